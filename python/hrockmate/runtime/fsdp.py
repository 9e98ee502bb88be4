"""Per-block FSDP2 under one plan: the runtime gathers, reshards and reduces each block.

The layout LLM trainers use (torchtitan's) is ``fully_shard`` on each transformer block and
then on the root. FSDP2 gathers a block's parameters in the block's forward pre-hook, frees
them in its post-hook, gathers them again before the block's backward and reduce-scatters the
block's gradients after it. A plan does not call the blocks' ``forward`` (it runs the traced
ATen ops as straight-line code), so none of those hooks fire. Here the plan drives them:

- a block is the set of parameter slots one FSDP2 parameter group manages; an op uses the
  block whose parameters (or views of them) it reads;
- in the forward segment the block is gathered (``FSDPModule.unshard``) right before the first
  op that uses it and resharded right after the last one (unless the block was sharded with
  ``reshard_after_forward=False``, which keeps it gathered into the backward);
- in the backward segment it is gathered once, before the first op using it there (a
  recomputation of its forward ops or one of its backward ops), and kept gathered until the
  last of them and the last of its gradients are done; then its gradients are handed to the
  unsharded parameters' ``.grad`` and the group's post-backward runs, which reshards and
  reduce-scatters them into the sharded parameters' ``.grad`` exactly as FSDP2 does after a
  block's backward. The root's final callback (queued by the root module's own hooks, which
  do fire: the root is the ``HRockmate`` module) finishes the iteration as usual.

So each block is gathered at most twice per iteration (once per segment), as with per-block
``torch.utils.checkpoint``, however the plan interleaves the block's recomputations.

The layout: build ``HRockmate`` on the unsharded model (tracing needs plain tensors), then
``fully_shard`` each block of the ``HRockmate`` module (its submodules are the model's) and the
``HRockmate`` module itself. The other order is refused by the constructor with an
``UnsupportedLayoutError`` naming this one.

The schedule's memory counts activations only; ``BlockDriver.gathered_bytes`` gives, per
schedule step, the bytes of gathered block parameters the driver holds there, and
``HRockmate.fsdp_gathered_peak_bytes`` the activation timeline plus them at its highest.

FSDP2's post-backward (``FSDPParamGroup.post_backward``) is private API; it and the few other
private attributes read are reached in ``_Group`` only, which raises ``UnsupportedLayoutError``
naming the torch version when they are missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from hrockmate.capture.layout import UnsupportedLayoutError

__all__ = ["BlockDriver", "blocks_of", "driver_for", "is_fsdp_module", "sharded_blocks"]


def _fsdp_types() -> tuple[Any, Any]:
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return (), ()
    return FSDPModule, DTensor


def is_fsdp_module(mod: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``mod``."""
    fsdp_module, _ = _fsdp_types()
    return bool(fsdp_module) and isinstance(mod, fsdp_module)


def sharded_blocks(hmod: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of the wrapped model's submodules that ``fully_shard`` was applied to
    (the model itself included, named "")."""
    fsdp_module, _ = _fsdp_types()
    if not fsdp_module:
        return []
    model = hmod.__dict__["_hr_model"]
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, fsdp_module)]


class _Group:
    """One FSDP2 parameter group of a block, and the private API used on it."""

    def __init__(self, module: nn.Module, group: Any) -> None:
        self.module = module
        self.group = group
        try:
            self.params = list(group.fsdp_params)
            self.post_backward_fn = group.post_backward
            uses_other_mesh = bool(group._use_post_forward_mesh)
            self.reshard_after_forward = bool(group._reshard_after_forward)
            self.unsharded_bytes = sum(int(p._orig_size.numel()) * _elem_size(p)
                                       for p in self.params)
            self.owners = [[(p._module_info.module, p._module_info.param_name)]
                           + list(zip(p._module_info.shared_modules,
                                      p._module_info.shared_param_names))
                           for p in self.params]
        except AttributeError as exc:
            raise UnsupportedLayoutError(
                f"HRockmate: FSDP2's internals changed in torch {torch.__version__} ({exc}); "
                "per-block fully_shard under a plan reads FSDPParamGroup.fsdp_params and "
                "post_backward. Shard the whole HRockmate module instead "
                "(fully_shard(hmod) only), or use the torch version this hrockmate supports"
            ) from exc
        cast = sorted({str(p.param_dtype) for p in self.params
                       if getattr(p, "param_dtype", None) is not None})
        if cast:
            raise UnsupportedLayoutError(
                f"HRockmate: a block is sharded with MixedPrecisionPolicy(param_dtype="
                f"{', '.join(cast)}); the plan was traced with the parameters' own dtype, so its "
                "ops would get parameters of another dtype. Shard the blocks without a "
                "param_dtype, and train under torch.autocast (build HRockmate within the "
                "autocast region) for low-precision compute")
        if uses_other_mesh:
            raise UnsupportedLayoutError(
                "HRockmate: a block sharded with reshard_after_forward=<int> (resharding onto a "
                "smaller mesh after forward) is not supported under a plan; use True or False")

    def unsharded_param(self, i: int) -> torch.Tensor:
        return self.params[i].unsharded_param


def _elem_size(p: Any) -> int:
    dtype = getattr(p, "param_dtype", None) or p.orig_dtype
    return torch.empty((), dtype=dtype).element_size()


def blocks_of(hmod: nn.Module) -> list[_Group]:
    """The FSDP2 parameter groups of the sharded blocks of ``hmod``'s model, in module order;
    raises ``UnsupportedLayoutError`` when the layout cannot run under a plan."""
    fsdp_module, _ = _fsdp_types()
    found = sharded_blocks(hmod)
    if not found:
        return []
    names = [n or "the model itself" for n, _ in found]
    if any(n == "" for n, _ in found):
        raise UnsupportedLayoutError(
            "HRockmate was called: the wrapped model itself was sharded with fully_shard; "
            "shard the HRockmate module instead (fully_shard(hmod)), after sharding its blocks")
    if not isinstance(hmod, fsdp_module):
        raise UnsupportedLayoutError(
            f"HRockmate was called: blocks of the wrapped model are sharded with fully_shard "
            f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) but the HRockmate "
            "module is not. Per-block FSDP2 needs a root: call fully_shard(hmod) after "
            "sharding the blocks (torchtitan's layout), so that FSDP2's root hooks run")
    groups = []
    for _, mod in found:
        state = mod._get_fsdp_state()
        for group in getattr(state, "_fsdp_param_groups", ()):
            groups.append(_Group(mod, group))
    return groups


@dataclass
class _Plan:
    """Where the driver's calls go in one schedule, and what it holds (``BlockDriver``)."""

    slot_group: dict[int, tuple[int, int]]  # parameter slot -> (group, its FSDPParam index)
    tensors_of_slot: dict[int, list[int]]  # parameter slot -> graph tensors standing for it
    gathers_per_iteration: int = 0
    #: per step, the unsharded bytes of the groups gathered there (model of what is held)
    gathered: list[int] = field(default_factory=list)


class BlockDriver:
    """Drives FSDP2's per-block gathers, reshards and gradient reductions from one compiled
    schedule (see the module's docstring); ``program`` is that schedule compiled with the
    driver's calls, its chunks handing only the non-block gradients to autograd."""

    def __init__(self, hmod: nn.Module, groups: list[_Group]) -> None:
        from hrockmate.runtime.compiler import StepHooks, compile_schedule

        self.groups = groups
        traced = hmod.traced
        graph = traced.graph
        schedule = hmod.schedule
        steps = [(str(k), int(i)) for k, i in schedule.steps]
        fwd_len = int(schedule.forward_len)
        slots = hmod._hr_param_slots  # slot -> (owner module, attribute)
        where: dict[tuple[int, str], tuple[int, int]] = {}
        for g, grp in enumerate(groups):
            for i, owners in enumerate(grp.owners):
                for mod, attr in owners:
                    where[(id(mod), attr)] = (g, i)
        slot_group = {j: where[(id(mod), attr)] for j, (mod, attr) in enumerate(slots)
                      if (id(mod), attr) in where}
        tensors_of_slot: dict[int, list[int]] = {}
        group_of_tensor: dict[int, int] = {}
        for tid, (kind, key) in traced.sources.items():
            if kind != "param":
                continue
            j = hmod._hr_param_slot[key]
            if j in slot_group:
                tensors_of_slot.setdefault(j, []).append(int(tid))
                group_of_tensor[int(tid)] = slot_group[j][0]
        self.plan = _Plan(slot_group, tensors_of_slot)

        def groups_read(op: int) -> set[int]:
            return {group_of_tensor[r] for r in (graph.storage_root(t) for t in graph.ops[op].inputs)
                    if r in group_of_tensor}

        uses: list[list[int]] = [[] for _ in groups]  # per group: step positions using it
        for pos, (kind, k) in enumerate(steps):
            if kind == "compute":
                for g in groups_read(k):
                    uses[g].append(pos)
        end = len(steps)
        grad_done: list[int] = [-1] * len(groups)  # per group: the step stashing its last grad
        freed_at = {i: pos for pos, (kind, i) in enumerate(steps) if kind == "free"}
        for name, tid in traced.param_grads.items():
            j = hmod._hr_param_slot.get(name)
            if j in slot_group:
                g = slot_group[j][0]
                grad_done[g] = max(grad_done[g], freed_at.get(int(tid), end))
        hooks = StepHooks(names={"_HR_FSDP": self})
        gathered = [0] * (end + 1)
        count = 0

        def hold(g: int, first: int, last: int) -> None:
            for p in range(first, min(last, end) + 1):
                gathered[p] += groups[g].unsharded_bytes

        for g, grp in enumerate(groups):
            fwd = [p for p in uses[g] if p < fwd_len]
            bwd = [p for p in uses[g] if p >= fwd_len]
            kept = not grp.reshard_after_forward
            if fwd:
                hooks.before.setdefault(fwd[0], []).append(f"_HR_FSDP.gather({g}, E)")
                count += 1
                if not kept:
                    hooks.after.setdefault(fwd[-1], []).append(f"_HR_FSDP.reshard({g})")
                    hold(g, fwd[0], fwd[-1])
            if bwd and (not fwd or not kept):
                hooks.before.setdefault(bwd[0], []).append(f"_HR_FSDP.gather({g}, E)")
                count += 1
            last = max(bwd[-1] if bwd else -1, grad_done[g])
            if last < 0 and fwd and kept:
                last = end  # (gathered in forward, unused after: resharded at the end)
            if last >= 0:
                call = f"_HR_FSDP.post_backward({g}, GP)"
                if last >= end:
                    hooks.end.append(call)
                else:
                    hooks.after.setdefault(last, []).append(call)
                start = fwd[0] if kept and fwd else (bwd[0] if bwd else last)
                hold(g, max(start, fwd_len) if not kept else start, last)
        self.plan.gathers_per_iteration = count
        self.plan.gathered = gathered
        self.gathers = 0  # unshard calls made (all iterations)
        program = compile_schedule(traced, steps, fwd_len, hmod._hr_param_slot,
                                   hmod._hr_buffer_slot, hmod._hr_input_slot, hooks)
        # the block gradients reach FSDP2 through post_backward, not autograd
        program.chunk_params = [[j for j in c if j not in slot_group]
                                for c in program.chunk_params]
        self.program = program

    # ---- the calls the generated code makes ------------------------------------------------
    def gather(self, g: int, E: list[Any]) -> None:
        """Unshard group ``g`` and point the graph's tensors of its parameters at the gathered
        ones (the same objects every time: FSDP2 refills their storage)."""
        grp = self.groups[g]
        if not grp.group.is_unsharded:
            self.gathers += 1
        grp.module.unshard()
        _, dtensor = _fsdp_types()
        for j, (gi, i) in self.plan.slot_group.items():
            if gi != g:
                continue
            p = grp.unsharded_param(i)
            if dtensor and isinstance(p, dtensor):
                raise UnsupportedLayoutError(
                    "HRockmate: a block's gathered parameter is a DTensor (FSDP2 combined with "
                    "tensor parallelism); only data-parallel fully_shard is supported per block")
            for t in self.plan.tensors_of_slot.get(j, ()):
                E[t] = p

    def reshard(self, g: int) -> None:
        self.groups[g].module.reshard()

    def post_backward(self, g: int, GP: list[Any]) -> None:
        """Hand group ``g``'s finished gradients to its unsharded parameters' ``.grad`` and run
        FSDP2's post-backward for it (reshard, reduce-scatter into the sharded ``.grad``)."""
        grp = self.groups[g]
        for j, (gi, i) in self.plan.slot_group.items():
            if gi != g:
                continue
            grad = GP[j]
            GP[j] = None
            if grad is None:
                continue
            p = grp.unsharded_param(i)
            if p.grad is None:
                p.grad = grad
            else:  # (gradient accumulation without reduction: set_requires_gradient_sync)
                p.grad = p.grad + grad
        grp.post_backward_fn()

    # ---- what the driver holds -------------------------------------------------------------
    @property
    def gathers_per_iteration(self) -> int:
        """Gathers one iteration makes (one per block per segment that uses it)."""
        return self.plan.gathers_per_iteration

    def gathered_bytes(self) -> list[int]:
        """Per schedule step (and one more: the end), the bytes of gathered block parameters
        the driver holds there."""
        return list(self.plan.gathered)


def driver_for(hmod: nn.Module) -> BlockDriver | None:
    """The driver of ``hmod``'s per-block FSDP2 layout for the schedule in use, built at the
    first call after the blocks were sharded or the schedule changed; None without sharded
    blocks."""
    held = hmod.__dict__.get("_hr_fsdp_driver")
    program = hmod.__dict__.get("_hr_program")
    if held is not None and held[0] is program:
        return held[1]
    groups = blocks_of(hmod)
    driver = BlockDriver(hmod, groups) if groups else None
    hmod.__dict__["_hr_fsdp_driver"] = (program, driver)
    return driver
