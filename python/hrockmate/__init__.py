"""hrockmate: hierarchical re-materialization planning and runtime for PyTorch training.

Pipeline (one module per stage): ``tracing`` -> ``graph`` -> simplify/partition/options (Rust,
``hierarchy``) -> ``planner`` (blocks and the H-ILP: ``ilp``, ``level_solvers``) ->
``schedule`` (+ ``simulate``) -> ``runtime``.
Public names are imported lazily so that ``import hrockmate`` stays cheap (torch is only
imported by the stages that need it).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "Graph": "hrockmate.graph",
    "GraphError": "hrockmate.graph",
    "Schedule": "hrockmate.schedule",
    "ScheduleError": "hrockmate.schedule",
    "SimulationResult": "hrockmate.schedule",
    "simulate": "hrockmate.schedule",
    "store_all_schedule": "hrockmate.schedule",
    "recompute_all_schedule": "hrockmate.schedule",
    "trace": "hrockmate.tracing",
    "trace_model": "hrockmate.tracing",
    "Traced": "hrockmate.tracing",
    "TraceError": "hrockmate.tracing",
    "measure_peak_memory": "hrockmate.memory",
    "PeakMeasurement": "hrockmate.memory",
    "solve": "hrockmate.planner",
    "solve_graph": "hrockmate.planner",
    "pareto": "hrockmate.planner",
    "Plan": "hrockmate.plan",
    "load_plan": "hrockmate.plan",
    "PlanError": "hrockmate.plan",
    "InfeasibleBudget": "hrockmate.plan",
    "parse_budget": "hrockmate.budget",
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
