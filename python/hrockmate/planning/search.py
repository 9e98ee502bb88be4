"""The search on top of the methods: the leaf-size sweep and the op-level retry.

``search`` runs a method (``methods.solve``) once, or, for ``"hrockmate"``, once per leaf size
(``best_over_leaf_sizes``) and then, on small graphs whose hierarchy plan is weak, at the op
level (``op_level_retry``). A try that can only improve a plan in hand gets the time the
improvement window leaves it (``SolveContext.improve_seconds``); the constants that steer the
search are in ``hrockmate.planning.context``. The low-peak retry of the hierarchy (blocks solved
again with the low-peak model below the least peak of their default options) is the second
half of one try of the method, in ``policy``: it shares the first half's simple strategies.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterator, Sequence

from hrockmate.ir.graph import Graph
from hrockmate.planning import methods
from hrockmate.planning.bounds import TimeBound, time_lower_bound
from hrockmate.planning.context import (
    BOUND_SECONDS,
    MIN_GAIN_TO_RETRY,
    OP_LEVEL_RETRY_RECOMPUTE,
    OP_LEVEL_RETRY_SECONDS,
    SolveContext,
    improve_seconds,
)
from hrockmate.planning.hierarchy import Hierarchy, leaf_sizes
from hrockmate.planning.methods import Candidate, Infeasible

logger = logging.getLogger("hrockmate")


def search(graph: Graph, method: str, budget: int, ctx: SolveContext, *,
           hierarchy: Hierarchy | Sequence[Hierarchy] | None = None,
           leaf_size: int | None = None, exact_ops: int = 100) -> Candidate | Infeasible:
    """The fastest plan ``method`` makes within ``budget`` bytes over the tries the search
    gives it, simulated; or why there is none (the lowest peak reached)."""
    found = best_over_leaf_sizes(graph, method, budget, hierarchy, leaf_size, ctx)
    if (method == "hrockmate" and hierarchy is None
            and ctx.flat_ops < graph.num_ops <= exact_ops):
        found = op_level_retry(graph, method, budget, found, ctx)
    return found


def op_level_retry(graph: Graph, method: str, budget: int, found: Candidate | Infeasible,
                   ctx: SolveContext) -> Candidate | Infeasible:
    """``found``, or the op-level MILP's plan where it is faster. Tried on graphs small enough
    for it when the hierarchy's own plan lost to a fallback, there is none, or it recomputes
    over ``OP_LEVEL_RETRY_RECOMPUTE`` of store-all's time: long skips, as in U-Nets, are where
    the hierarchy's blocks hold the most. Without a plan it gets ``OP_LEVEL_RETRY_SECONDS``;
    with one it only improves it, within the improvement window."""
    cand = found if isinstance(found, Candidate) else None
    base_time = ctx.baseline_time
    cand_time = math.inf
    if cand is not None:
        cand_time = methods.simulated(graph, cand).time  # type: ignore[assignment]
        if not (cand_time > (1 + MIN_GAIN_TO_RETRY) * base_time
                and (cand.stats.get("fallback")
                     or cand_time > (1 + OP_LEVEL_RETRY_RECOMPUTE) * base_time)):
            return found
    own = cand is not None and cand.hierarchy_planned
    left = ctx.time_left()
    cap = (improve_seconds(ctx.improve_until, left) if cand is not None
           else improve_seconds(None, OP_LEVEL_RETRY_SECONDS if left is None
                                else min(OP_LEVEL_RETRY_SECONDS, left)))
    if cap is None:
        return found
    logger.info("the hierarchy of '%s' fell back or recomputes over %.0f%%; trying the "
                "op-level MILP for up to %.0f s", graph.name, 100 * OP_LEVEL_RETRY_RECOMPUTE, cap)
    # (its own lowest-peak MILP is skipped: slow at the op level, and the hierarchy's
    # fallbacks are already known)
    flat_ctx = ctx.limited(cap, flat_ops=graph.num_ops, log_level=logging.INFO,
                           lowest_peak=False, hierarchy_retry=False,
                           starts=(cand.steps,) if own and cand is not None else ())
    alt = methods.solve(method, graph, budget, flat_ctx)
    if isinstance(alt, Candidate) and not alt.stats.get("fallback"):
        # (as between leaf sizes, the planner's own plan replaces a fallback's that is no
        # faster)
        assert alt.time is not None
        if alt.time < cand_time or (cand is not None and cand.stats.get("fallback")
                                    and alt.time <= cand_time):
            return alt
    if cand is None and isinstance(alt, Infeasible) and isinstance(found, Infeasible):
        return found if found.min_bytes <= alt.min_bytes else alt
    return found


def improving_tries(tries: Sequence[Any], improve_until: float | None,
                    time_left: Callable[[], float | None]) -> Iterator[tuple[Any, float | None]]:
    """Each try (a leaf size, ...) with the seconds it may take: None for the first (the
    solve's own limit), what ``improve_seconds`` leaves for each later one (until
    ``improve_until``); it stops where that is under a second. The caller stops earlier by not
    asking for more."""
    for k, item in enumerate(tries):
        if k == 0:
            yield item, None
            continue
        limit = improve_seconds(improve_until, time_left())
        if limit is None:
            return
        yield item, limit


def best_over_leaf_sizes(graph: Graph, method: str, budget: int,
                         hierarchy: Hierarchy | Sequence[Hierarchy] | None,
                         leaf_size: int | None, ctx: SolveContext) -> Candidate | Infeasible:
    """The method with each hierarchy given, else with each leaf size ``leaf_sizes`` picks
    (method ``"hrockmate"``): the fastest plan, and the lowest budget seen when none.
    A later try gets ``improve_seconds`` (until ``ctx.improve_until``), and none runs once a
    plan is within ``MIN_GAIN_TO_RETRY`` (of store-all's time) of ``ctx.baseline_time`` or of
    the lower bound (``bounds.time_lower_bound``, computed once before the first later try, in
    ``BOUND_SECONDS`` at most; ``stats["lower_bound_time"]``)."""
    if isinstance(hierarchy, Hierarchy):
        return methods.solve(method, graph, budget, ctx.replace(hierarchy=hierarchy))
    if method != "hrockmate":
        return methods.solve(method, graph, budget, ctx)
    tries: list[tuple[int, Hierarchy | None]] = (
        [(h.leaf_size, h) for h in hierarchy] if hierarchy
        else [(size, None) for size in leaf_sizes(graph, leaf_size, ctx.flat_ops)])
    best: Candidate | None = None
    best_time = math.inf
    lows: list[Infeasible] = []
    bound: TimeBound | None = None
    until = ctx.improve_until
    tried = improving_tries(tries, until, ctx.time_left)
    for k, ((size, h), limit) in enumerate(tried):
        ctx_k = ctx.replace(leaf_size=size, hierarchy=h)
        if until is not None and k + 1 < len(tries):
            # the sizes after this one get their turns: its top MILP ends, once it has a
            # schedule, at its share of what is left of the window when it starts (not when
            # the try starts: building the blocks can take most of the window)
            ctx_k = ctx_k.replace(top_shares=len(tries) - k)
        if limit is not None and best is not None and not best.stats.get("fallback"):
            # a later try, the hierarchy's own plan in hand (a fallback's in hand, the later
            # sizes get their turns in the window: the hierarchy may tie or beat it)
            gain = MIN_GAIN_TO_RETRY * ctx.baseline_time
            if best_time <= ctx.baseline_time + gain:
                break  # nothing worth another try is left to gain
            if bound is None:  # what no schedule beats: is there anything left to gain?
                bound = time_lower_bound(graph, budget, time_limit=min(BOUND_SECONDS, limit))
            if best_time <= bound.time + gain:
                logger.info("the plan of '%s' is within %.1f%% of store-all's time of the "
                            "lower bound; no other leaf size tried", graph.name,
                            100 * MIN_GAIN_TO_RETRY)
                break
            limit = ctx.improve_seconds()  # (the bound took some)
            if limit is None:
                break
        if limit is not None:
            # (with a plan in hand, a try that finds nothing returns nothing: no fallbacks)
            ctx_k = ctx_k.limited(limit, log_level=logging.INFO, plan_in_hand=best is not None)
        found = methods.solve(method, graph, budget, ctx_k)
        if isinstance(found, Infeasible):
            lows.append(found)
            continue
        assert found.time is not None
        t = found.time
        # (the hierarchy's own plan also replaces a fallback's that is no faster: greedy
        # eviction refined can tie it, and a plan made by a fallback asks for more search)
        if t < best_time or (best is not None and best.stats.get("fallback")
                             and not found.stats.get("fallback") and t <= best_time):
            if best is not None:
                logger.info("leaves of %d ops planned '%s' faster than leaves of %d", size,
                            graph.name, best.stats.get("leaf_size"))
            best, best_time = found, t
            best.stats.setdefault("leaf_size", size)
    if best is not None:
        if bound is not None:  # (whichever leaf size made the plan)
            best.stats["lower_bound_time"] = bound.time
        return best
    if not lows:
        return Infeasible(0, f"no leaf size was tried for '{graph.name}'")
    return min(lows, key=lambda x: x.min_bytes)
