"""The ``hrockmate`` command line: ``demo``, ``solve``, ``simulate``, ``bench``,
``truth-table``.

Errors are printed as one line (``hrockmate: error: ...``) with exit status 2, not a traceback;
set ``HROCKMATE_DEBUG=1`` to see the traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hrockmate.argtypes import seconds
from hrockmate.ir.budget import format_bytes

BUDGET_HELP = (
    "a number in (0, 1] or a percentage (50%%) is that fraction of the store-all peak; a whole "
    "number above 1 is bytes; or a size with a unit (6GiB, 500MB)"
)


def _cmd_demo(args: argparse.Namespace) -> int:
    from hrockmate.demo import run_demo

    run_demo(
        n_layer=args.layers,
        n_embd=args.embd,
        seq=args.seq,
        batch=args.batch,
        budget=args.budget,
        iterations=args.iterations,
        threads=args.threads,
    )
    return 0


def _cmd_truth_table(args: argparse.Namespace) -> int:
    from hrockmate.truth import truth_table

    truth_table(out=args.out, echo=True)
    return 0


def _parse_solvers(text: str | None) -> dict[str, str] | None:
    """``leaves=twremat,chains=rotor`` -> a dict (checked by ``solve_graph``)."""
    if not text:
        return None
    out = {}
    for part in text.split(","):
        level, sep, name = part.partition("=")
        if not sep:
            raise ValueError(f"--solvers: expected LEVEL=SOLVER pairs such as chains=rotor, "
                             f"got {part!r}")
        out[level.strip()] = name.strip()
    return out


def _cmd_solve(args: argparse.Namespace) -> int:
    import hrockmate

    graph = hrockmate.Graph.load(args.graph)
    plan = hrockmate.solve_graph(
        graph, args.budget, method=args.method, time_limit=args.time_limit,
        solvers=_parse_solvers(args.solvers),
        **({} if args.improve_time is None else {"improve_time": args.improve_time}),
    )
    if args.output:
        plan.save(args.output)
    unit = plan.time_unit
    overhead = f"overhead {100 * plan.overhead:.1f}%" if plan.baseline_time > 0 else (
        "no overhead: the graph's ops take no time")
    print(f"graph            {args.graph} ({graph.num_ops} ops, {graph.num_tensors} tensors)")
    print(f"budget           {format_bytes(plan.budget_bytes)}")
    print(
        f"predicted peak   {format_bytes(plan.peak_bytes)}"
        f"   (store-all {format_bytes(plan.baseline_peak_bytes)})"
    )
    print(
        f"predicted time   {plan.time:.6g} {unit}   (store-all {plan.baseline_time:.6g} {unit}, "
        f"{overhead})"
    )
    print(f"solve time       {plan.stats.get('solve_seconds', float('nan')):.2f} s")
    if args.bound and plan.baseline_time > 0:
        bound = hrockmate.time_lower_bound(graph, plan.budget_bytes)
        gap = 100 * (plan.time - bound.time) / plan.baseline_time
        print(f"lower bound      overhead {100 * bound.overhead:.1f}%"
              f"{'' if bound.proven else ' (search cut at its time limit)'}: no schedule within "
              f"the budget is faster; this plan is at most {gap:.1f} points from the best")
    if args.output:
        print(f"plan written to  {args.output}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    import hrockmate

    graph = hrockmate.Graph.load(args.graph)
    if args.schedule:
        from hrockmate.ir.plan import load_schedule_or_plan

        schedule = load_schedule_or_plan(args.schedule, graph)
    elif args.reference == "recompute-all":
        schedule = hrockmate.recompute_all_schedule(graph)
    else:
        schedule = hrockmate.store_all_schedule(graph)
    result = hrockmate.simulate(graph, schedule)
    print(f"graph        {graph.name or args.graph}: {graph.num_ops} ops, {graph.num_tensors} tensors")
    print(f"steps        {len(schedule.steps)} (forward segment {schedule.forward_len})")
    print(f"peak         {format_bytes(result.peak_bytes)}")
    print(f"time         {result.time:.6g} {graph.time_unit}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from hrockmate.bench import run_from_args

    run_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hrockmate",
        description="Re-materialization planner and runtime for PyTorch training.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo",
        help="trace, plan and train a built-in GPT-2-style model (random weights)",
        description="Trace a GPT-2-style model, plan it under a budget, run training steps and "
        "compare peak memory and time with plain PyTorch.",
    )
    demo.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    demo.add_argument("--embd", type=int, default=128, help="embedding width (default 128)")
    demo.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    demo.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    demo.add_argument(
        "--budget",
        default="0.5",
        help=f"memory budget: {BUDGET_HELP} (default 0.5)",
    )
    demo.add_argument("--iterations", type=int, default=3, help="timed iterations (default 3)")
    demo.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads (default: torch's own; on a busy machine 1 gives "
                      "steadier times)")
    demo.set_defaults(func=_cmd_demo)

    solve = sub.add_parser(
        "solve",
        help="plan a graph file (hrockmate IR JSON or networkx node-link JSON)",
        description="Solve a graph-level re-materialization problem and print the predicted "
        "peak memory and time.",
    )
    solve.add_argument("graph", type=Path, help="graph file")
    solve.add_argument("--budget", required=True, help=f"memory budget: {BUDGET_HELP}")
    solve.add_argument(
        "--method",
        default="hrockmate",
        choices=["hrockmate", "checkmate", "checkpoint", "twremat", "rotor", "recompute-all",
                 "store-all"],
        help="solver (default hrockmate; checkmate: exact ILP, for small graphs)",
    )
    solve.add_argument(
        "--time-limit", type=seconds, default=300.0, help="seconds for the solver (default 300)"
    )
    solve.add_argument(
        "--bound", action="store_true",
        help="also print a lower bound on the overhead of any schedule within the budget",
    )
    solve.add_argument(
        "--improve-time", type=seconds, default=None,
        help="seconds into the solve after which work that can only improve a plan in hand "
        "stops (default: 9 s up to 1,000 ops, 9 s per 1,000 ops above, at most 20 s)",
    )
    solve.add_argument(
        "--solvers",
        help="hrockmate method: solver per kind of level, e.g. leaves=twremat,chains=rotor,"
        "top=rotor (default: the ILP everywhere)",
    )
    solve.add_argument("-o", "--output", type=Path, help="write the plan (JSON) here")
    solve.set_defaults(func=_cmd_solve)

    sim = sub.add_parser(
        "simulate",
        help="simulate a schedule on a graph (peak memory and time)",
        description="Check a schedule against a graph and print its peak memory and time.",
    )
    sim.add_argument("graph", type=Path, help="graph file")
    sim.add_argument("--schedule", type=Path,
                     help="schedule JSON, or a plan file written by 'hrockmate solve -o' "
                     "(default: a reference schedule)")
    sim.add_argument(
        "--reference",
        choices=["store-all", "recompute-all"],
        default="store-all",
        help="reference schedule when --schedule is not given",
    )
    sim.set_defaults(func=_cmd_simulate)

    from hrockmate.bench import add_arguments as add_bench_arguments

    bench = sub.add_parser(
        "bench",
        help="benchmark hrockmate against plain autograd, checkpointing, torch.compile and "
        "the exact MILP",
        description="Run zoo models side by side with every method at budgets given as "
        "fractions of the store-all peak; write bench.json, a Pareto plot per model and print "
        "tables. Models come from the built-in zoo (hrockmate.zoo), or from the zoo module "
        "named by --zoo.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(func=_cmd_bench)

    truth = sub.add_parser(
        "truth-table",
        help="compare simulated and measured store-all peaks on the built-in models",
        description="Trace each built-in model, simulate its store-all schedule and measure "
        "plain autograd's peak on the CPU; print the table and write it as JSON.",
    )
    truth.add_argument("--out", type=Path, default=Path("bench-results/truth_table.json"),
                       help="where the rows are written (JSON)")
    truth.set_defaults(func=_cmd_truth_table)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("hrockmate: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line instead of a traceback
        if os.environ.get("HROCKMATE_DEBUG"):
            raise
        print(f"hrockmate: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
