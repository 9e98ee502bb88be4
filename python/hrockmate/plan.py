"""Plans: the result of solving, i.e. a validated schedule plus what was predicted for it.

A ``Plan`` is tied to one graph by ``Graph.structure_hash()``; saving writes JSON atomically and
loading checks the format and, when a graph is given, that the plan was made for it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hrockmate.budget import format_bytes
from hrockmate.graph import write_atomic

if TYPE_CHECKING:
    from hrockmate.graph import Graph
    from hrockmate.schedule import Schedule

PLAN_FORMAT = "hrockmate-plan"
PLAN_VERSION = 1

Step = tuple[str, int]


class PlanError(ValueError):
    """A plan file is unreadable or corrupt, or a plan does not belong to the given graph."""


class InfeasibleBudget(ValueError):
    """No schedule fits the budget; ``min_bytes`` is the smallest peak that can be reached."""

    def __init__(self, budget_bytes: int, min_bytes: int, graph_name: str = "") -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_bytes = int(min_bytes)
        self.graph_name = graph_name
        where = f" for graph '{graph_name}'" if graph_name else ""
        super().__init__(
            f"budget of {self.budget_bytes} bytes ({format_bytes(self.budget_bytes)}) is below "
            f"the smallest feasible peak{where}: {self.min_bytes} bytes "
            f"({format_bytes(self.min_bytes)}); give a budget of at least {self.min_bytes} bytes"
        )


@dataclass
class Plan:
    """A schedule for one graph with its predicted (simulated) peak and time.

    ``peak_bytes`` and ``time`` are the simulator's numbers for ``steps``; the ``baseline_*``
    fields are those of the store-all schedule (plain autograd). ``stats`` holds solver
    statistics, among them ``optimal`` (False when a time limit cut the search short),
    ``method`` and ``solve_seconds``.
    """

    graph_hash: str
    graph_name: str
    budget_bytes: int
    peak_bytes: int
    time: float
    baseline_peak_bytes: int
    baseline_time: float
    steps: list[Step]
    forward_len: int
    time_unit: str = "s"
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return str(self.stats.get("method", ""))

    @property
    def optimal(self) -> bool:
        return bool(self.stats.get("optimal", False))

    @property
    def overhead(self) -> float:
        """Predicted extra compute relative to store-all (0.1 = 10% slower)."""
        return self.time / self.baseline_time - 1.0 if self.baseline_time > 0 else 0.0

    @property
    def memory_ratio(self) -> float:
        """Predicted peak as a fraction of the store-all peak."""
        return self.peak_bytes / self.baseline_peak_bytes if self.baseline_peak_bytes else 0.0

    @property
    def schedule(self) -> "Schedule":
        from hrockmate.schedule import Schedule

        return Schedule(steps=list(self.steps), forward_len=self.forward_len)

    def check_graph(self, graph: "Graph") -> None:
        """Raise ``PlanError`` unless this plan was made for ``graph`` (same structure hash)."""
        h = graph.structure_hash()
        if h != self.graph_hash:
            raise PlanError(
                f"this plan was made for graph '{self.graph_name}' (structure hash "
                f"{self.graph_hash}) but the given graph '{graph.name}' has hash {h}; the model, "
                "sample shapes or dtypes changed: solve again for this graph"
            )

    def summary(self) -> str:
        state = "optimal" if self.optimal else "not proven optimal"
        return (
            f"plan for '{self.graph_name}': peak {format_bytes(self.peak_bytes)} of budget "
            f"{format_bytes(self.budget_bytes)} (store-all {format_bytes(self.baseline_peak_bytes)}),"
            f" time {self.time:.6g} {self.time_unit} (+{100 * self.overhead:.1f}% over store-all), "
            f"method {self.method}, {state}"
        )

    # ---- serialisation ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "version": PLAN_VERSION,
            "graph_hash": self.graph_hash,
            "graph_name": self.graph_name,
            "budget_bytes": int(self.budget_bytes),
            "peak_bytes": int(self.peak_bytes),
            "time": float(self.time),
            "baseline_peak_bytes": int(self.baseline_peak_bytes),
            "baseline_time": float(self.baseline_time),
            "time_unit": self.time_unit,
            "schedule": {
                "format": "hrockmate-schedule",
                "version": 1,
                "forward_len": int(self.forward_len),
                "steps": [[kind, int(i)] for kind, i in self.steps],
            },
            "stats": _jsonable(self.stats),
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON atomically (a crash never leaves half a file)."""
        write_atomic(Path(path), json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> "Plan":
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source} is not an hrockmate plan (missing format '{PLAN_FORMAT}')")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(
                f"{source} has plan version {data.get('version')!r}; this hrockmate reads version "
                f"{PLAN_VERSION}: solve again"
            )
        try:
            sched = data["schedule"]
            steps: list[Step] = []
            for k, item in enumerate(sched["steps"]):
                kind, ident = item
                if kind not in ("compute", "free") or not isinstance(ident, int) or ident < 0:
                    raise PlanError(f"{source}: schedule step {k} is malformed: {item!r}")
                steps.append((kind, ident))
            forward_len = int(sched["forward_len"])
            if not 0 <= forward_len <= len(steps):
                raise PlanError(f"{source}: forward_len {forward_len} is outside the schedule")
            stats = data.get("stats") or {}
            if not isinstance(stats, dict):
                raise PlanError(f"{source}: 'stats' must be an object")
            return cls(
                graph_hash=str(data["graph_hash"]),
                graph_name=str(data["graph_name"]),
                budget_bytes=int(data["budget_bytes"]),
                peak_bytes=int(data["peak_bytes"]),
                time=float(data["time"]),
                baseline_peak_bytes=int(data["baseline_peak_bytes"]),
                baseline_time=float(data["baseline_time"]),
                steps=steps,
                forward_len=forward_len,
                time_unit=str(data.get("time_unit", "s")),
                stats=stats,
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source} is corrupt: missing or bad field ({exc})") from None


def load_plan(path: str | os.PathLike[str], graph: "Graph | None" = None) -> Plan:
    """Read a plan written by ``Plan.save``; with ``graph``, also check that it belongs to it."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read plan file {p}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"plan file {p} is corrupt (not valid JSON: {exc.msg} at line {exc.lineno}); "
            "delete it and solve again"
        ) from None
    plan = Plan.from_dict(data, source=f"plan file {p}")
    if graph is not None:
        plan.check_graph(graph)
    return plan


def _jsonable(value: Any) -> Any:
    """Statistics may hold numpy scalars; turn them into plain JSON values."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
