"""The public face of a running service: :class:`DataService` (a rank's
:class:`~msd_dask.reader.Reader` lives in :mod:`msd_dask.reader`).

``DataService.start`` has a worker list every source's units, places the roles
as actors across the cluster's workers (planner, constructors, loaders) and
publishes their handles under ``msd-<name>`` on the scheduler, so that any
process can ``DataService.connect(address, name)`` and read a rank's batches.

The planner re-creates lost loaders and constructors itself; the process
that started the service (``owner``) keeps the last state the planner can
resume from and re-creates a lost planner: it closes the roles the lost
one leaves behind, starts a new planner (a new *generation*) from that
state and publishes it again under the same name.  Readers switch to it when
the old one stops answering, drop the tickets of older generations and tell
the new constructors which steps they already have (docs/resume.md).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from msd_dask.core.config import Config, parse_config
from msd_dask.core.figures import rank_figures, source_figures
from msd_dask.errors import RESTART_HINT, ConfigError, DataError, ServiceError, ServiceTimeoutError
from msd_dask.reader import Reader
from msd_dask.sources.check import load_config

__all__ = ["DataService", "Reader", "discover_units"]

_PREFIX = "msd-"
#: dataset holding the keys of a service's roles (see DataService._pin)
_ROLES = "msd_roles/"
_log = logging.getLogger("msd_dask.service")

#: Dask settings of the embedded cluster (:meth:`DataService.start` without ``address``).
#: Its workers run the service's actors only, and Dask's periodic callbacks (a stack
#: sample of the task threads every 10 ms, an event-loop tick every 20 ms, a memory
#: check every 100 ms, in every worker, nanny and the scheduler) cost an idle 2-worker
#: cluster 0.10 cores here, 0.02 with these: 0.4 us of CPU per delivered token at
#: 184K tokens/s (scripts/bench_scaling.py).  Blocked-loop warnings and memory limits
#: still work, at this resolution.
EMBEDDED_DASK_CONFIG: dict[str, Any] = {
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "200ms",
    "distributed.worker.memory.monitor-interval": "500ms",
}


def discover_units(cfg: Config, threads: int = 8,
                   quarantined: dict[str, list[str]] | None = None
                   ) -> tuple[dict[str, list[tuple[str, int, int]]], dict[str, str]]:
    """List every source's units (parquet footers are read here, in parallel).

    A file whose units cannot be listed raises :class:`DataError`, unless its
    source has ``on_error: skip``: then it is left out and its error appended to
    ``quarantined[source]``.

    Returns
    -------
    units : dict
        ``{source: [(path, part, row_offset), ...]}``, sorted.
    roots : dict
        ``{source: root}`` for document keys.
    """
    # imported where units are listed (DataService.start: a worker, see
    # _discover_on_worker), never by a reader or the process that starts the service
    from msd_dask.formats import get_format
    from msd_dask.sources.documents import with_source
    from msd_dask.sources.storage import open_source

    units: dict[str, list[tuple[str, int, int]]] = {}
    roots: dict[str, str] = {}
    with ThreadPoolExecutor(threads) as ex:
        for s in cfg.sources:
            files = open_source(s.uri, s.storage_options)
            fmt = get_format(s.format)

            def listing(p: str, fs: Any = files.fs, fmt: Any = fmt, name: str = s.name) -> Any:
                try:
                    return fmt.units(fs, p)
                except (DataError, OSError) as e:
                    return with_source(e, name, p)

            found = []
            for got in ex.map(listing, files.paths):
                if isinstance(got, DataError):
                    if s.on_error != "skip":
                        raise got
                    _log.warning("source %r quarantined %s", s.name, got)
                    if quarantined is not None:
                        quarantined.setdefault(s.name, []).append(str(got))
                    continue
                found.append(got)
            units[s.name] = [(u.path, u.part, u.row_offset) for u in itertools.chain(*found)]
            roots[s.name] = files.root
            if not units[s.name]:
                raise DataError(f"no readable units in {len(files.paths)} file(s) matching "
                                f"{s.uri!r} (empty files?)", source=s.name)
    return units, roots


def _anchored(uri: str) -> str:
    """A local relative ``uri`` made absolute against this process's working directory.

    fsspec resolves a relative local path against the current directory of the process
    that lists it; the units are listed on a worker, whose directory may differ, so the
    path is fixed where the user gave it.  URLs (``proto://``, ``a::b``) are unchanged.
    """
    if "://" in uri or "::" in uri or os.path.isabs(uri):
        return uri
    return os.path.abspath(os.path.expanduser(uri))


def _discover_on_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Check and list the sources of ``cfg`` (a :meth:`Config.to_dict`) on a Dask worker.

    Runs there so that the process that starts the service never imports the file
    formats' libraries (pyarrow, fsspec, s3fs, zstandard: ~30 MiB).  A
    :class:`DataError` or :class:`ConfigError` (a ``uri`` that matches no file)
    travels back as it is (both pickle with their fields).  The starting process
    waits for it (see :func:`_discover_remote`).

    Returns
    -------
    dict
        ``{"units", "roots", "quarantined"}`` as :func:`discover_units` gives them.
    """
    quarantined: dict[str, list[str]] = {}
    try:
        units, roots = discover_units(load_config(cfg), quarantined=quarantined)
    except (ConfigError, DataError) as e:
        # the library's own exception (its message is in e's) stays here: Dask sends the
        # causes too, and unpickling e.g. pyarrow's would import pyarrow in the starter
        e.__cause__ = e.__context__ = None
        raise
    return {"units": units, "roots": roots, "quarantined": quarantined}


def _processing_on(key: str, dask_scheduler: Any = None) -> str | None:
    """The worker running the task ``key``, if any (runs on the scheduler)."""
    ts = dask_scheduler.tasks.get(key)
    ws = getattr(ts, "processing_on", None)
    return None if ws is None else str(ws.address)


def _discover_remote(client: Any, cfg: Config, timeout: float
                     ) -> tuple[dict[str, list[tuple[str, int, int]]], dict[str, str],
                                dict[str, list[str]]]:
    """:func:`discover_units` of ``cfg`` on one of ``client``'s workers, with its checks.

    Returns
    -------
    units, roots, quarantined
        As :func:`discover_units` gives them.

    Raises
    ------
    ConfigError
        A source's ``uri`` matches no file or cannot be listed.
    DataError
        A file cannot be listed (its source does not skip bad input).
    ServiceTimeoutError
        The listing did not finish within ``timeout``.
    """
    d = cfg.to_dict()
    d["sources"] = [dict(s, uri=_anchored(str(s["uri"]))) for s in d["sources"]]
    fut = client.submit(_discover_on_worker, d, pure=False)
    try:
        got = fut.result(timeout=timeout)
    except TimeoutError:
        try:
            where = client.run_on_scheduler(_processing_on, fut.key, callback_timeout=5)
        except Exception:  # noqa: BLE001 - only for the message
            where = None
        fut.cancel()
        raise ServiceTimeoutError(
            f"listing the units of service {cfg.name!r}'s {len(cfg.sources)} source(s) "
            f"({', '.join(s.name for s in cfg.sources)}) on "
            f"{f'worker {where}' if where else 'a Dask worker'} did not finish within "
            f"{timeout:.0f}s (the config's 'timeout'); check that the workers reach the "
            "sources' storage") from None
    finally:
        fut.release()
    for name, entries in got["quarantined"].items():
        for entry in entries:
            _log.warning("source %r quarantined %s", name, entry)
    return got["units"], got["roots"], got["quarantined"]


def _keys_on(dask_scheduler: Any, workers: list[str], prefix: str) -> list[str]:
    """Keys starting with ``prefix`` held or running on ``workers`` (runs on the scheduler)."""
    out = []
    for w in workers:
        ws = dask_scheduler.workers.get(w)
        if ws is not None:
            out += [str(ts.key) for ts in (*ws.has_what, *ws.processing)
                    if str(ts.key).startswith(prefix)]
    return out


def _has_client(client_id: str, dask_scheduler: Any = None) -> bool:
    """Whether the client ``client_id`` is connected (runs on the scheduler)."""
    return client_id in dask_scheduler.clients



def _rank_queues(cfg: Config) -> list[str]:
    """The names of the service's ticket queues, one per global rank."""
    from msd_dask.roles.constructor import queue_name

    return [queue_name(cfg.name, r) for r in range(cfg.parallel.world_size)]


def _drop_queues(names: list[str], dask_scheduler: Any = None) -> int:
    """Delete the ticket queues ``names`` on the scheduler; returns how many existed.

    A ``distributed.Queue`` lives on the scheduler until every client that made
    it releases it, which nothing does: the queues of a closed (or crashed)
    service of the same name still hold its last tickets, which a new service's
    readers would take for their own.
    """
    ext = dask_scheduler.extensions.get("queues")
    dropped = 0
    for name in names:
        if ext is not None and name in ext.queues:
            ext.client_refcount[name] = 1
            ext.release(name=name)
            dropped += 1
    return dropped


def _put_in_queues(names: list[str], message: dict[str, Any], dask_scheduler: Any = None
                   ) -> int:
    """Put ``message`` in each of the queues ``names`` that exists; returns how many."""
    ext = dask_scheduler.extensions.get("queues")
    put = 0
    for name in names:
        if ext is not None and name in ext.queues:
            ext.queues[name].put_nowait({"type": "msgpack", "value": message})
            put += 1
    return put


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


def _source_payload(cfg: Config, name: str) -> dict[str, Any]:
    d = next(s for s in cfg.to_dict()["sources"] if s["name"] == name)
    d.pop("weight")
    return d


def _check_tls(address: str | None, security: Any) -> None:
    """Refuse a ``tls://`` address without TLS credentials, with a message that says where to put them."""
    if not address or not str(address).startswith("tls://") or security is not None:
        return
    from distributed.security import Security

    if Security().get_connection_args("client").get("ssl_context") is None:
        raise ServiceError(f"scheduler {address} uses TLS but no credentials were given: pass "
                           "security=distributed.security.Security(...) (CLI: --tls-ca-file, "
                           "--tls-cert, --tls-key) or set distributed.comm.tls.* in Dask's config")


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
        self._registry = registry
        #: the planner's generation: 0, then one more each time a lost one is re-created
        self.generation = int(registry.get("generation", 0))
        self._owner = owner
        self._cluster = cluster
        self._closed = False
        #: held by the owner while it keeps a checkpoint or re-creates the planner
        self._lock = threading.RLock()
        #: held while the planner handle, its generation and the constructors change
        self._swap = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        #: owner only: what re-creating the planner needs (units, roots, loader threads)
        self._recipe: dict[str, Any] = {}
        #: owner only: the planner's last :meth:`PlannerActor.checkpoint`
        self._checkpoint: dict[str, Any] | None = None
        self._pinned: list[str] | None = None
        #: this process's readers (told of a re-created planner together, see _tell_readers)
        self._readers: weakref.WeakSet[Reader] = weakref.WeakSet()
        self.planner: Any = None
        try:
            self.planner = registry["planner"].result(timeout=cfg.timeout)
        except Exception:  # noqa: BLE001 - a lost planner: refresh finds its successor
            pass
        self.constructors: list[Any] = []
        #: (generation, constructors of that generation), replaced together
        self._handles: tuple[int, list[Any]] = (-1, [])
        self.refresh()

    def refresh(self) -> None:
        """Fetch the current constructor handles (they change when a role is re-created).

        If the planner does not answer, switch to the one the service re-created
        after losing it (published under the same name, a higher generation).

        Raises
        ------
        ServiceError
            The planner was lost and the process that started the service is gone,
            so nothing can re-create it.
        ServiceTimeoutError
            The planner did not answer, and no successor appeared, within the
            config's ``timeout``.
        """
        deadline = time.monotonic() + self.config.timeout
        while True:
            with self._swap:
                planner, gen = self.planner, self.generation
            try:  # short waits: a call to a lost actor may hang instead of failing
                handles = planner.handles(False).result(timeout=5.0)
            except Exception as e:  # noqa: BLE001 - lost or busy: look for a successor
                if self._adopt_published():
                    continue
                self._raise_if_lost(deadline, e)
                time.sleep(0.5)
                continue
            with self._swap:
                if gen == self.generation:
                    self.constructors = list(handles["constructors"])
                    self._handles = (gen, self.constructors)
                    return

    def _planner_lost(self) -> bool:
        """Whether Dask reports the current planner's worker as lost (no call to it)."""
        fut = self._registry.get("planner")
        return fut is not None and fut.status in ("error", "lost", "cancelled")

    def _owner_alive(self) -> bool:
        """Whether the process that started the service is still connected (True if unknown)."""
        if self._owner:
            return not self._closed
        cid = self._registry.get("owner")
        if cid is None:
            return True
        try:
            return bool(self.client.run_on_scheduler(_has_client, cid, callback_timeout=5))
        except Exception:  # noqa: BLE001 - unknown: assume it is
            return True

    def _adopt_published(self) -> bool:
        """Switch to the published planner if it is a newer generation; returns whether it was."""
        try:
            reg = self.client.get_dataset(_PREFIX + self.name, default=None, callback_timeout=5)
            if reg is None or int(reg.get("generation", 0)) <= self.generation:
                return False
            planner = reg["planner"].result(timeout=5)
        except Exception:  # noqa: BLE001 - not there yet, or unreachable: try again later
            return False
        with self._swap:
            gen = int(reg.get("generation", 0))
            if gen <= self.generation:
                return False
            self._registry, self.planner, self.generation = reg, planner, gen
        _log.warning("msd_dask %s: switched to the re-created planner (generation %d)",
                     self.name, gen)
        return True

    def _raise_if_lost(self, deadline: float | None = None, cause: BaseException | None = None
                       ) -> None:
        """Raise if the planner is lost for good, or (past ``deadline``) did not answer."""
        lost = self._planner_lost()
        where = getattr(self.planner, "_address", "?")
        if lost and not self._owner_alive():
            raise ServiceError(
                f"the planner of service {self.name!r} was lost with its worker {where}, and "
                f"the process that started the service is gone, so nothing can re-create it; "
                f"{RESTART_HINT}")
        if deadline is not None and time.monotonic() > deadline:
            if lost:
                raise ServiceTimeoutError(
                    f"the planner of service {self.name!r} was lost with its worker {where} "
                    f"and was not re-created within {self.config.timeout:.0f}s; "
                    f"{RESTART_HINT}")
            raise ServiceTimeoutError(
                f"the planner of service {self.name!r} did not answer within "
                f"{self.config.timeout:.0f}s (its worker may be lost): {cause!r}")

    def _ask(self, method: str, *args: Any) -> Any:
        """Call the planner's ``method``; once more on its successor if it was lost."""
        try:
            return getattr(self.planner, method)(*args).result(timeout=self.config.timeout)
        except (KeyError, ValueError, ServiceError):
            raise
        except Exception:  # noqa: BLE001 - lost or not answering: find the current one
            self.refresh()
            return getattr(self.planner, method)(*args).result(timeout=self.config.timeout)

    # ------------------------------------------------- owner: keep the planner
    def _start_watching(self) -> None:
        try:
            self._keep_checkpoint()
        except Exception as e:  # noqa: BLE001 - the watcher tries again
            _log.warning("msd_dask %s: no planner checkpoint yet: %r", self.name, e)
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"msd-{self.name}-watch")
        self._watcher.start()

    def _keep_checkpoint(self) -> None:
        with self._lock:
            self._checkpoint = dict(self.planner.checkpoint().result(timeout=10))
            self._pin(self._checkpoint.get("keys", []))

    def _pin(self, keys: list[str]) -> None:
        """Hold the roles' keys from a published dataset.

        Only the planner's own client asks Dask for its roles' keys, so when the
        planner's worker dies Dask forgets every role at once: removed from their
        workers' actors, still running, and out of reach.  Held here, they stay
        reachable until :meth:`_recover` has closed them.
        """
        from distributed import Future

        keys = sorted(keys)
        if keys == self._pinned:
            return
        futures: list[Any] = [Future(k, self.client) for k in keys]
        self.client.publish_dataset(futures, name=_ROLES + self.name, override=True,
                                    callback_timeout=10)
        self._pinned = keys

    def _watch(self) -> None:
        """Owner: keep the planner's last checkpoint; re-create the planner if it is lost."""
        while not self._stop.wait(self.watch_interval):
            try:
                if self._planner_gone():
                    self._recover()
                else:
                    self._keep_checkpoint()
            except Exception as e:  # noqa: BLE001 - logged; the next round tries again
                if self._stop.is_set():
                    return
                _log.warning("msd_dask %s: watching the planner: %r", self.name, e)

    def _planner_gone(self) -> bool:
        """Whether the planner's worker is gone while the scheduler is still there (a lost
        scheduler cancels every future too, but then there is nothing to re-create it on)."""
        if self.client.status != "running":
            return False
        try:
            info = self.client.sync(self.client.scheduler.identity, callback_timeout=5)
        except Exception:  # noqa: BLE001 - scheduler unreachable: nothing to do from here
            return False
        return self._planner_lost() or self.planner._address not in info["workers"]

    def _recover(self) -> None:
        """Re-create the lost planner from the last checkpoint (owner only)."""
        with self._lock:
            # without a checkpoint (lost before the first one), from where this service
            # started: readers skip what they have, the plans are the same
            ck = self._checkpoint or {"state": self._recipe.get("resume"), "claimed": {},
                                      "recovered": {}, "events": []}
            cfg, old = self.config, self._registry
            t0 = time.monotonic()
            _log.warning("msd_dask %s: the planner on %s was lost; re-creating it from the "
                         "state after step %s", self.name,
                         getattr(self.planner, "_address", None),
                         (ck["state"] or {}).get("step", "-1 (the start)"))
            from msd_dask.roles.supervisor import (
                close_service_roles,  # the owner only: readers never import roles
            )

            # the roles the lost planner leaves behind stop publishing and free their memory
            closed = self.client.run(close_service_roles, self.name, on_error="return",
                                     callback_timeout=60)
            had = {int(r): int(s) for r, s in ck["claimed"].items()}
            for res in closed.values():
                if isinstance(res, dict):
                    for r, st in res["last_claimed"].items():
                        had[int(r)] = max(had.get(int(r), -1), int(st))
            gen = self.generation + 1
            registry = self._place_planner(
                self.client, cfg, self._recipe["units"], self._recipe["roots"], ck["state"],
                self._recipe["loader_threads"], members=old.get("members"), generation=gen,
                had=had, lost={"from": getattr(self.planner, "_address", None),
                               "recovered": ck["recovered"], "events": ck["events"]})
            registry["quarantined"] = old.get("quarantined", {})
            registry["owner"] = self.client.id
            planner = registry["planner"].result(timeout=cfg.timeout)
            try:
                planner.setup().result(timeout=cfg.timeout)
            except BaseException:
                try:
                    planner.close_roles().result(timeout=30)
                finally:
                    registry["planner"].release()
                raise
            self.client.publish_dataset(registry, name=_PREFIX + self.name, override=True,
                                        callback_timeout=cfg.timeout)
            handles = planner.handles(False).result(timeout=cfg.timeout)
            with self._swap:
                self._registry, self.planner, self.generation = registry, planner, gen
                self.constructors = list(handles["constructors"])
                self._handles = (gen, self.constructors)
            planner.start().result(timeout=cfg.timeout)
            old["planner"].release()
            self._tell_readers()
            _log.warning("msd_dask %s: planner re-created (generation %d) in %.1fs; closed "
                         "the old roles: %s", self.name, gen, time.monotonic() - t0, closed)
            self._keep_checkpoint()

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
        from distributed import Client, LocalCluster

        from msd_dask.roles.planner import planner_state

        cfg = parse_config(cfg)  # a worker checks and lists the files
        if resume is not None:
            planner_state(cfg, dict(resume))  # refuse a mismatched state before starting
        timeout = cfg.timeout if timeout is None else timeout
        cluster = None
        if address is None:
            import dask

            with dask.config.set(EMBEDDED_DASK_CONFIG):  # the workers start inside
                cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker,
                                       processes=True, dashboard_address=":0", security=security,
                                       **({"protocol": "tls://"} if security is not None else {}))
            address = cluster.scheduler_address
        _check_tls(address, security)
        client = Client(address, direct_to_workers=True, timeout=timeout, security=security)
        try:
            key = _PREFIX + cfg.name
            if key in client.list_datasets():
                raise ServiceError(f"a service named {cfg.name!r} is already running on "
                                   f"{address}; pick another 'name' or close it first")
            stale = client.run_on_scheduler(_drop_queues, _rank_queues(cfg))
            if stale:
                _log.info("msd_dask %s: dropped %d ticket queues a closed service of this name "
                          "left", cfg.name, stale)
            try:
                client.wait_for_workers(1, timeout=timeout)
            except TimeoutError:
                raise ServiceTimeoutError(
                    f"no Dask worker joined the scheduler at {address} within {timeout:.0f}s: "
                    f"service {cfg.name!r} lists its sources' units and places its roles on "
                    f"workers; start some (dask worker {address})") from None
            units, roots, quarantined = _discover_remote(client, cfg, cfg.timeout)
            registry = cls._place_planner(client, cfg, units, roots, resume, loader_threads)
            registry["quarantined"] = quarantined
            registry["owner"] = client.id
            registry["planner"].result().setup().result()
            client.publish_dataset(registry, name=key)
            svc = cls(client, cfg, registry, owner=True, cluster=cluster)
            svc._recipe = {"units": units, "roots": roots, "loader_threads": loader_threads,
                           "resume": dict(resume) if resume else None}
            _install_plugin(client)
            svc.planner.start().result()
            svc._start_watching()
            return svc
        except BaseException:
            client.close()
            if cluster is not None:
                cluster.close()
            raise

    @staticmethod
    def _place_planner(client: Any, cfg: Config,
                           units: dict[str, list[tuple[str, int, int]]], roots: dict[str, str],
                           resume: Mapping[str, Any] | None,
                           loader_threads: int, *,
                           members: list[dict[int, list[int]]] | None = None,
                           generation: int = 0, had: dict[int, int] | None = None,
                           lost: dict[str, Any] | None = None) -> dict[str, Any]:
        """Start the planner; it creates the loaders and constructors itself.

        ``members`` (constructor -> DP ranks) is kept across generations, so a
        ticket's constructor index means the same DP ranks in every generation.
        """
        from msd_dask.sources.tokenizer import make_tokenizer

        workers = sorted(client.scheduler_info()["workers"])
        if not workers:
            raise ServiceError(f"no worker to place the planner of service {cfg.name!r} on")
        if members is None:
            n_c = cfg.constructors or min(cfg.parallel.dp, len(workers))
            members = [{} for _ in range(n_c)]
            for dp in range(cfg.parallel.dp):
                members[dp % n_c][dp] = cfg.parallel.ranks_of_dp(dp)
        from msd_dask.roles.planner import PlannerActor  # the starting process only (see planner.py)

        # unique: a service started again under this name right after a close must not
        # find the old planner's key still held (by the plugin's cached registry) and
        # attach to that planner
        key = (f"msd-{cfg.name}-planner" + (f"-g{generation}" if generation else "")
               + f"-{uuid.uuid4().hex[:8]}")
        planner = client.submit(
            PlannerActor, cfg.to_dict(), units, roots, dict(resume) if resume else None,
            members=members, pad_id=make_tokenizer(cfg.tokenizer).pad_id,
            loader_threads=loader_threads,
            source_payloads={s.name: _source_payload(cfg, s.name) for s in cfg.sources},
            tokenizer=dataclasses.asdict(cfg.tokenizer), generation=generation, had=had,
            lost=lost, actor=True, workers=[workers[0]], pure=False, key=key)
        return {"config": cfg.to_dict(), "planner": planner, "members": members,
                "generation": generation}

    @classmethod
    def connect(cls, address: str, name: str, *, timeout: float = 30.0,
                security: Any = None) -> DataService:
        """Attach to the running service ``name`` on the scheduler at ``address``."""
        from distributed import Client

        _check_tls(address, security)
        client = Client(address, direct_to_workers=True, timeout=timeout, security=security)
        key = _PREFIX + name
        deadline = time.monotonic() + timeout
        while key not in client.list_datasets():
            if time.monotonic() > deadline:
                running = [d[len(_PREFIX):] for d in client.list_datasets()
                           if str(d).startswith(_PREFIX)]
                client.close()
                raise ServiceError(f"no service named {name!r} on {address} after "
                                   f"{timeout:.0f}s (running: {running or 'none'})")
            time.sleep(0.2)
        registry = client.get_dataset(key)
        cfg = parse_config(registry["config"])
        return cls(client, cfg, registry)

    # --------------------------------------------------------------- readers
    def reader(self, rank: int, *, timeout: float | None = None) -> Reader:
        """An iterator over the batches of global ``rank``."""
        reader = Reader(self, rank, timeout=self.config.timeout if timeout is None else timeout)
        self._readers.add(reader)
        return reader

    def _tell_readers(self) -> None:
        """After the planner was re-created: every reader of this process tells the new
        constructors which steps it has.  All of them, not only the one that noticed:
        ranks read one after the other in one thread would otherwise wait for each other
        (a constructor holds at most ``prefetch`` steps a rank has not released)."""
        for reader in list(self._readers):
            reader._tell_new_generation()

    # ------------------------------------------------------------ operations
    def set_weights(self, weights: Mapping[str, float], from_step: int | None = None) -> int:
        """Change the mix; returns the first step planned with the new weights."""
        return int(self._ask("set_weights", dict(weights), from_step))

    def scale_loaders(self, source: str, n: int) -> int:
        """Serve ``source`` with ``n`` loaders (within its bounds); returns the count.

        Applied before the next step is planned.  Which loader reads a unit never
        changes the documents of a step: the stream does not depend on it.
        """
        return int(self._ask("scale", source, int(n)))

    def retire_workers(self, workers: list[str], *, close: bool = True) -> dict[str, int]:
        """Move the loaders and constructors off ``workers``, then retire them from Dask.

        Dask cannot retire a worker holding actors, and actors cannot move; this
        re-creates the roles elsewhere first (no document lost or repeated).  The
        planner's own worker cannot be retired this way.
        """
        import gc

        moved = dict(self._ask("evacuate", list(workers)))
        self.refresh()  # drop this client's handles of the moved roles ...
        if self._owner:
            self._keep_checkpoint()  # ... and stop holding their keys
        gc.collect()
        # ... and wait until nothing references them any more: Dask does not retire a
        # worker that still holds an actor
        deadline = time.monotonic() + self.config.timeout
        while held := self.client.run_on_scheduler(_keys_on, workers=list(workers),
                                                   prefix=f"msd-{self.name}-"):
            if time.monotonic() > deadline:
                raise ServiceTimeoutError(f"roles {held} on {list(workers)} were still "
                                          f"referenced after {self.config.timeout:.0f}s")
            time.sleep(0.2)
        if close:
            self.client.retire_workers(list(workers), close_workers=True)
        return moved

    def stats(self) -> dict[str, Any]:
        """Counters per source, per rank and for the planner.

        Returns
        -------
        dict
            ``sources``: documents and tokens read, tokens planned, loaders, share
            of planned tokens against the weight; ``ranks``: queue depth and last
            claimed step; ``planner``: steps, imbalance, errors.
        """
        planner = self._ask("stats")
        loader_stats = self._ask("loader_stats")
        self.refresh()
        cons = [self._constructor_stats(i, c) for i, c in enumerate(self.constructors)]
        sources = source_figures(planner, loader_stats, self._registry.get("quarantined", {}))
        ranks = rank_figures(cons)
        return {"sources": sources, "ranks": ranks, "planner": planner,
                "constructors": cons}

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The data-plane state after ``step``, to :meth:`start` again from (JSON-serialisable).

        Parameters
        ----------
        step : int, optional
            The last step the resumed service must not serve again.  Default:
            :meth:`consumed_step`, the last step every reader has returned (ranks
            that read further skip those steps again with their
            :meth:`Reader.load_state_dict`).

        Returns
        -------
        dict
            ``{"format", "name", "seed", "seq_len", "sources", "step", "planner"}``.

        Raises
        ------
        ValueError
            If ``step`` is not planned yet or no longer held (the service keeps
            the planner state of the last ``2 × prefetch + 16`` steps).
        """
        if step is None:
            step = self.consumed_step()
        return dict(self._ask("state_at", int(step)))

    def _constructor_stats(self, i: int, c: Any) -> dict[str, Any]:
        try:
            return dict(c.stats().result(timeout=self.config.timeout))
        except TimeoutError:
            raise ServiceTimeoutError(f"constructor {i} of service {self.name!r} did not answer "
                                      f"within {self.config.timeout:.0f}s (its worker may be "
                                      "lost; the planner re-creates it)") from None

    def consumed_step(self) -> int:
        """The last step every rank has returned (one before the first step if some has none).

        A reader of this process counts the last step it returned.  For a rank read
        in another process the constructors know less: a reader claims a whole round
        (``round_steps``) when it has returned every step before it, so a rank that
        holds part of a round counts up to the round's first step.  Either way no
        step a rank has not returned is counted; pass ``step`` to
        :meth:`state_dict` for the step your training loop checkpoints.
        """
        first = int(self._ask("start_step"))
        last: dict[int, int] = {}
        for i, c in enumerate(self.constructors):
            for r, s in self._constructor_stats(i, c)["returned"].items():
                last[int(r)] = max(last.get(int(r), -1), int(s))
        for reader in list(self._readers):
            done = reader.state_dict()["step"]
            if done is not None:
                last[reader.rank] = max(last.get(reader.rank, -1), int(done))
        return min(last.get(r, first - 1) for r in range(self.config.parallel.world_size))

    @property
    def dashboard_link(self) -> str:
        """The service's status page on the Dask dashboard's address (``/msd/status``)."""
        link = str(self.client.dashboard_link)
        base = link[:-len("/status")] if link.endswith("/status") else link.rstrip("/")
        return base + "/msd/status"

    # ---------------------------------------------------------------- close
    def close(self) -> None:
        """Stop the service (if this handle started it) and disconnect."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(self.config.timeout)
        try:
            if self._owner and self.client.status == "running":
                keys: list[Any] = [*(self._pinned or ()), self._registry["planner"].key]
                try:
                    keys += self.planner.role_keys().result(timeout=10)
                except Exception:  # noqa: BLE001 - best effort: the pinned keys still go
                    pass
                try:
                    self.planner.close_roles().result(timeout=30)
                except Exception:  # noqa: BLE001 - best effort: the cluster may be gone
                    pass
                self.client.unpublish_dataset(_PREFIX + self.name)
                if self._pinned is not None:
                    self.client.unpublish_dataset(_ROLES + self.name)
                self._forget(keys)
                self._tell_closed()
        finally:
            self.client.close()
            if self._cluster is not None:
                self._cluster.close()

    def _tell_closed(self) -> None:
        """Put a last ticket in every rank's queue that exists: a reader still waiting
        raises :class:`ServiceError` saying the service was closed, instead of timing
        out.  One call to the scheduler, whatever the number of ranks."""
        msg = {"error": "closed by its owner", "g": self.generation}
        try:
            self.client.run_on_scheduler(_put_in_queues, _rank_queues(self.config), msg)
        except Exception as e:  # noqa: BLE001 - best effort: the cluster may be gone
            _log.warning("msd_dask %s: could not tell the ranks the service closed: %r",
                         self.name, e)

    def _forget(self, keys: list[Any]) -> None:
        """Make Dask forget the closed roles' keys, whoever still holds a reference.

        Every client that unpickled a handle (the planner's worker, constructors,
        the plugin's cached registry) holds a reference to a role's key, and one
        kept past close kept the actor on its worker and the key on the scheduler
        for as long as the cluster ran.  Cancelling with ``force`` releases the
        keys for every client.
        """
        from distributed import Future

        if not keys:
            return
        futures: list[Any] = [Future(k, self.client) for k in dict.fromkeys(keys)]
        try:
            self.client.cancel(futures, force=True, reason=f"msd_dask service {self.name!r} closed")
        except Exception as e:  # noqa: BLE001 - best effort: the cluster may be gone
            _log.warning("msd_dask %s: could not release the roles' keys: %r", self.name, e)

    def __enter__(self) -> DataService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
