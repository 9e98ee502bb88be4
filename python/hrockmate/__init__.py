"""hrockmate: hierarchical re-materialization planning and runtime for PyTorch training.

One subpackage per stage of the pipeline:

- ``capture``: trace one training iteration into a graph, measure op costs and peaks;
- ``ir``: the graph, schedules and their simulator (Rust), plans and budgets;
- ``planning``: hierarchy (Rust) -> block options -> H-ILP (HiGHS) -> schedule, with the
  fallback policy and the simple strategies it must never lose to;
- ``runtime``: the schedule compiled to straight-line code, run inside autograd (``HRockmate``).

``cli``, ``demo``, ``bench`` and the model zoos are the tools around them. Public names are
imported lazily so that ``import hrockmate`` stays cheap (torch is only imported by the stages
that need it).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Graph": "hrockmate.ir.graph",
    "GraphError": "hrockmate.ir.graph",
    "Schedule": "hrockmate.ir.schedule",
    "ScheduleError": "hrockmate.ir.schedule",
    "SimulationResult": "hrockmate.ir.schedule",
    "simulate": "hrockmate.ir.schedule",
    "store_all_schedule": "hrockmate.ir.schedule",
    "recompute_all_schedule": "hrockmate.ir.schedule",
    "trace": "hrockmate.capture.trace",
    "trace_model": "hrockmate.capture.trace",
    "Traced": "hrockmate.capture.joint",
    "TraceError": "hrockmate.capture.joint",
    "FiniteAssumptionError": "hrockmate.capture.values",
    "measure_peak_memory": "hrockmate.capture.memory",
    "PeakMeasurement": "hrockmate.capture.memory",
    "solve": "hrockmate.planning.api",
    "solve_graph": "hrockmate.planning.api",
    "pareto": "hrockmate.planning.api",
    "time_lower_bound": "hrockmate.planning.bounds",
    "TimeBound": "hrockmate.planning.bounds",
    "Plan": "hrockmate.ir.plan",
    "load_plan": "hrockmate.ir.plan",
    "PlanError": "hrockmate.ir.plan",
    "InfeasibleBudget": "hrockmate.ir.errors",
    "SolveError": "hrockmate.ir.plan",
    "parse_budget": "hrockmate.ir.budget",
    "HRockmate": "hrockmate.runtime",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hrockmate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
