"""Compiled plans against the compiled peers users run: the demo GPT-2 on CPU.

Every runner trains the same model (fresh copies of one initialisation) on the same batch:

- ``eager``: plain PyTorch; ``compile``: ``torch.compile(model)`` (inductor);
- ``compile+amb=<f>``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  set to ``f`` while it compiles (the min-cut partitioner's memory knob);
- ``compile+ckpt``: ``torch.compile`` over per-block ``torch.utils.checkpoint``;
- ``compile+sac``: ``torch.compile`` over per-block selective checkpointing saving the
  matmuls (``mm``, ``addmm``, ``bmm``, attention);
- ``hrockmate@<b>`` (eager mode) and ``hrockmate-compiled@<b>`` at each budget ``b``.

Each is warmed up (its compile time is the first step less a steady one), its peak measured
once (``hrockmate.measure_peak_memory``: the budget's definition), then all step in turn for
``--iters`` rounds so that load on a shared machine hits them alike; the median step times are
compared. For each budget the fastest ``activation_memory_budget`` setting whose measured peak
fits is named. Writes ``benches/results/compiled.json`` (or ``--out``).

    python benches/compiled.py                       # demo GPT-2, budgets 100/50/30 %
    python benches/compiled.py --layers 2 --iters 5  # quicker
    python benches/compiled.py --compiled-only       # torch.compile and compiled hrockmate only
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import statistics
import time
import types
from pathlib import Path
from typing import Any, Callable

import torch

import hrockmate
from hrockmate.models import gpt2_tiny
from hrockmate.runtime.inductor import CompiledModeError

_SAVED = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
          torch.ops.aten._scaled_dot_product_efficient_attention.default,
          torch.ops.aten._scaled_dot_product_flash_attention.default}


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return (CheckpointPolicy.MUST_SAVE if op in _SAVED
            else CheckpointPolicy.PREFER_RECOMPUTE)


class _Checkpointed(torch.nn.Module):
    """A block run under ``torch.utils.checkpoint`` (selective with ``sac``)."""

    def __init__(self, block: torch.nn.Module, sac: bool) -> None:
        super().__init__()
        self.block = block
        self.sac = sac

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        if self.sac:
            context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            return checkpoint(self.block, x, use_reentrant=False, context_fn=context)
        return checkpoint(self.block, x, use_reentrant=False)


def _with_checkpoints(model: torch.nn.Module, sac: bool) -> torch.nn.Module:
    model.h = torch.nn.ModuleList(_Checkpointed(b, sac) for b in model.h)
    return model


def _own_code(model: torch.nn.Module, tag: str) -> torch.nn.Module:
    """``model`` with a forward of its own code object. Dynamo keeps compiled code per code
    object and inlines modules, so copies of one class share a compiled graph: an
    ``activation_memory_budget`` runner would reuse the first runner's compile, partitioned
    under another setting."""
    f = type(model).forward
    code = f.__code__.replace(co_name=f"forward_{tag}")
    own = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    model.forward = types.MethodType(own, model)  # type: ignore[method-assign]
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.5, 0.3])
    ap.add_argument("--amb", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9],
                    help="activation_memory_budget settings of the torch.compile peer")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compiled-only", action="store_true",
                    help="only plain torch.compile and compiled hrockmate (no other peers)")
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "compiled.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):  # (one compile per runner, same code object)
            setattr(torch._dynamo.config, name, 256)
    from hrockmate.runtime.cpu_memory import keep_freed_cpu_memory

    keep_freed_cpu_memory()
    torch.manual_seed(0)
    base, sample = gpt2_tiny(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 32),
                             seq=a.seq, batch=a.batch, vocab=256, dropout=0.1, seed=0)

    runners: dict[str, dict[str, Any]] = {}

    def add(name: str, model: torch.nn.Module, module: Callable[..., Any],
            setup: Callable[[], Any] | None = None, **info: Any) -> None:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            module(*sample).backward()
        t0 = time.perf_counter()
        if setup is not None:
            with setup():
                step()
        else:
            step()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        step()
        steady = time.perf_counter() - t0

        def measured() -> None:  # (.grad tensors exist: the budget does not count them)
            module(*sample).backward()
        peak = hrockmate.measure_peak_memory(measured, params=list(model.parameters()))
        runners[name] = {"step": step, "compile_s": max(0.0, first - steady),
                         "peak_bytes": int(peak.peak_bytes), **info}
        print(f"{name:28} first step {first:7.1f} s, peak {peak.peak_bytes / 2**20:7.2f} MiB",
              flush=True)

    m = copy.deepcopy(base)
    add("eager", m, m)
    m = copy.deepcopy(base)
    add("compile", m, torch.compile(m))
    for i, f in enumerate([] if a.compiled_only else a.amb):
        m = _own_code(copy.deepcopy(base), f"amb{i}")
        add(f"compile+amb={f:g}", m, torch.compile(m),
            setup=functools.partial(torch._functorch.config.patch,
                                    activation_memory_budget=f), amb=f)
    for sac in () if a.compiled_only else (False, True):
        m = _with_checkpoints(copy.deepcopy(base), sac)
        add("compile+sac" if sac else "compile+ckpt", m, torch.compile(m))
    budget_bytes: dict[float, int] = {}
    skipped: dict[str, str] = {}
    for b in a.budgets:
        for compiled in (True,) if a.compiled_only else (False, True):
            m = copy.deepcopy(base)
            name = f"hrockmate{'-compiled' if compiled else ''}@{b:g}"
            t0 = time.perf_counter()
            try:
                h = hrockmate.HRockmate(m, sample, budget=b, compile=compiled, progress=False)
            except (hrockmate.InfeasibleBudget, CompiledModeError) as exc:
                print(f"{name:28} {exc}")
                skipped[name] = str(exc)
                continue
            build = time.perf_counter() - t0
            # the bytes the fraction asks for (eager mode's; compiled mode may replan for
            # fewer when its measured peak exceeded them, and reports those as budget_bytes)
            if not compiled:
                budget_bytes[b] = int(h.budget_bytes) if h.budget_bytes else 0
            elif b not in budget_bytes:  # (the fraction of plain eager's measured peak)
                budget_bytes[b] = int(b * runners["eager"]["peak_bytes"]) if b < 1 else 0
            costs = h.__dict__.get("compiled_costs") or {}
            add(name, m, h, budget=b, asked_budget_bytes=budget_bytes.get(b, 0),
                budget_bytes=int(h.budget_bytes or 0), build_s=build,
                solve_s=float(h.plan.stats.get("solve_seconds", 0.0) or 0.0),
                predicted_peak_bytes=int(h.predicted_peak_bytes),
                predicted_overhead=float(h.plan.overhead), method=h.plan.method,
                recomputed_ops=int(h.recomputed_ops), predicted_time_s=float(h.plan.time),
                measured_peak_at_build=int(h.__dict__.get("measured_peak_bytes") or 0),
                compiled_costs=costs)
            program = h._compiled_program("pieces")
            pieces = getattr(program, "pieces", None)
            if pieces is not None:
                runners[name]["pieces"] = len(pieces)
                runners[name]["piece_compile_s"] = sum(p.compile_s for p in pieces)

    times: dict[str, list[float]] = {n: [] for n in runners}
    for _ in range(a.iters):  # alternating: load changes hit every runner alike
        for n, r in runners.items():
            t0 = time.perf_counter()
            r["step"]()
            times[n].append(time.perf_counter() - t0)
    ref_compile = statistics.median(times["compile"])
    ref_eager = statistics.median(times["eager"])
    rows = {}
    for n, r in runners.items():
        t = statistics.median(times[n])
        row = {k: v for k, v in r.items() if k != "step"}
        row.update(step_ms=1e3 * t, vs_compile=t / ref_compile, vs_eager=t / ref_eager)
        if "asked_budget_bytes" in r:
            asked = r["asked_budget_bytes"]
            row["fits"] = r["peak_bytes"] <= asked if asked else True
        rows[n] = row
    # predicted against measured, compiled hrockmate: the plan's time over store-all's (both
    # in compiled op times) against the step time over compiled store-all's, in points
    ref = rows.get("hrockmate-compiled@1")
    for n, row in rows.items():
        if not n.startswith("hrockmate-compiled@") or ref is None:
            continue
        costs = row.get("compiled_costs") or {}
        base_s = costs.get("compiled_op_s")
        if base_s:
            row["predicted_vs_store_all"] = row["predicted_time_s"] / base_s
        elif n == "hrockmate-compiled@1":
            row["predicted_vs_store_all"] = 1.0
        row["measured_vs_store_all"] = row["step_ms"] / ref["step_ms"]
        if "predicted_vs_store_all" in row:
            row["time_error_points"] = 100 * (row["predicted_vs_store_all"]
                                              - row["measured_vs_store_all"])
        row["peak_error"] = row["predicted_peak_bytes"] / row["peak_bytes"] - 1
    best_amb = {}
    for b, limit in budget_bytes.items():
        fitting = [(rows[n]["step_ms"], n) for n in rows
                   if n.startswith("compile+amb=") and rows[n]["peak_bytes"] <= limit]
        best_amb[f"{b:g}"] = min(fitting)[1] if fitting else None
    print(f"{'runner':28}{'step ms':>9}{'vs compile':>11}{'peak MiB':>10}{'budget MiB':>11}")
    for n, row in rows.items():
        bud = row.get("asked_budget_bytes")
        print(f"{n:28}{row['step_ms']:9.1f}{row['vs_compile']:11.3f}"
              f"{row['peak_bytes'] / 2**20:10.2f}"
              f"{(bud / 2**20 if bud else float('nan')):11.2f}")
    print("fastest fitting activation_memory_budget per budget:", best_amb)
    for n, row in rows.items():
        if "measured_vs_store_all" in row:
            print(f"{n:28} time vs store-all predicted "
                  f"{row.get('predicted_vs_store_all', float('nan')):.3f} measured "
                  f"{row['measured_vs_store_all']:.3f}; peak predicted "
                  f"{row['predicted_peak_bytes'] / 2**20:.2f} MiB measured "
                  f"{row['peak_bytes'] / 2**20:.2f} MiB ({100 * row['peak_error']:+.1f}%)")
    out = {
        "model": {"name": "demo GPT-2 (hrockmate.models.gpt2_tiny)", "layers": a.layers,
                  "width": a.width, "seq": a.seq, "batch": a.batch, "dropout": 0.1},
        "device": "cpu", "threads": a.threads, "iters": a.iters,
        "torch": torch.__version__, "machine": platform.machine(),
        "note": "median step times measured side by side, alternating, in one process; "
                "compile_s is the first step less a steady one; peaks by "
                "hrockmate.measure_peak_memory; predicted_vs_store_all is the plan's time "
                "over store-all's in compiled op times, measured_vs_store_all the step time "
                "over compiled store-all's",
        "load_average_1_5_15min": list(os.getloadavg()),
        "runners": rows, "not_run": skipped, "best_fitting_activation_memory_budget": best_amb,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
