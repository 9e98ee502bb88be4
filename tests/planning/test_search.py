"""The search over the methods: leaf sizes, the op-level retry, and the time each try gets."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from hrockmate.ir.graph import Graph
from hrockmate.planning import hierarchy, search
from hrockmate.planning.bounds import TimeBound
from hrockmate.planning.context import SolveContext
from hrockmate.planning.methods import Candidate, Infeasible


def _fake_solve(monkeypatch: pytest.MonkeyPatch, answers: dict[int, Any]
                ) -> list[SolveContext]:
    """methods.solve answering by leaf size (a time, or an Infeasible); the contexts seen."""
    seen: list[SolveContext] = []

    def fake(method: str, graph: Graph, budget: int, ctx: SolveContext) -> Any:
        seen.append(ctx)
        a = answers[ctx.leaf_size]
        if isinstance(a, Infeasible):
            return a
        c = Candidate([], 0, False, {"method": method})
        c.peak, c.time = budget, float(a)
        return c

    monkeypatch.setattr(search.methods, "solve", fake)
    return seen


def test_improving_tries_give_the_first_its_own_limit_and_stop_when_the_window_is_spent(
) -> None:
    now = time.perf_counter()
    tries = list(search.improving_tries([6, 8, 9], now + 100.0, lambda: None))
    assert tries[0] == (6, None) and [t for t, _ in tries] == [6, 8, 9]
    assert all(0 < s <= 100.0 for _, s in tries[1:])  # type: ignore[operator]
    # the window spent: only the first
    assert list(search.improving_tries([6, 8, 9], now - 1.0, lambda: None)) == [(6, None)]


def test_every_leaf_size_is_tried_and_the_fastest_plan_kept(
        monkeypatch: pytest.MonkeyPatch, data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "resnet_like_train.json")
    sizes = hierarchy.leaf_sizes(g, None)
    assert len(sizes) > 1
    answers = {s: 100.0 + k for k, s in enumerate(sizes)}
    answers[sizes[-1]] = 50.0  # the last is the fastest
    seen = _fake_solve(monkeypatch, answers)
    monkeypatch.setattr(search, "MIN_GAIN_TO_RETRY", -1.0)  # no early stop
    monkeypatch.setattr(search, "time_lower_bound",
                        lambda graph, budget, time_limit=None: TimeBound(budget, 0.0, 1.0, True,
                                                                         0.0))
    ctx = SolveContext(baseline_time=1.0, flat_ops=0)
    best = search.best_over_leaf_sizes(g, "hrockmate", 10, None, None, ctx)
    assert isinstance(best, Candidate) and best.time == 50.0
    assert best.stats["leaf_size"] == sizes[-1]
    assert [c.leaf_size for c in seen] == list(sizes)
    # the later tries know a plan is in hand, the first does not
    assert not seen[0].plan_in_hand and all(c.plan_in_hand for c in seen[1:])


def test_no_plan_at_any_leaf_size_reports_the_lowest_peak_seen(
        monkeypatch: pytest.MonkeyPatch, data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "resnet_like_train.json")
    sizes = hierarchy.leaf_sizes(g, None)
    answers = {s: Infeasible(1000 - k, f"size {s}") for k, s in enumerate(sizes)}
    _fake_solve(monkeypatch, answers)
    out = search.best_over_leaf_sizes(g, "hrockmate", 10, None, None,
                                      SolveContext(flat_ops=0))
    assert isinstance(out, Infeasible) and out.min_bytes == 1000 - (len(sizes) - 1)


def test_other_methods_get_one_try(monkeypatch: pytest.MonkeyPatch, data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "resnet_like_train.json")
    seen = _fake_solve(monkeypatch, {hierarchy.LEAF_SIZE: 7.0})
    out = search.search(g, "greedy", 10, SolveContext(), exact_ops=10_000)
    assert isinstance(out, Candidate) and len(seen) == 1


def test_the_op_level_retry_runs_only_on_small_graphs_with_a_weak_plan(
        monkeypatch: pytest.MonkeyPatch, data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "resnet_like_train.json")
    calls: list[SolveContext] = []

    def fake(method: str, graph: Graph, budget: int, ctx: SolveContext) -> Any:
        calls.append(ctx)
        c = Candidate([], 0, False, {"method": method})
        # the hierarchy's plan recomputes 50% of store-all's time; the op level 10%
        c.peak, c.time = budget, 1.1 if ctx.flat_ops >= graph.num_ops else 1.5
        return c

    monkeypatch.setattr(search.methods, "solve", fake)
    ctx = SolveContext(baseline_time=1.0, flat_ops=0, leaf_size=6)
    out = search.search(g, "hrockmate", 10, ctx, leaf_size=6, exact_ops=g.num_ops)
    assert isinstance(out, Candidate) and out.time == 1.1
    flat = [c for c in calls if c.flat_ops >= g.num_ops]
    assert len(flat) == 1 and not flat[0].hierarchy_retry and not flat[0].lowest_peak
    # a graph above exact_ops gets no retry
    calls.clear()
    out = search.search(g, "hrockmate", 10, ctx, leaf_size=6, exact_ops=g.num_ops - 1)
    assert isinstance(out, Candidate) and out.time == 1.5 and len(calls) == 1
