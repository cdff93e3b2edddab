"""The planner's decisions (pure, no Dask): which pieces form a step, and where each goes.

:class:`Planner` is the single decision point of a service.  Each step it
draws pieces from the sources' streams in the order the :class:`~msd_dask.core.mixing.Mixer`
picks (token shares follow the weights in force), fills the step's
``dp × micro_batches × seq_len`` token capacity, and assigns pieces to DP
ranks and micro-batches with the configured balance strategy.  Pieces that do
not fit are carried, in order, to the front of the next step, so every piece
is delivered exactly once.  Its whole state is a JSON-able dict (:meth:`Planner.state_dict`),
or a :class:`PlannerSnapshot` taken without a pass over its pieces.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from msd_dask.core._kernels import (
    compile_for,
    compiled,
    gather_rows,
    permute_rows,
    row_order,
    stable_argsort,
)
from msd_dask.core.balance import lower_bound
from msd_dask.core.config import Config, cost_model_problem, rows_kept_empty
from msd_dask.core.cost import CostModel
from msd_dask.core.gcpause import gc_paused
from msd_dask.core.mixing import Mixer
from msd_dask.core.row_placement import place_step, spread_long
from msd_dask.core.stream import MetaLookup, NeedMetadata, Piece, SourceStream, fits_int32, new_piece
from msd_dask.core.units import Unit

#: pieces made at a time from a piece table (see Planner._pieces)
_SLICE = 4096

#: outliers held at most, in release groups (a source whose next piece finds the hold
#: full waits for the next release)
HOLD_GROUPS = 4

#: held outliers are released as a group once its longest piece is at most this many times
#: its shortest (or once they are held too long, or the hold is full)
RELEASE_SPREAD = 1.25

__all__ = ["Planner", "PlannerSnapshot", "StepPlan", "NeedMetadata", "change_step", "distinct",
           "pieces_of", "unit_keys", "units_of"]


def change_step(from_step: Any) -> int | None:
    """``from_step`` of a change of the mix (:meth:`Planner.set_weights`) as an ``int``, or
    ``None`` (the first unplanned step); a :class:`ValueError` naming ``set_weights`` for
    anything but an integer (a float was cut to a step, a bool taken for 0 or 1)."""
    if from_step is None:
        return None
    if isinstance(from_step, bool) or not isinstance(from_step, numbers.Integral):
        raise ValueError(f"set_weights: from_step must be a step (an integer), got {from_step!r}")
    if not from_step < STEP_LIMIT:  # (10**400 failed every later largest_weights() with
        # an OverflowError, in the adaptive policy's poll: a review)
        raise ValueError(f"set_weights: from_step must be a step below 2**31, got {from_step!r}")
    return int(from_step)


#: steps are below this (they travel as int32): the bound of a change of the mix's step,
#: given live (:func:`change_step`) or in a state (:func:`state_overrides`)
STEP_LIMIT = 2**31


def checked_change(weights: Any, cfg: Config, what: str) -> dict[str, float]:
    """The weights of a change of the mix, live (:meth:`Planner.set_weights`) or in a state
    (:func:`state_overrides`), as the planner takes them (:func:`checked_weights`), and
    refused where they leave rows empty under ``long_context.max_per_rank``
    (:func:`~msd_dask.core.config.rows_kept_empty`): a ``ValueError`` that starts with
    ``what`` (a state's change was taken that ``set_weights`` refuses; a review)."""
    w = checked_weights(weights, [s.name for s in cfg.sources], what)
    _refuse_empty_rows(w, cfg, what)
    return w


def _refuse_empty_rows(w: dict[str, float], cfg: Config, what: str) -> None:
    """:func:`checked_change`'s refusal of weights ``w`` that leave rows empty."""
    empty = rows_kept_empty(cfg.long_context.max_per_rank, cfg.batch.micro_batches,
                            cfg.sources, w)
    if empty is not None:
        raise ValueError(f"{what}: {empty} (long_context.max_per_rank): give a source of "
                         "context: short weight too")


@dataclass
class StepPlan:
    """The plan of one step.

    Attributes
    ----------
    step : int
    table : ndarray of int32 or int64, shape (n, 8)
        The step's pieces, row by row (DP rank, then micro-batch, each row in
        order): source index (in ``sources``), epoch, unit, row, chunk, start,
        end, doc_len, as the fields of :class:`~msd_dask.core.stream.Piece`;
        int32 where every value of the step's pieces fits (a step at dp 16,384
        x 128K holds millions of pieces), else int64.
    row_sizes : ndarray of int64, shape (dp, micro_batches)
        Pieces in each row.
    sources : tuple of str
    rank_cost : list of float
        Cost of each DP rank under the cost model.
    lower_bound : float
        ``max(mean rank cost, largest piece cost)``.
    weights : dict of str to float
        The weights in force.
    source_tokens : dict of str to int, optional
        :meth:`tokens_by_source`, where the planner counted them already (else
        counted when asked for).
    """

    step: int
    table: np.ndarray
    row_sizes: np.ndarray
    sources: tuple[str, ...]
    rank_cost: list[float]
    lower_bound: float
    weights: dict[str, float] = field(default_factory=dict)
    source_tokens: dict[str, int] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_rows(cls, step: int, rows: Sequence[Sequence[Sequence[Piece]]], rank_cost: list[float],
                  lower_bound: float, sources: Sequence[str],
                  weights: dict[str, float] | None = None) -> StepPlan:
        """A plan from ``rows[dp_rank][micro_batch]`` lists of pieces."""
        index = {n: i for i, n in enumerate(sources)}
        flat = [p for rank in rows for row in rank for p in row]
        table = np.array([[index[p.source], *p[1:]] for p in flat], dtype=np.int64).reshape(-1, 8)
        mb = len(rows[0]) if len(rows) else 0
        sizes = np.array([[len(row) for row in rank] for rank in rows], dtype=np.int64)
        return cls(step, table, sizes.reshape(len(rows), mb), tuple(sources), rank_cost, lower_bound,
                   dict(weights or {}))

    @cached_property
    def rows(self) -> list[list[list[Piece]]]:
        """``rows[dp_rank][micro_batch]``: the pieces of each row, in order (made when first read)."""
        flat = pieces_of(self.table, self.sources)
        dp, mb = self.row_sizes.shape
        bounds = [0, *np.cumsum(self.row_sizes.reshape(-1)).tolist()]
        lists = [flat[i:j] for i, j in zip(bounds[:-1], bounds[1:], strict=True)]
        return [lists[r * mb:(r + 1) * mb] for r in range(dp)]

    @property
    def imbalance(self) -> float:
        mean = sum(self.rank_cost) / len(self.rank_cost)
        return max(self.rank_cost) / mean if mean > 0 else 1.0

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each piece (int64), in the order of :attr:`table`."""
        return _lengths(self.table).astype(np.int64, copy=False)

    def rank_features(self) -> np.ndarray:
        """Each DP rank's ``(ΣL, ΣL²)`` over its pieces' lengths ``L``, shape (dp, 2): what
        the cost fitter (:class:`~msd_dask.core.cost.CostFitter`) takes of a rank's step."""
        dp = self.row_sizes.shape[0]
        rank = np.repeat(np.arange(dp), self.row_sizes.sum(axis=1))
        lengths = np.subtract(self.table[:, 6], self.table[:, 5], dtype=np.float64)
        return np.stack([np.bincount(rank, weights=lengths, minlength=dp),
                         np.bincount(rank, weights=lengths * lengths, minlength=dp)], axis=1)

    def pieces(self) -> list[Piece]:
        return pieces_of(self.table, self.sources)

    def units(self) -> set[tuple[str, int, int]]:
        """``(source, epoch, unit)`` of every unit the step's pieces come from."""
        return units_of(self.table, self.sources)

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens of each source with pieces in the step."""
        if self.source_tokens is None:
            pieces, tokens = _by_source(self.table[:, 0], self.lengths, len(self.sources))
            self.source_tokens = {self.sources[j]: int(tokens[j])
                                  for j in np.flatnonzero(pieces).tolist()}
        return dict(self.source_tokens)


def _by_source(source: np.ndarray, lengths: np.ndarray, n_sources: int) -> tuple[np.ndarray, np.ndarray]:
    """The pieces (int64) and tokens (float64, exact: a step's tokens are far fewer than
    2**53) of each of ``n_sources`` sources, given each piece's source and length (int or
    float)."""
    source = source.astype(np.intp, copy=False)  # (one conversion for both counts)
    return (np.bincount(source, minlength=n_sources),
            np.bincount(source, weights=lengths, minlength=n_sources))


def units_of(table: np.ndarray, sources: Sequence[str]) -> set[tuple[str, int, int]]:
    """``(source, epoch, unit)`` of every unit the pieces of a piece table come from.

    One int64 key per piece (:func:`unit_keys`); the keys present are read from a table
    of flags (or sorted, as :func:`distinct` would) and split into their columns again:
    ``np.unique(..., axis=0)`` over the three columns took seconds for the millions of
    pieces of a step at dp 16,384 × 128K.
    """
    if not len(table):
        return set()
    key, (n_sources, n_epochs, n_units) = _unit_keys(table[:, 0], table[:, 1], table[:, 2])
    span = n_sources * n_epochs * n_units
    if _flags_for(len(key), span):
        found = np.flatnonzero(_flags(key, span))
    else:
        found = np.unique(key)
    del key
    unit = (found % n_units).tolist()
    found //= n_units
    epoch = (found % n_epochs).tolist()
    found //= n_epochs
    return {(sources[s], e, u) for s, e, u in zip(found.tolist(), epoch, unit, strict=True)}


def unit_keys(source: np.ndarray, epoch: np.ndarray, unit: np.ndarray) -> tuple[np.ndarray, int]:
    """One int64 key per piece for its ``(source, epoch, unit)`` (non-negative columns of a
    piece table), in the order of the triples, and the keys' span (each key is below it)."""
    key, (n_sources, n_epochs, n_units) = _unit_keys(source, epoch, unit)
    return key, n_sources * n_epochs * n_units


def _unit_keys(source: np.ndarray, epoch: np.ndarray,
               unit: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
    """:func:`unit_keys`' keys, ``(source · n_epochs + epoch) · n_units + unit``, and
    ``(n_sources, n_epochs, n_units)``, each one more than its column's largest value."""
    n_sources = int(source.max()) + 1 if len(source) else 1
    n_epochs = int(epoch.max()) + 1 if len(epoch) else 1
    n_units = int(unit.max()) + 1 if len(unit) else 1
    # (a pass or two per column: the columns of a step's table are millions of strided values)
    key = np.multiply(source, n_epochs * n_units, dtype=np.int64)
    if n_epochs > 1:  # (else every epoch is 0)
        key += np.multiply(epoch, n_units, dtype=np.int64)
    key += unit
    return key, (n_sources, n_epochs, n_units)


def distinct(key: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``key`` (int64, each in ``[0, span)``; overwritten), in
    increasing order: the index of an occurrence of each, and the position of each key's
    value in that order (int64).

    Through a table of ``span`` flags where ``span`` is at most ``max(len(key), 2**22)``
    (a step's units, a constructor's paths: linear, where the sort of
    :func:`_first_and_inverse` took 0.7 s for the 3.4M keys of a step at dp 16,384 x 128K),
    else by that sort.
    """
    n = len(key)
    if n == 0 or not _flags_for(n, span):
        return _first_and_inverse(key)
    ids = np.cumsum(_flags(key, span), dtype=np.int64)
    ids -= 1
    # each key's position, in place of the keys, and an occurrence of each, a slice at a time
    # (``out`` overlapping the indices, ``np.take`` would copy them all first, and the
    # occurrences' positions are as many: at dp 16,384 x 128K this was the planner's peak)
    for a in range(0, n, _TAKE_SLICE):
        np.take(ids, key[a:a + _TAKE_SLICE], out=key[a:a + _TAKE_SLICE])
    one = np.empty(int(ids[-1]) + 1, dtype=np.int64)
    del ids
    for a in range(0, n, _TAKE_SLICE):  # (any occurrence will do)
        one[key[a:a + _TAKE_SLICE]] = np.arange(a, min(a + _TAKE_SLICE, n), dtype=np.int64)
    return one, key


#: keys :func:`distinct` handles at a time
_TAKE_SLICE = 1 << 16


def _flags_for(n: int, span: int) -> bool:
    """Whether ``n`` keys in ``[0, span)`` are made distinct through a table of ``span`` flags
    (linear), not a sort: where the table is no larger than the keys, or than 4 MiB."""
    return span <= max(n, 1 << 22)


def _flags(key: np.ndarray, span: int) -> np.ndarray:
    """A flag for each value in ``[0, span)``: whether it is one of ``key``."""
    present = np.zeros(span, dtype=bool)
    present[key] = True
    return present


def _first_and_inverse(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(key, return_index=True, return_inverse=True)[1:]``, made with fewer arrays
    of ``len(key)`` alive at once; ``key`` (int64) is overwritten.

    Returns
    -------
    first : ndarray of int
        The index of each distinct key's first occurrence, in increasing key order.
    inverse : ndarray of int64
        The position of each key's value in that order.
    """
    n = len(key)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    perm = np.argsort(key, kind="stable")
    new = np.empty(n, dtype=bool)
    new[0] = True
    np.take(key, perm, out=key)  # sorted, in place of the keys
    np.not_equal(key[1:], key[:-1], out=new[1:])
    first = perm[new]
    np.cumsum(new, out=key)
    key -= 1
    del new
    inverse = np.empty(n, dtype=np.int64)
    inverse[perm] = key
    return first, inverse




def pieces_of(table: np.ndarray, sources: Sequence[str]) -> list[Piece]:
    """:class:`Piece` objects of a piece table (source index, epoch, unit, row, chunk, start,
    end, doc_len)."""
    out: list[Piece] = []
    # in slices: ``tolist`` and a ``map`` over a builtin hold the GIL throughout (tens
    # of ms for a step of 10⁵ pieces), and the planner's actor plans in a thread while
    # its worker's event loop answers calls (roles.planner.PlannerActor)
    for i in range(0, len(table), _SLICE):
        cols = table[i:i + _SLICE].T.tolist()
        out.extend(map(new_piece, zip([sources[j] for j in cols[0]], *cols[1:], strict=True)))
    return out


@dataclass(frozen=True, eq=False)
class PlannerSnapshot:
    """The planner's whole state after a step, as :meth:`Planner.snapshot` takes it.

    Taken without a pass over the pieces: ``carry``, ``held`` and ``held_step`` are
    the planner's own tables, which it replaces each step and never writes to, so
    a snapshot stays the state of its step (the rest is copied).  At dp 16,384 ×
    128K a step carries and holds about 10⁶ pieces, and :meth:`to_state`, a list
    per piece, takes seconds: the planner's actor keeps a snapshot of each recent
    step (compressed) and makes the JSON form only when asked for it.

    Attributes
    ----------
    step : int
        The next step to plan.
    sources : tuple of str
        The sources in config order (column 0 of the tables indexes it).
    streams, mixer : dict
        Each stream's position and the mixer's credit.
    carry, held : ndarray of int, shape (n, 8)
        Piece tables: the pieces carried to the next step, the outliers held back.
    held_step : ndarray of int64
        The step each held outlier was drawn at.
    overrides : tuple of (int, dict)
        Live weight changes: (from_step, {source: weight}).
    tokens, pieces : dict
        Tokens and pieces planned so far, per source.
    cost : (float, float)
        The cost model's linear and quadratic coefficients.
    """

    step: int
    sources: tuple[str, ...]
    streams: dict[str, dict[str, int]]
    mixer: dict[str, float]
    carry: np.ndarray
    held: np.ndarray
    held_step: np.ndarray
    overrides: tuple[tuple[int, dict[str, float]], ...]
    tokens: dict[str, int]
    pieces: dict[str, int]
    cost: tuple[float, float]

    def to_state(self) -> dict[str, Any]:
        """The JSON-serialisable form (:meth:`Planner.state_dict`): the pieces as lists of
        ``[source, epoch, unit, row, chunk, start, end, doc_len]``."""
        names = self.sources
        n_carry, n_held = len(self.carry), len(self.held)
        # in slices, with the collector paused: a ``tolist`` of 10^6 rows, or freeing a list
        # of 10^6 lists, is one C call that holds the GIL for a second or so, and the
        # collector's passes over the new lists find nothing; this runs in a thread beside
        # the worker's event loop and the planning thread
        with gc_paused():
            carry = [[names[t[0]], *t[1:]] for i in range(0, n_carry, _SLICE)
                     for t in self.carry[i:i + _SLICE].tolist()]
            held = [[[names[t[0]], *t[1:]], s] for i in range(0, n_held, _SLICE)
                    for t, s in zip(self.held[i:i + _SLICE].tolist(),
                                    self.held_step[i:i + _SLICE].tolist(), strict=True)]
        return {
            "step": self.step,
            "streams": {k: dict(s) for k, s in self.streams.items()},
            "mixer": dict(self.mixer),
            "carry": carry,
            "held": held,
            "overrides": [[s, dict(w)] for s, w in self.overrides],
            "tokens": dict(self.tokens),
            "pieces": dict(self.pieces),
            "cost": list(self.cost),
        }


class Planner:
    """Plans steps from the sources' streams.

    Parameters
    ----------
    cfg : Config
    units : mapping of source name to list of Unit
        Every source's units, sorted.
    """

    def __init__(self, cfg: Config, units: Mapping[str, Sequence[Unit]]):
        self.cfg = cfg
        seq_len = cfg.batch.seq_len
        self.streams = {
            s.name: SourceStream(s.name, units[s.name], cfg.seed, s.shuffle_window, seq_len)
            for s in cfg.sources
        }
        self.mixer = Mixer([s.name for s in cfg.sources])
        self.long_sources = {s.name for s in cfg.sources if s.context == "long"}
        self.cost = CostModel.from_config(cfg.cost)
        self.step = 0
        #: the sources in config order; a piece table's column 0 indexes this list
        self._names = [s.name for s in cfg.sources]
        self._index = {n: i for i, n in enumerate(self._names)}
        #: pieces carried to the next step, in order (a piece table, see :meth:`_table`)
        self._carry = _no_pieces()
        #: outliers held back (``cfg.outliers``), oldest first, and the step each was drawn at
        self._held = _no_pieces()
        self._held_step = np.zeros(0, dtype=np.int64)
        #: live weight changes: (from_step, {source: weight}), in the order made
        self.overrides: list[tuple[int, dict[str, float]]] = []
        self.tokens = {s.name: 0 for s in cfg.sources}
        self.pieces_planned = {s.name: 0 for s in cfg.sources}
        #: the last draw's pieces taken and lengths looked at: the sizes the next draw's
        #: buffers start at (steps alike draw alike; growing them copies millions of keys)
        self._draw_sizes = (0, 0)

    # ------------------------------------------------------------ piece tables
    # A step's pieces are rows of an integer table (int64 from :meth:`_table`; a step's
    # own, and its carry, int32 where every value fits): source index (in ``_names``), epoch,
    # unit, row, chunk, start, end, doc_len; :class:`Piece` objects are made only for
    # what leaves the planner (a plan's rows, ``pending()``, ``state_dict()``).
    def _pieces(self, table: np.ndarray) -> list[Piece]:
        return pieces_of(table, self._names)

    def _table(self, tuples: Sequence[Sequence[Any]], what: str = "pieces") -> np.ndarray:
        """``tuples`` (a state's pieces, ``(source, 7 integers)``) as a table; a
        ``ValueError`` naming the first bad one as ``what[i]``."""
        if not tuples:
            return _no_pieces()
        index = self._index
        try:  # (one pass where every piece is whole: at dp 16,384 x 128K about 10^6)
            if all(len(t) == 8 and str(t[0]) in index and all(type(x) is int for x in t[1:])
                   for t in tuples):
                table = np.array([[index[str(t[0])], *t[1:]] for t in tuples],
                                 dtype=np.int64).reshape(len(tuples), 8)
                self._refuse_pieces(table, what)
                return table
        except (TypeError, OverflowError):
            pass
        for i, t in enumerate(tuples):  # the first that is not
            try:
                ok = len(t) == 8 and str(t[0]) in index
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"{what}[{i}]: a piece {t!r} is not (source, 7 integers) of "
                                 f"a source of {self._names}")
            for k, x in enumerate(t[1:], 1):  # (a float was cut, a row of 2.7 read as 2)
                at = f"{what}[{i}][{k}] ({_PIECE_FIELDS[k]})"
                if _whole(at, x) >= 2**63:
                    raise ValueError(f"{at}: {x!r} is out of int64's range")
        table = np.array([[index[str(t[0])], *map(int, t[1:])] for t in tuples],
                         dtype=np.int64).reshape(len(tuples), 8)
        self._refuse_pieces(table, what)
        return table

    def _refuse_pieces(self, table: np.ndarray, what: str) -> None:
        """A ``ValueError`` naming the first piece of a state's ``table`` that no stream of
        this config could have drawn (as ``what[i]``): a unit past its source's units, a
        negative field, or a token range ``[start, end)`` that is empty, passes its
        document's length or is longer than a row (a carried piece of a unit that does not
        exist was taken, and the step that placed it failed at the lookup; a review)."""
        n_units = np.array([len(self.streams[n].units) for n in self._names], dtype=np.int64)
        src, unit, start, end, doc_len = (table[:, c] for c in (0, 2, 5, 6, 7))
        checks = (
            ("a negative field", (table[:, 1:] < 0).any(axis=1)),
            ("a unit its source does not have", unit >= n_units[src]),
            ("an empty token range", end <= start),
            ("a token range past its document's length", end > doc_len),
            (f"more tokens than a row of {self.cfg.batch.seq_len}",
             end - start > self.cfg.batch.seq_len),
        )
        for why, bad in checks:
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                piece = Piece(self._names[int(src[i])], *table[i, 1:].tolist())
                detail = (f" (source {piece.source!r} has {int(n_units[src[i]])} units)"
                          if why.startswith("a unit") else "")
                raise ValueError(f"{what}[{i}]: {piece} has {why}{detail}: not a piece of "
                                 "this config's sources")

    @property
    def carry(self) -> list[Piece]:
        """Pieces carried to the next step, in order."""
        return self._pieces(self._carry)

    @property
    def held(self) -> list[tuple[Piece, int]]:
        """Outliers held back: (piece, step it was drawn at), oldest first."""
        return list(zip(self._pieces(self._held), self._held_step.tolist(), strict=True))

    # ----------------------------------------------------------------- weights
    def weights_at(self, step: int) -> dict[str, float]:
        """Normalised weights in force at ``step`` (schedule, then live changes).

        For a step before the one given to :meth:`forget_overridden`, the changes it
        forgot are missing.
        """
        raw = {s.name: s.weight.at(step) for s in self.cfg.sources}
        for start, w in self.overrides:
            if start <= step:
                # in the config's order whatever the override's (a state saved with
                # sorted keys must resume with the same sums, to the last bit)
                raw = {n: float(w.get(n, 0.0)) for n in raw}
        total = sum(raw.values())
        return {k: v / total for k, v in raw.items()}

    def largest_weights(self, lookahead: int) -> dict[str, float]:
        """Each source's largest normalised weight over the steps from the next to
        ``lookahead`` steps after it (:meth:`weights_at`).

        Exact: the raw weights are linear or constant between the schedules'
        breakpoints and the live changes' first steps, so each normalised weight is
        monotone between them, and the steps around each and at the two ends are enough
        (21 steps sampled over the window missed a phase shorter than a twentieth of it;
        a review)."""
        start, end = self.step, self.step + max(0, int(lookahead))
        kinks = [b for src in self.cfg.sources for b in src.weight.breakpoints()]
        kinks += [first for first, _ in self.overrides]
        steps = {start, end} | {st for b in kinks if math.isfinite(b)
                                for st in (math.floor(b) - 1, math.floor(b), math.ceil(b))
                                if start <= st <= end}
        out = dict.fromkeys(self._names, 0.0)
        for st in sorted(steps):
            for k, v in self.weights_at(st).items():
                out[k] = max(out[k], v)
        return out

    def set_weights(self, weights: Mapping[str, float], from_step: int | None = None) -> int:
        """Replace the weights from ``from_step`` (default: the first unplanned step) on.

        Returns the step the change takes effect at.
        """
        from_step = change_step(from_step)
        # (a change leaving rows empty was taken, and every step after: a review)
        w = checked_change(weights, self.cfg, "set_weights")
        start = self.step if from_step is None else max(int(from_step), self.step)
        self.overrides.append((start, w))
        return start


    # ---------------------------------------------------------------- planning
    def plan_step(self, lookup: MetaLookup) -> StepPlan:
        """Plan the next step.

        Raises
        ------
        NeedMetadata
            When a unit's lengths are not known yet; the planner's state is
            unchanged, so the caller fetches them and calls again.
        """
        # what a step changes before its last lookup: the streams' positions, the
        # mixer's credit and the held outliers (the other fields change only after it,
        # and the piece tables are replaced, never written to)
        saved = ([(st.epoch, st.window, st.offset) for st in self.streams.values()],
                 self.mixer.state_dict(), self._held, self._held_step)
        # a step's objects live on, so collector passes meanwhile find nothing (see gcpause)
        with gc_paused():
            try:
                return self._plan(lookup)
            except NeedMetadata:
                positions, credit, self._held, self._held_step = saved
                for st, (e, w, o) in zip(self.streams.values(), positions, strict=True):
                    st.load_state_dict({"epoch": e, "window": w, "offset": o})
                self.mixer.load_state_dict(credit)
                raise

    def pending(self) -> list[Piece]:
        """Pieces drawn from the streams but not placed yet (carried and held)."""
        return self.carry + self._pieces(self._held)

    def pending_units(self) -> set[tuple[str, int, int]]:
        """``(source, epoch, unit)`` of every unit a :meth:`pending` piece comes from,
        without making the pieces (10⁶ of them at dp 16,384 × 128K)."""
        return units_of(self._carry, self._names) | units_of(self._held, self._names)

    def _release(self, group: int, hold_limit: int, rows: int) -> np.ndarray:
        """Held outliers that join this step: ``group`` of them, and the oldest pieces that
        must go now for none to wait more than ``max_wait`` steps at ``rows`` a step
        (:meth:`_due`); at most ``rows`` in all (a row each), the oldest first.

        The group is the run of ``group`` held pieces closest in length
        (:func:`_closest_group`); it is released once its longest is at most
        :data:`RELEASE_SPREAD` times its shortest, or once the hold is half full, and
        must include the oldest piece once that has waited ``max_wait // 2`` steps.
        Where fewer than ``group`` are held, all go once the oldest waited ``max_wait``.
        (Every piece that had waited ``max_wait`` went with the group, however many: more
        than a step has rows, and those left over were carried behind the next release,
        step after step, reaching training long after ``max_wait``; a review.)
        """
        m = len(self._held)
        waited = self.step - int(self._held_step[0]) if m else 0
        max_wait = self.cfg.outliers.max_wait
        take = np.zeros(m, dtype=bool)
        take[:self._due(rows)] = True  # (the hold is in the order pieces came)
        if m < group:
            if m and waited >= max_wait:
                take[:] = True
            return self._take_held(take, rows)
        lengths = self._held[:, 6] - self._held[:, 5]
        pick = _closest_group(lengths, group, waited >= max_wait // 2)
        spread = float(lengths[pick].max()) / max(float(lengths[pick].min()), 1.0)
        if spread > RELEASE_SPREAD and m < hold_limit // 2 and waited < max_wait // 2:
            return self._take_held(take, rows)
        take[pick] = True
        return self._take_held(take, rows)

    def _due(self, rows: int) -> int:
        """How many of the oldest held pieces must go this step for none to wait more than
        ``max_wait`` steps, ``rows`` going a step: the most, over the next ``max_wait``
        steps ``j``, of the pieces due within ``j`` steps less the ``rows × j`` the steps
        after this one take."""
        if not len(self._held):
            return 0
        max_wait = self.cfg.outliers.max_wait
        left = np.clip(self._held_step + max_wait - self.step, 0, max_wait)
        due = np.cumsum(np.bincount(left, minlength=max_wait + 1))
        return max(0, int((due - rows * np.arange(max_wait + 1)).max()))

    def _take_held(self, take: np.ndarray, most: int) -> np.ndarray:
        """The held pieces ``take`` marks, at most ``most`` of them, the oldest first (the
        hold is in the order pieces came), out of the hold."""
        if int(take.sum()) > most:
            take = take.copy()
            take[np.flatnonzero(take)[most:]] = False
        out = self._held[take]
        self._held, self._held_step = self._held[~take], self._held_step[~take]
        return out

    def _draw(self, lookup: MetaLookup, weights: dict[str, float], eligible: dict[str, float],
              capacity: int, first: np.ndarray, n_long: int, long_budget: int | None, hold: int,
              hold_limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Draw the step's new pieces, in the order the mixer picks them.

        The mixer picks the eligible source with the most credit
        (:meth:`~msd_dask.core.mixing.Mixer.draw`); its next piece is held if
        it is an outlier (while the hold has room; else the source sits this
        step out), joins the step if it fits in what is left of ``capacity``,
        and otherwise ends the draw.  A piece taken or held is consumed and
        charged to the mixer.

        Returns the table of the step's pieces (``first``, the pieces placed before
        anything new, then the new pieces; int32 where every value fits, else int64)
        and that of the newly held pieces (int64).
        """
        names = self._names
        mixer = self.mixer
        streams = [self.streams[n] for n in names]
        S = len(names)
        w = np.array([weights.get(n, 0.0) for n in names], dtype=np.float64)
        el = np.array([eligible.get(n, 0.0) > 0 for n in names], dtype=bool)
        is_long = np.array([n in self.long_sources for n in names], dtype=bool)
        if long_budget is not None and n_long >= long_budget:
            el &= ~is_long
        drawing = el.copy()  # (the sources the mix may draw from at the start of the step)
        # the pieces the mixer takes without asking: shorter than an outlier, and not long
        # while long pieces are counted
        limit = np.array([0 if long_budget is not None and lg else hold or capacity + 1
                          for lg in is_long.tolist()], dtype=np.int64)
        offset = np.array([st.offset for st in streams], dtype=np.int64)
        sizes = self._draw_sizes
        lens = np.empty(sizes[1], dtype=np.int64)   # the lengths of the windows looked at, in turn
        n_lens = 0
        base = np.zeros(S, dtype=np.int64)   # where each source's current window starts in lens
        end = np.full(S, -1, dtype=np.int64)  # pieces in the source's current window (-1: not looked at yet)
        slot = np.zeros(S, dtype=np.int64)
        # the tables of the windows looked at (not the windows: their lists of lengths go
        # with the stream's next window), each dropped once its pieces are gathered
        windows: list[np.ndarray | None] = []
        win_src: list[int] = []
        taken = np.empty(sizes[0], dtype=np.int64)  # (window slot << 32) | offset of each piece, in order
        n_taken = 0
        held = np.zeros(0, dtype=np.int64)  # the keys of the pieces held, in order
        n_new_held = 0
        room = capacity - int((first[:, 6] - first[:, 5]).sum())
        loading = -1
        charge = -1                # the source of a piece placed here, for the mixer to charge
        try:
            while True:
                src, room, taken, n_taken, held, n_new_held = mixer.draw(
                    w, el, lens, base, offset, end, limit, room, taken, n_taken, slot, charge, hold, held,
                    n_new_held, hold_limit - len(self._held) - n_new_held)
                charge = -1
                if src < 0:
                    break
                o = int(offset[src])
                if o >= end[src]:
                    st = streams[src]
                    st.offset = o
                    loading = src
                    win = st.current(lookup)
                    loading = -1
                    offset[src] = st.offset
                    lens, n_lens = _appended(lens, n_lens, win.table[:, 5] - win.table[:, 4])
                    end[src] = len(win.table)
                    base[src] = n_lens - end[src]
                    slot[src] = len(windows) << 32
                    windows.append(win.table)
                    win_src.append(src)
                    continue
                n = int(lens[base[src] + o])
                if n > room:  # (outliers are held by the draw)
                    break
                else:  # a long piece while they are counted
                    taken, n_taken = _appended(taken, n_taken, slot[src:src + 1] | o)
                    room -= n
                    n_long += 1
                    if long_budget is not None and n_long >= long_budget:
                        el &= ~is_long
                charge = src
        finally:
            for j, (st, o) in enumerate(zip(streams, offset.tolist(), strict=True)):
                if j != loading:
                    st.offset = o
        # the cap, not the mix, kept these sources out: their credit beyond a step's worth
        # is forgiven, not kept for the steps after a re-mix lowers their weight.  The long
        # sources at the layout's cap; and sources whose next piece waited for room in a
        # full hold of outliers (a source of mostly outliers above the share one a row
        # allows: its credit grew without bound, and after a re-mix it took the backlog
        # first for hundreds of steps; a review)
        capped = drawing & ~el
        if long_budget is not None and n_long >= long_budget:
            capped |= is_long
        if capped.any():
            mixer.forgive(capped, w, float(capacity))
        # (a little over this draw's: a next draw that takes a few more does not copy them all)
        self._draw_sizes = (n_taken + n_taken // 16, n_lens + n_lens // 16)
        new_held = _gather(held[:n_new_held], windows, win_src)
        del held, lens
        narrow = all(fits_int32(t) for t in (first, *windows))
        return (_gather(taken[:n_taken], windows, win_src, first, drop=True,
                        dtype=np.int32 if narrow else np.int64), new_held)

    def _plan(self, lookup: MetaLookup) -> StepPlan:
        cfg = self.cfg
        dp, mb, seq_len = cfg.parallel.dp, cfg.batch.micro_batches, cfg.batch.seq_len
        capacity = dp * mb * seq_len
        compile_for(dp * mb)  # a step has a piece per row at least (the draw's loop is a kernel)
        weights = self.weights_at(self.step)
        hold = cfg.outliers.threshold(seq_len, self.cost.linear, self.cost.quadratic)
        if cfg.long_context.places_long_pieces() and self.long_sources:
            hold = 0  # held pieces would land against the layout (as parse_config says)
        group = cfg.outliers.group or dp * mb
        lc = cfg.long_context
        long_src = np.array([n in self.long_sources for n in self._names], dtype=bool)
        eligible = self._eligible(weights, capacity)
        waiting = self._waiting(long_src, eligible, weights)
        # released outliers (a row each), then carried pieces: placed before anything new
        # (the carry as it is where none waits: at dp 16,384 x 128K it holds about 10^6
        # pieces, and a copy of it a step costs time and the planner's peak)
        carried = self._carry if waiting is None else self._carry[~waiting]
        waiting_pieces = None if waiting is None else self._carry[waiting]
        # (the hold takes no more than max_wait steps' rows can release, so that _due always
        # finds a step's rows enough: with max_wait 1 it held 4 groups, a group a step went,
        # and the rest waited past max_wait; a review)
        hold_limit = min(HOLD_GROUPS * group, cfg.outliers.max_wait * dp * mb)
        released = self._release(group, hold_limit, dp * mb)
        # released outliers first, a row each (best fit puts the carried pieces in the room
        # beside them); with sequential's next fit the carried pieces first, which it
        # promises to place: behind a release filling every row they waited (a review)
        first = np.concatenate([carried, released] if cfg.balance == "sequential"
                               else [released, carried])
        del released
        del carried
        n_first = len(first)
        long_budget = dp * lc.max_per_rank if lc.mode == "spread" and lc.max_per_rank else None
        n_long = int(long_src[first[:, 0]].sum())
        table, held = self._draw(lookup, weights, eligible, capacity, first, n_long, long_budget,
                                 hold, hold_limit)
        del first  # copied into table
        if len(held):
            self._held = np.concatenate([self._held, held])
            self._held_step = np.concatenate([self._held_step,
                                              np.full(len(held), self.step, dtype=np.int64)])
        del held
        # the pieces' lengths and costs are kept for spread_long; else place_step alone holds
        # the lengths and prices the pieces itself, a block at a time (the placement is the
        # step's peak), and the placed pieces' are made again after
        if long_budget is None:  # (a temporary, which place_step lets go)
            rank, micro = place_step(_lengths(table), self.cost, n_first, dp, mb,
                                     seq_len, cfg.balance)
            costs = None
        else:
            lengths = _lengths(table)
            costs = self.cost(lengths)
            rank, micro = place_step(lengths, costs, n_first, dp, mb, seq_len, cfg.balance)
            spread_long(long_src[table[:, 0]], n_first, lengths, costs, rank, micro, dp, mb, seq_len,
                        lc.max_per_rank)
            del lengths
        placed = rank >= 0
        # (in the table's type: a step's carried pieces are many short ones; whole rows at a
        # time, where ``table[~placed]`` copies them field by field)
        self._carry = np.compress(~placed, table, axis=0)
        if waiting_pieces is not None and len(waiting_pieces):  # (before this step's: they
            self._carry = np.concatenate([waiting_pieces, self._carry])  # were carried first)
        del waiting_pieces
        # (the step's arrays of a value per piece go as soon as they are used: at dp 16,384 and
        # 128K a step holds millions of pieces, and the process's peak is their sum)
        # the placed pieces' lengths, as the floats the costs and sums take (exact: below 2**53)
        lengths = np.subtract(table[:, 6], table[:, 5], dtype=np.float64)[placed]
        placed_costs = self.cost(lengths) if costs is None else costs[placed]
        del costs
        rank_cost = np.bincount(rank[placed], weights=placed_costs, minlength=dp)
        bound = lower_bound(placed_costs, dp)
        del placed_costs
        pieces, tokens = _by_source(table[:, 0][placed], lengths, len(self._names))
        del lengths
        used = np.flatnonzero(pieces).tolist()
        step_tokens = {self._names[j]: int(tokens[j]) for j in used}
        for j in used:
            name = self._names[j]
            self.tokens[name] += step_tokens[name]
            self.pieces_planned[name] += int(pieces[j])
        del placed
        # the rows, each in step order: the placed pieces sorted (stably) by row
        perm, row_sizes = row_order(rank, micro, dp, mb)
        del rank, micro
        table = _in_order(table, perm)
        del perm
        plan = StepPlan(self.step, table, row_sizes, tuple(self._names),
                        rank_cost.tolist(), bound, weights, step_tokens)
        self.step += 1
        return plan

    def forget_overridden(self, step: int) -> None:
        """Forget the weight changes no step from ``step`` on sees: those before the last
        change in force at ``step`` (:meth:`weights_at` applies the changes in the order they
        were made, the last in force winning).  Its caller says from which step it may still
        ask (the planner's actor: the oldest state it keeps), so that a job calling
        :meth:`set_weights` every step keeps the changes still ahead and a few more, not one
        per call."""
        last = max((i for i, (start, _) in enumerate(self.overrides) if start <= step),
                   default=0)
        del self.overrides[:last]

    def _eligible(self, weights: dict[str, float], capacity: int) -> dict[str, float]:
        """Weights the mixer may choose from this step (long-context modes)."""
        if self.cfg.long_context.mode != "grouped" or not self.long_sources:
            return weights
        long_w = sum(v for k, v in weights.items() if k in self.long_sources)
        short_w = sum(v for k, v in weights.items() if k not in self.long_sources)
        # (summed in the config's order: a set's order depends on the process's hash seed)
        owed = sum(self.mixer.credit[k] for k in self._names
                   if k in self.long_sources and weights.get(k, 0) > 0)
        # a long step when the long sources are owed a step's worth (or nothing else is left)
        long_step = long_w > 0 and (short_w <= 0 or owed >= capacity * (1 - long_w))
        keep = self.long_sources if long_step else set(weights) - self.long_sources
        return {k: v if k in keep else 0.0 for k, v in weights.items()}

    def _waiting(self, long_src: np.ndarray, eligible: dict[str, float],
                 weights: dict[str, float]) -> np.ndarray | None:
        """Which carried pieces wait for a step of their kind (``long_context: grouped``): a
        long step's long pieces that found no row wait for the next long step, a short
        step's short ones for the next short step; placed first in the next step, they put
        long pieces on short steps, a fifth of them (a review).  Where the other kind has
        no weight (its steps never come), none waits.  ``long_src``: whether each source
        is long; ``eligible``: :meth:`_eligible`'s weights of this step.  ``None`` where
        none can (not grouped, nothing carried, or the other kind has no weight)."""
        if (self.cfg.long_context.mode != "grouped" or not self.long_sources
                or not len(self._carry)):
            return None
        long_step = any(eligible.get(n, 0.0) > 0 for n in self.long_sources)
        if not any(weights.get(n, 0.0) > 0 for n in self._names
                   if (n in self.long_sources) != long_step):
            return None
        return np.asarray(long_src[self._carry[:, 0]] != long_step)

    def upcoming_units(self, source: str, n: int) -> list[tuple[int, int]]:
        """``(epoch, unit)`` the source's stream needs next (current window + ``n``)."""
        return self.streams[source].upcoming_units(n)

    # ------------------------------------------------------------------- state
    def snapshot(self) -> PlannerSnapshot:
        """The planner's whole state now, without a pass over its pieces (see
        :class:`PlannerSnapshot`)."""
        return PlannerSnapshot(
            step=self.step, sources=tuple(self._names),
            streams={k: s.state_dict() for k, s in self.streams.items()},
            mixer=self.mixer.state_dict(), carry=self._carry, held=self._held,
            held_step=self._held_step,
            overrides=tuple((s, dict(w)) for s, w in self.overrides),
            tokens=dict(self.tokens), pieces=dict(self.pieces_planned),
            cost=(self.cost.linear, self.cost.quadratic))

    def load_snapshot(self, snap: PlannerSnapshot) -> None:
        """Take the state of ``snap`` (of a planner of the same config)."""
        if snap.sources != tuple(self._names):
            self._refuse_sources(snap.sources)
            raise ValueError(f"a planner state of sources in the order {list(snap.sources)}, "
                             f"not this config's {self._names}")
        self._refuse_sources(snap.streams)
        self.step = snap.step
        for k, s in snap.streams.items():
            self.streams[k].load_state_dict(s)
        self.mixer.load_state_dict(snap.mixer)
        self._carry, self._held, self._held_step = snap.carry, snap.held, snap.held_step
        self.overrides = [(s, dict(w)) for s, w in snap.overrides]
        self.tokens = dict(snap.tokens)
        self.pieces_planned = dict(snap.pieces)
        self.cost = CostModel(*snap.cost)

    def _refuse_sources(self, names: Iterable[str]) -> None:
        """A ``ValueError`` if a state's sources ``names`` are not this config's."""
        had = sorted(names)
        if had != sorted(self._names):
            raise ValueError(f"a planner state of sources {had} does not fit this config's "
                             f"sources {self._names}: resume with the config the state was "
                             "taken with")

    def state_dict(self) -> dict[str, Any]:
        """The planner's whole state, JSON-serialisable (:meth:`PlannerSnapshot.to_state`)."""
        return self.snapshot().to_state()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take a state of :meth:`state_dict` (of a planner of the same config)."""
        state = copy.deepcopy(dict(state))
        try:
            named = {key: dict(state[key]) for key in ("streams", "tokens", "pieces")}
        except (KeyError, TypeError, ValueError) as e:
            raise _not_whole(e) from e
        for names in named.values():  # (before its pieces are read)
            self._refuse_sources(names)
        try:
            streams = {}
            for name, stream in named["streams"].items():
                missing = {"epoch", "window", "offset"} - set(stream)
                if missing:
                    raise ValueError(f"streams[{name!r}] lacks {sorted(missing)}")
                streams[name] = {k: _whole(f"streams[{name!r}][{k!r}]", stream[k])
                                 for k in ("epoch", "window", "offset")}
            held = state.get("held", [])
            for i, h in enumerate(held):  # (each named: "too many values to unpack")
                if not (isinstance(h, list | tuple) and len(h) == 2):
                    raise ValueError(f"held[{i}]: {h!r} is not [piece, step]")
                _whole(f"held[{i}][1]", h[1])
            cost = state_cost(state.get("cost", [self.cost.linear, self.cost.quadratic]),
                              self.cfg.batch.seq_len)
            # the mixer's credit and the weight changes checked before anything is taken (a
            # bad one was taken halfway, a credit of other names read as 0, a change to
            # unknown sources or weights summing to 0 failed steps later: a review)
            mixer = {str(k): float(v) for k, v in dict(state["mixer"]).items()}
            if sorted(mixer) != sorted(self._names) or not all(map(np.isfinite, mixer.values())):
                raise ValueError(f"mixer: the credit of each of the sources {self._names}, "
                                 f"finite numbers; got {state['mixer']!r}")
            overrides = tuple(state_overrides(state["overrides"], self.cfg,
                                              _whole("step", state["step"])))
            snap = PlannerSnapshot(
                step=_whole("step", state["step"]), sources=tuple(self._names), streams=streams,
                mixer=mixer, carry=self._table(state["carry"], "carry"),
                held=self._table([t for t, _ in held], "held"),
                held_step=np.array([_whole(f"held[{i}][1]", s) for i, (_, s) in enumerate(held)],
                                   dtype=np.int64),
                overrides=overrides,
                tokens={k: _whole(f"tokens[{k!r}]", v) for k, v in named["tokens"].items()},
                pieces={k: _whole(f"pieces[{k!r}]", v) for k, v in named["pieces"].items()},
                cost=cost)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            raise _not_whole(e) from e
        self.load_snapshot(snap)


def state_cost(cost: Any, seq_len: int) -> tuple[float, float]:
    """A planner state's cost model, ``[linear, quadratic]``, for rows of ``seq_len``
    tokens; a ``ValueError`` naming ``cost`` unless it holds two finite numbers >= 0 that
    the config's rule takes (:func:`~msd_dask.core.config.cost_model_problem`).  The
    state's model plans on over the config's: NaN, infinite, negative or zero models went
    past every check of the config's (a review)."""
    if not (isinstance(cost, list | tuple) and len(cost) == 2
            and all(isinstance(c, int | float) and not isinstance(c, bool) for c in cost)):
        raise ValueError(f"cost: {cost!r} is not [linear, quadratic]")
    try:
        linear, quadratic = (float(c) for c in cost)
    except OverflowError:  # (an integer JSON reads, too large for a float)
        linear = quadratic = math.inf
    if not (math.isfinite(linear) and math.isfinite(quadratic)
            and linear >= 0 and quadratic >= 0):
        raise ValueError(f"cost: {cost!r} is not [linear, quadratic] of finite numbers >= 0")
    problem = cost_model_problem(linear, quadratic, seq_len)
    if problem is not None:
        raise ValueError(f"cost: {cost!r}: {problem}")
    return linear, quadratic


def state_overrides(overrides: Any, cfg: Config, first: int) -> list[tuple[int, dict[str, float]]]:
    """A planner state's live weight changes, ``[[step, weights], ...]``, as pairs, each
    read as :meth:`Planner.set_weights` reads a change under ``cfg``: its step below
    :data:`STEP_LIMIT`, its weights by :func:`checked_weights`, and those of every change
    that applies from step ``first`` on (the state's next step) by :func:`checked_change`
    (a change a later one replaced before ``first`` never applies again: its rows under
    another layout are no reason to refuse an elastic resume; a review).  A
    ``ValueError`` naming ``overrides`` or the change that is not such a pair."""
    if not isinstance(overrides, list | tuple):
        raise ValueError(f"overrides: {overrides!r} is not a list of [step, weights]")
    names = [s.name for s in cfg.sources]
    pairs = []
    for i, o in enumerate(overrides):
        if not (isinstance(o, list | tuple) and len(o) == 2):
            raise ValueError(f"overrides[{i}]: {o!r} is not [step, weights]")
        step = _whole(f"overrides[{i}][0]", o[0])
        if step >= STEP_LIMIT:  # (10**400 failed every later largest_weights(); a review)
            raise ValueError(f"overrides[{i}][0]: {step!r} is not a step below 2**31")
        pairs.append((step, checked_weights(o[1], names, f"overrides[{i}]")))
    # change i is in force at step t >= first where it starts at or before t and no later
    # change of the list does (Planner.weights_at: the last that started wins)
    later = STEP_LIMIT  # (the earliest start of the changes after i)
    for i in reversed(range(len(pairs))):
        start, w = pairs[i]
        if max(start, first) < later:
            _refuse_empty_rows(w, cfg, f"overrides[{i}]")
        later = min(later, start)
    return pairs


def checked_weights(weights: Any, names: Sequence[str], what: str) -> dict[str, float]:
    """``weights`` as a change of the mix takes them: every source of ``names`` (the
    config's, in its order; a source not named: 0), each a finite number >= 0, summing to
    more than 0; else a ``ValueError`` that starts with ``what`` (:meth:`Planner.set_weights`,
    or the change of a state being loaded: :func:`state_overrides`)."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"{what}: weights must map source names to numbers, got {weights!r}")
    # the config's order, not a set's: the mixer sums the weights in this order, and a
    # set's order depends on the process's hash seed (the same seed and the same
    # set_weights call must give the same steps in every process)
    unknown = set(weights) - set(names)
    if unknown:
        raise ValueError(f"{what}: unknown source(s) {sorted(unknown)} (known: "
                         f"{', '.join(names)})")
    w: dict[str, float] = {}
    for n in names:
        v = weights.get(n, 0.0)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{what}: the weight of source {n!r} must be a finite "
                             f"number >= 0, got {v!r}")
        w[n] = float(v)
    total = sum(w.values())
    if not 0 < total < np.inf:
        raise ValueError(f"{what}: the weights must sum to more than 0 and less than "
                         f"infinity (only their ratios matter), got {dict(weights)}")
    return w


#: the names of a piece's fields, as a state's piece lists them
_PIECE_FIELDS = tuple(Piece.__annotations__)


def _whole(key: str, value: Any) -> int:
    """``value``, a planner state's integer >= 0 at ``key``; a ``ValueError`` naming the key
    (a float was cut, 2.7 read as 2, and a step of -4 or True taken; a review)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | float | str):
        raise ValueError(f"{key}: {value!r} is not an integer")
    try:
        whole = int(value)
    except (ValueError, OverflowError):  # (JSON's Infinity: OverflowError named no key)
        raise ValueError(f"{key}: {value!r} is not an integer") from None
    if whole != value and not isinstance(value, str) or whole < 0:
        raise ValueError(f"{key}: {value!r} is not an integer >= 0")
    return whole


def _not_whole(e: Exception) -> ValueError:
    """The error of a planner state :meth:`Planner.load_state_dict` could not read: ``e``."""
    what = f"lacks {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
    return ValueError(f"a planner state that is not whole ({what}): load a "
                      "Planner.state_dict() as it was saved")


def _closest_group(lengths: np.ndarray, n: int, keep_first: bool) -> np.ndarray:
    """Indices of ``n`` of the pieces as close in length as can be.

    The window of ``n`` consecutive pieces by length (stable order) whose longest
    is the fewest times its shortest (ties: the shorter pieces); with
    ``keep_first``, among the windows that hold the first piece (the oldest).
    """
    order = stable_argsort(lengths)
    ls = lengths[order].astype(np.float64)
    lo, hi = 0, len(ls) - n
    if keep_first:
        pos = int(np.flatnonzero(order == 0)[0])
        lo, hi = max(0, pos - n + 1), min(pos, hi)
    starts = np.arange(lo, hi + 1)
    best = int(starts[np.argmin(ls[starts + n - 1] / np.maximum(ls[starts], 1.0))])
    return order[best:best + n]


def _lengths(table: np.ndarray) -> np.ndarray:
    """The tokens of each piece of a piece table, in the table's int type (a piece of an
    int32 table is shorter than 2**31 tokens; a step at dp 16,384 x 128K holds millions)."""
    return np.subtract(table[:, 6], table[:, 5])


def _in_order(table: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """``table[perm]`` (``perm``: distinct rows of ``table``), which may take over ``table``'s
    memory: a table of :data:`_PERMUTE_IN_PLACE_FROM` bytes or more is permuted in place
    (:func:`~msd_dask.core._kernels.permute_rows`; no second table of the step's pieces, at
    dp 16,384 x 128K the planner's peak), a smaller one gathered into a new table (about
    twice as fast: in place, each row is read and written at a random place)."""
    if table.nbytes < _PERMUTE_IN_PLACE_FROM:
        return np.take(table, perm, axis=0)
    permute_rows(table, perm)
    try:  # the rows past the placed pieces go back (in place, where no view holds them)
        table.resize((len(perm), 8))
    except ValueError:
        table = table[:len(perm)]
    return table


#: bytes of a step's piece table from which :func:`_in_order` permutes it in place (at dp
#: 16,384: a 4K step's table takes about 6 MiB, a 128K step's about 100 MiB)
_PERMUTE_IN_PLACE_FROM = 32 * 2**20


def _no_pieces() -> np.ndarray:
    return np.zeros((0, 8), dtype=np.int64)


def _appended(buf: np.ndarray, n: int, values: np.ndarray) -> tuple[np.ndarray, int]:
    """``buf[:n]`` followed by ``values``, in ``buf`` or in a larger copy of it: (array, length)."""
    m = n + len(values)
    if m > len(buf):
        grown = np.empty(max(m, 2 * len(buf)), dtype=buf.dtype)
        grown[:n] = buf[:n]
        buf = grown
    buf[n:m] = values
    return buf, m


def _gather(keys: np.ndarray, windows: list[np.ndarray | None], sources: list[int],
            head: np.ndarray | None = None, drop: bool = False,
            dtype: type[np.integer[Any]] = np.int64) -> np.ndarray:
    """The piece table of ``(window slot << 32) | offset`` keys, in their order.

    Parameters
    ----------
    keys : ndarray of int64
        Each source's keys in increasing order (as a draw takes them: a source's
        windows in slot order, each from its first piece on); the sources' keys may
        interleave in any way.
    windows : list of ndarray or None
        The tables of the windows (:attr:`~msd_dask.core.stream.Window.table`, C-ordered),
        by slot.
    sources : list of int
        The source index of each window.
    head : ndarray, optional
        A piece table put before the keys' pieces.
    drop : bool
        Set each window's entry to ``None`` once its pieces are copied, so that its
        memory goes back while the table fills.
    dtype : numpy integer type
        Of the table: int32 only where every value of ``head`` and the windows fits.

    Returns
    -------
    ndarray of ``dtype``, shape (len(head) + len(keys), 8)
    """
    h = 0 if head is None else len(head)
    n = len(keys)
    out = np.empty((h + n, 8), dtype=dtype)
    if h:
        out[:h] = head
    n_src = max(sources) + 1 if sources else 0
    k = np.asarray(keys, dtype=np.int64)
    slot = k >> 32
    # (the smallest signed type that holds them: numpy sorts 8- and 16-bit ints by radix)
    src = np.asarray(sources, dtype=np.min_scalar_type(-n_src))[slot]
    per_window = np.bincount(slot, minlength=len(windows)).tolist()
    del slot
    one_pass = compiled()  # (each window's rows copied by a kernel, its source with them)
    if not one_pass:
        out[h:, 0] = src
        # each row's fields after its source as one item (a copy each): numpy copies a row
        # of a 2-d array to rows it selects field by field, several times slower
        fields = out[:, 1:].view(np.dtype((np.void, 7 * out.itemsize)))[:, 0]
    # each source's keys where they go in the table, in increasing order, so that a
    # window's keys are a run of its source's (no sort of the keys by window)
    if n_src <= 8:  # (a pass over the keys per source)
        at = [np.flatnonzero(src == j) for j in range(n_src)]
    else:
        by_src = np.argsort(src, kind="stable")
        at = np.split(by_src, np.cumsum(np.bincount(src, minlength=n_src))[:-1].tolist())
    del src
    done = [0] * n_src  # each source's keys copied so far
    for i, j in enumerate(sources):
        c, win = per_window[i], windows[i]
        if c:
            assert win is not None
            mine = at[j][done[j]:done[j] + c]
            done[j] += c
            if one_pass:
                gather_rows(out, h, mine, k, win, j)
            else:
                rows = np.take(win, np.take(k, mine) & 0xFFFFFFFF, axis=0).astype(out.dtype,
                                                                                   copy=False)
                mine += h
                fields[mine] = rows.view(fields.dtype)[:, 0]
        if drop:
            windows[i] = None
    return out

