"""``scripts/bench_balance.py``: the planner's peak memory is its own process's."""

from __future__ import annotations

import multiprocessing
import os
import sys

import numpy as np

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "scripts")
sys.path.insert(0, SCRIPTS)

import bench_balance  # noqa: E402


def test_a_spawned_childs_peak_is_not_its_parents() -> None:
    """The end-to-end rows run in a spawned child of a parent that may hold hundreds of MiB;
    Linux carries ``ru_maxrss`` over the child's exec, so it reported the parent's size."""
    held = np.ones(300 * 2**20 // 8)  # 300 MiB resident in this process
    _now, parent_peak = bench_balance.rss_mib()
    assert parent_peak >= 300
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        now, peak = pool.apply(bench_balance.rss_mib)
    assert peak < 200 and now <= peak, (now, peak)
    del held
