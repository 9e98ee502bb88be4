"""The graph IR in Python: a mirror of ``rust/core/src/graph.rs`` (see docs/graph-ir.md).

Parsing and validation of JSON happen once, in the Rust core (``_native.parse_graph``); this
module holds the Python objects, writes the JSON, and turns a graph into the flat numpy arrays
that cross into Rust.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; abandoned temporary files are found by age
    fcntl = None  # type: ignore[assignment]

FORMAT_NAME = "hrockmate-graph"
FORMAT_VERSION = 1

ROLES: tuple[str, ...] = (
    "input",
    "parameter",
    "buffer",
    "tangent",
    "activation",
    "output",
    "param_grad",
    "input_grad",
    "buffer_update",
)
ROLE_CODE: dict[str, int] = {r: i for i, r in enumerate(ROLES)}
PREEXISTING_ROLES = frozenset({"input", "parameter", "buffer", "tangent"})
PHASES: tuple[str, ...] = ("forward", "backward")

T = TypeVar("T")


class GraphError(ValueError):
    """A graph or graph file is malformed; the message names the op, tensor or field."""


@dataclass
class Tensor:
    name: str
    bytes: int
    role: str = "activation"
    alias_of: int | None = None
    grad_of: int | None = None
    updates: int | None = None
    shape: list[int] | None = None
    dtype: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "bytes": _plain(self.bytes),
            "role": self.role,
            "alias_of": _plain(self.alias_of),
            "grad_of": _plain(self.grad_of),
            "updates": _plain(self.updates),
        }
        if self.shape is not None:
            d["shape"] = _plain_list(self.shape)
        if self.dtype is not None:
            d["dtype"] = self.dtype
        return d


@dataclass
class Op:
    name: str
    phase: str
    time: float
    inputs: list[int]
    outputs: list[int]
    target: str = ""
    workspace: int = 0
    differentiates: int | None = None
    random: bool = False
    mutates_buffer: bool = False
    module: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "phase": self.phase,
            "time": _plain(self.time),
            "workspace": _plain(self.workspace),
            "inputs": _plain_list(self.inputs),
            "outputs": _plain_list(self.outputs),
            "differentiates": _plain(self.differentiates),
            "random": _plain(self.random),
            "mutates_buffer": _plain(self.mutates_buffer),
            "module": self.module,
        }


@dataclass
class Graph:
    """One training iteration as ops and tensors. Ids are list positions."""

    name: str
    tensors: list[Tensor] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    time_unit: str = "s"
    meta: dict[str, Any] = field(default_factory=dict)

    # ---- construction helpers -------------------------------------------------------------
    def add_tensor(self, tensor: Tensor) -> int:
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def add_op(self, op: Op) -> int:
        self.ops.append(op)
        return len(self.ops) - 1

    # ---- derived views ---------------------------------------------------------------------
    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    def storage_root(self, x: int) -> int:
        """The tensor that owns the storage tensor ``x`` lives in (``x`` itself unless a view)."""
        while self.tensors[x].alias_of is not None:
            x = self.tensors[x].alias_of  # type: ignore[assignment]
        return x

    def producers(self) -> list[int | None]:
        prod: list[int | None] = [None] * len(self.tensors)
        for i, op in enumerate(self.ops):
            for t in op.outputs:
                prod[t] = i
        return prod

    def consumers(self) -> list[list[int]]:
        users: list[list[int]] = [[] for _ in self.tensors]
        for i, op in enumerate(self.ops):
            for t in dict.fromkeys(op.inputs):
                users[t].append(i)
        return users

    # ---- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "name": self.name,
            "time_unit": self.time_unit,
            "tensors": [t.to_dict() for t in self.tensors],
            "ops": [o.to_dict() for o in self.ops],
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_node_link(self) -> dict[str, Any]:
        """The graph as another tool's operator log: a networkx node-link graph of the
        Checkmate training kind (docs/graph-ir.md), one node per op with its ``backward`` flag,
        time (``cost_cpu``) and the bytes of the storages it makes (``cost_ram``), and a link
        from the op that made each tensor an op reads.

        What the format cannot say is left out: which forward op a backward op differentiates
        and which parameter a gradient is of (nodes are named ``"<index>:<op name>"``, which
        never pairs two nodes), views (a view's op makes no bytes; its readers are linked to
        the op that made the storage too, so that storage stays alive while the view is read),
        workspace, tensors that exist before the iteration, random ops and buffer updates.
        ``Graph.from_json`` reads the result back as a graph of one tensor per op."""
        made_by = self.producers()
        nodes = []
        links: list[dict[str, int]] = []
        for i, op in enumerate(self.ops):
            owned = sum(self.tensors[t].bytes for t in op.outputs
                        if self.tensors[t].alias_of is None)
            nodes.append({"id": i, "name": f"{i}:{op.name}", "backward": op.phase == "backward",
                          "cost_cpu": op.time, "cost_ram": owned})
            sources: dict[int, None] = {}
            for x in op.inputs:
                for y in (x, self.storage_root(x)):
                    p = made_by[y]
                    if p is not None and p != i:
                        sources[p] = None
            links.extend({"source": p, "target": i} for p in sources)
        return {"directed": True, "multigraph": False, "graph": {"name": self.name},
                "nodes": nodes, "links": links}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Graph":
        """Build from an already validated IR dict (as returned by the Rust parser)."""
        return cls(
            name=data.get("name", ""),
            tensors=[Tensor(**t) for t in data["tensors"]],
            ops=[Op(**o) for o in data["ops"]],
            time_unit=data.get("time_unit", "s"),
            meta=dict(data.get("meta") or {}),
        )

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        """Parse IR JSON or a networkx node-link graph; validated by the Rust core."""
        from hrockmate import _native

        try:
            canonical = _native.parse_graph(text)
        except ValueError as exc:
            raise GraphError(str(exc)) from None
        return cls.from_dict(json.loads(canonical))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Graph":
        return load_json_file(path, "graph", cls.from_json, GraphError)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write JSON atomically (temporary file + rename), so a crash never leaves half a file."""
        write_atomic(Path(path), self.to_json())

    def validate(self) -> None:
        """Raise GraphError naming the first problem, using the Rust core's checks."""
        from hrockmate import _native

        try:
            _native.parse_graph(self._json_for_reader())
        except ValueError as exc:
            raise GraphError(str(exc)) from None

    def _json_for_reader(self) -> str:
        """``to_json()``; a value JSON cannot hold raises GraphError naming its op or tensor."""
        try:
            return self.to_json()
        except (TypeError, ValueError) as exc:
            problem = exc
        for kind, items in (("tensor", self.tensors), ("op", self.ops)):
            for i, item in enumerate(items):
                try:
                    json.dumps(item.to_dict())
                except (TypeError, ValueError) as exc:
                    raise GraphError(f"{kind} {i} {item.name!r}: {exc}") from None
        raise GraphError(f"graph {self.name!r}: {problem}") from None

    def structure_hash(self) -> str:
        """Hash of everything a plan depends on except measured times (stable across runs)."""
        h = hashlib.sha256()
        for t in self.tensors:
            h.update(f"T{t.bytes},{t.role},{t.alias_of},{t.grad_of},{t.updates};".encode())
        for o in self.ops:
            h.update(
                f"O{o.target},{o.phase},{o.workspace},{o.inputs},{o.outputs},"
                f"{o.differentiates},{o.random},{o.mutates_buffer};".encode()
            )
        return h.hexdigest()[:16]

    # ---- flat arrays for Rust ----------------------------------------------------------------
    def to_arrays(self) -> dict[str, np.ndarray]:
        """The flat array form of docs/graph-ir.md.

        A graph built in Python is checked by the same rules, with the same messages, as a JSON
        graph: a field the arrays cannot carry as it is (a role or phase the IR does not know, a
        size or id that is not an integer >= 0, a flag that is not a bool, a time that is not a
        number) sends the graph through the Rust JSON reader, which raises ``GraphError`` naming
        the op or tensor and the field (or reads an integral float such as ``4096.0`` as JSON
        does). Everything else is checked by the Rust core when it receives the arrays.
        """
        cached = _ARRAYS_IN_USE.get(id(self))
        if cached is not None:
            return dict(cached)
        arrays = _exact_arrays(self)
        if arrays is None:
            arrays = _exact_arrays(Graph.from_json(self._json_for_reader()))
            if arrays is None:
                raise GraphError(f"graph '{self.name}': the reader's canonical form does not "
                                 "convert to arrays (internal error)")
        if id(self) in _ARRAYS_IN_USE:  # inside ``arrays_cached``: the first conversion
            _ARRAYS_IN_USE[id(self)] = arrays
            return dict(arrays)
        return arrays

    @contextlib.contextmanager
    def arrays_cached(self) -> Iterator[None]:
        """Within the block, ``to_arrays`` converts the graph once and then returns that
        conversion: for a caller that simulates many schedules of a graph it does not change
        meanwhile (a solve: on a 6k-op graph 90 conversions took 4 s). Nested blocks share it."""
        if id(self) in _ARRAYS_IN_USE:
            yield
            return
        _ARRAYS_IN_USE[id(self)] = None  # (the id stays this graph's while the block runs)
        try:
            yield
        finally:
            _ARRAYS_IN_USE.pop(id(self), None)


# ids of the graphs inside ``Graph.arrays_cached``: their arrays once converted (None before)
_ARRAYS_IN_USE: dict[int, dict[str, np.ndarray] | None] = {}


_INTEGERS = (int, np.integer)
_NUMBERS = (int, float, np.integer, np.floating)
_BOOLS = (bool, np.bool_)
_PHASE_CODE: dict[str, int] = {p: i for i, p in enumerate(PHASES)}


def _plain(value: Any) -> Any:
    """numpy scalars as Python values (for JSON); anything else unchanged, so that the JSON
    reader sees, and names, a value of the wrong type instead of a silently converted one."""
    return value.item() if isinstance(value, np.generic) else value


def _plain_list(values: Any) -> Any:
    return [_plain(v) for v in values] if isinstance(values, (list, tuple, np.ndarray)) else values


def _all_of(values: list[Any], kinds: tuple[type, ...], refused: tuple[type, ...] = ()) -> bool:
    return all(issubclass(k, kinds) and not issubclass(k, refused) for k in set(map(type, values)))


def _counts(values: list[Any]) -> np.ndarray | None:
    """int64 array when every value is an integer >= 0 that int64 holds (not a bool), else None."""
    if not _all_of(values, _INTEGERS, _BOOLS):
        return None
    try:
        arr = np.array(values, dtype=np.int64)
    except OverflowError:
        return None
    return None if arr.size and int(arr.min()) < 0 else arr


def _optional_ids(values: list[Any]) -> np.ndarray | None:
    """Like ``_counts`` with None allowed (as -1, the arrays' "none")."""
    given = [i for i, v in enumerate(values) if v is not None]
    ids = _counts([values[i] for i in given])
    if ids is None:
        return None
    out = np.full(len(values), -1, dtype=np.int64)
    out[given] = ids
    return out


def _times(values: list[Any]) -> np.ndarray | None:
    """float64 array when every value is a number (not a bool); the core checks the range."""
    if not _all_of(values, _NUMBERS, _BOOLS):
        return None
    try:
        return np.array(values, dtype=np.float64)
    except OverflowError:
        return None


def _flags(random: list[Any], mutates_buffer: list[Any]) -> np.ndarray | None:
    """Bit 0 random, bit 1 mutates_buffer, when both are bools."""
    if not _all_of(random + mutates_buffer, _BOOLS):
        return None
    return np.array(random, dtype=np.uint8) | (np.array(mutates_buffer, dtype=np.uint8) << 1)


def _codes(values: list[Any], table: dict[str, int]) -> np.ndarray | None:
    try:
        codes = [table.get(v) if isinstance(v, str) else None for v in values]
    except TypeError:
        return None
    return None if None in codes else np.array(codes, dtype=np.int8)


def _exact_arrays(graph: Graph) -> dict[str, np.ndarray] | None:
    """The flat arrays, or None when some field does not convert exactly."""
    ts, ops = graph.tensors, graph.ops
    try:
        in_lists = [list(o.inputs) for o in ops]
        out_lists = [list(o.outputs) for o in ops]
    except TypeError:
        return None
    arrays = {
        "tensor_bytes": _counts([t.bytes for t in ts]),
        "tensor_alias": _optional_ids([t.alias_of for t in ts]),
        "tensor_role": _codes([t.role for t in ts], ROLE_CODE),
        "tensor_grad_of": _optional_ids([t.grad_of for t in ts]),
        "tensor_updates": _optional_ids([t.updates for t in ts]),
        "op_time": _times([o.time for o in ops]),
        "op_workspace": _counts([o.workspace for o in ops]),
        "op_phase": _codes([o.phase for o in ops], _PHASE_CODE),
        "op_differentiates": _optional_ids([o.differentiates for o in ops]),
        "op_flags": _flags([o.random for o in ops], [o.mutates_buffer for o in ops]),
        "op_in_ptr": _csr_ptr(in_lists),
        "op_in_idx": _counts([i for ins in in_lists for i in ins]),
        "op_out_ptr": _csr_ptr(out_lists),
        "op_out_idx": _counts([i for outs in out_lists for i in outs]),
    }
    if any(a is None for a in arrays.values()):
        return None
    return arrays  # type: ignore[return-value]


def _optional_id(a: Any, i: int) -> int | None:
    return None if a is None or a[i] < 0 else int(a[i])


def tensors_from_arrays(arrays: Mapping[str, Any], names: Sequence[str] | None = None
                        ) -> list[Tensor]:
    """The tensors of the flat array form (``to_arrays``'s inverse; names are not in the
    arrays: ``names[i]``, else ``t{i}``). ``tensor_grad_of``/``tensor_updates`` may be absent."""
    d = arrays
    out = []
    for i in range(len(d["tensor_bytes"])):
        out.append(Tensor(
            name=names[i] if names is not None else f"t{i}",
            bytes=int(d["tensor_bytes"][i]),
            role=ROLES[int(d["tensor_role"][i])],
            alias_of=_optional_id(d["tensor_alias"], i),
            grad_of=_optional_id(d.get("tensor_grad_of"), i),
            updates=_optional_id(d.get("tensor_updates"), i),
        ))
    return out


def ops_from_arrays(arrays: Mapping[str, Any], names: Sequence[str] | None = None) -> list[Op]:
    """The ops of the flat array form (``to_arrays``'s inverse; names, targets and modules are
    not in the arrays: ``names[i]`` else ``op{i}``, and empty)."""
    d = arrays
    in_ptr, in_idx = d["op_in_ptr"], d["op_in_idx"]
    out_ptr, out_idx = d["op_out_ptr"], d["op_out_idx"]
    out = []
    for i in range(len(d["op_time"])):
        flags = int(d["op_flags"][i])
        out.append(Op(
            name=names[i] if names is not None else f"op{i}",
            phase=PHASES[int(d["op_phase"][i])],
            time=float(d["op_time"][i]),
            inputs=[int(x) for x in in_idx[in_ptr[i]:in_ptr[i + 1]]],
            outputs=[int(x) for x in out_idx[out_ptr[i]:out_ptr[i + 1]]],
            workspace=int(d["op_workspace"][i]),
            differentiates=_optional_id(d["op_differentiates"], i),
            random=bool(flags & 1),
            mutates_buffer=bool(flags & 2),
        ))
    return out


def _csr_ptr(lists: list[list[Any]]) -> np.ndarray:
    ptr = np.zeros(len(lists) + 1, dtype=np.int64)
    ptr[1:] = np.cumsum([len(x) for x in lists], dtype=np.int64)
    return ptr


def load_json_file(
    path: str | os.PathLike[str],
    what: str,
    parse: Callable[[str], T],
    error: type[ValueError],
) -> T:
    """Read a file and ``parse`` its text; errors (``error``) name the file."""
    p = Path(path)
    text = read_text_file(p, what, error)
    try:
        return parse(text)
    except error as exc:
        raise error(f"{p}: {exc}") from None


def read_text_file(path: Path, what: str, error: type[ValueError]) -> str:
    """The UTF-8 text of a file; ``error`` naming the file when it cannot be read or decoded."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise error(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(
            f"{what} file {path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}): it is corrupt or not a {what} file"
        ) from None


# Temporary files of write_atomic: ".<target name>.<8 random characters>.tmp" beside the target.
# Older versions used tempfile.mkstemp, whose random part has the same form.
_TEMP_RANDOM = re.compile(r"[a-z0-9_]{8}")
# Without file locks (Windows), a temporary file this old is taken as abandoned.
_ABANDONED_AFTER_S = 3600.0


def write_atomic(path: Path, text: str) -> None:
    """Write text to path via a temporary file in the same folder and an atomic rename.

    The temporary file is locked while it is written. Temporary files of the same target left
    behind by a writer that was killed (SIGKILL, power loss: nothing holds their lock any more)
    are removed first; a concurrent writer's file is left alone.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temps(path)
    fd, tmp = _new_locked_temp(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # while the lock is held, so no cleaner removes it first
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _is_temp_of(name: str, target: Path) -> bool:
    prefix = f".{target.name}."
    return (name.startswith(prefix) and name.endswith(".tmp")
            and _TEMP_RANDOM.fullmatch(name[len(prefix):-len(".tmp")]) is not None)


def _new_locked_temp(path: Path) -> tuple[int, Path]:
    """A new temporary file beside ``path`` (permissions as for a normal file), locked."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        if fcntl is None:
            return fd, tmp
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink > 0:
            return fd, tmp
        # a cleaner took it for abandoned between its creation and our lock: start again
        os.close(fd)


def _remove_abandoned_temps(path: Path) -> None:
    try:
        names = os.listdir(path.parent)
    except OSError:
        return
    for name in names:
        if _is_temp_of(name, path):
            _remove_if_abandoned(path.parent / name)


def _remove_if_abandoned(tmp: Path) -> None:
    if fcntl is None:
        try:
            if time.time() - tmp.stat().st_mtime > _ABANDONED_AFTER_S:
                tmp.unlink()
        except OSError:
            pass
        return
    try:
        fd = os.open(tmp, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its writer is alive and holds the lock
        os.close(fd)
        return
    try:
        tmp.unlink()
    except OSError:
        pass
    finally:
        os.close(fd)


def prioritized_topological_order(
    deps: Sequence[set[int]], priority: Sequence[Any]
) -> list[int] | None:
    """Kahn's algorithm over nodes ``0..n-1`` (``deps[k]``: the nodes ``k`` needs first); among
    the ready nodes the smallest ``(priority[k], k)`` goes next. None when there is a cycle."""
    n = len(deps)
    users: list[list[int]] = [[] for _ in range(n)]
    indeg = [len(d) for d in deps]
    for k, d in enumerate(deps):
        for p in d:
            users[p].append(k)
    heap = [(priority[k], k) for k in range(n) if indeg[k] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, k = heapq.heappop(heap)
        order.append(k)
        for v in users[k]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (priority[v], v))
    return order if len(order) == n else None


def topological_ops(graph: Graph) -> list[int]:
    """Op ids in a topological order, forward ops first, else keeping the graph's order: the
    order every level of the planner numbers its nodes in. Raises ValueError for a cycle or a
    forward op that depends on a backward one."""
    n = graph.num_ops
    prod = graph.producers()
    deps: list[set[int]] = [set() for _ in range(n)]
    for j, op in enumerate(graph.ops):
        for x in op.inputs:
            pj = prod[x]
            if pj is not None and pj != j:
                deps[j].add(pj)
    order = prioritized_topological_order(
        deps, [0 if op.phase == "forward" else 1 for op in graph.ops]
    )
    if order is None:
        raise ValueError(f"graph '{graph.name}' has a cycle among its ops")
    seen_backward = False
    for j in order:
        if graph.ops[j].phase == "backward":
            seen_backward = True
        elif seen_backward:
            raise ValueError(
                f"graph '{graph.name}': forward op '{graph.ops[j].name}' depends on a backward op"
            )
    return order


def gradient_seed_bytes(graph: Any) -> int:
    """Bytes of the outputs' gradients (tangents), which the caller's ``backward()`` makes
    inside the step (a loss's 4-byte seed), not before it as the graph's other preexisting
    tensors: the runtime holds them beside the plan's tensors through the backward, and plain
    autograd's measured peak has them."""
    return sum(t.bytes for t in graph.tensors if t.role == "tangent")
