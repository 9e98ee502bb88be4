"""Per-layer checkpointing as a model's own gradient checkpointing applies it: the layers found
from the module paths, its schedule, and the planner's plan never slower than it where it
fits (a tiny transformers GPT-2 at the peak of its own ``gradient_checkpointing_enable``)."""

from __future__ import annotations

from typing import Any

import copy

import pytest
import torch

import hrockmate
from hrockmate.ir.graph import Graph, Op, Tensor
from hrockmate.ir.schedule import Schedule, simulate, store_all_schedule
from hrockmate.planning import policy, strategies

transformers = pytest.importorskip("transformers")


def _gpt2(layers: int = 3, width: int = 64, seq: int = 32, vocab: int = 128,
          use_cache: bool = False, dropout: float = 0.0) -> tuple[Any, dict]:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=vocab,
                                  n_positions=seq, resid_pdrop=dropout, embd_pdrop=dropout,
                                  attn_pdrop=dropout, use_cache=use_cache, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _chain(modules: list[str]) -> Graph:
    """Forward ops in a chain, one per module path (backward ops: none are needed here)."""
    tensors = [Tensor("x", 4, "input")] + [Tensor(f"t{k}", 4, "activation")
                                           for k in range(len(modules))]
    ops = [Op(f"op{k}", "forward", 1.0, [k], [k + 1], module=m) for k, m in enumerate(modules)]
    return Graph("chain", tensors, ops)


def test_layers_are_the_children_of_the_largest_module_lists() -> None:
    modules = ["embed", "enc.layers.0.attn", "enc.layers.0.mlp", "enc.layers.1", "enc.layers.10",
               "enc.layers.10.mlp.experts.0", "enc.layers.10.mlp.experts.1", "mid",
               "dec.blocks.0", "dec.blocks.1.ff", "head", ""]
    labels = strategies.layer_labels(_chain(modules))
    # the experts' list is inside a layer; "enc.layers.1" is not a prefix of "enc.layers.10"
    assert labels == [-1, 0, 0, 1, 2, 2, 2, -1, 3, 4, -1, -1]
    assert strategies.layer_labels(_chain(["embed", "layers.0", "head"])) is None
    # the model's own checkpointing units, where the trace recorded them, come first
    g = _chain(["a.0", "a.1", "b", "c"])
    g.meta["checkpoint_layers"] = ["b", "c"]
    assert strategies.layer_labels(g) == [-1, -1, 0, 1]


@pytest.fixture(scope="module")
def gpt2_graph() -> Graph:
    model, sample = _gpt2()
    return hrockmate.trace(model, sample, loss_fn="loss", cost="estimate")


def test_per_layer_checkpointing_is_a_valid_schedule_that_plans_never_lose_to(
        gpt2_graph: Graph) -> None:
    g = gpt2_graph
    assert g.meta["checkpoint_layers"] == [f"transformer.h.{k}" for k in range(3)]
    labels = strategies.layer_labels(g)
    assert labels is not None and max(labels) == 2
    steps, fl = strategies.layer_checkpoint_schedule(g)
    sim = simulate(g, Schedule(steps, fl))  # raises on an invalid schedule
    store = simulate(g, store_all_schedule(g))
    computed = [i for k, i in steps if k == "compute"]
    for j, op in enumerate(g.ops):
        if op.phase == "backward":
            assert computed.count(j) == 1, op.name
        elif labels[j] < 0:  # outside the layers nothing runs again
            assert computed.count(j) == 1, op.name
    # every layer runs forward again (its inner values were dropped), once
    again = {labels[i] for i in computed[sum(k == "compute" for k, _ in steps[:fl]):]
             if g.ops[i].phase == "forward"}
    assert again == {0, 1, 2}
    assert sim.peak_bytes < 0.5 * store.peak_bytes and sim.time > store.time

    budget = int(sim.peak_bytes)
    # one of the simple strategies every plan is compared with and can fall back to
    simple = policy._simple_strategies(g, budget, "hrockmate")
    assert simple.lowest["layers"] == budget
    assert [c.stats["fallback"] for c, _, _ in simple.fits].count("layers") == 1
    alone = hrockmate.solve_graph(g, budget, method="layers")
    assert simulate(g, alone.schedule).peak_bytes <= budget
    # at the peak of per-layer checkpointing, the planner's plan is at least as fast
    plan = hrockmate.solve_graph(g, budget)
    planned = simulate(g, plan.schedule)
    assert planned.peak_bytes <= budget
    assert planned.time <= sim.time * (1 + 1e-9)


def test_a_graph_without_layers_is_refused_by_the_layers_method() -> None:
    g = _chain(["a", "b"])
    with pytest.raises(hrockmate.InfeasibleBudget, match="no repeated layers"):
        strategies.solve_layers(g, 10**9)


def test_tiny_gpt2_trains_bitwise_at_its_own_checkpointing_peak() -> None:
    model, sample = _gpt2()
    reference = copy.deepcopy(model)
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def peak_of(m: torch.nn.Module) -> int:
        def step() -> None:
            out = m(**sample)  # (the output held through backward, as a training loop does)
            out.loss.backward()

        step()
        m.zero_grad(set_to_none=True)
        peak = hrockmate.measure_peak_memory(step, params=list(m.parameters())).peak_bytes
        m.zero_grad(set_to_none=True)
        return int(peak)

    budget = peak_of(ckpt)
    assert budget < 0.5 * peak_of(reference)
    hm = hrockmate.HRockmate(model, sample, budget=budget, loss_fn="loss", cost="estimate",
                             cache=False)
    assert hm.predicted_peak_bytes <= budget
    out = hm(**sample)
    out.loss.backward()
    ref_out = reference(**sample)
    ref_out.loss.backward()
    assert torch.equal(out.loss, ref_out.loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    model.zero_grad(set_to_none=True)
    assert peak_of(hm) <= budget


def _dropped_peak_of(m: torch.nn.Module, sample: dict) -> int:
    """The measured peak of a step that keeps only the loss (the logits go as the forward
    returns)."""

    def step() -> None:
        m(**sample).loss.backward()

    step()
    m.zero_grad(set_to_none=True)
    peak = hrockmate.measure_peak_memory(step, params=list(m.parameters())).peak_bytes
    m.zero_grad(set_to_none=True)
    return int(peak)


def test_dropped_outputs_are_not_charged_after_the_forward(gpt2_graph: Graph) -> None:
    from hrockmate.planning import dropped

    g = gpt2_graph
    outputs = [x for x, t in enumerate(g.tensors) if t.role == "output"]
    loss = min(outputs, key=lambda x: g.tensors[g.storage_root(x)].bytes)
    drop = dropped.droppable_outputs(g, outputs, {loss})
    assert loss not in drop and drop  # the logits (a view of the head's output)
    planning = dropped.planning_graph(g, drop)
    assert all(planning.tensors[x].role == "activation" for x in drop)
    assert g.tensors[drop[0]].role == "output"  # (the traced graph is left as it is)
    store = store_all_schedule(g)
    held = simulate(g, store)
    let_go = dropped.dropped_peak(planning, store, drop)
    logits = g.tensors[g.storage_root(drop[0])].bytes
    # the backward starts without the logits: the peak (there) is lower by their bytes
    assert let_go.peak_bytes == held.peak_bytes - logits
    # a schedule of the planning graph frees them; as one of the traced graph it does not
    steps, fl = strategies.layer_checkpoint_schedule(planning)
    traced = dropped.traced_schedule(Schedule(steps, fl), drop)
    assert not any(k == "free" and i in drop for k, i in traced.steps)
    simulate(g, traced)  # valid on the traced graph
    assert dropped.dropped_peak(planning, traced, drop).peak_bytes < simulate(g, traced).peak_bytes


@pytest.mark.parametrize("use_cache", [False, True])
def test_tiny_gpt2_dropping_its_logits_trains_within_its_own_checkpointing_peak(
        use_cache: bool, caplog: pytest.LogCaptureFixture) -> None:
    # with use_cache=True passed (the caller asks for the cache) the model also returns its
    # keys and values (views of what attention's backward reads): dropped with the logits,
    # the runtime does not hold them, so the budget of transformers' checkpointing (which
    # turns the cache off) fits too; dropout on: the recomputed layers draw the masks plain
    # PyTorch drew
    model, sample = _gpt2(vocab=1024, dropout=0.1)
    reference = copy.deepcopy(model)
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    budget = _dropped_peak_of(ckpt, sample)
    sample = {**sample, "use_cache": use_cache}
    with caplog.at_level("WARNING", logger="hrockmate"):
        hm = hrockmate.HRockmate(model, sample, budget=budget, loss_fn="loss",
                                 cost="estimate", cache=False, drop_outputs=True)
    # (the cache's storage freed with what the backward reads: the caller is told that this
    # prediction is the one not exact on deep models)
    told = [r for r in caplog.records if "share storage with tensors the backward" in
            r.getMessage()]
    assert len(told) == (1 if use_cache else 0), caplog.text
    assert hm.plan.stats["dropped_outputs"] == (1 + 2 * 3 if use_cache else 1)
    assert hm.predicted_peak_bytes <= budget and hm.recomputed_ops > 0
    if use_cache:  # (their views are let go of with the caller: none is saved)
        assert hm._hr_saved_outputs == []
    torch.manual_seed(7)
    out = hm(**sample)
    torch.manual_seed(7)
    ref_out = reference(**sample)
    if use_cache:  # the cache holds this call's keys and values
        got = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        want = [t for layer in ref_out.past_key_values.layers
                for t in (layer.keys, layer.values)]
        assert len(got) == 2 * 3 and all(torch.equal(a, b) for a, b in zip(got, want))
    loss, ref_loss = out.loss, ref_out.loss
    del out, ref_out
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    model.zero_grad(set_to_none=True)
    measured = _dropped_peak_of(hm, sample)
    assert measured <= budget
    # the prediction is that of the step as run: not of one holding the logits and the cache
    assert 0.97 * hm.predicted_peak_bytes <= measured <= 1.02 * hm.predicted_peak_bytes


def _gpt2_at_library_defaults(layers: int = 2) -> tuple[Any, dict]:
    """A tiny GPT-2 at transformers' defaults: dropout 0.1, use_cache=True."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=64, n_head=2, vocab_size=1024,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    assert cfg.use_cache and cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.1
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def _held_peak_of(m: torch.nn.Module, sample: dict) -> int:
    def step() -> None:
        out = m(**sample)  # (the whole output held through backward)
        out.loss.backward()

    step()
    m.zero_grad(set_to_none=True)
    peak = hrockmate.measure_peak_memory(step, params=list(m.parameters())).peak_bytes
    m.zero_grad(set_to_none=True)
    return int(peak)


@pytest.mark.parametrize("hold", [True, False])
def test_gpt2_at_library_defaults_fits_its_own_checkpointing_peak_no_slower_than_layers(
        hold: bool, caplog: pytest.LogCaptureFixture) -> None:
    # given a budget, HRockmate traces without the cache, as transformers' checkpointing
    # trains: the plan at that checkpointing's peak fits, is predicted no slower than
    # per-layer checkpointing there, and trains bitwise with dropout on
    model, sample = _gpt2_at_library_defaults()
    reference = copy.deepcopy(model)
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    budget = _held_peak_of(ckpt, sample) if hold else _dropped_peak_of(ckpt, sample)
    options = {} if hold else {"drop_outputs": True}
    from hrockmate.integrations import use_cache as integration

    integration._told.discard(type(model))  # (told once per class)
    with caplog.at_level("WARNING", logger="hrockmate.runtime.module"):
        hm = hrockmate.HRockmate(model, sample, budget=budget, loss_fn="loss",
                                 cost="estimate", cache=False, **options)
    assert "use_cache=False" in caplog.text
    assert model.config.use_cache is True  # (restored after the trace)
    g = hm.traced.graph
    assert g.meta["use_cache_turned_off"] and len(hm.traced.output_ids) == 2  # loss, logits
    assert hm.predicted_peak_bytes <= budget and hm.recomputed_ops > 0
    assert any(op.random for op in g.ops)
    layers = Schedule(*strategies.layer_checkpoint_schedule(g))
    if hold:
        per_layer = simulate(g, layers)
    else:
        from hrockmate.planning import dropped

        drop = hm.plan.stats["dropped_output_ids"]
        per_layer = dropped.dropped_peak(dropped.planning_graph(g, drop), layers, drop)
    assert per_layer.peak_bytes <= budget  # (per-layer checkpointing fits there too)
    assert hm.plan.time <= per_layer.time * (1 + 1e-9)
    torch.manual_seed(3)
    out = hm(**sample)
    assert out.past_key_values is None and model.config.use_cache is True
    torch.manual_seed(3)
    ref_loss = reference(**sample).loss
    loss = out.loss
    if not hold:
        del out
    loss.backward()
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    model.zero_grad(set_to_none=True)
    measured = _held_peak_of(hm, sample) if hold else _dropped_peak_of(hm, sample)
    assert measured <= budget


def test_a_sample_passing_use_cache_keeps_the_cache() -> None:
    model, sample = _gpt2_at_library_defaults()
    sample = {**sample, "use_cache": True}
    # (held by the caller, the cache is charged to the end of backward: 50% is refused)
    hm = hrockmate.HRockmate(model, sample, budget=0.8, loss_fn="loss", cost="estimate",
                             cache=False)
    assert not hm.traced.graph.meta.get("use_cache_turned_off")
    assert len(hm.traced.output_ids) == 2 + 2 * 2  # and the keys and values of each layer
    out = hm(**sample)
    assert len(out.past_key_values.layers) == 2
    # without a budget (store-all: nothing is checkpointed) the model runs as it is
    plain = hrockmate.HRockmate(model, {k: v for k, v in sample.items() if k != "use_cache"},
                                loss_fn="loss", cost="estimate", cache=False)
    assert len(plain.traced.output_ids) == 2 + 2 * 2
