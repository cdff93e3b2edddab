"""A planner bound to a worker that leaves before it starts there: Dask holds it for that
worker for ever, and ``DataService.start`` waited out the config's whole ``timeout``
(300 s by default), then blamed a paused worker (review).  It now notices within a few
seconds, places the planner again on a worker still there, and the service reads."""

from __future__ import annotations

import time

import pytest
from distributed import LocalCluster

from msd_dask import DataService
from msd_dask.service import placement

from checks import check_content, record
from corpus import config

pytestmark = pytest.mark.slow

#: an address no worker has: the first placement's worker, "gone" once it is chosen
_GONE = "tcp://127.0.0.1:9"


def test_a_planner_whose_worker_left_is_placed_again(corpus, monkeypatch, caplog):
    root, texts = corpus
    real = placement.scheduler_workers
    placed: list[str] = []

    def first_a_worker_that_leaves(client, timeout, *, running=False):  # type: ignore[no-untyped-def]
        workers = real(client, timeout, running=running)
        if running and not placed:  # place_planner's look: a worker that then leaves
            placed.append(_GONE)
            return {_GONE}
        return workers

    monkeypatch.setattr(placement, "scheduler_workers", first_a_worker_that_leaves)
    with LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=":0") as cl:
        t0 = time.monotonic()
        with DataService.start(config(root, name="replaced", timeout=120),
                               cl.scheduler_address) as svc:
            took = time.monotonic() - t0
            assert svc.link.registry["planner_worker"] in cl.scheduler_info["workers"]
            recs = [record(next(rd)) for rd in [svc.reader(r) for r in range(2)] for _ in range(2)]
    assert placed == [_GONE]
    assert f"worker {_GONE} left the cluster before the planner started there" in caplog.text
    assert took < 60, f"start took {took:.0f}s"
    check_content(recs, texts, 512)
