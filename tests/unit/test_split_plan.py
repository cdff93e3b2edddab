"""The planner's work for the constructors (split_plan, StepPieces): the same work items,
rows and order as one tuple per piece, in a few arrays."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from msd_dask.core.plan import StepPlan
from msd_dask.core.stream import Piece
from msd_dask.roles.constructor import StepPieces, pack_work, unpack_work
from msd_dask.roles.planner import split_plan

NAMES = ["web", "code"]
RELPATH = {s: [f"{s}/part-{u}.jsonl" for u in range(50)] for s in NAMES}
OWNER = {(s, e, u): (u * 7 + e) % 3 for s in NAMES for e in range(3) for u in range(50)}


def _plan(dp: int, mb: int, seed: int, big: bool = False) -> StepPlan:
    rng = np.random.default_rng(seed)
    rows = [[[Piece(NAMES[int(rng.integers(2))], int(rng.integers(3)), int(rng.integers(50)),
                    int(rng.integers(1000)) + (2**40 if big else 0), int(rng.integers(2)),
                    0, int(rng.integers(1, 99)), 99)
              for _ in range(int(rng.integers(0, 6)))]
             for _ in range(mb)]
            for _ in range(dp)]
    return StepPlan.from_rows(0, rows, [float(rng.random()) for _ in range(dp)], 1.0, NAMES)


def _reference(plan: StepPlan, n: int) -> list[dict]:
    """One tuple per piece, as the planner sent the work before."""
    work: list[dict] = [{} for _ in range(n)]
    for dp, rows in enumerate(plan.rows):
        work[dp % n][dp] = [[(p.source, OWNER[(p.source, p.epoch, p.unit)], p.epoch, p.unit,
                              p.row, p.start, p.end, p.chunk,
                              f"{RELPATH[p.source][p.unit]}:{p.row}") for p in row]
                            for row in rows]
    return work


@pytest.mark.parametrize(("dp", "mb", "n", "big"), [(1, 1, 1, False), (7, 3, 3, False),
                                                      (4, 2, 6, False), (16, 4, 16, True),
                                                      (0, 2, 2, False)])
def test_same_work_items_in_the_same_order(dp: int, mb: int, n: int, big: bool) -> None:
    for seed in range(3):
        plan = _plan(dp, mb, seed, big)
        got = split_plan(plan, n, OWNER, RELPATH, NAMES)
        want = _reference(plan, n)
        assert len(got) == n
        for g, w in zip(got, want, strict=True):
            assert len(g) == len(w)
            assert dict(g.items()) == w
            again = pickle.loads(pickle.dumps(g, protocol=5))
            assert dict(again.items()) == w
            assert g.pieces.dtype == (np.int64 if big and len(g.pieces) else np.int32)
            assert len(g.paths) == len(set(g.paths))  # a unit's path once per constructor
            # each constructor gets its own DP ranks' costs, not the step's every rank's
            assert g.costs.tolist() == [plan.rank_cost[d] for d in g.dps.tolist()]


def test_kept_work_comes_back_the_same() -> None:
    """What the planner keeps for a re-created constructor (pack_work) is the work it sent."""
    plan = _plan(16, 4, 5, big=True)
    for w in split_plan(plan, 5, OWNER, RELPATH, NAMES):
        packed = pack_work(w)
        assert isinstance(packed, bytes)
        again = unpack_work(packed)
        assert dict(again.items()) == dict(w.items())
        assert again.pieces.dtype == w.pieces.dtype and again.paths == w.paths


def test_kept_work_holds_only_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_work's bytes hold no more memory than their length: zstandard's own result keeps
    its whole output buffer (the input's size), and the planner keeps ``prefetch`` steps."""
    import tracemalloc

    from msd_dask.roles import constructor

    monkeypatch.setattr(constructor, "_COMPRESS_FROM", 0)  # (a large step's, compressed)
    plan = StepPlan(0, np.zeros((20_000, 8), dtype=np.int64), np.full((4, 2), 2_500, dtype=np.int64),
                    tuple(NAMES), [1.0] * 4, 1.0)
    work = split_plan(plan, 1, OWNER, RELPATH, NAMES)[0]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        packed = pack_work(work)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(pickle.dumps(work, protocol=5)) > 100 * len(packed)
    assert held < len(packed) + 4096
    assert dict(unpack_work(packed).items()) == dict(work.items())


@pytest.mark.parametrize("n", [0, 1, 7, 5_000])
def test_first_and_inverse_is_uniques(n: int) -> None:
    from msd_dask.core.plan import _first_and_inverse

    key = np.random.default_rng(n).integers(-3, 40, n).astype(np.int64)
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    got_first, got_inverse = _first_and_inverse(key.copy())
    assert np.array_equal(got_first, first)
    assert np.array_equal(got_inverse, inverse.reshape(-1))


@pytest.mark.parametrize("n", [0, 1, 1000])
def test_distinct_by_flags_and_by_sort_agree(n: int) -> None:
    """split_plan numbers a step's units and a constructor's paths through a table of flags
    where the keys' span is small, else by a sort: the same numbering either way."""
    from msd_dask.core.plan import distinct

    rng = np.random.default_rng(n)
    keys = rng.integers(0, 5000, n).astype(np.int64)
    by_flags = distinct(keys.copy(), 5000)
    by_sort = distinct(keys.copy(), 2**40)  # a span too large for flags
    want = np.unique(keys, return_inverse=True)
    for one, position in (by_flags, by_sort):
        assert position.tolist() == want[1].reshape(-1).tolist()
        assert keys[one].tolist() == want[0].tolist()  # an occurrence of each, in order


class _Counting:
    """A zstd compressor that counts its calls, and those that start zstd's threads."""

    def __init__(self, z: object):
        self.z, self.calls, self.threaded = z, 0, 0

    def compress(self, data: bytes) -> bytes:
        self.calls += 1
        return self.z.compress(data)  # type: ignore[attr-defined, no-any-return]

    def multi_compress_to_buffer(self, data: list[bytes], threads: int) -> object:
        self.calls += 1
        self.threaded += 1
        return self.z.multi_compress_to_buffer(data, threads=threads)  # type: ignore[attr-defined]


@pytest.mark.parametrize("threads,batch", [(1, 1 << 27), (2, 1 << 27), (3, 1 << 27), (2, 1),
                                           (2, 3000)])
def test_a_steps_work_packed_is_each_constructors_packed(
        threads: int, batch: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_works packs each constructor's work of a step, in order, the same bytes on any
    number of threads, across its batches (a work each, two or three, or all in one); a
    large step's (from _COMPRESS_FROM bytes laid out) compressed on zstd's threads, one call
    per batch."""
    from msd_dask.roles import constructor

    z = _Counting(constructor._compressor())
    monkeypatch.setattr(constructor, "_compressor", lambda: z)
    monkeypatch.setattr(constructor, "_BATCH_BYTES", batch)
    monkeypatch.setattr(constructor, "_COMPRESS_FROM", 0)
    work = split_plan(_plan(16, 4, 7, big=True), 5, OWNER, RELPATH, NAMES)
    packed = constructor.pack_works(work, threads)
    if threads > 1:
        assert z.threaded == {1 << 27: 1, 1: 5, 3000: 2}[batch]
    else:
        assert z.threaded == 0 and z.calls == len(work)
    assert all(p[:4] == constructor._ZSTD_MAGIC for p in packed)
    assert packed == [pack_work(w) for w in work]
    assert all(type(p) is bytes for p in packed)
    for one, back in zip(work, map(unpack_work, packed), strict=True):
        assert pickle.dumps(back) == pickle.dumps(one)


@pytest.mark.parametrize("over", [0, 1])
def test_a_small_steps_work_is_kept_as_laid_out(over: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose works take fewer than _COMPRESS_FROM bytes laid out (dp 16,384 × 4K:
    3.6 MiB) is not compressed: zstd took about as long as laying the works out (10-16 ms
    a step) to save 1.6 MiB.  From _COMPRESS_FROM bytes on, the whole step is; either
    unpacks to the same work."""
    from msd_dask.roles import constructor

    z = _Counting(constructor._compressor())
    monkeypatch.setattr(constructor, "_compressor", lambda: z)
    work = split_plan(_plan(16, 4, 7, big=True), 5, OWNER, RELPATH, NAMES)
    laid = constructor._laid_out(work)
    monkeypatch.setattr(constructor, "_COMPRESS_FROM", sum(map(len, laid)) + over)
    packed = constructor.pack_works(work, 2)
    if over:
        assert packed == laid and z.calls == 0
    else:
        assert z.calls == 1 and all(p[:4] == constructor._ZSTD_MAGIC for p in packed)
        assert sum(map(len, packed)) < sum(map(len, laid))
    for one, back in zip(work, map(unpack_work, packed), strict=True):
        assert pickle.dumps(back) == pickle.dumps(one)


@pytest.mark.parametrize("piece_slice", [1, 7, 1 << 15])
def test_the_same_work_whatever_the_slices_and_the_plans_source_order(
        piece_slice: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """split_plan gathers the table a slice of pieces at a time, and maps the plan's source
    indices to ``names``: the same work items whatever the slice, whatever the plan's order
    of its sources or its table's dtype."""
    from msd_dask.roles import planner

    monkeypatch.setattr(planner, "_SLICE", piece_slice)
    for seed in range(3):
        plan = _plan(16, 3, seed)
        table = plan.table.copy()
        table[:, 0] = 1 - table[:, 0]
        swapped = StepPlan(plan.step, table, plan.row_sizes, tuple(reversed(NAMES)),
                           plan.rank_cost, plan.lower_bound)
        want = _reference(plan, 5)
        # (int64 plan tables, as from_rows makes them, and int32 ones, as the planner does)
        narrow = [StepPlan(p.step, p.table.astype(np.int32), p.row_sizes, p.sources,
                           p.rank_cost, p.lower_bound) for p in (plan, swapped)]
        for p in (plan, swapped, *narrow):
            got = split_plan(p, 5, OWNER, RELPATH, NAMES)
            assert [dict(g.items()) for g in got] == want
            assert all(g.sources == tuple(NAMES) for g in got)


@pytest.mark.parametrize("piece_slice", [1, 7, 1 << 15])
def test_a_negative_value_in_a_plan_table_widens_the_work_as_before(
        piece_slice: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """split_plan finds a negative value of an int32 plan table as it gathers it, in any
    slice (of an int64 one before): an int64 work where a piece holds one, an int32 work
    where only a column the work does not take does."""
    from msd_dask.roles import planner

    monkeypatch.setattr(planner, "_SLICE", piece_slice)
    for seed in range(3):
        plan = _plan(16, 3, seed)
        last = len(plan.table) - 1 - seed  # a piece in the last slices
        for col, want in ((5, np.int64), (7, np.int32)):  # a piece's start; no work's column
            for plan_dtype in (np.int32, np.int64):
                table = plan.table.astype(plan_dtype)
                table[last, col] = -3
                p = StepPlan(plan.step, table, plan.row_sizes, plan.sources, plan.rank_cost,
                             plan.lower_bound)
                got = split_plan(p, 5, OWNER, RELPATH, NAMES)
                assert [dict(g.items()) for g in got] == _reference(p, 5)
                assert {g.pieces.dtype for g in got} == {np.dtype(want)}


def _work(pieces: np.ndarray, paths: tuple[str, ...]) -> StepPieces:
    return StepPieces(dps=np.array([3, 8], dtype=np.int64), rows=np.array([1, 1], dtype=np.int64),
                      lengths=np.array([len(pieces) // 2, len(pieces) - len(pieces) // 2],
                                       dtype=np.int64),
                      pieces=pieces, sources=tuple(NAMES), paths=paths,
                      costs=np.array([0.5, 1.5]))


@pytest.mark.parametrize("case", ["narrow", "wide", "negative", "edges", "empty", "nul",
                                  "no paths"])
def test_packed_work_unpacks_equal_and_pickles_the_same(case: str) -> None:
    """pack_work narrows integer columns and joins the paths: what unpack_work gives back
    equals the work, column dtypes and all, and pickles to the same bytes (what a
    re-created constructor is sent is what the first one was)."""
    rng = np.random.default_rng(1)
    pieces = rng.integers(0, 70_000, (50, 9)).astype(np.int32)
    pieces[:, 0] = rng.integers(0, 2, 50)
    paths = tuple(f"dir/part-{i}.jsonl" for i in range(7))
    if case == "wide":
        pieces = pieces.astype(np.int64)
        pieces[:, 3] += 2**40
    elif case == "negative":
        pieces = pieces.astype(np.int64)
        pieces[5, 6] = -1
    elif case == "edges":  # the largest value of each narrow dtype, and one more
        pieces = pieces.astype(np.int64)
        for j, top in enumerate((2**8 - 1, 2**16 - 1, 2**32 - 1)):
            pieces[0, 2 * j + 1], pieces[0, 2 * j + 2] = top, top + 1
    elif case == "empty":
        pieces = pieces[:0]
    elif case == "nul":
        paths = ("a\0b", "c")
    elif case == "no paths":
        paths = ()
    work = _work(pieces, paths)
    again = unpack_work(pack_work(work))
    for name in ("dps", "rows", "lengths", "pieces", "costs"):
        want, got = getattr(work, name), getattr(again, name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want) and got.flags.writeable and got.flags.c_contiguous
    assert again.paths == work.paths and again.sources == work.sources
    assert type(again.paths) is tuple and all(type(p) is str for p in again.paths)
    assert pickle.dumps(again, protocol=5) == pickle.dumps(work, protocol=5)


def test_packed_work_narrows_its_columns() -> None:
    """Small values are kept narrow: the packed work is smaller than the pieces' bytes
    compressed as they are, and less than a byte per value where every value fits in one."""
    import zstandard

    rng = np.random.default_rng(2)
    pieces = rng.integers(0, 200, (5_000, 9)).astype(np.int32)
    work = _work(pieces, ("a",))
    packed = len(pack_work(work))
    assert packed < len(zstandard.ZstdCompressor(level=1).compress(pieces))
    assert packed < pieces.size + 1024


@pytest.mark.parametrize("lay_bytes", [1, 3000, 1 << 23])
def test_works_laid_out_together_are_each_laid_out_alone(
        lay_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_works lays out a run of works together, a field at a time (each column's
    narrow dtype of each work from one pass): each work's bytes are those it has packed
    alone, whatever the runs, where the works' arrays differ in dtype and columns, hold
    negative or wide values, or nothing."""
    from msd_dask.roles import constructor

    monkeypatch.setattr(constructor, "_LAY_BYTES", lay_bytes)
    rng = np.random.default_rng(3)
    works = []
    for case in range(12):
        pieces = rng.integers(0, [2, 16, 3, 300, 70_000, 5_000, 5_000, 2, 9],
                              (int(rng.integers(0, 40)), 9)).astype(np.int32)
        if case % 4 == 1:
            pieces = pieces.astype(np.int64)
            pieces[:, 3] += 2**40
        elif case % 4 == 2 and len(pieces):
            pieces[-1, 6] = -1
        elif case % 4 == 3:
            pieces = pieces[:0]
        works.append(_work(pieces, tuple(f"p{case}-{i}" for i in range(case % 3))))
    works.append(StepPieces(dps=np.zeros(0, dtype=np.int64), rows=np.zeros(0, dtype=np.int64),
                            lengths=np.zeros(0, dtype=np.int64),
                            pieces=np.zeros((3, 0), dtype=np.int32), sources=tuple(NAMES),
                            paths=(), costs=np.zeros(0)))
    alone = [constructor.pack_works([w])[0] for w in works]
    assert constructor.pack_works(works) == alone
    for one, back in zip(works, map(unpack_work, alone), strict=True):
        assert pickle.dumps(back, protocol=5) == pickle.dumps(one, protocol=5)
