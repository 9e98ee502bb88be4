"""Running a schedule as inductor-compiled code (``HRockmate(..., compile=True)``).

The eager program (``compiler.compile_schedule``) runs one ATen call per compute step. Here
the same schedule is cut into *pieces*: maximal runs of steps of one code segment (the forward
segment or one backward chunk, cut where the eager program cuts them) without a random op.
Each piece becomes one ``torch.fx`` graph of its compute steps in the schedule's order
(recomputations included), whose inputs are the tensors alive at the piece's start that it
reads and whose outputs are the tensors the schedule keeps alive past its end, the gradients
it hands over and the buffer updates it writes back. The graph is decomposed with inductor's
decomposition table and compiled by ``compile_fx_inner``, lazily at its first call, with the
inputs of that call (a program belongs to one input shape).

Memory: a compiled piece is called with the boxed convention: it receives a list holding the
only references to the inputs the schedule frees within the piece (they are dropped from the
environment ``E`` before the call), clears it, and releases each input after its last use, as
it releases its intermediates; fused intermediates are never materialised. Inductor would
still keep some buffers longer than the schedule: an input no kernel reads (held by the
call's locals to its end), what a C++ function of several kernels reads (freed only after
all of them), what a pointwise node reads where its result is made only at the kernel that
needs it, what a producer frees when fused into its consumer although its result stays.
``_inductor_compile`` removes each of these (``_drop_unused_inputs``,
``_cpu_kernels_end_at_frees``, ``_realize_where_freed``, ``_fusion_delays_frees``); what is
left of inductor's own
memory (a fused kernel holds its inputs and outputs at once) is measured
(``measured_peak_bytes``), not assumed.

Random ops run eagerly between pieces, with the eager program's generator replay (the state
saved at an op's first run, restored for each recomputation), so forward and recomputation
draw the same masks, and in plain PyTorch's order. Buffer updates (BatchNorm's running
statistics) are written back once, at the op's first run, after the piece that made them.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import statistics
import time
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx

from hrockmate.ir.graph import PREEXISTING_ROLES as _PREEXISTING
from hrockmate.runtime.compiler import (
    Program,
    RuntimeScheduleError,
    _accumulate,
    _Compiler,
    _replay_generator,
    _resolve_generator,
    _Segment,
    _state_nbytes,
    gradient_slots,
)

__all__ = ["CompiledModeError", "compile_program", "compiled_op_times", "measure_compiled_costs"]


logger = logging.getLogger("hrockmate.runtime.inductor")

class CompiledModeError(RuntimeScheduleError):
    """A schedule or model that compiled mode cannot run; the message says why and that
    ``compile=False`` (eager mode) runs it."""


#: compiled pieces of this process by (graph code, input layouts): the blocks of a model are
#: often the same graph, and a replan or another input shape meets the same pieces again
_COMPILED: dict[tuple[Any, ...], Callable[[list[Any]], Any]] = {}


_KEEP_ORDER = {"reorder_for_locality": False, "reorder_for_peak_memory": False}


def _layout_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device.type,
                x.requires_grad)
    return repr(x)


class _Piece:
    """One compiled run of steps: ``inputs`` read from ``E``, ``drop`` dropped from ``E``
    before the call, results stored into ``E[stores[i]]`` from output ``store_out[i]``."""

    __slots__ = ("gm", "inputs", "drop", "stores", "fn", "label", "steps", "compile_s", "ops")

    def __init__(self, gm: torch.fx.GraphModule, inputs: list[int], drop: list[int],
                 stores: list[tuple[int, int]], label: str, steps: int) -> None:
        self.gm = gm
        self.inputs = inputs
        self.drop = drop
        self.stores = stores
        self.fn: Callable[[list[Any]], Any] | None = None
        self.label = label
        self.steps = steps
        self.compile_s = 0.0
        self.ops: list[int] = []  # the ops it computes, once per compute step

    def compile(self, args: list[Any]) -> Callable[[list[Any]], Any]:
        t0 = time.perf_counter()
        # (the piece's own code names its ops and constants: identical pieces share it, so
        # a second one skips decomposing as well as compiling)
        key = (self.gm.code, tuple(_layout_key(a) for a in args))
        fn = _COMPILED.get(key)
        if fn is None:
            fn = _COMPILED[key] = _inductor_compile(self.gm, args)
        self.compile_s = time.perf_counter() - t0
        self.fn = fn
        return fn


def _inductor_compile(gm: torch.fx.GraphModule, args: list[Any]) -> Callable[[list[Any]], Any]:
    """``gm`` decomposed and compiled by inductor for inputs like ``args``.

    Both run under a tracing context whose fake mode has a shape environment: inductor's FX
    graph cache keys and guards compiled graphs by it and bypasses graphs compiled without
    one, so that only under it does a rebuild in a fresh process load the compiled code from
    the on-disk cache instead of generating and building it again. (The shapes stay static:
    a program belongs to one input shape.)"""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    fake = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    with torch.no_grad(), tracing(TracingContext(fake)):
        # (fake inputs, as AOTAutograd hands them over: the cache keys a real tensor by its
        # values, which differ from one run to the next, and copies them to hash them)
        example = [fake.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        decomposed = make_fx(gm, decomposition_table=select_decomp_table(),
                             tracing_mode="fake")(*example)
        used = _drop_unused_inputs(decomposed)
        _realize_where_freed(decomposed)
        # the graph's order is the plan's, whose memory the budget was solved for:
        # inductor's reorderings (for locality, or its own estimate of peak memory)
        # move recomputations away from their uses and keep more alive at once
        with _plan_order_kept():
            compiled = compile_fx_inner(decomposed, [example[i] for i in used])
    if len(used) == len(args):
        return compiled
    return _UsedInputs(compiled, used)


#: node meta of a node ``_realize_where_freed`` made a buffer: it is not fused into its users
_FREES = "hrockmate_frees_here"


def _frees_here(snode: Any) -> bool:
    ir_node = getattr(snode, "node", None)
    origins = getattr(ir_node, "origins", None) or ()
    return any(getattr(o, "meta", {}).get(_FREES) for o in origins)


def _plan_order_choices() -> Any:
    """Inductor's choices, less the vertical fusions that would undo ``_realize_where_freed``:
    a node made a buffer where the plan frees what it reads is not fused into its users (fused,
    what it frees would stay alive until their kernel ends, with their results)."""
    from torch._inductor.choices import InductorChoices

    class _PlanOrderChoices(InductorChoices):
        @staticmethod
        def can_fuse_vertical(scheduler: Any, node1: Any, node2: Any,
                              shared_data_score: int) -> bool:
            if any(_frees_here(n) for n in node1.get_nodes()) \
                    or _fusion_delays_frees(scheduler, node1, node2):
                return False
            return InductorChoices.can_fuse_vertical(scheduler, node1, node2,
                                                     shared_data_score)

        def uuid(self) -> str:
            # (in the key of inductor's FX graph cache: a piece compiled otherwise, by an
            # earlier version, is not loaded in its place; says what the C++ kernel groups do
            # too, see _cpu_kernels_end_at_frees)
            return "hrockmate plan order: no fusion past a free; C++ groups end at frees (5)"

    return _PlanOrderChoices()


def _fusion_delays_frees(scheduler: Any, node1: Any, node2: Any) -> bool:
    """Whether fusing producer ``node1`` into ``node2`` would only delay frees: ``node1`` is
    the last to read a buffer (freed after it when apart) and its own results stay (an output
    of the graph, or read beyond ``node2``), so that fused nothing is saved and what it frees
    stays alive beside ``node2``'s results (a dropout's mask ``ne``, read only by the kernel
    that makes the scaled mask, an output, beside the masked weights)."""
    from torch._inductor.virtualized import V

    inside1 = set(node1.get_nodes())
    inside = inside1 | set(node2.get_nodes())
    outputs = set(V.graph.get_output_names())
    kept = False
    written = set()
    for buf in node1.get_outputs():
        name = buf.get_name()
        written.add(name)
        if name in outputs or any(getattr(u, "node", None) not in inside for u in buf.users):
            kept = True
    if not kept:
        return False
    for dep in node1.read_writes.reads:
        name = dep.name
        if name in written or name in outputs:
            continue
        buf = scheduler.name_to_buf.get(name)
        if buf is not None:
            readers = {getattr(u, "node", None) for u in buf.users}
        elif name in V.graph.graph_inputs:
            readers = {n for s in scheduler.nodes for n in s.get_nodes()
                       if name in {d.name for d in n.read_writes.reads}}
        else:
            continue
        if readers and readers <= inside1:
            return True
    return False


@contextlib.contextmanager
def _plan_order_kept() -> Iterator[None]:
    """Inductor set to keep the plan's order and frees (see ``_inductor_compile``)."""
    from torch._inductor.virtualized import V

    try:
        choices = _plan_order_choices()
        handler = V.set_choices_handler(choices)
    except (ImportError, AttributeError):  # (an inductor without these hooks: its own fusions)
        with torch._inductor.config.patch(_KEEP_ORDER), _cpu_kernels_end_at_frees():
            yield
        return
    with torch._inductor.config.patch({**_KEEP_ORDER,
                                       "inductor_choices_class": lambda: choices}), \
            handler, _cpu_kernels_end_at_frees():
        yield


@contextlib.contextmanager
def _cpu_kernels_end_at_frees() -> Iterator[None]:
    """Inductor's C++ backend emits consecutive generated kernels as one C++ function (a
    kernel group, flushed at a library call): the wrapper allocates the outputs of every
    kernel of the group before calling it and frees what the group read last after it
    returns. So two neighbouring kernels that share nothing (the clone of attention's values
    next to a dropout mask) hold at once what the plan frees between them: the values' copy
    was alive with the mask's inputs. Here a group ends after each kernel that reads a buffer
    or an input for the last time, so that it is freed before the next kernel allocates, as
    the plan has it; kernels that free nothing stay together."""
    try:
        from torch._inductor.codegen.cpp import CppScheduling
    except ImportError:
        yield
        return
    original = CppScheduling.codegen_node
    if getattr(original, "_hr_ends_at_frees", False):  # (nested: already in effect)
        yield
        return

    def codegen_node(self: Any, node: Any) -> None:
        original(self, node)
        scheduler = self.scheduler
        from torch._inductor.virtualized import V

        graph = V.graph
        removed = graph.removed_buffers
        if any(name not in removed and (name in scheduler.name_to_buf
                                        or name in graph.graph_inputs)
               for name in node.last_usage):
            self._set_flush_status(True)

    codegen_node._hr_ends_at_frees = True  # type: ignore[attr-defined]
    CppScheduling.codegen_node = codegen_node
    try:
        yield
    finally:
        CppScheduling.codegen_node = original


#: ops inductor lowers as a pointwise computation without the pointwise tag
_LAZY_UNTAGGED = frozenset({"_to_copy", "clone", "copy", "full_like", "zeros_like", "ones_like"})


def _lazy(node: torch.fx.Node) -> bool:
    """Whether inductor lowers ``node`` lazily: a pointwise computation, inlined into its
    users and made a buffer only where one needs it (a library kernel, an output)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.is_view:
        return False
    return (torch.Tag.pointwise in target.tags
            or target.overloadpacket.__name__ in _LAZY_UNTAGGED)


def _allocates(node: torch.fx.Node) -> bool:
    """Whether ``node`` runs a kernel of its own that allocates its result (a library kernel,
    a reduction), not a pointwise node inductor may inline or a view."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and not node.target.is_view and not _lazy(node))


def _view(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.is_view)


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return int(val.numel() * val.element_size()) if isinstance(val, torch.Tensor) else 0


def _realize_where_freed(gm: torch.fx.GraphModule) -> int:
    """Have inductor make a buffer of a pointwise node at its place in the graph (the plan's
    order) where it would otherwise keep what the plan frees there alive across other
    kernels; returns how many nodes it marked.

    Inductor lowers a pointwise node lazily: inlined into its users, made a buffer only where
    one needs it (a library kernel, an output), and computed there. Where such a node is the
    last to read a buffer (an input of the piece, a library kernel's result), the plan frees
    that buffer right after it, but compiled it stays alive until the kernel that needs the
    node's result, across the kernels between: the clone of attention's values that a later
    ``bmm`` reads held the first ``bmm``'s result across the dropout mask's kernel and an
    ``mm``. Such a node is marked ``inductor_realize_to_strides`` (inductor realizes it as it
    lowers it, with the strides the trace recorded) where what it frees is at least its own
    size and its result becomes a buffer anyway (what first needs it, through other pointwise
    nodes and views, is a library kernel, an output or another marked node) or the reduction
    it would be fused into comes after other kernels. Where it frees more than its size it is also kept apart from
    its users (``_FREES``, ``_plan_order_choices``): fused into them, what it frees would stay
    alive beside their results (a dropout's ``ne`` frees its source, four times its size).
    Everywhere else nodes stay inlined and their intermediates never exist."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    root: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        if _view(n) and n.args and isinstance(n.args[0], torch.fx.Node):
            root[n] = root.get(n.args[0], n.args[0])
        else:
            root[n] = n
    # the last node (not a view) reading each storage, through any of its views
    last: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in nodes:
        if n.op == "output" or _view(n):
            continue
        for a in n.all_input_nodes:
            r = root[a]
            if r not in last or pos[n] > pos[last[r]]:
                last[r] = n

    def reduction(n: torch.fx.Node) -> bool:
        return isinstance(n.target, torch._ops.OpOverload) and torch.Tag.reduction in n.target.tags

    marked: set[torch.fx.Node] = set()
    # where each lazy node (or view of one) is first needed: (position, as a buffer); in
    # reverse order, so that its users are known (whether marked among them)
    need: dict[torch.fx.Node, tuple[int, bool]] = {}
    for n in reversed(nodes):
        if not (_lazy(n) or _view(n)) or not n.users:
            continue
        u = min(n.users, key=lambda x: pos[x])
        if u.op == "output":
            need[n] = (pos[u], True)
        elif u in marked:  # (made at its place: what it inlines frees only then)
            need[n] = (pos[u], True)
        elif reduction(u):
            need[n] = (pos[u], False)
        elif (_lazy(u) or _view(u)) and u in need:
            need[n] = need[u]
        else:
            need[n] = (pos[u], not (_lazy(u) or _view(u)))
        if not _lazy(n) or "val" not in n.meta:
            continue
        at, as_buffer = need[n]
        # fused into a reduction its result never exists, but what it reads stays alive
        # until the reduction runs: it is made at its place where other kernels come between
        # (a dropout mask applied to a gradient, which the softmax's backward reads after a
        # recomputed layer norm and matmul)
        if not as_buffer and not any(_allocates(m) for m in nodes[pos[n] + 1:at]):
            continue
        freed = {root[a] for a in n.all_input_nodes
                 if last.get(root[a]) is n and root[a].op != "get_attr"}
        freed = {r for r in freed if r.op == "placeholder" or not _lazy(r) or r in marked}
        frees = sum(_nbytes(r) for r in freed)
        if frees < max(_nbytes(n), 1):
            continue
        n.meta["inductor_realize_to_strides"] = True
        if frees > _nbytes(n):  # (kept apart from its users only where that saves memory)
            n.meta[_FREES] = True
        marked.add(n)
    return len(marked)


def _drop_unused_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """Remove the inputs the decomposed graph ``gm`` does not read (an op that needs only
    its input's shape, as ``nll_loss_backward`` of its ``self``, reads none of its data once
    decomposed with static shapes); returns the positions of those it keeps.

    Inductor's generated code deletes an input after its last use but never one that no
    kernel reads: handed over, such an input stays referenced by the call's locals until it
    returns, and where the plan frees it inside the piece (or it shares its storage with one
    the plan frees there, as a ``detach`` does), it would stay alive through the whole piece."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    used = [i for i, n in enumerate(placeholders) if n.users]
    if len(used) < len(placeholders):
        for n in placeholders:
            if not n.users:
                gm.graph.erase_node(n)
        gm.recompile()
    return used


class _UsedInputs:
    """A compiled piece called with the boxed convention on all of the piece's inputs that
    passes on only those its compiled graph reads: the list it is given is cleared first, so
    the inputs it does not read die at once rather than at the end of the call."""

    __slots__ = ("compiled", "used")

    def __init__(self, compiled: Callable[[list[Any]], Any], used: list[int]) -> None:
        self.compiled = compiled
        self.used = used

    def __call__(self, args: list[Any]) -> Any:
        kept = [args[i] for i in self.used]
        args.clear()
        return self.compiled(kept)

    @property
    def source_code(self) -> str | None:
        return getattr(self.compiled, "source_code", None)


#: while compiled costs are measured (``measure_compiled_costs``): seconds of each call of a
#: piece, by ``id(piece)``; None otherwise
_PIECE_SECONDS: dict[int, list[float]] | None = None


def _run_piece(piece: _Piece, E: list[Any]) -> Any:
    args = [E[t] for t in piece.inputs]
    for t in piece.drop:
        E[t] = None
    fn = piece.fn if piece.fn is not None else piece.compile(args)
    timing = _PIECE_SECONDS
    t0 = time.perf_counter() if timing is not None else 0.0
    outs = fn(args)  # (boxed: it clears ``args``, so the dropped inputs die at their last use)
    if timing is not None:
        timing.setdefault(id(piece), []).append(time.perf_counter() - t0)
    for t, i in piece.stores:
        E[t] = outs[i]
    return outs


class _Stash:
    """Hands gradient tensor ``t`` over into its slot (a clone where a gradient of another
    slot shares its storage; accumulated where several traced gradients feed one slot)."""

    __slots__ = ("into_params", "slot", "copy", "accumulate")

    def __init__(self, slot: tuple[str, int], copy: bool, accumulate: bool) -> None:
        self.into_params = slot[0] == "GP"
        self.slot = slot[1]
        self.copy = copy
        self.accumulate = accumulate

    def __call__(self, value: torch.Tensor, GP: list[Any], GX: list[Any]) -> None:
        if self.copy:
            value = value.clone()
        target = GP if self.into_params else GX
        if self.accumulate:
            target[self.slot] = _accumulate(target[self.slot], value)
        else:
            target[self.slot] = value


class _Chains:
    """The replays of random ops that follow their predecessor's (``chained``: their step
    positions), those that a chained one follows (``goes_on``), and the current state of each
    generator, held while a chain of replays runs."""

    __slots__ = ("chained", "goes_on", "current")

    def __init__(self, chained: set[int], goes_on: set[int], generators: int) -> None:
        self.chained = chained
        self.goes_on = goes_on
        self.current: list[Any] = [None] * generators


class _Builder:
    def __init__(self, traced: Any, steps: Sequence[tuple[str, int]], forward_len: int,
                 param_slot: dict[str, int], buffer_slot: dict[str, int],
                 input_slot: dict[int, int], eager: Program) -> None:
        self.c = _Compiler(traced, steps, forward_len, param_slot, buffer_slot, input_slot)
        if self.c.skip_rules.regions:
            raise CompiledModeError(
                "the model decides at random whether to run parts of itself (LayerDrop, "
                "stochastic depth skipping whole layers); compiled mode does not run such "
                "decisions yet: build HRockmate with compile=False")
        self.tr = traced
        self.g = traced.graph
        self.steps = self.c.steps
        self.forward_len = int(forward_len)
        self.param_slot, self.buffer_slot, self.input_slot = param_slot, buffer_slot, input_slot
        self.eager = eager
        self.pieces: list[_Piece] = []

    # ---- what the schedule reads --------------------------------------------------------
    def _reads(self, k: int) -> list[int]:
        node = self.tr.op_nodes[k]
        out: list[int] = []
        torch.fx.node.map_arg((node.args, node.kwargs),
                              lambda a: out.append(self.c._tensor_of(a, node.name)) or a)
        return out

    def build(self) -> Program:
        g, tr, steps = self.g, self.tr, self.steps
        n_t = g.num_tensors
        grad_slot, slot_uses, handed_copy = gradient_slots(tr, self.param_slot,
                                                           self.input_slot)

        def stash_of(t: int) -> _Stash:
            slot = grad_slot[t]
            return _Stash(slot, handed_copy(t), slot_uses[slot] > 1)

        buffer_tensor: dict[str, int] = {}
        input_tensor: dict[int, int] = {}
        head_fwd: list[tuple[int, str, Any]] = []
        head_bwd: list[tuple[int, int]] = []
        for tid, (kind, key) in tr.sources.items():
            tid = int(tid)
            if kind == "param":
                head_fwd.append((tid, "P", self.param_slot[key]))
            elif kind == "buffer":
                head_fwd.append((tid, "B", self.buffer_slot[key]))
                buffer_tensor[key] = tid
            elif kind == "input":
                head_fwd.append((tid, "X", self.input_slot[int(key)]))
                input_tensor[int(key)] = tid
            elif kind == "tangent":
                head_bwd.append((tid, int(key)))
            elif kind == "constant":
                head_fwd.append((tid, "K", getattr(tr.gm, key)))
        # written-back value -> (where it goes: "B"/"X", slot; tensor of the old value)
        update_target: dict[int, tuple[str, int, int | None]] = {
            tid: ("B", self.buffer_slot[b], buffer_tensor.get(b))
            for b, tid in tr.buffer_updates.items()}
        update_target.update({
            tid: ("X", self.input_slot[leaf], input_tensor.get(leaf))
            for leaf, tid in tr.input_updates.items()})

        runs = [0] * g.num_ops
        last_read: dict[int, int] = {}
        for pos, (kind, k) in enumerate(steps):
            if kind == "compute":
                runs[k] += 1
                for t in self._reads(k):
                    last_read[t] = pos

        # Generators of the random ops, and which replays need a saved state: as the eager
        # program, a replay right after the replay of the op that drew before it from the same
        # generator finds the generator where the forward left it, so a chain of replays saves
        # one state (at its head's first run) instead of one per random op; the current state
        # is held from the chain's first replay to its last. The eager program's extra bytes
        # count these states where they are held.
        random_ops = {k for k in range(g.num_ops) if g.ops[k].random}
        generator: dict[int, torch.Generator] = {}
        gens: list[torch.Generator] = []
        gen_index: dict[int, int] = {}
        for k in sorted(random_ops):
            gen = (_resolve_generator(tr.op_nodes[k]) if runs[k] > 1
                   else _replay_generator(tr.op_nodes[k]))
            if gen is None:
                continue
            if runs[k] > 1:
                generator[k] = gen
            j = next((i for i, other in enumerate(gens) if other is gen), len(gens))
            if j == len(gens):
                gens.append(gen)
            gen_index[k] = j
        _, _, chained, goes_on, heads = self.c._replay_chains(
            grad_slot, sorted(random_ops), gen_index, [_state_nbytes(gen) for gen in gens])
        rng_slot = {k: r for r, k in enumerate(heads)}
        chain = _Chains(chained, goes_on, len(gens))

        bounds = [self.forward_len, *self.eager.chunk_starts, len(steps)]
        if any(b < a for a, b in zip(bounds, bounds[1:])):
            raise RuntimeScheduleError("the backward chunks' cuts are not in the backward segment")
        alive = [t.role in _PREEXISTING for t in g.tensors]
        done = [0] * g.num_ops
        written_back: set[int] = set()
        segments = [(0, self.forward_len)] + list(zip(bounds, bounds[1:]))
        bodies: list[list[Callable[..., None]]] = []
        sources: list[list[str]] = []
        for si, (start, end) in enumerate(segments):
            body: list[Callable[..., None]] = []
            source: list[str] = []
            pos = start
            while pos < end:
                kind, k = steps[pos]
                if kind == "compute" and k in random_ops:
                    body.append(self._random_step(pos, k, alive, done, runs, rng_slot,
                                                  generator, chain, gen_index))
                    source.append(f"# step {pos}: random op {g.ops[k].name} (eager)")
                    pos += 1
                    continue
                stop = pos
                while stop < end and not (steps[stop][0] == "compute"
                                          and steps[stop][1] in random_ops):
                    stop += 1
                action, text = self._piece(pos, stop, alive, done, grad_slot, stash_of,
                                           update_target, written_back, last_read,
                                           f"segment {si} steps {pos}-{stop - 1}")
                body.append(action)
                source.append(text)
                pos = stop
            if si == len(segments) - 1:
                tail = [(t, stash_of(t)) for t in grad_slot if alive[t]]

                def hand_tail(E: list[Any], B: Any, X: Any, S: Any, GP: Any, GX: Any,
                              tail: list[tuple[int, _Stash]] = tail) -> None:
                    for t, stash in tail:
                        stash(E[t], GP, GX)
                body.append(hand_tail)
            bodies.append(body)
            sources.append(source)

        def forward_segment(P: list[Any], B: list[Any], X: list[Any], S: list[Any],
                            body: list[Callable[..., None]] = bodies[0]) -> list[Any]:
            E: list[Any] = [None] * n_t
            for tid, kind, key in head_fwd:
                E[tid] = (P[key] if kind == "P" else B[key] if kind == "B"
                          else X[key] if kind == "X" else key)
            for action in body:
                action(E, B, X, S, None, None)
            return E

        def chunk_fn(body: list[Callable[..., None]], first: bool) -> Callable[..., None]:
            def backward_chunk(E: list[Any], B: list[Any], T: Sequence[Any], S: list[Any],
                               GP: list[Any], GX: list[Any]) -> None:
                if first:
                    for tid, key in head_bwd:
                        E[tid] = T[key]
                for action in body:
                    action(E, B, None, S, GP, GX)
            return backward_chunk

        def text(i: int, lines: list[str]) -> str:
            what = "forward segment" if i == 0 else f"backward chunk {i - 1}"
            return f"# compiled {what}\n" + "\n".join(lines) + "\n"

        return replace(
            self.eager,
            forward=_Segment(forward_segment, text(0, sources[0])),
            chunks=[_Segment(chunk_fn(b, i == 0), text(i + 1, s))
                    for i, (b, s) in enumerate(zip(bodies[1:], sources[1:]))],
            num_rng_slots=len(rng_slot),
            num_decision_slots=0,
        )

    # ---- one random op, eagerly ---------------------------------------------------------
    def _random_step(self, pos: int, k: int, alive: list[bool], done: list[int],
                     runs: list[int], rng_slot: dict[int, int],
                     generator: dict[int, torch.Generator], chain: "_Chains",
                     gen_index: dict[int, int]) -> Callable[..., None]:
        c = self.c
        fresh = [(t, i) for t, i in c._output_slots(k) if not alive[t]]
        call = c._call(k, [])
        name = f"random_step_{pos}"
        fn = c._exec(f"def {name}(E):\n    return {call}\n", name)
        for t, _ in fresh:
            alive[t] = True
        first, last = done[k] == 0, done[k] == runs[k] - 1
        done[k] += 1
        gen, slot = generator.get(k), rng_slot.get(k)
        held, j = chain.current, gen_index.get(k, 0)
        head, ends = pos not in chain.chained, pos not in chain.goes_on

        def random_step(E: list[Any], B: Any, X: Any, S: list[Any], GP: Any, GX: Any) -> None:
            if gen is None:
                r = fn(E)
            elif first:
                if slot is not None:  # (the head of a chain of replays)
                    S[slot] = gen.get_state()
                r = fn(E)
            else:  # a recomputation draws what the first run drew
                if head:
                    held[j] = gen.get_state()
                    gen.set_state(S[slot])
                r = fn(E)
                if ends:
                    gen.set_state(held[j])
                    held[j] = None
                if slot is not None and last:
                    S[slot] = None
            for t, i in fresh:
                E[t] = r if i is None else r[i]
        return random_step

    # ---- a compiled piece ---------------------------------------------------------------
    def _piece(self, start: int, stop: int, alive: list[bool], done: list[int],
               grad_slot: dict[int, tuple[str, int]], stash_of: Callable[[int], _Stash],
               update_target: dict[int, tuple[str, int, int | None]], written_back: set[int],
               last_read: dict[int, int], label: str) -> tuple[Callable[..., None], str]:
        c, tr, steps = self.c, self.tr, self.steps
        fxg = torch.fx.Graph()
        value: dict[int, torch.fx.Node] = {}  # tensor -> its node, for those made or read here
        made_here: set[int] = set()  # tensors whose node ``value`` holds was made here
        inputs: list[int] = []
        drop: list[int] = []  # tensors of E the piece frees (their references go with it)
        outputs: list[torch.fx.Node] = []
        out_index: dict[torch.fx.Node, int] = {}
        # after the call, in step order: ("stash", stash, source, index) with source "pre"
        # (a tensor of E taken before the call) or "out"; ("write", target, old, index)
        after: list[tuple[Any, ...]] = []
        pre: list[int] = []  # tensors of E held for a stash after the call
        computes = 0
        ops: list[int] = []

        def output(node: torch.fx.Node) -> int:
            i = out_index.get(node)
            if i is None:
                i = out_index[node] = len(outputs)
                outputs.append(node)
            return i

        def read(a: torch.fx.Node, name: str) -> torch.fx.Node:
            t = c._tensor_of(a, name)
            node = value.get(t)
            if node is None:
                if not alive[t]:
                    raise RuntimeScheduleError(
                        f"{label}: op '{name}' reads tensor '{self.g.tensors[t].name}', which "
                        "is not alive there")
                node = fxg.placeholder(f"in{len(inputs)}")
                value[t] = node
                inputs.append(t)
            return node

        for pos in range(start, stop):
            kind, ident = steps[pos]
            if kind == "compute":
                k = ident
                computes += 1
                ops.append(k)
                src = tr.op_nodes[k]
                args = torch.fx.node.map_arg(src.args, lambda a: read(a, src.name))
                kwargs = torch.fx.node.map_arg(src.kwargs, lambda a: read(a, src.name))
                node = fxg.call_function(src.target, args, kwargs)
                for t, i in c._output_slots(k):
                    if alive[t]:
                        continue  # (made again while alive: the result is not used)
                    value[t] = node if i is None else fxg.call_function(operator.getitem,
                                                                         (node, i))
                    made_here.add(t)
                    alive[t] = True
                    target = update_target.get(t)
                    if target is not None and t not in written_back:
                        written_back.add(t)
                        after.append(("write", target, output(value[t])))
                done[k] += 1
                continue
            t = ident
            alive[t] = False
            if t in made_here:
                if t in grad_slot:
                    after.append(("stash", stash_of(t), "out", output(value[t])))
                made_here.discard(t)
            else:  # a tensor of E at the piece's start
                if t in grad_slot:
                    after.append(("stash", stash_of(t), "pre", len(pre)))
                    pre.append(t)
                drop.append(t)
            value.pop(t, None)
        stores = [(t, output(value[t])) for t in sorted(made_here) if alive[t]]
        last_pos = stop - 1
        gm = None
        if outputs:
            fxg.output(tuple(outputs))
            gm = torch.fx.GraphModule(tr.gm, fxg)
        elif computes:
            inputs = []  # (nothing it makes is kept: no need to run it)
        piece = _Piece(gm, inputs, drop, stores, label, stop - start) if gm is not None else None
        if piece is not None:
            piece.ops = ops
            self.pieces.append(piece)
        # write-backs whose buffer's old value a later step still reads keep a copy of it
        keep_old = {id(a) for a in after if a[0] == "write" and a[1][2] is not None
                    and last_read.get(a[1][2], -1) > last_pos}

        def run(E: list[Any], B: list[Any], X: Any, S: Any, GP: Any, GX: Any) -> None:
            held = [E[t] for t in pre]
            if piece is not None:
                outs = _run_piece(piece, E)
            else:
                outs = ()
                for t in drop:
                    E[t] = None
            for a in after:
                if a[0] == "stash":
                    a[1](held[a[3]] if a[2] == "pre" else outs[a[3]], GP, GX)
                else:
                    (where, slot, old), i = a[1], a[2]
                    if id(a) in keep_old:
                        E[old] = E[old].clone()
                    (B if where == "B" else X)[slot].copy_(outs[i])

        head = f"# {label}: {computes} compute steps, inputs {inputs}, frees {drop}"
        body = gm.code if gm is not None else "    (nothing to compute)\n"
        return run, head + "\n" + body


def compile_program(traced: Any, steps: Sequence[tuple[str, int]], forward_len: int,
                    param_slot: dict[str, int], buffer_slot: dict[str, int],
                    input_slot: dict[int, int], eager: Program) -> Program:
    """The schedule's program with its segments run as inductor-compiled pieces (see the
    module docstring); ``eager`` is ``compile_schedule``'s program of the same schedule, whose
    chunk cuts, gradient hand-over and output layouts it keeps. Pieces compile at their first
    call."""
    builder = _Builder(traced, steps, forward_len, param_slot, buffer_slot, input_slot, eager)
    program = builder.build()
    program.pieces = builder.pieces  # type: ignore[attr-defined]
    return program


#: ATen ops that inductor calls as library kernels (matmuls, convolutions, attention) rather
#: than generating code for: compiled, they run the kernel eager mode runs
_LIBRARY_KERNELS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward",
                    "_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_flash_attention_for_cpu_backward",
                    "_scaled_dot_product_efficient_attention",
                    "_scaled_dot_product_efficient_attention_backward",
                    "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_flash_attention_backward",
                    "_scaled_dot_product_cudnn_attention",
                    "_scaled_dot_product_cudnn_attention_backward")


def _library_kernel(target: str) -> bool:
    parts = target.split(".")
    return len(parts) >= 2 and parts[0] == "aten" and parts[1] in _LIBRARY_KERNELS


def compiled_op_times(graph: Any, pieces: Sequence[Any], seconds: Sequence[float]
                      ) -> list[float]:
    """Each op's time as compiled code, from the measured ``seconds`` of ``pieces`` of the
    store-all program (each op computed once, in the piece of its segment): a library kernel
    (``_LIBRARY_KERNELS``) keeps its eager time; what is left of the piece's time is the fused
    generated code's, shared among the piece's other ops by their eager times. A pointwise op
    fused into a neighbour's kernel gets the small share it adds to that kernel, which is what
    recomputing it inside a piece costs. Where the library kernels alone took longer than the
    piece (the compiled call was faster), every op of the piece is scaled alike. Ops outside
    the pieces (random ops, run eagerly) keep their eager times."""
    times = [float(op.time) for op in graph.ops]
    for piece, measured in zip(pieces, seconds):
        library = sum(times[k] for k in piece.ops if _library_kernel(graph.ops[k].target))
        generated = sum(times[k] for k in piece.ops
                        if not _library_kernel(graph.ops[k].target))
        if generated > 0 and measured >= library:
            scale_lib, scale_gen = 1.0, (measured - library) / generated
        elif library + generated > 0:
            scale_lib = scale_gen = measured / (library + generated)
        else:
            continue  # (views only: nothing to share the call's time among)
        new = {k: times[k] * (scale_lib if _library_kernel(graph.ops[k].target) else scale_gen)
               for k in piece.ops}
        for k, t in new.items():
            times[k] = t
    return times


def _iteration(hmod: Any, sample: Any) -> tuple[Callable[[], list[torch.Tensor]],
                                                 Callable[[], Any], list[torch.Tensor]] | None:
    """(step, restored, params) for training iterations of ``hmod`` on ``sample``: ``step()``
    runs one; ``with restored():`` puts back every state it changes (buffers, generators,
    inputs) and clears the ``.grad`` of what it differentiates before. None where running the
    model's backward would act beyond the iteration or the model is in eval mode."""
    import contextlib

    import torch.utils._pytree as pytree

    from hrockmate.capture.baseline import _state_restored, skip_reason
    from hrockmate.capture.joint import split_sample
    from hrockmate.capture.memory import _backward_roots

    model = hmod.wrapped_model
    if skip_reason(model) is not None or not model.training:
        return None
    args, kwargs = pytree.tree_map(
        lambda x: x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad
        else x, split_sample(sample))
    inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    params = [p for p in model.parameters() if p.requires_grad]
    fresh = params + [x for x in inputs if x.requires_grad]

    def step() -> list[torch.Tensor]:
        roots = _backward_roots(hmod(*args, **kwargs), None)[1]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
        return roots

    @contextlib.contextmanager
    def restored() -> Any:
        with _state_restored(model, inputs), torch.enable_grad():
            for t in fresh:
                t.grad = None
            yield
        for t in fresh:
            t.grad = None

    return step, restored, params


def measure_compiled_costs(hmod: Any, sample: Any, rounds: int = 3) -> dict[str, Any] | None:
    """Plan ``hmod`` on compiled op times: run the store-all schedule compiled (``rounds``
    timed iterations after one that compiles its pieces, every state put back), time each
    piece, set the graph's op times to ``compiled_op_times`` of the median times, and plan
    again for the module's budget (``replan``). Returns what was measured (also kept as
    ``hmod.compiled_costs``); None (nothing done) where the module runs store-all or a given
    plan, or cannot run an iteration here (``_iteration``)."""
    global _PIECE_SECONDS
    from hrockmate.ir.errors import InfeasibleBudget
    from hrockmate.ir.schedule import simulate, store_all_schedule

    budget = hmod.budget_bytes
    if budget is None or hmod.plan.method in ("store-all", "given"):
        return None
    run = _iteration(hmod, sample)
    if run is None:
        return None
    step, restored, _ = run
    graph = hmod.traced.graph
    store_all = store_all_schedule(graph)
    program = hmod._compile(store_all)
    pieces = list(program.pieces)  # type: ignore[attr-defined]
    old = (hmod.schedule, hmod.plan, hmod.predicted_peak_bytes,
           hmod._compiled_program("pieces"))
    hmod._install(store_all, old[1], int(simulate(graph, store_all).peak_bytes), program)
    steps_s: list[float] = []
    try:
        with restored():
            step()  # (compiles every piece)
        _PIECE_SECONDS = {}
        for _ in range(rounds):
            with restored():
                t0 = time.perf_counter()
                step()
                steps_s.append(time.perf_counter() - t0)
        measured = {k: statistics.median(v) for k, v in _PIECE_SECONDS.items()}
    finally:
        _PIECE_SECONDS = None
        hmod._install(old[0], old[1], old[2] - old[3].extra_bytes, old[3])
    seconds = [measured.get(id(p), 0.0) for p in pieces]
    eager_s = sum(float(op.time) for op in graph.ops)
    times = compiled_op_times(graph, pieces, seconds)
    report = {
        "store_all_step_s": statistics.median(steps_s),
        "pieces": len(pieces),
        "pieces_s": sum(seconds),
        "eager_op_s": eager_s,
        "compiled_op_s": sum(times),
    }
    eager_times = [float(op.time) for op in graph.ops]
    cost_report = dict(graph.meta.get("cost_report") or {})
    hmod.__dict__["_hr_eager_costs"] = (eager_times, cost_report)
    for op, t in zip(graph.ops, times):
        op.time = t
    # (a plan of compiled costs is cached apart from one of eager costs: planning.entry)
    graph.meta["cost_report"] = {**cost_report, "mode": "measure", "source": "compiled"}
    hmod.__dict__["_hr_prepared"].clear()  # (block options were chosen on eager times)
    try:
        hmod.replan(budget, sample)
    except InfeasibleBudget:  # (the eager-cost plan fits: keep it, and its times)
        for op, t in zip(graph.ops, eager_times):
            op.time = t
        graph.meta["cost_report"] = cost_report
        hmod.__dict__["_hr_prepared"].clear()
        report["replanned"] = False
    else:
        report["replanned"] = True
    hmod.__dict__["compiled_costs"] = report
    return report


def _compiled_record(hmod: Any, budget: int | None) -> tuple[Any, str | None]:
    """The plan cache and the key of this module's compiled-mode record (``None`` where
    there is no cache or no budget)."""
    from hrockmate.planning.cache import device_kind, open_cache

    request = hmod._hr_request
    store = open_cache(request.cache) if budget is not None else None
    if store is None:
        return None, None
    return store, store.compiled_key(hmod.traced.graph, budget, request.solve_options,
                                     device_kind(hmod.traced.device))


#: how often ``check_compiled_peak`` halves the lowering of a budget no plan fits
HALVINGS = 2


def check_compiled_peak(hmod: Any, sample: Any, rounds: int = 2) -> int | None:
    """Compile ``hmod``'s pieces by running one iteration on ``sample``, then measure the
    peak of a second (``hrockmate.measure_peak_memory``: the budget's definition) and keep it
    as ``hmod.measured_peak_bytes``; every state the runs change (buffers, generators,
    ``.grad``) is put back. Where the peak exceeds the budget (inductor's order kept more
    alive than the plan frees), the plan is made again for a budget lowered by the excess, or
    by half or a quarter of it where no plan fits that (``replan``), at most ``rounds``
    times, and the budget it ended at is kept in the plan cache
    (``PlanCache.save_compiled_budget``), where a rebuild plans for it at once;
    ``CompiledModeError`` when it still exceeds it, so
    that a run over the budget is never left to be found in training. None (nothing run)
    where running the model's backward would act beyond the iteration
    (``capture.baseline.skip_reason``) or the model is in eval mode."""
    from hrockmate.capture.memory import measure_peak_memory
    from hrockmate.ir.errors import InfeasibleBudget

    run = _iteration(hmod, sample)
    if run is None:
        return None
    step, restored, params = run

    def measure() -> int:
        with restored():
            step()  # (compiles every piece)
        with restored():
            # (the allocator's count: compiled code allocates without dispatching ops, which
            # the live-storage count would not see)
            return int(measure_peak_memory(step, params=params, device=hmod.traced.device,
                                           count="allocator").peak_bytes)

    budget = hmod.budget_bytes
    store, record = _compiled_record(hmod, budget)
    replans = 0
    known = store.load_compiled_budget(record, budget) if store is not None else None
    if known is not None and known < budget:
        # an earlier build measured this plan over the budget and planned again for less:
        # plan for that at once (from the plan cache) rather than compile and measure again
        try:
            hmod.replan(known, sample)
            replans += 1
        except InfeasibleBudget:
            pass
    peak = measure()
    measures = 1
    why = ""
    for _ in range(rounds if budget is not None else 0):
        if peak <= budget:
            break
        # the plan's budget lowered by the excess; where no plan fits that, by half as much
        # (the excess is inductor's and is not the same for every plan: a plan solved for
        # less than the plan in use may well fit)
        current = hmod.budget_bytes
        over = peak - budget
        for _ in range(HALVINGS + 1):
            target = current - over
            try:
                hmod.replan(target, sample)
            except InfeasibleBudget as exc:
                why = f"; no plan fits {target} bytes ({exc})"
                over //= 2
                continue
            why = ""
            replans += 1
            break
        else:
            break
        peak = measure()
        measures += 1
    hmod.__dict__["measured_peak_bytes"] = peak
    pieces = getattr(hmod._compiled_program("its pieces"), "pieces", [])
    # what building compiled mode cost beside planning (the plan's own solve time is in
    # ``plan.stats["solve_seconds"]``): the pieces' compiles, the measuring runs, the replans
    hmod.__dict__["compile_stats"] = {
        "pieces": len(pieces), "compile_seconds": sum(p.compile_s for p in pieces),
        "measuring_runs": 2 * measures, "replans": replans}
    if store is not None and budget is not None and peak <= budget:
        store.save_compiled_budget(record, hmod.budget_bytes)
    if budget is not None and peak > budget:
        over = peak - budget
        raise CompiledModeError(
            f"the compiled program measured a peak of {peak} bytes on the sample, {over} bytes "
            f"above the budget of {budget} bytes (the plan predicted "
            f"{hmod.predicted_peak_bytes}): inductor kept more alive than the plan frees{why}. "
            "Give a larger budget, or build HRockmate with compile=False (eager mode keeps "
            "the predicted peak)")
    return peak


def restore_eager_costs(hmod: Any) -> bool:
    """Put back the op times ``measure_compiled_costs`` replaced (the trace's eager ones); True
    where there were any to put back."""
    saved = hmod.__dict__.pop("_hr_eager_costs", None)
    report = hmod.__dict__.get("compiled_costs")
    if saved is None or not (report and report.get("replanned")):
        return False
    graph = hmod.traced.graph
    for op, t in zip(graph.ops, saved[0]):
        op.time = t
    graph.meta["cost_report"] = saved[1]
    hmod.__dict__["_hr_prepared"].clear()
    report["replanned"] = False
    return True


def build_compiled(hmod: Any, sample: Any) -> None:
    """What ``compile=True`` adds to construction: plan on compiled op times
    (``measure_compiled_costs``), then compile the pieces and measure the peak
    (``check_compiled_peak``). Where the plan made on compiled times cannot be brought within
    the budget, the plan on eager times is tried as well before refusing: the two plans order
    their frees differently, and inductor may keep one's buffers alive longer than the
    other's."""
    budget = hmod.budget_bytes
    measure_compiled_costs(hmod, sample)
    try:
        check_compiled_peak(hmod, sample)
    except CompiledModeError as first:
        if not restore_eager_costs(hmod):
            raise
        logger.info("the plan on compiled op times measured over the budget (%s); trying the "
                    "plan on eager op times", first)
        hmod.replan(budget, sample)
        check_compiled_peak(hmod, sample)
    finally:
        hmod.__dict__.pop("_hr_eager_costs", None)
