"""Assignment of one step's pieces to DP ranks and micro-batches (pure, no Dask).

Every step has ``n_ranks × micro_batches`` rows of ``seq_len`` tokens; a rank's
cost is the sum of its pieces' costs (see :mod:`msd_dask.core.cost`).  Strategies
are plain functions chosen by name (``balance:`` in the config):

``sequential``
    Naive packing, the baseline: pieces in stream order fill micro-batch rows
    one after another (next fit), as a per-rank loader packs.
``lpt``
    Longest processing time first: pieces by decreasing cost go to the rank
    with the least cost that still has a row with room, and inside it to the
    cheapest row with room.
``balanced`` (the default)
    Near-optimal multiway partitioning under the row capacity: the best of a
    few greedy starts (LPT on costs and on *excess* costs, see
    :func:`balanced`), improved by exchanges of pieces between heavy and light
    ranks until the heaviest rank is within ``tol`` of the best bound or the
    work budget runs out, then the micro-batches of each rank are evened by
    the same exchanges between its rows.

Each returns an :class:`Assignment`; a piece gets rank ``-1`` only when no row
has room for it, and the planner carries it to the next step.  Results are
deterministic: every sort is stable and ties go to the lowest index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from msd_dask.core._kernels import fill_rounds, greedy_fill, row_sums, sorted_sums, stable_argsort

__all__ = ["Assignment", "assign", "build_assignment", "check_piece_lengths", "STRATEGIES",
           "lower_bound", "capacity_bound", "sequential", "lpt", "balanced", "improve"]


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
    def micro_imbalance(self) -> float:
        """Worst over ranks of max over mean row cost inside the rank (1.0 is even)."""
        mc = self.micro_cost
        mean = mc.mean(axis=1)
        ok = mean > 0
        if not ok.any():
            return 1.0
        return float((mc.max(axis=1)[ok] / mean[ok]).max())

    @property
    def placed(self) -> np.ndarray:
        return self.rank >= 0


def lower_bound(costs: np.ndarray, n_ranks: int) -> float:
    """``max(mean rank cost, largest piece cost)``: no assignment has a lower max."""
    if len(costs) == 0:
        return 0.0
    return float(max(costs.sum() / n_ranks, costs.max()))


def capacity_bound(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
                   seq_len: int) -> float:
    """A lower bound on the max rank cost that also counts the row capacity.

    At least :func:`lower_bound`.  With the pieces sorted by decreasing cost,
    some rank holds ``t + 1`` of the ``t·n_ranks + 1`` largest (pigeonhole), so
    its cost is at least the sum of the ``t + 1`` cheapest of them.  When the
    rows are nearly full, as the planner fills them, that rank must also hold
    at least ``micro_batches·seq_len − free − (their tokens)`` more tokens
    (``free``: all rows' spare room), each costing at least the lowest cost per
    token of any piece.  Used to stop :func:`balanced` early where the pieces
    allow nothing better, and reported by ``scripts/bench_balance.py``.  The
    sums over the sorted pieces are one compiled pass
    (:func:`msd_dask.core._kernels.sorted_sums`), with no sorted copies.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if n == 0:
        return 0.0
    best = lower_bound(costs, n_ranks)
    order = stable_argsort(costs, descending=True, like=lengths)  # (costs grow with lengths)
    rho = _min_cost_per_token(lengths, costs)
    free = n_ranks * micro_batches * seq_len - int(lengths.sum())
    room = micro_batches * seq_len - free
    # the t+1 cheapest of the top t·R+1 are the last t+1 when keys (costs - rho·lengths)
    # follow costs
    first = order[0]
    tol = 1e-9 * max(1.0, float(costs[first] - rho * lengths[first]))
    monotone, ccum, lcum = sorted_sums(costs, lengths, order, rho, tol)
    del order  # (temporaries of n pieces go as soon as they are used: steps hold millions)
    t = np.arange((n - 1) // n_ranks + 1)
    hi = t * n_ranks + 1                      # prefix length
    lo = hi - (t + 1)
    csum = ccum[hi] - ccum[lo]
    best = max(best, float(csum.max()))
    if monotone and room > 0 and rho > 0:
        lsum = lcum[hi] - lcum[lo]
        best = max(best, float((csum + rho * np.maximum(0, room - lsum)).max()))
    return best


def _empty(n: int, n_ranks: int, micro_batches: int) -> Assignment:
    return Assignment(
        rank=np.full(n, -1, dtype=np.int64), micro=np.full(n, -1, dtype=np.int64),
        micro_cost=np.zeros((n_ranks, micro_batches)),
        micro_used=np.zeros((n_ranks, micro_batches), dtype=np.int64),
    )


def build_assignment(rank: np.ndarray, micro: np.ndarray, lengths: np.ndarray, costs: np.ndarray,
           n_ranks: int, micro_batches: int) -> Assignment:
    """An :class:`Assignment` whose row sums are recomputed from ``rank``/``micro``."""
    out_rank = np.full(len(lengths), -1, dtype=np.int64)
    out_micro = out_rank.copy()
    out_rank[:] = rank
    out_micro[:] = micro
    return _owning(out_rank, out_micro, lengths, costs, n_ranks, micro_batches)


def _owning(rank: np.ndarray, micro: np.ndarray, lengths: np.ndarray, costs: np.ndarray,
            n_ranks: int, micro_batches: int) -> Assignment:
    """:func:`build_assignment` that keeps ``rank`` and ``micro`` (int64) as they are, no copies:
    for arrays nothing else changes (a step's hold millions of pieces)."""
    a = _empty(0, n_ranks, micro_batches)
    a.rank, a.micro = rank, micro
    row_sums(rank, micro, lengths, costs, a.micro_cost, a.micro_used)  # (one pass, no copies)
    return a


# --------------------------------------------------------------------------- sequential


def sequential(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
               seq_len: int) -> Assignment:
    """Naive packing: fill rows in order, next fit, the way per-rank loaders pack."""
    n = len(lengths)
    out = [-1] * n
    used = 0
    row = 0
    n_rows = n_ranks * micro_batches
    for i, length in enumerate(lengths.tolist()):
        while row < n_rows and used + length > seq_len:
            row += 1
            used = 0
        if row >= n_rows:
            break
        used += length
        out[i] = row
    rows = np.asarray(out, dtype=np.int64)
    ok = rows >= 0
    return build_assignment(np.where(ok, rows // micro_batches, -1), np.where(ok, rows % micro_batches, -1),
                  lengths, costs, n_ranks, micro_batches)


# --------------------------------------------------------------------------- greedy (LPT)


class _Greedy:
    """Rows' free room and key sums, filled greedily.

    :meth:`fill` puts each piece on the rank with the least key sum that has a
    row with room (ties: lowest rank), inside it on the row with the least key
    sum that has room (ties: lowest row).  Ranks without room for the current
    piece are parked in a heap by their largest room and come back as soon as
    a piece fits them, so a full step costs ``O(n log n_ranks)``; the loop is
    compiled (:func:`msd_dask.core._kernels.greedy_fill`).
    """

    def __init__(self, n: int, n_ranks: int, micro_batches: int, seq_len: int):
        self.n_ranks, self.micro_batches, self.seq_len = n_ranks, micro_batches, seq_len
        self.free = np.full((n_ranks, micro_batches), seq_len, dtype=np.int64)
        self.row_key = np.zeros((n_ranks, micro_batches), dtype=np.float64)
        self.rank_key = np.zeros(n_ranks, dtype=np.float64)
        self.max_free = np.full(n_ranks, seq_len, dtype=np.int64)
        self.rank = np.full(n, -1, dtype=np.int64)
        self.micro = np.full(n, -1, dtype=np.int64)
        self.fresh = True

    def fill(self, order: np.ndarray, lengths: np.ndarray, keys: np.ndarray) -> None:
        """Place the pieces ``order``, in that order; on empty ranks the first pieces (while
        their keys are > 0) go to ranks 0, 1, ... in turn."""
        order = np.asarray(order, dtype=np.int64)
        greedy_fill(order, np.ascontiguousarray(lengths[order], dtype=np.int64),
                    np.ascontiguousarray(keys[order], dtype=np.float64), self.free, self.row_key,
                    self.rank_key, self.max_free, self.rank, self.micro, self.fresh)
        self.fresh = False

    def fill_tail(self, order: np.ndarray, lengths: np.ndarray, keys: np.ndarray) -> None:
        """:meth:`fill` for pieces whose keys are too small to matter one by one.

        Rounds: the next ``k`` pieces go, one each, to the ``k`` ranks with the
        least key sums among those with room for the round's first piece (``k``:
        how many such ranks), each on its row with the least key sum that has
        room.  Finishes with :meth:`fill` once fewer than 16 ranks have room (or
        for pieces that found no row).  The rounds are compiled
        (:func:`msd_dask.core._kernels.fill_rounds`).
        """
        order = np.asarray(order, dtype=np.int64)
        left = np.empty(len(order), dtype=np.int64)
        pos, n_left = fill_rounds(order, np.ascontiguousarray(lengths[order], dtype=np.int64),
                                  np.ascontiguousarray(keys[order], dtype=np.float64), self.free,
                                  self.row_key, self.rank_key, self.max_free, self.rank, self.micro,
                                  left)
        rest = np.concatenate([left[:n_left], order[pos:]])
        if len(rest):
            self.fill(rest[_decreasing(keys[rest])], lengths, keys)

    def shift_keys(self, rho: float) -> None:
        """Add ``rho`` per used token to every key sum (excess costs -> costs)."""
        rk = self.row_key
        rk += rho * (self.seq_len - self.free)
        # each rank's sum row by row, in order (as a Python sum; numpy's pairwise sum is not)
        total = rk[:, 0].copy()
        for m in range(1, self.micro_batches):
            total += rk[:, m]
        self.rank_key[:] = total

    def result(self, lengths: np.ndarray, costs: np.ndarray) -> Assignment:
        """The assignment, which takes over this object's arrays (fill no more after it)."""
        return _owning(self.rank, self.micro, lengths, costs, self.n_ranks, self.micro_batches)


def _decreasing(keys: np.ndarray, lengths: np.ndarray | None = None) -> np.ndarray:
    """The pieces by decreasing key (stable); ``lengths``: theirs, when keys likely grow with
    them (costs and excess costs do: their order is found by the lengths' sort)."""
    return stable_argsort(keys, descending=True, like=lengths)


def lpt(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
        seq_len: int) -> Assignment:
    """Greedy longest-processing-time-first under the row capacity ``seq_len``."""
    g = _Greedy(len(lengths), n_ranks, micro_batches, seq_len)
    g.fill(_decreasing(costs, lengths), lengths, costs)
    return g.result(lengths, costs)


# --------------------------------------------------------------------------- balanced


def _first_at_most(keys: np.ndarray, order: np.ndarray, x: float) -> int:
    """The first position of ``order``, the pieces by decreasing key, whose key is ``<= x``
    (the tiny keys are the last ones): by bisection, with no array of the keys in that
    order.  (A NaN key, last in ``order``, makes the keys' sum and so ``x`` NaN: no key
    is ``<= x``.)"""
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        if keys[order[mid]] <= x:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _min_cost_per_token(lengths: np.ndarray, costs: np.ndarray) -> float:
    pos = lengths > 0
    return float((costs[pos] / lengths[pos]).min()) if pos.any() else 0.0


#: Weight of the plain cost in the excess keys: breaks ties between pieces of
#: no excess (all of one length, say) towards the cheaper ranks.
_COST_SHARE = 1e-3
#: Pieces whose key is below this share of a mean rank's key sum are placed in
#: vectorised rounds (:meth:`_Greedy.fill_tail`) when there are many.
_TINY = 1e-4


def _starts(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
            seq_len: int, rho: float) -> list[Callable[[], Assignment]]:
    """Greedy starting points of :func:`balanced`, in the order they are tried."""
    mean = float(costs.sum()) / n_ranks

    def excess_costs() -> np.ndarray:
        # made by each start that uses them (an array of a value per piece, gone with it), in
        # place: ``max(costs - rho * lengths, 0) + _COST_SHARE * costs``
        out = np.multiply(rho, lengths, dtype=np.float64)
        np.subtract(costs, out, out=out)
        np.maximum(out, 0.0, out=out)
        out += _COST_SHARE * costs
        return out

    def fill(g: _Greedy, order: np.ndarray, keys: np.ndarray) -> None:
        # (order: by decreasing key, so the tiny keys are its last ones)
        k = _first_at_most(keys, order, _TINY * float(keys.sum()) / n_ranks)
        if len(order) - k < 4 * n_ranks:
            g.fill(order, lengths, keys)
        else:
            g.fill(order[:k], lengths, keys)
            g.fill_tail(order[k:], lengths, keys)

    def on_excess() -> Assignment:
        g = _Greedy(len(lengths), n_ranks, micro_batches, seq_len)
        excess = excess_costs()
        fill(g, _decreasing(excess, lengths), excess)
        return g.result(lengths, costs)

    def hybrid() -> Assignment:
        g = _Greedy(len(lengths), n_ranks, micro_batches, seq_len)
        excess = excess_costs()
        order = _decreasing(excess, lengths)
        big = excess[order] >= 0.002 * mean
        g.fill(order[big], lengths, excess)
        g.shift_keys(rho)
        rest = order[~big]
        fill(g, rest[_decreasing(costs[rest], lengths[rest])], costs)
        return g.result(lengths, costs)

    def on_cost() -> Assignment:
        g = _Greedy(len(lengths), n_ranks, micro_batches, seq_len)
        fill(g, _decreasing(costs, lengths), costs)
        return g.result(lengths, costs)

    # excess costs assume rows end up full: on a step well short of full, costs first
    full = int(lengths.sum()) >= 0.98 * n_ranks * micro_batches * seq_len
    return [on_excess, hybrid, on_cost] if full else [on_cost, on_excess, hybrid]


#: Index pairs of the piece sets an exchange considers in a group's table of
#: ``k`` pieces: every single piece and every pair (``-1``: no piece).
@lru_cache(maxsize=64)
def _sets(k: int, empty: bool) -> np.ndarray:
    i, j = np.triu_indices(k, 1)
    out = [np.stack([np.arange(k), np.full(k, -1)], axis=1), np.stack([i, j], axis=1)]
    if empty:
        out.insert(0, np.array([[-1, -1]]))
    sets = np.concatenate(out).astype(np.int64)
    sets.flags.writeable = False
    return sets


class _State:
    """Rows and pieces during the exchanges (flat row id ``rank·micro_batches + micro``)."""

    def __init__(self, a: Assignment, lengths: np.ndarray, costs: np.ndarray, seq_len: int):
        self.n_ranks, self.micro_batches = a.micro_cost.shape
        self.seq_len = seq_len
        self.lengths, self.costs = lengths, costs
        self.row = a.rank * self.micro_batches  # (in place: an array of a value per piece)
        self.row += a.micro
        self.row[a.rank < 0] = -1
        self.row_cost = a.micro_cost.reshape(-1).copy()
        self.row_free = (seq_len - a.micro_used).reshape(-1).astype(np.int64)

    def refresh(self) -> None:
        ok = self.row >= 0
        size = self.n_ranks * self.micro_batches
        self.row_cost = np.bincount(self.row[ok], self.costs[ok], size)
        used = np.bincount(self.row[ok], self.lengths[ok], size).astype(np.int64)
        self.row_free = self.seq_len - used

    def assignment(self) -> Assignment:
        mb = self.micro_batches
        rank = self.row // mb  # (-1, a piece left out, stays -1)
        micro = self.row % mb
        micro[rank < 0] = -1
        return _owning(rank, micro, self.lengths, self.costs, self.n_ranks, mb)


def _tables(group: np.ndarray, n_groups: int, lengths: np.ndarray, k: int) -> np.ndarray:
    """``(n_groups, k)`` piece indices per group (``-1`` pads).

    A group with more than ``k`` pieces keeps its ``k // 2`` longest and
    ``k - k // 2`` more spread evenly over the rest by length, so that small
    pieces stay available for fine adjustments.
    """
    span = int(lengths.max()) + 1 if len(lengths) else 1
    order = stable_argsort(group * span + (span - 1 - lengths))
    order = order[group[order] >= 0]
    g = group[order]
    start = np.searchsorted(g, np.arange(n_groups))
    count = np.diff(np.append(start, len(order)))
    top = k // 2
    col = np.arange(k)
    spread = top + ((count[:, None] - top) * (col[None, :] - top)) // max(1, k - top)
    pos = np.where((count[:, None] <= k) | (col[None, :] < top), col[None, :], spread)
    valid = pos < count[:, None]
    idx = np.minimum(start[:, None] + pos, max(0, len(order) - 1))
    return np.where(valid, order[idx] if len(order) else -1, -1)


def _exchange(st: _State, group_of_row: np.ndarray, g1: np.ndarray, g2: np.ndarray,
              group_cost: np.ndarray, table: np.ndarray) -> int:
    """One round of exchanges between heavy groups ``g1[p]`` and light groups ``g2[p]``.

    For every pair it looks at moving a set ``A`` (one or two pieces of ``g1``)
    to ``g2`` in return for a set ``B`` (none, one or two pieces of ``g2``):
    ``A`` goes into the row of ``B``'s first piece (or ``g2``'s roomiest row)
    and ``B`` into the row of ``A``'s first piece, where both rows must keep
    within ``seq_len``.  It applies, per pair, the exchange that most lowers
    the larger of the two groups' costs, if any.  The pairs' groups are
    distinct, so all exchanges apply together.  Returns how many were applied.
    """
    L, C = st.lengths, st.costs
    k = table.shape[1]
    sa, sb = _sets(k, False), _sets(k, True)

    def side(groups: np.ndarray, sets: np.ndarray) -> tuple[np.ndarray, ...]:
        t = table[groups]                                         # (P, k)
        ids = np.where(sets[None] >= 0, t[:, np.maximum(sets, 0)], -1)  # (P, s, 2)
        ok = np.all((ids >= 0) | (sets[None] < 0), axis=2)
        safe = np.maximum(ids, 0)
        here = ids >= 0
        ln = np.where(here, L[safe], 0)
        cs = np.where(here, C[safe], 0.0)
        rows = np.where(here, st.row[safe], -1)
        return ids, ok, ln, cs, rows

    ia, oka, la, ca, ra = side(g1, sa)
    ib, okb, lb, cb, rb = side(g2, sb)
    # receiving rows: A goes to B's first row, else g2's roomiest row
    rows_of = np.arange(len(group_of_row))
    roomiest = np.full(len(group_cost), -1, dtype=np.int64)
    order = np.lexsort((rows_of, -st.row_free, group_of_row))
    first = np.r_[True, group_of_row[order][1:] != group_of_row[order][:-1]]
    roomiest[group_of_row[order][first]] = order[first]
    b0 = np.where(rb[..., 0] >= 0, rb[..., 0], roomiest[g2][:, None])    # (P, sb)
    a0 = ra[..., 0]                                                      # (P, sa)
    la_in = la[..., 0] + np.where(ra[..., 1] == a0, la[..., 1], 0)       # tokens of A in a0
    lb_in = lb[..., 0] + np.where(rb[..., 1] == b0, lb[..., 1], 0)
    lat, lbt = la.sum(-1), lb.sum(-1)
    cat, cbt = ca.sum(-1), cb.sum(-1)
    fa = st.row_free[np.maximum(a0, 0)] + la_in                          # (P, sa)
    fb = st.row_free[b0] + lb_in                                         # (P, sb)
    ok = (oka[:, :, None] & okb[:, None, :]
          & (lbt[:, None, :] <= fa[:, :, None]) & (lat[:, :, None] <= fb[:, None, :]))
    delta = cat[:, :, None] - cbt[:, None, :]
    c1 = group_cost[g1][:, None, None]
    c2 = group_cost[g2][:, None, None]
    ok &= delta > 0
    new = np.where(ok, np.maximum(c1 - delta, c2 + delta), np.inf).reshape(len(g1), -1)
    best = np.argmin(new, axis=1)
    gain = new[np.arange(len(g1)), best] < group_cost[g1] * (1 - 1e-9)
    applied = 0
    for p in np.flatnonzero(gain).tolist():
        i, j = divmod(int(best[p]), len(sb))
        dest_b = int(b0[p, j])
        dest_a = int(a0[p, i])
        for x in ia[p, i]:
            if x >= 0:
                st.row[x] = dest_b
        for y in ib[p, j]:
            if y >= 0:
                st.row[y] = dest_a
        applied += 1
    if applied:
        st.refresh()
    return applied


class _Budget:
    """Candidate exchanges left to evaluate (the deterministic work limit)."""

    def __init__(self, cells: int, per_round: int, k_max: int, k_min: int = 6):
        self.left, self.per_round, self.k_max, self.k_min = cells, per_round, k_max, k_min

    def plan(self, pairs: int) -> tuple[int, int]:
        """``(pairs, k)`` for the next round: the widest tables that fit, at least
        ``k_min`` wide (fewer pairs, heaviest first, when they do not); ``(0, 0)``
        when the budget is spent."""
        cap = min(self.per_round, self.left)
        k = self.k_max
        while k > self.k_min and pairs * _n_cells(k) > cap:
            k -= 1
        k = min(k, self.k_max)
        pairs = min(pairs, cap // _n_cells(k))
        if pairs <= 0:
            return 0, 0
        self.left -= pairs * _n_cells(k)
        return pairs, k


def _n_cells(k: int) -> int:
    return len(_sets(k, False)) * len(_sets(k, True))


def _balance_ranks(st: _State, goal: float, budget: _Budget) -> None:
    R, M = st.n_ranks, st.micro_batches
    group_of_row = np.arange(R * M) // M
    stale = 0
    offset = 0
    while True:
        rank_cost = st.row_cost.reshape(R, M).sum(axis=1)
        top = float(rank_cost.max())
        if top <= goal:
            return
        order = np.argsort(-rank_cost, kind="stable")
        heavy = order[rank_cost[order] > goal]
        light = order[::-1]
        n_pairs = min(len(heavy), R // 2)
        # the lightest ranks, rotated while the top does not improve
        g2 = light[(np.arange(n_pairs) + offset) % max(1, R - n_pairs)]
        g1 = heavy[:n_pairs]
        keep = ~np.isin(g2, g1)
        g1, g2 = g1[keep], g2[keep]
        n_pairs, k = budget.plan(len(g1))
        if n_pairs == 0:
            return
        g1, g2 = g1[:n_pairs], g2[:n_pairs]
        table = _tables(np.where(st.row >= 0, st.row // M, -1), R, st.lengths, k)
        _exchange(st, group_of_row, g1, g2, rank_cost, table)
        after = float(st.row_cost.reshape(R, M).sum(axis=1).max())
        if after < top * (1 - 1e-9):
            stale = 0
        else:
            stale += 1
            offset += n_pairs
            if stale >= 2:
                return


def _even_rows(st: _State, tol: float, budget: _Budget) -> None:
    """Exchanges between the heaviest and the lightest row of every rank."""
    R, M = st.n_ranks, st.micro_batches
    if M < 2:
        return
    ok = st.row >= 0
    rank_of = np.where(ok, st.row // M, -1)
    big = np.zeros(R)
    np.maximum.at(big, rank_of[ok], st.costs[ok])
    rows = np.arange(R * M)
    while True:
        rc = st.row_cost.reshape(R, M)
        goal = np.maximum(rc.mean(axis=1), big) * (1 + tol)
        hi = np.argmax(rc, axis=1)
        lo = np.argmin(rc, axis=1)
        excess = np.divide(rc[np.arange(R), hi], goal, out=np.zeros(R), where=goal > 0)
        todo = np.flatnonzero((excess > 1) & (hi != lo))
        if len(todo) == 0:
            return
        todo = todo[np.argsort(-excess[todo], kind="stable")]
        n_pairs, k = budget.plan(len(todo))
        if n_pairs == 0:
            return
        todo = todo[:n_pairs]
        table = _tables(st.row, R * M, st.lengths, k)
        if not _exchange(st, rows, todo * M + hi[todo], todo * M + lo[todo], st.row_cost, table):
            return


def _place_leftovers(st: _State) -> None:
    """Put pieces that became placeable (exchanges move room around) on the cheapest rank."""
    left = np.flatnonzero(st.row < 0)
    if len(left) == 0:
        return
    R, M = st.n_ranks, st.micro_batches
    changed = False
    for i in left[_decreasing(st.lengths[left].astype(np.float64))].tolist():
        fits = st.row_free >= st.lengths[i]
        if not fits.any():
            continue
        rank_cost = st.row_cost.reshape(R, M).sum(axis=1)
        rank_ok = fits.reshape(R, M).any(axis=1)
        r = int(np.argmin(np.where(rank_ok, rank_cost, np.inf)))
        rows = r * M + np.flatnonzero(fits[r * M:(r + 1) * M])
        row = int(rows[np.argmin(st.row_cost[rows])])
        st.row[i] = row
        st.row_free[row] -= st.lengths[i]
        st.row_cost[row] += st.costs[i]
        changed = True
    if changed:
        st.refresh()


def _place_by_swaps(st: _State, limit: int) -> None:
    """Place left-out pieces by swapping each for a shorter placed piece.

    A left-out piece ``u`` takes the place of a shorter placed piece ``x`` whose
    row then has room for ``u`` (the row with the most room among those that
    do, then the shortest such ``x``); ``x`` goes to a row with room for it if
    there is one, else it is left out in turn.  The left-out tokens fall with
    every swap, so at most ``limit`` swaps are tried.  Rank costs change by the
    difference of two short pieces.
    """
    left = sorted(np.flatnonzero(st.row < 0).tolist(), key=lambda i: -int(st.lengths[i]))
    if not left:
        return
    L = st.lengths
    placed = np.flatnonzero(st.row >= 0)
    by_len = placed[stable_argsort(L[placed])]
    sorted_len = L[by_len]
    changed = False
    while left and limit > 0:
        limit -= 1
        u = left.pop(0)
        lu = int(L[u])
        fits = np.flatnonzero(st.row_free >= lu)
        if len(fits):  # room somewhere: the row with the least room that fits
            r = int(fits[np.argmin(st.row_free[fits])])
            st.row[u] = r
            st.row_free[r] -= lu
            st.row_cost[r] += st.costs[u]
            changed = True
            continue
        cand = by_len[:int(np.searchsorted(sorted_len, lu, side="left"))]
        cand = cand[st.row[cand] >= 0]
        room = st.row_free[st.row[cand]] + L[cand]
        cand = cand[room >= lu]
        if len(cand) == 0:
            continue
        x = int(cand[np.lexsort((L[cand], -st.row_free[st.row[cand]]))[0]])
        r = int(st.row[x])
        st.row[u], st.row[x] = r, -1
        st.row_free[r] += int(L[x]) - lu
        st.row_cost[r] += st.costs[u] - st.costs[x]
        left.append(x)
        left.sort(key=lambda i: -int(L[i]))
        changed = True
    if changed:
        st.refresh()


def balanced(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
             seq_len: int, *, tol: float = 0.005, greedy_work: int = 30_000,
             work: int = 400_000, per_round: int = 100_000, k_max: int = 12) -> Assignment:
    """Near-optimal balance of rank costs under the row capacity ``seq_len``.

    The goal is a heaviest rank within ``tol`` of ``max(lower_bound,
    capacity_bound)`` (what the pieces allow); each stage stops once it is met.

    1. **Greedy starts.**  With ``ρ`` the lowest cost per token of any piece,
       a piece's *excess* cost is ``cost − ρ·length`` (for ``α·L + β·L²``,
       about ``β·L²``).  A step's rows are nearly full, so every rank ends up
       with about the same tokens and rank costs differ by their excess: LPT
       on excess costs balances exactly that, where plain LPT on costs leaves
       the last, short pieces no room but on ranks that are already heavy.
       Tried in turn, keeping the best, until one is within ``2·tol``: LPT on
       excess costs (plus ``0.001 × cost``, to break ties), LPT on excess
       costs for the pieces above 0.2% of a mean rank and then on costs, and
       LPT on costs (first instead, when the pieces fill less than 98% of the
       step).  Starts after the first only run while the pieces they
       have handled stay within ``greedy_work``.  Pieces whose key is below
       1e-4 of a mean rank's are placed in vectorised rounds when there are
       many (:meth:`_Greedy.fill_tail`).
    2. **Exchanges between ranks.**  Each round pairs the ranks above the goal,
       heaviest first, with the lightest ranks and applies, per pair, the
       exchange of up to two pieces for up to two pieces (or a plain move)
       that most lowers the pair's larger cost while every row stays within
       ``seq_len``, vectorised over all pairs.  Stops at the goal, when the
       max has not fallen for 2 rounds, or when ``work`` candidate exchanges
       have been evaluated (at most ``per_round`` a round: the per-rank piece
       tables narrow from ``k_max`` pieces, the ``k_max // 2`` longest and the
       rest spread over the shorter ones, down to 6, then fewer pairs).
    3. **Pieces for which some row has room again are placed** (exchanges
       move room around).
    4. **Even micro-batches.**  The same exchanges between the heaviest and
       the lightest row of every rank (rank costs do not change), until every
       rank's rows are within ``tol`` of ``max(mean row, its largest piece)``,
       nothing improves, or ``work / 3`` candidates have been evaluated.

    Every limit counts work, not time, so the result depends only on the input.
    """
    n = len(lengths)
    if n == 0:
        return _empty(0, n_ranks, micro_batches)
    rho = _min_cost_per_token(lengths, costs)
    best: tuple[float, int] | None = None
    chosen = None
    chosen_bound = 0.0
    goal_ratio = 1.0 + tol
    spent = 0
    for start in _starts(lengths, costs, n_ranks, micro_batches, seq_len, rho):
        if spent and spent + n > greedy_work:
            break
        spent += n
        a = start()
        ok = a.placed
        if ok.all():  # (no copies of a step's lengths and costs)
            bound = capacity_bound(lengths, costs, n_ranks, micro_batches, seq_len)
        else:
            bound = capacity_bound(lengths[ok], costs[ok], n_ranks, micro_batches, seq_len)
        ratio = float(a.rank_cost.max()) / bound if bound > 0 else 1.0
        score = (ratio, int((~ok).sum()))
        if best is None or score < best:
            best, chosen, chosen_bound = score, a, bound
        if ratio <= 1.0 + 2 * tol:
            break
    assert chosen is not None
    st = _State(chosen, lengths, costs, seq_len)
    del chosen, a, ok  # the exchanges work on st alone
    if n_ranks > 1:
        # the bound of the pieces the chosen start placed, as computed for it
        goal = chosen_bound * goal_ratio
        _balance_ranks(st, goal, _Budget(work, per_round, k_max))
    _place_leftovers(st)
    _place_by_swaps(st, 4 * int((st.row < 0).sum()) + 64)
    _even_rows(st, tol, _Budget(work // 3, per_round, k_max))
    # (evening a rank's rows can open room for a piece left out: placed, as the strategy
    # promises a piece is left out only where no row has room; a review)
    _place_leftovers(st)
    return st.assignment()


def improve(a: Assignment, lengths: np.ndarray, costs: np.ndarray, seq_len: int, *,
            tol: float = 0.005, work: int = 400_000, per_round: int = 100_000,
            k_max: int = 12) -> Assignment:
    """:func:`balanced`'s exchanges (stages 2 and 4) from a given assignment.

    Every piece stays placed and every row within ``seq_len``: for a start
    that places every piece (as whole rows dealt to ranks do) where the greedy
    starts of :func:`balanced` leave some out.
    """
    n_ranks, micro_batches = a.micro_cost.shape
    st = _State(a, lengths, costs, seq_len)
    ok = a.placed
    if n_ranks > 1 and ok.any():
        goal = capacity_bound(lengths[ok], costs[ok], n_ranks, micro_batches, seq_len) * (1 + tol)
        _balance_ranks(st, goal, _Budget(work, per_round, k_max))
    _even_rows(st, tol, _Budget(work // 3, per_round, k_max))
    # (evening a rank's rows can open room for a piece left out: placed, as the strategy
    # promises a piece is left out only where no row has room; a review)
    _place_leftovers(st)
    return st.assignment()


Strategy = Callable[[np.ndarray, np.ndarray, int, int, int], Assignment]

STRATEGIES: dict[str, Strategy] = {"sequential": sequential, "lpt": lpt, "balanced": balanced}


def check_piece_lengths(lengths: np.ndarray, seq_len: int) -> None:
    """A ``ValueError`` naming the longest piece if it is longer than a row of ``seq_len``
    tokens, or the shortest if it is negative: the placements' one rule (with ``lpt`` and
    ``balanced`` a step's best fit took a piece longer than a row, carried it for ever,
    raised a bare ``IndexError``, or, compiled, wrote out of bounds; a review)."""
    if not len(lengths):
        return
    longest, shortest = int(lengths.max()), int(lengths.min())
    if longest > seq_len:
        raise ValueError(f"a piece of {longest} tokens exceeds seq_len {seq_len}")
    if shortest < 0:
        raise ValueError(f"a piece of {shortest} tokens: a piece's length is >= 0")


def assign(lengths: np.ndarray, costs: np.ndarray, n_ranks: int, micro_batches: int,
           seq_len: int, strategy: str = "balanced") -> Assignment:
    """Assign pieces to ranks and micro-batches with the named strategy.

    Parameters
    ----------
    lengths : ndarray of int
        Tokens of each piece (each ``<= seq_len``).
    costs : ndarray of float
        Cost of each piece (``>= 0``).
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
    check_piece_lengths(lengths, seq_len)
    return fn(lengths, np.asarray(costs, dtype=np.float64), n_ranks, micro_batches, seq_len)
