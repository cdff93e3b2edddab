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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .balance import assign, lower_bound
from .config import Config
from .cost import CostModel
from .formats import Unit
from .mixing import Mixer
from .stream import MetaLookup, NeedMetadata, Piece, SourceStream

__all__ = ["Planner", "StepPlan", "NeedMetadata"]


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
        self.cost = CostModel.from_config(cfg.cost)
        self.step = 0
        self.carry: list[Piece] = []
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

    def _plan(self, lookup: MetaLookup) -> StepPlan:
        cfg = self.cfg
        dp, mb, seq_len = cfg.parallel.dp, cfg.batch.micro_batches, cfg.batch.seq_len
        capacity = dp * mb * seq_len
        weights = self.weights_at(self.step)
        pieces = list(self.carry)
        total = sum(p.length for p in pieces)
        while True:
            src = self.mixer.choose(weights)
            p = self.streams[src].peek(lookup)
            if total + p.length > capacity:
                break
            self.streams[src].advance()
            self.mixer.take(src, p.length, weights)
            pieces.append(p)
            total += p.length
        lengths = np.fromiter((p.length for p in pieces), dtype=np.int64, count=len(pieces))
        costs = self.cost(lengths)
        a = assign(lengths, costs, dp, mb, seq_len, cfg.balance)
        rank, micro = a.rank.copy(), a.micro.copy()
        self._place_carried(len(self.carry), lengths, rank, micro, seq_len)
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

    @staticmethod
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
            "overrides": [[s, dict(w)] for s, w in self.overrides],
            "tokens": dict(self.tokens),
            "pieces": dict(self.pieces_planned),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = copy.deepcopy(dict(state))
        self.step = int(state["step"])
        for k, s in state["streams"].items():
            self.streams[k].load_state_dict(s)
        self.mixer.load_state_dict(state["mixer"])
        self.carry = [Piece.from_tuple(t) for t in state["carry"]]
        self.overrides = [(int(s), {k: float(v) for k, v in w.items()})
                          for s, w in state["overrides"]]
        self.tokens = {k: int(v) for k, v in state["tokens"].items()}
        self.pieces_planned = {k: int(v) for k, v in state["pieces"].items()}
