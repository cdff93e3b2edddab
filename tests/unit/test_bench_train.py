"""The pure parts of scripts/bench_train.py (the training run itself: test_bench_smoke)."""

from __future__ import annotations

import numpy as np
import pytest
from scripts_import import load_script


def test_bench_train_noise_floor_is_the_wait_of_the_residuals_alone():
    """``floor``: ranks given equal model cost differ only by their own CPU-time factors."""
    bt = load_script("bench_train")
    model = np.array([[1.0, 3.0], [2.0, 2.0], [5.0, 1.0]])
    # factors 1.1/1.0, 1.0/1.0, 1.0/1.2 whatever the model cost: the plan cannot matter
    cpu = model * np.array([[1.1, 1.0], [1.0, 1.0], [1.0, 1.2]])
    want = ((1.1 - 1.0) + 0 + (1.2 - 1.0)) / (2 * (1.1 + 1.0 + 1.2))
    assert bt.noise_floor(model, cpu) == pytest.approx(want)
    # exactly as the model predicts: no floor, however unbalanced the plan
    assert bt.noise_floor(model, model) == 0.0
    # a rank-step without model cost (an empty rank) is left out
    assert bt.noise_floor(np.array([[0.0, 1.0], [1.0, 1.0]]),
                          np.array([[0.5, 1.0], [1.0, 1.5]])) == pytest.approx(0.5 / 3.0)


def test_bench_train_wait_share_is_slowest_minus_own_over_slowest():
    """``cpu wait``: Σ (slowest − own) over Σ slowest, per step and rank."""
    bt = load_script("bench_train")
    times = np.array([[1.0, 3.0], [2.0, 2.0]])
    assert bt.wait_share(times) == pytest.approx((2.0 + 0.0) / (2 * (3.0 + 2.0)))
    assert bt.wait_share(np.zeros((2, 2))) == 0.0
    assert bt.wait_share(np.zeros((0, 2))) == 0.0
