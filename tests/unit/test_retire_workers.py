"""``DataService.retire_workers`` and ``scale_loaders`` refuse what they cannot do, by name
(a review of the elastic paths): a worker holding another service's actor, which Dask keeps
while saying so only in the scheduler's log, and counts or sources that are not the
service's."""

from __future__ import annotations

import types
from typing import Any

import pytest

from msd_dask.core.config import parse_config
from msd_dask.errors import ServiceError, ServiceTimeoutError
from msd_dask.service.handle import DataService

W1, W2 = "tcp://198.18.0.2:4000", "tcp://198.18.0.3:4000"


class _Scheduler:
    """What keys_on and actors_on read of the scheduler."""

    def __init__(self, actors: dict[str, list[str]]):
        self.workers = {w: types.SimpleNamespace(
            name=w, actors=[types.SimpleNamespace(key=k) for k in keys], has_what=(),
            processing=()) for w, keys in actors.items()}


class _Client:
    def __init__(self, actors: dict[str, list[str]], retires: bool = True):
        self.scheduler, self.retires = _Scheduler(actors), retires
        self.retired: list[str] | None = None

    def run_on_scheduler(self, fn: Any, callback_timeout: float = 0, **kw: Any) -> Any:
        return fn(self.scheduler, **kw)

    def retire_workers(self, workers: list[str], **kw: Any) -> dict[str, Any]:
        self.retired = list(workers)
        return {w: {} for w in workers} if self.retires else {}


class _Link:
    def __init__(self) -> None:
        self.evacuated: list[list[str]] = []

    def call(self, fn: Any, what: str = "") -> Any:
        return fn(self)

    def evacuate(self, workers: list[str]) -> dict[str, int]:
        self.evacuated.append(workers)
        return {"loaders": 1, "constructors": 0}

    def scale(self, source: str, n: int) -> int:
        return n

    def refresh(self) -> None:
        pass

    def check_open(self) -> None:
        pass


def _service(client: _Client) -> DataService:
    svc = DataService.__new__(DataService)
    svc.config = parse_config({"name": "rw", "batch": {"seq_len": 8}, "sources": [
        {"name": "a", "uri": "memory://a", "format": "jsonl"}]})
    svc.name = "rw"
    svc.client = client
    svc.link = _Link()  # type: ignore[assignment]
    svc.keeper = None
    return svc


def test_a_worker_holding_another_services_actor_is_refused_before_anything_moves() -> None:
    # Dask kept the worker (a warning in the scheduler's log) and retire_workers returned as
    # if it had retired it
    client = _Client({W1: ["msd-rw-loader-a-0-0123abcd", "msd-other-constructor-0-89abcdef"], W2: []})
    svc = _service(client)
    with pytest.raises(ValueError, match=r"\['tcp://198.18.0.2:4000'\] hold actors not of "
                                         r"service 'rw' .*msd-other-constructor-0-89abcdef"):
        svc.retire_workers([W1])
    assert svc.link.evacuated == [] and client.retired is None  # type: ignore[attr-defined]
    # moving the roles off without retiring it is still allowed
    assert svc.retire_workers([W1], close=False) == {"loaders": 1, "constructors": 0}


def test_the_planners_worker_is_left_to_evacuate_to_refuse() -> None:
    # (this service's planner is its own: evacuate names its worker, as before)
    client = _Client({W1: ["msd-rw-planner-g2-0123abcd"], W2: []})
    svc = _service(client)
    svc.retire_workers([W1])
    assert svc.link.evacuated == [[W1]]  # type: ignore[attr-defined]


def test_a_worker_dask_did_not_retire_is_named() -> None:
    client = _Client({W1: ["msd-rw-loader-a-0-0123abcd"], W2: []}, retires=False)
    with pytest.raises(ServiceError, match=r"Dask did not retire \['tcp://198.18.0.2:4000'\]"):
        _service(client).retire_workers([W1])


def test_a_worker_retired_returns_what_moved() -> None:
    client = _Client({W1: ["msd-rw-loader-a-0-0123abcd"], W2: []})
    assert _service(client).retire_workers([W1]) == {"loaders": 1, "constructors": 0}
    assert client.retired == [W1]


@pytest.mark.parametrize("workers", [None, W1, 3])
def test_workers_that_are_not_a_list_are_refused(workers: Any) -> None:
    with pytest.raises(ValueError, match="workers must be a list of addresses"):
        _service(_Client({W1: []})).retire_workers(workers)


@pytest.mark.parametrize("source, n, says", [
    ("a", 0, r"an integer >= 1\), got 0"), ("a", -1, r"an integer >= 1\), got -1"),
    ("nope", 2, r"no source 'nope' \(the service's sources: \['a'\]\)"),
    # (1000 was taken as 8, the bound, without a word; a review)
    ("a", 1000, r"source 'a' has between 1 and 8 loaders \(sources\[0\]\.min_loaders"),
])
def test_scale_loaders_refuses_what_is_no_count_or_no_source(source: str, n: int,
                                                             says: str) -> None:
    # 0 and -1 became 1 silently; an unknown source was KeyError('"no source \'nope\'"')
    with pytest.raises(ValueError, match=says):
        _service(_Client({W1: []})).scale_loaders(source, n)


def test_a_move_that_times_out_says_it_was_retiring() -> None:
    # the planner's timeout said only "the planner did not answer within 300s" (a review)
    client = _Client({W1: ["msd-rw-loader-a-0-0123abcd"], W2: []})
    svc = _service(client)

    def slow(workers: list[str]) -> dict[str, int]:
        raise ServiceTimeoutError("service 'rw': the planner did not answer within 300s")

    svc.link.evacuate = slow  # type: ignore[attr-defined]
    with pytest.raises(ServiceTimeoutError, match=r"retiring \['tcp://198.18.0.2:4000'\]: "
                                                  r"moving the roles of service 'rw' off them"):
        svc.retire_workers([W1])
    assert client.retired is None
