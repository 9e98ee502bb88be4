"""One HRockmate for every input shape (each new shape traced and planned in its first call,
kept in a bounded LRU, reusing what other shapes learned), and changes the module follows
planned for the bytes the user asked for, warning where no plan fits instead of raising."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import hrockmate
from hrockmate import models
from hrockmate.ir.schedule import peak_lower_bound
from hrockmate.runtime import HRockmate, InputMismatchError, OverBudgetWarning
from hrockmate.runtime import shapes
from hrockmate.capture.baseline import traced_store_all_peak


def _assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def _assert_same_buffers(model: nn.Module, reference: nn.Module) -> None:
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), name


def _step_both(hm: HRockmate, model: nn.Module, ref: nn.Module, args: tuple[Any, ...],
               seed: int = 0, loss_of: Any = lambda out: out) -> None:
    """One training step of the module and of the plain model from the same generator state
    and cleared gradients: losses and gradients bitwise equal."""
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_of(hm(*args))
    loss.backward()
    torch.manual_seed(seed)
    ref_loss = loss_of(ref(*args))
    ref_loss.backward()
    assert torch.equal(loss.detach(), ref_loss.detach())
    _assert_same_grads(model, ref)


def _measured_peak(hm: HRockmate, model: nn.Module, args: tuple[Any, ...],
                   loss_of: Any = lambda out: out) -> int:
    def step() -> Any:
        loss = loss_of(hm(*args))
        loss.backward()
        return loss

    model.zero_grad(set_to_none=True)
    return hrockmate.measure_peak_memory(step, params=list(model.parameters())).peak_bytes


class _Solves:
    """Counts solver calls (``solve_graph``, as the runtime calls it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import hrockmate.planning.api as api

        self.calls = 0
        real = api.solve_graph

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(api, "solve_graph", counted)


# ---- dynamic padding, a smaller last batch -----------------------------------------------------
def test_dynamic_padding_on_hf_gpt2_trains_bitwise_within_each_budget(
        caplog: pytest.LogCaptureFixture) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=128,
                                     vocab_size=64, resid_pdrop=0.1, embd_pdrop=0.1,
                                     attn_pdrop=0.1)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.train()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)

    def batch(seq: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (2, seq), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}

    first = batch(64)
    hm = HRockmate(model, first, budget=0.6, loss_fn="loss", cache=False, progress=False)
    for step, seq in enumerate((64, 96, 128, 80, 96)):
        inputs = first if step == 0 else batch(seq)
        with caplog.at_level(logging.INFO, logger="hrockmate.runtime"):
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = hm(**inputs)
            out.loss.backward()
            torch.manual_seed(step)
            ref_out = ref(**inputs)
            ref_out.loss.backward()
        assert torch.equal(out.loss.detach(), ref_out.loss.detach()), seq
        _assert_same_grads(model, ref)
        assert hm.planned_shapes[0] == ((2, seq), (2, seq))
        # a fraction is of each shape's own baseline (the smaller of plain PyTorch's measured
        # peak and the traced store-all's), and every plan keeps within it
        eager = hm.plan.eager_peak_bytes
        traced = traced_store_all_peak(hm.traced.graph)
        assert eager is not None
        assert hm.budget_bytes == hrockmate.parse_budget(0.6, min(eager, traced))
        assert hm.predicted_peak_bytes <= hm.budget_bytes, seq
        def step_fn() -> Any:
            o = hm(**inputs)
            o.loss.backward()
            return o

        model.zero_grad(set_to_none=True)
        got = hrockmate.measure_peak_memory(step_fn, params=list(model.parameters())).peak_bytes
        assert got <= hm.budget_bytes and got <= 1.05 * hm.predicted_peak_bytes, seq
    assert "input shape (2, 96), (2, 96) was traced and planned in" in caplog.text
    assert "planned before; switched to its program" in caplog.text  # the last 96
    assert len(hm.planned_shapes) == 4


def test_a_smaller_last_batch_on_a_cnn_with_batchnorm_keeps_buffers_bitwise() -> None:
    model, x = models.cnn_bn(batch=8, image=16, width=8)
    ref = copy.deepcopy(model)
    hm = HRockmate(model, x, budget=0.7, cache=False, progress=False)
    last = torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    for step, inputs in enumerate((x, last, x, last)):
        _step_both(hm, model, ref, (inputs,), seed=step, loss_of=lambda out: out.sum())
        _assert_same_buffers(model, ref)
        assert hm.predicted_peak_bytes <= hm.budget_bytes
    assert hm.planned_shapes == [((5, 3, 16, 16),), ((8, 3, 16, 16),)]
    assert hm.__dict__["_hr_shapes"].planned == 1  # the last two calls traced nothing


def test_the_programs_held_are_bounded_by_max_shapes(caplog: pytest.LogCaptureFixture) -> None:
    model, _ = models.mlp(batch=4, d_in=8, hidden=16, n_layers=2, d_out=4)
    ref = copy.deepcopy(model)
    hm = HRockmate(model, torch.randn(4, 8), max_shapes=2, cache=False)
    programs = hm.__dict__["_hr_shapes"]
    for n in (5, 6, 7, 4):
        x = torch.randn(n, 8)
        with caplog.at_level(logging.INFO, logger="hrockmate.runtime"):
            _step_both(hm, model, ref, (x,), loss_of=lambda out: out.square().mean())
        assert len(hm.planned_shapes) <= 2
    # 4 was dropped (least recently used) before it came back: traced and planned again
    assert programs.planned == 4 and "dropped the program of input shape (4, 8)" in caplog.text
    assert hm.planned_shapes == [((4, 8),), ((7, 8),)]
    with pytest.raises(ValueError, match="max_shapes must be a whole number >= 1"):
        HRockmate(model, torch.randn(4, 8), max_shapes=0, cache=False)


# ---- what still raises ---------------------------------------------------------------------------
def test_strict_shapes_and_fixed_plans_refuse_a_new_shape() -> None:
    model, x = models.mlp(batch=4, d_in=8, hidden=16, n_layers=2, d_out=4)
    strict = HRockmate(model, x, strict_shapes=True, cache=False)
    with pytest.raises(InputMismatchError,
                       match=r"args\[0\].*shape \(4, 8\).*shape \(6, 8\).*strict_shapes=True"):
        strict(torch.randn(6, 8))
    fixed = HRockmate(model, x, plan=strict.plan)
    with pytest.raises(InputMismatchError, match=r"shape \(6, 8\).*fixed plan="):
        fixed(torch.randn(6, 8))
    strict(x).sum().backward()  # the sample's shape still trains


def test_another_dtype_device_or_structure_still_raises_with_another_shape() -> None:
    model, x = models.mlp(batch=4, d_in=8, hidden=16, n_layers=2, d_out=4)
    hm = HRockmate(model, x, cache=False)
    with pytest.raises(InputMismatchError, match=r"args\[0\].*dtype torch.float32.*float64"):
        hm(torch.randn(6, 8, dtype=torch.float64))
    with pytest.raises(InputMismatchError, match="structure"):
        hm(torch.randn(6, 8), torch.randn(6, 8))
    assert hm.planned_shapes == [((4, 8),)]  # nothing was traced for those calls


# ---- reuse ---------------------------------------------------------------------------------------
def test_a_new_shape_of_the_same_structure_reuses_the_schedule_without_solving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = models.mlp(batch=16, d_in=32, hidden=64, n_layers=4, d_out=8)
    ref = copy.deepcopy(model)
    probe = HRockmate(model, x, cache=False)
    budget = int(0.6 * probe.predicted_peak_bytes)
    hm = HRockmate(model, x, budget=budget, cache=False, progress=False)
    assert hm.plan.method != "store-all" and hm.budget_bytes == budget
    solves = _Solves(monkeypatch)
    small = torch.randn(12, 32)
    _step_both(hm, model, ref, (small,), loss_of=lambda out: out.square().mean())
    assert solves.calls == 0  # the held schedule, simulated at batch 12, fits
    assert hm.plan.stats["reused_from_shape"] == [[16, 32]]
    assert hm.schedule.steps == list(hm.__dict__["_hr_shapes"].entries[((16, 32),)]
                                      ["_hr_schedule"].steps)
    assert hm.budget_bytes == budget  # bytes stay bytes
    assert hm.predicted_peak_bytes <= budget
    got = _measured_peak(hm, model, (small,), loss_of=lambda out: out.square().mean())
    assert got <= budget
    # op times came scaled from batch 16's measured ones, not measured again
    assert hm.traced.graph.meta["cost_report"]["source"] == "scaled"
    assert hm.__dict__["_hr_shapes"].reused == 1


def test_a_shape_the_held_schedule_does_not_fit_solves_over_its_blocks_re_costed(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import hrockmate.planning.api as api

    model, x = models.mlp(batch=16, d_in=32, hidden=64, n_layers=8, d_out=8)
    ref = copy.deepcopy(model)
    probe = HRockmate(model, x, cache=False)
    assert probe.traced.graph.num_ops > 60  # (solved over a hierarchy of blocks)
    budget = int(0.5 * probe.predicted_peak_bytes)
    hm = HRockmate(model, x, budget=budget, cache=False, progress=False)
    prepares: list[Any] = []
    monkeypatch.setattr(api, "prepare", lambda *a, **k: prepares.append(a) or None)
    solves = _Solves(monkeypatch)
    big = torch.randn(20, 32)
    with caplog.at_level(logging.INFO, logger="hrockmate.runtime"):
        _step_both(hm, model, ref, (big,), loss_of=lambda out: out.square().mean())
    assert solves.calls >= 1 and not prepares  # the top level alone was solved
    assert "re-costed at shape (20, 32)" in caplog.text
    assert "reused_from_shape" not in hm.plan.stats
    assert hm.plan.stats["blocks_recosted_from_shape"] == [[16, 32]]
    assert hm.predicted_peak_bytes <= budget == hm.budget_bytes


def test_recosted_blocks_cost_what_the_new_graph_says() -> None:
    from hrockmate.capture.trace import trace_model
    from hrockmate.planning.api import with_hierarchy
    from hrockmate.planning.level import option_from_steps

    model, x = models.mlp(batch=16, d_in=32, hidden=64, n_layers=8, d_out=8)
    a = trace_model(model, x, cost="estimate").graph
    b = trace_model(model, torch.randn(24, 32), cost="estimate").graph
    assert shapes.structure_signature(a) == shapes.structure_signature(b)
    assert a.structure_hash() != b.structure_hash()
    h = with_hierarchy(a, {"progress": False})["hierarchy"]
    h = h[0] if isinstance(h, list) else h
    moved = shapes.recosted_hierarchy(h, b)
    assert moved.graph is b and h.graph is a
    pairs = [(h.root, moved.root)]
    checked = 0
    while pairs:
        old, new = pairs.pop()
        pairs.extend(zip(old.children, new.children))
        if old.is_root:
            continue
        assert len(new.options) == len(old.options)
        for o in new.options:
            again = option_from_steps(moved.ctx, new, o.fwd, o.bwd, o.saved)
            assert again.key() == o.key()
            checked += 1
        # the activations grow with the batch: some saved bytes grew
        assert max(o.saved_bytes for o in new.options) > max(o.saved_bytes for o in old.options)
    assert checked > 0


# ---- changes the module follows --------------------------------------------------------------
class _Branchy(nn.Module):
    """A branch on the inputs' values: the wide path needs far more memory than the narrow."""

    def __init__(self) -> None:
        super().__init__()
        self.narrow = nn.Linear(8, 8)
        self.up = nn.Linear(8, 512)
        self.down = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.mean() > 0:
            return self.down(torch.tanh(self.up(x))).square().mean()
        return self.narrow(x).square().mean()


def test_a_flipped_branch_no_plan_fits_warns_once_and_trains_exactly() -> None:
    model = _Branchy()
    ref = copy.deepcopy(model)
    narrow = -torch.rand(16, 8) - 0.1
    wide = torch.rand(16, 8) + 0.1
    hm = HRockmate(model, narrow, budget=1.0, cache=False, progress=False)
    budget = hm.budget_bytes
    assert budget is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step_both(hm, model, ref, (wide,))
    over = [w for w in caught if issubclass(w.category, OverBudgetWarning)]
    assert len(over) == 1
    text = str(over[0].message)
    assert f"budget of {budget} bytes" in text and "hmod.replan(" in text
    assert f"predicted peak {hm.predicted_peak_bytes} bytes" in text
    floor, _ = peak_lower_bound(hm.traced.graph)
    assert hm.predicted_peak_bytes > budget and floor > budget  # no plan could fit
    assert hm.budget_bytes == budget  # still the bytes asked for
    with warnings.catch_warnings(record=True) as caught:  # once: not at every call
        warnings.simplefilter("always")
        for inputs in (wide, narrow, wide):
            _step_both(hm, model, ref, (inputs,))
    assert not [w for w in caught if issubclass(w.category, OverBudgetWarning)]
    hm.replan(hm.predicted_peak_bytes)  # the advice works
    assert hm.budget_bytes >= hm.predicted_peak_bytes


def _dropout_mlp() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(8, 256), nn.Dropout(0.5), nn.Tanh(), nn.Linear(256, 8)),
            torch.randn(64, 8))


def test_a_submodule_back_in_training_mode_over_the_budget_warns_and_trains_exactly() -> None:
    model, x = _dropout_mlp()
    model[1].eval()
    ref = copy.deepcopy(model)
    hm = HRockmate(model, x, budget=1.0, cache=False, progress=False)
    budget = hm.budget_bytes
    model[1].train()
    ref[1].train()
    with pytest.warns(OverBudgetWarning, match=r"module '1' is now in training mode.*replan"):
        _step_both(hm, model, ref, (x,), loss_of=lambda out: out.square().mean())
    assert hm.budget_bytes == budget and hm.predicted_peak_bytes > budget


def test_parameters_unfrozen_over_the_budget_warn_and_train_exactly() -> None:
    model, x = _dropout_mlp()
    model[0].requires_grad_(False)
    ref = copy.deepcopy(model)
    # (a budget in bytes at the frozen graph's store-all peak: unfreezing needs more)
    store_all = HRockmate(model, x, cache=False, progress=False).predicted_peak_bytes
    hm = HRockmate(model, x, budget=store_all, cache=False, progress=False)
    budget = hm.budget_bytes
    assert budget == store_all
    model[0].requires_grad_(True)
    ref[0].requires_grad_(True)
    with pytest.warns(OverBudgetWarning, match=r"parameter '0.weight' now requires grad"):
        _step_both(hm, model, ref, (x,), seed=3, loss_of=lambda out: out.square().mean())
    assert hm.budget_bytes == budget


@pytest.mark.parametrize("change", ["eval", "freeze"])
def test_followed_changes_keep_the_bytes_asked_for(change: str) -> None:
    """A fraction is resolved to bytes once: eval() of a dropout or frozen layers plan for
    those bytes (on a smaller graph), not for the fraction of the smaller graph's baseline."""
    model, x = _dropout_mlp()
    ref = copy.deepcopy(model)
    hm = HRockmate(model, x, budget=0.8, cache=False, progress=False)
    budget = hm.budget_bytes
    before = hm.plan.baseline_peak_bytes
    for m in (model, ref):
        if change == "eval":
            m[1].eval()
        else:
            m[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OverBudgetWarning)
        _step_both(hm, model, ref, (x,), seed=1, loss_of=lambda out: out.square().mean())
    assert hm.plan.baseline_peak_bytes < before  # another, smaller graph
    assert hm.budget_bytes == budget
    assert hm.predicted_peak_bytes <= budget


def test_a_copy_keeps_the_shape_settings_and_plans_its_shapes_again() -> None:
    model, x = models.mlp(batch=4, d_in=8, hidden=16, n_layers=2, d_out=4)
    hm = HRockmate(model, x, max_shapes=3, cache=False)
    hm(torch.randn(6, 8)).sum().backward()
    assert len(hm.planned_shapes) == 2
    twin = copy.deepcopy(hm)
    programs = twin.__dict__["_hr_shapes"]
    assert programs.max_shapes == 3 and not programs.strict and not programs.entries
    reference = copy.deepcopy(twin.wrapped_model)
    _step_both(twin, twin.wrapped_model, reference, (torch.randn(5, 8),),
               loss_of=lambda out: out.sum())
    assert twin.planned_shapes[0] == ((5, 8),)
