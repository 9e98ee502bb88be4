"""The model layouts hrockmate can trace: a model whose blocks FSDP2 has sharded
(``fully_shard`` on submodules) is refused, because tracing needs plain tensors and would break
the shards' state. Per-block FSDP2 runs when applied after ``HRockmate`` was built
(``hrockmate.runtime.fsdp``; ``hrockmate.runtime.distributed`` has the supported layouts)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch.nn as nn

__all__ = ["UnsupportedLayoutError", "check_layout", "gathered_blocks_traced"]

# set while the runtime traces a model whose sharded blocks it has gathered itself (FSDP2's
# hooks set aside: ``hrockmate.runtime.fsdp.as_run_under_policies``)
_BLOCKS_GATHERED = contextvars.ContextVar("hrockmate_blocks_gathered", default=False)


@contextlib.contextmanager
def gathered_blocks_traced() -> Iterator[None]:
    """Within: ``check_layout`` lets FSDP2-sharded submodules through (their DTensor
    parameters are still refused), for the runtime's trace of a model whose blocks it
    gathered and whose FSDP2 hooks it set aside."""
    token = _BLOCKS_GATHERED.set(True)
    try:
        yield
    finally:
        _BLOCKS_GATHERED.reset(token)


class UnsupportedLayoutError(RuntimeError):
    """The model is sharded in a way HRockmate does not trace or run; the message names the
    layouts that work."""


def _sharded_parts(model: nn.Module, with_tensors: bool) -> list[str]:
    """Names of the model's submodules that FSDP2's fully_shard was applied to, and (with
    ``with_tensors``) of its DTensor parameters."""
    found: list[str] = []
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        FSDPModule = ()  # type: ignore[assignment,misc]
    if FSDPModule and not _BLOCKS_GATHERED.get():
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
    parameters."""
    parts = _sharded_parts(model, with_tensors)
    if not parts:
        return
    shown = ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")
    raise UnsupportedLayoutError(
        f"{when}: the wrapped model is sharded per block with FSDP2's fully_shard "
        f"({shown}). Tracing needs the unsharded parameters, so build HRockmate first and "
        "shard afterwards: hmod = HRockmate(model, sample, budget); fully_shard(block) for "
        "each block of hmod (its submodules are the model's), then fully_shard(hmod); the "
        "plan then gathers, reshards and reduces the blocks itself (hrockmate.runtime.fsdp). "
        "Also supported: DistributedDataParallel(HRockmate(model, sample, budget)) and "
        "fully_shard(HRockmate(model, sample, budget)) on the whole module. A module with "
        "sharded blocks is not traced again (another input shape, a changed model): call it "
        "with the traced shapes")
