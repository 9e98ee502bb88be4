"""Side-by-side benchmark: hrockmate against what a user would pick instead.

For each model (built by a ``ModelSpec`` from a model zoo) and each budget (a fraction of the
measured peak of plain autograd, the *store-all* peak), all in one process:

- ``plain``: plain autograd (the store-all reference; gradients are compared with its own);
- ``hrockmate``: ``HRockmate`` with a plan solved for the budget (one trace, one hierarchy, one
  plan per budget, each installed with ``HRockmate.replan``);
- ``checkpoint``: ``torch.utils.checkpoint`` (non-reentrant) around evenly spread subsets of the
  model's blocks (all of them, 3/4, 1/2, 1/4), the manual practice;
- ``selective``: the same blocks under selective activation checkpointing (torchtitan's
  practice): the outputs of matmuls, convolutions and attention are saved
  (``hrockmate.planning.strategies.is_heavy_op``), the rest of each block runs again in its backward;
- ``compile``: ``torch.compile(backend="aot_eager_decomp_partition")`` with
  ``torch._functorch.config.activation_memory_budget`` swept over the budget fractions (that
  knob is a fraction of saved activations, not a peak bound, so every setting is measured);
- ``checkmate``: Checkmate's exact MILP over every op of the graph, on graphs of at most
  ``checkmate_max_ops`` ops and within ``checkmate_time_limit`` seconds.

Every point records the measured activation peak (the budget definition: ``hrockmate.capture.memory``),
the median iteration time (forward + backward), the overhead against plain autograd, whether
the parameter gradients equal plain autograd's (bitwise ``exact``, ``close`` within float
reassociation, or ``differ``) and the solve/compile time. Per budget, hrockmate and the exact
MILP are represented by their plan for that budget (if its measured peak fits), the other
methods by their fastest setting whose measured peak fits. Times are paired: each timed step
follows a step of plain autograd, and the overhead is the ratio of the two medians. Results go to ``<out>/bench.json`` and a Pareto plot
``<out>/<model>.png`` per model (matplotlib: ``pip install hrockmate[bench]``).

Run it with ``hrockmate bench`` or ``python benches/compare.py`` (same flags).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from hrockmate.argtypes import seconds
from hrockmate.modelspec import ModelSpec, ModelUnavailable

__all__ = [
    "METHODS",
    "DEFAULT_BUDGETS",
    "BenchConfig",
    "ModelSpec",
    "ModelUnavailable",
    "add_arguments",
    "format_summary",
    "format_table",
    "load_zoo",
    "plot_model",
    "refresh_selection",
    "run",
    "run_from_args",
    "run_model",
]

METHODS = ("plain", "hrockmate", "checkpoint", "selective", "compile", "checkmate")
DEFAULT_BUDGETS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3)
# Relative gradient error below which a difference is float reassociation, not a changed result.
CLOSE_REL = 1e-4


@dataclass
class BenchConfig:
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    methods: tuple[str, ...] = METHODS
    iterations: int = 5
    size: str = "small"
    device: str = "cpu"
    # CPU threads for torch (None: torch's default). One thread by default from the command
    # line: on a shared machine, OpenMP threads that spin while others hold the cores make
    # iteration times meaningless.
    threads: int | None = None
    seed: int = 0
    solve_time_limit: float = 120.0
    checkmate_time_limit: float = 60.0
    checkmate_max_ops: int = 300
    plot: bool = True
    echo: bool = True
    # threads solving the hierarchy's blocks (None: hrockmate.planning.hierarchy.default_workers())
    workers: int | None = None

    def check(self) -> None:
        if not self.budgets:
            raise ValueError("no budgets given; pass fractions of the store-all peak, e.g. 1,0.5")
        for b in self.budgets:
            if not (isinstance(b, (int, float)) and 0 < b <= 1):
                raise ValueError(
                    f"budget {b!r} is not a fraction in (0, 1] of the store-all peak; "
                    "give e.g. --budgets 1,0.8,0.5"
                )
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(
                f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}"
            )
        if "plain" not in self.methods:
            raise ValueError("method 'plain' is required: it is the reference for time and "
                             "gradients")
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")
        if self.workers is not None and self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


# ---------------------------------------------------------------------------------------------
# measuring one configuration


def _to_device(x: Any, device: Any) -> Any:
    import torch
    import torch.utils._pytree as pytree

    return pytree.tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, x)


class _Harness:
    """The training step shared by every method: forward, then backward from the outputs that
    require grad with fixed tangents (ones, created once), on the same sample and seed."""

    def __init__(self, model: Any, sample: Any, cfg: BenchConfig) -> None:
        import torch
        import torch.utils._pytree as pytree

        from hrockmate.capture.joint import split_sample

        self.model = model
        self.sample = sample
        self.cfg = cfg
        self.args, self.kwargs = split_sample(sample)
        torch.manual_seed(cfg.seed)
        out = model(*self.args, **self.kwargs)
        self.tangents = [torch.ones_like(x) for x in pytree.tree_leaves(out)
                         if isinstance(x, torch.Tensor) and x.requires_grad]
        del out
        self.reference: dict[str, Any] | None = None

    def step_of(self, fn: Callable[..., Any]) -> Callable[[], Any]:
        import torch
        import torch.utils._pytree as pytree

        def step() -> Any:
            out = fn(*self.args, **self.kwargs)
            diff = [x for x in pytree.tree_leaves(out)
                    if isinstance(x, torch.Tensor) and x.requires_grad]
            torch.autograd.backward(diff, self.tangents)
            return out

        return step

    def _sync(self) -> None:
        import torch

        if self.cfg.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _timed(self, step: Callable[[], Any], params: Iterable[Any]) -> float:
        """One step from cleared gradients (as after ``zero_grad()``): a step that finds
        gradients in place also pays for accumulating into them."""
        import torch

        for p in params:
            p.grad = None
        torch.manual_seed(self.cfg.seed)
        self._sync()
        t = time.perf_counter()
        step()
        self._sync()
        return time.perf_counter() - t

    def measure(self, method: str, setting: str, fn: Callable[..., Any], owner: Any,
                **extra: Any) -> dict[str, Any]:
        """Warm up, measure the peak and the gradients of one step, then time ``iterations``
        steps. ``owner``: the module holding the parameters ``fn`` trains (names as the
        model's)."""
        import torch

        from hrockmate.capture.memory import measure_peak_memory

        params = dict(owner.named_parameters())
        step = self.step_of(fn)
        t0 = time.perf_counter()
        torch.manual_seed(self.cfg.seed)
        step()  # warm-up: compiles, allocator caches, lazy initialisation
        self._sync()
        warm_s = time.perf_counter() - t0
        for p in params.values():
            p.grad = None
        torch.manual_seed(self.cfg.seed)
        measured = measure_peak_memory(step, params=list(params.values()),
                                       device=self.cfg.device)
        peak = measured.peak_bytes
        grads = {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None}
        # Paired timing: each timed step of this configuration follows a step of plain
        # autograd, so that load changes on a shared machine hit both alike; the overhead is
        # the ratio of the two medians.
        plain_step = self.step_of(self.model) if self.reference is not None else None
        times, plain_times = [], []
        for _ in range(self.cfg.iterations):
            if plain_step is not None:
                plain_times.append(self._timed(plain_step, self.model.parameters()))
            times.append(self._timed(step, params.values()))
        for p in params.values():
            p.grad = None
        for p in self.model.parameters():
            p.grad = None
        point: dict[str, Any] = {
            "method": method,
            "setting": setting,
            "status": "ok",
            "peak_bytes": int(peak),
            "time_s": statistics.median(times),
            "plain_time_s": statistics.median(plain_times or times),
            "warmup_s": round(warm_s, 4),
        }
        if measured.reserved_peak_bytes is not None:
            point["reserved_peak_bytes"] = measured.reserved_peak_bytes
        if self.reference is None:  # the plain reference itself
            self.reference = grads
            point.update(grad_match="exact", grad_max_rel_err=0.0)
        else:
            point.update(_compare_grads(self.reference, grads))
        point["overhead"] = point["time_s"] / point["plain_time_s"] - 1
        point.update(extra)
        return point


def _compare_grads(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    import torch

    if ref.keys() != got.keys():
        missing = sorted(ref.keys() - got.keys()) + sorted(got.keys() - ref.keys())
        return {"grad_match": "differ", "grad_max_rel_err": math.inf,
                "grad_note": f"gradients missing or extra for {', '.join(missing[:3])}"}
    exact = all(torch.equal(ref[n], got[n]) for n in ref)
    # Error relative to each gradient's scale, floored at 1e-3 of the largest gradient: some
    # gradients are zero in exact arithmetic (a bias before a normalisation) and hold only
    # rounding noise, which must not count as a changed result.
    scales = {n: float(r.abs().max()) if r.numel() else 0.0 for n, r in ref.items()}
    floor = 1e-3 * max(scales.values(), default=0.0)
    worst = 0.0
    for n, r in ref.items():
        err = float((got[n].float() - r.float()).abs().max()) if r.numel() else 0.0
        scale = max(scales[n], floor)
        worst = max(worst, err / scale if scale > 0 else (math.inf if err > 0 else 0.0))
    match = "exact" if exact else "close" if worst <= CLOSE_REL else "differ"
    return {"grad_match": match, "grad_max_rel_err": worst}


def _failed(method: str, setting: str, status: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"method": method, "setting": setting, "status": status, "message": message,
            "peak_bytes": None, "time_s": None, "overhead": None, "grad_match": None,
            "grad_max_rel_err": None, **extra}


def _error_point(method: str, setting: str, exc: BaseException) -> dict[str, Any]:
    if os.environ.get("HROCKMATE_DEBUG"):
        traceback.print_exception(exc)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return _failed(method, setting, "error", f"{type(exc).__name__}: {first}"[:300])


def _guard(method: str, setting: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one configuration; an error becomes a point with status ``error`` and the message."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a failing peer must not stop the benchmark
        return _error_point(method, setting, exc)


# ---------------------------------------------------------------------------------------------
# the methods


def _run_hrockmate(h: _Harness, budgets: list[tuple[float, int]], cfg: BenchConfig,
                   info: dict[str, Any], echo: Callable[[str], None]) -> list[dict[str, Any]]:
    """hrockmate and the exact MILP on one traced graph: one plan per budget."""
    from hrockmate.capture.costs import annotate_costs
    from hrockmate.ir.plan import InfeasibleBudget
    from hrockmate.planning.api import with_hierarchy
    from hrockmate.runtime import HRockmate

    t0 = time.perf_counter()
    # store-all until a plan is installed; no plan cache: each budget is solved here
    hmod = HRockmate(h.model, h.sample, cache=False)
    traced = hmod.traced
    graph = traced.graph
    t1 = time.perf_counter()
    annotate_costs(traced, h.model, h.sample, mode="measure")  # as HRockmate does for a budget
    t2 = time.perf_counter()
    info.update(ops=graph.num_ops, trace_s=round(t1 - t0, 3), cost_s=round(t2 - t1, 3))
    points: list[dict[str, Any]] = []
    methods = [m for m in ("hrockmate", "checkmate") if m in cfg.methods]
    hierarchy = None
    if "hrockmate" in methods:
        # one hierarchy per leaf size that solve_graph (and so HRockmate) tries, built once
        hierarchy = with_hierarchy(graph, dict(time_limit=cfg.solve_time_limit, progress=False),
                                   workers=cfg.workers).get("hierarchy")
        built = [] if hierarchy is None else (
            list(hierarchy) if isinstance(hierarchy, (list, tuple)) else [hierarchy])
        if built:
            info.update(hierarchy_s=round(sum(b.seconds for b in built), 3),
                        leaf_sizes=[b.leaf_size for b in built],
                        blocks=[b.blocks for b in built],
                        solved_blocks=[b.solved_blocks for b in built])
        else:  # each solve then uses the simple strategies
            info["hierarchy_error"] = "the time limit ran out while building the hierarchy"
            echo("  hrockmate: no hierarchy within the time limit; each budget is solved from "
                 "scratch")
    for method in methods:
        for frac, budget in budgets:
            setting = f"budget {frac:g}"
            if method == "checkmate" and graph.num_ops > cfg.checkmate_max_ops:
                points.append(_failed(method, setting, "skipped",
                                      f"graph has {graph.num_ops} ops > checkmate_max_ops="
                                      f"{cfg.checkmate_max_ops}", budget_fraction=frac,
                                      budget_bytes=budget))
                continue

            def one(method: str = method, frac: float = frac, budget: int = budget
                    ) -> dict[str, Any]:
                kw: dict[str, Any] = dict(method=method, progress=False)
                if method == "hrockmate":  # without a hierarchy: what solve_graph does alone
                    kw.update(hierarchy=hierarchy, time_limit=cfg.solve_time_limit)
                else:
                    kw.update(time_limit=cfg.checkmate_time_limit)
                # the runtime keeps a few bytes the graph does not show (saved generator
                # states, the CUDA allocator's slack): planned as HRockmate(budget=...) does
                t_solve = time.perf_counter()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        plan = hmod.replan(budget, **kw)
                except InfeasibleBudget as exc:
                    return _failed(method, f"budget {frac:g}", "infeasible", str(exc),
                                   budget_fraction=frac, budget_bytes=budget,
                                   min_bytes=int(exc.min_bytes))
                solve_s = time.perf_counter() - t_solve
                extra = int(hmod.predicted_peak_bytes) - int(plan.peak_bytes)
                fallback = plan.stats.get("fallback")
                label = f"budget {frac:g}" + (f", {fallback} fallback" if fallback else "")
                return h.measure(
                    method, label, hmod, h.model, budget_fraction=frac, fallback=fallback,
                    budget_bytes=budget, predicted_peak_bytes=int(hmod.predicted_peak_bytes),
                    runtime_extra_bytes=extra, solve_s=solve_s,
                    predicted_overhead=plan.overhead,
                    optimal=bool(plan.optimal), plan_method=plan.method,
                    recomputed_ops=int(hmod.recomputed_ops),
                )

            p = _guard(method, setting, one)
            p.setdefault("budget_fraction", frac)
            p.setdefault("budget_bytes", budget)
            points.append(p)
            echo(_point_line(p))
    return points


def _spread(n: int, k: int) -> list[int]:
    """``k`` indices spread evenly over ``range(n)``."""
    return sorted({min(n - 1, int(i * n / k)) for i in range(k)})


def _selective_context() -> Any:
    """``context_fn`` for ``torch.utils.checkpoint`` that saves the outputs of matmuls,
    convolutions and attention and recomputes everything else in the block."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from hrockmate.planning.strategies import is_heavy_op

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        return (CheckpointPolicy.MUST_SAVE if is_heavy_op(str(func))
                else CheckpointPolicy.PREFER_RECOMPUTE)

    return partial(create_selective_checkpoint_contexts, policy)


def _with_checkpoint(model: Any, blocks_of: Callable[[Any], list[Any]], picks: list[int],
                     selective: bool = False) -> Any:
    """A copy of ``model`` whose chosen blocks run under non-reentrant ``torch.utils.checkpoint``
    (parameter names and values are the model's); ``selective``: saving matmul, convolution and
    attention outputs (``_selective_context``)."""
    import torch.utils._pytree as pytree
    from torch.utils.checkpoint import checkpoint

    extra: dict[str, Any] = {"context_fn": _selective_context()} if selective else {}
    clone = copy.deepcopy(model)
    blocks = blocks_of(clone)
    for j in picks:
        block = blocks[j]
        inner = block.forward

        def wrapped(*args: Any, _inner: Callable[..., Any] = inner, **kwargs: Any) -> Any:
            # Fresh containers: a list argument the caller appends to later (DenseNet's
            # feature list) must not change what the recomputation sees.
            args, kwargs = pytree.tree_map(lambda v: v, (args, kwargs))
            return checkpoint(_inner, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = wrapped  # instance attribute: nn.Module.__call__ calls it
    return clone


def _run_checkpoint(h: _Harness, spec: ModelSpec, echo: Callable[[str], None],
                    method: str = "checkpoint") -> list[dict[str, Any]]:
    """``checkpoint`` or ``selective`` around all, 3/4, 1/2 and 1/4 of the model's blocks."""
    n = len(spec.blocks(h.model))
    if n == 0:
        return [_failed(method, "-", "skipped", f"{spec.name} lists no blocks")]
    counts = sorted({max(1, math.ceil(n * f)) for f in (1.0, 0.75, 0.5, 0.25)}, reverse=True)
    points = []
    for k in counts:
        picks = _spread(n, k)
        setting = f"{k}/{n} blocks"

        def one(picks: list[int] = picks, setting: str = setting) -> dict[str, Any]:
            clone = _with_checkpoint(h.model, spec.blocks, picks,
                                     selective=method == "selective")
            return h.measure(method, setting, clone, clone, blocks=k, solve_s=0.0)

        points.append(_guard(method, setting, one))
        echo(_point_line(points[-1]))
    return points


def _run_compile(h: _Harness, fractions: Sequence[float], echo: Callable[[str], None]
                 ) -> list[dict[str, Any]]:
    import torch
    import torch._functorch.config as functorch_config

    points = []
    for frac in fractions:
        setting = f"activation_memory_budget={frac:g}"

        def one(frac: float = frac, setting: str = setting) -> dict[str, Any]:
            torch._dynamo.reset()
            with functorch_config.patch(activation_memory_budget=float(frac)):
                compiled = torch.compile(h.model, backend="aot_eager_decomp_partition")
                p = h.measure("compile", setting, compiled, h.model,
                              activation_memory_budget=frac)
            p["solve_s"] = p["warmup_s"]  # the first call compiles and partitions
            return p

        points.append(_guard("compile", setting, one))
        echo(_point_line(points[-1]))
    torch._dynamo.reset()
    return points


# ---------------------------------------------------------------------------------------------
# one model, many models


def _point_line(p: dict[str, Any]) -> str:
    head = f"  {p['method']:<11}{p['setting']:<36} "
    if p["status"] != "ok":
        return head + f"{p['status']}: {p.get('message', '')}"[:160]
    budget = p.get("budget_bytes")
    over = " OVER BUDGET" if budget is not None and p["peak_bytes"] > budget else ""
    return head + (f"peak {p['peak_bytes'] / 2**20:8.2f} MiB  time {p['time_s'] * 1e3:8.1f} ms "
                   f"({100 * p['overhead']:+5.1f}%)  grads {p['grad_match']}{over}")


BUDGETED = ("hrockmate", "checkmate")  # methods that take the budget itself


def _select(points: list[dict[str, Any]], budgets: list[tuple[float, int]],
            methods: Sequence[str]) -> list[dict[str, Any]]:
    """Per budget and method, the index of the point a user would get: for the methods that
    take a budget, their plan for that budget if its measured peak fits; for the others, the
    fastest measured point that fits (the best setting a user could find by trying them)."""
    rows = []
    for frac, budget in budgets:
        chosen: dict[str, int | None] = {}
        for m in methods:
            # compared by overhead: each point's time relative to its paired plain runs
            fits = [(p["overhead"], i) for i, p in enumerate(points)
                    if p["method"] == m and p["status"] == "ok" and p["peak_bytes"] <= budget
                    and (m not in BUDGETED or p.get("budget_fraction") == frac)]
            chosen[m] = min(fits)[1] if fits else None
        row: dict[str, Any] = {"fraction": frac, "budget_bytes": budget, "methods": chosen}
        hr = chosen.get("hrockmate")
        if hr is not None:
            t = points[hr]["overhead"]
            row["hrockmate_beaten_by"] = sorted(
                m for m, i in chosen.items()
                if m != "hrockmate" and i is not None and points[i]["overhead"] < t
            )
        rows.append(row)
    return rows


def refresh_selection(report: dict[str, Any]) -> None:
    """Recompute every model's per-budget selection from its points (e.g. for an older file)."""
    for res in report["models"]:
        if "points" in res:
            methods = list(dict.fromkeys([*METHODS, *(p["method"] for p in res["points"])]))
            budgets = [(r["fraction"], r["budget_bytes"]) for r in res["by_budget"]]
            res["by_budget"] = _select(res["points"], budgets, methods)


def run_model(spec: ModelSpec, cfg: BenchConfig) -> dict[str, Any]:
    """Benchmark one model with every method of ``cfg``; returns its result dict."""
    import torch

    echo: Callable[[str], None] = (lambda s: print(s, flush=True)) if cfg.echo else (lambda s: None)
    result: dict[str, Any] = {"name": spec.name, "description": spec.description,
                              "size": cfg.size}
    try:
        model, sample = spec.build(cfg.size)
    except ModelUnavailable as exc:
        echo(f"{spec.name}: skipped: {exc}")
        result.update(skipped=str(exc))
        return result
    model = model.to(cfg.device).train()
    sample = _to_device(sample, cfg.device)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    echo(f"{spec.name}: {spec.description}, {result['parameters']:,} parameters, "
         f"size {cfg.size}")
    h = _Harness(model, sample, cfg)
    points = [h.measure("plain", "store-all", model, model, solve_s=0.0)]
    store_all = points[0]["peak_bytes"]
    result.update(store_all_peak_bytes=store_all, plain_time_s=points[0]["time_s"])
    echo(_point_line(points[0]))
    budgets = [(float(f), int(f * store_all)) for f in cfg.budgets]
    for p in points:
        p.update(budget_fraction=1.0, budget_bytes=store_all)
    if "hrockmate" in cfg.methods or "checkmate" in cfg.methods:
        info: dict[str, Any] = {}
        try:
            points += _run_hrockmate(h, budgets, cfg, info, echo)
        except Exception as exc:  # noqa: BLE001 - tracing failed: report, go on with peers
            for m in ("hrockmate", "checkmate"):
                if m in cfg.methods:
                    points.append(_error_point(m, "trace", exc))
                    echo(_point_line(points[-1]))
        result["hrockmate"] = info
    for method in ("checkpoint", "selective"):
        if method in cfg.methods:
            points += _run_checkpoint(h, spec, echo, method)
    if "compile" in cfg.methods:
        points += _run_compile(h, cfg.budgets, echo)
    result["points"] = points
    result["by_budget"] = _select(points, budgets, cfg.methods)
    del h, model
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "threads": torch.get_num_threads(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        from importlib.metadata import version

        info["highspy"] = version("highspy")
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def run(specs: Iterable[ModelSpec], cfg: BenchConfig, out_dir: str | os.PathLike[str] | None
        = "bench-results", *, command: str | None = None) -> dict[str, Any]:
    """Benchmark every model; write ``bench.json`` (and PNG plots) under ``out_dir``."""
    import torch

    from hrockmate.runtime.cpu_memory import keep_freed_cpu_memory

    cfg.check()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    machine = machine_info(cfg.device)
    if cfg.device == "cpu":  # plain autograd and the peers run under the same allocator setting
        machine["freed_cpu_memory_kept"] = keep_freed_cpu_memory()
    report: dict[str, Any] = {
        "format": "hrockmate-bench",
        "version": 1,
        "command": command,
        "machine": machine,
        "config": {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in cfg.__dict__.items() if k not in ("echo",)},
        "models": [],
    }
    t0 = time.perf_counter()
    out = Path(out_dir) if out_dir is not None else None
    for spec in specs:
        res = run_model(spec, cfg)
        report["models"].append(res)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            report["seconds"] = round(time.perf_counter() - t0, 1)
            _write_json(out / "bench.json", report)  # after every model: partial results survive
            if cfg.plot and "points" in res:
                res["plot"] = plot_model(res, out / f"{spec.name}.png")
    report["seconds"] = round(time.perf_counter() - t0, 1)
    if out is not None:
        _write_json(out / "bench.json", report)
    return report


def _write_json(path: Path, data: Any) -> None:
    from hrockmate.ir.graph import write_atomic

    def clean(v: Any) -> Any:  # JSON has no inf/nan
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    write_atomic(path, json.dumps(clean(data), indent=1))


# ---------------------------------------------------------------------------------------------
# plot and table

_STYLE = {
    "plain": ("black", "*"),
    "hrockmate": ("tab:red", "o"),
    "checkpoint": ("tab:blue", "s"),
    "selective": ("tab:cyan", "v"),
    "compile": ("tab:green", "^"),
    "checkmate": ("tab:purple", "D"),
}


def plot_model(result: dict[str, Any], path: str | os.PathLike[str]) -> str | None:
    """Pareto plot of one model: measured peak vs iteration time relative to plain autograd
    (medians of paired runs), one line per method.
    Returns the file written, or None (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install hrockmate[bench])",
              file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4), dpi=90)
    store_all = result["store_all_peak_bytes"]
    for frac in sorted({r["fraction"] for r in result.get("by_budget", [])}):
        ax.axvline(frac * store_all / 2**20, color="0.85", lw=0.8, zorder=0)
    for method, (color, marker) in _STYLE.items():
        pts = sorted((p["peak_bytes"], 1 + p["overhead"], p["grad_match"])
                     for p in result["points"] if p["method"] == method and p["status"] == "ok")
        if not pts:
            continue
        label = method
        if any(g == "differ" for _, _, g in pts):
            label += " (gradients differ)"
        ax.plot([x / 2**20 for x, _, _ in pts], [t for _, t, _ in pts], color=color,
                marker=marker, ms=7 if method == "plain" else 5, lw=1.2, label=label)
    worst = max((1 + p["overhead"] for p in result["points"] if p["status"] == "ok"),
                default=1.0)
    if worst > 3:  # keep the interesting range readable; say what was cut
        ax.set_ylim(top=3)
        ax.text(0.01, 0.98, f"clipped: points up to {worst:.1f}x", transform=ax.transAxes,
                fontsize=7, va="top")
    ax.set_xlabel("measured activation peak (MiB)")
    ax.set_ylabel("iteration time / plain autograd's")
    ax.set_title(f"{result['name']}: memory vs time (grey: budgets)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def format_table(report: dict[str, Any]) -> str:
    """Markdown tables: per model and budget, each method's selected point."""
    lines: list[str] = []
    for res in report["models"]:
        if "skipped" in res:
            lines += [f"### {res['name']}", "", f"skipped: {res['skipped']}", ""]
            continue
        info = res.get("hrockmate", {})
        lines += [
            f"### {res['name']}: {res['description']}",
            "",
            f"{res['parameters']:,} parameters; {info.get('ops', '?')} ops traced; store-all "
            f"peak {res['store_all_peak_bytes'] / 2**20:.2f} MiB; plain iteration "
            f"{res['plain_time_s'] * 1e3:.1f} ms",
            "",
            "| budget | method | setting | peak MiB | time ms | overhead | gradients | solve s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        pts = res["points"]
        for row in res["by_budget"]:
            for m, i in row["methods"].items():
                budget = f"{100 * row['fraction']:.0f}%"
                if i is None:
                    why = _why_none(pts, m, row["budget_bytes"])
                    lines.append(f"| {budget} | {m} | {why} | | | | | |")
                    continue
                p = pts[i]
                solve = p.get("solve_s")
                lines.append(
                    f"| {budget} | {m} | {p['setting']} | {p['peak_bytes'] / 2**20:.2f} | "
                    f"{p['time_s'] * 1e3:.1f} | {100 * p['overhead']:+.1f}% | {p['grad_match']} "
                    f"| {'' if solve is None else f'{solve:.2f}'} |"
                )
        lines.append("")
    return "\n".join(lines)


def format_summary(report: dict[str, Any]) -> str:
    """One Markdown table per model: budgets as rows, methods as columns, each cell the time
    overhead against plain autograd and the measured peak of the selected point."""
    lines: list[str] = []
    for res in report["models"]:
        if "skipped" in res or "points" not in res:
            continue
        pts = res["points"]
        methods = [m for m in METHODS if any(p["method"] == m for p in pts)]
        lines += [
            f"**{res['name']}** ({res['description']}; {res.get('hrockmate', {}).get('ops', '?')} "
            f"ops; store-all peak {res['store_all_peak_bytes'] / 2**20:.2f} MiB, plain "
            f"{res['plain_time_s'] * 1e3:.1f} ms)",
            "",
            "| budget | " + " | ".join(methods) + " |",
            "|---|" + "---|" * len(methods),
        ]
        for row in res["by_budget"]:
            cells = []
            for m in methods:
                i = row["methods"].get(m)
                if i is None:
                    cells.append("-")
                    continue
                p = pts[i]
                mark = " (grads differ)" if p["grad_match"] == "differ" else ""
                if p.get("fallback"):
                    mark += f" ({p['fallback']} fallback)"
                cells.append(f"{100 * p['overhead']:+.0f}% @ {p['peak_bytes'] / 2**20:.1f}"
                             f"{mark}")
            lines.append(f"| {100 * row['fraction']:.0f}% ({row['budget_bytes'] / 2**20:.1f} "
                         f"MiB) | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _why_none(points: list[dict[str, Any]], method: str, budget: int) -> str:
    mine = [p for p in points if p["method"] == method]
    if not mine:
        return "not run"
    ok = [p for p in mine if p["status"] == "ok"]
    if ok:
        return f"none fits (lowest {min(p['peak_bytes'] for p in ok) / 2**20:.2f} MiB)"
    at = [p for p in mine if p.get("budget_bytes") == budget] or mine
    return f"{at[0]['status']}: {at[0].get('message', '')}"[:80].replace("|", "/")


# ---------------------------------------------------------------------------------------------
# command line (shared by ``hrockmate bench`` and ``benches/compare.py``)


def load_zoo(path: str | os.PathLike[str] | None = None) -> dict[str, ModelSpec]:
    """The ``ZOO`` dict (name -> ModelSpec): the built-in one (``hrockmate.zoo``), or that of
    the zoo module file ``path``. Only a file named here is executed: nothing is looked up in
    the current directory."""
    if path is None:
        from hrockmate.zoo import ZOO

        return ZOO
    import importlib.util

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"model zoo {p} does not exist; pass --zoo with a zoo module file")
    spec = importlib.util.spec_from_file_location("hrockmate_user_zoo", p)
    if spec is None or spec.loader is None:
        raise ValueError(f"model zoo {p} is not a Python module file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    zoo = getattr(module, "ZOO", None)
    if not isinstance(zoo, dict) or not all(isinstance(v, ModelSpec) for v in zoo.values()):
        raise ValueError(f"{p} defines no ZOO dict of hrockmate.bench.ModelSpec entries")
    return zoo


def _fraction_list(text: str) -> tuple[float, ...]:
    """``1,0.5,30%``: fractions of the store-all peak, read as every budget is
    (``hrockmate.ir.budget``); BudgetError naming a bad item."""
    from hrockmate.ir.budget import parse_fraction

    return tuple(parse_fraction(x.strip()) for x in text.split(",") if x.strip())


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags (one definition for both entry points)."""
    parser.add_argument("--models", type=_name_list, default=None,
                        help="comma-separated zoo names (default: all; 'list' prints them)")
    parser.add_argument("--budgets", default=None,
                        help="fractions of the store-all peak, as numbers in (0, 1] or "
                        "percentages (default 1,0.8,0.6,0.5,0.4,0.3)")
    parser.add_argument("--methods", type=_name_list, default=METHODS,
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    parser.add_argument("--iterations", type=int, default=5,
                        help="timed iterations per point, median reported (default 5)")
    parser.add_argument("--size", choices=("tiny", "small", "large"), default="small",
                        help="model sizes: tiny (tests), small (CPU, default), large (GPU)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads for torch (default 1: stable timings on a shared "
                        "machine; 0 keeps torch's default)")
    parser.add_argument("--out", type=Path, default=Path("bench-results"),
                        help="output directory for bench.json and plots (default bench-results)")
    parser.add_argument("--zoo", type=Path, default=None,
                        help="a model zoo module of your own, a Python file defining ZOO (it is "
                        "executed; default: the built-in zoo, hrockmate.zoo)")
    parser.add_argument("--time-limit", type=seconds, default=120.0,
                        help="seconds per hrockmate MILP (default 120)")
    parser.add_argument("--checkmate-time-limit", type=seconds, default=60.0,
                        help="seconds for Checkmate's exact MILP per budget (default 60)")
    parser.add_argument("--checkmate-max-ops", type=int, default=300,
                        help="run the exact MILP only on graphs of at most this many ops "
                        "(default 300)")
    parser.add_argument("--workers", type=int, default=None,
                        help="threads solving the hierarchy's blocks (default: one per core, "
                        "at most 8)")
    parser.add_argument("--no-plot", action="store_true", help="write no PNG plots")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")


def run_from_args(args: argparse.Namespace, zoo: dict[str, ModelSpec] | None = None,
                  command: str | None = None) -> dict[str, Any]:
    """Run the benchmark the parsed flags describe; prints the tables and where files went."""
    zoo = zoo if zoo is not None else load_zoo(args.zoo)
    names = args.models or tuple(zoo)
    if names == ("list",):
        for name, spec in zoo.items():
            print(f"{name:<12}{spec.description}")
        return {}
    unknown = [n for n in names if n not in zoo]
    if unknown:
        raise ValueError(f"unknown model(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(zoo)}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: CUDA is not available here; use cpu")
    elif args.device != "cpu":
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    budgets = DEFAULT_BUDGETS if args.budgets is None else _fraction_list(args.budgets)
    cfg = BenchConfig(budgets=budgets, methods=tuple(args.methods),
                      iterations=args.iterations, size=args.size, device=args.device,
                      threads=args.threads or None, seed=args.seed,
                      solve_time_limit=args.time_limit,
                      checkmate_time_limit=args.checkmate_time_limit,
                      checkmate_max_ops=args.checkmate_max_ops, plot=not args.no_plot,
                      workers=args.workers)
    cfg.check()
    report = run([zoo[n] for n in names], cfg, args.out,
                 command=command or " ".join(["hrockmate bench", *sys.argv[2:]]))
    print()
    print(format_summary(report))
    print(f"results written to {args.out / 'bench.json'}")
    return report
