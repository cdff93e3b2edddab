"""The planner's kernels (msd_dask.core._kernels) against plain one-piece-at-a-time statements
of their rules, on random inputs with many ties; and the same plans whether the kernels run as
Python or compiled."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np
import pytest

from msd_dask.core._kernels import best_fit_rows


def _best_fit_one_by_one(ls: np.ndarray, n_rows: int, seq_len: int) -> np.ndarray:
    """Each piece to the row with the least room that fits it, the lowest such row on ties."""
    room = np.full(n_rows, seq_len, dtype=np.int64)
    out = np.full(len(ls), -1, dtype=np.int64)
    for i, length in enumerate(ls.tolist()):
        fits = room >= length
        if fits.any():
            r = int(np.argmin(np.where(fits, room, seq_len + 1)))
            room[r] -= length
            out[i] = r
    return out


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_rows_is_best_fit_piece_by_piece(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(60):
        seq_len = int(rng.choice([1, 7, 16, 100, 1024]))
        n_rows = int(rng.integers(1, 30))
        n = int(rng.integers(0, 200))
        if seed % 3 == 0:    # few distinct lengths: long runs, shared rooms
            ls = rng.choice(rng.integers(0, seq_len + 1, 3), n)
        elif seed % 3 == 1:  # zero lengths included
            ls = rng.integers(0, seq_len + 1, n)
        else:
            ls = np.minimum(seq_len, rng.lognormal(2, 1.5, n).astype(np.int64))
        ls = np.asarray(ls, dtype=np.int64)
        # runs of equal lengths, decreasing, after a few pieces in any order (carried ones)
        head = int(rng.integers(0, n + 1)) if n else 0
        ls = np.concatenate([ls[:head], -np.sort(-ls[head:])])
        assert best_fit_rows(ls, n_rows, seq_len).tolist() == \
            _best_fit_one_by_one(ls, n_rows, seq_len).tolist()


def _greedy_one_by_one(lens: np.ndarray, ks: np.ndarray, n_ranks: int, mb: int,
                       seq_len: int) -> tuple[list[int], list[int]]:
    """LPT piece by piece, no heap: the first pieces (keys > 0) to ranks 0, 1, ... in turn,
    then each to the least (key sum, rank) with a row with room, on its row with the least
    key sum that has room (the first on ties)."""
    free = [[seq_len] * mb for _ in range(n_ranks)]
    row_key = [[0.0] * mb for _ in range(n_ranks)]
    rank_key = [0.0] * n_ranks
    rank, micro = [-1] * len(lens), [-1] * len(lens)
    head = 0
    while head < min(len(lens), n_ranks) and ks[head] > 0:
        free[head][0] -= int(lens[head])
        row_key[head][0] = rank_key[head] = float(ks[head])
        rank[head], micro[head] = head, 0
        head += 1
    for i in range(head, len(lens)):
        length, key = int(lens[i]), float(ks[i])
        fits = [r for r in range(n_ranks) if max(free[r]) >= length]
        if not fits:
            continue
        r = min(fits, key=lambda x: (rank_key[x], x))
        m = min((q for q in range(mb) if free[r][q] >= length), key=lambda q: (row_key[r][q], q))
        free[r][m] -= length
        row_key[r][m] += key
        rank_key[r] += key
        rank[i], micro[i] = r, m
    return rank, micro


@pytest.mark.parametrize("seed", range(8))
def test_greedy_fill_is_lpt_piece_by_piece(seed: int) -> None:
    from msd_dask.core.balance import _Greedy

    rng = np.random.default_rng(seed)
    for _ in range(25):
        n_ranks, mb = int(rng.integers(1, 40)), int(rng.choice([1, 2, 8]))
        seq_len = int(rng.choice([16, 256]))
        n = int(rng.integers(0, n_ranks * mb * 3))
        lens = rng.integers(0, seq_len + 1, n) if seed % 2 else \
            np.minimum(seq_len, rng.lognormal(2, 1.5, n).astype(np.int64))
        lens = np.asarray(lens, dtype=np.int64)
        # keys with ties (equal and zero keys), decreasing or not
        ks = np.round(rng.random(n) * 4) if seed % 4 < 2 else lens.astype(np.float64) ** 1.5
        if seed % 3 == 0:
            ks = -np.sort(-ks)
        g = _Greedy(n, n_ranks, mb, seq_len)
        g.fill(np.arange(n), lens, ks)
        rank, micro = _greedy_one_by_one(lens, ks, n_ranks, mb, seq_len)
        assert g.rank.tolist() == rank and g.micro.tolist() == micro


@pytest.mark.parametrize("seed", range(8))
def test_greedy_fill_runs_of_equal_pieces_are_lpt_piece_by_piece(seed: int) -> None:
    """Long runs of equal pieces (a long document's full-row chunks) are placed in rounds
    where every rank with room is at one key sum: the same ranks and rows as piece by
    piece, whether the run starts on equal sums (after the first pieces), on unequal ones,
    on one sum too large for its key to raise (1 on 1e18) or with a key of zero, ends
    inside a round with other pieces after it (placed by the sums the rounds left), or
    leaves ranks without room; in one fill or two; below and above COMPILE_AT pieces
    (interpreted and compiled)."""
    from msd_dask.core.balance import _Greedy

    rng = np.random.default_rng(100 + seed)
    for case in range(8):
        n_ranks, mb = int(rng.integers(1, 40)), int(rng.choice([1, 2, 8]))
        seq_len = int(rng.choice([16, 256]))
        lens: list[int] = []
        ks: list[float] = []
        if case in (1, 4):  # a few pieces of another length first: unequal sums
            head = int(rng.integers(1, n_ranks + 2))
            lens += [int(x) for x in rng.integers(1, seq_len + 1, head)]
            ks += [float(x) * 1e18 if case == 4 else float(x) * 10 for x in lens]
        elif case == 6:  # every rank at one sum a key of 1 does not raise
            lens += [1] * n_ranks
            ks += [1e18] * n_ranks
        for _ in range(int(rng.integers(1, 4)) if case != 7 else 0):  # runs, longest first
            length = int(rng.integers(1, seq_len + 1)) if lens else seq_len
            run = int(rng.choice([64, 65, 200, 3 * n_ranks * mb + 7, 1100]))
            key = 0.0 if case == 5 else 1.0 if case == 6 else float(length)
            lens += [length] * run
            ks += [key] * run
        if case == 7:  # a run ending inside a round, then pieces the tree places by the
            # sums the rounds left (the first few ranks one piece ahead)
            n_ranks, seq_len = max(n_ranks, 2), 256
            run = n_ranks * (64 // n_ranks + 2) + n_ranks // 2
            lens += [4] * run + [2] * (3 * n_ranks)
            ks += [4.0] * run + [1.0] * (3 * n_ranks)
        order = np.argsort(-np.array(ks), kind="stable")
        lengths = np.array(lens, dtype=np.int64)[order]
        keys = np.array(ks, dtype=np.float64)[order]
        g = _Greedy(len(lengths), n_ranks, mb, seq_len)
        cut = len(lengths) if case % 2 else max(n_ranks, len(lengths) // 2)
        g.fill(np.arange(cut), lengths, keys)  # (two fills where cut is short of the end)
        g.fill(np.arange(cut, len(lengths)), lengths, keys)
        rank, micro = _greedy_one_by_one(lengths, keys, n_ranks, mb, seq_len)
        assert g.rank.tolist() == rank and g.micro.tolist() == micro, case


def _rounds_vectorised(g: object, order: np.ndarray, lengths: np.ndarray,
                       keys: np.ndarray) -> np.ndarray:
    """The rounds of ``_Greedy.fill_tail`` in numpy: per round, the ``k`` ranks with room for
    its first piece by (key sum, rank) take its ``k`` next pieces, each on its row with the
    least key sum that has room; the pieces left over, in order."""
    free, row_key, rank_key = g.free, g.row_key, g.rank_key  # type: ignore[attr-defined]
    lens, ks = lengths[order], keys[order]
    left, pos, n = [], 0, len(order)
    while pos < n:
        eligible = np.flatnonzero(free.max(axis=1) >= lens[pos])
        if len(eligible) < min(16, len(free)):
            break
        k = min(len(eligible), n - pos)
        ranks = eligible[np.argsort(rank_key[eligible], kind="stable")[:k]]
        ln, kk = lens[pos:pos + k], ks[pos:pos + k]
        room = free[ranks] >= ln[:, None]
        rows = np.argmin(np.where(room, row_key[ranks], np.inf), axis=1)
        ok = room[np.arange(k), rows]
        r, m = ranks[ok], rows[ok]
        free[r, m] -= ln[ok]
        row_key[r, m] += kk[ok]
        rank_key[r] += kk[ok]
        idx = order[pos:pos + k]
        g.rank[idx[ok]], g.micro[idx[ok]] = r, m  # type: ignore[attr-defined]
        left.append(idx[~ok])
        pos += k
    return np.concatenate([*left, order[pos:]])


@pytest.mark.parametrize("seed", range(6))
def test_fill_tail_rounds_are_the_vectorised_rounds(seed: int) -> None:
    from msd_dask.core.balance import _Greedy

    rng = np.random.default_rng(seed)
    for _ in range(12):
        n_ranks, mb = int(rng.integers(1, 60)), int(rng.choice([1, 2, 8]))
        seq_len = int(rng.choice([16, 256]))
        n = int(rng.integers(0, n_ranks * mb * 6))
        lens = np.asarray(np.minimum(seq_len, rng.lognormal(1.5, 1.5, n).astype(np.int64)) if seed % 2
                          else rng.integers(0, seq_len + 1, n), dtype=np.int64)
        ks = np.round(rng.random(n) * 3) if seed % 3 == 0 else lens.astype(np.float64) * 1e-3
        # a few pieces placed first, so the rounds start from uneven ranks
        head = int(rng.integers(0, n + 1)) // 4
        a, b = _Greedy(n, n_ranks, mb, seq_len), _Greedy(n, n_ranks, mb, seq_len)
        a.fill(np.arange(head), lens, ks)
        b.fill(np.arange(head), lens, ks)
        tail = rng.permutation(np.arange(head, n))
        a.fill_tail(tail, lens, ks)
        rest = _rounds_vectorised(b, tail, lens, ks)
        b.max_free = b.free.max(axis=1)
        if len(rest):
            b.fill(rest[np.argsort(-ks[rest], kind="stable")], lens, ks)
        assert a.rank.tolist() == b.rank.tolist() and a.micro.tolist() == b.micro.tolist()
        assert a.row_key.tolist() == b.row_key.tolist() and a.rank_key.tolist() == b.rank_key.tolist()
        assert a.max_free.tolist() == a.free.max(axis=1).tolist()


@pytest.mark.parametrize("n", [0, 1, 7, 5000, 70000])
def test_stable_argsort_is_numpys(n: int) -> None:
    from msd_dask.core._kernels import stable_argsort

    rng = np.random.default_rng(n)
    cases = [rng.integers(-5, 5, n), -rng.integers(0, 131073, n), rng.integers(0, 1 << 40, n),
             rng.integers(-(1 << 62), 1 << 62, n), rng.integers(0, 3, n).astype(np.int32),
             rng.normal(size=n), np.round(rng.normal(size=n), 1),
             # equal zeros of either sign, infinities and NaNs (last)
             np.where(rng.random(n) < 0.3, -0.0, rng.choice([0.0, 1.5, -2.0, np.inf, -np.inf, np.nan], n))]
    for a in cases:
        assert stable_argsort(a).tolist() == np.argsort(a, kind="stable").tolist(), a.dtype



@pytest.mark.parametrize("n", [2, 3, 16, 31, 32, 33, 40, 300])
def test_radix_argsort_of_a_few_keys_is_numpys(n: int) -> None:
    """A few keys (a round's ranks, sorted by insertion up to ``_INSERTION_AT``, by radix
    above): the stable order of the keys as unsigned 64-bit ints (a set top bit is large),
    with ties in index order; a round's rank keys, as ``_fill_rounds`` makes them (floats
    with ties, zeros of either sign)."""
    from msd_dask.core._kernels import _float_order, _radix_argsort

    rng = np.random.default_rng(n)
    keys = [rng.integers(-(1 << 63), (1 << 63) - 1, n, dtype=np.int64, endpoint=True),
            rng.integers(-3, 3, n).astype(np.int64),
            _float_order(np.where(rng.random(n) < 0.3, -0.0,
                                  rng.choice([0.0, 1.5, 2.25, 7.0], n)), False),
            _float_order(np.round(rng.normal(size=n), 1), False)]
    for k in keys:
        want = np.argsort(k.view(np.uint64), kind="stable")
        assert _radix_argsort(k.copy(), np.arange(n)).tolist() == want.tolist()


@pytest.mark.parametrize("n", [7, 5000, 70000])
def test_stable_argsort_like_lengths_is_numpys(n: int) -> None:
    """With ``like``: keys that follow it (costs of lengths) and keys that do not (equal keys
    of other lengths, keys that fall with it, a NaN, an order that holds but for one piece)."""
    from msd_dask.core._kernels import compile_kernels, stable_argsort

    compile_kernels()
    rng = np.random.default_rng(n)
    lengths = np.minimum(131072, rng.lognormal(7, 2, n).astype(np.int64))
    costs = lengths + lengths.astype(np.float64) ** 2 / (12 * 4096)
    clipped = np.minimum(costs, 900.0)                  # equal costs of other lengths
    nan = costs.copy()
    nan[n // 2] = np.nan
    off = costs.copy()
    off[n // 3] += 1e-9                                 # one piece unlike the others of its length
    wide = lengths * (1 << 30)                          # lengths past a counting pass
    for a in (costs, clipped, -costs, nan, off, lengths.astype(np.float64), wide.astype(np.float64)):
        for like in (lengths, wide):
            for descending in (False, True):
                want = np.argsort(-a if descending else a, kind="stable")
                assert stable_argsort(a, descending, like).tolist() == want.tolist()

_PLAN_DIGEST = """
import hashlib, json, sys
import numpy as np
from msd_dask.core import _kernels
from msd_dask.core.config import parse_config
from msd_dask.core.plan import Planner
from msd_dask.core.units import Unit

mode, dp, mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "python":
    _kernels.COMPILE_AT = 1 << 62
elif mode == "compiled":
    _kernels.compile_kernels()
h = hashlib.sha256()
for balance, outliers in (("balanced", None), ("lpt", {"min_length": 0.5})):
    cfg = {"name": "k", "seed": 3, "batch": {"seq_len": 2048, "micro_batches": mb},
           "parallel": {"dp": dp}, "balance": balance,
           "sources": [{"name": n, "uri": f"memory://{n}/*.parquet", "format": "parquet",
                        "weight": w} for n, w in (("web", 0.7), ("books", 0.3))]}
    if outliers:
        cfg["outliers"] = outliers
    c = parse_config(cfg)
    pl = Planner(c, {s.name: [Unit(f"{s.name}/u{i:04d}.parquet") for i in range(64)]
                     for s in c.sources})

    def look(source, epoch, unit):
        rng = np.random.default_rng([epoch, ord(source[0]), unit])
        # lognormal lengths, many of them equal (ties everywhere)
        return np.clip(np.ceil(rng.lognormal(5.0, 1.5, 256) / 8) * 8, 1, 20000).astype(np.int64)

    for _ in range(4):
        plan = pl.plan_step(look)
        h.update(plan.table.tobytes() + plan.row_sizes.tobytes()
                 + json.dumps([plan.rank_cost, plan.lower_bound, pl.state_dict()]).encode())
print(h.hexdigest(), "numba" in sys.modules, _kernels.compiled())
"""


def _plan_digest(mode: str, dp: int, mb: int) -> tuple[str, bool, bool]:
    out = subprocess.run([sys.executable, "-c", _PLAN_DIGEST, mode, str(dp), str(mb)], check=True,
                         capture_output=True, text=True, timeout=300).stdout.split()
    return out[0], out[1] == "True", out[2] == "True"


def test_python_and_compiled_kernels_plan_the_same() -> None:
    """The kernels decide the same run as Python and compiled (steps of about 2,000 pieces,
    both balance strategies, outliers held), and a small service never imports numba."""
    py, py_numba, _ = _plan_digest("python", 64, 4)
    nb, _, nb_compiled = _plan_digest("compiled", 64, 4)
    assert py == nb
    assert not py_numba and nb_compiled
    # left to itself: a step of 8 rows (tens of pieces) stays Python, one of 256 compiles
    assert _plan_digest("auto", 4, 2)[1:] == (False, False)
    assert _plan_digest("auto", 64, 4)[1:] == (True, True)


def _partial_permutations(rng: np.random.Generator) -> list[tuple[int, np.ndarray]]:
    """``(rows, perm)``: random ones (paths and cycles), the identity, pure cycles, paths only,
    and the planner's kind (rows taken group by group from all over the table)."""
    cases = [(0, np.arange(0)), (1, np.arange(1)), (5, np.arange(5)), (5, np.arange(3)),
             (6, np.array([1, 2, 0, 4, 5, 3])), (6, np.array([5, 4, 3])), (4, np.array([3, 0, 1]))]
    for _ in range(40):
        n = int(rng.integers(1, 300))
        m = int(rng.integers(0, n + 1))
        cases.append((n, rng.permutation(n)[:m]))
    n = 5000
    idx = np.flatnonzero(rng.random(n) < 0.9)
    row_of = rng.integers(0, 64, len(idx))
    cases.append((n, idx[np.argsort(row_of, kind="stable")]))
    return cases


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_permute_rows_is_fancy_indexing_interpreted_and_compiled(
        dtype: type, monkeypatch: pytest.MonkeyPatch) -> None:
    from msd_dask.core import _kernels

    _kernels.compile_kernels()
    rng = np.random.default_rng(7)
    cases = [(table, perm) for n, perm in _partial_permutations(rng) for n_cols in (8, 3)
             for table in [rng.integers(-(1 << 30), 1 << 30, (n, n_cols)).astype(dtype)]]

    def results() -> list[np.ndarray]:
        out = []
        for table, perm in cases:
            t = table.copy()
            _kernels.permute_rows(t, perm.astype(np.int64))
            out.append(t[:len(perm)])
        return out

    compiled = results()
    # the same kernels as plain Python (callees included)
    for name in ("_permute_rows", "_copy_row"):
        monkeypatch.setattr(_kernels, name, getattr(_kernels, name).py_func)
    interpreted = results()
    for (table, perm), a, b in zip(cases, compiled, interpreted, strict=True):
        assert np.array_equal(a, table[perm]) and np.array_equal(b, table[perm])


def test_row_order_is_the_stable_sort_of_the_placed_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """``row_order``: the placed pieces' stable argsort by row and the rows' counts, as numpy
    finds them, interpreted and compiled (unplaced pieces, empty rows and ties)."""
    from msd_dask.core import _kernels

    _kernels.compile_kernels()
    rng = np.random.default_rng(11)
    cases = [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), 3, 2),
             (np.full(4, -1, dtype=np.int64), np.full(4, -1, dtype=np.int64), 2, 2)]
    for _ in range(30):
        n, n_ranks, mb = int(rng.integers(1, 3000)), int(rng.integers(1, 40)), int(rng.integers(1, 9))
        rank = rng.integers(-1, n_ranks, n)
        micro = np.where(rank >= 0, rng.integers(0, mb, n), -1)
        cases.append((rank, micro, n_ranks, mb))

    def results() -> list[tuple[np.ndarray, np.ndarray]]:
        return [_kernels.row_order(rank, micro, n_ranks, mb) for rank, micro, n_ranks, mb in cases]

    compiled = results()
    monkeypatch.setattr(_kernels, "_row_order", _kernels._row_order.py_func)
    interpreted = results()
    for (rank, micro, n_ranks, mb), a, b in zip(cases, compiled, interpreted, strict=True):
        placed = np.flatnonzero(rank >= 0)
        row = rank[placed] * mb + micro[placed]
        want = placed[np.argsort(row, kind="stable")]
        sizes = np.bincount(row, minlength=n_ranks * mb).reshape(n_ranks, mb)
        for perm, got in (a, b):
            assert np.array_equal(perm, want) and np.array_equal(got, sizes)


def test_in_piece_order_reads_the_stable_descending_sort_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """``in_piece_order`` undoes the stable sort by decreasing length (``vals[order] ->
    vals``), interpreted and compiled, with many ties and lengths left out."""
    from msd_dask.core import _kernels

    _kernels.compile_kernels()
    rng = np.random.default_rng(5)
    cases = [np.zeros(0, dtype=np.int64), np.array([3, 3, 0, 7, 3], dtype=np.int64)]
    cases += [rng.integers(0, int(rng.integers(1, 500)), int(rng.integers(1, 3000))) for _ in range(30)]

    def results() -> list[np.ndarray]:
        out = []
        for lengths in cases:
            order = np.argsort(-lengths, kind="stable")
            vals = rng.integers(-5, 1 << 40, len(lengths))
            count = np.bincount(lengths)
            start = np.cumsum(count[::-1])[::-1] - count
            got = np.full(len(lengths), -9, dtype=np.int64)
            _kernels.in_piece_order(vals, lengths, start, got)
            want = np.empty_like(vals)
            want[order] = vals
            out.append(np.array_equal(got, want))
        return out

    assert all(results())
    monkeypatch.setattr(_kernels, "_in_piece_order", _kernels._in_piece_order.py_func)
    assert all(results())


_LOAD_ONLY = """
from msd_dask.core import _kernels

_kernels.compile_kernels()
compiled = [getattr(_kernels, f.__name__) for f in _kernels._KERNELS]
misses = {d.__name__: sum(d.stats.cache_misses.values()) for d in compiled}
hits = sum(sum(d.stats.cache_hits.values()) for d in compiled)
print(sum(misses.values()), hits, [n for n, m in misses.items() if m])
"""


#: the process of :func:`test_kernels_are_compiled_in_a_child_and_loaded_from_its_cache` and
#: its empty cache, started when the session's tests are collected (:func:`start_early`)
_EARLY: dict[str, Any] = {}


def start_early() -> None:
    """Start the compiling process of the test below now: it compiles every kernel (25 s
    of one core), which the tests run before it overlap on this machine's other core
    (tests/unit/conftest.py calls this once the test is collected)."""
    cache = tempfile.mkdtemp(prefix="msd-numba-cache-")
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    _EARLY.update(cache=cache, proc=subprocess.Popen(
        [sys.executable, "-c", _LOAD_ONLY], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env))


@pytest.mark.slow
def test_kernels_are_compiled_in_a_child_and_loaded_from_its_cache() -> None:
    """With an empty cache, the process that asks for the kernels compiles none of them
    itself (numba's compiler would keep about 200 MiB in it): a child compiles them into
    the cache, and this process loads every one from there."""
    if "proc" not in _EARLY:  # (not started at collection: run alone, say)
        start_early()
    cache = pathlib.Path(_EARLY["cache"])
    try:
        out, err = _EARLY["proc"].communicate(timeout=600)
        assert _EARLY["proc"].returncode == 0, err[-3000:]
        misses, hits, which = out.split(maxsplit=2)
        assert (int(misses), which.strip()) == (0, "[]"), out
        assert int(hits) > 0 and any(cache.rglob("*.nbi")), out
    finally:
        _EARLY.clear()
        shutil.rmtree(cache, ignore_errors=True)


def test_a_step_of_blocks_compiles_nothing_the_warm_up_did_not() -> None:
    """The warm-up (``_warm``) compiles every kernel for the types the planner passes, so a
    step never stops to compile one (seconds, and numba's compiler state kept in the
    process): planning steps whose rows and ranks are placed in blocks (int32 rows, ranks
    and lengths) adds no signature to any kernel."""
    from msd_dask.core import _kernels
    from msd_dask.core.config import parse_config
    from msd_dask.core.plan import Planner
    from msd_dask.core.row_placement import BLOCK_RANKS, BLOCK_ROWS
    from msd_dask.core.units import Unit

    _kernels.compile_kernels()
    dp = 2 * BLOCK_RANKS
    mb = max(1, 2 * BLOCK_ROWS // dp)
    cfg = parse_config({
        "name": "k", "seed": 1, "batch": {"seq_len": 64, "micro_batches": mb},
        "parallel": {"dp": dp},
        "sources": [{"name": n, "uri": f"memory://{n}/*.parquet", "format": "parquet",
                     "weight": 0.5} for n in ("web", "books")]})
    pl = Planner(cfg, {s.name: [Unit(f"{s.name}/u{i}.parquet") for i in range(64)]
                       for s in cfg.sources})
    rng = np.random.default_rng(0)
    lengths = {u: rng.integers(1, 200, size=4096) for u in range(64)}

    def signatures() -> dict[str, list]:
        return {f.__name__: list(getattr(_kernels, f.__name__).signatures)
                for f in _kernels._KERNELS}

    before = signatures()
    for _ in range(2):
        plan = pl.plan_step(lambda source, epoch, unit: lengths[unit])
        assert len(plan.table) > dp * mb  # (a step of blocks of ranks and of rows)
    assert signatures() == before


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_chunk_rows_is_the_numpy_chunking(dtype: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window's piece table from the kernel (compiled, and as plain Python) is numpy's,
    documents shorter, as long as and longer than a row, one token, none."""
    from msd_dask.core import _kernels, stream

    _kernels.compile_kernels()
    rng = np.random.default_rng(3)
    cases = []
    for n, seq_len, top in [(0, 8, 5), (1, 8, 5), (500, 8, 40), (500, 16, 16), (300, 7, 7),
                            (2000, 4096, 20000), (64, 5, 1)]:
        length = rng.integers(1, top + 1, n).astype(np.int64)
        unit = rng.integers(0, 50, n).astype(np.int64)
        row = rng.integers(0, 10**6, n).astype(np.int64)
        cases.append((length, unit, row, seq_len))

    def tables() -> list[np.ndarray]:
        return [stream._chunked(3, u, r, ln, s, int(ln.max(initial=0)), dtype)
                for ln, u, r, s in cases]

    compiled = tables()
    as_python = []
    for (length, unit, row, seq_len), t in zip(cases, compiled, strict=True):
        out = np.full_like(t, -1)
        _kernels._chunk_rows.py_func(3, unit, row, length, seq_len, out)
        as_python.append(out)
    monkeypatch.setattr(_kernels, "_compiled", False)  # (numpy's passes)
    by_numpy = tables()
    for a, b, c in zip(compiled, as_python, by_numpy, strict=True):
        assert a.dtype == c.dtype == dtype
        assert np.array_equal(a, c) and np.array_equal(b, c)
    assert sum(len(t) for t in by_numpy) > sum(len(ln) for ln, *_ in cases)  # (chunks made)
