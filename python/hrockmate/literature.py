"""Re-materialization solvers from the literature, run by the Rust core.

- :func:`twremat`: TW-Remat (Kumar et al., NeurIPS 2019), recursion over balanced separators of
  a tree decomposition; any graph; one (schedule, simulation) point per recursion depth.
- :func:`rotor`: Rotor (Beaumont et al.), the optimal dynamic program for heterogeneous chains;
  graphs whose forward ops split into a sequence of stages (see :func:`is_chain`).

Every returned schedule has been checked by the simulator. See docs/literature-solvers.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hrockmate.graph import Graph, GraphError
from hrockmate.plan import InfeasibleBudget
from hrockmate.schedule import Schedule, SimulationResult

__all__ = [
    "NotAChainError",
    "LiteratureSolverError",
    "TwRematPoint",
    "twremat",
    "rotor",
    "is_chain",
    "chain_stages",
]


class NotAChainError(ValueError):
    """The graph has no chain structure that Rotor can use; the message names the op at fault."""


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


def _native_call(fn: Callable[..., Any], graph: Graph, requested_bytes: int = 0, **extra: Any) -> Any:
    """Call a native solver, turning its (kind, message, min_bytes) errors into exceptions."""
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a hrockmate.Graph, got {type(graph).__name__}")
    arrays = graph.to_arrays()
    try:
        return fn(**extra, **arrays)
    except ValueError as exc:
        if len(exc.args) != 3:
            raise GraphError(str(exc)) from None
        kind, message, min_bytes = exc.args
    if kind in ("invalid_graph", "not_a_chain"):
        # Once more with names, so that the message names the op or tensor at fault (names
        # cost a list per call, so they are sent only when needed).
        try:
            fn(**extra, **arrays, tensor_names=[t.name for t in graph.tensors],
               op_names=[o.name for o in graph.ops])
        except ValueError as again:
            message = again.args[1] if len(again.args) == 3 else str(again)
    if kind == "invalid_graph":
        raise GraphError(message)
    if kind == "not_a_chain":
        raise NotAChainError(message)
    if kind == "infeasible":
        raise InfeasibleBudget(requested_bytes, int(min_bytes), graph.name)
    if kind == "invalid_argument":
        raise ValueError(message)
    raise LiteratureSolverError(message)


def twremat(
    graph: Graph, depth_limit: int | None = None, *, max_steps: int | None = None
) -> list[TwRematPoint]:
    """TW-Remat schedules of ``graph``.

    With ``depth_limit=None``, one point per distinct schedule from depth 0 (store-all)
    towards the full recursion (least memory, most recomputation), in depth order, stopping
    at the first depth whose schedule would exceed ``max_steps`` steps (default: a few hundred
    per op). With an int, that single point (values above the recursion height act as the
    full recursion; exceeding an explicit ``max_steps`` raises ValueError). Points are not
    filtered: a deeper limit usually lowers the peak but is not guaranteed to.
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
    raw = _native_call(_native.twremat, graph, depth_limits=limits, max_steps=max_steps)
    return [
        TwRematPoint(int(d), Schedule.from_arrays(kind, ids, fl), _sim(sim))
        for d, kind, ids, fl, sim in raw
    ]


def rotor(graph: Graph, budget_bytes: int, *, slots: int = 500) -> tuple[Schedule, SimulationResult]:
    """The fastest Rotor schedule of a chain-structured ``graph`` whose simulated peak is at
    most ``budget_bytes``.

    Memory is discretised into ``slots`` slots (more: closer to optimal, slower; the program
    costs O(stages^3 * slots)). Raises NotAChainError for graphs without chain structure and
    InfeasibleBudget (with ``min_bytes``) when the budget is too small.
    """
    from hrockmate import _native

    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
        raise ValueError(f"budget_bytes must be an int >= 0 (bytes), got {budget_bytes!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ValueError(f"slots must be an int >= 1, got {slots!r}")
    kind, ids, fl, sim = _native_call(
        _native.rotor, graph, budget_bytes, budget_bytes=budget_bytes, slots=slots
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
