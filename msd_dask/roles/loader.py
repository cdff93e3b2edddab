"""Source Loader: a Dask actor that owns the file access of a share of one source.

The planner assigns it ``(epoch, unit)`` keys in stream order; it reads
up to ``threads`` units at once on a small thread pool (pyarrow and zstd
release the GIL), preprocesses and tokenizes the documents of each unit on a
bounded :class:`DocPool` (threads or processes, ``sources[].pool``; the
documents keep their row order), reports the lengths
(:meth:`SourceLoader.metadata`) and keeps the tokens until constructors fetch
them (:meth:`SourceLoader.fetch`).  A unit's tokens stay until the planner
releases it (once every step that used it was claimed), so a loader holds the
units of its source's current shuffle window, those assigned after it
(``read_ahead`` units holding at most ``read_ahead_tokens``) and those behind
it not yet released.

All methods are ``async``: they run on the worker's event loop, and calls
from other actors never block a thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from msd_dask.core.config import PoolConfig, SourceConfig, TokenizerConfig, resolve_import_path
from msd_dask.core.packing import JoinedPieces, join_pieces
from msd_dask.errors import DataError
from msd_dask.sources.tokenizer import make_tokenizer

if TYPE_CHECKING:
    from msd_dask.core.units import Unit

# formats (fsspec, zstandard, tarfile), storage and vision are imported where a unit is read:
# a training process imports this module when it unpickles a loader's actor handle, and
# every module costs each training process memory (tests/test_imports.py)

__all__ = ["SourceLoader", "read_unit", "ImageDoc", "DocPool"]


_EMPTY = np.zeros(0, dtype=np.int32)
_KEEP_KEYS = 100  # quarantined keys kept for stats() (all are logged)
_log = logging.getLogger("msd_dask.roles.loader")


@functools.lru_cache(maxsize=32)
def _preprocessor(spec: str) -> Callable[[str, dict[str, Any]], str | None]:
    fn = resolve_import_path(spec)
    if not callable(fn):
        raise TypeError(f"preprocess {spec!r} is a {type(fn).__name__}, not a function")
    return fn


def with_source(e: BaseException, source: str, path: str | None = None, *,
                whole_file: bool = False) -> DataError:
    """``e`` as a :class:`DataError` naming ``source`` (and ``path`` if it names no file).

    ``whole_file``: the error is the file's (its ``row`` is dropped).
    """
    if not isinstance(e, DataError):
        return DataError(f"cannot read: {e!r}", source=source, path=path)
    if e.source is not None and not (whole_file and e.row is not None):
        return e
    where = ([f"file '{e.path}'"] if e.path is not None else []) + (
        [f"row {e.row}"] if e.row is not None else [])
    msg = str(e)
    prefix = ", ".join(where) + ": "
    if where and msg.startswith(prefix):
        msg = msg[len(prefix):]
    if e.source is not None and msg.startswith(f"source '{e.source}', "):
        msg = msg[len(f"source '{e.source}', "):]
        if where and msg.startswith(prefix):
            msg = msg[len(prefix):]
    out = DataError(msg if e.row is None or not whole_file else f"at row {e.row}: {msg}",
                    source=source, path=e.path if e.path is not None else path,
                    row=None if whole_file else e.row)
    out.__cause__ = e.__cause__ or e
    return out


class ImageDoc:
    """An image+text document as a loader keeps it.

    ``tokens`` is ``[image_id] * n + text tokens + [eod_id]`` and ``patches`` the
    image's ``n`` patches (``uint8 [n, patch·patch·3]``, see :mod:`msd_dask.sources.vision`),
    the ``i``-th patch standing for the ``i``-th token.  ``len()`` is its length in
    tokens, image tokens included.
    """

    __slots__ = ("tokens", "patches")

    def __init__(self, tokens: np.ndarray, patches: np.ndarray):
        self.tokens = tokens
        self.patches = patches

    def __len__(self) -> int:
        return len(self.tokens)

    def piece(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, end + 1)`` and the patches of the image tokens in ``[start, end)``."""
        n = len(self.patches)
        return self.tokens[start:end + 1], self.patches[min(start, n):min(end, n)]


def read_unit(src: SourceConfig, fs: Any, unit: Unit, tokenizer: Any,
              quarantine: list[DataError] | None = None,
              pool: DocPool | None = None,
              timing: list[float] | None = None,
              cpu: list[tuple[float, float]] | None = None) -> list[np.ndarray | ImageDoc]:
    """Read and tokenize every row of ``unit``; one array per row, in row order.

    The arrays are uint16 for a vocabulary of at most 65,536 ids, else int32.

    ``pool``: preprocess and tokenize the documents on it (several at once);
    ``None`` does it here, one after the other.  The result is the same.
    ``timing``: the busy seconds (reading the rows, plus preprocessing summed
    over the pool's workers) are appended to it.  ``cpu``: the CPU seconds of
    that busy time and the part of it spent waiting for a core (runnable while
    other threads had the cores) are appended as a pair: this thread's while it
    reads the rows (and preprocesses, without a pool), plus the pool's workers'
    summed over them (:meth:`DocPool.map`).  Both are measured over exactly the
    busy intervals, so ``cpu / (busy - wait)`` is the share of that time spent
    on a core (not counted: this thread waiting for the pool, and putting the
    pool's results in order).

    Rows of an image+text source (``src.image_field`` set) whose image field is not
    null become an :class:`ImageDoc`: the image decoded, resized and cut into patches
    (``src.image``), one image token per patch before the text's tokens.

    With ``src.preprocess`` set, ``fn(text, record)`` runs on every document
    first: a string replaces the text, ``None`` drops the document (its row
    keeps an empty placeholder array, so its length is 0 and the stream skips
    it; row indexes do not move).  Rows the format skips (blank JSON lines)
    get the same empty placeholder.

    Bad input follows ``src.on_error``: ``"fail"`` raises a :class:`DataError`
    naming the source, file and row; ``"skip"`` quarantines it instead: a bad
    document (missing field, invalid UTF-8, not text, preprocess failure) gets
    an empty placeholder, a file that cannot be read (missing, corrupt,
    truncated) yields no rows at all, and each error is appended to
    ``quarantine`` (``error.row is None`` for a whole file).
    """
    if getattr(src, "on_error", "fail") != "skip":
        try:
            return _read_rows(src, fs, unit, tokenizer, [], None, pool, timing, cpu)
        except (DataError, OSError) as e:
            raise with_source(e, src.name, unit.path) from e
    out: list[np.ndarray | ImageDoc] = []
    bad: list[DataError] = []
    try:
        _read_rows(src, fs, unit, tokenizer, out, bad, pool, timing, cpu)
    except (DataError, OSError) as e:
        if quarantine is not None:
            quarantine.append(with_source(e, src.name, unit.path, whole_file=True))
        return []
    if quarantine is not None:
        quarantine.extend(bad)
    return out


def _read_rows(src: SourceConfig, fs: Any, unit: Unit, tokenizer: Any,
               out: list[np.ndarray | ImageDoc],
               bad: list[DataError] | None, pool: DocPool | None = None,
               timing: list[float] | None = None,
               cpu: list[tuple[float, float]] | None = None) -> list[np.ndarray | ImageDoc]:
    """Append the tokens of the unit's rows to ``out`` (``bad``: collect row errors).

    The rows are read first, then their documents are preprocessed and tokenized
    (on ``pool`` when given); results and errors are taken in row order.
    """
    from msd_dask.formats import get_format

    fmt = get_format(src.format)
    # formats that can report a bad row without ending the read (JSON lines) do so
    tolerant = bad is not None and "errors" in inspect.signature(fmt.read).parameters
    read: Any = fmt.read
    fields = [src.text_field] + ([src.image_field] if src.image_field else [])

    def rows_in_order() -> list[tuple[int, Any]]:
        rows = read(fs, unit, fields, errors="yield") if tolerant else read(fs, unit, fields)
        items: list[tuple[int, Any]] = []
        for row, rec in rows:
            expected = unit.row_offset + len(items)
            if row < expected:
                raise DataError(f"rows out of order (expected {expected})", source=src.name,
                                path=unit.path, row=row)
            while len(items) < row - unit.row_offset:  # rows the format skipped (blank lines)
                items.append((unit.row_offset + len(items), None))
            items.append((row, rec))
        return items

    items, seconds, c, w = _cpu_timed(rows_in_order)
    todo = [(row, rec) for row, rec in items if rec is not None and not isinstance(rec, DataError)]
    busy = [seconds]
    used = [(c, w)]  # CPU and core-wait seconds of the busy time
    if pool is None:
        prep = _preprocessor(src.preprocess) if src.preprocess else None
        done, seconds, c, w = _process_in_thread(src, prep, tokenizer, unit.path, todo)
        busy.append(seconds)
        used.append((c, w))
    else:
        done = pool.map(unit.path, todo, busy, used)
    if timing is not None:
        timing.append(sum(busy))
    if cpu is not None:
        cpu.append((sum(c for c, _ in used), sum(w for _, w in used)))
    results = iter(done)
    for _row, rec in items:
        res: np.ndarray | ImageDoc | DataError
        if rec is None:
            res = _EMPTY
        elif isinstance(rec, DataError):
            res = rec
        else:
            res = next(results)
        if isinstance(res, DataError):
            if bad is None:
                raise res
            bad.append(with_source(res, src.name, unit.path))
            res = _EMPTY
        out.append(res)
    return out


def process_docs(src: SourceConfig, prep: Callable[[str, dict[str, Any]], str | None] | None,
                 tokenizer: Any, path: str, items: Sequence[tuple[int, dict[str, Any]]]
                 ) -> list[np.ndarray | ImageDoc | DataError]:
    """Preprocess and tokenize ``(row, record)`` items of file ``path``, in order.

    Returns one result per item: the tokens, an :class:`ImageDoc`, or the
    :class:`DataError` of a bad document, as a value (:func:`_cpu_timed` times it).
    """
    compact = _compacts(tokenizer)
    out: list[np.ndarray | ImageDoc | DataError] = []
    for row, rec in items:
        try:
            tokens = _tokenize(src, rec, prep, tokenizer, path, row)
            out.append(_compact(_with_image(src, rec, tokens, tokenizer, path, row), compact))
        except DataError as e:
            out.append(e)
    return out


def _compacts(tokenizer: Any) -> bool:
    """Whether tokens of ``tokenizer`` fit uint16 (a vocabulary of at most 65,536 ids)."""
    return bool(tokenizer.vocab_size <= 1 << 16)


def _compact(doc: np.ndarray | ImageDoc, compact: bool) -> np.ndarray | ImageDoc:
    """``doc`` with uint16 tokens if ``compact`` (a vocabulary of at most 65,536 ids).

    Done per document as it is tokenized, so a unit's int32 tokens are never all held
    at once (their freed memory would stay in the loader's heap, between the documents
    kept).
    """
    if not compact:
        return doc
    if isinstance(doc, ImageDoc):
        return ImageDoc(doc.tokens.astype(np.uint16, copy=False), doc.patches)
    return doc.astype(np.uint16, copy=False)


# ------------------------------------------------------------------ the document pool
_WORKER: dict[str, Any] = {}  # in a pool process: its source, tokenizer and preprocessor


def _source_config(source: dict[str, Any]) -> SourceConfig:
    """A loader's SourceConfig from its payload (``dataclasses.asdict``, weight dropped)."""
    from msd_dask.core.config import WeightSchedule

    source = dict(source)
    source["weight"] = WeightSchedule.constant(1.0)
    return SourceConfig(**source)


def _init_process(source: dict[str, Any], tokenizer: dict[str, Any]) -> None:
    """Initializer of a pool process: build the tokenizer, import the preprocessor once."""
    src = _source_config(source)
    _WORKER["src"] = src
    _WORKER["tokenizer"] = make_tokenizer(TokenizerConfig(**tokenizer))
    _WORKER["prep"] = _preprocessor(src.preprocess) if src.preprocess else None


class _Failure:
    """A bad document's :class:`DataError`, as it crosses from a pool process (picklable)."""

    __slots__ = ("message", "row", "cause")

    def __init__(self, e: DataError):
        prefix = str(DataError("", source=e.source, path=e.path, row=e.row))
        msg = str(e)
        self.message = msg[len(prefix):] if msg.startswith(prefix) else msg
        self.row = e.row
        cause = e.__cause__
        self.cause = None if cause is None else f"{type(cause).__name__}: {cause}"

    def error(self, source: str, path: str) -> DataError:
        out = DataError(self.message, source=source, path=path, row=self.row)
        if self.cause is not None:
            out.__cause__ = RuntimeError(f"in a pool process: {self.cause}")
        return out


#: What a pool's task returns for a chunk of documents: the results, the busy seconds,
#: the CPU seconds and the seconds the task waited for a core.
_Chunk = tuple[list[Any], float, float, float]


def _process_in_worker(path: str, items: list[tuple[int, dict[str, Any]]]) -> _Chunk:
    """A chunk of documents in a pool process: results, busy, CPU and core-wait seconds.

    The CPU seconds are the process's (``time.process_time``: threads the
    preprocessor or tokenizer start count too), the wait the task thread's.
    """
    res, busy, cpu, waited = _cpu_timed(
        process_docs, _WORKER["src"], _WORKER["prep"], _WORKER["tokenizer"], path, items,
        clock=time.process_time)
    return [_Failure(r) if isinstance(r, DataError) else r for r in res], busy, cpu, waited


def _process_in_thread(src: SourceConfig, prep: Callable[[str, dict[str, Any]], str | None] | None,
                       tokenizer: Any, path: str, items: Sequence[tuple[int, dict[str, Any]]]
                       ) -> _Chunk:
    """Documents processed on this thread: results, busy, CPU and core-wait seconds."""
    return _cpu_timed(process_docs, src, prep, tokenizer, path, items)


def _cpu_timed(fn: Callable[..., Any], *args: Any,
               clock: Callable[[], float] = time.thread_time) -> tuple[Any, float, float, float]:
    """``fn(*args)`` and the seconds it took: ``(result, busy, cpu, waited)``.

    ``busy`` is the wall time, ``cpu`` this thread's CPU time in it (``clock``;
    ``time.process_time`` counts every thread of the process), ``waited`` the
    time this thread was runnable but waited for a core (:func:`_run_delay`).
    The CPU and wait readings are taken inside the wall clock's, so ``cpu +
    waited <= busy`` for one thread (a preemption while reading them would
    otherwise count as waiting but not as busy); the rest of ``busy`` the
    thread was blocked (on I/O, a lock, the GIL).
    """
    t0 = time.perf_counter()
    w0, c0 = _run_delay(), clock()
    out = fn(*args)
    c1 = clock()
    w1 = _run_delay()
    return out, time.perf_counter() - t0, c1 - c0, w1 - w0


def _run_delay() -> float:
    """Seconds this thread was runnable but waited for a core (Linux; 0.0 elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


class DocPool:
    """Preprocesses and tokenizes documents on ``size`` threads or processes.

    :meth:`map` splits a unit's documents into contiguous chunks, runs them on
    the pool and returns the results in the documents' order, so the stream
    does not depend on the pool.

    Parameters
    ----------
    src : SourceConfig
    tokenizer : dict
        The tokenizer config (a process builds its own tokenizer from it).
    size : int
        Documents processed at once.
    kind : {"thread", "process"}
        ``"process"``: spawned processes, for preprocessing that holds the GIL.
        A daemonic process (a Dask worker by default) cannot start them: a
        :class:`RuntimeError` says so.
    """

    def __init__(self, src: SourceConfig, tokenizer: dict[str, Any], size: int,
                 kind: str = "thread"):
        if kind not in ("thread", "process"):
            raise ValueError(f"pool kind must be 'thread' or 'process', got {kind!r}")
        self.src = src
        self.size = max(1, int(size))
        self.kind = kind
        self._ex: Executor
        if kind == "process":
            if multiprocessing.current_process().daemon:
                raise RuntimeError(
                    f"source '{src.name}': pool.kind 'process' cannot start processes in a "
                    "daemonic Dask worker; run the workers with distributed.worker.daemon: "
                    "false (DASK_DISTRIBUTED__WORKER__DAEMON=False)")
            payload = dataclasses.asdict(src)
            payload.pop("weight")
            self._ex = ProcessPoolExecutor(
                self.size, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_process, initargs=(payload, dict(tokenizer)))
        else:
            self._tokenizer = make_tokenizer(TokenizerConfig(**tokenizer))
            self._prep = _preprocessor(src.preprocess) if src.preprocess else None
            self._ex = ThreadPoolExecutor(self.size, thread_name_prefix=f"msd-prep-{src.name}")

    def map(self, path: str, items: Sequence[tuple[int, dict[str, Any]]],
            timing: list[float] | None = None,
            cpu: list[tuple[float, float]] | None = None
            ) -> list[np.ndarray | ImageDoc | DataError]:
        """:func:`process_docs` of ``items`` on the pool, results in order.

        Parameters
        ----------
        path : str
            The file the documents come from (named by their errors).
        items : sequence of tuple
            ``(row, record)`` of each document.
        timing : list of float, optional
            The busy seconds of the pool's workers (summed over the chunks) are
            appended.
        cpu : list of tuple, optional
            ``(CPU seconds, seconds waiting for a core)`` of that work, summed over
            the chunks, is appended.  A thread measures each chunk it runs
            (:func:`_cpu_timed`: its CPU time, and its run delay from Linux
            ``schedstat``, 0.0 elsewhere); a process returns its
            ``time.process_time()`` and its task thread's run delay with each chunk's
            results.  Not counted: sending the documents to processes and their
            results back (the executor's threads in this process).

        Returns
        -------
        list
            One result per item, in order: the tokens, an :class:`ImageDoc`, or
            the :class:`DataError` of a bad document.
        """
        if not items:
            return []
        n = min(len(items), 4 * self.size)
        bounds = [len(items) * i // n for i in range(n + 1)]
        chunks = [list(items[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        futs: list[Any]
        if self.kind == "process":
            futs = [self._ex.submit(_process_in_worker, path, c) for c in chunks]
        else:
            futs = [self._ex.submit(_process_in_thread, self.src, self._prep, self._tokenizer,
                                    path, c) for c in chunks]
        out: list[np.ndarray | ImageDoc | DataError] = []
        busy = used = waited = 0.0
        for f in futs:
            res, seconds, c, w = f.result()
            busy += seconds
            used += c
            waited += w
            out.extend(r.error(self.src.name, path) if isinstance(r, _Failure) else r
                       for r in res)
        if timing is not None:
            timing.append(busy)
        if cpu is not None:
            cpu.append((used, waited))
        return out

    def close(self) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)


def _tokenize(src: SourceConfig, rec: dict[str, Any],
              prep: Callable[[str, dict[str, Any]], str | None] | None, tokenizer: Any,
              path: str, row: int) -> np.ndarray:
    text = rec.get(src.text_field)
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"field '{src.text_field}' is not valid UTF-8: {e}",
                            source=src.name, path=path, row=row) from e
    if not isinstance(text, str):
        raise DataError(f"field '{src.text_field}' is {type(text).__name__}, not text",
                        source=src.name, path=path, row=row)
    if prep is not None:
        try:
            text = prep(text, rec)
        except Exception as e:  # noqa: BLE001 - any failure of user code names the row
            raise DataError(f"preprocess {src.preprocess!r} raised {type(e).__name__}: {e}",
                            source=src.name, path=path, row=row) from e
        if text is None:
            return _EMPTY
        if not isinstance(text, str):
            raise DataError(f"preprocess {src.preprocess!r} returned "
                            f"{type(text).__name__}, not str or None",
                            source=src.name, path=path, row=row)
    return tokenizer.encode(text)


def _with_image(src: SourceConfig, rec: dict[str, Any], tokens: np.ndarray, tokenizer: Any,
                path: str, row: int) -> np.ndarray | ImageDoc:
    """``tokens`` of a text document, or the :class:`ImageDoc` of an image+text one."""
    if not src.image_field or len(tokens) == 0:  # a text source, or a dropped document
        return tokens
    data = rec.get(src.image_field)
    if data is None:  # no image: a text document of an image+text source
        return tokens
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DataError(f"field '{src.image_field}' is {type(data).__name__}, not image bytes",
                        source=src.name, path=path, row=row)
    assert src.image is not None
    if tokenizer.image_id is None:
        raise DataError("the tokenizer has no image token id (set tokenizer.image_token_id)",
                        source=src.name, path=path, row=row)
    try:
        from msd_dask.sources.vision import image_patches

        patches = image_patches(bytes(data), src.image.size, src.image.patch)
    except ValueError as e:
        raise DataError(f"field '{src.image_field}': {e}", source=src.name, path=path,
                        row=row) from None
    out = np.empty(len(patches) + len(tokens), dtype=np.int32)
    out[:len(patches)] = tokenizer.image_id
    out[len(patches):] = tokens
    return ImageDoc(out, patches)


class _UnitData:
    """A read unit's documents, held until the planner releases the unit.

    Their tokens are uint16 when the vocabulary allows (:func:`process_docs`
    compacts each document as it is tokenized): half the memory of a loader's
    buffer and of every fetch; the constructor packs them into int32 rows
    either way.
    """

    __slots__ = ("docs", "lengths")

    def __init__(self, docs: list[np.ndarray | ImageDoc]):
        self.docs: list[np.ndarray | ImageDoc | None] = list(docs)
        self.lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))


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
        from msd_dask.sources.storage import open_source

        self.src = _source_config(source)
        self.units = [Unit(*u) for u in units]
        self.index = index
        self.tokenizer = make_tokenizer(TokenizerConfig(**tokenizer))
        if self.src.preprocess:
            _preprocessor(self.src.preprocess)  # fail at start, not at the first unit
        self._files = open_source(self.src.uri, self.src.storage_options)
        self.threads = max(1, int(threads))
        pool = self.src.pool if isinstance(self.src.pool, PoolConfig) else PoolConfig()
        #: documents preprocessed at once (what the adaptive policy counts per loader)
        self.parallel = pool.size or self.threads
        self._docs: DocPool | None = None
        if pool.kind == "process" or self.parallel > 1:
            self._docs = DocPool(self.src, tokenizer, self.parallel, pool.kind)
        self._pool = ThreadPoolExecutor(self.threads,
                                        thread_name_prefix=f"msd-load-{self.src.name}")
        self._data: dict[tuple[int, int], _UnitData] = {}
        self._ready: dict[tuple[int, int], asyncio.Future[Any]] = {}
        self._todo: asyncio.Queue[tuple[int, int]] | None = None
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
        """Queue ``(epoch, unit)`` keys for reading, in order; returns how many were new."""
        loop = asyncio.get_running_loop()
        if self._todo is None:
            self._todo = asyncio.Queue()
            self._task = asyncio.create_task(self._reader())
        new = 0
        for k in keys:
            k = (int(k[0]), int(k[1]))
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
            fut = self._ready.get(key)
            if fut is None or fut.done():
                continue
            await slots.acquire()
            task = asyncio.create_task(self._read(key, fut))
            task.add_done_callback(lambda _t: slots.release())

    async def _read(self, key: tuple[int, int], fut: asyncio.Future[Any]) -> None:
        loop = asyncio.get_running_loop()
        quarantine: list[DataError] = []
        busy: list[float] = []
        cpu: list[tuple[float, float]] = []  # CPU and core-wait seconds of the busy time
        try:
            docs = await loop.run_in_executor(
                self._pool, read_unit, self.src, self._files.fs,
                self.units[key[1]], self.tokenizer, quarantine, self._docs, busy, cpu)
        except Exception as e:  # noqa: BLE001 - handed to whoever waits for this unit
            if not fut.done():
                fut.set_exception(e)
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
        if self._ready.get(key) is not fut:  # released while it was being read
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
        """Token lengths of the unit's rows, once it is read (assigns it if needed)."""
        key = (int(epoch), int(unit))
        if key not in self._ready:
            await self.assign([key])
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
        (:meth:`ImageDoc.piece`).  A
        unit that is not held (re-assigned after a loader was lost or retired)
        is read first.  Units stay until the planner releases them
        (:meth:`release`), so a step can be fetched again after a constructor
        was lost.
        """
        out: list[np.ndarray | tuple[np.ndarray, np.ndarray]] = []
        rows: Sequence[Sequence[int]] = (requests.reshape(-1, 5).tolist()
                                         if isinstance(requests, np.ndarray) else requests)
        for epoch, unit, row, start, end in rows:
            key = (int(epoch), int(unit))
            if key not in self._ready:
                await self.assign([key])
            await asyncio.shield(self._ready[key])
            data = self._data[key]
            i = int(row) - self.units[key[1]].row_offset
            doc = data.docs[i]
            if doc is None:
                raise DataError("document has no tokens (it was skipped as bad input)",
                                source=self.src.name, path=self.units[key[1]].path, row=int(row))
            if isinstance(doc, ImageDoc):
                out.append(doc.piece(int(start), int(end)))
            else:
                out.append(doc[int(start):int(end) + 1])
            self.tokens_fetched += int(end) - int(start)
        return join_pieces(out)

    async def release(self, keys: list[tuple[int, int]]) -> None:
        """Forget units the planner will not use (e.g. after a re-partition)."""
        for k in keys:
            key = (int(k[0]), int(k[1]))
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
        }

    async def close(self) -> None:
        """Stop reading and drop every unit held, as :meth:`release` does: a fetch or
        metadata call still waiting for a unit here ends at once (cancelled) and its
        caller asks the loader now in this slot, instead of waiting on one that reads
        nothing more and keeping its units in memory."""
        if self._task is not None:
            self._task.cancel()
        await self.release(list(self._ready))
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._docs is not None:
            self._docs.close()
