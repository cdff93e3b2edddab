"""Packing planned pieces into fixed-size rows (pure, no Dask).

A row holds whole pieces back to back, then padding.  Labels are the next
token inside the same document (so a chunk's last label is the first token of
the document's next chunk), ``-100`` at a document's last token and on padding;
position ids restart at 0 for every piece; ``cu_seqlens`` lists the piece
boundaries varlen-attention style, from 0 to the used length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["pack_rows", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def pack_rows(rows: Sequence[Sequence[tuple[np.ndarray, int]]], seq_len: int,
              pad_id: int) -> dict[str, object]:
    """Pack rows of pieces.

    Parameters
    ----------
    rows : sequence of sequence of (tokens, n)
        For every row, its pieces in order: ``tokens`` holds the piece's ``n``
        tokens, plus one more when the document continues after the piece (the
        label of the piece's last token).
    seq_len : int
        Row length.
    pad_id : int
        Token id used for padding.

    Returns
    -------
    dict
        ``input_ids``, ``labels``, ``position_ids`` (int64 arrays of shape
        ``[len(rows), seq_len]``) and ``cu_seqlens`` (a list of int32 arrays).
    """
    mb = len(rows)
    input_ids = np.full((mb, seq_len), pad_id, dtype=np.int64)
    labels = np.full((mb, seq_len), IGNORE_INDEX, dtype=np.int64)
    position_ids = np.zeros((mb, seq_len), dtype=np.int64)
    cu: list[np.ndarray] = []
    for m, pieces in enumerate(rows):
        bounds = [0]
        pos = 0
        for tokens, n in pieces:
            if pos + n > seq_len:
                raise ValueError(f"row {m} overflows seq_len {seq_len}")
            if len(tokens) not in (n, n + 1):
                raise ValueError(f"piece of {n} tokens given {len(tokens)} token ids")
            input_ids[m, pos:pos + n] = tokens[:n]
            labels[m, pos:pos + len(tokens) - 1] = tokens[1:]
            position_ids[m, pos:pos + n] = np.arange(n)
            pos += n
            bounds.append(pos)
        cu.append(np.asarray(bounds, dtype=np.int32))
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids,
            "cu_seqlens": cu}
