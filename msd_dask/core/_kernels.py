"""The planner's inner loops (private), compiled by numba once steps are large.

Each kernel is the one implementation of its rule; the modules that own the
rules (:mod:`~msd_dask.core.row_placement`, :mod:`~msd_dask.core.balance`,
:mod:`~msd_dask.core.mixing`) prepare arrays, call it and document what it
decides.

The kernels are plain Python over numpy arrays.  They run as such until a call
has :data:`COMPILE_AT` pieces or more (or :func:`compile_for` is told a step
will); from then on, in this process, every kernel runs compiled by numba
(:func:`compile_kernels`).  As Python they take about 60 µs per piece, so a
step of a few hundred pieces takes milliseconds either way, while numba and its
compiled code cost a process about 120 MiB of memory and a second or two (about
20 s where its cache is empty): a small service never imports it.  Compiled and interpreted runs
decide the same, bit for bit (``tests/unit/test_kernels.py``).  ``cache=True``
keeps the compiled code in ``__pycache__``, so only the first process after an
install (or a change here) pays the compilation, and it does in a child process
of its own (:func:`compile_kernels`): numba's compiler state stays in the
process that compiled, about 200 MiB.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

__all__ = ["COMPILE_AT", "best_fit_rows", "chunk_rows", "compile_for", "compile_kernels", "compiled",
           "fill_rounds", "gather_rows", "greedy_fill", "in_piece_order", "mix_draw", "permute_rows",
           "row_order", "row_sums", "sorted_sums", "stable_argsort"]

#: a kernel call with this many items (pieces) compiles the kernels
COMPILE_AT = 1024


# ----------------------------------------------------------------------------- scratch


def _flags(n: int) -> Any:
    """``n`` cleared flags, a kernel's scratch.  Interpreted, a Python list: numpy's scalar
    reads and writes cost several times a list's, and at a step of a few dozen pieces
    they are most of a kernel's time.  Compiled, :func:`_flags_array` takes its place."""
    return [False] * n


def _ints(n: int, value: int) -> Any:
    """``n`` copies of ``value``, a kernel's scratch: a Python list interpreted (see
    :func:`_flags`), :func:`_ints_array` compiled."""
    return [value] * n


def _flags_array(n: int) -> np.ndarray:
    return np.zeros(n, dtype=np.bool_)


def _ints_array(n: int, value: int) -> np.ndarray:
    return np.full(n, value, dtype=np.int64)


#: what :func:`compile_kernels` compiles in place of each interpreted scratch maker
_SCRATCH = {"_flags": _flags_array, "_ints": _ints_array}


# ----------------------------------------------------------------------------- best fit decreasing


def _meld(a: int, b: int, child: np.ndarray, sib: np.ndarray) -> int:
    """Pairing heap of row ids (the least on top): the meld of roots ``a`` and ``b``."""
    if a < 0:
        return b
    if b < 0:
        return a
    if b < a:
        a, b = b, a
    sib[b] = child[a]
    child[a] = b
    return a


def _pop(root: int, child: np.ndarray, sib: np.ndarray, stack: np.ndarray) -> int:
    """The new root once ``root`` leaves its pairing heap (two-pass pairing of its children)."""
    c = child[root]
    child[root] = -1
    top = 0
    while c >= 0:
        a = c
        b = sib[a]
        sib[a] = -1
        if b < 0:
            stack[top] = a
            top += 1
            break
        c = sib[b]
        sib[b] = -1
        stack[top] = _meld(a, b, child, sib)
        top += 1
    h = -1
    while top > 0:
        top -= 1
        h = _meld(stack[top], h, child, sib)
    return h


def _mark(tree: np.ndarray, leaf: int, on: bool) -> None:
    """Set (``on``) or clear a leaf of a segment tree of "some row has this room" flags."""
    i = leaf
    tree[i] = on
    while i > 1:
        up = i >> 1
        v = tree[2 * up] or tree[2 * up + 1]
        if tree[up] == v:
            break
        tree[up] = v
        i = up


def _first_at_least(tree: np.ndarray, size: int, x: int) -> int:
    """The least room ``>= x`` that some row has, ``-1`` if none."""
    i = x + size
    if tree[i]:
        return x
    while True:
        if i & 1 == 0 and tree[i + 1]:
            i += 1
            break
        i >>= 1
        if i <= 1:
            return -1
    while i < size:
        i = 2 * i if tree[2 * i] else 2 * i + 1
    return i - size


def _best_fit_rows(ls: np.ndarray, n_rows: int, seq_len: int) -> np.ndarray:
    """:func:`~msd_dask.core.row_placement.kept_rows`' best fit, in placement order.

    ``ls``: the pieces' lengths in the order they are placed (an array compiled, a
    list interpreted: see :func:`_flags`).  Returns each piece's row (``-1``: fits
    in no row), of the same kind.  Each piece goes to the row with the
    least room that fits it, the lowest such row on ties.  Runs of equal
    lengths go a row at a time: the tightest row that fits ``L`` stays the
    tightest while it takes ``L`` after ``L``, so it takes ``room // L`` of them
    before the next row.  Rows with one room are a pairing heap (lowest row on
    top); the rooms some row has are flags in a segment tree.
    """
    n = len(ls)
    out = _ints(n, -1)
    if n == 0 or n_rows <= 0:
        return out
    shortest = ls[0]
    for x in ls:
        shortest = min(shortest, x)
    size = 1
    while size < seq_len + 2:
        size *= 2
    tree = _flags(2 * size)
    head = _ints(seq_len + 1, -1)
    count = _ints(seq_len + 1, 0)
    child = _ints(n_rows, -1)
    sib = _ints(n_rows, -1)
    stack = _ints(n_rows, 0)
    take = _ints(n_rows, 0)
    # every row at seq_len: a path 0 -> 1 -> 2 ... (each the only child of the one before)
    for r in range(n_rows - 1):
        child[r] = r + 1
    head[seq_len] = 0
    count[seq_len] = n_rows
    _mark(tree, size + seq_len, True)
    pos = 0
    while pos < n:
        L = ls[pos]
        end = pos + 1
        while end < n and ls[end] == L:
            end += 1
        m = end - pos
        while m:
            room = _first_at_least(tree, size, L)
            if room < 0:
                break  # the rest of the run stays -1
            q = room // L if L > 0 else m
            need = -(-m // q)
            t = min(need, count[room])
            h = head[room]
            for j in range(t):
                take[j] = h
                h = _pop(h, child, sib, stack)
            head[room] = h
            count[room] -= t
            if count[room] == 0:
                _mark(tree, size + room, False)
            last = min(q, m - (t - 1) * q)
            for j in range(t):
                k = q if j < t - 1 else last
                r = take[j]
                for _ in range(k):
                    out[pos] = r
                    pos += 1
                left = room - k * L
                if left < shortest:
                    continue  # full
                child[r] = -1
                sib[r] = -1
                head[left] = _meld(head[left], r, child, sib)
                if count[left] == 0:
                    _mark(tree, size + left, True)
                count[left] += 1
            m -= (t - 1) * q + last
        pos = end
    return out


def _in_piece_order(vals: np.ndarray, lengths: np.ndarray, start: np.ndarray, out: np.ndarray) -> None:
    """``out[i]``: the value in ``vals`` of piece ``i`` where ``vals`` lists the pieces grouped
    by length, each group in piece order, group ``L`` from ``start[L]`` on (``start``
    advances in place).  A counting sort's scatter read backwards: no order array."""
    for i in range(len(lengths)):
        at = lengths[i]
        out[i] = vals[start[at]]
        start[at] += 1


# ----------------------------------------------------------------------------- greedy LPT


def _before(ka: float, ra: int, kb: float, rb: int) -> bool:
    """``(ka, ra) < (kb, rb)``, as Python compares the tuples."""
    return ka < kb or (ka == kb and ra < rb)


def _sift_down(key: np.ndarray, rid: np.ndarray, size: int, i: int) -> None:
    while True:
        least = i
        a = 2 * i + 1
        if a < size and _before(key[a], rid[a], key[least], rid[least]):
            least = a
        b = a + 1
        if b < size and _before(key[b], rid[b], key[least], rid[least]):
            least = b
        if least == i:
            return
        key[i], key[least] = key[least], key[i]
        rid[i], rid[least] = rid[least], rid[i]
        i = least


def _push(key: np.ndarray, rid: np.ndarray, size: int, k: float, r: int) -> int:
    """Push ``(k, r)`` on the heap of ``size`` entries; the new size."""
    i = size
    while i > 0:
        up = (i - 1) >> 1
        if not _before(k, r, key[up], rid[up]):
            break
        key[i], rid[i] = key[up], rid[up]
        i = up
    key[i], rid[i] = k, r
    return size + 1


def _pop_top(key: np.ndarray, rid: np.ndarray, size: int) -> int:
    """Drop the least entry of the heap; the new size."""
    size -= 1
    if size > 0:
        key[0], rid[0] = key[size], rid[size]
        _sift_down(key, rid, size, 0)
    return size


def _replay(tk: np.ndarray, tr: np.ndarray, i: int) -> None:
    """The winners (least ``(key, rank)``) on the path from leaf ``i`` of a tournament tree up
    to its root, once the leaf changed."""
    i >>= 1
    while i >= 1:
        a = 2 * i
        b = a + 1
        ka = tk[a]
        kb = tk[b]
        ra = tr[a]
        rb = tr[b]
        # (bitwise, no branches: which child wins is a coin toss to the branch predictor)
        first = (ka < kb) | ((ka == kb) & (ra < rb))
        tk[i] = ka if first else kb
        tr[i] = ra if first else rb
        i >>= 1


def _take(r: int, length: int, key: float, free: np.ndarray, row_key: np.ndarray,
          max_free: np.ndarray, rank_key: np.ndarray) -> int:
    """Put a piece on rank ``r``'s row with the least key sum that has room for it (the first
    on ties), updating the state arrays; returns the row.  The rank's largest room is
    looked for again only where the row had it."""
    mb = free.shape[1]
    m = -1
    for q in range(mb):
        if free[r, q] >= length and (m < 0 or row_key[r, q] < row_key[r, m]):
            m = q
    was = free[r, m]
    free[r, m] = was - length
    row_key[r, m] += key
    if was == max_free[r]:
        top = free[r, 0]
        for q in range(1, mb):
            if free[r, q] > top:
                top = free[r, q]
        max_free[r] = top
    rank_key[r] += key
    return m


def _build(tk: np.ndarray, tr: np.ndarray, size: int) -> None:
    """The inner nodes of a tournament tree from its leaves ``size ..``: each the least
    ``(key, rank)`` below it."""
    for i in range(size - 1, 0, -1):
        a = 2 * i
        b = a + 1
        if _before(tk[a], tr[a], tk[b], tr[b]):
            tk[i] = tk[a]
            tr[i] = tr[a]
        else:
            tk[i] = tk[b]
            tr[i] = tr[b]


def _greedy_fill(idx: np.ndarray, lens: np.ndarray, ks: np.ndarray, free: np.ndarray,
                row_key: np.ndarray, rank_key: np.ndarray, max_free: np.ndarray,
                out_rank: np.ndarray, out_micro: np.ndarray, fresh: bool) -> None:
    """:meth:`msd_dask.core.balance._Greedy.fill` over the pieces ``idx`` (lengths ``lens``,
    keys ``ks``, in that order), updating the state arrays in place.

    Each piece goes to the rank with the least ``(key sum, rank)`` that has a
    row with room, inside it to the row with the least key sum that has room
    (the first on ties); a piece no rank has room for is left out.  On
    ``fresh`` (empty) ranks the first pieces, while their keys are > 0, go to
    ranks 0, 1, ... in turn.  Ranks without room for the current piece are
    parked in a heap by ``(-largest room, rank)`` and come back as soon as a
    piece fits them.

    The others are the leaves of a tournament tree (each node: the least
    ``(key sum, rank)`` below it; a parked rank's leaf is ``(inf, past every
    rank)``, key sums being finite): the rank that takes a piece is the root,
    and its new sum is replayed up its path, a comparison a level with no
    branch on where it goes, where a heap's sift-down compares two children a
    level and guesses which way.

    A long run of equal pieces (length and key; a long document's full-row
    chunks, about half a 4K step's pieces on a lognormal corpus) that every
    rank with room for them meets at one key sum is placed in rounds, with no
    tree: each round, every such rank in rank order takes one piece (what the
    rule does piece by piece: the key raises each taker above the others, to
    one sum again once the round is over), and a rank without room for the
    next drops out.  Where the key does not raise a sum (a key of 0, or below
    the sum's precision), or the sums differ, the run goes piece by piece.
    """
    n_ranks, mb = free.shape
    n = len(idx)
    start = 0
    if fresh:
        while start < min(n, n_ranks) and ks[start] > 0:
            r = start
            free[r, 0] -= lens[start]
            row_key[r, 0] = ks[start]
            rank_key[r] = ks[start]
            max_free[r] = free[r].max()
            out_rank[idx[start]] = r
            out_micro[idx[start]] = 0
            start += 1
    size = 1
    while size < n_ranks:
        size *= 2
    # leaves size + r: the ranks with room, by (key sum, rank); the rest absent
    tk = np.full(2 * size, np.inf, dtype=np.float64)
    tr = np.arange(2 * size, dtype=np.int64) + 2 * size
    for r in range(n_ranks):
        tk[size + r] = rank_key[r]
        tr[size + r] = r
    _build(tk, tr, size)
    pk = np.empty(n_ranks, dtype=np.float64)  # the parked ranks, by (-largest room, rank)
    pr = np.empty(n_ranks, dtype=np.int64)
    p = 0
    # rounds for a run of at least this many pieces (each costs a pass over the ranks)
    in_rounds = max(64, n_ranks // 4)
    takers = np.empty(n_ranks, dtype=np.int64)  # a round's ranks, in rank order
    plain_until = 0  # (a run rounds were tried on: what they left, piece by piece)
    j = start
    while j < n:
        length = lens[j]
        key = ks[j]
        while p and -pk[0] >= length:
            r = pr[0]
            p = _pop_top(pk, pr, p)
            tk[size + r] = rank_key[r]
            tr[size + r] = r
            _replay(tk, tr, size + r)
        end = j + 1
        if j >= plain_until:  # (once a run: what rounds leave goes piece by piece)
            while end < n and lens[end] == length and ks[end] == key:
                end += 1
            plain_until = end
        if end - j >= in_rounds:
            # every rank with room (none parked: the heap's roomiest has less) at one sum
            k = 0
            level = 0.0
            equal = True
            for r in range(n_ranks):
                if max_free[r] >= length:
                    if k and rank_key[r] != level:
                        equal = False
                        break
                    level = rank_key[r]
                    takers[k] = r
                    k += 1
            placed = j
            while equal and k and j < end and level + key > level:
                c = 0
                left = 0  # the takers with room for another, in place
                while c < k and j < end:
                    r = takers[c]
                    out_micro[idx[j]] = _take(r, length, key, free, row_key, max_free, rank_key)
                    out_rank[idx[j]] = r
                    j += 1
                    if max_free[r] >= length:
                        takers[left] = r
                        left += 1
                    c += 1
                if c < k:  # the run ended inside the round
                    break
                k = left
                level = level + key
            if j > placed:  # the takers' new sums, in the tree at once
                for r in range(n_ranks):
                    if tr[size + r] == r:
                        tk[size + r] = rank_key[r]
                _build(tk, tr, size)
            if equal and not k:  # no rank has room for the rest of the run: left out
                j = end
            if j > placed:
                continue
        r = tr[1]
        while r < n_ranks and max_free[r] < length:
            p = _push(pk, pr, p, -float(max_free[r]), r)
            tk[size + r] = np.inf
            tr[size + r] = 2 * size + r
            _replay(tk, tr, size + r)
            r = tr[1]
        if r < n_ranks:
            out_micro[idx[j]] = _take(r, length, key, free, row_key, max_free, rank_key)
            out_rank[idx[j]] = r
            tk[size + r] = rank_key[r]
            _replay(tk, tr, size + r)
        j += 1


def _fill_rounds(order: np.ndarray, lens: np.ndarray, ks: np.ndarray, free: np.ndarray,
                 row_key: np.ndarray, rank_key: np.ndarray, max_free: np.ndarray, out_rank: np.ndarray,
                 out_micro: np.ndarray, left: np.ndarray) -> tuple[int, int]:
    """:meth:`msd_dask.core.balance._Greedy.fill_tail`'s rounds over the pieces ``order``
    (lengths ``lens``, keys ``ks``, in that order), updating the state arrays in place
    (``max_free``: each rank's largest room).

    Each round, the ranks with a row with room for the round's first piece, by
    ``(key sum, rank)``, take the round's next pieces one each, each piece on its
    rank's row with the least key sum that has room (the first on ties).  Rounds
    stop once fewer than ``min(16, ranks)`` ranks have room.  Pieces that found no
    row go to ``left``, in order.  Returns ``(pos, n_left)``: ``order[pos:]`` were
    not reached, ``left[:n_left]`` found no row.
    """
    n_ranks, mb = free.shape
    n = len(order)
    # the shortest piece from each position on: a rank without room for it is done
    shortest = lens.copy()
    for j in range(n - 2, -1, -1):
        shortest[j] = min(shortest[j], shortest[j + 1])
    live = np.arange(n_ranks)  # the ranks that may still take a piece, in rank order
    n_live = n_ranks
    ranks = np.empty(n_ranks, dtype=np.int64)
    keys = np.empty(n_ranks, dtype=np.float64)
    piece = np.empty(n_ranks, dtype=np.int64)  # each of the round's ranks' piece (-1: none)
    failed = np.zeros(n_ranks, dtype=np.bool_)  # the round's pieces that found no row
    least = min(16, n_ranks)
    pos = 0
    n_left = 0
    while pos < n:
        e = 0
        kept = 0
        for i in range(n_live):
            r = live[i]
            if max_free[r] < shortest[pos]:
                continue
            live[kept] = r
            kept += 1
            if max_free[r] >= lens[pos]:
                ranks[e] = r
                keys[e] = rank_key[r]
                e += 1
        n_live = kept
        if e < least:
            break
        k = min(e, n - pos)
        by_key = _radix_argsort(_float_order(keys[:e], False), np.arange(e))  # stable: ties by rank
        # each rank takes one piece and decides alone where it goes: the ranks go in rank
        # order (their rows side by side in memory), the pieces without a row in piece order
        piece[:e] = -1
        for i in range(k):
            piece[by_key[i]] = i
        any_failed = False
        for t in range(e):
            i = piece[t]
            if i < 0:
                continue
            r = ranks[t]
            j = pos + i
            length = lens[j]
            m = -1
            for q in range(mb):
                if free[r, q] >= length and (m < 0 or row_key[r, q] < row_key[r, m]):
                    m = q
            if m < 0:
                failed[i] = True
                any_failed = True
                continue
            free[r, m] -= length
            row_key[r, m] += ks[j]
            rank_key[r] += ks[j]
            max_free[r] = free[r].max()
            out_rank[order[j]] = r
            out_micro[order[j]] = m
        if any_failed:
            for i in range(k):
                if failed[i]:
                    failed[i] = False
                    left[n_left] = order[pos + i]
                    n_left += 1
        pos += k
    return pos, n_left


# ----------------------------------------------------------------------------- capacity bound


def _row_sums(rank: np.ndarray, micro: np.ndarray, lengths: np.ndarray, costs: np.ndarray,
              cost: np.ndarray, used: np.ndarray) -> None:
    """Add each placed piece's cost and length to its row of ``cost`` and ``used``
    (``(ranks, micro_batches)``), piece after piece (the sums of ``np.bincount``)."""
    for i in range(len(rank)):
        r = rank[i]
        if r >= 0:
            m = micro[i]
            cost[r, m] += costs[i]
            used[r, m] += lengths[i]


def _sorted_sums(costs: np.ndarray, lengths: np.ndarray, order: np.ndarray, rho: float, tol: float,
                 ccum: np.ndarray, lcum: np.ndarray) -> bool:
    """:func:`~msd_dask.core.balance.capacity_bound`'s pass over the pieces in ``order``:
    ``ccum``, ``lcum`` get ``[0, cumsum(costs[order])]`` and the same of the lengths, and
    it returns whether ``costs - rho * lengths`` in that order never rises by more than
    ``tol`` from one piece to the next (the sums as numpy's, one after the other)."""
    ok = True
    prev = 0.0
    c_sum = 0.0
    l_sum = 0
    ccum[0] = 0.0
    lcum[0] = 0
    for p in range(len(order)):
        i = order[p]
        c = costs[i]
        n = lengths[i]
        key = c - rho * n
        if p == 0:
            c_sum = c
        else:
            c_sum = c_sum + c
            if not key - prev <= tol:
                ok = False
        prev = key
        l_sum += n
        ccum[p + 1] = c_sum
        lcum[p + 1] = l_sum
    return ok


# ----------------------------------------------------------------------------- mixing


def _appended(buf: np.ndarray, n: int, key: int) -> np.ndarray:
    """``buf`` with ``key`` at ``n`` (a larger copy when it is full)."""
    if n == len(buf):
        grown = np.empty(2 * len(buf) + 1024, dtype=buf.dtype)
        grown[:n] = buf
        buf = grown
    buf[n] = key
    return buf


def _mix_draw(credit: np.ndarray, weights: np.ndarray, eligible: np.ndarray, lengths: np.ndarray,
             base: np.ndarray, offset: np.ndarray, end: np.ndarray, limit: np.ndarray, room: int,
             out: np.ndarray, n_out: int, tags: np.ndarray, first: int, hold: int,
             held: np.ndarray, n_held: int,
             hold_room: int) -> tuple[int, int, np.ndarray, int, np.ndarray, int]:
    """:meth:`msd_dask.core.mixing.Mixer.draw` (which says what it decides): ``credit``,
    ``offset`` and ``eligible`` change in place, source ``s``'s next piece is
    ``lengths[base[s] + offset[s]]``, and the keys taken (held) go to ``out[n_out:]``
    (``held[n_held:]``), a larger copy when it is full.

    Returns ``(src, room, out, n_out, held, n_held)``.
    """
    n_src = len(credit)
    src = first
    while True:
        if src < 0:
            for j in range(n_src):
                if eligible[j] and (src < 0 or credit[j] > credit[src]):
                    src = j
            if src < 0:
                break
            o = offset[src]
            if o >= end[src]:
                break
            n = lengths[base[src] + o]
            if hold > 0 and n >= hold:
                if hold_room <= 0:
                    eligible[src] = False  # the source waits for a release
                    src = -1
                    continue
                # (written here while there is room: a call returning the buffer per piece
                # costs its reference counting, nearly half of the compiled loop)
                if n_held < len(held):
                    held[n_held] = tags[src] | o
                else:
                    held = _appended(held, n_held, tags[src] | o)
                n_held += 1
                hold_room -= 1
            elif n >= limit[src] or n > room:
                break
            else:
                if n_out < len(out):
                    out[n_out] = tags[src] | o
                else:
                    out = _appended(out, n_out, tags[src] | o)
                n_out += 1
                room -= n
        else:
            o = offset[src]
            n = lengths[base[src] + o]
        offset[src] = o + 1
        for j in range(n_src):
            credit[j] += weights[j] * n
        credit[src] -= n
        src = -1
    return src, room, out, n_out, held, n_held


# ----------------------------------------------------------------------------- chunking


def _chunk_rows(epoch: int, unit: np.ndarray, row: np.ndarray, length: np.ndarray,
                seq_len: int, table: np.ndarray) -> None:
    """:func:`msd_dask.core.stream._chunked`'s piece table, in one pass: document ``d``
    (``unit[d]``, ``row[d]``, ``length[d] > 0`` tokens), in order, becomes its
    ``ceil(length / seq_len)`` chunks, each a row ``epoch, unit, row, chunk, start, end,
    doc_len`` of ``table`` (as many rows as the chunks)."""
    j = 0
    for d in range(len(length)):
        n = length[d]
        u = unit[d]
        r = row[d]
        start = 0
        c = 0
        while start < n:
            table[j, 0] = epoch
            table[j, 1] = u
            table[j, 2] = r
            table[j, 3] = c
            table[j, 4] = start
            table[j, 5] = min(start + seq_len, n)
            table[j, 6] = n
            j += 1
            c += 1
            start += seq_len


def _gather_rows(out: np.ndarray, h: int, at: np.ndarray, keys: np.ndarray, win: np.ndarray,
                 source: int) -> None:
    """:func:`msd_dask.core.plan._gather`'s copy of one window's pieces, in one pass: piece
    ``keys[at[i]] & 0xFFFFFFFF`` of the window table ``win`` (7 columns) becomes row
    ``h + at[i]`` of ``out`` (8 columns), ``source`` first."""
    for i in range(len(at)):
        p = at[i]
        s = keys[p] & 0xFFFFFFFF
        o = h + p
        out[o, 0] = source
        for c in range(7):
            out[o, c + 1] = win[s, c]


# ----------------------------------------------------------------------------- permuting rows


def _copy_row(dst: np.ndarray, x: int, src: np.ndarray, s: int) -> None:
    """``dst[x] = src[s]`` (rows of 8 columns, the planner's tables, copied by an unrolled loop)."""
    n_cols = dst.shape[1]
    if n_cols == 8:
        for c in range(8):
            dst[x, c] = src[s, c]
    else:
        for c in range(n_cols):
            dst[x, c] = src[s, c]


def _permute_rows(table: np.ndarray, perm: np.ndarray) -> None:
    """``table[:len(perm)] = table[perm]`` in place, a row at a time, with no second table.

    Row ``x < len(perm)`` takes the row ``perm[x]``; the moves form paths and
    cycles (``perm`` holds distinct rows).  A path starts at a row no one takes
    from (its content may go) and ends at a source past ``len(perm)``: each row
    takes its source's row, and that source is overwritten only after.  What is
    left are pure cycles, each turned with one spare row.  Rows past
    ``len(perm)`` are left as they are.

    Paths touch distinct rows, so :data:`_LANES` of them advance side by side:
    each step of a path waits for a read at a random place of ``perm`` and of
    the table, and reads of different paths overlap in the memory system.
    """
    m = len(perm)
    # 1: the row is some row's source; 2: the row has its new content
    state = np.zeros(len(table), dtype=np.uint8)
    for x in range(m):
        state[perm[x]] = 1
    at = np.empty(_LANES, dtype=np.int64)  # each lane's row (-1: idle)
    head = 0
    busy = _LANES
    for lane in range(_LANES):
        while head < m and state[head] != 0:
            head += 1
        at[lane] = head if head < m else -1
        head += 1
    while busy:
        busy = 0
        for lane in range(_LANES):
            x = at[lane]
            if x < 0:
                continue
            busy += 1
            s = perm[x]  # x takes its source, whose row is free once copied
            _copy_row(table, x, table, s)
            state[x] = 2
            if s < m:
                at[lane] = s
                continue
            while head < m and state[head] != 0:  # the path ends: the lane takes the next
                head += 1
            at[lane] = head if head < m else -1
            head += 1
    spare = np.empty((1, table.shape[1]), dtype=table.dtype)
    for head in range(m):
        if state[head] == 2:
            continue
        _copy_row(spare, 0, table, head)
        x = head
        while True:  # around the cycle: the row that takes from head's row takes the spare
            s = perm[x]
            state[x] = 2
            if s == head:
                _copy_row(table, x, spare, 0)
                break
            _copy_row(table, x, table, s)
            x = s


#: paths :func:`_permute_rows` follows side by side
_LANES = 16


def _row_order(rank: np.ndarray, micro: np.ndarray, mb: int, sizes: np.ndarray) -> np.ndarray:
    """The placed pieces (``rank >= 0``) row by row, each row's in piece order: the stable
    argsort of their rows ``rank·mb + micro``, as indices of all the pieces.

    A counting sort with the mask in it: one pass counts each row's pieces into ``sizes``
    (``n_rows`` zeros, filled in place), one writes each placed piece at its row's next
    place.
    """
    n_rows = len(sizes)
    for i in range(len(rank)):
        r = rank[i]
        if r >= 0:
            sizes[r * mb + micro[i]] += 1
    at = np.empty(n_rows, dtype=np.int64)
    m = 0
    for row in range(n_rows):
        at[row] = m
        m += sizes[row]
    perm = np.empty(m, dtype=np.int64)
    for i in range(len(rank)):
        r = rank[i]
        if r >= 0:
            row = r * mb + micro[i]
            perm[at[row]] = i
            at[row] += 1
    return perm


# ----------------------------------------------------------------------------- sorting

_SIGN = np.int64(-(1 << 63))
_BELOW_SIGN = np.int64((1 << 63) - 1)
_NAN = np.int64(0x7FF8000000000000)
#: :func:`_radix_argsort` sorts at most this many keys by insertion
_INSERTION_AT = 32


def _int_order(a: np.ndarray, negate: bool) -> np.ndarray:
    """Keys whose unsigned order is ``a``'s order (with ``negate``, ``-a``'s)."""
    k = np.empty(len(a), dtype=np.int64)
    for i in range(len(a)):
        x = np.int64(a[i])
        if negate:
            x = -x
        k[i] = x ^ _SIGN
    return k


def _float_order(a: np.ndarray, negate: bool) -> np.ndarray:
    """Keys whose unsigned order is numpy's order of ``a`` (with ``negate``, of ``-a``;
    ``-0.0`` equals ``0.0``, NaN last)."""
    bits = a.view(np.int64)
    k = np.empty(len(a), dtype=np.int64)
    for i in range(len(a)):
        x = a[i]
        b = bits[i]
        if negate:
            b ^= _SIGN  # the bits of -x
        if x == 0.0:
            b = 0
        elif x != x:
            b = _NAN
        if b < 0:
            b ^= _BELOW_SIGN
        k[i] = b ^ _SIGN
    return k


def _radix_argsort(k: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """The stable argsort of unsigned 64-bit keys ``k`` (which it overwrites): by insertion
    up to :data:`_INSERTION_AT` keys (a round's ranks in :func:`_fill_rounds` at a small
    step), else LSD radix over the bits that vary, in one counting pass where they span at
    most 20 bits, else 16 bits a pass (11 and 11 below 2^17 keys).
    ``idx``: ``arange(len(k))`` in an integer type that holds it (int32 takes half the
    memory of int64), which it reorders; the result is of its type."""
    n = len(k)
    if n < 2:
        return idx
    if n <= _INSERTION_AT:
        # a few keys (a round's ranks): an insertion sort, also stable, so the same
        # order.  Radix passes clear and sum 2^11 counts each, thousands of steps for a
        # handful of keys: interpreted, a small step's planning spent a quarter of its
        # time in them.  (Unsigned order: the sign bit flipped, then signed compares.)
        for i in range(1, n):
            key = k[i]
            signed = key ^ _SIGN
            at = idx[i]
            j = i - 1
            while j >= 0 and (k[j] ^ _SIGN) > signed:
                k[j + 1] = k[j]
                idx[j + 1] = idx[j]
                j -= 1
            k[j + 1] = key
            idx[j + 1] = at
        return idx
    same1 = k[0]
    any1 = k[0]
    for i in range(n):
        same1 &= k[i]
        any1 |= k[i]
    varies = same1 ^ any1
    if varies == 0:
        return idx
    low = 0
    while (varies >> low) & 1 == 0:
        low += 1
    high = 63
    while (varies >> high) & 1 == 0:
        high -= 1
    bits = high - low + 1
    if n >= 1 << 17:
        width = bits if bits <= 20 else 16
    else:  # (a pass clears and sums 2^width counts: small arrays take narrower digits)
        width = bits if bits <= 11 else 11
    keys = k  # (reordered in place: the callers' keys are temporaries)
    keys2 = np.empty(n if width <= high - low else 0, dtype=np.int64)  # only with passes to come
    idx2 = np.empty_like(idx)
    count = np.empty((1 << width) + 1, dtype=np.int64)
    mask = (1 << width) - 1
    shift = low
    while shift <= high:
        count[:] = 0
        for i in range(n):
            count[((keys[i] >> shift) & mask) + 1] += 1
        for d in range(1 << width):
            count[d + 1] += count[d]
        last = shift + width > high
        for i in range(n):
            d = (keys[i] >> shift) & mask
            j = count[d]
            count[d] = j + 1
            if not last:
                keys2[j] = keys[i]
            idx2[j] = idx[i]
        keys, keys2 = keys2, keys
        idx, idx2 = idx2, idx
        shift += width
    return idx


def _follows(a: np.ndarray, like: np.ndarray, low: int, span: int) -> bool:
    """Whether ``a`` is a strictly increasing function of ``like`` (ints in ``[low, low +
    span)``): equal ``like``, equal ``a``; larger ``like``, larger ``a`` (NaN: no)."""
    first = np.empty(span, dtype=a.dtype)
    seen = np.zeros(span, dtype=np.bool_)
    for i in range(len(a)):
        d = like[i] - low
        x = a[i]
        if not seen[d]:
            seen[d] = True
            first[d] = x
        elif not first[d] == x:
            return False
    last = first[0]
    on = False
    for d in range(span):
        if seen[d]:
            if on and not last < first[d]:
                return False
            if first[d] != first[d]:
                return False
            last = first[d]
            on = True
    return True


def _counting_argsort(a: np.ndarray, low: int, span: int, descending: bool) -> np.ndarray:
    """The stable argsort of the ints ``a`` in ``[low, low + span)`` (of ``-a`` with
    ``descending``), in one counting pass."""
    n = len(a)
    count = np.zeros(span + 1, dtype=np.int64)
    top = low + span - 1
    for i in range(n):
        d = top - a[i] if descending else a[i] - low
        count[d + 1] += 1
    for d in range(span):
        count[d + 1] += count[d]
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        d = top - a[i] if descending else a[i] - low
        out[count[d]] = i
        count[d] += 1
    return out


#: int keys spanning fewer values sort in one counting pass (:func:`_counting_argsort`)
_COUNTING_SPAN = 1 << 20


def stable_argsort(a: np.ndarray, descending: bool = False, like: np.ndarray | None = None) -> np.ndarray:
    """``np.argsort(a, kind="stable")`` of a 1-d int or float array, the same result in
    linear time (a radix sort) for large arrays.

    With ``descending``, ``np.argsort(-a, kind="stable")``, without an array ``-a``.
    ``like``: ints of ``a``'s length (the pieces' lengths, for costs that grow with
    them): where ``a`` is a strictly increasing function of them (one pass checks it),
    ``a``'s order is theirs, sorted in one counting pass where they span fewer than
    :data:`_COUNTING_SPAN` values.
    """
    a = np.ascontiguousarray(a)
    if len(a) < 4096 or not _use_compiled(len(a)):
        return np.argsort(-a if descending else a, kind="stable")
    if like is not None and like.dtype.kind == "i":
        like = np.ascontiguousarray(like)
        low, span = int(like.min()), int(like.max()) - int(like.min()) + 1
        if span <= _COUNTING_SPAN and _follows(a, like, low, span):
            return _counting_argsort(like, low, span, descending)
    if a.dtype.kind == "i":
        low, span = int(a.min()), int(a.max()) - int(a.min()) + 1
        if span <= _COUNTING_SPAN:
            return _counting_argsort(a, low, span, descending)
    if a.dtype.kind == "f":
        keys = _float_order(a.astype(np.float64, copy=False), descending)
    else:
        keys = _int_order(a, descending)
    # (int32 positions while sorting: the planner sorts arrays of millions of pieces)
    order = _radix_argsort(keys, np.arange(len(a), dtype=np.int32 if len(a) < 2**31 else np.int64))
    del keys
    return order.astype(np.int64, copy=False)


def chunk_rows(epoch: int, unit: np.ndarray, row: np.ndarray, length: np.ndarray,
               seq_len: int, table: np.ndarray) -> None:
    """Fill ``table`` with the chunks of documents ``unit, row, length``: see
    :func:`_chunk_rows`.  Called where the kernels run compiled (:func:`compiled`) only:
    interpreted, numpy's passes over the documents (the caller's) take its place, as a
    Python loop a chunk at a time costs microseconds a chunk, and a window of a small
    service, which never compiles the kernels, holds thousands."""
    _chunk_rows(epoch, unit, row, length, seq_len, table)


def gather_rows(out: np.ndarray, h: int, at: np.ndarray, keys: np.ndarray, win: np.ndarray,
                source: int) -> None:
    """Copy one window's pieces into a step's table: see :func:`_gather_rows`.  Called
    where the kernels run compiled only, as :func:`chunk_rows`."""
    _gather_rows(out, h, at, keys, win, source)


def permute_rows(table: np.ndarray, perm: np.ndarray) -> None:
    """Put ``table[perm]`` in the first ``len(perm)`` rows of the 2-d C-contiguous ``table``,
    in place: see :func:`_permute_rows` (``perm``: distinct rows of ``table``).
    Interpreted, numpy's own gather, which that kernel is checked against: below
    :data:`COMPILE_AT` rows its copy is small, and a Python loop a row at a time costs
    several microseconds a row."""
    if _use_compiled(len(perm)):
        _permute_rows(table, perm)
    else:
        table[:len(perm)] = table[perm]


def row_order(rank: np.ndarray, micro: np.ndarray, n_ranks: int,
              mb: int) -> tuple[np.ndarray, np.ndarray]:
    """``(perm, row_sizes)``: the placed pieces (``rank >= 0``) sorted stably by their row
    ``rank·mb + micro`` (indices of all the pieces), and each row's count of them
    (``(n_ranks, mb)``); see :func:`_row_order`."""
    sizes = np.zeros(n_ranks * mb, dtype=np.int64)
    _use_compiled(len(rank))
    perm = _row_order(rank, micro, mb, sizes)
    return perm, sizes.reshape(n_ranks, mb)


def best_fit_rows(ls: np.ndarray, n_rows: int, seq_len: int) -> np.ndarray:
    """Each piece's row by best fit decreasing: see :func:`_best_fit_rows`."""
    if _use_compiled(len(ls)):
        return _best_fit_rows(ls, n_rows, seq_len)
    # interpreted, Python ints throughout: numpy's scalar arithmetic costs several times theirs
    return np.array(_best_fit_rows(ls.tolist(), n_rows, seq_len), dtype=np.int64)


def in_piece_order(vals: np.ndarray, lengths: np.ndarray, start: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = vals[p(i)]``, ``p(i)`` piece ``i``'s place among the pieces grouped by length
    (group ``L`` from ``start[L]`` on, each in piece order; ``start`` changes): see
    :func:`_in_piece_order`."""
    _use_compiled(len(lengths))
    _in_piece_order(vals, lengths, start, out)


def row_sums(rank: np.ndarray, micro: np.ndarray, lengths: np.ndarray, costs: np.ndarray,
             cost: np.ndarray, used: np.ndarray) -> None:
    """Each row's cost and tokens, added to ``cost`` and ``used`` in place: see
    :func:`_row_sums`."""
    _use_compiled(len(rank))
    _row_sums(rank, micro, lengths, costs, cost, used)


def sorted_sums(costs: np.ndarray, lengths: np.ndarray, order: np.ndarray, rho: float,
                tol: float) -> tuple[bool, np.ndarray, np.ndarray]:
    """``(keys never rise by more than tol, cumulative costs, cumulative lengths)`` of the
    pieces in ``order``: see :func:`_sorted_sums`."""
    ccum = np.empty(len(order) + 1, dtype=np.float64)
    lcum = np.empty(len(order) + 1, dtype=np.int64)
    _use_compiled(len(order))
    ok = _sorted_sums(costs, lengths, order, rho, tol, ccum, lcum)
    return bool(ok), ccum, lcum


def greedy_fill(idx: np.ndarray, lens: np.ndarray, ks: np.ndarray, free: np.ndarray,
                row_key: np.ndarray, rank_key: np.ndarray, max_free: np.ndarray,
                out_rank: np.ndarray, out_micro: np.ndarray, fresh: bool) -> None:
    """The greedy LPT fill, in place: see :func:`_greedy_fill`."""
    _use_compiled(len(idx))
    _greedy_fill(idx, lens, ks, free, row_key, rank_key, max_free, out_rank, out_micro, fresh)


def fill_rounds(order: np.ndarray, lens: np.ndarray, ks: np.ndarray, free: np.ndarray,
                row_key: np.ndarray, rank_key: np.ndarray, max_free: np.ndarray, out_rank: np.ndarray,
                out_micro: np.ndarray, left: np.ndarray) -> tuple[int, int]:
    """The greedy fill in rounds, in place: see :func:`_fill_rounds`."""
    _use_compiled(len(order))
    pos, n_left = _fill_rounds(order, lens, ks, free, row_key, rank_key, max_free, out_rank, out_micro,
                               left)
    return int(pos), int(n_left)


def mix_draw(credit: np.ndarray, weights: np.ndarray, eligible: np.ndarray, lengths: np.ndarray,
             base: np.ndarray, offset: np.ndarray, end: np.ndarray, limit: np.ndarray, room: int,
             out: np.ndarray, n_out: int, tags: np.ndarray, first: int, hold: int,
             held: np.ndarray, n_held: int,
             hold_room: int) -> tuple[int, int, np.ndarray, int, np.ndarray, int]:
    """The mixer's draw: see :func:`_mix_draw` (compiled once the kernels are: how many pieces
    it takes is known only when it ends; the planner tells :func:`compile_for` the step's
    rows before its first draw)."""
    return _mix_draw(credit, weights, eligible, lengths, base, offset, end, limit, room, out, n_out,
                     tags, first, hold, held, n_held, hold_room)


# ----------------------------------------------------------------------------- compiling

#: every kernel: :func:`compile_kernels` replaces each in this module's globals by its
#: compiled version (numba finds a kernel's callees there when it compiles it, and the
#: functions above call the kernels by their names)
_KERNELS = (_meld, _pop, _mark, _first_at_least, _best_fit_rows, _in_piece_order, _before, _sift_down,
            _push, _pop_top, _replay, _take, _build,
            _greedy_fill, _fill_rounds, _appended, _mix_draw, _chunk_rows, _gather_rows, _copy_row,
            _permute_rows, _row_order,
            _int_order, _float_order, _radix_argsort, _follows, _counting_argsort, _sorted_sums, _row_sums)
#: kernels compiled into their callers (numba's ``inline="always"``): a call per piece of
#: :func:`_greedy_fill` to :func:`_take` cost it a fifth of its time
_INLINED = frozenset({_take})
_compiled = False
_compiling = threading.Lock()


def compiled() -> bool:
    """Whether this process runs the kernels compiled."""
    return _compiled


def compile_kernels(in_child: bool = True) -> None:
    """Compile every kernel with numba (the first call of a kernel with :data:`COMPILE_AT`
    items does it); from then on every kernel runs compiled in this process.

    Parameters
    ----------
    in_child : bool
        Compile in a child process first (:func:`_fill_cache`), which writes numba's
        cache, so that this process only loads the compiled code from it.  The process
        that compiles keeps numba's compiler state: about 200 MiB, which the planner's
        process at dp 16,384 × 128K has no room for under its 1 GiB.
        Where the child fails, this process compiles.
    """
    global _compiled
    with _compiling:
        if _compiled:
            return
        if in_child:
            _fill_cache()
        from numba import njit

        module = globals()
        for fn in _KERNELS:
            if fn in _INLINED:
                module[fn.__name__] = njit(cache=True, nogil=True, inline="always")(fn)
            else:
                module[fn.__name__] = njit(cache=True, nogil=True)(fn)
        for name, make in _SCRATCH.items():
            module[name] = njit(cache=True, nogil=True)(make)
        _compiled = True
        _warm()


#: how long :func:`_fill_cache` waits for its child (compiling takes ~20 s on 2 cores)
FILL_TIMEOUT = 600.0


def _fill_cache() -> None:
    """Compile the kernels in a child process, which fills numba's cache (``cache=True``:
    ``__pycache__`` next to this file, or ``NUMBA_CACHE_DIR``) and exits: about a second
    where the cache is full already.  A child that fails or times out is logged; the
    caller then compiles in its own process."""
    import logging
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    code = f"from {__name__} import compile_kernels; compile_kernels(in_child=False)"
    try:
        subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=path),
                       capture_output=True, text=True, timeout=FILL_TIMEOUT, check=True)
    except subprocess.CalledProcessError as e:
        logging.getLogger(__name__).warning(
            "msd_dask: compiling the planner's kernels in a child process failed (exit %s), "
            "compiling them here: %s", e.returncode, (e.stderr or "")[-2000:])
    except (OSError, subprocess.TimeoutExpired) as e:
        logging.getLogger(__name__).warning(
            "msd_dask: compiling the planner's kernels in a child process failed (%r), "
            "compiling them here", e)


def _warm() -> None:
    """Call every kernel once on tiny inputs of the types the planner passes, so that numba
    compiles them (or loads them from its cache) now, not in the middle of a step."""
    i1, f1 = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.float64)
    best_fit_rows(np.ones(1, dtype=np.int64), 1, 4)
    for rows in (np.int32, np.int64):  # (kept_rows' rows: int32 where the step's rows fit)
        for lengths in (np.int32, np.int64):  # (and the pieces' lengths, as the table's)
            in_piece_order(np.zeros(1, dtype=rows), np.zeros(1, dtype=lengths), i1.copy(),
                           np.zeros(1, dtype=rows))
    greedy_fill(i1.copy(), np.ones(1, dtype=np.int64), np.ones(1), np.full((1, 1), 4, dtype=np.int64),
                np.zeros((1, 1)), f1.copy(), np.full(1, 4, dtype=np.int64), i1.copy(), i1.copy(), True)
    fill_rounds(i1.copy(), np.ones(1, dtype=np.int64), np.ones(1), np.full((1, 1), 4, dtype=np.int64),
                np.zeros((1, 1)), f1.copy(), np.full(1, 4, dtype=np.int64), i1.copy(), i1.copy(),
                i1.copy())
    mix_draw(f1.copy(), np.ones(1), np.ones(1, dtype=np.bool_), np.ones(1, dtype=np.int64), i1.copy(),
             i1.copy(), np.ones(1, dtype=np.int64), np.full(1, 9, dtype=np.int64), 4, i1.copy(), 0,
             i1.copy(), -1, 0, i1.copy(), 0, 0)
    for a in (np.arange(4096, dtype=np.int64), np.arange(4096, dtype=np.float64),
              np.arange(4096, dtype=np.int32)):  # (int32: the placement's kept lengths)
        stable_argsort(a)
        stable_argsort(a, True, np.arange(4096, dtype=np.int64))
        stable_argsort(a, True)
    sorted_sums(np.ones(2), np.ones(2, dtype=np.int64), np.arange(2), 1.0, 0.0)
    row_sums(i1.copy(), i1.copy(), np.ones(1, dtype=np.int64), np.ones(1), np.zeros((1, 1)),
             np.zeros((1, 1), dtype=np.int64))
    for dtype in (np.int32, np.int64):  # (the planner's tables, either width)
        permute_rows(np.zeros((2, 8), dtype=dtype), np.array([1, 0], dtype=np.int64))
        chunk_rows(0, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64),
                   np.ones(1, dtype=np.int64), 4, np.zeros((1, 7), dtype=dtype))
        for win in (np.int32, np.int64):  # (a window's table, into the step's)
            gather_rows(np.zeros((1, 8), dtype=dtype), 0, i1.copy(), i1.copy(),
                        np.zeros((1, 7), dtype=win), 0)
    for ranks in (np.int32, np.int64):  # (place_step's: int32 where dp and mb fit)
        row_order(np.array([0, -1], dtype=ranks), np.zeros(2, dtype=ranks), 1, 1)


def compile_for(items: int) -> None:
    """Compile the kernels now if a coming call will have ``items`` items (at least
    :data:`COMPILE_AT`)."""
    _use_compiled(items)


def _use_compiled(n: int) -> bool:
    """Whether the kernels run compiled for a call of ``n`` items (compiling them if this is
    the first call with :data:`COMPILE_AT` or more)."""
    if not _compiled and n >= COMPILE_AT:
        compile_kernels()
    return _compiled
