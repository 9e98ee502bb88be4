"""The ``HRockmate`` module: run a compiled schedule over the traced joint graph inside autograd.

``HRockmate(model, sample, budget)`` traces one training iteration of ``model`` (see
``hrockmate.trace``), picks a schedule (store-all when the budget allows it, otherwise the
solver's plan) and returns a ``torch.nn.Module`` that is called like ``model``. In training mode
with gradients enabled a call runs the schedule's *forward segment* inside a
``torch.autograd.Function``; when autograd reaches it, its backward runs the *backward segment*
(with its recomputations) on the output gradients. The backward segment is cut into chunks, each
one autograd node chained behind the previous one, so that finished parameter gradients reach
autograd while the backward still runs. Parameters are inputs of these nodes, so autograd itself
accumulates into their ``.grad`` (existing gradients are added to; DDP/FSDP hooks fire as
usual).

The schedule is compiled once into straight-line Python functions (``compiler``).

Semantics kept from eager PyTorch:

- random ops draw exactly the numbers plain PyTorch draws with the same seed: the generator
  state is saved right before the first execution of a random op that the schedule runs again,
  and replayed around each recomputation (the current state is restored afterwards);
- buffer updates (e.g. BatchNorm running statistics) are written back once per iteration, when
  their value is first computed; recomputations neither write again nor see the new value;
- in ``eval()`` mode or under ``torch.no_grad()`` the original model runs unchanged.

A call with other tensor shapes than traced is traced and planned in that call, and the
programs of the shapes seen are kept (``shapes``, docs/input-shapes.md); a call whose inputs
differ otherwise (structure, dtype or device of a tensor, the value of a non-tensor argument)
raises ``InputMismatchError``, as a new shape does with ``strict_shapes=True``. Keyword
arguments that a call adds to an all-keyword sample (transformers' ``num_items_in_batch``) are
traced as inputs (``hrockmate.integrations.calls``, which also gives the module the model's
``forward`` signature). Each call also
compares the model with the model as traced (``_ModelCheck``, no tensor data read): a changed
``requires_grad`` or training flag makes it trace and plan again; an edit (modules or tensors
added, removed, replaced, reshaped, retied) raises ``ModelChangedError``. Plans and op times
are cached on disk (``hrockmate.planning.cache``). Pickling keeps the model and the plan and
rebuilds the trace and code at the first training call.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from hrockmate.capture.kernels import autocast_off, autocast_state, describe_autocast
from hrockmate.capture.joint import TensorLeaf, rebuild_output
from hrockmate.capture.randomness import replay_python_draws
from hrockmate.capture.values import FiniteAssumptionError
from hrockmate.planning.dropped import saved_positions
from hrockmate.planning.entry import (  # noqa: F401  (the runtime's names for them)
    MAX_ROUNDS,
    POSSIBLE_RESERVE_SHARE,
    POSSIBLE_RESERVE_SHARE_AFTER_OVERFLOW,
    plan_for_runtime,
    solve_within_budget,
)
from hrockmate.integrations.calls import signed_forward, unwrap_compiled
from hrockmate.runtime.compiler import (
    Program,
    RuntimeScheduleError,
    compile_schedule,
    gradient_seed_bytes,
)
from hrockmate.runtime.cpu_memory import keep_freed_cpu_memory
from hrockmate.runtime.cuda_memory import split_cuda_blocks
from hrockmate.runtime import fsdp, shapes

__all__ = ["FiniteAssumptionError", "HRockmate", "InputMismatchError", "ModelChangedError",
           "RuntimeScheduleError"]


logger = logging.getLogger(__name__)


class InputMismatchError(ValueError):
    """A call's inputs do not match the sample the module was traced (and planned) with."""


class ModelChangedError(RuntimeError):
    """The model was edited after it was traced (modules or tensors added, removed, replaced,
    reshaped or retied); the message names what changed."""


# ---------------------------------------------------------------------------------------------
# Sample / call normalisation
# ---------------------------------------------------------------------------------------------
def _leaf_names(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """Readable names of the flattened leaves of a call, e.g. ``args[0]``, ``kwargs['mask']``."""
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs))[0]:
        head, rest = path[0], path[1:]
        root = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
        names.append(root + "".join(str(k) for k in rest))
    return names


# ---------------------------------------------------------------------------------------------
# The autograd Functions
# ---------------------------------------------------------------------------------------------
class _IterationState:
    """Everything one iteration (one call) shares between its forward and backward chunks."""

    __slots__ = ("program", "params", "buffers", "inputs", "env", "rng", "gp", "gx", "ungiven",
                 "saved_outputs")

    def __init__(
        self,
        program: Program,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        inputs: list[torch.Tensor],
        saved_outputs: Sequence[int] = (),
    ) -> None:
        self.program = program
        self.saved_outputs = saved_outputs  # (positions among the outputs: dropped.saved_positions)
        self.params = params
        self.buffers = buffers
        self.inputs = inputs
        self.env: list[Any] | None = None
        self.rng: list[Any] = [None] * (program.num_rng_slots + program.num_decision_slots)
        self.gp: list[Any] = [None] * program.num_param_slots
        self.gx: list[Any] = [None] * program.num_input_slots
        self.ungiven = 0  # outputs that received no gradient (``_zero_missing_gradients``)

    def run_chunk(self, i: int, grad_outputs: Sequence[torch.Tensor] = ()) -> list[Any]:
        """Run backward chunk ``i``; return the gradients it hands over (and forget them)."""
        program = self.program
        env = self.env
        if env is None:
            raise RuntimeError(
                "HRockmate: backward ran twice through the same iteration (retain_graph=True "
                "is not supported: the schedule frees activations); run the forward pass again"
            )
        with autocast_off():  # (the graph holds autocast's casts: kernels.autocast_off)
            program.chunks[i].fn(env, self.buffers, grad_outputs, self.rng, self.gp, self.gx)
        gp, gx = self.gp, self.gx
        grads: list[Any] = []
        given = ~self.ungiven  # (outputs that received a gradient)
        for j in program.chunk_params[i]:
            grads.append(gp[j] if program.param_tangents[j] & given else None)
            gp[j] = None  # no extra reference: autograd may take the tensor over as .grad
        for j in program.chunk_inputs[i]:
            grads.append(gx[j] if program.input_tangents[j] & given else None)
            gx[j] = None
        if i == len(program.chunks) - 1:
            self.release()
        return grads

    def release(self) -> None:
        self.env = None
        self.params = self.inputs = self.buffers = []
        self.rng = []


def _zero_missing_gradients(grads: list[torch.Tensor | None], program: Program,
                            device: torch.device) -> int:
    """Zeros (in the planned layout) for the outputs planned with a gradient that received
    none, as autograd would materialize them; warns, since they cost memory the plan did not
    expect (pass loss_fn to plan for the loss alone). Returns those outputs as a bitmask."""
    missing = []
    for i, layout in enumerate(program.tangent_layout):
        if layout is not None and grads[i] is None:
            shape, stride, dtype = layout
            grads[i] = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()
            missing.append(i)
    if missing:
        warnings.warn(
            f"HRockmate: {len(missing)} of the model's outputs (positions {missing} among its "
            "tensors) were planned with a gradient but received none in backward; zeros were "
            "made for them, which costs memory and time the plan did not count. Pass "
            "loss_fn (a function, or the loss's key such as loss_fn='loss') to HRockmate so "
            "that only the loss is planned for",
            stacklevel=2,
        )
    return sum(1 << i for i in missing)


class _ForwardSegment(torch.autograd.Function):
    """Runs the forward segment; its backward runs the first backward chunk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, state: _IterationState, token: torch.Tensor | None, *wired: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        program = state.program
        with autocast_off():
            env = program.forward.fn(state.params, state.buffers, state.inputs, state.rng)
        outputs = [env[t] for t in program.output_ids]
        for t in program.output_ids:
            env[t] = None  # kept by save_for_backward instead: no reference cycle through ctx
        state.env = env
        ctx.state = state
        ctx.has_token = token is not None
        # Only the outputs whose storage the backward segment reads are saved, as a plain
        # autograd node saves only what its backward needs: the others (the loss, mostly) are
        # the caller's to modify in place (``loss /= accumulation_steps``), and a modified
        # saved one fails autograd's version check at backward, as it would in plain PyTorch.
        ctx.save_for_backward(*(outputs[k] for k in state.saved_outputs))
        # outputs the plan has no gradient for (see Program.tangent_layout)
        nondiff = [o for o, layout in zip(outputs, program.tangent_layout) if layout is None]
        if nondiff:
            ctx.mark_non_differentiable(*nondiff)
        ctx.set_materialize_grads(False)
        ctx.device = outputs[0].device
        return tuple(outputs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[Any, ...]:
        state: _IterationState = ctx.state
        program = state.program
        if state.env is not None:
            for k, saved in zip(state.saved_outputs, ctx.saved_tensors):
                state.env[program.output_ids[k]] = saved
        grads_out = [
            g if g is None or not contig or g.is_contiguous() else g.contiguous()
            for g, contig in zip(grad_outputs, program.tangent_contiguous)
        ]
        state.ungiven = _zero_missing_gradients(grads_out, program, ctx.device)
        if torch._C._is_any_autocast_enabled():
            warnings.warn(
                "HRockmate: backward() was called within a torch.autocast region. The backward "
                "was traced with autocast off, as plain PyTorch runs a backward() called after "
                "the region (PyTorch's recommended use); called within it, plain PyTorch would "
                "also autocast the backward's ops, so gradients may differ from its. Call "
                "backward() after leaving the autocast region", stacklevel=2)
        grads = state.run_chunk(0, grads_out)
        device = ctx.device
        del grads_out
        token_grad = torch.empty(0, device=device) if ctx.has_token else None
        return (None, token_grad, *grads)


class _BackwardChunk(torch.autograd.Function):
    """A no-op in forward; its backward runs backward chunk ``index`` after chunk
    ``index - 1`` (it receives that chunk's token gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, state: _IterationState, index: int, token: torch.Tensor, *wired: torch.Tensor
    ) -> torch.Tensor:
        ctx.state = state
        ctx.index = index
        return token.new_empty(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, token_grad: torch.Tensor) -> tuple[Any, ...]:
        state: _IterationState = ctx.state
        grads = state.run_chunk(ctx.index)
        last = ctx.index == len(state.program.chunks) - 1
        # the last chunk's token is a fresh anchor that needs no gradient
        return (None, None, None if last else token_grad, *grads)


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
def _warn_of_captured_tensors(loss_fn: Any, traced: Any) -> None:
    """Warn when ``loss_fn`` closes over tensors (typically a batch's targets): the graph reads
    them from the same objects at every call, so another batch's values are not seen unless
    they are copied into those tensors."""
    if not callable(loss_fn) or isinstance(loss_fn, nn.Module):
        return
    try:
        seen = inspect.getclosurevars(loss_fn)
    except TypeError:  # not a Python function (a builtin, a functools.partial, ...)
        return
    captured = {id(v) for v in (*seen.nonlocals.values(), *seen.globals.values())
                if isinstance(v, torch.Tensor)}
    used = {id(t): t for t in (getattr(traced.gm, key) for kind, key in traced.sources.values()
                               if kind == "constant") if id(t) in captured}
    shapes = [tuple(t.shape) for t in used.values()]
    if shapes:
        warnings.warn(
            f"HRockmate: loss_fn closes over {len(shapes)} tensor(s) (shapes {shapes}); every "
            "call reads them from these same objects, so the targets of another batch are "
            "used only if copied into them in place (targets.copy_(y)). To pass per-batch "
            "tensors, make them arguments of the model, e.g. a module whose forward(x, y) "
            "returns criterion(model(x), y)",
            stacklevel=3,
        )


def _owner_slots(model: nn.Module, named: list[tuple[str, Any]]) -> list[tuple[nn.Module, str]]:
    slots = []
    for name, _ in named:
        prefix, _, attr = name.rpartition(".")
        slots.append((model.get_submodule(prefix) if prefix else model, attr))
    return slots


@dataclass
class _PlanRequest:
    """The constructor's arguments that say what to plan for."""

    budget: Any
    plan: Any
    cache: Any
    solve_options: dict[str, Any]
    loss_fn: Any = None  # see hrockmate.capture.trace.trace_model


#: Left out when pickling (rebuilt by tracing again at the first training call).
_NOT_PICKLED = ("_hr_traced", "_hr_program", "_hr_variants", "_hr_fingerprint", "_hr_snapshot",
                "_hr_param_slots", "_hr_buffer_slots", "_hr_prepared")
# Paths of the model traced for other values of its inputs (``_follow_values``): this many
# are kept (the one in use included), to switch back without tracing again; what every path
# shares (the model, the request, the model checks) is not part of one. Eight: an
# encoder-decoder's two padding masks, each padded or not, take four (transformers' BART).
_MAX_VARIANTS = 8
_SHARED_BY_VARIANTS = frozenset({"_hr_model", "_hr_request", "_hr_fingerprint",
                                 "_hr_snapshot", "_hr_variants", "_hr_shapes"})
#: ``_build``'s budget when it is the one the constructor (or ``replan``) asked for.
_ASKED = object()

_NOT_REBUILT = (
    "HRockmate was unpickled and has not been traced again yet, so {what} is not available: "
    "its first training call traces the model again and compiles the plan"
)


def _modules_in_order(model: nn.Module) -> list[nn.Module]:
    """The module tree in depth-first pre-order, children in registration order (the order
    ``_model_fingerprint`` lists them in)."""
    out: list[nn.Module] = []
    stack = [model]
    while stack:
        mod = stack.pop()
        out.append(mod)
        stack.extend(c for c in reversed(mod._modules.values()) if c is not None)
    return out


def _model_fingerprint(model: nn.Module) -> list[Any]:
    """What the traced iteration depends on in the model, as far as it can be checked at every
    call without reading tensor data (one flat list, cheap to build and compare): the module
    tree (module identities and child names), each module's training flag, per parameter its
    name, which earlier parameter it is tied to, shape, dtype, device and ``requires_grad``, per
    buffer its name, shape, dtype and device. Parameters are compared by tying, not identity:
    the runtime reads them from their modules at each call, so a same-shaped replacement (as
    FSDP2 installs) is used correctly."""
    first_use: dict[int, int] = {}
    out: list[Any] = []
    add = out.append
    for mod in _modules_in_order(model):
        children = mod._modules
        add(id(mod))
        add(mod.training)
        add(tuple(children))
        add(len(mod._parameters))
        for name, p in mod._parameters.items():
            add(name)
            if p is not None:
                add(first_use.setdefault(id(p), len(first_use)))
                add(p.shape)
                add(p.dtype)
                add(p.device)
                add(p.requires_grad)
        for name, b in mod._buffers.items():
            add(name)
            if b is not None:
                add(b.shape)
                add(b.dtype)
                add(b.device)
    return out


try:  # TorchDynamo's guard on tensor metadata, checked in C++ (private API: used when present)
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - depends on the torch build
    _TensorGuards = None

_TRAINING = operator.attrgetter("training")
_CONTAINERS = operator.attrgetter("_modules", "_parameters", "_buffers")
_chain = itertools.chain.from_iterable


def _picker(positions: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A function taking the items at ``positions`` of a sequence, as a tuple."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)  # (one item: itemgetter returns it bare)
    return lambda seq: tuple(seq[i] for i in positions)


class _ModelCheck:
    """Whether the model is still as traced, asked at every training call.

    ``_model_fingerprint`` decides; it reads each tensor's metadata in Python, which on a slow
    host costs a few hundred microseconds per call, all before the first kernel of the step is
    launched. The common case, nothing changed since the last call, is answered first by a
    fast path of C-level loops: the same modules with the same training flags, the same names
    and the same objects in their child, parameter and buffer dicts, and the tensors' metadata
    unchanged (TorchDynamo's ``TensorGuards``: shape, strides, dtype, device,
    ``requires_grad``). When the fast path sees any difference the fingerprint decides, and a
    model that still matches (a parameter replaced by a same-shaped one, a changed dispatch
    context) is taken as the new reference for the fast path."""

    def __init__(self, model: nn.Module) -> None:
        self.fingerprint = _model_fingerprint(model)
        self._reference(model)

    def _reference(self, model: nn.Module) -> None:
        self._modules = _modules_in_order(model)
        self._training = list(map(_TRAINING, self._modules))
        containers = list(_chain(map(_CONTAINERS, self._modules)))
        # most child and buffer dicts are empty: their sizes are compared, their contents not
        self._sizes = list(map(len, containers))
        self._filled = _picker([i for i, n in enumerate(self._sizes) if n])
        filled = self._filled(containers)
        self._names = list(_chain(filled))
        values = list(_chain(map(dict.values, filled)))
        # (module identities cannot be reused while this holds the modules; a tensor's id can,
        # but the guard below checks the metadata of whatever tensor is there now)
        self._ids = list(map(id, values))
        seen: set[int] = set()  # (the guard takes each tensor once: tied weights appear twice)
        self._tensors = _picker([i for i, v in enumerate(values) if isinstance(v, torch.Tensor)
                                 and not (id(v) in seen or seen.add(id(v)))])
        self._guard = None
        if _TensorGuards is not None:
            try:
                self._guard = _TensorGuards(*self._tensors(values), dynamic_dims_sizes=None,
                                            dynamic_dims_strides=None)
            except Exception:  # (another torch's signature: the fingerprint alone decides)
                self._guard = None

    def _fast(self) -> bool:
        if self._guard is None or list(map(_TRAINING, self._modules)) != self._training:
            return False
        containers = list(_chain(map(_CONTAINERS, self._modules)))
        if list(map(len, containers)) != self._sizes:
            return False
        filled = self._filled(containers)
        if list(_chain(filled)) != self._names:
            return False
        values = list(_chain(map(dict.values, filled)))
        return list(map(id, values)) == self._ids and self._guard.check(*self._tensors(values))

    def matches(self, model: nn.Module) -> bool:
        """Whether ``model`` (the traced model object) is as traced."""
        if self._fast():
            return True
        if _model_fingerprint(model) != self.fingerprint:
            return False
        if self._guard is not None:  # (without one there is no fast path to refresh)
            self._reference(model)
        return True


@dataclass
class _ModelSnapshot:
    """The model's state as ``_model_fingerprint`` sees it, by name (to say what changed)."""

    modules: dict[str, tuple[int, str, bool]]  # name -> (identity, type name, training)
    #: name -> (name of the first parameter it is tied to, shape, dtype, device, requires_grad)
    params: dict[str, tuple[Any, ...]]
    buffers: dict[str, tuple[Any, ...]]  # name -> (shape, dtype, device)

    @classmethod
    def of(cls, model: nn.Module) -> "_ModelSnapshot":
        modules, params, buffers = {}, {}, {}
        first_name: dict[int, str] = {}
        for prefix, mod in model.named_modules(remove_duplicate=False):
            modules[prefix] = (id(mod), type(mod).__name__, mod.training)
            for name, p in mod._parameters.items():
                if p is not None:
                    qual = f"{prefix}.{name}" if prefix else name
                    params[qual] = (first_name.setdefault(id(p), qual), tuple(p.shape), p.dtype,
                                    p.device, p.requires_grad)
            for name, b in mod._buffers.items():
                if b is not None:
                    buffers[f"{prefix}.{name}" if prefix else name] = (tuple(b.shape), b.dtype,
                                                                       b.device)
        return cls(modules, params, buffers)


def _model_changes(traced: _ModelSnapshot, now: _ModelSnapshot) -> tuple[list[str], list[str]]:
    """(edits, mode changes) from the traced model to the model ``now``, in words. Edits
    (modules or tensors added, removed, replaced, reshaped, retied) invalidate the trace; mode
    changes (``requires_grad``, training flags) only call for tracing again."""

    def module(prefix: str) -> str:
        return f"module '{prefix}'" if prefix else "the model"

    def tying(name: str, first: str) -> str:
        return "not tied" if first == name else f"tied to '{first}'"

    edits: list[str] = []
    modes: list[str] = []
    for prefix in traced.modules.keys() - now.modules.keys():
        edits.append(f"{module(prefix)} ({traced.modules[prefix][1]}) was removed")
    for prefix in now.modules.keys() - traced.modules.keys():
        edits.append(f"{module(prefix)} ({now.modules[prefix][1]}) was added")
    for prefix in traced.modules.keys() & now.modules.keys():
        (old_id, old_type, old_training) = traced.modules[prefix]
        (new_id, new_type, new_training) = now.modules[prefix]
        if old_id != new_id:
            edits.append(f"{module(prefix)} was replaced ({old_type} -> {new_type})")
        elif old_training != new_training:
            modes.append(f"{module(prefix)} is now in {'training' if new_training else 'eval'} "
                         "mode")
    for kind, old, new in (("parameter", traced.params, now.params),
                           ("buffer", traced.buffers, now.buffers)):
        for name in old.keys() - new.keys():
            edits.append(f"{kind} '{name}' was removed (or set to None)")
        for name in new.keys() - old.keys():
            edits.append(f"{kind} '{name}' was added")
        for name in old.keys() & new.keys():
            before, after = old[name], new[name]
            if kind == "parameter":
                if before[0] != after[0]:
                    edits.append(f"parameter '{name}' was {tying(name, before[0])} when traced "
                                 f"and is {tying(name, after[0])} now")
                if before[4] != after[4]:
                    modes.append(f"parameter '{name}' "
                                 + ("now requires grad" if after[4] else "no longer requires grad"))
                before, after = before[1:4], after[1:4]
            for what, b, a in zip(("shape", "dtype", "device"), before, after):
                if b != a:
                    edits.append(f"{kind} '{name}' changed {what} from {b} to {a}")
    return sorted(edits), sorted(modes)


def _listed(items: list[str], most: int = 3) -> str:
    shown = ", ".join(items[:most])
    return shown + (f" and {len(items) - most} more" if len(items) > most else "")


def _on_cpu(model: nn.Module, leaves: list[Any]) -> bool:
    """Whether the model runs on the CPU (its first parameter, buffer or tensor input is there)."""
    for t in itertools.chain(model.parameters(), model.buffers(), leaves):
        if isinstance(t, torch.Tensor):
            return t.device.type == "cpu"
    return True


def _on_cuda(model: nn.Module, leaves: list[Any]) -> bool:
    return any(t.is_cuda for t in itertools.chain(model.parameters(), model.buffers(), leaves)
               if isinstance(t, torch.Tensor))


def _needs_grad(model: nn.Module, leaves: list[Any]) -> bool:
    return any(p.requires_grad for p in model.parameters()) or any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in leaves
    )


class HRockmate(nn.Module):
    """``model`` trained within ``budget``, with gradients identical to plain PyTorch.

    ``HRockmate(model, sample, budget=None, plan=None, cache=None, loss_fn=None, max_shapes=8,
    strict_shapes=False, compile=False, **solve_options)``

    - ``sample``: what the model is called with (a tensor, a tuple of positional arguments or a
      dict of keyword arguments); every later call must have the same structure, tensor
      dtypes and devices, and the same non-tensor values. Tensors of other shapes are traced
      and planned at their first call; ``max_shapes`` programs are kept (least recently used
      dropped), and ``strict_shapes=True`` refuses other shapes instead.
    - ``budget``: a fraction of the store-all peak (a number in (0, 1] or ``"50%"``; with the
      loss's gradient seed that ``backward()`` makes), bytes (a whole number above 1, or a size
      string such as ``"6GiB"``), or ``None`` for store-all (plain autograd's memory).
    - ``plan``: a ``Plan`` (from ``hrockmate.solve`` or ``load_plan``) or a ``Schedule`` for this
      model and sample; when given, ``budget`` and ``solve_options`` are not used.
    - ``cache``: the plan cache (``hrockmate.planning.cache``): ``None`` the default location, a
      directory, or ``False`` to plan afresh without reading or writing it.
    - ``solve_options``: passed to ``hrockmate.solve`` when a budget below the store-all peak
      needs a plan.
    - ``compile``: ``True`` runs the schedule as inductor-compiled pieces
      (``runtime.inductor``), with gradients within float tolerance of ``torch.compile`` of
      the plain model instead of bitwise equal to eager PyTorch's (docs/runtime.md).

    ``parameters()``, ``named_parameters()``, ``buffers()`` and ``state_dict()`` are the original
    model's (same objects, same keys); other attributes fall through to the model, and
    ``inspect.signature(hmod.forward)`` is the model's. The returned tensors are ordinary
    autograd outputs (``loss /= n`` in place works). docs/training-scripts.md: Trainer,
    torch.compile, distributed training.

    Mixed precision: build it within the ``torch.autocast`` region the training calls use (a
    call under other regions traces and plans again) and call ``backward()`` after the region.
    Under per-block FSDP2 a ``MixedPrecisionPolicy`` that casts the parameters is traced and
    planned at the first training call after sharding (``_follow_policies``).
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Any,
        budget: Any = None,
        plan: Any = None,
        cache: Any = None,
        loss_fn: Any = None,
        max_shapes: int = shapes.DEFAULT_MAX_SHAPES,
        strict_shapes: bool = False,
        compile: bool = False,
        **solve_options: Any,
    ) -> None:
        super().__init__()
        # (compiled mode: runtime.inductor; read by _compile for every program built)
        self.__dict__["_hr_inductor"] = bool(compile)
        if not isinstance(model, nn.Module):
            raise TypeError(f"HRockmate needs a torch.nn.Module, got {type(model).__name__}")
        model = unwrap_compiled(model)
        object.__setattr__(self, "_hr_model", model)
        # (the model's signature, for code that inspects it: hrockmate.integrations.calls)
        self.__dict__["forward"] = signed_forward(self)
        # Share the model's registries: parameters, buffers, children and state_dict keys are
        # exactly the original's, and .to()/zero_grad()/train() reach the same objects.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        self.training = model.training
        # What to plan for: kept to plan again when the model's trainable parameters or
        # training flags change, and after unpickling.
        self._hr_request = _PlanRequest(budget, plan, cache, dict(solve_options), loss_fn)
        from hrockmate.runtime import distributed

        distributed.check_layout(model, "HRockmate cannot be built")
        # Programs of the other input shapes called with (docs/input-shapes.md).
        self.__dict__["_hr_shapes"] = shapes.ShapePrograms(max_shapes, strict_shapes)
        self._build(sample)
        if distributed.should_agree():  # (every rank runs rank 0's plan)
            distributed.agree_on_plan(self)
        if compile:  # (plans on compiled op times, compiles the pieces now and measures the
            # peak against the budget)
            from hrockmate.runtime.inductor import build_compiled

            build_compiled(self, sample)

    def _build(self, sample: Any, plan: Any = None, budget: Any = _ASKED,
               change: str | None = None, donors: Sequence[dict[str, Any]] = ()) -> None:
        """Trace the model on ``sample``, then choose and compile its schedule: ``plan`` if
        given, else what the constructor's arguments ask for, for ``budget`` when given (the
        bytes of a shape whose graph changed: ``change`` says how, and a budget no plan fits
        then runs the lowest-peak plan with a warning). ``donors``: states of other input
        shapes, whose schedules and op times a graph of the same structure reuses
        (``shapes.choose_for_build``)."""
        model: nn.Module = self.__dict__["_hr_model"]
        request: _PlanRequest = self._hr_request
        from hrockmate.capture.joint import split_sample
        from hrockmate.capture.trace import trace_model

        before = _ModelSnapshot.of(model)
        args, kwargs = split_sample(sample)
        if _on_cpu(model, pytree.tree_leaves((args, kwargs))):
            keep_freed_cpu_memory()  # before tracing: op times are measured as they will run
        elif _on_cuda(model, pytree.tree_leaves((args, kwargs))):
            split_cuda_blocks()  # (so that a step's peak is the one its plan predicts)
        # "estimate" also measures each op's workspace, which the predicted peak includes.
        from hrockmate.planning.cache import open_cache

        from hrockmate.integrations.use_cache import training_without_cache

        # a budget or a plan checkpoints: a transformers model then trains without its cache
        # of keys and values, as with transformers' own gradient checkpointing
        checkpointed = ((request.budget if budget is _ASKED else budget) is not None
                        or (request.plan if plan is None else plan) is not None)
        with (training_without_cache(model, sample) if checkpointed
              else contextlib.nullcontext(False)) as cache_off:
            traced = trace_model(model, sample, loss_fn=request.loss_fn, cost="estimate",
                                 decisions_cache=open_cache(request.cache))
        if cache_off:
            traced.graph.meta["use_cache_turned_off"] = True
        _warn_of_captured_tensors(request.loss_fn, traced)
        object.__setattr__(self, "_hr_traced", traced)
        self.__dict__["_hr_variants"] = []  # (paths of other input values: of the old trace)

        # Slots: the unique parameters and buffers in the model's order, and tensor inputs.
        named_p = list(model.named_parameters())
        named_b = list(model.named_buffers())
        p_index = {id(p): j for j, (_, p) in enumerate(named_p)}
        b_index = {id(b): j for j, (_, b) in enumerate(named_b)}
        self._hr_param_slot = {
            n: p_index[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
        }
        self._hr_buffer_slot = {
            n: b_index[id(b)] for n, b in model.named_buffers(remove_duplicate=False)
        }
        self._hr_param_slots = _owner_slots(model, named_p)
        self._hr_buffer_slots = _owner_slots(model, named_b)

        leaves = pytree.tree_leaves((args, kwargs))
        tensor_leaf = [j for j, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        self._hr_input_slot = {flat: s for s, flat in enumerate(tensor_leaf)}
        self._hr_tensor_leaf = tensor_leaf
        self._hr_input_spec = traced.input_spec
        self._hr_input_meta = [  # (a torch.device, so that calls compare without converting)
            (m[0], m[1], torch.device(m[2])) if _is_tensor_meta(m) else m
            for m in traced.input_meta]
        self._hr_positional_tensors = (
            not kwargs
            and len(tensor_leaf) == len(leaves)
            and pytree.tree_flatten((tuple(leaves), {}))[1] == traced.input_spec
        )
        self._hr_input_grad_leaves = {int(k) for k in traced.input_grads}
        self._hr_out_leaves, self._hr_out_spec = _output_structure(traced)
        self._hr_single_output = (self._hr_out_leaves == [TensorLeaf]
                                  and self._hr_out_spec.is_leaf())
        self._hr_output_views = _output_views(traced)
        self._hr_device = traced.device

        # (hierarchies built for this trace: reused by replan() with the same options)
        self.__dict__["_hr_prepared"] = {}
        fixed = request.plan if plan is None else plan
        from hrockmate.capture.baseline import fraction_in_bytes, record_reference

        # a fraction is of plain PyTorch's measured peak at this shape (capture.baseline)
        asked = request.budget if budget is _ASKED else budget
        asked, eager = fraction_in_bytes(model, sample, traced, None if fixed is not None
                                         else asked, request.loss_fn, request.cache)
        self.__dict__["_hr_eager"] = eager

        def choose(budget_now: Any) -> tuple[Any, Any, int, Program]:
            return _choose_schedule(
                model, sample, traced, budget_now, fixed, request.solve_options, self._compile,
                cache=request.cache, prepared=self.__dict__["_hr_prepared"],
            )

        if fixed is not None:
            self.__dict__["_hr_budget_bytes"] = None
            self.__dict__["_hr_shape_info"] = None
            self._install(*choose(request.budget))
        else:
            chosen, budget_bytes, info = shapes.choose_for_build(
                choose, traced, shapes.shape_key(leaves), asked, self._compile, change=change,
                donors=donors, prepared=self.__dict__["_hr_prepared"])
            # the bytes this shape's later changes (trainable parameters, training flags,
            # other input values, autocast) are planned for: what the user asked for
            self.__dict__["_hr_budget_bytes"] = budget_bytes
            self.__dict__["_hr_shape_info"] = info
            self._install(*chosen)
        record_reference(self.plan, eager)
        # Taken after the trace: a model may edit itself in its forward (transformers' BigBird
        # swaps its attention modules for full attention on short inputs), and the trace and
        # the slots above are of the model as that call left it.
        self._hr_fingerprint = _ModelCheck(model)
        self._hr_snapshot = _ModelSnapshot.of(model)
        edits, modes = _model_changes(before, self._hr_snapshot)
        if edits or modes:
            logger.warning("HRockmate: the model changed itself while it was traced (%s); the "
                           "plan is for the model as that call left it", _listed(edits + modes))

    def use_plan(self, plan: Any) -> None:
        """Switch to another ``Plan`` or ``Schedule`` for the same traced graph (no re-tracing)."""
        self._install(*_choose_schedule(
            self.__dict__["_hr_model"], None, self.traced, None, plan, {}, self._compile
        ))

    def replan(self, budget: Any, sample: Any = None, **solve_options: Any) -> Any:
        """Plan the traced iteration for another ``budget`` (the forms the constructor takes;
        None: store-all) and switch to that plan, without tracing again; returns the ``Plan``.

        ``solve_options`` update the constructor's. The plan cache is used as the constructor
        uses it. The hierarchy's block options are built once per set of options and kept, so a
        sweep over budgets solves only the top levels after the first. ``sample`` (a call's
        arguments) is needed only when op times must be measured and were not yet (the module
        was built for store-all, with the default ``cost="measure"``). A budget no plan fits
        raises ``InfeasibleBudget`` and leaves the plan in use unchanged. Later rebuilds (after
        a change of trainable parameters, or unpickling) plan for this budget and options."""
        request: _PlanRequest = self._hr_request
        options = {**request.solve_options, **solve_options}
        from hrockmate.capture.baseline import fraction_in_bytes, record_reference

        resolved, eager = fraction_in_bytes(
            self.__dict__["_hr_model"], sample, self.traced, budget, request.loss_fn,
            request.cache, known=self.__dict__.get("_hr_eager"))
        self.__dict__["_hr_eager"] = eager
        self._install(*_choose_schedule(
            self.__dict__["_hr_model"], sample, self.traced, resolved, None, options,
            self._compile, cache=request.cache, prepared=self.__dict__["_hr_prepared"],
        ))
        record_reference(self.plan, eager)
        self._hr_request = _PlanRequest(budget, None, request.cache, options, request.loss_fn)
        # the new budget is this shape's from now on; other shapes plan again for it
        self.__dict__["_hr_budget_bytes"] = shapes.budget_in_bytes(resolved, self.traced.graph)
        programs = self.__dict__.get("_hr_shapes")
        if programs is not None:
            programs.clear()
        return self.plan

    def _compile(self, schedule: Any) -> Program:
        program = compile_schedule(
            self.traced,
            schedule.steps,
            schedule.forward_len,
            self._hr_param_slot,
            self._hr_buffer_slot,
            self._hr_input_slot,
        )
        if self.__dict__.get("_hr_inductor"):
            from hrockmate.runtime.inductor import compile_program

            program = compile_program(self.traced, schedule.steps, schedule.forward_len,
                                      self._hr_param_slot, self._hr_buffer_slot,
                                      self._hr_input_slot, program)
        # per-block FSDP2 with the gathered blocks charged (fsdp.plan_with_blocks): the bytes
        # they add to this schedule's peak are bytes the runtime keeps beside the graph's
        # tensors, which planning fits into the budget with the rest
        gathered = fsdp.gathered_excess_bytes(self, schedule.steps, schedule.forward_len)
        if self.__dict__.get("_hr_fsdp_charged"):
            program.extra_bytes_fixed = False  # (the gathered blocks depend on the schedule)
        program.extra_bytes += gathered
        return program

    def _install(self, schedule: Any, plan: Any, predicted: int, program: Program) -> None:
        object.__setattr__(self, "_hr_plan", plan)
        object.__setattr__(self, "_hr_schedule", schedule)
        object.__setattr__(self, "_hr_program", program)
        # (the outputs a drop_outputs plan says the caller lets go of are saved only where a
        # later step reads them themselves: hrockmate.planning.dropped.saved_positions)
        object.__setattr__(self, "_hr_saved_outputs", saved_positions(
            self.traced.graph, schedule, program.output_ids,
            plan.stats.get("dropped_output_ids", ()) if plan is not None else ()))
        # The simulator's peak plus what the runtime keeps beyond the graph's tensors.
        self.predicted_peak_bytes: int = predicted + program.extra_bytes

    # ---- public properties -------------------------------------------------------------
    @property
    def plan(self) -> Any:
        """The ``Plan`` in use: the solver's, or one describing the store-all schedule
        (``plan.method == "store-all"``) or a hand-given ``Schedule`` (``"given"``)."""
        return self.__dict__["_hr_plan"]

    @property
    def schedule(self) -> Any:
        """The schedule being executed."""
        return self.__dict__["_hr_schedule"]

    @property
    def traced(self) -> Any:
        """The ``Traced`` iteration (graph IR and joint graph) the schedule runs on."""
        traced = self.__dict__["_hr_traced"]
        if traced is None:
            raise RuntimeError(_NOT_REBUILT.format(what="its trace"))
        return traced

    @property
    def wrapped_model(self) -> nn.Module:
        """The original model (runs as is in ``eval()`` mode and under ``torch.no_grad()``)."""
        return self.__dict__["_hr_model"]

    @property
    def recomputed_ops(self) -> int:
        """How many compute steps of one iteration re-run an op (0 for store-all)."""
        return self._compiled_program("the number of recomputed ops").recomputed_ops

    def generated_code(self) -> str:
        """The Python source of the compiled forward segment and of each backward chunk (for
        inspection)."""
        program = self._compiled_program("its generated code")
        return "\n".join(segment.source for segment in [program.forward, *program.chunks])

    def _compiled_program(self, what: str) -> Program:
        program = self.__dict__.get("_hr_program")
        if program is None:
            raise RuntimeError(_NOT_REBUILT.format(what=what))
        return program

    # ---- nn.Module behaviour -------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_hr_model")
            if model is None:
                raise
            return getattr(model, name)

    def train(self, mode: bool = True) -> "HRockmate":
        super().train(mode)
        self.__dict__["_hr_model"].training = mode
        return self

    def extra_repr(self) -> str:
        plan = self.__dict__.get("_hr_plan")
        peak = getattr(self, "predicted_peak_bytes", 0)
        how = plan.method if plan is not None else "?"
        program = self.__dict__.get("_hr_program")
        code = (f"{program.recomputed_ops} recomputed ops" if program is not None
                else "traced again at the first training call")
        return f"{how}, predicted peak {peak} bytes, {code}"

    # ---- pickling ------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """``torch.save(hmod)``, pickle and ``copy.deepcopy`` keep the model, the plan and
        what calls are checked against; the trace and the compiled code (Python functions) are
        left out and rebuilt at the first training call, which traces the model again on that
        call's inputs and reuses the plan."""
        state = dict(self.__dict__)
        for name in _NOT_PICKLED:
            state.pop(name, None)
        state.pop("forward", None)  # (made again: it refers to this object)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__["forward"] = signed_forward(self)
        self.__dict__["_hr_traced"] = None
        self.__dict__["_hr_program"] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model: nn.Module = self.__dict__["_hr_model"]
        if not (self.training and torch.is_grad_enabled()):
            return model(*args, **kwargs)
        leaves = self._check_inputs(args, kwargs)
        check: _ModelCheck | None = self.__dict__.get("_hr_fingerprint")
        if check is None or not check.matches(model):
            if not _needs_grad(model, leaves):
                return model(*args, **kwargs)  # nothing to differentiate: plain forward
            self._follow_model(args, kwargs)
        if self.__dict__["_hr_traced"].autocast != autocast_state():
            self._follow_autocast(args, kwargs)
        inputs = [leaves[j] for j in self._hr_tensor_leaf]
        guards = self.__dict__["_hr_traced"].value_guards
        if guards is not None:
            differs = guards.failing(self._guarded_value(inputs))
            if differs is not None:
                self._follow_values(args, kwargs, inputs, differs)
        program: Program = self._hr_program
        if fsdp.is_fsdp_module(self):  # (per-block FSDP2: the plan drives the blocks)
            driver = fsdp.driver_for(self)
            if driver is not None:
                program = driver.program
        params = [owner._parameters[attr] for owner, attr in self._hr_param_slots]
        if not any(t.requires_grad for t in params) and not any(t.requires_grad for t in inputs):
            return model(*args, **kwargs)  # nothing to differentiate: plain forward
        buffers = [owner._buffers[attr] for owner, attr in self._hr_buffer_slots]
        replay_python_draws(self.__dict__["_hr_traced"].python_draws)  # (as the model's code)
        state = _IterationState(program, params, buffers, inputs, self._hr_saved_outputs)
        n = len(program.chunks)
        token: torch.Tensor | None = None
        if n > 1:
            # Chain the later chunks behind the first: autograd runs chunk i only after
            # chunk i - 1 has handed its gradients over (and AccumulateGrad consumed them).
            token = torch.empty(0, device=self._hr_device, requires_grad=True)
            for i in range(n - 1, 0, -1):
                wired = [params[j] for j in program.chunk_params[i]]
                wired += [inputs[j] for j in program.chunk_inputs[i]]
                token = _BackwardChunk.apply(state, i, token, *wired)
        wired = [params[j] for j in program.chunk_params[0]]
        wired += [inputs[j] for j in program.chunk_inputs[0]]
        outs = _ForwardSegment.apply(state, token, *wired)
        if self._hr_output_views:
            # an output that is a view of another (``logits = stacked[:, -1]``) is made again
            # from that one's returned tensor, as AOTAutograd does: it has no gradient of its
            # own in the graph, and a view returned by the function itself carried none
            outs = list(outs)
            for k, j in self._hr_output_views:
                v = outs[k]
                outs[k] = outs[j].as_strided(v.size(), v.stride(), v.storage_offset())
        traced = self.__dict__["_hr_traced"]
        if traced.finite_check is not None and not bool(outs[traced.finite_check]):
            assumed = traced.finite_assumptions
            raise FiniteAssumptionError(
                f"values the model tests for finiteness (at {_listed(sorted(set(assumed)))}) "
                "hold inf or NaN at this call: plain PyTorch takes the model's other branch "
                "there (DETR-style layers clamp such values), and the traced graph holds only "
                "the finite one. Training has likely diverged (lower the learning rate, check "
                "the inputs for inf/NaN); torch.autograd.set_detect_anomaly(True) on the plain "
                "model shows where they first appear")
        if self._hr_single_output:
            return outs[0]
        return _rebuild_outputs(self._hr_out_leaves, self._hr_out_spec, outs)

    # ---- model checks ----------------------------------------------------------------------
    def _follow_model(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model differs from the traced one: raise ``ModelChangedError`` when it was
        edited; trace and plan again when only trainable parameters or training flags changed,
        or when the module was unpickled."""
        from hrockmate.ir.plan import PlanError

        sample = self._sample_of_call(args, kwargs)
        request: _PlanRequest = self._hr_request
        if "_hr_fingerprint" not in self.__dict__:  # unpickled: trace again, keep the plan
            try:
                self._build(sample, plan=self._hr_plan)
                return
            except PlanError as exc:
                if request.plan is not None:
                    raise
                logger.warning("HRockmate: the unpickled plan does not fit the model as traced "
                               "now (%s); planning again", exc)
            self._build(sample)
            return
        edits, modes = _model_changes(self._hr_snapshot,
                                      _ModelSnapshot.of(self.__dict__["_hr_model"]))
        if not edits and not modes:  # same names and tensors, in another order or nesting
            edits = ["the order or nesting of its modules changed"]
        if edits:
            raise ModelChangedError(
                f"the model changed since it was traced: {_listed(edits)}; rebuild HRockmate "
                "(HRockmate(model, sample, ...)) after changing the model"
            )
        what = _listed(modes)
        if request.plan is not None:
            raise ModelChangedError(
                f"{what} since the model was traced, and HRockmate was built with a fixed plan= "
                "for the traced state; restore that state, or build a new HRockmate (with a "
                "budget to plan for the new state)"
            )
        logger.warning("HRockmate: %s since the model was traced; tracing and planning again",
                       what)
        self._build(sample, budget=self._budget_bytes(), change=f"{what} since it was traced")

    def _guarded_value(self, inputs: list[torch.Tensor]) -> Callable[[Any], torch.Tensor]:
        """The values a trace's guards read (``capture.values``): inputs, small buffers."""
        model: nn.Module = self.__dict__["_hr_model"]

        def value_of(key: Any) -> torch.Tensor:
            kind, which = key
            return inputs[which] if kind == "input" else model.get_buffer(which)

        return value_of

    def _follow_values(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                       inputs: list[torch.Tensor], differs: str) -> None:
        """A value the model read from its inputs while traced (``capture.values``) differs at
        this call: the graph is not this call's. Switch to a path traced before whose guards
        hold (the last ``_MAX_VARIANTS`` are kept), else trace and plan again (or raise
        ``InputMismatchError`` with a fixed ``plan=``)."""
        if self._hr_request.plan is not None:
            raise InputMismatchError(
                f"{differs}, and HRockmate was built with a fixed plan= for the traced graph; "
                "build a new HRockmate for this input")
        variants: list[dict[str, Any]] = self.__dict__.get("_hr_variants", [])
        current = {k: v for k, v in self.__dict__.items()
                   if k.startswith("_hr_") and k not in _SHARED_BY_VARIANTS
                   or k == "predicted_peak_bytes"}
        for i, variant in enumerate(variants):
            if variant["_hr_traced"].value_guards.failing(self._guarded_value(inputs)) is None:
                variants[i] = current
                self.__dict__.update(variant)
                logger.info("HRockmate: %s; using the plan traced before for these values",
                            differs)
                return
        logger.warning("HRockmate: %s; the model took another path, so it is traced and "
                       "planned again for this call (the last %d paths are kept)", differs,
                       _MAX_VARIANTS)
        self._build(self._sample_of_call(args, kwargs), budget=self._budget_bytes(),
                    change=differs)
        self.__dict__["_hr_variants"] = (variants + [current])[-(_MAX_VARIANTS - 1):]

    def _follow_autocast(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """This call runs under other ``torch.autocast`` regions than the trace did: its
        casts and dtypes are in the graph, so trace and plan again under this call's (or raise
        ``ModelChangedError`` with a fixed ``plan=``)."""
        traced, now = self.__dict__["_hr_traced"].autocast, autocast_state()
        what = (f"HRockmate was traced {describe_autocast(traced)} and is called "
                f"{describe_autocast(now)}")
        if self._hr_request.plan is not None:
            raise ModelChangedError(
                f"{what}, and it was built with a fixed plan= for the traced graph (whose "
                "dtypes autocast chose); call it as it was traced, or build a new HRockmate "
                "within the same autocast region as the training calls")
        logger.warning("%s; tracing and planning again for this call (build HRockmate within "
                       "the autocast region the training calls use to trace once)", what)
        self._build(self._sample_of_call(args, kwargs), budget=self._budget_bytes(),
                    change=what)

    def _follow_policies(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                         changes: list[str]) -> None:
        """Per-block FSDP2 whose ``MixedPrecisionPolicy`` changes the ops the plan runs
        (``fsdp.policy_changes_graph``: parameters gathered in ``param_dtype``, block outputs
        cast): at the first training call, trace and plan again the model as plain
        per-block FSDP2 runs it (``fsdp.as_run_under_policies``), so that the graph's dtypes
        and sizes, and the plan, are of what runs. A collective call, as every rank's first
        training call is. Raises ``UnsupportedLayoutError`` with a fixed ``plan=``."""
        from hrockmate.capture.layout import UnsupportedLayoutError
        from hrockmate.runtime import distributed

        what = _listed(changes)
        request: _PlanRequest = self._hr_request
        if request.plan is not None:
            raise UnsupportedLayoutError(
                f"HRockmate was built with a fixed plan= for the graph traced with the "
                f"parameters' own dtypes, and under FSDP2's MixedPrecisionPolicy {what}, so "
                "the ops the plan would run are others; build HRockmate with a budget (or "
                "none, for store-all) instead: its first training call after sharding traces "
                "and plans the model as the policy runs it")
        plan = self.__dict__.get("_hr_plan")
        if plan is not None and plan.method == "given":
            logger.warning(
                "HRockmate: the schedule given to use_plan is of the graph traced with the "
                "parameters' own dtypes; under FSDP2's MixedPrecisionPolicy %s, so the model "
                "is traced and planned again for its budget. Call use_plan after this call "
                "with a schedule of hmod.traced.graph", what)
        sample = self._sample_of_call(args, kwargs)
        for key in ("_hr_fsdp_driver", "_hr_fsdp_charged"):
            self.__dict__.pop(key, None)
        logger.info("HRockmate: under FSDP2's MixedPrecisionPolicy %s; tracing and planning "
                    "the model as it runs so", what)
        with fsdp.as_run_under_policies(self):
            self._build(sample, change=f"under FSDP2's MixedPrecisionPolicy {what}")
            if distributed.should_agree():
                distributed.agree_on_plan(self)
        # the model as the calls see it (the root gathered, the blocks sharded), not as traced
        model: nn.Module = self.__dict__["_hr_model"]
        self._hr_fingerprint = _ModelCheck(model)
        self._hr_snapshot = _ModelSnapshot.of(model)
        programs = self.__dict__.get("_hr_shapes")
        if programs is not None:
            programs.clear()
        self.__dict__["_hr_fsdp_policies"] = list(changes)

    def _budget_bytes(self) -> Any:
        """The budget a changed graph of this shape is planned for: the bytes it was resolved
        to when the shape was planned (a module unpickled from before they were kept: the
        constructor's budget)."""
        return self.__dict__.get("_hr_budget_bytes", self._hr_request.budget)

    def _follow_shape(self, args: tuple[Any, ...], kwargs: dict[str, Any], leaves: list[Any],
                      j: int) -> None:
        """Leaf ``j`` (and maybe others) has another shape than traced: switch to the program
        held for this call's shapes, or trace and plan them in this call
        (``shapes.switch_shape``); ``InputMismatchError`` with ``strict_shapes=True`` or a fixed
        ``plan=``."""
        programs = self.__dict__.get("_hr_shapes")
        if programs is None:  # (unpickled from a module that held one shape: the defaults)
            programs = self.__dict__["_hr_shapes"] = shapes.ShapePrograms()
        why = ("strict_shapes=True" if programs.strict
               else "a fixed plan= for the sample's graph" if self._hr_request.plan is not None
               else None)
        if why is not None:
            name = _leaf_names(args, kwargs)[j]
            raise InputMismatchError(
                f"argument {name} differs from the traced sample: traced with shape "
                f"{tuple(self._hr_input_meta[j][0])}, called with shape {tuple(leaves[j].shape)}; "
                f"HRockmate was built with {why}, so it runs the sample's shapes only: build "
                "it without that to trace and plan each new shape at its first call, or "
                "build another HRockmate for this input")
        sample = self._sample_of_call(args, kwargs)
        old = shapes.describe_shapes(shapes.meta_shape_key(self._hr_input_meta))
        new = shapes.describe_shapes(shapes.shape_key(leaves))
        shapes.switch_shape(self, shapes.shape_key(leaves), lambda donors: self._build(
            sample, change=f"the input shapes changed from {old} to {new}", donors=donors))

    @property
    def budget_bytes(self) -> int | None:
        """The budget of the input shape in use, in bytes (None: store-all, or a fixed plan=):
        a budget given in bytes as given; a fraction, of this shape's baseline. Changes the
        module follows are planned for these bytes."""
        return self.__dict__.get("_hr_budget_bytes")

    @property
    def planned_shapes(self) -> list[tuple[Any, ...]]:
        """The input shapes whose programs the module holds (at most ``max_shapes``), the one
        in use first: per flattened argument its shape, None for non-tensors."""
        held = self.__dict__.get("_hr_shapes")
        now = [shapes.meta_shape_key(self.__dict__["_hr_input_meta"])]
        return now + (list(reversed(held.entries)) if held is not None else [])

    def _sample_of_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call's arguments as a sample of the traced form: detached tensors, those whose
        gradient the trace has requiring grad."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        grads = self._hr_input_grad_leaves
        leaves = [
            x.detach().requires_grad_(j in grads) if isinstance(x, torch.Tensor) else x
            for j, x in enumerate(leaves)
        ]
        new_args, new_kwargs = pytree.tree_unflatten(leaves, spec)
        return dict(new_kwargs) if new_kwargs else tuple(new_args)

    # ---- input checks ----------------------------------------------------------------------
    def _check_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                      follow: bool = True) -> list[Any]:
        if self._hr_positional_tensors and not kwargs and len(args) == len(self._hr_input_meta):
            leaves = list(args)  # common case: only positional tensors, no pytree walk needed
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            self._check_structure(spec)
        meta = self._hr_input_meta
        reshaped = None  # the first tensor of another shape (followed once all else matches)
        for j, leaf in enumerate(leaves):
            want = meta[j]
            if isinstance(leaf, torch.Tensor):
                if not (isinstance(want, tuple) and len(want) == 3):
                    self._mismatch(args, kwargs, j, "a non-tensor value", "a tensor")
                shape, dtype, device = want
                if leaf.shape != shape and reshaped is None:  # (torch.Size is a tuple)
                    if not follow:
                        self._mismatch(args, kwargs, j, f"shape {tuple(shape)}",
                                       f"shape {tuple(leaf.shape)}")
                    reshaped = j
                if leaf.dtype != dtype:
                    self._mismatch(args, kwargs, j, f"dtype {dtype}", f"dtype {leaf.dtype}")
                if leaf.device != device:
                    self._mismatch(args, kwargs, j, f"device {device}", f"device {leaf.device}")
                if leaf.requires_grad and j not in self._hr_input_grad_leaves:
                    name = _leaf_names(args, kwargs)[j]
                    raise InputMismatchError(
                        f"input {name} requires grad but the traced sample's did not, so no "
                        "gradient for it was planned; build HRockmate with a sample whose "
                        f"{name} requires grad"
                    )
            elif _is_tensor_meta(want):
                self._mismatch(args, kwargs, j, "a tensor", f"{type(leaf).__name__} {leaf!r}")
            elif not _same_value(leaf, want):
                self._mismatch(args, kwargs, j, f"value {want!r}", f"value {leaf!r}")
        if reshaped is not None:
            self._follow_shape(args, kwargs, leaves, reshaped)
            return self._check_inputs(args, kwargs, follow=False)
        return leaves

    def _check_structure(self, spec: Any) -> None:
        if spec != self._hr_input_spec:
            raise InputMismatchError(
                "HRockmate was called with a different argument structure than the traced "
                f"sample: expected {self._hr_input_spec}, got {spec}; call it like the sample or "
                "build a new HRockmate for these arguments"
            )

    def _mismatch(self, args: Any, kwargs: Any, j: int, traced: str, got: str) -> None:
        name = _leaf_names(args, kwargs)[j]
        raise InputMismatchError(
            f"argument {name} differs from the traced sample: traced with {traced}, called with "
            f"{got}; only tensor shapes may change from call to call, so call it as the sample "
            "or build another HRockmate for this input"
        )


def _is_tensor_meta(meta: Any) -> bool:
    """Whether a traced input leaf's entry describes a tensor (shape, dtype, device)."""
    return isinstance(meta, tuple) and len(meta) == 3 and isinstance(meta[1], torch.dtype)


def _same_value(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # objects whose comparison fails count as different
        return a is b


def _output_structure(traced: Any) -> tuple[list[Any], Any]:
    """(leaf template, spec): see ``output_spec`` in ``hrockmate.capture.trace``."""
    spec, leaves = traced.output_spec
    return list(leaves), spec


def _output_views(traced: Any) -> list[tuple[int, int]]:
    """(k, j): the k-th output is a view of the j-th's storage and has no gradient planned
    (the trace differentiates only its base)."""
    position = {t: j for j, t in enumerate(traced.output_ids)}
    with_tangent = {int(v[1]) for v in traced.sources.values() if v[0] == "tangent"}
    views = []
    for k, t in enumerate(traced.output_ids):
        root = traced.graph.storage_root(t)
        j = position.get(root)
        if root != t and j is not None and k not in with_tangent:
            views.append((k, j))
    return views


def _rebuild_outputs(template: list[Any], spec: Any, outs: Sequence[torch.Tensor]) -> Any:
    return rebuild_output((spec, template), outs)


def _choose_schedule(
    model: nn.Module,
    sample: Any,
    traced: Any,
    budget: Any,
    plan: Any,
    solve_options: dict[str, Any],
    compile_fn: Callable[[Any], Program],
    cache: Any = None,
    prepared: dict[str, dict[str, Any]] | None = None,
) -> tuple[Any, Any, int, Program]:
    """(schedule, plan, simulated peak, compiled program): the planning entry
    (``hrockmate.planning.entry.plan_for_runtime``) with this runtime's compiler."""
    return plan_for_runtime(model, sample, traced, budget, plan, solve_options, compile_fn,
                            describe=_describe, seed_bytes=gradient_seed_bytes(traced.graph),
                            cache=cache, prepared=prepared)


def _describe(graph: Any, schedule: Any, sim: Any, base: Any, budget_bytes: int,
              method: str) -> Any:
    """A ``Plan`` for a schedule that did not come from the solver."""
    from hrockmate.ir.plan import Plan

    return Plan(
        graph_hash=graph.structure_hash(),
        graph_name=graph.name,
        budget_bytes=int(budget_bytes),
        peak_bytes=int(sim.peak_bytes),
        time=float(sim.time),
        baseline_peak_bytes=int(base.peak_bytes),
        baseline_time=float(base.time),
        steps=list(schedule.steps),
        forward_len=int(schedule.forward_len),
        time_unit=graph.time_unit,
        stats={"method": method, "optimal": method == "store-all"},
    )
