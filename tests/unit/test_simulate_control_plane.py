"""scripts/simulate.py --control-plane: the utilisation arithmetic on a small case."""

from __future__ import annotations

import math

import pytest
from scripts_import import load_script

sim = load_script("simulate")

COSTS = sim.ControlPlaneCosts(sched_rank_step=50e-6, queue_op=0.25e-3, connect=10e-3,
                              plan_rank_step=1e-3, constructor_rank_step=2e-3, client_beat=1e-3)


def test_utilisation_of_each_role_and_design():
    # 96 ranks, tp 8 -> 12 DP ranks; a 2 s step; rounds of 4 steps; 3 constructors
    queue, direct = sim.control_plane(COSTS, 96, 2.0, round_steps=4, tp=8, constructors=3)
    assert (queue.design, direct.design) == ("queue", "direct")
    idle = 96 * 1e-3 / 20.0                           # 96 clients beat every 10 x 2 s
    rounds = 96 / 4 / 2.0                             # 12 rank-rounds per second
    assert queue.dp == direct.dp == 12
    assert math.isclose(queue.scheduler, idle + 2 * 0.25e-3 * rounds)      # 0.0156
    # (measured at rounds of 3 steps: 2 queue operations per rank and 3 steps, here per 4)
    assert math.isclose(queue.scheduler_measured, idle + 50e-6 * 3 / 4 * 96 / 2.0)  # 0.0098
    assert math.isclose(direct.scheduler, idle) and math.isclose(direct.scheduler_measured, idle)
    assert math.isclose(queue.planner, 1e-3 * 12 / 2.0) and direct.planner == queue.planner
    assert math.isclose(queue.constructor, 2e-3 * 96 / 2.0 / 3)             # 0.032 each
    assert math.isclose(direct.constructor, queue.constructor + 0.25e-3 * rounds / 3)
    assert math.isclose(queue.connect_s, 0.96) and direct.connect_s == queue.connect_s
    assert queue.busiest == max(queue.scheduler, queue.planner, queue.constructor)


def test_utilisation_scales_with_ranks_and_step():
    small = sim.control_plane(COSTS, 4096, 1.0)[0]
    big = sim.control_plane(COSTS, 16384, 1.0)[0]
    slow = sim.control_plane(COSTS, 16384, 4.0)[0]
    idle = 16384 * 1e-3 / (10 * (16384 / 200 + 1))   # Dask stretches the clients' interval
    assert math.isclose(slow.planner, big.planner / 4)
    assert math.isclose(slow.scheduler - idle, (big.scheduler - idle) / 4)
    assert big.scheduler > small.scheduler


def test_the_measured_scheduler_figure_follows_the_rounds():
    """The measured CPU per rank-step came from rounds of 3 steps: longer rounds send fewer
    tickets, so it scales with them as the per-message figure does (it stayed at its
    rounds-of-3 value, and ``busiest`` called the queue design saturated where it was not;
    a review)."""
    rows = {k: sim.control_plane(COSTS, 4096, 1.0, round_steps=k, workers=0)[0] for k in (1, 3, 6)}
    idle = rows[3].scheduler_measured - 50e-6 * 4096
    for k, row in rows.items():
        assert math.isclose(row.scheduler_measured - idle, 50e-6 * 4096 * 3 / k)
        assert math.isclose((row.scheduler - idle) * k, (rows[1].scheduler - idle))


def test_the_cli_refuses_bad_values_naming_them(capsys):
    for args in (["--control-plane", "--cp-ranks-per-client", "0"],
                 ["--control-plane", "--cp-step-seconds", "0"],
                 ["--control-plane", "--cp-workers", "-5"],
                 ["--workers", "0"], ["--strategy", "nosuch"]):
        with pytest.raises(SystemExit) as e:
            sim.main(args)
        assert e.value.code == 2, args
        err = capsys.readouterr().err
        assert args[-2] in err and args[-1] in err, err


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        sim.control_plane(COSTS, 0, 1.0)
    with pytest.raises(ValueError):
        sim.control_plane(COSTS, 16, 0.0)
    # (negative workers or clients gave negative loads, a NaN step NaN loads the busiest
    # role skipped; a review)
    for kwargs in ({"workers": -256}, {"clients": -100}):
        with pytest.raises(ValueError, match="clients and workers >= 0"):
            sim.control_plane(COSTS, 16, 1.0, **kwargs)
    with pytest.raises(ValueError, match="step_seconds a finite number > 0"):
        sim.control_plane(COSTS, 16, math.nan)


@pytest.mark.parametrize("args, says", [
    (["--outliers", "nan"], "argument --outliers: MIN_LENGTH is tokens"),
    (["--source", "a:0:1e-6"], "--source: the sources' weights sum to 0"),
    (["--source", "a:1:1e-6", "--source", "a:1:1e-6"], "a source's name is given twice"),
])
def test_sources_and_outliers_the_simulator_cannot_run_are_refused(args, says, capsys):
    # each failed after the parameter header, as a traceback naming a YAML key (a review)
    with pytest.raises(SystemExit) as e:
        sim.main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_cli_prints_the_table(capsys):
    assert sim.main(["--control-plane", "--cp-ranks", "64", "--cp-step-seconds", "2"]) == 0
    out = capsys.readouterr().out
    assert "control plane" in out and "scheduler" in out and "planner" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["64"]]
    assert [r[2] for r in rows] == ["queue", "direct"], out


def test_fewer_clients_cut_the_idle_load_and_the_connects():
    per_rank = sim.control_plane(COSTS, 64, 1.0, clients=64)[1]
    per_host = sim.control_plane(COSTS, 64, 1.0, clients=8)[1]
    assert math.isclose(per_rank.scheduler, 64 * 1e-3 / 20.0)   # 64 clients: every 20 s
    assert math.isclose(per_host.scheduler, 8 * 1e-3 / 5.0)     # 8 clients: every 5 s
    assert math.isclose(per_host.connect_s, 8 * 10e-3)


def test_the_clients_idle_load_is_bounded_by_dasks_heartbeat_rule():
    """Dask beats each of n > 200 clients every 10 x (n / 200 + 1) s: the load tends to
    20 beats a second, so 16,384 clients cost about what 2,048 do."""
    loads = [sim.control_plane(COSTS, n, 1.0, clients=n)[1].scheduler for n in (2048, 16384)]
    assert all(x < 20 * 1e-3 for x in loads) and loads[1] < 1.1 * loads[0]


def test_cli_ranks_per_client(capsys):
    assert sim.main(["--control-plane", "--cp-ranks", "64", "--cp-ranks-per-client", "8"]) == 0
    assert "one client per 8 rank(s)" in capsys.readouterr().out


def test_busiest_counts_the_measured_scheduler_where_there_is_one():
    """At 4,096 ranks the queue design's per-message scheduler is 0.87 of a step and its
    measured CPU 1.08: busiest said 0.87, "can be held" (review)."""
    row = sim.ControlPlaneRow("queue", 4096, 512, scheduler=0.87, scheduler_measured=1.08,
                              planner=0.01, constructor=0.19, connect_s=37.0)
    assert row.busiest == 1.08
    none = sim.ControlPlaneRow("direct", 4096, 512, scheduler=0.05, scheduler_measured=math.nan,
                               planner=0.01, constructor=0.20, connect_s=37.0)
    assert none.busiest == 0.20


def test_dasks_own_load_is_counted_with_the_workers():
    """The scheduler's figure was its clients' heartbeats alone, which a review found left
    out what every Dask scheduler carries: its idle load and its workers' heartbeats."""
    from distributed.scheduler import heartbeat_interval

    costs = sim.ControlPlaneCosts(client_beat=1e-3, scheduler_idle=0.02, worker_beat=0.3e-3)
    alone = sim.control_plane(costs, 64, 1.0, clients=64)[1]
    with_workers = sim.control_plane(costs, 64, 1.0, clients=64, workers=256)[1]
    dask = 0.02 + 256 * 0.3e-3 / heartbeat_interval(256)   # 256 workers beat every 2.28 s
    assert alone.dask == 0.0
    assert math.isclose(with_workers.dask, dask)
    assert math.isclose(with_workers.scheduler, alone.scheduler + dask)
    assert math.isclose(with_workers.scheduler_measured, alone.scheduler_measured + dask)


def test_cli_counts_256_workers_by_default(capsys):
    assert sim.main(["--control-plane", "--cp-ranks", "64"]) == 0
    out = capsys.readouterr().out
    assert "256 workers" in out and "of it Dask" in out
    direct = next(line.split() for line in out.splitlines() if line.split()[1:3] == ["8", "direct"])
    assert float(direct[5]) > 0.05  # (Dask's own: the idle scheduler and 112 beats a second)


def test_the_plots_bound_is_each_cells_own(monkeypatch, tmp_path):
    # the line took the context for the row length: with --seq-len 1024 it drew 1.083 and
    # 1.667 where the table's bound column said 1.021 (a review)
    from types import SimpleNamespace

    import matplotlib.figure

    drawn = {}

    def savefig(fig, path, **kw):
        for line in fig.axes[0].get_lines():
            drawn[line.get_label()] = list(line.get_ydata())

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    cells = [SimpleNamespace(cfg=SimpleNamespace(dp=8, context=c, hidden=4096), bound=1.021,
                             speedup_total=1.0, speedup_ideal=1.0, tokens_gain=1.0,
                             imb_base=1.0, imb_msd=1.0) for c in (4096, 32768)]
    sim._plot(cells, str(tmp_path / "p.png"))
    assert drawn["bound 1+L/(12H)"] == [1.021, 1.021]
