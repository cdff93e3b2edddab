"""The C heap of a process that reads sources (a Dask worker hosting loaders).

Every loader reads on threads of its own, and glibc's ``malloc`` gives each new thread
an arena of its own, up to eight per core: a worker hosting a dozen loaders keeps a
dozen arenas, each holding the pages its thread freed (token buffers, Arrow's buffers,
which msd_dask's parquet reader takes from the C heap, documents).  The deployment
sets ``MALLOC_ARENA_MAX=2`` where it starts the workers (docs/deployment.md, the C
heap's arenas; the embedded cluster does), which also merges the arenas of Dask's own
threads.  Where it did not, :func:`cap_arenas` caps the arenas a process creates from
its first loader on at one per core it may run on (at least two), so the loaders'
threads share them.  A C library other than glibc is left alone.

glibc also raises its threshold for taking a block straight from the operating system
(``mmap``) to the size of each such block freed, up to 32 MiB: after the first large
array goes, the next ones of that size come from an arena, and what they leave there
when freed stays in the process.  It stops raising it once the process sets any of its
thresholds, and Dask's nanny starts every worker with ``MALLOC_TRIM_THRESHOLD_``: there it
stays at 128 KiB, and every array above that is mapped anew and its pages faulted in each
time (a planner's step at dp 16,384 × 4K makes hundreds of arrays of a few MiB: 1.4× the
time).  :func:`map_large_blocks` fixes it at :data:`MMAP_THRESHOLD` in the planner's
process, either way: a step's arrays of a few MiB are reused from the arenas, and those of
tens of MiB (dp 16,384 × 128K) go back when freed.  After such a large step,
:func:`trim_after` gives back the free pages its arrays of a few MiB left in the arenas.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from collections.abc import Callable

from msd_dask.core.scaling import usable_cores

__all__ = ["cap_arenas", "map_large_blocks", "trim_after", "MMAP_THRESHOLD"]

_log = logging.getLogger("msd_dask.heap")

#: glibc's ``mallopt`` parameter for the most arenas (``M_ARENA_MAX`` of ``malloc.h``)
_M_ARENA_MAX = -8
#: glibc's ``mallopt`` parameter for the size from which a block is mapped on its own
#: (``M_MMAP_THRESHOLD``); setting it stops glibc raising it
_M_MMAP_THRESHOLD = -3
#: the size from which :func:`map_large_blocks` has blocks mapped on their own, and so
#: given back to the operating system when freed: above a 4K step's arrays at dp 16,384
#: (a few MiB, made and freed each step, which mapping anew slows down)
MMAP_THRESHOLD = 16 * 2**20
#: the most glibc takes as that size (``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit)
_MMAP_MAX = 32 * 2**20
#: the cap this process set, ``None`` until :func:`cap_arenas` set one
_cap: int | None = None
#: the threshold this process set, ``None`` until :func:`map_large_blocks` set one
_threshold: int | None = None
_lock = threading.Lock()


def cap_arenas(arenas: int | None = None) -> int | None:
    """Cap the arenas of this process's C heap (glibc ``mallopt(M_ARENA_MAX)``), once.

    glibc fixes its limit when a process first has more than eight arenas, so this is
    called where a process starts reading sources, before its read threads allocate.
    Idempotent: a second call returns the first cap and changes nothing.

    Parameters
    ----------
    arenas : int, optional
        The most arenas; default one per core this process may run on, at least 2.

    Returns
    -------
    int or None
        The cap in force, ``None`` where it was left alone: ``MALLOC_ARENA_MAX`` (or
        ``GLIBC_TUNABLES``'s ``glibc.malloc.arena_max``) set in the environment (the
        deployment's choice), a C library other than glibc, or
        ``mallopt`` refused it.
    """
    global _cap
    with _lock:
        if _cap is not None:
            return _cap
        n = max(2, usable_cores()) if arenas is None else int(arenas)
        if n < 1:
            raise ValueError(f"arenas must be >= 1, got {arenas}")
        if not _mallopt("MALLOC_ARENA_MAX", _M_ARENA_MAX, n):
            return None
        _cap = n
        return n


def map_large_blocks(threshold: int = MMAP_THRESHOLD) -> int | None:
    """Have blocks of ``threshold`` bytes and more mapped on their own (glibc
    ``mallopt(M_MMAP_THRESHOLD)``), so that freeing one gives its memory back, once.

    Idempotent: a second call returns the first threshold and changes nothing.

    Parameters
    ----------
    threshold : int
        Bytes; glibc takes at most 32 MiB.

    Returns
    -------
    int or None
        The threshold set, ``None`` where it was left alone: ``MALLOC_MMAP_THRESHOLD_``
        (or ``GLIBC_TUNABLES``'s ``glibc.malloc.mmap_threshold``) set in the environment
        (the deployment's choice), a C library other than glibc, or
        ``mallopt`` refused it.
    """
    global _threshold
    if not 0 < threshold <= _MMAP_MAX:
        raise ValueError(f"threshold must be in (0, 32 MiB], got {threshold}")
    with _lock:
        if _threshold is not None:
            return _threshold
        if not _mallopt("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, threshold):
            return None
        _threshold = threshold
        return threshold


def trim_after(nbytes: int) -> bool:
    """After work whose largest array took ``nbytes``: from the mmap threshold in force on
    (:func:`map_large_blocks`'s, else the deployment's ``MALLOC_MMAP_THRESHOLD_``, else
    :data:`MMAP_THRESHOLD`), give the free pages of the C heap back to the operating system
    (glibc ``malloc_trim(0)``); whether it did.

    Such work (a planner's step at dp 16,384 × 128K, millions of pieces) also made arrays
    of a few MiB, below the threshold, which the heap keeps when freed: about 200 MiB
    after a step there, which the next step's peak adds to.  Giving them back takes a few
    ms there; after a smaller step the heap's pages are reused instead (at 4K, giving
    them back every step cost 5-7 ms of a 110 ms step in page faults).  Not on a C library
    other than glibc.
    """
    if nbytes < _threshold_in_force():
        return False
    trimmed = _glibc_call("C heap not trimmed",
                          lambda libc: libc.malloc_trim(ctypes.c_size_t(0)))
    return trimmed is not None


def _threshold_in_force() -> int:
    """The size from which this process maps blocks on their own: the one
    :func:`map_large_blocks` set, else the environment's ``MALLOC_MMAP_THRESHOLD_`` (the
    deployment's, which that function leaves alone) where glibc takes it (at most 32
    MiB), else :data:`MMAP_THRESHOLD`."""
    if _threshold is not None:
        return _threshold
    try:
        given = _c_number(_deployments("MALLOC_MMAP_THRESHOLD_") or "")
    except ValueError:  # (unset, or not a number glibc would take either)
        return MMAP_THRESHOLD
    # glibc ignores a threshold above its most (and keeps raising its own)
    return given if 0 <= given <= _MMAP_MAX else MMAP_THRESHOLD


def _c_number(text: str) -> int:
    """A whole number as glibc reads one (``strtoul`` of base 0): ``0x`` hex, a leading
    ``0`` octal, else decimal (``int(text, 0)`` refused ``010``, and the threshold in force
    was taken for the default; a review)."""
    t = text.strip()
    base = 16 if t[:2].lower() == "0x" else 8 if len(t) > 1 and t[0] == "0" else 10
    return int(t, base)


#: the GLIBC_TUNABLES name of each environment variable :func:`_mallopt` is told of
_TUNABLES = {"MALLOC_ARENA_MAX": "glibc.malloc.arena_max",
             "MALLOC_MMAP_THRESHOLD_": "glibc.malloc.mmap_threshold"}


def _deployments(env: str) -> str | None:
    """The value the deployment gave glibc's setting ``env``: the environment variable, else
    its entry in ``GLIBC_TUNABLES`` (``glibc.malloc.mmap_threshold=1048576:...``, the form
    glibc documents, which was overridden as unset; a review); None where neither sets it."""
    if os.environ.get(env):
        return os.environ[env]
    tunable = _TUNABLES.get(env)
    for item in os.environ.get("GLIBC_TUNABLES", "").split(":"):
        name, eq, value = item.partition("=")
        if eq and name.strip() == tunable and value.strip():
            return value.strip()
    return None


def _mallopt(env: str, param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; whether it took it.  Not where the deployment sets
    the same (:func:`_deployments`: ``env`` or ``GLIBC_TUNABLES``) or the C library is not
    glibc."""
    if _deployments(env) is not None:
        return False
    return bool(_glibc_call(f"C heap's {env} left alone",
                            lambda libc: libc.mallopt(ctypes.c_int(param), ctypes.c_int(value))))


def _glibc_call(failed: str, call: Callable[[ctypes.CDLL], int]) -> int | None:
    """What ``call(glibc)`` returned; None on a C library other than glibc, or where the call
    cannot be made (logged at debug level as ``failed``)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return int(call(ctypes.CDLL(None)))
    except (OSError, AttributeError) as e:
        _log.debug("msd_dask: %s (%s)", failed, e)
        return None
