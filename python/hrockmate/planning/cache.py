"""On-disk cache of plans and measured op times.

Building ``HRockmate`` (or calling ``hrockmate.solve``) again for the same model, sample shapes
and budget then neither measures op times nor solves again, and the same model gets the same
plan in every run: op times are measured once per graph and device, and every later plan of
that graph is made from the same times.

Where: the ``cache=`` argument (a directory), else ``$HROCKMATE_CACHE_DIR``, else
``$XDG_CACHE_HOME/hrockmate``, else ``~/.cache/hrockmate``. ``cache=False``, or
``HROCKMATE_CACHE_DIR=off``, turns the cache off.

What:

- ``times/<key>.json``: the measured time of every op of one graph, keyed by the graph's
  structure hash (``Graph.structure_hash``: ops, tensors, sizes, workspaces; not times), the
  device kind, the torch version and the number of CPU threads.
- ``plans/<key>.plan.json``: a plan in ``Plan.save``'s format, keyed by the graph's structure
  hash, the budget in bytes, the solve options, who asked (``HRockmate`` reserves room for its
  saved random-generator states, so its plans differ from ``solve``'s), the versions of
  hrockmate and torch, the device kind, and a digest of the planner's code (the native core
  and the Python planning and IR modules, ``planner_fingerprint``): a plan made by another
  build of the same version is not reused.
- ``eager/<key>.json``: plain PyTorch's measured peak for one iteration (the reference of a
  fractional budget, ``capture.baseline``), keyed as op times are.
- ``compiled/<key>.json``: the budget compiled mode (``HRockmate(..., compile=True)``) planned
  for in the end, where the compiled program of the asked budget's plan measured over it
  and was planned again for less (``runtime.inductor.check_compiled_peak``), keyed by the
  graph's structure hash, the asked budget, the solve options, the device kind and the
  versions of hrockmate, torch and the planner: a rebuild plans for that budget at once. The
  compiled code itself is inductor's to cache (its FX graph cache, under
  ``$TORCHINDUCTOR_CACHE_DIR``).
- ``decisions/<key>.json``: what each random decision of a model (LayerDrop) leaves out of
  its graph, keyed by the graph as traced, the model's files where it reads the decisions and
  the version of the rules (``capture.decisions.cache_key``): a later start needs none of the
  extra traces that found it.

Every file is written atomically. An entry that cannot be read, is corrupt or belongs to
another graph is ignored with a ``PlanCacheWarning`` (and replaced by the next write); a cache
directory that cannot be written is reported the same way. Neither ever stops planning.

The graph's structure hash covers everything traced, but not the Python code of the model: two
models whose traced iterations are identical share entries, which is what makes the entries
valid for both. Delete the directory to start afresh.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from hrockmate.ir.graph import write_atomic

if TYPE_CHECKING:
    import torch
    import torch.nn as nn

    from hrockmate.capture.joint import Traced
    from hrockmate.ir.graph import Graph
    from hrockmate.ir.plan import Plan

__all__ = [
    "CACHE_ENV", "PlanCache", "PlanCacheWarning", "default_cache_dir", "device_kind",
    "measured_times", "open_cache", "planner_fingerprint",
]

CACHE_ENV = "HROCKMATE_CACHE_DIR"
#: Raise when what a cached entry means changes (planner or cost model behaviour).
CACHE_VERSION = 2
TIMES_FORMAT = "hrockmate-op-times"
DECISIONS_FORMAT = "hrockmate-decisions"
EAGER_FORMAT = "hrockmate-eager-peak"
COMPILED_FORMAT = "hrockmate-compiled-budget"
_OFF = frozenset({"off", "0", "false", "no", "none"})
#: Solve options that do not change the plan.
_NOT_IN_KEY = frozenset({"progress"})


class PlanCacheWarning(UserWarning):
    """A cache entry was ignored or could not be written; planning went on without it."""


def default_cache_dir() -> Path | None:
    """The cache directory used when ``cache=None``: ``$HROCKMATE_CACHE_DIR`` (``off`` turns
    caching off), else ``$XDG_CACHE_HOME/hrockmate``, else ``~/.cache/hrockmate``."""
    env = os.environ.get(CACHE_ENV)
    if env is not None and env.strip():
        return None if env.strip().lower() in _OFF else Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "hrockmate"


def open_cache(cache: Any = None) -> PlanCache | None:
    """The cache a ``cache=`` argument asks for: ``None`` or ``True`` the default location,
    ``False`` none, a path that directory, a ``PlanCache`` itself."""
    if isinstance(cache, PlanCache):
        return cache
    if cache is None or cache is True:
        directory = default_cache_dir()
        return None if directory is None else PlanCache(directory)
    if cache is False:
        return None
    if isinstance(cache, (str, os.PathLike)):
        return PlanCache(Path(cache).expanduser())
    raise TypeError(
        f"cache= must be a directory (str or path), True/None for the default location or "
        f"False to turn the cache off, got {type(cache).__name__}"
    )


def device_kind(device: "torch.device") -> str:
    """What op times depend on besides the graph: the device model, torch's version and, on
    CPU, the number of threads."""
    import torch

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        what = f"cuda:{torch.cuda.get_device_name(index)}"
    else:
        what = f"{device.type}:{platform.machine()}:{os.cpu_count()}cpus:" \
               f"{torch.get_num_threads()}threads"
    return f"{what};torch {torch.__version__}"


@functools.lru_cache(maxsize=1)
def planner_fingerprint() -> str:
    """A digest of the code that makes plans: the native core's library and the Python modules
    of ``hrockmate.planning`` and ``hrockmate.ir`` (about 10 ms, once per process)."""
    import hrockmate
    from hrockmate import _native

    root = Path(hrockmate.__file__).parent
    h = hashlib.sha256()
    for f in [Path(_native.__file__), *sorted((root / "planning").glob("*.py")),
              *sorted((root / "ir").glob("*.py"))]:
        h.update(f.name.encode())
        try:
            h.update(f.read_bytes())
        except OSError:  # unreadable: the key still differs from a readable file's
            h.update(b"?")
    return h.hexdigest()[:16]


def _digest(fields: Mapping[str, Any]) -> str:
    text = json.dumps(fields, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class PlanCache:
    """Plans and op times under one directory (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"PlanCache({str(self.directory)!r})"

    # ---- plans ----------------------------------------------------------------------------
    def plan_key(self, graph: "Graph", budget_bytes: int, options: Mapping[str, Any],
                 device: str, purpose: str) -> str | None:
        """The key of the plan for ``graph`` at ``budget_bytes`` made with ``options``;
        ``None`` when an option cannot be part of a key (a prepared ``hierarchy``)."""
        from hrockmate import __version__

        if options.get("hierarchy") is not None:
            return None
        return _digest({
            "cache": CACHE_VERSION,
            "hrockmate": __version__,
            "planner": planner_fingerprint(),
            "graph": graph.structure_hash(),
            "budget_bytes": int(budget_bytes),
            "options": {k: v for k, v in options.items() if k not in _NOT_IN_KEY},
            "device": device,
            "purpose": purpose,
        })

    def _plan_path(self, key: str) -> Path:
        return self.directory / "plans" / f"{key}.plan.json"

    def load_plan(self, key: str | None, graph: "Graph") -> "Plan | None":
        """The cached plan under ``key``, if there is a readable one for ``graph``."""
        from hrockmate.ir.plan import PlanError, load_plan

        if key is None:
            return None
        path = self._plan_path(key)
        if not path.is_file():
            return None
        try:
            plan = load_plan(path, graph)
        except (PlanError, OSError, ValueError, TypeError, ArithmeticError, RecursionError) as exc:
            _warn(f"ignoring plan cache entry {path}: {exc}")
            return None
        plan.stats["cache"] = "hit"
        return plan

    def save_plan(self, key: str | None, plan: "Plan") -> None:
        if key is None:
            return
        path = self._plan_path(key)
        try:
            plan.save(path)
        except OSError as exc:
            _warn(f"cannot write plan cache entry {path}: {exc.strerror or exc}")

    # ---- op times -------------------------------------------------------------------------
    def _times_path(self, graph: "Graph", device: str) -> Path:
        key = _digest({"cache": CACHE_VERSION, "graph": graph.structure_hash(), "device": device})
        return self.directory / "times" / f"{key}.json"

    def load_times(self, graph: "Graph", device: str) -> bool:
        """Set the op times of ``graph`` from the cache; False when none are cached."""
        path = self._times_path(graph, device)
        if not path.is_file():
            return False
        try:
            data = json.loads(path.read_text())
            times = data["times"] if isinstance(data, dict) else None
            if data.get("format") != TIMES_FORMAT or data.get("graph") != graph.structure_hash():
                raise ValueError("not the op times of this graph")
            if not isinstance(times, list) or len(times) != graph.num_ops:
                raise ValueError(f"expected {graph.num_ops} op times")
            if not all(isinstance(t, (int, float)) and math.isfinite(t) and t >= 0
                       for t in times):
                raise ValueError("op times must be finite numbers >= 0")
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            _warn(f"ignoring op-time cache entry {path}: {exc}")
            return False
        for op, t in zip(graph.ops, times):
            op.time = float(t)
        graph.meta["cost_report"] = {"mode": "measure", "cache": "hit"}
        return True

    # ---- plain PyTorch's peak -----------------------------------------------------------
    def _eager_path(self, graph: "Graph", device: str) -> Path:
        key = _digest({"cache": CACHE_VERSION, "graph": graph.structure_hash(), "device": device,
                       "what": "eager-peak"})
        return self.directory / "eager" / f"{key}.json"

    def load_eager_peak(self, graph: "Graph", device: str) -> int | None:
        """Plain PyTorch's measured peak for the iteration ``graph`` traces, on this kind of
        device (``capture.baseline``), keyed as op times are; None when none is cached."""
        path = self._eager_path(graph, device)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("format") != EAGER_FORMAT or data.get("graph") != graph.structure_hash():
                raise ValueError("not plain PyTorch's peak for this graph")
            peak = data["peak_bytes"]
            if isinstance(peak, bool) or not isinstance(peak, int) or peak <= 0:
                raise ValueError("peak_bytes must be a positive whole number")
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            _warn(f"ignoring eager-peak cache entry {path}: {exc}")
            return None
        return peak

    def save_eager_peak(self, graph: "Graph", device: str, peak_bytes: int) -> None:
        path = self._eager_path(graph, device)
        data = {"format": EAGER_FORMAT, "graph": graph.structure_hash(), "device": device,
                "peak_bytes": int(peak_bytes)}
        try:
            write_atomic(path, json.dumps(data))
        except OSError as exc:
            _warn(f"cannot write eager-peak cache entry {path}: {exc.strerror or exc}")

    # ---- compiled mode's budget ----------------------------------------------------------
    def compiled_key(self, graph: "Graph", budget_bytes: int, options: Mapping[str, Any],
                     device: str) -> str | None:
        """The key of compiled mode's record for ``graph`` asked for ``budget_bytes``; None
        where the options cannot be part of a key."""
        plan_key = self.plan_key(graph, budget_bytes, options, device, purpose="compiled")
        if plan_key is None:
            return None
        import torch

        return _digest({"plan": plan_key, "torch": torch.__version__, "what": "compiled"})

    def load_compiled_budget(self, key: str | None, asked_bytes: int) -> int | None:
        """The budget (bytes, below ``asked_bytes``) compiled mode last planned for under
        ``key``; None when there is no readable entry."""
        if key is None:
            return None
        path = self.directory / "compiled" / f"{key}.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("format") != COMPILED_FORMAT:
                raise ValueError("not a compiled-mode entry")
            planned = data["planned_bytes"]
            if isinstance(planned, bool) or not isinstance(planned, int) or not (
                    0 < planned <= asked_bytes):
                raise ValueError(f"planned_bytes must be a whole number in 1..{asked_bytes}")
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            _warn(f"ignoring compiled-mode cache entry {path}: {exc}")
            return None
        return planned

    def save_compiled_budget(self, key: str | None, planned_bytes: int) -> None:
        if key is None:
            return
        path = self.directory / "compiled" / f"{key}.json"
        try:
            write_atomic(path, json.dumps({"format": COMPILED_FORMAT,
                                           "planned_bytes": int(planned_bytes)}))
        except OSError as exc:
            _warn(f"cannot write compiled-mode cache entry {path}: {exc.strerror or exc}")

    # ---- random decisions -----------------------------------------------------------------
    def load_decisions(self, key: str, parse: Callable[[Any], Any]) -> Any:
        """What a model's random decisions leave out (``capture.decisions``), cached under
        ``key``, as ``parse`` reads it; None when there is no readable entry."""
        path = self.directory / "decisions" / f"{key}.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("format") != DECISIONS_FORMAT:
                raise ValueError("not a decisions entry")
            return parse(data["regions"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            _warn(f"ignoring decisions cache entry {path}: {exc}")
            return None

    def save_decisions(self, key: str, regions: Any) -> None:
        path = self.directory / "decisions" / f"{key}.json"
        try:
            write_atomic(path, json.dumps({"format": DECISIONS_FORMAT, "regions": regions}))
        except OSError as exc:
            _warn(f"cannot write decisions cache entry {path}: {exc.strerror or exc}")

    def save_times(self, graph: "Graph", device: str) -> None:
        path = self._times_path(graph, device)
        data = {
            "format": TIMES_FORMAT,
            "graph": graph.structure_hash(),
            "device": device,
            "times": [float(op.time) for op in graph.ops],
        }
        try:
            write_atomic(path, json.dumps(data))
        except OSError as exc:
            _warn(f"cannot write op-time cache entry {path}: {exc.strerror or exc}")


def measured_times(traced: "Traced", model: "nn.Module", sample: Any,
                   cache: PlanCache | None) -> None:
    """Give ``traced.graph`` measured op times: the cached ones when this graph was measured
    before on this kind of device, otherwise measure them (``annotate_costs``, keeping the
    workspaces and sizes the trace measured) and cache them."""
    from hrockmate.capture.costs import annotate_costs

    device = device_kind(traced.device)
    if cache is not None and cache.load_times(traced.graph, device):
        return
    annotate_costs(traced, model, sample, mode="measure", workspace=False)
    if cache is not None:
        cache.save_times(traced.graph, device)


def _warn(message: str) -> None:
    warnings.warn(message, PlanCacheWarning, stacklevel=3)
