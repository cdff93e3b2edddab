"""A claim's answer lost on its way (the connection to the constructor failed after the
constructor handed the round over): the reader asks again and gets the same round, so the
rank still reads every step once.  It used to get the round after: the lost round's steps
never reached the rank, and nothing said so."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from test_constructor_bookkeeping import _serving

from msd_dask.core.config import parse_config
from msd_dask.core.packing import from_wire
from msd_dask.errors import ServiceTimeoutError
from msd_dask.reader import Reader
from msd_dask.roles.constructor import DataConstructor

MEMBERS = {0: [0, 1], 1: [2, 3]}


async def _closed(con: DataConstructor) -> None:
    """Close ``con`` and let its builder task end."""
    task = con._task
    await con.close()
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)


def test_a_claim_that_lacks_the_last_round_gets_it_again() -> None:
    """Rank 0 is handed step 0, then claims again still saying it has nothing: it gets
    step 0 again, with the same content; once it says it has step 0, step 1; its group's
    other rank is not affected."""

    async def run() -> None:
        con = await _serving(MEMBERS, 3)
        first = await con.next_round(0, -1)
        again = await con.next_round(0, -1)
        assert first["steps"] == again["steps"] == [0]
        a, b = from_wire(first["payloads"][0]), from_wire(again["payloads"][0])
        assert (a["input_ids"] == b["input_ids"]).all() and a["input_ids"][0, 0] == 0
        assert (await con.stats())["rounds_resent"] == 1
        assert (await con.next_round(0, 0))["steps"] == [1]
        assert (await con.next_round(1, -1))["steps"] == [0]  # rank 1's own claim
        # a report that rank 0 has step 1 forgets its round: a claim saying less is no retry
        await con.returned_through(0, 1)
        assert con._last_round.get(0) is None
        await _closed(con)

    asyncio.run(run())


class _Handle:
    def __init__(self, obj: Any, key: str):
        self.obj, self.key = obj, key


class _Link:
    """What a reader needs of its service's link, over one constructor on an event loop of
    its own thread; the second claim's answer is lost after the constructor answered."""

    def __init__(self, loop: asyncio.AbstractEventLoop, con: DataConstructor):
        self.loop = loop
        self.name = "lost"
        self.closed = False
        self.generation = 0
        self.config = parse_config({"name": "lost", "batch": {"seq_len": 8}, "parallel": {
            "dp": 2, "tp": 2}, "sources": [{"name": "toy", "uri": "mem://toy/*.parquet",
                                             "format": "parquet"}]})
        self.planner = _Handle(None, "planner")
        self.constructors = [_Handle(con, "con-0")]
        self.handles = (0, self.constructors)
        self.claims = 0
        self.client = SimpleNamespace(id="Client-of-the-test")  # (a reader names it)

    def on_new_generation(self, listener: Any) -> None:
        pass

    def send(self, handle: _Handle, method: Any, *args: Any, **kwargs: Any) -> Any:
        if self.closed:  # (as a closed service's link: its loop is gone)
            from msd_dask.errors import ServiceError

            raise ServiceError("closed")
        fut = asyncio.run_coroutine_threadsafe(method(handle.obj, *args, **kwargs), self.loop)
        if method is DataConstructor.next_round_packed:
            self.claims += 1
            if self.claims == 2:
                fut.result(10)  # the constructor answered (and handed the round over) ...
                lost: concurrent.futures.Future[Any] = concurrent.futures.Future()
                lost.set_exception(ConnectionResetError("the answer was lost on its way"))
                return lost  # ... and the answer never arrived
        return fut

    def refresh(self, max_age: float = 0.0, timeout: float | None = None) -> None:
        pass

    def announce_generation(self) -> None:
        pass

    def planner_lost(self, *, confirm: bool = False) -> bool:
        return False

    def scheduler_lost(self) -> str | None:
        return None


@contextmanager
def _serving_on_a_loop() -> Iterator[_Link]:
    """A constructor serving 3 rounds of one step (:func:`_serving`) on an event loop of
    its own thread, behind a :class:`_Link`; closed after the block."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        con = asyncio.run_coroutine_threadsafe(_serving(MEMBERS, 3), loop).result(30)
        link = _Link(loop, con)
        yield link
        link.closed = True
        asyncio.run_coroutine_threadsafe(_closed(con), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_a_reader_whose_answer_was_lost_reads_every_step_once() -> None:
    with _serving_on_a_loop() as link:
        reader = Reader(link, 0, timeout=20.0)  # type: ignore[arg-type]
        batches = [next(reader) for _ in range(3)]
        assert [b.step for b in batches] == [0, 1, 2]
        # each step's row of DP rank 0 (the toy constructor's row 10 * step)
        assert [int(b.input_ids[0, 0]) for b in batches] == [0, 10, 20]
        con = link.constructors[0].obj
        stats = asyncio.run_coroutine_threadsafe(con.stats(), link.loop).result(10)
        assert stats["rounds_resent"] == 1 and link.claims == 4


def test_a_timed_out_reader_names_the_step_after_its_loaded_state() -> None:
    """A reader that loaded a state (resumed after step 41) and finds nothing names step 42
    in its timeout, as does one that read steps 0-2 and then loaded step 9 (step 10); it
    used to say "the first step" and "step 3"."""
    with _serving_on_a_loop() as link:
        link.claims = 2  # (no answer lost here)
        resumed = Reader(link, 0, timeout=0.5)  # type: ignore[arg-type]
        resumed.load_state_dict({"rank": 0, "step": 41})
        with pytest.raises(ServiceTimeoutError, match="rank 0 waited 0s for step 42 "):
            next(resumed)
        reader = Reader(link, 2, timeout=0.5)  # type: ignore[arg-type]
        assert [next(reader).step for _ in range(3)] == [0, 1, 2]
        reader.load_state_dict({"rank": 2, "step": 9})
        with pytest.raises(ServiceTimeoutError, match="rank 2 waited 0s for step 10 "):
            next(reader)


def test_a_claim_left_waiting_by_its_reader_takes_no_round() -> None:
    """The reader's claim waits on the constructor, its connection fails, the reader claims
    again: the first call still runs on the constructor (Dask does not cancel a handler
    whose comm closed).  It used to take the next round posted, its answer going nowhere,
    and the retry got the round after (the rank never read step 0, and nothing said so)."""
    from test_constructor_bookkeeping import _serving, _toy_round

    async def run() -> tuple[Any, Any, Any]:
        con = await _serving(MEMBERS, 0)
        orphan = asyncio.create_task(con.next_round(0, -1, wait=10.0))
        await asyncio.sleep(0.05)
        retry = asyncio.create_task(con.next_round(0, -1, wait=10.0))
        await asyncio.sleep(0.05)
        for step in range(2):
            await con.submit(_toy_round(MEMBERS, [step]))
        got = await asyncio.gather(orphan, retry)
        after = await con.next_round(0, 0)
        await _closed(con)
        return got[0], got[1], after

    orphan, retry, after = asyncio.run(run())
    assert orphan is None
    assert retry["steps"] == [0] and after["steps"] == [1]


def test_close_ends_a_next_waiting_in_another_thread() -> None:
    """A reader closed while another thread's ``next()`` waits for a round: that ``next()``
    raises that the reader is closed once its claim comes back (it ran out the reader's
    whole timeout, or returned a batch after ``close()``), and the round posted meanwhile
    goes to the rank's next reader."""
    import time

    from test_constructor_bookkeeping import _toy_round

    from msd_dask.errors import ServiceError

    with _serving_on_a_loop() as link:
        link.claims = 2  # (no answer lost here)
        con = link.constructors[0].obj
        for step in range(3):  # rank 0 takes steps 0-2; nothing more is posted yet
            asyncio.run_coroutine_threadsafe(con.next_round(0, step - 1), link.loop).result(10)
        reader = Reader(link, 0, timeout=60.0)  # type: ignore[arg-type]
        reader.load_state_dict({"rank": 0, "step": 2})
        outcome: list[Any] = []

        def wait() -> None:
            try:
                outcome.append(next(reader))
            except ServiceError as e:
                outcome.append(e)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        reader.close()
        asyncio.run_coroutine_threadsafe(con.submit(_toy_round(MEMBERS, [3])),
                                         link.loop).result(10)
        waiter.join(30)
        assert not waiter.is_alive()
        assert isinstance(outcome[0], ServiceError) and "the reader is closed" in str(outcome[0])
        assert time.monotonic() - t0 < 10
        again = Reader(link, 0, timeout=10.0)  # type: ignore[arg-type]
        again.load_state_dict({"rank": 0, "step": 2})
        assert next(again).step == 3
        again.close()


def test_a_reader_dropped_without_close_reports_its_last_step() -> None:
    """``for batch in svc.reader(rank): ... break``: the reader is garbage-collected right
    after the loop.  Nothing reported its last step, so ``DataService.state_dict()`` could
    not tell it was returned and refused, though every rank had returned it (review)."""
    import gc
    import time

    with _serving_on_a_loop() as link:
        link.claims = 2  # (no answer lost here)
        con = link.constructors[0].obj
        for batch in Reader(link, 0, timeout=10.0):  # type: ignore[arg-type]
            if batch.step == 1:
                break
        gc.collect()
        deadline = time.monotonic() + 5
        while con.returned.get(0, -1) < 1:  # (the report is fire and forget)
            assert time.monotonic() < deadline, f"rank 0 reported {con.returned.get(0)}"
            time.sleep(0.05)
        assert con.returned[0] == 1 and con.returned_by[0] == "pause"


def test_a_rank_restarted_from_an_older_state_is_told_its_steps_are_gone() -> None:
    """A rank handed steps 0-2 restarts from the state of step 0 against the running
    service: steps 1-2 are not served again (each step is served once).  It got step 3
    next, silently; it is told (review), at once, with nothing posted to it yet (it used to
    be told only once step 3 was posted, which waits for room that the other DP group's
    ranks may hold: a CI run waited out its timeout), and step 3 is not lost with the
    error: the state it names reads on from there."""
    import time

    from test_constructor_bookkeeping import _toy_round

    from msd_dask.errors import ServiceError

    with _serving_on_a_loop() as link:
        link.claims = 2  # (no answer lost here)
        con = link.constructors[0].obj
        first = Reader(link, 0, timeout=10.0)  # type: ignore[arg-type]
        assert [next(first).step for _ in range(3)] == [0, 1, 2]
        again = Reader(link, 0, timeout=10.0)  # type: ignore[arg-type]
        again.load_state_dict({"rank": 0, "step": 0})
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match=r"asked service 'lost' for step 1, but the "
                                               r"service had handed this rank the steps up to "
                                               r"2 already .* load the state of step 2 or "):
            next(again)
        assert time.monotonic() - t0 < 5.0  # (not the reader's 10 s timeout)
        asyncio.run_coroutine_threadsafe(con.submit(_toy_round(MEMBERS, [3])),
                                         link.loop).result(10)
        resumed = Reader(link, 0, timeout=10.0)  # type: ignore[arg-type]
        resumed.load_state_dict({"rank": 0, "step": 2})
        batch = next(resumed)
        assert batch.step == 3 and int(batch.input_ids[0, 0]) == 30
        first.close()


def test_a_claim_from_before_the_steps_handed_is_answered_at_once() -> None:
    """The constructor answers a claim whose ``done`` is before the last step it handed
    the rank (not a retry of its last round) with that step, without waiting for a round:
    rank 0 had steps 0-2, nothing more is posted; a claim from step 0 is answered
    ``handed: 2``, and so is a new reader's with no state (``done`` -1: it went on after
    the steps handed to the earlier reader, which may have held them unread); a retry of
    the last round is not."""
    import time

    from test_constructor_bookkeeping import _serving

    async def run() -> None:
        con = await _serving(MEMBERS, 3)
        for step in range(3):
            assert (await con.next_round(0, step - 1))["steps"] == [step]
        t0 = time.monotonic()
        answer = await con.next_round(0, 0, wait=5.0)
        assert answer == {"handed": 2, "g": con.generation}
        assert time.monotonic() - t0 < 2.0
        assert (await con.next_round(0, 1))["steps"] == [2]  # the last round: a retry
        assert await con.next_round(0, -1, wait=0.2) == {"handed": 2, "g": con.generation}
        await _closed(con)

    asyncio.run(run())


class _LostLink(_Link):
    """A link whose constructor's worker is gone (every claim fails at once) and whose look
    for a re-created one times out; it records the bound each look was given."""

    def __init__(self) -> None:
        super().__init__(None, None)  # type: ignore[arg-type]
        self.bounds: list[float | None] = []

    def send(self, handle: _Handle, method: Any, *args: Any, **kwargs: Any) -> Any:
        lost: concurrent.futures.Future[Any] = concurrent.futures.Future()
        lost.set_exception(ConnectionResetError("its worker is gone"))
        return lost

    def refresh(self, max_age: float = 0.0, timeout: float | None = None) -> None:
        self.bounds.append(timeout)
        raise ServiceTimeoutError("the planner of service 'lost' did not answer within 0.1s")


def test_a_look_for_roles_past_the_readers_deadline_raises_the_readers_timeout() -> None:
    """A reader's look for re-created roles is bounded by what is left of the reader's own
    timeout, not by the config's (300 s); past the reader's deadline its error is the
    rank's own timeout, naming what it waited for, with the look's error as its cause."""
    link = _LostLink()
    reader = Reader(link, 0, timeout=0.3)  # type: ignore[arg-type]
    with pytest.raises(ServiceTimeoutError, match="rank 0 waited 0s for the first step of "
                       "service 'lost'") as info:
        next(reader)
    assert isinstance(info.value.__cause__, ServiceTimeoutError)
    assert "did not answer within 0.1s" in str(info.value.__cause__)
    assert link.bounds and all(b is not None and b <= 0.3 for b in link.bounds), link.bounds
