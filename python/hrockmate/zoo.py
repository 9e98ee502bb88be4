"""The built-in model zoo of ``hrockmate bench``: random weights, built in code, three sizes.

Sizes: ``tiny`` (seconds, for tests), ``small`` (the default: runs on a 2-core CPU), ``large``
(for a GPU). Every entry also says which submodules are its repeated *blocks*, the unit a user
would wrap in ``torch.utils.checkpoint``.

Built on ``hrockmate.models`` (GPT-2-style decoder, U-Net, encoder-decoder Transformer,
ResNet-with-BatchNorm, DenseNet) plus an MLP-Mixer defined here, and Hugging Face
``transformers`` GPT-2 and T5 built from their configs (no weight download) when that package is
installed; without it those two entries raise ``ModelUnavailable`` with a message and the runner
skips them.

    from hrockmate.zoo import ZOO
    model, sample = ZOO["gpt2"].build("small")

``hrockmate bench`` reads this zoo from the installed package; a zoo module of one's own is
loaded (executed) only when named with ``--zoo PATH``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from hrockmate import models
from hrockmate.modelspec import ModelSpec, ModelUnavailable

SIZES = ("tiny", "small", "large")


def _pick(size: str, table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if size not in table:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    return table[size]


# ---- MLP-Mixer (Tolstikhin et al. 2021) ---------------------------------------------------------
class _MixerMLP(nn.Sequential):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, channels: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token_mlp = _MixerMLP(tokens, token_hidden)
        self.norm2 = nn.LayerNorm(channels)
        self.channel_mlp = _MixerMLP(channels, channel_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, channels)
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MLPMixer(nn.Module):
    def __init__(self, image: int, patch: int, in_ch: int, channels: int, depth: int,
                 n_classes: int) -> None:
        super().__init__()
        if image % patch:
            raise ValueError(f"MLPMixer: image={image} must be divisible by patch={patch}")
        tokens = (image // patch) ** 2
        self.stem = nn.Conv2d(in_ch, channels, patch, stride=patch)
        self.blocks = nn.ModuleList(
            [_MixerBlock(tokens, channels, channels // 2, 4 * channels) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def mlp_mixer(batch: int = 2, image: int = 16, patch: int = 4, in_ch: int = 3,
              channels: int = 16, depth: int = 2, n_classes: int = 10,
              seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """MLP-Mixer with random weights (drawn from a private generator, like hrockmate.models)."""
    gen = torch.Generator().manual_seed(seed)
    model = MLPMixer(image, patch, in_ch, channels, depth, n_classes)
    with torch.no_grad():
        for p in model.parameters():
            bound = 1.0 / math.sqrt(p.shape[-1])
            p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
    return model, torch.randn(batch, in_ch, image, image, generator=gen)


# ---- builders and block selectors ----------------------------------------------------------------
def _gpt2(size: str) -> tuple[nn.Module, Any]:
    cfg = _pick(size, {
        "tiny": dict(n_layer=2, n_embd=32, n_head=2, seq=16, batch=2, vocab=64),
        "small": dict(n_layer=4, n_embd=128, n_head=4, seq=128, batch=4, vocab=512),
        "large": dict(n_layer=12, n_embd=768, n_head=12, seq=1024, batch=8, vocab=50257),
    })
    return models.gpt2_tiny(dropout=0.1, with_loss=True, **cfg)


def _unet(size: str) -> tuple[nn.Module, Any]:
    cfg = _pick(size, {
        "tiny": dict(batch=2, image=16, base=4, depth=2),
        "small": dict(batch=4, image=64, base=16, depth=3),
        "large": dict(batch=8, image=256, base=64, depth=4),
    })
    return models.unet_tiny(**cfg)


def _encdec(size: str) -> tuple[nn.Module, Any]:
    cfg = _pick(size, {
        "tiny": dict(batch=2, src_len=8, tgt_len=8, vocab=32, d_model=16, n_head=2, n_layers=1,
                     d_ff=32),
        "small": dict(batch=4, src_len=64, tgt_len=64, vocab=256, d_model=128, n_head=4,
                      n_layers=2, d_ff=512),
        "large": dict(batch=16, src_len=512, tgt_len=512, vocab=32000, d_model=512, n_head=8,
                      n_layers=6, d_ff=2048),
    })
    return models.transformer_encdec(dropout=0.1, **cfg)


def _resnet(size: str) -> tuple[nn.Module, Any]:
    cfg = _pick(size, {
        "tiny": dict(batch=2, image=16, width=8, n_blocks=2),
        "small": dict(batch=8, image=32, width=32, n_blocks=4),
        "large": dict(batch=32, image=64, width=128, n_blocks=8),
    })
    return models.cnn_bn(**cfg)


def _densenet(size: str) -> tuple[nn.Module, Any]:
    cfg = _pick(size, {
        "tiny": dict(batch=2, image=16, growth=4, n_blocks=2, layers=3),
        "small": dict(batch=4, image=32, growth=12, n_blocks=3, layers=4),
        "large": dict(batch=32, image=128, growth=32, n_blocks=4, layers=12),
    })
    return models.densenet_tiny(**cfg)


def _mixer(size: str) -> tuple[nn.Module, Any]:
    cfg = _pick(size, {
        "tiny": dict(batch=2, image=16, patch=4, channels=16, depth=2),
        "small": dict(batch=8, image=64, patch=8, channels=128, depth=4),
        "large": dict(batch=64, image=224, patch=16, channels=512, depth=12),
    })
    return mlp_mixer(**cfg)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelUnavailable(
            "the 'transformers' package is not installed (pip install transformers to benchmark "
            "Hugging Face models)"
        ) from None
    return transformers


def _hf_gpt2(size: str) -> tuple[nn.Module, Any]:
    tf = _transformers()
    cfg = _pick(size, {
        "tiny": dict(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64),
        "small": dict(n_layer=6, n_embd=128, n_head=4, n_positions=128, vocab_size=512),
        "large": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257),
    })
    batch = {"tiny": 2, "small": 4, "large": 8}[size]
    torch.manual_seed(0)
    # (the special tokens inside the vocabulary: GPT-2's default 50256 is not in a small one)
    last = cfg["vocab_size"] - 1
    model = tf.GPT2LMHeadModel(tf.GPT2Config(**cfg, bos_token_id=last, eos_token_id=last))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (batch, cfg["n_positions"]), generator=gen)
    return _HFLoss(model), {"input_ids": ids, "labels": ids.clone()}


def _hf_t5(size: str) -> tuple[nn.Module, Any]:
    tf = _transformers()
    cfg = _pick(size, {
        "tiny": dict(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64),
        "small": dict(d_model=128, d_ff=512, num_layers=3, num_heads=4, d_kv=32, vocab_size=512),
        "large": dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64,
                      vocab_size=32128),
    })
    batch, seq = {"tiny": (2, 8), "small": (4, 64), "large": (16, 512)}[size]
    torch.manual_seed(0)
    # (T5 shifts the labels right from the decoder's start token, which a configuration built
    # from scratch lacks in transformers 5: the pad token, as the released T5 checkpoints set)
    model = tf.T5ForConditionalGeneration(tf.T5Config(**cfg, pad_token_id=0, eos_token_id=1,
                                                      decoder_start_token_id=0))
    gen = torch.Generator().manual_seed(1)
    src = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=gen)
    labels = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=gen)
    return _HFLoss(model), {"input_ids": src, "labels": labels}


class _HFLoss(nn.Module):
    """A Hugging Face model that returns just its loss (a tensor, not a ModelOutput)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **kwargs: Any) -> torch.Tensor:
        return self.model(**kwargs, use_cache=False, return_dict=True).loss


def _blocks(*paths: str) -> Any:
    """A block selector over submodule paths: ``"h.*"`` is every child of ``h``, ``"inc"`` is
    the module ``inc`` itself."""

    def select(model: nn.Module) -> list[nn.Module]:
        out: list[nn.Module] = []
        for path in paths:
            if path.endswith(".*"):
                out += list(model.get_submodule(path[:-2]).children())
            else:
                out.append(model.get_submodule(path))
        return out

    return select


def _dense_layers(model: nn.Module) -> list[nn.Module]:
    return [layer for block in model.blocks for layer in block]


ZOO: dict[str, ModelSpec] = {
    "gpt2": ModelSpec("gpt2", "GPT-2-style decoder (dropout, tied embeddings)", _gpt2,
                      _blocks("h.*")),
    "unet": ModelSpec("unet", "U-Net (concatenated skips)", _unet,
                      _blocks("inc", "down.*", "dec.*")),
    "encdec": ModelSpec("encdec", "encoder-decoder Transformer (torch.nn layers)", _encdec,
                        _blocks("encoder.*", "decoder.*")),
    "resnet_bn": ModelSpec("resnet_bn", "ResNet with BatchNorm and in-place ReLU", _resnet,
                           _blocks("blocks.*")),
    "densenet": ModelSpec("densenet", "DenseNet (dense blocks with BatchNorm)", _densenet,
                          _dense_layers),
    "mlp_mixer": ModelSpec("mlp_mixer", "MLP-Mixer", _mixer, _blocks("blocks.*")),
    "hf_gpt2": ModelSpec("hf_gpt2", "Hugging Face GPT-2 (from config, random weights)",
                         _hf_gpt2, _blocks("model.transformer.h.*")),
    "hf_t5": ModelSpec("hf_t5", "Hugging Face T5 (from config, random weights)", _hf_t5,
                       _blocks("model.encoder.block.*", "model.decoder.block.*")),
}
