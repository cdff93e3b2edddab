"""The loader's preprocessing pool (``sources[].pool``): order, content and errors.

Documents of a unit are preprocessed and tokenized several at once, on
threads or processes; the results must come back in row order, so the
stream does not depend on the pool, and a bad document must still be named
by source, file and row (through the service:
``tests/integration/test_loader_pool_service.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import multiprocessing
import os
import re
from typing import Any

import numpy as np
import pytest

from msd_dask import ConfigError, DataError, load_config
from msd_dask.core.config import PoolConfig, SourceConfig
from msd_dask.examples import preprocess as prep
from msd_dask.roles.loader import SourceLoader
from msd_dask.sources.documents import DocPool, read_unit
from msd_dask.sources.tokenizer import ByteTokenizer

from corpus import config, source_units

TOK = {"kind": "bytes"}
POOLS = [("thread", 1), ("thread", 4), ("process", 1), ("process", 3)]


def _read_all(src: SourceConfig, pool: DocPool | None) -> list[list[np.ndarray]]:
    fs, units = source_units(src)
    return [[np.asarray(d) for d in read_unit(src, fs, u, ByteTokenizer(), pool=pool)]
            for u in units]


@pytest.fixture(scope="module")
def sources(corpus: Any) -> dict[str, SourceConfig]:
    root, _ = corpus
    cfg = load_config(config(root))
    return {s.name: s for s in cfg.sources}


@pytest.mark.parametrize("name", ["code", "prose"])
def test_pool_keeps_row_order_and_content(sources: dict[str, SourceConfig], corpus: Any,
                                          name: str) -> None:
    _, texts = corpus
    src = sources[name]
    inline = _read_all(src, None)
    fs, units = source_units(src)
    tok = ByteTokenizer()
    n = 0
    for u, docs in zip(units, inline, strict=True):  # content equals the source text
        for i, d in enumerate(docs):
            key = (name, f"{os.path.basename(u.path)}:{u.row_offset + i}")
            np.testing.assert_array_equal(d, tok.encode(texts[key]))
            n += 1
    assert n == sum(1 for k in texts if k[0] == name)
    for kind, size in POOLS:
        pool = DocPool(src, TOK, size, kind)
        try:
            got = _read_all(src, pool)
        finally:
            pool.close()
        assert [len(u) for u in got] == [len(u) for u in inline], (kind, size)
        for a, b in zip(got, inline, strict=True):
            for x, y in zip(a, b, strict=True):
                np.testing.assert_array_equal(x, y, err_msg=f"pool {kind} x{size}")


def test_pool_runs_the_preprocessor_in_order(sources: dict[str, SourceConfig],
                                             corpus: Any) -> None:
    _, texts = corpus
    src = dataclasses.replace(sources["prose"], preprocess="msd_dask.examples.preprocess:clean")
    fs, units = source_units(src)
    tok = ByteTokenizer()
    for kind, size in POOLS:
        pool = DocPool(src, TOK, size, kind)
        try:
            dropped = 0
            for u in units:
                docs = read_unit(src, fs, u, tok, pool=pool)
                for i, d in enumerate(docs):
                    want = prep.clean(texts[("prose", f"{os.path.basename(u.path)}:"
                                                      f"{u.row_offset + i}")], {})
                    if want is None:
                        assert len(d) == 0
                        dropped += 1
                    else:
                        np.testing.assert_array_equal(d, tok.encode(want))
            assert dropped > 0
        finally:
            pool.close()


def _failing_source(tmp_path: Any, on_error: str) -> SourceConfig:
    lines = [{"text": f"doc {i} " + ("FAIL-ME" if i in (3, 7) else "fine")} for i in range(12)]
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    cfg = load_config({"name": "t", "batch": {"seq_len": 64}, "sources": [
        {"name": "bad", "uri": str(tmp_path / "*.jsonl"), "format": "jsonl",
         "preprocess": "msd_dask.examples.preprocess:fail_on_marker", "on_error": on_error}]})
    return cfg.sources[0]


@pytest.mark.parametrize("kind,size", [("thread", 4), ("process", 2)])
def test_errors_in_a_pool_name_source_file_and_first_row(tmp_path: Any, kind: str,
                                                         size: int) -> None:
    src = _failing_source(tmp_path, "fail")
    fs, units = source_units(src)
    pool = DocPool(src, TOK, size, kind)
    try:
        with pytest.raises(DataError, match=r"source 'bad', file '.*x\.jsonl', row 3: "
                           r"preprocess 'msd_dask.examples.preprocess:fail_on_marker' "
                           r"raised ValueError: found the FAIL-ME marker") as info:
            read_unit(src, fs, units[0], ByteTokenizer(), pool=pool)
        assert (info.value.source, info.value.row) == ("bad", 3)
        assert info.value.path is not None and info.value.path.endswith("x.jsonl")
        assert "FAIL-ME" in str(info.value.__cause__)
        # on_error: skip quarantines both rows, in row order, and keeps the others
        skip = dataclasses.replace(src, on_error="skip")
        quarantine: list[DataError] = []
        docs = read_unit(skip, fs, units[0], ByteTokenizer(), quarantine, pool=pool)
        assert [e.row for e in quarantine] == [3, 7]
        assert all(e.source == "bad" and "x.jsonl" in str(e) for e in quarantine)
        assert [len(d) == 0 for d in docs] == [i in (3, 7) for i in range(12)]
    finally:
        pool.close()


def _in_daemon(q: Any, src: SourceConfig) -> None:
    try:
        DocPool(src, TOK, 2, "process")
        q.put("started")
    except RuntimeError as e:
        q.put(str(e))


def test_process_pool_in_a_daemonic_process_says_how_to_fix(sources: dict[str, SourceConfig]
                                                            ) -> None:
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_in_daemon, args=(q, sources["prose"]), daemon=True)
    p.start()
    msg = q.get(timeout=60)
    p.join(10)
    assert "source 'prose'" in msg and "distributed.worker.daemon" in msg


def test_pool_config_is_validated_against_its_key(corpus: Any) -> None:
    root, _ = corpus
    for pool, key in [({"kind": "fiber"}, "sources[1].pool.kind"),
                      ({"size": -1}, "sources[1].pool.size"),
                      ({"size": 2, "workers": 2}, "sources[1].pool.workers"),
                      ("process", "sources[1].pool")]:
        cfg = config(root)
        cfg["sources"][1]["pool"] = pool
        with pytest.raises(ConfigError, match=re.escape(f"'{key}'")):
            load_config(cfg)
    cfg = config(root)
    cfg["sources"][1]["pool"] = {"kind": "process", "size": 2}
    c = load_config(cfg)
    assert c.sources[1].pool == PoolConfig("process", 2)
    assert load_config(c.to_dict()).sources[1].pool == PoolConfig("process", 2)


def test_unit_buffer_is_compact_for_small_vocabularies():
    """A loader keeps tokens as uint16 when the vocabulary allows: same ids, half the bytes."""
    from msd_dask.roles.loader import _UnitData
    from msd_dask.sources.documents import ImageDoc, _compact, _compacts
    from msd_dask.sources.tokenizer import ByteTokenizer

    assert _compacts(ByteTokenizer())
    rng = np.random.default_rng(0)
    text = rng.integers(0, 65536, size=300).astype(np.int32)
    img = ImageDoc(np.r_[np.full(4, 258), text[:10]].astype(np.int32),
                   rng.integers(0, 255, size=(4, 12)).astype(np.uint8))
    small = _UnitData([_compact(text, True), _compact(img, True)])
    wide = _UnitData([_compact(text, False), _compact(img, False)])
    assert small.docs[0].dtype == np.uint16 and small.docs[1].tokens.dtype == np.uint16
    assert wide.docs[0].dtype == np.int32
    assert (small.docs[0] == text).all() and (small.docs[1].tokens == img.tokens).all()
    assert (small.docs[1].patches == img.patches).all()
    assert (small.lengths == wide.lengths).all()


def test_a_process_pool_that_lost_a_process_is_started_again(
        sources: dict[str, SourceConfig]) -> None:
    """A process of a loader's pool killed (by the kernel's OOM killer, say) made every
    later unit of the loader fail with a bare BrokenProcessPool, under on_error: skip too,
    and the loader, its worker alive, was never re-created (a review of the loaders).  The
    pool is started again and the unit read once more: the same documents."""
    import signal
    import time

    src = sources["prose"]
    inline = _read_all(src, None)
    pool = DocPool(src, TOK, 2, "process")
    try:
        fs, units = source_units(src)
        first = [np.asarray(d) for d in read_unit(src, fs, units[0], ByteTokenizer(), pool=pool)]
        os.kill(next(iter(pool._ex._processes)), signal.SIGKILL)  # type: ignore[attr-defined]
        time.sleep(0.5)
        got = [first] + [[np.asarray(d) for d in read_unit(src, fs, u, ByteTokenizer(), pool=pool)]
                         for u in units[1:]]
    finally:
        pool.close()
    for a, b in zip(got, inline, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_read_threads_that_find_the_pool_broken_together_start_one_new_pool(
        sources: dict[str, SourceConfig], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two read threads of a loader saw its process pool broken at once: each replaced it,
    the second shutting down the pool the first had just started, whose work was then
    cancelled (the unit never settled, or a RuntimeError failed the service; a review of
    the loaders, 3 of 12 runs).  One new pool is started, and both units read on it.
    (Stand-ins: a pool that reports itself broken once both threads reached it, then
    threads running the processes' own task, so that the race is the same in every run.)"""
    import threading
    from concurrent.futures import Future, ThreadPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from msd_dask.sources import documents

    src = sources["prose"]
    payload = dataclasses.asdict(src)
    payload.pop("weight")
    monkeypatch.setattr(documents, "_WORKER", {})
    documents._init_process(payload, TOK)  # (the processes' task, run here on threads)
    both_reached = threading.Barrier(2)
    reached: set[int] = set()

    class _Broken:
        def submit(self, *args: Any, **kwargs: Any) -> Future:
            if threading.get_ident() not in reached:  # (each thread's first task)
                reached.add(threading.get_ident())
                both_reached.wait(10)
            fut: Future = Future()
            fut.set_exception(BrokenProcessPool("a process of the pool died"))
            return fut

        def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
            pass

    started: list[ThreadPoolExecutor] = []

    def new_pool() -> ThreadPoolExecutor:
        started.append(ThreadPoolExecutor(2))
        return started[-1]

    pool = DocPool(src, TOK, 2, "process")  # (no process starts before a first task)
    pool._ex = _Broken()  # type: ignore[assignment]
    pool._processes = new_pool  # type: ignore[assignment]
    items = [(i, {src.text_field: f"document {i} " * 50}) for i in range(40)]
    want = [np.asarray(d) for d in DocPool(src, TOK, 1, "thread").map("f", items)]
    got: dict[int, Any] = {}

    def read(i: int) -> None:
        try:
            got[i] = pool.map("f", items)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            got[i] = e

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert len(started) == 1, started
        for i in range(2):
            assert not isinstance(got[i], BaseException), got[i]
            for a, b in zip(got[i], want, strict=True):
                np.testing.assert_array_equal(np.asarray(a), b)
    finally:
        for ex in started:
            ex.shutdown()


@pytest.mark.parametrize("kind", ["none", "thread", "process"])
def test_user_code_raising_a_base_exception_names_the_document(tmp_path: Any,
                                                               kind: str) -> None:
    # a preprocess function calling sys.exit() (a pyo3 panic of a tokenizer is another
    # BaseException) passed 'except Exception' and ended the loader's read loop
    lines = [{"text": f"doc {i} " + ("EXIT-ME" if i == 2 else "fine")} for i in range(6)]
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    src = load_config({"name": "t", "batch": {"seq_len": 64}, "sources": [
        {"name": "bad", "uri": str(tmp_path / "*.jsonl"), "format": "jsonl",
         "preprocess": "msd_dask.examples.preprocess:exit_on_marker"}]}).sources[0]
    fs, units = source_units(src)
    pool = None if kind == "none" else DocPool(src, TOK, 2, kind)
    try:
        with pytest.raises(DataError, match=r"x\.jsonl', row 2: preprocess .* raised "
                                            r"SystemExit: found the EXIT-ME marker"):
            read_unit(src, fs, units[0], ByteTokenizer(), pool=pool)
        quarantine: list[DataError] = []
        docs = read_unit(dataclasses.replace(src, on_error="skip"), fs, units[0],
                         ByteTokenizer(), quarantine, pool=pool)
        assert [e.row for e in quarantine] == [2]
        assert [len(d) == 0 for d in docs] == [i == 2 for i in range(6)]
    finally:
        if pool is not None:
            pool.close()


def test_a_format_raising_a_base_exception_fails_its_unit_not_the_loader(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # a format of the user's own that raised SystemExit ended the loader's read task: the
    # unit's waiters were cancelled, not told which file
    (tmp_path / "exiting_format_xyz.py").write_text(
        "import sys\n"
        "from msd_dask.examples.text_lines import TextLinesFormat\n"
        "class Exiting(TextLinesFormat):\n"
        "    def read(self, fs, unit, fields):\n"
        "        if unit.path.endswith('b.txt'):\n"
        "            sys.exit('a format gave up')\n"
        "        yield from super().read(fs, unit, fields)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text("one\ntwo\n")
    src = load_config({"name": "t", "batch": {"seq_len": 64}, "sources": [
        {"name": "s", "uri": str(tmp_path / "*.txt"),
         "format": "exiting_format_xyz:Exiting"}]}).sources[0]
    source = dataclasses.asdict(src)
    source.pop("weight")
    units = [(u.path, u.part, u.row_offset) for u in source_units(src)[1]]
    assert [os.path.basename(u[0]) for u in units] == ["a.txt", "b.txt"]

    async def run() -> None:
        loader = SourceLoader(source, units, {"kind": "bytes"}, threads=1)
        try:
            with pytest.raises(RuntimeError, match=r"file '.*b\.txt' \(epoch 0, unit 1\): "
                                                   r"SystemExit: a format gave up"):
                await asyncio.wait_for(loader.metadata(0, 1), 30)
            # the loader reads on
            assert list(await asyncio.wait_for(loader.metadata(0, 0), 30)) == [4, 4]
        finally:
            await loader.close()

    asyncio.run(run())


@pytest.mark.parametrize("size, threads", [(1, 3), (2, 3), (None, 2)])
def test_a_loader_processes_as_many_documents_at_once_as_it_says(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, size: int | None, threads: int) -> None:
    """A thread pool of one behind 3 read threads: each read thread processed its own unit's
    documents, 3 at once where the loader's stats said 1, and the adaptive policy sized the
    source 3 times over (a review)."""
    (tmp_path / "probe_prep.py").write_text(
        "import threading, time\nlock = threading.Lock()\nnow = peak = 0\n"
        "def slow(text, rec):\n    global now, peak\n    with lock:\n        now += 1\n"
        "        peak = max(peak, now)\n    time.sleep(0.01)\n    with lock:\n"
        "        now -= 1\n    return text\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for f in range(6):
        (tmp_path / f"f{f}.jsonl").write_text("".join(json.dumps({"text": f"doc {f} {r}"}) + "\n"
                                                      for r in range(8)))
    pool = {"kind": "thread"} if size is None else {"kind": "thread", "size": size}
    src = load_config({"name": "t", "batch": {"seq_len": 64}, "sources": [
        {"name": "j", "uri": f"{tmp_path}/*.jsonl", "format": "jsonl", "pool": pool,
         "preprocess": "probe_prep:slow"}]}).sources[0]
    source = dataclasses.asdict(src)
    source.pop("weight")
    units = [(u.path, u.part, u.row_offset) for u in source_units(src)[1]]
    import probe_prep  # (the first test's module, each later one's too)

    probe_prep.peak = 0

    async def run() -> dict[str, Any]:
        loader = SourceLoader(source, units, TOK, threads=threads)
        await loader.assign([(0, u) for u in range(len(units))])
        for u in range(len(units)):
            await loader.metadata(0, u)
        stats = await loader.stats()
        await loader.close()
        return stats

    stats = asyncio.run(run())
    assert stats["threads"] == (size or threads)
    assert 1 <= probe_prep.peak <= stats["threads"]


def test_a_row_group_is_decoded_on_the_read_thread(tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Arrow decoded a row group on threads of its own, whose CPU the loader's count (the
    read thread's) left out: a CPU-bound parquet source read as 0.66 busy, and its CPU cap
    erred high (a review)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from msd_dask.formats import Unit, get_format
    from msd_dask.sources.storage import source_filesystem

    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(40)]}), tmp_path / "x.parquet",
                   row_group_size=20)
    seen: list[bool] = []
    read = pq.ParquetFile.read_row_group

    def spy(self: Any, i: int, *a: Any, use_threads: bool = True, **k: Any) -> Any:
        seen.append(use_threads)
        return read(self, i, *a, use_threads=use_threads, **k)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)
    fs = source_filesystem(str(tmp_path))
    rows = list(get_format("parquet").read(fs, Unit(str(tmp_path / "x.parquet"), 1, 20),
                                           ["text"]))
    assert [r["text"] for _, r in rows] == [f"doc {i}" for i in range(20, 40)]
    assert seen == [False]
