"""The format registry: what a source format provides, and the formats known by name."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import fsspec

from msd_dask.core.units import Unit

__all__ = ["Format", "FORMATS", "get_format", "register_format"]


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
