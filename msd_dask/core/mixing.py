"""Token-share mixing across sources (pure, no Dask).

A credit scheme (smooth weighted round robin over tokens): every time ``n``
tokens are taken from source ``s``, each source ``t`` earns ``w_t · n`` credit
and ``s`` pays ``n``.  The next piece comes from the source with the most
credit.  Credits always sum to zero and stay bounded (within about the number
of sources times the longest piece), so over any window of steps the
delivered token shares follow the weights in force, including weights that
change with a schedule or a live re-mix.  A source kept below its share by
something other than the mix (a layout's cap on its pieces per step) would
gather credit without bound: the caller forgives it (:meth:`Mixer.forgive`).

:meth:`Mixer.draw` is the one implementation of the rule: it draws a run of
pieces from per-source length arrays (the planner draws up to millions of
pieces a step through it), and :meth:`Mixer.choose` and :meth:`Mixer.take`,
one piece at a time, are draws too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from msd_dask.core._kernels import mix_draw

__all__ = ["Mixer"]

#: no held keys (the default ``held`` of :meth:`Mixer.draw`)
_NONE = np.zeros(0, dtype=np.int64)


class Mixer:
    """Chooses the source of the next piece.

    Parameters
    ----------
    sources : sequence of str
        Source names, in config order (ties go to the earlier source).
    """

    def __init__(self, sources: Sequence[str]):
        self.sources = list(sources)
        #: each source's credit, in the order of :attr:`sources`
        self.credits = np.zeros(len(self.sources), dtype=np.float64)

    @property
    def credit(self) -> dict[str, float]:
        """Each source's credit, by name (a copy)."""
        return dict(zip(self.sources, self.credits.tolist(), strict=True))

    def draw(self, weights: np.ndarray, eligible: np.ndarray, lengths: np.ndarray, base: np.ndarray,
             offset: np.ndarray, end: np.ndarray, limit: np.ndarray, room: int, out: np.ndarray,
             n_out: int, tags: np.ndarray, first: int = -1, hold: int = 0,
             held: np.ndarray = _NONE, n_held: int = 0,
             hold_room: int = 0) -> tuple[int, int, np.ndarray, int, np.ndarray, int]:
        """Draw pieces while the chosen source's next piece is an ordinary one.

        ``weights`` sum to 1 (the credits balance only then; :meth:`choose` and
        :meth:`take` scale any weights to that, the planner passes its weights in force,
        which do).  Sources are indices into :attr:`sources`; every argument but ``room``,
        ``n_out``, ``first`` and the hold's is an array with an entry per
        source, but ``lengths`` (the pieces' lengths of all sources: source
        ``src``'s ``o``-th piece is ``lengths[base[src] + o]``) and ``out``.
        Each turn the eligible source with the most credit is chosen (ties: the
        first); its next piece is the one at ``offset[src]``.  A piece of ``n``
        tokens with ``offset[src] < end[src]``, ``n < limit[src]`` and
        ``n <= room`` is taken: ``tags[src] | offset[src]`` is stored at
        ``out[n_out]``, ``n_out`` grows by one, ``room`` shrinks by ``n``,
        ``offset[src]`` advances, and every source ``t`` earns
        ``weights[t] · n`` credit while ``src`` pays ``n``.  With ``hold > 0``
        a piece of at least ``hold`` tokens is held instead, while
        ``hold_room`` (how many more may be held) allows: its key goes to
        ``held[n_held]``, and it is consumed and charged like a piece taken,
        but not counted against ``room``; once the hold is full such a piece
        makes its source ineligible (``eligible[src] = False``) and the turn
        goes on.  Any other piece ends the draw, untaken, for the caller to
        decide on.

        ``first`` (a source; ``-1``: none) is the source of a piece the caller
        took itself, the one the last draw ended on: its next piece is consumed
        and charged before the first turn, but neither stored nor counted
        against ``room``.  ``eligible`` is read every turn, so a caller may
        change it between draws.  ``offset`` changes in place.  The loop is
        compiled (:func:`msd_dask.core._kernels.mix_draw`).

        Returns
        -------
        src, room : int
            The source whose piece ended the draw (``-1``: no source is
            eligible) and the room left.
        out, n_out, held, n_held : ndarray, int, ndarray, int
            The keys taken (held) so far, in ``out[:n_out]`` (``held[:n_held]``):
            the arrays given, or larger copies of them where they were full.
        """
        src, room, out, n_out, held, n_held = mix_draw(
            self.credits, weights, eligible, lengths, base, offset, end, limit, room, out, n_out, tags,
            first, hold, held, n_held, hold_room)
        return int(src), int(room), out, int(n_out), held, int(n_held)

    def choose(self, weights: Mapping[str, float]) -> str:
        """The source with the most credit among those with a positive weight."""
        w = self._weights(weights)
        zero = np.zeros(len(w), dtype=np.int64)
        src, *_ = self.draw(w, w > 0, zero, zero, zero, zero, zero, 0, zero, 0, zero)
        if src < 0:
            raise ValueError("every source weight is 0")
        return self.sources[src]

    def take(self, source: str, tokens: int, weights: Mapping[str, float]) -> None:
        """Record that ``tokens`` tokens were taken from ``source``.

        A draw that consumes only the ``first`` piece, of ``tokens`` tokens.
        """
        k = len(self.sources)
        zero = np.zeros(k, dtype=np.int64)
        self.draw(self._weights(weights), np.zeros(k, dtype=bool), np.full(k, tokens, dtype=np.int64),
                  np.arange(k, dtype=np.int64), zero.copy(), zero + 1, zero, 0, zero, 0, zero,
                  first=self.sources.index(source))

    def _weights(self, weights: Mapping[str, float]) -> np.ndarray:
        """``weights`` in source order, scaled to sum to 1 (weights need not sum to 1; the
        credits balance only for weights that do).  ``ValueError`` naming the source for a
        name the mixer does not have, and a weight that is negative or not finite (NaN
        was passed over, -1 read as 0, inf said every weight was 0; a review)."""
        for name, weight in weights.items():
            if name not in self.sources:
                raise ValueError(f"weights: no source {name!r} (the mixer's sources are "
                                 f"{list(self.sources)})")
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"weights: source {name!r} has weight {weight!r}; expected a "
                                 "finite number >= 0")
        w = np.array([weights.get(s, 0.0) for s in self.sources], dtype=np.float64)
        total = float(w.sum())
        return w / total if total > 0 else w

    def forgive(self, capped: np.ndarray, weights: np.ndarray, bound: float) -> None:
        """Forgive the credit above ``bound`` of the sources ``capped`` (a mask in source
        order): sources something other than the mix keeps from their share (a layout's
        cap on their pieces per step).  Their credit would grow with every step
        otherwise, and once the cap no longer binds (a live re-mix lowers their weight)
        they would take that backlog first, for as many steps as it took to build.  The
        others pay the forgiven credit back in proportion to ``weights`` (equally where
        those are 0), so the credits still sum to zero."""
        excess = np.where(capped, np.maximum(self.credits - bound, 0.0), 0.0)
        total = float(excess.sum())
        others = ~capped
        if total <= 0 or not others.any():
            return
        share = np.where(others, weights, 0.0)
        if share.sum() <= 0:
            share = others.astype(np.float64)
        self.credits -= excess
        self.credits += total * share / share.sum()

    def state_dict(self) -> dict[str, float]:
        return self.credit

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.credits = np.array([float(state.get(s, 0.0)) for s in self.sources], dtype=np.float64)
