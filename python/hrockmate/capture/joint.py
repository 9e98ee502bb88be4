"""Joint capture: one training step of a model as AOTAutograd's joint graph.

What a trace starts from and what it returns: the sample as (args, kwargs), the loss picked
from the model's output, the output's structure (``flatten_output`` / ``rebuild_output``), the
``Traced`` result and ``TraceError``; the capture itself (``capture_joint``) and the process
state it runs under (``tracing_context``: eager's kernels, module names on the nodes, the
model's own checkpoints as plain calls, ...); and the joint graph run eagerly on real values
(``placeholder_values``, ``run_joint``), which cost measurement and tests use. The contract of
the whole trace is in ``capture.trace``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import logging
import sys
import threading
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import traceback as fx_traceback
from torch.utils._python_dispatch import _disable_current_modes

from hrockmate.capture import ctc
from hrockmate.capture.decisions import SkippableRegion
from hrockmate.capture.kernels import AutocastState, autocast_off, op_kernel
from hrockmate.capture.values import ValueGuards
from hrockmate.ir.graph import Graph

__all__ = [
    "LossFn", "ModuleAttributes", "NewCacheEntriesCleared", "TensorHolder", "TensorLeaf",
    "TraceError", "Traced", "capture_joint", "coerce_like", "flatten_output", "is_traced",
    "leaf_meta", "node_module", "one_trace_at_a_time", "placeholder_values", "rebuild_output",
    "run_joint", "same_joint", "select_loss", "select_member", "split_sample", "state_slots",
    "tracing_context",
]


#: Tracing relies on process-wide state (AOTAutograd's and the dispatcher's, hooks registered on
#: the model, the global random generators), so traces and cost measurements run one at a time:
#: a thread that starts one while another runs waits for it.
_TRACE_LOCK = threading.RLock()


@contextlib.contextmanager
def quiet_tracing_noise() -> Iterator[None]:
    """PyTorch logs an error with a traceback whenever a fake (meta) kernel raises, before the
    exception reaches us; it then reaches the caller as a TraceError (naming the model's own
    error where the model fails in plain PyTorch too), so while we trace that log is noise, as
    is autograd's warning of an error in a backward node (whose "traceback of forward call" is
    empty under the tracer; the TraceError says it failed in the backward).
    (Traces run one at a time, under ``_TRACE_LOCK``.)"""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Error detected in \w+\. Traceback of "
                                    "forward call")
            yield
    finally:
        log.setLevel(level)


def one_trace_at_a_time(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run while holding the process-wide tracing lock."""

    @functools.wraps(fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _TRACE_LOCK:
            return fn(*args, **kwargs)

    return locked


class TraceError(RuntimeError):
    """The model cannot be traced into a training-iteration graph; the message says why and
    what to change."""


@dataclass
class Traced:
    graph: Graph
    gm: fx.GraphModule
    op_nodes: list[fx.Node]
    tensor_nodes: list[tuple[fx.Node, int | None]]
    sources: dict[int, tuple[str, Any]]
    output_ids: list[int]
    output_spec: tuple[pytree.TreeSpec, list[Any]]
    param_grads: dict[str, int]
    input_grads: dict[int, int]
    buffer_updates: dict[str, int]
    input_spec: pytree.TreeSpec
    input_meta: list[Any]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    autocast: AutocastState = ()
    value_guards: ValueGuards | None = None
    # where the model tested values for finiteness and the graph assumed them finite
    # (``capture.values``), and the position in ``output_ids`` of whether all held at a call
    # (after the model's outputs; views' bases AOTAutograd adds come after it)
    finite_assumptions: list[str] = field(default_factory=list)
    finite_check: int | None = None
    # random decisions (LayerDrop): what each leaves out when the draw goes the other way
    # (``capture.decisions``); their tests are outputs after the model's, before finite_check
    skippable: list[SkippableRegion] = field(default_factory=list)
    # the draws of Python's global generator a call makes (replayed at each call: a call
    # advances it as plain PyTorch does; ``host_draws_recorded``)
    python_draws: tuple[tuple[str, int], ...] = ()
    # sample leaf index -> IR tensor id of its new value: inputs the model updates in place
    # (written back into the caller's tensor once, as buffers are)
    input_updates: dict[int, int] = field(default_factory=dict)
    trace_seconds: float = 0.0
    cost_seconds: float = 0.0


# ---- sample handling ----------------------------------------------------------------------------
def split_sample(sample: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A sample as (args, kwargs): a tensor -> one positional argument, a tuple/list ->
    positional arguments, a dict -> keyword arguments."""
    if isinstance(sample, torch.Tensor):
        return (sample,), {}
    if isinstance(sample, (tuple, list)):
        return tuple(sample), {}
    if isinstance(sample, dict):
        if not all(isinstance(k, str) for k in sample):
            raise TraceError("a dict sample is passed as keyword arguments: its keys must be str")
        return (), dict(sample)
    raise TraceError(
        f"sample must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments, got {type(sample).__name__}"
    )


def leaf_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device)
    return x


LossFn = Callable[[Any], Any] | str | int


def select_member(out: Any, key: str | int) -> Any:
    """``out[key]`` for mappings and sequences, else the attribute ``key`` (dataclasses,
    named tuples, ``ModelOutput``)."""
    if isinstance(key, str) and not isinstance(out, Mapping) and hasattr(out, key):
        return getattr(out, key)
    try:
        return out[key]
    except (KeyError, IndexError, TypeError):
        pass
    raise TraceError(
        f"loss_fn={key!r} names no member of the model's output ({type(out).__name__}); name "
        "the key or attribute that holds the loss (e.g. loss_fn='loss'), or pass a function "
        "of the output"
    )


def select_loss(out: Any, key: str | int) -> torch.Tensor:
    """The loss member ``key`` of a model's output (``loss_fn`` given as a name or position)."""
    loss = select_member(out, key)
    if not isinstance(loss, torch.Tensor):
        raise TraceError(
            f"loss_fn={key!r} selects a {type(loss).__name__}, not a tensor (for a "
            "transformers model, pass labels in the sample so that it computes its loss)"
        )
    return loss


#: Objects never looked into for tensors: their tensors (if any) are not the iteration's.
_OPAQUE = (nn.Module, torch.device, torch.dtype, type, types.ModuleType, types.FunctionType,
           types.MethodType, types.BuiltinFunctionType, str, bytes, int, float, complex, bool)
#: How deep a non-tensor output object (a cache holding layers holding tensors...) is searched.
_HOLDER_DEPTH = 6
_SLOT = ("tensor",)


class TensorLeaf:
    """Where a tensor goes in an output template (``output_spec``): the class itself is the
    mark (a ``None`` leaf of the output, such as a ModelOutput field left unset in a nested
    output, stays ``None``)."""


class TensorHolder:
    """A non-tensor leaf of the model's output that holds tensors computed by the iteration
    (e.g. a transformers cache object with the keys and values of each layer). Those tensors
    are outputs of the traced graph; ``rebuild`` makes a fresh shallow copy of the object
    around the tensors of one call, leaving everything else shared with the traced one."""

    __slots__ = ("recipe",)

    def __init__(self, recipe: tuple[Any, ...]) -> None:
        self.recipe = recipe

    @staticmethod
    def find(obj: Any, is_traced: Callable[[torch.Tensor], bool],
             found: list[torch.Tensor]) -> "TensorHolder | None":
        """A holder for ``obj`` if it holds traced tensors (appended to ``found`` in the order
        ``rebuild`` consumes them), else None."""
        recipe = _holder_recipe(obj, is_traced, found, _HOLDER_DEPTH, set())
        return None if recipe is None else TensorHolder(recipe)

    def rebuild(self, tensors: Iterator[Any]) -> Any:
        return _holder_build(self.recipe, tensors)


def _holder_recipe(obj: Any, is_traced: Callable[[torch.Tensor], bool],
                   found: list[torch.Tensor], depth: int, active: set[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        if not is_traced(obj):
            return None
        found.append(obj)
        return _SLOT
    if depth == 0 or id(obj) in active or isinstance(obj, _OPAQUE) or obj is None:
        return None
    if isinstance(obj, (list, tuple)):
        items: list[tuple[Any, Any]] = list(enumerate(obj))
        kind = "sequence"
    elif isinstance(obj, dict):
        items = list(obj.items())
        kind = "dict"
    else:
        names = list(getattr(obj, "__dict__", {}))
        names += [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())
                  if isinstance(n, str) and n not in ("__dict__", "__weakref__")]
        items = [(n, getattr(obj, n)) for n in dict.fromkeys(names) if hasattr(obj, n)]
        kind = "object"
    active.add(id(obj))
    try:
        parts = []
        for key, value in items:
            sub = _holder_recipe(value, is_traced, found, depth - 1, active)
            if sub is not None:
                parts.append((key, sub))
    finally:
        active.discard(id(obj))
    return (kind, obj, parts) if parts else None


def _holder_build(recipe: tuple[Any, ...], tensors: Iterator[Any]) -> Any:
    if recipe is _SLOT:
        return next(tensors)
    kind, template, parts = recipe
    if kind == "sequence":
        items = list(template)
        for i, sub in parts:
            items[i] = _holder_build(sub, tensors)
        if isinstance(template, list):
            return type(template)(items) if type(template) is not list else items
        return type(template)(*items) if hasattr(template, "_fields") else type(template)(items)
    new = copy.copy(template)
    for key, sub in parts:
        value = _holder_build(sub, tensors)
        if kind == "dict":
            new[key] = value
        elif key in getattr(new, "__dict__", {}):
            new.__dict__[key] = value  # bypasses properties and frozen dataclasses' __setattr__
        else:
            object.__setattr__(new, key, value)
    return new


def is_traced(x: torch.Tensor) -> bool:
    """Whether ``x`` was computed while tracing (not a real tensor the model closes over)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(x, (FunctionalTensor, FakeTensor))


def flatten_output(out: Any, is_traced: Callable[[torch.Tensor], bool]
                   ) -> tuple[list[torch.Tensor], tuple[pytree.TreeSpec, list[Any]]]:
    """The tensors of a model output in order, and ``(treespec, leaves)`` to rebuild it:
    ``leaves`` holds ``TensorLeaf`` where a tensor leaf goes, a ``TensorHolder`` for a
    non-tensor leaf holding traced tensors, and other leaves as they are."""
    out_leaves, spec = pytree.tree_flatten(out)
    tensors: list[torch.Tensor] = []
    template: list[Any] = []
    for x in out_leaves:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            template.append(TensorLeaf)
        else:
            holder = TensorHolder.find(x, is_traced, tensors)
            template.append(x if holder is None else holder)
    return tensors, (spec, template)


def rebuild_output(output_spec: tuple[pytree.TreeSpec, list[Any]],
                   tensors: Sequence[torch.Tensor]) -> Any:
    """The model's output structure around ``tensors`` (in ``output_ids`` order)."""
    spec, template = output_spec
    it = iter(tensors)
    leaves = [next(it) if x is TensorLeaf else x.rebuild(it) if isinstance(x, TensorHolder)
              else x for x in template]
    return pytree.tree_unflatten(leaves, spec)


def state_slots(model: nn.Module, kinds: list[tuple[str, Any]]) -> list[tuple[str, int]]:
    """(name, index into ``kinds``) for every place the model holds a parameter or buffer,
    each place named once: tied tensors (one tensor in several modules) get the value of their
    first name, and a module registered under several paths (a shared embedding) is named by
    its first path only. ``functional_call``'s own tying swaps such a module's tensor once per
    path and restores it wrongly, leaving the traced value in the model."""
    index = {kind_key: i for i, kind_key in enumerate(kinds)}
    first_name: dict[int, tuple[str, str]] = {}
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            first_name.setdefault(id(t), (kind, name))
    slots: list[tuple[str, int]] = []
    seen: set[tuple[int, str]] = set()
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            prefix, _, attr = name.rpartition(".")
            place = (id(model.get_submodule(prefix)), attr)
            if place in seen:
                continue
            seen.add(place)
            slots.append((name, index[first_name[id(t)]]))
    return slots


# ---- module names on fx nodes -------------------------------------------------------------------
@contextlib.contextmanager
def _module_annotations(model: nn.Module, stack: list[str]) -> Iterator[None]:
    """While tracing, keep ``nn_module_stack`` in the fx node metadata up to date (the nodes
    created inside a submodule's forward record its path), and the current path in ``stack``
    for error messages. torch keeps that metadata process-wide: a forward that raises skips
    its module's exit hook, so what was there before is put back on exit (left stale, it named
    the failed trace's module on every later trace's unplaced backward ops)."""
    handles = []
    before = fx_traceback.get_current_meta().get("nn_module_stack")

    def pre(name: str, mod: nn.Module) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any) -> None:
            stack.append(name)
            meta = fx_traceback.get_current_meta()
            mstack = dict(meta.get("nn_module_stack", {}))
            mstack[name or "<root>"] = (name, type(mod))
            meta["nn_module_stack"] = mstack

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(_m: nn.Module, _args: Any, _out: Any) -> None:
            if stack and stack[-1] == name:
                stack.pop()
            meta = fx_traceback.get_current_meta()
            mstack = dict(meta.get("nn_module_stack", {}))
            mstack.pop(name or "<root>", None)
            meta["nn_module_stack"] = mstack

        return hook

    try:
        for name, mod in model.named_modules(remove_duplicate=False):
            handles.append(mod.register_forward_pre_hook(pre(name, mod)))
            handles.append(mod.register_forward_hook(post(name)))
        yield
    finally:
        for h in handles:
            h.remove()
        meta = fx_traceback.get_current_meta()
        if before is None:
            meta.pop("nn_module_stack", None)
        else:
            meta["nn_module_stack"] = before


def node_module(node: fx.Node) -> str:
    mstack = node.meta.get("nn_module_stack")
    if not mstack:
        return ""
    path = list(mstack.values())[-1][0]
    return path if isinstance(path, str) else str(path)


def same_joint(a: fx.GraphModule, b: fx.GraphModule) -> bool:
    """Whether two traces of one step are the same graph: the same nodes, arguments and
    literals, and equal constant tensors."""
    if str(a.graph) != str(b.graph):
        return False
    for node in a.graph.nodes:
        if node.op != "get_attr":
            continue
        x, y = getattr(a, node.target, None), getattr(b, node.target, None)
        try:
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        except Exception:  # noqa: BLE001 - fake or odd values: not known to be the same
            return False
        if not same:
            return False
    return True


# ---- eager-faithful dispatch --------------------------------------------------------------------
# Ops whose Python tracing override picks a different implementation than eager PyTorch on the
# same device. ``aten.dropout`` is overridden to ``native_dropout`` (a bool mask) while eager CPU
# dropout multiplies by a float noise tensor; the saved mask is then 4x larger in eager. The
# traced graph must describe (and reproduce) what plain PyTorch does, so these overrides are
# switched off while tracing and the op's own composite implementation is traced instead.
_EAGER_FAITHFUL_OPS: tuple[Any, ...] = (torch.ops.aten.dropout.default,) + tuple(
    # interpolation: the overrides trace index/gather ops (bilinear and bicubic round
    # differently from eager's kernels: gradients were not bitwise equal), where eager runs the
    # upsampling kernel and its backward
    getattr(getattr(torch.ops.aten, f"upsample_{mode}"), overload)
    for mode in ("nearest1d", "nearest2d", "nearest3d", "linear1d", "bilinear2d", "bicubic2d",
                 "trilinear3d")
    for overload in ("default", "vec")
    if hasattr(getattr(torch.ops.aten, f"upsample_{mode}"), overload))
# On the CPU, eager LSTMs run oneDNN's layer kernel (``mkldnn_rnn_layer``, with the workspace
# its backward reads) wherever oneDNN can. The Python override takes that kernel only when the
# LSTM's input needs no gradient, and then in its inference mode, without a workspace, even when
# the weights need gradients: the traced backward failed at run time ("... got None ... for
# argument #22 'workspace'"). Otherwise it unrolls the layer into per-step ops, which round
# differently from oneDNN (timm's Sequencer2D: gradients 6e-7 off eager's; 3,143 ops where
# eager's path gives 307). (On CUDA eager runs cuDNN's RNN; the override is kept there.)
_EAGER_FAITHFUL_CPU_OPS: tuple[Any, ...] = tuple(
    getattr(getattr(torch.ops.aten, rnn), overload)
    for rnn in ("lstm", "gru", "rnn_tanh", "rnn_relu") for overload in ("input", "data"))


@contextlib.contextmanager
def eager_faithful_dispatch(device: torch.device) -> Iterator[None]:
    from torch._C import DispatchKey

    ops = _EAGER_FAITHFUL_OPS + (_EAGER_FAITHFUL_CPU_OPS if device.type == "cpu" else ())
    removed: list[tuple[Any, Any, Any]] = []
    try:
        for op in ops:
            for key in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd):
                fn = op.py_kernels.pop(key, None)
                if fn is not None:
                    removed.append((op, key, fn))
            op._dispatch_cache.clear()
        yield
    finally:
        for op, key, fn in removed:
            op.py_kernels[key] = fn
        for op in ops:
            op._dispatch_cache.clear()


# ---- capture ------------------------------------------------------------------------------------
class _Captured(Exception):
    """Raised from the partition hook to stop AOTAutograd once the joint graph is captured."""


def capture_joint(
    fn: Callable[..., Any], flat: list[torch.Tensor]
) -> fx.GraphModule:
    from torch._functorch.aot_autograd import aot_function

    box: dict[str, fx.GraphModule] = {}

    def partition(joint: fx.GraphModule, _inputs: Any, **_kw: Any) -> Any:
        box["joint"] = joint
        raise _Captured

    def never(gm: fx.GraphModule, _inputs: Any) -> Any:
        return gm

    compiled = aot_function(fn, fw_compiler=never, bw_compiler=never, partition_fn=partition)
    try:
        compiled(*flat)
    except _Captured:
        pass
    if "joint" not in box:
        raise TraceError(
            "no gradient flows in this model: no parameter or input that requires grad "
            "influences its output; check requires_grad and that the output is not detached"
        )
    ctc.rewrite_backwards(box["joint"])
    return box["joint"]


@contextlib.contextmanager
def distribution_checks_off() -> Iterator[None]:
    """``torch.distributions`` checks a distribution's arguments by default (``scale > 0``, ...)
    and raises on a bad one: a read of tensor values, which one graph for every batch cannot
    hold (HF's time-series models build a StudentT from the model's outputs). The checks change
    no value, so the default is off while tracing (distributions built with
    ``validate_args=True`` still check); plain PyTorch runs keep it."""
    from torch.distributions import Distribution

    old = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(old)


@contextlib.contextmanager
def tensor_literals_read() -> Iterator[None]:
    """``torch.tensor(data)`` with tensors of the trace in ``data`` (transformers' Qwen2-VL
    makes its rope deltas from a list of 0-d results) reads their values: PyTorch's C++ copies
    their memory, which fake tensors do not have ("data is not allocated yet"). Values of the
    inputs or of constants are answered (``ValueReads``, guarded where they come from the
    inputs); others stop the trace as any read of a value does. The dtype is the one
    ``torch.tensor`` infers from the tensors' dtypes."""
    original = torch.tensor

    def tensor(data: Any, **kwargs: Any) -> torch.Tensor:
        if not any(isinstance(x, torch.Tensor) and is_traced(x)
                   for x in pytree.tree_leaves(data)):
            return original(data, **kwargs)
        if kwargs.get("dtype") is None:
            with _disable_current_modes():  # (real stand-ins of the same dtypes)
                kwargs["dtype"] = original(pytree.tree_map_only(
                    torch.Tensor, lambda x: torch.zeros(x.shape, dtype=x.dtype), data)).dtype
        return original(pytree.tree_map_only(torch.Tensor, lambda x: x.tolist(), data),
                        **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = original


@contextlib.contextmanager
def checkpoints_as_plain_calls(found: list[str]) -> Iterator[None]:
    """The model's own activation checkpointing (``torch.utils.checkpoint.checkpoint``: what
    transformers' ``gradient_checkpointing_enable``, ``checkpoint_sequential`` and
    ``checkpoint_wrapper`` call) runs its function as a plain call while tracing. The plan
    decides what is recomputed; a checkpoint traced as it is put the recomputation and
    autograd's reentrant or saved-tensor-hook machinery into the joint graph, and gradients
    were not eager's (HF Llama with gradient checkpointing: 757 ops, not bitwise; eager with
    and without checkpointing are bitwise equal, with dropout too, since the checkpoint
    replays the random state). ``found`` gets one entry per checkpointed call. Where the
    private entry point is missing (another torch), checkpoints are traced as they are."""
    import torch.utils.checkpoint as ckpt

    impl = getattr(ckpt, "_checkpoint_impl", None)
    if impl is None:
        yield
        return

    def plain(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              **options: Any) -> Any:
        if options.get("use_reentrant") in (None, True) and (kwargs or not any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in args)):
            # eager's reentrant checkpoint refuses keyword arguments, and differentiates
            # nothing inside when no input requires grad (it warns): left to it
            return impl(function, args, kwargs, **options)
        found.append(getattr(function, "__qualname__", type(function).__name__))
        return function(*args, **kwargs)

    ckpt._checkpoint_impl = plain
    try:
        yield
    finally:
        ckpt._checkpoint_impl = impl


@contextlib.contextmanager
def compiling_paths_taken() -> Iterator[None]:
    """Make ``torch.compiler.is_compiling()`` answer True, as ``torch.export`` does while it
    traces. Libraries check it (transformers' ``is_tracing`` among them) to take code paths
    that never read tensor values, e.g. building an attention mask instead of first testing
    whether the padding mask is all ones; those paths are what a graph reused for every batch
    of the sample's shape must contain."""
    old = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


@contextlib.contextmanager
def tracing_context(model: nn.Module, device: torch.device, module_stack: list[str],
                    checkpointed: list[str], compiling_paths: bool) -> Iterator[None]:
    """The process state one capture runs under: grad mode on, eager's kernels
    (``eager_faithful_dispatch``), PyTorch's tracing noise quiet, distribution checks off,
    ``torch.tensor`` of traced values answered, module paths on the nodes (and the current one
    in ``module_stack``), autocast off in the backward (as a ``loss.backward()`` after the
    autocast region runs it), the model's checkpoints as plain calls (named in
    ``checkpointed``), and with ``compiling_paths`` the compilers' code paths."""
    with torch.enable_grad(), eager_faithful_dispatch(device), quiet_tracing_noise(), \
            distribution_checks_off(), tensor_literals_read(), \
            _module_annotations(model, module_stack), \
            torch._functorch.config.patch(backward_pass_autocast="off"), \
            checkpoints_as_plain_calls(checkpointed), \
            compiling_paths_taken() if compiling_paths else contextlib.nullcontext():
        yield


def _model_lru_caches() -> dict[int, tuple[Any, int]]:
    """The ``functools.lru_cache`` caches of code outside torch, hrockmate and Python's
    standard library: id -> (the cached function, its misses so far)."""
    skipped = {"torch", "hrockmate", *sys.stdlib_module_names}
    caches: dict[int, tuple[Any, int]] = {}
    for obj in gc.get_objects():
        if type(obj) is functools._lru_cache_wrapper and \
                (getattr(obj, "__module__", None) or "").split(".")[0] not in skipped:
            caches[id(obj)] = (obj, obj.cache_info().misses)
    return caches


class NewCacheEntriesCleared:
    """Clears the model code's LRU caches that computed entries during a trace: an entry
    made while tracing can hold a fake tensor (transformers'
    ``compile_compatible_method_lru_cache`` keeps BEiT's relative position index), which
    would break the next trace and the model in plain PyTorch for the rest of the process.
    Caches only skip work again, so clearing one changes no result. One per ``trace_model``
    call: what a trace leaves is what the next one starts from (the scan of the process's
    objects takes about 0.1 s), and a cache that got entries between two traces is cleared
    too, which also changes no result."""

    def __init__(self) -> None:
        self._after: dict[int, tuple[Any, int]] | None = None

    @contextlib.contextmanager
    def around(self) -> Iterator[None]:
        before = self._after if self._after is not None else _model_lru_caches()
        try:
            yield
        finally:
            now = _model_lru_caches()
            for key, (cached, misses) in now.items():
                if key not in before or misses > before[key][1]:
                    cached.cache_clear()
                    now[key] = (cached, cached.cache_info().misses)
            self._after = now


class ModuleAttributes:
    """The model's modules' plain attributes that hold a tensor or None, as before a trace.
    Model code caches tensors there on first use (transformers' Mimi keeps its codebook's
    ``_embed``): a trace would leave a fake tensor behind, which breaks AOTAutograd's next pass
    of the same trace and the model in plain PyTorch for the rest of the process (Mimi failed
    eagerly after a failed trace, and the failure was blamed on the model). ``restore`` puts
    them back: before each pass (each computes such a value in its own graph, as a first call
    does) and after the trace."""

    _TABLES = frozenset({"_parameters", "_buffers", "_modules"})

    def __init__(self, model: nn.Module) -> None:
        self._saved = [
            (m, {k: v for k, v in vars(m).items()
                 if k not in self._TABLES and (v is None or isinstance(v, torch.Tensor))})
            for m in model.modules()]

    def restore(self) -> None:
        for module, saved in self._saved:
            attrs = vars(module)
            for k, v in list(attrs.items()):
                if k in saved:
                    if v is not saved[k]:
                        attrs[k] = saved[k]
                elif isinstance(v, torch.Tensor):
                    del attrs[k]  # (made by the traced call)


# ---- running the joint graph --------------------------------------------------------------------
def placeholder_values(
    traced: Traced,
    model: nn.Module,
    sample: Any,
    tangents: Sequence[torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Real values for the joint graph's placeholders: the model's parameters and buffers, the
    sample's tensors, and ``tangents`` (default: ones, i.e. ``loss.backward()`` for a scalar)."""
    args, kwargs = split_sample(sample)
    leaves = pytree.tree_leaves((args, kwargs))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    values: dict[str, torch.Tensor] = {}
    for tid, (kind, key) in traced.sources.items():
        node = traced.tensor_nodes[tid][0]
        if kind == "param":
            values[node.name] = params[key].detach()
        elif kind == "buffer":
            values[node.name] = buffers[key].detach()
        elif kind == "input":
            values[node.name] = leaves[key].detach()
        elif kind == "constant":
            continue  # read from the graph module by run_joint
        else:
            meta = node.meta["val"]
            if tangents is not None:
                values[node.name] = coerce_like(tangents[key], meta)
            else:
                values[node.name] = torch.empty_strided(
                    meta.shape, meta.stride(), dtype=meta.dtype, device=traced.device
                ).fill_(1)
    return values


def coerce_like(value: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """``value`` with the shape, strides and dtype of the placeholder metadata ``meta`` (copied
    only when they differ). AOTAutograd traces a tangent with the strides of its output (e.g.
    a transposed attention output), and the joint graph's views rely on them."""
    if tuple(value.shape) != tuple(meta.shape):
        raise ValueError(
            f"tangent of shape {tuple(value.shape)} given for an output of shape "
            f"{tuple(meta.shape)}"
        )
    if value.stride() == meta.stride() and value.dtype == meta.dtype:
        return value
    out = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=value.device)
    out.copy_(value)
    return out


def run_joint(
    traced: Traced,
    values: dict[str, torch.Tensor],
    *,
    keep: set[int] | None = None,
    on_op: Callable[[int, fx.Node, tuple[Any, ...], dict[str, Any]], Any] | None = None,
) -> dict[int, torch.Tensor]:
    """Run the joint graph's ops eagerly in order on real placeholder ``values`` (by node name),
    freeing each value after its last use. Returns the values of the IR tensors in ``keep``
    (default: outputs, gradients and buffer updates). ``on_op(op_id, node, args, kwargs)``, if
    given, runs the op instead of calling it directly and returns its result."""
    graph = traced.gm.graph
    if keep is None:
        keep = set(traced.output_ids) | set(traced.param_grads.values()) | set(
            traced.input_grads.values()) | set(traced.buffer_updates.values()) | set(
            traced.input_updates.values())
    keep_at: dict[fx.Node, list[tuple[int, int | None]]] = {}
    for tid in keep:
        node, index = traced.tensor_nodes[tid]
        keep_at.setdefault(node, []).append((tid, index))
    op_index = {n: i for i, n in enumerate(traced.op_nodes)}
    last_use: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        for a in node.all_input_nodes:
            last_use[a] = node
    dies_after: dict[fx.Node, list[fx.Node]] = {}
    for a, user in last_use.items():
        dies_after.setdefault(user, []).append(a)

    env: dict[fx.Node, Any] = {}
    kept: dict[int, torch.Tensor] = {}
    with autocast_off():  # (the graph holds autocast's casts already)
        for node in graph.nodes:
            if node.op == "placeholder":
                if node.name not in values:
                    raise ValueError(f"no value given for placeholder {node.name}")
                env[node] = values[node.name]
            elif node.op == "get_attr":
                env[node] = getattr(traced.gm, node.target)
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                if node in op_index and on_op is not None:
                    env[node] = on_op(op_index[node], node, args, kwargs)
                else:
                    env[node] = op_kernel(node, traced.device.type)(*args, **kwargs)
                for tid, index in keep_at.get(node, ()):
                    kept[tid] = env[node] if index is None else env[node][index]
            elif node.op == "output":
                break
            for dead in dies_after.get(node, ()):
                if dead.op != "output":
                    env.pop(dead, None)
    return kept
