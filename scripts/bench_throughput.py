"""Delivered tokens/s of the service against the single-process limit, side by side in one run.

The limit is one Python process doing the whole job with nothing in between:
read every source's units, tokenize, pack rows of ``seq_len`` (sequential
first fit), for the same number of tokens.  The service runs on an embedded
LocalCluster over the same cores, and all its ranks are consumed from this
process.  Reported: both rates and their ratio (absolute times on a shared
machine are noise; the ratio is the figure).

    python scripts/bench_throughput.py configs/demo.yaml --steps 100
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def single_process(cfg, tokens_goal: int) -> tuple[int, float]:
    """Read, tokenize and pack until ``tokens_goal`` tokens; returns (tokens, seconds)."""
    from msd_dask.formats import get_format
    from msd_dask.loader import read_unit
    from msd_dask.packing import pack_rows
    from msd_dask.storage import open_source
    from msd_dask.tokenizer import PAD, make_tokenizer

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
                            pack_rows(rows, seq_len, PAD)
                            rows = []
                    row.append((piece, n))
                    used += n
                    done += n
        i += 1
    return done, time.perf_counter() - t0


def service(cfg, steps: int, workers: int) -> tuple[int, float, dict]:
    from msd_dask import DataService

    with DataService.start(cfg, n_workers=workers, threads_per_worker=1) as svc:
        readers = [svc.reader(r) for r in range(cfg.parallel.world_size)]
        for rd in readers:  # warm-up: first step includes start-up reads
            next(rd)
        t0 = time.perf_counter()
        tokens = 0
        counts = [all(v == 0 for k, v in cfg.parallel.coords(rd.rank).items() if k != "dp")
                  for rd in readers]  # one member per DP group counts its tokens
        for _ in range(steps):
            for rd, count in zip(readers, counts, strict=True):
                b = next(rd)
                tokens += b.num_tokens if count else 0
        elapsed = time.perf_counter() - t0
        stats = svc.stats()
    return tokens, elapsed, stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--quick", action="store_true", help="30 steps")
    args = p.parse_args(argv)
    from msd_dask import load_config

    cfg = load_config(args.config)
    steps = 30 if args.quick else args.steps
    tokens, secs, stats = service(cfg, steps, args.workers)
    base_tokens, base_secs = single_process(cfg, tokens)
    svc_rate, base_rate = tokens / secs, base_tokens / base_secs
    print(f"config {args.config}: {steps} steps x {cfg.parallel.world_size} ranks, "
          f"{args.workers} workers, {os.cpu_count()} cores")
    print(f"{'pipeline':<34}{'tokens':>12}{'tokens/s':>14}")
    print(f"{'single process (limit)':<34}{base_tokens:>12,}{base_rate:>14,.0f}")
    print(f"{'msd_dask (all ranks consumed)':<34}{tokens:>12,}{svc_rate:>14,.0f}")
    print(f"ratio msd_dask / limit: {svc_rate / base_rate:.2f}")
    print(f"mean imbalance: {stats['planner']['mean_imbalance']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
