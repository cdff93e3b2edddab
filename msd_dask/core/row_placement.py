"""Where a step's pieces go (pure, no Dask): rows, ranks and micro-batches.

The planner's placement (:class:`~msd_dask.core.plan.Planner` draws a step's
pieces, these functions place them), reusable by benchmarks and the simulator:
:func:`kept_rows` chooses the pieces a step keeps without the mesh,
:func:`place_step` puts them on ranks and micro-batches with a balance
strategy (:mod:`msd_dask.core.balance`), on a large mesh block by block
(:func:`rank_blocks`, in parallel threads), and :func:`spread_long` limits the
long-context pieces per rank.  Pieces it cannot place are carried to the next
step (rank ``-1``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from heapq import heappop, heappush
from typing import Any, TypeVar

import numpy as np

from msd_dask.core._kernels import best_fit_rows, in_piece_order, stable_argsort
from msd_dask.core.balance import assign, build_assignment, check_piece_lengths, improve
from msd_dask.core.scaling import usable_cores
from msd_dask.core.stream import fits_int32

__all__ = ["kept_rows", "place_step", "planner_threads", "rank_blocks", "row_blocks",
           "spread_long", "BLOCK_RANKS", "BLOCK_ROWS", "KEPT_SLACK", "THREADS_ENV"]

#: the share of a step's tokens :func:`kept_rows` leaves free (rows packed to the last token
#: leave the balance strategy no room to move pieces between ranks)
KEPT_SLACK = 0.001

#: the fewest DP ranks of a block :func:`place_step` balances on its own (:func:`rank_blocks`)
BLOCK_RANKS = 2048

#: the fewest rows of a block :func:`kept_rows` fits on its own (:func:`row_blocks`): a
#: block's best fit is as full as the whole step's, and the blocks fit on threads
BLOCK_ROWS = 16384

#: the environment variable that caps the threads placing blocks (default: the cores this
#: process may run on)
THREADS_ENV = "MSD_DASK_PLANNER_THREADS"

_T = TypeVar("_T")

#: prices pieces: their costs, given their lengths (a :class:`~msd_dask.core.cost.CostModel`)
Pricing = Callable[[np.ndarray], np.ndarray]
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _forget_pool() -> None:
    """In a forked child: the parent's pool has no threads here (a job given to it would
    never run), and its lock may have been held by another thread at the fork."""
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def kept_rows(lengths: np.ndarray, n_carried: int, n_rows: int, seq_len: int) -> np.ndarray:
    """Which pieces a step places, decided without the mesh: a row of each (int32 where
    ``n_rows`` fits), ``-1`` if carried.

    Best-fit decreasing over ``n_rows`` rows of ``seq_len`` tokens: the pieces
    carried from the last step first (in order), then the new ones by
    decreasing length (stable); each goes to the row with the least room that
    still fits it (lowest row on ties), and a piece that fits in no row is
    carried.  From ``2 × BLOCK_ROWS`` rows on, the rows are blocks of
    consecutive rows (:func:`row_blocks`) and the pieces, in that order, are
    dealt to them in turn, each block fitting its own on a thread
    (:func:`planner_threads`; the same rows on any number of them).  Then the
    shortest kept new pieces beyond ``1 - KEPT_SLACK`` of the step's tokens are
    carried too (only pieces no longer than that excess), so the balance
    strategy has room to move pieces between ranks.  Only the
    number of rows matters, not how they are split into ranks and
    micro-batches, so a step holds the same pieces after an elastic resume
    with another ``dp`` and the same ``dp × micro_batches``.

    The best fit is compiled (:func:`msd_dask.core._kernels.best_fit_rows`),
    which places runs of pieces of one length a row at a time.
    """
    n = len(lengths)
    row = np.full(n, -1, dtype=_int_type(n_rows))
    if n == 0 or n_rows <= 0:
        return row
    lengths = np.asarray(lengths)
    if lengths.dtype != np.int32:  # (int32 as the planner passes them, else int64)
        lengths = lengths.astype(np.int64, copy=False)
    # the lengths in best-fit order: the carried pieces', then each length as often as it
    # comes, longest first (a counting sort: no gather or order array of millions of pieces)
    # (int32, as the rows they get: a step at dp 16,384 x 128K holds millions of pieces, and
    # this is the placement's peak)
    count = np.bincount(lengths[n_carried:])
    ls = np.empty(n, dtype=np.int32 if fits_int32(lengths) else np.int64)
    ls[:n_carried] = lengths[:n_carried]
    ls[n_carried:] = np.repeat(np.arange(len(count) - 1, -1, -1, dtype=ls.dtype), count[::-1])
    fit = _best_fit_blocks(ls, n_rows, seq_len)
    del ls
    row[:n_carried] = fit[:n_carried]
    # back in piece order: the new pieces of length L come after the longer ones
    after = np.cumsum(count[::-1])[::-1]  # the new pieces of length L or more
    start = after - count
    del count, after
    in_piece_order(fit[n_carried:], lengths[n_carried:], start, row[n_carried:])
    del fit, start
    # the shortest new pieces over (1 - KEPT_SLACK) of the step's tokens wait for the next
    # step (where they are placed first)
    over = int(lengths[row >= 0].sum()) - int((1 - KEPT_SLACK) * n_rows * seq_len)
    if over > 0:
        _carry_shortest(row[n_carried:], lengths[n_carried:], over)
    return row


def _best_fit_blocks(ls: np.ndarray, n_rows: int, seq_len: int) -> np.ndarray:
    """The best fit of the pieces ``ls`` (lengths, in placement order) over ``n_rows`` rows,
    block by block of :func:`row_blocks` (see :func:`kept_rows`): each piece's row (int32
    where ``n_rows`` fits)."""
    blocks = row_blocks(n_rows)
    if blocks == 1:
        return best_fit_rows(ls.astype(np.int64), n_rows, seq_len).astype(_int_type(n_rows))
    per = n_rows // blocks
    # each block writes its own pieces' rows (every blocks-th), so not every block's result
    # at once besides the whole
    fit = np.empty(len(ls), dtype=_int_type(n_rows))

    def block(b: int) -> None:
        rows = best_fit_rows(ls[b::blocks].astype(np.int64), per, seq_len)
        np.add(rows, b * per, out=rows, where=rows >= 0)  # (-1, carried, stays)
        fit[b::blocks] = rows

    _map(block, range(blocks), planner_threads())
    return fit


def _carry_shortest(row: np.ndarray, lengths: np.ndarray, over: int) -> None:
    """Carry (``row`` -1, in place) the fewest kept pieces of at most ``over`` tokens,
    shortest first (the first on ties), whose tokens reach ``over`` (all of them where
    they do not).

    A longer piece stays: freeing a few tokens of slack by carrying a whole row's piece
    would leave that row empty, step after step while a long document's full-row chunks
    come (at dp 2 × 1 row of 4,096, one rank of every such step got nothing).

    By a count of the kept pieces of each length, not a sort: the pieces shorter than
    the length where the tokens reach ``over`` go, and of that length the first as many
    as the rest needs.
    """
    kept = (row >= 0) & (lengths <= over)
    tokens = np.bincount(lengths[kept], minlength=1)
    tokens *= np.arange(len(tokens))  # the kept pieces' tokens of each length
    reach = np.cumsum(tokens)
    if reach[-1] < over:
        row[kept] = -1
        return
    cut = int(np.searchsorted(reach, over, side="left"))  # (> 0: over > 0)
    need = -(-(over - int(reach[cut - 1])) // cut)  # pieces of length cut, in order
    at_cut = np.flatnonzero(kept & (lengths == cut))[:need]
    row[kept & (lengths < cut)] = -1
    row[at_cut] = -1


def place_step(lengths: np.ndarray, costs: np.ndarray | Pricing, n_carried: int, dp: int,
               mb: int, seq_len: int, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """Rank and micro-batch of each of a step's pieces (``-1``: carried to the next step).

    The planner's placement, reusable by benchmarks and the simulator.  With
    ``sequential`` the pieces fill rows next fit in order (carried pieces
    first, and always placed).  With the other strategies the pieces the step
    keeps are chosen by :func:`kept_rows`, independently of how the rows are
    grouped into ranks, and the strategy balances them over the mesh; where it
    cannot place them all (most steps of a heavy-tailed corpus with nearly full
    rows below the blocks of ranks: docs/balance.md), the kept rows themselves
    are dealt to ranks (most costly row first, to the cheapest rank with a free
    micro-batch), which always fits, and with ``balanced`` then evened by its
    exchanges (:func:`~msd_dask.core.balance.improve`).

    From ``2 × BLOCK_RANKS`` DP ranks on, the strategy balances blocks of
    ranks on their own (:func:`rank_blocks`: ``B`` blocks of ``dp / B``
    consecutive ranks): the kept pieces, longest first (stable), are dealt to
    the blocks in turn, so each block has the same share of long and short
    pieces (the blocks' tokens differ by at most one piece), and the blocks
    are placed in parallel threads (:func:`planner_threads`).  The kernels
    release the GIL, and a block's tables are smaller, so this is faster even
    on one thread.  The result depends on ``dp``, never on the threads.

    Parameters
    ----------
    lengths : ndarray
        Tokens of each piece, the ``n_carried`` carried pieces first.
    costs : ndarray or callable
        Cost of each piece, or the function that prices pieces of given lengths (a
        :class:`~msd_dask.core.cost.CostModel`, as the planner passes it): then each
        block prices its own pieces, and no array of the step's costs is made (at dp
        16,384 × 128K a step holds millions of pieces, and the placement is the
        planner's peak).
    n_carried : int
    dp, mb, seq_len : int
        ``dp × mb`` rows of ``seq_len`` tokens.
    strategy : str
        A balance strategy (:data:`msd_dask.core.balance.STRATEGIES`).

    Returns
    -------
    rank, micro : ndarray of int
        int32 where ``dp`` and ``mb`` fit (a config's always do; a step at dp 16,384 ×
        128K holds millions of pieces)
    """
    check_piece_lengths(lengths, seq_len)
    if strategy == "sequential":  # next fit over the rows: mesh-agnostic already
        costs = _priced(lengths, costs)
        a = assign(lengths, costs, dp, mb, seq_len, strategy)
        rank, micro = a.rank.copy(), a.micro.copy()
        _place_carried(n_carried, lengths, rank, micro, seq_len)
        return rank.astype(_int_type(dp)), micro.astype(_int_type(mb))
    n = len(lengths)
    rows = kept_rows(lengths, n_carried, dp * mb, seq_len)
    # (what lives through the strategy is as narrow as it can be: a step at dp 16,384 x 128K
    # holds millions of pieces, and the planner's peak is the sum of their arrays)
    idx = np.flatnonzero(rows >= 0).astype(_int_type(n))
    rows = rows[idx]  # the kept pieces' rows
    # (the kept lengths in int32: a piece is at most seq_len tokens, a config's int)
    lengths_kept = lengths[idx].astype(_int_type(seq_len + 1))
    costs_kept = costs if callable(costs) else np.asarray(costs, dtype=np.float64)[idx]
    del lengths, costs  # (the caller may pass them for this call alone)
    kept_rank, kept_micro = _assign_blocks(lengths_kept, costs_kept, dp, mb, seq_len, strategy)
    if (kept_rank >= 0).all():
        # (the kept pieces' arrays go before the step's are made, one at a time: else these
        # are the placement's peak)
        del lengths_kept, costs_kept, rows
        rank = _scattered(n, idx, kept_rank, dp)
        del kept_rank
        return rank, _scattered(n, idx, kept_micro, mb)
    del kept_rank, kept_micro
    lengths_kept = lengths_kept.astype(np.int64)
    costs_kept = _priced(lengths_kept, costs_kept)
    rank = np.full(n, -1, dtype=np.int64)
    micro = rank.copy()
    row_cost = np.bincount(rows, weights=costs_kept, minlength=dp * mb)
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
    rank[idx], micro[idx] = rank_of[rows], micro_of[rows]
    if strategy == "balanced":  # then the exchanges, which keep every piece placed
        b = improve(build_assignment(rank[idx], micro[idx], lengths_kept, costs_kept, dp, mb),
                    lengths_kept, costs_kept, seq_len)
        rank[idx], micro[idx] = b.rank, b.micro
    return rank.astype(_int_type(dp)), micro.astype(_int_type(mb))


def _priced(lengths: np.ndarray, costs: np.ndarray | Pricing) -> np.ndarray:
    """The pieces' costs: ``costs`` as given (array-like), or as it prices ``lengths``."""
    return costs(lengths) if callable(costs) else np.asarray(costs, dtype=np.float64)


def _int_type(top: int) -> type[np.signedinteger[Any]]:
    """int32 for values below ``top`` where it fits them (the step's arrays are narrow: at dp
    16,384 × 128K they hold millions of pieces), else int64."""
    return np.int32 if top <= 2**31 else np.int64


def _scattered(n: int, idx: np.ndarray, values: np.ndarray, top: int) -> np.ndarray:
    """``n`` values below ``top`` (:func:`_int_type`), ``values`` at ``idx`` and ``-1``
    elsewhere."""
    out = np.full(n, -1, dtype=_int_type(top))
    out[idx] = values
    return out


def rank_blocks(dp: int) -> int:
    """How many blocks of DP ranks :func:`place_step` balances on their own.

    The most blocks, each of at least :data:`BLOCK_RANKS` ranks, that split ``dp``
    into equal blocks (``dp`` divided by them); ``1`` (the whole mesh at once) below
    ``2 × BLOCK_RANKS`` ranks or where no such split exists.  dp 16,384: 8 blocks of
    2,048; dp 12,288: 6 of 2,048; dp 4,096: 2.
    """
    return _equal_blocks(dp, BLOCK_RANKS)


def row_blocks(n_rows: int) -> int:
    """How many blocks of rows :func:`kept_rows` fits on their own: as :func:`rank_blocks`,
    of at least :data:`BLOCK_ROWS` rows.  A step's rows alone decide it (``dp ×
    micro_batches``), so an elastic resume keeps the same pieces.  dp 16,384 × 8 rows:
    8 blocks of 16,384 rows; × 1 row: one."""
    return _equal_blocks(n_rows, BLOCK_ROWS)


def _equal_blocks(n: int, least: int) -> int:
    """The most equal blocks of at least ``least`` that split ``n``; 1 where none do."""
    for blocks in range(n // least, 1, -1):
        if n % blocks == 0:
            return blocks
    return 1


def planner_threads() -> int:
    """The threads :func:`place_step` places blocks with (and the planner's actor compresses
    a step's work with): ``$MSD_DASK_PLANNER_THREADS`` (:data:`THREADS_ENV`) if set, else the
    cores this process may run on."""
    raw = os.environ.get(THREADS_ENV, "").strip()
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{THREADS_ENV}={raw!r}: expected a whole number of threads >= 1")
        return n
    return usable_cores()


def _map(fn: Callable[[int], _T], items: Iterable[int], threads: int) -> list[_T]:
    """``[fn(i) for i in items]``, on up to ``threads`` threads of one pool kept for the
    process (the same threads step after step, so their C heap arenas too)."""
    global _pool, _pool_size
    if threads <= 1:
        return [fn(i) for i in items]
    with _pool_lock:  # (submitted under the lock: another size replaces this pool only after)
        if _pool is None or _pool_size != threads:
            if _pool is not None:
                _pool.shutdown(wait=False)  # (jobs submitted to it still run)
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="msd-place")
            _pool_size = threads
        jobs = [_pool.submit(fn, i) for i in items]
    return [job.result() for job in jobs]


def _assign_blocks(lengths: np.ndarray, costs: np.ndarray | Pricing, dp: int, mb: int,
                   seq_len: int, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """The strategy's rank and micro-batch of each kept piece (``-1``: it left the piece
    out), block by block of :func:`rank_blocks` (see :func:`place_step`; ``costs`` a
    function: each block prices its own)."""
    blocks = rank_blocks(dp)
    if blocks == 1:
        a = assign(lengths, _priced(lengths, costs), dp, mb, seq_len, strategy)
        return a.rank, a.micro
    # (int32: the step's pieces' order lives through the blocks, the placement's peak)
    order = stable_argsort(lengths, descending=True).astype(_int_type(len(lengths)))
    per = dp // blocks
    # each block writes its own pieces' places (no two blocks share one), so neither a
    # merged copy nor every block's arrays at once (at dp 16,384 x 128K a step holds
    # millions of pieces)
    rank = np.empty(len(lengths), dtype=_int_type(dp))
    micro = np.empty(len(lengths), dtype=_int_type(mb))

    def block(b: int) -> None:
        mine = order[b::blocks]  # every blocks-th piece from the b-th longest
        ls = lengths[mine]
        a = assign(ls, costs(ls) if callable(costs) else costs[mine], per, mb, seq_len,
                   strategy)
        del ls
        r = a.rank.astype(rank.dtype)
        np.add(r, b * per, out=r, where=r >= 0)  # (-1, left out, stays)
        rank[mine] = r
        micro[mine] = a.micro

    _map(block, range(blocks), planner_threads())
    return rank, micro


def spread_long(is_long: np.ndarray, n_carried: int, lengths: np.ndarray, costs: np.ndarray,
                 rank: np.ndarray, micro: np.ndarray, dp: int, mb: int, seq_len: int,
                 max_per_rank: int) -> None:
    """Move long pieces off ranks holding more than ``max_per_rank`` of them.

    A long piece moves to the cheapest rank still under the limit, into its
    emptiest row; short pieces it displaces there take its old row where they
    fit, else they are carried to the next step (never pieces carried already).
    A long piece no rank can take is carried itself (a new one of the rank's:
    the pieces carried already are placed in this step).
    """
    placed = rank >= 0
    count = np.bincount(rank[placed & is_long], minlength=dp)
    used = np.zeros((dp, mb), dtype=np.int64)
    np.add.at(used, (rank[placed], micro[placed]), lengths[placed])
    load = np.bincount(rank[placed], weights=costs[placed], minlength=dp)
    for r in np.flatnonzero(count > max_per_rank):
        mine = [int(i) for i in np.flatnonzero((rank == r) & is_long)]
        mine.sort(key=lambda i: costs[i])
        stuck: list[int] = []
        for i in mine[: int(count[r]) - max_per_rank]:
            if not _move_long(i, n_carried, is_long, lengths, costs, rank, micro, count, used,
                              load, max_per_rank, seq_len):
                stuck.append(i)
        # those no rank could take wait for the next step, new ones first (cheapest first)
        new = [i for i in mine if i >= n_carried and rank[i] == r]
        for i in new[:len(stuck)]:
            _unplace(i, lengths, costs, rank, micro, count, used, load)
        # a carried one still over the limit takes the place of a new long piece of another
        # rank, which waits instead (it stayed over: a rank with two carried long pieces
        # where the other ranks were at the limit or full of carried pieces; a review)
        over = int(count[r]) - max_per_rank
        for i in [i for i in stuck if i < n_carried and rank[i] == r][:max(over, 0)]:
            _swap_long(i, n_carried, is_long, lengths, costs, rank, micro, count, used, load,
                       seq_len)


def _move_long(i: int, n_carried: int, is_long: np.ndarray, lengths: np.ndarray,
               costs: np.ndarray, rank: np.ndarray, micro: np.ndarray, count: np.ndarray,
               used: np.ndarray, load: np.ndarray, max_per_rank: int, seq_len: int) -> bool:
    """Move long piece ``i`` to the cheapest rank under the limit that can take it, into its
    emptiest row that can (see :func:`spread_long`), updating the bookkeeping arrays;
    whether one could.

    Each row of a rank is tried, emptiest first: only the emptiest was, and where it held
    a piece carried from the last step (which cannot be evicted) the rank was passed over
    though another row could make room, and a rank with two carried long pieces stayed
    over the limit (a review)."""
    for t in np.argsort(load, kind="stable"):
        if count[t] >= max_per_rank:
            continue
        for m in np.argsort(used[t], kind="stable").tolist():
            evict = _room_for(i, t, m, n_carried, is_long, lengths, rank, micro, used, seq_len)
            if evict is not None:
                _move(i, int(t), m, evict, lengths, costs, rank, micro, count, used, load,
                      seq_len)
                return True
    return False


def _swap_long(i: int, n_carried: int, is_long: np.ndarray, lengths: np.ndarray,
               costs: np.ndarray, rank: np.ndarray, micro: np.ndarray, count: np.ndarray,
               used: np.ndarray, load: np.ndarray, seq_len: int) -> bool:
    """Put carried long piece ``i``, which no rank under the limit can take, in the row of a
    new long piece of another rank (the cheapest rank first, its longest such piece first)
    that makes room for it; that piece waits for the next step (see :func:`spread_long`).
    Whether one did."""
    ri = int(rank[i])
    for t in np.argsort(load, kind="stable").tolist():
        if t == ri:
            continue
        mine = [int(j) for j in np.flatnonzero((rank == t) & is_long) if j >= n_carried]
        for j in sorted(mine, key=lambda j: -int(lengths[j])):
            m = int(micro[j])
            _unplace(j, lengths, costs, rank, micro, count, used, load)
            evict = _room_for(i, t, m, n_carried, is_long, lengths, rank, micro, used, seq_len)
            if evict is not None:
                _move(i, t, m, evict, lengths, costs, rank, micro, count, used, load, seq_len)
                return True
            _place(j, t, m, lengths, costs, rank, micro, count, used, load)
    return False


def _move(i: int, t: int, m: int, evict: list[int], lengths: np.ndarray, costs: np.ndarray,
          rank: np.ndarray, micro: np.ndarray, count: np.ndarray, used: np.ndarray,
          load: np.ndarray, seq_len: int) -> None:
    """Move long piece ``i`` to row ``(t, m)``, less the short pieces ``evict``, which take
    its old row where they fit there, else wait for the next step."""
    ri, mi = int(rank[i]), int(micro[i])
    for j in evict:
        used[t, m] -= lengths[j]
        load[t] -= costs[j]
        rank[j] = micro[j] = -1
    _unplace(i, lengths, costs, rank, micro, count, used, load)
    _place(i, t, m, lengths, costs, rank, micro, count, used, load)
    for j in evict:
        if used[ri, mi] + lengths[j] <= seq_len:
            rank[j], micro[j] = ri, mi
            used[ri, mi] += lengths[j]
            load[ri] += costs[j]


def _unplace(i: int, lengths: np.ndarray, costs: np.ndarray, rank: np.ndarray,
             micro: np.ndarray, count: np.ndarray, used: np.ndarray, load: np.ndarray) -> None:
    """Take long piece ``i`` out of its row (it waits for the next step)."""
    r, m = int(rank[i]), int(micro[i])
    used[r, m] -= lengths[i]
    load[r] -= costs[i]
    count[r] -= 1
    rank[i] = micro[i] = -1


def _place(i: int, t: int, m: int, lengths: np.ndarray, costs: np.ndarray, rank: np.ndarray,
           micro: np.ndarray, count: np.ndarray, used: np.ndarray, load: np.ndarray) -> None:
    """Put long piece ``i`` in row ``(t, m)``."""
    rank[i], micro[i] = t, m
    used[t, m] += lengths[i]
    load[t] += costs[i]
    count[t] += 1


def _room_for(i: int, t: int, m: int, n_carried: int, is_long: np.ndarray, lengths: np.ndarray,
              rank: np.ndarray, micro: np.ndarray, used: np.ndarray,
              seq_len: int) -> list[int] | None:
    """The new short pieces to evict from row ``(t, m)`` (longest first) so that piece ``i``
    fits there; ``None`` if evicting every such piece would not make room."""
    need = int(lengths[i]) - (seq_len - int(used[t, m]))
    evict: list[int] = []
    if need <= 0:
        return evict
    cands = [int(j) for j in np.flatnonzero((rank == t) & (micro == m) & ~is_long)
             if j >= n_carried]
    cands.sort(key=lambda j: -lengths[j])
    freed = 0
    for j in cands:
        if freed >= need:
            break
        evict.append(j)
        freed += int(lengths[j])
    return evict if freed >= need else None


def _place_carried(n_carried: int, lengths: np.ndarray, rank: np.ndarray, micro: np.ndarray,
                   seq_len: int) -> None:
    """Make sure pieces carried from the last step are placed now.

    A carried piece the strategy left out takes the row of a new piece
    (the shortest that makes room), which is carried instead; so no piece
    waits more than one step.
    """
    n = len(lengths)
    lengths = np.asarray(lengths, dtype=np.int64)
    new = np.arange(n) >= n_carried
    for i in range(n_carried):
        if rank[i] >= 0:
            continue
        placed = rank >= 0
        # tokens used in each piece's row; the new placed piece with the least length (the
        # first of them) whose row has room for piece i once it leaves
        row = rank * max(int(micro.max()) + 1, 1) + micro
        used = np.zeros(max(int(row.max()) + 1, 1), dtype=np.int64)
        np.add.at(used, row[placed], lengths[placed])
        room = seq_len - used[np.maximum(row, 0)] + lengths
        cand = np.flatnonzero(placed & new & (room >= lengths[i]))
        if len(cand) == 0:  # every row is full of carried pieces: cannot happen in practice
            continue
        best = int(cand[np.argmin(lengths[cand])])
        rank[i], micro[i] = rank[best], micro[best]
        rank[best] = micro[best] = -1
