"""HRockmate's peak at fractional budgets against plain PyTorch's own peak.

A fractional budget is of plain PyTorch's measured peak (``capture.baseline``, docs/budget.md).
Per model, in one process, on the CPU by default:

- ``eager``: plain PyTorch's peak as a training loop runs it (``loss = model(...)``, the other
  outputs dropped, ``loss.backward()``), measured here independently of ``capture.baseline``
  after one unmeasured iteration, by the budget's measure (``hrockmate.measure_peak_memory``:
  allocations above the start of the step, parameters' ``.grad`` not counted);
- ``traced``: the traced store-all schedule's predicted peak, with the loss's gradient seed;
- per budget (1.0 and 0.5): HRockmate built with default options (measured op times, plan
  cache off), its predicted peak, its measured peak with only the loss kept (as the loop
  runs it) and with the whole output kept to the end of the step, all as x eager; the
  predicted overhead against store-all; whether one step's gradients equal plain PyTorch's
  bitwise.

The models are those of issue 60: Hugging Face GPT2LMHeadModel and BertForMaskedLM (2 layers,
width 64, 8 sequences of 128 tokens, one padded, vocabulary 512, dropout off), the hand-written
GPT of ``hrockmate.models`` (tied embeddings, its own cross-entropy) and an ``nn.GRUCell``
loop.

    python benches/eager_baseline.py                 # writes benches/results/eager_baseline.json
    python benches/eager_baseline.py --models gpt2 --budgets 1.0,0.5 --device cuda

Needs the ``models`` extra (transformers). torch runs single-threaded (``--threads``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HROCKMATE_CACHE_DIR", "off")  # every plan solved afresh

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import hrockmate  # noqa: E402
from hrockmate.runtime import HRockmate  # noqa: E402
from hrockmate.capture.baseline import traced_store_all_peak  # noqa: E402

VOCAB, BATCH, SEQ, LAYERS, WIDTH = 512, 8, 128, 2, 64


def _text_sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 3 * SEQ // 8:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def hf_gpt2() -> tuple[nn.Module, Any, Any]:
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=2, vocab_size=VOCAB,
                        n_positions=SEQ, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return tf.GPT2LMHeadModel(cfg), _text_sample(), "loss"


def hf_bert() -> tuple[nn.Module, Any, Any]:
    import transformers as tf

    cfg = tf.BertConfig(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=2,
                        intermediate_size=4 * WIDTH, vocab_size=VOCAB,
                        max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return tf.BertForMaskedLM(cfg), _text_sample(), "loss"


def gpt_tied() -> tuple[nn.Module, Any, Any]:
    from hrockmate.models import gpt2_tiny

    model, sample = gpt2_tiny(n_layer=LAYERS, n_embd=WIDTH, n_head=2, seq=SEQ, batch=BATCH,
                              vocab=VOCAB, dropout=0.0)
    return model, sample, None


def gru_loop() -> tuple[nn.Module, Any, Any]:
    from hrockmate.models import rnn_loop

    model, x = rnn_loop(cell="gru", batch=32, steps=16, d_in=16, hidden=64)
    return model, x, None


MODELS: dict[str, Callable[[], tuple[nn.Module, Any, Any]]] = {
    "hf_gpt2": hf_gpt2, "hf_bert": hf_bert, "gpt_tied": gpt_tied, "gru_loop": gru_loop,
}


def _call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, dict):
        return model(**sample)
    return model(*sample) if isinstance(sample, tuple) else model(sample)


def _loss(out: Any, loss_fn: Any) -> torch.Tensor:
    loss = out[loss_fn] if isinstance(loss_fn, str) else out
    return loss if loss.dim() == 0 else loss.square().mean()


def _peak(model: nn.Module, fn: Callable[[], Any]) -> int:
    params = list(model.parameters())
    torch.manual_seed(7)
    fn()  # lazy initialisations are not part of an iteration
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    peak = hrockmate.measure_peak_memory(fn, params=params).peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


def _loop_step(model: nn.Module, sample: Any, loss_fn: Any, keep: bool) -> Callable[[], Any]:
    """A training loop's step: only the loss kept, or the whole output (``keep``)."""
    def kept() -> Any:
        out = _call(model, sample)
        _loss(out, loss_fn).backward()
        return out

    def dropped() -> Any:
        loss = _loss(_call(model, sample), loss_fn)  # (no name holds the output object)
        loss.backward()
        return loss

    return kept if keep else dropped


def _bitwise(hm: HRockmate, ref: nn.Module, sample: Any, loss_fn: Any) -> bool:
    torch.manual_seed(100)
    _loss(_call(hm, sample), loss_fn).backward()
    torch.manual_seed(100)
    _loss(_call(ref, sample), loss_fn).backward()
    same = all((p.grad is None) == (q.grad is None)
               and (p.grad is None or torch.equal(p.grad, q.grad))
               for p, q in zip(hm.wrapped_model.parameters(), ref.parameters()))
    hm.wrapped_model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    return same


def run_model(name: str, budgets: list[float], device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, sample, loss_fn = MODELS[name]()
    model = model.to(device).train()
    sample = ({k: v.to(device) for k, v in sample.items()} if isinstance(sample, dict)
              else tuple(t.to(device) for t in sample) if isinstance(sample, tuple)
              else sample.to(device))
    reference = copy.deepcopy(model)
    eager = _peak(model, _loop_step(model, sample, loss_fn, keep=False))
    eager_kept = _peak(model, _loop_step(model, sample, loss_fn, keep=True))
    row: dict[str, Any] = {"model": name, "eager_peak_bytes": eager,
                           "eager_outputs_kept_peak_bytes": eager_kept, "budgets": []}
    for fraction in budgets:
        t0 = time.perf_counter()
        hm = HRockmate(model, sample, budget=fraction, loss_fn=loss_fn, progress=False)
        build_s = time.perf_counter() - t0
        traced = traced_store_all_peak(hm.traced.graph)
        row["traced_store_all_bytes"] = traced
        measured = _peak(model, _loop_step(hm, sample, loss_fn, keep=False))
        measured_kept = _peak(model, _loop_step(hm, sample, loss_fn, keep=True))
        plan = hm.plan
        row["budgets"].append({
            "fraction": fraction,
            "plan_eager_peak_bytes": plan.eager_peak_bytes,
            "method": plan.made_by,
            "predicted_bytes": hm.predicted_peak_bytes,
            "measured_bytes": measured,
            "measured_outputs_kept_bytes": measured_kept,
            "predicted_x_eager": round(hm.predicted_peak_bytes / eager, 4),
            "measured_x_eager": round(measured / eager, 4),
            "measured_outputs_kept_x_eager": round(measured_kept / eager, 4),
            "predicted_overhead": round(plan.overhead, 4),
            "recomputed_ops": hm.recomputed_ops,
            "gradients_bitwise": _bitwise(hm, reference, sample, loss_fn),
            "build_s": round(build_s, 2),
        })
        model.load_state_dict(reference.state_dict())
    row["traced_x_eager"] = round(row["traced_store_all_bytes"] / eager, 4)
    return row


def _table(rows: list[dict[str, Any]]) -> str:
    mib = 2**20
    lines = ["| model | eager peak | traced store-all | " + " | ".join(
        f"{b['fraction']:.0%}: measured (outputs kept) / predicted" for b in rows[0]["budgets"])
        + " |", "|---|---|---|" + "---|" * len(rows[0]["budgets"])]
    for r in rows:
        cells = [f"{b['measured_x_eager']:.3f}x ({b['measured_outputs_kept_x_eager']:.3f}x) / "
                 f"{b['predicted_x_eager']:.3f}x" for b in r["budgets"]]
        lines.append(f"| {r['model']} | {r['eager_peak_bytes'] / mib:.2f} MiB | "
                     f"{r['traced_x_eager']:.3f}x | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budgets", default="1.0,0.5")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "eager_baseline.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    budgets = [float(b) for b in args.budgets.split(",")]
    rows = []
    for name in args.models.split(","):
        rows.append(run_model(name, budgets, args.device))
        print(json.dumps(rows[-1]), file=sys.stderr)
    result = {
        "what": "HRockmate's peak at fractional budgets as x plain PyTorch's measured peak",
        "device": args.device, "threads": args.threads, "torch": torch.__version__,
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
