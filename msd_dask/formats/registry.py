"""The format registry: what a source format provides, and the formats known by name.

A source's ``format`` is a registered format's name (the built-in ones register
themselves) or the import path ``"package.module:Name"`` of a format of your own:
a class, made with no arguments, or an instance, which every process that lists or
reads the source (the workers) imports on first use, as it does a ``preprocess``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import fsspec

from msd_dask.core.units import Unit

__all__ = ["Format", "FORMATS", "Record", "get_format", "register_format"]


class Record(dict[str, Any]):
    """A record a format may yield in place of a plain ``dict``, naming its row: ``key``,
    the sample's name in its file (a WebDataset sample's key), which the error of a bad
    document names beside its row (a row's index alone sent the user counting samples
    through a tar; a review)."""

    #: the sample's name in its file (``None``: the row's index names it)
    key: str | None = None


class Format(Protocol):
    """What a source format provides.

    A format may also have ``suffixes``, a tuple of the file names' endings it reads
    (``(".parquet",)``; compared case-insensitively): where a source's ``uri`` is a
    folder, only those files are its data, the others are left out (logged).  A format
    without it reads every file of a folder.

    Its ``read`` may also take ``errors="raise"`` (the default) or ``"yield"``: with
    ``"yield"``, a bad row yields ``(row, DataError)`` and the rows after it are read on,
    so that a source under ``on_error: skip`` loses that row alone.  A ``read`` without
    the parameter ends the file at its first bad row, which ``skip`` then sets aside
    whole.
    """

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

#: formats named by import path, once imported in this process (by path)
_IMPORTED: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` to the registry under ``fmt.name`` (the built-in formats do, when
    :mod:`msd_dask.formats` is imported).  A format of your own is named in a config by
    its import path instead: a name registered in one process is unknown to the others."""
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    """The format a source's ``format`` names.

    Parameters
    ----------
    name : str
        A registered format's name, or ``"package.module:Name"``: a format class (made
        with no arguments) or instance, imported here the first time it is asked for.

    Raises
    ------
    ValueError
        No such format; a path that does not import, or names something without
        ``units()`` and ``read()``.
    """
    fmt = FORMATS.get(name) or _IMPORTED.get(name)
    if fmt is not None:
        return fmt
    if ":" not in name:
        raise ValueError(f"unknown format {name!r} (known: {', '.join(sorted(FORMATS))}; or "
                         "'package.module:Name' naming a format of your own)")
    # (imported and made outside any lock of ours: a format that asks for another while it
    # is imported must not wait on itself; two threads at once may both make one, one kept)
    return _IMPORTED.setdefault(name, _imported(name))


def _imported(spec: str) -> Format:
    """The format ``spec`` (``"package.module:Name"``) names, imported."""
    from msd_dask.core.config import resolve_import_path

    try:
        obj = resolve_import_path(spec)
        if isinstance(obj, type):
            obj = obj()
    except Exception as e:  # noqa: BLE001 - whatever stops it (import, constructor) is the path's
        raise ValueError(f"format {spec!r} does not import ({type(e).__name__}: {e}): a format "
                         "of your own must be importable on every worker (installed, or on "
                         "PYTHONPATH), its class made with no arguments") from e
    missing = [m for m in ("units", "read") if not callable(getattr(obj, m, None))]
    if missing:
        # (named by its own name: a function was called 'function'; a review)
        what = getattr(obj, "__qualname__", None) or type(obj).__name__
        raise ValueError(f"format {spec!r} names {what!r}, which has no "
                         f"{' or '.join(m + '()' for m in missing)} (see msd_dask.formats.Format)")
    suffixes = getattr(obj, "suffixes", ())
    if not (isinstance(suffixes, str) or isinstance(suffixes, tuple | list)
            and all(isinstance(x, str) for x in suffixes)):
        # (a None among them failed every listing of a folder with a bare AttributeError)
        raise ValueError(f"format {spec!r} has suffixes {suffixes!r}: a string, or a tuple "
                         "of strings (the names a folder's files end with)")
    return obj
