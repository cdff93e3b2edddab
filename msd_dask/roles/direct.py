"""Calls between roles on one worker, without the worker's loopback connection.

Dask sends a call from an ``async def`` actor method to an actor on the same
worker over a TCP connection to that worker itself: the arguments and the
result are serialized, written, read and deserialized in one process (Dask
short-cuts only calls made from an actor's own thread, i.e. from plain
methods).  The planner, a constructor and a loader often share a worker, and
every such message costs the service CPU at both ends whatever its size.
:func:`direct` hands the caller the actor object itself when it lives in the
calling worker, so the call is a coroutine on the same event loop.

What stays as it was for a remote call:

* the callee runs as a task of its own (:func:`asyncio.shield`): cancelling
  the caller's wait (a slot re-filled, a timeout) does not cancel the callee's
  work half-way, as it would not on another worker;
* only ``async def`` methods are called this way (the roles' calls between one
  another are all ``async``; a plain method would run on the event loop
  instead of the actor's thread).

What differs: arguments and results are the caller's objects, not copies, so
neither side may change what it passed or got.  None of the calls made
through :func:`direct` does (the planner copies the lengths array a loader
hands it, the one object it keeps); ``tests/integration/test_direct.py`` checks that the
results are equal both ways.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

__all__: list[str] = []

from msd_dask.dask_internals import local_actor


class _Local:
    """The actor object of a handle in this worker, called like the handle (``await``)."""

    __slots__ = ("_obj",)

    def __init__(self, obj: Any):
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._obj, name)
        if not inspect.iscoroutinefunction(attr):
            raise TypeError(f"{type(self._obj).__name__}.{name} is not an async method: "
                            "call it through the actor handle")

        def call(*args: Any, **kwargs: Any) -> asyncio.Future[Any]:
            return asyncio.shield(attr(*args, **kwargs))

        return call


def direct(handle: Any) -> Any:
    """``handle``'s actor object if it lives in this worker process, else ``handle``.

    Either is called the same way, ``await direct(h).method(...)``, for the
    ``async def`` methods of the roles.  Outside a worker, or for an actor on
    another worker (or one this worker no longer holds), the handle is returned
    unchanged.
    """
    try:
        from distributed import get_worker

        worker = get_worker()
    except ValueError:  # not on a worker (a client, a test)
        return handle
    obj = local_actor(worker, handle)
    if obj is None:
        return handle
    return _Local(obj)
