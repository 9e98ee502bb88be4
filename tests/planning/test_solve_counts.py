"""How much work a solve does, counted rather than timed: repeated layers solved once, the
least peak's greedy ladder refined once at most, recompute-all built once per refusal."""

from __future__ import annotations

from typing import Any

import pytest
from graph_builders import training_graph

import hrockmate
from hrockmate import InfeasibleBudget
from hrockmate.ir import schedule as schedule_mod
from hrockmate.ir.schedule import peak_lower_bound, simulate, store_all_schedule
from hrockmate.planning import hierarchy as hierarchy_mod
from hrockmate.planning import minima
from hrockmate.planning import refine as refine_mod
from hrockmate.planning import strategies

# a multi-level hierarchy on a small graph (as in test_minima): its refusals run the search
HIER = dict(flat_ops=0, leaf_size=2, group_size=2, top_size=2, progress=False, time_limit=20)


@pytest.fixture(autouse=True)
def _fresh_minima() -> None:
    minima.clear_cache()


def _counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_blocks_solved_do_not_grow_with_the_number_of_repeated_layers(monkeypatch) -> None:
    from hrockmate import models

    solved = {}
    for layers in (4, 8):
        model, sample = models.gpt2_tiny(n_layer=layers)
        g = hrockmate.trace(model, sample, cost="estimate")
        calls = _counting(monkeypatch, hierarchy_mod, "_block_options")
        h = hierarchy_mod.prepare(g, flat_ops=0, progress=False)
        monkeypatch.undo()
        assert len(calls) == h.solved_blocks
        solved[layers] = (h.solved_blocks, h.blocks)
    # twice the layers, about twice the blocks, and no more of them solved
    assert solved[8][1] > 1.5 * solved[4][1]
    assert solved[8][0] == solved[4][0]


def test_the_least_peak_refines_one_greedy_schedule_at_most(monkeypatch, data_graphs) -> None:
    # a U-Net whose every rung of the ladder finds a schedule, the lowest of them the least
    graph = hrockmate.Graph.load(data_graphs / "unet_tiny_oplog.json")
    calls = _counting(monkeypatch, refine_mod, "refine")
    least = minima.least_peak(graph, flat_ops=0)
    greedy = [s for s in least.schedules if s[2].startswith("greedy eviction")]
    assert len(greedy) == len(minima.GREEDY_LADDER)
    assert least.label.startswith("greedy eviction")
    assert len(calls) == 1
    monkeypatch.undo()
    # and the peak is no higher than each rung of the ladder refined, as it was once computed
    floor, _ = peak_lower_bound(graph)
    base = simulate(graph, store_all_schedule(graph)).peak_bytes
    for share in minima.GREEDY_LADDER:
        found = strategies.greedy_eviction_schedule(graph, int(floor + share * (base - floor)))
        if found is not None:
            peak = simulate(graph, schedule_mod.Schedule(*found)).peak_bytes
            assert least.peak <= peak
    # every schedule kept is valid and has the peak recorded for it
    for peak, time, _label, steps, fl in least.schedules:
        res = simulate(graph, schedule_mod.Schedule(list(steps), fl))
        assert (res.peak_bytes, res.time) == (peak, pytest.approx(time))


def test_a_refusal_builds_recompute_all_once(monkeypatch) -> None:
    graph = training_graph(9, 2)
    floor, _ = peak_lower_bound(graph)
    calls = _counting(monkeypatch, schedule_mod, "recompute_all_schedule")
    with pytest.raises(InfeasibleBudget) as info:
        hrockmate.solve_graph(graph, floor, **HIER)
    assert not info.value.why  # (refused by the search, not by the floor)
    assert len(calls) == 1
    # a second refusal at another budget names the same number and builds nothing again
    with pytest.raises(InfeasibleBudget) as again:
        hrockmate.solve_graph(graph, (floor + info.value.min_bytes) // 2, **HIER)
    assert again.value.min_bytes == info.value.min_bytes
    assert len(calls) == 1


def test_a_budget_below_the_floor_runs_no_search(monkeypatch) -> None:
    from hrockmate.planning import search as search_mod

    graph = training_graph(9, 2)
    floor, _ = peak_lower_bound(graph)
    searched = _counting(monkeypatch, search_mod, "best_over_leaf_sizes")
    computed = _counting(monkeypatch, minima, "_compute")
    with pytest.raises(InfeasibleBudget) as info:
        hrockmate.solve_graph(graph, floor - 1, **HIER)
    assert info.value.why and info.value.min_bytes == floor
    assert searched == [] and computed == []


def test_a_prepared_hierarchy_builds_its_low_peak_twin_once(monkeypatch) -> None:
    """Solves given one prepared hierarchy (the runtime's, ``pareto``'s) that fall to the
    low-peak model reuse the blocks it was built with the first time."""
    from hrockmate.planning import policy
    from hrockmate.planning.api import with_hierarchy

    graph = training_graph(9, 2)
    floor, _ = peak_lower_bound(graph)
    options = with_hierarchy(graph, HIER)
    h = options["hierarchy"]
    built: list[bool] = []
    real = policy.prepare

    def counted(*args: Any, **kwargs: Any) -> Any:
        built.append(bool(kwargs.get("low_peak")))
        return real(*args, **kwargs)

    monkeypatch.setattr(policy, "prepare", counted)
    refusals = []
    for budget in (floor, floor + 1, floor + 2):
        with pytest.raises(InfeasibleBudget) as info:
            hrockmate.solve_graph(graph, budget, **options)
        refusals.append(info.value.min_bytes)
    assert built == [True]  # (the default model's blocks are the prepared ones)
    assert len(h.low_peak_twins) == 1 and next(iter(h.low_peak_twins.values())).low_peak
    assert len(set(refusals)) == 1


def test_plans_of_the_low_peak_model_reuse_its_blocks(data_graphs, monkeypatch) -> None:
    # the case of test_strategies' low-peak test: the CNN+BN log at 35% of store-all, below
    # the least peak of the blocks' default options, greedy eviction taken out; the blocks
    # solved again with the low-peak model plan it, the second time without solving them again
    from hrockmate.planning import policy

    monkeypatch.setattr(strategies, "greedy_eviction_schedule", lambda *a, **k: None)
    g = hrockmate.Graph.load(data_graphs / "cnn_bn_oplog.json")
    budget = int(0.35 * simulate(g, store_all_schedule(g)).peak_bytes)
    h = hierarchy_mod.prepare(g, flat_ops=0, leaf_size=9, progress=False, time_limit=60)
    built = _counting(monkeypatch, policy, "prepare")
    plans = [hrockmate.solve_graph(g, budget, progress=False, exact_ops=0, hierarchy=h,
                                   time_limit=60) for _ in range(2)]
    assert len(built) == 1
    for plan in plans:
        assert plan.stats.get("low_peak") is True and not plan.stats.get("fallback")
        assert simulate(g, plan.schedule).peak_bytes == plan.peak_bytes <= budget


def test_the_low_peak_twin_solves_only_the_leaf_milps_its_hierarchy_did_not(
        monkeypatch) -> None:
    """A leaf's MILP is the same under both memory models: the low-peak twin built ``like`` a
    hierarchy reads the solutions of the MILPs both solve with the same arguments (each leaf's
    fastest, its caps on what it keeps, its lowest peak) and solves only the others."""
    from hrockmate import models
    from hrockmate.planning import ilp

    model, sample = models.gpt2_tiny(n_layer=2)
    g = hrockmate.trace(model, sample, cost="estimate")
    h = hierarchy_mod.prepare(g, flat_ops=0, progress=False, workers=1)
    shared = set(h.leaf_solutions)
    leaves_solved = sum(1 for b in _blocks(h) if not b.children and b.solver == "ilp")
    assert leaves_solved > 0 and len(shared) >= leaves_solved
    current: list[Any] = []
    leaf_milps: list[int] = []
    real_options, real_solve = hierarchy_mod._block_options, ilp.solve_level

    def options(ctx, block, st):
        current[:] = [block]
        return real_options(ctx, block, st)

    def solve(*args, **kwargs):
        if not current[0].children:
            leaf_milps.append(1)
        return real_solve(*args, **kwargs)

    monkeypatch.setattr(hierarchy_mod, "_block_options", options)
    monkeypatch.setattr(ilp, "solve_level", solve)
    twin = hierarchy_mod.prepare(g, flat_ops=0, progress=False, workers=1, low_peak=True,
                                 like=h)
    assert twin.low_peak and twin.solved_blocks == h.solved_blocks
    # one solve per new entry, none for an entry the first hierarchy made, and fewer than it
    assert len(leaf_milps) == len(set(h.leaf_solutions) - shared)
    assert len(leaf_milps) < len(shared)
    # and every block of the twin has its options
    assert all(b.options for b in _blocks(twin))


def _blocks(h: Any) -> list[Any]:
    out, stack = [], list(h.root.children)
    while stack:
        b = stack.pop()
        stack.extend(b.children)
        out.append(b)
    return out
