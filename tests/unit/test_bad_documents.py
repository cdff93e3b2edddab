"""Documents that broke a unit's read with an error naming nothing (found by a review, each
by running it): each is now one DataError naming the source, file and row, and with
``on_error: skip`` only that document is quarantined."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from msd_dask import ConfigError, DataError, load_config
from msd_dask.sources import documents
from msd_dask.sources.documents import read_unit
from msd_dask.sources.tokenizer import ByteTokenizer

from corpus import source_units

#: a valid JSON string whose text holds a lone surrogate (not encodable as UTF-8)
SURROGATE = b'{"text": "bad \\ud800 doc"}'
#: valid JSON nested deeper than Python's parser recurses
DEEP = b'{"text": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _read(tmp_path: Path, name: str, fmt: str, on_error: str) -> tuple[list, list]:
    cfg = load_config({"name": "bad", "batch": {"seq_len": 64}, "sources": [
        {"name": "s", "uri": str(tmp_path / name), "format": fmt, "on_error": on_error}]})
    src = cfg.sources[0]
    fs, units = source_units(src)
    quarantine: list[DataError] = []
    docs = read_unit(src, fs, units[0], ByteTokenizer(), quarantine)
    return docs, quarantine


@pytest.mark.parametrize("line, reason", [
    (SURROGATE, "field 'text' could not be tokenized: UnicodeEncodeError"),
    (DEEP, "invalid JSON: nested too deep to parse"),
])
def test_a_bad_json_document_names_its_row(tmp_path: Path, line: bytes, reason: str) -> None:
    (tmp_path / "x.jsonl").write_bytes(b'{"text": "fine 0"}\n' + line + b'\n{"text": "fine 2"}\n')
    with pytest.raises(DataError, match=rf"source 's', file '.*x\.jsonl', row 1: {reason}"):
        _read(tmp_path, "x.jsonl", "jsonl", "fail")
    docs, quarantine = _read(tmp_path, "x.jsonl", "jsonl", "skip")
    assert [len(d) for d in docs] == [7, 0, 7]  # ("fine 0" and its end-of-document token)
    assert len(quarantine) == 1 and quarantine[0].row == 1 and reason in str(quarantine[0])


def test_a_parquet_value_that_is_not_utf8_names_its_row(tmp_path: Path) -> None:
    """Arrow does not check UTF-8 when it reads a string column: one bad value used to fail
    the row group with a bare UnicodeDecodeError, even with ``on_error: skip``."""
    good = pa.array(["fine 0", "fine 1", "fine 2"], type=pa.string())
    raw = pa.array([b"fine 0", b"bad \xff", b"fine 2"], type=pa.binary())
    bad = pa.StringArray.from_buffers(3, raw.buffers()[1], raw.buffers()[2])  # unchecked
    assert good.type == bad.type
    pq.write_table(pa.table({"text": bad}), tmp_path / "x.parquet")
    with pytest.raises(DataError, match=r"file '.*x\.parquet', row 1: field 'text' is not "
                       r"valid UTF-8"):
        _read(tmp_path, "x.parquet", "parquet", "fail")
    docs, quarantine = _read(tmp_path, "x.parquet", "parquet", "skip")
    assert [len(d) for d in docs] == [7, 0, 7]
    assert [q.row for q in quarantine] == [1]


def test_a_byte_order_mark_a_binary_text_starts_with_is_not_text(tmp_path: Path) -> None:
    # a .txt member's was dropped, a binary column's (or a .caption member's) tokenized as
    # 3 tokens of junk (a review); one inside the text is kept
    raw = pa.array(["\ufeffa caption".encode(), "mid\ufeff".encode()], type=pa.binary())
    pq.write_table(pa.table({"text": raw}), tmp_path / "x.parquet")
    docs, quarantine = _read(tmp_path, "x.parquet", "parquet", "fail")
    assert [ByteTokenizer().decode(d) for d in docs] == ["a caption", "mid\ufeff"]


def test_good_documents_read_as_before(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl").write_text("\n".join(json.dumps({"text": t})
                                                for t in ("a", "bc", "déf")) + "\n")
    docs, quarantine = _read(tmp_path, "x.jsonl", "jsonl", "fail")
    assert [ByteTokenizer().decode(d) for d in docs] == ["a", "bc", "déf"] and not quarantine


@pytest.mark.parametrize("line", [b'{"text": 5}', SURROGATE])
def test_a_document_error_pickles_as_dask_sends_it(tmp_path: Path, line: bytes) -> None:
    """An error the row's processing already names was re-raised as its own cause
    (``raise e from e``): Dask's pickling of it (tblib follows ``__cause__``) recursed
    without end, so from a loader on another worker than the planner the error never
    arrived and the readers waited out the config's ``timeout`` instead (review)."""
    from distributed.protocol import pickle as dask_pickle

    (tmp_path / "x.jsonl").write_bytes(b'{"text": "fine 0"}\n' + line + b"\n")
    with pytest.raises(DataError) as info:
        _read(tmp_path, "x.jsonl", "jsonl", "fail")
    err = info.value
    assert err.__cause__ is not err
    again = dask_pickle.loads(dask_pickle.dumps(err))
    assert (type(again), str(again), again.source, again.row) == (DataError, str(err), "s", 1)


class _FlakyFS(LocalFileSystem):
    """A local filesystem whose first ``fails`` opens time out, as an object store's
    connection may for a moment."""

    def __init__(self, fails: int, error: Callable[[], BaseException] | type[OSError] = TimeoutError,
                 ) -> None:
        super().__init__()
        self.fails, self.error, self.opens = fails, error, 0

    def _open(self, path: str, *args: Any, **kwargs: Any) -> Any:
        self.opens += 1
        if self.opens <= self.fails:
            error = self.error
            if isinstance(error, type) and issubclass(error, OSError):
                raise error("read timed out (a store's blip)")
            raise error()
        return super()._open(path, *args, **kwargs)


def _two_documents(tmp_path: Path, on_error: str,
                   monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """A source of one JSON-lines file of two documents (3 and 4 tokens with their ends) and
    its one unit; blips waited for 10 ms."""
    monkeypatch.setattr(documents, "BLIP_RETRIES", (0.01, 0.01))
    (tmp_path / "f.jsonl").write_text('{"text": "ab"}\n{"text": "cde"}\n')
    src = load_config({"name": "bad", "batch": {"seq_len": 64}, "sources": [
        {"name": "s", "uri": str(tmp_path / "f.jsonl"), "format": "jsonl",
         "on_error": on_error}]}).sources[0]
    return src, source_units(src)[1][0]


def _store_errors() -> dict[str, Callable[[], BaseException]]:
    """What an object store raises once its own retries give up: s3fs's botocore and aiohttp
    errors (no built-in ``ConnectionError``), and a 503 ``SlowDown`` (s3fs's ``EBUSY``)."""
    import errno

    import aiohttp
    import botocore.exceptions as boto

    return {"EndpointConnectionError": lambda: boto.EndpointConnectionError(endpoint_url="s3://b/f"),
            "ResponseStreamingError": lambda: boto.ResponseStreamingError(error="broken"),
            "ClientPayloadError": lambda: aiohttp.ClientPayloadError("payload not completed"),
            "SlowDown": lambda: OSError(errno.EBUSY, "SlowDown")}


@pytest.mark.parametrize("on_error", ["fail", "skip"])
@pytest.mark.parametrize("kind", ["EndpointConnectionError", "ResponseStreamingError",
                                  "ClientPayloadError", "SlowDown"])
def test_an_object_stores_blip_is_read_again_and_one_that_lasts_is_the_files(
        tmp_path: Path, on_error: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On S3 a dropped connection or a busy store surfaces as botocore's or aiohttp's errors,
    none a built-in ``ConnectionError``: never read again, and under ``on_error: skip`` it
    escaped the quarantine and stopped the service (a review).  Read again now; one that
    lasts is the file's: refused naming it under ``fail``, quarantined under ``skip``."""
    src, unit = _two_documents(tmp_path, on_error, monkeypatch)
    error = _store_errors()[kind]
    fs = _FlakyFS(2, error)
    quarantine: list[DataError] = []
    assert [len(d) for d in read_unit(src, fs, unit, ByteTokenizer(), quarantine)] == [3, 4]
    assert quarantine == [] and fs.opens == 3
    lasting = _FlakyFS(100, error)
    if on_error == "fail":
        with pytest.raises(DataError, match=r"source 's', file '.*f\.jsonl': cannot read it: "
                                            r"the storage failed 3 times"):
            read_unit(src, lasting, unit, ByteTokenizer(), quarantine)
    else:
        assert read_unit(src, lasting, unit, ByteTokenizer(), quarantine) == []
        assert len(quarantine) == 1 and "the storage failed 3 times" in str(quarantine[0])
    assert lasting.opens == 3


@pytest.mark.parametrize("on_error", ["fail", "skip"])
@pytest.mark.parametrize("fails", [1, 2])
def test_a_storage_blip_is_read_again_not_bad_input(tmp_path: Path, on_error: str, fails: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # a storage error that passed in a moment stopped the service (fail) or quarantined the
    # whole unit for the epoch (skip), although the next read of it succeeded
    src, unit = _two_documents(tmp_path, on_error, monkeypatch)
    fs = _FlakyFS(fails)
    quarantine: list[DataError] = []
    docs = read_unit(src, fs, unit, ByteTokenizer(), quarantine)
    assert [len(d) for d in docs] == [3, 4] and quarantine == []
    assert fs.opens > fails  # (read again after each)


@pytest.mark.parametrize("error", [TimeoutError, FileNotFoundError])
def test_a_storage_failure_that_lasts_is_the_files(tmp_path: Path, error: type[OSError],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(documents, "BLIP_RETRIES", (0.01, 0.01))
    (tmp_path / "f.jsonl").write_text('{"text": "ab"}\n')
    cfg = {"name": "bad", "batch": {"seq_len": 64}, "sources": [
        {"name": "s", "uri": str(tmp_path / "f.jsonl"), "format": "jsonl"}]}
    src = load_config(cfg).sources[0]
    unit = source_units(src)[1][0]
    fs = _FlakyFS(100, error)
    said = ("cannot read it: the storage failed 3 times" if error is TimeoutError
            else f"cannot read: {error.__name__}")
    with pytest.raises(DataError, match=rf"source 's', file '.*f\.jsonl': {said}"):
        read_unit(src, fs, unit, ByteTokenizer())
    assert fs.opens == (3 if error is TimeoutError else 1)  # (a missing file is no blip)
    quarantine: list[DataError] = []
    skip = dataclasses.replace(src, on_error="skip")
    assert read_unit(skip, _FlakyFS(100, error), unit, ByteTokenizer(), quarantine) == []
    assert len(quarantine) == 1 and quarantine[0].row is None


def test_a_bad_line_of_the_example_format_loses_that_line_alone(tmp_path: Path) -> None:
    """The example format of your own (``TextLinesFormat``) ended the file at a line that
    was not UTF-8: under ``on_error: skip`` the whole file was set aside, every good line of
    it lost, where a JSON-lines file loses the bad line alone (a review of bad input).  Its
    ``read`` takes ``errors="yield"``, as the built-in formats' do."""
    (tmp_path / "x.txt").write_bytes(b"fine 0\nbad \xff\nfine 2\n")
    fmt = "msd_dask.examples.text_lines:TextLinesFormat"
    with pytest.raises(DataError, match=r"source 's', file '.*x\.txt', row 1: invalid UTF-8"):
        _read(tmp_path, "x.txt", fmt, "fail")
    docs, quarantine = _read(tmp_path, "x.txt", fmt, "skip")
    assert [ByteTokenizer().decode(d) for d in docs] == ["fine 0", "", "fine 2"]
    assert [q.row for q in quarantine] == [1]


#: a format of the user's whose listing raises what it raises (no DataError)
_LISTS_BADLY = '''
from msd_dask.core.units import Unit
from msd_dask.examples.text_lines import TextLinesFormat

class Indexed(TextLinesFormat):
    def units(self, fs, path):
        if path.endswith("b.txt"):
            return {}["rows"]  # (a header it could not parse, say)
        return [Unit(path, 0, 0)]
'''


def test_a_users_format_that_raises_while_listing_names_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A format of your own whose ``units()`` raised anything but a DataError or OSError
    stopped the start with that bare error (a KeyError's traceback, exit 1 from the CLI),
    naming no source or file, and ``on_error: skip`` did not set the file aside (a review of
    bad input): the listing names the source and the file, as a read does."""
    from msd_dask.sources.check import check_fields
    from msd_dask.sources.discover import discover_units

    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "lists_badly.py").write_text(_LISTS_BADLY)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    (tmp_path / "data").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "data" / name).write_text("one\ntwo\n")

    def cfg(on_error: str, pattern: str = "*.txt") -> Any:
        return load_config({"name": "own", "batch": {"seq_len": 64}, "sources": [
            {"name": "s", "uri": str(tmp_path / "data" / pattern),
             "format": "lists_badly:Indexed", "on_error": on_error}]})

    says = r"source 's', file '.*b\.txt': cannot read: KeyError\('rows'\)"
    with pytest.raises(DataError, match=says):
        discover_units(cfg("fail"))
    with pytest.raises(DataError, match=says):  # (msd-dask validate reads the first file)
        check_fields(cfg("fail", "b.txt"))
    quarantined: dict[str, list[str]] = {}
    units, _ = discover_units(cfg("skip"), quarantined=quarantined)
    assert [u[0].rsplit("/", 1)[1] for u in units["s"]] == ["a.txt"]
    assert len(quarantined["s"]) == 1 and "b.txt" in quarantined["s"][0]


class _BlipsFS(MemoryFileSystem):
    """An in-memory store whose file opens fail for a moment: ``fails[path]`` opens of
    ``path`` raise ConnectionError (a dropped connection), the later ones succeed."""

    protocol = "msd-test-blips"
    store: dict[str, Any] = {}
    pseudo_dirs = [""]
    fails: dict[str, int] = {}
    #: globs that fail before one succeeds (a listing's request dropped)
    glob_fails = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return MemoryFileSystem._strip_protocol(path.removeprefix(f"{cls.protocol}://"))

    def glob(self, path: str, **kwargs: Any) -> Any:
        if type(self).glob_fails > 0:
            type(self).glob_fails -= 1
            raise ConnectionError(f"connection reset while listing {path}")
        return super().glob(path, **kwargs)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode and self.fails.get(path, 0) > 0:
            self.fails[path] -= 1
            raise ConnectionError(f"connection reset while opening {path}")
        return super()._open(path, mode, **kwargs)


@pytest.fixture
def blips(monkeypatch: pytest.MonkeyPatch) -> type[_BlipsFS]:
    """:class:`_BlipsFS`, empty, with a parquet file ``/d/a.parquet`` and ``/d/b.parquet``
    of two row groups each, and blips waited for 10 ms."""
    import io

    import fsspec

    monkeypatch.setattr(documents, "BLIP_RETRIES", (0.01, 0.01))
    monkeypatch.setattr(_BlipsFS, "store", {})
    monkeypatch.setattr(_BlipsFS, "fails", {})
    monkeypatch.setattr(_BlipsFS, "glob_fails", 0)
    fsspec.register_implementation(_BlipsFS.protocol, _BlipsFS, clobber=True)
    fs = _BlipsFS()
    for name in ("a", "b"):
        buf = io.BytesIO()
        pq.write_table(pa.table({"text": [f"{name}{i}" for i in range(4)]}), buf,
                       row_group_size=2)
        fs.pipe(f"/d/{name}.parquet", buf.getvalue())
    return _BlipsFS


@pytest.mark.parametrize("on_error", ["fail", "skip"])
@pytest.mark.parametrize("fails", [1, 2, 3])
def test_a_storage_blip_while_listing_a_file_is_listed_again(
        blips: type[_BlipsFS], on_error: str, fails: int) -> None:
    """A file whose storage failed for a moment when the service listed its units (its
    parquet footer) was quarantined for the whole run (``skip``) or refused the start
    (``fail``), and ``msd-dask validate`` set it aside or failed (a review): the listing
    and the first record are read again as a unit is (``BLIP_RETRIES``), and only the
    third failure is the file's."""
    from msd_dask.sources.check import check_fields
    from msd_dask.sources.discover import discover_units

    cfg = load_config({"name": "b", "batch": {"seq_len": 64}, "sources": [
        {"name": "s", "uri": f"{blips.protocol}://d/*.parquet", "format": "parquet",
         "on_error": on_error}]})
    says = (r"source 's', file '/d/a\.parquet': cannot read it: the storage failed 3 times "
            r"\(ConnectionError")
    blips.fails["/d/a.parquet"] = fails
    quarantined: dict[str, list[str]] = {}
    if fails == 3 and on_error == "fail":
        with pytest.raises(DataError, match=says):
            discover_units(cfg, quarantined=quarantined)
    else:
        units, _ = discover_units(cfg, quarantined=quarantined)
        listed = sorted({path for path, _, _ in units["s"]})
        if fails == 3:  # (the third failure: the file's, set aside under skip)
            assert listed == ["/d/b.parquet"] and len(quarantined["s"]) == 1
            assert re.match(says, quarantined["s"][0]), quarantined
        else:
            assert listed == ["/d/a.parquet", "/d/b.parquet"] and quarantined == {}
    blips.fails["/d/a.parquet"] = fails
    if fails == 3 and on_error == "fail":
        with pytest.raises(DataError, match=says):
            check_fields(cfg)
        return
    (first,) = check_fields(cfg)
    if fails == 3:
        assert first.path == "/d/b.parquet" and len(first.set_aside) == 1
    else:
        assert (first.path, first.found, first.set_aside) == ("/d/a.parquet", True, [])


@pytest.mark.parametrize("fails", [1, 2, 3])
def test_a_storage_blip_while_listing_a_source_is_listed_again(
        blips: type[_BlipsFS], fails: int) -> None:
    """A source's glob whose listing failed for a moment (a dropped request) failed the
    service's start, and ``msd-dask validate``, with the storage's bare error (a review):
    it is listed again as a file's units are, and the third failure is one error naming
    the source and its glob."""
    from msd_dask.sources.check import check_fields
    from msd_dask.sources.discover import discover_units

    uri = f"{blips.protocol}://d/*.parquet"
    cfg = load_config({"name": "b", "batch": {"seq_len": 64}, "sources": [
        {"name": "s", "uri": uri, "format": "parquet"}]})
    blips.glob_fails = fails
    if fails == 3:
        with pytest.raises(DataError, match=rf"source 's': cannot list '{re.escape(uri)}': "
                                            r"ConnectionError"):
            discover_units(cfg)
    else:
        units, _ = discover_units(cfg)
        assert sorted({path for path, _, _ in units["s"]}) == ["/d/a.parquet", "/d/b.parquet"]
    assert blips.glob_fails == 0
    blips.glob_fails = fails
    if fails == 3:
        with pytest.raises(ConfigError, match=r"sources\[0\]\.uri.*cannot list.*connection reset"):
            check_fields(cfg)
        return
    (first,) = check_fields(cfg)
    assert (first.path, first.found) == ("/d/a.parquet", True)


def _skip_source(tmp_path: Path, pattern: str = "*.jsonl*", text_field: str = "text",
                 on_error: str = "skip") -> Any:
    return load_config({"name": "v", "batch": {"seq_len": 64}, "sources": [
        {"name": "s", "uri": str(tmp_path / pattern), "format": "jsonl",
         "text_field": text_field, "on_error": on_error}]})


def test_validate_under_skip_passes_over_a_bad_row_not_its_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``msd-dask validate`` (check_fields) read a source's first record with errors raised:
    under ``on_error: skip`` a first line cut off set its whole file aside, where the
    service quarantines that row alone and reads the rest (a review).  The row is now
    noted as skipped, named by its row, and the file's first good record is read; a
    file that cannot be read at all is still set aside."""
    from msd_dask.sources.check import check_fields

    (tmp_path / "a.jsonl").write_text('{"text": "cut off\n{"text": "good 1"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "good"}\n')
    (first,) = check_fields(_skip_source(tmp_path))
    assert (first.path, first.found, first.set_aside) == (str(tmp_path / "a.jsonl"), True, [])
    assert [(e.source, e.path, e.row) for e in first.skipped] == [
        ("s", str(tmp_path / "a.jsonl"), 0)]
    # (validate warns of it)
    from msd_dask.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(f"name: v\nbatch: {{seq_len: 8}}\nsources:\n  - {{name: s, uri: "
                      f"'{tmp_path}/*.jsonl', format: jsonl, on_error: skip}}\n")
    assert main(["validate", str(config)]) == 0
    assert re.search(r"warning: row skipped \(on_error: skip\): source 's', file "
                     r"'.*a\.jsonl', row 0: invalid JSON", capsys.readouterr().out)
    # (the service reads the file so: the row quarantined alone)
    src = _skip_source(tmp_path, "a.jsonl").sources[0]
    fs, units = source_units(src)
    quarantine: list[DataError] = []
    assert [len(d) for d in read_unit(src, fs, units[0], ByteTokenizer(), quarantine)] == [0, 7]
    assert [q.row for q in quarantine] == [0]

    # a corrupt file is the file's: set aside, the next file read
    (tmp_path / "0.jsonl.gz").write_bytes(b"not gzip\n")
    (first,) = check_fields(_skip_source(tmp_path))
    assert first.path == str(tmp_path / "a.jsonl") and len(first.skipped) == 1
    assert [(e.path, e.row) for e in first.set_aside] == [(str(tmp_path / "0.jsonl.gz"), None)]
    assert "corrupt gzip stream" in str(first.set_aside[0])

    # a misspelt field makes every row bad: still an error naming the row
    with pytest.raises(DataError, match=r"source 's', file '.*b\.jsonl', row 0: missing "
                                        r"field 'txt' \(the line's keys: text\)"):
        check_fields(_skip_source(tmp_path, "b.jsonl", text_field="txt"))
    # (nor is a file read to its end for its first record: SKIP_ROWS bad rows are all bad)
    from msd_dask.sources.check import SKIP_ROWS

    (tmp_path / "c.jsonl").write_text("not json\n" * SKIP_ROWS + '{"text": "late"}\n')
    with pytest.raises(DataError, match=r"file '.*c\.jsonl', row 0: invalid JSON"):
        check_fields(_skip_source(tmp_path, "c.jsonl"))
    # under fail, the first bad row stands, as the service stops on it
    with pytest.raises(DataError, match=r"file '.*a\.jsonl', row 0: invalid JSON"):
        check_fields(_skip_source(tmp_path, "a.jsonl", on_error="fail"))


def test_what_is_a_storage_blip() -> None:
    """A missing or refused file over HTTP (fsspec raises ``FileNotFoundError`` from the
    client's 404 or 403) was read three times and called "the storage failed"; a bug raised
    while handling a dropped connection was read again and quarantined; a certificate
    error would have been too (a read-back).  Only explicit causes are followed, and a
    missing or refused file, bad input, an answer below 500 (but 429), a certificate or a
    URL are no blip."""
    import aiohttp
    import botocore.exceptions as boto

    from msd_dask.errors import storage_blip

    def answer(status: int) -> aiohttp.ClientResponseError:
        return aiohttp.ClientResponseError(request_info=None, history=(),  # type: ignore[arg-type]
                                           status=status, message="")

    def raised(error: BaseException, cause: BaseException | None = None,
               handling: BaseException | None = None) -> BaseException:
        try:
            try:
                if handling is not None:
                    raise handling
            except BaseException:  # noqa: BLE001 - the error raised while handling it
                raise error from cause  # noqa: B904 - (cause None: only the context)
            raise error from cause
        except BaseException as e:  # noqa: BLE001 - what the rule looks at
            return e

    for status, blip in ((503, True), (500, True), (429, True), (404, False), (403, False)):
        assert storage_blip(raised(OSError("read failed"), answer(status))) is blip, status
        assert storage_blip(answer(status)) is blip, status
    assert not storage_blip(raised(FileNotFoundError("x"), answer(503)))
    assert not storage_blip(raised(PermissionError("x"), ConnectionResetError()))
    assert not storage_blip(raised(DataError("bad row"), ConnectionResetError()))
    assert not storage_blip(raised(AttributeError("a bug"), handling=ConnectionResetError()))
    assert storage_blip(raised(RuntimeError("wrapped"), ConnectionResetError()))
    assert not storage_blip(aiohttp.ClientSSLError(None, OSError("cert")))  # type: ignore[arg-type]
    assert not storage_blip(boto.SSLError(endpoint_url="https://s3", error="cert"))
    assert storage_blip(boto.EndpointConnectionError(endpoint_url="https://s3"))
