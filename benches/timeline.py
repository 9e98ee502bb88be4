"""Memory timeline of one plan: live bytes over the schedule's steps, with the budget.

Plans a zoo model (or a graph file) at a budget and plots the simulator's timeline
(``hrockmate.simulate(graph, schedule).timeline``) of the plan next to plain autograd's
(store-all) schedule: the plan's curve stays under the budget line, recomputations stretch it.

    python benches/timeline.py                                  # gpt2 (tiny), 50%
    python benches/timeline.py --model unet --size small --budget 0.4
    python benches/timeline.py --graph path/to/vgg16_train.json --budget 0.6

Writes ``bench-results/timeline.png`` (or ``--out``) and prints the peaks.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def load_graph(model: str | None, size: str, graph: Path | None) -> Any:
    """The graph to plan: a graph file, or a zoo model traced (estimated op times)."""
    from hrockmate.capture.trace import trace_model
    from hrockmate.ir.graph import Graph

    if graph is not None:
        return Graph.load(graph)
    from hrockmate.zoo import ZOO

    if model not in ZOO:
        raise SystemExit(f"unknown model {model!r}; choose from {', '.join(ZOO)}")
    m, sample = ZOO[model].build(size)
    return trace_model(m.train(), sample, cost="estimate", name=model).graph


def plot_timeline(graph: Any, plan: Any, path: Path) -> dict[str, int]:
    """Plot the store-all and the plan's timelines (MiB per step) with the budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hrockmate.ir.schedule import simulate, store_all_schedule

    base_sched = store_all_schedule(graph)
    base = simulate(graph, base_sched)
    mine = simulate(graph, plan.schedule)
    units = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
    unit, uname = next((u, n) for u, n in units if base.peak_bytes >= 2 * u or u == 1)
    fig, ax = plt.subplots(figsize=(7, 4.4), dpi=90)
    for sched, sim, label, color in ((base_sched, base, "store-all (plain autograd)", "0.45"),
                                     (plan.schedule, mine, "hrockmate plan", "tab:red")):
        ax.plot([b / unit for b in sim.timeline], color=color, lw=1.0,
                label=f"{label}: peak {sim.peak_bytes / unit:.2f} {uname}, "
                f"{len(sched.steps)} steps")
        ax.axvline(sched.forward_len, color=color, ls=":", lw=0.8)
    ax.axhline(plan.budget_bytes / unit, color="tab:red", ls="--", lw=1.0,
               label=f"budget {plan.budget_bytes / unit:.2f} {uname}")
    ax.set_xlabel("schedule step (dotted: end of the forward segment)")
    ax.set_ylabel(f"live memory ({uname})")
    ax.set_title(f"{graph.name}: memory over one training iteration", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return {"store_all_peak": base.peak_bytes, "plan_peak": mine.peak_bytes,
            "budget": plan.budget_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", help="zoo model (default gpt2)")
    parser.add_argument("--size", default="tiny", choices=("tiny", "small", "large"))
    parser.add_argument("--graph", type=Path, default=None, help="plan this graph file instead")
    parser.add_argument("--budget", type=float, default=0.5,
                        help="fraction of the store-all peak (default 0.5)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per MILP")
    parser.add_argument("--out", type=Path, default=Path("bench-results") / "timeline.png")
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 1:
        parser.error(f"--budget must be a fraction in (0, 1], got {args.budget}")
    import torch

    from hrockmate.planning.api import solve_graph

    torch.set_num_threads(1)
    graph = load_graph(args.model, args.size, args.graph)
    plan = solve_graph(graph, args.budget, time_limit=args.time_limit, progress=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    peaks = plot_timeline(graph, plan, args.out)
    print(f"{graph.name}: {graph.num_ops} ops; store-all peak {peaks['store_all_peak']} B, "
          f"budget {peaks['budget']} B, plan peak {peaks['plan_peak']} B, overhead "
          f"{100 * plan.overhead:.1f}%")
    print(f"plot written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
