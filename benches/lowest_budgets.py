"""The lowest budget each planner reaches, predicted by the simulator, on every test graph.

The hierarchy's formulation holds block checkpointing and Rotor's chain schedules as points,
so the lowest peak its own plan reaches (the top level solved for the least peak, with each
default leaf size and both models of the blocks' options, the least kept) should be at or
below the lowest one of per-block checkpointing (every block count tried), selective
checkpointing and whole-graph Rotor (chain-shaped graphs only). Graphs as in
``benches/simple_strategies.py`` (``--graphs DIR``, ``--demo``, ``--zoo SIZE``).

    OMP_NUM_THREADS=1 python benches/lowest_budgets.py [--demo] [--zoo small] [--graphs DIR]

Writes JSON (default ``bench-results/lowest_budgets.json``) and prints a table: each lowest
peak as a percentage of the store-all peak (``-`` where the strategy does not apply).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hrockmate
from hrockmate.ir.graph import Graph, write_atomic
from hrockmate.planning import hierarchy, ilp, policy
from hrockmate.planning.policy import lowest_peak_top
from hrockmate.planning.strategies import checkpoint_points

sys.path.insert(0, str(Path(__file__).resolve().parent))
from simple_strategies import REPO, graphs  # noqa: E402


def hierarchy_lowest(g: Graph, time_limit: float) -> tuple[int | None, dict[str, Any]]:
    """The least peak of the hierarchy's own plans over the default leaf sizes, each with the
    blocks' default options and with their low-peak model (``policy.lowest_peak_top``, as
    ``solve_graph`` finds it when nothing simple fits; it solves the blocks again with the
    low-peak model below the least peak of the default options)."""
    best: int | None = None
    per_size: dict[str, Any] = {}
    for size in hierarchy.leaf_sizes(g, None):
        for low_peak in (False, True):
            key = f"{size} low-peak" if low_peak else str(size)
            t0 = time.perf_counter()
            try:
                h = hierarchy.prepare(g, leaf_size=size, time_limit=time_limit, progress=False,
                                      low_peak=low_peak)
                steps, fl, proven, _ = lowest_peak_top(h, time_limit)
            except (ilp.LevelInfeasible, ilp.LevelNoSolution, hierarchy.HierarchyTimeout):
                per_size[key] = None
                continue
            peak = hrockmate.simulate(g, hrockmate.Schedule(steps, fl)).peak_bytes
            per_size[key] = {"peak": peak, "proven": proven,
                             "seconds": round(time.perf_counter() - t0, 2)}
            best = peak if best is None else min(best, peak)
    return best, per_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", type=Path, action="append", default=[],
                    help="folder of graph files (repeatable; the repository's test graphs "
                         "always)")
    ap.add_argument("--no-test-graphs", action="store_true",
                    help="leave out the repository's test graphs")
    ap.add_argument("--demo", action="store_true", help="add a trace of the demo GPT-2")
    ap.add_argument("--zoo", default=None, help="add the zoo models at this size as operator "
                                                "logs (e.g. small)")
    ap.add_argument("--time-limit", type=float, default=60.0,
                    help="seconds for each leaf size's blocks and for its top MILP")
    ap.add_argument("--out", type=Path, default=Path("bench-results/lowest_budgets.json"))
    args = ap.parse_args(argv)
    folders = ([] if args.no_test_graphs else [REPO / "tests" / "data" / "graphs"]) + args.graphs
    rows = []
    print(f"{'graph':34} {'ops':>6} {'hierarchy':>10} {'checkpoint':>11} {'selective':>10} "
          f"{'rotor':>7}  at or below")
    for name, g in graphs(folders, args.demo, args.zoo):
        base = hrockmate.simulate(g, hrockmate.store_all_schedule(g)).peak_bytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            own, per_size = hierarchy_lowest(g, args.time_limit)
            lows: dict[str, int | None] = {
                "checkpoint": min(p.peak for p in checkpoint_points(g, False)),
                "selective": min(p.peak for p in checkpoint_points(g, True)),
                "rotor": policy.rotor_least_peak(g, 60),
            }
        others = [v for v in lows.values() if v is not None]
        ok = own is not None and all(own <= v for v in others)
        rows.append({"graph": name, "ops": g.num_ops, "store_all_peak": base,
                     "hierarchy": own, "hierarchy_per_leaf_size": per_size, **lows,
                     "at_or_below": ok})

        def pct(v: int | None) -> str:
            return "-" if v is None else f"{100 * v / base:.1f}%"

        print(f"{name[:34]:34} {g.num_ops:6d} {pct(own):>10} {pct(lows['checkpoint']):>11} "
              f"{pct(lows['selective']):>10} {pct(lows['rotor']):>7}  {'yes' if ok else 'NO'}",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps({"rows": rows, "time_limit": args.time_limit}, indent=1))
    print(f"{sum(r['at_or_below'] for r in rows)} of {len(rows)} at or below; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
