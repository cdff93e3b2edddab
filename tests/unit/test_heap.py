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
