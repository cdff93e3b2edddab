"""A ``torch.utils.data.IterableDataset`` over one rank's batches of a running service.

The service already builds whole batches (``[micro_batches, seq_len]`` per rank
and step), so the adapter is meant for ``DataLoader(ds, batch_size=None,
num_workers=0)``: no collation, no loader worker processes (the work is done
by the service's roles on the Dask cluster, not in the training process).

Example
-------
>>> from torch.utils.data import DataLoader
>>> from msd_dask.torch import MsdIterableDataset
>>> ds = MsdIterableDataset("tcp://head:8786", "demo", rank)        # doctest: +SKIP
>>> for batch in DataLoader(ds, batch_size=None, num_workers=0):   # doctest: +SKIP
...     logits = model(batch["input_ids"], position_ids=batch["position_ids"],
...                    cu_seqlens=batch["cu_seqlens"])
...     # labels are shifted already (a Hugging Face model's labels= would shift them again)
...     loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
...                                              batch["labels"].flatten(), ignore_index=-100)

``prefetch=k`` claims up to ``k`` batches ahead in a background thread while
the model computes, and :meth:`MsdIterableDataset.report_step_time` passes a
rank's measured compute time to the planner (``cost: {fit: true}``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import torch.utils.data

from msd_dask.batch import (
    MAX_PREFETCH,
    Batch,
    is_whole,
    loaded_step,
    rank_number,
    reader_state,
)

__all__ = ["MsdIterableDataset", "Prefetcher", "batch_to_dict"]

T = TypeVar("T")


def batch_to_dict(batch: Batch) -> dict[str, Any]:
    """The fields of a :class:`~msd_dask.Batch` as a dict.

    Parameters
    ----------
    batch : Batch

    Returns
    -------
    dict
        ``input_ids``, ``labels``, ``position_ids`` (``torch.long``,
        ``[micro_batches, seq_len]``), ``cu_seqlens`` (list of int32 tensors, one
        per micro-batch), ``documents``, ``epochs``, ``step``, ``rank``, ``cost``
        and ``num_tokens`` (tokens that are not padding); ``cp_index`` (context
        parallelism), ``pixel_values`` and ``image_spans`` (image+text sources):
        ``None`` where the batch has none (see :class:`~msd_dask.Batch`).
    """
    return {
        "input_ids": batch.input_ids,
        "labels": batch.labels,
        "position_ids": batch.position_ids,
        "cu_seqlens": batch.cu_seqlens,
        "documents": batch.documents,
        "epochs": batch.epochs,
        "step": batch.step,
        "rank": batch.rank,
        "cost": batch.cost,
        "num_tokens": batch.num_tokens,
        "cp_index": batch.cp_index,
        "pixel_values": batch.pixel_values,
        "image_spans": batch.image_spans,
    }


#: seconds :meth:`Prefetcher.close` waits for an item being taken before it wakes the source
WAKE_AFTER = 0.05


class Prefetcher(Generic[T]):
    """Takes an iterator's next items in a background thread, at most ``depth`` ahead.

    At any time at most ``depth`` items have been taken from ``source`` and
    not yet returned by :meth:`get` (the one being taken included), so the
    read-ahead is bounded.  Items come out in the source's order.  An
    exception raised by the source (``StopIteration`` included) is raised by
    :meth:`get` once the items taken before it are returned, and again on
    every later call.

    Parameters
    ----------
    source : iterator
        Read only by the background thread from now on.
    depth : int
        ``>= 1``.
    name : str
        The thread's name.
    """

    def __init__(self, source: Iterator[T], depth: int, *, name: str = "msd-prefetch"):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.depth = int(depth)
        self._run = _Run(source, depth)
        self._error: BaseException | None = None
        self._returned = 0       # items returned by get()
        # (the thread holds the run, not this object: a prefetcher dropped without close()
        # stops its thread, which then lets go of the source, e.g. a reader and its socket)
        self._thread = threading.Thread(target=self._run.loop, name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, self._run.stop.set)

    @property
    def ahead(self) -> int:
        """Items taken from the source (or being taken) and not yet returned by :meth:`get`."""
        with self._run.lock:
            return self._run.taken - self._returned

    def get(self, timeout: float | None = None) -> T:
        """The next item (waits for it; ``timeout`` in seconds raises ``TimeoutError``)."""
        if self._error is not None:
            raise self._error
        try:
            ok, item = self._run.items.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no item within {timeout}s") from None
        if not ok:
            self._error = item
            raise item
        with self._run.lock:
            self._returned += 1
        self._run.slots.release()
        return item

    def close(self, timeout: float = 5.0, wake: Callable[[], None] | None = None) -> list[T]:
        """Stop taking items (an item being taken is finished first, up to ``timeout``);
        returns the items taken and not returned by :meth:`get`, in order (an error the
        source raised after them is not raised).

        ``wake``: called if the thread is still taking an item after :data:`WAKE_AFTER`
        seconds, to end a wait of the source's (a reader's close, which ends its wait for
        a step): else a thread waiting for a slow step held the close ``timeout`` seconds,
        and an item it took after them was dropped."""
        self._run.stop.set()
        if wake is not None:
            self._thread.join(min(timeout, WAKE_AFTER))
            if self._thread.is_alive():
                wake()
        self._thread.join(timeout)
        left = []
        while True:
            try:
                ok, item = self._run.items.get_nowait()
            except queue.Empty:
                break
            if not ok:
                break
            left.append(item)
        # a get() waiting in another thread (a loop whose dataset a signal handler closed)
        # took nothing of what was drained, and waited for ever: it, and any later get(),
        # raises that the prefetcher is closed (a review)
        self._run.items.put((False, PrefetcherClosed("the prefetcher is closed")))
        return left


class PrefetcherClosed(RuntimeError):
    """What :meth:`Prefetcher.get` raises once the prefetcher is closed."""


class _Run:
    """What a :class:`Prefetcher`'s thread works with: the source, the queue of items (or
    the source's error, after which the thread ends), and how far it is ahead."""

    def __init__(self, source: Iterator[Any], depth: int):
        self.source = source
        self.slots = threading.Semaphore(depth)
        self.items: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.taken = 0  # items taken from the source

    def loop(self) -> None:
        while not self.stop.is_set():
            if not self.slots.acquire(timeout=0.1):
                continue
            if self.stop.is_set():
                return
            with self.lock:
                self.taken += 1
            try:
                item = next(self.source)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer by get()
                self.items.put((False, e))
                return
            self.items.put((True, item))


class MsdIterableDataset(torch.utils.data.IterableDataset):
    """One global rank's batches of the service ``name``, as a torch ``IterableDataset``.

    The connection is opened lazily on the first ``iter()`` (so the dataset can
    be built before the service is up and pickled into spawned processes) and
    kept for later iterations: a second ``iter()`` continues with the next step
    rather than starting over, like the service itself.

    Parameters
    ----------
    address : str
        The Dask scheduler the service runs on (``tcp://host:port``).
    name : str
        The service's ``name``.
    rank : int
        The global rank whose batches to yield.
    steps : int, optional
        Stop after this many batches per ``iter()`` (default: never stop): a count per
        ``iter()``, not an epoch's length (torchdata's ``StatefulDataLoader`` restored
        mid-epoch yields ``steps`` more batches, from the restored step on).
    timeout : float, optional
        Seconds a reader waits for a batch (default: the service config's).
    connect_timeout : float
        Seconds to wait for the service to appear on the scheduler.
    security : distributed.security.Security, optional
        The cluster's TLS settings, as ``DataService.connect`` takes them (a rank
        reading directly from a TLS cluster; through a host agent it needs none).  It is
        pickled with the dataset into spawned processes (file paths, as Dask's own).
    prefetch : int
        Batches claimed ahead by a background thread while the model computes
        (``0``, the default: each batch is claimed when asked for), at most
        :data:`~msd_dask.batch.MAX_PREFETCH` (16).  At most
        ``prefetch`` batches are taken from the reader and not yet handed out
        (the reader itself claims whole rounds, ``round_steps`` steps, and
        holds the rest of a round until they are taken); they stay with the
        dataset from one ``iter()`` to the next, and across :meth:`close`.  The thread shares the
        process's GIL: on CPU ranks it competes with the model's own Python
        work (``scripts/bench_train.py`` measured the data share going from
        ~0.4% to 0.1% of a step, and no wait reduction beyond noise).

    Notes
    -----
    Use ``DataLoader(ds, batch_size=None, num_workers=0)``.  With
    ``num_workers > 0`` every loader worker would be a second reader of the
    same rank, so iterating in a loader worker raises ``RuntimeError``.

    ``DataLoader`` with ``batch_size=None`` converts each batch with torch's
    ``default_convert``, which makes lists of the tuples in ``documents``
    (``["source", "file:row", chunk]``) and ``image_spans`` (``[first patch,
    patches]``); iterating the dataset itself, or ``DataLoader(...,
    collate_fn=lambda b: b)``, keeps them tuples.

    With ``MSD_DASK_AGENT`` set, the rank reads through the host's agent as
    ``DataService.connect`` does (docs/deployment.md): the process then imports
    neither Dask nor the service's handle.

    :meth:`state_dict` / :meth:`load_state_dict` carry the position of the
    last batch handed out (not of a batch only prefetched), so a restarted
    rank skips the steps it has already trained on.

    :meth:`close` ends the dataset's iterators made before it, and disconnects; a
    dataset dropped without it lets go of its prefetch thread, reader and connection.
    """

    def __init__(self, address: str, name: str, rank: int, *, steps: int | None = None,
                 timeout: float | None = None, connect_timeout: float = 30.0,
                 prefetch: int = 0, security: Any = None):
        super().__init__()
        if steps is not None and (not is_whole(steps) or steps < 0):
            # (-1 yielded nothing, 2.5 three batches, "2" a TypeError at the first batch)
            raise ValueError(f"steps must be a whole number >= 0 (batches per iter()) or "
                             f"None, got {steps!r}")
        if not is_whole(prefetch) or not 0 <= prefetch <= MAX_PREFETCH:
            why = (f": the service keeps the states of {MAX_PREFETCH} steps more than it "
                   "publishes ahead of its readers, and svc.state_dict(ds.last_step) must "
                   "find the step the training loop finished"
                   if is_whole(prefetch) and prefetch > MAX_PREFETCH else "")
            raise ValueError(f"prefetch must be a whole number from 0 to {MAX_PREFETCH}, got "
                             f"{prefetch!r}{why}")
        self.address = address
        self.name = name
        # (a reader's rule: int() read rank 3 for 3.7 and rank 1 for True; a review)
        self.rank = rank_number(rank)
        self.steps = None if steps is None else int(steps)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.prefetch = int(prefetch)
        self.security = security
        self._service: Any = None
        self._reader: Any = None
        self._pending_state: Mapping[str, Any] | None = None
        self._prefetcher: Prefetcher[Batch] | None = None
        self._start_state: dict[str, Any] | None = None
        #: batches prefetched and not handed out when the dataset was closed: the next
        #: iter() hands them out first (its new reader goes on after them)
        self._carried: list[Batch] = []
        #: bumped by close(): an iterator made before it ends instead of handing out one
        #: more batch (a batch of the closed reader, or a step the next iter() hands out)
        self._generation = 0
        #: the step of the last batch handed out
        self.last_step: int | None = None

    def _connect(self) -> Any:
        """The dataset's reader, connected at the first call (and after :meth:`close`).

        The handle is the dataset's only once its reader is made and has loaded the
        pending state: where ``reader()`` or ``load_state_dict`` raises (a rank outside
        the world, one the agent does not serve, a bad state) the handle is closed (else
        each failed ``iter()`` left a Dask client open) and neither is kept (a reader that
        refused the state would be read from without it); the next ``iter()`` connects
        again.
        """
        if self._reader is None:
            from msd_dask.service.agent_client import connect_agent

            # behind a host agent, without importing the service's handle (nor Dask)
            service: Any = connect_agent(self.name, timeout=self.connect_timeout)
            if service is None:
                from msd_dask.service import DataService

                service = DataService.connect(self.address, self.name,
                                              timeout=self.connect_timeout, agent=False,
                                              security=self.security)
            try:
                reader = service.reader(self.rank, timeout=self.timeout)
                if self._pending_state is not None:
                    reader.load_state_dict(self._pending_state)
            except BaseException:
                # (best effort: the reader's error is the one to tell, not the close's)
                with contextlib.suppress(Exception):
                    service.close()
                raise
            self._service, self._reader, self._pending_state = service, reader, None
        return self._reader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("MsdIterableDataset must be read with DataLoader(num_workers=0): "
                               "each loader worker would be another reader of rank "
                               f"{self.rank}")
        # an iterator ends once the dataset is closed (checked before each batch it takes):
        # what it would take next belongs to the dataset's next iter(), which goes on after
        # the last batch handed out.  Its generation is the one of iter()'s call, not of its
        # first batch (a generator's body runs then): made before a close, it ends too
        return self._batches(self._generation)

    def _batches(self, generation: int) -> Iterator[dict[str, Any]]:
        """The batches of an iterator made at ``generation`` (see :meth:`__iter__`)."""
        n = 0
        while self._carried and (self.steps is None or n < self.steps):
            if self._generation != generation:
                return
            batch = self._carried.pop(0)
            self.last_step = batch.step
            yield batch_to_dict(batch)
            n += 1
        if (self.steps is not None and n >= self.steps) or self._generation != generation:
            return
        reader = self._connect()
        if self.prefetch and self._prefetcher is None:
            self._start_state = dict(reader.state_dict())
            self._prefetcher = Prefetcher(reader, self.prefetch,
                                          name=f"msd-prefetch-{self.name}-rank{self.rank}")
        while self.steps is None or n < self.steps:
            if self._generation != generation:
                return
            prefetcher = self._prefetcher
            try:
                batch = next(reader) if prefetcher is None else prefetcher.get()
            except Exception:
                if self._generation != generation:
                    # closed while it waited (a signal handler saving a checkpoint, another
                    # thread): the iterator ends, as close() says, where it raised the
                    # closed reader's error, or waited for ever behind a prefetcher (a review)
                    return
                if prefetcher is not None:
                    # its thread ended on the reader's error (a timeout, say), every batch
                    # it took handed out before: the next iter() reads on with a new one,
                    # as a loop reading the reader directly would
                    prefetcher.close()
                    self._prefetcher = None
                raise
            self.last_step = batch.step
            yield batch_to_dict(batch)
            n += 1

    @property
    def ahead(self) -> int:
        """Batches claimed by the prefetch thread and not yet handed out (``0`` without prefetch)."""
        return self._prefetcher.ahead if self._prefetcher is not None else 0

    def report_step_time(self, seconds: float, step: int | None = None) -> None:
        """Report this rank's compute time on a step (default: the last batch handed out).

        With ``cost: {fit: true}`` the planner fits its cost model's ``α`` and
        ``β`` to these times (see :meth:`msd_dask.Reader.report_step_time`).
        Fire and forget.  Time only the rank's own work (forward and
        backward), not the wait for other ranks at a collective.

        Not connected (after :meth:`close`, or while a new ``iter()`` hands out the
        batches prefetched before it), the dataset connects as ``iter()`` does.

        Raises
        ------
        ValueError
            If no batch was handed out yet and ``step`` is not given.
        """
        step = self.last_step if step is None else int(step)
        if step is None:
            raise ValueError("report_step_time: no batch was handed out yet (give step=)")
        # (it said "no batch was handed out yet" once closed, with a step given too, and
        # while a new iter() handed out the batches carried from before a close; a review)
        self._connect().report_step_time(seconds, step=step)

    def state_dict(self) -> dict[str, Any]:
        """``{"service", "rank", "step"}``: the service's name, the rank and the last step
        handed out (``None`` before the first), as a reader's
        (:meth:`msd_dask.Reader.state_dict`)."""
        return reader_state(self.rank, self._step(), self.name)

    def _step(self) -> int | None:
        """The step of :meth:`state_dict`."""
        if self._carried and self.last_step is not None:
            return self.last_step
        if self._carried:
            return self._start_step()
        if self._reader is None:
            if self._pending_state is None:
                return None
            return loaded_step(self._pending_state, self.rank, self.name)
        if self._prefetcher is not None:  # the reader is ahead by the prefetched batches
            return self.last_step if self.last_step is not None else self._start_step()
        step = self._reader.state_dict()["step"]
        return None if step is None else int(step)

    def _start_step(self) -> int | None:
        """The step the reader was at when prefetching started."""
        step = (self._start_state or {}).get("step")
        return None if step is None else int(step)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on after the step of ``state`` (see :meth:`msd_dask.Reader.load_state_dict`).

        Any state of the rank is taken while the dataset is not connected: before the
        first ``iter()``, after :meth:`close`, in a pickled copy (the reader made at the
        next ``iter()`` loads it).  Once its reader has returned a batch, only a state of
        the step the dataset is at (:meth:`state_dict`: nothing changes) or of a later one
        (the steps up to it are skipped) is: the service serves each step once.

        Parameters
        ----------
        state : Mapping
            ``{"service", "rank", "step"}``, as :meth:`state_dict` returns it (a state
            without ``"service"``, of an earlier version, is not checked for it).

        Raises
        ------
        ValueError
            If ``state`` is no reader state, or belongs to another service or rank.
        RuntimeError
            If batches were already prefetched (load the state before iterating).
        ServiceError
            If the dataset's reader has returned a batch and ``state`` is of an earlier
            step than the one the dataset is at, or of no step (a ``RuntimeError`` too):
            the message names both steps.
        """
        if self._prefetcher is not None:
            raise RuntimeError("load_state_dict after prefetching started: batches were already "
                               "claimed ahead; load the state before the first iter()")
        # (checked now, as a reader checks it: else a bad state came back from state_dict()
        # into a checkpoint, and failed only at iter())
        loaded = loaded_step(state, self.rank, self.name)
        step = -1 if loaded is None else loaded
        # batches carried from before a close stay where the state goes on right before
        # them, connected again or not; else the state's reader decides (they are dropped:
        # a reader connected again was handed the state while the carried steps were
        # handed out after it, and then asked for them again; a review)
        carried = [b for b in self._carried if b.step > step]
        if carried and carried[0].step != step + 1:
            carried = []
        if self._reader is None:
            if not carried:
                self._pending_state = dict(state)
        elif not carried:  # (its reader, direct or a host agent's, refuses a state it
            self._reader.load_state_dict(state)  # cannot honour: nothing changed then)
        self._carried = carried
        # the last step "handed out" is the state's: the step before the load said it until
        # the next batch, once prefetching had started (a checkpoint taken then went back to
        # it), and a connected dataset's stayed behind the state it skipped to (a review)
        self.last_step = step if step >= 0 else None

    def __enter__(self) -> MsdIterableDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`close` (``with MsdIterableDataset(...) as ds:``)."""
        self.close()

    def close(self) -> None:
        """Stop prefetching and disconnect from the service (the service keeps running).

        An iterator of the dataset made before ends (``StopIteration``) instead of handing
        out another batch: a later ``iter()`` goes on after the last batch handed out.
        Batches prefetched and not handed out stay with the dataset: a later ``iter()``
        hands them out first, then reads on after them (:meth:`state_dict` stays the
        last batch handed out).
        """
        self._generation += 1
        reader, service = self._reader, self._service
        if self._prefetcher is not None:
            # (its thread stops first: it reads the reader closed below; waiting for a step,
            # the reader's close ends its wait, and a step it took is returned, not dropped)
            self._carried += self._prefetcher.close(
                wake=None if reader is None else reader.close)
            self._prefetcher = None
        position = self._resume_at()  # (kept: a later iter() goes on after it)
        self._service = None
        self._reader = None
        self._pending_state = position
        try:
            if reader is not None:
                # (its constructor learns the last step it returned; the batches it held
                # and did not return are not handed out: the next reader gets them again)
                reader.close()
        finally:
            if service is not None:
                service.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_service"] = None
        state["_reader"] = None
        state["_prefetcher"] = None
        state["_pending_state"] = self._resume_at()  # (a copy goes on after it)
        state["_carried"] = list(self._carried)
        return state

    def _resume_at(self) -> dict[str, Any] | None:
        """The state a reader connected later loads: after the batches carried from a close
        (its reader took them), else :meth:`_position`."""
        if self._carried:
            return reader_state(self.rank, self._carried[-1].step, self.name)
        return self._position()

    def _position(self) -> dict[str, Any] | None:
        """The state a reader connected later loads: :meth:`state_dict`, if any step was
        handed out or loaded."""
        state = self.state_dict()
        return state if state["step"] is not None else None
