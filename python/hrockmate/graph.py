"""The graph IR in Python: a mirror of ``rust/core/src/graph.rs`` (see docs/graph-ir.md).

Parsing and validation of JSON happen once, in the Rust core (``_native.parse_graph``); this
module holds the Python objects, writes the JSON, and turns a graph into the flat numpy arrays
that cross into Rust.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

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
            "bytes": int(self.bytes),
            "role": self.role,
            "alias_of": self.alias_of,
            "grad_of": self.grad_of,
            "updates": self.updates,
        }
        if self.shape is not None:
            d["shape"] = [int(s) for s in self.shape]
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
            "time": float(self.time),
            "workspace": int(self.workspace),
            "inputs": [int(i) for i in self.inputs],
            "outputs": [int(i) for i in self.outputs],
            "differentiates": self.differentiates,
            "random": bool(self.random),
            "mutates_buffer": bool(self.mutates_buffer),
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
            _native.parse_graph(self.to_json())
        except ValueError as exc:
            raise GraphError(str(exc)) from None

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
        """The flat array form of docs/graph-ir.md."""
        n_ops = len(self.ops)
        in_ptr = np.zeros(n_ops + 1, dtype=np.int64)
        out_ptr = np.zeros(n_ops + 1, dtype=np.int64)
        in_ptr[1:] = np.cumsum([len(o.inputs) for o in self.ops], dtype=np.int64)
        out_ptr[1:] = np.cumsum([len(o.outputs) for o in self.ops], dtype=np.int64)
        return {
            "tensor_bytes": np.array([t.bytes for t in self.tensors], dtype=np.int64),
            "tensor_alias": np.array(
                [-1 if t.alias_of is None else t.alias_of for t in self.tensors], dtype=np.int64
            ),
            "tensor_role": np.array([ROLE_CODE[t.role] for t in self.tensors], dtype=np.int8),
            "tensor_grad_of": np.array(
                [-1 if t.grad_of is None else t.grad_of for t in self.tensors], dtype=np.int64
            ),
            "tensor_updates": np.array(
                [-1 if t.updates is None else t.updates for t in self.tensors], dtype=np.int64
            ),
            "op_time": np.array([o.time for o in self.ops], dtype=np.float64),
            "op_workspace": np.array([o.workspace for o in self.ops], dtype=np.int64),
            "op_phase": np.array(
                [0 if o.phase == "forward" else 1 for o in self.ops], dtype=np.int8
            ),
            "op_differentiates": np.array(
                [-1 if o.differentiates is None else o.differentiates for o in self.ops],
                dtype=np.int64,
            ),
            "op_flags": np.array(
                [int(o.random) | (int(o.mutates_buffer) << 1) for o in self.ops], dtype=np.uint8
            ),
            "op_in_ptr": in_ptr,
            "op_in_idx": np.array([i for o in self.ops for i in o.inputs], dtype=np.int64),
            "op_out_ptr": out_ptr,
            "op_out_idx": np.array([i for o in self.ops for i in o.outputs], dtype=np.int64),
        }


def load_json_file(
    path: str | os.PathLike[str],
    what: str,
    parse: Callable[[str], T],
    error: type[ValueError],
) -> T:
    """Read a file and ``parse`` its text; errors (``error``) name the file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise error(f"cannot read {what} file {p}: {exc.strerror or exc}") from None
    try:
        return parse(text)
    except error as exc:
        raise error(f"{p}: {exc}") from None


def write_atomic(path: Path, text: str) -> None:
    """Write text to path via a temporary file in the same folder and an atomic rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file private (0600); give it the permissions of a normal file.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
