"""The shared exactly-once check itself (tests/checks.py): what it accepts and what it catches."""

from __future__ import annotations

import pytest

from checks import check_exactly_once

TEXTS = {("s", "a"): "alpha", ("s", "b"): "beta", ("s", "c"): "gamma"}


def _recs(*steps: list[tuple[str, int]]) -> list[dict]:
    """One record per step, each holding ``(key, epoch)`` pieces of source ``s`` in one row."""
    return [{"step": i, "documents": [[("s", k, 0) for k, _ in st]],
             "epochs": [[e for _, e in st]]} for i, st in enumerate(steps)]


def test_an_epoch_may_end_after_the_next_began():
    # epoch 1 begins (step 1) before epoch 0's last piece is delivered (step 2, carried over);
    # a run that stops after step 1 has epoch 0 partial and epoch 1 begun (CI failed on this)
    steps = [[("a", 0), ("b", 0)], [("a", 1), ("b", 1)], [("c", 0), ("c", 1)], [("b", 2)]]
    assert check_exactly_once(_recs(*steps[:2]), TEXTS, 512, min_complete=0) == {"s": 0}
    assert check_exactly_once(_recs(*steps[:3]), TEXTS, 512) == {"s": 2}
    assert check_exactly_once(_recs(*steps), TEXTS, 512) == {"s": 2}


def test_an_epoch_left_partial_long_before_the_end_fails():
    # epoch 0 misses c, and epoch 1 began 4 steps before the last record: not a carry
    steps = [[("a", 0), ("b", 0)], [("a", 1)], [("b", 1)], [], [], [("c", 1)]]
    with pytest.raises(AssertionError, match=r"epoch 0 is not exactly-once: missing \[\('c', 0\)\]"):
        check_exactly_once(_recs(*steps), TEXTS, 512)
    assert check_exactly_once(_recs(*steps), TEXTS, 512, carry_steps=4) == {"s": 1}


def test_a_missing_piece_before_the_last_two_epochs_fails():
    steps = [[("a", 0), ("b", 0)], [("a", 1), ("b", 1), ("c", 1)], [("a", 2)]]
    with pytest.raises(AssertionError, match=r"epoch 0 is not exactly-once: missing \[\('c', 0\)\]"):
        check_exactly_once(_recs(*steps), TEXTS, 512)


@pytest.mark.parametrize("steps, what", [
    ([[("a", 0), ("a", 0)]], "a piece repeats inside epoch 0"),
    ([[("a", 0), ("b", 0), ("c", 0)], [("a", 1), ("a", 1)]], "a piece repeats inside epoch 1"),
    ([[("a", 0), ("z", 0)]], "unknown pieces delivered in epoch 0"),
    ([[("a", 0)], [("a", 2)]], r"epochs \[0, 2\] are not contiguous"),
])
def test_repeats_unknown_pieces_and_gaps_fail(steps, what):
    with pytest.raises(AssertionError, match=what):
        check_exactly_once(_recs(*steps), TEXTS, 512)


def test_a_run_that_completes_no_epoch_fails_unless_it_says_so():
    """A run short of an epoch shows only that no piece came twice: a lost piece would
    pass, so such a run must say min_complete=0."""
    steps = [[("a", 0)], [("b", 0)]]  # epoch 0 holds a, b and c: c is never delivered
    with pytest.raises(AssertionError, match="epochs complete per source"):
        check_exactly_once(_recs(*steps), TEXTS, 512)
    assert check_exactly_once(_recs(*steps), TEXTS, 512, min_complete=0) == {"s": 0}
    with pytest.raises(AssertionError, match="at least 2 wanted"):
        check_exactly_once(_recs([("a", 0), ("b", 0), ("c", 0)]), TEXTS, 512, min_complete=2)
