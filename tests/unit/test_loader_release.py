"""A unit the planner released is not kept by a fetch that reads it again.

The planner releases a unit once every step that used it was claimed by all
ranks (``PlannerActor._assign_ahead``), but a constructor re-created while the
planner waits in ``submit`` is re-sent the recent steps and may fetch the unit
after that.  ``fetch`` read it again and kept it: nothing releases it a second
time, so each such recovery left units in the loader's memory for good (a
review).  Now a unit the planner does not hold is kept only while fetches use
it, and a release waits for the fetches using the unit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from test_loader_fetch import _loader_inputs

from msd_dask.core.packing import split_pieces
from msd_dask.roles.loader import SourceLoader

from corpus import config


def _requests(loader: SourceLoader, lengths: np.ndarray, unit: int) -> list[tuple[int, ...]]:
    """A piece of each document of ``unit`` (epoch 0) with more than one token."""
    off = loader.units[unit].row_offset
    return [(0, unit, off + r, 0, int(n) - 1) for r, n in enumerate(lengths) if n > 1]


def _held(loader: SourceLoader) -> tuple[int, int]:
    return len(loader._data), len(loader._ready)


def test_a_unit_fetched_after_its_release_is_read_for_the_fetch_not_kept(corpus) -> None:
    root, _ = corpus
    source, units = _loader_inputs(config(root), 0)

    async def run() -> None:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            await loader.assign([(0, 1)])
            lengths = np.asarray(await loader.metadata(0, 1))
            reqs = _requests(loader, lengths, 1)
            want = split_pieces(await loader.fetch(reqs))
            assert _held(loader) == (1, 1)  # the planner's unit stays after a fetch
            await loader.release([(0, 1)])
            assert _held(loader) == (0, 0)
            read = loader.units_read
            for _ in range(2):  # re-sent steps fetched after the release, twice
                got = split_pieces(await loader.fetch(np.asarray(reqs, dtype=np.int64)))
                for a, b in zip(got, want, strict=True):
                    np.testing.assert_array_equal(a, b)
                # read again for the fetch, and not kept: nothing would release it again
                assert _held(loader) == (0, 0)
                assert await loader.ping() == 0
            assert loader.units_read == read + 2
            assert (await loader.stats())["units_buffered"] == 0
        finally:
            await loader.close()

    asyncio.run(run())


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """``read_unit`` waits until the returned event is set (a read in progress)."""
    import msd_dask.roles.loader as loader_module

    gate = threading.Event()
    read_unit = loader_module.read_unit

    def slow(*args: Any, **kwargs: Any) -> Any:
        gate.wait(30)
        return read_unit(*args, **kwargs)

    monkeypatch.setattr(loader_module, "read_unit", slow)
    return gate


async def _fetching(loader: SourceLoader, units: Any) -> asyncio.Future[Any]:
    """A fetch of a piece of unit 1, under way: its read waits for the gate (``gated``)."""
    fetching = asyncio.ensure_future(loader.fetch([(0, 1, units[1][2], 0, 1)]))
    await asyncio.sleep(0.2)
    return fetching


def _on_a_loader(corpus: Any, gated: threading.Event,
                 body: Callable[[SourceLoader, Any], Awaitable[None]]) -> None:
    """Run ``body(loader, units)`` on a loader of the corpus's first source; then open the
    gate (a read still waiting ends) and close the loader."""
    root, _ = corpus
    source, units = _loader_inputs(config(root), 0)

    async def run() -> None:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            await body(loader, units)
        finally:
            gated.set()
            await loader.close()

    asyncio.run(run())


def test_a_release_during_a_fetch_waits_for_the_fetch(corpus, gated) -> None:
    """The unit a fetch waits for is released meanwhile: the fetch gets its pieces (it was
    cancelled, and the constructor's retry read the unit again and kept it), and the unit
    is dropped once the fetch ends."""

    async def body(loader: SourceLoader, units: Any) -> None:
        await loader.assign([(0, 1)])
        fetching = await _fetching(loader, units)
        await loader.release([(0, 1)])
        assert not fetching.done()
        gated.set()
        pieces = split_pieces(await asyncio.wait_for(fetching, 30))
        assert len(pieces) == 1 and len(pieces[0]) == 2
        assert _held(loader) == (0, 0)

    _on_a_loader(corpus, gated, body)


def test_a_unit_assigned_while_a_fetch_reads_it_is_kept_until_released(corpus, gated) -> None:
    """A re-created loader may be asked for a unit before the planner hands it the unit
    (``hand_over``): the planner's assign makes it the planner's to release."""

    async def body(loader: SourceLoader, units: Any) -> None:
        fetching = await _fetching(loader, units)
        assert await loader.assign([(0, 1)]) == 0  # being read already: not read twice
        gated.set()
        await asyncio.wait_for(fetching, 30)
        assert _held(loader) == (1, 1)
        assert loader.units_read == 1
        await loader.release([(0, 1)])
        assert _held(loader) == (0, 0)

    _on_a_loader(corpus, gated, body)


def test_close_ends_a_fetch_of_a_released_unit(corpus, gated) -> None:
    """A fetch keeping a released unit does not keep a closed loader's wait going."""
    root, _ = corpus
    source, units = _loader_inputs(config(root), 0)

    async def run() -> BaseException | None:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        fetching = await _fetching(loader, units)
        await loader.close()
        gated.set()
        try:
            await asyncio.wait_for(fetching, 5.0)
            return None
        except BaseException as e:  # noqa: BLE001 - the test reports what ended the wait
            assert _held(loader) == (0, 0)
            return e

    err = asyncio.run(run())
    assert isinstance(err, asyncio.CancelledError), repr(err)


def test_a_unit_released_while_it_waits_for_a_read_thread_is_not_read(corpus, gated) -> None:
    """Units queued behind a read and released meanwhile (a scale-up's ``spread_units``
    moving them to a new loader) were still read in full once a read thread was free, then
    dropped: on a slow store, the old loader spent a unit's read on exactly the load the new
    loaders were to take off it (a review).  They are passed over."""

    async def body(loader: SourceLoader, units: Any) -> None:
        assert loader.threads == 1
        await loader.assign([(0, 0), (0, 1), (0, 2)])
        await asyncio.sleep(0.2)  # (unit 0 is read, the gate holds it; 1 and 2 wait)
        assert list(loader._reading) == [(0, 0)]
        await loader.release([(0, 1), (0, 2)])
        gated.set()
        await asyncio.wait_for(asyncio.shield(loader._ready[(0, 0)]), 30)
        await asyncio.sleep(0.3)
        assert loader.units_read == 1 and not loader._reading
        assert _held(loader) == (1, 1)

    _on_a_loader(corpus, gated, body)


def test_a_held_unit_whose_read_failed_for_a_moment_is_read_again(corpus, monkeypatch) -> None:
    """A held unit kept its failed read as its answer for good: a read cancelled under it
    once (a preprocess pool replaced) failed every later fetch, and the constructor retried
    until the service gave up (a review).  Bad input (a ``DataError``) is not read again."""
    import concurrent.futures

    from msd_dask.errors import DataError
    from msd_dask.roles import loader as module

    root, _ = corpus
    source, units = _loader_inputs(config(root), 0)
    real, calls = module.read_unit, []
    failures: list[BaseException] = [concurrent.futures.CancelledError()]

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[2])
        if failures:
            raise failures.pop()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "read_unit", flaky)

    async def run() -> None:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            await loader.assign([(0, 1)])
            with pytest.raises(RuntimeError, match=r"CancelledError"):
                await loader.metadata(0, 1)
            lengths = np.asarray(await loader.metadata(0, 1))  # read again
            assert len(calls) == 2 and len(lengths)
            assert split_pieces(await loader.fetch(_requests(loader, lengths, 1)))
            failures.append(DataError("bad row", path=units[2][0], row=3))
            await loader.assign([(0, 2)])
            for _ in range(2):  # the same error, from the one read
                with pytest.raises(DataError, match="bad row"):
                    await loader.metadata(0, 2)
            assert len(calls) == 3
        finally:
            await loader.close()

    asyncio.run(run())
