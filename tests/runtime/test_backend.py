"""The ``hrockmate`` torch.compile backend (``runtime.backend``).

The contract: ``torch.compile(model, backend="hrockmate", options={"budget": b})`` trains with
gradients within float tolerance of ``torch.compile(model)`` (inductor) when the plan runs
compiled (the default), bitwise equal to plain PyTorch with ``"compile": False``; every graph
dynamo compiles (another input shape: a recompile) is planned for the budget and its measured
peak fits it; graph breaks are refused with an error naming ``HRockmate(compile=True)``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hrockmate
from hrockmate import models
from hrockmate.runtime import backend
from hrockmate.runtime.backend import BackendError, built_modules, hrockmate_backend

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RTOL, ATOL = 1e-5, 1e-6
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train_step(module: Any, x: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = module(x).square().mean()
    loss.backward()
    return loss.detach()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _new_modules(before: int) -> list[Any]:
    return built_modules()[before:]


def test_the_backend_is_registered_by_name_and_entry_point() -> None:
    import tomllib

    assert "hrockmate" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("hrockmate") is hrockmate_backend
    # an installed hrockmate registers it without an import, through the entry point
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["torch_dynamo_backends"]["hrockmate"]
    module, _, name = target.partition(":")
    assert getattr(sys.modules[module], name) is hrockmate_backend


def test_compiled_plan_matches_torch_compile_and_fits_the_budget() -> None:
    model, x = models.mlp(batch=64, d_in=16, hidden=64, n_layers=3)
    plain = copy.deepcopy(model)
    before = len(built_modules())
    trained = torch.compile(model, backend="hrockmate",
                            options={"budget": 0.7, "progress": False})
    loss = _train_step(trained, x, model)
    (hmod,) = _new_modules(before)
    assert hmod.recomputed_ops > 0  # (a plan that recomputes, not store-all)
    assert hmod._compiled_program("pieces").pieces  # (run as inductor-compiled pieces)
    assert sorted(n for n, _ in hmod.named_parameters()) == [f"p{j}" for j in range(8)]

    reference = torch.compile(plain)
    want = _train_step(reference, x, plain)
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
    got, ref = _grads(model), _grads(plain)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=RTOL, atol=ATOL, msg=name)

    def step() -> None:  # (the .grad tensors exist: the budget does not count them)
        trained(x).square().mean().backward()
    peak = hrockmate.measure_peak_memory(step, params=list(model.parameters())).peak_bytes
    assert 0 < peak <= hmod.budget_bytes, (peak, hmod.budget_bytes)
    assert hmod.measured_peak_bytes <= hmod.budget_bytes
    assert len(_new_modules(before)) == 1  # (later calls run the same graph and plan)


def test_another_shape_recompiles_and_is_planned_for_the_budget() -> None:
    model, x = models.mlp(batch=64, d_in=16, hidden=64, n_layers=3)
    plain = copy.deepcopy(model)
    trained = torch.compile(model, backend="hrockmate",
                            options={"budget": 0.6, "compile": False, "progress": False})
    mods: list[Any] = []  # (held here: the backend keeps them weakly)
    for batch in (64, 96, 128):
        x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))
        _train_step(trained, x, model)
        _train_step(plain, x, plain)
        ref = _grads(plain)
        for name, g in _grads(model).items():  # (eager plans: bitwise plain PyTorch)
            assert torch.equal(g, ref[name]), (batch, name)
        hmod = built_modules()[-1]
        assert all(hmod is not m for m in mods)  # (a module of its own for this shape)
        mods.append(hmod)
        assert hmod.recomputed_ops > 0
        assert hmod.predicted_peak_bytes <= hmod.budget_bytes

        def step(x: torch.Tensor = x) -> None:
            trained(x).square().mean().backward()
        peak = hrockmate.measure_peak_memory(step, params=list(model.parameters())).peak_bytes
        assert peak <= hmod.budget_bytes, (batch, peak, hmod.budget_bytes)
    # one module per input shape: dynamo recompiled for the second (a graph with sizes as
    # inputs), whose third call planned again for its own sizes
    budgets = [m.budget_bytes for m in mods]
    assert budgets == sorted(budgets) and len(set(budgets)) == 3  # (0.6 of each shape's peak)


def test_a_graph_break_is_refused_naming_the_fix() -> None:
    class Breaks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.tanh(self.a(x))
            torch._dynamo.graph_break()
            return self.b(x)

    trained = torch.compile(Breaks(), backend="hrockmate", options={"budget": 0.5})
    with pytest.raises(Exception, match=r"graph break.*HRockmate\(model, sample, budget, "
                                        r"compile=True\)") as info:
        trained(torch.randn(4, 8))
    # (dynamo wraps what a backend raises in its BackendCompilerFailed, naming the type)
    assert isinstance(info.value, BackendError) or "BackendError" in str(info.value)


def test_without_gradients_the_graph_goes_to_inductor() -> None:
    model, x = models.mlp(batch=8, d_in=16, hidden=32, n_layers=2)
    before = len(built_modules())
    trained = torch.compile(model, backend="hrockmate", options={"budget": 0.5})
    with torch.no_grad():
        out = trained(x)
        want = model(x)
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)
    assert len(_new_modules(before)) == 0  # (no backward: nothing planned)


def test_replaced_parameters_are_refused() -> None:
    model, x = models.mlp(batch=8, d_in=16, hidden=32, n_layers=2)
    seen: list[Any] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[Any], **kw: Any) -> Any:
        seen.append((gm, list(example_inputs)))
        return hrockmate_backend(gm, example_inputs, **kw)

    trained = torch.compile(model, backend=capture,
                            options={"budget": None, "compile": False, "progress": False})
    trained(x).sum().backward()
    ((gm, inputs),) = seen
    assert sum(isinstance(a, torch.nn.Parameter) for a in inputs) == len(list(model.parameters()))
    planned = hrockmate_backend(gm, inputs, options={"compile": False, "progress": False})
    assert isinstance(planned, backend._Planned)
    planned(*inputs)
    swapped = [torch.nn.Parameter(a.detach().clone()) if isinstance(a, torch.nn.Parameter)
               else a for a in inputs]
    with pytest.raises(BackendError, match="other parameters"):
        planned(*swapped)

