"""Outlier delay (``outliers:``): long pieces held back and released a row's worth at a time."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pytest
from test_plan import SEQ_LEN, WEIGHTS_3, expected_pieces, lookup, make_cfg, plan_key, planner, run

from msd_dask.core.balance import capacity_bound
from msd_dask.core.config import Config, ConfigError, parse_config
from msd_dask.core.plan import Planner, StepPlan, units_of

MIN = 3 * SEQ_LEN // 4   # every piece this long is an outlier; two never share a row
ROWS = 4                 # make_cfg: dp 2 x 2 micro-batches
COST = {"linear": 1.0, "quadratic": 0.02}


def outlier_cfg(balance: str = "balanced", **extra: Any) -> Config:
    return make_cfg(WEIGHTS_3, balance, cost=COST, outliers={"min_length": MIN}, **extra)


def long_per_step(plans: list[StepPlan]) -> list[int]:
    return [sum(q.length >= MIN for q in p.pieces()) for p in plans]


@pytest.fixture(scope="module")
def held_run() -> tuple[list[StepPlan], list[int], Planner]:
    """200 steps with outlier delay, how many pieces were held after each, and the planner."""
    pl = planner(outlier_cfg())
    plans, held = [], []
    for _ in range(200):
        plans.append(pl.plan_step(lookup))
        held.append(len(pl.held))
    return plans, held, pl


def test_every_piece_once_per_epoch_with_outliers_held(
        held_run: tuple[list[StepPlan], list[int], Planner]) -> None:
    """Every piece of an epoch is delivered once, or still waits (held or carried)."""
    plans, held, pl = held_run
    assert max(held) > 0, "no piece was ever held: the test corpus has no outliers"
    delivered = [q for p in plans for q in p.pieces()]
    counts = Counter((q.source, q.epoch, q.unit, q.row, q.chunk) for q in delivered)
    assert max(counts.values()) == 1
    waiting = pl.pending()
    assert not {(q.source, q.epoch, q.unit, q.row, q.chunk) for q in waiting} & set(counts)
    for source in WEIGHTS_3:
        mine = [q for q in delivered if q.source == source]
        for epoch in range(max(q.epoch for q in mine)):
            got = {(q.unit, q.row, q.chunk, q.start, q.end) for q in mine if q.epoch == epoch}
            wait = {(q.unit, q.row, q.chunk, q.start, q.end) for q in waiting
                    if q.source == source and q.epoch == epoch}
            assert not got & wait
            assert got | wait == expected_pieces(source), (source, epoch)


def test_outliers_come_a_row_each(held_run: tuple[list[StepPlan], list[int], Planner]) -> None:
    """A step holds no outlier or one in every row (never one rank alone with one)."""
    plans, _, _ = held_run
    counts = long_per_step(plans)
    assert set(counts) <= {0, ROWS}, Counter(counts)
    assert counts.count(ROWS) >= 10
    for p in plans:
        if long_per_step([p])[0]:
            assert all(sum(q.length >= MIN for q in row) == 1 for rank in p.rows for row in rank)


def test_without_delay_outliers_land_unpaired() -> None:
    """The property above is the delay's doing: without it steps hold 1-3 outliers."""
    counts = long_per_step(run(planner(make_cfg(WEIGHTS_3, "balanced", cost=COST,
                                                outliers={"min_length": 0})), 200))
    assert any(0 < c < ROWS for c in counts)


def step_bounds(plans: list[StepPlan], cost: Planner) -> list[float]:
    out = []
    for p in plans:
        lengths = np.array([q.length for q in p.pieces()])
        costs = cost.cost(lengths)
        out.append(capacity_bound(lengths, costs, 2, 2, SEQ_LEN) / (costs.sum() / 2))
    return out


def test_delay_lets_steps_balance_better() -> None:
    """What the pieces of a step allow (capacity bound) and what the planner reaches both improve."""
    off = planner(make_cfg(WEIGHTS_3, "balanced", cost=COST, outliers={"min_length": 0}))
    on = planner(outlier_cfg())
    a, b = run(off, 200), run(on, 200)
    imb_off, imb_on = np.mean([p.imbalance for p in a]), np.mean([p.imbalance for p in b])
    assert np.mean(step_bounds(b, on)) < np.mean(step_bounds(a, off)) - 0.01
    assert imb_on < imb_off - 0.01, (imb_off, imb_on)


def test_no_piece_is_held_longer_than_max_wait() -> None:
    """With a group of every row, held pieces join a step within ``max_wait`` steps."""
    pl = planner(make_cfg(WEIGHTS_3, "balanced", cost=COST,
                          outliers={"min_length": MIN, "group": ROWS, "max_wait": 3}))
    held_ever: set[tuple] = set()
    delivered: set[tuple] = set()
    for _ in range(60):
        plan = pl.plan_step(lookup)
        delivered.update(q.to_tuple() for q in plan.pieces())
        assert all(pl.step - s <= 3 for _, s in pl.held), [(q, s) for q, s in pl.held]
        held_ever.update(q.to_tuple() for q, _ in pl.held)
    assert held_ever
    still = {q.to_tuple() for q in pl.pending()}
    assert held_ever <= delivered | still


@pytest.mark.parametrize("group, max_wait", [(1, 1), (0, 1), (0, 2), (2, 3)])
def test_no_piece_is_held_longer_than_max_wait_when_groups_fill(group: int, max_wait: int) -> None:
    """Where ``group`` or more pieces are held, one group goes per step: the others (drawn
    with it, or passed over for closer lengths) waited 4-8 steps at ``max_wait`` 1-3 (review).
    Once the oldest has waited ``max_wait`` steps, every held piece goes."""
    pl = planner(make_cfg(WEIGHTS_3, "lpt", cost=COST,
                          outliers={"min_length": SEQ_LEN // 3, "group": group,
                                    "max_wait": max_wait}))
    held_ever: set[tuple] = set()
    delivered: list[tuple] = []
    for _ in range(120):
        plan = pl.plan_step(lookup)
        delivered.extend(q.to_tuple() for q in plan.pieces())
        assert all(pl.step - s <= max_wait for _, s in pl.held), [(q, s) for q, s in pl.held]
        held_ever.update(q.to_tuple() for q, _ in pl.held)
    assert len(held_ever) > 20
    assert len(delivered) == len(set(delivered))
    assert held_ever <= set(delivered) | {q.to_tuple() for q in pl.pending()}


def test_spread_with_max_per_rank_holds_no_piece() -> None:
    """``long_context: {mode: spread, max_per_rank: k}``: released outliers came a row each
    at the front of a step, before the long budget, so a rank got ``micro_batches`` long
    pieces (98 of 100 rank-steps over the limit, review).  Such a layout holds nothing, as
    ``grouped`` does: ``auto`` is off, a number is refused."""
    d = make_cfg(WEIGHTS_3, "balanced", cost=COST).to_dict()
    d["sources"][0]["context"] = "long"
    d["long_context"] = {"mode": "spread", "max_per_rank": 1}
    long_source = d["sources"][0]["name"]
    # (a long piece no rank under the limit could take stayed where it was, over the limit:
    # in 28 of 30 seeds at this size within 100 steps, a review; now it waits a step)
    for seed in range(10):
        cfg = parse_config(dict(d, seed=seed))
        assert cfg.outliers.min_length == 0
        pl = planner(cfg)
        plans = run(pl, 100)
        for plan in plans:
            for rank in plan.rows:
                assert sum(q.source == long_source for row in rank for q in row) <= 1, seed
            assert not pl.held
        seen = Counter((q.source, q.epoch, q.unit, q.row, q.chunk)
                       for p in plans for q in p.pieces())
        assert max(seen.values()) == 1
        pending = {(q.source, q.epoch, q.unit, q.row, q.chunk) for q in pl.pending()}
        assert not pending & set(seen)
    d["outliers"] = {"min_length": MIN}
    with pytest.raises(ConfigError, match=r"outliers\.min_length.*max_per_rank"):
        parse_config(d)


@pytest.mark.parametrize("k", [0, 3, 37])
def test_resume_with_pieces_held(k: int) -> None:
    cfg = outlier_cfg()
    uninterrupted = run(planner(cfg), k + 40)
    first = planner(cfg)
    run(first, k)
    state = json.loads(json.dumps(first.state_dict()))
    assert k == 0 or state["held"], "resume from a state that holds pieces"
    second = planner(cfg)
    second.load_state_dict(state)
    assert [plan_key(p) for p in run(second, 40)] == [plan_key(p) for p in uninterrupted[k:]]


def test_a_snapshot_stays_the_state_of_its_step() -> None:
    """The planner's actor keeps a snapshot per recent step, its piece tables by reference:
    planning on must not change one, and a planner loading it (the re-created planner, from
    the packed checkpoint) plans the uninterrupted run's steps."""
    import pickle

    cfg = outlier_cfg()
    first = planner(cfg)
    k = 0
    while not (len(first.held) and len(first.carry)) and k < 200:
        run(first, 1)
        k += 1
    assert first.held and first.carry, "a snapshot that holds and carries pieces"
    uninterrupted = run(planner(cfg), k + 40)
    assert first.pending_units() == {(q.source, q.epoch, q.unit) for q in first.pending()}
    snap = first.snapshot()
    state = json.loads(json.dumps(first.state_dict()))
    run(first, 5)  # the planner goes on; the snapshot is still the state after step k - 1
    assert json.loads(json.dumps(snap.to_state())) == state
    second = planner(cfg)
    second.load_snapshot(pickle.loads(pickle.dumps(snap, protocol=5)))
    assert json.loads(json.dumps(second.state_dict())) == state
    assert [plan_key(p) for p in run(second, 40)] == [plan_key(p) for p in uninterrupted[k:]]


def test_units_of_pending_and_planned_pieces(held_run: tuple[list[StepPlan], list[int], Planner]
                                             ) -> None:
    """The units the actor keeps (pending_units) and a step's units (StepPlan.units), made
    from the tables by one key per piece, are those of the pieces themselves."""
    plans, _, pl = held_run
    assert pl.held
    assert pl.pending_units() == {(q.source, q.epoch, q.unit) for q in pl.pending()}
    for p in plans[::20]:
        assert p.units() == {(q.source, q.epoch, q.unit) for q in p.pieces()}
    assert units_of(np.zeros((0, 8), dtype=np.int64), ["a"]) == set()


def test_a_snapshot_of_other_sources_is_refused() -> None:
    snap = planner(outlier_cfg()).snapshot()
    other = planner(make_cfg({"code": 1.0}, "balanced"))
    with pytest.raises(ValueError, match=r"a planner state of sources \[.*\] does not fit"):
        other.load_snapshot(snap)


def test_elastic_resume_same_pieces_per_step_with_delay() -> None:
    cfg = outlier_cfg()
    ref = run(planner(cfg), 60)
    first = planner(cfg)
    run(first, 11)
    state = json.loads(json.dumps(first.state_dict()))
    other = outlier_cfg(parallel={"dp": 4}, batch={"seq_len": SEQ_LEN, "micro_batches": 1})
    resumed = planner(other)
    resumed.load_state_dict(state)
    for a, b in zip(ref[11:], run(resumed, 49), strict=True):
        assert Counter(q.to_tuple() for q in a.pieces()) == Counter(q.to_tuple() for q in b.pieces())


def test_pending_names_held_pieces_for_the_loaders() -> None:
    """The planner keeps the units of ``pending()`` pieces: held ones must be in it."""
    pl = planner(outlier_cfg())
    run(pl, 3)
    assert pl.held
    assert all(q in pl.pending() for q, _ in pl.held)


@pytest.mark.parametrize("outliers, key", [
    ({"min_length": SEQ_LEN + 1}, "outliers.min_length"),
    ({"min_length": -1}, "outliers.min_length"),
    ({"max_wait": 0}, "outliers.max_wait"),
    ({"minimum": 3}, "outliers.minimum"),
    ({"min_length": 1.5}, "outliers.min_length"),
    ({"min_length": -0.5}, "outliers.min_length"),
    ({"min_length": "half"}, "outliers.min_length"),
])
def test_config_errors_name_the_key(outliers: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        make_cfg(WEIGHTS_3, outliers=outliers)


def test_a_group_over_the_steps_rows_is_refused() -> None:
    """Released a row each, the pieces of a group over the step's rows were carried, behind
    the next group released, step after step (a review)."""
    with pytest.raises(ConfigError, match=rf"outliers\.group.*at most the step's rows, "
                                          rf"parallel\.dp × batch\.micro_batches = {ROWS} "
                                          r"\(0: that many\), got 7"):
        make_cfg(WEIGHTS_3, outliers={"min_length": MIN, "group": 7})


@pytest.mark.parametrize("balance", ["sequential", "lpt", "balanced"])
@pytest.mark.parametrize("max_wait", [1, 2, 4])
def test_a_held_piece_reaches_training_within_max_wait(balance: str, max_wait: int) -> None:
    """Every piece held that had waited ``max_wait`` steps was released with the group, more
    than the step has rows; those left over were carried, behind the next group released
    before them, and reached training 5-9 steps after they were held at ``max_wait`` 1-4;
    with ``sequential`` the pieces carried from the last step waited up to 13 steps behind
    releases that filled every row (a review).  A release takes a row each, the oldest first,
    and those due soon enough that none waits past ``max_wait``: none is held longer, and a
    held piece reaches training within ``max_wait`` steps (one more with ``sequential``,
    which places the carried pieces first); a carried piece, the next step."""
    pl = planner(make_cfg(WEIGHTS_3, balance, cost=COST,
                          outliers={"min_length": SEQ_LEN // 3, "max_wait": max_wait}))
    held_at: dict[tuple, int] = {}
    carried_at: dict[tuple, int] = {}
    late_held, late_carried, held_ever = 0, 0, 0
    for _ in range(240):
        plan = pl.plan_step(lookup)
        for q in plan.pieces():
            key = q.to_tuple()
            if key in held_at:
                late_held = max(late_held, plan.step - held_at.pop(key))
            if key in carried_at:
                late_carried = max(late_carried, plan.step - carried_at.pop(key))
        for q, since in pl.held:
            held_at.setdefault(q.to_tuple(), since)
            assert pl.step - since <= max_wait
        held_ever = max(held_ever, len(held_at))
        for q in pl.carry:
            if q.to_tuple() not in held_at:
                carried_at.setdefault(q.to_tuple(), pl.step)
    assert held_ever >= ROWS  # (as many held as a step has rows, at least: the case)
    assert late_held <= max_wait + (balance == "sequential"), late_held
    if balance == "sequential":
        assert late_carried <= 0, late_carried


def test_outliers_refused_with_grouped_long_context() -> None:
    d = make_cfg(WEIGHTS_3).to_dict()
    d["sources"][0]["context"] = "long"
    d["long_context"] = {"mode": "grouped"}
    d["outliers"] = {"min_length": MIN}
    with pytest.raises(ConfigError, match=r"outliers\.min_length.*grouped"):
        parse_config(d)


@pytest.mark.parametrize("balance", ["sequential", "lpt", "balanced"])
@pytest.mark.parametrize("outliers", [{"min_length": MIN}, {"min_length": SEQ_LEN // 3},
                                      {"min_length": MIN, "group": 3},
                                      {"min_length": SEQ_LEN // 3, "max_wait": 1}])
def test_exactly_once_for_every_strategy_and_group(balance: str, outliers: dict) -> None:
    """Also where outliers can share a row (min_length < seq_len/2), groups are fewer than
    the rows, or every held piece is due at the next step."""
    pl = planner(make_cfg(WEIGHTS_3, balance, cost=COST, outliers=outliers))
    plans = run(pl, 200)
    assert all(sum(q.length for q in row) <= SEQ_LEN for p in plans for r in p.rows for row in r)
    delivered = [q for p in plans for q in p.pieces()] + pl.pending()  # pending: placed later
    assert max(Counter(q.to_tuple() for q in delivered).values()) == 1
    for source in WEIGHTS_3:
        mine = [q for q in delivered if q.source == source]
        last = max(q.epoch for q in mine)
        assert last >= 1
        for epoch in range(last):
            got = {(q.unit, q.row, q.chunk, q.start, q.end) for q in mine if q.epoch == epoch}
            assert got == expected_pieces(source), (source, epoch)


def test_a_fraction_follows_seq_len() -> None:
    """``min_length: 0.5`` is "over half a row" whatever seq_len a config or script sets."""
    cfg = make_cfg(WEIGHTS_3, outliers={"min_length": 0.5})
    assert cfg.outliers.threshold(SEQ_LEN) == SEQ_LEN // 2 + 1
    d = cfg.to_dict()
    d["batch"]["seq_len"] = 1000
    again = parse_config(d)
    assert again.outliers.threshold(again.batch.seq_len) == 501
    assert make_cfg(WEIGHTS_3, outliers={"min_length": 0.0}).outliers.threshold(SEQ_LEN) == 0
    plans = run(planner(cfg), 100)
    counts = Counter(sum(q.length > SEQ_LEN // 2 for q in p.pieces()) for p in plans)
    assert set(counts) <= {0, ROWS} and counts[ROWS] > 0, counts


@pytest.mark.parametrize("min_length, says", [(1, "at least 4 tokens"), (3, "at least 4 tokens"),
                                              (0.01, "at least 0.03125")])
def test_a_min_length_that_holds_nearly_every_piece_is_refused(min_length: Any, says: str) -> None:
    # min_length: 1 made every piece an outlier: the held pieces, released a row each,
    # outgrew the steps and (max_wait: 1) the carried pieces grew by ~9 a step (a review)
    with pytest.raises(ConfigError, match=rf"outliers\.min_length.*{says}"):
        make_cfg(WEIGHTS_3, outliers={"min_length": min_length, "max_wait": 1})


def test_the_shortest_min_length_delivers_every_piece_within_steps() -> None:
    # (at min_length 1 the oldest pending piece waited 999 of 1,000 steps)
    from msd_dask.core.config import shortest_outlier

    cfg = make_cfg(WEIGHTS_3, cost=COST, outliers={"min_length": shortest_outlier(SEQ_LEN),
                                                   "max_wait": 1})
    pl = planner(cfg)
    first: dict[Any, int] = {}
    worst = 0
    for step in range(600):
        for q in pl.plan_step(lookup).pieces():
            worst = max(worst, step - first.pop((q.source, q.epoch, q.unit, q.row, q.chunk), step))
        for q in pl.pending():
            first.setdefault((q.source, q.epoch, q.unit, q.row, q.chunk), step)
    assert worst <= 32 and 599 - min(first.values(), default=599) <= 32, worst


def test_auto_never_holds_pieces_below_the_shortest_outlier() -> None:
    from msd_dask.core.config import OutlierConfig, auto_outlier_length, shortest_outlier

    # a cost model whose attention term is large: auto alone would hold 3-token pieces
    assert auto_outlier_length(4096, 1.0, 100.0) == 4
    assert OutlierConfig().threshold(4096, 1.0, 100.0) == shortest_outlier(4096) == 128
    assert OutlierConfig().threshold(4096, 1.0, 0.0) == 0  # (off stays off)


def test_a_source_held_back_by_a_full_hold_keeps_no_backlog_for_after_a_re_mix() -> None:
    """A source of mostly outliers at a weight above the share one outlier a row allows sat
    out each step once the hold was full, yet kept earning credit: after 600 steps it was
    owed 49 steps' worth, and after a re-mix to an equal weight it took 0.81-0.88 of the
    tokens for about 175 steps (a review).  Its credit beyond a step is forgiven, as a
    layout's cap on long pieces is."""
    rng = np.random.default_rng(0)
    lengths = {"short": [rng.integers(1, 100, size=200) for _ in range(10)],
               "long": [rng.integers(300, 512, size=200) for _ in range(10)]}

    def look(source: str, epoch: int, unit: int) -> np.ndarray:
        return lengths[source][unit]

    cfg = parse_config({"name": "t", "seed": 11, "batch": {"seq_len": 512, "micro_batches": 2},
                        "parallel": {"dp": 2}, "outliers": {"min_length": 0.5},
                        "sources": [{"name": n, "uri": f"mem://{n}/*", "format": "parquet",
                                     "weight": w, "shuffle_window": 2}
                                    for n, w in (("short", 0.1), ("long", 0.9))]})
    from msd_dask.core.units import Unit

    pl = Planner(cfg, {n: [Unit(f"{n}/p{i}.parquet") for i in range(10)] for n in lengths})
    capacity = 2 * 2 * 512
    held_back = [pl.plan_step(look) for _ in range(300)]
    tokens = Counter[str]()
    for p in held_back[100:]:
        tokens.update(p.tokens_by_source())
    assert tokens["long"] / sum(tokens.values()) < 0.85  # (held back: below its 0.9)
    assert max(abs(c) for c in pl.mixer.credit.values()) <= capacity, pl.mixer.credit
    pl.set_weights({"short": 0.5, "long": 0.5})
    tokens = Counter()
    for p in [pl.plan_step(look) for _ in range(60)][10:]:
        tokens.update(p.tokens_by_source())
    assert abs(tokens["long"] / sum(tokens.values()) - 0.5) < 0.05, tokens
