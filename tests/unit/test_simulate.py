"""The simulator of issue 7 (scripts/simulate.py) on tiny configurations: invariants, not figures."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scripts_import import load_script

from msd_dask.core.config import parse_config
from msd_dask.core.plan import Planner, StepPlan

sim = load_script("simulate")

# heavy tail: lognormal sigma 2, so the top 1% of documents hold a large share of the tokens
HEAVY = (sim.SourceSpec("text", 0.7, 5e-7, 1024.0, 2.0), sim.SourceSpec("image", 0.3, 1e-5, 1024.0, 2.0))


def tiny(**kw) -> sim.SimConfig:
    base = dict(dp=16, context=8192, micro_batches=4, steps=3, hidden=1024, layers=8, flops=1e14,
                workers=2, sources=HEAVY, seed=3)
    base.update(kw)
    return sim.SimConfig(**base)


def test_default_strategy_is_the_config_default():
    from msd_dask.core.config import Config

    assert sim.default_strategy() == Config.__dataclass_fields__["balance"].default
    assert tiny().strategy == sim.default_strategy()


def test_msd_imbalance_not_worse_than_baseline_on_heavy_tail():
    r = sim.simulate(tiny())
    assert r.steps_run == 3 and not r.plan_timed_out
    assert 1.0 <= r.imb_msd <= r.imb_base
    assert r.speedup_balance >= 1.0
    assert r.speedup_total <= r.speedup_ideal + 1e-9   # no assignment beats the lower bound
    assert r.imb_base <= r.bound + 1e-9                # equal rows per rank: 1 + L/(12H) bounds it


def test_no_stalls_without_preprocessing_cost():
    free = tuple(sim.SourceSpec(s.name, s.weight, 0.0, s.median, s.sigma) for s in HEAVY)
    r = sim.simulate(tiny(sources=free))
    assert r.stall_frac_base == 0.0 and r.speedup_stalls == 1.0
    assert r.stall_frac_msd == 0.0


def test_speedup_with_both_effects():
    # images costly enough that an image-heavy rank's own workers fall behind its compute
    alpha, _ = sim.model_coefficients(1024, 8, 1e14)
    costly = (HEAVY[0], sim.SourceSpec("image", 0.3, 8 * alpha, 1024.0, 2.0))
    r = sim.simulate(tiny(sources=costly))
    assert r.stall_frac_base > 0.0 and r.speedup_stalls > 1.0
    assert r.speedup_balance >= 1.0
    assert r.speedup_total >= 1.0


def test_deterministic_with_a_seed():
    a, b = sim.simulate(tiny()), sim.simulate(tiny())
    for k in ("imb_base", "imb_msd", "stall_frac_base", "speedup_total", "fill_base", "fill_msd"):
        assert getattr(a, k) == getattr(b, k)
    assert a.per_step["step_b"] == b.per_step["step_b"]
    c = sim.simulate(tiny(seed=4))
    assert c.per_step["step_b"] != a.per_step["step_b"]


def test_bound_and_coefficients():
    alpha, beta = sim.model_coefficients(4096, 32, 4e14)
    assert math.isclose(beta / alpha, 1 / (12 * 4096))
    assert math.isclose(sim.balance_bound(4096, 4096), 1 + 1 / 12)


def test_planner_time_limit_reports_a_timeout():
    r = sim.simulate(tiny(plan_timeout=1e-6))
    assert r.plan_timed_out and math.isnan(r.speedup_total) and math.isnan(r.imb_msd)
    assert r.steps_run == 3 and r.imb_base >= 1.0   # the baseline is simulated whatever the planner


def _plan_key(p: StepPlan) -> list:
    return [[[q.to_tuple() for q in row] for row in rank] for rank in p.rows]


@pytest.mark.parametrize("outliers", [0.0, 0.5])
@pytest.mark.parametrize("plan_timeout", [0.0, 60.0])   # in process, and in the forked child
def test_msd_side_is_the_planner(outliers, plan_timeout):
    cfg = tiny(outliers=outliers, keep_plans=True, plan_timeout=plan_timeout)
    r = sim.simulate(cfg)
    # a Planner built here from the same parameters, fed the same unit lengths
    alpha, beta = sim.model_coefficients(1024, 8, 1e14)
    conf = parse_config({
        "name": "t", "seed": 3, "batch": {"seq_len": 8192, "micro_batches": 4}, "parallel": {"dp": 16},
        "cost": {"linear": alpha, "quadratic": beta}, "outliers": {"min_length": outliers},
        "sources": [{"name": s.name, "uri": f"memory://x/{s.name}/*.parquet", "format": "parquet",
                     "weight": s.weight} for s in HEAVY],
    })
    corpus = sim.corpus_for(cfg)
    pl = Planner(conf, corpus.units())
    plans = [pl.plan_step(corpus) for _ in range(cfg.steps)]
    assert len(r.plans) == cfg.steps
    assert [_plan_key(p) for p in r.plans] == [_plan_key(p) for p in plans]
    # the simulated compute of each rank is that placement's: α·rows·seq_len + β·Σ l²
    for plan, comp, fill in zip(plans, r.per_step["comp_m"], r.per_step["fill_m"], strict=True):
        sq = [sum(q.length ** 2 for row in rank for q in row) for rank in plan.rows]
        assert math.isclose(comp, alpha * 4 * 8192 + beta * max(sq), rel_tol=1e-12)
        assert math.isclose(fill, sum(q.length for q in plan.pieces()) / (16 * 4 * 8192))
    # the pieces are the corpus's documents, chunked at seq_len
    for q in plans[0].pieces():
        assert corpus.lengths(q.source, q.unit)[q.row] == q.doc_len


def test_corpus_same_documents_for_both_sides():
    cfg = tiny()
    corpus = sim.corpus_for(cfg)
    base = sim.PieceSource(corpus, "text", 8192)
    assert (base.take(100) == np.minimum(corpus.lengths("text", 0), 8192)[:100]).all()
    assert corpus("text", 5, 0).tolist() == corpus("text", 0, 0).tolist()   # the same every epoch
    assert corpus.lengths("text", 0).max() <= cfg.context


def test_outlier_delay_not_worse_on_heavy_tail():
    # one row per rank: a rank alone with a long piece is the slowest whatever the placement; the
    # delay promises a step holds no outlier or one in every row, so no rank is alone with one
    for ctx in (8192, 32768):
        off = sim.simulate(tiny(micro_batches=1, context=ctx, steps=6))
        on = sim.simulate(tiny(micro_batches=1, context=ctx, steps=6, outliers=0.5, keep_plans=True))
        assert on.imb_msd <= off.imb_msd
        assert on.work_gain >= off.work_gain   # useful work per second, unbiased by what is held
        assert on.pending > 0.0   # long pieces drawn but not trained yet
        for plan in on.plans:
            per_rank = {sum(q.length > ctx // 2 for row in rank for q in row) for rank in plan.rows}
            assert per_rank in ({0}, {1}), per_rank


@pytest.mark.parametrize("argv", [["--dp", "8", "--context", "4096", "--steps", "2", "--micro-batches", "2"]])
def test_cli_prints_parameters_and_table(argv, capsys):
    assert sim.main(argv) == 0
    out = capsys.readouterr().out
    assert "α = 72·H²·layers/F" in out and "bound on the balance gain" in out
    assert "plan ms/st" in out and "outlier delay off" in out


def test_cli_outliers_option(capsys):
    assert sim.main(["--dp", "8", "--context", "4096", "--steps", "3", "--micro-batches", "1",
                     "--outliers", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "outlier delay ON: outliers.min_length=0.5" in out and "max_wait=16" in out
