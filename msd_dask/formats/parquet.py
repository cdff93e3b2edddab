"""Parquet reader: one unit per row group, reading only the requested columns."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import fsspec

from msd_dask.core.units import Unit
from msd_dask.errors import DataError, storage_failure
from msd_dask.formats.registry import register_format

__all__ = ["READ_AHEAD", "ParquetFormat"]

#: bytes an object store fetches beyond what pyarrow reads of a parquet file (its read-ahead
#: block; s3fs's default was 50 MiB)
READ_AHEAD = 1 << 20


def _arrow_allocates_from_the_c_heap() -> None:
    """Arrow's default memory pool in this process becomes the C heap (``malloc``), once.

    pyarrow's bundled mimalloc keeps the pages Arrow has freed: a process that read the
    demo's parquet three times held 110-126 MiB in it while Arrow had at most 9 MiB
    allocated (pyarrow 26; the same retention is reported upstream, e.g. apache/arrow#47266
    and microsoft/mimalloc#1111); the C heap returns them.  Left alone when the
    deployment chose a pool (``ARROW_DEFAULT_MEMORY_POOL``).  Called where parquet is
    read, so only the processes that read it (the workers hosting loaders) change.
    """
    import os

    import pyarrow as pa

    if not os.environ.get("ARROW_DEFAULT_MEMORY_POOL") and \
            pa.default_memory_pool().backend_name != "system":
        pa.set_memory_pool(pa.system_memory_pool())


def _data_error(path: str, exc: BaseException, where: str = "") -> DataError:
    """``exc`` (pyarrow's, or any a corrupt file raises) as the file's :class:`DataError`;
    ``where``: the part of the file read (a row group)."""
    import pyarrow as pa

    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not isinstance(exc, pa.ArrowException | OSError):  # (an IndexError says little alone)
        reason = f"{type(exc).__name__}: {reason}"
    return DataError(f"cannot read parquet{' ' + where if where else ''}: {reason}", path=path)


def _values(column: Any) -> list[Any]:
    """A column's values as Python objects.  Arrow does not check UTF-8 when it reads a
    ``string`` column, so one invalid value would fail the whole row group: such a
    column comes back as ``bytes``, which the reader decodes (and reports) row by row."""
    import pyarrow as pa

    try:
        return list(column.to_pylist())
    except UnicodeDecodeError:
        raw = pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
        return list(column.cast(raw).to_pylist())


@dataclass(frozen=True)
class _Footer:
    """One file's parsed footer, as :meth:`ParquetFormat.read` needs it for every unit.

    Attributes
    ----------
    identity : str
        ``fs.ukey(path)`` taken before the footer was read (see :meth:`ParquetFormat.read`).
    metadata : pyarrow.parquet.FileMetaData
        The parsed footer, handed to pyarrow so that it reads only the row group.
    schema : pyarrow.Schema
        The file's Arrow schema (the types the writer stored, e.g. ``large_string``).
    starts : tuple of int
        ``starts[i]``: the first row of row group ``i``; ``starts[-1]``: the file's rows.
    nbytes : int
        The footer's size in the file, what :class:`_FooterCache` bounds.
    """

    identity: str
    metadata: Any
    schema: Any
    starts: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, pf: Any, identity: str) -> _Footer:
        """The footer of the open ``pyarrow.parquet.ParquetFile`` ``pf``, read once: O(row
        groups)."""
        meta = pf.metadata
        rows = (meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        return cls(identity, meta, pf.schema_arrow, (0, *accumulate(rows)),
                   meta.serialized_size)


class _FooterCache:
    """The parsed footers of the files read last in this process, least recently used
    dropped first; safe to share between threads (a loader reads units from a pool).

    Without it every unit re-read and re-parsed its file's whole footer: reading the G
    row groups of a file read G footers of O(G) bytes each, and summed O(G) row counts
    each (a footer of 5,000 row groups is several MB; over S3, a ranged GET per unit).

    Parameters
    ----------
    files : int
        Footers kept at most.
    nbytes : int
        Footer bytes kept at most (their size in the files: parsed, they take up to ten
        times that, 5.6 MB for the 0.64 MB footer of 5,000 row groups of one column),
        except that the footer used last is always kept: a file whose footer alone is
        larger would otherwise be re-parsed for each of its units again.
    """

    def __init__(self, files: int, nbytes: int):
        self.files = files
        self.nbytes = nbytes
        self._lock = threading.Lock()
        # (fs, path) -> the footer; one per file: a file read again under a new identity
        # replaces its entry, so a rewritten file's old footer is not kept
        self._footers: OrderedDict[tuple[Any, str], _Footer] = OrderedDict()
        self._held = 0  # (sum of the kept footers' nbytes)

    def get(self, fs: fsspec.AbstractFileSystem, path: str, identity: str) -> _Footer | None:
        """The footer of ``path`` on ``fs`` if one was kept under ``identity``, else None."""
        with self._lock:
            footer = self._footers.get((fs, path))
            if footer is None:
                return None
            if footer.identity != identity:  # (rewritten since: the old footer is no use)
                self._drop((fs, path))
                return None
            self._footers.move_to_end((fs, path))
            return footer

    def put(self, fs: fsspec.AbstractFileSystem, path: str, footer: _Footer) -> None:
        """Keep ``footer`` as the newest, dropping the least recently used beyond the
        bounds.  (Two threads that missed the same file both parse it; one is kept.)"""
        with self._lock:
            self._drop((fs, path))
            self._footers[(fs, path)] = footer
            self._held += footer.nbytes
            while len(self._footers) > self.files or \
                    (self._held > self.nbytes and len(self._footers) > 1):
                self._drop(next(iter(self._footers)))

    def clear(self) -> None:
        """Forget every footer."""
        with self._lock:
            self._footers.clear()
            self._held = 0

    def __len__(self) -> int:
        return len(self._footers)

    def _drop(self, key: tuple[Any, str]) -> None:
        footer = self._footers.pop(key, None)  # (the caller holds the lock)
        if footer is not None:
            self._held -= footer.nbytes


#: The footers :meth:`ParquetFormat.read` keeps in this process.  A loader reads its
#: source's units in a shuffled order, so a footer is reused when the units read close
#: together share files: all units of one file read in a row, or a source of few files.
_FOOTERS = _FooterCache(files=8, nbytes=8 << 20)


class ParquetFormat:
    """Parquet files, split into row groups.

    Each row group is one :class:`~msd_dask.formats.Unit`; reading a unit loads only that
    row group and only the requested columns.  Values come back as Python objects
    (``string`` columns as ``str``, ``binary`` columns as ``bytes``).

    Attributes
    ----------
    suffixes : tuple of str
        The names a source whose ``uri`` is a folder reads (case-insensitive).
    """

    name = "parquet"
    suffixes = (".parquet", ".parq", ".pq")

    def units(self, fs: fsspec.AbstractFileSystem, path: str) -> list[Unit]:
        """Split ``path`` into one unit per row group, in file order.

        Parameters
        ----------
        fs : fsspec.AbstractFileSystem
            Filesystem holding the file.
        path : str
            The file, as ``fs`` names it.

        Returns
        -------
        list of Unit
            ``Unit(path, part=i, row_offset=first row of group i)`` for every row group;
            empty for a file without row groups.

        Raises
        ------
        DataError
            If the footer cannot be read (not a parquet file, truncated, corrupt).
        """
        import pyarrow.parquet as pq  # here, not at import: a training process never needs it

        _arrow_allocates_from_the_c_heap()

        with fs.open(path, "rb", block_size=READ_AHEAD) as f:
            try:
                meta = pq.ParquetFile(f).metadata
                units = []
                offset = 0
                for i in range(meta.num_row_groups):
                    units.append(Unit(path, part=i, row_offset=offset))
                    offset += meta.row_group(i).num_rows
            except Exception as exc:  # noqa: BLE001 - a corrupt footer raises all kinds
                if storage_failure(exc):
                    raise
                raise _data_error(path, exc) from exc
        return units

    def read(self, fs: fsspec.AbstractFileSystem, unit: Unit,
             fields: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(row, record)`` for every row of the row group ``unit.part``.

        The row group is read (only ``fields``) and the file closed before the first
        record is yielded, so an abandoned iterator holds no open file.

        The file's parsed footer is kept (a few files per process, see Notes), so reading
        the G units of a file reads and parses its footer once, not G times.

        Parameters
        ----------
        fs : fsspec.AbstractFileSystem
            Filesystem holding ``unit.path``.
        unit : Unit
            The row group to read, as returned by :meth:`units`.
        fields : sequence of str
            Columns to return; every record maps exactly these names to values.

        Yields
        ------
        tuple of (int, dict)
            The row's index within the file and its requested fields.

        Raises
        ------
        DataError
            If a field is not a column of the file or is more than one (naming the unit's
            first row), the file changed since :meth:`units` listed it, or it cannot be
            read (naming the row group where that is where it failed).

        Notes
        -----
        A kept footer is used only while the file's identity is the one it was read under:
        ``fs.ukey(path)``, fsspec's "has this file changed" key (the one its caching
        filesystems check), by default a hash of ``fs.info(path)``: size, modification and
        change times and inode on a local disk; size, ETag and LastModified on S3.  Each
        read asks for it (one ``stat``, or one HEAD request where the filesystem has no
        listing of the file cached) and reads the footer again when it differs, so a file
        rewritten in place is checked against its listed units by the next read of one
        of them, as when every read parsed the footer, at a cost that does not grow with
        the row groups.  The footer's bytes would be no cheaper an identity: comparing
        them is reading them.  What goes unseen is a rewrite that keeps the size, the times
        (to the filesystem's timestamp resolution) and the inode, or one made while s3fs
        answers ``info`` from a listing it cached before: pyarrow then reads the new bytes
        where the kept footer puts the row group, which, unless the layout is the same,
        fails as a corrupt row group or a row count unlike the footer's.
        """
        import pyarrow.parquet as pq

        _arrow_allocates_from_the_c_heap()
        path = unit.path
        columns = list(dict.fromkeys(fields))
        where = ""  # (the row group once it is being read: a failure from there names it)
        # (taken before the file is opened: a rewrite between the two is then seen by the
        # next read, which finds another identity and reads the footer again)
        identity = fs.ukey(path)
        footer = _FOOTERS.get(fs, path, identity)
        # (a small read-ahead: pyarrow reads the row group's column chunks, each at once,
        # where an object store's default block fetched 50 MiB (s3fs) from the first one
        # on, whatever their size; a review.  A block size every fsspec filesystem takes,
        # not a cache type, which some refuse: a caching one, a user's own)
        with fs.open(path, "rb", block_size=READ_AHEAD) as f:
            try:
                if footer is None:
                    pf = pq.ParquetFile(f)
                    footer = _Footer.of(pf, identity)
                    _FOOTERS.put(fs, path, footer)
                else:  # (pyarrow reads only the row group's column chunks)
                    pf = pq.ParquetFile(f, metadata=footer.metadata)
                schema = footer.schema
                missing = [c for c in columns if c not in schema.names]
                if missing:
                    raise DataError(f"missing field '{missing[0]}' (the file's columns: "
                                    f"{', '.join(schema.names)})", path=path,
                                    row=unit.row_offset)
                twice = [c for c in columns if len(schema.get_all_field_indices(c)) > 1]
                if twice:
                    raise DataError(f"column '{twice[0]}' appears "
                                    f"{len(schema.get_all_field_indices(twice[0]))} times "
                                    "in the file's schema: which one to read is ambiguous",
                                    path=path, row=unit.row_offset)
                starts = footer.starts
                groups = len(starts) - 1
                if not 0 <= unit.part < groups or starts[unit.part] != unit.row_offset:
                    # (row groups are the units: another layout would repeat or skip rows)
                    raise DataError(
                        f"the file changed since its units were listed: row group "
                        f"{unit.part} was to start at row {unit.row_offset}, the file now "
                        + (f"has {groups} row group(s)" if not 0 <= unit.part < groups else
                           f"starts it at row {starts[unit.part]}") + "; list the source "
                        "again (restart the service) to read the file as it is", path=path)
                num_rows = starts[unit.part + 1] - starts[unit.part]
                where = (f"row group {unit.part} (rows {unit.row_offset}-"
                         f"{unit.row_offset + num_rows - 1})")
                # (on the read thread: Arrow's own decode threads ran outside the loader's
                # CPU count, a CPU-bound source read as 0.66 busy; the loader reads units in
                # parallel already; a review)
                table = pf.read_row_group(unit.part, columns=columns, use_threads=False)
                if table.num_rows != num_rows:
                    raise DataError(f"cannot read parquet: {where} holds {table.num_rows} "
                                    f"rows, the file's footer says {num_rows}", path=path)
                values = {c: _values(table.column(c)) for c in columns}
            except DataError:
                raise
            except Exception as exc:  # noqa: BLE001 - a corrupt file raises all kinds
                if storage_failure(exc):
                    raise
                raise _data_error(path, exc, where) from exc
        del table
        for i in range(num_rows):
            yield unit.row_offset + i, {c: values[c][i] for c in columns}


register_format(ParquetFormat())
