"""HRockmate inside ordinary training scripts: in-place ops on the returned loss and outputs,
the module's forward signature and keyword arguments the sample lacked, transformers'
Trainer at its default arguments (and saving a model with tied weights), torch.compile."""

from __future__ import annotations

import copy
import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

import hrockmate
from hrockmate.runtime import HRockmate


class _MLPLoss(nn.Module):
    """A small MLP that returns its own MSE loss: forward(x, y)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return nn.functional.mse_loss(self.c(h), y)


def _recomputing(model: nn.Module, sample: Any, **kw: Any) -> HRockmate:
    """HRockmate running recompute-all (every forward op re-run in backward), so that the
    backward reads recomputed tensors, not the forward's."""
    hm = HRockmate(model, sample, cache=False, **kw)
    hm.use_plan(hrockmate.recompute_all_schedule(hm.traced.graph))
    assert hm.recomputed_ops > 0
    return hm


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)) for _ in range(n)]


def _assert_bitwise_grads(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert torch.equal(p.grad, q.grad), f"grad of {name} differs"


# ---- outputs are ordinary tensors ---------------------------------------------------------
@pytest.mark.parametrize("op", ["div", "mul"])
def test_gradient_accumulation_with_in_place_loss_scaling_is_bitwise(op: str) -> None:
    """``loss /= 4`` (and ``loss *= s``) on the returned loss over 4 accumulated micro-batches:
    the same gradients as plain PyTorch, bit for bit."""
    model = _MLPLoss()
    ref = copy.deepcopy(model)
    hm = _recomputing(model, _batches(1)[0])
    for mod in (hm, ref):
        for x, y in _batches(4, seed=1):
            loss = mod(x, y)
            if op == "div":
                loss /= 4
            else:
                loss *= 0.25
            loss.backward()
    _assert_bitwise_grads(model, ref)


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return self.b(h), h.sum(dim=1)


def test_in_place_add_on_outputs_backpropagates_as_plain() -> None:
    """``out.add_(...)`` and ``out.mul_(...)`` on outputs the backward does not read: the
    gradients are plain PyTorch's."""
    model = _TwoOutputs()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    hm = _recomputing(model, x)
    for mod in (hm, ref):
        out, total = mod(x)
        out.add_(1.0)
        total.mul_(3.0)
        (out.pow(2).sum() + total.sum()).backward()
    _assert_bitwise_grads(model, ref)


def test_in_place_op_on_an_output_the_backward_reads_raises_like_plain() -> None:
    """Softmax's backward reads its result: modifying it in place fails in plain PyTorch, and
    fails the same way (autograd's version check) through HRockmate."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    hm = HRockmate(model, x, cache=False)
    for mod in (ref, hm):
        out = mod(x)
        out.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


# ---- the call surface -------------------------------------------------------------------
class _Keywords(nn.Module):
    """forward(input_ids, labels=None, **kwargs), dividing a summed loss by
    ``num_items_in_batch`` when given (as transformers' causal LM loss does)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.out = nn.Linear(16, 32)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                **kwargs: Any) -> torch.Tensor:
        logits = self.out(torch.tanh(self.emb(input_ids)))
        n = kwargs.get("num_items_in_batch")
        reduction = "sum" if n is not None else "mean"
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                           reduction=reduction)
        return loss / n if n is not None else loss


def test_forward_shows_the_wrapped_models_signature() -> None:
    model = _Keywords()
    g = torch.Generator().manual_seed(0)
    sample = {"input_ids": torch.randint(0, 32, (2, 5), generator=g),
              "labels": torch.randint(0, 32, (2, 5), generator=g)}
    hm = HRockmate(model, sample, cache=False)
    sig = inspect.signature(hm.forward)
    assert list(sig.parameters) == ["input_ids", "labels", "kwargs"]
    assert sig.parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    # the same after a pickle round trip (the function is made again for the copy)
    copied = copy.deepcopy(hm)
    assert list(inspect.signature(copied.forward).parameters) == list(sig.parameters)
    assert copied.forward is not hm.forward


def test_a_keyword_the_sample_lacked_is_traced_as_an_input() -> None:
    """Calls that add ``num_items_in_batch`` (a 0-d tensor whose value changes every call)
    trace again once with it as an input: each call's loss and the accumulated gradients are
    plain PyTorch's, bit for bit."""
    model = _Keywords()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)

    def batch() -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, 32, (2, 5), generator=g),
                "labels": torch.randint(0, 32, (2, 5), generator=g)}

    hm = _recomputing(model, batch())
    calls = [{**batch(), "num_items_in_batch": torch.tensor(k)} for k in (7, 9, 10)]
    first = hm.traced
    for mod in (hm, ref):
        for kw in calls:
            loss = mod(**kw)
            loss.backward()
    assert hm.traced is not first  # traced once more, for the new argument
    assert any(kind == "input" for kind, _ in hm.traced.sources.values())
    _assert_bitwise_grads(model, ref)
    # the loss is the one with this call's count, not a traced constant
    with torch.no_grad():
        want = ref(**calls[1])
    got = hm(**calls[1])
    assert torch.equal(got.detach(), want)


# ---- transformers' Trainer --------------------------------------------------------------
def _hf_gpt2() -> tuple[nn.Module, list[dict[str, torch.Tensor]]]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                  n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(12):
        ids = torch.randint(0, 64, (16,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long),
                     "labels": ids.clone()})
    return model, rows


@pytest.mark.slow  # (two plans at 50%: the sample's, and the one with num_items_in_batch)
def test_trainer_with_default_arguments_trains_like_plain_and_saves_tied_weights(
        tmp_path: Any) -> None:
    """transformers' Trainer at its default TrainingArguments (remove_unused_columns=True, the
    model's loss kwargs detected, so num_items_in_batch is passed and the loss scaled in
    place): 3 steps over HRockmate at 50% leave the parameters bitwise equal to the same
    Trainer over the plain model; HRockmateTrainer.save_model writes the tied GPT-2 so that
    from_pretrained loads it back, still tied."""
    pytest.importorskip("accelerate")
    from transformers import GPT2LMHeadModel, Trainer, TrainingArguments

    from hrockmate.integrations.transformers import HRockmateTrainer

    model, rows = _hf_gpt2()
    ref = copy.deepcopy(model)
    sample = {k: torch.stack([r[k] for r in rows[:4]]) for k in rows[0]}
    hm = HRockmate(model, sample, budget=0.5, cache=False, loss_fn="loss")
    assert hm.plan.method != "store-all"

    def train(trainer_class: type, m: nn.Module, out: str) -> Any:
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=3,
                                 per_device_train_batch_size=4, use_cpu=True, report_to=[],
                                 save_strategy="no", seed=0, data_seed=0, disable_tqdm=True)
        trainer = trainer_class(model=m, args=args, train_dataset=rows)
        trainer.train()
        return trainer

    train(Trainer, ref, "plain")
    trainer = train(Trainer, hm, "hrockmate")
    assert trainer.model_accepts_loss_kwargs  # (so num_items_in_batch reached the module)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"{name} differs from the plain Trainer's"

    saver = HRockmateTrainer(model=hm, args=trainer.args)
    plain = Trainer(model=ref, args=trainer.args)
    assert saver.label_names == plain.label_names == ["labels"]
    assert saver.can_return_loss == plain.can_return_loss
    saver.save_model(str(tmp_path / "saved"))
    back = GPT2LMHeadModel.from_pretrained(str(tmp_path / "saved"))
    assert back.lm_head.weight is back.transformer.wte.weight
    for (name, p), (_, q) in zip(back.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), f"{name} did not round-trip"


# ---- torch.compile ----------------------------------------------------------------------
def test_compiling_the_module_runs_the_plan_eagerly_within_its_budget() -> None:
    """``torch.compile(hmod)``: dynamo leaves the plan's execution alone (it runs as in eager
    mode, recomputations included), so gradients are bitwise eager's and the measured peak of
    a step stays within the predicted peak."""
    import torch._dynamo

    model = _MLPLoss()
    ref = copy.deepcopy(model)
    x, y = _batches(1)[0]
    hm = HRockmate(model, (x, y), cache=False)
    hm.use_plan(hrockmate.recompute_all_schedule(hm.traced.graph))
    graphs: list[Any] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)  # (what dynamo captured: none of the plan's execution)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(hm, backend=backend)
    for mod in (compiled, ref):
        for bx, by in _batches(2, seed=3):
            mod(bx, by).backward()
    _assert_bitwise_grads(model, ref)
    assert graphs == []

    model.zero_grad(set_to_none=True)

    def step() -> None:
        compiled(x, y).backward()

    step()
    model.zero_grad(set_to_none=True)
    got = hrockmate.measure_peak_memory(step, params=list(model.parameters())).peak_bytes
    assert got <= hm.predicted_peak_bytes * 1.05, (got, hm.predicted_peak_bytes)


def test_wrapping_a_compiled_model_warns_and_keeps_the_models_keys() -> None:
    """``HRockmate(torch.compile(model))`` says that the plan runs eagerly, plans the module
    inside, and its state_dict has the user's model's keys (no '_orig_mod.')."""
    model = _MLPLoss()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match="torch.compile'd module.*runs that plan eagerly"):
        hm = HRockmate(compiled, _batches(1)[0], cache=False)
    assert hm.wrapped_model is model
    assert list(hm.state_dict()) == list(model.state_dict()) == [
        "a.weight", "a.bias", "b.weight", "b.bias", "c.weight", "c.bias"]
    fresh = _MLPLoss()
    fresh.load_state_dict(hm.state_dict())  # (strict: a plain model takes it as is)
    for bx, by in _batches(2, seed=5):
        hm(bx, by).backward()
        ref(bx, by).backward()
    _assert_bitwise_grads(model, ref)


def test_a_plain_model_builds_without_a_compile_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HRockmate(_MLPLoss(), _batches(1)[0], cache=False)


@pytest.mark.slow  # (planning a BERT classifier at 60%)
def test_trainer_drops_unused_columns_accumulates_and_compiles_like_eager(tmp_path: Any) -> None:
    """A BERT classifier under Trainer's defaults plus 2-step gradient accumulation and
    ``torch_compile=True``: the dataset's extra column is dropped by the module's signature,
    ``label`` is renamed for the model, and the compiled HRockmate module (which runs its plan
    eagerly) ends bitwise equal to the plain Trainer without compile."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments, default_data_collator

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    model = transformers.BertForSequenceClassification(cfg)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 64, (12,), generator=g),
             "attention_mask": torch.ones(12, dtype=torch.long),
             "token_type_ids": torch.zeros(12, dtype=torch.long),
             "label": int(torch.randint(0, 3, (1,), generator=g)),
             "source": "a column the model does not take"} for _ in range(16)]
    sample = dict(default_data_collator([{k: v for k, v in r.items() if k != "source"}
                                         for r in rows[:4]]))
    hm = HRockmate(model, sample, budget=0.6, cache=False, loss_fn="loss")
    assert hm.plan.method != "store-all"

    def train(m: nn.Module, out: str, compile_: bool) -> None:
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=3,
                                 per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                 use_cpu=True, report_to=[], save_strategy="no",
                                 disable_tqdm=True, torch_compile=compile_)
        Trainer(model=m, args=args, train_dataset=rows).train()

    train(ref, "plain", False)
    train(hm, "hrockmate", True)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), f"{name} differs from the plain Trainer's"
