"""Many readers against one service: the control plane's cost per rank and step.

A real ``dask scheduler`` process (pinned to one core where the machine allows it)
and ``--dask-workers`` ``dask worker`` processes (``bench_memory.start_cluster``:
``--no-nanny`` with the nanny's environment); this process starts the service on
them (the demo config's sources, ``seq_len`` 256, 1 micro-batch,
``parallel: {dp: N/8, tp: 8}``) and owns it, as ``msd-dask serve`` would.  The
scheduler, the workers and the hosts run with the Dask settings
docs/deployment.md recommends for the service's processes
(``msd_dask.service.EMBEDDED_DASK_CONFIG``: no stack sampling, 200 ms ticks).

``N`` ranks are simulated as hosts of 8 ranks, one DP group each (tp = 8, the order
``tp-cp-dp-pp``: host ``h`` reads ranks ``8h .. 8h+7``): one process per host,
forked from a server that imported torch (a training process has it) and msd_dask
once (``multiprocessing`` ``forkserver``: 128 separately started hosts would take
about 170 MiB each), which calls ``DataService.connect(address, name)`` once and
runs 8 threads, each iterating ``svc.reader(rank)``. When every host is connected
with its readers created, the CPU of the scheduler and of the workers is measured
for ``--idle-seconds`` (the idle baseline: the service, its clients, their
heartbeats; not after the reads: the service then plans and publishes the next
rounds); then all hosts read step 0 at the same moment. Step ``k ≥ 1`` of a host is
due ``k × step_seconds`` after its 8 ranks all had step 0, or when they all had step
``k - 1`` if that is later (a per-host barrier, as a training step waits for its
ranks; the same pace on every host). A rank's "compute" is the wait until its next
step is due.

Reported per ``N`` (``--json``: these and more, per ``N``):

* **hosts up**: seconds from launching the host processes until all were connected
  (process start and imports included); **connect**: the slowest host's
  ``DataService.connect`` plus its 8 readers (JSON ``sched_cpu_per_connect_s``:
  the scheduler's CPU while the hosts connected, net of the idle baseline, per host);
* **first batch**: seconds from the common start until every rank had step 0;
* **steps/s**: the paced steps (1 .. steps-1) / the slowest host's time for them,
  against the pace ``1 / step_seconds``, and their ratio (1.00: the pace was held);
* **wait**: median and largest time a rank waited in ``next(reader)`` (paced steps);
* **sched CPU/step**: the scheduler's CPU seconds over the paced window, less the
  idle baseline's rate (**idle cores**) × the window, per step of all ranks;
* **svc CPU/rank-step**: the workers' CPU (every role) over the paced window / the
  rank-steps read in it, as measured and net of the workers' idle baseline;
* **sockets**: the most the scheduler and the busiest worker held during the
  reads (``/proc/<pid>/fd`` entries that are sockets);
* **once**: every rank read every step exactly once (its steps consecutive from the
  same first step, no repeat), and the 8 ranks of each DP group got equal
  ``input_ids`` at every step (a CRC32 per batch).

The CPU windows run from the first sample (every 0.5 s) after every host had step 0
to the last before the last read; the exit status is 1 if any rank misread.

    python scripts/bench_many_readers.py --quick                     # N = 16, 32; < 60 s
    python scripts/bench_many_readers.py --ranks 16,64,256
    python scripts/bench_many_readers.py --ranks 1024 --json many.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: ranks per simulated host (one process), = tp: a host holds one DP group
HOST_RANKS = 8
SEQ_LEN = 256


# ------------------------------------------------------------------ the host (a child process)
def _dask_env() -> dict[str, str]:
    """``EMBEDDED_DASK_CONFIG`` as the environment variables Dask reads it from."""
    from bench_scheduler_bytes import dask_environ

    from msd_dask.service.handle import EMBEDDED_DASK_CONFIG

    return dask_environ(EMBEDDED_DASK_CONFIG)[0]


def _rank_loop(reader: Any, k_steps: int, t0: float, period: float,
               barrier: threading.Barrier, out: dict[str, Any]) -> None:
    """One rank: ``k_steps`` batches.  Step 0 is read at once; step ``k`` is due ``k`` periods
    after the host's ranks all had step 0, or when they all had step ``k - 1`` if later."""
    import zlib

    steps, crcs, waits, done = [], [], [], []
    base = 0.0
    time.sleep(max(0.0, t0 - time.time()))  # every host starts at once
    try:
        for k in range(k_steps):
            delay = base + k * period - time.time()
            if k and delay > 0:
                time.sleep(delay)  # the rank "computes" until its next step is due
            t = time.time()
            batch = next(reader)
            now = time.time()
            waits.append(now - t)
            done.append(now)
            steps.append(batch.step)
            crcs.append(zlib.crc32(batch.input_ids.numpy().tobytes()))
            # the host's ranks finish a step together (a timeout: the reads are reported)
            barrier.wait(timeout=max(120.0, 10 * period))
            base = base or time.time()
        out["base"] = base
    except Exception as e:  # noqa: BLE001 - reported with the rank's results
        out["error"] = f"{type(e).__name__}: {e}"
        barrier.abort()
    out.update(steps=steps, crcs=crcs, waits=waits, done=done)


def host_process(conn: Any, host: int, address: str, name: str, steps: int, period: float,
                 out: str, log: str) -> None:
    """One host (a forked child): connect once, create 8 readers, send ``ready``; on
    ``("go", t0)`` read, write the results to ``out``, send ``done``; exit when told."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)  # Dask's warnings of 128 hosts go to the run's log
    t_start = time.time()
    from msd_dask import DataService

    svc = DataService.connect(address, name)
    ranks = range(host * HOST_RANKS, (host + 1) * HOST_RANKS)
    readers = {r: svc.reader(r) for r in ranks}
    conn.send(("ready", time.time() - t_start))
    msg = conn.recv()
    if msg[0] != "go":
        os._exit(0)
    barrier = threading.Barrier(HOST_RANKS)
    outs: dict[int, dict[str, Any]] = {r: {} for r in ranks}
    threads = [threading.Thread(target=_rank_loop, args=(readers[r], steps, msg[1], period,
                                                         barrier, outs[r]), daemon=True)
               for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(out, "w") as f:
        json.dump(outs, f)
    conn.send(("done", 0.0))
    conn.recv()  # stay connected until told to go: the others may still read
    os._exit(0)


def _wait_all(conns: list[Any], procs: list[Any], word: str, what: str, timeout: float
              ) -> list[float]:
    """Until every host sent ``word``; what each sent with it.  Raises naming ``what`` on a
    timeout, a host that exited, or less than 2 GiB of memory left."""
    from multiprocessing.connection import wait

    import psutil

    got: dict[int, float] = {}
    index = {id(c): i for i, c in enumerate(conns)}
    deadline = time.monotonic() + timeout
    while len(got) < len(conns):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{len(conns) - len(got)} of {len(conns)} hosts did not report "
                               f"{what} within {timeout:.0f}s")
        if psutil.virtual_memory().available < 2 * 1024 ** 3:
            raise MemoryError(f"less than 2 GiB of memory left while waiting for {what}: stopping")
        for c in wait([c for i, c in enumerate(conns) if i not in got], min(1.0, left)):
            i = index[id(c)]
            try:
                msg = c.recv()
            except EOFError:
                raise RuntimeError(f"host {i} exited with {procs[i].exitcode} before it reported "
                                   f"{what} (see hosts.log in the run's directory)") from None
            if msg[0] == word:
                got[i] = msg[1]
    return [got[i] for i in range(len(conns))]


def _cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _sockets(pid: int) -> int:
    """Sockets among ``pid``'s open file descriptors."""
    n = 0
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            n += os.readlink(os.path.join(fd_dir, fd)).startswith("socket:")
        except OSError:
            pass  # closed meanwhile
    return n


def _pin(pid: int, core: int) -> bool:
    """Pin every thread of ``pid`` (threads it starts later inherit it) to ``core``."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {core})
        return True
    except OSError:
        return False


def _idle(scheduler: int, workers: list[int], seconds: float) -> tuple[float, float]:
    """The cores the scheduler and the workers (together) use over the next ``seconds``."""
    s0, w0, t0 = _cpu(scheduler), sum(_cpu(w) for w in workers), time.perf_counter()
    time.sleep(seconds)
    t = time.perf_counter() - t0
    return (_cpu(scheduler) - s0) / t, (sum(_cpu(w) for w in workers) - w0) / t


class _Sampler(threading.Thread):
    """Samples the scheduler's and the workers' CPU seconds and sockets twice a second.

    Keeps ``(time, scheduler CPU, workers' CPU)`` per sample and each process's
    largest socket count.
    """

    def __init__(self, scheduler: int, workers: list[int]):
        super().__init__(daemon=True)
        self.scheduler, self.workers = scheduler, workers
        self.cpu: list[tuple[float, float, float]] = []
        self.peak = dict.fromkeys([scheduler, *workers], 0)
        self.halt = threading.Event()

    def sample(self) -> None:
        self.cpu.append((time.time(), _cpu(self.scheduler), sum(_cpu(w) for w in self.workers)))
        for pid in self.peak:
            try:
                self.peak[pid] = max(self.peak[pid], _sockets(pid))
            except OSError:
                pass

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(0.5)

    def between(self, start: float, end: float) -> tuple[float, float, float, float]:
        """``(first time, last time, scheduler CPU, workers' CPU)`` from the first sample at
        or after ``start`` to the last at or before ``end``."""
        inside = [c for c in self.cpu if start <= c[0] <= end]
        if len(inside) < 2:
            raise RuntimeError(f"fewer than 2 CPU samples in the paced window ({end - start:.1f} s)")
        (t0, s0, w0), (t1, s1, w1) = inside[0], inside[-1]
        return t0, t1, s1 - s0, w1 - w0


def service_config(base: str, n: int) -> dict[str, Any]:
    """The service of ``n`` ranks: ``base``'s sources, seq_len 256, 1 micro-batch, tp = 8."""
    from msd_dask.core.config import parse_config

    cfg = parse_config(base).to_dict()
    cfg.update(name=f"many-{n}", parallel={"dp": n // HOST_RANKS, "tp": HOST_RANKS},
               batch={"seq_len": SEQ_LEN, "micro_batches": 1}, timeout=300)
    return cfg


def check_once(results: dict[int, dict[str, Any]], steps: int, ranks: int) -> list[str]:
    """What is wrong with the ranks' reads (empty: every one of ``ranks`` ranks read every
    step exactly once, and each DP group's ranks got the same ``input_ids`` at every step)."""
    problems = []
    missing = sorted(set(range(ranks)) - set(results))
    if missing:
        problems.append(f"{len(missing)} rank(s) reported nothing: {missing[:8]}")
    firsts = {r["steps"][0] for r in results.values() if r.get("steps")}
    if len(firsts) > 1:
        problems.append(f"ranks started at different steps: {sorted(firsts)}")
    start = min(firsts, default=0)
    for rank, r in sorted(results.items()):
        if r.get("error"):
            problems.append(f"rank {rank}: {r['error']}")
        if r.get("steps") != list(range(start, start + steps)):
            problems.append(f"rank {rank} read steps {r.get('steps')}")
    for host in {rank // HOST_RANKS for rank in results}:
        crcs = {tuple(results[r].get("crcs", ())) for r in
                range(host * HOST_RANKS, (host + 1) * HOST_RANKS) if r in results}
        if len(crcs) > 1:
            problems.append(f"DP group {host}: its ranks got different batches")
    return problems


class _Hosts:
    """The host processes of a run, forked from a server that imported torch and msd_dask once
    (``multiprocessing`` ``forkserver``: they share those pages, about 170 MiB each otherwise)."""

    def __init__(self, tmp: str):
        import multiprocessing

        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "distributed", "msd_dask.service"])
        self.log = os.path.join(tmp, "hosts.log")
        self.procs: list[Any] = []
        self.conns: list[Any] = []

    def start(self, host: int, *args: Any) -> None:
        mine, theirs = self.ctx.Pipe()
        p = self.ctx.Process(target=host_process, args=(theirs, host, *args, self.log),
                             name=f"host {host}")
        p.start()
        theirs.close()
        self.procs.append(p)
        self.conns.append(mine)

    def wait(self, word: str, what: str, timeout: float) -> list[float]:
        return _wait_all(self.conns, self.procs, word, what, timeout)

    def send(self, msg: tuple[str, float]) -> None:
        for c in self.conns:
            c.send(msg)

    def stop(self) -> None:
        """Tell every host to exit; kill those still there after 30 s."""
        for c in self.conns:
            try:
                c.send(("stop", 0.0))
            except OSError:
                pass  # exited already
        deadline = time.monotonic() + 30
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in self.conns:
            c.close()


def _wait_planned(svc: Any, timeout: float) -> None:
    """Until the planner planned its first step (a first plan may compile the planner's
    kernels: not part of the first batch)."""
    deadline = time.monotonic() + timeout
    while svc.planner.stats().result(timeout=timeout)["steps_planned"] < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the planner of {svc.name!r} planned no step within {timeout:.0f}s")
        time.sleep(0.2)


def run_one(n: int, a: argparse.Namespace, address: str, sched_pid: int, worker_pids: list[int],
            tmp: str) -> dict[str, Any]:
    """Start the service of ``n`` ranks, read it from ``n / 8`` hosts, close it; the figures."""
    from msd_dask import DataService

    hosts_n = n // HOST_RANKS
    svc = DataService.start(service_config(a.config, n), address, timeout=a.timeout)
    hosts = _Hosts(tmp)
    try:
        _wait_planned(svc, a.timeout)
        t_launch, c_launch = time.time(), _cpu(sched_pid)
        for h in range(hosts_n):
            hosts.start(h, address, svc.name, a.steps, a.step_seconds,
                        os.path.join(tmp, f"host-{n}-{h}.json"))
        connects = hosts.wait("ready", "connected with its readers created",
                              a.timeout + 2.0 * hosts_n)
        connected, c_connect = time.time() - t_launch, _cpu(sched_pid) - c_launch
        time.sleep(min(2.0, a.idle_seconds))  # the last readers' first requests settle
        idle_before = _idle(sched_pid, worker_pids, a.idle_seconds)
        sampler = _Sampler(sched_pid, worker_pids)
        sampler.start()
        t0 = time.time() + 1.0  # every host has the line by then
        hosts.send(("go", t0))
        hosts.wait("done", "its ranks' last step", a.steps * a.step_seconds + a.timeout)
        sampler.halt.set()
        sampler.join(5)
        sampler.sample()
    finally:
        hosts.stop()
        svc.close()
    results: dict[int, dict[str, Any]] = {}
    for h in range(hosts_n):
        with open(os.path.join(tmp, f"host-{n}-{h}.json")) as f:
            results.update({int(r): v for r, v in json.load(f).items()})
    problems = check_once(results, a.steps, n)
    read = [r for r in results.values() if len(r.get("done", ())) == a.steps]
    nan = float("nan")
    first = max(r["done"][0] for r in read) - t0 if len(read) == n else nan
    # the paced steps: 1 .. steps-1, from when a host's ranks all had step 0
    paced = a.steps - 1
    span = max((r["done"][-1] - r["base"] for r in read), default=nan) if len(read) == n else nan
    achieved = paced / span if paced and span > 0 else nan
    start = max((r["base"] for r in read), default=t0)
    end = max((r["done"][-1] for r in read), default=time.time())
    w0, w1, cs, cw = sampler.between(start, end) if paced else (nan, nan, nan, nan)
    secs = w1 - w0
    # the rank-steps read between the two samples (step 0 excluded)
    rank_steps = sum(w0 < d <= w1 for r in read for d in r["done"][1:]) or nan
    waits = [w for r in results.values() for w in r.get("waits", ())[1:]]
    idle_s, idle_w = idle_before
    workers = [sampler.peak[p] for p in worker_pids]
    return {
        "ranks": n, "hosts": hosts_n, "dp": hosts_n, "tp": HOST_RANKS, "steps": a.steps,
        "step_seconds": a.step_seconds, "hosts_connected_s": connected,
        "connect_max_s": max(connects), "connect_median_s": statistics.median(connects),
        "first_batch_s": first,
        "achieved_steps_per_s": achieved, "paced_steps_per_s": 1.0 / a.step_seconds,
        "ratio": achieved * a.step_seconds,
        "wait_median_s": statistics.median(waits) if waits else nan,
        "wait_max_s": max(waits, default=nan),
        "sched_cpu_per_connect_s": (c_connect - idle_s * connected) / hosts_n,
        "window_s": secs, "sched_idle_cores": idle_s,
        "sched_cpu_s": cs, "sched_cores": cs / secs,
        "sched_cpu_per_step_s": (cs - idle_s * secs) / (rank_steps / n),
        "sched_cpu_per_rank_step_s": (cs - idle_s * secs) / rank_steps,
        "workers_idle_cores": idle_w, "workers_cpu_s": cw, "workers_cores": cw / secs,
        "svc_cpu_per_rank_step_s": cw / rank_steps,
        "svc_cpu_per_rank_step_net_s": (cw - idle_w * secs) / rank_steps,
        "sockets_scheduler": sampler.peak[sched_pid], "sockets_worker_max": max(workers),
        "sockets_workers": workers,
        "once": not problems, "problems": problems[:20],
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'ranks':>6}{'hosts':>6}{'hosts up s':>11}{'connect s':>10}{'first batch s':>14}"
          f"{'steps/s':>9}"
          f"{'paced':>7}{'ratio':>7}{'wait med/max ms':>16}{'sched CPU/step ms':>18}"
          f"{'idle cores':>11}{'svc CPU/rank-step ms':>24}{'sockets sched/worker':>21}"
          f"{'once':>6}")
    for r in rows:
        print(f"{r['ranks']:>6}{r['hosts']:>6}{r['hosts_connected_s']:>11.1f}"
              f"{r['connect_max_s']:>10.1f}{r['first_batch_s']:>14.2f}"
              f"{r['achieved_steps_per_s']:>9.3f}"
              f"{r['paced_steps_per_s']:>7.3f}{r['ratio']:>7.2f}"
              f"{r['wait_median_s'] * 1e3:>8.0f}/{r['wait_max_s'] * 1e3:<7.0f}"
              f"{r['sched_cpu_per_step_s'] * 1e3:>18.1f}{r['sched_idle_cores']:>11.3f}"
              f"{r['svc_cpu_per_rank_step_s'] * 1e3:>16.2f}/"
              f"{r['svc_cpu_per_rank_step_net_s'] * 1e3:<7.2f}"
              f"{r['sockets_scheduler']:>13}/{r['sockets_worker_max']:<7}"
              f"{'yes' if r['once'] else 'NO':>6}")
    for r in rows:
        print(f"{r['ranks']} ranks: scheduler {r['sched_cores']:.3f} cores while reading, "
              f"{r['sched_idle_cores']:.3f} idle ({r['sched_cpu_per_rank_step_s'] * 1e6:.0f} us "
              f"per rank-step); workers {r['workers_cores']:.2f} cores while reading, "
              f"{r['workers_idle_cores']:.2f} idle; scheduler CPU per host connecting (client "
              f"and 8 readers) {r['sched_cpu_per_connect_s'] * 1e3:.0f} ms")
    for r in rows:
        for p in r["problems"]:
            print(f"ranks {r['ranks']}: {p}")


def _ranks(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or any(n < HOST_RANKS or n % HOST_RANKS for n in out):
        raise argparse.ArgumentTypeError(f"ranks are multiples of {HOST_RANKS} (one host of "
                                         f"{HOST_RANKS} ranks per process), got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    from cli_types import bounded, positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=_ranks, default=[16, 64, 256, 1024],
                   help="comma-separated rank counts, multiples of 8 (default 16,64,256,1024); "
                        "one service and N/8 host processes each")
    # (each checked here: --idle-seconds -1 failed after the hosts connected, 0 made every
    # net figure the gross one, --steps 1 printed only nan, --dask-workers 0 a traceback
    # after the scheduler started; a review)
    p.add_argument("--steps", type=bounded(int, 2, above=False), default=10,
                   help="steps every rank reads, at least 2: the figures are over steps 1 on "
                        "(default 10)")
    p.add_argument("--step-seconds", type=positive_float, default=6.0,
                   help="the pace: one step per this many seconds (default 6: 1,024 ranks "
                        "kept 95%% of it on a 2-core machine)")
    p.add_argument("--idle-seconds", type=positive_float, default=8.0,
                   help="the idle baseline of the scheduler and the workers is measured for this "
                        "long with every host connected, before the reads (default 8)")
    p.add_argument("--dask-workers", type=positive_int, default=2,
                   help="dask worker processes (default 2)")
    p.add_argument("--config", default="configs/demo.yaml",
                   help="the sources (default: the demo's; its corpus is written if missing)")
    p.add_argument("--timeout", type=positive_float, default=300.0,
                   help="seconds each wait may take beyond what the run needs (default 300)")
    p.add_argument("--quick", action="store_true",
                   help="N = 16 and 32, 4 steps of 0.5 s, 1 s idle baseline (< 60 s)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    if a.quick:
        a.ranks, a.steps, a.step_seconds, a.idle_seconds = [16, 32], 4, 0.5, 1.0
    from msd_dask import load_config

    # the files need not exist yet: they are written below if they are missing
    root = os.path.dirname(load_config(a.config, check_files=False).sources[0].uri
                           .split("*")[0].rstrip("/"))
    if not os.path.isdir(root):
        from msd_dask.examples.demo import write_demo_corpus

        print(f"writing the demo corpus to {root}", flush=True)
        write_demo_corpus(root)
    import dask.config
    from bench_memory import start_cluster
    from bench_scheduler_bytes import stop_cluster
    from distributed import Client

    os.environ.update(_dask_env())  # the hosts' server starts with them, as does this process's
    dask.config.refresh()

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        address, cluster = start_cluster(tmp, a.dask_workers, {})  # with EMBEDDED_DASK_CONFIG
        try:
            with Client(address, timeout=a.timeout) as c:
                c.wait_for_workers(a.dask_workers, timeout=a.timeout)
            pinned = _pin(cluster[0].pid, 0)
            print(f"{a.dask_workers} dask workers x 2 threads, scheduler "
                  + ("pinned to core 0" if pinned else "not pinned")
                  + f"; {os.cpu_count()} cores; seq_len {SEQ_LEN} x 1 micro-batch; "
                  f"tp {HOST_RANKS} (a host = one DP group); {a.steps} steps paced at "
                  f"{a.step_seconds:g} s", flush=True)
            for n in a.ranks:
                rows.append(run_one(n, a, address, cluster[0].pid, [w.pid for w in cluster[1:]],
                                    tmp))
                print(f"N = {n}: done", flush=True)
        finally:
            stop_cluster(cluster)
    print_table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["once"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
