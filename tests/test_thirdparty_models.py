"""Models nobody here wrote: Hugging Face transformers, timm and torchvision, built from small
configs (no weights downloaded), trained with HRockmate at two budgets: gradients equal to plain
PyTorch's and the measured peak within the budget.

The transformers models run at their default settings (``use_cache=True``, ``ModelOutput``
outputs, sdpa attention), with a padded ``attention_mask`` and the loss computed inside the
model from ``labels`` (``loss_fn="loss"``); the vision models are wrapped with their loss in a
module that takes the targets as an argument.
These tests need the ``models`` extra (``pip install ".[test,models]"``).
"""

from __future__ import annotations

import copy
import importlib
import os
from types import ModuleType
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import hrockmate
from hrockmate.budget import parse_budget
from hrockmate.runtime import HRockmate

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing may be downloaded
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _require(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"{name} is needed by tests/test_thirdparty_models.py: install the models extra, "
            "pip install '.[test,models]'"
        ) from exc


# ---- models: (model, sample, loss_fn) ---------------------------------------------------------
VOCAB, BATCH, SEQ = 100, 4, 32


def _text_sample() -> dict[str, torch.Tensor]:
    """Token ids with a padded second row (its last 12 positions masked out and ignored)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 12:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def gpt2() -> tuple[nn.Module, Any, Any]:
    tf = _require("transformers")
    cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg), _text_sample(), "loss"


def bert() -> tuple[nn.Module, Any, Any]:
    tf = _require("transformers")
    cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=SEQ)
    return tf.BertForMaskedLM(cfg), _text_sample(), "loss"


def t5() -> tuple[nn.Module, Any, Any]:
    tf = _require("transformers")
    cfg = tf.T5Config(num_layers=1, num_decoder_layers=1, d_model=64, d_kv=16, d_ff=128,
                      num_heads=2, vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1)
    return tf.T5ForConditionalGeneration(cfg), _text_sample(), "loss"


def llama() -> tuple[nn.Module, Any, Any]:
    tf = _require("transformers")
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=VOCAB,
                         max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    return tf.LlamaForCausalLM(cfg), _text_sample(), "loss"


class Classifier(nn.Module):
    """A vision model and its loss in one module: the targets are an argument of every call
    (what a loss_fn closing over them could not give)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(images), targets)


def _image_classifier(model: nn.Module, size: int = 64, batch: int = 8
                      ) -> tuple[nn.Module, Any, Any]:
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, size, size, generator=gen)
    targets = torch.randint(0, 10, (batch,), generator=gen)
    return Classifier(model), (images, targets), None


def vit() -> tuple[nn.Module, Any, Any]:
    timm = _require("timm")
    return _image_classifier(timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=8, depth=2,
        num_classes=10))


def resnet18() -> tuple[nn.Module, Any, Any]:
    return _image_classifier(_require("torchvision").models.resnet18(num_classes=10))


def mobilenet_v3_small() -> tuple[nn.Module, Any, Any]:
    return _image_classifier(_require("torchvision").models.mobilenet_v3_small(num_classes=10))


#: model -> (builder, two budgets as fractions of the store-all peak). At these tiny sizes
#: parameter gradients are a large part of the peak, which puts the lowest feasible budget of
#: GPT-2 near 0.47 and of ResNet18 near 0.58.
MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, Any, Any]], tuple[float, float]]] = {
    "gpt2": (gpt2, (0.7, 0.5)),
    "bert": (bert, (0.7, 0.4)),
    "t5": (t5, (0.7, 0.4)),
    "llama": (llama, (0.7, 0.4)),
    "vit": (vit, (0.7, 0.4)),
    "resnet18": (resnet18, (0.8, 0.6)),
    "mobilenet_v3_small": (mobilenet_v3_small, (0.7, 0.4)),
}


# ---- helpers -------------------------------------------------------------------------------------
def _call(model: nn.Module, sample: Any) -> Any:
    return model(**sample) if isinstance(sample, dict) else model(*sample)


def _loss(out: Any, loss_fn: Any) -> torch.Tensor:
    return out[loss_fn] if isinstance(loss_fn, str) else out


def _another_batch(sample: Any) -> Any:
    """A batch of the sample's shapes with other values: new images, rows of integer tensors
    reversed (token ids, attention mask and labels together: the padding moves)."""
    gen = torch.Generator().manual_seed(1)

    def other(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen) if t.is_floating_point() else t.flip(0)

    if isinstance(sample, dict):
        return {k: other(v) for k, v in sample.items()}
    return tuple(other(t) for t in sample)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equal, or within 1e-6 relative."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if torch.equal(a, b):
        return
    err = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
    assert err <= 1e-6, f"{what}: relative difference {err:.3g}"


def _train_both(hm: HRockmate, ref: nn.Module, sample: Any, loss_fn: Any, what: str) -> None:
    """Two AdamW steps of HRockmate and of plain PyTorch from the same state and seeds, on the
    sample and on another batch of its shapes."""
    model = hm.wrapped_model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for it, batch in enumerate([sample, _another_batch(sample)]):
        torch.manual_seed(100 + it)  # dropout draws the same numbers in both
        loss = _loss(_call(hm, batch), loss_fn)
        loss.backward()
        torch.manual_seed(100 + it)
        ref_loss = _loss(_call(ref, batch), loss_fn)
        ref_loss.backward()
        _assert_same(loss.detach(), ref_loss.detach(), f"{what} step {it}: loss")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), f"{what} step {it}: grad of {name}"
            if q.grad is not None:
                _assert_same(p.grad, q.grad, f"{what} step {it}: grad of {name}")
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):
            _assert_same(b, c, f"{what} step {it}: buffer {name}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)


def _tensors_in(obj: Any, depth: int = 4) -> list[torch.Tensor]:
    """The tensors an output object holds (attributes, lists, dicts), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return [t for item in items for t in _tensors_in(item, depth - 1)]


def _measured_peak(hm: HRockmate, sample: Any, loss_fn: Any) -> int:
    model = hm.wrapped_model

    def step() -> Any:
        out = _call(hm, sample)
        _loss(out, loss_fn).backward()
        return out

    step()  # lazy initialisations are not part of an iteration
    model.zero_grad(set_to_none=True)
    peak = hrockmate.measure_peak_memory(step, params=list(model.parameters())).peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan afresh: a cached plan from an earlier run would not test planning."""
    monkeypatch.setenv("HROCKMATE_CACHE_DIR", "off")


# ---- the tests -----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_trains_exactly_within_two_budgets(name: str) -> None:
    build, budgets = MODELS[name]
    torch.manual_seed(0)
    model, sample, loss_fn = build()
    model.train()
    if isinstance(loss_fn, str):  # transformers at its defaults: sdpa where the model has it
        assert model.config.use_cache and model.config.use_return_dict
        assert model.config._attn_implementation == (
            "sdpa" if type(model)._supports_sdpa else "eager")
    reference = copy.deepcopy(model)
    for fraction in budgets:
        ref = copy.deepcopy(reference)  # same start as the model, which trains on
        model.load_state_dict(reference.state_dict())
        hm = HRockmate(model, sample, budget=fraction, loss_fn=loss_fn, cost="estimate")
        budget = parse_budget(fraction, hm.plan.baseline_peak_bytes)
        assert hm.recomputed_ops > 0 and hm.predicted_peak_bytes <= budget
        _train_both(hm, ref, sample, loss_fn, f"{name} at {fraction:.0%}")
        peak = _measured_peak(hm, sample, loss_fn)
        assert peak <= budget, f"{name} at {fraction:.0%}: measured {peak} > budget {budget}"
        pred = hm.predicted_peak_bytes
        assert abs(peak - pred) <= 0.05 * pred, f"{name}: measured {peak} vs predicted {pred}"


def test_gpt2_padded_mask_traces_its_compiler_path() -> None:
    """transformers' sdpa mask helpers read the padding mask's values unless they see a
    compiler: the trace takes their compiler path, so one graph serves every padding of the
    shape (and the cache object comes back holding each call's tensors)."""
    model, sample, _ = gpt2()
    hm = HRockmate(model, sample, loss_fn="loss")
    if model.config._attn_implementation == "sdpa":
        assert hm.traced.graph.meta["compiling_paths"] is True
    tangents = [k for kind, k in hm.traced.sources.values() if kind == "tangent"]
    assert len(tangents) == 1  # only the loss is planned for a gradient
    ref = copy.deepcopy(model)
    ones = torch.ones_like(sample["attention_mask"])
    unpadded = dict(sample, attention_mask=ones, labels=sample["input_ids"])  # eager drops it
    other = dict(sample, attention_mask=ones.clone())
    other["attention_mask"][0, :5] = 0  # left padding in another row
    for batch in (sample, other, unpadded):
        torch.manual_seed(3)
        out = hm(**batch)
        torch.manual_seed(3)
        ref_out = ref(**batch)
        _assert_same(out.logits, ref_out.logits.detach(), "logits")
        # the cache object holds this call's real keys and values
        cached, ref_cached = _tensors_in(out.past_key_values), _tensors_in(ref_out.past_key_values)
        assert len(cached) == len(ref_cached) == 2 * model.config.n_layer
        for got, want in zip(cached, ref_cached):
            assert type(got) is torch.Tensor
            _assert_same(got, want.detach(), "cached keys or values")
        out.loss.backward()
        ref_out.loss.backward()
        for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
            _assert_same(p.grad, q.grad, f"grad of {pname}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
