"""The stage ILP solved with HiGHS, generic over "nodes with options" (see docs/solver.md).

A *level* is a DAG of nodes that read and produce *values* (tensors, or interface tensors of
clusters). Every node has one or more *options*; an option has a run time, an ``overhead`` (bytes
used while the node runs beyond what is alive before it and its outputs: an op's workspace, or
the memory inside a cluster's schedule fragment) and ``saved`` bytes that a forward node keeps
for the backward node paired with it (the cluster's "phantoms"). With one option per node, no
saved memory and op workspaces as overheads, the model is exactly Checkmate's MILP (Jain et al.,
MLSys 2020) with its stage structure:

- stage ``t`` computes node ``t`` (the frontier) and may recompute forward nodes ``i < t``;
  backward nodes run once, in their own stage;
- ``R[t,i,o]``: node ``i`` computed with option ``o`` in stage ``t``;
  ``S[t,x]``: value ``x`` kept from stage ``t-1`` into stage ``t``;
  ``P[t,f,o]``: the memory saved by forward node ``f`` under option ``o`` kept into stage ``t``;
  ``FREE[t,x,k]``: value ``x`` released right after node ``k`` in stage ``t``;
  ``U[t,k]``: memory after node ``k`` in stage ``t`` (continuous, by recurrence);
- every input of a computed node is alive; kept values were alive in the previous stage;
  ``U[t,k]`` plus the node's overhead is within the budget at every step.

Only upper bounds on ``FREE`` are needed: freeing more never hurts feasibility, so the solver
frees whatever the constraints allow. The model is assembled as coordinate triplets and passed to
HiGHS in one ``passModel`` call (row-wise CSR, int32 indices, float64 values).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time as _time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hrockmate.ir.errors import InfeasibleBudget
from hrockmate.ir.graph import (  # noqa: F401  (the planner's names for these graph facts)
    PREEXISTING_ROLES,
    prioritized_topological_order,
    topological_ops,
)
from hrockmate.planning.context import (
    CLOSE_GAP,
    CLOSE_GAP_STALL_SECONDS,
    INTERRUPT_GRACE_SECONDS,
    STALL_FACTOR,
    STALL_IMPROVEMENT,
    START_STALL_FACTOR,
    WINDOW_MAX_GAP,
)

logger = logging.getLogger("hrockmate")



@dataclass
class NodeOption:
    """One way of running a node."""

    time: float
    overhead: int = 0
    saved: int = 0
    # the backward partner needs what this option keeps, even when that costs no bytes
    # (e.g. views of parameters); implied by ``saved > 0``
    keeps: bool = False
    # a child's fragment in parts, cut where inputs it reads go for the last time: per part,
    # (its overhead, the input storages already released before it). A storage the level
    # frees right after the node (``FREE``) goes inside the fragment after its last read, so
    # each part is charged with those storages taken off. None: one part, ``overhead``.
    parts: list[tuple[int, frozenset[int]]] | None = None

    @property
    def pairs(self) -> bool:
        return self.saved > 0 or self.keeps


@dataclass
class LevelNode:
    """A node of a level: an op, or a cluster's forward or backward part."""

    name: str
    inputs: list[int]
    outputs: list[int]
    options: list[NodeOption]
    backward: bool = False
    # for a backward node: the forward node whose option-saved memory (same option index) it uses
    pair: int | None = None
    # per option, the inputs it reads (None: every option reads every input). A backward
    # fragment that recomputes from saved tensors may not read its block's forward inputs, so
    # the level can free them earlier when that option runs.
    option_inputs: list[frozenset[int]] | None = None

    def readers_of(self, x: int) -> list[int]:
        """Indices of the options that read input ``x``."""
        if self.option_inputs is None:
            return list(range(len(self.options)))
        return [o for o, ins in enumerate(self.option_inputs) if x in ins]


@dataclass
class LevelValue:
    """A value of a level. ``bytes`` counts only for values owning their storage."""

    name: str
    bytes: int
    producer: int | None = None  # None: exists before the iteration (never counted or freed)
    keep: bool = False  # never freed once produced (model outputs)
    root: int | None = None  # the value whose storage this one shares (a view), if any
    # a view of a storage made outside the level: keeping the view past the level's forward
    # keeps that storage too (the parent might have freed it), so saving it costs these bytes
    hold_bytes: int = 0


@dataclass
class LevelProblem:
    """Nodes in a topological order (forward nodes first); ``n_forward`` of them are forward."""

    values: list[LevelValue]
    nodes: list[LevelNode]
    n_forward: int
    name: str = ""

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        n = len(self.nodes)
        for i, node in enumerate(self.nodes):
            if not node.options:
                raise ValueError(f"level node '{node.name}' has no options")
            if node.backward != (i >= self.n_forward):
                raise ValueError(
                    f"level node '{node.name}': forward nodes must come before backward nodes"
                )
            for x in node.inputs:
                p = self.values[x].producer
                if p is not None and p >= i:
                    raise ValueError(
                        f"level node '{node.name}' reads '{self.values[x].name}' produced by a "
                        "later node: nodes must be in a topological order"
                    )
            if node.option_inputs is not None and (
                    len(node.option_inputs) != len(node.options)
                    or any(not ins <= set(node.inputs) for ins in node.option_inputs)):
                raise ValueError(
                    f"level node '{node.name}': option_inputs needs one subset of the node's "
                    "inputs per option"
                )
            if any(o.parts is not None for o in node.options):
                self._check_parts(node)
            if node.pair is not None:
                f = self.nodes[node.pair]
                if not node.backward or f.backward or len(f.options) != len(node.options):
                    raise ValueError(
                        f"level node '{node.name}' is paired with '{f.name}': a pair must be a "
                        "backward node and a forward node with the same number of options"
                    )
        for x, v in enumerate(self.values):
            if v.producer is not None and not (0 <= v.producer < n):
                raise ValueError(f"level value '{v.name}' has producer {v.producer} out of range")
            if v.producer is not None and x not in self.nodes[v.producer].outputs:
                raise ValueError(f"level value '{v.name}' is not among its producer's outputs")

    def _check_parts(self, node: LevelNode) -> None:
        # the storages a node's inputs hold: its inputs and the values up their view chains
        owners = set(node.inputs)
        for x in node.inputs:
            r = self.values[x].root
            while r is not None and r not in owners:
                owners.add(r)
                r = self.values[r].root
        outputs = set(node.outputs)
        for o in node.options:
            if o.parts is not None and (not o.parts or any(
                    not frees <= owners or outputs & frees for _, frees in o.parts)):
                raise ValueError(
                    f"level node '{node.name}': an option's parts must release only storages "
                    "of the node's inputs"
                )


@dataclass
class StagePlan:
    """A solved level: per stage, the (node, option) computed in order and the values freed
    after each of them (``frees[t][j]`` after the j-th compute; ``frees_before[t]`` at the stage
    start), plus which forward nodes' saved memory is kept into the next stage."""

    computes: list[list[tuple[int, int]]]
    frees_before: list[list[int]]
    frees: list[list[list[int]]]
    kept_saved: list[set[tuple[int, int]]]
    objective: float
    optimal: bool
    stats: dict[str, Any] = field(default_factory=dict)


class LevelInfeasible(InfeasibleBudget):
    """The level has no schedule within the given budget (proven by the solver, or its
    schedule simulated over the budget: ``policy._within_budget``). An ``InfeasibleBudget``
    whose ``min_bytes`` is 0 (the level's least peak is not known)."""

    def __init__(self, message: str) -> None:
        self._as_solver_signal(message, None)


class LevelNoSolution(Exception):
    """The time limit ran out before the solver found any schedule."""


# ---------------------------------------------------------------------------------------------
# analysis shared by the builder and the extraction


@dataclass
class _Analysis:
    users: list[list[int]]  # value -> nodes reading it directly
    uses: list[list[int]]  # value -> nodes reading it or a view of it (sorted)
    storage: list[int]  # value -> the value owning its storage (itself when not a view)
    need_v: list[int]  # last stage in which the value may be needed
    need_n: list[int]  # last stage in which the node may be (re)computed
    stage_nodes: list[list[int]]  # stage -> computable nodes, ascending


def analyse(p: LevelProblem) -> _Analysis:
    n, nv = len(p.nodes), len(p.values)
    users: list[list[int]] = [[] for _ in range(nv)]
    for j, node in enumerate(p.nodes):
        for x in dict.fromkeys(node.inputs):
            users[x].append(j)
    storage = list(range(nv))
    for x in range(nv):
        r, seen = x, 0
        while p.values[r].root is not None:
            r = p.values[r].root  # type: ignore[assignment]
            seen += 1
            if seen > nv:
                raise ValueError(f"level value '{p.values[x].name}' has a cyclic view chain")
        storage[x] = r
    uses_set: list[set[int]] = [set(u) for u in users]
    for x in range(nv):
        if storage[x] != x:
            uses_set[storage[x]].update(users[x])
    uses = [sorted(s) for s in uses_set]

    need_v = [-1] * nv
    need_n = list(range(n))
    last = n - 1
    for j in range(n - 1, -1, -1):
        node = p.nodes[j]
        if not node.backward:
            m = j
            for x in node.outputs:
                m = max(m, _value_need(p, x, users, need_n, need_v, last))
            # a forward node whose options save memory for a backward partner may be run
            # again (with another option) up to the partner's stage
            need_n[j] = m
    for j, node in enumerate(p.nodes):
        if node.pair is not None:
            f = node.pair
            need_n[f] = max(need_n[f], j)
    for x in range(nv):
        need_v[x] = _value_need(p, x, users, need_n, need_v, last)
    # a view keeps its storage's owner needed as long as itself
    for x in range(nv):
        r = storage[x]
        if r != x:
            need_v[r] = max(need_v[r], need_v[x])

    stage_nodes: list[list[int]] = [[] for _ in range(n)]
    for i, node in enumerate(p.nodes):
        if node.backward:
            stage_nodes[i].append(i)
        else:
            for t in range(i, need_n[i] + 1):
                stage_nodes[t].append(i)
    for s in stage_nodes:
        s.sort()
    return _Analysis(users, uses, storage, need_v, need_n, stage_nodes)


def _value_need(
    p: LevelProblem, x: int, users: list[list[int]], need_n: list[int], need_v: list[int], last: int
) -> int:
    v = p.values[x]
    if v.keep:
        return last
    m = v.producer if v.producer is not None else -1
    for j in users[x]:
        m = max(m, j if p.nodes[j].backward else need_n[j])
    if need_v[x] > m:
        m = need_v[x]
    return m


# ---------------------------------------------------------------------------------------------
# model building


class ModelBuilder:
    """Columns and coordinate-form rows, turned into one HighsLp."""

    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.cost: list[float] = []
        self.integer: list[int] = []
        self.r_idx: list[int] = []
        self.c_idx: list[int] = []
        self.vals: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []

    def col(self, cost: float, lb: float, ub: float, integer: bool) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integer.append(1 if integer else 0)
        return len(self.lb) - 1

    def row(self, cols: list[int], vals: list[float], lo: float, hi: float) -> None:
        r = len(self.row_lo)
        self.row_lo.append(lo)
        self.row_hi.append(hi)
        self.r_idx.extend([r] * len(cols))
        self.c_idx.extend(cols)
        self.vals.extend(vals)

    def to_lp(self) -> Any:
        import highspy

        lp = highspy.HighsLp()
        n_col, n_row = len(self.lb), len(self.row_lo)
        lp.num_col_ = n_col
        lp.num_row_ = n_row
        lp.col_cost_ = np.asarray(self.cost, dtype=np.float64)
        lp.col_lower_ = np.asarray(self.lb, dtype=np.float64)
        lp.col_upper_ = np.asarray(self.ub, dtype=np.float64)
        lp.row_lower_ = np.asarray(self.row_lo, dtype=np.float64)
        lp.row_upper_ = np.asarray(self.row_hi, dtype=np.float64)
        rows = np.asarray(self.r_idx, dtype=np.int64)
        cols = np.asarray(self.c_idx, dtype=np.int32)
        vals = np.asarray(self.vals, dtype=np.float64)
        keep = vals != 0.0  # HiGHS wants no explicit zeros
        rows, cols, vals = rows[keep], cols[keep], vals[keep]
        order = np.argsort(rows, kind="stable")
        start = np.zeros(n_row + 1, dtype=np.int64)
        np.cumsum(np.bincount(rows, minlength=n_row), out=start[1:])
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_ = n_col
        lp.a_matrix_.num_row_ = n_row
        lp.a_matrix_.start_ = start.astype(np.int32)
        lp.a_matrix_.index_ = cols[order]
        lp.a_matrix_.value_ = vals[order]
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
            for i in self.integer
        ]
        return lp


# Taken off the memory rows' right-hand side, in units of the budget: HiGHS accepts a row
# violated by up to its mip_feasibility_tolerance (1e-6) and a binary up to its integrality
# tolerance (1e-6) off 0 or 1, and a memory row sums many binaries; 1e-5 of the budget (10 KB
# of 1 GB) covers both, so no accepted schedule simulates over the budget.
MEMORY_TOLERANCE_MARGIN = 1e-5


@dataclass
class _Model:
    builder: ModelBuilder
    R: list[dict[int, int]]  # stage -> node -> first column (options follow)
    S: dict[tuple[int, int], int]
    P: dict[tuple[int, int, int], int]
    peak_col: int | None
    scale: float


def build_model(
    p: LevelProblem,
    a: _Analysis,
    budget: float | None,
    minimize_peak: bool = False,
    boundary_limit: float | None = None,
) -> _Model:
    """Assemble the stage MILP. With ``minimize_peak`` the budget becomes a variable M that is
    minimised (times are a small tie-break); otherwise the objective is the total time and
    ``budget=None`` leaves memory unconstrained. ``boundary_limit`` bounds the bytes kept from
    the forward stages into the first backward stage (what a cluster saves for its backward)."""
    n = len(p.nodes)
    b = ModelBuilder()
    nv = len(p.values)
    max_bytes = max([v.bytes for v in p.values] + [o.overhead + o.saved for nd in p.nodes
                                                  for o in nd.options] + [1])
    scale = float(budget) if (budget is not None and not minimize_peak) else float(max_bytes)
    unconstrained = budget is None and not minimize_peak
    scale = max(scale, 1.0)
    total_time = sum(max(o.time for o in nd.options) for nd in p.nodes) * n + 1.0
    time_w = 1e-3 / total_time if minimize_peak else 1.0

    counted = [
        x
        for x in range(nv)
        if p.values[x].producer is not None and a.storage[x] == x and p.values[x].bytes > 0
    ]
    mem = [p.values[x].bytes / scale for x in range(nv)]
    counted_mask = np.zeros(nv, dtype=bool)
    counted_mask[counted] = True
    out_mem = [sum(mem[x] for x in dict.fromkeys(nd.outputs) if counted_mask[x]) for nd in p.nodes]

    # R columns
    R: list[dict[int, int]] = []
    for t in range(n):
        cols: dict[int, int] = {}
        for i in a.stage_nodes[t]:
            first = -1
            for o in p.nodes[i].options:
                c = b.col(o.time * time_w, 0.0, 1.0, True)
                if first < 0:
                    first = c
            cols[i] = first
            k = len(p.nodes[i].options)
            if i == t:
                b.row(list(range(first, first + k)), [1.0] * k, 1.0, 1.0)
            elif k > 1:
                b.row(list(range(first, first + k)), [1.0] * k, 0.0, 1.0)
        R.append(cols)

    def rsum(t: int, i: int) -> list[int]:
        first = R[t].get(i)
        if first is None:
            return []
        return list(range(first, first + len(p.nodes[i].options)))

    # S columns: value kept into stage t, for producer < t <= need
    S: dict[tuple[int, int], int] = {}
    for x in range(nv):
        v = p.values[x]
        if v.producer is None:
            continue
        for t in range(v.producer + 1, a.need_v[x] + 1):
            lb = 1.0 if v.keep else 0.0
            S[(t, x)] = b.col(0.0, lb, 1.0, True)

    # P columns: saved memory of (forward node f, option o) kept into stage t, f < t <= partner
    P: dict[tuple[int, int, int], int] = {}
    partner: dict[int, int] = {}
    for j, nd in enumerate(p.nodes):
        if nd.pair is not None:
            partner[nd.pair] = j
    for f, j in partner.items():
        for o, opt in enumerate(p.nodes[f].options):
            if opt.pairs:
                for t in range(f + 1, j + 1):
                    P[(t, f, o)] = b.col(0.0, 0.0, 1.0, True)

    # tie-break: among equally fast schedules prefer keeping fewer bytes (the total penalty
    # stays below half of the smallest op time, so it never trades time for memory)
    times = [o.time for nd in p.nodes for o in nd.options if o.time > 0]
    hold = [p.values[x].hold_bytes / scale for x in range(nv)]
    kept_mem = sum(mem[x] if counted_mask[x] else hold[x] for (_, x) in S)
    if times and kept_mem > 0 and not minimize_peak:
        eps = 0.5 * min(times) / kept_mem
        for (t, x), c in S.items():
            if counted_mask[x]:
                b.cost[c] = eps * mem[x]
            elif hold[x] > 0:
                b.cost[c] = eps * hold[x]

    # keeping requires having had the value in the previous stage
    for (t, x), c in S.items():
        prev = [S[(t - 1, x)]] if (t - 1, x) in S else []
        prod = rsum(t - 1, p.values[x].producer)  # type: ignore[arg-type]
        b.row([c] + prev + prod, [1.0] + [-1.0] * (len(prev) + len(prod)), -math.inf, 0.0)
        r = a.storage[x]
        if r != x and (t, r) in S:  # a view kept implies its storage kept
            b.row([c, S[(t, r)]], [1.0, -1.0], -math.inf, 0.0)
    for (t, f, o), c in P.items():
        prev = [P[(t - 1, f, o)]] if (t - 1, f, o) in P else []
        made = [R[t - 1][f] + o] if f in R[t - 1] else []
        b.row([c] + prev + made, [1.0] + [-1.0] * (len(prev) + len(made)), -math.inf, 0.0)

    # dependencies: inputs alive when a node runs; paired saved memory alive for a backward node
    for t in range(n):
        for j in a.stage_nodes[t]:
            first_j = R[t][j]
            for x in dict.fromkeys(p.nodes[j].inputs):
                v = p.values[x]
                if v.producer is None:
                    continue
                rj = [first_j + o for o in p.nodes[j].readers_of(x)]
                if not rj:
                    continue
                alive = rsum(t, v.producer) + ([S[(t, x)]] if (t, x) in S else [])
                b.row(rj + alive, [1.0] * len(rj) + [-1.0] * len(alive), -math.inf, 0.0)
            f = p.nodes[j].pair
            if f is not None:
                for o, opt in enumerate(p.nodes[f].options):
                    if opt.pairs:
                        have = [P[(t, f, o)]] if (t, f, o) in P else []
                        have += [R[t][f] + o] if f in R[t] else []
                        b.row([R[t][j] + o] + have, [1.0] + [-1.0] * len(have), -math.inf, 0.0)

    if boundary_limit is not None and p.n_forward < n:
        t = p.n_forward
        bc: list[int] = []
        bv: list[float] = []
        for x in range(nv):
            if (t, x) in S and not p.values[x].keep and (counted_mask[x] or hold[x] > 0):
                bc.append(S[(t, x)])
                bv.append(mem[x] if counted_mask[x] else hold[x])
        for (tt, f, o), c in P.items():
            if tt == t:
                bc.append(c)
                bv.append(p.nodes[f].options[o].saved / scale)
        if bc:
            b.row(bc, bv, -math.inf, max(boundary_limit, 0.0) / scale + 1e-9)
    if unconstrained:
        return _Model(b, R, S, P, None, scale)

    # peak variable for the min-peak variant, bounded below by what the stages' own nodes hold
    # (the LP relaxation's bound is weak: without this floor HiGHS often found the lowest peak
    # at once and spent its whole time limit failing to prove it)
    peak_col = (b.col(1.0, _peak_floor(p, a, mem, counted_mask, out_mem, scale), math.inf,
                      False) if minimize_peak else None)
    # memory sums whole bytes: half a byte of slack accepts a peak equal to the budget, and
    # the solver's feasibility and integrality tolerances are taken off, so a solution the
    # solver accepts as feasible is within the budget when its binaries are rounded
    limit = ((float(budget) + 0.5) / scale - MEMORY_TOLERANCE_MARGIN  # type: ignore[arg-type]
             if not minimize_peak else 0.0)

    # outputs a rerun of their node may find alive, per node: kept to the end, or holding the
    # storage of a view another node makes (kept with the view: a view needs its storage)
    pinned: dict[int, list[int]] = {}
    viewed = {a.storage[v] for v in range(nv)
              if a.storage[v] != v and p.values[v].producer != p.values[a.storage[v]].producer}
    for x in counted:
        if p.values[x].keep or x in viewed:
            pinned.setdefault(p.values[x].producer, []).append(x)  # type: ignore[arg-type]

    # memory: U[t,k] by recurrence over the computable nodes of the stage
    counted_by_stage_user: dict[int, list[int]] = {}
    for x in counted:
        for k in [p.values[x].producer] + a.uses[x]:
            counted_by_stage_user.setdefault(k, []).append(x)  # type: ignore[arg-type]
    for t in range(n):
        order = a.stage_nodes[t]
        prev_u: int | None = None
        prev_frees: list[tuple[int, float]] = []
        for k in order:
            u = b.col(0.0, -math.inf, math.inf, False)
            rk = rsum(t, k)
            vals_out = [-(out_mem[k] + p.nodes[k].options[o].saved / scale) for o in range(len(rk))]
            # a node run again while one of its outputs is still alive makes that output again
            # only as a temporary copy: it counts while the node runs, not after (the
            # simulator's rule). AGAIN[t,k,x] <= run, <= kept; continuous: taking it off memory
            # only helps, so it is min(run, kept) where that matters, and integral when they
            # are. Only for pinned outputs: any other can be freed after its last read before
            # the rerun at no cost, which the model already allows
            again_c: list[int] = []
            again_v: list[float] = []
            for x in pinned.get(k, ()):
                if (t, x) in S and rk:
                    c = b.col(0.0, 0.0, 1.0, False)
                    b.row([c] + rk, [1.0] + [-1.0] * len(rk), -math.inf, 0.0)
                    b.row([c, S[(t, x)]], [1.0, -1.0], -math.inf, 0.0)
                    again_c.append(c)
                    again_v.append(mem[x])
            if prev_u is None:
                base_c: list[int] = []
                base_v: list[float] = []
                for x in counted:
                    if (t, x) in S:
                        base_c.append(S[(t, x)])
                        base_v.append(-mem[x])
                for (tt, f, o), c in P.items():
                    if tt == t:
                        base_c.append(c)
                        base_v.append(-p.nodes[f].options[o].saved / scale)
                b.row([u] + rk + base_c + again_c, [1.0] + vals_out + base_v + again_v,
                      0.0, 0.0)
            else:
                fc = [c for c, _ in prev_frees]
                fv = [m for _, m in prev_frees]
                b.row([u, prev_u] + rk + fc + again_c,
                      [1.0, -1.0] + vals_out + fv + again_v, 0.0, 0.0)
            # FREE[t,x,k] for counted values x touched by k
            free_col = {x: b.col(0.0, 0.0, 1.0, True) for x in counted_by_stage_user.get(k, [])}
            # while the node runs its copies count (its option's peak counts every output)
            for cols, vals in _running_rows(p.nodes[k].options, rk, free_col, mem, scale):
                if peak_col is None:
                    b.row([u] + cols + again_c, [1.0] + vals + again_v, -math.inf, limit)
                else:
                    b.row([u, peak_col] + cols + again_c, [1.0, -1.0] + vals + again_v,
                          -math.inf, 0.0)
            prev_frees = []
            for x, c in free_col.items():
                b.row([c] + rk, [1.0] + [-1.0] * len(rk), -math.inf, 0.0)
                if (t + 1, x) in S:
                    b.row([c, S[(t + 1, x)]], [1.0, 1.0], -math.inf, 1.0)
                elif p.values[x].keep:
                    b.ub[c] = 0.0  # kept values are never freed
                for j in a.uses[x]:
                    if j > k and j in R[t]:
                        rj = [R[t][j] + o for o in _readers_of_storage(p, a, j, x)]
                        if rj:
                            b.row([c] + rj, [1.0] * (1 + len(rj)), -math.inf, 1.0)
                prev_frees.append((c, mem[x]))
            prev_u = u
    return _Model(b, R, S, P, peak_col, scale)


def _running_rows(options: list[NodeOption], rk: list[int], free_col: dict[int, int],
                  mem: list[float], scale: float) -> list[tuple[list[int], list[float]]]:
    """The terms, beside ``U[t,k]``, of the rows bounding memory while node ``k`` runs.

    One row, ``sum_o overhead[o] R[o]``, unless an option comes in parts. Then each part of
    each option gets a row: its overhead times ``R[o]``, less the bytes of the inputs released
    before it times their ``FREE[t,x,k]`` (freed after the node means gone after the last
    read). In the row of a part of option ``o`` another option ``o'`` counts with the least
    its own rows allow (its lowest part with all it may release taken off), so the row holds
    whenever ``o'`` is chosen instead."""
    if not rk:
        return [([], [])]
    if all(o.parts is None for o in options):
        return [(list(rk), [o.overhead / scale for o in options])]
    parts = [o.parts if o.parts is not None else [(o.overhead, frozenset())] for o in options]
    least = [min(ov / scale - sum(mem[x] for x in frees) for ov, frees in ps) for ps in parts]
    rows = []
    for o, ps in enumerate(parts):
        for ov, frees in ps:
            vals = list(least)
            vals[o] = ov / scale
            cols = list(rk)
            for x in sorted(frees):
                cols.append(free_col[x])
                vals.append(-mem[x])
            rows.append((cols, vals))
    return rows


def _peak_floor(p: LevelProblem, a: _Analysis, mem: list[float], counted_mask: np.ndarray,
                out_mem: list[float], scale: float) -> float:
    """A lower bound on the model's peak (in units of ``scale``): node t runs in stage t, and
    while it runs, the memory rows count its outputs, what its option saves and needs beside,
    the inputs it reads (freed only after it) and the values kept to the end."""
    nv = len(p.values)
    kept = [x for x in range(nv) if p.values[x].keep and counted_mask[x]]
    floor = 0.0
    for t, nd in enumerate(p.nodes):
        made = [x for x in kept if p.values[x].producer is not None
                and p.values[x].producer < t]  # type: ignore[operator]
        least = math.inf
        for o, opt in enumerate(nd.options):
            read = nd.inputs if nd.option_inputs is None else nd.option_inputs[o]
            alive = {x for x in read if counted_mask[x]}.union(made)
            alive.difference_update(nd.outputs)
            need = -math.inf
            for ov, frees in opt.parts or [(opt.overhead, frozenset())]:
                # (a storage in ``frees`` read through a view is not in ``alive``: nothing to
                # take off then)
                need = max(need, out_mem[t] + (opt.saved + ov) / scale
                           + sum(mem[x] for x in alive - frees))
            least = min(least, need)
        floor = max(floor, least)
    # (a hair below: the rows hold it up to HiGHS's tolerances)
    return max(0.0, floor * (1 - 1e-9) - 1e-9)


# ---------------------------------------------------------------------------------------------
# solving


_THREADS_SET = False


# Models with more nonzeros than this are solved without HiGHS's presolve and symmetry
# detection, which do not poll interrupts: on op-level MILPs of a few hundred ops (millions of
# nonzeros) presolve runs far past the time limit. Without them HiGHS still spends ~3-5 us per
# nonzero setting up before its first interruptible step, so a
# large model is refused up front when that set-up alone would outlast the time left. Level
# problems of the hierarchy are far smaller (thousands of nonzeros).
PRESOLVE_MAX_NONZEROS = 1_000_000
SETUP_SECONDS_PER_NONZERO = 6e-6  # building the model (~1 us) and HiGHS's set-up (~3-5 us)
# Models past this are refused whatever the time limit: ~6 GB of memory in the builder and
# HiGHS (the op-level MILP grows with the square of the graph: ~3.5M nonzeros at 600 ops).
MAX_MODEL_NONZEROS = 40_000_000


def new_highs(time_limit: float | None, mip_rel_gap: float) -> Any:
    import highspy

    global _THREADS_SET
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    if not _THREADS_SET:
        # HiGHS fixes its thread pool size once per process
        h.setOptionValue("threads", 1)
        _THREADS_SET = True
    if time_limit is not None:
        h.setOptionValue("time_limit", float(max(time_limit, 0.01)))
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    return h


class SolveCancelled(Exception):
    """A solve stopped because its caller cancelled it (``cancelled_by``)."""


_cancel = threading.local()  # .event: the threading.Event that cancels this thread's solves


@contextlib.contextmanager
def cancelled_by(event: threading.Event) -> Iterator[None]:
    """Solves run by this thread meanwhile stop (``SolveCancelled``) once ``event`` is set:
    how a caller solving in several threads stops them all, e.g. on Ctrl-C, which only the
    main thread receives."""
    _cancel.event = event
    try:
        yield
    finally:
        _cancel.event = None




def run_highs(h: Any, deadline: float | None = None, stall: float | None = None,
              started_from: bool = False, soft_deadline: float | None = None,
              count_below: float = math.inf, barren_deadline: float | None = None,
              window_gap: float = math.inf) -> str | None:
    """``h.run()`` that Ctrl-C (or the ``cancelled_by`` event) stops within about 0.1 s, and
    ``INTERRUPT_GRACE_SECONDS`` at most (then HiGHS is left to stop on its own thread).

    HiGHS runs on a worker thread while this thread waits; on KeyboardInterrupt, HiGHS's
    interrupt callbacks (polled by its simplex, IPM and MIP loops) tell it to stop, and the
    KeyboardInterrupt is raised again once it has stopped (or once the grace is over). HiGHS
    releases the GIL while it runs, so solves in several threads run in parallel.

    ``deadline`` (a ``time.perf_counter`` time) is a hard stop: HiGHS's own ``time_limit`` is
    checked between phases only, and on large models its presolve and first LP ran minutes
    past it. Past the deadline HiGHS is interrupted and returns the best schedule it has.

    ``stall`` (seconds) stops a MIP whose best schedule has not improved (by more than
    ``STALL_IMPROVEMENT``) for ``max(stall, STALL_FACTOR x the time it took to find it)``, or
    for ``CLOSE_GAP_STALL_SECONDS`` once the gap is within ``CLOSE_GAP``;
    ``started_from``: HiGHS was given a starting schedule, which it reports at once, so that one
    is kept for ``START_STALL_FACTOR x stall`` (HiGHS's own heuristics take that long to find
    anything better on the op-level MILPs of 50-80 ops).
    ``soft_deadline`` (a ``time.perf_counter`` time): past it, a MIP with a schedule in hand
    stops (the solve's improvement window) once HiGHS's relative gap is within ``window_gap``
    (block levels pass ``WINDOW_MAX_GAP``).
    ``count_below``: schedules count for these rules only with an objective below it (a start
    of last resort is returned at the deadline, but does not end the search).
    ``barren_deadline`` (a ``time.perf_counter`` time): past it, a MIP that has found no
    schedule that counts stops (the caller has another plan within the budget).
    Returns why it stopped HiGHS early: ``"deadline"``, ``"stall"``, ``"window"``,
    ``"barren"`` or None.
    """
    cancel: threading.Event | None = getattr(_cancel, "event", None)
    if cancel is not None and cancel.is_set():
        raise SolveCancelled("the solve was cancelled")
    stop = threading.Event()
    why: str | None = None
    started = _time.perf_counter()
    best = [math.inf, started]  # best objective so far, and when it was found
    found = [0]  # how many better schedules HiGHS reported
    gap = [math.inf]  # HiGHS's relative gap, as its MIP loop last reported it

    def interrupt_when_asked(event: Any) -> None:
        if stop.is_set() or (cancel is not None and cancel.is_set()):
            event.interrupt()

    def mip_interrupt_when_asked(event: Any) -> None:
        value = event.data_out.mip_gap
        if math.isfinite(value):
            gap[0] = value
        interrupt_when_asked(event)

    def note_better(event: Any) -> None:
        value = event.data_out.objective_function_value
        # (a start of last resort is the best so far without counting: the same improvement
        # rule then tells a better schedule from HiGHS reporting the start with rounding)
        if value < min(best[0], count_below) - STALL_IMPROVEMENT * abs(value):
            best[0], best[1] = value, _time.perf_counter()
            found[0] += 1
            logger.debug("MIP: better schedule %.6g after %.1f s", value, best[1] - started)

    def stalled() -> bool:
        if stall is None or not math.isfinite(best[0]):
            return False
        quiet = _time.perf_counter() - best[1]
        if gap[0] <= CLOSE_GAP:
            return quiet > CLOSE_GAP_STALL_SECONDS
        window = stall * (START_STALL_FACTOR if started_from and found[0] == 1 else 1.0)
        return quiet > max(window, STALL_FACTOR * (best[1] - started))

    h.cbSimplexInterrupt += interrupt_when_asked
    h.cbIpmInterrupt += interrupt_when_asked
    h.cbMipInterrupt += mip_interrupt_when_asked
    h.cbMipImprovingSolution += note_better
    failure: list[BaseException] = []
    done = threading.Event()

    def solve() -> None:
        try:
            h.run()
        except BaseException as exc:  # handed to the waiting thread
            failure.append(exc)
        finally:
            done.set()

    # (waiting on an Event, not Thread.join: a join interrupted by Ctrl-C can wrongly mark the
    # thread finished on Python 3.11)
    threading.Thread(target=solve, name="highs", daemon=True).start()
    try:
        while not done.wait(0.05):
            if cancel is not None and cancel.is_set():
                stop.set()
                done.wait(INTERRUPT_GRACE_SECONDS)
                break
            if not stop.is_set():
                now = _time.perf_counter()
                if deadline is not None and now > deadline:
                    why = "deadline"
                elif (soft_deadline is not None and now > soft_deadline
                      and math.isfinite(best[0]) and gap[0] <= window_gap):
                    why = "window"
                elif stalled():
                    why = "stall"
                elif (barren_deadline is not None and now > barren_deadline
                      and not math.isfinite(best[0])):
                    why = "barren"
                if why is not None:
                    stop.set()
    except KeyboardInterrupt:
        stop.set()
        done.wait(INTERRUPT_GRACE_SECONDS)
        raise
    finally:
        if done.is_set():  # (an abandoned run keeps them: they stop it at its next poll)
            h.cbSimplexInterrupt -= interrupt_when_asked
            h.cbIpmInterrupt -= interrupt_when_asked
            h.cbMipInterrupt -= mip_interrupt_when_asked
            h.cbMipImprovingSolution -= note_better
    if failure:
        raise failure[0]
    if cancel is not None and cancel.is_set():
        raise SolveCancelled("the solve was cancelled")
    return why


def solve_level(
    p: LevelProblem,
    budget: float | None,
    *,
    time_limit: float | None = None,
    mip_rel_gap: float = 1e-4,
    minimize_peak: bool = False,
    boundary_limit: float | None = None,
    stall: float | None = None,
    start: Sequence[Sequence[tuple[int, int]]] | None = None,
    soft_deadline: float | None = None,
    last_resort_start: bool = False,
    barren_deadline: float | None = None,
    window_gap: float = math.inf,
) -> StagePlan:
    """Solve one level at ``budget`` bytes (or for its smallest peak with ``minimize_peak``).
    ``stall``, ``soft_deadline``: stop once the best schedule stops improving, or once past
    ``soft_deadline`` with a schedule in hand (``run_highs``). ``start``: a known
    schedule, per stage the (node, option) pairs it computes, given to HiGHS as a partial
    solution (``R`` fixed; HiGHS completes the rest or drops it when it does not fit);
    ``last_resort_start``: it is a poor one (``lean_start``), returned at the time limit when
    nothing better was found, but the stall and window rules wait for a better one.
    ``barren_deadline``: past it, a search that found no schedule (the start of last resort
    aside) stops; ``window_gap``: the gap within which ``soft_deadline`` ends it
    (``run_highs``).

    Raises ``LevelInfeasible`` when proven infeasible and ``LevelNoSolution`` when the time limit
    passed without any feasible schedule.
    """
    import highspy

    if time_limit is not None and time_limit <= 0:
        raise LevelNoSolution(f"level '{p.name}': no time left to solve it")
    t0 = _time.perf_counter()
    a = analyse(p)
    _check_size(p, a, time_limit)
    model = build_model(p, a, budget, minimize_peak, boundary_limit)
    lp = model.builder.to_lp()
    t_build = _time.perf_counter() - t0
    # the limit covers building the model too
    h = new_highs(None if time_limit is None else time_limit - t_build, mip_rel_gap)
    if len(lp.a_matrix_.value_) > PRESOLVE_MAX_NONZEROS:
        h.setOptionValue("presolve", "off")
        h.setOptionValue("mip_detect_symmetry", False)
    h.passModel(lp)
    start_cost = None if start is None else _set_start(h, p, model, start)
    started_from = start_cost is not None
    stopped = run_highs(h, None if time_limit is None else t0 + time_limit, stall,
                        started_from and not last_resort_start, soft_deadline,
                        count_below=start_cost if started_from and last_resort_start
                        else math.inf, barren_deadline=barren_deadline,
                        window_gap=window_gap)
    status = h.getModelStatus()
    t_solve = _time.perf_counter() - t0 - t_build
    MS = highspy.HighsModelStatus
    info = h.getInfo()
    stats: dict[str, Any] = {
        "columns": int(lp.num_col_),
        "rows": int(lp.num_row_),
        "nonzeros": int(len(lp.a_matrix_.value_)),
        "build_seconds": round(t_build, 4),
        "solve_seconds": round(t_solve, 4),
        "status": h.modelStatusToString(status),
    }
    if time_limit is not None:
        stats["time_limit"] = round(float(time_limit), 3)  # what this MILP was given
    if started_from:
        stats["started_from_schedule"] = True
    if stopped is not None:
        stats["stopped"] = stopped  # HiGHS was stopped early: at the deadline, or stalled
    if status == MS.kInfeasible:
        raise LevelInfeasible(f"level '{p.name}' has no schedule within {budget} bytes")
    has_solution = info.primal_solution_status == 2  # feasible point available
    if not has_solution:
        if stopped == "barren":
            raise LevelNoSolution(
                f"level '{p.name}': no schedule found in {t_solve:.1f} s, and a simpler plan "
                "fits the budget"
            )
        if status in (MS.kTimeLimit, MS.kInterrupt, MS.kIterationLimit, MS.kSolutionLimit):
            raise LevelNoSolution(
                f"level '{p.name}': no schedule found within the time limit ({time_limit} s)"
            )
        raise LevelInfeasible(
            f"level '{p.name}': the solver found no schedule ({stats['status']})"
        )
    optimal = status == MS.kOptimal
    x = np.asarray(h.getSolution().col_value)
    stats["mip_gap"] = float(info.mip_gap) if math.isfinite(info.mip_gap) else None
    stats["optimal"] = optimal
    plan = extract(p, a, model, x)
    plan.optimal = optimal
    plan.stats = stats
    if model.peak_col is not None:
        plan.stats["peak_bound_bytes"] = float(x[model.peak_col]) * model.scale
    return plan


def lean_start(p: LevelProblem) -> list[list[tuple[int, int]]]:
    """A schedule of level ``p`` that keeps as little as the level allows, as per-stage
    (node, option) pairs (``solve_level``'s ``start``): each forward node runs in its stage
    with the option that saves least; before each backward node, the forward nodes it needs run
    again (its partner with the backward's option, the one that leaves the least memory in use,
    and the ancestors of what both read). Like recompute-all, a schedule of last resort: given
    as a start it lets a MILP that has found nothing better return it at its time limit."""
    nodes, n_fwd = p.nodes, p.n_forward

    def leanest(node: LevelNode, partner: LevelNode | None = None) -> int:
        def cost(o: int) -> tuple[int, int]:
            mine = node.options[o]
            if partner is None:
                return mine.saved, mine.overhead
            theirs = partner.options[o]
            return theirs.saved + max(mine.overhead, theirs.overhead), theirs.saved
        return min(range(len(node.options)), key=cost)

    least = [leanest(node) for node in nodes[:n_fwd]]
    stages: list[list[tuple[int, int]]] = [[(t, least[t])] for t in range(n_fwd)]
    for b in range(n_fwd, len(nodes)):
        node = nodes[b]
        f = node.pair
        o = leanest(node, None if f is None else nodes[f])
        needed: set[int] = set()
        todo = [p.values[x].producer for x in node.inputs] + ([] if f is None else [f])
        while todo:  # the forward nodes whose values it reads, its partner, their ancestors
            j = todo.pop()
            if j is None or j >= n_fwd or j in needed:
                continue
            needed.add(j)
            todo.extend(p.values[x].producer for x in nodes[j].inputs)
        stage = [(j, o if j == f else least[j]) for j in sorted(needed)]
        stages.append(stage + [(b, o)])
    return stages


def _set_start(h: Any, p: LevelProblem, model: _Model,
               start: Sequence[Sequence[tuple[int, int]]]) -> float | None:
    """Every ``R`` column of the model set to whether ``start`` computes that (node, option)
    in that stage; the other columns are left for HiGHS to complete. Returns the objective of
    those columns, or None when the start does not fit the model."""
    chosen = {(t, i, o) for t, stage in enumerate(start) for i, o in stage}
    if any(t >= len(model.R) or i not in model.R[t] for t, i, _ in chosen):
        return None  # it computes a node where the model has no column: not a schedule of it
    cols: list[int] = []
    vals: list[float] = []
    for t, stage_cols in enumerate(model.R):
        for i, first in stage_cols.items():
            for o in range(len(p.nodes[i].options)):
                cols.append(first + o)
                vals.append(1.0 if (t, i, o) in chosen else 0.0)
    h.setSolution(len(cols), np.asarray(cols, dtype=np.int32), np.asarray(vals, dtype=np.float64))
    cost = model.builder.cost
    return float(sum(cost[c] for c, v in zip(cols, vals) if v))


def estimated_nonzeros(p: LevelProblem, a: _Analysis) -> int:
    """About how many nonzeros ``build_model`` makes: ~25 per (stage, node, option) triple on
    op-level models of 100-600 ops."""
    return 25 * sum(len(p.nodes[i].options) for nodes in a.stage_nodes for i in nodes)


def _check_size(p: LevelProblem, a: _Analysis, time_limit: float | None) -> None:
    """Refuse a model too large to build, or to set up within ``time_limit``, before building
    it (``LevelNoSolution``, naming the size)."""
    nnz = estimated_nonzeros(p, a)
    if nnz > MAX_MODEL_NONZEROS:
        raise LevelNoSolution(
            f"level '{p.name}' ({len(p.nodes):,} nodes) would make a MILP of about {nnz:,} "
            f"nonzeros, more than the {MAX_MODEL_NONZEROS:,} this solver builds; plan it "
            "hierarchically (method 'hrockmate')")
    setup = SETUP_SECONDS_PER_NONZERO * nnz if nnz > PRESOLVE_MAX_NONZEROS else 0.0
    if time_limit is not None and setup > time_limit:
        raise LevelNoSolution(
            f"level '{p.name}' ({len(p.nodes):,} nodes) would make a MILP of about {nnz:,} "
            f"nonzeros, which takes about {setup:.0f} s to build and set up, more than the "
            f"{time_limit:.1f} s left; raise time_limit or plan hierarchically")


def _readers_of_storage(p: LevelProblem, a: _Analysis, j: int, x: int) -> list[int]:
    """Options of node ``j`` that read ``x`` or a view of its storage."""
    node = p.nodes[j]
    if node.option_inputs is None:
        return list(range(len(node.options)))
    return [o for o, ins in enumerate(node.option_inputs)
            if any(y == x or a.storage[y] == x for y in ins)]


def extract(p: LevelProblem, a: _Analysis, model: _Model, x: np.ndarray) -> StagePlan:
    """Turn a MILP solution into per-stage computes and frees.

    Frees are recomputed from liveness rather than read from ``FREE``: a value is released right
    after its last use in the stage unless the solution keeps it, which never uses more memory
    than the model accounted for.
    """
    n = len(p.nodes)
    on = x > 0.5
    computes: list[list[tuple[int, int]]] = []
    frees_before: list[list[int]] = []
    frees: list[list[list[int]]] = []
    kept_saved: list[set[tuple[int, int]]] = []
    objective = 0.0
    alive: set[int] = set()
    stages: list[list[tuple[int, int]]] = []
    for t in range(n):
        stage: list[tuple[int, int]] = []
        for i in a.stage_nodes[t]:
            first = model.R[t][i]
            for o in range(len(p.nodes[i].options)):
                if on[first + o]:
                    stage.append((i, o))
                    objective += p.nodes[i].options[o].time
                    break
        stages.append(stage)
    # Values read later before being produced again, at each stage start. The solver may keep
    # a value it never reads again (within the optimality gap, keeping costs it nothing worth
    # closing); such values are freed, which only lowers memory.
    live_at: list[set[int]] = [set() for _ in range(n + 1)]
    live: set[int] = set()
    for t in range(n - 1, -1, -1):
        for i, o in reversed(stages[t]):
            node = p.nodes[i]
            live.difference_update(node.outputs)
            live.update(node.inputs if node.option_inputs is None else node.option_inputs[o])
        live_at[t] = set(live)
    for t in range(n):
        stage = stages[t]
        keep_next = {
            xv for xv in alive | {y for i, _ in stage for y in p.nodes[i].outputs}
            if (t + 1, xv) in model.S and on[model.S[(t + 1, xv)]]
            and (xv in live_at[t + 1] or p.values[xv].keep)
        }
        kept_saved.append(
            {(f, o) for (tt, f, o), c in model.P.items() if tt == t + 1 and on[c]}
        )
        # last position in the stage at which each value is used (directly or via a view)
        last_use: dict[int, int] = {}
        for pos, (i, o) in enumerate(stage):
            node = p.nodes[i]
            for y in node.inputs if node.option_inputs is None else node.option_inputs[o]:
                last_use[y] = pos
                last_use[a.storage[y]] = max(last_use.get(a.storage[y], -1), pos)
            for y in p.nodes[i].outputs:
                last_use[y] = max(last_use.get(y, -1), pos)
        # a storage owner stays while a view of it stays
        for y in list(keep_next):
            keep_next.add(a.storage[y])
        fb = sorted(
            y for y in alive if y not in last_use and y not in keep_next and not p.values[y].keep
        )
        alive.difference_update(fb)
        stage_frees: list[list[int]] = []
        for pos, (i, _) in enumerate(stage):
            alive.update(p.nodes[i].outputs)
            done = sorted(
                y
                for y in alive
                if last_use.get(y, -1) <= pos
                and y not in keep_next
                and not p.values[y].keep
                and not _view_alive_later(y, alive, last_use, pos, keep_next, a)
            )
            alive.difference_update(done)
            stage_frees.append(done)
        computes.append(stage)
        frees_before.append(fb)
        frees.append(stage_frees)
    return StagePlan(computes, frees_before, frees, kept_saved, objective, False)


def _view_alive_later(
    y: int,
    alive: set[int],
    last_use: dict[int, int],
    pos: int,
    keep_next: set[int],
    a: _Analysis,
) -> bool:
    """True when ``y`` owns a storage that a still-needed view refers to."""
    for z in alive:
        if z != y and a.storage[z] == y and (last_use.get(z, -1) > pos or z in keep_next):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# the op level: one node per op, one value per tensor (Checkmate's model on the IR)


@dataclass
class OpLevel:
    """The op-level problem of a graph and the maps back to IR ids."""

    problem: LevelProblem
    node_op: list[int]  # level node -> op id


def op_level(graph: Any, ops: list[int] | None = None) -> OpLevel:
    """Checkmate's problem for a graph: every op a node with one option (time, workspace)."""
    order = topological_ops(graph) if ops is None else ops
    pos = {op: k for k, op in enumerate(order)}
    prod = graph.producers()
    values = []
    for x, t in enumerate(graph.tensors):
        p = prod[x]
        values.append(
            LevelValue(
                name=t.name,
                bytes=int(t.bytes) if t.alias_of is None else 0,
                producer=None if p is None or t.role in PREEXISTING_ROLES else pos[p],
                keep=t.role == "output",
                root=t.alias_of,
            )
        )
    nodes = []
    for j in order:
        op = graph.ops[j]
        nodes.append(
            LevelNode(
                name=op.name,
                inputs=list(op.inputs),
                outputs=list(op.outputs),
                options=[NodeOption(time=float(op.time), overhead=int(op.workspace))],
                backward=op.phase == "backward",
            )
        )
    n_forward = sum(1 for j in order if graph.ops[j].phase == "forward")
    return OpLevel(LevelProblem(values, nodes, n_forward, name=graph.name), list(order))




def op_steps(level: OpLevel, plan: StagePlan) -> tuple[list[tuple[str, int]], int]:
    """IR schedule steps of a solved op level, and the forward segment's length."""
    steps: list[tuple[str, int]] = []
    forward_len = 0
    for t, stage in enumerate(plan.computes):
        steps.extend(("free", x) for x in plan.frees_before[t])
        for (i, _), freed in zip(stage, plan.frees[t]):
            steps.append(("compute", level.node_op[i]))
            steps.extend(("free", x) for x in freed)
        if t == level.problem.n_forward - 1:
            forward_len = len(steps)
    return steps, forward_len
