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
# allocate, touch and free a 64 MiB tensor three times; in the last round count the page faults
# and how much the resident size drops at the free. glibc serves such a block with mmap and
# unmaps it on free unless told otherwise, so every round faults all 16384 pages in again.
# Kept, the block stays in the process; whether the next allocation reuses it (no faults) is
# glibc's choice: in about one process in four (address-space layout randomisation) the
# aligned allocation torch asks for does not fit the freed chunk and the heap grows instead,
# so only the resident size is asserted when kept.
_PROBE = textwrap.dedent("""
    import json, resource, sys
    import torch
    from hrockmate import HRockmate
    from hrockmate.runtime import keep_freed_cpu_memory

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    HRockmate(model, torch.randn(4, 8), cache=False)
    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(16 * 2**20, dtype=torch.float32)
        t.fill_(1.0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        held = resident()
        del t
        dropped = held - resident()
    print(json.dumps({"kept": keep_freed_cpu_memory(), "faults": faults, "dropped": dropped}))
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
def test_freed_cpu_memory_stays_in_the_process() -> None:
    block = 64 * 2**20
    pages = block // 4096
    kept = _probe(HROCKMATE_KEEP_CPU_MEMORY="1")
    assert kept["kept"] is True
    assert kept["dropped"] < block // 10, kept
    # turned off: the C library's defaults; the block goes back to the OS at the free and is
    # faulted in again at the next allocation
    default = _probe(HROCKMATE_KEEP_CPU_MEMORY="0")
    assert default["kept"] is False
    assert default["dropped"] > block // 2, default
    assert default["faults"] > pages // 2, default
