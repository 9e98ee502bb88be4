"""HRockmate against transformers' own gradient checkpointing, at that checkpointing's peak.

    OMP_NUM_THREADS=1 python benches/hf_checkpointing.py            # writes the JSON below
    OMP_NUM_THREADS=1 python benches/hf_checkpointing.py --defaults  # library defaults
    python benches/hf_checkpointing.py --layers 2 --seq 64 --rounds 2   # a quick look

An HF GPT-2 built from a config (no weights downloaded, dropout off, ``use_cache=False`` as
``gradient_checkpointing_enable`` sets it in training; with ``--defaults``, transformers'
defaults instead: dropout 0.1 and ``use_cache`` left at its default, ``True``, which gives
2,076 traced ops at the default sizes) runs one training step (forward and backward on one
batch) in each configuration:

- ``plain``: the model as it is;
- ``hf``: ``gradient_checkpointing_enable()`` (non-reentrant), every ``GPT2Block`` checkpointed;
- ``hrockmate@hf``: ``HRockmate(model, sample, budget)`` with the budget in bytes set to the
  peak ``hf`` measured, and ``hrockmate-layers@hf``: the same with ``method="layers"``
  (per-layer checkpointing alone, planned by hrockmate); with the output dropped, both are
  built with ``drop_outputs=True`` (the caller lets go of the logits as the forward returns),
  and ``hrockmate-with-cache@hf`` is the same model returning its cache of keys and values
  (``use_cache=True`` in the batch: the caller's choice, which keeps the cache; HRockmate
  given a budget otherwise traces a transformers model without it, as transformers'
  checkpointing trains it), which the caller drops with the logits;

each with the output held through backward (``out = model(**b); out.loss.backward()``) and
with it dropped first (``model(**b).loss.backward()``; the logits freed before backward).
The HRockmate budgets are ``hf``'s peak in the same mode. Peaks are measured with
``hrockmate.measure_peak_memory`` (activations, parameters' gradients excluded); step times
are medians of rounds in which the configurations run in turn (alternating), so that the
ratios to ``plain`` are measured side by side. Gradients are compared bitwise with plain's
from the same seed (dropout draws the same masks). Writes
``benches/results/hf_checkpointing.json`` (``hf_checkpointing_defaults.json`` with
``--defaults``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _report  # noqa: E402  (benches/_report.py)


def _model(layers: int, embd: int, heads: int, seq: int, vocab: int, defaults: bool) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # (transformers' defaults: dropout 0.1 everywhere, use_cache=True)
    off = {} if defaults else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                               "use_cache": False}
    cfg = GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, vocab_size=vocab,
                     n_positions=seq, bos_token_id=0, eos_token_id=0, **off)
    model = GPT2LMHeadModel(cfg)
    model.train()
    return model


def _step(model: Any, batch: dict[str, torch.Tensor], hold: bool) -> Callable[[], None]:
    def step() -> None:
        if hold:
            out = model(**batch)
            out.loss.backward()
            del out
        else:
            model(**batch).loss.backward()

    return step


def _peak(model: Any, batch: dict[str, torch.Tensor], hold: bool) -> int:
    import hrockmate

    step = _step(model, batch, hold)
    step()
    model.zero_grad(set_to_none=True)
    params = list(model.wrapped_model.parameters() if hasattr(model, "wrapped_model")
                  else model.parameters())
    peak = int(hrockmate.measure_peak_memory(step, params=params).peak_bytes)
    model.zero_grad(set_to_none=True)
    return peak


def dropped_of(traced: Any) -> list[int]:
    """The outputs ``drop_outputs=True`` plans without (those without a gradient)."""
    from hrockmate.planning.dropped import droppable_outputs

    with_grad = {traced.output_ids[int(key)] for kind, key in traced.sources.values()
                 if kind == "tangent"}
    return droppable_outputs(traced.graph, traced.output_ids, with_grad)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benches/hf_checkpointing.py")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--defaults", action="store_true",
                        help="the model at transformers' defaults (dropout 0.1, use_cache)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = str(Path(__file__).parent / "results" / (
            "hf_checkpointing_defaults.json" if args.defaults else "hf_checkpointing.json"))
    os.environ.setdefault("HROCKMATE_CACHE_DIR", "off")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from hrockmate import HRockmate
    from hrockmate.ir.schedule import Schedule, simulate
    from hrockmate.planning.dropped import dropped_peak, planning_graph
    from hrockmate.planning.strategies import layer_checkpoint_schedule

    base = _model(args.layers, args.embd, args.heads, args.seq, args.vocab, args.defaults)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    plain = copy.deepcopy(base)
    hf = copy.deepcopy(base)
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf.train()

    result: dict[str, Any] = {"benchmark": "hf_checkpointing"}
    rows: dict[str, dict[str, Any]] = {}
    models: dict[str, tuple[Any, bool, dict[str, Any]]] = {}
    for hold in (True, False):
        mode = "held" if hold else "dropped"
        models[f"plain/{mode}"] = (plain, hold, batch)
        models[f"hf/{mode}"] = (hf, hold, batch)
        budget = _peak(hf, batch, hold)
        # (dropping the output, the caller says so: drop_outputs=True plans without it)
        drop = {} if hold else {"drop_outputs": True}
        builds = [(f"hrockmate@hf/{mode}", drop, False),
                  (f"hrockmate-layers@hf/{mode}", {"method": "layers", **drop}, False)]
        if not hold:
            # the model at its default use_cache=True returns a cache of keys and values,
            # which transformers' checkpointing turns off; dropped with the logits
            builds.append((f"hrockmate-with-cache@hf/{mode}", drop, True))
        for name, options, use_cache in builds:
            print(f"building {name} at {budget} bytes", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            model = copy.deepcopy(base)
            own = batch
            if args.defaults:  # (the cache kept where the caller asks for it)
                own = {**batch, "use_cache": True} if use_cache else batch
            else:
                model.config.use_cache = use_cache
            try:
                hm = HRockmate(model, own, budget=budget, loss_fn="loss", cache=False,
                               **options)
            except Exception as exc:  # noqa: BLE001 - a refusal is a result here
                rows[name] = {"budget_bytes": budget, "error": f"{type(exc).__name__}: {exc}"}
                continue
            plan = hm.plan
            # per-layer checkpointing on the same op times as this plan (each build measures
            # its own): what "never slower than it" compares
            graph = hm.traced.graph
            layers = layer_checkpoint_schedule(graph)
            assert layers is not None
            layers_sched = Schedule(*layers)
            if options.get("drop_outputs"):
                drop = dropped_of(hm.traced)
                layers_sim = dropped_peak(planning_graph(graph, drop), layers_sched, drop)
            else:
                layers_sim = simulate(graph, layers_sched)
            rows[name] = {
                "budget_bytes": budget, "build_s": round(time.perf_counter() - t0, 2),
                "method": plan.method, "fallback": plan.stats.get("fallback"),
                "beats_hierarchy_plan": bool(plan.stats.get("beats_hierarchy_plan")),
                "predicted_peak_bytes": hm.predicted_peak_bytes,
                "predicted_time_ratio": round(1.0 + plan.overhead, 4),
                "hierarchy_plan_time_ratio": (
                    round(plan.stats["hierarchy_plan_time"] / plan.baseline_time, 4)
                    if plan.stats.get("hierarchy_plan_time") else None),
                "recomputed_ops": hm.recomputed_ops, "traced_ops": graph.num_ops,
                "use_cache_turned_off": bool(graph.meta.get("use_cache_turned_off")),
                "dropped_outputs": plan.stats.get("dropped_outputs", 0),
                "layers_same_times": {"peak_bytes": int(layers_sim.peak_bytes),
                                      "time_ratio": round(layers_sim.time / plan.baseline_time,
                                                          4)},
            }
            models[name] = (hm, hold, own)

    peaks = {name: _peak(m, b, hold) for name, (m, hold, b) in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for name, (m, hold, b) in models.items():  # (warm-up)
        _step(m, b, hold)()
        m.zero_grad(set_to_none=True)
    for _ in range(args.rounds):
        for name, (m, hold, b) in models.items():
            step = _step(m, b, hold)
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - t0)
                m.zero_grad(set_to_none=True)
    # bitwise: one step of each HRockmate against plain's
    ref = copy.deepcopy(base)
    torch.manual_seed(11)  # (dropout draws the same masks in each)
    ref(**batch).loss.backward()
    bitwise = {}
    for name, (m, hold, b) in models.items():
        if not name.startswith("hrockmate"):
            continue
        torch.manual_seed(11)
        _step(m, b, hold)()
        bitwise[name] = all(torch.equal(p.grad, q.grad) for p, q in
                            zip(m.wrapped_model.parameters(), ref.parameters()))
        m.zero_grad(set_to_none=True)
    result.update({
        "command": " ".join(["python benches/hf_checkpointing.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "host": _report.host(),
        "model": {"family": "transformers GPT2LMHeadModel", "layers": args.layers,
                  "embd": args.embd, "heads": args.heads, "seq": args.seq,
                  "batch": args.batch, "vocab": args.vocab,
                  "dropout": base.config.resid_pdrop, "use_cache": base.config.use_cache},
        "hrockmate": rows,
        "measured_peak_bytes": peaks,
        "peak_ratio_to_plain": {k: round(v / peaks["plain/" + k.split("/")[1]], 4)
                                for k, v in peaks.items()},
        "within_budget": {k: peaks[k] <= r["budget_bytes"] for k, r in rows.items()
                          if k in peaks},
        **_report.step_summary(times, lambda name: "plain/" + name.split("/")[1]),
        "gradients_bitwise_equal_to_plain": bitwise,
    })
    _report.write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
