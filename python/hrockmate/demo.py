"""``hrockmate demo``: the whole pipeline on a built-in GPT-2-style model with random weights.

Trace one training iteration, plan it under a budget, train with the planned module, and
compare peak memory (budget definition), iteration time and gradients with plain PyTorch.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from typing import Any, Callable

import torch

from hrockmate.ir.budget import BudgetLike, format_bytes, parse_budget
from hrockmate.planning.bounds import time_lower_bound


def _paired_median_times(first: Callable[[], Any], second: Callable[[], Any],
                         iterations: int) -> tuple[float, float]:
    """Median seconds of each step, the two alternating so that load changes on a shared
    machine hit both alike."""
    first()  # warm-up
    second()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(iterations):
        for step, sink in ((first, times[0]), (second, times[1])):
            t0 = time.perf_counter()
            step()
            sink.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_demo(
    *,
    n_layer: int = 4,
    n_embd: int = 128,
    seq: int = 128,
    batch: int = 8,
    budget: BudgetLike = 0.5,
    iterations: int = 3,
    seed: int = 0,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run the demo and print a report; returns the figures as a dict. ``threads``: torch's CPU
    threads for the run (None: leave torch's setting)."""
    from hrockmate.capture.memory import measure_eager_peak, measure_peak_memory
    from hrockmate.models import gpt2_tiny
    from hrockmate.runtime import HRockmate
    from hrockmate.runtime.cpu_memory import ENV_VAR, keep_freed_cpu_memory

    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model, sample = gpt2_tiny(
        n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 32), seq=seq, batch=batch,
        vocab=256, dropout=0.1, with_loss=True, seed=seed,
    )
    reference = copy.deepcopy(model)
    print(f"threads   {torch.get_num_threads()} torch CPU threads on {os.cpu_count()} cores "
          "(--threads to change; other jobs on these cores make the times noisy)")
    if keep_freed_cpu_memory():  # before either run, so that both allocate alike
        print(f"memory    freed CPU memory is kept for reuse, as CUDA's caching allocator does "
              f"({ENV_VAR}=0 to turn off)")
    print(
        f"model     GPT-2-style decoder: {n_layer} layers, width {n_embd}, sequence {seq}, "
        f"batch {batch}, {sum(p.numel() for p in model.parameters()):,} parameters (random)"
    )

    t0 = time.perf_counter()
    hmod = HRockmate(model, sample, budget=budget, progress=False)
    setup_s = time.perf_counter() - t0
    plan = hmod.plan
    graph = hmod.traced.graph
    done = "traced in" if plan.stats.get("cache") == "hit" else "traced and planned in"
    source = ", plan from the cache" if plan.stats.get("cache") == "hit" else ""
    print(
        f"plan      {graph.num_ops} ATen ops {done} {setup_s:.1f} s "
        f"(method {plan.method}{source})"
    )

    # Same seed on both sides: dropout draws the same numbers, so gradients must match.
    torch.manual_seed(seed + 1)
    eager = measure_eager_peak(reference, sample, traced=hmod.traced)
    reference_grads = _grads(reference)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed + 1)
    hr = measure_peak_memory(
        lambda: hmod(*sample).backward(), params=[p for p in model.parameters()]
    )
    ours_grads = _grads(model)
    max_err = max(
        (float((ours_grads[n] - g).abs().max()) for n, g in reference_grads.items()), default=0.0
    )
    same = ours_grads.keys() == reference_grads.keys() and max_err == 0.0

    def eager_step() -> None:
        reference.zero_grad(set_to_none=True)
        reference(*sample).backward()

    def hr_step() -> None:
        model.zero_grad(set_to_none=True)
        hmod(*sample).backward()

    t_eager, t_hr = _paired_median_times(eager_step, hr_step, iterations)

    # the budget asked for; plan.budget_bytes is the solver's target, lowered by what the
    # runtime keeps besides the graph's tensors (saved random-generator states); a fraction
    # is of the smaller of plain PyTorch's peak and the traced store-all's (docs/budget.md)
    from hrockmate.capture.baseline import EagerBaseline, budget_reference, traced_store_all_peak

    measured = plan.eager_peak_bytes
    budget_bytes = parse_budget(budget, budget_reference(
        traced_store_all_peak(graph), None if measured is None else EagerBaseline(measured, "")))
    print(f"budget    {format_bytes(budget_bytes)}")
    print(f"{'':10}{'peak memory':>14}{'iteration':>12}")
    print(f"{'PyTorch':10}{format_bytes(eager.peak_bytes):>14}{t_eager * 1e3:>10.1f}ms")
    print(
        f"{'hrockmate':10}{format_bytes(hr.peak_bytes):>14}{t_hr * 1e3:>10.1f}ms"
        f"   (predicted {format_bytes(hmod.predicted_peak_bytes)})"
    )
    print(
        f"result    memory {100 * (1 - hr.peak_bytes / max(eager.peak_bytes, 1)):.0f}% lower, "
        f"time {100 * (t_hr / t_eager - 1):+.0f}% (predicted {100 * plan.overhead:+.0f}%), "
        "gradients "
        + ("identical to PyTorch" if same else f"differ (max abs error {max_err:.3g})")
    )
    # what no schedule within the plan's budget can beat, on the same predicted op times
    bound = time_lower_bound(graph, plan.budget_bytes, time_limit=5.0)
    print(f"bound     time {100 * bound.overhead:+.0f}%: no schedule within this budget is "
          "predicted faster (hrockmate.time_lower_bound)")
    return {
        "eager_peak_bytes": eager.peak_bytes,
        "hrockmate_peak_bytes": hr.peak_bytes,
        "predicted_peak_bytes": hmod.predicted_peak_bytes,
        "budget_bytes": budget_bytes,
        "eager_seconds": t_eager,
        "hrockmate_seconds": t_hr,
        "predicted_overhead": plan.overhead,
        "lower_bound_overhead": bound.overhead,
        "gradients_identical": same,
        "max_abs_grad_error": max_err,
    }
