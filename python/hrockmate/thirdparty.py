"""Models nobody here wrote, built from configs with random weights (nothing downloaded):
Hugging Face transformers GPT-2, BERT, T5, Llama, CLIP and Wav2Vec2 (speech recognition with
a CTC loss), timm's ViT and EfficientNet-B0, torchvision's ResNet18 and MobileNetV3. They
serve the third-party tests (``tiny``) and ``benches/thirdparty.py`` (``small``, sized so that
activations, not parameter gradients, make most of the peak).

The transformers models run at their library defaults (``use_cache=True``, ``ModelOutput``
outputs, sdpa attention where the model has it), with a padded ``attention_mask`` and the loss
computed inside the model (from ``labels``; CLIP's contrastive loss with ``return_loss=True``):
their loss is the output member ``"loss"``. The vision models come wrapped with their loss in a
module that takes the targets as an argument. They need the ``models`` extra (``pip install
"hrockmate[models]"``).

    from hrockmate.thirdparty import BUILDERS
    model, sample, loss_fn = BUILDERS["gpt2"]("small")
    hm = hrockmate.HRockmate(model, sample, budget=0.5, loss_fn=loss_fn)
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn as nn

__all__ = ["BUILDERS", "SIZES", "Classifier"]

SIZES = ("tiny", "small")
_Built = tuple[nn.Module, Any, Any]  # (model, sample, loss_fn)


def _require(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"the third-party models need {name}: install the models extra, "
            "pip install 'hrockmate[models]'"
        ) from exc


def _pick(size: str, table: dict[str, Any]) -> Any:
    if size not in table:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    return table[size]


# (vocabulary, batch, sequence length, layers, width) of the text models per size
_TEXT = {"tiny": (100, 4, 32, 2, 64), "small": (1000, 4, 128, 4, 256)}


def _text_sample(size: str) -> dict[str, torch.Tensor]:
    """Token ids with a padded second row (its last 3/8 masked out and ignored)."""
    vocab, batch, seq, _, _ = _pick(size, _TEXT)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq - 3 * seq // 8:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def gpt2(size: str = "tiny") -> _Built:
    tf = _require("transformers")
    vocab, _, seq, layers, width = _pick(size, _TEXT)
    cfg = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 32, vocab_size=vocab,
                        n_positions=seq, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg), _text_sample(size), "loss"


def bert(size: str = "tiny") -> _Built:
    tf = _require("transformers")
    vocab, _, seq, layers, width = _pick(size, _TEXT)
    cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=width,
                        num_attention_heads=width // 32, intermediate_size=2 * width,
                        vocab_size=vocab, max_position_embeddings=seq)
    return tf.BertForMaskedLM(cfg), _text_sample(size), "loss"


def t5(size: str = "tiny") -> _Built:
    tf = _require("transformers")
    vocab, _, _, layers, width = _pick(size, _TEXT)
    cfg = tf.T5Config(num_layers=layers // 2, num_decoder_layers=layers // 2, d_model=width,
                      d_kv=16, d_ff=2 * width, num_heads=width // 32, vocab_size=vocab,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return tf.T5ForConditionalGeneration(cfg), _text_sample(size), "loss"


def llama(size: str = "tiny") -> _Built:
    tf = _require("transformers")
    vocab, _, seq, layers, width = _pick(size, _TEXT)
    cfg = tf.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                         num_attention_heads=width // 16, num_key_value_heads=width // 32,
                         intermediate_size=2 * width, vocab_size=vocab,
                         max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    return tf.LlamaForCausalLM(cfg), _text_sample(size), "loss"


def clip(size: str = "tiny") -> _Built:
    """A text and an image tower trained against each other (``return_loss=True``): two
    inputs of different kinds and a contrastive loss over the batch."""
    tf = _require("transformers")
    vocab, batch, seq, layers, width = _pick(size, _TEXT)
    image, _ = _pick(size, _VISION)
    tower = dict(hidden_size=width, num_hidden_layers=layers, num_attention_heads=width // 32,
                 intermediate_size=2 * width)
    cfg = tf.CLIPConfig(
        text_config=dict(tower, vocab_size=vocab, max_position_embeddings=seq, bos_token_id=0,
                         eos_token_id=2, pad_token_id=1),
        vision_config=dict(tower, image_size=image, patch_size=8), projection_dim=width // 2)
    sample = _text_sample(size)
    del sample["labels"]
    gen = torch.Generator().manual_seed(1)
    sample["pixel_values"] = torch.randn(batch, 3, image, image, generator=gen)
    sample["return_loss"] = True
    return tf.CLIPModel(cfg), sample, "loss"


# (batch, audio samples, layers, width, longest label sequence) of the speech model per size
_SPEECH = {"tiny": (2, 1600, 2, 32, 10), "small": (4, 16000, 4, 128, 40)}


def wav2vec2_ctc(size: str = "tiny") -> _Built:
    """Speech recognition with a CTC loss: labels of different lengths (padded with -100) and
    a padded second row of audio, LayerDrop at the library's default (each layer skipped with
    probability 0.1 while training). SpecAugment's time masks are off: they are drawn with
    numpy, which a trace would fix."""
    tf = _require("transformers")
    batch, samples, layers, width, longest = _pick(size, _SPEECH)
    convs = layers + 1  # (strides 5, 2, 2, ...: about one frame per 5 * 2**layers samples)
    cfg = tf.Wav2Vec2Config(
        vocab_size=32, hidden_size=width, num_hidden_layers=layers,
        num_attention_heads=width // 16, intermediate_size=2 * width,
        conv_dim=(width,) * convs, conv_stride=(5,) + (2,) * layers,
        conv_kernel=(10,) + (3,) * layers, num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, mask_time_prob=0.0)
    gen = torch.Generator().manual_seed(0)
    audio = torch.randn(batch, samples, generator=gen)
    mask = torch.ones(batch, samples, dtype=torch.long)
    mask[1, samples - samples // 4:] = 0
    labels = torch.randint(1, cfg.vocab_size, (batch, longest), generator=gen)
    lengths = torch.arange(batch) * (longest // 2) // max(1, batch - 1) + longest // 2
    labels[torch.arange(longest)[None] >= lengths[:, None]] = -100
    sample = {"input_values": audio, "attention_mask": mask, "labels": labels}
    return tf.Wav2Vec2ForCTC(cfg), sample, "loss"


class Classifier(nn.Module):
    """A vision model and its loss in one module: the targets are an argument of every call
    (what a loss_fn closing over them could not give)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(images), targets)


# (image size, batch) of the vision models per size
_VISION = {"tiny": (64, 8), "small": (96, 16)}


def _image_classifier(model: nn.Module, size: str) -> _Built:
    image, batch = _pick(size, _VISION)
    gen = torch.Generator().manual_seed(0)
    images = torch.randn(batch, 3, image, image, generator=gen)
    targets = torch.randint(0, 10, (batch,), generator=gen)
    return Classifier(model), (images, targets), None


def vit(size: str = "tiny") -> _Built:
    timm = _require("timm")
    image, _ = _pick(size, _VISION)
    depth = {"tiny": 2, "small": 6}[size]
    return _image_classifier(timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=image, patch_size=8, depth=depth,
        num_classes=10), size)


def efficientnet_b0(size: str = "tiny") -> _Built:
    """With stochastic depth and dropout: random ops whose draws the runtime replays."""
    timm = _require("timm")
    return _image_classifier(timm.create_model(
        "efficientnet_b0", pretrained=False, num_classes=10, drop_rate=0.2,
        drop_path_rate=0.1), size)


def resnet18(size: str = "tiny") -> _Built:
    return _image_classifier(_require("torchvision").models.resnet18(num_classes=10), size)


def mobilenet_v3_small(size: str = "tiny") -> _Built:
    return _image_classifier(
        _require("torchvision").models.mobilenet_v3_small(num_classes=10), size)


BUILDERS: dict[str, Callable[[str], _Built]] = {
    "gpt2": gpt2,
    "bert": bert,
    "t5": t5,
    "llama": llama,
    "clip": clip,
    "wav2vec2_ctc": wav2vec2_ctc,
    "vit": vit,
    "efficientnet_b0": efficientnet_b0,
    "resnet18": resnet18,
    "mobilenet_v3_small": mobilenet_v3_small,
}
