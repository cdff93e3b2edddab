"""``SourceLoader.fetch`` takes its requests as an int64 array (what constructors send) or as tuples,
and ``fetch_packed`` as that array's bytes, answering pickled; ``close()`` ends the waits for
its units.

Constructors send one ``(n, 5)`` array per loader and round: Dask serializes a
list of tuples element by element (566 us for 27 pieces, 35 us as one array).
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
from typing import Any

import numpy as np
import pytest

from msd_dask import load_config
from msd_dask.core.packing import split_pieces
from msd_dask.roles.loader import SourceLoader

from corpus import config, source_units


def _loader_inputs(cfg: dict, index: int) -> tuple[dict, list[tuple[str, int, int]]]:
    """A SourceLoader's ``source`` and ``units`` for source ``index`` of ``cfg``."""
    src = load_config(cfg).sources[index]
    source = dataclasses.asdict(src)
    source.pop("weight")
    units = [(u.path, u.part, u.row_offset) for u in source_units(src)[1]]
    return source, units


def test_fetch_answers_an_array_of_requests_as_it_answers_tuples(corpus) -> None:
    root, texts = corpus
    source, units = _loader_inputs(config(root), 0)

    async def run() -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            lengths = np.asarray(await loader.metadata(0, 1))
            off = units[1][2]
            reqs = [(0, 1, off + r, 0, int(n) - 1) for r, n in enumerate(lengths) if n > 1]
            reqs.append((0, 1, off, 1, 1))  # an empty piece inside a document: its label only
            as_tuples = split_pieces(await loader.fetch(reqs))
            as_array = split_pieces(await loader.fetch(np.asarray(reqs, dtype=np.int64)))
            # what a constructor on another worker sends and gets back (fetch_packed)
            packed = split_pieces(pickle.loads(await loader.fetch_packed(
                np.asarray(reqs, dtype=np.int64).tobytes())))
            for a, b in zip(packed, as_array, strict=True):
                assert a.dtype == b.dtype
                np.testing.assert_array_equal(a, b)
            return as_tuples, as_array, lengths
        finally:
            await loader.close()

    as_tuples, as_array, lengths = asyncio.run(run())
    assert len(as_array) == len(as_tuples) == int((lengths > 1).sum()) + 1
    for a, b in zip(as_array, as_tuples, strict=True):
        np.testing.assert_array_equal(a, b)
    # and it is the source's text: the byte tokenizer's ids are the text's UTF-8 bytes
    path, _part, off = units[1]
    doc = texts[("code", f"{path.rsplit('/', 1)[-1]}:{off}")].encode("utf-8")
    assert lengths[0] > 1
    assert bytes(as_array[0][:len(doc)].astype(np.uint8)) == doc
    assert list(as_array[-1]) == [doc[1]]  # piece (1, 1): no token, and the label doc[1]


def test_close_ends_a_wait_for_a_unit_and_drops_what_it_holds(corpus) -> None:
    """A call waiting for a unit of a closed (retired) loader is cancelled at once, as for a
    released unit, rather than waiting forever; the units read are dropped."""
    root, _texts = corpus
    cfg = config(root)
    cfg["sources"][1]["preprocess"] = "msd_dask.examples.preprocess:slow_store"
    source, units = _loader_inputs(cfg, 1)

    async def run() -> tuple[bool, BaseException | None, int]:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        await loader.metadata(0, 0)  # one unit read and held
        waiting = asyncio.ensure_future(loader.metadata(0, 1))
        await asyncio.sleep(0.2)
        still_reading = not waiting.done()
        await loader.close()
        try:
            await asyncio.wait_for(asyncio.shield(waiting), 5.0)
            err = None
        except BaseException as e:  # noqa: BLE001 - the test reports what ended the wait
            err = e
        # a call reaching it after close is refused at once: its reader is stopped, and the
        # unit it asked for was queued and waited for for ever (a review of the loaders)
        for late in (loader.metadata(0, 0), loader.fetch([(0, 0, units[0][2], 0, 1)])):
            with pytest.raises(RuntimeError, match="loader 0 of source 'prose' was closed"):
                await asyncio.wait_for(late, 5.0)
        return still_reading, err, len(loader._data)

    still_reading, err, held = asyncio.run(run())
    assert still_reading
    assert isinstance(err, asyncio.CancelledError), repr(err)
    assert held == 0


def test_stats_say_what_the_loader_is_reading(corpus) -> None:
    """A fetch that waits on a loader whose read hangs names the file it reads (the
    constructor asks ``stats()["reading"]``)."""
    root, _texts = corpus
    cfg = config(root)
    cfg["sources"][1]["preprocess"] = "msd_dask.examples.preprocess:slow_store"
    source, units = _loader_inputs(cfg, 1)

    async def run() -> tuple[list[dict], list[dict]]:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            before = (await loader.stats())["reading"]
            waiting = asyncio.ensure_future(loader.metadata(0, 1))
            await asyncio.sleep(0.3)
            during = (await loader.stats())["reading"]
            waiting.cancel()
            return before, during
        finally:
            await loader.close()

    before, during = asyncio.run(run())
    assert before == []
    assert [(r["path"], r["epoch"]) for r in during] == [(units[1][0], 0)], during
    assert 0.1 <= during[0]["seconds"] < 30


def test_a_unit_released_and_assigned_again_is_read_once(corpus, monkeypatch) -> None:
    """A unit released before its read and assigned again (``spread_units`` moving it back)
    sits in the loader's queue twice: it is read once, and its counters count it once (a
    review found it read twice, the tokens read that the adaptive policy uses doubled)."""
    import msd_dask.roles.loader as loader_module

    root, _ = corpus
    source, units = _loader_inputs(config(root), 0)
    reads: list[int] = []
    read_unit = loader_module.read_unit

    def counted(src, fs, unit, *args, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(unit.row_offset)
        return read_unit(src, fs, unit, *args, **kwargs)

    monkeypatch.setattr(loader_module, "read_unit", counted)

    async def run() -> None:
        loader = SourceLoader(source, units, {"kind": "bytes"}, threads=1)
        try:
            await loader.assign([(0, 0), (0, 1), (0, 2)])
            await loader.release([(0, 2)])
            await loader.assign([(0, 2)])
            lengths = await loader.metadata(0, 2)
            await asyncio.sleep(0.3)  # (a second read would have started by now)
            assert len(reads) == 3 and sorted(reads) == sorted(u[2] for u in units[:3])
            assert loader.units_read == 3 and len(lengths) > 0
        finally:
            await loader.close()

    asyncio.run(run())


def _skipping_copy(corpus, tmp_path) -> tuple[Any, Any, str]:
    """A copy of the corpus whose ``prose`` source skips bad input: its source, units and
    the path of its unit 1 (the file the tests take away for a moment)."""
    import shutil

    root, _ = corpus
    copy = str(tmp_path / "corpus")
    shutil.copytree(root, copy)
    cfg = config(copy)
    cfg["sources"][1]["on_error"] = "skip"
    source, units = _loader_inputs(cfg, 1)
    return source, units, units[1][0]


async def _planned_then_away(source: Any, units: Any, path: str) -> tuple[list, np.ndarray]:
    """Read unit 1 as the planner planned it (a piece of row 2), then take its file away
    (a store failing for a moment): the request and the piece it fetched."""
    import os

    first = SourceLoader(source, units, {"kind": "bytes"})
    lengths = np.asarray(await first.metadata(0, 1))  # what the planner plans with
    request = [(0, 1, units[1][2] + 2, 0, int(lengths[2]) - 1)]
    want = split_pieces(await first.fetch(request))[0]
    await first.close()  # lost, or retired
    os.rename(path, path + ".away")
    return request, want


def test_a_unit_read_again_differently_is_read_once_more_not_cut(corpus, tmp_path) -> None:
    """Under ``on_error: skip`` a loader re-created (or given a retired one's units) reads
    a unit again; a store failing for a moment then quarantines the file, and the unit
    has no row where the step was planned with the first read's.  ``fetch`` raised a
    bare IndexError, and kept the empty unit after the store came back (a review).  Now
    it says which source, file and row read differently, and reads the unit again at
    the next fetch."""
    import os

    source, units, path = _skipping_copy(corpus, tmp_path)

    async def run() -> None:
        request, want = await _planned_then_away(source, units, path)
        again = SourceLoader(source, units, {"kind": "bytes"})
        try:
            with pytest.raises(RuntimeError, match=rf"file '{path}', row {units[1][2] + 2} "
                               r"\(epoch 0\): read again, the document has 0 rows in the unit"):
                await again.fetch(request)
            os.rename(path + ".away", path)  # it is back: the next fetch reads the unit again
            np.testing.assert_array_equal(split_pieces(await again.fetch(request))[0], want)
        finally:
            await again.close()

    asyncio.run(run())


def test_a_unit_that_keeps_reading_differently_fails_naming_its_file(corpus, tmp_path) -> None:
    """A file changed or gone since its steps were planned was read again about four
    times a second until the constructor's timeout (300 s by default), the service
    stalled, the ranks' first error named no file, and under ``on_error: skip`` each read
    counted one more quarantine (a review of storage failing mid-run).  Its third read
    that reads differently is a ``DataError`` naming the source, file and row, which
    fails the constructor at once; a read as planned in between starts the count again."""
    import os

    from msd_dask import DataError
    from msd_dask.roles.loader import DIFFERENT_READS

    source, units, path = _skipping_copy(corpus, tmp_path)
    row = units[1][2] + 2

    async def run() -> None:
        request, want = await _planned_then_away(source, units, path)
        again = SourceLoader(source, units, {"kind": "bytes"})
        try:
            for _ in range(DIFFERENT_READS - 1):
                with pytest.raises(RuntimeError, match="; reading it again$"):
                    await again.fetch(request)
            os.rename(path + ".away", path)  # back for a read: the count starts again
            np.testing.assert_array_equal(split_pieces(await again.fetch(request))[0], want)
            os.rename(path, path + ".away")
            await again.release([(0, 1)])  # (the planner released it: read afresh)
            for _ in range(DIFFERENT_READS - 1):
                with pytest.raises(RuntimeError, match="; reading it again$"):
                    await again.fetch(request)
            with pytest.raises(DataError, match=rf"^source 'prose', file '{path}', row {row}: "
                                                r"read again, the document has 0 rows in the "
                                                r"unit, .* 3 times: the file changed, or cannot "
                                                r"be read, since its documents were planned"):
                await again.fetch(request)
        finally:
            await again.close()

    asyncio.run(run())


def test_a_fetch_that_fails_counts_no_token_fetched(corpus, tmp_path) -> None:
    """A fetch that failed at a later row counted the pieces cut before it as fetched, and
    its retry counted them again (a review): ``tokens_fetched`` counts what was delivered."""
    source, units, path = _skipping_copy(corpus, tmp_path)

    async def run() -> None:
        request, _want = await _planned_then_away(source, units, path)
        again = SourceLoader(source, units, {"kind": "bytes"})
        try:
            lengths = np.asarray(await again.metadata(0, 0))
            first = (0, 0, units[0][2], 0, int(lengths[0]) - 1)  # a piece that is there
            with pytest.raises(RuntimeError, match="read again"):
                await again.fetch([first, *request])
            assert again.tokens_fetched == 0
            await again.fetch([first])
            assert again.tokens_fetched == int(lengths[0]) - 1
        finally:
            await again.close()

    asyncio.run(run())


@pytest.mark.parametrize("key", [(0, 10_000), (0, -1), (-1, 0)])
def test_a_unit_the_source_does_not_have_is_refused_naming_it(corpus, key) -> None:
    """A unit past the end raised inside the read's bookkeeping, which settled no future:
    ``metadata`` and ``fetch`` waited for ever; unit -1 answered the last unit's lengths
    (a review).  Refused at once, naming the unit and the source's range."""
    root, _texts = corpus
    source, units = _loader_inputs(config(root), 0)
    epoch, unit = key

    async def run() -> None:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            says = (rf"loader 0 of source 'code' was asked for unit {unit} of epoch {epoch}: "
                    rf"the source has units 0\.\.{len(units) - 1}")
            with pytest.raises(ValueError, match=says):
                await asyncio.wait_for(loader.metadata(epoch, unit), 10)
            with pytest.raises(ValueError, match=says):
                await asyncio.wait_for(loader.fetch([(epoch, unit, 0, 0, 1)]), 10)
            with pytest.raises(ValueError, match=says):
                await loader.assign([(0, 0), key])
            assert (0, 0) not in loader._ready  # (nothing of the call was queued)
            assert len(np.asarray(await loader.metadata(0, 0))) > 0  # (it reads on)
        finally:
            await loader.close()

    asyncio.run(run())


def test_fetches_waiting_together_for_a_unit_read_differently_both_say_so(corpus, tmp_path) -> None:
    """Two fetches wait for one unit (a constructor's round and a retry, say); the first
    to wake finds it read differently and drops it.  The second then took the dropped
    unit's documents: a bare KeyError (a review).  Now both say the unit read
    differently, and the next fetch reads it again."""
    import os

    source, units, path = _skipping_copy(corpus, tmp_path)

    async def run() -> None:
        request, want = await _planned_then_away(source, units, path)
        again = SourceLoader(source, units, {"kind": "bytes"})
        try:
            got = await asyncio.gather(again.fetch(request), again.fetch(request),
                                       return_exceptions=True)
            for e in got:
                assert isinstance(e, RuntimeError), got
                assert f"file '{path}', row {units[1][2] + 2} (epoch 0): read again" in str(e)
            os.rename(path + ".away", path)
            np.testing.assert_array_equal(split_pieces(await again.fetch(request))[0], want)
        finally:
            await again.close()

    asyncio.run(run())


def test_a_failure_that_is_not_bad_input_names_the_source_and_file(corpus) -> None:
    """A tokenizer's (or a format's, or a pool's) own error reached the planner and the
    constructors bare, naming no source, file or unit (a review of the loaders)."""
    root, _ = corpus
    source, units = _loader_inputs(config(root), 1)

    async def run() -> None:
        loader = SourceLoader(source, units, {"kind": "bytes"})

        def broken(text: str) -> Any:
            raise RuntimeError("tokenizer internal error")

        loader.tokenizer.encode = broken
        try:
            with pytest.raises(RuntimeError, match=rf"source 'prose', file '{units[1][0]}' "
                               r"\(epoch 0, unit 1\): RuntimeError: tokenizer internal error"):
                await loader.metadata(0, 1)
        finally:
            await loader.close()

    asyncio.run(run())


def test_a_loader_made_does_not_list_its_source(corpus, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader listed its whole source to get a filesystem (one glob and an isdir per
    file: on object storage a listing at start, at every scale-up and after every loss,
    and a listing that failed briefly failed the role; a review of the loaders).  It now
    lists nothing, and reads its units all the same."""
    from fsspec.implementations.local import LocalFileSystem

    root, texts = corpus
    source, units = _loader_inputs(config(root), 0)

    def listed(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the loader listed its source")

    for name in ("glob", "find", "ls"):
        monkeypatch.setattr(LocalFileSystem, name, listed)

    async def run() -> np.ndarray:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            return np.asarray(await loader.metadata(0, 1))
        finally:
            await loader.close()

    assert len(asyncio.run(run())) > 0


def test_a_read_whose_work_was_cancelled_under_it_fails_its_unit(
        corpus, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read whose work was cancelled under it (its preprocess pool replaced by another read
    thread after a pool process died) ended the read's task with asyncio's CancelledError,
    which ``except Exception`` let through: the unit was never settled, and whoever waited
    for it waited for the planner's timeout, then blamed the loader (a review of the
    loaders).  The unit fails at once, naming its file."""
    import concurrent.futures

    from msd_dask.roles import loader as loader_module

    root, texts = corpus
    source, units = _loader_inputs(config(root), 0)

    def cancelled(*args: Any, **kwargs: Any) -> Any:
        raise concurrent.futures.CancelledError()

    monkeypatch.setattr(loader_module, "read_unit", cancelled)

    async def run() -> None:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            with pytest.raises(RuntimeError, match=r"file .* \(epoch 0, unit 1\): CancelledError"):
                await asyncio.wait_for(loader.metadata(0, 1), 10)
        finally:
            await loader.close()

    asyncio.run(run())


class _HeldReads:
    """A read pool whose reads run only when the test says so (:meth:`complete`)."""

    def __init__(self) -> None:
        import concurrent.futures

        self._future = concurrent.futures.Future
        self.pending: dict[tuple[int, str], Any] = {}

    def submit(self, fn: Any, *args: Any) -> Any:
        f = self._future()
        unit = args[2]  # read_unit(src, fs, unit, ...)
        self.pending[unit.row_offset, unit.path] = (f, fn, args)
        return f

    def complete(self, unit: Any) -> None:
        f, fn, args = self.pending.pop((unit.row_offset, unit.path))
        f.set_result(fn(*args))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


def test_a_unit_released_while_read_and_fetched_as_the_read_ends_is_read_again(corpus) -> None:
    """Unit K is released while it is read; a fetch asks for it again, and K's read ends one
    step of the loop after another read freed a slot: the read loop took K's new request
    for the read still going on (K left ``_reading`` only in the task's done callback) and
    skipped it, so nothing read K and the fetch waited until its timeout (a review of the
    data path).  K is read again and the fetch answered."""
    root, _ = corpus

    async def run() -> tuple[bool, Any]:
        source, units = _loader_inputs(config(root), 0)
        loader = SourceLoader(source, units, {"kind": "bytes"}, threads=2)
        reads = loader._pool = _HeldReads()  # type: ignore[assignment]
        k, l_, m = (0, 0), (0, 1), (0, 2)
        await loader.assign([k, l_, m])  # K and L read (2 slots), M waits for a slot
        await asyncio.sleep(0.05)
        assert set(loader._reading) == {k, l_}
        await loader.release([k])  # (not pinned: released while it is read)
        uk, ul = loader.units[0], loader.units[1]
        fetch = asyncio.ensure_future(loader.fetch(
            [(0, 1, ul.row_offset, 0, 1), (0, 0, uk.row_offset, 0, 1)]))
        await asyncio.sleep(0.05)
        reads.complete(ul)  # L's read ends, M takes its slot ...
        await asyncio.sleep(0)
        reads.complete(uk)  # ... and K's read ends a step of the loop later
        await asyncio.sleep(0.2)
        again = (uk.row_offset, uk.path) in reads.pending
        if again:
            reads.complete(uk)
        try:
            answer = await asyncio.wait_for(fetch, 5)
        finally:
            fetch.cancel()
            await loader.close()
        return again, answer

    again, answer = asyncio.run(run())
    assert again  # K is read again for the fetch
    assert len(split_pieces(answer)) == 2
