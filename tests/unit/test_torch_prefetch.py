"""msd_dask.torch's Prefetcher: reads ahead in order, at most its depth, and hands on errors."""

from __future__ import annotations

import threading
import time

import pytest

from msd_dask.torch import Prefetcher

from checks import wait_until


class Counting:
    """An iterator over 0, 1, ... that counts how often it was advanced and can fail."""

    def __init__(self, fail_at: int | None = None):
        self.taken = 0
        self.fail_at = fail_at
        self.lock = threading.Lock()

    def __iter__(self):
        return self

    def __next__(self) -> int:
        with self.lock:
            i = self.taken
            self.taken += 1
        if i == self.fail_at:
            raise OSError(f"source failed at item {i}")
        return i


def test_prefetcher_reads_ahead_in_order_and_at_most_depth():
    src = Counting()
    pf = Prefetcher(src, 3)
    try:
        assert wait_until(lambda: src.taken == 3)
        time.sleep(0.3)                      # it stops at the depth: nothing more is taken
        assert src.taken == 3 and pf.ahead == 3
        assert [pf.get(timeout=5) for _ in range(5)] == [0, 1, 2, 3, 4]
        assert wait_until(lambda: src.taken == 8)
        time.sleep(0.3)
        assert src.taken == 8 and pf.ahead == 3
    finally:
        pf.close()


def test_prefetcher_hands_on_the_sources_error_after_its_items():
    pf = Prefetcher(Counting(fail_at=2), 4)
    assert [pf.get(timeout=5), pf.get(timeout=5)] == [0, 1]
    for _ in range(2):                       # raised again on every later call
        with pytest.raises(OSError, match="failed at item 2"):
            pf.get(timeout=5)
    pf.close()
    with pytest.raises(ValueError, match="depth"):
        Prefetcher(Counting(), 0)


def test_batch_to_dict_keeps_images_and_cp_index() -> None:
    """The torch adapter's dict had only the text fields: an image+text job never saw its
    images through ``MsdIterableDataset`` (review), nor a context-parallel rank its
    ``cp_index``."""
    import numpy as np
    from test_agent_protocol import fake_payload

    from msd_dask.batch import Batch
    from msd_dask.torch import batch_to_dict

    batch = Batch.from_payload(fake_payload(3, 0, images=True), 0)
    d = batch_to_dict(batch)
    assert d["pixel_values"] is batch.pixel_values and d["pixel_values"] is not None
    assert d["image_spans"] == [[(0, 3), None], [None]]
    assert d["cp_index"] is None  # (no context parallelism in this batch)
    cp = dict(fake_payload(3, 0), cp_index=np.tile(np.arange(8), (2, 1)))
    assert batch_to_dict(Batch.from_payload(cp, 0))["cp_index"] is not None
    assert {f for f, v in batch_to_dict(Batch.from_payload(fake_payload(3, 0), 0)).items()
            if v is None} == {"cp_index", "pixel_values", "image_spans"}
