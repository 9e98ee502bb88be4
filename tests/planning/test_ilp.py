"""The stage MILP (hrockmate.planning.ilp): exactness on tiny graphs against brute force, options
and pairs, model building and input checks."""

from __future__ import annotations

import heapq
import math
import time
import types
from pathlib import Path
from typing import Callable

import pytest
from graph_builders import training_graph
from highs_standins import HighsStandIn

import hrockmate
from hrockmate.ir.graph import PREEXISTING_ROLES, Graph, Op, Tensor
from hrockmate.planning import ilp, strategies


def brute_force_time(graph: Graph, budget: int) -> float | None:
    """Least total time over *all* valid schedules with peak <= budget (Dijkstra over
    (alive tensors, finished backward ops)); None when no schedule fits."""
    T = graph.tensors
    root = []
    for x in range(len(T)):
        r = x
        while T[r].alias_of is not None:
            r = T[r].alias_of  # type: ignore[assignment]
        root.append(r)
    fixed = frozenset(x for x, t in enumerate(T) if t.role in PREEXISTING_ROLES)
    outputs = frozenset(x for x, t in enumerate(T) if t.role == "output")
    bwd = [j for j, o in enumerate(graph.ops) if o.phase == "backward"]
    all_bwd = frozenset(bwd)

    def mem(alive: frozenset[int]) -> int:
        return sum(T[r].bytes for r in {root[x] for x in alive} if r not in fixed)

    start = (frozenset(), frozenset())
    dist = {start: 0.0}
    heap = [(0.0, 0, start)]
    tick = 0
    while heap:
        d, _, state = heapq.heappop(heap)
        if dist.get(state, float("inf")) < d:
            continue
        alive, done = state
        if done == all_bwd:
            return d
        have = alive | fixed
        moves = []
        for j, op in enumerate(graph.ops):
            if op.phase == "backward" and (j in done or not outputs <= alive):
                continue
            if not all(x in have for x in op.inputs):
                continue
            if op.phase == "forward" and all(x in alive for x in op.outputs):
                continue
            new_bytes = sum(T[x].bytes for x in op.outputs if T[x].alias_of is None)
            if mem(alive) + new_bytes + op.workspace > budget:
                continue
            nd = done | {j} if op.phase == "backward" else done
            moves.append((d + op.time, (alive | frozenset(op.outputs), nd)))
        for x in alive:
            if x not in outputs:
                moves.append((d, (alive - {x}, done)))
        for nd_, ns in moves:
            if nd_ < dist.get(ns, float("inf")):
                dist[ns] = nd_
                tick += 1
                heapq.heappush(heap, (nd_, tick, ns))
    return None


def _sim(graph: Graph, steps: list[tuple[str, int]], fl: int) -> tuple[int, float]:
    r = hrockmate.simulate(graph, hrockmate.Schedule(steps, fl))
    return r.peak_bytes, r.time


@pytest.mark.parametrize("seed", range(6))
def test_exact_ilp_matches_brute_force(seed: int) -> None:
    g = training_graph(3 + seed % 2, seed, skips=seed % 3 == 0)
    base = _sim(g, *_store_all(g))
    low_steps, low_fl, proven, _ = strategies.min_peak_checkmate(g)
    low = _sim(g, low_steps, low_fl)[0]
    assert proven
    for budget in sorted({low, (low + base[0]) // 2, base[0]}):
        expected = brute_force_time(g, budget)
        assert expected is not None, "the min-peak schedule must be feasible for brute force"
        r = strategies.solve_checkmate(g, budget)
        peak, t = _sim(g, r.steps, r.forward_len)
        assert r.optimal
        assert peak <= budget
        assert t == pytest.approx(expected), (seed, budget)


@pytest.mark.parametrize("seed", [11, 0, 3, 5])
def test_min_peak_is_the_least_feasible_budget(seed: int) -> None:
    # (the peak's floor in the model, ``ilp._peak_floor``, must never cut off the least peak)
    g = training_graph(4, seed, skips=seed % 3 == 0)
    steps, fl, proven, bound = strategies.min_peak_checkmate(g)
    low = _sim(g, steps, fl)[0]
    assert proven and bound <= low + 1
    assert brute_force_time(g, low) is not None
    assert brute_force_time(g, low - 1) is None
    with pytest.raises(strategies.SolverInfeasible) as info:
        strategies.solve_checkmate(g, low - 1)
    assert info.value.proven or brute_force_time(g, low - 1) is None


def _head_with_two_outputs() -> Graph:
    """A head making a model output (kept to the end) and a hidden tensor; the hidden tensor is
    freed for the memory-hungry backward of the op after it, and the head runs again to remake
    it while its output is still alive: that output is a temporary copy then, not a second
    tensor to the end."""
    g = Graph(name="rerun_with_an_output_alive", time_unit="units")
    x = g.add_tensor(Tensor("x", 64, role="input"))
    logits = g.add_tensor(Tensor("logits", 100, role="output"))
    h = g.add_tensor(Tensor("h", 100))
    head = g.add_op(Op("head", "forward", 5.0, [x], [logits, h]))
    z = g.add_tensor(Tensor("z", 100))
    f1 = g.add_op(Op("f1", "forward", 1.0, [h], [z]))
    loss = g.add_tensor(Tensor("loss", 4, role="output"))
    lo = g.add_op(Op("loss", "forward", 1.0, [z], [loss]))
    dloss = g.add_tensor(Tensor("dloss", 4, role="tangent"))
    gz = g.add_tensor(Tensor("gz", 100))
    g.add_op(Op("loss_bwd", "backward", 1.0, [dloss], [gz], differentiates=lo))
    gh = g.add_tensor(Tensor("gh", 10))
    g.add_op(Op("f1_bwd", "backward", 1.0, [gz], [gh], workspace=150, differentiates=f1))
    gx = g.add_tensor(Tensor("gx", 10, role="input_grad"))
    g.add_op(Op("head_bwd", "backward", 1.0, [gh, h], [gx], workspace=100, differentiates=head))
    return g


def test_an_op_run_again_while_an_output_is_alive_counts_that_output_once() -> None:
    # (the model had counted the alive output twice until the stage's end: a lowest peak of
    # 424 for a schedule that simulates at 364, and no schedule at budgets in between)
    g = _head_with_two_outputs()
    steps, fl, proven, bound = strategies.min_peak_checkmate(g)
    low = _sim(g, steps, fl)[0]
    assert proven and bound <= low + 1
    assert brute_force_time(g, low - 1) is None
    expected = brute_force_time(g, low)
    assert expected is not None
    r = strategies.solve_checkmate(g, low)
    peak, t = _sim(g, r.steps, r.forward_len)
    assert peak <= low and t == pytest.approx(expected)
    assert [i for k, i in r.steps if k == "compute"].count(0) == 2  # the head runs again


def test_a_block_run_again_while_an_output_is_kept_counts_that_output_once() -> None:
    # the same at a block level: F0 makes x (kept to the end) and y; B1 needs room without y,
    # so F0 runs again before B0, with x alive: 110 kept + 200 while F0 runs, then 220 + 100
    V, N, O = ilp.LevelValue, ilp.LevelNode, ilp.NodeOption
    values = [V("in", 0), V("x", 100, producer=0, keep=True), V("y", 100, producer=0),
              V("z", 100, producer=1), V("dz", 10, producer=2), V("dy", 10, producer=3, keep=True)]
    nodes = [N("F0", [0], [1, 2], [O(5.0)]), N("F1", [2], [3], [O(1.0)]),
             N("B1", [3], [4], [O(1.0, 150)], backward=True),
             N("B0", [2, 4], [5], [O(1.0, 100)], backward=True)]
    p = ilp.LevelProblem(values, nodes, n_forward=2, name="rerun")
    low = ilp.solve_level(p, None, minimize_peak=True)
    assert low.stats["peak_bound_bytes"] == pytest.approx(360, abs=1e-3)  # B1: x, z, dz, 150
    sp = ilp.solve_level(p, 400)
    assert sp.computes[3] == [(0, 0), (3, 0)] and sp.objective == pytest.approx(13.0)


def _level_with_parts(parts: bool, b0_reads_a: bool) -> ilp.LevelProblem:
    # F1 reads a (100 bytes) early in its fragment; its peak, 300 bytes beside what the level
    # counts, comes after that read: in parts, a is gone by then if the level frees it after F1
    V, N, O = ilp.LevelValue, ilp.LevelNode, ilp.NodeOption
    values = [V("in", 0), V("a", 100, producer=0), V("b", 10, producer=1),
              V("db", 10, producer=2), V("din", 10, producer=3, keep=True)]
    f1 = O(1.0, 300, parts=[(200, frozenset()), (300, frozenset({1}))] if parts else None)
    nodes = [N("F0", [0], [1], [O(5.0)]), N("F1", [1], [2], [f1]),
             N("B1", [2], [3], [O(1.0)], backward=True),
             N("B0", [1, 3] if b0_reads_a else [3], [4], [O(1.0)], backward=True)]
    return ilp.LevelProblem(values, nodes, n_forward=2, name="parts")


def test_an_input_freed_after_a_child_is_gone_from_its_fragments_later_parts() -> None:
    # a is dead after F1: with parts the peak is a + b + 300 - a, without them a + b + 300
    low = ilp.solve_level(_level_with_parts(True, False), None, minimize_peak=True)
    assert low.stats["peak_bound_bytes"] == pytest.approx(310, abs=1e-3)
    whole = ilp.solve_level(_level_with_parts(False, False), None, minimize_peak=True)
    assert whole.stats["peak_bound_bytes"] == pytest.approx(410, abs=1e-3)
    sp = ilp.solve_level(_level_with_parts(True, False), 320)
    assert sp.objective == pytest.approx(8.0) and 1 in sp.frees[1][0]
    with pytest.raises(ilp.LevelInfeasible):
        ilp.solve_level(_level_with_parts(False, False), 320)
    # when B0 reads a, freeing it after F1 means making it again: F0 runs twice at 320
    again = ilp.solve_level(_level_with_parts(True, True), 320)
    assert again.objective == pytest.approx(13.0)
    assert (0, 0) in again.computes[3] and 1 in again.frees[1][0]
    roomy = ilp.solve_level(_level_with_parts(True, True), 410)
    assert roomy.objective == pytest.approx(8.0) and 1 not in roomy.frees[1][0]


def test_parts_release_only_the_nodes_input_storages() -> None:
    V, N, O = ilp.LevelValue, ilp.LevelNode, ilp.NodeOption
    values = [V("in", 0), V("a", 100, producer=0), V("b", 10, producer=1)]
    bad = O(1.0, 300, parts=[(300, frozenset({2}))])  # b is the node's own output
    with pytest.raises(ValueError, match="parts"):
        ilp.LevelProblem(values, [N("F0", [0], [1], [O(1.0)]), N("F1", [1], [2], [bad])],
                         n_forward=2)


def _store_all(g: Graph) -> tuple[list[tuple[str, int]], int]:
    s = hrockmate.store_all_schedule(g)
    return list(s.steps), s.forward_len


def _two_node_level(saved: int, fast_bwd: float, slow_bwd: float) -> ilp.LevelProblem:
    values = [
        ilp.LevelValue("in", 0, producer=None),
        ilp.LevelValue("y", 10, producer=0),
        ilp.LevelValue("dy", 10, producer=1),
    ]
    nodes = [
        ilp.LevelNode("F", [0], [1], [ilp.NodeOption(5.0, 0, saved), ilp.NodeOption(5.0, 0, 0)]),
        ilp.LevelNode("B", [0, 1], [2], [ilp.NodeOption(fast_bwd, 0), ilp.NodeOption(slow_bwd, 40)],
                      backward=True, pair=0),
    ]
    return ilp.LevelProblem(values, nodes, n_forward=1, name="pair")


def test_options_trade_saved_memory_for_time() -> None:
    p = _two_node_level(saved=100, fast_bwd=1.0, slow_bwd=7.0)
    roomy = ilp.solve_level(p, 1000)
    assert roomy.computes[1] == [(1, 0)] and roomy.objective == pytest.approx(6.0)
    assert (0, 0) in roomy.kept_saved[0]
    # 100 saved bytes + y + dy do not fit in 80: the option without saved memory must be used
    tight = ilp.solve_level(p, 80)
    assert tight.computes[1] == [(1, 1)] and tight.objective == pytest.approx(12.0)
    assert not tight.kept_saved[0]
    with pytest.raises(ilp.LevelInfeasible):
        ilp.solve_level(p, 50)


def test_minimize_peak_reports_the_bound() -> None:
    p = _two_node_level(saved=100, fast_bwd=1.0, slow_bwd=7.0)
    sp = ilp.solve_level(p, None, minimize_peak=True)
    # B with its low-memory option: y (10) + dy (10) + overhead 40
    assert sp.stats["peak_bound_bytes"] == pytest.approx(60, rel=1e-6)
    assert sp.computes[1] == [(1, 1)]


def test_boundary_limit_bounds_saved_bytes() -> None:
    g = training_graph(6, 3)
    lvl = ilp.op_level(g)
    free_run = ilp.solve_level(lvl.problem, None)
    limited = ilp.solve_level(lvl.problem, None, boundary_limit=0)
    # keeping nothing across the boundary forces recomputation in backward
    assert limited.objective > free_run.objective
    steps, fl = ilp.op_steps(lvl, limited)
    kept = hrockmate.simulate(g, hrockmate.Schedule(steps, fl)).bytes_after_forward
    outputs = sum(t.bytes for t in g.tensors if t.role == "output")
    assert kept == outputs


def test_model_is_built_in_bulk_with_stats() -> None:
    g = training_graph(8, 5)
    sp = ilp.solve_level(ilp.op_level(g).problem, 10**6)
    st = sp.stats
    assert st["columns"] > 0 and st["rows"] > 0 and st["nonzeros"] >= st["rows"]
    assert st["status"] == "Optimal" and st["optimal"] is True


def test_level_problem_checks_its_input() -> None:
    values = [ilp.LevelValue("a", 1, producer=1), ilp.LevelValue("b", 1, producer=0)]
    nodes = [
        ilp.LevelNode("n0", [0], [1], [ilp.NodeOption(1.0)]),
        ilp.LevelNode("n1", [], [0], [ilp.NodeOption(1.0)]),
    ]
    with pytest.raises(ValueError, match="topological"):
        ilp.LevelProblem(values, nodes, n_forward=2)
    with pytest.raises(ValueError, match="no options"):
        ilp.LevelProblem([], [ilp.LevelNode("n", [], [], [])], n_forward=1)
    with pytest.raises(ValueError, match="forward nodes must come before"):
        ilp.LevelProblem([], [ilp.LevelNode("n", [], [], [ilp.NodeOption(1.0)], backward=True),
                              ilp.LevelNode("m", [], [], [ilp.NodeOption(1.0)])], n_forward=1)


def test_topological_order_puts_forward_first() -> None:
    g = training_graph(5, 2)
    order = ilp.topological_ops(g)
    phases = [g.ops[j].phase for j in order]
    assert phases == sorted(phases, key=lambda p: p == "backward")
    pos = {j: k for k, j in enumerate(order)}
    prod = g.producers()
    for j, op in enumerate(g.ops):
        for x in op.inputs:
            if prod[x] is not None:
                assert pos[prod[x]] < pos[j]


def test_the_op_level_milp_starts_from_a_known_schedule() -> None:
    from hrockmate.planning.hierarchy import prepare
    from hrockmate.planning.level import block_level, expand_level, op_stages
    from hrockmate.planning.policy import baseline_schedule

    g = training_graph(14, seed=3)
    peak = baseline_schedule(g)[2]
    budget = int(0.7 * peak)
    found = strategies.greedy_eviction_schedule(g, budget)
    assert found is not None
    h = prepare(g, flat_ops=g.num_ops, progress=False)
    lvl = block_level(h.ctx, h.root)
    stages = op_stages(lvl, found[0])
    assert stages is not None
    # stage t runs node t last, after recomputations of earlier forward nodes only
    assert all(stage[-1] == (t, 0) and all(i < t < len(stages) and i < lvl.problem.n_forward
                                           for i, _ in stage[:-1])
               for t, stage in enumerate(stages))
    # the same computations in another order are no schedule of the stage structure
    computes = [s for s in found[0] if s[0] == "compute"]
    swapped = [computes[1], computes[0], *computes[2:]]
    assert op_stages(lvl, swapped) is None

    # with a stall window of milliseconds HiGHS stops on its first schedule: the start's, or a
    # better one
    sp = ilp.solve_level(lvl.problem, budget, stall=1e-3, start=stages)
    assert sp.stats.get("started_from_schedule") is True
    fwd, bwd, _ = expand_level(h.ctx, h.root, lvl, sp)
    peak_milp, time_milp = _sim(g, fwd + bwd, len(fwd))
    assert peak_milp <= budget
    assert time_milp <= _sim(g, *found)[1] * (1 + 1e-9)
    # a start that does not fit the model's columns is not given to HiGHS
    bad = [[(len(stages) - 1, 0)] + stage if t == 0 else stage for t, stage in enumerate(stages)]
    sp = ilp.solve_level(lvl.problem, budget, start=bad)
    assert "started_from_schedule" not in sp.stats


def test_past_its_soft_deadline_a_milp_stops_once_it_has_a_schedule(data_graphs: Path) -> None:
    # the U-Net-like graph's op-level MILP at 50%: HiGHS proves nothing for many seconds; past
    # the solve's improvement window it returns its start at the first poll
    from hrockmate.planning.hierarchy import prepare
    from hrockmate.planning.level import block_level, op_stages
    from hrockmate.planning.policy import baseline_schedule

    g = Graph.load(data_graphs / "unet_like_train.json")
    budget = int(0.5 * baseline_schedule(g)[2])
    found = strategies.greedy_eviction_schedule(g, budget)
    assert found is not None
    h = prepare(g, flat_ops=g.num_ops, progress=False)
    lvl = block_level(h.ctx, h.root)
    stages = op_stages(lvl, found[0])
    t0 = time.perf_counter()
    sp = ilp.solve_level(lvl.problem, budget, start=stages, stall=60.0, time_limit=60.0,
                         soft_deadline=t0)
    assert sp.stats["stopped"] == "window" and not sp.optimal
    assert sp.stats["solve_seconds"] < 30  # (a bound far from the 60 s it could take)


def test_a_block_level_starts_from_its_leanest_schedule(data_graphs: Path) -> None:
    # the top level of the DenseNet log with leaves of 4 at 50%: every forward block runs once
    # keeping least; each backward block runs right after its partner, run again with its
    # option; HiGHS takes seconds to prove the optimum
    from hrockmate.planning.hierarchy import prepare
    from hrockmate.planning.level import block_level
    from hrockmate.planning.policy import baseline_schedule

    g = Graph.load(data_graphs / "densenet_tiny_oplog.json")
    budget = int(0.5 * baseline_schedule(g)[2])
    h = prepare(g, leaf_size=4, progress=False)
    assert h.root.children
    p = block_level(h.ctx, h.root).problem
    stages = ilp.lean_start(p)
    assert len(stages) == len(p.nodes)
    for t, stage in enumerate(stages):
        node, option = stage[-1]
        assert node == t and all(i < p.n_forward for i, _ in stage[:-1])
        if t < p.n_forward:
            assert len(stage) == 1
            saved = [o.saved for o in p.nodes[t].options]
            assert saved[option] == min(saved)
        elif p.nodes[t].pair is not None:
            assert (p.nodes[t].pair, option) in stage  # its partner, with its option
    start_time = sum(p.nodes[i].options[o].time for stage in stages for i, o in stage)

    # a start that counts as a schedule in hand: past the window HiGHS stops at its first
    # poll, on the start (it fits the budget) or on a better one found by then
    sp = ilp.solve_level(p, budget, start=stages, soft_deadline=time.perf_counter(),
                         time_limit=60.0)
    assert sp.stats.get("started_from_schedule") and sp.stats.get("stopped") == "window"
    assert sp.objective <= start_time * (1 + 1e-9)
    sp = ilp.solve_level(p, budget, start=stages, time_limit=60.0, last_resort_start=True)
    assert sp.stats.get("started_from_schedule") and sp.objective < start_time * (1 - 1e-6)


@pytest.mark.parametrize("leaf_size", [4, 6])
def test_a_blocks_lowest_peak_starts_lean_and_stops_at_its_floor(
        data_graphs: Path, leaf_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # the blocks of the resnet-like graph: started from the leanest schedule, the lowest-peak
    # MILP is proven at its floor (what the stages' own ops hold); without the floor HiGHS
    # finds the same lowest peak (the floor cuts nothing off), proving it later
    from hrockmate.planning.hierarchy import prepare
    from hrockmate.planning.level import block_level

    g = Graph.load(data_graphs / "resnet_like_train.json")
    h = prepare(g, leaf_size=leaf_size, progress=False, workers=1)
    stack, levels = list(h.root.children), []
    while stack:
        b = stack.pop()
        stack.extend(b.children)
        p = block_level(h.ctx, b).problem
        if p.n_forward < len(p.nodes):
            levels.append(p)
    assert len(levels) >= 4
    for p in levels:
        floored = ilp.solve_level(p, None, minimize_peak=True, boundary_limit=0.0,
                                  start=ilp.lean_start(p), time_limit=60.0)
        assert floored.optimal and floored.stats["started_from_schedule"]
        with monkeypatch.context() as m:
            m.setattr(ilp, "_peak_floor", lambda *a: 0.0)
            plain = ilp.solve_level(p, None, minimize_peak=True, boundary_limit=0.0,
                                    time_limit=60.0)
        assert plain.optimal
        assert floored.stats["peak_bound_bytes"] == pytest.approx(
            plain.stats["peak_bound_bytes"], rel=1e-6)


class _Event:
    """What highspy hands a callback: ``data_out`` and ``interrupt()``."""

    def __init__(self, objective: float = math.inf) -> None:
        self.data_out = types.SimpleNamespace(objective_function_value=objective,
                                              mip_gap=math.inf)
        self.interrupted = False

    def interrupt(self) -> None:
        self.interrupted = True


class _ReportingHighs(HighsStandIn):
    """A HiGHS stand-in that reports schedules ``(seconds after the start, objective)`` and
    polls its MIP interrupt callbacks every 10 ms until told to stop (or ``seconds`` pass)."""

    def __init__(self, reports: list[tuple[float, float]], seconds: float = 5.0,
                 gap: Callable[[float], float] = lambda t: 0.1) -> None:
        super().__init__()
        self.reports, self.seconds, self.gap = reports, seconds, gap
        self.reported = 0  # schedules reported before the run ended
        self.interrupted = False  # whether a callback stopped it (else its seconds ran out)
        self.last_gap: float | None = None  # the gap it reported at its last poll

    def run(self) -> None:
        t0 = time.perf_counter()
        todo = sorted(self.reports)
        while time.perf_counter() - t0 < self.seconds:
            while todo and time.perf_counter() - t0 >= todo[0][0]:
                for fn in self.cbMipImprovingSolution:
                    fn(_Event(todo.pop(0)[1]))
                self.reported += 1
            poll = _Event()
            poll.data_out.mip_gap = self.gap(time.perf_counter() - t0)  # (HiGHS's relative gap)
            self.last_gap = poll.data_out.mip_gap
            for fn in self.cbMipInterrupt:
                fn(poll)
            if poll.interrupted:
                self.interrupted = True
                return
            time.sleep(0.01)


def test_a_start_of_last_resort_does_not_end_the_window() -> None:
    # past its soft deadline a MIP stops on its first schedule; a start of last resort (the
    # objective 100 reported at once) does not count: it stops on the better one at 0.6 s
    # (which schedules the stand-in reported before it was stopped, not how long it ran)
    h = _ReportingHighs([(0.0, 100.0), (0.6, 50.0)])
    why = ilp.run_highs(h, soft_deadline=time.perf_counter())
    assert why == "window" and h.interrupted and h.reported == 1
    h = _ReportingHighs([(0.0, 100.0), (0.6, 50.0)])
    why = ilp.run_highs(h, soft_deadline=time.perf_counter(), count_below=100.0)
    assert why == "window" and h.interrupted and h.reported == 2
    # the start reported with rounding below its own cost is still the start
    h = _ReportingHighs([(0.0, 100.0 * (1 - 1e-12)), (0.6, 50.0)])
    why = ilp.run_highs(h, soft_deadline=time.perf_counter(), count_below=100.0)
    assert why == "window" and h.interrupted and h.reported == 2
    # nor does it start the stall rule's clock: the stand-in runs out its second unstopped
    h = _ReportingHighs([(0.0, 100.0)], seconds=1.0)
    why = ilp.run_highs(h, stall=0.1, count_below=100.0)
    assert why is None and not h.interrupted and h.reported == 1


def test_a_barren_search_stops_at_its_deadline_only_without_a_schedule() -> None:
    # nothing found (the start of last resort aside): it stops at the barren deadline
    h = _ReportingHighs([(0.0, 100.0)], seconds=5.0)
    why = ilp.run_highs(h, barren_deadline=time.perf_counter() + 0.3, count_below=100.0)
    assert why == "barren" and h.interrupted and h.reported == 1
    # a schedule found before it: the search goes on (here to the stand-in's own end)
    h = _ReportingHighs([(0.0, 100.0), (0.1, 50.0)], seconds=1.0)
    why = ilp.run_highs(h, barren_deadline=time.perf_counter() + 0.3, count_below=100.0)
    assert why is None and not h.interrupted and h.reported == 2


def test_the_window_ends_a_search_only_within_its_gap() -> None:
    # a schedule in hand past the soft deadline, but HiGHS's gap still 60%: the search goes on
    # until the gap is within WINDOW_MAX_GAP (here from 0.5 s on)
    h = _ReportingHighs([(0.0, 100.0)], seconds=3.0, gap=lambda t: 0.6 if t < 0.5 else 0.1)
    why = ilp.run_highs(h, soft_deadline=time.perf_counter(), window_gap=ilp.WINDOW_MAX_GAP)
    assert why == "window" and h.interrupted and h.last_gap == 0.1
    assert ilp.CLOSE_GAP < 0.1 <= ilp.WINDOW_MAX_GAP < 0.6
    # a gap HiGHS never closes: the stall rule ends it
    h = _ReportingHighs([(0.0, 100.0)], seconds=3.0, gap=lambda t: 0.6)
    why = ilp.run_highs(h, soft_deadline=time.perf_counter(), stall=0.3,
                        window_gap=ilp.WINDOW_MAX_GAP)
    assert why == "stall" and h.interrupted
    # without a gap to wait for (op levels), the window ends it at once
    h = _ReportingHighs([(0.0, 100.0)], seconds=3.0, gap=lambda t: 0.6)
    why = ilp.run_highs(h, soft_deadline=time.perf_counter())
    assert why == "window" and h.interrupted and h.reported == 1 and h.last_gap == 0.6
