"""Schedules (sequences of compute/free steps) and the exact simulator (docs/graph-ir.md).

The rules and the memory model live in the Rust core; this module holds the Python objects,
their JSON form (format ``hrockmate-schedule`` version 1), and thin wrappers that hand a graph
and a schedule to ``hrockmate._native`` as flat numpy arrays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hrockmate.ir.graph import PREEXISTING_ROLES, Graph, GraphError, load_json_file, write_atomic

SCHEDULE_FORMAT = "hrockmate-schedule"
SCHEDULE_VERSION = 1
STEP_KINDS: tuple[str, ...] = ("compute", "free")
MAX_ID = 2**63 - 1  # ids cross into the core as int64
_KIND_SET = frozenset(STEP_KINDS)

Step = tuple[str, int]  # ("compute", op id) or ("free", tensor id)


class ScheduleError(ValueError):
    """A schedule breaks a rule on a graph. ``step`` is the index of the first bad step
    (``len(schedule)`` for problems found at the end); the message names the op or tensor."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


def _plain_steps(steps: list[Any]) -> bool:
    """Whether every step is already a ``(kind, id)`` tuple of a known kind and a plain int id
    in range (the planner's own schedules): checked in bulk, ~3x faster than step by step."""
    if not steps:
        return True
    if set(map(type, steps)) != {tuple} or set(map(len, steps)) != {2}:
        return False
    try:
        kinds = {k for k, _ in steps}
    except TypeError:  # an unhashable kind: the step-by-step check names it
        return False
    ids = [i for _, i in steps]
    return (kinds <= _KIND_SET and set(map(type, ids)) == {int}
            and min(ids) >= 0 and max(ids) <= MAX_ID)


def _checked_steps(steps: list[Any]) -> list[Step]:
    """The steps as ``(kind, int id)`` tuples, or ValueError naming the first bad one."""
    checked: list[Step] = []
    for i, step in enumerate(steps):
        try:
            kind, ident = step
        except (TypeError, ValueError):
            raise ValueError(
                f"schedule step {i}: expected a (kind, id) pair, got {step!r}"
            ) from None
        if kind not in STEP_KINDS:
            raise ValueError(
                f"schedule step {i}: kind must be 'compute' or 'free', got {kind!r}"
            )
        if isinstance(ident, bool) or not isinstance(ident, (int, np.integer)) or ident < 0:
            raise ValueError(f"schedule step {i}: id must be an integer >= 0, got {ident!r}")
        if ident > MAX_ID:
            raise ValueError(
                f"schedule step {i}: id {ident} is out of range (ids are at most 2^63-1)"
            )
        checked.append((kind, int(ident)))
    return checked


class Schedule:
    """A sequence of ``("compute", op_id)`` / ``("free", tensor_id)`` steps; the first
    ``forward_len`` steps run in the forward call, the rest in backward."""

    __slots__ = ("steps", "forward_len")

    def __init__(self, steps: Iterable[Step], forward_len: int) -> None:
        given = list(steps)
        checked = given if _plain_steps(given) else _checked_steps(given)
        if isinstance(forward_len, bool) or not isinstance(forward_len, (int, np.integer)):
            raise ValueError(f"forward_len must be an integer, got {forward_len!r}")
        if not 0 <= forward_len <= len(checked):
            raise ValueError(
                f"forward_len {forward_len} must be between 0 and the number of steps ({len(checked)})"
            )
        self.steps: list[Step] = checked
        self.forward_len: int = int(forward_len)

    # ---- container behaviour ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self.forward_len == other.forward_len and self.steps == other.steps

    def __repr__(self) -> str:
        n_compute = sum(1 for k, _ in self.steps if k == "compute")
        return (
            f"Schedule({len(self.steps)} steps, {n_compute} computes, "
            f"forward_len={self.forward_len})"
        )

    @property
    def forward_steps(self) -> list[Step]:
        return self.steps[: self.forward_len]

    @property
    def backward_steps(self) -> list[Step]:
        return self.steps[self.forward_len :]

    # ---- flat arrays -------------------------------------------------------------------------
    @classmethod
    def from_arrays(cls, step_kind: Any, step_id: Any, forward_len: int) -> "Schedule":
        kinds = np.asarray(step_kind)
        ids = np.asarray(step_id)
        if kinds.shape != ids.shape or kinds.ndim != 1:
            raise ValueError(
                f"step_kind and step_id must be 1-D arrays of equal length, got shapes "
                f"{kinds.shape} and {ids.shape}"
            )
        bad = np.flatnonzero((kinds != 0) & (kinds != 1))
        if bad.size:
            raise ValueError(
                f"step_kind item {int(bad[0])} is {kinds[bad[0]]}; 0 = compute, 1 = free"
            )
        if ids.size and int(ids.min()) < 0:
            raise ValueError(f"step_id item {int(np.argmin(ids))} is negative; ids are >= 0")
        forward_len = int(forward_len)
        if not 0 <= forward_len <= len(ids):
            raise ValueError(
                f"forward_len {forward_len} must be between 0 and the number of steps ({len(ids)})"
            )
        # Checked in bulk above, so the per-step checks of __init__ are skipped.
        obj = cls.__new__(cls)
        obj.steps = [(STEP_KINDS[k], i) for k, i in zip(kinds.tolist(), ids.tolist())]
        obj.forward_len = forward_len
        return obj

    def to_arrays(self) -> dict[str, Any]:
        """``step_kind`` int8, ``step_id`` int64 and ``forward_len``, as the bindings take them."""
        return {
            "step_kind": np.array(
                [0 if k == "compute" else 1 for k, _ in self.steps], dtype=np.int8
            ),
            "step_id": np.array([i for _, i in self.steps], dtype=np.int64),
            "forward_len": self.forward_len,
        }

    # ---- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SCHEDULE_FORMAT,
            "version": SCHEDULE_VERSION,
            "forward_len": self.forward_len,
            "steps": [[k, i] for k, i in self.steps],
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        """Parse schedule JSON; ValueError naming the field on bad input."""
        from hrockmate import _native

        kinds, ids, forward_len = _native.parse_schedule(text)
        return cls.from_arrays(kinds, ids, forward_len)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (temporary file + rename)."""
        write_atomic(Path(path), self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Schedule":
        return load_json_file(path, "schedule", cls.from_json, ValueError)

    # ---- readable form ---------------------------------------------------------------------
    def describe(self, graph: Graph) -> list[str]:
        """One line per step naming the op or tensor, e.g. ``compute mm_3`` (for debugging)."""
        lines = []
        for i, (kind, ident) in enumerate(self.steps):
            if i == self.forward_len:
                lines.append("-- backward --")
            items = graph.ops if kind == "compute" else graph.tensors
            name = items[ident].name if ident < len(items) else f"<id {ident} out of range>"
            lines.append(f"{kind} {name}")
        return lines


@dataclass
class SimulationResult:
    """What the simulator measured (bytes and the graph's time unit)."""

    peak_bytes: int
    time: float
    forward_peak: int
    backward_peak: int
    bytes_after_forward: int
    peak_step: int
    timeline: np.ndarray  # memory during each step (int64)
    compute_count: np.ndarray  # times each op is computed (int64)

    @classmethod
    def from_native(cls, d: dict[str, Any]) -> "SimulationResult":
        """From the dict the native simulator returns."""
        return cls(
            peak_bytes=int(d["peak_bytes"]),
            time=float(d["time"]),
            forward_peak=int(d["forward_peak"]),
            backward_peak=int(d["backward_peak"]),
            bytes_after_forward=int(d["bytes_after_forward"]),
            peak_step=int(d["peak_step"]),
            timeline=d["timeline"],
            compute_count=d["compute_count"],
        )


def _graph_names(graph: Graph) -> dict[str, list[str]]:
    return {
        "tensor_names": [t.name for t in graph.tensors],
        "op_names": [o.name for o in graph.ops],
    }


#: (native exception class, factory): how one caller turns a native error into its own exception.
ErrorRule = tuple[type[BaseException], Callable[[Any], BaseException]]


def _python_error(exc: BaseException, errors: Iterable[ErrorRule]) -> BaseException:
    """The Python exception for native error ``exc``: the caller's rule for it if any, else the
    graph/schedule defaults, else ``exc`` itself."""
    from hrockmate import _native

    for cls, make in errors:
        if isinstance(exc, cls):
            return make(exc)
    if isinstance(exc, _native.InvalidScheduleError):
        return ScheduleError(str(exc), exc.step)
    if isinstance(exc, _native.InvalidGraphError):
        return GraphError(str(exc))
    return exc


def call_native(fn: Callable[..., Any], graph: Graph, arrays: dict[str, Any] | None = None,
                *, errors: Iterable[ErrorRule] = (), **extra: Any) -> Any:
    """``fn(**extra, **arrays)`` (``arrays``: ``graph.to_arrays()`` unless given), with native
    errors turned into Python ones: ``errors`` first, then InvalidScheduleError -> ScheduleError,
    InvalidGraphError -> GraphError. The one way every wrapper calls the core.

    An error whose message names ops or tensors (invalid graph or schedule, not a chain) is
    answered by calling again with the names, so that the message names them (names cost a
    list per call, so they are sent only when needed). TimeLimitError, TooLargeError and
    KeyboardInterrupt pass through unless ``errors`` names them.
    """
    from hrockmate import _native

    errors = tuple(errors)
    named = (_native.InvalidGraphError, _native.InvalidScheduleError, _native.NotAChainError)
    if arrays is None:
        arrays = graph.to_arrays()
    try:
        return fn(**extra, **arrays)
    except named:
        pass
    except Exception as exc:
        new = _python_error(exc, errors)
        if new is exc:
            raise
        raise new from None
    try:
        fn(**extra, **arrays, **_graph_names(graph))
    except named as exc:
        new = _python_error(exc, errors)
        if new is exc:
            raise
        raise new from None
    raise AssertionError("native call failed without names but succeeded with them")


def simulate(graph: Graph, schedule: Schedule, *,
             graph_arrays: dict[str, np.ndarray] | None = None) -> SimulationResult:
    """Check ``schedule`` against every rule and measure its memory and time on ``graph``.

    ``graph_arrays``: ``graph.to_arrays()``, for callers simulating many schedules of one graph
    (26 ms per call on a 10k-op graph otherwise). Raises ScheduleError (with ``.step``) for a
    broken rule, GraphError for an invalid graph.
    """
    from hrockmate import _native

    arrays = graph.to_arrays() if graph_arrays is None else graph_arrays
    d = call_native(_native.simulate, graph, arrays, **schedule.to_arrays())
    return SimulationResult.from_native(d)


def store_all_schedule(graph: Graph) -> Schedule:
    """Plain autograd's schedule: every op once, each tensor freed after its last use."""
    from hrockmate import _native

    return Schedule.from_arrays(*call_native(_native.store_all, graph))


def recompute_all_schedule(graph: Graph) -> Schedule:
    """Forward keeps only the outputs; backward recomputes what each backward op needs.

    On long chains that is O(n^2) steps: a schedule of more than 20 million steps is refused
    with ``hrockmate._native.TooLargeError`` (a MemoryError) naming its size, before anything
    is allocated."""
    from hrockmate import _native

    return Schedule.from_arrays(*call_native(_native.recompute_all, graph))


# Roles every schedule must produce (docs/graph-ir.md, schedule rules).
# The results every schedule must produce and leave alive (the simulator's rule).
REQUIRED_ROLES = frozenset({"output", "param_grad", "input_grad", "buffer_update"})


def peak_lower_bound(graph: Graph) -> tuple[int, str]:
    """A peak no valid schedule of ``graph`` goes below, and why, in words.

    Every schedule computes the backward ops, the ops producing the required results and,
    transitively, the ops whose outputs those read. While one of them runs, what it reads is
    alive and what it produces is allocated, with its workspace (the simulator's rule); the
    largest such sum is the bound. It costs one pass over the graph, so a budget far too small
    is refused at once; the smallest feasible peak is often higher. ``graph`` must be valid.
    """
    tensors, ops = graph.tensors, graph.ops
    root = [-1] * len(tensors)  # storage owner of each tensor (-1: not known yet)
    for t in range(len(tensors)):
        chain, x = [t], t  # alias chains are acyclic in a valid graph
        while root[x] < 0 and (up := tensors[x].alias_of) is not None:
            chain.append(up)
            x = up
        owner = x if root[x] < 0 else root[x]
        for c in chain:
            root[c] = owner

    def counted(t: int) -> int:
        owner = tensors[root[t]]
        return 0 if owner.role in PREEXISTING_ROLES else int(owner.bytes)

    producer = graph.producers()
    todo = [i for i, op in enumerate(ops) if op.phase == "backward"]
    todo += [p for t, p in enumerate(producer)
             if p is not None and tensors[t].role in REQUIRED_ROLES]
    needed: set[int] = set()
    while todo:
        i = todo.pop()
        if i in needed:
            continue
        needed.add(i)
        todo += [p for t in ops[i].inputs if (p := producer[t]) is not None]
    best, best_op = 0, None
    for i in sorted(needed):
        op = ops[i]
        need = (int(op.workspace) + sum(counted(r) for r in {root[t] for t in op.inputs})
                + sum(counted(t) for t in op.outputs if tensors[t].alias_of is None))
        if need > best:
            best, best_op = need, i
    if best_op is None:
        return 0, "nothing has to be computed"
    return best, (f"op {best_op} '{ops[best_op].name}' alone needs that much while it runs: "
                  "what it reads, what it produces and its workspace")
