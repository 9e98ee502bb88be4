"""Built-in models with random weights, for the demo, the tests and the benchmarks.

Every factory returns ``(model, sample)`` where ``sample`` is what ``hrockmate.trace`` and
``hrockmate.HRockmate`` accept: a tensor, a tuple of positional arguments or a dict of keyword
arguments. Sizes are parameters so that benchmarks can scale the same architectures up; the
defaults are tiny so that tests run in seconds on a CPU. Weights are drawn from a private
generator seeded by ``seed``, so building a model never disturbs the global random state.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "MODELS",
    "build",
    "mlp",
    "cnn_bn",
    "gpt2_tiny",
    "unet_tiny",
    "transformer_encdec",
    "densenet_tiny",
    "rnn_loop",
]


def _init_(model: nn.Module, seed: int) -> nn.Module:
    """Re-draw every parameter from a private generator (deterministic, global RNG untouched)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                bound = 1.0 / math.sqrt(p[0].numel())
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
            elif name.endswith("bias"):
                p.zero_()
            else:  # norm weights and other 1-d parameters
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
    return model


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + 1)


# ---- MLP --------------------------------------------------------------------------------------
def mlp(
    batch: int = 8, d_in: int = 32, hidden: int = 64, n_layers: int = 3, d_out: int = 10,
    seed: int = 0,
) -> tuple[nn.Module, torch.Tensor]:
    """A plain MLP (Linear + GELU); output: logits of shape (batch, d_out)."""
    layers: list[nn.Module] = []
    d = d_in
    for _ in range(n_layers):
        layers += [nn.Linear(d, hidden), nn.GELU()]
        d = hidden
    layers.append(nn.Linear(d, d_out))
    model = _init_(nn.Sequential(*layers), seed)
    return model, torch.randn(batch, d_in, generator=_gen(seed))


# ---- CNN with BatchNorm, in-place ReLU and residual adds ---------------------------------------
class _ResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x  # in-place residual add, as torchvision's ResNet does
        return self.relu(out)


class CNNBN(nn.Module):
    def __init__(self, in_ch: int, width: int, n_blocks: int, n_classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_ch, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
        )
        self.blocks = nn.Sequential(*[_ResBlock(width) for _ in range(n_blocks)])
        self.head = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def cnn_bn(
    batch: int = 4, in_ch: int = 3, image: int = 16, width: int = 8, n_blocks: int = 2,
    n_classes: int = 10, seed: int = 0,
) -> tuple[nn.Module, torch.Tensor]:
    """A small ResNet-like CNN (BatchNorm, in-place ReLU, in-place residual add)."""
    model = _init_(CNNBN(in_ch, width, n_blocks, n_classes), seed)
    return model, torch.randn(batch, in_ch, image, image, generator=_gen(seed))


# ---- GPT-2-style decoder ------------------------------------------------------------------------
class _CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class _GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = _CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(approximate="tanh"),
            nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2-style decoder; the output embedding is tied to the token embedding."""

    def __init__(
        self, vocab: int, seq: int, n_layer: int, n_embd: int, n_head: int, dropout: float
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(seq, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList([_GPTBlock(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied weights: one Parameter, two modules

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt2_tiny(
    n_layer: int = 2, n_embd: int = 32, n_head: int = 2, seq: int = 16, batch: int = 2,
    vocab: int = 64, dropout: float = 0.1, with_loss: bool = True, seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """GPT-2-style decoder (dropout, tied embeddings). With ``with_loss`` the sample is
    ``(idx, targets)`` and the model returns its own scalar loss; otherwise ``(idx,)`` -> logits."""
    if n_embd % n_head:
        raise ValueError(f"gpt2_tiny: n_embd={n_embd} must be divisible by n_head={n_head}")
    model = _init_(GPT2(vocab, seq, n_layer, n_embd, n_head, dropout), seed)
    g = _gen(seed)
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    if not with_loss:
        return model, (idx,)
    return model, (idx, torch.randint(0, vocab, (batch, seq), generator=g))


# ---- U-Net with concatenated skips --------------------------------------------------------------
def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(),
        nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(),
    )


class UNet(nn.Module):
    def __init__(self, in_ch: int, base: int, depth: int, out_ch: int) -> None:
        super().__init__()
        chans = [base * 2**i for i in range(depth + 1)]
        self.inc = _double_conv(in_ch, chans[0])
        self.down = nn.ModuleList([_double_conv(chans[i], chans[i + 1]) for i in range(depth)])
        self.up = nn.ModuleList(
            [nn.ConvTranspose2d(chans[i + 1], chans[i], 2, stride=2)
             for i in reversed(range(depth))]
        )
        self.dec = nn.ModuleList(
            [_double_conv(2 * chans[i], chans[i]) for i in reversed(range(depth))]
        )
        self.outc = nn.Conv2d(chans[0], out_ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(F.max_pool2d(skips[-1], 2)))
        x = skips.pop()
        for up, dec in zip(self.up, self.dec):
            x = dec(torch.cat([skips.pop(), up(x)], dim=1))
        return self.outc(x)


def unet_tiny(
    batch: int = 2, in_ch: int = 3, image: int = 16, base: int = 4, depth: int = 2,
    out_ch: int = 2, seed: int = 0,
) -> tuple[nn.Module, torch.Tensor]:
    """A small U-Net (max-pool down, transposed-conv up, concatenated skips)."""
    if image % 2**depth:
        raise ValueError(f"unet_tiny: image={image} must be divisible by 2**depth={2**depth}")
    model = _init_(UNet(in_ch, base, depth, out_ch), seed)
    return model, torch.randn(batch, in_ch, image, image, generator=_gen(seed))


# ---- encoder-decoder Transformer from torch.nn layers ------------------------------------------
class EncDecTransformer(nn.Module):
    def __init__(
        self, vocab: int, d_model: int, n_head: int, n_layers: int, d_ff: int, dropout: float
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.encoder = nn.ModuleList(
            [nn.TransformerEncoderLayer(d_model, n_head, d_ff, dropout, batch_first=True)
             for _ in range(n_layers)]
        )
        self.decoder = nn.ModuleList(
            [nn.TransformerDecoderLayer(d_model, n_head, d_ff, dropout, batch_first=True)
             for _ in range(n_layers)]
        )
        self.out = nn.Linear(d_model, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mem = self.embed(src)
        for layer in self.encoder:
            mem = layer(mem)
        t = tgt.shape[1]
        causal = torch.triu(torch.full((t, t), float("-inf"), device=tgt.device), diagonal=1)
        y = self.embed(tgt)
        for layer in self.decoder:
            y = layer(y, mem, tgt_mask=causal)
        return self.out(y)


def transformer_encdec(
    batch: int = 2, src_len: int = 8, tgt_len: int = 8, vocab: int = 32, d_model: int = 16,
    n_head: int = 2, n_layers: int = 1, d_ff: int = 32, dropout: float = 0.1, seed: int = 0,
) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """Encoder-decoder Transformer built from nn.TransformerEncoderLayer/DecoderLayer;
    sample ``(src_ids, tgt_ids)``, output logits."""
    model = _init_(EncDecTransformer(vocab, d_model, n_head, n_layers, d_ff, dropout), seed)
    g = _gen(seed)
    return model, (
        torch.randint(0, vocab, (batch, src_len), generator=g),
        torch.randint(0, vocab, (batch, tgt_len), generator=g),
    )


# ---- DenseNet-style dense blocks ----------------------------------------------------------------
class _DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(cin)
        self.conv = nn.Conv2d(cin, growth, 3, padding=1, bias=False)

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:
        return self.conv(F.relu(self.bn(torch.cat(feats, 1))))


class DenseNet(nn.Module):
    def __init__(self, in_ch: int, growth: int, n_blocks: int, layers: int, n_classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_ch, 2 * growth, 3, padding=1, bias=False)
        ch = 2 * growth
        blocks: list[nn.ModuleList] = []
        trans: list[nn.Module] = []
        for b in range(n_blocks):
            blocks.append(
                nn.ModuleList([_DenseLayer(ch + i * growth, growth) for i in range(layers)])
            )
            ch += layers * growth
            if b < n_blocks - 1:
                trans.append(nn.Sequential(nn.BatchNorm2d(ch), nn.ReLU(), nn.Conv2d(ch, ch // 2, 1),
                                           nn.AvgPool2d(2)))
                ch //= 2
        self.blocks = nn.ModuleList(blocks)
        self.trans = nn.ModuleList(trans)
        self.head = nn.Linear(ch, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b, block in enumerate(self.blocks):
            feats = [x]
            for layer in block:
                feats.append(layer(feats))
            x = torch.cat(feats, 1)
            if b < len(self.trans):
                x = self.trans[b](x)
        return self.head(x.mean(dim=(2, 3)))


def densenet_tiny(
    batch: int = 2, in_ch: int = 3, image: int = 16, growth: int = 4, n_blocks: int = 2,
    layers: int = 3, n_classes: int = 10, seed: int = 0,
) -> tuple[nn.Module, torch.Tensor]:
    """DenseNet-style dense blocks (every layer reads the concatenation of all earlier ones)."""
    model = _init_(DenseNet(in_ch, growth, n_blocks, layers, n_classes), seed)
    return model, torch.randn(batch, in_ch, image, image, generator=_gen(seed))


# ---- recurrent cell unrolled in a Python loop --------------------------------------------------
class RNNLoop(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int, cell: str) -> None:
        super().__init__()
        cells = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}
        if cell not in cells:
            raise ValueError(f"rnn_loop: cell must be one of {sorted(cells)}, got {cell!r}")
        self.kind = cell
        self.cell = cells[cell](d_in, hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        c = h
        for t in range(x.shape[1]):  # unrolled when traced: one copy of the cell per step
            if self.kind == "lstm":
                h, c = self.cell(x[:, t], (h, c))
            else:
                h = self.cell(x[:, t], h)
        return self.head(h)


def rnn_loop(
    batch: int = 4, steps: int = 6, d_in: int = 8, hidden: int = 16, d_out: int = 4,
    cell: str = "lstm", seed: int = 0,
) -> tuple[nn.Module, torch.Tensor]:
    """A recurrent cell (``cell``: "lstm", "gru" or "rnn", the torch.nn cells) applied step by
    step in a Python loop over a (batch, steps, d_in) sequence.

    Note: on CPU, eager ``nn.GRUCell`` updates slices of its gate tensor in place, so the whole
    gate tensor stays alive where the traced (functional) graph keeps only the slices it needs;
    plain PyTorch then peaks about one (batch, hidden) tensor per step above the traced graph.
    """
    model = _init_(RNNLoop(d_in, hidden, d_out, cell), seed)
    return model, torch.randn(batch, steps, d_in, generator=_gen(seed))


MODELS: dict[str, Callable[..., tuple[nn.Module, Any]]] = {
    "mlp": mlp,
    "cnn_bn": cnn_bn,
    "gpt2_tiny": gpt2_tiny,
    "unet_tiny": unet_tiny,
    "transformer_encdec": transformer_encdec,
    "densenet_tiny": densenet_tiny,
    "rnn_loop": rnn_loop,
}


def build(name: str, **config: Any) -> tuple[nn.Module, Any]:
    """Build a built-in model by name, e.g. ``build("gpt2_tiny", n_layer=4)``."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}"
        ) from None
    return factory(**config)
