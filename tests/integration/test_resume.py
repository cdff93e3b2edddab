"""Exact resume: state_dict after step k-1, a new service continues with step k, identically."""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from msd_dask import DataService, ServiceError

from checks import record
from corpus import config, write_corpus

K = 7  # steps served before the state is taken
N = 100  # steps compared after it


def _read(svc: DataService, first: int, steps: int, readers=None) -> list[list[dict]]:
    """``out[i][rank]``: the record of step ``first + i`` for every rank."""
    world = svc.config.parallel.world_size
    readers = readers or [svc.reader(r) for r in range(world)]
    out = []
    for i in range(steps):
        row = []
        for reader in readers:
            b = next(reader)
            assert b.step == first + i and b.rank == reader.rank
            row.append(record(b))
        out.append(row)
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted run of K + N steps, and the state it gave after step K - 1."""
    root = str(tmp_path_factory.mktemp("corpus"))
    write_corpus(root)
    cfg = config(root, name="resume")  # the default balance strategy
    with DataService.start(cfg, n_workers=1, threads_per_worker=2) as svc:
        readers = [svc.reader(r) for r in range(2)]
        head = _read(svc, 0, K, readers)
        assert svc.consumed_step() == K - 1
        state = svc.state_dict()
        assert state == svc.state_dict(K - 1)
        for step in (-5, 10_000):
            with pytest.raises(ValueError, match="not planned yet|no longer held"):
                svc.state_dict(step)
        rest = _read(svc, K, N, readers)
    state = json.loads(json.dumps(state))  # it is JSON, as a checkpoint stores it
    assert state["step"] == K - 1 and state["seed"] == 7 and state["format"]
    return root, cfg, state, head + rest


def test_resume_continues_exactly(baseline):
    root, cfg, state, full = baseline
    with DataService.start(cfg, resume=state, n_workers=1, threads_per_worker=2) as svc:
        assert svc.consumed_step() == K - 1
        got = _read(svc, K, N)
    for i, (a_row, b_row) in enumerate(zip(full[K:], got, strict=True)):
        for a, b in zip(a_row, b_row, strict=True):
            assert a["documents"] == b["documents"], f"step {K + i} rank {a['rank']}"
            assert (a["input_ids"] == b["input_ids"]).all()


def test_elastic_resume_same_documents_per_step(baseline):
    root, cfg, state, full = baseline
    # dp=2 x 2 micro-batches -> dp=4 x 1: the same rows per step, over twice the ranks
    cfg4 = dict(cfg, parallel={"dp": 4}, batch={"seq_len": 512, "micro_batches": 1})
    with DataService.start(cfg4, resume=state, n_workers=1, threads_per_worker=2) as svc:
        got = _read(svc, K, N)

    def docs(row):
        return Counter(d for rec in row for mb in rec["documents"] for d in mb)

    assert all(len(row) == 4 for row in got)  # the same documents, over four ranks now
    for i in range(N):
        assert docs(full[K + i]) == docs(got[i]), f"step {K + i}"


def test_refuses_another_seed_and_reader_skips_consumed_steps(baseline):
    root, cfg, state, full = baseline
    with pytest.raises(ServiceError, match="seed 7.*config has seed 8"):
        DataService.start(dict(cfg, seed=8), resume=state)
    with pytest.raises(ServiceError, match="format"):
        DataService.start(cfg, resume={"format": "other/9", "planner": {}})
    with DataService.start(cfg, resume=state, n_workers=1, threads_per_worker=1) as svc:
        # a rank's own state older than the service's: it was told the service had handed
        # it the steps up to K - 1, which this service never had (a review)
        stale = svc.reader(0)
        stale.load_state_dict({"rank": 0, "step": 2})
        with pytest.raises(ServiceError, match=rf"for step 3, but the service had handed this "
                           rf"rank the steps up to {K - 1} already \(or it was resumed from the "
                           rf"state of step {K - 1} or later; this rank's state is of step 2\)"):
            next(stale)
        r0, r1 = svc.reader(0), svc.reader(1)
        # rank 0 restarted from its own checkpoint after step K + 2
        r0.load_state_dict({"rank": 0, "step": K + 2})
        assert r0.state_dict() == {"service": "resume", "rank": 0, "step": K + 2}
        with ThreadPoolExecutor(1) as ex:  # the ranks read concurrently, as in training
            rank0 = ex.submit(lambda: [record(next(r0)) for _ in range(3)])
            for step in range(K, K + 6):
                b1 = next(r1)
                assert b1.step == step
                assert record(b1)["documents"] == full[step][1]["documents"]
            got0 = rank0.result(timeout=60)
        assert [b["step"] for b in got0] == [K + 3, K + 4, K + 5]
        assert [b["documents"] for b in got0] == [full[s][0]["documents"] for s in range(K + 3, K + 6)]
        assert r0.state_dict() == {"service": "resume", "rank": 0, "step": K + 5}
        with pytest.raises(ValueError, match="rank 1"):
            r0.load_state_dict({"rank": 1, "step": 3})
