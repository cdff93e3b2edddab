"""The public face of a running service: :class:`DataService` (a rank's
:class:`~msd_dask.reader.Reader` lives in :mod:`msd_dask.reader`).

``DataService.start`` has a worker list every source's units
(:mod:`msd_dask.sources.discover`), places the planner on the cluster
(:mod:`msd_dask.service.placement`; it creates the constructors and loaders) and
publishes the handles under ``msd-<name>`` on the scheduler, so that any
process can ``DataService.connect(address, name)`` and read a rank's batches.

The planner re-creates lost loaders and constructors itself; the process
that started the service (``owner``) re-creates a lost planner
(:mod:`msd_dask.service.recovery`).  Every handle reads through a
:class:`~msd_dask.service.link.PlannerLink`, which follows the planner to its
successor (docs/resume.md).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal, overload

from msd_dask.batch import is_seconds, is_whole, reader_state, step_number
from msd_dask.core.config import Config, parse_config
from msd_dask.core.figures import rank_figures, source_figures
from msd_dask.dask_internals import (
    actor_address,
    actors_on,
    bound_actor,
    keys_on,
    stop_identity_refresh,
)
from msd_dask.errors import (
    CLOSED_BY_OWNER,
    STOPPED,
    ServiceError,
    ServiceTimeoutError,
    WorkerLeft,
    first_of,
)
from msd_dask.reader import REPORT_IDLE, Reader
from msd_dask.service.agent_client import AgentHandle, connect_agent
from msd_dask.service.link import PlannerLink
from msd_dask.service.placement import (
    REGISTRY_PREFIX,
    ROLES_PREFIX,
    forget_keys,
    place_planner,
    published_event,
)
from msd_dask.service.recovery import (
    PlannerKeeper,
    close_roles_everywhere,
    unanswered_workers,
)
from msd_dask.sources.discover import anchored_config, discover_remote

__all__ = ["DataService"]

_log = logging.getLogger("msd_dask.service")

#: what a reader of a handle closed by a process other than the owner raises
HANDLE_CLOSED = "this process's handle on it was closed (DataService.close)"

#: Dask settings of the embedded cluster (:meth:`DataService.start` without ``address``).
#: Its workers run the service's actors only, and Dask's periodic callbacks (a stack
#: sample of the task threads every 10 ms, an event-loop tick every 20 ms, a memory
#: check every 100 ms, in every worker, nanny and the scheduler) cost CPU in every
#: process whether it works or not; these intervals cut that cost about fivefold
#: (docs/deployment.md).  Blocked-loop warnings and memory limits still work, at this
#: resolution.  Each worker's nanny also starts it with ``MALLOC_ARENA_MAX=2``: glibc's
#: heap in two arenas shared by every thread (loaders read on threads of their own),
#: about 12 MiB less per worker (docs/deployment.md, the C heap's arenas).
EMBEDDED_DASK_CONFIG: dict[str, Any] = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "200ms",
    "distributed.worker.memory.monitor-interval": "500ms",
    "distributed.nanny.pre-spawn-environ.MALLOC_ARENA_MAX": 2,
}


def _install_plugin(client: Any) -> None:
    """Install :class:`~msd_dask.plugin.scheduler.MsdSchedulerPlugin` unless the scheduler has it."""
    from msd_dask.plugin.scheduler import MsdSchedulerPlugin

    def has(dask_scheduler: Any) -> bool:
        return MsdSchedulerPlugin.name in dask_scheduler.plugins

    try:
        if not client.run_on_scheduler(has):
            client.register_plugin(MsdSchedulerPlugin())
    except Exception as e:  # noqa: BLE001 - the service runs without its dashboard page
        _log.warning("msd_dask: could not install the scheduler plugin: %r", e)


#: seconds :meth:`DataService.close` waits for the scheduler to unpublish the service
CLOSE_WAIT = 10.0

#: seconds the owner's :meth:`DataService.close` waits for its client to reconnect before it
#: closes the roles (else it says how to stop the service)
RECONNECT_WAIT = 5.0

#: seconds a handle's ask of the scheduler waits (its workers, their actors, its
#: dashboard), then raises :class:`ServiceTimeoutError` naming what it asked
SCHEDULER_ASK = 10.0


def _close_service(client: Any, name: str, planner: Any, planner_key: Any,
                   pinned: list[Any] | None, sources: list[str] | None = None,
                   notice: str = CLOSED_BY_OWNER, timeout: float = 30.0) -> list[str]:
    """Close service ``name``'s roles, unpublish it and make Dask forget its keys: the
    owner's close (:meth:`DataService.close`) and :meth:`DataService.stop`.  ``notice``:
    what its readers are told (:data:`~msd_dask.errors.CLOSED_NOTICES`).

    ``planner``: its planner's actor handle (None: not reachable), which closes the roles
    it knows; ``pinned``: the role keys the owner's keeper published (None: none
    published); ``sources``: where given, the roles of the service left on any worker are
    closed by name as well (:func:`~msd_dask.service.recovery.close_roles_everywhere`:
    a planner lost with its worker closes nothing).  ``timeout``: the most the roles' close
    waits (at least 5 s for the workers' answers).  Returns the workers whose roles may
    stay open (they did not answer), each logged: a frozen planner's or worker's close was
    given up without a word, and took up to 70 s (a review).
    """
    keys: list[Any] = [*(pinned or ()), planner_key]
    open_on: list[str] = []
    deadline = time.monotonic() + timeout
    if planner is not None:
        where = actor_address(planner) or "?"
        try:
            keys += planner.role_keys().result(timeout=min(10.0, timeout))
        except Exception:  # noqa: BLE001 - best effort: the pinned keys still go
            pass
        try:  # (its own try: a role_keys that failed skipped the close and its notice)
            planner.close_roles(notice).result(timeout=max(1.0, deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - the name and the pinned keys still go
            # ("within 30s" said of a planner lost with its worker, which raised at once)
            why = (f"within {timeout:g}s" if isinstance(e, TimeoutError) else
                   f"({type(e).__name__}: {e})")
            _log.warning("msd_dask %s: its planner on %s did not close its roles %s: they may "
                         "stay open until their workers go%s", name, where, why,
                         "; closing them by name" if sources is not None else "")
            open_on.append(where)
    if sources is not None:
        try:
            left = max(5.0, deadline - time.monotonic())
            open_on = unanswered_workers(close_roles_everywhere(client, name, sources, left))
        except Exception as e:  # noqa: BLE001 - the name still goes: said, not raised
            _log.warning("msd_dask %s: could not look for its roles on every worker: %r",
                         name, e)
        else:
            if open_on:
                _log.warning("msd_dask %s: worker(s) %s did not close its roles within %gs: "
                             "they may stay open until those workers go", name,
                             first_of(open_on, 8), left)

    def on_scheduler() -> None:
        published_event(client, name).clear(CLOSE_WAIT)
        client.unpublish_dataset(REGISTRY_PREFIX + name)
        if pinned is not None:
            client.unpublish_dataset(ROLES_PREFIX + name)
        forget_keys(client, name, keys)

    # a scheduler that does not answer (frozen, its event loop blocked) keeps its TCP
    # connection, so these calls would wait for ever: in a thread, waited for a while
    failed: list[BaseException] = []
    done = threading.Thread(target=_catching(on_scheduler, failed), daemon=True,
                            name=f"msd-dask close {name}")
    try:
        done.start()
    except RuntimeError:  # (Python 3.12.0-1 start no thread at exit: the close at exit)
        _catching(on_scheduler, failed)()
    else:
        done.join(CLOSE_WAIT)
    if done.is_alive() or failed:
        # (its calls are bounded too: one that lapsed is the same silence, said so)
        silent = not failed or isinstance(failed[0], TimeoutError)
        why = f"did not answer within {CLOSE_WAIT:g}s" if silent else f"failed: {failed[0]!r}"
        _log.warning("msd_dask %s: the scheduler %s while the service closed: its name may "
                     "stay published until the scheduler restarts", name, why)
    return open_on


def _running_services(client: Any, timeout: float) -> list[str]:
    """The names of the services published on ``client``'s scheduler (a ``TimeoutError``
    where it does not answer within ``timeout`` seconds)."""
    return [str(d)[len(REGISTRY_PREFIX):] for d in client.list_datasets(callback_timeout=timeout)
            if str(d).startswith(REGISTRY_PREFIX)]


def _catching(fn: Callable[[], None], failed: list[BaseException]) -> Callable[[], None]:
    """``fn``, which appends what it raised to ``failed`` instead of raising (in a thread)."""
    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - reported by the thread's waiter
            failed.append(e)
    return run


@contextmanager
def _planner_within(name: str, what: str, timeout: float) -> Iterator[None]:
    """Turn a wait on service ``name``'s new planner that ran out into a
    :class:`ServiceTimeoutError` saying what it waited for."""
    try:
        yield
    except TimeoutError as e:
        raise ServiceTimeoutError(
            f"the planner of service {name!r} did not {what} within {timeout:.0f}s (its "
            "worker may be paused, e.g. over its memory limit, or overloaded: see the "
            "worker's log)") from e


#: seconds a start that failed waits for its planner to close the roles it made
UNSTARTED_CLOSE_WAIT = 30.0


def _close_unstarted(name: str, planner: Any, future: Any) -> None:
    """Close the roles of service ``name``'s new ``planner``, whose setup failed, and
    release its ``future`` (best effort: a failure is logged, the caller raises its own)."""
    try:
        planner.close_roles().result(timeout=UNSTARTED_CLOSE_WAIT)
    except TimeoutError:
        _log.warning("msd_dask %s: the planner whose setup failed did not close its roles "
                     "within %.0fs: those it made may stay open on their workers", name,
                     UNSTARTED_CLOSE_WAIT)
    except Exception as e:  # noqa: BLE001 - its worker may be the trouble: said, not raised
        _log.warning("msd_dask %s: the planner whose setup failed could not close its "
                     "roles: %r", name, e)
    finally:
        future.release()


def _seconds(call: str, name: str, value: Any, zero: bool = False) -> float:
    """``value``, the argument ``name`` of ``DataService.<call>``, as seconds: a finite
    number > 0 (>= 0 where ``zero``), else a ``ValueError`` naming it (a string reached
    Dask's time parser, whose ``KeyError`` named no argument; a review)."""
    if not is_seconds(value, zero):
        raise ValueError(f"DataService.{call}: {name} must be a finite number of seconds "
                         f"{'>=' if zero else '>'} 0, got {value!r}")
    return float(value)


def _client(address: str, timeout: float, security: Any) -> Any:
    """A service's client of the scheduler at ``address`` (each training process, or each
    host's agent, has one): talking to the workers directly, without the periodic
    ``identity`` call of every Dask client, 15-53% of its idle cost to the scheduler
    (:func:`~msd_dask.dask_internals.stop_identity_refresh`)."""
    from distributed import Client
    from distributed.comm import CommClosedError

    try:
        client = Client(address, direct_to_workers=True, timeout=timeout, security=security)
    except OSError as e:  # (Dask's own named neither what could not be reached nor why)
        if isinstance(e, CommClosedError) and not str(address).startswith(("tls://", "wss://")):
            # (a TLS scheduler closes a plain connection: "Connection reset by peer", with
            # no word of TLS; a review)
            raise ServiceError(f"the scheduler at {address} closed the connection ({e}): if it "
                               "uses TLS, give its tls://... address and credentials "
                               "(security=, CLI: --tls-ca-file, --tls-cert, --tls-key)") from e
        if isinstance(e, ServiceTimeoutError) or not (
                isinstance(e, TimeoutError) or str(e).startswith("Timed out trying to connect")):
            raise
        raise ServiceTimeoutError(f"the scheduler at {address} could not be reached: {e} (is "
                                  "it running, and is the address right?)") from e
    stop_identity_refresh(client)
    return client


#: seconds a handle dropped without close() waits for its dropped readers' reports, then
#: for its client to close (:func:`_close_dropped`)
DROPPED_CLOSE_TIMEOUT = 5.0


def _close_dropped(client: Any, name: str, reports: list[Any]) -> None:
    """Close the client of a handle of service ``name`` garbage-collected without
    :meth:`DataService.close`, in a thread of its own: a finalizer runs on whatever thread
    dropped the handle, holding whatever locks it held, and that may be the client's own
    IO loop thread, where a synchronous close would wait on the loop it blocks.  Best
    effort, each wait bounded by :data:`DROPPED_CLOSE_TIMEOUT`."""
    try:
        threading.Thread(target=_close_client, args=(client, name, reports),
                         name=f"msd-{name}-close-dropped", daemon=True).start()
    except RuntimeError:  # (no new thread at interpreter shutdown: Dask closes its clients)
        pass


def _close_client(client: Any, name: str, reports: list[Any]) -> None:
    import concurrent.futures

    # the last steps of the readers dropped with the handle (Reader.REPORT_WHEN_DROPPED)
    # are on their way through this client: let them arrive first
    pending = [f for f in list(reports) if isinstance(f, concurrent.futures.Future)]
    if pending:
        concurrent.futures.wait(pending, timeout=DROPPED_CLOSE_TIMEOUT)
    try:
        client.close(timeout=DROPPED_CLOSE_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - best effort: said, not raised
        _log.debug("msd_dask %s: closing the client of a dropped handle failed: %r", name, e)


def _check_tls(address: str | None, security: Any) -> None:
    """Refuse TLS settings that do not fit the scheduler's ``address``, each with a message
    that says what to give: a ``tls://`` address without credentials, credentials that
    require encryption with another address (a bare Dask ``RuntimeError``, "encryption
    required by Dask configuration"), or a ``Security`` with no client certificate (a
    ``TypeError`` about an ``ssl_context``; a review)."""
    if not address:
        return
    from distributed.comm.addressing import parse_address
    from distributed.security import Security

    # (a dict, as Dask's Client takes one: Security's arguments)
    given = (Security(**security) if isinstance(security, Mapping)
             else security if security is not None else Security())
    # (the scheme Dask takes: a bare address is distributed.comm.default-scheme's)
    scheme = parse_address(str(address))[0]
    if scheme == "tcp" and getattr(given, "require_encryption", False):
        # (Dask refuses a plain TCP connection then; inproc:// and the others it does not)
        what = ("the TLS credentials given require" if security is not None else
                "Dask's config (distributed.comm.require-encryption) requires")
        raise ServiceError(f"scheduler {address}: {what} an encrypted connection: give the "
                           "scheduler's tls://... address (dask scheduler prints it)")
    if scheme not in ("tls", "wss"):
        return
    if given.get_connection_args("client").get("ssl_context") is None:
        if security is None:
            raise ServiceError(f"scheduler {address} uses TLS but no credentials were given: "
                               "pass security=distributed.security.Security(...) (CLI: "
                               "--tls-ca-file, --tls-cert, --tls-key) or set "
                               "distributed.comm.tls.* in Dask's config")
        raise ServiceError(f"scheduler {address} uses TLS but the security given has no client "
                           "certificate: pass tls_client_cert and tls_client_key (CLI: "
                           "--tls-cert, --tls-key)")


def _check_embedded_tls(security: Any) -> None:
    """Refuse TLS settings an embedded cluster cannot start with: its scheduler and workers
    need certificates of their own, and a client's alone failed deep in Dask ("Cluster
    failed to start", or a TypeError about an ssl_context; a review)."""
    if security is None or not getattr(security, "require_encryption", True):
        return
    missing = [name for name in ("tls_scheduler_cert", "tls_worker_cert")
               if not getattr(security, name, None)]
    if missing:
        raise ServiceError(
            f"an embedded cluster with TLS needs certificates for its scheduler and workers "
            f"too ({', '.join(missing)} not given): pass Security(tls_ca_file=..., "
            "tls_scheduler_cert=..., tls_scheduler_key=..., tls_worker_cert=..., "
            "tls_worker_key=..., tls_client_cert=..., tls_client_key=...), or start it "
            "without security: its scheduler listens on 127.0.0.1 only")


def _embedded_cluster(n_workers: int, threads_per_worker: int, security: Any,
                      cfg: Config | None = None) -> Any:
    """A ``LocalCluster`` for :meth:`DataService.start` without an address; its workers
    are not daemonic where a source preprocesses in a pool of processes (a daemonic
    process cannot start any: ``msd-dask run`` of such a config failed).  Its scheduler
    and dashboard listen on 127.0.0.1 only (the dashboard listened on every address,
    over plain HTTP even with TLS; a review)."""
    import dask
    from distributed import LocalCluster

    _check_embedded_tls(security)
    settings = dict(EMBEDDED_DASK_CONFIG)
    if cfg is not None and any(s.pool.kind == "process" for s in cfg.sources):
        settings["distributed.worker.daemon"] = False
    with dask.config.set(settings), _sigint_ignored():  # the workers start inside
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                            processes=True, dashboard_address="127.0.0.1:0", security=security,
                            **({"protocol": "tls://"} if security is not None else {}))


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while the embedded cluster's processes start, which inherit that:
    a terminal's Ctrl-C reaches its whole process group, and each worker process then
    printed a traceback of its own while this process closed the cluster anyway (a
    review of the command line).  Only in the main thread (where signals are set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


#: the upper bound of what a rank returned that no constructor knows (see
#: :meth:`DataService.consumed_step`)
_UNKNOWN = 2**62


#: this process's handles not closed yet (an owner closing its embedded cluster closes the
#: others on it)
_OPEN: weakref.WeakSet[DataService] = weakref.WeakSet()


class DataService:
    """A handle on a running msd_dask service.

    Use :meth:`start` to launch one and :meth:`connect` to attach to one from a
    training process.  Also a context manager: leaving it calls :meth:`close`.
    """

    #: seconds between two checks of the planner by the owner
    watch_interval = 1.0

    def __init__(self, client: Any, cfg: Config, registry: dict[str, Any], *,
                 owner: bool = False, cluster: Any = None):
        self.client = client
        self.config = cfg
        self.name = cfg.name
        #: the current planner generation's handles, shared with this handle's readers
        self.link = PlannerLink(client, cfg, registry, owner=owner)
        #: the owner's keeper of the planner (checkpoints, re-creation); None elsewhere
        self.keeper: PlannerKeeper | None = None
        self._cluster = cluster
        self._closed = False
        #: this process's readers (counted by :meth:`consumed_step`)
        self._readers: weakref.WeakSet[Reader] = weakref.WeakSet()
        #: rank -> the last step this handle's readers of it returned (or loaded)
        self._returned: dict[int, int] = {}
        #: the owner's process, whose exit closes the service (:meth:`_close_at_exit`)
        self._exit_pid: int | None = None
        #: the reports of this handle's readers dropped without close(), which a handle
        #: dropped with them waits for before closing its client (:func:`_close_dropped`)
        self._dropped_reports: list[Any] = []
        #: closes the client once this handle is garbage-collected without close(), for a
        #: handle that owns its client but not the service (:meth:`connect`)
        self._finalizer: weakref.finalize | None = None
        self.refresh()
        _OPEN.add(self)

    @property
    def address(self) -> str:
        """The address of the scheduler the service runs on (for :meth:`connect` from other
        processes; with :meth:`start` without one, its embedded cluster's)."""
        # (recorded by the link: a closed client has no scheduler, and the property raised
        # AttributeError after close; a review)
        return self.link.scheduler_address

    @property
    def planner(self) -> Any:
        """The current planner's actor handle."""
        return self.link.planner

    @property
    def generation(self) -> int:
        """The planner's generation: 0, then one more each time a lost one is re-created."""
        return self.link.generation

    @property
    def constructors(self) -> list[Any]:
        """The current constructors' actor handles (see :meth:`refresh`)."""
        return self.link.constructors

    def refresh(self) -> None:
        """Fetch the current constructor handles (they change when a role is re-created).

        If the planner does not answer, switch to the one the service re-created
        after losing it (see :meth:`PlannerLink.refresh`).
        """
        self.link.refresh()

    # ----------------------------------------------------------------- start
    @classmethod
    def start(cls, cfg: Config | Mapping[str, Any] | str, address: str | None = None, *,
              resume: Mapping[str, Any] | None = None, n_workers: int = 2,
              threads_per_worker: int = 2, loader_threads: int = 1,
              timeout: float | None = None, security: Any = None) -> DataService:
        """Start a service.

        Parameters
        ----------
        cfg : Config, mapping or str
            The configuration (see :func:`~msd_dask.load_config`).
        address : str, optional
            A running Dask scheduler; ``None`` starts an embedded ``LocalCluster``.
        resume : dict, optional
            A :meth:`state_dict` to continue from: the first step served is the one
            after the state's ``step``.  Refused (:class:`ServiceError`) if it was taken
            with another seed, ``seq_len`` or set of sources.
        n_workers, threads_per_worker : int
            Size of the embedded cluster (ignored with ``address``).
        loader_threads : int
            Read threads per source loader.
        timeout : float, optional
            How long to wait for workers (default: the config's ``timeout``).
        security : distributed.security.Security, optional
            TLS settings of the cluster (the embedded one is started with them).
            Roles talk to each other through Dask's own comms, so they use the
            same TLS; every process that connects must pass its own.

        Returns
        -------
        DataService

        Raises
        ------
        ConfigError
            The config is invalid, or a source's ``uri`` matches no file.  The
            files are checked and their units listed on a worker (within the
            config's ``timeout``), so this process never imports the formats'
            libraries; a relative local ``uri`` is taken from this process's
            working directory.
        DataError
            A file's units cannot be listed (its source does not skip bad input).
        ServiceTimeoutError
            No worker joined within ``timeout``, or the listing did not finish
            within the config's ``timeout``.
        """
        from msd_dask.roles.planner import planner_state

        # a worker checks and lists the files, in its own working directory
        cfg = anchored_config(parse_config(cfg))
        if resume is not None:
            # refuse a mismatched state before starting (a list, say: not a state at all)
            planner_state(cfg, dict(resume) if isinstance(resume, Mapping) else resume)
        timeout = cfg.timeout if timeout is None else _seconds("start", "timeout", timeout)
        # (n_workers=0 waited the whole timeout for a worker of an embedded cluster nobody
        # can join; loader_threads=None raised int()'s words; a review)
        for arg, value in (("loader_threads", loader_threads),
                           *((("n_workers", n_workers), ("threads_per_worker", threads_per_worker))
                             if address is None else ())):
            if not is_whole(value) or value < 1:
                raise ValueError(f"DataService.start: {arg} must be a whole number >= 1, "
                                 f"got {value!r}")
        cluster = None
        if address is None:
            cluster = _embedded_cluster(n_workers, threads_per_worker, security, cfg)
            address = cluster.scheduler_address
        client = None
        try:  # (a client that failed to connect left the embedded cluster running; a review)
            _check_tls(address, security)
            client = _client(address, timeout, security)
            return cls._start_on(client, cfg, address, resume=resume, cluster=cluster,
                                 loader_threads=loader_threads, timeout=timeout)
        except BaseException as e:
            if client is not None:
                client.close()
            if cluster is not None:
                cluster.close()
            if isinstance(e, TimeoutError) and not isinstance(e, ServiceTimeoutError):
                # (the scheduler's calls here wait at most the timeout: one that stopped
                # answering held the start for ever; a review)
                raise ServiceTimeoutError(f"service {cfg.name!r}: the scheduler at {address} "
                                          f"did not answer within {timeout:g}s while the "
                                          f"service started ({e or 'timed out'})") from e
            raise

    @classmethod
    def _start_on(cls, client: Any, cfg: Config, address: str, *,
                  resume: Mapping[str, Any] | None, cluster: Any, loader_threads: int,
                  timeout: float) -> DataService:
        """:meth:`start` once ``client`` is connected: list the units, place the planner,
        publish its registry and watch it."""
        from msd_dask.roles.planner import planner_state, resume_notes

        key = REGISTRY_PREFIX + cfg.name
        if key in client.list_datasets(callback_timeout=timeout):
            raise ServiceError(f"a service named {cfg.name!r} is already running on "
                               f"{address}; pick another 'name' or close it first (from the "
                               "process that started it; if that process is gone: msd-dask "
                               f"stop {cfg.name} --scheduler {address})")
        try:
            try:
                client.wait_for_workers(1, timeout=min(2.0, timeout))
            except TimeoutError:
                if timeout <= 2.0:
                    raise
                # (said, not minutes of silence: a new cluster's workers may be on their way)
                _log.warning("msd_dask %s: waiting up to %.0fs for a Dask worker to join the "
                             "scheduler at %s (start some: dask worker %s)", cfg.name, timeout,
                             address, address)
                client.wait_for_workers(1, timeout=timeout - 2.0)
        except TimeoutError:
            raise ServiceTimeoutError(
                f"no Dask worker joined the scheduler at {address} within {timeout:.0f}s: "
                f"service {cfg.name!r} lists its sources' units and places its roles on "
                f"workers; start some (dask worker {address})") from None
        units, roots, quarantined = discover_remote(client, cfg, cfg.timeout)
        if resume is not None:  # (as listed now: the files may differ from the state's)
            planner_state(cfg, dict(resume), {k: len(v) for k, v in units.items()})
            for note in resume_notes(cfg, dict(resume)):
                _log.warning("service %r: %s", cfg.name, note)
        while True:
            registry = place_planner(client, cfg, units, roots, resume, loader_threads)
            try:
                with _planner_within(cfg.name, "start", timeout):
                    planner = bound_actor(client, registry["planner"], registry["planner_worker"],
                                          cfg.name, "the planner", timeout)
                break
            except WorkerLeft as e:  # placed again, on a worker still there
                registry["planner"].release()
                _log.warning("%s; placing it again", e)
        registry["quarantined"] = quarantined
        registry["owner"] = client.id
        try:
            with _planner_within(cfg.name, "set up", timeout):
                planner.setup().result(timeout=timeout)
            client.publish_dataset(registry, name=key, callback_timeout=timeout)
        except BaseException:
            # a setup that failed part-way (a worker that left, a timeout) leaves the roles
            # it made open on their workers: nothing else knows them
            _close_unstarted(cfg.name, planner, registry["planner"])
            raise
        svc = None
        try:  # from here, a failure (or Ctrl-C) leaves nothing published or running
            published_event(client, cfg.name).set(timeout)
            svc = cls(client, cfg, registry, owner=True, cluster=cluster)
            svc.keeper = PlannerKeeper(
                svc.link, {"units": units, "roots": roots, "loader_threads": loader_threads,
                           "resume": dict(resume) if resume else None},
                interval=svc.watch_interval)
            _install_plugin(client)
            with _planner_within(cfg.name, "start planning", timeout):
                svc.planner.start().result(timeout=timeout)
            svc.keeper.start()
            # (after the client: atexit runs the last registered first, so the roles close
            # while the client still runs)
            svc._exit_pid = os.getpid()
            atexit.register(svc._close_at_exit)
        except BaseException:
            if svc is not None:
                svc.close()  # (the roles closed, the service unpublished)
            else:
                # (the handle's own making failed, its first look timed out or Ctrl-C: the
                # planner's roles stayed open and its key held; a review)
                _close_unstarted(cfg.name, planner, registry["planner"])
                published_event(client, cfg.name).clear(timeout)
                client.unpublish_dataset(key, callback_timeout=timeout)
            raise
        return svc

    @overload
    @classmethod
    def connect(cls, address: str, name: str, *, timeout: float = 30.0,
                security: Any = None, agent: Literal[False],
                wait: float | None = None) -> DataService: ...

    @overload
    @classmethod
    def connect(cls, address: str, name: str, *, timeout: float = 30.0,
                security: Any = None, agent: str | bool | None = None,
                wait: float | None = None) -> DataService | AgentHandle: ...

    @classmethod
    def connect(cls, address: str, name: str, *, timeout: float = 30.0,
                security: Any = None, agent: str | bool | None = None,
                wait: float | None = None) -> DataService | AgentHandle:
        """Attach to the running service ``name`` on the scheduler at ``address``.

        Parameters
        ----------
        address : str
            The Dask scheduler the service runs on.
        name : str
            The service's ``name``.
        timeout : float
            Seconds to wait for the scheduler and, unless ``wait`` says otherwise, for the
            service to appear (through an agent: for the agent to answer).
        security : distributed.security.Security, optional
            TLS settings of the cluster.
        agent : str or bool, optional
            Read through the host's ``msd-dask agent`` (docs/deployment.md): its socket
            path, ``True`` for the default path of ``name``
            (:func:`~msd_dask.service.agent_client.default_socket`), ``False`` to connect
            directly whatever the environment says.  Default: the agent whose socket the
            environment variable ``MSD_DASK_AGENT`` names, if set; else directly.
        wait : float, optional
            Directly: seconds to wait for service ``name`` once connected to the
            scheduler (readers started before their service wait for it); ``0``: it must
            be running already, else the error names the services that are (what
            ``msd-dask stats`` and ``set-weights`` do).  Default: ``timeout``.

        Returns
        -------
        DataService or AgentHandle
            Directly: a handle with its own Dask client, which :meth:`close` closes; a
            handle garbage-collected without it (a training loop that raised, say) closes
            it too, once its readers are gone as well (each keeps its handle alive).
            Through an agent: an
            :class:`~msd_dask.service.agent_client.AgentHandle` (no Dask client in this
            process) whose :meth:`~msd_dask.service.agent_client.AgentHandle.reader` gives
            readers with the API of :class:`~msd_dask.reader.Reader`.

        Raises
        ------
        ServiceError
            No service ``name`` within ``wait``; through an agent, no agent answers
            at its socket, or it serves another service.
        ValueError
            No ``address`` (directly).
        """
        timeout = _seconds("connect", "timeout", timeout)
        if wait is not None:
            wait = _seconds("connect", "wait", wait, zero=True)
        handle = connect_agent(name, agent, timeout=timeout)
        if handle is not None:
            return handle
        if not address:  # (a Client of None starts a cluster of its own: no service there)
            raise ValueError(f"DataService.connect(address, {name!r}): no scheduler address; "
                             "a service started without one runs on an embedded cluster, "
                             "whose address is its handle's .address")
        _check_tls(address, security)
        client = _client(address, timeout, security)
        try:
            registry = cls._published_registry(client, address, name,
                                               timeout if wait is None else wait, timeout)
            svc = cls(client, parse_config(registry["config"]), registry)
        except BaseException:  # (a planner lost with its owner, say): no client left open
            client.close()
            raise
        # a handle dropped without close() (the training loop raised, say) would leave its
        # client connected until the process exits: the scheduler's per-client cost, a
        # socket, heartbeats, an IO thread.  (The finalizer holds the client, not the
        # handle, which it would keep alive; close() detaches it.)
        svc._finalizer = weakref.finalize(svc, _close_dropped, client, name,
                                          svc._dropped_reports)
        svc._finalizer.atexit = False  # (at exit Dask closes its clients itself)
        return svc

    @classmethod
    def stop(cls, address: str, name: str, *, timeout: float = 30.0,
             security: Any = None) -> list[str]:
        """Stop service ``name`` whose starting process is gone: close its roles, free its
        workers and its name.

        A service lives as long as the process that started it (:meth:`start`, ``msd-dask
        serve``), which closes it when it closes or exits.  One killed (``SIGKILL``, a
        ``SIGTERM`` nothing handles, its node lost) leaves the service published, its
        roles on their workers and its name taken; this stops it (``msd-dask stop NAME
        --scheduler ADDRESS``).  Its readers then raise
        :class:`~msd_dask.errors.ServiceError`.  A process of the owner that was only out
        of reach and comes back does not re-create it (its keeper finds the service no
        longer published as its own).

        Parameters
        ----------
        address : str
            The Dask scheduler the service runs on.
        name : str
            The service's ``name``.
        timeout : float
            Seconds to wait for the scheduler, and for the roles' close.
        security : distributed.security.Security, optional
            TLS settings of the cluster.

        Returns
        -------
        list of str
            The workers that did not answer the close of their roles (a frozen one): the
            service's roles there may stay open until they go (logged too).

        Raises
        ------
        ServiceError
            No service ``name`` on the scheduler, or the process that started it is still
            connected (close it there: it would re-create what this closes).
        """
        from msd_dask.dask_internals import bind_actor, has_client

        timeout = _seconds("stop", "timeout", timeout)
        _check_tls(address, security)
        client = _client(address, timeout, security)
        try:
            registry = client.get_dataset(REGISTRY_PREFIX + name, default=None,
                                          callback_timeout=timeout)
            if registry is None:
                raise ServiceError(f"no service named {name!r} on {address} (running: "
                                   f"{_running_services(client, timeout) or 'none'})")
            owner = registry.get("owner")
            if owner is not None and client.run_on_scheduler(has_client, owner,
                                                             callback_timeout=timeout):
                raise ServiceError(
                    f"service {name!r}: the process that started it is still connected to "
                    f"{address} (client {owner}); close it there (DataService.close(), or "
                    "stop its msd-dask serve with Ctrl-C): its keeper would re-create what "
                    "a stop from elsewhere closes")
            cfg = parse_config(registry["config"])
            pinned = client.get_dataset(ROLES_PREFIX + name, default=None,
                                        callback_timeout=timeout)
            try:  # (a planner lost with its worker: not waited for long)
                planner = bind_actor(registry["planner"].result(timeout=min(timeout, 10.0)),
                                     client)
            except Exception:  # noqa: BLE001 - lost with its worker: its roles by name
                planner = None
            open_on = _close_service(client, name, planner, registry["planner"].key,
                                     None if pinned is None else [f.key for f in pinned],
                                     [s.name for s in cfg.sources], STOPPED, timeout)
            _log.warning("msd_dask %s: stopped on %s", name, address)
            return open_on
        finally:
            client.close()

    @staticmethod
    def _published_registry(client: Any, address: str, name: str, timeout: float,
                            answer: float) -> dict[str, Any]:
        """The registry service ``name`` published, once it is (``ServiceError`` after
        ``timeout`` seconds; :class:`ServiceTimeoutError` where the scheduler does not
        answer a call within ``answer`` seconds: each call, the wait on the published event
        too, ran with no end on this side, and a scheduler that stopped answering held
        every rank's connect for ever; a review)."""
        key = REGISTRY_PREFIX + name
        published = published_event(client, name)
        deadline = time.monotonic() + timeout
        was_set = False
        try:
            while (registry := client.get_dataset(key, default=None,
                                                  callback_timeout=answer)) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    after = f" after {timeout:.0f}s" if timeout > 0 else ""
                    running = _running_services(client, answer)
                    raise ServiceError(f"no service named {name!r} on {address}{after} "
                                       f"(running: {running or 'none'})")
                # one call the scheduler answers when the service is published (or at the
                # deadline); set twice in a row and still not published: the service is
                # closing, look again in a second
                if published.wait(left, answer):
                    if was_set:
                        time.sleep(min(1.0, left))
                    was_set = True
        except TimeoutError as e:
            raise ServiceTimeoutError(f"the scheduler at {address} did not answer within "
                                      f"{answer:g}s while service {name!r} was looked for "
                                      "(overloaded or frozen?)") from e
        return dict(registry)

    # --------------------------------------------------------------- readers
    def reader(self, rank: int, *, timeout: float | None = None) -> Reader:
        """An iterator over the batches of global ``rank``.

        A rank's second reader from this handle starts after the last step the first
        returned (or the state it loaded), as if that state were loaded: its constructor
        sends it again the steps of the last round the first held unread.  A reader with
        no state of a rank whose earlier reader (in another process, say) had steps is
        refused: load the state of the last step the rank returned
        (:meth:`~msd_dask.reader.Reader.load_state_dict`, docs/resume.md).

        Parameters
        ----------
        rank : int
            A global rank of the service's mesh (``0 <= rank < world_size``).
        timeout : float, optional
            Seconds the reader waits for a step before it raises
            :class:`~msd_dask.errors.ServiceTimeoutError` (default: the config's ``timeout``).

        Raises
        ------
        ValueError
            A rank outside the mesh, or a timeout that is not a number > 0.
        ServiceError
            The handle is closed.
        """
        self.link.check_open()  # (a closed handle's reader failed at its first step only)
        reader = Reader(self.link, rank, ledger=self._returned, reports=self._dropped_reports,
                        timeout=self.config.timeout if timeout is None else timeout)
        # (the reader keeps this handle, and so its client, alive: a handle dropped with a
        # reader in use, `DataService.connect(...).reader(rank)`, is not closed under it)
        reader.handle = self
        last = self._returned.get(rank, -1)
        if last >= 0:
            reader.load_state_dict(reader_state(rank, last, self.name))
        self._readers.add(reader)
        return reader

    # ------------------------------------------------------------ operations
    def set_weights(self, weights: Mapping[str, float], from_step: int | None = None) -> int:
        """Change the mix; returns the first step planned with the new weights.

        In the process that started the service, the planner's checkpoint the owner keeps
        (what a re-created planner starts from) has the change once this returns, unless
        the planner does not send its checkpoint in time (a warning says so; the owner's
        next check, a second later, keeps it); a change made elsewhere reaches it within
        the owner's next check (a second).

        Parameters
        ----------
        weights : mapping
            ``{source: weight}``, finite numbers >= 0 summing to more than 0; a source not
            named gets weight 0.
        from_step : int, optional
            The first step planned with them (default, or a step planned already: the next
            step the planner plans).

        Raises
        ------
        ValueError
            A source the service does not have, a weight that is not a finite number >= 0,
            weights summing to 0, or a ``from_step`` that is not an integer.
        ServiceError, ServiceTimeoutError
            The handle is closed, or the planner did not answer within the config's
            ``timeout``.
        """
        given = dict(weights) if isinstance(weights, Mapping) else weights
        at = from_step

        def apply() -> int:
            nonlocal at
            at = int(self.link.call(lambda p: p.set_weights(given, at), "set_weights()"))
            return at  # (applied again, from the same step)

        return self._applied(apply, lambda start: f"weights {given} from step {start}")

    def _applied(self, apply: Callable[[], int], change: Callable[[int], str]) -> int:
        """``apply()``, a change the planner makes (its answer returned), kept for a
        re-created planner (:meth:`_keep_applied`); made again where the planner that made
        it was re-created meanwhile from a state without it (at most twice more)."""
        for _ in range(3):
            generation = self.link.generation
            got = apply()
            if self._keep_applied(change(got), generation):
                break
            _log.warning("msd_dask %s: the planner was re-created while %s was applied, from "
                         "a state without it: applying it again", self.name, change(got))
        return got

    def _keep_applied(self, change: str, generation: int) -> bool:
        """In the process that started the service, keep the planner's checkpoint now, so
        that a planner lost right after a change applied by the planner is re-created with
        it.  A checkpoint not sent in time is not the change's failure: a warning says so,
        and the owner's next check (a second later) keeps it.  ``False`` if the planner of
        ``generation``, which made the change, was re-created meanwhile (the kept state,
        and the new planner, lack it)."""
        if self.keeper is None:
            return True
        try:
            self.keeper.keep_checkpoint()
        except Exception as e:  # noqa: BLE001 - applied all the same: not the call's failure
            if self.link.generation != generation:
                return False
            _log.warning("msd_dask %s: %s applied, but not kept for a re-created planner yet "
                         "(the next check keeps it): %s", self.name, change, e)
            return True
        kept = self.keeper.checkpoint
        return kept is None or int(kept["generation"]) == generation

    def scale_loaders(self, source: str, n: int) -> int:
        """Serve ``source`` with ``n`` loaders; returns the count.

        Applied before the next step is planned, or at once while the planner waits for
        the constructors' room (training paused: a scale-down frees its loaders then).
        Which loader reads a unit never
        changes the documents of a step: the stream does not depend on it.  A planner
        re-created after a loss starts with as many loaders: in the process that started
        the service, its kept checkpoint has the count once this returns, unless the
        planner does not send its checkpoint in time (a warning says so; the owner's next
        check, a second later, keeps it); elsewhere within a second, as for
        :meth:`set_weights`.

        Raises
        ------
        ValueError
            A source the service does not have, or ``n`` outside the source's bounds
            (``sources[].min_loaders``/``max_loaders``, else ``scaling``'s).
        """
        from msd_dask.core.scaling import ScalingPolicy

        if not is_whole(n) or n < 1:
            raise ValueError(f"scale_loaders({source!r}, n): n must be a number of loaders "
                             f"(an integer >= 1), got {n!r}")
        names = [s.name for s in self.config.sources]
        if source not in names:
            raise ValueError(f"scale_loaders: no source {source!r} (the service's sources: "
                             f"{names})")
        lo, hi = ScalingPolicy.from_config(self.config).bounds(source)
        if not lo <= n <= hi:  # (1000 was taken as 8, the bound, without a word; a review)
            i = names.index(source)
            raise ValueError(f"scale_loaders({source!r}, {n}): source {source!r} has between "
                             f"{lo} and {hi} loaders (sources[{i}].min_loaders/max_loaders, "
                             "else scaling's)")
        return self._applied(lambda: int(self.link.call(lambda p: p.scale(source, int(n)),
                                                        "scale_loaders()")),
                             lambda got: f"{got} loaders of {source!r}")

    def retire_workers(self, workers: list[str], *, close: bool = True) -> dict[str, int]:
        """Move the loaders and constructors off ``workers``, then retire them from Dask.

        Dask cannot retire a worker holding actors, and actors cannot move; this
        re-creates the roles elsewhere first (no document lost or repeated).  The
        planner's own worker cannot be retired this way.

        Parameters
        ----------
        workers : list of str
            The workers' addresses or Dask names.
        close : bool
            Also close the workers once their roles moved (``False``: they stay, empty).

        Returns
        -------
        dict
            How many loaders and constructors moved.

        Raises
        ------
        ValueError
            A worker the cluster does not have, or the planner's own.
        ServiceError
            The handle is closed.
        ServiceTimeoutError
            The scheduler did not answer (each ask waits :data:`SCHEDULER_ASK` seconds).
        """
        import gc

        self.link.check_open()  # (closed: Dask's "IOLoop is closed", a review)

        from msd_dask.roles.keys import (  # (an operation: ranks import no role)
            not_its_roles,
            role_pattern,
        )

        workers = self._worker_addresses(workers)
        sources = [s.name for s in self.config.sources]
        pattern = role_pattern(self.name, sources)
        if close:
            # (the planner's are its own: evacuate says so)
            others = {w: not_its_roles(keys, self.name, sources)
                      for w, keys in self._actors_on(workers).items()}
            foreign = {w: keys for w, keys in others.items() if keys}
            if foreign:  # (Dask would keep them, saying so only in the scheduler's log)
                raise ValueError(
                    f"retire_workers: Dask does not retire a worker holding an actor, and "
                    f"{sorted(foreign)} hold actors not of service {self.name!r} (another "
                    f"service's roles, or your own): {foreign}; nothing was moved")
        try:
            moved = dict(self.link.call(lambda p: p.evacuate(list(workers)), "retire_workers()"))
        except ServiceTimeoutError as e:
            raise ServiceTimeoutError(
                f"retiring {list(workers)}: moving the roles of service {self.name!r} off them did "
                f"not finish within {self.config.timeout:.0f}s ({e}); the planner goes on "
                "moving them, and places no new role there") from e
        self.refresh()  # drop this client's handles of the moved roles ...
        if self.keeper is not None:
            self.keeper.keep_checkpoint()  # ... and stop holding their keys
        gc.collect()
        # ... and wait until nothing references them any more: Dask does not retire a
        # worker that still holds an actor
        deadline = time.monotonic() + self.config.timeout

        def holding() -> list[str]:
            return list(self._ask_scheduler(
                keys_on, f"retiring {list(workers)}: the scheduler did not say which of this "
                "service's roles they still hold", workers=list(workers), pattern=pattern))

        while held := holding():
            if time.monotonic() > deadline:
                raise ServiceTimeoutError(f"roles {held} on {list(workers)} were still "
                                          f"referenced after {self.config.timeout:.0f}s")
            time.sleep(0.2)
        if close:
            try:
                retired = self.client.retire_workers(list(workers), close_workers=True,
                                                     callback_timeout=self.config.timeout)
            except TimeoutError:
                raise ServiceTimeoutError(
                    f"retiring {list(workers)}: Dask did not finish within "
                    f"{self.config.timeout:.0f}s (the roles moved off them)") from None
            kept = [w for w in workers if w not in (retired or {})]
            if kept:  # (an actor placed on them meanwhile, say: Dask only logs it)
                raise ServiceError(
                    f"retire_workers: Dask did not retire {kept} (service {self.name!r}'s "
                    f"roles moved off them); the actors on them now: "
                    f"{self._actors_on(kept)}")
        return moved

    def _actors_on(self, workers: list[str]) -> dict[str, list[str]]:
        """The keys of the actors on each of ``workers``, as the scheduler has them."""
        return dict(self._ask_scheduler(
            actors_on, f"retiring {list(workers)}: the scheduler did not say which actors they "
            "hold", workers=list(workers)))

    def _ask_scheduler(self, fn: Callable[..., Any], what: str, **kwargs: Any) -> Any:
        """``fn(dask_scheduler, **kwargs)`` run on the scheduler, within
        :data:`SCHEDULER_ASK` seconds; else :class:`ServiceTimeoutError`, ``what`` and the
        wait (the client's own asks, ``scheduler_info()`` and ``dashboard_link``, waited for
        ever on a scheduler that stopped answering; a review)."""
        try:
            return self.client.run_on_scheduler(fn, callback_timeout=SCHEDULER_ASK, **kwargs)
        except TimeoutError:
            raise ServiceTimeoutError(f"{what} within {SCHEDULER_ASK:g}s") from None

    def _worker_addresses(self, workers: list[str]) -> list[str]:
        """The addresses of ``workers`` (addresses or Dask worker names); a
        :class:`ValueError` naming those the cluster does not have (nothing moves then:
        an address mistyped, or ``localhost`` for ``127.0.0.1``, moved no role and retired
        nothing, silently)."""
        if not isinstance(workers, list | tuple):
            raise ValueError(f"retire_workers: workers must be a list of addresses, got {workers!r}")
        def named(dask_scheduler: Any) -> dict[str, str]:  # (nested: pickled by value)
            return {a: str(ws.name) for a, ws in dask_scheduler.workers.items()}

        info = dict(self._ask_scheduler(
            named, f"retiring {list(workers)}: the scheduler did not list its workers"))
        by_name = {name: a for a, name in info.items()}
        addresses = [w if w in info else by_name.get(str(w)) for w in workers]
        unknown = [w for w, a in zip(workers, addresses, strict=True) if a is None]
        if unknown:
            raise ValueError(f"retire_workers: {unknown} is not a worker of the cluster "
                             f"(its workers: {sorted(info)})")
        return [a for a in addresses if a is not None]

    def stats(self) -> dict[str, Any]:
        """Counters per source, per rank and for the planner.

        Returns
        -------
        dict
            ``sources``: documents and tokens read, tokens planned, loaders, share
            of planned tokens against the weight; ``ranks``: queue depth and last
            claimed step; ``planner``: steps, imbalance, errors; ``constructors``:
            each constructor's counters.  While the planner re-creates a role lost with
            its worker, the call still answers: a loader's figures are its last
            answer's (``loaders_unanswered`` of its source counts them), a constructor
            has ``error`` and ``unanswered`` set and its ranks are missing from ``ranks``.
        """
        planner = self.link.call(lambda p: p.stats(), "stats()")
        loader_stats = self.link.call(lambda p: p.loader_stats(), "stats() (the loaders')")
        cons = self.link.call(lambda p: p.constructor_stats(), "stats() (the constructors')")
        sources = source_figures(planner, loader_stats, self.link.registry.get("quarantined", {}))
        ranks = rank_figures(cons)
        return {"sources": sources, "ranks": ranks, "planner": planner,
                "constructors": cons}

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The data-plane state after ``step``, to :meth:`start` again from (JSON-serialisable).

        Parameters
        ----------
        step : int, optional
            The last step the resumed service must not serve again.  Default:
            :meth:`consumed_step`, the last step every reader has returned: taken
            while every rank is stopped after returning step ``k`` (a checkpoint,
            a barrier), the state of step ``k`` (ranks that read further skip
            those steps again with their :meth:`Reader.load_state_dict`).

        Returns
        -------
        dict
            ``{"format", "name", "seed", "seq_len", "sources", "step", "planner"}`` and what
            a resume checks against the config (``shuffle_window``, ``units``,
            ``reading``, ``weights``, ``tokenizer_sha256``: docs/resume.md).

        Raises
        ------
        ValueError
            If ``step`` is not planned yet or no longer held (the service keeps
            the planner state of the last ``prefetch + 2 × round_steps + 16`` steps, and
            of the steps from 16 before the last every rank returned, up to 4 times as
            many: docs/resume.md), or before the state its planner started from; without
            ``step``, if the last step every rank returned cannot be known (see
            :meth:`consumed_step`).
        """
        at = step_number(self.consumed_step() if step is None else step, "state_dict")
        return dict(self.link.call(lambda p: p.state_at(at), f"state_dict({at})"))

    def _constructor_stats(self, i: int, c: Any) -> dict[str, Any]:
        """Constructor ``i``'s ``stats()``, where the answer matters (the default
        checkpoint): its failure raises, naming the constructor."""
        try:
            return dict(c.stats().result(timeout=self.config.timeout))
        except TimeoutError:
            raise ServiceTimeoutError(f"constructor {i} of service {self.name!r} did not answer "
                                      f"within {self.config.timeout:.0f}s (its worker may be "
                                      "lost; the planner re-creates it)") from None
        except Exception as e:  # noqa: BLE001 - its worker was lost meanwhile
            raise ServiceError(f"constructor {i} of service {self.name!r} did not answer "
                               f"({type(e).__name__}: {e}): its worker may be lost; ask again "
                               "once the planner re-created it") from e

    #: seconds :meth:`consumed_step` gives the reports of paused readers beyond the
    #: idle time their readers announced (the reporter's wake-up, the call to the
    #: constructor, a busy worker)
    report_margin = 3.0

    def consumed_step(self) -> int:
        """The last step every rank has returned (one before the first step if some has none).

        Exact for the ranks that are stopped (a checkpoint, a barrier, an evaluation)
        or read in this process.  A reader of this process counts the last step it
        returned.  For a rank read in another process the constructors know the
        steps before the round it claimed last, and the last step it returned once
        its training loop stopped asking for batches for its reader's idle time
        (:data:`~msd_dask.reader.REPORT_IDLE`, or three times its usual time between
        batches if that is longer; it reports then).  If that leaves the answer open
        (a rank holds claimed steps it has not reported returning), this waits for
        the reports: until the longest idle time the open ranks announced has passed,
        then up to ``report_margin`` seconds more while they arrive.

        Raises
        ------
        ValueError
            If a rank still holds claimed steps it has not reported returning after
            that wait (its reader keeps reading without pausing, or its process is
            gone), naming the steps the answer lies between: pass ``step`` to
            :meth:`state_dict`, the last step the training loop finished.
        """
        t0 = time.monotonic()
        self.refresh()  # (a constructor re-created since: ask the new one, not the lost one)
        first = int(self.link.call(lambda p: p.start_step(), "consumed_step()"))
        lo, hi, idle = self._returned_bounds(first, trust_pauses=False)
        if min(lo.values()) == min(hi.values()):
            return min(lo.values())
        # a rank stopped since before t0 has reported once its idle time has passed
        wait = max(idle[r] for r in lo if lo[r] < hi[r])
        time.sleep(max(0.0, t0 + wait - time.monotonic()))
        deadline = time.monotonic() + self.report_margin
        while True:
            lo, hi, _ = self._returned_bounds(first, trust_pauses=True)
            low, high = min(lo.values()), min(hi.values())
            if low == high:
                return low
            if time.monotonic() > deadline:
                break
            time.sleep(0.25)
        open_ranks = sorted(r for r in lo if lo[r] < hi[r] and lo[r] < high)
        lost = [r for r in open_ranks if hi[r] >= _UNKNOWN]
        shown = first_of(lost or open_ranks, 8)
        if lost:
            raise ValueError(
                f"service {self.name!r}: rank(s) {shown} are served by a constructor re-created "
                "after a loss, which has heard nothing from them since (paused readers in "
                "other processes do not report again): pass state_dict(step=N) with N the "
                "last step the training loop finished")
        raise ValueError(
            f"service {self.name!r}: the last step every rank returned is between {low} and "
            f"{high}: rank(s) {shown} hold claimed steps they did not report returning within "
            f"{wait + self.report_margin:.0f}s (still reading, or their process is gone); "
            "pass state_dict(step=N) with N the last step the training loop finished")

    def _returned_bounds(self, first: int, *, trust_pauses: bool
                         ) -> tuple[dict[int, int], dict[int, int], dict[int, float]]:
        """``(lo, hi, idle)``: per rank, bounds of the last step it returned, as its
        constructors and this process's readers know them, and the seconds its reader
        waits before reporting.  ``trust_pauses``: a rank whose last word was a report
        after a pause is taken to be still there (see :meth:`consumed_step`)."""
        world = self.config.parallel.world_size
        returned: dict[int, int] = {}
        by: dict[int, str] = {}
        claimed: dict[int, int] = {}
        idle: dict[int, float] = {}
        unknown: set[int] = set()
        for i, c in enumerate(self.constructors):
            st = self._constructor_stats(i, c)
            if st.get("replacing"):  # knows its ranks only once they claim or report
                unknown |= {int(r) for r in st["queue_depth"]} - {
                    int(r) for r in (*st["returned"], *st["last_claimed"])}
            for r, s in st["returned"].items():
                if int(s) >= returned.get(int(r), first - 1):
                    returned[int(r)] = int(s)
                    by[int(r)] = st.get("returned_by", {}).get(r, "")
            for r, s in st["last_claimed"].items():
                claimed[int(r)] = max(claimed.get(int(r), first - 1), int(s))
            for r, t in st.get("report_after", {}).items():
                idle[int(r)] = max(idle.get(int(r), REPORT_IDLE), float(t))
        lo: dict[int, int] = {}
        hi: dict[int, int] = {}
        for r in range(world):
            # a claim says the steps before the round: the reader may not have the
            # round yet (the claim is counted before its batches arrive)
            lo[r] = returned.get(r, first - 1)
            hi[r] = lo[r] if trust_pauses and by.get(r) == "pause" else claimed.get(r, first - 1)
            hi[r] = _UNKNOWN if r in unknown else max(hi[r], lo[r])
            idle.setdefault(r, REPORT_IDLE)
        # this process's readers know exactly: the last step of each rank's latest reader
        # (the handle's ledger; an earlier reader of the rank, closed or replaced but still
        # referenced, said an older step: a review), unless the rank went on reading
        # elsewhere (another handle or process) and its constructor has a later step
        for rank, done in self._returned.items():
            if done >= 0 and int(done) >= lo[rank]:
                lo[rank] = hi[rank] = int(done)
        return lo, hi, idle

    @property
    def dashboard_link(self) -> str:
        """The service's status page on the Dask dashboard's address (``/msd/status``).

        Under the dashboard's prefix (``dask scheduler --dashboard-prefix``), which Dask's
        own link leaves out unless ``distributed.dashboard.link`` says it: a link with a
        path of its own (a reverse proxy's, or the prefix) is taken as it is; one straight
        to the scheduler's address gets the prefix the scheduler's plugin serves under.
        """
        from urllib.parse import urlsplit

        self.link.check_open()  # (closed: "None/msd/status", a review)
        link = self._dask_dashboard_link()
        base = link[:-len("/status")] if link.endswith("/status") else link.rstrip("/")
        if not urlsplit(base).path.strip("/"):
            base = base.rstrip("/") + self._dashboard_prefix()
        return base + "/msd/status"

    def _dask_dashboard_link(self) -> str:
        """Dask's link to the scheduler's dashboard (``Client.dashboard_link``), asked of the
        scheduler (:meth:`_ask_scheduler`); :class:`ServiceError` where it serves none."""
        from distributed.utils import format_dashboard_link

        cluster = getattr(self.client, "cluster", None)  # (an embedded one knows it)
        link = None if cluster is None else getattr(cluster, "dashboard_link", None)
        if link:
            return str(link)

        def port(dask_scheduler: Any) -> int | None:  # (nested: pickled by value)
            return getattr(dask_scheduler.services.get("dashboard"), "port", None)

        address = str(self.client.scheduler.address)
        found = self._ask_scheduler(port, f"the scheduler at {address} did not say its "
                                    "dashboard's port")
        if found is None:
            raise ServiceError(f"the scheduler at {address} serves no dashboard (started "
                               "with --no-dashboard?): the service's page is on it")
        protocol, rest = address.split("://", 1)
        host = "localhost" if protocol == "inproc" else rest.rsplit(":", 1)[0]
        return str(format_dashboard_link(host, found))

    def _dashboard_prefix(self) -> str:
        """The prefix the scheduler's plugin serves its pages under (``""``: none, or no
        plugin there to ask)."""
        from msd_dask.plugin.scheduler import MsdSchedulerPlugin

        name = MsdSchedulerPlugin.name

        def prefix(dask_scheduler: Any) -> str:  # (nested: pickled by value)
            return str(getattr(dask_scheduler.plugins.get(name), "http_prefix", ""))

        try:
            return str(self.client.run_on_scheduler(prefix, callback_timeout=SCHEDULER_ASK))
        except Exception:  # noqa: BLE001 - a link without the prefix beats none
            return ""

    # ---------------------------------------------------------------- close
    def close(self) -> None:
        """Stop the service (if this handle started it) and disconnect.

        A handle that started its own embedded cluster (:meth:`start` without an
        address) closes this process's other handles on it first: they cannot outlive it.

        This process's readers send nothing from then on: the next batch they do not
        hold raises :class:`ServiceError` (one waiting for a round hears the owner's
        notice as the roles close).  The owner then closes the roles and lets Dask
        release them; a call that reached one after that would fail on its worker,
        which logs the failure as an error.
        """
        if self._closed:
            return
        if self._finalizer is not None:  # (closed here, not when garbage-collected)
            self._finalizer.detach()
        if self._cluster is not None:
            # this process's other handles on the embedded cluster cannot outlive it (their
            # clients would try to reach its scheduler until the process exits, and log each
            # try): closed first, while the roles still hear their readers' last steps
            for other in [h for h in _OPEN if h is not self and not h._closed]:
                if other.address == self.address:
                    other.close()
        if not self.link.owner:  # the last steps this process's readers returned
            self._report_readers(5.0)
        # before the roles are closed and released: this process's readers send nothing
        # more (a call reaching a released actor fails, and its worker logs it)
        self._closed = True
        if self._exit_pid is not None:  # (closed from here on: nothing more to do at exit)
            atexit.unregister(self._close_at_exit)
        self.link.close(CLOSED_BY_OWNER if self.link.owner else HANDLE_CLOSED)
        if self.keeper is not None:
            self.keeper.stop(self.config.timeout)
        try:
            if self.link.owner:
                if self._client_running(RECONNECT_WAIT):
                    self._close_roles()
                else:  # (closed nothing and said nothing while the client reconnected)
                    _log.warning(
                        "msd_dask %s: the client was not connected to the scheduler at %s "
                        "(%s) when the service closed: its roles may stay open and its "
                        "name published; stop it with: msd-dask stop %s --scheduler %s",
                        self.name, self.address, self.client.status, self.name, self.address)
        finally:
            self.client.close()
            if self._cluster is not None:
                self._cluster.close()

    def _client_running(self, wait: float) -> bool:
        """Whether this handle's client is connected, waiting up to ``wait`` seconds for one
        that is reconnecting (a network blip) to be."""
        deadline = time.monotonic() + wait
        while self.client.status != "running":
            if self.client.status in ("closed", "closing") or time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def _close_at_exit(self) -> None:
        """At the exit of the process that started the service without closing it: close
        it.  Nothing else could (its readers' processes may not; :meth:`stop` only once
        this process is gone) and its roles would hold their workers until the scheduler
        restarts.  A process forked from the owner's that exits closes nothing."""
        if self._closed or os.getpid() != self._exit_pid:
            return
        _log.warning("msd_dask %s: the process that started the service exits without "
                     "closing it: closing it now (a service lives as long as the process "
                     "that started it; keep that process running, e.g. msd-dask serve)",
                     self.name)
        try:
            self.close()
        except BaseException as e:  # noqa: BLE001 - at exit (a second Ctrl-C too): said
            _log.warning("msd_dask %s: closing at exit failed: %r", self.name, e)

    def _report_readers(self, timeout: float) -> None:
        """Tell the constructors the last step each reader of this handle returned, and
        wait (up to ``timeout`` in all) until they know it."""
        calls = [c for c in (r.report_returned() for r in list(self._readers)) if c is not None]
        deadline = time.monotonic() + timeout
        for call in calls:
            try:
                call.result(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - best effort: a lost constructor learns nothing
                pass

    def _close_roles(self) -> None:
        """Owner: close the roles, unpublish the service and make Dask forget its keys."""
        if self.keeper is not None and self.keeper.stopped_elsewhere:
            return  # (msd-dask stop closed its roles; the name may be another service's now)
        pinned = self.keeper.pinned if self.keeper is not None else None
        # (by name too where the planner is lost: the roles it held on the other workers
        # stayed open, unreachable once their keys went; a review)
        lost = self.link.planner_lost() or (self.keeper is not None and self.keeper.gave_up)
        _close_service(self.client, self.name, self.planner, self.link.registry["planner"].key,
                       pinned, sources=[s.name for s in self.config.sources] if lost else None)

    def __enter__(self) -> DataService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
