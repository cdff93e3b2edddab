"""The scheduler plugin: the /msd/status page in a real headless browser, and /metrics."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

import pytest

from msd_dask import DataService

from cluster import dask_cluster, http_get
from corpus import config, write_corpus


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "chromium-headless-shell"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("headless Chromium is required in CI (.ci/run installs Debian's chromium)")
    pytest.skip("no Chromium on this machine (apt-get install chromium)")


def _reported(status: str) -> dict:
    """Service ``dash``'s rank summary in the plugin's ``/msd/api/status`` answer."""
    import json

    return json.loads(status)["services"]["dash"]["rank_summary"]


def test_status_page_and_metrics(tmp_path):
    browser = _chromium()
    root = str(tmp_path / "corpus")
    write_corpus(root)
    with dask_cluster(str(tmp_path), n_workers=1, preload="msd_dask.plugin") as cl:
        with DataService.start(config(root, name="dash"), cl["address"]) as svc:
            port = svc.client.scheduler_info()["services"]["dashboard"]
            base = f"http://127.0.0.1:{port}"
            readers = [svc.reader(r) for r in range(2)]
            for _ in range(20):
                for rd in readers:
                    next(rd)
            deadline = time.monotonic() + 30
            while '"dash"' not in http_get(base + "/msd/api/status"):
                assert time.monotonic() < deadline, "the plugin never reported the service"
                time.sleep(0.5)
            # the plugin's status is that of its last poll, which may predate the readers'
            # 20 steps: wait for one after them (the page shows the same status)
            while _reported(http_get(base + "/msd/api/status"))["waiting"] != 0:
                assert time.monotonic() < deadline, "the plugin never saw the ranks' steps"
                time.sleep(0.5)
            metrics = http_get(base + "/metrics")
            for src in ("code", "prose"):
                assert f'msd_source_weight{{service="dash",source="{src}"}}' in metrics
                assert f'msd_source_loaders{{service="dash",source="{src}"}}' in metrics
            # the ranks in a few series, not one per rank
            assert 'msd_ranks{service="dash"} 2.0' in metrics, metrics
            for quantile in ("0", "0.5", "0.9", "1"):
                assert f'msd_rank_queue_depth_quantile{{quantile="{quantile}",service="dash"}}' in metrics
            assert 'msd_rank_lag_steps{service="dash"}' in metrics
            assert 'msd_planner_failed{service="dash"} 0.0' in metrics  # (it plans)
            # by place among the slowest, not by rank id (each rank that once lagged made a
            # series of its own: a review of the plugin)
            assert 'msd_slowest_rank_last_claimed{place="0",service="dash"}' in metrics
            assert re.search(r'msd_slowest_rank\{place="1",service="dash"\} [01]\.0', metrics)
            assert 'rank="' not in metrics
            assert 'msd_rank_queue_depth{' not in metrics
            dom = subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu",
                 "--virtual-time-budget=5000", "--dump-dom", base + "/msd/status"],
                capture_output=True, text=True, timeout=120).stdout
            assert 'id="svc-dash"' in dom, dom[:2000]
            assert "2 ranks, 0 waiting" in dom, dom[:4000]
            for src in ("code", "prose"):
                assert f"<td>{src}</td>" in dom
            shot = tmp_path / "status.png"
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu",
                            "--virtual-time-budget=5000", "--window-size=1000,700",
                            f"--screenshot={shot}", base + "/msd/status"],
                           capture_output=True, timeout=120)
            assert shot.exists() and shot.stat().st_size > 1000
            if os.environ.get("MSD_SAVE_SCREENSHOT"):
                shutil.copy(shot, os.environ["MSD_SAVE_SCREENSHOT"])
            # error texts are shown as text, not markup (they went into innerHTML as is), and a
            # service whose polls fail says its figures are the last answered poll's
            def errors_with_markup(dask_scheduler):  # (nested: pickled by value)
                plugin = dask_scheduler.plugins["msd_dask"]
                # no poll replaces what follows: neither the next nor one under way (each
                # service's poll is a task of its own, which a loaded machine's CI run found
                # finishing after this and putting the service's answer back)
                plugin._task.cancel()
                for poll in list(plugin._polling.values()):
                    poll.cancel()
                plugin.services["dash"]["planner"]["error"] = "DataError('<i>row 3</i> & more')"
                plugin.poll_errors["dash"] = "OSError('<b>lost</b>')"

            svc.client.run_on_scheduler(errors_with_markup)
            dom = subprocess.run(
                [browser, "--headless", "--no-sandbox", "--disable-gpu",
                 "--virtual-time-budget=5000", "--dump-dom", base + "/msd/status"],
                capture_output=True, text=True, timeout=120).stdout
            assert "DataError('&lt;i&gt;row 3&lt;/i&gt; &amp; more')" in dom, dom[:4000]
            assert "<i>row 3</i>" not in dom and "<b>lost</b>" not in dom
            assert "did not answer its last polls (OSError('&lt;b&gt;lost&lt;/b&gt;'))" in dom



def _count_planner_calls(dask_worker):
    """Count the actor calls this worker's planner (planner actor) gets, by method."""
    import collections
    import functools

    counts = dask_worker._msd_planner_calls = collections.Counter()
    handler = dask_worker.handlers["actor_execute"]

    @functools.wraps(handler)
    async def counted(*args, **kwargs):
        if "planner" in str(kwargs.get("actor")):
            counts[str(kwargs.get("function"))] += 1
        return await handler(*args, **kwargs)

    dask_worker.handlers["actor_execute"] = counted


def _planner_calls(dask_worker):
    return dict(getattr(dask_worker, "_msd_planner_calls", {}))


async def _polls(n, dask_scheduler):
    import asyncio
    import time

    plugin = dask_scheduler.plugins["msd_dask"]
    deadline = time.monotonic() + 30
    while plugin._client is None:  # made by the plugin's own loop, after its first interval
        assert time.monotonic() < deadline, "the plugin never connected"
        await asyncio.sleep(0.1)
    for _ in range(n):
        await plugin.poll()
    return plugin.status()["services"]


def test_a_poll_asks_the_planner_once(corpus):
    """The plugin polls every service each second: one call to its planner, which asks
    its loaders and constructors (each call costs CPU at both ends), with the same
    figures as :meth:`DataService.stats`; the adaptive policy's look-ahead weights too."""
    root, _ = corpus
    cfg = config(root, name="polled", scaling={"policy": "adaptive"})
    with DataService.start(cfg, n_workers=1, threads_per_worker=1) as svc:
        readers = [svc.reader(r) for r in range(2)]
        for _ in range(5):
            for rd in readers:
                next(rd)
        svc.client.run(_count_planner_calls)
        status = svc.client.run_on_scheduler(_polls, 3)["polled"]
        calls = {}
        for c in svc.client.run(_planner_calls).values():
            calls.update(c)
        stats = svc.stats()
    # besides the polls: the owner's checkpoint each second, the policy's decisions
    polled = {k: v for k, v in calls.items() if k not in ("checkpoint", "scale")}
    assert set(polled) == {"snapshot"} and polled["snapshot"] >= 3, calls
    assert set(status["sources"]) == set(stats["sources"]) == {"code", "prose"}
    for s, v in status["sources"].items():
        assert v["weight"] == stats["sources"][s]["weight"]
        assert v["tokens_read"] <= stats["sources"][s]["tokens_read"]
    assert set(status["ranks"]) == {str(r) for r in stats["ranks"]}


def test_a_poll_past_the_listed_ranks_brings_the_scheduler_their_summary_alone(corpus):
    """Past :data:`~msd_dask.core.figures.RANKS_LISTED` ranks the planner sends the plugin
    the ranks' summary, not every rank's figures (six dicts of 16,384 entries at 16,384
    ranks, about 30 ms of the scheduler's CPU a poll): the figures the scheduler keeps are
    those of :meth:`DataService.stats`' ranks, summarised."""
    from msd_dask.core.figures import RANKS_LISTED, rank_columns, rank_summary

    root, _ = corpus
    # (a reader for the first rank of each DP group: the others' steps wait unclaimed, so
    # the readers take fewer than a round ahead of what the constructors may hold)
    dp, tp = 2, RANKS_LISTED // 2 + 4
    cfg = config(root, name="many", parallel={"dp": dp, "tp": tp})
    with DataService.start(cfg, n_workers=1, threads_per_worker=1) as svc:
        readers = [svc.reader(dp_rank * tp) for dp_rank in range(dp)]
        for _ in range(2):
            for rd in readers:
                next(rd)
        # (the constructors' figures a snapshot takes may be a second old: wait for the
        # readers' claims to show)
        deadline = time.monotonic() + 30
        while True:
            snap = svc.link.call(lambda p: p.snapshot(0, None))
            status = svc.client.run_on_scheduler(_polls, 1)["many"]
            if snap["rank_summary"]["waiting"] == status["rank_summary"]["waiting"] == \
                    dp * (tp - 1):
                break
            assert time.monotonic() < deadline, (snap["rank_summary"], status["rank_summary"])
            time.sleep(0.5)
        stats = svc.stats()
    assert snap["ranks"] == {} and status["ranks"] == {}
    assert snap["constructors"] == len(stats["constructors"])
    assert len(stats["ranks"]) == dp * tp > RANKS_LISTED
    want = rank_summary(*rank_columns(stats["constructors"]))
    for got in (snap["rank_summary"], status["rank_summary"]):
        assert got["ranks"] == want["ranks"] == dp * tp
        assert want["waiting"] == dp * (tp - 1)  # the ranks not read
        assert got["queue_depth"]["max"] >= 1 and got["last_claimed"]["max"] >= 1
