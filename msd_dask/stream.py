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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import DataError
from .formats import Unit

__all__ = ["Piece", "SourceStream", "NeedMetadata", "MetaLookup"]


@dataclass(frozen=True)
class Piece:
    """One chunk of one document, as planned.

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
        return (self.source, self.epoch, self.unit, self.row, self.chunk,
                self.start, self.end, self.doc_len)

    @classmethod
    def from_tuple(cls, t: Sequence[Any]) -> Piece:
        return cls(str(t[0]), *(int(x) for x in t[1:]))


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


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in key]))


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
        self._pieces_cache: tuple[int, int, list[Piece]] | None = None

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
    def _window_pieces(self, lookup: MetaLookup) -> list[Piece]:
        e, w = self.epoch, self.window
        if self._pieces_cache is not None and self._pieces_cache[:2] == (e, w):
            return self._pieces_cache[2]
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
        docs: list[tuple[int, int, int]] = []  # (unit, row, length)
        for u in units:
            off = self.units[u].row_offset
            docs.extend((u, off + i, int(n)) for i, n in enumerate(lengths[u]) if n > 0)
        perm = _rng(self.seed, self._salt, e, w + 1).permutation(len(docs))
        pieces = []
        s = self.seq_len
        for i in perm:
            u, row, n = docs[int(i)]
            for c, start in enumerate(range(0, n, s)):
                pieces.append(Piece(self.name, e, u, row, c, start, min(start + s, n), n))
        self._pieces_cache = (e, w, pieces)
        return pieces

    def peek(self, lookup: MetaLookup) -> Piece:
        """The next piece, without consuming it."""
        empty = 0
        while True:
            pieces = self._window_pieces(lookup)
            if self.offset < len(pieces):
                return pieces[self.offset]
            if not pieces:
                empty += 1
                if empty > self.n_windows:
                    raise DataError("the source has no documents in a whole epoch",
                                    source=self.name)
            self._next_window()

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
        self.epoch = int(state["epoch"])
        self.window = int(state["window"])
        self.offset = int(state["offset"])
        self._pieces_cache = None
