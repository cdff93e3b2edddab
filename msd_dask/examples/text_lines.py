"""An example source format of your own: one document per line of a UTF-8 text file.

A format is any class (or instance) with ``units(fs, path)`` and ``read(fs, unit,
fields)`` (:class:`msd_dask.formats.Format`); a source names it by import path::

    sources:
      - name: lines
        uri: data/lines/*.txt
        format: msd_dask.examples.text_lines:TextLinesFormat

Like a ``preprocess`` function, it must be importable on every worker (installed, or on
``PYTHONPATH``): the workers list and read the source's files, and each imports the
format the first time it does.  The readers and the process that starts the service
never import it.  What a format must do is what the built-in ones pass in
``tests/unit/test_formats.py``: every row once, in file order, in units that split the
file; a record of exactly the fields asked for; one :class:`~msd_dask.errors.DataError`
naming the file and row for bad input (or, with ``errors="yield"``, that row's error
yielded in its place and the rows after it read on: a source under ``on_error: skip``
then loses only the bad row); every file it opens closed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import closing
from typing import Any

import fsspec

from msd_dask.core.units import Unit
from msd_dask.errors import DataError
from msd_dask.formats.jsonl import file_lines

__all__ = ["TextLinesFormat"]


class TextLinesFormat:
    """Plain UTF-8 text files, a document per line (blank lines are no document).

    A file is one unit; its rows are its lines, counted from 0 (row ``r`` is line
    ``r + 1`` in an editor).  A record has one field, ``text``: the line without its
    line break.  A file whose name says it is compressed (``.gz``, ``.zst``/``.zstd``,
    ``.bz2``, ``.xz``) is decompressed as JSON-lines files are
    (:func:`msd_dask.formats.jsonl.file_lines`).
    """

    name = "text-lines"

    def units(self, fs: fsspec.AbstractFileSystem, path: str) -> list[Unit]:
        """The whole file as one unit (the file is not opened).

        Parameters
        ----------
        fs : fsspec.AbstractFileSystem
            Filesystem holding the file.
        path : str
            The file, as ``fs`` names it.

        Returns
        -------
        list of Unit
            ``[Unit(path, 0, 0)]``.
        """
        return [Unit(path, 0, 0)]

    def read(self, fs: fsspec.AbstractFileSystem, unit: Unit, fields: Sequence[str],
             errors: str = "raise") -> Iterator[tuple[int, dict[str, Any] | DataError]]:
        """Yield ``(row, {"text": line})`` for every line of ``unit.path`` that is not blank.

        Parameters
        ----------
        fs : fsspec.AbstractFileSystem
            Filesystem holding ``unit.path``.
        unit : Unit
            The file to read.
        fields : sequence of str
            The fields to return: ``text`` or none.
        errors : {"raise", "yield"}
            ``"yield"``: a line that is not valid UTF-8 yields ``(row, DataError)`` and the
            lines after it are read on (a corrupt compressed file still raises).

        Raises
        ------
        DataError
            A field other than ``text`` is asked for, or a line is not valid UTF-8
            (naming the file and row); a compressed file is corrupt or cut off (naming the
            file).
        """
        other = [f for f in fields if f != "text"]
        if other:
            raise DataError(f"missing field '{other[0]}' (a text-lines file has only 'text')",
                            path=unit.path, row=unit.row_offset)
        with closing(file_lines(fs, unit.path)) as lines:  # (decompressed, as JSON lines are)
            for row, line in enumerate(lines):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as e:
                    bad = DataError(f"invalid UTF-8: {e.reason} at byte {e.start}",
                                    path=unit.path, row=row)
                    if errors != "yield":
                        raise bad from None
                    yield row, bad
                    continue
                if text.strip():
                    # (the line break alone: a CR of the line's own went too; a review)
                    yield row, {"text": _without_break(text)} if fields else {}


def _without_break(line: str) -> str:
    """``line`` without its line break: one ``\\n``, and one ``\\r`` before it."""
    if line.endswith("\n"):
        line = line[:-1]
        if line.endswith("\r"):
            line = line[:-1]
    return line
