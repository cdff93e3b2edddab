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
import sys
from typing import Any

__all__ = ["drop_short", "normalize_whitespace", "clean", "fail_on_marker", "exit_on_marker",
           "crash_on_marker", "slow_store",
           "store_1x", "store_20x", "cpu_heavy", "cpu_bound", "cpu_bound_py", "MIN_CHARS",
           "SLOW_SECONDS_PER_KB", "STORE_SECONDS_PER_KB", "CPU_ROUNDS", "CPU_HASH_BYTES",
           "CPU_PY_ROUNDS"]

#: Documents shorter than this (after stripping) are dropped by :func:`drop_short`.
MIN_CHARS = 40

_WS = re.compile(r"\s+")


def drop_short(text: str, record: dict[str, Any]) -> str | None:
    """Drop documents with fewer than :data:`MIN_CHARS` characters once stripped (blanks
    inside count)."""
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


def exit_on_marker(text: str, record: dict[str, Any]) -> str | None:
    """Call ``sys.exit`` on documents containing ``"EXIT-ME"`` (user code raising a
    BaseException: to test that it still names the document)."""
    if "EXIT-ME" in text:
        sys.exit("found the EXIT-ME marker")
    return text


def crash_on_marker(text: str, record: dict[str, Any]) -> str | None:
    """Kill the process (``SIGKILL``) on documents containing ``"CRASH-ME"``: a native
    decoder's segfault, or the kernel's out-of-memory kill, as the service sees it (to
    test that it stops re-creating its roles on worker after worker)."""
    if "CRASH-ME" in text:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return text


#: Seconds :func:`slow_store` waits per KiB of text.
SLOW_SECONDS_PER_KB = 0.1

#: Hash rounds per KiB of text in :func:`cpu_heavy`.
CPU_ROUNDS = 40


def slow_store(text: str, record: dict[str, Any]) -> str | None:
    """Wait as a slow remote store would (``SLOW_SECONDS_PER_KB``; releases the GIL).

    For benchmarks and tests of loader scaling: the text is returned unchanged.
    """
    import time

    time.sleep(SLOW_SECONDS_PER_KB * (len(text) + 1) / 1024)
    return text


def cpu_heavy(text: str, record: dict[str, Any]) -> str | None:
    """Burn CPU in proportion to the text (``CPU_ROUNDS`` sha256 passes per KiB).

    hashlib releases the GIL on large inputs, like image decoding does; the
    text is returned unchanged.
    """
    import hashlib

    data = text.encode("utf-8") * CPU_ROUNDS
    hashlib.sha256(data).digest()
    return text


#: Seconds :func:`store_1x` waits per KiB (:func:`store_20x` waits 20 times as long).
STORE_SECONDS_PER_KB = 0.002


def store_1x(text: str, record: dict[str, Any]) -> str | None:
    """A store that costs ``STORE_SECONDS_PER_KB`` of waiting per KiB (benchmarks)."""
    import time

    time.sleep(STORE_SECONDS_PER_KB * (len(text) + 1) / 1024)
    return text


def store_20x(text: str, record: dict[str, Any]) -> str | None:
    """Like :func:`store_1x`, 20 times slower per token (benchmarks)."""
    import time

    time.sleep(20 * STORE_SECONDS_PER_KB * (len(text) + 1) / 1024)
    return text


#: Bytes :func:`cpu_bound` hashes per byte of text.
CPU_HASH_BYTES = 40_000

#: Python-level operations :func:`cpu_bound_py` does per byte of text.
CPU_PY_ROUNDS = 400


def cpu_bound(text: str, record: dict[str, Any]) -> str | None:
    """Hash ``CPU_HASH_BYTES`` bytes per byte of text, in 16 KiB blocks (benchmarks).

    A stand-in for image decoding: heavy C work that releases the GIL (hashlib
    does on blocks over 2 KiB), so a loader's thread pool spreads it over cores.
    The text is returned unchanged.
    """
    import hashlib

    data = text.encode("utf-8") or b" "
    block = data * max(1, 16384 // len(data))
    h = hashlib.sha256()
    for _ in range(max(1, len(data) * CPU_HASH_BYTES // len(block))):
        h.update(block)
    return text


def cpu_bound_py(text: str, record: dict[str, Any]) -> str | None:
    """``CPU_PY_ROUNDS`` pure-Python operations per byte of text (holds the GIL; benchmarks).

    Threads cannot run it in parallel: a ``pool: {kind: process}`` can.  The text
    is returned unchanged.
    """
    acc = 0
    for i in range(len(text) * CPU_PY_ROUNDS):
        acc = (acc + i) & 0xFFFF
    return text
