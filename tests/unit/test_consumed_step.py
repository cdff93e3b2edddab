"""``DataService.consumed_step()`` over what the constructors know, without a cluster: a
constructor re-created after a loss knows nothing of what its ranks returned before, and
readers paused in other processes do not report again.  It answered one before the
first step (a state that would serve every step again); it now refuses, naming the
ranks (found by review, reproduced by killing a constructor's worker)."""

from __future__ import annotations

import weakref
from typing import Any

import pytest
from test_link_refresh import _Done

from msd_dask.core.config import parse_config
from msd_dask.service.handle import DataService


class _Constructor:
    def __init__(self, ranks: list[int], returned: dict[int, int], replacing: bool):
        self.ranks, self.returned, self.replacing = ranks, returned, replacing

    def stats(self) -> _Done:
        return _Done({"queue_depth": dict.fromkeys(self.ranks, 0),
                      "returned": dict(self.returned), "returned_by": dict.fromkeys(self.returned, "pause"),
                      "last_claimed": dict(self.returned), "report_after": {},
                      "replacing": self.replacing})


class _Planner:
    def start_step(self) -> int:
        return 0


class _Link:
    generation = 0

    def __init__(self, constructors: list[_Constructor]):
        self.constructors = constructors
        self.refreshed = 0

    def refresh(self) -> None:
        self.refreshed += 1

    def call(self, fn: Any, what: str = "") -> Any:
        return fn(_Planner())


def _service(constructors: list[_Constructor]) -> DataService:
    svc = DataService.__new__(DataService)
    svc.config = parse_config({"name": "cs", "parallel": {"dp": 2}, "batch": {"seq_len": 8},
                               "sources": [{"name": "a", "uri": "memory://a", "format": "jsonl"}]})
    svc.name = "cs"
    svc.link = _Link(constructors)  # type: ignore[assignment]
    svc._readers = weakref.WeakSet()
    svc._returned = {}
    svc.report_margin = 0.2
    return svc


def test_every_rank_reported_step_3() -> None:
    """The step every rank has returned: the least of the ranks' (rank 1 is at step 5)."""
    svc = _service([_Constructor([0], {0: 3}, False), _Constructor([1], {1: 5}, False)])
    assert svc.consumed_step() == 3
    assert svc.link.refreshed == 1  # (a constructor re-created since is asked, not the lost one)


def test_an_earlier_reader_of_a_rank_does_not_speak_for_it() -> None:
    """Rank 0 read to step 2 with one reader, closed it, and read to step 5 with the next;
    both still referenced, whichever came last in the handle's set of readers (an order of
    memory addresses) gave the rank's step: 2, a state that serves steps 3-5 again (a
    review of the handle).  The latest reader's step counts (the handle's ledger)."""

    class _Reader:
        def __init__(self, rank: int, step: int):
            self.rank, self.step = rank, step

        def state_dict(self) -> dict[str, int]:
            return {"rank": self.rank, "step": self.step}

    svc = _service([_Constructor([0], {0: 2}, False), _Constructor([1], {1: 5}, False)])
    readers = [_Reader(0, 5), _Reader(0, 2), _Reader(1, 5)]
    svc._returned = {0: 5, 1: 5}  # (what the readers kept up to date)
    for order in (readers, readers[::-1]):
        svc._readers = list(order)  # type: ignore[assignment]
        assert svc.consumed_step() == 5


def test_ranks_that_read_on_elsewhere_are_not_held_back_by_this_handles_ledger() -> None:
    """The owner read steps 0-2 on both ranks, then the ranks read on to step 8 through
    another handle (the training processes): the owner's ledger said 2, overriding the
    constructors' 8, so its default state_dict() served steps 3-8 again (a review)."""
    svc = _service([_Constructor([0], {0: 8}, False), _Constructor([1], {1: 8}, False)])
    svc._returned = {0: 2, 1: 2}
    assert svc.consumed_step() == 8
    svc._returned = {0: 9, 1: 8}  # (its own readers' newer steps still count)
    assert svc.consumed_step() == 8


def test_a_re_created_constructor_that_heard_nothing_is_refused_by_name() -> None:
    svc = _service([_Constructor([0], {0: 3}, False), _Constructor([1], {}, True)])
    with pytest.raises(ValueError, match=r"rank\(s\) 1 are served by a constructor re-created"):
        svc.consumed_step()
    # once its rank claims or reports, it knows
    svc.link.constructors[1].returned = {1: 3}
    assert svc.consumed_step() == 3


def test_the_owners_set_weights_returns_once_its_kept_checkpoint_has_the_change() -> None:
    """The owner's keeper fetched the planner's checkpoint once a second: a planner lost
    within that second of a set_weights was re-created from a checkpoint without the change,
    and the new mix never came (review, by killing the planner's worker)."""
    events: list[str] = []

    class _WeightsPlanner(_Planner):
        def set_weights(self, weights: Any, from_step: Any) -> int:
            events.append("set_weights")
            return 13

    class _Keeper:
        checkpoint = {"generation": 0}

        def keep_checkpoint(self) -> None:
            events.append("keep_checkpoint")

    svc = _service([])
    svc.link.call = lambda fn, what="": fn(_WeightsPlanner())  # type: ignore[method-assign]
    svc.keeper = _Keeper()  # type: ignore[assignment]
    assert svc.set_weights({"a": 1.0}) == 13
    assert events == ["set_weights", "keep_checkpoint"]
    svc.keeper = None  # a process connected to the service: nothing to keep
    assert svc.set_weights({"a": 1.0}) == 13 and events[-1] == "set_weights"


def test_set_weights_applied_returns_when_the_checkpoint_is_not_sent_in_time(caplog) -> None:
    """The planner applied the weights, but the owner's checkpoint did not come in time: the
    call raised although the change was made (noticed in review, as for scale_loaders).  It
    warns and returns the step."""
    import logging

    from msd_dask import ServiceTimeoutError

    class _WeightsPlanner(_Planner):
        def set_weights(self, weights: Any, from_step: Any) -> int:
            return 21

    class _LateKeeper:
        def keep_checkpoint(self) -> None:
            raise ServiceTimeoutError("the planner did not send its checkpoint within 10s")

    svc = _service([])
    svc.link.call = lambda fn, what="": fn(_WeightsPlanner())  # type: ignore[method-assign]
    svc.keeper = _LateKeeper()  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="msd_dask.service"):
        assert svc.set_weights({"a": 0.25, "b": 0.75}) == 21
    assert "weights {'a': 0.25, 'b': 0.75} from step 21 applied, but not kept for a " \
        "re-created planner yet" in caplog.text


def test_a_change_the_planner_made_just_before_it_was_re_created_is_made_again() -> None:
    """The owner's set_weights was answered by planner generation 0, which was lost before
    the owner kept its checkpoint; the owner's watcher re-created the planner from the state
    it kept before the change, and set_weights returned: the change was gone from the
    service, with no warning (a review of the handle).  It is made again on the new one,
    from the step the first answer named; a scale_loaders likewise."""
    calls: list[tuple[int, Any]] = []

    class _Planner2(_Planner):
        def __init__(self, generation: int):
            self.generation = generation

        def set_weights(self, weights: Any, from_step: Any) -> int:
            calls.append((self.generation, from_step))
            return 13 if from_step is None else int(from_step)

        def scale(self, source: str, n: int) -> int:
            calls.append((self.generation, n))
            return n

    svc = _service([])
    link = svc.link

    def call(fn: Any, what: str = "") -> Any:
        return fn(_Planner2(link.generation))

    class _Keeper:
        checkpoint: dict[str, Any] = {"generation": 0}
        lose = True

        def keep_checkpoint(self) -> None:
            if self.lose:  # the planner that answered is lost: re-created from an old state
                self.lose = False
                link.generation += 1  # type: ignore[attr-defined]
            self.checkpoint = {"generation": link.generation}

    link.call = call  # type: ignore[attr-defined]
    svc.keeper = _Keeper()  # type: ignore[assignment]
    assert svc.set_weights({"a": 1.0}) == 13
    assert calls == [(0, None), (1, 13)]  # again, on generation 1, from the same step
    calls.clear()
    svc.keeper.lose = True  # type: ignore[attr-defined]
    assert svc.scale_loaders("a", 2) == 2
    assert calls == [(1, 2), (2, 2)]


def test_a_planner_re_created_after_the_service_closed_is_not_published(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A recovery that outlived close()'s wait for it published its new planner all the
    same: the service's name stayed taken on the scheduler, its roles alive (a review of
    the handle).  A recovery that finds the keeper stopped closes the new planner's roles
    instead."""
    from msd_dask.errors import ServiceError
    from msd_dask.service import recovery
    from msd_dask.service.recovery import PlannerKeeper

    done: list[str] = []

    class _NewPlanner:
        def setup(self) -> _Done:
            return _Done(None)

        def close_roles(self) -> _Done:
            done.append("close_roles")
            return _Done(None)

    class _Future:
        def release(self) -> None:
            done.append("release")

    class _Client:
        def publish_dataset(self, *args: Any, **kwargs: Any) -> None:
            done.append("publish")

    svc = _service([])
    link = svc.link
    link.client, link.config, link.name = _Client(), svc.config, "cs"  # type: ignore[attr-defined]
    monkeypatch.setattr(recovery, "bound_actor", lambda *a, **k: _NewPlanner())
    keeper = PlannerKeeper(link, {})  # type: ignore[arg-type]
    keeper.stop(0.1)  # the service closed (no watcher: nothing to wait for)
    with pytest.raises(ServiceError, match="closed while its planner was re-created"):
        keeper._start_generation({"planner": _Future(), "planner_worker": "tcp://w:1",
                                  "generation": 1})
    assert done == ["close_roles", "release"]


def test_a_failure_of_the_watcher_that_lasts_is_logged_once(caplog: Any) -> None:
    """The owner's watcher logged the same failure every second: with the workers and then
    the scheduler gone, msd-dask serve wrote about 300 identical lines before it exited (a
    review of the command line).  A failure is logged when it changes."""
    import logging
    import threading
    import time

    from msd_dask.service.recovery import PlannerKeeper

    class _LostLink:
        name, generation = "cs", 0
        failures = 0

        def planner_lost(self, confirm: bool = False) -> bool:
            self.failures += 1
            if self.failures == 20:
                raise ValueError("another failure")
            raise RuntimeError("Worker holding Actor was lost.  Status: cancelled")

    link = _LostLink()
    keeper = PlannerKeeper(link, {}, interval=0.01)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="msd_dask.service"):
        watcher = threading.Thread(target=keeper._watch, daemon=True)
        watcher.start()
        deadline = time.monotonic() + 10
        while link.failures < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        keeper.stop(5)
    said = [r.getMessage() for r in caplog.records if "watching the planner" in r.getMessage()]
    assert link.failures >= 40 and len(said) == 3, said  # lost, another, lost again


@pytest.mark.parametrize("step", [True, 5.7, "5"])
def test_a_step_that_is_not_an_integer_is_refused(step: Any) -> None:
    # int() took True as step 1 and 5.7 as step 5 (a review)
    svc = _service([_Constructor([0], {0: 8}, False), _Constructor([1], {1: 8}, False)])
    with pytest.raises(ValueError, match="step must be a step"):
        svc.state_dict(step)
