"""Simplification, hierarchical partitioning and leaf options (Python side of the Rust core).

See docs/hierarchy.md for the data model. Typical use::

    from hrockmate.planning.clusters import build_hierarchy
    h = build_hierarchy(graph)                 # partition + options of every leaf
    for leaf in h.leaves():
        for opt in h.options[leaf.id]:
            opt.saved_bytes, opt.bwd_time, opt.fwd_steps

All op and tensor ids refer to the graph that was passed in. ``simplify`` returns a smaller
graph plus the mappings back; ``SimplifiedGraph.expand_schedule`` turns a schedule of the
simplified graph into one of the original graph with the same peak memory and time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from hrockmate.ir.graph import Graph, ops_from_arrays, tensors_from_arrays
from hrockmate.ir.schedule import call_native

__all__ = [
    "Cluster",
    "ClusterOption",
    "ClusterTree",
    "HierarchyError",
    "PARTITIONERS",
    "SimplifiedGraph",
    "build_hierarchy",
    "correspondence",
    "simplify",
]

PARTITIONERS: tuple[str, ...] = ("contiguous", "bottom_up", "topo_interval")
STEP_KINDS: tuple[str, ...] = ("compute", "free")


class HierarchyError(ValueError):
    """Bad configuration, or a graph the partitioner or option enumeration cannot handle."""


def _steps(kind: np.ndarray, ids: np.ndarray) -> list[tuple[str, int]]:
    return [(STEP_KINDS[int(k)], int(i)) for k, i in zip(kind, ids)]


@dataclass(frozen=True)
class ClusterOption:
    """One way to run a leaf cluster: a forward and a backward schedule fragment.

    Steps are ``int8`` kinds (0 compute, 1 free) and ``int64`` ids of the partitioned graph.
    """

    cluster: int
    fwd_kind: np.ndarray
    fwd_id: np.ndarray
    bwd_kind: np.ndarray
    bwd_id: np.ndarray
    saved: tuple[int, ...]
    bwd_needs_inputs: tuple[int, ...]
    bwd_needs_outputs: tuple[int, ...]
    fwd_time: float
    bwd_time: float
    saved_bytes: int
    fwd_overhead: int
    bwd_overhead: int

    @property
    def fwd_steps(self) -> list[tuple[str, int]]:
        return _steps(self.fwd_kind, self.fwd_id)

    @property
    def bwd_steps(self) -> list[tuple[str, int]]:
        return _steps(self.bwd_kind, self.bwd_id)

    def renamed(self, cluster: int, ops: dict[int, int], tensors: dict[int, int]) -> "ClusterOption":
        """The same option with ids mapped (see ``ClusterTree.correspondence``)."""

        def ids(kind: np.ndarray, vals: np.ndarray) -> np.ndarray:
            return np.array(
                [ops[int(v)] if k == 0 else tensors[int(v)] for k, v in zip(kind, vals)],
                dtype=np.int64,
            )

        def ts(v: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(sorted(tensors[t] for t in v))

        return ClusterOption(
            cluster=cluster,
            fwd_kind=self.fwd_kind.copy(),
            fwd_id=ids(self.fwd_kind, self.fwd_id),
            bwd_kind=self.bwd_kind.copy(),
            bwd_id=ids(self.bwd_kind, self.bwd_id),
            saved=ts(self.saved),
            bwd_needs_inputs=ts(self.bwd_needs_inputs),
            bwd_needs_outputs=ts(self.bwd_needs_outputs),
            fwd_time=self.fwd_time,
            bwd_time=self.bwd_time,
            saved_bytes=self.saved_bytes,
            fwd_overhead=self.fwd_overhead,
            bwd_overhead=self.bwd_overhead,
        )


@dataclass(frozen=True)
class Cluster:
    """A node of the hierarchy (see docs/hierarchy.md, "Clusters")."""

    id: int
    level: int
    is_leaf: bool
    children: tuple[int, ...]
    parent: int | None
    fwd_ops: tuple[int, ...]
    bwd_ops: tuple[int, ...]
    own_bwd_ops: tuple[int, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    canon_hash: int
    representative: int


@dataclass
class ClusterTree:
    clusters: list[Cluster]
    root: int
    op_cluster: np.ndarray
    partitioner: str
    #: options[c]: the options of cluster c (empty for non-leaves or without enumeration)
    options: list[list[ClusterOption]] = field(default_factory=list)
    #: exact[c]: whether leaf c's Pareto front is exact (False: greedy search)
    exact: list[bool] = field(default_factory=list)

    def leaves(self) -> Iterator[Cluster]:
        return (c for c in self.clusters if c.is_leaf)

    @property
    def depth(self) -> int:
        return self.clusters[self.root].level

    def bottom_up(self) -> list[Cluster]:
        """Clusters ordered by level (children before parents), ties by id."""
        return sorted(self.clusters, key=lambda c: (c.level, c.id))

    def correspondence(self, graph: Graph, a: int, b: int) -> tuple[dict[int, int], dict[int, int]]:
        """Op and tensor maps from cluster ``a`` to cluster ``b`` (same representative)."""
        return correspondence(graph, self.clusters[a], self.clusters[b])

    def map_option(self, graph: Graph, option: ClusterOption, to: int) -> ClusterOption:
        """Rename an option of one cluster for an equivalent cluster ``to``."""
        ops, tensors = self.correspondence(graph, option.cluster, to)
        return option.renamed(to, ops, tensors)

    def summary(self) -> dict[str, Any]:
        leaves = list(self.leaves())
        return {
            "partitioner": self.partitioner,
            "clusters": len(self.clusters),
            "leaves": len(leaves),
            "depth": self.depth,
            "root_children": len(self.clusters[self.root].children),
            "distinct_leaves": len({c.representative for c in leaves}),
            "max_leaf_size": max((len(c.children) for c in leaves), default=0),
            "options": sum(len(o) for o in self.options),
        }


def correspondence(graph: Graph, a: Cluster, b: Cluster) -> tuple[dict[int, int], dict[int, int]]:
    """Op and tensor maps from cluster ``a`` to the equivalent cluster ``b`` (the core gave both
    one representative: repeated layers). Ops correspond position by position in canonical
    order, tensors as the ops' inputs and outputs, and storage owners as their views do."""
    if a.representative != b.representative:
        raise HierarchyError(
            f"clusters {a.id} and {b.id} are not equivalent (representatives "
            f"{a.representative} and {b.representative}); only equivalent clusters map"
        )
    oa, ob = [*a.fwd_ops, *a.bwd_ops], [*b.fwd_ops, *b.bwd_ops]
    ops = dict(zip(oa, ob))
    tensors: dict[int, int] = {}
    for x, y in zip(oa, ob):
        gx, gy = graph.ops[x], graph.ops[y]
        tensors.update(zip(gx.inputs, gy.inputs))
        tensors.update(zip(gx.outputs, gy.outputs))
    for x, y in list(tensors.items()):
        tx, ty = graph.tensors[x].alias_of, graph.tensors[y].alias_of
        while tx is not None and ty is not None and tx not in tensors:
            tensors[tx] = ty
            tx, ty = graph.tensors[tx].alias_of, graph.tensors[ty].alias_of
    return ops, tensors


def _native_call(fn_name: str, graph: Graph, **kwargs: Any) -> Any:
    """Call native ``fn_name`` on ``graph``; its errors become HierarchyError (naming ops and
    tensors where the core's message does)."""
    from hrockmate import _native

    errors = [(ValueError, lambda e: HierarchyError(str(e)))]
    return call_native(getattr(_native, fn_name), graph, errors=errors, **kwargs)


def _split(ptr: np.ndarray, idx: np.ndarray) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in idx[ptr[i] : ptr[i + 1]]) for i in range(len(ptr) - 1)]


def _native_defaults(name: str) -> dict[str, Any]:
    """The keyword defaults of the core's function ``name`` as the bindings declare them: the
    one place the partition defaults are written (``rust/bindings``' pyo3 signature)."""
    import inspect

    from hrockmate import _native

    params = inspect.signature(getattr(_native, name)).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


#: ``build_hierarchy``'s defaults, read from the core.
HIERARCHY_DEFAULTS: dict[str, Any] = _native_defaults("build_hierarchy")


def build_hierarchy(
    graph: Graph,
    *,
    partitioner: str = HIERARCHY_DEFAULTS["partitioner"],
    max_size: int = HIERARCHY_DEFAULTS["max_size"],
    top_max_size: int = HIERARCHY_DEFAULTS["top_max_size"],
    alpha: float = HIERARCHY_DEFAULTS["alpha"],
    leaf_size: int = HIERARCHY_DEFAULTS["leaf_size"],
    group_size: int = HIERARCHY_DEFAULTS["group_size"],
    options: bool = HIERARCHY_DEFAULTS["options"],
    max_options: int = HIERARCHY_DEFAULTS["max_options"],
    exact_limit: int = HIERARCHY_DEFAULTS["exact_limit"],
    max_evaluations: int = HIERARCHY_DEFAULTS["max_evaluations"],
) -> ClusterTree:
    """Partition ``graph`` into a hierarchy of clusters and enumerate each leaf's options.

    ``partitioner``: ``"contiguous"`` (the planner's: stretches of the forward order of about
    ``leaf_size`` ops per leaf and ``group_size`` children above, cut where few bytes cross),
    ``"bottom_up"`` (H-Rockmate's algorithm) or ``"topo_interval"``.
    ``max_size``/``top_max_size``: most children of a cluster / of the root.
    ``max_options``: most options per leaf; ``exact_limit``: most candidate tensors for which a
    leaf's front is searched exactly; ``max_evaluations``: search budget per leaf (a leaf whose
    search runs out of it gets a greedy front and ``exact[c] = False``).
    Runs in the Rust core; Ctrl-C interrupts it.
    """
    if partitioner not in PARTITIONERS:
        raise HierarchyError(f"unknown partitioner {partitioner!r}; use one of {', '.join(PARTITIONERS)}")
    d = _native_call(
        "build_hierarchy",
        graph,
        partitioner=partitioner,
        max_size=int(max_size),
        top_max_size=int(top_max_size),
        alpha=float(alpha),
        leaf_size=int(leaf_size),
        group_size=int(group_size),
        options=bool(options),
        max_options=int(max_options),
        exact_limit=int(exact_limit),
        max_evaluations=int(max_evaluations),
    )
    lists = {k: _split(d[f"{k}_ptr"], d[f"{k}_idx"]) for k in ("children", "fwd_ops", "bwd_ops", "own_bwd_ops", "inputs", "outputs")}
    n = len(d["level"])
    clusters = [
        Cluster(
            id=i,
            level=int(d["level"][i]),
            is_leaf=bool(d["is_leaf"][i]),
            children=lists["children"][i],
            parent=None if d["parent"][i] < 0 else int(d["parent"][i]),
            fwd_ops=lists["fwd_ops"][i],
            bwd_ops=lists["bwd_ops"][i],
            own_bwd_ops=lists["own_bwd_ops"][i],
            inputs=lists["inputs"][i],
            outputs=lists["outputs"][i],
            canon_hash=int(d["canon_hash"][i]),
            representative=int(d["representative"][i]),
        )
        for i in range(n)
    ]
    h = ClusterTree(clusters=clusters, root=int(d["root"]), op_cluster=d["op_cluster"], partitioner=d["partitioner"])
    h.options = [[] for _ in range(n)]
    h.exact = [True] * n
    if options:
        h.exact = [bool(x) for x in d["exact"]]
        saved = _split(d["opt_saved_ptr"], d["opt_saved_idx"])
        needs_in = _split(d["opt_needs_inputs_ptr"], d["opt_needs_inputs_idx"])
        needs_out = _split(d["opt_needs_outputs_ptr"], d["opt_needs_outputs_idx"])
        fp, bp = d["opt_fwd_ptr"], d["opt_bwd_ptr"]
        for k, c in enumerate(d["opt_cluster"]):
            h.options[int(c)].append(
                ClusterOption(
                    cluster=int(c),
                    fwd_kind=d["opt_fwd_kind"][fp[k] : fp[k + 1]],
                    fwd_id=d["opt_fwd_id"][fp[k] : fp[k + 1]],
                    bwd_kind=d["opt_bwd_kind"][bp[k] : bp[k + 1]],
                    bwd_id=d["opt_bwd_id"][bp[k] : bp[k + 1]],
                    saved=saved[k],
                    bwd_needs_inputs=needs_in[k],
                    bwd_needs_outputs=needs_out[k],
                    fwd_time=float(d["opt_fwd_time"][k]),
                    bwd_time=float(d["opt_bwd_time"][k]),
                    saved_bytes=int(d["opt_saved_bytes"][k]),
                    fwd_overhead=int(d["opt_fwd_overhead"][k]),
                    bwd_overhead=int(d["opt_bwd_overhead"][k]),
                )
            )
    return h


@dataclass
class SimplifiedGraph:
    """A simplified graph and the way back to the original (see docs/hierarchy.md)."""

    graph: Graph
    original: Graph
    #: op_origin[new op]: the original ops it runs, in order
    op_origin: list[tuple[int, ...]]
    #: tensor_origin[new tensor]: the original tensor
    tensor_origin: np.ndarray
    #: tensor_new[original tensor]: the new tensor it is (or was folded into); -1: merged away
    tensor_new: np.ndarray
    fold_views: bool = True
    merge_chains: bool = True

    def expand_schedule(
        self, step_kind: np.ndarray, step_id: np.ndarray, forward_len: int
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """A schedule of the simplified graph -> the same schedule on the original graph."""
        return _native_call(
            "expand_schedule",
            self.original,
            step_kind=np.asarray(step_kind, dtype=np.int8),
            step_id=np.asarray(step_id, dtype=np.int64),
            forward_len=int(forward_len),
            fold_views=self.fold_views,
            merge_chains=self.merge_chains,
        )


def simplify(graph: Graph, *, fold_views: bool = True, merge_chains: bool = True) -> SimplifiedGraph:
    """Fold free views into their storage and merge chains no schedule would split."""
    d = _native_call("simplify", graph, fold_views=fold_views, merge_chains=merge_chains)
    origin = _split(d["op_origin_ptr"], d["op_origin_idx"])
    t_origin = d["tensor_origin"]
    tensors = tensors_from_arrays(d, [graph.tensors[int(t)].name for t in t_origin])
    for t, src in zip(tensors, (graph.tensors[int(t)] for t in t_origin)):
        t.shape, t.dtype = src.shape, src.dtype
    ops = ops_from_arrays(d, ["+".join(graph.ops[m].name for m in members) for members in origin])
    for op, members in zip(ops, origin):
        op.target = "+".join(graph.ops[m].target for m in members)
        op.module = graph.ops[members[0]].module
    new = Graph(name=graph.name, tensors=tensors, ops=ops, time_unit=graph.time_unit, meta=dict(graph.meta))
    return SimplifiedGraph(
        graph=new,
        original=graph,
        op_origin=origin,
        tensor_origin=t_origin,
        tensor_new=d["tensor_new"],
        fold_views=fold_views,
        merge_chains=merge_chains,
    )
