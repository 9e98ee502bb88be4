"""The lower bound on every schedule's time within a budget (``hrockmate.time_lower_bound``):
never above a plan that fits, never above the exact MILP's proven optimum, and infinite only
where nothing fits."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from graph_builders import training_graph
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hrockmate
from hrockmate.ir.graph import Graph, Op, Tensor
from hrockmate.ir.plan import InfeasibleBudget


def _store_all(g: Graph) -> hrockmate.SimulationResult:
    return hrockmate.simulate(g, hrockmate.store_all_schedule(g))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 12), seed=st.integers(0, 10_000), fraction=st.floats(0.15, 0.95))
def test_the_bound_never_exceeds_the_exact_optimum(n: int, seed: int, fraction: float) -> None:
    g = training_graph(n, seed=seed)
    budget = int(fraction * _store_all(g).peak_bytes)
    bound = hrockmate.time_lower_bound(g, budget)
    assert bound.proven and bound.budget_bytes == budget
    try:
        exact = hrockmate.solve_graph(g, budget, method="checkmate", progress=False,
                                      time_limit=30)
    except InfeasibleBudget:
        return  # (the bound may still be finite: it does not count the backward's memory)
    assert bound.time <= exact.time * (1 + 1e-6) + 1e-9
    if exact.optimal and not exact.stats.get("fallback"):
        assert bound.time <= exact.time + 1e-9
    # and never above any other plan within the budget
    greedy = hrockmate.solve_graph(g, budget, method="greedy", progress=False)
    assert bound.time <= greedy.time * (1 + 1e-6) + 1e-9


def _three_layers(loss_grad_bytes: int) -> Graph:
    """x -> a (cost 1, 100 B) -> b (cost 5, 50 B) -> loss (cost 10); the backward reads the
    loss (making a gradient of ``loss_grad_bytes``), then b, then a."""
    g = Graph(name="three", time_unit="units")
    x = g.add_tensor(Tensor("x", 100, role="input"))
    a = g.add_tensor(Tensor("a", 100))
    b = g.add_tensor(Tensor("b", 50))
    loss = g.add_tensor(Tensor("loss", 4, role="output"))
    dl = g.add_tensor(Tensor("dl", loss_grad_bytes))
    db = g.add_tensor(Tensor("db", 4))
    da = g.add_tensor(Tensor("da", 4, role="input_grad"))
    g.add_op(Op("fa", "forward", 1.0, [x], [a]))
    g.add_op(Op("fb", "forward", 5.0, [a], [b]))
    g.add_op(Op("fl", "forward", 10.0, [b], [loss]))
    g.add_op(Op("bl", "backward", 0.5, [loss], [dl]))
    g.add_op(Op("bb", "backward", 5.0, [b, dl], [db]))
    g.add_op(Op("ba", "backward", 1.0, [a, db], [da]))
    return g


def test_the_bound_is_tight_where_one_tensor_must_go() -> None:
    # at 150 B (what computing b needs) a, b and the loss cannot all stay after the forward:
    # rerunning a (cost 1) is the least, and a schedule doing just that exists
    g = _three_layers(4)
    base = _store_all(g)
    assert base.peak_bytes > 150
    bound = hrockmate.time_lower_bound(g, 150)
    assert bound.proven and bound.time == pytest.approx(base.time + 1.0)
    exact = hrockmate.solve_graph(g, 150, method="checkmate", progress=False)
    assert exact.time == pytest.approx(bound.time)
    # store-all fits: nothing to rerun; below what computing b alone needs: nothing fits
    assert hrockmate.time_lower_bound(g, 1.0).time == base.time
    assert hrockmate.time_lower_bound(g, 149).time == math.inf


def test_the_first_backward_step_tightens_the_bound() -> None:
    # the loss's backward allocates 100 B: after the forward a, b and the loss fit 160 B, at
    # that first backward step they do not with its 100 B; rerunning a is the least there too
    # (a bound counting the forward's end alone says 0)
    g = _three_layers(100)
    base = _store_all(g)
    bound = hrockmate.time_lower_bound(g, 160)
    assert bound.proven and bound.time == pytest.approx(base.time + 1.0)
    exact = hrockmate.solve_graph(g, 160, method="checkmate", progress=False)
    assert exact.time == pytest.approx(bound.time)


def test_the_bound_grows_as_the_budget_shrinks(data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "resnet_like_train.json")
    bounds = [hrockmate.time_lower_bound(g, f) for f in (0.9, 0.7, 0.5, 0.3)]
    assert all(b.proven for b in bounds)
    assert [b.time for b in bounds] == sorted(b.time for b in bounds)
    assert bounds[-1].overhead > 0.05  # the bound says something at 30%
    plan = hrockmate.solve_graph(g, 0.5, progress=False)
    assert bounds[2].time <= plan.time


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "10"])
def test_the_bound_rejects_bad_time_limits(bad: object) -> None:
    with pytest.raises(ValueError, match="time_limit must be a positive number"):
        hrockmate.time_lower_bound(training_graph(4, seed=1), 0.5,
                                   time_limit=bad)  # type: ignore[arg-type]


def test_the_bound_honours_its_time_limit() -> None:
    import time

    g = training_graph(3000, seed=2)
    greedy = hrockmate.solve_graph(g, 0.4, method="greedy", progress=False)
    start = time.perf_counter()
    bound = hrockmate.time_lower_bound(g, 0.4, time_limit=1.0)
    assert time.perf_counter() - start < 1.0 + 4.0  # (building the model, on a loaded machine)
    assert bound.time <= greedy.time


def test_without_presolve_the_bound_is_the_same(data_graphs: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # large models skip HiGHS's presolve (it does not always poll the time limit): the bound
    # proven without it is the one proven with it
    from hrockmate.planning import bounds as bounds_module

    g = Graph.load(data_graphs / "resnet_like_train.json")
    with_presolve = [hrockmate.time_lower_bound(g, f) for f in (0.7, 0.3)]
    monkeypatch.setattr(bounds_module, "PRESOLVE_MAX_COLUMNS", 0)
    without = [hrockmate.time_lower_bound(g, f) for f in (0.7, 0.3)]
    for a, b in zip(with_presolve, without):
        assert a.proven and b.proven
        assert b.time == pytest.approx(a.time, rel=1e-6)
    assert without[1].overhead > 0.05
