"""Which method runs and what replaces it: the single fallback policy of ``solve_graph``.

Every candidate is simulated; the plan never costs more than the simple strategies at the
same budget, and recompute-all is the last resort (the log says why)."""

from __future__ import annotations

import logging
import math
import sys
import time as _time
from dataclasses import dataclass, field
from typing import Any, Mapping

from hrockmate.ir.graph import Graph
from hrockmate.ir.plan import InfeasibleBudget, SolveError
from hrockmate.ir.schedule import SimulationResult, Step
from hrockmate.planning import ilp
from hrockmate.planning import strategies as reference
from hrockmate.planning.hierarchy import (
    NEAR_STORE_ALL_MIN_BUDGET,
    REFINE_TIME_SHARE,
    TOP_TIME_SHARE,
    Hierarchy,
    HierarchyTimeout,
    prepare,
    solve_top,
)
from hrockmate.progress import elapsed_progress

logger = logging.getLogger("hrockmate")

METHODS = ("hrockmate", "checkmate", "checkpoint", "selective", "greedy", "twremat", "rotor",
           "recompute-all", "store-all")

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

    @property
    def hierarchy_planned(self) -> bool:
        """The hierarchy made a plan: this one, or one that a simple strategy's (this) beat."""
        return not self.stats.get("fallback") or bool(self.stats.get("beats_hierarchy_plan"))


def lowest_peak_top(h: Hierarchy, time_limit: float | None
                    ) -> tuple[list[Step], int, bool, dict[str, Any]]:
    """The hierarchy's plan of least peak: ``solve_top`` for the least peak. An op-level top
    starts from block checkpointing's least-peak schedule: without it, the op-level MILP
    stalled far above that (the U-Net-like test graph: 80.3% of the store-all peak against
    checkpointing's 79.1%; from it, 57.1%). A block level starts from its leanest schedule."""
    starts: list[list[Step]] = []
    if not h.root.children:
        points = [p for p in reference.checkpoint_points(h.graph) if p.steps is not None]
        if points:
            lowest = min(points, key=lambda p: (p.peak, p.time))
            assert lowest.steps is not None
            starts.append(lowest.steps)
    return solve_top(h, None, time_limit=time_limit, mip_rel_gap=1e-3, minimize_peak=True,
                     starts=starts)


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def time_left(kw: Mapping[str, Any]) -> float | None:
    """Seconds left of the solve's ``time_limit`` (None: no limit)."""
    deadline = kw.get("deadline")
    return None if deadline is None else max(0.0, deadline - _time.perf_counter())


# Tries that can only improve a plan in hand stop this many seconds into the solve (the default
# of ``solve_graph(improve_time=)``, ``kw["improve_until"]``, ``improve_seconds``; what follows
# them takes about a second more): later
# leaf sizes, the op-level second try of small graphs, the hierarchical retry of a graph planned
# at the op level, and an op-level MILP that starts from a schedule (greedy eviction's or the
# hierarchy's, which HiGHS then only improves). On the graphs of at most 400 ops of
# benches/simple_strategies.py at 50% such tries took solves to 13-15 s: the op-level MILP of a
# 53-op U-Net found nothing better than its start in 13 s of HiGHS, a 64-op CNN's and a 78-op
# U-Net's second tries nothing in 11-12 s. Only a search with no plan in hand at all runs on to
# the time limit. Their messages about fallbacks are logged at INFO (``kw["log_level"]``): the
# plan returned says what it is.
IMPROVE_SECONDS = 9.0

# With ``improve_time="auto"`` (the default) a larger graph gets a longer window:
# IMPROVE_SECONDS per IMPROVE_OPS ops, at most IMPROVE_MAX_SECONDS, as the solve-time targets
# grow with the graph (10 s up to 1,000 ops, 30 s for the 6,248-op enc-dec). At 9 s the 12-layer
# GPT-2 (1,666 ops, op times measured on an H100) was planned with one leaf size only: the first
# took 5.5 s on a 2-core machine, the second would take 6.6 s and plan +2.9% at 70% of store-all
# where the first planned +7.0% (90%: +1.0 against +1.7%; 50%: +11.5 against +12.3%).
IMPROVE_OPS = 1000
IMPROVE_MAX_SECONDS = 20.0


def improve_window(improve_time: float | str | None, num_ops: int) -> float | None:
    """Seconds of a solve's improvement window: ``improve_time`` as given (None: no window),
    or for ``"auto"`` the window of a graph of ``num_ops`` ops."""
    if improve_time != "auto":
        return improve_time  # type: ignore[return-value]
    return min(IMPROVE_MAX_SECONDS, IMPROVE_SECONDS * max(1.0, num_ops / IMPROVE_OPS))


# Later leaf sizes and the op-level second try are not tried once a plan costs at most this
# much over store-all (the most they could gain): at 90% of store-all most plans of the
# never-costlier benchmark were within 0.1-0.8%, and trying every size took their solves from
# 1.5-3 s to 5-8 s.
MIN_GAIN_TO_RETRY = 0.01


def improve_seconds(until: float | None, left: float | None) -> float | None:
    """Seconds for a try that can only improve a plan in hand: what is left until ``until``
    (the end of the solve's improvement window, a ``time.perf_counter`` time; None: no window),
    within ``left`` (seconds left of the time limit, or None). None: under 1 s; ``math.inf``:
    neither a window nor a time limit."""
    limit = math.inf if until is None else until - _time.perf_counter()
    if left is not None:
        limit = min(limit, left)
    return None if limit < 1.0 else limit


def limited(kw: Mapping[str, Any], seconds: float, **extra: Any) -> dict[str, Any]:
    """``kw`` for a try of at most ``seconds`` (``math.inf``: no limit), with ``extra``."""
    bounded = math.isfinite(seconds)
    return {**kw, **extra, "time_limit": seconds if bounded else None,
            "deadline": _time.perf_counter() + seconds if bounded else None}


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


def run_method(graph: Graph, method: str, budget: int, hierarchy: Hierarchy | None,
                kw: dict[str, Any]) -> tuple[Candidate | None, int]:
    """The method's candidate within the budget, or (None, the lowest peak that was reached).

    When a MILP gives nothing within the budget, the low-memory schedules met on the way
    (recompute-all, the MILP's own lowest-peak schedule, block checkpointing) are tried; the
    fastest that fits is returned, marked not optimal."""
    from hrockmate.ir.schedule import recompute_all_schedule

    spares: list[tuple[Candidate, int, float]] = []  # (candidate, peak, time)
    # (a second call for the same budget, with the low-peak model, shares the first's)
    simple_memo: list[SimpleStrategies] = kw["simple_memo"] if "simple_memo" in kw else []

    def simple_strategies() -> SimpleStrategies:
        # once per call: before a block level's top MILP (whether one fits bounds how long that
        # MILP may search without finding a schedule), then as the plans it must beat
        if not simple_memo:
            simple_memo.append(_simple_strategies(graph, budget, method, time_left(kw)))
        return simple_memo[0]

    def spare(label: str, steps: list[Step], fl: int, **stats: Any) -> None:
        peak, t = simulate_steps(graph, steps, fl)
        spares.append((Candidate(steps, fl, False, {"method": method, "fallback": label,
                                                       **stats}), peak, t))

    def add_recompute_all() -> None:
        # the last resort, built only when a fallback is wanted: on a 6k-op graph building and
        # simulating it took a second that a solve with a plan does not need
        try:
            rc = recompute_all_schedule(graph)
        except MemoryError as exc:  # TooLargeError: O(n^2) steps on a long chain
            if method == "recompute-all":
                raise
            logger.info("no recompute-all fallback for '%s': %s", graph.name, exc)
        else:
            spare("recompute-all", rc.steps, int(rc.forward_len))

    if method == "recompute-all":
        add_recompute_all()
        spares[0][0].stats.pop("fallback")
        return _pick(spares, budget, method, graph)
    if method in ("checkpoint", "selective"):
        try:
            r = reference.solve_checkpoint(graph, budget, selective=method == "selective")
        except reference.SolverInfeasible as exc:
            # keeping no block at all is recompute-all, the checkpointing with least memory
            add_recompute_all()
            cand, lowest = _pick(spares, budget, method, graph)
            return cand, int(min(lowest, exc.min_bytes))
        return Candidate(r.steps, r.forward_len, False, {"method": method, **r.stats}), 0

    if method in ("twremat", "rotor"):
        return _run_literature(graph, method, budget, time_left(kw))
    if method == "greedy":
        found = reference.greedy_eviction_schedule(graph, budget, time_left(kw))
        if found is not None and simulate_steps(graph, *found)[0] <= budget:
            return Candidate(found[0], found[1], False, {"method": "greedy"}), 0
        add_recompute_all()
        cand, lowest = _pick(spares, budget, method, graph)
        if cand is not None:
            logger.warning("greedy eviction got stuck for '%s' within %d bytes; using %s",
                           graph.name, budget, cand.stats["fallback"])
        return cand, lowest

    if method == "checkmate":
        try:
            r = reference.solve_checkmate(graph, budget, time_limit=time_left(kw),
                                          mip_rel_gap=kw["mip_rel_gap"])
            cand = Candidate(r.steps, r.forward_len, r.optimal, {"method": "checkmate",
                                                                  **r.stats})
            return _within_budget(graph, budget, cand), 0
        except (reference.SolverInfeasible, ilp.LevelInfeasible) as exc:
            # not proven infeasible (time limit, too large): say why before falling back
            proven = getattr(exc, "proven", True)
            logger.log(logging.INFO if proven else logging.WARNING, "checkmate: %s", exc)
        try:
            steps, fl, _, _ = reference.min_peak_checkmate(graph, time_left(kw))
            spare("lowest-peak MILP", steps, fl)
        except (ilp.LevelInfeasible, ilp.LevelNoSolution):
            pass
    else:
        # the blocks' options near store-all: solved for and offered at high budgets only
        near_store_all = budget >= NEAR_STORE_ALL_MIN_BUDGET * kw["baseline_peak"]
        try:
            h = hierarchy if hierarchy is not None else prepare(
                graph, flat_ops=kw["flat_ops"], leaf_size=kw["leaf_size"],
                group_size=kw["group_size"], top_size=kw["top_size"],
                time_limit=time_left(kw), sub_time_limit=kw["sub_time_limit"],
                mip_rel_gap=kw["mip_rel_gap"], progress=kw["progress"], solvers=kw["solvers"],
                near_store_all=near_store_all, low_peak=kw.get("low_peak", False))
        except HierarchyTimeout as exc:
            if kw.get("plan_in_hand"):
                # a later try (another leaf size) whose blocks did not fit the window: the
                # fallbacks were weighed by the first try at this budget already
                logger.info("the blocks of '%s' with leaves of %d ops were not all solved "
                            "within the improvement window; the plan in hand is kept",
                            graph.name, kw["leaf_size"])
                return None, 0
            logger.log(kw.get("log_level", logging.WARNING), "%s; using the simple strategies "
                       "(raise time_limit to let the hierarchy finish)", exc)
            h = None
        if h is not None:
            stats_h = {"method": "hrockmate", "levels": h.root.depth(), "blocks": h.blocks,
                       "solved_blocks": h.solved_blocks, "solvers": dict(h.solvers),
                       "block_solvers": h.solver_counts(), "lean_blocks": h.lean,
                       "hierarchy_seconds": round(h.seconds, 4), "leaf_size": h.leaf_size}
            if h.low_peak:
                stats_h["low_peak"] = True

            until = kw.get("improve_until")

            def top(b: int) -> reference.SolverResult:
                # (first: whether a simple strategy fits bounds a search that finds nothing)
                fallback_fits = bool(h.root.children and until is not None
                                     and not kw.get("plan_in_hand") and simple_strategies().fits)
                left = time_left(kw)
                if left is not None and h.root.children:  # (a flat level is the whole solve)
                    left *= TOP_TIME_SHARE
                starts = []
                if not h.root.children:
                    # the op-level MILP starts from a known plan (the hierarchy's own, in
                    # kw["starts"], on a second try) or greedy eviction's: it has a schedule at
                    # once, and a search that finds nothing better stops on the stall rule
                    # instead of the time limit
                    starts += kw.get("starts", [])
                    found = reference.greedy_eviction_schedule(graph, b, left)
                    starts += [found[0]] if found is not None else []
                    if starts and until is not None:  # a plan in hand: HiGHS only improves it
                        left = improve_seconds(until, left) or 1.0
                # a top MILP that begins within the improvement window ends with it once it has
                # a schedule (MobileNet at 30%: found at 8.5 s into the solve, then 5 s more of
                # the stall rule); one that begins later (large graphs) runs on its stall rule
                now = _time.perf_counter()
                soft = until if until is not None and now < until else None
                if soft is not None and kw.get("top_shares"):
                    # its share of what is left, when other leaf sizes follow it
                    soft = now + (soft - now) / kw["top_shares"]
                if soft is not None and not kw.get("plan_in_hand"):
                    # the solve's first plan gets TOP_WINDOW_MIN_SECONDS whenever it begins
                    soft = max(soft, now + TOP_WINDOW_MIN_SECONDS)
                # when a simple strategy fits, a block level's top MILP that has found no
                # schedule of its own by the window's end, and TOP_BARREN_SECONDS at least,
                # stops there (transformers' Mamba at 50%: 240 s without one, then greedy's
                # plan); improve_time=None asks for searches to the time limit
                barren = (max(until, now + TOP_BARREN_SECONDS)
                          if fallback_fits and until is not None else None)
                if barren is not None and soft is not None and kw.get("top_shares", 0) > 1:
                    # other leaf sizes follow: one that has found nothing by the end of its
                    # share gives way to them (the mlp-mixer log at 30%: leaves of 6 found
                    # their first schedule 8 s into the 9 s window; 9 and 12 plan it faster;
                    # the never-costlier benchmark: the enc-dec log at 30% +16.68 -> +14.06%)
                    barren = soft
                level = "op-level" if not h.root.children else "top"
                with elapsed_progress(f"{level} MILP of '{graph.name}'", left, kw["progress"]):
                    steps, fl, optimal, stats = solve_top(
                        h, b, time_limit=left, mip_rel_gap=kw["mip_rel_gap"], starts=starts,
                        soft_deadline=soft, barren_deadline=barren,
                        near_store_all=near_store_all)
                return reference.SolverResult(steps, fl, optimal, stats)

            # an op-level MILP cut short by the time limit may lose to the hierarchy
            flat = not h.root.children and kw["flat_ops"] > 0
            try:
                r = top(budget)
                cand = _within_budget(graph, budget, Candidate(
                    r.steps, r.forward_len, r.optimal, {**stats_h, **r.stats}))
                cand = _refined(graph, budget, cand, kw)
                retry = improve_seconds(until, time_left(kw))
                if (flat and not cand.optimal and kw.get("hierarchy_retry", True)
                        and retry is not None):
                    alt, _ = run_method(graph, method, budget, None,
                                        limited(kw, retry, flat_ops=0, log_level=logging.INFO))
                    if alt is not None and (
                            simulate_steps(graph, alt.steps, alt.forward_len)[1]
                            < simulate_steps(graph, cand.steps, cand.forward_len)[1]):
                        return alt, 0
                if (h.root.children or not cand.optimal) and not kw.get("plan_in_hand"):
                    # (with a plan in hand the first try weighed these at this budget already)
                    # the hierarchy's memory model is conservative; near its lowest budgets block
                    # checkpointing, or Rotor on a chain-shaped graph, can be faster, and both cost
                    # little to check; so can greedy eviction, refined, where an op-level MILP
                    # was cut short (the U-Net-like graph at 50%: +38.33% against +38.44%)
                    best, best_time = cand, simulate_steps(graph, cand.steps, cand.forward_len)[1]
                    own_time = best_time
                    for alt, _peak, alt_time in simple_strategies().fits:
                        if alt_time < best_time:
                            # the hierarchy's figures stay (top_solver, ...): what it did, its
                            # plan's time and what beat it
                            alt.stats = {**cand.stats, **alt.stats, "optimal": False,
                                         "beats_hierarchy_plan": True,
                                         "hierarchy_plan_time": own_time}
                            best, best_time = alt, alt_time
                    if best is not cand:  # the fallback gets the same refinement
                        best = _refined(graph, budget, best, kw)
                    return best, 0
                return cand, 0
            except ilp.LevelInfeasible:
                if h.root.children and not h.low_peak:
                    # below the least peak of the blocks' options: their low-peak model frees
                    # what a block's backward makes again after its last read, and plans lower
                    # budgets (``prepare(low_peak=True)``; Checkmate's MobileNet 20.3 -> 19.1%
                    # of store-all), blocks solved again within the time left
                    logger.info("'%s' has no schedule within %d bytes with these blocks' "
                                "options; solving the blocks again with the low-peak model",
                                graph.name, budget)
                    # (the leaf size of a hierarchy the caller prepared, not the default's)
                    return run_method(graph, method, budget, None,
                                      {**kw, "leaf_size": h.leaf_size, "low_peak": True,
                                       "simple_memo": simple_memo})
                if kw.get("plan_in_hand"):
                    return None, 0
            except ilp.LevelNoSolution as exc:
                if kw.get("plan_in_hand"):
                    return None, 0
                logger.info("%s", exc)
                if flat and kw.get("hierarchy_retry", True):
                    logger.info("no op-level schedule for '%s' in %s s; solving hierarchically",
                                graph.name, kw["time_limit"])
                    return run_method(graph, method, budget, None, {**kw, "flat_ops": 0})
            try:
                # (a spare, and the lowest peak to report when nothing fits: not needed when a
                # simple strategy fits, which is nearly always faster than a lowest-peak plan)
                if kw.get("lowest_peak", True) and not simple_strategies().fits:
                    with elapsed_progress(f"lowest-peak MILP of '{graph.name}'", time_left(kw),
                                          kw["progress"]):
                        steps, fl, _, _ = lowest_peak_top(h, time_left(kw))
                    spare("lowest-peak H-ILP", steps, fl, **stats_h)
            except (ilp.LevelInfeasible, ilp.LevelNoSolution):
                pass
    add_recompute_all()
    simple = simple_strategies()
    spares.extend(simple.fits)
    cand, lowest = _pick(spares, budget, method, graph)
    if cand is not None and method == "hrockmate":
        cand = _refined(graph, budget, cand, kw)
    minima = simple.lowest
    if "rotor" in minima and (cand is None or cand.stats["fallback"] == "recompute-all"):
        # probed only now that it is reported: up to six of Rotor's dynamic programs (2 s on a
        # 6k-op graph) that a solve with a plan does not need
        minima["rotor"] = rotor_lowest(graph, minima["rotor"], time_left(kw))
    if cand is None:
        lowest = min([lowest, *minima.values()])
    else:
        if cand.stats["fallback"] == "recompute-all":
            reached = [f"{k} {v} bytes" for k, v in minima.items()]
            reached += [f"{k}: {why}" for k, why in simple.why_none.items()]
            cand.notice = (f"{method} found no schedule for '{graph.name}' within {budget} bytes "
                           "and only recompute-all fits (the lowest peaks reached: "
                           + (", ".join(reached) or "none") + ")")
        else:
            cand.notice = (f"{method} found no schedule for '{graph.name}' within {budget} "
                           f"bytes; using {cand.stats['fallback']}")
        if "log_level" in kw:  # a later or second try: the solve's own plan is told at its end
            logger.log(kw["log_level"], "%s", cand.notice)
    return cand, lowest


# A block level's top MILP that has found no schedule of its own (its start of last resort
# aside) stops at the end of the improvement window, and no sooner than this many seconds after
# it started, when a simple strategy already fits the budget.
TOP_BARREN_SECONDS = 30.0

# A top MILP that makes the solve's first plan and begins within the improvement window is
# stopped by it no sooner than this many seconds after it began (once faster simple strategies
# let the demo GPT-2's top MILP at 30% begin 1 s before the window's end, its share of that
# second stopped it at an 11.8% gap: +21.4%, where 0.9 s on its stall rule reach the optimum's
# +20.9%).
TOP_WINDOW_MIN_SECONDS = 2.0

# Greedy eviction gets at least this long even when the time limit has run out: it takes
# milliseconds on graphs of a few thousand ops (30 ms on 327 ops), and without it a solve whose
# blocks used up a short limit fell to recompute-all on a loaded machine.
GREEDY_MIN_SECONDS = 0.25


@dataclass
class SimpleStrategies:
    """What the simple strategies reach at one budget (``_simple_strategies``)."""

    # those within the budget, as (candidate, peak, time), marked as fallbacks
    fits: list[tuple[Candidate, int, float]] = field(default_factory=list)
    # the lowest peak block checkpointing, selective checkpointing and Rotor each reach (for the
    # log and the error when nothing fits; Rotor's is its chain model's minimum, which
    # ``rotor_lowest`` refines)
    lowest: dict[str, int] = field(default_factory=dict)
    # why one of them has no lowest peak ("rotor": "does not apply, ...")
    why_none: dict[str, str] = field(default_factory=dict)


def _simple_strategies(graph: Graph, budget: int, method: str, time_limit: float | None = None
                       ) -> SimpleStrategies:
    """The simple strategies no plan may lose to, each at its fastest setting within the
    budget: block checkpointing, selective checkpointing, whole-graph Rotor (chain-shaped
    graphs only) and greedy eviction (DTR-style, any graph), within ``time_limit`` seconds."""
    from hrockmate.planning.literature import NotAChainError

    found_simple = SimpleStrategies()
    out, lowest, why_none = found_simple.fits, found_simple.lowest, found_simple.why_none
    deadline = None if time_limit is None else _time.perf_counter() + time_limit
    # shares of the time left: checkpointing 1/4, selective 1/3 of the rest, Rotor half of
    # what remains, greedy eviction the rest
    for share, (label, selective) in ((4, ("checkpoint", False)), (3, ("selective", True))):
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
    try:
        rotor, rotor_lowest = _run_literature(
            graph, "rotor", budget,
            None if deadline is None else max(0.0, deadline - _time.perf_counter()) / 2,
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


def _refined(graph: Graph, budget: int, cand: Candidate, kw: Mapping[str, Any]) -> Candidate:
    """``cand`` with the recomputations its memory slack allows dropped
    (``hrockmate.planning.refine``); ``stats["refined"]`` counts them and gives the time before."""
    from hrockmate.planning.refine import refine

    left = time_left(kw)
    # a share of the time left, less a margin for what follows (the simple strategies; the
    # final simulation of a 40k-step schedule takes ~0.5 s): on the 10k-op LSTM a round takes
    # ~2 s and the later rounds gain little
    r = refine(graph, cand.steps, cand.forward_len, budget,
               deadline=None if left is None
               else _time.perf_counter() + min(left - 1.0, REFINE_TIME_SHARE * left))
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


