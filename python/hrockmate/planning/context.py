"""The settings of one solve, and the time and search constants of the planner.

``SolveContext`` is frozen: a sub-solve gets its own context (``limited`` for its share of the
time, ``replace`` for other settings), so no try can change what a later one sees. Every
constant that steers the search or shares out the time lives here, each with the rule it sets;
the modules that use them import them from here.

This module imports nothing from the rest of the planner, so every planning module can use it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time as _time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from hrockmate.ir.schedule import Step

# --- the improvement window ---------------------------------------------------------------

#: Seconds into a solve after which the tries that can only improve a plan in hand stop (later
#: leaf sizes, the op-level second try, the hierarchical retry of a graph planned at the op
#: level, an op-level MILP that starts from a schedule). Only a search with no plan in hand at
#: all runs on to the time limit. The default of ``solve_graph(improve_time=)`` on graphs of up
#: to ``IMPROVE_OPS`` ops, so that they plan in about ten seconds.
IMPROVE_SECONDS = 9.0
#: With ``improve_time="auto"`` a larger graph gets ``IMPROVE_SECONDS`` per this many ops ...
IMPROVE_OPS = 1000
#: ... and at most this long: later leaf sizes on large graphs are worth a longer window, not
#: an unbounded one.
IMPROVE_MAX_SECONDS = 20.0
#: A try that can only improve a plan in hand is not started with less than this many seconds
#: left of the window: it could not finish a top MILP.
MIN_TRY_SECONDS = 1.0

# --- the search over leaf sizes and retries ------------------------------------------------

#: Later leaf sizes and the op-level second try are not tried once a plan costs at most this
#: fraction of store-all's time over store-all, or over the lower bound on the time: that is
#: the most they could gain.
MIN_GAIN_TO_RETRY = 0.01
#: Seconds the time lower bound may take before the later leaf sizes (past the limit its dual
#: bound is still valid, only weaker).
BOUND_SECONDS = 1.0
#: Graphs of more than ``flat_ops`` and at most ``exact_ops`` ops whose hierarchy plan recomputes
#: more than this fraction of store-all's time are also tried at the op level.
OP_LEVEL_RETRY_RECOMPUTE = 0.1
#: The op-level retry of a graph with no plan at all runs for at most this many seconds (with a
#: plan in hand it only gets the improvement window).
OP_LEVEL_RETRY_SECONDS = 60.0

# --- shares of the time limit --------------------------------------------------------------

#: Share of a solve's time limit the blocks' options may use: the top level and the simple
#: strategies need the rest.
HIERARCHY_TIME_SHARE = 0.75
#: Share of the time left after the blocks that a block level's top MILP may use: the simple
#: strategies and the refinement need the rest.
TOP_TIME_SHARE = 0.7
#: Share of the time left that one refinement (``hrockmate.planning.refine``) may use ...
REFINE_TIME_SHARE = 0.2
#: ... less this many seconds for what follows it (the simple strategies, the final simulation).
REFINE_MARGIN_SECONDS = 1.0
#: The simple strategies share the time left in this order: block checkpointing gets 1/4 of it,
#: selective checkpointing 1/3 of the rest, whole-graph Rotor 1/2 of what remains, greedy
#: eviction the rest.
SIMPLE_STRATEGY_SHARES = (4, 3, 2)
#: Greedy eviction gets at least this long even when the time limit has run out: it takes
#: milliseconds on graphs of a few thousand ops, and without it a solve whose blocks used up a
#: short limit would fall to recompute-all.
GREEDY_MIN_SECONDS = 0.25

# --- the top MILP's stopping rules ---------------------------------------------------------

#: A block level's top MILP that has found no schedule of its own (its start of last resort
#: aside) stops at the end of the improvement window, and no sooner than this many seconds
#: after it started, when a simple strategy already fits the budget.
TOP_BARREN_SECONDS = 30.0
#: A top MILP that makes the solve's first plan and begins within the improvement window is
#: stopped by it no sooner than this many seconds after it began: a top MILP started just
#: before the window's end still gets the time to close most of its gap.
TOP_WINDOW_MIN_SECONDS = 2.0
#: The top MILP stops once its best schedule has not improved for this long (nor for half the
#: time it took to find it: ``ilp.run_highs``): proving a schedule optimal can take far longer
#: than finding it.
TOP_STALL_SECONDS = 5.0
#: A schedule better than the best one by less than this (relative) is no improvement for
#: ``ilp.run_highs``'s stall rule.
STALL_IMPROVEMENT = 1e-3
#: The stall rule waits at least this fraction of the time the best schedule took to find ...
STALL_FACTOR = 0.5
#: ... and, for a search that started from a given schedule, this many times the stall time
#: before it gives up improving that start.
START_STALL_FACTOR = 2.0
#: Once HiGHS's relative gap is at most this, what is left to gain is that much at most ...
CLOSE_GAP = 5e-3
#: ... and a best schedule that has not improved for this many seconds ends the search.
CLOSE_GAP_STALL_SECONDS = 1.0
#: The improvement window ends a block level's top search only once HiGHS's relative gap is at
#: most this: a schedule that may be this much slower than the level's optimum is worth the
#: stall rule's time. Op-level MILPs, whose LP bounds are weak, stop at the window whatever
#: their gap.
WINDOW_MAX_GAP = 0.2
#: HiGHS does not poll interrupts inside its sub-MIP heuristics: on Ctrl-C or cancellation
#: ``ilp.run_highs`` waits this long, then returns and leaves HiGHS to stop on its own thread.
INTERRUPT_GRACE_SECONDS = 0.5

# --- the hierarchy ------------------------------------------------------------------------

#: Children per block above the leaves. A small group keeps enough blocks at the top for the
#: top level to place its recomputations (a transformer's layer is about one top block).
GROUP_SIZE = 4
#: Forward ops per leaf block. No single size is best for every graph, so a graph is planned
#: with each size of ``LEAF_SIZES`` in turn (graphs of at most ``LEAF_PORTFOLIO_MAX_OPS`` ops:
#: ``SMALL_GRAPH_LEAF_SIZES``), the later ones only within the improvement window, and the
#: fastest plan is kept. On small graphs 6 goes first (the fastest to solve), and 4 last (the
#: slowest: before 8 and 9 it would spend the window).
LEAF_SIZE = 8
LEAF_SIZES = (LEAF_SIZE, 9)
SMALL_GRAPH_LEAF_SIZES = (6, 8, 9, 4)
#: Graphs of at most this many ops solve in seconds: they get the small-graph leaf sizes.
LEAF_PORTFOLIO_MAX_OPS = 400
#: Options near store-all (``hierarchy.NEAR_STORE_ALL_FRACTIONS``) are solved for, and offered
#: to the top level, only at budgets of at least this fraction of the store-all peak, where a
#: child gives up little of what it keeps; lower, they only make the top MILP larger.
NEAR_STORE_ALL_MIN_BUDGET = 0.8
#: Seconds for one block MILP under a memory limit (the lowest peak, a peak between; the caps
#: on what the forward keeps get ``FRACTION_TIME`` times this).
SUB_TIME_LIMIT = 0.3
#: Time for a block's solves under a cap on what its forward keeps, in sub_time_limits: they
#: are options offered to the parent, and the best schedule found in a few seconds is as good
#: as a proven one.
FRACTION_TIME = 3.0
#: The blocks go lean when, at the pace of those solved so far, the rest would need more than
#: this fraction of the time left (blocks higher up are larger and slower than the leaves that
#: set the pace).
LEAN_MARGIN = 2.0
#: Blocks solved before the pace is trusted.
LEAN_SAMPLE = 20


def improve_window(improve_time: float | str | None, num_ops: int) -> float | None:
    """Seconds of a solve's improvement window: ``improve_time`` as given (None: no window),
    or for ``"auto"`` the window of a graph of ``num_ops`` ops."""
    if improve_time != "auto":
        return improve_time  # type: ignore[return-value]
    return min(IMPROVE_MAX_SECONDS, IMPROVE_SECONDS * max(1.0, num_ops / IMPROVE_OPS))


def improve_seconds(until: float | None, left: float | None) -> float | None:
    """Seconds for a try that can only improve a plan in hand: what is left until ``until``
    (the end of the solve's improvement window, a ``time.perf_counter`` time; None: no window),
    within ``left`` (seconds left of the time limit, or None). None: under
    ``MIN_TRY_SECONDS``; ``math.inf``: neither a window nor a time limit."""
    limit = math.inf if until is None else until - _time.perf_counter()
    if left is not None:
        limit = min(limit, left)
    return None if limit < MIN_TRY_SECONDS else limit


@dataclass(frozen=True)
class SolveContext:
    """What one try of a method sees: the solve's settings, its clock, and what the search
    already knows (a plan in hand, schedules to start from).

    Times are ``time.perf_counter`` values. A sub-solve gets a new context: ``limited`` for a
    try of at most some seconds, ``with_plan`` for a try that can only improve a plan in hand,
    ``replace`` for any other setting."""

    # the solve's options (``solve_graph``)
    time_limit: float | None = None
    mip_rel_gap: float = 1e-4
    flat_ops: int = 60
    leaf_size: int = LEAF_SIZE
    group_size: int = GROUP_SIZE
    top_size: int = 16
    sub_time_limit: float | None = None
    progress: bool = False
    solvers: Mapping[str, str] = field(default_factory=dict)
    # the clock: when the time limit ends, and when the improvement window does (None: none)
    deadline: float | None = None
    improve_until: float | None = None
    # store-all's simulated time and peak: what "over store-all" is measured against
    baseline_time: float = 0.0
    baseline_peak: int = 0
    # a prepared hierarchy for the method "hrockmate" (None: built by the try)
    hierarchy: Any = None
    # the search's state: a plan is in hand (a try that finds nothing returns nothing and
    # weighs no fallbacks); the other leaf sizes still to try after this one, whose turns the
    # top MILP leaves time for (0: none); schedules the op-level MILP may start from
    plan_in_hand: bool = False
    top_shares: int = 0
    starts: tuple[list[Step], ...] = ()
    # the level of the fallback messages of a later or second try (None: the solve's own, told
    # at its end)
    log_level: int | None = None
    # the lowest-peak MILP as a spare when nothing simple fits; the hierarchical retry of a
    # graph planned at the op level; the low-peak model of the blocks' backward
    lowest_peak: bool = True
    hierarchy_retry: bool = True
    low_peak: bool = False
    # what the simple strategies reach at this budget, shared by the low-peak second try with
    # the first (a one-element list once computed; None: each try computes its own)
    simple_memo: list[Any] | None = field(default=None, compare=False)
    # the default-model hierarchy whose low-peak twin this try builds: the twin is kept on it
    # (``Hierarchy.low_peak_twins``) for later solves given that hierarchy
    twin_of: Any = field(default=None, compare=False)

    def time_left(self) -> float | None:
        """Seconds left of the time limit (None: no limit)."""
        return None if self.deadline is None else max(0.0, self.deadline - _time.perf_counter())

    def improve_seconds(self) -> float | None:
        """Seconds for a try that can only improve a plan in hand (``improve_seconds``)."""
        return improve_seconds(self.improve_until, self.time_left())

    def limited(self, seconds: float, **changes: Any) -> SolveContext:
        """This context for a try of at most ``seconds`` from now (``math.inf``: no limit),
        with ``changes``."""
        bounded = math.isfinite(seconds)
        return dataclasses.replace(
            self, **changes, time_limit=seconds if bounded else None,
            deadline=_time.perf_counter() + seconds if bounded else None)

    def with_plan(self, seconds: float, **changes: Any) -> SolveContext:
        """A later try of at most ``seconds`` that can only improve the plan in hand: its
        fallback messages go to INFO, and it returns nothing rather than a fallback."""
        return self.limited(seconds, log_level=logging.INFO, plan_in_hand=True, **changes)

    def replace(self, **changes: Any) -> SolveContext:
        return dataclasses.replace(self, **changes)

    @property
    def fallback_log_level(self) -> int:
        """The level of a message about a fallback: WARNING for the solve's own try."""
        return logging.WARNING if self.log_level is None else self.log_level
