"""HRockmate inside torch.distributed wrappers: DDP (gloo, 2 CPU processes) and FSDP2."""

from __future__ import annotations

import copy
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import hrockmate
from hrockmate import models
from hrockmate.runtime import HRockmate

WORLD = 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_TRIES = 5


def _spawn(worker: Any) -> None:
    """Run ``worker(rank, port)`` on WORLD processes. A worker killed by a signal is retried on a
    fresh port after a pause that doubles each time (1, 2, 4, 8 s): on a loaded 2-core machine
    the gloo processes sometimes abort in native code at start-up ("terminate called without an
    active exception", within 3 s of the spawn) with no Python error, once three times within
    10 s. An exception or failed assertion inside a worker still fails the test at once."""
    for attempt in range(_TRIES):
        try:
            mp.spawn(worker, args=(_free_port(),), nprocs=WORLD, join=True)
            return
        except mp.ProcessExitedException:
            if attempt == _TRIES - 1:
                raise
            time.sleep(2.0**attempt)


def _init(rank: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if os.path.exists("/sys/class/net/lo"):
        # gloo's pairs then connect over loopback, not over whichever interface the host name
        # resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def _assert_equal_grads(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert p.grad is not None and q.grad is not None, f"{what}: no grad for {name}"
        diff = (p.grad - q.grad).abs().max().item()
        scale = q.grad.abs().max().item() or 1.0
        assert diff <= 1e-6 * scale, f"{what}: grad of {name} differs by {diff}"


def _ddp_worker(rank: int, port: int) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init(rank, port)
    try:
        model, sample = models.gpt2_tiny(n_layer=1, n_embd=16, seq=8, vocab=32, dropout=0.2)
        ref = copy.deepcopy(model)
        hm = HRockmate(model, sample)
        hm.use_plan(hrockmate.recompute_all_schedule(hm.traced.graph))
        ddp = DDP(hm)
        ddp_ref = DDP(ref)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        opt_ref = torch.optim.SGD(ddp_ref.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
        for it in range(2):
            idx = torch.randint(0, 32, sample[0].shape, generator=gen)
            tgt = torch.randint(0, 32, sample[1].shape, generator=gen)
            torch.manual_seed(10 * it + rank)
            ddp(idx, tgt).backward()
            torch.manual_seed(10 * it + rank)
            ddp_ref(idx, tgt).backward()
            _assert_equal_grads(model, ref, f"rank {rank} iteration {it}")
            # the gradients really were averaged across ranks
            g = model.wte.weight.grad.clone()
            dist.all_reduce(g)
            assert torch.allclose(g / WORLD, model.wte.weight.grad, atol=1e-7)
            opt.step()
            opt_ref.step()
            opt.zero_grad(set_to_none=True)
            opt_ref.zero_grad(set_to_none=True)
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_equal_ddp_over_the_plain_model() -> None:
    _spawn(_ddp_worker)


def _fsdp_worker(rank: int, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init(rank, port)
    try:
        model, sample = models.mlp(batch=4, d_in=8, hidden=16, n_layers=2, d_out=4)
        ref = copy.deepcopy(model)
        hm = HRockmate(model, sample)
        hm.use_plan(hrockmate.recompute_all_schedule(hm.traced.graph))
        # a CPU mesh: with a GPU present, fully_shard would otherwise move the model to it
        fully_shard(hm, mesh=init_device_mesh("cpu", (WORLD,)))
        gen = torch.Generator().manual_seed(2000 + rank)
        x = torch.randn(sample.shape, generator=gen)
        hm(x).square().sum().backward()
        # reference: plain autograd on the full model, gradients averaged like FSDP does
        ref(x).square().sum().backward()
        for (name, p), q in zip(hm.named_parameters(), ref.parameters()):
            full = q.grad.clone()
            dist.all_reduce(full)
            full /= WORLD
            got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert torch.allclose(got, full, rtol=1e-6, atol=1e-7), f"rank {rank}: grad {name}"
    finally:
        dist.destroy_process_group()


def test_fsdp2_fully_shard_gradients_match() -> None:
    _spawn(_fsdp_worker)


def test_pipeline_stages_one_hrockmate_per_stage() -> None:
    """Two stages, each its own HRockmate; the second stage's sample requires grad so that its
    input gradient flows back into the first stage."""
    full, sample = models.mlp(batch=4, d_in=8, hidden=16, n_layers=3, d_out=4)
    ref = copy.deepcopy(full)
    stage1, stage2 = full[:4], full[4:]
    h1 = HRockmate(stage1, sample)
    mid_sample = stage1(sample).detach().requires_grad_()
    h2 = HRockmate(stage2, mid_sample)
    h1.use_plan(hrockmate.recompute_all_schedule(h1.traced.graph))
    h2.use_plan(hrockmate.recompute_all_schedule(h2.traced.graph))
    for _ in range(2):
        h2(h1(sample)).square().sum().backward()
        ref(sample).square().sum().backward()
    _assert_equal_grads(full, ref, "pipeline")


def _agree_worker(rank: int, port: int) -> None:
    from hrockmate.runtime.distributed import planning_per_rank

    _init(rank, port)
    try:
        model, sample = models.mlp(batch=64, d_in=16, hidden=64, n_layers=4, d_out=4)
        # the ranks ask for different budgets, so that their own plans differ
        budget = 0.5 if rank == 0 else 0.8
        with planning_per_rank():
            own = HRockmate(model, sample, budget=budget, cache=False)
        hm = HRockmate(model, sample, budget=budget, cache=False)
        mine = (list(hm.schedule.steps), hm.schedule.forward_len)
        everyone: list[Any] = [None] * WORLD
        dist.all_gather_object(everyone, (mine, list(own.schedule.steps)))
        assert everyone[0][0] == everyone[1][0], "the ranks run different schedules"
        assert everyone[0][1] != everyone[1][1], "the ranks' own plans did not differ"
        # and the schedule runs: one step, gradients as plain autograd's
        ref = copy.deepcopy(model)
        hm(sample).square().sum().backward()
        ref(sample).square().sum().backward()
        _assert_equal_grads(model, ref, f"rank {rank}")
    finally:
        dist.destroy_process_group()


def test_every_rank_runs_rank_zeros_plan() -> None:
    """With a process group of two ranks whose own plans differ, both run rank 0's."""
    _spawn(_agree_worker)


def _per_block_worker(rank: int, port: int) -> None:
    import pytest
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hrockmate.runtime.distributed import UnsupportedLayoutError

    _init(rank, port)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        # sharded per block, then wrapped: refused at construction
        model, sample = models.mlp(batch=4, d_in=8, hidden=16, n_layers=2, d_out=4)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        model(sample).sum().backward()  # (plain per-block FSDP2 trains)
        with pytest.raises(UnsupportedLayoutError, match=r"HRockmate cannot be built.*per block"
                           r".*build HRockmate first.*then fully_shard\(hmod\)"
                           r".*DistributedDataParallel\(HRockmate.*fully_shard\(HRockmate"):
            HRockmate(model, sample)
        # tracing it directly is refused the same way, before tracing could break the
        # shards' state (it did, and the model then failed in plain PyTorch too)
        with pytest.raises(UnsupportedLayoutError, match="hrockmate cannot trace this model"):
            hrockmate.trace_model(model, sample)
        model(sample).sum().backward()
        # wrapped, then sharded per block without the HRockmate module as FSDP2's root:
        # refused at the first training call, naming the root that is missing (with it, the
        # layout trains: tests/runtime/test_fsdp_blocks.py)
        model, sample = models.mlp(batch=4, d_in=8, hidden=16, n_layers=2, d_out=4)
        hm = HRockmate(model, sample)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        with pytest.raises(UnsupportedLayoutError,
                           match=r"HRockmate was called.*HRockmate module is not.*fully_shard"
                                 r"\(hmod\)"):
            hm(sample)
    finally:
        dist.destroy_process_group()


def test_per_block_fsdp2_in_the_wrong_order_is_refused_naming_the_working_one() -> None:
    _spawn(_per_block_worker)
