"""The block tree over the Rust core's hierarchy, and the options of every block: repeated
blocks are solved once, blocks of one height in parallel; ``solve_top`` solves the root."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time as _time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from hrockmate.ir.graph import Graph
from hrockmate.ir.plan import SolveError
from hrockmate.ir.schedule import Step
from hrockmate.planning import clusters, ilp, level_solvers
from hrockmate.planning.blocks import Block, BlockOption, GraphFacts
from hrockmate.planning.context import (
    FRACTION_TIME,
    GROUP_SIZE,
    HIERARCHY_TIME_SHARE,
    LEAF_PORTFOLIO_MAX_OPS,
    LEAF_SIZE,
    LEAF_SIZES,
    LEAN_MARGIN,
    LEAN_SAMPLE,
    NEAR_STORE_ALL_MIN_BUDGET,
    REFINE_TIME_SHARE,
    SMALL_GRAPH_LEAF_SIZES,
    SUB_TIME_LIMIT,
    TOP_STALL_SECONDS,
    TOP_TIME_SHARE,
    WINDOW_MAX_GAP,
)
from hrockmate.planning.level import (
    block_level,
    expand_level,
    fragment_peak,
    make_option,
    op_stages,
    option_from_steps,
    own_storages,
    pareto_filter,
)
from hrockmate.progress import Progress

logger = logging.getLogger("hrockmate")

def _interfaces(ctx: GraphFacts, block: Block) -> None:
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




def leaf_sizes(graph: Graph, leaf_size: int | None, flat_ops: int = 60) -> tuple[int, ...]:
    """The leaf sizes to plan ``graph`` with, in turn: the one asked for; else
    ``SMALL_GRAPH_LEAF_SIZES`` on graphs of at most ``LEAF_PORTFOLIO_MAX_OPS`` ops,
    ``LEAF_SIZES`` on larger ones, and ``LEAF_SIZE`` on graphs of at most ``flat_ops`` ops
    (planned as one op-level block: no leaves)."""
    if leaf_size is not None:
        return (leaf_size,)
    if graph.num_ops <= flat_ops:
        return (LEAF_SIZE,)
    if graph.num_ops <= LEAF_PORTFOLIO_MAX_OPS:
        return SMALL_GRAPH_LEAF_SIZES
    return LEAF_SIZES


def block_tree(graph: Graph, leaf_size: int = LEAF_SIZE, group_size: int = GROUP_SIZE,
               top_size: int = 16, partitioner: str = "contiguous",
               leaf_options: bool = False) -> Block:
    """The planner's tree of blocks over the core's partition (``clusters.build_hierarchy``,
    the one partition entry); the root holds the whole graph.

    The tree is the Rust core's hierarchy (``clusters.build_hierarchy``): by default contiguous
    stretches of the forward order, ``leaf_size`` ops per leaf and ``group_size`` children per
    block above, at most ``top_size`` at the root; each backward op joins a leaf by the owner
    rule of docs/hierarchy.md. With ``leaf_options`` the core also enumerates every leaf's
    options (exactly, in parallel) and each leaf block keeps their fragments."""
    ctx = GraphFacts(graph)
    h = clusters.build_hierarchy(
        graph, partitioner=partitioner, leaf_size=leaf_size, group_size=group_size,
        # the contiguous partitioner's groups span up to 1.4x their target size
        max_size=max(2, math.ceil(1.4 * max(leaf_size, group_size)) + 1),
        top_max_size=top_size, options=leaf_options)
    by_pos = ctx.pos.__getitem__

    def block(c: clusters.Cluster) -> Block:
        kids = [] if c.is_leaf else [block(h.clusters[k]) for k in c.children]
        b = Block(fwd_ops=sorted(c.fwd_ops, key=by_pos), bwd_ops=sorted(c.bwd_ops, key=by_pos),
                  children=kids, native_options=h.options[c.id], cluster=c)
        _interfaces(ctx, b)
        return b

    top = h.clusters[h.root]
    return Block(fwd_ops=list(ctx.fwd), bwd_ops=list(ctx.bwd),
                 children=[block(h.clusters[k]) for k in top.children],
                 loose_bwd=sorted(top.own_bwd_ops, key=by_pos), is_root=True)


def flat_root(graph: Graph) -> Block:
    """The hierarchy of one level: every op is a unit of the root (Checkmate's model)."""
    ctx = GraphFacts(graph)
    return Block(fwd_ops=list(ctx.fwd), bwd_ops=list(ctx.bwd), is_root=True)

class HierarchyTimeout(ilp.LevelNoSolution):
    """The blocks' options were not all solved before the hierarchy's share of the time limit
    ran out (the caller then uses the simple strategies)."""




# A block's options (``_block_options``): the fastest schedule, then the fastest under caps on
# what its forward keeps for its backward (fractions of what the fastest keeps), the lowest
# peak, and the fastest under peaks between the lowest and the fastest's (fractions of the way).
# More, finer options give the parent more trade-offs to choose from; each costs a short block
# MILP (``SUB_TIME_LIMIT``), and these are the ones whose plans repay their solving time
# (benches/simple_strategies.py and benches/solver_quality.py measure them).
SAVED_FRACTIONS: tuple[float, ...] = (0.0, 0.0625, 0.125, 0.25, 0.375, 0.5, 0.75)
PEAK_FRACTIONS: tuple[float, ...] = (0.25, 0.5, 0.75)
# Caps close to what the fastest keeps, solved besides the ones above (so a block's options
# only grow). Where a block's cheapest savings are a small share of what it keeps (an unrolled
# recurrent cell: large gates, small states cheap to make again from them), the 3/4 cap is too
# coarse: it makes the block give up expensive values too, and the parent then runs whole
# blocks again near store-all.
NEAR_STORE_ALL_FRACTIONS: tuple[float, ...] = (0.9375, 0.875)


@dataclass
class _Settings:
    time_limit: float | None
    sub_time_limit: float
    mip_rel_gap: float
    saved_fractions: tuple[float, ...] = field(default_factory=lambda: SAVED_FRACTIONS)
    peak_fractions: tuple[float, ...] = field(default_factory=lambda: PEAK_FRACTIONS)
    near_store_all_fractions: tuple[float, ...] = field(
        default_factory=lambda: NEAR_STORE_ALL_FRACTIONS)
    solvers: dict[str, str] = field(default_factory=dict)  # level kind -> solver
    deadline: float | None = None  # perf_counter time by which every block must be solved
    # set when the blocks would not all be solved by the deadline with full option sets
    # (``prepare``): then leaves take the Rust core's options and other blocks get only their
    # fastest, keep-nothing and lowest-peak options (``go_lean``)
    lean: bool = False
    # the low-peak model: a block's backward frees the forward outputs it makes again after
    # their last read (``level.recomputed_outputs_freed``; ``prepare(low_peak=True)``)
    low_peak: bool = False
    # leaf MILP solutions by (the leaf's ops, the solve's arguments): a leaf's MILP is the same
    # under both memory models (they differ in how a solution is expanded into fragments), so
    # the low-peak twin of a hierarchy reads the solutions its leaves share with it from here
    # (``prepare(like=)``) instead of solving those MILPs again
    leaf_solutions: dict[Any, Any] = field(default_factory=dict)

    def go_lean(self) -> None:
        self.lean = True
        self.saved_fractions = (0.0,)
        self.peak_fractions = ()
        self.near_store_all_fractions = ()






def _block_options(ctx: GraphFacts, block: Block, st: _Settings) -> list[BlockOption]:
    """Solve a block's level at several limits and keep the Pareto-optimal results.

    The limits: none (the fastest schedule); caps on what the forward keeps for the backward
    (fractions of what the fastest keeps, 0 = keep nothing); the lowest peak; and peaks in
    between the lowest and the fastest one. ``st.solvers`` may give leaves to the Rust core's
    enumeration or TW-Remat (alone, or beside the ILP: ``"ilp+rust"``) and chains of children to
    Rotor (``level_solvers``); the ILP takes what they cannot."""
    extra: list[BlockOption] = []
    leaves = st.solvers.get("leaves", "ilp")
    if st.lean and not block.children and block.native_options:
        leaves = "rust"
    provider = leaves.removeprefix("ilp+")
    if leaves != "ilp" and not block.children:
        found = level_solvers.LEAF_PROVIDERS[provider](ctx, block)
        if found and leaves == provider:
            block.solver = provider
            return found
        extra = found or []
    if st.solvers.get("chains") == "rotor" and block.children:
        chain = level_solvers.chain_level(ctx, block)
        found = level_solvers.rotor_block_options(ctx, block, chain) if chain else []
        if found:
            block.solver = "rotor"
            return found
    block.solver = "ilp"
    lvl = block_level(ctx, block)
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
        gap = max(st.mip_rel_gap, 1e-2 if limited else 1e-3)
        # (a start is the problem's own leanest schedule: named, not compared)
        key = None if block.children else (
            tuple(block.fwd_ops), tuple(block.bwd_ops), limit, gap,
            tuple(sorted((k, "lean" if k == "start" else v) for k, v in a.items())))
        sp = st.leaf_solutions.get(key) if key is not None else None
        if sp is None:
            try:
                sp = ilp.solve_level(lvl.problem, **a, time_limit=limit,  # type: ignore[arg-type]
                                     mip_rel_gap=gap)
            except (ilp.LevelInfeasible, ilp.LevelNoSolution):
                sp = False  # (no schedule; not the exception, whose traceback keeps frames)
            if key is not None:
                st.leaf_solutions[key] = sp
        if sp is False:
            return None
        return make_option(ctx, block, lvl, sp, free_recomputed=st.low_peak)

    first = attempt(easy, budget=None)
    if first is None and st.deadline is not None and _time.perf_counter() >= st.deadline:
        raise HierarchyTimeout(f"the time limit ran out while solving the blocks of "
                               f"'{ctx.graph.name}'")
    if first is None:
        raise SolveError(f"internal error: a block of '{ctx.graph.name}' has no schedule even "
                         "without a memory limit")
    options = [first]
    # the Rust core's front already covers what the forward keeps against what the backward
    # recomputes, exactly: beside it the ILP adds only the options of lower peaks
    # Limits are taken loosest first: a schedule found under a looser limit that already meets
    # a tighter one is also the fastest there (up to the MILP's gap), so that MILP is skipped.
    if block.bwd_ops and first.saved_bytes > 0 and not (extra and provider == "rust"):
        last = first
        for frac in sorted(st.saved_fractions, reverse=True):
            cap = frac * first.saved_bytes
            if last.saved_bytes <= cap:
                continue
            o = attempt(FRACTION_TIME * st.sub_time_limit, budget=None, boundary_limit=cap)
            if o is not None:
                options.append(o)
                last = o
        # each cap near store-all is solved unless an option lies between it and the next
        # lower cap already
        caps = sorted(set(st.saved_fractions) | set(st.near_store_all_fractions))
        for frac in st.near_store_all_fractions if block.children else ():
            cap = frac * first.saved_bytes
            below = max((f for f in caps if f < frac), default=0.0) * first.saved_bytes
            if any(below < o.saved_bytes <= cap for o in options):
                continue
            o = attempt(FRACTION_TIME * st.sub_time_limit, budget=None, boundary_limit=cap)
            if o is not None:
                o.near_store_all = True
                options.append(o)
    # the lowest peak, started from the leanest schedule: with the model's floor on the peak
    # (``ilp.build_model``) that start often proves optimal at once, where HiGHS alone can
    # spend many sub-time-limits reaching it
    low = attempt(budget=None, minimize_peak=True, boundary_limit=boundary0,
                  start=ilp.lean_start(lvl.problem))
    if low is not None:
        options.append(low)
        internal = _internal_storages(ctx, block)
        hi_peak, lo_peak = _internal_peak(ctx, first, internal), _internal_peak(ctx, low, internal)
        last_peak = hi_peak
        for frac in sorted(st.peak_fractions, reverse=True):
            limit = lo_peak + frac * (hi_peak - lo_peak)
            if last_peak <= limit:  # (always so when the fastest's peak is the lowest)
                continue
            o = attempt(budget=limit, boundary_limit=None)
            if o is not None:
                options.append(o)
                last_peak = _internal_peak(ctx, o, internal)
    if extra:
        block.solver = leaves
    return pareto_filter(options + extra)


def _internal_storages(ctx: GraphFacts, block: Block) -> set[int]:
    interface = set(block.fwd_out) | set(block.bwd_out)
    return {x for x in own_storages(ctx, block) if x not in interface}


def _internal_peak(ctx: GraphFacts, o: BlockOption, internal: set[int]) -> int:
    """An option's peak as its own level counts it (internal tensors only)."""
    start = {x: (iid, b if ctx.root[x] in internal else 0) for x, (iid, b) in o.saved_state.items()}
    return max(fragment_peak(ctx, o.fwd, internal, {})[0],
               fragment_peak(ctx, o.bwd, internal, start)[0])


def _renamed_options(ctx: GraphFacts, src: Block, dst: Block) -> list[BlockOption] | None:
    """``src``'s options for ``dst``, a block of the same representative cluster (None if a
    step falls outside the correspondence; the caller then solves ``dst``)."""
    assert src.cluster is not None and dst.cluster is not None
    op_map, t_map = clusters.correspondence(ctx.graph, src.cluster, dst.cluster)

    def steps(fragment: list[Step]) -> list[Step]:
        return [(k, op_map[i] if k == "compute" else t_map[i]) for k, i in fragment]

    try:
        return [dataclasses.replace(
                    option_from_steps(ctx, dst, steps(o.fwd), steps(o.bwd),
                                      frozenset(t_map[x] for x in o.saved)),
                    near_store_all=o.near_store_all)
                for o in src.options]
    except KeyError:
        logger.debug("a step of cluster %d has no counterpart in cluster %d; solving the "
                     "latter itself", src.cluster.id, dst.cluster.id)
        return None


@dataclass
class Hierarchy:
    """A graph's block tree with every non-root block's options computed."""

    graph: Graph
    root: Block
    ctx: GraphFacts
    seconds: float
    blocks: int
    solved_blocks: int  # blocks whose level was solved; the others reuse an equal block's options
    solvers: dict[str, str] = field(default_factory=dict)
    lean: bool = False  # some blocks got fewer options to finish in time (``_Settings.lean``)
    low_peak: bool = False  # built with the low-peak model (``prepare``)
    leaf_size: int = LEAF_SIZE
    # the same blocks built again with the low-peak model, by the settings they were built
    # with (``policy.twin_key``): a solve given this hierarchy that falls to the low-peak
    # model reuses them instead of solving every block again (the runtime keeps one prepared
    # hierarchy for all its solves, and a refused budget is often followed by a build at the
    # least budget named, which needs the low-peak model too)
    low_peak_twins: dict[Any, "Hierarchy"] = field(default_factory=dict, repr=False)
    # the leaves' MILP solutions (``_Settings.leaf_solutions``), for a twin built ``like`` this
    leaf_solutions: dict[Any, Any] = field(default_factory=dict, repr=False)

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


def prepare(graph: Graph, *, flat_ops: int = 60, leaf_size: int = LEAF_SIZE,
            group_size: int = GROUP_SIZE,
            top_size: int = 16, time_limit: float | None = None,
            sub_time_limit: float | None = None,
            mip_rel_gap: float = 1e-4, progress: bool = True,
            workers: int | None = None, solvers: Mapping[str, str] | None = None,
            near_store_all: bool = True, low_peak: bool = False,
            like: Hierarchy | None = None) -> Hierarchy:
    """Build the hierarchy and compute the options of every block below the root.

    Blocks of the same height are independent: ``workers`` threads solve them at once (HiGHS
    releases the GIL while it solves; model building and the rest stay serial). Default: one per
    core, at most ``MAX_WORKERS``. Ctrl-C or an error in one block stops every thread's solve
    within about 0.1 s. ``near_store_all``: also solve the blocks above the leaves under the
    caps of ``NEAR_STORE_ALL_FRACTIONS`` (only budgets of ``NEAR_STORE_ALL_MIN_BUDGET`` and
    more use them). ``low_peak``: a block's backward frees the forward outputs it makes again
    right after their last read there instead of holding them to its end
    (``level.recomputed_outputs_freed``). Its options' peaks are lower or equal, so this model
    plans lower budgets. It is not the default: on its changed coefficients the top MILPs search
    worse at budgets both models plan, so ``solve_graph`` uses it only where the default model
    has no schedule (``policy.run_method``). ``like``: a hierarchy of the same graph built with
    the other model; the leaves' MILPs it solved with the same arguments are not solved
    again."""
    t0 = _time.perf_counter()
    ctx = GraphFacts(graph)
    chosen = level_solvers.check_solvers(solvers)
    if graph.num_ops <= flat_ops:
        root = flat_root(graph)
    else:
        # the core's leaf options: asked for, or a fallback for leaves if time runs short
        root = block_tree(graph, leaf_size, group_size, top_size,
                          leaf_options=chosen["leaves"] in ("rust", "ilp+rust")
                          or time_limit is not None)
    st = _Settings(time_limit, SUB_TIME_LIMIT if sub_time_limit is None else sub_time_limit,
                   mip_rel_gap, solvers=chosen,
                   deadline=None if time_limit is None
                   else t0 + HIERARCHY_TIME_SHARE * time_limit, low_peak=low_peak)
    if like is not None and like.graph is graph:
        st.leaf_solutions = like.leaf_solutions  # (shared: each model's leaves fill it)
    if not near_store_all:
        st.near_store_all_fractions = ()
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
    bar = Progress(total, f"solving {total} blocks of '{graph.name}'", progress)
    cancel = threading.Event()

    def options_of(b: Block) -> list[BlockOption]:
        with ilp.cancelled_by(cancel):
            return _block_options(ctx, b, st)

    # repeated layers: the core gives equivalent clusters one representative; solve one block
    # of each class, rename its options for the others
    levels = []
    for height in sorted(by_height):
        firsts: dict[int, Block] = {}
        copies: list[tuple[Block, Block]] = []
        for b in by_height[height]:
            assert b.cluster is not None
            src = firsts.setdefault(b.cluster.representative, b)
            if src is not b:
                copies.append((b, src))
        levels.append((list(firsts.values()), copies))
    to_solve = sum(len(blocks) for blocks, _ in levels)
    t_blocks = _time.perf_counter()

    def pace(solved: int) -> None:
        """Go lean when the blocks left would not be solved in time at the pace so far."""
        if st.lean or st.deadline is None or solved < LEAN_SAMPLE:
            return
        now = _time.perf_counter()
        need = (now - t_blocks) / solved * (to_solve - solved) * LEAN_MARGIN
        if need > st.deadline - now:
            st.go_lean()
            logger.info("'%s': %d of %d blocks solved in %.1f s; the rest would need about "
                        "%.1f s of the %.1f s left, so they get fewer options each (leaves: "
                        "the Rust core's)", graph.name, solved, to_solve, now - t_blocks,
                        need / LEAN_MARGIN, st.deadline - now)

    solved = 0
    pool = ThreadPoolExecutor(workers, thread_name_prefix="hrockmate-blocks") if workers > 1 \
        else None
    try:
        for blocks, copies in levels:
            if pool is not None and len(blocks) > 1:
                futures = [pool.submit(options_of, b) for b in blocks]
                results: Iterable[list[BlockOption]] = (f.result() for f in futures)
            else:
                results = (options_of(b) for b in blocks)
            for b, options in zip(blocks, results):
                b.options = options
                solved += 1
                pace(solved)
                bar.update()
            for b, src in copies:
                renamed = _renamed_options(ctx, src, b)
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
    return Hierarchy(graph, root, ctx, _time.perf_counter() - t0, total, solved, chosen,
                     lean=st.lean, leaf_size=leaf_size, low_peak=low_peak,
                     leaf_solutions=st.leaf_solutions)


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




def solve_top(h: Hierarchy, budget: int | None, *, time_limit: float | None, mip_rel_gap: float,
              minimize_peak: bool = False, starts: Sequence[list[Step]] = (),
              soft_deadline: float | None = None, barren_deadline: float | None = None,
              near_store_all: bool = True) -> tuple[list[Step], int, bool, dict[str, Any]]:
    """The top level at ``budget`` (None: no limit, or the least peak with ``minimize_peak``):
    (steps, forward length, proven optimal, statistics). Raises ``ilp.LevelInfeasible`` or
    ``ilp.LevelNoSolution`` when it finds nothing. ``starts``: schedules within the budget; when
    the top is the op level the MILP starts from the first that fits its stage structure (it
    then has a schedule at once, and the stall rule ends a search that finds nothing better).
    ``soft_deadline``: past it, the top MILP stops once it has a schedule; ``barren_deadline``:
    past it, it stops if it has found none (``ilp.run_highs``). ``near_store_all``: offer the
    children's options made under caps near what they keep at store-all (``BlockOption``)."""
    with _offered(h.root, near_store_all):
        return _solve_top(h, budget, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
                          minimize_peak=minimize_peak, starts=starts,
                          soft_deadline=soft_deadline, barren_deadline=barren_deadline)


@contextlib.contextmanager
def _offered(root: Block, near_store_all: bool) -> Iterator[None]:
    """While the top level is solved and expanded (which index the children's option lists),
    the root's children list only the options offered to it."""
    if near_store_all:
        yield
        return
    kept = [c.options for c in root.children]
    try:
        for c in root.children:
            c.options = [o for o in c.options if not o.near_store_all]
        yield
    finally:
        for c, options in zip(root.children, kept):
            c.options = options


def _solve_top(h: Hierarchy, budget: int | None, *, time_limit: float | None,
               mip_rel_gap: float, minimize_peak: bool, starts: Sequence[list[Step]],
               soft_deadline: float | None, barren_deadline: float | None
               ) -> tuple[list[Step], int, bool, dict[str, Any]]:
    if h.solvers.get("top") == "rotor":
        chain = level_solvers.chain_level(h.ctx, h.root)
        if chain is not None:
            lo, hi = level_solvers.chain_bounds(chain)
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
    lvl = block_level(h.ctx, h.root)
    stages, last_resort = None, False
    if not h.root.children:
        stages = next((st for st in map(partial(op_stages, lvl), starts) if st is not None), None)
    else:
        # a block level starts from its leanest schedule: a search for the fastest schedule
        # cut by its time limit before it found anything returns that rather than nothing; the
        # search for the lowest peak often proves it optimal at once (the model's floor)
        stages, last_resort = ilp.lean_start(lvl.problem), not minimize_peak
    sp = ilp.solve_level(lvl.problem, budget, time_limit=time_limit, mip_rel_gap=mip_rel_gap,
                         minimize_peak=minimize_peak, stall=TOP_STALL_SECONDS, start=stages,
                         soft_deadline=soft_deadline, last_resort_start=last_resort,
                         barren_deadline=barren_deadline,
                         window_gap=WINDOW_MAX_GAP if h.root.children else math.inf)
    if sp.stats.get("stopped") == "window":
        logger.info("the top MILP of '%s' stopped after %.1f s at the end of the solve's "
                    "improvement window", h.graph.name, sp.stats["solve_seconds"])
    if sp.stats.get("stopped") == "barren":
        logger.info("the top MILP of '%s' stopped after %.1f s without a schedule of its own: "
                    "a simple strategy fits the budget", h.graph.name, sp.stats["solve_seconds"])
    if sp.stats.get("stopped") == "stall":
        gap = sp.stats.get("mip_gap")
        logger.info("the top MILP of '%s' stopped after %.1f s: its best schedule had stopped "
                    "improving (%s)", h.graph.name, sp.stats["solve_seconds"],
                    "gap unknown" if gap is None else f"within {100 * gap:.1f}% of optimal")
    fwd, bwd, _ = expand_level(h.ctx, h.root, lvl, sp)
    return fwd + bwd, len(fwd), sp.optimal, {**sp.stats, "top_solver": "ilp"}


