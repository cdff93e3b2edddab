"""Parquet reader: one unit per row group, reading only the requested columns."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import fsspec

from msd_dask.core.units import Unit
from msd_dask.errors import DataError
from msd_dask.formats.registry import register_format

__all__ = ["ParquetFormat"]

# Errors that say the storage, not the file's content, failed: they propagate as they are
# so that callers may retry them.
_STORAGE_ERRORS = (FileNotFoundError, PermissionError, ConnectionError, TimeoutError)


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

        with fs.open(path, "rb") as f:
            try:
                meta = pq.ParquetFile(f).metadata
                units = []
                offset = 0
                for i in range(meta.num_row_groups):
                    units.append(Unit(path, part=i, row_offset=offset))
                    offset += meta.row_group(i).num_rows
            except Exception as exc:  # noqa: BLE001 - a corrupt footer raises all kinds
                if isinstance(exc, _STORAGE_ERRORS):
                    raise
                raise _data_error(path, exc) from exc
        return units

    def read(self, fs: fsspec.AbstractFileSystem, unit: Unit,
             fields: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(row, record)`` for every row of the row group ``unit.part``.

        The row group is read (only ``fields``) and the file closed before the first
        record is yielded, so an abandoned iterator holds no open file.

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
        """
        import pyarrow.parquet as pq

        _arrow_allocates_from_the_c_heap()
        path = unit.path
        columns = list(dict.fromkeys(fields))
        where = ""  # (the row group once it is being read: a failure from there names it)
        with fs.open(path, "rb") as f:
            try:
                pf = pq.ParquetFile(f)
                schema = pf.schema_arrow
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
                meta = pf.metadata
                groups = meta.num_row_groups
                first = sum(meta.row_group(i).num_rows for i in range(min(unit.part, groups)))
                if not 0 <= unit.part < groups or first != unit.row_offset:
                    # (row groups are the units: another layout would repeat or skip rows)
                    raise DataError(
                        f"the file changed since its units were listed: row group "
                        f"{unit.part} was to start at row {unit.row_offset}, the file now "
                        + (f"has {groups} row group(s)" if not 0 <= unit.part < groups else
                           f"starts it at row {first}") + "; list the source again "
                        "(restart the service) to read the file as it is", path=path)
                num_rows = meta.row_group(unit.part).num_rows
                where = (f"row group {unit.part} (rows {unit.row_offset}-"
                         f"{unit.row_offset + num_rows - 1})")
                table = pf.read_row_group(unit.part, columns=columns)
                if table.num_rows != num_rows:
                    raise DataError(f"cannot read parquet: {where} holds {table.num_rows} "
                                    f"rows, the file's footer says {num_rows}", path=path)
                values = {c: _values(table.column(c)) for c in columns}
            except DataError:
                raise
            except Exception as exc:  # noqa: BLE001 - a corrupt file raises all kinds
                if isinstance(exc, _STORAGE_ERRORS):
                    raise
                raise _data_error(path, exc, where) from exc
        del table
        for i in range(num_rows):
            yield unit.row_offset + i, {c: values[c][i] for c in columns}


register_format(ParquetFormat())
