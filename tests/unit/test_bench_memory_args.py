"""scripts/bench_memory.py: ``--cluster-env`` pairs are parsed, a malformed one refused."""

from __future__ import annotations

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
