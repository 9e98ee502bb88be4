"""Tracing real models into the IR, and executing the traced joint graph like plain autograd."""

from __future__ import annotations

import copy
import functools
import random
import types
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import hrockmate
from hrockmate import models
from hrockmate.capture.joint import (
    TensorLeaf,
    Traced,
    TraceError,
    placeholder_values,
    run_joint,
    split_sample,
)
from hrockmate.capture.trace import trace_model
from hrockmate.ir.graph import PREEXISTING_ROLES

_CACHE: dict[str, tuple[nn.Module, Any, Traced]] = {}


def traced_builtin(name: str) -> tuple[nn.Module, Any, Traced]:
    """Trace each built-in model once per test session (cost "none": tests of structure)."""
    if name not in _CACHE:
        model, sample = models.build(name)
        _CACHE[name] = (model, sample, trace_model(model, sample, cost="none", name=name))
    return _CACHE[name]


def eager_step(
    model: nn.Module, sample: Any, seed: int, loss_fn: Callable[[Any], torch.Tensor] | None = None
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain autograd: outputs, parameter gradients, buffers after the step (tangents of ones)."""
    args, kwargs = split_sample(sample)
    torch.manual_seed(seed)
    out = model(*args, **kwargs)
    if loss_fn is not None:
        out = loss_fn(out)
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    diff = [x for x in leaves if x.requires_grad]
    torch.autograd.backward(diff, [torch.ones_like(x) for x in diff])
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return leaves, grads, {n: b.clone() for n, b in model.named_buffers()}


def joint_step(
    traced: Traced, model: nn.Module, sample: Any, seed: int
) -> dict[int, torch.Tensor]:
    torch.manual_seed(seed)
    return run_joint(traced, placeholder_values(traced, model, sample))


def assert_reproduces_autograd(
    model: nn.Module, sample: Any, traced: Traced, *, exact: bool = True,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> None:
    fresh = copy.deepcopy(model)  # the eager step below updates BatchNorm buffers
    got = joint_step(traced, fresh, sample, seed=1234)
    outs, grads, buffers = eager_step(model, sample, seed=1234, loss_fn=loss_fn)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-6)

    assert len(outs) == len(traced.output_ids)
    for tid, ref in zip(traced.output_ids, outs):
        assert same(got[tid], ref), f"output {traced.graph.tensors[tid].name} differs"
    assert set(traced.param_grads) == set(grads)
    for name, tid in traced.param_grads.items():
        assert same(got[tid], grads[name]), f"gradient of {name} differs"
    for name, tid in traced.buffer_updates.items():
        assert same(got[tid], buffers[name]), f"buffer {name} differs"


# ---- every built-in model ------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_builtin_model_traces_to_valid_ir(name: str) -> None:
    model, _sample, traced = traced_builtin(name)
    g = traced.graph
    g.validate()  # the Rust core's checks
    phases = [op.phase for op in g.ops]
    n_fwd = phases.count("forward")
    assert 0 < n_fwd < len(phases)
    assert phases == ["forward"] * n_fwd + ["backward"] * (len(phases) - n_fwd)
    # one IR parameter per distinct Parameter, and one gradient for each
    params = dict(model.named_parameters())
    assert sum(t.role == "parameter" for t in g.tensors) == len(params)
    assert set(traced.param_grads) == set(params)
    for name, tid in traced.param_grads.items():
        t = g.tensors[tid]
        assert t.role == "param_grad"
        assert g.tensors[t.grad_of].name == f"param:{name}"
    assert len(traced.op_nodes) == g.num_ops
    assert len(traced.tensor_nodes) == g.num_tensors
    for tid, t in enumerate(g.tensors):
        node, _ = traced.tensor_nodes[tid]
        if t.role in PREEXISTING_ROLES:
            assert node.op == "placeholder" and tid in traced.sources
        if t.alias_of is not None:
            assert t.bytes == 0
    # every traced graph of a model with parameters has backward ops grouped under forward ops
    assert any(op.differentiates is not None for op in g.ops if op.phase == "backward")
    for op in g.ops:
        if op.differentiates is not None:
            assert g.ops[op.differentiates].phase == "forward"


@pytest.mark.parametrize("name", sorted(models.MODELS))
def test_builtin_joint_graph_reproduces_autograd(name: str) -> None:
    model, sample, traced = traced_builtin(name)
    assert_reproduces_autograd(copy.deepcopy(model), sample, traced, exact=True)


# ---- specific features -----------------------------------------------------------------------
def test_batchnorm_running_stats_become_buffer_updates() -> None:
    model, _sample, traced = traced_builtin("cnn_bn")
    g = traced.graph
    buffers = dict(model.named_buffers())
    assert set(traced.buffer_updates) == set(buffers)
    for name, tid in traced.buffer_updates.items():
        t = g.tensors[tid]
        assert t.role == "buffer_update" and g.tensors[t.updates].name == f"buffer:{name}"
        producer = next(op for op in g.ops if tid in op.outputs)
        assert producer.mutates_buffer and producer.phase == "forward"
    assert any(op.target.startswith("aten._native_batch_norm_legit") for op in g.ops)


def test_dropout_ops_are_random_and_replay_with_the_seed() -> None:
    model, sample, traced = traced_builtin("gpt2_tiny")
    g = traced.graph
    random_ops = [op for op in g.ops if op.random]
    assert len(random_ops) == 7  # embedding dropout + 3 per block (attn, resid, mlp) x 2 blocks
    assert all(op.phase == "forward" for op in random_ops)
    loss = traced.output_ids[0]
    a = joint_step(traced, model, sample, seed=5)[loss]
    b = joint_step(traced, model, sample, seed=5)[loss]
    c = joint_step(traced, model, sample, seed=6)[loss]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_float_dropout_masks_get_a_one_byte_copy() -> None:
    """CPU dropout draws float masks; each gets a bool copy (a quarter of the bytes) from which
    the float mask is rebuilt, so a plan can keep the small one instead of drawing again; the
    random op's own output is read by nothing else."""
    model, sample, traced = traced_builtin("gpt2_tiny")
    g = traced.graph
    readers = g.consumers()
    masks = [op for op in g.ops if op.target == "aten.bernoulli.p"]
    assert len(masks) == 7
    for op in masks:
        (out,) = op.outputs
        (ne,) = readers[out]
        assert g.ops[ne].target == "aten.ne.Scalar" and g.ops[ne].phase == "forward"
        (bits,) = g.ops[ne].outputs
        assert g.tensors[bits].dtype == "bool"
        assert g.tensors[bits].bytes * 4 <= g.tensors[out].bytes + 64  # allocator rounding
        (back,) = readers[bits]
        assert g.ops[back].target == "aten._to_copy.default"
        assert g.tensors[g.ops[back].outputs[0]].dtype == g.tensors[out].dtype
    a = joint_step(traced, model, sample, seed=5)[traced.output_ids[0]]
    torch.manual_seed(5)
    assert torch.equal(a, model(*sample))  # the same loss as eager, masks included


def test_tied_weights_give_one_parameter_and_one_gradient() -> None:
    model, _sample, traced = traced_builtin("gpt2_tiny")
    assert model.lm_head.weight is model.wte.weight
    assert "wte.weight" in traced.param_grads
    assert "lm_head.weight" not in traced.param_grads
    names = [t.name for t in traced.graph.tensors if t.role == "parameter"]
    assert "param:wte.weight" in names and "param:lm_head.weight" not in names


def test_views_alias_their_input_and_own_no_bytes() -> None:
    _model, _sample, traced = traced_builtin("mlp")
    g = traced.graph
    views = [op for op in g.ops if op.target in ("aten.t.default", "aten.view.default")]
    assert views
    for op in views:
        (out,) = op.outputs
        assert g.tensors[out].alias_of == op.inputs[0] and g.tensors[out].bytes == 0
    mm = next(op for op in g.ops if op.target == "aten.addmm.default")
    out = g.tensors[mm.outputs[0]]
    assert out.alias_of is None and out.bytes == 8 * 64 * 4  # (batch, hidden) float32


def test_storage_sharing_without_schema_annotation_is_an_alias() -> None:
    # nn.LSTMCell splits its gates with unsafe_chunk: outputs share the gates' storage
    _model, _sample, traced = traced_builtin("rnn_loop")
    g = traced.graph
    split = next(op for op in g.ops if op.target == "aten.unsafe_split.Tensor")
    assert len(split.outputs) == 4
    for t in split.outputs:
        assert g.tensors[t].alias_of == split.inputs[0] and g.tensors[t].bytes == 0


def test_multi_output_members_are_tensors_even_if_unused() -> None:
    _model, _sample, traced = traced_builtin("cnn_bn")
    g = traced.graph
    bn = next(op for op in g.ops if op.target.startswith("aten._native_batch_norm_legit"))
    assert len(bn.outputs) == 5  # out, save_mean, save_invstd, new running mean, new running var
    assert sum(g.tensors[t].role == "buffer_update" for t in bn.outputs) == 2
    assert all(g.tensors[t].bytes > 0 for t in bn.outputs)


def test_module_paths_and_backward_grouping() -> None:
    _model, _sample, traced = traced_builtin("gpt2_tiny")
    g = traced.graph
    fwd_modules = {op.module for op in g.ops if op.phase == "forward"}
    assert {"h.0.attn.qkv", "h.1.mlp.0", "ln_f"} <= fwd_modules
    for op in g.ops:
        if op.phase == "backward" and op.differentiates is not None:
            assert op.module == g.ops[op.differentiates].module or op.module
    # the weight gradient of the first MLP projection differentiates its addmm
    addmm = next(i for i, op in enumerate(g.ops)
                 if op.module == "h.0.mlp.0" and op.target == "aten.addmm.default")
    assert any(op.differentiates == addmm and op.target == "aten.mm.default" for op in g.ops)


def test_int_inputs_and_model_returning_its_own_loss() -> None:
    model, sample, traced = traced_builtin("gpt2_tiny")
    g = traced.graph
    inputs = [g.tensors[t] for t, (kind, _) in traced.sources.items() if kind == "input"]
    assert [t.dtype for t in inputs] == ["int64", "int64"]
    (loss,) = traced.output_ids
    assert g.tensors[loss].shape == [] and g.tensors[loss].role == "output"
    tangents = [t for t, (kind, _) in traced.sources.items() if kind == "tangent"]
    assert len(tangents) == 1 and traced.sources[tangents[0]] == ("tangent", 0)


def test_outputs_without_loss_are_driven_by_tangents() -> None:
    model, sample = models.gpt2_tiny(with_loss=False, n_layer=1)
    traced = trace_model(model, sample, cost="none")
    (logits,) = traced.output_ids
    t = traced.graph.tensors[logits]
    assert t.shape == [2, 16, 64]
    (tangent,) = [tid for tid, (kind, _) in traced.sources.items() if kind == "tangent"]
    assert traced.graph.tensors[tangent].shape == [2, 16, 64]
    assert_reproduces_autograd(copy.deepcopy(model), sample, traced)


def test_loss_fn_is_traced_inside() -> None:
    model, sample = models.mlp(n_layers=1)
    loss_fn = lambda out: out.square().mean()  # noqa: E731
    traced = trace_model(model, sample, cost="none", loss_fn=loss_fn)
    (loss,) = traced.output_ids
    assert traced.graph.tensors[loss].shape == []
    assert any(op.target == "aten.mean.default" for op in traced.graph.ops)
    assert_reproduces_autograd(copy.deepcopy(model), sample, traced, loss_fn=loss_fn)


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.lin = nn.Linear(6, 6)

    def forward(self, ids: torch.Tensor, scale: float = 1.0, extra: torch.Tensor | None = None
                ) -> dict[str, Any]:
        h = self.lin(self.emb(ids)) * scale
        assert extra is not None
        return {"h": h, "stats": (h.sum(), "tag", 3), "extra": extra * 2}


def test_dict_sample_several_outputs_and_constants() -> None:
    model = _DictModel()
    sample = {"ids": torch.tensor([[1, 2, 3]]), "scale": 0.5, "extra": torch.ones(2)}
    traced = trace_model(model, sample, cost="none")
    assert len(traced.output_ids) == 3
    spec, leaves = traced.output_spec
    rebuilt = pytree.tree_unflatten(
        [f"T{i}" if x is TensorLeaf else x for i, x in enumerate(leaves)], spec
    )
    assert rebuilt["stats"][1:] == ("tag", 3) and isinstance(rebuilt["h"], str)
    assert [m if not isinstance(m, tuple) else m[0] for m in traced.input_meta] == [
        (1, 3), 0.5, (2,)
    ]
    # "extra" does not require grad, so its output has no tangent: 2 tangents for 3 outputs
    assert sum(kind == "tangent" for kind, _ in traced.sources.values()) == 2
    assert_reproduces_autograd(copy.deepcopy(model), sample, traced)


def test_input_requiring_grad_gets_an_input_grad() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    traced = trace_model(model, x, cost="none")
    assert list(traced.input_grads) == [0]
    t = traced.graph.tensors[traced.input_grads[0]]
    assert t.role == "input_grad" and traced.graph.tensors[t.grad_of].role == "input"


class _GradIsTangent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.randn(2, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + self.b, x  # d(out)/d(b) is the tangent itself; the input is returned as is


def test_results_that_are_placeholders_get_their_own_alias_op() -> None:
    model = _GradIsTangent()
    x = torch.randn(2, 4)
    traced = trace_model(model, x, cost="none")
    g = traced.graph
    g.validate()
    aliases = [op for op in g.ops if op.target == "aten.alias.default"]
    assert len(aliases) == 2
    grad = g.tensors[traced.param_grads["b"]]
    assert g.tensors[grad.alias_of].role == "tangent"
    ret = g.tensors[traced.output_ids[1]]
    assert ret.role == "output" and g.tensors[ret.alias_of].role == "input"
    got = joint_step(traced, model, x, seed=0)
    assert torch.equal(got[traced.output_ids[1]], x)
    assert torch.equal(got[traced.param_grads["b"]], torch.ones(2, 4))


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def test_transposed_output_tangent_keeps_traced_strides() -> None:
    # batch_first attention returns a transposed tensor. Recent AOTAutograd traces its tangent
    # with those strides, older versions (torch 2.11) with contiguous ones: either way the
    # tangent given at run time is laid out as traced and the step reproduces autograd.
    model, x = _SelfAttention(), torch.randn(2, 4, 8)
    assert not model(x).is_contiguous()
    traced = trace_model(model, x, cost="none")
    (tangent,) = [tid for tid, (kind, _) in traced.sources.items() if kind == "tangent"]
    meta = traced.tensor_nodes[tangent][0].meta["val"]
    out_meta = traced.tensor_nodes[traced.output_ids[0]][0].meta["val"]
    assert meta.stride() in (out_meta.stride(), torch.empty(meta.shape).stride())
    assert_reproduces_autograd(copy.deepcopy(model), x, traced)


def test_encoder_layer_dropout_on_transposed_tensor_replays_eager_numbers() -> None:
    model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5, batch_first=True)
    x = torch.randn(2, 4, 8)
    traced = trace_model(model, x, cost="none")
    assert sum(op.random for op in traced.graph.ops) == 4
    assert_reproduces_autograd(copy.deepcopy(model), x, traced)


def test_gru_loop_matches_autograd_to_rounding() -> None:
    model, sample = models.rnn_loop(cell="gru", steps=3)
    traced = trace_model(model, sample, cost="none")
    assert_reproduces_autograd(copy.deepcopy(model), sample, traced, exact=False)


def test_trace_leaves_global_rng_untouched() -> None:
    model, sample = models.gpt2_tiny(n_layer=1)
    torch.manual_seed(77)
    before = torch.random.get_rng_state()
    hrockmate.trace(model, sample, cost="estimate")
    assert torch.equal(before, torch.random.get_rng_state())


def test_trace_returns_graph_with_costs() -> None:
    model, sample = models.mlp(n_layers=1)
    g = hrockmate.trace(model, sample, cost="estimate")
    assert isinstance(g, hrockmate.Graph)
    assert all(op.time > 0 for op in g.ops)
    assert g.meta["cost"] == "estimate" and g.meta["trace_seconds"] > 0


# ---- errors --------------------------------------------------------------------------------
class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # data-dependent control flow
            return h
        return -h


def test_data_dependent_control_flow_names_the_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Branchy())
    with pytest.raises(TraceError, match=r"module '1' \(_Branchy\).*control flow") as info:
        trace_model(model, torch.randn(2, 4), cost="none")
    # and the line of the model's code that read the value
    line = _Branchy.forward.__code__.co_firstlineno + 2
    assert f"called at {__file__}:{line} in forward (`if h.sum() > 0:  # data-dependent " \
           "control flow`)" in str(info.value)


class _MaskedAssign(nn.Module):
    """Assigns through a boolean mask computed from activations: the forward traces, the
    gradient of that assignment needs the mask's nonzero count, a value of the activations.
    (A mask from the inputs, as transformers' Wav2Vec2 applies SpecAugment, is written through
    by its positions and trains: tests/runtime.)"""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fill = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h[h.detach().sum(-1) > 0] = self.fill.to(h.dtype)
        return h.square().mean()


def test_a_failure_in_the_backward_says_so(recwarn: pytest.WarningsRecorder) -> None:
    with pytest.raises(TraceError, match=r"cannot trace the backward pass .*nonzero.*"
                                          r"boolean mask.*torch\.where") as info:
        trace_model(_MaskedAssign(), torch.randn(3, 4), cost="none")
    assert "called at" not in str(info.value)  # (no line of the model's code runs there)
    # autograd's own warning of an error in a backward node (with an empty traceback) is not
    # shown beside it
    assert not [w for w in recwarn if "Error detected in" in str(w.message)]


class _HostRandom(nn.Module):
    """Draws on the host: a numpy time mask (as SpecAugment in transformers) and a Python
    random LayerDrop decision."""

    def __init__(self, use: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.use = use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.use == "numpy":
            h = h * torch.from_numpy(np.random.rand(*h.shape) > 0.5).to(h.dtype)
        elif self.use == "python" and random.random() < 0.5:
            h = torch.relu(h)
        elif self.use == "python, never taken":  # (transformers' Musicgen: LayerDrop of 0.0)
            for _ in range(3):
                if random.uniform(0, 1) < 0.0:
                    h = torch.relu(h)
        elif self.use == "python, bound before" and _BOUND_RANDOM() < 2.0:  # (always taken,
            h = torch.relu(h)  # but a draw hrockmate cannot see or force: still reported)
        return h.square().mean()


_BOUND_RANDOM = random.random  # (the generator's method, taken before any trace)


@pytest.mark.parametrize("use, named", [("numpy", "numpy.random"), ("python", "Python's random"),
                                        ("python, never taken", None),
                                        ("python, bound before", "Python's random"),
                                        ("none", None)])
def test_random_draws_on_the_host_are_reported_and_undone(use: str, named: str | None) -> None:
    np.random.seed(7)
    random.seed(7)
    np_state, py_state = np.random.get_state(), random.getstate()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trace_model(_HostRandom(use), torch.randn(3, 4), cost="none")
    drawn = [str(w.message) for w in seen if "drew random numbers" in str(w.message)]
    if named is None:
        assert drawn == []
    else:
        assert len(drawn) == 1 and f"from {named} while it was traced" in drawn[0]
        assert "every training call repeats them" in drawn[0]
    # the user's host generators are where they were
    assert random.getstate() == py_state
    now = np.random.get_state()
    assert np.array_equal(now[1], np_state[1]) and now[2:] == np_state[2:]


def test_draws_that_cannot_change_the_step_are_drawn_at_each_call_as_eager_draws_them(
        ) -> None:
    """Python's random draws whose values do not change the traced step (the same graph with
    each draw at either end of its range) raise no warning, and each training call advances
    Python's generator as the model's own code does in plain PyTorch."""
    import hrockmate

    model = _HostRandom("python, never taken")
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    hm = hrockmate.HRockmate(model, (x,), cache=False, progress=False)  # (store-all, compiled)
    assert hm.traced.python_draws == (("random", 0),) * 3
    for seed in (1, 2):
        random.seed(seed)
        hm(x).backward()
        after = random.getstate()
        random.seed(seed)
        ref(x).backward()
        assert random.getstate() == after
        assert torch.equal(model.lin.weight.grad, ref.lin.weight.grad)


class _Misconfigured(nn.Module):
    """Fails in plain PyTorch as well: a setting its forward reads is missing (a model built
    from an incomplete configuration)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.config = types.SimpleNamespace()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return h * self.config.start_token_id


def test_a_model_that_fails_in_plain_pytorch_is_told_apart_from_a_tracing_limit() -> None:
    model = _Misconfigured()
    before = [b.clone() for b in model.buffers()]
    with pytest.raises(TraceError, match=r"fails in plain PyTorch too.*AttributeError.*"
                                          r"start_token_id") as info:
        trace_model(model, torch.randn(8, 4) + 3.0, cost="none")
    assert "control flow" not in str(info.value)
    # the eager check left the running statistics as they were
    for a, b in zip(before, model.buffers()):
        assert torch.equal(a, b)


class _SharedModule(nn.Module):
    """One embedding module under three paths and its weight tied to a head (as T5 in
    transformers 4.x shares its embedding with the encoder, decoder and LM head)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(10, 6)
        self.encoder = nn.ModuleDict({"embed": self.shared})
        self.decoder = nn.ModuleDict({"embed": self.shared})
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.encoder["embed"](ids) + 2 * self.decoder["embed"](ids)
        return self.head(h).logsumexp(-1).mean()


def test_module_shared_under_several_paths_stays_intact() -> None:
    model = _SharedModule()
    weight = model.shared.weight
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    traced = trace_model(model, ids, cost="none")
    assert model.shared.weight is weight and model.head.weight is weight
    assert model.decoder["embed"] is model.shared
    assert list(traced.param_grads) == ["shared.weight"]
    assert not any(kind == "constant" for kind, _ in traced.sources.values())
    assert_reproduces_autograd(copy.deepcopy(model), ids, traced)


class _MaskFastPath(nn.Module):
    """Skips the mask when it is all ones, unless a compiler traces it (as transformers' mask
    helpers do): the eager path tests the mask's values, the compilers' path does not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if torch.compiler.is_compiling() or not bool(mask.all()):
            h = h.masked_fill(~mask[:, :, None], 0.0)
        return h.square().mean()


class _MaskCountPath(_MaskFastPath):
    """Reads how many positions the mask keeps (a count, not a test) unless compiled."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).masked_fill(~mask[:, :, None], 0.0)
        if torch.compiler.is_compiling():
            return h.square().sum() / mask.sum()
        return h.square().sum() / int(mask.sum())


def test_value_tests_of_the_inputs_keep_the_eager_path() -> None:
    """A test of the inputs' values (True or False) is answered on the eager path and guarded:
    what plain PyTorch computes, in a graph per outcome (the compilers' path of transformers'
    mask helpers builds a mask where eager uses is_causal, and rounds otherwise)."""
    model = _MaskFastPath()
    x = torch.randn(2, 3, 4)
    padded = torch.tensor([[True, True, True], [True, True, False]])
    ones = torch.ones(2, 3, dtype=torch.bool)
    traced = trace_model(model, {"x": x, "mask": padded}, cost="none")
    assert not torch.compiler.is_compiling()  # restored after tracing
    assert traced.graph.meta["compiling_paths"] is False
    assert traced.graph.meta["value_guards"] == 1
    assert any(op.target == "aten.masked_fill.Scalar" for op in traced.graph.ops)
    assert_reproduces_autograd(copy.deepcopy(model), {"x": x, "mask": padded}, traced)
    guards = traced.value_guards
    assert guards is not None and guards.tests_only
    other = padded.flip(1)  # another padding: the same outcome
    assert guards.failing({("input", 0): x, ("input", 1): other}.__getitem__) is None
    assert "was False" in (guards.failing({("input", 0): x, ("input", 1): ones}.__getitem__)
                           or "")
    unpadded = trace_model(model, {"x": x, "mask": ones}, cost="none")
    assert not any(op.target == "aten.masked_fill.Scalar" for op in unpadded.graph.ops)
    assert_reproduces_autograd(copy.deepcopy(model), {"x": x, "mask": ones}, unpadded)


def test_value_reads_with_a_compiler_path_take_it() -> None:
    """A count read from the inputs would take a graph per count: the compilers' path, where
    the model has one, serves them all."""
    model = _MaskCountPath()
    x = torch.randn(2, 3, 4)
    padded = torch.tensor([[True, True, True], [True, True, False]])
    traced = trace_model(model, {"x": x, "mask": padded}, cost="none")
    assert traced.graph.meta["compiling_paths"] is True
    assert traced.graph.meta["value_guards"] == 0
    for mask in (padded, torch.ones(2, 3, dtype=torch.bool)):
        assert_reproduces_autograd(copy.deepcopy(model), {"x": x, "mask": mask}, traced)
    plain = trace_model(nn.Linear(4, 4), x, cost="none")
    assert plain.graph.meta["compiling_paths"] is False


class _TwoPaths(nn.Module):
    """A linear layer, then one path while a compiler traces and another in eager code."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.compiler_path(h) if torch.compiler.is_compiling() else self.eager_path(h)

    def compiler_path(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def eager_path(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _CompilerOnlyBranch(_TwoPaths):
    """A branch for compilers that fails outside one (and, like transformers' Mamba scans,
    computes differently from the eager path): the eager paths are traced."""

    def compiler_path(self, h: torch.Tensor) -> torch.Tensor:
        return self.compiled_head(h)  # type: ignore[operator]  # not an attribute

    def eager_path(self, h: torch.Tensor) -> torch.Tensor:
        return h.tanh().sum()


def test_the_eager_paths_are_traced_when_they_trace() -> None:
    model = _CompilerOnlyBranch()
    x = torch.randn(3, 4)
    traced = trace_model(model, x, cost="none")
    assert traced.graph.meta["compiling_paths"] is False
    assert any(op.target == "aten.tanh.default" for op in traced.graph.ops)
    assert_reproduces_autograd(copy.deepcopy(model), x, traced)


class _ReadsConstants(nn.Module):
    """Reads values computed from shapes alone, as transformers' check for packed sequences
    reads position ids made by ``arange``; its compilers' path computes otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).unsqueeze(0)
        step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
        if torch.compiler.is_compiling():
            h = torch.tanh(self.fc(x))
        elif (step == 1).all():
            h = torch.relu(self.fc(x))
        else:
            h = self.fc(x)
        keep = int(torch.tensor([3, 5]).max())  # a literal's value
        return h[:, :keep].square().sum()


def test_reads_of_values_made_from_constants_alone_are_answered() -> None:
    model, x = _ReadsConstants(), torch.randn(2, 6, 8)
    traced = trace_model(model, x, cost="none")
    assert traced.graph.meta["compiling_paths"] is False
    targets = {op.target for op in traced.graph.ops}
    assert "aten.relu.default" in targets and "aten.tanh.default" not in targets
    assert_reproduces_autograd(copy.deepcopy(model), x, traced)


class _ConstantWrittenFromData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flags = torch.zeros(2)
        flags[0] = self.fc(x).sum()  # from here on a value of the parameters
        view = flags[:1]
        if view.item() > 0:
            return self.fc(x).sum()
        return -self.fc(x).sum()


class _InputValueRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.abs().argmax()) % 3 + 1  # a value of the input
        return self.fc(x)[:, :n].sum()


class _ParameterValueRead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fc.weight.abs().sum() > 0:  # a value of the parameters
            return self.fc(x).sum()
        return x.sum()


@pytest.mark.parametrize("model", [_ConstantWrittenFromData(), _ParameterValueRead()])
def test_reads_of_values_of_parameters_or_activations_are_refused(model: nn.Module) -> None:
    with pytest.raises(TraceError, match=r"depends on tensor values") as info:
        trace_model(model, torch.randn(2, 6, 8), cost="none")
    assert "in forward (`" in str(info.value)  # the line that reads


def test_reads_of_values_of_the_inputs_alone_are_answered_and_guarded() -> None:
    """Both paths fail at a read of the input; the last try answers it from the input's value
    and keeps the read as a guard, which replays the ops from the inputs to the read."""
    model, x = _InputValueRead(), torch.randn(2, 6, 8)
    traced = trace_model(model, x, cost="none")
    assert traced.graph.meta["value_guards"] == 1
    assert traced.graph.meta["compiling_paths"] is False
    assert_reproduces_autograd(copy.deepcopy(model), x, traced)
    guards = traced.value_guards
    assert guards is not None and guards.sources == [("input", 0)]
    assert guards.failing({("input", 0): x}.__getitem__) is None
    other = x.clone()
    other.view(-1)[int(x.abs().argmax())] = 0.0
    other.view(-1)[(int(x.abs().argmax()) + 1) % x.numel()] = 100.0
    assert "was " in (guards.failing({("input", 0): other}.__getitem__) or "")


def _cached_unless_compiling(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A process-wide cache that compilers bypass, as transformers'
    ``compile_compatible_method_lru_cache`` is (BEiT's relative position index)."""
    cached = functools.lru_cache(maxsize=8)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any) -> torch.Tensor:
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)

    wrapper.cache = cached  # type: ignore[attr-defined]
    return wrapper


class _CachedRelativeIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 2))

    @_cached_unless_compiling
    def relative_index(self, n: int) -> torch.Tensor:
        pos = torch.arange(n)
        return pos[:, None] - pos[None, :] + n - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.table[self.relative_index(x.shape[1])]  # (n, n, 2)
        return (x.unsqueeze(2) * bias).square().sum()


def test_a_cache_compilers_bypass_keeps_no_fake_tensor() -> None:
    """An eager-path trace fills such a cache with a fake tensor: AOTAutograd's second pass
    then meets an unexpected fake buffer; the error blamed the model, and the model failed in
    plain PyTorch for the rest of the process."""
    from torch._subclasses.fake_tensor import FakeTensor

    model = _CachedRelativeIndex()
    x = torch.randn(2, 5, 2)
    traced = trace_model(model, x, cost="none")
    assert traced.graph.meta["compiling_paths"] is True  # (the compilers bypass the cache)
    cache = _CachedRelativeIndex.relative_index.cache  # type: ignore[attr-defined]
    assert cache.cache_info().currsize == 0  # the failed eager-path trace's entry is dropped
    model(x).backward()  # the user's model still runs (and fills the cache with a real tensor)
    assert cache.cache_info().currsize == 1
    assert not isinstance(cache(model, 5), FakeTensor)
    assert_reproduces_autograd(copy.deepcopy(model), x, traced)


class _LazyTable(nn.Module):
    """Computes a table from its buffers at first use and keeps it in a plain attribute, as
    transformers' Mimi codebooks do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("table_sum", torch.randn(6, 4))
        self.register_buffer("usage", torch.rand(6) + 0.5)
        self._table: torch.Tensor | None = None

    @property
    def table(self) -> torch.Tensor:
        if self._table is None:
            self._table = self.table_sum / self.usage.clamp(min=1e-5)[:, None]
        return self._table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) @ self.table.T).square().mean()


def test_tensors_the_model_keeps_in_attributes_while_traced_are_dropped() -> None:
    """The trace left a fake tensor in the attribute: AOTAutograd's second pass failed on it,
    and so did the model in plain PyTorch afterwards (the failure blamed on the model)."""
    model, x = _LazyTable(), torch.randn(3, 4)
    traced = trace_model(model, x, cost="none")
    assert model._table is None  # as the user gave it
    assert_reproduces_autograd(copy.deepcopy(model), x, traced)
    model(x).backward()  # the model still runs in plain PyTorch, and keeps its real table
    assert type(model._table) is torch.Tensor
    again = trace_model(model, x, cost="none")  # a table kept before the trace stays
    assert type(model._table) is torch.Tensor
    assert_reproduces_autograd(copy.deepcopy(model), x, again)


class _BrokenCompilerPath(_TwoPaths):
    """A data-dependent shape in eager code, and a compiler path that fails for a reason of its
    own (transformers' Switch Transformers: ``nonzero`` in its experts, and an attention mask
    it leaves None when compiling)."""

    def compiler_path(self, h: torch.Tensor) -> torch.Tensor:
        mask = None
        return (h * mask[:, None]).sum()  # type: ignore[index]

    def eager_path(self, h: torch.Tensor) -> torch.Tensor:
        hit = (h > 0).nonzero()
        return h.sum() + hit.shape[0]


def test_a_failing_compiler_path_reports_the_value_read_that_sent_tracing_there() -> None:
    with pytest.raises(TraceError) as info:
        trace_model(_BrokenCompilerPath(), torch.randn(3, 4), cost="none")
    text = str(info.value)
    assert "at op aten.nonzero.default" in text and "hit = (h > 0).nonzero()" in text
    assert "With torch.compiler.is_compiling() answering True" in text
    assert "TypeError: 'NoneType' object is not subscriptable" in text


class _LayerDrop(nn.Module):
    """Skips each layer with ``probability`` while training, deciding on ``torch.rand`` (as
    transformers' LayerDrop does, before 5.2x also at probability 0), then a dropout;
    ``data_read`` branches on a dropped-out activation instead."""

    def __init__(self, data_read: bool = False, probability: float = 0.5) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 4)
        self.data_read = data_read
        self.probability = probability

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.data_read:
                x = nn.functional.dropout(layer(x), 0.5, self.training)
                if x.sum() > 0:
                    x = x.relu()
                continue
            dropout_probability = torch.rand([])
            if self.training and dropout_probability < self.probability:
                continue
            x = nn.functional.dropout(layer(x).relu(), 0.2, self.training)
        return self.head(x).square().sum()


def test_distribution_argument_checks_are_off_while_tracing() -> None:
    # (HF's time-series models) a distribution built from the model's outputs checks its
    # arguments by reading their values; the checks change nothing and are left out of the
    # trace, the default is back afterwards, and training is bitwise plain PyTorch's
    from torch.distributions import Distribution, Normal

    class Gaussian(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loc, raw = self.net(x).unbind(-1)
            dist = Normal(loc, nn.functional.softplus(raw) + 1e-3)
            return -dist.log_prob(y).mean()

    assert Distribution._validate_args
    torch.manual_seed(0)
    model, x, y = Gaussian(), torch.randn(8, 4), torch.randn(8)
    ref = copy.deepcopy(model)
    hm = hrockmate.HRockmate(model, (x, y), cache=False)
    assert Distribution._validate_args
    for _ in range(2):
        hm(x, y).backward()
        ref(x, y).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_branch_on_dropped_out_data_is_no_random_decision() -> None:
    # (LayerDrop's decisions are traced both ways: tests/capture/test_decisions.py) a read of
    # data that went through a dropout is an ordinary data dependency
    assert len(trace_model(_LayerDrop(), torch.randn(2, 4), cost="none").skippable) == 3
    with pytest.raises(TraceError) as info:
        trace_model(_LayerDrop(data_read=True), torch.randn(2, 4), cost="none")
    text = str(info.value)
    assert "random draw" not in text and "if x.sum() > 0:" in text
    assert "control flow that depends on tensor values" in text


@torch.library.custom_op("hrockmate_test::no_fake", mutates_args=())
def _no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def test_op_without_fake_implementation_is_named() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(_no_fake(x))

    with pytest.raises(TraceError, match=r"no_fake.*register_fake"):
        trace_model(M(), torch.randn(2, 4), cost="none")


def test_bad_arguments_are_reported() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(TraceError, match="sample must be a tensor"):
        trace_model(model, 3.0, cost="none")
    with pytest.raises(TraceError, match="cost must be one of"):
        trace_model(model, torch.randn(2, 4), cost="fast")
    with pytest.raises(TraceError, match="must be a torch.nn.Module"):
        trace_model(lambda x: x, torch.randn(2, 4), cost="none")  # type: ignore[arg-type]
    frozen = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(TraceError, match="no gradient flows"):
        trace_model(frozen, torch.randn(2, 4), cost="none")


def test_in_place_update_of_an_input_needing_grad_is_rejected() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.mul_(2)  # modifies the caller's input
            return self.lin(x)

    # one that needs no gradient is written back as a buffer update is
    traced = trace_model(M(), torch.randn(2, 4), cost="none")
    assert list(traced.input_updates) == [0]
    update = traced.graph.tensors[traced.input_updates[0]]
    assert traced.graph.tensors[update.updates].role == "input"
    with pytest.raises(TraceError, match="modifies its input"):
        trace_model(M(), torch.randn(2, 4, requires_grad=True) * 1.0, cost="none")


class _PlainTensorAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.scale = torch.tensor([1.0, 2.0, 3.0])  # neither parameter nor buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_closed_over_tensors_become_constants() -> None:
    model = _PlainTensorAttribute()
    x = torch.randn(5, 4)
    target = torch.randint(0, 3, (5,))
    loss_fn = lambda out: nn.functional.cross_entropy(out, target)  # noqa: E731
    traced = trace_model(model, x, cost="none", loss_fn=loss_fn)
    traced.graph.validate()
    constants = {tid: key for tid, (kind, key) in traced.sources.items() if kind == "constant"}
    assert len(constants) >= 2  # the attribute and the targets
    for tid, key in constants.items():
        assert traced.graph.tensors[tid].role == "buffer"
        assert isinstance(getattr(traced.gm, key), torch.Tensor)
    values = {torch.equal(getattr(traced.gm, k), target) for k in constants.values()}
    assert True in values
    assert_reproduces_autograd(copy.deepcopy(model), x, traced, loss_fn=loss_fn)


def test_a_failing_kernel_is_reported_once_without_pytorchs_error_log(caplog) -> None:
    import logging

    # an input too small for the pooling window: the fake kernel raises while tracing
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AvgPool2d(8), nn.Flatten())
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    with caplog.at_level(logging.ERROR):
        with pytest.raises(TraceError, match=r"fails in plain PyTorch too.*Output size is too "
                                             r"small"):
            trace_model(model, torch.randn(1, 3, 5, 5), cost="none")
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    assert fake_log.level == level  # restored


class _LogitsUpdatedInPlace(nn.Module):
    """transformers' MobileBERT head: the logits are a 3-D matmul's result with the bias added
    in place, returned beside the loss computed from their flattened view."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Parameter(torch.randn(8, 16))
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        scores = torch.tanh(x).matmul(self.proj)
        scores += self.bias
        loss = nn.functional.cross_entropy(scores.view(-1, 16), y.view(-1))
        return {"loss": loss, "logits": scores}


@pytest.mark.parametrize("budget", [None, 0.9])
def test_an_output_view_emitted_after_the_gradients_is_a_forward_result(
        budget: float | None) -> None:
    """AOTAutograd regenerates the returned view of a tensor updated in place after the
    gradients; that output is still a forward result (it was "produced by backward op
    'detach_3'" and no schedule could be built). It is computed in the forward now and the
    module trains as eager does, the logits returned equal."""
    torch.manual_seed(0)
    model = _LogitsUpdatedInPlace()
    ref = copy.deepcopy(model)
    x, y = torch.randn(2, 5, 8), torch.randint(0, 16, (2, 5))
    if budget is not None:
        # (in bytes, of the traced store-all: plain PyTorch's peak, which a fraction is of,
        # drops the logits this test keeps, and no plan of this tiny graph fits 90% of it)
        budget = int(budget * hrockmate.HRockmate(model, (x, y), loss_fn="loss", cache=False,
                                                  progress=False).predicted_peak_bytes)
    hm = hrockmate.HRockmate(model, (x, y), loss_fn="loss", budget=budget, cache=False,
                             progress=False)
    assert budget is None or hm.plan.stats.get("method") != "store-all"
    graph = hm.traced.graph
    for t, tensor in enumerate(graph.tensors):
        if tensor.role == "output":
            producer = next(o for o in graph.ops if t in o.outputs)
            assert producer.phase == "forward", producer.name
    out, want = hm(x, y), ref(x, y)
    assert torch.equal(out["logits"], want["logits"]) and torch.equal(out["loss"], want["loss"])
    out["loss"].backward()
    want["loss"].backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_a_sparse_gradient_is_refused_with_its_remedy() -> None:
    class SparseLookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 8, sparse=True)
            self.fc = nn.Linear(8, 1)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.fc(self.emb(idx)).square().mean()

    with pytest.raises(TraceError, match=r"torch.sparse_coo tensor .*sparse=False"):
        trace_model(SparseLookup(), torch.randint(0, 100, (4, 6)), cost="none")


def test_a_read_of_a_buffer_the_step_updates_is_refused() -> None:
    # BatchNorm with momentum=None averages with 1 / num_batches_tracked, read as a float:
    # a value that changes at every step cannot be one traced graph's
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 1))
    before = model[1].num_batches_tracked.clone()
    with pytest.raises(TraceError, match=r"buffer '1.num_batches_tracked', which each training "
                                         r"step updates.*give a momentum"):
        trace_model(model, torch.randn(16, 8), cost="none")
    assert torch.equal(model[1].num_batches_tracked, before)  # (followed on a copy)


def test_a_refused_trace_leaves_no_module_on_the_next_trace() -> None:
    """The refused trace's first try fails inside the BatchNorm's forward, whose exit hook
    then never runs; torch keeps the module path process-wide, and a stale one named that
    BatchNorm ('1') on the next trace's backward ops outside every module (the loss's), so a
    LayerDrop model traced next failed to match its two outcomes."""
    refused = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8, momentum=None), nn.Linear(8, 1))
    with pytest.raises(TraceError, match="num_batches_tracked"):
        trace_model(refused, torch.randn(16, 8), cost="none")
    assert "nn_module_stack" not in torch.fx.traceback.get_current_meta()

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x).square().mean()  # (the loss outside every module)

    traced = trace_model(Net(), torch.randn(4, 8), cost="none")
    modules = {op.module for op in traced.graph.ops}
    assert modules == {"", "body"}, modules


@pytest.mark.parametrize("probability", [0.0, 1.0])
def test_a_draw_every_value_of_which_decides_alike_is_no_random_read(probability: float) -> None:
    """LayerDrop off (transformers before 5.2x drew ``torch.rand([])`` and compared it with a
    probability of 0.0 all the same; it was refused with the remedy "set layerdrop to 0.0"):
    ``rand < 0`` is False and ``rand < 1`` True for every draw, so the read is answered
    without a guard, the draws stay in the graph and the generator advances as in eager
    (the dropouts after it draw the same masks)."""
    torch.manual_seed(0)
    model, x = _LayerDrop(probability=probability), torch.randn(2, 4)
    ref = copy.deepcopy(model)
    hm = hrockmate.HRockmate(model, (x,), cache=False)
    assert hm.traced.value_guards is None and not hm.traced.finite_assumptions
    for plan in (None, hrockmate.recompute_all_schedule(hm.traced.graph)):
        if plan is not None:
            hm.use_plan(plan)
        for step in range(2):
            torch.manual_seed(step)
            loss = hm(x)
            loss.backward()
            state = torch.get_rng_state()
            torch.manual_seed(step)
            ref_loss = ref(x)
            ref_loss.backward()
            assert torch.equal(state, torch.get_rng_state())
            assert torch.equal(loss, ref_loss)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                assert p.grad is None or torch.equal(p.grad, q.grad), name
