"""fsspec helpers: expand a source's URL or glob into files and stable keys."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.core import url_to_fs

__all__ = ["SourceFiles", "list_files", "open_source"]

_GLOB_CHARS = "*?["


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
    """Expand ``uri`` (an fsspec URL, optionally a glob) into a :class:`SourceFiles`."""
    fs, path = url_to_fs(uri, **dict(storage_options or {}))
    if any(c in path for c in _GLOB_CHARS) and not fs.isfile(path):  # (a file named "a[0].jsonl")
        first = min(path.find(c) for c in _GLOB_CHARS if c in path)
        root = path[:first].rsplit("/", 1)[0] if "/" in path[:first] else ""
        paths = sorted(p for p in fs.glob(path) if not fs.isdir(p))
    elif fs.isdir(path):
        root = path
        paths = sorted(p for p in fs.find(path) if not fs.isdir(p))
    else:
        root = path.rsplit("/", 1)[0] if "/" in path else ""
        paths = [path] if fs.exists(path) else []
    return SourceFiles(fs, root, paths)


def list_files(uri: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The files a source's ``uri`` matches, sorted."""
    return open_source(uri, storage_options).paths
