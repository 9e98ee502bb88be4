"""The truth table: for each built-in model, the store-all peak the simulator predicts for its
traced graph against the peak of plain autograd measured on the CPU (``hrockmate truth-table``).
A tool over the capture stage: it builds models from ``hrockmate.models``, traces them and
measures them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn as nn

from hrockmate import models
from hrockmate.capture.memory import measure_eager_peak
from hrockmate.capture.trace import trace_model
from hrockmate.ir.graph import write_atomic
from hrockmate.ir.schedule import simulate, store_all_schedule

__all__ = ["format_truth_table", "truth_row", "truth_table"]


def truth_row(
    name: str,
    model: nn.Module,
    sample: Any,
    *,
    loss_fn: Any = None,
) -> dict[str, Any]:
    """Trace ``model`` (estimated times, measured workspaces), simulate the store-all schedule
    and measure plain autograd's peak on the same iteration: one row of the truth table."""
    t0 = time.perf_counter()
    traced = trace_model(model, sample, loss_fn=loss_fn, cost="estimate", name=name)
    trace_s = time.perf_counter() - t0
    sim = simulate(traced.graph, store_all_schedule(traced.graph))
    measured = measure_eager_peak(model, sample, loss_fn=loss_fn, traced=traced).peak_bytes
    simulated = int(sim.peak_bytes)
    return {
        "model": name,
        "ops": traced.graph.num_ops,
        "trace_s": round(trace_s, 3),
        "simulated_peak": simulated,
        "measured_peak": int(measured),
        "error": (simulated - measured) / measured if measured else float("nan"),
    }


def format_truth_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':<24}{'ops':>6}{'trace s':>9}{'simulated':>12}{'measured':>12}{'error':>9}"]
    for r in rows:
        lines.append(
            f"{r['model']:<24}{r['ops']:>6}{r['trace_s']:>9.2f}{r['simulated_peak']:>12}"
            f"{r['measured_peak']:>12}{100 * r['error']:>8.2f}%"
        )
    return "\n".join(lines)


def truth_table(
    names: Iterable[str] | None = None,
    *,
    out: str | Path | None = "bench-results/truth_table.json",
    echo: bool = True,
) -> list[dict[str, Any]]:
    """Simulated store-all peak of each built-in model's traced graph (default configuration)
    against the peak of plain autograd measured on CPU. Writes the rows as JSON to ``out``."""
    rows = []
    for name in names or models.MODELS:
        model, sample = models.build(name)
        rows.append(truth_row(name, model, sample))
    if echo:
        print(format_truth_table(rows))
    if out is not None:
        write_atomic(Path(out), json.dumps({"device": "cpu", "torch": torch.__version__,
                                            "rows": rows}, indent=2))
    return rows
