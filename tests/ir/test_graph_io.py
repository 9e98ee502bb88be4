"""Graph IR reading/writing through the Rust core: round trips, every bad-input error path,
the third-party node-link graphs, and the flat-array boundary."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hrockmate import _native
from hrockmate.ir.graph import Graph, GraphError, Op, Tensor
from hrockmate.ir.schedule import recompute_all_schedule, simulate, store_all_schedule


def mlp_graph() -> Graph:
    """x -> linear(w) -> relu -> loss, with its backward pass."""
    g = Graph(name="mlp", meta={"origin": "test"})
    x = g.add_tensor(Tensor("x", 64, "input", shape=[4, 4], dtype="float32"))
    w = g.add_tensor(Tensor("w", 64, "parameter"))
    h = g.add_tensor(Tensor("h", 64, "activation"))
    r = g.add_tensor(Tensor("r", 64, "activation"))
    loss = g.add_tensor(Tensor("loss", 4, "output"))
    t = g.add_tensor(Tensor("tangent_loss", 4, "tangent"))
    dr = g.add_tensor(Tensor("dr", 64, "activation"))
    dh = g.add_tensor(Tensor("dh", 64, "activation"))
    dw = g.add_tensor(Tensor("dw", 64, "param_grad", grad_of=w))
    lin = g.add_op(Op("linear", "forward", 2.5e-6, [x, w], [h], target="aten.mm.default"))
    relu = g.add_op(Op("relu", "forward", 1e-6, [h], [r], module="act"))
    lo = g.add_op(Op("sum", "forward", 1e-6, [r], [loss]))
    g.add_op(Op("sum_bwd", "backward", 1e-6, [t], [dr], differentiates=lo))
    g.add_op(Op("relu_bwd", "backward", 1e-6, [dr, r], [dh], differentiates=relu))
    g.add_op(Op("linear_bwd", "backward", 3e-6, [dh, x], [dw], differentiates=lin, workspace=32))
    return g


def load_error(doc: dict[str, Any] | str) -> str:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(GraphError) as info:
        Graph.from_json(text)
    return str(info.value)


def test_round_trip_through_rust_is_exact(tmp_path: Path) -> None:
    g = mlp_graph()
    back = Graph.from_json(g.to_json())
    assert back.to_dict() == g.to_dict()
    assert back.tensors[0].shape == [4, 4] and back.ops[1].module == "act"
    path = tmp_path / "sub" / "mlp.json"
    g.save(path)
    assert Graph.load(path).to_dict() == g.to_dict()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    # The canonical JSON the core writes parses back to the same graph.
    canonical = _native.parse_graph(g.to_json())
    assert json.loads(canonical) == json.loads(g.to_json())


def test_invalid_json_names_line_and_column() -> None:
    msg = load_error('{\n  "format": "hrockmate-graph",\n  "version": 1,,\n}')
    assert "invalid JSON at line 3, column" in msg


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d["tensors"][2].update(bytes="lots"), "tensor 2 'h': field 'bytes': expected an integer >= 0"),
        (lambda d: d["tensors"][2].update(bytes=-1), "tensor 2 'h': field 'bytes'"),
        (lambda d: d["ops"][1].update(time="fast"), "op 1 'relu': field 'time': expected a number >= 0"),
        (lambda d: d["ops"][1].update(colour="red"), "op 1 'relu': field 'colour': unknown field"),
        (lambda d: d["tensors"][0].update(size=3), "tensor 0 'x': field 'size': unknown field"),
        (lambda d: d.update(comment="hi"), "graph: field 'comment': unknown field"),
        (lambda d: d["ops"][0].pop("outputs"), "op 0 'linear': field 'outputs': missing"),
        (lambda d: d["tensors"][3].update(role="hidden"), "tensor 3 'r': field 'role'"),
        (lambda d: d["ops"][2].update(phase="later"), "op 2 'sum': field 'phase'"),
        (lambda d: d.update(format="onnx"), "graph: field 'format'"),
        (lambda d: d.update(version=7), "unsupported version 7"),
        (lambda d: d["ops"][1].update(inputs=[99]), "op 1 'relu': field 'inputs': tensor id 99 out of range"),
        (lambda d: d["ops"][0].update(differentiates=1), "op 0 'linear': field 'differentiates'"),
        (lambda d: d["tensors"][3].update(name="h"), "tensor 3 'h': field 'name': duplicate name"),
        (lambda d: d["ops"][2].update(name="relu"), "op 2 'relu': field 'name': duplicate name"),
        (lambda d: d["tensors"][3].update(alias_of=2), "tensor 3 'r': field 'bytes'"),
        (lambda d: d["tensors"][3].update(alias_of=3, bytes=0), "alias_of chain loops"),
        (lambda d: d["ops"][2].update(outputs=[]), "tensor 4 'loss': role 'output' must be the output of exactly one op"),
        (lambda d: d["ops"][1].update(outputs=[3, 2]), "tensor 2 'h': is an output of both op 0 'linear' and op 1 'relu'"),
        (lambda d: d["ops"][1].update(inputs=[2, 5]), "op 1 'relu': is a forward op but reads tensor 5 'tangent_loss'"),
        (lambda d: d["tensors"][8].update(grad_of=0), "tensor 8 'dw': field 'grad_of': a 'param_grad' must point at a 'parameter'"),
        (lambda d: d["tensors"][6].update(updates=1), "tensor 6 'dr': field 'updates'"),
    ],
)
def test_bad_input_names_the_item_and_field(edit: Any, expected: str) -> None:
    doc = mlp_graph().to_dict()
    edit(doc)
    assert expected in load_error(doc)


# A Python-built graph gets the checks and messages of the JSON reader: (edit of the Python
# objects, the same edit of the JSON document).
PYTHON_AND_JSON_EDITS = [
    (lambda g: setattr(g.tensors[2], "role", "evil"), lambda d: d["tensors"][2].update(role="evil")),
    (lambda g: setattr(g.ops[1], "inputs", ["2"]), lambda d: d["ops"][1].update(inputs=["2"])),
    (lambda g: setattr(g.tensors[2], "bytes", 10.5), lambda d: d["tensors"][2].update(bytes=10.5)),
    (lambda g: setattr(g.tensors[2], "bytes", -1), lambda d: d["tensors"][2].update(bytes=-1)),
    (lambda g: setattr(g.tensors[2], "bytes", 2**64), lambda d: d["tensors"][2].update(bytes=2**64)),
    (lambda g: setattr(g.ops[2], "phase", "sideways"), lambda d: d["ops"][2].update(phase="sideways")),
    (lambda g: setattr(g.ops[2], "random", 1), lambda d: d["ops"][2].update(random=1)),
    (lambda g: setattr(g.ops[2], "time", "fast"), lambda d: d["ops"][2].update(time="fast")),
    (lambda g: setattr(g.ops[2], "workspace", 0.5), lambda d: d["ops"][2].update(workspace=0.5)),
    (lambda g: setattr(g.tensors[3], "alias_of", -1), lambda d: d["tensors"][3].update(alias_of=-1)),
    (lambda g: setattr(g.ops[4], "differentiates", "relu"),
     lambda d: d["ops"][4].update(differentiates="relu")),
    # a rule between items, which the core checks on the arrays too
    (lambda g: setattr(g.ops[1], "inputs", [7]), lambda d: d["ops"][1].update(inputs=[7])),
]


@pytest.mark.parametrize(("python_edit", "json_edit"), PYTHON_AND_JSON_EDITS)
def test_python_built_graphs_are_checked_like_json(python_edit: Any, json_edit: Any) -> None:
    doc = mlp_graph().to_dict()
    json_edit(doc)
    expected = load_error(doc)
    g = mlp_graph()
    python_edit(g)
    for use in (store_all_schedule, Graph.validate):
        with pytest.raises(GraphError) as info:
            use(g)
        assert str(info.value) == expected, use


def test_python_built_graph_errors_name_the_item() -> None:
    g = mlp_graph()
    g.ops[2].phase = "sideways"
    with pytest.raises(GraphError, match="op 2 'sum': field 'phase'"):
        store_all_schedule(g)
    g = mlp_graph()
    g.tensors[3].bytes = object()
    with pytest.raises(GraphError, match="tensor 3 'r': .*not JSON serializable"):
        store_all_schedule(g)


def test_python_built_graphs_keep_numpy_and_integral_values() -> None:
    g = mlp_graph()
    g.tensors[2].bytes = np.int64(64)
    g.ops[1].time = np.float32(1e-6)
    g.ops[1].random = np.bool_(False)
    g.ops[1].inputs = (2,)
    g.tensors[3].bytes = 64.0  # an integral float, as the JSON reader accepts it
    arrays = g.to_arrays()
    assert arrays["tensor_bytes"].tolist() == [t.bytes for t in mlp_graph().tensors]
    assert simulate(g, store_all_schedule(g)).peak_bytes == simulate(
        mlp_graph(), store_all_schedule(mlp_graph())).peak_bytes


def test_graph_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    path.write_bytes(b'{"name": "\xff"}')
    with pytest.raises(GraphError, match=r"g.json is not UTF-8 text \(byte 0xff at offset 10\)"):
        Graph.load(path)


def test_a_cycle_names_an_op_on_it() -> None:
    doc = mlp_graph().to_dict()
    # relu reads r, its own output's consumer chain: linear -> relu -> linear.
    doc["ops"][0]["inputs"] = [0, 1, 3]
    msg = load_error(doc)
    assert "the ops form a cycle" in msg
    assert "op 0 'linear'" in msg and "op 1 'relu'" in msg and "sum" not in msg


def test_not_a_graph_at_all() -> None:
    assert "node-link" in load_error({"tensors": []})
    assert "expected an object, got a list" in load_error("[]")


def test_missing_file_and_validate() -> None:
    with pytest.raises(GraphError, match="cannot read graph file"):
        Graph.load("/nonexistent/graph.json")
    g = mlp_graph()
    g.validate()
    g.ops[1].inputs = [7]  # dh is produced later, by a backward op
    with pytest.raises(GraphError, match="op 1 'relu': is a forward op but reads tensor 7 'dh'"):
        g.validate()


# ---- node-link -------------------------------------------------------------------------------

def node_link(nodes: list[dict[str, Any]], links: list[dict[str, Any]]) -> dict[str, Any]:
    return {"directed": True, "multigraph": False, "graph": {}, "nodes": nodes, "links": links}


def test_node_link_error_paths() -> None:
    nodes = [
        {"id": 0, "name": "conv", "backward": False, "cost_cpu": 5, "cost_ram": 100},
        {"id": 1, "name": "conv_backward", "backward": True, "cost_cpu": 9, "cost_ram": 100},
    ]
    ok = node_link(nodes, [{"source": 0, "target": 1}])
    g = Graph.from_json(json.dumps(ok))
    assert g.time_unit == "units" and g.ops[1].differentiates == 0
    assert g.tensors[1].role == "input_grad" and g.meta["source_kind"] == "checkmate-training"

    bad = copy.deepcopy(ok)
    bad["links"][0]["target"] = 5
    assert "link 0: field 'target': refers to node id 5, which does not exist" in load_error(bad)
    bad = copy.deepcopy(ok)
    bad["nodes"][1]["id"] = 0
    assert "duplicate node id 0" in load_error(bad)
    bad = copy.deepcopy(ok)
    bad["nodes"][0]["cost_ram"] = "big"
    assert "node 0 'conv': field 'cost_ram'" in load_error(bad)
    bad = copy.deepcopy(ok)
    bad["nodes"][1]["name"] = "conv"
    assert "duplicate name" in load_error(bad)
    bad = copy.deepcopy(ok)
    bad["directed"] = False
    assert "undirected" in load_error(bad)
    bad = copy.deepcopy(ok)
    bad["nodes"][1]["backward"] = False
    bad["links"].append({"source": 1, "target": 0})
    assert "the ops form a cycle" in load_error(bad)


def test_a_graph_exports_as_an_operator_log_without_pairing() -> None:
    g = mlp_graph()
    # a view of the relu's output, read by the loss instead of the output itself
    v = g.add_tensor(Tensor("r_view", 0, "activation", alias_of=3))
    g.ops.insert(2, Op("view", "forward", 0.0, [3], [v]))
    g.ops[3].inputs = [v]
    for op in g.ops:  # (op ids from the insertion on moved up by one)
        if op.differentiates is not None and op.differentiates >= 2:
            op.differentiates += 1
    g.validate()
    doc = g.to_node_link()
    # nothing in the names pairs two nodes: "<index>:<op name>"
    assert [n["name"] for n in doc["nodes"]][:3] == ["0:linear", "1:relu", "2:view"]
    back = Graph.from_json(json.dumps(doc))
    assert back.name == "mlp" and back.num_ops == g.num_ops
    assert [o.phase for o in back.ops] == [o.phase for o in g.ops]
    assert [o.time for o in back.ops] == [o.time for o in g.ops]
    assert all(o.differentiates is None for o in back.ops)
    # one tensor per op, of the bytes of the storages it makes (the view makes none)
    assert [t.bytes for t in back.tensors] == [64, 64, 0, 4, 64, 64, 64]
    # the loss reads the view and, through it, the relu's storage
    assert sorted(back.ops[3].inputs) == [1, 2]
    # the last backward op's result nobody reads: a required gradient
    assert back.tensors[-1].role == "input_grad"
    # the storage read through the view stays alive while the view is read
    r = simulate(back, store_all_schedule(back))
    assert r.peak_bytes >= 64 + 64 + 4


def test_random_layered_dag_format() -> None:
    doc = node_link(
        [
            {"name": 0, "duration": 0, "out_cost": 10, "param_cost": 0},
            {"name": 2, "duration": 4, "out_cost": 20, "param_cost": 8},
            {"name": 1, "duration": 0, "out_cost": 5, "param_cost": 0},
        ],
        [{"0": 0, "1": 2}, {"0": 2, "1": 1}, {"0": 0, "1": 1}],
    )
    g = Graph.from_json(json.dumps(doc))
    assert [o.name for o in g.ops] == ["0", "2", "1"]
    assert all(o.phase == "forward" for o in g.ops)
    assert g.ops[2].inputs == [1, 0]
    assert (g.tensors[3].name, g.tensors[3].role, g.tensors[3].bytes) == ("2.param", "parameter", 8)
    assert [t.role for t in g.tensors[:3]] == ["activation", "activation", "output"]
    r = simulate(g, store_all_schedule(g))
    assert r.peak_bytes == 10 + 20 + 5  # node 0 is read by the sink, so it lives to the end


def test_every_third_party_graph(graphs_dir: Path) -> None:
    files = sorted(graphs_dir.glob("*.json"))
    assert len(files) == 9
    _check_node_link_files(files)


def test_every_repository_graph(data_graphs: Path) -> None:
    files = sorted(data_graphs.glob("*.json"))
    assert len(files) >= 9
    _check_node_link_files(files)


def _check_node_link_files(files: list[Path]) -> None:
    for path in files:
        raw = json.loads(path.read_text())
        g = Graph.load(path)
        assert g.num_ops == len(raw["nodes"]), path.name
        assert sum(len(o.inputs) for o in g.ops) >= len(raw["links"]), path.name
        store = simulate(g, store_all_schedule(g))
        recompute = simulate(g, recompute_all_schedule(g))
        assert recompute.peak_bytes <= store.peak_bytes, path.name
        if path.name.startswith("random_layered"):
            assert {o.phase for o in g.ops} == {"forward"}
            assert any(t.role == "output" for t in g.tensors)
        else:
            by_name = {o.name: i for i, o in enumerate(g.ops)}
            for o in g.ops:
                if path.name.endswith("_oplog.json"):  # operator logs carry no pairing
                    assert o.differentiates is None
                elif o.phase == "backward" and o.name != "Loss":
                    assert o.differentiates == by_name[o.name.removesuffix("_backward")]
            assert recompute.time > store.time, path.name
        # Graphs read from node-link survive the IR round trip.
        assert Graph.from_json(g.to_json()).to_dict() == g.to_dict()


# ---- flat arrays -----------------------------------------------------------------------------

def test_flat_array_boundary_errors() -> None:
    g = mlp_graph()
    arrays = g.to_arrays()
    _native.check_graph(**arrays)
    with pytest.raises(TypeError, match="'tensor_bytes' must be a 1-D numpy array of dtype int64"):
        _native.check_graph(**{**arrays, "tensor_bytes": arrays["tensor_bytes"].astype(np.int32)})
    with pytest.raises(TypeError, match="'op_time' must be a 1-D numpy array of dtype float64"):
        _native.check_graph(**{**arrays, "op_time": [1.0] * g.num_ops})
    with pytest.raises(ValueError, match="'op_phase': has length 5, expected 6"):
        _native.check_graph(**{**arrays, "op_phase": arrays["op_phase"][:-1]})
    with pytest.raises(TypeError, match="missing graph array 'op_flags'"):
        _native.check_graph(**{k: v for k, v in arrays.items() if k != "op_flags"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra'"):
        _native.check_graph(**arrays, extra=np.zeros(1))
    with pytest.raises(TypeError, match="missing graph arrays"):
        _native.check_graph()
    ptr = arrays["op_in_ptr"].copy()
    ptr[3] = 1000
    with pytest.raises(ValueError, match="op_in_ptr"):
        _native.check_graph(**{**arrays, "op_in_ptr": ptr})
    roles = arrays["tensor_role"].copy()
    roles[4] = 4  # the loss becomes an activation: fine; a role code of 9 is not
    _native.check_graph(**{**arrays, "tensor_role": roles})
    roles[4] = 9
    with pytest.raises(ValueError, match="tensor_role': item 4 is 9"):
        _native.check_graph(**{**arrays, "tensor_role": roles})
    # Names, when given, appear in validation messages.
    idx = arrays["op_in_idx"].copy()
    idx[2] = 7  # relu reads dh
    names = {"tensor_names": [t.name for t in g.tensors], "op_names": [o.name for o in g.ops]}
    with pytest.raises(ValueError, match="op 1 'relu': is a forward op but reads tensor 7 'dh'"):
        _native.check_graph(**{**arrays, "op_in_idx": idx}, **names)


def test_arrays_are_converted_once_inside_arrays_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside ``arrays_cached`` the graph is converted once (a solve simulates many schedules);
    outside, or for another graph, every call converts again, so a changed graph is seen."""
    import hrockmate.ir.graph as graph_mod

    calls = []
    real = graph_mod._exact_arrays

    def counting(g: Graph) -> Any:
        calls.append(g)
        return real(g)

    monkeypatch.setattr(graph_mod, "_exact_arrays", counting)
    g, other = mlp_graph(), mlp_graph()
    with g.arrays_cached():
        first = g.to_arrays()
        first["op_time"] = None  # a caller's change to its dict does not reach the cache
        with g.arrays_cached():  # nested: the same conversion
            again = g.to_arrays()
        assert again["op_time"] is not None and np.array_equal(again["op_time"],
                                                               g.to_arrays()["op_time"])
        other.to_arrays()
        other.to_arrays()
    assert calls == [g, other, other]
    g.ops[0].time = 1.0  # outside the block the graph may change, and is converted again
    assert g.to_arrays()["op_time"][0] == 1.0 and calls[-1] is g


def test_the_array_form_decodes_back_to_the_graph(data_graphs: Path) -> None:
    from hrockmate.ir.graph import ops_from_arrays, tensors_from_arrays

    for path in sorted(data_graphs.glob("*.json")):
        g = Graph.load(path)
        arrays = g.to_arrays()
        tensors = tensors_from_arrays(arrays, [t.name for t in g.tensors])
        ops = ops_from_arrays(arrays, [o.name for o in g.ops])
        for t, back in zip(g.tensors, tensors):
            assert (back.name, back.bytes, back.role, back.alias_of, back.grad_of,
                    back.updates) == (t.name, t.bytes, t.role, t.alias_of, t.grad_of, t.updates)
        for o, back in zip(g.ops, ops):
            assert (back.name, back.phase, back.time, back.inputs, back.outputs, back.workspace,
                    back.differentiates, back.random, back.mutates_buffer) == (
                o.name, o.phase, o.time, o.inputs, o.outputs, o.workspace, o.differentiates,
                o.random, o.mutates_buffer)
        assert len(tensors) == len(g.tensors) and len(ops) == len(g.ops)
        assert tensors_from_arrays(arrays)[0].name == "t0"
