"""The planning entry points: ``solve`` (a model), ``solve_graph`` (a graph or graph file) and
``pareto`` (many budgets from one hierarchy). They check the arguments, handle the budgets that
need no search (store-all, below a proven floor), and hand the rest to ``search.search``."""

from __future__ import annotations

import inspect
import logging
import math
import os
import time as _time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from hrockmate.ir.budget import BudgetLike, parse_budget
from hrockmate.ir.graph import Graph
from hrockmate.ir.plan import InfeasibleBudget, Plan
from hrockmate.ir.schedule import peak_lower_bound
from hrockmate.planning.context import GROUP_SIZE, SolveContext, improve_window
from hrockmate.planning.hierarchy import Hierarchy, HierarchyTimeout, leaf_sizes, prepare
from hrockmate.planning.methods import Candidate, Infeasible, check_method
from hrockmate.planning.policy import baseline_schedule, validate
from hrockmate.planning.search import improving_tries, search

logger = logging.getLogger("hrockmate")

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


def solve_graph(
    graph_or_path: Graph | str | os.PathLike[str],
    budget: BudgetLike,
    *,
    method: str = "hrockmate",
    time_limit: float | None = 300.0,
    mip_rel_gap: float = 1e-4,
    flat_ops: int = 60,
    leaf_size: int | None = None,
    group_size: int = GROUP_SIZE,
    top_size: int = 16,
    sub_time_limit: float | None = None,
    progress: bool = True,
    hierarchy: Hierarchy | Sequence[Hierarchy] | None = None,
    solvers: Mapping[str, str] | None = None,
    exact_ops: int = 100,
    improve_time: float | str | None = "auto",
) -> Plan:
    """Plan one training iteration given as a graph (IR JSON or a node-link file).

    Args:
        budget: a number in (0, 1] or a percentage (a fraction of the store-all peak), a whole
            number above 1 (bytes) or a string with a unit (``"6GiB"``); see
            ``hrockmate.parse_budget``.
        method: ``"hrockmate"`` (hierarchical H-ILP; graphs of at most ``flat_ops`` ops are
            solved at the op level, i.e. exactly), ``"checkmate"`` (exact MILP over all ops),
            ``"checkpoint"`` (per-block checkpointing), ``"selective"`` (the same, keeping
            matmul/conv/attention outputs), ``"layers"`` (per-layer checkpointing of the
            model's repeated layers, as its own gradient checkpointing does it),
            ``"twremat"`` (the fastest of TW-Remat's recursion depths that fits), ``"rotor"`` (Rotor's dynamic program; the graph must split into
            a chain of stages), ``"recompute-all"`` or ``"store-all"``.
        time_limit: seconds (positive, or None for no limit) for the whole solve: the blocks'
            options get 75% of it, then the top level and the simple strategies the rest.
            When it runs out the best plan found is returned with a warning and
            ``plan.stats["optimal"] = False``.
        leaf_size: forward ops per leaf block. None: 8, then 9 (graphs of at most 400
            ops: 6, 8, 9, then 4), keeping the fastest plan (``hierarchy.leaf_sizes``;
            ``plan.stats["leaf_size"]`` says which); the later sizes only within the
            improvement window (``improve_time``).
        sub_time_limit: seconds for each memory-limited MILP that makes a block's options
            (None: ``hierarchy.SUB_TIME_LIMIT``, 0.3 s).
        hierarchy: a prepared hierarchy (``with_hierarchy``), or several (one per leaf size;
            the fastest plan is kept), to solve only the top level.
        exact_ops: graphs of more than ``flat_ops`` and at most ``exact_ops`` ops whose
            hierarchy plan is beaten by a fallback, is missing, or recomputes over 10% are
            also tried at the op level: for at most 60 s when there is no plan at all, else
            within ``improve_time``. Graphs of at most ``flat_ops`` ops are planned at the
            op level first, from greedy eviction's plan, also within ``improve_time``.
        improve_time: seconds into the solve after which the work that can only improve a
            plan in hand stops (later leaf sizes, the op-level second try, an op-level or top
            MILP that has a schedule). ``"auto"``: 9 s on graphs of up to 1,000 ops, so that
            they plan in about 10 s, and 9 s per 1,000 ops on larger ones, at most 20 s
            (``context.improve_window``). None: up to ``time_limit`` (better plans, sometimes,
            for longer solves).
        solvers: (method ``"hrockmate"``) the solver of each kind of level:
            ``{"leaves": "ilp" | "rust" | "ilp+rust" | "twremat" | "ilp+twremat",
            "chains": "ilp" | "rotor", "top": "ilp" | "rotor"}``
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
    check_method(method)
    if time_limit is not None and not (isinstance(time_limit, (int, float))
                                       and math.isfinite(time_limit) and time_limit > 0):
        raise ValueError(f"time_limit must be a positive number of seconds or None, "
                         f"got {time_limit!r}")
    if improve_time not in (None, "auto") and not (
            isinstance(improve_time, (int, float)) and not isinstance(improve_time, bool)
            and math.isfinite(improve_time) and improve_time >= 0):
        raise ValueError(f"improve_time must be a number of seconds >= 0, 'auto' or None, "
                         f"got {improve_time!r}")
    from hrockmate.planning.level_solvers import check_solvers

    chosen = check_solvers(solvers)
    graph = _as_graph(graph_or_path)
    with graph.arrays_cached():  # the solve never changes the graph
        return _solve_graph(graph, budget, method=method, time_limit=time_limit,
                            mip_rel_gap=mip_rel_gap, flat_ops=flat_ops, leaf_size=leaf_size,
                            group_size=group_size, top_size=top_size,
                            sub_time_limit=sub_time_limit, progress=progress,
                            hierarchy=hierarchy, chosen=chosen, exact_ops=exact_ops,
                            improve_time=improve_time)


def _solve_graph(graph: Graph, budget: BudgetLike, *, method: str, time_limit: float | None,
                 mip_rel_gap: float, flat_ops: int, leaf_size: int | None, group_size: int,
                 top_size: int, sub_time_limit: float | None, progress: bool,
                 hierarchy: Hierarchy | Sequence[Hierarchy] | None, chosen: Mapping[str, str],
                 exact_ops: int, improve_time: float | str | None) -> Plan:
    t0 = _time.perf_counter()
    improve = improve_window(improve_time, graph.num_ops)
    base_steps, base_fl, base_peak, base_time = baseline_schedule(graph)
    budget_bytes = parse_budget(budget, base_peak)

    def plan_of(c: Candidate, peak: int, t: float) -> Plan:
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
        c = Candidate(base_steps, base_fl, True,
                      {"method": "store-all",
                       "note": "the budget is at or above the store-all peak"})
        return plan_of(c, base_peak, base_time)
    if method == "store-all":
        raise InfeasibleBudget(budget_bytes, base_peak, graph.name)
    floor, why = peak_lower_bound(graph)  # refuses a budget far too small at once
    if budget_bytes < floor:
        raise InfeasibleBudget(budget_bytes, floor, graph.name, why=why)

    ctx = SolveContext(time_limit=time_limit, mip_rel_gap=mip_rel_gap, flat_ops=flat_ops,
                       leaf_size=leaf_sizes(graph, leaf_size, flat_ops)[0],
                       group_size=group_size, top_size=top_size,
                       sub_time_limit=sub_time_limit, progress=progress, solvers=chosen,
                       deadline=None if time_limit is None else t0 + time_limit,
                       improve_until=None if improve is None else t0 + improve,
                       baseline_time=base_time, baseline_peak=base_peak)
    found = search(graph, method, budget_bytes, ctx, hierarchy=hierarchy, leaf_size=leaf_size,
                   exact_ops=exact_ops)
    if isinstance(found, Infeasible):
        if method != "hrockmate":  # (the other methods state their own minimum)
            raise InfeasibleBudget(budget_bytes, found.min_bytes, graph.name)
        found = least_peak_fallback(graph, budget_bytes, method, flat_ops, hierarchy)
    cand = found
    peak, t = validate(graph, cand, budget_bytes)
    if cand.notice:
        logger.warning("%s", cand.notice)
    plan = plan_of(cand, peak, t)
    shortfall = plan.shortfall(time_limit)
    if shortfall:
        import warnings

        warnings.warn(shortfall, stacklevel=2)
    logger.info("%s", plan.summary())
    return plan


def least_peak_fallback(graph: Graph, budget_bytes: int, method: str, flat_ops: int,
                        hierarchy: Hierarchy | Sequence[Hierarchy] | None) -> Candidate:
    """The lowest-peak schedule found for the graph (``minima.least_peak``) when it is within
    ``budget_bytes``, as the plan of a search that found none; else the refusal naming its
    peak, the one number that does not depend on the budget asked for and at which a solve
    returns a plan."""
    from hrockmate.planning.minima import least_peak_for_options

    least = least_peak_for_options(graph, {"flat_ops": flat_ops, "hierarchy": hierarchy})
    if least.peak > budget_bytes:
        raise InfeasibleBudget(budget_bytes, least.peak, graph.name, proof=least.proof)
    cand = Candidate(list(least.steps), least.forward_len, least.proven,
                     {"method": method, "fallback": "least-peak",
                      "least_peak_by": least.label})
    cand.notice = (f"{method} found no schedule for '{graph.name}' within {budget_bytes} bytes; "
                   f"using the lowest-peak schedule found ({least.label}, {least.peak} bytes)")
    return cand


def least_peak_plan(graph: Graph, schedule: Any, label: str, budget_bytes: int) -> Plan:
    """The ``Plan`` of a lowest-peak schedule (from ``minima.least_peak``, made by ``label``)
    for ``budget_bytes``."""
    from hrockmate.planning.policy import simulate_steps

    _steps, _fl, base_peak, base_time = baseline_schedule(graph)
    steps = [(str(k), int(i)) for k, i in schedule.steps]
    peak, t = simulate_steps(graph, steps, int(schedule.forward_len))
    return Plan(graph_hash=graph.structure_hash(), graph_name=graph.name,
                budget_bytes=int(budget_bytes), peak_bytes=peak, time=t,
                baseline_peak_bytes=base_peak, baseline_time=base_time,
                steps=steps, forward_len=int(schedule.forward_len),
                time_unit=graph.time_unit,
                stats={"method": "hrockmate", "fallback": "least-peak",
                       "least_peak_by": label, "optimal": False})


def solve(model: Any, sample: Any, budget: BudgetLike, *, loss_fn: Any = None,
          cache: Any = None, **options: Any) -> Plan:
    """Trace one training iteration of ``model`` on ``sample`` and plan it within ``budget``.

    A fractional budget is of the smaller of plain PyTorch's peak, measured once on ``sample``
    (``plan.eager_peak_bytes``; the model's state is restored after it), and the traced
    store-all peak (``plan.baseline_peak_bytes``; ``capture.baseline``, docs/budget.md).

    ``options`` are those of ``solve_graph`` (``method``, ``time_limit``, ...). The budget bounds
    activation memory: the peak, during forward and backward, of memory allocated by the
    iteration beyond what existed before it, not counting the parameters' ``.grad`` tensors.
    ``cache``: the plan cache (``hrockmate.planning.cache``): ``None`` the default location, a
    directory, or ``False`` to measure op times and solve afresh without reading or writing it.
    """
    from hrockmate.capture.trace import trace_model
    from hrockmate.ir.schedule import simulate, store_all_schedule
    from hrockmate.planning.cache import device_kind, measured_times, open_cache

    from hrockmate.capture.baseline import fraction_in_bytes, record_reference

    store = open_cache(cache)
    traced = trace_model(model, sample, loss_fn=loss_fn, cost="estimate", decisions_cache=store)
    graph = traced.graph
    # a fraction is of plain PyTorch's measured peak (capture.baseline)
    budget, eager = fraction_in_bytes(model, sample, traced, budget, loss_fn,
                                      False if store is None else store, seeds=False)
    key = None
    if store is not None:
        baseline = int(simulate(graph, store_all_schedule(graph)).peak_bytes)
        key = store.plan_key(graph, parse_budget(budget, baseline), options,
                             device_kind(traced.device), purpose="solve")
        cached = store.load_plan(key, graph)
        if cached is not None:
            record_reference(cached, eager)
            return cached
    measured_times(traced, model, sample, store)
    plan = solve_graph(graph, budget, **options)
    record_reference(plan, eager)
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


def with_hierarchy(graph: Graph, options: Mapping[str, Any], *,
                   workers: int | None = None) -> dict[str, Any]:
    """``solve_graph`` options for several solves of ``graph`` (other budgets): with method
    ``"hrockmate"`` the hierarchy and its block options are built once here, for each leaf
    size ``solve_graph`` would try, and reused, so each solve only solves the top levels.
    ``workers``: threads solving the blocks (``prepare``). When the time limit runs out while
    building them, the options are returned with the hierarchies built so far (none: each
    solve then falls back as it would alone)."""
    options = dict(options)
    if options.get("method", "hrockmate") == "hrockmate" and options.get("hierarchy") is None:
        keys = ("flat_ops", "group_size", "top_size", "time_limit", "sub_time_limit",
                "mip_rel_gap", "progress", "solvers")
        defaults = inspect.signature(solve_graph).parameters  # as solve_graph would prepare it
        kw = {k: options.get(k, defaults[k].default) for k in keys}
        prepared: list[Hierarchy] = []
        time_limit = kw["time_limit"]
        t0 = _time.perf_counter()

        def left() -> float | None:
            return None if time_limit is None else time_limit - (_time.perf_counter() - t0)

        sizes = leaf_sizes(graph, options.get("leaf_size"), kw["flat_ops"])
        improve = improve_window(options.get("improve_time", defaults["improve_time"].default),
                                 graph.num_ops)
        until = None if improve is None else t0 + improve
        for size, limit in improving_tries(sizes, until, left):
            if limit is not None:  # a later leaf size
                kw["time_limit"] = limit if math.isfinite(limit) else None
            try:
                prepared.append(prepare(graph, leaf_size=size, workers=workers, **kw))
            except HierarchyTimeout:
                break
        if prepared:
            options["hierarchy"] = prepared[0] if len(prepared) == 1 else prepared
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
        from hrockmate.capture.trace import trace

        graph = trace(graph_or_model, sample) if loss_fn is None else trace(
            graph_or_model, sample, loss_fn=loss_fn)
    else:
        graph = _as_graph(graph_or_model)
    check_method(options.get("method", "hrockmate"))
    options = with_hierarchy(graph, options)
    points = []
    for b in budgets:
        try:
            points.append(ParetoPoint(0, solve_graph(graph, b, **options)))
            points[-1].budget_bytes = points[-1].plan.budget_bytes  # type: ignore[union-attr]
        except InfeasibleBudget as exc:
            points.append(ParetoPoint(exc.budget_bytes, None))
    return points

