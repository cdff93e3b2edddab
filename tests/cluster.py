"""Real ``dask scheduler`` / ``dask worker`` processes for integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from types import ModuleType

from scripts_import import load_script


def _wait_for(path: str, proc: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) or os.path.getsize(path) == 0:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} was not ready after {timeout}s")
        time.sleep(0.1)


def http_get(url: str) -> str:
    """The body of ``url`` (a dashboard page), as text."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def workers_info(client) -> dict:
    """The scheduler's workers now (address -> info), asked of the scheduler.

    Not ``client.scheduler_info()["workers"]``: that returns the client's cached
    identity, which the client's periodic call (totals only, ``"workers"`` empty)
    can overwrite between the fetch and the return.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]


def _wait_for_workers(address: str, n: int, workers: list[subprocess.Popen],
                      tls: dict[str, str] | None, timeout: float = 60) -> None:
    """Until ``n`` workers registered: a service started earlier would put every role on
    the first one (a test that retires "a worker without the planner" found none)."""
    from distributed import Client
    from distributed.security import Security

    sec = (Security(tls_ca_file=tls["ca"], tls_client_cert=tls["cert"],
                    tls_client_key=tls["key"], require_encryption=True) if tls else None)
    with Client(address, security=sec, timeout=timeout) as c:
        deadline = time.monotonic() + timeout
        while len(workers_info(c)) < n:
            dead = [w.returncode for w in workers if w.poll() is not None]
            if dead:
                raise RuntimeError(f"a dask worker exited with {dead[0]} before {n} registered")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{n} dask workers did not register within {timeout:.0f}s")
            time.sleep(0.1)


@contextmanager
def dask_cluster(tmp: str, n_workers: int = 2, nthreads: int = 1,
                 preload: str | None = None, tls: dict[str, str] | None = None,
                 dashboard_prefix: str | None = None) -> Iterator[dict]:
    """Start a scheduler and ``n_workers`` worker processes on loopback.

    ``tls``: ``{"ca": path, "cert": path, "key": path}`` starts them with dask's own
    ``--tls-*`` options (protocol ``tls://``); ``dashboard_prefix``: the scheduler's
    ``--dashboard-prefix``.
    Yields ``{"address": ..., "workers": [Popen, ...], "scheduler": Popen}``.
    """
    tls_args = (["--tls-ca-file", tls["ca"], "--tls-cert", tls["cert"], "--tls-key", tls["key"]]
                if tls else [])
    sched_file = os.path.join(tmp, "scheduler.json")
    env = dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False")
    procs: list[subprocess.Popen] = []
    log = open(os.path.join(tmp, "cluster.log"), "ab")
    try:
        sched = subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
             "--port", "0", "--dashboard-address", "127.0.0.1:0",
             "--scheduler-file", sched_file, *(["--preload", preload] if preload else []),
             *(["--dashboard-prefix", dashboard_prefix] if dashboard_prefix else []),
             *(["--protocol", "tls", *tls_args] if tls else [])],
            stdout=log, stderr=log, env=env)
        procs.append(sched)
        _wait_for(sched_file, sched, "dask scheduler")
        with open(sched_file) as f:
            address = json.load(f)["address"]
        workers = []
        for _ in range(n_workers):
            w = subprocess.Popen(
                [sys.executable, "-m", "distributed.cli.dask_worker", address,
                 "--nthreads", str(nthreads), "--no-nanny", "--host", "127.0.0.1",
                 "--dashboard-address", "127.0.0.1:0", "--memory-limit", "2GiB", *tls_args],
                stdout=log, stderr=log, env=env)
            procs.append(w)
            workers.append(w)
        _wait_for_workers(address, n_workers, workers, tls)
        yield {"address": address, "workers": workers, "scheduler": sched}
    finally:
        _stopping().stop_cluster(procs)  # (the scheduler first in procs: stopped last)
        log.close()


def interrupt(procs: list[subprocess.Popen]) -> None:
    """SIGINT to each of ``procs``, and wait for them (a second SIGINT to a process still
    there 3 s later, killed 10 s after that): ``stop_processes`` of
    ``scripts/bench_scheduler_bytes.py``, which says why."""
    _stopping().stop_processes(procs)


@cache
def _stopping() -> ModuleType:
    """``scripts/bench_scheduler_bytes.py``, where the benchmarks and these helpers stop
    Dask processes (imported once)."""
    return load_script("bench_scheduler_bytes", "bench_scheduler_bytes")


def start_serve(cfg: dict, tmp: str, address: str, *extra: str,
                says: str | None = None) -> subprocess.Popen:
    """``msd-dask serve`` of ``cfg`` in another process, returned once it says it serves
    (its first line holds ``says``, by default ``serving 'NAME'``).

    Its output (stdout and stderr) stays readable on ``proc.stdout``; ``extra`` are more
    command-line options (e.g. ``--tls-*``).
    """
    path = os.path.join(tmp, f"serve-{cfg['name']}.json")  # JSON is YAML too
    with open(path, "w") as f:
        json.dump(cfg, f)
    proc = subprocess.Popen(
        [sys.executable, "-m", "msd_dask.cli", "serve", path, "--scheduler", address, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return _announced(proc, says or f"serving {cfg['name']!r}")


def start_agent(address: str, name: str, sock: str, env: dict[str, str], ranks: str,
                groups: str, prefetch: int | None = None) -> subprocess.Popen:
    """``msd-dask agent`` of service ``name`` for ``ranks`` (``"A-B"``), returned once it
    serves; ``groups``: the groups it must announce (``"0,1; 2,3"``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "msd_dask.cli", "agent", "--scheduler", address, "--name", name,
         "--ranks", ranks, "--socket", sock,
         *(["--prefetch", str(prefetch)] if prefetch is not None else [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return _announced(proc, f"agent of {name!r} serves ranks {groups} on {sock}")


def _announced(proc: subprocess.Popen, text: str) -> subprocess.Popen:
    """``proc`` once its first line of output says ``text`` (killed if it says otherwise)."""
    line = proc.stdout.readline()
    if text not in line:
        proc.kill()
        raise AssertionError(line + proc.stdout.read())
    return proc


def stop_proc(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop ``proc`` with ``sig`` (killed if it has not exited 30 s later)."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
