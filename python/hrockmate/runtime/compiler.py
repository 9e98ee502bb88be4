"""Compiling a schedule into straight-line Python over the traced joint graph.

``compile_schedule`` turns (traced graph, schedule) into a ``Program``: the forward segment and
the backward chunks, each a generated function over a list ``E`` indexed by IR tensor id. A
compute step is one call of the ATen op with its arguments read from ``E``; a free step drops
the reference. Op callables, constants, output slots, which random ops replay their generator
state, buffer write-backs and the backward's chunk cuts are all decided here, once.
"""

from __future__ import annotations

import bisect
import functools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx

from hrockmate.capture.decisions import SkipRules
from hrockmate.capture.kernels import RELAYOUT, in_place_kernel, op_kernel
from hrockmate.ir.graph import PREEXISTING_ROLES as _PREEXISTING
from hrockmate.ir.graph import gradient_seed_bytes  # noqa: F401  (the runtime counts it)
from hrockmate.runtime.cuda_memory import allocator_slack_bytes

__all__ = ["Program", "RuntimeScheduleError", "StepHooks", "compile_schedule"]


class RuntimeScheduleError(ValueError):
    """A schedule cannot be executed on the traced graph; the message names the step."""



_LITERAL_TYPES = (bool, int, str, type(None))

#: Elementwise ops whose in-place sibling runs the same kernel over the same elements, which the
#: code runs in place into a first argument nothing reads again (``_Compiler._in_place_reuse``).
REUSES_FIRST_ARGUMENT = frozenset({
    torch.ops.aten.add.Tensor, torch.ops.aten.sub.Tensor, torch.ops.aten.mul.Tensor,
    torch.ops.aten.div.Tensor})


@dataclass
class _Segment:
    fn: Callable[..., Any]
    source: str


@dataclass
class Program:
    """A schedule compiled for one traced graph (what the autograd Functions execute).

    ``forward.fn(P, B, X, S) -> E``: P parameters by slot, B buffers by slot, X tensor inputs by
    slot, S the list of saved generator states (filled here), then of the random decisions
    read at this call and the tensors standing for what they skip; returns the environment.
    ``chunks[i].fn(E, B, T, S, GP, GX)``: the i-th part of the backward segment (T the output
    gradients); it stores gradients per parameter / tensor-input slot into GP / GX.

    The backward segment is cut into chunks so that gradients reach autograd (and thus
    ``.grad``, DDP hooks...) while the backward still runs, not all at its end: each chunk is one
    autograd node and hands over the gradients of ``chunk_params[i]`` / ``chunk_inputs[i]``.
    Cuts are placed only where holding the finished gradients longer would raise the peak.
    """

    forward: _Segment
    chunks: list[_Segment]
    chunk_params: list[list[int]]
    chunk_inputs: list[list[int]]
    num_tensors: int
    num_rng_slots: int
    output_ids: list[int]
    tangent_contiguous: list[bool]  # per output: traced gradient layout was contiguous
    #: per output: (shape, strides, dtype) of its gradient in the plan, None for outputs
    #: without one (returned as non-differentiable tensors)
    tangent_layout: list[tuple[Any, ...] | None]
    num_param_slots: int
    num_input_slots: int
    recomputed_ops: int  # compute steps that re-run an op already run in this iteration
    modelled_peak_bytes: int  # peak of the runtime's own memory model (gradients as handed over)
    #: what the runtime adds to the graph's peak: the saved generator states of replayed random
    #: ops (by how much they raise the modelled peak), old values of buffers that
    #: recomputations read after write-back (at most), and on CUDA the caching allocator's
    #: unsplit block remainder (``runtime.cuda_memory.allocator_slack_bytes``)
    extra_bytes: int
    #: at least what ``extra_bytes`` of any schedule of this graph exceeds this program's: a
    #: saved state for every random op and a current one per generator, an old value for
    #: every updated buffer (what a planner sets aside so that its plan fits with the runtime's
    #: bytes)
    possible_extra_bytes: int = 0
    #: every schedule of this graph compiles to these ``extra_bytes`` (no random op, no buffer
    #: update, no skippable region: nothing the runtime keeps depends on where the schedule
    #: puts its ops), so planning reads another schedule's bytes here instead of compiling it
    #: (compiling recompute-all's millions of steps, only to refuse a budget, took a minute)
    extra_bytes_fixed: bool = False
    #: per parameter / tensor-input slot, the outputs its gradient depends on (bit k: output
    #: k's gradient): a gradient that only outputs which received none reach is handed over
    #: as None, as eager autograd leaves ``.grad`` (the plan computes zeros there)
    param_tangents: list[int] = field(default_factory=list)
    input_tangents: list[int] = field(default_factory=list)
    #: slots of S after the generator states: per random decision, whether this call skips
    #: its region, and per tensor standing for a skipped one, that tensor while needed
    num_decision_slots: int = 0
    #: schedule positions where backward chunks 1, 2, ... begin (chunk 0 begins at the end of
    #: the forward segment); another executor of the same schedule cuts it there too
    chunk_starts: list[int] = field(default_factory=list)


def _tangents_reaching(graph: Any, sources: dict[int, tuple[str, Any]]) -> list[int]:
    """Per tensor, the outputs whose gradients reach it (a bitmask over output positions)."""
    reach = [0] * len(graph.tensors)
    for tid, (kind, key) in sources.items():
        if kind == "tangent":
            reach[int(tid)] |= 1 << int(key)
    for op in graph.ops:  # (in the traced order: inputs before outputs)
        mask = 0
        for x in op.inputs:
            mask |= reach[x]
        if mask:
            for o in op.outputs:
                reach[o] |= mask
    return reach


def _resolve_generator(node: torch.fx.Node) -> torch.Generator:
    """The default generator a random op draws from, from the device of its traced output."""
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) and val else val
    device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.init()
        return torch.cuda.default_generators[idx]
    raise RuntimeScheduleError(
        f"random op '{node.name}' runs on device {device}; replaying its random numbers is "
        "supported on cpu and cuda only"
    )


def _state_nbytes(gen: torch.Generator) -> int:
    """Bytes of one saved state of ``gen`` (5056 for the CPU Mersenne twister, 16 on CUDA)."""
    return int(gen.get_state().nbytes)


def _replay_generator(node: torch.fx.Node) -> torch.Generator | None:
    """``_resolve_generator``, or None where replays are not supported (compiling a schedule
    that replays the op fails with the reason)."""
    try:
        return _resolve_generator(node)
    except RuntimeScheduleError:
        return None



def gradient_slots(traced: Any, param_slot: dict[str, int], input_slot: dict[int, int]
                   ) -> tuple[dict[int, tuple[str, int]], dict[tuple[str, int], int],
                              Callable[[int], bool]]:
    """Where each traced gradient goes, for the programs of both modes: ``(grad_slot,
    slot_uses, handed_copy)``. ``grad_slot[t]`` is ``("GP", parameter slot)`` or ``("GX",
    tensor-input slot)``; ``slot_uses[slot]`` counts the traced gradients feeding a slot (more
    than one: they are accumulated); ``handed_copy(t)``, called once per gradient in the order
    they are handed over, says whether ``t`` must be copied.

    Gradients of different slots may share one storage (one traced tensor is the gradient of
    both parameters of ``a + b``, and of both biases of oneDNN's LSTM layer). Autograd keeps
    what it is handed as ``.grad``, so accumulating into one (the next backward,
    ``clip_grad_norm_``) would change the other too; eager autograd copies such a gradient,
    and so do the programs, for all but the first slot handed it."""
    g = traced.graph
    grad_slot: dict[int, tuple[str, int]] = {}
    for pname, tid in traced.param_grads.items():
        if pname not in param_slot:
            raise RuntimeScheduleError(
                f"the trace has a gradient for parameter '{pname}', which the model no "
                "longer has; re-create HRockmate for the current model"
            )
        grad_slot[tid] = ("GP", param_slot[pname])
    for flat_idx, tid in traced.input_grads.items():
        grad_slot[tid] = ("GX", input_slot[int(flat_idx)])
    slot_uses: dict[tuple[str, int], int] = {}
    for slot in grad_slot.values():
        slot_uses[slot] = slot_uses.get(slot, 0) + 1
    slots_of_root: dict[int, set[tuple[str, int]]] = {}
    for t, slot in grad_slot.items():
        slots_of_root.setdefault(g.storage_root(t), set()).add(slot)
    shared_roots = {r for r, slots in slots_of_root.items() if len(slots) > 1}
    handed_roots: set[int] = set()

    def handed_copy(t: int) -> bool:
        root = g.storage_root(t)
        copy = root in handed_roots
        if root in shared_roots:
            handed_roots.add(root)
        return copy

    return grad_slot, slot_uses, handed_copy

class _Compiler:
    """Turns (traced graph, schedule) into the Python source of the two segments."""

    def __init__(
        self,
        traced: Any,
        steps: Sequence[tuple[str, int]],
        forward_len: int,
        param_slot: dict[str, int],
        buffer_slot: dict[str, int],
        input_slot: dict[int, int],
        hooks: "StepHooks | None" = None,
    ) -> None:
        self.traced = traced
        self.hooks = hooks if hooks is not None else StepHooks()
        self.namespace: dict[str, Any] = dict(self.hooks.names)
        self.graph = traced.graph
        self.steps = [(str(k), int(i)) for k, i in steps]
        self.forward_len = int(forward_len)
        self.param_slot = param_slot
        self.buffer_slot = buffer_slot
        self.input_slot = input_slot
        #: the rules for the trace's random decisions (one description, also checked)
        self.skip_rules = SkipRules.of(traced, list(getattr(traced, "skippable", ()) or ()))
        self._consts: dict[int, str] = {}
        self._node_key: dict[tuple[torch.fx.Node, int | None], int] = {}
        for tid, (node, idx) in enumerate(traced.tensor_nodes):
            if node is None:
                continue
            self._node_key[(node, idx)] = tid
            if node.op == "call_function" and node.target is operator.getitem and idx is None:
                self._node_key[(node.args[0], node.args[1])] = tid

    # ---- argument expressions ------------------------------------------------------------
    def _const(self, value: Any) -> str:
        key = id(value)
        name = self._consts.get(key)
        if name is None:
            name = f"K{len(self._consts)}"
            self._consts[key] = name
            self.namespace[name] = value
        return name

    def _tensor_of(self, node: torch.fx.Node, op_name: str) -> int:
        tid = self._node_key.get((node, None))
        if tid is None and node.op == "call_function" and node.target is operator.getitem:
            tid = self._node_key.get((node.args[0], node.args[1]))
        if tid is None:
            raise RuntimeScheduleError(
                f"op '{op_name}' reads fx node '{node.name}', which is no tensor of the graph "
                "IR; the trace is inconsistent (re-trace the model)"
            )
        return tid

    def _expr(self, a: Any, op_name: str, reads: list[int]) -> str:
        if isinstance(a, torch.fx.Node):
            tid = self._tensor_of(a, op_name)
            reads.append(tid)
            return f"E[{tid}]"
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self._expr(x, op_name, reads) for x in a)
            if isinstance(a, tuple):
                return f"({inner},)" if len(a) == 1 else f"({inner})"
            return f"[{inner}]"
        if isinstance(a, _LITERAL_TYPES) and not isinstance(a, torch.SymInt):
            return repr(a)
        if isinstance(a, float) and math.isfinite(a):
            return repr(a)
        return self._const(a)

    def _call(self, op_id: int, reads: list[int], in_place: Callable[..., Any] | None = None
              ) -> str:
        """The call of op ``op_id`` (its arguments read from ``E``; the tensors it reads are
        added to ``reads``), by its kernel, or by ``in_place``, its variant that writes its
        results into some of its arguments."""
        node = self.traced.op_nodes[op_id]
        name = f"F{op_id}" if in_place is None else f"W{op_id}"
        if name not in self.namespace:
            kernel = in_place or op_kernel(node, self.traced.device.type)
            if op_id in self.skip_rules.sums:  # (a term may be missing)
                kernel = functools.partial(_sum_present, kernel)
            self.namespace[name] = kernel
        parts = [self._expr(a, node.name, reads) for a in node.args]
        parts += [f"{k}={self._expr(v, node.name, reads)}" for k, v in node.kwargs.items()]
        return f"{name}({', '.join(parts)})"

    def _in_place_write_back(self, op_id: int, pos: int, buffer_of_update: dict[int, str],
                             buffer_tensor: dict[str, int], last_read: dict[int, int],
                             viewed: set[int]) -> str | None:
        """The call computing op ``op_id`` (its first run, at step ``pos``) straight into the
        buffers it updates, as eager does (``kernels.in_place_kernel``), when that is
        unobservable: every argument it writes is a buffer's traced value whose result is that
        buffer's update, of the same shape and dtype, read by no later step and viewed by no
        tensor. None otherwise (the op then runs out of place and its result is copied over)."""
        node = self.traced.op_nodes[op_id]
        found = in_place_kernel(node.target, self.traced.device.type)
        if found is None or node.meta.get(RELAYOUT):
            return None  # (an output the real kernel lays out otherwise is copied: op_kernel)
        _, written = found
        if any(i >= len(node.args) or not isinstance(node.args[i], torch.fx.Node)
               for i in written):
            return None
        # the written arguments' new values are the op's last results, in the order written
        n_results = len(node.target._schema.returns)
        result_of = {i: t for t, i in self._output_slots(op_id)}
        outputs = set(self.traced.output_ids)
        for j, i in enumerate(written):
            t = result_of.get(n_results - len(written) + j if n_results > 1 else None)
            if t is None:
                return None
            bt = self._tensor_of(node.args[i], node.name)
            buffer = buffer_of_update.get(t)
            if (buffer is None or buffer_tensor.get(buffer) != bt or t in outputs or bt in viewed
                    or last_read.get(bt, -1) > pos):
                return None
            if not _same_layout(node.args[i], self.traced.tensor_nodes[t]):
                return None
        return self._call(op_id, [], in_place=found[0])

    def _in_place_reuse(self, op_id: int, pos: int, next_free: dict[int, list[int]],
                        next_read: dict[int, list[int]], excluded: set[int]) -> str | None:
        """The call computing op ``op_id`` at step ``pos`` into the storage of its first
        argument (``add(a, b)`` as ``a.add_(b)``), where that is unobservable: the op is an
        elementwise one of ``REUSES_FIRST_ARGUMENT``, ``a`` has the result's shape, strides
        and dtype, owns its storage, is viewed by no tensor, is none of ``excluded`` (tensors
        the code hands out, keeps or aliases beside the graph), and the schedule's next use of
        it is its free (no later step reads the old value). Eager autograd accumulates a
        gradient's terms so (``a.add_(b)`` into its input buffer); the traced backward's
        out-of-place sums allocate a fresh tensor per term, memory the caches do not hold. The
        values are the same kernel's; the memory is at most the schedule's (the result takes
        ``a``'s storage instead of new storage). None otherwise."""
        node = self.traced.op_nodes[op_id]
        if node.target not in REUSES_FIRST_ARGUMENT or node.meta.get(RELAYOUT):
            return None
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        out = self.graph.ops[op_id].outputs
        if len(out) != 1 or self.graph.tensors[out[0]].alias_of is not None:
            return None
        a = self._tensor_of(node.args[0], node.name)
        if a in excluded or self.graph.storage_root(a) != a:
            return None
        frees = next_free.get(a, [])
        j = bisect.bisect_right(frees, pos)
        if j == len(frees):
            return None  # (never freed after this step: its value may be read at the end)
        reads = next_read.get(a, [])
        i = bisect.bisect_right(reads, pos)
        if i < len(reads) and reads[i] < frees[j]:
            return None
        if not _same_layout(node.args[0], self.traced.tensor_nodes[out[0]]):
            return None
        found = in_place_kernel(node.target, self.traced.device.type)
        if found is None or found[1] != (0,):
            return None
        return self._call(op_id, [], in_place=found[0])

    def _output_slots(self, op_id: int) -> list[tuple[int, int | None]]:
        """(tensor id, position in the op's tuple result or None) for each IR output."""
        node = self.traced.op_nodes[op_id]
        out = []
        for tid in self.graph.ops[op_id].outputs:
            src, idx = self.traced.tensor_nodes[tid]
            if src is not node:  # registered on the getitem node that unpacks the result
                if src.op == "call_function" and src.target is operator.getitem:
                    idx = src.args[1]
                else:
                    raise RuntimeScheduleError(
                        f"tensor '{self.graph.tensors[tid].name}' is an output of op "
                        f"'{self.graph.ops[op_id].name}' in the IR but not of its fx node"
                    )
            out.append((tid, idx))
        return out

    # ---- the whole program -------------------------------------------------------------
    def compile(self) -> Program:
        g = self.graph
        tr = self.traced
        n_t = g.num_tensors
        if not 0 <= self.forward_len <= len(self.steps):
            raise RuntimeScheduleError(
                f"forward_len {self.forward_len} is outside the schedule of {len(self.steps)} steps"
            )
        roles = [t.role for t in g.tensors]
        preexisting = [r in _PREEXISTING for r in roles]

        grad_slot, slot_uses, handed_copy = gradient_slots(tr, self.param_slot,
                                                           self.input_slot)

        def stash(t: int) -> str:
            copy = handed_copy(t)
            return self._stash(t, grad_slot[t], slot_uses, copy, skips.may_be_missing(t))
        buffer_of_update = {tid: b for b, tid in tr.buffer_updates.items()}
        buffer_tensor: dict[str, int] = {}
        input_tensor: dict[int, int] = {}  # sample leaf -> its tensor id
        head_fwd: list[str] = [f"E = [None] * {n_t}"]
        head_bwd: list[str] = []
        for tid, (kind, key) in tr.sources.items():
            tid = int(tid)
            if kind == "param":
                head_fwd.append(f"E[{tid}] = P[{self.param_slot[key]}]")
            elif kind == "buffer":
                head_fwd.append(f"E[{tid}] = B[{self.buffer_slot[key]}]")
                buffer_tensor[key] = tid
            elif kind == "input":
                slot = self.input_slot.get(int(key))
                if slot is None:
                    raise RuntimeScheduleError(
                        f"graph input '{g.tensors[tid].name}' comes from sample leaf {key}, "
                        "which is not a tensor"
                    )
                head_fwd.append(f"E[{tid}] = X[{slot}]")
                input_tensor[int(key)] = tid
            elif kind == "tangent":
                head_bwd.append(f"E[{tid}] = T[{int(key)}]")
            elif kind == "constant":  # a tensor the model closes over: the same object each call
                head_fwd.append(f"E[{tid}] = {self._const(getattr(tr.gm, key))}")
            else:
                raise RuntimeScheduleError(f"unknown source kind {kind!r} for tensor {tid}")
        # what each written-back value is copied into, and the old value's tensor
        update_target: dict[int, tuple[str, int | None]] = {
            tid: (f"B[{self.buffer_slot[b]}]", buffer_tensor.get(b))
            for b, tid in tr.buffer_updates.items()}
        update_target.update({  # (a QA head clamps its start positions in place, as eager)
            tid: (f"X[{self.input_slot[leaf]}]", input_tensor.get(leaf))
            for leaf, tid in tr.input_updates.items()})

        mask_of_unpack, mask_of_pack = self._compact_masks()
        float_masks = set(mask_of_unpack.values())
        # First pass: check reads, count how often each op runs, find the last read of each
        # tensor (a buffer written back must keep its old value for later recomputations), and
        # which restorations of compact masks can alias the float mask.
        alive = list(preexisting)
        runs = [0] * g.num_ops
        calls: list[str | None] = []
        last_read: dict[int, int] = {}
        reads_at: dict[int, list[int]] = {}  # tensor -> the steps reading it, in order
        frees_at: dict[int, list[int]] = {}  # tensor -> the steps freeing it, in order
        aliased: dict[int, int] = {}  # step position -> the float mask its output aliases
        packed_needed: set[int] = set()  # float masks restored at least once from their bits
        # A float mask freed just before its restoration (only free steps and its own packing
        # in between, so nothing is allocated meanwhile) is kept until then instead.
        freed_clean: dict[int, int] = {}  # float mask -> position of that free step
        deferred_free: dict[int, int] = {}  # free step kept -> restoration step that drops it
        for pos, (kind, ident) in enumerate(self.steps):
            where = f"schedule step {pos} ({kind} {ident})"
            if kind == "compute":
                if not 0 <= ident < g.num_ops:
                    raise RuntimeScheduleError(f"{where}: no op {ident} in the graph")
                mask = mask_of_unpack.get(ident)
                if mask is not None:
                    if alive[mask]:
                        aliased[pos] = mask
                    elif mask in freed_clean:
                        aliased[pos] = mask
                        deferred_free[freed_clean[mask]] = pos
                    else:
                        packed_needed.add(mask)
                if freed_clean:
                    own = mask_of_pack.get(ident)
                    freed_clean = {m: f for m, f in freed_clean.items() if m == own}
                if pos < self.forward_len and g.ops[ident].phase == "backward":
                    raise RuntimeScheduleError(
                        f"{where}: backward op '{g.ops[ident].name}' in the forward segment"
                    )
                reads: list[int] = []
                calls.append(self._call(ident, reads))
                for t in reads:
                    if not alive[t]:
                        raise RuntimeScheduleError(
                            f"{where}: op '{g.ops[ident].name}' reads tensor "
                            f"'{g.tensors[t].name}', which is not alive at that point"
                        )
                    last_read[t] = pos
                    reads_at.setdefault(t, []).append(pos)
                runs[ident] += 1
                for t in g.ops[ident].outputs:
                    alive[t] = True
            elif kind == "free":
                if not 0 <= ident < n_t:
                    raise RuntimeScheduleError(f"{where}: no tensor {ident} in the graph")
                if roles[ident] in _PREEXISTING or roles[ident] == "output":
                    raise RuntimeScheduleError(
                        f"{where}: tensor '{g.tensors[ident].name}' has role "
                        f"'{roles[ident]}', which a schedule may not free"
                    )
                if not alive[ident]:
                    raise RuntimeScheduleError(
                        f"{where}: tensor '{g.tensors[ident].name}' is not alive"
                    )
                calls.append(None)
                alive[ident] = False
                frees_at.setdefault(ident, []).append(pos)
                if ident in float_masks:
                    freed_clean[ident] = pos
            else:
                raise RuntimeScheduleError(f"{where}: unknown step kind {kind!r}")
        freed = {i for k, i in self.steps if k == "free"}
        for t in grad_slot:
            if not alive[t] and t not in freed:
                raise RuntimeScheduleError(
                    f"the schedule never produces gradient '{g.tensors[t].name}'"
                )
        for t in tr.output_ids:
            if not alive[t]:
                raise RuntimeScheduleError(
                    f"output '{g.tensors[t].name}' is not produced by the schedule"
                )

        random_ops = [k for k in range(g.num_ops) if g.ops[k].random]
        self._check_random_order(random_ops)
        # each random op's generator, once (GEN<j> in the generated code); a replayed op whose
        # generator is not supported fails here with the reason
        gen_index: dict[int, int] = {}
        generators: list[torch.Generator] = []
        for k in random_ops:
            node = tr.op_nodes[k]
            gen = _resolve_generator(node) if runs[k] > 1 else _replay_generator(node)
            if gen is None:
                continue
            j = next((i for i, other in enumerate(generators) if other is gen), len(generators))
            if j == len(generators):
                generators.append(gen)
                self.namespace[f"GEN{j}"] = gen
            gen_index[k] = j
        state_nbytes = [_state_nbytes(gen) for gen in generators]
        cuts, rng_bytes, chained, chain_goes_on, heads = self._replay_chains(
            grad_slot, random_ops, gen_index, state_nbytes)
        # the ops whose state is saved: those with a replay that does not follow its
        # predecessor's (only ops that run again need their generator state kept)
        rng_slot = {k: r for r, k in enumerate(heads)}
        # (a saved state per random op and a current one per generator, at most)
        possible_state_bytes = sum(state_nbytes[j] for j in gen_index.values()) + sum(
            state_nbytes)

        skips = _Skips(self.skip_rules, g, self.steps, self.forward_len, len(rng_slot))
        aliased_masks_only = set(mask_of_pack.values()) - packed_needed
        dropped_at = {to: deferred_free_pos for deferred_free_pos, to in deferred_free.items()}
        # Tensors an op may not overwrite in place although no step reads them again: what
        # the code hands out (outputs, gradients), keeps beside the graph (sources, buffers'
        # old and new values, stand-ins of skipped regions) or shares between two slots of E
        # (float masks and their restorations).
        not_reused = set(tr.output_ids) | set(grad_slot) | {int(t) for t in tr.sources}
        not_reused |= set(update_target) | {o for _, o in update_target.values() if o is not None}
        not_reused |= float_masks | set(skips.holds_of_source) | set(skips.rules.missing)
        not_reused |= {t for k in mask_of_unpack for t in g.ops[k].outputs}
        # Second pass: emit code.
        extra_bytes = 0
        alive = list(preexisting)
        done = [0] * g.num_ops
        written_back: set[int] = set()
        viewed = {g.storage_root(t) for t in range(n_t) if g.tensors[t].alias_of is not None}
        not_reused |= viewed
        fwd_body: list[str] = []
        chunk_bodies: list[list[str]] = [list(head_bwd)]
        pending: list[int] = []  # gradients stashed since the last cut
        chunk_grads: list[list[int]] = []
        for pos, (kind, ident) in enumerate(self.steps):
            if pos in cuts:
                chunk_grads.append(pending)
                pending = []
                chunk_bodies.append([])
            out = fwd_body if pos < self.forward_len else chunk_bodies[-1]
            out.extend(self.hooks.before.get(pos, ()))
            if kind == "free":
                t = ident
                alive[t] = False
                out.extend(skips.freeing(t, pos))
                skips.track(pos, (t,), alive)
                if pos not in deferred_free:  # (else dropped at its restoration's step)
                    if t in grad_slot:
                        out.append(stash(t))
                        pending.append(t)
                    out.append(f"E[{t}] = None")
                out.extend(self.hooks.after.get(pos, ()))
                continue
            k = ident
            fresh = [(t, i) for t, i in self._output_slots(k) if not alive[t]]
            skip = skips.condition(k)
            call = calls[pos]
            assert call is not None
            if done[k] == 0 and any(t in buffer_of_update for t, _ in fresh):
                in_place = self._in_place_write_back(k, pos, buffer_of_update, buffer_tensor,
                                                     last_read, viewed)
                if in_place is not None:
                    call = in_place
                    written_back.update(t for t, _ in fresh if t in buffer_of_update)
            if (call is calls[pos] and len(fresh) == 1 and fresh[0][1] is None and not skip
                    and pos not in aliased and k not in skips.rules.unfed
                    and k not in skips.rules.sums):
                call = self._in_place_reuse(k, pos, frees_at, reads_at, not_reused) or call
            lines: list[str] = []
            if pos in aliased or mask_of_pack.get(k, -1) in aliased_masks_only:
                # a compact mask's restoration while its float mask is alive: the same bits,
                # so the output is that tensor (no allocation, no copy); a packing op whose
                # bits no restoration reads is skipped
                if pos in aliased:
                    lines += [f"E[{t}] = E[{aliased[pos]}]" for t, _ in fresh]
                    if pos in dropped_at:
                        lines.append(f"E[{aliased[pos]}] = None")
            elif not fresh:
                lines.append(call)  # every output is alive: a temporary, dropped at once
            elif len(fresh) == 1 and fresh[0][1] is None:
                lines.append(f"E[{fresh[0][0]}] = {call}")
            else:
                lines.append(f"_r = {call}")
                lines += [f"E[{t}] = _r[{i}]" for t, i in fresh]
                lines.append("del _r")
            for t, _ in fresh:
                target = update_target.get(t)
                if target is not None and t not in written_back:
                    written_back.add(t)
                    dest, old_value = target
                    if old_value is not None and last_read.get(old_value, -1) > pos:
                        # a later recomputation reads the old value: keep it for it
                        lines.append(f"E[{old_value}] = E[{old_value}].clone()")
                        extra_bytes += g.tensors[old_value].bytes
                    lines.append(f"{dest}.copy_(E[{t}])")
            if k in skips.rules.unfed:  # (missing gradients: not run, its results missing)
                fed = " and ".join(f"E[{t}] is not None" for t in skips.rules.unfed[k])
                lines = [f"if {fed}:", *("    " + x for x in lines or ["pass"])]
            if skip:  # (a skipped op's generator state is still saved and restored below)
                given = skips.stand_ins(k, [t for t, _ in fresh], call, alive)
                lines = [f"if not ({skip}):", *("    " + x for x in lines or ["pass"]),
                         *(["else:", *("    " + x for x in given)] if given else [])]
            if k in gen_index:
                j, r = gen_index[k], rng_slot.get(k)
                if done[k] == 0:
                    if r is not None:
                        lines.insert(0, f"S[{r}] = GEN{j}.get_state()")
                else:
                    if pos not in chained:  # the head of a chain of replays
                        lines.insert(0, f"_c{j} = GEN{j}.get_state(); GEN{j}.set_state(S[{r}])")
                    if pos not in chain_goes_on:
                        lines.append(f"GEN{j}.set_state(_c{j}); del _c{j}")
                    if r is not None and done[k] == runs[k] - 1:
                        lines.append(f"S[{r}] = None")  # last replay: the state is not needed
            if done[k] == 0:
                lines += skips.decided(k)
            done[k] += 1
            for t, _ in fresh:
                alive[t] = True
            skips.track(pos, [t for t, _ in fresh], alive)
            lines += skips.released(pos)
            out.extend(lines)
            out.extend(self.hooks.after.get(pos, ()))
        tail = []
        for t in grad_slot:
            if alive[t]:
                tail.append(stash(t))
                pending.append(t)
        chunk_bodies[-1].extend(tail)
        chunk_bodies[-1].extend(self.hooks.end)
        chunk_grads.append(pending)

        self.namespace["_acc"] = _accumulate
        self.namespace["_stand_in"] = _stand_in
        fwd_src = "def forward_segment(P, B, X, S):\n" + "".join(
            f"    {line}\n" for line in head_fwd + fwd_body + ["return E"]
        )
        chunks = []
        for i, body in enumerate(chunk_bodies):
            src = f"def backward_chunk_{i}(E, B, T, S, GP, GX):\n" + "".join(
                f"    {line}\n" for line in body + ["return None"]
            )
            chunks.append(_Segment(self._exec(src, f"backward_chunk_{i}"), src))

        # Each slot is handed over with the chunk that stashes its last gradient.
        slot_chunk: dict[tuple[str, int], int] = {}
        for i, grads in enumerate(chunk_grads):
            for t in grads:
                slot_chunk[grad_slot[t]] = i
        chunk_params: list[list[int]] = [[] for _ in chunks]
        chunk_inputs: list[list[int]] = [[] for _ in chunks]
        n_params = len(set(self.param_slot.values()))
        for j in range(n_params):
            chunk_params[slot_chunk.get(("GP", j), 0)].append(j)
        for j in range(len(self.input_slot)):
            chunk_inputs[slot_chunk.get(("GX", j), 0)].append(j)

        tangent_contig: list[bool] = []
        for o in tr.output_ids:
            node, idx = tr.tensor_nodes[o]
            val = node.meta.get("val")
            if isinstance(val, (tuple, list)) and idx is not None:
                val = val[idx]
            tangent_contig.append(not isinstance(val, torch.Tensor) or val.is_contiguous())
        # The layout the backward expects of each output gradient (None: the output has none).
        tangent_layout: list[tuple[Any, ...] | None] = [None] * len(tr.output_ids)
        for tid, (kind, key) in tr.sources.items():
            if kind == "tangent":
                meta = tr.tensor_nodes[int(tid)][0].meta["val"]
                tangent_layout[int(key)] = (tuple(meta.shape), meta.stride(), meta.dtype)
        reach = _tangents_reaching(g, tr.sources)
        param_tangents, input_tangents = [0] * n_params, [0] * len(self.input_slot)
        for t, (kind, j) in grad_slot.items():
            (param_tangents if kind == "GP" else input_tangents)[j] |= reach[t]
        return Program(
            forward=_Segment(self._exec(fwd_src, "forward_segment"), fwd_src),
            chunks=chunks,
            chunk_params=chunk_params,
            chunk_inputs=chunk_inputs,
            num_tensors=n_t,
            num_rng_slots=len(rng_slot),
            output_ids=list(tr.output_ids),
            tangent_contiguous=tangent_contig,
            tangent_layout=tangent_layout,
            num_param_slots=n_params,
            num_input_slots=len(self.input_slot),
            recomputed_ops=sum(max(0, r - 1) for r in runs),
            modelled_peak_bytes=self._modelled_peak,
            extra_bytes=rng_bytes + extra_bytes + skips.excess_bytes + gradient_seed_bytes(g)
            + allocator_slack_bytes(g, tr.device),
            possible_extra_bytes=possible_state_bytes + sum(
                g.tensors[old].bytes for _, old in update_target.values() if old is not None),
            extra_bytes_fixed=not random_ops and not update_target
            and not getattr(tr, "skippable", None),
            param_tangents=param_tangents,
            input_tangents=input_tangents,
            num_decision_slots=skips.num_slots,
            chunk_starts=sorted(cuts),
        )

    def _compact_masks(self) -> tuple[dict[int, int], dict[int, int]]:
        """The compact random masks of the trace (``bernoulli -> ne -> _to_copy``, see
        ``capture.randomness.compact_random_masks``): op id of each restoring ``_to_copy`` and
        of each packing ``ne`` -> tensor id of the float mask."""
        unpack: dict[int, int] = {}
        pack: dict[int, int] = {}
        for k, node in enumerate(self.traced.op_nodes):
            for key, into in (("unpacks_mask_of", unpack), ("packs_mask_of", pack)):
                src = node.meta.get(key)
                if src is not None and len(self.graph.ops[k].outputs) == 1:
                    into[k] = self._tensor_of(src, node.name)
        return unpack, pack

    def _check_random_order(self, random_ops: list[int]) -> None:
        """Plain PyTorch draws random numbers in forward order; the schedule must run each
        random op for the first time in the forward segment and in that order."""
        first: list[tuple[int, int]] = []
        seen: set[int] = set()
        wanted = set(random_ops)
        for pos, (kind, ident) in enumerate(self.steps):
            if kind == "compute" and ident in wanted and ident not in seen:
                seen.add(ident)
                first.append((pos, ident))
        for (pos, k), (_, prev) in zip(first[1:], first):
            if k < prev:
                raise RuntimeScheduleError(
                    f"schedule step {pos} runs random op '{self.graph.ops[k].name}' for the first "
                    f"time after random op '{self.graph.ops[prev].name}', which comes later in "
                    "the forward pass; plain PyTorch's random numbers could not be reproduced"
                )
        for pos, k in first:
            if pos >= self.forward_len:
                raise RuntimeScheduleError(
                    f"schedule step {pos} runs random op '{self.graph.ops[k].name}' for the first "
                    "time in the backward segment; it must first run in the forward segment"
                )

    def _replay_chains(self, grad_slot: dict[int, tuple[str, int]], random_ops: list[int],
                       gen_index: dict[int, int], state_nbytes: list[int],
                       ) -> tuple[set[int], int, set[int], set[int], dict[int, int]]:
        """Which replays need no saved generator state: a replay of random op ``k`` right after
        a replay of the random op that drew before ``k`` from the same generator in the
        forward pass (nothing drawn from it in between, in the same code segment: autograd
        runs code of its own between chunks) finds the generator where ``k`` found it, as the
        forward's draws left it. So a recomputed block with several dropouts saves one state,
        not one per dropout; the current state is kept from the chain's first replay to its
        last.

        ``gen_index``: random op -> its generator's index (absent where replays are not
        supported); ``state_nbytes``: bytes of one state of each generator. Returns (chunk
        cuts, the bytes the saved and current states add to the peak, the step positions of
        chained replays, the positions of replays that a chained one follows, the ops whose
        state is saved -> its bytes, in the order of their first such replay)."""
        predecessor: dict[int, int | None] = {}  # per random op, the one before on its generator
        generator_of: dict[int, int] = {}
        last_op: dict[int, int] = {}
        for k in sorted(random_ops):  # (ids are in forward order: _check_random_order)
            j = gen_index.get(k, -1 - k)  # (an unsupported one: a generator of its own)
            generator_of[k] = j
            predecessor[k] = last_op.get(j)
            last_op[j] = k
        cuts, _ = self._chunk_cuts(grad_slot, {}, [])  # (the cuts do not depend on states)

        chained: set[int] = set()
        goes_on: set[int] = set()
        heads: dict[int, int] = {}
        spans: list[list[int]] = []  # [first, last position, bytes] per chain of replays
        segment = 0
        last: dict[int, tuple[int, bool, int, int]] = {}  # generator -> its last draw
        open_span: dict[int, list[int]] = {}
        ran: set[int] = set()
        for pos, (kind, k) in enumerate(self.steps):
            if pos == self.forward_len or pos in cuts:
                segment += 1
            if kind != "compute" or k not in predecessor:
                continue
            replay = k in ran
            ran.add(k)
            j = generator_of[k]
            before = last.get(j)
            if (replay and before is not None and before[0] == segment and before[1]
                    and before[2] == predecessor[k]):
                chained.add(pos)
                goes_on.add(before[3])
                open_span[j][1] = pos
            elif replay:  # the head of a chain: its op's state is saved
                heads.setdefault(k, state_nbytes[j])
                open_span[j] = [pos, pos, state_nbytes[j]]
                spans.append(open_span[j])
            last[j] = (segment, replay, k, pos)
        if not heads:  # no state is saved: the first measure is the whole answer
            return cuts, 0, chained, goes_on, heads
        cuts, rng_bytes = self._chunk_cuts(grad_slot, heads, [tuple(sp) for sp in spans])
        return cuts, rng_bytes, chained, goes_on, heads

    def _chunk_cuts(self, grad_slot: dict[int, tuple[str, int]], state_bytes: dict[int, int],
                    current_state: list[tuple[int, int, int]]) -> tuple[set[int], int]:
        """Step positions (in the backward segment) before which the finished gradients are
        handed to autograd, and how much the saved generator states (``state_bytes``: replayed
        random op -> bytes) and the current ones (``current_state``: (first, last position,
        bytes) of each chain of replays) raise the peak; measured by the Rust core with the
        simulator's storage rules (``hrockmate_core::chunking``)."""
        from hrockmate import _native
        from hrockmate.ir.schedule import Schedule

        ops = sorted(state_bytes)
        try:
            cuts, with_states, held_peak = _native.gradient_chunks(
                **Schedule(list(self.steps), self.forward_len).to_arrays(),
                gradient_ids=sorted(grad_slot), state_op=ops,
                state_bytes=[state_bytes[k] for k in ops], current_state=current_state,
                **self.graph.to_arrays())
        except (_native.InvalidScheduleError, _native.InvalidGraphError) as exc:
            raise RuntimeScheduleError(f"the schedule does not simulate: {exc}") from None
        self._modelled_peak = int(with_states)
        return {int(c) for c in cuts}, int(with_states) - int(held_peak)

    @staticmethod
    def _stash(t: int, slot: tuple[str, int], uses: dict[tuple[str, int], int],
               copy: bool = False, may_be_missing: bool = False) -> str:
        arr, j = slot
        value = f"E[{t}].clone()" if copy else f"E[{t}]"
        if copy and may_be_missing:  # (a gradient a skipped region makes alone: None)
            value = f"(None if E[{t}] is None else {value})"
        if uses[slot] > 1:  # several traced gradients of one parameter (tied under two names)
            return f"{arr}[{j}] = _acc({arr}[{j}], {value})"
        return f"{arr}[{j}] = {value}"

    def _exec(self, src: str, name: str) -> Callable[..., Any]:
        code = compile(src, f"<hrockmate {name} of {self.graph.name or 'graph'}>", "exec")
        scope = dict(self.namespace)
        exec(code, scope)  # generated from the traced graph only; no user strings are inlined
        return scope[name]


def _same_layout(arg: torch.fx.Node, result: tuple[torch.fx.Node, Any]) -> bool:
    """Whether the traced value ``arg`` and the traced result ``result`` (its fx node and tuple
    position) have the same shape, strides and dtype."""
    a = arg.meta.get("val")
    node, index = result
    r = node.meta.get("val")
    if index is not None and isinstance(r, (tuple, list)):
        r = r[index]
    return (isinstance(a, torch.Tensor) and isinstance(r, torch.Tensor) and a.shape == r.shape
            and a.stride() == r.stride() and a.dtype == r.dtype)


def _stand_in(S: list[Any], pairs: tuple[tuple[int, torch.Tensor | None], ...]
              ) -> torch.Tensor | None:
    """The first stand-in of a decision that skips ((decision slot, stand-in) pairs) that is
    not missing, or None."""
    for d, value in pairs:
        if S[d] and value is not None:
            return value
    return None


def _sum_present(add: Callable[..., Any], a: torch.Tensor | None, b: torch.Tensor | None
                 ) -> torch.Tensor | None:
    """A sum of two terms of which a skipped region may have left one or both missing."""
    if a is None:
        return b
    return a if b is None else add(a, b)


def _accumulate(acc: torch.Tensor | None, g: torch.Tensor | None) -> torch.Tensor | None:
    if g is None:  # (a gradient a skipped region makes alone)
        return acc
    return g if acc is None else acc + g


class _Skips:
    """The code for the trace's random decisions (``capture.decisions.SkipRules``): the slots
    of S where a call's decisions and the tensors standing for skipped ones are kept, and the
    lines that read the decisions, test them before an op they may skip, and keep and give
    the stand-ins. Slots of S after the generator states: one per decision (True when this
    call skips its region), then one per (region, skipped tensor) stand-in. (Sums of two run
    their kernel through ``_sum_present``: ``_Compiler._call``.)

    A stand-in is read where the schedule has it alive; it is kept in its slot (when its
    decision skips) only from a free of it until the last run of the skipped op before the
    schedule makes it again, so a call that skips holds no more than that. What a skip can
    still add to the schedule's memory (a stand-in held where the schedule had neither it
    nor the region's tensors) is counted per step (``track``) into ``excess_bytes``, a part
    of the program's extra bytes, so the budget holds whichever way the decisions go."""

    def __init__(self, rules: SkipRules, graph: Any, steps: Sequence[tuple[str, int]],
                 forward_len: int, first_slot: int) -> None:
        self.graph = graph
        self.rules = rules
        regions = rules.regions
        producer = graph.producers()
        self.producer = producer
        self.decision_slot = {r.index: first_slot + i for i, r in enumerate(regions)}
        self.test_of: dict[int, list[Any]] = {}  # op making a decision's test -> regions
        next_slot = first_slot + len(regions)
        self.hold_slot: dict[tuple[int, int], int] = {}  # (region, skipped tensor) -> slot
        # stand-in -> (region, slot, the skipped tensor it stands for)
        self.holds_of_source: dict[int, list[tuple[Any, int, int]]] = {}
        for r in regions:
            k = producer[r.test]
            if k is None or k in rules.regions_of:
                raise RuntimeScheduleError(
                    f"random decision {r.index} ({r.where}) is not made by an op that always "
                    "runs; decisions inside parts that other decisions skip are not supported")
            self.test_of.setdefault(k, []).append(r)
            for o, w in sorted(r.stands_for.items()):
                self.hold_slot[(r.index, o)] = next_slot
                self.holds_of_source.setdefault(w, []).append((r, next_slot, o))
                next_slot += 1
        self.num_slots = next_slot - first_slot
        self.runs_at: dict[int, list[int]] = {}  # op -> the steps where it runs
        for pos, (kind, k) in enumerate(steps):
            if kind == "compute":
                self.runs_at.setdefault(k, []).append(pos)
        self.read_at: dict[int, int] = {}  # decision -> the step that reads it
        # a decision is read when its test first runs, in the forward, before its region
        for k, rs in self.test_of.items():
            at = self.runs_at.get(k, [len(steps)])[0]
            for r in rs:
                self.read_at[r.index] = at
                if at >= forward_len or any(self.runs_at.get(o, [len(steps)])[0] < at
                                            for o in r.ops):
                    raise RuntimeScheduleError(
                        f"the schedule runs an op that random decision {r.index} ({r.where}) "
                        "may skip before the decision's test, or the test outside the forward "
                        "segment")
        self.kept: set[int] = set()  # hold slots the code emitted so far keeps (when skipping)
        self.clear_after: dict[int, list[int]] = {}  # step -> hold slots emptied after it
        # the memory count: per region, the bytes of its own tensors (no view, no sum, no
        # stand-in's, in no other region) the schedule has alive, which a skip does not allocate
        self.own_of: dict[int, list[tuple[int, int]]] = {}  # tensor -> (region, bytes)
        for i, r in enumerate(regions):
            for k in r.ops:
                if k in rules.sums or len(rules.regions_of.get(k, ())) != 1:
                    continue
                for t in graph.ops[k].outputs:
                    if graph.storage_root(t) == t and t not in r.stands_for:
                        self.own_of.setdefault(t, []).append((i, int(graph.tensors[t].bytes)))
        self.own_alive = [0] * len(regions)
        # per region, each stand-in pair: (skipped tensor, its bytes if it owns its storage
        # (else 0), whether a sum makes it, stand-in, its storage, that storage's bytes, slot)
        self.pairs_of = [[
            (o, int(graph.tensors[o].bytes) if graph.storage_root(o) == o else 0,
             producer[o] in rules.sums, w, graph.storage_root(w),
             int(graph.tensors[graph.storage_root(w)].bytes), self.hold_slot[(r.index, o)])
            for o, w in r.stands_for.items()] for r in regions]
        self.excess_bytes = 0
        self._timeline: Any = None
        if regions:
            from hrockmate.ir.schedule import Schedule, simulate

            self._timeline = simulate(graph, Schedule(list(steps), forward_len)).timeline
            self._peak = int(self._timeline.max()) if len(self._timeline) else 0

    def condition(self, k: int) -> str:
        """The expression, true when this call skips op ``k`` ("" for an op always run)."""
        return " or ".join(f"S[{self.decision_slot[r.index]}]"
                           for r in self.rules.regions_of.get(k, ()))

    def may_be_missing(self, t: int) -> bool:
        return t in self.rules.missing

    def decided(self, k: int) -> list[str]:
        """After op ``k``'s first run: the decisions whose test it made, read."""
        return [f"S[{self.decision_slot[r.index]}] = bool(E[{r.test}]) != {r.taken!r}"
                for r in self.test_of.get(k, ())]

    def stand_ins(self, k: int, fresh: list[int], call: str, alive: list[bool]) -> list[str]:
        """For skipped op ``k`` (``call`` its call): its fresh results, the first stand-in of
        a skipped region that is not missing (read where it is, or from its slot where the
        schedule has freed it); for a sum of two, else the sum of the terms there."""
        lines = []
        for o in fresh:
            pairs = []
            for r in self.rules.stand_ins(k, o):
                w, h = r.stands_for[o], self.hold_slot[(r.index, o)]
                if alive[w]:
                    pairs.append(f"({self.decision_slot[r.index]}, E[{w}])")
                elif h in self.kept:
                    pairs.append(f"({self.decision_slot[r.index]}, S[{h}])")
                else:
                    raise RuntimeScheduleError(
                        f"the schedule frees tensor '{self.graph.tensors[w].name}' before "
                        f"random decision {r.index} ({r.where}) is read, or makes it only "
                        "later, where it must stand for a tensor the decision skips")
            if pairs:
                lines.append(f"E[{o}] = _stand_in(S, ({', '.join(pairs)},))")
            if k in self.rules.sums:
                lines.append(f"E[{o}] = {call}" if not pairs else
                             f"if E[{o}] is None: E[{o}] = {call}")
        return lines

    def freeing(self, w: int, pos: int) -> list[str]:
        """Before the schedule frees tensor ``w`` at step ``pos``: ``w`` kept (where its
        decision skips) for each skipped tensor it stands for whose op runs again before the
        schedule makes ``w`` again, until the last such run."""
        lines = []
        k = self.producer[w]
        makes = self.runs_at.get(k, []) if k is not None else []
        j = bisect.bisect_right(makes, pos)
        remade = makes[j] if j < len(makes) else math.inf
        for r, h, o in self.holds_of_source.get(w, ()):
            runs = self.runs_at.get(self.producer[o], [])
            i = bisect.bisect_right(runs, pos)
            if i == len(runs) or runs[i] > remade:
                continue  # (no run of its op before it is made again)
            if self.read_at[r.index] > pos:
                continue  # (not read yet: a later run finds it neither alive nor kept)
            last = runs[bisect.bisect_left(runs, remade) - 1]
            lines.append(f"if S[{self.decision_slot[r.index]}]: S[{h}] = E[{w}]")
            self.kept.add(h)
            self.clear_after.setdefault(last, []).append(h)
        return lines

    def released(self, pos: int) -> list[str]:
        """After the op at step ``pos`` ran: the slots kept for it emptied."""
        done = self.clear_after.pop(pos, [])
        self.kept.difference_update(done)
        return [f"S[{h}] = None" for h in done]

    def track(self, pos: int, changed: Sequence[int], alive: list[bool]) -> None:
        """Counts step ``pos`` (after it ran, ``changed`` the tensors it made or freed): the
        most skipped regions can add to the schedule's memory there, each region on its own
        (a skip allocates its stand-ins where the schedule has them freed, and none of the
        region's own tensors); ``excess_bytes`` keeps the most over the steps."""
        if self._timeline is None:
            return
        for t in changed:
            for i, b in self.own_of.get(t, ()):
                self.own_alive[i] += b if alive[t] else -b
        extra = 0
        for i, pairs in enumerate(self.pairs_of):
            more, held = -self.own_alive[i], set()
            for o, own, summed, w, root, root_bytes, slot in pairs:
                # the stand-in's storage, where the schedule has it freed (once per storage)
                given = root_bytes if not alive[w] and root not in held else 0
                if alive[o] and own:
                    # the skipped tensor the schedule counts is the stand-in, or for a sum
                    # whose stand-in is missing, the sum of the terms there
                    more += max(given, own if summed else 0) - own
                elif slot in self.kept or alive[o]:
                    more += given
                else:
                    continue
                if given:
                    held.add(root)
            extra += max(0, more)
        if extra:
            self.excess_bytes = max(self.excess_bytes,
                                    int(self._timeline[pos]) + extra - self._peak)


@dataclass
class StepHooks:
    """Lines of code the generated segments run around schedule steps, besides the steps'
    own (the per-block FSDP2 driver's gathers, reshards and gradient hand-overs:
    ``runtime.fsdp``). ``before[pos]`` / ``after[pos]``: lines emitted just before / after step
    ``pos``, in the segment of that step; ``end``: lines at the very end of the last backward
    chunk, after the gradients still alive there are stashed. The lines may read ``E`` (both
    segments), ``P`` (forward) and ``GP`` (backward) and call the objects in ``names``."""

    before: dict[int, list[str]] = field(default_factory=dict)
    after: dict[int, list[str]] = field(default_factory=dict)
    end: list[str] = field(default_factory=list)
    names: dict[str, Any] = field(default_factory=dict)


def compile_schedule(
    traced: Any,
    steps: Sequence[tuple[str, int]],
    forward_len: int,
    param_slot: dict[str, int],
    buffer_slot: dict[str, int],
    input_slot: dict[int, int],
    hooks: StepHooks | None = None,
) -> Program:
    """Compile a schedule for a traced graph (see ``Program``); ``hooks``: code to run around
    its steps (``StepHooks``)."""
    return _Compiler(traced, steps, forward_len, param_slot, buffer_slot, input_slot,
                     hooks).compile()

