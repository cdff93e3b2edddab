"""scripts/bench_memory.py: ``--cluster-env`` reaches the dask scheduler and workers only
(``tests/unit/test_bench_memory_args.py``: its parsing; its ``--smoke`` runs, directly and
through an agent, in test_bench_smoke.py)."""

from __future__ import annotations

import os

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
