"""How compiled pieces are made to keep the plan's frees (``runtime/inductor.py``): which
nodes of a piece's decomposed graph inductor is told to make at their place, and which inputs
are dropped because no kernel reads them. The peaks these give on a model are checked in
``test_compiled.py`` (``test_the_compiled_peak_stays_at_the_plans_...``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hrockmate.runtime.inductor import _drop_unused_inputs, _realize_where_freed

aten = torch.ops.aten


def test_marks_and_dropped_inputs() -> None:
    """Which nodes are made at their place: a pointwise node that is the last to read a
    buffer at least its size and whose result a library kernel needs; not one fused into a
    reduction. An input nothing reads is dropped from the graph."""
    def fn(a: torch.Tensor, b: torch.Tensor, unread: torch.Tensor) -> Any:
        c = aten.clone.default(aten.transpose.int(a, 0, 1), memory_format=torch.contiguous_format)
        s = aten.sum.dim_IntList(aten.mul.Tensor(b, 3.0), [0])
        return aten.mm.default(c, c), s, aten.zeros_like.default(unread)

    gm = make_fx(fn)(torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))
    marked = _realize_where_freed(gm)
    names = [n.target.overloadpacket.__name__ for n in gm.graph.nodes
             if n.meta.get("inductor_realize_to_strides")]
    # (zeros_like is the last to "read" its input and makes an output: marked as well)
    assert marked == 2 and names == ["clone", "zeros_like"], names
    # (zeros_like decomposes to a fill: the input stays, as make_fx keeps its node; after
    # inductor's decomposition table it has no user)
    from torch._inductor.decomposition import select_decomp_table

    dec = make_fx(fn, decomposition_table=select_decomp_table())(
        torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))
    assert _drop_unused_inputs(dec) == [0, 1]
    assert [n.name for n in dec.graph.nodes if n.op == "placeholder"] == ["a_1", "b_1"]
