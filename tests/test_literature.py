"""TW-Remat and Rotor through the Python bindings: the third-party graphs, chain detection,
budgets and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from hrockmate.graph import Graph, Op, Tensor
from hrockmate.literature import (
    NotAChainError,
    chain_stages,
    is_chain,
    rotor,
    twremat,
)
from hrockmate.plan import InfeasibleBudget
from hrockmate.schedule import simulate, store_all_schedule


def _graphs(graphs_dir: Path) -> list[Path]:
    files = sorted(graphs_dir.glob("*.json"))
    assert len(files) == 9, files
    return files


@pytest.fixture(scope="module")
def loaded(graphs_dir: Path) -> dict[str, Graph]:
    return {p.stem: Graph.load(p) for p in _graphs(graphs_dir)}


def test_twremat_gives_valid_points_for_every_third_party_graph(loaded: dict[str, Graph]) -> None:
    for name, g in loaded.items():
        points = twremat(g)
        assert points, name
        base = simulate(g, store_all_schedule(g))
        assert points[0].depth_limit == 0
        assert points[0].sim.peak_bytes == base.peak_bytes, name
        depths = [p.depth_limit for p in points]
        assert depths == sorted(set(depths)), name
        for p in points:
            again = simulate(g, p.schedule)
            assert again.peak_bytes == p.sim.peak_bytes and again.time == p.sim.time, name
        if any(o.phase == "backward" for o in g.ops):
            assert min(p.sim.peak_bytes for p in points) < base.peak_bytes, name
            # Less memory is paid for with recomputation.
            assert max(p.sim.time for p in points) > base.time, name


def test_twremat_single_depth_and_bad_arguments(loaded: dict[str, Graph]) -> None:
    g = loaded["resnet50_train"]
    (deep,) = twremat(g, depth_limit=1000)
    full = twremat(g)[-1]
    assert deep.schedule == full.schedule
    with pytest.raises(ValueError, match="depth_limit"):
        twremat(g, depth_limit=-1)
    with pytest.raises(ValueError, match="exceed 10 steps"):
        twremat(g, depth_limit=3, max_steps=10)
    # Listing depths stops where the cap is hit (depth 0 is always there).
    capped = twremat(g, max_steps=len(deep.schedule) - 1)
    assert 1 <= len(capped) < len(twremat(g))
    with pytest.raises(TypeError, match="hrockmate.Graph"):
        twremat("vgg16")  # type: ignore[arg-type]


def test_checkmate_vgg_graphs_are_chains_for_rotor(loaded: dict[str, Graph]) -> None:
    for name in ("vgg16_train", "vgg19_train"):
        g = loaded[name]
        assert is_chain(g)
        stages = chain_stages(g)
        assert len(stages) >= 15, name
        # Every useful op is in exactly one stage; forward and backward ids have the right phase.
        fwd = [o for f, _ in stages for o in f]
        bwd = [o for _, b in stages for o in b]
        assert len(set(fwd + bwd)) == len(fwd) + len(bwd)
        assert all(g.ops[o].phase == "forward" for o in fwd)
        assert all(g.ops[o].phase == "backward" for o in bwd)
        assert len(bwd) == sum(o.phase == "backward" for o in g.ops)

        base = simulate(g, store_all_schedule(g))
        with pytest.raises(InfeasibleBudget) as info:
            rotor(g, 1000)
        low = info.value.min_bytes
        assert 0 < low < base.peak_bytes
        assert str(low) in str(info.value)
        prev_time = float("inf")
        for frac in (0.0, 0.5, 1.0):
            budget = int(low * 1.05 + (base.peak_bytes - low) * frac)
            schedule, sim = rotor(g, budget)
            assert sim.peak_bytes <= budget
            assert simulate(g, schedule).peak_bytes == sim.peak_bytes
            assert sim.time <= prev_time * (1 + 1e-9)
            prev_time = sim.time
        assert prev_time < base.time * 1.1


def _not_a_chain_graph() -> Graph:
    """Forward f0 -> f1 -> f2 -> f3 -> loss; backward b2 reads f0's result, b1 reads f3's and
    b2's: b1 needs stage 4's state but must run after b2, which belongs to stage 2."""
    g = Graph(name="crossed")
    x = g.add_tensor(Tensor("x", 0, role="input"))
    w = g.add_tensor(Tensor("w", 64, role="parameter"))
    prev = x
    acts = []
    for i in range(4):
        t = g.add_tensor(Tensor(f"a{i}", 100))
        g.add_op(Op(f"f{i}", "forward", 1.0, [prev, w] if i == 0 else [prev], [t]))
        acts.append(t)
        prev = t
    loss = g.add_tensor(Tensor("loss", 4, role="output"))
    g.add_op(Op("loss_op", "forward", 1.0, [prev], [loss]))
    g2 = g.add_tensor(Tensor("g2", 100))
    g.add_op(Op("b2", "backward", 1.0, [acts[0]], [g2]))
    gw = g.add_tensor(Tensor("gw", 64, role="param_grad", grad_of=w))
    g.add_op(Op("b1", "backward", 1.0, [acts[3], g2], [gw]))
    g.validate()
    return g


def test_graphs_that_are_not_chains_get_a_clear_error() -> None:
    g = _not_a_chain_graph()
    assert not is_chain(g)
    with pytest.raises(NotAChainError, match="not a chain.*'b1'"):
        rotor(g, 10_000)
    with pytest.raises(NotAChainError, match="TW-Remat"):
        chain_stages(g)
    # TW-Remat handles it.
    points = twremat(g)
    assert all(simulate(g, p.schedule).peak_bytes == p.sim.peak_bytes for p in points)


def test_rotor_rejects_bad_arguments(loaded: dict[str, Graph]) -> None:
    g = loaded["vgg16_train"]
    with pytest.raises(ValueError, match="budget_bytes"):
        rotor(g, -5)
    with pytest.raises(ValueError, match="slots"):
        rotor(g, 10**12, slots=0)
