"""Runtime overhead: HRockmate at a budget >= the store-all peak versus plain eager autograd.

Both run one full training iteration (forward, backward, no optimizer step) on the same model
in the same process, alternating between the two so that machine noise hits both alike; the
result is the median iteration time of each and their ratio. Writes JSON to
``bench-results/runtime_overhead.json`` (or ``--out``).

    python benches/runtime_overhead.py                      # default models, CPU
    python benches/runtime_overhead.py --device cuda --iters 50
    python benches/runtime_overhead.py --models gpt2 --scale 2
    python benches/runtime_overhead.py --device cuda --zoo large --models unet resnet_bn

Besides the whole iteration, the host time of the forward call alone is recorded (on CUDA the
kernels run asynchronously, so this is the Python work a step does before and while it
launches the forward: for hrockmate the per-call checks and the forward segment's dispatch).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from hrockmate import models
from hrockmate.runtime import HRockmate
from hrockmate.zoo import SIZES, ZOO


def _configs(scale: int) -> dict[str, Callable[[], tuple[nn.Module, Any]]]:
    """Models big enough that an iteration is dominated by compute, not by Python."""
    return {
        "gpt2": lambda: models.gpt2_tiny(
            n_layer=4, n_embd=128 * scale, n_head=4, seq=128, batch=8, vocab=512, dropout=0.1
        ),
        "cnn_bn": lambda: models.cnn_bn(batch=16, image=32, width=32 * scale, n_blocks=4),
        "mlp": lambda: models.mlp(batch=256, d_in=512, hidden=1024 * scale, n_layers=4, d_out=10),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _call(model: nn.Module, sample: Any) -> Any:
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    return model(sample)


def _step(model: nn.Module, sample: Any) -> float:
    """One iteration; returns the host seconds of the forward call."""
    t = time.perf_counter()
    out = _call(model, sample)
    forward_s = time.perf_counter() - t
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.requires_grad]
    loss = sum(x.float().mean() for x in leaves)
    loss.backward()
    return forward_s


def bench_model(
    name: str, factory: Callable[[], tuple[nn.Module, Any]], device: torch.device,
    iters: int, warmup: int,
) -> dict[str, Any]:
    model, sample = factory()
    model.to(device)
    sample = pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, sample)
    t0 = time.perf_counter()
    hm = HRockmate(model, sample, budget=1.0)  # 100% of store-all: the store-all schedule
    build_s = time.perf_counter() - t0
    eager_t: list[tuple[float, float]] = []
    hr_t: list[tuple[float, float]] = []
    pair = [(model, eager_t), (hm, hr_t)]
    for i in range(warmup + iters):
        for mod, sink in pair if i % 2 == 0 else pair[::-1]:  # alternate who goes first
            _timed(mod, sample, device, sink, keep=i >= warmup)
    eager = statistics.median(t for t, _ in eager_t)
    hr = statistics.median(t for t, _ in hr_t)
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "ops": hm.traced.graph.num_ops,
        "backward_chunks": len(hm._hr_program.chunks),
        "eager_median_s": eager,
        "hrockmate_median_s": hr,
        "overhead": hr / eager - 1.0,
        "eager_forward_host_median_s": statistics.median(f for _, f in eager_t),
        "hrockmate_forward_host_median_s": statistics.median(f for _, f in hr_t),
        "build_s": build_s,
        "iters": iters,
    }


def _timed(mod: nn.Module, sample: Any, device: torch.device, sink: list[tuple[float, float]],
           keep: bool) -> None:
    mod.zero_grad(set_to_none=True)  # a step that finds gradients also pays for accumulating
    _sync(device)
    t = time.perf_counter()
    forward_s = _step(mod, sample)
    _sync(device)
    if keep:
        sink.append((time.perf_counter() - t, forward_s))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="*", default=None,
                   help="subset of: gpt2 cnn_bn mlp (with --zoo: of hrockmate.zoo's models)")
    p.add_argument("--zoo", choices=SIZES, default=None,
                   help="use hrockmate.zoo's models (the bench command's) at this size")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--scale", type=int, default=1, help="width multiplier of the models")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--out", default="bench-results/runtime_overhead.json")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    device = torch.device(ns.device)
    if ns.zoo:
        configs = {name: functools.partial(spec.build, ns.zoo) for name, spec in ZOO.items()}
    else:
        configs = _configs(ns.scale)
    names = ns.models or list(configs)
    unknown = [n for n in names if n not in configs]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(configs)}")
    results = []
    for name in names:
        r = bench_model(name, configs[name], device, ns.iters, ns.warmup)
        results.append(r)
        print(
            f"{name:8s} eager {1e3 * r['eager_median_s']:9.3f} ms   hrockmate "
            f"{1e3 * r['hrockmate_median_s']:9.3f} ms   overhead {100 * r['overhead']:+6.2f}%"
            f"   ({r['ops']} ops, {r['backward_chunks']} backward chunks; forward call on the "
            f"host {1e3 * r['eager_forward_host_median_s']:.3f} / "
            f"{1e3 * r['hrockmate_forward_host_median_s']:.3f} ms)"
        )
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "runtime_overhead",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
        platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
