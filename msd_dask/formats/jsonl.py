"""JSON-lines reader: plain, gzip (``.gz``), zstandard (``.zst``, ``.zstd``), bzip2 (``.bz2``)
or xz (``.xz``) files.

A file is one unit; it is decompressed and parsed as a stream, one line at a time.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import io
import json
import lzma
import zlib
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import ExitStack, closing
from typing import IO, Any, Protocol

import fsspec
import zstandard

from msd_dask.core.units import Unit
from msd_dask.errors import DataError
from msd_dask.formats.registry import register_format

__all__ = ["MAX_LINE_BYTES", "STREAM_BLOCK", "JsonlFormat", "LineTooLong", "compression_in", "compression_of",
           "file_lines"]

_BUFFER_SIZE = 1 << 20
#: bytes an object store fetches at a time for a file read from its start to its end (a
#: JSON-lines file, a webdataset shard): its own default was s3fs's 50 MiB, held by each
#: read thread (a review)
STREAM_BLOCK = 8 << 20


def compression_of(path: str) -> str | None:
    """The compression a JSON-lines file uses, from its suffix.

    Parameters
    ----------
    path : str
        File name or path.

    Returns
    -------
    str or None
        ``"gzip"`` for ``.gz``, ``"zstd"`` for ``.zst``/``.zstd``, ``"bzip2"`` for
        ``.bz2``, ``"xz"`` for ``.xz``, ``None`` otherwise.
    """
    lower = path.lower()
    return next((kind for suffix, kind in _COMPRESSIONS.items() if lower.endswith(suffix)),
                None)


#: each compressed file's suffix, and its compression (:func:`compression_of`)
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bzip2", ".xz": "xz"}

#: the first bytes of each compression's stream (bzip2's with its first block's magic: a
#: line of text may start with "BZh"); none starts a line of UTF-8 JSON
_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"\xfd7zXZ\x00": "xz"}
_BZIP2 = (b"BZh", b"1AY&SY")
#: the last three bytes of a zstd skippable frame's magic (its first is 0x50 to 0x5F), which
#: starts a file of pzstd's or of the seekable format (a review)
_SKIPPABLE = b"\x2a\x4d\x18"


def compression_in(head: bytes) -> str | None:
    """The compression whose stream starts with ``head`` (a file's first 10 bytes or more),
    if any: a compressed file named as a plain one is refused whole, not read as lines of
    binary (each one a bad row).

    Parameters
    ----------
    head : bytes
        The file's first bytes.

    Returns
    -------
    str or None
        ``"gzip"``, ``"zstd"``, ``"bzip2"`` or ``"xz"`` (as :func:`compression_of`), or
        ``None``.
    """
    if head[:3] == _BZIP2[0] and head[3:4] in b"123456789" and head[4:10] == _BZIP2[1]:
        return "bzip2"
    if head[:1] and 0x50 <= head[0] <= 0x5F and head[1:4] == _SKIPPABLE:
        return "zstd"
    return next((name for magic, name in _MAGIC.items() if head.startswith(magic)), None)


class _LineReader(Protocol):
    def readline(self, size: int = -1, /) -> bytes: ...


class LineTooLong(bytes):
    """What :func:`file_lines` yields, empty, in place of a line longer than its
    ``max_bytes``; ``size``: the line's bytes."""

    size: int = 0


#: the longest line the JSON-lines reader takes: a longer one is that row's bad input (a
#: 400 MiB line took 1.2 GiB to refuse for not being an object; a few GiB would have ended
#: the worker, and its re-created loader would read the same file again)
MAX_LINE_BYTES = 256 * 2**20


def file_lines(fs: fsspec.AbstractFileSystem, path: str,
               max_bytes: int | None = None) -> Generator[bytes, None, None]:
    """Each line of file ``path`` (bytes, with its line break), decompressed as its name says
    (:func:`compression_of`; a file of several compressed streams read whole), without the
    UTF-8 byte-order mark that may start it.  The JSON-lines reader's lines, for a format
    of your own to reuse (``msd_dask.examples.text_lines``).

    The file is read a buffer at a time, and closed when the lines end or the iterator is
    closed.  With ``max_bytes``, a longer line is read through without being kept and
    yields a :class:`LineTooLong` (empty) in its place.

    Raises
    ------
    DataError
        A compressed stream that is corrupt or cut off (naming the file).
    """
    compression = compression_of(path)
    with ExitStack() as stack:
        raw = stack.enter_context(fs.open(path, "rb", block_size=STREAM_BLOCK))
        lines = _open_lines(stack, raw, compression)
        if compression is None and isinstance(lines, io.BufferedReader):
            packed = compression_in(lines.peek(10)[:10])
            if packed is not None:  # (read as lines, each a bad row: under skip, thousands)
                suffix = next(k for k, v in _COMPRESSIONS.items() if v == packed)
                raise DataError(f"the file is {packed}-compressed but its name does not end "
                                f"in {suffix}: rename it so that it is read decompressed",
                                path=path)
        first = True
        while True:
            # (one byte past the longest line taken, and the first line's byte-order mark)
            limit = -1 if max_bytes is None else max_bytes + 1 + (
                len(codecs.BOM_UTF8) if first else 0)
            try:
                line = lines.readline(limit)
                if limit > 0 and len(line) == limit and not line.endswith(b"\n"):
                    size = len(line)
                    while line and not line.endswith(b"\n"):  # (the rest of it, not kept)
                        line = lines.readline(limit)
                        size += len(line)
                    too_long = LineTooLong()
                    too_long.size = size
                    first = False
                    yield too_long
                    continue
            except _Unsupported as exc:
                raise DataError(str(exc), path=path) from exc
            except (_Corrupt, gzip.BadGzipFile, zlib.error, EOFError) as exc:
                raise DataError(f"corrupt {compression} stream: {exc}", path=path) from exc
            if not line:
                return
            if first and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8):]
            first = False
            yield line


def _open_lines(stack: ExitStack, raw: IO[bytes], compression: str | None) -> _LineReader:
    """A binary stream of the decompressed content of ``raw``, read line by line."""
    if compression == "gzip":
        return stack.enter_context(gzip.GzipFile(fileobj=raw, mode="rb"))
    if compression is not None:
        # BufferedReader gives readline() over the reader's readinto().
        return stack.enter_context(io.BufferedReader(_Streams(raw, compression), _BUFFER_SIZE))
    # Not fsspec's own readline(): it reads a whole block (STREAM_BLOCK) per line.
    return stack.enter_context(io.BufferedReader(raw, _BUFFER_SIZE))  # type: ignore[type-var]


class _Corrupt(Exception):
    """A compressed stream that does not decompress: bad data, or cut off."""


class _Unsupported(Exception):
    """A compressed stream that is sound but asks for more than the reader allows."""


#: what zstd says of a frame whose window is past the decoder's limit (2**27 bytes,
#: zstandard's default): ``zstd --long=28`` or more writes such frames
_ZSTD_WINDOW = "Frame requires too much memory for decoding"


#: a new decompressor (``decompress``, ``eof``, ``unused_data``) for each compression that
#: :class:`_Streams` reads
_DECOMPRESSORS: dict[str, Callable[[], Any]] = {
    "zstd": lambda: zstandard.ZstdDecompressor().decompressobj(),
    "bzip2": bz2.BZ2Decompressor,
    "xz": lzma.LZMADecompressor,
}


#: the compressed bytes a zstd decompressor is given at first: it has no limit on what one
#: call returns, so each call is given a slice of the input sized by the ratio seen so far,
#: for about :data:`_BUFFER_SIZE` bytes out (between these bounds)
_ZSTD_SLICE = (256, _BUFFER_SIZE)


class _Streams(io.RawIOBase):
    """Decompressed content of a file of compressed streams one after the other (zstd
    frames, bzip2 or xz streams, as parallel compressors write them; xz's NUL padding
    between and after streams is skipped); a truncated last stream is an error.

    (zstandard's ``stream_reader`` ends silently at a truncated frame, which would
    drop the rest of a cut-off file without a word; ``bz2.BZ2File`` reports bad data
    as a bare ``OSError``, which reads like a failed read of the storage.)  Only the
    decompressors' errors become :class:`_Corrupt`; the storage's own errors pass.
    Memory stays bounded whatever the compression ratio: bzip2 and xz return at most
    :data:`_BUFFER_SIZE` bytes a call, zstd is given slices of the input sized for about
    as much (:data:`_ZSTD_SLICE`).
    """

    def __init__(self, raw: IO[bytes], compression: str):
        self._raw = raw
        self._new = _DECOMPRESSORS[compression]
        #: its decompressors take ``max_length`` (and keep the input they did not use)
        self._limited = compression != "zstd"
        self._padded = compression == "xz"
        self._obj: Any = None
        self._slice = _ZSTD_SLICE[0]
        self._in = b""  # compressed bytes no decompressor was given yet
        self._out = b""
        self._pos = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while self._pos >= len(self._out):
            out = self._next_output()
            if out is None:
                return 0
            self._out, self._pos = out, 0
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n

    def _next_output(self) -> bytes | None:
        """The next piece of the decompressed content, ``None`` at its end."""
        while True:
            obj = self._obj
            if obj is not None and not obj.eof and self._limited and not obj.needs_input:
                data = b""  # it holds input it has not decompressed yet
            else:
                if not self._in:
                    self._in = self._raw.read(_BUFFER_SIZE)
                    if not self._in:
                        if obj is not None and not obj.eof:
                            raise _Corrupt("truncated stream: the last frame is incomplete")
                        return None
                if obj is None or obj.eof:
                    if obj is not None and self._padded:
                        self._in = self._in.lstrip(b"\0")
                        if not self._in:
                            continue
                    self._obj = obj = self._new()
                cut = len(self._in) if self._limited else self._slice
                data, self._in = self._in[:cut], self._in[cut:]
            try:
                out = obj.decompress(data, _BUFFER_SIZE) if self._limited else obj.decompress(data)
            except (OSError, EOFError, lzma.LZMAError, zstandard.ZstdError) as e:
                if isinstance(e, zstandard.ZstdError) and _ZSTD_WINDOW in str(e):
                    # (sound data: "corrupt" sent users looking for a bad download)
                    raise _Unsupported(
                        "a zstd frame asks for a window over 128 MiB (written with `zstd "
                        "--long=28` or more), past what each read may hold: recompress with "
                        "`zstd --long=27` or less (or without --long)") from e
                raise _Corrupt(str(e)) from e
            if not self._limited:  # the next slice: about _BUFFER_SIZE out
                lo, hi = _ZSTD_SLICE
                # (nothing out: a block is not complete yet, give it more)
                want = len(data) * _BUFFER_SIZE // len(out) if out else 2 * self._slice
                self._slice = max(lo, min(hi, want))
            if obj.eof:
                self._in = obj.unused_data + self._in
            if out:
                return out


#: the names of JSON-lines files, plain or compressed (:func:`compression_of`); ``.json``
#: only compressed, as some corpora name theirs (C4's ``.json.gz``): a plain ``.json`` in a
#: folder is more often its metadata (``dataset_info.json``)
_SUFFIXES = (*(name + packed for name in (".jsonl", ".ndjson") for packed in ("", *_COMPRESSIONS)),
             *(".json" + packed for packed in _COMPRESSIONS))


class JsonlFormat:
    """JSON lines: one JSON object per line; blank lines are skipped.

    Rows are 0-based line indices in the (decompressed) file, blank lines included, so a
    row's index is its line number whether or not blank lines precede it.

    Attributes
    ----------
    suffixes : tuple of str
        The names a source whose ``uri`` is a folder reads (case-insensitive):
        ``.jsonl`` and ``.ndjson``, each plain, ``.gz``, ``.zst``, ``.zstd``, ``.bz2`` or
        ``.xz``, and ``.json`` compressed so (a plain ``.json`` beside the data is most
        often metadata: name JSON-lines files so with a glob).
    """

    name = "jsonl"
    suffixes = _SUFFIXES

    def units(self, fs: fsspec.AbstractFileSystem, path: str) -> list[Unit]:
        """The whole file as a single unit.

        Parameters
        ----------
        fs : fsspec.AbstractFileSystem
            Filesystem holding the file (unused: the file is not opened).
        path : str
            The file, as ``fs`` names it.

        Returns
        -------
        list of Unit
            ``[Unit(path, 0, 0)]``.
        """
        return [Unit(path, 0, 0)]

    def read(self, fs: fsspec.AbstractFileSystem, unit: Unit,
             fields: Sequence[str], errors: str = "raise") -> Iterator[tuple[int, Any]]:
        """Yield ``(line_index, record)`` for every non-blank line of ``unit.path``.

        Parameters
        ----------
        fs : fsspec.AbstractFileSystem
            Filesystem holding ``unit.path``.
        unit : Unit
            The file to read (JSON-lines files have one unit).
        fields : sequence of str
            Keys to return; every record maps exactly these names to values.
        errors : {"raise", "yield"}
            ``"yield"``: a line that cannot be parsed yields ``(row, DataError)``
            instead of ending the iteration (a corrupt stream still raises).

        Yields
        ------
        tuple of (int, dict)
            The line's 0-based index in the file and its requested fields.

        Raises
        ------
        DataError
            For a line that is not valid UTF-8 or JSON, is not an object or lacks a
            field (naming file and row), or a compressed stream that is corrupt (naming
            the file).
        """
        path = unit.path
        with closing(file_lines(fs, path, MAX_LINE_BYTES)) as lines:
            for row, line in enumerate(lines):
                if isinstance(line, LineTooLong):
                    too_long = DataError(f"line of {line.size} bytes: longer than "
                                         f"{MAX_LINE_BYTES} (MAX_LINE_BYTES) bytes", path=path,
                                         row=row)
                    if errors != "yield":
                        raise too_long
                    yield row, too_long
                    continue
                if not line.strip():
                    continue
                try:
                    rec = _parse(line, fields, path, row)
                except DataError as exc:
                    if errors != "yield":
                        raise
                    yield row, exc
                    continue
                yield row, rec


def _parse(line: bytes, fields: Sequence[str], path: str, row: int) -> dict[str, Any]:
    try:
        text = line.decode("utf-8")  # (a byte-order mark starting the file is gone)
    except UnicodeDecodeError as exc:
        raise DataError(f"invalid UTF-8: {exc.reason} at byte {exc.start}",
                        path=path, row=row) from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"invalid JSON: {exc.msg} (column {exc.colno})",
                        path=path, row=row) from None
    except RecursionError:
        raise DataError("invalid JSON: nested too deep to parse", path=path, row=row) from None
    except ValueError as exc:  # an integer of more digits than int() converts, say
        raise DataError(f"invalid JSON: {exc}", path=path, row=row) from None
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}",
                        path=path, row=row)
    try:
        return {f: obj[f] for f in fields}
    except KeyError as exc:
        keys = ", ".join(map(str, list(obj)[:12])) + (", ..." if len(obj) > 12 else "")
        raise DataError(f"missing field '{exc.args[0]}' (the line's keys: {keys or 'none'})",
                        path=path, row=row) from None


register_format(JsonlFormat())
