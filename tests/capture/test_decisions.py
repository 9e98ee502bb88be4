"""Random decisions (LayerDrop): traced once per outcome of each, run as plain PyTorch runs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import hrockmate
from hrockmate.capture.memory import measure_peak_memory
from hrockmate.capture.joint import TraceError
from hrockmate.capture.trace import trace_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Layer(nn.Module):
    def __init__(self, width: int, context: bool) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width) if context else None

    def forward(self, x: torch.Tensor, ctx: torch.Tensor | None) -> torch.Tensor:
        h = nn.functional.dropout(self.outer(torch.relu(self.inner(x))), 0.2, self.training)
        if ctx is not None and self.mix is not None:
            h = h + self.mix(ctx)  # (every layer reads ctx: its gradient sums over the layers)
        return self.norm(x + h)


class _LayerDropNet(nn.Module):
    """Layers skipped each with ``probability`` while training, decided on ``torch.rand`` as
    transformers' LayerDrop does; with ``context``, every layer also reads one tensor made
    before them (an encoder's output for cross-attention, WavLM's position bias), whose
    gradient gets nothing from skipped layers and is missing when all are."""

    def __init__(self, width: int = 32, layers: int = 4, probability: float = 0.5,
                 context: bool = False, cache: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.context = nn.Linear(width, width) if context else None
        self.layers = nn.ModuleList(_Layer(width, context) for _ in range(layers))
        self.head = nn.Linear(width, 1)
        self.probability = probability
        self.cache = cache

    def forward(self, x: torch.Tensor) -> Any:
        h = self.embed(x)
        ctx = torch.tanh(self.context(x)) if self.context is not None else None
        kept = []
        for layer in self.layers:
            skip = False
            if self.training:
                skip = torch.rand([]) < self.probability
            if not skip:
                h = layer(h, ctx)
                kept.append(h[:, :2])  # (like a cache of keys per layer run)
        loss = self.head(h).square().mean()
        return (loss, kept) if self.cache else loss


def _generators(device: torch.device) -> list[torch.Tensor]:
    """The states of the generators a step on ``device`` draws from."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _steps_equal(hm: hrockmate.HRockmate, ref: nn.Module, x: torch.Tensor, seeds: range
                 ) -> list[int]:
    """Trains both a step per seed (the same seed before each), asserting losses, gradients
    (None where plain PyTorch leaves None) and the generator afterwards equal; returns how
    many parameters got no gradient at each step."""
    model = hm.wrapped_model
    missing = []
    for seed in seeds:
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss = hm(x)
        loss.backward()
        state = _generators(x.device)
        torch.manual_seed(seed)
        ref_loss = ref(x)
        ref_loss.backward()
        assert all(torch.equal(a, b) for a, b in zip(state, _generators(x.device)))
        assert torch.equal(loss, ref_loss), seed
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (seed, name)
            assert p.grad is None or torch.equal(p.grad, q.grad), (seed, name)
        missing.append(sum(q.grad is None for q in ref.parameters()))
    return missing


@pytest.mark.parametrize("plan,device", [
    ("budget", "cpu"), ("recompute_all", "cpu"),
    pytest.param("budget", "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_layerdrop_trains_as_plain_pytorch(plan: str, device: str) -> None:
    """Each decision is traced both ways; a call skips the regions its draws skip, whatever
    the plan recomputes (it was refused: "set layerdrop to 0.0"). On CUDA the decisions
    still draw on the CPU's generator and the dropouts on the GPU's, as in eager."""
    torch.manual_seed(0)
    model, x = _LayerDropNet().to(device), torch.randn(64, 32, device=device)
    ref = copy.deepcopy(model)
    hm = hrockmate.HRockmate(model, (x,), budget=0.6, cache=False)
    regions = hm.traced.skippable
    assert [r.index for r in regions] == [0, 1, 2, 3]
    assert all(r.ops and r.stands_for and not r.taken for r in regions)
    assert all(len(r.lost_grads) == 6 for r in regions)  # (each layer's own 6 parameters)
    if plan == "recompute_all":
        hm.use_plan(hrockmate.recompute_all_schedule(hm.traced.graph))
    assert hm.recomputed_ops > 0
    missing = _steps_equal(hm, ref, x, range(8))
    assert len(set(missing)) >= 3 and max(missing) >= 18  # (1, 2, 3... layers skipped)


def test_a_call_that_skips_stays_within_the_predicted_peak() -> None:
    """A skipped layer's output is its input: where the plan has freed that input and runs
    the layer again later (in the backward), a call that skips keeps the input from there to
    that run. Kept from the draw to the layer's last run instead, a call that skipped layers
    measured up to 131 KiB above the predicted peak here (seeds 8 and 13); the stand-ins are
    now kept only where the plan freed them, and what they can still add is counted."""
    torch.manual_seed(0)
    model, x = _LayerDropNet(width=64, layers=5), torch.randn(64, 8, 64)
    ref = copy.deepcopy(model)
    hm = hrockmate.HRockmate(model, (x,), budget=0.3, cache=False)
    params = list(hm.wrapped_model.parameters())
    one = torch.ones(())  # (the loss's gradient, made before the step as a tangent is)
    skipped = set()
    for seed in range(16):
        torch.manual_seed(seed)
        skipped.add(sum(bool(torch.rand([]) < 0.5) for _ in range(5)))
        torch.manual_seed(seed)
        peak = measure_peak_memory(lambda: torch.autograd.backward(hm(x), one),
                                   params=params).peak_bytes
        assert peak <= hm.predicted_peak_bytes, (seed, peak - hm.predicted_peak_bytes)
    assert len(skipped) >= 4
    missing = _steps_equal(hm, ref, x, range(8))  # (the stand-ins read from where they are)
    assert len(set(missing)) >= 3


def test_a_tensor_every_layer_reads_gets_gradients_from_the_layers_run() -> None:
    """A tensor all layers read sums its gradient over those run (a missing term leaves the
    other) and gets none when every layer is skipped: no gradient flows into what made it,
    whose parameters keep None as in plain PyTorch (the backward of its maker does not run)."""
    torch.manual_seed(0)
    model, x = _LayerDropNet(layers=3, probability=0.6, context=True), torch.randn(64, 32)
    ref = copy.deepcopy(model)
    hm = hrockmate.HRockmate(model, (x,), budget=0.6, cache=False)
    assert len(hm.traced.skippable) == 3
    missing = _steps_equal(hm, ref, x, range(12))
    everything = 3 * 8 + 2  # (every layer's 8 parameters and the context's 2)
    assert everything in missing and len(set(missing)) >= 3


def test_other_outputs_when_a_layer_is_skipped_are_refused() -> None:
    # one graph's outputs cannot be a cache with an entry per layer run
    with pytest.raises(TraceError, match=r"returns other tensors when a decision goes the "
                                         r"other way.*use_cache=False"):
        trace_model(_LayerDropNet(layers=2, cache=True), torch.randn(8, 32), cost="none",
                    loss_fn=0)


def test_decisions_are_found_by_tracing_each_outcome() -> None:
    traced = trace_model(_LayerDropNet(layers=3), torch.randn(8, 32), cost="none")
    g = traced.graph
    regions = traced.skippable
    assert len(regions) == 3 and not set(regions[0].ops) & set(regions[1].ops) - {
        k for k in range(g.num_ops) if g.ops[k].phase == "backward"}
    for r in regions:
        # the test is an output of the graph, made before the region, by a comparison
        assert r.test in traced.output_ids
        maker = next(k for k, op in enumerate(g.ops) if r.test in op.outputs)
        assert g.ops[maker].target == "aten.lt.Scalar" and maker < min(r.ops)
        # every plan makes the test before the region: the ops entering it read the test
        assert any(r.test in g.ops[k].inputs for k in r.ops)
        # the layer's output stands for... its input: the region reads every stand-in
        read = {t for k in r.ops for t in g.ops[k].inputs}
        assert set(r.stands_for.values()) <= read
        assert "layers." in "".join(g.ops[k].module for k in r.ops)
    # the step as traced runs every layer: one op count per layer more than with none
    assert all(len([k for k in r.ops if g.ops[k].phase == "forward"]) >= 8 for r in regions)


def test_a_draw_read_as_a_number_is_named() -> None:
    """A draw read as a number (not a test of it) has no two outcomes to trace."""

    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.training and torch.rand([]).item() < 0.5:
                return x.sum()
            return self.layer(x).sum()

    with pytest.raises(TraceError) as info:
        trace_model(Drop(), torch.randn(2, 4), cost="none")
    text = str(info.value)
    assert "branches on a random draw" in text and "layerdrop" in text
    assert "if self.training and torch.rand([]).item() < 0.5:" in text


def test_what_decisions_leave_out_is_cached(tmp_path: Any) -> None:
    """A later start with the plan cache finds the regions without the extra traces; an
    entry that does not fit the graph is ignored with a warning, and traced afresh."""
    from hrockmate.capture import regions
    from hrockmate.planning.cache import PlanCache, PlanCacheWarning

    model, x = _LayerDropNet(layers=2), torch.randn(8, 32)
    cache = PlanCache(tmp_path)
    first = trace_model(model, x, cost="none", decisions_cache=cache)
    (entry,) = (tmp_path / "decisions").iterdir()
    calls: list[set[int]] = []
    real = regions.skippable_regions

    def counted(traced: Any, decided: Any, first_test: int, trace_not_taken: Any,
                cache: Any = None) -> Any:
        def spy(indices: set[int]) -> Any:
            calls.append(indices)
            return trace_not_taken(indices)
        return real(traced, decided, first_test, spy, cache)

    regions.skippable_regions = counted  # type: ignore[assignment]
    try:
        again = trace_model(model, x, cost="none", decisions_cache=cache)
        assert calls == []
        assert [(r.ops, r.stands_for, r.lost_grads) for r in again.skippable] == [
            (r.ops, r.stands_for, r.lost_grads) for r in first.skippable]
        entry.write_text(entry.read_text().replace('"index": 1', '"index": 7'))
        with pytest.warns(PlanCacheWarning, match="ignoring decisions cache entry"):
            fresh = trace_model(model, x, cost="none", decisions_cache=cache)
        assert len(calls) == 3 and [r.ops for r in fresh.skippable] == [
            r.ops for r in first.skippable]
    finally:
        regions.skippable_regions = real  # type: ignore[assignment]


def test_a_backward_op_placed_in_no_module_matches_any() -> None:
    """Which forward op a backward op belongs to can be found in one trace and not in another
    (Wav2Vec2 on CUDA, where an in-place op writes into a view): a backward op in no module
    matches the same op in any, while forward ops keep their modules (a later dropout is not
    the skipped layer's own)."""
    from hrockmate.capture.decisions import DecisionError, _match

    first = trace_model(_LayerDropNet(layers=2), torch.randn(8, 32), cost="none")
    g = first.graph
    backward = next(k for k, op in enumerate(g.ops) if op.phase == "backward" and op.module)
    forward = next(k for k, op in enumerate(g.ops) if op.phase == "forward" and op.module)
    for k, matches in ((backward, True), (forward, False)):
        other = copy.copy(first)
        other.graph = copy.deepcopy(g)
        other.graph.ops[k].module = ""
        if matches:
            skipped, _, _, matched = _match(first, other)
            assert not skipped and len(matched) == g.num_ops
        else:
            with pytest.raises(DecisionError, match="no counterpart in the first"):
                _match(first, other)


def _count_traces(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The sets of decisions each extra trace takes the other way, as they are traced."""
    from hrockmate.capture import regions

    calls: list[set[int]] = []
    real = regions.skippable_regions

    def counted(traced: Any, decided: Any, first_test: int, trace_not_taken: Any,
                cache: Any = None) -> Any:
        def spy(indices: set[int]) -> Any:
            calls.append(set(indices))
            return trace_not_taken(indices)
        return real(traced, decided, first_test, spy, cache)

    monkeypatch.setattr(regions, "skippable_regions", counted)
    return calls


def _regions(traced: Any) -> list[tuple[Any, ...]]:
    return [(r.index, r.test, r.ops, r.stands_for, r.lost_grads) for r in traced.skippable]


def test_regions_of_alike_layers_are_derived_and_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In a stack of alike layers only the first two and last two decisions are traced
    alone; the others' regions are the second's moved by whole layers, checked by one trace
    with every other decision taken the other way: the same regions as tracing each, in 6
    extra traces instead of 9, and steps bitwise equal to plain PyTorch."""
    from hrockmate.capture import regions

    torch.manual_seed(0)
    model, x = _LayerDropNet(layers=8, probability=0.5, context=True), torch.randn(64, 32)
    ref = copy.deepcopy(model)
    calls = _count_traces(monkeypatch)
    hm = hrockmate.HRockmate(model, (x,), budget=0.6, cache=False)
    assert calls == [{0}, {1}, {6}, {7}, {0, 2, 4, 6}, set(range(8))]
    derived = _regions(hm.traced)
    calls.clear()
    monkeypatch.setattr(regions, "MIN_DERIVED_RUN", 100)  # (each traced alone)
    each = trace_model(copy.deepcopy(model), (x,), cost="none")
    assert len(calls) == 9 and _regions(each) == derived
    missing = _steps_equal(hm, ref, x, range(8))
    assert len(set(missing)) >= 3


def test_layers_that_are_not_alike_or_regions_that_do_not_hold_are_traced_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack whose layers differ (one with more ops) is traced decision by decision; so
    is one whose derived regions the check trace contradicts. (A region missing an op is no
    error: the op runs, and what it makes is not read.)"""
    from hrockmate.capture import decisions, regions

    torch.manual_seed(0)
    model, x = _LayerDropNet(layers=6), torch.randn(16, 32)
    calls = _count_traces(monkeypatch)
    want = _regions(trace_model(model, (x,), cost="none"))
    odd = copy.deepcopy(model)
    odd.layers[3].inner = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
    calls.clear()
    traced = trace_model(odd, (x,), cost="none")
    assert calls == [{0}, {1}, {4}, {5}, {2}, {3}, set(range(6))]
    assert len(traced.graph.ops[min(traced.skippable[3].ops)].module) > 0

    real = decisions.derive_between

    def wrong(*args: Any) -> Any:  # (no stand-in: what follows a skipped layer misses it)
        got = real(*args)
        for r in got:
            r.stands_for = {}
        return got

    monkeypatch.setattr(regions, "derive_between", wrong)
    calls.clear()
    assert _regions(trace_model(model, (x,), cost="none")) == want
    assert calls == [{0}, {1}, {4}, {5}, {0, 2, 4}, {2}, {3}, set(range(6))]
