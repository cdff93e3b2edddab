"""Source formats: one reader per format, in a small registry keyed by name.

A reader splits a file into :class:`Unit`\\ s (the pieces a loader reads at
once: a parquet row group, a whole JSON-lines file) and yields the records of
one unit.  Every reader passes the shared conformance suite in
``tests/test_formats.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import fsspec

__all__ = ["Format", "Unit", "get_format", "register_format", "FORMATS"]


@dataclass(frozen=True, order=True)
class Unit:
    """A piece of one file that a loader reads in one go.

    Attributes
    ----------
    path : str
        The file, as the source's filesystem names it.
    part : int
        Index of the piece inside the file (parquet row group; 0 for JSON lines and tar shards).
    row_offset : int
        Index, within the file, of the piece's first row.
    """

    path: str
    part: int = 0
    row_offset: int = 0


class Format(Protocol):
    """What a source format provides."""

    name: str

    def units(self, fs: fsspec.AbstractFileSystem, path: str) -> list[Unit]:
        """Split ``path`` into units, in file order."""
        ...

    def read(self, fs: fsspec.AbstractFileSystem, unit: Unit,
             fields: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield ``(row, record)`` for every row of ``unit``.

        ``row`` is the row's index within the file; ``record`` maps each of
        ``fields`` to its value (missing fields raise :class:`~msd_dask.errors.DataError`
        naming the file and row).
        """
        ...


FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` to the registry under ``fmt.name``."""
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    """The registered format called ``name``."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown format {name!r} (known: {', '.join(sorted(FORMATS))})") from None


from . import jsonl as _jsonl  # noqa: E402,F401  (registers itself)
from . import parquet as _parquet  # noqa: E402,F401
from . import webdataset as _webdataset  # noqa: E402,F401
