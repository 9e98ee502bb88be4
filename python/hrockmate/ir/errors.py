"""The planner's errors, and the one mapping of the native core's errors to them.

``InfeasibleBudget`` is the one "no schedule fits" error: it carries the smallest peak reached
or proven (``min_bytes``) and why (``reason``). The solvers' own signals of infeasibility
(``strategies.SolverInfeasible``, ``ilp.LevelInfeasible``) are subclasses of it, so a caller that
catches ``InfeasibleBudget`` sees them all; inside the planner they are caught by their own
class, as the fallbacks depend on which solver failed. ``native_error_rules`` turns the core's
errors (``_native.InfeasibleError``, ``_native.NotAChainError``, ...) into these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hrockmate.ir.budget import format_bytes

if TYPE_CHECKING:
    from hrockmate.ir.schedule import ErrorRule

__all__ = ["InfeasibleBudget", "NotAChainError", "infeasible_from_native", "native_error_rules"]


class InfeasibleBudget(ValueError):
    """No schedule fits the budget. ``min_bytes`` is the smallest peak the solver reached, or,
    when ``why`` is set, a lower bound on every schedule's peak that ``why`` explains (found
    before solving; the smallest reachable peak may be higher). ``reason`` says which, in
    words. ``proof`` (with no ``why``): why the peak reached is the least of any schedule;
    without it the peak reached is the least found, not proven minimal. ``proven_minimum``: the number
    is a proven floor (``why``) or a proven least peak (``proof``)."""

    def __init__(self, budget_bytes: int, min_bytes: int, graph_name: str = "",
                 why: str = "", proof: str = "") -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_bytes = int(min_bytes)
        self.graph_name = graph_name
        self.why = why
        self.proof = "" if why else proof
        where = f" for graph '{graph_name}'" if graph_name else ""
        minimum = f"{self.min_bytes} bytes ({format_bytes(self.min_bytes)})"
        budget = f"{self.budget_bytes} bytes ({format_bytes(self.budget_bytes)})"
        if why:  # a proven lower bound
            text = (f"budget of {budget} is below the smallest feasible peak{where}, which is at "
                    f"least {minimum} (a proven floor): {why}")
            self._reason = why
        else:  # the lowest peak the methods reached
            if self.proof:
                reached = (f"the lowest peak reached is {minimum}, proven the least possible: "
                           f"{self.proof}")
            else:
                reached = (f"the lowest peak reached is {minimum}, the least found (not proven "
                           "minimal)")
            text = f"no schedule was found within the budget of {budget}{where}: {reached}"
            self._reason = reached
        # (a floor is only a bound: a schedule reaching it is not known)
        more = " (a schedule may need more)" if why else ""
        super().__init__(f"{text}; give a budget of at least {self.min_bytes} bytes{more}")

    @property
    def proven_minimum(self) -> bool:
        """Whether ``min_bytes`` is proven: a floor no schedule goes below (``why``), or a
        least peak (``proof``)."""
        return bool(self.why or self.proof)

    def _as_solver_signal(self, message: str, min_bytes: int | None) -> None:
        """Set up a solver's subclass instance: ``message`` is its text and reason, and
        ``min_bytes`` is 0 where the solver does not know it."""
        self.budget_bytes = 0
        self.min_bytes = int(min_bytes or 0)
        self.graph_name = ""
        self.why = ""
        self.proof = ""
        self._reason = message
        ValueError.__init__(self, message)

    @property
    def reason(self) -> str:
        """Why no schedule fits: the proof of the floor, or what the solvers reached."""
        return self._reason


class NotAChainError(ValueError):
    """The graph has no chain structure that Rotor can use; the message names the op at fault."""


def infeasible_from_native(exc: Any, requested_bytes: int, graph_name: str = ""
                           ) -> InfeasibleBudget:
    """``_native.InfeasibleError`` (which has ``min_bytes``) as an ``InfeasibleBudget`` for a
    request of ``requested_bytes``."""
    return InfeasibleBudget(requested_bytes, exc.min_bytes, graph_name)


def native_error_rules(requested_bytes: int = 0, graph_name: str = "") -> list[ErrorRule]:
    """How the core's planning errors become the planner's: ``call_native(errors=...)``
    rules (``_native.InfeasibleError`` -> ``InfeasibleBudget``, ``_native.NotAChainError`` ->
    ``NotAChainError``)."""
    from hrockmate import _native

    return [
        (_native.NotAChainError, lambda e: NotAChainError(str(e))),
        (_native.InfeasibleError,
         lambda e: infeasible_from_native(e, requested_bytes, graph_name)),
    ]
