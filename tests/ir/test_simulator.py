"""The simulator and reference schedules through the bindings: hand-computed peaks, errors that
name the step and the op, and the Schedule JSON form."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hrockmate
from hrockmate import _native
from hrockmate.ir.graph import Graph, GraphError, Op, Tensor
from hrockmate.ir.schedule import (
    Schedule,
    ScheduleError,
    SimulationResult,
    recompute_all_schedule,
    simulate,
    store_all_schedule,
)


def example() -> Graph:
    """Hand-computed example (tensor ids in comments):
    f0: [x(0), w(1)] -> a(2) 1000 B, workspace 300
    f1: [a] -> v(3), a view of a
    f2: [v] -> b(4) 200 B, c(5) 30 B
    loss: [b] -> L(6) output 4 B
    loss_b: [tL(7) tangent, b] -> db(8) 200 B
    f2_b: [db, v] -> da(9) 1000 B
    f0_b: [da, x, w] -> dw(10) param_grad 50 B, dx(11) input_grad 100 B
    """
    g = Graph(name="example")
    for t in [
        Tensor("x", 100, "input"),
        Tensor("w", 50, "parameter"),
        Tensor("a", 1000),
        Tensor("v", 0, alias_of=2),
        Tensor("b", 200),
        Tensor("c", 30),
        Tensor("L", 4, "output"),
        Tensor("tL", 4, "tangent"),
        Tensor("db", 200),
        Tensor("da", 1000),
        Tensor("dw", 50, "param_grad", grad_of=1),
        Tensor("dx", 100, "input_grad", grad_of=0),
    ]:
        g.add_tensor(t)
    for o in [
        Op("f0", "forward", 1.0, [0, 1], [2], workspace=300),
        Op("f1", "forward", 1.0, [2], [3]),
        Op("f2", "forward", 1.0, [3], [4, 5]),
        Op("loss", "forward", 1.0, [4], [6]),
        Op("loss_b", "backward", 1.0, [7, 4], [8], differentiates=3),
        Op("f2_b", "backward", 1.0, [8, 3], [9], differentiates=2),
        Op("f0_b", "backward", 1.0, [9, 0, 1], [10, 11], differentiates=0),
    ]:
        g.add_op(o)
    return g


STORE_ALL = [
    ("compute", 0), ("compute", 1), ("free", 2), ("compute", 2), ("free", 5), ("compute", 3),
    ("compute", 4), ("free", 4), ("compute", 5), ("free", 8), ("free", 3),
    ("compute", 6), ("free", 9), ("free", 10), ("free", 11),
]  # fmt: skip


def test_store_all_hand_computed() -> None:
    g = example()
    s = store_all_schedule(g)
    assert s.steps == STORE_ALL and s.forward_len == 6
    r = simulate(g, s)
    assert isinstance(r, SimulationResult)
    assert r.timeline.dtype == np.int64
    assert r.timeline.tolist() == [1300, 1000, 1000, 1230, 1200, 1204, 1404, 1204, 2204, 2004, 1004, 1154, 154, 104, 4]
    assert (r.peak_bytes, r.peak_step, r.forward_peak, r.backward_peak) == (2204, 8, 1300, 2204)
    assert r.bytes_after_forward == 1204
    assert r.time == 7.0
    assert r.compute_count.tolist() == [1] * 7


def test_recompute_of_an_alive_output_is_a_temporary() -> None:
    g = example()
    steps = STORE_ALL[:6] + [("compute", 2), ("free", 5)] + STORE_ALL[6:]
    r = simulate(g, Schedule(steps, 6))
    # b (200) is alive, so its recomputed copy is dropped after the step; c (30) is new.
    assert r.timeline[6] == 1204 + 200 + 30
    assert r.timeline[7] == 1204
    assert r.compute_count[2] == 2 and r.time == 8.0


def test_recompute_all_is_valid_and_cheaper_in_memory() -> None:
    g = example()
    s = recompute_all_schedule(g)
    r = simulate(g, s)
    store = simulate(g, store_all_schedule(g))
    assert r.bytes_after_forward == 4  # only the loss survives the forward segment
    assert r.peak_bytes <= store.peak_bytes and r.time > store.time
    assert r.compute_count.tolist() == [3, 3, 2, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("steps", "forward_len", "step", "text"),
    [
        (STORE_ALL[:1] + [("compute", 2)], 2, 1, "compute op 2 'f2': input tensor 3 'v' is not alive"),
        (STORE_ALL[:3] + [("free", 3)] + STORE_ALL[3:], 7, 4, "input tensor 3 'v' is not alive (it was freed)"),
        (STORE_ALL, 7, 6, "compute op 4 'loss_b': a backward op cannot run in the forward segment"),
        (STORE_ALL[:7] + [("compute", 4)] + STORE_ALL[7:], 6, 7, "op 4 'loss_b': backward ops run exactly once"),
        (STORE_ALL[:6] + [("free", 6)] + STORE_ALL[6:], 6, 6, "free tensor 6 'L': its role 'output' cannot be freed"),
        ([("free", 1)], 1, 0, "free tensor 1 'w': its role 'parameter' cannot be freed"),
        (STORE_ALL[:3] + [("free", 2)], 4, 3, "free tensor 2 'a': not alive (it was already freed)"),
        (STORE_ALL, 5, 5, "tensor 6 'L' is an 'output' but was not produced in the forward segment"),
        (STORE_ALL[:11], 6, 11, "backward op 6 'f0_b' never runs"),
        ([("compute", 9)], 1, 0, "op id 9 out of range"),
        ([("free", 99)], 1, 0, "tensor id 99 out of range"),
    ],
)
def test_schedule_errors_name_the_step_and_the_op(
    steps: list[tuple[str, int]], forward_len: int, step: int, text: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        simulate(example(), Schedule(steps, forward_len))
    assert info.value.step == step
    assert str(info.value).startswith(f"step {step}: ")
    assert text in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_required_result_is_reported_at_the_end() -> None:
    g = example()
    g.add_tensor(Tensor("bn", 8, "buffer"))
    g.add_tensor(Tensor("bn_new", 8, "buffer_update", updates=12))
    g.add_op(Op("stats", "forward", 1.0, [0, 12], [13], mutates_buffer=True))
    with pytest.raises(ScheduleError, match="tensor 13 'bn_new' \\('buffer_update'\\) is never produced") as info:
        simulate(g, Schedule(STORE_ALL, 6))
    assert info.value.step == len(STORE_ALL)
    # The reference schedules produce (and immediately write back) the update.
    s = store_all_schedule(g)
    assert ("free", 13) in s.steps
    assert simulate(g, s).compute_count[7] == 1


def test_invalid_graph_is_a_graph_error_with_names() -> None:
    g = example()
    g.ops[1].inputs = [8]  # f1 reads db, produced in backward
    with pytest.raises(GraphError, match="op 1 'f1': is a forward op but reads tensor 8 'db'"):
        simulate(g, Schedule(STORE_ALL, 6))
    with pytest.raises(GraphError, match="op 1 'f1'"):
        store_all_schedule(g)
    with pytest.raises(GraphError, match="op 1 'f1'"):
        recompute_all_schedule(g)


def test_bindings_directly() -> None:
    g = example()
    kinds, ids, forward_len = _native.store_all(**g.to_arrays())
    assert kinds.dtype == np.int8 and ids.dtype == np.int64 and forward_len == 6
    d = _native.simulate(kinds, ids, forward_len, **g.to_arrays())
    assert set(d) == {
        "peak_bytes", "time", "forward_peak", "backward_peak", "bytes_after_forward",
        "peak_step", "timeline", "compute_count",
    }  # fmt: skip
    assert d["peak_bytes"] == 2204
    with pytest.raises(ValueError, match=r"^step 1: compute op 2: input tensor 3 is not alive"):
        _native.simulate(kinds[[0, 3]], ids[[0, 3]], 2, **g.to_arrays())
    with pytest.raises(ValueError, match="step_kind': item 0 is 5"):
        _native.simulate(np.array([5], np.int8), np.array([0]), 1, **g.to_arrays())
    with pytest.raises(ValueError, match="forward_len"):
        _native.simulate(kinds, ids, len(kinds) + 1, **g.to_arrays())
    with pytest.raises(TypeError):
        _native.simulate(kinds.astype(np.int64), ids, forward_len, **g.to_arrays())


# ---- Schedule objects ------------------------------------------------------------------------

def test_schedule_json_round_trip(tmp_path: Path) -> None:
    s = Schedule(STORE_ALL, 6)
    d = s.to_dict()
    assert d["format"] == "hrockmate-schedule" and d["version"] == 1
    assert Schedule.from_json(s.to_json()) == s
    path = tmp_path / "plan" / "s.json"
    s.save(path)
    assert Schedule.load(path) == s
    assert json.loads(path.read_text())["steps"][0] == ["compute", 0]
    arrays = s.to_arrays()
    assert Schedule.from_arrays(arrays["step_kind"], arrays["step_id"], arrays["forward_len"]) == s
    assert len(s) == 15 and s.forward_steps == STORE_ALL[:6] and s.backward_steps == STORE_ALL[6:]
    lines = s.describe(example())
    assert lines[:2] == ["compute f0", "compute f1"] and lines[6] == "-- backward --"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{", "invalid JSON at line 1"),
        ('{"format": "x", "version": 1, "forward_len": 0, "steps": []}', "field 'format'"),
        ('{"format": "hrockmate-schedule", "version": 3, "forward_len": 0, "steps": []}', "unsupported version 3"),
        ('{"format": "hrockmate-schedule", "version": 1, "forward_len": 2, "steps": [["compute", 0]]}', "forward_len"),
        ('{"format": "hrockmate-schedule", "version": 1, "forward_len": 0, "steps": [["run", 0]]}', "step 0: expected"),
        ('{"format": "hrockmate-schedule", "version": 1, "forward_len": 0, "steps": [], "x": 1}', "field 'x': unknown field"),
    ],
)
def test_schedule_json_errors(text: str, expected: str) -> None:
    with pytest.raises(ValueError) as info:
        Schedule.from_json(text)
    assert expected in str(info.value)


def test_schedule_constructor_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step 1: kind must be 'compute' or 'free'"):
        Schedule([("compute", 0), ("drop", 1)], 0)
    with pytest.raises(ValueError, match="step 0: id must be an integer >= 0"):
        Schedule([("free", -1)], 0)
    with pytest.raises(ValueError, match="step 0: expected a \\(kind, id\\) pair"):
        Schedule([("compute",)], 0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="forward_len 3 must be between 0 and the number of steps"):
        Schedule([("compute", 0)], 3)
    # the bulk check of plain (kind, int) tuples lets none of these through either
    with pytest.raises(ValueError, match="step 1: id must be an integer >= 0, got True"):
        Schedule([("compute", 0), ("free", True)], 0)
    with pytest.raises(ValueError, match="step 0: id 9223372036854775808 is out of range"):
        Schedule([("free", 2**63)], 0)
    with pytest.raises(ValueError, match="step 0: kind must be 'compute' or 'free', got \\['c'\\]"):
        Schedule([(["c"], 0)], 0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="step 0: kind must be 'compute' or 'free', got 'a'"):
        Schedule(["ab"], 0)  # type: ignore[list-item]
    # lists, numpy ids and tuples come out as (str, int) tuples, and a copy of the input
    given = [["compute", np.int64(0)], ("free", 1)]
    s = Schedule(given, 1)  # type: ignore[arg-type]
    assert s.steps == [("compute", 0), ("free", 1)] and type(s.steps[0][1]) is int
    plain = [("compute", 0), ("free", 1)]
    s = Schedule(plain, 1)
    assert s.steps == plain and s.steps is not plain
    with pytest.raises(ValueError, match="step_kind item 1 is 2"):
        Schedule.from_arrays(np.array([0, 2], np.int8), np.array([0, 0]), 0)
    with pytest.raises(ValueError, match="cannot read schedule file"):
        Schedule.load(tmp_path / "missing.json")


def test_public_exports() -> None:
    assert hrockmate.Schedule is Schedule and hrockmate.ScheduleError is ScheduleError
    assert hrockmate.simulate is simulate and hrockmate.SimulationResult is SimulationResult
    assert hrockmate.store_all_schedule is store_all_schedule
    assert hrockmate.recompute_all_schedule is recompute_all_schedule
