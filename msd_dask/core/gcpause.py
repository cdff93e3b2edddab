"""A process-wide pause of the cyclic garbage collector (no Dask).

Process plumbing, kept apart from the planning logic that uses it: planning a
big step makes ~10⁵-10⁶ objects that outlive it (a plan's pieces and rows),
and each of the collector's generation thresholds those allocations cross
starts a pass over the objects tracked so far; none of those objects is
garbage yet, so the passes find nothing.  Paused for the step, the collector
runs again at the next allocations after it.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_LOCK = threading.Lock()
_state = {"pauses": 0, "was_on": False}


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (process-wide) while the block runs.

    Counted, so that overlapping pauses (two planners in two threads) turn it back
    on once, after the last, and only if it was on before the first.
    """
    with _LOCK:
        if _state["pauses"] == 0:
            _state["was_on"] = gc.isenabled()
            gc.disable()
        _state["pauses"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _state["pauses"] -= 1
            if _state["pauses"] == 0 and _state["was_on"]:
                gc.enable()
