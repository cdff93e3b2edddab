"""Token-share mixing across sources (pure, no Dask).

A credit scheme (smooth weighted round robin over tokens): every time ``n``
tokens are taken from source ``s``, each source ``t`` earns ``w_t · n`` credit
and ``s`` pays ``n``.  The next piece comes from the source with the most
credit.  Credits always sum to zero and stay bounded (within about the number
of sources times the longest piece), so over any window of steps the
delivered token shares follow the weights in force, including weights that
change with a schedule or a live re-mix.

:meth:`msd_dask.core.plan.Planner._draw` applies the same rule inline, on plain
lists, for speed (a step draws up to millions of pieces): a change to the rule
here must be made there too (``tests/test_plan_golden.py`` pins the planner's
decisions, ``tests/test_mixing.py`` this reference).
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
        self.credit = {s: 0.0 for s in self.sources}

    def choose(self, weights: Mapping[str, float]) -> str:
        """The source with the most credit among those with a positive weight."""
        best = None
        for s in self.sources:
            if weights.get(s, 0.0) > 0 and (best is None or self.credit[s] > self.credit[best]):
                best = s
        if best is None:
            raise ValueError("every source weight is 0")
        return best

    def take(self, source: str, tokens: int, weights: Mapping[str, float]) -> None:
        """Record that ``tokens`` tokens were taken from ``source``."""
        for s in self.sources:
            self.credit[s] += weights.get(s, 0.0) * tokens
        self.credit[source] -= tokens

    def state_dict(self) -> dict[str, float]:
        return dict(self.credit)

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        self.credit = {s: float(state.get(s, 0.0)) for s in self.sources}
