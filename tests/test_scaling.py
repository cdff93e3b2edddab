"""The loader policy: proactive sizing, reactive bottleneck rule, hysteresis, bounds."""

from __future__ import annotations

from msd_dask.scaling import Scaler, ScalingPolicy, SourceLoad, proactive_target


def load(**kw):
    base = dict(loaders=1, weight_ahead=0.5, consumption=1000.0, seconds_per_token=0.001,
                threads=1, starved=0.0)
    base.update(kw)
    return SourceLoad(**base)


def test_proactive_sizes_to_demand_times_cost():
    # demand 0.5 * 1000 = 500 tok/s; one loader supplies 1000 tok/s -> 1 with headroom 1.25
    assert proactive_target(load(), 1.25) == 1
    # 20x costlier per token: one loader supplies 50 tok/s -> ceil(1.25 * 500 / 50) = 13
    assert proactive_target(load(seconds_per_token=0.02), 1.25) == 13
    # two threads per loader halve it
    assert proactive_target(load(seconds_per_token=0.02, threads=2), 1.25) == 7
    # unmeasured cost or no demand asks for nothing (the minimum applies later)
    assert proactive_target(load(seconds_per_token=0.0), 1.25) == 0
    assert proactive_target(load(weight_ahead=0.0), 1.25) == 0


def test_weight_ramp_ahead_scales_up_before_it_starts():
    s = Scaler(ScalingPolicy(max_loaders=16))
    now_low = s.decide(0.0, {"img": load(weight_ahead=0.1, seconds_per_token=0.01)})
    assert now_low == {"img": 2}  # ceil(1.25 * 0.1 * 1000 / 100)
    ahead = s.decide(10.0, {"img": load(loaders=2, weight_ahead=0.5, seconds_per_token=0.01)})
    assert ahead == {"img": 4}  # the target is 7: at most doubling per change
    ahead = s.decide(15.0, {"img": load(loaders=4, weight_ahead=0.5, seconds_per_token=0.01)})
    assert ahead == {"img": 7}


def test_reactive_rule_adds_one_to_a_starved_source():
    s = Scaler(ScalingPolicy())
    assert s.decide(0.0, {"a": load(loaders=2, seconds_per_token=0.0, starved=0.3)}) == {"a": 3}
    # below the threshold nothing happens
    s = Scaler(ScalingPolicy())
    assert s.decide(0.0, {"a": load(loaders=1, seconds_per_token=0.0, starved=0.01)}) == {}


def test_bounds_clamp_targets():
    s = Scaler(ScalingPolicy(min_loaders=2, max_loaders=4))
    assert s.decide(0.0, {"a": load(seconds_per_token=1.0)}) == {"a": 2}  # doubling
    assert s.decide(5.0, {"a": load(loaders=2, seconds_per_token=1.0)}) == {"a": 4}
    s = Scaler(ScalingPolicy(limits={"a": (3, 3)}))
    assert s.decide(0.0, {"a": load(loaders=1)}) == {"a": 3}


def test_hysteresis_no_flapping():
    p = ScalingPolicy(cooldown=5.0, scale_down_after=30.0)
    s = Scaler(p)
    # demand oscillates around one loader's capacity: up once, then no flapping down
    changes = []
    loaders = 1
    for t in range(0, 120):
        spt = 0.0021 if t % 2 else 0.0019  # 1.25*500/(1/spt) ~ 1.3 / 1.2 -> 2 either way
        d = s.decide(float(t), {"a": load(loaders=loaders, seconds_per_token=spt)})
        if d:
            changes.append((t, d["a"]))
            loaders = d["a"]
    assert changes == [(0, 2)]


def test_scale_down_waits_then_steps_one_at_a_time():
    p = ScalingPolicy(cooldown=5.0, scale_down_after=30.0)
    s = Scaler(p)
    changes = []
    loaders = 6
    for t in range(0, 200):
        d = s.decide(float(t), {"a": load(loaders=loaders)})  # needs 1
        if d:
            changes.append((t, d["a"]))
            loaders = d["a"]
    assert changes[0] == (30, 5)
    assert [c[1] for c in changes] == [5, 4, 3, 2, 1]
    assert all(b[0] - a[0] >= 30 for a, b in zip(changes, changes[1:], strict=False))


def test_policy_from_config_uses_per_source_bounds():
    from msd_dask.config import load_config

    cfg = load_config({
        "name": "p", "batch": {"seq_len": 8},
        "scaling": {"policy": "adaptive", "min_loaders": 2, "max_loaders": 5, "cooldown": 1},
        "sources": [{"name": "a", "uri": "x", "format": "jsonl"},
                    {"name": "b", "uri": "y", "format": "jsonl", "min_loaders": 1,
                     "max_loaders": 9}]}, check_files=False)
    p = ScalingPolicy.from_config(cfg)
    assert p.bounds("a") == (2, 5) and p.bounds("b") == (1, 9)
    assert p.cooldown == 1.0


def test_reactive_rule_corrects_demand_for_the_wait():
    # 2000 tok/s of capacity for a demand of 500: more than 2 x 1.25 x 500, unless the planner
    # waited half the time (it would have planned twice as fast): then it is the bottleneck
    s = Scaler(ScalingPolicy())
    assert s.decide(0.0, {"a": load(seconds_per_token=0.0005, starved=0.06)}) == {}
    assert s.decide(1.0, {"a": load(seconds_per_token=0.0005, starved=0.5)}) == {"a": 2}
    # the proactive rule sizes to what is delivered (1.25 * 500 / 2000 -> 1)
    assert proactive_target(load(seconds_per_token=0.0005, starved=0.5), 1.25) == 1


def test_reactive_rule_ignores_waits_of_a_source_supplied_twice_over():
    # one loader supplies 1e6 tok/s, the demand is ~600: a wait is read latency, not capacity
    s = Scaler(ScalingPolicy())
    assert s.decide(0.0, {"a": load(seconds_per_token=1e-6, starved=0.2)}) == {}
    # supplied less than twice over (with headroom): the bottleneck rule adds one
    s = Scaler(ScalingPolicy())
    assert s.decide(0.0, {"a": load(seconds_per_token=0.0012, starved=0.2)}) == {"a": 2}


def _drive(s: Scaler, loaders: int, seconds: int, measured) -> list[tuple[int, int]]:
    """One decision a second for source "a"; ``measured(t, loaders)`` is its SourceLoad.

    Returns the changes as ``(t, loaders)``.
    """
    changes = []
    for t in range(seconds):
        d = s.decide(float(t), {"a": measured(t, loaders)})
        if d:
            changes.append((t, d["a"]))
            loaders = d["a"]
    return changes


def _simulate(s: Scaler, loaders: int, seconds: int, consumption=lambda t: 1000.0,
              need=lambda t: 7):
    """The planner starves (20%) whenever fewer than ``need(t)`` loaders serve the source."""
    return _drive(s, loaders, seconds, lambda t, n: load(
        loaders=n, seconds_per_token=0.007, starved=0.2 if n < need(t) else 0.0,
        consumption=consumption(t)))


def test_a_scale_down_that_starves_is_undone_once_not_repeated():
    # the model asks for 5 (ceil(1.25 * 500 * 0.007)) but the source starves below 7:
    # without a floor the policy would go 7 -> 6 -> 7 every scale_down_after seconds
    s = Scaler(ScalingPolicy(cooldown=5.0, scale_down_after=30.0))
    changes = _simulate(s, 7, 600)
    assert changes == [(30, 6), (35, 7)]
    assert s.floors["a"][0] == 7


def test_the_floor_goes_when_demand_falls():
    s = Scaler(ScalingPolicy(cooldown=5.0, scale_down_after=30.0))
    # demand drops to a third at t=100: the floor is released and loaders step down
    changes = _simulate(s, 7, 600, consumption=lambda t: 1000.0 if t < 100 else 330.0,
                        need=lambda t: 7 if t < 100 else 3)
    assert changes[:2] == [(30, 6), (35, 7)]
    # then one loader at a time, every scale_down_after, down to the model's
    # ceil(1.25 * 165 * 0.007) = 2; that starves (3 are needed): back to 3, held there
    assert changes[2:] == [(130, 6), (160, 5), (190, 4), (220, 3), (250, 2), (255, 3)]
    assert s.floors["a"][0] == 3


def _cpu_bound(s: Scaler, cores: int, seconds: int, loaders: int = 1):
    """Loaders sharing ``cores``: busy time per token grows once they outnumber the cores."""
    return _drive(s, loaders, seconds, lambda t, n: load(
        loaders=n, seconds_per_token=0.001 * max(1.0, n / cores), consumption=20_000.0,
        starved=0.5))


def test_loaders_that_add_no_capacity_are_removed_and_not_added_again():
    # demand 10k tok/s, 1k per loader: the model asks for 8 (the maximum); on 2 cores
    # 4 loaders supply what 2 do, so the policy goes back to 2 and stays there
    s = Scaler(ScalingPolicy(cooldown=5.0, scale_down_after=30.0))
    changes = _cpu_bound(s, cores=2, seconds=300)
    assert changes == [(0, 2), (5, 4), (10, 2)]
    assert s.saturated == {"a": 2}
    assert s.target("a", load(loaders=2, seconds_per_token=0.001, consumption=20_000.0,
                              starved=0.5)) == 2


def test_loaders_that_each_add_capacity_are_kept():
    # an I/O-bound source: busy time per token does not grow with loaders
    s = Scaler(ScalingPolicy(cooldown=5.0, scale_down_after=30.0))
    changes = _cpu_bound(s, cores=64, seconds=300)
    assert changes == [(0, 2), (5, 4), (10, 8)]
    assert s.saturated == {}


def test_a_loader_that_adds_some_capacity_is_kept_but_no_more_are_added():
    # the second loader adds 25% (cores shared with other jobs): keep 2, add no third
    s = Scaler(ScalingPolicy(cooldown=5.0, scale_down_after=30.0))
    kw = dict(consumption=20_000.0, starved=0.5)
    assert s.decide(0.0, {"a": load(loaders=1, seconds_per_token=0.001, **kw)}) == {"a": 2}
    for t in range(5, 200):
        assert s.decide(float(t), {"a": load(loaders=2, seconds_per_token=0.0016, **kw)}) == {}
    assert s.saturated == {"a": 2}
