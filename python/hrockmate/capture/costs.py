"""Cost model: run time and temporary workspace of every op of a traced iteration.

Times (seconds):
- ``"measure"``: each distinct op *signature* (target + shapes, strides, dtypes and devices of
  tensor arguments + the non-tensor arguments) is run on the sample's device on real tensors
  and timed; repeated layers are measured once. On CUDA with CUDA events, on CPU with
  ``time.perf_counter``. The joint graph is run ``MEASURE_PASSES`` times; in each pass every
  signature gets one warm-up call, then repeats until ``MIN_MEASURE_S`` of run time (at least
  ``MIN_REPEATS``, at most ``MAX_REPEATS`` calls), and the fastest call over all passes is
  kept (other processes only ever slow a call down; spreading the repeats over passes keeps a
  burst of load from hitting all of one op's calls). Measured times are then rounded to a
  geometric grid of ``TIME_GRID_STEPS`` steps per doubling, relative to the iteration's total
  time, so that noise of a few percent, or a machine that is uniformly slower in one run, does
  not change the plan (``round_times``). Once ``budget_s`` seconds have been spent measuring,
  remaining new signatures are estimated instead (reported in ``CostReport``).
- ``"estimate"``: ``launch + flops / peak_flops + bytes_moved / bandwidth`` with FLOPs from
  ``torch.utils.flop_counter``'s formulas (matmuls, convolutions, attention; 0 for other ops)
  and bytes moved = bytes of the tensor arguments read + bytes of the outputs written. The
  constants are in ``DEVICE_SPEEDS``: rough figures for a current server CPU core pair and a
  data-centre GPU; only ratios between ops matter to the planner.

In sequence (``"measure"``, CPU): the runtime runs a schedule as straight-line Python
(``runtime.compiler``), each op once on tensors that earlier ops just made, in memory the
allocator just handed out; the op called in a loop finds its arguments and its result's memory
in the caches, and on graphs of many small ops runs much faster. So after the passes
above the joint graph runs ``SEQUENCE_PASSES`` more times as the program runs it, each call
timed once, and every signature's time becomes its fastest call plus the median of what its
calls in sequence took beyond that (``in_sequence_extra``): store-all's predicted time is then
the program's, each recomputation costs what it costs in the program, and a schedule of more
steps predicts more time. The mean of those extras per op is ``CostReport.step_seconds``. Not
on CUDA: the host runs ahead of the kernels, which CUDA events time as they run in sequence.

Real tensors: the joint graph is run once on the real sample (parameters, buffers, inputs and
tangents of ones), so every op sees values like the real ones (integer indices stay in range).
The values are detached, and ops run with grad mode on as when traced (some kernels, e.g.
oneDNN's LSTM layer, only return the workspace their backward needs in grad mode).

Output sizes: the same real run checks every output against the fake tensors (size of the
storage it owns, or the storage it shares) and corrects the IR where they differ
(``CostReport.resized``).

Workspace (bytes): memory an op allocates while it runs beyond its new outputs, measured in
that same run: on CUDA, ``max_memory_allocated`` during the op minus the memory allocated
before it and its new outputs (measured on a second call of the op, so that the handles and
workspaces cuBLAS and cuDNN allocate once per process do not count); on CPU, from the
profiler's allocator events (running sum of the bytes allocated and freed inside the op, peak
minus its new outputs). ``"none"`` leaves 0.
"""

from __future__ import annotations

import math
import operator
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from hrockmate.capture.ctc import SIZED_FOR_LONGEST
from hrockmate.capture.kernels import op_kernel, relayout_outputs, run_node, want_relayout
from hrockmate.capture.build import allocated_bytes
from hrockmate.capture.joint import Traced, one_trace_at_a_time, placeholder_values, run_joint
from hrockmate.capture.randomness import preserved_rng

__all__ = [
    "DEVICE_SPEEDS",
    "CostReport",
    "annotate_costs",
    "estimate_time",
    "op_signature",
    "round_times",
]

#: (peak FLOP/s, memory bandwidth bytes/s, per-op launch overhead s) per device type.
DEVICE_SPEEDS: dict[str, tuple[float, float, float]] = {
    "cpu": (5.0e10, 1.0e10, 5.0e-6),
    "cuda": (5.0e13, 1.5e12, 5.0e-6),
}
MEASURE_PASSES = 3
#: Runs of the joint graph timing each call once in sequence (``in_sequence_extra``).
SEQUENCE_PASSES = 2
MIN_MEASURE_S = 1e-3
MAX_REPEATS = 50
MIN_REPEATS = 5
TIME_GRID_STEPS = 8


@dataclass
class CostReport:
    mode: str
    signatures: int = 0  # distinct op signatures seen
    measured: int = 0  # signatures timed on the device
    estimated: int = 0  # signatures estimated (mode "estimate", or the time budget ran out)
    resized: int = 0  # output sizes corrected from the real run (fake kernels got them wrong)
    measure_seconds: float = 0.0
    workspace_seconds: float = 0.0
    #: the mean over ops of what running in sequence adds to an op's time (``in_sequence_extra``)
    step_seconds: float = 0.0
    cache: dict[Any, float] = field(default_factory=dict)


def _tensor_sig(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type)
    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(x)
    return x


def op_signature(node: fx.Node) -> Any:
    """Hashable key: target + tensor metadata of the arguments + the non-tensor arguments."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    flat, spec = pytree.tree_flatten((args, kwargs))
    key = tuple(_tensor_sig(x) for x in flat)
    try:
        hash(key)
    except TypeError:
        key = repr(key)  # type: ignore[assignment]
    return (str(node.target), str(spec), key)


def _nbytes(x: Any) -> int:
    return sum(
        t.numel() * t.element_size()
        for t in pytree.tree_leaves(x)
        if isinstance(t, torch.Tensor)
    )


def estimate_time(node: fx.Node, device_type: str = "cpu") -> float:
    """FLOP/bandwidth estimate of one op from its fake-tensor metadata (seconds)."""
    from torch.utils.flop_counter import flop_registry

    peak, bandwidth, launch = DEVICE_SPEEDS.get(device_type, DEVICE_SPEEDS["cpu"])
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    out = node.meta.get("val")
    flops = 0
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None and packet in flop_registry:
        try:
            flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001 - a formula that rejects these args counts 0 FLOPs
            flops = 0
    schema = getattr(node.target, "_schema", None)
    is_view = schema is not None and all(r.alias_info is not None for r in schema.returns)
    moved = 0 if is_view else _nbytes((args, kwargs)) + _nbytes(out)
    return launch + flops / peak + moved / bandwidth


def _new_output_bytes(traced: Traced, op_id: int) -> int:
    g = traced.graph
    return sum(g.tensors[t].bytes for t in g.ops[op_id].outputs if g.tensors[t].alias_of is None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_op(node: fx.Node, args: Any, kwargs: Any, device: torch.device) -> float:
    """The fastest of a few timed calls of the op (seconds)."""
    fn = op_kernel(node, device.type)
    fn(*args, **kwargs)  # warm-up
    samples: list[float] = []
    total = 0.0
    while len(samples) < MAX_REPEATS and (total < MIN_MEASURE_S or len(samples) < MIN_REPEATS):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args, **kwargs)
            end.record()
            end.synchronize()
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn(*args, **kwargs)
            dt = time.perf_counter() - t0
        samples.append(dt)
        total += dt
    return min(samples)


def in_sequence_extra(traced: Traced, values: dict[str, torch.Tensor], sigs: list[Any],
                      fastest: dict[Any, float]) -> dict[Any, float]:
    """Per measured signature (``fastest``: its fastest call in a loop), the median over its
    calls, in ``SEQUENCE_PASSES`` runs of the joint graph in order with every call timed once,
    of what a call took beyond its fastest one (at least 0): the cost of running in sequence
    as the runtime's program does (see the module docstring). CPU only (empty elsewhere)."""
    if traced.device.type != "cpu" or not fastest:
        return {}
    calls: dict[Any, list[float]] = {}

    def on_op(op_id: int, node: fx.Node, args: Any, kwargs: Any) -> Any:
        fn = op_kernel(node, "cpu")
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        dt = time.perf_counter() - t0
        calls.setdefault(sigs[op_id], []).append(dt)
        return out

    for _ in range(SEQUENCE_PASSES):
        with preserved_rng(traced.device), torch.enable_grad():
            run_joint(traced, values, keep=set(), on_op=on_op)
    return {sig: max(0.0, statistics.median(calls[sig]) - t)
            for sig, t in fastest.items() if sig in calls}


def round_times(times: dict[Any, float], weights: dict[Any, int]) -> dict[Any, float]:
    """``times`` (per signature) rounded to a geometric grid of ``TIME_GRID_STEPS`` steps per
    doubling, anchored at the total time (each signature weighted by how many ops share it):
    relative times, which alone decide the plan, do not move with a uniform change of speed,
    and move only when an op's share of the total crosses a grid line."""
    total = sum(t * weights.get(sig, 1) for sig, t in times.items())
    if total <= 0:
        return dict(times)
    rounded = {}
    for sig, t in times.items():
        if t <= 0:
            rounded[sig] = t
            continue
        step = round(math.log2(t / total) * TIME_GRID_STEPS)
        rounded[sig] = total * 2.0 ** (step / TIME_GRID_STEPS)
    return rounded


def _correct_outputs(traced: Traced, op_id: int, args: Any, kwargs: Any, out: Any) -> int:
    """Make ``op_id``'s outputs in the IR agree with what the real run allocated.

    Fake (meta) kernels may get an output wrong: oneDNN's LSTM layer reports an empty
    workspace tensor that is tens of kilobytes in reality, and a fake kernel may return one
    tensor twice where the real kernel makes two. A storage-owning output gets the real size;
    an output recorded as sharing the storage of an input or of another output of the op, but
    which does not share it in reality, becomes a storage owner. Returns how many changed."""
    g = traced.graph
    op = g.ops[op_id]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    real_of: dict[int, torch.Tensor] = {}
    in_vals = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    if len(in_vals) == len(op.inputs):
        real_of.update(zip(op.inputs, in_vals))
    for tid in op.outputs:
        index = traced.tensor_nodes[tid][1]
        real = outs[0] if index is None else outs[index]
        if isinstance(real, torch.Tensor):
            real_of[tid] = real
    changed = 0
    # (an output sized for the worst case of values the trace does not fix keeps its size)
    upper_bound = traced.op_nodes[op_id].target in SIZED_FOR_LONGEST
    for tid in op.outputs:
        t, real = g.tensors[tid], real_of.get(tid)
        if real is None:
            continue
        nbytes = allocated_bytes(real.untyped_storage().nbytes(), traced.device)
        if t.alias_of is not None:
            base = real_of.get(t.alias_of)
            if base is None or _same_storage(base, real):
                continue  # a view as recorded (or of a tensor this op does not see)
            t.alias_of = None
            t.bytes = nbytes
            changed += 1
        elif nbytes > t.bytes or (nbytes < t.bytes and not upper_bound):
            t.bytes = nbytes
            changed += 1
    return changed


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# Measuring runs started again after a view failed on a real layout (one per op relaid out).
MAX_RELAYOUT_RUNS = 8


def _layout_source(node: fx.Node) -> fx.Node | None:
    """The op that made the storage a failing view op ``node`` reads: back through views and
    tuple members to the first op that is neither (None when ``node`` is no view op or the
    storage is a graph input)."""
    if not getattr(node.target, "is_view", False):
        return None
    src = node.args[0] if node.args else None
    while isinstance(src, fx.Node) and src.op == "call_function":
        if src.target is operator.getitem:
            return src.args[0] if isinstance(src.args[0], fx.Node) else None
        if not getattr(src.target, "is_view", False):
            return src
        src = src.args[0] if src.args else None
    return None


def _measure_with_relayouts(traced: Traced, values: dict[str, torch.Tensor]
                            ) -> tuple[list[int], int]:
    """The workspace measurement of the device. Where a view op fails on a real layout (the
    fake kernel of the op that made its storage recorded another layout, and later ops were
    traced for that one), a ``view`` runs as a reshape (``kernels.run_node``: its output then
    owns its storage, ``_correct_outputs``); where another view op fails, the op that made
    its storage is marked for ``kernels.relayout_outputs`` and the run starts again. Every
    other output keeps the real kernel's layout, as in eager."""
    measure = _measure_workspace_cuda if traced.device.type == "cuda" else _measure_workspace_cpu
    for _ in range(MAX_RELAYOUT_RUNS):
        at: list[fx.Node] = []  # the op being run
        try:
            return measure(traced, values, at)
        except RuntimeError:
            source = _layout_source(at[0]) if at else None
            if source is None or not want_relayout(source):
                raise
    return measure(traced, values, [])


def _measure_workspace_cpu(
    traced: Traced, values: dict[str, torch.Tensor], at: list[fx.Node]
) -> tuple[list[int], int]:
    from torch.profiler import record_function

    from hrockmate.capture.memory import cpu_memory_profile

    n = len(traced.op_nodes)
    resized = 0

    def on_op(op_id: int, node: fx.Node, args: Any, kwargs: Any) -> Any:
        nonlocal resized
        at[:] = [node]
        with record_function(f"hrockmate_op:{op_id}"):
            out = relayout_outputs(node, args, kwargs, run_node(node, "cpu", args, kwargs))
        resized += _correct_outputs(traced, op_id, args, kwargs, out)
        return out

    with cpu_memory_profile() as prof:
        run_joint(traced, values, keep=set(), on_op=on_op)
    windows: list[tuple[int, int, int]] = []
    mem: list[tuple[int, int]] = []
    for ev in prof.profiler.kineto_results.events():
        name = ev.name()
        if name == "[memory]":
            mem.append((ev.start_ns(), int(ev.nbytes())))
        elif name.startswith("hrockmate_op:"):
            windows.append((ev.start_ns(), ev.start_ns() + ev.duration_ns(), int(name[13:])))
    mem.sort()
    windows.sort()
    peaks = [0] * n
    j = 0
    for start, end, op_id in windows:
        while j < len(mem) and mem[j][0] < start:
            j += 1
        running = peak = 0
        while j < len(mem) and mem[j][0] <= end:
            running += mem[j][1]
            peak = max(peak, running)
            j += 1
        peaks[op_id] = peak
    return [max(0, peaks[i] - _new_output_bytes(traced, i)) for i in range(n)], resized


def _measure_workspace_cuda(
    traced: Traced, values: dict[str, torch.Tensor], at: list[fx.Node]
) -> tuple[list[int], int]:
    device = traced.device
    work = [0] * len(traced.op_nodes)
    resized = 0

    def on_op(op_id: int, node: fx.Node, args: Any, kwargs: Any) -> Any:
        nonlocal resized
        at[:] = [node]
        schema = getattr(node.target, "_schema", None)
        if schema is not None and not schema.is_mutable:
            # A first call may set up cuBLAS/cuDNN handles and their workspaces, which then stay
            # allocated for the process: not this op's workspace. Ops that mutate run once.
            run_node(node, "cuda", args, kwargs)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = relayout_outputs(node, args, kwargs, run_node(node, "cuda", args, kwargs))
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        resized += _correct_outputs(traced, op_id, args, kwargs, out)
        work[op_id] = max(0, peak - _new_output_bytes(traced, op_id))
        return out

    run_joint(traced, values, keep=set(), on_op=on_op)
    return work, resized


@one_trace_at_a_time
def annotate_costs(
    traced: Traced,
    model: nn.Module,
    sample: Any,
    *,
    mode: str = "measure",
    budget_s: float = 120.0,
    workspace: bool = True,
) -> CostReport:
    """Fill ``time`` and ``workspace`` of every op of ``traced.graph`` (see module docstring).
    ``workspace=False`` keeps the workspaces and sizes an earlier call measured and only sets
    the times."""
    if mode not in ("measure", "estimate"):
        raise ValueError(f"cost mode must be 'measure' or 'estimate', got {mode!r}")
    device = traced.device
    report = CostReport(mode=mode)
    values = placeholder_values(traced, model, sample)
    ops = traced.graph.ops

    t0 = time.perf_counter()
    if workspace:
        with preserved_rng(device), torch.enable_grad():
            work, report.resized = _measure_with_relayouts(traced, values)
        for op, w in zip(ops, work):
            op.workspace = int(w)
    report.workspace_seconds = time.perf_counter() - t0

    sigs = [op_signature(n) for n in traced.op_nodes]
    report.signatures = len(set(sigs))
    cache = report.cache
    if mode == "estimate":
        for i, node in enumerate(traced.op_nodes):
            if sigs[i] not in cache:
                cache[sigs[i]] = estimate_time(node, device.type)
        report.estimated = len(cache)
    else:
        t1 = time.perf_counter()
        fastest: dict[Any, float] = {}  # measured signatures: fastest call so far
        seen: set[Any] = set()  # signatures handled in the current pass

        def on_op(op_id: int, node: fx.Node, args: Any, kwargs: Any) -> Any:
            sig = sigs[op_id]
            if sig not in seen and sig not in cache:
                seen.add(sig)
                if time.perf_counter() - t1 < budget_s:
                    dt = _time_op(node, args, kwargs, device)
                    fastest[sig] = min(dt, fastest.get(sig, dt))
                elif sig not in fastest:
                    cache[sig] = estimate_time(node, device.type)
                    report.estimated += 1
            return op_kernel(node, device.type)(*args, **kwargs)

        for _ in range(MEASURE_PASSES):
            seen.clear()
            with preserved_rng(device), torch.enable_grad():
                run_joint(traced, values, keep=set(), on_op=on_op)
            if time.perf_counter() - t1 >= budget_s:
                break
        report.measured = len(fastest)
        weights: dict[Any, int] = {}
        for sig in sigs:
            weights[sig] = weights.get(sig, 0) + 1
        extra = in_sequence_extra(traced, values, sigs, fastest)
        if extra:
            report.step_seconds = sum(extra.get(sig, 0.0) for sig in sigs) / len(sigs)
        cache.update(round_times({sig: t + extra.get(sig, 0.0) for sig, t in fastest.items()},
                                 weights))
        report.measure_seconds = time.perf_counter() - t1
    for op, sig in zip(ops, sigs):
        op.time = float(cache[sig])
    traced.graph.meta["cost_report"] = {
        "mode": mode,
        "signatures": report.signatures,
        "measured": report.measured,
        "estimated": report.estimated,
        "resized": report.resized,
        "step_seconds": report.step_seconds,
    }
    return report
