"""One ``HRockmate`` for every input shape, and budgets that stay the memory asked for.

A plan is made for one traced graph, and a graph for one set of input shapes. A call whose
tensors have other shapes (another sequence length, a smaller last batch, another image size)
is traced and planned inside that call (``switch_shape``); what was made for each shape (the
trace, the schedule and its compiled program) is kept in a bounded LRU (``ShapePrograms``), so
that a shape seen again switches back without tracing. Everything else a call must match (the
argument structure, dtypes, devices, non-tensor values) still raises ``InputMismatchError``,
as does any new shape with ``strict_shapes=True`` or a fixed ``plan=``.

A new shape learns from those planned before (``choose_for_build``): where its graph has the
structure of a held one (``structure_signature``: the same ops and tensors, other sizes), the
held schedule is simulated on the new graph and used when it fits the budget; where none fits,
the held hierarchy's block options are re-costed on the new graph (``recosted_hierarchy``) and
only the top level is solved. The held graph's measured op times, scaled per op by the ratio
of the cost model's estimates at the two sizes (``scale_times``), stand in for measuring the
new graph's.

Budgets (docs/input-shapes.md): a budget in bytes stays those bytes for every shape; a fraction
is taken of each new shape's own baseline (``budget_in_bytes``, the one rule for both). For the
changes the module follows on one shape (trainable parameters, training flags, a flipped
branch on the inputs' values, autocast) the budget is the bytes it was resolved to when that
shape was planned. Where no plan of the new graph fits those bytes, the lowest-peak plan found
runs and ``OverBudgetWarning`` says so, instead of a training call raising.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["DEFAULT_MAX_SHAPES", "OverBudgetWarning", "ShapePrograms", "budget_in_bytes",
           "choose_for_build", "shape_key", "structure_signature"]

logger = logging.getLogger("hrockmate.runtime.module")

#: Input shapes whose programs an ``HRockmate`` keeps by default (the one in use included).
#: Dynamic padding to multiples of a bucket size, or a last smaller batch, take a few; each
#: held program keeps its trace (the joint graph and the graph IR, without tensor data) and
#: its compiled code.
DEFAULT_MAX_SHAPES = 8

#: The improvement window (``solve_graph``'s ``improve_time``) of a new shape's top-level solve
#: over re-costed blocks, unless the solve options set one: the call that meets the shape
#: waits for it, and the blocks' options were already searched at the first shape.
NEW_SHAPE_IMPROVE_SECONDS = 2.0

#: Attributes of an ``HRockmate`` that every input shape shares; all other ``_hr_*``
#: attributes (and ``predicted_peak_bytes``) belong to the shape they were built for.
SHARED_BY_SHAPES = frozenset({"_hr_model", "_hr_request", "_hr_shapes"})


class OverBudgetWarning(UserWarning):
    """No plan of a changed graph (a change the module follows, or a new input shape) fits the
    budget: the module runs the lowest-peak plan it found, whose predicted peak is over it."""


def budget_in_bytes(budget: Any, graph: Any, baseline: int | None = None) -> int | None:
    """The budget in bytes for ``graph`` (None: no budget, store-all): bytes as given, a
    fraction of plain autograd's peak measured as the graph's store-all peak with the
    gradient seed that ``backward()`` makes. ``baseline``: the graph's store-all peak when the
    caller has simulated it already. ``HRockmate`` resolves a fractional budget against plain
    PyTorch's measured peak first (``capture.baseline.fraction_in_bytes``), so what comes here
    from it is bytes; a fraction here is of the traced store-all."""
    if budget is None:
        return None
    from hrockmate.ir.budget import parse_budget
    from hrockmate.ir.graph import gradient_seed_bytes

    if baseline is None:
        baseline = _store_all_peak(graph)
    return parse_budget(budget, baseline + gradient_seed_bytes(graph))


def _store_all_peak(graph: Any) -> int:
    from hrockmate.ir.schedule import simulate, store_all_schedule

    return int(simulate(graph, store_all_schedule(graph)).peak_bytes)


def shape_key(leaves: Sequence[Any]) -> tuple[Any, ...]:
    """The shapes of a call's tensor leaves (None for the other leaves): what tells one
    program from another."""
    return tuple(tuple(x.shape) if hasattr(x, "shape") and hasattr(x, "dtype") else None
                 for x in leaves)


def meta_shape_key(meta: Sequence[Any]) -> tuple[Any, ...]:
    """``shape_key`` of the leaves a trace describes (``(shape, dtype, device)`` per tensor)."""
    return tuple(tuple(m[0]) if isinstance(m, tuple) and len(m) == 3 else None for m in meta)


def describe_shapes(key: Sequence[Any]) -> str:
    shapes = [tuple(s) for s in key if s is not None]
    return ", ".join(str(s) for s in shapes) if shapes else "()"


def _listed(key: Sequence[Any]) -> list[Any]:
    """A shape key as JSON holds it (plans' stats are saved as JSON)."""
    return [None if s is None else list(s) for s in key]


def structure_signature(graph: Any) -> str:
    """A hash of the graph without its sizes: per tensor its role, view and gradient links,
    dtype and rank; per op its target, phase, inputs, outputs, module and flags. Two graphs
    with one signature differ only in sizes (and times), and ids are list positions, so a
    schedule of one names the same ops and tensors in the other."""
    h = hashlib.sha256()
    for t in graph.tensors:
        rank = None if t.shape is None else len(t.shape)
        h.update(f"T{t.role},{t.alias_of},{t.grad_of},{t.updates},{t.dtype},{rank};".encode())
    for o in graph.ops:
        h.update(f"O{o.target},{o.phase},{o.inputs},{o.outputs},{o.differentiates},"
                 f"{o.random},{o.mutates_buffer},{o.module};".encode())
    return h.hexdigest()[:16]


@dataclass
class ShapeInfo:
    """What a trace's graph was at its own shape before op times were measured."""

    key: tuple[Any, ...]
    signature: str
    estimates: list[float]  # the cost model's op times (``cost="estimate"``)


def _measured(graph: Any) -> bool:
    return graph.meta.get("cost_report", {}).get("mode") == "measure"


def scale_times(graph: Any, estimates: Sequence[float], donor_graph: Any,
                donor_estimates: Sequence[float], donor_key: tuple[Any, ...]) -> None:
    """Give ``graph`` the donor's measured op times, each scaled by the ratio of the cost
    model's estimates of that op at the two sizes (its FLOPs and bytes moved, plus a launch
    cost, so ops too small to matter keep their time). The graphs have one structure: op ``i``
    is the same op in both. Costs nothing to run; the plan cache's op times are left alone."""
    for op, new, old_op, old in zip(graph.ops, estimates, donor_graph.ops, donor_estimates):
        op.time = float(old_op.time) * (new / old) if old > 0 else float(new)
    graph.meta["cost_report"] = {"mode": "measure", "source": "scaled",
                                 "scaled_from_shape": _listed(donor_key)}


def recosted_hierarchy(hierarchy: Any, graph: Any) -> Any:
    """``hierarchy`` (prepared for a graph of ``graph``'s structure at other sizes) with the
    costs of every block option measured again on ``graph``: the same blocks and the same
    forward and backward fragments, whose times, saved bytes and peaks are those at the new
    sizes. Re-solving only the top level over these options skips the block MILPs, most of
    a solve; the options stay valid schedules of each block, though the MILPs at the new
    sizes might have offered other trade-offs."""
    from hrockmate.planning.blocks import GraphFacts
    from hrockmate.planning.level import option_from_steps

    start = time.perf_counter()
    ctx = GraphFacts(graph)

    def copied(block: Any) -> Any:
        new = dataclasses.replace(block, children=[copied(c) for c in block.children])
        if not block.is_root:
            options = [dataclasses.replace(option_from_steps(ctx, new, o.fwd, o.bwd, o.saved),
                                           near_store_all=o.near_store_all)
                       for o in block.options]
            new.options = sorted(options, key=lambda o: o.saved_bytes)
        return new

    root = copied(hierarchy.root)
    return dataclasses.replace(hierarchy, graph=graph, root=root, ctx=ctx,
                               seconds=time.perf_counter() - start)


def recosted_prepared(prepared: dict[str, dict[str, Any]], graph: Any
                      ) -> dict[str, dict[str, Any]]:
    """A module's prepared solve options (``with_hierarchy``'s, by options) with their
    hierarchies re-costed on ``graph`` (``recosted_hierarchy``)."""
    from hrockmate.planning.hierarchy import Hierarchy

    out: dict[str, dict[str, Any]] = {}
    for key, options in prepared.items():
        # (the top MILP searches its improvement window: a new shape's call waits for it)
        options = {"improve_time": NEW_SHAPE_IMPROVE_SECONDS, **options}
        h = options.get("hierarchy")
        if isinstance(h, Hierarchy):
            out[key] = {**options, "hierarchy": recosted_hierarchy(h, graph)}
        elif isinstance(h, (list, tuple)) and h and all(isinstance(x, Hierarchy) for x in h):
            out[key] = {**options, "hierarchy": [recosted_hierarchy(x, graph) for x in h]}
    return out


class ShapePrograms:
    """The programs an ``HRockmate`` holds for the input shapes it is not running now, most
    recently used last, at most ``max_shapes - 1`` of them (the one in use is the module's
    own). Pickling keeps the settings, not the programs (they hold traces)."""

    def __init__(self, max_shapes: int = DEFAULT_MAX_SHAPES, strict: bool = False) -> None:
        if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
            raise ValueError(f"max_shapes must be a whole number >= 1 (the input shapes whose "
                             f"programs are kept), got {max_shapes!r}")
        self.max_shapes = max_shapes
        self.strict = bool(strict)
        self.entries: OrderedDict[tuple[Any, ...], dict[str, Any]] = OrderedDict()
        self.planned = 0  # new shapes traced and planned in a call
        self.reused = 0  # ... of which ran a held shape's schedule, not solving

    def __getstate__(self) -> dict[str, Any]:
        return {"max_shapes": self.max_shapes, "strict": self.strict}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["max_shapes"], state["strict"])  # type: ignore[misc]

    def take(self, key: tuple[Any, ...]) -> dict[str, Any] | None:
        return self.entries.pop(key, None)

    def hold(self, key: tuple[Any, ...], state: dict[str, Any]) -> None:
        self.entries.pop(key, None)
        self.entries[key] = state
        while len(self.entries) > self.max_shapes - 1:
            dropped, _ = self.entries.popitem(last=False)
            logger.info("HRockmate: dropped the program of input shape %s (max_shapes=%d)",
                        describe_shapes(dropped), self.max_shapes)

    def states(self) -> list[dict[str, Any]]:
        """The held shapes' states, most recently used first."""
        return list(reversed(self.entries.values()))

    def clear(self) -> None:
        self.entries.clear()


def state_of(hmod: Any) -> dict[str, Any]:
    """What belongs to the shape the module runs now."""
    return {k: v for k, v in hmod.__dict__.items()
            if k.startswith("_hr_") and k not in SHARED_BY_SHAPES or k == "predicted_peak_bytes"}


def load_state(hmod: Any, state: dict[str, Any]) -> None:
    for k in list(state_of(hmod)):
        if k not in state:  # (a state saved before the module was traced again: unpickled)
            del hmod.__dict__[k]
    hmod.__dict__.update(state)


def switch_shape(hmod: Any, key: tuple[Any, ...], build: Callable[[list[dict[str, Any]]], Any]
                 ) -> None:
    """Make the module run input shape ``key``: its held program, else ``build(donors)``
    traces and plans it (``donors``: the states of the shapes planned before, for
    ``choose_for_build``). The shape in use is held; a failed build leaves it in use."""
    programs: ShapePrograms = hmod.__dict__["_hr_shapes"]
    old_key = meta_shape_key(hmod.__dict__["_hr_input_meta"])
    current = state_of(hmod)
    held = programs.take(key)
    if held is not None:
        programs.hold(old_key, current)
        load_state(hmod, held)
        logger.info("HRockmate: input shape %s, planned before; switched to its program",
                    describe_shapes(key))
        return
    start = time.perf_counter()
    try:
        build([current, *programs.states()])
    except BaseException:
        load_state(hmod, current)
        raise
    programs.hold(old_key, current)
    programs.planned += 1
    plan = hmod.__dict__["_hr_plan"]
    reused = "reused_from_shape" in plan.stats
    programs.reused += reused
    how = (f"the schedule of shape {describe_shapes(plan.stats['reused_from_shape'])} "
           "fits" if reused else f"{plan.method} plan")
    logger.info("HRockmate: input shape %s was traced and planned in %.2f s (%s, predicted "
                "peak %d bytes; %d shapes held, max_shapes=%d)", describe_shapes(key),
                time.perf_counter() - start, how, hmod.predicted_peak_bytes,
                len(programs.entries) + 1, programs.max_shapes)


def _reused(graph: Any, info: ShapeInfo, budget_bytes: int, donors: Sequence[dict[str, Any]],
            compile_fn: Callable[[Any], Any]) -> tuple[Any, Any, int, Any] | None:
    """A held shape's schedule run on ``graph`` (same structure), simulated at the new sizes,
    when it fits ``budget_bytes`` with the runtime's bytes; None when none does."""
    from hrockmate.ir.plan import Plan
    from hrockmate.ir.schedule import Schedule, ScheduleError, simulate, store_all_schedule

    base = None
    for donor in donors:
        other: ShapeInfo | None = donor.get("_hr_shape_info")
        plan = donor.get("_hr_plan")
        if other is None or other.signature != info.signature or plan is None:
            continue
        if plan.method == "store-all":
            continue  # (store-all fits only where the budget is above this graph's baseline)
        schedule = Schedule(list(plan.steps), plan.forward_len)
        try:
            sim = simulate(graph, schedule)
        except (ScheduleError, ValueError):
            continue
        if sim.peak_bytes > budget_bytes:
            continue
        program = compile_fn(schedule)
        if sim.peak_bytes + program.extra_bytes > budget_bytes:
            continue
        if base is None:
            base = simulate(graph, store_all_schedule(graph))
        made = Plan(graph_hash=graph.structure_hash(), graph_name=graph.name,
                    budget_bytes=int(budget_bytes), peak_bytes=int(sim.peak_bytes),
                    time=float(sim.time), baseline_peak_bytes=int(base.peak_bytes),
                    baseline_time=float(base.time), steps=list(schedule.steps),
                    forward_len=schedule.forward_len, time_unit=graph.time_unit,
                    stats={"method": plan.method, "optimal": False,
                           "reused_from_shape": _listed(other.key),
                           "reused_from_graph": plan.graph_hash})
        return schedule, made, int(sim.peak_bytes), program
    return None


def choose_for_build(choose: Callable[[Any], tuple[Any, Any, int, Any]], traced: Any,
                     key: tuple[Any, ...], budget: Any, compile_fn: Callable[[Any], Any], *,
                     change: str | None = None, donors: Sequence[dict[str, Any]] = (),
                     prepared: dict[str, dict[str, Any]] | None = None,
                     ) -> tuple[tuple[Any, Any, int, Any], int | None, ShapeInfo]:
    """(schedule, plan, simulated peak, program), the budget in bytes and the graph's
    ``ShapeInfo``, for a freshly traced graph. ``choose(budget_bytes)`` is the module's
    planner (store-all when it fits, the plan cache, the solver). ``donors``: the states of
    shapes planned before; one with the same structure lends its op times and, where it fits,
    its schedule, and where none fits its prepared hierarchies, re-costed at the new sizes,
    go into ``prepared`` (the new graph's, which ``choose`` solves with; the plan's
    ``stats["blocks_recosted_from_shape"]`` says so). ``change`` (in words) says the graph is
    not the one the user built the module for: then a budget no plan fits runs the lowest-peak
    plan with an ``OverBudgetWarning`` instead of raising ``InfeasibleBudget``."""
    from hrockmate.ir.plan import InfeasibleBudget

    graph = traced.graph
    info = ShapeInfo(key, structure_signature(graph), [float(op.time) for op in graph.ops])
    baseline = _store_all_peak(graph)
    budget_bytes = budget_in_bytes(budget, graph, baseline)
    recosted_from = None
    if budget_bytes is not None and budget_bytes < baseline and not _measured(graph):
        donor = next((d for d in donors if (d.get("_hr_shape_info") is not None
                                            and d["_hr_shape_info"].signature == info.signature
                                            and d.get("_hr_traced") is not None
                                            and _measured(d["_hr_traced"].graph))), None)
        if donor is not None:
            other: ShapeInfo = donor["_hr_shape_info"]
            scale_times(graph, info.estimates, donor["_hr_traced"].graph, other.estimates,
                        other.key)
        reused = _reused(graph, info, budget_bytes, donors, compile_fn)
        if reused is not None:
            return reused, budget_bytes, info
        for d in donors:  # (the most recently used shape of this structure lends its blocks)
            other = d.get("_hr_shape_info")
            if (other is not None and other.signature == info.signature
                    and d.get("_hr_prepared") and prepared is not None and not prepared):
                start = time.perf_counter()
                prepared.update(recosted_prepared(d["_hr_prepared"], graph))
                if prepared:
                    logger.info("HRockmate: the blocks of shape %s re-costed at shape %s in "
                                "%.2f s; solving the top level only", describe_shapes(other.key),
                                describe_shapes(key), time.perf_counter() - start)
                    recosted_from = other.key
                    break
    try:
        chosen = choose(budget_bytes)
        if recosted_from is not None and chosen[1].stats.get("method") != "store-all":
            chosen[1].stats["blocks_recosted_from_shape"] = _listed(recosted_from)
        return chosen, budget_bytes, info
    except InfeasibleBudget as exc:
        if change is None or budget_bytes is None:
            raise
        chosen = _lowest_peak(choose, exc)
    peak = chosen[2] + chosen[3].extra_bytes
    from hrockmate.ir.budget import format_bytes

    warnings.warn(
        f"HRockmate: {change}, and no plan of the new graph fits the budget of {budget_bytes} "
        f"bytes ({format_bytes(budget_bytes)}); it runs the lowest-peak plan found, predicted "
        f"peak {peak} bytes ({format_bytes(peak)}, {peak - budget_bytes} bytes over). To plan "
        f"for another budget call hmod.replan(budget), e.g. hmod.replan({peak}), or build "
        "HRockmate with a larger budget", OverBudgetWarning, stacklevel=5)
    return chosen, budget_bytes, info


def _lowest_peak(choose: Callable[[Any], tuple[Any, Any, int, Any]], exc: Any
                 ) -> tuple[Any, Any, int, Any]:
    """The plan for the lowest peak the solver reported (its ``InfeasibleBudget``): solved
    at that peak, or a little above where it was a bound no schedule reached; store-all
    (which always runs) when three tries found none."""
    from hrockmate.ir.plan import InfeasibleBudget

    target = exc.min_bytes
    for _ in range(3):
        try:
            return choose(target)
        except InfeasibleBudget as again:
            target = max(again.min_bytes, target + max(1, target // 100))
    return choose(None)
