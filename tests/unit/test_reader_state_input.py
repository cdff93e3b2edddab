"""A reader's saved state, its rank and its timeout, given wrong: one clear error naming
what is wrong, the same on the direct reader and on a host agent's (``msd_dask.batch``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from msd_dask.batch import loaded_step, rank_number, wait_seconds


def test_a_reader_state_is_its_step() -> None:
    assert loaded_step({"rank": 2, "step": 7}, 2) == 7
    assert loaded_step({"step": None}, 2) is None
    assert loaded_step({"rank": np.int64(2), "step": np.int64(7)}, 2) == 7  # numpy's ints
    assert type(loaded_step({"rank": 2, "step": np.int64(7)}, 2)) is int


@pytest.mark.parametrize("state, message", [
    ([0, 3], "a reader state is a mapping {'rank', 'step'}, got list"),
    ({"stp": 5}, r"unknown key\(s\) \['stp'\]"),
    ({"rank": "2", "step": 3}, "reader state of rank '2' loaded into rank 2"),
    ({"rank": 1, "step": 3}, "reader state of rank 1 loaded into rank 2"),
    ({"rank": 2, "step": "abc"}, "'step' is 'abc', not a whole number >= 0 or None"),
    ({"rank": 2, "step": 2.7}, "'step' is 2.7"),
    ({"rank": 2, "step": -1}, "'step' is -1"),
    ({"rank": 2, "step": True}, "'step' is True"),
])
def test_a_wrong_reader_state_is_named(state: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        loaded_step(state, 2)


@pytest.mark.parametrize("rank", ["0", 1.5, None, True])
def test_a_rank_that_is_no_integer_is_named(rank: Any) -> None:
    with pytest.raises(ValueError, match=rf"rank must be an integer, got {rank!r}"):
        rank_number(rank)
    assert rank_number(np.int32(3)) == 3


def test_both_readers_take_the_same_rule() -> None:
    """The direct reader and the agent's reader load states through loaded_step."""
    from msd_dask.reader import Reader, _Progress
    from msd_dask.service.agent_client import AgentReader

    direct = Reader.__new__(Reader)  # (their state alone: no service behind them)
    direct._progress = _Progress()
    direct.rank, direct.step, direct._skip_through = 2, None, -1
    agent = AgentReader.__new__(AgentReader)
    agent.rank, agent.step, agent._loaded = 2, None, None
    for reader in (direct, agent):
        with pytest.raises(ValueError, match=r"unknown key\(s\) \['stp'\]"):
            reader.load_state_dict({"stp": 5})
        reader.load_state_dict({"rank": 2, "step": 9})
        assert reader.state_dict() == {"rank": 2, "step": 9}
    with pytest.raises(ValueError, match="rank must be an integer, got '2'"):
        AgentReader("/nowhere", "svc", "2", timeout=1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1.0, "5", None, True])
def test_a_timeout_that_is_no_finite_number_of_seconds_is_named(timeout: Any) -> None:
    """``timeout=float("inf")``: the direct reader took it (a wait with no end), the
    agent's failed connecting with a bare ``OverflowError`` (a review of the reader path)."""
    from msd_dask.service.agent_client import AgentReader

    message = rf"rank 2: a reader's timeout is a finite number of seconds > 0, got {timeout!r}"
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        wait_seconds(timeout, 2)
    with pytest.raises(ValueError, match="a reader's timeout is a finite number"):
        AgentReader("/nowhere", "svc", 2, timeout=timeout)
    assert wait_seconds(np.float32(2.5), 2) == 2.5 and wait_seconds(3, 2) == 3.0
