"""heap.py: a batch get's freed results are reused by the next batch instead of faulted in again.
Counted in page faults (getrusage), not time; each case in a fresh interpreter (the setting is
process-wide and once)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

_BATCHES = """
import os, resource, sys
from mooncaked.store import heap
print(heap.keep_freed_memory() if sys.argv[1] == "keep" else "left")
src = os.urandom(512 * 1024)
faults = []
for _ in range(6):  # a batch get's results: 16 new 512 KiB objects, used, then all freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    got = [src[:-1] + bytes([i]) for i in range(16)]
    del got
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[2:]))
"""


def _run(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _BATCHES, mode], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env}, check=True).stdout.split()
    return out[0], int(out[1])


def test_freed_results_are_reused_not_faulted_in_again() -> None:
    kept, kept_faults = _run("keep")
    glibc = platform.libc_ver()[0] == "glibc"
    assert kept == str(glibc)  # another libc has no such mallopt: the allocator is left alone, and it says so
    if not glibc:
        return
    left, left_faults = _run("leave")
    # left alone, glibc hands each freed batch back to the kernel: ~128 faults per 512 KiB object
    assert left_faults > 4 * 16 * 64, left_faults
    assert kept_faults < left_faults / 10, (kept_faults, left_faults)


def test_a_process_that_chose_its_own_thresholds_keeps_them() -> None:
    assert _run("keep", MALLOC_TRIM_THRESHOLD_="1048576")[0] == "False"
