"""Solvers from the literature inside the hierarchy (``solve(..., solvers=...)``).

The hierarchical solver gives every block a list of options (``solve.BlockOption``). By default
each level is solved by the H-ILP. This module lets other solvers take a level's place:

- ``leaves="twremat"``: a leaf block becomes a small graph of its own (its inputs given, its
  forward outputs kept) and TW-Remat's schedules at every recursion depth become the block's
  options, each cut where its forward ends;
- ``chains="rotor"`` / ``top="rotor"``: when a block's children form a chain (each reads only
  its predecessor's outputs, each backward only its own tensors, its input and its
  successor's gradients), Rotor's dynamic program runs over the children's options: a child
  either runs its forward keeping only its outputs, or keeps the saved tensors of one of its
  options for its backward. Below the top, the block's options are Rotor's schedules at several
  memory limits; at the top, the schedule at the user's budget.

Whatever a plug-in returns is measured on its real steps (``solve.option_from_steps``) and the
final plan is simulated, so a loose cost model costs quality, never validity.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Mapping

from hrockmate.ir.graph import PREEXISTING_ROLES, Graph, GraphError, Op, Tensor
from hrockmate.ir.plan import InfeasibleBudget
from hrockmate.ir.schedule import Step
from hrockmate.planning import literature
from hrockmate.planning.blocks import Block, BlockOption, GraphFacts
from hrockmate.planning.level import (
    FREEABLE_ROLES,
    alive_after,
    leftover_frees,
    option_from_steps,
    pareto_filter,
)

logger = logging.getLogger("hrockmate")

#: the solvers each kind of level accepts; the first is the default
LEVEL_SOLVERS: dict[str, tuple[str, ...]] = {
    "leaves": ("ilp", "rust", "ilp+rust", "twremat", "ilp+twremat"),
    "chains": ("ilp", "rotor"),
    "top": ("ilp", "rotor"),
}


def check_solvers(solvers: Mapping[str, str] | None) -> dict[str, str]:
    """``solvers`` completed with the defaults; a ValueError names an unknown level or solver."""
    chosen = {level: names[0] for level, names in LEVEL_SOLVERS.items()}
    if solvers is None:
        return chosen
    if not isinstance(solvers, Mapping):
        raise TypeError(
            f"solvers must be a dict such as {{'chains': 'rotor'}}, got {type(solvers).__name__}")
    for level, name in solvers.items():
        if level not in LEVEL_SOLVERS:
            raise ValueError(f"solvers: unknown level {level!r}; the levels are "
                             f"{', '.join(LEVEL_SOLVERS)}")
        if name not in LEVEL_SOLVERS[level]:
            raise ValueError(f"solvers: {level!r} cannot use {name!r}; choose one of "
                             f"{', '.join(LEVEL_SOLVERS[level])}")
        chosen[level] = name
    return chosen


# ---------------------------------------------------------------------------------------------
# TW-Remat at the leaves


def _block_subgraph(ctx: GraphFacts, block: Block) -> tuple[Graph, list[int], list[int]]:
    """The block as a graph of its own: tensors made outside are given (forward ones as inputs,
    backward ones as tangents), forward outputs leaving the block are outputs, gradients
    leaving it must be produced. Returns the graph and its op and tensor ids in ``ctx.graph``."""
    g = ctx.graph
    ops = block.fwd_ops + block.bwd_ops
    producer = {x: j for j in ops for x in g.ops[j].outputs}
    fwd_out, bwd_out = set(block.fwd_out), set(block.bwd_out)
    sub = Graph(name=f"{g.name}/block", time_unit=g.time_unit)
    new: dict[int, int] = {}
    tensor_of: list[int] = []

    def add(x: int) -> int:
        if x in new:
            return new[x]
        t = g.tensors[x]
        alias = add(t.alias_of) if t.alias_of is not None else None
        grad_of = updates = None
        if x not in producer:
            if t.role in PREEXISTING_ROLES:
                role = t.role
            else:
                p = ctx.prod[x]
                role = "tangent" if p is not None and g.ops[p].phase == "backward" else "input"
        elif x in fwd_out:
            role = "output"
        elif x in bwd_out or t.role == "param_grad":
            role = "input_grad"
        elif t.role == "buffer_update":
            role = "buffer_update"
            updates = add(t.updates) if t.updates is not None else None
        else:
            role = t.role
        new[x] = sub.add_tensor(Tensor(t.name, 0 if alias is not None else t.bytes, role=role,
                                       alias_of=alias, grad_of=grad_of, updates=updates))
        tensor_of.append(x)
        return new[x]

    op_new = {j: k for k, j in enumerate(ops)}
    for j in ops:
        o = g.ops[j]
        sub.add_op(Op(
            name=o.name, phase=o.phase, time=o.time, target=o.target, workspace=o.workspace,
            inputs=[add(x) for x in o.inputs], outputs=[add(x) for x in o.outputs],
            differentiates=op_new.get(o.differentiates) if o.differentiates is not None else None,
            random=o.random, mutates_buffer=o.mutates_buffer, module=o.module,
        ))
    return sub, ops, tensor_of


def twremat_leaf_options(ctx: GraphFacts, block: Block) -> list[BlockOption] | None:
    """TW-Remat's schedules of a leaf block as its options (None when TW-Remat cannot take
    the block; the caller then uses the ILP)."""
    try:
        sub, op_of, tensor_of = _block_subgraph(ctx, block)
        points = literature.twremat(sub)
    except (GraphError, ValueError, literature.LiteratureSolverError) as exc:
        logger.debug("TW-Remat cannot take a block of '%s' (%s); using the ILP",
                     ctx.graph.name, exc)
        return None
    options = []
    for p in points:
        steps = [("compute", op_of[int(i)]) if kind == "compute" else ("free", tensor_of[int(i)])
                 for kind, i in p.schedule.steps]
        fl = int(p.schedule.forward_len)
        options.append(_leaf_option(ctx, block, steps[:fl], steps[fl:]))
    return pareto_filter(options) if options else None


def native_leaf_options(ctx: GraphFacts, block: Block) -> list[BlockOption] | None:
    """The Rust core's options of a leaf block (docs/hierarchy.md, "Options": the Pareto front
    of what the forward saves against the backward's recomputation, enumerated exactly), or
    None when the hierarchy was built without them."""
    if not block.native_options:
        return None
    return pareto_filter([_leaf_option(ctx, block, o.fwd_steps, o.bwd_steps)
                          for o in block.native_options])


def _leaf_option(ctx: GraphFacts, block: Block, fwd: list[Step], bwd: list[Step]
                 ) -> BlockOption:
    """A leaf option from a forward and a backward fragment that another solver wrote over the
    graph's ids: frees of interface tensors are dropped (the parent frees them), what the
    forward leaves alive inside the block is what it saves, and the backward frees the rest."""
    interface = set(block.fwd_out) | set(block.bwd_out)
    fwd = [s for s in fwd if s[0] == "compute" or s[1] not in interface]
    bwd = [s for s in bwd if s[0] == "compute" or s[1] not in interface]
    saved = frozenset(x for x in alive_after(ctx.graph, fwd) if x not in interface)
    bwd += leftover_frees(ctx.graph, fwd + bwd, interface)
    return option_from_steps(ctx, block, fwd, bwd, saved)


#: leaf solvers other than the ILP: block -> options (None: cannot take this block)
LEAF_PROVIDERS = {"twremat": twremat_leaf_options, "rust": native_leaf_options}


# ---------------------------------------------------------------------------------------------
# Rotor on chain levels


@dataclass
class ChainLevel:
    """A block whose children form a chain, as Rotor sees it.

    A child's forward outputs are split in two: ``outputs`` (a_k, read by the next child) and
    ``handed_back`` (read only by the previous child's backward, as in graphs whose backward of
    an op reads the next op's output). The latter live, like a gradient, from the child's
    backward to the previous child's, so Rotor counts them with the gradient it produces."""

    children: list[Block]
    stages: list[literature.ChainStage]
    plain: list[int]  # per child: the option whose forward a plain ``Forward`` runs
    outputs: list[frozenset[int]]
    handed_back: list[frozenset[int]]
    grads_in: list[frozenset[int]]  # per child: what its backward receives from the next child


def _storage_bytes(ctx: GraphFacts, tensors: Iterable[int]) -> int:
    g = ctx.graph
    roots = {ctx.root[x] for x in tensors if not ctx.fixed[x]}
    return sum(g.tensors[r].bytes for r in roots if not ctx.fixed[r])


def chain_level(ctx: GraphFacts, block: Block) -> ChainLevel | None:
    """The chain formed by ``block``'s children, or None when they do not form one."""
    kids = block.children
    n = len(kids)
    if n < 2 or block.loose_bwd or any(not c.bwd_ops or not c.options for c in kids):
        return None
    g = ctx.graph
    fixed = ctx.fixed
    block_ops = set(block.all_ops)
    ops_of = [set(c.all_ops) for c in kids]
    outputs: list[frozenset[int]] = []
    handed_back: list[frozenset[int]] = []
    for k, c in enumerate(kids):
        given = set(kids[k - 1].fwd_out) if k > 0 else set(block.fwd_in)
        if any(not fixed[x] and x not in given for x in c.fwd_in):
            return None
        nxt = ops_of[k + 1] if k + 1 < n else set()
        prev_bwd = set(kids[k - 1].bwd_ops) if k > 0 else set()
        a, b = set(), set()
        for x in c.fwd_out:
            readers = [r for r in ctx.readers[x] if r not in ops_of[k]]
            inside = [r for r in readers if r in block_ops]
            if len(inside) < len(readers) and k + 1 < n:
                return None  # read outside the block, but not at the end of the chain
            if any(r not in nxt and r not in prev_bwd for r in inside):
                return None  # read by a child further away
            to_prev = any(r in prev_bwd for r in inside)
            if to_prev and any(r in nxt for r in inside):
                return None
            (b if to_prev else a).add(x)
        outputs.append(frozenset(a))
        handed_back.append(frozenset(b))
    top_grads = {x for j in block.bwd_ops for x in g.ops[j].inputs
                 if ctx.prod[x] is None or ctx.prod[x] not in block_ops}
    grads_in = []
    for k, c in enumerate(kids):
        later = (set(kids[k + 1].bwd_out) | handed_back[k + 1]) if k + 1 < n else top_grads
        allowed = set(c.fwd_in) | set(c.fwd_out) | later
        if any(not fixed[x] and x not in allowed for x in c.bwd_in):
            return None
        for x in c.bwd_out:  # a gradient goes to the previous child only
            if any(r in block_ops and (k == 0 or r not in kids[k - 1].bwd_ops)
                   for r in ctx.readers[x]):
                return None
        grads_in.append(frozenset(x for x in c.bwd_in if x in later and not fixed[x]))
    stages, plain = [], []
    for k, c in enumerate(kids):
        out = _storage_bytes(ctx, outputs[k])
        state_out = _storage_bytes(ctx, c.fwd_out)
        grad = _storage_bytes(ctx, set(c.bwd_out) | handed_back[k])
        p = min(range(len(c.options)), key=lambda i: (c.options[i].saved_bytes,
                                                      c.options[i].fwd_time))
        plain.append(p)
        po = c.options[p]
        stages.append(literature.ChainStage(
            fwd_time=po.fwd_time, out_bytes=out, grad_bytes=grad,
            fwd_overhead=max(0, po.fwd_peak - out),
            options=[literature.StateOption(
                fwd_time=o.fwd_time, state_bytes=o.saved_bytes + state_out,
                fwd_overhead=max(0, o.fwd_peak - o.saved_bytes - state_out),
                bwd_time=o.bwd_time, bwd_overhead=max(0, o.bwd_peak - o.saved_bytes - grad))
                for o in c.options],
        ))
    return ChainLevel(list(kids), stages, plain, outputs, handed_back, grads_in)


def expand_chain(ctx: GraphFacts, block: Block, chain: ChainLevel,
                 plan: literature.ChainPlan) -> tuple[list[Step], list[Step]]:
    """IR steps of a Rotor plan over a chain of blocks: (forward, backward) fragments."""
    g = ctx.graph
    interface = set(block.fwd_out) | set(block.bwd_out)
    alive: set[int] = set()
    out: list[Step] = []
    fwd: list[Step] | None = None
    states: dict[int, tuple[int, frozenset[int]]] = {}

    def free(x: int) -> None:
        if x in alive and x not in interface and g.tensors[x].role in FREEABLE_ROLES:
            alive.discard(x)
            out.append(("free", x))

    def run(steps: list[Step], consumable: frozenset[int]) -> set[int]:
        protect = alive - consumable
        before = set(alive)
        for kind, i in steps:
            if kind == "compute":
                out.append(("compute", i))
                alive.update(g.ops[i].outputs)
            elif i not in protect:
                free(i)
        return alive - before

    for kind, k, o in plan.ops:
        c = chain.children[k - 1]
        if kind == "backward" and fwd is None:
            fwd, out = out, []
        if kind == "forward":
            made = run(c.options[chain.plain[k - 1]].fwd, frozenset())
            for x in sorted(made - chain.outputs[k - 1]):
                free(x)
        elif kind == "forward_all":
            opt = c.options[o]
            made = run(opt.fwd, frozenset())
            for x in sorted(made - set(c.fwd_out) - opt.saved):
                free(x)
            states[k] = (o, frozenset(opt.saved & alive))
        elif kind == "backward":
            o, saved = states.pop(k)
            made = run(c.options[o].bwd, saved)
            # the full state goes, except what the previous child's backward still reads
            doomed = (made - set(c.bwd_out)) | saved | set(c.fwd_out) | chain.grads_in[k - 1]
            for x in sorted(doomed - chain.handed_back[k - 1]):
                free(x)
        else:  # free a_k
            for x in chain.outputs[k - 1]:
                free(x)
    if fwd is None:
        fwd, out = out, []
    bwd = out
    if not block.is_root:
        bwd = bwd + leftover_frees(g, fwd + bwd, interface)
    return fwd, bwd


def chain_bounds(chain: ChainLevel) -> tuple[int, int]:
    """(least memory Rotor needs, memory that lets it keep every stage's fastest state)."""
    try:
        literature.rotor_chain(chain.stages, 0)
        lo = 0
    except InfeasibleBudget as exc:
        lo = int(exc.min_bytes)
    hi = sum(max(o.state_bytes for o in s.options) for s in chain.stages)
    hi += max(s.grad_bytes for s in chain.stages)
    hi += max(max(o.fwd_overhead + o.bwd_overhead for o in s.options) for s in chain.stages)
    return lo, max(hi, lo + 1)


def rotor_plan(chain: ChainLevel, limit: int) -> literature.ChainPlan | None:
    try:
        return literature.rotor_chain(chain.stages, limit)
    except InfeasibleBudget:
        return None


def rotor_block_options(ctx: GraphFacts, block: Block, chain: ChainLevel,
                        fractions: tuple[float, ...] = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)
                        ) -> list[BlockOption]:
    """A chain block's options: Rotor's schedules at limits from its least memory up to what
    keeping every state needs."""
    lo, hi = chain_bounds(chain)
    options = []
    for f in fractions:
        limit = int(lo * 1.01 + f * (hi - lo)) + 1 if f < 1.0 else 2 * hi
        plan = rotor_plan(chain, limit)
        if plan is None:
            continue
        fwd, bwd = expand_chain(ctx, block, chain, plan)
        made = alive_after(ctx.graph, fwd)
        interface = set(block.fwd_out) | set(block.bwd_out)
        saved = frozenset(x for x in made if x not in interface)
        options.append(option_from_steps(ctx, block, fwd, bwd, saved))
    return pareto_filter(options)
