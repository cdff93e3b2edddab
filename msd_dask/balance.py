"""Assignment of one step's pieces to DP ranks and micro-batches (pure, no Dask).

Strategies are plain functions chosen by name (``balance:`` in the config):

``sequential``
    Naive packing, the baseline: pieces in stream order fill micro-batch rows
    one after another (first fit), as a per-rank loader packs.
``lpt``
    Longest processing time first: pieces by decreasing cost go to the rank
    with the least cost that still has a row with room, and inside it to the
    cheapest row with room.

Each returns an :class:`Assignment`; pieces that fit nowhere get rank ``-1``
and are carried to the next step by the planner.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["Assignment", "assign", "STRATEGIES", "lower_bound"]


@dataclass
class Assignment:
    """Where each piece goes.

    Attributes
    ----------
    rank, micro : ndarray of int
        DP rank and micro-batch of each piece; ``-1`` where it did not fit.
    micro_cost : ndarray of float, shape (n_ranks, micro_batches)
    micro_used : ndarray of int, shape (n_ranks, micro_batches)
        Tokens used in each row.
    """

    rank: np.ndarray
    micro: np.ndarray
    micro_cost: np.ndarray
    micro_used: np.ndarray

    @property
    def rank_cost(self) -> np.ndarray:
        return self.micro_cost.sum(axis=1)

    @property
    def imbalance(self) -> float:
        """Max over mean per-rank cost (1.0 is perfect)."""
        rc = self.rank_cost
        mean = float(rc.mean())
        return float(rc.max()) / mean if mean > 0 else 1.0

    @property
    def placed(self) -> np.ndarray:
        return self.rank >= 0


def lower_bound(costs: np.ndarray, n_ranks: int) -> float:
    """``max(mean rank cost, largest piece cost)``: no assignment has a lower max."""
    if len(costs) == 0:
        return 0.0
    return float(max(costs.sum() / n_ranks, costs.max()))


def _empty(n: int, n_ranks: int, micro_batches: int) -> Assignment:
    return Assignment(
        rank=np.full(n, -1, dtype=np.int64), micro=np.full(n, -1, dtype=np.int64),
        micro_cost=np.zeros((n_ranks, micro_batches)),
        micro_used=np.zeros((n_ranks, micro_batches), dtype=np.int64),
    )


def sequential(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
               seq_len: int) -> Assignment:
    """Naive packing: fill rows in order, first fit, the way per-rank loaders pack."""
    a = _empty(len(lengths), n_ranks, micro_batches)
    flat_used = a.micro_used.reshape(-1)
    flat_cost = a.micro_cost.reshape(-1)
    row = 0
    n_rows = n_ranks * micro_batches
    for i, (n, c) in enumerate(zip(lengths, costs, strict=True)):
        while row < n_rows and flat_used[row] + n > seq_len:
            row += 1
        if row >= n_rows:
            break
        flat_used[row] += n
        flat_cost[row] += c
        a.rank[i], a.micro[i] = divmod(row, micro_batches)
    return a


def lpt(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
        seq_len: int) -> Assignment:
    """Greedy longest-processing-time-first under the row capacity ``seq_len``."""
    a = _empty(len(lengths), n_ranks, micro_batches)
    order = np.argsort(-costs, kind="stable")
    heap = [(0.0, r) for r in range(n_ranks)]
    free = np.full((n_ranks, micro_batches), seq_len, dtype=np.int64)
    for i in order:
        n, c = int(lengths[i]), float(costs[i])
        popped = []
        while heap:
            rc, r = heapq.heappop(heap)
            fits = free[r] >= n
            if fits.any():
                rows = np.flatnonzero(fits)
                m = int(rows[np.argmin(a.micro_cost[r, rows])])
                free[r, m] -= n
                a.micro_cost[r, m] += c
                a.rank[i], a.micro[i] = r, m
                heapq.heappush(heap, (rc + c, r))
                break
            popped.append((rc, r))
        for p in popped:
            heapq.heappush(heap, p)
    a.micro_used[:] = seq_len - free
    return a


Strategy = Callable[[np.ndarray, np.ndarray, int, int, int], Assignment]

STRATEGIES: dict[str, Strategy] = {"sequential": sequential, "lpt": lpt}


def assign(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
           seq_len: int, strategy: str = "lpt") -> Assignment:
    """Assign pieces to ranks and micro-batches with the named strategy.

    Parameters
    ----------
    lengths : ndarray of int
        Tokens of each piece (each ``<= seq_len``).
    costs : ndarray of float
        Cost of each piece.
    n_ranks, micro_batches, seq_len : int
        ``n_ranks × micro_batches`` rows of ``seq_len`` tokens.
    strategy : str
        A key of :data:`STRATEGIES`.
    """
    try:
        fn = STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown balance strategy {strategy!r} "
                         f"(known: {', '.join(STRATEGIES)})") from None
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > seq_len:
        raise ValueError(f"a piece of {int(lengths.max())} tokens exceeds seq_len {seq_len}")
    return fn(lengths, np.asarray(costs, dtype=np.float64), n_ranks, micro_batches, seq_len)
