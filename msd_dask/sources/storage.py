"""fsspec helpers: expand a source's URL or glob into files and stable keys."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import fsspec
from fsspec.core import url_to_fs

from msd_dask.errors import SHOWN, ConfigError, first_of

if TYPE_CHECKING:
    from msd_dask.core.config import SourceConfig

__all__ = ["IGNORED_PREFIXES", "SourceFiles", "check_format_suffixes", "expand_braces",
           "format_paths", "is_glob", "list_files", "open_source", "source_filesystem"]

_GLOB_CHARS = "*?["

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
    folder : bool
        Whether the ``uri`` named a folder (neither a glob nor a file): discovery then
        keeps only the files the source's format reads
        (:func:`format_paths`).
    """

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, paths: list[str],
                 folder: bool = False):
        self.fs = fs
        self.root = root.rstrip("/")
        self.paths = paths
        self.folder = folder

    def relpath(self, path: str) -> str:
        """The key of ``path``: its name relative to the source root."""
        if self.root and path.startswith(self.root + "/"):
            return path[len(self.root) + 1:]
        return path


def source_filesystem(uri: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem of ``uri`` (what a loader reads its units with), without listing
    the source: a loader is made at start, at every scale-up and after every loss, and on
    object storage a listing of a large source is many requests (and one that fails
    briefly failed the role).  Its listing cache is emptied (:func:`_uncached`)."""
    return _uncached(url_to_fs(uri, **dict(storage_options or {}))[0])


def _uncached(fs: Any) -> Any:
    """``fs`` with its listing cache emptied.  fsspec hands every caller of one URL and
    options the same filesystem object, whose listing cache (s3fs, gcsfs...) never
    expires: a process that listed a source once (a worker that ran a service's start, a
    notebook) listed it so again after files were added, deleted or rewritten, and read a
    rewritten file by its old listing's ETag (``FileExpired``), so a service started again
    over the changed files failed as before (a review)."""
    fs.invalidate_cache()
    return fs


def open_source(uri: str, storage_options: Mapping[str, Any] | None = None) -> SourceFiles:
    """Expand ``uri`` (an fsspec URL, optionally a glob) into a :class:`SourceFiles`.

    A glob may hold alternatives in braces (``data/{code,math}/*.parquet``, nested too).
    Where a folder or a glob is expanded, a file is left out if its name, or a folder's
    on its way from the root, starts with one of :data:`IGNORED_PREFIXES` where the
    listing or a wildcard found it; a name the glob spells out (``{_shards,more}``,
    ``_*.jsonl``) and a file named alone are read.  A folder's files are all listed here (``folder=True``):
    discovery keeps those its source's format reads.
    """
    fs, path = url_to_fs(uri, **dict(storage_options or {}))
    _uncached(fs)  # (listed as the storage has it now)
    start = _glob_start(path)
    # (a file or folder named as it is, "a[0].jsonl" or "run[1]", is no glob: a folder
    # was globbed and matched no file; a review)
    if start is not None and not fs.exists(path):
        root = path[:start].rsplit("/", 1)[0] if "/" in path[:start] else ""
        found: dict[str, Any] = {}
        for pattern in expand_braces(path):
            found.update({p: info for p, info in fs.glob(pattern, detail=True).items()
                          if not _wildcard_ignored(p, pattern, root)})
        paths = sorted(p for p, info in found.items() if _is_file(fs, p, info))
    elif fs.isdir(path):
        root = path
        paths = sorted(p for p, info in fs.find(path, detail=True).items()
                       if not _ignored(p, root) and _is_file(fs, p, info))
        return SourceFiles(fs, root, paths, folder=True)
    else:
        root = path.rsplit("/", 1)[0] if "/" in path else ""
        paths = [path] if fs.exists(path) else []
    return SourceFiles(fs, root, paths)


def _is_file(fs: fsspec.AbstractFileSystem, path: str, info: Mapping[str, Any]) -> bool:
    """Whether ``path``, as a listing's detail ``info`` gives it, is a file of data.

    Decided from the listing itself: on S3, once a glob has filled s3fs's listing cache,
    ``fs.isdir`` is False for a folder (a key prefix), and the zero-byte ``prefix/`` key
    that the S3 console's "Create folder" makes is listed as a file; read as data, either
    fails the source (a parquet reader: "Parquet file size is 0 bytes").  An entry of
    another type than file or directory (a local symbolic link, listed as ``"other"``)
    is asked about, following the link as before.
    """
    kind = info.get("type")
    if kind == "directory":
        return False
    if kind == "file":
        return not path.endswith("/")
    return not fs.isdir(path)


def is_glob(uri: str) -> bool:
    """Whether ``uri`` is a glob (holds ``*``, ``?`` or ``[``, or alternatives in braces),
    not the path of one file or folder."""
    return _glob_start(uri) is not None


def _glob_start(path: str) -> int | None:
    """Where the first glob character or brace alternative of ``path`` is (None: none)."""
    starts = [path.find(c) for c in _GLOB_CHARS if c in path]
    alternatives = _first_alternatives(path)
    if alternatives is not None:
        starts.append(alternatives[0])
    return min(starts) if starts else None


def _ignored(path: str, root: str) -> bool:
    """Whether a name on ``path``'s way from ``root`` starts with an ignored prefix."""
    rel = path[len(root):] if root and path.startswith(root) else path
    return any(part.startswith(IGNORED_PREFIXES) for part in rel.split("/") if part)


def _wildcard_ignored(path: str, pattern: str, root: str) -> bool:
    """Whether a glob ``pattern`` (no braces) matched ``path`` where a wildcard of it matched
    a name starting with an ignored prefix: a name the pattern spells out (a folder
    ``_shards``, one of the alternatives in braces, ``_*.jsonl``) is read (the alternatives
    were left out without a word where the same folder outside braces was read; a review).
    Where the names do not line up with the pattern's (a ``**`` within a name), as
    :func:`_ignored` decides from ``root``."""
    names, parts = path.split("/"), pattern.split("/")
    if "**" in parts:  # the names before it and after it line up; it matched those between
        k = parts.index("**")
        after = len(parts) - k - 1
        if len(names) < k + after:
            return _ignored(path, root)
        lined = list(zip(parts[:k], names[:k], strict=True))
        lined += list(zip(parts[k + 1:], names[len(names) - after:], strict=True))
        if any(n.startswith(IGNORED_PREFIXES) for n in names[k:len(names) - after]):
            return True
    elif len(names) == len(parts) and not any("**" in p for p in parts):
        lined = list(zip(parts, names, strict=True))
    else:
        return _ignored(path, root)
    return any(n.startswith(IGNORED_PREFIXES) and not p.startswith(n[0]) for p, n in lined)


def expand_braces(pattern: str) -> list[str]:
    """The patterns ``pattern``'s braces stand for, in order: ``a{b,c{d,e}}`` is ``ab``,
    ``acd``, ``ace`` (as a shell expands them; fsspec's glob has no braces).  A brace
    without a comma at its level (``run{1}``), without its closing brace, or inside a
    character class (``[{,}]``) is kept as it is."""
    found = _first_alternatives(pattern)
    if found is None:
        return [pattern]
    start, end, options = found
    tails = expand_braces(pattern[end + 1:])
    return [pattern[:start] + o + t for option in options for o in expand_braces(option)
            for t in tails]


def _first_alternatives(pattern: str) -> tuple[int, int, list[str]] | None:
    """``(start, end, options)`` of the first brace group of ``pattern`` with a comma at
    its level (``pattern[start] == "{"``, ``pattern[end] == "}"``), outside character
    classes; ``None`` if there is none."""
    for i, c in _outside_classes(pattern, 0):
        if c == "{":  # (one without alternatives is a character: look on inside it)
            end, options = _brace_group(pattern, i)
            if end > 0 and len(options) > 1:
                return i, end, options
    return None


def _brace_group(pattern: str, start: int) -> tuple[int, list[str]]:
    """The closing brace of the group opened at ``start`` and the group's parts between
    its commas at its level; ``(-1, [])`` if it is not closed."""
    depth, cut = 0, start + 1
    options: list[str] = []
    for j, c in _outside_classes(pattern, start + 1):
        if c == "{":
            depth += 1
        elif c == "}":
            if depth == 0:
                return j, [*options, pattern[cut:j]]
            depth -= 1
        elif c == "," and depth == 0:
            options.append(pattern[cut:j])
            cut = j + 1
    return -1, []


def _outside_classes(pattern: str, start: int) -> Iterator[tuple[int, str]]:
    """``(index, character)`` of ``pattern`` from ``start`` on, character classes
    (``[...]``) passed over."""
    i = start
    while i < len(pattern):
        if pattern[i] == "[" and (end := _class_end(pattern, i)) > 0:
            i = end + 1
            continue
        yield i, pattern[i]
        i += 1


def _class_end(pattern: str, start: int) -> int:
    """The ``]`` closing the character class opened at ``start`` (a ``]`` first in it, after
    an optional ``!`` or ``^``, is a member), or -1."""
    k = start + 1
    if k < len(pattern) and pattern[k] in "!^":
        k += 1
    if k < len(pattern) and pattern[k] == "]":
        k += 1
    return pattern.find("]", k)


def list_files(uri: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The files a source's ``uri`` matches, sorted."""
    return open_source(uri, storage_options).paths


def format_paths(files: SourceFiles, fmt: Any, src: SourceConfig, index: int
                 ) -> tuple[list[str], list[str]]:
    """The files of source ``src`` that its format ``fmt`` reads, and those left out.

    Where the source's ``uri`` names a folder (``files.folder``), only the files whose
    names end in one of the format's ``suffixes`` (compared case-insensitively) are its
    data: a ``README.md``, ``LICENSE`` or ``dataset_info.json`` beside the shards is not.
    A glob or a single file is read as named, and so is every file of a folder when the
    format has no ``suffixes`` (a format of your own may not).

    Parameters
    ----------
    files : SourceFiles
        The source's files, as :func:`open_source` lists them.
    fmt : Format
        The source's format.
    src : SourceConfig
        The source.
    index : int
        The source's place in the config (for the error's key).

    Returns
    -------
    paths : list of str
        The files to list units of, in ``files.paths``'s order.
    skipped : list of str
        The folder's other files, relative to its root, in the same order.

    Raises
    ------
    ConfigError
        The folder holds files, none of which the format reads: naming
        ``sources[index].uri``, the source, the format and a few of the files; or every
        file is another built-in format's (:func:`check_format_suffixes`).
    """
    check_format_suffixes(files, fmt, src, index)
    suffixes = _suffixes(fmt)
    if not files.folder or not suffixes:
        return list(files.paths), []
    ends = tuple(x.lower() for x in suffixes)
    paths: list[str] = []
    skipped: list[str] = []
    for p in files.paths:
        (paths if p.rsplit("/", 1)[-1].lower().endswith(ends) else skipped).append(p)
    others = [files.relpath(p) for p in skipped]
    if skipped and not paths:
        glob = src.uri.rstrip("/") + "/**"  # (its subfolders too, as the folder was listed)
        raise ConfigError(
            f"sources[{index}].uri",
            f"folder {src.uri!r} of source {src.name!r} holds no file that format "
            f"{src.format!r} reads (names ending in {', '.join(suffixes)}), only "
            f"{len(others)} other(s): {first_of(others, SHOWN)}; to read those as {src.format!r}, "
            f"name them with a glob (e.g. {glob!r})")
    return paths, others


def check_format_suffixes(files: SourceFiles, fmt: Any, src: SourceConfig, index: int) -> None:
    """Refuse a source whose files are all another built-in format's.

    Where none of the source's files ends in one of its format's ``suffixes`` and every
    one ends in a suffix of a built-in format
    (:data:`~msd_dask.core.config.KNOWN_FORMATS`), the source's ``format`` is wrong
    (``format: jsonl`` over ``*.parquet``), and reading would fail on the first file with
    an error of its bytes (``invalid UTF-8``) that says nothing of the format.  A format
    without ``suffixes`` (one of your own may have none), a file that ends in one of the
    format's, and a file no built-in format claims (``data.bin``) are let through as before.

    Parameters
    ----------
    files : SourceFiles
        The source's files, as :func:`open_source` lists them.
    fmt : Format
        The source's format.
    src : SourceConfig
        The source.
    index : int
        The source's place in the config (for the error's key).

    Raises
    ------
    ConfigError
        Naming ``sources[index].format``, the source, its format, the first file's suffix
        and name, and the built-in format that reads such files.
    """
    from msd_dask.core.config import KNOWN_FORMATS
    from msd_dask.formats import FORMATS

    own = tuple(x.lower() for x in _suffixes(fmt))
    if not own or not files.paths:
        return
    others = [(name, tuple(x.lower() for x in _suffixes(FORMATS[name])))
              for name in KNOWN_FORMATS if name in FORMATS]
    first: tuple[str, str, str] | None = None  # (the first file, its suffix, its format)
    for p in files.paths:
        base = p.rsplit("/", 1)[-1]
        lower = base.lower()
        if lower.endswith(own):
            return
        claim = next(((name, x) for name, ends in others for x in ends if lower.endswith(x)),
                     None)
        if claim is None:  # (a file no built-in format names: perhaps the format's data)
            return
        if first is None:
            first = (files.relpath(p), base[len(base) - len(claim[1]):], claim[0])
    assert first is not None  # (files.paths is not empty)
    example, suffix, reader = first
    raise ConfigError(f"sources[{index}].format",
                      f"source {src.name!r} has format {src.format!r}, but its files end in "
                      f"{suffix} (e.g. {example!r}), which format {reader!r} reads")


def _suffixes(fmt: Any) -> tuple[str, ...]:
    """The ``suffixes`` of format ``fmt`` (one given as a string too); ``()`` where it has none."""
    suffixes = getattr(fmt, "suffixes", None) or ()
    return (suffixes,) if isinstance(suffixes, str) else tuple(suffixes)
