"""What each member of a DP group receives under tensor/context/pipeline parallelism (pure).

A DP group's batch is built once.  Its member ranks then receive:

* tensor-parallel peers: the same tensors;
* context-parallel rank ``i`` of ``cp``: the load-balanced causal split of
  every row — the row cut into ``2·cp`` equal chunks, of which rank ``i``
  gets chunks ``i`` and ``2·cp − 1 − i`` (so every rank holds an equal share
  of early and late, cheap and expensive, causal positions); ``cu_seqlens``
  stay those of the whole row and ``cp_index`` says which row positions the
  slice holds;
* pipeline stage ``j`` of ``pp``: the first stage needs ``input_ids``,
  ``position_ids`` and the images (``pixel_values``, whole on every
  context-parallel rank), the last stage ``labels``; every stage gets
  ``cu_seqlens`` (each runs attention layers, which must not attend across the
  row's documents) and the step's metadata.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["check_view", "cp_divides", "cp_indices", "view_for_rank"]

_TOKENS = ("input_ids", "labels", "position_ids")


def cp_divides(seq_len: int, cp_size: int) -> bool:
    """Whether ``cp_size`` context-parallel ranks can split rows of ``seq_len`` tokens:
    each takes two of ``2 · cp_size`` equal chunks (:func:`cp_indices`)."""
    return cp_size == 1 or seq_len % (2 * cp_size) == 0


def _check_cp(seq_len: int, cp_rank: int, cp_size: int) -> None:
    if not 0 <= cp_rank < cp_size:  # (rank cp_size was given rank cp_size - 1's columns)
        raise ValueError(f"cp_rank {cp_rank} is not a rank of cp {cp_size}")
    if not cp_divides(seq_len, cp_size):
        raise ValueError(f"seq_len {seq_len} is not divisible by 2·cp = {2 * cp_size}")


def check_view(seq_len: int, cp_rank: int = 0, cp_size: int = 1, pp_rank: int = 0,
               pp_size: int = 1) -> None:
    """A ``ValueError`` where a member's coordinates are no rank of the mesh, or rows of
    ``seq_len`` tokens cannot be split ``cp_size`` ways (what :func:`view_for_rank`
    refuses, before a caller hands anything over)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is not a stage of pp {pp_size}")
    _check_cp(seq_len, cp_rank, cp_size)


def cp_indices(seq_len: int, cp_rank: int, cp_size: int) -> np.ndarray:
    """Row positions held by context-parallel rank ``cp_rank`` of ``cp_size``."""
    _check_cp(seq_len, cp_rank, cp_size)
    if cp_size == 1:
        return np.arange(seq_len)
    c = seq_len // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return np.concatenate([np.arange(first * c, (first + 1) * c),
                           np.arange(second * c, (second + 1) * c)])


def view_for_rank(batch: dict[str, Any], cp_rank: int = 0, cp_size: int = 1, pp_rank: int = 0,
                  pp_size: int = 1) -> dict[str, Any]:
    """The part of a DP group's packed batch one member rank receives.

    Parameters
    ----------
    batch : dict
        ``input_ids``, ``labels``, ``position_ids`` (``[micro_batches, seq_len]``),
        ``cu_seqlens`` and metadata, as a constructor packs them.
    cp_rank, cp_size, pp_rank, pp_size : int
        The member's context- and pipeline-parallel coordinates.

    Returns
    -------
    dict
        A shallow copy: tensors a stage does not need are ``None``; with
        ``cp_size > 1`` token tensors are ``[micro_batches, seq_len / cp]`` and
        ``cp_index`` holds the row positions of the slice.
    """
    check_view(batch["input_ids"].shape[1], cp_rank, cp_size, pp_rank, pp_size)
    out = dict(batch)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    if cp_size > 1:
        idx = cp_indices(batch["input_ids"].shape[1], cp_rank, cp_size)
        for k in _TOKENS:
            out[k] = np.ascontiguousarray(batch[k][:, idx])
        out["cp_index"] = idx
    if not first:
        out["input_ids"] = out["position_ids"] = None
        if out.get("pixel_values") is not None:
            out["pixel_values"] = None
    if not last:
        out["labels"] = None
    # (cu_seqlens on every stage: middle stages got None, and their attention layers had
    # nothing to keep a row's documents apart by; a review)
    return out
