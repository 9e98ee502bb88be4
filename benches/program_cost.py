"""The generated program's own cost: measured against plain eager autograd and against the plan's
prediction, with and without running elementwise steps in place.

For each model and budget, HRockmate plans once; the schedule is then compiled twice, as the
runtime compiles it (``after``) and with no step run in place into its first argument
(``before``: ``runtime.compiler.REUSES_FIRST_ARGUMENT`` empty). Plain eager, ``before`` and
``after`` run full training iterations (forward and backward of the loss) in turn in one
process, the order rotating each round, so that load on the machine hits all three alike. The
result per run is the median iteration time (CPU time of the process by default, ``--clock``:
on a shared machine, elapsed time counts the waits for a core, which hit each run unevenly);
overheads are against eager. A budget is a
fraction of plain PyTorch's peak (``HRockmate``'s), or ``store-all``. The prediction is
``plan.overhead`` (the plan's time against store-all's, both with op times as measured, in
sequence: ``capture.costs``). Writes JSON to ``bench-results/program_cost.json`` (``--out``).

    python benches/program_cost.py                               # mamba, gpt2 (the demo's)
    python benches/program_cost.py --models mamba jamba --budgets store-all 0.7 0.5
    python benches/program_cost.py --models mamba --mamba-hidden 64 --mamba-layers 2 --mamba-seq 64

Mamba and Jamba are transformers' models from small random configs, on their slow torch path
(no ``mamba_ssm`` kernels): a scan of many small ops per layer, the kind of graph where the
program's cost per op shows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from hrockmate import models
from hrockmate.runtime import HRockmate
from hrockmate.runtime import compiler


def _mamba(ns: argparse.Namespace) -> tuple[nn.Module, Any]:
    import transformers

    cfg = transformers.MambaConfig(
        vocab_size=64, hidden_size=ns.mamba_hidden, state_size=8,
        num_hidden_layers=ns.mamba_layers, expand=2, conv_kernel=4, use_mambapy=False)
    model = transformers.MambaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, ns.mamba_seq))
    return model, {"input_ids": ids, "labels": ids}


def _jamba(ns: argparse.Namespace) -> tuple[nn.Module, Any]:
    import transformers

    cfg = transformers.JambaConfig(
        vocab_size=64, hidden_size=ns.jamba_hidden, intermediate_size=2 * ns.jamba_hidden,
        num_hidden_layers=ns.jamba_layers, num_attention_heads=4, num_key_value_heads=2,
        num_experts=2, num_experts_per_tok=1, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, use_mamba_kernels=False)
    model = transformers.JambaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, ns.jamba_seq))
    return model, {"input_ids": ids, "labels": ids}


def _gpt2(ns: argparse.Namespace) -> tuple[nn.Module, Any]:
    # the demo's model (``python -m hrockmate demo``), its loss inside
    return models.gpt2_tiny(n_layer=4, n_embd=128, n_head=4, seq=128, batch=8, vocab=256,
                            dropout=0.1, with_loss=True, seed=0)


MODELS: dict[str, Callable[[argparse.Namespace], tuple[nn.Module, Any]]] = {
    "mamba": _mamba, "jamba": _jamba, "gpt2": _gpt2}


def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    return out if out.dim() == 0 else out.float().mean()


#: the clock of an iteration: "cpu" (the process's CPU time, ``time.process_time``) or "wall"
CLOCK = {"cpu": time.process_time, "wall": time.perf_counter}


def _iteration(mod: nn.Module, sample: Any, clock: Callable[[], float]) -> float:
    mod.zero_grad(set_to_none=True)
    t0 = clock()
    out = mod(**sample) if isinstance(sample, dict) else mod(*sample)
    _loss(out).backward()
    return clock() - t0


def bench(name: str, ns: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, sample = MODELS[name](ns)
    loss_fn = "loss" if isinstance(sample, dict) else None
    rows = []
    for budget in ns.budgets:
        t0, c0 = time.perf_counter(), time.process_time()
        hm = HRockmate(model, sample, budget=budget, loss_fn=loss_fn)
        build_s, build_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        after = hm._hr_program
        kept = compiler.REUSES_FIRST_ARGUMENT
        compiler.REUSES_FIRST_ARGUMENT = frozenset()
        try:
            before = hm._compile(hm._hr_schedule)
        finally:
            compiler.REUSES_FIRST_ARGUMENT = kept
        runs: dict[str, list[float]] = {"eager": [], "before": [], "after": []}

        def run(which: str) -> float:
            if which == "eager":
                return _iteration(model, sample, CLOCK[ns.clock])
            object.__setattr__(hm, "_hr_program", before if which == "before" else after)
            return _iteration(hm, sample, CLOCK[ns.clock])

        order = list(runs)
        for i in range(ns.warmup + ns.iters):
            for which in order[i % 3:] + order[:i % 3]:
                dt = run(which)
                if i >= ns.warmup:
                    runs[which].append(dt)
        object.__setattr__(hm, "_hr_program", after)
        med = {k: statistics.median(v) for k, v in runs.items()}
        # per round, the program's time against the eager run beside it: load that shifts
        # between rounds hits both alike, so the spread of these ratios is the noise
        paired = sorted(a / e - 1.0 for a, e in zip(runs["after"], runs["eager"]))
        quart = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        plan, g = hm.plan, hm.traced.graph
        report = g.meta.get("cost_report", {})
        steps = plan.steps
        source = after.forward.source + "".join(c.source for c in after.chunks)
        row = {
            "model": name, "budget": "store-all" if budget is None else budget,
            "ops": g.num_ops,
            "compute_steps": sum(1 for k, _ in steps if k == "compute"),
            "free_steps": sum(1 for k, _ in steps if k == "free"),
            "recomputed_ops": after.recomputed_ops,
            "steps_in_place": source.count("= W"),
            "made_by": plan.made_by,
            "predicted_overhead": plan.overhead,
            "measured_overhead_before": med["before"] / med["eager"] - 1.0,
            "measured_overhead_after": med["after"] / med["eager"] - 1.0,
            "eager_median_s": med["eager"], "before_median_s": med["before"],
            "after_median_s": med["after"],
            "predicted_time_s": plan.time, "predicted_store_all_s": plan.baseline_time,
            "in_sequence_s_per_op": report.get("step_seconds"),
            "measured_overhead_after_paired_quartiles": quart,
            "build_s": build_s, "build_cpu_s": build_cpu_s, "iters": ns.iters,
            "load_average": os.getloadavg()[0],
        }
        rows.append(row)
        print(f"{name:6s} budget {budget or 'store-all':<9} {g.num_ops} ops  predicted "
              f"{100 * row['predicted_overhead']:+6.1f}%  measured before "
              f"{100 * row['measured_overhead_before']:+6.1f}%  after "
              f"{100 * row['measured_overhead_after']:+6.1f}% (paired quartiles "
              f"{100 * quart[0]:+.1f} / {100 * quart[2]:+.1f}%)  ({row['steps_in_place']} steps "
              f"in place, eager {1e3 * med['eager']:.1f} ms)", flush=True)
    return rows


def _budget(text: str) -> float | None:
    return None if text == "store-all" else float(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="*", default=["mamba", "gpt2"], choices=sorted(MODELS))
    p.add_argument("--budgets", nargs="*", type=_budget, default=[None, 0.7],
                   help="fractions of plain PyTorch's peak, or store-all (the default's first)")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    # (the defaults trace to about the sizes: Mamba 8,549 ops, Jamba 9,328)
    p.add_argument("--mamba-hidden", type=int, default=256)
    p.add_argument("--mamba-layers", type=int, default=4)
    p.add_argument("--mamba-seq", type=int, default=61)
    p.add_argument("--jamba-hidden", type=int, default=64)
    p.add_argument("--jamba-layers", type=int, default=8)
    p.add_argument("--jamba-seq", type=int, default=56)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--clock", choices=sorted(CLOCK), default="cpu",
                   help="cpu: the process's CPU time per iteration, which time spent waiting "
                        "for a core on a loaded machine does not inflate (one thread); wall: "
                        "elapsed time")
    p.add_argument("--out", default="bench-results/program_cost.json")
    ns = p.parse_args(argv)
    torch.set_num_threads(ns.threads)
    results: list[dict[str, Any]] = []
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in ns.models:
        results += bench(name, ns)
        # (written after each model: a long run stopped later keeps what it measured)
        out.write_text(json.dumps({
            "machine": platform.platform(), "torch": torch.__version__, "threads": ns.threads,
            "args": {k: v for k, v in vars(ns).items() if k != "out"}, "results": results,
        }, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
