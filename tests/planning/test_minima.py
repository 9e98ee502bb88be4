"""The least budget an ``InfeasibleBudget`` names is one that plans: the lowest-peak schedule
found is kept with its peak (``planning.minima``), the same for every budget refused, and the
runtime adds the bytes its compiled program keeps beside the graph's tensors."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from graph_builders import training_graph

import hrockmate
from hrockmate import InfeasibleBudget
from hrockmate.ir.schedule import peak_lower_bound, simulate, store_all_schedule
from hrockmate.planning import minima

# flat_ops=0 and tiny leaves: a multi-level hierarchy on a small graph, whose refusals come
# from the heuristics' lowest peaks rather than the exact MILP's
HIER = dict(flat_ops=0, leaf_size=2, group_size=2, top_size=2, progress=False, time_limit=20)


@pytest.fixture(autouse=True)
def _fresh_minima() -> None:
    minima.clear_cache()


def _refused(graph: Any, budget: int, **options: Any) -> InfeasibleBudget:
    with pytest.raises(InfeasibleBudget) as info:
        hrockmate.solve_graph(graph, budget, **options)
    return info.value


def test_a_refused_graph_budget_names_one_that_plans(data_graphs: Path) -> None:
    graph = hrockmate.Graph.load(data_graphs / "cnn_bn_oplog.json")
    floor, _ = peak_lower_bound(graph)
    exc = _refused(graph, floor, progress=False, time_limit=20)
    assert exc.min_bytes > floor and not exc.why
    plan = hrockmate.solve_graph(graph, exc.min_bytes, progress=False, time_limit=20)
    assert plan.peak_bytes <= exc.min_bytes
    assert hrockmate.simulate(graph, plan.schedule).peak_bytes == plan.peak_bytes


def test_two_refused_budgets_name_the_same_least_peak_computed_once(monkeypatch) -> None:
    graph = training_graph(9, 2)
    floor, _ = peak_lower_bound(graph)
    calls: list[int] = []
    compute = minima._compute

    def counted(*args: Any) -> Any:
        calls.append(1)
        return compute(*args)

    monkeypatch.setattr(minima, "_compute", counted)
    low = _refused(graph, floor, **HIER)
    least = minima.least_peak(graph, flat_ops=0)
    assert low.min_bytes == least.peak > floor
    higher = _refused(graph, (floor + least.peak) // 2, **HIER)
    assert higher.min_bytes == low.min_bytes and len(calls) == 1
    # and the number plans, with the hierarchy's own search or the schedule kept for it
    plan = hrockmate.solve_graph(graph, low.min_bytes, **HIER)
    assert plan.peak_bytes <= low.min_bytes


def test_the_message_says_whether_the_least_peak_is_proven() -> None:
    # an op-level graph: the exact MILP proves its lowest peak
    small = training_graph(6, 8)
    floor, _ = peak_lower_bound(small)
    exact = _refused(small, floor, progress=False)
    assert exact.proven_minimum and exact.proof and not exact.why
    assert "proven the least possible" in str(exact) and "not proven" not in str(exact)
    assert f"give a budget of at least {exact.min_bytes} bytes" in str(exact)
    assert hrockmate.solve_graph(small, exact.min_bytes, progress=False).peak_bytes \
        <= exact.min_bytes
    # the hierarchy's heuristics: the least peak found, not proven minimal
    graph = training_graph(9, 2)
    found = _refused(graph, peak_lower_bound(graph)[0], **HIER)
    assert not found.proven_minimum and "the least found (not proven minimal)" in str(found)
    # below the graph's floor: a proven floor, named as one
    far = _refused(graph, 2, **HIER)
    assert far.proven_minimum and far.why and "(a proven floor)" in str(far)


def test_the_error_texts_name_floor_least_found_and_proven_least() -> None:
    found = InfeasibleBudget(100, 300, "g")
    proven = InfeasibleBudget(100, 300, "g", proof="the MILP proved it")
    floor = InfeasibleBudget(100, 250, "g", why="op 'x' alone needs that much")
    assert not found.proven_minimum and "not proven minimal" in found.reason
    assert proven.proven_minimum and "proven the least possible: the MILP proved it" in str(proven)
    assert floor.proven_minimum and floor.proof == "" and "(a proven floor)" in str(floor)
    for exc in (found, proven):
        assert str(exc).endswith(f"give a budget of at least {exc.min_bytes} bytes")
    assert str(floor).endswith("give a budget of at least 250 bytes (a schedule may need more)")


class _Program:
    def __init__(self, extra_bytes: int) -> None:
        self.extra_bytes = extra_bytes
        self.possible_extra_bytes = 0


def test_the_runtime_names_a_least_budget_with_its_compiled_bytes() -> None:
    """A plan that recomputes more keeps more beside the graph's tensors (generator states of
    the random ops it replays): the number named includes the lowest-peak schedule's own
    bytes, so a build at exactly that number fits as compiled."""
    from hrockmate.planning.entry import solve_within_budget

    graph = training_graph(12, seed=3)
    store_all = store_all_schedule(graph)
    reserve = 64

    def compile_fn(schedule: Any) -> _Program:
        # 16 bytes per step beyond store-all's: a stand-in for replayed random ops' states
        return _Program(reserve + 16 * max(0, len(schedule.steps) - len(store_all.steps)))

    options = {"time_limit": 10, "progress": False}
    floor, _ = peak_lower_bound(graph)
    refusals = []
    for budget in (floor + reserve, floor + reserve + 50):
        with pytest.raises(InfeasibleBudget) as info:
            solve_within_budget(graph, budget, options, compile_fn, reserve_bytes=reserve)
        refusals.append(info.value.min_bytes)
    least = refusals[0]
    assert refusals[1] == least > floor + reserve
    plan, peak, program = solve_within_budget(graph, least, options, compile_fn,
                                              reserve_bytes=reserve)
    assert peak + program.extra_bytes <= least
    assert simulate(graph, plan.schedule).peak_bytes == peak


def _dropout_mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(32, 4)), torch.randn(16, 32)


def test_hrockmate_builds_at_the_least_budget_it_names(caplog) -> None:
    """On a model with random ops (whose replays keep generator states), a refused budget
    names a least budget at which ``HRockmate`` builds and predicts a peak within it; another
    refused budget names the same one."""
    from hrockmate import HRockmate

    model, x = _dropout_mlp()
    kw = dict(cache=False, progress=False, cost="estimate", time_limit=10)
    store_all = HRockmate(model, x, budget=1.0, **kw)
    # the lowest budgets past the floor check: the graph's floor with store-all's runtime bytes
    floor = peak_lower_bound(store_all._hr_traced.graph)[0] + store_all._hr_program.extra_bytes
    refusals = []
    for budget in (floor, floor + 1024):
        with pytest.raises(InfeasibleBudget) as info:
            HRockmate(model, x, budget=budget, **kw)
        assert not info.value.why
        refusals.append(info.value.min_bytes)
    assert refusals[0] == refusals[1]
    with caplog.at_level(logging.WARNING, logger="hrockmate"):
        built = HRockmate(model, x, budget=refusals[0], **kw)
    assert built.predicted_peak_bytes <= refusals[0]
