"""Source formats: one reader per format, in a small registry keyed by name.

A reader splits a file into :class:`Unit`\\ s (the pieces a loader reads at
once: a parquet row group, a whole JSON-lines file) and yields the records of
one unit.  Every built-in reader passes the shared conformance suite in
``tests/unit/test_formats.py``.  A source may also name a format of your own by
import path (``format: "package.module:Name"``, :func:`get_format`;
``msd_dask.examples.text_lines`` is one).
"""

from __future__ import annotations

from msd_dask.core.units import Unit
from msd_dask.formats import jsonl as _jsonl  # noqa: F401  (each backend registers itself)
from msd_dask.formats import parquet as _parquet  # noqa: F401
from msd_dask.formats import webdataset as _webdataset  # noqa: F401
from msd_dask.formats.registry import FORMATS, Format, Record, get_format, register_format

__all__ = ["Format", "Record", "Unit", "get_format", "register_format", "FORMATS"]
