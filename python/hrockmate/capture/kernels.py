"""Which kernel runs an op of the traced joint graph, on real tensors.

Mostly the op's own ATen overload. The exception is BatchNorm on CUDA. The trace holds the
functional op ``_native_batch_norm_legit_functional`` and its backward
``native_batch_norm_backward``, which run PyTorch's native CUDA kernels. Eager autograd goes
through ``_batch_norm_impl_index`` instead, which picks cuDNN whenever cuDNN can run it. The
two kernels sum in different orders, so gradients differed (up to 1e-2 relative on a ResNet
with TF32 convolutions) and the native kernel was slower. Here the forward op runs
``_batch_norm_impl_index`` as eager does, on copies of the running statistics (the traced op
is functional: it returns the updated statistics instead of writing them). When cuDNN was
picked, its reserve space (an extra output the graph does not have, empty for plain BatchNorm)
is attached to the saved mean, and the backward op runs ``cudnn_batch_norm_backward`` as
eager's autograd does. Times are measured (``hrockmate.capture.costs``) and workspaces sized with
the same kernels the runtime calls.

Mixed precision: a model traced under ``torch.autocast`` has autocast's casts in its graph as
ops (``_to_copy`` to the autocast dtype), and each op's dtypes are the ones autocast chose. The
traced ops therefore run with autocast switched off (``autocast_off``): autocast active around
them would cast again, by its op lists alone, also the ops of a region the model ran with
autocast disabled (an ``mm`` of float32 tensors would run in bfloat16), and the graph's dtypes
would no longer be the traced ones. ``autocast_state`` is what a trace is valid for.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch
import torch.utils._pytree as pytree

__all__ = ["AS_RESHAPE", "RELAYOUT", "AutocastState", "autocast_off", "autocast_state",
           "describe_autocast", "draws_random_numbers", "in_place_kernel", "kernel",
           "node_kernel", "op_kernel", "relayout_outputs", "run_node", "target_name",
           "view_as_reshape", "want_relayout"]

#: The device types whose autocast state is followed (those this torch build knows).
_AUTOCAST_DEVICES = tuple(
    d for d in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")
    if torch.amp.autocast_mode.is_autocast_available(d))

#: The autocast regions active: (device type, dtype) for each device type with autocast on.
AutocastState = tuple[tuple[str, torch.dtype], ...]


def autocast_state() -> AutocastState:
    """The autocast regions active in this thread (empty outside ``torch.autocast``)."""
    if not torch._C._is_any_autocast_enabled():
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def describe_autocast(state: AutocastState) -> str:
    """``state`` in words, for messages."""
    if not state:
        return "without autocast"
    return "under " + " and ".join(
        f"torch.autocast({d!r}, dtype=torch.{str(dt).removeprefix('torch.')})"
        for d, dt in state)


@contextlib.contextmanager
def autocast_off() -> Iterator[None]:
    """Autocast switched off on every device type while traced ops run (see the module
    docstring); nothing is entered when it is off already (the usual case)."""
    state = autocast_state()
    if not state:
        yield
        return
    with contextlib.ExitStack() as stack:
        for device_type, _ in state:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        yield

_aten = torch.ops.aten
_RESERVE = "_hrockmate_cudnn_reserve"  # attribute of the saved mean: cuDNN's reserve space


def _batch_norm_as_eager_in_place(input: torch.Tensor, weight: torch.Tensor | None,
                                  bias: torch.Tensor | None, running_mean: torch.Tensor,
                                  running_var: torch.Tensor, training: bool, momentum: float,
                                  eps: float) -> tuple[torch.Tensor, ...]:
    """Eager's BatchNorm path, updating the running statistics in place (as eager does); returns
    what ``_native_batch_norm_legit_functional`` returns, the statistics being the same tensors."""
    out, save_mean, save_invstd, reserve, impl = _aten._batch_norm_impl_index(
        input, weight, bias, running_mean, running_var, training, momentum, eps,
        torch.backends.cudnn.enabled,
    )
    if impl == 1:  # cuDNN: its backward needs the reserve space
        setattr(save_mean, _RESERVE, reserve)
    return out, save_mean, save_invstd, running_mean, running_var


def _batch_norm_as_eager(input: torch.Tensor, weight: torch.Tensor | None,
                         bias: torch.Tensor | None, running_mean: torch.Tensor,
                         running_var: torch.Tensor, training: bool, momentum: float,
                         eps: float) -> tuple[torch.Tensor, ...]:
    """``_native_batch_norm_legit_functional`` computed by eager's BatchNorm path."""
    return _batch_norm_as_eager_in_place(input, weight, bias, running_mean.clone(),
                                         running_var.clone(), training, momentum, eps)


def _suggested_memory_format(t: torch.Tensor) -> torch.memory_format:
    """ATen's ``suggest_memory_format``: channels-last when ``t`` is laid out so (and not
    plainly contiguous), else contiguous; eager's autograd lays BatchNorm's gradient out so."""
    if not t.is_contiguous():
        if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
            return torch.channels_last
        if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
    return torch.contiguous_format


def _batch_norm_backward_as_eager(grad_out: torch.Tensor, input: torch.Tensor,
                                  weight: torch.Tensor | None, running_mean: Any,
                                  running_var: Any, save_mean: torch.Tensor | None,
                                  save_invstd: torch.Tensor | None, train: bool, eps: float,
                                  output_mask: list[bool]) -> tuple[Any, ...]:
    """``native_batch_norm_backward``, by cuDNN when the forward ran cuDNN (as eager does)."""
    reserve = getattr(save_mean, _RESERVE, None)
    if reserve is None or weight is None or not train:
        return _aten.native_batch_norm_backward.default(
            grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train,
            eps, output_mask)
    grad_out = grad_out.contiguous(memory_format=_suggested_memory_format(input))
    grads = _aten.cudnn_batch_norm_backward(input, grad_out, weight, running_mean, running_var,
                                            save_mean, save_invstd, eps, reserve)
    return tuple(g if wanted else None for g, wanted in zip(grads, output_mask))


_EAGER_CUDA: dict[Any, Callable[..., Any]] = {
    _aten._native_batch_norm_legit_functional.default: _batch_norm_as_eager,
    _aten.native_batch_norm_backward.default: _batch_norm_backward_as_eager,
}


def _rnn_layer_for_training(*args: Any) -> Any:
    # oneDNN's LSTM layer (eager's CPU LSTM in training) makes the workspace its backward reads
    # only while grad mode is on, and the runtime's forward runs with it off: run it with grad
    # mode on, on detached tensors, so that autograd records nothing
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.enable_grad():
        return _aten.mkldnn_rnn_layer.default(*args)


_EAGER_CPU: dict[Any, Callable[..., Any]] = {
    _aten.mkldnn_rnn_layer.default: _rnn_layer_for_training,
}


#: Schema arguments through which an op is handed a draw made by another op.
_GIVEN_DRAWS = frozenset({"philox_seed", "philox_offset", "rng_state"})

#: Tagged ops that never draw: the CPU flash attention refuses any dropout ("Currently do not
#: support dropout > 0"), so it takes nothing from the generator. Taken for random, every CPU
#: transformer's attention was replayed with the generator's 5,056-byte state kept for it.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_NEVER_DRAWS = frozenset() if _CPU_FLASH is None else frozenset({_CPU_FLASH.default})


@functools.lru_cache(maxsize=None)
def draws_random_numbers(target: Any) -> bool:
    """Whether running ``target`` takes numbers from a random generator. ATen tags such ops
    ``nondeterministic_seeded``; the tag is also on the backwards of the fused attention
    kernels (memory-efficient, cuDNN), which take the forward's draw as inputs (its philox seed
    and offset) and draw nothing: replaying them needs no generator state. The CPU flash
    attention carries it too and never draws (``_NEVER_DRAWS``)."""
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()) or (
            target in _NEVER_DRAWS):
        return False
    schema = getattr(target, "_schema", None)
    return schema is None or not any(a.name in _GIVEN_DRAWS for a in schema.arguments)


@functools.lru_cache(maxsize=None)
def kernel(target: Any, device_type: str) -> Callable[..., Any]:
    """The callable that runs ``target`` (an fx node's target) on ``device_type`` tensors."""
    if device_type == "cuda" and target in _EAGER_CUDA:
        return _EAGER_CUDA[target]
    if device_type == "cpu" and target in _EAGER_CPU:
        return _EAGER_CPU[target]
    # OpOverload.__call__ only forwards to the C++ op; calling that directly saves a frame.
    return getattr(target, "_op", target)


# node.meta key: positions of the op's outputs that its real kernel lays out otherwise than
# the trace recorded (``relayout_outputs``); None stands for a single-tensor output
RELAYOUT = "hrockmate_relayout"
_WANTED = "hrockmate_relayout_wanted"  # node.meta key: a view of its output failed (see below)
# node.meta key: a view op that failed on its input's real layout runs as ``reshape``
AS_RESHAPE = "hrockmate_view_as_reshape"
_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def view_as_reshape(node: Any) -> bool:
    """Mark ``node``, a ``view`` that failed on its input's real layout, to run as ``reshape``
    (a copy where that layout cannot be viewed so). The trace holds a ``view`` where the code
    reshaped and the fake kernel of the op before it recorded a layout that could be viewed
    (softplus's backward: contiguous, where the real kernel keeps its gradient's transposed
    strides); eager's reshape copies on that path alone, and every other user of the tensor
    sees the real layout (a sum over it rounds as eager's). False if ``node`` is no such view
    or was marked already."""
    if node.target not in _RESHAPES or node.meta.get(AS_RESHAPE):
        return False
    node.meta[AS_RESHAPE] = True
    return True


def node_kernel(node: Any, device_type: str) -> Callable[..., Any]:
    """``kernel`` for the op of fx node ``node`` (``reshape`` for a view marked by
    ``view_as_reshape``), its outputs as the real kernel lays them out."""
    if node.meta.get(AS_RESHAPE):
        return torch.ops.aten.reshape.default
    return kernel(node.target, device_type)


def run_node(node: Any, device_type: str, args: Any, kwargs: Any) -> Any:
    """``node_kernel`` called on real ``args``; a view that fails on their layout is marked
    by ``view_as_reshape`` and runs as a reshape (the first real run of a trace's ops)."""
    try:
        return node_kernel(node, device_type)(*args, **kwargs)
    except RuntimeError:
        if not view_as_reshape(node):
            raise
        return node_kernel(node, device_type)(*args, **kwargs)


def want_relayout(node: Any) -> bool:
    """Mark ``node``'s op for ``relayout_outputs``: a view of one of its outputs failed on the
    real layout. False if it was marked already (a relayout did not help)."""
    if node.meta.get(_WANTED):
        return False
    node.meta[_WANTED] = True
    return True


def op_kernel(node: Any, device_type: str) -> Callable[..., Any]:
    """``kernel`` for the op of fx node ``node``. Where its real kernel lays an output out
    otherwise than the trace recorded (found by ``relayout_outputs`` when the workspaces were
    measured), that output is copied into the recorded layout: the graph's later ops were
    traced for it (a ``view`` of a transpose of it, say, where a real layout needs a copy)."""
    run = node_kernel(node, device_type)
    positions = node.meta.get(RELAYOUT)
    if not positions:
        return run
    traced = node.meta["val"]

    def relaid(*args: Any, **kwargs: Any) -> Any:
        return _in_traced_layout(run(*args, **kwargs), positions, traced)
    return relaid


def _in_traced_layout(out: Any, positions: tuple[int | None, ...], traced: Any) -> Any:
    if positions == (None,):
        return _copied_into(out, traced)
    outs = list(out)
    for i in positions:
        assert i is not None
        outs[i] = _copied_into(outs[i], traced[i])
    return type(out)(outs) if isinstance(out, list) else tuple(outs)


def _copied_into(t: torch.Tensor, traced: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(traced.shape, traced.stride(), dtype=t.dtype,
                               device=t.device).copy_(t)


def _same_layout(real: torch.Tensor, traced: torch.Tensor) -> bool:
    # (the stride of a dimension of size 1 never matters)
    return real.shape == traced.shape and all(
        n == 1 or a == b for n, a, b in zip(real.shape, real.stride(), traced.stride()))


def relayout_outputs(node: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """For an op marked by ``want_relayout``: ``out`` (what the real kernel returned for
    ``node``'s op) with the outputs whose layout differs from the traced one copied into the
    traced layout, and those positions recorded in ``node.meta[RELAYOUT]`` for ``op_kernel``.
    Other ops' outputs keep the real kernel's layout (eager's). Fake kernels can get a layout
    wrong: the one of ``_native_batch_norm_legit_functional`` keeps a transposed input's
    strides, the CPU kernel returns a contiguous tensor (HF PatchTST's BatchNorm over a
    transposed input: the trace then viewed a transpose of it, which the real tensor cannot be
    viewed as). Outputs that share an input's storage (views) are left alone."""
    if not node.meta.get(_WANTED):
        return out
    traced = node.meta.get("val")
    single = not isinstance(out, (tuple, list))
    outs, vals = ([out], [traced]) if single else (list(out), list(traced or ()))
    inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    found: list[int | None] = []
    for i, (o, v) in enumerate(zip(outs, vals)):
        if not (isinstance(o, torch.Tensor) and isinstance(v, torch.Tensor)) or o.numel() < 2:
            continue
        if o.shape != v.shape or _same_layout(o, v):
            continue
        ptr = o.untyped_storage().data_ptr()
        if any(x.untyped_storage().data_ptr() == ptr for x in inputs):
            continue
        found.append(None if single else i)
    if not found:
        return out
    node.meta[RELAYOUT] = tuple(found)
    return _in_traced_layout(out, tuple(found), traced)


_EAGER_CUDA_IN_PLACE: dict[Any, Callable[..., Any]] = {
    _aten._native_batch_norm_legit_functional.default: _batch_norm_as_eager_in_place,
}


def _returning(op: Any, mutated: tuple[int, ...]) -> Callable[..., Any]:
    """``op`` (which writes its arguments at ``mutated``), returning what its functional variant
    returns: the op's own results, then those arguments."""
    def run(*args: Any, **kwargs: Any) -> Any:
        result = op(*args, **kwargs)
        own = result if isinstance(result, tuple) else (result,)
        return (*own, *(args[i] for i in mutated))
    return run


@functools.lru_cache(maxsize=None)
def in_place_kernel(target: Any,
                    device_type: str) -> tuple[Callable[..., Any], tuple[int, ...]] | None:
    """A callable computing ``target`` by writing its results into some of its tensor arguments,
    and the positions of those arguments; None when the op has no such variant.

    The runtime uses it to write a buffer's new value (BatchNorm's running statistics, a step
    counter) straight into the buffer, as eager PyTorch does, instead of computing it into a new
    tensor and copying it over. Two forms: a functional op ``X_functional`` (whose results end
    with the new values of the arguments ``X`` writes; e.g. BatchNorm) and an out-of-place op
    with an in-place sibling ``X_`` of the same overload (``add`` -> ``add_``, which writes its
    first argument and returns it). The caller checks that the results have the arguments'
    shapes and dtypes, and that the old values are read nowhere else."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    packet, overload = target._schema.name.split("::")[1], target._overloadname
    if packet.endswith("_functional"):
        mutating = getattr(getattr(_aten, packet[: -len("_functional")], None), overload, None)
        if mutating is None:
            return None
        written = _written_arguments(mutating)
        n_own = len(mutating._schema.returns)
        if not written or n_own + len(written) != len(target._schema.returns):
            return None
        if device_type == "cuda" and target in _EAGER_CUDA_IN_PLACE:
            return _EAGER_CUDA_IN_PLACE[target], written
        return _returning(kernel(mutating, device_type), written), written
    sibling = getattr(getattr(_aten, packet + "_", None), overload, None)
    if sibling is None or _written_arguments(sibling) != (0,) or len(
            sibling._schema.returns) != 1 or len(target._schema.returns) != 1:
        return None
    return kernel(sibling, device_type), (0,)


def _written_arguments(op: Any) -> tuple[int, ...]:
    """Positions of the arguments ``op`` writes into (``Tensor(a!)`` in its schema)."""
    return tuple(i for i, a in enumerate(op._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def target_name(target: Any) -> str:
    """The op's name as the IR writes it (``aten.mm.default``), or the callable's name."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__name__", str(target))
