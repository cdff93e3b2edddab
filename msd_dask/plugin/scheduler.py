"""Scheduler plugin: every msd_dask service's figures on the dashboard and in Prometheus.

Install it at scheduler start with ``dask scheduler --preload msd_dask.plugin``
(or ``client.register_plugin(MsdSchedulerPlugin())``; registered again, the new one
replaces the first, which is closed).  Once a second it polls
the roles of every service published on the scheduler and serves

* ``/msd/status`` — a live page on the dashboard's own address: per source
  configured vs delivered weight, loaders, tokens/s, read seconds per token,
  buffer; the ranks' queue depths and claimed steps in quantiles, and the
  slowest ranks (every rank, too, up to ``RANKS_LISTED``); per step imbalance;
* ``/msd/api/status`` — the same as JSON;
* ``msd_*`` metrics on the scheduler's ``/metrics`` endpoint (the services of that
  scheduler, also where one process holds several).

Both pages go under the dashboard's prefix where it has one (``dask scheduler
--dashboard-prefix /dask``: ``/dask/msd/status``), as Dask's own pages do.

It also applies the adaptive loader policy (``scaling: {policy: adaptive}``),
and makes Dask's ``Adaptive`` (``cluster.adapt(...)``) serve the roles:

* ``adaptive_target`` (the RPC handler ``Adaptive`` calls, and the method the
  HTTP API ``/api/v1/adaptive_target`` calls) returns at least the workers the
  services' roles need (:func:`msd_dask.plugin.adaptive.workers_needed`);
* ``workers_to_close`` never proposes a worker that holds a role (an actor
  keyed ``msd-...``, or one being placed there): through the plugin hook
  ``valid_workers_downscaling`` and by filtering the handler's result.

Moving roles off a worker is :meth:`msd_dask.DataService.retire_workers`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

from msd_dask.core.figures import RANKS_LISTED, SLOWEST, source_figures
from msd_dask.dask_internals import published_datasets, scraped_server, wrap_scheduler_call

if TYPE_CHECKING:
    from msd_dask.core.scaling import PlannedRate

__all__ = ["MsdSchedulerPlugin", "dask_setup"]

logger = logging.getLogger(__name__)
_PREFIX = "msd-"
#: seconds a poll waits for a service's planner to apply its adaptive policy's decisions
SCALE_WAIT = 30.0
#: seconds a poll waits for a service's stats (its planner's, its roles')
POLL_WAIT = 10.0


def planner_of(registry: dict[str, Any], client: Any) -> Any:
    """The planner's actor handle of a service's published ``registry``, bound to
    ``client`` (:func:`~msd_dask.dask_internals.actor_on`: from its key and its worker)."""
    from msd_dask.dask_internals import actor_on
    from msd_dask.roles.planner import PlannerActor

    return actor_on(PlannerActor, registry["planner_worker"], registry["planner"].key, client)


async def collect(planner: Any, registry: dict[str, Any], since: int = 0,
                  lookahead: int | None = None) -> dict[str, Any]:
    """Gather the figures of one service from its roles (async; any client).

    One call to the service's ``planner`` (its actor handle, :func:`planner_of`;
    :meth:`~msd_dask.roles.planner.PlannerActor.snapshot`), which asks its loaders and
    constructors; its published ``registry`` gives the files quarantined.  ``history``
    holds the planner's per-step records from step ``since`` on; ``weights_ahead`` each
    source's largest weight over the next ``lookahead`` steps (``None`` without
    ``lookahead``).
    """
    snap = await planner.snapshot(since, lookahead)
    planner = snap["planner"]
    sources = source_figures(planner, snap["loaders"], registry.get("quarantined", {}))
    # (the ranks come summarised: nothing per rank reaches the scheduler at 16,384 ranks)
    return {"sources": sources, "ranks": snap["ranks"], "rank_summary": snap["rank_summary"],
            "planner": planner, "history": snap["history"],
            "weights_ahead": snap["weights_ahead"], "constructors": snap["constructors"],
            "time": time.time()}


class _Page(web.RequestHandler):
    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(_page())


class _Api(web.RequestHandler):
    def initialize(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def get(self) -> None:
        # the plugin installed now, not the one that added the route: a plugin registered
        # again (a preload and a register_plugin) replaces the first, whose route came first
        plugin = _installed_plugin(self.scheduler)
        if plugin is None:
            raise web.HTTPError(404, "the msd_dask plugin is not installed on this scheduler")
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(plugin.status(), default=str))


def _installed_plugin(scheduler: Any) -> MsdSchedulerPlugin | None:
    """The :class:`MsdSchedulerPlugin` installed on ``scheduler``, if any."""
    plugin = getattr(scheduler, "plugins", {}).get(MsdSchedulerPlugin.name)
    return plugin if isinstance(plugin, MsdSchedulerPlugin) else None


class MsdSchedulerPlugin(SchedulerPlugin):
    """Polls every msd_dask service on this scheduler and publishes its figures.

    Parameters
    ----------
    interval : float
        Seconds between polls.
    """

    name = "msd_dask"

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.services: dict[str, dict[str, Any]] = {}
        self.rates: dict[str, dict[str, float]] = {}
        #: service name -> its last poll's failure (``repr``), while it fails
        self.poll_errors: dict[str, str] = {}
        self.imbalance: dict[str, deque[tuple[int, float]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._configs: dict[str, Any] = {}
        self._scalers: dict[str, Any] = {}
        #: service -> its sources' read costs at their loader counts (ReadCostAtCount)
        self._read_costs: dict[str, Any] = {}
        #: the adaptive policy's decisions per service
        self.decisions: dict[str, deque[dict[str, Any]]] = {}
        self.scheduler: Any = None
        #: source -> loaders the adaptive policy wants, per service (last poll)
        self._targets: dict[str, dict[str, int]] = {}
        #: roles each service wants (last poll), for ``adaptive_target``
        self._wanted: dict[str, int] = {}
        #: per service: the snapshot its adaptive policy was last evaluated from (the next
        #: evaluation comes ``scaling.interval`` seconds after it, over the time between)
        self._scaled_from: dict[str, dict[str, Any]] = {}
        #: service -> its consumption's readings (the policy's, over scale_down_after)
        self._planned: dict[str, PlannedRate] = {}
        #: what puts back each scheduler entry point :meth:`_hook` wrapped
        self._unhooks: list[Callable[[], None]] = []
        #: name -> (the scheduler's entry of the published dataset, registry, its planner's
        #: handle): a registry is fetched again only when it is published again (a new
        #: entry) or a poll fails
        self._registries: dict[str, tuple[Any, dict[str, Any], Any]] = {}
        #: registries fetched from the scheduler, and polls done (for tests and the docs)
        self.registry_fetches = 0
        self.polls = 0
        #: the scheduler's dashboard prefix its pages are served under ("" for none)
        self.http_prefix = ""
        #: per service: its poll under way (:meth:`poll`)
        self._polling: dict[str, asyncio.Task[None]] = {}

    async def start(self, scheduler: Any) -> None:
        # a plugin registered again replaces this scheduler's first (Dask's add_plugin
        # does not close it): closed, it stops polling every service and steering
        # Adaptive beside this one, and leaves /metrics
        for old in [p for p in _LIVE_PLUGINS if p.scheduler is scheduler and p is not self]:
            await old.close()
        self.scheduler = scheduler
        # under the dashboard's prefix (``dask scheduler --dashboard-prefix``), as Dask's
        # own pages are: the reverse proxy that prefix is for forwards nothing else
        self.http_prefix = _http_prefix(scheduler)
        at = re.escape(self.http_prefix)
        scheduler.http_application.add_handlers(r".*", [
            (at + r"/msd/status/?", _Page),
            (at + r"/msd/api/status/?", _Api, {"scheduler": scheduler}),
        ])
        _register_collector(self)
        self._hook(scheduler)
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        _unregister_collector(self)
        self._unhook()
        if self._task is not None:
            self._task.cancel()
        for task in self._polling.values():
            task.cancel()
        if self._client is not None:
            await self._client.close()

    async def _run(self) -> None:
        from distributed import Client

        failed = None
        while True:
            await asyncio.sleep(self.period())
            try:
                if self._client is None:
                    self._client = await Client(self.scheduler.address, asynchronous=True,
                                                direct_to_workers=True, name="msd-plugin",
                                                security=_as_client(self.scheduler.security))
                await self.poll(wait=self.period())
                failed = None
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a poll must never take the scheduler down
                # (said once per kind of failure: a plugin that cannot poll shows nothing,
                # and its adaptive policy does nothing)
                if repr(e) != failed:
                    logger.warning("msd_dask plugin: polling failed: %r", e)
                failed = repr(e)

    def period(self) -> float:
        """Seconds between polls: :attr:`interval`, or less where an adaptive service's
        ``scaling.interval`` (seconds between evaluations of its policy) is shorter."""
        return min([self.interval, *(c.scaling.interval for c in self._configs.values()
                                     if c.scaling.policy == "adaptive")])

    async def poll(self, wait: float | None = None) -> None:
        """Refresh the figures of every published service.

        Each service is polled on its own, one poll of it at a time: a service still
        being polled from an earlier call (its planner slow to answer: up to
        :data:`POLL_WAIT` and :data:`SCALE_WAIT`) is not polled again meanwhile.

        Parameters
        ----------
        wait : float, optional
            Seconds to wait for the services' polls (the plugin's own loop: its period,
            so that one service that does not answer holds back no other's next poll);
            ``None``: until every one is done.
        """
        published = published_datasets(self.scheduler)
        listed = list(published) if published is not None else await self._client.list_datasets()
        names = [n for n in listed if str(n).startswith(_PREFIX)]
        self.polls += 1
        # closed services first, before any registry is fetched: a fetch tells the
        # scheduler every key this plugin's client holds, and a closed service's keys
        # are gone (the scheduler warns "desires key ... but key is unknown")
        for gone in self._known() - _names(names):
            self._forget(gone)
        # (each on its own: one after another, a service whose planner does not answer held
        # back the figures of every service after it by up to POLL_WAIT + SCALE_WAIT, and
        # awaited together, every service's next poll waited for it)
        polls = [self._polling_of(key) for key in names]
        if polls:
            await asyncio.wait(polls, timeout=wait)

    def _polling_of(self, key: Any) -> asyncio.Task[None]:
        """The poll under way of the service published under ``key``, started if none is."""
        name = str(key)[len(_PREFIX):]
        task = self._polling.get(name)
        if task is None:
            task = asyncio.ensure_future(self._poll_one(key))
            self._polling[name] = task

            def done(t: asyncio.Task[None]) -> None:
                if self._polling.get(name) is t:
                    del self._polling[name]

            task.add_done_callback(done)
        return task

    async def _poll_one(self, key: Any) -> None:
        """:meth:`_poll_service`, its failure recorded in :attr:`poll_errors` and logged."""
        name = str(key)[len(_PREFIX):]
        try:
            await self._poll_service(key)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - one service's failure stops no other
            # (its registry stays: a new planner, or a new service of that name,
            # publishes a new entry, and a refetch of a service being closed would ask
            # for keys its owner is about to forget); logged when the failure changes
            if self.poll_errors.get(name) != repr(e):
                logger.warning("msd_dask plugin: service %r did not answer its poll: %r",
                               name, e)
            self.poll_errors[name] = repr(e)
        else:
            self.poll_errors.pop(name, None)

    async def _poll_service(self, key: Any) -> None:
        """Refresh the figures of the service published under ``key``."""
        name = str(key)[len(_PREFIX):]
        registry, planner = await self._registry(key)
        if name not in self._configs:
            from msd_dask.core.config import parse_config

            self._configs[name] = parse_config(registry["config"])
        hist = self.imbalance.setdefault(name, deque(maxlen=300))
        since = hist[-1][0] + 1 if hist else 0
        sc = self._configs[name].scaling
        try:
            snap = await asyncio.wait_for(
                collect(planner, registry, since,
                        sc.lookahead if sc.policy == "adaptive" else None),
                POLL_WAIT)
        except TimeoutError:
            raise TimeoutError(f"the planner of {name!r} did not answer its stats within "
                               f"{POLL_WAIT:g}s") from None
        prev = self.services.get(name)
        if prev is not None:
            dt = snap["time"] - prev["time"]
            rates = {}
            for src, v in snap["sources"].items() if dt > 0 else ():
                read = v["tokens_read"] - prev["sources"].get(src, {}).get("tokens_read", 0)
                # (fewer: the planner was re-created since, and its loaders count on from
                # the owner's last checkpoint, up to a second old; the last rate stands for
                # this poll)
                rates[src] = read / dt if read >= 0 else self.rates.get(name, {}).get(src, 0.0)
            self.rates[name] = rates
        self.services[name] = snap
        hist.extend((h["step"], h["imbalance"]) for h in snap.pop("history"))
        base = self._scaled_from.setdefault(name, snap)
        # (within half a poll: polls one interval apart evaluate at every poll)
        if snap["time"] > base["time"] and \
                snap["time"] - base["time"] >= sc.interval - self.period() / 2:
            self._scaled_from[name] = snap
            # (bounded: one service's planner that stops answering must not stall the
            # polls, the dashboard and the metrics of every service)
            try:
                await asyncio.wait_for(self._scale(name, planner, snap, base), SCALE_WAIT)
            except TimeoutError:
                raise TimeoutError(f"applying the scaling decisions of {name!r} took more than "
                                   f"{SCALE_WAIT:g}s") from None
        from msd_dask.plugin.adaptive import roles_wanted

        self._wanted[name] = roles_wanted(snap["constructors"], snap["planner"]["loaders"],
                                          self._targets.get(name))

    def _per_service(self) -> tuple[dict[str, Any], ...]:
        """Every table this plugin keeps per service name."""
        return (self.services, self.rates, self.imbalance, self.decisions, self._configs,
                self._scalers, self._read_costs, self._targets, self._wanted, self._registries,
                self.poll_errors, self._scaled_from, self._planned)

    def _known(self) -> set[str]:
        """Names of the services this plugin holds anything for."""
        return set().union(*self._per_service())

    def _forget(self, name: str) -> None:
        """Drop everything held for service ``name`` (closed): its registry (the handles
        that keep its keys referenced), figures, history and policy state; a later service
        of that name starts afresh (its own config, history from its step 0).  Its poll
        under way, if any and not the caller (a poll finding the service started again),
        is cancelled: it would put back what was dropped."""
        task = self._polling.get(name)
        if task is not None and task is not asyncio.current_task():
            del self._polling[name]
            task.cancel()
        for table in self._per_service():
            table.pop(name, None)

    #: a registry's planner handle for this plugin's client (:func:`planner_of`; a test's
    #: fake registries give their own)
    planner_of = staticmethod(planner_of)

    async def _registry(self, key: Any) -> tuple[dict[str, Any], Any]:
        """A service's published registry and its planner's handle; fetched (≈21 KB) only
        when published anew.

        Publishing stores a new entry on the scheduler, so the entry's identity
        tells whether the cached registry is still the published one.
        """
        name = str(key)[len(_PREFIX):]
        published = published_datasets(self.scheduler)
        entry = published.get(key) if published is not None else None
        cached = self._registries.get(name)
        if cached is not None and entry is not None and cached[0] is entry:
            return cached[1], cached[2]
        # stale registries' handles go before the fetch (see :meth:`poll`): this name's
        # planner may be gone (re-created, or the service closed and started again), and
        # so may any service closed since the poll began
        owner = None if cached is None else cached[1].get("owner")
        generation = None if cached is None else cached[1].get("generation")
        del cached
        self._registries.pop(name, None)
        if published is not None:
            for gone in set(self._registries) - _names(published):
                del self._registries[gone]
        await self._release_unknown()
        registry = await self._client.get_dataset(key)
        self.registry_fetches += 1
        if owner is not None and registry.get("owner") != owner:
            # another service of this name (closed and started again between two polls):
            # nothing of the old one's (config, history, policy) stands for it; a planner
            # re-created by the same owner keeps them
            self._forget(name)
        elif generation is not None and registry.get("generation") != generation:
            # a re-created planner counts on from the owner's last checkpoint, behind the
            # lost one's counts, and its waits from 0: the policy's next window would take
            # the two planners' difference, negative consumption and starvation, which
            # dropped a source's floor and started its scale-down timer (a review).  The
            # new planner's first poll starts the next window
            self._scaled_from.pop(name, None)
        planner = self.planner_of(registry, self._client)
        self._registries[name] = (entry, registry, planner)
        return registry, planner

    async def _release_unknown(self) -> None:
        """Before a fetch: let go of the handles this client holds on keys the scheduler
        has forgotten (a closed service's, a lost planner's).

        A fetch tells the scheduler every key the client holds.  A call through an
        actor handle leaves the handle in a reference cycle (Dask's call closure refers
        to itself), so a closed service's planner handle, and its key, outlive the call
        until the collector runs: run it now, then let the released keys go (their
        release is a callback on this loop).  Only when such a key is held: a fetch
        is rare (a service published anew), a collection is not free.
        """
        import gc

        held = list(getattr(self._client, "refcount", ()))
        if any(k not in self.scheduler.tasks for k in held):
            gc.collect()
            await asyncio.sleep(0)

    async def _scale(self, name: str, planner: Any, snap: dict[str, Any],
                     prev: dict[str, Any]) -> None:
        """Apply the adaptive loader policy (``scaling: {policy: adaptive}``) to a service."""
        from msd_dask.core.scaling import PlannedRate, ReadCostAtCount, Scaler, ScalingPolicy, SourceLoad

        cfg = self._configs[name]
        if cfg.scaling.policy != "adaptive":
            return
        if name not in self._scalers:
            self._scalers[name] = Scaler(ScalingPolicy.from_config(cfg))
        dt = snap["time"] - prev["time"]
        consumption = self._planned.setdefault(
            name, PlannedRate(cfg.scaling.scale_down_after)).update(
                snap["time"], sum(snap["planner"]["tokens_planned"].values()))
        ahead = snap["weights_ahead"]
        cores = float(sum(ws.nthreads for ws in self.scheduler.workers.values()
                          if _running(ws)))
        costs = self._read_costs.setdefault(name, ReadCostAtCount())
        loads = {}
        for s, v in snap["sources"].items():
            starved = (snap["planner"]["starved_seconds"].get(s, 0.0)
                       - prev["planner"]["starved_seconds"].get(s, 0.0)) / dt
            n = int(snap["planner"]["loaders"][s])
            # (at this count: see ReadCostAtCount; the CPU a token's preprocessing takes is
            # the data's, not the count's: from the start)
            spt, wait = costs.update(s, n, v["tokens_read"], v["read_seconds"],
                                     v["cpu_wait_seconds"])
            loads[s] = SourceLoad(
                loaders=n, weight_ahead=float(ahead[s]), consumption=consumption,
                seconds_per_token=spt, threads=int(v["threads"]),
                starved=starved, cpu_per_token=(v["cpu_seconds"] / v["tokens_read"]
                                                if v["tokens_read"] else 0.0),
                cpu_fraction=_cpu_fraction(v, prev["sources"].get(s)), cores=cores,
                core_wait_per_token=wait)
        scaler = self._scalers[name]
        decided = scaler.decide(time.monotonic(), loads)
        self._targets[name] = {s: scaler.target(s, ld) for s, ld in loads.items()}
        for s, n in decided.items():
            # recorded before it is applied: a scale that waits for new workers may outlast
            # this poll's SCALE_WAIT, and the planner applies it all the same
            decision = {"time": time.time(), "source": s, "loaders": n, "applied": False,
                        "from": loads[s].loaders, "starved": loads[s].starved,
                        "consumption": loads[s].consumption,
                        "seconds_per_token": loads[s].seconds_per_token,
                        "cpu_fraction": scaler.cpu_fraction.get(s, 0.0),
                        "cpu_cap": scaler.cpu_caps.get(s), "saturated": scaler.saturated.get(s),
                        "cores": cores}
            self.decisions.setdefault(name, deque(maxlen=1000)).append(decision)
            decision["loaders"] = await planner.scale(s, n)
            decision["applied"] = True

    # ------------------------------------------------------------ Dask's Adaptive
    def _hook(self, scheduler: Any) -> None:
        """Wrap ``adaptive_target`` and ``workers_to_close`` (RPC handlers and methods)."""
        wrappers: dict[str, Callable[..., Any]] = {
            "adaptive_target": self._adaptive_target, "workers_to_close": self._workers_to_close}
        for name, wrap in wrappers.items():
            self._unhooks.append(wrap_scheduler_call(scheduler, name, wrap))

    def _unhook(self) -> None:
        """Put back what :meth:`_hook` wrapped (unless something wrapped it again since)."""
        for unhook in reversed(self._unhooks):
            unhook()
        self._unhooks.clear()

    def _active(self) -> bool:
        """Whether this plugin is still installed (a removed one must not steer Adaptive)."""
        return self.scheduler is not None and _installed_plugin(self.scheduler) is self

    def role_holders(self) -> set[str]:
        """Addresses of the workers that hold an msd_dask role, or are being given one."""
        sched = self.scheduler
        held = {ws.address for ws in sched.workers.values()
                if any(_is_role(ts) for ts in ws.actors)}
        for ts in list(getattr(sched, "unrunnable", ())):  # placed on a worker not ready yet
            if _is_role(ts):
                held.update(ts.worker_restrictions or ())
        return held

    def workers_needed(self) -> int:
        """Workers the roles of every service need (see :mod:`msd_dask.plugin.adaptive`)."""
        from msd_dask.plugin.adaptive import capacity, workers_needed

        sched = self.scheduler
        # configs of closed services are dropped at the next poll; a config is known before
        # the service's first snapshot (which can fail or time out under load)
        rpw = [c.scaling.roles_per_worker for c in self._configs.values()
               if c.scaling.roles_per_worker > 0]
        per_worker = min(rpw) if rpw else 0
        holders = self.role_holders()
        workers = list(sched.workers.values())
        placed = sum(_is_role(ts) for ws in workers for ts in ws.actors)
        roles = max(placed, sum(self._wanted.values()))
        held = [capacity(ws.nthreads, per_worker) for ws in workers if ws.address in holders]
        free = [capacity(ws.nthreads, per_worker) for ws in workers if ws.address not in holders]
        new = capacity(min((ws.nthreads for ws in workers), default=1), per_worker)
        return workers_needed(roles, held, free, new)

    def _adaptive_target(self, original: Callable[..., int], *args: Any, **kwargs: Any) -> int:
        target = original(*args, **kwargs)
        if not self._active():
            return target
        try:
            need = self.workers_needed()
        except Exception as e:  # noqa: BLE001 - Adaptive must keep its own answer then
            logger.warning("msd_dask: could not count the workers the roles need: %r", e)
            return target
        if need > target:
            logger.debug("msd_dask: adaptive target %d -> %d (roles)", target, need)
        return max(target, need)

    def _workers_to_close(self, original: Callable[..., list[Any]], *args: Any,
                          **kwargs: Any) -> list[Any]:
        out = original(*args, **kwargs)
        if not self._active() or not out:
            return out
        attribute = kwargs.get("attribute", args[5] if len(args) > 5 else "address")
        key = kwargs.get("key", args[2] if len(args) > 2 else None)
        if isinstance(key, bytes):
            from distributed.protocol import pickle

            key = pickle.loads(key)
        workers = self.scheduler.workers.values()
        holders = self.role_holders()
        # workers closed together (``key``: e.g. one dask-jobqueue job) stay together
        groups = {key(ws) for ws in workers if ws.address in holders} if key else set()
        keep = {getattr(ws, attribute) for ws in workers
                if ws.address in holders or (key and key(ws) in groups)}
        return [w for w in out if w not in keep]

    def valid_workers_downscaling(self, scheduler: Any, workers: list[Any]) -> list[Any]:
        """Dask's hook in ``workers_to_close``: a worker holding a role is never a candidate."""
        if not self._active():
            return workers
        keep = self.role_holders()
        return [ws for ws in workers if ws.address not in keep]

    def status(self) -> dict[str, Any]:
        """Everything the page shows, as JSON-able data."""
        out = {}
        for name, snap in self.services.items():
            rates = self.rates.get(name, {})
            sources = {s: dict(v, tokens_per_second=rates.get(s, 0.0))
                       for s, v in snap["sources"].items()}
            ranks = snap["ranks"]
            out[name] = {"sources": sources, "rank_summary": snap["rank_summary"],
                         # every rank only while that stays readable
                         "ranks": ranks if len(ranks) <= RANKS_LISTED else {},
                         "steps_planned": snap["planner"]["steps_planned"],
                         "mean_imbalance": snap["planner"]["mean_imbalance"],
                         "imbalance": list(self.imbalance.get(name, [])),
                         "scaling": list(self.decisions.get(name, []))[-20:],
                         "error": snap["planner"].get("error"),
                         # the last polls failed: these figures are the last answered one's
                         "poll_error": self.poll_errors.get(name),
                         "answered_at": snap["time"]}
        # services whose polls failed from the first (a planner out of reach, or busy past
        # POLL_WAIT with its first step at scale): named, with why, not left off the page
        unanswered = {name: err for name, err in self.poll_errors.items() if name not in out}
        return {"services": out, "unanswered": unanswered, "time": time.time()}


def _as_client(security: Any) -> Any:
    """The scheduler's ``Security`` as its plugin's client takes it: on a TLS cluster (``dask
    scheduler --tls-*`` gives the scheduler alone its credentials) the client presents the
    scheduler's own certificate; ``None`` on a plain one."""
    from distributed.security import Security

    if security is None or not security.tls_scheduler_cert:
        return security
    return Security(tls_ca_file=security.tls_ca_file, tls_client_cert=security.tls_scheduler_cert,
                    tls_client_key=security.tls_scheduler_key,
                    require_encryption=security.require_encryption)


def _http_prefix(scheduler: Any) -> str:
    """The prefix the scheduler serves its dashboard under: ``"/a/b"``, or ``""`` for none.

    Dask does not keep ``Scheduler(http_prefix=...)`` (``dask scheduler
    --dashboard-prefix``); it puts it in front of each route of the modules of
    ``distributed.scheduler.http.routes``.  So the prefix is what stands in front of
    those routes in the scheduler's HTTP application (the most common answer, should a
    route of one module end like that of another).

    Parameters
    ----------
    scheduler : distributed.Scheduler
        A scheduler whose HTTP server is started.

    Returns
    -------
    str
        The prefix, with a leading and no trailing slash; ``""`` where there is none
        or none can be told.
    """
    import importlib
    from collections import Counter

    import dask

    app = getattr(scheduler, "http_application", None)
    patterns = [getattr(getattr(rule.matcher, "regex", None), "pattern", "")
                for rule in (app.wildcard_router.rules if app is not None else ())]
    votes: Counter[str] = Counter()
    for module in dask.config.get("distributed.scheduler.http.routes", None) or ():
        try:
            routes = importlib.import_module(module).routes
        except Exception:  # noqa: BLE001 - a module Dask could not load either
            continue
        for url, *_ in routes:
            tail = str(url).lstrip("/") + "$"  # (tornado anchors each route with "$")
            if tail == "$":  # (the prefix itself: no telling where it ends)
                continue
            for pattern in patterns:
                head = pattern[:-len(tail)]
                if pattern.endswith(tail) and head.startswith("/") and head.endswith("/"):
                    votes[head] += 1
    return votes.most_common(1)[0][0].rstrip("/") if votes else ""


def _names(published: Any) -> set[str]:
    """The names of the services among published dataset names."""
    return {str(k)[len(_PREFIX):] for k in published if str(k).startswith(_PREFIX)}


def _running(ws: Any) -> bool:
    """Whether a scheduler's worker state is running (not paused, not closing)."""
    status = getattr(ws, "status", None)
    return status is None or getattr(status, "name", str(status)) == "running"


def _cpu_fraction(now: dict[str, Any], before: dict[str, Any] | None) -> float:
    """CPU seconds / busy seconds of a source's loaders between two polls (0: unknown).

    The busy seconds do not count the time the loaders waited for a core (other
    threads had them), so a CPU-bound source is near 1 on a contended machine too.
    Unknown when a loader does not measure CPU, when the loaders changed (a removed
    loader takes its counters with it), when one had measured none at the last poll (a
    loader just added: the source's ``cpu_seconds`` then reads 0, and the window took the
    other loaders' whole history, a fraction far above 1 that the scaler kept as 1, capping
    an I/O-bound source at one loader for good; a review) or when no unit was read in
    between.
    """
    if (before is None or now["loaders"] != before["loaders"] or not now["cpu_seconds"]
            or not before.get("cpu_seconds")):
        return 0.0
    busy = now["read_seconds"] - before["read_seconds"]
    busy -= now["cpu_wait_seconds"] - before.get("cpu_wait_seconds", 0.0)
    cpu = now["cpu_seconds"] - before.get("cpu_seconds", 0.0)
    return cpu / busy if busy > 0 and cpu >= 0 else 0.0


def _is_role(ts: Any) -> bool:
    """Whether a scheduler task is an msd_dask role (planner, constructor or loader actor)."""
    return bool(ts.actor) and str(ts.key).startswith(_PREFIX)


def _page() -> str:
    from importlib.resources import files

    return files("msd_dask.plugin").joinpath("static/status.html").read_text(encoding="utf-8")


#: the plugins started in this process and not closed (one per scheduler: a process with
#: several schedulers, embedded clusters say, shares prometheus_client's one registry)
_LIVE_PLUGINS: list[MsdSchedulerPlugin] = []
_COLLECTOR: list[Any] = []


def _unregister_collector(plugin: MsdSchedulerPlugin) -> None:
    """A closed plugin's services leave ``/metrics``."""
    if plugin in _LIVE_PLUGINS:
        _LIVE_PLUGINS.remove(plugin)


def _scraped_status() -> dict[str, Any]:
    """The services of the plugin of the scheduler whose ``/metrics`` is being rendered:
    every live plugin's were, so a process with two schedulers (two embedded services)
    reported each service on both, and a name on both schedulers twice or one over the
    other.  Outside a render of Dask's (prometheus_client's registry read directly, as
    :func:`~msd_dask.dask_internals.scraped_server` tells), those of every installed
    plugin of the process."""
    server = scraped_server()
    plugins = [p for p in _LIVE_PLUGINS if p._active() and (server is None
                                                            or p.scheduler is server)]
    services: dict[str, Any] = {}
    unanswered: dict[str, str] = {}
    for p in plugins:
        status = p.status()
        services.update(status["services"])
        unanswered.update(status["unanswered"])
    return {"services": services,
            "unanswered": {k: v for k, v in unanswered.items() if k not in services}}


def _register_collector(plugin: MsdSchedulerPlugin) -> None:
    """Expose ``msd_*`` metrics through prometheus_client's default registry: the services
    of every live plugin of this process (the registry is the process's)."""
    try:
        from prometheus_client.core import REGISTRY, GaugeMetricFamily
    except ImportError:  # pragma: no cover - prometheus_client is optional
        return
    if plugin not in _LIVE_PLUGINS:
        _LIVE_PLUGINS.append(plugin)
    if _COLLECTOR:
        return

    class _Collector:
        def collect(self) -> Any:
            status = _scraped_status()
            st: dict[str, Any] = status["services"]
            unanswered: dict[str, str] = status["unanswered"]
            # whether the figures are current: a service whose polls fail keeps its last
            # answered figures (its tokens/s among them), so alert on these, not on a rate
            ok = GaugeMetricFamily("msd_poll_ok", "1 if the service answered the plugin's last "
                                   "poll; 0 if it failed (its other figures are those of the "
                                   "last poll it answered, if any)", labels=["service"])
            at = GaugeMetricFamily("msd_poll_answered_timestamp_seconds", "Unix time of the "
                                   "last poll the service answered", labels=["service"])
            # a planner that stopped planning (its error) still answers every poll: its
            # poll_ok stayed 1 and nothing on /metrics said it had failed (a review)
            failed = GaugeMetricFamily("msd_planner_failed", "1 if the service's planner "
                                       "stopped planning (the page and /msd/api/status give "
                                       "its error), else 0", labels=["service"])
            for svc, d in st.items():
                ok.add_metric([svc], 0.0 if d["poll_error"] else 1.0)
                at.add_metric([svc], float(d["answered_at"]))
                failed.add_metric([svc], 1.0 if d["error"] else 0.0)
            for svc in unanswered:
                ok.add_metric([svc], 0.0)
            yield from (ok, at, failed)
            per_source = {
                "weight": "Configured token share of the source (normalised)",
                "share": "Delivered (planned) token share of the source",
                "loaders": "Source loaders serving the source",
                "tokens_read": "Tokens read and tokenized by the source's loaders",
                "tokens_per_second": "Tokens read per second over the last poll",
                "seconds_per_token": "Loader read+tokenize seconds per token",
                "tokens_buffered": "Tokens held by the source's loaders",
            }
            for field, doc in per_source.items():
                g = GaugeMetricFamily(f"msd_source_{field}", doc, labels=["service", "source"])
                for svc, d in st.items():
                    for src, v in d["sources"].items():
                        g.add_metric([svc, src], float(v[field]))
                yield g
            # a few series per service whatever the number of ranks
            n = GaugeMetricFamily("msd_ranks", "Ranks served", labels=["service"])
            q = GaugeMetricFamily("msd_rank_queue_depth_quantile", "Batches published, not yet claimed, "
                                  "over the ranks (quantile 0, 0.5, 0.9, 1)",
                                  labels=["service", "quantile"])
            lag = GaugeMetricFamily("msd_rank_lag_steps", "Steps between the most and the least "
                                    "advanced rank", labels=["service"])
            # (by place, not by rank: a label per rank id made a new series of each rank
            # that was once among the slowest, without end at 16,384 ranks)
            slow = GaugeMetricFamily("msd_slowest_rank_last_claimed", "Last step claimed by the "
                                     f"least advanced ranks (up to {SLOWEST}, least advanced "
                                     "first; -1: none yet)", labels=["service", "place"])
            slow_rank = GaugeMetricFamily("msd_slowest_rank", "Global rank of the least advanced "
                                          f"ranks (up to {SLOWEST}, least advanced first)",
                                          labels=["service", "place"])
            steps = GaugeMetricFamily("msd_steps_planned", "Steps planned", labels=["service"])
            imb = GaugeMetricFamily("msd_step_imbalance_mean",
                                    "Mean max/mean rank cost per step", labels=["service"])
            for svc, d in st.items():
                summary = d["rank_summary"]
                n.add_metric([svc], float(summary["ranks"]))
                depth = summary["queue_depth"]
                if depth is not None:
                    for name, quantile in (("min", "0"), ("p50", "0.5"), ("p90", "0.9"),
                                           ("max", "1")):
                        q.add_metric([svc, quantile], float(depth[name]))
                lag.add_metric([svc], float(summary["lag"]))
                for place, v in enumerate(summary["slowest"]):
                    claimed = v["last_claimed"]
                    slow.add_metric([svc, str(place)], float(-1 if claimed is None else claimed))
                    slow_rank.add_metric([svc, str(place)], float(v["rank"]))
                steps.add_metric([svc], float(d["steps_planned"]))
                imb.add_metric([svc], float(d["mean_imbalance"]))
            yield from (n, q, lag, slow, slow_rank, steps, imb)

    _COLLECTOR.append(_Collector())
    REGISTRY.register(_COLLECTOR[0])


def dask_setup(scheduler: Any) -> None:
    """Entry point of ``dask scheduler --preload msd_dask.plugin``."""
    scheduler.add_plugin(MsdSchedulerPlugin())
