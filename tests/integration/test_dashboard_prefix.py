"""The plugin's pages on a scheduler that serves its dashboard under a prefix
(``dask scheduler --dashboard-prefix``, for a reverse proxy that forwards only that path):
they were served at ``/msd/...`` whatever the prefix, and ``DataService.dashboard_link``
left the prefix out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from msd_dask import DataService

from corpus import config, write_corpus

PREFIX = "/dask/x"


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


@contextmanager
def _prefixed_cluster(tmp: str, prefix: str) -> Iterator[str]:
    """``dask scheduler --dashboard-prefix prefix --preload msd_dask.plugin`` and one
    worker, on loopback (``tests/cluster.py``'s cluster takes no prefix); yields the
    scheduler's address."""
    from distributed import Client

    sched_file = os.path.join(tmp, "scheduler.json")
    env = dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False")
    log = open(os.path.join(tmp, "cluster.log"), "ab")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", "0", "--dashboard-address", "127.0.0.1:0", "--dashboard-prefix", prefix,
         "--scheduler-file", sched_file, "--preload", "msd_dask.plugin"],
        stdout=log, stderr=log, env=env)]
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sched_file) or os.path.getsize(sched_file) == 0:
            assert procs[0].poll() is None, "dask scheduler exited"
            assert time.monotonic() < deadline, "dask scheduler was not ready after 60s"
            time.sleep(0.1)
        with open(sched_file) as f:
            address = json.load(f)["address"]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
             "--no-nanny", "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0",
             "--memory-limit", "2GiB"], stdout=log, stderr=log, env=env))
        with Client(address, timeout=60) as c:
            c.wait_for_workers(1, timeout=60)
        yield address
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in reversed(procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        log.close()


def test_the_pages_are_served_under_the_dashboards_prefix(tmp_path: Path) -> None:
    root = str(tmp_path / "corpus")
    write_corpus(root)
    with _prefixed_cluster(str(tmp_path), PREFIX) as address:
        with DataService.start(config(root, name="pfx"), address) as svc:
            port = svc.client.scheduler_info()["services"]["dashboard"]
            host = f"http://127.0.0.1:{port}"
            # Dask's own link leaves the prefix out (its template has none): the service's
            # link has it
            assert svc.dashboard_link.endswith(f":{port}{PREFIX}/msd/status"), svc.dashboard_link
            page = _get(svc.dashboard_link)
            assert "msd_dask services" in page
            assert "msd_dask services" in _get(host + PREFIX + "/msd/status/")
            deadline = time.monotonic() + 30
            while "pfx" not in json.loads(_get(host + PREFIX + "/msd/api/status"))["services"]:
                assert time.monotonic() < deadline, "the plugin never reported the service"
                time.sleep(0.5)
            status = json.loads(_get(host + PREFIX + "/msd/api/status/"))["services"]["pfx"]
            assert set(status["sources"]) == {"code", "prose"}
            # only under the prefix, as Dask's own pages (the prefix's proxy forwards
            # nothing else)
            assert _status(host + "/msd/status") == _status(host + "/msd/api/status") == 404
            assert _status(host + PREFIX + "/status") != 404
