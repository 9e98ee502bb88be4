"""Keeping freed CPU memory in the process: the CPU counterpart of CUDA's caching allocator.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc hands large blocks back to the
kernel when they are freed (blocks it served with ``mmap``, and free space at the top of the heap
above its trim threshold), so the next tensor of that size takes a page fault on each 4 KiB page
and the kernel zeroes every page. A schedule that recomputes allocates more often than plain
autograd and paid for it on every recomputed tensor: ResNet18 at 70% of store-all ran about 4
points above its predicted overhead, and went back to the prediction once freed memory stayed
mapped (docs/runtime.md). CUDA's caching allocator already keeps freed blocks, so only CPU needs
this.

``keep_freed_cpu_memory`` sets glibc's ``mallopt`` so that tensors come from the heap and freed
space is kept for reuse: the process's memory stays at its high-water mark, which a training
loop reaches every iteration anyway. It applies to the whole process, once; set
``HROCKMATE_KEEP_CPU_MEMORY=0`` to leave the C library's defaults. Which freed chunk serves
the next tensor stays glibc's choice: torch asks for 64-byte-aligned blocks, and depending on
where the heap starts (address-space randomisation) a freed chunk of exactly the size can be
a few bytes short of such a request, so the heap grows by one more block, faulted in once; in
30 rounds of a 64 MiB tensor that happened at most twice per process, never more.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

__all__ = ["ENV_VAR", "keep_freed_cpu_memory"]

logger = logging.getLogger(__name__)

ENV_VAR = "HROCKMATE_KEEP_CPU_MEMORY"

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1  # mallopt takes an int: trim only beyond 2 GiB of free heap top

_state: bool | None = None  # None: not tried yet in this process


def _turned_off() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off")


def keep_freed_cpu_memory() -> bool:
    """Keep freed CPU memory mapped for reuse (glibc on Linux); True when it is in effect.

    Idempotent: the first call decides for the process. Returns False, changing nothing, on other
    C libraries and systems, or when ``HROCKMATE_KEEP_CPU_MEMORY=0``.
    """
    global _state
    if _state is not None:
        return _state
    _state = False
    if _turned_off():
        logger.info("%s=0: the C library's defaults for freed CPU memory are kept", ENV_VAR)
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already uses
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only (not musl)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # No block is served by mmap (so none is unmapped when freed), and the heap top is trimmed
    # only past 2 GiB of free space.
    _state = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    if _state:
        logger.info("freed CPU memory is kept for reuse (glibc mallopt); %s=0 turns this off",
                    ENV_VAR)
    else:
        logger.info("glibc's mallopt refused the settings; freed CPU memory may go back to the "
                    "kernel and recomputation may run slower than predicted")
    return _state
