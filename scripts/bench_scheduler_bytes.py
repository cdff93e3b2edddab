"""Bytes the Dask scheduler handles per delivered batch, for two batch sizes, side by side.

The data path of msd_dask keeps batches off the scheduler: a reader asks its
constructor's worker for its next round directly and gets the tensors in the
answer.  This script checks that claim by counting every byte the scheduler
process reads from or writes to any TCP comm: the scheduler runs as its own
process (``dask scheduler --preload`` of this file, which wraps
``distributed.comm.tcp``'s read and write), two ``dask worker`` processes
serve the roles, and this process consumes every rank's batches.

For each ``seq_len`` it starts the service (the demo config, renamed), warms
up, snapshots the scheduler's counters, consumes ``--steps`` steps from every
rank, snapshots again.  Reported per delivered batch (one rank's batch of one
step): the scheduler's bytes and messages (in + out), the same after
subtracting the idle background (heartbeats etc., measured for a few seconds
with no service running, scaled by the window's duration), the same after
subtracting the traffic of the service when nobody reads (measured after the
window: the scheduler plugin polls the service once a second, so this part
grows with the window's length, not with the batches), and the bytes of the
batch's tensors, which do not pass through the scheduler.  The windows must be
long against the plugin's one-second polls (``--steps 200``: several seconds).

    python scripts/bench_scheduler_bytes.py --steps 200
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

# ---------------------------------------------------------------- scheduler side (preload)
_COUNT = {"read_bytes": 0, "write_bytes": 0, "read_msgs": 0, "write_msgs": 0}


def _install_counters() -> None:
    import distributed.comm.tcp as tcp

    if getattr(tcp, "_msd_counting", False):
        return
    orig_read_rw = tcp.read_bytes_rw
    orig_read = tcp.TCP.read
    orig_write = tcp.TCP.write

    async def read_bytes_rw(stream: Any, n: int) -> Any:
        _COUNT["read_bytes"] += int(n)
        return await orig_read_rw(stream, n)

    async def read(self: Any, deserializers: Any = None) -> Any:
        msg = await orig_read(self, deserializers)
        _COUNT["read_msgs"] += 1
        _COUNT["read_bytes"] += 8  # the length prefix read with stream.read_bytes
        return msg

    async def write(self: Any, msg: Any, serializers: Any = None, on_error: str = "message") -> int:
        n = await orig_write(self, msg, serializers, on_error)
        _COUNT["write_msgs"] += 1
        _COUNT["write_bytes"] += int(n or 0)
        return n

    tcp.read_bytes_rw = read_bytes_rw
    tcp.TCP.read = read
    tcp.TCP.write = write
    tcp._msd_counting = True


def dask_setup(scheduler: Any) -> None:  # called by `dask scheduler --preload <this file>`
    _install_counters()
    scheduler.handlers["msd_comm_bytes"] = lambda: dict(_COUNT)


# ---------------------------------------------------------------- driver side
def _snapshot(client: Any) -> dict[str, int]:
    async def ask(rpc: Any) -> dict[str, int]:
        return await rpc.msd_comm_bytes()

    return dict(client.sync(ask, client.scheduler))


def _diff(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a[k] for k in a}


#: the Dask setting a nanny takes its worker's environment from
_NANNY_ENVIRON = "distributed.nanny.pre-spawn-environ"


def dask_environ(config: Mapping[str, Any] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """Dask settings (dotted keys) as the environment of the processes they are for.

    Returns
    -------
    (dict, dict)
        The ``DASK_*`` variables Dask reads the settings from, and the environment a
        nanny gives the worker it starts under them (``pre-spawn-environ``: Dask's
        ``MALLOC_TRIM_THRESHOLD_`` and the settings' own entries).
    """
    import dask.config
    import distributed  # noqa: F401 - loads distributed's config defaults

    with dask.config.set(dict(config or {})):
        spawn_env = {k: str(v) for k, v in (dask.config.get(_NANNY_ENVIRON) or {}).items()}
    dask_env = {"DASK_" + "__".join(p.upper().replace("-", "_") for p in k.split(".")): str(v)
                for k, v in (config or {}).items() if not k.startswith(_NANNY_ENVIRON)}
    return dask_env, spawn_env


@contextlib.contextmanager
def environ(extra: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``extra`` set while the block runs (for the processes it starts)."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_cluster(tmp: str, workers: int, count: bool = True, nthreads: int = 2,
                   config: Mapping[str, Any] | None = None) -> tuple[str, list[subprocess.Popen]]:
    """A ``dask scheduler`` (counting its comm bytes if ``count``) and ``workers`` workers.

    ``config``: Dask settings (dotted keys, e.g. ``msd_dask.service.EMBEDDED_DASK_CONFIG``)
    for both, as ``DASK_*`` variables; those of the nanny's ``pre-spawn-environ`` become
    the workers' environment, as a nanny would give it.
    """
    sched_file = os.path.join(tmp, "scheduler.json")
    log = open(os.path.join(tmp, "cluster.log"), "ab")
    # spawn_env: the environment a nanny gives the worker it starts (`dask worker` without
    # --no-nanny): MALLOC_TRIM_THRESHOLD_ etc., so that glibc returns freed memory as it
    # does in a deployment
    dask_env, spawn_env = dask_environ(config)
    env = dict(os.environ, DASK_DISTRIBUTED__WORKER__DAEMON="False", **dask_env)
    worker_env = dict(env, **spawn_env)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
         "--port", "0", "--dashboard-address", "127.0.0.1:0", "--scheduler-file", sched_file,
         *(["--preload", os.path.abspath(__file__)] if count else [])],
        stdout=log, stderr=log, env=env)]
    deadline = time.monotonic() + 60
    while not os.path.exists(sched_file) or os.path.getsize(sched_file) == 0:
        if procs[0].poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"scheduler did not start (see {tmp}/cluster.log)")
        time.sleep(0.1)
    with open(sched_file) as f:
        address = json.load(f)["address"]
    for _ in range(workers):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", str(nthreads),
             "--no-nanny", "--host", "127.0.0.1", "--dashboard-address", "127.0.0.1:0",
             "--memory-limit", "4GiB"], stdout=log, stderr=log, env=worker_env))
    return address, procs


def _rate(client: Any, seconds: float) -> float:
    """The scheduler's traffic (bytes in + out per second) over the next ``seconds``."""
    a = _snapshot(client)
    t0 = time.perf_counter()
    time.sleep(seconds)
    d = _diff(a, _snapshot(client))
    return (d["read_bytes"] + d["write_bytes"]) / (time.perf_counter() - t0)


def _client_and_idle_rate(address: str, workers: int, seconds: float) -> tuple[Any, float]:
    """A client of the counting scheduler, once ``workers`` joined, and its idle traffic in B/s."""
    from distributed import Client

    client = Client(address, timeout=60)
    client.wait_for_workers(workers, timeout=60)
    return client, _rate(client, seconds)


def stop_cluster(procs: list[subprocess.Popen]) -> None:
    """Stop the processes of :func:`_start_cluster` (the scheduler first in ``procs``): the
    workers, then the scheduler (a worker told to close by its closing scheduler while it
    handles its own SIGINT can hang)."""
    stop_processes(procs[1:])
    stop_processes(procs[:1])


def stop_processes(procs: list[subprocess.Popen], grace: float = 3.0) -> None:
    """SIGINT to each of ``procs`` still running, and wait for them to exit.

    ``dask worker --no-nanny`` does not close its worker on a signal: it cancels the
    worker's tasks, which now and then hangs for good; Dask's CLI puts Python's own handler
    back after the first signal, so a second one, sent to a process still there ``grace``
    seconds later, ends it at once (KeyboardInterrupt).  A process still there 10 s after
    that is killed.
    """
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)


def measure(client: Any, address: str, cfg: dict[str, Any], steps: int, warmup: int,
            background_rate: float, idle_seconds: float = 3.0) -> dict[str, Any]:
    """Scheduler traffic per delivered batch over ``steps`` steps of every rank.

    Also measured, after the timed steps: the scheduler's traffic while the
    service runs but nobody reads (``idle_seconds``, its constructors full):
    the scheduler plugin's polls and the workers' heartbeats, which grow with
    time, not with batches.
    """
    from msd_dask import DataService
    from msd_dask.core.config import parse_config

    # (every rank of the mesh: with tp > 1, ranks 0..dp-1 are some groups' ranks only, and
    # the batches were counted as steps x dp; a review)
    world = parse_config(cfg).parallel.world_size
    with DataService.start(cfg, address) as svc:
        readers = [svc.reader(r) for r in range(world)]
        tensor_bytes = 0
        for _ in range(warmup):
            for rd in readers:
                next(rd)
        time.sleep(0.5)  # let the planner and constructors refill their prefetch
        a = _snapshot(client)
        t0 = time.perf_counter()
        for _ in range(steps):
            for rd in readers:
                b = next(rd)
                tensor_bytes += (b.input_ids.nbytes + b.labels.nbytes + b.position_ids.nbytes
                                 + sum(c.nbytes for c in b.cu_seqlens))
        elapsed = time.perf_counter() - t0
        d = _diff(a, _snapshot(client))
        time.sleep(0.5)  # the constructors refill, then the service idles
        service_idle = _rate(client, idle_seconds)
    batches = steps * world
    return {"seq_len": cfg["batch"]["seq_len"], "batches": batches, "seconds": elapsed,
            **per_batch(d, batches, elapsed, background_rate, service_idle, tensor_bytes)}


def per_batch(d: dict, batches: int, elapsed: float, background_rate: float,
              service_idle: float, tensor_bytes: float) -> dict:
    """The scheduler's traffic ``d`` (a :func:`_diff`) over ``elapsed`` seconds, per batch.

    Raw, net of the cluster's idle rate (``background_rate`` B/s) and net of the service's
    own idle rate (``service_idle`` B/s: service up, nobody reading); messages per batch,
    and the tensor bytes the readers received per batch (which never pass the scheduler).
    """
    total = d["read_bytes"] + d["write_bytes"]
    return {"bytes_per_batch": total / batches,
            "bytes_per_batch_net": (total - background_rate * elapsed) / batches,
            "service_idle_rate": service_idle,
            "bytes_per_batch_net_service": (total - service_idle * elapsed) / batches,
            "msgs_per_batch": (d["read_msgs"] + d["write_msgs"]) / batches,
            "tensor_bytes_per_batch": tensor_bytes / batches}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from cli_types import natural, positive_int, positive_list

    p.add_argument("config", nargs="?", default="configs/demo.yaml",
                   help="the service's config (default configs/demo.yaml)")
    p.add_argument("--seq-lens", type=positive_list, default=[1024, 8192],
                   help="comma-separated batch.seq_len values, a service each (default "
                        "1024,8192): the bytes per batch should not grow with them")
    p.add_argument("--steps", type=positive_int, default=200,
                   help="steps every rank reads, measured (default 200)")
    p.add_argument("--warmup", type=natural, default=5,
                   help="steps every rank reads before (default 5)")
    p.add_argument("--workers", type=positive_int, default=2, help="dask workers (default 2)")
    p.add_argument("--quick", action="store_true", help="60 steps")
    p.add_argument("--smoke", action="store_true", help="5 steps, seq_len 256 and 1024 (CI)")
    args = p.parse_args(argv)
    from msd_dask import load_config

    steps, seq_lens = args.steps, args.seq_lens
    if args.quick:
        steps = 60
    if args.smoke:
        steps, seq_lens, args.warmup = 5, [256, 1024], 2
    base = load_config(args.config).to_dict()
    with tempfile.TemporaryDirectory() as tmp:
        address, procs = _start_cluster(tmp, args.workers)
        try:
            client, background = _client_and_idle_rate(address, args.workers,
                                                       1.0 if args.smoke else 3.0)
            rows = []
            for sl in seq_lens:
                cfg = json.loads(json.dumps(base))
                cfg["name"] = f"schedbytes{sl}"
                cfg["batch"]["seq_len"] = sl
                rows.append(measure(client, address, cfg, steps, args.warmup, background,
                                    1.0 if args.smoke else 3.0))
            client.close()
        finally:
            stop_cluster(procs)
    world = base["parallel"]["dp"]
    print(f"config {args.config}: {world} ranks x {base['batch']['micro_batches']} micro-batches, "
          f"{steps} steps per seq_len, {args.workers} workers; idle scheduler traffic "
          f"{background:,.0f} B/s")
    print("net of idle: minus the cluster's traffic before any service ran; net of svc idle: "
          "minus the traffic with the service up and nobody reading (its plugin's polls ...)")
    print(f"{'seq_len':>8}{'batches':>9}{'seconds':>9}{'sched B/batch':>15}{'net of idle':>13}"
          f"{'svc idle B/s':>14}{'net of svc idle':>17}{'msgs/batch':>12}{'tensor B/batch':>16}")
    for r in rows:
        print(f"{r['seq_len']:>8}{r['batches']:>9}{r['seconds']:>9.2f}{r['bytes_per_batch']:>15,.0f}"
              f"{r['bytes_per_batch_net']:>13,.0f}{r['service_idle_rate']:>14,.0f}"
              f"{r['bytes_per_batch_net_service']:>17,.0f}{r['msgs_per_batch']:>12.1f}"
              f"{r['tensor_bytes_per_batch']:>16,.0f}")
    lo, hi = rows[0], rows[-1]
    print(f"ratio of scheduler bytes per batch, seq_len {hi['seq_len']} / {lo['seq_len']}: "
          f"{hi['bytes_per_batch'] / lo['bytes_per_batch']:.2f}, net of svc idle "
          f"{hi['bytes_per_batch_net_service'] / lo['bytes_per_batch_net_service']:.2f} "
          f"(tensor bytes: {hi['tensor_bytes_per_batch'] / lo['tensor_bytes_per_batch']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
