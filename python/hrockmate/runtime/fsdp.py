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
``torch.utils.checkpoint``, however the plan interleaves the block's recomputations;
``set_extra_gathers`` allows more where they lower the modelled peak. ``set_prefetch``
issues each gather ahead (asynchronously, where the block gathered before it in that segment
is gathered) and waits for it before the block's first op.

The plan knows the gathered blocks: ``place`` gives, for any schedule, where the driver's
calls go and the gathered bytes it holds at each step, and ``plan_with_blocks`` (made by the
first training call for a module the solver planned for a budget) plans again with what the
gathered blocks add beyond the largest one counted as the runtime's extra bytes of each
schedule tried (``gathered_excess_bytes``), which planning fits into the budget.

The layout: build ``HRockmate`` on the unsharded model (tracing needs plain tensors), then
``fully_shard`` each block of the ``HRockmate`` module (its submodules are the model's) and the
``HRockmate`` module itself. The other order is refused by the constructor with an
``UnsupportedLayoutError`` naming this one.

The schedule's simulated memory counts activations only; ``BlockDriver.gathered_bytes`` gives,
per schedule step, the bytes of gathered block parameters the driver holds there, and
``BlockDriver.peak_with_gathered_bytes`` the activation timeline plus them at its highest.
``fit_step_budget`` plans for a budget of the whole step (parameters, gradients, gathered
blocks and activations).

A ``MixedPrecisionPolicy`` that changes the ops the plan runs (``policy_changes_graph``: a
``param_dtype``, a block's ``output_dtype``) has the module traced and planned again at its
first training call, as plain per-block FSDP2 runs it (``as_run_under_policies``): the graph's
dtypes and sizes are then those that run, and FSDP2's post-backward reduces the gradients,
which come out in ``param_dtype``, in its ``reduce_dtype``.

FSDP2's post-backward (``FSDPParamGroup.post_backward``) is private API; it and the few other
private attributes read are reached in ``_Group`` only, which raises ``UnsupportedLayoutError``
naming the torch version when they are missing.
"""

from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.nn as nn

from hrockmate.capture.layout import UnsupportedLayoutError, check_layout

__all__ = ["as_run_under_policies", "BlockDriver", "blocks_of", "driver_for", "fit_step_budget",
           "gathered_excess_bytes", "is_fsdp_module", "place", "plan_with_blocks",
           "policy_changes_graph", "set_extra_gathers", "set_prefetch", "sharded_blocks",
           "StepBudgetError", "StepFit"]


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
            # (gradients left in the dtype the ops made, as FSDP2's pre-backward does:
            # torch versions whose gradients follow the parameters' grad_dtype have it)
            self.defer_upcast = getattr(group, "_set_unsharded_grad_dtypes", None)
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
        if uses_other_mesh:
            raise UnsupportedLayoutError(
                "HRockmate: a block sharded with reshard_after_forward=<int> (resharding onto a "
                "smaller mesh after forward) is not supported under a plan; use True or False")

    def unsharded_param(self, i: int) -> torch.Tensor:
        return self.params[i].unsharded_param

    def is_unsharded(self) -> bool:
        return bool(self.group.is_unsharded)


def _gathered_dtype(p: Any) -> torch.dtype | None:
    """The dtype an FSDPParam is gathered in when its policy casts it, else None (FSDP2 sets
    ``param_dtype`` at its lazy initialisation, the root's first forward; before, it is read
    from the parameter's own policy, as that initialisation does)."""
    if hasattr(p, "param_dtype"):
        return p.param_dtype
    policy = getattr(p, "mp_policy", None)
    want = getattr(policy, "param_dtype", None)
    orig = p.sharded_param.dtype
    return want if want is not None and want != orig and orig.is_floating_point else None


def _elem_size(p: Any) -> int:
    """Bytes per element of an FSDPParam's gathered parameter."""
    dtype = _gathered_dtype(p) or p.sharded_param.dtype
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
    return [_Group(mod, group) for _, mod in found for group in _param_groups(mod)]


def _param_groups(mod: nn.Module) -> list[Any]:
    """FSDP2's parameter groups of the FSDP module ``mod`` (private state)."""
    try:
        return list(mod._get_fsdp_state()._fsdp_param_groups)
    except AttributeError as exc:
        raise UnsupportedLayoutError(
            f"HRockmate: FSDP2's internals changed in torch {torch.__version__} ({exc}); "
            "per-block fully_shard under a plan reads each FSDP module's parameter "
            "groups. Shard the whole HRockmate module instead (fully_shard(hmod) only)"
        ) from exc


def _policy(mod: nn.Module) -> Any:
    """The ``MixedPrecisionPolicy`` ``fully_shard`` was given for ``mod`` (None: unknown)."""
    try:
        return mod._get_fsdp_state()._mp_policy
    except AttributeError:
        return None


def policy_changes_graph(hmod: nn.Module) -> list[str]:
    """What the ``MixedPrecisionPolicy`` of ``hmod``'s per-block layout changes in the ops
    the plan runs, in words (empty: nothing): a ``param_dtype`` gathers parameters (of the
    root's group or a block's) in another dtype than the traced one, and a block's
    ``output_dtype`` casts its outputs. (The root's input and output casts are made by its
    own hooks, around the plan.)"""
    fsdp_module, _ = _fsdp_types()
    if not fsdp_module or not isinstance(hmod, fsdp_module):
        return []
    found: list[str] = []
    for name, mod in [("the HRockmate module", hmod)] + sharded_blocks(hmod):
        dtypes = {_gathered_dtype(p) for grp in _param_groups(mod) for p in grp.fsdp_params}
        cast = sorted(str(d) for d in dtypes if d is not None)
        if cast:
            found.append(f"{name or 'the model'} gathers its parameters in {', '.join(cast)}")
        policy = _policy(mod)
        if mod is not hmod and policy is not None and policy.output_dtype is not None:
            found.append(f"{name} casts its outputs to {policy.output_dtype}")
    return found


def _cast_floats(dtype: torch.dtype, tree: Any) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype``, as FSDP2 casts a module's
    inputs and outputs."""
    import torch.utils._pytree as pytree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    try:  # (FSDP2's own walk: it also reaches into dataclasses such as ModelOutput)
        from torch.distributed.utils import _apply_to_tensors
    except ImportError:  # pragma: no cover - depends on the torch version
        return pytree.tree_map(cast, tree)
    return _apply_to_tensors(cast, tree)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _is_fsdp_hook(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "") or "").startswith("torch.distributed.fsdp")


@contextlib.contextmanager
def as_run_under_policies(hmod: nn.Module) -> Iterator[None]:
    """Within: the wrapped model is the model plain per-block FSDP2 runs under its
    ``MixedPrecisionPolicy``, as a plain module to trace (and to measure op times on): every
    block gathered (``FSDPModule.unshard``: in ``param_dtype``), its FSDP2 forward hooks set
    aside and in their place the casts they make (floating-point inputs to ``param_dtype``
    with ``cast_forward_inputs``, outputs to ``output_dtype``); the root is gathered already
    (this runs within its forward). Afterwards the blocks are resharded and their hooks back.
    A collective (every block is all-gathered once): every rank enters it."""
    from hrockmate.capture.layout import gathered_blocks_traced

    modules = [mod for _, mod in sharded_blocks(hmod)]
    saved: list[tuple[nn.Module, list[dict[Any, Any]]]] = []
    handles: list[Any] = []
    try:
        for mod in modules:
            mod.unshard()
        for mod in modules:
            dicts = [getattr(mod, name) for name in _HOOK_DICTS]
            saved.append((mod, [dict(d) for d in dicts]))
            for name in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = getattr(mod, name)
                for key in [k for k, fn in hooks.items() if _is_fsdp_hook(fn)]:
                    del hooks[key]
                    for d in dicts:
                        if d is not hooks:
                            d.pop(key, None)
            policy = _policy(mod)
            if policy is None:
                continue
            if policy.cast_forward_inputs and policy.param_dtype is not None:
                dtype = policy.param_dtype

                def cast_inputs(_m: nn.Module, args: Any, kwargs: Any,
                                dtype: torch.dtype = dtype) -> Any:
                    return _cast_floats(dtype, args), _cast_floats(dtype, kwargs)

                handles.append(mod.register_forward_pre_hook(cast_inputs, prepend=True,
                                                             with_kwargs=True))
            if policy.output_dtype is not None:
                out_dtype = policy.output_dtype

                def cast_outputs(_m: nn.Module, _args: Any, out: Any,
                                 dtype: torch.dtype = out_dtype) -> Any:
                    return _cast_floats(dtype, out)

                handles.append(mod.register_forward_hook(cast_outputs))
        with gathered_blocks_traced():
            yield
    finally:
        for handle in handles:
            handle.remove()
        for mod, dicts in saved:
            for name, content in zip(_HOOK_DICTS, dicts):
                d = getattr(mod, name)
                d.clear()
                d.update(content)
        for mod in modules:
            for p in mod.parameters():  # (the unsharded ones: what tracing left behind)
                p.grad = None
            mod.reshard()


@dataclass
class _Plan:
    """Where the driver's calls go in one schedule, and what it holds (``BlockDriver``)."""

    slot_group: dict[int, tuple[int, int]]  # parameter slot -> (group, its FSDPParam index)
    tensors_of_slot: dict[int, list[int]]  # parameter slot -> graph tensors standing for it
    gathers_per_iteration: int = 0
    peak_with_gathered: int = 0
    #: per step, the unsharded bytes of the groups gathered there (model of what is held)
    gathered: list[int] = field(default_factory=list)


def _slots(hmod: nn.Module, groups: list[_Group]
           ) -> tuple[dict[int, tuple[int, int]], dict[int, list[int]], dict[int, int]]:
    """(parameter slot -> (group, FSDPParam index), slot -> graph tensors standing for it,
    graph tensor -> group) of ``hmod``'s traced graph."""
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
    for tid, (kind, key) in hmod.traced.sources.items():
        if kind != "param":
            continue
        j = hmod._hr_param_slot[key]
        if j in slot_group:
            tensors_of_slot.setdefault(j, []).append(int(tid))
            group_of_tensor[int(tid)] = slot_group[j][0]
    return slot_group, tensors_of_slot, group_of_tensor


@dataclass
class _Placement:
    """Where one schedule's gathers, reshards and post-backwards go (``place``)."""

    #: per group, the step ranges it is gathered over ((first, last), both included; last ==
    #: the number of steps: the end of the backward)
    held: list[list[tuple[int, int]]]
    post_at: list[int]  # per group: the step its post-backward follows (-1: none)
    gathered: list[int]  # per step (and the end), the unsharded bytes of the groups held
    timeline: list[int]  # per step (and the end), the schedule's simulated memory
    #: (group, its range) -> the step before which that range's gather is issued ahead of its
    #: first use (where the group gathered before it in that segment is), and that use
    prefetch_at: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)

    @property
    def peak_with_gathered(self) -> int:
        return max(a + b for a, b in zip(self.timeline, self.gathered))


def place(hmod: nn.Module, groups: list[_Group], steps: list[tuple[str, int]], fwd_len: int,
          extra_gathers: int = 0, prefetch: bool = False) -> _Placement:
    """The driver's gathers for a schedule of ``hmod``'s graph and the memory they hold (see
    the module's docstring); ``prefetch``: each group's gather is issued when the group used
    before it in that segment is gathered, as FSDP2's forward and backward prefetch do, and
    it is held from there."""
    graph = hmod.traced.graph
    slot_group, _, group_of_tensor = _slots(hmod, groups)

    def groups_read(op: int) -> set[int]:
        roots = (graph.storage_root(t) for t in graph.ops[op].inputs)
        return {group_of_tensor[r] for r in roots if r in group_of_tensor}

    uses: list[list[int]] = [[] for _ in groups]  # per group: step positions using it
    for pos, (kind, k) in enumerate(steps):
        if kind == "compute":
            for g in groups_read(k):
                uses[g].append(pos)
    end = len(steps)
    grad_done: list[int] = [-1] * len(groups)  # per group: the step stashing its last grad
    freed_at = {i: pos for pos, (kind, i) in enumerate(steps) if kind == "free"}
    for name, tid in hmod.traced.param_grads.items():
        j = hmod._hr_param_slot.get(name)
        if j in slot_group:
            g = slot_group[j][0]
            grad_done[g] = max(grad_done[g], freed_at.get(int(tid), end))
    from hrockmate.ir.schedule import Schedule, simulate

    timeline = [int(x) for x in simulate(graph, Schedule(steps, fwd_len)).timeline]
    timeline += [0] * (end + 1 - len(timeline))
    # the backward's idle stretches between the clusters of a group's uses there (other
    # groups' ops in between) that one more gather could free
    held: list[list[tuple[int, int]]] = []
    idle: list[list[tuple[int, int]]] = []
    post_at: list[int] = []
    for g, grp in enumerate(groups):
        fwd = [p for p in uses[g] if p < fwd_len]
        bwd = [p for p in uses[g] if p >= fwd_len]
        # kept gathered from the forward into the backward (reshard_after_forward=False)
        kept = bool(fwd) and not grp.reshard_after_forward
        last = max(bwd[-1] if bwd else -1, grad_done[g])
        if last < 0 and kept:
            last = end  # (gathered in forward, unused after: resharded at the end)
        post_at.append(last)
        ranges = []
        if fwd and not kept:
            ranges.append((fwd[0], fwd[-1]))
        if kept:
            ranges.append((fwd[0], last))
        elif bwd:
            ranges.append((bwd[0], last))
        held.append(ranges)
        gaps = []
        if bwd and not kept:
            others = sorted(p for h in range(len(groups)) if h != g for p in uses[h]
                            if bwd[0] < p < bwd[-1])
            for a, b in zip(bwd, bwd[1:]):
                i = bisect.bisect_right(others, a)
                if i < len(others) and others[i] < b:
                    gaps.append((a, b))
        idle.append(gaps)

    def gathered_at() -> list[int]:
        out = [0] * (end + 1)
        for g, ranges in enumerate(held):
            for first, last in ranges:
                for p in range(first, last + 1):
                    out[p] += groups[g].unsharded_bytes
        return out

    gathered = gathered_at()
    # One more gather per idle stretch that holds the step of the highest memory
    # (activations and gathered blocks), the largest group first, at most extra_gathers.
    for _ in range(max(0, int(extra_gathers))):
        total = [a + b for a, b in zip(timeline, gathered)]
        top = max(range(end + 1), key=total.__getitem__)
        choice = max(((groups[g].unsharded_bytes, g, gap) for g, gaps in enumerate(idle)
                      for gap in gaps if gap[0] < top < gap[1]), default=None)
        if choice is None:
            break
        _, g, (a, b) = choice
        idle[g].remove((a, b))
        ranges = held[g]
        k = next(i for i, (f, l) in enumerate(ranges) if f <= a and b <= l)
        f, l = ranges[k]
        ranges[k:k + 1] = [(f, a), (b, l)]
        gathered = gathered_at()
    prefetch_at: dict[tuple[int, int], int] = {}
    if prefetch:
        # Per segment, the gathers in the order they are made: each is issued when the one
        # before it is made (and is held from there), so its all-gather runs while the
        # previous group computes.
        for lo, hi in ((0, fwd_len), (fwd_len, end + 1)):
            starts = sorted((first, g, k) for g, ranges in enumerate(held)
                            for k, (first, _) in enumerate(ranges) if lo <= first < hi)
            for (before, _, _), (first, g, k) in zip(starts, starts[1:]):
                if before < first:
                    prefetch_at[(g, k)] = (before, first)
                    held[g][k] = (before, held[g][k][1])
        gathered = gathered_at()
    return _Placement(held, post_at, gathered, timeline, prefetch_at)


class BlockDriver:
    """Drives FSDP2's per-block gathers, reshards and gradient reductions from one compiled
    schedule (see the module's docstring); ``program`` is that schedule compiled with the
    driver's calls, its chunks handing only the non-block gradients to autograd."""

    def __init__(self, hmod: nn.Module, groups: list[_Group], extra_gathers: int = 0,
                 prefetch: bool = False) -> None:
        from hrockmate.runtime.compiler import StepHooks, compile_schedule

        self.groups = groups
        traced = hmod.traced
        schedule = hmod.schedule
        steps = [(str(k), int(i)) for k, i in schedule.steps]
        fwd_len = int(schedule.forward_len)
        end = len(steps)
        slot_group, tensors_of_slot, _ = _slots(hmod, groups)
        self.plan = _Plan(slot_group, tensors_of_slot)
        placed = place(hmod, groups, steps, fwd_len, extra_gathers, prefetch)
        self.placement = placed  # (where the calls go and what they hold)
        held, post_at, gathered = placed.held, placed.post_at, placed.gathered
        hooks = StepHooks(names={"_HR_FSDP": self})
        count = 0
        for g, ranges in enumerate(held):
            for k, (first, last) in enumerate(ranges):
                # (a prefetched range is held from where its gather is issued; the gather is
                # waited for and installed before the first use)
                use = placed.prefetch_at.get((g, k), (first, first))[1]
                hooks.before.setdefault(use, []).append(f"_HR_FSDP.gather({g}, E)")
                count += 1
                if last != post_at[g]:
                    hooks.after.setdefault(last, []).append(f"_HR_FSDP.reshard({g})")
            last = post_at[g]
            if last < 0:
                continue  # (no backward use, no gradient: FSDP2's final callback is enough)
            call = f"_HR_FSDP.post_backward({g}, GP)"
            if last >= end:
                hooks.end.append(call)
            else:
                hooks.after.setdefault(last, []).append(call)
        # issued after the gathers made at the same step (the block computing first)
        for (g, _), (ahead, _) in sorted(placed.prefetch_at.items(), key=lambda kv: kv[1]):
            hooks.before.setdefault(ahead, []).append(f"_HR_FSDP.prefetch({g})")
        self.plan.gathers_per_iteration = count
        self.plan.gathered = gathered
        self.plan.peak_with_gathered = placed.peak_with_gathered
        self.gathers = 0  # all-gathers issued (all iterations)
        self.pending: dict[int, Any] = {}  # group -> the handle of its prefetched all-gather
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
        pending = self.pending.pop(g, None)
        if pending is not None:
            pending.wait()  # (issued by ``prefetch``, counted there)
        elif not grp.is_unsharded():
            self.gathers += 1
        grp.module.unshard()  # (a no-op where it is gathered already)
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

    def prefetch(self, g: int) -> None:
        """Issue group ``g``'s all-gather without waiting for it (``gather`` waits)."""
        grp = self.groups[g]
        if grp.is_unsharded() or g in self.pending:
            return
        self.gathers += 1
        self.pending[g] = grp.module.unshard(async_op=True)

    def reshard(self, g: int) -> None:
        self.groups[g].module.reshard()

    def post_backward(self, g: int, GP: list[Any]) -> None:
        """Hand group ``g``'s finished gradients to its unsharded parameters' ``.grad`` and run
        FSDP2's post-backward for it (reshard, reduce-scatter into the sharded ``.grad``)."""
        grp = self.groups[g]
        if grp.defer_upcast is not None:
            # a gathered parameter in param_dtype takes a gradient of that dtype (its
            # grad_dtype is the sharded parameter's until FSDP2's pre-backward lifts it; the
            # reduce-scatter casts to reduce_dtype)
            grp.defer_upcast(defer_upcast=True)
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

    @property
    def peak_with_gathered_bytes(self) -> int:
        """The schedule's simulated memory (the activations the budget bounds) plus the
        gathered block parameters held at each step, at its highest: what the plan holds
        beyond the sharded parameters and gradients, the root group's gathered parameters and
        the runtime's extra bytes (``Program.extra_bytes``)."""
        return self.plan.peak_with_gathered


def driver_for(hmod: nn.Module) -> BlockDriver | None:
    """The driver of ``hmod``'s per-block FSDP2 layout for the schedule in use, built at the
    first call after the blocks were sharded, the schedule changed, ``set_extra_gathers`` or
    ``set_prefetch``; None without sharded blocks. At the first call with sharded blocks of a
    module planned by the solver for a budget, the module is planned again with the gathered
    blocks charged (``plan_with_blocks``): a collective call then, as every rank's first
    training call is."""
    held = hmod.__dict__.get("_hr_fsdp_driver")
    program = hmod.__dict__.get("_hr_program")
    if held is not None and held[0] is program:
        return held[1]
    groups = blocks_of(hmod)
    if groups and hmod.__dict__.get("_hr_inductor"):
        # the driver's hooks are lines of the eager program; compiled pieces have no place
        # for an all-gather between two of their ops
        raise UnsupportedLayoutError(
            "per-block FSDP2 runs the plan's eager program: build the HRockmate module with "
            "compile=False (the default) before sharding its blocks")
    if groups and _planned_without_blocks(hmod):
        plan_with_blocks(hmod, groups=groups, strict=False)
        program = hmod.__dict__.get("_hr_program")
    extra, prefetch = _settings(hmod)
    driver = BlockDriver(hmod, groups, extra, prefetch) if groups else None
    hmod.__dict__["_hr_fsdp_driver"] = (program, driver)
    return driver


def _settings(hmod: nn.Module) -> tuple[int, bool]:
    return (int(hmod.__dict__.get("_hr_fsdp_extra_gathers", 0)),
            bool(hmod.__dict__.get("_hr_fsdp_prefetch", False)))


def set_extra_gathers(hmod: nn.Module, extra: int) -> None:
    """Let the driver gather blocks up to ``extra`` more times per iteration than once per
    segment, to lower the step's peak: a plan that recomputes a block's op long before the
    block's backward would otherwise hold the block gathered from there on. Each extra gather
    frees a block over an idle stretch of its backward uses that holds the modelled peak
    (activations plus gathered blocks). 0 (the default): at most two gathers per block and
    iteration, as per-block ``torch.utils.checkpoint``. Set it to the same value on every rank
    (the collectives must match)."""
    hmod.__dict__["_hr_fsdp_extra_gathers"] = int(extra)
    hmod.__dict__.pop("_hr_fsdp_driver", None)


def set_prefetch(hmod: nn.Module, on: bool = True) -> None:
    """Issue each block's all-gather ahead, when the block gathered before it in that segment
    (forward or backward) is gathered, as FSDP2's forward and backward prefetch do, so that
    the all-gather runs while that block computes; the block is waited for before its first
    op. The all-gathers are the same ones, earlier: two blocks are gathered at once where one
    was, which the modelled memory (``BlockDriver.gathered_bytes``, and the charge of
    ``plan_with_blocks``) counts. Set it to the same value on every rank, before the first
    call (or call ``plan_with_blocks`` again after: the plan was charged without it)."""
    hmod.__dict__["_hr_fsdp_prefetch"] = bool(on)
    hmod.__dict__.pop("_hr_fsdp_driver", None)


def _planned_without_blocks(hmod: nn.Module) -> bool:
    """Whether the plan in use was solved for a budget with the gathered blocks not charged
    (a fixed plan, store-all or a given schedule is run as it is)."""
    request = hmod._hr_request
    plan = hmod.__dict__.get("_hr_plan")
    return (request.budget is not None and request.plan is None and plan is not None
            and plan.method not in ("store-all", "given", "")
            and "_hr_fsdp_charged" not in hmod.__dict__
            and hmod.traced.graph.meta.get("cost_report", {}).get("mode") == "measure")


def gathered_excess_bytes(hmod: nn.Module, steps: Any, forward_len: int) -> int:
    """What the gathered blocks add to a schedule's simulated peak once charged
    (``plan_with_blocks``): the highest of its memory plus, at each step, the gathered blocks
    beyond the largest one, less its highest memory alone; 0 for a module not charged. One
    block is not charged: every op of a block runs with that block gathered, under plain
    per-block FSDP2 as under any plan, and the budget (a fraction of the unsharded model's
    activation peak) never counted parameters; what a plan holds beyond that (a block kept
    gathered from an early recomputation to its backward, a prefetched one) is what it
    trades against activations. The module's compile step adds this to the program's
    ``extra_bytes``, the bytes planning adds to a schedule's peak before comparing it with
    the budget (``hrockmate.planning.entry``), so the rounds that fit a plan count them."""
    groups = hmod.__dict__.get("_hr_fsdp_charged")
    if not groups:
        return 0
    extra, prefetch = _settings(hmod)
    placed = place(hmod, groups, [(str(k), int(i)) for k, i in steps], int(forward_len),
                   extra, prefetch)
    free = max(grp.unsharded_bytes for grp in groups)
    top = max(a + max(0, b - free) for a, b in zip(placed.timeline, placed.gathered))
    return top - max(placed.timeline)


def _everyone(ok: bool) -> bool:
    """Whether every rank's ``ok`` holds (so that all leave a loop together)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return ok
    box = torch.tensor([0 if ok else 1], dtype=torch.int64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return int(box.item()) == 0


def plan_with_blocks(hmod: nn.Module, budget: Any = None, *, groups: list[_Group] | None = None,
                     strict: bool = True) -> Any:
    """Plan ``hmod`` (its blocks and itself sharded with ``fully_shard``) again for ``budget``
    (None: the budget it was built for) with the gathered blocks charged: the schedule's
    memory plus the unsharded bytes of the blocks the driver holds gathered at each step,
    beyond the largest block (``gathered_excess_bytes``), must fit the budget, so a plan that recomputes a block's op outside the block's own use (where
    the block is not gathered anyway) pays for holding the block from there, and one placed
    where the block is gathered pays nothing. The charge stays: later ``replan`` calls count
    the gathered blocks too. The first training call does this by itself for a module the
    solver planned for a budget. A collective call (every rank makes it; every rank runs rank
    0's plan after). Where no plan fits: raises ``StepBudgetError`` (``strict``) or keeps the
    plan in use and logs a warning. Returns the ``Plan`` in use."""
    import logging

    from hrockmate.ir.errors import InfeasibleBudget
    from hrockmate.runtime.distributed import agree_on_plan

    groups = blocks_of(hmod) if groups is None else groups
    if not groups:
        raise UnsupportedLayoutError(
            "plan_with_blocks: no block of the HRockmate module is sharded; call fully_shard "
            "on each block, then on the HRockmate module, first")
    _check_policies_followed(hmod, "plan_with_blocks")
    if hmod.traced.graph.meta.get("cost_report", {}).get("mode") != "measure":
        raise StepBudgetError(
            "plan_with_blocks: the module's op times were not measured (it was built for "
            "store-all or with a fixed plan=), and measuring them now would run the ops on "
            "sharded parameters; build HRockmate with a budget (budget=0.5, say) before "
            "sharding")
    hmod.__dict__["_hr_fsdp_charged"] = groups
    hmod.__dict__.pop("_hr_fsdp_driver", None)
    budget = hmod._hr_request.budget if budget is None else budget
    failed: InfeasibleBudget | None = None
    try:
        hmod.replan(budget)
    except InfeasibleBudget as exc:
        failed = exc
    if not _everyone(failed is None):
        why = str(failed) if failed is not None else "another rank found none"
        if strict:
            raise StepBudgetError(
                f"plan_with_blocks: no plan fits the budget with the gathered blocks charged on "
                f"every rank ({why}); raise the budget or shard over more ranks")
        logging.getLogger("hrockmate").warning(
            "HRockmate: no plan fits the budget with the gathered blocks charged on every "
            "rank (%s); running the plan made without them, whose gathered blocks come on top "
            "of the budget. Raise the budget, or call "
            "hrockmate.runtime.fsdp.plan_with_blocks(hmod, budget) on every rank", why)
    agree_on_plan(hmod)
    hmod.__dict__.pop("_hr_fsdp_driver", None)
    return hmod.plan


def _check_policies_followed(hmod: nn.Module, what: str) -> None:
    """Raise ``UnsupportedLayoutError`` where a ``MixedPrecisionPolicy`` changes the ops the
    plan runs and the module was not traced again as it runs them yet."""
    changes = policy_changes_graph(hmod)
    if changes and "_hr_fsdp_policies" not in hmod.__dict__:
        raise UnsupportedLayoutError(
            f"{what}: under FSDP2's MixedPrecisionPolicy {', '.join(changes)}, and the "
            "module's graph is still the one traced with the parameters' own dtypes, so its "
            "plans would be costed for ops that do not run. Its first training call traces "
            "and plans it as the policy runs it: make one training call (forward and "
            f"backward) first, then call {what}")


class StepBudgetError(ValueError):
    """No plan fits the budget with the step's other parts counted (``fit_step_budget``: the
    whole step; ``plan_with_blocks``: the gathered blocks); the message says what they are."""


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel()) * local.element_size()


@dataclass
class StepFit:
    """What ``fit_step_budget`` planned for: the bytes of the step's parts (this rank's
    sharded parameters and gradients, the root group's gathered parameters and its
    reduce-scatter input; FSDP2's buffers and the runtime's extra bytes) and the activation budget
    the plan was made for; ``step_bytes`` is their modelled sum with the plan's activation and
    gathered-block peak, at most the budget."""

    step_budget: int
    activation_budget: int
    resident_bytes: int
    peak_with_gathered_bytes: int
    extra_bytes: int
    rounds: int

    @property
    def step_bytes(self) -> int:
        return self.resident_bytes + self.peak_with_gathered_bytes + self.extra_bytes


def fit_step_budget(hmod: nn.Module, step_budget: int, rounds: int = 4) -> StepFit:
    """Plan ``hmod`` (its blocks and itself already sharded with ``fully_shard``) so that the
    whole step fits ``step_budget`` bytes: this rank's sharded parameters and gradients, the
    root group's gathered parameters (held for the whole step) and reduce-scatter input, the
    gathered blocks the plan holds at each step, the activations, and FSDP2's buffers at a
    block boundary (a block's flat all-gather output, two blocks' reduce-scatter inputs).
    The plans charge the gathered blocks (``plan_with_blocks``); the activation budget starts
    at what is left after the parts held all step and one gathered block, and is lowered by the excess of the modelled step until it fits, at most
    ``rounds`` plans. A collective call: every rank makes it, the smallest ``step_budget``
    of the ranks is planned for, and every rank runs rank 0's plan
    (``distributed.agree_on_plan``). The op times must have been measured before the blocks
    were sharded (measuring runs the ops on the parameters): build ``HRockmate`` with a
    budget below store-all. Raises ``StepBudgetError`` when no plan fits."""
    import torch.distributed as dist

    from hrockmate.ir.errors import InfeasibleBudget
    from hrockmate.runtime.distributed import agree_on_plan

    grouped = dist.is_available() and dist.is_initialized()

    if hmod.traced.graph.meta.get("cost_report", {}).get("mode") != "measure":
        raise StepBudgetError(
            "fit_step_budget: the module's op times were not measured (it was built for "
            "store-all or with a fixed plan=), and measuring them now would run the ops on "
            "sharded parameters; build HRockmate with a budget (budget=0.5, say) before "
            "sharding, then fit the step budget")
    groups = blocks_of(hmod)
    if not groups:
        raise UnsupportedLayoutError(
            "fit_step_budget: no block of the HRockmate module is sharded; call fully_shard "
            "on each block, then on the HRockmate module, before fitting the step budget")
    _check_policies_followed(hmod, "fit_step_budget")
    block_ids = {id(p.sharded_param) for grp in groups for p in grp.params}
    sharded = sum(_local_bytes(p) for p in hmod.parameters())
    root = sum(int(p.numel()) * p.element_size() for p in hmod.parameters()
               if id(p) not in block_ids)
    # sharded parameters and gradients, the root's gathered parameters and their gradients'
    # reduce-scatter input
    resident = 2 * sharded + 2 * root
    if grouped:  # (shards of a last rank may be smaller; budgets the ranks measured differ)
        box = torch.tensor([resident, -int(step_budget)], dtype=torch.int64)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        resident, step_budget = int(box[0].item()), -int(box[1].item())
    largest = max(grp.unsharded_bytes for grp in groups)
    # FSDP2's own buffers at a block boundary: the flat all-gather output of the block being
    # gathered (copied out into its parameters) and two blocks' reduce-scatter inputs (one
    # kept in flight while the next is reduced)
    buffers = 3 * largest
    # (the plans charge the gathered blocks beyond the largest: the activation budget covers
    # them, and the largest is set aside)
    hmod.__dict__["_hr_fsdp_charged"] = groups
    activation = int(step_budget) - resident - largest - buffers
    best: int | None = None  # the smallest modelled step of the plans made
    for r in range(1, rounds + 1):
        if activation <= 0:
            break
        try:
            hmod.replan(activation)
            planned = True
        except InfeasibleBudget:
            planned = False
        if not _everyone(planned):
            break
        agree_on_plan(hmod)
        driver = driver_for(hmod)
        assert driver is not None
        fit = StepFit(int(step_budget), activation, resident, driver.peak_with_gathered_bytes,
                      buffers + driver.program.extra_bytes, r)
        if fit.step_bytes <= step_budget:
            return fit
        best = fit.step_bytes if best is None else min(best, fit.step_bytes)
        activation -= fit.step_bytes - int(step_budget)
    raise StepBudgetError(
        f"fit_step_budget: no plan fits a step of {int(step_budget)} bytes: this rank holds "
        f"{resident} bytes all step (sharded parameters and gradients, the root group's "
        f"gathered parameters and their reduce-scatter input) and the largest block gathers "
        f"{largest} bytes"
        + (f"; the plans made model steps of {best} bytes at the least" if best else "")
        + "; raise the budget or shard over more ranks")


def first_call_check(hmod: nn.Module, args: tuple[Any, ...] = (),
                     kwargs: dict[str, Any] | None = None) -> None:
    """The layout check at a module's first training call (FSDP2 may shard blocks after the
    module was built), called with that call's arguments: a ``MixedPrecisionPolicy`` that
    changes the ops the plan runs has the module traced and planned again as the policy runs
    it (``HRockmate._follow_policies``)."""
    if hmod.__dict__.get("_hr_layout_checked"):
        return
    if sharded_blocks(hmod):
        blocks_of(hmod)  # (raises where the per-block layout cannot run under the plan)
    else:
        check_layout(hmod.__dict__["_hr_model"], "HRockmate was called", with_tensors=True)
    # (also for fully_shard(hmod) alone: its parameters are gathered in param_dtype too)
    changes = policy_changes_graph(hmod)
    if changes and "_hr_fsdp_policies" not in hmod.__dict__:
        hmod._follow_policies(args, dict(kwargs or {}), changes)
    hmod.__dict__["_hr_layout_checked"] = True
