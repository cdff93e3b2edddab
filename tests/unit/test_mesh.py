"""Members of a DP group: identical (tp) or complementary (cp) tensors, stage-specific (pp)."""

from __future__ import annotations

import numpy as np
import pytest

from msd_dask.core.mesh import cp_indices, view_for_rank
from msd_dask.core.packing import pack_rows


def batch(seq_len=16, mb=2):
    rng = np.random.default_rng(0)
    rows = [[(rng.integers(0, 255, size=n + 1), n) for n in (5, 7)],
            [(rng.integers(0, 255, size=n), n) for n in (9, 4)]]
    b = pack_rows(rows[:mb], seq_len, 257)
    b.update(step=3, documents=[[("s", "k", 0)] * 2] * mb)
    return b


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_cp_slices_are_complementary_and_load_balanced(cp):
    b = batch()
    views = [view_for_rank(b, i, cp) for i in range(cp)]
    idx = np.concatenate([v.get("cp_index", np.arange(16)) for v in views])
    assert sorted(idx.tolist()) == list(range(16))  # disjoint and complete
    for k in ("input_ids", "labels", "position_ids"):
        full = np.empty_like(b[k])
        for v in views:
            full[:, v.get("cp_index", np.arange(16))] = v[k]
        np.testing.assert_array_equal(full, b[k])
    if cp > 1:
        c = 16 // (2 * cp)
        assert cp_indices(16, 0, cp).tolist() == list(range(c)) + list(range(16 - c, 16))
        # causal work per rank (sum of positions + 1) is equal across cp ranks
        work = [int((cp_indices(16, i, cp) + 1).sum()) for i in range(cp)]
        assert len(set(work)) == 1


def test_cp_needs_divisible_seq_len():
    with pytest.raises(ValueError, match="not divisible"):
        cp_indices(18, 0, 4)


def test_pp_stages_get_only_what_they_need():
    b = batch()
    first, mid, last = (view_for_rank(b, pp_rank=j, pp_size=3) for j in range(3))
    assert first["input_ids"] is not None and first["position_ids"] is not None
    assert first["labels"] is None and first["cu_seqlens"] is not None
    assert mid["input_ids"] is None and mid["labels"] is None
    # every stage runs attention layers: each gets the rows' document boundaries (middle
    # stages got None; a review)
    for stage in (first, mid, last):
        assert stage["cu_seqlens"] is b["cu_seqlens"]
    assert mid["documents"] == b["documents"] and mid["step"] == 3
    assert last["labels"] is not None and last["input_ids"] is None
    np.testing.assert_array_equal(last["labels"], b["labels"])
    only = view_for_rank(b)  # pp = 1: everything
    assert all(only[k] is not None for k in ("input_ids", "labels", "position_ids"))


def test_pp_only_the_first_stage_gets_pixel_values():
    b = batch()
    b["pixel_values"] = np.arange(2 * 12, dtype=np.uint8).reshape(2, 12)
    b["image_spans"] = [[(0, 2), None], [None, None]]
    first, mid, last = (view_for_rank(b, pp_rank=j, pp_size=3) for j in range(3))
    np.testing.assert_array_equal(first["pixel_values"], b["pixel_values"])
    assert mid["pixel_values"] is None and last["pixel_values"] is None
    assert last["image_spans"] == b["image_spans"]
    for i in range(2):  # every context-parallel rank gets the whole images
        np.testing.assert_array_equal(view_for_rank(b, i, 2)["pixel_values"], b["pixel_values"])


def test_a_rank_outside_the_mesh_is_refused() -> None:
    """cp_rank 2 of cp 2 was given rank 1's columns (a review)."""
    with pytest.raises(ValueError, match="cp_rank 2 is not a rank of cp 2"):
        cp_indices(8, 2, 2)
    with pytest.raises(ValueError, match="pp_rank 3 is not a stage of pp 3"):
        view_for_rank({"input_ids": np.zeros((1, 8))}, pp_rank=3, pp_size=3)
