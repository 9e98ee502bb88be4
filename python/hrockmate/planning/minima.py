"""The least peak the planner reaches on a graph, with the schedule that reaches it.

An ``InfeasibleBudget`` from the method ``"hrockmate"`` names this peak as the least budget, so
the number has to be one a solve accepts: ``least_peak`` keeps the schedule that reaches it,
and a solve whose search finds nothing within a budget at or above that peak returns that
schedule (``solve_graph``'s fallback "least-peak"). The runtime adds the compiled schedule's
own bytes (``hrockmate.planning.entry``).

The least peak depends on the graph (its sizes, not its op times) and on the options that
decide which schedules are tried (the op-level MILP for graphs of at most ``flat_ops`` ops, the
prepared hierarchies' lowest-peak top), never on the budget asked for: it is computed once per
graph and options and cached, so refusals at two budgets name the same number. Every MILP in it
gets ``LEAST_PEAK_SECONDS`` of its own, whatever the solve that asked has left, for the same
reason.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from hrockmate.ir.graph import Graph
from hrockmate.ir.schedule import Step, simulate

logger = logging.getLogger("hrockmate")

__all__ = ["LeastPeak", "least_peak", "least_peak_for_options", "LEAST_PEAK_SECONDS"]

#: Seconds for each lowest-peak MILP behind the least peak (op-level, or one hierarchy's top).
#: A fixed figure rather than the solve's time left: the least peak must not depend on how long
#: the search at the budget asked for took.
LEAST_PEAK_SECONDS = 30.0
#: Greedy eviction is aimed at the graph's floor plus these shares of the way to store-all.
GREEDY_LADDER = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35)
#: Least peaks kept (graphs and options): each holds one whole-graph schedule.
CACHE_SIZE = 8


@dataclass(frozen=True)
class LeastPeak:
    """The lowest-peak schedule found for a graph: its steps, simulated peak, which strategy
    made it (``label``), and whether the peak is proven the least any schedule reaches
    (``proven``: it meets the graph's floor, ``peak_lower_bound``, or the exact op-level MILP
    proved it optimal; ``proof`` says which)."""

    steps: tuple[Step, ...]
    forward_len: int
    peak: int
    label: str
    proven: bool
    proof: str
    #: every low-peak schedule that was built, as (peak, time, label, steps, forward_len), by
    #: ascending peak: the runtime adds each one's own bytes (generator states of the random
    #: ops it replays, ...), which can reorder them
    schedules: tuple[tuple[int, float, str, tuple[Step, ...], int], ...] = ()


_cache: OrderedDict[tuple[Any, ...], LeastPeak] = OrderedDict()
_lock = threading.Lock()
def _key(graph: Graph, flat_ops: int, hierarchies: Sequence[Any]) -> tuple[Any, ...]:
    # the structure hash covers every size and storage rule a peak depends on; a prepared
    # hierarchy by its leaf size and memory model (the blocks it was built from)
    hs = tuple((getattr(h, "leaf_size", None), bool(getattr(h, "low_peak", False)), id(h))
               for h in hierarchies)
    exact = graph.num_ops <= flat_ops
    return (graph.structure_hash(), exact, hs)


def least_peak(graph: Graph, *, flat_ops: int = 60, hierarchies: Sequence[Any] = ()
               ) -> LeastPeak:
    """The lowest-peak schedule among recompute-all, block and selective checkpointing at
    their leanest, greedy eviction aimed at the graph's floor, and a lowest-peak MILP: the
    exact op-level one on graphs of at most ``flat_ops`` ops, else each prepared hierarchy's
    lowest-peak top (``hierarchies``). Cached per graph and options (``CACHE_SIZE``)."""
    key = _key(graph, flat_ops, hierarchies)
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return hit
    found = _compute(graph, flat_ops, hierarchies)
    with _lock:
        _cache[key] = found
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return found


def least_peak_for_options(graph: Graph, options: dict[str, Any]) -> LeastPeak:
    """``least_peak`` with the ``solve_graph`` options that decide it (``flat_ops``, a prepared
    ``hierarchy`` or several)."""
    h = options.get("hierarchy")
    hierarchies = () if h is None else (h,) if not isinstance(h, (list, tuple)) else tuple(h)
    return least_peak(graph, flat_ops=int(options.get("flat_ops", 60)), hierarchies=hierarchies)


def _compute(graph: Graph, flat_ops: int, hierarchies: Sequence[Any]) -> LeastPeak:
    from hrockmate.ir.schedule import Schedule, peak_lower_bound, store_all_schedule
    from hrockmate.planning import ilp
    from hrockmate.planning import strategies as reference
    from hrockmate.planning.policy import lowest_peak_top

    floor, why = peak_lower_bound(graph)
    found: list[tuple[int, float, str, list[Step], int, bool]] = []
    arrays = graph.to_arrays()  # (once: every schedule below is simulated on it)

    def add(label: str, schedule: Schedule, optimal: bool = False) -> int:
        # a Schedule's steps are (str, int) pairs already: on graphs of thousands of ops,
        # recompute-all has millions of steps, and copying them cost more than simulating
        res = simulate(graph, schedule, graph_arrays=arrays)
        found.append((int(res.peak_bytes), float(res.time), label, schedule.steps,
                      schedule.forward_len, optimal))
        return len(found) - 1

    try:
        add("recompute-all", reference.recompute_all(graph))
    except MemoryError as exc:  # O(n^2) steps on a long chain
        logger.info("no recompute-all schedule for the least peak of '%s': %s", graph.name, exc)
    for label, selective in (("checkpoint", False), ("selective", True)):
        points = [p for p in reference.checkpoint_points(graph, selective) if p.steps is not None]
        if points:
            p = min(points, key=lambda p: (p.peak, p.time))
            assert p.steps is not None and p.forward_len is not None
            add(label, Schedule(p.steps, p.forward_len))
    layers = reference.layer_checkpoint_schedule(graph)
    if layers is not None:
        add("per-layer checkpointing", Schedule(*layers))
    # greedy eviction aimed at a ladder of budgets from the floor up: it gets stuck below
    # what it can reach, and it takes milliseconds per budget. Only peaks matter here, so the
    # rungs are not refined (a refinement takes seconds on graphs of thousands of ops and
    # changes times, not peaks); the one schedule that turns out the least peak is, below.
    base = int(simulate(graph, store_all_schedule(graph), graph_arrays=arrays).peak_bytes)
    greedy_rows: set[int] = set()
    for share in GREEDY_LADDER:
        greedy = _greedy_unrefined(graph, int(floor + share * (base - floor)), arrays)
        if greedy is not None:
            greedy_rows.add(add(f"greedy eviction at {share:.0%} above the floor", greedy))
    if graph.num_ops <= flat_ops:
        try:
            steps, fl, optimal, _ = reference.min_peak_checkmate(graph, LEAST_PEAK_SECONDS)
            add("lowest-peak MILP", Schedule(steps, fl), optimal)
        except (ilp.LevelInfeasible, ilp.LevelNoSolution) as exc:
            logger.info("no lowest-peak MILP schedule for '%s': %s", graph.name, exc)
    for h in hierarchies:
        try:
            steps, fl, _, _ = lowest_peak_top(h, LEAST_PEAK_SECONDS)
            add(f"lowest-peak H-ILP (leaves of {h.leaf_size})", Schedule(steps, fl))
        except (ilp.LevelInfeasible, ilp.LevelNoSolution) as exc:
            logger.info("no lowest-peak H-ILP schedule for '%s': %s", graph.name, exc)
    if not found:
        raise MemoryError(f"no schedule of '{graph.name}' could be built for its least peak")
    least = min(range(len(found)), key=lambda k: (found[k][0], found[k][1]))
    if least in greedy_rows:
        _refine_in_place(graph, found, least)
    found.sort(key=lambda f: (f[0], f[1]))
    peak, _t, label, steps, fl, _optimal = found[0]
    if peak <= floor:
        proven, proof = True, f"it meets the graph's floor ({why})"
    elif any(opt and p == peak for p, _, _, _, _, opt in found):  # (a tie keeps the faster)
        proven, proof = True, "the op-level MILP proved it the least peak of any schedule"
    else:
        proven, proof = False, ""
    return LeastPeak(tuple(steps), fl, peak, label, proven, proof,
                     tuple((p, t, lab, tuple(st), f) for p, t, lab, st, f, _ in found))


def _greedy_unrefined(graph: Graph, budget: int, arrays: dict[str, Any]) -> Any:
    """Greedy eviction's schedule of least (peak, time) over the core's eviction scores,
    as the core makes it (no refinement); None when every score gets stuck."""
    from hrockmate import _native
    from hrockmate.ir.schedule import Schedule, call_native

    best: tuple[int, float, Any] | None = None
    for score in _native.EVICTION_SCORES:
        made = call_native(_native.greedy_eviction, graph, arrays, budget_bytes=int(budget),
                           time_limit=LEAST_PEAK_SECONDS, score=score)
        if made is None:
            continue
        schedule = Schedule.from_arrays(*made)
        res = simulate(graph, schedule, graph_arrays=arrays)
        key = (int(res.peak_bytes), float(res.time))
        if best is None or key < best[:2]:
            best = (key[0], key[1], schedule)
    return None if best is None else best[2]


def _refine_in_place(graph: Graph, found: list[Any], row: int) -> None:
    """Refine the schedule of ``found[row]`` within its own peak, so that the least peak stays
    what the unrefined schedule reached and the schedule kept for it gets faster."""
    import time as _time

    from hrockmate.planning.refine import refine

    peak, _t, label, steps, fl, optimal = found[row]
    r = refine(graph, list(steps), fl, peak, deadline=_time.perf_counter() + LEAST_PEAK_SECONDS)
    if r is not None and r.peak_bytes <= peak:
        found[row] = (int(r.peak_bytes), float(r.time), label, list(r.steps), int(r.forward_len),
                      optimal)


def clear_cache() -> None:
    """Forget every least peak computed (for tests that change the strategies)."""
    from hrockmate.planning import strategies as reference

    with _lock:
        _cache.clear()
    reference.forget_recompute_all()
