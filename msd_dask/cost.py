"""The per-document cost model ``α·L + β·L²`` (pure, no Dask)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import CostConfig

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """Cost of a document of ``L`` tokens: ``linear·L + quadratic·L²``.

    ``linear`` stands for the dense layers (per-token work) and ``quadratic``
    for causal attention inside the document.
    """

    linear: float = 1.0
    quadratic: float = CostConfig.quadratic

    @classmethod
    def from_config(cls, cfg: CostConfig) -> CostModel:
        return cls(cfg.linear, cfg.quadratic)

    def __call__(self, lengths: np.ndarray | int) -> np.ndarray:
        L = np.asarray(lengths, dtype=np.float64)
        return self.linear * L + self.quadratic * L * L
