"""Random decisions: parts of a traced step that run or not as a random draw decides.

LayerDrop (``if torch.rand([]) < layerdrop: skip the layer``, the default of transformers'
speech encoders, M2M100, Informer...) reads a draw to decide whether a whole layer runs.
One graph cannot hold both outcomes of every layer (2**layers graphs), so the tracer traces
the step once with every decision answered "run" (``capture.values.Decision``), and once more
per decision with that one answered otherwise, and this module finds, per decision, what the
other outcome leaves out of the first graph: a ``SkippableRegion``, the ops to skip and the
tensors that stand for their results (the layer's input for its output; in the backward, the
gradient of its output for that of its input). The runtime reads the draw's test at each call
and skips the regions whose decision went the other way (``runtime.compiler``); the plan is
made for the graph where every region runs, and a skipped region only leaves out work.

The matching is checked, not assumed: every op of the other trace is matched, in order, to
an op of the first with the same target, arguments and result shapes, reading the matched
tensors or those standing for skipped ones; outputs, gradients and buffer updates must match
likewise (a gradient or update the other trace lacks must come from a skipped op: the
runtime hands None, and writes nothing back). So the first graph with a region skipped is,
op by op, the graph traced for that outcome. Each other trace is taken in turn and checked
against the first; several regions skipped together are checked against one more trace with
every decision taken otherwise. Regions may share ops (the gradient of a layer's input, which
only the layer before needs, is left out when either layer is skipped): an op runs when no
region holding it is skipped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.fx as fx
import torch.utils._pytree as pytree

__all__ = ["MIN_DERIVED_RUN", "DecisionError", "SkipRules", "SkippableRegion", "cache_key",
           "check_together", "derive_between", "is_sum_of_two", "order_after_tests",
           "regions_from_json", "regions_to_json", "simulate", "skipped_part"]


class DecisionError(ValueError):
    """The trace for a decision's other outcome is not the first trace with ops left out."""


@dataclass
class SkippableRegion:
    """What the graph leaves out when decision ``index`` reads other than ``taken``."""

    index: int  # position among the step's decisions (the order the model read them in)
    test: int  # IR tensor id of the test the model read (a 0-d bool output of the graph)
    taken: bool  # the test's value with which the region runs (the traced answer)
    where: str  # the model's code that read the test
    ops: frozenset[int] = frozenset()
    #: skipped tensor -> the tensor standing for it (a result of an op that is not skipped
    #: in this region, or a tensor the step starts with)
    stands_for: dict[int, int] = field(default_factory=dict)
    #: parameter / tensor-input gradients and buffer / input updates the region makes alone
    #: (skipped: the runtime hands None and writes nothing back)
    lost_grads: frozenset[int] = frozenset()


def cache_key(first: Any, wheres: Sequence[str]) -> str | None:
    """What the regions found for ``first`` depend on: the graph as traced (ops with their
    modules and arguments, tensors with shapes, the step's sources and outputs), the model's
    files where it read its decisions (the other outcome's code is there, not in the graph),
    this module's rules and torch's version: the key of a cached finding
    (``hrockmate.planning.cache``), which saves the extra traces on a later start; None
    when one of those files cannot be read."""
    import os

    import torch

    h = hashlib.sha256()
    h.update(f"{torch.__version__};{sorted(first.sources.items())};{first.output_ids};".encode())
    for k in range(first.graph.num_ops):
        op = first.graph.ops[k]
        h.update(f"{_signature(first, k)}{op.module}{op.inputs}".encode())
        h.update(f"{op.outputs};".encode())
    for t in first.graph.tensors:
        h.update(f"{t.bytes},{t.role},{t.alias_of},{t.shape},{t.dtype};".encode())
    files = sorted({w.split(":")[0] for w in wheres} | {os.path.abspath(__file__)})
    for path in files:
        try:
            with open(path, "rb") as f:
                h.update(path.encode() + hashlib.sha256(f.read()).digest())
        except OSError:
            return None  # (the code cannot be told apart: nothing is cached)
    return h.hexdigest()[:24]


def regions_to_json(regions: Sequence[SkippableRegion]) -> list[dict[str, Any]]:
    return [{"index": r.index, "test": r.test, "taken": r.taken, "where": r.where,
             "ops": sorted(r.ops), "stands_for": sorted(r.stands_for.items()),
             "lost_grads": sorted(r.lost_grads)} for r in regions]


def regions_from_json(data: Any, first: Any, count: int) -> list[SkippableRegion]:
    """The regions a cache entry holds, checked against ``first`` (``count`` decisions);
    ValueError when they cannot be its."""
    if not isinstance(data, list) or len(data) != count:
        raise ValueError(f"expected {count} regions")
    n_ops, n_tensors = first.graph.num_ops, first.graph.num_tensors
    regions = []
    for i, d in enumerate(data):
        ops = frozenset(int(k) for k in d["ops"])
        stands = {int(a): int(b) for a, b in d["stands_for"]}
        lost = frozenset(int(t) for t in d["lost_grads"])
        test = int(d["test"])
        if (int(d["index"]) != i or test not in first.output_ids
                or not all(0 <= k < n_ops for k in ops)
                or not all(0 <= t < n_tensors for t in [*stands, *stands.values(), *lost])):
            raise ValueError(f"region {i} does not fit the graph")
        regions.append(SkippableRegion(index=i, test=test, taken=bool(d["taken"]),
                                       where=str(d["where"]), ops=ops, stands_for=stands,
                                       lost_grads=lost))
    return regions


def _signature(traced: Any, k: int) -> tuple[Any, ...]:
    """What must agree for two ops to be the same computation (tensor inputs aside)."""
    op = traced.graph.ops[k]
    node = traced.op_nodes[k]
    literals = pytree.tree_map(lambda a: "%" if isinstance(a, fx.Node) else a,
                               (node.args, node.kwargs))
    outs = tuple((tuple(traced.graph.tensors[t].shape or ()), traced.graph.tensors[t].dtype)
                 for t in op.outputs)
    return (op.phase, op.target, len(op.inputs), outs, repr(literals))


def _same_module(a: Any, b: Any) -> bool:
    """Ops are also matched by the module whose forward ran them: a dropout after the skipped
    layer is not the skipped layer's own. A backward op that one trace places in no module
    matches any: the sums autograd adds have none, and where an in-place op wrote into a view
    (Wav2Vec2's masked features on CUDA), which forward op a backward op belongs to can be
    found in one trace and not in the other. (A wrong match is refused by ``check_skipped``.)"""
    return a.module == b.module or _unplaced_backward(a, b)


def _unplaced_backward(a: Any, b: Any) -> bool:
    """Backward ops of which one is placed in no module (``_same_module``)."""
    return a.phase == "backward" and not (a.module and b.module)


def _match(first: Any, other: Any
           ) -> tuple[set[int], dict[int, int], dict[int, int], list[tuple[int, int]]]:
    """(ops of ``first`` left out, skipped tensor -> its stand-in, tensor of ``other`` ->
    tensor of ``first``, (op of ``first``, op of ``other``) matched): ``other`` as ``first``
    with ops left out (module docstring)."""
    by_source = {src: tid for tid, src in first.sources.items()}
    same: dict[int, int] = {}  # other's tensor -> first's
    canon = _constants(first)
    for tid, src in other.sources.items():
        if src[0] == "constant":
            # (numbered in the order traced: matched by value; equal ones are interchangeable)
            value = getattr(other.gm, src[1])
            found = next((t for t in set(canon.values())
                          if _equal_constants(getattr(first.gm, first.sources[t][1]), value)),
                         None)
            if found is None:
                raise DecisionError("a constant of the other trace is not in the first")
            same[tid] = found
            continue
        if src not in by_source:
            raise DecisionError(f"a tensor the step starts with ({src[0]} {src[1]!r}) is only "
                                "in the other trace")
        same[tid] = by_source[src]
    ops_a, ops_b = first.graph.ops, other.graph.ops
    producer, readers = first.graph.producers(), first.graph.consumers()
    skipped: set[int] = set()
    stand: dict[int, int] = {}
    matched: list[tuple[int, int]] = []
    p = 0
    for j, op_b in enumerate(ops_b):
        sig_b = _signature(other, j)
        q = p
        found: dict[int, int] | None = None
        while q < len(ops_a):
            if _signature(first, q) == sig_b and _same_module(ops_a[q], op_b):
                found = _inputs_agree([canon.get(t, t) for t in ops_a[q].inputs], op_b.inputs,
                                      same, stand, producer, readers, skipped, p, q)
                if found is not None:
                    break
            q += 1
        if found is None:
            alike = any(ops_a[k].target == op_b.target and ops_a[k].module == op_b.module
                        for k in range(p, len(ops_a)))
            raise DecisionError(
                f"op '{op_b.name}' ({op_b.target}) of the other trace has no counterpart in "
                "the first" + (" (one of its module runs with other shapes or arguments: the "
                               "other outcome changes what follows it, as Informer's "
                               "distilling convolutions halve the length after each layer "
                               "run)" if alike else ""))
        skipped.update(range(p, q))
        stand.update(found)
        matched.append((q, j))
        for t_a, t_b in zip(ops_a[q].outputs, op_b.outputs):
            same[t_b] = t_a
        p = q + 1
    skipped.update(range(p, len(ops_a)))
    return skipped, stand, same, matched


def _constants(traced: Any) -> dict[int, int]:
    """Each constant of the trace -> the first constant equal to it (its stand-in for
    matching: the trace numbers constants as it meets them)."""
    firsts: list[int] = []
    canon: dict[int, int] = {}
    for tid, (kind, key) in sorted(traced.sources.items()):
        if kind != "constant":
            continue
        value = getattr(traced.gm, key)
        canon[tid] = next((f for f in firsts if _equal_constants(
            getattr(traced.gm, traced.sources[f][1]), value)), tid)
        if canon[tid] == tid:
            firsts.append(tid)
    return canon


def _equal_constants(a: Any, b: Any) -> bool:
    import torch

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.device == b.device and a.stride() == b.stride()
            and bool(torch.equal(a, b)))


def _inputs_agree(ins_a: Sequence[int], ins_b: Sequence[int], same: dict[int, int],
                  stand: dict[int, int], producer: Sequence[int | None],
                  readers: Sequence[list[int]], skipped: set[int], p: int, q: int
                  ) -> dict[int, int] | None:
    """The stand-ins op ``q`` of the first trace needs to read what the other trace's op
    reads (ops ``p``..``q - 1`` skipped too), or None when it cannot. A stand-in is a tensor
    the skipped ops read (a layer's input for its output; the gradient of its output for that
    of its input), which keeps an op of the skipped part from passing for a later one."""
    new: dict[int, int] = {}
    for a, b in zip(ins_a, ins_b):
        mapped = same.get(b)
        if mapped is None:
            return None
        if mapped == a:
            continue
        k = producer[a]
        if k is None or not (k in skipped or p <= k < q):
            return None
        if stand.get(a, mapped) != mapped or new.get(a, mapped) != mapped:
            return None
        if not any(r in skipped or p <= r < q for r in readers[mapped]):
            return None
        new[a] = mapped
    return new


def _pairs(first: Any, other: Any) -> list[tuple[str, int | None, int | None]]:
    """(what, first's tensor, other's tensor) for every output, gradient and update."""
    if len(first.output_ids) != len(other.output_ids):
        raise DecisionError(
            "the step returns other tensors when a decision goes the other way (a cache of "
            "keys and values per layer: call the model with use_cache=False while training)")
    pairs: list[tuple[str, int | None, int | None]] = [
        ("output", a, b) for a, b in zip(first.output_ids, other.output_ids)]
    for what, da, db in (("gradient of parameter", first.param_grads, other.param_grads),
                         ("gradient of input", first.input_grads, other.input_grads),
                         ("update of buffer", first.buffer_updates, other.buffer_updates),
                         ("update of input", first.input_updates, other.input_updates)):
        for key in dict.fromkeys([*da, *db]):
            pairs.append((f"{what} {key!r}", da.get(key), db.get(key)))
    return pairs


def skipped_part(first: Any, other: Any, index: int, test: int, taken: bool, where: str
                 ) -> SkippableRegion:
    """The region decision ``index`` leaves out of ``first`` (the step traced with every
    decision taken) when ``other`` is the step traced with that decision not taken."""
    skipped, stand, _, _ = _match(first, other)
    lost = {t for what, t, b in _pairs(first, other) if b is None and t is not None}
    region = SkippableRegion(index=index, test=test, taken=taken, where=where,
                             ops=frozenset(skipped), stands_for=stand,
                             lost_grads=frozenset(lost))
    check_skipped(first, other, SkipRules.of(first, [region]), {index})
    return region


#: A run of at least this many decisions made at one line of code (a stack of layers) has its
#: inner regions derived from two traced ones instead of traced each (``derive_between``).
MIN_DERIVED_RUN = 6


def _index_step(a: str, b: str) -> int | None:
    """How many places further the one dotted component two names differ in counts, when
    it is an index (``layers.3.fc`` / ``layers.7.fc``: 4); 0 when they are equal; else None."""
    pa, pb = a.split("."), b.split(".")
    if len(pa) != len(pb):
        return None
    diff = [(x, y) for x, y in zip(pa, pb) if x != y]
    if not diff:
        return 0
    if len(diff) == 1 and diff[0][0].isdigit() and diff[0][1].isdigit():
        return int(diff[0][1]) - int(diff[0][0])
    return None


class _Shift:
    """The first graph's ops and tensors of one repeated layer mapped to those of another:
    forward ops ``forward`` later, backward ops ``backward`` earlier (the backward runs the
    layers in reverse), module and parameter names one index further by the same step.
    ``op`` gives None where the image is not the same computation; ``tensor`` gives None
    where a tensor is shared by the layers (made before them, or a parameter of none)."""

    def __init__(self, first: Any, forward: int, backward: int,
                 producer: Sequence[int | None], source_of: dict[Any, int]) -> None:
        self.first = first
        self.ops = first.graph.ops
        self.producer, self.source_of = producer, source_of  # (the graph's, made once)
        self.forward, self.backward = forward, backward
        self.step: int | None = None  # how many layers further names count, once seen

    def _same_step(self, step: int | None) -> bool:
        if step is None:
            return False
        if step and self.step is None:
            self.step = step
        return step == 0 or step == self.step

    def op(self, k: int) -> int | None:
        op = self.ops[k]
        j = k + self.forward if op.phase == "forward" else k - self.backward
        if not 0 <= j < len(self.ops) or self.ops[j].phase != op.phase:
            return None
        if _signature(self.first, k) != _signature(self.first, j):
            return None
        if not (op.module or self.ops[j].module) or _unplaced_backward(op, self.ops[j]):
            return j  # (no module, so no layer index to move)
        return j if self._same_step(_index_step(op.module, self.ops[j].module)) else None

    def tensor(self, t: int) -> int | None:
        k = self.producer[t]
        if k is None:  # a parameter or buffer of the layer: the one of the same name there
            kind, key = self.first.sources.get(t, ("", None))
            if kind not in ("param", "buffer") or not isinstance(key, str) or not self.step:
                return None
            parts = key.split(".")
            for i, part in enumerate(parts):
                if part.isdigit():
                    moved = ".".join([*parts[:i], str(int(part) + self.step), *parts[i + 1:]])
                    if (kind, moved) in self.source_of:
                        return self.source_of[(kind, moved)]
            return None
        j = self.op(k)
        if j is None or j == k:
            return None
        return self.ops[j].outputs[self.ops[k].outputs.index(t)]


def derive_between(first: Any, a: SkippableRegion, c: SkippableRegion, steps: int,
                   made: Sequence[tuple[int, int, bool, str]]) -> list[SkippableRegion] | None:
    """The regions of the decisions between ``a`` and ``c``, two traced regions of a stack of
    identical layers ``steps`` layers apart: ``made`` holds (index, test, taken, where) of the
    decisions 1 .. ``steps - 1`` layers after ``a``'s. Each is ``a``'s region moved by whole
    layers, every op of it checked to be the same computation reading the moved (or the same,
    shared) tensors; None where the stack is not that regular (then each is traced). The
    caller checks the derived regions against traces of several skipped together."""
    ops = first.graph.ops
    producer = first.graph.producers()

    def split(r: SkippableRegion) -> tuple[list[int], list[int]]:
        return (sorted(k for k in r.ops if ops[k].phase == "forward"),
                sorted(k for k in r.ops if ops[k].phase == "backward"))

    (fa, ba), (fc, bc) = split(a), split(c)
    if len(fa) != len(fc) or len(ba) != len(bc) or not fa or steps < 2:
        return None
    forward = {y - x for x, y in zip(fa, fc)} | {producer[c.test] - producer[a.test]}
    backward = {x - y for x, y in zip(ba, bc)} or {0}
    if len(forward) != 1 or len(backward) != 1:
        return None
    df, db = forward.pop(), backward.pop()
    if df <= 0 or df % steps or db < 0 or db % steps:
        return None
    outputs = {t for _, t, _ in _pairs(first, first)}
    source_of = {src: t for t, src in first.sources.items()}
    derived = []
    for j, (index, test, taken, where) in enumerate(made, start=1):
        shift = _Shift(first, j * df // steps, j * db // steps, producer, source_of)
        if producer[test] != producer[a.test] + shift.forward:
            return None
        image = {k: shift.op(k) for k in sorted(a.ops)}
        if None in image.values():
            return None
        for k, m in image.items():
            for t, u in zip(ops[k].inputs, ops[m].inputs):  # type: ignore[index]
                if u != t and u != shift.tensor(t):
                    return None
        moved = {m for m in image.values() if m is not None}
        stands: dict[int, int] = {}
        for o, w in a.stands_for.items():
            o2 = shift.tensor(o)
            if o2 is None:
                return None
            w2 = shift.tensor(w)
            stands[o2] = w if w2 is None else w2
        lost = {shift.tensor(t) for t in a.lost_grads}
        if None in lost or not lost <= outputs:
            return None
        derived.append(SkippableRegion(index=index, test=test, taken=taken, where=where,
                                       ops=frozenset(moved), stands_for=stands,
                                       lost_grads=frozenset(t for t in lost if t is not None)))
    return derived


def order_after_tests(graph: Any, regions: Sequence[SkippableRegion]) -> None:
    """Makes the forward ops that enter each region read the decision's test in the graph IR
    (not in the traced code), so that every plan makes the test first: the runtime reads the
    decision there, before anything it may skip. Called once op costs are measured (they run
    each op on its traced arguments)."""
    for r in regions:
        inside = {t for k in r.ops for t in graph.ops[k].outputs}
        for k in sorted(r.ops):
            op = graph.ops[k]
            if op.phase == "forward" and r.test not in op.inputs and not any(
                    t in inside for t in op.inputs):
                op.inputs.append(r.test)


def is_sum_of_two(traced: Any, k: int) -> bool:
    """Whether op ``k`` adds two tensors of its result's shape and dtype (``a + b``), as
    autograd sums the gradients of a tensor used twice: with one of them missing (its
    maker skipped), the result is the other; with both, none (``sum_present``)."""
    op = traced.graph.ops[k]
    if op.target != "aten.add.Tensor" or len(op.inputs) < 2 or len(op.outputs) != 1:
        return False
    node = traced.op_nodes[k]
    if node.kwargs or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
        return False
    tensors = traced.graph.tensors
    out = tensors[op.outputs[0]]
    # (the two terms come first: ``order_after_tests`` may add a decision's test after them)
    return all(tensors[t].shape == out.shape and tensors[t].dtype == out.dtype
               for t in op.inputs[:2])


@dataclass
class SkipRules:
    """The runtime's rules for a trace's random decisions, per op: ``runtime.compiler`` emits
    them as code for every outcome, ``simulate`` evaluates them for one, and the checks compare
    that with the traces of the other outcomes (so what runs is what was checked).

    - An op of a region its decision skips does not run. Each of its results takes the first
      stand-in (``SkippableRegion.stands_for``) of a skipped region holding it that is not
      missing; without one, a sum of two gives what its terms give (below), other results are
      missing (None).
    - A sum of two (``is_sum_of_two``) that may find a term missing gives the other term, or
      nothing when both are (autograd's sum of the gradients of a tensor used twice, one use
      skipped: eager's order of sums is kept).
    - An op of the backward that may find an input missing does not run when one is, and its
      results are missing (autograd runs no node that no gradient reaches: the encoder's when
      every decoder layer is skipped).
    - An op of the forward must find what it reads."""

    regions: list[SkippableRegion]  # by decision, in the order the model reads them
    regions_of: dict[int, list[SkippableRegion]]  # op -> the regions holding it, in order
    sums: set[int]  # sums of two in a region or reading what may be missing
    unfed: dict[int, list[int]]  # backward op -> the inputs it may find missing
    missing: set[int]  # tensors a call may leave missing

    @classmethod
    def of(cls, traced: Any, regions: Sequence[SkippableRegion]) -> "SkipRules":
        regions_of: dict[int, list[SkippableRegion]] = {}
        for r in regions:
            for k in r.ops:
                regions_of.setdefault(k, []).append(r)
        rules = cls(list(regions), regions_of, set(), {}, set())
        for k, op in enumerate(traced.graph.ops):
            reads = [t for t in op.inputs if t in rules.missing]
            if (reads or k in regions_of) and is_sum_of_two(traced, k):
                rules.sums.add(k)
            elif reads and op.phase == "backward":
                rules.unfed[k] = list(dict.fromkeys(reads))
            if k in regions_of or reads:
                rules.missing.update(op.outputs)
        return rules

    def stand_ins(self, k: int, t: int) -> list[SkippableRegion]:
        """The regions holding op ``k`` with a stand-in for its result ``t``, in order."""
        return [r for r in self.regions_of.get(k, ()) if t in r.stands_for]


def simulate(first: Any, rules: SkipRules, skipped: set[int]
             ) -> tuple[dict[int, int | None], set[int]]:
    """What the runtime computes with the regions of decisions ``skipped`` skipped
    (``SkipRules``): per tensor, the tensor whose value it holds (itself where absent from
    the map) or None (missing), and the ops that run."""
    value: dict[int, int | None] = {}
    runs: set[int] = set()

    def sum_of(k: int, ins: list[int | None]) -> None:
        if None in ins[:2]:
            value[first.graph.ops[k].outputs[0]] = ins[0] if ins[1] is None else ins[1]
        else:
            runs.add(k)  # (both terms there: the sum is made)

    for k, op in enumerate(first.graph.ops):
        ins = [value.get(t, t) for t in op.inputs]
        if any(r.index in skipped for r in rules.regions_of.get(k, ())):
            for o in op.outputs:
                given = [value.get(r.stands_for[o], r.stands_for[o])
                         for r in rules.stand_ins(k, o) if r.index in skipped]
                present = [v for v in given if v is not None]
                if present:
                    value[o] = present[0]
                elif k in rules.sums:
                    sum_of(k, ins)
                else:
                    value[o] = None
        elif k in rules.sums:
            sum_of(k, ins)
        elif k in rules.unfed and any(value.get(t, t) is None for t in rules.unfed[k]):
            for o in op.outputs:
                value[o] = None
        else:
            if None in ins:
                missing = first.graph.tensors[op.inputs[ins.index(None)]].name
                raise DecisionError(f"op '{op.name}' runs and reads {missing!r}, which a "
                                    "skipped op makes")
            runs.add(k)
    return value, runs


def check_skipped(first: Any, other: Any, rules: SkipRules, skipped: set[int]) -> None:
    """Checks that the runtime's rules (``SkipRules``, ``simulate``) with the regions of decisions
    ``skipped`` skipped compute ``other``, the step traced with those decisions not taken:
    each op of ``other`` is an op that runs, reading the same values; the other ops that run
    compute what nobody reads then (the gradient of the first kept layer's input when every
    layer before is skipped) and so must draw nothing and write nothing back; outputs,
    gradients and updates are the same values, or missing where ``other`` has none."""
    _, _, same, matched = _match(first, other)
    value, runs = simulate(first, rules, skipped)
    canon = _constants(first)
    ops_a, ops_b = first.graph.ops, other.graph.ops
    for q, j in matched:
        if q not in runs or any(canon.get(value.get(a, a), value.get(a, a)) != same[b]
                                for a, b in zip(ops_a[q].inputs, ops_b[j].inputs)):
            parts = "part" if len(skipped) == 1 else "parts"
            raise DecisionError(f"op '{ops_b[j].name}' of the other trace is not what the "
                                f"first computes with the {parts} skipped")
    for k in sorted(runs - {q for q, _ in matched}):
        if ops_a[k].random or ops_a[k].mutates_buffer:
            raise DecisionError(f"op '{ops_a[k].name}' runs where the other trace has no "
                                "counterpart, and draws random numbers or writes a buffer")
    for what, a, b in _pairs(first, other):
        got = None if a is None else value.get(a, a)
        if got != (None if b is None else same.get(b)):
            raise DecisionError(f"the {what} differs from the other trace's")


def check_together(first: Any, every_other: Any, rules: SkipRules) -> None:
    """Checks that skipping all regions of ``rules`` at once computes ``every_other`` (the step
    traced with every decision not taken): ``check_skipped`` with all skipped."""
    check_skipped(first, every_other, rules, {r.index for r in rules.regions})
