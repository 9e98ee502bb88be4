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

Supported layouts: ``DistributedDataParallel(HRockmate(model, ...))``, FSDP2's
``fully_shard`` on the whole ``HRockmate`` module, and per-block FSDP2 applied after wrapping:
``fully_shard`` on each block of the ``HRockmate`` module, then on the module itself (the plan
drives the blocks' gathers, reshards and reductions: ``hrockmate.runtime.fsdp``). Blocks
sharded before wrapping are refused with ``UnsupportedLayoutError`` naming that order (tracing
needs the unsharded parameters), and so are sharded blocks without ``fully_shard`` on the
``HRockmate`` module (FSDP2's root hooks start and finish each iteration).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch.nn as nn

from hrockmate.capture.layout import UnsupportedLayoutError, check_layout


__all__ = ["UnsupportedLayoutError", "agree_on_plan", "check_layout", "planning_per_rank"]


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


def agree_on_plan(hmod: nn.Module) -> bool:
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

