"""Peak-memory measurement by the budget definition of hrockmate.

The budget bounds *activation memory*: the peak, during one training step, of the memory
allocated beyond what was allocated before the step started, not counting the parameters'
``.grad`` tensors.

How ``measure_peak_memory`` implements it:
- ``.grad`` exclusion: for every parameter passed in ``params`` whose ``.grad`` is ``None``, a
  zero ``.grad`` is created *before* the baseline is taken. Autograd then accumulates each
  parameter's gradient into that existing tensor in place, so the freshly computed gradient is
  a transient: it is counted from the moment the backward op produces it until autograd has
  added it into ``.grad`` and dropped it. This is exactly how the graph IR counts ``param_grad``
  tensors (alive from production until freed, and freeing = handing to ``.grad``).
- CUDA: ``reset_peak_memory_stats``; baseline = ``memory_allocated()`` before the step; peak =
  ``max_memory_allocated()`` during the step minus the baseline. These are the caching
  allocator's block sizes (rounded up to 512 bytes), so tiny tensors count a little more than
  their ``nbytes``. Also reported: ``reserved_peak_bytes``, the peak of ``memory_reserved()``
  above its value before the step, the allocator's cache emptied first: what the process holds
  from the driver, fragmentation included.
- CPU: ``torch.profiler`` with ``profile_memory=True`` records every allocation and free made
  while the step runs on the threads it profiles; the peak of the running sum of their byte
  counts is the peak. The profiler only sees allocations made during the step, so
  ``baseline_bytes`` is 0 on CPU (the peak is relative to the start of the step by
  construction). It does not see a free made on another thread: a collective's worker thread
  (gloo) that drops the last reference to a buffer after the step's thread let it go frees it
  unseen, and the running sum then keeps those bytes to the end, by chance. So with a process
  group of more than one rank the CPU count is ``"tensors"``: the storages the step's ops create
  (a dispatch mode sees every op, backward's included) and the storages resized in place
  (FSDP2 gathers and frees its parameters so), each counted until it is freed on whichever
  thread (a finalizer on the storage); allocations inside an op that do not outlive it are not
  seen, nor those compiled code makes without dispatching ops (compiled mode's own checks use
  the allocator's count).

The step function's return value stays referenced until the measurement ends, so tensors it
returns (e.g. the model's outputs) count until the end of the step, like ``output`` tensors in
the IR. Whatever the step needs that is not part of the iteration (inputs, tangents) must be
created before calling ``measure_peak_memory``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

__all__ = [
    "PeakMeasurement",
    "measure_peak_memory",
    "eager_training_step",
    "measure_eager_peak",
]


@dataclass
class PeakMeasurement:
    peak_bytes: int
    baseline_bytes: int
    device: str
    #: on CPU: memory above the start after each allocator event (bytes); None on CUDA.
    timeline: list[int] | None = None
    #: what the step function returned (kept alive until the measurement ended)
    result: Any = field(default=None, repr=False)
    #: on CUDA: the caching allocator's reserved-memory peak above what it held before the step
    #: (its cache emptied first), which includes fragmentation; None on CPU.
    reserved_peak_bytes: int | None = None


def _resolve_device(device: torch.device | str | None, params: list[torch.Tensor]) -> torch.device:
    if device is not None:
        return torch.device(device)
    if params:
        return params[0].device
    return torch.device("cpu")


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Hide what native code writes to stderr meanwhile (the profiler library prints a banner
    on every start and stop that is noise to users)."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced, e.g. by a test runner
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def cpu_memory_profile() -> Iterator[Any]:
    """``torch.profiler`` recording CPU allocator events, started and stopped quietly."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_native_stderr():
        prof.start()
    try:
        yield prof
    finally:
        with _quiet_native_stderr():
            prof.stop()


def measure_peak_memory(
    step_fn: Callable[[], Any],
    *,
    device: torch.device | str | None = None,
    params: Iterable[torch.Tensor] | None = None,
    count: str | None = None,
) -> PeakMeasurement:
    """Run ``step_fn()`` once and measure its activation-memory peak (see module docstring).

    ``params``: the parameters whose ``.grad`` must not count (zero ``.grad`` tensors are
    created for those that have none). ``device``: where to measure; default: the parameters'
    device, else CPU. ``count`` (CPU only): ``"allocator"`` (the profiler's allocation events)
    or ``"tensors"`` (live storages, right where other threads free memory); default
    ``"tensors"`` inside a process group of more than one rank, else ``"allocator"``.
    """
    if count not in (None, "allocator", "tensors"):
        raise ValueError(f"measure_peak_memory: count must be 'allocator' or 'tensors', got "
                         f"{count!r}")
    plist = list(params) if params is not None else []
    dev = _resolve_device(device, plist)
    with torch.no_grad():
        for p in plist:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # reserved memory then starts from what is allocated
        baseline = torch.cuda.memory_allocated(dev)
        reserved_before = torch.cuda.memory_reserved(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result = step_fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - baseline
        reserved = torch.cuda.max_memory_reserved(dev) - reserved_before
        return PeakMeasurement(int(peak), int(baseline), str(dev), None, result, int(reserved))
    if dev.type != "cpu":
        raise ValueError(
            f"measure_peak_memory supports cpu and cuda devices, got {dev}; "
            "move the model to one of them"
        )
    if count is None:
        count = "tensors" if _in_process_group() else "allocator"
    if count == "tensors":
        with _LiveStorages() as live:
            result = step_fn()
        return PeakMeasurement(live.peak, 0, str(dev), live.timeline, result)
    with cpu_memory_profile() as prof:
        result = step_fn()
    events = sorted(
        (ev.start_ns(), int(ev.nbytes()))
        for ev in prof.profiler.kineto_results.events()
        if ev.name() == "[memory]" and ev.device_type() == torch.autograd.DeviceType.CPU
    )
    running = peak = 0
    timeline: list[int] = []
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
        timeline.append(running)
    return PeakMeasurement(int(peak), 0, str(dev), timeline, result)


def _in_process_group() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class _LiveStorages:
    """Counts the bytes of the storages alive above the start, for ``count="tensors"``: those
    the ops run meanwhile create (their outputs' storages not seen before as inputs) and the
    bytes any storage gains or loses by ``UntypedStorage.resize_``; a storage's bytes leave the
    count when it is freed, by a finalizer that runs on the thread that frees it."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.timeline: list[int] = []
        # id(storage) -> (its bytes when first seen if it existed before, else 0; the bytes
        # counted for it now)
        self.known: dict[int, tuple[int, int]] = {}

    def _note(self, storage: Any, existed: bool) -> int:
        """Start following ``storage`` (once); returns its key."""
        import weakref

        key = id(storage)
        with self.lock:
            if key in self.known:
                return key
            self.known[key] = (int(storage.nbytes()) if existed else 0, 0)
        weakref.finalize(storage, self._freed, key)
        return key

    def _count(self, key: int, nbytes: int) -> None:
        with self.lock:
            base, counted = self.known.get(key, (0, 0))
            now = nbytes - base
            self.known[key] = (base, now)
            self.running += now - counted
            self.peak = max(self.peak, self.running)
            self.timeline.append(self.running)

    def _freed(self, key: int) -> None:
        with self.lock:
            base, counted = self.known.pop(key, (0, 0))
            self.running -= counted + base
            self.timeline.append(self.running)

    @staticmethod
    def _storages(tree: Any) -> Iterator[Any]:
        for t in pytree.tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                try:
                    yield t.untyped_storage()
                except (RuntimeError, NotImplementedError):  # (no storage: a wrapper subclass)
                    continue

    def __enter__(self) -> "_LiveStorages":
        from torch.utils._python_dispatch import TorchDispatchMode

        live = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                kwargs = kwargs or {}
                for st in live._storages((args, kwargs)):  # (an output aliasing an input is
                    live._note(st, existed=True)  # not new memory)
                out = func(*args, **kwargs)
                for st in live._storages(out):
                    if id(st) not in live.known:
                        live._count(live._note(st, existed=False), int(st.nbytes()))
                return out

        original = torch.UntypedStorage.resize_

        def resize_(storage: Any, size: int) -> Any:
            if storage.device.type != "cpu":
                return original(storage, size)
            key = live._note(storage, existed=True)
            result = original(storage, size)
            live._count(key, int(storage.nbytes()))
            return result

        self._original = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original  # type: ignore[method-assign]


def _backward_roots(out: Any, loss_fn: Any) -> tuple[Any, list[torch.Tensor]]:
    """(the step's result, the tensors backward starts from) for a model output and a
    ``loss_fn`` as in ``hrockmate.trace``: a function's result, or the named loss member."""
    if isinstance(loss_fn, (str, int)):
        from hrockmate.capture.joint import select_loss

        return out, [select_loss(out, loss_fn)]
    if loss_fn is not None:
        out = loss_fn(out)
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return out, [x for x in leaves if x.requires_grad]


def eager_training_step(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: Any = None,
    tangents: list[torch.Tensor] | None = None,
) -> Callable[[], Any]:
    """A plain-autograd training step for ``measure_peak_memory``: forward (plus ``loss_fn``,
    as in ``hrockmate.trace``), then backward from the tensor outputs that require grad (only
    the loss when ``loss_fn`` names it) with ``tangents`` (one per such output, in pytree
    order; create them beforehand, default ones made on first use). Returns the outputs, so
    they stay alive until the step ends."""
    from hrockmate.capture.joint import split_sample

    args, kwargs = split_sample(sample)

    def step() -> Any:
        out, diff = _backward_roots(model(*args, **kwargs), loss_fn)
        grads = tangents if tangents is not None else [torch.ones_like(x) for x in diff]
        if len(grads) != len(diff):
            raise ValueError(
                f"{len(grads)} tangents given for {len(diff)} outputs that require grad"
            )
        torch.autograd.backward(diff, grads)
        return out

    return step


def measure_eager_peak(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: Any = None,
    traced: Any = None,
) -> PeakMeasurement:
    """Activation-memory peak of one plain-autograd training step of ``model`` on ``sample``:
    the iteration a traced graph describes, with tangents of ones created before the baseline
    (shapes from ``traced`` when given, else from a no-grad forward run)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if traced is not None:
        g = traced.graph
        tangent_ids = sorted(
            (key, tid) for tid, (kind, key) in traced.sources.items() if kind == "tangent"
        )
        tangents = []
        for _key, tid in tangent_ids:
            t = g.tensors[tid]
            tangents.append(torch.ones(t.shape or [], dtype=getattr(torch, t.dtype or "float32"),
                                       device=traced.device))
    else:
        from hrockmate.capture.joint import split_sample

        args, kwargs = split_sample(sample)
        with torch.enable_grad():
            out, roots = _backward_roots(model(*args, **kwargs), loss_fn)
        tangents = [torch.ones_like(x) for x in roots]
        del out, roots
    step = eager_training_step(model, sample, loss_fn=loss_fn, tangents=tangents)
    return measure_peak_memory(step, params=params)
