"""A block's level problem: its children (or ops) as units of ``ilp.LevelProblem``, and a
solved level expanded back into IR steps with the fragments' costs measured."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

from hrockmate.ir.graph import Graph
from hrockmate.ir.plan import SolveError
from hrockmate.ir.schedule import Step
from hrockmate.planning import ilp
from hrockmate.planning.blocks import Block, BlockOption, GraphFacts, Storages

logger = logging.getLogger("hrockmate")

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


def block_level(ctx: GraphFacts, block: Block) -> _Level:
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
    _release_parts(ctx, units, values, value_tensor, nodes)
    problem = ilp.LevelProblem(values, nodes, fwd_units, name=ctx.graph.name)
    return _Level(problem, units, value_tensor, partner_stage)


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


def _release_parts(ctx: GraphFacts, units: list[_Unit], values: list[ilp.LevelValue],
                   value_tensor: list[int], nodes: list[ilp.LevelNode]) -> None:
    """Cut each child's fragments where inputs it reads go for the last time
    (``ilp.NodeOption.parts``), measured with the simulator's storage rules: an input storage
    that the level frees right after the node is gone, inside the fragment, after its last
    read (``expand_level`` passes those frees to the fragment as dying)."""

    def owner(x: int) -> int:
        while values[x].root is not None:
            x = values[x].root  # type: ignore[assignment]
        return x

    nbytes = [v.bytes for v in values]
    for k, u in enumerate(units):
        c = u.child
        if c is None:
            continue
        node = nodes[k]
        # the input storages the level counts and may free after this node, with the node's
        # input tensors of each
        holders: dict[int, list[int]] = {}
        for y in dict.fromkeys(node.inputs):
            x = owner(y)
            v = values[x]
            if v.bytes > 0 and v.producer is not None and not v.keep and x not in node.outputs:
                holders.setdefault(x, []).append(y)
        if not holders:
            continue
        out_counted = sum(values[v].bytes for v in dict.fromkeys(node.outputs))
        own = own_storages(ctx, c)
        for idx, (o, opt) in enumerate(zip(node.options, c.options)):
            # an option frees only storages it reads: those are alive when it runs (the level
            # frees one it does not read before the node, if nothing else needs it)
            reads = None if node.option_inputs is None else node.option_inputs[idx]
            mine = {x: ys for x, ys in holders.items()
                    if reads is None or any(y in reads for y in ys)}
            steps = opt.bwd if u.backward else opt.fwd
            if not mine or not steps:
                continue
            tensors = {value_tensor[y] for ys in mine.values() for y in ys}
            roots = {value_tensor[x] for x in mine}
            start = _outside(ctx, tensors, roots)
            if u.backward:
                start.update(opt.saved_state)
            during, released = ctx.memory.fragment_profile(steps, own | roots, start, tensors)
            gone = {x: released[-1 - value_tensor[x]] for x in mine
                    if -1 - value_tensor[x] in released}
            n = len(steps)
            # the fragment's own memory per step: the input storages still held taken off
            drop = [0] * (n + 1)
            for x, r in gone.items():
                drop[r + 1] += values[x].bytes
            held: list[int] = []
            h = sum(values[x].bytes for x in mine)
            for s in range(n):
                h -= drop[s]
                held.append(h)
            base = opt.saved_bytes + out_counted
            cuts = sorted({0} | {r + 1 for r in gone.values() if r + 1 < n})
            parts = []
            for i, a in enumerate(cuts):
                b = cuts[i + 1] if i + 1 < len(cuts) else n
                ov = max(d - h for d, h in zip(during[a:b], held[a:b])) - base
                # (a forward part may be below the outputs and saved bytes the level counts
                # from the node's start: those not made yet are not held)
                parts.append((ov, frozenset(x for x, r in gone.items() if r < a)))
            parts = _binding_parts(parts, nbytes)
            if len(parts) == 1 and not parts[0][1]:
                o.overhead = min(o.overhead, parts[0][0])
            else:
                o.parts = parts


def _binding_parts(parts: list[tuple[int, frozenset[int]]], nbytes: list[int]
                   ) -> list[tuple[int, frozenset[int]]]:
    """The parts whose rows other parts do not imply (each part releases what the ones before
    it do, and more): a later part with no more overhead than an earlier one is implied by
    it; an earlier one is implied by a later one whose overhead less all it may release beyond
    it is still as high."""
    rising: list[tuple[int, frozenset[int]]] = []
    for ov, frees in parts:
        if not rising or ov > rising[-1][0]:  # (the kept overheads rise)
            rising.append((ov, frees))
    kept = []
    for i, (ov, frees) in enumerate(rising):
        if not any(ov2 - sum(nbytes[x] for x in frees2 - frees) >= ov
                   for ov2, frees2 in rising[i + 1:]):
            kept.append((ov, frees))
    return kept


def own_storages(ctx: GraphFacts, block: Block) -> set[int]:
    g = ctx.graph
    return {x for j in block.all_ops for x in g.ops[j].outputs if g.tensors[x].alias_of is None}


def _order_units(ctx: GraphFacts, units: list[_Unit], io: Any) -> list[_Unit]:
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


def op_stages(lvl: _Level, steps: list[Step]) -> list[list[tuple[int, int]]] | None:
    """A schedule of an op-level (flat) level as its stage structure: per stage, the (node,
    option) pairs computed, for ``ilp.solve_level``'s ``start``. Stage ``t`` is the first run
    of node ``t`` with the recomputations just before it. None when the schedule does not fit
    that structure (it first runs the nodes in another order, or the level has children)."""
    node_of: dict[tuple[int, bool], int] = {}
    for k, u in enumerate(lvl.units):
        if u.op is None:
            return None
        node_of[(u.op, u.backward)] = k
    n = len(lvl.units)
    stages: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    pending: list[tuple[int, int]] = []  # recomputations waiting for the next first run
    frontier = -1
    seen: set[int] = set()
    for kind, i in steps:
        if kind != "compute":
            continue
        k = node_of.get((i, False), node_of.get((i, True)))
        if k is None:
            return None
        if k in seen:
            if k >= lvl.problem.n_forward:
                return None  # backward nodes run once
            pending.append((k, 0))
            continue
        if k != frontier + 1:
            return None
        seen.add(k)
        frontier = k
        stages[k] = pending + [(k, 0)]
        pending = []
    if frontier != n - 1 or pending:
        return None
    return stages


def expand_level(ctx: GraphFacts, block: Block, lvl: _Level, sp: ilp.StagePlan, *,
                 free_recomputed: bool = False
                 ) -> tuple[list[Step], list[Step], frozenset[int]]:
    """Forward steps, backward steps and saved tensors of one solution of a block's level.
    ``free_recomputed``: the backward frees the forward outputs it makes again after their last
    read (``recomputed_outputs_freed``)."""
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

    def dying(i: int, freed: list[int]) -> frozenset[int]:
        # what the level frees after a child's fragment goes inside it after its last read
        # (the model's ``parts``); nothing the fragment makes
        outs = set(p.nodes[i].outputs)
        return frozenset(lvl.value_tensor[y] for y in freed if y not in outs) & alive

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
                made = replay(opt.fwd, frozenset(), dying(i, freed))
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
                made = replay(opt.bwd, mine, dying(i, freed))
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
    saved = frozenset(x for x in alive_after(g, fwd_steps) if x not in interface)
    bwd_steps = out
    if block.bwd_ops and not block.is_root:
        if free_recomputed:
            bwd_steps = recomputed_outputs_freed(ctx, block, bwd_steps)
        bwd_steps = bwd_steps + leftover_frees(g, fwd_steps + bwd_steps, interface)
    return fwd_steps, bwd_steps, saved


FREEABLE_ROLES = frozenset({"activation", "param_grad", "input_grad", "buffer_update"})


def recomputed_outputs_freed(ctx: GraphFacts, block: Block, bwd: list[Step]) -> list[Step]:
    """``bwd`` with each forward output of the block that it makes again freed right after its
    last read there (the low-peak model, ``expand_level(free_recomputed=True)``). The level
    keeps a block's forward outputs to the end (they are the parent's), so a backward fragment
    that recomputes one holds it through the rest of the block's backward (Checkmate's
    MobileNet: its first block's output, 1.2% of the store-all peak, alive at the peak of the
    least-peak plan). The parent never counts such a copy after the fragment: where it holds
    that output itself, the fragment's copy is a temporary one and the parent's replay keeps
    its own (what was alive before a fragment is protected)."""
    g = ctx.graph
    made_at: dict[int, int] = {}
    read_before_made: set[int] = set()
    last_read: dict[int, int] = {}
    freed: set[int] = set()
    for s, (kind, i) in enumerate(bwd):
        if kind != "compute":
            freed.add(i)
            continue
        for x in g.ops[i].inputs:
            r = ctx.root[x]
            if r not in made_at:
                read_before_made.add(r)
            last_read[r] = s
        for x in g.ops[i].outputs:
            made_at[x] = s
            if ctx.root[x] != x:
                read_before_made.add(ctx.root[x])  # (a view made here: left as it was)
    done = set(block.bwd_out) | freed | read_before_made
    after: dict[int, list[int]] = {}
    for x in block.fwd_out:
        if (x in made_at and x not in done and ctx.root[x] == x
                and g.tensors[x].role in FREEABLE_ROLES):
            after.setdefault(max(made_at[x], last_read.get(x, -1)), []).append(x)
    if not after:
        return bwd
    out: list[Step] = []
    for s, step in enumerate(bwd):
        out.append(step)
        out.extend(("free", x) for x in sorted(after.get(s, ())))
    return out


def leftover_frees(g: Graph, steps: list[Step], interface: set[int]) -> list[Step]:
    """Frees that close a block's backward fragment: it leaves nothing of its own behind but
    its interface tensors, which are the parent's to free."""
    return [("free", x) for x in sorted(alive_after(g, steps))
            if x not in interface and g.tensors[x].role in FREEABLE_ROLES]


def alive_after(g: Graph, steps: list[Step]) -> set[int]:
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




def fragment_peak(ctx: GraphFacts, steps: list[Step], counted: set[int], start: Storages,
                  dying: frozenset[int] = frozenset()) -> tuple[int, Storages]:
    """Peak bytes of the ``counted`` storages over a fragment and the storages alive at its end,
    measured by the Rust core with the simulator's storage rules. ``start`` is what is alive
    before; ``dying`` tensors are dropped after their last read."""
    return ctx.memory.fragment_peak(steps, counted, start, dying)


def _outside(ctx: GraphFacts, tensors: Iterable[int], counted: set[int]) -> Storages:
    """Storages of tensors alive before a fragment: one per storage owner."""
    g = ctx.graph
    out: Storages = {}
    for x in tensors:
        r = ctx.root[x]
        out[x] = (-1 - r, g.tensors[r].bytes if r in counted else 0)
    return out


def make_option(ctx: GraphFacts, block: Block, lvl: _Level, sp: ilp.StagePlan, *,
                free_recomputed: bool = False) -> BlockOption:
    fwd, bwd, saved = expand_level(ctx, block, lvl, sp, free_recomputed=free_recomputed)
    return option_from_steps(ctx, block, fwd, bwd, saved)


def option_from_steps(ctx: GraphFacts, block: Block, fwd: list[Step], bwd: list[Step],
                       saved: frozenset[int]) -> BlockOption:
    """A block option's costs, measured on its forward and backward fragments."""
    g = ctx.graph
    own = own_storages(ctx, block)
    peak_f, after_f = fragment_peak(ctx, fwd, own, {})
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
    peak_b, _ = fragment_peak(ctx, bwd, own, saved_state)
    t_f = sum(g.ops[i].time for k, i in fwd if k == "compute")
    t_b = sum(g.ops[i].time for k, i in bwd if k == "compute")
    reads = frozenset(_fragment_reads(g, bwd) & set(block.bwd_in))
    return BlockOption(fwd, bwd, saved, saved_state, t_f, t_b, saved_bytes, peak_f, peak_b,
                       reads)


def pareto_filter(options: list[BlockOption]) -> list[BlockOption]:
    uniq: dict[tuple[Any, ...], BlockOption] = {}
    for o in options:
        uniq.setdefault((o.key(), o.bwd_reads), o)
    opts = list(uniq.values())
    keep = [o for o in opts if not any(q is not o and q.dominates(o) for q in opts)]
    return sorted(keep, key=lambda o: o.saved_bytes)
