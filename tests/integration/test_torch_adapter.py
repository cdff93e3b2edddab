"""msd_dask.torch: MsdIterableDataset through a torch DataLoader on an embedded LocalCluster
(``tests/unit/test_torch_prefetch.py``: the Prefetcher alone)."""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from torch.utils.data import DataLoader

from msd_dask import DataService, ServiceError
from msd_dask.torch import MsdIterableDataset

from checks import wait_until
from corpus import config, write_corpus


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("corpus"))
    write_corpus(root)
    with DataService.start(config(root, name="torchtest", cost={"fit": True}), n_workers=1,
                           threads_per_worker=2) as svc:
        yield svc


#: each rank's reader state when a test closed its datasets: the module's tests share one
#: service, and a rank's next process loads the state its last one saved, as a training
#: process restarted from its checkpoint does (a rank's reader with no state after one that
#: had steps is refused: each step is served once)
_SAVED: dict[int, dict] = {}


def _rank_loaders(service, **kwargs):
    """One dataset per rank of the service and a DataLoader iterator over each."""
    addr = service.client.scheduler.address
    datasets = [MsdIterableDataset(addr, "torchtest", r, **kwargs) for r in range(2)]
    for ds in datasets:
        if ds.rank in _SAVED:
            ds.load_state_dict(_SAVED[ds.rank])
    return datasets, [iter(DataLoader(ds, batch_size=None, num_workers=0)) for ds in datasets]


def _close(datasets) -> None:
    for ds in datasets:
        _SAVED[ds.rank] = ds.state_dict()
        ds.close()


def test_dataloader_yields_the_readers_batches(service):
    datasets, loaders = _rank_loaders(service, steps=3)
    try:
        for step in range(3):
            for rank, it in enumerate(loaders):
                b = next(it)
                assert b["step"] == step and b["rank"] == rank
                assert b["input_ids"].dtype == torch.long and b["input_ids"].shape == (2, 512)
                assert b["labels"].shape == b["position_ids"].shape == (2, 512)
                assert len(b["cu_seqlens"]) == 2 and b["cu_seqlens"][0].dtype == torch.int32
                assert b["cu_seqlens"][0][0] == 0
                assert b["num_tokens"] == sum(int(c[-1]) for c in b["cu_seqlens"])
                assert len(b["documents"][0]) == len(b["cu_seqlens"][0]) - 1
        for it in loaders:  # steps=3: the iteration ends by itself
            with pytest.raises(StopIteration):
                next(it)
        # a second iteration continues where the first stopped, and state_dict says where
        assert datasets[0].state_dict() == {"service": "torchtest", "rank": 0, "step": 2}
        assert next(iter(datasets[1]))["step"] == 3
        assert next(iter(datasets[0]))["step"] == 3
    finally:
        _close(datasets)


def test_pickles_unconnected_and_refuses_loader_workers(service):
    addr = service.client.scheduler.address
    ds = pickle.loads(pickle.dumps(MsdIterableDataset(addr, "torchtest", 0, steps=1)))
    assert ds.state_dict() == {"service": "torchtest", "rank": 0, "step": None}
    ds.load_state_dict({"rank": 0, "step": 7})
    assert ds.state_dict() == {"service": "torchtest", "rank": 0, "step": 7}
    with pytest.raises(ValueError, match="rank 1"):
        MsdIterableDataset(addr, "torchtest", 0).load_state_dict({"rank": 1, "step": 0})
    with pytest.raises(RuntimeError, match="num_workers=0"):
        next(iter(DataLoader(ds, batch_size=None, num_workers=1,
                             multiprocessing_context="spawn")))


def test_prefetch_claims_ahead_and_reports_step_times(service):
    datasets, loaders = _rank_loaders(service, prefetch=2)
    try:
        first = [next(it)["step"] for it in loaders]
        assert first[0] == first[1]
        # both ranks' threads claim two more steps while "the model computes", then stop
        assert wait_until(lambda: all(ds.ahead == 2 for ds in datasets), timeout=60)
        time.sleep(0.5)
        for ds in datasets:
            assert ds.ahead == 2 and ds._reader.step == first[0] + 2
            # the position is the last batch handed out, not the last one claimed
            assert ds.state_dict() == {"service": "torchtest", "rank": ds.rank, "step": first[0]}
        for k in range(1, 5):
            for rank, it in enumerate(loaders):
                b = next(it)
                assert (b["step"], b["rank"]) == (first[0] + k, rank)
                assert b["input_ids"].shape == (2, 512)
        def reports() -> int:  # (fitted or set aside: a group's first ones are warm-up)
            model = service.stats()["planner"]["cost_model"]
            return int(model["observations"] + model["set_aside"])

        observed = reports()
        for ds in datasets:
            ds.report_step_time(0.25)        # the step of the last batch handed out
            ds.report_step_time(0.25, step=first[0] + 2)
        assert wait_until(lambda: reports() == observed + 4, timeout=30)
        with pytest.raises(RuntimeError, match="before the first iter"):
            datasets[0].load_state_dict({"rank": 0, "step": 0})
        # closed (its prefetched batches carried to the next iter()), it still reports: it
        # said "no batch was handed out yet", a step given too (a review)
        datasets[0].close()
        datasets[0].report_step_time(0.25, step=first[0] + 3)  # (steps not reported yet:
        datasets[0].report_step_time(0.25, step=first[0] + 1)  # a step's first report counts)
        assert wait_until(lambda: reports() == observed + 6, timeout=30)
    finally:
        _close(datasets)
    addr = service.client.scheduler.address
    with MsdIterableDataset(addr, "torchtest", 0) as ds:  # (closed on leaving: disconnected)
        with pytest.raises(ServiceError, match="handed this rank the steps"):  # (connected)
            next(iter(ds))
        assert ds._service is not None
    assert ds._service is None
    with pytest.raises(ValueError, match="no batch"):
        MsdIterableDataset(addr, "torchtest", 0).report_step_time(1.0)
    with pytest.raises(ValueError, match="prefetch"):
        MsdIterableDataset(addr, "torchtest", 0, prefetch=-1)


def test_a_dataset_connected_again_takes_a_state_where_it_is(tmp_path):
    """A dataset closed with prefetched batches carried, connected again (its
    ``report_step_time`` does so), took its own state (a ``StatefulDataLoader``'s restore):
    the state went to the new reader while the carried steps were handed out after it, and
    the reader then asked for them again, a ``ServiceError``.  A connected dataset that
    skipped ahead kept its old ``last_step``, which docs/resume.md has rank 0 checkpoint
    (a review).  Both go on with the next steps, and ``last_step`` is the state's."""
    root = str(tmp_path / "corpus")
    write_corpus(root)
    with DataService.start(config(root, name="torchagain"), n_workers=1,
                           threads_per_worker=2) as svc:
        addr = svc.client.scheduler.address
        datasets = [MsdIterableDataset(addr, "torchagain", r, prefetch=2) for r in range(2)]
        plain = [MsdIterableDataset(addr, "torchagain", r) for r in range(2)]
        try:
            loaders = [iter(DataLoader(ds, batch_size=None)) for ds in datasets]
            assert [next(it)["step"] for it in loaders] == [0, 0]
            assert wait_until(lambda: all(ds.ahead == 2 for ds in datasets), timeout=60)
            for ds in datasets:
                ds.close()  # (steps 1 and 2 carried)
                ds.report_step_time(0.25)  # connected again
                state = ds.state_dict()
                assert state["step"] == 0
                ds.load_state_dict(state)  # nothing changes
                assert ds.last_step == 0 and ds.state_dict() == state
            loaders = [iter(DataLoader(ds, batch_size=None)) for ds in datasets]
            for step in range(1, 5):
                assert [next(it)["step"] for it in loaders] == [step, step]
            assert wait_until(lambda: all(ds.ahead == 2 for ds in datasets), timeout=60)
            for ds in datasets:
                ds.close()  # (steps 5 and 6 carried, never trained on: dropped here)
            for ds in plain:  # the ranks go on after them
                ds.load_state_dict({"service": "torchagain", "rank": ds.rank, "step": 6})
            loaders = [iter(DataLoader(ds, batch_size=None)) for ds in plain]
            assert [next(it)["step"] for it in loaders] == [7, 7]
            for ds in plain:  # connected: a later state skips steps 8 and 9
                ds.load_state_dict({"service": "torchagain", "rank": ds.rank, "step": 9})
                assert ds.last_step == 9 == ds.state_dict()["step"]
            assert [next(it)["step"] for it in loaders] == [10, 10]
        finally:
            for ds in datasets + plain:
                ds.close()
