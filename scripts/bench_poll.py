"""What the scheduler plugin's poll of one service costs the scheduler and the planner, by
number of ranks.

Every second the plugin (on the scheduler) asks the service's planner for a snapshot;
the planner asks its constructors for their ``stats()``, whose per-rank figures (six
dicts of a value per rank) it summarises (:func:`msd_dask.core.figures.rank_columns`,
:func:`~msd_dask.core.figures.rank_summary`) before it answers.  This script builds
constructors' stats of the shape ``DataConstructor.stats()`` gives for ``--ranks`` ranks
over ``--constructors`` constructors and times, median of ``--repeat``:

* at the planner: summarising the ranks;
* at the scheduler: Dask's decoding of the answer (``distributed.protocol``'s
  ``dumps``/``loads``, as the message travels), and its size;
* for comparison, the same for an answer carrying every constructor's stats as they
  are (what reached the scheduler before the planner summarised them).

    python scripts/bench_poll.py --ranks 1024,16384
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def constructor_stats(ranks: int, constructors: int) -> list[dict[str, Any]]:
    """Stats of ``constructors`` constructors sharing ``ranks`` ranks round robin, with the
    per-rank fields of ``DataConstructor.stats()`` (a few steps apart, a few queued)."""
    out = []
    for c in range(constructors):
        mine = range(c, ranks, constructors)
        claimed = {r: 1000 + r % 5 for r in mine}
        out.append({"index": c, "held_steps": 4, "queue_depth": {r: r % 3 for r in mine},
                    "last_claimed": claimed, "shown": dict(claimed), "returned": dict(claimed),
                    "returned_by": {r: f"tcp://10.0.{r // 256}.{r % 256}:40000" for r in mine},
                    "report_after": dict(claimed), "reports": 10, "batches_built": 1000})
    return out


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(ranks: int, constructors: int, repeat: int) -> dict[str, float]:
    """The module's figures for one size."""
    from distributed.protocol import dumps, loads

    from msd_dask.core.figures import rank_columns, rank_summary

    cons = constructor_stats(ranks, constructors)
    summary = rank_summary(*rank_columns(cons))
    summarised = {"op": "reply", "result": {"constructors": len(cons), "rank_summary": summary,
                                            "ranks": {}}}
    whole = {"op": "reply", "result": {"constructors": cons}}

    def received(msg: dict[str, Any]) -> Callable[[], Any]:
        frames = dumps(msg)
        return lambda: loads(frames)

    return {"ranks": ranks, "constructors": constructors,
            "planner_ms": _median_ms(lambda: rank_summary(*rank_columns(cons)), repeat),
            "scheduler_ms": _median_ms(received(summarised), repeat),
            "bytes": float(sum(len(f) for f in dumps(summarised))),
            "whole_scheduler_ms": _median_ms(received(whole), repeat),
            "whole_bytes": float(sum(len(f) for f in dumps(whole)))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1024,16384",
                   help="comma-separated numbers of ranks (default 1024,16384)")
    p.add_argument("--per-constructor", type=int, default=64,
                   help="ranks per constructor (default 64: dp 16,384 x tp 1 on 256 constructors)")
    p.add_argument("--repeat", type=int, default=9, help="timings per figure (median; default 9)")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.ranks.split(",") if x.strip()]
    except ValueError:
        p.error(f"--ranks {args.ranks!r}: expected comma-separated whole numbers")
    if not sizes or min(sizes) < 1 or args.per_constructor < 1 or args.repeat < 1:
        p.error("--ranks, --per-constructor and --repeat must be at least 1")
    print(f"{'ranks':>7} {'constructors':>12} {'planner ms':>10} {'scheduler ms':>12} "
          f"{'bytes':>8} | {'as they are: scheduler ms':>25} {'bytes':>10}")
    for n in sizes:
        r = measure(n, max(1, -(-n // args.per_constructor)), args.repeat)
        print(f"{n:>7,} {int(r['constructors']):>12,} {r['planner_ms']:>10.2f} "
              f"{r['scheduler_ms']:>12.3f} {int(r['bytes']):>8,} | "
              f"{r['whole_scheduler_ms']:>25.2f} {int(r['whole_bytes']):>10,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
