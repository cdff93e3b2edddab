"""SourceStream: a deterministic, exactly-once-per-epoch order of one source's pieces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from msd_dask.core.stream import NeedMetadata, Piece, SourceStream
from msd_dask.errors import DataError
from msd_dask.formats import Unit

NAME = "web"
SEQ_LEN = 16

# Three files; "a" has two units (row groups) starting at rows 0 and 5.
UNITS = [Unit("a.parquet", 0, 0), Unit("a.parquet", 1, 5), Unit("b.parquet", 0, 0),
         Unit("c.parquet", 0, 0), Unit("d.parquet", 0, 0), Unit("e.parquet", 0, 0),
         Unit("f.parquet", 0, 0)]


def make_lengths(seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for u in range(len(UNITS)):
        n = 5 if u == 0 else int(rng.integers(3, 9))
        out[u] = rng.integers(1, 60, size=n)
    return out


LENGTHS = make_lengths()


def fake_lookup(lengths: dict[int, np.ndarray], name: str = NAME):
    def lookup(source: str, epoch: int, unit: int) -> np.ndarray:
        assert source == name
        return lengths[unit]
    return lookup


def stream(seed: int = 0, name: str = NAME, window: int = 3, seq_len: int = SEQ_LEN,
           units: list[Unit] | None = None) -> SourceStream:
    return SourceStream(name, units or UNITS, seed, window, seq_len)


def take(s: SourceStream, lookup, n: int) -> list[Piece]:
    out = []
    for _ in range(n):
        out.append(s.peek(lookup))
        s.advance()
    return out


def epoch_pieces(s: SourceStream, lookup, epoch: int) -> list[Piece]:
    """All pieces of ``epoch``, consuming the stream up to the first piece of the next one."""
    out = []
    while True:
        p = s.peek(lookup)
        if p.epoch != epoch:
            assert p.epoch == epoch + 1
            return out
        out.append(p)
        s.advance()


def expected_docs(lengths: dict[int, np.ndarray], units: list[Unit] = UNITS) -> dict:
    return {(u, units[u].row_offset + i): int(n)
            for u, ls in lengths.items() for i, n in enumerate(ls) if n > 0}


def doc_order(pieces: list[Piece]) -> list[tuple[int, int]]:
    return [(p.unit, p.row) for p in pieces if p.chunk == 0]


# --------------------------------------------------------------------- exactly once


@pytest.mark.parametrize("window", [1, 3, 7, 10])
def test_every_document_once_per_epoch(window: int) -> None:
    s = stream(window=window)
    lookup = fake_lookup(LENGTHS)
    docs = expected_docs(LENGTHS)
    for epoch in range(3):
        pieces = epoch_pieces(s, lookup, epoch)
        assert all(p.source == NAME and p.epoch == epoch for p in pieces)
        counts = Counter((p.unit, p.row, p.chunk) for p in pieces)
        assert max(counts.values()) == 1
        assert set(doc_order(pieces)) == set(docs)
        assert len(doc_order(pieces)) == len(docs)
        # Each document's pieces cover [0, L) contiguously, none longer than seq_len.
        by_doc: dict[tuple[int, int], list[Piece]] = {}
        for p in pieces:
            by_doc.setdefault((p.unit, p.row), []).append(p)
        for key, ps in by_doc.items():
            L = docs[key]
            ps.sort(key=lambda p: p.chunk)
            assert [p.chunk for p in ps] == list(range(-(-L // SEQ_LEN)))
            assert ps[0].start == 0 and ps[-1].end == L
            for a, b in zip(ps, ps[1:], strict=False):
                assert a.end == b.start
            assert all(0 < p.length <= SEQ_LEN and p.doc_len == L for p in ps)


def test_rows_use_the_unit_row_offset() -> None:
    s = stream()
    pieces = epoch_pieces(s, fake_lookup(LENGTHS), 0)
    rows_of_unit1 = sorted({p.row for p in pieces if p.unit == 1})
    assert rows_of_unit1 == list(range(5, 5 + len(LENGTHS[1])))
    rows_of_unit0 = sorted({p.row for p in pieces if p.unit == 0})
    assert rows_of_unit0 == list(range(5))


def test_long_document_chunks() -> None:
    units = [Unit("x.jsonl")]
    lengths = {0: np.array([50, 16, 17, 1])}
    s = SourceStream("x", units, 3, 1, 16)
    pieces = epoch_pieces(s, fake_lookup(lengths, "x"), 0)
    spans = sorted((p.row, p.chunk, p.start, p.end, p.doc_len) for p in pieces)
    assert spans == [
        (0, 0, 0, 16, 50), (0, 1, 16, 32, 50), (0, 2, 32, 48, 50), (0, 3, 48, 50, 50),
        (1, 0, 0, 16, 16),
        (2, 0, 0, 16, 17), (2, 1, 16, 17, 17),
        (3, 0, 0, 1, 1),
    ]
    # A document's chunks come out consecutively, in order.
    for i, p in enumerate(pieces):
        if p.chunk > 0:
            prev = pieces[i - 1]
            assert (prev.row, prev.chunk, prev.end) == (p.row, p.chunk - 1, p.start)


def test_rows_with_non_positive_length_are_skipped() -> None:
    lengths = {u: ls.copy() for u, ls in LENGTHS.items()}
    lengths[0][1] = 0
    lengths[0][3] = -1
    lengths[2][0] = -5
    s = stream()
    pieces = epoch_pieces(s, fake_lookup(lengths), 0)
    delivered = set(doc_order(pieces))
    assert (0, 1) not in delivered and (0, 3) not in delivered and (2, 0) not in delivered
    assert delivered == set(expected_docs(lengths))


@pytest.mark.parametrize("seq_len", [16, 59, 1000])  # chunked documents; every document whole
def test_window_table_is_the_documents_in_shuffled_order_chunked(seq_len: int) -> None:
    # the rule, document by document: a window's units in order, their rows in file order
    # (non-positive lengths skipped), permuted by the window's generator, each in chunks
    from msd_dask.core.stream import _rng

    lengths = {u: ls.copy() for u, ls in LENGTHS.items()}
    lengths[1][2] = 0
    lengths[3][:] = -1  # a unit without documents
    for window in (1, 3):
        s = stream(window=window, seq_len=seq_len)
        for epoch in range(2):
            for w in range(s.n_windows):
                s.epoch, s.window = epoch, w
                docs = [(u, UNITS[u].row_offset + i, int(n)) for u in s.window_units(epoch, w)
                        for i, n in enumerate(lengths[u]) if n > 0]
                perm = _rng(s.seed, s._salt, epoch, w + 1).permutation(len(docs))
                want = [(epoch, u, r, c, c * seq_len, min((c + 1) * seq_len, n), n)
                        for u, r, n in (docs[i] for i in perm) for c in range(-(-n // seq_len))]
                table = s._window(fake_lookup(lengths)).table
                assert table.dtype == np.int32 and table.shape == (len(want), 7)
                assert table.tolist() == [list(t) for t in want]


def test_source_without_documents_is_a_data_error() -> None:
    s = stream()
    empty = {u: np.zeros(3, dtype=np.int64) for u in range(len(UNITS))}
    with pytest.raises(DataError):
        s.peek(fake_lookup(empty))
    with pytest.raises(DataError):
        SourceStream("none", [], 0, 1, 8)


def test_empty_windows_across_an_epochs_end_are_not_an_empty_source() -> None:
    # one unit of five has documents: the empty windows at the end of one epoch and the
    # start of the next (the units shuffled each epoch) were counted together and the
    # source refused as without documents (a review)
    units = [Unit(f"f{i}") for i in range(5)]
    lookup = fake_lookup({u: np.array([10, 12]) if u == 0 else np.zeros(0, np.int64)
                          for u in range(5)})
    for seed in range(20):
        s = SourceStream("web", units, seed, 1, 64)
        got = []
        for _ in range(6):
            got.append(s.peek(lookup))
            s.advance()
        assert sorted((p.epoch, p.unit, p.row) for p in got) == [
            (e, 0, r) for e in range(3) for r in range(2)], seed


# ----------------------------------------------------------------------- determinism


def test_same_seed_same_order() -> None:
    a = take(stream(seed=5), fake_lookup(LENGTHS), 150)
    b = take(stream(seed=5), fake_lookup(LENGTHS), 150)
    assert a == b


def test_different_seed_or_epoch_or_name_changes_order() -> None:
    lookup = fake_lookup(LENGTHS)
    s0 = stream(seed=0)
    e0 = doc_order(epoch_pieces(s0, lookup, 0))
    e1 = doc_order(epoch_pieces(s0, lookup, 1))
    assert sorted(e0) == sorted(e1) and e0 != e1
    other_seed = doc_order(epoch_pieces(stream(seed=1), lookup, 0))
    assert sorted(other_seed) == sorted(e0) and other_seed != e0
    other_name = doc_order(epoch_pieces(stream(name="code"), fake_lookup(LENGTHS, "code"), 0))
    assert sorted(other_name) == sorted(e0) and other_name != e0


def test_order_depends_only_on_seed_name_epoch_lengths() -> None:
    lookup = fake_lookup(LENGTHS)
    ref = stream(seed=9)
    epoch_pieces(ref, lookup, 0)
    epoch1 = epoch_pieces(ref, lookup, 1)
    # Jumping straight to epoch 1 (no history, no caches) gives the same epoch.
    fresh = stream(seed=9)
    fresh.load_state_dict({"epoch": 1, "window": 0, "offset": 0})
    assert epoch_pieces(fresh, lookup, 1) == epoch1
    # Lengths given as lists or as other integer dtypes: same order.
    as_int32 = {u: ls.astype(np.int32) for u, ls in LENGTHS.items()}
    s = stream(seed=9)
    s.load_state_dict({"epoch": 1, "window": 0, "offset": 0})
    assert epoch_pieces(s, fake_lookup(as_int32), 1) == epoch1
    # Lookups that first fail for every unit (metadata arriving late, in any order).
    known: set[int] = set()

    def late(source: str, epoch: int, unit: int) -> np.ndarray:
        if unit not in known:
            raise NeedMetadata(source, [(epoch, unit)])
        return LENGTHS[unit]

    s = stream(seed=9)
    s.load_state_dict({"epoch": 1, "window": 0, "offset": 0})
    got = []
    while len(got) < len(epoch1):
        try:
            got.append(s.peek(late))
            s.advance()
        except NeedMetadata as nm:
            known.update(u for _, u in nm.units)
    assert got == epoch1


def test_order_is_the_same_in_another_process() -> None:
    lookup = fake_lookup(LENGTHS)
    here = [p.to_tuple() for p in take(stream(seed=4), lookup, 60)]
    code = """
import json, sys
import numpy as np
from msd_dask.formats import Unit
from msd_dask.core.stream import SourceStream
args = json.loads(sys.argv[1])
units = [Unit(*u) for u in args["units"]]
lengths = {int(k): np.array(v) for k, v in args["lengths"].items()}
s = SourceStream(args["name"], units, 4, 3, args["seq_len"])
out = []
for _ in range(60):
    out.append(list(s.peek(lambda n, e, u: lengths[u]).to_tuple()))
    s.advance()
print(json.dumps(out))
"""
    args = {"units": [[u.path, u.part, u.row_offset] for u in UNITS], "name": NAME,
            "seq_len": SEQ_LEN, "lengths": {u: ls.tolist() for u, ls in LENGTHS.items()}}
    env = dict(os.environ, PYTHONHASHSEED="12345")
    res = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    there = [tuple(t) for t in json.loads(res.stdout)]
    assert there == here


# ----------------------------------------------------------------------- metadata


def test_need_metadata_lists_every_missing_unit_of_the_window() -> None:
    s = stream(window=len(UNITS))
    missing = {1, 4}

    def lookup(source: str, epoch: int, unit: int) -> np.ndarray:
        if unit in missing:
            raise NeedMetadata(source, [(epoch, unit)])
        return LENGTHS[unit]

    before = s.state_dict()
    with pytest.raises(NeedMetadata) as info:
        s.peek(lookup)
    assert info.value.source == NAME
    assert sorted(info.value.units) == [(0, 1), (0, 4)]
    assert isinstance(info.value, LookupError)
    assert s.state_dict() == before
    # Once the metadata is there, the stream goes on as if nothing happened.
    missing.clear()
    assert take(s, lookup, 40) == take(stream(window=len(UNITS)), fake_lookup(LENGTHS), 40)


def test_need_metadata_raised_by_a_later_window() -> None:
    s = stream(window=2)
    first_window = set(s.window_units(0, 0))

    def lookup(source: str, epoch: int, unit: int) -> np.ndarray:
        if unit not in first_window:
            raise NeedMetadata(source, [(epoch, unit)])
        return LENGTHS[unit]

    n_first = sum(-(-int(n) // SEQ_LEN) for u in first_window for n in LENGTHS[u] if n > 0)
    got = take(s, lookup, n_first)
    assert {p.unit for p in got} == first_window
    with pytest.raises(NeedMetadata) as info:
        s.peek(lookup)
    assert sorted(info.value.units) == sorted((0, u) for u in s.window_units(0, 1))


def test_upcoming_units() -> None:
    s = stream(window=3)
    up = s.upcoming_units(4)
    order = [int(u) for u in s.unit_order(0)]
    assert up == [(0, u) for u in order[:7]]
    # Never looks past the next epoch.
    far = s.upcoming_units(1000)
    assert {e for e, _ in far} == {0, 1}


# -------------------------------------------------------------------------- resume


@pytest.mark.parametrize("k", [0, 1, 7, 33, 80])
def test_state_dict_resumes_identical_sequence(k: int) -> None:
    lookup = fake_lookup(LENGTHS)
    ref = stream(seed=2)
    full = take(ref, lookup, k + 100)
    s = stream(seed=2)
    take(s, lookup, k)
    state = json.loads(json.dumps(s.state_dict()))
    resumed = stream(seed=2)
    resumed.load_state_dict(state)
    assert take(resumed, lookup, 100) == full[k:]
    # Loading a state into a stream that is elsewhere (warm caches) works too.
    busy = stream(seed=2)
    take(busy, lookup, 150)
    busy.load_state_dict(state)
    assert take(busy, lookup, 100) == full[k:]


def test_piece_tuple_round_trip() -> None:
    p = Piece("web", 2, 3, 17, 1, 16, 32, 40)
    assert Piece.from_tuple(json.loads(json.dumps(p.to_tuple()))) == p
    assert p.length == 16


def test_window_of_matches_the_unit_order():
    from msd_dask.core.stream import SourceStream as _Stream
    from msd_dask.formats import Unit as _Unit

    s = _Stream("w", [_Unit(f"u{i}") for i in range(23)], 5, 4, 100)
    for e in range(3):
        order = [int(u) for u in s.unit_order(e)]
        assert [s.window_of(e, u) for u in range(23)] == [order.index(u) // 4 for u in range(23)]


def test_kept_lengths_are_an_int32_copy_where_every_length_fits() -> None:
    """A planner keeps the lengths of thousands of units (dp 16,384 × 128K): int32 halves
    them; a value int32 cannot hold keeps them int64, and the copy is the planner's own."""
    from msd_dask.core.stream import kept_lengths

    given = np.array([5, -1, 2**31 - 1, 0], dtype=np.int64)
    kept = kept_lengths(given)
    assert kept.dtype == np.int32 and kept.tolist() == given.tolist()
    given[0] = 7
    assert kept[0] == 5  # (a loader on the planner's worker hands its own array)
    wide = kept_lengths([2**31, 3])
    assert wide.dtype == np.int64 and wide.tolist() == [2**31, 3]
    assert kept_lengths([-2**31 - 1]).dtype == np.int64
    assert kept_lengths(np.zeros(0, dtype=np.int64)).dtype == np.int32
    # a stream reads the same pieces from either
    a, b = SourceStream(NAME, UNITS, 3, 2, SEQ_LEN), SourceStream(NAME, UNITS, 3, 2, SEQ_LEN)
    lengths = make_lengths()
    narrow = {u: kept_lengths(v) for u, v in lengths.items()}
    np.testing.assert_array_equal(a.current(lambda s, e, u: lengths[u]).table,
                                  b.current(lambda s, e, u: narrow[u]).table)


@pytest.mark.parametrize("change, message", [
    ({"window": 3}, r"window 3 is not one of its 3 windows \(0-2\)"),
    ({"window": -1}, r"window -1 is not one of its 3 windows"),
    ({"epoch": -1}, r"epoch must be >= 0, got -1"),
    ({"offset": -2}, r"offset must be >= 0, got -2"),
])
def test_a_position_the_stream_cannot_be_at_is_refused_naming_it(change, message) -> None:
    """A state of another corpus or config: a window past the source's windows was taken
    as the next epoch's first, a negative one as a window counted from the end (documents
    skipped, or served twice, with nothing said); a negative offset failed planning with
    an IndexError."""
    s = stream()
    take(s, fake_lookup(LENGTHS), 4)
    state = dict(s.state_dict(), **change)
    with pytest.raises(ValueError, match=rf"source 'web': {message}"):
        stream().load_state_dict(state)


def test_an_offset_past_its_windows_pieces_is_refused_once_they_are_known() -> None:
    lookup = fake_lookup(LENGTHS)
    s = stream()
    whole = len(s.current(lookup).table)
    s.load_state_dict({"epoch": 0, "window": 0, "offset": whole})  # (its window read whole)
    assert s.peek(lookup).epoch == 0  # the next window's first piece
    s.load_state_dict({"epoch": 0, "window": 0, "offset": whole + 1})
    with pytest.raises(ValueError, match=rf"offset {whole + 1} is past the {whole} pieces "
                                         "of window 0 of epoch 0"):
        s.peek(lookup)
