"""What the CUDA caching allocator counts beyond a step's tensors, and the setting that makes
it count them exactly.

``torch.cuda.memory_allocated`` (and the budget's measure) counts the allocator's blocks, not
the bytes asked for. Every block is a multiple of 512 bytes (``capture.build.allocated_bytes``
sizes the graph's tensors so). A request over 1 MiB comes from the large pool, which splits a
cached block only when more than 1 MiB would remain: the request may get a block up to 1 MiB
larger, and every tensor alive at the peak may hold such a remainder. Which ones do depends on
what the cache held before (an earlier plan, the user's own tensors), not on the schedule. On
an H200, torchvision's ResNet18 at 50% measured 43.54 MiB where the graph predicts 39.63 MiB:
about 3.9 MiB of remainders at the peak, where one had been budgeted.

With expandable segments the allocator splits every block to the request, and the same step
measured 39.41 MiB; GPT-2 steps measured the graph's peak to the byte. So ``split_cuda_blocks``
turns them on for the process, once, when an ``HRockmate`` is built on CUDA, as
``cpu_memory.keep_freed_cpu_memory`` sets the C library's allocator on the CPU. It leaves the
allocator as the user set it when ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` or a
setting made from Python name ``expandable_segments``, or when
``HROCKMATE_EXPANDABLE_SEGMENTS=0``; without them, 1 MiB is budgeted for a remainder
(``allocator_slack_bytes``), which is not a bound, and a warning says so. With them the same
1 MiB stays free for small allocations the graph does not count.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

__all__ = ["CUDA_LARGE_POOL_SLACK", "CUDA_OVERSIZE_SLACK", "ENV_VAR", "allocator_slack_bytes",
           "split_cuda_blocks"]

logger = logging.getLogger(__name__)

ENV_VAR = "HROCKMATE_EXPANDABLE_SEGMENTS"

#: Requests above this size come from the large pool, whose cached blocks are split only when
#: more than this would remain.
CUDA_LARGE_POOL_SLACK = 1 << 20
#: With ``max_split_size_mb`` set, blocks of at least that size are never split, and a request
#: of at least that size may get a cached one up to this much larger (the allocator's rule).
CUDA_OVERSIZE_SLACK = 20 << 20

_state: bool | None = None  # whether split_cuda_blocks turned them on; None: not tried yet


def _parse(text: str, into: dict[str, str]) -> None:
    for item in text.split(","):
        key, _, value = item.partition(":")
        if key.strip():
            into[key.strip()] = value.strip()


def _settings_from_python() -> str:
    """The settings made from Python (``torch._C._accelerator_setAllocatorSettings``), where
    this torch can report them."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    try:
        return str(getter()) if getter is not None else ""
    except RuntimeError:
        return ""


def _set_settings(text: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # (torch before 2.9)
        setter = torch._C._cuda_cudaCachingAllocator_set_allocator_settings
    setter(text)


def allocator_settings() -> dict[str, str]:
    """The CUDA allocator's settings: the environment's as torch reads them when CUDA starts
    (``PYTORCH_CUDA_ALLOC_CONF`` over ``PYTORCH_ALLOC_CONF``), then those made from Python."""
    conf: dict[str, str] = {}
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        _parse(os.environ.get(var, ""), conf)
    _parse(_settings_from_python(), conf)
    return conf


def _turned_off() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")


def split_cuda_blocks() -> bool:
    """Turn the CUDA allocator's expandable segments on for the process unless the user's
    settings name them or ``HROCKMATE_EXPANDABLE_SEGMENTS=0``; True when they are on.

    Idempotent: the first call decides for the process. Blocks of segments made before are
    split from then on too (the allocator's rule reads the setting at each request)."""
    global _state
    if _state is not None:
        return _state or allocator_settings().get("expandable_segments") == "True"
    _state = False
    chosen = allocator_settings().get("expandable_segments")
    if chosen is None and not _turned_off():
        try:
            _set_settings("expandable_segments:True")
            _state = True
        except (RuntimeError, AttributeError) as exc:
            logger.warning("HRockmate: could not turn on the CUDA allocator's expandable "
                           "segments (%s)", exc)
        else:
            logger.info("HRockmate: the CUDA allocator's expandable segments are on, so that "
                        "blocks are split to what each tensor asks for and the step's peak "
                        "is the one planned; %s=0 keeps the allocator as it was", ENV_VAR)
            return True
    if chosen == "True":
        return True
    logger.warning(
        "HRockmate: the CUDA allocator's expandable segments are off (%s), so a tensor over "
        "1 MiB may get a cached block up to 1 MiB larger than it asks for; 1 MiB is budgeted "
        "for that, and a step where several tensors get one measures above its budget (set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to have every block split)",
        f"{ENV_VAR}=0" if chosen is None else "the allocator's settings say so")
    return False


def allocator_slack_bytes(graph: Any, device: torch.device) -> int:
    """What the allocator may count beyond the graph's tensors at a peak, on CUDA, when the
    graph makes a large pool request (a tensor or workspace over 1 MiB): an oversize block's
    remainder when ``max_split_size_mb`` is set and a request reaches it, else 1 MiB. Without
    expandable segments that is one block's unsplit remainder (not a bound: see the module
    docstring); with them no block is larger than asked, and the 1 MiB covers the few small
    allocations the graph does not count (a small CNN with cuDNN's BatchNorm measured 3,840
    bytes above the graph's peak on an H200)."""
    if device.type != "cuda":
        return 0
    largest = max([t.bytes for t in graph.tensors] + [o.workspace for o in graph.ops], default=0)
    conf = allocator_settings()
    if not (_state or conf.get("expandable_segments") == "True"):
        try:
            if largest >= float(conf["max_split_size_mb"]) * 2**20:
                return CUDA_OVERSIZE_SLACK
        except (KeyError, ValueError):
            pass
    return CUDA_LARGE_POOL_SLACK if largest > CUDA_LARGE_POOL_SLACK else 0
