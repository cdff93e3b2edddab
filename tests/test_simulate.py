"""The simulator of issue 7 (scripts/simulate.py) on tiny configurations: invariants, not figures."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "simulate.py"
_spec = importlib.util.spec_from_file_location("msd_simulate", _PATH)
assert _spec is not None and _spec.loader is not None
sim = importlib.util.module_from_spec(_spec)
sys.modules["msd_simulate"] = sim
_spec.loader.exec_module(sim)

# heavy tail: lognormal sigma 2, so the top 1% of documents hold a large share of the tokens
HEAVY = (sim.SourceSpec("text", 0.7, 5e-7, 1024.0, 2.0), sim.SourceSpec("image", 0.3, 1e-5, 1024.0, 2.0))


def tiny(**kw) -> sim.SimConfig:
    base = dict(dp=16, context=8192, micro_batches=4, steps=3, hidden=1024, layers=8, flops=1e14,
                workers=2, sources=HEAVY, seed=3)
    base.update(kw)
    return sim.SimConfig(**base)


def test_default_strategy_is_the_config_default():
    from msd_dask.config import Config

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
    assert r.plan_timed_out and math.isnan(r.speedup_total) and r.speedup_ideal >= 1.0


@pytest.mark.parametrize("argv", [["--dp", "8", "--context", "4096", "--steps", "2", "--micro-batches", "2"]])
def test_cli_prints_parameters_and_table(argv, capsys):
    assert sim.main(argv) == 0
    out = capsys.readouterr().out
    assert "α = 72·H²·layers/F" in out and "bound on the balance gain" in out
    assert "plan ms/st" in out
