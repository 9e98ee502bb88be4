"""The plan against the leaf size of the hierarchy, predicted by the simulator.

For each graph (tests/data/graphs, third-party graphs with ``--graphs``, any graph files given
with ``--graph``, a trace of the demo GPT-2 with ``--demo``) of more than 60 ops (smaller graphs
are solved at the op level: no leaves) and each budget, it plans with each leaf size of
``--leaf-sizes`` and reports the time over store-all and the solve time. This is how the
default (``hrockmate.planning.hierarchy.LEAF_SIZES``) was chosen.

    OMP_NUM_THREADS=1 python benches/leaf_sizes.py [--demo] [--graphs DIR] [--graph FILE]

Writes JSON (default ``bench-results/leaf_sizes.json``) and prints one line per case.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

from simple_strategies import graphs

import hrockmate
from hrockmate.ir.graph import Graph, write_atomic

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", action="append", default=[], help="a folder of graph files")
    ap.add_argument("--graph", action="append", default=[], help="a graph file")
    ap.add_argument("--demo", action="store_true", help="also trace and plan the demo GPT-2")
    ap.add_argument("--leaf-sizes", default="6,8,9")
    ap.add_argument("--budgets", default="0.9,0.7,0.5,0.3")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--exact-ops", type=int, default=100,
                    help="solve_graph's exact_ops (0: the hierarchy's own plans, no op-level "
                         "second try)")
    ap.add_argument("--out", default=str(REPO / "bench-results" / "leaf_sizes.json"))
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.leaf_sizes.split(",")]
    found = graphs([REPO / "tests" / "data" / "graphs", *map(Path, args.graphs)], args.demo)
    found += [(Path(f).stem, Graph.load(f)) for f in args.graph]
    rows: list[dict[str, Any]] = []
    for name, g in found:
        if g.num_ops <= 60:
            continue
        for fraction in (float(b) for b in args.budgets.split(",")):
            row: dict[str, Any] = {"graph": name, "ops": g.num_ops, "budget": fraction}
            for size in sizes:
                t0 = time.perf_counter()
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        plan = hrockmate.solve_graph(g, fraction, leaf_size=size, progress=False,
                                                     time_limit=args.time_limit,
                                                     exact_ops=args.exact_ops)
                    row[str(size)] = {"overhead": plan.time / plan.baseline_time - 1,
                                      "seconds": time.perf_counter() - t0,
                                      "fallback": plan.stats.get("fallback")}
                except hrockmate.InfeasibleBudget:
                    row[str(size)] = {"overhead": None, "seconds": time.perf_counter() - t0}
            rows.append(row)
            print(f"{name[:30]:30} {g.num_ops:6d} {fraction:4.0%} " + "  ".join(
                f"{s}: " + ("inf." if row[str(s)]["overhead"] is None else
                            f"{100 * row[str(s)]['overhead']:+.1f}%")
                + f" {row[str(s)]['seconds']:.1f}s" for s in sizes), flush=True)
    write_atomic(Path(args.out), json.dumps({"rows": rows, "time_limit": args.time_limit,
                                                "exact_ops": args.exact_ops},
                                            indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
