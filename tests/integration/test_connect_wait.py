"""Readers that connect before their service starts wait on the scheduler, not in a poll loop:
at thousands of ranks a 0.2 s poll of the published datasets was 5 scheduler calls per rank
and second."""

from __future__ import annotations

import collections
import sys
import threading
import time

import cloudpickle
import pytest
from distributed import Client

from msd_dask import DataService, ServiceError

from cluster import dask_cluster
from corpus import config

# the scheduler runs this module's functions: send them by value (it cannot import tests)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

WATCHED = ("publish_list", "publish_get", "event_wait", "event_is_set", "event_set", "event_clear")


def _count_calls(dask_scheduler):
    counts = dask_scheduler._msd_test_calls = collections.Counter()
    for name in WATCHED:
        original = dask_scheduler.handlers[name]

        def counted(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        dask_scheduler.handlers[name] = counted


def _calls(dask_scheduler):
    return dict(dask_scheduler._msd_test_calls)


def test_readers_started_first_wait_without_polling(tmp_path, corpus):
    root, _ = corpus
    cfg = config(root, name="late")
    with dask_cluster(str(tmp_path)) as cluster, Client(cluster["address"]) as watcher:
        watcher.run_on_scheduler(_count_calls)
        connected: dict[int, DataService] = {}
        errors: list[BaseException] = []

        def connect(i: int) -> None:
            try:
                connected[i] = DataService.connect(cluster["address"], "late", timeout=60)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                errors.append(e)

        threads = [threading.Thread(target=connect, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(4.0)  # the readers wait for a service nobody started yet
        waiting = watcher.run_on_scheduler(_calls)
        assert not connected and not errors
        with DataService.start(cfg, cluster["address"]) as svc:
            for t in threads:
                t.join(60)
            assert not errors, errors
            assert sorted(connected) == [0, 1, 2, 3]
            first = [next(connected[i].reader(i % 2)).step for i in range(2)]
            assert first == [0, 0]
            for s in connected.values():
                s.close()
            assert svc.stats()["planner"]["steps_planned"] >= 1
    # 4 s of waiting: one look and one held wait per reader (a 0.2 s poll made 80 calls)
    polls = waiting.get("publish_list", 0) + waiting.get("publish_get", 0)
    assert polls <= 4 and waiting.get("event_wait", 0) <= 4, waiting


def test_connect_to_a_service_that_never_starts_says_so(tmp_path):
    with dask_cluster(str(tmp_path)) as cluster:
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match="no service named 'absent'.*after 2s"):
            DataService.connect(cluster["address"], "absent", timeout=2)
        assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("wait", [None, 7.0])
def test_stats_against_an_unreachable_scheduler_says_so_within_its_wait(wait):
    """``msd-dask stats`` against a scheduler nobody runs took Dask's 30 s connect timeout
    whatever ``--wait`` said (a review): it tries the scheduler for ``--wait`` seconds, at
    least ``SCHEDULER_WAIT``, and says so in one line."""
    import socket
    import subprocess

    from msd_dask.cli import SCHEDULER_WAIT

    with socket.socket() as s:  # a port nothing listens on (bound, not listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        argv = [sys.executable, "-m", "msd_dask.cli", "stats", "x", "--scheduler",
                f"tcp://127.0.0.1:{port}"] + ([] if wait is None else ["--wait", str(wait)])
        t = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t
    within = SCHEDULER_WAIT if wait is None else wait
    assert done.returncode == 2, done.stderr
    assert f"after {within:g} s" in done.stderr.strip().splitlines()[-1], done.stderr
    assert within <= took < within + 15, took
