"""A start whose planner fails to set up its roles closes those it made (DataService._start_on,
with stand-ins for the cluster): they stayed open on their workers (review)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from msd_dask.core.config import parse_config
from msd_dask.errors import ServiceTimeoutError, WorkerLeft
from msd_dask.service import handle


class _Done:
    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value, self.error = value, error

    def result(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _Planner:
    """A new planner whose setup raises ``error``; ``closing``: what its close_roles raises."""

    def __init__(self, calls: list[str], error: BaseException,
                 closing: BaseException | None = None):
        self.calls, self.error, self.closing = calls, error, closing

    def setup(self) -> _Done:
        self.calls.append("setup")
        return _Done(error=self.error)

    def close_roles(self, notice: str | None = None) -> _Done:
        self.calls.append("close_roles")
        return _Done(error=self.closing)

    def start(self) -> _Done:
        self.calls.append("start")
        return _Done()


class _Future:
    key = "msd-fs-planner-0"

    def __init__(self, calls: list[str]):
        self.calls = calls

    def release(self) -> None:
        self.calls.append("release")


class _Client:
    id = "owner-1"

    def __init__(self, calls: list[str]):
        self.calls = calls

    def list_datasets(self, callback_timeout: float | None = None) -> list[str]:
        return []

    def unpublish_dataset(self, name: str, callback_timeout: float | None = None) -> None:
        self.calls.append("unpublish")

    def wait_for_workers(self, n: int, timeout: float) -> None:
        pass

    def publish_dataset(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append("publish")


def _start(monkeypatch: pytest.MonkeyPatch, planner: _Planner, calls: list[str]) -> None:
    cfg = parse_config({"name": "fs", "batch": {"seq_len": 8}, "sources": [
        {"name": "a", "uri": "memory://a", "format": "jsonl"}]})
    monkeypatch.setattr(handle, "discover_remote", lambda *a: ({"a": []}, {"a": "/"}, {}))
    monkeypatch.setattr(handle, "place_planner", lambda *a, **k: {
        "planner": _Future(calls), "planner_worker": "tcp://w:1", "config": cfg.to_dict(),
        "constructors": 1, "generation": 0})
    monkeypatch.setattr(handle, "bound_actor", lambda *a, **k: planner)
    handle.DataService._start_on(_Client(calls), cfg, "tcp://s:1", resume=None, cluster=None,
                                 loader_threads=1, timeout=5)


@pytest.mark.parametrize("error, raised", [
    (WorkerLeft("fs", "constructor 1", "tcp://w:3"), WorkerLeft),  # (the others made)
    (TimeoutError("timed out after 5 s."), ServiceTimeoutError),
])
def test_a_setup_that_fails_closes_the_roles_it_made(monkeypatch: pytest.MonkeyPatch,
                                                      error: BaseException,
                                                      raised: type[BaseException]) -> None:
    """A worker that left during the setup (the other roles made) or a setup not done in
    time: the planner closes its roles and its future goes, then the start raises."""
    calls: list[str] = []
    with pytest.raises(raised) as info:
        _start(monkeypatch, _Planner(calls, error), calls)
    assert info.value is error or info.value.__cause__ is error  # (its own error, not the close's)
    assert calls == ["setup", "close_roles", "release"]


def test_a_close_that_fails_after_a_failed_setup_is_said_not_raised(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The close is best effort (the planner's worker may be the trouble): the setup's
    error is the one raised."""
    calls: list[str] = []
    error = WorkerLeft("fs", "constructor 1", "tcp://w:3")
    planner = _Planner(calls, error, closing=OSError("Timed out trying to connect"))
    with caplog.at_level(logging.WARNING, logger="msd_dask.service"), \
            pytest.raises(WorkerLeft) as info:
        _start(monkeypatch, planner, calls)
    assert info.value is error and calls == ["setup", "close_roles", "release"]
    assert any("could not close its roles" in r.getMessage() for r in caplog.records)
    caplog.clear()
    calls.clear()
    planner = _Planner(calls, error, closing=TimeoutError("timed out after 30 s."))
    with caplog.at_level(logging.WARNING, logger="msd_dask.service"), \
            pytest.raises(WorkerLeft):
        _start(monkeypatch, planner, calls)
    assert any("did not close its roles within 30s" in r.getMessage() for r in caplog.records)


def test_a_start_that_fails_after_its_setup_closes_the_roles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The handle's own making failed (its first look at the planner timed out, or Ctrl-C)
    after the planner set up its roles and the registry was published: the service was
    unpublished but its roles stayed open and the planner's key held (a review)."""
    import types

    calls: list[str] = []
    events: list[str] = []
    monkeypatch.setattr(handle, "published_event", lambda client, name: types.SimpleNamespace(
        set=lambda timeout: events.append("set"), clear=lambda timeout: events.append("clear")))

    def refused(*a: Any, **k: Any) -> None:
        raise ServiceTimeoutError("the planner of 'fs' did not answer within 5s")

    monkeypatch.setattr(handle.DataService, "__init__", refused)
    with pytest.raises(ServiceTimeoutError, match="did not answer"):
        _start(monkeypatch, _Planner(calls, None), calls)  # type: ignore[arg-type]
    assert calls == ["setup", "publish", "close_roles", "release", "unpublish"]
    assert events == ["set", "clear"]

