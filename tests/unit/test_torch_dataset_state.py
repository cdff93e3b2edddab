"""MsdIterableDataset over a stand-in service (no Dask; the stand-in is patched in where
the dataset connects): its state survives close() and pickling, one timeout does not end
prefetching for good, a dataset dropped without close() lets go of its reader and thread,
and a reader that loaded a state after reading reports that state (found by a review, each
by running it)."""

from __future__ import annotations

import gc
import pickle
import threading
import time
import weakref
from typing import Any
from unittest import mock

import pytest
import torch
from torch.utils.data import DataLoader

from msd_dask.batch import Batch
from msd_dask.errors import ServiceError, ServiceTimeoutError
from msd_dask.torch import MsdIterableDataset

from checks import next_in_a_thread, wait_until


def _batch(step: int) -> Batch:
    z = torch.zeros(1, 4, dtype=torch.long)
    return Batch(step=step, rank=0, input_ids=z, labels=z, position_ids=z,
                 cu_seqlens=[torch.tensor([0, 4], dtype=torch.int32)], documents=[[]],
                 cost=0.0, epochs=[[]])


class _Service:
    """Serves steps after what a reader has (or loaded), once each; may time out once at
    ``fail_once_at``."""

    def __init__(self, fail_once_at: int | None = None):
        self.served = -1
        self.fail_once_at = fail_once_at
        #: refuse a reader that asks for a step served already (as the agent does), instead
        #: of serving it the next one
        self.strict = False
        self.readers: list[Any] = []
        #: a step a reader waits for until it is closed (a slow service), then refuses
        self.stall_at: int | None = None

    def reader(self, rank: int, timeout: float | None = None) -> Any:
        service = self

        class _Reader:
            def __init__(self) -> None:
                self.step: int | None = None
                self.skip = -1
                self.closed = False
                self.woken = threading.Event()

            def state_dict(self) -> dict[str, Any]:
                step = max(-1 if self.step is None else self.step, self.skip)
                return {"rank": rank, "step": step if step >= 0 else None}

            def load_state_dict(self, state: dict[str, Any]) -> None:
                from msd_dask.batch import no_going_back

                if self.step is not None:  # (the readers' rule, as a real one's)
                    no_going_back(state.get("step"), self.state_dict()["step"], rank, "demo")
                if state.get("step") is not None:
                    self.skip = int(state["step"])

            def __iter__(self) -> Any:
                return self

            def __next__(self) -> Batch:
                step = max(service.served, self.skip) + 1
                if service.strict and self.step is None and 0 <= self.skip < service.served:
                    raise ServiceError(f"rank {rank} asked for step {self.skip + 1}, but took "
                                       f"the steps up to {service.served} already")
                if step == service.stall_at:  # (as a real reader: a close ends the wait)
                    self.woken.wait(10)
                    raise ServiceError(f"rank {rank}: the reader is closed")
                if step == service.fail_once_at:
                    service.fail_once_at = None
                    raise ServiceTimeoutError(f"rank {rank} waited 1s for step {step}")
                service.served = self.step = step
                return _batch(step)

            def report_step_time(self, *args: Any, **kwargs: Any) -> None:
                pass

            def close(self) -> None:
                self.closed = True
                self.woken.set()

        reader = _Reader()
        self.readers.append(weakref.ref(reader))
        return reader

    def close(self) -> None:
        pass


@pytest.fixture()
def service(monkeypatch: pytest.MonkeyPatch) -> _Service:
    import msd_dask.service.agent_client as agent_client

    svc = _Service()
    monkeypatch.setattr(agent_client, "connect_agent", lambda name, agent=None, timeout=30.0: svc)
    return svc


@pytest.mark.parametrize("prefetch", [0, 2])
def test_the_position_survives_close_and_pickling(service: _Service, prefetch: int) -> None:
    """``state_dict()`` after ``close()`` (or of a pickled copy) said step None: a checkpoint
    taken then resumed from the start.  A later ``iter()`` goes on after the position."""
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, prefetch=prefetch)
    it = iter(ds)
    assert [next(it)["step"] for _ in range(3)] == [0, 1, 2]
    ds.close()
    assert ds.state_dict() == {"service": "demo", "rank": 0, "step": 2}
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.state_dict() == {"service": "demo", "rank": 0, "step": 2}
    service.served = -1  # (what a new service resumed from that state would serve after it)
    assert next(iter(ds))["step"] == 3
    ds.close()


def test_batches_prefetched_before_a_close_are_handed_out_by_the_next_iter(
        service: _Service) -> None:
    """Closed with batches prefetched, the dataset's next ``iter()`` asked for the step after
    the last one handed out, which the reader had taken already: behind the agent, a refusal
    (a review of the reader path).  They are handed out first, then the new reader goes on
    after them; the state stays the last batch handed out, also in a pickled copy."""
    service.strict = True
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, prefetch=2)
    it = iter(ds)
    assert [next(it)["step"] for _ in range(3)] == [0, 1, 2]
    deadline = time.monotonic() + 5
    while ds.ahead < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # (the prefetch thread takes steps 3 and 4)
    ds.close()
    assert service.served == 4 and ds.state_dict() == {"service": "demo", "rank": 0, "step": 2}
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.state_dict() == {"service": "demo", "rank": 0, "step": 2}
    assert [b["step"] for _, b in zip(range(4), ds, strict=False)] == [3, 4, 5, 6]
    assert ds.state_dict() == {"service": "demo", "rank": 0, "step": 6}
    ds.close()
    # a state loaded into the copy (it carries the batches too): the carried batches right
    # after it stay, others go
    copy.load_state_dict({"rank": 0, "step": 3})
    assert copy.state_dict() == {"service": "demo", "rank": 0, "step": 3}
    assert [b.step for b in copy._carried] == [4]
    copy.load_state_dict({"rank": 0, "step": 1})
    assert copy._carried == [] and copy.state_dict() == {"service": "demo", "rank": 0, "step": 1}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_an_iterator_made_before_a_close_ends_without_another_batch(
        service: _Service, prefetch: int) -> None:
    """An iterator alive across ``close()`` (an evaluation or checkpoint hook closes the
    dataset) went on reading the closed reader: it handed out steps the next ``iter()``
    handed out again (prefetch 0: the first iterator saw 0, 1, 2 and the second 2, 3, ...),
    or past the batches the close kept (prefetch 2: 0, 1, 4, 5, then 2, 3, 4, ...), and
    ``state_dict()`` was not what was handed out (a review).  It ends instead; each step is
    handed out once and in order, and the closed reader is closed."""
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, prefetch=prefetch)
    it = iter(DataLoader(ds, batch_size=None, num_workers=0))
    seen = [next(it)["step"] for _ in range(2)]
    first = service.readers[0]()
    ds.close()
    with pytest.raises(StopIteration):
        next(it)
    with pytest.raises(StopIteration):  # (and stays ended)
        next(it)
    assert seen == [0, 1] and ds.state_dict() == {"service": "demo", "rank": 0, "step": 1}
    again = DataLoader(ds, batch_size=None, num_workers=0)
    seen += [b["step"] for _, b in zip(range(5), again, strict=False)]
    assert seen == [0, 1, 2, 3, 4, 5, 6]
    assert ds.state_dict() == {"service": "demo", "rank": 0, "step": 6}
    assert first is not None and first.closed
    ds.close()


def test_an_iterator_made_before_a_close_and_first_read_after_it_ends(service: _Service) -> None:
    """An iterator was of the generation of its first batch, not of its ``iter()``: made
    before a close and first advanced after it, it connected again and read on beside the
    next ``iter()``'s (left alone in a review; now it ends as one advanced before)."""
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0)
    assert next(iter(ds))["step"] == 0
    early = iter(ds)
    ds.close()
    with pytest.raises(StopIteration):
        next(early)
    assert [b["step"] for _, b in zip(range(2), ds, strict=False)] == [1, 2]
    ds.close()
    with pytest.raises(RuntimeError, match="num_workers=0"):  # (checked at iter(), as before)
        with mock.patch.object(torch.utils.data, "get_worker_info", return_value=object()):
            iter(ds)


def test_closing_while_the_prefetch_thread_waits_for_a_step_is_prompt(service: _Service) -> None:
    """The dataset's close stopped its prefetch thread first, waiting up to 5 s for it, then
    closed the reader: a thread waiting for a slow step held the close for 5 s, and a step
    that came after that wait, before the reader's close, was taken and then dropped (the
    next ``iter()`` was refused behind the agent; a review).  The reader is closed as soon
    as the thread is found waiting, which ends its wait, and no step is lost."""
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, prefetch=2)
    # (set before the reads: the prefetch thread may take step 3 as soon as step 1 is
    # handed out, which in a process at a lower priority it did, before the stall was set)
    service.stall_at = 3
    it = iter(ds)
    assert [next(it)["step"] for _ in range(2)] == [0, 1]
    assert wait_until(lambda: service.served == 2, 5)  # (step 2 taken; it waits for step 3)
    time.sleep(0.1)
    t0 = time.monotonic()
    ds.close()
    assert time.monotonic() - t0 < 2.0
    service.stall_at = None
    assert [b["step"] for _, b in zip(range(3), ds, strict=False)] == [2, 3, 4]
    ds.close()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_loop_waiting_for_a_step_ends_when_another_thread_closes_the_dataset(
        service: _Service, prefetch: int) -> None:
    """A preemption handler (or a watchdog thread) that closes the dataset while the loop
    waits for a slow step: with prefetch the loop's ``next()`` waited for ever (the close
    drained the prefetch thread's last word from the queue the loop waited on), without it
    the loop raised the closed reader's error, where ``close()`` says an iterator made
    before it ends (a review).  It ends; the next ``iter()`` reads on."""
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, prefetch=prefetch)
    service.stall_at = 3
    it = iter(ds)
    assert [next(it)["step"] for _ in range(3)] == [0, 1, 2]
    closer = threading.Timer(0.3, ds.close)
    closer.start()
    waiting, ended = next_in_a_thread(it)
    waiting.join(10)
    closer.join()
    assert not waiting.is_alive(), "the loop still waits for a step after the close"
    assert len(ended) == 1 and isinstance(ended[0], StopIteration), ended
    service.stall_at = None
    assert ds.state_dict()["step"] == 2
    assert [b["step"] for _, b in zip(range(2), ds, strict=False)] == [3, 4]
    ds.close()


def test_a_closed_prefetchers_get_raises_instead_of_waiting() -> None:
    """A ``get()`` after (or waiting across) ``close()`` raises that the prefetcher is closed
    (it waited for ever on the queue the close drained)."""
    from msd_dask.torch import Prefetcher, PrefetcherClosed

    stall = threading.Event()

    def source() -> Any:
        yield 1
        stall.wait(10)
        yield 2

    p = Prefetcher(source(), 2)
    assert p.get(timeout=5) == 1
    assert p.close(timeout=0.2, wake=stall.set) in ([], [2])
    with pytest.raises(PrefetcherClosed):
        p.get(timeout=5)


def test_a_state_loaded_after_a_close_is_the_datasets_until_the_next_batch(
        service: _Service) -> None:
    """A prefetching dataset that handed out steps 0-2, was closed and loaded the state of
    step 10 said step 2 again once its next ``iter()`` had started prefetching, until the
    next batch came: a checkpoint taken then went back to step 2 (a review)."""
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, prefetch=2)
    it = iter(ds)
    assert [next(it)["step"] for _ in range(3)] == [0, 1, 2]
    ds.close()
    ds.load_state_dict({"service": "demo", "rank": 0, "step": 10})
    assert ds.state_dict()["step"] == 10
    service.stall_at = 11  # (the next step is slow to come: the loop waits for it)
    loop = threading.Thread(target=lambda: next(iter(ds), None), daemon=True)
    loop.start()
    assert wait_until(lambda: ds._prefetcher is not None, 5)
    assert ds.state_dict()["step"] == 10
    ds.close()
    loop.join(10)
    assert ds.state_dict()["step"] == 10


@pytest.mark.parametrize("rank", [3.7, True, "3"])
def test_a_rank_that_is_no_integer_is_refused(rank: Any) -> None:
    """``int(rank)`` read rank 3 for 3.7 and rank 1 for True, where a reader refuses both
    (a review)."""
    with pytest.raises(ValueError, match=f"rank must be an integer, got {rank!r}"):
        MsdIterableDataset("tcp://198.18.0.1:8786", "demo", rank)


@pytest.mark.parametrize("kwargs, message", [
    ({"steps": -1}, r"steps must be a whole number >= 0 \(batches per iter\(\)\) or None, got -1"),
    ({"steps": 2.5}, r"steps must be a whole number >= 0 .*, got 2\.5"),
    ({"steps": "2"}, r"steps must be a whole number >= 0 .*, got '2'"),
    ({"prefetch": 2.7}, r"prefetch must be a whole number from 0 to 16, got 2\.7$"),
    ({"prefetch": -1}, r"prefetch must be a whole number from 0 to 16, got -1$"),
])
def test_steps_and_prefetch_that_are_no_counts_are_refused(kwargs: dict[str, Any],
                                                           message: str) -> None:
    """``steps=-1`` yielded nothing, ``steps=2.5`` three batches, ``steps="2"`` a
    ``TypeError`` at the first batch naming nothing, ``prefetch=2.7`` was read as 2 (a
    review): one ``ValueError`` naming the argument, when the dataset is made."""
    with pytest.raises(ValueError, match=message):
        MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, **kwargs)


def test_steps_counts_the_batches_of_each_iter(service: _Service) -> None:
    """``steps=2``: two batches per ``iter()``, then the next two (a numpy count too)."""
    import numpy as np

    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, steps=np.int64(2))
    assert [b["step"] for b in ds] == [0, 1] and [b["step"] for b in ds] == [2, 3]
    ds.close()


def test_one_timeout_does_not_end_prefetching(service: _Service) -> None:
    """The reader times out once at step 2: the loop sees the timeout once and reads on
    with the next ``iter()`` (prefetching used to raise it on every later call)."""
    service.fail_once_at = 2
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, prefetch=2)
    steps: list[int] = []
    timeouts = 0
    while len(steps) < 5:
        try:
            for b in ds:
                steps.append(b["step"])
                if len(steps) == 5:
                    break
        except ServiceTimeoutError:
            timeouts += 1
    assert steps == [0, 1, 2, 3, 4] and timeouts == 1
    ds.close()


def test_a_dataset_dropped_without_close_lets_go_of_its_reader(service: _Service) -> None:
    for _ in range(3):  # e.g. a dataset per evaluation, never closed
        ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0, prefetch=2)
        next(iter(ds))
        del ds
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        gc.collect()
        threads = [t for t in threading.enumerate() if t.name.startswith("msd-prefetch-demo")]
        if not threads and all(r() is None for r in service.readers):
            break
        time.sleep(0.1)
    assert not threads and all(r() is None for r in service.readers)


def test_a_reader_that_loads_a_state_after_reading_reports_it() -> None:
    """A reader that read steps 0-3 and then loaded the state of step 10 said step 3 until
    its next batch: a checkpoint then would resume at 4, not 11."""
    reader = _reader_at(3)
    reader.load_state_dict({"rank": 0, "step": 10})
    assert reader.state_dict() == {"service": "demo", "rank": 0, "step": 10}


@pytest.mark.parametrize("state", [{"rank": 0, "step": -3}, {"rank": 0, "step": True},
                                   {"rank": 0, "step": 2, "bogus": 1}, {"rank": 1, "step": 2}])
def test_a_bad_state_is_refused_when_loaded_not_at_iter(state: dict[str, Any]) -> None:
    # the dataset kept such a state and gave it back from state_dict() (into a checkpoint);
    # only the reader made at iter() refused it (a review)
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0)
    with pytest.raises(ValueError):
        ds.load_state_dict(state)
    assert ds.state_dict() == {"service": "demo", "rank": 0, "step": None}


def _reader_at(step: int | None, skip: int = -1) -> Any:
    """A reader that returned the steps up to ``step`` and loaded ``skip`` (its state alone:
    no service behind it)."""
    from types import SimpleNamespace

    from msd_dask.reader import Reader, _Progress

    reader = Reader.__new__(Reader)
    reader._progress = _Progress()
    reader.link = SimpleNamespace(name="demo")  # type: ignore[assignment]
    reader.rank, reader.step, reader._skip_through = 0, step, skip
    return reader


def test_a_reader_that_returned_batches_refuses_an_older_state_naming_both_steps() -> None:
    """A reader that returned steps 0-3 and then loaded the state of step 1 kept going from
    step 4 and still said step 3, with no error: the loop believed it had gone back (a
    review).  The service serves each step once, so the reader cannot go back: it refuses,
    naming both steps and what to do, and stays where it was."""
    reader = _reader_at(3)
    with pytest.raises(ServiceError, match=r"rank 0: a reader at step 3 cannot load the state "
                       r"of step 1: .* service 'demo' serves each step once; load a state "
                       r"before its first next\(\) .* DataService.state_dict\(1\)"):
        reader.load_state_dict({"rank": 0, "step": 1})
    assert reader.state_dict() == {"service": "demo", "rank": 0, "step": 3}
    with pytest.raises(ServiceError, match=r"at step 3 cannot load a state of no step"):
        reader.load_state_dict({"rank": 0, "step": None})
    reader.load_state_dict({"rank": 0, "step": 3})  # its own state: nothing changes
    assert reader.state_dict() == {"service": "demo", "rank": 0, "step": 3}
    reader.load_state_dict({"rank": 0, "step": 10})  # later: skips ahead, as documented
    assert reader.state_dict() == {"service": "demo", "rank": 0, "step": 10}
    with pytest.raises(ServiceError, match=r"a reader at step 10 cannot load the state of "
                                           r"step 5"):
        reader.load_state_dict({"rank": 0, "step": 5})
    assert reader.state_dict() == {"service": "demo", "rank": 0, "step": 10}


def test_a_reader_takes_any_state_before_its_first_batch() -> None:
    """Before its first ``next()`` a reader's position is the state loaded last, earlier
    ones included (e.g. after the state of the rank's earlier reader in this process): the
    service refuses the next read if it handed those steps already; a state of no step
    too."""
    reader = _reader_at(None, skip=9)
    reader.load_state_dict({"rank": 0, "step": 4})
    assert reader.state_dict() == {"service": "demo", "rank": 0, "step": 4}
    reader.load_state_dict({"rank": 0, "step": None})
    assert reader.state_dict() == {"service": "demo", "rank": 0, "step": None}


def test_an_older_state_is_refused_and_the_reader_reads_on() -> None:
    """Over a real constructor: rank 0 read steps 0-2; the state of step 0 is refused at
    once (nothing sent) and the reader still reads step 3 next, once."""
    import asyncio

    from test_constructor_bookkeeping import _toy_round
    from test_lost_answer import MEMBERS, _serving_on_a_loop

    from msd_dask.reader import Reader

    with _serving_on_a_loop() as link:
        link.claims = 2  # (no answer lost here)
        reader = Reader(link, 0, timeout=10.0)  # type: ignore[arg-type]
        assert [next(reader).step for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ServiceError, match=r"rank 0: a reader at step 2 cannot load the "
                                               r"state of step 0"):
            reader.load_state_dict({"rank": 0, "step": 0})
        asyncio.run_coroutine_threadsafe(link.constructors[0].obj.submit(
            _toy_round(MEMBERS, [3])), link.loop).result(10)
        batch = next(reader)
        assert batch.step == 3 and int(batch.input_ids[0, 0]) == 30
        reader.close()


def test_a_dataset_that_handed_out_batches_refuses_an_older_state(service: _Service) -> None:
    """The dataset's reader returned steps 0-2: the state of step 0 was passed on to it and
    ignored.  The reader's refusal (the stand-in follows the readers' rule) reaches the
    caller, naming both steps, and the dataset stays where it was; its own state and later
    ones are taken; before the first ``iter()`` any state is."""
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0)
    it = iter(ds)
    assert [next(it)["step"] for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ServiceError, match=r"rank 0: a reader at step 2 cannot load "
                       r"the state of step 0: .* service 'demo' serves each step once; load "
                       r"a state before its first next\(\) .* DataService.state_dict\(0\)"):
        ds.load_state_dict({"rank": 0, "step": 0})
    with pytest.raises(ServiceError, match="at step 2 cannot load a state of no step"):
        ds.load_state_dict({"rank": 0, "step": None})
    assert ds.state_dict() == {"service": "demo", "rank": 0, "step": 2}
    ds.load_state_dict(ds.state_dict())
    assert next(it)["step"] == 3
    ds.load_state_dict({"rank": 0, "step": 5})
    assert ds.state_dict() == {"service": "demo", "rank": 0, "step": 5} and next(it)["step"] == 6
    ds.close()
    fresh = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0)
    fresh.load_state_dict({"rank": 0, "step": 8})
    fresh.load_state_dict({"rank": 0, "step": 7})  # (not connected: the last one counts)
    assert fresh.state_dict() == {"service": "demo", "rank": 0, "step": 7} and next(iter(fresh))["step"] == 8
    fresh.close()


@pytest.mark.parametrize("refused", ["reader", "state"])
def test_an_iter_whose_reader_is_refused_closes_the_handle_it_opened(
        monkeypatch: pytest.MonkeyPatch, refused: str) -> None:
    """``iter()`` whose reader the service refused (a rank outside the world, one the agent
    does not serve), or whose reader refused the state loaded before: the handle just
    opened (a ``DataService`` with a Dask client of its own) was kept and replaced, never
    closed, by the next ``iter()``'s, a client leaked per failed ``iter()`` (a review of
    the torch adapter); a reader that refused the state was kept too, and the next
    ``iter()`` read from it without the state.  Each handle is closed, each ``iter()``
    tries again, and the state loaded stays the dataset's."""
    import msd_dask.service.agent_client as agent_client

    opened: list[_Service] = []
    closed: list[_Service] = []

    class _Refusing(_Service):
        def reader(self, rank: int, timeout: float | None = None) -> Any:
            if refused == "reader":
                raise ValueError(f"rank {rank} is outside [0, 4) for parallel dp=4")
            reader = super().reader(rank, timeout)

            def load_state_dict(state: dict[str, Any]) -> None:
                raise ServiceError(f"rank {rank}: the service refuses the state of step "
                                   f"{state['step']}")

            reader.load_state_dict = load_state_dict
            return reader

        def close(self) -> None:
            closed.append(self)

    def connect(name: str, agent: Any = None, timeout: float = 30.0) -> _Service:
        opened.append(_Refusing())
        return opened[-1]

    monkeypatch.setattr(agent_client, "connect_agent", connect)
    ds = MsdIterableDataset("tcp://198.18.0.1:8786", "demo", 0)
    ds.load_state_dict({"rank": 0, "step": 3})
    for _ in range(3):
        with pytest.raises(ValueError if refused == "reader" else ServiceError):
            next(iter(ds))
    assert len(opened) == 3 and closed == opened
    assert ds.state_dict() == {"service": "demo", "rank": 0, "step": 3}
    ds.close()  # (nothing of its own left to close)
    assert closed == opened
