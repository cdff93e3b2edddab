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
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

__all__ = ["cap_arenas"]

_log = logging.getLogger("msd_dask.heap")

#: glibc's ``mallopt`` parameter for the most arenas (``M_ARENA_MAX`` of ``malloc.h``)
_M_ARENA_MAX = -8
#: the cap this process set, ``None`` until :func:`cap_arenas` set one
_cap: int | None = None
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
        The cap in force, ``None`` where it was left alone: ``MALLOC_ARENA_MAX`` set in
        the environment (the deployment's choice), a C library other than glibc, or
        ``mallopt`` refused it.
    """
    global _cap
    with _lock:
        if _cap is not None:
            return _cap
        if os.environ.get("MALLOC_ARENA_MAX") or platform.libc_ver()[0] != "glibc":
            return None
        n = max(2, len(os.sched_getaffinity(0))) if arenas is None else int(arenas)
        if n < 1:
            raise ValueError(f"arenas must be >= 1, got {arenas}")
        try:
            libc = ctypes.CDLL(None)
            ok = libc.mallopt(ctypes.c_int(_M_ARENA_MAX), ctypes.c_int(n))
        except (OSError, AttributeError) as e:
            _log.debug("msd_dask: C heap's arenas left alone (%s)", e)
            return None
        if not ok:
            return None
        _cap = n
        return n
