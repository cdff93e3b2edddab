"""The unit: the piece of one file that a Source Loader reads in one go."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Unit"]


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
