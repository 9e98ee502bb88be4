"""The cost model: per-op times (measured or estimated), signature caching, workspaces."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from hrockmate import models
from hrockmate.capture.costs import annotate_costs, estimate_time, op_signature
from hrockmate.capture.joint import placeholder_values, run_joint
from hrockmate.capture.trace import trace_model

SCRATCH_BYTES = 4000


@torch.library.custom_op("hrockmate_test::scratch_double", mutates_args=())
def _scratch_double(x: torch.Tensor) -> torch.Tensor:
    scratch = torch.empty(SCRATCH_BYTES // 4)  # a temporary alive while the output is made
    out = torch.add(x, x)
    del scratch
    return out


@_scratch_double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _WithScratch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(_scratch_double(x))


def _repeated_mlp() -> tuple[nn.Module, torch.Tensor]:
    return models.mlp(batch=4, d_in=16, hidden=16, n_layers=4, d_out=16)


def test_workspace_is_the_temporary_memory_beyond_outputs() -> None:
    model, x = _WithScratch(), torch.randn(4, 8)
    traced = trace_model(model, x, cost="estimate")
    g = traced.graph
    (op,) = [o for o in g.ops if o.target == "hrockmate_test.scratch_double.default"]
    assert op.workspace == SCRATCH_BYTES
    assert g.tensors[op.outputs[0]].bytes == 4 * 8 * 4
    for o in g.ops:
        if all(g.tensors[t].alias_of is not None for t in o.outputs):
            assert o.workspace == 0, f"view op {o.name} has workspace {o.workspace}"


def test_estimate_scales_with_flops_and_bytes() -> None:
    model, x = _repeated_mlp()
    traced = trace_model(model, x, cost="estimate")
    g = traced.graph
    assert all(op.time > 0 for op in g.ops)
    addmm = max(op.time for op in g.ops if op.target == "aten.addmm.default")
    view = max(op.time for op in g.ops if op.target == "aten.t.default")
    assert addmm > view
    big, _ = models.mlp(batch=64, d_in=16, hidden=256, n_layers=1, d_out=16)
    big_traced = trace_model(big, torch.randn(64, 16), cost="none")
    node = next(n for n in big_traced.op_nodes if str(n.target) == "aten.mm.default")
    small = next(n for n in traced.op_nodes if str(n.target) == "aten.mm.default")
    assert estimate_time(node, "cpu") > estimate_time(small, "cpu")
    assert estimate_time(node, "cuda") < estimate_time(node, "cpu")


def test_repeated_layers_are_measured_once() -> None:
    model, x = _repeated_mlp()
    traced = trace_model(model, x, cost="none")
    report = annotate_costs(traced, model, x, mode="measure")
    g = traced.graph
    sigs = [op_signature(n) for n in traced.op_nodes]
    assert report.signatures == len(set(sigs)) < len(sigs)
    assert report.measured == report.signatures and report.estimated == 0
    by_sig: dict[object, float] = {}
    for sig, op in zip(sigs, g.ops):
        assert op.time > 0
        assert by_sig.setdefault(sig, op.time) == op.time
    # the hidden layers' addmm ops are identical, so they share one signature
    addmm_sigs = {s for s, op in zip(sigs, g.ops) if op.target == "aten.addmm.default"}
    n_addmm = sum(op.target == "aten.addmm.default" for op in g.ops)
    assert len(addmm_sigs) < n_addmm


def test_signature_distinguishes_shapes_and_arguments() -> None:
    # addmm shapes: 16->32, 32->32, 32->32, 32->8: three distinct signatures among four ops
    model, x = models.mlp(batch=4, d_in=16, hidden=32, n_layers=3, d_out=8)
    traced = trace_model(model, x, cost="none")
    addmms = [n for n in traced.op_nodes if str(n.target) == "aten.addmm.default"]
    assert len(addmms) == 4
    sigs = [op_signature(n) for n in addmms]
    assert len(set(sigs)) == 3 and sigs[1] == sigs[2]
    # same op and tensor arguments but different non-tensor arguments: different signatures
    gpt, sample = models.gpt2_tiny(n_layer=1)
    nodes = trace_model(gpt, sample, cost="none").op_nodes
    by_tensors: dict[object, list[object]] = {}
    for n in nodes:
        tensor_meta = tuple(
            (tuple(a.meta["val"].shape), a.meta["val"].dtype) for a in n.all_input_nodes
        )
        by_tensors.setdefault((str(n.target), tensor_meta), []).append(n)
    def constants(n: Any) -> str:
        return repr(fx.node.map_arg((n.args, n.kwargs), lambda _: "T"))

    pairs = [
        (a, b) for group in by_tensors.values() for a in group for b in group
        if a is not b and constants(a) != constants(b)
    ]
    assert pairs
    assert all(op_signature(a) != op_signature(b) for a, b in pairs)  # type: ignore[arg-type]


def test_measurement_time_budget_falls_back_to_estimates() -> None:
    model, x = _repeated_mlp()
    traced = trace_model(model, x, cost="none")
    report = annotate_costs(traced, model, x, mode="measure", budget_s=0.0)
    assert report.measured == 0 and report.estimated == report.signatures
    assert all(op.time > 0 for op in traced.graph.ops)


def test_measured_times_rank_big_matmul_above_tiny_elementwise() -> None:
    model = nn.Sequential(nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 2), nn.Tanh())
    x = torch.randn(384, 384)
    traced = trace_model(model, x, cost="measure")
    g = traced.graph
    big = next(op.time for op in g.ops if op.target == "aten.addmm.default")
    tiny = next(op.time for op in g.ops if op.target == "aten.tanh.default")
    assert big > tiny
    assert traced.cost_seconds > 0  # (recorded on the trace)


def test_costs_need_a_known_mode() -> None:
    model, x = models.mlp(n_layers=1)
    traced = trace_model(model, x, cost="none")
    with pytest.raises(ValueError, match="cost mode"):
        annotate_costs(traced, model, x, mode="guess")
    assert all(op.time == 0 and op.workspace == 0 for op in traced.graph.ops)


class _LSTMOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]


def test_real_run_corrects_sizes_fake_kernels_get_wrong() -> None:
    model, x = _LSTMOut(), torch.randn(2, 5, 8)
    traced = trace_model(model, x, cost="estimate")
    g = traced.graph
    g.validate()
    if torch.backends.mkldnn.is_available():
        # oneDNN's LSTM layer: the meta kernel reports an empty workspace, the real one is not
        assert g.meta["cost_report"]["resized"] >= 1
    mismatches: list[str] = []

    def check(op_id: int, node: Any, args: Any, kwargs: Any) -> Any:
        out = node.target(*args, **kwargs)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        for tid in g.ops[op_id].outputs:
            t = g.tensors[tid]
            index = traced.tensor_nodes[tid][1]
            real = outs[0] if index is None else outs[index]
            if t.alias_of is None and t.bytes != real.untyped_storage().nbytes():
                mismatches.append(f"{t.name}: IR {t.bytes} real {real.untyped_storage().nbytes()}")
        return out

    run_joint(traced, placeholder_values(traced, model, x), keep=set(), on_op=check)
    assert mismatches == []


def test_each_step_costs_its_op_as_measured_in_sequence(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """An op's time is its fastest call plus what its calls in sequence took beyond that; a
    schedule that runs one more step predicts that op's whole time more."""
    from hrockmate.capture import costs
    from hrockmate.ir.schedule import Schedule, simulate, store_all_schedule

    hot, extra = 1e-6, 3e-6
    monkeypatch.setattr(costs, "_time_op", lambda *a, **k: hot)
    monkeypatch.setattr(costs, "in_sequence_extra",
                        lambda traced, values, sigs, fastest: {s: extra for s in fastest})
    model, x = _repeated_mlp()
    traced = trace_model(model, x, cost="none")
    report = annotate_costs(traced, model, x, mode="measure")
    g = traced.graph
    assert report.step_seconds == pytest.approx(extra)
    assert g.meta["cost_report"]["step_seconds"] == pytest.approx(extra)
    grid = 2 ** (1 / 16)  # (half a step of the rounding grid)
    assert all((hot + extra) / grid <= op.time <= (hot + extra) * grid for op in g.ops)

    base = store_all_schedule(g)
    steps = list(base.steps)
    k = next(k for k, op in enumerate(g.ops) if op.phase == "forward"
             and all(g.tensors[t].role not in ("output", "input") for t in op.outputs))
    at = steps.index(("compute", k)) + 1
    steps[at:at] = [("free", t) for t in g.ops[k].outputs] + [("compute", k)]
    more = Schedule(steps, base.forward_len + len(g.ops[k].outputs) + 1)
    added = simulate(g, more).time - simulate(g, base).time
    assert added == pytest.approx(g.ops[k].time)
    assert added >= (hot + extra) / grid


def test_calls_in_sequence_cost_more_than_in_a_loop() -> None:
    """What an op's calls in sequence take beyond its fastest call in a loop: never negative,
    positive on average (fresh arguments and memory), and bounded by the calls themselves."""
    from hrockmate.capture import costs

    model, x = _repeated_mlp()
    traced = trace_model(model, x, cost="measure")
    report = traced.graph.meta["cost_report"]
    mean_time = sum(op.time for op in traced.graph.ops) / traced.graph.num_ops
    assert 0 < report["step_seconds"] < 1.1 * mean_time
    sigs = [op_signature(n) for n in traced.op_nodes]
    values = placeholder_values(traced, model, x)
    extra = costs.in_sequence_extra(traced, values, sigs, {s: 0.0 for s in sigs})
    assert set(extra) == set(sigs)
    assert all(0 <= e < 1.0 for e in extra.values())  # (seconds: the calls' own medians)
