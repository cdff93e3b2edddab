"""Packing planned pieces into fixed-size rows (pure, no Dask).

A row holds whole pieces back to back, then padding.  Labels are the next
token inside the same document (so a chunk's last label is the first token of
the document's next chunk), ``-100`` at a document's last token and on padding;
position ids restart at 0 for every piece; ``cu_seqlens`` lists the piece
boundaries varlen-attention style, from 0 to the used length.

A piece of an image+text document comes as ``(tokens, patches)`` instead of
``tokens``: its first ``len(patches)`` tokens are image tokens, one per patch.
The packed batch then also holds ``pixel_values`` (the patches of all rows,
in row order, segment order) and ``image_spans`` (per row and segment,
``(first patch, patches)`` or ``None``), and labels are ``-100`` wherever the
next token is an image token (nothing learns to predict image placeholders).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["pack_rows", "PieceError", "join_pieces", "split_pieces", "to_wire", "from_wire",
           "IGNORE_INDEX"]

IGNORE_INDEX = -100

#: pieces as one message: every piece's tokens back to back, the offsets of each piece
#: (``len(pieces) + 1``) and the patches of the image+text pieces by index
JoinedPieces = tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]


def join_pieces(pieces: Sequence[Any]) -> JoinedPieces:
    """Pieces (token arrays, or ``(tokens, patches)`` pairs) as three objects.

    A loader sends a constructor one array instead of one per piece: each
    array of a message is a frame of its own, and a Dask message's CPU cost
    grows with its frames more than with its bytes, so a fetch costs a few
    frames whatever its number of pieces.  :func:`split_pieces` gives the
    pieces back (views).
    """
    images: dict[int, np.ndarray] = {}
    tokens = []
    for i, p in enumerate(pieces):
        if isinstance(p, tuple):
            p, images[i] = p
        tokens.append(p)
    offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    flat = np.concatenate(tokens) if tokens else np.zeros(0, dtype=np.int32)
    return flat, offsets, images


def split_pieces(joined: JoinedPieces) -> list[Any]:
    """The pieces :func:`join_pieces` joined, in order (views of its array)."""
    flat, offsets, images = joined
    out: list[Any] = []
    for i in range(len(offsets) - 1):
        t = flat[int(offsets[i]):int(offsets[i + 1])]
        out.append((t, images[i]) if i in images else t)
    return out


#: the integer arrays of a batch, sent to a reader as one int32 array (:func:`to_wire`)
_WIRE_INTS = ("input_ids", "labels", "position_ids", "cp_index")


def to_wire(batch: dict[str, Any]) -> dict[str, Any]:
    """A packed batch (:func:`pack_rows`, a rank's view of it) with its integer arrays
    in one int32 array, for the way to a reader.

    Each array of a Dask message is a frame of its own, and each frame costs
    CPU at both ends whatever its size, so the integer arrays travel as one
    frame.  :func:`from_wire` undoes it (views).

    Raises
    ------
    ValueError
        If an integer array holds a value outside int32 (named with the array), or
        is not of an integer dtype.
    """
    parts: list[np.ndarray] = []
    layout: list[tuple[str, tuple[int, ...]]] = []
    for k in _WIRE_INTS:
        a = batch.get(k)
        if a is not None:
            a = np.asarray(a)
            parts.append(_as_int32(a, k).ravel())
            layout.append((k, a.shape))
    cu = batch.get("cu_seqlens")
    if cu is not None:
        parts.extend(_as_int32(np.asarray(c), f"cu_seqlens[{i}]") for i, c in enumerate(cu))
        layout.extend(("cu_seqlens", (len(c),)) for c in cu)
    out = {k: v for k, v in batch.items() if k not in _WIRE_INTS and k != "cu_seqlens"}
    out["ints"] = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    out["layout"] = layout
    out["cu_rows"] = None if cu is None else len(cu)
    return out


def _as_int32(a: np.ndarray, name: str) -> np.ndarray:
    """``a`` as int32 (no copy if it is already); ``ValueError`` naming ``name`` and the
    value if a value does not fit (a cast would wrap it around silently)."""
    if a.dtype == np.int32:
        return a
    if a.dtype.kind not in "iub":
        raise ValueError(f"to_wire: {name} has dtype {a.dtype}, not integers")
    if a.size and not np.can_cast(a.dtype, np.int32):
        info = np.iinfo(np.int32)
        lo, hi = a.min(), a.max()
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise ValueError(f"to_wire: {name} holds {int(bad)}, outside int32 "
                             f"[{info.min}, {info.max}]")
    return a.astype(np.int32, copy=False)


def from_wire(wire: dict[str, Any]) -> dict[str, Any]:
    """The batch :func:`to_wire` packed (arrays are views of its int32 array)."""
    out = {k: v for k, v in wire.items() if k not in ("ints", "layout", "cu_rows")}
    flat = wire["ints"]
    out.update({k: None for k in _WIRE_INTS})
    cu: list[np.ndarray] = []
    pos = 0
    for k, shape in wire["layout"]:
        n = int(np.prod(shape)) if shape else 1
        a = flat[pos:pos + n].reshape(shape)
        pos += n
        if k == "cu_seqlens":
            cu.append(a)
        else:
            out[k] = a
    out["cu_seqlens"] = None if wire["cu_rows"] is None else cu
    return out


class PieceError(ValueError):
    """A piece :func:`pack_rows` cannot pack: ``row`` and ``piece`` say which."""

    def __init__(self, row: int, piece: int, message: str):
        super().__init__(message)
        self.row, self.piece = row, piece


def pack_rows(rows: Sequence[Sequence[tuple[Any, int]]], seq_len: int,
              pad_id: int) -> dict[str, object]:
    """Pack rows of pieces.

    Parameters
    ----------
    rows : sequence of sequence of (tokens, n)
        For every row, its pieces in order: ``tokens`` holds the piece's ``n``
        tokens, plus one more when the document continues after the piece (the
        label of the piece's last token).  For a piece of an image+text document
        ``tokens`` is a pair ``(tokens, patches)``: ``patches`` (``[k, d]``) stand
        for the piece's first ``k`` tokens.
    seq_len : int
        Row length.
    pad_id : int
        Token id used for padding.

    Returns
    -------
    dict
        ``input_ids``, ``labels``, ``position_ids`` (int32 arrays of shape
        ``[len(rows), seq_len]``: half the bytes of int64 on the way to a reader;
        :class:`~msd_dask.Batch` hands them to torch as int64), ``cu_seqlens`` (a
        list of int32 arrays),
        ``pixel_values`` (``[patches, d]``, the patches of every row in order) and
        ``image_spans`` (for every row, ``(first patch, patches)`` of each piece or
        ``None`` for a text piece); both ``None`` when no piece has an image.
    """
    mb = len(rows)
    input_ids = np.full((mb, seq_len), pad_id, dtype=np.int32)
    labels = np.full((mb, seq_len), IGNORE_INDEX, dtype=np.int32)
    position_ids = np.zeros((mb, seq_len), dtype=np.int32)
    cu: list[np.ndarray] = []
    patches: list[np.ndarray] = []
    spans: list[list[tuple[int, int] | None]] = []
    n_patches = 0
    for m, pieces in enumerate(rows):
        bounds = [0]
        pos = 0
        row_spans: list[tuple[int, int] | None] = []
        for j, (tokens, n) in enumerate(pieces):
            image = None
            if isinstance(tokens, tuple):
                tokens, image = tokens
            if n < 0:  # (it overwrote the tokens before it, cu_seqlens going back; a review)
                raise PieceError(m, j, f"row {m}, piece {j}: a piece of {n} tokens (a length "
                                       "is >= 0)")
            if pos + n > seq_len:
                raise PieceError(m, j, f"row {m}, piece {j}: {n} tokens after {pos} overflow "
                                       f"seq_len {seq_len}")
            if len(tokens) not in (n, n + 1):
                raise PieceError(m, j, f"row {m}, piece {j}: a piece of {n} tokens given "
                                       f"{len(tokens)} token ids")
            input_ids[m, pos:pos + n] = tokens[:n]
            # (max: an empty piece first in a row made the slice 0:-1, and raised)
            labels[m, pos:pos + max(len(tokens) - 1, 0)] = tokens[1:]
            position_ids[m, pos:pos + n] = np.arange(n)
            if image is not None and len(image):
                k = len(image)
                if k > n:
                    raise PieceError(m, j, f"row {m}, piece {j}: a piece of {n} tokens given "
                                           f"{k} image patches")
                labels[m, pos:pos + k - 1] = IGNORE_INDEX  # the next token is an image token
                patches.append(image)
                row_spans.append((n_patches, k))
                n_patches += k
            else:
                row_spans.append(None)
            pos += n
            bounds.append(pos)
        cu.append(np.asarray(bounds, dtype=np.int32))
        spans.append(row_spans)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "cu_seqlens": cu,
            "pixel_values": np.concatenate(patches) if patches else None,
            "image_spans": spans if patches else None}
