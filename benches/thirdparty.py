"""Third-party models with HRockmate, as a user gets them: Hugging Face GPT-2, BERT, T5,
Llama, CLIP and Wav2Vec2 with its CTC loss, timm's ViT and EfficientNet-B0, torchvision's
ResNet18 and MobileNetV3 (``hrockmate.thirdparty``, random weights, library defaults), each at
a few budgets.

Per model and budget, in one process:
- ``works``: HRockmate built and trained; ``exact``: one training step's parameter gradients
  and buffers against plain PyTorch from the same state ("exact" bitwise, "close" within 1e-4
  relative, else "differ");
- the budget and the measured peak (``hrockmate.capture.memory``: allocations above the start of the
  step, parameter gradients excluded), and the predicted peak;
- predicted and measured overhead against plain autograd (median of paired iterations);
- ``plan_s``: building HRockmate with an empty plan cache (trace, op times, solve); ``cached_s``:
  building it again with the plan cached (trace and op times, no solve), in the same process.

    python benches/thirdparty.py                        # all models, size small, 70% and 50%
    python benches/thirdparty.py --models gpt2,resnet18 --budgets 0.5
    python benches/thirdparty.py --device cuda --size small  # on a GPU
    python benches/thirdparty.py --models resnet18 --budgets 0.5 --save DIR  # keep the graph,
        # the plan and (on CUDA) the allocator's history of one planned step, to compare the
        # measured peak with the simulated timeline offline

Writes ``benches/results/thirdparty.json`` (``--out``) and prints a Markdown table. Needs the
``models`` extra. torch runs single-threaded (``--threads``): on a shared machine, spinning
OpenMP threads make timings meaningless.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import hrockmate  # noqa: E402
from hrockmate.bench import _compare_grads, _to_device  # noqa: E402
from hrockmate.capture.memory import eager_training_step  # noqa: E402
from hrockmate.ir.budget import parse_budget  # noqa: E402
from hrockmate.runtime import keep_freed_cpu_memory  # noqa: E402
from hrockmate.thirdparty import BUILDERS  # noqa: E402


def _peak(step: Any, params: list[torch.Tensor]) -> int:
    step()  # lazy initialisations are not part of an iteration
    for p in params:
        p.grad = None
    peak = hrockmate.measure_peak_memory(step, params=params).peak_bytes
    for p in params:
        p.grad = None
    return peak


def _timed(step: Any, seed: int, params: list[torch.Tensor]) -> float:
    """One step from cleared gradients: a step that finds gradients in place also pays for
    accumulating into them (on a GPU, from an idle device to the step's last kernel)."""
    for p in params:
        p.grad = None
    torch.manual_seed(seed)
    cuda = params[0].is_cuda
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _save_point(hm: Any, step: Any, params: list[torch.Tensor], stem: Path) -> None:
    """The traced graph (with the op times and workspaces measured here), the plan, the
    generated code of each segment (as its frames name it: ``forward_segment``,
    ``backward_chunk_<i>``) and on CUDA the caching allocator's history of one planned step
    (Python stacks: the generated code's lines show which step allocated what)."""
    hm.traced.graph.save(stem.with_suffix(".graph.json"))
    hm.plan.save(stem.with_suffix(".plan.json"))
    program = hm._compiled_program("its generated code")
    segments = {"forward_segment": program.forward.source}
    segments.update({f"backward_chunk_{i}": c.source for i, c in enumerate(program.chunks)})
    stem.with_suffix(".code.json").write_text(json.dumps(segments))
    if not params[0].is_cuda:
        return
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        torch.cuda.memory._dump_snapshot(str(stem.with_suffix(".memory.pickle")))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    for p in params:
        p.grad = None


def run_model(name: str, size: str, budgets: list[float], iterations: int,
              time_limit: float, device: str = "cpu", save: Path | None = None
              ) -> dict[str, Any]:
    torch.manual_seed(0)
    model, sample, loss_fn = BUILDERS[name](size)
    model.train().to(device)
    sample = _to_device(sample, device)
    params = list(model.parameters())
    start = copy.deepcopy(model.state_dict())
    plain_step = eager_training_step(model, sample, loss_fn=loss_fn)
    row: dict[str, Any] = {"model": name, "size": size, "device": device,
                           "parameters": sum(p.numel() for p in params),
                           "plain_peak_bytes": _peak(plain_step, params)}
    print(f"{name}: {row['parameters']:,} parameters, plain peak "
          f"{row['plain_peak_bytes'] / 2**20:.2f} MiB", flush=True)
    row["points"] = []
    for frac in budgets:
        point: dict[str, Any] = {"budget_fraction": frac}
        model.load_state_dict(start)
        try:
            with tempfile.TemporaryDirectory() as cache:
                t0 = time.perf_counter()
                hm = hrockmate.HRockmate(model, sample, budget=frac, loss_fn=loss_fn,
                                         cache=cache, time_limit=time_limit, progress=False)
                point["plan_s"] = round(time.perf_counter() - t0, 2)
                t0 = time.perf_counter()
                again = hrockmate.HRockmate(model, sample, budget=frac, loss_fn=loss_fn,
                                            cache=cache, time_limit=time_limit, progress=False)
                point["cached_s"] = round(time.perf_counter() - t0, 2)
                point["cached_same_plan"] = again.plan.steps == hm.plan.steps
                del again
            plan = hm.plan
            budget = parse_budget(frac, plan.baseline_peak_bytes)
            point.update(budget_bytes=int(budget),
                         predicted_peak_bytes=int(hm.predicted_peak_bytes),
                         predicted_overhead=float(plan.overhead), plan_method=plan.method,
                         fallback=plan.stats.get("fallback"))
            # one training step of each from the same state and seed
            ref = copy.deepcopy(model)
            for p, q in zip(params, ref.parameters()):
                p.grad = q.grad = None
            hr_step = eager_training_step(hm, sample, loss_fn=loss_fn)
            torch.manual_seed(7)
            hr_step()
            torch.manual_seed(7)
            eager_training_step(ref, sample, loss_fn=loss_fn)()
            match = _compare_grads(_grads(ref), _grads(model))
            buffers_equal = all(torch.equal(b, c) for b, c in zip(model.buffers(), ref.buffers()))
            point.update(match, buffers_equal=buffers_equal)
            for p in params:
                p.grad = None
            point["peak_bytes"] = _peak(hr_step, params)
            point["within_budget"] = point["peak_bytes"] <= budget
            if save is not None:
                _save_point(hm, hr_step, params, save / f"{name}_{round(100 * frac)}")
            # paired timing: each hrockmate iteration follows a plain one, both from cleared
            # gradients
            plain_t, hr_t = [], []
            for it in range(iterations):
                plain_t.append(_timed(plain_step, it, params))
                hr_t.append(_timed(hr_step, it, params))
            point.update(plain_time_s=statistics.median(plain_t), time_s=statistics.median(hr_t))
            point["overhead"] = point["time_s"] / point["plain_time_s"] - 1
            point["works"] = True
            print(f"  {frac:.0%}: {point['grad_match']}, peak {point['peak_bytes']:,} / budget "
                  f"{budget:,} (predicted {point['predicted_peak_bytes']:,}), overhead "
                  f"{100 * point['overhead']:+.1f}% (predicted "
                  f"{100 * point['predicted_overhead']:+.1f}%, {plan.method}), plan "
                  f"{point['plan_s']} s, cached {point['cached_s']} s", flush=True)
        except Exception as exc:  # noqa: BLE001 - a model that fails is a row of the table
            point.update(works=False, error=f"{type(exc).__name__}: {exc}"[:500])
            traceback.print_exc()
        row["points"].append(point)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | budget | works | gradients | measured / budget (MiB) | predicted peak "
             "(MiB) | overhead measured / predicted | made by | plan s | cached start s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for p in r["points"]:
            frac = f"{p['budget_fraction']:.0%}"
            if not p.get("works"):
                lines.append(f"| {r['model']} | {frac} | no: {p.get('error', '')[:80]} "
                             "| | | | | | | |")
                continue
            mib = 2**20
            lines.append(
                f"| {r['model']} | {frac} | yes | {p['grad_match']} | "
                f"{p['peak_bytes'] / mib:.2f} / {p['budget_bytes'] / mib:.2f} | "
                f"{p['predicted_peak_bytes'] / mib:.2f} | {100 * p['overhead']:+.1f}% / "
                f"{100 * p['predicted_overhead']:+.1f}% | {p['fallback'] or p['plan_method']} | "
                f"{p['plan_s']:.1f} | {p['cached_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(BUILDERS),
                    help=f"comma-separated, from {','.join(BUILDERS)}")
    ap.add_argument("--size", default="small", choices=("tiny", "small"))
    ap.add_argument("--budgets", default="0.7,0.5", help="fractions of the store-all peak")
    ap.add_argument("--iterations", type=int, default=11)
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda")
    ap.add_argument("--save", type=Path, default=None,
                    help="a folder for each point's graph, plan and (CUDA) allocator history")
    ap.add_argument("--out", type=Path, default=Path("benches/results/thirdparty.json"))
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in BUILDERS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(BUILDERS)}")
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = keep_freed_cpu_memory()  # before any model runs: plain and hrockmate allocate alike
    t0 = time.perf_counter()
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
    rows = [run_model(n, args.size, budgets, args.iterations, args.time_limit, args.device,
                      args.save) for n in names]
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(),
                    "load_average": list(os.getloadavg()), "freed_cpu_memory_kept": kept,
                    "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                               else "cpu")},
        "seconds": round(time.perf_counter() - t0, 1),
        "models": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print()
    print(table(rows))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
