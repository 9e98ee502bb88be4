"""The one planning entry of the runtime: a plan whose predicted peak, with what the runtime
keeps beside the graph's tensors, fits the budget.

``plan_for_runtime`` takes a plan or schedule as given, or finds one: from the plan cache, or by
measuring op times and solving (``solve_within_budget``: rounds of ``solve_graph`` until the plan
fits as compiled). The runtime passes in how it compiles a schedule (``compile_fn``, whose result
tells the bytes it adds: ``extra_bytes``, ``possible_extra_bytes``) and how it describes a
schedule that did not come from the solver (``describe``): planning never imports the runtime.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence


class CompiledProgram(Protocol):
    """What planning reads of a compiled schedule: the bytes the runtime keeps beside the
    graph's tensors (generator states, old buffer values, the allocator's slack), and the most
    a plan's runtime bytes may exceed store-all's.

    ``extra_bytes`` is the one place where memory the graph does not hold enters planning: it
    is per schedule, so a runtime that holds bytes depending on where the schedule puts its
    ops (per-block FSDP2's gathered parameters: ``hrockmate.runtime.fsdp``) gives what they
    add to that schedule's peak, and the rounds below fit the plan with them."""

    extra_bytes: int
    possible_extra_bytes: int
    # (optional) every schedule of the graph compiles to these extra bytes
    # extra_bytes_fixed: bool


Compile = Callable[[Any], Any]
Describe = Callable[[Any, Any, Any, Any, int, str], Any]


def plan_for_runtime(
    model: Any,
    sample: Any,
    traced: Any,
    budget: Any,
    plan: Any,
    solve_options: dict[str, Any],
    compile_fn: Compile,
    *,
    describe: Describe,
    seed_bytes: int = 0,
    cache: Any = None,
    prepared: dict[str, dict[str, Any]] | None = None,
) -> tuple[Any, Any, int, Any]:
    """(schedule, plan, simulated peak, compiled program) for the given arguments. Without a
    solver plan (store-all, or a hand-given schedule) a ``Plan`` describing the schedule is made,
    with ``stats["method"]`` "store-all" or "given". A solver plan comes from the plan cache
    (``hrockmate.planning.cache``) when it holds one for this graph, budget and options; otherwise
    the op times are measured (or taken from the cache) unless the graph has measured ones, the
    graph solved and the plan cached. ``prepared``: solve options with their hierarchies
    (``with_hierarchy``) by the options they were built for, kept by the caller across calls.
    ``describe(graph, schedule, sim, base, budget_bytes, method)`` makes the ``Plan`` of a
    schedule that did not come from the solver; ``seed_bytes``: the outputs' gradients, which a
    fraction of plain autograd's peak counts. The solve option ``drop_outputs=True`` plans for
    a caller that lets go of the outputs without a gradient before backward
    (``hrockmate.planning.dropped``)."""
    from hrockmate.ir.schedule import peak_lower_bound, simulate, store_all_schedule

    graph = traced.graph
    solve_options = dict(solve_options)
    drop_outputs = bool(solve_options.pop("drop_outputs", False))
    if plan is not None:
        if hasattr(plan, "check_graph"):  # a Plan
            plan.check_graph(graph)
            schedule = plan.schedule
            peak = int(simulate(graph, schedule).peak_bytes)  # validates it on this graph
            return schedule, plan, peak, compile_fn(schedule)
        if hasattr(plan, "steps") and hasattr(plan, "forward_len"):  # a Schedule
            sim = simulate(graph, plan)
            base = simulate(graph, store_all_schedule(graph))
            made = describe(graph, plan, sim, base, int(sim.peak_bytes), "given")
            return plan, made, int(sim.peak_bytes), compile_fn(plan)
        raise TypeError(
            f"plan= must be a hrockmate Plan or Schedule, got {type(plan).__name__}"
        )
    store_all = store_all_schedule(graph)
    base = simulate(graph, store_all)
    baseline = int(base.peak_bytes)
    program = compile_fn(store_all)
    budget_bytes = baseline + program.extra_bytes
    if budget is not None:
        from hrockmate.ir.budget import parse_budget

        # a fraction is of plain autograd's peak by the same measure: with the gradient seed
        budget_bytes = parse_budget(budget, baseline + seed_bytes)
    if drop_outputs:
        return _dropping_outputs(model, sample, traced, budget_bytes, solve_options, compile_fn,
                                 describe=describe, cache=cache, prepared=prepared)
    if budget_bytes >= baseline + program.extra_bytes:
        made = describe(graph, store_all, base, base, budget_bytes, "store-all")
        return store_all, made, baseline, program
    floor, why = peak_lower_bound(graph)
    if floor + program.extra_bytes > budget_bytes:  # (before op times and block options)
        raise below_floor(graph, budget_bytes, floor, why, program.extra_bytes)
    from hrockmate.planning.api import with_hierarchy
    from hrockmate.planning.cache import device_kind, measured_times, open_cache

    options = dict(solve_options)
    cost = options.pop("cost", "measure")
    if cost not in ("measure", "estimate"):
        raise ValueError(f"cost must be 'measure' or 'estimate', got {cost!r}")
    store = open_cache(cache)
    key = None
    if store is not None:
        # (a plan made on compiled code's op times, runtime.inductor, is not eager mode's)
        compiled = graph.meta.get("cost_report", {}).get("source") == "compiled"
        key = store.plan_key(graph, budget_bytes, {**options, "cost": cost},
                             device_kind(traced.device),
                             purpose="runtime-compiled" if compiled else "runtime")
        cached = store.load_plan(key, graph)
        if cached is not None:
            peak = int(simulate(graph, cached.schedule).peak_bytes)
            program = compile_fn(cached.schedule)
            if peak + program.extra_bytes <= budget_bytes:
                return cached.schedule, cached, peak, program
    measured = graph.meta.get("cost_report", {}).get("mode") == "measure"
    if cost == "measure" and not measured:  # op times matter for choosing what to recompute
        if sample is None:
            raise ValueError(
                "replanning needs the op times measured, and they were not (the module was "
                "built for store-all): pass sample= (the arguments of a call), or "
                "cost='estimate' to plan on estimated times")
        measured_times(traced, model, sample, store)
    # block options are shared by every round, and by later calls with the same options
    options_key = repr(sorted((k, repr(v)) for k, v in options.items()))
    if prepared is not None and options_key in prepared:
        options = prepared[options_key]
    else:
        options = with_hierarchy(graph, options)
        if prepared is not None:
            prepared.clear()  # (one set kept: hierarchies hold much of the graph's size)
            prepared[options_key] = options
    # store-all's extra bytes (the allocator's slack, mostly) are what most plans add too: the
    # first round solves for what is left, so that a tight budget is not solved twice
    new_plan, peak, program = solve_within_budget(
        graph, budget_bytes, options, compile_fn, reserve_bytes=program.extra_bytes,
        possible_reserve_bytes=program.possible_extra_bytes,
        reserve_fixed=bool(getattr(program, "extra_bytes_fixed", False)))
    if store is not None:
        store.save_plan(key, new_plan)
    return new_plan.schedule, new_plan, peak, program


#: Rounds of ``_dropping_outputs`` at most: each solves again for the budget less what the
#: last plan's forward exceeded it by (the dropped outputs are alive through the forward,
#: which the planning graph does not charge where its schedule frees them early).
DROPPED_ROUNDS = 3


def _dropping_outputs(model: Any, sample: Any, traced: Any, budget_bytes: int,
                      solve_options: dict[str, Any], compile_fn: Compile, *,
                      describe: Describe, cache: Any, prepared: Any
                      ) -> tuple[Any, Any, int, Any]:
    """``plan_for_runtime`` for a caller that drops the outputs without a gradient before
    backward (``drop_outputs=True``; ``hrockmate.planning.dropped``): planned on the graph
    in which they are activations, the schedule made one of the traced graph, its peak
    that with them freed where the forward ends."""
    import dataclasses

    from hrockmate.ir.schedule import store_all_schedule
    from hrockmate.planning import dropped as dr

    graph = traced.graph
    with_grad = {traced.output_ids[int(key)] for kind, key in traced.sources.values()
                 if kind == "tangent"}
    drop = dr.droppable_outputs(graph, traced.output_ids, with_grad)
    options = dict(solve_options)
    if not drop:
        return plan_for_runtime(model, sample, traced, budget_bytes, None, options, compile_fn,
                                describe=describe, cache=cache, prepared=prepared)
    planning = dr.planning_graph(graph, drop)
    store_all = store_all_schedule(graph)
    base = dr.dropped_peak(planning, store_all, drop)
    program = compile_fn(store_all)
    if budget_bytes >= base.peak_bytes + program.extra_bytes:
        made = describe(graph, store_all, base, base, budget_bytes, "store-all")
        made.stats.update(dropped_outputs=len(drop), dropped_output_ids=list(drop))
        return store_all, made, int(base.peak_bytes), program

    def compile_traced(schedule: Any) -> Any:
        return compile_fn(dr.traced_schedule(schedule, drop))

    # (the planning graph stands in for the traced one; the hierarchies prepared for the
    # traced graph are not its own)
    stand_in = _with_graph(traced, planning)
    from hrockmate.ir.plan import InfeasibleBudget

    target = budget_bytes
    reached: list[int] = []  # the peaks with the runtime's bytes of the plans that went over
    for _ in range(DROPPED_ROUNDS):
        try:
            _, made, _, _ = plan_for_runtime(model, sample, stand_in, target, None, options,
                                             compile_traced, describe=describe, cache=cache)
        except InfeasibleBudget:
            if not reached:
                raise  # (the first round's target is the budget asked: its refusal holds)
            break  # (a lower target than asked: the least peak a plan reached is named)
        schedule = dr.traced_schedule(made.schedule, drop)
        sim = dr.dropped_peak(planning, schedule, drop)
        program = compile_fn(schedule)
        over = int(sim.peak_bytes) + program.extra_bytes - budget_bytes
        if over <= 0:
            _warn_storage_shared(planning, schedule, drop)
            plan = dataclasses.replace(
                made, graph_hash=graph.structure_hash(), steps=list(schedule.steps),
                forward_len=int(schedule.forward_len), peak_bytes=int(sim.peak_bytes),
                time=float(sim.time), stats={**made.stats, "dropped_outputs": len(drop),
                                          "dropped_output_ids": list(drop)})
            return schedule, plan, int(sim.peak_bytes), program
        reached.append(int(sim.peak_bytes) + program.extra_bytes)
        target -= over
    raise InfeasibleBudget(budget_bytes, min(reached), graph.name)


def _with_graph(traced: Any, graph: Any) -> Any:
    import copy

    other = copy.copy(traced)
    other.graph = graph
    return other


def below_floor(graph: Any, budget_bytes: int, floor: int, why: str, reserve_bytes: int
                ) -> Exception:
    """The refusal of a budget below a proven floor of the graph's peak (``why`` says what
    proves it) plus the runtime's bytes beside the graph's tensors: store-all's, the fewest
    any plan's runtime keeps."""
    from hrockmate.ir.budget import format_bytes
    from hrockmate.ir.plan import InfeasibleBudget

    if reserve_bytes:
        why += f", and the runtime keeps {format_bytes(reserve_bytes)} beside the graph's tensors"
    return InfeasibleBudget(budget_bytes, floor + reserve_bytes, graph.name, why=why)


#: The largest share of the budget that ``solve_within_budget`` sets aside in its first round for
#: bytes a plan may add at runtime (generator states of random ops it replays, old values of
#: buffers it recomputes); above it the rounds find out instead.
POSSIBLE_RESERVE_SHARE = 0.01
#: ... and after a round's plan did not fit once compiled (beyond it, a target with all of them
#: set aside is mostly infeasible: small models with many random ops keep generator states of
#: a large share of their budget).
POSSIBLE_RESERVE_SHARE_AFTER_OVERFLOW = 0.05

#: Solve rounds of ``solve_within_budget`` at most (usually one; more only while plans' runtime
#: bytes push them over the budget, and from the fourth on only while they overshoot less
#: than the round before).
MAX_ROUNDS = 6


def solve_within_budget(graph: Any, budget_bytes: int, options: dict[str, Any],
                        compile_fn: Compile,
                        reserve_bytes: int = 0, possible_reserve_bytes: int = 0,
                        reserve_fixed: bool = False) -> tuple[Any, int, Any]:
    """The solver's plan for ``graph`` (``solve_graph`` with ``options``) whose predicted peak,
    the simulated one plus what the runtime keeps beyond the graph's tensors
    (``Program.extra_bytes``: saved generator states, old buffer values, the CUDA allocator's
    slack), fits ``budget_bytes``.

    The first round solves for ``budget_bytes - reserve_bytes - possible_reserve_bytes`` (the
    latter, the most a plan's runtime bytes can exceed the reserve's, only while it is at most
    ``POSSIBLE_RESERVE_SHARE`` of the budget), so that its plan fits as compiled. When a plan
    does not fit, the next round sets all of ``possible_reserve_bytes`` aside (its plan then
    fits as compiled; up to ``POSSIBLE_RESERVE_SHARE_AFTER_OVERFLOW`` of the budget), and later
    rounds solve for the budget less the last plan's extra bytes (``MAX_ROUNDS`` in all). A
    target with possible bytes set aside that turns out infeasible where the reserve alone
    would not is replaced by the target without them; one whose plan fits is compared with the
    plan for the budget less the last plan's extra bytes (one more solve), and the faster that
    fits as compiled is kept. Returns (plan, simulated peak, its
    compiled program); raises InfeasibleBudget when no round fits. ``reserve_fixed``: every
    schedule's runtime bytes are ``reserve_bytes`` (``least_peak_within``)."""
    from hrockmate.ir.plan import InfeasibleBudget

    reserve_bytes = max(0, int(reserve_bytes))
    possible_all = max(0, int(possible_reserve_bytes))
    possible = possible_all if possible_all <= POSSIBLE_RESERVE_SHARE * budget_bytes else 0
    target = budget_bytes - reserve_bytes - possible
    # where to go when a target with the possible bytes set aside is infeasible
    give_back = budget_bytes - reserve_bytes if possible else None
    reserved_all = possible == possible_all or (
        possible_all > POSSIBLE_RESERVE_SHARE_AFTER_OVERFLOW * budget_bytes)
    reached: list[int] = []  # peaks with the runtime's bytes of the plans the rounds compiled
    floor: int | None = None  # the lowest peak the solver reached, with the reserve
    looser: int | None = None  # a target above the one with all possible bytes set aside

    def fits(peak: int, program: CompiledProgram) -> bool:  # as compiled, with the runtime's bytes
        return peak + program.extra_bytes <= budget_bytes

    for _ in range(MAX_ROUNDS):
        if target <= 0:
            break
        try:
            plan, peak, program = solved_and_compiled(graph, target, options, compile_fn)
        except InfeasibleBudget as exc:  # (its lowest peak needs the runtime's bytes too)
            if give_back is not None and give_back > target and (
                    exc.min_bytes + reserve_bytes <= budget_bytes):
                # the possible bytes made it infeasible: the rounds find out what a plan adds
                target, give_back, looser = give_back, None, None
                continue
            floor = exc.min_bytes + reserve_bytes
            if exc.why and floor > budget_bytes:
                raise below_floor(graph, budget_bytes, exc.min_bytes, exc.why,
                                  reserve_bytes) from None
            break
        if fits(peak, program):
            if looser is not None:
                # all possible bytes set aside may leave only a slower method's plan, where
                # the plan for the budget less the last plan's bytes fits as compiled: one
                # solve there, kept when it fits and is faster
                try:
                    other = solved_and_compiled(graph, looser, options, compile_fn)
                except InfeasibleBudget:
                    other = None
                if other is not None and fits(other[1], other[2]) and other[0].time < plan.time:
                    return other
            return plan, peak, program
        if len(reached) >= 3 and peak + program.extra_bytes >= reached[-1]:
            reached.append(peak + program.extra_bytes)
            break  # (not converging)
        reached.append(peak + program.extra_bytes)
        target, give_back = min(target, budget_bytes - program.extra_bytes) - 1, None
        if not reserved_all:
            # a plan added runtime bytes: set aside all a plan may add, so that the next one
            # fits as compiled (each tighter plan can recompute one more buffer update, so
            # stepping down by the last plan's bytes can take many rounds)
            reserved_all = True
            if budget_bytes - reserve_bytes - possible_all < target:
                target, give_back = budget_bytes - reserve_bytes - possible_all, target
                looser = give_back
    if options.get("method", "hrockmate") == "hrockmate":
        return least_peak_within(graph, budget_bytes, options, compile_fn, reserve_bytes,
                                 reserve_fixed)
    # the smallest a compiled plan reached (it fits a budget of its peak with its runtime
    # bytes), else the solver's lowest peak with the reserve
    raise InfeasibleBudget(budget_bytes, min(reached) if reached else
                           floor if floor is not None else budget_bytes + 1, graph.name)


def least_peak_within(graph: Any, budget_bytes: int, options: dict[str, Any],
                      compile_fn: Compile, reserve_bytes: int = 0, reserve_fixed: bool = False
                      ) -> tuple[Any, int, Any]:
    """The lowest-peak schedule found for ``graph`` (``minima.least_peak``, the same for every
    budget) as (plan, simulated peak, compiled program) when, compiled, it fits
    ``budget_bytes``; else the refusal that names its peak with its compiled program's extra
    bytes: a budget of that many bytes is one this schedule fits as compiled. The peaks the
    rounds' plans reached are not named: they come from searches at other targets, which a
    solve at that number would not repeat.

    Only schedules that may lower the best total are compiled: every schedule's runtime keeps
    ``reserve_bytes`` at least (store-all's, the fewest), and with ``reserve_fixed`` exactly
    that, so only the one returned is compiled. (The least peak is often recompute-all's, of
    millions of steps on graphs of thousands of ops: compiling it to refuse a budget cost more
    than the whole solve.)"""
    from hrockmate.ir.plan import InfeasibleBudget
    from hrockmate.ir.schedule import Schedule
    from hrockmate.planning.api import least_peak_plan
    from hrockmate.planning.minima import least_peak_for_options

    least = least_peak_for_options(graph, options)
    best: tuple[int, int, Any, Any] | None = None  # (total, simulated peak, schedule, program)
    for peak, _t, _label, steps, fl in least.schedules:
        if best is not None and peak + reserve_bytes >= best[0]:
            break  # (by ascending peak: no later one can have a smaller total)
        schedule = Schedule(steps=list(steps), forward_len=fl)
        if reserve_fixed and peak + reserve_bytes > budget_bytes:
            # (the least total, and over the budget: its bytes are known without compiling)
            best = (peak + reserve_bytes, peak, schedule, None)
            break
        program = compile_fn(schedule)
        total = peak + int(program.extra_bytes)
        if best is None or total < best[0]:
            best = (total, peak, schedule, program)
        if reserve_fixed:
            break  # (the first has the least total)
    assert best is not None
    total, peak, schedule, program = best
    if total <= budget_bytes:
        return least_peak_plan(graph, schedule, least.label, budget_bytes), peak, program
    extra = total - peak
    # (a proven least peak stays proven with the fewest runtime bytes any plan keeps)
    proof = least.proof if peak == least.peak and extra <= reserve_bytes else ""
    if proof and extra:
        proof += ", and the runtime keeps no fewer bytes beside the graph's tensors"
    raise InfeasibleBudget(budget_bytes, total, graph.name, proof=proof)


def solved_and_compiled(graph: Any, target: int, options: dict[str, Any],
                        compile_fn: Compile) -> tuple[Any, int, Any]:
    """The solver's plan for ``target`` bytes, its simulated peak and its compiled program
    (raises InfeasibleBudget as ``solve_graph`` does)."""
    from hrockmate.ir.schedule import simulate
    from hrockmate.planning.api import solve_graph

    plan = solve_graph(graph, max(target, 2), **options)  # (a bare 1 would mean 100%)
    plan.check_graph(graph)
    peak = int(simulate(graph, plan.schedule).peak_bytes)
    return plan, peak, compile_fn(plan.schedule)


def _warn_storage_shared(graph: Any, schedule: Any, drop: Sequence[int]) -> None:
    """Dropped outputs that share their storage with tensors the backward reads (a cache of
    keys and values the caller asked for) are let go of with the caller, and the peak is
    predicted with their storage freed with those tensors; on deep decoders that prediction
    has measured a few percent low, so the caller is told, with the exact alternative."""
    import logging

    from hrockmate.planning import dropped as dr

    steps = [(str(k), int(i)) for k, i in schedule.steps]
    read = dr.read_after_forward(graph, steps, int(schedule.forward_len))
    roots = {graph.storage_root(t) for t in read}
    shared = [t for t in drop if t not in read and graph.storage_root(t) in roots]
    if shared:
        names = ", ".join(graph.tensors[t].name for t in shared[:4])
        logging.getLogger("hrockmate").warning(
            "drop_outputs=True: %d dropped output(s) (%s%s) share storage with tensors the "
            "backward reads (a returned cache of keys and values); the predicted peak of "
            "dropping them can be a few percent low on deep models. Leave use_cache out of "
            "the sample (or pass use_cache=False) for an exact prediction",
            len(shared), names, ", ..." if len(shared) > 4 else "")
