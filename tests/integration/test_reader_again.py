"""A rank's next reader.  From the same handle it continues after the last step the rank
returned: the steps its earlier reader held unread come again, none is skipped.  With no
state, after a reader elsewhere (a restarted process) had steps, it is refused, naming
what to load; with the state loaded it continues."""

from __future__ import annotations

import gc

import pytest

from msd_dask import DataService, ServiceError

from checks import record
from corpus import config


def test_a_ranks_next_reader_neither_skips_nor_repeats_a_step(corpus):
    """A reader left after one step of its round of 3 (``for b in svc.reader(0): break``)
    and a new one made: the new one went on with the next round, and the two steps the
    first held unread were never delivered, silently (a review of the claim protocol)."""
    root, _ = corpus
    cfg = config(root, name="again", parallel={"dp": 1})  # rounds of prefetch - 1 = 3 steps
    with DataService.start(cfg, n_workers=1, threads_per_worker=2) as svc:
        got = []
        for b in svc.reader(0):
            got.append(record(b))
            break
        gc.collect()  # (the first reader is gone)
        reader = svc.reader(0)
        got += [record(next(reader)) for _ in range(6)]
        assert [g["step"] for g in got] == list(range(7))
        # a restarted training process: its own handle, the rank's reader without its state
        other = DataService.connect(svc.address, "again", agent=False)
        try:
            with pytest.raises(ServiceError, match=r"rank 0: a new reader with no state .* "
                               r"handed this rank the steps up to 8 .* load the state"):
                next(other.reader(0))
            again = other.reader(0)
            again.load_state_dict(reader.state_dict())  # the state it saved: step 6
            assert [next(again).step for _ in range(3)] == [7, 8, 9]
        finally:
            other.close()
