"""The code the compiler writes per step: elementwise ops run in place into a first argument that
nothing reads again, as eager autograd accumulates gradients, with gradients bitwise equal."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn

import hrockmate
from hrockmate import models
from hrockmate.runtime import HRockmate
from hrockmate.runtime.compiler import REUSES_FIRST_ARGUMENT

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _TwoUsers(nn.Module):
    """``h`` feeds two layers, so its gradient is the sum of two terms (an ``add`` whose first
    term nothing reads afterwards); ``u`` is added to and then read again by a product."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        u = self.b(h)
        v = u + self.c(h)
        return (v * u).sum()


def _source(hm: HRockmate) -> str:
    prog = hm._hr_program
    return prog.forward.source + "".join(c.source for c in prog.chunks)


def _reused_ops(hm: HRockmate) -> set[int]:
    """Op ids the program calls through their in-place variant (``W<op>``)."""
    return {int(k) for k in re.findall(r"= W(\d+)\(", _source(hm))}


def _same_grads(model: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), f"grad of {name}"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, cuda])])
def test_a_gradients_first_term_takes_the_sum_in_place(device: str) -> None:
    torch.manual_seed(0)
    model, x = _TwoUsers().to(device), torch.randn(8, 16, device=device)
    ref = copy.deepcopy(model)
    hm = HRockmate(model, x)
    nodes, g = hm.traced.op_nodes, hm.traced.graph
    adds = [k for k, n in enumerate(nodes) if n.target is torch.ops.aten.add.Tensor]
    reused = _reused_ops(hm)
    # the backward's sum of h's two gradient terms runs in place
    assert any(g.ops[k].phase == "backward" for k in reused & set(adds))
    # the forward's u + c(h) does not: the product reads u afterwards
    (forward_add,) = [k for k in adds if g.ops[k].phase == "forward"]
    assert forward_add not in reused
    assert all(nodes[k].target in REUSES_FIRST_ARGUMENT for k in reused)
    hm(x).backward()
    ref(x).backward()
    _same_grads(model, ref)


def test_steps_in_place_keep_gradients_bitwise_and_the_peak_within_prediction() -> None:
    """A model with residual sums and dropout, at store-all and at a budget that recomputes:
    some steps run in place, gradients stay bitwise and the measured peak within the
    prediction."""
    for budget in (None, 0.5):
        model, sample = models.gpt2_tiny(n_layer=2, n_embd=32, seq=16, vocab=64, dropout=0.1)
        ref = copy.deepcopy(model)
        hm = HRockmate(model, sample, budget=budget)
        assert _reused_ops(hm), budget
        if budget is not None:
            assert hm._hr_program.recomputed_ops > 0
        for seed in (1, 2):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            hm(*sample).float().square().mean().backward()
            torch.manual_seed(seed)
            ref(*sample).float().square().mean().backward()
            _same_grads(model, ref)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            seed = torch.ones_like(hm(*sample))  # (made before: not the iteration's memory)

        def step() -> None:
            hm(*sample).backward(seed)

        step()
        model.zero_grad(set_to_none=True)
        peak = hrockmate.measure_peak_memory(step, params=list(model.parameters())).peak_bytes
        assert peak <= hm.predicted_peak_bytes, budget
