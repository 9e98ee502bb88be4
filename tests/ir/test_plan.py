"""Plans: save/load round trip, corrupt files, plans for another graph, infeasible budgets."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from graph_builders import training_graph

import hrockmate
from hrockmate.ir.plan import InfeasibleBudget, Plan, PlanError, load_plan
from hrockmate.planning import strategies

try:
    import fcntl
except ImportError:
    fcntl = None  # type: ignore[assignment]


@pytest.fixture(scope="module")
def plan_and_graph() -> tuple[Plan, hrockmate.Graph]:
    g = training_graph(6, 1)
    base = hrockmate.simulate(g, hrockmate.store_all_schedule(g)).peak_bytes
    steps, fl, _, _ = strategies.min_peak_checkmate(g)
    low = hrockmate.simulate(g, hrockmate.Schedule(steps, fl)).peak_bytes
    assert low < base
    return hrockmate.solve_graph(g, (low + base) // 2, progress=False), g


def test_round_trip(tmp_path: Path, plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, g = plan_and_graph
    path = tmp_path / "sub" / "plan.json"
    plan.save(path)
    again = load_plan(path, graph=g)
    assert again == plan
    assert again.schedule == plan.schedule
    assert again.stats["optimal"] == plan.stats["optimal"]
    # no temporary files left behind by the atomic write
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]


def test_plan_fields(plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, g = plan_and_graph
    assert plan.graph_hash == g.structure_hash()
    assert plan.peak_bytes <= plan.budget_bytes < plan.baseline_peak_bytes
    assert plan.time >= plan.baseline_time
    sim = hrockmate.simulate(g, plan.schedule)
    assert (sim.peak_bytes, sim.time) == (plan.peak_bytes, pytest.approx(plan.time))
    assert 0 < plan.memory_ratio < 1
    assert plan.overhead == pytest.approx(plan.time / plan.baseline_time - 1)
    assert "plan for" in plan.summary() and plan.method in plan.summary()
    assert plan.made_by == plan.method  # (no fallback)


def test_saved_file_is_versioned_json(tmp_path: Path,
                                      plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, _ = plan_and_graph
    path = tmp_path / "p.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "hrockmate-plan" and data["version"] == 1
    assert data["schedule"]["format"] == "hrockmate-schedule"
    assert len(data["schedule"]["steps"]) == len(plan.steps)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "not an hrockmate plan"),
        ('{"format": "something-else"}', "not an hrockmate plan"),
        ('{"format": "hrockmate-plan", "version": 99}', "version 99"),
        ('{"format": "hrockmate-plan", "version": 1}', "corrupt"),
    ],
)
def test_corrupt_files(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


def test_truncated_and_tampered_files(tmp_path: Path,
                                      plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, _ = plan_and_graph
    path = tmp_path / "p.json"
    plan.save(path)
    full = path.read_text()
    path.write_text(full[: len(full) // 2])
    with pytest.raises(PlanError, match="corrupt"):
        load_plan(path)
    data = json.loads(full)
    data["schedule"]["steps"][0] = ["jump", 3]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="step 0 is malformed"):
        load_plan(path)
    data = json.loads(full)
    data["schedule"]["forward_len"] = 10**6
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="forward_len"):
        load_plan(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read plan file"):
        load_plan(tmp_path / "nope.json")


def test_plan_for_another_graph(tmp_path: Path,
                                plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, _ = plan_and_graph
    other = training_graph(7, 2)
    path = tmp_path / "p.json"
    plan.save(path)
    with pytest.raises(PlanError) as info:
        load_plan(path, graph=other)
    msg = str(info.value)
    assert plan.graph_hash in msg and other.structure_hash() in msg and "solve again" in msg


def test_infeasible_budget_message_states_minimum() -> None:
    err = InfeasibleBudget(1000, 4096, "g")
    assert err.min_bytes == 4096 and err.budget_bytes == 1000
    assert "4096 bytes" in str(err) and "'g'" in str(err) and "at least 4096" in str(err)
    assert isinstance(err, ValueError)
    # a peak the methods reached is not called the least possible; a proven bound is
    assert "lowest peak reached" in str(err) and "smallest feasible" not in str(err)
    bound = InfeasibleBudget(1000, 4096, "g", why="op 'x' alone needs that much")
    assert "smallest feasible peak" in str(bound) and "op 'x' alone" in str(bound)


# ---- every bad plan file is a PlanError naming the file and the problem ------------------------

def _edited(plan: Plan, edit: Any) -> str:
    data = plan.to_dict()
    edit(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda full: b"\xff" + full.encode(), "not UTF-8 text (byte 0xff at offset 0)"),
        (lambda full: "[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (lambda full: full.replace('"time": ', '"time": 1e400, "x": ', 1), "1e400 is out of range"),
        (lambda full: full.replace('"peak_bytes": ', '"peak_bytes": ' + "9" * 5000 + ", \"x\": ",
                                   1), "5000 digits is out of range"),
        (lambda full: full.replace('"time": ', '"time": NaN, "x": ', 1), "NaN is not a number"),
    ],
)
def test_unreadable_files_are_plan_errors(tmp_path: Path, make: Any, fragment: str,
                                          plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, _ = plan_and_graph
    path = tmp_path / "bad.plan.json"
    content = make(json.dumps(plan.to_dict()))
    if isinstance(content, str):
        path.write_text(content)
    else:
        path.write_bytes(content)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (lambda d: d["schedule"].update(forward_len="39"),
         "field 'forward_len': expected an integer >= 0, got a string \"39\""),
        (lambda d: d["schedule"].update(forward_len=39.7),
         "field 'forward_len': expected an integer >= 0, got a number 39.7"),
        (lambda d: d.update(version=1.0), "plan version 1.0"),
        (lambda d: d.update(time=float("nan")), "NaN is not a number"),
        (lambda d: d.update(baseline_time=-1.0), "field 'baseline_time': expected a finite number"),
        (lambda d: d.update(budget_bytes=True), "field 'budget_bytes': expected an integer >= 0, "
                                                "got a boolean true"),
        (lambda d: d.update(peak_bytes=-5), "field 'peak_bytes': expected an integer >= 0"),
        (lambda d: d.update(graph_hash=123), "field 'graph_hash': expected a string"),
        (lambda d: d.update(stats=[1]), "field 'stats': expected an object"),
        (lambda d: d.update(comment="hi"), "field 'comment': unknown field"),
        (lambda d: d.pop("baseline_peak_bytes"), "field 'baseline_peak_bytes' is missing"),
        (lambda d: d["schedule"]["steps"].__setitem__(1, ["compute", 2.0]), "step 1 is malformed"),
        (lambda d: d["schedule"]["steps"].__setitem__(1, ["compute", True]), "step 1 is malformed"),
        (lambda d: d["schedule"].update(version=2), "not an hrockmate-schedule version 1"),
    ],
)
def test_fields_are_checked_strictly(tmp_path: Path, edit: Any, fragment: str,
                                     plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, _ = plan_and_graph
    path = tmp_path / "bad.plan.json"
    path.write_text(_edited(plan, edit))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert fragment in str(info.value) and str(path) in str(info.value)


# ---- what cut a solve short ------------------------------------------------------------------

def test_shortfall_says_what_happened(plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, _ = plan_and_graph

    def with_stats(**stats: Any) -> Plan:
        return dataclasses.replace(plan, stats={"method": "hrockmate", **stats})

    assert with_stats(optimal=True, status="Optimal").shortfall(300.0) is None
    # not proven optimal, but nothing was cut short: no warning
    assert with_stats(optimal=False, top_solver="rotor").shortfall(300.0) is None
    assert with_stats(optimal=False, fallback="checkpoint",
                      beats_hierarchy_plan=True).shortfall(300.0) is None
    timed_out = with_stats(optimal=False, status="Time limit reached").shortfall(30.0)
    assert timed_out is not None and "stopped at its time limit (30 s)" in timed_out
    assert "fell back" not in timed_out and "fallback" not in timed_out
    # a MILP given a share of the limit (a later leaf size, the top level) says which
    share = with_stats(optimal=False, status="Time limit reached",
                       time_limit=7.25).shortfall(60.0)
    assert share is not None and "end of its share (7.25 s of the solve's 60 s)" in share
    fell_back = with_stats(optimal=False, fallback="recompute-all").shortfall(300.0)
    assert fell_back is not None and "found no schedule within the budget" in fell_back
    assert "recompute-all schedule is used" in fell_back and "time limit" not in fell_back


# ---- temporary files left by a killed save ---------------------------------------------------

_KILLED_SAVE = """
import os, signal, sys
import hrockmate.ir.graph as graph_module
from hrockmate.ir.plan import load_plan

plan = load_plan(sys.argv[1])
def die(fd):  # SIGKILL in the middle of Plan.save, after the temporary file is written
    os.kill(os.getpid(), signal.SIGKILL)
graph_module.os.fsync = die
plan.save(sys.argv[2])
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_save_removes_temporary_files_of_a_killed_save(
        tmp_path: Path, plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, g = plan_and_graph
    source, target = tmp_path / "source.json", tmp_path / "plan.json"
    plan.save(source)
    left = []
    for _ in range(2):  # each killed save also removes what the one before it left
        run = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(source), str(target)])
        assert run.returncode == -signal.SIGKILL
        left = sorted(tmp_path.glob(".plan.json.*.tmp"))
        assert len(left) == 1 and not target.exists()
    # files that are not our temporary files for this target stay
    keep = [tmp_path / ".plan.json.mine.tmp", tmp_path / ".other.json.abcd1234.tmp",
            tmp_path / ".plan.json.abcd1234.tmp.bak", tmp_path / "plan.json.abcd1234.tmp"]
    for p in keep:
        p.write_text("x")
    plan.save(target)
    assert load_plan(target, graph=g) == plan
    assert not left[0].exists() and all(p.exists() for p in keep)


@pytest.mark.skipif(fcntl is None, reason="needs advisory file locks")
def test_save_leaves_a_concurrent_writers_temporary_file(
        tmp_path: Path, plan_and_graph: tuple[Plan, hrockmate.Graph]) -> None:
    plan, _ = plan_and_graph
    target = tmp_path / "plan.json"
    busy = tmp_path / ".plan.json.0a1b2c3d.tmp"
    busy.write_text("being written")
    with open(busy) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # as a live writer holds it
        plan.save(target)
        assert busy.exists()
    plan.save(target)
    assert not busy.exists()
