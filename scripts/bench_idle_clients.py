"""The Dask scheduler's CPU for connected, idle clients: what every training process's (or host
agent's) client costs it while nothing else happens, and what connecting them costs.

A real ``dask scheduler`` process (no workers, no dashboard); ``N`` clients connect from ``P``
forked processes.  Measured on the scheduler process (``psutil``): its idle CPU before any client,
the CPU of connecting all of them, and its CPU over ``--window`` seconds once every client has
had ``--settle`` seconds to take the heartbeat interval the scheduler gives it (``10 ×
distributed.scheduler.heartbeat_interval(N)``: 20 s for 50-199 clients, ``10 × (N / 200 + 1)``
s from 200).  Reported per ``N``: the CPU per connect, the load per client (cores, net of the
idle scheduler) and the same per client and heartbeat interval, the figure
``simulate.py --control-plane`` takes as ``--cp-client-beat``; each for clients as Dask makes
them and as msd_dask's handle does (without their periodic ``identity`` call,
``msd_dask.dask_internals.stop_identity_refresh``), one after the other.

    python scripts/bench_idle_clients.py --clients 128,512
    python scripts/bench_idle_clients.py --workers 24 --settle 20 --window 60   # workers instead
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any


def _hold(address: str, n: int, ready: Any, stop: Any, service: bool) -> None:
    """Connect ``n`` clients, say so, and keep them until ``stop`` is set; ``service``: as
    msd_dask's handle makes them (without the periodic ``identity`` call)."""
    from distributed import Client

    from msd_dask.dask_internals import stop_identity_refresh

    clients = [Client(address, timeout=120) for _ in range(n)]
    if service:
        for c in clients:
            stop_identity_refresh(c)
    ready.put(len(clients))
    stop.wait()
    for c in clients:
        c.close()


def measure(clients: int, procs: int, settle: float, window: float, port: int,
            service: bool = True) -> dict[str, float]:
    """One scheduler, ``clients`` idle clients in ``procs`` processes: the figures of the module;
    ``service``: clients as msd_dask makes them, else as Dask does."""
    from distributed.scheduler import heartbeat_interval

    ctx = mp.get_context("fork")
    stop = ctx.Event()
    holders: list[Any] = []
    with _scheduler(port) as cpu:
        try:
            idle = _rate(cpu, window / 2)
            ready = ctx.Queue()
            per = [clients // procs + (i < clients % procs) for i in range(procs)]
            holders = [ctx.Process(target=_hold, args=(f"tcp://127.0.0.1:{port}", n, ready, stop,
                                                             service))
                       for n in per if n]
            c0 = cpu()
            for p in holders:
                p.start()
            for _ in holders:
                try:
                    ready.get(timeout=300)
                except Exception as e:  # noqa: BLE001 - one clear message
                    raise TimeoutError(f"{clients} clients did not all connect to the scheduler "
                                       f"on port {port} within 300 s") from e
            connect = cpu() - c0
            time.sleep(settle)
            busy = _rate(cpu, window)
        finally:
            stop.set()
            for p in holders:
                p.join(30)
                if p.is_alive():
                    p.kill()
    interval = 10.0 * heartbeat_interval(clients)
    per_client = (busy - idle) / clients
    return {"clients": clients, "connect_ms": connect / clients * 1e3, "idle_cores": idle,
            "busy_cores": busy, "per_client_ms_s": per_client * 1e3,
            "interval_s": interval, "per_beat_ms": per_client * interval * 1e3}


@contextlib.contextmanager
def _scheduler(port: int) -> Iterator[Callable[[], float]]:
    """A ``dask scheduler`` on ``port`` (no dashboard), up; yields its CPU seconds so far (a
    function), and stops it."""
    import psutil

    sched = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--port",
                              str(port), "--no-dashboard"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        sp = psutil.Process(sched.pid)

        def cpu() -> float:
            t = sp.cpu_times()
            return t.user + t.system

        time.sleep(3.0)  # the scheduler up
        # (one that could not take the port exits at once: the clients connected to whatever
        # held it, and the table measured the dead process's CPU, 0 everywhere; a review)
        if sched.poll() is not None:
            raise SystemExit(f"the dask scheduler on port {port} exited at start (status "
                             f"{sched.returncode}): is the port taken? give another --port")
        yield cpu
        if sched.poll() is not None:
            raise SystemExit(f"the dask scheduler on port {port} exited while measured "
                             f"(status {sched.returncode})")
    finally:
        sched.terminate()
        try:
            sched.wait(10)
        except subprocess.TimeoutExpired:
            sched.kill()


def _free_port() -> int:
    """A TCP port on 127.0.0.1 free now (the scheduler takes it a moment later)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rate(cpu: Callable[[], float], seconds: float) -> float:
    """Cores ``cpu`` says were used over the next ``seconds``."""
    c0, t0 = cpu(), time.monotonic()
    time.sleep(seconds)
    return (cpu() - c0) / (time.monotonic() - t0)


def measure_workers(workers: int, settle: float, window: float, port: int) -> dict[str, float]:
    """One scheduler and ``workers`` idle ``dask worker`` processes (one thread, no nanny): the
    scheduler's CPU per worker heartbeat, net of its idle load (``simulate.py
    --control-plane`` takes it as ``--cp-worker-beat``).  A worker beats every
    ``distributed.scheduler.heartbeat_interval(workers)`` s."""
    from distributed import Client
    from distributed.scheduler import heartbeat_interval

    procs: list[subprocess.Popen[bytes]] = []
    with _scheduler(port) as cpu:
        try:
            idle = _rate(cpu, window / 2)
            procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker",
                                       f"tcp://127.0.0.1:{port}", "--nthreads", "1",
                                       "--no-nanny", "--no-dashboard", "--memory-limit", "0"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for _ in range(workers)]
            with Client(f"tcp://127.0.0.1:{port}", timeout=120) as client:
                client.wait_for_workers(workers, timeout=300)
            time.sleep(settle)
            busy = _rate(cpu, window)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    interval = heartbeat_interval(workers)
    per_worker = (busy - idle) / workers
    return {"workers": workers, "idle_cores": idle, "busy_cores": busy,
            "per_worker_ms_s": per_worker * 1e3, "interval_s": interval,
            "per_beat_ms": per_worker * interval * 1e3}


def main(argv: list[str] | None = None) -> int:
    from cli_types import natural, positive_float, positive_int, positive_list

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=positive_list, default=[128, 512],
                   help="comma-separated client counts (default 128,512)")
    p.add_argument("--procs", type=positive_int, default=8,
                   help="processes the clients connect from")
    p.add_argument("--settle", type=positive_float, default=30.0,
                   help="seconds after connecting before the window (the intervals adjust)")
    p.add_argument("--window", type=positive_float, default=90.0, help="seconds measured")
    p.add_argument("--port", type=natural, default=0,
                   help="the scheduler's port (default: a free one)")
    p.add_argument("--workers", type=positive_list, default=[],
                   help="comma-separated worker counts: measure idle workers' heartbeats instead "
                        "of clients' (one dask worker process each)")
    p.add_argument("--smoke", action="store_true", help="8 clients, 2 processes, a few seconds (CI)")
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.procs, args.settle, args.window = [8], 2, 1.0, 2.0
    if not args.port:
        args.port = _free_port()
    if args.workers:
        print(f"{'workers':>8} {'idle cores':>10} {'busy cores':>10} {'ms/s per worker':>15} "
              f"{'interval s':>10} {'ms per beat':>11}")
        for n in args.workers:
            r = measure_workers(n, args.settle, args.window, args.port)
            print(f"{n:>8} {r['idle_cores']:>10.4f} {r['busy_cores']:>10.4f} "
                  f"{r['per_worker_ms_s']:>15.4f} {r['interval_s']:>10.1f} "
                  f"{r['per_beat_ms']:>11.2f}", flush=True)
        return 0
    print(f"{'clients':>8} {'made by':>8} {'connect ms':>10} {'idle cores':>10} "
          f"{'busy cores':>10} {'ms/s per client':>15} {'interval s':>10} {'ms per beat':>11}")
    for n in args.clients:
        for service in (False, True):  # (side by side: the machine's load drifts)
            r = measure(n, min(args.procs, n), args.settle, args.window, args.port, service)
            print(f"{n:>8} {'msd_dask' if service else 'Dask':>8} {r['connect_ms']:>10.1f} "
                  f"{r['idle_cores']:>10.4f} {r['busy_cores']:>10.4f} "
                  f"{r['per_client_ms_s']:>15.4f} {r['interval_s']:>10.1f} "
                  f"{r['per_beat_ms']:>11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
