"""hrockmate against the simple strategies, predicted by the simulator, on every test graph.

For each graph (the repository's tests/data/graphs, third-party graphs with ``--graphs``, and a
trace of the demo GPT-2 with ``--demo``, every zoo model exported as an operator log without
pairing with ``--zoo SIZE``) and each budget (a fraction of the store-all peak), it
plans with the default method and with block checkpointing, selective checkpointing,
whole-graph Rotor and greedy eviction (DTR-style), and reports each one's time over store-all
(``inf.`` where it does not fit; ``RA`` where only recompute-all fits), which method made
hrockmate's plan, its solve time, and whether hrockmate cost more than any strategy that fits
(it must not), with a lower bound on what any schedule costs there
(``hrockmate.time_lower_bound``; ``inf.`` where no schedule can fit) and hrockmate's gap to it.

    OMP_NUM_THREADS=1 python benches/simple_strategies.py [--demo] [--zoo small] [--graphs DIR]

Writes JSON (default ``bench-results/simple_strategies.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import hrockmate
from hrockmate.ir.graph import Graph, write_atomic
from hrockmate.ir.plan import InfeasibleBudget

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("checkpoint", "selective", "rotor", "greedy")


def graphs(folders: list[Path], demo: bool, zoo: str | None = None) -> list[tuple[str, Graph]]:
    out = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            g = Graph.load(path)
            if any(o.phase == "backward" for o in g.ops):
                out.append((path.stem, g))
    if demo:
        import torch

        from hrockmate.models import gpt2_tiny

        torch.manual_seed(0)
        model, sample = gpt2_tiny(n_layer=4, n_embd=128, n_head=4, seq=128, batch=8, vocab=256,
                                  dropout=0.1, with_loss=True, seed=0)
        out.append(("gpt2_demo (traced)", hrockmate.trace(model, sample)))
    if zoo:
        out += zoo_operator_logs(zoo)
    return out


def zoo_operator_logs(size: str) -> list[tuple[str, Graph]]:
    """Every built-in zoo model at ``size``, traced and exported as another tool's operator log
    (``Graph.to_node_link``: one tensor per op, no pairing of backward with forward ops, only
    ``backward`` flags), read back. Models whose library is not installed are left out."""
    from hrockmate.bench import ModelUnavailable
    from hrockmate.zoo import ZOO

    out = []
    for name, spec in ZOO.items():
        try:
            model, sample = spec.build(size)
        except ModelUnavailable as exc:
            print(f"{name}: left out ({exc})")
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            g = hrockmate.trace(model, sample)
        out.append((f"{name} (log)", Graph.from_json(json.dumps(g.to_node_link()))))
    return out


def run_one(g: Graph, fraction: float, method: str, time_limit: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = hrockmate.solve_graph(g, fraction, method=method, progress=False,
                                         time_limit=time_limit)
    except InfeasibleBudget:
        return {"fits": False, "seconds": time.perf_counter() - t0}
    except hrockmate.planning.literature.NotAChainError:
        return {"fits": False, "not_a_chain": True, "seconds": time.perf_counter() - t0}
    out = {"fits": True, "overhead": plan.time / plan.baseline_time - 1,
           "peak_fraction": plan.peak_bytes / plan.baseline_peak_bytes,
           "fallback": plan.stats.get("fallback"), "seconds": time.perf_counter() - t0}
    if "hierarchy_plan_time" in plan.stats:  # a simple strategy beat the hierarchy's own plan
        out["hierarchy_overhead"] = plan.stats["hierarchy_plan_time"] / plan.baseline_time - 1
    return out


def cell(r: dict[str, Any]) -> str:
    if not r["fits"]:
        return "n/a" if r.get("not_a_chain") else "inf."
    if r.get("fallback") == "recompute-all":
        return f"{100 * r['overhead']:.1f}% (RA)"
    return f"{100 * r['overhead']:.1f}%"


def bound_cell(b: dict[str, Any]) -> str:
    if b["overhead"] is None:
        return "inf."
    return f"{100 * b['overhead']:.1f}%" + ("" if b["proven"] else "*")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", action="append", default=[],
                    help="another folder of graph files (repeatable)")
    ap.add_argument("--demo", action="store_true", help="also trace and plan the demo GPT-2")
    ap.add_argument("--zoo", metavar="SIZE", choices=("tiny", "small", "large"),
                    help="also plan every built-in zoo model of this size, traced and exported "
                         "as an operator log without pairing (only backward flags)")
    ap.add_argument("--budgets", default="0.9,0.7,0.5,0.3")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--out", default=str(REPO / "bench-results" / "simple_strategies.json"))
    args = ap.parse_args(argv)
    folders = [REPO / "tests" / "data" / "graphs", *map(Path, args.graphs)]
    rows = []
    print(f"{'graph':32} {'budget':>6} {'hrockmate':>12} {'made by':>21} {'solve s':>8} "
          + " ".join(f"{s:>12}" for s in STRATEGIES) + f" {'bound':>8}  never costlier")
    for name, g in graphs(folders, args.demo, args.zoo):
        for fraction in (float(b) for b in args.budgets.split(",")):
            row: dict[str, Any] = {"graph": name, "ops": g.num_ops, "budget": fraction}
            row["hrockmate"] = run_one(g, fraction, "hrockmate", args.time_limit)
            for s in STRATEGIES:
                row[s] = run_one(g, fraction, s, args.time_limit)
            b = hrockmate.time_lower_bound(g, fraction)
            row["bound"] = {"overhead": b.overhead if b.time < float("inf") else None,
                            "proven": b.proven, "seconds": b.seconds}
            h = row["hrockmate"]
            beaten = [s for s in STRATEGIES if row[s]["fits"] and row[s].get("fallback") is None
                      and h["fits"] and h["overhead"] > row[s]["overhead"] + 1e-9]
            row["never_costlier"] = not beaten
            made_by = (h.get("fallback") or "hierarchy") if h["fits"] else "-"
            if "hierarchy_overhead" in h:  # what the hierarchy's own plan cost
                made_by += f" (H {100 * h['hierarchy_overhead']:.2f}%)"
            rows.append(row)
            print(f"{name[:32]:32} {fraction:>6.0%} {cell(h):>12} {made_by:>21} "
                  f"{h['seconds']:>8.1f} " + " ".join(f"{cell(row[s]):>12}" for s in STRATEGIES)
                  + f" {bound_cell(row['bound']):>8}"
                  + f"  {'yes' if not beaten else 'NO: ' + ','.join(beaten)}", flush=True)
    write_atomic(Path(args.out), json.dumps({"rows": rows, "time_limit": args.time_limit},
                                            indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r["never_costlier"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
