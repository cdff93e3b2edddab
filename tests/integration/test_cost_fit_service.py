"""cost: {fit: true}: readers report step times, the planner's model follows the hardware."""

from __future__ import annotations

import time

import numpy as np
import pytest

from msd_dask import DataService
from msd_dask.roles.planner import WARMUP_REPORTS

from corpus import config, write_corpus

ALPHA, BETA = 2e-6, 3e-8  # hidden: β/α = 0.015, far from the prior's 1/(12·4096)


def seconds(batch, rng):
    t = 0.0
    for cu in batch.cu_seqlens:
        n = np.diff(cu.numpy()).astype(np.float64)
        t += ALPHA * n.sum() + BETA * (n * n).sum()
    return t * (1 + rng.normal(0, 0.005))


@pytest.mark.parametrize("spikes", [False, True], ids=["steady", "compile-steps"])
def test_fitted_model_predicts_reported_times_within_5_percent(tmp_path, spikes):
    """``compile-steps``: each rank's first step takes 20 times longer (torch.compile, warm
    caches) and one later step of rank 1 30 times: one such report fitted β to 0 for the
    rest of a run, silently (a review).  The planner sets aside each DP group's first
    WARMUP_REPORTS reports and the implausible one, and says how many."""
    root = str(tmp_path / "c")
    write_corpus(root)
    rng = np.random.default_rng(0)
    cfg = config(root, cost={"fit": True})
    with DataService.start(cfg, n_workers=1, threads_per_worker=1) as svc:
        readers = [svc.reader(r) for r in range(2)]
        for step in range(50):
            for r, rd in enumerate(readers):
                b = next(rd)
                slow = 20 if step == 0 else 30 if (step, r) == (30, 1) else 1
                rd.report_step_time(seconds(b, rng) * (slow if spikes else 1))
        set_aside = 2 * WARMUP_REPORTS + (1 if spikes else 0)
        # a time that is no finite number of seconds >= 0 is refused at the call (a NaN was
        # dropped without a word: the planner's error lost in a fire-and-forget call)
        with pytest.raises(ValueError, match=r"rank 1: report_step_time takes .* got nan"):
            readers[1].report_step_time(float("nan"))
        deadline = time.monotonic() + 20
        while svc.stats()["planner"]["cost_model"]["observations"] < 100 - set_aside:
            assert time.monotonic() < deadline, "reports did not reach the planner"
            time.sleep(0.2)
        # the model is refreshed before each plan: read a few more steps to see it in use
        for _ in range(8):
            for rd in readers:
                next(rd)
        model = svc.stats()["planner"]["cost_model"]
        assert model["fitted"] and model["set_aside"] == set_aside, model
        errs = []
        for _ in range(10):
            for rd in readers:
                b = next(rd)
                n = np.concatenate([np.diff(c.numpy()) for c in b.cu_seqlens]).astype(float)
                true = ALPHA * n.sum() + BETA * (n * n).sum()
                pred = model["linear"] * n.sum() + model["quadratic"] * (n * n).sum()
                errs.append(abs(pred - true) / true)
    assert max(errs) < 0.05, (model, max(errs))
    # the fit left the prior (β/α = 2e-5) for the hardware's ratio (0.015); packed ranks hold
    # similar token counts, so β is identified less tightly than the prediction
    assert 0.005 < model["quadratic"] / model["linear"] < 0.03, model
