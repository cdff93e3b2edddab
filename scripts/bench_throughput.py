"""Delivered tokens/s of msd_dask against the single-process limit and a per-rank HF loader, side by side.

Three pipelines deliver the config's ``dp`` ranks' batches (``micro_batches ×
seq_len``) from the same sources with the same tokenizer, one after the other
in one run, on the same cores:

* **single process (limit)**: one Python process doing the whole job with
  nothing in between: read every source's units, tokenize, pack rows of
  ``seq_len`` (sequential first fit), for as many tokens as msd_dask delivered.
* **HF streaming (per rank)**: what each rank runs today
  (``scripts/baselines.py``): ``dp`` rank loaders, each
  ``split_dataset_by_node(interleave_datasets([load_dataset(...,
  streaming=True) per source]))`` in a ``DataLoader`` with ``--hf-workers``
  worker processes that tokenize and pack; this process takes one batch per
  rank per step.
* **msd_dask**: a ``dask scheduler`` process and ``--workers`` ``dask worker``
  processes (``--threads`` threads each) host the roles; this process reads
  every rank through ``svc.reader(rank)``.

The ranks of both per-rank pipelines are read concurrently, one thread per
rank in this process (a training job's ranks read at the same time); with
``--sequential`` one thread takes them in turn.  Two rates per pipeline:
*steady*, over the ``--steps`` steps after every rank's first batch, and *from
start*, from building the pipeline (``DataService.start``, the HF loaders) to
the last batch.  The steady rate favours msd_dask when its loaders read ahead
during the first batch (``read_ahead`` units per source, 8 by default: the
whole demo source), so the run also reports how many tokens msd_dask's loaders
tokenized during the steady window.  Tokens are non-padding tokens (the HF
baseline's rows are always full).  ``--tokenizer`` picks the byte tokenizer, a
byte-level BPE tokenizer (vocabulary 4096, trained on the demo corpus by
``train_demo_tokenizer.py`` into a temporary file unless ``--tokenizer-file``
names one), or both.

The scheduler process counts every byte it reads and writes on any TCP comm
(``--preload`` of ``bench_scheduler_bytes.py``); reported per delivered batch
(one rank's batch of one step) over msd_dask's timed window, also net of the
idle background (heartbeats, measured for a few seconds before any service
runs) and net of the traffic with the service up and nobody reading (the
scheduler plugin's polls: they grow with time, not with batches).
``bench_scheduler_bytes.py`` shows that the figure does not grow with the
batch size; here it is shown for the throughput run's batches.

Absolute rates on a shared machine are noise; the ratios are the figures.

    python scripts/bench_throughput.py configs/demo.yaml --steps 100 --tokenizer both
    python scripts/bench_throughput.py --quick      # 30 steps, both tokenizers
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def single_process(cfg: Any, tokens_goal: int) -> tuple[int, float]:
    """Read, tokenize and pack until ``tokens_goal`` tokens; returns (tokens, seconds)."""
    from msd_dask.core.packing import pack_rows
    from msd_dask.formats import get_format
    from msd_dask.sources.documents import read_unit
    from msd_dask.sources.storage import open_source
    from msd_dask.sources.tokenizer import make_tokenizer

    tok = make_tokenizer(cfg.tokenizer)
    seq_len, rows_per_step = cfg.batch.seq_len, cfg.batch.micro_batches
    t0 = time.perf_counter()
    streams = []
    for s in cfg.sources:
        files = open_source(s.uri, s.storage_options)
        fmt = get_format(s.format)
        units = [u for p in files.paths for u in fmt.units(files.fs, p)]
        streams.append((s, files, units))
    done = 0
    row: list[tuple[np.ndarray, int]] = []
    rows: list[list[tuple[np.ndarray, int]]] = []
    used = 0
    i = 0
    while done < tokens_goal:
        for s, files, units in streams:
            docs = read_unit(s, files.fs, units[i % len(units)], tok)
            for d in docs:
                for start in range(0, len(d), seq_len):
                    piece = d[start:start + seq_len + 1]
                    n = min(seq_len, len(d) - start)
                    if used + n > seq_len:
                        rows.append(row)
                        row, used = [], 0
                        if len(rows) == rows_per_step:
                            pack_rows(rows, seq_len, tok.pad_id)
                            rows = []
                    row.append((piece, n))
                    used += n
                    done += n
        i += 1
    return done, time.perf_counter() - t0


def consume(iterators: list[Any], steps: int, take: Any, sequential: bool) -> tuple[list[Any], float]:
    """``steps`` items from every iterator; returns ``take(item)`` summed per iterator, and seconds.

    Concurrently, one thread per iterator (ranks of a training job read at the
    same time), unless ``sequential``: then one thread takes rank 0's item,
    rank 1's ..., step after step.
    """
    from concurrent.futures import ThreadPoolExecutor

    def run(it: Any) -> Any:
        acc = None
        for _ in range(steps):
            x = take(next(it))
            acc = x if acc is None else acc + x
        return acc

    t0 = time.perf_counter()
    if sequential:
        accs: list[Any] = [None] * len(iterators)
        for _ in range(steps):
            for i, it in enumerate(iterators):
                x = take(next(it))
                accs[i] = x if accs[i] is None else accs[i] + x
    else:
        with ThreadPoolExecutor(len(iterators)) as pool:
            accs = list(pool.map(run, iterators))
    return accs, time.perf_counter() - t0


def hf_streaming(cfg: Any, steps: int, workers: int, sequential: bool) -> dict[str, Any]:
    """``dp`` per-rank HF streaming loaders consumed here, a first batch then ``steps`` per rank.

    ``start`` is the time from building the loaders to every rank's first batch.
    """
    import baselines

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    sources = baselines.config_sources(cfg)
    dp = cfg.parallel.dp
    tokenizer = cfg.to_dict()["tokenizer"]
    t0 = time.perf_counter()
    its = [iter(baselines.hf_loader(sources, r, dp, workers, cfg.batch.seq_len,
                                    cfg.batch.micro_batches, seed=cfg.seed, tokenizer=tokenizer))
           for r in range(dp)]
    try:
        # first batch: worker start-up and the shuffle buffer's first fill
        first, _ = consume(its, 1, lambda b: int(b["num_tokens"]), sequential)
        start = time.perf_counter() - t0
        counts, elapsed = consume(its, steps, lambda b: int(b["num_tokens"]), sequential)
    finally:
        for it in its:
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
    return {"tokens": sum(counts), "seconds": elapsed, "start_tokens": sum(first),
            "start_seconds": start}


def _batch_counts(b: Any) -> np.ndarray:
    """(non-padding tokens, bytes of the batch's tensors) of an msd_dask batch."""
    nbytes = sum(t.nbytes for t in (b.input_ids, b.labels, b.position_ids) if t is not None)
    nbytes += sum(t.nbytes for t in b.cu_seqlens or [])
    return np.array([b.num_tokens, nbytes], dtype=np.int64)


def _tokens_read(svc: Any) -> int:
    return sum(int(s["tokens_read"]) for s in svc.stats()["sources"].values())


def service(client: Any, address: str, cfg: dict[str, Any], steps: int,
            background: float, sequential: bool, idle_seconds: float = 3.0) -> dict[str, Any]:
    """Start the service on the cluster at ``address``; read every rank, a first batch then ``steps``.

    ``start`` is the time from ``DataService.start`` to every rank's first batch;
    ``read`` the tokens its loaders read (tokenized) during the timed steps;
    ``service_idle_rate`` the scheduler's traffic in B/s after them, with the service
    up and nobody reading (the scheduler plugin's polls, heartbeats).
    """
    from bench_scheduler_bytes import _diff, _rate, _snapshot, per_batch

    from msd_dask import DataService

    t0 = time.perf_counter()
    with DataService.start(cfg, address) as svc:
        c = svc.config
        readers = [svc.reader(r) for r in range(c.parallel.world_size)]
        counts = [all(v == 0 for k, v in c.parallel.coords(rd.rank).items() if k != "dp")
                  for rd in readers]  # one member per DP group counts its tokens
        first, _ = consume(readers, 1, _batch_counts, sequential)
        start = time.perf_counter() - t0
        read0 = _tokens_read(svc)
        a = _snapshot(client)
        per_rank, elapsed = consume(readers, steps, _batch_counts, sequential)
        d = _diff(a, _snapshot(client))
        read = _tokens_read(svc) - read0
        tokens = sum(int(x[0]) for x, count in zip(per_rank, counts, strict=True) if count)
        tensor_bytes = sum(int(x[1]) for x in per_rank)
        imbalance = svc.stats()["planner"]["mean_imbalance"]
        time.sleep(0.5)  # the constructors refill, then the service idles
        service_idle = _rate(client, idle_seconds)
    batches = steps * len(readers)
    return {"tokens": tokens, "seconds": elapsed, "imbalance": imbalance, "batches": batches,
            "start_tokens": sum(int(x[0]) for x, count in zip(first, counts, strict=True) if count),
            "start_seconds": start, "read": read,
            **per_batch(d, batches, elapsed, background, service_idle, tensor_bytes)}


def bpe_tokenizer(root: str, out: str) -> str:
    """Train the demo's byte-level BPE tokenizer into ``out`` (a few seconds) and return ``out``."""
    import train_demo_tokenizer

    train_demo_tokenizer.main([root, out])
    return out


def main(argv: list[str] | None = None) -> int:
    from cli_types import natural, positive_int

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="configs/demo.yaml")
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 2,
                   help="dask workers")
    p.add_argument("--threads", type=positive_int, default=1, help="threads per dask worker")
    p.add_argument("--hf-workers", type=natural, default=1,
                   help="DataLoader workers per HF rank (0: the rank's own process)")
    p.add_argument("--tokenizer", choices=["bytes", "bpe", "both"], default="both")
    p.add_argument("--tokenizer-file", help="a tokenizer.json for --tokenizer bpe "
                   "(default: train one on --corpus into a temporary file)")
    p.add_argument("--corpus", default="data/demo", help="corpus the BPE tokenizer is trained on")
    p.add_argument("--sequential", action="store_true",
                   help="take the ranks' batches in turn from one thread (default: one thread per rank)")
    p.add_argument("--quick", action="store_true", help="30 steps")
    p.add_argument("--smoke", action="store_true",
                   help="3 steps, seq_len 1024, dp 2 (CI)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from bench_scheduler_bytes import _client_and_idle_rate, _start_cluster, stop_cluster

    from msd_dask import load_config

    base = load_config(args.config).to_dict()
    steps = 3 if args.smoke else 30 if args.quick else args.steps
    if args.smoke:
        # dp 2: the HF side's loaders each take ~5 s to shut down (datasets' sleep on its
        # threads' shutdown, one loader after the other), and 2 ranks still read concurrently
        base["batch"]["seq_len"] = 1024
        base["parallel"]["dp"] = 2
    kinds = ["bytes", "bpe"] if args.tokenizer == "both" else [args.tokenizer]
    results: dict[str, dict[str, Any]] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tok_file = args.tokenizer_file
        if "bpe" in kinds and tok_file is None:
            tok_file = bpe_tokenizer(args.corpus, os.path.join(tmp, "bpe.tokenizer.json"))
        address, procs = _start_cluster(tmp, args.workers, nthreads=args.threads)
        try:
            client, background = _client_and_idle_rate(address, args.workers,
                                                       1.0 if args.smoke else 3.0)
            for kind in kinds:
                cfg_d = json.loads(json.dumps(base))
                cfg_d["name"] = f"throughput-{kind}"
                cfg_d["tokenizer"] = {"kind": "bytes"} if kind == "bytes" else \
                    {"kind": "hf", "path": os.path.abspath(str(tok_file))}
                cfg = load_config(cfg_d)
                svc = service(client, address, cfg_d, steps, background, args.sequential,
                              1.0 if args.smoke else 3.0)
                hf = hf_streaming(cfg, steps, args.hf_workers, args.sequential)
                lim_tokens, lim_secs = single_process(cfg, svc["tokens"] + svc["start_tokens"])
                limit = {"tokens": lim_tokens, "seconds": lim_secs, "start_tokens": 0,
                         "start_seconds": 0.0}
                results[kind] = {"service": svc, "hf": hf, "limit": limit}
            client.close()
        finally:
            stop_cluster(procs)
    secs = time.perf_counter() - t_start
    c = base["parallel"]
    dp = c["dp"]
    world = dp * c.get("tp", 1) * c.get("cp", 1) * c.get("pp", 1)
    print(f"config {args.config}: {steps} steps x {world} ranks (dp {dp}) x "
          f"{base['batch']['micro_batches']} micro-batches x {base['batch']['seq_len']} tokens; "
          f"msd_dask: {args.workers} dask workers x {args.threads} thread(s); "
          f"HF: {args.hf_workers} DataLoader worker(s) per rank; ranks read "
          f"{'in turn by one thread' if args.sequential else 'concurrently, one thread each'}; "
          f"{os.cpu_count()} cores; {secs:.0f} s")
    print("steady = the timed steps after every rank's first batch; from start = from building "
          "the pipeline (DataService.start, the HF loaders) to the last batch, first batch included")
    print(f"{'tokenizer':<10}{'pipeline':<26}{'tokens':>11}{'steady tok/s':>14}{'/ limit':>9}"
          f"{'from start':>12}{'/ limit':>9}{'start s':>9}")
    names = {"limit": "single process (limit)", "hf": "HF streaming (per rank)",
             "service": "msd_dask"}
    for kind, r in results.items():
        for k in ("limit", "hf", "service"):
            x = r[k]
            x["steady"] = x["tokens"] / x["seconds"]
            x["from_start"] = (x["tokens"] + x["start_tokens"]) / (x["seconds"] + x["start_seconds"])
        lim = r["limit"]
        for k in ("limit", "hf", "service"):
            x = r[k]
            print(f"{kind:<10}{names[k]:<26}{x['tokens']:>11,}{x['steady']:>14,.0f}"
                  f"{x['steady'] / lim['steady']:>9.3f}{x['from_start']:>12,.0f}"
                  f"{x['from_start'] / lim['from_start']:>9.3f}{x['start_seconds']:>9.1f}")
    for kind, r in results.items():
        lim, hf, sv = r["limit"], r["hf"], r["service"]
        print(f"{kind}: msd_dask / HF {sv['steady'] / hf['steady']:.2f} steady, "
              f"{sv['from_start'] / hf['from_start']:.2f} from start; "
              f"msd_dask / limit {sv['steady'] / lim['steady']:.3f} steady, "
              f"{sv['from_start'] / lim['from_start']:.3f} from start; msd_dask loaders tokenized "
              f"{sv['read'] / max(1, sv['tokens']):.2f}x the tokens delivered in the steady window; "
              f"mean imbalance {sv['imbalance']:.3f}")
    print(f"scheduler, per delivered batch of msd_dask (cluster idle before any service "
          f"{background:,.0f} B/s; svc idle = service up, nobody reading):")
    print(f"{'tokenizer':<10}{'batches':>9}{'seconds':>9}{'sched B/batch':>15}{'net of idle':>13}"
          f"{'svc idle B/s':>14}{'net of svc idle':>17}{'msgs/batch':>12}{'tensor B/batch':>16}")
    for kind, r in results.items():
        s = r["service"]
        print(f"{kind:<10}{s['batches']:>9}{s['seconds']:>9.2f}{s['bytes_per_batch']:>15,.0f}"
              f"{s['bytes_per_batch_net']:>13,.0f}{s['service_idle_rate']:>14,.0f}"
              f"{s['bytes_per_batch_net_service']:>17,.0f}{s['msgs_per_batch']:>12.1f}"
              f"{s['tensor_bytes_per_batch']:>16,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
