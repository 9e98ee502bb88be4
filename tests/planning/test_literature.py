"""TW-Remat and Rotor through the Python bindings: the third-party graphs, chain detection,
budgets and error messages."""

from __future__ import annotations

import pytest
from conftest import corpus_files

from hrockmate.ir.graph import Graph, Op, Tensor
from hrockmate.ir.plan import InfeasibleBudget
from hrockmate.ir.schedule import simulate, store_all_schedule
from hrockmate.planning.literature import (
    ChainStage,
    NotAChainError,
    StateOption,
    chain_stages,
    is_chain,
    rotor,
    rotor_chain,
    twremat,
)


@pytest.fixture(scope="module")
def loaded() -> dict[str, Graph]:
    """The repository's test graphs, plus the third-party ones when present."""
    return {p.stem: Graph.load(p) for p in corpus_files()}


def test_twremat_gives_valid_points_for_every_test_graph(loaded: dict[str, Graph]) -> None:
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
    g = loaded["resnet_like_train"]
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
    for name in ("vgg_like_train",):
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


def test_rotors_least_peak_is_the_peak_of_a_schedule_it_makes(loaded: dict[str, Graph]) -> None:
    from hrockmate.planning import policy

    g = loaded["vgg_like_train"]
    least = policy.rotor_least_peak(g)
    assert least is not None
    # the least budget Rotor is seen to solve holds a schedule of that peak, and no lower
    # budget is solved
    with pytest.raises(InfeasibleBudget) as info:
        rotor(g, 1000)
    budget = policy.rotor_lowest(g, info.value.min_bytes)
    schedule, sim = rotor(g, budget)
    assert least == sim.peak_bytes == simulate(g, schedule).peak_bytes <= budget
    with pytest.raises(InfeasibleBudget):
        rotor(g, least - 1)
    assert policy.rotor_least_peak(_not_a_chain_graph()) is None


def test_rotor_rejects_bad_arguments(loaded: dict[str, Graph]) -> None:
    g = loaded["vgg_like_train"]
    with pytest.raises(ValueError, match="budget_bytes"):
        rotor(g, -5)
    with pytest.raises(ValueError, match="slots"):
        rotor(g, 10**12, slots=0)


# --- Rotor on a chain with several state options per stage ---------------------------------


def _replay(
    stages: list[ChainStage],
    ops: list[tuple[str, int, int]],
    input_bytes: int,
    final_grad_bytes: int,
) -> tuple[int, float]:
    """Peak and time of ``ops`` in the chain model, checking each operation's requirements."""
    n = len(stages)
    out = {0: input_bytes}
    out.update({k: stages[k - 1].out_bytes for k in range(1, n + 1)})
    a = {0}  # stored outputs
    full: dict[int, int] = {}  # stored full states: stage -> option
    delta = n
    cur = input_bytes + final_grad_bytes
    peak, time = cur, 0.0
    for kind, k, o in ops:
        st = stages[k - 1]
        if kind in ("forward", "forward_all"):
            assert (k - 1 in a or k - 1 in full) and k not in a and k not in full, (kind, k)
            if kind == "forward":
                assert o == -1
                peak = max(peak, cur + st.out_bytes + st.fwd_overhead)
                cur += st.out_bytes
                a.add(k)
                time += st.fwd_time
            else:
                opt = st.options[o]
                size = max(opt.state_bytes, st.out_bytes)
                peak = max(peak, cur + size + opt.fwd_overhead)
                cur += size
                full[k] = o
                time += opt.fwd_time
        elif kind == "backward":
            assert delta == k and k in full and (k - 1 in a or k - 1 in full), (kind, k)
            assert full[k] == o, "the backward reports the option of its full state"
            opt = st.options[o]
            peak = max(peak, cur + st.grad_bytes + opt.bwd_overhead)
            g_k = final_grad_bytes if k == n else stages[k].grad_bytes
            cur += st.grad_bytes - max(opt.state_bytes, st.out_bytes) - g_k
            del full[k]
            delta = k - 1
            time += opt.bwd_time
        else:
            assert kind == "free" and o == -1 and k in a and (k + 1) not in full, (kind, k)
            a.remove(k)
            cur -= out[k]
    assert delta == 0, "every backward ran"
    return peak, time


def _options_chain(middle_options: list[int] | None = None) -> list[ChainStage]:
    """Three stages; the middle one keeps either a large state (fast backward) or a small one
    (its backward recomputes, 3x slower)."""

    def stage(options: list[StateOption]) -> ChainStage:
        return ChainStage(
            fwd_time=1.0, out_bytes=10, grad_bytes=10, fwd_overhead=2, options=options
        )

    def plain() -> list[StateOption]:
        return [
            StateOption(fwd_time=1.0, state_bytes=10, fwd_overhead=1, bwd_time=1.0, bwd_overhead=3)
        ]

    middle = [
        StateOption(fwd_time=1.0, state_bytes=100, fwd_overhead=5, bwd_time=1.0, bwd_overhead=4),
        StateOption(fwd_time=1.5, state_bytes=20, fwd_overhead=0, bwd_time=3.0, bwd_overhead=4),
    ]
    if middle_options is not None:
        middle = [middle[i] for i in middle_options]
    return [stage(plain()), stage(middle), stage(plain())]


def test_rotor_chain_takes_the_option_that_fits() -> None:
    stages = _options_chain()
    kw = {"input_bytes": 10, "final_grad_bytes": 10}
    roomy = rotor_chain(stages, 10_000, **kw)
    assert ("forward_all", 2, 0) in roomy.ops and ("backward", 2, 0) in roomy.ops
    assert roomy.time == 6.0
    assert _replay(stages, roomy.ops, **kw) == (roomy.peak_bytes, roomy.time)

    limit = 70
    with pytest.raises(InfeasibleBudget) as info:
        rotor_chain(_options_chain([0]), limit, **kw)
    assert info.value.min_bytes > limit
    plan = rotor_chain(stages, limit, **kw)
    assert ("forward_all", 2, 1) in plan.ops and ("backward", 2, 1) in plan.ops
    assert plan.peak_bytes <= limit
    assert _replay(stages, plan.ops, **kw) == (plan.peak_bytes, plan.time)
    assert plan.time > roomy.time
    # Only the small option: same sequence.
    assert rotor_chain(_options_chain([1]), limit, **kw).time == plan.time


def test_rotor_chain_reports_its_minimum_when_infeasible() -> None:
    stages = _options_chain()
    with pytest.raises(InfeasibleBudget) as info:
        rotor_chain(stages, 30, input_bytes=10, final_grad_bytes=10)
    low = info.value.min_bytes
    assert low > 30 and str(low) in str(info.value)
    # The minimum is met exactly, even with coarse slots (refined as needed).
    plan = rotor_chain(stages, low, input_bytes=10, final_grad_bytes=10, slots=3)
    assert plan.peak_bytes <= low
    assert _replay(stages, plan.ops, 10, 10) == (plan.peak_bytes, plan.time)


def test_rotor_chain_rejects_bad_input() -> None:
    stages = _options_chain()
    with pytest.raises(ValueError, match=r"stages\[1\]\.options must be a non-empty"):
        rotor_chain([stages[0], ChainStage(1.0, 10, 10, 0, [])], 1000)
    bad = _options_chain()
    bad[1].options[1].bwd_time = -2.0
    with pytest.raises(ValueError, match=r"stages\[1\]\.options\[1\]\.bwd_time"):
        rotor_chain(bad, 1000)
    bad = _options_chain()
    bad[2].options[0].fwd_time = float("nan")
    with pytest.raises(ValueError, match=r"stages\[2\]\.options\[0\]\.fwd_time"):
        rotor_chain(bad, 1000)
    bad = _options_chain()
    bad[0].out_bytes = -1
    with pytest.raises(ValueError, match=r"stages\[0\]\.out_bytes"):
        rotor_chain(bad, 1000)
    with pytest.raises(ValueError, match="limit_bytes"):
        rotor_chain(stages, -1)
    with pytest.raises(ValueError, match="slots"):
        rotor_chain(stages, 1000, slots=0)
    with pytest.raises(ValueError, match=r"stages\[0\] must be a ChainStage"):
        rotor_chain([StateOption(1.0, 1, 0, 1.0, 0)], 1000)  # type: ignore[list-item]


def test_native_rotor_chain_checks_its_arrays() -> None:
    import numpy as np

    from hrockmate import _native

    f = lambda *xs: np.array(xs, dtype=np.float64)  # noqa: E731
    u = lambda *xs: np.array(xs, dtype=np.uint64)  # noqa: E731
    one = (f(1.0), u(1), u(1), u(0))
    opts = (f(1.0), u(2), u(0), f(1.0), u(0))

    def call(stage_arrays, ptr, option_arrays):
        ptr = np.array(ptr, dtype=np.int64)
        return _native.rotor_chain(0, 0, *stage_arrays, ptr, *option_arrays, 100, 10)

    d = call(one, [0, 1], opts)
    assert list(d["op_kind"]) == [1, 2] and list(d["op_option"]) == [0, 0] and d["peak_bytes"] == 3
    two = (f(1.0, 1.0), u(1, 1), u(1, 1), u(0, 0))
    for stage_arrays, ptr, what in (
        (one, [0], "opt_ptr has 1 entries"),
        (one, [0, 0], "opt_ptr must start at 0 and end"),
        (one, [0, 2], "opt_ptr must start at 0 and end"),
        (two, [0, 2, 1], "opt_ptr must be non-decreasing"),
    ):
        with pytest.raises(_native.InvalidArgumentError, match=what):
            call(stage_arrays, ptr, opts)
    with pytest.raises(_native.InvalidArgumentError) as info:
        call(two, [0, 1, 1], opts)
    assert str(info.value) == "stage 2 has no state option; give each stage at least one"
    with pytest.raises(_native.InvalidArgumentError, match="opt_state_bytes has 2 entries"):
        call(one, [0, 1], (f(1.0), u(2, 3), u(0), f(1.0), u(0)))
    with pytest.raises(_native.InvalidArgumentError, match="bwd_time"):
        call(one, [0, 1], (f(1.0), u(2), u(0), f(-1.0), u(0)))
