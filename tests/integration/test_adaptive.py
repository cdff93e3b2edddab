"""Dask's ``Adaptive`` with msd_dask: the cluster grows for the roles, and never loses a role holder.

A real ``LocalCluster`` (worker processes) under ``cluster.adapt(...)``, a service started
against its scheduler (the plugin is installed by ``DataService.start``).
"""

from __future__ import annotations

import time

import pytest
from distributed import LocalCluster
from distributed.deploy.adaptive import Adaptive
from distributed.protocol import pickle
from distributed.scheduler import Scheduler

from msd_dask import DataService

from checks import check_content, check_exactly_once, record
from cluster import workers_info
from corpus import config

pytestmark = pytest.mark.slow


class _Shrinking(Adaptive):
    """An ``Adaptive`` that always wants its minimum: it retires every worker Dask lets it."""

    async def target(self) -> int:
        return self.minimum


def _targets(dask_scheduler):
    """Dask's own ``adaptive_target`` (the class's method) and the plugin's, with the state
    they were computed from."""
    return {"own": Scheduler.adaptive_target(dask_scheduler),
            "msd": dask_scheduler.adaptive_target(),
            "processing": {a: len(ws.processing) for a, ws in dask_scheduler.workers.items()},
            "occupancy": dask_scheduler.total_occupancy,
            "queued": len(dask_scheduler.queued) + len(dask_scheduler.unrunnable)}


def _known_services(dask_scheduler):
    """Services whose config and first snapshot the plugin has."""
    plugin = dask_scheduler.plugins["msd_dask"]
    return sorted(set(plugin._configs) & set(plugin.services))


def serve_steps_until(readers, recs, cond, what: str, timeout: float = 40.0, each=None) -> None:
    """Read the next step on every reader (records into ``recs``) until ``cond()``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f}s"
        step = len(recs) // len(readers)
        for rd in readers:
            b = next(rd)
            assert b.step == step
            recs.append(record(b))
        if each is not None:
            each()


def _one_group(ws):
    return "all"


def _holders(svc):
    """Workers holding a role of ``svc`` (planner, constructors, loaders)."""
    svc.refresh()
    loaders = svc.planner.loader_stats().result()
    return ({s["worker"] for v in loaders.values() for s in v}
            | {c._address for c in svc.constructors} | {svc.planner._address})


def _window(seen: list[set[str]], cluster, svc) -> str:
    """What a failed window assertion needs: each change of the worker set, Adaptive's log
    and the service's role events."""
    changes = [(i, sorted(ws)) for i, ws in enumerate(seen) if i == 0 or ws != seen[i - 1]]
    events = svc.stats()["planner"]["role_events"]
    return f"worker sets (sample, set): {changes}; adaptive: {list(cluster._adaptive.log)}; " \
           f"role events: {events}"


def test_adapt_grows_for_the_roles_and_never_retires_a_role_holder(corpus):
    root, texts = corpus
    # planner + 1 constructor (one worker at start) + 3 + 2 loaders = 7 roles, 3 per worker
    cfg = config(root, name="adapt", scaling={"roles_per_worker": 3})
    cfg["sources"][0]["loaders"] = 3
    cfg["sources"][1]["loaders"] = 2
    recs: list[dict] = []
    seen_workers: list[set[str]] = []
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster:
        cluster.adapt(minimum=1, maximum=3, interval="500ms", wait_count=2)
        with DataService.start(cfg, cluster.scheduler_address, timeout=60) as svc:
            client = svc.client
            readers = [svc.reader(r) for r in range(svc.config.parallel.world_size)]

            def workers() -> set[str]:
                return set(workers_info(client))

            def serve_until(cond, what: str, timeout: float = 40.0) -> None:
                def each() -> None:
                    seen_workers.append(workers())
                    time.sleep(0.05)

                serve_steps_until(readers, recs, cond, what, timeout, each)

            first = workers()
            assert len(first) == 1
            # the plugin reads each service's config (roles_per_worker) at its first poll
            serve_until(lambda: client.run_on_scheduler(_known_services) == ["adapt"],
                        "the plugin polled the service")
            (w0,) = first
            assert _holders(svc) == {w0}

            # (a) 7 roles do not fit on one worker of 3: the plugin asks Adaptive for 3
            serve_until(lambda: len(workers()) == 3, "the cluster grew to 3 workers")
            assert any(rec.get("status") == "up" for _, rec in cluster._adaptive.log), \
                cluster._adaptive.log
            # ... and it is msd_dask asking: without a Dask task Dask's own target is 1
            t = client.run_on_scheduler(_targets)
            assert t["own"] == 1 and t["msd"] == 3, t
            assert client.sync(client.scheduler.adaptive_target) == 3

            # (c) Adaptive's call (RPC handler) never proposes the worker holding the roles
            assert _holders(svc) == {w0}
            others = workers() - {w0}
            assert set(client.sync(client.scheduler.workers_to_close, n=3)) == others
            names = {w["name"] for a, w in workers_info(client).items()
                     if a != w0}
            assert set(client.sync(client.scheduler.workers_to_close, target=0,
                                   attribute="name")) == names
            # workers closed together (one group, e.g. one dask-jobqueue job) stay together
            assert list(client.sync(client.scheduler.workers_to_close, n=3,
                                    key=pickle.dumps(_one_group))) == []

            # new loaders go to the new workers: every worker now holds a role
            assert svc.scale_loaders("code", 5) == 5
            serve_until(lambda: _holders(svc) == workers(), "loaders placed on the new workers")
            assert len(workers()) == 3

            # (b) an Adaptive that wants one worker: no role holder is retired while
            # the service serves ...
            cluster.adapt(Adaptive=_Shrinking, minimum=1, maximum=3, interval="500ms",
                          wait_count=2)
            start = len(seen_workers)
            t0 = time.monotonic()
            serve_until(lambda: time.monotonic() - t0 > 4.0, "serving", timeout=30)
            assert all(len(ws) == 3 for ws in seen_workers[start:]), _window(
                seen_workers[start:], cluster, svc)

            # ... and once loaders are retired from the new workers, Adaptive takes those
            # workers back, but never the one that still holds roles
            assert svc.scale_loaders("code", 3) == 3
            start = len(seen_workers)
            serve_until(lambda: workers() == {w0}, "the idle workers were retired")
            assert all(w0 in ws for ws in seen_workers[start:])
            serve_until(lambda: len(recs) >= 2 * 60 * len(readers), "60 steps served")
            assert _holders(svc) == {w0}
            stats = svc.stats()
    # no role was lost with a worker (nothing had to be re-created)
    assert not any(e["why"] == "lost" for e in stats["planner"]["role_events"]), \
        stats["planner"]["role_events"]
    # every step reached every rank once, every document once per epoch
    steps = [(r["step"], r["rank"]) for r in recs]
    assert len(steps) == len(set(steps))
    check_content(recs, texts, 512)
    assert min(check_exactly_once(recs, texts, 512).values()) >= 1


def test_closing_the_plugin_puts_the_scheduler_entry_points_back():
    import asyncio

    from msd_dask.plugin.scheduler import MsdSchedulerPlugin

    async def main():
        async with Scheduler(port=0, dashboard_address="127.0.0.1:0") as s:
            handlers = {n: s.handlers[n] for n in ("adaptive_target", "workers_to_close")}
            plugin = MsdSchedulerPlugin()
            await s.register_scheduler_plugin(plugin, idempotent=False)
            for n, h in handlers.items():
                assert s.handlers[n] is not h and n in s.__dict__, n
                assert s.handlers[n].__name__ == n  # Dask's RPC logs the handler's name
            assert s.adaptive_target() == 0 and s.workers_to_close() == []
            await plugin.close()
            for n, h in handlers.items():
                assert s.handlers[n] is h and n not in s.__dict__, n

    asyncio.run(main())
