"""Reference solvers, behind the same interface as the hierarchical solver.

Each solver maps ``(graph, budget_bytes, options)`` to a ``SolverResult`` (schedule steps, forward
segment length, whether the result is proven optimal, statistics). ``hrockmate.solve_graph``
validates every result with the simulator and picks among them with ``method=``:

- ``store-all``: plain autograd, keeps every activation until its backward use;
- ``recompute-all``: keeps nothing, recomputes every forward value from the inputs when needed;
- ``checkpoint``: per-block checkpointing as ``torch.utils.checkpoint`` does it: the forward
  op order is cut into contiguous blocks, only tensors crossing a block boundary are kept, and a
  block runs forward again when its backward needs what it dropped; the number of blocks is the
  fastest one that fits the budget;
- ``selective``: the same, but also keeping the outputs of matmuls, convolutions and attention
  (torchtitan-style selective checkpointing);
- ``layers``: per-layer checkpointing as a model's own ``gradient_checkpointing`` applies it
  (transformers' ``gradient_checkpointing_enable``, torchtitan's per-block activation
  checkpointing): each repeated layer of the model (a module in a ``ModuleList`` such as
  ``transformer.h.3``, from the module path the trace records per op) is one block, and what
  runs outside the layers (embeddings, the final norm, the head and the loss) keeps all it
  makes, as it does when only the layers are checkpointed;
- ``greedy``: greedy eviction in the op order, DTR-style (``greedy_eviction_schedule``; four
  eviction scores, the fastest refined schedule): needs no structure, so it serves graphs with
  long skips that the block strategies cannot cut;
- ``checkmate``: Checkmate's exact MILP over the whole op graph (only for small graphs: HiGHS
  stalls around 75 ops, so it runs under a time limit).
"""

from __future__ import annotations

import threading
import time as _time
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import numpy as np

from hrockmate.ir.errors import InfeasibleBudget
from hrockmate.ir.graph import Graph
from hrockmate.ir.schedule import Schedule, Step, call_native, simulate
from hrockmate.planning import ilp


@dataclass
class SolverResult:
    steps: list[Step]
    forward_len: int
    optimal: bool
    stats: dict[str, Any] = field(default_factory=dict)


class SolverInfeasible(InfeasibleBudget):
    """A reference solver found no schedule within the budget (``proven`` when it is certain;
    ``min_bytes``: the lowest peak it reached, 0 when unknown). An ``InfeasibleBudget``."""

    def __init__(self, message: str, proven: bool, min_bytes: int | None = None) -> None:
        self._as_solver_signal(message, min_bytes)
        self.proven = proven


# Ops whose outputs selective checkpointing keeps (matmuls, convolutions, attention), by ATen
# name without leading underscores; attention kernels are matched by stem, because each backend
# has its own name (_scaled_dot_product_efficient_attention, _flash_attention_forward, ...).
_HEAVY_OPS = frozenset({"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "convolution",
                        "conv1d", "conv2d", "conv3d", "cudnn_convolution"})
_ATTENTION_STEMS = ("scaled_dot_product", "flash_attention", "efficient_attention",
                    "cudnn_attention")


#: recompute-all's schedule of the last graph asked for, by structure hash (it depends on
#: nothing else): a search that finds nothing builds it as its last resort, and the least peak
#: that the refusal then names needs it again; on graphs of thousands of ops it has millions
#: of steps and took seconds to build each time
_recompute_all_lock = threading.Lock()
_recompute_all: list[tuple[str, Any]] = []


def recompute_all(graph: Graph) -> Any:
    """``ir.schedule.recompute_all_schedule(graph)``, kept for the last graph asked (the same
    ``Schedule`` object: callers must not change its steps). Raises its MemoryError on graphs
    whose schedule would be too large."""
    from hrockmate.ir.schedule import recompute_all_schedule

    key = graph.structure_hash()
    with _recompute_all_lock:
        if _recompute_all and _recompute_all[0][0] == key:
            return _recompute_all[0][1]
    schedule = recompute_all_schedule(graph)
    with _recompute_all_lock:
        _recompute_all[:] = [(key, schedule)]
    return schedule


def forget_recompute_all() -> None:
    """Drop the kept recompute-all schedule (``minima.clear_cache``)."""
    with _recompute_all_lock:
        _recompute_all.clear()


def is_heavy_op(target: str) -> bool:
    """Whether selective checkpointing keeps this op's outputs; ``target`` is an ATen name as
    ``str(torch.ops.aten.mm.default)`` writes it ("aten.mm.default") or a bare op name."""
    parts = target.split(".")
    name = (parts[-2] if len(parts) >= 3 else parts[-1]).strip("_")
    return name in _HEAVY_OPS or any(stem in name for stem in _ATTENTION_STEMS)


def heavy_outputs(graph: Graph) -> set[int]:
    """Outputs of the forward ops that selective checkpointing keeps (``is_heavy_op``); in
    graphs without targets (node-link files), the ops whose time per output byte is in the top
    third (expensive to recompute, cheap to keep). (The storage a kept view lives in is kept
    by the core's block rule, ``checkpointing::block_checkpoint``.)"""
    fwd = [j for j, o in enumerate(graph.ops) if o.phase == "forward"]
    if any(graph.ops[j].target for j in fwd):
        chosen = [j for j in fwd if graph.ops[j].target and is_heavy_op(graph.ops[j].target)]
    else:
        def density(j: int) -> float:
            b = sum(graph.tensors[x].bytes for x in graph.ops[j].outputs)
            return graph.ops[j].time / max(b, 1)
        ranked = sorted(fwd, key=density, reverse=True)
        chosen = ranked[:len(ranked) // 3]
    return {x for j in chosen for x in graph.ops[j].outputs}


def block_checkpoint_schedule(graph: Graph, blocks: int,
                              keep_extra: Iterable[int] = ()) -> tuple[list[Step], int]:
    """Per-block checkpointing as ``torch.utils.checkpoint`` runs it, with the forward ops cut
    into ``blocks`` contiguous runs of the topological order (equal op counts).

    Forward: every op runs once; only the values that cross blocks (read by a forward op of
    another block, or by a backward op of another block), the model outputs and ``keep_extra``
    are kept. Backward: when a backward op reads a dropped value, that value's block is run
    forward again (only the ops the block's backward still needs), and the recomputed values
    live until their last backward use. ``keep_extra`` = matmul/attention outputs gives
    selective checkpointing. Built by the Rust core (``checkpointing::block_checkpoint``);
    backward ops join blocks by the hierarchy's rule (``partition::backward_owners``)."""
    from hrockmate import _native

    kind, ids, fl = call_native(_native.block_checkpoint_schedule, graph, blocks=blocks,
                                keep_extra=_id_array(keep_extra))
    return Schedule.from_arrays(kind, ids, fl).steps, int(fl)


def layer_labels(graph: Graph) -> list[int] | None:
    """Per op, the repeated layer its module belongs to (0, 1, ... in the order the layers'
    first forward ops run), -1 for ops outside every layer; None when the graph has no
    repeated layers (no module paths, or no list of at least two layers).

    The layers are the children of the module lists whose children run the most forward
    ops: a path ``P.<k>`` with at least two indices ``k`` under one prefix ``P`` is a layer of
    the list ``P`` (transformers' ``transformer.h.3``, ``model.layers.0``, torchtitan's
    ``layers.5``). Lists nested in another list's layer (the experts of a mixture-of-experts
    layer) are part of that layer; side-by-side lists (an encoder's and a decoder's) each
    give their layers. ``graph.meta["checkpoint_layers"]``, the module paths a model marks as
    its own checkpointing units when the trace recorded them, takes precedence."""
    fwd = [j for j, o in enumerate(graph.ops) if o.phase == "forward"]
    named = graph.meta.get("checkpoint_layers") or _listed_layers(graph.ops[j].module
                                                                  for j in fwd)
    if len(named) < 2:
        return None
    # longest first: a path inside a layer whose name extends another's ("h.1" and "h.10")
    # is matched on a whole segment
    paths = sorted(named, key=len, reverse=True)
    label = [-1] * graph.num_ops
    index: dict[str, int] = {}
    for j in fwd:
        module = graph.ops[j].module
        for p in paths:
            if module == p or module.startswith(p + "."):
                label[j] = index.setdefault(p, len(index))
                break
    return label if len(index) >= 2 else None


def _listed_layers(modules: Iterable[str]) -> list[str]:
    """The layer paths of ``layer_labels``' rule: ``P.<k>`` for the module lists ``P`` with at
    least two children ``k`` among ``modules``, the lists whose children run the most ops,
    lists inside another list's layer left out."""
    runs: dict[str, dict[str, int]] = {}  # list prefix -> layer path -> ops under it
    for module in modules:
        parts = module.split(".") if module else []
        for k in range(1, len(parts)):
            if parts[k].isdigit():
                prefix, layer = ".".join(parts[:k]), ".".join(parts[:k + 1])
                counts = runs.setdefault(prefix, {})
                counts[layer] = counts.get(layer, 0) + 1
    lists = {p: c for p, c in runs.items() if len(c) >= 2}
    chosen: list[str] = []
    # the lists covering the most ops first; a list inside a chosen list's layer is skipped
    for prefix in sorted(lists, key=lambda p: (-sum(lists[p].values()), p)):
        if any(prefix.startswith(q + ".") or q.startswith(prefix + ".") for q in chosen):
            continue
        chosen.append(prefix)
    return [layer for p in chosen for layer in lists[p]]


def layer_checkpoint_schedule(graph: Graph, labels: list[int] | None = None
                              ) -> tuple[list[Step], int] | None:
    """Per-layer checkpointing (``layer_labels``' layers, or the ``labels`` given): each layer a
    block of ``block_checkpoint_schedule``'s rule (what crosses layers kept, a layer run
    forward again when its backward needs what it dropped), the ops outside the layers keeping
    every output. Built by the Rust core (``CheckpointFacts::labelled_blocks``,
    ``checkpointing::block_checkpoint``); None when the graph has no repeated layers."""
    from hrockmate import _native

    labels = layer_labels(graph) if labels is None else labels
    if labels is None:
        return None
    kind, ids, fl = call_native(_native.labelled_checkpoint_schedule, graph,
                                label=np.asarray(labels, dtype=np.int64),
                                keep_extra=_id_array(()))
    return Schedule.from_arrays(kind, ids, fl).steps, int(fl)


def solve_layers(graph: Graph, budget: int, **_: Any) -> SolverResult:
    """Per-layer checkpointing when it fits the budget (``layer_checkpoint_schedule``)."""
    labels = layer_labels(graph)
    found = layer_checkpoint_schedule(graph, labels) if labels is not None else None
    if found is None or labels is None:
        raise SolverInfeasible(
            f"'{graph.name}' has no repeated layers to checkpoint (no module list with two or "
            "more layers among its ops' module paths); use method='checkpoint'", proven=False)
    steps, fl = found
    peak = int(simulate(graph, Schedule(steps, fl)).peak_bytes)
    if peak > budget:
        raise SolverInfeasible(
            f"per-layer checkpointing of '{graph.name}' peaks at {peak} bytes, over the budget "
            f"of {budget} bytes", proven=False, min_bytes=peak)
    return SolverResult(steps, fl, False, {"layers": max(labels) + 1})


def greedy_eviction_schedule(graph: Graph, budget: int, time_limit: float | None = None
                             ) -> tuple[list[Step], int] | None:
    """A dynamic-tensor-rematerialization-style greedy (Kirisame et al., ICLR 2021), planned
    ahead: run the ops in order; before an op whose inputs and outputs would pass ``budget``,
    evict forward values; a value needed again after its eviction is recomputed from what is
    alive, recursively. Needs no structure at all (no pairing, no chain), so it serves graphs
    the other strategies cannot cut well (long skips). Built by the Rust core
    (``greedy::greedy_eviction_scored``), which measures memory with the simulator's storage
    rules, so a schedule it returns is within ``budget``; None when it gets stuck (nothing left
    to evict) or out of time.

    The core evicts by a score, recompute time / (bytes x a distance): the distance is DTR's
    staleness (ops since the last use) or the ops until the next use, which a planner knows
    ahead; the recompute time is the value's producer's, or with ``+inputs`` also that of the
    producers of its inputs that are not alive (the names: ``_native.EVICTION_SCORES``). None
    wins everywhere (milliseconds each on a few hundred ops; on the 10k-op LSTM 0.3 s for all
    four), so all run and the fastest schedule after ``refine`` is returned (evictions leave
    slack, and which refines better is not which was faster before). ``time_limit`` covers it
    all."""
    from hrockmate import _native
    from hrockmate.planning.refine import refine

    deadline = None if time_limit is None else _time.perf_counter() + time_limit

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - _time.perf_counter())

    runs: list[tuple[float, list[Step], int]] = []  # (simulated time, steps, forward length)
    for score in _native.EVICTION_SCORES:
        if left() == 0.0 and runs:
            break
        found = call_native(_native.greedy_eviction, graph, budget_bytes=int(budget),
                            time_limit=left(), score=score)
        if found is not None:
            steps, fl = Schedule.from_arrays(*found).steps, int(found[2])
            runs.append((float(simulate(graph, Schedule(steps, fl)).time), steps, fl))
    runs.sort(key=lambda r: r[0])
    # each refinement takes 0.3-0.6 s on graphs of 10k ops: there only the two fastest
    # schedules are refined (the refinement's winner was among them on the 10k-op LSTM and the
    # 24-layer encoder-decoder); on smaller graphs all, since the order can change (the
    # bench's U-Net at 50%: the second slowest became the fastest)
    for k, (_, steps, fl) in enumerate(runs[:2 if graph.num_ops > REFINE_ALL_OPS else None]):
        remaining = left()
        if remaining == 0.0:
            break
        # (a share of the time left: the other refinements follow)
        r = refine(graph, steps, fl, budget, deadline=None if remaining is None
                   else _time.perf_counter() + remaining / (len(runs) - k + 1))
        if r is not None:
            runs[k] = (r.time, r.steps, r.forward_len)
    if not runs:
        return None
    _, steps, fl = min(runs, key=lambda r: r[0])
    return steps, fl


#: Graphs with more ops than this have only their two fastest greedy schedules refined.
REFINE_ALL_OPS = 2000


class CheckpointPoint(NamedTuple):
    """Block checkpointing at one block count, simulated; ``steps``/``forward_len`` are None
    for points that did not keep their schedule."""

    peak: int
    time: float
    blocks: int
    steps: list[Step] | None
    forward_len: int | None


def checkpoint_points(graph: Graph, selective: bool = False, time_limit: float | None = None,
                      budget: int | None = None) -> list[CheckpointPoint]:
    """Block checkpointing (``selective``: also keeping matmul/attention outputs) at every
    candidate block count (sqrt(n) and a spread around it), each built and simulated by the
    Rust core (``checkpointing::checkpoint_points``), in ascending block counts. With
    ``time_limit`` (seconds), the counts nearest sqrt(n) come first and the rest stop when time
    runs out. With ``budget`` only the fastest point within it keeps its steps: dozens of
    whole-graph schedules held at once took 1 GB on a 45k-op graph."""
    from hrockmate import _native

    extra = heavy_outputs(graph) if selective else ()
    raw = call_native(_native.checkpoint_points, graph, keep_extra=_id_array(extra),
                      budget_bytes=budget, time_limit=time_limit)
    out = []
    for blocks, peak, t, sched in raw:
        steps, fl = None, None
        if sched is not None:
            steps, fl = Schedule.from_arrays(*sched).steps, int(sched[2])
        out.append(CheckpointPoint(int(peak), float(t), int(blocks), steps, fl))
    return sorted(out, key=lambda p: p.blocks)


def _id_array(ids: Iterable[int]) -> np.ndarray:
    return np.fromiter(sorted(ids), dtype=np.int64)


def solve_checkpoint(graph: Graph, budget: int, *, selective: bool = False, **_: Any
                     ) -> SolverResult:
    """The fastest block count whose per-block checkpointing fits the budget."""
    points = checkpoint_points(graph, selective, budget=budget)
    fits = [p for p in points if p.steps is not None]
    kind = "selective checkpointing" if selective else "block checkpointing"
    if not fits:
        lowest = min(p.peak for p in points)
        raise SolverInfeasible(
            f"no {kind} of '{graph.name}' fits {budget} bytes (its lowest peak is {lowest} bytes)",
            proven=False, min_bytes=lowest,
        )
    best = fits[0]
    assert best.steps is not None and best.forward_len is not None
    return SolverResult(best.steps, best.forward_len, False, {"blocks": best.blocks})


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
