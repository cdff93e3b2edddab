"""pack_rows: input ids, labels, position ids and cu_seqlens of hand-built rows."""

from __future__ import annotations

import numpy as np
import pytest

from msd_dask.core.packing import IGNORE_INDEX, pack_rows
from msd_dask.sources.tokenizer import EOD, PAD

I = IGNORE_INDEX  # noqa: E741


def arr(*xs: int) -> np.ndarray:
    return np.asarray(xs, dtype=np.int32)


def test_hand_built_rows() -> None:
    rows = [
        [
            (arr(10, 11, 12, EOD), 4),       # a whole document (ends with EOD)
            (arr(20, 21, 22, 23), 3),        # a chunk whose document continues with 23
        ],
        [
            (arr(30, 31, 32, 33, 34, 35), 5),  # continues with 35
            (arr(40, EOD), 2),
            (arr(50), 1),                      # the last chunk of a document: one token
        ],
        [],                                    # an empty row: all padding
    ]
    out = pack_rows(rows, seq_len=10, pad_id=PAD)
    ids, labels, pos, cu = (out["input_ids"], out["labels"], out["position_ids"],
                            out["cu_seqlens"])
    P = PAD
    assert ids.shape == labels.shape == pos.shape == (3, 10)
    assert ids.dtype == labels.dtype == pos.dtype == np.int32  # half the bytes to a reader

    assert ids[0].tolist() == [10, 11, 12, EOD, 20, 21, 22, P, P, P]
    assert labels[0].tolist() == [11, 12, EOD, I, 21, 22, 23, I, I, I]
    assert pos[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 0, 0]
    assert cu[0].tolist() == [0, 4, 7]

    assert ids[1].tolist() == [30, 31, 32, 33, 34, 40, EOD, 50, P, P]
    assert labels[1].tolist() == [31, 32, 33, 34, 35, EOD, I, I, I, I]
    assert pos[1].tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 0, 0]
    assert cu[1].tolist() == [0, 5, 7, 8]

    assert ids[2].tolist() == [P] * 10
    assert labels[2].tolist() == [I] * 10
    assert pos[2].tolist() == [0] * 10
    assert cu[2].tolist() == [0]

    assert len(cu) == 3
    assert all(c.dtype == np.int32 for c in cu)


def test_labels_never_cross_pieces() -> None:
    # Two whole documents back to back: the first's last label is -100, not 7.
    out = pack_rows([[(arr(1, 2, 3), 3), (arr(7, 8), 2)]], seq_len=5, pad_id=PAD)
    assert out["labels"][0].tolist() == [2, 3, I, 8, I]
    assert out["cu_seqlens"][0].tolist() == [0, 3, 5]  # a full row ends at seq_len


def test_row_exactly_full_with_continuation() -> None:
    out = pack_rows([[(arr(5, 6, 7, 8, 9), 4)]], seq_len=4, pad_id=0)
    assert out["input_ids"][0].tolist() == [5, 6, 7, 8]
    assert out["labels"][0].tolist() == [6, 7, 8, 9]
    assert out["position_ids"][0].tolist() == [0, 1, 2, 3]
    assert out["cu_seqlens"][0].tolist() == [0, 4]


def test_pad_id_is_used() -> None:
    out = pack_rows([[(arr(1, 2), 2)]], seq_len=4, pad_id=999)
    assert out["input_ids"][0].tolist() == [1, 2, 999, 999]
    assert out["labels"][0].tolist() == [2, I, I, I]


def test_overflow_raises() -> None:
    # (the piece and the numbers named: it said only "row 0 overflows seq_len 4"; a review)
    with pytest.raises(ValueError, match=r"row 0, piece 1: 2 tokens after 3 overflow seq_len 4"):
        pack_rows([[(arr(1, 2, 3), 3), (arr(4, 5), 2)]], seq_len=4, pad_id=PAD)
    with pytest.raises(ValueError, match=r"row 1, piece 0: 5 tokens after 0 overflow seq_len 4"):
        pack_rows([[], [(arr(1, 2, 3, 4, 5), 5)]], seq_len=4, pad_id=PAD)
    # (a negative length overwrote the piece before it, cu_seqlens going back; a review)
    with pytest.raises(ValueError, match=r"row 0, piece 1: a piece of -1 tokens"):
        pack_rows([[(arr(1, 2), 2), (arr(), -1), (arr(3), 1)]], seq_len=8, pad_id=PAD)


def test_wrong_number_of_tokens_raises() -> None:
    with pytest.raises(ValueError):
        pack_rows([[(arr(1, 2, 3, 4), 2)]], seq_len=8, pad_id=PAD)
    with pytest.raises(ValueError):
        pack_rows([[(arr(1), 2)]], seq_len=8, pad_id=PAD)


def test_no_rows() -> None:
    out = pack_rows([], seq_len=8, pad_id=PAD)
    assert out["input_ids"].shape == (0, 8)
    assert out["cu_seqlens"] == []


def test_join_split_pieces_round_trip_with_image_pieces():
    from msd_dask.core.packing import join_pieces, split_pieces

    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 60000, n).astype(np.uint16) for n in (5, 1, 0, 9)]
    pieces.insert(2, (np.arange(4, dtype=np.uint16), rng.random((3, 6)).astype(np.float32)))
    joined = join_pieces(pieces)
    assert joined[0].ndim == 1 and len(joined[1]) == len(pieces) + 1  # one array of tokens
    back = split_pieces(joined)
    assert len(back) == len(pieces)
    for a, b in zip(pieces, back, strict=True):
        if isinstance(a, tuple):
            assert isinstance(b, tuple)
            np.testing.assert_array_equal(a[0], b[0])
            np.testing.assert_array_equal(a[1], b[1])
        else:
            np.testing.assert_array_equal(a, b)
    assert split_pieces(join_pieces([])) == []


@pytest.mark.parametrize("cp, pp_rank", [(1, 0), (2, 0), (1, 1), (2, 2)])
def test_wire_form_round_trip_of_every_rank_view(cp, pp_rank):
    from msd_dask.core.mesh import view_for_rank
    from msd_dask.core.packing import from_wire, to_wire

    rng = np.random.default_rng(1)
    rows = [[(rng.integers(0, 500, n + 1).astype(np.uint16), n) for n in (5, 9, 2)],
            [(rng.integers(0, 500, 7).astype(np.uint16), 7)]]
    batch = pack_rows(rows, 24, 0)
    batch.update(step=4, dp=1, documents=[[("s", "f:0", 0)]] * 2, epochs=[[0], [0]], cost=2.0)
    view = view_for_rank(batch, cp - 1, cp, pp_rank, 3)
    wire = to_wire(view)
    assert sum(isinstance(v, np.ndarray) for v in wire.values()) == 1  # one array on the wire
    back = from_wire(wire)
    assert set(back) == set(view) | {"cp_index"}
    for k, v in view.items():
        if k == "cu_seqlens" and v is not None:
            assert len(back[k]) == len(v)
            for a, b in zip(v, back[k], strict=True):
                np.testing.assert_array_equal(a, b)
        elif isinstance(v, np.ndarray):
            np.testing.assert_array_equal(v, back[k])
            assert back[k].shape == v.shape
        else:
            assert back[k] == v, k


def test_a_batch_holds_nothing_of_its_wire_array():
    """A batch's cu_seqlens were views of the wire form's one int32 array (input ids, labels
    and position ids together), which they kept alive as long as the batch: three rows'
    worth of ints a micro-batch (a review of the build path).  The wire array may be
    reused or freed once the batch is built."""
    from msd_dask.batch import Batch
    from msd_dask.core.packing import from_wire, to_wire

    rng = np.random.default_rng(2)
    rows = [[(rng.integers(0, 500, n + 1).astype(np.uint16), n) for n in (5, 9)],
            [(rng.integers(0, 500, 7).astype(np.uint16), 7)]]
    batch = pack_rows(rows, 24, 0)
    batch.update(step=4, dp=0, documents=[[("s", "f:0", 0)]] * 2, epochs=[[0], [0]], cost=2.0)
    wire = to_wire(batch)
    built = Batch.from_payload(from_wire(wire), 0)
    before = [c.clone() for c in built.cu_seqlens]
    wire["ints"][:] = -7  # (reused by whoever owned it)
    for c, was in zip(built.cu_seqlens, before, strict=True):
        assert (c == was).all() and not np.shares_memory(c.numpy(), wire["ints"])
    assert (built.input_ids != -7).all() and (built.labels != -7).all()


@pytest.mark.parametrize("key, value", [("input_ids", 2**31), ("labels", -(2**31) - 1),
                                        ("position_ids", 2**40)])
def test_wire_form_rejects_values_outside_int32(key, value):
    from msd_dask.core.packing import to_wire

    batch = pack_rows([[(np.arange(5, dtype=np.uint16), 5)]], 8, 0)
    a = batch[key].astype(np.int64)
    a[0, 1] = value
    batch[key] = a
    with pytest.raises(ValueError, match=rf"{key} holds {value}, outside int32"):
        to_wire(batch)


def test_wire_form_rejects_cu_seqlens_outside_int32_and_keeps_int64_that_fits():
    from msd_dask.core.packing import from_wire, to_wire

    batch = pack_rows([[(np.arange(5, dtype=np.uint16), 5)]], 8, 0)
    batch["input_ids"] = batch["input_ids"].astype(np.int64)  # fits: cast, same values
    np.testing.assert_array_equal(from_wire(to_wire(batch))["input_ids"], batch["input_ids"])
    batch["cu_seqlens"] = [np.array([0, 2**33], dtype=np.int64)]
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] holds 8589934592"):
        to_wire(batch)
    batch["cu_seqlens"] = [np.array([0.0, 5.0])]
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\] has dtype float64, not integers"):
        to_wire(batch)


def test_an_empty_piece_first_in_a_row_packs() -> None:
    """A piece of no tokens first in a row made its labels' slice ``0:-1`` and raised; later
    in a row it packed (a review; the planner makes none today)."""
    packed = pack_rows([[(np.zeros(0, dtype=np.int32), 0), (np.array([5, 6, 7]), 2)]], 4, 0)
    assert packed["input_ids"][0].tolist() == [5, 6, 0, 0]
    assert packed["labels"][0].tolist() == [6, 7, -100, -100]


def test_a_piece_that_cannot_be_packed_says_its_row_and_place() -> None:
    """The constructor names the piece's document from them (a review: "piece of 3 tokens
    given 2 token ids" named none)."""
    from msd_dask.core.packing import PieceError

    with pytest.raises(PieceError, match=r"row 1, piece 1: a piece of 3 tokens given 2") as e:
        pack_rows([[(np.arange(3), 2)], [(np.arange(2), 1), (np.arange(2), 3)]], 8, 0)
    assert (e.value.row, e.value.piece) == (1, 1)
