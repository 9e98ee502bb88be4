"""Reference solvers, behind the same interface as the hierarchical solver.

Each solver maps ``(graph, budget_bytes, options)`` to a ``SolverResult`` (schedule steps, forward
segment length, whether the result is proven optimal, statistics). ``hrockmate.solve_graph``
validates every result with the simulator and picks among them with ``method=``:

- ``store-all``: plain autograd, keeps every activation until its backward use;
- ``recompute-all``: keeps nothing, recomputes every forward value from the inputs when needed;
- ``checkpoint``: per-block checkpointing (sqrt(n)-style): the forward op order is cut into
  contiguous blocks, only tensors crossing a block boundary are kept and a block is recomputed
  when its backward needs it; the number of blocks is the fastest one that fits the budget;
- ``checkmate``: Checkmate's exact MILP over the whole op graph (only for small graphs: HiGHS
  stalls around 75 ops, so it runs under a time limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from hrockmate import ilp
from hrockmate.graph import PREEXISTING_ROLES, Graph

Step = tuple[str, int]


@dataclass
class SolverResult:
    steps: list[Step]
    forward_len: int
    optimal: bool
    stats: dict[str, Any] = field(default_factory=dict)


class SolverInfeasible(Exception):
    """The solver found no schedule within the budget (``proven`` when it is certain)."""

    def __init__(self, message: str, proven: bool) -> None:
        super().__init__(message)
        self.proven = proven


def keep_set_schedule(graph: Graph, keep: set[int]) -> tuple[list[Step], int]:
    """A schedule that keeps the forward tensors in ``keep`` and recomputes the others on demand.

    Forward: every forward op runs once in order; a tensor outside ``keep`` is freed after its
    last forward use. Backward: before each backward op, missing inputs are recomputed from the
    kept tensors (walking producers); a recomputed tensor lives until its last direct backward
    use; a kept tensor lives until the last backward op that needs it directly or as a source
    of a recomputation. ``keep`` = all forward tensors gives store-all, ``keep`` = {} gives
    recompute-all.
    """
    order = ilp.topological_ops(graph)
    prod = graph.producers()
    ops = graph.ops
    tensors = graph.tensors
    fwd = [j for j in order if ops[j].phase == "forward"]
    bwd = [j for j in order if ops[j].phase == "backward"]
    fixed = {x for x, t in enumerate(tensors) if t.role in PREEXISTING_ROLES}
    is_fwd_tensor = [
        prod[x] is not None and ops[prod[x]].phase == "forward" and x not in fixed  # type: ignore[index]
        for x in range(len(tensors))
    ]
    never_free = {x for x, t in enumerate(tensors) if t.role == "output"} | fixed

    # kept tensors needed by backward op q, directly or as recomputation sources
    def sources(y: int, memo: dict[int, frozenset[int]]) -> frozenset[int]:
        if y in memo:
            return memo[y]
        stack = [y]
        while stack:
            z = stack[-1]
            if z in memo:
                stack.pop()
                continue
            if z in keep or not is_fwd_tensor[z] or z in never_free:
                memo[z] = frozenset([z]) if is_fwd_tensor[z] else frozenset()
                stack.pop()
                continue
            pending = [w for w in ops[prod[z]].inputs if w not in memo]  # type: ignore[index]
            if pending:
                stack.extend(pending)
                continue
            acc: set[int] = set()
            for w in ops[prod[z]].inputs:  # type: ignore[index]
                acc |= memo[w]
            memo[z] = frozenset(acc)
            stack.pop()
        return memo[y]

    memo: dict[int, frozenset[int]] = {}
    horizon: dict[int, int] = {}
    last_direct: dict[int, int] = {}
    for q, j in enumerate(bwd):
        for y in ops[j].inputs:
            last_direct[y] = q
            if is_fwd_tensor[y]:
                for s in sources(y, memo) | ({y} if y in keep else set()):
                    if s in keep:
                        horizon[s] = q
    last_fwd_use: dict[int, int] = {}
    for p, j in enumerate(fwd):
        for y in ops[j].inputs:
            last_fwd_use[y] = p
        for y in ops[j].outputs:
            last_fwd_use.setdefault(y, p)

    steps: list[Step] = []
    alive: set[int] = set(fixed)

    def free(x: int) -> None:
        alive.discard(x)
        steps.append(("free", x))

    for p, j in enumerate(fwd):
        steps.append(("compute", j))
        alive.update(ops[j].outputs)
        for x in sorted({*ops[j].inputs, *ops[j].outputs}):
            if x in never_free or x not in alive or last_fwd_use.get(x, -1) > p:
                continue
            if x in keep and horizon.get(x, -1) >= 0:
                continue
            free(x)
    forward_len = len(steps)

    for q, j in enumerate(bwd):
        recomputed: list[int] = []
        for y in ops[j].inputs:
            if y in alive:
                continue
            # recompute y: post-order walk over producers of missing tensors
            stack: list[tuple[int, bool]] = [(y, False)]
            while stack:
                z, expanded = stack.pop()
                if z in alive:
                    continue
                op = prod[z]
                if expanded:
                    steps.append(("compute", op))  # type: ignore[arg-type]
                    alive.update(ops[op].outputs)  # type: ignore[index]
                    recomputed.extend(ops[op].outputs)  # type: ignore[index]
                    continue
                stack.append((z, True))
                stack.extend((w, False) for w in ops[op].inputs if w not in alive)  # type: ignore[index]
        steps.append(("compute", j))
        alive.update(ops[j].outputs)
        for x in sorted({*ops[j].inputs, *ops[j].outputs, *recomputed}):
            if x in never_free or x not in alive:
                continue
            if x in keep and is_fwd_tensor[x]:
                if horizon.get(x, -1) > q or last_direct.get(x, -1) > q:
                    continue
            elif last_direct.get(x, -1) > q:
                continue
            free(x)
    return steps, forward_len


def _block_keep(graph: Graph, blocks: int) -> set[int]:
    """Tensors crossing a boundary between contiguous blocks of the forward op order."""
    order = [j for j in ilp.topological_ops(graph) if graph.ops[j].phase == "forward"]
    n = len(order)
    block_of: dict[int, int] = {}
    for k, j in enumerate(order):
        block_of[j] = (k * blocks) // max(n, 1)
    prod = graph.producers()
    keep: set[int] = set()
    for j in order:
        for x in graph.ops[j].inputs:
            p = prod[x]
            if p is not None and p in block_of and block_of[p] != block_of[j]:
                keep.add(x)
                # a view's storage owner must stay with it
                r = graph.tensors[x].alias_of
                while r is not None:
                    keep.add(r)
                    r = graph.tensors[r].alias_of
    return keep


def checkpoint_candidates(n_forward: int) -> list[int]:
    """Block counts tried by the checkpoint solver: sqrt(n) and a spread around it."""
    if n_forward <= 0:
        return [1]
    cands = {1, n_forward, max(1, round(math.sqrt(n_forward)))}
    k = 2
    while k < n_forward:
        cands.add(k)
        k = k + 1 if k < 16 else int(k * 1.3)
    return sorted(cands)


Simulate = Callable[[Graph, list[Step], int], tuple[int, float]]


def solve_checkpoint(graph: Graph, budget: int, simulate: Simulate, **_: Any) -> SolverResult:
    n_forward = sum(1 for o in graph.ops if o.phase == "forward")
    best: tuple[float, int, list[Step], int, int] | None = None
    lowest = math.inf
    for blocks in checkpoint_candidates(n_forward):
        steps, fl = keep_set_schedule(graph, _block_keep(graph, blocks))
        peak, t = simulate(graph, steps, fl)
        lowest = min(lowest, peak)
        if peak <= budget and (best is None or t < best[0]):
            best = (t, blocks, steps, fl, peak)
    if best is None:
        raise SolverInfeasible(
            f"no block checkpointing of '{graph.name}' fits {budget} bytes "
            f"(its lowest peak is {int(lowest)} bytes)",
            proven=False,
        )
    return SolverResult(best[2], best[3], False, {"blocks": best[1]})


def solve_checkmate(
    graph: Graph, budget: int, *, time_limit: float | None = 120.0, mip_rel_gap: float = 1e-4,
    **_: Any
) -> SolverResult:
    """Checkmate's MILP over every op of the graph."""
    level = ilp.op_level(graph)
    try:
        sp = ilp.solve_level(level.problem, budget, time_limit=time_limit, mip_rel_gap=mip_rel_gap)
    except ilp.LevelInfeasible as exc:
        raise SolverInfeasible(str(exc), proven=True) from None
    except ilp.LevelNoSolution as exc:
        raise SolverInfeasible(str(exc), proven=False) from None
    steps, fl = ilp.op_steps(level, sp)
    return SolverResult(steps, fl, sp.optimal, dict(sp.stats))


def min_peak_checkmate(graph: Graph, time_limit: float | None = 60.0) -> tuple[list[Step], int, bool, float]:
    """The lowest-peak schedule of the op-level MILP: (steps, forward_len, proven, lower bound)."""
    level = ilp.op_level(graph)
    sp = ilp.solve_level(level.problem, None, minimize_peak=True, time_limit=time_limit)
    steps, fl = ilp.op_steps(level, sp)
    return steps, fl, sp.optimal, float(sp.stats.get("peak_bound_bytes", 0.0))
