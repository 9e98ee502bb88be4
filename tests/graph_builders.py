"""Graphs the tests build: small random training iterations in the shape autograd gives."""

from __future__ import annotations

import random

from hrockmate.ir.graph import PREEXISTING_ROLES, Graph, Op, Tensor


def training_graph(
    n_fwd: int,
    seed: int = 0,
    *,
    skips: bool = True,
    views: bool = True,
    params: bool = True,
    workspace: bool = True,
) -> Graph:
    """A small random training iteration in the shape autograd gives: a forward DAG ending in a
    loss, and per forward op a backward op reading its inputs, its output and the incoming
    gradients, producing the gradient of its input (and of its parameter)."""
    rng = random.Random(seed)
    g = Graph(name=f"train{n_fwd}_{seed}", time_unit="units")
    x = g.add_tensor(Tensor("x", 64, role="input"))
    acts = [x]
    fwd_ops: list[int] = []
    reads: list[list[int]] = []
    param_of: dict[int, int] = {}
    for i in range(n_fwd):
        last = acts[-1]
        ins = [last]
        if skips and len(acts) > 2 and rng.random() < 0.4:
            ins.append(rng.choice(acts[1:-1]))
        is_view = views and i > 0 and rng.random() < 0.2 and len(ins) == 1
        if is_view:
            out = g.add_tensor(Tensor(f"v{i}", 0, alias_of=last))
        else:
            out = g.add_tensor(Tensor(f"a{i}", rng.choice([16, 32, 64, 128, 256])))
        if params and not is_view and rng.random() < 0.5:
            w = g.add_tensor(Tensor(f"w{i}", 32, role="parameter"))
            param_of[i] = w
            ins = ins + [w]
        op = g.add_op(Op(f"f{i}", "forward", float(rng.randint(1, 9)), ins, [out],
                         workspace=rng.choice([0, 0, 8, 24]) if workspace else 0))
        fwd_ops.append(op)
        reads.append(ins)
        acts.append(out)
    loss = g.add_tensor(Tensor("loss", 4, role="output"))
    loss_op = g.add_op(Op("loss", "forward", 1.0, [acts[-1]], [loss]))
    tangent = g.add_tensor(Tensor("dloss", 4, role="tangent"))
    # gradients flowing back: grad_parts[t] = gradient tensors for activation t
    grad_parts: dict[int, list[int]] = {acts[-1]: []}
    gl = g.add_tensor(Tensor("g_out", g.tensors[acts[-1]].bytes or 16))
    g.add_op(Op("loss_bwd", "backward", 1.0, [tangent, acts[-1]], [gl], differentiates=loss_op))
    grad_parts[acts[-1]] = [gl]
    for i in range(n_fwd - 1, -1, -1):
        out = acts[i + 1]
        parts = grad_parts.get(out, [])
        if not parts:
            continue
        ins = list(parts) + [t for t in reads[i] if g.tensors[t].role not in PREEXISTING_ROLES]
        if g.tensors[out].alias_of is None:
            ins.append(out)
        outs = []
        for t in reads[i]:
            if g.tensors[t].role == "parameter":
                outs.append(g.add_tensor(Tensor(f"dw{i}", 32, role="param_grad", grad_of=t)))
            elif g.tensors[t].role == "input":
                outs.append(g.add_tensor(Tensor("dx", 64, role="input_grad", grad_of=t)))
            else:
                gt = g.add_tensor(Tensor(f"g{i}_{g.tensors[t].name}",
                                         max(16, g.tensors[t].bytes)))
                outs.append(gt)
                grad_parts.setdefault(t, []).append(gt)
        g.add_op(Op(f"b{i}", "backward", float(rng.randint(1, 9)), ins, outs,
                    differentiates=fwd_ops[i], workspace=rng.choice([0, 16]) if workspace else 0))
    # unused gradient pieces (of views' bases handled above) must not dangle: every tensor is
    # produced by exactly one op, which holds by construction
    g.validate()
    return g


def gated_chain(cells: int, heavy_bytes: int = 900, light_bytes: int = 50,
                heavy_time: float = 30.0, light_time: float = 1.0) -> Graph:
    """A recurrent chain in the shape of an unrolled LSTM: per cell a heavy op (a matmul and its
    gates: ``heavy_bytes``, ``heavy_time``) reading the state, then two cheap ones (``tanh`` of
    the gates, and the new state from both) whose outputs are small; the backward reads every
    one of them. Dropping the cheap outputs saves a small share of the bytes for little time."""
    g = Graph(name=f"gated_chain{cells}", time_unit="units")
    state = g.add_tensor(Tensor("h0", light_bytes, role="input"))
    w = g.add_tensor(Tensor("w", 64, role="parameter"))
    states, cell_ops = [state], []
    for i in range(cells):
        gates = g.add_tensor(Tensor(f"gates{i}", heavy_bytes))
        act = g.add_tensor(Tensor(f"act{i}", light_bytes))
        new = g.add_tensor(Tensor(f"h{i + 1}", light_bytes))
        ops = (g.add_op(Op(f"matmul{i}", "forward", heavy_time, [state, w], [gates])),
               g.add_op(Op(f"tanh{i}", "forward", light_time, [gates], [act])),
               g.add_op(Op(f"mix{i}", "forward", light_time, [gates, act], [new])))
        cell_ops.append((ops, gates, act))
        state = new
        states.append(new)
    loss = g.add_tensor(Tensor("loss", 4, role="output"))
    loss_op = g.add_op(Op("loss", "forward", light_time, [state], [loss]))
    tangent = g.add_tensor(Tensor("dloss", 4, role="tangent"))
    grad = g.add_tensor(Tensor("g_out", light_bytes))
    g.add_op(Op("loss_bwd", "backward", light_time, [tangent, state], [grad],
                differentiates=loss_op))
    dws = []
    for i in range(cells - 1, -1, -1):
        (matmul, tanh, mix), gates, act = cell_ops[i]
        d_act = g.add_tensor(Tensor(f"d_act{i}", light_bytes))
        d_gates_mix = g.add_tensor(Tensor(f"d_gates_mix{i}", heavy_bytes))
        g.add_op(Op(f"mix{i}_bwd", "backward", light_time, [grad, gates, act],
                    [d_gates_mix, d_act], differentiates=mix))
        d_gates = g.add_tensor(Tensor(f"d_gates{i}", heavy_bytes))
        g.add_op(Op(f"tanh{i}_bwd", "backward", light_time, [d_act, act, d_gates_mix],
                    [d_gates], differentiates=tanh))
        d_state = g.add_tensor(Tensor(f"d_h{i}", light_bytes,
                                      role="input_grad" if i == 0 else "activation",
                                      grad_of=states[0] if i == 0 else None))
        dw = g.add_tensor(Tensor(f"dw{i}", 64))
        g.add_op(Op(f"matmul{i}_bwd", "backward", heavy_time, [d_gates, states[i], w],
                    [d_state, dw], differentiates=matmul))
        dws.append(dw)
        grad = d_state
    total = g.add_tensor(Tensor("dw", 64, role="param_grad", grad_of=w))
    g.add_op(Op("dw_sum", "backward", light_time, dws, [total]))
    g.validate()
    return g
