"""The planner's decisions (pure, no Dask): which pieces form a step, and where each goes.

:class:`Planner` is the single decision point of a service.  Each step it
draws pieces from the sources' streams in the order the :class:`~msd_dask.mixing.Mixer`
picks (token shares follow the weights in force), fills the step's
``dp × micro_batches × seq_len`` token capacity, and assigns pieces to DP
ranks and micro-batches with the configured balance strategy.  Pieces that do
not fit are carried, in order, to the front of the next step, so every piece
is delivered exactly once.  Its whole state is a small JSON-able dict.
"""

from __future__ import annotations

import copy
from bisect import bisect_left, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from typing import Any

import numpy as np

from .balance import assign, lower_bound
from .config import Config
from .cost import CostModel
from .formats import Unit
from .mixing import Mixer
from .stream import MetaLookup, NeedMetadata, Piece, SourceStream

#: outliers held at most, in release groups (a source whose next piece finds the hold
#: full waits for the next release)
HOLD_GROUPS = 4

__all__ = ["Planner", "StepPlan", "NeedMetadata", "place_step", "kept_rows"]


@dataclass
class StepPlan:
    """The plan of one step.

    Attributes
    ----------
    step : int
    rows : list of list of list of Piece
        ``rows[dp_rank][micro_batch]``: the pieces of each row, in order.
    rank_cost : list of float
        Cost of each DP rank under the cost model.
    lower_bound : float
        ``max(mean rank cost, largest piece cost)``.
    """

    step: int
    rows: list[list[list[Piece]]]
    rank_cost: list[float]
    lower_bound: float
    weights: dict[str, float] = field(default_factory=dict)

    @property
    def imbalance(self) -> float:
        mean = sum(self.rank_cost) / len(self.rank_cost)
        return max(self.rank_cost) / mean if mean > 0 else 1.0

    def pieces(self) -> list[Piece]:
        return [p for rank in self.rows for row in rank for p in row]

    def tokens_by_source(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pieces():
            out[p.source] = out.get(p.source, 0) + p.length
        return out


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
        self.carry: list[Piece] = []
        #: outliers held back (``cfg.outliers``): (piece, step it was drawn at), oldest first
        self.held: list[tuple[Piece, int]] = []
        #: live weight changes: (from_step, {source: weight}), in the order made
        self.overrides: list[tuple[int, dict[str, float]]] = []
        self.tokens = {s.name: 0 for s in cfg.sources}
        self.pieces_planned = {s.name: 0 for s in cfg.sources}

    # ----------------------------------------------------------------- weights
    def weights_at(self, step: int) -> dict[str, float]:
        """Normalised weights in force at ``step`` (schedule, then live changes)."""
        raw = {s.name: s.weight.at(step) for s in self.cfg.sources}
        for start, w in self.overrides:
            if start <= step:
                raw = dict(w)
        total = sum(raw.values())
        return {k: v / total for k, v in raw.items()}

    def set_weights(self, weights: Mapping[str, float], from_step: int | None = None) -> int:
        """Replace the weights from ``from_step`` (default: the first unplanned step) on.

        Returns the step the change takes effect at.
        """
        start = self.step if from_step is None else max(int(from_step), self.step)
        names = {s.name for s in self.cfg.sources}
        unknown = set(weights) - names
        if unknown:
            raise ValueError(f"set_weights: unknown source(s) {sorted(unknown)}")
        w = {n: float(weights.get(n, 0.0)) for n in names}
        if any(not np.isfinite(v) or v < 0 for v in w.values()) or sum(w.values()) <= 0:
            raise ValueError(f"set_weights: weights must be >= 0 and sum to > 0, got {dict(weights)}")
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
        snapshot = self.state_dict()
        try:
            return self._plan(lookup)
        except NeedMetadata:
            self.load_state_dict(snapshot)
            raise

    def pending(self) -> list[Piece]:
        """Pieces drawn from the streams but not placed yet (carried and held)."""
        return self.carry + [p for p, _ in self.held]

    def _release(self, group: int) -> list[Piece]:
        """Held outliers that join this step: ``group`` of them, or those held too long."""
        if len(self.held) >= group:
            n = group
        elif self.held and self.step - self.held[0][1] >= self.cfg.outliers.max_wait:
            n = len(self.held)
        else:
            return []
        if n < len(self.held):
            # the oldest, and the held pieces closest to it in length
            first = self.held[0][0].length
            rest = sorted(range(1, len(self.held)),
                          key=lambda i: (abs(self.held[i][0].length - first), i))[: n - 1]
            take = sorted([0, *rest])
        else:
            take = list(range(n))
        out = [self.held[i][0] for i in take]
        keep = set(take)
        self.held = [h for i, h in enumerate(self.held) if i not in keep]
        return out

    def _plan(self, lookup: MetaLookup) -> StepPlan:
        cfg = self.cfg
        dp, mb, seq_len = cfg.parallel.dp, cfg.batch.micro_batches, cfg.batch.seq_len
        capacity = dp * mb * seq_len
        weights = self.weights_at(self.step)
        hold = cfg.outliers.threshold(seq_len)
        group = cfg.outliers.group or dp * mb
        # released outliers (a row each), then carried pieces: placed before anything new
        pieces = self._release(group) + self.carry
        n_first = len(pieces)
        total = sum(p.length for p in pieces)
        lc = cfg.long_context
        long_budget = dp * lc.max_per_rank if lc.mode == "spread" and lc.max_per_rank else None
        n_long = sum(p.source in self.long_sources for p in pieces)
        eligible = self._eligible(weights, capacity)
        while True:
            if long_budget is not None and n_long >= long_budget:
                eligible = {k: 0.0 if k in self.long_sources else v for k, v in eligible.items()}
            if not any(v > 0 for v in eligible.values()):
                break
            src = self.mixer.choose(eligible)
            p = self.streams[src].peek(lookup)
            if hold and p.length >= hold:
                if len(self.held) >= HOLD_GROUPS * group:
                    # no room to hold it: the source waits for a release, the others fill
                    eligible = {k: 0.0 if k == src else v for k, v in eligible.items()}
                    continue
                self.streams[src].advance()
                self.mixer.take(src, p.length, weights)
                self.held.append((p, self.step))
                continue
            if total + p.length > capacity:
                break
            self.streams[src].advance()
            self.mixer.take(src, p.length, weights)
            pieces.append(p)
            total += p.length
            n_long += src in self.long_sources
        lengths = np.fromiter((p.length for p in pieces), dtype=np.int64, count=len(pieces))
        costs = self.cost(lengths)
        rank, micro = place_step(lengths, costs, n_first, dp, mb, seq_len, cfg.balance)
        if long_budget is not None:
            is_long = np.fromiter((p.source in self.long_sources for p in pieces), dtype=bool,
                                  count=len(pieces))
            _spread_long(is_long, n_first, lengths, costs, rank, micro, dp, mb, seq_len,
                         lc.max_per_rank)
        rows: list[list[list[Piece]]] = [[[] for _ in range(mb)] for _ in range(dp)]
        carry = []
        for i, p in enumerate(pieces):
            r = int(rank[i])
            if r < 0:
                carry.append(p)
            else:
                rows[r][int(micro[i])].append(p)
                self.tokens[p.source] += p.length
                self.pieces_planned[p.source] += 1
        self.carry = carry
        placed = rank >= 0
        rank_cost = np.bincount(rank[placed], weights=costs[placed], minlength=dp)
        plan = StepPlan(self.step, rows, [float(c) for c in rank_cost],
                        lower_bound(costs[placed], dp), weights)
        self.step += 1
        return plan

    def _eligible(self, weights: dict[str, float], capacity: int) -> dict[str, float]:
        """Weights the mixer may choose from this step (long-context modes)."""
        if self.cfg.long_context.mode != "grouped" or not self.long_sources:
            return weights
        long_w = sum(v for k, v in weights.items() if k in self.long_sources)
        short_w = sum(v for k, v in weights.items() if k not in self.long_sources)
        owed = sum(self.mixer.credit[k] for k in self.long_sources if weights.get(k, 0) > 0)
        # a long step when the long sources are owed a step's worth (or nothing else is left)
        long_step = long_w > 0 and (short_w <= 0 or owed >= capacity * (1 - long_w))
        keep = self.long_sources if long_step else set(weights) - self.long_sources
        return {k: v if k in keep else 0.0 for k, v in weights.items()}

    def upcoming_units(self, source: str, n: int) -> list[tuple[int, int]]:
        """``(epoch, unit)`` the source's stream needs next (current window + ``n``)."""
        return self.streams[source].upcoming_units(n)

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The planner's whole state, small and JSON-serialisable."""
        return {
            "step": self.step,
            "streams": {k: s.state_dict() for k, s in self.streams.items()},
            "mixer": self.mixer.state_dict(),
            "carry": [list(p.to_tuple()) for p in self.carry],
            "held": [[list(p.to_tuple()), s] for p, s in self.held],
            "overrides": [[s, dict(w)] for s, w in self.overrides],
            "tokens": dict(self.tokens),
            "pieces": dict(self.pieces_planned),
            "cost": [self.cost.linear, self.cost.quadratic],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = copy.deepcopy(dict(state))
        self.step = int(state["step"])
        for k, s in state["streams"].items():
            self.streams[k].load_state_dict(s)
        self.mixer.load_state_dict(state["mixer"])
        self.carry = [Piece.from_tuple(t) for t in state["carry"]]
        self.held = [(Piece.from_tuple(t), int(s)) for t, s in state.get("held", [])]
        self.overrides = [(int(s), {k: float(v) for k, v in w.items()})
                          for s, w in state["overrides"]]
        self.tokens = {k: int(v) for k, v in state["tokens"].items()}
        self.pieces_planned = {k: int(v) for k, v in state["pieces"].items()}
        if "cost" in state:
            self.cost = CostModel(float(state["cost"][0]), float(state["cost"][1]))


def _place_carried(n_carried: int, lengths: np.ndarray, rank: np.ndarray, micro: np.ndarray,
                   seq_len: int) -> None:
    """Make sure pieces carried from the last step are placed now.

    A carried piece the strategy left out takes the row of a new piece
    (the shortest that makes room), which is carried instead; so no piece
    waits more than one step.
    """
    for i in range(n_carried):
        if rank[i] >= 0:
            continue
        placed = np.flatnonzero(rank >= 0)
        used: dict[tuple[int, int], int] = {}
        for j in placed:
            k = (int(rank[j]), int(micro[j]))
            used[k] = used.get(k, 0) + int(lengths[j])
        best = -1
        for j in placed:
            if j < n_carried:
                continue
            room = seq_len - used[(int(rank[j]), int(micro[j]))] + int(lengths[j])
            if room >= lengths[i] and (best < 0 or lengths[j] < lengths[best]):
                best = int(j)
        if best < 0:  # every row is full of carried pieces: cannot happen in practice
            continue
        rank[i], micro[i] = rank[best], micro[best]
        rank[best] = micro[best] = -1


def kept_rows(lengths: np.ndarray, n_carried: int, n_rows: int, seq_len: int) -> np.ndarray:
    """Which pieces a step places, decided without the mesh: a row of each, ``-1`` if carried.

    Best-fit decreasing over ``n_rows`` rows of ``seq_len`` tokens: the pieces
    carried from the last step first (in order), then the new ones by
    decreasing length (stable); each goes to the row with the least room that
    still fits it (lowest row on ties), and a piece that fits in no row is
    carried.  Only the
    number of rows matters, not how they are split into ranks and
    micro-batches, so a step holds the same pieces after an elastic resume
    with another ``dp`` and the same ``dp × micro_batches``.
    """
    n = len(lengths)
    row = np.full(n, -1, dtype=np.int64)
    if n == 0 or n_rows <= 0:
        return row
    new = n_carried + np.argsort(-lengths[n_carried:], kind="stable")
    order = np.concatenate([np.arange(n_carried), new]).tolist()
    # the distinct rooms left, sorted, and the rows with each room (a heap: lowest row first)
    rooms = [seq_len]
    rows_at = {seq_len: list(range(n_rows))}
    ls = lengths.tolist()
    out = [-1] * n
    for i in order:
        k = bisect_left(rooms, ls[i])  # the tightest room that fits, lowest row on ties
        if k == len(rooms):
            continue
        room = rooms[k]
        at = rows_at[room]
        r = heappop(at)
        if not at:
            del rows_at[room]
            del rooms[k]
        left = room - ls[i]
        if left in rows_at:
            heappush(rows_at[left], r)
        else:
            rows_at[left] = [r]
            insort(rooms, left)
        out[i] = r
    row[:] = out
    return row


def place_step(lengths: np.ndarray, costs: np.ndarray, n_carried: int, dp: int, mb: int,
               seq_len: int, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """Rank and micro-batch of each of a step's pieces (``-1``: carried to the next step).

    The planner's placement, reusable by benchmarks and the simulator.  With
    ``sequential`` the pieces fill rows next fit in order (carried pieces
    first, and always placed).  With the other strategies the pieces the step
    keeps are chosen by :func:`kept_rows`, independently of how the rows are
    grouped into ranks, and the strategy balances them over the mesh; in the
    rare case it cannot place them all, the kept rows themselves are dealt to
    ranks (most costly row first, to the cheapest rank with a free
    micro-batch), which always fits.

    Parameters
    ----------
    lengths, costs : ndarray
        Tokens and cost of each piece, the ``n_carried`` carried pieces first.
    n_carried : int
    dp, mb, seq_len : int
        ``dp × mb`` rows of ``seq_len`` tokens.
    strategy : str
        A balance strategy (:data:`msd_dask.balance.STRATEGIES`).

    Returns
    -------
    rank, micro : ndarray of int
    """
    if strategy == "sequential":  # next fit over the rows: mesh-agnostic already
        a = assign(lengths, costs, dp, mb, seq_len, strategy)
        rank, micro = a.rank.copy(), a.micro.copy()
        _place_carried(n_carried, lengths, rank, micro, seq_len)
        return rank, micro
    rows = kept_rows(lengths, n_carried, dp * mb, seq_len)
    idx = np.flatnonzero(rows >= 0)
    rank = np.full(len(lengths), -1, dtype=np.int64)
    micro = rank.copy()
    a = assign(lengths[idx], costs[idx], dp, mb, seq_len, strategy)
    if (a.rank >= 0).all():
        rank[idx], micro[idx] = a.rank, a.micro
        return rank, micro
    row_cost = np.bincount(rows[idx], weights=costs[idx], minlength=dp * mb)
    load = [(0.0, r) for r in range(dp)]
    slots = [0] * dp
    rank_of = np.empty(dp * mb, dtype=np.int64)
    micro_of = np.empty(dp * mb, dtype=np.int64)
    for row in np.argsort(-row_cost, kind="stable").tolist():
        c, r = heappop(load)
        rank_of[row], micro_of[row] = r, slots[r]
        slots[r] += 1
        if slots[r] < mb:
            heappush(load, (c + float(row_cost[row]), r))
    rank[idx], micro[idx] = rank_of[rows[idx]], micro_of[rows[idx]]
    return rank, micro


def _spread_long(is_long: np.ndarray, n_carried: int, lengths: np.ndarray, costs: np.ndarray,
                 rank: np.ndarray, micro: np.ndarray, dp: int, mb: int, seq_len: int,
                 max_per_rank: int) -> None:
    """Move long pieces off ranks holding more than ``max_per_rank`` of them.

    A long piece moves to the cheapest rank still under the limit, into its
    emptiest row; short pieces it displaces there take its old row where they
    fit, else they are carried to the next step (never pieces carried already).
    """
    placed = rank >= 0
    count = np.bincount(rank[placed & is_long], minlength=dp)
    used = np.zeros((dp, mb), dtype=np.int64)
    np.add.at(used, (rank[placed], micro[placed]), lengths[placed])
    load = np.bincount(rank[placed], weights=costs[placed], minlength=dp)
    for r in np.flatnonzero(count > max_per_rank):
        mine = [int(i) for i in np.flatnonzero((rank == r) & is_long)]
        mine.sort(key=lambda i: costs[i])
        for i in mine[: int(count[r]) - max_per_rank]:
            for t in np.argsort(load, kind="stable"):
                if count[t] >= max_per_rank:
                    continue
                m = int(np.argmin(used[t]))
                ri, mi = int(rank[i]), int(micro[i])
                need = int(lengths[i]) - (seq_len - int(used[t, m]))
                evict: list[int] = []
                if need > 0:
                    cands = [int(j) for j in np.flatnonzero((rank == t) & (micro == m) & ~is_long)
                             if j >= n_carried]
                    cands.sort(key=lambda j: -lengths[j])
                    freed = 0
                    for j in cands:
                        if freed >= need:
                            break
                        evict.append(j)
                        freed += int(lengths[j])
                    if freed < need:
                        continue
                # move i to (t, m); displaced pieces go to i's old row or are carried
                for j in evict:
                    used[t, m] -= lengths[j]
                    load[t] -= costs[j]
                    rank[j] = micro[j] = -1
                rank[i], micro[i] = t, m
                used[ri, mi] -= lengths[i]
                used[t, m] += lengths[i]
                load[ri] -= costs[i]
                load[t] += costs[i]
                count[ri] -= 1
                count[t] += 1
                for j in evict:
                    if used[ri, mi] + lengths[j] <= seq_len:
                        rank[j], micro[j] = ri, mi
                        used[ri, mi] += lengths[j]
                        load[ri] += costs[j]
                break
