"""Compiled plans against the compiled peers users run, and the eager ones: CPU.

Models: the demo GPT-2 (``--model gpt2``, default), torchvision's ResNet18 at a small
resolution (``resnet18``), hrockmate's small U-Net (``unet``). Every runner trains the same
model (fresh copies of one initialisation) on the same batch (a model that returns no loss
trains on the mean square of its output):

- ``eager``: plain PyTorch; ``eager+ckpt``: per-block ``torch.utils.checkpoint``;
  ``eager+sac``: per-block selective checkpointing saving the matmuls;
- ``compile``: ``torch.compile(model)`` (inductor);
- ``compile+amb=<f>``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  set to ``f`` while it compiles (the min-cut partitioner's memory knob);
- ``compile+ckpt``: ``torch.compile`` over per-block ``torch.utils.checkpoint``;
- ``compile+sac``: ``torch.compile`` over per-block selective checkpointing saving the
  matmuls (``mm``, ``addmm``, ``bmm``, attention);
- ``hrockmate@<b>`` (eager mode), ``hrockmate-compiled@<b>`` (``HRockmate(..., compile=True)``)
  and ``hrockmate-backend@<b>`` (``torch.compile(model, backend="hrockmate",
  options={"budget": b})``) at each budget ``b``.

Each is warmed up (its compile time is the first step less a steady one; hrockmate's build
time is its construction, or the backend's first step, with the solve and inductor compile
times it includes reported beside it), its peak measured
once (``hrockmate.measure_peak_memory``: the budget's definition), then all step in turn for
``--iters`` rounds so that load on a shared machine hits them alike; the median step times are
compared. For each budget the fastest ``activation_memory_budget`` setting whose measured peak
fits is named. Writes ``benches/results/compiled.json`` (or ``--out``).

    python benches/compiled.py                       # demo GPT-2, budgets 100/50/30 %
    python benches/compiled.py --layers 2 --iters 5  # quicker
    python benches/compiled.py --compiled-only       # torch.compile and compiled hrockmate only
    python benches/compiled.py --model resnet18 --out benches/results/compiled_resnet18.json
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
from hrockmate.models import gpt2_tiny, unet_tiny
from hrockmate.runtime import backend as hrockmate_backend
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


def _blocks(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(container, key) of each block a per-block checkpoint wraps: GPT-2's transformer
    blocks, ResNet's residual blocks, the U-Net's double convolutions."""
    if hasattr(model, "h"):
        return [(model.h, i) for i in range(len(model.h))]
    if hasattr(model, "layer1"):
        return [(getattr(model, f"layer{k}"), i) for k in range(1, 5)
                for i in range(len(getattr(model, f"layer{k}")))]
    return [(model, "inc"), *((model.down, i) for i in range(len(model.down))),
            *((model.dec, i) for i in range(len(model.dec)))]


def _with_checkpoints(model: torch.nn.Module, sac: bool) -> torch.nn.Module:
    for container, key in _blocks(model):
        if isinstance(key, str):
            setattr(container, key, _Checkpointed(getattr(container, key), sac))
        else:
            container[key] = _Checkpointed(container[key], sac)
    return model


def _model(a: argparse.Namespace) -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    if a.model == "gpt2":
        base, sample = gpt2_tiny(n_layer=a.layers, n_embd=a.width, n_head=max(1, a.width // 32),
                                 seq=a.seq, batch=a.batch, vocab=256, dropout=0.1, seed=0)
        return base, tuple(sample), {
            "name": "demo GPT-2 (hrockmate.models.gpt2_tiny)", "layers": a.layers,
            "width": a.width, "seq": a.seq, "batch": a.batch, "dropout": 0.1}
    if a.model == "resnet18":
        import torchvision

        torch.manual_seed(0)
        base = torchvision.models.resnet18(num_classes=10)
        x = torch.randn(a.batch, 3, a.image, a.image, generator=torch.Generator().manual_seed(0))
        return base, (x,), {"name": "torchvision resnet18 (10 classes)", "batch": a.batch,
                            "image": a.image}
    base, x = unet_tiny(batch=a.batch, image=a.image, base=16, depth=3, seed=0)
    return base, (x,), {"name": "U-Net (hrockmate.models.unet_tiny, base 16, depth 3)",
                        "batch": a.batch, "image": a.image}


def _loss(out: Any) -> torch.Tensor:
    return out if out.dim() == 0 else out.float().square().mean()


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


def _plan_info(h: Any) -> dict[str, Any]:
    info = {"budget_bytes": int(h.budget_bytes or 0),
            "solve_s": float(h.plan.stats.get("solve_seconds", 0.0) or 0.0),
            "predicted_peak_bytes": int(h.predicted_peak_bytes),
            "predicted_overhead": float(h.plan.overhead), "method": h.plan.method,
            "recomputed_ops": int(h.recomputed_ops)}
    stats = h.__dict__.get("compile_stats")
    if stats is not None:  # (compiled mode: the pieces and their inductor compile time)
        info.update(pieces=stats["pieces"], piece_compile_s=stats["compile_seconds"],
                    replans=stats["replans"])
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("gpt2", "resnet18", "unet"), default="gpt2")
    ap.add_argument("--image", type=int, default=64, help="resolution (resnet18, unet)")
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
    base, sample, model_info = _model(a)

    runners: dict[str, dict[str, Any]] = {}

    def add(name: str, model: torch.nn.Module, module: Callable[..., Any],
            setup: Callable[[], Any] | None = None, **info: Any) -> None:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            _loss(module(*sample)).backward()
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
            _loss(module(*sample)).backward()
        peak = hrockmate.measure_peak_memory(measured, params=list(model.parameters()))
        runners[name] = {"step": step, "compile_s": max(0.0, first - steady),
                         "first_step_s": first, "peak_bytes": int(peak.peak_bytes), **info}
        print(f"{name:28} first step {first:7.1f} s, peak {peak.peak_bytes / 2**20:7.2f} MiB",
              flush=True)

    m = copy.deepcopy(base)
    add("eager", m, m)
    for sac in (False, True):
        m = _with_checkpoints(copy.deepcopy(base), sac)
        add("eager+sac" if sac else "eager+ckpt", m, m)
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
                build_s=build, **_plan_info(h), predicted_time_s=float(h.plan.time),
                measured_peak_at_build=int(h.__dict__.get("measured_peak_bytes") or 0),
                compiled_costs=costs)
        # the backend: dynamo captures the forward, hrockmate plans it at the first call
        m = _own_code(copy.deepcopy(base), f"backend{b:g}")
        name = f"hrockmate-backend@{b:g}"
        before = len(hrockmate_backend.built_modules())
        try:
            add(name, m, torch.compile(m, backend="hrockmate",
                                       options={"budget": b, "progress": False}),
                budget=b, asked_budget_bytes=budget_bytes.get(b, 0))
        except Exception as exc:  # (dynamo wraps the backend's errors in its own)
            print(f"{name:28} {exc}")
            skipped[name] = str(exc).splitlines()[0]
            continue
        built = hrockmate_backend.built_modules()[before:]
        if built:
            runners[name].update(_plan_info(built[-1]), build_s=runners[name]["first_step_s"],
                                 graphs=len(built))

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
    print(f"{'runner':28}{'step ms':>9}{'vs compile':>11}{'peak MiB':>10}{'budget MiB':>11}"
          f"{'build s':>9}{'solve s':>9}{'inductor s':>11}")
    for n, row in rows.items():
        bud = row.get("asked_budget_bytes")
        print(f"{n:28}{row['step_ms']:9.1f}{row['vs_compile']:11.3f}"
              f"{row['peak_bytes'] / 2**20:10.2f}"
              f"{(bud / 2**20 if bud else float('nan')):11.2f}"
              f"{row.get('build_s', row['compile_s']):9.1f}{row.get('solve_s', 0.0):9.1f}"
              f"{row.get('piece_compile_s', 0.0):11.1f}")
    print("fastest fitting activation_memory_budget per budget:", best_amb)
    for n, row in rows.items():
        if "measured_vs_store_all" in row:
            print(f"{n:28} time vs store-all predicted "
                  f"{row.get('predicted_vs_store_all', float('nan')):.3f} measured "
                  f"{row['measured_vs_store_all']:.3f}; peak predicted "
                  f"{row['predicted_peak_bytes'] / 2**20:.2f} MiB measured "
                  f"{row['peak_bytes'] / 2**20:.2f} MiB ({100 * row['peak_error']:+.1f}%)")
    out = {
        "model": model_info,
        "device": "cpu", "threads": a.threads, "iters": a.iters,
        "torch": torch.__version__, "machine": platform.machine(),
        "note": "median step times measured side by side, alternating, in one process; "
                "compile_s is the first step less a steady one; build_s hrockmate's "
                "construction (the backend's first step), solve_s and piece_compile_s "
                "the solver's and inductor's parts of it; peaks by "
                "hrockmate.measure_peak_memory; predicted_vs_store_all is the plan's time "
                "over store-all's in compiled op times, measured_vs_store_all the step time "
                "over compiled store-all's; a 2-core machine shared with other jobs",
        "load_average_1_5_15min": list(os.getloadavg()),
        "runners": rows, "not_run": skipped, "best_fitting_activation_memory_budget": best_amb,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
