"""A demo corpus built, without network, from the Python standard library on this machine.

:func:`write_demo_corpus` writes two sources:

``code``
    One document per ``*.py`` file of the standard library (``text``: the file's content,
    ``path``: its path relative to the library root), as parquet shards
    ``code/part-00000.parquet``, ``code/part-00001.parquet``, ...

``prose``
    One document per non-empty module, class or function docstring of those files
    (``text``: the docstring as :func:`ast.get_docstring` cleans it, ``origin``:
    ``"<relpath>:<qualname>"``), as zstandard-compressed JSON-lines shards
    ``prose/part-00000.jsonl.zst``, ...

Which files are used
    Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted by relative
    path, except those under a directory named ``site-packages`` (third-party code),
    ``__pycache__``, or ``test``, ``tests`` or ``idle_test`` (the library's own test
    suites: more than half of its bytes, many of them deliberately malformed or in legacy
    encodings, and not "real" code).  Files that are not valid UTF-8 are skipped; files that
    do not parse contribute code but no prose.

Documents are dealt round-robin to shards in sorted order (document ``i`` goes to shard
``i % shards``) and everything is written deterministically: on one machine, two runs
produce byte-identical files.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sysconfig
import warnings
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard
from tqdm import tqdm

__all__ = ["write_demo_corpus", "stdlib_files", "docstrings"]

SKIP_DIRS = frozenset({"site-packages", "__pycache__", "test", "tests", "idle_test"})
"""Directory names whose contents the demo corpus leaves out."""

CODE_SCHEMA = pa.schema([("text", pa.string()), ("path", pa.string())])
_ZSTD_LEVEL = 3


def stdlib_files(root: str | os.PathLike[str] | None = None) -> list[tuple[str, Path]]:
    """The standard library's ``*.py`` files that the demo corpus uses.

    Parameters
    ----------
    root : str or path-like, optional
        Library root; defaults to ``sysconfig.get_paths()["stdlib"]``.

    Returns
    -------
    list of (str, pathlib.Path)
        ``(relative POSIX path, absolute path)`` pairs sorted by relative path, leaving out
        the directories in :data:`SKIP_DIRS`.  Whether a file decodes is not checked here.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                full = Path(dirpath, name)
                if full.is_file():
                    found.append((full.relative_to(base).as_posix(), full))
    found.sort(key=lambda item: item[0])
    return found


def docstrings(source: str | bytes) -> Iterator[tuple[str, str]]:
    """The non-empty docstrings of a module, in source order.

    Parameters
    ----------
    source : str or bytes
        Python source code.

    Yields
    ------
    tuple of (str, str)
        ``(qualname, docstring)``: ``"<module>"`` for the module docstring, otherwise the
        object's ``__qualname__`` (``"Class.method"``, ``"func.<locals>.inner"``).  The
        docstring is the one :func:`ast.get_docstring` returns (indentation cleaned).

    Raises
    ------
    SyntaxError
        If ``source`` does not parse.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarning for odd escapes in old code
        tree = ast.parse(source)
    doc = ast.get_docstring(tree)
    if doc and doc.strip():
        yield "<module>", doc
    yield from _definition_docstrings(tree, "")


_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# Definitions are statements, found only in blocks of statements, exception handlers and
# match cases: expressions need not be searched.
_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)


def _definition_docstrings(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, _BLOCKS):
            continue
        if isinstance(child, _DEFINITIONS):
            qualname = prefix + child.name
            doc = ast.get_docstring(child)
            if doc and doc.strip():
                yield qualname, doc
            inner = "." if isinstance(child, ast.ClassDef) else ".<locals>."
            yield from _definition_docstrings(child, qualname + inner)
        else:
            yield from _definition_docstrings(child, prefix)


def _remove_stale(directory: Path, suffix: str, keep: int) -> None:
    """Delete ``part-NNNNN<suffix>`` shards left by an earlier run with more shards (only
    those: ``part-notes.parquet``, a file of the user's, went too; a review)."""
    for old in directory.glob(f"part-*{suffix}"):
        # (the names the writer makes alone: part-10 of the user's went, and "part-²" made
        # int() raise; a review)
        number = re.fullmatch(r"[0-9]{5,}", old.name[len("part-"):-len(suffix)], re.ASCII)
        if number is not None and int(number.group()) >= keep:
            old.unlink()


class _CodeShards:
    """Parquet shards written one full row group at a time."""

    def __init__(self, stack: ExitStack, directory: Path, shards: int, row_group_size: int):
        self.row_group_size = row_group_size
        self.writers = [stack.enter_context(pq.ParquetWriter(
            directory / f"part-{i:05d}.parquet", CODE_SCHEMA, compression="zstd"))
            for i in range(shards)]
        self.pending: list[list[tuple[str, str]]] = [[] for _ in range(shards)]
        self.count = 0

    def add(self, text: str, path: str) -> None:
        shard = self.count % len(self.writers)
        self.count += 1
        self.pending[shard].append((text, path))
        if len(self.pending[shard]) == self.row_group_size:
            self._flush(shard)

    def _flush(self, shard: int) -> None:
        rows = self.pending[shard]
        if rows:
            table = pa.table({"text": [t for t, _ in rows], "path": [p for _, p in rows]},
                             schema=CODE_SCHEMA)
            self.writers[shard].write_table(table, row_group_size=len(rows))
            self.pending[shard] = []

    def finish(self) -> None:
        for shard in range(len(self.writers)):
            self._flush(shard)


class _ProseShards:
    """JSON-lines shards, each one zstandard stream."""

    def __init__(self, stack: ExitStack, directory: Path, shards: int):
        self.streams: list[Any] = []
        for i in range(shards):
            raw: BinaryIO = stack.enter_context(open(directory / f"part-{i:05d}.jsonl.zst", "wb"))
            # One compressor per stream: a compressor serves one operation at a time.
            cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
            self.streams.append(stack.enter_context(cctx.stream_writer(raw, closefd=False)))
        self.count = 0

    def add(self, text: str, origin: str) -> None:
        line = json.dumps({"text": text, "origin": origin}, ensure_ascii=False) + "\n"
        self.streams[self.count % len(self.streams)].write(line.encode("utf-8"))
        self.count += 1


def write_demo_corpus(out_dir: str | os.PathLike[str], *, code_shards: int = 8,
                      prose_shards: int = 8, row_group_size: int = 64,
                      progress: bool = False) -> dict[str, int]:
    """Write the demo corpus (``code`` and ``prose`` sources) under ``out_dir``.

    See the module docstring for what the sources hold and which files are used.  Shard
    files of an earlier run in ``out_dir/code`` and ``out_dir/prose`` are overwritten, and
    any numbered beyond the new shard counts are removed.

    Parameters
    ----------
    out_dir : str or path-like
        Local directory to write into (created if missing).
    code_shards : int, default 8
        Number of parquet shards ``out_dir/code/part-NNNNN.parquet``.
    prose_shards : int, default 8
        Number of JSON-lines shards ``out_dir/prose/part-NNNNN.jsonl.zst``.
    row_group_size : int, default 64
        Rows per parquet row group (the last group of a shard may be smaller).
    progress : bool, default False
        Show a tqdm progress bar over the library's files.

    Returns
    -------
    dict of str to int
        Documents written: ``{"code": n_files, "prose": n_docstrings}``.

    Raises
    ------
    ValueError
        If a shard count or ``row_group_size`` is below 1.
    """
    for name, value in (("code_shards", code_shards), ("prose_shards", prose_shards),
                        ("row_group_size", row_group_size)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    code_dir = Path(out_dir, "code")
    prose_dir = Path(out_dir, "prose")
    code_dir.mkdir(parents=True, exist_ok=True)
    prose_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale(code_dir, ".parquet", code_shards)
    _remove_stale(prose_dir, ".jsonl.zst", prose_shards)

    files = stdlib_files()
    with ExitStack() as stack:
        code = _CodeShards(stack, code_dir, code_shards, row_group_size)
        prose = _ProseShards(stack, prose_dir, prose_shards)
        bar = stack.enter_context(tqdm(files, desc="demo corpus", unit="file",
                                       disable=not progress))
        for relpath, full in bar:
            data = full.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            code.add(text, relpath)
            try:
                for qualname, doc in docstrings(data):
                    prose.add(doc, f"{relpath}:{qualname}")
            except (SyntaxError, ValueError):
                pass  # code that this Python cannot parse: no prose from it
        code.finish()
    return {"code": code.count, "prose": prose.count}
