"""``scripts/bench_balance.py``: the planner's time per step is its own, not its lookup's."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "scripts")
sys.path.insert(0, SCRIPTS)

import bench_balance  # noqa: E402


class _SlowUnits(bench_balance.LognormalUnits):
    """Lengths as the bench's, each unit's taking ``delay`` seconds to make."""

    def __init__(self, delay: float):
        super().__init__(64)
        self.delay, self.calls = delay, 0

    def __call__(self, source: str, epoch: int, unit: int) -> np.ndarray:
        self.calls += 1
        time.sleep(self.delay)
        return super().__call__(source, epoch, unit)


def test_the_plans_seconds_leave_out_the_lookups() -> None:
    """In the service the loaders make a unit's lengths and the planner's lookup is a dict's:
    a step whose lookups take seconds still plans in a fraction of that."""
    cfg = bench_balance.default_config(4, 2, 512)
    pl = bench_balance.planner_for(cfg, 64)
    look = _SlowUnits(0.2)
    relpath = {s.name: [f"u{i:06d}.parquet" for i in range(64)] for s in cfg.sources}
    t0 = time.perf_counter()
    (plan_s, split_s, pack_s), n, work, _state = bench_balance.planning_step(pl, look, 2, relpath)
    wall = time.perf_counter() - t0
    assert look.calls >= 2 and n > 0 and len(work) == 2
    assert wall >= 0.2 * look.calls
    assert 0 <= plan_s < 0.1 * look.calls, (plan_s, look.calls)


def test_write_replaces_a_tables_figure_line_and_keeps_the_prose_after_it(tmp_path) -> None:
    """``--write``: the figure under a table (``interpreted / compiled: x``) is this run's,
    the text people wrote after it stays, and so does every other section."""
    path = tmp_path / "b.md"
    path.write_text("# B\n\n## Balance\n\nCommand: `old`\n\n**the small step (500 steps)**\n\n"
                    "| a |\n|---|\n| 1 |\n\ninterpreted / compiled: 1.49.  Against the "
                    "version before, 0.9.\n\n## Next\n\ninterpreted / compiled: 7.0\n")
    bench_balance.write_section(str(path), "Command: `new`\n\n**the small step (20 steps)**"
                                "\n\n| a |\n|---|\n| 2 |\n\ninterpreted / compiled: 1.62")
    assert path.read_text() == (
        "# B\n\n## Balance\n\nCommand: `new`\n\n**the small step (500 steps)**\n\n"
        "| a |\n|---|\n| 2 |\n\ninterpreted / compiled: 1.62.  Against the "
        "version before, 0.9.\n\n## Next\n\ninterpreted / compiled: 7.0\n")
