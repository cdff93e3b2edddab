"""Scheduler plugin: every msd_dask service's figures on the dashboard and in Prometheus.

Install it at scheduler start with ``dask scheduler --preload msd_dask.plugin``
(or ``client.register_plugin(MsdSchedulerPlugin())``).  Once a second it polls
the roles of every service published on the scheduler and serves

* ``/msd/status`` — a live page on the dashboard's own address: per source
  configured vs delivered weight, loaders, tokens/s, read seconds per token,
  buffer; per rank queue depth; per step imbalance;
* ``/msd/api/status`` — the same as JSON;
* ``msd_*`` metrics on the scheduler's ``/metrics`` endpoint.

Sizing loaders to demand (the adaptive policy) is not part of this module yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from tornado import web

__all__ = ["MsdSchedulerPlugin", "dask_setup"]

logger = logging.getLogger(__name__)
_PREFIX = "msd-"


async def collect(registry: dict[str, Any], since: int = 0) -> dict[str, Any]:
    """Gather the figures of one service from its roles (async; any client).

    ``history`` holds the planner's per-step records from step ``since`` on.
    """
    coordinator = await registry["coordinator"]
    constructors = (await coordinator.handles())["constructors"]
    planner = await coordinator.stats()
    loader_stats = await coordinator.loader_stats()
    cons = [await c.stats() for c in constructors]
    total = sum(planner["tokens_planned"].values()) or 1
    sources = {}
    for name, ls in loader_stats.items():
        tokens_read = sum(x["tokens_read"] for x in ls)
        read_seconds = sum(x["read_seconds"] for x in ls)
        sources[name] = {
            "loaders": len(ls),
            "docs_read": sum(x["docs_read"] for x in ls),
            "tokens_read": tokens_read,
            "tokens_buffered": sum(x["tokens_buffered"] for x in ls),
            "units_buffered": sum(x["units_buffered"] for x in ls),
            "tokens_planned": planner["tokens_planned"][name],
            "share": planner["tokens_planned"][name] / total,
            "weight": planner["weights"][name],
            "read_seconds": read_seconds,
            "seconds_per_token": read_seconds / tokens_read if tokens_read else 0.0,
            "threads": ls[0].get("threads", 1) if ls else 1,
        }
    ranks = {}
    for c in cons:
        for r, depth in c["queue_depth"].items():
            ranks[str(r)] = {"queue_depth": depth, "last_claimed": c["last_claimed"].get(r)}
    history = await coordinator.history_since(since)
    return {"sources": sources, "ranks": ranks, "planner": planner, "history": history,
            "time": time.time()}


class _Page(web.RequestHandler):
    def initialize(self, plugin: MsdSchedulerPlugin) -> None:
        self.plugin = plugin

    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(_page())


class _Api(web.RequestHandler):
    def initialize(self, plugin: MsdSchedulerPlugin) -> None:
        self.plugin = plugin

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(self.plugin.status(), default=str))


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
        self.imbalance: dict[str, deque[tuple[int, float]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._configs: dict[str, Any] = {}
        self._scalers: dict[str, Any] = {}
        #: the adaptive policy's decisions per service
        self.decisions: dict[str, deque[dict[str, Any]]] = {}
        self.scheduler: Any = None

    async def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        scheduler.http_application.add_handlers(r".*", [
            (r"/msd/status/?", _Page, {"plugin": self}),
            (r"/msd/api/status/?", _Api, {"plugin": self}),
        ])
        _register_collector(self)
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._client is not None:
            await self._client.close()

    async def _run(self) -> None:
        from distributed import Client

        while True:
            await asyncio.sleep(self.interval)
            try:
                if self._client is None:
                    self._client = await Client(self.scheduler.address, asynchronous=True,
                                                direct_to_workers=True, name="msd-plugin")
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a poll must never take the scheduler down
                logger.debug("msd_dask plugin poll failed: %r", e)

    async def poll(self) -> None:
        """Refresh the figures of every published service."""
        names = [n for n in await self._client.list_datasets() if str(n).startswith(_PREFIX)]
        for key in names:
            name = str(key)[len(_PREFIX):]
            registry = await self._client.get_dataset(key)
            hist = self.imbalance.setdefault(name, deque(maxlen=300))
            since = hist[-1][0] + 1 if hist else 0
            snap = await asyncio.wait_for(collect(registry, since), 10)
            prev = self.services.get(name)
            if prev is not None:
                dt = snap["time"] - prev["time"]
                self.rates[name] = {
                    s: (v["tokens_read"] - prev["sources"].get(s, {}).get("tokens_read", 0)) / dt
                    for s, v in snap["sources"].items()} if dt > 0 else {}
            self.services[name] = snap
            hist.extend((h["step"], h["imbalance"]) for h in snap.pop("history"))
            if prev is not None and snap["time"] > prev["time"]:
                await self._scale(name, registry, snap, prev)
        for gone in set(self.services) - {str(k)[len(_PREFIX):] for k in names}:
            self.services.pop(gone, None)

    async def _scale(self, name: str, registry: dict[str, Any], snap: dict[str, Any],
                     prev: dict[str, Any]) -> None:
        """Apply the adaptive loader policy (``scaling: {policy: adaptive}``) to a service."""
        from .config import load_config
        from .scaling import Scaler, ScalingPolicy, SourceLoad

        if name not in self._configs:
            self._configs[name] = load_config(registry["config"], check_files=False)
        cfg = self._configs[name]
        if cfg.scaling.policy != "adaptive":
            return
        sc = cfg.scaling
        if name not in self._scalers:
            self._scalers[name] = Scaler(ScalingPolicy.from_config(cfg))
        dt = snap["time"] - prev["time"]
        planned = sum(snap["planner"]["tokens_planned"].values())
        before = sum(prev["planner"]["tokens_planned"].values())
        coordinator = await registry["coordinator"]
        ahead = await coordinator.weights_ahead(sc.lookahead)
        loads = {}
        for s, v in snap["sources"].items():
            starved = (snap["planner"]["starved_seconds"].get(s, 0.0)
                       - prev["planner"]["starved_seconds"].get(s, 0.0)) / dt
            loads[s] = SourceLoad(
                loaders=int(snap["planner"]["loaders"][s]), weight_ahead=float(ahead[s]),
                consumption=(planned - before) / dt,
                seconds_per_token=float(v["seconds_per_token"]), threads=int(v["threads"]),
                starved=starved)
        for s, n in self._scalers[name].decide(time.monotonic(), loads).items():
            got = await coordinator.scale(s, n)
            self.decisions.setdefault(name, deque(maxlen=1000)).append(
                {"time": time.time(), "source": s, "loaders": got, "from": loads[s].loaders,
                 "starved": loads[s].starved, "consumption": loads[s].consumption})

    def status(self) -> dict[str, Any]:
        """Everything the page shows, as JSON-able data."""
        out = {}
        for name, snap in self.services.items():
            rates = self.rates.get(name, {})
            sources = {s: dict(v, tokens_per_second=rates.get(s, 0.0))
                       for s, v in snap["sources"].items()}
            out[name] = {"sources": sources, "ranks": snap["ranks"],
                         "steps_planned": snap["planner"]["steps_planned"],
                         "mean_imbalance": snap["planner"]["mean_imbalance"],
                         "imbalance": list(self.imbalance.get(name, [])),
                         "scaling": list(self.decisions.get(name, []))[-20:],
                         "error": snap["planner"].get("error")}
        return {"services": out, "time": time.time()}


def _page() -> str:
    from importlib.resources import files

    return files("msd_dask").joinpath("static/status.html").read_text(encoding="utf-8")


_COLLECTOR_PLUGIN: list[MsdSchedulerPlugin] = []


def _register_collector(plugin: MsdSchedulerPlugin) -> None:
    """Expose ``msd_*`` metrics through prometheus_client's default registry."""
    try:
        from prometheus_client.core import REGISTRY, GaugeMetricFamily
    except ImportError:  # pragma: no cover - prometheus_client is optional
        return
    if _COLLECTOR_PLUGIN:
        _COLLECTOR_PLUGIN[0] = plugin
        return
    _COLLECTOR_PLUGIN.append(plugin)

    class _Collector:
        def collect(self) -> Any:
            p = _COLLECTOR_PLUGIN[0]
            st = p.status()["services"]
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
            q = GaugeMetricFamily("msd_rank_queue_depth", "Batches published, not yet claimed",
                                  labels=["service", "rank"])
            steps = GaugeMetricFamily("msd_steps_planned", "Steps planned", labels=["service"])
            imb = GaugeMetricFamily("msd_step_imbalance_mean",
                                    "Mean max/mean rank cost per step", labels=["service"])
            for svc, d in st.items():
                for r, v in d["ranks"].items():
                    q.add_metric([svc, r], float(v["queue_depth"]))
                steps.add_metric([svc], float(d["steps_planned"]))
                imb.add_metric([svc], float(d["mean_imbalance"]))
            yield q
            yield steps
            yield imb

    REGISTRY.register(_Collector())


def dask_setup(scheduler: Any) -> None:
    """Entry point of ``dask scheduler --preload msd_dask.plugin``."""
    scheduler.add_plugin(MsdSchedulerPlugin())
