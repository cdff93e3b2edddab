"""scripts/bench_memory.py: ``--cluster-env`` reaches the dask scheduler and workers only
(``tests/unit/test_bench_memory_args.py``: its parsing); ``--agents 0,1`` measures the
readers directly and through a host agent in one run (``--smoke``, about 50 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from scripts_import import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench_memory():
    return load_script("bench_memory", "bench_memory")


def test_cluster_env_reaches_the_scheduler_and_workers_only(bench_memory, tmp_path):
    from distributed import Client

    key = "MSD_BENCH_MEMORY_TEST"
    os.environ.pop(key, None)
    address, procs = bench_memory.start_cluster(str(tmp_path), 1, {key: "on"})
    try:
        assert key not in os.environ  # this process (and what it starts next) does not get it
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            assert list(client.run(os.getenv, key).values()) == ["on"]
            assert client.run_on_scheduler(os.getenv, key) == "on"
    finally:
        from bench_scheduler_bytes import stop_cluster

        stop_cluster(procs)


@pytest.mark.slow
def test_smoke_measures_the_readers_directly_and_through_an_agent(tmp_path):
    pytest.importorskip("datasets", reason="the baseline needs Hugging Face `datasets`")
    if not all(os.path.isdir(os.path.join(ROOT, "data", "demo", d)) for d in ("code", "prose")):
        from msd_dask.examples.demo import write_demo_corpus

        write_demo_corpus(os.path.join(ROOT, "data", "demo"))
    out_json = tmp_path / "memory.json"
    proc = subprocess.run(
        [sys.executable, os.path.join("scripts", "bench_memory.py"), "--smoke", "--read-ahead",
         "config", "--agents", "0,1", "--json", str(out_json)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "direct" in proc.stdout and "1 agent x 2 ranks" in proc.stdout, proc.stdout
    assert "host agents (with their children)" in proc.stdout, proc.stdout
    assert "read_ahead 8 (config)" in proc.stdout and "token buffers" in proc.stdout, proc.stdout
    assert "ratio HF total / msd_dask total" in proc.stdout, proc.stdout
    direct, agent = json.loads(out_json.read_text())["msd"]
    assert (direct["hosts"], direct["agents"], direct["agent_blocks"]) == (0, 0, 0)
    assert agent["hosts"] == 1 and agent["agents"] > 0 and agent["reader_adds"] > 0
    for m in (direct, agent):
        assert m["total"] > 0 and m["scheduler"] > 0 and m["workers"] > 0 and m["serve"] > 0
    assert agent["total"] == pytest.approx(agent["scheduler"] + agent["workers"] + agent["serve"]
                                           + agent["agents"] + 2 * agent["reader_adds"])
