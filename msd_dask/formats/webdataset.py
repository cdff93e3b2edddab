"""WebDataset-style tar shards: one unit per shard, one row per sample.

A sample is the run of consecutive members sharing a *key*: the member's path
up to the first dot of its file name (``shard/000123.jpg`` and
``shard/000123.txt`` are the sample ``shard/000123``; its fields are named by
the rest, ``jpg`` and ``txt``).  Each sample becomes one record:

* an image (:data:`IMAGE_EXTENSIONS`: ``.jpg``, ``.png``, ``.webp``, ``.gif``, ``.bmp``,
  ``.tiff``, ``.ppm`` and their other names; of several, the first in that order) →
  ``"image"`` (the encoded bytes; also under the extension itself);
* ``.txt`` → ``"text"`` (UTF-8 decoded; also under ``"txt"``);
* ``.json`` → its keys merged into the record (a JSON object; ``.txt`` and the
  image win over keys of the same name);
* any other extension → its bytes under the extension.

Hidden members (a name starting with a dot: macOS's ``._`` files, ``.DS_Store``) and
those under ``__MACOSX/`` belong to no sample and are passed over.  A sample lacking a
field asked for is bad input, save for the image: a sample
without one is a text document (its image field ``None``).  Rows are sample
indices in tar order.  The shard is read as a stream of members, never listed
first; a shard that ends without the tar end-of-archive
block, or with a header that does not parse, is a :class:`DataError`.
"""

from __future__ import annotations

import json
import posixpath
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

import fsspec

from msd_dask.core.units import Unit
from msd_dask.errors import DataError, storage_failure
from msd_dask.formats.jsonl import STREAM_BLOCK, compression_in
from msd_dask.formats.registry import Record, register_format

__all__ = ["WebDatasetFormat", "IMAGE_EXTENSIONS", "split_key"]

#: a sample's members that are its image: every encoding the image decoder reads
#: (:data:`msd_dask.sources.vision.IMAGE_FORMATS`); a sample whose image had another of
#: these was taken for a text document, without a word (a review).  Of a sample with
#: several, the image is the first in this order
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "gif", "bmp", "tif", "tiff", "ppm", "pgm",
                    "pbm", "pnm")

#: the fields a sample's image is under (``image``, and its extension): absent, the
#: sample is a text document (``None``), as a parquet or JSON row whose image is null
_IMAGE_FIELDS = frozenset(("image", *IMAGE_EXTENSIONS))


def split_key(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name: ``"a/b/0001.seg.json"`` → ``("a/b/0001", "seg.json")``."""
    d, base = posixpath.split(name)
    stem, dot, ext = base.partition(".")
    return (posixpath.join(d, stem) if d else stem), ext.lower() if dot else ""


def _record(fields: dict[str, bytes], key: str, path: str, row: int) -> dict[str, Any]:
    """The record of the sample ``key`` (its errors name the key: a row's index alone sent
    the user counting samples through the tar; a review)."""
    rec: dict[str, Any] = {}
    if "json" in fields:
        try:
            # (utf-8-sig: a byte-order mark made the sample bad input, where the JSON-lines
            # reader and WebDataset's own take it; a review)
            obj = json.loads(fields["json"].decode("utf-8-sig"))
        except (ValueError, RecursionError) as exc:  # bad UTF-8, JSON, an int too long
            raise DataError(f"sample {key!r}: invalid .json member: {exc}", path=path,
                            row=row) from None
        if not isinstance(obj, dict):
            raise DataError(f"sample {key!r}: .json member is a {type(obj).__name__}, not "
                            "an object",
                            path=path, row=row)
        # (an image comes from the sample's members only: metadata naming its image, as
        # {"image": "http://.../x.jpg"}, made a sample with no image member bad input, "field
        # 'image' is str", where the docs say it is a text document; a review)
        rec.update((k, v) for k, v in obj.items() if k not in _IMAGE_FIELDS)
    for ext, data in fields.items():
        if ext == "json":
            continue
        rec[ext] = data
        if ext == "txt":
            try:
                # (a byte-order mark is no text: it was tokenized as 3 tokens of junk)
                rec["text"] = rec["txt"] = data.decode("utf-8-sig")
            except UnicodeDecodeError as exc:
                raise DataError(f"sample {key!r}: invalid UTF-8 in .txt member: {exc.reason} at byte "
                                f"{exc.start}", path=path, row=row) from None
    # the sample's image: of several image members (a photo and its depth map as .pgm,
    # say), the first in IMAGE_EXTENSIONS' order, whatever the tar's
    image = next((ext for ext in IMAGE_EXTENSIONS if ext in fields), None)
    if image is not None:
        rec["image"] = fields[image]
    return rec


class WebDatasetFormat:
    """Tar shards of samples (WebDataset layout); a shard is one unit.

    Attributes
    ----------
    suffixes : tuple of str
        The names a source whose ``uri`` is a folder reads (case-insensitive): plain
        tar shards, as WebDataset writes them.
    """

    name = "webdataset"
    suffixes = (".tar",)

    def units(self, fs: fsspec.AbstractFileSystem, path: str) -> list[Unit]:
        """The whole shard as a single unit (the file is not opened)."""
        return [Unit(path, 0, 0)]

    def read(self, fs: fsspec.AbstractFileSystem, unit: Unit, fields: Sequence[str],
             errors: str = "raise") -> Iterator[tuple[int, Any]]:
        """Yield ``(sample_index, record)`` for every sample of the shard.

        Parameters
        ----------
        fs : fsspec.AbstractFileSystem
        unit : Unit
            The shard (webdataset shards have one unit).
        fields : sequence of str
            Keys to return; every record maps exactly these names to values.
        errors : {"raise", "yield"}
            ``"yield"``: a sample whose members cannot be decoded or that lacks a
            field yields ``(row, DataError)``; a corrupt shard still raises.

        Raises
        ------
        DataError
            A sample lacking a field (save its image), a ``.txt`` that is not UTF-8, a ``.json`` that is
            not an object, a member that is a link (naming file and row); a shard that is not
            a tar file, is truncated, has a corrupt header, data after its end (two tars
            joined) or a sample whose members are apart (naming the file).
        """
        path = unit.path
        with fs.open(path, "rb", block_size=STREAM_BLOCK) as f:
            try:
                tar = tarfile.open(fileobj=f, mode="r:")
            except tarfile.TarError as exc:
                f.seek(0)
                packed = compression_in(f.read(10))
                raise DataError(f"cannot read tar: {exc}" + (
                    f" (the shard is {packed}-compressed: shards are read as plain tar "
                    "files, as WebDataset writes them)" if packed else ""), path=path) from None
            with tar:
                row = -1
                key: str | None = None
                sample: dict[str, bytes] = {}
                bad: str | None = None  # why the sample is bad input, if it is
                seen: dict[str, int] = {}  # the samples' keys so far, and each one's row
                members = _members(tar, f, path)
                for name, data in members:
                    if _hidden(name):
                        continue
                    k, ext = split_key(name)
                    if k != key:
                        if key is not None:
                            row += 1
                            yield row, self._select(sample, key, fields, path, row, errors, bad)
                        if k in seen:
                            # (a sample's members apart in the tar, as `tar` writes a folder
                            # in its directory order: each part was a sample, the caption
                            # one without its image, without a word; a review).  The whole
                            # shard: its rows so far are not used (a unit is read whole)
                            raise DataError(
                                f"sample {k!r} (row {seen[k]}) has members apart from each "
                                f"other, {name!r} after other samples' members: a sample's "
                                "members must follow each other; make shards with `tar "
                                "--sort=name` or WebDataset's writers", path=path)
                        key, sample, bad = k, {}, None
                        seen[k] = row + 1
                    if isinstance(data, str):  # (a member with no content of its own)
                        bad = bad or data
                        continue
                    if ext in sample:  # (a bad sample: the others of the shard still count)
                        bad = bad or f"sample {k!r} has two '.{ext}' members"
                    sample[ext] = data
                if key is not None:
                    row += 1
                    yield row, self._select(sample, key, fields, path, row, errors, bad)

    @staticmethod
    def _select(sample: dict[str, bytes], key: str, fields: Sequence[str], path: str,
                row: int, errors: str, bad: str | None = None) -> Any:
        try:
            if bad is not None:
                raise DataError(bad, path=path, row=row)
            rec = _record(sample, key, path, row)
            # a sample without any image is a text document; one whose image is under
            # another extension than the field asked for is the usual missing field
            imageless = not any(k in rec for k in _IMAGE_FIELDS)
            missing = [name for name in fields
                       if name not in rec and not (imageless and name in _IMAGE_FIELDS)]
            if missing:
                raise DataError(f"sample {key!r}: missing field '{missing[0]}' (its fields: "
                                f"{', '.join(sorted(rec)) or 'none'})", path=path, row=row)
            out = Record((name, rec.get(name)) for name in fields)
            out.key = key  # (a bad document's error names it: documents.read_unit)
            return out
        except DataError as exc:
            if errors == "yield":
                return exc
            raise


def _hidden(name: str) -> bool:
    """Whether member ``name`` is a file no sample holds: a hidden one (``.DS_Store``, the
    ``._0001.txt`` AppleDouble file macOS's tar writes before each file with extended
    attributes) or one under ``__MACOSX/``.  Grouped as samples, each one cut the sample
    beside it in two (its json from its text, its image from its caption)."""
    return posixpath.basename(name).startswith(".") or "/__MACOSX/" in f"/{name}"


def _members(tar: tarfile.TarFile, f: Any, path: str) -> Iterator[tuple[str, bytes | str]]:
    """``(name, content)`` of every file member, in order, a link's content why it has none
    (a ``str``: its sample is bad input); checks the shard's end."""
    try:
        while True:
            m = tar.next()
            if m is None:
                break
            if m.isdir():
                continue
            if not m.isfile():
                # (passed over, a linked image made its sample a text document and a sample
                # of links vanished, without a word; a review)
                kind = ("a hard link" if m.islnk() else "a symbolic link" if m.issym()
                        else "not a regular file")
                yield m.name, (f"member {m.name!r} is {kind} (to {m.linkname!r})"
                               if m.linkname else f"member {m.name!r} is {kind}") + (
                    ": a shard holds each member's bytes; make it with `tar -h "
                    "--hard-dereference`")
                tar.members.clear()  # type: ignore[attr-defined]
                continue
            fh = tar.extractfile(m)
            assert fh is not None
            data = fh.read()
            if len(data) != m.size:
                raise tarfile.ReadError("unexpected end of data")
            yield m.name, data
            tar.members.clear()  # type: ignore[attr-defined]  # stream: keep no member list
        # tarfile ends silently at a truncated or corrupt header: insist on the end block
        f.seek(tar.offset)
        end = f.read(tarfile.BLOCKSIZE)
    except (tarfile.TarError, OSError, EOFError) as exc:
        if storage_failure(exc):
            raise
        raise DataError(f"corrupt tar: {exc}", path=path) from None
    if len(end) < tarfile.BLOCKSIZE:
        raise DataError(f"truncated tar: no end-of-archive block at byte {tar.offset}",
                        path=path)
    if end.count(0) != tarfile.BLOCKSIZE:
        raise DataError(f"corrupt tar: invalid member header at byte {tar.offset}", path=path)
    after = _data_after_end(f)
    if after is not None:
        # (tarfile, as WebDataset's reader and GNU tar without -i, stops at the first
        # archive's end: a second tar after it lost every sample, without a word; a review)
        raise DataError(f"data after the end-of-archive blocks, at byte {after}: two tars "
                        "joined (`cat a.tar b.tar`) read as the first alone; write one tar "
                        "per shard (or join them with `tar -A`)", path=path)


def _data_after_end(f: Any) -> int | None:
    """The offset of the first byte that is not zero from ``f``'s position to its end (a
    tar's end blocks and their padding to the record, 10 KiB as tar writes them); ``None``
    where all are zero."""
    while True:
        at = f.tell()
        chunk = f.read(1 << 16)
        if not chunk:
            return None
        if chunk.count(0) != len(chunk):
            return at + next(i for i, b in enumerate(chunk) if b)


register_format(WebDatasetFormat())
