"""transformers' Trainer over HRockmate, against the plain Trainer and the Trainer's own
``gradient_checkpointing=True``, paired in one process.

    OMP_NUM_THREADS=1 python benches/training_scripts.py            # writes the JSON below
    python benches/training_scripts.py --layers 2 --steps 6 --rounds 2   # a quick look

An HF GPT-2 built from a config (no weights downloaded, dropout off) is trained by
``transformers.Trainer`` at its default TrainingArguments (``remove_unused_columns=True``,
``num_items_in_batch`` passed to the model): plain, with ``gradient_checkpointing=True``, and
wrapped in ``HRockmate(model, sample, budget)`` at each of ``--budgets`` (50%, and 33%: about
the peak of checkpointing every block). The configurations run in turn, in rounds, each round
a few Trainer steps, on copies of the same initial model; the step time is each
configuration's median step (callback-timed; the first steps of each Trainer run are left out:
the first holds the re-trace for ``num_items_in_batch``). After training, the parameters of
each HRockmate run are compared bitwise with the plain run's. One training step of each
configuration (forward and backward on the same batch, outside Trainer) is measured for its
activation peak with ``hrockmate.measure_peak_memory``. The build time of each HRockmate
(trace, op times, plan) is reported beside it. Writes ``benches/results/training_scripts.json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (benches/_report.py)


def _model(layers: int, embd: int, seq: int, vocab: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=layers, n_embd=embd, n_head=4, vocab_size=vocab, n_positions=seq,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _rows(n: int, seq: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        rows.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long),
                     "labels": ids.clone()})
    return rows


def _train(model: Any, rows: list[dict[str, torch.Tensor]], steps: int, batch: int,
           checkpointing: bool, out: str) -> list[float]:
    """Step times (s) of one Trainer run of ``steps`` steps."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter() - self.t)

    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                             use_cpu=True, report_to=[], save_strategy="no", seed=0, data_seed=0,
                             disable_tqdm=True, gradient_checkpointing=checkpointing,
                             logging_strategy="no")
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[Clock()]).train()
    return times


def _peak(model: Any, batch: dict[str, torch.Tensor]) -> int:
    import hrockmate

    def step() -> None:
        model(**batch).loss.backward()

    step()
    model.zero_grad(set_to_none=True)
    return int(hrockmate.measure_peak_memory(step, params=list(model.parameters())).peak_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benches/training_scripts.py")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budgets", default="0.5,0.33",
                        help="HRockmate budgets (fractions of the store-all peak), comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="Trainer steps per round")
    parser.add_argument("--skip", type=int, default=2, help="first steps of a run left out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"
                                             / "training_scripts.json"))
    args = parser.parse_args(argv)
    os.environ.setdefault("HROCKMATE_CACHE_DIR", "off")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from hrockmate import HRockmate

    base = _model(args.layers, args.embd, args.seq, args.vocab)
    rows = _rows(args.batch * args.steps, args.seq, args.vocab)
    sample = {k: torch.stack([r[k] for r in rows[:args.batch]]) for k in rows[0]}
    models: dict[str, Any] = {"plain": copy.deepcopy(base), "checkpointing": copy.deepcopy(base)}
    built: dict[str, dict[str, Any]] = {}
    for budget in (float(b) for b in args.budgets.split(",")):
        t0 = time.perf_counter()
        hm = HRockmate(copy.deepcopy(base), sample, budget=budget, cache=False, loss_fn="loss")
        name = f"hrockmate@{budget:g}"
        built[name] = {"budget": budget, "build_s": round(time.perf_counter() - t0, 3)}
        models[name] = hm

    steps: dict[str, list[float]] = {k: [] for k in models}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for name, model in models.items():
                times = _train(model, rows, args.steps, args.batch, name == "checkpointing",
                               os.path.join(tmp, name))
                steps[name] += times[args.skip:]
    bitwise = {name: all(torch.equal(p, q) for p, q in zip(models["plain"].parameters(),
                                                             models[name].parameters()))
               for name in built}
    # (as Trainer calls the model: the count of the shifted labels, divided into a float)
    batch = {**sample, "num_items_in_batch": sample["labels"][:, 1:].ne(-100).sum() / 1}
    ckpt = models["checkpointing"]
    ckpt.gradient_checkpointing_enable()
    ckpt.train()
    peaks = {"plain": _peak(models["plain"], batch), "checkpointing": _peak(ckpt, batch)}
    for name in built:
        hm = models[name]
        peaks[name] = _peak(hm, batch)
        # (after training: the plan in use, made again with num_items_in_batch as an input)
        built[name].update(method=hm.plan.method, recomputed_ops=hm.recomputed_ops,
                           predicted_peak_bytes=hm.predicted_peak_bytes)
    result = {
        "benchmark": "training_scripts",
        "command": " ".join(["python benches/training_scripts.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "host": _report.host(),
        "model": {"family": "transformers GPT2LMHeadModel", "layers": args.layers,
                  "embd": args.embd, "seq": args.seq, "vocab": args.vocab,
                  "batch": args.batch},
        "hrockmate": built,
        **_report.step_summary(steps, lambda name: "plain"),
        "measured_peak_bytes": peaks,
        "peak_ratio_to_plain": {k: round(v / peaks["plain"], 4) for k, v in peaks.items()},
        "parameters_bitwise_equal_to_plain": bitwise,
    }
    _report.write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
