"""The kernels that run traced ops (``hrockmate.capture.kernels``): BatchNorm runs as eager does."""

from __future__ import annotations

import copy

import pytest
import torch

from hrockmate import models
from hrockmate.capture import kernels
from hrockmate.runtime import HRockmate

aten = torch.ops.aten


def _bn_args(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 5, 5, generator=gen)
    w, b = torch.rand(3, generator=gen) + 0.5, torch.randn(3, generator=gen)
    rm, rv = torch.randn(3, generator=gen), torch.rand(3, generator=gen) + 0.5
    return x, w, b, rm, rv


def test_batch_norm_forward_is_the_traced_op_and_leaves_the_statistics_alone() -> None:
    x, w, b, rm, rv = _bn_args()
    rm0, rv0 = rm.clone(), rv.clone()
    want = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
    got = kernels.kernel(aten._native_batch_norm_legit_functional.default, "cuda")(
        x, w, b, rm, rv, True, 0.1, 1e-5)
    assert len(got) == len(want) == 5
    for g, e in zip(got, want):
        assert torch.equal(g, e)
    # functional: the updated statistics are returned, the inputs are not written
    assert torch.equal(rm, rm0) and torch.equal(rv, rv0)
    assert not torch.equal(got[3], rm0)


@pytest.mark.parametrize("mask", [[True, True, True], [True, False, False], [False, True, True]])
def test_batch_norm_backward_is_the_traced_op(mask: list[bool]) -> None:
    x, w, b, rm, rv = _bn_args(1)
    out, mean, invstd, _, _ = kernels.kernel(aten._native_batch_norm_legit_functional.default,
                                             "cuda")(x, w, b, rm, rv, True, 0.1, 1e-5)
    grad = torch.randn_like(out)
    want = aten.native_batch_norm_backward.default(grad, x, w, rm, rv, mean, invstd, True, 1e-5,
                                                   mask)
    got = kernels.kernel(aten.native_batch_norm_backward.default, "cuda")(
        grad, x, w, rm, rv, mean, invstd, True, 1e-5, mask)
    for g, e, m in zip(got, want, mask):
        assert (g is None) == (not m) == (e is None)
        if m:
            assert torch.equal(g, e)


def test_other_ops_and_cpu_run_their_own_overload() -> None:
    bn = aten._native_batch_norm_legit_functional.default
    assert kernels.kernel(bn, "cpu") is bn._op
    assert kernels.kernel(aten.mm.default, "cuda") is aten.mm.default._op


def test_runtime_with_the_eager_batch_norm_kernels_trains_exactly(monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    """The CUDA kernel table wired through tracing, costs and the runtime, exercised on CPU
    (where ``_batch_norm_impl_index`` picks the native kernel): gradients and statistics stay
    bitwise eager's, with recomputation."""
    table = kernels._EAGER_CUDA
    real = kernels.kernel.__wrapped__
    # (costs, tracing and the runtime call kernels.run_node / op_kernel, which look
    # kernels.kernel up)
    monkeypatch.setattr(kernels, "kernel", lambda t, d: table[t] if t in table else real(t, d))
    model, x = models.cnn_bn(batch=4, image=8, width=8)
    ref = copy.deepcopy(model)
    hm = HRockmate(model, x, budget=0.6)
    assert hm.recomputed_ops > 0
    program = hm._hr_program
    used = {id(f) for seg in (program.forward, *program.chunks)
            for f in seg.fn.__globals__.values()}
    assert id(kernels._batch_norm_as_eager) in used
    assert id(kernels._batch_norm_backward_as_eager) in used
    for _ in range(2):
        hm(x).square().mean().backward()
        ref(x).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), name
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            assert torch.equal(b, c), name


def test_suggested_memory_format_follows_the_layout() -> None:
    x = torch.randn(2, 3, 4, 5)
    assert kernels._suggested_memory_format(x) == torch.contiguous_format
    assert kernels._suggested_memory_format(
        x.to(memory_format=torch.channels_last)) == torch.channels_last
    y = torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    assert kernels._suggested_memory_format(y) == torch.channels_last_3d
    assert kernels._suggested_memory_format(torch.randn(3, 4).t()) == torch.contiguous_format


def test_the_cudnn_path_hands_the_reserve_space_to_the_backward(monkeypatch: pytest.MonkeyPatch
                                                                  ) -> None:
    """Where ``_batch_norm_impl_index`` picks cuDNN (index 1), the forward's reserve space
    reaches ``cudnn_batch_norm_backward`` and only the requested gradients come back. cuDNN is
    stood in for by the native kernels, so this runs without a GPU."""
    reserves: list[torch.Tensor] = []

    class CudnnPicked:
        def __getattr__(self, name: str) -> object:
            return getattr(torch.ops.aten, name)

        def _batch_norm_impl_index(self, *args: object) -> tuple[object, ...]:
            out, mean, invstd, _, _ = torch.ops.aten._batch_norm_impl_index(*args)
            return out, mean, invstd, torch.empty(0, dtype=torch.uint8), 1

        def cudnn_batch_norm_backward(self, x, grad, w, rm, rv, mean, invstd, eps, reserve):
            reserves.append(reserve)
            assert grad.is_contiguous()
            return torch.ops.aten.native_batch_norm_backward.default(
                grad, x, w, rm, rv, mean, invstd, True, eps, [True, True, True])

    monkeypatch.setattr(kernels, "_aten", CudnnPicked())
    x, w, b, rm, rv = _bn_args(2)
    out, mean, invstd, _, _ = kernels._batch_norm_as_eager(x, w, b, rm, rv, True, 0.1, 1e-5)
    grad = torch.randn_like(out).transpose(2, 3).contiguous().transpose(2, 3)  # not contiguous
    got = kernels._batch_norm_backward_as_eager(grad, x, w, rm, rv, mean, invstd, True, 1e-5,
                                                [True, False, True])
    want = torch.ops.aten.native_batch_norm_backward.default(
        grad.contiguous(), x, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True])
    assert len(reserves) == 1 and reserves[0].numel() == 0
    assert got[1] is None
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def test_fused_attention_backwards_draw_no_random_numbers() -> None:
    """The memory-efficient and cuDNN attention backwards carry ATen's ``nondeterministic_seeded``
    tag but replay the forward's draw from its philox seed and offset: taking them for random
    ops failed every CUDA transformer with attention dropout ("runs random op
    '_scaled_dot_product_efficient_attention_backward' for the first time in the backward")."""
    aten = torch.ops.aten
    draws = [aten._scaled_dot_product_efficient_attention.default,
             aten._scaled_dot_product_cudnn_attention.default,
             aten._scaled_dot_product_flash_attention.default,
             aten.native_dropout.default, aten.bernoulli.p, aten.randn.default]
    given = [aten._scaled_dot_product_efficient_attention_backward.default,
             aten._scaled_dot_product_cudnn_attention_backward.default,
             aten._scaled_dot_product_flash_attention_backward.default,
             aten.native_dropout_backward.default, aten.mm.default]
    assert all(kernels.draws_random_numbers(op) for op in draws)
    assert not any(kernels.draws_random_numbers(op) for op in given)
    assert not kernels.draws_random_numbers(lambda x: x)  # (a plain function: no tags)


def test_the_cpu_flash_attention_draws_no_random_numbers() -> None:
    """It carries the ``nondeterministic_seeded`` tag but refuses any dropout: taken for a random
    op, every CPU transformer's attention was replayed with the generator's state kept for it
    (5 KB per op, which pushed a tiny Starcoder2's plan over its budget as compiled)."""
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    assert torch.Tag.nondeterministic_seeded in op.tags
    assert not kernels.draws_random_numbers(op)
    q = torch.randn(2, 2, 8, 4)
    state = torch.get_rng_state()
    op(q, q, q, 0.0, True)
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(RuntimeError, match="dropout"):  # if this ever runs, revisit the rule
        op(q, q, q, 0.1, True)
