"""One infeasible error: InfeasibleBudget with min_bytes and reason, the solvers' as subclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

import hrockmate
from hrockmate.ir.errors import InfeasibleBudget, NotAChainError
from hrockmate.ir.graph import Graph


def test_the_public_name_is_the_one_class() -> None:
    from hrockmate.ir import plan
    from hrockmate.planning import literature

    assert hrockmate.InfeasibleBudget is plan.InfeasibleBudget is InfeasibleBudget
    assert literature.NotAChainError is NotAChainError


def test_a_floor_and_a_reached_peak_say_which_they_are() -> None:
    proven = InfeasibleBudget(100, 250, "g", why="op 3 alone needs that much")
    assert (proven.min_bytes, proven.budget_bytes) == (250, 100)
    assert proven.reason == "op 3 alone needs that much"
    assert "at least 250 bytes" in str(proven) and "give a budget of at least 250" in str(proven)
    reached = InfeasibleBudget(100, 300, "g")
    assert reached.why == "" and "lowest peak reached is 300 bytes" in reached.reason


def test_the_solvers_signals_are_infeasible_budgets() -> None:
    from hrockmate.planning import ilp, strategies

    s = strategies.SolverInfeasible("no block count fits", proven=False, min_bytes=77)
    level = ilp.LevelInfeasible("level 'x' has no schedule within 5 bytes")
    for exc, low in ((s, 77), (level, 0)):
        assert isinstance(exc, InfeasibleBudget) and isinstance(exc, ValueError)
        assert exc.min_bytes == low and exc.reason == str(exc)
    assert s.proven is False
    # inside the planner each is still caught by its own class
    with pytest.raises(ilp.LevelInfeasible):
        try:
            raise level
        except strategies.SolverInfeasible:  # pragma: no cover - must not catch it
            pytest.fail("a LevelInfeasible was caught as a SolverInfeasible")


def test_native_errors_map_to_the_planners(data_graphs: Path) -> None:
    from hrockmate.planning import literature

    chain = Graph.load(data_graphs / "resnet_like_train.json")
    with pytest.raises(InfeasibleBudget) as info:
        literature.rotor(chain, 10)
    assert info.value.min_bytes > 10 and info.value.budget_bytes == 10
    assert chain.name in str(info.value)
    not_chain = Graph.load(data_graphs / "densenet_tiny_oplog.json")
    if not literature.is_chain(not_chain):
        with pytest.raises(NotAChainError):
            literature.chain_stages(not_chain)
