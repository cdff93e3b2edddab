"""Workers the services' roles need (the arithmetic behind the plugin's ``adaptive_target``)."""

from __future__ import annotations

import pytest

from msd_dask.plugin.adaptive import capacity, roles_wanted, workers_needed


def test_capacity_is_roles_per_worker_else_threads():
    assert capacity(4) == 4
    assert capacity(4, roles_per_worker=2) == 2
    assert capacity(1, roles_per_worker=3) == 3
    assert capacity(0) == 1  # a worker always hosts at least one role


def test_roles_wanted_counts_planner_constructors_and_the_larger_loader_count():
    assert roles_wanted(2, {"code": 3, "prose": 1}) == 1 + 2 + 4
    # the policy wants more code loaders than there are: they count
    assert roles_wanted(2, {"code": 3, "prose": 1}, {"code": 6}) == 1 + 2 + 7
    # a lower target frees nothing yet (scale-down is delayed and gradual)
    assert roles_wanted(1, {"code": 3}, {"code": 1}) == 1 + 1 + 3


def test_roles_that_fit_on_their_holders_need_no_other_worker():
    assert workers_needed(5, held=[3, 3], free=[3, 3], new_capacity=3) == 2
    assert workers_needed(0, held=[], free=[2, 2], new_capacity=2) == 0


def test_every_holder_stays_even_when_fewer_would_do():
    # roles cannot move by themselves: three holders stay although 2 roles fit on one
    assert workers_needed(2, held=[4, 4, 4], free=[], new_capacity=4) == 3


def test_free_workers_are_used_largest_first_before_new_ones():
    # 7 roles, holder hosts 3: the free worker of 4 covers the rest, not the one of 1
    assert workers_needed(7, held=[3], free=[1, 4], new_capacity=2) == 2
    # 9 roles: 3 + 4 + 1 = 8, one new worker for the last role
    assert workers_needed(9, held=[3], free=[1, 4], new_capacity=2) == 4


def test_demand_beyond_the_cluster_asks_for_new_workers():
    # one worker of capacity 3 holding 7 roles' worth of demand: ceil(4 / 3) = 2 more
    assert workers_needed(7, held=[3], free=[], new_capacity=3) == 3
    assert workers_needed(10, held=[3], free=[], new_capacity=3) == 4
    # nothing running yet: all new
    assert workers_needed(5, held=[], free=[], new_capacity=2) == 3


def test_new_capacity_must_be_positive():
    with pytest.raises(ValueError, match="new_capacity"):
        workers_needed(3, held=[1], free=[], new_capacity=0)


def test_roles_per_worker_config_key():
    from msd_dask.core.config import ConfigError, parse_config

    base = {"name": "t", "parallel": {"dp": 1}, "batch": {"seq_len": 64},
            "sources": [{"name": "a", "uri": "memory://none/*.jsonl", "format": "jsonl"}]}
    assert parse_config(base).scaling.roles_per_worker == 0
    cfg = parse_config(dict(base, scaling={"roles_per_worker": 3}))
    assert cfg.scaling.roles_per_worker == 3
    assert parse_config(cfg.to_dict()).scaling.roles_per_worker == 3
    with pytest.raises(ConfigError, match="scaling.roles_per_worker"):
        parse_config(dict(base, scaling={"roles_per_worker": -1}))
