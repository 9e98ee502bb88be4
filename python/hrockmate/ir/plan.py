"""Plans: the result of solving, i.e. a validated schedule plus what was predicted for it.

A ``Plan`` is tied to one graph by ``Graph.structure_hash()``; saving writes JSON atomically and
loading checks the format and, when a graph is given, that the plan was made for it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hrockmate.ir.budget import format_bytes
from hrockmate.ir.errors import InfeasibleBudget
from hrockmate.ir.graph import read_text_file, write_atomic
from hrockmate.ir.schedule import SCHEDULE_FORMAT, SCHEDULE_VERSION

if TYPE_CHECKING:
    from hrockmate.ir.graph import Graph
    from hrockmate.ir.schedule import Schedule, Step

PLAN_FORMAT = "hrockmate-plan"
PLAN_VERSION = 1
# HiGHS' model status when a MILP ran out of time (ilp.solve_level records it in stats["status"])
TIME_LIMIT_STATUS = "Time limit reached"



class PlanError(ValueError):
    """A plan file is unreadable or corrupt, or a plan does not belong to the given graph."""


class SolveError(RuntimeError):
    """The solver produced a schedule the simulator rejects (a bug); the message says which."""


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
    def made_by(self) -> str:
        """What made the schedule: the fallback used (``stats["fallback"]``: ``"greedy"``,
        ``"checkpoint"``, ``"rotor"``, ...) where there was one, else ``method``."""
        return str(self.stats.get("fallback") or self.method)

    @property
    def optimal(self) -> bool:
        return bool(self.stats.get("optimal", False))

    @property
    def eager_peak_bytes(self) -> int | None:
        """Plain PyTorch's measured peak for the iteration (``stats["eager_peak_bytes"]``), which
        a fractional budget of ``HRockmate`` or ``solve`` is of when it is below the traced
        store-all peak (``baseline_peak_bytes``); None where it was not measured (a graph
        solved alone, a budget in bytes)."""
        value = self.stats.get("eager_peak_bytes")
        return None if value is None else int(value)

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
        from hrockmate.ir.schedule import Schedule

        return Schedule(steps=list(self.steps), forward_len=self.forward_len)

    def shortfall(self, time_limit: float | None = None) -> str | None:
        """What cut this plan's solve short, in words, or None when nothing did.

        Two things do: the MILP stopped at its time limit (``time_limit``, the limit the solve
        was given) before proving its plan optimal, or the method found no schedule within
        the budget and a fallback schedule (``stats["fallback"]``) is used. A plan that is not
        proven optimal only because of the hierarchy's decomposition, or because block
        checkpointing or Rotor beat the hierarchy's plan, gives None.
        """
        what = []
        if self.stats.get("status") == TIME_LIMIT_STATUS:
            own = self.stats.get("time_limit")  # the MILP's own share of the solve's limit
            if own is not None and (time_limit is None or own < 0.99 * time_limit):
                # a share: later leaf sizes get what is left of the first seconds of the solve
                # (``context.improve_window``), the top level part of what the blocks left
                of = f" of the solve's {time_limit:g} s" if time_limit is not None else ""
                what.append(f"the MILP stopped at the end of its share ({own:.3g} s{of}) "
                            "before proving its plan optimal")
            else:
                limit = f" ({time_limit:g} s)" if time_limit is not None else ""
                what.append(f"the MILP stopped at its time limit{limit} before proving its "
                            "plan optimal (raise time_limit for a better one)")
        fallback = self.stats.get("fallback")
        if fallback and not self.stats.get("beats_hierarchy_plan"):
            what.append(f"the {self.method} method found no schedule within the budget, so "
                        f"the {fallback} schedule is used")
        if not what:
            return None
        return (f"solving '{self.graph_name}': {'; '.join(what)}: the plan is valid and within "
                "the budget but may be suboptimal")

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
        beaten = ""
        own = self.stats.get("hierarchy_plan_time")
        if self.stats.get("beats_hierarchy_plan") and own is not None and self.baseline_time > 0:
            beaten = (f"; the {self.stats.get('fallback')} plan beat the hierarchy's own "
                      f"(+{100 * (own / self.baseline_time - 1):.2f}%)")
        elif self.made_by != self.method:
            beaten = f"; the {self.made_by} schedule (the method found none within the budget)"
        return (
            f"plan for '{self.graph_name}': peak {format_bytes(self.peak_bytes)} of budget "
            f"{format_bytes(self.budget_bytes)} (store-all {format_bytes(self.baseline_peak_bytes)}),"
            f" time {self.time:.6g} {self.time_unit} (+{100 * self.overhead:.1f}% over store-all), "
            f"method {self.method}, {state}{beaten}"
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
                "format": SCHEDULE_FORMAT,
                "version": SCHEDULE_VERSION,
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
        """Check every field (type and range; the message names the field) and build the plan."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise PlanError(f"{source} is not an hrockmate plan (missing format '{PLAN_FORMAT}')")
        version = data.get("version")
        if not _is_int(version) or version != PLAN_VERSION:
            raise PlanError(
                f"{source} has plan version {version!r}; this hrockmate reads version "
                f"{PLAN_VERSION} (an integer): solve again"
            )
        unknown = sorted(set(data) - _PLAN_FIELDS - {"format", "version"})
        if unknown:
            raise PlanError(f"{source}: field {unknown[0]!r}: unknown field")
        fields = _Fields(data, source)
        sched = _Fields(fields.get("schedule", dict), f"{source}: field 'schedule'")
        sched_format = sched.data.get("format", SCHEDULE_FORMAT)
        sched_version = sched.data.get("version", SCHEDULE_VERSION)
        if sched_format != SCHEDULE_FORMAT or not _is_int(sched_version) or (
                sched_version != SCHEDULE_VERSION):
            raise PlanError(f"{source}: field 'schedule' is not an {SCHEDULE_FORMAT} version "
                            f"{SCHEDULE_VERSION}")
        steps = _steps(sched.get("steps", list), source)
        forward_len = sched.count("forward_len")
        if forward_len > len(steps):
            raise PlanError(f"{source}: forward_len {forward_len} is outside the schedule "
                            f"({len(steps)} steps)")
        return cls(
            graph_hash=fields.get("graph_hash", str),
            graph_name=fields.get("graph_name", str),
            budget_bytes=fields.count("budget_bytes"),
            peak_bytes=fields.count("peak_bytes"),
            time=fields.seconds("time"),
            baseline_peak_bytes=fields.count("baseline_peak_bytes"),
            baseline_time=fields.seconds("baseline_time"),
            steps=steps,
            forward_len=forward_len,
            time_unit=fields.get("time_unit", str, default="s"),
            stats=fields.get("stats", dict, default={}),
        )


_PLAN_FIELDS = frozenset({
    "graph_hash", "graph_name", "budget_bytes", "peak_bytes", "time", "baseline_peak_bytes",
    "baseline_time", "time_unit", "schedule", "stats",
})
# Sizes and ids beyond this many digits cannot be real (2**64 has 20); refusing them early also
# keeps Python from converting huge digit strings.
_MAX_INT_DIGITS = 20
_TYPE_NAMES = {str: "a string", dict: "an object", list: "a list"}
_REQUIRED = object()  # a field without a default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Fields:
    """Typed access to the fields of one JSON object; errors name the field."""

    def __init__(self, data: Any, source: str) -> None:
        if not isinstance(data, dict):
            raise PlanError(f"{source}: expected an object, got {_describe(data)}")
        self.data = data
        self.source = source

    def _missing(self, key: str) -> PlanError:
        return PlanError(f"{self.source} is corrupt: field {key!r} is missing")

    def _bad(self, key: str, expected: str) -> PlanError:
        return PlanError(f"{self.source}: field {key!r}: expected {expected}, got "
                         f"{_describe(self.data[key])}")

    def get(self, key: str, kind: type, default: Any = _REQUIRED) -> Any:
        if key not in self.data:
            if default is _REQUIRED:
                raise self._missing(key)
            return default
        if not isinstance(self.data[key], kind):
            raise self._bad(key, _TYPE_NAMES[kind])
        return self.data[key]

    def count(self, key: str) -> int:
        """An integer >= 0 (sizes in bytes, lengths)."""
        if key not in self.data:
            raise self._missing(key)
        value = self.data[key]
        if not _is_int(value) or value < 0:
            raise self._bad(key, "an integer >= 0")
        return value

    def seconds(self, key: str) -> float:
        """A finite number >= 0 (times, in the graph's time unit)."""
        if key not in self.data:
            raise self._missing(key)
        value = self.data[key]
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not math.isfinite(value) or value < 0):
            raise self._bad(key, "a finite number >= 0")
        return float(value)


def _steps(items: list[Any], source: str) -> list[Step]:
    steps: list[Step] = []
    for k, item in enumerate(items):
        if (not isinstance(item, list) or len(item) != 2 or item[0] not in ("compute", "free")
                or not _is_int(item[1]) or item[1] < 0):
            raise PlanError(f"{source}: schedule step {k} is malformed: {_shown(item)} (expected "
                            "[\"compute\" or \"free\", an id >= 0])")
        steps.append((item[0], item[1]))
    return steps


def _describe(value: Any) -> str:
    """A JSON value as in the graph reader's messages: ``a string "39"``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        kind = "a boolean"
    elif isinstance(value, (int, float)):
        kind = "a number"
    else:
        kind = _TYPE_NAMES.get(type(value), type(value).__name__)
    return f"{kind} {_shown(value)}"


def _shown(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:60] + "..."


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits is out of range")
    return int(digits)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def load_plan(path: str | os.PathLike[str], graph: "Graph | None" = None) -> Plan:
    """Read a plan written by ``Plan.save``; with ``graph``, also check that it belongs to it.

    Every failure to read, decode, parse or validate the file is a ``PlanError`` naming the
    file and what is wrong."""
    p = Path(path)
    source = f"plan file {p}"
    plan = Plan.from_dict(_parse_json(read_text_file(p, "plan", PlanError), source), source)
    if graph is not None:
        plan.check_graph(graph)
    return plan


def load_schedule_or_plan(path: str | os.PathLike[str], graph: "Graph") -> "Schedule":
    """A schedule file, or the schedule of a plan file (which must belong to ``graph``)."""
    from hrockmate.ir.schedule import Schedule

    p = Path(path)
    text = read_text_file(p, "schedule", PlanError)
    data = _parse_json(text, f"schedule file {p}")
    if isinstance(data, dict) and data.get("format") == PLAN_FORMAT:
        plan = Plan.from_dict(data, source=f"plan file {p}")
        plan.check_graph(graph)
        return plan.schedule
    try:
        return Schedule.from_json(text)
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None


def _parse_json(text: str, source: str) -> Any:
    """JSON as Python values; PlanError for invalid JSON, NaN or Infinity, numbers out of range
    and nesting too deep for Python."""
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float,
                          parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"{source} is corrupt (not valid JSON: {exc.msg} at line {exc.lineno}); "
            "delete it and solve again"
        ) from None
    except RecursionError:
        raise PlanError(f"{source} is corrupt (JSON nested too deeply); delete it and "
                        "solve again") from None
    except ValueError as exc:  # from the number hooks
        raise PlanError(f"{source} is corrupt ({exc}); delete it and solve again") from None


def _jsonable(value: Any) -> Any:
    """Statistics may hold numpy scalars; turn them into plain JSON values."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value
