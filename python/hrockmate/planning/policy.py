"""Which method runs and what replaces it: the single fallback policy of ``solve_graph``.

Every candidate is simulated; the plan never costs more than the simple strategies at the
same budget, and recompute-all is the last resort (the log says why)."""

from __future__ import annotations

import logging
import sys
import time as _time
from dataclasses import dataclass, field
from typing import Any, Callable

from hrockmate.ir.graph import Graph
from hrockmate.ir.plan import InfeasibleBudget, SolveError
from hrockmate.ir.schedule import SimulationResult, Step
from hrockmate.planning import ilp
from hrockmate.planning import strategies as reference
from hrockmate.planning.context import (
    GREEDY_MIN_SECONDS,
    NEAR_STORE_ALL_MIN_BUDGET,
    REFINE_MARGIN_SECONDS,
    REFINE_TIME_SHARE,
    SIMPLE_STRATEGY_SHARES,
    TOP_BARREN_SECONDS,
    TOP_TIME_SHARE,
    TOP_WINDOW_MIN_SECONDS,
    SolveContext,
    improve_seconds,
)
from hrockmate.planning.hierarchy import (
    Hierarchy,
    HierarchyTimeout,
    prepare,
    solve_top,
)
from hrockmate.progress import elapsed_progress

logger = logging.getLogger("hrockmate")

def simulate_steps(graph: Graph, steps: list[Step], forward_len: int) -> tuple[int, float]:
    from hrockmate.ir.schedule import Schedule, simulate

    res = simulate(graph, Schedule(steps=list(steps), forward_len=forward_len))
    return int(res.peak_bytes), float(res.time)


def baseline_schedule(graph: Graph) -> tuple[list[Step], int, int, float]:
    from hrockmate.ir.schedule import store_all_schedule

    sched = store_all_schedule(graph)
    steps = [(str(k), int(i)) for k, i in sched.steps]
    peak, t = simulate_steps(graph, steps, int(sched.forward_len))
    return steps, int(sched.forward_len), peak, t



@dataclass
class Candidate:
    steps: list[Step]
    forward_len: int
    optimal: bool
    stats: dict[str, Any]
    # why a fallback was used for want of a plan of the method's own: logged as a warning by
    # ``solve_graph`` when this candidate is the plan returned (a later leaf size may still
    # make one, so the try that fell back does not warn)
    notice: str | None = None
    # the simulated peak (bytes) and time of the schedule, once simulated
    # (``methods.simulated``)
    peak: int | None = None
    time: float | None = None

    @property
    def hierarchy_planned(self) -> bool:
        """The hierarchy made a plan: this one, or one that a simple strategy's (this) beat."""
        return not self.stats.get("fallback") or bool(self.stats.get("beats_hierarchy_plan"))


def lowest_peak_top(h: Hierarchy, time_limit: float | None
                    ) -> tuple[list[Step], int, bool, dict[str, Any]]:
    """The hierarchy's plan of least peak: ``solve_top`` for the least peak. An op-level top
    starts from block checkpointing's least-peak schedule: without a start, the op-level
    MILP can stall above that peak. A block level starts from its leanest schedule."""
    starts: list[list[Step]] = []
    if not h.root.children:
        points = [p for p in reference.checkpoint_points(h.graph) if p.steps is not None]
        if points:
            lowest = min(points, key=lambda p: (p.peak, p.time))
            assert lowest.steps is not None
            starts.append(lowest.steps)
    return solve_top(h, None, time_limit=time_limit, mip_rel_gap=1e-3, minimize_peak=True,
                     starts=starts)


def _run_literature(graph: Graph, method: str, budget: int, time_limit: float | None = None,
                    probe_lowest: bool = True) -> tuple[Candidate | None, int]:
    """TW-Remat or Rotor on the whole graph (hrockmate.planning.literature) within ``time_limit``
    seconds: the candidate, or (None, the lowest peak the method reaches; for Rotor without
    ``probe_lowest`` its chain model's minimum, which ``rotor_lowest`` refines). Raises
    TimeoutError when the time runs out, MemoryError when Rotor's tables cannot fit."""
    from hrockmate.planning import literature

    if method == "twremat":
        points = literature.twremat(graph, time_limit=time_limit)
        fits = [p for p in points if p.sim.peak_bytes <= budget]
        if not fits:
            return None, min(p.sim.peak_bytes for p in points)
        best = min(fits, key=lambda p: p.sim.time)
        sched, stats = best.schedule, {"depth_limit": best.depth_limit}
    else:
        deadline = None if time_limit is None else _time.perf_counter() + time_limit
        try:
            sched, _ = literature.rotor(graph, budget, time_limit=time_limit)
        except InfeasibleBudget as exc:
            if not probe_lowest:
                return None, exc.min_bytes
            left = None if deadline is None else max(0.0, deadline - _time.perf_counter())
            return None, rotor_lowest(graph, exc.min_bytes, left)
        stats = {}
    steps = [(str(k), int(i)) for k, i in sched.steps]
    return Candidate(steps, int(sched.forward_len), False, {"method": method, **stats}), 0


def rotor_lowest(graph: Graph, model_min: int, time_limit: float | None = None) -> int:
    """The smallest budget Rotor is seen to solve. Its dynamic program rounds sizes up to memory
    slots, so the chain model's minimum itself may be out of reach: probe just above it, for
    at most ``time_limit`` seconds in all (then the model's minimum is the answer)."""
    return _rotor_probe(graph, model_min, time_limit)[0]


def _rotor_probe(graph: Graph, model_min: int, time_limit: float | None
                 ) -> tuple[int, SimulationResult | None]:
    """``rotor_lowest``'s budget and the simulation of Rotor's schedule there (None when no
    probe solved)."""
    from hrockmate.planning import literature

    deadline = None if time_limit is None else _time.perf_counter() + time_limit
    for factor in (1.0, 1.0001, 1.001, 1.01, 1.05, 1.2):
        left = None if deadline is None else max(0.0, deadline - _time.perf_counter())
        try:
            _, sim = literature.rotor(graph, int(model_min * factor), time_limit=left)
            return int(model_min * factor), sim
        except InfeasibleBudget:
            continue
        except TimeoutError:
            break
    return model_min, None


def rotor_least_peak(graph: Graph, time_limit: float | None = None) -> int | None:
    """Whole-graph Rotor's least peak, simulated: that of its schedule at the floor of every
    schedule (``peak_lower_bound``), or where its chain model does not go that low, at the
    least budget it is seen to solve (``rotor_lowest``; its chain model's minimum when no
    probe solves within ``time_limit``). None where the graph is not chain-shaped."""
    from hrockmate.ir.schedule import peak_lower_bound
    from hrockmate.planning import literature

    deadline = None if time_limit is None else _time.perf_counter() + time_limit
    try:
        _, sim = literature.rotor(graph, peak_lower_bound(graph)[0], time_limit=time_limit)
    except literature.NotAChainError:
        return None
    except InfeasibleBudget as exc:
        left = None if deadline is None else max(0.0, deadline - _time.perf_counter())
        least, probed = _rotor_probe(graph, exc.min_bytes, left)
        if probed is None:
            return least
        sim = probed
    return int(sim.peak_bytes)


def validate(graph: Graph, c: Candidate, budget_bytes: int) -> tuple[int, float]:
    """Simulate a candidate; a rejected or over-budget schedule is a solver bug."""
    from hrockmate.ir.schedule import ScheduleError

    try:
        peak, t = simulate_steps(graph, c.steps, c.forward_len)
    except ScheduleError as exc:
        raise SolveError(
            f"internal error: method {c.stats.get('method')} produced a schedule the simulator "
            f"rejects for '{graph.name}': {exc}"
        ) from None
    if peak > budget_bytes:
        raise SolveError(
            f"internal error: method {c.stats.get('method')} produced a schedule with peak "
            f"{peak} bytes over the budget of {budget_bytes} bytes for '{graph.name}'"
        )
    return peak, t


class _Run:
    """One call of ``run_method``: what it solves, its context, and the low-memory schedules
    met on the way (spares: (candidate, peak, time)), of which the fastest within the budget
    is the fallback."""

    def __init__(self, graph: Graph, method: str, budget: int, ctx: SolveContext) -> None:
        self.graph, self.method, self.budget, self.ctx = graph, method, budget, ctx
        self.spares: list[tuple[Candidate, int, float]] = []
        # (a second call for the same budget, with the low-peak model, shares the first's)
        self.simple_memo: list[SimpleStrategies] = (
            ctx.simple_memo if ctx.simple_memo is not None else [])

    def simple_strategies(self) -> SimpleStrategies:
        # once per call: before a block level's top MILP (whether one fits bounds how long that
        # MILP may search without finding a schedule), then as the plans it must beat
        if not self.simple_memo:
            self.simple_memo.append(_simple_strategies(self.graph, self.budget, self.method,
                                                       self.ctx.time_left()))
        return self.simple_memo[0]

    def spare(self, label: str, steps: list[Step], fl: int, **stats: Any) -> None:
        peak, t = simulate_steps(self.graph, steps, fl)
        self.spares.append((Candidate(steps, fl, False, {"method": self.method,
                                                         "fallback": label, **stats}), peak, t))

    def add_recompute_all(self) -> None:
        # the last resort, built only when a fallback is wanted: on large graphs building and
        # simulating it takes time that a solve with a plan does not need
        from hrockmate.ir.schedule import simulate

        try:
            rc = reference.recompute_all(self.graph)  # (kept: a refusal's least peak needs it too)
        except MemoryError as exc:  # TooLargeError: O(n^2) steps on a long chain
            if self.method == "recompute-all":
                raise
            logger.info("no recompute-all fallback for '%s': %s", self.graph.name, exc)
        else:
            # simulated as it is: its steps are plain pairs already, and copying its millions
            # of steps on large graphs cost more than the simulation
            res = simulate(self.graph, rc)
            self.spares.append((Candidate(list(rc.steps), int(rc.forward_len), False,
                                          {"method": self.method, "fallback": "recompute-all"}),
                                int(res.peak_bytes), float(res.time)))

    def pick(self) -> tuple[Candidate | None, int]:
        return _pick(self.spares, self.budget, self.method, self.graph)


Found = tuple["Candidate | None", int]


def run_method(graph: Graph, method: str, budget: int, hierarchy: Hierarchy | None,
               ctx: SolveContext) -> Found:
    """The method's candidate within the budget, or (None, the lowest peak that was reached).

    When a MILP gives nothing within the budget, the low-memory schedules met on the way
    (recompute-all, the MILP's own lowest-peak schedule, block checkpointing) are tried; the
    fastest that fits is returned, marked not optimal."""
    run = _Run(graph, method, budget, ctx)
    found = _RUNNERS[method](run, hierarchy)
    return found if found is not None else _fallback(run)


def _recompute_all(run: _Run, _h: Hierarchy | None) -> Found:
    run.add_recompute_all()
    run.spares[0][0].stats.pop("fallback")
    return run.pick()


def _literature(run: _Run, _h: Hierarchy | None) -> Found:
    return _run_literature(run.graph, run.method, run.budget, run.ctx.time_left())


def _checkpointing(run: _Run, _h: Hierarchy | None) -> Found:
    try:
        r = reference.solve_checkpoint(run.graph, run.budget,
                                       selective=run.method == "selective")
    except reference.SolverInfeasible as exc:
        # keeping no block at all is recompute-all, the checkpointing with least memory
        run.add_recompute_all()
        cand, lowest = run.pick()
        return cand, int(min(lowest, exc.min_bytes))
    return Candidate(r.steps, r.forward_len, False, {"method": run.method, **r.stats}), 0


def _layers(run: _Run, _h: Hierarchy | None) -> Found:
    try:
        r = reference.solve_layers(run.graph, run.budget)
    except reference.SolverInfeasible as exc:
        if not exc.min_bytes:  # (no layers at all: say so before falling back)
            logger.warning("%s", exc)
        run.add_recompute_all()
        cand, lowest = run.pick()
        return cand, int(min(lowest, exc.min_bytes) if exc.min_bytes else lowest)
    return Candidate(r.steps, r.forward_len, False, {"method": run.method, **r.stats}), 0


def _greedy(run: _Run, _h: Hierarchy | None) -> Found:
    graph, budget = run.graph, run.budget
    found = reference.greedy_eviction_schedule(graph, budget, run.ctx.time_left())
    if found is not None and simulate_steps(graph, *found)[0] <= budget:
        return Candidate(found[0], found[1], False, {"method": "greedy"}), 0
    run.add_recompute_all()
    cand, lowest = run.pick()
    if cand is not None:
        logger.warning("greedy eviction got stuck for '%s' within %d bytes; using %s",
                       graph.name, budget, cand.stats["fallback"])
    return cand, lowest


def _checkmate(run: _Run, _h: Hierarchy | None) -> Found | None:
    """The op-level MILP's plan; None (its lowest-peak schedule a spare) when it has none."""
    graph, budget, ctx = run.graph, run.budget, run.ctx
    try:
        r = reference.solve_checkmate(graph, budget, time_limit=ctx.time_left(),
                                      mip_rel_gap=ctx.mip_rel_gap)
        cand = Candidate(r.steps, r.forward_len, r.optimal, {"method": "checkmate", **r.stats})
        return _within_budget(graph, budget, cand), 0
    except (reference.SolverInfeasible, ilp.LevelInfeasible) as exc:
        # not proven infeasible (time limit, too large): say why before falling back
        proven = getattr(exc, "proven", True)
        logger.log(logging.INFO if proven else logging.WARNING, "checkmate: %s", exc)
    try:
        steps, fl, _, _ = reference.min_peak_checkmate(graph, ctx.time_left())
        run.spare("lowest-peak MILP", steps, fl)
    except (ilp.LevelInfeasible, ilp.LevelNoSolution):
        pass
    return None


def _prepared(run: _Run, hierarchy: Hierarchy | None, near_store_all: bool
              ) -> Hierarchy | None | Found:
    """The hierarchy to solve the top of: the one given, or one built for the context; None
    when its blocks ran out of time (the fallbacks follow); ``(None, 0)`` when they did on a
    try with a plan in hand (the first try at this budget weighed the fallbacks already)."""
    if hierarchy is not None:
        return hierarchy
    ctx = run.ctx
    try:
        built = prepare(
            run.graph, flat_ops=ctx.flat_ops, leaf_size=ctx.leaf_size,
            group_size=ctx.group_size, top_size=ctx.top_size, time_limit=ctx.time_left(),
            sub_time_limit=ctx.sub_time_limit, mip_rel_gap=ctx.mip_rel_gap,
            progress=ctx.progress, solvers=ctx.solvers, near_store_all=near_store_all,
            low_peak=ctx.low_peak, like=ctx.twin_of)
        if ctx.twin_of is not None and built.low_peak and not built.lean:
            # (a lean twin, cut short by this solve's time, is not kept for solves with more)
            ctx.twin_of.low_peak_twins[twin_key(ctx, near_store_all)] = built
        return built
    except HierarchyTimeout as exc:
        if ctx.plan_in_hand:
            logger.info("the blocks of '%s' with leaves of %d ops were not all solved "
                        "within the improvement window; the plan in hand is kept",
                        run.graph.name, ctx.leaf_size)
            return None, 0
        logger.log(ctx.fallback_log_level, "%s; using the simple strategies "
                   "(raise time_limit to let the hierarchy finish)", exc)
        return None


def twin_key(ctx: SolveContext, near_store_all: bool) -> tuple[Any, ...]:
    """What a low-peak hierarchy built for ``ctx`` depends on besides the graph: the settings
    ``_prepared`` passes to ``prepare``."""
    return (ctx.flat_ops, ctx.leaf_size, ctx.group_size, ctx.top_size, ctx.sub_time_limit,
            ctx.mip_rel_gap, tuple(sorted(dict(ctx.solvers).items())), near_store_all)


def _hierarchy_stats(h: Hierarchy) -> dict[str, Any]:
    stats = {"method": "hrockmate", "levels": h.root.depth(), "blocks": h.blocks,
             "solved_blocks": h.solved_blocks, "solvers": dict(h.solvers),
             "block_solvers": h.solver_counts(), "lean_blocks": h.lean,
             "hierarchy_seconds": round(h.seconds, 4), "leaf_size": h.leaf_size}
    if h.low_peak:
        stats["low_peak"] = True
    return stats


def _top_deadlines(run: _Run, h: Hierarchy, fallback_fits: bool
                   ) -> tuple[float | None, float | None]:
    """(soft, barren) deadlines of a top MILP that begins now (``ilp.run_highs``)."""
    ctx, until = run.ctx, run.ctx.improve_until
    # a top MILP that begins within the improvement window ends with it once it has a
    # schedule; one that begins later (large graphs) runs on its stall rule
    now = _time.perf_counter()
    soft = until if until is not None and now < until else None
    if soft is not None and ctx.top_shares:
        # its share of what is left, when other leaf sizes follow it
        soft = now + (soft - now) / ctx.top_shares
    if soft is not None and not ctx.plan_in_hand:
        # the solve's first plan gets TOP_WINDOW_MIN_SECONDS whenever it begins
        soft = max(soft, now + TOP_WINDOW_MIN_SECONDS)
    # when a simple strategy fits, a block level's top MILP that has found no schedule of
    # its own by the window's end, and TOP_BARREN_SECONDS at least, stops there;
    # improve_time=None asks for searches to the time limit
    barren = (max(until, now + TOP_BARREN_SECONDS)
              if fallback_fits and until is not None else None)
    if barren is not None and soft is not None and ctx.top_shares > 1:
        # other leaf sizes follow: one that has found nothing by the end of its share gives
        # way to them
        barren = soft
    return soft, barren


def _solve_top_at(run: _Run, h: Hierarchy, b: int, near_store_all: bool
                  ) -> reference.SolverResult:
    """The top level of ``h`` at ``b`` bytes within the context's time."""
    ctx, graph = run.ctx, run.graph
    # (first: whether a simple strategy fits bounds a search that finds nothing)
    fallback_fits = bool(h.root.children and ctx.improve_until is not None
                         and not ctx.plan_in_hand and run.simple_strategies().fits)
    left = ctx.time_left()
    if left is not None and h.root.children:  # (a flat level is the whole solve)
        left *= TOP_TIME_SHARE
    starts: list[list[Step]] = []
    if not h.root.children:
        # the op-level MILP starts from a known plan (the hierarchy's own, in ctx.starts, on
        # a second try) or greedy eviction's: it has a schedule at once, and a search that
        # finds nothing better stops on the stall rule instead of the time limit
        starts += ctx.starts
        found = reference.greedy_eviction_schedule(graph, b, left)
        starts += [found[0]] if found is not None else []
        if starts and ctx.improve_until is not None:  # a plan in hand: HiGHS only improves it
            left = improve_seconds(ctx.improve_until, left) or 1.0
    soft, barren = _top_deadlines(run, h, fallback_fits)
    level = "op-level" if not h.root.children else "top"
    with elapsed_progress(f"{level} MILP of '{graph.name}'", left, ctx.progress):
        steps, fl, optimal, stats = solve_top(
            h, b, time_limit=left, mip_rel_gap=ctx.mip_rel_gap, starts=starts,
            soft_deadline=soft, barren_deadline=barren, near_store_all=near_store_all)
    return reference.SolverResult(steps, fl, optimal, stats)


def _hierarchical(run: _Run, hierarchy: Hierarchy | None) -> Found | None:
    """The hierarchy's plan (or a simple strategy's that beats it); None when it has none
    (the fallbacks follow, a lowest-peak schedule among the spares)."""
    graph, budget, ctx = run.graph, run.budget, run.ctx
    # the blocks' options near store-all: solved for and offered at high budgets only
    near_store_all = budget >= NEAR_STORE_ALL_MIN_BUDGET * ctx.baseline_peak
    h = _prepared(run, hierarchy, near_store_all)
    if h is None or isinstance(h, tuple):
        return h
    stats_h = _hierarchy_stats(h)
    # an op-level MILP cut short by the time limit may lose to the hierarchy
    flat = not h.root.children and ctx.flat_ops > 0
    try:
        r = _solve_top_at(run, h, budget, near_store_all)
        cand = _within_budget(graph, budget, Candidate(
            r.steps, r.forward_len, r.optimal, {**stats_h, **r.stats}))
        cand = _refined(graph, budget, cand, ctx)
        retry = ctx.improve_seconds()
        if flat and not cand.optimal and ctx.hierarchy_retry and retry is not None:
            alt, _ = run_method(graph, run.method, budget, None,
                                ctx.limited(retry, flat_ops=0, log_level=logging.INFO,
                                            hierarchy=None))
            if alt is not None and (simulate_steps(graph, alt.steps, alt.forward_len)[1]
                                    < simulate_steps(graph, cand.steps, cand.forward_len)[1]):
                return alt, 0
        if (h.root.children or not cand.optimal) and not ctx.plan_in_hand:
            # (with a plan in hand the first try weighed these at this budget already)
            return _beaten_by_simple(run, cand), 0
        return cand, 0
    except ilp.LevelInfeasible:
        if h.root.children and not h.low_peak:
            # below the least peak of the blocks' options: their low-peak model frees what a
            # block's backward makes again after its last read, and plans lower budgets
            # (``prepare(low_peak=True)``), blocks solved again within the time left
            logger.info("'%s' has no schedule within %d bytes with these blocks' options; "
                        "solving the blocks again with the low-peak model", graph.name, budget)
            # (the leaf size of a hierarchy the caller prepared, not the default's; its
            # low-peak twin where an earlier solve built one with these settings)
            twin_ctx = ctx.replace(leaf_size=h.leaf_size, low_peak=True, hierarchy=None,
                                   simple_memo=run.simple_memo, twin_of=h)
            twin = h.low_peak_twins.get(twin_key(twin_ctx, near_store_all))
            return run_method(graph, run.method, budget, twin, twin_ctx)
        if ctx.plan_in_hand:
            return None, 0
    except ilp.LevelNoSolution as exc:
        if ctx.plan_in_hand:
            return None, 0
        logger.info("%s", exc)
        if flat and ctx.hierarchy_retry:
            logger.info("no op-level schedule for '%s' in %s s; solving hierarchically",
                        graph.name, ctx.time_limit)
            return run_method(graph, run.method, budget, None,
                              ctx.replace(flat_ops=0, hierarchy=None))
    try:
        # (a spare, and the lowest peak to report when nothing fits: not needed when a simple
        # strategy fits, which is nearly always faster than a lowest-peak plan)
        if ctx.lowest_peak and not run.simple_strategies().fits:
            with elapsed_progress(f"lowest-peak MILP of '{graph.name}'", ctx.time_left(),
                                  ctx.progress):
                steps, fl, _, _ = lowest_peak_top(h, ctx.time_left())
            run.spare("lowest-peak H-ILP", steps, fl, **stats_h)
    except (ilp.LevelInfeasible, ilp.LevelNoSolution):
        pass
    return None


def _beaten_by_simple(run: _Run, cand: Candidate) -> Candidate:
    """``cand``, or the fastest simple strategy faster than it (refined in turn). The
    hierarchy's memory model is conservative: near its lowest budgets block checkpointing, or
    Rotor on a chain-shaped graph, can be faster, and both cost little to check; so can greedy
    eviction, refined, where an op-level MILP was cut short."""
    graph = run.graph
    best, best_time = cand, simulate_steps(graph, cand.steps, cand.forward_len)[1]
    own_time = best_time
    for alt, _peak, alt_time in run.simple_strategies().fits:
        if alt_time < best_time:
            # the hierarchy's figures stay (top_solver, ...): what it did, its plan's time and
            # what beat it
            alt.stats = {**cand.stats, **alt.stats, "optimal": False,
                         "beats_hierarchy_plan": True, "hierarchy_plan_time": own_time}
            best, best_time = alt, alt_time
    if best is not cand:  # the fallback gets the same refinement
        best = _refined(graph, run.budget, best, run.ctx)
    return best


def _fallback(run: _Run) -> Found:
    """The fastest spare or simple strategy within the budget (recompute-all the last
    resort), with a notice saying why; else (None, the lowest peak reached)."""
    graph, budget, method, ctx = run.graph, run.budget, run.method, run.ctx
    run.add_recompute_all()
    simple = run.simple_strategies()
    run.spares.extend(simple.fits)
    cand, lowest = run.pick()
    if cand is not None and method == "hrockmate":
        cand = _refined(graph, budget, cand, ctx)
    minima = simple.lowest
    if "rotor" in minima and (cand is None or cand.stats["fallback"] == "recompute-all"):
        # probed only now that it is reported: up to six of Rotor's dynamic programs that a
        # solve with a plan does not need
        minima["rotor"] = rotor_lowest(graph, minima["rotor"], ctx.time_left())
    if cand is None:
        return None, min([lowest, *minima.values()])
    if cand.stats["fallback"] == "recompute-all":
        reached = [f"{k} {v} bytes" for k, v in minima.items()]
        reached += [f"{k}: {why}" for k, why in simple.why_none.items()]
        cand.notice = (f"{method} found no schedule for '{graph.name}' within {budget} bytes "
                       "and only recompute-all fits (the lowest peaks reached: "
                       + (", ".join(reached) or "none") + ")")
    else:
        cand.notice = (f"{method} found no schedule for '{graph.name}' within {budget} "
                       f"bytes; using {cand.stats['fallback']}")
    if ctx.log_level is not None:  # a later or second try: the solve's own plan is told at its end
        logger.log(ctx.log_level, "%s", cand.notice)
    return cand, lowest


#: Each method's own try (``run_method``): a result, or None for the fallbacks (``_fallback``).
_RUNNERS: dict[str, Callable[[_Run, Hierarchy | None], Found | None]] = {
    "hrockmate": _hierarchical,
    "checkmate": _checkmate,
    "checkpoint": _checkpointing,
    "selective": _checkpointing,
    "layers": _layers,
    "greedy": _greedy,
    "twremat": _literature,
    "rotor": _literature,
    "recompute-all": _recompute_all,
}




@dataclass
class SimpleStrategies:
    """What the simple strategies reach at one budget (``_simple_strategies``)."""

    # those within the budget, as (candidate, peak, time), marked as fallbacks
    fits: list[tuple[Candidate, int, float]] = field(default_factory=list)
    # the lowest peak block checkpointing, selective checkpointing, per-layer checkpointing and
    # Rotor each reach (for the log and the error when nothing fits; Rotor's is its chain
    # model's minimum, which ``rotor_lowest`` refines)
    lowest: dict[str, int] = field(default_factory=dict)
    # why one of them has no lowest peak ("rotor": "does not apply, ...")
    why_none: dict[str, str] = field(default_factory=dict)


def _simple_strategies(graph: Graph, budget: int, method: str, time_limit: float | None = None
                       ) -> SimpleStrategies:
    """The simple strategies no plan may lose to, each at its fastest setting within the
    budget: block checkpointing, selective checkpointing, per-layer checkpointing (graphs
    with repeated layers only), whole-graph Rotor (chain-shaped
    graphs only) and greedy eviction (DTR-style, any graph), within ``time_limit`` seconds."""
    from hrockmate.planning.literature import NotAChainError

    found_simple = SimpleStrategies()
    out, lowest, why_none = found_simple.fits, found_simple.lowest, found_simple.why_none
    deadline = None if time_limit is None else _time.perf_counter() + time_limit
    # shares of the time left (SIMPLE_STRATEGY_SHARES), greedy eviction the rest
    checkpoint_share, selective_share, rotor_share = SIMPLE_STRATEGY_SHARES
    for share, (label, selective) in ((checkpoint_share, ("checkpoint", False)),
                                      (selective_share, ("selective", True))):
        left = None if deadline is None else max(0.0, deadline - _time.perf_counter()) / share
        points = reference.checkpoint_points(graph, selective, left, budget)
        lowest[label] = min(p.peak for p in points)
        fits = [p for p in points if p.steps is not None]  # the fastest within the budget
        if fits:
            best = fits[0]
            assert best.steps is not None and best.forward_len is not None
            out.append((Candidate(best.steps, best.forward_len, False,
                                  {"method": method, "fallback": label, "blocks": best.blocks}),
                        best.peak, best.time))
    # per-layer checkpointing, as the model's own gradient checkpointing applies it: one
    # schedule, built in milliseconds
    layers = reference.layer_checkpoint_schedule(graph)
    if layers is None:
        why_none["layers"] = "does not apply, the graph has no repeated layers"
    else:
        peak, t = simulate_steps(graph, *layers)
        lowest["layers"] = peak
        if peak <= budget:
            out.append((Candidate(layers[0], layers[1], False,
                                  {"method": method, "fallback": "layers"}), peak, t))
    try:
        rotor, rotor_lowest = _run_literature(
            graph, "rotor", budget,
            None if deadline is None else max(0.0, deadline - _time.perf_counter()) / rotor_share,
            probe_lowest=False)
    except NotAChainError:
        rotor = None
        why_none["rotor"] = "does not apply, the graph is not chain-shaped"
    except (TimeoutError, MemoryError) as exc:  # out of time, or tables too large
        logger.info("whole-graph Rotor skipped for '%s': %s", graph.name, exc)
        rotor = None
        why_none["rotor"] = ("out of time" if isinstance(exc, TimeoutError)
                             else "its tables do not fit in memory")
    else:
        if rotor is None:
            lowest["rotor"] = rotor_lowest
        else:
            rotor.stats = {"method": method, "fallback": "rotor"}
            peak, t = simulate_steps(graph, rotor.steps, rotor.forward_len)
            out.append((rotor, peak, t))
    left = None if deadline is None else max(GREEDY_MIN_SECONDS,
                                              deadline - _time.perf_counter())
    found = reference.greedy_eviction_schedule(graph, budget, left)
    if found is not None:
        peak, t = simulate_steps(graph, *found)
        if peak <= budget:
            out.append((Candidate(found[0], found[1], False,
                                   {"method": method, "fallback": "greedy"}), peak, t))
    return found_simple


def _pick(spares: list[tuple[Candidate, int, float]], budget: int, method: str, graph: Graph
          ) -> tuple[Candidate | None, int]:
    fits = [(t, c) for c, peak, t in spares if peak <= budget]
    if fits:
        return min(fits, key=lambda tc: tc[0])[1], 0
    # (no spare at all: the callers take the minimum with block checkpointing's lowest peak)
    return None, int(min((peak for _, peak, _ in spares), default=sys.maxsize))


def _refined(graph: Graph, budget: int, cand: Candidate, ctx: SolveContext) -> Candidate:
    """``cand`` with the recomputations its memory slack allows dropped
    (``hrockmate.planning.refine``); ``stats["refined"]`` counts them and gives the time before."""
    from hrockmate.planning.refine import refine

    left = ctx.time_left()
    # a share of the time left, less a margin for what follows (the simple strategies, the
    # final simulation): the later rounds of a refinement gain little
    r = refine(graph, cand.steps, cand.forward_len, budget,
               deadline=None if left is None else _time.perf_counter()
               + min(left - REFINE_MARGIN_SECONDS, REFINE_TIME_SHARE * left))
    if r is None:
        return cand
    logger.info("refinement dropped %d recomputations of the %s plan for '%s': time %.6g -> "
                "%.6g", r.dropped, cand.stats.get("method"), graph.name, r.time_before, r.time)
    return Candidate(r.steps, r.forward_len, cand.optimal,
                      {**cand.stats, "refined": {"dropped": r.dropped,
                                                 "time_before": r.time_before}})


def _within_budget(graph: Graph, budget: int, cand: Candidate) -> Candidate:
    """``cand`` if its schedule simulates within ``budget``. The MILPs' memory rows leave the
    solver's tolerances out of the budget (``ilp.MEMORY_TOLERANCE_MARGIN``) and the level model
    counts storage as the simulator does, so a schedule over the budget means a corner of the
    storage rules the level model misses: that is logged as a warning with its size (worth a
    report, with the graph) and ``ilp.LevelInfeasible`` raised, and the caller falls back."""
    peak, _t = simulate_steps(graph, cand.steps, cand.forward_len)
    if peak <= budget:
        return cand
    logger.warning("the %s schedule for '%s' simulates %d bytes (%.3g%%) over the budget of %d "
                   "bytes: its level model missed a storage rule (please report this graph); "
                   "falling back", cand.stats.get("method"), graph.name, peak - budget,
                   100.0 * (peak - budget) / max(budget, 1), budget)
    raise ilp.LevelInfeasible(f"the schedule simulates {peak - budget} bytes over the budget")


