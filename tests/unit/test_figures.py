"""The per-source and per-rank figures DataService.stats and the plugin both report."""

from __future__ import annotations

import pytest

from msd_dask.core.figures import rank_figures, source_figures


def loader(**kw: float) -> dict:
    base = {"tokens_read": 100, "read_seconds": 2.0, "docs_read": 3, "tokens_buffered": 10,
            "units_buffered": 1, "tokens_fetched": 50, "cpu_seconds": 1.0,
            "cpu_wait_seconds": 0.5, "threads": 2}
    return base | kw


def test_sums_over_a_sources_loaders_and_shares_of_planned_tokens() -> None:
    planner = {"tokens_planned": {"a": 300, "b": 100}, "weights": {"a": 0.7, "b": 0.3}}
    got = source_figures(planner, {"a": [loader(), loader(tokens_read=300, quarantined=["f:3"],
                                                       quarantined_docs=1)],
                                   "b": [loader(cpu_seconds=0.0)]},
                         {"a": ["bad.parquet: unreadable"]})
    a, b = got["a"], got["b"]
    assert a["loaders"] == 2 and a["tokens_read"] == 400 and a["read_seconds"] == 4.0
    assert a["seconds_per_token"] == pytest.approx(0.01)
    assert a["share"] == 0.75 and b["share"] == 0.25 and a["weight"] == 0.7
    assert a["quarantined_files"] == 1 and a["quarantined_docs"] == 1
    assert a["quarantined"] == ["bad.parquet: unreadable", "f:3"]
    assert a["cpu_seconds"] == 2.0 and b["cpu_seconds"] == 0.0  # b's loader does not measure it
    assert a["threads"] == 2 and a["tokens_fetched"] == 100


def test_ranks_from_every_constructor() -> None:
    cons = [{"queue_depth": {"0": 2, "2": 1}, "last_claimed": {"0": 7}},
            {"queue_depth": {1: 0}, "last_claimed": {1: 9}}]
    assert rank_figures(cons) == {0: {"queue_depth": 2, "last_claimed": 7},
                                  2: {"queue_depth": 1, "last_claimed": None},
                                  1: {"queue_depth": 0, "last_claimed": 9}}
