"""HRockmate under ``torch.distributed``: one plan for every rank, and the layouts it supports.

Every rank traces and plans its own replica. Plans come from a solver with time limits and
measured op times, so two ranks may choose different plans for the same graph: harmless while
plans hold no collectives, a deadlock once they do. So, when a default process group is
initialized with more than one rank, the constructor ends with ``agree_on_plan``: rank 0
broadcasts its plan (``broadcast_object_list``) and every other rank runs it (the graphs must
be the same: ranks build the same model for the same sample shapes). This makes the
constructor a collective call: every rank of the group must build the module. Inside
``planning_per_rank()`` the constructor skips the exchange (a module only some ranks build,
for evaluation say). Plans made again inside a training call (a changed model, another path
of the inputs' values) are not exchanged, since ranks may make them at different calls;
call ``agree_on_plan(hmod)`` on every rank afterwards to align them.

Supported layouts: ``DistributedDataParallel(HRockmate(model, ...))`` and FSDP2's
``fully_shard`` on the whole ``HRockmate`` module. ``fully_shard`` on submodules of the
wrapped model (per-block FSDP2), before or after wrapping, is refused with
``UnsupportedLayoutError``: the plan runs the whole model as one program that reads the
parameters directly, so the blocks' hooks, which gather their sharded parameters, never run.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Iterator

import torch.nn as nn

if TYPE_CHECKING:  # pragma: no cover
    from hrockmate.runtime.module import HRockmate

__all__ = ["UnsupportedLayoutError", "agree_on_plan", "check_layout", "planning_per_rank"]


class UnsupportedLayoutError(RuntimeError):
    """The model is sharded in a way HRockmate does not run (per-block FSDP2)."""


_local = threading.local()


@contextlib.contextmanager
def planning_per_rank() -> Iterator[None]:
    """Within it, ``HRockmate(...)`` keeps its own rank's plan (no exchange with rank 0)."""
    before = getattr(_local, "per_rank", False)
    _local.per_rank = True
    try:
        yield
    finally:
        _local.per_rank = before


def _group_size() -> int:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def agree_on_plan(hmod: "HRockmate") -> bool:
    """Make every rank of the default process group run rank 0's plan; a collective call (every
    rank must make it). Returns whether this rank's plan was replaced. Does nothing with one
    rank, without a process group, or for a module built with a fixed ``plan=``."""
    import torch.distributed as dist

    if _group_size() <= 1 or hmod._hr_request.plan is not None:
        return False
    schedule = hmod.schedule
    mine = (list(schedule.steps), int(schedule.forward_len))
    box: list[Any] = [(mine, hmod.plan) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    theirs, plan = box[0]
    if theirs == mine:
        return False
    from hrockmate.ir.plan import PlanError

    try:
        hmod.use_plan(plan)
    except PlanError as exc:
        raise UnsupportedLayoutError(
            f"HRockmate: rank {dist.get_rank()} traced another graph than rank 0 ({exc}); every "
            "rank must wrap the same model with samples of the same shapes, so that all run "
            "one plan. Build the module inside hrockmate.runtime.distributed."
            "planning_per_rank() to keep per-rank plans") from exc
    return True


def should_agree() -> bool:
    """Whether the constructor exchanges plans (see the module's docstring)."""
    return not getattr(_local, "per_rank", False) and _group_size() > 1


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


def first_call_check(hmod: "HRockmate") -> None:
    """The layout check at a module's first training call (FSDP2 may shard blocks after the
    module was built)."""
    if hmod.__dict__.get("_hr_layout_checked"):
        return
    check_layout(hmod.__dict__["_hr_model"], "HRockmate was called", with_tensors=True)
    hmod.__dict__["_hr_layout_checked"] = True

