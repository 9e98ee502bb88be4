"""Freed CPU memory stays in the process once an HRockmate module runs on the CPU."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import pytest

# A fresh process (the setting is process-wide): build an HRockmate module on the CPU, then
# allocate, touch and free a 64 MiB tensor three times and count the page faults of the last
# round. glibc serves such a block with mmap and unmaps it on free unless told otherwise, so
# every round faults all 16384 pages in again.
_PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from hrockmate import HRockmate
    from hrockmate.runtime import keep_freed_cpu_memory

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    HRockmate(model, torch.randn(4, 8), cache=False)
    faults = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(16 * 2**20, dtype=torch.float32)
        t.fill_(1.0)
        del t
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"kept": keep_freed_cpu_memory(), "faults": faults[-1]}))
""")


def _glibc() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except (OSError, AttributeError):
        return False
    return True


def _probe(**env: str) -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _glibc(), reason="the setting is glibc's (Linux); elsewhere it is a no-op")
def test_freed_cpu_memory_is_reused_without_page_faults() -> None:
    pages = 64 * 2**20 // 4096
    kept = _probe(HROCKMATE_KEEP_CPU_MEMORY="1")
    assert kept["kept"] is True
    assert kept["faults"] < pages // 10, kept
    # turned off: the C library's defaults, and the block is faulted in again
    default = _probe(HROCKMATE_KEEP_CPU_MEMORY="0")
    assert default["kept"] is False
    assert default["faults"] > pages // 2, default
