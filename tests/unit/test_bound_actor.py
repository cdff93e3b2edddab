"""``dask_internals.bound_actor``'s wait for an actor placed on one worker (no Dask: a
stand-in future)."""

from __future__ import annotations

from typing import Any

import pytest

from msd_dask.dask_internals import bound_actor


class _Future:
    """Pending; its timed waits lapse as given (``TimeoutError``, or the ``UnboundLocalError``
    Dask's ``sync`` raises where ``asyncio.wait_for`` lets a ``CancelledError`` out on Python
    3.11), then it has ``value``."""

    status = "pending"

    def __init__(self, lapses: list[type[BaseException]], value: Any = "handle"):
        self.lapses, self.value = list(lapses), value

    def result(self, timeout: float | None = None) -> Any:
        if self.lapses:
            raise self.lapses.pop(0)("cannot access local variable 'result'")
        return self.value


def test_a_wait_that_lapses_in_dasks_sync_is_waited_again() -> None:
    """A CI run's service start failed with ``UnboundLocalError`` out of Dask's ``sync``: a
    lapsed wait, waited again (the scheduler's look at the worker is asked of a client that
    cannot answer here: taken as the worker still there)."""
    future = _Future([UnboundLocalError, TimeoutError, UnboundLocalError])
    assert bound_actor(object(), future, "tcp://198.18.0.2:1", "svc", "planner", 30) == "handle"


def test_a_wait_that_lapses_at_the_deadline_is_a_timeout() -> None:
    with pytest.raises(TimeoutError):
        bound_actor(object(), _Future([UnboundLocalError] * 3), "tcp://198.18.0.2:1", "svc",
                    "planner", 0.5)
