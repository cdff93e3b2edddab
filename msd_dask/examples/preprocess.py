"""Example document preprocessors for a source's ``preprocess`` key.

A preprocessor is any importable function ``fn(text, record) -> str | None``
named as ``"package.module:function"``.  It runs in the loader, on every
document, before tokenizing: return the (new) text, or ``None`` to drop the
document.  ``record`` is the row as read (at least the ``text_field``).
Exceptions it raises stop the service with a :class:`~msd_dask.DataError`
naming the source, file, row and function.

Example::

    sources:
      - name: code
        uri: data/demo/code/*.parquet
        format: parquet
        preprocess: msd_dask.examples.preprocess:drop_short

It must be importable on every worker (installed, or on ``PYTHONPATH``).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["drop_short", "normalize_whitespace", "clean", "fail_on_marker", "MIN_CHARS"]

#: Documents shorter than this (after stripping) are dropped by :func:`drop_short`.
MIN_CHARS = 40

_WS = re.compile(r"\s+")


def drop_short(text: str, record: dict[str, Any]) -> str | None:
    """Drop documents with fewer than :data:`MIN_CHARS` non-blank characters."""
    return text if len(text.strip()) >= MIN_CHARS else None


def normalize_whitespace(text: str, record: dict[str, Any]) -> str | None:
    """Collapse every run of whitespace to one space and strip the ends."""
    return _WS.sub(" ", text).strip()


def clean(text: str, record: dict[str, Any]) -> str | None:
    """:func:`normalize_whitespace`, then :func:`drop_short`."""
    return drop_short(_WS.sub(" ", text).strip(), record)


def fail_on_marker(text: str, record: dict[str, Any]) -> str | None:
    """Raise on documents containing ``"FAIL-ME"`` (to test error reporting)."""
    if "FAIL-ME" in text:
        raise ValueError("found the FAIL-ME marker")
    return text
