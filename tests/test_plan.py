"""Plans: save/load round trip, corrupt files, plans for another graph, infeasible budgets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_ilp import training_graph

import hrockmate
from hrockmate import solvers
from hrockmate.plan import InfeasibleBudget, Plan, PlanError, load_plan


@pytest.fixture(scope="module")
def plan_and_graph() -> tuple[Plan, hrockmate.Graph]:
    g = training_graph(6, 1)
    base = hrockmate.simulate(g, hrockmate.store_all_schedule(g)).peak_bytes
    steps, fl, _, _ = solvers.min_peak_checkmate(g)
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
