"""Tracing: one training iteration of a model -> the graph IR plus an executable joint graph.

CONTRACT (shared by the tracer and the runtime; keep this docstring true):

``trace_model(model, sample, *, loss_fn=None, cost="measure"|"estimate"|"none") -> Traced``
(``hrockmate.trace(model, sample, ...)`` with the same arguments returns just the graph.)

``Traced`` fields:
- ``graph``: the IR (``hrockmate.ir.graph.Graph``), ops in the joint graph's execution order
  (forward ops, then backward ops).
- ``gm``: a ``torch.fx.GraphModule`` holding the AOTAutograd joint graph (ATen level, functional):
  placeholders are the primals (parameters, buffers, flattened user inputs) then the tangents;
  running its ops eagerly in order reproduces plain autograd.
- ``op_nodes[op_id]``: the fx node an IR op executes (``node.target(*args, **kwargs)``).
- ``tensor_nodes[tensor_id] = (node, index)``: where an IR tensor's value comes from: the fx node
  and the position in its tuple output (``None`` when the node returns a single tensor).
- ``sources``: for pre-existing tensors, ``tensor_id -> (kind, key)`` with kind ``"param"``
  (key = parameter name), ``"buffer"`` (buffer name), ``"input"`` (index into the flattened
  sample leaves), ``"tangent"`` (index into ``output_ids``), ``"constant"`` (key = attribute
  name on ``gm``: a real tensor the model or ``loss_fn`` closes over, e.g. targets or a plain
  tensor attribute; the same object, not a copy, so in-place changes to it are seen; its fx
  node is a ``get_attr`` node, its IR role ``buffer``).
- ``output_ids``: IR tensor ids of the model's tensor outputs, in pytree-flattened order;
  ``output_spec``: what rebuilds the output's structure around them (see below).
- ``param_grads``: parameter name -> IR tensor id of its gradient.
- ``input_grads``: flat input index -> IR tensor id of its gradient.
- ``buffer_updates``: buffer name -> IR tensor id of its new value (written back once).
- ``input_spec`` / ``input_meta``: pytree spec of (args, kwargs) and, per leaf, (shape, dtype,
  device) for tensors or the value itself for non-tensors: what later calls are checked against.
- ``autocast``: the ``torch.autocast`` regions active while tracing (``kernels.autocast_state``;
  empty without autocast). The forward is traced under them, so their casts are ops of the
  graph; the backward is traced with autocast off, as eager runs a ``loss.backward()`` called
  after the autocast region (PyTorch's recommended use). The ops run with autocast off
  (``kernels.autocast_off``), and the trace is valid only for calls under the same regions.
- ``value_guards``: reads of values of the inputs and of small buffers that the trace answered
  (``capture.values``; a second eager-path try after a read: see ``trace_model``), or None:
  the graph holds the path those values took, so ``value_guards.failing(value_of)`` must be
  None for a call to use it (``value_of(("input", k))``: the k-th tensor input,
  ``value_of(("buffer", name))``).

Details of the mapping (see docs/graph-ir.md for the IR itself):
- Every ``call_function`` node that computes tensors is an op; ``getitem`` nodes only select a
  member of a multi-output op and are not ops. Every tensor member of an op's output is an IR
  tensor, used or not (it is allocated either way).
- A tensor sharing its input's storage (view ops, detected from the fake tensors' storages and
  the op schema's alias annotations) has ``alias_of`` set and ``bytes`` 0; other tensors own a
  storage of ``untyped_storage().nbytes()`` bytes (on CUDA rounded up to the caching
  allocator's 512-byte blocks, as ``torch.cuda.memory_allocated`` counts them).
- ``output_spec`` is ``(treespec, leaves)`` where ``leaves`` holds ``TensorLeaf`` where a
  tensor leaf goes, a ``TensorHolder`` for a non-tensor leaf that holds tensors computed by
  the iteration (e.g. a transformers cache: its tensors are outputs too, in the order it
  rebuilds from), and the other non-tensor leaves as they are;
  ``rebuild_output(output_spec, tensors)`` rebuilds.
- Outputs without a gradient (not requiring grad, or not the member ``loss_fn`` names) have no
  tangent; ``sources`` holds tangents only for the others.
- ``input_spec`` is the treespec of ``(args, kwargs)``; ``sample`` given as a tensor means
  ``args = (sample,)``, a tuple or list means positional arguments, a dict keyword arguments.
- Where a required result would otherwise be a pre-existing tensor or the same tensor as another
  required result (e.g. a gradient that equals a tangent), an ``aten.alias`` node is inserted
  into ``gm`` so that every required result is produced by its own op.
- Tangent values must have the strides of their placeholder's ``node.meta["val"]``
  (AOTAutograd traces a tangent with its output's strides, which may be non-contiguous, e.g. a
  batch-first attention output, and the joint graph's views rely on them): pass them through
  ``coerce_like(value, node.meta["val"])``.
- Run the ops with grad mode enabled (on detached values): some kernels return what their
  backward needs only then (oneDNN's LSTM layer returns its workspace only in grad mode).
- With ``cost`` other than ``"none"`` the joint graph is run once on the real sample and the
  IR's sizes are corrected where a fake kernel got an output's size wrong.
- Thread safety: ``trace_model`` and ``annotate_costs`` hold one process-wide lock, so traces
  started from several threads run one after another (and give the same graph as alone).
- A model whose trace fails at a read of its inputs' values is traced again with those reads
  answered and guarded (kept when each is a test, True or False); otherwise (a count read, a
  fake tensor kept by a cache) it is traced with ``torch.compiler.is_compiling()`` answering
  True (``graph.meta["compiling_paths"]``), so that code with a value-independent path for
  compilers (transformers' mask helpers) takes it and caches that compilers bypass are
  bypassed. Entries that model code's ``functools.lru_cache`` caches computed during a trace
  are dropped after it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import logging
import operator
import os
import re
import sys
import sysconfig
import threading
import time
import traceback
import types
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import traceback as fx_traceback
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from hrockmate.capture import ctc
from hrockmate.capture.decisions import (
    MIN_DERIVED_RUN,
    DecisionError,
    SkippableRegion,
    SkipRules,
    cache_key,
    check_skipped,
    check_together,
    derive_between,
    order_after_tests,
    regions_from_json,
    regions_to_json,
    skipped_part,
)
from hrockmate.capture.kernels import (
    AutocastState,
    autocast_off,
    autocast_state,
    draws_random_numbers,
    op_kernel,
)
from hrockmate.capture.values import (
    MAX_BYTES,
    Decision,
    FinitenessTests,
    MaskWritesByPositions,
    ValueGuards,
    ValueReads,
)
from hrockmate.ir.graph import Graph, Op, Tensor
from hrockmate.progress import Progress

__all__ = [
    "COST_MODES", "LossFn", "TensorHolder", "TensorLeaf", "TraceError", "Traced", "coerce_like",
    "flatten_output", "placeholder_values", "rebuild_output", "run_joint", "select_loss",
    "select_member", "split_sample", "trace", "trace_graph", "trace_model",
]

COST_MODES = ("measure", "estimate", "none")

logger = logging.getLogger(__name__)

#: Tracing relies on process-wide state (AOTAutograd's and the dispatcher's, hooks registered on
#: the model, the global random generators), so traces and cost measurements run one at a time:
#: a thread that starts one while another runs waits for it.
_TRACE_LOCK = threading.RLock()


@contextlib.contextmanager
def _quiet_tracing_noise() -> Iterator[None]:
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


def _leaf_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, x.device)
    return x


def _starts_backward(node: fx.Node) -> bool:
    """Whether ``node`` is part of the backward pass by itself: marked so by autograd, or
    reading a tangent (the phase of the IR starts at the first such node)."""
    from torch._functorch._aot_autograd import descriptors as d

    return bool(node.meta.get("autograd_backward")) or any(
        a.op == "placeholder" and isinstance(a.meta.get("desc"), d.TangentAOTInput)
        for a in node.all_input_nodes)


def _forward_results_first(graph: fx.Graph) -> None:
    """Move ahead of the backward pass the nodes after its start that compute only results of
    the forward call from forward values (no tangent, no backward node in their inputs, used
    only by the graph's output or by such nodes). AOTAutograd can emit an output's view there
    (transformers' MobileBERT: its logits reshaped and detached after the gradients); the IR's
    phase starts at the first backward node, so such an output would be "produced by a backward
    op", which no schedule can return from the forward segment."""
    nodes = list(graph.nodes)
    start = next((i for i, n in enumerate(nodes) if n.op == "call_function"
                  and _starts_backward(n)), None)
    if start is None:
        return
    backward: set[fx.Node] = set()
    later = [n for n in nodes[start:] if n.op == "call_function"]
    for n in later:
        if _starts_backward(n) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    results: set[fx.Node] = set()
    for n in reversed(later):
        if n not in backward and n.users and all(u.op == "output" or u in results
                                                 for u in n.users):
            results.add(n)
    # (only those whose inputs come before the backward's start or move too)
    after_start = set(later)
    moved: list[fx.Node] = []
    for n in later:
        if n in results and all(a not in after_start or a in results
                                for a in n.all_input_nodes):
            moved.append(n)
        else:
            results.discard(n)
    first = nodes[start]
    for n in moved:
        first.prepend(n)  # (in order: each lands right before the backward's first node)


# ---- model outputs ------------------------------------------------------------------------------
#: What ``loss_fn`` may be: a function of the model's output, or the key / attribute name (str)
#: or position (int) of the loss in it (``"loss"`` for a transformers ``ModelOutput``).
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


def _is_traced(x: torch.Tensor) -> bool:
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


def _state_slots(model: nn.Module, kinds: list[tuple[str, Any]]) -> list[tuple[str, int]]:
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


def _node_module(node: fx.Node) -> str:
    mstack = node.meta.get("nn_module_stack")
    if not mstack:
        return ""
    path = list(mstack.values())[-1][0]
    return path if isinstance(path, str) else str(path)


# ---- RNG state --------------------------------------------------------------------------------
@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore the CPU (and the device's CUDA) generator state on exit."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


@contextlib.contextmanager
def host_draws_recorded(drawn: set[str], record: PythonDraws | None = None,
                        forced: float | None = None) -> Iterator[None]:
    """Adds to ``drawn`` the host generators (Python's ``random``, numpy's global one) that the
    body drew from, and restores their states on exit. A traced call's host draws are fixed in
    the graph: the runtime replays torch's generators at every call, not these. ``record``
    gets the draws of Python's global generator (``PythonDraws``). ``forced``: what each
    ``random()`` returns instead of its draw."""
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    inst = random._inst  # type: ignore[attr-defined]  # (the global generator)
    real_random, real_bits = inst.random, inst.getrandbits
    module_random, module_bits = random.random, random.getrandbits

    def draw() -> float:
        if record is not None:
            record.calls.append(("random", 0))
        value = real_random()
        return value if forced is None else forced

    def bits(k: int) -> int:
        if record is not None:
            record.calls.append(("getrandbits", int(k)))
        return real_bits(k)

    # (an instance attribute shadows the method for the generator's own functions: uniform,
    # randint, choice, shuffle...; the module's random() and getrandbits() are bound apart)
    inst.random, inst.getrandbits = draw, bits
    random.random, random.getrandbits = draw, bits
    try:
        yield
    finally:
        del inst.random, inst.getrandbits
        random.random, random.getrandbits = module_random, module_bits
        if record is not None:
            record.end = random.getstate()
        if random.getstate() != py:
            drawn.add("Python's random")
        now = np.random.get_state()
        if now[2:] != npy[2:] or not np.array_equal(now[1], npy[1]):
            drawn.add("numpy.random")
        random.setstate(py)
        np.random.set_state(npy)


@dataclass
class PythonDraws:
    """The draws of Python's global generator in one traced step: each ("random", 0) or
    ("getrandbits", bits), the primitives all its functions draw through; ``start`` and
    ``end``, its states around them (``complete``: nothing drew past the two, as a reference
    to the generator's C method taken before tracing would)."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    start: Any = None
    end: Any = None

    def begin(self) -> None:
        import random

        self.calls.clear()
        self.start = random.getstate()

    def complete(self) -> bool:
        import random

        if self.start is None or self.end is None:
            return False
        saved = random.getstate()
        try:
            random.setstate(self.start)
            replay_python_draws(self.calls)
            return bool(random.getstate() == self.end)
        finally:
            random.setstate(saved)


def replay_python_draws(calls: Sequence[tuple[str, int]]) -> None:
    """Advances Python's global generator by the draws a traced call made
    (``host_draws_recorded``), as the model's own code would at that call."""
    import random

    for kind, k in calls:
        if kind == "random":
            random.random()
        else:
            random.getrandbits(k)


def _same_joint(a: fx.GraphModule, b: fx.GraphModule) -> bool:
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


# ---- eager-faithful dispatch ---------------------------------------------------------------------
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
def _eager_faithful_dispatch(device: torch.device) -> Iterator[None]:
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


# ---- rewrites of the joint graph ----------------------------------------------------------------
def _call_beside(gm: fx.GraphModule, where: fx.Node, target: Any, args: tuple[Any, ...],
                 val: Any, *, before: bool = False, kwargs: dict[str, Any] | None = None
                 ) -> fx.Node:
    """A new call of ``target`` right after (or before) ``where``, in its module, sequence
    number and phase, with the fake value ``val``."""
    with gm.graph.inserting_before(where) if before else gm.graph.inserting_after(where):
        node = gm.graph.call_function(target, args, kwargs or {})
    node.meta = {k: v for k, v in where.meta.items()
                 if k in ("nn_module_stack", "seq_nr", "autograd_backward")}
    node.meta["val"] = val
    return node


def _fake_mode_of(t: torch.Tensor) -> Any:
    """The fake mode ``t`` belongs to (to compute fake values of new nodes), or a no-op."""
    mode = getattr(t, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


# ---- random ops on strided tensors ------------------------------------------------------------
def _match_random_layouts(gm: fx.GraphModule) -> None:
    """Make functionalized random ops draw their numbers in the same positions as eager.

    Eager fills a tensor in place (``empty_like(x).bernoulli_(p)``) in the memory order of
    ``x``, which may be permuted (e.g. a transposed attention output); the functional variant
    in the joint graph returns a contiguous tensor and so assigns the same random stream to
    other elements. Such an op is rewritten as ``permute -> op -> inverse permute`` so that it
    generates in ``x``'s memory order and returns ``x``'s strides, as eager does.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not _is_random(node) or not node.args:
            continue
        src_node = node.args[0]
        out = node.meta.get("val")
        src = src_node.meta.get("val") if isinstance(src_node, fx.Node) else None
        if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
            continue
        if src.shape != out.shape or src.stride() == out.stride() or src.dim() < 2:
            continue
        perm = sorted(range(src.dim()), key=lambda dim: -src.stride(dim))
        inverse = [perm.index(i) for i in range(src.dim())]
        with _fake_mode_of(src):
            src_perm = src.permute(perm)
            if not src_perm.is_contiguous():
                continue  # not a permuted dense layout: nothing sensible to match
            out_perm = torch.empty(src_perm.shape, dtype=out.dtype, device=out.device)
            out_back = out_perm.permute(inverse)
        before = _call_beside(gm, node, aten.permute.default, (src_node, perm), src_perm,
                              before=True)
        after = _call_beside(gm, node, aten.permute.default, (node, inverse), out_back)
        node.replace_all_uses_with(after, delete_user_cb=lambda user: user is not after)
        node.args = (before, *node.args[1:])
        node.meta["val"] = out_perm


# ---- 0/1 random masks kept in one byte ------------------------------------------------------
#: random ops whose output holds only 0s and 1s
_BINARY_RANDOM_OPS = ("aten.bernoulli.p", "aten.bernoulli.default", "aten.bernoulli.Tensor")


def _compact_random_masks(gm: fx.GraphModule) -> None:
    """Give every floating 0/1 random mask a one-byte copy the planner can keep instead.

    Dropout on CPU draws its mask as floats (``empty_like(x).bernoulli_(p)``) and the backward
    reads it; on CPU ``bernoulli`` is among the slowest ops of a transformer (a third of the
    demo GPT-2's forward time), so the choice between keeping a 4-byte mask and drawing it
    again is a poor one. The op is rewritten as ``bernoulli -> ne(0) -> _to_copy(dtype)``: the
    bool in the middle is a quarter of the bytes and the float mask comes back from it with two
    cheap elementwise ops, bit for bit (0.0 and 1.0 convert exactly), so the random op itself
    runs once. CUDA's fused dropout already keeps a bool mask and does not use this path.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or _target_name(node.target) not in _BINARY_RANDOM_OPS:
            continue
        out = node.meta.get("val")
        if (not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point
                or out.element_size() < 2 or not node.users):
            continue
        with _fake_mode_of(out):
            bits = torch.ne(out, 0)
            back = bits.to(out.dtype)
        ne = _call_beside(gm, node, aten.ne.Scalar, (node, 0), bits)
        to = _call_beside(gm, ne, aten._to_copy.default, (ne,), back,
                          kwargs={"dtype": out.dtype})
        node.replace_all_uses_with(to, delete_user_cb=lambda user: user is not ne)
        # The runtime copies nothing while the float mask is alive (runtime.compiler).
        ne.meta["packs_mask_of"] = node
        to.meta["unpacks_mask_of"] = node


# ---- capture ----------------------------------------------------------------------------------
class _Captured(Exception):
    """Raised from the partition hook to stop AOTAutograd once the joint graph is captured."""


def _capture_joint(
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
def _distribution_checks_off() -> Iterator[None]:
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
def _tensor_literals_read() -> Iterator[None]:
    """``torch.tensor(data)`` with tensors of the trace in ``data`` (transformers' Qwen2-VL
    makes its rope deltas from a list of 0-d results) reads their values: PyTorch's C++ copies
    their memory, which fake tensors do not have ("data is not allocated yet"). Values of the
    inputs or of constants are answered (``ValueReads``, guarded where they come from the
    inputs); others stop the trace as any read of a value does. The dtype is the one
    ``torch.tensor`` infers from the tensors' dtypes."""
    original = torch.tensor

    def tensor(data: Any, **kwargs: Any) -> torch.Tensor:
        if not any(isinstance(x, torch.Tensor) and _is_traced(x)
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
def _checkpoints_as_plain_calls(found: list[str]) -> Iterator[None]:
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
def _compiling_paths() -> Iterator[None]:
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


class _NewCacheEntriesCleared:
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


class _ModuleAttributes:
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


# (``t.numpy()`` of a traced tensor: its values handed to numpy, e.g. scipy's Hungarian
# matching in DETR-style losses)
_NUMPY_OF_TRACED = ".numpy() is not supported for tensor subclasses"


def _reads_tensor_values(exc: BaseException) -> bool:
    """Whether tracing failed because the model read a tensor's value (``.item()``, ``if`` on
    a tensor, a data-dependent output shape), here or in an exception it was raised from."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (DataDependentOutputException, DynamicOutputShapeException,
             GuardOnDataDependentSymNode)
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kinds) or (isinstance(cur, RuntimeError) and _NUMPY_OF_TRACED
                                      in str(cur)):
            return True
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return False


class _RandomReads(TorchDispatchMode):
    """Follows the values that depend on nothing but random draws (``torch.rand([])`` and
    what is computed from it alone; LayerDrop's test ``dropout_probability < layerdrop`` is
    traced both ways, ``capture.decisions``) through an eager run, and records where model
    code reads one as a Python value (code locations as ``_failing_code`` writes them). A
    value computed from data as well (a dropped-out activation) is not followed: reading it
    is an ordinary data dependency."""

    def __init__(self) -> None:
        super().__init__()
        self._random: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> the tensor
        self.reads: set[str] = set()

    def _only_random(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        name = func.overloadpacket.__name__
        if draws_random_numbers(func):
            if name.endswith("_") or name.endswith("_like"):
                tensors = tensors[1:]  # (the tensor filled in place, or only its shape)
        elif not tensors:
            return False  # (a factory: not random)
        return all(self._random.get(id(t), lambda: None)() is t for t in tensors)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._only_random(func, args, kwargs):
            if func is torch.ops.aten._local_scalar_dense.default:
                code = _user_code(traceback.extract_stack())[0]
                if code is not None:
                    self.reads.add(code)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._random[id(t)] = weakref.ref(t)
        return out


def _eager_run(step: Callable[..., Any], flat_real: list[torch.Tensor],
               buffers: dict[str, torch.Tensor], device: torch.device
               ) -> tuple[BaseException | None, set[str]]:
    """Runs the traced step eagerly on the real tensors (without gradients; buffers and
    generator states restored after). Returns the exception it raises, or None when it runs
    (tells a model's own error from a limit of tracing), and where the model read a value that
    depends on random draws alone (``_RandomReads``). Only called after tracing failed."""
    saved = {name: b.detach().clone() for name, b in buffers.items()}
    random_reads = _RandomReads()
    try:
        with preserved_rng(device), host_draws_recorded(set()), torch.no_grad(), random_reads:
            step(*flat_real)
    except torch.OutOfMemoryError:
        return None, random_reads.reads  # (undecided: the tracing error stands)
    except Exception as exc:  # noqa: BLE001 - the model's own error, returned to be reported
        return exc, random_reads.reads
    finally:
        with torch.no_grad():
            for name, b in buffers.items():
                b.copy_(saved[name])
    return None, random_reads.reads


# Buffers up to this size are followed (and their reads guarded) by the guarded try of a trace
# (``capture.values``): EnCodec's integer padding buffers; large buffers are data.
_GUARDED_BUFFER_BYTES = 1024

_UNTRACEABLE_HINT = (
    "hrockmate traces one training iteration with fake tensors (AOTAutograd), so Python "
    "control flow that depends on tensor values of parameters or activations (if/while on a "
    "tensor, .item(), .tolist()), data-dependent shapes and ops without a fake/meta "
    "implementation cannot be traced (values computed from constants or from the inputs "
    "alone are read, and nonzero or boolean masks of them traced for the count they have, "
    "the latter checked again at each call; code that checks "
    "torch.compiler.is_compiling(), as transformers' mask helpers do, is traced along its "
    "compiler path). "
    "Make the control flow independent of tensor values (e.g. torch.where), register a fake "
    "implementation for custom ops (torch.library.register_fake), or leave this module out "
    "of hrockmate"
)


_AUTOGRAD_ENTRIES = frozenset({"grad", "backward", "_engine_run_backward"})


def _failing_code(exc: BaseException) -> tuple[str | None, bool]:
    """Where tracing failed in the model's code: the innermost frame outside torch, hrockmate
    and Python's standard library, as ``file:line in function: source``, or None; and whether
    it failed while autograd computed gradients (past the forward's frames, with no model code,
    such as a custom Function's backward, below)."""
    return _user_code(traceback.extract_tb(exc.__traceback__))


def _user_code(frames: Sequence[traceback.FrameSummary]) -> tuple[str | None, bool]:
    """The innermost model frame of ``frames`` (outermost first), as ``_failing_code`` says."""
    # torch's package, then ours (this file is in hrockmate/capture/)
    skipped = (os.path.dirname(torch.__file__ or "") + os.sep,
               os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
    stdlib = sysconfig.get_paths()["stdlib"] + os.sep
    user: traceback.FrameSummary | None = None
    in_backward = False
    for fs in frames:
        path = os.path.abspath(fs.filename)
        if path.startswith(skipped) or path.startswith(stdlib) or fs.filename.startswith("<"):
            if path.startswith(skipped[0]) and fs.name in _AUTOGRAD_ENTRIES and \
                    f"{os.sep}autograd{os.sep}" in path:
                in_backward = True
            continue
        user, in_backward = fs, False
    if user is None:
        return None, in_backward
    code = f" (`{user.line.strip()}`)" if user.line and user.line.strip() else ""
    return f"{user.filename}:{user.lineno} in {user.name}{code}", in_backward


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message ("" for an empty one)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# code locations (``_failing_code``) inside a loss: transformers' ``loss/`` package, the
# Hungarian matchers of DETR-style models
_IN_A_LOSS = re.compile(r"loss|matcher|hungarian|linear_sum_assignment", re.IGNORECASE)


def _explain(exc: BaseException, module_path: str, model: nn.Module,
             random_reads: set[str] | frozenset[str] = frozenset()) -> str:
    """The error for a failed trace. ``random_reads``: where the model read a value of random
    draws alone in an eager run (``_eager_run``); a failure there is named as such."""
    code, in_backward = _failing_code(exc)
    if in_backward:
        # (the module stack is the forward's: empty or stale while gradients are traced)
        where = "the backward pass (the gradient of an op of the forward)"
    else:
        where = "the model's top level" if not module_path else f"module {module_path!r}"
        if module_path:
            try:
                where += f" ({type(model.get_submodule(module_path)).__name__})"
            except AttributeError:
                pass
    op = getattr(exc, "func", None) or getattr(exc, "op", None)
    op_txt = f" at op {op}" if op is not None else ""
    code_txt = f", called at {code}" if code and not in_backward else ""
    if code is not None and code in random_reads and _reads_tensor_values(exc):
        return (f"cannot trace {where}{op_txt}{code_txt}: the model branches on a random draw "
                "there (a value computed from torch's random numbers alone, read as a Python "
                "number, as in torch.rand([]).item() < p). hrockmate traces both outcomes of a "
                "test of a draw kept as a tensor (LayerDrop's torch.rand([]) < p, then if on "
                "it), not a number read from it. Compare the draw as a tensor, or turn that "
                "randomness off while training with hrockmate (transformers models: set the "
                "config's layerdrop, encoder_layerdrop and decoder_layerdrop to 0.0), or leave "
                "this module out of hrockmate")
    first = _first_line(exc) or type(exc).__name__
    hint = _UNTRACEABLE_HINT
    if code is not None and not in_backward and _IN_A_LOSS.search(code):
        hint += (". The read is in a loss computed inside the model (a matching of "
                 "predictions to targets, a check of predicted boxes): call the model without "
                 "its labels and compute that loss on its outputs outside hrockmate (the "
                 "outputs carry their gradients into the planned backward)")
    if in_backward:
        hint += (". In the backward, this is typically an op whose gradient has a "
                 "data-dependent shape, such as assigning through a boolean mask "
                 "(x[mask] = v): use torch.where(mask, v, x) instead")
    return (f"cannot trace {where}{op_txt}{code_txt}: {type(exc).__name__}: {first}. {hint}")


def _skippable_regions(traced: Traced, decided: list[Decision], first_test: int,
                       trace_not_taken: Callable[[set[int]], Traced],
                       cache: Any = None) -> list[SkippableRegion]:
    """What each random decision of the step leaves out when it goes the other way: the step
    traced again per decision with that one not taken, matched against ``traced`` (every
    decision taken), and once with none taken to check them together
    (``capture.decisions``). In a run of at least ``MIN_DERIVED_RUN`` decisions made at one
    line (a stack of layers), only the first two and the last two are traced alone; the
    others are derived from the second and the last but one (``derive_between``) and checked
    by one trace with every other decision of the run not taken (else traced alone).
    ``cache``: where an earlier finding for the same graph and code is kept
    (``load_decisions`` / ``save_decisions`` of ``hrockmate.planning.cache``)."""
    where = ", ".join(dict.fromkeys(d.where or "the model's code" for d in decided))
    key = cache_key(traced, [d.where or "" for d in decided]) if cache is not None else None
    if key is not None:
        cached = cache.load_decisions(key, lambda data: regions_from_json(
            data, traced, len(decided)))
        if cached is not None:
            logger.info("the model's %d random decisions (%s): what each leaves out is "
                        "cached", len(decided), where)
            return cached
    logger.info("the model decides at random %d times whether to run parts of the step (%s); "
                "tracing each decision's other outcome", len(decided), where)
    n = len(decided)
    made = [(i, traced.output_ids[first_test + i], d.answer, d.where or "the model's code")
            for i, d in enumerate(decided)]
    # Runs of decisions made at one line (a stack of layers): the inner ones are derived
    # from the second and the last but one, then checked by a trace with every other one
    # of the run skipped.
    runs: dict[str, list[int]] = {}
    for i, d in enumerate(decided):
        runs.setdefault(d.where or "", []).append(i)
    derived_runs = [r for r in runs.values() if len(r) >= MIN_DERIVED_RUN]
    inner = {i for r in derived_runs for i in r[2:-2]}
    found: dict[int, SkippableRegion] = {}
    bar = Progress(n - len(inner) + bool(derived_runs) + (n > 1),
                   f"tracing the other outcome of {n} random decisions of "
                   f"'{traced.graph.name}'", True)

    def trace_alone(i: int) -> None:
        found[i] = skipped_part(traced, trace_not_taken({i}), *made[i])
        bar.update()

    try:
        for i in range(n):
            if i not in inner:
                trace_alone(i)
        alternate: set[int] = set()
        derived: set[int] = set()  # (the decisions whose regions were derived)
        for r in derived_runs:
            got = derive_between(traced, found[r[1]], found[r[-2]], len(r) - 3,
                                 [made[i] for i in r[2:-2]])
            if got is None:
                logger.info("the layers deciding at %s are not alike: tracing each of them",
                            made[r[0]][3])
                bar.add(len(r) - 4)
                for i in r[2:-2]:
                    trace_alone(i)
                continue
            found.update((g.index, g) for g in got)
            derived.update(g.index for g in got)
            alternate.update(r[0::2])
        if derived_runs and not alternate:
            bar.add(-1)  # (no check trace)
        regions = [found[i] for i in range(n)]
        rules = SkipRules.of(traced, regions)
        if alternate:
            try:
                check_skipped(traced, trace_not_taken(alternate), rules, alternate)
            except DecisionError as exc:
                logger.info("regions derived for alike layers do not hold (%s): tracing each "
                            "of them", exc)
                bar.add(len(derived))
                for i in sorted(derived):
                    trace_alone(i)
                regions = [found[i] for i in range(n)]
                rules = SkipRules.of(traced, regions)
            bar.update()
        if len(regions) > 1:
            check_together(traced, trace_not_taken(set(range(n))), rules)
            bar.update()
    except DecisionError as exc:
        raise TraceError(
            f"the model decides at random whether to run parts of the step (at {where}), and "
            f"hrockmate cannot tell what the other outcome leaves out: {exc}. Turn that "
            "randomness off (transformers models: set the config's layerdrop, "
            "encoder_layerdrop and decoder_layerdrop to 0.0) or leave this module out of "
            "hrockmate") from exc
    finally:
        bar.close()
    for r in regions:
        logger.debug("decision %d at %s: %d ops skipped when it goes the other way",
                     r.index, r.where, len(r.ops))
    if key is not None:
        cache.save_decisions(key, regions_to_json(regions))
    return regions


# ---- IR construction ----------------------------------------------------------------------------
#: The CUDA caching allocator hands out blocks in multiples of 512 bytes, and that is what
#: ``torch.cuda.memory_allocated`` counts; the CPU allocator's events report the requested size.
CUDA_BLOCK_BYTES = 512


def allocated_bytes(nbytes: int, device: torch.device) -> int:
    """Bytes a storage of ``nbytes`` occupies on ``device`` by the allocator's own count."""
    if device.type == "cuda" and nbytes > 0:
        return -(-int(nbytes) // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return int(nbytes)


def _tensor_members(val: Any) -> list[tuple[int | None, torch.Tensor]]:
    if isinstance(val, torch.Tensor):
        return [(None, val)]
    if isinstance(val, (tuple, list)):
        return [(i, v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)]
    return []


def _storage_key(t: torch.Tensor) -> Any:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _schema_alias_arg(node: fx.Node, index: int | None) -> fx.Node | None:
    """The input node that the op schema says output ``index`` aliases (``Tensor(a)``)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return None
    rets = schema.returns
    ret = rets[0] if (index is None or len(rets) == 1) else rets[index]
    info = ret.alias_info
    if info is None:
        return None
    sets = set(info.before_set)
    for arg, value in zip(schema.arguments, node.args):
        if arg.alias_info is not None and set(arg.alias_info.before_set) & sets:
            if isinstance(value, fx.Node):
                return value
    for arg in schema.arguments:
        if arg.alias_info is not None and set(arg.alias_info.before_set) & sets:
            value = node.kwargs.get(arg.name)
            if isinstance(value, fx.Node):
                return value
    return None


def _alias_source(
    node: fx.Node,
    index: int | None,
    val: torch.Tensor,
    tensor_of: dict[tuple[fx.Node, int | None], int],
    storage_owner: dict[Any, int],
) -> int | None:
    """The IR tensor whose storage output ``index`` of ``node`` shares, or None if it owns a new
    one. The schema's alias annotation names the input; ops that share storage without an
    annotation (``_unsafe_view``, ``unsafe_split``...) are caught by comparing the fake
    tensors' storages, preferring an input of the op, else the storage's first owner."""
    src = _schema_alias_arg(node, index)
    if src is not None:
        return tensor_of[(src, None)]
    key = _storage_key(val)
    owner = storage_owner.get(key)
    if owner is None:
        return None
    for a in _arg_nodes(node):
        if _storage_key(a.meta["val"]) == key:
            return tensor_of[(a, None)]
    return owner


def _is_random(node: fx.Node) -> bool:
    return draws_random_numbers(node.target)


def _insert_alias(gm: fx.GraphModule, src: fx.Node, where: fx.Node, *, before: bool,
                  backward: bool) -> fx.Node:
    ctx = gm.graph.inserting_before(where) if before else gm.graph.inserting_after(where)
    with ctx:
        node = gm.graph.call_function(torch.ops.aten.alias.default, (src,))
    node.meta = {k: v for k, v in src.meta.items() if k in ("nn_module_stack", "seq_nr")}
    node.meta["val"] = src.meta["val"]
    if backward:
        node.meta["autograd_backward"] = True
    return node


def _refuse_sparse_tensors(gm: fx.GraphModule) -> None:
    """The IR sizes dense storages; a sparse tensor's (a sparse embedding's gradient) has
    none to size (``Cannot access storage of SparseTensorImpl`` was all a user saw)."""
    for node in gm.graph.nodes:
        for val in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(val, torch.Tensor) and val.layout != torch.strided:
                what = (f"op {node.target}" if node.op == "call_function"
                        else f"input {node.name}")
                raise TraceError(
                    f"the training step has a {val.layout} tensor ({what}): hrockmate plans "
                    "dense (strided) tensors only. A sparse gradient comes from "
                    "nn.Embedding(sparse=True) or nn.EmbeddingBag(sparse=True): build them "
                    "with sparse=False (the default; the gradient is then dense, and any "
                    "optimizer takes it)")


def _build(
    gm: fx.GraphModule,
    flat_kinds: list[tuple[str, Any]],
    flat_real: list[torch.Tensor],
    n_user_outputs: int,
    name: str,
    device: torch.device,
) -> Traced:
    from torch._functorch._aot_autograd import descriptors as d

    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    out_vals = list(out_node.args[0])
    out_descs = out_node.meta.get("desc")
    if out_descs is None or len(out_descs) != len(out_vals):
        raise TraceError(
            "this PyTorch version does not annotate AOTAutograd's joint graph outputs; "
            "hrockmate needs torch >= 2.9"
        )

    # Which joint-graph outputs play which role: user outputs, gradients, buffer updates.
    user_out: dict[int, fx.Node] = {}
    grads: dict[int, fx.Node] = {}
    mutations: dict[int, fx.Node] = {}
    # outputs that are views of one intermediate: AOTAutograd differentiates that base (an
    # extra output, after the model's) and makes the views from it (the runtime does too)
    base_position: dict[Any, int] = {}
    for val, desc in zip(out_vals, out_descs):
        if val is None:
            continue
        if isinstance(desc, d.PlainAOTOutput):
            user_out[desc.idx] = val
        elif isinstance(desc, d.IntermediateBaseAOTOutput):
            base_position[desc] = n_user_outputs + len(base_position)
            user_out[base_position[desc]] = val
        elif isinstance(desc, d.GradAOTOutput):
            grads[_input_index(desc.grad_of)] = val
        elif isinstance(desc, d.InputMutationAOTOutput):
            idx = _input_index(desc.mutated_input)
            kind, key = flat_kinds[idx]
            if kind not in ("buffer", "input") or (
                    kind == "input" and flat_real[idx].requires_grad):
                raise TraceError(
                    f"the model modifies its {kind} {key!r} in place during the forward pass; "
                    "hrockmate supports in-place updates of buffers (e.g. BatchNorm "
                    "running statistics) and of inputs that need no gradient (a QA head's "
                    "start_positions.clamp_()) only: make that update out of place"
                )
            mutations[idx] = val
        elif isinstance(desc, d.MetadataMutationAOTOutput):
            raise TraceError(
                "the model changes the shape or strides of one of its inputs in place "
                "(e.g. x.t_() on an argument); use an out-of-place view instead"
            )
        # other bookkeeping outputs are not results of the iteration

    _forward_results_first(graph)

    # Required results that are placeholders or shared with another result get an alias node.
    claimed: set[fx.Node] = set()

    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    last_op = out_node.prev

    def own(node: fx.Node) -> fx.Node:
        if node.op == "placeholder":
            if isinstance(node.meta.get("desc"), d.TangentAOTInput):
                node = _insert_alias(gm, node, last_op, before=False, backward=True)
            else:
                node = _insert_alias(gm, node, first_op, before=True, backward=False)
        elif node in claimed:
            node = _insert_alias(gm, node, node, before=False,
                                 backward=bool(node.meta.get("autograd_backward")))
        claimed.add(node)
        return node

    for k in sorted(user_out):
        user_out[k] = own(user_out[k])
    for k in sorted(grads):
        grads[k] = own(grads[k])
    for k in sorted(mutations):
        mutations[k] = own(mutations[k])
    # (the graph passes before this one edit the graph only: its code is made once, here;
    # the joint graph is run node by node, ``run_joint``, never as code)
    gm.recompile()

    ir = Graph(name=name)
    tensor_of: dict[tuple[fx.Node, int | None], int] = {}
    tensor_nodes: list[tuple[fx.Node, int | None]] = []
    sources: dict[int, tuple[str, Any]] = {}
    op_nodes: list[fx.Node] = []
    used_names: set[str] = set()
    storage_owner: dict[Any, int] = {}

    def unique(base: str) -> str:
        cand, i = base, 1
        while cand in used_names:
            i += 1
            cand = f"{base}_{i}"
        used_names.add(cand)
        return cand

    def add_tensor(node: fx.Node, index: int | None, t: Tensor, val: torch.Tensor) -> int:
        tid = ir.add_tensor(t)
        tensor_of[(node, index)] = tid
        tensor_nodes.append((node, index))
        if t.alias_of is None:
            storage_owner.setdefault(_storage_key(val), tid)
        return tid

    input_tensor: dict[int, int] = {}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta.get("desc")
        val = node.meta["val"]
        if isinstance(desc, d.TangentAOTInput):
            role, src = "tangent", ("tangent", desc.output)
            tname = f"tangent:{node.name}"
        else:
            if not isinstance(desc, d.PlainAOTInput):
                raise TraceError(
                    f"unsupported input kind {type(desc).__name__} in the joint graph: two "
                    "inputs, parameters or buffers share memory (one is a view of another); "
                    "pass independent tensors"
                )
            kind, key = flat_kinds[desc.idx]
            role = {"param": "parameter", "buffer": "buffer", "input": "input"}[kind]
            src = (kind, key)
            tname = f"{kind}:{key}"
            real = flat_real[desc.idx]
        nbytes = int(val.untyped_storage().nbytes()) if role == "tangent" else int(
            real.untyped_storage().nbytes()
        )
        tid = add_tensor(
            node, None,
            Tensor(unique(tname), nbytes, role, shape=list(val.shape), dtype=_dtype(val)), val,
        )
        if role == "tangent":
            sources[tid] = src  # fixed up below to an index into output_ids
        else:
            sources[tid] = src
            input_tensor[desc.idx] = tid

    # Phase: everything from the first node marked as part of the backward pass on.
    backward = False
    first_fwd_of_seq: dict[int, int] = {}
    role_of: dict[fx.Node, tuple[str, int | None, int | None]] = {}
    for k, n in user_out.items():
        role_of[n] = ("output", None, None)
    for idx, n in grads.items():
        kind, key = flat_kinds[idx]
        role_of[n] = ("param_grad" if kind == "param" else "input_grad", input_tensor[idx], None)
    for idx, n in mutations.items():
        role_of[n] = ("buffer_update", None, input_tensor[idx])

    for node in graph.nodes:
        if node.op == "get_attr":
            # a real tensor the model or loss_fn closes over, stored on the graph module
            val = getattr(gm, node.target)
            if isinstance(val, torch.Tensor):
                if val.requires_grad:
                    raise TraceError(
                        f"the model or loss_fn uses a tensor of shape {tuple(val.shape)} that "
                        "requires grad but is neither a parameter, a buffer nor an input, so "
                        "its gradient would be lost; register it as an nn.Parameter or pass "
                        "it in the sample"
                    )
                tid = add_tensor(node, None, Tensor(
                    unique(f"constant:{node.target}"), int(val.untyped_storage().nbytes()),
                    "buffer", shape=list(val.shape), dtype=_dtype(val)), node.meta.get("val", val))
                sources[tid] = ("constant", node.target)
            continue
        if node.op != "call_function":
            continue
        if node.target is operator.getitem:
            parent, i = node.args[0], node.args[1]
            tid = tensor_of.get((parent, i))  # type: ignore[arg-type]
            if tid is None:
                raise TraceError(f"internal: getitem {node.name} selects an unknown tensor")
            tensor_of[(node, None)] = tid
            used_names.discard(ir.tensors[tid].name)
            ir.tensors[tid].name = unique(node.name)
            if node in role_of:
                _apply_role(ir.tensors[tid], role_of[node])
            continue
        members = _tensor_members(node.meta.get("val"))
        if not members:
            continue  # computes no tensor (e.g. a symbolic size): nothing to schedule
        if _starts_backward(node):
            backward = True
        inputs = [tensor_of[(a, None)] for a in _arg_nodes(node)]
        outputs: list[int] = []
        mutates = False
        for index, val in members:
            alias = _alias_source(node, index, val, tensor_of, storage_owner)
            tname = node.name if index is None else f"{node.name}.{index}"
            t = Tensor(
                unique(tname),
                0 if alias is not None else allocated_bytes(val.untyped_storage().nbytes(), device),
                "activation",
                alias_of=alias,
                shape=list(val.shape),
                dtype=_dtype(val),
            )
            if index is None and node in role_of:
                _apply_role(t, role_of[node])
            if t.role == "buffer_update":
                mutates = True
            outputs.append(add_tensor(node, index, t, val))
        seq = node.meta.get("seq_nr")
        phase = "backward" if backward else "forward"
        differentiates = None
        module = _node_module(node)
        op_id = len(ir.ops)
        if phase == "forward":
            if seq is not None:
                first_fwd_of_seq.setdefault(seq, op_id)
        elif seq is not None and seq in first_fwd_of_seq:
            differentiates = first_fwd_of_seq[seq]
            module = module or ir.ops[differentiates].module
        ir.add_op(
            Op(
                name=node.name,
                phase=phase,
                time=0.0,
                inputs=inputs,
                outputs=outputs,
                target=_target_name(node.target),
                workspace=0,
                differentiates=differentiates,
                random=_is_random(node),
                mutates_buffer=mutates,
                module=module,
            )
        )
        op_nodes.append(node)

    # A multi-output member selected by a getitem carries the getitem's role.
    for n, r in role_of.items():
        tid = tensor_of.get((n, None))
        if tid is not None and ir.tensors[tid].role == "activation":
            _apply_role(ir.tensors[tid], r)
    mutates_fix = {t for t, ten in enumerate(ir.tensors) if ten.role == "buffer_update"}
    for op in ir.ops:
        if any(o in mutates_fix for o in op.outputs):
            op.mutates_buffer = True

    n_outputs = n_user_outputs + len(base_position)
    output_ids = [tensor_of[(user_out[k], None)] for k in range(n_outputs) if k in user_out]
    if len(output_ids) != n_outputs:
        raise TraceError("internal: some model outputs are missing from the joint graph")
    for tid, (kind, key) in list(sources.items()):
        if kind == "tangent":
            if isinstance(key, d.PlainAOTOutput):
                sources[tid] = ("tangent", key.idx)
            elif key in base_position:
                sources[tid] = ("tangent", base_position[key])
            else:
                raise TraceError(f"internal: tangent of an unexpected output kind {key}")

    param_grads = {flat_kinds[i][1]: tensor_of[(n, None)] for i, n in grads.items()
                   if flat_kinds[i][0] == "param"}
    input_grads = {flat_kinds[i][1]: tensor_of[(n, None)] for i, n in grads.items()
                   if flat_kinds[i][0] == "input"}
    buffer_updates = {flat_kinds[i][1]: tensor_of[(n, None)] for i, n in mutations.items()
                      if flat_kinds[i][0] == "buffer"}
    input_updates = {int(flat_kinds[i][1]): tensor_of[(n, None)] for i, n in mutations.items()
                     if flat_kinds[i][0] == "input"}
    return Traced(
        graph=ir,
        gm=gm,
        op_nodes=op_nodes,
        tensor_nodes=tensor_nodes,
        sources=sources,
        output_ids=output_ids,
        output_spec=(pytree.tree_flatten(())[1], []),  # filled by the caller
        param_grads=param_grads,
        input_grads=input_grads,
        buffer_updates=buffer_updates,
        input_updates=input_updates,
        input_spec=pytree.tree_flatten(())[1],
        input_meta=[],
    )


def _input_index(desc: Any) -> int:
    from torch._functorch._aot_autograd import descriptors as d

    if isinstance(desc, d.PlainAOTInput):
        return desc.idx
    raise TraceError(
        f"unsupported input kind {type(desc).__name__}: two inputs, parameters or buffers "
        "share memory; pass independent tensors"
    )


def _apply_role(t: Tensor, role: tuple[str, int | None, int | None]) -> None:
    t.role, t.grad_of, t.updates = role


def _arg_nodes(node: fx.Node) -> list[fx.Node]:
    """Tensor-valued fx nodes among an op's arguments, in argument order (repeats kept)."""
    found: list[fx.Node] = []
    pytree.tree_map(
        lambda a: found.append(a) if isinstance(a, fx.Node) else None,
        (node.args, node.kwargs),
    )
    return [a for a in found if isinstance(a.meta.get("val"), torch.Tensor)]


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


# ---- public API ---------------------------------------------------------------------------------
@one_trace_at_a_time
def trace_model(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: LossFn | None = None,
    cost: str = "measure",
    name: str | None = None,
    decisions_cache: Any = None,
) -> Traced:
    """Trace one training iteration (forward and backward) of ``model`` on ``sample``.

    ``loss_fn``: a function: ``loss_fn(model_output)`` is traced as part of the forward, it is
    the traced output, and backward starts from it. A str (key or attribute) or int
    (position): the model's output member holding the loss (``"loss"`` for a transformers
    ``ModelOutput``); the output keeps its structure, backward starts from that member only
    and the other tensors are outputs without gradient. ``None``: backward starts from the
    gradients of all the model's outputs that require grad (``tangent`` tensors; for a scalar
    output, the usual ``loss.backward()``).
    ``cost``: ``"measure"`` runs each distinct op on the sample's device, ``"estimate"`` uses
    a FLOP/bandwidth model (both measure workspaces once), ``"none"`` leaves times and
    workspaces at 0.
    ``decisions_cache``: a ``hrockmate.planning.cache.PlanCache`` keeping what the model's
    random decisions (LayerDrop) leave out, which otherwise takes one more trace per decision.
    """
    if not isinstance(model, nn.Module):
        raise TraceError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if cost not in COST_MODES:
        raise TraceError(f"cost must be one of {COST_MODES}, got {cost!r}")
    from hrockmate.runtime.distributed import check_layout  # (tracing would break its state)

    check_layout(model, "hrockmate cannot trace this model")
    t0 = time.perf_counter()
    args, kwargs = split_sample(sample)
    leaves, input_spec = pytree.tree_flatten((args, kwargs))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    devices = {t.device for t in [*params.values(), *buffers.values()]} | {
        x.device for x in leaves if isinstance(x, torch.Tensor)
    }
    if len(devices) > 1:
        raise TraceError(
            f"model and sample live on several devices ({', '.join(map(str, devices))}); "
            "move them to one device first"
        )
    device = next(iter(devices)) if devices else torch.device("cpu")

    flat_kinds: list[tuple[str, Any]] = [("param", k) for k in params]
    flat_kinds += [("buffer", k) for k in buffers]
    tensor_leaf_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    flat_kinds += [("input", i) for i in tensor_leaf_pos]
    n_pb = len(params) + len(buffers)
    slots = _state_slots(model, flat_kinds[:n_pb])
    out_box: dict[str, Any] = {}

    attributes = _ModuleAttributes(model)

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attributes.restore()  # (each pass starts from the model the user gave)
        state = {name: flat[i] for name, i in slots}
        new_leaves = list(leaves)
        for pos, v in zip(tensor_leaf_pos, flat[n_pb:]):
            new_leaves[pos] = v
        a, kw = pytree.tree_unflatten(new_leaves, input_spec)
        out = torch.func.functional_call(model, state, tuple(a), kw, tie_weights=False,
                                         strict=False)
        loss = None
        if isinstance(loss_fn, (str, int)):
            loss = select_loss(out, loss_fn)
        elif loss_fn is not None:
            out = loss_fn(out)
        tensors, out_box["spec"] = flatten_output(out, _is_traced)
        if loss is not None:
            # only the loss is differentiated: the other outputs get no gradient (tangent)
            tensors = [x if x is loss else x.detach() for x in tensors]
        out_box["count"] = len(tensors)
        return tuple(tensors)

    # the guarded try follows (and guards) values of the inputs and of small buffers: key ->
    # (position among the traced function's arguments, a copy of the value, which the
    # model's in-place ops on it then change, not the user's tensor)
    guarded_sources: dict[Any, tuple[int, torch.Tensor]] = {}
    guarded_try: list[bool] = []
    reads_box: dict[str, ValueReads] = {}

    def follow_inputs_and_small_buffers() -> None:
        for k, i in enumerate(range(n_pb, len(flat_real))):
            if flat_real[i].untyped_storage().nbytes() <= MAX_BYTES:
                guarded_sources["input", k] = (i, flat_real[i].detach().clone())
        for j, name in enumerate(buffers, start=len(params)):
            if flat_real[j].untyped_storage().nbytes() <= _GUARDED_BUFFER_BYTES:
                guarded_sources["buffer", name] = (j, flat_real[j].detach().clone())

    # the random decisions answered "not taken" (their other outcome; capture.decisions)
    not_taken: set[int] = set()

    def step_with_values(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        sources = {key: (flat[i], real) for key, (i, real) in guarded_sources.items()}
        reads = ValueReads(sources if guarded_sources else None,
                           where=lambda: _user_code(traceback.extract_stack())[0],
                           answers=lambda k: k in not_taken)
        reads_box["last"] = reads  # (AOTAutograd may call this twice; the joint is the last)
        python_draws.begin()  # (so are the draws of Python's random kept)
        # (on top of AOTAutograd's modes; writes through masks matter only where values of
        # the inputs are followed: the function mode costs about 8% of a trace's time)
        writes = MaskWritesByPositions(reads) if guarded_sources else contextlib.nullcontext()
        tests = FinitenessTests(reads) if guarded_try else contextlib.nullcontext()
        with reads, writes, tests:
            outs = step(*flat)
            held = reads.assumptions_held()
        # (after the model's outputs, which rebuild_output takes: the runtime reads the
        # decisions' tests and checks that the assumptions held)
        extra = [d.tensor for d in reads.decisions]
        if held is not None:
            extra.append(held)
        out_box["count"] += len(extra)
        return (*outs, *extra)

    flat_real: list[torch.Tensor] = [*params.values(), *buffers.values()]
    flat_real += [leaves[i] for i in tensor_leaf_pos]
    module_stack: list[str] = []
    host_draws: set[str] = set()
    python_draws = PythonDraws()  # (the last step's draws of Python's random)
    forced_draw: list[float] = []  # (what Python's random() returns while tracing, if given)
    drawn_by: dict[str, list[tuple[str, int]]] = {}  # try -> its draws of Python's random
    checkpointed: list[str] = []  # the model's own checkpointed calls (traced as plain calls)

    def capture(compiling_paths: bool) -> fx.GraphModule:
        module_stack.clear()
        checkpointed.clear()
        # Our own fake mode, so that real tensors the model or loss_fn closes over (e.g.
        # targets, plain tensor attributes) are accepted; they become constants of the graph.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        drawn = host_draws_recorded(host_draws, python_draws,
                                    forced_draw[0] if forced_draw else None)
        try:
            with preserved_rng(device), drawn, torch.enable_grad(), \
                    _eager_faithful_dispatch(device), _quiet_tracing_noise(), \
                    _distribution_checks_off(), _tensor_literals_read(), \
                    _module_annotations(model, module_stack), \
                    torch._functorch.config.patch(backward_pass_autocast="off"), \
                    _checkpoints_as_plain_calls(checkpointed), \
                    _compiling_paths() if compiling_paths else contextlib.nullcontext():
                return _capture_joint(step_with_values,
                                      [fake_mode.from_tensor(t) for t in flat_real])
        finally:
            attributes.restore()

    # The eager paths first: they compute what plain PyTorch computes (with
    # torch.compiler.is_compiling() True, transformers' Mamba models take a parallel scan that
    # rounds differently). Where that trace fails at a read of values, it is traced again on
    # the eager path with the reads of the inputs' values answered and guarded; kept when every
    # read is a test (True or False: a few graphs at most), as transformers' test that an
    # attention mask has no padding, where the compilers' path builds an explicit mask in place
    # of eager's is_causal and grouped-query kernel (HunYuan's key-norm gradients 3e-7 off; on
    # GPU, no flash kernel). Otherwise the compilers' paths are traced: code that reads a
    # tensor value may have a value-independent path for compilers (one graph for every
    # count), and caches that compilers bypass (transformers' compile_compatible_method_lru_cache:
    # BEiT's relative position index) keep no fake tensor of the trace, which breaks
    # AOTAutograd's second pass; where those fail too, the guarded eager trace is taken as it
    # is. Each retry runs outside the previous failure's handler so that its own failure does
    # not carry the first as its context.
    failures: dict[str, tuple[BaseException, str]] = {}  # try -> (error, module)
    new_entries_cleared = _NewCacheEntriesCleared()

    def try_capture(which: str) -> fx.GraphModule | None:
        """The joint graph of try ``which`` ("eager", "guarded" or "compiling"), or None with
        its failure kept in ``failures``."""
        try:
            with new_entries_cleared.around():
                joint = capture(which == "compiling")
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001 - explained below once every path failed
            failures[which] = (exc, module_stack[-1] if module_stack else "")
            return None
        if not forced_draw:  # (its draws of Python's random, if they are all of them)
            drawn_by[which] = list(python_draws.calls) if python_draws.complete() else []
        return joint

    guards: ValueGuards | None = None
    compiling_paths = False
    which = "eager"  # the try whose graph is kept
    joint = try_capture("eager")
    # the guarded try's graph, its guards and its reads
    guarded: tuple[fx.GraphModule, ValueGuards | None, ValueReads] | None = None
    if joint is None and _reads_tensor_values(failures["eager"][0]):
        follow_inputs_and_small_buffers()
        guarded_try.append(True)  # (isfinite's tests: a function mode, in guarded tries only)
        found = try_capture("guarded")
        if found is not None:
            guarded = (found, reads_box["last"].guards(), reads_box["last"])
            if guarded[1] is None or guarded[1].tests_only:
                joint, guards, which = guarded[0], guarded[1], "guarded"
        if joint is None:
            guarded_sources.clear()
            guarded_try.clear()
    if joint is None:
        joint = try_capture("compiling")
        compiling_paths = joint is not None
        which = "compiling"
    if joint is None and guarded is not None:
        joint, guards, reads_box["last"] = guarded
        which = "guarded"
    if joint is None:
        (exc, path), (comp_exc, comp_path) = failures["eager"], failures["compiling"]
        def plain_step(*_: torch.Tensor) -> Any:  # the model as the user calls it, unswapped
            attributes.restore()
            out = model(*args, **kwargs)
            return select_loss(out, loss_fn) if isinstance(loss_fn, (str, int)) else \
                out if loss_fn is None else loss_fn(out)

        eager, random_reads = _eager_run(plain_step, flat_real, buffers, device)
        attributes.restore()
        if eager is not None:  # the model's own error, not a limit of tracing
            first = _first_line(eager)
            raise TraceError(
                f"the model fails in plain PyTorch too when called with this sample (and "
                f"loss_fn): {type(eager).__name__}: {first}; fix the model, its configuration "
                "or the sample (the traceback above shows where)") from eager
        guarded_exc, guarded_path = failures.get("guarded", (None, ""))
        if guarded_exc is not None and _reads_tensor_values(guarded_exc) and \
                _failing_code(guarded_exc)[0] != _failing_code(exc)[0]:
            # the guarded try got past the first read: the next one, not the inputs' alone,
            # is the cause (a read where the first try failed is explained as before)
            raise TraceError(_explain(guarded_exc, guarded_path, model, random_reads)) \
                from guarded_exc
        if _reads_tensor_values(exc) and not _reads_tensor_values(comp_exc):
            # the model reads a value on its eager path and its compilers' path breaks for a
            # reason of its own (transformers' Switch Transformers: `nonzero` in its experts,
            # and an attention mask it leaves None when compiling): the read is the cause
            first = _first_line(comp_exc)
            raise TraceError(
                _explain(exc, path, model, random_reads) + ". With "
                "torch.compiler.is_compiling() answering True, as it does for compilers, the "
                "model failed too" + (f" in module {comp_path!r}" if comp_path else "")
                + f": {type(comp_exc).__name__}: {first}") from exc
        if _reads_tensor_values(comp_exc):
            # a read on the compilers' path too: that is the one to remove
            raise TraceError(_explain(comp_exc, comp_path, model, random_reads)) from comp_exc
        raise TraceError(_explain(exc, path, model, random_reads)) from exc

    if out_box["count"] == 0:
        raise TraceError("the model's output contains no tensor; return a tensor or a loss")
    def trace_again() -> fx.GraphModule | None:
        """The kept try traced once more (with other answers or draws), or None."""
        if which == "guarded" and not guarded_try:  # (as when the kept graph was traced)
            follow_inputs_and_small_buffers()
            guarded_try.append(True)
        return try_capture(which)

    draws = drawn_by.get(which, [])
    if host_draws == {"Python's random"} and draws and all(kind == "random"
                                                           for kind, _ in draws):
        # draws that cannot change the step (transformers' Musicgen and VITS draw LayerDrop
        # with random.uniform(0, 1) < layerdrop, at a default of 0.0): the same graph with
        # every draw at either end of its range
        kept = dict(out_box), dict(reads_box), list(checkpointed)  # (the kept trace's)
        for value in (0.0, 1.0 - 2.0 ** -53):
            forced_draw[:] = [value]
            try:
                other = trace_again()
            finally:
                forced_draw.clear()
                out_box.clear(), out_box.update(kept[0])
                reads_box.clear(), reads_box.update(kept[1])
                checkpointed[:] = kept[2]
            if other is None or not _same_joint(joint, other):
                break
        else:
            host_draws.clear()
            logger.info("the model draws from Python's random while it runs (%d draws), and "
                        "the traced step is the same whatever they are; each call draws them "
                        "as plain PyTorch does", len(draws))
    if host_draws:
        warnings.warn(
            f"the model drew random numbers from {' and '.join(sorted(host_draws))} while it "
            "was traced: those draws (a SpecAugment mask, a LayerDrop decision, ...) are now "
            "fixed in the traced graph, so every training call repeats them where plain "
            "PyTorch would draw new ones. Draw them with torch's generators (torch.rand, "
            "torch.bernoulli), whose draws hrockmate replays at every call, or turn that "
            "randomness off", stacklevel=2)
    if checkpointed:
        names = sorted(set(checkpointed))
        logger.info(
            "the model checkpoints activations itself (torch.utils.checkpoint, of %s); the "
            "checkpointed calls are traced as plain calls and the plan decides what is "
            "recomputed (eager's gradients are the same either way)",
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    def build(joint: fx.GraphModule) -> Traced:
        _refuse_sparse_tensors(joint)
        _match_random_layouts(joint)
        _compact_random_masks(joint)
        return _build(joint, flat_kinds, flat_real, out_box["count"],
                      name or type(model).__name__, device)

    traced = build(joint)
    decided = reads_box["last"].decisions if "last" in reads_box else []
    if decided:
        first_test = out_box["count"] - len(decided) - (
            1 if reads_box["last"].assumptions else 0)

        def trace_not_taken(indices: set[int]) -> Traced:
            not_taken.clear()
            not_taken.update(indices)
            try:
                other = trace_again()
            finally:
                not_taken.clear()
            if other is None:
                exc = failures[which][0]
                raise TraceError(
                    f"the model decides at random whether to run parts of the step (at "
                    f"{decided[min(indices)].where or 'its code'}), and tracing the other "
                    f"outcome failed: {type(exc).__name__}: {_first_line(exc)}. Turn that "
                    "randomness off (transformers: set the config's layerdrop, "
                    "encoder_layerdrop and decoder_layerdrop to 0.0)") from exc
            return build(other)

        traced.skippable = _skippable_regions(
            traced, decided, first_test, trace_not_taken, decisions_cache)
    traced.python_draws = tuple(draws)
    traced.output_spec = out_box["spec"]
    traced.input_spec = input_spec
    traced.input_meta = [_leaf_meta(x) for x in leaves]
    traced.device = device
    traced.autocast = autocast_state()
    traced.value_guards = guards
    assumed = reads_box["last"].assumptions if "last" in reads_box else []
    traced.finite_assumptions = [a.where or "the model's code" for a in assumed]
    traced.finite_check = out_box["count"] - 1 if assumed else None
    if assumed:
        logger.info("the model tests values for finiteness (%s); the graph assumes them finite "
                    "and each call checks that", ", ".join(dict.fromkeys(
                        traced.finite_assumptions)))
    updated = sorted(k for kind, k in (guards.sources if guards else ())
                     if kind == "buffer" and k in traced.buffer_updates)
    if updated:
        raise TraceError(
            f"the model reads the value of buffer {updated[0]!r}, which each training step "
            "updates, to decide what it computes (as BatchNorm does with momentum=None): one "
            "traced graph cannot follow a decision that changes at every call. Make the "
            "decision independent of that value (BatchNorm: give a momentum) or leave this "
            "module out of hrockmate")
    if cost != "none":
        from hrockmate.capture.costs import annotate_costs

        t1 = time.perf_counter()
        annotate_costs(traced, model, sample, mode=cost)
        traced.cost_seconds = time.perf_counter() - t1
    order_after_tests(traced.graph, traced.skippable)
    traced.trace_seconds = time.perf_counter() - t0
    traced.graph.meta.update(
        {
            "source": "hrockmate.capture.tracing",
            "cost": cost,
            "compiling_paths": compiling_paths,
            "device": str(device),
            "autocast": [[d, str(dt).removeprefix("torch.")] for d, dt in traced.autocast],
            "value_guards": len(guards) if guards is not None else 0,
            "trace_seconds": round(traced.trace_seconds, 4),
        }
    )
    return traced


def trace_graph(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: LossFn | None = None,
    cost: str = "measure",
) -> Graph:
    """The IR of one training iteration of ``model`` on ``sample`` (see ``trace_model``)."""
    return trace_model(model, sample, loss_fn=loss_fn, cost=cost).graph


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


def trace(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: LossFn | None = None,
    cost: str = "measure",
) -> Graph:
    """The IR of one training iteration of ``model`` on ``sample`` (``hrockmate.trace``)."""
    return trace_graph(model, sample, loss_fn=loss_fn, cost=cost)


# ---- command line: the truth table ---------------------------------------------------------------
def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hrockmate.capture.tracing")
    p.add_argument("--truth-table", action="store_true",
                   help="compare simulated and measured store-all peaks on the built-in models")
    p.add_argument("--out", default="bench-results/truth_table.json")
    ns = p.parse_args(argv)
    if not ns.truth_table:
        p.print_help()
        return 2
    from hrockmate.capture.memory import truth_table

    truth_table(out=ns.out, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
