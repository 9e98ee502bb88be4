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

import contextlib
import logging
import time
import traceback
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from hrockmate.capture import regions
from hrockmate.capture.build import build_ir, refuse_sparse_tensors
from hrockmate.capture.costs import annotate_costs
from hrockmate.capture.decisions import order_after_tests
from hrockmate.capture.failures import (
    eager_run,
    first_line,
    raise_trace_failure,
    reads_tensor_values,
    user_code,
)
from hrockmate.capture.joint import (
    LossFn,
    ModuleAttributes,
    NewCacheEntriesCleared,
    Traced,
    TraceError,
    capture_joint,
    flatten_output,
    is_traced,
    leaf_meta,
    one_trace_at_a_time,
    same_joint,
    select_loss,
    split_sample,
    state_slots,
    tracing_context,
)
from hrockmate.capture.kernels import autocast_state
from hrockmate.capture.randomness import (
    PythonDraws,
    compact_random_masks,
    host_draws_recorded,
    match_random_layouts,
    preserved_rng,
)
from hrockmate.capture.values import (
    MAX_BYTES,
    FinitenessTests,
    MaskWritesByPositions,
    ValueGuards,
    ValueReads,
)
from hrockmate.ir.graph import Graph

__all__ = ["COST_MODES", "trace", "trace_model"]

COST_MODES = ("measure", "estimate", "none")

logger = logging.getLogger(__name__)

# Buffers up to this size are followed (and their reads guarded) by the guarded try of a trace
# (``capture.values``): EnCodec's integer padding buffers; large buffers are data.
_GUARDED_BUFFER_BYTES = 1024


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
    from hrockmate.capture.layout import check_layout  # (tracing would break its state)

    check_layout(model, "hrockmate cannot trace this model")
    t0 = time.perf_counter()
    tracer = _StepTracer(model, sample, loss_fn, name or type(model).__name__)
    joint = tracer.first_joint()
    if tracer.out_box["count"] == 0:
        raise TraceError("the model's output contains no tensor; return a tensor or a loss")
    draws = tracer.python_draws_of_kept_try(joint)
    _tell_about_host_draws_and_checkpoints(tracer)
    traced = tracer.build(joint)
    tracer.find_skippable_regions(traced, decisions_cache)
    tracer.describe_call(traced, draws)
    if cost != "none":
        t1 = time.perf_counter()
        annotate_costs(traced, model, sample, mode=cost)
        traced.cost_seconds = time.perf_counter() - t1
    order_after_tests(traced.graph, traced.skippable)
    traced.trace_seconds = time.perf_counter() - t0
    traced.graph.meta.update(
        {
            "source": "hrockmate.capture.trace",
            "cost": cost,
            "compiling_paths": tracer.compiling_paths,
            "device": str(tracer.device),
            "autocast": [[d, str(dt).removeprefix("torch.")] for d, dt in traced.autocast],
            "value_guards": len(tracer.guards) if tracer.guards is not None else 0,
            "trace_seconds": round(traced.trace_seconds, 4),
        }
    )
    layers = checkpoint_layers(model)
    if layers:
        traced.graph.meta["checkpoint_layers"] = layers
    return traced


def checkpoint_layers(model: nn.Module) -> list[str]:
    """The module paths of the layers the model's own gradient checkpointing wraps, in
    module order: transformers' ``GradientCheckpointingLayer`` instances, else the modules
    whose class the model names in ``_no_split_modules`` (its repeated blocks, which
    transformers' older ``gradient_checkpointing`` wrapped); empty for fewer than two. The
    planner's per-layer checkpointing (``planning.strategies.layer_labels``) cuts there;
    without them it finds the layers from the module lists."""
    import sys

    modeling = sys.modules.get("transformers.modeling_layers")  # (never imported for this)
    marker = getattr(modeling, "GradientCheckpointingLayer", None)
    named = [(n, m) for n, m in model.named_modules() if n]
    found = [n for n, m in named if marker is not None and isinstance(m, marker)]
    if len(found) < 2:
        classes = set(getattr(model, "_no_split_modules", None) or ())
        found = [n for n, m in named if type(m).__name__ in classes]
    # (a layer inside another is part of it)
    found = [n for n in found if not any(n.startswith(o + ".") for o in found)]
    return found if len(found) >= 2 else []


def trace(
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: LossFn | None = None,
    cost: str = "measure",
) -> Graph:
    """The IR of one training iteration of ``model`` on ``sample`` (``hrockmate.trace``; see
    ``trace_model``)."""
    return trace_model(model, sample, loss_fn=loss_fn, cost=cost).graph


def _tell_about_host_draws_and_checkpoints(tracer: _StepTracer) -> None:
    if tracer.host_draws:
        warnings.warn(
            f"the model drew random numbers from {' and '.join(sorted(tracer.host_draws))} "
            "while it was traced: those draws (a SpecAugment mask, a LayerDrop decision, ...) "
            "are now fixed in the traced graph, so every training call repeats them where "
            "plain PyTorch would draw new ones. Draw them with torch's generators (torch.rand, "
            "torch.bernoulli), whose draws hrockmate replays at every call, or turn that "
            "randomness off", stacklevel=3)
    if tracer.checkpointed:
        names = sorted(set(tracer.checkpointed))
        logger.info(
            "the model checkpoints activations itself (torch.utils.checkpoint, of %s); the "
            "checkpointed calls are traced as plain calls and the plan decides what is "
            "recomputed (eager's gradients are the same either way)",
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))


class _StepTracer:
    """One training step of ``model`` on ``sample`` as a function of the flat tensors
    (parameters, buffers, the sample's tensors), and the tries that trace it.

    The eager paths first: they compute what plain PyTorch computes (with
    torch.compiler.is_compiling() True, transformers' Mamba models take a parallel scan that
    rounds differently). Where that trace fails at a read of values, it is traced again on the
    eager path with the reads of the inputs' values answered and guarded; kept when every read
    is a test (True or False: a few graphs at most), as transformers' test that an attention
    mask has no padding, where the compilers' path builds an explicit mask in place of eager's
    is_causal and grouped-query kernel (HunYuan's key-norm gradients 3e-7 off; on GPU, no flash
    kernel). Otherwise the compilers' paths are traced: code that reads a tensor value may have
    a value-independent path for compilers (one graph for every count), and caches that
    compilers bypass (transformers' compile_compatible_method_lru_cache: BEiT's relative
    position index) keep no fake tensor of the trace, which breaks AOTAutograd's second pass;
    where those fail too, the guarded eager trace is taken as it is. Each retry runs outside
    the previous failure's handler so that its own failure does not carry the first as its
    context."""

    def __init__(self, model: nn.Module, sample: Any, loss_fn: LossFn | None, name: str
                 ) -> None:
        self.model, self.loss_fn, self.name = model, loss_fn, name
        args, kwargs = split_sample(sample)
        self.leaves, self.input_spec = pytree.tree_flatten((args, kwargs))
        params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        devices = {t.device for t in [*params.values(), *self.buffers.values()]} | {
            x.device for x in self.leaves if isinstance(x, torch.Tensor)
        }
        if len(devices) > 1:
            raise TraceError(
                f"model and sample live on several devices ({', '.join(map(str, devices))}); "
                "move them to one device first"
            )
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        self.n_params = len(params)

        self.flat_kinds: list[tuple[str, Any]] = [("param", k) for k in params]
        self.flat_kinds += [("buffer", k) for k in self.buffers]
        self.tensor_leaf_pos = [i for i, x in enumerate(self.leaves)
                                if isinstance(x, torch.Tensor)]
        self.flat_kinds += [("input", i) for i in self.tensor_leaf_pos]
        self.n_pb = len(params) + len(self.buffers)
        self.slots = state_slots(model, self.flat_kinds[:self.n_pb])
        self.flat_real: list[torch.Tensor] = [*params.values(), *self.buffers.values()]
        self.flat_real += [self.leaves[i] for i in self.tensor_leaf_pos]
        self.attributes = ModuleAttributes(model)
        # the last traced step's output structure ("spec") and tensor count ("count")
        self.out_box: dict[str, Any] = {}

        # the guarded try follows (and guards) values of the inputs and of small buffers: key
        # -> (position among the traced function's arguments, a copy of the value, which the
        # model's in-place ops on it then change, not the user's tensor)
        self.guarded_sources: dict[Any, tuple[int, torch.Tensor]] = {}
        self.guarded_try: list[bool] = []
        self.reads_box: dict[str, ValueReads] = {}
        # the random decisions answered "not taken" (their other outcome; capture.decisions)
        self.not_taken: set[int] = set()

        self.module_stack: list[str] = []
        self.host_draws: set[str] = set()
        self.python_draws = PythonDraws()  # (the last step's draws of Python's random)
        self.forced_draw: list[float] = []  # (what Python's random() returns, if given)
        self.drawn_by: dict[str, list[tuple[str, int]]] = {}  # try -> its Python draws
        self.checkpointed: list[str] = []  # the model's own checkpointed calls
        self.failures: dict[str, tuple[BaseException, str]] = {}  # try -> (error, module)
        self.new_entries_cleared = NewCacheEntriesCleared()

        # the outcome of the tries
        self.which = "eager"  # the try whose graph is kept
        self.guards: ValueGuards | None = None
        self.compiling_paths = False

    # ---- the step -------------------------------------------------------------------------------
    def plain_step(self, *_: torch.Tensor) -> Any:
        """The model as the user calls it, its parameters not swapped: what "fails in plain
        PyTorch too" is said of."""
        self.attributes.restore()
        a, kw = pytree.tree_unflatten(list(self.leaves), self.input_spec)
        out = self.model(*a, **kw)
        if isinstance(self.loss_fn, (str, int)):
            return select_loss(out, self.loss_fn)
        return out if self.loss_fn is None else self.loss_fn(out)

    def step(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self.attributes.restore()  # (each pass starts from the model the user gave)
        state = {name: flat[i] for name, i in self.slots}
        new_leaves = list(self.leaves)
        for pos, v in zip(self.tensor_leaf_pos, flat[self.n_pb:]):
            new_leaves[pos] = v
        a, kw = pytree.tree_unflatten(new_leaves, self.input_spec)
        out = torch.func.functional_call(self.model, state, tuple(a), kw, tie_weights=False,
                                         strict=False)
        loss = None
        if isinstance(self.loss_fn, (str, int)):
            loss = select_loss(out, self.loss_fn)
        elif self.loss_fn is not None:
            out = self.loss_fn(out)
        tensors, self.out_box["spec"] = flatten_output(out, is_traced)
        if loss is not None:
            # only the loss is differentiated: the other outputs get no gradient (tangent)
            tensors = [x if x is loss else x.detach() for x in tensors]
        self.out_box["count"] = len(tensors)
        return tuple(tensors)

    def step_with_values(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``step`` with reads of values answered (``ValueReads``), and the decisions' tests
        and whether the finiteness assumptions held as extra outputs."""
        sources = {key: (flat[i], real) for key, (i, real) in self.guarded_sources.items()}
        reads = ValueReads(sources if self.guarded_sources else None,
                           where=lambda: user_code(traceback.extract_stack())[0],
                           answers=lambda k: k in self.not_taken)
        self.reads_box["last"] = reads  # (AOTAutograd may call this twice; the last counts)
        self.python_draws.begin()  # (so are the draws of Python's random kept)
        # (on top of AOTAutograd's modes; writes through masks matter only where values of
        # the inputs are followed: the function mode costs about 8% of a trace's time)
        writes = (MaskWritesByPositions(reads) if self.guarded_sources
                  else contextlib.nullcontext())
        tests = FinitenessTests(reads) if self.guarded_try else contextlib.nullcontext()
        with reads, writes, tests:
            outs = self.step(*flat)
            held = reads.assumptions_held()
        # (after the model's outputs, which rebuild_output takes: the runtime reads the
        # decisions' tests and checks that the assumptions held)
        extra = [d.tensor for d in reads.decisions]
        if held is not None:
            extra.append(held)
        self.out_box["count"] += len(extra)
        return (*outs, *extra)

    def follow_inputs_and_small_buffers(self) -> None:
        flat_real = self.flat_real
        for k, i in enumerate(range(self.n_pb, len(flat_real))):
            if flat_real[i].untyped_storage().nbytes() <= MAX_BYTES:
                self.guarded_sources["input", k] = (i, flat_real[i].detach().clone())
        for j, name in enumerate(self.buffers, start=self.n_params):
            if flat_real[j].untyped_storage().nbytes() <= _GUARDED_BUFFER_BYTES:
                self.guarded_sources["buffer", name] = (j, flat_real[j].detach().clone())

    # ---- the tries ------------------------------------------------------------------------------
    def capture(self, compiling_paths: bool) -> fx.GraphModule:
        self.module_stack.clear()
        self.checkpointed.clear()
        # Our own fake mode, so that real tensors the model or loss_fn closes over (e.g.
        # targets, plain tensor attributes) are accepted; they become constants of the graph.
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        drawn = host_draws_recorded(self.host_draws, self.python_draws,
                                    self.forced_draw[0] if self.forced_draw else None)
        try:
            with preserved_rng(self.device), drawn, tracing_context(
                    self.model, self.device, self.module_stack, self.checkpointed,
                    compiling_paths):
                return capture_joint(self.step_with_values,
                                     [fake_mode.from_tensor(t) for t in self.flat_real])
        finally:
            self.attributes.restore()

    def try_capture(self, which: str) -> fx.GraphModule | None:
        """The joint graph of try ``which`` ("eager", "guarded" or "compiling"), or None with
        its failure kept in ``failures``."""
        try:
            with self.new_entries_cleared.around():
                joint = self.capture(which == "compiling")
        except TraceError:
            raise
        except Exception as exc:  # noqa: BLE001 - explained once every path failed
            self.failures[which] = (exc, self.module_stack[-1] if self.module_stack else "")
            return None
        if not self.forced_draw:  # (its draws of Python's random, if they are all of them)
            self.drawn_by[which] = (list(self.python_draws.calls)
                                    if self.python_draws.complete() else [])
        return joint

    def first_joint(self) -> fx.GraphModule:
        """The joint graph of the first try that works (see the class), or the
        ``TraceError`` that says why none did."""
        joint = self.try_capture("eager")
        # the guarded try's graph, its guards and its reads
        guarded: tuple[fx.GraphModule, ValueGuards | None, ValueReads] | None = None
        if joint is None and reads_tensor_values(self.failures["eager"][0]):
            self.follow_inputs_and_small_buffers()
            self.guarded_try.append(True)  # (isfinite's tests: a function mode, guarded only)
            found = self.try_capture("guarded")
            if found is not None:
                guarded = (found, self.reads_box["last"].guards(), self.reads_box["last"])
                if guarded[1] is None or guarded[1].tests_only:
                    joint, self.guards, self.which = guarded[0], guarded[1], "guarded"
            if joint is None:
                self.guarded_sources.clear()
                self.guarded_try.clear()
        if joint is None:
            joint = self.try_capture("compiling")
            self.compiling_paths = joint is not None
            self.which = "compiling"
        if joint is None and guarded is not None:
            joint, self.guards, self.reads_box["last"] = guarded
            self.which = "guarded"
        if joint is None:
            eager, random_reads = eager_run(self.plain_step, self.flat_real, self.buffers,
                                            self.device)
            self.attributes.restore()
            raise_trace_failure(self.failures, self.model, eager, random_reads)
        return joint

    def trace_again(self) -> fx.GraphModule | None:
        """The kept try traced once more (with other answers or draws), or None."""
        if self.which == "guarded" and not self.guarded_try:  # (as the kept graph was)
            self.follow_inputs_and_small_buffers()
            self.guarded_try.append(True)
        return self.try_capture(self.which)

    def python_draws_of_kept_try(self, joint: fx.GraphModule) -> list[tuple[str, int]]:
        """The kept try's draws of Python's random. Draws that cannot change the step
        (transformers' Musicgen and VITS draw LayerDrop with random.uniform(0, 1) < layerdrop,
        at a default of 0.0: the same graph with every draw at either end of its range) are
        replayed at each call and leave ``host_draws``; others stay there, fixed in the
        graph."""
        draws = self.drawn_by.get(self.which, [])
        if self.host_draws != {"Python's random"} or not draws or any(
                kind != "random" for kind, _ in draws):
            return draws
        kept = dict(self.out_box), dict(self.reads_box), list(self.checkpointed)
        for value in (0.0, 1.0 - 2.0 ** -53):
            self.forced_draw[:] = [value]
            try:
                other = self.trace_again()
            finally:
                self.forced_draw.clear()
                self.out_box.clear(), self.out_box.update(kept[0])
                self.reads_box.clear(), self.reads_box.update(kept[1])
                self.checkpointed[:] = kept[2]
            if other is None or not same_joint(joint, other):
                return draws
        self.host_draws.clear()
        logger.info("the model draws from Python's random while it runs (%d draws), and the "
                    "traced step is the same whatever they are; each call draws them as plain "
                    "PyTorch does", len(draws))
        return draws

    # ---- the graph ------------------------------------------------------------------------------
    def build(self, joint: fx.GraphModule) -> Traced:
        """The IR of a joint graph of this step, after the rewrites every trace gets."""
        refuse_sparse_tensors(joint)
        match_random_layouts(joint)
        compact_random_masks(joint)
        return build_ir(joint, self.flat_kinds, self.flat_real, self.out_box["count"],
                        self.name, self.device)

    def find_skippable_regions(self, traced: Traced, decisions_cache: Any) -> None:
        """``traced.skippable``: what each random decision of the step leaves out."""
        decided = self.reads_box["last"].decisions if "last" in self.reads_box else []
        if not decided:
            return
        first_test = self.out_box["count"] - len(decided) - (
            1 if self.reads_box["last"].assumptions else 0)

        def trace_not_taken(indices: set[int]) -> Traced:
            self.not_taken.clear()
            self.not_taken.update(indices)
            try:
                other = self.trace_again()
            finally:
                self.not_taken.clear()
            if other is None:
                exc = self.failures[self.which][0]
                raise TraceError(
                    f"the model decides at random whether to run parts of the step (at "
                    f"{decided[min(indices)].where or 'its code'}), and tracing the other "
                    f"outcome failed: {type(exc).__name__}: {first_line(exc)}. Turn that "
                    "randomness off (transformers: set the config's layerdrop, "
                    "encoder_layerdrop and decoder_layerdrop to 0.0)") from exc
            return self.build(other)

        traced.skippable = regions.skippable_regions(
            traced, decided, first_test, trace_not_taken, decisions_cache)

    def describe_call(self, traced: Traced, draws: list[tuple[str, int]]) -> None:
        """The fields of ``traced`` that say what a later call must match or replay."""
        guards = self.guards
        traced.python_draws = tuple(draws)
        traced.output_spec = self.out_box["spec"]
        traced.input_spec = self.input_spec
        traced.input_meta = [leaf_meta(x) for x in self.leaves]
        traced.device = self.device
        traced.autocast = autocast_state()
        traced.value_guards = guards
        assumed = self.reads_box["last"].assumptions if "last" in self.reads_box else []
        traced.finite_assumptions = [a.where or "the model's code" for a in assumed]
        traced.finite_check = self.out_box["count"] - 1 if assumed else None
        if assumed:
            logger.info("the model tests values for finiteness (%s); the graph assumes them "
                        "finite and each call checks that", ", ".join(dict.fromkeys(
                            traced.finite_assumptions)))
        updated = sorted(k for kind, k in (guards.sources if guards else ())
                         if kind == "buffer" and k in traced.buffer_updates)
        if updated:
            raise TraceError(
                f"the model reads the value of buffer {updated[0]!r}, which each training "
                "step updates, to decide what it computes (as BatchNorm does with "
                "momentum=None): one traced graph cannot follow a decision that changes at "
                "every call. Make the decision independent of that value (BatchNorm: give a "
                "momentum) or leave this module out of hrockmate")
