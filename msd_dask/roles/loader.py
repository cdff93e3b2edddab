"""Source Loader: a Dask actor that owns the file access of a share of one source.

The planner assigns it ``(epoch, unit)`` keys in stream order; it reads
up to ``threads`` units at once on a small thread pool (pyarrow and zstd
release the GIL), preprocesses and tokenizes the documents of each unit on a
bounded :class:`~msd_dask.sources.documents.DocPool` (threads or processes, ``sources[].pool``; the
documents keep their row order), reports the lengths
(:meth:`SourceLoader.metadata`) and keeps the tokens until constructors fetch
them (:meth:`SourceLoader.fetch`).  A unit's tokens stay until the planner
releases it (once every step that used it was claimed), so a loader holds the
units of its source's current shuffle window, those assigned after it
(``read_ahead`` units holding at most ``read_ahead_tokens``) and those behind
it not yet released.  A unit fetched that the planner does not hold (released
already, or not handed to this loader yet) is read for the fetches that use it
and dropped after them.

All methods are ``async``: they run on the worker's event loop, and calls
from other actors never block a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from msd_dask.core.config import PoolConfig, TokenizerConfig
from msd_dask.core.packing import JoinedPieces, join_pieces
from msd_dask.errors import ConfigError, DataError
from msd_dask.sources.documents import DocPool, ImageDoc, preprocessor, read_unit, source_config
from msd_dask.sources.tokenizer import make_tokenizer

# storage (fsspec) is imported where the loader starts, formats and vision where a unit is
# read (msd_dask.sources.documents): a training process imports this module when it
# unpickles a loader's actor handle, and every module costs each training process memory
# (tests/unit/test_imports.py)

__all__ = ["SourceLoader", "unanswered_stats"]


_KEEP_KEYS = 100  # quarantined keys kept for stats() (all are logged)
#: reads of a unit that read differently from what its steps were planned with, after
#: which a fetch of it fails with a DataError naming its file (its constructor then fails
#: at once): a file that changed or went after it was planned was read again about four
#: times a second until the constructor's timeout, the service stalled for it, and the
#: ranks' first error named no file (a review of storage failing mid-run)
DIFFERENT_READS = 3
_log = logging.getLogger("msd_dask.roles.loader")


class _UnitData:
    """A read unit's documents, held until the planner releases the unit.

    Their tokens are uint16 when the vocabulary allows (:func:`~msd_dask.sources.documents.process_docs`
    compacts each document as it is tokenized): half the memory of a loader's
    buffer and of every fetch; the constructor packs them into int32 rows
    either way.
    """

    __slots__ = ("docs", "lengths")

    def __init__(self, docs: list[np.ndarray | ImageDoc]):
        self.docs: list[np.ndarray | ImageDoc | None] = list(docs)
        self.lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))


def unanswered_stats(source: str, index: int, last: dict[str, Any] | None,
                     error: str) -> dict[str, Any]:
    """What stands for :meth:`SourceLoader.stats` of a loader that did not answer (its
    worker was lost and the planner re-creates it): its ``last`` answer (zero counters
    without one), with ``error`` saying why."""
    zero: dict[str, Any] = {
        "threads": 1, "read_threads": 1, "pool": "thread", "docs_read": 0, "tokens_read": 0,
        "units_read": 0, "units_buffered": 0, "tokens_buffered": 0, "read_seconds": 0.0,
        "cpu_seconds": 0.0, "cpu_wait_seconds": 0.0, "tokens_fetched": 0,
        "quarantined_docs": 0, "quarantined_files": 0, "quarantined": [], "reading": []}
    return {**(last or zero), "source": source, "index": index, "error": error}


class SourceLoader:
    """Dask actor reading one share of one source.

    Parameters
    ----------
    source : dict
        The source's config (``dataclasses.asdict`` of a SourceConfig, weight dropped).
    units : list of tuple
        The source's units as ``(path, part, row_offset)``, sorted.
    tokenizer : dict
        The tokenizer config.
    index : int
        This loader's index among the source's loaders.
    threads : int
        Size of the read pool: units read at once.  The documents of those units
        are preprocessed and tokenized on the source's ``pool`` (``size`` 0:
        ``threads`` threads); a thread pool of size 1 does it in the read thread.
    """

    def __init__(self, source: dict[str, Any], units: list[tuple[str, int, int]],
                 tokenizer: dict[str, Any], index: int = 0, threads: int = 1):
        from msd_dask.core.units import Unit
        from msd_dask.formats import get_format
        from msd_dask.sources.heap import cap_arenas
        from msd_dask.sources.storage import source_filesystem

        cap_arenas()  # before this process's read threads allocate
        self.src = source_config(source)
        self.units = [Unit(*u) for u in units]
        self.index = index
        self.tokenizer = make_tokenizer(TokenizerConfig(**tokenizer))
        if self.src.preprocess:
            preprocessor(self.src.preprocess)  # fail at start, not at the first unit
        get_format(self.src.format)  # (a format of your own: imported here, at start too)
        self._fs = source_filesystem(self.src.uri, self.src.storage_options)
        #: closed (:meth:`close`): calls that would wait for a unit are refused
        self._closed = False
        self.threads = max(1, int(threads))
        pool = self.src.pool if isinstance(self.src.pool, PoolConfig) else PoolConfig()
        #: documents preprocessed at once (what the adaptive policy counts per loader)
        self.parallel = pool.size or self.threads
        self._docs: DocPool | None = None
        # (a pool of one behind several read threads too: each thread processed its own
        # unit's documents, 3 at once where the loader said 1, and the policy sized the
        # source 3x over; a review)
        if pool.kind == "process" or self.parallel > 1 or self.threads > 1:
            self._docs = DocPool(self.src, tokenizer, self.parallel, pool.kind)
        self._pool = ThreadPoolExecutor(self.threads,
                                        thread_name_prefix=f"msd-load-{self.src.name}")
        self._data: dict[tuple[int, int], _UnitData] = {}
        self._ready: dict[tuple[int, int], asyncio.Future[Any]] = {}
        #: keys the planner assigned and has not released: the units kept after a fetch.
        #: A re-created constructor may fetch a unit after the planner released it (the
        #: re-sent steps); kept, it stayed for good, as nothing releases it again
        self._held: set[tuple[int, int]] = set()
        #: fetch calls using each key now: its release waits for them (see release)
        self._pins: dict[tuple[int, int], int] = {}
        #: keys read again that read differently from their plan, and how many times
        #: (:data:`DIFFERENT_READS`); a key read as planned leaves it
        self._different: dict[tuple[int, int], int] = {}
        self._todo: asyncio.Queue[tuple[int, int]] | None = None
        #: keys being read now, and when their read began: a key queued twice (released,
        #: then assigned again before its read) is read once
        self._reading: dict[tuple[int, int], float] = {}
        self._task: asyncio.Task[None] | None = None
        self.docs_read = 0
        self.tokens_read = 0
        self.units_read = 0
        self.read_seconds = 0.0
        #: CPU seconds of the read threads and of the pool's workers (see stats())
        self.cpu_seconds = 0.0
        self.cpu_wait_seconds = 0.0  # of their busy time: waiting for a core
        self.tokens_fetched = 0
        self.quarantined_docs = 0
        self.quarantined_files = 0
        self.quarantined_keys: list[str] = []

    # ------------------------------------------------------------ assignment
    async def assign(self, keys: list[tuple[int, int]]) -> int:
        """Queue ``(epoch, unit)`` keys for reading, in order, and keep them until
        :meth:`release`; returns how many were new."""
        keys = [(int(k[0]), int(k[1])) for k in keys]
        new = self._queue(keys)
        self._held.update(keys)
        return new

    def _queue(self, keys: list[tuple[int, int]]) -> int:
        """Queue the keys not queued or read yet; returns how many were new."""
        if self._closed:  # (its reader is stopped: the call would wait for ever)
            raise RuntimeError(f"loader {self.index} of source {self.src.name!r} was closed; "
                               "ask the loader now in its slot")
        for epoch, unit in keys:  # (all checked before any is queued)
            if not 0 <= unit < len(self.units) or epoch < 0:
                # (a unit past the end raised inside the read's own bookkeeping, which
                # settled no future: the call waited for ever; a negative one read the
                # last unit under another key; a review)
                raise ValueError(f"loader {self.index} of source {self.src.name!r} was asked "
                                 f"for unit {unit} of epoch {epoch}: the source has units "
                                 f"0..{len(self.units) - 1}, epochs from 0")
        loop = asyncio.get_running_loop()
        if self._todo is None:
            self._todo = asyncio.Queue()
            self._task = asyncio.create_task(self._reader())
        new = 0
        for k in keys:
            if k not in self._ready:
                self._ready[k] = loop.create_future()
                self._todo.put_nowait(k)
                new += 1
        return new

    async def _reader(self) -> None:
        """Read assigned units in order, up to ``threads`` at a time (the read pool's size)."""
        assert self._todo is not None
        slots = asyncio.Semaphore(self.threads)
        while True:
            key = await self._todo.get()
            if not self._wants_read(key):
                continue
            await slots.acquire()
            if not self._wants_read(key):  # (released while it waited for a read thread: a
                slots.release()  # unit read and dropped, the load a scale-up moved off)
                continue
            self._reading[key] = time.monotonic()
            task = asyncio.create_task(self._read(key))

            task.add_done_callback(lambda _t: slots.release())

    def _wants_read(self, key: tuple[int, int]) -> bool:
        """Whether unit ``key`` is assigned, not read yet and not being read."""
        fut = self._ready.get(key)
        return fut is not None and not fut.done() and key not in self._reading

    async def _read(self, key: tuple[int, int]) -> None:
        """Read unit ``key`` and settle its future: the one assigned when the read ends (a
        unit released while it was read and assigned again takes this read).

        ``key`` leaves :attr:`_reading` in the same step as that future is looked at: left
        to the task's done callback, one step of the loop later, a fetch that assigned
        the released unit again in between had it skipped by :meth:`_reader` as still
        being read, and waited for it until its timeout.
        """
        try:
            await self._read_unit(key)
        except BaseException as e:
            # (whatever fails in the read's own bookkeeping reaches those who wait for the
            # unit: they waited for ever, behind a task error nobody read; a review)
            fut = self._ready.get(key)
            if fut is not None and not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else
                                  RuntimeError(f"the read of unit {key[1]} (epoch {key[0]}) "
                                               f"of source {self.src.name!r} stopped: {e!r}"))
                del self._ready[key]
            raise
        finally:
            self._reading.pop(key, None)

    async def _read_unit(self, key: tuple[int, int]) -> None:
        """:meth:`_read` but for :attr:`_reading`."""
        loop = asyncio.get_running_loop()
        quarantine: list[DataError] = []
        busy: list[float] = []
        cpu: list[tuple[float, float]] = []  # CPU and core-wait seconds of the busy time
        failed: BaseException | None = None
        try:
            docs = await loop.run_in_executor(
                self._pool, read_unit, self.src, self._fs,
                self.units[key[1]], self.tokenizer, quarantine, self._docs, busy, cpu)
        except asyncio.CancelledError as e:
            task = asyncio.current_task()
            if self._closed or task is None or task.cancelling():
                raise  # (this read was stopped: the waits for the loader's units end too)
            # the work was cancelled under it (a preprocess pool replaced meanwhile): said,
            # not left for whoever waits for the unit to find out at its timeout
            failed = e
        except BaseException as e:  # handed to whoever waits for this unit (raised here,
            failed = e                # a SystemExit of user code ended the read loop)
        if failed is not None:
            if not isinstance(failed, DataError | ConfigError | OSError):  # (they name it)
                # a tokenizer's, a format's or a preprocess pool's own failure: say where
                named = RuntimeError(f"source {self.src.name!r}, file "
                                     f"{self.units[key[1]].path!r} (epoch {key[0]}, unit "
                                     f"{key[1]}): {type(failed).__name__}: {failed}")
                named.__cause__ = failed
                failed = named
            fut = self._ready.get(key)
            if fut is not None and not fut.done():
                fut.set_exception(failed)
            if fut is not None and not isinstance(failed, DataError | ConfigError):
                # (the calls waiting have the error; the next reads the unit again: a held
                # unit kept its failed read as its answer for good, and a failure of the
                # moment, as a pool replaced under the read, failed every later fetch until
                # the service gave up; a review.  Bad input fails alike every time: kept)
                del self._ready[key]
            return
        # counted together, so a poll sees a unit's busy and CPU seconds at once
        self.read_seconds += sum(busy)
        self.cpu_seconds += sum(c for c, _ in cpu)
        self.cpu_wait_seconds += sum(w for _, w in cpu)
        self._quarantine(key, quarantine)
        data = _UnitData(docs)
        self.units_read += 1
        self.docs_read += len(docs)
        self.tokens_read += int(data.lengths.sum())
        fut = self._ready.get(key)
        if fut is None:  # released while it was being read
            return
        self._data[key] = data
        if not fut.done():
            fut.set_result(data.lengths)

    def _quarantine(self, key: tuple[int, int], errors: list[DataError]) -> None:
        for e in errors:
            if e.row is None:
                self.quarantined_files += 1
            else:
                self.quarantined_docs += 1
            where = f"{e.path or self.units[key[1]].path}" + ("" if e.row is None else f":{e.row}")
            self.quarantined_keys.append(f"epoch {key[0]} {where}: {e}")
            _log.warning("source %r quarantined %s (epoch %d): %s", self.src.name, where,
                         key[0], e)
        del self.quarantined_keys[:-_KEEP_KEYS]

    # ---------------------------------------------------------------- serving
    async def metadata(self, epoch: int, unit: int) -> np.ndarray:
        """Token lengths of the unit's rows, once it is read (assigns it if needed).

        The planner asks for units it holds: one only a fetch reads now is kept after it.
        """
        key = (int(epoch), int(unit))
        await self.assign([key])  # (queues it only if not queued or read already)
        return await asyncio.shield(self._ready[key])

    async def fetch(self, requests: np.ndarray | list[tuple[int, int, int, int, int]]
                    ) -> JoinedPieces:
        """Tokens of planned pieces, given as ``(epoch, unit, row, start, end)`` (rows of an
        integer array of shape ``(n, 5)``, or tuples).

        Returns, joined into one array (:func:`~msd_dask.core.packing.join_pieces`;
        :func:`~msd_dask.core.packing.split_pieces` undoes it), ``doc[start:end + 1]``
        for each (one token more than the piece where the document goes on: the
        label of the piece's last token); for an image+text document a tuple
        ``(tokens, patches)``, the patches of the piece's image tokens
        (:meth:`~msd_dask.sources.documents.ImageDoc.piece`).  A
        unit that is not held (re-assigned after a loader was lost or retired)
        is read first.  Units stay until the planner releases them
        (:meth:`release`), so a step can be fetched again after a constructor
        was lost; a unit the planner does not hold (it released the unit before a
        re-created constructor fetched the steps re-sent to it) is read for this
        fetch and not kept.
        """
        pinned: set[tuple[int, int]] = set()
        try:
            return await self._fetch(requests, pinned)
        finally:
            for key in pinned:
                n = self._pins[key] - 1
                if n:
                    self._pins[key] = n
                else:
                    del self._pins[key]
                    if key not in self._held:  # released, or never assigned here
                        self._drop(key)

    async def _fetch(self, requests: np.ndarray | list[tuple[int, int, int, int, int]],
                     pinned: set[tuple[int, int]]) -> JoinedPieces:
        """:meth:`fetch`; each key it uses is pinned once (counted in ``_pins``) and added
        to ``pinned``, for :meth:`fetch` to unpin."""
        out: list[np.ndarray | tuple[np.ndarray, np.ndarray]] = []
        tokens = 0  # (counted once the whole fetch is cut: a failed one delivers nothing)
        rows: Sequence[Sequence[int]] = (requests.reshape(-1, 5).tolist()
                                         if isinstance(requests, np.ndarray) else requests)
        for epoch, unit, row, start, end in rows:
            key = (int(epoch), int(unit))
            if key not in pinned:
                pinned.add(key)
                self._pins[key] = self._pins.get(key, 0) + 1
            if key not in self._ready:
                self._queue([key])  # (not assigned: the planner does not release it)
            await asyncio.shield(self._ready[key])
            data = self._data.get(key)
            if data is None:
                # another fetch that waited for the same read found it read differently
                # (below) and dropped it before this one woke
                raise RuntimeError(
                    f"source {self.src.name!r}, file {self.units[key[1]].path!r}, row {int(row)} "
                    f"(epoch {key[0]}): read again, and another fetch waiting for it found "
                    "that the file read differently from what the step was planned with; "
                    "reading it again")
            i = int(row) - self.units[key[1]].row_offset
            doc = data.docs[i] if 0 <= i < len(data.docs) else None
            if doc is None or len(doc) < int(end):
                # the unit read again (this loader re-created, or given another's units)
                # is not what the step was planned from: under on_error: skip a store that
                # failed for a moment quarantined the file, or a preprocess failed once.
                # Read again at the next fetch (the constructor asks again), rather than cut
                # a piece of what is not there; DIFFERENT_READS such reads, and the file
                # changed or went since it was planned: named, the service cannot go on
                self._drop(key)
                what = (f"{len(doc)} tokens" if doc is not None else
                        f"{len(data.docs)} rows in the unit")
                reads = self._different[key] = self._different.get(key, 0) + 1
                said = (f"read again, the document has {what}, but the step was planned with "
                        f"a piece up to token {int(end)}")
                if reads >= DIFFERENT_READS:
                    raise DataError(
                        f"{said}, {reads} times: the file changed, or cannot be read, since its "
                        "documents were planned (the steps planned with it cannot be served; "
                        "under on_error: skip too)", source=self.src.name,
                        path=self.units[key[1]].path, row=int(row))
                raise RuntimeError(
                    f"source {self.src.name!r}, file {self.units[key[1]].path!r}, row {int(row)} "
                    f"(epoch {key[0]}): {said}: the file read differently (a read error "
                    "quarantined under on_error: skip?); reading it again")
            if self._different:
                self._different.pop(key, None)
            if isinstance(doc, ImageDoc):
                out.append(doc.piece(int(start), int(end)))
            else:
                out.append(doc[int(start):int(end) + 1])
            tokens += int(end) - int(start)
        self.tokens_fetched += tokens
        return join_pieces(out)

    async def fetch_packed(self, requests: bytes) -> bytes:
        """:meth:`fetch` for a constructor on another worker: ``requests`` as the bytes of
        an int64 array of shape ``(n, 5)``, the answer pickled into one ``bytes``.

        A Dask message serialises each array of an answer on its own, with a header
        of its own, and measures the size of every object in it first; one ``bytes``
        costs both ends a fraction of that (the copy of the tokens into it is cheap).
        """
        import pickle

        joined = await self.fetch(np.frombuffer(requests, dtype=np.int64).reshape(-1, 5))
        return pickle.dumps(joined, protocol=5)

    async def release(self, keys: list[tuple[int, int]]) -> None:
        """Forget units the planner will not use (e.g. after a re-partition).

        A unit a fetch uses now is dropped when the last such fetch ends, rather than
        the fetch cancelled: its constructor retried it, which read the unit again.
        """
        for k in keys:
            key = (int(k[0]), int(k[1]))
            self._held.discard(key)
            if key not in self._pins:
                self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        """Drop unit ``key``'s documents; a call still waiting for them is cancelled."""
        self._data.pop(key, None)
        fut = self._ready.pop(key, None)
        if fut is not None and not fut.done():
            fut.cancel()

    async def ping(self) -> int:
        """Liveness check; returns the number of units held."""
        return len(self._data)

    async def stats(self) -> dict[str, Any]:
        """Counters: documents and tokens read, units buffered, read seconds.

        ``read_seconds`` are busy seconds (reading rows, plus preprocessing and
        tokenizing summed over the pool's workers) and ``threads`` the documents
        processed at once, so one loader supplies ``threads / (read_seconds /
        tokens_read)`` tokens/s at most.  ``cpu_seconds``: the CPU time of that
        work, the read threads' plus the pool's (each pool thread's time in the
        chunks of documents it ran; a pool process's ``process_time`` in its
        chunks), and ``cpu_wait_seconds`` the busy time it was runnable but
        waited for a core (other threads or processes had them; Linux
        ``schedstat``, 0.0 elsewhere).  ``cpu_seconds / (read_seconds -
        cpu_wait_seconds)`` near 1 is CPU-bound work, a few percent work that waits
        (on a store, or for the GIL: a thread blocked on it is busy, neither on
        a core nor waiting for one).  Not counted: what sending documents to a
        process pool and results back costs this process.
        """
        now = time.monotonic()
        return {
            "source": self.src.name,
            "index": self.index,
            "threads": self.parallel,
            "read_threads": self.threads,
            "pool": self.src.pool.kind if isinstance(self.src.pool, PoolConfig) else "thread",
            "docs_read": self.docs_read,
            "tokens_read": self.tokens_read,
            "units_read": self.units_read,
            "units_buffered": len(self._data),
            "tokens_buffered": int(sum(int(d.lengths.clip(0).sum()) for d in self._data.values())),
            "read_seconds": self.read_seconds,
            "cpu_seconds": self.cpu_seconds,
            "cpu_wait_seconds": self.cpu_wait_seconds,
            "tokens_fetched": self.tokens_fetched,
            "quarantined_docs": self.quarantined_docs,
            "quarantined_files": self.quarantined_files,
            "quarantined": list(self.quarantined_keys),
            # the longest reads going on: what a fetch that waits on this loader waits for
            "reading": [{"path": self.units[k[1]].path, "epoch": k[0],
                         "seconds": round(now - t, 1)}
                        for k, t in sorted(self._reading.items(), key=lambda kt: kt[1])[:3]],
        }

    async def close(self) -> None:
        """Stop reading and drop every unit held, fetched or not: a fetch or metadata
        call still waiting for a unit here ends at once (cancelled) and its caller asks
        the loader now in this slot, instead of waiting on one that reads nothing more
        and keeping its units in memory."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        self._held.clear()
        for key in list(self._ready):
            self._drop(key)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._docs is not None:
            self._docs.close()
