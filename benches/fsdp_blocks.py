"""Per-block FSDP2 (``fully_shard`` on each block, then on the root) under a plan, against plain
per-block FSDP2 and per-block FSDP2 with per-block ``torch.utils.checkpoint``; gloo, CPU.

    OMP_NUM_THREADS=1 python benches/fsdp_blocks.py            # writes the JSON below
    python benches/fsdp_blocks.py --models gpt2 --steps 3      # a quick look

Each of ``--world`` processes builds the same models; per model (an HF GPT-2 and an HF Llama
from configs, 4 layers, no weights downloaded) these layouts are measured on copies of the
same initial model, all in one process, in turn:

- ``plain``: per-block FSDP2 as torchtitan applies it;
- ``checkpointed``: the same, with transformers' per-block checkpointing (non-reentrant);
- ``hrockmate``: ``HRockmate(model, sample, budget)`` built on the unsharded model, then its
  blocks and the module sharded (the plan drives the blocks: ``hrockmate.runtime.fsdp``; its
  first call plans again with the gathered blocks charged, ``plan_with_blocks``);
- ``hrockmate_extra_gathers``: the same plan, the driver allowed one more gather per block
  (``set_extra_gathers``) where that lowers the modelled peak;
- ``hrockmate_prefetch``: the same plan, each block's all-gather issued ahead
  (``set_prefetch``);
- ``hrockmate_whole``: the same plan with ``fully_shard(hmod)`` on the whole module only
  (every parameter gathered for the whole step);
- ``hrockmate_step_budget``: planned by ``fit_step_budget`` for ``--step-budget`` (80%) of
  plain's whole step (this rank's sharded parameters plus the step peak).

``--param-dtype bfloat16``: every ``fully_shard`` (blocks and root) gets
``MixedPrecisionPolicy(param_dtype=...)``, as torchtitan applies it; the layouts are
``plain``, ``checkpointed`` and ``hrockmate`` (whose first call traces and plans the model in
that dtype; the others reuse a fixed plan, which such a policy refuses), compared with plain
per-block FSDP2 under the same policy.

Per layout: the step peak (``hrockmate.measure_peak_memory`` around one forward and backward,
rank 0: activations, gathered parameters, gradients; allocations made during the step), the
all-gathers of one step (FSDP2's ``foreach_all_gather`` calls), the median step time over
``--steps`` steps after one warm-up (all layouts in the same process, one after another; on a
shared machine only the ratios mean anything), and the largest difference of the gradients
from plain per-block FSDP2's on the same batch (relative to the gradient's largest entry).
For ``hrockmate`` also the driver's model: gathers per iteration and the most gathered block
bytes it holds at one step. Writes ``benches/results/fsdp_blocks.json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_OUT = Path(__file__).parent / "results" / "fsdp_blocks.json"


def _build(arch: str) -> tuple[Any, Any]:
    import transformers as tf

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = tf.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256, n_positions=64,
                            bos_token_id=0, eos_token_id=0)
        return tf.GPT2LMHeadModel(cfg), lambda m: m.transformer.h
    cfg = tf.LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, vocab_size=256,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                         pad_token_id=0)
    return tf.LlamaForCausalLM(cfg), lambda m: m.model.layers


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _worker(rank: int, port: int, args: argparse.Namespace, box: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["HROCKMATE_CACHE_DIR"] = "off"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    import hrockmate
    from hrockmate.capture.memory import measure_peak_memory
    from hrockmate.runtime.fsdp import (driver_for, fit_step_budget, set_extra_gathers,
                                        set_prefetch)

    mesh = init_device_mesh("cpu", (args.world,))
    policy: dict[str, Any] = {}
    if args.param_dtype:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, args.param_dtype))
    count = [0]
    original = _fsdp_param_group.foreach_all_gather

    def counting(*a: Any, **k: Any) -> Any:
        count[0] += 1
        return original(*a, **k)

    _fsdp_param_group.foreach_all_gather = counting
    results: dict[str, Any] = {}
    try:
        for arch in args.models:
            model, blocks_of = _build(arch)
            params = sum(p.numel() * p.element_size() for p in model.parameters())
            block = sum(p.numel() * p.element_size() for p in blocks_of(model)[0].parameters())
            layouts: dict[str, Any] = {}
            t0 = time.perf_counter()
            hm = hrockmate.HRockmate(copy.deepcopy(model), _batch(0), budget=args.budget,
                                     loss_fn="loss", cache=False)
            build_s = time.perf_counter() - t0
            whole = extra = ahead = fitted = None  # (a fixed plan: refused under a policy)
            if not policy:
                whole = hrockmate.HRockmate(copy.deepcopy(model), _batch(0), plan=hm.plan,
                                            loss_fn="loss", cache=False)
                extra = hrockmate.HRockmate(copy.deepcopy(model), _batch(0), plan=hm.plan,
                                            loss_fn="loss", cache=False)
                ahead = hrockmate.HRockmate(copy.deepcopy(model), _batch(0), plan=hm.plan,
                                            loss_fn="loss", cache=False)
                # (built with a budget: fit_step_budget plans again on the op times measured here)
                fitted = hrockmate.HRockmate(copy.deepcopy(model), _batch(0), budget=args.budget,
                                             loss_fn="loss", cache=False)
            checkpointed = copy.deepcopy(model)
            checkpointed.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            runs = {"plain": model, "checkpointed": checkpointed, "hrockmate": hm,
                    "hrockmate_extra_gathers": extra, "hrockmate_prefetch": ahead,
                    "hrockmate_whole": whole,
                    "hrockmate_step_budget": fitted}
            if policy:
                runs = {k: v for k, v in runs.items() if k in ("plain", "checkpointed",
                                                               "hrockmate")}
            for name, m in runs.items():
                if name != "hrockmate_whole":
                    for b in blocks_of(m):
                        fully_shard(b, mesh=mesh, **policy)
                fully_shard(m, mesh=mesh, **policy)
            if not policy:
                set_extra_gathers(extra, len(blocks_of(model)))
                set_prefetch(ahead)
            batch = _batch(rank + 1)
            grads: dict[str, list[torch.Tensor]] = {}
            fit = None
            for name, m in runs.items():
                if name in ("hrockmate_extra_gathers", "hrockmate_prefetch"):
                    # (the plan hrockmate's first call made with the gathered blocks charged)
                    m.use_plan(hm.plan)
                if name == "hrockmate_step_budget":  # (plain's whole step is measured by now)
                    step_budget = int(args.step_budget * layouts["plain"]["whole_step_bytes"])
                    fit = fit_step_budget(m, step_budget)
                torch.manual_seed(1)
                m(**batch)["loss"].backward()  # (warm-up: lazy initialisations)
                grads[name] = [p.grad.to_local().clone() for p in m.parameters()]
                m.zero_grad()
                count[0] = 0
                torch.manual_seed(1)
                peak = measure_peak_memory(lambda: m(**batch)["loss"].backward()).peak_bytes
                gathers = count[0]
                m.zero_grad()
                times = []
                for s in range(args.steps):
                    dist.barrier()
                    t = time.perf_counter()
                    m(**_batch(100 + s))["loss"].backward()
                    times.append(time.perf_counter() - t)
                    m.zero_grad()
                resident = sum(p.to_local().numel() * p.element_size() for p in m.parameters())
                layouts[name] = {"step_peak_bytes": int(peak), "all_gathers_per_step": gathers,
                                 "whole_step_bytes": int(resident + peak),
                                 "median_step_s": statistics.median(times)}
            for name in runs:
                worst = 0.0
                for g, r in zip(grads[name], grads["plain"]):
                    worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-30))
                                .item())
                layouts[name]["grad_rel_diff_vs_plain"] = worst
            driver = driver_for(hm)
            plain = layouts["plain"]
            for name, row in layouts.items():
                row["step_peak_vs_plain"] = row["step_peak_bytes"] / plain["step_peak_bytes"]
                row["step_time_vs_plain"] = row["median_step_s"] / plain["median_step_s"]
            results[arch] = {
                "parameter_bytes": int(params), "block_parameter_bytes": int(block),
                "budget": args.budget, "plan_method": hm.plan.method,
                "recomputed_ops": hm.recomputed_ops, "build_s": build_s,
                "predicted_activation_peak_bytes": int(hm.predicted_peak_bytes),
                "driver_gathers_per_iteration": driver.gathers_per_iteration,
                "driver_most_gathered_bytes": max(driver.gathered_bytes()),
                "driver_peak_with_gathered_bytes": driver.peak_with_gathered_bytes,
                "extra_gathers_driver_peak_with_gathered_bytes":
                    None if policy else driver_for(extra).peak_with_gathered_bytes,
                "prefetch_driver_peak_with_gathered_bytes":
                    None if policy else driver_for(ahead).peak_with_gathered_bytes,
                "param_dtype": args.param_dtype,
                "plan_charges_gathered_blocks": "_hr_fsdp_charged" in hm.__dict__,
                "step_budget_fraction_of_plain_whole_step": args.step_budget,
                "step_budget": dataclasses.asdict(fit) if fit is not None else None,
                "layouts": layouts,
            }
        if rank == 0:
            box.put(results)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2", "llama"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--step-budget", type=float, default=0.8,
                    help="whole-step budget of the step-budget layout, of plain's whole step")
    ap.add_argument("--param-dtype", default=None,
                    help="MixedPrecisionPolicy(param_dtype=...) on every fully_shard, e.g. "
                         "bfloat16 (then plain, checkpointed and hrockmate only)")
    ap.add_argument("--out", type=Path, default=_OUT)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    box = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(port, args, box), nprocs=args.world, join=True,
                       start_method="spawn")
    results = box.get()
    out = {
        "what": "per-block FSDP2 under a plan vs plain per-block FSDP2 (and with per-block "
                "checkpointing), gloo on CPU; step peaks on rank 0",
        "world": args.world, "steps": args.steps, "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared, loaded)",
        "models": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for arch, r in results.items():
        for name, row in r["layouts"].items():
            print(f"{arch:6s} {name:24s} peak {row['step_peak_bytes'] / 2**20:7.2f} MiB "
                  f"({row['step_peak_vs_plain']:.2f}x)  all-gathers "
                  f"{row['all_gathers_per_step']:3d}  time {row['step_time_vs_plain']:.2f}x  "
                  f"grad diff {row['grad_rel_diff_vs_plain']:.1e}  whole step "
                  f"{row['whole_step_bytes'] / 2**20:.2f} MiB")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
