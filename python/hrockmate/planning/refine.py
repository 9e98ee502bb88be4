"""Schedule refinement: spend a plan's unused memory on dropping recomputations.

A hierarchical plan picks each block's schedule from a few options, so its peak usually sits
below the budget (the Checkmate ResNet-50 at 90% of store-all: a peak of 84%). This pass turns
that slack into time, on any valid schedule:

1. *keep instead of recompute*: a recomputation of op ``j`` whose outputs were freed since its
   previous run is dropped, and those frees with it, so the outputs stay alive in between. The
   recomputations saving the most time per byte kept go first, each only where the simulator's
   memory timeline has room for the outputs over that stretch (less the inputs that only the
   recomputation dropped read until their free: they go earlier), or where evicting cheaper
   tensors makes room (*exchange*): a tensor whose forward op reads only tensors alive at its
   next read (or made there by recomputations the plan runs a little later anyway, moved up,
   or kept alive since the plan freed them a little before) is freed after a read and made
   again right before the next one, when all such evictions together cost less time than the
   recomputation dropped. This is how an op-level plan keeps a batch norm's output and
   recomputes the ReLU after it, where a plan made of whole blocks re-runs the block (the
   ReLU is made from the output kept: a recomputation dropped, now or before, is not moved up
   for an eviction). Recomputations that found no room alone are tried in pairs (one eviction
   can make room for two, neither worth it alone);
2. *dead recomputations*: a recomputation none of whose outputs is read before it is freed
   again (it fed a recomputation dropped in 1) is dropped;
3. *earlier frees*: every free moves up to just after the last read of its tensor;
4. *later recomputations*: where a round finds nothing, the backward's recomputations move
   down to right before their first read (``_sink_recomputes``; same time, less memory held)
   and the round is tried once more.

The memory rules are the simulator's alone: the timeline it returns guides the choices, and the
refined schedule is simulated again; if it does not fit (the timeline is an estimate where views
share storage) fewer changes are kept, down to none. Work is bounded by ``deadline``.
"""

from __future__ import annotations

import bisect
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from hrockmate.ir.graph import PREEXISTING_ROLES, Graph
from hrockmate.ir.schedule import Schedule, ScheduleError, SimulationResult, Step, simulate

__all__ = ["Refined", "refine"]


@dataclass
class Refined:
    """A refined schedule and what the simulator measured for it."""

    steps: list[Step]
    forward_len: int
    peak_bytes: int
    time: float
    dropped: int  # recomputations removed
    time_before: float  # the simulated time of the schedule given to ``refine``


def refine(graph: Graph, steps: list[Step], forward_len: int, budget: int, *,
           deadline: float | None = None, rounds: int = 10) -> Refined | None:
    """``steps`` with recomputations dropped where the budget allows, or None when nothing
    could be dropped. The result is valid, within ``budget`` and faster (simulated)."""
    best: Refined | None = None
    cur_steps, cur_fl = list(steps), forward_len
    arrays = graph.to_arrays()
    for _ in range(rounds):
        if deadline is not None and _time.perf_counter() > deadline:
            break
        step = _one_round(graph, arrays, cur_steps, cur_fl, budget, deadline)
        started = step.time_before if step is not None else None
        if step is None:
            # stuck: recomputations moved down to their first read hold less memory for as
            # long, which may leave room for more (sunk only here: sinking first led the
            # rounds elsewhere, to worse plans as often as to better); stuck again after
            # that, the refinement ends
            sunk = _sink_recomputes(graph, cur_steps, cur_fl)
            if sunk is not None:
                sunk_steps, sunk_fl = _free_early(graph, [(s, q < cur_fl)
                                                          for q, s in enumerate(sunk)])
                step = _one_round(graph, arrays, sunk_steps, sunk_fl, budget, deadline)
        if step is None:
            break
        if best is None and started is None:  # (the time of ``steps`` themselves: the sunk
            # schedule's is the same, but summed in another order)
            res = _sim(graph, arrays, cur_steps, cur_fl)
            started = step.time_before if res is None else float(res.time)
        best = Refined(step.steps, step.forward_len, step.peak_bytes, step.time,
                       step.dropped + (best.dropped if best else 0),
                       best.time_before if best else started)
        cur_steps, cur_fl = step.steps, step.forward_len
    return best


def _unshared(graph: Graph) -> list[bool]:
    """Per tensor, whether its storage is its own: it is no view and no view is taken of it
    (keeping, freeing or moving it then touches no other tensor's storage)."""
    has_view = {t.alias_of for t in graph.tensors if t.alias_of is not None}
    return [t.alias_of is None and x not in has_view for x, t in enumerate(graph.tensors)]


def _sink_recomputes(graph: Graph, steps: list[Step], forward_len: int) -> list[Step] | None:
    """``steps`` with each recomputation of the backward segment moved down to right before
    the first step that reads its outputs, where no input has to stay alive longer for it
    by more bytes than its outputs then spend less; None when none moves. The time is the
    same.

    A block's plan runs a child's forward again where the block's backward starts, so the
    outputs wait, alive, while other backward steps run (the Checkmate MobileNet at 30%: six
    layers made again ahead of two other layers' backward, holding half the budget there).
    Moved last to first, a chain of recomputations moves as one."""
    ops, tensors = graph.ops, graph.tensors
    plain = _unshared(graph)
    n = len(steps)
    # where each step now sits: (the original position of the step it precedes, and among
    # the steps moved before that one, a later move first: a producer moves after its reader)
    key: list[tuple[int, float]] = [(p, 0.0) for p in range(n)]
    events: dict[int, list[int]] = {}  # tensor -> the steps that make, read or free it
    first_run: dict[int, int] = {}
    for p, (kind, i) in enumerate(steps):
        if kind == "free":
            events.setdefault(i, []).append(p)
            continue
        first_run.setdefault(i, p)
        for x in dict.fromkeys((*ops[i].inputs, *ops[i].outputs)):
            events.setdefault(x, []).append(p)

    def reads(q: int, x: int) -> bool:
        return steps[q][0] == "compute" and x in ops[steps[q][1]].inputs

    def makes(q: int, x: int) -> bool:
        return steps[q][0] == "compute" and x in ops[steps[q][1]].outputs

    order = 0.0  # (the moved steps' second key: each below all before)
    moved = False
    for p in range(n - 1, forward_len - 1, -1):
        kind, k = steps[p]
        if kind != "compute" or first_run[k] == p or ops[k].time <= 0 or not all(
                plain[x] for x in (*ops[k].inputs, *ops[k].outputs)):
            continue
        # the first read of the outputs made here, before they are made again (a run whose
        # outputs are freed unread is left alone); the steps after p all sit after it still
        target: tuple[int, float] | None = None
        for x in ops[k].outputs:
            ev = events[x]
            first: tuple[int, float] | None = None
            for q in ev[bisect.bisect_right(ev, p):]:
                if makes(q, x):
                    break
                if q - p > _SINK_REACH:  # (the steps from q on sit at q or later)
                    first = None if first is None else min(first, (q, 0.0))
                    break
                if reads(q, x):
                    first = key[q] if first is None else min(first, key[q])
                elif first is None or key[q] < first:  # (freed before any read)
                    first = None
                    break
            if first is None:
                target = None
                break
            target = first if target is None else min(target, first)
        if target is None or target[0] <= p + 1:
            continue
        new_key = (target[0], order - 1.0)
        # the inputs: alive there already, or freed on the way (that free moves down too)
        extend: list[int] = []
        extra = 0
        for y in dict.fromkeys(ops[k].inputs):
            if tensors[y].role in PREEXISTING_ROLES:
                continue
            ev = events[y]
            on_way = [q for q in ev[bisect.bisect_right(ev, p):bisect.bisect_right(ev, target[0])]
                      if key[p] < key[q] < new_key and not reads(q, y)]
            if any(makes(q, y) for q in on_way) or len(on_way) > 1:
                extra = -1  # (made again on the way: left alone)
                break
            if on_way:
                extend.append(on_way[0])
                extra += int(tensors[y].bytes)
        if extra < 0 or extra > sum(int(tensors[x].bytes) for x in ops[k].outputs):
            continue
        order -= 1.0
        key[p] = new_key
        for f in extend:
            key[f] = (new_key[0], order + 0.5)  # (right after the run)
        moved = True
    if not moved:
        return None
    return [steps[p] for p in sorted(range(n), key=key.__getitem__)]


# Steps a recomputation moves down at most (each move scans its tensors' steps over the way)
_SINK_REACH = 4096


def _sim(graph: Graph, arrays: dict[str, np.ndarray], steps: list[Step],
         forward_len: int) -> SimulationResult | None:
    try:
        return simulate(graph, Schedule(steps, forward_len), graph_arrays=arrays)
    except ScheduleError:
        return None


def _one_round(graph: Graph, arrays: dict[str, np.ndarray], steps: list[Step],
               forward_len: int, budget: int, deadline: float | None) -> Refined | None:
    base = _sim(graph, arrays, steps, forward_len)
    if base is None or base.peak_bytes > budget:
        return None
    choices = _keep_choices(graph, steps, base.timeline, budget, deadline)
    if not choices:
        return None

    def attempt(n: int) -> Refined | None:
        """The first ``n`` choices applied, if that simulates within budget and faster."""
        new_steps, new_fl = _apply(graph, steps, forward_len, choices[:n])
        res = _sim(graph, arrays, new_steps, new_fl)
        if res is None or res.peak_bytes > budget or res.time >= base.time:
            return None
        return Refined(new_steps, new_fl, int(res.peak_bytes), float(res.time), n, base.time)

    # the timeline is exact for storages without views; where views share storage the estimate
    # can miss, so fall back to the longest prefix of the choices that simulates within budget
    # (all of them first: the usual case, one simulation)
    found = attempt(len(choices))
    if found is not None:
        return found
    lo, hi = 0, len(choices) - 1
    while lo < hi and (deadline is None or _time.perf_counter() <= deadline):
        mid = (lo + hi + 1) // 2
        r = attempt(mid)
        if r is not None:
            lo, found = mid, r
        else:
            hi = mid - 1
    return found


_NONE: frozenset[int] = frozenset()


@dataclass
class _Eviction:
    """``tensor`` freed after the step at ``after`` and made again by ``op`` right before the
    step at ``before`` (its next read). Inputs of ``op`` not alive there are made first by
    ``moved`` (in order): each such op's next recomputation after ``before`` moves up to run
    there instead, so its output stays alive from there on (more bytes over that stretch) at
    no extra time."""

    tensor: int
    op: int
    after: int
    before: int
    bytes: int
    cost: float
    reads: tuple[int, ...]  # what ``op`` reads
    moved: tuple[_Move, ...] = ()
    # (derived from the above, read for every pair of gaps compared: made once)
    inputs: tuple[int, ...] = field(init=False, repr=False)  # what it and the moves read
    _drops: frozenset[int] = field(init=False, repr=False)
    _made: frozenset[int] = field(init=False, repr=False)  # the moves' outputs
    _kept_alive: frozenset[int] = field(init=False, repr=False)  # those not made again
    held: int = field(init=False, repr=False)  # their bytes

    def __post_init__(self) -> None:
        if not self.moved:  # (most gaps: made once per gap of a large schedule)
            self._drops = self._made = self._kept_alive = _NONE
            self.inputs, self.held = self.reads, 0
            return
        self._drops = frozenset(m.drop if m.drop >= 0 else m.unfree for m in self.moved
                                if max(m.drop, m.unfree) >= 0)
        self.inputs = self.reads + tuple(y for m in self.moved for y in m.reads)
        self._made = frozenset(m.output for m in self.moved)
        self._kept_alive = frozenset(m.output for m in self.moved if m.unfree >= 0)
        self.held = sum(m.bytes for m in self.moved if m.unfree >= 0)

    def drops(self) -> frozenset[int]:
        """The steps of the recomputations moved up (dropped where they were), and of the frees
        dropped to keep an input alive."""
        return self._drops

    def keeping(self, kept: frozenset[int]) -> _Eviction:
        """This eviction beside the recomputations at steps ``kept`` dropped for their outputs
        kept alive since their previous run: a move of one of them up to ``before`` is not
        needed, its output is alive there (ResNets: a batch norm's output kept, the ReLU after
        it evicted and made again from it, as greedy eviction does), and neither are the moves
        that only made its inputs (the convolution before that batch norm)."""
        if kept.isdisjoint(self._drops):
            return self
        needed = set(self.reads)
        stay: list[_Move] = []
        saved = 0.0  # the time of the runs added and left out
        for m in reversed(self.moved):  # (a move comes after the moves that make its inputs)
            if m.output not in needed or m.drop in kept:
                saved += m.time
                continue
            stay.append(m)
            needed.update(m.reads)
        if len(stay) == len(self.moved):
            return self
        stay.reverse()
        return replace(self, cost=self.cost - saved, moved=tuple(stay))

    def fresh(self) -> list[int]:
        """The outputs made for this eviction alone (freed once ``op`` has run)."""
        return [m.output for m in self.moved if m.drop < 0]

    def moved_fits(self, level: np.ndarray, budget: int) -> bool:
        """Whether ``level`` has room for the moved outputs from ``before`` on (and the inputs
        kept alive, from their frees on)."""
        if not self.moved:
            return True
        start = min([self.before - 1, *(m.unfree for m in self.moved if m.unfree >= 0)])
        over = level[start:max([self.before, *(m.drop for m in self.moved)])].copy()
        self.apply_moved(over, start)
        if start < self.before - 1:  # (an input kept alive over the gap, where the tensor
            # evicted is not)
            over[max(self.after + 1 - start, 0):self.before - 1 - start] -= self.bytes
        return int(over.max()) <= budget

    def apply_moved(self, level: np.ndarray, offset: int = 0) -> None:
        """Count the moved outputs in ``level`` (indexed from step ``offset``)."""
        for m in self.moved:
            lo = max((self.before - 1 if m.unfree < 0 else m.unfree) - offset, 0)
            level[lo:max(m.drop - offset, self.before - offset, lo + 1)] += m.bytes

    def apply(self, level: np.ndarray, offset: int = 0) -> None:
        """Count the eviction in ``level`` (indexed from step ``offset``): its tensor gone over
        the gap, the moved outputs alive from ``before`` on."""
        level[max(self.after + 1 - offset, 0):max(self.before - offset, 0)] -= self.bytes
        self.apply_moved(level, offset)


@dataclass(frozen=True)
class _Move:
    """A recomputation of ``op`` (at step ``drop``) moved up to an eviction's ``before``;
    its output (``bytes``) is then alive from there. With ``drop`` -1 a recomputation added
    for the eviction alone, or, with ``unfree`` a step, none: the free of the output at that
    step is dropped instead, so it stays alive until the eviction's op; either way the output
    is freed after that op."""

    op: int
    drop: int
    bytes: int
    output: int
    time: float = 0.0  # (added, if drop is -1)
    reads: tuple[int, ...] = ()  # the op's inputs (none, if kept alive)
    unfree: int = -1


@dataclass
class _Choice:
    compute_pos: int  # the recomputation dropped
    free_pos: list[int]  # the frees of its outputs dropped with it
    evictions: list[_Eviction] = field(default_factory=list)  # the room made for it


class _Gaps:
    """Every stretch between two reads of an evictable tensor (``_Eviction``s), as arrays for
    finding those that span a step, and per step the bytes all gaps not yet taken could free
    there (``cover``: no set of evictions lowers a step by more)."""

    def __init__(self, found: list[_Eviction], num_steps: int) -> None:
        self.items = found
        self.after = np.array([e.after for e in found], dtype=np.int64)
        self.before = np.array([e.before for e in found], dtype=np.int64)
        # (bytes freed at every step of the gap: less the inputs kept alive over it)
        self.bytes = np.array([e.bytes - e.held for e in found], dtype=np.int64)
        self.cost = np.array([e.cost for e in found], dtype=np.float64)
        # time per byte freed: the cheapest first
        self.price = self.cost / np.maximum(self.bytes, 1)
        self.free = np.ones(len(found), dtype=bool)
        # (an eviction lowers the steps after+1 .. before-1: summed by differences)
        diff = np.zeros(num_steps + 1, dtype=np.int64)
        np.add.at(diff, self.after + 1, self.bytes)
        np.add.at(diff, self.before, -self.bytes)
        self.cover = np.cumsum(diff[:-1])

    def take(self, g: int) -> None:
        """Gap ``g`` is evicted: no longer free, nor counted in ``cover``."""
        self.free[g] = False
        self.cover[self.after[g] + 1:self.before[g]] -= self.bytes[g]


def _eviction_gaps(graph: Graph, steps: list[Step]) -> _Gaps:
    """The stretches of ``steps`` over which a tensor could be evicted: made by a forward op
    with no other output and no view of it in the graph, alive and unread between two steps
    that touch it, and the op's inputs alive at the second (recomputing it is one step), or
    made there by up to ``_MAX_MOVED`` recomputations the plan runs later anyway, moved up
    (``_moves``; ResNet-50 at 90%: a block's ReLU output, whose input the plan recomputes for
    the add's backward a few steps after the ReLU's own). Where that needs a run added, the
    gap is offered a second time with the inputs the plan freed within reach kept alive
    instead (no time, their bytes over that stretch; the DenseNet log at 30%: a concatenation
    made again from a convolution output kept); its bytes count less theirs."""
    ops, tensors = graph.ops, graph.tensors
    producer = graph.producers()
    unshared = _unshared(graph)
    evictable = [
        producer[x] is not None and ops[producer[x]].phase == "forward"
        and len(ops[producer[x]].outputs) == 1 and unshared[x]
        and t.role == "activation" and ops[producer[x]].time > 0 and t.bytes > 0
        for x, t in enumerate(tensors)]
    runs: dict[int, list[int]] = {}  # op -> the positions of its computations
    for p, (kind, i) in enumerate(steps):
        if kind == "compute":
            runs.setdefault(i, []).append(p)
    alive = {x for x, t in enumerate(tensors) if t.role in PREEXISTING_ROLES}
    touched: dict[int, int] = {}  # alive evictable tensor -> the last step that made/read it
    freed: dict[int, int] = {}  # tensor made and freed since -> the step of that free
    found: list[_Eviction] = []
    for p, (kind, i) in enumerate(steps):
        if kind == "free":
            if i in alive:
                freed[i] = p
            alive.discard(i)
            touched.pop(i, None)
            continue
        op = ops[i]
        for x in op.inputs:
            a = touched.get(x)
            if a is not None and p - a > 1:
                k = producer[x]
                assert k is not None
                reads = tuple(ops[k].inputs)
                moved = _moves(graph, reads, p, alive, evictable, producer, runs)
                if moved is not None:
                    found.append(_Eviction(x, k, a, p, int(tensors[x].bytes),
                                           float(ops[k].time) + sum(m.time for m in moved),
                                           reads, moved))
                if moved is None or any(m.drop < 0 for m in moved):
                    # (inputs kept alive replace only runs added)
                    kept = _moves(graph, reads, p, alive, evictable, producer, runs, freed)
                    if kept is not None and any(m.unfree >= 0 for m in kept):
                        e = _Eviction(x, k, a, p, int(tensors[x].bytes),
                                      float(ops[k].time) + sum(m.time for m in kept),
                                      reads, kept)
                        if e.held < e.bytes:  # (else it frees nothing at some step)
                            found.append(e)
            if x in touched:
                touched[x] = p
        for x in op.outputs:
            alive.add(x)
            freed.pop(x, None)
            if evictable[x]:
                touched[x] = p
    return _Gaps(found, len(steps))


# Recomputations one eviction may move up at most (the Checkmate MobileNet at 50%: a padding
# whose input's batch norm and ReLU the plan recomputes a few steps after its next read)
_MAX_MOVED = 16
# and how many steps up (each check of the room for the moved outputs scans that stretch)
_MOVE_REACH = 256
# and how many steps back an input may be kept alive from its free (the same scan)
_KEEP_ALIVE_REACH = 256


def _moves(graph: Graph, needed: Sequence[int], p: int, alive: set[int], evictable: list[bool],
           producer: list[int | None], runs: dict[int, list[int]],
           freed: dict[int, int] | None = None) -> tuple[_Move, ...] | None:
    """The recomputations to move up to step ``p`` so that all of ``needed`` are alive there
    (inputs first): the next run of each op after ``p`` within reach, else, with ``freed``
    (tensor -> the step that freed it), the tensor kept alive from its free within reach, else
    a run added; None when some cannot be made (not evictable, or too many)."""
    ops = graph.ops
    moved: list[_Move] = []
    made: set[int] = set()

    def make(y: int) -> bool:
        if y in alive or y in made:
            return True
        k = producer[y]
        if not evictable[y] or k is None or len(made) >= _MAX_MOVED:
            return False
        made.add(y)
        later = runs[k]
        at = bisect.bisect_right(later, p)
        f = -1 if freed is None else freed.get(y, -1)
        if f >= 0 and p - f <= _KEEP_ALIVE_REACH and not (
                at < len(later) and later[at] - p <= _MOVE_REACH):
            moved.append(_Move(k, -1, int(graph.tensors[y].bytes), y, unfree=f))
            return True
        if not all(make(z) for z in ops[k].inputs):
            return False
        reads = tuple(ops[k].inputs)
        if at < len(later) and later[at] - p <= _MOVE_REACH:
            moved.append(_Move(k, later[at], int(graph.tensors[y].bytes), y, 0.0, reads))
        else:
            moved.append(_Move(k, -1, int(graph.tensors[y].bytes), y, float(ops[k].time), reads))
        return True

    return tuple(moved) if all(make(y) for y in needed) else None


# Exchanges tried per round at most, and evictions per exchange (each eviction scans the gaps
# once: bounded work on graphs of 100k ops)
_MAX_EXCHANGES = 256
_MAX_EVICTIONS = 32
_MAX_SCAN = 256  # gaps looked at for one eviction, cheapest per byte first


def _make_room(level: np.ndarray, a: int, p: int, need: np.ndarray, budget: int, gain: float,
               gaps: _Gaps, busy: set[int], reads_at: dict[int, list[int]],
               evicted: dict[int, list[tuple[int, int]]],
               deadline: float | None, kept: frozenset[int] = frozenset()) -> list[int] | None:
    """Gaps (indices) whose evictions lower ``level[a:p]`` so that ``need`` (bytes more at
    each of those steps) fits under ``budget``, costing less than ``gain`` in all; None when
    there are none. The cheapest of two picks: gaps cheapest per byte first, or one gap
    that alone covers all (those per byte can add up to more: the Checkmate MobileNet at
    50%, where one padding made again makes room for two outputs kept). ``kept``: the
    recomputations dropped for the outputs kept (each gap is taken as ``keeping`` them)."""
    room = level[a:p] + need
    picked = _cheapest_per_byte(level, a, room.copy(), budget, gain, gaps, busy, reads_at,
                                evicted, deadline, kept)
    cost = gain if picked is None else float(sum(gaps.cost[g] for g in picked))
    whole = _one_gap_for_all(level, a, room, budget, cost, gaps, busy, reads_at, evicted, kept)
    return [whole] if whole is not None else picked


def _cheapest_per_byte(level: np.ndarray, a: int, room: np.ndarray, budget: int, gain: float,
                       gaps: _Gaps, busy: set[int], reads_at: dict[int, list[int]],
                       evicted: dict[int, list[tuple[int, int]]],
                       deadline: float | None, kept: frozenset[int] = frozenset()
                       ) -> list[int] | None:
    """``_make_room``'s gaps taken cheapest per byte first, at the step most over each time
    (``room`` is the memory from step ``a`` with the outputs kept, lowered in place)."""
    picked: list[int] = []
    taken: list[_Eviction] = []  # the picked gaps' evictions, as taken beside ``kept``
    cost = 0.0
    mask = gaps.free.copy()
    while True:
        over = room - budget
        m = int(over.argmax())
        if over[m] <= 0:
            return picked
        if len(picked) >= _MAX_EVICTIONS or (
                deadline is not None and _time.perf_counter() > deadline):
            return None
        # only gaps over step m lower it, each by its bytes, and only those that keep the
        # cost under the gain can be picked from now on: when all of them together cannot
        # bring m under the budget, no choice here can (most calls end so, in one pass)
        step = m + a
        spans = np.flatnonzero(mask & (gaps.after < step) & (gaps.before > step)
                               & (cost + gaps.cost < gain))
        if int(gaps.bytes[spans].sum()) < over[m]:
            return None
        choice = None
        for g in spans[np.argsort(gaps.price[spans], kind="stable")][:_MAX_SCAN]:
            e = gaps.items[g].keeping(kept)
            if _conflicts(e, busy, reads_at, evicted) or any(
                    _clash(e, f) or _clash(f, e) for f in taken) or (
                    not e.moved_fits(level, budget)):
                mask[g] = False  # (none of these gets better as more are picked)
                continue
            choice = int(g)
            break
        if choice is None:
            return None
        mask[choice] = False
        picked.append(choice)
        taken.append(e)
        cost += e.cost
        e.apply(room, a)


def _one_gap_for_all(level: np.ndarray, a: int, room: np.ndarray, budget: int, gain: float,
                     gaps: _Gaps, busy: set[int], reads_at: dict[int, list[int]],
                     evicted: dict[int, list[tuple[int, int]]],
                     kept: frozenset[int] = frozenset()) -> int | None:
    """The cheapest gap whose eviction alone brings ``room`` (the memory from step ``a`` with
    the outputs kept) under ``budget`` for less than ``gain``, or None."""
    over = room - budget
    steps_over = np.flatnonzero(over > 0)
    if not len(steps_over):
        return None
    lo, hi = int(steps_over[0]) + a, int(steps_over[-1]) + a
    spans = np.flatnonzero(gaps.free & (gaps.after < lo) & (gaps.before > hi)
                           & (gaps.bytes >= int(over.max())) & (gaps.cost < gain))
    for g in spans[np.argsort(gaps.cost[spans], kind="stable")][:_MAX_SCAN]:
        e = gaps.items[g].keeping(kept)
        if _conflicts(e, busy, reads_at, evicted) or not e.moved_fits(level, budget):
            continue
        after = room.copy()
        e.apply(after, a)
        if int(after.max()) <= budget:
            return int(g)
    return None


def _conflicts(e: _Eviction, busy: set[int], reads_at: dict[int, list[int]],
               evicted: dict[int, list[tuple[int, int]]]) -> bool:
    """Whether evicting ``e`` would break a change already chosen: its next read is a dropped
    recomputation, an input of its op is evicted over its next read, or a recomputation
    inserted for another eviction reads its tensor within its gap."""
    if e.before in busy or not busy.isdisjoint(e.drops()):
        return True
    if any(a < e.before < b for x in e.inputs for a, b in evicted.get(x, ())):
        return True
    return any(e.after < q < e.before for q in reads_at.get(e.tensor, ()))


def _clash(e: _Eviction, other: _Eviction) -> bool:
    """Whether ``other``'s recomputation reads ``e``'s tensor within ``e``'s gap, both
    recompute right before the same step, move the same recomputation (or ``other`` moves the
    one ``e`` recomputes before), or one keeps alive an input the other makes."""
    return e.before == other.before or (
        e.tensor in other.inputs and e.after < other.before < e.before) or (
        e.before in other.drops() or not e.drops().isdisjoint(other.drops())) or (
        not e._kept_alive.isdisjoint(other._made) or not other._kept_alive.isdisjoint(e._made))


@dataclass
class _Candidate:
    """A recomputation to drop (at step ``pos``), its outputs kept alive instead from the
    first of their frees dropped with it (``start``). Inputs it was the last to read before
    their next free are freed earlier then (``released``: from, to, bytes), as the
    convolutions feeding a concatenation in a DenseNet, dead once the concatenation's output
    is kept."""

    gain: float  # the time saved
    pos: int
    frees: list[int]
    bytes: int  # kept from ``start`` to ``pos``
    start: int
    released: list[tuple[int, int, int]]

    def drop_released(self, busy: set[int]) -> None:
        """Forget the inputs whose free (the step ``to``) is dropped by a change chosen
        before (``busy``): they are not freed earlier."""
        if self.released:
            self.released = [r for r in self.released if r[1] not in busy]

    def add_need(self, need: np.ndarray, a: int) -> None:
        """Count the bytes this needs more at each step from ``a`` in ``need``, less those
        released there."""
        need[self.start - a:self.pos - a] += self.bytes
        for lo, hi, b in self.released:
            lo, hi = max(lo, a), min(hi, a + len(need))
            if lo < hi:
                need[lo - a:hi - a] -= b

    def release_outside(self, level: np.ndarray, a: int, p: int) -> None:
        """Count the bytes released outside steps ``a:p`` (those inside, ``add_need``) in
        ``level``."""
        for lo, hi, b in self.released:
            if lo < a:
                level[lo:min(a, hi)] -= b
            if hi > p:
                level[max(lo, p):hi] -= b

    @property
    def net_bytes(self) -> int:
        """The bytes kept less those released over the whole stretch kept."""
        return self.bytes - sum(b for lo, hi, b in self.released
                                if lo <= self.start and hi >= self.pos)


def _candidates(graph: Graph, steps: list[Step]) -> list[_Candidate]:
    """Every recomputation whose outputs were freed since the op's previous run."""
    ops, tensors = graph.ops, graph.tensors
    last_compute: dict[int, int] = {}
    frees_of: dict[int, list[int]] = {}  # tensor -> the steps that free it (so far)
    cands: list[_Candidate] = []
    for p, (kind, i) in enumerate(steps):
        if kind == "free":
            frees_of.setdefault(i, []).append(p)
            continue
        prev = last_compute.get(i)
        last_compute[i] = p
        if prev is None or ops[i].time <= 0:
            continue
        freed: list[int] = []
        extra = 0
        for x in ops[i].outputs:
            fs = frees_of.get(x, [])
            between = fs[bisect.bisect_right(fs, prev):]  # (the frees after the previous run)
            freed.extend(between)
            if between:
                # a view kept alive keeps its base's storage (the simulator counts it when
                # the base is freed, and again if the base is recomputed)
                extra += int(tensors[graph.storage_root(x)].bytes)
        if freed:
            cands.append(_Candidate(float(ops[i].time), p, freed, extra, min(freed), []))
    # the inputs whose reads go with a recomputation dropped: their reads, makes and frees
    # (a second pass, over those tensors only)
    unshared = _unshared(graph)
    wanted = {x for c in cands for x in ops[steps[c.pos][1]].inputs
              if tensors[x].role == "activation" and unshared[x] and tensors[x].bytes > 0}
    reads_of: dict[int, list[int]] = {x: [] for x in wanted}
    made_at: dict[int, list[int]] = {x: [] for x in wanted}
    frees_of = {x: [] for x in wanted}
    for p, (kind, i) in enumerate(steps):
        if kind == "free":
            if i in wanted:
                frees_of[i].append(p)
            continue
        op = ops[i]
        for x in op.inputs:
            if x in wanted and (not reads_of[x] or reads_of[x][-1] != p):
                reads_of[x].append(p)
        for x in op.outputs:
            if x in wanted:
                made_at[x].append(p)

    def released(x: int, p: int) -> tuple[int, int, int] | None:
        """The stretch over which input ``x`` would no longer be alive without its read at
        ``p``: from after the step that touched it before to its next free, when nothing
        reads it in between."""
        fs = frees_of[x]
        j = bisect.bisect_right(fs, p)
        if j == len(fs):
            return None  # (alive to the end)
        rs = reads_of[x]
        k = bisect.bisect_left(rs, p)
        if k + 1 < len(rs) and rs[k + 1] < fs[j]:
            return None
        ms = made_at[x]
        m = bisect.bisect_left(ms, p)
        touched = max(rs[k - 1] if k else -1, ms[m - 1] if m else -1)
        return (touched + 1, fs[j], int(tensors[x].bytes)) if touched >= 0 else None

    for c in cands:
        c.released = [r for x in dict.fromkeys(ops[steps[c.pos][1]].inputs)
                      if x in wanted and (r := released(x, c.pos))]
    return cands


def _keep_choices(graph: Graph, steps: list[Step], timeline: np.ndarray, budget: int,
                  deadline: float | None) -> list[_Choice]:
    """Recomputations to drop, most time saved per byte kept first, each fitting the timeline
    as raised by the ones before it, or after evictions that make room (``_eviction_gaps``,
    found at the first recomputation that needs them)."""
    ops = graph.ops
    cands = _candidates(graph, steps)
    # most time saved per byte kept first (a knapsack's greedy order; by time alone it did a
    # little worse)
    cands.sort(key=lambda c: -c.gain / max(c.net_bytes, 1))
    level = np.asarray(timeline, dtype=np.int64).copy()
    chosen: list[_Choice] = []
    busy: set[int] = set()  # compute steps dropped, or that an eviction recomputes before
    reads_at: dict[int, list[int]] = {}  # tensor -> steps where an inserted recompute reads it
    evicted: dict[int, list[tuple[int, int]]] = {}  # tensor -> its evicted gaps
    gaps: _Gaps | None = None
    exchanges = 0
    failed: list[int] = []  # candidates that found no room alone
    kept: frozenset[int] = frozenset()  # the recomputations dropped so far (outputs kept)

    def room_for(group: list[_Candidate]) -> list[_Eviction] | None:
        """Evictions that make room for keeping every candidate of ``group`` (those in
        ``level`` and the bookkeeping once found), or None."""
        nonlocal gaps
        for c in group:
            c.drop_released(busy)
        a = min(c.start for c in group)
        p = max(c.pos for c in group)
        need = np.zeros(p - a, dtype=np.int64)
        for c in group:
            c.add_need(need, a)
        evictions: list[_Eviction] = []
        over = level[a:p] + need - budget
        if int(over.max()) > 0:
            if gaps is None:
                gaps = _eviction_gaps(graph, steps)
            if (over > gaps.cover[a:p]).any():
                return None  # (even evicting every gap left leaves a step over)
            gain = sum(c.gain for c in group)
            own = frozenset(c.pos for c in group)
            # (recomputations dropped before, for outputs kept, count as kept too)
            held = own | kept
            # (and no eviction may keep an input alive by dropping a free the group drops)
            own_frees = {f for c in group for f in c.frees}
            picked = _make_room(level, a, p, need, budget, gain, gaps, busy | own | own_frees,
                                reads_at, evicted, deadline, held)
            if picked is None:
                return None
            for g in picked:
                e = gaps.items[g].keeping(held)
                gaps.take(g)
                e.apply(level)
                busy.add(e.before)
                busy.update(e.drops())
                for x in e.inputs:
                    reads_at.setdefault(x, []).append(e.before)
                evicted.setdefault(e.tensor, []).append((e.after, e.before))
                evictions.append(e)
        level[a:p] += need
        for c in group:
            c.release_outside(level, a, p)
            busy.update(hi for _, hi, _ in c.released)  # (the frees they count on stay)
        return evictions

    def blocked(c: _Candidate) -> bool:
        """Whether an inserted recomputation reads an output of ``c`` while it is freed."""
        return any(c.start < q < c.pos for x in ops[steps[c.pos][1]].outputs
                   for q in reads_at.get(x, ()))

    def fits(c: _Candidate) -> bool:
        c.drop_released(busy)
        if not c.released:  # (most candidates)
            return int(level[c.start:c.pos].max()) + c.bytes <= budget
        need = np.zeros(c.pos - c.start, dtype=np.int64)
        c.add_need(need, c.start)
        return int((level[c.start:c.pos] + need).max()) <= budget

    for n, c in enumerate(cands):
        if deadline is not None and n % 64 == 63 and _time.perf_counter() > deadline:
            break
        if c.pos in busy or not busy.isdisjoint(c.frees):
            continue
        if c.bytes and not fits(c):
            if exchanges >= _MAX_EXCHANGES or blocked(c):
                continue
            exchanges += 1
        evictions = room_for([c])
        if evictions is None:
            failed.append(n)
            continue
        busy.add(c.pos)
        busy.update(c.frees)
        kept |= {c.pos}
        chosen.append(_Choice(c.pos, c.frees, evictions))
    # two recomputations kept for one set of evictions: each alone gains less than they cost
    # (ResNet-50 at 70%: one block output of 784 MiB made again makes room for two of 392)
    exchanges = 0
    taken: set[int] = set()
    for k, n in enumerate(failed):
        if deadline is not None and _time.perf_counter() > deadline:
            break
        for m in failed[k + 1:k + 1 + _PARTNERS]:
            if n in taken or exchanges >= _MAX_EXCHANGES:
                break
            if m in taken:  # (kept with an earlier partner)
                continue
            c, d = cands[n], cands[m]
            if (c.pos in busy or d.pos in busy or blocked(c) or blocked(d)
                    or not busy.isdisjoint(c.frees) or not busy.isdisjoint(d.frees)
                    or max(c.start, d.start) >= min(c.pos, d.pos)):  # (no overlap)
                continue
            exchanges += 1
            evictions = room_for([c, d])
            if evictions is None:
                continue
            taken.update((n, m))
            busy.update((c.pos, d.pos, *c.frees, *d.frees))
            kept |= {c.pos, d.pos}
            chosen.append(_Choice(c.pos, c.frees, evictions))
            chosen.append(_Choice(d.pos, d.frees, []))
    return chosen


# Candidates after a failed one tried as its partner
_PARTNERS = 16


def _apply(graph: Graph, steps: list[Step], forward_len: int,
           choices: list[_Choice]) -> tuple[list[Step], int]:
    drop: set[int] = set()
    free_after: dict[int, list[Step]] = {}
    compute_before: dict[int, list[Step]] = {}
    for c in choices:
        drop.add(c.compute_pos)
        drop.update(c.free_pos)
        for e in c.evictions:
            free_after.setdefault(e.after, []).append(("free", e.tensor))
            for m in e.moved:
                if m.unfree >= 0:
                    drop.add(m.unfree)
                    continue
                compute_before.setdefault(e.before, []).append(("compute", m.op))
                if m.drop >= 0:
                    drop.add(m.drop)
            compute_before.setdefault(e.before, []).append(("compute", e.op))
            compute_before[e.before].extend(("free", y) for y in e.fresh())
    kept: list[_Placed] = []
    for p, s in enumerate(steps):
        fwd = p < forward_len
        kept.extend((t, fwd) for t in compute_before.get(p, ()))
        if p not in drop:
            kept.append((s, fwd))
        kept.extend((t, fwd) for t in free_after.get(p, ()))
    return _free_early(graph, _drop_dead_recomputes(graph, kept))


# (step, whether it belongs to the forward segment)
_Placed = tuple[Step, bool]


def _drop_dead_recomputes(graph: Graph, steps: list[_Placed]) -> list[_Placed]:
    """Remove recomputations whose new outputs are all freed before anything reads them (and
    those frees); removing one takes its reads away, which can leave the recomputation of its
    inputs dead in turn (a worklist, in time linear in the steps and their reads)."""
    ops = graph.ops
    ran: set[int] = set()
    made_at: dict[int, int] = {}  # alive tensor -> the compute position that made it
    new_outs: dict[int, list[int]] = {}  # recompute position -> the outputs it made
    readers: dict[tuple[int, int], int] = {}  # (maker position, tensor) -> reads before its free
    reads_of: dict[int, list[tuple[int, int]]] = {}  # recompute position -> (maker, tensor) read
    free_at: dict[tuple[int, int], int] = {}  # (maker position, tensor) -> position of its free
    for p, ((kind, i), _) in enumerate(steps):
        if kind == "compute":
            read = [(made_at[x], x) for x in dict.fromkeys(ops[i].inputs) if x in made_at]
            for key in read:
                readers[key] = readers.get(key, 0) + 1
            made = [x for x in dict.fromkeys(ops[i].outputs) if x not in made_at]
            for x in made:
                made_at[x] = p
            if i in ran:
                new_outs[p] = made
                reads_of[p] = read
            ran.add(i)
        else:
            q = made_at.pop(i, None)
            if q is not None:
                free_at[(q, i)] = p

    def dead(q: int) -> bool:
        return all((q, x) in free_at and not readers.get((q, x)) for x in new_outs[q])

    remove: set[int] = set()
    work = [q for q in new_outs if dead(q)]
    while work:
        q = work.pop()
        if q in remove:
            continue
        remove.add(q)
        remove.update(free_at[(q, x)] for x in new_outs[q])
        for key in reads_of[q]:
            readers[key] -= 1
            maker = key[0]
            if maker in new_outs and maker not in remove and dead(maker):
                work.append(maker)
    if not remove:
        return steps
    return [s for p, s in enumerate(steps) if p not in remove]


def _free_early(graph: Graph, steps: list[_Placed]) -> tuple[list[Step], int]:
    """Every free moved to right after the last compute that read or made its tensor; returns
    the steps and the new forward length (a free may move into the forward segment)."""
    ops = graph.ops
    last_touch: dict[int, int] = {}
    after: dict[int, list[Step]] = {}  # compute position -> frees placed right after it
    for p, ((kind, i), _) in enumerate(steps):
        if kind == "compute":
            for x in ops[i].inputs:
                last_touch[x] = p
            for x in ops[i].outputs:
                last_touch[x] = p
        else:
            after.setdefault(last_touch.get(i, -1), []).append((kind, i))
    result: list[Step] = list(after.get(-1, []))
    forward_len = len(result)
    for p, (s, fwd) in enumerate(steps):
        if s[0] != "compute":
            continue
        result.append(s)
        result.extend(after.get(p, []))
        if fwd:
            forward_len = len(result)
    return result, forward_len
