"""A stalled reader: bounded memory (planning stops at prefetch) and a timeout naming who is stuck."""

from __future__ import annotations

import time

import pytest

from msd_dask import DataService, ServiceTimeoutError

from corpus import config, write_corpus


def test_stalled_reader_bounds_memory_and_is_named(tmp_path):
    root = str(tmp_path / "corpus")
    write_corpus(root)
    cfg = config(root, name="stall", prefetch=2)
    with DataService.start(cfg, n_workers=1, threads_per_worker=2) as svc:
        r1 = svc.reader(1, timeout=3)
        got = []
        with pytest.raises(ServiceTimeoutError) as ei:
            for _ in range(20):
                got.append(next(r1).step)
        # rank 0 never reads: rank 1 gets at most `prefetch` steps ahead of it
        assert got == list(range(len(got))) and 1 <= len(got) <= cfg["prefetch"]
        msg = str(ei.value)
        assert "not yet claimed by rank(s) [0]" in msg, msg
        assert "planner (at step" in msg and "waiting for constructors to make room" in msg, msg

        def sample() -> tuple[int, int, int]:
            st = svc.stats()
            return (st["planner"]["steps_planned"],
                    sum(s["tokens_buffered"] for s in st["sources"].values()),
                    st["ranks"][0]["queue_depth"])

        first = sample()
        time.sleep(1.5)
        samples = [first, sample()]
        # nothing grows while the reader stalls
        assert samples[0] == samples[1], samples
        planned, _, depth = samples[0]
        assert planned <= cfg["prefetch"] + 1 and depth <= cfg["prefetch"], samples
        # and the stalled rank can still read everything, in order
        r0 = svc.reader(0, timeout=30)
        assert [next(r0).step for _ in range(len(got) + 2)] == list(range(len(got) + 2))


def test_closing_a_dataset_whose_prefetch_thread_waits_is_prompt(tmp_path):
    """A dataset's close while its prefetch thread waited in a claim for a step that does
    not come (rank 0 never reads: rank 1 may run only ``prefetch`` steps ahead) waited the
    claim's poll, up to 5 s: the reader's close ends the wait at once (a review)."""
    from msd_dask.torch import MsdIterableDataset

    root = str(tmp_path / "corpus")
    write_corpus(root)
    cfg = config(root, name="stallclose", prefetch=2)
    with DataService.start(cfg, n_workers=1, threads_per_worker=2) as svc:
        ds = MsdIterableDataset(svc.client.scheduler.address, "stallclose", 1, prefetch=2,
                                timeout=60)
        first = next(iter(ds))["step"]
        assert first == 0
        time.sleep(6.0)  # (the prefetch thread took what there is and waits for more)
        t0 = time.monotonic()
        ds.close()
        took = time.monotonic() - t0
        assert took < 1.5, took
