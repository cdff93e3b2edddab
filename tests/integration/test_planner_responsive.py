"""The planner answers while it plans a large step (issue "The planner at 16,384 ranks").

A step is planned in a thread of the planner's worker, not on its event loop
(:class:`~msd_dask.roles.planner.PlannerActor`), so the worker answers every other
call meanwhile.  Here a step holds about 260,000 short documents (about a second to
plan on 2 cores); while the planner plans its first steps, ``stats()`` is called
again and again through the service's planner handle, each call timed from the
call to its answer in this process.  Planned on the event loop, no call is
answered while a step is planned (each waits for the whole step).
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from msd_dask import DataService

from checks import wait_until
from corpus import config

#: the issue's bound: the planner answers a call within 50 ms while it plans
BOUND = 0.050


def _short_docs(root: str, files: int = 6, rows: int = 100_000) -> None:
    """``files`` parquet files of ``rows`` documents of 3 to 13 bytes each."""
    rng = np.random.default_rng(0)
    os.makedirs(f"{root}/short", exist_ok=True)
    words = np.array(["a", "bb", "ccc", "dddd", "eeeee", "ffffff"])
    for f in range(files):
        a = words[rng.integers(0, len(words), size=rows)]
        b = words[rng.integers(0, len(words), size=rows)]
        text = np.char.add(np.char.add(a, " "), b)
        pq.write_table(pa.table({"text": text.tolist()}), f"{root}/short/part-{f}.parquet",
                       row_group_size=rows)


def _config(root: str, dp: int, micro_batches: int, seq_len: int) -> dict:
    # dp x micro_batches x seq_len = 2.1M or 8.4M tokens a step: 260,000 or a million
    # documents of ~8 tokens (at 520,000, 0.28 s since the draw's passes were compiled: too
    # quick to show a planner busy for a while).
    # One constructor and one loader, each on a worker of its own (3 workers): the planner's
    # worker hosts no other role, so what is timed is the planner's answer
    return config(root, name="responsive", parallel={"dp": dp},
                  batch={"seq_len": seq_len, "micro_batches": micro_batches}, constructors=1,
                  sources=[{"name": "short", "uri": f"{root}/short/*.parquet",
                            "format": "parquet", "weight": 1.0, "shuffle_window": 2}])


# (placed as 2 blocks of 2,048 ranks, on threads of their own; a step of one block, dp 16 x
# 16 micro-batches x 8192, planned the same way and answered as quickly: left out for the
# suite's time)
@pytest.mark.parametrize("dp, micro_batches, seq_len", [(4096, 1, 2048)])
def test_the_planner_answers_stats_within_50ms_while_it_plans_a_large_step(
        tmp_path, dp, micro_batches, seq_len):
    root = str(tmp_path)
    _short_docs(root)
    cfg = _config(root, dp, micro_batches, seq_len)
    with DataService.start(cfg, n_workers=3, threads_per_worker=1) as svc:
        planner = svc.link.planner
        during: list[float] = []   # seconds from call to answer, of calls answered mid-step
        plan_seconds = 0.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            st = planner.stats().result(timeout=30)
            dt = time.perf_counter() - t0
            if st["planning"]:
                during.append(dt)
            plan_seconds = max(plan_seconds, st["plan_seconds"])
            # (a step planned whole, not only tries cut short for lengths not known yet)
            if st["steps_planned"] >= 1 and plan_seconds >= 0.3 and len(during) >= 20:
                break
            time.sleep(0.005)
        # the step after (planned, or split for the constructor): closing meanwhile
        # does not wait for it (the thread finishes it, its result is dropped)
        planning = wait_until(lambda: planner.stats().result(timeout=30)["planning"], 20, 0.02)
        t0 = time.monotonic()
    closed = time.monotonic() - t0
    ms = sorted(round(d * 1e3, 1) for d in during) or [float("nan")]
    print(f"\nplan_seconds {plan_seconds:.2f}; {len(ms)} stats calls answered while planning: "
          f"median {statistics.median(ms):.1f} ms, p90 {ms[len(ms) * 9 // 10]} ms, max {ms[-1]} ms, "
          f"{sum(m >= BOUND * 1e3 for m in ms)} at or over {BOUND * 1e3:.0f} ms; closed in "
          f"{closed:.1f} s ({'while' if planning else 'not'} planning)")
    assert plan_seconds >= 0.3, f"a step is too quick to show anything: {plan_seconds:.2f} s"
    # answered while it planned, and quickly: the median within the bound (on a loaded
    # 2-core machine single calls may wait for a CPU), and every one far below a step
    assert len(during) >= 10, ms
    assert statistics.median(during) < BOUND, ms
    assert max(during) < plan_seconds / 2, (ms, plan_seconds)
    assert closed < 15, closed
