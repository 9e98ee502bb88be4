"""Solving: ``solve`` (model), ``solve_graph`` (graph or graph file) and ``pareto``.

The hierarchical solver (method ``"hrockmate"``) follows H-Rockmate:

1. the Rust core partitions the graph (``hrockmate.hierarchy.build_hierarchy``, partitioner
   ``contiguous``): the forward ops, in a topological order, are cut into contiguous blocks of
   a few ops, with cuts where few bytes cross; blocks are grouped again into larger blocks,
   level by level, until the top has at most ``top_size`` blocks; every backward op joins the
   block of the forward op it differentiates (without that link: the latest block whose
   forward values it reads), but never a later block than a backward op it reads from (so the
   blocks' backward parts form a DAG);
2. bottom-up, each block is a level problem (``hrockmate.ilp``) over its children (ops at the
   bottom, blocks above), whose *options* come from solving that level at several limits on its
   peak and on what it saves between forward and backward; each solution gives a forward and a
   backward schedule fragment, the saved tensors, times and memory overheads;
3. the top level is solved at the user's budget and its stages expanded into IR steps;
4. the schedule is refined (``hrockmate.refine``): recomputations the memory left under the
   budget allows to skip are dropped.

Graphs with at most ``flat_ops`` ops skip the hierarchy: the top level is then the op level,
which is Checkmate's exact model. Every plan is checked by ``hrockmate.simulate`` before it is
returned. docs/solver.md describes the models and options.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import sys
import threading
import time as _time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from hrockmate import ilp
from hrockmate import solvers as reference
from hrockmate.budget import BudgetLike, parse_budget
from hrockmate.graph import PREEXISTING_ROLES, Graph
from hrockmate.plan import InfeasibleBudget, Plan
from hrockmate.schedule import peak_lower_bound

logger = logging.getLogger("hrockmate")

Step = tuple[str, int]

METHODS = ("hrockmate", "checkmate", "checkpoint", "selective", "greedy", "twremat", "rotor",
           "recompute-all", "store-all")


class SolveError(RuntimeError):
    """The solver produced a schedule the simulator rejects (a bug); the message says which."""


# ---------------------------------------------------------------------------------------------
# simulation (the simulator is the judge of every schedule)


def _simulate(graph: Graph, steps: list[Step], forward_len: int) -> tuple[int, float]:
    from hrockmate.schedule import Schedule, simulate

    res = simulate(graph, Schedule(steps=list(steps), forward_len=forward_len))
    return int(res.peak_bytes), float(res.time)


def _baseline(graph: Graph) -> tuple[list[Step], int, int, float]:
    from hrockmate.schedule import store_all_schedule

    sched = store_all_schedule(graph)
    steps = [(str(k), int(i)) for k, i in sched.steps]
    peak, t = _simulate(graph, steps, int(sched.forward_len))
    return steps, int(sched.forward_len), peak, t


# ---------------------------------------------------------------------------------------------
# hierarchy


@dataclass
class BlockOption:
    """One way of running a block: forward and backward fragments and what they cost."""

    fwd: list[Step]
    bwd: list[Step]
    saved: frozenset[int]  # tensors kept from the forward fragment for the backward one
    saved_state: Storages  # their storages as the forward fragment left them
    fwd_time: float
    bwd_time: float
    saved_bytes: int
    # peak bytes of the block's own tensors (internal and interface outputs) above what was
    # alive before the fragment; the backward one starts with the saved tensors
    fwd_peak: int
    bwd_peak: int
    # the block's backward inputs the backward fragment reads (the parent must keep them)
    bwd_reads: frozenset[int] = frozenset()

    def key(self) -> tuple[float, float, int, int, int]:
        return (self.fwd_time, self.bwd_time, self.saved_bytes, self.fwd_peak, self.bwd_peak)

    def dominates(self, other: "BlockOption") -> bool:
        """No worse in every cost and reads no more of the block's inputs, and not the same."""
        return (all(a <= b for a, b in zip(self.key(), other.key()))
                and self.bwd_reads <= other.bwd_reads
                and (self.key(), self.bwd_reads) != (other.key(), other.bwd_reads))


@dataclass
class Block:
    """A contiguous range of forward ops with the backward ops that belong to them."""

    fwd_ops: list[int]
    bwd_ops: list[int]
    children: list["Block"] = field(default_factory=list)
    loose_bwd: list[int] = field(default_factory=list)  # backward ops no child takes
    fwd_in: list[int] = field(default_factory=list)
    fwd_out: list[int] = field(default_factory=list)
    bwd_in: list[int] = field(default_factory=list)
    bwd_out: list[int] = field(default_factory=list)
    options: list[BlockOption] = field(default_factory=list)
    is_root: bool = False
    solver: str = ""  # what made the options: "ilp", "twremat", "rotor" or "renamed"

    @property
    def all_ops(self) -> list[int]:
        return self.fwd_ops + self.bwd_ops

    def depth(self) -> int:
        return 1 + max((c.depth() for c in self.children), default=0)


class _Ctx:
    """Per-graph facts shared by the hierarchy code."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.order = ilp.topological_ops(graph)
        self.pos = {j: k for k, j in enumerate(self.order)}
        self.prod = graph.producers()
        self.readers = graph.consumers()
        self.fixed = [t.role in PREEXISTING_ROLES for t in graph.tensors]
        self.fwd = [j for j in self.order if graph.ops[j].phase == "forward"]
        self.bwd = [j for j in self.order if graph.ops[j].phase == "backward"]
        self.root = [graph.storage_root(x) for x in range(len(graph.tensors))]


def _interfaces(ctx: _Ctx, block: Block) -> None:
    """Fill a block's interface tensor lists from its op sets."""
    g = ctx.graph
    ops = set(block.all_ops)
    produced = {x for j in ops for x in g.ops[j].outputs}
    out: set[int] = set()
    for x in produced:
        if g.tensors[x].role == "output" or any(r not in ops for r in ctx.readers[x]):
            out.add(x)
    # a view leaving the block takes its storage owner with it
    for x in list(out):
        r = g.tensors[x].alias_of
        while r is not None:
            if r in produced:
                out.add(r)
            r = g.tensors[r].alias_of
    fwd_prod = {x for j in block.fwd_ops for x in g.ops[j].outputs}
    block.fwd_out = sorted(x for x in out if x in fwd_prod)
    block.bwd_out = sorted(x for x in out if x not in fwd_prod)
    fwd_in: set[int] = set()
    for j in block.fwd_ops:
        fwd_in.update(x for x in g.ops[j].inputs if x not in fwd_prod)
    bwd_in = set(fwd_in)
    read_inside: set[int] = set()
    for j in ops:
        read_inside.update(g.ops[j].inputs)
    for j in block.bwd_ops:
        bwd_in.update(x for x in g.ops[j].inputs if x not in produced)
    bwd_in.update(x for x in block.fwd_out if x in read_inside)
    block.fwd_in = sorted(fwd_in)
    block.bwd_in = sorted(bwd_in) if block.bwd_ops else []


# Children per block above the leaves. 4 rather than 8: with 8, the demo GPT-2 (230 forward ops,
# 38 leaves) had 4 blocks at the top, each spanning about 1.3 layers, and without dropout it ran
# +22.8% at 50% (+36.5% at 40%, where block checkpointing did +29%); with 4 it has 9 and runs
# +14.3% (+23.5% at 40%).
GROUP_SIZE = 4


def build_hierarchy(graph: Graph, leaf_size: int = 6, group_size: int = GROUP_SIZE,
                    top_size: int = 16, partitioner: str = "contiguous") -> Block:
    """Partition a graph into a tree of blocks; the root holds the whole graph.

    The tree is the Rust core's hierarchy (``hrockmate.hierarchy.build_hierarchy``, without
    leaf options): by default contiguous stretches of the forward order, ``leaf_size`` ops per
    leaf and ``group_size`` children per block above, at most ``top_size`` at the root; each
    backward op joins a leaf by the owner rule of docs/hierarchy.md."""
    from hrockmate import hierarchy

    ctx = _Ctx(graph)
    h = hierarchy.build_hierarchy(
        graph, partitioner=partitioner, leaf_size=leaf_size, group_size=group_size,
        # the contiguous partitioner's groups span up to 1.4x their target size
        max_size=max(2, math.ceil(1.4 * max(leaf_size, group_size)) + 1),
        top_max_size=top_size, options=False)
    by_pos = ctx.pos.__getitem__

    def block(c: hierarchy.Cluster) -> Block:
        kids = [] if c.is_leaf else [block(h.clusters[k]) for k in c.children]
        b = Block(fwd_ops=sorted(c.fwd_ops, key=by_pos), bwd_ops=sorted(c.bwd_ops, key=by_pos),
                  children=kids)
        _interfaces(ctx, b)
        return b

    top = h.clusters[h.root]
    return Block(fwd_ops=list(ctx.fwd), bwd_ops=list(ctx.bwd),
                 children=[block(h.clusters[k]) for k in top.children],
                 loose_bwd=sorted(top.own_bwd_ops, key=by_pos), is_root=True)


def flat_root(graph: Graph) -> Block:
    """The hierarchy of one level: every op is a unit of the root (Checkmate's model)."""
    ctx = _Ctx(graph)
    return Block(fwd_ops=list(ctx.fwd), bwd_ops=list(ctx.bwd), is_root=True)


# ---------------------------------------------------------------------------------------------
# a block's level problem


@dataclass
class _Unit:
    op: int | None = None
    child: Block | None = None
    backward: bool = False


@dataclass
class _Level:
    problem: ilp.LevelProblem
    units: list[_Unit]
    value_tensor: list[int]
    partner_stage: dict[int, int]  # forward child node -> stage of its backward node
    # backward child node -> inputs that nothing after it needs: its fragment frees them
    dying: dict[int, frozenset[int]] = field(default_factory=dict)


def _block_level(ctx: _Ctx, block: Block) -> _Level:
    g = ctx.graph
    units: list[_Unit] = []
    if block.children:
        units += [_Unit(child=c) for c in block.children]
        fwd_units = len(units)
        bwd_units = [_Unit(child=c, backward=True) for c in block.children if c.bwd_ops]
        bwd_units += [_Unit(op=j, backward=True) for j in block.loose_bwd]
    else:
        units += [_Unit(op=j) for j in block.fwd_ops]
        fwd_units = len(units)
        bwd_units = [_Unit(op=j, backward=True) for j in block.bwd_ops]

    def io(u: _Unit) -> tuple[list[int], list[int]]:
        if u.op is not None:
            return list(g.ops[u.op].inputs), list(g.ops[u.op].outputs)
        c = u.child
        assert c is not None
        return (c.bwd_in, c.bwd_out) if u.backward else (c.fwd_in, c.fwd_out)

    bwd_units = _order_units(ctx, bwd_units, io)
    units += bwd_units
    # values: every tensor at a unit boundary, plus the storage owners of views
    tensor_ids: dict[int, int] = {}
    value_tensor: list[int] = []

    def vid(x: int) -> int:
        if x not in tensor_ids:
            tensor_ids[x] = len(value_tensor)
            value_tensor.append(x)
            r = g.tensors[x].alias_of
            if r is not None:
                vid(r)
        return tensor_ids[x]

    unit_io = [io(u) for u in units]
    for ins, outs in unit_io:
        for x in ins + outs:
            vid(x)
    producer: dict[int, int] = {}
    for k, (_, outs) in enumerate(unit_io):
        for x in outs:
            producer.setdefault(x, k)
    interface = set(block.fwd_out) | set(block.bwd_out)
    values = []
    for x in value_tensor:
        t = g.tensors[x]
        p = producer.get(x)
        if ctx.fixed[x]:
            p = None
        counted = p is not None and x not in interface and t.alias_of is None
        r = ctx.root[x]
        holds = (p is not None and t.alias_of is not None and not ctx.fixed[r]
                 and (producer.get(r) is None or ctx.fixed[r]))
        values.append(
            ilp.LevelValue(
                name=t.name,
                bytes=int(t.bytes) if counted else 0,
                producer=p,
                keep=(x in interface or t.role == "output") and p is not None,
                root=tensor_ids[t.alias_of] if t.alias_of is not None else None,
                hold_bytes=int(g.tensors[r].bytes) if holds else 0,
            )
        )
    nodes = []
    fwd_node_of_child: dict[int, int] = {}
    for k, u in enumerate(units):
        ins, outs = unit_io[k]
        # the model adds the outputs counted at this level when the node runs; a child's
        # overhead is the rest of its peak (negative when its backward frees what it saved)
        out_counted = sum(values[tensor_ids[x]].bytes for x in dict.fromkeys(outs))
        if u.op is not None:
            op = g.ops[u.op]
            options = [ilp.NodeOption(time=float(op.time), overhead=int(op.workspace))]
            pair = None
        else:
            c = u.child
            assert c is not None
            if u.backward:
                options = [ilp.NodeOption(time=o.bwd_time,
                                          overhead=o.bwd_peak - o.saved_bytes - out_counted)
                           for o in c.options]
                pair = fwd_node_of_child[id(c)]
            else:
                options = [ilp.NodeOption(time=o.fwd_time,
                                          overhead=max(0, o.fwd_peak - o.saved_bytes - out_counted),
                                          saved=o.saved_bytes, keeps=bool(o.saved))
                           for o in c.options]
                fwd_node_of_child[id(c)] = k
                pair = None
        option_inputs = None
        if u.backward and u.child is not None:
            # what each backward fragment reads from outside itself (it may recompute from
            # saved tensors instead of reading the block's forward inputs)
            mine = set(ins)
            option_inputs = [frozenset(tensor_ids[x] for x in o.bwd_reads & mine)
                             for o in u.child.options]
        nodes.append(
            ilp.LevelNode(
                name=g.ops[u.op].name if u.op is not None else f"block@{k}",
                inputs=[tensor_ids[x] for x in ins],
                outputs=[tensor_ids[x] for x in outs],
                options=options,
                backward=u.backward,
                pair=pair,
                option_inputs=option_inputs,
            )
        )
    partner_stage = {n.pair: k for k, n in enumerate(nodes) if n.pair is not None}
    problem = ilp.LevelProblem(values, nodes, fwd_units, name=ctx.graph.name)
    lvl = _Level(problem, units, value_tensor, partner_stage)
    _dying_inputs(ctx, lvl, tensor_ids)
    return lvl


def _fragment_reads(g: Graph, steps: list[Step]) -> set[int]:
    """Tensors a fragment reads before producing them itself (with their storage owners, which a
    view being read keeps alive)."""
    made: set[int] = set()
    reads: set[int] = set()
    for kind, i in steps:
        if kind == "compute":
            reads.update(x for x in g.ops[i].inputs if x not in made)
            made.update(g.ops[i].outputs)
    for x in list(reads):
        r = g.tensors[x].alias_of
        while r is not None:
            reads.add(r)
            r = g.tensors[r].alias_of
    return reads


def _dying_inputs(ctx: _Ctx, lvl: _Level, tensor_ids: dict[int, int]) -> None:
    """Let a backward child free the inputs that no later node of the level needs as soon as
    its fragment is done with them, and charge its options' overheads accordingly.

    A backward node runs last in its stage, so an input whose last possible use is that node
    is dead afterwards; inside the fragment it can go after its last read."""
    p = lvl.problem
    a = ilp.analyse(p)
    views: dict[int, list[int]] = {}
    for v in range(len(p.values)):
        if a.storage[v] != v:
            views.setdefault(a.storage[v], []).append(v)
    for k, u in enumerate(lvl.units):
        if not (u.backward and u.child is not None):
            continue
        c = u.child
        node = p.nodes[k]
        dead = {v for v in node.inputs
                if p.values[v].producer is not None and not p.values[v].keep
                and a.need_v[v] <= k}
        dead = {v for v in dead if all(w in dead for w in views.get(v, []))}
        if not dead:
            continue
        dying = frozenset(lvl.value_tensor[v] for v in dead)
        mem = {lvl.value_tensor[v] for v in dead if p.values[v].bytes > 0}
        mem_bytes = sum(p.values[v].bytes for v in dead)
        out_counted = sum(p.values[v].bytes for v in dict.fromkeys(node.outputs))
        own = _own_storages(ctx, c)
        for o, opt in zip(node.options, c.options):
            start = {**_outside(ctx, dying, mem), **opt.saved_state}
            peak, _ = _fragment_peak(ctx, opt.bwd, own | mem, start, dying)
            opt_ov = peak - opt.saved_bytes - out_counted - mem_bytes
            o.overhead = min(o.overhead, opt_ov)
        lvl.dying[k] = dying
    del tensor_ids


def _own_storages(ctx: _Ctx, block: Block) -> set[int]:
    g = ctx.graph
    return {x for j in block.all_ops for x in g.ops[j].outputs if g.tensors[x].alias_of is None}


def _order_units(ctx: _Ctx, units: list[_Unit], io: Any) -> list[_Unit]:
    """Backward units in a topological order of their data flow (earliest ops first)."""
    made: dict[int, int] = {}
    for k, u in enumerate(units):
        for x in io(u)[1]:
            made[x] = k
    deps: list[set[int]] = [set() for _ in units]
    for k, u in enumerate(units):
        for x in io(u)[0]:
            p = made.get(x)
            if p is not None and p != k:
                deps[k].add(p)
    first = []
    for u in units:
        ops = [u.op] if u.op is not None else u.child.bwd_ops  # type: ignore[union-attr]
        first.append(min(ctx.pos[j] for j in ops))
    out = ilp.prioritized_topological_order(deps, first)
    if out is None:
        # cannot happen: block indices never increase along backward data flow
        raise SolveError("internal error: backward blocks depend on each other in a cycle")
    return [units[k] for k in out]


# ---------------------------------------------------------------------------------------------
# expanding a solved level into IR steps


def _expand(ctx: _Ctx, block: Block, lvl: _Level, sp: ilp.StagePlan
            ) -> tuple[list[Step], list[Step], frozenset[int]]:
    """Forward steps, backward steps and saved tensors of one solution of a block's level."""
    g = ctx.graph
    p = lvl.problem
    alive: set[int] = set()
    out: list[Step] = []
    fwd_steps: list[Step] = []
    phantoms: dict[tuple[int, int], frozenset[int]] = {}  # (forward node, option) -> tensors

    def free(x: int) -> None:
        if x in alive:
            alive.discard(x)
            out.append(("free", x))

    def free_phantoms(keys: Iterable[tuple[int, int]]) -> None:
        keys = [k for k in keys if k in phantoms]
        doomed: set[int] = set()
        for k in keys:
            doomed |= phantoms.pop(k)
        still = set().union(*phantoms.values()) if phantoms else set()
        for x in sorted(doomed - still):
            free(x)

    def replay(steps: list[Step], consumable: frozenset[int],
               dying: frozenset[int] = frozenset()) -> set[int]:
        protect = alive - consumable
        before = set(alive)
        last = _last_reads(g, steps, dying)
        by_step: dict[int, list[int]] = {}
        for x, s in last.items():
            by_step.setdefault(s, []).append(x)
        for x in sorted(by_step.get(-1, ())):
            free(x)
        for s, (kind, i) in enumerate(steps):
            if kind == "compute":
                out.append(("compute", i))
                alive.update(g.ops[i].outputs)
                for x in sorted(by_step.get(s, ())):
                    free(x)
            elif i not in protect:
                free(i)
        return alive - before

    for t, stage in enumerate(sp.computes):
        # saved memory that is neither kept nor used in this stage goes first
        used_here = {i for i, _ in stage}
        drop = [k for k in phantoms if k not in sp.kept_saved[t]
                and lvl.partner_stage.get(k[0]) not in used_here]
        free_phantoms(drop)
        for x in sp.frees_before[t]:
            free(lvl.value_tensor[x])
        for (i, o), freed in zip(stage, sp.frees[t]):
            u = lvl.units[i]
            if u.op is not None:
                out.append(("compute", u.op))
                alive.update(g.ops[u.op].outputs)
            elif not u.backward:
                c = u.child
                assert c is not None
                opt = c.options[o]
                made = replay(opt.fwd, frozenset())
                for x in sorted(made - set(c.fwd_out) - opt.saved):
                    free(x)
                if opt.saved:
                    phantoms[(i, o)] = frozenset(opt.saved & alive) | phantoms.get((i, o),
                                                                                   frozenset())
                    keep = (i, o) in sp.kept_saved[t] or lvl.partner_stage.get(i) == t
                    if not keep:
                        free_phantoms([(i, o)])
            else:
                c = u.child
                assert c is not None
                opt = c.options[o]
                f = p.nodes[i].pair
                assert f is not None
                mine = phantoms.get((f, o), frozenset())
                made = replay(opt.bwd, mine, lvl.dying.get(i, frozenset()))
                for x in sorted(made - set(c.bwd_out)):
                    free(x)
                # every saved tensor of this block dies with its backward
                free_phantoms([k for k in phantoms if k[0] == f])
                for x in sorted(mine):
                    free(x)
            for x in freed:
                free(lvl.value_tensor[x])
        if t == p.n_forward - 1:
            fwd_steps = out
            out = []
    interface = set(block.fwd_out) | set(block.bwd_out)
    saved = frozenset(x for x in _alive_after(g, fwd_steps) if x not in interface)
    bwd_steps = out
    if block.bwd_ops and not block.is_root:
        bwd_steps = bwd_steps + _leftover_frees(g, fwd_steps + bwd_steps, interface)
    return fwd_steps, bwd_steps, saved


FREEABLE_ROLES = frozenset({"activation", "param_grad", "input_grad", "buffer_update"})


def _leftover_frees(g: Graph, steps: list[Step], interface: set[int]) -> list[Step]:
    """Frees that close a block's backward fragment: it leaves nothing of its own behind but
    its interface tensors, which are the parent's to free."""
    return [("free", x) for x in sorted(_alive_after(g, steps))
            if x not in interface and g.tensors[x].role in FREEABLE_ROLES]


def _alive_after(g: Graph, steps: list[Step]) -> set[int]:
    alive: set[int] = set()
    for kind, i in steps:
        if kind == "compute":
            alive.update(g.ops[i].outputs)
        else:
            alive.discard(i)
    return alive


def _last_reads(g: Graph, steps: list[Step], tensors: frozenset[int]) -> dict[int, int]:
    """Step index after which each of ``tensors`` is no longer read (-1: never read)."""
    last = {x: -1 for x in tensors}
    for s, (kind, i) in enumerate(steps):
        if kind == "compute":
            for x in g.ops[i].inputs:
                if x in last:
                    last[x] = s
    return last


Storages = dict[int, tuple[int, int]]  # alive tensor -> (storage instance, its bytes)


def _fragment_peak(ctx: _Ctx, steps: list[Step], counted: set[int], start: Storages,
                   dying: frozenset[int] = frozenset()) -> tuple[int, Storages]:
    """Peak bytes of the ``counted`` storages over a fragment and the storages alive at its end.

    Storages are followed as the simulator does: an op producing a tensor that is not alive
    allocates a new storage even when a view still holds the old one; a view shares its base's.
    ``start`` is what is alive before; ``dying`` tensors are dropped after their last read."""
    g = ctx.graph
    alive: Storages = dict(start)
    last = _last_reads(g, steps, dying)
    for x, s in last.items():
        if s < 0:
            alive.pop(x, None)
    by_step: dict[int, list[int]] = {}
    for x, s in last.items():
        by_step.setdefault(s, []).append(x)
    fresh = max((k for k, _ in alive.values()), default=0) + 1

    def live_bytes() -> int:
        return sum(dict(alive.values()).values())

    cur = peak = live_bytes()
    for s, (kind, i) in enumerate(steps):
        if kind == "compute":
            op = g.ops[i]
            new = sum(g.tensors[x].bytes for x in op.outputs
                      if g.tensors[x].alias_of is None and x in counted)
            peak = max(peak, cur + new + int(op.workspace))
            for x in op.outputs:
                if x in alive:
                    continue  # recomputed while alive: a temporary, dropped again
                base = g.tensors[x].alias_of
                if base is None:
                    alive[x] = (fresh, g.tensors[x].bytes if x in counted else 0)
                    fresh += 1
                elif base in alive:
                    alive[x] = alive[base]
                else:  # a view of something this fragment does not count
                    alive[x] = (fresh, 0)
                    fresh += 1
            for x in by_step.get(s, ()):
                alive.pop(x, None)
        else:
            alive.pop(i, None)
        cur = live_bytes()
        peak = max(peak, cur)
    return peak, alive


def _outside(ctx: _Ctx, tensors: Iterable[int], counted: set[int]) -> Storages:
    """Storages of tensors alive before a fragment: one per storage owner."""
    g = ctx.graph
    out: Storages = {}
    for x in tensors:
        r = ctx.root[x]
        out[x] = (-1 - r, g.tensors[r].bytes if r in counted else 0)
    return out


def _make_option(ctx: _Ctx, block: Block, lvl: _Level, sp: ilp.StagePlan) -> BlockOption:
    fwd, bwd, saved = _expand(ctx, block, lvl, sp)
    return _option_from_steps(ctx, block, fwd, bwd, saved)


def _option_from_steps(ctx: _Ctx, block: Block, fwd: list[Step], bwd: list[Step],
                       saved: frozenset[int]) -> BlockOption:
    """A block option's costs, measured on its forward and backward fragments."""
    g = ctx.graph
    own = _own_storages(ctx, block)
    peak_f, after_f = _fragment_peak(ctx, fwd, own, {})
    # A saved view of a storage made outside this block keeps that storage too: if the parent
    # frees and recomputes the owner, both copies exist. Count it, once per storage owner.
    saved_state: Storages = {}
    for x in saved:
        r = ctx.root[x]
        if r in own:
            saved_state[x] = after_f[x]
        else:
            saved_state[x] = (-1 - r, 0 if ctx.fixed[r] else g.tensors[r].bytes)
    saved_bytes = sum(b for _, b in set(saved_state.values()))
    # forward outputs recomputed by the backward fragment are counted as if they stayed
    peak_b, _ = _fragment_peak(ctx, bwd, own, saved_state)
    t_f = sum(g.ops[i].time for k, i in fwd if k == "compute")
    t_b = sum(g.ops[i].time for k, i in bwd if k == "compute")
    reads = frozenset(_fragment_reads(g, bwd) & set(block.bwd_in))
    return BlockOption(fwd, bwd, saved, saved_state, t_f, t_b, saved_bytes, peak_f, peak_b,
                       reads)


def _pareto_filter(options: list[BlockOption]) -> list[BlockOption]:
    uniq: dict[tuple[Any, ...], BlockOption] = {}
    for o in options:
        uniq.setdefault((o.key(), o.bwd_reads), o)
    opts = list(uniq.values())
    keep = [o for o in opts if not any(q is not o and q.dominates(o) for q in opts)]
    return sorted(keep, key=lambda o: o.saved_bytes)


class HierarchyTimeout(ilp.LevelNoSolution):
    """The blocks' options were not all solved before the hierarchy's share of the time limit
    ran out (the caller then uses the simple strategies)."""


# Share of a solve's time limit the blocks' options may use: the top level and the simple
# strategies need the rest.
HIERARCHY_TIME_SHARE = 0.75
# Share of the time left after the blocks that the top level may use: the simple strategies and
# the refinement need the rest. On the 10k-op unrolled LSTM at time_limit=60 the top level took
# all of it (33 s, stopped with an 8.9% gap at +28.2%), and block checkpointing, then given no
# time, tried one block count where its best fits at +22.9%.
TOP_TIME_SHARE = 0.7
# Share of the time left that one refinement (hrockmate.refine) may use.
REFINE_TIME_SHARE = 0.2


@dataclass
class _Settings:
    time_limit: float | None
    sub_time_limit: float
    mip_rel_gap: float
    # caps on what a block's forward keeps, as fractions of what its fastest schedule keeps. The
    # 1/8 cap took the demo GPT-2 at 50% from +22.9% to +21.5% and at 30% from +48.3% to +43.7%,
    # and the 24-layer enc-dec at 30% from +35.1% to +33.2%, for ~15% more block-solving time.
    saved_fractions: tuple[float, ...] = (0.0, 0.125, 0.25, 0.5, 0.75)
    peak_fractions: tuple[float, ...] = (0.5,)
    solvers: dict[str, str] = field(default_factory=dict)  # level kind -> solver
    deadline: float | None = None  # perf_counter time by which every block must be solved


# Time for a block's solves under a cap on what its forward keeps, in sub_time_limits: they are
# options offered to the parent, and on blocks of thousands of ops (groups of unrolled steps)
# proving them took 10-20 s each where the best schedule found in a few seconds is as good.
_FRACTION_TIME = 3.0


def _block_options(ctx: _Ctx, block: Block, st: _Settings) -> list[BlockOption]:
    """Solve a block's level at several limits and keep the Pareto-optimal results.

    The limits: none (the fastest schedule); caps on what the forward keeps for the backward
    (fractions of what the fastest keeps, 0 = keep nothing); the lowest peak; and peaks in
    between the lowest and the fastest one. ``st.solvers`` may give leaves to TW-Remat and
    chains of children to Rotor (``hrockmate.level_solvers``); the ILP takes what they cannot."""
    extra: list[BlockOption] = []
    if st.solvers.get("leaves") in ("twremat", "ilp+twremat") and not block.children:
        from hrockmate import level_solvers

        found = level_solvers.twremat_leaf_options(ctx, block)
        if found and st.solvers["leaves"] == "twremat":
            block.solver = "twremat"
            return found
        extra = found or []
    if st.solvers.get("chains") == "rotor" and block.children:
        from hrockmate import level_solvers

        chain = level_solvers.chain_level(ctx, block)
        found = level_solvers.rotor_block_options(ctx, block, chain) if chain else []
        if found:
            block.solver = "rotor"
            return found
    block.solver = "ilp"
    lvl = _block_level(ctx, block)
    boundary0 = 0.0 if block.bwd_ops else None

    # solves without a memory limit are easy and always have a solution: give them time
    easy = max(10.0 * st.sub_time_limit, 30.0)

    def attempt(limit: float = st.sub_time_limit, **a: Any) -> BlockOption | None:
        # the fastest option is solved closely; the memory-limited ones, which are only
        # choices offered to the parent and much harder, to 1%
        limited = a.get("budget") is not None or a.get("boundary_limit") is not None
        if st.deadline is not None:
            left = st.deadline - _time.perf_counter()
            if left <= 0:
                raise HierarchyTimeout(f"the time limit ran out while solving the blocks of "
                                       f"'{ctx.graph.name}'")
            limit = min(limit, left)
        try:
            sp = ilp.solve_level(lvl.problem, **a, time_limit=limit,  # type: ignore[arg-type]
                                 mip_rel_gap=max(st.mip_rel_gap, 1e-2 if limited else 1e-3))
        except (ilp.LevelInfeasible, ilp.LevelNoSolution):
            return None
        return _make_option(ctx, block, lvl, sp)

    first = attempt(easy, budget=None)
    if first is None and st.deadline is not None and _time.perf_counter() >= st.deadline:
        raise HierarchyTimeout(f"the time limit ran out while solving the blocks of "
                               f"'{ctx.graph.name}'")
    if first is None:
        raise SolveError(f"internal error: a block of '{ctx.graph.name}' has no schedule even "
                         "without a memory limit")
    options = [first]
    if block.bwd_ops and first.saved_bytes > 0:
        for frac in st.saved_fractions:
            o = attempt(_FRACTION_TIME * st.sub_time_limit, budget=None,
                        boundary_limit=frac * first.saved_bytes)
            if o is not None:
                options.append(o)
    low = attempt(budget=None, minimize_peak=True, boundary_limit=boundary0)
    if low is not None:
        options.append(low)
        internal = _internal_storages(ctx, block)
        hi_peak, lo_peak = _internal_peak(ctx, first, internal), _internal_peak(ctx, low, internal)
        for frac in st.peak_fractions:
            if hi_peak <= lo_peak:
                break
            o = attempt(budget=lo_peak + frac * (hi_peak - lo_peak), boundary_limit=None)
            if o is not None:
                options.append(o)
    if extra:
        block.solver = "ilp+twremat"
    return _pareto_filter(options + extra)


def _internal_storages(ctx: _Ctx, block: Block) -> set[int]:
    interface = set(block.fwd_out) | set(block.bwd_out)
    return {x for x in _own_storages(ctx, block) if x not in interface}


def _internal_peak(ctx: _Ctx, o: BlockOption, internal: set[int]) -> int:
    """An option's peak as its own level counts it (internal tensors only)."""
    start = {x: (iid, b if ctx.root[x] in internal else 0) for x, (iid, b) in o.saved_state.items()}
    return max(_fragment_peak(ctx, o.fwd, internal, {})[0],
               _fragment_peak(ctx, o.bwd, internal, start)[0])


@dataclass
class _Shape:
    """A block's structure up to renaming. Blocks with equal keys (repeated layers) have the same
    level problem up to op and tensor ids, so one's options, renamed, are the other's."""

    key: tuple[Any, ...]
    ops: list[int]  # the block's ops in canonical order
    tensors: list[int]  # the tensors they touch (and their storage owners), in canonical order


def _block_shape(ctx: _Ctx, block: Block) -> _Shape:
    g = ctx.graph
    child_of = {j: i for i, c in enumerate(block.children) for j in c.all_ops}
    local: dict[int, int] = {}
    tensors: list[int] = []

    def ref(x: int) -> int:
        if x not in local:
            local[x] = len(tensors)
            tensors.append(x)
        return local[x]

    ops = block.all_ops + block.loose_bwd
    op_items = []
    for j in ops:
        o = g.ops[j]
        op_items.append((o.phase, o.target, o.time, o.workspace, child_of.get(j, -1),
                         tuple(ref(x) for x in o.inputs), tuple(ref(x) for x in o.outputs)))
    flags = [set(block.fwd_in), set(block.bwd_in), set(block.fwd_out), set(block.bwd_out)]
    tensor_items = []
    k = 0
    while k < len(tensors):  # storage owners join the list as they are met
        x = tensors[k]
        t = g.tensors[x]
        alias = ref(t.alias_of) if t.alias_of is not None else -1
        tensor_items.append((t.bytes, t.role, alias, ctx.fixed[x], *(x in f for f in flags)))
        k += 1
    return _Shape((tuple(op_items), tuple(tensor_items)), ops, tensors)


def _renamed_options(ctx: _Ctx, src: Block, src_shape: _Shape, dst: Block,
                     dst_shape: _Shape) -> list[BlockOption] | None:
    """``src``'s options for the equally shaped ``dst`` (None if a step falls outside the
    mapping, which would be a bug in ``_block_shape``; the caller then solves ``dst``)."""
    op_map = dict(zip(src_shape.ops, dst_shape.ops))
    t_map = dict(zip(src_shape.tensors, dst_shape.tensors))

    def steps(fragment: list[Step]) -> list[Step]:
        return [(k, op_map[i] if k == "compute" else t_map[i]) for k, i in fragment]

    try:
        return [_option_from_steps(ctx, dst, steps(o.fwd), steps(o.bwd),
                                   frozenset(t_map[x] for x in o.saved)) for o in src.options]
    except KeyError:
        logger.debug("block shape mapping missed a tensor; solving the block itself")
        return None


@dataclass
class Hierarchy:
    """A graph's block tree with every non-root block's options computed."""

    graph: Graph
    root: Block
    ctx: _Ctx
    seconds: float
    blocks: int
    solved_blocks: int  # blocks whose level was solved; the others reuse an equal block's options
    solvers: dict[str, str] = field(default_factory=dict)

    def solver_counts(self) -> dict[str, int]:
        """How many blocks each solver gave options to (``renamed``: copied from an equal
        block)."""
        counts: dict[str, int] = {}
        stack = list(self.root.children)
        while stack:
            b = stack.pop()
            stack.extend(b.children)
            counts[b.solver] = counts.get(b.solver, 0) + 1
        return counts


def prepare(graph: Graph, *, flat_ops: int = 60, leaf_size: int = 6, group_size: int = GROUP_SIZE,
            top_size: int = 16, time_limit: float | None = None, sub_time_limit: float = 1.0,
            mip_rel_gap: float = 1e-4, progress: bool = True,
            workers: int | None = None, solvers: Mapping[str, str] | None = None) -> Hierarchy:
    """Build the hierarchy and compute the options of every block below the root.

    Blocks of the same height are independent: ``workers`` threads solve them at once (HiGHS
    releases the GIL while it solves; model building and the rest stay serial). Default: one per
    core, at most ``MAX_WORKERS``. Ctrl-C or an error in one block stops every thread's solve
    within about 0.1 s."""
    t0 = _time.perf_counter()
    ctx = _Ctx(graph)
    if graph.num_ops <= flat_ops:
        root = flat_root(graph)
    else:
        root = build_hierarchy(graph, leaf_size, group_size, top_size)
    from hrockmate.level_solvers import check_solvers

    chosen = check_solvers(solvers)
    st = _Settings(time_limit, sub_time_limit, mip_rel_gap, solvers=chosen,
                   deadline=None if time_limit is None
                   else t0 + HIERARCHY_TIME_SHARE * time_limit)
    by_height: dict[int, list[Block]] = {}

    def post(b: Block) -> int:
        height = 1 + max((post(c) for c in b.children), default=0)
        if not b.is_root:
            by_height.setdefault(height, []).append(b)
        return height

    post(root)
    total = sum(len(v) for v in by_height.values())
    workers = default_workers() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    bar = _Progress(total, f"solving {total} blocks of '{graph.name}'", progress)
    cancel = threading.Event()

    def options_of(b: Block) -> list[BlockOption]:
        with ilp.cancelled_by(cancel):
            return _block_options(ctx, b, st)

    solved = 0
    pool = ThreadPoolExecutor(workers, thread_name_prefix="hrockmate-blocks") if workers > 1 \
        else None
    try:
        for height in sorted(by_height):
            # repeated layers give blocks of equal shape: solve one of each, rename for the rest
            firsts: dict[tuple[Any, ...], tuple[Block, _Shape]] = {}
            copies: list[tuple[Block, _Shape, Block, _Shape]] = []
            for b in by_height[height]:
                shape = _block_shape(ctx, b)
                if shape.key in firsts:
                    copies.append((b, shape, *firsts[shape.key]))
                else:
                    firsts[shape.key] = (b, shape)
            blocks = [b for b, _ in firsts.values()]
            if pool is not None and len(blocks) > 1:
                futures = [pool.submit(options_of, b) for b in blocks]
                results: Iterable[list[BlockOption]] = (f.result() for f in futures)
            else:
                results = (options_of(b) for b in blocks)
            for b, options in zip(blocks, results):
                b.options = options
                solved += 1
                bar.update()
            for b, shape, src, src_shape in copies:
                renamed = _renamed_options(ctx, src, src_shape, b, shape)
                if renamed is None:
                    renamed = options_of(b)
                    solved += 1
                else:
                    b.solver = "renamed"
                b.options = renamed
                bar.update()
    except BaseException:
        cancel.set()  # the other threads' solves stop at HiGHS's next interrupt check
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return Hierarchy(graph, root, ctx, _time.perf_counter() - t0, total, solved, chosen)


# Block-solving threads at most: beyond this, the serial Python parts dominate.
MAX_WORKERS = 8


def default_workers() -> int:
    """Threads for the hierarchy's blocks: one per available core (the CPU affinity, and a
    container's CPU quota where cgroup v2 sets one), at most ``MAX_WORKERS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:  # "max 100000" (no quota) or "<quota> <period>" in microseconds
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, min(MAX_WORKERS, cores))


# The top MILP stops once its best schedule has not improved for this long (nor for half the
# time it took to find it: ``ilp.run_highs``). On the T5 of the third-party tests (815 ops, 15
# top blocks) at 40% HiGHS found its last better schedule 9.6 s into the top solve and then
# spent the rest of a 60 s limit (or 210 s of the default 300 s) failing to prove it optimal:
# the solve took 43.5 s, and 16.8 s with this rule, for the same plan (+25.6%).
TOP_STALL_SECONDS = 5.0


def solve_top(h: Hierarchy, budget: int | None, *, time_limit: float | None, mip_rel_gap: float,
              minimize_peak: bool = False) -> tuple[list[Step], int, bool, dict[str, Any]]:
    """The top level at ``budget`` (None: no limit, or the least peak with ``minimize_peak``):
    (steps, forward length, proven optimal, statistics). Raises ``ilp.LevelInfeasible`` or
    ``ilp.LevelNoSolution`` when it finds nothing."""
    if h.solvers.get("top") == "rotor":
        from hrockmate import level_solvers

        chain = level_solvers.chain_level(h.ctx, h.root)
        if chain is not None:
            lo, hi = level_solvers._chain_bounds(chain)
            limit = 2 * hi if budget is None and not minimize_peak else (
                int(lo * 1.01) + 1 if budget is None else budget)
            plan = level_solvers.rotor_plan(chain, limit)
            if plan is not None:
                fwd, bwd = level_solvers.expand_chain(h.ctx, h.root, chain, plan)
                return fwd + bwd, len(fwd), False, {"top_solver": "rotor"}
            logger.info("Rotor finds no schedule of the top chain of '%s' within %d bytes "
                        "(its least is %d); solving the top with the ILP", h.graph.name, limit,
                        lo)
        else:
            logger.info("the top level of '%s' is not a chain; solving it with the ILP",
                        h.graph.name)
    lvl = _block_level(h.ctx, h.root)
    sp = ilp.solve_level(lvl.problem, budget, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
                         minimize_peak=minimize_peak, stall=TOP_STALL_SECONDS)
    if sp.stats.get("stopped") == "stall":
        gap = sp.stats.get("mip_gap")
        logger.info("the top MILP of '%s' stopped after %.1f s: its best schedule had stopped "
                    "improving (%s)", h.graph.name, sp.stats["solve_seconds"],
                    "gap unknown" if gap is None else f"within {100 * gap:.1f}% of optimal")
    fwd, bwd, _ = _expand(h.ctx, h.root, lvl, sp)
    return fwd + bwd, len(fwd), sp.optimal, {**sp.stats, "top_solver": "ilp"}


class _Progress:
    """tqdm when it is installed, else log lines at most every few seconds."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self.t0 = self.last = _time.perf_counter()
        self.bar = None
        if enabled and total > 1:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, desc=desc, leave=False)
            except ImportError:
                self.bar = None
        self.enabled = enabled

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        now = _time.perf_counter()
        if self.enabled and now - self.last > 3.0:
            self.last = now
            logger.info("%s: %d/%d (%.0f s)", self.desc, self.n, self.total, now - self.t0)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ---------------------------------------------------------------------------------------------
# public API


def _as_graph(graph_or_path: Graph | str | os.PathLike[str]) -> Graph:
    if isinstance(graph_or_path, Graph):
        return graph_or_path
    if isinstance(graph_or_path, (str, os.PathLike)):
        return Graph.load(Path(graph_or_path))
    raise TypeError(
        f"expected a hrockmate.Graph or the path of a graph file, got "
        f"{type(graph_or_path).__name__}; for a torch model use hrockmate.solve(model, sample, "
        "budget)"
    )


@dataclass
class _Candidate:
    steps: list[Step]
    forward_len: int
    optimal: bool
    stats: dict[str, Any]


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def solve_graph(
    graph_or_path: Graph | str | os.PathLike[str],
    budget: BudgetLike,
    *,
    method: str = "hrockmate",
    time_limit: float | None = 300.0,
    mip_rel_gap: float = 1e-4,
    flat_ops: int = 60,
    leaf_size: int = 6,
    group_size: int = GROUP_SIZE,
    top_size: int = 16,
    sub_time_limit: float = 1.0,
    progress: bool = True,
    hierarchy: Hierarchy | None = None,
    solvers: Mapping[str, str] | None = None,
    exact_ops: int = 100,
) -> Plan:
    """Plan one training iteration given as a graph (IR JSON or a node-link file).

    Args:
        budget: a number in (0, 1] or a percentage (a fraction of the store-all peak), a whole
            number above 1 (bytes) or a string with a unit (``"6GiB"``); see
            ``hrockmate.parse_budget``.
        method: ``"hrockmate"`` (hierarchical H-ILP; graphs of at most ``flat_ops`` ops are
            solved at the op level, i.e. exactly), ``"checkmate"`` (exact MILP over all ops),
            ``"checkpoint"`` (per-block checkpointing), ``"selective"`` (the same, keeping
            matmul/conv/attention outputs), ``"twremat"`` (the fastest of TW-Remat's recursion
            depths that fits), ``"rotor"`` (Rotor's dynamic program; the graph must split into
            a chain of stages), ``"recompute-all"`` or ``"store-all"``.
        time_limit: seconds (positive, or None for no limit) for the whole solve: the blocks'
            options get 75% of it, then the top level and the simple strategies the rest.
            When it runs out the best plan found is returned with a warning and
            ``plan.stats["optimal"] = False``.
        exact_ops: graphs of more than ``flat_ops`` and at most ``exact_ops`` ops whose
            hierarchy plan is beaten by a fallback, is missing, or recomputes over 10% are
            also tried at the op level, for at most 60 s.
        solvers: (method ``"hrockmate"``) the solver of each kind of level:
            ``{"leaves": "ilp" | "twremat", "chains": "ilp" | "rotor", "top": "ilp" | "rotor"}``
            (missing keys: ``"ilp"``). Rotor takes a level only when its children form a chain
            and TW-Remat a leaf only when it can schedule it; the ILP solves the others.
            ``plan.stats["block_solvers"]`` counts the blocks each solver gave options to and
            ``plan.stats["top_solver"]`` says which solved the top.

    The plan never costs more than block checkpointing, selective checkpointing or (on
    chain-shaped graphs) whole-graph Rotor at the same budget: when one of them is faster it
    is returned (``plan.stats["fallback"]`` names it). Raises ``hrockmate.InfeasibleBudget``
    (stating the smallest peak reached) when no schedule fits. A budget at or above the
    store-all peak returns the store-all schedule.
    """
    _check_method(method)
    if time_limit is not None and not (isinstance(time_limit, (int, float))
                                       and math.isfinite(time_limit) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds or None, "
                         f"got {time_limit!r}")
    from hrockmate.level_solvers import check_solvers

    chosen = check_solvers(solvers)
    graph = _as_graph(graph_or_path)
    t0 = _time.perf_counter()
    base_steps, base_fl, base_peak, base_time = _baseline(graph)
    budget_bytes = parse_budget(budget, base_peak)

    def plan_of(c: _Candidate, peak: int, t: float) -> Plan:
        stats = dict(c.stats)
        stats["optimal"] = bool(c.optimal)
        stats["solve_seconds"] = round(_time.perf_counter() - t0, 4)
        return Plan(
            graph_hash=graph.structure_hash(),
            graph_name=graph.name,
            budget_bytes=budget_bytes,
            peak_bytes=peak,
            time=t,
            baseline_peak_bytes=base_peak,
            baseline_time=base_time,
            steps=list(c.steps),
            forward_len=c.forward_len,
            time_unit=graph.time_unit,
            stats=stats,
        )

    if budget_bytes >= base_peak:
        c = _Candidate(base_steps, base_fl, True,
                       {"method": "store-all", "note": "the budget is at or above the store-all peak"})
        return plan_of(c, base_peak, base_time)
    if method == "store-all":
        raise InfeasibleBudget(budget_bytes, base_peak, graph.name)
    floor, why = peak_lower_bound(graph)  # refuses a budget far too small at once
    if budget_bytes < floor:
        raise InfeasibleBudget(budget_bytes, floor, graph.name, why=why)

    kw = dict(time_limit=time_limit, mip_rel_gap=mip_rel_gap, flat_ops=flat_ops,
              leaf_size=leaf_size, group_size=group_size, top_size=top_size,
              sub_time_limit=sub_time_limit, progress=progress, solvers=chosen,
              deadline=None if time_limit is None else t0 + time_limit)
    cand, lowest = _run_method(graph, method, budget_bytes, hierarchy, kw)
    if (method == "hrockmate" and hierarchy is None and flat_ops < graph.num_ops <= exact_ops
            and (cand is None or cand.stats.get("fallback")
                 or _simulate(graph, cand.steps, cand.forward_len)[1] > 1.1 * base_time)):
        # the hierarchy's own plan lost to a fallback, there is none, or it recomputes much:
        # on a graph this small the op-level MILP often does better, within a short limit
        # (long skips, as in U-Nets, are where the hierarchy's blocks hold the most)
        logger.info("the hierarchy of '%s' fell back or recomputes over 10%%; trying the "
                    "op-level MILP", graph.name)
        # (its own lowest-peak MILP is skipped: slow at the op level, and the hierarchy's
        # fallbacks are already known)
        # 60 s when the hierarchy has no plan of its own, 20 s to improve one it has
        cap = 60.0 if cand is None or cand.stats.get("fallback") else 20.0
        left = _time_left(kw)
        flat_kw = {**kw, "flat_ops": graph.num_ops,
                   "time_limit": min(cap if left is None else left, cap),
                   "deadline": _time.perf_counter() + min(cap if left is None else left, cap),
                   "lowest_peak": False, "hierarchy_retry": False}
        alt, alt_lowest = _run_method(graph, method, budget_bytes, None, flat_kw)
        if alt is not None and not alt.stats.get("fallback") and (
                cand is None or _simulate(graph, alt.steps, alt.forward_len)[1]
                < _simulate(graph, cand.steps, cand.forward_len)[1]):
            cand = alt
        lowest = min(lowest, alt_lowest) if cand is None else 0
    if cand is None:
        raise InfeasibleBudget(budget_bytes, lowest, graph.name)
    peak, t = _validate(graph, cand, budget_bytes)
    plan = plan_of(cand, peak, t)
    shortfall = plan.shortfall(time_limit)
    if shortfall:
        import warnings

        warnings.warn(shortfall, stacklevel=2)
    logger.info("%s", plan.summary())
    return plan


def _time_left(kw: Mapping[str, Any]) -> float | None:
    """Seconds left of the solve's ``time_limit`` (None: no limit)."""
    deadline = kw.get("deadline")
    return None if deadline is None else max(0.0, deadline - _time.perf_counter())


def _run_literature(graph: Graph, method: str, budget: int, time_limit: float | None = None
                    ) -> tuple[_Candidate | None, int]:
    """TW-Remat or Rotor on the whole graph (hrockmate.literature) within ``time_limit``
    seconds: the candidate, or (None, the lowest peak the method reaches). Raises
    TimeoutError when the time runs out, MemoryError when Rotor's tables cannot fit."""
    from hrockmate import literature

    if method == "twremat":
        points = literature.twremat(graph, time_limit=time_limit)
        fits = [p for p in points if p.sim.peak_bytes <= budget]
        if not fits:
            return None, min(p.sim.peak_bytes for p in points)
        best = min(fits, key=lambda p: p.sim.time)
        sched, stats = best.schedule, {"depth_limit": best.depth_limit}
    else:
        deadline = None if time_limit is None else _time.perf_counter() + time_limit
        try:
            sched, _ = literature.rotor(graph, budget, time_limit=time_limit)
        except InfeasibleBudget as exc:
            left = None if deadline is None else max(0.0, deadline - _time.perf_counter())
            return None, _rotor_lowest(graph, exc.min_bytes, left)
        stats = {}
    steps = [(str(k), int(i)) for k, i in sched.steps]
    return _Candidate(steps, int(sched.forward_len), False, {"method": method, **stats}), 0


def _rotor_lowest(graph: Graph, model_min: int, time_limit: float | None = None) -> int:
    """The smallest budget Rotor is seen to solve. Its dynamic program rounds sizes up to memory
    slots, so the chain model's minimum itself may be out of reach: probe just above it, for
    at most ``time_limit`` seconds in all (then the model's minimum is the answer)."""
    from hrockmate import literature

    deadline = None if time_limit is None else _time.perf_counter() + time_limit
    for factor in (1.0, 1.0001, 1.001, 1.01, 1.05, 1.2):
        left = None if deadline is None else max(0.0, deadline - _time.perf_counter())
        try:
            literature.rotor(graph, int(model_min * factor), time_limit=left)
            return int(model_min * factor)
        except InfeasibleBudget:
            continue
        except TimeoutError:
            break
    return model_min


def _validate(graph: Graph, c: _Candidate, budget_bytes: int) -> tuple[int, float]:
    """Simulate a candidate; a rejected or over-budget schedule is a solver bug."""
    from hrockmate.schedule import ScheduleError

    try:
        peak, t = _simulate(graph, c.steps, c.forward_len)
    except ScheduleError as exc:
        raise SolveError(
            f"internal error: method {c.stats.get('method')} produced a schedule the simulator "
            f"rejects for '{graph.name}': {exc}"
        ) from None
    if peak > budget_bytes:
        raise SolveError(
            f"internal error: method {c.stats.get('method')} produced a schedule with peak "
            f"{peak} bytes over the budget of {budget_bytes} bytes for '{graph.name}'"
        )
    return peak, t


def _run_method(graph: Graph, method: str, budget: int, hierarchy: Hierarchy | None,
                kw: dict[str, Any]) -> tuple[_Candidate | None, int]:
    """The method's candidate within the budget, or (None, the lowest peak that was reached).

    When a MILP gives nothing within the budget, the low-memory schedules met on the way
    (recompute-all, the MILP's own lowest-peak schedule, block checkpointing) are tried; the
    fastest that fits is returned, marked not optimal."""
    from hrockmate.schedule import recompute_all_schedule

    spares: list[tuple[_Candidate, int, float]] = []  # (candidate, peak, time)

    def spare(label: str, steps: list[Step], fl: int, **stats: Any) -> None:
        peak, t = _simulate(graph, steps, fl)
        spares.append((_Candidate(steps, fl, False, {"method": method, "fallback": label,
                                                       **stats}), peak, t))

    try:
        rc = recompute_all_schedule(graph)
    except MemoryError as exc:  # TooLargeError: O(n^2) steps on a long chain
        if method == "recompute-all":
            raise
        logger.info("no recompute-all fallback for '%s': %s", graph.name, exc)
    else:
        spare("recompute-all", [(str(k), int(i)) for k, i in rc.steps], int(rc.forward_len))
    if method == "recompute-all":
        spares[0][0].stats.pop("fallback")
        return _pick(spares, budget, method, graph)
    if method in ("checkpoint", "selective"):
        try:
            r = reference.solve_checkpoint(graph, budget, _simulate,
                                           selective=method == "selective")
        except reference.SolverInfeasible as exc:
            # keeping no block at all is recompute-all, the checkpointing with least memory
            cand, lowest = _pick(spares, budget, method, graph)
            return cand, int(min(lowest, exc.min_bytes))
        return _Candidate(r.steps, r.forward_len, False, {"method": method, **r.stats}), 0

    if method in ("twremat", "rotor"):
        return _run_literature(graph, method, budget, _time_left(kw))
    if method == "greedy":
        found = reference.greedy_eviction_schedule(graph, budget, _time_left(kw))
        if found is not None and _simulate(graph, *found)[0] <= budget:
            return _Candidate(found[0], found[1], False, {"method": "greedy"}), 0
        cand, lowest = _pick(spares, budget, method, graph)
        if cand is not None:
            logger.warning("greedy eviction got stuck for '%s' within %d bytes; using %s",
                           graph.name, budget, cand.stats["fallback"])
        return cand, lowest

    if method == "checkmate":
        def again(b: int) -> reference.SolverResult:
            return reference.solve_checkmate(graph, b, time_limit=_time_left(kw),
                                           mip_rel_gap=kw["mip_rel_gap"])

        try:
            r = again(budget)
            cand = _Candidate(r.steps, r.forward_len, r.optimal, {"method": "checkmate",
                                                                  **r.stats})
            return _retighten(graph, budget, cand, again), 0
        except (reference.SolverInfeasible, ilp.LevelInfeasible) as exc:
            # not proven infeasible (time limit, too large): say why before falling back
            proven = getattr(exc, "proven", True)
            logger.log(logging.INFO if proven else logging.WARNING, "checkmate: %s", exc)
        try:
            steps, fl, _, _ = reference.min_peak_checkmate(graph, _time_left(kw))
            spare("lowest-peak MILP", steps, fl)
        except (ilp.LevelInfeasible, ilp.LevelNoSolution):
            pass
    else:
        try:
            h = hierarchy if hierarchy is not None else prepare(
                graph, flat_ops=kw["flat_ops"], leaf_size=kw["leaf_size"],
                group_size=kw["group_size"], top_size=kw["top_size"],
                time_limit=_time_left(kw), sub_time_limit=kw["sub_time_limit"],
                mip_rel_gap=kw["mip_rel_gap"], progress=kw["progress"], solvers=kw["solvers"])
        except HierarchyTimeout as exc:
            logger.warning("%s; using the simple strategies (raise time_limit to let the "
                           "hierarchy finish)", exc)
            h = None
        if h is not None:
            stats_h = {"method": "hrockmate", "levels": h.root.depth(), "blocks": h.blocks,
                       "solved_blocks": h.solved_blocks, "solvers": dict(h.solvers),
                       "block_solvers": h.solver_counts(),
                       "hierarchy_seconds": round(h.seconds, 4)}

            def top(b: int) -> reference.SolverResult:
                left = _time_left(kw)
                if left is not None and h.root.children:  # (a flat level is the whole solve)
                    left *= TOP_TIME_SHARE
                steps, fl, optimal, stats = solve_top(h, b, time_limit=left,
                                                      mip_rel_gap=kw["mip_rel_gap"])
                return reference.SolverResult(steps, fl, optimal, stats)

            # an op-level MILP cut short by the time limit may lose to the hierarchy
            flat = not h.root.children and kw["flat_ops"] > 0
            try:
                r = top(budget)
                cand = _retighten(graph, budget, _Candidate(
                    r.steps, r.forward_len, r.optimal, {**stats_h, **r.stats}), top)
                cand = _refined(graph, budget, cand, kw)
                if flat and not cand.optimal and kw.get("hierarchy_retry", True):
                    alt, _ = _run_method(graph, method, budget, None, {**kw, "flat_ops": 0})
                    if alt is not None and (_simulate(graph, alt.steps, alt.forward_len)[1]
                                            < _simulate(graph, cand.steps, cand.forward_len)[1]):
                        return alt, 0
                if h.root.children:
                    # the hierarchy's memory model is conservative; near its lowest budgets block
                    # checkpointing, or Rotor on a chain-shaped graph, can be faster, and both cost
                    # little to check
                    best, best_time = cand, _simulate(graph, cand.steps, cand.forward_len)[1]
                    simple, _ = _simple_strategies(graph, budget, method, _time_left(kw))
                    for alt, _peak, alt_time in simple:
                        if alt_time < best_time:
                            # the hierarchy's figures stay (top_solver, ...): what it did and
                            # what beat it
                            alt.stats = {**cand.stats, **alt.stats, "optimal": False,
                                         "beats_hierarchy_plan": True}
                            best, best_time = alt, alt_time
                    if best is not cand:  # the fallback gets the same refinement
                        best = _refined(graph, budget, best, kw)
                    return best, 0
                return cand, 0
            except ilp.LevelInfeasible:
                pass
            except ilp.LevelNoSolution:
                if flat and kw.get("hierarchy_retry", True):
                    logger.info("no op-level schedule for '%s' in %s s; solving hierarchically",
                                graph.name, kw["time_limit"])
                    return _run_method(graph, method, budget, None, {**kw, "flat_ops": 0})
            try:
                if kw.get("lowest_peak", True):
                    steps, fl, _, _ = solve_top(h, None, time_limit=_time_left(kw),
                                                mip_rel_gap=1e-3, minimize_peak=True)
                    spare("lowest-peak H-ILP", steps, fl, **stats_h)
            except (ilp.LevelInfeasible, ilp.LevelNoSolution):
                pass
    simple, minima = _simple_strategies(graph, budget, method, _time_left(kw))
    spares.extend(simple)
    cand, lowest = _pick(spares, budget, method, graph)
    if cand is not None and method == "hrockmate":
        cand = _refined(graph, budget, cand, kw)
    if cand is None:
        lowest = min([lowest, *minima.values()])
    elif cand.stats["fallback"] == "recompute-all":
        logger.warning(
            "%s found no schedule for '%s' within %d bytes and only recompute-all fits (the "
            "lowest peaks reached: %s)", method, graph.name, budget,
            ", ".join(f"{k} {v} bytes" for k, v in minima.items()) or "none")
    else:
        logger.warning("%s found no schedule for '%s' within %d bytes; using %s", method,
                       graph.name, budget, cand.stats["fallback"])
    return cand, lowest


def _simple_strategies(graph: Graph, budget: int, method: str, time_limit: float | None = None
                       ) -> tuple[list[tuple[_Candidate, int, float]], dict[str, int]]:
    """The simple strategies no plan may lose to, each at its fastest setting within the
    budget: block checkpointing, selective checkpointing, whole-graph Rotor (chain-shaped
    graphs only) and greedy eviction (DTR-style, any graph), within ``time_limit`` seconds.
    Returns them as (candidate, peak, time), marked as fallbacks, and the lowest peak each of
    the first three reaches (for the log and the error when nothing fits)."""
    from hrockmate.literature import NotAChainError

    out: list[tuple[_Candidate, int, float]] = []
    lowest: dict[str, int] = {}
    deadline = None if time_limit is None else _time.perf_counter() + time_limit
    # shares of the time left: checkpointing 1/4, selective 1/3 of the rest, Rotor half of
    # what remains, greedy eviction the rest
    for share, (label, selective) in ((4, ("checkpoint", False)), (3, ("selective", True))):
        left = None if deadline is None else max(0.0, deadline - _time.perf_counter()) / share
        points = reference.checkpoint_points(graph, _simulate, selective, left)
        lowest[label] = min(p[0] for p in points)
        fits = [p for p in points if p[0] <= budget]
        if fits:
            peak, t, blocks, steps, fl = min(fits, key=lambda p: p[1])
            out.append((_Candidate(steps, fl, False, {"method": method, "fallback": label,
                                                      "blocks": blocks}), peak, t))
    try:
        rotor, rotor_lowest = _run_literature(
            graph, "rotor", budget,
            None if deadline is None else max(0.0, deadline - _time.perf_counter()) / 2)
    except NotAChainError:
        rotor = None
    except (TimeoutError, MemoryError) as exc:  # out of time, or tables too large
        logger.info("whole-graph Rotor skipped for '%s': %s", graph.name, exc)
        rotor = None
    else:
        if rotor is None:
            lowest["rotor"] = rotor_lowest
        else:
            rotor.stats = {"method": method, "fallback": "rotor"}
            peak, t = _simulate(graph, rotor.steps, rotor.forward_len)
            out.append((rotor, peak, t))
    left = None if deadline is None else max(0.0, deadline - _time.perf_counter())
    found = reference.greedy_eviction_schedule(graph, budget, left)
    if found is not None:
        peak, t = _simulate(graph, *found)
        if peak <= budget:
            out.append((_Candidate(found[0], found[1], False,
                                   {"method": method, "fallback": "greedy"}), peak, t))
    return out, lowest


def _pick(spares: list[tuple[_Candidate, int, float]], budget: int, method: str, graph: Graph
          ) -> tuple[_Candidate | None, int]:
    fits = [(t, c) for c, peak, t in spares if peak <= budget]
    if fits:
        return min(fits, key=lambda tc: tc[0])[1], 0
    # (no spare at all: the callers take the minimum with block checkpointing's lowest peak)
    return None, int(min((peak for _, peak, _ in spares), default=sys.maxsize))


def _refined(graph: Graph, budget: int, cand: _Candidate, kw: Mapping[str, Any]) -> _Candidate:
    """``cand`` with the recomputations its memory slack allows dropped
    (``hrockmate.refine``); ``stats["refined"]`` counts them and gives the time before."""
    from hrockmate.refine import refine

    left = _time_left(kw)
    # a share of the time left, less a margin for what follows (the simple strategies; the
    # final simulation of a 40k-step schedule takes ~0.5 s): on the 10k-op LSTM a round takes
    # ~2 s and the later rounds gain little
    r = refine(graph, cand.steps, cand.forward_len, budget,
               deadline=None if left is None
               else _time.perf_counter() + min(left - 1.0, REFINE_TIME_SHARE * left))
    if r is None:
        return cand
    logger.info("refinement dropped %d recomputations of the %s plan for '%s': time %.6g -> "
                "%.6g", r.dropped, cand.stats.get("method"), graph.name, r.time_before, r.time)
    return _Candidate(r.steps, r.forward_len, cand.optimal,
                      {**cand.stats, "refined": {"dropped": r.dropped,
                                                 "time_before": r.time_before}})


def _retighten(graph: Graph, budget: int, cand: _Candidate,
               again: Any) -> _Candidate:
    """If a MILP schedule ended over the budget (solver tolerances, or a level's memory model
    missing a corner of the simulator's storage rules), solve again a little lower, each time
    further. Raises ``ilp.LevelInfeasible`` when no attempt fits: the caller then falls back."""
    target = budget
    for attempt in range(5):
        peak, _t = _simulate(graph, cand.steps, cand.forward_len)
        if peak <= budget:
            return cand
        target = int(target - (peak - budget) - max(1, budget * 2e-3 * attempt))
        logger.debug("schedule %d bytes over the budget; solving again at %d", peak - budget,
                     target)
        try:
            r = again(target)
        except (reference.SolverInfeasible, ilp.LevelInfeasible, ilp.LevelNoSolution):
            break
        cand = _Candidate(r.steps, r.forward_len, r.optimal, {**cand.stats, **r.stats})
    if _simulate(graph, cand.steps, cand.forward_len)[0] <= budget:
        return cand
    logger.warning("the %s schedules for '%s' stayed over the budget of %d bytes; falling back",
                   cand.stats.get("method"), graph.name, budget)
    raise ilp.LevelInfeasible("no schedule within the budget after re-solving lower")


def solve(model: Any, sample: Any, budget: BudgetLike, *, loss_fn: Any = None,
          cache: Any = None, **options: Any) -> Plan:
    """Trace one training iteration of ``model`` on ``sample`` and plan it within ``budget``.

    ``options`` are those of ``solve_graph`` (``method``, ``time_limit``, ...). The budget bounds
    activation memory: the peak, during forward and backward, of memory allocated by the
    iteration beyond what existed before it, not counting the parameters' ``.grad`` tensors.
    ``cache``: the plan cache (``hrockmate.plan_cache``): ``None`` the default location, a
    directory, or ``False`` to measure op times and solve afresh without reading or writing it.
    """
    from hrockmate.plan_cache import device_kind, measured_times, open_cache
    from hrockmate.schedule import simulate, store_all_schedule
    from hrockmate.tracing import trace_model

    store = open_cache(cache)
    traced = trace_model(model, sample, loss_fn=loss_fn, cost="estimate")
    graph = traced.graph
    key = None
    if store is not None:
        baseline = int(simulate(graph, store_all_schedule(graph)).peak_bytes)
        key = store.plan_key(graph, parse_budget(budget, baseline), options,
                             device_kind(traced.device), purpose="solve")
        cached = store.load_plan(key, graph)
        if cached is not None:
            return cached
    measured_times(traced, model, sample, store)
    plan = solve_graph(graph, budget, **options)
    if store is not None:
        store.save_plan(key, plan)
    return plan




@dataclass
class ParetoPoint:
    budget_bytes: int
    plan: Plan | None  # None when the budget is infeasible

    @property
    def feasible(self) -> bool:
        return self.plan is not None

    @property
    def peak_bytes(self) -> int | None:
        return None if self.plan is None else self.plan.peak_bytes

    @property
    def time(self) -> float | None:
        return None if self.plan is None else self.plan.time


def with_hierarchy(graph: Graph, options: Mapping[str, Any]) -> dict[str, Any]:
    """``solve_graph`` options for several solves of ``graph`` (other budgets): with method
    ``"hrockmate"`` the hierarchy and its block options are built once here and reused, so
    each solve only solves the top level. When the time limit runs out while building it, the
    options are returned as they are (each solve then falls back as it would alone)."""
    options = dict(options)
    if options.get("method", "hrockmate") == "hrockmate" and options.get("hierarchy") is None:
        keys = ("flat_ops", "leaf_size", "group_size", "top_size", "time_limit",
                "sub_time_limit", "mip_rel_gap", "progress", "solvers")
        defaults = inspect.signature(solve_graph).parameters  # as solve_graph would prepare it
        try:
            options["hierarchy"] = prepare(
                graph, **{k: options.get(k, defaults[k].default) for k in keys})
        except HierarchyTimeout:
            pass
    return options


def pareto(
    graph_or_model: Any,
    budgets: Sequence[BudgetLike],
    sample: Any = None,
    *,
    loss_fn: Any = None,
    **options: Any,
) -> list[ParetoPoint]:
    """Time against memory over many budgets, from one hierarchy (block options are computed
    once and reused; only the top level is solved per budget). ``graph_or_model`` is a Graph, a
    graph file, or a torch model together with ``sample``."""
    if sample is not None:
        from hrockmate.tracing import trace

        graph = trace(graph_or_model, sample) if loss_fn is None else trace(
            graph_or_model, sample, loss_fn=loss_fn)
    else:
        graph = _as_graph(graph_or_model)
    _check_method(options.get("method", "hrockmate"))
    options = with_hierarchy(graph, options)
    points = []
    for b in budgets:
        try:
            points.append(ParetoPoint(0, solve_graph(graph, b, **options)))
            points[-1].budget_bytes = points[-1].plan.budget_bytes  # type: ignore[union-attr]
        except InfeasibleBudget as exc:
            points.append(ParetoPoint(exc.budget_bytes, None))
    return points
