"""Per-document cost models ``α·L + β·L²`` (pure, no Dask).

Three ways to get ``α`` (``linear``) and ``β`` (``quadratic``), chosen by the
``cost:`` section of the config:

``cost: {linear: α, quadratic: β}``
    Given outright (default ``α = 1``, ``β = 1 / (12·4096)``).
``cost: {model: {hidden_size: H, layers: N}}``
    Derived from a dense transformer's forward FLOPs, see
    :meth:`CostModel.from_transformer`.
``cost: {fit: true}``
    Learnt online from measured step times by :class:`CostFitter`, starting
    from the model the rest of the section gives.

Only the ratio ``β / α`` matters to balancing (:mod:`msd_dask.core.balance`), so
the units are free: tokens, FLOPs or seconds.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from msd_dask.core.config import MAX_PRIOR_WEIGHT, CostConfig
from msd_dask.core.flops import transformer_coefficients

__all__ = ["CostModel", "CostFitter", "transformer_coefficients"]

#: pieces :class:`CostModel` prices at a time
_COST_SLICE = 1 << 16


@dataclass(frozen=True)
class CostModel:
    """Cost of a document of ``L`` tokens: ``linear·L + quadratic·L²``.

    ``linear`` stands for the dense layers (per-token work) and ``quadratic``
    for causal attention inside the document.
    """

    linear: float = CostConfig.linear
    quadratic: float = CostConfig.quadratic

    @classmethod
    def from_config(cls, cfg: CostConfig) -> CostModel:
        """The configured model (with ``fit: true``, the fitter's starting model)."""
        return cls(cfg.linear, cfg.quadratic)

    @classmethod
    def from_transformer(cls, hidden_size: int, layers: int) -> CostModel:
        """Forward FLOPs per document, see :func:`transformer_coefficients`."""
        return cls(*transformer_coefficients(hidden_size, layers))

    def __call__(self, lengths: np.ndarray | int) -> np.ndarray:
        # linear·L + (quadratic·L)·L, bit for bit, in the result alone and a slice's
        # temporaries, where the plain expression makes four arrays of the pieces' size (a
        # step at dp 16,384 x 128K has millions of pieces: this is the planner's peak)
        given = np.asarray(lengths)
        flat = given.reshape(-1)
        out = np.empty(flat.shape, dtype=np.float64)
        for a in range(0, len(flat), _COST_SLICE):
            L = flat[a:a + _COST_SLICE].astype(np.float64)  # (a copy: never the caller's)
            part = out[a:a + _COST_SLICE]
            np.multiply(L, self.quadratic, out=part)
            part *= L
            L *= self.linear
            part += L
        return out[0] if given.ndim == 0 else out.reshape(given.shape)  # (a scalar's: a scalar)

    def total(self, lengths: np.ndarray | Sequence[np.ndarray]) -> float:
        """Cost of a rank holding these pieces (one array, or one per micro-batch)."""
        s1, s2 = _features(lengths)
        return self.linear * s1 + self.quadratic * s2


def _features(lengths: np.ndarray | Sequence[np.ndarray]) -> tuple[float, float]:
    """``(ΣL, ΣL²)`` of one rank's pieces, given as one array or a list of arrays."""
    if isinstance(lengths, np.ndarray):
        parts = [lengths]
    else:
        parts = [np.asarray(p) for p in lengths]
    s1 = s2 = 0.0
    for p in parts:
        f = np.asarray(p, dtype=np.float64).reshape(-1)
        s1 += float(f.sum())
        s2 += float((f * f).sum())
    return s1, s2


#: of the prior's pull, the share in every direction, in units of a normalised feature's
#: mean square: it decides only directions the observations never separate (every document
#: of one length: the prior's β/α is kept)
PRIOR_FLOOR = 1e-9

#: a rank's time more than this many times above or below the fitted model's prediction is
#: set aside (:meth:`CostFitter.plausible`)
IMPLAUSIBLE = 4.0


class CostFitter:
    """Online least-squares fit of measured rank times to ``α·ΣL + β·ΣL²``.

    Each observation (:meth:`observe`) is one rank: the lengths of the pieces
    it processed in a step and the seconds it took.  The fit is a
    non-negative least squares on the features ``[ΣL, ΣL²]``, kept as running
    sums (2×2 normal equations), so memory and time per observation are
    constant.  :meth:`observe_step` also takes a step whose only time is the
    step's (its slowest rank's): such a step is fitted as
    ``max over ranks of α·ΣL + β·ΣL²``, keeping only the ranks that can be the
    slowest for some ``α, β >= 0`` and the last ``window`` steps.

    Until ``min_observations`` have been made, :meth:`model` returns the
    ``prior`` scaled to the observed seconds (only its ratio ``β / α`` is
    kept); after that, the fit, pulled towards that scaled prior with the
    weight of ``prior_weight`` mean observations (as much in each direction of
    ``(α, β)`` as the observations tell there; where they never separate ``α``
    from ``β``, the prior's ratio is kept).
    ``decay < 1`` forgets old observations geometrically, to follow drift.

    Parameters
    ----------
    prior : CostModel, optional
        Starting model (default: :class:`CostModel`'s defaults).
    min_observations : int
    prior_weight : float
    decay : float
        In ``(0, 1]``; ``1`` keeps every observation.
    window : int
        Steps timed as a whole that are kept.
    """

    def __init__(self, prior: CostModel | None = None, *, min_observations: int = 8,
                 prior_weight: float = 0.1, decay: float = 1.0, window: int = 256):
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        # (a NaN or infinite prior weight fitted a model of 0 and 0, every piece free; a
        # float count was cut; a prior of a negative, NaN or no cost was taken; a review)
        for key, value in (("min_observations", min_observations), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{key} must be a whole number >= 1, got {value!r}")
        if not 0 <= float(prior_weight) <= MAX_PRIOR_WEIGHT:
            raise ValueError(f"prior_weight must be a number in [0, {MAX_PRIOR_WEIGHT:g}], got "
                             f"{prior_weight!r}")
        self.prior = prior if prior is not None else CostModel()
        a, b = self.prior.linear, self.prior.quadratic
        if not (math.isfinite(a) and math.isfinite(b) and a >= 0 and b >= 0 and a + b > 0):
            raise ValueError(f"the prior's coefficients must be finite, >= 0 and not both 0, got "
                             f"{self.prior}")
        self.min_observations = int(min_observations)
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        self.count = 0
        self._w = 0.0                       # decayed number of observations
        self._xtx = np.zeros((2, 2))
        self._xty = np.zeros(2)
        self._yty = 0.0
        self.window = int(window)
        #: steps timed as a whole: [weight, seconds, [[ΣL, ΣL²] of candidate ranks]]
        self._steps: list[list[Any]] = []
        self._cached: CostModel | None = None
        #: the times :meth:`plausible` set aside since the last it took, ``(ΣL, ΣL², seconds,
        #: step)``: the fit starts again from them where they say the level changed
        self._run: list[tuple[float, float, float, int | None]] = []

    @classmethod
    def from_config(cls, cfg: CostConfig, **kwargs: Any) -> CostFitter:
        """A fitter starting from the configured model (``cost: {fit: true, ...}``), with the
        configured ``prior_weight`` unless given."""
        kwargs.setdefault("prior_weight", cfg.prior_weight)
        return cls(CostModel.from_config(cfg), **kwargs)

    # ---------------------------------------------------------------- observing
    def observe(self, lengths_per_rank: np.ndarray | Sequence[np.ndarray], seconds: float) -> None:
        """Record that a rank whose pieces had these lengths took ``seconds``.

        Parameters
        ----------
        lengths_per_rank : array or list of arrays
            The lengths of the pieces the rank processed in the step: one
            array, or a list of arrays (say, one per micro-batch) that count
            together.
        seconds : float
            The rank's compute time for them.
        """
        self.observe_sums(*_features(lengths_per_rank), seconds)

    def observe_sums(self, sum_lengths: float, sum_squares: float, seconds: float) -> None:
        """:meth:`observe` of a rank whose pieces' lengths ``L`` had ``ΣL = sum_lengths`` and
        ``ΣL² = sum_squares`` (all the fit takes of them)."""
        self._add(float(sum_lengths), float(sum_squares), float(seconds))

    def observe_step(self, lengths_per_rank: Sequence[np.ndarray | Sequence[np.ndarray]],
                     seconds: float | Sequence[float]) -> None:
        """Record a step: one entry of ``lengths_per_rank`` per rank.

        ``seconds`` is one time per rank, or a single time for the whole step.
        A step lasts as long as its slowest rank, so a single time is recorded
        against the rank the current model predicts to be the slowest.
        """
        feats = [_features(r) for r in lengths_per_rank]
        for s1, s2 in feats:  # (with one time a NaN rank was dropped, a negative one taken)
            _check_features(s1, s2)
        if np.ndim(seconds) == 0:
            y = float(seconds)  # type: ignore[arg-type]
            _check_seconds(y)
            pts = _upper_hull(np.array(feats, dtype=np.float64).reshape(-1, 2))
            if len(pts) == 0:
                return
            if len(pts) == 1:                # the slowest rank is known: a plain observation
                self._add(float(pts[0, 0]), float(pts[0, 1]), y)
                return
            self._decay()
            self._steps.append([1.0, y, pts.tolist()])
            del self._steps[:-self.window]
            self.count += 1
            return
        times = [float(t) for t in seconds]  # type: ignore[union-attr]
        if len(times) != len(feats):
            raise ValueError(f"{len(feats)} ranks but {len(times)} times")
        for y in times:  # (all of them first: a bad time of rank k recorded ranks 0..k-1 of
            _check_seconds(y)  # a step it refused, and a retry counted them twice; a review)
        for (s1, s2), y in zip(feats, times, strict=True):
            self._add(s1, s2, y)

    def plausible(self, sum_lengths: float, sum_squares: float, seconds: float,
                  step: int | None = None) -> bool:
        """Whether a rank's time is one :meth:`observe_sums` should take: always before
        ``min_observations``; after, within :data:`IMPLAUSIBLE` times the current model's
        prediction either way.  Least squares let one step that compiled (a first step's
        torch.compile, a rank that paused) outweigh hundreds: a 20 times slower first step
        fitted β to 0 for the rest of a run, and the outlier delay went off (a review).

        Never a time of 0 for some work, nor one that is not a finite number >= 0.
        ``min_observations`` times in a row set aside, of more than one ``step`` (each
        call its own where none is given), say the level changed (or the times first
        fitted were off): the fit starts again from its prior (:meth:`restart`) with the
        times of that run, and this time is taken.  One slow step alone (a pause, a
        checkpoint in the timed region) gives a time per DP rank, each off the fit: at
        dp 8 it threw the fit away, and its one slow time fitted β to 0 (a review)."""
        y = float(seconds)
        if not math.isfinite(y) or y < 0 or y <= 0 < float(sum_lengths):
            # (no work takes no time: eight zero-second reports fitted the unscaled prior,
            # and every real time after was set aside for good; NaN and inf were counted
            # towards a restart; a review)
            return False
        if self.count < self.min_observations:
            return True
        m = self.model()
        predicted = m.linear * float(sum_lengths) + m.quadratic * float(sum_squares)
        if not predicted > 0:
            return True
        if 1 / IMPLAUSIBLE <= y / predicted <= IMPLAUSIBLE:
            self._run = []
            return True
        self._run.append((float(sum_lengths), float(sum_squares), y, step))
        steps = {st if st is not None else -1 - i for i, (*_, st) in enumerate(self._run)}
        if len(self._run) < self.min_observations or len(steps) < 2:
            return False
        # ``min_observations`` times in a row off the fit, over more than one step: the
        # level changed (or the first times fitted were off, a long warm-up): the fit starts
        # again from the prior with that run's times, and takes the times to come; it
        # rejected every later time for good (a review)
        run = self._run[:-1]
        self.restart()
        for s1, s2, t, _ in run:
            self._add(s1, s2, t)
        return True

    def restart(self) -> None:
        """Forget every observation: the fit starts again from its prior."""
        self.count = 0
        self._w = 0.0
        self._xtx = np.zeros((2, 2))
        self._xty = np.zeros(2)
        self._yty = 0.0
        self._steps = []
        self._cached = None
        self._run = []

    def _add(self, s1: float, s2: float, y: float) -> None:
        _check_seconds(y)
        _check_features(s1, s2)
        if s1 <= 0 and s2 <= 0:
            return                          # nothing processed: says nothing about α, β
        x = np.array([s1, s2])
        self._decay()
        self._xtx += np.outer(x, x)
        self._xty += x * y
        self._yty += y * y
        self._w += 1.0
        self.count += 1

    def _decay(self) -> None:
        self._cached = None
        d = self.decay
        if d < 1:
            self._xtx *= d
            self._xty *= d
            self._yty *= d
            self._w *= d
            for st in self._steps:
                st[0] *= d

    # ------------------------------------------------------------------ fitting
    def model(self) -> CostModel:
        """The current model: the prior, the scaled prior, or the fit (see the class doc)."""
        if self._cached is None:
            self._cached = self._fit()
        return self._cached

    def _fit(self) -> CostModel:
        if self.count == 0:
            return self.prior
        p = _Problem(self)
        prior = np.array([self.prior.linear, self.prior.quadratic])
        u_dir = prior * p.s
        norm = float(np.hypot(*u_dir))
        if norm <= 0:
            return self.prior
        d0 = u_dir / norm
        a0, b0 = p.coefficients(d0, np.zeros((2, 2)), np.zeros(2))
        u0 = d0 * max(0.0, b0 / a0) if a0 > 0 else np.zeros(2)
        if not u0.any():  # (every time measured 0 s: no scale to rescale the prior to)
            return self.prior
        if self.count < self.min_observations or p.y_rms <= 0:
            return p.theta(u0)
        # the prior counts as prior_weight observations of the mean one seen (the data's
        # information per observation, plus PRIOR_FLOOR of a unit in every direction for
        # directions the data never separates): a pull of prior_weight units in every
        # direction outweighed hundreds of observations where ranks' ΣL hardly differ,
        # the usual case (rows are filled), and held β/α near the prior's (a review)
        # (the floor whatever prior_weight is: at 0 equal-length data dropped β to 0, where
        # the prior's β/α is to be kept; a review)
        lam = self.prior_weight * p.mean_information() + PRIOR_FLOOR * np.eye(2)
        if not self._steps:
            # min |yn - Xn u|^2 + (u - u0)ᵀ lam (u - u0) over u >= 0, in closed form
            u = _nnls2(p.g + lam, p.b + lam @ u0)
            return p.theta(u)
        # a direction search: for u = r·d the objective is const - 2rB + r²A
        def score(phi: float) -> tuple[float, np.ndarray]:
            d = np.array([math.cos(phi), math.sin(phi)])
            a, b = p.coefficients(d, lam, u0)
            r = max(0.0, b / a) if a > 0 else 0.0
            return (b * b / a if b > 0 and a > 0 else 0.0), d * r

        grid = np.linspace(0.0, math.pi / 2, 91)
        vals = [score(float(phi))[0] for phi in grid]
        k = int(np.argmax(vals))
        lo, hi = float(grid[max(0, k - 1)]), float(grid[min(len(grid) - 1, k + 1)])
        g = (math.sqrt(5) - 1) / 2
        x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
        f1, f2 = score(x1)[0], score(x2)[0]
        for _ in range(40):                  # golden section: maximise the score
            if f1 >= f2:
                hi, x2, f2 = x2, x1, f1
                x1 = hi - g * (hi - lo)
                f1 = score(x1)[0]
            else:
                lo, x1, f1 = x1, x2, f2
                x2 = lo + g * (hi - lo)
                f2 = score(x2)[0]
        best = max((vals[k], float(grid[k])), (f1, x1), (f2, x2))
        return p.theta(score(best[1])[1])

    def predict(self, lengths: np.ndarray | Sequence[np.ndarray]) -> float:
        """Predicted seconds of a rank holding these pieces."""
        return self.model().total(lengths)

    # -------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The fitter's whole state, small and JSON-serialisable."""
        return {
            "prior": [self.prior.linear, self.prior.quadratic],
            "min_observations": self.min_observations,
            "prior_weight": self.prior_weight,
            "decay": self.decay,
            "count": self.count,
            "w": self._w,
            "xtx": self._xtx.tolist(),
            "xty": self._xty.tolist(),
            "yty": self._yty,
            "window": self.window,
            "steps": [list(st) for st in self._steps],
            # (a restored fitter restarted later than the one saved; a review)
            "set_aside": [list(r) for r in self._run],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._cached = None
        self._run = [(float(a), float(b), float(t), None if st is None else int(st))
                     for a, b, t, st in state.get("set_aside", [])]
        self.prior = CostModel(*(float(v) for v in state["prior"]))
        self.min_observations = int(state["min_observations"])
        self.prior_weight = float(state["prior_weight"])
        self.decay = float(state["decay"])
        self.count = int(state["count"])
        self._w = float(state["w"])
        self._xtx = np.array(state["xtx"], dtype=np.float64).reshape(2, 2)
        self._xty = np.array(state["xty"], dtype=np.float64).reshape(2)
        self._yty = float(state["yty"])
        self.window = int(state.get("window", 256))
        self._steps = [[float(w), float(y), [[float(a), float(b)] for a, b in pts]]
                       for w, y, pts in state.get("steps", [])]


def _check_seconds(y: float) -> None:
    if not math.isfinite(y) or y < 0:
        raise ValueError(f"seconds must be finite and >= 0, got {y}")


def _check_features(s1: float, s2: float) -> None:
    if not (math.isfinite(s1) and math.isfinite(s2) and s1 >= 0 and s2 >= 0):
        # (a NaN went into the sums and the fit was the unscaled prior for good; a review)
        raise ValueError(f"a rank's ΣL and ΣL² must be finite and >= 0, got {s1!r}, {s2!r}")


class _Problem:
    """The fit in normalised coordinates: features over their RMS, seconds over theirs.

    Rank observations enter through their running sums (``g = Σ x̃x̃ᵀ``,
    ``b = Σ x̃ỹ``), steps timed as a whole through their candidate ranks.
    """

    def __init__(self, f: CostFitter):
        w = f._w + sum(st[0] for st in f._steps)
        #: the (decayed) number of rank observations
        self.rank_weight = f._w
        sq = np.diag(f._xtx).copy()
        yy = f._yty
        for weight, y, pts in f._steps:
            sq += weight * np.max(np.square(pts), axis=0)
            yy += weight * y * y
        w = max(w, 1e-300)
        self.s = np.sqrt(sq / w)
        self.s[self.s <= 0] = 1.0
        self.y_rms = math.sqrt(yy / w)
        yr = self.y_rms if self.y_rms > 0 else 1.0
        self.g = f._xtx / np.outer(self.s, self.s)
        self.b = f._xty / (self.s * yr)
        # steps' candidate ranks, padded by repeating the first: (steps, ranks, 2)
        width = max((len(st[2]) for st in f._steps), default=0)
        self.pts = np.zeros((len(f._steps), width, 2))
        for i, (_, _, pts) in enumerate(f._steps):
            arr = np.asarray(pts, dtype=np.float64)
            self.pts[i] = np.concatenate([arr, np.repeat(arr[:1], width - len(arr), axis=0)])
        self.pts /= self.s
        self.step_w = np.array([st[0] for st in f._steps])
        self.step_y = np.array([st[1] for st in f._steps]) / yr

    def mean_information(self) -> np.ndarray:
        """``x̃x̃ᵀ`` of the mean observation (a step timed as a whole by its candidate rank
        of largest features, an upper bound)."""
        total = self.g.copy()
        n = self.rank_weight
        for w, pts in zip(self.step_w, self.pts, strict=True):
            top = pts.max(axis=0)
            total += w * np.outer(top, top)
            n += w
        return total / max(n, 1e-300)

    def coefficients(self, d: np.ndarray, lam: np.ndarray, u0: np.ndarray) -> tuple[float, float]:
        """``(A, B)`` of the objective ``const − 2rB + r²A`` along ``u = r·d``, with the
        prior's pull ``(u - u0)ᵀ lam (u - u0)``."""
        a = float(d @ self.g @ d) + float(d @ lam @ d)
        b = float(d @ self.b) + float(d @ lam @ u0)
        if len(self.step_w):
            m = (self.pts @ d).max(axis=1)
            a += float(self.step_w @ (m * m))
            b += float(self.step_w @ (self.step_y * m))
        return a, b

    def theta(self, u: np.ndarray) -> CostModel:
        theta = u * (self.y_rms if self.y_rms > 0 else 1.0) / self.s
        return CostModel(float(theta[0]), float(theta[1]))


def _upper_hull(pts: np.ndarray) -> np.ndarray:
    """The points that maximise ``α·x + β·y`` for some ``α, β >= 0`` (upper-right hull)."""
    pts = pts[(pts > 0).any(axis=1)]
    if len(pts) == 0:
        return pts
    order = np.lexsort((-pts[:, 1], -pts[:, 0]))      # by x, then y, decreasing
    cur = pts[order[0]]
    hull = [cur]
    while True:
        up = pts[pts[:, 1] > cur[1]]
        if len(up) == 0:
            return np.array(hull)
        dx = np.maximum(cur[0] - up[:, 0], 0.0)
        dy = up[:, 1] - cur[1]
        with np.errstate(divide="ignore"):
            slope = np.where(dx > 0, dy / np.where(dx > 0, dx, 1.0), np.inf)
        best = np.flatnonzero(slope == slope.max())
        cur = up[best[np.argmax(up[best, 1])]]          # the farthest along that edge
        hull.append(cur)


def _nnls2(h: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``argmin_{u >= 0} uᵀhu − 2·uᵀrhs`` for 2 variables (``h`` positive semi-definite).

    Tries the free solution and each face of the orthant.
    """
    def objective(u: np.ndarray) -> float:
        return float(u @ h @ u - 2 * u @ rhs)

    candidates = [np.zeros(2)]
    try:
        u = np.linalg.solve(h, rhs)
        if (u >= 0).all():
            candidates.append(u)
    except np.linalg.LinAlgError:
        pass
    for j in range(2):
        if h[j, j] > 0:
            u = np.zeros(2)
            u[j] = max(0.0, rhs[j] / h[j, j])
            candidates.append(u)
    return min(candidates, key=objective)
