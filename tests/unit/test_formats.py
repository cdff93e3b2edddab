"""Conformance suite for every registered source format, plus per-format cases.

Every format in :data:`msd_dask.formats.FORMATS` must have at least one writer in
``WRITERS`` below; the shared tests then run against each writer's output, on the local
filesystem and on fsspec's in-memory one.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import tarfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from msd_dask.errors import DataError
from msd_dask.formats import FORMATS, Format, Unit, get_format
from msd_dask.formats.jsonl import compression_of
from msd_dask.sources.storage import open_source

# ---------------------------------------------------------------------------------------
# The shared records and one writer per format variant
# ---------------------------------------------------------------------------------------

LONG_TEXT = "".join(f"paragraph {i}: the quick brown fox jumps over the lazy dog.\n"
                    for i in range(5000))
TEXTS = [
    "hello world",
    "naïve café — 日本語のテキスト — emoji 🎉🚀 — Ελληνικά",
    "",
    LONG_TEXT,
    "line one\nline two\r\nline three\ttabbed",
    'quotes " and backslashes \\ and {"json": "inside"}',
    "separators \u2028 and \u2029 and nul \x00 inside",
    "   leading and trailing blanks   ",
    "short",
    "the last record",
]
RECORDS = [{"text": t, "id": i, "meta": f"meta-{i}"} for i, t in enumerate(TEXTS)]
ROW_GROUP_SIZE = 3  # parquet: 10 records -> row groups of 3, 3, 3, 1

Writer = Callable[[fsspec.AbstractFileSystem, str, list[dict[str, Any]]], str]


def write_parquet(fs: fsspec.AbstractFileSystem, stem: str, records: list[dict[str, Any]]) -> str:
    path = stem + ".parquet"
    table = pa.Table.from_pylist(records)
    with fs.open(path, "wb") as f:
        pq.write_table(table, f, row_group_size=ROW_GROUP_SIZE)
    return path


def _jsonl_bytes(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)


def write_jsonl(fs: fsspec.AbstractFileSystem, stem: str, records: list[dict[str, Any]]) -> str:
    path = stem + ".jsonl"
    fs.pipe_file(path, _jsonl_bytes(records))
    return path


def write_jsonl_gz(fs: fsspec.AbstractFileSystem, stem: str,
                   records: list[dict[str, Any]]) -> str:
    path = stem + ".jsonl.gz"
    fs.pipe_file(path, gzip.compress(_jsonl_bytes(records), mtime=0))
    return path


def write_jsonl_zst(fs: fsspec.AbstractFileSystem, stem: str,
                    records: list[dict[str, Any]]) -> str:
    path = stem + ".jsonl.zst"
    fs.pipe_file(path, zstandard.ZstdCompressor().compress(_jsonl_bytes(records)))
    return path


def write_jsonl_bz2(fs: fsspec.AbstractFileSystem, stem: str,
                    records: list[dict[str, Any]]) -> str:
    path = stem + ".jsonl.bz2"
    fs.pipe_file(path, bz2.compress(_jsonl_bytes(records)))
    return path


def write_jsonl_xz(fs: fsspec.AbstractFileSystem, stem: str,
                   records: list[dict[str, Any]]) -> str:
    path = stem + ".jsonl.xz"
    fs.pipe_file(path, lzma.compress(_jsonl_bytes(records)))
    return path


def write_webdataset(fs: fsspec.AbstractFileSystem, stem: str,
                     records: list[dict[str, Any]]) -> str:
    """A tar shard: ``<i>.txt`` holds the text, ``<i>.json`` the other fields."""
    path = stem + ".tar"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i, rec in enumerate(records):
            rest = {k: v for k, v in rec.items() if k != "text"}
            for ext, data in (("txt", rec["text"].encode()), ("json", json.dumps(rest).encode())):
                info = tarfile.TarInfo(f"samples/{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    fs.pipe_file(path, buf.getvalue())
    return path


WRITERS: dict[str, dict[str, Writer]] = {
    "parquet": {"parquet": write_parquet},
    "webdataset": {"webdataset": write_webdataset},
    "jsonl": {"jsonl": write_jsonl, "jsonl.gz": write_jsonl_gz, "jsonl.zst": write_jsonl_zst,
              "jsonl.bz2": write_jsonl_bz2, "jsonl.xz": write_jsonl_xz},
}

CASES = [pytest.param((name, variant), id=variant)
         for name in sorted(FORMATS)
         for variant in (sorted(WRITERS[name]) if name in WRITERS else ["<no writer>"])]


# ---------------------------------------------------------------------------------------
# Fixtures and helpers
# ---------------------------------------------------------------------------------------

@pytest.fixture
def memory_fs() -> Iterator[tuple[fsspec.AbstractFileSystem, str]]:
    fs = fsspec.filesystem("memory")
    root = f"/test-formats-{uuid.uuid4().hex}"
    fs.mkdir(root)
    try:
        yield fs, root
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def where(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    if request.param == "local":
        return fsspec.filesystem("file"), tmp_path.as_posix()
    return request.getfixturevalue("memory_fs")


@pytest.fixture(params=CASES)
def written(request: pytest.FixtureRequest, where: tuple[fsspec.AbstractFileSystem, str]
            ) -> tuple[Format, fsspec.AbstractFileSystem, str]:
    name, variant = request.param
    if name not in WRITERS:
        pytest.fail(f"format {name!r} is registered but tests/unit/test_formats.py has no writer "
                    "for it: add one to WRITERS")
    fs, root = where
    path = WRITERS[name][variant](fs, f"{root}/sample", RECORDS)
    return get_format(name), fs, path


def read_all(fmt: Format, fs: fsspec.AbstractFileSystem, path: str,
             fields: Sequence[str]) -> list[tuple[int, dict[str, Any]]]:
    return [item for unit in fmt.units(fs, path) for item in fmt.read(fs, unit, fields)]


def corrupt_garbage(data: bytes) -> bytes:
    return b"this is not a valid data file \x00\xff\xfe" * 50


def corrupt_truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def corrupt_flip(data: bytes) -> bytes:
    middle = bytearray(data)
    lo, hi = len(data) // 3, len(data) // 3 + 64
    middle[lo:hi] = bytes(b ^ 0xA5 for b in middle[lo:hi])
    return bytes(middle)


class _Handle:
    """A file object that remembers whether it was closed, delegating all else."""

    def __init__(self, f: Any):
        self._f = f
        self.was_closed = False

    def close(self) -> None:
        self.was_closed = True
        self._f.close()

    def __enter__(self) -> _Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class TrackingFS:
    """Delegates to a filesystem and remembers every file it opened.

    Wraps the files rather than reading their ``closed``: fsspec's in-memory files never
    report themselves closed (and ``open`` hands out the same object each time).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem):
        self._fs = fs
        self.opened: list[_Handle] = []

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> _Handle:
        handle = _Handle(self._fs.open(path, mode, **kwargs))
        self.opened.append(handle)
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def all_closed(self) -> bool:
        return all(h.was_closed for h in self.opened)


# ---------------------------------------------------------------------------------------
# Conformance suite: every registered format
# ---------------------------------------------------------------------------------------

def test_every_format_has_a_writer() -> None:
    assert set(FORMATS) >= {"parquet", "jsonl"}
    assert set(FORMATS) <= set(WRITERS), "add a writer for each registered format"


def test_format_names_match_registry() -> None:
    for name, fmt in FORMATS.items():
        assert fmt.name == name
        assert get_format(name) is fmt
    with pytest.raises(ValueError, match="unknown format"):
        get_format("no-such-format")


# ---------------------------------------------------------------------------------------
# A format of your own, named by import path (msd_dask.examples.text_lines)
# ---------------------------------------------------------------------------------------

TEXT_LINES = "msd_dask.examples.text_lines:TextLinesFormat"


def test_the_example_format_reads_each_line_without_its_break_alone(tmp_path: Any) -> None:
    # rstrip("\\r\\n") took a CR of the line's own with its break (a review)
    path = tmp_path / "x.txt"
    path.write_bytes(b"ends in CR\r\r\nwindows\r\nunix\n\nlast, no break\r")
    got = list(get_format(TEXT_LINES).read(LOCAL, Unit(str(path)), ["text"]))
    assert got == [(0, {"text": "ends in CR\r"}), (1, {"text": "windows"}), (2, {"text": "unix"}),
                   (4, {"text": "last, no break\r"})]


def test_a_format_named_by_import_path_is_imported_once_and_not_registered() -> None:
    from msd_dask.examples import text_lines

    fmt = get_format(TEXT_LINES)
    assert isinstance(fmt, text_lines.TextLinesFormat)  # (a class is made with no arguments)
    assert get_format(TEXT_LINES) is fmt
    assert TEXT_LINES not in FORMATS and fmt.name not in FORMATS
    # an instance is taken as it is
    text_lines.INSTANCE = text_lines.TextLinesFormat()  # type: ignore[attr-defined]
    try:
        spec = "msd_dask.examples.text_lines:INSTANCE"
        assert get_format(spec) is text_lines.INSTANCE  # type: ignore[attr-defined]
    finally:
        del text_lines.INSTANCE  # type: ignore[attr-defined]


@pytest.mark.parametrize("spec, says", [
    ("no_such_module_here:Format", "No module named 'no_such_module_here'"),
    ("msd_dask.core.units:Unit", "TypeError"),  # (a class that needs arguments)
    ("raises_when_imported_xyz:Format", "RuntimeError: broken on purpose"),
    ("msd_dask.examples.text_lines:Nope", "has no attribute 'Nope'"),
    # (named by its own name: it was called 'function'; a review)
    ("msd_dask.examples.preprocess:drop_short", "'drop_short', which has no units() or read()"),
    ("csv", "unknown format 'csv'"),
])
def test_a_format_that_cannot_be_had_says_why(spec: str, says: str, tmp_path: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "raises_when_imported_xyz.py").write_text(
        "raise RuntimeError('broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as info:
        get_format(spec)
    assert says in str(info.value) and spec in str(info.value)


@pytest.mark.parametrize("suffix, compress", [
    (".txt", lambda b: b), (".txt.gz", gzip.compress), (".txt.bz2", bz2.compress),
    (".txt.xz", lzma.compress), (".txt.zst", zstandard.ZstdCompressor().compress),
    (".txt.zstd", zstandard.ZstdCompressor().compress),
    # two frames, as parallel compressors write them: both read
    (".txt.zst", lambda b: b"".join(zstandard.ZstdCompressor().compress(h)
                                    for h in (b[:len(b) // 2], b[len(b) // 2:]))),
], ids=["plain", "gz", "bz2", "xz", "zst", "zstd", "zst-frames"])
def test_text_lines_reads_each_line_as_a_document(where: tuple[Any, str], suffix: str,
                                                  compress: Callable[[bytes], bytes]) -> None:
    fs, root = where
    fmt = get_format(TEXT_LINES)
    body = "\ufefffirst\n\n  \nnaïve café\r\n\u00a0\u3000\n\r\nlast without a break"
    path = f"{root}/a{suffix}"
    fs.pipe_file(path, compress(body.encode()))
    want = [(0, {"text": "first"}), (3, {"text": "naïve café"}),
            (6, {"text": "last without a break"})]  # (rows 4 and 5: Unicode blanks, a lone CR)
    assert read_all(fmt, fs, path, ["text"]) == want
    assert [rec for _, rec in read_all(fmt, fs, path, [])] == [{}] * 3
    tracking = TrackingFS(fs)  # an abandoned read leaves nothing open
    it = fmt.read(tracking, fmt.units(tracking, path)[0], ["text"])
    next(it)
    it.close()
    assert tracking.opened and tracking.all_closed()


def test_text_lines_bad_input_names_file_and_row(where: tuple[Any, str]) -> None:
    fs, root = where
    fmt = get_format(TEXT_LINES)
    fs.pipe_file(f"{root}/bad.txt", b"fine\nnot \xff utf-8\n")
    with pytest.raises(DataError) as info:
        read_all(fmt, fs, f"{root}/bad.txt", ["text"])
    assert info.value.path == f"{root}/bad.txt" and info.value.row == 1
    assert "invalid UTF-8" in str(info.value)
    with pytest.raises(DataError, match="missing field 'id'") as info:
        read_all(fmt, fs, f"{root}/bad.txt", ["text", "id"])
    assert info.value.row == 0
    fs.pipe_file(f"{root}/cut.txt.gz", gzip.compress(b"a line\n" * 5000)[:-12])
    with pytest.raises(DataError) as info:
        read_all(fmt, fs, f"{root}/cut.txt.gz", ["text"])
    assert info.value.path == f"{root}/cut.txt.gz" and info.value.row is None
    tracking = TrackingFS(fs)
    with pytest.raises(DataError):
        read_all(fmt, tracking, f"{root}/bad.txt", ["text"])
    assert tracking.opened and tracking.all_closed()


def test_units_cover_every_row_once_in_file_order(written: Any) -> None:
    fmt, fs, path = written
    units = fmt.units(fs, path)
    assert units, "a non-empty file has at least one unit"
    assert all(isinstance(u, Unit) and u.path == path for u in units)
    assert [u.part for u in units] == list(range(len(units)))
    offsets = [u.row_offset for u in units]
    assert offsets == sorted(offsets) and offsets[0] == 0
    rows: list[int] = []
    for i, unit in enumerate(units):
        unit_rows = [row for row, _ in fmt.read(fs, unit, ["text"])]
        end = units[i + 1].row_offset if i + 1 < len(units) else float("inf")
        assert all(unit.row_offset <= r < end for r in unit_rows)
        rows.extend(unit_rows)
    assert rows == list(range(len(RECORDS)))


def test_read_returns_written_texts_and_rows(written: Any) -> None:
    fmt, fs, path = written
    got = read_all(fmt, fs, path, ["text"])
    assert got == [(i, {"text": t}) for i, t in enumerate(TEXTS)]
    assert all(type(rec["text"]) is str for _, rec in got)


def test_read_returns_only_requested_fields(written: Any) -> None:
    fmt, fs, path = written
    got = read_all(fmt, fs, path, ["id", "text"])
    assert got == [(i, {"id": i, "text": t}) for i, t in enumerate(TEXTS)]
    assert [set(rec) for _, rec in read_all(fmt, fs, path, ["meta"])] == [{"meta"}] * len(TEXTS)
    assert [rec for _, rec in read_all(fmt, fs, path, [])] == [{}] * len(TEXTS)


def test_missing_field_names_file_and_row(written: Any) -> None:
    fmt, fs, path = written
    unit = fmt.units(fs, path)[-1]
    with pytest.raises(DataError) as info:
        list(fmt.read(fs, unit, ["text", "nope"]))
    err = info.value
    name = path.rsplit("/", 1)[-1]
    assert name in str(err) and "nope" in str(err)
    assert err.path == path
    assert err.row == unit.row_offset
    assert f"row {unit.row_offset}" in str(err)


@pytest.mark.parametrize("corrupt", [corrupt_garbage, corrupt_truncate, corrupt_flip])
def test_corrupt_file_raises_data_error(written: Any, corrupt: Callable[[bytes], bytes]) -> None:
    fmt, fs, path = written
    fs.pipe_file(path, corrupt(fs.cat_file(path)))
    with pytest.raises(DataError) as info:
        read_all(fmt, fs, path, ["text"])
    assert path.rsplit("/", 1)[-1] in str(info.value)
    assert info.value.path == path


def test_file_handles_are_closed(written: Any) -> None:
    fmt, fs, path = written
    tracking = TrackingFS(fs)
    units = fmt.units(tracking, path)
    read_all(fmt, tracking, path, ["text"])
    assert tracking.opened and tracking.all_closed()
    # An abandoned iterator and a failed read leave nothing open either.
    it = fmt.read(tracking, units[0], ["text"])
    next(it)
    it.close()
    with pytest.raises(DataError):
        list(fmt.read(tracking, units[0], ["nope"]))
    assert tracking.all_closed()


def test_reads_through_open_source_on_memory_fs(memory_fs: Any) -> None:
    fs, root = memory_fs
    for name, variants in WRITERS.items():
        for variant, write in variants.items():
            write(fs, f"{root}/{variant}/a", RECORDS[:5])
            write(fs, f"{root}/{variant}/b", RECORDS[5:])
            source = open_source(f"memory://{root}/{variant}/*")
            assert len(source.paths) == 2
            fmt = get_format(name)
            texts = [rec["text"] for p in source.paths
                     for _, rec in read_all(fmt, source.fs, p, ["text"])]
            assert texts == TEXTS


# ---------------------------------------------------------------------------------------
# Parquet
# ---------------------------------------------------------------------------------------

PARQUET = get_format("parquet")
LOCAL = fsspec.filesystem("file")


def _parquet_file(tmp_path: Any, records: list[dict[str, Any]] = RECORDS) -> str:
    return write_parquet(LOCAL, (tmp_path / "p").as_posix(), records)


def test_parquet_one_unit_per_row_group(tmp_path: Any) -> None:
    path = _parquet_file(tmp_path)
    assert PARQUET.units(LOCAL, path) == [Unit(path, 0, 0), Unit(path, 1, 3),
                                          Unit(path, 2, 6), Unit(path, 3, 9)]


def test_parquet_middle_unit_reads_only_its_row_group(tmp_path: Any) -> None:
    path = _parquet_file(tmp_path)
    unit = PARQUET.units(LOCAL, path)[1]
    assert list(PARQUET.read(LOCAL, unit, ["text", "id"])) == [
        (i, {"text": TEXTS[i], "id": i}) for i in (3, 4, 5)]
    # Wreck the data pages of every other row group, and of the unrequested column of this
    # one: the unit still reads, so it never touched them.
    meta = pq.ParquetFile(path).metadata
    names = meta.schema.to_arrow_schema().names
    data = bytearray(open(path, "rb").read())
    for g in range(meta.num_row_groups):
        for c in range(meta.num_columns):
            if g == 1 and names[c] != "meta":
                continue
            col = meta.row_group(g).column(c)
            start = min(o for o in (col.dictionary_page_offset, col.data_page_offset)
                        if o is not None)
            data[start:start + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    with open(path, "wb") as f:
        f.write(bytes(data))
    assert [r for r, _ in PARQUET.read(LOCAL, unit, ["text", "id"])] == [3, 4, 5]
    with pytest.raises(DataError, match="cannot read parquet"):
        list(PARQUET.read(LOCAL, unit, ["meta"]))
    with pytest.raises(DataError, match="cannot read parquet"):
        list(PARQUET.read(LOCAL, PARQUET.units(LOCAL, path)[0], ["text"]))


def test_parquet_missing_field_names_first_row_of_unit(tmp_path: Any) -> None:
    path = _parquet_file(tmp_path)
    unit = PARQUET.units(LOCAL, path)[2]
    with pytest.raises(DataError, match=r"p\.parquet', row 6: missing field 'title' "
                                        r"\(the file's columns: text"):
        list(PARQUET.read(LOCAL, unit, ["text", "title"]))


def test_parquet_keeps_python_types(tmp_path: Any) -> None:
    records: list[dict[str, Any]] = [
        {"text": "ü", "blob": b"\x00\xff", "n": 1.5, "tags": ["a", "b"]},
        {"text": "", "blob": b"", "n": None, "tags": []},
    ]
    path = _parquet_file(tmp_path, records)
    assert [rec for _, rec in read_all(PARQUET, LOCAL, path, ["text", "blob", "n", "tags"])] \
        == records
    large = (tmp_path / "large.parquet").as_posix()
    pq.write_table(pa.table({"text": pa.array(["x", "y"], pa.large_string()),
                             "blob": pa.array([b"1", b"2"], pa.large_binary())}), large)
    assert read_all(PARQUET, LOCAL, large, ["text", "blob"]) == [
        (0, {"text": "x", "blob": b"1"}), (1, {"text": "y", "blob": b"2"})]


def test_parquet_without_row_groups_has_no_units(tmp_path: Any) -> None:
    path = (tmp_path / "empty.parquet").as_posix()
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])):
        pass
    assert PARQUET.units(LOCAL, path) == []


def test_parquet_empty_file_is_data_error(tmp_path: Any) -> None:
    path = (tmp_path / "zero.parquet").as_posix()
    open(path, "wb").close()
    with pytest.raises(DataError, match=r"zero\.parquet.*cannot read parquet"):
        PARQUET.units(LOCAL, path)


def test_parquet_missing_file_is_not_a_data_error(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError):
        PARQUET.units(LOCAL, (tmp_path / "absent.parquet").as_posix())


def test_parquet_a_column_twice_is_one_clear_error(tmp_path: Any) -> None:
    # pyarrow's KeyError passed the reader's handling: no file named, on_error ignored
    path = (tmp_path / "dup.parquet").as_posix()
    pq.write_table(pa.Table.from_arrays([pa.array(["a", "b"]), pa.array(["c", "d"])],
                                        names=["text", "text"]), path)
    (unit,) = PARQUET.units(LOCAL, path)
    with pytest.raises(DataError, match=r"dup\.parquet.*row 0.*column 'text' appears 2 times"):
        list(PARQUET.read(LOCAL, unit, ["text"]))


@pytest.mark.parametrize("groups", [5, 2])
def test_parquet_a_file_rewritten_after_listing_is_not_read_shifted(tmp_path: Any,
                                                                    groups: int) -> None:
    # the row groups listed were read by index: rows came twice, or shifted, silently
    path = (tmp_path / "f.parquet").as_posix()
    pq.write_table(pa.table({"text": [f"old{i}" for i in range(6)]}), path, row_group_size=3)
    first, second = PARQUET.units(LOCAL, path)
    pq.write_table(pa.table({"text": [f"new{i}" for i in range(6 if groups == 5 else 2)]}),
                   path, row_group_size=groups if groups == 5 else 1)
    assert [r for r, _ in PARQUET.read(LOCAL, first, ["text"])][0] == 0  # (still starts at 0)
    with pytest.raises(DataError, match=r"f\.parquet.*changed since its units were listed"):
        list(PARQUET.read(LOCAL, second, ["text"]))


@pytest.mark.parametrize("groups", [2, 1, 4])
def test_parquet_a_file_rewritten_between_reads_of_its_units_is_caught(
        where: tuple[fsspec.AbstractFileSystem, str], groups: int) -> None:
    # the first read keeps the file's footer: the next one must not trust it once the file
    # was rewritten (another layout: 3 row groups of 2 rows, 6 of 1, 1 of 4)
    fs, root = where
    path = f"{root}/kept.parquet"
    with fs.open(path, "wb") as f:
        pq.write_table(pa.table({"text": [f"old{i}" for i in range(6)]}), f, row_group_size=3)
    first, second = PARQUET.units(fs, path)
    assert [rec["text"] for _, rec in PARQUET.read(fs, first, ["text"])] == ["old0", "old1", "old2"]
    with fs.open(path, "wb") as f:
        pq.write_table(pa.table({"text": [f"new{i}" for i in range(6 if groups < 4 else 4)]}), f,
                       row_group_size=groups)
    with pytest.raises(DataError, match=r"kept\.parquet.*changed since its units were listed"):
        list(PARQUET.read(fs, second, ["text"]))
    # (the footer read again is the new one: the first row group now ends sooner)
    assert list(PARQUET.read(fs, first, ["text"])) == [(i, {"text": f"new{i}"})
                                                       for i in range(groups)]


class _CountingHandle(_Handle):
    """A :class:`_Handle` that adds up the bytes read through it."""

    def __init__(self, f: Any, counts: dict[str, int]):
        super().__init__(f)
        self._counts = counts

    def read(self, *args: Any) -> bytes:
        data = self._f.read(*args)
        self._counts["bytes"] += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        self._counts["bytes"] += n or 0
        return n


class CountingFS(TrackingFS):
    """A :class:`TrackingFS` that counts the bytes read from the files it opened."""

    def __init__(self, fs: fsspec.AbstractFileSystem):
        super().__init__(fs)
        self.counts = {"bytes": 0}

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> _Handle:
        handle = _CountingHandle(self._fs.open(path, mode, **kwargs), self.counts)
        self.opened.append(handle)
        return handle


def test_parquet_reading_every_row_group_reads_the_footer_once(tmp_path: Any) -> None:
    # every unit read and parsed the whole footer (and summed the row counts before its
    # group): the 2,000 row groups of a 370 KB file, a footer of 200 KB, read 540 MB
    path = (tmp_path / "many.parquet").as_posix()
    rows = 2000
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(rows)]}), path, row_group_size=1)
    size = LOCAL.size(path)
    footer = pq.ParquetFile(path).metadata.serialized_size
    assert footer > size / 2  # (the footer is most of the file: reading it per unit is O(G²))
    fs = CountingFS(LOCAL)
    units = PARQUET.units(fs, path)
    assert len(units) == rows
    fs.counts["bytes"] = 0
    got = [item for unit in units for item in PARQUET.read(fs, unit, ["text"])]
    assert got == [(i, {"text": f"doc {i}"}) for i in range(rows)]
    # every column chunk and the footer once (pyarrow 26 read the file and 64 KiB more)
    assert size - footer <= fs.counts["bytes"] <= 2 * size
    assert len(fs.opened) == rows + 1 and fs.all_closed()


def test_parquet_reads_from_many_threads_share_the_footer(tmp_path: Any) -> None:
    from concurrent.futures import ThreadPoolExecutor

    path = (tmp_path / "threads.parquet").as_posix()
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(400)]}), path, row_group_size=2)
    size = LOCAL.size(path)
    fs = CountingFS(LOCAL)
    units = PARQUET.units(fs, path)
    fs.counts["bytes"] = 0
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda u: list(PARQUET.read(fs, u, ["text"])), units))
    assert [item for part in got for item in part] == [(i, {"text": f"doc {i}"})
                                                       for i in range(400)]
    # the footer shared: a few threads may parse it at once, not each of the 200 units
    assert fs.counts["bytes"] <= 8 * size, (fs.counts["bytes"], size)


def test_parquet_errors_are_the_same_from_a_kept_footer(tmp_path: Any) -> None:
    path = _parquet_file(tmp_path)
    units = PARQUET.units(LOCAL, path)
    for _ in range(2):  # (the first read parses the footer, the second finds it kept)
        with pytest.raises(DataError, match=r"p\.parquet', row 6: missing field 'title'"):
            list(PARQUET.read(LOCAL, units[2], ["text", "title"]))
    dup = (tmp_path / "dup.parquet").as_posix()
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])],
                                        names=["text", "text"]), dup)
    (unit,) = PARQUET.units(LOCAL, dup)
    for _ in range(2):
        with pytest.raises(DataError, match=r"dup\.parquet.*row 0.*column 'text' appears 2"):
            list(PARQUET.read(LOCAL, unit, ["text"]))
    with pytest.raises(DataError, match=r"p\.parquet.*changed since.*has 4 row group\(s\)"):
        list(PARQUET.read(LOCAL, Unit(path, 4, 10), ["text"]))


def test_parquet_keeps_a_few_footers_least_recently_used_first(tmp_path: Any) -> None:
    from msd_dask.formats import parquet

    kept = parquet._FOOTERS
    for i in range(3 * kept.files):  # (a loader reads thousands of files over an epoch)
        path = write_parquet(LOCAL, (tmp_path / f"f{i}").as_posix(), RECORDS)
        list(PARQUET.read(LOCAL, PARQUET.units(LOCAL, path)[0], ["id"]))
        assert len(kept) <= kept.files

    def footer(nbytes: int) -> Any:
        return parquet._Footer("id", None, None, (0,), nbytes)

    cache = parquet._FooterCache(files=2, nbytes=100)
    cache.put(LOCAL, "a", footer(10))
    cache.put(LOCAL, "b", footer(10))
    assert cache.get(LOCAL, "a", "id") is not None  # (now the most recently used)
    cache.put(LOCAL, "c", footer(10))
    assert cache.get(LOCAL, "b", "id") is None and cache.get(LOCAL, "a", "id") is not None
    assert cache.get(LOCAL, "a", "another id") is None  # (rewritten: dropped)
    assert cache.get(LOCAL, "a", "id") is None and len(cache) == 1
    cache.put(LOCAL, "big", footer(150))  # (over the bytes: kept alone, as the last used)
    assert len(cache) == 1 and cache.get(LOCAL, "big", "id") is not None
    cache.put(LOCAL, "d", footer(10))
    assert len(cache) == 1 and cache.get(LOCAL, "d", "id") is not None


def test_parquet_a_corrupt_footer_is_always_a_data_error(tmp_path: Any) -> None:
    # bytes changed at random in the footer: some made pyarrow raise an IndexError or a
    # UnicodeDecodeError, which passed on_error: skip and named no file
    import random

    out = io.BytesIO()
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(50)]}), out, row_group_size=10)
    base = out.getvalue()
    start = len(base) - 8 - int.from_bytes(base[-8:-4], "little")
    rng = random.Random(1)
    fs = fsspec.filesystem("memory")
    path = f"/fuzz-{uuid.uuid4().hex}.parquet"
    failed = 0
    for _ in range(400):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(start, len(base) - 8)] = rng.randrange(256)
        fs.pipe_file(path, bytes(data))
        try:
            for unit in PARQUET.units(fs, path):
                for _ in PARQUET.read(fs, unit, ["text"]):
                    pass
        except DataError as e:
            assert path in str(e)
            failed += 1
    fs.rm(path)
    assert failed > 100  # (most changes break the file)


# ---------------------------------------------------------------------------------------
# JSON lines
# ---------------------------------------------------------------------------------------

JSONL = get_format("jsonl")


def _jsonl_file(tmp_path: Any, content: bytes, name: str = "f.jsonl") -> str:
    path = (tmp_path / name).as_posix()
    with open(path, "wb") as f:
        f.write(content)
    return path


def _rows(path: str, fields: Sequence[str] = ("text",)) -> list[tuple[int, dict[str, Any]]]:
    return read_all(JSONL, LOCAL, path, fields)


@pytest.mark.parametrize("name, expected", [
    ("a.jsonl", None), ("a.json", None), ("a.jsonl.gz", "gzip"), ("A.JSONL.GZ", "gzip"),
    ("a.jsonl.zst", "zstd"), ("a.jsonl.zstd", "zstd"), ("dir.zst/a.jsonl", None),
    ("a.jsonl.bz2", "bzip2"), ("a.JSONL.XZ", "xz"), ("dir.xz/a.jsonl", None),
])
def test_jsonl_compression_from_suffix(name: str, expected: str | None) -> None:
    assert compression_of(name) == expected


@pytest.mark.parametrize("compress, says", [
    (gzip.compress, "gzip-compressed but its name does not end in .gz"),
    (zstandard.ZstdCompressor().compress, "zstd-compressed but its name does not end in .zst"),
    (bz2.compress, "bzip2-compressed but its name does not end in .bz2"),
    (lzma.compress, "xz-compressed but its name does not end in .xz"),
    # (a skippable frame first, as pzstd and the seekable format write: read as lines of
    # binary; a review)
    (lambda b: b"\x5e\x2a\x4d\x18\x04\x00\x00\x00abcd" + zstandard.ZstdCompressor().compress(b),
     "zstd-compressed but its name does not end in .zst")])
def test_jsonl_a_compressed_file_named_plain_is_one_error(
        tmp_path: Any, compress: Callable[[bytes], bytes], says: str) -> None:
    """A compressed file named ``x.jsonl`` was read as lines of binary: under ``fail`` "row 0:
    invalid UTF-8" with no word of the compression, under ``skip`` each newline byte of the
    compressed data a bad row (175 for 20,000 documents, every epoch; a review)."""
    content = b"".join(b'{"text": "document %d"}\n' % i for i in range(2000))
    path = _jsonl_file(tmp_path, compress(content))
    with pytest.raises(DataError) as info:
        list(JSONL.read(LOCAL, Unit(path), ["text"], errors="yield"))
    assert str(info.value) == (f"file '{path}': the file is {says}: rename it so that it is "
                               "read decompressed")
    assert info.value.row is None
    # (a line of text starting as a bzip2 stream does not, by its first three bytes, make
    # the file one: it is that row's bad input)
    plain = _jsonl_file(tmp_path, b'BZh9 not json\n{"text": "b"}\n', "bzh.jsonl")
    got = list(JSONL.read(LOCAL, Unit(plain), ["text"], errors="yield"))
    assert isinstance(got[0][1], DataError) and got[1] == (1, {"text": "b"})


def test_jsonl_a_zstd_window_past_the_limit_is_named_not_corrupt(tmp_path: Any) -> None:
    """A file written with ``zstd --long=28`` or more (frames with a window over 128 MiB, what
    the decoder allows) read as "corrupt zstd stream: ... Frame requires too much memory",
    sending users to look for a bad download (a review)."""
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=28, enable_ldm=True)
    packer = zstandard.ZstdCompressor(compression_params=params).compressobj()
    content = b"".join(b'{"text": "d%d"}\n' % i for i in range(100))
    path = _jsonl_file(tmp_path, packer.compress(content) + packer.flush(), "long.jsonl.zst")
    with pytest.raises(DataError) as info:
        _rows(path)
    assert str(info.value) == (
        f"file '{path}': a zstd frame asks for a window over 128 MiB (written with `zstd "
        "--long=28` or more), past what each read may hold: recompress with `zstd --long=27` "
        "or less (or without --long)")


def test_jsonl_is_one_unit(tmp_path: Any) -> None:
    path = _jsonl_file(tmp_path, b'{"text": "a"}\n')
    assert JSONL.units(LOCAL, path) == [Unit(path, 0, 0)]


def test_jsonl_blank_lines_are_skipped_but_counted(tmp_path: Any) -> None:
    content = b'\n{"text": "a"}\n   \n\r\n{"text": "b"}\r\n\n{"text": "c"}'
    path = _jsonl_file(tmp_path, content)
    assert _rows(path) == [(1, {"text": "a"}), (4, {"text": "b"}), (6, {"text": "c"})]


@pytest.mark.parametrize("line, reason", [
    (b'{"text": "a"', "invalid JSON"),
    (b'["text", "a"]', "expected a JSON object, got list"),
    (b'"text"', "expected a JSON object, got str"),
    (b'{"title": "a"}', "missing field 'text' (the line's keys: title)"),
    (b'{}', "missing field 'text' (the line's keys: none)"),
    (b'{"text": "\xff\xfe"}', "invalid UTF-8"),
    # json.loads raises a bare ValueError past int()'s 4,300 digits: it escaped as one
    pytest.param(b'{"text": "a", "n": ' + b"1" * 5000 + b"}", "invalid JSON: Exceeds the limit",
                 id="int-too-long"),
])
def test_jsonl_bad_line_names_file_and_row(tmp_path: Any, line: bytes, reason: str) -> None:
    path = _jsonl_file(tmp_path, b'{"text": "ok"}\n\n' + line + b'\n{"text": "after"}\n')
    with pytest.raises(DataError) as info:
        _rows(path)
    assert info.value.row == 2 and info.value.path == path
    assert f"file '{path}', row 2: {reason}" in str(info.value)


def test_jsonl_rows_before_a_bad_line_are_yielded(tmp_path: Any) -> None:
    path = _jsonl_file(tmp_path, b'{"text": "ok"}\nnot json\n')
    it = JSONL.read(LOCAL, Unit(path), ["text"])
    assert next(it) == (0, {"text": "ok"})
    with pytest.raises(DataError, match="row 1"):
        next(it)


def test_jsonl_byte_order_mark_at_start_is_accepted(tmp_path: Any) -> None:
    path = _jsonl_file(tmp_path, b'\xef\xbb\xbf{"text": "a"}\n{"text": "b"}\n')
    assert _rows(path) == [(0, {"text": "a"}), (1, {"text": "b"})]


@pytest.mark.parametrize("content, rows", [
    (b'\xef\xbb\xbf\n{"text": "a"}\n', [(1, {"text": "a"})]),
    (b"\xef\xbb\xbf", []),
    (b"\xef\xbb\xbf\r\n", []),
])
def test_jsonl_byte_order_mark_then_a_blank_line_is_skipped(
        tmp_path: Any, content: bytes, rows: list[Any]) -> None:
    """A byte-order mark, then a blank line (or nothing): the blank line is skipped (it
    was row 0's invalid JSON)."""
    assert _rows(_jsonl_file(tmp_path, content)) == rows


def test_jsonl_zst_with_several_frames(tmp_path: Any) -> None:
    cctx = zstandard.ZstdCompressor()
    content = b"".join(cctx.compress(_jsonl_bytes(RECORDS[i:i + 3])) for i in range(0, 10, 3))
    path = _jsonl_file(tmp_path, content, "multi.jsonl.zst")
    assert [rec["text"] for _, rec in _rows(path)] == TEXTS


def test_jsonl_zst_streamed_from_writer_and_zstd_suffix(tmp_path: Any) -> None:
    buf = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(buf, closefd=False) as w:
        w.write(_jsonl_bytes(RECORDS))
    path = _jsonl_file(tmp_path, buf.getvalue(), "s.jsonl.zstd")
    assert [rec["text"] for _, rec in _rows(path)] == TEXTS


@pytest.mark.parametrize("name, compress", [
    ("multi.jsonl.bz2", bz2.compress), ("multi.jsonl.xz", lzma.compress),
])
def test_jsonl_several_streams_in_one_file(tmp_path: Any, name: str,
                                           compress: Callable[[bytes], bytes]) -> None:
    """Streams one after the other (as pbzip2 and parallel xz write): all are read."""
    content = b"".join(compress(_jsonl_bytes(RECORDS[i:i + 3])) for i in range(0, 10, 3))
    assert [rec["text"] for _, rec in _rows(_jsonl_file(tmp_path, content, name))] == TEXTS


class _FailingRead(io.RawIOBase):
    """A file whose storage fails after its first bytes (a dropped connection)."""

    def __init__(self, data: bytes):
        self.data, self.sent = data, False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        if self.sent:
            raise OSError("connection reset by peer")
        self.sent = True
        n = min(len(b), 64)
        b[:n] = self.data[:n]
        return n


class _FailingFs:
    def __init__(self, data: bytes):
        self.data = data

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> _FailingRead:
        # (as fsspec's open: a block size, a cache type, passed on to the file)
        return _FailingRead(self.data)


@pytest.mark.parametrize("name, compress", [
    ("a.jsonl.bz2", bz2.compress), ("a.jsonl.xz", lzma.compress),
    ("a.jsonl.zst", zstandard.ZstdCompressor().compress), ("a.jsonl", lambda b: b),
])
def test_jsonl_storage_error_is_not_called_corrupt(name: str,
                                                   compress: Callable[[bytes], bytes]) -> None:
    """A read that fails in the storage stays an OSError (retried or reported as I/O),
    never a DataError: on_error: skip would quarantine a good file for it.
    (bz2.BZ2File reports bad data as a bare OSError too: the decompressor's errors alone
    become DataError.)"""
    data = compress(_jsonl_bytes(RECORDS))
    with pytest.raises(OSError, match="connection reset") as info:
        list(JSONL.read(_FailingFs(data), Unit(name), ["text"]))  # type: ignore[arg-type]
    assert not isinstance(info.value, DataError)


@pytest.mark.parametrize("name, content", [
    ("bad.jsonl.gz", b"\x1f\x8b\x08\x00garbage-after-gzip-magic" * 4),
    ("plain.jsonl.gz", b'{"text": "not compressed"}\n'),
    ("bad.jsonl.zst", b"\x28\xb5\x2f\xfd" + b"\xff" * 64),
    ("plain.jsonl.zst", b'{"text": "not compressed"}\n'),
    ("bad.jsonl.bz2", b"BZh9" + b"\xff" * 64),
    ("plain.jsonl.bz2", b'{"text": "not compressed"}\n'),
    ("bad.jsonl.xz", b"\xfd7zXZ\x00" + b"\xff" * 64),
    ("plain.jsonl.xz", b'{"text": "not compressed"}\n'),
    ("cut.jsonl.bz2", bz2.compress(_jsonl_bytes(RECORDS))[:-10]),
    ("cut.jsonl.xz", lzma.compress(_jsonl_bytes(RECORDS))[:-10]),
    ("cut.jsonl.zst", zstandard.ZstdCompressor().compress(_jsonl_bytes(RECORDS))[:-4]),
])
def test_jsonl_corrupt_stream_names_file(tmp_path: Any, name: str, content: bytes) -> None:
    path = _jsonl_file(tmp_path, content, name)
    with pytest.raises(DataError, match=rf"file '.*{name}'.*corrupt") as info:
        _rows(path)
    assert info.value.path == path


def test_jsonl_truncated_gzip_is_data_error(tmp_path: Any) -> None:
    data = gzip.compress(_jsonl_bytes(RECORDS))
    path = _jsonl_file(tmp_path, data[:-10], "t.jsonl.gz")
    with pytest.raises(DataError, match=r"t\.jsonl\.gz"):
        _rows(path)


@pytest.mark.parametrize("name, content", [
    ("empty.jsonl", b""), ("blank.jsonl", b"\n \n"), ("empty.jsonl.gz", gzip.compress(b"", mtime=0)),
    ("empty.jsonl.zst", zstandard.ZstdCompressor().compress(b"")), ("zero.jsonl.zst", b""),
    ("empty.jsonl.bz2", bz2.compress(b"")), ("zero.jsonl.bz2", b""),
    ("empty.jsonl.xz", lzma.compress(b"")), ("zero.jsonl.xz", b""),
], ids=lambda v: v if isinstance(v, str) else "")  # (the suite's two processes collect alike)
def test_jsonl_empty_files_have_no_rows(tmp_path: Any, name: str, content: bytes) -> None:
    assert _rows(_jsonl_file(tmp_path, content, name)) == []


_POOL_RUN = """
import sys
import fsspec, pyarrow as pa, pyarrow.parquet as pq
from msd_dask.formats import get_format
pq.write_table(pa.table({{"text": ["a b c"] * 10}}), {path!r})
fmt, fs = get_format("parquet"), fsspec.filesystem("file")
units = fmt.units(fs, {path!r})
list(fmt.read(fs, units[0], ["text"]))
print(pa.default_memory_pool().backend_name)
"""


@pytest.mark.parametrize("env, backend", [({}, "system"),
                                          ({"ARROW_DEFAULT_MEMORY_POOL": "mimalloc"}, "mimalloc")])
def test_parquet_reads_allocate_from_the_c_heap_unless_the_deployment_chose(
        tmp_path: Any, env: dict[str, str], backend: str) -> None:
    # pyarrow's bundled mimalloc kept 110-126 MiB of freed pages in a worker that read
    # the demo's parquet three times (Arrow itself held at most 9 MiB)
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    out = subprocess.run([sys.executable, "-c", _POOL_RUN.format(path=str(tmp_path / "p.parquet"))],
                         check=True, capture_output=True, text=True, env={**base, **env})
    assert out.stdout.strip() == backend


def test_webdataset_a_member_twice_is_one_bad_sample(tmp_path: Any) -> None:
    """A sample with two ``.txt`` members (``0001.TXT`` and ``0001.txt`` count as one
    extension) is one bad row; the shard's other samples still read (a review found the
    whole shard dropped, the error naming no row, even with ``errors="yield"``)."""
    path = str(tmp_path / "dup.tar")
    with tarfile.open(path, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, text in (("a/0.txt", "zero"), ("a/1.TXT", "one"), ("a/1.txt", "uno"),
                           ("a/2.txt", "two")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text.encode()))
    wds = get_format("webdataset")
    rows = list(wds.read(LOCAL, Unit(path), ["text"], errors="yield"))
    assert [r for r, _ in rows] == [0, 1, 2]
    assert rows[0][1] == {"text": "zero"} and rows[2][1] == {"text": "two"}
    bad = rows[1][1]
    assert isinstance(bad, DataError) and bad.row == 1
    assert "sample 'a/1' has two '.txt' members" in str(bad)
    with pytest.raises(DataError, match=r"row 1: sample 'a/1' has two '\.txt' members"):
        list(wds.read(LOCAL, Unit(path), ["text"]))


def test_webdataset_json_member_with_a_too_long_integer_is_one_bad_sample(tmp_path: Any) -> None:
    """A ``.json`` member json.loads refuses with a bare ValueError (an integer past
    int()'s digit limit) is one bad row, not the shard's failure."""
    path = str(tmp_path / "bigint.tar")
    with tarfile.open(path, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("s/0.txt", b"zero"), ("s/1.txt", b"one"),
                           ("s/1.json", b'{"n": ' + b"9" * 5000 + b"}"), ("s/2.txt", b"two")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    rows = list(get_format("webdataset").read(LOCAL, Unit(path), ["text"], errors="yield"))
    assert [r for r, _ in rows] == [0, 1, 2]
    assert rows[0][1] == {"text": "zero"} and rows[2][1] == {"text": "two"}
    bad = rows[1][1]
    assert isinstance(bad, DataError) and bad.row == 1 and "invalid .json member" in str(bad)


def test_open_source_a_file_whose_name_has_glob_characters(tmp_path: Any) -> None:
    """A uri naming an existing file with ``[`` in its name is that file, not a glob of a
    character class that matches nothing."""
    path = tmp_path / "part[0].jsonl"
    path.write_bytes(b'{"text": "a"}\n')
    assert open_source(str(path)).paths == [str(path)]
    assert open_source(str(tmp_path / "part*.jsonl")).paths == [str(path)]


def test_open_source_a_folder_whose_name_has_glob_characters(tmp_path: Any) -> None:
    """A uri naming an existing folder with ``[`` in its name (``run[1]``) is that folder:
    it was globbed as ``run1`` and the start refused, "matches no file" (a review)."""
    import fsspec
    folder = tmp_path / "run[1]"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b'{"text": "a"}\n')
    (tmp_path / "run1").mkdir()
    (tmp_path / "run1" / "b.jsonl").write_bytes(b'{"text": "b"}\n')
    for uri in (str(folder), f"{folder}/"):
        found = open_source(uri)
        assert found.paths == [str(folder / "a.jsonl")] and found.folder, uri
    mem = fsspec.filesystem("memory")
    mem.pipe("/globby/run[1]/a.jsonl", b'{"text": "a"}\n')
    try:
        assert open_source("memory://globby/run[1]").paths == ["/globby/run[1]/a.jsonl"]
        # a glob is still a glob
        assert open_source(f"{tmp_path}/run[1]/*.jsonl").paths == [str(tmp_path / "run1" /
                                                                      "b.jsonl")]
    finally:
        mem.rm("/globby", recursive=True)


def _spark_folder(root: Any) -> None:
    """A folder as Spark writes it: data, its markers, checksums and a leftover attempt."""
    files = ["part-00000.jsonl", "part-00001.jsonl", "_SUCCESS", "_committed_123",
             ".part-00000.jsonl.crc", "_temporary/0/part-00009.jsonl", ".hidden/part-7.jsonl",
             "sub/part-00002.jsonl", "sub/_SUCCESS"]
    for name in files:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"" if "SUCCESS" in name else b'{"text": "x"}\n')


@pytest.mark.parametrize("pattern", ["{root}", "{root}/", "{root}/**", "{root}/*", "{root}/*/*"])
def test_markers_and_hidden_files_are_not_data(tmp_path: Any, pattern: str) -> None:
    """A folder or glob over Spark output listed _SUCCESS (empty: 'no readable units' or a
    parse error), .crc checksums and _temporary/ leftovers as data (review).  Names
    starting with '.' or '_' are left out where a folder or glob is expanded, as pyarrow's
    datasets do."""
    _spark_folder(tmp_path / "out")
    source = open_source(pattern.format(root=(tmp_path / "out").as_posix()))
    names = [source.relpath(p) for p in source.paths]
    expected = {"{root}": ["part-00000.jsonl", "part-00001.jsonl", "sub/part-00002.jsonl"],
                "{root}/*": ["part-00000.jsonl", "part-00001.jsonl"],
                "{root}/*/*": ["sub/part-00002.jsonl"]}
    assert names == expected.get(pattern, expected["{root}"])


def test_a_marker_named_alone_is_read(tmp_path: Any) -> None:
    _spark_folder(tmp_path / "out")
    path = (tmp_path / "out" / "_temporary" / "0" / "part-00009.jsonl").as_posix()
    assert open_source(path).paths == [path]


@pytest.mark.parametrize("pattern, read", [
    ("{root}/{{_temporary/0,sub}}/*.jsonl", ["_temporary/0/part-00009.jsonl",
                                             "sub/part-00002.jsonl"]),
    ("{root}/{{.hidden,sub}}/part-*.jsonl", [".hidden/part-7.jsonl", "sub/part-00002.jsonl"]),
    ("{root}/_temporary/*/*.jsonl", ["0/part-00009.jsonl"]),  # (its root: _temporary)
    ("{root}/*/0/*.jsonl", []),  # (a wildcard matched _temporary)
    ("{root}/_*", ["_SUCCESS", "_committed_123"]),
    ("{root}/**/_SUCCESS", ["_SUCCESS", "sub/_SUCCESS"]),
])
def test_names_a_glob_spells_out_are_read(tmp_path: Any, pattern: str, read: list[str]) -> None:
    # a name starting with '.' or '_' is left out where a wildcard matched it, not where the
    # pattern names it: one of the alternatives in braces was left out without a word where
    # the same folder outside braces was read (a review)
    _spark_folder(tmp_path / "out")
    source = open_source(pattern.format(root=(tmp_path / "out").as_posix()))
    assert [source.relpath(p) for p in source.paths] == read


def test_braces_in_a_glob_are_alternatives(tmp_path: Any) -> None:
    """fsspec's glob has no braces: 'data/{code,math}/*.jsonl' matched no file."""
    for d in ("code", "math", "prose", "math2"):
        (tmp_path / d).mkdir()
        for i in range(2):
            (tmp_path / d / f"p{i}.jsonl").write_bytes(b'{"text": "x"}\n')
    root = tmp_path.as_posix()
    source = open_source(f"{root}/{{code,math{{,2}}}}/p{{1,0}}.jsonl")
    assert source.root == root
    assert [source.relpath(p) for p in source.paths] == [
        f"{d}/p{i}.jsonl" for d in ("code", "math", "math2") for i in (0, 1)]


@pytest.mark.parametrize("pattern, expanded", [
    ("a{b,c{d,e}}f", ["abf", "acdf", "acef"]), ("{a,b}{1,2}", ["a1", "a2", "b1", "b2"]),
    ("a{,b}", ["a", "ab"]), ("{x}", ["{x}"]), ("a{b", ["a{b"]), ("a}b", ["a}b"]),
    ("s3://b/{x,y}/*.parquet", ["s3://b/x/*.parquet", "s3://b/y/*.parquet"]),
    # a brace without alternatives, or inside a character class, is a character (review)
    ("run{1}/*.jsonl", ["run{1}/*.jsonl"]), ("cls/[{,}].jsonl", ["cls/[{,}].jsonl"]),
    ("{a{b,c}}", ["{ab}", "{ac}"]), ("{[,],y}", ["[,]", "y"]), ("[]{,]x", ["[]{,]x"]),
])
def test_expand_braces(pattern: str, expanded: list[str]) -> None:
    from msd_dask.sources.storage import expand_braces

    assert expand_braces(pattern) == expanded


def test_jsonl_xz_stream_padding_is_skipped(tmp_path: Any) -> None:
    """xz allows NUL padding between and after streams (its spec, 2.2): it was read as a
    corrupt stream (review)."""
    one = lzma.compress(_jsonl_bytes(RECORDS[:3]))
    two = lzma.compress(_jsonl_bytes(RECORDS[3:]))
    path = _jsonl_file(tmp_path, one + b"\0" * 4 + two + b"\0" * 8, "padded.jsonl.xz")
    assert [rec["text"] for _, rec in _rows(path)] == TEXTS


@pytest.mark.parametrize("name, compress", [
    ("big.jsonl.bz2", lambda b: bz2.compress(b, 1)), ("big.jsonl.xz", lambda b: lzma.compress(
        b, preset=0)), ("big.jsonl.zst", zstandard.ZstdCompressor(level=1).compress),
])
def test_jsonl_memory_stays_bounded_whatever_the_ratio(tmp_path: Any, name: str,
                                                       compress: Callable[[bytes], bytes]) -> None:
    """A file that compresses ~1,000x (16 MiB of repeated lines): a 1 MiB read of it was
    decompressed whole at once, so memory grew with the ratio (review: 224 MiB for a 17 KB
    .xz).  Reading it row by row holds a bounded amount."""
    import tracemalloc

    line = json.dumps({"text": "the same line " * 60}).encode() + b"\n"
    content = line * ((16 << 20) // len(line))
    path = _jsonl_file(tmp_path, compress(content), name)
    del content
    tracemalloc.start()
    try:
        rows = sum(1 for _ in JSONL.read(LOCAL, Unit(path), ["text"]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows == (16 << 20) // len(line)
    assert peak < 12 << 20, f"peak {peak / 2**20:.0f} MiB"


def test_a_brace_that_is_a_character_lists_as_before(tmp_path: Any) -> None:
    """A folder named run{1} listed nothing once braces counted as a glob, run{1}/*.jsonl
    keyed its files under 'run{1}/', and [{,}] lost its class (review)."""
    run = tmp_path / "run{1}"
    run.mkdir()
    (run / "a.jsonl").write_bytes(b'{"text": "x"}\n')
    (tmp_path / "cls").mkdir()
    for name in ("{.jsonl", "}.jsonl", ",.jsonl"):
        (tmp_path / "cls" / name).write_bytes(b'{"text": "x"}\n')
    folder = open_source(run.as_posix())
    assert [folder.relpath(p) for p in folder.paths] == ["a.jsonl"]
    glob = open_source(f"{run.as_posix()}/*.jsonl")
    assert glob.root == run.as_posix() and [glob.relpath(p) for p in glob.paths] == ["a.jsonl"]
    cls = open_source(f"{tmp_path.as_posix()}/cls/[{{}}].jsonl")
    assert [cls.relpath(p) for p in cls.paths] == ["{.jsonl", "}.jsonl"]


def test_a_source_whose_every_file_is_quarantined_asks_about_its_format(tmp_path: Any) -> None:
    """JSON lines listed as parquet under ``on_error: skip``: every file was quarantined, and
    the error said 'empty files?'."""
    from msd_dask.core.config import parse_config
    from msd_dask.sources.discover import discover_units

    # (named .txt: ``.jsonl`` files read as parquet are refused before, by their names,
    # test_a_format_that_does_not_read_the_files_is_one_clear_error)
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text('{"text": "hello world"}\n')
    cfg = parse_config({"name": "q", "batch": {"seq_len": 64},
                        "sources": [{"name": "s", "uri": str(tmp_path / "*.txt"),
                                     "format": "parquet", "on_error": "skip"}]})
    with pytest.raises(DataError, match=r"all 2 were quarantined .*is its format 'parquet' right"):
        discover_units(cfg)


#: what users keep beside their shards: a Hugging Face dataset repo's card, attributes and
#: info, a licence, Spark's marker
_NOT_DATA = ("README.md", ".gitattributes", "_SUCCESS", "LICENSE", "dataset_info.json")


def _folder(root: Any, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def _folder_units(uri: str, fmt: str, **kw: Any) -> list[tuple[str, int, int]]:
    from msd_dask.core.config import parse_config
    from msd_dask.sources.discover import discover_units

    cfg = parse_config({"name": "f", "batch": {"seq_len": 64},
                        "sources": [{"name": "s", "uri": uri, "format": fmt}]})
    return discover_units(cfg, **kw)[0]["s"]


def test_a_folder_reads_its_parquet_shards_not_the_files_beside_them(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A folder uri listed every file in it: the README.md or LICENSE beside the shards was
    a parquet file whose footer could not be read, and the start failed (review).  Only the
    format's files are read, in the order a glob of them gives, and the others are named
    once in the log."""
    import logging

    root = tmp_path / "ds"
    _folder(root, {name: b"# not data\n" for name in _NOT_DATA})
    (root / "data").mkdir()
    for stem in ("data/train-00000", "data/train-00001", "top"):
        write_parquet(LOCAL, (root / stem).as_posix(), RECORDS)
    with caplog.at_level(logging.INFO, logger="msd_dask.service"):
        units = _folder_units(root.as_posix(), "parquet")
    shards = [(root / f"{stem}.parquet").as_posix()
              for stem in ("data/train-00000", "data/train-00001", "top")]
    assert units == [(p, i, 3 * i) for p in shards for i in range(4)]
    assert units == _folder_units(f"{root.as_posix()}/**/*.parquet", "parquet")
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and said[0].count("left out") == 1
    assert "left out 3 other(s): LICENSE, README.md, dataset_info.json" in said[0]
    assert "'parquet'" in said[0] and "read the 3 file(s)" in said[0]


def test_a_folder_reads_its_json_lines_files_plain_and_compressed(tmp_path: Any) -> None:
    """The same for JSON lines: every suffix the format reads, compressed too (C4's
    ``.json.gz`` as well), and in any case; nothing else of the folder."""
    root = tmp_path / "ds"
    line = b'{"text": "x"}\n'
    data = {"a.jsonl": line, "b.jsonl.gz": gzip.compress(line),
            "c.jsonl.zst": zstandard.ZstdCompressor().compress(line),
            "d.json.gz": gzip.compress(line), "e.ndjson.xz": lzma.compress(line),
            "F.JSONL.BZ2": bz2.compress(line)}
    _folder(root, {**data, **{name: b"# not data\n" for name in _NOT_DATA},
                   "notes.txt": b"hi\n", "old.jsonl.bak": line})
    units = _folder_units(root.as_posix(), "jsonl")
    assert units == [((root / n).as_posix(), 0, 0) for n in sorted(data)]
    fs = fsspec.filesystem("file")
    assert [rec for p, _, _ in units for _, rec in JSONL.read(fs, Unit(p), ["text"])] == \
        [{"text": "x"}] * len(data)


def test_a_folder_reads_its_tar_shards(tmp_path: Any) -> None:
    root = tmp_path / "ds"
    _folder(root, {name: b"# not data\n" for name in _NOT_DATA})
    for i in range(2):
        _write_tar((root / f"shard-{i}.tar").as_posix(), [(f"{i}.txt", b"text")])
    assert _folder_units(root.as_posix(), "webdataset") == [
        ((root / f"shard-{i}.tar").as_posix(), 0, 0) for i in range(2)]


def test_a_folder_without_a_file_of_its_format_is_one_clear_error(tmp_path: Any) -> None:
    """Files left out, none read: not an empty source, but a config error naming the key,
    the source, the folder, the format and what the folder holds."""
    from msd_dask.errors import ConfigError

    root = tmp_path / "ds"
    _folder(root, {name: b"# not data\n" for name in (*_NOT_DATA, "a.csv", "b.csv", "c.csv")})
    with pytest.raises(ConfigError) as info:
        _folder_units(root.as_posix(), "parquet")
    err = info.value
    assert err.key == "sources[0].uri"
    assert f"folder {root.as_posix()!r} of source 's' holds no file that format 'parquet' " \
           "reads (names ending in .parquet" in str(err)
    assert "only 6 other(s): LICENSE, README.md, a.csv, b.csv, c.csv and 1 more" in str(err)
    assert f"name them with a glob (e.g. '{root.as_posix()}/**')" in str(err)


def test_a_glob_or_a_file_is_read_as_named(tmp_path: Any) -> None:
    """The user said what to read: a glob reads every file it matches and a file named
    alone is read, whatever their names (one that is not the format's data fails as
    before)."""
    root = tmp_path / "ds"
    _folder(root, {"a.jsonl": b'{"text": "x"}\n', "notes.txt": b'{"text": "y"}\n',
                   "README.md": b"# not data\n"})
    posix = root.as_posix()
    assert _folder_units(f"{posix}/*", "jsonl") == [
        (f"{posix}/{n}", 0, 0) for n in ("README.md", "a.jsonl", "notes.txt")]
    assert _folder_units(f"{posix}/*.txt", "jsonl") == [(f"{posix}/notes.txt", 0, 0)]
    assert _folder_units(f"{posix}/notes.txt", "jsonl") == [(f"{posix}/notes.txt", 0, 0)]
    with pytest.raises(DataError, match=r"README\.md': cannot read parquet"):
        _folder_units(f"{posix}/*", "parquet")


def test_a_format_without_suffixes_reads_every_file_of_a_folder(tmp_path: Any) -> None:
    root = tmp_path / "ds"
    _folder(root, {"a.txt": b"x\n", "b.lines": b"y\n"})
    assert _folder_units(root.as_posix(), "msd_dask.examples.text_lines:TextLinesFormat") == [
        ((root / n).as_posix(), 0, 0) for n in ("a.txt", "b.lines")]


def test_a_format_that_does_not_read_the_files_is_one_clear_error(tmp_path: Any) -> None:
    """``format: jsonl`` over parquet files failed on the first file's bytes ("row 0:
    invalid UTF-8: invalid start byte at byte 7", a review): where every file is another
    built-in format's and none the source's, the listing refuses ``sources[i].format``,
    whether the uri is a glob, a file or a folder."""
    from msd_dask.errors import ConfigError

    root = tmp_path / "ds"
    root.mkdir()
    for stem in ("part-00000", "part-00001"):
        write_parquet(LOCAL, (root / stem).as_posix(), RECORDS)
    posix = root.as_posix()
    for uri in (f"{posix}/*.parquet", f"{posix}/part-00000.parquet", posix):
        with pytest.raises(ConfigError) as info:
            _folder_units(uri, "jsonl")
        assert info.value.key == "sources[0].format"
        assert str(info.value) == (
            "config key 'sources[0].format': source 's' has format 'jsonl', but its files end "
            "in .parquet (e.g. 'part-00000.parquet'), which format 'parquet' reads"), uri
    # the other way round, with the file's own spelling of the suffix
    (root / "A.JSONL.GZ").write_bytes(gzip.compress(b'{"text": "x"}\n'))
    with pytest.raises(ConfigError, match=r"source 's' has format 'parquet', but its files end "
                                          r"in \.JSONL\.GZ \(e\.g\. 'A\.JSONL\.GZ'\), which format "
                                          r"'jsonl' reads$"):
        _folder_units(f"{posix}/*.JSONL.GZ", "parquet")


def test_files_of_the_format_or_of_no_built_in_format_are_read_as_before(tmp_path: Any) -> None:
    """Only a source whose every file is another built-in format's is refused: one file of
    its own format, a file no built-in format names, or a format without ``suffixes``
    (one of your own) and it is listed as before (a file it cannot read fails as before)."""
    root = tmp_path / "ds"
    root.mkdir()
    write_parquet(LOCAL, (root / "b").as_posix(), RECORDS)
    write_parquet(LOCAL, (root / "c").as_posix(), RECORDS)
    (root / "a.jsonl").write_bytes(b'{"text": "x"}\n')
    posix = root.as_posix()
    # (a JSON-lines file is one unit, listed unread: its bytes fail where they are read)
    assert _folder_units(f"{posix}/*", "jsonl") == [  # (mixed: one file is the format's)
        (f"{posix}/{n}", 0, 0) for n in ("a.jsonl", "b.parquet", "c.parquet")]
    (root / "b.bin").write_bytes((root / "b.parquet").read_bytes())
    assert _folder_units(f"{posix}/*.{{bin,parquet}}", "jsonl") == [  # (.bin: no format's)
        (f"{posix}/{n}", 0, 0) for n in ("b.bin", "b.parquet", "c.parquet")]
    (root / "d.jsonl").write_bytes(b"one line\n")
    assert _folder_units(f"{posix}/*.jsonl", "msd_dask.examples.text_lines:TextLinesFormat") == [
        (f"{posix}/{n}", 0, 0) for n in ("a.jsonl", "d.jsonl")]


def test_every_built_in_format_reads_its_writers_files_from_a_folder() -> None:
    """Each built-in format says what its files are named, and its writers' files are."""
    for name, variants in WRITERS.items():
        suffixes = FORMATS[name].suffixes  # type: ignore[attr-defined]
        assert suffixes and all(x.startswith(".") for x in suffixes), name
        for variant, write in variants.items():
            path = write(fsspec.filesystem("memory"), f"/suffixes/{uuid.uuid4().hex}", RECORDS)
            assert path.lower().endswith(suffixes), (name, variant, path)
    for suffix in FORMATS["jsonl"].suffixes:  # type: ignore[attr-defined]
        assert (compression_of("f" + suffix) is None) == suffix.endswith(("l", "json")), suffix


def test_the_starter_logs_the_files_a_folder_left_out_once(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The units are listed on a worker, whose log the user may never see: the files left
    out travel back and are logged where the service is started, once."""
    import logging

    from msd_dask.core.config import parse_config
    from msd_dask.sources.discover import discover_remote

    class Done:
        def __init__(self, value: Any):
            self.value = value

        def result(self, timeout: float) -> Any:
            return self.value

        def release(self) -> None:
            pass

    class Client:
        def submit(self, fn: Any, *args: Any, pure: bool) -> Done:
            return Done(fn(*args))

    root = tmp_path / "ds"
    _folder(root, {"a.jsonl": b'{"text": "x"}\n', "README.md": b"# not data\n"})
    cfg = parse_config({"name": "f", "batch": {"seq_len": 64},
                        "sources": [{"name": "s", "uri": root.as_posix(), "format": "jsonl"}]})
    with caplog.at_level(logging.INFO, logger="msd_dask.service"):
        units, _, _ = discover_remote(Client(), cfg, timeout=10)
    assert units == {"s": [((root / "a.jsonl").as_posix(), 0, 0)]}
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert said == [f"source 's': read the 1 file(s) of folder {root.as_posix()!r} that format "
                    "'jsonl' reads; left out 1 other(s): README.md (name them with a glob to "
                    "read them)"]


def test_a_format_that_yields_rows_out_of_order_is_named(tmp_path: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A format of your own whose ``read`` gives row 1 before row 0 is bad input naming the
    file, the row and the format (it said only "rows out of order")."""
    from msd_dask import load_config
    from msd_dask.sources.documents import read_unit
    from msd_dask.sources.tokenizer import ByteTokenizer

    (tmp_path / "backwards_format_xyz.py").write_text(
        "from msd_dask.formats import Unit\n"
        "class Backwards:\n"
        "    def units(self, fs, path):\n"
        "        return [Unit(path, 0, 0)]\n"
        "    def read(self, fs, unit, fields):\n"
        "        yield 1, {'text': 'b'}\n"
        "        yield 0, {'text': 'a'}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "a.txt").write_text("a\nb\n")
    cfg = load_config({"name": "b", "batch": {"seq_len": 8}, "sources": [
        {"name": "back", "uri": str(tmp_path / "*.txt"), "format": "backwards_format_xyz:Backwards"}]})
    src = cfg.sources[0]
    fs = fsspec.filesystem("file")
    with pytest.raises(DataError) as info:
        read_unit(src, fs, Unit(str(tmp_path / "a.txt")), ByteTokenizer())
    err = info.value
    assert err.source == "back" and err.path == str(tmp_path / "a.txt") and err.row == 0
    assert "rows out of order" in str(err) and "backwards_format_xyz:Backwards" in str(err)


def _write_tar(path: str, members: Sequence[tuple[str, bytes]]) -> None:
    with tarfile.open(path, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_webdataset_a_sample_without_an_image_is_a_text_document(tmp_path: Any) -> None:
    # the docs say a row whose image is null is a text document; a shard's sample without
    # an image member was a 'missing field' error (a review)
    path = str(tmp_path / "mixed.tar")
    _write_tar(path, [("s/0.jpg", b"JPEG"), ("s/0.txt", b"zero"), ("s/1.txt", b"one")])
    wds = get_format("webdataset")
    rows = list(wds.read(LOCAL, Unit(path), ["text", "image"]))
    assert rows == [(0, {"text": "zero", "image": b"JPEG"}), (1, {"text": "one", "image": None})]
    assert list(wds.read(LOCAL, Unit(path), ["text", "jpg"]))[1] == (1, {"text": "one",
                                                                        "jpg": None})
    # an image under another extension than the field asked for is a missing field still
    # (a review of this change: image_field png over .jpg shards made every sample text)
    with pytest.raises(DataError, match=r"row 0: sample 's/0': missing field 'png'"):
        list(wds.read(LOCAL, Unit(path), ["text", "png"]))


def test_webdataset_an_image_comes_from_members_not_from_the_json(tmp_path: Any) -> None:
    """A sample's ``.json`` metadata naming its image (a URL, a file name: common in crawled
    shards) made a sample with no image member bad input ("field 'image' is str") where the
    docs say it is a text document; with an image member, the member's bytes are the image
    (a review of the multimodal path).  The json's other keys are fields as before."""
    meta = json.dumps({"image": "http://x/y.jpg", "jpg": "y.jpg", "url": "http://x"}).encode()
    path = str(tmp_path / "meta.tar")
    _write_tar(path, [("s/0.txt", b"text only"), ("s/0.json", meta),
                      ("s/1.jpg", b"JPEG"), ("s/1.txt", b"one"), ("s/1.json", meta)])
    wds = get_format("webdataset")
    rows = list(wds.read(LOCAL, Unit(path), ["text", "image", "url"]))
    assert rows == [(0, {"text": "text only", "image": None, "url": "http://x"}),
                    (1, {"text": "one", "image": b"JPEG", "url": "http://x"})]
    assert [r["jpg"] for _, r in wds.read(LOCAL, Unit(path), ["text", "jpg"])] == [None, b"JPEG"]


def test_webdataset_a_missing_field_lists_the_samples_fields(tmp_path: Any) -> None:
    path = str(tmp_path / "s.tar")
    _write_tar(path, [("s/0.txt", b"zero"), ("s/0.cls", b"3")])
    with pytest.raises(DataError, match=r"row 0: sample 's/0': missing field 'caption' \(its "
                                        r"fields: cls, text, txt\)"):
        list(get_format("webdataset").read(LOCAL, Unit(path), ["caption"]))


@pytest.mark.parametrize("members, says", [
    ([("a/7.txt", b"\xff\xfe")], "invalid UTF-8 in .txt member"),
    ([("a/7.txt", b"x"), ("a/7.json", b"{")], "invalid .json member"),
    ([("a/7.txt", b"x"), ("a/7.json", b"[1]")], ".json member is a list, not an object"),
    ([("a/7.cls", b"3")], "missing field 'text'"),
])
def test_webdataset_a_bad_samples_error_names_its_key(tmp_path: Any, members: list[Any],
                                                      says: str) -> None:
    """A bad sample's error named its row alone, an index the user had to count through the
    tar to find: it names the sample's key (the members' common name) too (a review)."""
    path = str(tmp_path / "k.tar")
    _write_tar(path, [("a/6.txt", b"fine"), *members, ("a/8.txt", b"fine")])
    rows = list(get_format("webdataset").read(LOCAL, Unit(path), ["text"], errors="yield"))
    assert [r for _, r in rows if not isinstance(r, DataError)] == [{"text": "fine"}] * 2
    bad = rows[1][1]
    assert isinstance(bad, DataError) and bad.row == 1, rows
    assert f"row 1: sample 'a/7': {says}" in str(bad), bad


def test_webdataset_every_image_the_decoder_reads_is_the_samples_image(tmp_path: Any) -> None:
    """A sample whose image was a ``.gif``, ``.bmp``, ``.tiff`` or ``.ppm`` (formats the image
    decoder reads) was taken for a text document, its image dropped without a word (a
    review)."""
    from msd_dask.formats.webdataset import IMAGE_EXTENSIONS
    from msd_dask.sources.vision import IMAGE_FORMATS

    exts = ["jpg", "gif", "bmp", "tif", "tiff", "ppm", "pgm", "pbm", "pnm", "png", "webp"]
    path = str(tmp_path / "images.tar")
    _write_tar(path, [m for i, ext in enumerate(exts)
                      for m in ((f"s/{i}.{ext}", ext.encode()), (f"s/{i}.txt", b"caption"))])
    rows = list(get_format("webdataset").read(LOCAL, Unit(path), ["text", "image"]))
    assert rows == [(i, {"text": "caption", "image": ext.encode()}) for i, ext in enumerate(exts)]
    # (one list of each: every format the decoder opens has its names here)
    named = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp",
             "TIFF": "tiff", "PPM": "ppm"}
    assert {named[f] for f in IMAGE_FORMATS} <= set(IMAGE_EXTENSIONS)


def test_webdataset_a_sample_with_two_images_takes_the_first_of_the_list(tmp_path: Any) -> None:
    """A photo and its depth map as ``.pgm``: with the image names widened, the later member
    in the tar became the image (a read-back); the first of ``IMAGE_EXTENSIONS`` is, in
    either order.  A folder whose name merely ends in ``__MACOSX`` is no macOS folder."""
    path = str(tmp_path / "two.tar")
    _write_tar(path, [("0.jpg", b"PHOTO"), ("0.pgm", b"DEPTH"), ("0.txt", b"a"),
                      ("1.pgm", b"DEPTH"), ("1.jpg", b"PHOTO"), ("1.txt", b"b"),
                      ("x__MACOSX/2.txt", b"c")])
    rows = list(get_format("webdataset").read(LOCAL, Unit(path), ["text", "image", "pgm"]))
    assert rows == [(0, {"text": "a", "image": b"PHOTO", "pgm": b"DEPTH"}),
                    (1, {"text": "b", "image": b"PHOTO", "pgm": b"DEPTH"}),
                    (2, {"text": "c", "image": None, "pgm": None})]


@pytest.mark.parametrize("hidden", ["./._{k}.json", "._{k}.txt", "s/.DS_Store",
                                    "__MACOSX/s/._{k}.txt"])
def test_webdataset_hidden_members_do_not_cut_a_sample(tmp_path: Any, hidden: str) -> None:
    """macOS's tar writes an AppleDouble ``._0001.txt`` before each file with extended
    attributes: each one was a sample of its own, cutting its neighbours in two (a json
    from its text: under ``fail`` the service stopped at row 0, under ``skip`` every sample
    was set aside; a review)."""
    members: list[tuple[str, bytes]] = []
    for k in range(3):
        for ext, data in (("json", b'{"id": %d}' % k), ("txt", b"doc %d" % k)):
            members.append((hidden.format(k=k).replace("{k}", str(k)), b"\x00\x05\x16\x07"))
            members.append((f"./{k}.{ext}" if hidden.startswith("./") else f"{k}.{ext}", data))
    path = str(tmp_path / "mac.tar")
    _write_tar(path, members)
    rows = list(get_format("webdataset").read(LOCAL, Unit(path), ["text", "id"]))
    assert rows == [(k, {"text": f"doc {k}", "id": k}) for k in range(3)]


@pytest.mark.parametrize("compress, says", [(gzip.compress, "gzip"), (bz2.compress, "bzip2"),
                                            (zstandard.ZstdCompressor().compress, "zstd")])
def test_webdataset_a_compressed_shard_says_so(tmp_path: Any, compress: Callable[[bytes], bytes],
                                               says: str) -> None:
    plain = str(tmp_path / "s.tar")
    _write_tar(plain, [("s/0.txt", b"zero")])
    path = str(tmp_path / "s.tar.x")
    with open(plain, "rb") as f, open(path, "wb") as out:
        out.write(compress(f.read()))
    with pytest.raises(DataError, match=rf"s\.tar\.x': cannot read tar: .* \(the shard is "
                                        rf"{says}-compressed"):
        list(get_format("webdataset").read(LOCAL, Unit(path), ["text"]))


@pytest.mark.parametrize("name, compress", [("f.jsonl", lambda b: b), ("f.jsonl.gz", gzip.compress),
                                            ("f.jsonl.zst", zstandard.ZstdCompressor().compress)])
def test_jsonl_a_line_too_long_is_its_rows_bad_input(tmp_path: Any, name: str,
                                                    compress: Callable[[bytes], bytes],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # a line had no bound: a 400 MiB line of a 13 KB .zst took 1.2 GiB before its error (a
    # review); a longer one would end the worker. It is now that row's DataError, read
    # through without being kept, and the rows after it still read
    from msd_dask.formats import jsonl

    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", 100)
    # (exactly: a line of 100 bytes and its break is taken, one of 101 is not)
    edge = _jsonl_file(tmp_path, compress(b'{"text": "a"}\n{"text": "' + b"y" * 88 + b'"}\n'
                                          + b'{"text": "' + b"z" * 89 + b'"}\n'), "edge" + name)
    got = list(JSONL.read(LOCAL, Unit(edge), ["text"], errors="yield"))
    assert got[1][1] == {"text": "y" * 88} and isinstance(got[2][1], DataError)
    big = json.dumps({"text": "x" * 300}).encode()
    content = b'{"text": "a"}\n' + big + b'\n{"text": "b"}'
    path = _jsonl_file(tmp_path, compress(content), name)
    rows = list(JSONL.read(LOCAL, Unit(path), ["text"], errors="yield"))
    assert [r for r, _ in rows] == [0, 1, 2]
    assert rows[0][1] == {"text": "a"} and rows[2][1] == {"text": "b"}
    bad = rows[1][1]
    assert isinstance(bad, DataError) and bad.row == 1
    assert f"line of {len(big) + 1} bytes: longer than 100" in str(bad)
    with pytest.raises(DataError, match=r"row 1: line of \d+ bytes: longer than 100"):
        list(JSONL.read(LOCAL, Unit(path), ["text"]))


class _RangeFile(fsspec.spec.AbstractBufferedFile):
    """A file of an object store: each fetch is a ranged GET, recorded by its filesystem."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        self.fs.fetched.append((start, end))
        return self.fs.data[start:end]


class _RangeFs(fsspec.AbstractFileSystem):
    """One file read as an object store reads it (fsspec's buffered file with a read-ahead
    cache of its default block, s3fs's 50 MiB), recording each ranged fetch."""

    protocol = "rangetest"

    def __init__(self, data: bytes) -> None:
        super().__init__(skip_instance_cache=True)
        self.data, self.fetched = data, []

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        return {"name": path, "size": len(self.data), "type": "file"}

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> _RangeFile:
        block = 50 << 20 if block_size in (None, "default") else block_size
        return _RangeFile(self, path, mode, block_size=block, cache_options=cache_options,
                          **kwargs)


def test_an_object_store_fetches_about_what_a_unit_reads() -> None:
    """On S3 a parquet unit fetched 50 MiB (s3fs's read-ahead block) from its first column
    chunk on, whatever the row group's size, and a JSON-lines or webdataset read held 50 MiB
    per read thread (a review).  A parquet file is opened with a read-ahead of
    ``READ_AHEAD`` (pyarrow reads each column chunk at once); a file read through in blocks
    of ``STREAM_BLOCK``."""
    from msd_dask.formats.jsonl import STREAM_BLOCK
    from msd_dask.formats.parquet import READ_AHEAD

    rng = np.random.default_rng(0)
    texts = [bytes(rng.integers(97, 123, 2000, dtype=np.uint8)).decode() for _ in range(5000)]
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf, row_group_size=500, compression="zstd")
    fs = _RangeFs(buf.getvalue())
    fmt = get_format("parquet")
    units = fmt.units(fs, "f.parquet")
    chunk = pq.ParquetFile(io.BytesIO(fs.data)).metadata.row_group(3).column(0)
    fs.fetched.clear()
    rows = list(fmt.read(fs, units[3], ["text"]))
    assert [r["text"] for _, r in rows] == texts[1500:2000]
    fetched = sum(b - a for a, b in fs.fetched)
    # (the chunk, a read-ahead after it, and what pyarrow looks at around it)
    assert fetched <= chunk.total_compressed_size + 2 * READ_AHEAD, (fetched, chunk)
    # (not vacuous: a store's default block fetched the rest of the file from the chunk on)
    assert len(fs.data) - chunk.data_page_offset > chunk.total_compressed_size + 2 * READ_AHEAD
    # a JSON-lines file is fetched a block at a time: the read (a buffer of 1 MiB) and the
    # STREAM_BLOCK after it
    lines = _RangeFs(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts * 2))
    got = [r["text"] for _, r in get_format("jsonl").read(lines, Unit("f.jsonl", 0, 0), ["text"])]
    assert got == texts * 2 and len(lines.fetched) >= 2
    assert max(b - a for a, b in lines.fetched) <= STREAM_BLOCK + (1 << 20)


def _shard(path: str, members: list[tuple[str, bytes]],
           links: tuple[tuple[str, str, bytes], ...] = ()) -> None:
    """A tar shard of ``members``, then each ``(name, target, type)`` of ``links``."""
    with tarfile.open(path, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for name, target, kind in links:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)


def test_webdataset_a_link_member_makes_its_sample_bad_input(tmp_path: Any) -> None:
    """``tar cf`` over linked files stores links: passed over, a linked image made its
    sample a text document and a sample of links vanished, without a word (a review)."""
    path = str(tmp_path / "links.tar")
    _shard(path, [("s/0.txt", b"zero"), ("s/0.jpg", b"img"), ("s/1.txt", b"one")],
           (("s/1.jpg", "s/0.jpg", tarfile.LNKTYPE), ("s/2.txt", "/elsewhere/blob",
                                                       tarfile.SYMTYPE)))
    rows = list(get_format("webdataset").read(LOCAL, Unit(path), ["text", "image"],
                                              errors="yield"))
    assert [r for r, _ in rows] == [0, 1, 2]
    assert rows[0][1] == {"text": "zero", "image": b"img"}
    for row, kind, target in ((1, "a hard link", "s/0.jpg"),
                              (2, "a symbolic link", "/elsewhere/blob")):
        bad = rows[row][1]
        assert isinstance(bad, DataError) and bad.row == row, bad
        assert f"is {kind} (to {target!r})" in str(bad) and "--hard-dereference" in str(bad)


def test_webdataset_two_tars_joined_are_refused_not_read_as_the_first(tmp_path: Any) -> None:
    """``cat a.tar b.tar``: a tar reader stops at the first one's end, and the second's
    samples were lost without a word (a review)."""
    a, b = str(tmp_path / "a.tar"), str(tmp_path / "b.tar")
    _shard(a, [("s/0.txt", b"zero"), ("s/1.txt", b"one")])
    _shard(b, [("s/2.txt", b"two")])
    joined = tmp_path / "ab.tar"
    joined.write_bytes(open(a, "rb").read() + open(b, "rb").read())
    wds = get_format("webdataset")
    with pytest.raises(DataError, match=r"ab\.tar.*data after the end-of-archive blocks, at "
                                        r"byte \d+: two tars joined"):
        list(wds.read(LOCAL, Unit(str(joined)), ["text"], errors="yield"))
    # (a tar's own padding after its end, any record size, is no data)
    padded = tmp_path / "padded.tar"
    padded.write_bytes(open(a, "rb").read() + bytes(70_000))
    assert [r["text"] for _, r in wds.read(LOCAL, Unit(str(padded)), ["text"])] == ["zero", "one"]


def test_webdataset_a_sample_whose_members_are_apart_refuses_the_shard(tmp_path: Any) -> None:
    """``tar`` over a folder in its directory order puts a sample's members apart: each part
    was a sample of its own, the caption one without its image, without a word (a review).
    The shard is refused whole (a unit is read whole: none of its rows is used)."""
    path = str(tmp_path / "apart.tar")
    _shard(path, [("0001.txt", b"cap one"), ("0002.png", b"p2"), ("0001.png", b"p1"),
                  ("0002.txt", b"cap two")])
    with pytest.raises(DataError, match=r"apart\.tar.*sample '0001' \(row 0\) has members "
                                        r"apart.*'0001\.png'.*--sort=name"):
        list(get_format("webdataset").read(LOCAL, Unit(path), ["text", "image"],
                                           errors="yield"))


def test_webdataset_a_byte_order_mark_is_not_text(tmp_path: Any) -> None:
    """A ``.txt`` kept U+FEFF (3 tokens of junk) and a ``.json`` with one was bad input,
    where the JSON-lines reader takes it (a review)."""
    path = str(tmp_path / "bom.tar")
    _shard(path, [("s/0.txt", "\ufeffa caption".encode()),
                  ("s/1.json", "\ufeff{\"text\": \"from json\"}".encode())])
    rows = list(get_format("webdataset").read(LOCAL, Unit(path), ["text"]))
    assert [r["text"] for _, r in rows] == ["a caption", "from json"]
