"""The call surface of ``HRockmate``: what code that inspects or compiles the module sees.

``HRockmate`` keeps an instance attribute ``forward`` (``signed_forward``): a function with
the wrapped model's signature, so that ``inspect.signature(hmod.forward)`` lists the model's
parameters (transformers' ``Trainer`` drops every dataset column that the signature does not
name, and passes ``num_items_in_batch`` only to a forward that takes ``**kwargs``). The function
is excluded from TorchDynamo: ``torch.compile(hmod)`` then runs the plan eagerly, so the
budget still holds (a compiled plan is not built yet; tracing the runtime's Python with
dynamo broke the graph in many places and ran outside the plan's memory model).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree


logger = logging.getLogger("hrockmate.runtime.module")

__all__ = ["model_signature", "signed_forward", "unwrap_compiled"]


def model_signature(model: nn.Module) -> inspect.Signature | None:
    """The signature of ``model.forward`` (None where it has none Python can read)."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _accepts(signature: inspect.Signature | None, names: set[str]) -> bool:
    """Whether a forward of ``signature`` takes all of ``names`` as keyword arguments."""
    if signature is None:
        return False
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return all(n in params and params[n].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                 inspect.Parameter.KEYWORD_ONLY) for n in names)


def _halves(spec: Any) -> tuple[Any, Any]:
    """The (args, kwargs) children of a traced call's TreeSpec."""
    children = spec.children() if callable(getattr(spec, "children", None)) \
        else spec.children_specs
    return children[0], children[1]


def _follow_new_keywords(hmod: nn.Module, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> None:
    """A training call that passes keyword arguments the sample had not (transformers'
    ``Trainer`` adds ``num_items_in_batch`` to each batch when the model takes ``**kwargs``):
    when the sample was all keywords, the call is too and the model accepts them, trace and
    plan again with this call's arguments, so that their values reach the graph as inputs (the
    loss is then exactly plain PyTorch's). Other differences are left to the input checks."""
    spec = hmod.__dict__.get("_hr_input_spec")
    if spec is None or args:
        return
    known = hmod.__dict__.get("_hr_keywords")  # (the spec's keywords, read once per trace)
    if known is None or known[0] is not spec:
        traced_args, traced_kwargs = _halves(spec)
        known = (spec, frozenset(traced_kwargs.context or ()), traced_args.num_children == 0)
        hmod.__dict__["_hr_keywords"] = known
    _, traced, all_keywords = known
    if not all_keywords or kwargs.keys() == traced:
        return
    new = set(kwargs) - traced
    if not new or not traced <= kwargs.keys():
        return
    model = hmod.__dict__["_hr_model"]
    if not _accepts(model_signature(model), new):
        return
    if hmod._hr_request.plan is not None:
        return  # (a fixed plan is for the traced graph: the input checks say so)
    sample = pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), dict(kwargs))
    logger.warning(
        "HRockmate: called with keyword argument(s) %s that the sample did not have; tracing "
        "and planning again with them as inputs (put them in the sample to trace once)",
        ", ".join(sorted(new)))
    hmod._build(sample)


def signed_forward(hmod: nn.Module) -> Callable[..., Any]:
    """The ``forward`` an ``HRockmate`` instance shows: it runs ``type(hmod).forward`` after
    ``_follow_new_keywords``, carries the wrapped model's signature and is skipped by
    TorchDynamo (see the module's docstring)."""
    model = hmod.__dict__["_hr_model"]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if hmod.training and torch.is_grad_enabled():
            if not hmod.__dict__.get("_hr_layout_checked"):
                from hrockmate.runtime.fsdp import first_call_check

                first_call_check(hmod, args, kwargs)
            if kwargs:
                _follow_new_keywords(hmod, args, kwargs)
        return type(hmod).forward(hmod, *args, **kwargs)

    forward = torch._dynamo.disable(
        forward, reason="hrockmate runs its plan eagerly (a compiled plan is not built yet)")
    signature = model_signature(model)
    if signature is not None:
        forward.__signature__ = signature  # type: ignore[attr-defined]
    forward.__doc__ = type(model).forward.__doc__
    forward.__name__ = "forward"
    return forward


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module inside ``torch.compile(model)``, with a warning that the plan runs eagerly;
    ``model`` itself otherwise."""
    compiled = getattr(getattr(torch, "_dynamo", None), "eval_frame", None)
    optimized = getattr(compiled, "OptimizedModule", None)
    if optimized is None or not isinstance(model, optimized):
        return model
    inner = model._orig_mod
    warnings.warn(
        "HRockmate was given a torch.compile'd module: hrockmate traces and plans the module "
        f"inside it ({type(inner).__name__}) and runs that plan eagerly, without the compile "
        "(compiled execution of plans is not supported yet). state_dict() keys are that "
        "module's, without torch.compile's '_orig_mod.' prefix. To silence this, pass the "
        "module itself: HRockmate(model, ...)",
        stacklevel=3,
    )
    return inner
