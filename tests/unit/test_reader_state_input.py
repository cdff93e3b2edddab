"""A reader's saved state, its rank and its timeout, given wrong: one clear error naming
what is wrong, the same on the direct reader and on a host agent's (``msd_dask.batch``)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from msd_dask.batch import loaded_step, rank_number, reader_state, wait_seconds


def test_a_reader_state_is_its_step() -> None:
    assert loaded_step({"service": "svc", "rank": 2, "step": 7}, 2, "svc") == 7
    assert loaded_step(reader_state(2, 7, "svc"), 2, "svc") == 7
    assert loaded_step({"rank": 2, "step": 7}, 2, "svc") == 7  # (of an earlier version)
    assert loaded_step({"step": None}, 2, "svc") is None
    assert loaded_step({"rank": np.int64(2), "step": np.int64(7)}, 2, "svc") == 7  # numpy's
    assert type(loaded_step({"rank": 2, "step": np.int64(7)}, 2, "svc")) is int


def test_a_state_of_another_service_is_refused_naming_both() -> None:
    """The state of rank 0 of service 'itest' after step 4, loaded into rank 0 of service
    'other', was taken: 'other''s reader silently skipped its own steps 0-4 (a review)."""
    state = reader_state(0, 4, "itest")
    with pytest.raises(ValueError, match=r"reader state of service 'itest' loaded into a "
                       r"reader of service 'other' \(rank 0\): .* load the state rank 0 saved "
                       r"while reading 'other', or none to read 'other' from its first step"):
        loaded_step(state, 0, "other")
    with pytest.raises(ValueError, match=r"reader state of service 'other' without a 'rank'"):
        loaded_step({"service": "other", "step": 4}, 0, "other")


@pytest.mark.parametrize("state, message", [
    ([0, 3], "a reader state is a mapping {'service', 'rank', 'step'}, got list"),
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
        loaded_step(state, 2, "svc")


@pytest.mark.parametrize("rank", ["0", 1.5, None, True])
def test_a_rank_that_is_no_integer_is_named(rank: Any) -> None:
    with pytest.raises(ValueError, match=rf"rank must be an integer, got {rank!r}"):
        rank_number(rank)
    assert rank_number(np.int32(3)) == 3


def test_both_readers_take_the_same_rule() -> None:
    """The direct reader, the agent's reader and the torch dataset load states through
    loaded_step: each names its service in its state and refuses another service's."""
    from types import SimpleNamespace

    from msd_dask.reader import Reader, _Progress
    from msd_dask.service.agent_client import AgentReader
    from msd_dask.torch import MsdIterableDataset

    direct = Reader.__new__(Reader)  # (their state alone: no service behind them)
    direct._progress = _Progress()
    direct.link = SimpleNamespace(name="svc")  # type: ignore[assignment]
    direct.rank, direct.step, direct._skip_through = 2, None, -1
    agent = AgentReader.__new__(AgentReader)
    agent.rank, agent.step, agent._loaded, agent.name = 2, None, None, "svc"
    dataset = MsdIterableDataset("tcp://198.18.0.1:8786", "svc", 2)  # (not connected)
    for reader in (direct, agent, dataset):
        with pytest.raises(ValueError, match=r"unknown key\(s\) \['stp'\]"):
            reader.load_state_dict({"stp": 5})
        with pytest.raises(ValueError, match=r"reader state of service 'itest' loaded into a "
                                             r"reader of service 'svc' \(rank 2\)"):
            reader.load_state_dict(reader_state(2, 9, "itest"))
        reader.load_state_dict({"rank": 2, "step": 9})
        assert reader.state_dict() == {"service": "svc", "rank": 2, "step": 9}
        reader.load_state_dict(reader.state_dict())  # (its own state: taken)
        assert reader.state_dict() == {"service": "svc", "rank": 2, "step": 9}
    with pytest.raises(ValueError, match="rank must be an integer, got '2'"):
        AgentReader("/nowhere", "svc", "2", timeout=1.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), 0, -1.0, "5", None, True,
                                     1e10, 365 * 24 * 3600 + 1])
def test_a_timeout_that_is_no_finite_number_of_seconds_is_named(timeout: Any) -> None:
    """``timeout=float("inf")``: the direct reader took it (a wait with no end), the
    agent's failed connecting with a bare ``OverflowError`` (a review of the reader path);
    so did 1e10, past what a socket's timeout takes (a review of the agent)."""
    from msd_dask.service.agent_client import AgentReader

    message = ("rank 2: a reader's timeout is a finite number of seconds > 0 and at most "
               f"3.1536e+07 (a year), got {timeout!r}")
    with pytest.raises(ValueError, match=re.escape(message)):
        wait_seconds(timeout, 2)
    with pytest.raises(ValueError, match="a reader's timeout is a finite number"):
        AgentReader("/nowhere", "svc", 2, timeout=timeout)
    assert wait_seconds(np.float32(2.5), 2) == 2.5 and wait_seconds(3, 2) == 3.0


def test_the_longest_timeout_is_a_reader_timeout() -> None:
    assert wait_seconds(365 * 24 * 3600, 2) == 365 * 24 * 3600

