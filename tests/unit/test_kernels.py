"""The compiled kernels of the planner (msd_dask.core._kernels) against plain one-piece-at-a-time
statements of their rules, on random inputs with many ties."""

from __future__ import annotations

import numpy as np
import pytest

from msd_dask.core._kernels import best_fit_rows


def _best_fit_one_by_one(ls: np.ndarray, n_rows: int, seq_len: int) -> np.ndarray:
    """Each piece to the row with the least room that fits it, the lowest such row on ties."""
    room = np.full(n_rows, seq_len, dtype=np.int64)
    out = np.full(len(ls), -1, dtype=np.int64)
    for i, length in enumerate(ls.tolist()):
        fits = room >= length
        if fits.any():
            r = int(np.argmin(np.where(fits, room, seq_len + 1)))
            room[r] -= length
            out[i] = r
    return out


@pytest.mark.parametrize("seed", range(6))
def test_best_fit_rows_is_best_fit_piece_by_piece(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(60):
        seq_len = int(rng.choice([1, 7, 16, 100, 1024]))
        n_rows = int(rng.integers(1, 30))
        n = int(rng.integers(0, 200))
        if seed % 3 == 0:    # few distinct lengths: long runs, shared rooms
            ls = rng.choice(rng.integers(0, seq_len + 1, 3), n)
        elif seed % 3 == 1:  # zero lengths included
            ls = rng.integers(0, seq_len + 1, n)
        else:
            ls = np.minimum(seq_len, rng.lognormal(2, 1.5, n).astype(np.int64))
        ls = np.asarray(ls, dtype=np.int64)
        # runs of equal lengths, decreasing, after a few pieces in any order (carried ones)
        head = int(rng.integers(0, n + 1)) if n else 0
        ls = np.concatenate([ls[:head], -np.sort(-ls[head:])])
        assert best_fit_rows(ls, n_rows, seq_len).tolist() == \
            _best_fit_one_by_one(ls, n_rows, seq_len).tolist()
