"""A step's work as the planner keeps it for re-created constructors
(:class:`msd_dask.roles.kept_work.KeptWork`): in memory where small, else in a file of the
worker's local directory, read back equal, and the file gone with the object."""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import pytest

from msd_dask.roles.kept_work import KeptWork, local_directory

PARTS = [b"a" * 10, b"", os.urandom(1000), b"z" * 7]


def test_a_small_work_stays_in_memory(tmp_path: Any) -> None:
    kept = KeptWork(3, PARTS, str(tmp_path), spill_from=2000)
    assert kept.path is None and kept.in_memory == kept.nbytes == 1017
    assert [kept.part(i) for i in range(len(kept))] == PARTS
    assert not list(tmp_path.iterdir())


def test_no_directory_keeps_it_in_memory() -> None:
    kept = KeptWork(3, PARTS, None, spill_from=0)
    assert kept.path is None and [kept.part(i) for i in range(4)] == PARTS


def test_a_large_work_goes_to_a_file_and_comes_back_equal(tmp_path: Any) -> None:
    kept = KeptWork(3, PARTS, str(tmp_path), spill_from=1000)
    assert kept.path is not None and os.path.dirname(kept.path) == str(tmp_path)
    assert kept.in_memory == 0 and kept.nbytes == 1017
    assert os.path.getsize(kept.path) == 1017
    assert [kept.part(i) for i in range(len(kept))] == PARTS


def test_the_file_goes_with_the_object_or_at_close(tmp_path: Any) -> None:
    kept = KeptWork(3, PARTS, str(tmp_path), spill_from=0)
    assert len(list(tmp_path.iterdir())) == 1
    del kept
    gc.collect()
    assert not list(tmp_path.iterdir())
    kept = KeptWork(4, PARTS, str(tmp_path), spill_from=0)
    kept.close()
    kept.close()  # (idempotent)
    assert not list(tmp_path.iterdir())


def test_a_work_that_cannot_be_written_is_kept_in_memory_with_a_warning(
        tmp_path: Any, caplog: Any) -> None:
    gone = str(tmp_path / "no-such-folder")
    with caplog.at_level(logging.WARNING, logger="msd_dask.roles.kept_work"):
        kept = KeptWork(7, PARTS, gone, spill_from=0)
    assert kept.path is None and [kept.part(i) for i in range(4)] == PARTS
    assert "step 7's work (1017 bytes) kept in memory" in caplog.text and gone in caplog.text


def test_a_directory_that_fails_is_warned_of_once_until_a_write_succeeds(
        tmp_path: Any, caplog: Any) -> None:
    """The worker's local directory removed under the planner: every large step warned
    (at 128K one line every 2 s for the rest of the run; a review)."""
    gone = tmp_path / "local"
    with caplog.at_level(logging.WARNING, logger="msd_dask.roles.kept_work"):
        for step in range(3):
            KeptWork(step, PARTS, str(gone), spill_from=0)
        assert caplog.text.count("kept in memory") == 1
        gone.mkdir()
        written = KeptWork(3, PARTS, str(gone), spill_from=0)
        assert written.path is not None
        written.close()
        gone.rmdir()
        KeptWork(4, PARTS, str(gone), spill_from=0)
    assert caplog.text.count("kept in memory") == 2  # (written again in between)


def test_parts_reads_every_part_back(tmp_path: Any) -> None:
    assert KeptWork(5, PARTS, str(tmp_path), spill_from=0).parts() == PARTS
    assert KeptWork(5, PARTS, None).parts() == PARTS


def test_a_file_removed_under_it_is_named_when_read(tmp_path: Any) -> None:
    kept = KeptWork(9, PARTS, str(tmp_path), spill_from=0)
    assert kept.path is not None
    os.remove(kept.path)
    with pytest.raises(OSError, match=r"step 9's work, kept in .*msd-kept-step-9-.*constructor 2"):
        kept.part(2)
    kept.close()  # (a file gone already is no error)


def test_a_file_cut_short_is_named_when_read(tmp_path: Any) -> None:
    kept = KeptWork(9, PARTS, str(tmp_path), spill_from=0)
    assert kept.path is not None
    os.truncate(kept.path, 500)
    assert kept.part(0) == PARTS[0]
    with pytest.raises(OSError, match="cut short: constructor 2's part ends at byte 1010, "
                                      "the file at 500"):
        kept.part(2)


def test_no_local_directory_outside_a_worker() -> None:
    assert local_directory() is None
