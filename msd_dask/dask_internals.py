"""Every use of Dask's private internals, in one place, each with the reason it is needed.

The rest of msd_dask talks to Dask through its public API (``Client``,
``Actor`` handles, ``SchedulerPlugin``, ``get_worker``) and through the
functions here.  When a Dask release changes one of these internals, this is
the one module to adapt; each function says what it relies on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ASK_WAIT", "CREATE_CHECK", "actor_address", "actor_counts", "bound_actor", "event_set",
           "event_wait", "call_actor", "call_remote_actor",
           "has_client", "keys_on", "local_actor", "published_datasets", "release_actor",
           "scraped_server",
           "scheduler_workers", "stop_identity_refresh", "task_worker", "worker_actors",
           "wrap_scheduler_call"]

_log = logging.getLogger(__name__)

#: what msgpack carries as it is (tuples arrive as tuples, lists too: Dask reads
#: msgpack arrays as tuples)
_PLAIN = (int, float, str, bytes, bool, type(None))


def _plain(value: Any) -> bool:
    """Whether ``value`` travels in a Dask message's msgpack frame as it is: a scalar of
    :data:`_PLAIN` or a list or tuple of them (not a subclass, e.g. a numpy integer or a
    named tuple, which msgpack would change or not take)."""
    if type(value) in _PLAIN:
        return True
    return type(value) in (list, tuple) and all(type(v) in _PLAIN for v in value)


def _wire(value: Any) -> Any:
    """An argument of an actor call as the message carries it: as it is if
    :func:`_plain`, else wrapped for Dask's serialisation.

    Dask's ``Actor`` wraps every argument (``to_serialize``): each is then pickled
    on its own, with a header of its own, at about 0.1 ms per argument at each end
    whatever its size; an int or a list of ints costs nothing in the msgpack frame.
    """
    from distributed.protocol import to_serialize

    return value if _plain(value) else to_serialize(value)


def _actor_message(handle: Any, name: str, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> dict[str, Any]:
    """The fields of an ``actor_execute`` message calling ``name`` on ``handle``'s actor."""
    return {"function": name, "actor": handle.key, "args": [_wire(a) for a in args],
            "kwargs": {k: _wire(v) for k, v in kwargs.items()}}


def actor_address(handle: Any) -> str | None:
    """The address of the worker holding the actor behind ``handle`` (``None`` if unknown).

    Relies on ``distributed.Actor._address``: Dask has no public accessor for
    where an actor lives, and the service needs it to tell which roles a lost
    or retiring worker held and whether a role is on the calling worker.
    """
    return getattr(handle, "_address", None)


def call_actor(handle: Any, method: Callable[..., Any], /, *args: Any,
               **kwargs: Any) -> concurrent.futures.Future[Any]:
    """Call ``method`` (a method of the actor's class) on the actor behind ``handle``, from
    a client's thread; a future that can be cancelled.

    Relies on ``Actor._address``, ``Actor._worker_rpc``, ``Actor._io_loop`` and the
    workers' ``actor_execute`` handler (what ``Actor.__getattr__`` sends).  A call
    through the handle whose worker dies does not fail: it waits for the actor's key
    to be computed again and, holding the handle meanwhile, keeps the key wanted,
    so the scheduler re-creates the lost actor from its arguments on another
    worker.  A reader long-polling a constructor is almost always in such a call;
    this one fails on the lost connection instead, and the reader cancels it when
    the service replaces the constructor.
    """
    # the call holds none of the handle: a call still connecting to a lost worker (Dask
    # retries for distributed.comm.timeouts.connect) would keep the actor's key wanted
    rpc, loop = handle._worker_rpc, handle._io_loop.asyncio_loop
    message = _actor_message(handle, method.__name__, args, kwargs)

    async def execute() -> Any:
        result = await rpc.actor_execute(**message)
        if result["status"] == "OK":
            return result["result"]
        raise result["exception"]

    return asyncio.run_coroutine_threadsafe(execute(), loop)


async def call_remote_actor(handle: Any, method: Callable[..., Any], /, *args: Any,
                            **kwargs: Any) -> Any:
    """``await`` ``method`` (an ``async def`` method of the actor's class) on the actor
    behind ``handle`` from the running event loop of a worker, as ``await
    getattr(handle, method.__name__)(*args, **kwargs)`` does, in a cheaper message.

    Relies on ``Actor.key``, ``Actor._worker_rpc`` and the workers' ``actor_execute``
    handler, as :func:`call_actor`: arguments that msgpack carries as they are (ints,
    bytes, lists of them) are not wrapped one by one for Dask's serialisation, which
    costs both ends about 0.1 ms per argument (the roles' hot calls pass a few ints
    and one ``bytes``).  If the actor's worker cannot be reached (``OSError``), the
    call is made again through the handle, which then does what Dask does for a lost
    actor (wait for its key), so a caller sees what it would have seen before.
    """
    try:
        result = await handle._worker_rpc.actor_execute(
            **_actor_message(handle, method.__name__, args, kwargs))
    except OSError:
        return await getattr(handle, method.__name__)(*args, **kwargs)
    if result["status"] == "OK":
        return result["result"]
    raise result["exception"]


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
    building and holding memory; see
    :func:`msd_dask.roles.supervisor.close_service_roles`).
    """
    return dict(worker.state.actors)


def bind_actor(handle: Any, client: Any) -> Any:
    """``handle`` (an actor handle made in a client's process) bound to ``client``; returns it.

    Relies on ``distributed.Actor._client`` and ``_future``: a handle unpickled outside a
    worker binds itself to the process's *current* client (``get_client()``: the last one
    made), whose loop and connections its calls then use, and through a future of which it
    holds its key.  A process with two service handles (two ranks' datasets in one
    process) had handles of one bound to the other's client, so closing one broke the
    other's calls ("Event loop is closed").  Handles on a worker (roles calling roles) are
    left as Dask binds them.
    """
    if getattr(handle, "_worker", None) is not None or getattr(handle, "_client", None) is client:
        return handle
    from distributed import Future

    old = handle.__dict__.get("_future")
    handle._client = client
    handle._future = Future(handle.key, client)
    if old is not None:
        old.release()  # (the other client's reference, taken when it was unpickled)
    return handle


def actor_on(cls: type, worker: str, key: str, client: Any) -> Any:
    """The handle of actor ``key`` (of class ``cls``, on ``worker``) bound to ``client``:
    made from its key and worker, not from its task's result.

    Relies on ``distributed.Actor(cls, address, key)`` making a handle that calls the
    actor on ``address`` (as a result's handle does), and on :func:`bind_actor`.  The
    scheduler plugin's client had the planner's published future from a fetch, and on a
    cluster in the plugin's own process (``LocalCluster(processes=False)``) that is the
    owner's future, which the plugin's client does not hold: awaiting it raised
    ``AttributeError`` at every poll (a review).
    """
    from distributed.actor import Actor

    return bind_actor(Actor(cls, worker, key), client)


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


# ------------------------------------------------------- the front (service, plugin)
def task_worker(key: str, dask_scheduler: Any = None) -> str | None:
    """The worker running the task ``key``, if any (runs on the scheduler).

    Relies on ``Scheduler.tasks`` and ``TaskState.processing_on``: Dask's client
    has no call that says where a task runs; the service names the worker in the
    message of a unit listing that did not finish.
    """
    ts = dask_scheduler.tasks.get(key)
    ws = getattr(ts, "processing_on", None)
    return None if ws is None else str(ws.address)


def keys_on(dask_scheduler: Any, workers: list[str], pattern: str) -> list[str]:
    """Keys held or running on ``workers`` that the regular expression ``pattern`` matches
    whole (:func:`msd_dask.roles.keys.role_pattern`; runs on the scheduler).

    Relies on ``Scheduler.workers`` and ``WorkerState.has_what`` / ``.processing``:
    ``Client.has_what`` does not list running tasks (an actor is one), and
    retiring a worker must wait until no role's key is left on it.
    """
    from msd_dask.roles.keys import is_role_of  # (the one rule for a role's whole key)

    out = []
    for w in workers:
        ws = dask_scheduler.workers.get(w)
        if ws is not None:
            out += [str(ts.key) for ts in (*ws.has_what, *ws.processing)
                    if is_role_of(ts.key, pattern)]
    return out


def actors_on(dask_scheduler: Any, workers: list[str]) -> dict[str, list[str]]:
    """The keys of the actors each of ``workers`` holds (runs on the scheduler): Dask does
    not retire a worker holding one, whoever's it is.

    Relies on ``Scheduler.workers`` and ``WorkerState.actors``.
    """
    out = {}
    for w in workers:
        ws = dask_scheduler.workers.get(w)
        if ws is not None:
            out[w] = sorted(str(ts.key) for ts in ws.actors)
    return out


def event_wait(client: Any, name: str, timeout: float, answer: float) -> bool:
    """Whether the scheduler ``Event`` ``name`` is set within ``timeout`` seconds (as
    ``Event.wait``), its answer waited for at most ``answer`` seconds more here: Dask's
    ``Event`` bounds only the scheduler's wait, and a scheduler that stopped answering (its
    connection open) held ``DataService.connect`` for ever (a review).  A ``TimeoutError``
    where it did not answer.

    Relies on ``Client.sync`` and the scheduler RPC ``event_wait`` (``Event.wait``'s).
    """
    return bool(client.sync(client.scheduler.event_wait, name=name, timeout=timeout,
                            callback_timeout=timeout + answer))


def event_set(client: Any, name: str, timeout: float, on: bool) -> None:
    """Set (``on``) or clear the scheduler ``Event`` ``name``, its answer waited for at most
    ``timeout`` seconds (a ``TimeoutError`` after: see :func:`event_wait`).

    Relies on ``Client.sync`` and the scheduler RPCs ``event_set``, ``event_clear``.
    """
    rpc = client.scheduler.event_set if on else client.scheduler.event_clear
    client.sync(rpc, name=name, callback_timeout=timeout)


def actor_counts(client: Any, workers: list[str], timeout: float) -> dict[str, int]:
    """How many actors (any client's) each of ``workers`` holds, as the scheduler lists them
    (:func:`actors_on`), asked through the synchronous ``client``; ``{}`` where the scheduler
    does not answer within ``timeout`` (the caller places by address alone).

    Relies on what :func:`actors_on` relies on.
    """
    try:
        held = client.run_on_scheduler(actors_on, workers=list(workers), callback_timeout=timeout)
    except Exception as e:  # noqa: BLE001 - best effort: the placement goes on by address
        _log.warning("msd_dask: could not count the actors on the workers (%r)", e)
        return {}
    return {w: len(keys) for w, keys in held.items()}


def has_client(client_id: str, dask_scheduler: Any = None) -> bool:
    """Whether the client ``client_id`` is connected (runs on the scheduler).

    Relies on ``Scheduler.clients`` (client id -> state): Dask has no call that
    says whether another client is connected; a reader asks whether the process
    that started the service (the only one that can re-create a lost planner) is.
    """
    return client_id in dask_scheduler.clients


async def client_connected(client_id: str) -> bool:
    """Whether the client ``client_id`` is connected, asked of the scheduler from inside a
    worker (an actor's method).  ``True`` where the scheduler cannot be asked, or does not
    answer within :data:`ASK_WAIT` seconds (then nothing is taken from a process that may be
    there; a frozen scheduler held a constructor's claim handler for ever: a review).

    Relies on the scheduler's ``run_function`` handler, which ``Client.run_on_scheduler``
    calls (a pickled function and arguments; the answer ``{"status": "OK", "result"}``),
    reached through the worker's ``scheduler`` RPC, and on :func:`has_client`.
    """
    import pickle

    from distributed import get_worker

    try:
        answer = await asyncio.wait_for(get_worker().scheduler.run_function(
            function=pickle.dumps(has_client), args=pickle.dumps((client_id,)), wait=True),
            ASK_WAIT)
        return bool(answer["result"]) if answer.get("status") == "OK" else True
    except Exception:  # noqa: BLE001 - unknown (or no answer in time): assume it is
        return True


#: seconds an ask of the scheduler waits for its answer, at most (:func:`client_connected`;
#: a link's asks, less where its wait has less left)
ASK_WAIT = 5.0


#: seconds between two looks at the scheduler's workers while an actor bound to one of them
#: (``allow_other_workers=False``) is created: Dask holds it for that worker for ever if
#: the worker leaves first, so a wait for it asks whether the worker is still there
CREATE_CHECK = 1.0

#: seconds a role's ``stats()`` is waited for before it counts as not answering: a call
#: to an actor whose worker was lost waits to connect for Dask's connect timeout (tens of
#: seconds), and a monitor polling the service must not stall while the role is re-created
STATS_WAIT = 3.0

#: the oldest answers of every constructor's ``stats()`` (seconds since they were asked)
#: the owner's checkpoint and the plugin's poll take instead of asking again: each comes
#: once a second, and one round of asks serves both
STATS_SHARED = 1.0


def bound_actor(client: Any, future: Any, worker: str, service: str, role: str,
                timeout: float) -> Any:
    """The actor handle of ``future`` (``role`` of ``service``, placed on ``worker`` only).

    Relies on a task restricted to a worker that left staying ``"pending"`` (Dask
    keeps it for that worker; checked on a real cluster), and on
    :func:`scheduler_workers`.  A timed ``Future.result`` whose wait lapses can raise
    ``UnboundLocalError`` from Dask's ``sync`` on Python 3.11 (``asyncio.wait_for`` lets a
    ``CancelledError`` out at the timeout's edge, which ``sync``'s ``except Exception``
    misses; a CI run's service start failed so): taken as the lapsed wait it is.

    Raises
    ------
    WorkerLeft
        ``worker`` left the cluster before the actor started there (looked at every
        :data:`CREATE_CHECK` seconds).
    TimeoutError
        It did not start within ``timeout`` seconds.
    """
    from msd_dask.errors import WorkerLeft

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return future.result(timeout=max(0.01, min(CREATE_CHECK, left)))
        except (TimeoutError, UnboundLocalError) as e:
            if left <= CREATE_CHECK:
                if isinstance(e, TimeoutError):
                    raise
                raise TimeoutError(f"timed out after {left:.2f} s.") from None
        if future.status != "pending":
            continue
        try:
            there = worker in scheduler_workers(client, CREATE_CHECK * 5)
        except Exception:  # noqa: BLE001 - the scheduler did not answer this look: wait on
            there = True
        if not there:
            raise WorkerLeft(service, role, worker)


def scheduler_workers(client: Any, timeout: float, *, running: bool = False) -> set[str]:
    """The addresses of the workers the scheduler knows now (raises if it does not answer);
    ``running``: only those that run tasks (not paused, e.g. over their memory limit, nor
    being retired: a role placed on one would not start).

    Relies on ``Client.sync`` and the scheduler RPC ``client.scheduler.ncores``:
    ``Client.scheduler_info()`` may answer from the client's cached copy and
    takes no timeout, and the owner must tell a lost worker from an unreachable
    scheduler within ``timeout`` seconds.  ``ncores`` (each worker's threads), not
    ``identity``, which carries every worker's metrics: the scheduler builds them
    and this process reads them at every look.
    """
    rpc = client.scheduler.ncores_running if running else client.scheduler.ncores
    threads = client.sync(rpc, callback_timeout=timeout)
    return set(threads)


def stop_identity_refresh(client: Any) -> None:
    """Stop ``client``'s periodic ``identity`` call to the scheduler; its heartbeat goes on.

    Relies on ``Client._periodic_callbacks["scheduler-info"]``, the periodic callback
    that refreshes the client's copy of the scheduler's identity as often as the client
    heartbeats (the scheduler stretches both with the number of clients).  Without it an
    idle client cost the scheduler 15-53% less (``bench_idle_clients.py``), and a
    service's client (a training process's, a host agent's) never reads the copy: a
    synchronous client's ``scheduler_info()`` and ``dashboard_link`` ask the scheduler
    when called.  Stopped on the client's own event loop (a periodic callback is not
    thread-safe); nothing if Dask has no such callback.  For a client already started (a
    synchronous one is once made): an asynchronous client not awaited yet starts its
    callbacks when awaited.
    """
    callback = getattr(client, "_periodic_callbacks", {}).get("scheduler-info")
    if callback is not None:
        client.loop.add_callback(callback.stop)


def published_datasets(scheduler: Any) -> dict[Any, Any] | None:
    """The datasets published on ``scheduler`` (name -> entry), from inside the scheduler.

    Relies on the publish extension (``Scheduler.extensions["publish"].datasets``):
    a scheduler plugin reads them without a client round trip, and an entry's
    identity tells whether a name was published again since.  ``None`` if the
    extension is missing or changed.
    """
    ext = getattr(scheduler, "extensions", {}).get("publish")
    datasets = getattr(ext, "datasets", None)
    return datasets if isinstance(datasets, dict) else None


def scraped_server() -> Any | None:
    """The Dask server whose ``/metrics`` page prometheus_client is rendering now, if known.

    Relies on ``distributed.http.scheduler.prometheus.core.PrometheusHandler._collectors``:
    each request's handler points Dask's own collectors at its server before it renders
    the process's one registry (several schedulers in one process, embedded clusters say,
    share it).  A collector of msd_dask's reads the same, to report the services of that
    scheduler only.  ``None`` outside such a render: the handler leaves the collectors
    pointing at the last server it rendered, so a read of the registry from a thread
    that runs no event loop (prometheus_client's own HTTP server, a test) or from
    another loop than that server's is none; so is a server closed since; and ``None``
    if Dask changed.
    """
    import asyncio

    try:
        from distributed.http.scheduler.prometheus.core import PrometheusHandler
    except ImportError:  # pragma: no cover - prometheus_client missing
        return None
    collectors = getattr(PrometheusHandler, "_collectors", None) or ()
    server = getattr(collectors[0], "server", None) if collectors else None
    status = getattr(getattr(server, "status", None), "name", None)
    if server is None or status in ("closing", "closed", "failed"):
        return None
    try:  # (the handler renders on its server's event loop)
        running = asyncio.get_running_loop()
    except RuntimeError:
        return None
    loop = getattr(getattr(server, "loop", None), "asyncio_loop", None)
    return server if running is loop else None


def wrap_scheduler_call(scheduler: Any, name: str, wrap: Callable[..., Any]
                        ) -> Callable[[], None]:
    """Route the scheduler's RPC handler ``name`` and its method ``name`` through
    ``wrap(original, *args, **kwargs)``; returns a function that puts both back
    (unless something wrapped them again since).

    Relies on ``Scheduler.handlers`` (the table the scheduler's server dispatches
    RPCs from) and on setting a method on the scheduler instance: Dask has no
    hook on the answers of ``adaptive_target`` and ``workers_to_close``, which
    ``Adaptive`` calls as RPCs and the scheduler (HTTP API, ``retire_workers``)
    as methods.
    """
    hooks = []
    for where in (scheduler.handlers, scheduler):
        original = where[name] if where is scheduler.handlers else getattr(where, name)
        wrapper = _wrapped(wrap, original)
        if where is scheduler.handlers:
            where[name] = wrapper
        else:
            setattr(where, name, wrapper)
        hooks.append((where, original, wrapper))

    def unwrap() -> None:
        for where, original, wrapper in reversed(hooks):
            if isinstance(where, dict):
                if where.get(name) is wrapper:
                    where[name] = original
            elif where.__dict__.get(name) is wrapper:
                del where.__dict__[name]  # back to the class's method
                if getattr(where, name) != original:
                    setattr(where, name, original)

    return unwrap


def _wrapped(wrap: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """``wrap(original, ...)`` under ``original``'s name and signature (Dask's RPC reads both)."""
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return wrap(original, *args, **kwargs)

    return wrapper
