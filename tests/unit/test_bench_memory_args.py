"""scripts/bench_memory.py: ``--cluster-env`` pairs are parsed, a malformed one refused;
``--agents`` counts and the simulated hosts; a child that never gets ready is named and
stopped."""

from __future__ import annotations

import sys

import pytest
from scripts_import import load_script


@pytest.fixture(scope="module")
def bench_memory():
    return load_script("bench_memory", "bench_memory")


def test_cluster_env_parses_pairs_and_refuses_a_malformed_one(bench_memory):
    assert bench_memory._cluster_env(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    for bad in ("A", "=1"):
        with pytest.raises(SystemExit, match="KEY=VALUE"):
            bench_memory._cluster_env([bad])


def test_agents_parses_counts_and_refuses_more_hosts_than_ranks(bench_memory):
    assert bench_memory._agent_counts("0", 16) == [0]
    assert bench_memory._agent_counts("0, 2", 16) == [0, 2]
    assert bench_memory._agent_counts("16", 16) == [16]
    for bad in ("x", "1.5", "", "0,,2"):
        with pytest.raises(SystemExit, match="comma-separated integers"):
            bench_memory._agent_counts(bad, 16)
    for bad in ("-1", "17"):
        with pytest.raises(SystemExit, match="want 0"):
            bench_memory._agent_counts(bad, 16)


def test_hosts_split_the_ranks_into_consecutive_even_hosts(bench_memory):
    assert bench_memory._hosts(16, 2) == [list(range(8)), list(range(8, 16))]
    assert bench_memory._hosts(2, 1) == [[0, 1]]
    hosts = bench_memory._hosts(7, 3)
    assert [r for h in hosts for r in h] == list(range(7))
    assert sorted(len(h) for h in hosts) == [2, 2, 3]
    assert bench_memory._agents_head(0, 16) == "direct"
    assert bench_memory._agents_head(2, 16) == "2 agents x 8 ranks"
    assert bench_memory._agents_head(1, 2) == "1 agent x 2 ranks"
    assert bench_memory._agents_head(3, 7) == "3 agents x 2-3 ranks"


def test_a_child_that_is_never_ready_is_named_and_stopped(bench_memory):
    procs = bench_memory.Procs()
    procs.start("agent0", [], argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    p = procs.procs["agent0"]
    try:
        with pytest.raises(TimeoutError, match=r"agent0 not ready \(no line 'agent of'\)"):
            procs.wait_ready(["agent0"], 1.0, ready="agent of")
    finally:
        procs.stop()
    assert p.returncode is not None and procs.procs == {}  # SIGTERM: no 30 s wait


def test_a_child_that_exits_early_is_named(bench_memory):
    procs = bench_memory.Procs()
    procs.start("agent1", [], argv=[sys.executable, "-c", "raise SystemExit(3)"])
    try:
        with pytest.raises(RuntimeError, match="agent1 exited with 3"):
            procs.wait_ready(["agent1"], 60, ready="agent of")
    finally:
        procs.stop()


def test_stop_kills_what_a_child_left_behind(bench_memory):
    import time

    leave = ("import subprocess, sys; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "print('ready', p.pid, flush=True)")
    procs = bench_memory.Procs()
    procs.start("agent2", [], argv=[sys.executable, "-c", leave])
    line = procs.procs["agent2"].stdout.readline()
    orphan = int(line.split()[1])
    procs.stop()
    deadline = time.monotonic() + 10

    def state() -> str | None:
        try:
            with open(f"/proc/{orphan}/stat") as f:
                return f.read().rsplit(")", 1)[-1].split()[0]
        except FileNotFoundError:
            return None

    while state() not in (None, "Z") and time.monotonic() < deadline:  # Z: killed, not reaped
        time.sleep(0.1)
    assert state() in (None, "Z"), "the process a child left behind outlived stop()"
