"""What a new input shape costs an HRockmate: its first call against the first construction.

One ``HRockmate`` is built on the first shape with the plan cache off, then called with each
other shape in turn, as a training loop with dynamic padding or a smaller last batch calls it:

- ``gpt2``: the demo GPT-2 (``hrockmate.models.gpt2_tiny``, 4 layers, width 128, batch 8),
  sequence lengths 64, then 96, 128 and 80;
- ``cnn_bn``: the ResNet-like CNN with BatchNorm (``models.cnn_bn``), batch 32, then 20;
- ``gpt2_bytes``: the demo GPT-2 with a budget in bytes (the ``--budget`` fraction of its
  sequence-64 baseline, held for every shape), sequence lengths 64, then 80 and 72: at 80 the
  held schedule peaks above those bytes, so the call solves, over the held blocks re-costed.

Recorded per case: the first construction's seconds, and per new shape the seconds of its
first call (tracing and planning it, then the step itself) and their ratio, how it was planned
(a held schedule reused, or solved), the steady step's time against plain PyTorch's (median of
alternating steps, in one process), the measured and predicted peaks against the shape's
budget and plain PyTorch's measured peak, and whether loss and gradients were bitwise equal.

    OMP_NUM_THREADS=1 python benches/new_shape_cost.py
    python benches/new_shape_cost.py --cases cnn_bn --budget 0.6 --iters 20

Writes JSON to ``benches/results/new_shape_cost.json`` (or ``--out``). The first case of a
process also pays the process's first AOTAutograd trace in its construction.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

import hrockmate
from hrockmate import models
from hrockmate.runtime import HRockmate


def _gpt2(seqs: tuple[int, ...] = (64, 96, 128, 80)
          ) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]], Callable[[Any], Any]]:
    model, _ = models.gpt2_tiny(n_layer=4, n_embd=128, n_head=4, seq=128, batch=8, vocab=256,
                                dropout=0.1)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for seq in seqs:
        idx = torch.randint(0, 256, (8, seq), generator=gen)
        samples.append((idx, torch.randint(0, 256, (8, seq), generator=gen)))
    return model, samples, lambda out: out


def _cnn_bn() -> tuple[nn.Module, list[tuple[torch.Tensor, ...]], Callable[[Any], Any]]:
    model, x = models.cnn_bn(batch=32, image=32, width=16, n_blocks=4)
    last = torch.randn(20, *x.shape[1:], generator=torch.Generator().manual_seed(1))
    return model, [(x,), (last,)], lambda out: out.square().mean()


CASES = {"gpt2": _gpt2, "cnn_bn": _cnn_bn, "gpt2_bytes": lambda: _gpt2((64, 80, 72))}
#: Cases whose budget is the fraction's bytes at the first shape, held for the others.
IN_BYTES = {"gpt2_bytes"}


def _step(module: nn.Module, args: tuple[Any, ...], loss_of: Callable[[Any], Any]) -> Any:
    loss = loss_of(module(*args))
    loss.backward()
    return loss


def _same_step(hm: HRockmate, model: nn.Module, ref: nn.Module, args: tuple[Any, ...],
               loss_of: Callable[[Any], Any], seed: int) -> tuple[bool, float]:
    """One step of each from the same generator state and cleared gradients: bitwise equal?
    Returns (equal, seconds of the module's step)."""
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    loss = _step(hm, args, loss_of)
    seconds = time.perf_counter() - t0
    torch.manual_seed(seed)
    ref_loss = _step(ref, args, loss_of)
    same = torch.equal(loss.detach(), ref_loss.detach()) and all(
        (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
        for p, q in zip(model.parameters(), ref.parameters()))
    same = same and all(torch.equal(b, c) for b, c in zip(model.buffers(), ref.buffers()))
    return same, seconds


def _steady(hm: HRockmate, model: nn.Module, ref: nn.Module, args: tuple[Any, ...],
            loss_of: Callable[[Any], Any], iters: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"hrockmate": [], "plain": []}
    for _ in range(iters):  # alternating, so that the machine's load hits both alike
        for name, module, owner in (("hrockmate", hm, model), ("plain", ref, ref)):
            owner.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            _step(module, args, loss_of)
            times[name].append(time.perf_counter() - t0)
    h, p = statistics.median(times["hrockmate"]), statistics.median(times["plain"])
    return {"step_s": h, "plain_step_s": p, "step_ratio_vs_plain": h / p}


def _peak(module: nn.Module, owner: nn.Module, args: tuple[Any, ...],
          loss_of: Callable[[Any], Any]) -> int:
    owner.zero_grad(set_to_none=True)
    return hrockmate.measure_peak_memory(lambda: _step(module, args, loss_of),
                                         params=list(owner.parameters())).peak_bytes


def run_case(name: str, budget: Any, iters: int) -> dict[str, Any]:
    model, samples, loss_of = CASES[name]()
    ref = copy.deepcopy(model)
    if name in IN_BYTES:
        from hrockmate.capture.trace import trace_model
        from hrockmate.runtime.shapes import budget_in_bytes

        budget = budget_in_bytes(budget, trace_model(model, samples[0], cost="estimate").graph)
    t0 = time.perf_counter()
    hm = HRockmate(model, samples[0], budget=budget, cache=False, progress=False)
    construction = time.perf_counter() - t0
    num_ops = hm.traced.graph.num_ops
    shapes_out = []
    for k, args in enumerate(samples):
        entry: dict[str, Any] = {"shape": [list(a.shape) for a in args]}
        if k == 0:
            same, _ = _same_step(hm, model, ref, args, loss_of, seed=k)
        else:
            same, first = _same_step(hm, model, ref, args, loss_of, seed=k)
            entry["first_call_s"] = first
            entry["first_call_ratio"] = first / construction
        plan = hm.plan
        entry.update({
            "planned_by": ("reused the schedule of " + str(plan.stats["reused_from_shape"])
                           if "reused_from_shape" in plan.stats else plan.made_by
                           + (" over the blocks of " + str(plan.stats["blocks_recosted_from_shape"])
                              + " re-costed" if "blocks_recosted_from_shape" in plan.stats
                              else "")),
            "predicted_overhead": plan.overhead,
            "bitwise_equal": same,
            "budget_bytes": hm.budget_bytes,
            "predicted_peak_bytes": hm.predicted_peak_bytes,
        })
        entry.update(_steady(hm, model, ref, args, loss_of, iters))
        entry["measured_peak_bytes"] = _peak(hm, model, args, loss_of)
        entry["plain_peak_bytes"] = _peak(ref, ref, args, loss_of)
        entry["within_budget"] = (entry["measured_peak_bytes"] <= hm.budget_bytes
                                  and hm.predicted_peak_bytes <= hm.budget_bytes)
        shapes_out.append(entry)
        print(f"{name} {entry['shape']}: "
              + (f"first call {entry['first_call_s']:.2f} s "
                 f"({100 * entry['first_call_ratio']:.1f}% of the construction's "
                 f"{construction:.2f} s), " if k else f"construction {construction:.2f} s, ")
              + f"{entry['planned_by']}, step {entry['step_ratio_vs_plain']:.3f}x plain, "
              f"peak {entry['measured_peak_bytes']} of {hm.budget_bytes} "
              f"(plain {entry['plain_peak_bytes']}), bitwise {same}", flush=True)
    return {"case": name, "budget": budget, "num_ops_first_shape": num_ops,
            "first_construction_s": construction,
            "shapes": shapes_out}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--budget", default="0.5", help="the budget (a fraction, or bytes)")
    p.add_argument("--iters", type=int, default=10, help="steady steps of each, alternating")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                        "new_shape_cost.json"))
    args = p.parse_args(argv)
    budget: Any = float(args.budget) if "." in args.budget else args.budget
    results = [run_case(name, budget, args.iters) for name in args.cases]
    payload = {
        "benchmark": "new_shape_cost",
        "budget": args.budget,
        "torch": torch.__version__,
        "hrockmate": hrockmate.__version__,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(),
                    "load_average": list(os.getloadavg())},
        "plan_cache": "off",
        "cases": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
