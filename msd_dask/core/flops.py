"""FLOP coefficients of a dense transformer (pure, no imports).

The rule behind ``cost: {model: {hidden_size: H, layers: N}}``: the config
(:mod:`msd_dask.core.config`) derives ``linear`` and ``quadratic`` with it, and
:meth:`msd_dask.core.cost.CostModel.from_transformer` builds a cost model from
it; its own module so that neither of those imports the other for it.
"""

from __future__ import annotations

__all__ = ["transformer_coefficients"]


def transformer_coefficients(hidden_size: int, layers: int) -> tuple[float, float]:
    """``(α, β)`` in forward FLOPs of a dense decoder-only transformer.

    Per layer and per document of ``L`` tokens:

    * dense layers (QKV and output projections, ``4·H²`` weights, and a
      ``4H``-wide MLP, ``8·H²`` weights: ``12·H²`` weights at 2 FLOPs per
      multiply-add) cost ``24·L·H²``;
    * causal attention (``Q·Kᵀ`` and ``softmax·V``, ``2·L²·H`` FLOPs each,
      half of it masked) costs ``2·L²·H``.

    So ``α = 24·N·H²`` and ``β = 2·N·H`` for ``N`` layers, and
    ``β / α = 1 / (12·H)``.  Training (forward and backward) is about three
    times the forward pass for both terms, which changes no balancing decision.
    Embeddings, the output layer and norms are linear in ``L`` and small next
    to ``24·N·H²``; they are left out.
    """
    if hidden_size <= 0 or layers <= 0:
        raise ValueError(f"hidden_size and layers must be > 0, got {hidden_size}, {layers}")
    return 24.0 * layers * hidden_size * hidden_size, 2.0 * layers * hidden_size
