"""Token-share mixing across sources (pure, no Dask).

A credit scheme (smooth weighted round robin over tokens): every time ``n``
tokens are taken from source ``s``, each source ``t`` earns ``w_t · n`` credit
and ``s`` pays ``n``.  The next piece comes from the source with the most
credit.  Credits always sum to zero and stay bounded (within about the number
of sources times the longest piece), so over any window of steps the
delivered token shares follow the weights in force, including weights that
change with a schedule or a live re-mix.

:meth:`Mixer.draw` is the one implementation of the rule: it draws a run of
pieces from per-source length lists (the planner draws up to millions of
pieces a step through it), and :meth:`Mixer.choose` and :meth:`Mixer.take`,
one piece at a time, are draws too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["Mixer"]


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
        self.credits = [0.0] * len(self.sources)
        self._js = range(len(self.sources))
        self._two = len(self.sources) == 2

    @property
    def credit(self) -> dict[str, float]:
        """Each source's credit, by name (a copy)."""
        return dict(zip(self.sources, self.credits, strict=True))

    def draw(self, weights: Sequence[float], eligible: Sequence[bool], lengths: Sequence[Sequence[int]],
             offset: list[int], end: Sequence[int], limit: Sequence[int], room: int, out: list[int],
             tags: Sequence[int], first: int = -1) -> tuple[int, int]:
        """Draw pieces while the chosen source's next piece is an ordinary one.

        Sources are indices into :attr:`sources`.  Each turn the eligible
        source with the most credit is chosen (ties: the first); its next piece
        is ``lengths[src][offset[src]]``.  A piece of ``n`` tokens with
        ``offset[src] < end[src]``, ``n < limit[src]`` and ``n <= room`` is
        taken: ``tags[src] | offset[src]`` is appended to ``out``, ``room``
        shrinks by ``n``, ``offset[src]`` advances, and every source ``t``
        earns ``weights[t] · n`` credit while ``src`` pays ``n``.  Any other
        piece ends the draw, untaken, for the caller to decide on.

        ``first`` (a source; ``-1``: none) is the source of a piece the caller
        took itself, the one the last draw ended on: its next piece is consumed
        and charged before the first turn, but neither appended to ``out`` nor
        counted against ``room``.  ``eligible`` is read every turn, so a caller
        may change it between draws.

        Returns
        -------
        src, room : int
            The source whose piece ended the draw (``-1``: no source is
            eligible) and the room left.
        """
        credit = self.credits
        js = self._js
        two = self._two  # the common case, with the loops over sources written out
        if two:
            w0, w1 = weights
            c0, c1 = credit  # the credit while ``two``
        else:
            w0 = w1 = c0 = c1 = 0.0
        src = first
        while True:
            if src < 0:
                if two:
                    if eligible[1] and (not eligible[0] or c1 > c0):
                        src = 1
                    elif eligible[0]:
                        src = 0
                    else:
                        break
                else:
                    for j in js:
                        if eligible[j] and (src < 0 or credit[j] > credit[src]):
                            src = j
                    if src < 0:
                        break
                o = offset[src]
                if o >= end[src]:
                    break
                n = lengths[src][o]
                if n >= limit[src] or n > room:
                    break
                out.append(tags[src] | o)
                room -= n
            else:
                o = offset[src]
                n = lengths[src][o]
            offset[src] = o + 1
            if two:
                c0 += w0 * n
                c1 += w1 * n
                if src:
                    c1 -= n
                else:
                    c0 -= n
            else:
                for j in js:
                    credit[j] += weights[j] * n
                credit[src] -= n
            src = -1
        if two:
            credit[:] = c0, c1
        return src, room

    def choose(self, weights: Mapping[str, float]) -> str:
        """The source with the most credit among those with a positive weight."""
        w = self._weights(weights)
        k = len(w)
        src, _ = self.draw(w, [x > 0 for x in w], [[]] * k, [0] * k, [0] * k, [0] * k, 0, [], [0] * k)
        if src < 0:
            raise ValueError("every source weight is 0")
        return self.sources[src]

    def take(self, source: str, tokens: int, weights: Mapping[str, float]) -> None:
        """Record that ``tokens`` tokens were taken from ``source``.

        A draw that consumes only the ``first`` piece, of ``tokens`` tokens.
        """
        k = len(self.sources)
        self.draw(self._weights(weights), [False] * k, [[tokens]] * k, [0] * k, [1] * k, [0] * k, 0, [],
                  [0] * k, first=self.sources.index(source))

    def _weights(self, weights: Mapping[str, float]) -> list[float]:
        return [weights.get(s, 0.0) for s in self.sources]

    def state_dict(self) -> dict[str, float]:
        return self.credit

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.credits = [float(state.get(s, 0.0)) for s in self.sources]
