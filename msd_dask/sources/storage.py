"""fsspec helpers: expand a source's URL or glob into files and stable keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.core import url_to_fs

__all__ = ["IGNORED_PREFIXES", "SourceFiles", "expand_braces", "list_files", "open_source"]

_GLOB_CHARS = "*?[{"

#: files (or folders) whose names start with these are not a source's data where a folder or
#: a glob is expanded: Spark's and Hadoop's markers (``_SUCCESS``, ``_committed_*``,
#: ``_temporary/``), checksums (``.part-0.crc``), hidden files; pyarrow's datasets skip them too
IGNORED_PREFIXES = (".", "_")


class SourceFiles:
    """The files of one source.

    Attributes
    ----------
    fs : fsspec.AbstractFileSystem
        The filesystem (built from ``storage_options``).
    root : str
        The longest directory prefix of the glob; keys are relative to it.
    paths : list of str
        Matching files, sorted, as ``fs`` names them (without protocol).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, paths: list[str]):
        self.fs = fs
        self.root = root.rstrip("/")
        self.paths = paths

    def relpath(self, path: str) -> str:
        """The key of ``path``: its name relative to the source root."""
        if self.root and path.startswith(self.root + "/"):
            return path[len(self.root) + 1:]
        return path


def open_source(uri: str, storage_options: Mapping[str, Any] | None = None) -> SourceFiles:
    """Expand ``uri`` (an fsspec URL, optionally a glob) into a :class:`SourceFiles`.

    A glob may hold alternatives in braces (``data/{code,math}/*.parquet``, nested too).
    Where a folder or a glob is expanded, a file is left out if its name, or a folder's
    on its way from the root, starts with one of :data:`IGNORED_PREFIXES`; a file named
    alone is always read.
    """
    fs, path = url_to_fs(uri, **dict(storage_options or {}))
    if any(c in path for c in _GLOB_CHARS) and not fs.isfile(path):  # (a file named "a[0].jsonl")
        first = min(path.find(c) for c in _GLOB_CHARS if c in path)
        root = path[:first].rsplit("/", 1)[0] if "/" in path[:first] else ""
        found = {p for pattern in expand_braces(path) for p in fs.glob(pattern)}
        paths = sorted(p for p in found if not _ignored(p, root) and not fs.isdir(p))
    elif fs.isdir(path):
        root = path
        paths = sorted(p for p in fs.find(path) if not _ignored(p, root) and not fs.isdir(p))
    else:
        root = path.rsplit("/", 1)[0] if "/" in path else ""
        paths = [path] if fs.exists(path) else []
    return SourceFiles(fs, root, paths)


def _ignored(path: str, root: str) -> bool:
    """Whether a name on ``path``'s way from ``root`` starts with an ignored prefix."""
    rel = path[len(root):] if root and path.startswith(root) else path
    return any(part.startswith(IGNORED_PREFIXES) for part in rel.split("/") if part)


def expand_braces(pattern: str) -> list[str]:
    """The patterns ``pattern``'s braces stand for, in order: ``a{b,c{d,e}}`` is ``ab``,
    ``acd``, ``ace`` (as a shell expands them; fsspec's glob has no braces).  A brace
    without a comma or its closing brace is kept as it is."""
    depth, start = 0, -1
    for i, c in enumerate(pattern):
        if c == "{":
            if depth == 0:
                start = i
            depth += 1
        elif c == "}" and depth:
            depth -= 1
            if depth == 0:
                options, level, cut = [], 0, start + 1
                for j in range(start + 1, i):
                    level += {"{": 1, "}": -1}.get(pattern[j], 0)
                    if pattern[j] == "," and level == 0:
                        options.append(pattern[cut:j])
                        cut = j + 1
                if not options:  # "{x}": no alternatives, a literal brace
                    return [pattern[:i + 1] + rest for rest in expand_braces(pattern[i + 1:])]
                options.append(pattern[cut:i])
                head, tails = pattern[:start], expand_braces(pattern[i + 1:])
                return [head + o + t for option in options for o in expand_braces(option)
                        for t in tails]
    return [pattern]


def list_files(uri: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The files a source's ``uri`` matches, sorted."""
    return open_source(uri, storage_options).paths
