"""Mixer: delivered token shares follow the weights in force."""

from __future__ import annotations

import json

import numpy as np
import pytest

from msd_dask.core.mixing import Mixer

MAX_LEN = 512


def names(n: int) -> list[str]:
    return [f"s{i}" for i in range(n)]


def run(m: Mixer, weights: dict[str, float], n: int, rng: np.random.Generator,
        tokens: dict[str, int] | None = None) -> dict[str, int]:
    """Take ``n`` pieces of random lengths; return the tokens taken per source."""
    tokens = tokens if tokens is not None else dict.fromkeys(m.sources, 0)
    for _ in range(n):
        s = m.choose(weights)
        k = int(rng.integers(1, MAX_LEN + 1))
        m.take(s, k, weights)
        tokens[s] += k
    return tokens


def shares(tokens: dict[str, int]) -> dict[str, float]:
    total = sum(tokens.values())
    return {s: t / total for s, t in tokens.items()}


@pytest.mark.parametrize("ws", [
    [0.5, 0.3, 0.2],
    [0.05, 0.9, 0.05],
    [0.25, 0.25, 0.25, 0.25],
    [0.01, 0.99],
    [0.7, 0.0, 0.3],
    [1.0],
])
def test_long_run_token_shares(ws: list[float]) -> None:
    src = names(len(ws))
    w = dict(zip(src, ws, strict=True))
    m = Mixer(src)
    got = shares(run(m, w, 8000, np.random.default_rng(1)))
    for s in src:
        # Well within 1% (absolute): the deviation is bounded by credit / total tokens.
        assert abs(got[s] - w[s]) <= 0.001, (s, got[s], w[s])
    # Credits sum to zero and stay within a few piece lengths of it.
    assert abs(sum(m.credit.values())) < 1e-6
    assert max(abs(c) for c in m.credit.values()) <= len(src) * MAX_LEN


@pytest.mark.parametrize("ws", [[3.0, 1.0], [0.7, 0.4], [0.2, 0.1, 0.0]])
def test_weights_that_do_not_sum_to_one_give_their_shares(ws: list[float]) -> None:
    """``choose``/``take`` scale weights to sum to 1: 3 : 1 used to give shares 1.0 / 0.0
    and 0.7 : 0.4 gave 0.65 / 0.35 (a source earned ``w·n`` while paying ``n``)."""
    src = names(len(ws))
    w = dict(zip(src, ws, strict=True))
    got = shares(run(Mixer(src), w, 8000, np.random.default_rng(1)))
    for s, ws_s in w.items():
        assert abs(got[s] - ws_s / sum(ws)) <= 0.001, (s, got[s])


def test_equal_weights_and_lengths_alternate() -> None:
    m = Mixer(["a", "b"])
    w = {"a": 0.5, "b": 0.5}
    picks = []
    for _ in range(10):
        s = m.choose(w)
        m.take(s, 100, w)
        picks.append(s)
    assert picks == ["a", "b"] * 5  # ties go to the earlier source


def test_zero_weight_source_never_chosen() -> None:
    src = names(3)
    m = Mixer(src)
    rng = np.random.default_rng(2)
    w = {"s0": 0.5, "s1": 0.0, "s2": 0.5}
    tokens = run(m, w, 3000, rng)
    assert tokens["s1"] == 0
    # Even with a large positive credit built up while it had a weight.
    m = Mixer(src)
    run(m, {"s0": 0.1, "s1": 0.8, "s2": 0.1}, 50, rng)
    credit = m.credit
    credit["s1"] = 10_000.0
    credit["s0"] -= 5_000.0
    credit["s2"] -= 5_000.0
    m.load_state_dict(credit)
    assert run(m, w, 500, rng)["s1"] == 0


def test_missing_weight_counts_as_zero() -> None:
    m = Mixer(names(3))
    tokens = run(m, {"s2": 1.0}, 200, np.random.default_rng(3))
    assert tokens["s0"] == 0 and tokens["s1"] == 0 and tokens["s2"] > 0


def test_all_zero_weights_raise() -> None:
    m = Mixer(names(2))
    with pytest.raises(ValueError):
        m.choose({"s0": 0.0, "s1": 0.0})
    with pytest.raises(ValueError):
        m.choose({})


def test_shares_follow_a_weight_change_quickly() -> None:
    src = names(3)
    m = Mixer(src)
    rng = np.random.default_rng(4)
    before = {"s0": 0.8, "s1": 0.1, "s2": 0.1}
    after = {"s0": 0.1, "s1": 0.1, "s2": 0.8}
    run(m, before, 3000, rng)
    # Over the next 100 pieces (~25k tokens), the new weights already hold.
    window = shares(run(m, after, 100, rng))
    for s in src:
        assert abs(window[s] - after[s]) < 0.06, (s, window[s], after[s])
    # And over a longer stretch, tightly.
    longer = shares(run(m, after, 3000, rng))
    for s in src:
        assert abs(longer[s] - after[s]) < 0.005


def test_state_dict_round_trip() -> None:
    src = names(3)
    w = {"s0": 0.2, "s1": 0.3, "s2": 0.5}
    rng = np.random.default_rng(5)
    m = Mixer(src)
    run(m, w, 77, rng)
    state = json.loads(json.dumps(m.state_dict()))
    m2 = Mixer(src)
    m2.load_state_dict(state)
    picks1, picks2 = [], []
    for k in np.random.default_rng(6).integers(1, MAX_LEN, size=200):
        for mm, picks in ((m, picks1), (m2, picks2)):
            s = mm.choose(w)
            mm.take(s, int(k), w)
            picks.append(s)
    assert picks1 == picks2
    assert m.state_dict() == m2.state_dict()


@pytest.mark.parametrize("n_src", [1, 2, 3])
def test_draw_takes_what_choose_and_take_would(n_src: int) -> None:
    # the planner's batched draws and the one-piece API are the same rule: the same picks
    # and, to the last bit, the same credit
    rng = np.random.default_rng(7 + n_src)
    src = names(n_src)
    w = dict(zip(src, rng.dirichlet(np.ones(n_src)).tolist(), strict=True))
    lengths = [rng.integers(1, MAX_LEN, size=300).tolist() for _ in src]
    limit = 400  # longer pieces end a draw; the caller takes them with ``first``
    one = Mixer(src)
    want: list[tuple[int, int]] = []
    offset = [0] * n_src
    for _ in range(200):
        s = src.index(one.choose(w))
        want.append((s, offset[s]))
        one.take(src[s], lengths[s][offset[s]], w)
        offset[s] += 1
    batched = Mixer(src)
    wl = np.array([w[s] for s in src])
    flat = np.array(sum(lengths, []), dtype=np.int64)
    base = np.arange(n_src, dtype=np.int64) * 300
    got = np.zeros(0, dtype=np.int64)  # grown by draw
    n_got = 0
    offset = np.zeros(n_src, dtype=np.int64)
    tags = np.arange(n_src, dtype=np.int64) << 32
    first, room = -1, sum(lengths[s][o] for s, o in want)
    while True:
        s, room, got, n_got, *_ = batched.draw(wl, np.ones(n_src, dtype=bool), flat, base, offset,
                                               np.full(n_src, 300), np.full(n_src, limit), room, got,
                                               n_got, tags, first)
        if s < 0 or lengths[s][offset[s]] > room:
            break
        got = np.append(got[:n_got], (s << 32) | offset[s])
        n_got += 1
        room -= lengths[s][offset[s]]
        first = s
    assert [(k >> 32, k & 0xFFFFFFFF) for k in got[:n_got].tolist()] == want
    assert batched.state_dict() == one.state_dict()


def test_draw_holds_outliers_while_the_hold_has_room() -> None:
    # pieces of at least ``hold`` tokens are held (consumed and charged, not counted against
    # the room) while the hold has room; then their source sits out and the others fill
    m, one = Mixer(["a", "b"]), Mixer(["a", "b"])
    lengths = np.array([90, 95, 10, 20, 20, 20, 20], dtype=np.int64)
    offset = np.zeros(2, dtype=np.int64)
    el = np.ones(2, dtype=bool)
    src, room, out, n_out, held, n_held = m.draw(
        np.array([0.9, 0.1]), el, lengths, np.array([0, 3]), offset, np.array([3, 4]), np.array([50, 50]),
        1000, np.zeros(0, dtype=np.int64), 0, np.array([0, 1 << 32]), -1, 50, np.zeros(0, dtype=np.int64),
        0, 1)
    assert held[:n_held].tolist() == [0]                     # a's 90 held: the hold is full
    assert el.tolist() == [False, True]                      # so a's 95 waits, and b fills
    assert out[:n_out].tolist() == [(1 << 32) | i for i in range(4)]
    assert (src, room, offset.tolist()) == (1, 1000 - 80, [1, 4])
    for s, n in (("a", 90), ("b", 20), ("b", 20), ("b", 20), ("b", 20)):
        one.take(s, n, {"a": 0.9, "b": 0.1})
    assert m.state_dict() == one.state_dict()


@pytest.mark.parametrize("weights, says", [
    ({"a": float("nan"), "b": 1.0}, "source 'a' has weight nan"),
    ({"a": -1.0, "b": 1.0}, "source 'a' has weight -1.0"),
    ({"a": float("inf"), "b": 1.0}, "source 'a' has weight inf"),
    ({"x": 1.0}, "no source 'x'"),
])
def test_weights_that_are_not_a_mix_are_refused_naming_the_source(weights: dict[str, float],
                                                                  says: str) -> None:
    """NaN was passed over, -1 read as 0, inf and an unknown name said "every source weight
    is 0" (a review)."""
    mixer = Mixer(["a", "b"])
    with pytest.raises(ValueError, match=says):
        mixer.choose(weights)
    with pytest.raises(ValueError, match=says):
        mixer.take("a", 10, weights)
