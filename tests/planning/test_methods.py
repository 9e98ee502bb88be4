"""The method registry: every method behind solve(graph, budget, ctx) -> Candidate | Infeasible."""

from __future__ import annotations

from pathlib import Path

import pytest

import hrockmate
from hrockmate.ir.graph import Graph
from hrockmate.planning import methods
from hrockmate.planning.context import SolveContext
from hrockmate.planning.methods import Candidate, Infeasible

PUBLIC_NAMES = ("hrockmate", "checkmate", "checkpoint", "selective", "layers", "greedy",
                "twremat", "rotor", "recompute-all", "store-all")


def _ctx(graph: Graph) -> SolveContext:
    base = hrockmate.simulate(graph, hrockmate.store_all_schedule(graph))
    return SolveContext(time_limit=30.0, progress=False, baseline_time=float(base.time),
                        baseline_peak=int(base.peak_bytes), improve_until=None)


def test_every_public_method_name_is_registered() -> None:
    assert tuple(methods.METHODS) == PUBLIC_NAMES
    with pytest.raises(ValueError, match="unknown method 'nope'.*hrockmate"):
        methods.check_method("nope")
    with pytest.raises(ValueError, match="registered already"):
        methods.register("greedy")(lambda g, b, c: Infeasible(0, ""))


@pytest.mark.parametrize("name", [n for n in PUBLIC_NAMES if n != "checkmate"])
def test_each_method_gives_a_simulated_candidate_or_says_why_not(
        name: str, data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "resnet_like_train.json")
    ctx = _ctx(g)
    budget = int(0.6 * ctx.baseline_peak)
    out = methods.solve(name, g, budget, ctx)
    if isinstance(out, Candidate):
        sim = hrockmate.simulate(g, hrockmate.Schedule(out.steps, out.forward_len))
        assert out.peak == sim.peak_bytes <= budget
        assert out.time == pytest.approx(sim.time)
        assert out.stats["method"] == name or out.stats.get("fallback")
    else:
        assert isinstance(out, Infeasible)
        assert out.min_bytes > budget and name in out.why


def test_store_all_is_infeasible_below_its_peak(data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "vgg_like_train.json")
    ctx = _ctx(g)
    out = methods.solve("store-all", g, ctx.baseline_peak - 1, ctx)
    assert out == Infeasible(ctx.baseline_peak, out.why)  # type: ignore[union-attr]
    full = methods.solve("store-all", g, ctx.baseline_peak, ctx)
    assert isinstance(full, Candidate) and full.peak == ctx.baseline_peak


def test_greedy_that_gets_stuck_falls_back_behind_the_same_signature(
        monkeypatch: pytest.MonkeyPatch, data_graphs: Path) -> None:
    from hrockmate.planning import strategies

    monkeypatch.setattr(strategies, "greedy_eviction_schedule", lambda *a, **k: None)
    g = Graph.load(data_graphs / "resnet_like_train.json")
    ctx = _ctx(g)
    out = methods.solve("greedy", g, int(0.6 * ctx.baseline_peak), ctx)
    # the recompute-all fallback, simulated like any candidate
    assert isinstance(out, Candidate) and out.stats["fallback"] == "recompute-all"
    assert out.peak is not None and out.peak <= int(0.6 * ctx.baseline_peak)


def test_solve_graph_takes_every_registered_name(data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "vgg_like_train.json")
    for name in PUBLIC_NAMES:
        plan = hrockmate.solve_graph(g, 1.0, method=name, progress=False)
        assert plan.peak_bytes == plan.baseline_peak_bytes
