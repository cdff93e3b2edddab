"""What a reader that timed out says of the roles (``Reader._diagnose``): one look per process
and interval, shared by its readers, bounded in time, naming a role that does not answer."""

from __future__ import annotations

import time
from typing import Any

import pytest

from msd_dask import reader as reader_module
from msd_dask.reader import Reader


class _Answer:
    def __init__(self, value: Any, delay: float = 0.0):
        self.value, self.delay = value, delay

    def done(self) -> bool:  # (an answer of no delay is there at once)
        return self.delay <= 0.0

    def result(self, timeout: float | None = None) -> Any:
        if self.delay > (timeout or 0.0):
            time.sleep(timeout or 0.0)
            raise TimeoutError(f"timed out after {timeout} s.")
        return self.value


class _Role:
    def __init__(self, stats: dict[str, Any], delay: float = 0.0):
        self._stats, self.delay, self.asked = stats, delay, 0

    def stats(self) -> _Answer:
        self.asked += 1
        return _Answer(self._stats, self.delay)


class _Link:
    def __init__(self, planner: _Role, constructors: list[_Role]):
        self.planner, self.constructors = planner, constructors


def _reader(link: _Link) -> Reader:
    r = Reader.__new__(Reader)  # (only what the diagnosis reads)
    r.link = link  # type: ignore[assignment]
    return r


def test_the_readers_of_a_process_share_one_look(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of ranks timing out together each asked the planner and every constructor."""
    monkeypatch.setattr(reader_module, "DIAGNOSIS_AGE", 60.0)
    planner = _Role({"steps_planned": 7, "waiting": "constructors to make room for step 8"})
    held = _Role({"unclaimed": {"5": [0, 2]}, "held_steps": 2})
    link = _Link(planner, [_Role({}), held])
    said = {_reader(link)._diagnose() for _ in range(50)}
    assert said == {"planner (at step 7) is waiting for constructors to make room for step 8; "
                    "constructor 1 holds 2 step(s) not yet claimed by rank(s) [0, 2] "
                    "(see DataService.stats())"}
    assert planner.asked == held.asked == 1
    monkeypatch.setattr(reader_module, "DIAGNOSIS_AGE", 0.0)  # a later look asks again
    _reader(link)._diagnose()
    assert planner.asked == 2


def test_a_role_that_does_not_answer_is_named_and_the_look_is_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The look waited 5 s for each role in turn (hundreds of constructors: minutes), and a
    role that did not answer ended it with 'the service did not answer'."""
    monkeypatch.setattr(reader_module, "DIAGNOSIS_AGE", 0.0)
    monkeypatch.setattr(reader_module, "DIAGNOSIS_WAIT", 0.3)
    roles = [_Role({}, delay=10.0) for _ in range(6)]
    link = _Link(_Role({"steps_planned": 3}), roles)
    t0 = time.monotonic()
    said = _reader(link)._diagnose()
    assert time.monotonic() - t0 < 1.5, said
    assert said.startswith("planner is planning step 3; constructor 0, constructor 1, "
                           "constructor 2, constructor 3 and 2 more did not answer within 0.3s")


def test_roles_that_answered_are_not_named_silent_after_one_that_did_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A frozen planner used up the look's wait, and every constructor asked after it was
    waited for 0 s, which Dask's wait raises on even for an answer already there: healthy
    constructors were named as not answering (a review).  Answers there are read."""
    monkeypatch.setattr(reader_module, "DIAGNOSIS_AGE", 0.0)
    monkeypatch.setattr(reader_module, "DIAGNOSIS_WAIT", 0.3)

    class _Zero(_Answer):  # (Dask's: a wait of 0 s raises, answer or not)
        def result(self, timeout: float | None = None) -> Any:
            if not timeout:
                raise TimeoutError("timed out after 0 s.")
            return super().result(timeout)

    class _Healthy(_Role):
        def stats(self) -> _Answer:
            return _Zero(self._stats)

    held = _Healthy({"unclaimed": {"5": [1]}, "held_steps": 1})
    link = _Link(_Role({}, delay=10.0), [_Healthy({}), held])
    said = _reader(link)._diagnose()
    assert said == ("constructor 1 holds 1 step(s) not yet claimed by rank(s) [1]; planner did "
                    "not answer within 0.3s (see DataService.stats())"), said
