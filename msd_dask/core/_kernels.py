"""Compiled inner loops of the planner (numba, private).

Each kernel is the one implementation of its rule; the modules that own the
rules (:mod:`~msd_dask.core.row_placement`, :mod:`~msd_dask.core.balance`,
:mod:`~msd_dask.core.mixing`) prepare arrays, call it and document what it
decides.  ``cache=True`` keeps the compiled code in ``__pycache__``, so only the
first process after an install (or a change here) pays the compilation.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["best_fit_rows"]


# ----------------------------------------------------------------------------- best fit decreasing


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
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


@njit(cache=True)
def best_fit_rows(ls: np.ndarray, n_rows: int, seq_len: int) -> np.ndarray:
    """:func:`~msd_dask.core.row_placement.kept_rows`' best fit, in placement order.

    ``ls``: the pieces' lengths in the order they are placed.  Returns each
    piece's row (``-1``: fits in no row).  Each piece goes to the row with the
    least room that fits it, the lowest such row on ties.  Runs of equal
    lengths go a row at a time: the tightest row that fits ``L`` stays the
    tightest while it takes ``L`` after ``L``, so it takes ``room // L`` of them
    before the next row.  Rows with one room are a pairing heap (lowest row on
    top); the rooms some row has are flags in a segment tree.
    """
    n = len(ls)
    out = np.full(n, -1, dtype=np.int64)
    if n == 0 or n_rows <= 0:
        return out
    shortest = ls.min()
    size = 1
    while size < seq_len + 2:
        size *= 2
    tree = np.zeros(2 * size, dtype=np.bool_)
    head = np.full(seq_len + 1, -1, dtype=np.int64)
    count = np.zeros(seq_len + 1, dtype=np.int64)
    child = np.full(n_rows, -1, dtype=np.int64)
    sib = np.full(n_rows, -1, dtype=np.int64)
    stack = np.empty(n_rows, dtype=np.int64)
    take = np.empty(n_rows, dtype=np.int64)
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
