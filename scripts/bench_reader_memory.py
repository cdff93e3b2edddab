"""What a msd_dask reader adds to a training process, stage by stage (PSS and USS).

``bench_memory.py`` reports one figure per reader ("what a reader adds to a
training process": a reader's PSS minus a bare ``python -c "import torch"``).
This script splits it: a training process is started against a running
service (the same one ``bench_memory.py`` starts: a ``dask scheduler``, 2
``dask worker`` processes, the demo corpus as ``--sources`` sources) and
measures its own memory after each stage:

1. ``import torch`` (the training process before msd_dask);
2. ``import msd_dask.torch`` (the adapter; the service is imported on first use);
3. ``import distributed`` (the Dask client library);
4. ``import msd_dask.service`` (the reader's own modules);
5. ``DataService.connect`` (the Client, the service's registry and config, and
   the actor handles it unpickles: planner, constructors, loaders);
6. ``DataService.reader(rank)``;
7. ``--warm`` batches read, then released;
8. with ``--steady N``: ``N`` batches more (the process's steady state).

Last, glibc's ``malloc_trim(0)`` is called once and the PSS it gave back is
reported: heap pages that were free but still held (left by compiling
msd_dask's modules from source, by the handshake, by a round's messages).
Giving them back once is not a lasting cut: a reader that trimmed after
connecting and after its first round had taken as many pages again ~15
batches later (2 ranks, 60 batches, alternating runs: 201.5 and 202.7 MiB at
the end without, 201.9 and 201.9 with).

Each figure is the process's PSS and USS (``psutil`` ``memory_full_info``)
after ``gc.collect()``; the modules imported while connecting and the threads
the client starts are listed.  ``--ranks`` readers run (the others read in the
background so that steps flow); rank 0 is measured.

    python scripts/bench_reader_memory.py            # 2 ranks, 16 sources
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child_stages(address: str, rank: int, warm: int, steady: int = 0) -> None:
    """The measured training process: one JSON line per stage, then the imports and threads."""
    import gc
    import threading
    import time

    import psutil

    proc = psutil.Process()

    def stage(name: str) -> None:
        gc.collect()
        time.sleep(0.3)
        m = proc.memory_full_info()
        print(json.dumps({"stage": name, "pss": m.pss, "uss": m.uss,
                          "threads": threading.active_count()}), flush=True)

    stage("python")
    import torch  # noqa: F401

    stage("import torch")
    import msd_dask.torch  # noqa: F401

    stage("import msd_dask.torch")
    import distributed  # noqa: F401

    stage("import distributed")
    import msd_dask.service  # noqa: F401

    stage("import msd_dask.service")
    from msd_dask import DataService

    before = set(sys.modules)
    svc = DataService.connect(address, "benchmem", timeout=120)
    connect_mods = sorted(set(sys.modules) - before)
    stage("DataService.connect")
    reader = svc.reader(rank)
    stage("DataService.reader")
    for _ in range(warm):
        batch = next(reader)
    del batch
    stage(f"{warm} batches read")
    if steady:
        for _ in range(steady):
            batch = next(reader)
        del batch
        stage(f"{steady} batches more")
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to report
        trim = None
    if trim is not None:
        trim(0)
        stage("malloc_trim(0) (free heap)")
    print(json.dumps({"connect_imports": connect_mods,
                      "threads": sorted(t.name for t in threading.enumerate())}), flush=True)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", "-R", type=int, default=2)
    p.add_argument("--sources", "-S", type=int, default=16)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--root", default="data/demo")
    p.add_argument("--warm", type=int, default=3)
    p.add_argument("--steady", type=int, default=0, help="batches read after the --warm ones")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--child-stages", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child_stages:
        child_stages(a.child_stages, 0, a.warm, a.steady)
        return 0

    import bench_memory
    from bench_scheduler_bytes import _start_cluster, stop_cluster

    from msd_dask import load_config

    cfg = load_config(a.config)
    common = ["--ranks", str(a.ranks), "--workers", "1", "--sources", str(a.sources),
              "--config", a.config, "--root", a.root, "--seq-len", str(cfg.batch.seq_len),
              "--micro-batches", str(cfg.batch.micro_batches), "--warm",
              str(a.warm + a.steady)]  # the other ranks read as far as the measured one
    with tempfile.TemporaryDirectory() as tmp:
        address, cluster = _start_cluster(tmp, 2, count=False)
        procs = bench_memory.Procs()
        try:
            procs.start("serve", ["--child", "serve", "--address", address, *common])
            procs.wait_ready(["serve"], a.timeout)
            for r in range(1, a.ranks):
                procs.start(f"rank{r}", ["--child", "reader", "--rank", str(r),
                                         "--address", address, *common])
            res = subprocess.run([sys.executable, os.path.abspath(__file__), "--warm", str(a.warm),
                                  "--steady", str(a.steady), "--child-stages", address],
                                 capture_output=True, text=True, timeout=a.timeout)
            if res.returncode != 0:
                raise RuntimeError(f"the measured reader failed:\n{res.stderr[-3000:]}")
        finally:
            procs.stop()
            stop_cluster(cluster)
    lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    stages = [x for x in lines if "stage" in x]
    extra = next(x for x in lines if "connect_imports" in x)
    mib = 1024 ** 2
    print(f"a training process reading rank 0 of {a.ranks} ranks, {a.sources} sources; "
          f"PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}")
    print(f"{'stage':<28}{'PSS MiB':>10}{'+PSS':>8}{'USS MiB':>10}{'+USS':>8}{'threads':>9}")
    prev = None
    for s in stages:
        dp = "" if prev is None else f"{(s['pss'] - prev['pss']) / mib:+.1f}"
        du = "" if prev is None else f"{(s['uss'] - prev['uss']) / mib:+.1f}"
        print(f"{s['stage']:<28}{s['pss'] / mib:>10.1f}{dp:>8}{s['uss'] / mib:>10.1f}{du:>8}"
              f"{s['threads']:>9}")
        prev = s
    torch_stage = next(s for s in stages if s["stage"] == "import torch")
    last = [s for s in stages if not s["stage"].startswith("malloc_trim")][-1]  # untrimmed
    print(f"{'all of msd_dask (after torch)':<28}{'':>10}"
          f"{(last['pss'] - torch_stage['pss']) / mib:>+8.1f}{'':>10}"
          f"{(last['uss'] - torch_stage['uss']) / mib:>+8.1f}")
    print("modules imported while connecting: "
          + ", ".join(m for m in extra["connect_imports"] if "." not in m or m.startswith("msd_"))
          + f" ({len(extra['connect_imports'])} in all)")
    print("threads: " + ", ".join(extra["threads"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
