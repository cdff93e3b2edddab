"""The document pipeline of a Source Loader: read a unit, preprocess, tokenize, images.

:func:`read_unit` reads one unit's rows (through :mod:`msd_dask.formats`),
preprocesses and tokenizes each document, and for an image+text source cuts
its image into patches (:class:`ImageDoc`); bad input follows the source's
``on_error``.  The documents of a unit go through a bounded :class:`DocPool`
(threads or spawned processes, ``sources[].pool``) and come back in row
order, so the stream does not depend on the pool.  Nothing here knows Dask:
:class:`~msd_dask.roles.loader.SourceLoader` runs it on its worker.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError, Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from msd_dask.core.config import SourceConfig, TokenizerConfig, WeightSchedule, resolve_import_path
from msd_dask.errors import ConfigError, DataError, storage_blip
from msd_dask.sources.tokenizer import make_tokenizer

if TYPE_CHECKING:
    from msd_dask.core.units import Unit
    from msd_dask.formats import Format
    from msd_dask.sources.storage import SourceFiles

# formats (fsspec, zstandard, tarfile), storage and vision are imported where a unit is read:
# a training process imports this module with msd_dask.roles.loader when it unpickles a
# loader's actor handle, and every module costs each training process memory
# (tests/unit/test_imports.py)

__all__ = ["BLIP_RETRIES", "DocPool", "ImageDoc", "again_after_a_blip", "listed_files",
           "preprocessor", "process_docs", "read_unit", "source_config", "source_fields",
           "source_format", "text_of", "with_source"]


_log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int32)

_T = TypeVar("_T")


@functools.lru_cache(maxsize=32)
def preprocessor(spec: str) -> Callable[[str, dict[str, Any]], str | None]:
    """The function ``sources[].preprocess`` names (``module:function``), imported once."""
    fn = resolve_import_path(spec)
    if not callable(fn):
        raise TypeError(f"{spec!r} is a {type(fn).__name__}, not a function")
    return fn


def with_source(e: BaseException, source: str, path: str | None = None, *,
                whole_file: bool = False) -> DataError:
    """``e`` as a :class:`DataError` naming ``source`` (and ``path`` if it names no file).

    ``whole_file``: the error is the file's (its ``row`` is dropped).
    """
    if not isinstance(e, DataError):
        if storage_blip(e):  # (tried again already: again_after_a_blip)
            return DataError(f"cannot read it: the storage failed {len(BLIP_RETRIES) + 1} "
                             f"times ({type(e).__name__}: {e})", source=source, path=path)
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
    it; row indexes do not move).  Rows the format skips (blank JSON lines), and
    texts of no tokens (an empty string), get the same empty placeholder.

    Bad input follows ``src.on_error``: ``"fail"`` raises a :class:`DataError`
    naming the source, file and row; ``"skip"`` quarantines it instead: a bad
    document (missing field, invalid UTF-8, not text, preprocess failure) gets
    an empty placeholder, a file that cannot be read (missing, corrupt,
    truncated) yields no rows at all, and each error is appended to
    ``quarantine`` (``error.row is None`` for a whole file).
    """
    if getattr(src, "on_error", "fail") != "skip":
        try:
            return again_after_a_blip(
                lambda: _read_rows(src, fs, unit, tokenizer, [], None, pool, timing, cpu),
                src.name, unit.path)
        except Exception as e:
            if not isinstance(e, DataError | OSError) and not storage_blip(e):
                raise
            err = with_source(e, src.name, unit.path)
            if err is e:  # (already named: 'raise e from e' would make e its own cause, a
                raise     # cycle Dask's pickling of the error recursed on without end)
            raise err from e
    bad: list[DataError] = []

    def read() -> list[np.ndarray | ImageDoc]:
        bad.clear()  # (a read cut short by a blip: its rows are read again)
        return _read_rows(src, fs, unit, tokenizer, [], bad, pool, timing, cpu)

    try:
        out = again_after_a_blip(read, src.name, unit.path)
    except Exception as e:
        # (an object store's client errors are no OSError: one escaped the skip and
        # stopped the service; a review)
        if not isinstance(e, DataError | OSError) and not storage_blip(e):
            raise
        if quarantine is not None:
            quarantine.append(with_source(e, src.name, unit.path, whole_file=True))
        return []
    if quarantine is not None:
        quarantine.extend(bad)
    return out


#: seconds :func:`again_after_a_blip` waits before each new read of a file whose storage
#: failed for a moment (:func:`~msd_dask.errors.storage_blip`); the last failure is the file's
BLIP_RETRIES = (0.5, 2.0)

def again_after_a_blip(fn: Callable[[], _T], source: str, path: str,
                       doing: str = "reading it") -> _T:
    """``fn()``, again after each of :data:`BLIP_RETRIES` where the storage failed for a
    moment (:func:`~msd_dask.errors.storage_blip`: a dropped connection, a read that timed
    out, a busy store, as the built-in errors or an object store's HTTP client's say it,
    after the store's own retries): a brief failure of the store is not bad input, which
    ``on_error: skip`` would quarantine (a unit for the epoch, a file listed at start for
    the run) and ``fail`` would stop the service on.  The rule of every read of a source's
    files: :func:`read_unit`, the listing of a source's files and of a file's units when a
    service starts (:func:`~msd_dask.sources.discover.discover_units`) and ``msd-dask
    validate``'s listing and first record (:func:`~msd_dask.sources.check.check_fields`).

    Parameters
    ----------
    fn : callable
        The whole read, done again from its start after a blip.
    source, path : str
        The source and the file, named by the warning of each blip.
    doing : str
        What ``fn`` does, for that warning (``"listing its units"``).

    Returns
    -------
    object
        What ``fn`` returned.

    Raises
    ------
    Exception
        What the last try of ``fn`` raised (a blip too: the third failure counts).
    """
    for delay in BLIP_RETRIES:
        try:
            return fn()
        except Exception as e:
            if not storage_blip(e):
                raise
            _log.warning("source %r, file %r: %s failed (%s: %s); %s again in %.1fs",
                         source, path, doing, type(e).__name__, e, doing, delay)
            time.sleep(delay)
    return fn()


def listed_files(src: SourceConfig) -> SourceFiles:
    """The files of source ``src`` (:func:`~msd_dask.sources.storage.open_source` of its
    ``uri``), listed again after a blip of the store (:func:`again_after_a_blip`): one
    dropped request while globbing failed a service's start, or ``msd-dask validate``."""
    from msd_dask.sources.storage import open_source

    return again_after_a_blip(functools.partial(open_source, src.uri, src.storage_options),
                              src.name, src.uri, "listing its files")


def source_format(src: SourceConfig, index: int) -> Format:
    """The format ``src`` reads (:func:`msd_dask.formats.get_format`), imported here first if
    it is one of your own; ``index``: the source's place in the config.

    Raises
    ------
    ConfigError
        No such format, or it cannot be had here: naming ``sources[index].format``.
    """
    from msd_dask.formats import get_format

    try:
        return get_format(src.format)
    except ValueError as e:
        raise ConfigError(f"sources[{index}].format", str(e)) from e


def source_fields(src: SourceConfig) -> list[str]:
    """The fields a source reads from each record: its ``text_field``, and its
    ``image_field`` if it has one."""
    return [src.text_field] + ([src.image_field] if src.image_field else [])


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

    fmt = get_format(src.format)  # (the loader had it made: SourceLoader)
    # formats that can report a bad row without ending the read (JSON lines) do so
    tolerant = bad is not None and "errors" in inspect.signature(fmt.read).parameters
    read: Any = fmt.read
    fields = source_fields(src)

    def rows_in_order() -> list[tuple[int, Any]]:
        rows = read(fs, unit, fields, errors="yield") if tolerant else read(fs, unit, fields)
        items: list[tuple[int, Any]] = []
        for row, rec in rows:
            expected = unit.row_offset + len(items)
            if row < expected:
                raise DataError(f"rows out of order (expected {expected} or later): format "
                                f"{src.format!r} must yield a unit's rows in increasing order "
                                f"from its row_offset", source=src.name, path=unit.path, row=row)
            while len(items) < row - unit.row_offset:  # rows the format skipped (blank lines)
                items.append((unit.row_offset + len(items), None))
            items.append((row, rec))
        return items

    items, seconds, c, w = _cpu_timed(rows_in_order)
    todo = [(row, rec) for row, rec in items if rec is not None and not isinstance(rec, DataError)]
    busy = [seconds]
    used = [(c, w)]  # CPU and core-wait seconds of the busy time
    if pool is None:
        prep = preprocessor(src.preprocess) if src.preprocess else None
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
            res = _in_sample(res, rec)
            if bad is None:
                raise res
            bad.append(with_source(res, src.name, unit.path))
            res = _EMPTY
        out.append(res)
    return out


def _in_sample(e: DataError, rec: Any) -> DataError:
    """``e``, the error of a bad document, naming its sample where its format names the
    samples (:class:`~msd_dask.formats.Record`'s ``key``): a WebDataset sample's bad
    image or failed preprocess named its row alone (a review)."""
    key = getattr(rec, "key", None)
    if key is None or e.message.startswith(f"sample {key!r}"):
        return e
    named = type(e)(f"sample {key!r}: {e.message}", source=e.source, path=e.path, row=e.row)
    # (its cause, a user's preprocess's exception, was lost with its traceback: a review)
    named.__cause__ = e.__cause__
    return named


def process_docs(src: SourceConfig, prep: Callable[[str, dict[str, Any]], str | None] | None,
                 tokenizer: Any, path: str, items: Sequence[tuple[int, dict[str, Any]]],
                 stop: threading.Event | None = None
                 ) -> list[np.ndarray | ImageDoc | DataError]:
    """Preprocess and tokenize ``(row, record)`` items of file ``path``, in order.

    Returns one result per item: the tokens, an :class:`ImageDoc`, or the
    :class:`DataError` of a bad document, as a value (:func:`_cpu_timed` times it).  A
    text of no tokens (an empty string) gets the empty placeholder: it is never
    delivered, as a document a preprocess drops.  Once ``stop`` is set (its
    :class:`DocPool` closed), :class:`~concurrent.futures.CancelledError` is raised
    before the next document.
    """
    compact = _compacts(tokenizer)
    out: list[np.ndarray | ImageDoc | DataError] = []
    for row, rec in items:
        if stop is not None and stop.is_set():
            # (the loader is gone: its results would be thrown away, and the CPU is
            # the other loaders')
            raise CancelledError(f"the preprocessing pool of source {src.name!r} was closed")
        try:
            tokens = _tokenize(src, rec, prep, tokenizer, path, row)
            doc = _with_image(src, rec, tokens, tokenizer, path, row)
            if not isinstance(doc, ImageDoc) and len(doc) == 1:
                # a text of no tokens (an empty string): its end-of-document id alone, a
                # piece of the plan's and a separator in a row for nothing; dropped, as a
                # preprocess returning None drops one
                doc = _EMPTY
            out.append(_compact(doc, compact))
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


def source_config(source: dict[str, Any]) -> SourceConfig:
    """A loader's SourceConfig from its payload (``dataclasses.asdict``, weight dropped)."""
    source = dict(source)
    source["weight"] = WeightSchedule.constant(1.0)
    return SourceConfig(**source)


def _exit_with_parent() -> None:
    """Kill this process when its parent, the process holding the pool, ends: SIGKILLed
    or killed for memory too.

    Nothing else ends it then (a review of the loaders: the pool's processes waited on
    their task queue for good, and held the resource tracker up with them).  A thread
    waits on the parent's sentinel (the pipe the parent spawned this process with, which
    the kernel closes with the parent), not on Linux's ``PR_SET_PDEATHSIG``, which fires
    when the parent *thread* that started the process ends (an executor's thread, not
    the worker).  Nothing is watched outside a process of :mod:`multiprocessing`.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    sentinel = parent.sentinel

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([sentinel])
        # (at once, no cleanup: the work and its results are nobody's now; SIGKILL, as
        # user code may handle SIGTERM; TerminateProcess on Windows)
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))

    threading.Thread(target=watch, name="msd-exit-with-parent", daemon=True).start()


def _init_process(source: dict[str, Any], tokenizer: dict[str, Any]) -> None:
    """Initializer of a pool process: end with the process holding the pool
    (:func:`_exit_with_parent`), build the tokenizer, import the preprocessor once."""
    _exit_with_parent()
    src = source_config(source)
    _WORKER["src"] = src
    _WORKER["tokenizer"] = make_tokenizer(TokenizerConfig(**tokenizer))
    _WORKER["prep"] = preprocessor(src.preprocess) if src.preprocess else None


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
                       tokenizer: Any, path: str, items: Sequence[tuple[int, dict[str, Any]]],
                       stop: threading.Event | None = None) -> _Chunk:
    """Documents processed on this thread: results, busy, CPU and core-wait seconds
    (``stop``: see :func:`process_docs`)."""
    return _cpu_timed(process_docs, src, prep, tokenizer, path, items, stop)


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
        #: held while a broken pool of processes is replaced (the loader's read threads
        #: share this pool, and each sees it broken)
        self._swap = threading.Lock()
        self._closed = False
        #: set by :meth:`close`: a thread's chunk ends before its next document
        self._stop = threading.Event()
        if kind == "process":
            if multiprocessing.current_process().daemon:
                raise RuntimeError(
                    f"source '{src.name}': pool.kind 'process' cannot start processes in a "
                    "daemonic Dask worker; run the workers with distributed.worker.daemon: "
                    "false (DASK_DISTRIBUTED__WORKER__DAEMON=False)")
            payload = dataclasses.asdict(src)
            payload.pop("weight")
            self._processes = functools.partial(
                ProcessPoolExecutor, self.size, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_process, initargs=(payload, dict(tokenizer)))
            self._ex = self._processes()
        else:
            self._tokenizer = make_tokenizer(TokenizerConfig(**tokenizer))
            self._prep = preprocessor(src.preprocess) if src.preprocess else None
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
        ex = self._ex
        try:
            return self._map(ex, path, items, timing, cpu)
        except (RuntimeError, CancelledError) as e:  # (BrokenProcessPool is a RuntimeError)
            # (a pool another read thread replaced: this work was cancelled with it, or
            # refused by it: "cannot schedule new futures after shutdown")
            lost = isinstance(e, BrokenProcessPool | CancelledError) or self._ex is not ex
            if self.kind != "process" or self._closed or not lost:
                raise
            # a process of the pool died (killed for memory, say): every later unit would
            # fail the same way, and the loader's worker lives on, so it is never re-created.
            # A new pool, and this unit once more (a second failure is raised).  Replaced
            # once: the loader's other read threads see the same pool broken (or their
            # work cancelled with it), and take the new one
            with self._swap:
                if self._closed:  # (closed since the look above: no new pool to leak)
                    raise
                if self._ex is ex:
                    _log.warning("source %r: a process of its pool died; starting a new pool",
                                 self.src.name)
                    ex.shutdown(wait=False, cancel_futures=True)
                    self._ex = self._processes()
                ex = self._ex
            return self._map(ex, path, items, timing, cpu)

    def _map(self, ex: Executor, path: str, items: Sequence[tuple[int, dict[str, Any]]],
             timing: list[float] | None, cpu: list[tuple[float, float]] | None
             ) -> list[np.ndarray | ImageDoc | DataError]:
        n = min(len(items), 4 * self.size)
        bounds = [len(items) * i // n for i in range(n + 1)]
        chunks = [list(items[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
        futs: list[Any]
        if self.kind == "process":
            futs = [ex.submit(_process_in_worker, path, c) for c in chunks]
        else:
            futs = [ex.submit(_process_in_thread, self.src, self._prep, self._tokenizer,
                              path, c, self._stop) for c in chunks]
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
        """Stop the pool's work now, without waiting for it.

        Work not started is cancelled.  A thread's chunk ends before its next
        document, and the processes of a process pool are terminated: their chunks
        and those queued to them ran on for many seconds after a loader was closed
        (scaled down or retired), on the CPU the other loaders need, for results
        thrown away (a review of the loaders).  A :meth:`map` waiting on that work
        raises (:class:`~concurrent.futures.CancelledError` or
        :class:`~concurrent.futures.process.BrokenProcessPool`).
        """
        with self._swap:
            self._closed = True
            self._stop.set()
            ex = self._ex
            # (what Python 3.14's terminate_workers does; before it, through the stdlib
            # executor's private table of its processes, read before shutdown() drops it)
            procs = list((getattr(ex, "_processes", None) or {}).values())
            ex.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                try:
                    p.terminate()  # (the executor's thread reaps them: no wait here)
                except (OSError, ValueError):  # (gone, or its handle closed)
                    pass


def text_of(src: SourceConfig, rec: Mapping[str, Any], path: str, row: int) -> str:
    """The text of record ``rec`` (row ``row`` of file ``path``): its ``text_field``, a str or
    UTF-8 bytes (a byte-order mark they start with is no text, as in a ``.txt`` member);
    a :class:`DataError` naming the field, file and row otherwise."""
    text = rec.get(src.text_field)
    if isinstance(text, bytes):
        try:  # (a .caption member or a binary column kept it: 3 tokens of junk; a review)
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise DataError(f"field '{src.text_field}' is not valid UTF-8: {e}",
                            source=src.name, path=path, row=row) from e
    if not isinstance(text, str):
        raise DataError(f"field '{src.text_field}' is {type(text).__name__}, not text",
                        source=src.name, path=path, row=row)
    return text


def _tokenize(src: SourceConfig, rec: dict[str, Any],
              prep: Callable[[str, dict[str, Any]], str | None] | None, tokenizer: Any,
              path: str, row: int) -> np.ndarray:
    text = text_of(src, rec, path, row)
    if prep is not None:
        try:
            prepared = prep(text, rec)
        except BaseException as e:  # any failure of user code names the row
            if not _users_failure(e):
                raise
            raise DataError(f"preprocess {src.preprocess!r} raised {type(e).__name__}: {e}",
                            source=src.name, path=path, row=row) from e
        if prepared is None:
            return _EMPTY
        if not isinstance(prepared, str):
            raise DataError(f"preprocess {src.preprocess!r} returned "
                            f"{type(prepared).__name__}, not str or None",
                            source=src.name, path=path, row=row)
        text = prepared
    try:
        return tokenizer.encode(text)
    except (UnicodeError, TypeError, ValueError) as e:
        # e.g. a lone surrogate ("\ud800" is valid JSON, not UTF-8): the byte tokenizer
        # raises UnicodeEncodeError, a Hugging Face one TypeError, or ValueError for a text
        # that encodes to its image id (its other failures, a Rust panic among them, fail
        # the unit: SourceLoader names its file)
        raise DataError(f"field '{src.text_field}' could not be tokenized: "
                        f"{type(e).__name__}: {e}", source=src.name, path=path, row=row) from e


def _users_failure(e: BaseException) -> bool:
    """Whether ``e``, raised by a preprocess function, is that function's failure on the
    document it was given: any exception, and the BaseExceptions such code raises that
    are not the process's own stop (a ``sys.exit()``), which, let through, ended the
    loader's read loop instead of naming the document."""
    return not isinstance(e, KeyboardInterrupt | GeneratorExit)


def _with_image(src: SourceConfig, rec: dict[str, Any], tokens: np.ndarray, tokenizer: Any,
                path: str, row: int) -> np.ndarray | ImageDoc:
    """``tokens`` of a text document, or the :class:`ImageDoc` of an image+text one."""
    if not src.image_field or len(tokens) == 0:  # a text source, or a dropped document
        return tokens
    data = rec.get(src.image_field)
    if isinstance(data, dict) and "bytes" in data:
        # a Hugging Face datasets Image column, as its parquet files hold it: a struct of
        # the encoded bytes and the file's path (refused as "is dict"; a review)
        if data["bytes"] is None and data.get("path"):
            raise DataError(f"field '{src.image_field}' holds the path {data['path']!r}, "
                            "not the image's bytes (a Hugging Face Image column saved "
                            "without them)", source=src.name, path=path, row=row)
        data = data["bytes"]
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
