"""Re-materialization solvers from the literature, run by the Rust core.

- :func:`twremat`: TW-Remat (Kumar et al., NeurIPS 2019), recursion over balanced separators of
  a tree decomposition; any graph; one (schedule, simulation) point per recursion depth.
- :func:`rotor`: Rotor (Beaumont et al.), the optimal dynamic program for heterogeneous chains;
  graphs whose forward ops split into a sequence of stages (see :func:`is_chain`).
- :func:`rotor_chain`: the same program on a chain described directly (:class:`ChainStage`),
  each stage with one or more ways (:class:`StateOption`) to keep what its backward needs.

Every returned schedule has been checked by the simulator. ``time_limit`` (seconds) bounds each
call (``hrockmate._native.TimeLimitError``, a TimeoutError, when it runs out), Ctrl-C stops it,
and Rotor's tables stay within ``max_table_bytes``
(``hrockmate._native.TooLargeError``, a MemoryError, when even the fewest useful memory slots
do not fit). See docs/literature-solvers.md.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from hrockmate.ir.graph import Graph
from hrockmate.ir.errors import (  # noqa: F401  (InfeasibleBudget: the error it raises)
    InfeasibleBudget,
    NotAChainError,
    infeasible_from_native,
    native_error_rules,
)
from hrockmate.ir.schedule import ErrorRule, Schedule, SimulationResult, call_native

__all__ = [
    "NotAChainError",
    "LiteratureSolverError",
    "TwRematPoint",
    "twremat",
    "rotor",
    "is_chain",
    "chain_stages",
    "StateOption",
    "ChainStage",
    "ChainPlan",
    "rotor_chain",
]


class LiteratureSolverError(RuntimeError):
    """A solver produced a schedule the simulator rejects (a bug; please report the graph)."""


@dataclass
class TwRematPoint:
    """One TW-Remat result: the schedule at ``depth_limit`` and its simulation."""

    depth_limit: int
    schedule: Schedule
    sim: SimulationResult


def _sim(d: dict[str, Any]) -> SimulationResult:
    return SimulationResult.from_native(d)


def _check_time_limit(time_limit: float | None) -> float | None:
    if time_limit is None:
        return None
    if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float)) or not (
        math.isfinite(time_limit) and time_limit >= 0
    ):
        raise ValueError(f"time_limit must be None or a number of seconds >= 0, got {time_limit!r}")
    return float(time_limit)


def _native_call(fn: Callable[..., Any], graph: Graph, requested_bytes: int = 0, **extra: Any) -> Any:
    """Call a native solver, turning its errors into this module's exceptions (TimeLimitError,
    TooLargeError and KeyboardInterrupt pass through)."""
    from hrockmate import _native

    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a hrockmate.Graph, got {type(graph).__name__}")
    errors: list[ErrorRule] = [
        *native_error_rules(requested_bytes, graph.name),
        (_native.InvalidArgumentError, lambda e: ValueError(str(e))),
        (_native.InternalError, lambda e: LiteratureSolverError(str(e))),
    ]
    return call_native(fn, graph, errors=errors, **extra)


def twremat(
    graph: Graph,
    depth_limit: int | None = None,
    *,
    max_steps: int | None = None,
    time_limit: float | None = None,
) -> list[TwRematPoint]:
    """TW-Remat schedules of ``graph``.

    With ``depth_limit=None``, one point per distinct schedule from depth 0 (store-all)
    towards the full recursion (least memory, most recomputation), in depth order, stopping
    at the first depth whose schedule would exceed ``max_steps`` steps (default: a few hundred
    per op). With an int, that single point (values above the recursion height act as the
    full recursion; exceeding an explicit ``max_steps`` raises ValueError). Points are not
    filtered: a deeper limit usually lowers the peak but is not guaranteed to.
    ``time_limit`` (seconds) bounds the whole call (``TimeLimitError`` when it runs out).
    """
    from hrockmate import _native

    if depth_limit is not None and (
        isinstance(depth_limit, bool) or not isinstance(depth_limit, int) or depth_limit < 0
    ):
        raise ValueError(f"depth_limit must be None or an int >= 0, got {depth_limit!r}")
    if max_steps is not None and (
        isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
    ):
        raise ValueError(f"max_steps must be None or an int >= 1, got {max_steps!r}")
    limits = None if depth_limit is None else [depth_limit]
    raw = _native_call(_native.twremat, graph, depth_limits=limits, max_steps=max_steps,
                       time_limit=_check_time_limit(time_limit))
    return [
        TwRematPoint(int(d), Schedule.from_arrays(kind, ids, fl), _sim(sim))
        for d, kind, ids, fl, sim in raw
    ]


DEFAULT_MAX_TABLE_BYTES = 2**30


def rotor(
    graph: Graph,
    budget_bytes: int,
    *,
    slots: int = 500,
    time_limit: float | None = None,
    max_table_bytes: int = DEFAULT_MAX_TABLE_BYTES,
) -> tuple[Schedule, SimulationResult]:
    """The fastest Rotor schedule of a chain-structured ``graph`` whose simulated peak is at
    most ``budget_bytes``.

    Memory is discretised into ``slots`` slots (more: closer to optimal, slower; the program
    costs O(stages^3 * slots) time and stages^2 * slots * 6 bytes of tables). The slots are
    reduced so that the tables fit ``max_table_bytes``; when even 16 slots do not fit,
    ``TooLargeError`` names the stage count and the bytes needed. ``time_limit`` (seconds)
    bounds the call (``TimeLimitError``). Raises NotAChainError for graphs without chain
    structure and InfeasibleBudget (with ``min_bytes``) when the budget is too small.
    """
    from hrockmate import _native

    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be an int >= 0 (bytes), got {budget_bytes!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    kind, ids, fl, sim = _native_call(
        _native.rotor, graph, budget_bytes, budget_bytes=budget_bytes, slots=slots,
        time_limit=_check_time_limit(time_limit),
        max_table_bytes=_nonneg_int(max_table_bytes, "max_table_bytes"),
    )
    return Schedule.from_arrays(kind, ids, fl), _sim(sim)


def chain_stages(graph: Graph) -> list[tuple[list[int], list[int]]]:
    """The stages Rotor sees: per stage, its forward op ids and backward op ids (execution
    order). Raises NotAChainError when there is no chain of at least two stages."""
    from hrockmate import _native

    return [(list(f), list(b)) for f, b in _native_call(_native.chain_stages, graph)]


def is_chain(graph: Graph) -> bool:
    """Whether ``graph``'s forward ops split into at least two stages, each reading only the
    previous stage's results and pre-existing tensors, with a compatible backward."""
    try:
        chain_stages(graph)
    except NotAChainError:
        return False
    return True


# --- Rotor on a chain given directly -------------------------------------------------------


@dataclass
class StateOption:
    """One way to run a stage's forward while keeping everything its backward needs (its full
    state), with the backward that goes with it. Times in any unit (all the same), sizes in
    bytes; ``state_bytes`` includes the stage output (raised to ``out_bytes`` if smaller)."""

    fwd_time: float
    state_bytes: int
    fwd_overhead: int
    bwd_time: float
    bwd_overhead: int


@dataclass
class ChainStage:
    """One stage of a chain: its plain forward (compute the output ``out_bytes`` only, with
    ``fwd_overhead`` extra bytes meanwhile), the bytes of the gradient its backward produces,
    and at least one :class:`StateOption`."""

    fwd_time: float
    out_bytes: int
    grad_bytes: int
    fwd_overhead: int
    options: list[StateOption] = field(default_factory=list)


@dataclass
class ChainPlan:
    """A Rotor sequence for a chain. ``ops`` holds ``(kind, stage, option)`` with kind one of
    ``"forward"``, ``"forward_all"``, ``"backward"``, ``"free"``, stage numbered from 1 and
    option the index in that stage's ``options`` for ``forward_all`` and ``backward`` (-1
    otherwise). ``time`` and ``peak_bytes`` are those of the chain model."""

    ops: list[tuple[str, int, int]]
    time: float
    peak_bytes: int
    slots: int = 0  # the memory slots the program ran with (fewer than asked if reduced to fit)


_OP_KINDS = ("forward", "forward_all", "backward", "free")
_U64_MAX = 2**64 - 1


def _nonneg_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int >= 0 (bytes), got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int >= 0 (bytes), got {value!r}") from None
    if not 0 <= v <= _U64_MAX:
        raise ValueError(f"{what} must be an int in 0..2**64-1 (bytes), got {v}")
    return v


def _time(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}") from None
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return v


def rotor_chain(
    stages: Sequence[ChainStage],
    limit_bytes: int,
    *,
    input_bytes: int = 0,
    final_grad_bytes: int = 0,
    slots: int = 500,
    time_limit: float | None = None,
    max_table_bytes: int = DEFAULT_MAX_TABLE_BYTES,
) -> ChainPlan:
    """The fastest Rotor sequence for a chain of ``stages`` whose peak, in the chain model, is
    at most ``limit_bytes``; for each full state it keeps, the program also picks the stage's
    :class:`StateOption`.

    ``input_bytes`` is the chain input (stored throughout), ``final_grad_bytes`` the gradient
    given to the last stage. Memory is discretised into ``slots`` slots (refined when rounding
    alone loses a limit the exact model meets). Raises ``hrockmate.ir.plan.InfeasibleBudget``
    (with ``min_bytes``, the exact smallest limit the program can meet) when the limit is too
    small, and ValueError naming the field at fault for bad input. ``time_limit`` and
    ``max_table_bytes`` bound the program as in :func:`rotor`.
    """
    from hrockmate import _native

    limit = _nonneg_int(limit_bytes, "limit_bytes")
    x0 = _nonneg_int(input_bytes, "input_bytes")
    g_last = _nonneg_int(final_grad_bytes, "final_grad_bytes")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    seconds = _check_time_limit(time_limit)
    table_limit = _nonneg_int(max_table_bytes, "max_table_bytes")
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence):
        raise ValueError(f"stages must be a list of ChainStage, got {type(stages).__name__}")
    fwd_time, out_bytes, grad_bytes, fwd_overhead = [], [], [], []
    ptr = [0]
    o_fwd, o_state, o_fo, o_bwd, o_bo = [], [], [], [], []
    for k, st in enumerate(stages):
        where = f"stages[{k}]"
        if not isinstance(st, ChainStage):
            raise ValueError(f"{where} must be a ChainStage, got {type(st).__name__}")
        fwd_time.append(_time(st.fwd_time, f"{where}.fwd_time"))
        out_bytes.append(_nonneg_int(st.out_bytes, f"{where}.out_bytes"))
        grad_bytes.append(_nonneg_int(st.grad_bytes, f"{where}.grad_bytes"))
        fwd_overhead.append(_nonneg_int(st.fwd_overhead, f"{where}.fwd_overhead"))
        opts = st.options
        if isinstance(opts, (str, bytes)) or not isinstance(opts, Sequence) or not opts:
            raise ValueError(f"{where}.options must be a non-empty list of StateOption")
        for i, opt in enumerate(opts):
            at = f"{where}.options[{i}]"
            if not isinstance(opt, StateOption):
                raise ValueError(f"{at} must be a StateOption, got {type(opt).__name__}")
            o_fwd.append(_time(opt.fwd_time, f"{at}.fwd_time"))
            o_state.append(_nonneg_int(opt.state_bytes, f"{at}.state_bytes"))
            o_fo.append(_nonneg_int(opt.fwd_overhead, f"{at}.fwd_overhead"))
            o_bwd.append(_time(opt.bwd_time, f"{at}.bwd_time"))
            o_bo.append(_nonneg_int(opt.bwd_overhead, f"{at}.bwd_overhead"))
        ptr.append(len(o_fwd))

    def f64(xs: list[float]) -> np.ndarray:
        return np.array(xs, dtype=np.float64)

    def u64(xs: list[int]) -> np.ndarray:
        return np.array(xs, dtype=np.uint64)

    try:
        raw = _native.rotor_chain(
            x0, g_last,
            f64(fwd_time), u64(out_bytes), u64(grad_bytes), u64(fwd_overhead),
            np.array(ptr, dtype=np.int64),
            f64(o_fwd), u64(o_state), u64(o_fo), f64(o_bwd), u64(o_bo),
            limit, slots, time_limit=seconds, max_table_bytes=table_limit,
        )
    except _native.InfeasibleError as exc:
        raise infeasible_from_native(exc, limit) from None
    except _native.InvalidArgumentError as exc:
        raise ValueError(str(exc)) from None
    except _native.InternalError as exc:
        raise LiteratureSolverError(str(exc)) from None
    ops = [
        (_OP_KINDS[int(kd)], int(k), int(o))
        for kd, k, o in zip(raw["op_kind"], raw["op_stage"], raw["op_option"])
    ]
    return ChainPlan(ops=ops, time=float(raw["time"]), peak_bytes=int(raw["peak_bytes"]),
                     slots=int(raw["slots"]))
