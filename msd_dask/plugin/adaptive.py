"""How many Dask workers the roles of msd_dask services need (pure, no Dask).

Dask's ``Adaptive`` sizes a cluster to its task load; msd_dask's roles are
long-lived actors that Dask does not count.  The scheduler plugin asks
``Adaptive`` for at least :func:`workers_needed` workers, where

* a worker hosts ``capacity`` roles: ``scaling.roles_per_worker`` when a
  service sets it, else the worker's thread count (one role per thread);
* a role is the planner, a constructor or a loader; every loader counts as
  one, whatever its read threads;
* every worker that holds a role stays (roles cannot move by themselves);
  when the roles wanted do not fit on them, the other live workers count
  (largest first), then new workers of ``new_capacity`` each.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["capacity", "roles_wanted", "workers_needed"]


def capacity(nthreads: int, roles_per_worker: int = 0) -> int:
    """Roles one worker hosts: ``roles_per_worker`` if set (> 0), else its threads (at least 1)."""
    return max(1, roles_per_worker if roles_per_worker > 0 else nthreads)


def roles_wanted(constructors: int, loaders: Mapping[str, int],
                 targets: Mapping[str, int] | None = None) -> int:
    """Roles one service wants: its planner, its constructors and its loaders.

    Parameters
    ----------
    constructors : int
        Data constructors the service has.
    loaders : mapping
        Loaders each source has now.
    targets : mapping, optional
        Loaders the adaptive policy wants per source; a source counts
        ``max(now, target)`` (the policy scales down one loader at a time and
        only after a delay, so a lower target does not free a role yet).
    """
    targets = targets or {}
    return 1 + constructors + sum(max(n, targets.get(s, 0)) for s, n in loaders.items())


def workers_needed(roles: int, held: Sequence[int], free: Sequence[int],
                   new_capacity: int) -> int:
    """Workers to keep or start so that ``roles`` roles fit.

    Parameters
    ----------
    roles : int
        Roles wanted, summed over every service on the scheduler.
    held : sequence of int
        Capacity of each worker that holds a role now: all of them stay.
    free : sequence of int
        Capacity of each other live worker.
    new_capacity : int
        Capacity of a worker not started yet (at least 1).

    Returns
    -------
    int
        ``len(held)`` plus as many free workers (largest capacity first) and
        then new workers as it takes to reach ``roles``.
    """
    if new_capacity < 1:
        raise ValueError(f"new_capacity must be >= 1, got {new_capacity}")
    n = len(held)
    room = sum(held)
    for cap in sorted(free, reverse=True):
        if room >= roles:
            return n
        n += 1
        room += cap
    if room >= roles:
        return n
    return n + math.ceil((roles - room) / new_capacity)
