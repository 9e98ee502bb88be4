"""Type stub of ``hrockmate._native``, the Rust core's Python bindings (rust/bindings/src).

Graphs cross as keyword arguments holding the flat arrays of docs/graph-ir.md ("Flat array
form"): pass ``**graph.to_arrays()``, optionally with ``tensor_names``/``op_names`` (used only in
error messages). Schedules cross as ``(step_kind int8, step_id int64, forward_len)``.

Every call runs on a worker thread: Ctrl-C stops it within a few milliseconds of the core's
next poll and raises KeyboardInterrupt. ``time_limit`` (seconds, None for none) bounds the
calls that take one. Errors raise the exception classes below.
"""

from typing import Any

import numpy as np
from numpy.typing import NDArray

__version__: str

class InvalidGraphError(ValueError):
    """A graph breaks a rule of the IR; the message names the op, tensor or field."""

class InvalidScheduleError(ValueError):
    """A schedule breaks a rule; the message starts with ``step N:`` when ``step`` is known."""

    step: int | None

class InvalidArgumentError(ValueError):
    """A parameter of a native call is out of range; the message names it."""

class NotAChainError(ValueError):
    """The graph has no chain structure Rotor can use; the message names the op or tensor."""

class InfeasibleError(ValueError):
    """No schedule fits the memory limit."""

    limit_bytes: int
    min_bytes: int

class TooLargeError(MemoryError):
    """The work would need more memory than its bound allows; the message names the sizes."""

class TimeLimitError(TimeoutError):
    """The time limit given to the call ran out before the work finished."""

class InternalError(RuntimeError):
    """A bug in the core (a produced schedule failed its check, or a panic)."""

# A graph as keyword arguments: its flat arrays, plus optional name lists.
_GraphArg = NDArray[Any] | list[str] | None
_ScheduleArrays = tuple[NDArray[np.int8], NDArray[np.int64], int]

# ---- graph_api.rs ----------------------------------------------------------------------------

def parse_graph(text: str) -> str:
    """IR JSON or networkx node-link JSON in; the canonical, validated IR JSON out."""

def check_graph(**graph: _GraphArg) -> None:
    """Validate a graph given as flat arrays."""

def simulate(
    step_kind: NDArray[np.int8],
    step_id: NDArray[np.int64],
    forward_len: int,
    **graph: _GraphArg,
) -> dict[str, Any]:
    """The simulation of a schedule: ``peak_bytes``, ``time``, ``forward_peak``,
    ``backward_peak``, ``bytes_after_forward``, ``peak_step``, ``timeline`` (int64 array),
    ``compute_count`` (int64 array)."""

class MemoryModel:
    """A graph prepared once for measuring schedule fragments with the simulator's storage
    rules (thread-safe)."""

    def __init__(self, **graph: _GraphArg) -> None: ...
    def fragment_peak(
        self,
        steps: list[tuple[str, int]],
        counted: set[int] | frozenset[int],
        start: dict[int, tuple[int, int]],
        dying: list[int] | set[int] | frozenset[int],
    ) -> tuple[int, dict[int, tuple[int, int]]]:
        """(peak bytes of the storages rooted in ``counted`` over ``steps``, the tensors alive
        at the end as {tensor: (storage instance id, bytes)}); ``start``: alive before, in the
        same form; ``dying`` tensors go after their last read."""
    def fragment_profile(
        self,
        steps: list[tuple[str, int]],
        counted: set[int] | frozenset[int],
        start: dict[int, tuple[int, int]],
        dying: list[int] | set[int] | frozenset[int],
    ) -> tuple[list[int], dict[int, int]]:
        """The same measurement step by step: (per step, the bytes while it runs; {instance id
        of ``start``: the step after which its last holder went, -1 before the first} for the
        instances released inside the fragment)."""

def gradient_chunks(
    step_kind: NDArray[np.int8],
    step_id: NDArray[np.int64],
    forward_len: int,
    gradient_ids: list[int],
    state_op: list[int],
    state_bytes: list[int],
    current_state: list[tuple[int, int, int]],
    **graph: _GraphArg,
) -> tuple[NDArray[np.int64], int, int]:
    """The runtime's backward chunking: (step positions before which held gradients are handed
    to autograd, the peak with replayed random ops' generator states, the peak without them).
    ``current_state``: (first, last step position, bytes) of each chain of replays, during which
    the generator's current state is held. The cuts do not depend on the states."""

def store_all(**graph: _GraphArg) -> _ScheduleArrays:
    """The store-all (plain autograd) schedule."""

def recompute_all(**graph: _GraphArg) -> _ScheduleArrays:
    """The recompute-all schedule; TooLargeError beyond 20 million steps."""

def parse_schedule(text: str) -> _ScheduleArrays:
    """Parse schedule JSON."""

def block_checkpoint_schedule(
    blocks: int, keep_extra: NDArray[np.int64], **graph: _GraphArg
) -> _ScheduleArrays:
    """Per-block checkpointing with ``blocks`` contiguous blocks of the forward ops, also keeping
    the tensors ``keep_extra``."""

def labelled_checkpoint_schedule(
    label: NDArray[np.int64], keep_extra: NDArray[np.int64], **graph: _GraphArg
) -> _ScheduleArrays:
    """Per-block checkpointing with a block per run of forward ops of one ``label`` (one per op,
    negative outside every checkpointed layer, ignored on backward ops); the outputs of the
    unlabelled ops are kept besides ``keep_extra``."""

def checkpoint_points(
    keep_extra: NDArray[np.int64],
    budget_bytes: int | None = None,
    time_limit: float | None = None,
    **graph: _GraphArg,
) -> list[tuple[int, int, float, _ScheduleArrays | None]]:
    """Per-block checkpointing at every candidate block count, simulated: ``(blocks,
    peak_bytes, time, schedule)`` each; with ``budget_bytes`` only the fastest point within it
    keeps its schedule; with ``time_limit`` the counts nearest sqrt(n) come first and the rest
    are dropped once it has passed."""

#: The names ``greedy_eviction`` takes as ``score`` (``greedy::EvictionScore::NAMES``).
EVICTION_SCORES: list[str]

def greedy_eviction(
    budget_bytes: int, time_limit: float | None = None, score: str = "staleness",
    **graph: _GraphArg
) -> _ScheduleArrays | None:
    """Greedy eviction (DTR-style) within ``budget_bytes``, evicting by ``score``
    (``"staleness"``: DTR's, ``"next_use"``: the ops until the next use; either with
    ``"+inputs"``: the recompute time counts the producers of inputs that are not alive);
    None when it gets stuck or the time limit passes."""

# ---- literature_api.rs -----------------------------------------------------------------------

def twremat(
    depth_limits: list[int] | None = None,
    max_steps: int | None = None,
    time_limit: float | None = None,
    **graph: _GraphArg,
) -> list[tuple[int, NDArray[np.int8], NDArray[np.int64], int, dict[str, Any]]]:
    """TW-Remat points ``(depth_limit, step_kind, step_id, forward_len, sim)``."""

def rotor(
    budget_bytes: int,
    slots: int = 500,
    time_limit: float | None = None,
    max_table_bytes: int = 1073741824,
    **graph: _GraphArg,
) -> tuple[NDArray[np.int8], NDArray[np.int64], int, dict[str, Any]]:
    """Rotor on a chain-structured graph: ``(step_kind, step_id, forward_len, sim)``."""

def chain_stages(**graph: _GraphArg) -> list[tuple[list[int], list[int]]]:
    """Per chain stage: its forward op ids and backward op ids."""

def rotor_chain(
    input_bytes: int,
    final_grad_bytes: int,
    fwd_time: NDArray[np.float64],
    out_bytes: NDArray[np.uint64],
    grad_bytes: NDArray[np.uint64],
    fwd_overhead: NDArray[np.uint64],
    opt_ptr: NDArray[np.int64],
    opt_fwd_time: NDArray[np.float64],
    opt_state_bytes: NDArray[np.uint64],
    opt_fwd_overhead: NDArray[np.uint64],
    opt_bwd_time: NDArray[np.float64],
    opt_bwd_overhead: NDArray[np.uint64],
    limit_bytes: int,
    slots: int,
    time_limit: float | None = None,
    max_table_bytes: int = 1073741824,
) -> dict[str, Any]:
    """Rotor's program on a chain given as arrays: ``op_kind``, ``op_stage``, ``op_option``
    (arrays), ``time``, ``peak_bytes``, ``slots``."""

# ---- solver_api.rs ---------------------------------------------------------------------------

def build_hierarchy(
    partitioner: str = "contiguous",
    max_size: int = 20,
    top_max_size: int = 30,
    alpha: float = 0.5,
    leaf_size: int = 6,
    group_size: int = 4,
    options: bool = True,
    max_options: int = 12,
    exact_limit: int = 20,
    max_evaluations: int = 1000000,
    **graph: _GraphArg,
) -> dict[str, Any]:
    """The cluster hierarchy (and each leaf's options) as a dict of CSR arrays
    (docs/hierarchy.md, "Arrays")."""

def backward_owners(
    block_of_fwd: NDArray[np.int64], last: int, **graph: _GraphArg
) -> NDArray[np.int64]:
    """The block of every backward op given the forward ops' blocks (-1: none), by the owner rule of
    docs/hierarchy.md ("Clusters"); -1 for forward ops."""

def simplify(
    fold_views: bool = True, merge_chains: bool = True, **graph: _GraphArg
) -> dict[str, Any]:
    """The simplified graph's arrays plus ``op_origin_ptr/idx``, ``tensor_origin``,
    ``tensor_new``."""

def expand_schedule(
    step_kind: NDArray[np.int8],
    step_id: NDArray[np.int64],
    forward_len: int,
    fold_views: bool = True,
    merge_chains: bool = True,
    **graph: _GraphArg,
) -> _ScheduleArrays:
    """A schedule of the simplified graph mapped back to the original graph."""
