"""Why a trace failed: the model's own error (it fails in plain PyTorch too), a read of a tensor
value (of a random draw alone, in a loss inside the model, in the backward), or an op without a
fake kernel; and where in the model's code (``failing_code``). ``raise_trace_failure`` names
the cause once every try of ``trace_model`` has failed.
"""

from __future__ import annotations

import os
import re
import sysconfig
import traceback
import weakref
from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hrockmate.capture.joint import TraceError
from hrockmate.capture.kernels import draws_random_numbers
from hrockmate.capture.randomness import host_draws_recorded, preserved_rng

__all__ = ["eager_run", "explain", "failing_code", "first_line", "raise_trace_failure",
           "reads_tensor_values", "user_code"]

# (``t.numpy()`` of a traced tensor: its values handed to numpy, e.g. scipy's Hungarian
# matching in DETR-style losses)
_NUMPY_OF_TRACED = ".numpy() is not supported for tensor subclasses"


def reads_tensor_values(exc: BaseException) -> bool:
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
    code reads one as a Python value (code locations as ``failing_code`` writes them). A
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
                code = user_code(traceback.extract_stack())[0]
                if code is not None:
                    self.reads.add(code)
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._random[id(t)] = weakref.ref(t)
        return out


def eager_run(step: Callable[..., Any], flat_real: list[torch.Tensor],
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


def failing_code(exc: BaseException) -> tuple[str | None, bool]:
    """Where tracing failed in the model's code: the innermost frame outside torch, hrockmate
    and Python's standard library, as ``file:line in function: source``, or None; and whether
    it failed while autograd computed gradients (past the forward's frames, with no model code,
    such as a custom Function's backward, below)."""
    return user_code(traceback.extract_tb(exc.__traceback__))


def user_code(frames: Sequence[traceback.FrameSummary]) -> tuple[str | None, bool]:
    """The innermost model frame of ``frames`` (outermost first), as ``failing_code`` says."""
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


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message ("" for an empty one)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


# code locations (``failing_code``) inside a loss: transformers' ``loss/`` package, the
# Hungarian matchers of DETR-style models
_IN_A_LOSS = re.compile(r"loss|matcher|hungarian|linear_sum_assignment", re.IGNORECASE)


def explain(exc: BaseException, module_path: str, model: nn.Module,
             random_reads: set[str] | frozenset[str] = frozenset()) -> str:
    """The error for a failed trace. ``random_reads``: where the model read a value of random
    draws alone in an eager run (``eager_run``); a failure there is named as such."""
    code, in_backward = failing_code(exc)
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
    if code is not None and code in random_reads and reads_tensor_values(exc):
        return (f"cannot trace {where}{op_txt}{code_txt}: the model branches on a random draw "
                "there (a value computed from torch's random numbers alone, read as a Python "
                "number, as in torch.rand([]).item() < p). hrockmate traces both outcomes of a "
                "test of a draw kept as a tensor (LayerDrop's torch.rand([]) < p, then if on "
                "it), not a number read from it. Compare the draw as a tensor, or turn that "
                "randomness off while training with hrockmate (transformers models: set the "
                "config's layerdrop, encoder_layerdrop and decoder_layerdrop to 0.0), or leave "
                "this module out of hrockmate")
    first = first_line(exc) or type(exc).__name__
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


def raise_trace_failure(failures: dict[str, tuple[BaseException, str]], model: nn.Module,
                        eager: BaseException | None, random_reads: set[str]) -> NoReturn:
    """Raise the ``TraceError`` for a trace whose every try failed. ``failures``: try
    ("eager", "compiling", and "guarded" if it ran) -> (its error, the module it failed in);
    ``eager``: what the step raised when run in plain PyTorch (``eager_run``), None when it
    ran; ``random_reads``: where that run read a value of random draws alone."""
    (exc, path), (comp_exc, comp_path) = failures["eager"], failures["compiling"]
    if eager is not None:  # the model's own error, not a limit of tracing
        raise TraceError(
            f"the model fails in plain PyTorch too when called with this sample (and "
            f"loss_fn): {type(eager).__name__}: {first_line(eager)}; fix the model, its "
            "configuration or the sample (the traceback above shows where)") from eager
    guarded_exc, guarded_path = failures.get("guarded", (None, ""))
    if guarded_exc is not None and reads_tensor_values(guarded_exc) and \
            failing_code(guarded_exc)[0] != failing_code(exc)[0]:
        # the guarded try got past the first read: the next one, not the inputs' alone,
        # is the cause (a read where the first try failed is explained as before)
        raise TraceError(explain(guarded_exc, guarded_path, model, random_reads)) \
            from guarded_exc
    if reads_tensor_values(exc) and not reads_tensor_values(comp_exc):
        # the model reads a value on its eager path and its compilers' path breaks for a
        # reason of its own (transformers' Switch Transformers: `nonzero` in its experts,
        # and an attention mask it leaves None when compiling): the read is the cause
        raise TraceError(
            explain(exc, path, model, random_reads) + ". With "
            "torch.compiler.is_compiling() answering True, as it does for compilers, the "
            "model failed too" + (f" in module {comp_path!r}" if comp_path else "")
            + f": {type(comp_exc).__name__}: {first_line(comp_exc)}") from exc
    if reads_tensor_values(comp_exc):
        # a read on the compilers' path too: that is the one to remove
        raise TraceError(explain(comp_exc, comp_path, model, random_reads)) from comp_exc
    raise TraceError(explain(exc, path, model, random_reads)) from exc
