"""Solver scaling: graph size (ops) against solve time.

Traces GPT-2-style decoders and encoder-decoder Transformers (narrow widths: the graph's size
depends on the layer count, not on the width) from 2 to 48 layers, plus the third-party training
graphs of the shared graphs folder, and solves each at one budget (a fraction of its store-all
peak) with hrockmate and, on graphs small enough, with Checkmate's exact MILP; optionally
synthetic deep residual networks of any size (``--synthetic``).

    python benches/scaling.py                                 # defaults below
    python benches/scaling.py --layers 2,4,8 --budget 0.4 --graphs path/to/graphs
    python benches/scaling.py --layers "" --no-graphs --synthetic 50000 --time-limit 540

Writes ``bench-results/scaling.json`` (after every case, so a long run keeps what it has) and
``bench-results/scaling.png`` (log-log: ops vs solve seconds, one series per family).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]


def shared_graphs_dir() -> Path:
    """Third-party graphs beside the repository (override with HROCKMATE_GRAPHS_DIR)."""
    env = os.environ.get("HROCKMATE_GRAPHS_DIR")
    return Path(env) if env else REPO.parent / "shared" / "data" / "graphs"


def _families() -> dict[str, Callable[[int], tuple[Any, Any]]]:
    from hrockmate import models

    return {
        "gpt2": lambda n: models.gpt2_tiny(n_layer=n, n_embd=32, n_head=2, seq=16, batch=2,
                                           vocab=64),
        "encdec": lambda n: models.transformer_encdec(n_layers=n, d_model=16, n_head=2, d_ff=32,
                                                      src_len=8, tgt_len=8, vocab=32),
    }


def solve_case(graph: Any, budget: float, method: str, time_limit: float) -> dict[str, Any]:
    """Solve one graph; returns seconds, status and the plan's predicted figures."""
    from hrockmate.ir.plan import InfeasibleBudget
    from hrockmate.planning.api import solve_graph

    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = solve_graph(graph, budget, method=method, time_limit=time_limit,
                               progress=False)
    except InfeasibleBudget as exc:
        return {"method": method, "status": "infeasible", "message": str(exc),
                "solve_s": round(time.perf_counter() - t0, 3)}
    except Exception as exc:  # noqa: BLE001 - record and go on with the next case
        return {"method": method, "status": "error",
                "message": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "solve_s": round(time.perf_counter() - t0, 3)}
    return {
        "method": method,
        "status": "optimal" if plan.optimal else "feasible",
        "plan_method": plan.method,
        "solve_s": round(time.perf_counter() - t0, 3),
        "peak_ratio": plan.peak_bytes / plan.baseline_peak_bytes,
        "overhead": plan.time / plan.baseline_time - 1 if plan.baseline_time else None,
        "fallback": plan.stats.get("fallback"),
        "lean_blocks": plan.stats.get("lean_blocks"),
        # the process's peak resident memory so far (cases run in order, smallest first)
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def run(layers: list[int], budget: float, time_limit: float, graphs: Path | None,
        checkmate_max_ops: int, out: Path, synthetic: list[int] = ()) -> dict[str, Any]:
    from hrockmate.bench import machine_info
    from hrockmate.capture.trace import trace_model
    from hrockmate.ir.graph import Graph

    report: dict[str, Any] = {"machine": machine_info("cpu"), "budget": budget,
                              "time_limit": time_limit, "command": " ".join(sys.argv),
                              "cases": []}
    cases: list[tuple[str, str, Callable[[], tuple[Any, float]]]] = []
    for family, build in _families().items():
        for n in layers:
            def load(build: Callable[[int], Any] = build, n: int = n) -> tuple[Any, float]:
                model, sample = build(n)
                t0 = time.perf_counter()
                g = trace_model(model, sample, cost="estimate").graph
                return g, time.perf_counter() - t0

            cases.append((family, f"{n} layers", load))
    if graphs is not None:
        for path in sorted(graphs.glob("*.json")):
            cases.append(("shared graphs", path.stem, lambda p=path: (Graph.load(p), 0.0)))
    if synthetic:
        from solver_quality import synthetic_training_graph
    for n in sorted(synthetic):  # last: the largest graphs, and the process's memory grows
        cases.append(("synthetic", f"{n} forward ops",
                      lambda n=n: (synthetic_training_graph(n), 0.0)))
    out.parent.mkdir(parents=True, exist_ok=True)
    for family, label, load in cases:
        graph, trace_s = load()
        row: dict[str, Any] = {"family": family, "case": label, "ops": graph.num_ops,
                               "tensors": graph.num_tensors, "trace_s": round(trace_s, 3),
                               "results": [solve_case(graph, budget, "hrockmate", time_limit)]}
        if graph.num_ops <= checkmate_max_ops:
            row["results"].append(solve_case(graph, budget, "checkmate", time_limit))
        report["cases"].append(row)
        print(f"{family:<14}{label:<28}{graph.num_ops:>6} ops  " + "  ".join(
            f"{r['method']} {r['status']} {r['solve_s']:.1f}s" for r in row["results"]),
            flush=True)
        out.write_text(json.dumps(report, indent=1))
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=90)
    families = {"gpt2": ("tab:red", "o"), "encdec": ("tab:blue", "s"),
                "shared graphs": ("tab:green", "^"), "synthetic": ("tab:purple", "D")}
    for method, line, fill in (("hrockmate", "-", True), ("checkmate", "--", False)):
        for family, (color, marker) in families.items():
            pts = sorted((c["ops"], r["solve_s"]) for c in report["cases"]
                         if c["family"] == family for r in c["results"]
                         if r["method"] == method and r["status"] != "error")
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker,
                    ls="none" if family in ("shared graphs", "synthetic") else line,
                    mfc=color if fill else "none", label=f"{method}: {family}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ops in the training graph")
    ax.set_ylabel("solve time (s), or time to report infeasible")
    ax.set_title(f"solve time at {100 * report['budget']:.0f}% of the store-all peak",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,4,8,16,32,48",
                        help="layer counts for both families (default 2,4,8,16,32,48)")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="fraction of each graph's store-all peak (default 0.5)")
    parser.add_argument("--time-limit", type=float, default=120.0,
                        help="seconds per MILP (default 120)")
    parser.add_argument("--checkmate-max-ops", type=int, default=150,
                        help="also run the exact MILP on graphs of at most this many ops "
                        "(default 150)")
    parser.add_argument("--graphs", type=Path, default=None,
                        help="folder of graph files (default: the shared graphs folder)")
    parser.add_argument("--no-graphs", action="store_true", help="skip the graph folder")
    parser.add_argument("--synthetic", default="",
                        help="forward-op counts of synthetic deep residual networks to add "
                        "(e.g. 50000: a 112,501-op training graph)")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "scaling.json")
    parser.add_argument("--plot-only", action="store_true",
                        help="re-draw the plot from an existing --out JSON (e.g. a cut-short run)")
    args = parser.parse_args(argv)
    png = args.out.with_suffix(".png")
    if args.plot_only:
        plot(json.loads(args.out.read_text()), png)
        print(f"plot written to {png}")
        return 0
    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()]
        synthetic = [int(x) for x in args.synthetic.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--layers/--synthetic: expected comma-separated integers, got "
                     f"{args.layers!r} / {args.synthetic!r}")
    graphs = None if args.no_graphs else (args.graphs or shared_graphs_dir())
    if graphs is not None and not graphs.is_dir():
        parser.error(f"graph folder {graphs} not found; pass --graphs DIR or --no-graphs")
    import torch

    torch.set_num_threads(1)
    report = run(layers, args.budget, args.time_limit, graphs, args.checkmate_max_ops, args.out,
                 synthetic)
    plot(report, png)
    print(f"results written to {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
