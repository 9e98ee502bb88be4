"""Random draws: torch's generators kept as they were around a trace, the host generators
(Python's ``random``, numpy's) recorded and replayed at each call, and the joint graph's random
ops rewritten to draw as eager does (in the input's memory order; a 0/1 float mask kept as one
byte beside it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx

from hrockmate.capture.kernels import draws_random_numbers, target_name

__all__ = [
    "PythonDraws", "compact_random_masks", "host_draws_recorded", "is_random",
    "match_random_layouts", "preserved_rng", "replay_python_draws",
]

# ---- generator states ---------------------------------------------------------------------------
@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore the CPU (and the device's CUDA) generator state on exit."""
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


@contextlib.contextmanager
def host_draws_recorded(drawn: set[str], record: PythonDraws | None = None,
                        forced: float | None = None) -> Iterator[None]:
    """Adds to ``drawn`` the host generators (Python's ``random``, numpy's global one) that the
    body drew from, and restores their states on exit. A traced call's host draws are fixed in
    the graph: the runtime replays torch's generators at every call, not these. ``record``
    gets the draws of Python's global generator (``PythonDraws``). ``forced``: what each
    ``random()`` returns instead of its draw."""
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    inst = random._inst  # type: ignore[attr-defined]  # (the global generator)
    real_random, real_bits = inst.random, inst.getrandbits
    module_random, module_bits = random.random, random.getrandbits

    def draw() -> float:
        if record is not None:
            record.calls.append(("random", 0))
        value = real_random()
        return value if forced is None else forced

    def bits(k: int) -> int:
        if record is not None:
            record.calls.append(("getrandbits", int(k)))
        return real_bits(k)

    # (an instance attribute shadows the method for the generator's own functions: uniform,
    # randint, choice, shuffle...; the module's random() and getrandbits() are bound apart)
    inst.random, inst.getrandbits = draw, bits
    random.random, random.getrandbits = draw, bits
    try:
        yield
    finally:
        del inst.random, inst.getrandbits
        random.random, random.getrandbits = module_random, module_bits
        if record is not None:
            record.end = random.getstate()
        if random.getstate() != py:
            drawn.add("Python's random")
        now = np.random.get_state()
        if now[2:] != npy[2:] or not np.array_equal(now[1], npy[1]):
            drawn.add("numpy.random")
        random.setstate(py)
        np.random.set_state(npy)


@dataclass
class PythonDraws:
    """The draws of Python's global generator in one traced step: each ("random", 0) or
    ("getrandbits", bits), the primitives all its functions draw through; ``start`` and
    ``end``, its states around them (``complete``: nothing drew past the two, as a reference
    to the generator's C method taken before tracing would)."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    start: Any = None
    end: Any = None

    def begin(self) -> None:
        import random

        self.calls.clear()
        self.start = random.getstate()

    def complete(self) -> bool:
        import random

        if self.start is None or self.end is None:
            return False
        saved = random.getstate()
        try:
            random.setstate(self.start)
            replay_python_draws(self.calls)
            return bool(random.getstate() == self.end)
        finally:
            random.setstate(saved)


def replay_python_draws(calls: Sequence[tuple[str, int]]) -> None:
    """Advances Python's global generator by the draws a traced call made
    (``host_draws_recorded``), as the model's own code would at that call."""
    import random

    for kind, k in calls:
        if kind == "random":
            random.random()
        else:
            random.getrandbits(k)


# ---- new nodes beside old ones ------------------------------------------------------------------
def call_beside(gm: fx.GraphModule, where: fx.Node, target: Any, args: tuple[Any, ...],
                 val: Any, *, before: bool = False, kwargs: dict[str, Any] | None = None
                 ) -> fx.Node:
    """A new call of ``target`` right after (or before) ``where``, in its module, sequence
    number and phase, with the fake value ``val``."""
    with gm.graph.inserting_before(where) if before else gm.graph.inserting_after(where):
        node = gm.graph.call_function(target, args, kwargs or {})
    node.meta = {k: v for k, v in where.meta.items()
                 if k in ("nn_module_stack", "seq_nr", "autograd_backward")}
    node.meta["val"] = val
    return node


def fake_mode_of(t: torch.Tensor) -> Any:
    """The fake mode ``t`` belongs to (to compute fake values of new nodes), or a no-op."""
    mode = getattr(t, "fake_mode", None)
    return mode if mode is not None else contextlib.nullcontext()


# ---- random ops on strided tensors --------------------------------------------------------------
def match_random_layouts(gm: fx.GraphModule) -> None:
    """Make functionalized random ops draw their numbers in the same positions as eager.

    Eager fills a tensor in place (``empty_like(x).bernoulli_(p)``) in the memory order of
    ``x``, which may be permuted (e.g. a transposed attention output); the functional variant
    in the joint graph returns a contiguous tensor and so assigns the same random stream to
    other elements. Such an op is rewritten as ``permute -> op -> inverse permute`` so that it
    generates in ``x``'s memory order and returns ``x``'s strides, as eager does.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not is_random(node) or not node.args:
            continue
        src_node = node.args[0]
        out = node.meta.get("val")
        src = src_node.meta.get("val") if isinstance(src_node, fx.Node) else None
        if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
            continue
        if src.shape != out.shape or src.stride() == out.stride() or src.dim() < 2:
            continue
        perm = sorted(range(src.dim()), key=lambda dim: -src.stride(dim))
        inverse = [perm.index(i) for i in range(src.dim())]
        with fake_mode_of(src):
            src_perm = src.permute(perm)
            if not src_perm.is_contiguous():
                continue  # not a permuted dense layout: nothing sensible to match
            out_perm = torch.empty(src_perm.shape, dtype=out.dtype, device=out.device)
            out_back = out_perm.permute(inverse)
        before = call_beside(gm, node, aten.permute.default, (src_node, perm), src_perm,
                              before=True)
        after = call_beside(gm, node, aten.permute.default, (node, inverse), out_back)
        node.replace_all_uses_with(after, delete_user_cb=lambda user: user is not after)
        node.args = (before, *node.args[1:])
        node.meta["val"] = out_perm


# ---- 0/1 random masks kept in one byte ----------------------------------------------------------
#: random ops whose output holds only 0s and 1s
_BINARY_RANDOM_OPS = ("aten.bernoulli.p", "aten.bernoulli.default", "aten.bernoulli.Tensor")


def compact_random_masks(gm: fx.GraphModule) -> None:
    """Give every floating 0/1 random mask a one-byte copy the planner can keep instead.

    Dropout on CPU draws its mask as floats (``empty_like(x).bernoulli_(p)``) and the backward
    reads it; on CPU ``bernoulli`` is among the slowest ops of a transformer (a third of the
    demo GPT-2's forward time), so the choice between keeping a 4-byte mask and drawing it
    again is a poor one. The op is rewritten as ``bernoulli -> ne(0) -> _to_copy(dtype)``: the
    bool in the middle is a quarter of the bytes and the float mask comes back from it with two
    cheap elementwise ops, bit for bit (0.0 and 1.0 convert exactly), so the random op itself
    runs once. CUDA's fused dropout already keeps a bool mask and does not use this path.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or target_name(node.target) not in _BINARY_RANDOM_OPS:
            continue
        out = node.meta.get("val")
        if (not isinstance(out, torch.Tensor) or not out.dtype.is_floating_point
                or out.element_size() < 2 or not node.users):
            continue
        with fake_mode_of(out):
            bits = torch.ne(out, 0)
            back = bits.to(out.dtype)
        ne = call_beside(gm, node, aten.ne.Scalar, (node, 0), bits)
        to = call_beside(gm, ne, aten._to_copy.default, (ne,), back,
                          kwargs={"dtype": out.dtype})
        node.replace_all_uses_with(to, delete_user_cb=lambda user: user is not ne)
        # The runtime copies nothing while the float mask is alive (runtime.compiler).
        ne.meta["packs_mask_of"] = node
        to.meta["unpacks_mask_of"] = node


def is_random(node: fx.Node) -> bool:
    return draws_random_numbers(node.target)
