"""Reader: the iterator a training rank reads its batches with.

A rank asks the constructor of its DP rank for its next round of steps, and gets
their tensors in the answer
(:meth:`~msd_dask.roles.constructor.DataConstructor.next_round`: one call, peer to
peer, that the constructor holds until a round is built); it hands them out one
step at a time.  Nothing per step passes through the scheduler.  It follows the
service to a re-created planner or constructor, and the constructor skips the
steps the rank already has (:meth:`Reader.load_state_dict`).

A reader that pauses tells its constructor the last step it returned: a claim
tells it only that the rank returned every step before the round (a host agent's
reader, which claims ahead of its ranks, tells what they took instead).  When a reader
has returned a step its constructor does not know of and is not asked for the
next batch for :data:`REPORT_IDLE` seconds, one daemon thread per process sends
that step (one fire-and-forget call,
:meth:`~msd_dask.roles.constructor.DataConstructor.returned_through`).  A
training loop that keeps asking sends nothing; one that stops (a checkpoint, a
barrier, an evaluation) sends one call.  :meth:`DataService.state_dict` counts it.

A reader reads through a :class:`ServiceLink` (what it needs from its service;
:class:`~msd_dask.service.link.PlannerLink` is the one :meth:`DataService.reader` hands it).

The constructor's module (and :mod:`statistics`) is imported where a reader first uses
it: a training process reading through a host agent imports this module with
:mod:`msd_dask.service` but never calls a constructor (every module it imports costs
each training process memory).
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from msd_dask.batch import (
    Batch,
    check_rank,
    check_world_size,
    loaded_step,
    no_going_back,
    rank_number,
    reader_state,
    step_time,
    wait_seconds,
)
from msd_dask.core.config import Config
from msd_dask.core.packing import from_wire
from msd_dask.errors import (
    CLOSED_NOTICES,
    RESTART_HINT,
    TRIAL_HINT,
    ServiceError,
    ServiceTimeoutError,
    first_of,
)

__all__ = ["REPORT_IDLE", "Reader", "ServiceLink", "idle_time"]

#: seconds a reader waits, after returning a step its constructor does not know of,
#: for the next ``next()`` before it reports that step (:class:`_Reporter`)
REPORT_IDLE = 1.0
#: a reader reports after ``max(REPORT_IDLE, IDLE_FACTOR x`` the median of its last
#: ``IDLE_GAPS`` gaps between batches``)``: a training loop whose steps take longer
#: than ``REPORT_IDLE`` does not report after every step, only when it stops
IDLE_FACTOR = 3.0
IDLE_GAPS = 8
#: a request for a round not answered ``CLAIM_WAIT`` seconds after the constructor's
#: own wait (:data:`~msd_dask.roles.constructor.POLL`) looks for a re-created
#: constructor (one look per process and ``CLAIM_WAIT`` seconds), then after twice as
#: long, up to every ``CLAIM_WAIT_MAX`` seconds
CLAIM_WAIT = 2.0
CLAIM_WAIT_MAX = 8.0
#: seconds the readers of a process share one look at the roles when they time out (the
#: look asks the planner and every constructor: thousands of ranks timing out together
#: would each ask them all), and the longest the look waits for the roles' answers
DIAGNOSIS_AGE = 10.0
DIAGNOSIS_WAIT = 5.0

_diagnoses: weakref.WeakKeyDictionary[Any, tuple[float, str]] = weakref.WeakKeyDictionary()
_diagnosing = threading.Lock()


def _look_at_roles(link: Any) -> str:
    """What the planner and each constructor of ``link`` say they do or wait for, asked all
    at once and waited for at most :data:`DIAGNOSIS_WAIT` seconds (a role that does not
    answer by then is named as such)."""
    deadline = time.monotonic() + DIAGNOSIS_WAIT
    parts = []
    try:
        asked = [("planner", link.planner.stats())]
        asked += [(f"constructor {i}", c.stats()) for i, c in enumerate(link.constructors)]
    except Exception as e:  # noqa: BLE001 - the diagnosis must not hide the timeout
        return f"the service did not answer ({type(e).__name__}: {e}) (see DataService.stats())"
    silent = []
    for role, call in asked:
        left = deadline - time.monotonic()
        if left <= 0 and not call.done():
            silent.append(role)
            continue
        try:
            # (a role that answered is read whatever is left of the wait: one frozen role
            # used it up, and Dask's wait of 0 s raised for answers already there, naming
            # the healthy roles after it silent; a review)
            st = call.result(timeout=max(left, 1.0) if call.done() else left)
        except Exception:  # noqa: BLE001 - lost, or not answering within the look's wait
            silent.append(role)
            continue
        if role == "planner":
            if st.get("error"):
                parts.append(f"planner failed: {st['error']}")
            elif st.get("waiting"):
                parts.append(f"planner (at step {st['steps_planned']}) is waiting for "
                             f"{st['waiting']}")
            else:
                parts.append(f"planner is planning step {st['steps_planned']}")
        elif st.get("error"):
            parts.append(f"{role} failed: {st['error']}")
        elif st.get("fetching"):
            parts.append(f"{role} is fetching {st['fetching']}")
        elif st.get("unclaimed"):
            slow = sorted({r for rs in st["unclaimed"].values() for r in rs})
            parts.append(f"{role} holds {st['held_steps']} step(s) not yet claimed by "
                         f"rank(s) {slow}")
    if silent:
        parts.append(f"{first_of(silent, 4)} did not answer within {DIAGNOSIS_WAIT:g}s")
    return "; ".join(parts) + " (see DataService.stats())"


class ServiceLink(Protocol):
    """What a :class:`Reader` needs from its service: the current planner generation.

    The planner may be lost and re-created (a higher ``generation``, published
    under the same name); the link switches to it and tells every reader of the
    process (:meth:`announce_generation`).
    """

    client: Any
    config: Config
    name: str
    #: set once this process's handle closed, or a reader heard the owner closed the
    #: service: then no reader sends anything (see :meth:`send`)
    closed: bool
    #: the current planner generation, its planner and constructors (actor handles)
    generation: int
    planner: Any
    constructors: list[Any]
    #: (generation, constructors of that generation), replaced together
    handles: tuple[int, list[Any]]

    def close(self, notice: str) -> None:
        """Send nothing more (``notice``: why, what :meth:`send` raises then)."""

    def send(self, handle: Any, method: Callable[..., Any], /, *args: Any,
             **kwargs: Any) -> Any:
        """Call ``method`` on the actor ``handle`` (a future), or raise
        :class:`~msd_dask.errors.ServiceError` without sending once :meth:`close` was called."""

    def refresh(self, max_age: float = 0.0, timeout: float | None = None) -> None:
        """Fetch the current constructors; switch to a re-created planner if needed (not if
        this process did within ``max_age`` seconds), waiting ``timeout`` seconds at most
        (the config's ``timeout`` if ``None`` or longer)."""

    def adopt_published(self) -> bool:
        """Switch to the published planner if it is a newer generation; whether it was."""

    def planner_lost(self, *, confirm: bool = False) -> bool:
        """Whether Dask reports the current planner lost."""

    def scheduler_lost(self) -> str | None:
        """What to say where the process is not connected to the scheduler; ``None`` while
        it is."""

    def raise_if_lost(self, deadline: float | None = None,
                      cause: BaseException | None = None) -> None:
        """Raise if the planner is lost for good, or (past ``deadline``) did not answer."""

    def on_new_generation(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (held weakly) each time the planner was re-created."""

    def announce_generation(self) -> None:
        """Call every listener: the readers tell the new constructors what they have."""


def idle_time(gaps: Sequence[float]) -> float:
    """Seconds without a request for a batch after which a reader reports the last step it
    returned, given its last gaps between batches: ``REPORT_IDLE``, or ``IDLE_FACTOR``
    times the median of the last ``IDLE_GAPS`` gaps once there are that many, whichever
    is longer (a training loop pausing between its steps is not a stop)."""
    if len(gaps) < IDLE_GAPS:
        return REPORT_IDLE
    import statistics

    return max(REPORT_IDLE, IDLE_FACTOR * statistics.median(list(gaps)[-IDLE_GAPS:]))


class _Reporter:
    """The process's one thread that reports paused readers' last returned steps.

    A reader registers itself (:meth:`pending`) when it returns a step its
    constructor does not know of and is not registered already; the thread
    wakes when the earliest registered reader may have been idle for
    :data:`REPORT_IDLE` seconds, reports those that were (:meth:`Reader.report_returned`)
    and sleeps again.  A reader that keeps reading stays registered: the thread
    then wakes about once per ``REPORT_IDLE`` and sends nothing.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """No reader, no thread, a new lock: also what a forked process (a DataLoader
        worker) starts with, since it has none of its parent's threads and may
        inherit the lock held."""
        self._cond = threading.Condition()
        self._readers: dict[int, weakref.ref[Reader]] = {}
        self._thread: threading.Thread | None = None

    def pending(self, reader: Reader) -> None:
        with self._cond:
            reader.report_pending = True
            self._readers[id(reader)] = weakref.ref(reader)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="msd-reader-report",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def _due(self) -> tuple[list[Reader], float | None]:
        """Unregister the readers idle for ``REPORT_IDLE``; them, and how long until the
        next may be (``None``: none is registered).  Called holding the lock."""
        now = time.monotonic()
        due, wait = [], None
        for key, ref in list(self._readers.items()):
            reader = ref()
            if reader is None:
                del self._readers[key]
                continue
            left = reader.returned_at + reader.report_after - now
            if left <= 0:
                # unregistered before its step is read: a step returned meanwhile
                # registers it again, or is the one reported
                reader.report_pending = False
                del self._readers[key]
                due.append(reader)
            else:
                wait = left if wait is None else min(wait, left)
        return due, wait

    def _run(self) -> None:
        while True:
            with self._cond:
                due, wait = self._due()
                if not due:
                    self._cond.wait(wait)
                    continue
            for reader in due:
                try:
                    reader.report_returned()
                except Exception:  # noqa: BLE001 - best effort; the thread serves the others
                    pass
            del due, reader  # no reference keeps a reader alive while the thread waits


_REPORTER = _Reporter()

os.register_at_fork(after_in_child=_REPORTER.reset)


class _Progress:
    """What a :class:`Reader` returned and what its constructor knows of it, kept apart
    from the reader: a reader dropped without :meth:`~Reader.close` still reports its
    last step (:func:`_report_dropped`)."""

    __slots__ = ("step", "skip_through", "known")

    def __init__(self) -> None:
        #: the last step returned (``None``: none)
        self.step: int | None = None
        #: the step of the state loaded (``-1``: none)
        self.skip_through = -1
        #: (key of the constructor actor, last step returned that it knows of): a
        #: re-created constructor knows nothing yet
        self.known: tuple[Any, int] = (None, -1)

    def last(self) -> int:
        """The later of the last step returned and of the state loaded (``-1``: neither):
        a state loaded after reading counts, the next step served is after it."""
        return self.skip_through if self.step is None else max(self.step, self.skip_through)


def _report(link: ServiceLink, c: int, rank: int, ranks: list[int], step: int | None,
            progress: _Progress) -> Any:
    """Tell constructor ``c`` of ``link`` that ``ranks`` returned ``step``, unless it knows;
    the call's future, or ``None`` if nothing was sent (see :meth:`Reader.report_returned`)."""
    from msd_dask.roles.constructor import DataConstructor

    if step is None:
        return None
    try:
        constructor = link.constructors[c]
        key = constructor.key
        if progress.known[0] == key and step <= progress.known[1]:
            return None
        call = link.send(constructor, DataConstructor.returned_through, rank, int(step), ranks)
    except Exception:  # noqa: BLE001 - a lost constructor (the state then needs a step),
        # or a closed service: its roles may be released already
        return None
    progress.known = (key, int(step))
    return call


def _report_dropped(link: ServiceLink, c: int, rank: int, ranks: list[int],
                    progress: _Progress, reports: list[Any] | None = None) -> None:
    """A reader was dropped (garbage-collected) without :meth:`Reader.close`, e.g. after a
    ``for batch in svc.reader(rank)`` loop that ended with ``break``: report its last step,
    as close() would (:meth:`DataService.state_dict` counts it).  The call goes to
    ``reports`` (its handle's), which a handle dropped with its readers waits for before
    it closes its client."""
    last = progress.last()
    call = _report(link, c, rank, ranks, last if last >= 0 else None, progress)
    if call is not None and reports is not None:
        reports[:] = [f for f in reports if not f.done()]  # (the ones still on their way)
        reports.append(call)


def claimant_of(client_id: str) -> tuple[str, str]:
    """``("host:pid", client id)``: the process a reader's claims come from, and its Dask
    client (:meth:`~msd_dask.roles.constructor.DataConstructor.next_round`'s ``claimant``)."""
    import socket

    return f"{socket.gethostname()}:{os.getpid()}", client_id


class Reader:
    """Iterator over one global rank's batches (see :meth:`DataService.reader`).

    ``also``: more ranks of the rank's DP group with the same view (its tensor-parallel
    peers) this reader reads for: their constructor sends each batch once, for all of
    them (a host agent serving the ranks of its host reads so).  ``ledger``: a record,
    rank -> the last step returned (or the state loaded), this reader keeps up to date
    (:meth:`DataService.reader` starts a rank's next reader after it).  ``reports``: a
    list the report of a reader dropped without :meth:`close` goes to (its handle's).
    """

    def __init__(self, link: ServiceLink, rank: int, *, timeout: float,
                 also: Sequence[int] = (), ledger: dict[int, int] | None = None,
                 reports: list[Any] | None = None):
        from msd_dask.roles.constructor import constructor_of

        cfg = link.config
        world, p = cfg.parallel.world_size, cfg.parallel
        layout = p.layout
        if self.IN_JOB:
            check_world_size(rank, link.name, world, layout)
        for r in (rank, *also):
            check_rank(rank_number(r), link.name, world, layout)
        coords = cfg.parallel.coords(rank)
        for r in also:
            other = cfg.parallel.coords(r)
            if any(other[k] != coords[k] for k in ("dp", "cp", "pp")):
                raise ValueError(f"rank {r} does not read what rank {rank} reads: its DP, "
                                 f"CP and PP coordinates {other} differ from {coords}")
        #: the service's current planner generation (see :class:`ServiceLink`)
        self.link = link
        self.rank = rank
        #: this process and its Dask client, as a claim names them (:func:`claimant_of`;
        #: made at the first claim)
        self._claimant: tuple[str, str] | None = None
        #: every rank this reader reads for (``rank`` first)
        self.ranks = [rank, *(r for r in also if r != rank)]
        self.coords = coords
        self.timeout = wait_seconds(timeout, rank)
        self._progress = _Progress()
        self._ledger = ledger
        self._view = (self.coords["cp"], cfg.parallel.cp, self.coords["pp"], cfg.parallel.pp)
        #: the planner generation whose constructors know what this reader has
        self._gen = link.handles[0]
        #: batches of the last round claimed and not returned yet (in step order)
        self._held: deque[Batch] = deque()
        #: the constructor this rank's steps come from
        self._c = constructor_of(self.coords["dp"], len(link.constructors))
        #: when the last batch was returned (monotonic); whether the process's reporter
        #: watches this reader (see :class:`_Reporter`)
        self.returned_at = 0.0
        self.report_pending = False
        #: seconds without a request for a batch after which the reporter reports (see
        #: :data:`IDLE_FACTOR`); the reader's claims tell its constructor
        self.report_after = REPORT_IDLE
        self._gaps: deque[float] = deque(maxlen=IDLE_GAPS)
        self._closed = False
        #: done once :meth:`close` was called: a claim waited for in another thread ends
        #: then (:meth:`_answer`)
        self._closing: concurrent.futures.Future[None] = concurrent.futures.Future()
        link.on_new_generation(self._tell_new_generation)
        if self.REPORT_WHEN_DROPPED:
            # (at garbage collection only: at interpreter exit the client may be gone)
            weakref.finalize(self, _report_dropped, link, self._c, rank, self.ranks,
                             self._progress, reports).atexit = False

    #: whether a reader dropped without :meth:`close` reports the last step it returned
    REPORT_WHEN_DROPPED = True
    #: whether this reader runs in the training job, whose ``WORLD_SIZE`` it checks
    #: (:func:`~msd_dask.batch.check_world_size`); a host agent's group reader does not:
    #: its ranks are checked where they run (it checked the agent's own environment where
    #: the group was one rank; a review)
    IN_JOB = True
    #: the record of the last steps returned this reader keeps up to date (see ``ledger``)
    _ledger: dict[int, int] | None = None
    #: what this reader reads through and keeps alive: the handle that made it (a handle
    #: dropped without close() closes its client, see ``DataService.connect``)
    handle: Any = None

    @property
    def step(self) -> int | None:
        """The last step this reader returned (``None``: none)."""
        return self._progress.step

    @step.setter
    def step(self, value: int | None) -> None:
        self._progress.step = value

    @property
    def _skip_through(self) -> int:
        return self._progress.skip_through

    @_skip_through.setter
    def _skip_through(self, value: int) -> None:
        self._progress.skip_through = value

    @property
    def _known(self) -> tuple[Any, int]:
        return self._progress.known

    @_known.setter
    def _known(self, value: tuple[Any, int]) -> None:
        self._progress.known = value

    def state_dict(self) -> dict[str, Any]:
        """``{"service", "rank", "step"}``: the service's name, the rank, and the later of
        the last step this reader returned and of a state it loaded (``None``: neither)."""
        last = self._progress.last()
        return reader_state(self.rank, last if last >= 0 else None, self.link.name)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on after the step of ``state``: skip every step up to ``state["step"]``.

        Before this reader returns its first batch, any state of its rank (of its service)
        is taken as its position (``step`` ``None`` included: no step returned): the steps
        up to it are released without being transferred, so a restarted rank gets no step
        twice.  (A service that handed this rank later steps already refuses the next
        ``next()``, naming them: it serves each step once.)  Once the reader has returned a batch, it
        takes only a state of the step it is at (:meth:`state_dict`: nothing changes) or
        of a later one (the steps up to it are skipped): it cannot go back.

        Parameters
        ----------
        state : Mapping
            ``{"service", "rank", "step"}``, as :meth:`state_dict` returns it (a state
            without ``"service"``, of an earlier version, is not checked for it).

        Raises
        ------
        ValueError
            ``state`` is no reader state, or another service's or another rank's
            (:func:`~msd_dask.batch.loaded_step`).
        ServiceError
            The reader has returned a batch and ``state`` is of an earlier step than the
            one it is at, or of no step: the message names both steps.
        """
        step = loaded_step(state, self.rank, self.link.name)
        if self.step is not None:
            no_going_back(step, self._progress.last(), self.rank, self.link.name)
        self._skip_through = -1 if step is None else step
        self._keep_ledger()

    def _keep_ledger(self) -> None:
        if self._ledger is not None:
            self._ledger[self.rank] = self._progress.last()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`close` (``with service.reader(rank) as reader:``)."""
        self.close()

    def _done(self) -> int:
        """The last step this reader has (returned, skipped or claimed and held); -1 if none."""
        done = self._progress.last()
        try:  # another reader's thread may ask (announce_generation) while this one pops
            return max(done, self._held[-1].step)
        except IndexError:
            return done

    def _raise_if_closed(self) -> None:
        if self._closed:
            self._held.clear()
            raise ServiceError(f"rank {self.rank}: the reader is closed")

    def __next__(self) -> Batch:
        self._raise_if_closed()
        while self._held and self._held[0].step <= self._skip_through:
            self._held.popleft()  # a state loaded after this round was claimed
        if not self._held:
            self._held.extend(self._next_round())
            # closed while this thread waited: the round is not this reader's to return
            # (its constructor keeps it for the rank's next reader: it was never returned)
            self._raise_if_closed()
        batch = self._held.popleft()
        self.step = batch.step
        self._keep_ledger()
        now = time.monotonic()
        if self.returned_at:
            self._gaps.append(now - self.returned_at)
            self.report_after = idle_time(self._gaps)
        self.returned_at = now
        self._report_when_idle()
        return batch

    def _report_when_idle(self) -> None:
        """Have the process's reporter tell this rank's constructor what it returned once
        it pauses (:meth:`report_returned`): once per pause, not per step."""
        if not self.report_pending:
            _REPORTER.pending(self)

    def close(self) -> None:
        """Stop reading: tell this rank's constructor the last step returned (what
        :meth:`DataService.state_dict` counts), drop the steps held and not returned;
        :meth:`__next__` then refuses.  Idempotent; the service keeps running.  (The
        same as :meth:`AgentReader.close <msd_dask.service.agent_client.AgentReader.close>`:
        a training script runs unchanged with and without the host agent.)"""
        if self._closed:
            return
        self._closed = True
        try:
            self._closing.set_result(None)
        except concurrent.futures.InvalidStateError:  # (closed by two threads at once)
            pass
        self.report_returned()
        self._held.clear()

    def _answer(self, call: concurrent.futures.Future[Any], timeout: float) -> Any:
        """``call``'s result within ``timeout`` seconds (``TimeoutError`` after), or the
        closed reader's error as soon as :meth:`close` is called from another thread: a
        dataset's close while its prefetch thread waited here for a slow step waited the
        claim's poll, up to 5 s (a review)."""
        done, _ = concurrent.futures.wait((call, self._closing), timeout=timeout,
                                          return_when=concurrent.futures.FIRST_COMPLETED)
        if call in done:
            return call.result()
        self._raise_if_closed()
        raise TimeoutError(f"no answer within {timeout:.1f}s")

    def report_returned(self) -> Any:
        """Tell this rank's constructor the last step this reader returned, if it does not
        know it yet (:meth:`DataService.state_dict` counts it); the call's future, or
        ``None`` if nothing was sent.

        The process's reporter calls this once the reader was not asked for a batch
        for :data:`REPORT_IDLE` seconds, and :meth:`DataService.close` before it
        disconnects.  Fire and forget: best effort, a lost constructor learns nothing.
        """
        return _report(self.link, self._c, self.rank, self.ranks, self.state_dict()["step"],
                       self._progress)

    def _returned_through(self) -> int | None:
        """What a claim tells the constructor this reader returned: ``None``, every step
        before the round it claims (this reader claims a round once it returned the
        steps it held).  A reader that claims ahead of what it returned says the step
        (:class:`~msd_dask.service.agent.AgentGroupReader`); the constructor then
        learns that it paused from its report only."""
        return None

    def _batch(self, wire: dict[str, Any]) -> Batch:
        """What this reader hands out for one payload of its constructor (the wire form of
        :func:`msd_dask.core.packing.to_wire`): the rank's :class:`~msd_dask.batch.Batch`."""
        return Batch.from_payload(from_wire(wire), self.rank)

    def _next_round(self) -> list[Batch]:
        """The batches of this rank's next round, which it does not have yet.

        One call to the constructor at a time: it hands a round over once, so a call
        is waited for until it answers, unless the service replaced that constructor.
        The constructor answers ``None`` after :data:`POLL` seconds without a round;
        a call to a lost worker hangs, and is given up once the link finds the
        constructor re-created.
        """
        from msd_dask.roles.constructor import POLL, DataConstructor

        done = self._done()  # (a loaded state's step counts: the next step is after it)
        waiting_for = "the first step" if done < 0 else f"step {done + 1}"
        deadline = time.monotonic() + self.timeout
        c = self._c
        constructor = self.link.constructors[c]
        call: Any = None
        returned: int | None = None  # what the call in flight told the constructor
        wait = CLAIM_WAIT
        while True:
            self._raise_if_closed()  # (by another thread while this one waited)
            try:
                if call is None:
                    poll = min(POLL, max(0.1, deadline - time.monotonic()))
                    returned = self._returned_through()
                    told = {} if returned is None else {"returned": returned}
                    if self._claimant is None:
                        self._claimant = claimant_of(self.link.client.id)
                    call = self.link.send(constructor, DataConstructor.next_round_packed,
                                          self.rank, self._done(), self._view,
                                          report_after=self.report_after, wait=poll,
                                          ranks=self.ranks, claimant=self._claimant, **told)
                # (at most until the deadline: a slow or frozen constructor's call was waited
                # for up to 13 s more, and the rank raised 13-18 s after its timeout, behind
                # an agent after the rank's own wait, without the cause; a review)
                answer = pickle.loads(self._answer(
                    call, min(POLL + wait, max(0.1, deadline - time.monotonic()))))
            except ServiceError:  # closed: nothing was sent
                raise
            except TimeoutError:
                # a slow constructor only answers late, a lost one never: whether the
                # service replaced it is looked at (one look per process and interval:
                # thousands of ranks may wait at once) before the deadline can raise, or
                # every later request of this rank would go to the lost one again
                constructor, call = self._current(c, constructor, call, CLAIM_WAIT, deadline,
                                                  waiting_for)
                self._check_deadline(deadline, waiting_for)
                wait = min(2 * wait, CLAIM_WAIT_MAX)
                continue
            except Exception as e:  # noqa: BLE001 - its worker was lost, or it was closed
                # a KeyError naming the actor: Dask forgot it (its planner was lost)
                gone = isinstance(e, KeyError) and e.args and e.args[0] == constructor.key
                if isinstance(e, KeyError | ValueError) and not gone:
                    raise
                time.sleep(0.5)
                constructor, call = self._current(c, constructor, None, 0.0, deadline,
                                                  waiting_for)  # (as above)
                self._check_deadline(deadline, waiting_for, e)
                continue
            else:
                call = None
                if answer is not None:
                    if "error" in answer:
                        if answer["error"] in CLOSED_NOTICES:  # the process's other readers
                            self.link.close(answer["error"])  # then call no released role
                        raise ServiceError(f"service {self.link.name!r}: {answer['error']}")
                    if "handed" in answer:  # the constructor says so: nothing was sent
                        raise self._gone(done, int(answer["handed"]))
                    first_step = int(answer["steps"][0])
                    if done >= 0 and first_step > done + 1:
                        raise self._gone(done, first_step - 1, offered=True)
                    if returned is None:  # it knows the steps before the round
                        self._known = (constructor.key, first_step - 1)
                    return [self._batch(p) for p in answer["payloads"]]
                # nothing built for this rank within POLL: is the planner still there?
                self._check_deadline(deadline, waiting_for)
                if not self.link.planner_lost():
                    continue
                # its successor (if the service's owner re-creates it) is published; a
                # planner nobody can re-create is reported at once
                if not self.link.adopt_published():
                    self.link.raise_if_lost()
                    continue
            constructor, call = self._current(c, constructor, call, 0.0, deadline, waiting_for)

    def _gone(self, done: int, handed: int, offered: bool = False) -> ServiceError:
        """The error for a rank restarted from a state (``done``) older than what the
        service handed it (every step up to ``handed``): those steps are gone from the
        service, which serves each once.  ``offered``: the service offered the rank a
        round after them (it may have handed them, or been resumed after them: a service
        resumed from a later state than the rank's never had them)."""
        if done < 0:  # (a reader with no state, after another reader of the rank)
            return ServiceError(
                f"rank {self.rank}: a new reader with no state asked service "
                f"{self.link.name!r} for its first step, but the service had handed this rank "
                f"the steps up to {handed} already (to an earlier reader, a round of steps at "
                "a time: possibly past the last one it returned) and serves each step "
                "once: load the state of the last step this rank returned "
                "(reader.load_state_dict(state), the state_dict() saved with its checkpoint), "
                "or resume the whole job from DataService.state_dict(step) (docs/resume.md); "
                f"{TRIAL_HINT}")
        # (a rank whose own state is older than the state the service resumed from was told
        # the service had handed it steps it never had: a review)
        resumed = (f" (or it was resumed from the state of step {handed} or later; this "
                   f"rank's state is of step {done})") if offered else ""
        return ServiceError(
            f"rank {self.rank} asked service {self.link.name!r} for step {done + 1}, but the "
            f"service had handed this rank the steps up to {handed} already{resumed} and "
            "serves each step once: resume the whole job from DataService.state_dict(step) "
            f"(docs/resume.md), or load the state of step {handed} or later on this rank")

    def _current(self, c: int, constructor: Any, call: Any, max_age: float,
                 deadline: float, waiting_for: str) -> tuple[Any, Any]:
        """``(constructor c, the call in flight)`` as the service has them now: the link
        refreshed (if its handles are older than ``max_age`` seconds, waiting at most
        until this reader's ``deadline``: past it, this rank's own timeout for
        ``waiting_for`` is raised, the look's error its cause); where the service replaced
        the constructor, the new one and no call (the one to the old is cancelled: a call
        to a lost worker would wait for ever)."""
        try:
            self.link.refresh(max_age=max_age,
                              timeout=max(0.1, deadline - time.monotonic()))
        except ServiceTimeoutError as e:
            try:
                self._check_deadline(deadline, waiting_for)
            except ServiceTimeoutError as mine:  # (this rank's words, the look's as cause)
                raise mine from e
            raise
        self.link.announce_generation()
        if self.link.constructors[c].key == constructor.key:
            return constructor, call
        if call is not None:
            call.cancel()
        return self.link.constructors[c], None

    def _check_deadline(self, deadline: float, waiting_for: str,
                        cause: BaseException | None = None) -> None:
        """Raise if this rank has waited ``timeout`` for ``waiting_for``, saying why."""
        if time.monotonic() <= deadline:
            return
        gone = self.link.scheduler_lost()
        if gone is not None:  # (its futures cancelled: the planner looked lost)
            raise ServiceTimeoutError(
                f"rank {self.rank} waited {self.timeout:.0f}s for {waiting_for} of service "
                f"{self.link.name!r}: {gone}")
        lost = ""
        if self.link.planner_lost():
            lost = (f"the planner was lost with its worker and not re-created; "
                    f"{RESTART_HINT}; ")
        if cause is not None:
            lost += f"constructor {self._c} was lost ({cause!r}); "
        raise ServiceTimeoutError(
            f"rank {self.rank} waited {self.timeout:.0f}s for {waiting_for} of service "
            f"{self.link.name!r}: no batch was published; {lost}{self._diagnose()}")

    def _tell_new_generation(self) -> None:
        """After the planner was re-created: tell its constructors which steps this rank
        has, so they do not hold those steps for it (best effort: its next request for
        a round says so too)."""
        from msd_dask.roles.constructor import DataConstructor

        gen, constructors = self.link.handles
        if self._gen == gen:
            return
        self._gen = gen
        self._report_when_idle()  # (the new constructor learns what it returned)
        done = self._done()
        if done < 0:
            return
        calls: list[Any] = []
        try:  # the one constructor of this rank's DP group
            calls.extend(self.link.send(constructors[self._c], DataConstructor.mark_had, r,
                                        done) for r in self.ranks)
        except Exception:  # noqa: BLE001 - lost meanwhile: its successor learns from next_round
            pass
        for call in calls:
            try:
                call.result(timeout=5.0)
            except Exception:  # noqa: BLE001 - as above
                pass

    def _diagnose(self) -> str:
        """Which role is stuck, from the roles' own stats: one look per process every
        :data:`DIAGNOSIS_AGE` seconds, shared by its readers (best effort, at most
        :data:`DIAGNOSIS_WAIT` seconds)."""
        with _diagnosing:
            at, text = _diagnoses.get(self.link, (float("-inf"), ""))
            if time.monotonic() - at >= DIAGNOSIS_AGE:
                text = _look_at_roles(self.link)
                _diagnoses[self.link] = (time.monotonic(), text)
        return text

    def report_step_time(self, seconds: float, step: int | None = None) -> None:
        """Report how long this rank computed on a step (default: the last one returned).

        With ``cost: {fit: true}`` the planner fits ``α`` and ``β`` to these
        times.  Fire and forget: the call does not wait for the planner.
        """
        seconds = step_time(seconds, self.rank)
        step = self.step if step is None else step
        if step is None:
            raise ValueError("report_step_time: no step was read yet")
        if self.link.closed:  # its planner may be released already
            return
        try:
            self.link.planner.report_step_time(int(step), self.coords["dp"], float(seconds))
        except Exception:  # noqa: BLE001 - a lost planner: its successor fits from new reports
            pass
