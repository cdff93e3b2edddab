"""What a reader tells its constructor about the steps it returned, without Dask: the
process's reporter sends nothing while a loop keeps reading and one report per pause, and
a constructor keeps what a claim taught it over a report that arrives late."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

from msd_dask import reader as reader_module
from msd_dask.reader import IDLE_FACTOR, IDLE_GAPS, REPORT_IDLE, _Reporter, idle_time
from msd_dask.roles.constructor import DataConstructor


class FakeReader:
    """What the reporter uses of a :class:`~msd_dask.reader.Reader`: it counts reports."""

    def __init__(self, reporter: _Reporter):
        self.reporter = reporter
        self.returned_at = 0.0
        self.report_pending = False
        self.report_after = REPORT_IDLE
        self.reports = 0

    def next(self) -> None:  # as Reader.__next__ does after a batch
        self.returned_at = time.monotonic()
        if not self.report_pending:
            self.reporter.pending(self)

    def report_returned(self) -> None:
        self.reports += 1


def _until(check: object, timeout: float) -> None:
    """Wait until ``check()`` holds, polled every 10 ms; fail after ``timeout`` (a loaded
    machine's thread wakes late: the bound is generous, the order is what counts)."""
    t0 = time.monotonic()
    while not check():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout, f"not within {timeout}s"
        time.sleep(0.01)


def test_no_report_while_reading_one_per_pause() -> None:
    reporter = _Reporter()
    readers = [FakeReader(reporter) for _ in range(3)]
    end = time.monotonic() + 2.5 * REPORT_IDLE
    while time.monotonic() < end:  # a loop that asks every 50 ms: nothing sent
        for r in readers:
            r.next()
        time.sleep(0.05)
    assert [r.reports for r in readers] == [0, 0, 0]
    # the loops stop: one report each, once they were idle REPORT_IDLE
    _until(lambda: [r.reports for r in readers] == [1, 1, 1], REPORT_IDLE + 10)
    assert min(time.monotonic() - r.returned_at for r in readers) >= REPORT_IDLE - 0.02
    time.sleep(REPORT_IDLE)  # and no more while they stay stopped
    assert [r.reports for r in readers] == [1, 1, 1]
    readers[0].next()  # one resumes and stops again: one more from it
    _until(lambda: [r.reports for r in readers] == [2, 1, 1], REPORT_IDLE + 10)
    assert time.monotonic() - readers[0].returned_at >= REPORT_IDLE - 0.02


def test_a_reader_waits_longer_when_its_loop_is_slower() -> None:
    """A loop whose steps take longer than REPORT_IDLE reports only when it stops, not after
    every step: the idle time follows the median of the reader's recent gaps."""
    assert idle_time([]) == REPORT_IDLE
    assert idle_time([5.0] * (IDLE_GAPS - 1)) == REPORT_IDLE  # too few gaps to tell
    assert idle_time([0.01] * IDLE_GAPS) == REPORT_IDLE  # fast loops: the floor
    slow = [3.0] * (IDLE_GAPS - 1) + [600.0]  # 3 s steps, one long checkpoint among them
    assert idle_time(slow) == IDLE_FACTOR * 3.0
    assert idle_time([0.01] * 20 + [3.0] * IDLE_GAPS) == IDLE_FACTOR * 3.0  # the last ones count
    reporter = _Reporter()
    slow_reader = FakeReader(reporter)
    slow_reader.report_after = idle_time([1.0] * IDLE_GAPS)  # 3 s
    for _ in range(3):  # steps of 1.2 s: longer than REPORT_IDLE, no report
        slow_reader.next()
        time.sleep(1.2)
    assert slow_reader.reports == 0
    # stopped: one report, once idle for its 3 s
    _until(lambda: slow_reader.reports == 1, 10.0)
    assert time.monotonic() - slow_reader.returned_at >= 3.0 - 0.02


def test_constructor_counts_claims_and_pauses() -> None:
    con = DataConstructor("unit", 0, {0: [0, 1]}, 8, 0, prefetch=4)

    async def run() -> None:
        con._raise_returned(0, 2, "claim")  # claimed steps 3-5: returned 0-2, and now 3
        await con.returned_through(0, 4)  # paused after step 4
        assert (con.returned[0], con.returned_by[0], con.reports) == (4, "pause", 1)
        con._raise_returned(0, 5, "claim")  # resumed: claimed 6-8
        await con.returned_through(0, 5)  # a report sent before the claim, arriving after
        assert (con.returned[0], con.returned_by[0]) == (5, "claim")
        await con.returned_through(7, 9)  # not a member: ignored
        assert 7 not in con.returned and con.reports == 2
        assert (await con.stats())["returned_by"] == {0: "claim"}

    asyncio.run(run())


def test_constructor_keeps_an_agents_pause_over_its_claims_ahead() -> None:
    """A host agent claims ahead of its ranks, telling what they took (``"taken"``): a claim
    of the step its ranks paused at, before or after its report, leaves the report (its
    ranks did not move); a claim of a later step counts."""
    con = DataConstructor("unit", 0, {0: [0, 1]}, 8, 0, prefetch=4)

    async def run() -> None:
        con._raise_returned(0, 3, "taken")  # the agent read ahead; its ranks took step 3
        await con.returned_through(0, 3)  # they stopped there: its report
        assert (con.returned[0], con.returned_by[0]) == (3, "pause")
        con._raise_returned(0, 3, "taken")  # it reads on while they stay stopped
        assert (con.returned[0], con.returned_by[0]) == (3, "pause")
        con._raise_returned(0, 4, "taken")  # they resumed
        assert (con.returned[0], con.returned_by[0]) == (4, "taken")
        con._raise_returned(0, 2, "taken")  # a claim sent earlier, arriving late
        assert con.returned[0] == 4

    asyncio.run(run())


def test_a_forked_child_starts_with_its_own_reporter() -> None:
    """A DataLoader worker forked while the parent's reporter watches a reader and holds
    its lock gets no reader of the parent's and a lock it can take."""
    parent = FakeReader(reader_module._REPORTER)
    parent.next()
    with reader_module._REPORTER._cond:
        pid = os.fork()
        if pid == 0:  # the child: report what it inherited through its exit code
            rep = reader_module._REPORTER
            ok = not rep._readers and rep._thread is None and rep._cond.acquire(timeout=1)
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert reader_module._REPORTER._readers  # the parent's is untouched



def test_a_group_reader_reports_what_its_ranks_took_while_it_waits(monkeypatch: Any) -> None:
    """The agent's reader of a group read steps 0-3 ahead of its ranks and then waited on
    the service; its ranks took step 0, the reporter told the constructor so once the
    reader paused, and the ranks then took steps 1-3 and stopped (a checkpoint): nothing
    told the constructor, so ``consumed_step()`` and the default state stayed at step 0
    (a review of the reader path).  A step taken re-registers the reader."""
    from msd_dask.core.config import parse_config
    from msd_dask.service.agent import AgentGroupReader, WireBatch

    from corpus import config as config_dict

    reports: list[int] = []
    monkeypatch.setattr(reader_module, "_report",
                        lambda link, c, rank, ranks, step, progress: reports.append(step))

    class Link:  # what a reader uses of its link to the planner here
        config = parse_config(config_dict("/nonexistent", name="report", timeout=60,
                                          parallel={"dp": 2, "tp": 2}))
        name, closed = "report", False
        constructors = [type("C", (), {"key": "c0"})()]
        handles = (0, constructors)

        def on_new_generation(self, f: object) -> None:
            pass

    gate, rounds = threading.Event(), []

    def next_round(self: AgentGroupReader) -> list[WireBatch]:
        rounds.append(1)
        if len(rounds) == 1:
            return [WireBatch({"step": s}) for s in range(4)]
        gate.wait(30)  # the service is slow: the round after step 3 is not built yet
        return [WireBatch({"step": 4})]

    monkeypatch.setattr(AgentGroupReader, "_next_round", next_round)
    reader = AgentGroupReader(Link(), 0, timeout=60, also=[1])
    try:
        for _ in range(4):
            next(reader)  # the agent reads steps 0-3 ahead of its ranks
        reader.mark_taken(0)
        threading.Thread(target=next, args=(reader,), daemon=True).start()  # waits for 4
        _until(lambda: reports == [0], REPORT_IDLE + 10)  # the reader paused
        reader.mark_taken(3)  # its ranks take steps 1-3 and stop
        _until(lambda: reports[-1:] == [3], REPORT_IDLE + 10)
    finally:
        gate.set()
