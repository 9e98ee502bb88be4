"""A lower bound on the time of every schedule of a graph within a memory budget.

It tells how far a plan can be from the best one without solving the whole problem exactly:
a plan at +10.3% over store-all against a bound of +7.7% is at most 2.6 points from optimal.

The argument, on the simulator's rules. Right after the forward segment, what is alive fits the
budget (preexisting storage is not counted). Every forward tensor the backward (or a required
result) reads is then alive, or the op producing it runs again later; an op that runs again
needs each of its forward inputs alive at that point or made again too. Each op that runs again
costs at least its time once. The cheapest set of re-runs that lets the alive set fit is a
small MILP over the forward ops and storages (one binary each: kept alive, run again); any
schedule within the budget recomputes at least that much. The memory of the backward segment is
not counted, so the bound can sit below the optimum, never above it.
"""

from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass

import numpy as np

from hrockmate.ir.budget import BudgetLike, parse_budget
from hrockmate.ir.graph import PREEXISTING_ROLES, Graph
from hrockmate.ir.schedule import REQUIRED_ROLES, peak_lower_bound
from hrockmate.planning import ilp

__all__ = ["TimeBound", "time_lower_bound"]

@dataclass(frozen=True)
class TimeBound:
    """No schedule of the graph within ``budget_bytes`` takes less than ``time``.

    ``baseline_time``: store-all's time (each op once); ``recompute_time``: ``time`` minus it,
    the least recomputation; ``overhead``: that relative to ``baseline_time``. ``proven``: the
    bound's MILP was solved to optimality (else HiGHS's dual bound at the time limit, still a
    valid bound, only looser). ``math.inf`` when not even the forward's needed tensors fit.
    """

    budget_bytes: int
    time: float
    baseline_time: float
    proven: bool
    seconds: float

    @property
    def recompute_time(self) -> float:
        return self.time - self.baseline_time

    @property
    def overhead(self) -> float:
        return self.recompute_time / self.baseline_time if self.baseline_time > 0 else 0.0


def time_lower_bound(graph: Graph, budget: BudgetLike, *,
                     time_limit: float | None = 10.0) -> TimeBound:
    """A lower bound on the time of every schedule of ``graph`` within ``budget`` (the forms
    ``solve_graph`` takes; a fraction is of the store-all peak). ``time_limit`` (seconds) bounds
    the MILP; Ctrl-C stops it."""
    from hrockmate.planning.policy import baseline_schedule

    if time_limit is not None and not (isinstance(time_limit, (int, float))
                                       and math.isfinite(time_limit) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds or None, "
                         f"got {time_limit!r}")
    t0 = _time.perf_counter()
    _steps, _fl, base_peak, base_time = baseline_schedule(graph)
    budget_bytes = parse_budget(budget, base_peak)

    def bound(time: float, proven: bool) -> TimeBound:
        return TimeBound(budget_bytes, time, base_time, proven,
                         round(_time.perf_counter() - t0, 4))

    if budget_bytes >= base_peak:
        return bound(base_time, True)  # store-all fits: nothing need run again
    if budget_bytes < peak_lower_bound(graph)[0]:
        return bound(math.inf, True)  # some op's inputs and outputs alone do not fit
    tensors, ops = graph.tensors, graph.ops
    producer = graph.producers()
    forward = [i for i, op in enumerate(ops) if op.phase == "forward"]
    is_forward = np.zeros(len(ops), dtype=bool)
    is_forward[forward] = True
    root = [graph.storage_root(t) for t in range(len(tensors))]

    def made_in_forward(t: int) -> bool:
        """``t`` is made by a forward op and its storage counts against the budget."""
        p = producer[t]
        return p is not None and bool(is_forward[p]) and (
            tensors[root[t]].role not in PREEXISTING_ROLES)

    b = ilp.ModelBuilder()
    keep: dict[int, int] = {}  # storage root -> column "alive after the forward"
    # costs relative to store-all's time: HiGHS's absolute gap tolerance (1e-6) is then far
    # below what matters, whatever the time unit
    scale = base_time if base_time > 0 else 1.0
    rerun = {j: b.col(float(ops[j].time) / scale, 0.0, 1.0, True) for j in forward}

    def keep_col(t: int) -> int:
        r = root[t]
        if r not in keep:
            keep[r] = b.col(0.0, 0.0, 1.0, True)
        return keep[r]

    def alive_or_made_again(t: int, needed_by: int | None) -> None:
        """keep[root t] + rerun[producer t] >= 1 (needed after the forward), or
        >= rerun[needed_by] (an input of an op that runs again)."""
        cols = [keep_col(t), rerun[producer[t]]]  # type: ignore[index]
        if needed_by is None:
            b.row(cols, [1.0, 1.0], 1.0, math.inf)
        elif needed_by != producer[t]:
            b.row(cols + [rerun[needed_by]], [1.0, 1.0, -1.0], 0.0, math.inf)

    needed = {t for i, op in enumerate(ops) if not is_forward[i] for t in op.inputs
              if made_in_forward(t)}
    needed |= {t for t, x in enumerate(tensors) if x.role in REQUIRED_ROLES
               and made_in_forward(t)}
    for t in sorted(needed):
        alive_or_made_again(t, None)
    for j in forward:
        for t in dict.fromkeys(ops[j].inputs):
            if made_in_forward(t):
                alive_or_made_again(t, j)
    roots = sorted(keep)
    b.row([keep[r] for r in roots], [float(tensors[r].bytes) for r in roots], -math.inf,
          float(budget_bytes))

    h = ilp.new_highs(time_limit, 1e-6)
    h.passModel(b.to_lp())
    ilp.run_highs(h, None if time_limit is None else t0 + time_limit)
    import highspy

    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return bound(math.inf, True)
    info = h.getInfo()
    proven = status == highspy.HighsModelStatus.kOptimal
    # the dual bound is valid whether or not the search finished; before HiGHS has one, the
    # trivial bound (nothing runs again) is
    least = float(info.mip_dual_bound) if math.isfinite(info.mip_dual_bound) else 0.0
    return bound(base_time + max(0.0, least) * scale, proven)
