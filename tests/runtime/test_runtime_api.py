"""HRockmate's API around the schedule: generated code, pickling, tracing from several threads."""

from __future__ import annotations

import copy
import io
import pickle
import threading
from typing import Any

import pytest
import torch
import torch.nn as nn

from hrockmate import models
from hrockmate.capture.trace import trace_model
from hrockmate.runtime import HRockmate


def _recompute_model() -> tuple[nn.Module, torch.Tensor]:
    return models.mlp(batch=16, d_in=32, hidden=64, n_layers=4, d_out=8)


# ---- generated_code ------------------------------------------------------------------------------
def test_generated_code_shows_forward_and_every_backward_chunk() -> None:
    model, x = _recompute_model()
    h = HRockmate(model, x, budget=0.8, cache=False, progress=False)
    assert h.recomputed_ops > 0
    code = h.generated_code()
    program = h._hr_program
    assert code.count("def forward_segment(P, B, X, S):") == 1
    for i in range(len(program.chunks)):
        assert f"def backward_chunk_{i}(E, B, T, S, GP, GX):" in code
    assert program.forward.source in code
    assert all(chunk.source in code for chunk in program.chunks)
    compile(code, "<generated>", "exec")  # the whole text is valid Python


# ---- pickling ------------------------------------------------------------------------------------
def _train(module: nn.Module, x: torch.Tensor, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        loss = module(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def test_torch_save_round_trip_trains_identically() -> None:
    model, x = _recompute_model()
    h = HRockmate(model, x, budget=0.8, cache=False, progress=False)
    buffer = io.BytesIO()
    torch.save(h, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, HRockmate)
    assert loaded.plan.steps == h.plan.steps
    assert "traced again at the first training call" in repr(loaded)
    with pytest.raises(RuntimeError, match="unpickled and has not been traced again yet"):
        loaded.generated_code()

    # the loaded module's parameters are its model's (one set of objects, not copies)
    assert [id(p) for p in loaded.parameters()] == [
        id(p) for p in loaded.wrapped_model.parameters()
    ]
    losses = _train(h, x)
    loaded_losses = _train(loaded, x)
    assert [float(v) for v in losses] == [float(v) for v in loaded_losses]
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name
    assert loaded.schedule.steps == h.schedule.steps  # the plan was reused, not solved again
    assert loaded.recomputed_ops == h.recomputed_ops


def test_pickle_and_deepcopy_keep_a_working_module() -> None:
    model, sample = models.gpt2_tiny(n_layer=1, n_embd=16, seq=8, vocab=32)
    h = HRockmate(model, sample, cache=False)
    for other in (pickle.loads(pickle.dumps(h)), copy.deepcopy(h)):
        torch.manual_seed(3)
        loss = other(*sample)
        loss.backward()
        torch.manual_seed(3)
        ref = h(*sample)
        ref.backward()
        assert torch.equal(loss.detach(), ref.detach())
        for (name, p), (_, q) in zip(other.named_parameters(), h.named_parameters()):
            assert torch.equal(p.grad, q.grad), name
        h.zero_grad(set_to_none=True)
        # the copy checks its inputs against the traced sample before tracing again: another
        # dtype is refused, another shape traced and planned (tests/runtime/test_shapes.py)
        with pytest.raises(ValueError, match="differs from the traced sample"):
            other(sample[0].to(torch.int32), sample[1])
        other(sample[0][:1], sample[1][:1]).backward()
        assert other.planned_shapes[0] == ((1, 8), (1, 8))


# ---- tracing from several threads ----------------------------------------------------------------
def test_tracing_from_several_threads() -> None:
    shared, sample = models.gpt2_tiny(n_layer=1, n_embd=16, seq=8, vocab=32)
    expected = trace_model(shared, sample, cost="none").graph.structure_hash()
    hashes: list[str] = []
    errors: list[BaseException] = []

    def work(own_model: bool) -> None:
        model = models.gpt2_tiny(n_layer=1, n_embd=16, seq=8, vocab=32)[0] if own_model else shared
        for _ in range(2):
            try:
                hashes.append(trace_model(model, sample, cost="none").graph.structure_hash())
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert hashes == [expected] * 8


# ---- replan --------------------------------------------------------------------------------------
def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    module(x).square().mean().backward()
    return [p.grad.clone() for p in module.parameters()]


def test_replan_switches_budgets_without_tracing_again() -> None:
    model, x = _recompute_model()
    reference = _grads(model, x)
    h = HRockmate(model, x, cache=False, progress=False)
    assert h.plan.method == "store-all"
    traced = h.traced
    # built for store-all, with measured op times by default: a sample is needed to measure them
    with pytest.raises(ValueError, match="pass sample="):
        h.replan(0.6)
    tight = h.replan(0.6, sample=x)
    assert h.plan is tight and tight.method == "hrockmate"
    assert tight.peak_bytes <= tight.budget_bytes
    assert h.traced is traced  # not traced again
    assert h.recomputed_ops > 0
    prepared = next(iter(h._hr_prepared.values()))["hierarchy"]
    loose = h.replan(0.9)  # times are measured now; the hierarchy is reused
    assert next(iter(h._hr_prepared.values()))["hierarchy"] is prepared
    assert loose.budget_bytes > tight.budget_bytes and loose.time <= tight.time
    for a, b in zip(_grads(h, x), reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert h.replan(None).method == "store-all" and h.recomputed_ops == 0


def test_replan_to_an_infeasible_budget_keeps_the_plan_in_use() -> None:
    from hrockmate import InfeasibleBudget

    model, x = _recompute_model()
    h = HRockmate(model, x, budget=0.8, cache=False, progress=False)
    before = h.plan
    with pytest.raises(InfeasibleBudget):
        h.replan(1000)  # bytes: far below any op's own inputs and outputs
    assert h.plan is before
    assert h._hr_request.budget == 0.8  # a later rebuild still plans for 0.8


def test_a_budget_below_one_ops_needs_is_refused_before_any_solve(monkeypatch) -> None:
    """Refused with the op and what it needs once the graph is traced, before its op times
    are measured and its blocks solved (it was after them: 8-20 s on timm's PoolFormer and
    Inception-v3, where one convolution's backward needs more than half of store-all)."""
    import hrockmate.planning.api as api
    import hrockmate.planning.cache as plan_cache
    from hrockmate import InfeasibleBudget

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("solving started")

    monkeypatch.setattr(api, "with_hierarchy", never)
    monkeypatch.setattr(plan_cache, "measured_times", never)
    model, x = _recompute_model()
    with pytest.raises(InfeasibleBudget) as info:
        HRockmate(model, x, budget=1000, cache=False, progress=False)
    assert "alone needs that much" in str(info.value) and info.value.min_bytes > 1000


# ---- the runtime's extra bytes ------------------------------------------------------------------
class _Program:
    """What ``solve_within_budget`` reads of a compiled program: the bytes the runtime adds."""

    def __init__(self, extra_bytes: int) -> None:
        self.extra_bytes = extra_bytes


def _counted_solves(monkeypatch) -> tuple[list[int], Any]:
    """Record the budget of every ``solve_graph`` call (the list), which the real solver (the
    function returned) still answers."""
    import hrockmate.planning.api as api

    targets: list[int] = []
    solve = api.solve_graph

    def counting_solve(g, budget, **options):
        targets.append(budget)
        return solve(g, budget, **options)

    monkeypatch.setattr(api, "solve_graph", counting_solve)
    return targets, solve


def test_a_reserve_for_the_runtimes_bytes_solves_a_tight_budget_once(monkeypatch) -> None:
    from graph_builders import training_graph

    from hrockmate import InfeasibleBudget
    from hrockmate.ir.schedule import simulate, store_all_schedule
    from hrockmate.runtime.module import solve_within_budget

    graph = training_graph(12, seed=3)
    store_all = int(simulate(graph, store_all_schedule(graph)).peak_bytes)
    targets, _ = _counted_solves(monkeypatch)
    options = {"time_limit": 10, "progress": False}
    extra = 64  # the runtime adds this to every plan's peak
    budget = int(0.7 * store_all)

    def compile_fn(schedule):
        return _Program(extra)

    plan, peak, _ = solve_within_budget(graph, budget, options, compile_fn)
    assert peak + extra <= budget
    # without a reserve the first round solves for the whole budget
    assert targets[0] == budget
    targets.clear()
    plan, peak, _ = solve_within_budget(graph, budget, options, compile_fn, reserve_bytes=extra)
    assert targets == [budget - extra] and peak + extra <= budget
    # an infeasible budget names a minimum that includes the reserve
    with pytest.raises(InfeasibleBudget) as info:
        solve_within_budget(graph, 100, options, compile_fn, reserve_bytes=extra)
    floor, why = info.value.min_bytes, info.value.why
    with pytest.raises(InfeasibleBudget) as info:
        solve_within_budget(graph, 100, options, compile_fn)
    assert floor == info.value.min_bytes + extra
    # far below any op's own needs: the solver's proven floor and its reason reach the caller
    assert info.value.why and why.startswith(info.value.why) and "the runtime keeps" in why


def test_after_an_overflow_the_faster_of_the_reserved_and_the_looser_plan_is_kept(
        monkeypatch) -> None:
    """A plan over the budget once compiled makes the next round set all possible bytes aside;
    that target may leave only a slower plan, so the target less the last plan's extra bytes is
    solved too and its plan kept when it fits as compiled and is faster."""
    from graph_builders import training_graph

    import hrockmate.planning.api as api
    from hrockmate.ir.schedule import simulate, store_all_schedule
    from hrockmate.runtime.module import solve_within_budget

    graph = training_graph(12, seed=3)
    store_all = int(simulate(graph, store_all_schedule(graph)).peak_bytes)
    options = {"time_limit": 10, "progress": False}
    fast = api.solve_graph(graph, int(0.9 * store_all), **options)
    slow = api.solve_graph(graph, int(0.7 * store_all), **options)
    assert slow.time > fast.time
    budget = fast.peak_bytes + 2
    possible = int(0.03 * budget)  # above the first round's share, below the later one's
    assert possible > 8
    targets: list[int] = []

    def fake_solve(g, target, **_):
        targets.append(target)
        return fast if target > budget - possible else slow

    monkeypatch.setattr(api, "solve_graph", fake_solve)
    compiled: list[int] = []

    def compile_fn(schedule):
        compiled.append(1)
        return _Program(3 if len(compiled) == 1 else 0)  # the first plan overflows by 1 byte

    plan, peak, _ = solve_within_budget(graph, budget, options, compile_fn,
                                        possible_reserve_bytes=possible)
    assert targets == [budget, budget - possible, budget - 4]
    assert plan is fast and peak <= budget
    # where the looser target's plan is not faster, the reserved round's plan stays
    targets.clear()
    compiled.clear()
    monkeypatch.setattr(api, "solve_graph",
                        lambda g, target, **_: targets.append(target) or slow)
    plan, _, _ = solve_within_budget(graph, slow.peak_bytes + 2 + possible, options,
                                     lambda s: _Program(0), possible_reserve_bytes=possible)
    assert plan is slow and len(targets) == 1


def test_the_first_round_reserves_what_a_plan_may_add(monkeypatch) -> None:
    """The bytes a plan may add at runtime (a generator state per replayed random op, an old
    value per recomputed buffer update) are set aside in the first round when they are a small
    share of the budget, and given back when they alone make the budget infeasible."""
    from graph_builders import training_graph

    import hrockmate.planning.api as api
    from hrockmate import InfeasibleBudget
    from hrockmate.ir.schedule import simulate, store_all_schedule
    from hrockmate.runtime.module import POSSIBLE_RESERVE_SHARE, solve_within_budget

    graph = training_graph(12, seed=3)
    store_all = int(simulate(graph, store_all_schedule(graph)).peak_bytes)
    targets, solve = _counted_solves(monkeypatch)
    options = {"time_limit": 10, "progress": False}
    extra = 64
    budget = int(0.7 * store_all)
    possible = int(POSSIBLE_RESERVE_SHARE * budget)
    assert possible > 0

    def compile_fn(schedule):
        return _Program(extra + possible)  # the plan replays everything it could

    plan, peak, _ = solve_within_budget(graph, budget, options, compile_fn, reserve_bytes=extra,
                                        possible_reserve_bytes=possible)
    assert targets == [budget - extra - possible]  # one round: it fits as compiled
    assert peak + extra + possible <= budget
    # more than the share: not reserved up front (the rounds find out)
    targets.clear()
    solve_within_budget(graph, budget, options, lambda s: _Program(extra), reserve_bytes=extra,
                        possible_reserve_bytes=budget // 2)
    assert targets == [budget - extra]
    # reserved, it would make a budget infeasible that the reserve alone allows: given back
    # (a solver whose lowest peak is a known plan's, so that the floor is exact)
    known = solve(graph, budget, **options)
    lowest = known.peak_bytes

    def floored_solve(g, budget, **options):
        targets.append(budget)
        if budget < lowest:
            raise InfeasibleBudget(budget, lowest, g.name)
        return known

    monkeypatch.setattr(api, "solve_graph", floored_solve)
    tight = lowest + extra
    small = max(1, int(POSSIBLE_RESERVE_SHARE * tight))
    targets.clear()
    plan, peak, _ = solve_within_budget(graph, tight, options, lambda s: _Program(extra),
                                        reserve_bytes=extra, possible_reserve_bytes=small)
    assert targets == [tight - extra - small, tight - extra]
    assert plan is known and peak + extra <= tight
    # an infeasible budget is still one, with the reserve in its minimum, and is not solved
    # again when giving the possible bytes back cannot make it feasible (the lowest-peak
    # schedule named is the known plan's, as the solver's)
    from hrockmate.planning import minima

    known_least = minima.LeastPeak(tuple(known.steps), known.forward_len, lowest, "known",
                                   False, "", ((lowest, known.time, "known",
                                                tuple(known.steps), known.forward_len),))
    monkeypatch.setattr(minima, "least_peak_for_options", lambda g, o: known_least)
    targets.clear()
    with pytest.raises(InfeasibleBudget) as info:
        solve_within_budget(graph, tight - 1, options, lambda s: _Program(extra),
                            reserve_bytes=extra, possible_reserve_bytes=small)
    assert info.value.min_bytes == tight and len(targets) == 1


def test_a_budget_no_round_fits_names_the_lowest_peak_schedule_as_compiled(
        monkeypatch) -> None:
    """When every round's plan needs more than the budget once compiled (each replays more
    random ops than the last), the error names the lowest-peak schedule's peak with its own
    compiled bytes: the rounds' plans came from searches at other targets, which a build at
    their peak would not repeat, so naming one of them is no promise."""
    from graph_builders import training_graph

    from hrockmate import InfeasibleBudget
    from hrockmate.ir.schedule import recompute_all_schedule, simulate, store_all_schedule
    from hrockmate.planning import minima
    from hrockmate.runtime.module import solve_within_budget

    graph = training_graph(12, seed=3)
    budget = int(0.95 * simulate(graph, store_all_schedule(graph)).peak_bytes)
    rc = recompute_all_schedule(graph)
    rc_peak = int(simulate(graph, rc).peak_bytes)
    steps = tuple((str(k), int(i)) for k, i in rc.steps)
    least = minima.LeastPeak(steps, int(rc.forward_len), rc_peak, "recompute-all", False, "",
                             ((rc_peak, 0.0, "recompute-all", steps, int(rc.forward_len)),))
    monkeypatch.setattr(minima, "least_peak_for_options", lambda g, o: least)
    growing = iter([budget // 20, budget // 6, 2 * budget, 4 * budget, 8 * budget])
    totals: list[int] = []

    def compile_fn(schedule):
        extra = next(growing)
        totals.append(int(simulate(graph, schedule).peak_bytes) + extra)
        return _Program(extra)

    with pytest.raises(InfeasibleBudget) as info:
        solve_within_budget(graph, budget, {"time_limit": 10, "progress": False}, compile_fn)
    assert len(totals) >= 3 and all(t > budget for t in totals)
    assert info.value.min_bytes == totals[-1] and not info.value.why


def test_fixed_runtime_bytes_refuse_the_least_peak_without_compiling_it(monkeypatch) -> None:
    """Where every schedule compiles to store-all's runtime bytes (no random op, no buffer
    update, no skippable region), a budget below the least peak with them is refused without
    compiling any lowest-peak schedule (recompute-all's, the least peak of large graphs, has
    millions of steps there), naming the same number as with them compiled; at that number,
    only the schedule returned is compiled."""
    from graph_builders import training_graph

    from hrockmate import InfeasibleBudget
    from hrockmate.ir.schedule import recompute_all_schedule, simulate, store_all_schedule
    from hrockmate.planning import minima
    from hrockmate.planning.entry import least_peak_within

    graph = training_graph(12, seed=3)
    rc = recompute_all_schedule(graph)
    rc_peak = int(simulate(graph, rc).peak_bytes)
    store_all = store_all_schedule(graph)
    sa_peak = int(simulate(graph, store_all).peak_bytes)
    assert rc_peak < sa_peak
    rows = tuple((peak, 0.0, label, tuple((str(k), int(i)) for k, i in s.steps),
                  int(s.forward_len))
                 for peak, label, s in ((rc_peak, "recompute-all", rc),
                                        (sa_peak, "store-all", store_all)))
    least = minima.LeastPeak(rows[0][3], rows[0][4], rc_peak, "recompute-all", False, "", rows)
    monkeypatch.setattr(minima, "least_peak_for_options", lambda g, o: least)
    extra = 8
    compiled: list[int] = []

    def compile_fn(schedule):
        compiled.append(len(schedule.steps))
        return _Program(extra)

    named = []
    for fixed in (False, True):
        compiled.clear()
        with pytest.raises(InfeasibleBudget) as info:
            least_peak_within(graph, rc_peak + extra - 1, {}, compile_fn, reserve_bytes=extra,
                              reserve_fixed=fixed)
        named.append(info.value.min_bytes)
        assert len(compiled) == (0 if fixed else 1)
    assert named == [rc_peak + extra, rc_peak + extra]
    compiled.clear()
    plan, peak, program = least_peak_within(graph, rc_peak + extra, {}, compile_fn,
                                            reserve_bytes=extra, reserve_fixed=True)
    assert peak == rc_peak and program.extra_bytes == extra
    assert compiled == [len(rc.steps)]


def test_a_model_without_random_ops_compiles_to_fixed_runtime_bytes() -> None:
    """The compiler says when no schedule can change the runtime's bytes: a plain MLP's
    programs all have the same ``extra_bytes``, a dropout model's are not fixed."""
    model, x = _recompute_model()
    h = HRockmate(model, x, budget=0.6, cache=False, progress=False)
    assert h.recomputed_ops > 0 and h._hr_program.extra_bytes_fixed
    store_all = HRockmate(model, x, budget=None, cache=False, progress=False)
    assert store_all._hr_program.extra_bytes == h._hr_program.extra_bytes
    torch.manual_seed(0)
    drop = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.1), nn.ReLU(), nn.Linear(64, 8))
    d = HRockmate(drop, torch.randn(16, 32), budget=None, cache=False, progress=False)
    assert not d._hr_program.extra_bytes_fixed


def test_after_a_plan_overflows_the_next_round_sets_aside_all_a_plan_may_add(
        monkeypatch) -> None:
    """A plan's runtime bytes grow as plans tighten (each may recompute one more BatchNorm):
    stepping down by the last plan's bytes took 4 rounds on timm's GhostNet. After one plan
    did not fit, the next round sets aside all a plan may add, and its plan fits as compiled."""
    import types

    import hrockmate.ir.schedule as schedule_module
    import hrockmate.planning.api as api
    from hrockmate.runtime.module import (
        POSSIBLE_RESERVE_SHARE,
        POSSIBLE_RESERVE_SHARE_AFTER_OVERFLOW,
        solve_within_budget,
    )

    class _Plan:  # a plan whose peak is its target, slower the tighter it is
        def __init__(self, peak: int) -> None:
            self.schedule = peak
            self.time = 1e9 - peak

        def check_graph(self, graph) -> None:
            pass

    targets: list[int] = []

    def solve(graph, budget, **options):
        targets.append(budget)
        return _Plan(budget)

    monkeypatch.setattr(api, "solve_graph", solve)
    monkeypatch.setattr(schedule_module, "simulate",
                        lambda graph, schedule: types.SimpleNamespace(peak_bytes=schedule))
    budget = 100_000
    share = (POSSIBLE_RESERVE_SHARE + POSSIBLE_RESERVE_SHARE_AFTER_OVERFLOW) / 2
    possible = int(share * budget)  # too much for the first round, not after an overflow
    adds = iter([possible // 4, possible, possible // 4])  # the tighter plan recomputes more
    plan, peak, program = solve_within_budget(
        types.SimpleNamespace(name="g"), budget, {}, lambda s: _Program(next(adds)),
        possible_reserve_bytes=possible)
    # (not budget - possible // 4 - 1 next: that target is only tried against the plan with
    # all possible bytes set aside, which fits; its plan fits too and is faster, so it is kept)
    assert targets == [budget, budget - possible, budget - possible // 4 - 1]
    assert peak + program.extra_bytes <= budget and plan.schedule == budget - possible // 4 - 1
    # beyond the share after an overflow, the rounds step down by the last plan's bytes
    targets.clear()
    adds = iter([budget // 40, budget // 40])
    solve_within_budget(types.SimpleNamespace(name="g"), budget, {},
                        lambda s: _Program(next(adds)), possible_reserve_bytes=budget // 4)
    assert targets == [budget, budget - budget // 40 - 1]
