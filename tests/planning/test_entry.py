"""The runtime's planning entry: plans that fit the budget with the runtime's own bytes."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import hrockmate
from hrockmate.ir.graph import Graph
from hrockmate.ir.plan import InfeasibleBudget, Plan
from hrockmate.planning import entry


@dataclass
class _Program:
    extra_bytes: int
    possible_extra_bytes: int = 0


def _describe(graph: Any, schedule: Any, sim: Any, base: Any, budget_bytes: int,
              method: str) -> Plan:
    return Plan(graph.structure_hash(), graph.name, int(budget_bytes), int(sim.peak_bytes),
                float(sim.time), int(base.peak_bytes), float(base.time), list(schedule.steps),
                int(schedule.forward_len), graph.time_unit, {"method": method})


def test_planning_never_imports_the_runtime() -> None:
    for path in Path(entry.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in names if m and m.startswith("hrockmate.runtime")}, path.name


def test_the_plan_fits_with_the_bytes_the_compiled_program_adds(data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "resnet_like_train.json")
    base = hrockmate.simulate(g, hrockmate.store_all_schedule(g)).peak_bytes
    extra = base // 50
    compiled: list[Any] = []

    def compile_fn(schedule: Any) -> _Program:
        compiled.append(schedule)
        return _Program(extra)

    traced = SimpleNamespace(graph=g, device=None)
    budget = int(0.6 * base)
    schedule, plan, peak, program = entry.plan_for_runtime(
        None, None, traced, budget, None, {"cost": "estimate", "progress": False,
                                           "time_limit": 30},
        compile_fn, describe=_describe, cache=False)
    assert peak + program.extra_bytes <= budget
    assert hrockmate.simulate(g, schedule).peak_bytes == peak == plan.peak_bytes
    # the first round solved for the budget less store-all's extra bytes
    assert plan.budget_bytes <= budget - extra
    assert len(compiled) >= 2  # store-all's program, then the plan's


def test_a_given_schedule_is_described_not_solved(data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "vgg_like_train.json")
    sched = hrockmate.recompute_all_schedule(g)
    traced = SimpleNamespace(graph=g, device=None)
    _, plan, peak, _ = entry.plan_for_runtime(None, None, traced, None, sched, {},
                                              lambda s: _Program(0), describe=_describe)
    assert plan.stats["method"] == "given"
    assert peak == hrockmate.simulate(g, sched).peak_bytes


def test_a_budget_below_the_floor_names_the_runtime_bytes(data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "vgg_like_train.json")
    traced = SimpleNamespace(graph=g, device=None)
    with pytest.raises(InfeasibleBudget, match="the runtime keeps") as info:
        entry.plan_for_runtime(None, None, traced, 1000, None, {"cost": "estimate"},
                               lambda s: _Program(64), describe=_describe, cache=False)
    assert info.value.min_bytes > 1000 and info.value.why
