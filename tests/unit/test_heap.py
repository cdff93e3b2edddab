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


def test_a_platform_without_cpu_affinity_or_glibc_is_left_alone() -> None:
    """macOS and Windows have neither ``os.sched_getaffinity`` nor glibc: ``cap_arenas``
    raised ``AttributeError`` there, in every loader's and the planner's start, before it
    saw the C library (a review); it leaves the process alone, and the planner's threads
    count the machine's cores."""
    probe = (
        "import os, platform\n"
        "del os.sched_getaffinity\n"
        "platform.libc_ver = lambda *a, **k: ('', '')\n"
        "from msd_dask.core.row_placement import planner_threads\n"
        "from msd_dask.sources.heap import cap_arenas\n"
        "print(cap_arenas(), planner_threads() == (os.cpu_count() or 1))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX",
                                                             "MSD_DASK_PLANNER_THREADS")}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["None", "True"]


#: what the processes below share: glibc's malloc and free, and the process's RSS in MiB
LIBC = """
import ctypes, sys
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
"""

#: a process that (with argv[1] == "map") fixes glibc's mmap threshold, frees a 24 MiB block
#: (which raises glibc's own mmap threshold to 24 MiB, and its trim threshold to twice that),
#: then makes and frees a 20 MiB block: prints what ``map_large_blocks`` returned, and the MiB
#: its memory stayed above what it was before the 20 MiB block (from the heap's top, and not
#: trimmed under 48 MiB, unless mapped on its own)
LARGE = LIBC + """
if sys.argv[1] == "map":
    from msd_dask.sources.heap import map_large_blocks
    print(map_large_blocks(), map_large_blocks(2**20), flush=True)
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


#: a process that, as a planner in a nanny's worker (Dask's MALLOC_TRIM_THRESHOLD_ set), fixes
#: the mmap threshold, makes 2,000 blocks of 64 KiB with a small one between each two
#: (kept: the freed blocks are holes, not the heap's top), frees the 64 KiB ones, then calls
#: trim_after(argv[1]): prints what it returned and the MiB the process gave back
TRIM = LIBC + """
from msd_dask.sources.heap import map_large_blocks, trim_after
map_large_blocks()
blocks, keep = [], []
for _ in range(2000):
    b = libc.malloc(64 * 1024)
    ctypes.memset(b, 1, 64 * 1024)
    blocks.append(b)
    keep.append(libc.malloc(64))
for b in blocks:
    libc.free(b)
before = rss()
print(trim_after(int(sys.argv[1])), round(before - rss()), flush=True)
"""


@pytest.mark.parametrize("nbytes, gives_back", [(2**20, False), (16 * 2**20, True),
                                                (200 * 2**20, True)])
def test_a_large_steps_free_heap_pages_go_back(nbytes: int, gives_back: bool) -> None:
    """After a planner's step at dp 16,384 × 128K the heap kept about 200 MiB of the step's
    arrays of a few MiB, which the next step's peak added to; after a step whose table
    takes the mmap threshold or more, their pages go back.  After a smaller step they
    stay, to be reused (at 4K, giving them back cost 5-7% of each step)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    res = subprocess.run([sys.executable, "-c", TRIM, str(nbytes)], capture_output=True,
                         text=True, timeout=60, env={**base, "MALLOC_TRIM_THRESHOLD_": "65536"})
    assert res.returncode == 0, res.stderr
    returned, mib = res.stdout.split()
    assert returned == str(gives_back)
    if gives_back:
        assert int(mib) >= 100, mib  # (of the 125 MiB of freed blocks)
    else:
        assert int(mib) <= 5, mib


@pytest.mark.parametrize("nbytes, gives_back", [(2**20, False), (4 * 2**20, True)])
def test_a_step_is_large_from_the_deployments_mmap_threshold(nbytes: int,
                                                            gives_back: bool) -> None:
    """Where the deployment sets ``MALLOC_MMAP_THRESHOLD_`` (which map_large_blocks leaves
    alone), a step is large from that threshold on, not from msd_dask's own 16 MiB."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    res = subprocess.run([sys.executable, "-c", TRIM, str(nbytes)], capture_output=True,
                         text=True, timeout=60,
                         env={**base, "MALLOC_TRIM_THRESHOLD_": "65536",
                              "MALLOC_MMAP_THRESHOLD_": str(4 * 2**20)})
    assert res.returncode == 0, res.stderr
    returned, mib = res.stdout.split()
    assert returned == str(gives_back)
    if gives_back:
        assert int(mib) >= 100, mib  # (of the 125 MiB of freed blocks)


@pytest.mark.parametrize("value, threshold", [("4194304", 4 << 20), ("0x400000", 4 << 20),
                                              ("020000000", 4 << 20), ("010", 8),
                                              (str(64 << 20), 16 << 20), ("junk", 16 << 20)])
@pytest.mark.parametrize("where", ["variable", "tunables"])
def test_the_deployments_threshold_is_read_as_glibc_reads_it(
        value: str, threshold: int, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc takes the variable in hex and octal too, and ignores one above 32 MiB: so does
    the threshold that decides which steps are large (reviews: octal was taken for no
    setting, and GLIBC_TUNABLES, the form glibc documents, was not read)."""
    from msd_dask.sources import heap

    monkeypatch.setattr(heap, "_threshold", None)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    if where == "variable":
        monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", value)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", f"glibc.malloc.check=0:glibc.malloc.mmap_threshold"
                                             f"={value}:glibc.malloc.arena_max=3")
    assert heap._threshold_in_force() == threshold


def test_the_deployments_tunables_are_left_alone() -> None:
    # GLIBC_TUNABLES's threshold was overridden with msd_dask's 16 MiB (a review)
    printed, kept, _ = _kept_mib("map", GLIBC_TUNABLES=f"glibc.malloc.mmap_threshold={2**20}")
    assert printed == "None None"
    assert int(kept) <= 1  # (its threshold, 1 MiB, maps the 20 MiB block)
