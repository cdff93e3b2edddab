"""CPU time of a loader's preprocessing pool, and the loader policy's CPU cap on it.

A loader reports the CPU seconds of its busy time and the part of it spent
waiting for a core, its pool's workers included (threads: each chunk of
documents timed on the thread that runs it; processes: each chunk's CPU time
returned with its results).  The CPU fraction, ``cpu / (busy - wait)``, must
tell preprocessing that burns CPU from preprocessing that waits on a store, on
either kind of pool, so the adaptive policy caps a CPU-bound source at what the
cores can run however it is preprocessed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from msd_dask import load_config
from msd_dask.core.config import PoolConfig, ScalingConfig, SourceConfig
from msd_dask.core.scaling import Scaler, ScalingPolicy, SourceLoad, cpu_caps
from msd_dask.roles.loader import SourceLoader

from corpus import config, source_units

PREP = "msd_dask.examples.preprocess:"


def _read_all(src: SourceConfig, preprocess: str, pool: PoolConfig | None) -> dict[str, Any]:
    """``stats()`` of a :class:`SourceLoader` that read every unit of ``src`` (no Dask)."""
    source = dataclasses.asdict(dataclasses.replace(src, preprocess=PREP + preprocess,
                                                    pool=pool or PoolConfig()))
    source.pop("weight")
    units = [(u.path, u.part, u.row_offset) for u in source_units(src)[1]]

    async def run() -> dict[str, Any]:
        loader = SourceLoader(source, units, {"kind": "bytes"})
        try:
            await loader.assign([(0, i) for i in range(len(units))])
            for i in range(len(units)):
                await loader.metadata(0, i)
            return await loader.stats()
        finally:
            await loader.close()

    return asyncio.run(run())


def _fraction(st: dict[str, Any]) -> float:
    """The CPU fraction of a loader's busy time, as the scheduler plugin computes it."""
    return float(st["cpu_seconds"] / (st["read_seconds"] - st["cpu_wait_seconds"]))


@pytest.fixture(scope="module")
def prose(corpus: Any) -> SourceConfig:
    root, _ = corpus
    return load_config(config(root)).sources[1]


@pytest.mark.parametrize("kind,preprocess", [("thread", "cpu_bound"),
                                             ("process", "cpu_bound"),
                                             ("process", "cpu_bound_py")])
def test_a_pool_reports_the_cpu_of_cpu_bound_preprocessing(prose: SourceConfig, kind: str,
                                                           preprocess: str) -> None:
    inline = _read_all(prose, preprocess, None)
    pooled = _read_all(prose, preprocess, PoolConfig(kind, 2))
    assert pooled["threads"] == 2 and pooled["pool"] == kind
    assert pooled["tokens_read"] == inline["tokens_read"] > 0
    # the pool's workers are on a core for most of their busy time (hashing or Python
    # loops), as one thread doing the same work is
    assert _fraction(pooled) > 0.5, pooled
    assert _fraction(inline) > 0.5, inline
    # the same documents cost about the same CPU, whoever runs them (it was 0.0 on a pool)
    assert 0.5 < pooled["cpu_seconds"] / inline["cpu_seconds"] < 2.0, (pooled, inline)
    # CPU and core waits are parts of the busy time
    assert pooled["cpu_seconds"] + pooled["cpu_wait_seconds"] <= pooled["read_seconds"] * 1.02


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_a_pool_waiting_on_a_store_reports_a_small_cpu_fraction(prose: SourceConfig,
                                                                 kind: str) -> None:
    st = _read_all(prose, "store_20x", PoolConfig(kind, 2))
    assert st["read_seconds"] > 0.3, st  # 40 ms per KiB of waiting, summed over the pool
    assert 0.0 < _fraction(st) < 0.2, st


def _pooled_load(loaders: int, fraction: float, threads: int = 4) -> SourceLoad:
    """A source on a pool of ``threads`` with 1 ms of busy time per token, on 2 cores;
    its demand asks for the maximum number of loaders."""
    return SourceLoad(loaders=loaders, weight_ahead=0.5, consumption=40_000.0,
                      seconds_per_token=0.001, threads=threads, starved=0.5,
                      cpu_per_token=0.001 * fraction, cpu_fraction=fraction, cores=2.0)


def test_cpu_cap_of_a_pooled_source_counts_its_pool() -> None:
    # a process pool of 2 burning CPU keeps both cores busy: one loader
    assert cpu_caps({"a": _pooled_load(1, 0.95, threads=2)}, {"a": 0.95}) == {"a": 1}
    s = Scaler(ScalingPolicy(ScalingConfig(cooldown=1.0, scale_down_after=30.0)))
    for t in range(30):
        assert s.decide(float(t), {"a": _pooled_load(1, 0.95, threads=2)}) == {}
    assert s.cpu_caps == {"a": 1}
    # a GIL-bound thread pool of 4 measures about 1/4: one core per loader, two loaders
    assert cpu_caps({"a": _pooled_load(1, 0.26)}, {"a": 0.26}) == {"a": 2}


def test_unconfirmed_fraction_does_not_remove_loaders_of_a_large_pool() -> None:
    # 4 threads waiting on a store, 2% on a core, on 2 cores: 25 such loaders keep them busy.
    # Before MIN_CPU_WINDOWS windows the cap is at most cores / threads (0 here) or the
    # loaders the source has: it stays at 3, then grows; it used to go 3 -> 1 -> 2 -> 4 ...
    s = Scaler(ScalingPolicy(ScalingConfig(cooldown=1.0, scale_down_after=30.0)))
    n, changes = 3, []
    for t in range(30):
        d = s.decide(float(t), {"a": _pooled_load(n, 0.02)})
        if d:
            changes.append((t, d["a"]))
            n = d["a"]
    counts = [3] + [c for _, c in changes]
    assert len(counts) > 2 and counts == sorted(set(counts)), changes  # up only
    assert changes[0][0] >= 2 and s.cpu_caps == {"a": 25}
