"""A lower bound on the time of every schedule of a graph within a memory budget.

It tells how far a plan can be from the best one without solving the whole problem exactly:
a plan at +10.3% over store-all against a bound of +8.4% is at most 1.9 points from optimal.

The argument, on the simulator's rules, at several moments of any schedule. Right after the forward
segment, what is alive fits the budget (preexisting storage is not counted). Every forward
storage the backward (or a required result) reads is then alive, or the op producing it runs
again later; an op that runs again needs each of its forward inputs alive at that moment or made
again later too. Each op that runs again costs at least its time once. The same holds at the
step of the first backward op that allocates memory (the ops that can be it read no output of
another such op; every other one runs after it) and at the steps of a few backward ops spread
over the backward (what their descendants read is alive there or made again after), where the
op's inputs are alive and its allocation comes off the budget. The cheapest set of re-runs
meeting all of these is a MILP (binaries per forward op and per storage and moment); any schedule
within the budget recomputes at least that much. The memory of the backward is counted only at
those steps, so the bound can sit below the optimum (U-Nets, whose skip connections hold
memory there), never above it.
"""

from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from hrockmate.ir.budget import BudgetLike, parse_budget
from hrockmate.ir.graph import PREEXISTING_ROLES, Graph
from hrockmate.ir.schedule import REQUIRED_ROLES, peak_lower_bound
from hrockmate.planning import ilp

__all__ = ["TimeBound", "time_lower_bound"]

# Moments of the backward the second MILP also looks at (the first allocating backward op, and
# more spread over the backward)
BACKWARD_STEPS = 4
# The second MILP runs only when the time the first took, times this, fits what is left.
SECOND_MILP_FACTOR = 3 * (BACKWARD_STEPS + 1)
# Models with more columns than this are solved without HiGHS's presolve: it polls neither the
# time limit nor the interrupt in all of its passes, and on large models it can run far past
# the limit. On smaller models presolve is kept: it does not change the bound.
PRESOLVE_MAX_COLUMNS = 20_000


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
    # The moment after the forward alone first (a fraction of a second; its optimum is a bound
    # already), then with the backward's moments within what is left of the limit: that MILP
    # is tighter but can take seconds, and its dual bound is valid wherever the search stops.
    scale = base_time if base_time > 0 else 1.0
    best, proven = 0.0, False
    for steps in (0, BACKWARD_STEPS):
        spent = _time.perf_counter() - t0
        left = None if time_limit is None else time_limit - spent
        if left is not None and (left <= 0 or (steps and spent * SECOND_MILP_FACTOR > left)):
            # the second model is about (BACKWARD_STEPS + 1) times the first, and building
            # and presolving it grows faster than its size
            break
        b = ilp.ModelBuilder()
        _Model(graph, b, budget_bytes, scale).build(backward_steps=steps)
        least, optimal = _solve(b, left)
        if least == math.inf:
            return bound(math.inf, True)
        if least >= best:
            best, proven = least, optimal
    return bound(base_time + best * scale, proven)


def _solve(b: ilp.ModelBuilder, time_limit: float | None) -> tuple[float, bool]:
    """The MILP's optimum, or HiGHS's dual bound where ``time_limit`` cut the search (valid
    whether or not it finished; 0 before it has one); inf when infeasible. And whether it is
    the optimum."""
    import highspy

    # (the dual bound is what is returned, so a gap of 1e-4 only stops the search sooner)
    h = ilp.new_highs(time_limit, 1e-4)
    lp = b.to_lp()
    if lp.num_col_ > PRESOLVE_MAX_COLUMNS:
        h.setOptionValue("presolve", "off")
    h.passModel(lp)
    ilp.run_highs(h, None if time_limit is None else _time.perf_counter() + time_limit)
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return math.inf, True
    dual = float(h.getInfo().mip_dual_bound)
    return (max(0.0, dual) if math.isfinite(dual) else 0.0,
            status == highspy.HighsModelStatus.kOptimal)


class _Model:
    """The bound's MILP: ``rerun[j]`` (forward op ``j`` runs again after the forward, costing
    its time relative to ``scale``) and, per time point, which storages are alive there."""

    def __init__(self, graph: Graph, b: ilp.ModelBuilder, budget: int, scale: float) -> None:
        self.graph, self.b, self.budget = graph, b, budget
        tensors, ops = graph.tensors, graph.ops
        self.producer = graph.producers()
        self.root = [graph.storage_root(t) for t in range(len(tensors))]
        self.forward = [i for i, op in enumerate(ops) if op.phase == "forward"]
        self.is_forward = np.zeros(len(ops), dtype=bool)
        self.is_forward[self.forward] = True
        # (costs relative to store-all's time: HiGHS's absolute gap tolerance, 1e-6, is then
        # far below what matters, whatever the time unit)
        self.rerun = {j: b.col(float(ops[j].time) / scale, 0.0, 1.0, True) for j in self.forward}

    def made_in_forward(self, t: int) -> int | None:
        """The tensor a forward op made that ``t`` is (``t``, or for a view the backward made,
        the nearest such tensor it views), when its storage counts against the budget."""
        tensors = self.graph.tensors
        if tensors[self.root[t]].role in PREEXISTING_ROLES:
            return None
        while True:
            p = self.producer[t]
            if p is not None and self.is_forward[p]:
                return t
            up = tensors[t].alias_of
            if up is None:
                return None
            t = up

    def build(self, backward_steps: int = 0) -> None:
        """The rows: after the forward, then (``backward_steps`` > 0) at the first backward op
        that allocates memory and at up to ``backward_steps - 1`` more backward ops, spread
        over the backward, each with what its descendants read."""
        ops, tensors = self.graph.ops, self.graph.tensors
        backward = [i for i in range(len(ops)) if not self.is_forward[i]]
        # right after the forward: what the backward or a required result reads
        needed = {t for i in backward for t in ops[i].inputs}
        needed |= {t for t, x in enumerate(tensors) if x.role in REQUIRED_ROLES}
        self.point(needed, self.rerun, self.budget, ())
        if backward_steps <= 0:
            return
        # the step of the first backward op that allocates memory (its own allocation, the
        # least among the ops that can be that one, comes off the budget)
        first, rest = self._first_allocating_backward()
        if first:
            own = ops[first[0]].inputs if len(first) == 1 else ()
            self.point({t for i in rest for t in ops[i].inputs}, self._later_reruns(),
                       self.budget - min(self._allocates(i) for i in first), own)
        # the steps of some allocating backward ops: what the ops after them read (their
        # descendants) is alive there or made again after
        spread = rest[len(rest) // backward_steps::max(1, len(rest) // backward_steps)]
        readers = self.graph.consumers()
        for i in spread[:backward_steps - 1]:
            after = self._descendants(i, readers)
            self.point({t for k in after for t in ops[k].inputs}, self._later_reruns(),
                       self.budget - self._allocates(i), ops[i].inputs)

    def _later_reruns(self) -> dict[int, int]:
        """Columns "runs again after the moment", one per forward op: such a run is a rerun."""
        cols = {j: self.b.col(0.0, 0.0, 1.0, True) for j in self.forward}
        for j, col in cols.items():
            self.b.row([col, self.rerun[j]], [1.0, -1.0], -math.inf, 0.0)
        return cols

    def _descendants(self, i: int, readers: list[list[int]]) -> set[int]:
        """The backward ops that read, directly or not, what backward op ``i`` makes."""
        ops = self.graph.ops
        seen: set[int] = set()
        todo = [i]
        while todo:
            for t in ops[todo.pop()].outputs:
                for k in readers[t]:
                    if k not in seen and not self.is_forward[k]:
                        seen.add(k)
                        todo.append(k)
        return seen

    def point(self, needed: set[int], rerun: dict[int, int], budget: float,
              alive: Iterable[int]) -> None:
        """Rows for one time point: each storage of ``needed`` (tensors read after it) is alive
        there or its producer runs after it (``rerun``); an op that runs after it needs its
        forward inputs alive there or made after it too; ``alive`` (tensors read at it) are;
        what is alive fits ``budget``."""
        tensors, ops = self.graph.tensors, self.graph.ops
        keep: dict[int, int] = {}  # storage -> column "alive at this point"

        def alive_or_made_after(t: int, needed_by: int | None) -> int:
            """Rows for forward-made tensor ``t``; its storage's column."""
            r = self.root[t]
            if r not in keep:
                keep[r] = self.b.col(0.0, 0.0, 1.0, True)
            p = self.producer[t]
            if needed_by is None:
                self.b.row([keep[r], rerun[p]], [1.0, 1.0], 1.0, math.inf)  # type: ignore[index]
            elif needed_by != p:
                self.b.row([keep[r], rerun[p], rerun[needed_by]],  # type: ignore[index]
                           [1.0, 1.0, -1.0], 0.0, math.inf)
            return keep[r]

        made = {self.made_in_forward(t) for t in needed} - {None}
        for t in sorted(made):  # type: ignore[type-var]
            alive_or_made_after(t, None)  # type: ignore[arg-type]
        for j in self.forward:
            for t in dict.fromkeys(ops[j].inputs):
                if self.made_in_forward(t) == t:
                    alive_or_made_after(t, j)
        for t in alive:
            f = self.made_in_forward(t)
            if f is not None:
                self.b.lb[alive_or_made_after(f, None)] = 1.0
        roots = sorted(keep)
        self.b.row([keep[r] for r in roots], [float(tensors[r].bytes) for r in roots],
                   -math.inf, float(budget))

    def _allocates(self, i: int) -> int:
        op, tensors = self.graph.ops[i], self.graph.tensors
        return int(op.workspace) + sum(
            int(tensors[t].bytes) for t in op.outputs
            if tensors[t].alias_of is None and tensors[t].role not in PREEXISTING_ROLES)

    def _first_allocating_backward(self) -> tuple[list[int], list[int]]:
        """The backward ops that allocate memory, split into those that can be the first of
        them to run (they depend on no other) and the rest, which run after it."""
        ops = self.graph.ops
        after = np.zeros(len(self.graph.tensors), dtype=bool)  # made only after such an op
        first: list[int] = []
        rest: list[int] = []
        for i in ilp.topological_ops(self.graph):
            if self.is_forward[i]:
                continue
            follows = any(after[t] for t in ops[i].inputs)
            allocating = self._allocates(i) > 0
            if allocating:
                (rest if follows else first).append(i)
            after[ops[i].outputs] = follows or allocating
        return first, rest
