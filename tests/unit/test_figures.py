"""The per-source and per-rank figures DataService.stats and the plugin both report."""

from __future__ import annotations

import pytest

from msd_dask.core.figures import SLOWEST, rank_columns, rank_figures, rank_summary, source_figures


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


def test_a_loader_that_did_not_answer_counts_by_its_last_answer() -> None:
    from msd_dask.roles.loader import unanswered_stats

    planner = {"tokens_planned": {"a": 300}, "weights": {"a": 1.0}}
    last = loader(tokens_read=250)
    lost = unanswered_stats("a", 1, last, "did not answer")
    never = unanswered_stats("a", 2, None, "did not answer")  # lost before its first answer
    got = source_figures(planner, {"a": [loader(), lost, never]})["a"]
    assert got["loaders"] == 3 and got["loaders_unanswered"] == 2
    assert got["tokens_read"] == 350 and got["tokens_buffered"] == 20  # no counter goes back
    assert lost["error"] == "did not answer" and lost["index"] == 1
    assert source_figures(planner, {"a": [loader()]})["a"]["loaders_unanswered"] == 0


def test_ranks_from_every_constructor() -> None:
    cons = [{"queue_depth": {"0": 2, "2": 1}, "last_claimed": {"0": 7}},
            {"queue_depth": {1: 0}, "last_claimed": {1: 9}}]
    assert rank_figures(cons) == {0: {"queue_depth": 2, "last_claimed": 7},
                                  2: {"queue_depth": 1, "last_claimed": None},
                                  1: {"queue_depth": 0, "last_claimed": 9}}
    # a constructor that did not answer has no ranks' figures
    from msd_dask.roles.constructor import unanswered_stats

    assert rank_figures([cons[0], unanswered_stats(1, "did not answer")]) == {
        0: {"queue_depth": 2, "last_claimed": 7}, 2: {"queue_depth": 1, "last_claimed": None}}


def _summary(depth: dict, claimed: dict, slowest: int = SLOWEST) -> dict:
    """:func:`rank_summary` of one constructor's ranks (its stats' two dicts)."""
    return rank_summary(*rank_columns([{"queue_depth": depth, "last_claimed": claimed}]), slowest)


def test_rank_summary_small() -> None:
    s = _summary({0: 2, 1: 0, 2: 1, 3: 3}, {0: 7, 1: 9, 3: 7})
    assert s["ranks"] == 4 and s["waiting"] == 1
    assert s["queue_depth"] == {"min": 0, "p50": 1, "p90": 3, "max": 3}
    assert s["last_claimed"] == {"min": 7, "p50": 7, "p90": 9, "max": 9}
    assert s["lag"] == 10    # rank 2 has claimed nothing: step -1
    # least advanced first; ties: the deeper queue, then the lower rank
    assert [v["rank"] for v in s["slowest"]] == [2, 3, 0, 1]
    assert s["slowest"][0] == {"rank": 2, "last_claimed": None, "queue_depth": 1}
    assert _summary({}, {})["ranks"] == 0 and rank_summary(*rank_columns([]))["slowest"] == []


def test_rank_quantiles_are_what_their_names_say() -> None:
    """``p50`` and ``p90`` are values some rank has with at least half and at least 90% of
    the ranks at or below them, and the least such (nearest rank): the p90 of 2 ranks was
    the smaller, 50% of the ranks at or below it (a review)."""
    import numpy as np

    assert _summary({0: 0, 1: 5}, {})["queue_depth"] == {"min": 0, "p50": 0, "p90": 5, "max": 5}
    rng = np.random.default_rng(3)
    for n in [*range(1, 40), 101, 1000, 4097]:
        depth = rng.integers(0, rng.integers(1, 20), n)
        q = _summary(dict(enumerate(depth.tolist())), {})["queue_depth"]
        for name, share in (("p50", 0.5), ("p90", 0.9)):
            v = q[name]
            assert v in depth and (depth <= v).mean() >= share, (n, name)
            below = depth[depth < v]  # the next lower value has too few ranks at or below
            assert not len(below) or (depth <= below.max()).mean() < share, (n, name)


def test_rank_summary_stays_small_at_16k_ranks() -> None:
    """16,384 ranks: the same few numbers, the slowest named, nothing per rank."""
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    claimed = rng.integers(100, 104, 16384)
    claimed[[5, 9000]] = [40, 41]
    s = _summary({r: int(rng.integers(0, 5)) for r in range(16384)},
                 {r: int(c) for r, c in enumerate(claimed)})
    assert len(json.dumps(s)) < 2000
    assert len(s["slowest"]) == SLOWEST
    assert [v["rank"] for v in s["slowest"][:2]] == [5, 9000]
    assert s["lag"] == 103 - 40 and s["last_claimed"]["p50"] in range(100, 104)


def test_rank_columns_say_what_the_dict_of_ranks_says() -> None:
    """The arrays the planner summarises from (no dict per rank) hold what
    :func:`rank_figures` says of each rank: keys as the constructors send them (ints, or
    strings through JSON), ranks that have claimed nothing, a constructor that did not
    answer; the summary does not depend on the ranks' order."""
    import numpy as np

    from msd_dask.roles.constructor import unanswered_stats

    rng = np.random.default_rng(1)
    cons: list[dict] = []
    for c in range(8):
        rs = rng.permutation(np.arange(c, 512, 8)).tolist()
        key = str if c % 2 else int
        cons.append({"queue_depth": {key(r): int(rng.integers(0, 4)) for r in rs},
                     "last_claimed": {key(r): int(rng.integers(20, 25)) for r in rs
                                      if rng.random() < 0.9}})
    cons.append(unanswered_stats(8, "did not answer"))
    rank, depth, claimed = rank_columns(cons)
    want = {r: (v["queue_depth"], -1 if v["last_claimed"] is None else v["last_claimed"])
            for r, v in rank_figures(cons).items()}
    assert dict(zip(rank.tolist(), zip(depth.tolist(), claimed.tolist(), strict=True),
                    strict=True)) == want and len(rank) == len(want) == 512
    order = rng.permutation(len(rank))
    for slowest in (3, 8, 600):
        assert rank_summary(rank, depth, claimed, slowest) == \
            rank_summary(rank[order], depth[order], claimed[order], slowest)
