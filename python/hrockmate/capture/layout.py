"""The model layouts hrockmate can trace and run: per-block FSDP2 (``fully_shard`` on
submodules of the wrapped model) is refused, because the plan runs the whole model as one
program that reads the parameters itself, so the blocks' hooks that gather their shards would
never run (``hrockmate.runtime.distributed`` has the supported layouts)."""

from __future__ import annotations

import torch.nn as nn

__all__ = ["UnsupportedLayoutError", "check_layout"]


class UnsupportedLayoutError(RuntimeError):
    """The model is sharded in a way HRockmate does not run (per-block FSDP2)."""


def _sharded_parts(model: nn.Module, with_tensors: bool) -> list[str]:
    """Names of the model's submodules that FSDP2's fully_shard was applied to, and (with
    ``with_tensors``) of its DTensor parameters."""
    found: list[str] = []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        FSDPModule = ()  # type: ignore[assignment,misc]
    if FSDPModule:
        found += [name or "the model itself" for name, mod in model.named_modules()
                  if isinstance(mod, FSDPModule)]
    if with_tensors:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover
            return found
        found += [f"parameter {name}" for name, p in model.named_parameters()
                  if isinstance(p, DTensor)]
    return found


def check_layout(model: nn.Module, when: str, with_tensors: bool = True) -> None:
    """Raise ``UnsupportedLayoutError`` when ``model`` (the wrapped model) holds per-block
    FSDP2 shards; ``when`` starts the message. ``with_tensors``: also refuse DTensor
    parameters (at a call they are unsharded already where the whole HRockmate module is
    sharded, so they are blocks')."""
    parts = _sharded_parts(model, with_tensors)
    if not parts:
        return
    shown = ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")
    raise UnsupportedLayoutError(
        f"{when}: the wrapped model is sharded per block with FSDP2's fully_shard "
        f"({shown}). hrockmate runs the whole model as one plan that reads the parameters "
        "itself, so the blocks' hooks that gather their shards would never run. Supported "
        "layouts: DistributedDataParallel(HRockmate(model, sample, budget)), or "
        "fully_shard(HRockmate(model, sample, budget)) on the whole HRockmate module only "
        "(build HRockmate on the unsharded model, then shard that module)")
