"""The adaptive policy's CPU measurements when a source's loaders change (found by a review,
each by running it): a window right after a loader was added measures no CPU, and must not
be read as a CPU-bound source, nor as one that needs no core."""

from __future__ import annotations

import math
from dataclasses import replace

from msd_dask.core.config import ScalingConfig
from msd_dask.core.figures import source_figures
from msd_dask.core.scaling import (
    Scaler,
    ScalingPolicy,
    SourceLoad,
    demand,
    proactive_target,
)
from msd_dask.plugin.scheduler import _cpu_fraction


def _loader(read_s: float, cpu_s: float, tokens: int) -> dict[str, float]:
    return dict(tokens_read=tokens, read_seconds=read_s, cpu_seconds=cpu_s,
                cpu_wait_seconds=0.0, docs_read=1, tokens_buffered=0, units_buffered=0,
                tokens_fetched=0, threads=8)


PLANNER = {"tokens_planned": {"s3": 1}, "weights": {"s3": 1.0}}


def test_a_window_after_a_loader_was_added_is_no_cpu_measurement() -> None:
    """Two loaders read for an hour at 10% CPU; two more were just added and had measured
    nothing at the last poll (the source's ``cpu_seconds`` read 0).  The window took the old
    loaders' whole history as its own: a fraction of 22, kept by the scaler as 1, which
    capped this I/O-bound source at one loader for good."""
    def old(extra: float) -> list[dict[str, float]]:
        return [_loader(3600 + extra, 360 + extra / 10, 10**9)] * 2

    before = source_figures(PLANNER, {"s3": old(0) + [_loader(0, 0, 0)] * 2})["s3"]
    now = source_figures(PLANNER, {"s3": old(8) + [_loader(8, 0.8, 10**6)] * 2})["s3"]
    assert before["cpu_seconds"] == 0.0 and now["cpu_seconds"] > 0  # (as the poll sees them)
    assert _cpu_fraction(now, before) == 0.0  # unknown, not 22
    after = source_figures(PLANNER, {"s3": old(16) + [_loader(16, 1.6, 2 * 10**6)] * 2})["s3"]
    assert math.isclose(_cpu_fraction(after, now), 0.1)  # the next window measures it


def _load(loaders: int, cpu_per_token: float) -> SourceLoad:
    return SourceLoad(loaders=loaders, weight_ahead=0.5, consumption=1.2e6,
                      seconds_per_token=1e-5, threads=1, cpu_per_token=cpu_per_token,
                      cpu_fraction=1.0, cores=8.0)


def test_a_window_with_no_cpu_per_token_keeps_the_sources_last_one() -> None:
    """Two CPU-bound sources on 8 cores, 4 loaders each.  The window after ``a`` gained a
    loader measured no CPU per token for it: ``a`` read as needing no core, ``b``'s cap
    jumped to every core and ``b`` grew 4 -> 8 loaders, cut back at the next window."""
    scaler = Scaler(ScalingPolicy(ScalingConfig()))
    n = {"a": 4, "b": 4}
    seen = []
    for t in range(200):
        loads = {s: _load(n[s], 0.0 if s == "a" and t == 60 else 1e-5) for s in n}
        n.update(scaler.decide(float(t), loads))
        seen.append((scaler.cpu_caps.get("a"), scaler.cpu_caps.get("b"), n["b"]))
    assert {s for s in seen[5:]} == {(4, 4, 4)}, sorted(set(seen))


def test_loads_that_are_not_measurements_ask_for_no_loader() -> None:
    """NaN or infinite figures raised in the rules' rounding (and stopped the service's
    adaptive policy at every poll); a pool of 0 threads divided by zero."""
    for consumption in (math.nan, math.inf):
        load = SourceLoad(loaders=2, weight_ahead=1.0, consumption=consumption,
                          seconds_per_token=1e-5)
        assert demand(load) == 0.0 and proactive_target(load, 1.2) == 0
    for spt in (math.nan, math.inf):
        assert proactive_target(SourceLoad(loaders=2, weight_ahead=1.0, consumption=1e6,
                                           seconds_per_token=spt), 1.2) == 0
    one = SourceLoad(loaders=2, weight_ahead=1.0, consumption=1e6, seconds_per_token=1e-5)
    assert proactive_target(replace(one, threads=0), 1.0) == proactive_target(one, 1.0) >= 10
