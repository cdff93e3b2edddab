"""The deterministic document stream of one source (pure, no Dask).

A source's stream in epoch ``e`` is a pure function of the seed, the source
name, ``e`` and the files' contents:

1. its units (parquet row groups, JSON-lines files) are permuted with a
   generator seeded by ``(seed, crc32(name), e)``;
2. consecutive runs of ``shuffle_window`` units form a *window*; the documents
   of a window are permuted together (the bounded shuffle buffer);
3. a document longer than ``seq_len`` tokens becomes ``ceil(L / seq_len)``
   pieces (chunks).

Nothing here depends on how many loaders read the units or when they answer,
so the stream, and every plan built from it, is the same whatever the cluster.
Every unit appears once per epoch and every row of a unit once, so each
document is delivered exactly once per source epoch.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from msd_dask.core._kernels import chunk_rows, compiled
from msd_dask.core.units import Unit
from msd_dask.errors import DataError

__all__ = ["Piece", "SourceStream", "NeedMetadata", "MetaLookup", "Window", "fits_int32", "kept_lengths"]


class Piece(NamedTuple):
    """One chunk of one document, as planned (immutable, hashable).

    A named tuple, so a step's hundreds of thousands of pieces are cheap to
    make; it compares equal only to another :class:`Piece` (never to a plain
    tuple), as a frozen dataclass would.

    Attributes
    ----------
    source : str
    epoch : int
        The source epoch the document was drawn in.
    unit : int
        Index of the document's unit in the source's sorted unit list.
    row : int
        The document's row within its file.
    chunk : int
        Index of this chunk within the document.
    start, end : int
        Token range ``[start, end)`` of the document this piece covers.
    doc_len : int
        The document's full length in tokens (end-of-document id included).
    """

    source: str
    epoch: int
    unit: int
    row: int
    chunk: int
    start: int
    end: int
    doc_len: int

    @property
    def length(self) -> int:
        return self.end - self.start

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(self)

    @classmethod
    def from_tuple(cls, t: Sequence[Any]) -> Piece:
        return cls(str(t[0]), *(int(x) for x in t[1:]))

    def __eq__(self, other: object) -> bool:
        return other.__class__ is self.__class__ and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return tuple.__hash__(self)


#: ``Piece`` from an iterable of its 8 fields, without the checks of ``Piece._make``
#: (for the planner's bulk conversions)
new_piece: Callable[[Iterable[Any]], Piece] = partial(tuple.__new__, Piece)


class NeedMetadata(LookupError):
    """Raised by a :data:`MetaLookup` for units whose lengths are not known yet."""

    def __init__(self, source: str, units: list[tuple[int, int]]):
        self.source = source
        self.units = units  # [(epoch, unit_index)]
        super().__init__(f"source {source!r} needs metadata of units {units}")


#: ``lookup(source, epoch, unit_index) -> lengths`` of the unit's rows
#: (``row_offset + i`` has length ``lengths[i]``; a negative length marks a
#: row that was skipped as bad input).  Raises :class:`NeedMetadata`.
MetaLookup = Callable[[str, int, int], np.ndarray]


def kept_lengths(lengths: Any) -> np.ndarray:
    """A unit's row lengths as a planner keeps them for its :data:`MetaLookup`: a copy of
    its own, int32 where every value fits (a planner at dp 16,384 × 128K holds those of
    thousands of units).

    Parameters
    ----------
    lengths : array_like of int
        Each row's length in tokens (negative: a row skipped as bad input).
    """
    given = np.asarray(lengths).reshape(-1)
    return given.astype(np.int32 if fits_int32(given) else np.int64)  # (astype: a copy)


def fits_int32(table: np.ndarray | None) -> bool:
    """Whether every value of ``table`` (None: no table) fits in int32: the rule of every
    piece table and list of lengths a planner narrows to int32 (:class:`Window`)."""
    if table is None or table.size == 0 or np.can_cast(table.dtype, np.int32):
        return True
    return bool(table.min() >= np.iinfo(np.int32).min and table.max() <= np.iinfo(np.int32).max)


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]))


def _chunked(epoch: int, unit: np.ndarray, row: np.ndarray, length: np.ndarray, seq_len: int,
             longest: int, dtype: type[np.integer[Any]]) -> np.ndarray:
    """The piece table (:attr:`Window.table`) of documents in order: each in ``seq_len``
    chunks, consecutively (``longest``: the longest document; every ``length`` > 0, as
    :meth:`SourceStream._window` keeps them)."""
    k = (length + (seq_len - 1)) // seq_len if longest > seq_len else None
    table = np.empty((len(length) if k is None else int(k.sum()), 7), dtype=dtype)
    # one pass over the documents where the planner compiled its kernels (a large step's),
    # else numpy's passes, a column at a time
    if compiled():
        chunk_rows(epoch, unit, row, length, seq_len, table)
        return table
    if k is None:  # a piece per document: chunk 0, from token 0, the whole document
        table[:, 0] = epoch
        table[:, 1] = unit
        table[:, 2] = row
        table[:, 3:5] = 0
        table[:, 5] = length
        table[:, 6] = length
        return table
    first = np.cumsum(k)
    first -= k
    chunk = np.arange(len(table), dtype=np.int64)
    chunk -= np.repeat(first, k)
    length = np.repeat(length, k)
    table[:, 0] = epoch
    table[:, 1] = np.repeat(unit, k)
    table[:, 2] = np.repeat(row, k)
    table[:, 3] = chunk
    chunk *= seq_len  # (the chunks' starts)
    table[:, 4] = chunk
    chunk += seq_len
    table[:, 5] = np.minimum(chunk, length, out=chunk)
    table[:, 6] = length
    return table


class Window:
    """The pieces of one window of a source's stream, in stream order, as columns.

    Attributes
    ----------
    epoch, window : int
    table : ndarray of int32 or int64, shape (n, 7)
        Per piece ``epoch, unit, row, chunk, start, end, doc_len`` (a
        :class:`Piece` without its source); int32 where every value fits, else
        int64 (a planner holds the tables of every window a step draws from).
    """

    __slots__ = ("epoch", "window", "table")

    def __init__(self, epoch: int, window: int, table: np.ndarray):
        self.epoch, self.window, self.table = epoch, window, table


class SourceStream:
    """Position in, and order of, one source's document stream.

    Parameters
    ----------
    name : str
        The source name (part of the shuffle seed).
    units : list of Unit
        All units of the source, sorted.
    seed : int
        The service seed.
    shuffle_window : int
        Units whose documents are shuffled together.
    seq_len : int
        Longest piece, in tokens.
    """

    def __init__(self, name: str, units: Sequence[Unit], seed: int, shuffle_window: int,
                 seq_len: int):
        if not units:
            raise DataError("the source has no readable units (empty files?)", source=name)
        self.name = name
        self.units = list(units)
        self.seed = seed
        self.window_size = shuffle_window
        self.seq_len = seq_len
        self._salt = zlib.crc32(name.encode("utf-8"))
        # position: the next piece is pieces(epoch, window)[offset]
        self.epoch = 0
        self.window = 0
        self.offset = 0
        self._order_cache: dict[int, np.ndarray] = {}
        self._position_cache: dict[int, np.ndarray] = {}
        self._window_cache: Window | None = None

    # ------------------------------------------------------------------ order
    @property
    def n_windows(self) -> int:
        return -(-len(self.units) // self.window_size)

    def unit_order(self, epoch: int) -> np.ndarray:
        """Unit indices in the order epoch ``epoch`` reads them."""
        perm = self._order_cache.get(epoch)
        if perm is None:
            perm = _rng(self.seed, self._salt, epoch).permutation(len(self.units))
            self._order_cache = {e: p for e, p in self._order_cache.items() if e >= epoch - 1}
            self._order_cache[epoch] = perm
        return perm

    def window_of(self, epoch: int, unit: int) -> int:
        """The window of epoch ``epoch`` that reads ``unit``."""
        pos = self._position_cache.get(epoch)
        if pos is None:
            pos = np.empty(len(self.units), dtype=np.int64)
            pos[self.unit_order(epoch)] = np.arange(len(self.units))
            self._position_cache = {e: p for e, p in self._position_cache.items()
                                    if e >= epoch - 1}
            self._position_cache[epoch] = pos
        return int(pos[unit]) // self.window_size

    def window_units(self, epoch: int, window: int) -> list[int]:
        order = self.unit_order(epoch)
        return [int(u) for u in order[window * self.window_size:(window + 1) * self.window_size]]

    def upcoming_units(self, n: int) -> list[tuple[int, int]]:
        """``(epoch, unit)`` of the current window and of the ``n`` units after it.

        Never looks further than the next epoch, so a tiny source is not read
        many epochs ahead.
        """
        epoch, window = self.epoch, self.window
        out = [(epoch, u) for u in self.window_units(epoch, window)]
        limit = len(out) + n
        while len(out) < limit:
            window += 1
            if window >= self.n_windows:
                epoch, window = epoch + 1, 0
                if epoch > self.epoch + 1:
                    break
            out.extend((epoch, u) for u in self.window_units(epoch, window))
        return out[:limit]

    # ----------------------------------------------------------------- pieces
    def _window(self, lookup: MetaLookup) -> Window:
        """The current window's pieces (cached until the window changes)."""
        e, w = self.epoch, self.window
        cached = self._window_cache
        if cached is not None and cached.epoch == e and cached.window == w:
            return cached
        units = self.window_units(e, w)
        missing = []
        lengths: dict[int, np.ndarray] = {}
        for u in units:
            try:
                lengths[u] = lookup(self.name, e, u)
            except NeedMetadata as nm:
                missing.extend(nm.units)
        if missing:
            raise NeedMetadata(self.name, missing)
        # the documents (unit, row, length), units in window order, rows in file order
        per_unit = [np.asarray(lengths[u]).reshape(-1) for u in units]
        counts = [len(n) for n in per_unit]
        given = np.concatenate(per_unit) if per_unit else np.zeros(0, np.int64)
        du = np.repeat(np.asarray(units, dtype=np.int64), counts)
        # (a row: its unit's row offset plus its place in the unit)
        dr = np.repeat(np.asarray([self.units[u].row_offset for u in units], dtype=np.int64)
                       - np.cumsum([0, *counts[:-1]], dtype=np.int64), counts)
        dr += np.arange(len(given))
        keep = given > 0
        dn = given.astype(np.int64)
        if not keep.all():
            du, dr, dn = du[keep], dr[keep], dn[keep]
        longest = int(dn.max(initial=0))
        narrow = max(e, len(self.units), int(dr.max(initial=0)), longest) < 2**31
        perm = _rng(self.seed, self._salt, e, w + 1).permutation(len(dn))
        table = _chunked(e, du[perm], dr[perm], dn[perm], self.seq_len, longest,
                         np.int32 if narrow else np.int64)
        self._window_cache = win = Window(e, w, table)
        return win

    def current(self, lookup: MetaLookup) -> Window:
        """The window holding the next piece (moving past exhausted windows): its
        ``offset``-th piece is the next.

        A ``DataError`` once every window of one epoch is empty (not for empty windows
        in a row across two epochs: the units are shuffled each epoch, and the empty
        ones at the end of one and the start of the next were taken for an empty
        source; a review)."""
        run = 0  # empty windows in a row from the first window of an epoch
        counting = self.window == 0
        while True:
            win = self._window(lookup)
            if self.offset < len(win.table):
                return win
            if self.offset > len(win.table):  # (a loaded state's: the draw stops at its end)
                raise ValueError(
                    f"the stream of source {self.name!r}: offset {self.offset} is past the "
                    f"{len(win.table)} pieces of window {self.window} of epoch {self.epoch}: "
                    "a state of another config or corpus?")
            if len(win.table):
                counting = False
            elif counting:
                run += 1
                if run >= self.n_windows:
                    raise DataError("the source has no documents in a whole epoch",
                                    source=self.name)
            self._next_window()
            if self.window == 0:
                counting, run = True, 0

    def peek(self, lookup: MetaLookup) -> Piece:
        """The next piece, without consuming it."""
        win = self.current(lookup)
        return Piece(self.name, *win.table[self.offset].tolist())

    def advance(self) -> None:
        """Consume the piece :meth:`peek` returned."""
        self.offset += 1

    def _next_window(self) -> None:
        self.window += 1
        self.offset = 0
        if self.window >= self.n_windows:
            self.window = 0
            self.epoch += 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "window": self.window, "offset": self.offset}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Take a position of :meth:`state_dict`.

        Raises
        ------
        ValueError
            A position this stream cannot be at (a state of another corpus or config),
            naming the field: a negative epoch or offset, a window past this source's
            windows.  (Taken, a window past them skipped to the next epoch and a negative
            one read a window counted from the end: documents skipped or served twice,
            with nothing said.)  An offset past its window's pieces is refused once the
            window's lengths are known (:meth:`current`).
        """
        epoch, window, offset = (int(state["epoch"]), int(state["window"]),
                                 int(state["offset"]))
        where = f"the stream of source {self.name!r}"
        if epoch < 0:
            raise ValueError(f"{where}: epoch must be >= 0, got {epoch}")
        if not 0 <= window < self.n_windows:
            raise ValueError(f"{where}: window {window} is not one of its {self.n_windows} "
                             f"windows (0-{self.n_windows - 1}): a state of another config "
                             "or corpus?")
        if offset < 0:
            raise ValueError(f"{where}: offset must be >= 0, got {offset}")
        self.epoch, self.window, self.offset = epoch, window, offset
        self._window_cache = None
