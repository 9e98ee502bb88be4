"""Per-block FSDP2 (torchtitan's layout) under a plan: gloo, CPU processes.

``fully_shard`` on each transformer block of the ``HRockmate`` module and then on the module
itself; the plan gathers, reshards and reduces the blocks (``hrockmate.runtime.fsdp``). Each
check compares with the same model sharded the same way and trained by plain PyTorch.
"""

from __future__ import annotations

import copy
import os
import socket
import time
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

transformers = pytest.importorskip("transformers")

import hrockmate  # noqa: E402
from hrockmate.runtime import HRockmate  # noqa: E402

_TRIES = 5


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(worker: Callable[..., None], world: int, *args: Any) -> None:
    """Run ``worker(rank, port, world, *args)`` on ``world`` processes. Only a start-up abort
    (a process killed by a signal: gloo sometimes aborts in native code while the processes
    connect on a loaded machine) is retried, on a fresh port after a growing pause; an
    exception or failed assertion in a worker fails the test at once."""
    for attempt in range(_TRIES):
        try:
            mp.spawn(worker, args=(_free_port(), world, *args), nprocs=world, join=True)
            return
        except mp.ProcessExitedException:
            if attempt == _TRIES - 1:
                raise
            time.sleep(2.0**attempt)


def _init(rank: int, port: int, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["HROCKMATE_CACHE_DIR"] = "off"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    # a CPU mesh: with a GPU present, fully_shard would otherwise move the model to it
    return init_device_mesh("cpu", (world,))


def _gpt2(layers: int = 4, width: int = 128) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, vocab_size=256,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg), lambda m: m.transformer.h


def _llama(layers: int = 4, width: int = 64) -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=2 * width, vocab_size=256,
                                   max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                   pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg), lambda m: m.model.layers


_BUILD = {"gpt2": _gpt2, "llama": _llama}


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _shard(model: nn.Module, blocks: Any, mesh: Any, mp_policy: Any = None,
           root_policy: Any = "same", **options: Any) -> None:
    """``fully_shard`` each block (with ``options``), then the root; a ``mp_policy`` is
    given to both, as torchtitan does, unless ``root_policy`` says otherwise."""
    from torch.distributed.fsdp import fully_shard

    root_policy = mp_policy if isinstance(root_policy, str) else root_policy
    for block in blocks:
        fully_shard(block, mesh=mesh, **({} if mp_policy is None else {"mp_policy": mp_policy}),
                    **options)
    fully_shard(model, mesh=mesh, **({} if root_policy is None else {"mp_policy": root_policy}))


class _AllGathers:
    """Counts FSDP2's all-gathers (each is one collective over a parameter group)."""

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        self.where = _fsdp_param_group
        self.original = _fsdp_param_group.foreach_all_gather
        self.count = 0

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return self.original(*args, **kwargs)

        _fsdp_param_group.foreach_all_gather = counting

    def take(self) -> int:
        n, self.count = self.count, 0
        return n


def _largest_difference(a: nn.Module, b: nn.Module, of_grads: bool) -> float:
    worst = 0.0
    for (name, p), (other, q) in zip(a.named_parameters(), b.named_parameters()):
        assert name == other
        x, y = (p.grad, q.grad) if of_grads else (p, q)
        assert x is not None and y is not None, f"no gradient for {name}"
        x = x.to_local() if hasattr(x, "to_local") else x
        y = y.to_local() if hasattr(y, "to_local") else y
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item())
    return worst


def _train_worker(rank: int, port: int, world: int, arch: str, reshard: bool,
                  extra: bool = False, prefetch: bool = False) -> None:
    mesh = _init(rank, port, world)
    try:
        counter = _AllGathers()
        model, blocks_of = _BUILD[arch]()
        ref = copy.deepcopy(model)
        hm = HRockmate(model, _batch(0), loss_fn="loss", cache=False)
        # every forward op recomputed in the backward: the most the plan can interleave
        hm.use_plan(hrockmate.recompute_all_schedule(hm.traced.graph))
        assert hm.recomputed_ops > 0
        n_blocks = len(blocks_of(model))
        _shard(hm, blocks_of(hm), mesh, reshard_after_forward=reshard)
        _shard(ref, blocks_of(ref), mesh, reshard_after_forward=reshard)
        from hrockmate.runtime.fsdp import driver_for, set_extra_gathers, set_prefetch

        if extra:
            set_extra_gathers(hm, 2 * n_blocks)
        if prefetch:
            set_prefetch(hm)
        opt = torch.optim.AdamW(hm.parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            batch = _batch(100 * step + rank)  # each rank its own batch
            torch.manual_seed(step)  # (the same dropout masks for both)
            hm(**batch)["loss"].backward()
            ours = counter.take()
            torch.manual_seed(step)
            ref(**batch)["loss"].backward()
            theirs = counter.take()
            # the root's group once, each block once per pass (twice when resharded after
            # forward), as plain per-block FSDP2; more with extra gathers allowed
            assert theirs == 1 + n_blocks * (2 if reshard else 1), theirs
            assert ours == theirs if not extra else theirs < ours <= theirs + 2 * n_blocks
            diff = _largest_difference(hm, ref, of_grads=True)
            assert diff <= 1e-6, f"rank {rank} step {step}: gradients differ by {diff:.3g}"
            opt.step()
            opt_ref.step()
            opt.zero_grad()
            opt_ref.zero_grad()
        diff = _largest_difference(hm, ref, of_grads=False)
        assert diff <= 1e-6, f"rank {rank}: parameters after 3 AdamW steps differ by {diff:.3g}"
        driver = driver_for(hm)
        assert driver is not None and driver.gathers_per_iteration == ours - 1
        # in the forward, each block is gathered alone (with the next one's all-gather issued
        # ahead when prefetching), and freed after its last op when resharded after forward
        # (else all of them are held at the end of the forward)
        block_bytes = sum(p.numel() * p.element_size() for p in blocks_of(model)[0].parameters())
        forward = driver.gathered_bytes()[:hm.schedule.forward_len]
        alone = 2 * block_bytes if prefetch else block_bytes
        assert max(forward) == (alone if reshard else n_blocks * block_bytes)
        assert forward[-1] == (0 if reshard else n_blocks * block_bytes)
        if prefetch:  # (every gather but each segment's first was issued ahead)
            assert len(driver.placement.prefetch_at) == driver.gathers_per_iteration - 2
            assert not driver.pending
        # recompute-all recomputes a block's forward ops long before the block's backward:
        # with one gather per segment, some block is held from its recomputation to its
        # backward at the modelled peak; extra gathers free it there and lower that peak
        from hrockmate.runtime.fsdp import BlockDriver, blocks_of as groups_of

        once = BlockDriver(hm, groups_of(hm), extra_gathers=0, prefetch=prefetch)
        if extra:
            assert driver.peak_with_gathered_bytes < once.peak_with_gathered_bytes
        else:
            assert driver.peak_with_gathered_bytes == once.peak_with_gathered_bytes
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_per_block_fsdp2_trains_as_plain_per_block_fsdp2(arch: str) -> None:
    """Gradients after each of 3 steps and parameters after 3 AdamW steps equal plain
    per-block FSDP2's, with as many all-gathers."""
    _spawn(_train_worker, 2, arch, True)


def test_reshard_after_forward_false_keeps_blocks_gathered_into_backward() -> None:
    _spawn(_train_worker, 2, "gpt2", False)


def test_extra_gathers_free_blocks_between_their_recomputation_and_backward() -> None:
    _spawn(_train_worker, 2, "gpt2", True, True)


def test_four_processes() -> None:
    _spawn(_train_worker, 4, "llama", True)


def test_prefetch_issues_the_same_all_gathers_ahead() -> None:
    """``set_prefetch``: each block's all-gather is issued when the block before it is
    gathered; gradients and parameters as plain per-block FSDP2's, as many all-gathers, and
    two blocks counted as gathered at once in the forward."""
    _spawn(_train_worker, 2, "gpt2", True, False, True)


def _llama128() -> tuple[nn.Module, Callable[[nn.Module], Any]]:
    return _llama(width=128)


def _long_batch(seed: int) -> dict[str, torch.Tensor]:
    """4 x 32 tokens: the activations outweigh a block's parameters, as in training (at
    2 x 32 the gradients and FSDP2's buffers are as large as the activations, and no
    activation plan moves the step's peak far)."""
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _budget_worker(rank: int, port: int, world: int, arch: str) -> None:
    from hrockmate.capture.memory import measure_peak_memory

    mesh = _init(rank, port, world)
    try:
        counter = _AllGathers()
        model, blocks_of = {"gpt2": _gpt2, "llama": _llama128}[arch]()
        plain = copy.deepcopy(model)
        checkpointed = copy.deepcopy(model)
        checkpointed.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        hm = HRockmate(model, _long_batch(0), budget=0.5, loss_fn="loss", cache=False)
        assert hm.recomputed_ops > 0
        peaks, gathers = {}, {}
        batch = _long_batch(rank)
        for name, m in (("hrockmate", hm), ("plain", plain), ("checkpointed", checkpointed)):
            _shard(m, blocks_of(m), mesh)
            m(**batch)["loss"].backward()  # (first calls: lazy initialisations)
            m.zero_grad()
            counter.take()
            peaks[name] = measure_peak_memory(lambda: m(**batch)["loss"].backward()).peak_bytes
            gathers[name] = counter.take()
        assert gathers["hrockmate"] <= gathers["checkpointed"], gathers
        # the first call planned again with the gathered blocks charged: the schedule's
        # memory plus the blocks gathered at each step beyond one fit the budget
        from hrockmate.runtime.fsdp import driver_for

        driver = driver_for(hm)
        assert "_hr_fsdp_charged" in hm.__dict__
        block_bytes = sum(p.numel() * p.element_size() for p in blocks_of(model)[0].parameters())
        assert hm.predicted_peak_bytes <= hm.plan.budget_bytes
        assert (driver.peak_with_gathered_bytes + driver.program.extra_bytes
                <= hm.plan.budget_bytes + block_bytes), (driver.peak_with_gathered_bytes,
                                                         hm.plan.budget_bytes)
        assert max(driver.gathered_bytes()) <= 2 * block_bytes
        assert peaks["hrockmate"] <= 0.8 * peaks["plain"], peaks
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_half_budget_step_peak_is_at_most_0_8x_plain_without_more_all_gathers(arch: str) -> None:
    """At 50% (the gathered blocks charged in the budget), the measured step peak
    (activations, gathered parameters, gradients) is at most 0.8x plain per-block FSDP2's, at
    most two blocks are gathered at once, and the plan gathers no more often than per-block
    torch.utils.checkpoint does."""
    _spawn(_budget_worker, 2, arch)


def _mixed_precision_worker(rank: int, port: int, world: int, arch: str, reshard: bool,
                            policy: dict[str, Any], blocks_only: bool = False) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hrockmate.runtime.fsdp import driver_for

    mesh = _init(rank, port, world)
    try:
        counter = _AllGathers()
        model, blocks_of = _BUILD[arch]()
        ref = copy.deepcopy(model)
        hm = HRockmate(model, _batch(0), loss_fn="loss", cache=False)
        n_blocks = len(blocks_of(model))
        mp = MixedPrecisionPolicy(**policy)
        root = None if blocks_only else mp
        _shard(hm, blocks_of(hm), mesh, mp, root, reshard_after_forward=reshard)
        _shard(ref, blocks_of(ref), mesh, mp, root, reshard_after_forward=reshard)
        def hooks() -> list[tuple[Any, ...]]:
            return [(tuple(b._forward_pre_hooks), tuple(b._forward_hooks))
                    for b in blocks_of(hm)]

        sharded_hooks = hooks()
        opt = torch.optim.AdamW(hm.parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(3):
            batch = _batch(100 * step + rank)
            torch.manual_seed(step)
            hm(**batch)["loss"].backward()
            ours = counter.take()
            assert hooks() == sharded_hooks  # (FSDP2's hooks back after the trace)
            torch.manual_seed(step)
            ref(**batch)["loss"].backward()
            theirs = counter.take()
            assert theirs == 1 + n_blocks * (2 if reshard else 1), theirs
            # the first call also gathers each block once to trace the model as it runs
            assert ours == theirs + (n_blocks if step == 0 else 0), (step, ours, theirs)
            diff = _largest_difference(hm, ref, of_grads=True)
            assert diff == 0.0, f"rank {rank} step {step}: gradients differ by {diff:.3g}"
            opt.step()
            opt_ref.step()
            opt.zero_grad()
            opt_ref.zero_grad()
            if step == 0:
                # traced as it runs: each parameter of the graph a tensor of its gathered
                # dtype (bf16 in the blocks; the root's too unless it has no policy)
                graph = hm.traced.graph
                in_blocks = {id(p) for b in blocks_of(model) for p in b.parameters()}
                numel = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
                named = dict(model.named_parameters(remove_duplicate=False))
                for tid, (kind, name) in hm.traced.sources.items():
                    if kind != "param":
                        continue
                    t = graph.tensors[int(tid)]
                    bf16 = not blocks_only or id(named[name]) in in_blocks
                    assert t.dtype.removeprefix("torch.") == ("bfloat16" if bf16 else "float32")
                    if t.alias_of is None:
                        assert t.bytes == numel[name] * (2 if bf16 else 4), (name, t.bytes)
                # then every forward op recomputed in the backward, for the later steps
                hm.use_plan(hrockmate.recompute_all_schedule(graph))
                assert hm.recomputed_ops > 0
        diff = _largest_difference(hm, ref, of_grads=False)
        assert diff == 0.0, f"rank {rank}: parameters after 3 AdamW steps differ by {diff:.3g}"
        driver = driver_for(hm)
        assert driver is not None and driver.gathers_per_iteration == ours - 1
        # the gathered blocks are counted in param_dtype (half the fp32 parameters' bytes)
        block_bytes = sum(p.numel() * 2 for p in blocks_of(model)[0].parameters())
        forward = driver.gathered_bytes()[:hm.schedule.forward_len]
        assert max(forward) == (block_bytes if reshard else n_blocks * block_bytes)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_bf16_param_dtype_policy_trains_as_plain_per_block_fsdp2(arch: str) -> None:
    """``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` on the blocks and the root: the
    first call traces the model in bf16; gradients after each of 3 steps (a store-all plan,
    then recompute-all) and parameters after 3 AdamW steps are bitwise plain per-block
    FSDP2's with the same policy, with as many all-gathers after the first call."""
    _spawn(_mixed_precision_worker, 2, arch, True, {"param_dtype": torch.bfloat16})


def test_bf16_params_with_fp32_reduction_kept_gathered_into_backward() -> None:
    _spawn(_mixed_precision_worker, 2, "llama", False,
           {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32})


def test_bf16_blocks_casting_their_outputs_to_fp32_under_an_fp32_root() -> None:
    """Only the blocks in bf16 (their inputs cast to bf16, their outputs to fp32), the
    embeddings, final norm and head in fp32."""
    _spawn(_mixed_precision_worker, 2, "gpt2", True,
           {"param_dtype": torch.bfloat16, "output_dtype": torch.float32}, True)


def _whole_module_policy_worker(rank: int, port: int, world: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _init(rank, port, world)
    try:
        model, _ = _llama()
        ref = copy.deepcopy(model)
        hm = HRockmate(model, _batch(0), loss_fn="loss", cache=False)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        fully_shard(hm, mesh=mesh, mp_policy=mp)
        fully_shard(ref, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(hm.parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(2):
            batch = _batch(100 * step + rank)
            hm(**batch)["loss"].backward()
            ref(**batch)["loss"].backward()
            diff = _largest_difference(hm, ref, of_grads=True)
            assert diff == 0.0, f"rank {rank} step {step}: gradients differ by {diff:.3g}"
            if step == 0:
                hm.use_plan(hrockmate.recompute_all_schedule(hm.traced.graph))
                dtypes = {hm.traced.graph.tensors[int(t)].dtype
                          for t, (kind, _) in hm.traced.sources.items() if kind == "param"}
                assert {d.removeprefix("torch.") for d in dtypes} == {"bfloat16"}, dtypes
            for o in (opt, opt_ref):
                o.step()
                o.zero_grad()
        diff = _largest_difference(hm, ref, of_grads=False)
        assert diff == 0.0, f"rank {rank}: parameters after 2 AdamW steps differ by {diff:.3g}"
    finally:
        dist.destroy_process_group()


def test_a_bf16_policy_on_the_whole_module_trains_as_plain_fsdp2() -> None:
    """``fully_shard(hmod, mp_policy=...)`` alone: traced in bf16 at the first call too."""
    _spawn(_whole_module_policy_worker, 2)


def _mixed_budget_worker(rank: int, port: int, world: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hrockmate.runtime.fsdp import driver_for

    mesh = _init(rank, port, world)
    try:
        counter = _AllGathers()
        model, blocks_of = _gpt2(layers=2)
        ref = copy.deepcopy(model)
        hm = HRockmate(model, _long_batch(0), budget=0.5, loss_fn="loss", cache=False)
        fp32_budget = hm.plan.budget_bytes
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        _shard(hm, blocks_of(hm), mesh, mp)
        _shard(ref, blocks_of(ref), mesh, mp)
        n_blocks = len(blocks_of(model))
        for step in range(2):
            batch = _long_batch(10 * step + rank)
            torch.manual_seed(step)
            hm(**batch)["loss"].backward()
            ours = counter.take()
            torch.manual_seed(step)
            ref(**batch)["loss"].backward()
            theirs = counter.take()
            assert ours == theirs + (n_blocks if step == 0 else 0), (step, ours, theirs)
            diff = _largest_difference(hm, ref, of_grads=True)
            assert diff == 0.0, f"rank {rank} step {step}: gradients differ by {diff:.3g}"
            hm.zero_grad()
            ref.zero_grad()
        # planned again at the first call, for half of the bf16 graph's store-all peak (most
        # activations' bytes halve), the op times measured on the bf16 ops, and the gathered
        # blocks charged (in bf16) by the driver's replan
        assert hm.recomputed_ops > 0 and hm.plan.method not in ("store-all", "given")
        assert hm.traced.graph.meta.get("cost_report", {}).get("mode") == "measure"
        assert hm.plan.budget_bytes < 0.75 * fp32_budget, (hm.plan.budget_bytes, fp32_budget)
        assert "_hr_fsdp_charged" in hm.__dict__
        block_bytes = sum(p.numel() * 2 for p in blocks_of(model)[0].parameters())
        driver = driver_for(hm)
        assert driver is not None and max(driver.gathered_bytes()) <= 2 * block_bytes
    finally:
        dist.destroy_process_group()


def test_a_half_budget_under_a_bf16_policy_is_planned_for_the_bf16_graph() -> None:
    """Built for 50% before sharding: the first call plans the bf16 graph for half of its
    store-all peak, with bitwise plain per-block FSDP2 gradients."""
    _spawn(_mixed_budget_worker, 2)


def _refusal_worker(rank: int, port: int, world: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hrockmate.runtime.distributed import UnsupportedLayoutError
    from hrockmate.runtime.fsdp import StepBudgetError, fit_step_budget, plan_with_blocks

    mesh = _init(rank, port, world)
    try:
        model, blocks_of = _gpt2(layers=1, width=32)
        hm = HRockmate(model, _batch(0), loss_fn="loss", cache=False)
        _shard(hm, blocks_of(hm), mesh,
               mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        # before the first call the graph is of fp32 parameters: planning it for the step
        # would cost what does not run
        with pytest.raises(UnsupportedLayoutError, match=r"bfloat16.*first training call"):
            plan_with_blocks(hm, 0.5)
        # a whole-step budget needs the op times measured before sharding (built for
        # store-all, this module never measured them)
        with pytest.raises(StepBudgetError, match=r"op times were not measured.*budget"):
            fit_step_budget(hm, 10**9)
        # a fixed plan is of the fp32 graph
        model, blocks_of = _gpt2(layers=1, width=32)
        sample = {**_batch(0), "use_cache": False}  # (the same graph with a plan as without)
        plain = HRockmate(model, sample, loss_fn="loss", cache=False)
        fixed = HRockmate(model, sample, plan=plain.schedule, loss_fn="loss", cache=False)
        _shard(fixed, blocks_of(fixed), mesh,
               mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        with pytest.raises(UnsupportedLayoutError, match=r"fixed plan=.*bfloat16.*budget"):
            fixed(**sample)
    finally:
        dist.destroy_process_group()


def test_a_fixed_plan_under_a_param_dtype_policy_and_unmeasured_step_fit_are_refused(
) -> None:
    _spawn(_refusal_worker, 2)


def _step_budget_worker(rank: int, port: int, world: int) -> None:
    from hrockmate.capture.memory import measure_peak_memory
    from hrockmate.runtime.fsdp import fit_step_budget

    mesh = _init(rank, port, world)
    try:
        cfg = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=256,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        blocks_of = lambda m: m.transformer.h  # noqa: E731
        plain = copy.deepcopy(model)

        def long_batch(seed: int) -> dict[str, torch.Tensor]:  # (activations outweigh weights)
            ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(seed))
            return {"input_ids": ids, "labels": ids}

        hm = HRockmate(model, long_batch(0), budget=0.5, loss_fn="loss", cache=False)
        batch = long_batch(rank)

        def step_bytes(m: nn.Module) -> int:
            """This rank's sharded parameters, held across steps, and what one step allocates
            (gathered parameters, activations, gradients: .grad is None before it)."""
            m.zero_grad(set_to_none=True)
            resident = sum(p.to_local().numel() * p.element_size() for p in m.parameters())
            peak = measure_peak_memory(lambda: m(**batch)["loss"].backward()).peak_bytes
            return resident + peak

        _shard(plain, blocks_of(plain), mesh)
        plain(**batch)["loss"].backward()
        whole = step_bytes(plain)
        _shard(hm, blocks_of(hm), mesh)
        budget = int(0.8 * whole)  # (fit_step_budget plans for the smallest of the ranks')
        fit = fit_step_budget(hm, budget)
        assert fit.step_bytes <= fit.step_budget <= budget
        assert fit.activation_budget < fit.step_budget - fit.resident_bytes
        hm(**batch)["loss"].backward()
        measured = step_bytes(hm)
        assert fit.step_budget <= budget and measured <= fit.step_budget, (measured, fit)
        # and every rank runs the plan it fitted
        steps: list[Any] = [None] * world
        dist.all_gather_object(steps, list(hm.schedule.steps))
        assert all(s == steps[0] for s in steps)
    finally:
        dist.destroy_process_group()


def test_a_whole_step_budget_bounds_the_measured_step() -> None:
    """``fit_step_budget``: at 80% of plain per-block FSDP2's whole step (sharded parameters,
    gathered parameters, activations, gradients), the measured step fits."""
    _spawn(_step_budget_worker, 2)


def test_compiled_mode_with_sharded_blocks_is_refused_naming_eager_mode(monkeypatch) -> None:
    # The driver's gathers are lines of the eager program; a compiled module with sharded
    # blocks must say so at its first call rather than run without gathering.
    from hrockmate.capture.layout import UnsupportedLayoutError
    from hrockmate.runtime import fsdp

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    hmod = HRockmate(model, torch.randn(4, 8), cache=False)
    hmod.__dict__["_hr_inductor"] = True
    monkeypatch.setattr(fsdp, "blocks_of", lambda m: [object()])
    with pytest.raises(UnsupportedLayoutError, match="compile=False"):
        fsdp.driver_for(hmod)
    hmod.__dict__["_hr_inductor"] = False
    hmod.__dict__.pop("_hr_fsdp_driver", None)
    monkeypatch.setattr(fsdp, "blocks_of", lambda m: [])
    assert fsdp.driver_for(hmod) is None
