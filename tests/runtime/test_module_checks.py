"""What HRockmate checks about the model at every call: trainable parameters and training flags
are followed (traced and planned again), edits of the model are refused with a clear error."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hrockmate import models
from hrockmate.runtime import HRockmate, ModelChangedError


def _mlp() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(5, 8)


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    got, want = _grads(model), _grads(reference)
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            assert torch.equal(got[name], want[name]), name


# ---- requires_grad changed after building --------------------------------------------------------
def test_parameters_unfrozen_after_building_get_gradients(caplog: pytest.LogCaptureFixture) -> None:
    m, x = _mlp()
    m.requires_grad_(False)
    m[2].requires_grad_(True)
    h = HRockmate(m, x, cache=False)
    assert set(h.traced.param_grads) == {"2.weight", "2.bias"}
    h.requires_grad_(True)
    reference = copy.deepcopy(m)
    with caplog.at_level(logging.WARNING, logger="hrockmate.runtime"):
        h(x).sum().backward()
    reference(x).sum().backward()
    _assert_same_grads(m, reference)
    assert all(p.grad is not None for p in m.parameters())
    assert "parameter '0.weight' now requires grad" in caplog.text
    assert set(h.traced.param_grads) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_parameters_frozen_after_building_get_no_gradient() -> None:
    m, x = models.mlp(batch=16, d_in=32, hidden=64, n_layers=4, d_out=8)
    h = HRockmate(m, x, budget=0.8, cache=False, progress=False)
    m[0].requires_grad_(False)
    reference = copy.deepcopy(m)
    h(x).sum().backward()
    reference(x).sum().backward()
    _assert_same_grads(m, reference)
    assert m[0].weight.grad is None and m[2].weight.grad is not None
    assert h.plan.method != "store-all"  # planned again for the same budget


def test_frozen_everything_runs_the_plain_model() -> None:
    m, x = _mlp()
    h = HRockmate(m, x, cache=False)
    m.requires_grad_(False)
    out = h(x)
    assert not out.requires_grad and torch.equal(out, m(x))


def test_a_fixed_plan_is_not_replanned_when_requires_grad_changes() -> None:
    m, x = _mlp()
    plan = HRockmate(m, x, cache=False).plan
    h = HRockmate(m, x, plan=plan)
    m[0].bias.requires_grad_(False)
    with pytest.raises(ModelChangedError,
                       match=r"parameter '0.bias' no longer requires grad.*fixed plan="):
        h(x)


# ---- training flags changed after building -------------------------------------------------------
def test_model_traced_in_eval_mode_is_traced_again_for_training() -> None:
    model, sample = models.gpt2_tiny(n_layer=1, n_embd=16, seq=8, vocab=32, dropout=0.3)
    model.eval()
    h = HRockmate(model, sample, cache=False)
    h.train()
    reference = copy.deepcopy(model)
    torch.manual_seed(7)
    loss = h(*sample)
    loss.backward()
    torch.manual_seed(7)
    ref_loss = reference(*sample)
    ref_loss.backward()
    assert torch.equal(loss.detach(), ref_loss.detach())  # dropout active, same numbers
    _assert_same_grads(model, reference)


def test_submodule_switched_to_eval_is_followed() -> None:
    model, x = models.cnn_bn(batch=2, image=4, width=4)
    h = HRockmate(model, x, cache=False)
    frozen_bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    frozen_bn.eval()  # e.g. frozen BatchNorm statistics while fine-tuning
    reference = copy.deepcopy(model)
    h(x).sum().backward()
    reference(x).sum().backward()
    _assert_same_grads(model, reference)
    for (name, b), (_, c) in zip(model.named_buffers(), reference.named_buffers()):
        assert torch.equal(b, c), name


# ---- edits of the model --------------------------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc(x)))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: setattr(m, "act", nn.ReLU()), r"module 'act' was replaced \(GELU -> ReLU\)"),
        (lambda m: setattr(m.fc, "bias", None), r"parameter 'fc.bias' was removed"),
        (lambda m: delattr(m.fc, "bias"), r"parameter 'fc.bias' was removed"),
        (lambda m: setattr(m, "extra", nn.Linear(2, 2)), r"module 'extra' \(Linear\) was added"),
        (lambda m: setattr(m.fc, "weight", nn.Parameter(torch.zeros(8, 8, 1))),
         r"parameter 'fc.weight' changed shape from \(8, 8\) to \(8, 8, 1\)"),
        (lambda m: m.head.double(), r"parameter 'head.weight' changed dtype"),
        (lambda m: m.fc.register_buffer("scale", torch.ones(1)), r"buffer 'fc.scale' was added"),
    ],
    ids=["replaced", "bias-none", "bias-deleted", "added", "shape", "dtype", "buffer"],
)
def test_edited_model_is_refused(edit: Any, message: str) -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8)
    h = HRockmate(model, x, cache=False)
    edit(model)
    with pytest.raises(ModelChangedError, match="the model changed since it was traced: ") as err:
        h(x)
    assert "rebuild HRockmate" in str(err.value)
    assert err.match(message)


def test_appended_layer_is_refused() -> None:
    m, x = _mlp()
    h = HRockmate(m, x, cache=False)
    m.append(nn.Tanh())
    with pytest.raises(ModelChangedError, match=r"module '3' \(Tanh\) was added"):
        h(x)


def test_reordered_layers_are_refused() -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(4, 8)
    h = HRockmate(m, x, cache=False)
    m._modules = dict(sorted(m._modules.items(), key=lambda kv: kv[0] in ("1", "3")))
    h._modules = m._modules
    with pytest.raises(ModelChangedError, match="the order or nesting of its modules changed"):
        h(x)


def test_untied_parameters_are_refused() -> None:
    model, sample = models.gpt2_tiny(n_layer=1, n_embd=16, seq=8, vocab=32)
    h = HRockmate(model, sample, cache=False)
    assert model.lm_head.weight is model.wte.weight
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    with pytest.raises(ModelChangedError, match=r"parameter 'lm_head.weight' was tied to "
                                                r"'wte.weight' when traced and is not tied now"):
        h(*sample)


def test_same_shaped_parameter_replacement_is_used() -> None:
    """The runtime reads parameters from their modules at each call (as FSDP2 swaps them in), so
    a replacement of the same shape, dtype and device is no edit: it is used."""
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8)
    h = HRockmate(model, x, cache=False)
    model.fc.weight = nn.Parameter(torch.randn(8, 8))
    reference = copy.deepcopy(model)
    out = h(x)
    assert torch.equal(out, reference(x))
    out.sum().backward()
    reference(x).sum().backward()
    _assert_same_grads(model, reference)


def test_edits_in_eval_mode_run_the_model_as_it_is() -> None:
    torch.manual_seed(0)
    model, x = _Net(), torch.randn(4, 8)
    h = HRockmate(model, x, cache=False)
    model.act = nn.ReLU()
    h.eval()
    assert torch.equal(h(x), model.head(F.relu(model.fc(x))))


# ---- a model that edits itself in its forward -----------------------------------------------
class _SwitchesOnShortInputs(nn.Module):
    """Like transformers' BigBird: on its first short input the forward replaces its attention
    module by another kind holding the same submodules (and parameters), then runs it."""

    class _Sparse(nn.Module):
        def __init__(self, proj: nn.Linear) -> None:
            super().__init__()
            self.proj = proj

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.proj(x))

    class _Full(_Sparse):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.gelu(self.proj(x)) * x

    def __init__(self) -> None:
        super().__init__()
        self.attn = self._Sparse(nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.attn, self._Full):
            self.attn = self._Full(self.attn.proj)
        return self.head(self.attn(x) + x).square().mean()


def test_a_model_that_edits_itself_once_in_its_forward_is_followed(
        caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, x = _SwitchesOnShortInputs(), torch.randn(16, 8)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="hrockmate"):
        h = HRockmate(model, x, cache=False)
    assert "the model changed itself while it was traced (module 'attn' was replaced " \
           "(_Sparse -> _Full))" in caplog.text
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):  # (the first call used to raise ModelChangedError)
        batch = torch.randn(16, 8) if step else x
        loss, ref_loss = h(batch), reference(batch)
        assert torch.equal(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        _assert_same_grads(model, reference)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()



# ---- the per-call check itself ---------------------------------------------------------------
def _tied_net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = _Net()
    model.register_buffer("steps", torch.zeros(3))
    model.fc2 = nn.Linear(8, 8)
    model.fc2.weight = model.fc.weight  # tied: appears twice in the module tree
    return model, torch.randn(4, 8)


_EDITS = {
    "nothing": lambda m: None,
    "train flag": lambda m: m.act.eval(),
    "requires_grad": lambda m: m.fc.bias.requires_grad_(False),
    "data reshaped in place": lambda m: setattr(m.head.weight, "data", torch.zeros(2, 9)),
    "data cast in place": lambda m: setattr(m.head.bias, "data", m.head.bias.data.double()),
    "data strided in place": lambda m: setattr(m.fc.weight, "data", torch.zeros(8, 8).t()),
    "same-shaped parameter": lambda m: setattr(m.head, "weight", nn.Parameter(torch.ones(2, 8))),
    "same-shaped buffer": lambda m: setattr(m, "steps", torch.ones(3)),
    "untied": lambda m: setattr(m.fc2, "weight", nn.Parameter(torch.ones(8, 8))),
    "module replaced": lambda m: setattr(m, "act", nn.GELU()),
    "buffer added": lambda m: m.act.register_buffer("x", torch.ones(1)),
    "child renamed": lambda m: setattr(m, "_modules",
                                       {("tail" if k == "head" else k): v
                                        for k, v in m._modules.items()}),
}


@pytest.mark.parametrize("without_guard", [False, True], ids=["fast path", "fingerprint only"])
@pytest.mark.parametrize("edit", list(_EDITS))
def test_the_per_call_check_agrees_with_the_fingerprint(
        edit: str, without_guard: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_ModelCheck`` answers the common case (nothing changed) from C-level loops and
    TorchDynamo's tensor guard; whatever the edit, its answer is the full fingerprint's, and after
    a change the fingerprint accepts (a same-shaped replacement) the fast path answers again."""
    from hrockmate.runtime import module as runtime_module

    if without_guard:  # (a torch without the guard class: the fingerprint decides every call)
        monkeypatch.setattr(runtime_module, "_TensorGuards", None)
    model, _ = _tied_net()
    check = runtime_module._ModelCheck(model)
    if not without_guard and runtime_module._TensorGuards is not None:
        assert check._fast()
    assert check.matches(model)
    _EDITS[edit](model)
    same = runtime_module._model_fingerprint(model) == check.fingerprint
    assert check.matches(model) == same
    # (strides are not part of the fingerprint: a transposed copy of the same shape is no edit)
    assert same == (edit in ("nothing", "same-shaped parameter", "same-shaped buffer",
                             "data strided in place"))
    if same and not without_guard and runtime_module._TensorGuards is not None:
        assert check._fast()  # the accepted state is the new reference
    if not same:
        assert not check.matches(model)  # (and stays refused: no reference was taken)
