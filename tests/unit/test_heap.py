"""The C heap's arenas in a process that reads sources (msd_dask.sources.heap)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's arenas")

#: a process that (with argv[1] == "cap") caps its arenas, then has 6 threads allocate
#: at once and counts the arenas glibc's malloc_stats reports
ARENAS = """
import ctypes, sys, threading
if sys.argv[1] == "cap":
    from msd_dask.sources.heap import cap_arenas
    print(cap_arenas(), cap_arenas(5), flush=True)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
barrier = threading.Barrier(7)
held = []
def work():
    held.append(libc.malloc(64 * 1024))
    barrier.wait()
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(6)]
for t in threads:
    t.start()
barrier.wait()
libc.malloc_stats()
barrier.wait()
for t in threads:
    t.join()
"""


def _arenas(mode: str, **env: str) -> tuple[str, int]:
    """What the probe printed, and its arenas while 6 threads held an allocation each.

    The probe's environment has ``MALLOC_ARENA_MAX`` only from ``env``: a Dask nanny
    started in this process (an embedded cluster of an earlier test) leaves its
    ``pre-spawn-environ`` in this process's environment."""
    base = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    res = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True,
                         timeout=60, env={**base, **env})
    assert res.returncode == 0, res.stderr
    return res.stdout.strip(), sum(line.startswith("Arena ") for line in res.stderr.splitlines())


def test_threads_share_the_capped_arenas() -> None:
    cores = max(2, len(os.sched_getaffinity(0)))
    printed, capped = _arenas("cap")
    assert printed == f"{cores} {cores}"  # the second call keeps the first cap
    _, free = _arenas("nocap")
    assert free == 7  # the main thread's arena and one per thread
    assert capped == min(cores, 7)


def test_the_deployments_setting_is_left_alone() -> None:
    printed, arenas = _arenas("cap", MALLOC_ARENA_MAX="4")
    assert printed == "None None"
    assert arenas == 4


#: a process that (with argv[1] == "map") fixes glibc's mmap threshold, frees a 24 MiB block
#: (which raises glibc's own mmap threshold to 24 MiB, and its trim threshold to twice that),
#: then makes and frees a 20 MiB block: prints what ``map_large_blocks`` returned, and the MiB
#: its memory stayed above what it was before the 20 MiB block (from the heap's top, and not
#: trimmed under 48 MiB, unless mapped on its own)
LARGE = """
import ctypes, sys
if sys.argv[1] == "map":
    from msd_dask.sources.heap import map_large_blocks
    print(map_large_blocks(), map_large_blocks(2**20), flush=True)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
big = libc.malloc(24 * 2**20)
ctypes.memset(big, 1, 24 * 2**20)
libc.free(big)
before = rss()
block = libc.malloc(20 * 2**20)
ctypes.memset(block, 1, 20 * 2**20)
libc.free(block)
print(round(rss() - before), flush=True)
"""


def _kept_mib(mode: str, **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    res = subprocess.run([sys.executable, "-c", LARGE, mode], capture_output=True, text=True,
                         timeout=60, env={**base, **env})
    assert res.returncode == 0, res.stderr
    return res.stdout.split("\n")


def test_a_large_block_freed_goes_back_once_the_threshold_is_fixed() -> None:
    """glibc raised its mmap threshold to a freed block's size: a 20 MiB array made and
    freed after it stays in the process; with the planner's fixed threshold it goes back."""
    from msd_dask.sources.heap import MMAP_THRESHOLD

    assert MMAP_THRESHOLD <= 20 * 2**20
    kept = _kept_mib("plain")
    assert int(kept[0]) >= 19, kept
    printed, kept_mapped, _ = _kept_mib("map")
    assert printed == f"{MMAP_THRESHOLD} {MMAP_THRESHOLD}"  # the second call keeps the first
    assert int(kept_mapped) <= 1, kept_mapped


def test_the_threshold_is_fixed_in_a_nannys_worker_too() -> None:
    """Dask's nanny starts every worker with ``MALLOC_TRIM_THRESHOLD_``, which fixes glibc's
    mmap threshold at 128 KiB: every array of a planner's 4K step above that was mapped anew
    (1.4× the step's time); the planner's process fixes it at its own threshold there too."""
    from msd_dask.sources.heap import MMAP_THRESHOLD

    printed, kept, _ = _kept_mib("map", MALLOC_TRIM_THRESHOLD_="65536")
    assert printed == f"{MMAP_THRESHOLD} {MMAP_THRESHOLD}"
    assert int(kept) <= 1


def test_the_deployments_mmap_threshold_is_left_alone() -> None:
    printed, kept, _ = _kept_mib("map", MALLOC_MMAP_THRESHOLD_=str(2**20))
    assert printed == "None None"
    assert int(kept) <= 1  # (its threshold, 1 MiB, maps the 20 MiB block)
