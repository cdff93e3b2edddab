"""Fixed vs adaptive loaders when one source is 20x costlier per token, side by side in one run.

Two sources of the demo corpus with equal weights; the costly one's preprocessing waits
on a slow store (``--mode io``, `msd_dask.examples.preprocess:store_20x`) or burns CPU
(``--mode cpu``, `cpu_heavy`).  A consumer emulates training: every step it takes all
ranks' batches, then "computes" for ``--step-seconds``.  Reported per allocation:
delivered tokens/s, the fraction of time the consumer waited for data after the
policy converged, and the loaders per source over time (plotted to ``--plot``).

    python scripts/bench_scaling.py --plot docs/scaling.png
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def make_config(data: str, policy: str, mode: str, seconds_per_step: float) -> dict:
    costly = ("msd_dask.examples.preprocess:store_20x" if mode == "io"
              else "msd_dask.examples.preprocess:cpu_heavy")
    cheap = "msd_dask.examples.preprocess:store_1x" if mode == "io" else None
    src = [
        {"name": "code", "uri": f"{data}/code/*.parquet", "format": "parquet", "weight": 0.5,
         "loaders": 1, "preprocess": cheap},
        {"name": "costly", "uri": f"{data}/prose/*.jsonl.zst", "format": "jsonl",
         "weight": 0.5, "loaders": 1, "preprocess": costly},
    ]
    for s in src:
        if s["preprocess"] is None:
            del s["preprocess"]
    return {
        "name": f"scaling-{policy}", "seed": 1, "parallel": {"dp": 2},
        "batch": {"seq_len": 4096, "micro_batches": 1}, "prefetch": 4, "timeout": 120,
        "scaling": {"policy": policy, "max_loaders": 8, "cooldown": 2.0,
                    "scale_down_after": 30.0, "lookahead": 50},
        "sources": src,
    }


def run(cfg: dict, seconds: float, step_seconds: float, workers: int) -> dict:
    from msd_dask import DataService

    with DataService.start(cfg, n_workers=workers, threads_per_worker=1,
                           loader_threads=1) as svc:
        readers = [svc.reader(r) for r in range(2)]
        t_start = time.perf_counter()
        timeline = []
        waited = tokens = 0.0
        conv_wait = conv_time = conv_tokens = 0.0
        next_poll = 0.0
        while (now := time.perf_counter() - t_start) < seconds:
            t0 = time.perf_counter()
            batches = [next(rd) for rd in readers]
            w = time.perf_counter() - t0
            n = sum(b.num_tokens for b in batches)
            time.sleep(step_seconds)  # the training step
            waited += w
            tokens += n
            if now > seconds / 2:  # after the policy had time to converge
                conv_wait += w
                conv_time += w + step_seconds
                conv_tokens += n
            if now >= next_poll:
                timeline.append((now, dict(svc.stats()["planner"]["loaders"])))
                next_poll = now + 1.0
        elapsed = time.perf_counter() - t_start
    return {"tokens_per_s": tokens / elapsed, "wait": waited / elapsed,
            "converged_tokens_per_s": conv_tokens / conv_time if conv_time else 0.0,
            "converged_wait": conv_wait / conv_time if conv_time else 0.0,
            "timeline": timeline}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/scaling",
                   help="demo corpus with 64 prose shards (written if missing): a source "
                        "needs many units for several loaders to share it")
    p.add_argument("--mode", choices=["io", "cpu"], default="io")
    p.add_argument("--seconds", type=float, default=60.0, help="per allocation")
    p.add_argument("--step-seconds", type=float, default=0.04, help="emulated compute/step")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    p.add_argument("--plot", help="write the loaders-over-time plot here (PNG)")
    p.add_argument("--quick", action="store_true", help="25 s per allocation")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(args.data, "code")):
        from msd_dask.demo import write_demo_corpus

        write_demo_corpus(args.data, prose_shards=64, code_shards=16, row_group_size=16)
    seconds = 25.0 if args.quick else args.seconds
    res = {}
    for policy in ("fixed", "adaptive"):
        cfg = make_config(args.data, policy, args.mode, args.step_seconds)
        res[policy] = run(cfg, seconds, args.step_seconds, args.workers)
    print(f"mode {args.mode}: costly source 20x per token, equal weights, {seconds:.0f}s per "
          f"allocation, {args.step_seconds * 1000:.0f} ms compute per step, "
          f"{args.workers} workers on {os.cpu_count()} cores")
    print(f"{'allocation':<12}{'tokens/s':>12}{'wait':>8}{'tokens/s conv.':>16}"
          f"{'wait conv.':>12}{'final loaders':>24}")
    for k, r in res.items():
        final = r["timeline"][-1][1] if r["timeline"] else {}
        print(f"{k:<12}{r['tokens_per_s']:>12,.0f}{r['wait']:>8.1%}"
              f"{r['converged_tokens_per_s']:>16,.0f}{r['converged_wait']:>12.1%}"
              f"{str(final):>24}")
    ratio = res["adaptive"]["tokens_per_s"] / max(res["fixed"]["tokens_per_s"], 1e-9)
    conv = (res["adaptive"]["converged_tokens_per_s"]
            / max(res["fixed"]["converged_tokens_per_s"], 1e-9))
    print(f"adaptive / fixed tokens/s: {ratio:.2f} over the run, {conv:.2f} after convergence")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for policy, style in (("adaptive", "-"), ("fixed", ":")):
            tl = res[policy]["timeline"]
            for src in ("code", "costly"):
                ax.step([t for t, _ in tl], [d[src] for _, d in tl], style, where="post",
                        label=f"{policy}: {src}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("loaders")
        ax.set_title(f"loaders per source ({args.mode}-bound costly source, 20x per token)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
