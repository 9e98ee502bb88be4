"""Plain PyTorch's peak: the reference a fractional budget of ``HRockmate`` and ``solve`` is of.

A fraction (``budget=0.5``, ``"50%"``) promises a share of what plain PyTorch itself uses for
the iteration. The traced store-all schedule is not plain PyTorch: the traced backward keeps
only what it reads (plain autograd's ops may save more), and the model's outputs count until
the end of the traced iteration, where a training loop such as
``model(**batch).loss.backward()`` drops every output but the loss before its backward, so
plain PyTorch frees the logits of a language model there (``docs/budget.md``). Either can be
the larger. The reference is therefore the smaller of the two peaks (``budget_reference``):

- plain PyTorch's, measured once on the sample by ``measure_eager_baseline``: the way a
  training loop runs, the tensors backward starts from kept (the loss) and the other outputs
  dropped before the backward, their gradient seeds made inside the iteration, by the budget's
  own measure (``capture.memory.measure_peak_memory``: memory allocated beyond what was
  allocated before, parameters' ``.grad`` not counted);
- the traced store-all schedule's, predicted exactly, with the gradient seeds.

The measurement must leave no trace in training: the random generators' states, the model's
buffers (BatchNorm statistics) and every parameter's and input's ``.grad`` are as they were
after it, so the first real step matches plain PyTorch bit for bit. Python state that a
forward edits (a counter of calls) is not restored: the model runs twice more (a warm-up and
the measured iteration). Gradient hooks and distributed wrappers, which would act beyond the
iteration, make it skip the measurement (``skip_reason``), as does a device other than CPU
and CUDA or a plain iteration that runs out of memory; the traced store-all is then the
reference.
"""

from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from hrockmate.ir.budget import BudgetLike, is_fraction

__all__ = ["EagerBaseline", "budget_reference", "eager_baseline_for", "fraction_in_bytes",
           "measure_eager_baseline", "record_reference", "resolve_budget", "skip_reason",
           "traced_store_all_peak"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EagerBaseline:
    """Plain PyTorch's measured peak (bytes, by the budget's measure) on one device kind."""

    peak_bytes: int
    device: str
    #: "measured" in this process, or "cache" when the plan cache held it
    source: str = "measured"


def skip_reason(model: nn.Module) -> str | None:
    """Why plain PyTorch's iteration must not be run on ``model`` to measure it (None: it may
    be). A backward there would run code that acts beyond the iteration: gradient hooks on
    parameters (an optimizer stepping in backward, DDP's all-reduce) or a distributed wrapper's
    communication."""
    names = {"DistributedDataParallel", "FullyShardedDataParallel"}
    for mod in model.modules():
        kind = type(mod).__name__
        if kind in names or kind.startswith("FSDP"):
            return f"the model holds a {kind} module, whose backward communicates"
    for name, p in model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None) or getattr(p, "_backward_hooks", None):
            return f"parameter '{name}' has gradient hooks, which a measuring backward would run"
    return None


@contextlib.contextmanager
def _state_restored(model: nn.Module, inputs: list[torch.Tensor]) -> Iterator[None]:
    """Run the block, then put back the random generators, the buffers' values and the
    ``.grad`` of every parameter and input leaf as they were (the same objects: autograd
    accumulates into fresh zero tensors meanwhile, never into the caller's)."""
    params = list(dict.fromkeys(p for p in model.parameters()))
    leaves = [x for x in inputs if x.requires_grad and x.is_leaf]
    grads = [t.grad for t in params + leaves]
    buffers = list(dict.fromkeys(b for b in model.buffers()))
    with torch.no_grad():
        saved = [b.clone() for b in buffers]
    devices = sorted({t.device.index or 0 for t in params + buffers + inputs if t.is_cuda})
    py_state = random.getstate()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py_state)
        with torch.no_grad():
            for b, value in zip(buffers, saved):
                b.copy_(value)
        for t, g in zip(params + leaves, grads):
            t.grad = g


def measure_eager_baseline(model: nn.Module, sample: Any, *, loss_fn: Any = None,
                           warmup: bool = True) -> EagerBaseline:
    """Plain PyTorch's peak for one training iteration of ``model`` on ``sample``: forward,
    ``loss_fn`` as ``hrockmate.trace`` applies it, the model's other outputs dropped, then
    ``backward()`` from the loss (each tensor backward starts from gets a seed of ones made
    inside the iteration, as ``loss.backward()`` makes it). ``warmup``: run it once unmeasured
    first, so that lazy initialisations (kernels' caches, a library's first-call set-up) do not
    count. Every state the iteration changes is restored (module docstring)."""
    from hrockmate.capture.memory import _backward_roots, measure_peak_memory
    from hrockmate.capture.joint import split_sample

    # inputs that require grad become leaves of their own (sharing the storage): the backward
    # must neither reach the graph an input came from (it would free that graph's saved
    # tensors) nor accumulate into the caller's .grad
    args, kwargs = pytree.tree_map(
        lambda x: x.detach().requires_grad_() if isinstance(x, torch.Tensor) and x.requires_grad
        else x, split_sample(sample))
    inputs = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    params = [p for p in model.parameters() if p.requires_grad]
    fresh = params + [x for x in inputs if x.requires_grad]  # (cleared before each run)

    def step() -> list[torch.Tensor]:
        # (the model's output object is not bound to a name: only the roots stay)
        roots = _backward_roots(model(*args, **kwargs), loss_fn)[1]
        if roots:
            torch.autograd.backward(roots, [torch.ones_like(r) for r in roots])
        return roots  # the loss stays alive to the end, as the caller's does

    device = params[0].device if params else (inputs[0].device if inputs else None)
    with _state_restored(model, inputs), torch.enable_grad():
        if warmup:
            with _state_restored(model, inputs):
                for t in fresh:
                    t.grad = None
                step()
        for t in fresh:  # (measure_peak_memory gives the parameters zeros that are not counted)
            t.grad = None
        peak = measure_peak_memory(step, params=params, device=device).peak_bytes
    return EagerBaseline(int(peak), str(device) if device is not None else "cpu")


def budget_reference(traced_store_all: int, eager: EagerBaseline | None) -> int:
    """The bytes a fraction is of: the smaller of plain PyTorch's measured peak and the traced
    store-all's (with the gradient seeds), so that a fraction never gives more memory than
    that fraction of either; the traced store-all's alone when there is no measurement."""
    if eager is None or eager.peak_bytes <= 0:
        return int(traced_store_all)
    return min(int(traced_store_all), int(eager.peak_bytes))


def resolve_budget(budget: BudgetLike | None, traced_store_all: int,
                   eager: EagerBaseline | None) -> BudgetLike | None:
    """``budget`` with a fraction turned into bytes of ``budget_reference``; any other budget
    (bytes, a size, None) unchanged."""
    from hrockmate.ir.budget import parse_budget

    if budget is None or not is_fraction(budget):
        return budget
    # (at least 2: a bare 1 would be read as the fraction 1 again)
    return max(2, parse_budget(budget, budget_reference(traced_store_all, eager)))


def traced_store_all_peak(graph: Any) -> int:
    """The traced store-all schedule's predicted peak with the outputs' gradient seeds that
    ``backward()`` makes (what a module's fraction was of before plain PyTorch was measured)."""
    from hrockmate.ir.schedule import simulate, store_all_schedule
    from hrockmate.ir.graph import gradient_seed_bytes

    return int(simulate(graph, store_all_schedule(graph)).peak_bytes) + gradient_seed_bytes(graph)


def fraction_in_bytes(model: nn.Module, sample: Any, traced: Any, budget: BudgetLike | None,
                      loss_fn: Any, cache: Any, known: EagerBaseline | None = None,
                      seeds: bool = True) -> tuple[BudgetLike | None, EagerBaseline | None]:
    """(``budget`` in bytes when it is a fraction, the plain-PyTorch peak it was resolved
    with): ``known`` if given, else the cache's or a measurement when ``sample`` is given
    (``eager_baseline_for``); without either, the fraction is of the traced store-all
    (``budget_reference``), with the gradient seeds unless ``seeds`` is False (``solve``
    plans the graph alone, whose store-all peak has none). Other budgets come back
    unchanged, with ``known``."""
    if budget is None or not is_fraction(budget):
        return budget, known
    eager = known
    if eager is None and sample is not None:
        eager = eager_baseline_for(model, sample, traced, loss_fn, cache)
    traced_peak = traced_store_all_peak(traced.graph)
    if not seeds:
        from hrockmate.ir.graph import gradient_seed_bytes

        traced_peak -= gradient_seed_bytes(traced.graph)
    return resolve_budget(budget, traced_peak, eager), eager


def eager_baseline_for(model: nn.Module, sample: Any, traced: Any, loss_fn: Any,
                       cache: Any) -> EagerBaseline | None:
    """Plain PyTorch's peak for the traced iteration: the plan cache's (keyed by the graph
    and the device kind, as op times are), else measured and cached; None when it must not
    be measured (``skip_reason``, logged)."""
    from hrockmate.planning.cache import device_kind, open_cache

    why = skip_reason(model)
    if why is not None:
        logger.info("HRockmate: plain PyTorch's peak is not measured (%s); a fractional budget "
                    "is of the traced store-all peak", why)
        return None
    if getattr(traced, "skippable", None):
        # (plain PyTorch's peak is then that of whichever layers its own draws keep; the traced
        # store-all is of the iteration that keeps them all, the most any call can need)
        logger.info("HRockmate: plain PyTorch's peak is not measured (the model skips layers "
                    "at random, LayerDrop); a fractional budget is of the traced store-all peak")
        return None
    if torch.device(traced.device).type not in ("cpu", "cuda"):
        logger.info("HRockmate: plain PyTorch's peak is measured on cpu and cuda devices only, "
                    "not %s; a fractional budget is of the traced store-all peak", traced.device)
        return None
    store = open_cache(cache)
    device = device_kind(traced.device)
    if store is not None:
        cached = store.load_eager_peak(traced.graph, device)
        if cached is not None:
            return EagerBaseline(cached, str(traced.device), "cache")
    try:
        found = measure_eager_baseline(model, sample, loss_fn=loss_fn)
    except torch.OutOfMemoryError:
        # plain PyTorch not fitting is what a budget is for: its peak is then unknown (more
        # than the device had free), and the traced store-all is the reference
        import gc

        gc.collect()
        if torch.device(traced.device).type == "cuda":
            torch.cuda.empty_cache()
        logger.warning("HRockmate: plain PyTorch's iteration ran out of memory while its peak "
                       "was measured; a fractional budget is of the traced store-all peak")
        return None
    if store is not None:
        store.save_eager_peak(traced.graph, device, found.peak_bytes)
    return found


def record_reference(plan: Any, eager: EagerBaseline | None) -> None:
    """Note on ``plan`` what a fraction is of: ``stats["eager_peak_bytes"]`` (plain PyTorch's
    measured peak, when measured) beside ``baseline_peak_bytes`` (the traced store-all's)."""
    if eager is not None:
        plan.stats["eager_peak_bytes"] = int(eager.peak_bytes)
