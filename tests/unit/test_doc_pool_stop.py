"""A loader's preprocessing pool (:class:`~msd_dask.sources.documents.DocPool`) stops
with its loader: its processes end with the process holding the pool, killed too, and
its work ends when the pool is closed (a loader scaled down or retired)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import CancelledError, Future
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import psutil
import pytest

from msd_dask import load_config
from msd_dask.core.config import SourceConfig
from msd_dask.sources.documents import DocPool

TOK = {"kind": "bytes"}

#: A process holding a pool of 2 processes: it prints their pids once they run, then waits.
_HOLDER = r'''
import sys, time
from msd_dask import load_config
from msd_dask.sources.documents import DocPool
src = load_config({"name": "t", "batch": {"seq_len": 64}, "sources": [
    {"name": "s", "uri": sys.argv[1], "format": "jsonl"}]}).sources[0]
pool = DocPool(src, {"kind": "bytes"}, 2, "process")
pool.map("f", [(i, {"text": "doc %d" % i}) for i in range(8)])
print(" ".join(map(str, pool._ex._processes)), flush=True)
time.sleep(300)
'''


def _source(tmp_path: Path, preprocess: str | None = None) -> SourceConfig:
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    src: dict[str, Any] = {"name": "s", "uri": str(tmp_path / "*.jsonl"), "format": "jsonl"}
    if preprocess:
        src["preprocess"] = preprocess
    return load_config({"name": "t", "batch": {"seq_len": 64}, "sources": [src]}).sources[0]


def _alive(procs: list[psutil.Process]) -> list[int]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _gone_within(procs: list[psutil.Process], seconds: float) -> list[int]:
    """The pids of ``procs`` still running after ``seconds`` (none: all ended)."""
    end = time.monotonic() + seconds
    while _alive(procs) and time.monotonic() < end:
        time.sleep(0.05)
    return _alive(procs)


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_pool_processes_end_when_the_process_holding_the_pool_is_killed(
        tmp_path: Path) -> None:
    """A Dask worker holding a loader's pool of processes SIGKILLed (or killed for memory)
    left the pool's processes, and the resource tracker they held up, running for good:
    nothing watched for the parent's death (a review of the loaders: 3 processes alive
    60 s after)."""
    _source(tmp_path)  # (the file the holder's config globs)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "*.jsonl")],
                              stdout=subprocess.PIPE, text=True)
    kids: list[psutil.Process] = []
    try:
        assert holder.stdout is not None
        pool_pids = {int(p) for p in holder.stdout.readline().split()}
        kids = psutil.Process(holder.pid).children(recursive=True)  # (and the tracker)
        assert len(pool_pids) == 2 and pool_pids <= {k.pid for k in kids}, (pool_pids, kids)
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert _gone_within(kids, 5) == []
    finally:
        holder.kill()
        holder.wait(10)
        _kill(kids)


_BURN = '''
import os, time
MARKS = {marks!r}
STARTED = []  # (documents begun, in a thread pool's process)
def burn(text, rec):
    STARTED.append(text)
    open(os.path.join(MARKS, str(os.getpid())), "a").close()
    t = time.process_time()
    while time.process_time() - t < {seconds}:
        pass
    return text
'''


def _burner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str,
            seconds: float) -> tuple[SourceConfig, Path]:
    """A source whose preprocess burns ``seconds`` of CPU per document, and the folder
    where each process running it leaves a file named by its pid."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / f"{module}.py").write_text(_BURN.format(marks=str(marks), seconds=seconds))
    monkeypatch.syspath_prepend(str(tmp_path))  # (spawned processes get sys.path too)
    return _source(tmp_path, f"{module}:burn"), marks


def _map_in_thread(pool: DocPool, n: int) -> tuple[threading.Thread, list[Any]]:
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(pool.map("f", [(i, {"text": f"doc {i}"}) for i in range(n)]))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            got.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_closing_a_process_pool_ends_its_work_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed loader's pool of processes ran its chunks and those queued to its
    processes to the end (seconds to minutes), on the CPU the remaining loaders need, for
    results thrown away: shutdown(cancel_futures=True) cancels only work not yet sent to
    a process (a review of the loaders: 19 CPU seconds burned, processes gone 22 s after
    close).  Its processes are terminated, and the map waiting on them ends."""
    src, marks = _burner(tmp_path, monkeypatch, "doc_pool_burn_process", 0.05)
    pool = DocPool(src, TOK, 2, "process")
    procs: list[psutil.Process] = []
    t, got = _map_in_thread(pool, 400)  # (8 chunks of 50 documents, 2.5 CPU seconds each)
    try:
        end = time.monotonic() + 60
        while len(os.listdir(marks)) < 2 and time.monotonic() < end:  # (both at work)
            time.sleep(0.05)
        procs = [psutil.Process(p) for p in pool._ex._processes]  # type: ignore[attr-defined]
        assert len(procs) == 2
        t0 = time.perf_counter()
        pool.close()
        assert time.perf_counter() - t0 < 0.5  # (called from the loader's event loop)
        assert _gone_within(procs, 2) == []
        t.join(5)
        assert not t.is_alive()
        assert isinstance(got[0], BrokenProcessPool | CancelledError), got
    finally:
        _kill(procs)
        pool.close()
        t.join(10)


def test_closing_a_thread_pool_ends_its_work_before_the_next_document(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed loader's pool of threads ran the chunks its threads had begun to the end,
    for results thrown away (a review of the loaders).  Each thread ends before its next
    document."""
    src, _ = _burner(tmp_path, monkeypatch, "doc_pool_burn_thread", 0.01)
    import doc_pool_burn_thread as burner  # type: ignore[import-not-found]

    burner.STARTED.clear()
    pool = DocPool(src, TOK, 2, "thread")
    t, got = _map_in_thread(pool, 400)  # (8 chunks of 50 documents)
    try:
        end = time.monotonic() + 30
        while len(burner.STARTED) < 4 and time.monotonic() < end:
            time.sleep(0.01)
        pool.close()
        begun = len(burner.STARTED)
        t.join(5)
        assert not t.is_alive()
        assert isinstance(got[0], CancelledError), got
        # (a thread may have begun one more document between the count and the close)
        assert len(burner.STARTED) - begun <= 2, (begun, len(burner.STARTED))
    finally:
        pool.close()
        t.join(10)


def test_a_pool_closed_while_a_read_thread_finds_it_broken_is_not_started_again(
        tmp_path: Path) -> None:
    """A read thread that found the pool of processes broken looked at whether the pool
    was closed before taking the lock that close() takes: a close in between, and the
    thread started a new pool for the closed loader, whose processes nothing ended (a
    review of the loaders).  (Stand-ins: a pool that is broken, and a lock that lets the
    close in just before the read thread takes it.)"""
    src = _source(tmp_path)
    pool = DocPool(src, TOK, 2, "process")
    pool._ex.shutdown()  # (it started no process: none starts before a first task)

    class _Broken:
        def submit(self, *args: Any, **kwargs: Any) -> Future:
            fut: Future = Future()
            fut.set_exception(BrokenProcessPool("a process of the pool died"))
            return fut

        def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
            pass

    class _CloseFirst:
        """The pool's lock: closes the pool before the first taker gets it."""

        def __init__(self) -> None:
            self.lock = threading.Lock()
            self.first = True

        def __enter__(self) -> None:
            if self.first:
                self.first = False
                pool.close()
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    started: list[_Broken] = []

    def new_pool() -> _Broken:
        started.append(_Broken())
        return started[-1]

    pool._ex = _Broken()  # type: ignore[assignment]
    pool._swap = _CloseFirst()  # type: ignore[assignment]
    pool._processes = new_pool  # type: ignore[assignment]
    with pytest.raises(BrokenProcessPool):
        pool.map("f", [(0, {"text": "doc"})])
    assert started == []
