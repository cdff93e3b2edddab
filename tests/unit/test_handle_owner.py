"""The owner's handle around its service (no Dask: stand-ins for its link, keeper and
client): arguments refused before anything starts, its address after close, what its close
closes where the planner is lost or the service was stopped from elsewhere (found by a
review, each by running it)."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from msd_dask.core.config import parse_config
from msd_dask.service import DataService

CFG = {"name": "own", "batch": {"seq_len": 8}, "sources": [
    {"name": "a", "uri": "memory://own/a.jsonl", "format": "jsonl"},
    {"name": "b", "uri": "memory://own/b.jsonl", "format": "jsonl"}]}


@pytest.mark.parametrize("kwargs, says", [
    ({"n_workers": 0}, "n_workers must be a whole number >= 1, got 0"),
    ({"threads_per_worker": 1.5}, "threads_per_worker must be a whole number >= 1, got 1.5"),
    ({"loader_threads": None}, "loader_threads must be a whole number >= 1, got None"),
    ({"loader_threads": "2"}, "loader_threads must be a whole number >= 1, got '2'"),
])
def test_start_refuses_counts_that_are_no_count_before_anything_starts(
        kwargs: dict[str, Any], says: str) -> None:
    """``n_workers=0`` started an embedded cluster nobody can join and waited the whole
    timeout for a worker; ``loader_threads=None`` raised int()'s words naming no argument."""
    with pytest.raises(ValueError, match=f"DataService.start: {says}"):
        DataService.start(CFG, **kwargs)


def _owner(planner_lost: bool = False, stopped_elsewhere: bool = False,
           gave_up: str | None = None) -> DataService:
    svc = DataService.__new__(DataService)
    svc.config = parse_config(CFG)
    svc.name = "own"
    svc.client = SimpleNamespace(scheduler=None, status="closed")  # (as a closed client)
    svc.link = SimpleNamespace(  # type: ignore[assignment]
        scheduler_address="tcp://198.18.0.1:8786", registry={"planner": SimpleNamespace(key="k")},
        planner_lost=lambda: planner_lost)
    svc.keeper = SimpleNamespace(  # type: ignore[assignment]
        pinned=["p"], stopped_elsewhere=stopped_elsewhere, gave_up=gave_up)
    return svc


def test_the_address_is_said_after_close() -> None:
    """``address`` read the closed client's scheduler: ``AttributeError`` after close, where
    every other call of a closed handle says it is closed."""
    assert _owner().address == "tcp://198.18.0.1:8786"


@pytest.mark.parametrize("planner_lost, gave_up, stopped, by_name, closes", [
    (False, None, False, None, True),
    (True, None, False, ["a", "b"], True),
    (False, "gave up after 3 losses", False, ["a", "b"], True),
    (False, None, True, None, False),
])
def test_the_owners_close_closes_by_name_where_the_planner_is_lost(
        monkeypatch: pytest.MonkeyPatch, planner_lost: bool, gave_up: str | None,
        stopped: bool, by_name: list[str] | None, closes: bool) -> None:
    """Where the planner was lost (and not re-created, or its keeper gave up) the owner's
    close asked only the lost planner to close the roles: those on the other workers stayed
    open, unreachable once their keys went.  It closes them by name there.  A service
    stopped from elsewhere while the owner was out of reach (its name perhaps another's now)
    is left alone."""
    from msd_dask.service import handle

    calls: list[Any] = []
    monkeypatch.setattr(handle, "_close_service",
                        lambda *args, **kwargs: calls.append(kwargs.get("sources")))
    monkeypatch.setattr(DataService, "planner", property(lambda self: None))
    _owner(planner_lost, stopped, gave_up)._close_roles()
    assert calls == ([by_name] if closes else [])


def test_a_keeper_that_finds_its_service_stopped_elsewhere_says_so_to_its_owner() -> None:
    """The keeper stopped re-creating the planner of a service stopped from elsewhere, but
    told nobody: ``msd-dask serve`` watched on for ever, warning every timeout that a live
    worker's planner was lost."""
    from msd_dask.service.recovery import PlannerKeeper

    link = SimpleNamespace(name="own", failed=None, published_as_mine=lambda: False)
    keeper = SimpleNamespace(link=link, _lock=threading.RLock(), _stop=threading.Event(),
                             stopped_elsewhere=False)
    PlannerKeeper.recover(keeper)  # type: ignore[arg-type]
    assert keeper._stop.is_set() and keeper.stopped_elsewhere
    assert link.failed is not None and "stopped from elsewhere" in link.failed
