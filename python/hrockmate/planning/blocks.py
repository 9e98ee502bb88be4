"""The hierarchy's blocks and their options (forward and backward fragments with costs),
and the per-graph facts the planning stages share."""

from __future__ import annotations

from dataclasses import dataclass, field

from hrockmate import _native
from hrockmate.ir.graph import PREEXISTING_ROLES, Graph
from hrockmate.ir.schedule import Step
from hrockmate.planning import ilp
from hrockmate.planning.clusters import Cluster, ClusterOption

Storages = dict[int, tuple[int, int]]  # alive tensor -> (storage instance, its bytes)


@dataclass
class BlockOption:
    """One way of running a block: forward and backward fragments and what they cost."""

    fwd: list[Step]
    bwd: list[Step]
    saved: frozenset[int]  # tensors kept from the forward fragment for the backward one
    saved_state: Storages  # their storages as the forward fragment left them
    fwd_time: float
    bwd_time: float
    saved_bytes: int
    # peak bytes of the block's own tensors (internal and interface outputs) above what was
    # alive before the fragment; the backward one starts with the saved tensors
    fwd_peak: int
    bwd_peak: int
    # the block's backward inputs the backward fragment reads (the parent must keep them)
    bwd_reads: frozenset[int] = frozenset()
    # made under a cap close to what the fastest option keeps (``NEAR_STORE_ALL_FRACTIONS`` of
    # hrockmate.planning.hierarchy): the top level offers it only at high budgets
    near_store_all: bool = False

    def key(self) -> tuple[float, float, int, int, int]:
        return (self.fwd_time, self.bwd_time, self.saved_bytes, self.fwd_peak, self.bwd_peak)

    def dominates(self, other: "BlockOption") -> bool:
        """No worse in every cost and reads no more of the block's inputs, and not the same."""
        return (all(a <= b for a, b in zip(self.key(), other.key()))
                and self.bwd_reads <= other.bwd_reads
                and (self.key(), self.bwd_reads) != (other.key(), other.bwd_reads))


@dataclass
class Block:
    """A contiguous range of forward ops with the backward ops that belong to them."""

    fwd_ops: list[int]
    bwd_ops: list[int]
    children: list["Block"] = field(default_factory=list)
    loose_bwd: list[int] = field(default_factory=list)  # backward ops no child takes
    fwd_in: list[int] = field(default_factory=list)
    fwd_out: list[int] = field(default_factory=list)
    bwd_in: list[int] = field(default_factory=list)
    bwd_out: list[int] = field(default_factory=list)
    options: list[BlockOption] = field(default_factory=list)
    is_root: bool = False
    solver: str = ""  # what made the options: "ilp", "twremat", "rust", "rotor" or "renamed"
    #: a leaf's options as the Rust core enumerated them, when the hierarchy was built with
    #: them (turned into ``BlockOption``s only for the leaves that use them)
    native_options: list[ClusterOption] = field(default_factory=list)
    #: its cluster of the Rust core's hierarchy (None for the root): blocks whose clusters share
    #: a representative are repeated layers, solved once
    cluster: Cluster | None = None

    @property
    def all_ops(self) -> list[int]:
        return self.fwd_ops + self.bwd_ops

    def depth(self) -> int:
        return 1 + max((c.depth() for c in self.children), default=0)


class GraphFacts:
    """Per-graph facts shared by the hierarchy code."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.order = ilp.topological_ops(graph)
        self.pos = {j: k for k, j in enumerate(self.order)}
        self.prod = graph.producers()
        self.readers = graph.consumers()
        self.fixed = [t.role in PREEXISTING_ROLES for t in graph.tensors]
        self.fwd = [j for j in self.order if graph.ops[j].phase == "forward"]
        self.bwd = [j for j in self.order if graph.ops[j].phase == "backward"]
        self.root = [graph.storage_root(x) for x in range(len(graph.tensors))]
        self._memory: _native.MemoryModel | None = None

    @property
    def memory(self) -> _native.MemoryModel:
        """The graph in the Rust core, for measuring schedule fragments (built once)."""
        if self._memory is None:
            self._memory = _native.MemoryModel(**self.graph.to_arrays())
        return self._memory

