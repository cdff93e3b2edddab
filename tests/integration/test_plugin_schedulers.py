"""The plugin where a process holds several schedulers, or a scheduler the plugin twice.

Real schedulers in this process, their ``/metrics`` and ``/msd/api/status`` fetched over
HTTP; each plugin's figures are set by hand (no service is polled: its interval is an hour),
since what is checked is which plugin's figures reach which page.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
from distributed import Scheduler

from msd_dask.core.figures import rank_summary
from msd_dask.plugin import MsdSchedulerPlugin

prometheus_parser = pytest.importorskip("prometheus_client.parser")


def _figures(source: str) -> dict[str, Any]:
    """A service's figures as a poll leaves them."""
    return {"sources": {source: {"weight": 1.0, "share": 1.0, "loaders": 1, "tokens_read": 10,
                                 "seconds_per_token": 1e-6, "tokens_buffered": 0}},
            "ranks": {}, "rank_summary": rank_summary(np.arange(2), np.zeros(2, int),
                                                      -np.ones(2, int)),
            "planner": {"steps_planned": 3, "mean_imbalance": 1.0}, "time": time.time(),
            "constructors": []}


@asynccontextmanager
async def _scheduler() -> AsyncIterator[Scheduler]:
    async with Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0") as s:
        yield s


async def _install(scheduler: Scheduler, services: dict[str, str]) -> MsdSchedulerPlugin:
    """A plugin registered as a client's ``register_plugin`` does, holding ``services``
    (name -> source) as if polled."""
    plugin = MsdSchedulerPlugin(interval=3600)
    await scheduler.register_scheduler_plugin(plugin, idempotent=False)
    plugin.services.update({name: _figures(src) for name, src in services.items()})
    return plugin


async def _get(scheduler: Scheduler, path: str) -> str:
    url = f"http://127.0.0.1:{scheduler.http_server.port}{path}"

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.read().decode()
    return await asyncio.to_thread(fetch)


def _series(text: str, name: str) -> list[dict[str, str]]:
    return [s.labels for f in prometheus_parser.text_string_to_metric_families(text)
            for s in f.samples if s.name == name]


def test_each_schedulers_metrics_report_its_own_services() -> None:
    """Two services started without an address (an embedded cluster each: both schedulers in
    the user's process) were each reported on both schedulers' ``/metrics``, so a sum over
    the scrape targets counted each twice; a name on both, once (a review)."""
    async def main() -> None:
        async with _scheduler() as a, _scheduler() as b:
            await _install(a, {"train": "code", "same": "a-src"})
            await _install(b, {"val": "prose", "same": "b-src"})
            for s, own, other, src in ((a, "train", "val", "a-src"), (b, "val", "train", "b-src")):
                text = await _get(s, "/metrics")
                services = sorted(lab["service"] for lab in _series(text, "msd_poll_ok"))
                assert services == sorted([own, "same"]), text
                assert {"service": "same", "source": src} in _series(text, "msd_source_weight")
                assert f'service="{other}"' not in text
            # the registry read outside a render (prometheus_client's own HTTP server, in a
            # thread of its own): every scheduler's, not the last one rendered (a read-back)
            from prometheus_client import REGISTRY, generate_latest

            text = (await asyncio.to_thread(generate_latest, REGISTRY)).decode()
            assert sorted(lab["service"] for lab in _series(text, "msd_poll_ok")) == [
                "same", "train", "val"], text
    asyncio.run(main())
    # the scheduler last rendered has closed: the registry read directly (no render of a
    # page) reports every installed plugin, not none (the suite's unit tests after this
    # one found nothing: the closed scheduler was still taken for the one rendered)
    from types import SimpleNamespace

    from prometheus_client import REGISTRY, generate_latest

    from msd_dask.plugin import scheduler as module

    plugin = MsdSchedulerPlugin()
    plugin.scheduler = SimpleNamespace(plugins={MsdSchedulerPlugin.name: plugin})
    plugin.services["direct"] = _figures("code")
    module._register_collector(plugin)
    try:
        text = generate_latest(REGISTRY).decode()
        assert [lab["service"] for lab in _series(text, "msd_poll_ok")] == ["direct"], text
    finally:
        module._unregister_collector(plugin)


def test_a_plugin_registered_again_replaces_the_first_wholly() -> None:
    """``--preload msd_dask.plugin`` and a ``client.register_plugin(MsdSchedulerPlugin())``
    (the module's docstring offers both): Dask replaced the first without closing it, which
    went on polling every service beside the second, answered ``/msd/api/status`` (its route
    came first) and stayed on ``/metrics`` after its scheduler closed (a review)."""
    async def main() -> None:
        async with _scheduler() as s:
            first = await _install(s, {"old": "code"})
            with pytest.warns(UserWarning, match="overwriting"):
                second = await _install(s, {"new": "code"})
            assert s.plugins[MsdSchedulerPlugin.name] is second
            assert first._task is not None
            await asyncio.sleep(0)  # (the cancelled poll loop ends)
            assert first._task.done() and not second._task.done()  # type: ignore[union-attr]
            api = json.loads(await _get(s, "/msd/api/status"))
            assert sorted(api["services"]) == ["new"]
            metrics = await _get(s, "/metrics")
            assert [lab["service"] for lab in _series(metrics, "msd_poll_ok")] == ["new"]
            s.plugins.pop(MsdSchedulerPlugin.name)  # (removed: its page says so, not old figures)
            with pytest.raises(urllib.error.HTTPError, match="404"):
                await _get(s, "/msd/api/status")
    asyncio.run(main())
