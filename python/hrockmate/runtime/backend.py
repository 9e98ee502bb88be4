"""``torch.compile(model, backend="hrockmate", options={"budget": ...})``: hrockmate as a dynamo
backend.

Dynamo hands a backend the FX graph of the model's forward and the example values of its
inputs (parameters and buffers among them, lifted to graph inputs). The planner needs the
joint graph of forward and backward, so this backend does not plan the FX graph it is handed
directly: it wraps it as a module (``DynamoGraph``) whose parameters are the graph's
parameter inputs and whose forward takes the other inputs, and builds ``HRockmate`` over that
module with the first call's real inputs. ``HRockmate`` traces it (AOTAutograd's joint graph),
plans it for the budget and runs the plan, compiled by inductor by default (``compile=True``)
or eagerly (``"compile": False``), exactly as ``HRockmate(model, sample, budget)`` would on the
model itself. Dynamo's guards decide when a graph is compiled again (another input shape,
the training flag, grad mode), and each new graph gets its own plan.

What is refused: a graph that ends at a graph break (the budget is of the whole iteration,
and the pieces around a break would each be planned for it alone), and parameters other than
the ones the graph was built with. A graph compiled where nothing needs a gradient
(``torch.no_grad``, inference) has no backward to plan and is handed to inductor as is.

The backend registers itself under the name ``hrockmate`` when this module is imported (and
through the ``torch_dynamo_backends`` entry point of an installed hrockmate).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

__all__ = ["BackendError", "DynamoGraph", "built_modules", "hrockmate_backend"]

#: options the backend reads itself; every other option goes to ``HRockmate`` (``loss_fn``,
#: ``cache``, ``max_shapes``, solve options such as ``time_limit``)
_OWN = ("budget", "compile")


#: the ``HRockmate`` modules this backend built, oldest first (weakly: dynamo's cache owns
#: them), so that a caller can read their plans, budgets and measured peaks
_BUILT: list[weakref.ref[Any]] = []


def built_modules() -> list[Any]:
    """The ``HRockmate`` modules the backend has built in this process (one per graph dynamo
    compiled and then called) that are still alive, oldest first."""
    return [m for m in (r() for r in _BUILT) if m is not None]


class BackendError(RuntimeError):
    """A graph or call the ``hrockmate`` backend cannot plan; the message names the fix."""


class DynamoGraph(nn.Module):
    """Dynamo's FX graph ``gm`` as a module: the inputs at ``param_positions`` (the model's
    parameters, lifted to graph inputs by dynamo) are this module's parameters, so that
    ``HRockmate`` plans them as parameters (their gradients go to ``.grad``, the budget does
    not count those); ``forward`` takes the graph's other inputs in their order."""

    def __init__(self, gm: torch.fx.GraphModule, params: Sequence[nn.Parameter],
                 param_positions: Sequence[int], n_inputs: int) -> None:
        super().__init__()
        self.graph_module = gm
        self.n_params = len(params)
        for j, p in enumerate(params):
            self.register_parameter(f"p{j}", p)
        self.param_positions = list(param_positions)
        placed = set(self.param_positions)
        self.input_positions = [i for i in range(n_inputs) if i not in placed]

    def forward(self, *inputs: Any) -> Any:
        args: list[Any] = [None] * (len(inputs) + self.n_params)
        for i, v in zip(self.input_positions, inputs):
            args[i] = v
        # (read from the registry at each call: tracing swaps the registered parameters)
        for j, i in enumerate(self.param_positions):
            args[i] = self._parameters[f"p{j}"]
        return self.graph_module(*args)


def _is_graph_break(gm: torch.fx.GraphModule) -> bool:
    reason = getattr(gm, "compile_subgraph_reason", None)
    return bool(getattr(reason, "graph_break", False))


def _needs_grad(values: Sequence[Any]) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in values)


class _Planned:
    """The callable dynamo runs for one graph: ``HRockmate`` over ``DynamoGraph``, built at
    the first call from its real inputs (dynamo's example values may be fake, and planning
    measures the model on real ones). A graph dynamo made dynamic takes sizes as integer
    inputs; ``HRockmate`` traces with their values, so each set of values gets its own module
    (other tensor shapes with the same sizes are ``HRockmate``'s own per-shape programs)."""

    def __init__(self, gm: torch.fx.GraphModule, budget: Any, compiled: bool,
                 options: dict[str, Any]) -> None:
        self.gm = gm
        self.budget = budget
        self.compiled = compiled
        self.options = options
        self.modules: dict[tuple[Any, ...], Any] = {}
        self.params: list[nn.Parameter] | None = None
        self.positions: list[int] = []
        self.inputs: list[int] = []
        self.values: list[int] = []  # (positions of the non-tensor inputs: sizes)

    def build(self, args: Sequence[Any], values: tuple[Any, ...]) -> Any:
        from hrockmate.runtime.module import HRockmate

        module = DynamoGraph(self.gm, self.params or [], self.positions, len(args))
        sample = tuple(args[i] for i in self.inputs)
        hmod = HRockmate(module, sample, budget=self.budget, compile=self.compiled,
                         **self.options)
        _BUILT.append(weakref.ref(hmod))
        self.modules[values] = hmod
        return hmod

    def __call__(self, *args: Any) -> Any:
        if self.params is None:
            self.positions = [i for i, a in enumerate(args) if isinstance(a, nn.Parameter)]
            self.params = [args[i] for i in self.positions]
            placed = set(self.positions)
            self.inputs = [i for i in range(len(args)) if i not in placed]
            self.values = [i for i in self.inputs if not isinstance(args[i], torch.Tensor)]
        elif len(args) != len(self.positions) + len(self.inputs) or any(
                args[i] is not p for i, p in zip(self.positions, self.params)):
            raise BackendError(
                "the graph compiled by the hrockmate backend was called with other parameters "
                "than it was planned with (a parameter was replaced, or the compiled function "
                "is shared between models): call torch._dynamo.reset() after replacing "
                "parameters, or compile each model separately")
        values = tuple(args[i] for i in self.values)
        hmod = self.modules.get(values)
        if hmod is None:
            hmod = self.build(args, values)
        return hmod(*[args[i] for i in self.inputs])


def hrockmate_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                      options: dict[str, Any] | None = None, **_: Any) -> Callable[..., Any]:
    """The ``hrockmate`` dynamo backend: ``torch.compile(model, backend="hrockmate",
    options={"budget": 0.5})``. Options: ``budget`` (what ``HRockmate`` takes: a fraction of
    plain PyTorch's measured peak, bytes, or a string such as ``"2GiB"``; None plans
    store-all), ``compile`` (True, the default: the plan runs as inductor-compiled pieces;
    False: eagerly, bitwise plain PyTorch), and any other ``HRockmate`` keyword argument."""
    opts = dict(options or {})
    budget = opts.pop("budget", None)
    compiled = bool(opts.pop("compile", True))
    if _is_graph_break(gm):
        raise BackendError(
            "the hrockmate backend plans the whole training iteration as one graph, and dynamo "
            "broke this model's forward into several (a graph break: "
            "torch._dynamo.explain(model)(*inputs) names where). Remove the break, or build "
            "hrockmate.HRockmate(model, sample, budget, compile=True), which traces the model "
            "without dynamo")
    if not _needs_grad(example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(example_inputs))  # (no backward: nothing to plan)
    return _Planned(gm, budget, compiled, opts)


def _register() -> None:
    from torch._dynamo.backends import registry

    # an installed hrockmate's entry point registers the function when dynamo looks the name
    # up (it imports this module first): registering here too would be a duplicate
    if "hrockmate" in registry._COMPILER_FNS or registry._BACKENDS.get("hrockmate") is not None:
        return
    registry.register_backend(hrockmate_backend, name="hrockmate")


_register()
