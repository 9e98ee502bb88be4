"""Simplification, partitioning and leaf options through the Python bindings."""

from __future__ import annotations

import _thread
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import corpus_files

from hrockmate import _native
from hrockmate.ir.graph import ROLE_CODE, Graph, Op, Tensor
from hrockmate.planning.blocks import Block
from hrockmate.planning.clusters import ClusterTree, HierarchyError, build_hierarchy, simplify


def chain_model(n: int, *, repeat: bool = False, free_views: bool = False) -> Graph:
    """A chain of n layers with a parameter each, its backward, and a loss gradient op."""
    g = Graph(name=f"chain{n}", time_unit="s")
    x = g.add_tensor(Tensor("x", 64, "input"))
    cur = x
    fwd: list[int] = []
    acts: list[int] = []
    params: list[int] = []
    for i in range(n):
        w = g.add_tensor(Tensor(f"w{i}", 16, "parameter"))
        params.append(w)
        size = 100 if repeat else 50 + 37 * i % 101
        a = g.add_tensor(Tensor(f"a{i}", size, "activation"))
        fwd.append(g.add_op(Op(f"lin{i}", "forward", 1.0 if repeat else 1.0 + i % 3, [cur, w], [a], target="aten.mm")))
        acts.append(a)
        cur = a
        if free_views:
            v = g.add_tensor(Tensor(f"v{i}", 0, "activation", alias_of=a))
            g.add_op(Op(f"view{i}", "forward", 0.0, [a], [v], target="aten.view"))
            cur = v
    loss = g.add_tensor(Tensor("loss", 4, "output"))
    loss_op = g.add_op(Op("loss", "forward", 0.5, [cur], [loss], target="aten.sum"))
    dloss = g.add_tensor(Tensor("dloss", 4, "tangent"))
    grad = g.add_tensor(Tensor("g_out", acts[-1] and g.tensors[acts[-1]].bytes, "activation"))
    g.add_op(Op("loss_bwd", "backward", 0.5, [dloss], [grad], target="aten.expand", differentiates=loss_op))
    for i in reversed(range(n)):
        inp = x if i == 0 else acts[i - 1]
        outs = []
        dw = g.add_tensor(Tensor(f"dw{i}", 16, "param_grad", grad_of=params[i]))
        outs.append(dw)
        if i > 0:
            gi = g.add_tensor(Tensor(f"g{i - 1}", g.tensors[inp].bytes, "activation"))
            outs.append(gi)
        g.add_op(Op(f"lin{i}_bwd", "backward", 2.0, [grad, inp, acts[i]], outs, target="aten.mm_bwd", differentiates=fwd[i]))
        if i > 0:
            grad = outs[-1]
    return g


def check_structure(g: Graph, h: ClusterTree, max_size: int, top_max_size: int) -> None:
    seen = np.zeros(len(g.ops), dtype=int)
    for c in h.leaves():
        assert 1 <= len(c.children) <= max_size
        assert set(c.children) == set(c.fwd_ops)
        for o in (*c.fwd_ops, *c.bwd_ops):
            seen[o] += 1
    for o in h.clusters[h.root].own_bwd_ops:
        seen[o] += 1
    assert (seen == 1).all(), "every op must be in exactly one leaf (or owned by the root)"
    assert len(h.clusters[h.root].children) <= max(top_max_size, max_size)
    for c in h.clusters:
        for k in c.children if not c.is_leaf else ():
            assert h.clusters[k].parent == c.id
            assert h.clusters[k].level < c.level


def check_options(g: Graph, h: ClusterTree) -> None:
    for c in h.leaves():
        opts = h.options[c.id]
        assert opts, f"leaf {c.id} has no option"
        bwd_time = sum(g.ops[o].time for o in c.bwd_ops)
        assert min(o.bwd_time for o in opts) == pytest.approx(bwd_time)
        for o in opts:
            computed_bwd = [i for k, i in o.bwd_steps if k == "compute" and g.ops[i].phase == "backward"]
            assert sorted(computed_bwd) == sorted(c.bwd_ops), "each backward op runs exactly once"
            assert {i for k, i in o.fwd_steps if k == "compute"} == set(c.fwd_ops)
            assert set(o.saved) <= {t for op in c.fwd_ops for t in g.ops[op].outputs}
            assert o.fwd_overhead >= 0 and o.bwd_overhead >= 0
        # a Pareto front: more saved memory must buy less backward time
        for a, b in zip(opts, opts[1:]):
            assert a.saved_bytes < b.saved_bytes and a.bwd_time > b.bwd_time


@pytest.mark.parametrize("partitioner", ["contiguous", "bottom_up", "topo_interval"])
def test_chain_hierarchy_and_options(partitioner: str) -> None:
    g = chain_model(30)
    h = build_hierarchy(g, partitioner=partitioner, max_size=6, top_max_size=4)
    check_structure(g, h, 6, 4)
    check_options(g, h)
    assert h.depth >= 3
    assert h.partitioner == partitioner
    # interfaces: a leaf in the middle reads the previous activation and sends one on
    mid = next(c for c in h.leaves() if 0 not in c.fwd_ops and len(g.ops) - 1 not in c.bwd_ops)
    assert mid.inputs and mid.outputs


def test_the_planner_plans_on_the_rust_hierarchy(data_graphs: Path) -> None:
    """The planner's block tree is the Rust core's contiguous hierarchy, cluster for cluster:
    same ops per block at every level, same root-owned backward ops."""
    from hrockmate.planning import hierarchy as planner

    g = Graph.load(data_graphs / "gpt2_tiny_oplog.json")
    h = build_hierarchy(g, partitioner="contiguous", leaf_size=6, group_size=planner.GROUP_SIZE,
                        max_size=20, top_max_size=16, options=False)
    root = planner.block_tree(g, leaf_size=6, group_size=planner.GROUP_SIZE, top_size=16)

    def same(block: Block, cluster_id: int) -> None:
        c = h.clusters[cluster_id]
        assert sorted(block.fwd_ops) == sorted(c.fwd_ops)
        assert sorted(block.bwd_ops) == sorted(c.bwd_ops)
        if c.is_leaf:
            assert not block.children
        else:
            assert len(block.children) == len(c.children)
            for b, k in zip(block.children, c.children):
                same(b, k)

    top = h.clusters[h.root]
    assert len(root.children) == len(top.children) > 1
    for b, k in zip(root.children, top.children):
        same(b, k)
    assert sorted(root.loose_bwd) == sorted(top.own_bwd_ops)
    # the repeated layers of the operator log give leaves of equal structure
    leaves = list(h.leaves())
    assert len({c.representative for c in leaves}) < len(leaves)


def test_partition_sizes_are_checked() -> None:
    g = chain_model(12)
    with pytest.raises(HierarchyError, match=r"group_size at least 2 \(got 6 and 1\)"):
        build_hierarchy(g, group_size=1)
    with pytest.raises(ValueError, match="block_of_fwd has 3 entries"):
        _native.backward_owners(np.zeros(3, dtype=np.int64), 0, **g.to_arrays())


def test_store_and_recompute_all_in_every_leaf() -> None:
    g = chain_model(12)
    h = build_hierarchy(g, partitioner="topo_interval", max_size=6)
    for c in h.leaves():
        opts = h.options[c.id]
        assert any(o.saved_bytes == 0 for o in opts), "recompute-all (nothing saved) is an option"
        fastest = min(opts, key=lambda o: o.bwd_time)
        # store-all recomputes nothing: its backward fragment computes only backward ops
        assert all(g.ops[i].phase == "backward" for k, i in fastest.bwd_steps if k == "compute")


def test_identical_layers_share_options() -> None:
    g = chain_model(36, repeat=True)
    h = build_hierarchy(g, partitioner="topo_interval", max_size=6)
    leaves = list(h.leaves())
    reps = {c.representative for c in leaves}
    assert len(reps) < len(leaves)
    twin = next(c for c in leaves if c.representative != c.id)
    rep = h.clusters[twin.representative]
    assert twin.canon_hash == rep.canon_hash
    for a, b in zip(h.options[rep.id], h.options[twin.id]):
        mapped = h.map_option(g, a, twin.id)
        assert mapped.fwd_steps == b.fwd_steps and mapped.bwd_steps == b.bwd_steps
        assert mapped.saved == b.saved and mapped.saved_bytes == b.saved_bytes
    other = next(c for c in leaves if c.representative != rep.id)
    with pytest.raises(HierarchyError, match="not equivalent"):
        h.correspondence(g, rep.id, other.id)


def test_real_graphs() -> None:
    files = corpus_files()
    assert len(files) >= 9
    for f in files:
        g = Graph.load(f)
        for partitioner in ("bottom_up", "topo_interval"):
            h = build_hierarchy(g, partitioner=partitioner)
            check_structure(g, h, 20, 30)
            check_options(g, h)
            assert all(h.exact[c.id] for c in h.leaves()), f"{f.name}: leaves of <= 20 ops are exact"


def test_an_invalid_graph_is_a_hierarchy_error_naming_the_op() -> None:
    g = chain_model(4)
    bwd = next(o for o in g.ops if o.phase == "backward")
    i, fwd = next((i, o) for i, o in enumerate(g.ops) if o.phase == "forward" and o.inputs)
    fwd.inputs = [bwd.outputs[0]]  # a forward op reading a backward op's output
    name = f"op {i} '{fwd.name}'"
    with pytest.raises(HierarchyError, match=name):
        build_hierarchy(g)
    with pytest.raises(HierarchyError, match=name):
        simplify(g)


def test_partition_only_is_fast_and_has_no_options(data_graphs: Path) -> None:
    g = Graph.load(data_graphs / "resnet_like_train.json")
    h = build_hierarchy(g, options=False)
    assert all(not o for o in h.options)
    assert h.summary()["leaves"] >= 2


def test_bad_arguments_raise_clear_errors() -> None:
    g = chain_model(4)
    with pytest.raises(HierarchyError, match="unknown partitioner"):
        build_hierarchy(g, partitioner="metis")
    with pytest.raises(HierarchyError, match="max_size"):
        build_hierarchy(g, max_size=1)
    with pytest.raises(HierarchyError, match="max_options"):
        build_hierarchy(g, max_options=1)
    arrays = g.to_arrays()
    arrays["op_in_idx"] = arrays["op_in_idx"] + 1000
    with pytest.raises(ValueError, match="op_in_idx|tensor"):
        _native.build_hierarchy(**arrays)
    with pytest.raises(TypeError, match="tensor_bytes"):
        _native.build_hierarchy(**{k: v for k, v in g.to_arrays().items() if k != "tensor_bytes"})


def _sim(g_arrays: dict, kind: np.ndarray, ids: np.ndarray, forward_len: int) -> dict:
    return _native.simulate(kind, ids, forward_len, **g_arrays)


def test_simplify_folds_views_and_keeps_reference_numbers() -> None:
    g = chain_model(10, free_views=True)
    s = simplify(g)
    assert len(s.graph.ops) < len(g.ops) - 5, "the free view ops are folded away"
    assert all(op.target != "aten.view" for op in s.graph.ops)
    s.graph.validate()
    for ref in (_native.store_all, _native.recompute_all):
        ga, sa = g.to_arrays(), s.graph.to_arrays()
        a = _sim(ga, *ref(**ga))
        b = _sim(sa, *ref(**sa))
        assert a["peak_bytes"] == b["peak_bytes"]
        assert a["time"] == pytest.approx(b["time"])
        back = s.expand_schedule(*ref(**sa))
        c = _sim(ga, *back)
        assert c["peak_bytes"] == b["peak_bytes"] and c["time"] == pytest.approx(b["time"])
    # every original op appears in exactly one new op, or was a folded view
    covered = sorted(o for grp in s.op_origin for o in grp)
    folded = [i for i, op in enumerate(g.ops) if op.target == "aten.view"]
    assert sorted(covered + folded) == list(range(len(g.ops)))


def _big_chain_arrays(n: int) -> dict[str, np.ndarray]:
    """Flat arrays of a forward-only chain of n ops (built with numpy: fast at any size)."""
    tensor_role = np.full(n + 1, ROLE_CODE["activation"], dtype=np.int8)
    tensor_role[0] = ROLE_CODE["input"]
    tensor_role[n] = ROLE_CODE["output"]
    return {
        "tensor_bytes": np.full(n + 1, 1000, dtype=np.int64),
        "tensor_alias": np.full(n + 1, -1, dtype=np.int64),
        "tensor_role": tensor_role,
        "op_time": np.ones(n, dtype=np.float64),
        "op_workspace": np.zeros(n, dtype=np.int64),
        "op_phase": np.zeros(n, dtype=np.int8),
        "op_differentiates": np.full(n, -1, dtype=np.int64),
        "op_flags": np.zeros(n, dtype=np.uint8),
        "op_in_ptr": np.arange(n + 1, dtype=np.int64),
        "op_in_idx": np.arange(n, dtype=np.int64),
        "op_out_ptr": np.arange(n + 1, dtype=np.int64),
        "op_out_idx": np.arange(1, n + 1, dtype=np.int64),
    }


def test_ctrl_c_interrupts_a_long_call() -> None:
    arrays = _big_chain_arrays(150_000)
    start = time.perf_counter()
    _native.build_hierarchy(options=False, **arrays)
    full = time.perf_counter() - start
    timer = threading.Timer(min(0.05, full / 4), _thread.interrupt_main)
    # interrupt_main does nothing while SIGINT is ignored (a test run started in the background)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _native.build_hierarchy(options=True, **arrays)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, before)
    assert time.perf_counter() - start < full + 5.0


def test_the_stub_and_the_partition_defaults_are_the_cores() -> None:
    # the bindings' pyo3 signatures are the one place defaults are written: the shipped stub
    # and clusters.build_hierarchy must say the same
    import ast
    import inspect

    from hrockmate.planning import clusters

    stub = ast.parse((Path(_native.__file__).parent / "_native.pyi").read_text())
    checked = 0
    for fn in (n for n in stub.body if isinstance(n, ast.FunctionDef)):
        native = getattr(_native, fn.name, None)
        if native is None or getattr(native, "__text_signature__", None) is None:
            continue
        # (a default pyo3 cannot write as a literal shows as "...": not checked)
        real = {p.name: p.default for p in inspect.signature(native).parameters.values()
                if p.default is not inspect.Parameter.empty and p.default is not ...}
        args = fn.args.args + fn.args.kwonlyargs
        defaults = [None] * (len(fn.args.args) - len(fn.args.defaults)) + fn.args.defaults
        defaults += fn.args.kw_defaults
        written = {a.arg: ast.literal_eval(d) for a, d in zip(args, defaults)
                   if d is not None and a.arg in real}
        assert written == real, f"_native.pyi's {fn.name} defaults differ from the core's"
        checked += 1
    assert checked >= 1
    ours = {name: p.default for name, p in inspect.signature(clusters.build_hierarchy)
            .parameters.items() if p.default is not inspect.Parameter.empty}
    assert ours == clusters.HIERARCHY_DEFAULTS
    assert ours == {p.name: p.default
                    for p in inspect.signature(_native.build_hierarchy).parameters.values()
                    if p.default is not inspect.Parameter.empty}
