"""Values the model reads while it is traced: constants, and guarded values of the inputs.

Fake tensors carry no values, so a read (``.item()``, ``if`` on a tensor) stops a trace. Two
kinds of reads can still be answered, by following real values beside the trace
(``ValueReads``, a dispatch mode on top of AOTAutograd's modes: each op on followed values
also runs on their real values, outside every mode, and a read of a followed value returns
the real result instead of reaching the fake tensor, which would raise):

- **Values made from constants alone**: tensors made by factory ops from shapes and Python
  numbers (``arange``, ``full``, a ``torch.tensor`` literal) and by ops on such tensors only.
  They are the same at every call (shapes and non-tensor arguments are checked at each call),
  so their reads need no guard. transformers' check for packed sequences reads position ids
  made by ``arange`` when a decoder runs without a cache; the eager path failed there and the
  compilers' path built an explicit mask where eager uses ``is_causal`` (HF Llama's gradients
  were 1e-7 off; bitwise along the eager path).
- **Values computed from the call's inputs alone** (``sources``; a second try on the eager
  path after its first failed at a read, kept when every read is a test (``tests_only``),
  else after the compilers' path failed too): a padding mask's "any padding?", a check of the
  labels' range, ``global_attention_mask.any()``; and from small buffers (EnCodec computes its
  padding from integer buffers). They may differ from call to call, so each read becomes a guard:
  ``ValueGuards.failing`` replays the ops from the sources to each read on a call's values
  before the call runs, and a different result means the graph is not this call's (the
  runtime traces and plans again).

A shape that depends on followed values (``nonzero`` of a mask, ``x[mask]``,
``masked_select``: Longformer's global attention positions, GLPN's valid pixels) is traced for
the count the real values give, as ``nonzero_static`` of that size feeding an indexing by
positions (how ATen computes a boolean index), ``repeat_interleave`` with ``output_size=``
(Qwen2-VL); with values from the inputs the count is a guard, so another count traces and
plans again. An op with no form of a fixed size (``unique_consecutive``) gives a constant of
the graph, its whole result a guard. Writes through such masks are made by positions above
autograd (``MaskWritesByPositions``). Concatenated CTC targets selected from the inputs keep
the labels' fixed shape instead, their count no guard (``hrockmate.capture.ctc``).

- **Finiteness tests of activations** (DETR-family and Mask2Former layers clamp their hidden
  states in training ``if not torch.isfinite(hidden_states).all()``): a test of values that
  are not followed (``isfinite``, ``isinf``, ``isnan``, then ``all``/``any``/``not``, or a
  count of them compared with a number: I-BERT's ``x.isnan().sum() == 0``) is read
  as the finite outcome, the only one a graph for every batch can hold, and the tested value
  becomes an assumption (``ValueReads.assumptions``): the traced step also returns whether every
  assumption held, and the runtime checks that at each call (``FiniteAssumptionError``: plain
  PyTorch would have taken the other branch there).

- **Comparisons of a uniform draw decided by their threshold** (``torch.rand([]) < 0.0``:
  LayerDrop switched off in transformers before 5.2x still drew and compared): read as the
  outcome every draw gives, with no guard and no assumption; the draw stays in the graph, so
  the generator advances as in eager.
- **Random decisions** (a threshold inside [0, 1): LayerDrop's ``torch.rand([]) <
  layerdrop``, read to skip a layer): answered by ``answers`` (the k-th read gets
  ``answers(k)``; False by default) and recorded in ``decisions`` (the traced 0-d test, the
  answer, where). The tracer traces each decision's other outcome too and the runtime takes
  at each call the outcome the draw gives (``hrockmate.capture.decisions``). Without
  ``answers`` such a read is not followed (tracing fails there, and the failure is named).

Not followed: random ops, tensors the model closes over (the user may change them in place),
parameters, buffers other than small ones followed as sources, anything written in place from
a value not followed, and tensors over ``MAX_BYTES`` (sized from the traced result before any
real memory is taken).
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DynamicOutputShapeException
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from hrockmate.capture import ctc
from hrockmate.capture.kernels import autocast_off, draws_random_numbers

__all__ = ["Decision", "FiniteAssumptionError", "FinitenessTests", "MaskWritesByPositions",
           "ValueGuards", "ValueReads"]

MAX_BYTES = 16 << 20
_HELD_BYTES = 4096  # (sources compared with their last values instead of replaying reads)

_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)

_aten = torch.ops.aten
# per element, what a test of finite values gives
_FINITE_TESTS = {_aten.isfinite: True, _aten.isinf: False, _aten.isnan: False,
                 _aten.isposinf: False, _aten.isneginf: False}
# ops whose result holds one value wherever their argument does: the same, or its negation
_KEEP_UNIFORM = (_aten.all, _aten.any, _aten.clone, _aten.alias, _aten.view, _aten.reshape,
                 _aten._to_copy, _aten.detach)
_NEGATE = (_aten.logical_not, _aten.bitwise_not)
# counts of a test's outcomes (``isnan(x).sum() == 0``), and comparisons of a known count
_COUNTS = (_aten.sum, _aten.count_nonzero)
_COMPARE = {_aten.eq: operator.eq, _aten.ne: operator.ne, _aten.lt: operator.lt,
            _aten.le: operator.le, _aten.gt: operator.gt, _aten.ge: operator.ge}
_SCALAR_READS = (_aten._local_scalar_dense, _aten.is_nonzero, _aten.item)
# draws uniform in [0, 1), and the comparisons whose outcome is monotonic in the draw: one
# with a threshold is the same for every draw when it is the same at both ends of the range
_UNIFORM_DRAWS = (_aten.rand, _aten.rand_like)
_MONOTONIC = (_aten.lt, _aten.le, _aten.gt, _aten.ge)
_LAST_DRAW = math.nextafter(1.0, 0.0)


class FiniteAssumptionError(RuntimeError):
    """Values the traced graph assumed finite (a finiteness test in the model's code, read as
    "finite") were not at this call: plain PyTorch takes the other branch there."""


@dataclass
class _Assumption:
    tensor: torch.Tensor  # the traced 0-d test the model read
    expected: bool  # what the graph assumed it reads
    where: str | None


@dataclass
class Decision:
    """A read of a test of a uniform draw alone (``torch.rand([]) < p``): ``tensor`` the
    traced 0-d test, ``answer`` what the trace read it as."""

    tensor: torch.Tensor
    answer: bool
    where: str | None


@dataclass(frozen=True)
class _Slot:
    """A followed tensor in an op's recorded arguments."""

    index: int


@dataclass
class _Op:
    """An op on followed values: ``outs[i]`` is the slot of the i-th leaf of its result."""

    func: Any
    args: Any  # (args, kwargs) with followed tensors as _Slot
    outs: list[int | None]
    in_place: bool


@dataclass
class _Read:
    """A read of values computed from the inputs: ``func`` on ``args`` gave ``expected``."""

    func: Any
    args: Any
    expected: Any
    where: str | None  # the model's code that read it
    what: str = "a value the model read from its inputs or buffers"


@dataclass
class _Selection:
    """Values of the inputs selected by a followed mask (``x.masked_select(mask)``, ``x[mask]``
    with a mask of x's shape): ``result``, traced for the count the sample gives (``reads``:
    the indices of that count's reads). A CTC op reads them as targets in a fixed shape
    instead (``padded``, made once); the count needs no guard when nothing else uses
    ``result``."""

    result: torch.Tensor
    x: torch.Tensor
    mask: torch.Tensor
    reads: range
    padded: torch.Tensor | None = None
    used: bool = False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (tuple, list)) or isinstance(a, torch.Tensor):
        la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
        return len(la) == len(lb) and all(
            x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else _same(x, y)
            for x, y in zip(la, lb))
    return bool(a == b)


class ValueGuards:
    """What a trace assumed about values of its inputs and small buffers (module docstring)."""

    def __init__(self, sources: dict[int, Hashable], ops: list[_Op], reads: list[_Read]
                 ) -> None:
        self._sources = sources  # slot -> what it is (ValueReads' ``sources`` keys)
        self._ops = ops
        self._reads = reads
        # copies of the sources' values when the reads last held, when all are small: the
        # same values need no replay (EnCodec's 72 reads of its padding buffers: 5.5 ms per
        # call replayed)
        self._held: dict[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._reads)

    @property
    def tests_only(self) -> bool:
        """Whether every read is a test (True or False): each has two outcomes at most, so
        the values of the inputs take few graphs; a count or a value read may take one per
        call."""
        return all(isinstance(r.expected, bool) for r in self._reads)

    @property
    def sources(self) -> list[Hashable]:
        """The sources the reads depend on."""
        return list(self._sources.values())

    def failing(self, value_of: Callable[[Hashable], torch.Tensor]) -> str | None:
        """None when every read gives what it gave while tracing, on the sources' values now
        (``value_of(key)``); else which read differs, in words."""
        now = {s: value_of(k).detach() for s, k in self._sources.items()}
        held = self._held
        if held is not None and all(torch.equal(now[s], v) for s, v in held.items()):
            return None
        # (the replay must not write the sources)
        env: dict[int, Any] = ({s: v.clone() for s, v in now.items()}
                               if any(op.in_place for op in self._ops) else dict(now))

        def filled(template: Any) -> Any:
            return pytree.tree_map(lambda x: env[x.index] if isinstance(x, _Slot) else x,
                                   template)

        with torch.no_grad(), autocast_off():
            for op in self._ops:
                a, kw = filled(op.args)
                try:
                    out = op.func(*a, **kw)
                except Exception as exc:  # (another count of rows: shapes no longer match)
                    return (f"the ops on the model's inputs or buffers that its reads depend "
                            f"on fail on this call's values ({type(exc).__name__}: {exc})")
                for slot, val in zip(op.outs, pytree.tree_leaves(out)):
                    if slot is not None:
                        env[slot] = val
            for read in self._reads:
                a, kw = filled(read.args)
                got = read.func(*a, **kw)
                if not _same(got, read.expected):
                    where = f" at {read.where}" if read.where else ""
                    return (f"{read.what}{where} was {read.expected!r} when traced and is "
                            f"{got!r} now")
        if all(v.untyped_storage().nbytes() <= _HELD_BYTES for v in now.values()):
            self._held = {s: v.clone() for s, v in now.items()}
        return None


class ValueReads(TorchDispatchMode):
    """Follows real values beside a trace and answers reads of them (module docstring).
    ``sources``: a key (what the runtime will ask ``ValueGuards.failing`` for) -> (the traced
    tensor, its real value), values to follow and guard; ``where`` names the model's code at
    a read."""

    def __init__(self, sources: dict[Hashable, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 where: Callable[[], str | None] = lambda: None,
                 answers: Callable[[int], bool] | None = None) -> None:
        super().__init__()
        self._answers = answers
        # id -> (the traced tensor, its real value, its slot, whether it depends on inputs)
        self._real: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, int, bool]] = {}
        self._spoiled: set[int] = set()  # storages of real values written from other values
        self._where = where
        self._ops: list[_Op] = []
        self._reads: list[_Read] = []
        self._source_slots: dict[int, Hashable] = {}
        self._record = sources is not None
        self._slots = 0
        self._selections: dict[int, _Selection] = {}  # id of the result -> its selection
        # id -> (the traced tensor, the value each of its elements has wherever the tested
        # values are finite, whether it has it for any values): results of finiteness tests of
        # values not followed, and of comparisons that every uniform draw passes or fails
        self._uniform: dict[int, tuple[weakref.ref[torch.Tensor], bool | int, bool]] = {}
        self._draws: dict[int, weakref.ref[torch.Tensor]] = {}  # uniform draws in [0, 1)
        self.assumptions: list[_Assumption] = []
        # id -> (the traced tensor, whether it negates the test, the test): a test of a
        # uniform draw inside [0, 1) and what keeps or negates it (random decisions)
        self._random_tests: dict[int, tuple[weakref.ref[torch.Tensor], bool, torch.Tensor]] = {}
        self.decisions: list[Decision] = []
        for key, (traced, real) in (sources or {}).items():
            slot = self._follow(traced, real, True)
            self._source_slots[slot] = key

    def guards(self) -> ValueGuards | None:
        """The reads of input values as guards (None when there were none): only the ops
        they need, with every in-place op that writes a storage they need (a write through a
        view changes its base too; BatchNorm's count of batches, a buffer written at every
        step, is no guard's source unless a read needs it)."""
        unneeded = {i for s in self._selections.values() if s.padded is not None and not s.used
                    for i in s.reads}  # (counts only CTC's fixed-shape targets depend on)
        reads = [r for i, r in enumerate(self._reads) if i not in unneeded]
        if not reads:
            return None
        storage = {slot: real.untyped_storage().data_ptr()
                   for _, real, slot, _ in self._real.values()}
        needed = {x.index for r in reads for x in pytree.tree_leaves(r.args)
                  if isinstance(x, _Slot)}
        needed_storages = {storage.get(s) for s in needed}
        kept: list[_Op] = []
        for op in reversed(self._ops):
            if any(s in needed for s in op.outs if s is not None) or (
                    op.in_place and any(storage.get(s) in needed_storages
                                        for s in _written_slots(op))):
                kept.append(op)
                inputs = {x.index for x in pytree.tree_leaves(op.args) if isinstance(x, _Slot)}
                needed.update(inputs)
                needed_storages.update(storage.get(s) for s in inputs)
        kept.reverse()
        sources = {s: k for s, k in self._source_slots.items() if s in needed}
        return ValueGuards(sources, kept, reads)

    def _follow(self, traced: torch.Tensor, real: torch.Tensor, from_inputs: bool) -> int:
        entry = self._real.get(id(traced))
        if entry is not None and entry[0]() is traced:  # (an in-place op's result: same slot)
            slot = entry[2]
            from_inputs = from_inputs or entry[3]
        else:
            self._slots += 1
            slot = self._slots
        self._real[id(traced)] = (weakref.ref(traced), real, slot, from_inputs)
        inner = getattr(traced, "elem", None)
        if isinstance(inner, torch.Tensor):
            # a functionalization wrapper's tensor: its ``tolist()`` reads that one, below the
            # wrapper (transformers' Qwen2-VL: ``grid_thw.tolist()``)
            self._real[id(inner)] = (weakref.ref(inner), real, slot, from_inputs)
        return slot

    def _lookup(self, t: Any) -> tuple[torch.Tensor, int, bool] | None:
        entry = self._real.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        ref, real, slot, from_inputs = entry
        if real.untyped_storage().data_ptr() in self._spoiled:
            return None
        return real, slot, from_inputs

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in ctc.FORWARDS:
            return self._ctc(func, args, kwargs)
        tested = self._finiteness(func, args, kwargs)
        if tested is not None:
            return tested[0]
        if self._selections:
            self._note_uses((args, kwargs))
        if func in _MASKED:
            rewritten = self._by_positions(func, args, kwargs)
            if rewritten is not None:
                return rewritten
        leaves, spec = pytree.tree_flatten((args, kwargs))
        lifted = func in _LIFTS
        found = [self._lookup(x) if isinstance(x, torch.Tensor) else None for x in leaves]
        tensors = [f for x, f in zip(leaves, found) if isinstance(x, torch.Tensor)]
        if draws_random_numbers(func) or not (
                lifted or all(f is not None for f in tensors)):
            if any(f is not None for f in tensors):
                self._spoil_written(func, args)
            out = func(*args, **kwargs)
            if func.overloadpacket in _UNIFORM_DRAWS and isinstance(out, torch.Tensor):
                self._draws[id(out)] = weakref.ref(out)
            return out
        from_inputs = any(f is not None and f[2] for f in tensors)
        if lifted:  # (a fresh literal: the real tensor is its value)
            real_leaves, template = leaves, leaves
        else:
            real_leaves = [f[0] if f is not None else x for x, f in zip(leaves, found)]
            template = [_Slot(f[1]) if f is not None else x for x, f in zip(leaves, found)]
        real_args, real_kwargs = pytree.tree_unflatten(real_leaves, spec)
        recorded = pytree.tree_unflatten(template, spec)
        if not any("Tensor" in str(r.type) for r in func._schema.returns):
            # a value read (``_local_scalar_dense``, ``equal``): answered from real values
            with _disable_current_modes():
                value = func(*real_args, **real_kwargs)
            if from_inputs:
                self._reads.append(_Read(func, recorded, value, self._where()))
            return value
        sized = _SIZED_BY_VALUES.get(func)
        if sized is not None and kwargs.get("output_size") is None:
            # a data-dependent shape, known from the real values: traced in a form of that
            # fixed size (``nonzero_static``, ``output_size=``), the size guarded when it comes
            # from the inputs (Longformer's global attention positions; Qwen2-VL's patches
            # per image, repeated by its images' grid sizes)
            length_of, fixed, what = sized
            with _disable_current_modes():
                real_out = func(*real_args, **real_kwargs)
            length = int(real_out.shape[0])
            if from_inputs:
                self._reads.append(_Read(length_of, recorded, length, self._where(), what))
            return self._followed_result(func, recorded, fixed(args, kwargs, length), real_out,
                                         from_inputs)
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            return self._constant(func, real_args, real_kwargs, recorded, from_inputs)
        outs = pytree.tree_leaves(out)
        if sum(x.untyped_storage().nbytes() for x in outs
               if isinstance(x, torch.Tensor)) > MAX_BYTES:
            self._spoil_written(func, args)  # (a write not followed leaves a stale value)
            return out
        with _disable_current_modes():
            real_out = func(*real_args, **real_kwargs)
        slots: list[int | None] = []
        for fake, real in zip(outs, pytree.tree_leaves(real_out)):
            if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor):
                slots.append(self._follow(fake, real, from_inputs))
            else:
                slots.append(None)
        if self._record:
            self._ops.append(_Op(func, recorded, slots, _writes(func)))
        return out

    def _finiteness(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[Any] | None:
        """A finiteness test of values not followed, a comparison that every uniform draw
        passes or fails, an op carrying such an outcome, or a read of it (module docstring):
        (the result,), else None."""
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        packet = func.overloadpacket
        certain = False
        if packet in _FINITE_TESTS:
            if self._lookup(args[0]) is not None:
                return None  # (followed values are read as they are)
            uniform = _FINITE_TESTS[packet]
        elif packet in _MONOTONIC and self._draws.get(id(args[0]), lambda: None)() is args[0]:
            # transformers before 5.2x drew LayerDrop's decision even at probability 0
            # (``torch.rand([]) < layerdrop``): no draw passes it, whatever it is
            if len(args) < 2 or not isinstance(args[1], (int, float)):
                return None
            test = _COMPARE[packet]
            uniform = test(0.0, args[1])
            if uniform != test(_LAST_DRAW, args[1]):
                if self._answers is None:
                    return None
                out = func(*args, **kwargs)  # (a random decision: read below)
                self._random_tests[id(out)] = (weakref.ref(out), False, out)
                return (out,)
            certain = True
        elif id(args[0]) in self._random_tests:
            return self._decision(func, args, kwargs)
        else:
            entry = self._uniform.get(id(args[0]))
            if entry is None or entry[0]() is not args[0]:
                return None
            _, uniform, certain = entry
            if type(uniform) is not bool:  # (a count: compared, else not followed)
                if packet not in _COMPARE or len(args) < 2 or isinstance(args[1], torch.Tensor):
                    return None
                uniform = bool(_COMPARE[packet](uniform, args[1]))
            elif packet in _SCALAR_READS:
                if args[0].numel() != 1:
                    return None
                if not certain:
                    self.assumptions.append(_Assumption(args[0], uniform, self._where()))
                return (uniform,)
            elif packet in _NEGATE:
                uniform = not uniform
            elif packet in _COUNTS:
                whole = len(args) == 1 and not kwargs.get("dim")
                if uniform and not whole:
                    return None
                uniform = args[0].numel() if uniform else 0  # (how many hold)
            elif packet not in _KEEP_UNIFORM:
                return None
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):  # (a tested value was found not followed above)
            self._uniform[id(out)] = (weakref.ref(out), uniform, certain)
        return (out,)

    def _decision(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[Any] | None:
        """A read of a random decision, answered and recorded, or an op keeping or negating
        one ((the result,)); None for any other use of it (an ordinary traced op)."""
        ref, negated, test = self._random_tests[id(args[0])]
        if ref() is not args[0]:
            return None
        packet = func.overloadpacket
        if packet in _SCALAR_READS:
            if args[0].numel() != 1 or self._answers is None:
                return None
            answer = bool(self._answers(len(self.decisions)))
            self.decisions.append(Decision(test, answer, self._where()))
            return (answer != negated,)
        if packet in _NEGATE:
            negated = not negated
        elif packet not in _KEEP_UNIFORM or packet in (_aten.all, _aten.any) and \
                args[0].numel() != 1:
            return None
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self._random_tests[id(out)] = (weakref.ref(out), negated, test)
        return (out,)

    def decided(self) -> torch.Tensor | None:
        """Traced at the end of the step: the random decisions' tests stacked (a 1-d bool),
        so that they stay in the graph for the runtime to read, or None when there were
        none."""
        if not self.decisions:
            return None
        return torch.stack([d.tensor.reshape(()) for d in self.decisions])

    def mark_test(self, tested: torch.Tensor | None, out: Any, uniform: bool | int) -> None:
        """``out`` holds ``uniform`` in each element wherever the values are finite: a test of
        ``tested``, marked only if that value is not followed (None: checked already, or
        ``out`` is an op's on a marked result)."""
        if isinstance(out, torch.Tensor) and (
                tested is None or isinstance(tested, torch.Tensor)
                and self._lookup(tested) is None):
            self._uniform[id(out)] = (weakref.ref(out), uniform, False)

    def assumptions_held(self) -> torch.Tensor | None:
        """Traced at the end of the step: whether every assumption held (a 0-d bool), or
        None when there was none."""
        if not self.assumptions:
            return None
        held = [a.tensor.reshape(()) if a.expected else torch.logical_not(a.tensor.reshape(()))
                for a in self.assumptions]
        return torch.stack(held).all() if len(held) > 1 else held[0].clone()

    def _constant(self, func: Any, real_args: Any, real_kwargs: Any, recorded: Any,
                  from_inputs: bool) -> Any:
        """An op on followed values whose result's shape fake tensors cannot know and that has
        no form of a fixed size (``unique_consecutive``: Qwen2.5-VL's attention windows from
        its images' grid sizes): its result is a constant of the graph, the whole of it a
        guard when it comes from the inputs."""
        with _disable_current_modes():
            real_out = func(*real_args, **real_kwargs)
            expected = pytree.tree_map_only(torch.Tensor, torch.clone, real_out)
        if from_inputs:
            self._reads.append(_Read(
                func, recorded, expected, self._where(), f"the result of {func} on values of "
                "the model's inputs (a shape traced for each result)"))
        return self._followed_result(func, recorded,
                                     pytree.tree_map_only(torch.Tensor, _LIFT_FRESH, real_out),
                                     real_out, from_inputs)

    def _followed_result(self, func: Any, recorded: Any, out: Any, real_out: Any,
                         from_inputs: bool) -> Any:
        """``out``, what the trace holds for ``func``'s result, followed with ``real_out``
        (its value) and the op recorded for the guards' replay."""
        slots = [self._follow(fake, real, from_inputs) if isinstance(fake, torch.Tensor) else None
                 for fake, real in zip(pytree.tree_leaves(out), pytree.tree_leaves(real_out))]
        if self._record:
            self._ops.append(_Op(func, recorded, slots, False))
        return out

    def _by_positions(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                      ) -> Any:
        """``x[mask]`` or ``x.masked_select(mask)`` with a followed mask, as ``x`` indexed
        by the mask's positions (``nonzero``, traced for the count it has: see above), which
        is how ATen computes them; None when the mask is not followed. A selection of
        followed values by one mask of their shape is kept (``_Selection``)."""
        if func is _MASKED_SELECT:
            x, mask = args
            if self._lookup(mask) is None or mask.dtype != torch.bool:
                return None
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            if tuple(x.shape) != tuple(shape):
                x = self.__torch_dispatch__(_EXPAND, (), (x, list(shape)))
            if tuple(mask.shape) != tuple(shape):
                mask = self.__torch_dispatch__(_EXPAND, (), (mask, list(shape)))
            return self.__torch_dispatch__(_INDEX, (), (x, [mask]))
        x, indices = args

        def followed_mask(i: Any) -> bool:
            return (i is not None and i.dtype in (torch.bool, torch.uint8)
                    and self._lookup(i) is not None)

        if not any(followed_mask(i) for i in indices):
            return None
        first = len(self._reads)
        expanded: list[Any] = []
        masks: list[torch.Tensor] = []
        for i in indices:
            if not followed_mask(i):
                expanded.append(i)
                continue
            if i.dtype == torch.uint8:
                i = self.__torch_dispatch__(torch.ops.aten.ne.Scalar, (), (i, 0))
            masks.append(i)
            positions = self.__torch_dispatch__(_NONZERO, (), (i,))
            expanded.extend(self.__torch_dispatch__(torch.ops.aten.select.int, (),
                                                    (positions, 1, d))
                            for d in range(i.dim()))
        result = self.__torch_dispatch__(func, (), (x, expanded), kwargs)
        if len(indices) == 1 and tuple(masks[0].shape) == tuple(x.shape) \
                and self._lookup(x) is not None and isinstance(result, torch.Tensor):
            self._selections[id(result)] = _Selection(result, x, masks[0],
                                                      range(first, len(self._reads)))
        return result

    def _note_uses(self, tree: Any) -> None:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                found = self._selections.get(id(leaf))
                if found is not None and found.result is leaf:
                    found.used = True

    def _ctc(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """ATen's CTC forward ``func`` as ``ctc``'s (a fake kernel sized for the longest
        target); targets selected from the inputs by a followed mask in a fixed shape, their
        count not guarded for it (module ``ctc``)."""
        args = ctc.by_position(func, args, kwargs)
        targets = args[1]
        self._note_uses((args[0], *args[2:]))
        found = self._selections.get(id(targets))
        if found is not None and found.result is targets:
            if found.padded is None:
                found.padded = self._padded(found)
            targets = found.padded
        return ctc.substitute(args, targets)

    def _padded(self, s: _Selection) -> torch.Tensor:
        """The values ``s`` selects first, in order, then ``x``'s first value up to x's size:
        a shape that does not depend on the mask."""
        run = self.__torch_dispatch__
        flat_x = run(_RESHAPE, (), (s.x, [-1]))
        flat_mask = run(_RESHAPE, (), (s.mask, [-1]))
        positions = run(_NONZERO_STATIC, (), (flat_mask,),
                        {"size": flat_mask.shape[0], "fill_value": 0})
        return run(_INDEX, (), (flat_x, [run(torch.ops.aten.select.int, (), (positions, 1, 0))]))

    def _spoil_written(self, func: Any, args: tuple[Any, ...]) -> None:
        """A followed tensor written in place by an op on other values (``x[i] = y`` with
        ``y`` computed from parameters) is followed no more, nor are its views."""
        for i in _written_positions(func):
            if i < len(args) and isinstance(args[i], torch.Tensor):
                found = self._lookup(args[i])
                if found is not None:
                    self._spoiled.add(found[0].untyped_storage().data_ptr())


class FinitenessTests(TorchFunctionMode):
    """Marks ``torch.isfinite``'s results for ``ValueReads`` (module docstring): ATen composes
    it from other ops (``isinf`` and ``isnan`` reach the dispatch mode as they are)."""

    def __init__(self, reads: ValueReads) -> None:
        super().__init__()
        self._reads = reads

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _ISFINITE and isinstance(out, torch.Tensor):
            self._reads.mark_test(args[0], out, True)
        return out


_ISFINITE = (torch.isfinite, torch.Tensor.isfinite)


class MaskWritesByPositions(TorchFunctionMode):
    """``x[mask] = y`` (``__setitem__``, ``index_put``) with a mask that ``reads`` follows and
    a ``y`` that needs a gradient, as ``x[mask.nonzero(as_tuple=True)] = y``, which is how
    PyTorch expands a boolean index: the count of positions is then traced and guarded as
    ``nonzero``'s is (``ValueReads``). Done above autograd, which would otherwise record the
    write's backward with the mask itself, and ``y``'s gradient ``grad[mask]`` has a shape
    fake tensors cannot know (Qwen3-VL adds its deepstack features at the image tokens'
    positions). Writes of values without a gradient stay as they are, unguarded: their
    backward writes through the mask, a fixed shape (Wav2Vec2 zeroes its padded frames with
    ``h[~mask] = 0``: a guard there would trace again for every count of padded frames); so
    does a read ``x[mask]``."""

    def __init__(self, reads: ValueReads) -> None:
        super().__init__()
        self._reads = reads

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and len(args) == 3 and _needs_grad(args[2]):
            x, key, value = args
            key = self._positions(key if isinstance(key, tuple) else (key,))
            if key is not None:
                args = (x, key, value)
        elif func in _INDEX_PUTS and len(args) >= 3 and isinstance(args[1], (tuple, list)) \
                and _needs_grad(args[2]):
            key = self._positions(tuple(args[1]))
            if key is not None:
                args = (args[0], key, *args[2:])
        return func(*args, **kwargs)

    def _positions(self, key: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """``key`` with each followed boolean mask replaced by its positions (one long index
        per dimension); None when it has none."""
        masks = [isinstance(k, torch.Tensor) and k.dtype == torch.bool
                 and self._reads._lookup(k) is not None for k in key]
        if not any(masks):
            return None
        return tuple(p for k, mask in zip(key, masks)
                     for p in (k.nonzero(as_tuple=True) if mask else (k,)))


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


_INDEX_PUTS = (torch.Tensor.index_put_, torch.Tensor.index_put, torch.index_put,
               torch.index_put_)
_NONZERO = torch.ops.aten.nonzero.default
_INDEX = torch.ops.aten.index.Tensor
_MASKED_SELECT = torch.ops.aten.masked_select.default
_EXPAND = torch.ops.aten.expand.default
_MASKED = (_INDEX, _MASKED_SELECT)
_RESHAPE = torch.ops.aten.reshape.default
_NONZERO_STATIC = torch.ops.aten.nonzero_static.default
_LIFT_FRESH = torch.ops.aten.lift_fresh_copy.default


def _count_nonzero(x: torch.Tensor) -> int:
    """How many rows ``nonzero(x)`` has (a guard's read)."""
    return int(torch.count_nonzero(x))


def _repeated_length(repeats: torch.Tensor, output_size: int | None = None) -> int:
    """How long ``repeat_interleave(repeats)`` is (a guard's read)."""
    return int(repeats.sum())


_REPEAT_INTERLEAVE = torch.ops.aten.repeat_interleave.Tensor
#: Ops whose result's length is a value of their arguments: (that length, as a guard reads
#: it; the op in a form of a given length; the length in words, for the guard's message).
_SIZED_BY_VALUES: dict[Any, tuple[Callable[..., int], Callable[..., Any], str]] = {
    _NONZERO: (_count_nonzero,
               lambda args, kwargs, n: _NONZERO_STATIC(args[0], size=n),
               "the number of positions a mask from the model's inputs selects (nonzero, "
               "boolean indexing: a shape traced for each count)"),
    _REPEAT_INTERLEAVE: (_repeated_length,
                         lambda args, kwargs, n: _REPEAT_INTERLEAVE(
                             *args, **{**kwargs, "output_size": n}),
                         "the length of repeat_interleave's result from the model's inputs (a "
                         "shape traced for each length)"),
}


def _written_positions(func: Any) -> list[int]:
    """The positions of the arguments ``func`` writes in place."""
    return [i for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write]


def _written_slots(op: _Op) -> list[int]:
    """The followed tensors an in-place op writes."""
    args = op.args[0]
    return [args[i].index for i in _written_positions(op.func)
            if i < len(args) and isinstance(args[i], _Slot)]


def _writes(func: Any) -> bool:
    return bool(_written_positions(func))
