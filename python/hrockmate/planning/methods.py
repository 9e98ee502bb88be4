"""Every planning method behind one signature, in a registry by name.

A method is ``solve(graph, budget, ctx) -> Candidate | Infeasible``: ``budget`` in bytes, ``ctx``
the try's ``SolveContext`` (a prepared hierarchy for ``"hrockmate"`` in ``ctx.hierarchy``). A
``Candidate`` holds a schedule with its simulated peak and time, within the budget; an
``Infeasible`` says the lowest peak the method reached (``min_bytes``; 0 when a try with a plan
in hand found nothing and did not look for one) and why. ``solve`` runs one by name.

What each method does when it finds nothing (the fallbacks: recompute-all, a lowest-peak MILP,
the simple strategies) is the policy's (``hrockmate.planning.policy``); the search over leaf
sizes and retries on top of the methods is ``hrockmate.planning.search``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from hrockmate.ir.graph import Graph
from hrockmate.planning import policy
from hrockmate.planning.context import SolveContext
from hrockmate.planning.policy import Candidate, run_method

__all__ = ["Candidate", "Infeasible", "Method", "METHODS", "check_method", "register", "solve"]


@dataclass(frozen=True)
class Infeasible:
    """A method found no schedule within the budget: the lowest peak it reached and why."""

    min_bytes: int
    why: str


Outcome = Union[Candidate, Infeasible]
Method = Callable[[Graph, int, SolveContext], Outcome]

#: name -> solve(graph, budget, ctx), in the order the error for an unknown name lists them.
METHODS: dict[str, Method] = {}


def register(name: str) -> Callable[[Method], Method]:
    """Register ``solve(graph, budget, ctx)`` as the method ``name``."""

    def add(fn: Method) -> Method:
        if name in METHODS:
            raise ValueError(f"a planning method named {name!r} is registered already")
        METHODS[name] = fn
        return fn

    return add


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")


def solve(method: str, graph: Graph, budget: int, ctx: SolveContext) -> Outcome:
    """Run the method ``method``: a candidate within ``budget``, simulated, or why none."""
    check_method(method)
    return METHODS[method](graph, budget, ctx)


def outcome(graph: Graph, method: str, budget: int,
            found: tuple[Candidate | None, int]) -> Outcome:
    """The registry's shape of ``policy.run_method``'s (candidate or None, lowest peak)."""
    cand, lowest = found
    if cand is None:
        return Infeasible(int(lowest), f"{method} found no schedule for '{graph.name}' within "
                                       f"{budget} bytes")
    return simulated(graph, cand)


def simulated(graph: Graph, cand: Candidate) -> Candidate:
    """``cand`` with its simulated peak and time filled in (once)."""
    if cand.peak is None or cand.time is None:
        cand.peak, cand.time = policy.simulate_steps(graph, cand.steps, cand.forward_len)
    return cand


def _by_policy(name: str) -> Method:
    def solve_one(graph: Graph, budget: int, ctx: SolveContext) -> Outcome:
        hierarchy = ctx.hierarchy if name == "hrockmate" else None
        return outcome(graph, name, budget, run_method(graph, name, budget, hierarchy, ctx))

    solve_one.__name__ = solve_one.__qualname__ = f"solve_{name.replace('-', '_')}"
    solve_one.__doc__ = f"The method {name!r} (``policy.run_method``)."
    return solve_one


# hrockmate: the hierarchy's H-ILP, never slower than the simple strategies;
# checkmate: the exact MILP over every op; checkpoint / selective: block checkpointing;
# greedy: DTR-style greedy eviction; twremat / rotor: the literature's solvers on the whole
# graph; recompute-all: the schedule of least memory
for _name in ("hrockmate", "checkmate", "checkpoint", "selective", "layers", "greedy",
              "twremat", "rotor", "recompute-all"):
    register(_name)(_by_policy(_name))


@register("store-all")
def solve_store_all(graph: Graph, budget: int, ctx: SolveContext) -> Outcome:
    """Plain autograd's schedule: every activation kept until its backward use."""
    steps, fl, peak, t = policy.baseline_schedule(graph)
    if peak > budget:
        return Infeasible(peak, "store-all keeps every activation until its backward use")
    cand = Candidate(steps, fl, True, {"method": "store-all"})
    cand.peak, cand.time = peak, t
    return cand
