"""The batch a training rank receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Batch"]


@dataclass
class Batch:
    """One rank's data for one step.

    Attributes
    ----------
    step : int
        The global step.
    rank : int
        The global rank it was built for.
    input_ids, labels, position_ids : torch.Tensor
        ``torch.long``, shape ``[micro_batches, seq_len]``.  Labels are the next
        token inside the same document, ``-100`` at a document's last token and
        on padding; position ids restart at 0 for every piece.
    cu_seqlens : list of torch.Tensor
        One int32 tensor per micro-batch: piece boundaries from 0 to the used length.
    documents : list of list of tuple
        For every micro-batch, ``(source, key, chunk)`` of each cu_seqlens
        segment; ``key`` is ``"<path relative to the source root>:<row>"``.
    cost : float
        The rank's cost under the configured cost model.
    epochs : list of list of int
        The source epoch of each document in ``documents``.
    """

    step: int
    rank: int
    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: list[torch.Tensor]
    documents: list[list[tuple[str, str, int]]]
    cost: float
    epochs: list[list[int]]

    @classmethod
    def from_payload(cls, payload: dict[str, Any], rank: int) -> Batch:
        """Build from what a constructor's ``claim`` returns."""
        return cls(
            step=int(payload["step"]),
            rank=rank,
            input_ids=torch.from_numpy(np.ascontiguousarray(payload["input_ids"])),
            labels=torch.from_numpy(np.ascontiguousarray(payload["labels"])),
            position_ids=torch.from_numpy(np.ascontiguousarray(payload["position_ids"])),
            cu_seqlens=[torch.from_numpy(np.asarray(c, dtype=np.int32)) for c in payload["cu_seqlens"]],
            documents=[[(str(s), str(k), int(c)) for s, k, c in row] for row in payload["documents"]],
            cost=float(payload["cost"]),
            epochs=[[int(e) for e in row] for row in payload["epochs"]],
        )

    @property
    def num_tokens(self) -> int:
        """Tokens that are not padding."""
        return int(sum(int(c[-1]) for c in self.cu_seqlens))
