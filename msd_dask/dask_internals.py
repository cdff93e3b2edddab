"""Every use of Dask's private internals, in one place, each with the reason it is needed.

The rest of msd_dask talks to Dask through its public API (``Client``,
``Actor`` handles, ``SchedulerPlugin``, ``get_worker``) and through the
functions here.  When a Dask release changes one of these internals, this is
the one module to adapt; each function says what it relies on.
"""

from __future__ import annotations

from typing import Any

__all__ = ["actor_address", "local_actor", "release_actor", "worker_actors"]


def actor_address(handle: Any) -> str | None:
    """The address of the worker holding the actor behind ``handle`` (``None`` if unknown).

    Relies on ``distributed.Actor._address``: Dask has no public accessor for
    where an actor lives, and the service needs it to tell which roles a lost
    or retiring worker held and whether a role is on the calling worker.
    """
    return getattr(handle, "_address", None)


def local_actor(worker: Any, handle: Any) -> Any | None:
    """The actor object behind ``handle`` if ``worker`` holds it, else ``None``.

    Relies on ``Worker.state.actors`` (key -> actor object): Dask sends a call
    from an ``async def`` actor method to an actor on the *same* worker through
    a TCP connection to that worker; calling the object directly skips the
    serialisation and the loopback round trip (see :mod:`msd_dask.roles.direct`).
    """
    if actor_address(handle) != worker.address:
        return None
    return worker.state.actors.get(handle.key)


def worker_actors(worker: Any) -> dict[Any, Any]:
    """The actors ``worker`` holds: ``{key: actor object}``.

    Relies on ``Worker.state.actors``: Dask has no public way to reach the actor
    objects a worker holds, and the process re-creating a lost planner must
    close the roles the lost one left on every worker (they would go on
    publishing tickets and holding memory; see
    :func:`msd_dask.roles.supervisor.close_service_roles`).
    """
    return dict(worker.state.actors)


def release_actor(handle: Any) -> None:
    """Release the future an actor handle holds on its actor's key, if it holds one.

    Relies on ``distributed.Actor._future`` (set on a handle made from a
    ``submit(..., actor=True)`` future): released only through the submit
    future, a closed role's key stayed on the scheduler and its actor on its
    worker for as long as the cluster ran.
    """
    inner = handle.__dict__.get("_future")
    if inner is not None:
        inner.release()
