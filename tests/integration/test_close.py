"""Closing a service gives its roles and queues back, so a long-lived cluster can start it again."""

from __future__ import annotations

import time

import pytest
from distributed import Client, LocalCluster

from msd_dask import DataService, ServiceError

from checks import check_content, record
from corpus import config

pytestmark = pytest.mark.slow


def _actors(prefix: str, dask_worker=None) -> list[str]:
    return sorted(str(k) for k in dask_worker.state.actors if str(k).startswith(prefix))


def _keys(prefix: str, dask_scheduler=None) -> list[str]:
    return sorted(str(k) for k in dask_scheduler.tasks if str(k).startswith(prefix))


def _left(client: Client, prefix: str) -> tuple[list[str], list[str]]:
    held = [k for ks in client.run(_actors, prefix).values() for k in ks]
    return held, client.run_on_scheduler(_keys, prefix)


def test_close_releases_every_role_and_the_name_starts_again_from_step_0(corpus):
    root, texts = corpus
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address=":0") as cl, \
            Client(cl) as client:
        for round_ in range(3):
            # each service reads 4 steps of the 7 it plans ahead (rounds of 3, prefetch 4):
            # the rest are dropped with the closed service's constructors
            recs = []
            with DataService.start(config(root, name="closing"), cl.scheduler_address) as svc:
                held, _ = _left(client, "msd-closing-")
                assert any("loader" in k for k in held) and any("constructor" in k for k in held)
                readers = [svc.reader(r) for r in range(svc.config.parallel.world_size)]
                for step in range(4):
                    for rd in readers:
                        b = next(rd)
                        assert b.step == step, f"service {round_} read step {b.step} first"
                        recs.append(record(b))
            check_content(recs, texts, 512)
            deadline = time.monotonic() + 20
            while (left := _left(client, "msd-closing-")) != ([], []):
                assert time.monotonic() < deadline, (
                    f"service {round_} closed 20 s ago; still held (actors, keys): {left}")
                time.sleep(0.25)


def test_a_reader_of_a_closed_service_says_so(corpus):
    root, _ = corpus
    with LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=":0") as cl:
        with DataService.start(config(root, name="shut"), cl.scheduler_address):
            other = DataService.connect(cl.scheduler_address, "shut")
            reader = other.reader(0)
            for _ in range(3):
                next(reader)
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match="closed by its owner"):
            for _ in range(20):  # the rest of what it holds, then the notice
                next(reader)
        assert time.monotonic() - t0 < 30
        other.close()
