"""Solver quality: cost of hrockmate's plans against the exact MILP and the literature.

For every training graph and budget (a fraction of the store-all peak) this records the time
and solve time of the plans of (``COLUMNS``): the exact MILP (``method="checkmate"``, under a
time limit), hrockmate with its defaults (graphs of at most ``flat_ops`` ops are solved at the
op level), hrockmate forced through the hierarchy (``flat_ops=0``, one hierarchy per graph and
solver choice, reused for every budget), the hierarchy with Rotor on chain levels and at the
top, the hierarchy with TW-Remat at the leaves, TW-Remat and Rotor on the whole graph, and
block checkpointing. The gap is ``time / exact time - 1`` where the exact MILP proved
optimality, else the overhead over store-all is given. A second table times the hierarchical
solver on larger synthetic training graphs.

    python benches/solver_quality.py [--graphs DIR] [--zoo mlp gpt2_tiny] [--exact-time-limit 120]

Writes JSON (default ``bench-results/solver_quality.json``) and prints a table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hrockmate
from hrockmate.ir.graph import Graph, Op, Tensor, write_atomic
from hrockmate.ir.plan import InfeasibleBudget
from hrockmate.planning import strategies

hierarchy_mod = importlib.import_module("hrockmate.planning.hierarchy")
REPO = Path(__file__).resolve().parents[1]
BUDGETS = (0.9, 0.7, 0.5, 0.4, 0.3)


def _plan_row(fn: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = fn()
    except InfeasibleBudget as exc:
        return {"status": "infeasible", "min_bytes": exc.min_bytes,
                "seconds": round(time.perf_counter() - t0, 2)}
    return {
        "status": "optimal" if plan.optimal else "feasible",
        "time": plan.time,
        "overhead": round(plan.overhead, 5),
        "peak_ratio": round(plan.memory_ratio, 4),
        "fallback": plan.stats.get("fallback"),
        "levels": plan.stats.get("levels"),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _exact_row(g: Graph, budget: int, time_limit: float) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        r = strategies.solve_checkmate(g, budget, time_limit=time_limit)
    except strategies.SolverInfeasible as exc:
        return {"status": "infeasible" if exc.proven else "no solution in time limit",
                "seconds": round(time.perf_counter() - t0, 2)}
    sim = hrockmate.simulate(g, hrockmate.Schedule(r.steps, r.forward_len))
    assert sim.peak_bytes <= budget
    return {"status": "optimal" if r.optimal else "feasible", "time": sim.time,
            "mip_gap": r.stats.get("mip_gap"), "seconds": round(time.perf_counter() - t0, 2)}


#: the columns of the comparison: label -> solve_graph keyword arguments (None: the exact MILP)
COLUMNS: dict[str, dict[str, Any] | None] = {
    "exact": None,
    "hrockmate": {},
    "hierarchical": {"flat_ops": 0},
    "hier+rotor": {"flat_ops": 0, "solvers": {"chains": "rotor", "top": "rotor"}},
    "hier+twremat": {"flat_ops": 0, "solvers": {"leaves": "twremat"}},
    "twremat": {"method": "twremat"},
    "rotor": {"method": "rotor"},
    "checkpoint": {"method": "checkpoint"},
}


def load_graphs(graphs_dir: Path, only: list[str] | None, zoo: list[str]) -> list[tuple[str, Graph]]:
    """The shared training graphs, then the built-in models traced (``zoo``)."""
    out = []
    for path in sorted(graphs_dir.glob("*_train.json")):
        if not only or any(o in path.name for o in only):
            out.append((path.name.removesuffix("_train.json"), Graph.load(path)))
    if zoo:
        from hrockmate import models

        for name in zoo:
            model, sample = models.build(name)
            out.append((f"{name} (traced)", hrockmate.trace(model, sample)))
    return out


def quality(graphs: list[tuple[str, Graph]], budgets: tuple[float, ...], exact_limit: float,
            columns: list[str],
            exact_from: dict[tuple[str, int, float], dict[str, Any]] | None = None
            ) -> list[dict[str, Any]]:
    """One row per graph and budget. ``exact_from`` holds exact-MILP rows of an earlier run
    (keyed by graph name, op count and budget fraction) to reuse instead of solving again."""
    rows = []
    for name, g in graphs:
        base = hrockmate.simulate(g, hrockmate.store_all_schedule(g))
        hierarchies: dict[str, Any] = {}  # one hierarchy per solver choice, reused per budget
        for frac in budgets:
            budget = int(frac * base.peak_bytes)
            row: dict[str, Any] = {"graph": name, "ops": g.num_ops, "budget_fraction": frac,
                                   "budget_bytes": budget}
            for col in columns:
                kw = COLUMNS[col]
                if kw is None:
                    known = (exact_from or {}).get((name, g.num_ops, frac))
                    row[col] = known if known is not None else _exact_row(g, budget, exact_limit)
                    continue
                kw = dict(kw)
                if kw.get("flat_ops") == 0:
                    key = repr(kw.get("solvers"))
                    if key not in hierarchies:
                        t0 = time.perf_counter()
                        hierarchies[key] = (hierarchy_mod.prepare(
                            g, flat_ops=0, progress=False, solvers=kw.get("solvers")),
                            time.perf_counter() - t0)
                    kw["hierarchy"] = hierarchies[key][0]
                row[col] = _plan_row(lambda: hrockmate.solve_graph(
                    g, budget, time_limit=exact_limit, progress=False, **kw))
                if "hierarchy" in kw:
                    row[col]["hierarchy_seconds"] = round(hierarchies[key][1], 2)
            if row.get("exact", {}).get("status") == "optimal":
                for col in columns:
                    if "time" in row[col] and col != "exact":
                        row[col]["gap"] = round(row[col]["time"] / row["exact"]["time"] - 1, 5)
            rows.append(row)
            _print_row(row, columns)
    return rows


def _cell(d: dict[str, Any]) -> str:
    if "gap" in d:
        return f"{100 * d['gap']:+.2f}%"
    if "time" in d:
        return f"ovh {100 * d['overhead']:.1f}%"
    return {"infeasible": "infeasible", "optimal": "optimal"}.get(d["status"], d["status"][:12])


def _print_row(row: dict[str, Any], columns: list[str]) -> None:
    cells = []
    for col in columns:
        d = row[col]
        if col == "exact":
            cells.append(f"{d['status'][:9]} {d['seconds']:.0f}s")
        else:
            cells.append(f"{_cell(d)} ({d['seconds']:.1f}s)")
    print(f"{row['graph'][:18]:18s} {row['ops']:4d} {row['budget_fraction']:4.2f} | "
          + " | ".join(f"{c:18s}" for c in cells), flush=True)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """One line per graph and budget: gap to the exact optimum (or overhead over store-all)."""
    head = "| graph (ops) | budget | " + " | ".join(columns) + " |"
    lines = [head, "|" + "---|" * (len(columns) + 2)]
    for row in rows:
        cells = []
        for col in columns:
            d = row[col]
            if col == "exact":
                cells.append(d["status"] if "time" not in d else
                             f"{d['status']} ({d['seconds']:.0f} s)")
            else:
                cells.append(f"{_cell(d)}, {d['seconds']:.1f} s" if "time" in d else _cell(d))
        lines.append(f"| {row['graph']} ({row['ops']}) | {row['budget_fraction']:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def synthetic_training_graph(n_fwd: int, seed: int = 0) -> Graph:
    """A deep network's training iteration: a chain of forward ops with residual joins every
    few ops and parameters, plus the matching backward ops (gradient accumulation included)."""
    rng = random.Random(seed)
    g = Graph(name=f"synthetic{n_fwd}", time_unit="units")
    x = g.add_tensor(Tensor("x", 1 << 20, role="input"))
    acts = [x]
    fwd: list[tuple[int, list[int], int]] = []  # (op, inputs, output)
    for i in range(n_fwd):
        ins = [acts[-1]]
        if i % 4 == 3 and len(acts) > 4:
            ins.append(acts[-4])  # residual join
        w = None
        if rng.random() < 0.6:
            w = g.add_tensor(Tensor(f"w{i}", 1 << 16, role="parameter"))
            ins.append(w)
        out = g.add_tensor(Tensor(f"a{i}", rng.choice([1, 2, 4]) << 20))
        op = g.add_op(Op(f"f{i}", "forward", rng.uniform(1, 10), ins, [out],
                         workspace=rng.choice([0, 1 << 18])))
        fwd.append((op, ins, out))
        acts.append(out)
    loss = g.add_tensor(Tensor("loss", 4, role="output"))
    loss_op = g.add_op(Op("loss", "forward", 1.0, [acts[-1]], [loss]))
    seed_t = g.add_tensor(Tensor("dloss", 4, role="tangent"))
    grads: dict[int, list[int]] = {}
    g0 = g.add_tensor(Tensor("g_last", g.tensors[acts[-1]].bytes))
    g.add_op(Op("loss_bwd", "backward", 1.0, [seed_t, acts[-1]], [g0], differentiates=loss_op))
    grads[acts[-1]] = [g0]
    for i in range(n_fwd - 1, -1, -1):
        op, ins, out = fwd[i]
        parts = grads[out]
        if len(parts) > 1:  # accumulate the gradient contributions first
            acc = g.add_tensor(Tensor(f"gacc{i}", g.tensors[out].bytes))
            g.add_op(Op(f"acc{i}", "backward", 0.5, list(parts), [acc], differentiates=op))
            parts = [acc]
        outs = []
        for t in ins:
            role = g.tensors[t].role
            if role == "parameter":
                outs.append(g.add_tensor(Tensor(f"dw{i}", g.tensors[t].bytes,
                                                role="param_grad", grad_of=t)))
            elif role == "input":
                outs.append(g.add_tensor(Tensor("dx", g.tensors[t].bytes, role="input_grad",
                                                grad_of=t)))
            else:
                gt = g.add_tensor(Tensor(f"g{i}_{t}", g.tensors[t].bytes))
                grads.setdefault(t, []).append(gt)
                outs.append(gt)
        reads = parts + [t for t in ins if g.tensors[t].role != "input"] + [out]
        g.add_op(Op(f"b{i}", "backward", 2 * g.ops[op].time, reads, outs, differentiates=op))
    return g


def scale(sizes: list[int], time_limit: float) -> list[dict[str, Any]]:
    rows = []
    for n_fwd in sizes:
        g = synthetic_training_graph(n_fwd)
        t0 = time.perf_counter()
        plan = hrockmate.solve_graph(g, 0.5, time_limit=time_limit, progress=False)
        secs = time.perf_counter() - t0
        row = {"graph": g.name, "ops": g.num_ops, "budget_fraction": 0.5, "seconds": round(secs, 2),
               "hierarchy_seconds": plan.stats.get("hierarchy_seconds"),
               "levels": plan.stats.get("levels"), "blocks": plan.stats.get("blocks"),
               "overhead": round(plan.overhead, 4), "peak_ratio": round(plan.memory_ratio, 4),
               "optimal_top": plan.optimal, "fallback": plan.stats.get("fallback")}
        print(f"scale {g.num_ops:6d} ops: {secs:6.1f} s, overhead {100 * plan.overhead:.1f}% at "
              f"{100 * plan.memory_ratio:.0f}% of store-all, {row['levels']} levels", flush=True)
        rows.append(row)
    return rows


def _exact_rows(path: Path | None) -> dict[tuple[str, int, float], dict[str, Any]] | None:
    if path is None:
        return None
    data = json.loads(path.read_text())
    # traced graphs carry op times measured by each trace: solve those again
    return {(r["graph"], r["ops"], r["budget_fraction"]): r["exact"]
            for r in data["quality"] if "exact" in r and "(traced)" not in r["graph"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_graphs = os.environ.get("HROCKMATE_GRAPHS_DIR",
                                    str(REPO.parent / "shared" / "data" / "graphs"))
    ap.add_argument("--graphs", default=default_graphs, help="folder of *_train.json graphs")
    ap.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS))
    ap.add_argument("--exact-time-limit", type=float, default=120.0)
    ap.add_argument("--only", nargs="*", help="substrings of graph file names to run")
    ap.add_argument("--zoo", nargs="*", default=[],
                    help="built-in models to trace and compare too (e.g. mlp gpt2_tiny)")
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=list(COLUMNS),
                    help="solvers to compare")
    ap.add_argument("--exact-from", type=Path,
                    help="reuse the exact MILP's rows of an earlier JSON output of this bench "
                    "(same graphs and budgets); the exact MILP does not depend on hrockmate")
    ap.add_argument("--scale", type=int, nargs="*", default=[500, 1000, 1500],
                    help="forward ops of the synthetic graphs timed (total ops ~2x)")
    ap.add_argument("--out", default=str(REPO / "bench-results" / "solver_quality.json"))
    args = ap.parse_args(argv)
    graphs_dir = Path(args.graphs)
    if not graphs_dir.is_dir():
        print(f"graph folder {graphs_dir} not found; pass --graphs", file=sys.stderr)
        return 2
    result = {
        "benchmark": "solver_quality",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "exact_time_limit_s": args.exact_time_limit,
        "columns": {c: COLUMNS[c] for c in args.columns},
        "quality": quality(load_graphs(graphs_dir, args.only, args.zoo), tuple(args.budgets),
                           args.exact_time_limit, args.columns, _exact_rows(args.exact_from)),
        "scale": scale(args.scale, args.exact_time_limit) if args.scale else [],
    }
    write_atomic(Path(args.out), json.dumps(result, indent=1))
    print(markdown_table(result["quality"], args.columns))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
