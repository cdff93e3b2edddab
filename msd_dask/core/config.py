"""Declarative service configuration: YAML or dict in, validated typed objects out.

Every refusal raises :class:`~msd_dask.errors.ConfigError` naming the YAML key
(``sources[1].weight``) and the reason.  A section's keys and defaults are
its dataclass's fields (each default is written once, there).  Nothing here
touches Dask or the sources' storage (:func:`msd_dask.load_config` adds that
check).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from msd_dask.core.flops import transformer_coefficients
from msd_dask.core.mesh import cp_divides
from msd_dask.errors import MAX_TIMEOUT, ConfigError

__all__ = [
    "BatchConfig",
    "Config",
    "CostConfig",
    "ImageConfig",
    "ParallelConfig",
    "PoolConfig",
    "SourceConfig",
    "TokenizerConfig",
    "WeightSchedule",
    "parse_config",
    "resolve_import_path",
]

#: The built-in source formats (the readers :mod:`msd_dask.formats` registers); a source may
#: also name a format of its own by import path (``"package.module:Name"``)
KNOWN_FORMATS = ("parquet", "jsonl", "webdataset")
KNOWN_TOKENIZERS = ("bytes", "hf")
#: the keys of :data:`msd_dask.core.balance.STRATEGIES`, named here so that parsing a config (as
#: every training process does) does not import the balancer (tests/unit/test_imports.py checks)
KNOWN_BALANCE = ("sequential", "lpt", "balanced")
_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
MESH_AXES = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class WeightSchedule:
    """A source weight over training steps.

    ``kind`` is ``"constant"`` (one value), ``"piecewise"`` (``points`` are
    ``(until, weight)`` pairs: the weight holds for steps ``< until``; the last
    pair has ``until = inf``) or ``"linear"`` (``points`` are ``(step, weight)``
    anchors, linearly interpolated, constant before the first and after the
    last).
    """

    kind: str
    points: tuple[tuple[float, float], ...]

    @classmethod
    def constant(cls, weight: float) -> WeightSchedule:
        return cls("constant", ((math.inf, float(weight)),))

    def at(self, step: int) -> float:
        """The weight in force at ``step``."""
        if self.kind == "constant":
            return self.points[0][1]
        if self.kind == "piecewise":
            for until, w in self.points:
                if step < until:
                    return w
            return self.points[-1][1]
        pts = self.points
        if step <= pts[0][0]:
            return pts[0][1]
        for (s0, w0), (s1, w1) in zip(pts, pts[1:], strict=False):
            if step <= s1:
                return w0 + (w1 - w0) * (step - s0) / (s1 - s0)
        return pts[-1][1]

    def breakpoints(self) -> list[float]:
        """Steps where the schedule changes slope or value (for validation)."""
        return [p[0] for p in self.points if math.isfinite(p[0])]

    def to_yaml(self) -> Any:
        if self.kind == "constant":
            return self.points[0][1]
        if self.kind == "piecewise":
            return [
                {"until": int(u), "weight": w} if math.isfinite(u) else {"weight": w}
                for u, w in self.points
            ]
        return [{"step": int(s), "weight": w} for s, w in self.points]


@dataclass(frozen=True)
class ImageConfig:
    """How a multimodal source's images become image tokens (see :mod:`msd_dask.sources.vision`).

    Each image is resized to ``size × size`` RGB and cut into patches of
    ``patch × patch`` pixels: ``(size / patch)²`` image tokens.
    """

    size: int = 224
    patch: int = 14

    @property
    def tokens(self) -> int:
        """Image tokens (patches) per image."""
        return (self.size // self.patch) ** 2


@dataclass(frozen=True)
class PoolConfig:
    """Where a loader preprocesses and tokenizes the documents of its units.

    ``kind`` is ``"thread"`` (a thread pool: for work that releases the GIL,
    such as waiting on a store, zstd, hashing or image decoding in C) or
    ``"process"`` (a pool of spawned processes: for CPU-heavy Python that holds
    the GIL).  ``size`` is the number of documents processed at once per loader
    (0: the service's ``loader_threads``).  The documents of a unit keep their
    order whatever the pool.
    """

    kind: str = "thread"
    size: int = 0


@dataclass(frozen=True)
class SourceConfig:
    """One data source: a glob of files in one format and its mixing weight."""

    name: str
    uri: str
    format: str
    weight: WeightSchedule
    text_field: str = "text"
    # (credentials: left out of the repr, which a log or a traceback may print)
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    loaders: int = 1
    shuffle_window: int = 4
    read_ahead: int = 8
    #: cap on the tokens of the units assigned ahead of the current shuffle window
    #: (at least one unit is always assigned); 0: ``prefetch`` whole steps' tokens
    read_ahead_tokens: int = 0
    context: str = "short"
    #: ``"package.module:function"`` called as ``fn(text, record) -> str | None``
    #: on every document before tokenizing (``None`` drops the document).
    preprocess: str | None = None
    #: bad input (unreadable file, document without text): ``"fail"`` stops the
    #: service with an error naming source, file and row; ``"skip"`` quarantines it
    on_error: str = "fail"
    #: bounds of the adaptive loader policy for this source (0: the ``scaling`` default)
    min_loaders: int = 0
    max_loaders: int = 0
    #: image+text sources: the field holding each document's encoded image (bytes;
    #: ``"image"`` for webdataset shards); ``None``: a text source
    image_field: str | None = None
    #: image size and patch size of an image+text source
    image: ImageConfig | None = None
    #: the loader's preprocessing pool (threads or processes, and how many)
    pool: PoolConfig = PoolConfig()

    def __post_init__(self) -> None:
        # a loader receives the config as a dict (dataclasses.asdict)
        if isinstance(self.image, Mapping):
            object.__setattr__(self, "image", ImageConfig(**self.image))
        if isinstance(self.pool, Mapping):
            object.__setattr__(self, "pool", PoolConfig(**self.pool))


@dataclass(frozen=True)
class ParallelConfig:
    """The device mesh: ``dp × cp × tp × pp`` ranks laid out in ``order``.

    ``order`` lists the axes from fastest-varying to slowest, as in Megatron's
    ``tp-cp-dp-pp`` default: global rank ``r`` has ``tp = r % tp`` and so on.
    """

    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    order: str = "tp-cp-dp-pp"

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    @property
    def layout(self) -> str:
        """The mesh's sizes as messages say them: ``"dp=… tp=… cp=… pp=…"``."""
        return f"dp={self.dp} tp={self.tp} cp={self.cp} pp={self.pp}"

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank, e.g. ``{"dp": 1, "tp": 0, ...}``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside [0, {self.world_size}) ({self.layout})")
        out = {}
        rest = rank
        for axis in self.order.split("-"):
            size = getattr(self, axis)
            out[axis] = rest % size
            rest //= size
        return out

    def ranks_of_dp(self, dp_rank: int) -> list[int]:
        """All global ranks whose data-parallel coordinate is ``dp_rank``, ascending
        (none outside ``[0, dp)``); ``world_size / dp`` of them, found by arithmetic."""
        if not 0 <= dp_rank < self.dp:
            return []
        base = dp_rank * self._stride("dp")
        return [base + o for o in self._group_offsets()]

    def dp_groups(self) -> list[list[int]]:
        """Every DP group's ranks at once, ``[ranks_of_dp(0), ranks_of_dp(1), ...]``:
        one pass over the world (start-up maps all of them; ``ranks_of_dp`` per index
        used to scan the whole world for each)."""
        offsets, step = self._group_offsets(), self._stride("dp")
        return [[d * step + o for o in offsets] for d in range(self.dp)]

    def _stride(self, axis: str) -> int:
        """How far apart two ranks one step apart along ``axis`` are."""
        stride = 1
        for a in self.order.split("-"):
            if a == axis:
                return stride
            stride *= getattr(self, a)
        raise ValueError(f"no mesh axis {axis!r} in order {self.order!r}")

    def _group_offsets(self) -> list[int]:
        """The ranks of DP group 0, ascending: every tp/cp/pp coordinate's offset.
        Built from the fastest axis up, each axis's stride exceeds the offsets so far."""
        offsets = [0]
        for axis in self.order.split("-"):
            if axis != "dp":
                stride = self._stride(axis)
                offsets = [k * stride + o for k in range(getattr(self, axis)) for o in offsets]
        return offsets


@dataclass(frozen=True)
class BatchConfig:
    seq_len: int
    micro_batches: int = 1


@dataclass(frozen=True)
class TokenizerConfig:
    """Which tokenizer turns text into ids (see :mod:`msd_dask.sources.tokenizer`).

    ``kind`` is ``"bytes"`` (UTF-8 bytes, the default) or ``"hf"`` (a Hugging
    Face ``tokenizer.json`` at the fsspec ``path``).  ``eod_id`` / ``pad_id``
    override the end-of-document and padding ids an ``hf`` tokenizer would
    otherwise take from its special tokens.
    """

    kind: str = "bytes"
    path: str | None = None
    eod_id: int | None = None
    pad_id: int | None = None
    # (credentials: left out of the repr, which a log or a traceback may print)
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: ``hf``: the id standing for one image patch in image+text documents (the
    #: byte tokenizer's is 258)
    image_token_id: int | None = None


def resolve_import_path(spec: str) -> Any:
    """The object ``"package.module:attr"`` names (imports the module)."""
    if not _IMPORT_PATH.match(spec):
        raise ValueError(f"{spec!r} is not of the form 'package.module:function'")
    mod, attr = spec.split(":", 1)
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


#: the most observations ``cost.prior_weight`` may count the starting model as: beyond, the
#: fit could never move from it (``fit: false`` says that), and its sums overflow near 1e300
MAX_PRIOR_WEIGHT = 1e9


@dataclass(frozen=True)
class CostConfig:
    """Per-document cost ``linear·L + quadratic·L²`` (see :mod:`msd_dask.core.cost`).

    The default ``quadratic`` is the ratio of causal attention to dense-layer
    FLOPs of a transformer of hidden size 4096 (``1 / (12·4096)``).  With
    ``model`` (``{"hidden_size": H, "layers": N}``), ``linear`` and
    ``quadratic`` are that transformer's forward FLOPs ``24·N·H²`` and
    ``2·N·H``.  With ``fit``, step times refine the model online
    (:class:`~msd_dask.core.cost.CostFitter`), starting from it; ``prior_weight`` is
    how many observations the starting model counts as in the fit (0: none).
    """

    linear: float = 1.0
    quadratic: float = 1.0 / (12 * 4096)
    model: Mapping[str, int] | None = None
    fit: bool = False
    prior_weight: float = 0.1


@dataclass(frozen=True)
class ScalingConfig:
    """The loader policy (see :mod:`msd_dask.core.scaling`).

    ``policy: fixed`` keeps ``sources[].loaders``; ``adaptive`` lets the
    scheduler plugin size each source's loaders to demand × measured cost,
    within ``[min_loaders, max_loaders]`` (per source overrides allowed).
    """

    policy: str = "fixed"
    min_loaders: int = 1
    max_loaders: int = 8
    headroom: float = 1.25
    starve_fraction: float = 0.05
    cooldown: float = 5.0
    scale_down_after: float = 30.0
    lookahead: int = 200
    interval: float = 1.0
    #: roles (planner, constructors, loaders) one Dask worker hosts when the plugin sizes an
    #: adaptive cluster (``cluster.adapt``); 0: the worker's thread count
    roles_per_worker: int = 0


@dataclass(frozen=True)
class LongContextConfig:
    """How documents of ``context: long`` sources are laid out over steps.

    ``mode: spread`` puts at most ``max_per_rank`` long pieces on each DP rank
    per step (0: no limit); ``mode: grouped`` gathers long pieces on dedicated
    steps, taken whenever the long sources are owed a step's worth of tokens,
    so the token mix still holds over a window of steps (pieces of the other kind
    carried from the last step wait for a step of their kind).
    """

    mode: str = "spread"
    max_per_rank: int = 0

    def places_long_pieces(self) -> bool:
        """Whether the layout decides where long pieces go (``grouped``, or ``spread``
        with ``max_per_rank``): then no piece is held as an outlier, since held pieces
        are released a row each at the front of a step, wherever the layout wants them."""
        return self.mode == "grouped" or self.max_per_rank > 0


@dataclass(frozen=True)
class OutlierConfig:
    """Outlier delay: hold long pieces back until every row of a step can get one.

    A piece of at least ``min_length`` tokens is held when drawn instead of
    joining the step; once ``group`` of them are held (0: the step's
    ``dp × micro_batches`` rows) they are released together at the front of a
    step, so no row (and no rank) is the only one with a long,
    attention-heavy piece.  A piece is never held more than ``max_wait`` steps.
    The rule counts rows, not ranks, so a step holds the same pieces after an
    elastic resume that keeps ``dp × micro_batches``.

    ``min_length`` is ``"auto"`` (the default: from the cost model, see
    :func:`auto_outlier_length`), ``0`` (off), a number of tokens (an int), or
    a fraction of ``batch.seq_len`` (a float in (0, 1), so it survives a change
    of ``seq_len``).
    """

    min_length: float | str = "auto"
    group: int = 0
    max_wait: int = 16

    def threshold(self, seq_len: int, linear: float = 1.0, quadratic: float = 0.0) -> int:
        """The shortest outlier in tokens for rows of ``seq_len`` (0: off).

        ``linear`` and ``quadratic`` are the cost model's coefficients, which
        ``"auto"`` reads.
        """
        v = self.min_length
        if v == "auto":
            auto = auto_outlier_length(seq_len, linear, quadratic)
            return max(auto, shortest_outlier(seq_len)) if auto else 0
        if isinstance(v, float) and 0 < v < 1:
            return int(v * seq_len) + 1
        return int(v)


#: the shortest outlier, as a share of ``batch.seq_len`` (:func:`shortest_outlier`)
MIN_OUTLIER_SHARE = 1 / 32


def shortest_outlier(seq_len: int) -> int:
    """The shortest piece ``outliers.min_length`` may hold back: :data:`MIN_OUTLIER_SHARE` of
    a row.  Below it nearly every piece is an outlier: the pieces held, each released a row
    of its own, outgrow the steps (with ``max_wait: 1`` the carried pieces grew by about
    nine a step at 128 tokens, and the oldest was never delivered)."""
    return math.ceil(seq_len * MIN_OUTLIER_SHARE)


#: ``outliers.min_length: auto`` holds a piece whose attention cost (``quadratic·L²``) is at
#: least this share of a full row's per-token cost (``linear·seq_len``)
AUTO_OUTLIER_SHARE = 0.25


def auto_outlier_length(seq_len: int, linear: float, quadratic: float) -> int:
    """``outliers.min_length: auto``: the shortest piece worth holding back (0: none is).

    A step's rows are nearly full, so ranks differ in cost by their pieces'
    attention term ``quadratic·L²``; a piece whose term is at least
    :data:`AUTO_OUTLIER_SHARE` of a full row's ``linear·seq_len`` is more than the
    other pieces of a rank can even out (a rank has only ``micro_batches`` rows),
    so it waits until every row gets one.  With the default cost model
    (``1 / (12·4096)``) that is pieces of at least 61% of a row at 32K and 31%
    at 128K, and none at 4K (where the term stays below 8% of a row's linear cost).
    With no linear cost every piece's attention term is over that share (1: the
    threshold's floor decides); it was 0, the delay off where attention is all the cost
    (a fit whose linear coefficient reached its bound of 0; a review).
    """
    if quadratic <= 0:
        return 0
    if linear <= 0:
        return 1
    length = math.ceil(math.sqrt(AUTO_OUTLIER_SHARE * linear * seq_len / quadratic))
    return length if length <= seq_len else 0


@dataclass(frozen=True)
class Config:
    """A validated service configuration (see ``docs/config.md``)."""

    name: str
    sources: tuple[SourceConfig, ...]
    batch: BatchConfig
    seed: int = 0
    parallel: ParallelConfig = ParallelConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    prefetch: int = 4
    #: steps planned, built, published and claimed together (0: ``prefetch - 1``, at least 1)
    round_steps: int = 0
    cost: CostConfig = CostConfig()
    constructors: int = 0
    timeout: float = 300.0
    balance: str = "balanced"
    long_context: LongContextConfig = LongContextConfig()
    scaling: ScalingConfig = ScalingConfig()
    outliers: OutlierConfig = OutlierConfig()

    @property
    def steps_per_round(self) -> int:
        """Steps the planner plans and ships at once (``round_steps``; 0: ``prefetch - 1``).

        A reader claims a round at once, so its constructor is free to take the
        next round as soon as every member rank claimed it: ``prefetch - 1``
        keeps one step of the next round ahead of the readers' last claim.
        """
        return self.round_steps or max(1, self.prefetch - 1)

    def source(self, name: str) -> SourceConfig:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(name)

    def weights_at(self, step: int) -> dict[str, float]:
        """Normalised token shares of every source at ``step``."""
        raw = {s.name: s.weight.at(step) for s in self.sources}
        total = sum(raw.values())
        return {k: v / total for k, v in raw.items()}

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that :func:`parse_config` turns back into this config."""
        d = dataclasses.asdict(self)
        d["sources"] = []
        for s in self.sources:
            sd = dataclasses.asdict(s)
            sd["weight"] = s.weight.to_yaml()
            sd["storage_options"] = dict(s.storage_options)
            d["sources"].append(sd)
        d["tokenizer"] = {k: v for k, v in dataclasses.asdict(self.tokenizer).items()
                          if v is not None and (v != {} or k != "storage_options")}
        if self.tokenizer.kind == "bytes":
            d["tokenizer"] = {"kind": "bytes"}
        return d

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------- helpers


def _check_keys(d: Any, key: str, allowed: set[str], required: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    if not isinstance(d, Mapping):
        raise ConfigError(key or "<root>", f"must be a mapping, got {type(d).__name__}")
    for k in d:
        if k not in allowed:
            where = f"{key}.{k}" if key else str(k)
            raise ConfigError(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(k for k in required if k not in d)  # (a set's order: the hash seed's)
    if missing:
        named = [f"{key}.{k}" if key else k for k in missing]
        raise ConfigError(named[0], "is required" + (
            f" (and so are {', '.join(named[1:])})" if len(named) > 1 else ""))


def _names(cls: Any) -> set[str]:
    """The keys of a config section: the fields of its dataclass."""
    return {f.name for f in dataclasses.fields(cls)}


# The parsers below take a key's default from its dataclass (``Config.prefetch``), so
# each default is written once, in the dataclass; ``None``: the key has no default.


#: the most tokens a step may hold (dp 16,384 x 8 rows x 128K is 2**34)
MAX_STEP_TOKENS = 2**40

#: the most a full row may cost under the cost model (a rank's cost sums millions of pieces')
MAX_COST = 1e200


#: the largest integer a config value may be: counts, lengths, steps and ids travel as int32
#: (a value past it failed deep in the planner with an OverflowError naming no key)
MAX_INT = 2**31 - 1


def _int(d: Mapping[str, Any], k: str, key: str, default: int | None = None, lo: int = 1,
         hi: int = MAX_INT) -> int:
    v = d.get(k, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{key}.{k}" if key else k, f"must be an integer, got {v!r}")
    if v < lo:
        raise ConfigError(f"{key}.{k}" if key else k, f"must be >= {lo}, got {v}")
    if v > hi:
        raise ConfigError(f"{key}.{k}" if key else k, f"must be <= {hi}, got {v}")
    return v


def _finite(v: Any) -> bool:
    """Whether ``v`` is a number (not a bool) a float holds, and finite: an integer too
    long for a float (a YAML literal of hundreds of digits) is not."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def cost_model_problem(linear: float, quadratic: float, seq_len: int) -> str | None:
    """What makes ``linear·L + quadratic·L²`` (each a finite number >= 0) no cost model for
    rows of ``seq_len`` tokens, or ``None``: both 0, or a full row costing
    :data:`MAX_COST` or more (sums of rows' costs must stay finite).  The rule of the
    config's ``cost`` and of a resume state's cost model, which plans on over the config's
    (:func:`~msd_dask.core.plan.state_cost`)."""
    if linear == 0 and quadratic == 0:
        return "linear and quadratic cannot both be 0"
    row = linear * seq_len + quadratic * float(seq_len) ** 2
    if not row < MAX_COST:
        return (f"a full row of batch.seq_len {seq_len} tokens costs {row:g} under linear "
                f"{linear:g} and quadratic {quadratic:g}: at most {MAX_COST:g} (the model's "
                "scale does not matter, only the ratio quadratic/linear)")
    return None


def _num(d: Mapping[str, Any], k: str, key: str, default: float | None = None, lo: float = 0.0,
         hi: float = math.inf) -> float:
    v = d.get(k, default)
    if not _finite(v):
        raise ConfigError(f"{key}.{k}" if key else k, f"must be a finite number, got {v!r}")
    if v < lo:
        raise ConfigError(f"{key}.{k}" if key else k, f"must be >= {lo}, got {v}")
    if v > hi:
        raise ConfigError(f"{key}.{k}" if key else k, f"must be <= {hi:g}, got {v}")
    return float(v)


def _str(d: Mapping[str, Any], k: str, key: str, default: str | None = None) -> str:
    v = d.get(k, default)
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"{key}.{k}" if key else k, f"must be a non-empty string, got {v!r}")
    return v


def parse_weight(v: Any, key: str) -> WeightSchedule:
    """Parse a weight: a number, or a schedule (list of points)."""
    if isinstance(v, bool):
        raise ConfigError(key, f"must be a number or a schedule, got {v!r}")
    if isinstance(v, int | float):
        if not _finite(v) or v < 0:
            raise ConfigError(key, f"must be a finite number >= 0, got {v!r}")
        return WeightSchedule.constant(v)
    if not isinstance(v, list) or not v:
        raise ConfigError(key, f"must be a number or a non-empty list of schedule points, got {v!r}")
    points: list[tuple[float, float]] = []
    kinds = set()
    for i, item in enumerate(v):
        k = f"{key}[{i}]"
        _check_keys(item, k, {"until", "step", "weight"}, {"weight"})
        w = _num(item, "weight", k)
        if "step" in item and "until" in item:
            raise ConfigError(k, "a schedule point has either 'step' (a ramp point) or 'until' "
                              "(a constant segment), not both")
        if "step" in item:
            kinds.add("linear")
            points.append((_int(item, "step", k, lo=0), w))
        elif "until" in item:
            kinds.add("piecewise")
            points.append((_int(item, "until", k, lo=1), w))
        else:
            if i != len(v) - 1:
                raise ConfigError(k, "only the last schedule point may omit 'until'")
            kinds.add("piecewise")
            points.append((math.inf, w))
    if len(kinds) != 1:
        raise ConfigError(key, "a schedule uses either 'until' points or 'step' points, not both")
    kind = kinds.pop()
    steps = [p[0] for p in points]
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise ConfigError(key, f"schedule steps must increase, got {steps}")
    if kind == "piecewise" and math.isfinite(points[-1][0]):
        raise ConfigError(f"{key}[{len(v) - 1}]", "the last point of a piecewise schedule "
                          "must omit 'until' (the weight after the last step)")
    return WeightSchedule(kind, tuple(points))


def _source(d: Any, key: str) -> SourceConfig:
    _check_keys(d, key, _names(SourceConfig), {"name", "uri", "format"})
    fmt = _str(d, "format", key)
    if fmt not in KNOWN_FORMATS and not _IMPORT_PATH.match(fmt):
        # (a format of your own is imported where the source is listed and read, never here)
        raise ConfigError(f"{key}.format", f"unknown format {fmt!r} (known: {', '.join(KNOWN_FORMATS)}; "
                          "or 'package.module:Name' naming a format of your own)")
    so = _storage_options(d.get("storage_options", {}), f"{key}.storage_options")
    context = d.get("context", SourceConfig.context)
    if context not in ("short", "long"):
        raise ConfigError(f"{key}.context", f"must be 'short' or 'long', got {context!r}")
    src = SourceConfig(
        name=_str(d, "name", key),
        uri=_str(d, "uri", key),
        format=fmt,
        weight=parse_weight(d.get("weight", 1.0), f"{key}.weight"),
        text_field=_str(d, "text_field", key, SourceConfig.text_field),
        storage_options=so,
        loaders=_int(d, "loaders", key, SourceConfig.loaders),
        min_loaders=_int(d, "min_loaders", key, SourceConfig.min_loaders, lo=0),
        max_loaders=_int(d, "max_loaders", key, SourceConfig.max_loaders, lo=0),
        shuffle_window=_int(d, "shuffle_window", key, SourceConfig.shuffle_window),
        read_ahead=_int(d, "read_ahead", key, SourceConfig.read_ahead),
        read_ahead_tokens=_int(d, "read_ahead_tokens", key, SourceConfig.read_ahead_tokens, lo=0,
                               hi=2**62),  # (a token count: "no cap" is a large one)
        context=context,
        preprocess=_preprocess(d, key),
        on_error=_on_error(d, key),
        pool=_pool(d, key),
        **_image(d, key),
    )
    return src


def _image(d: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``image_field`` and ``image`` of a source (either one makes it an image+text source)."""
    if d.get("image_field") is None and d.get("image") is None:
        return {}
    field_ = _str(d, "image_field", key, "image")
    img = {} if d.get("image") is None else d["image"]  # (image: false is no mapping)
    k = f"{key}.image"
    _check_keys(img, k, _names(ImageConfig))
    if d.get("format") == "jsonl":  # (every row with an image was bad input; a review)
        raise ConfigError(f"{key}.{'image_field' if 'image_field' in d else 'image'}",
                          "a jsonl source cannot carry images: JSON has no bytes (a base64 "
                          "string or a file's path is text); images come from parquet (a "
                          "binary column) or webdataset (image members)")
    size = _int(img, "size", k, ImageConfig.size)
    patch = _int(img, "patch", k, ImageConfig.patch)
    if size % patch:
        raise ConfigError(f"{k}.patch", f"must divide image.size {size}, got {patch}")
    if field_ == d.get("text_field", SourceConfig.text_field):
        raise ConfigError(f"{key}.image_field", f"must differ from text_field {field_!r}")
    return {"image_field": field_, "image": ImageConfig(size=size, patch=patch)}


def _pool(d: Mapping[str, Any], key: str) -> PoolConfig:
    """``pool: {kind: thread|process, size: N}`` of a source."""
    pool = d.get("pool")
    if pool is None:
        return PoolConfig()
    k = f"{key}.pool"
    _check_keys(pool, k, _names(PoolConfig))
    kind = pool.get("kind", PoolConfig.kind)
    if kind not in ("thread", "process"):
        raise ConfigError(f"{k}.kind", f"must be 'thread' or 'process', got {kind!r}")
    return PoolConfig(kind=kind, size=_int(pool, "size", k, PoolConfig.size, lo=0))


def _on_error(d: Mapping[str, Any], key: str) -> str:
    v = d.get("on_error", SourceConfig.on_error)
    if v not in ("fail", "skip"):
        raise ConfigError(f"{key}.on_error", f"must be 'fail' or 'skip', got {v!r}")
    return str(v)


def _preprocess(d: Mapping[str, Any], key: str) -> str | None:
    spec = d.get("preprocess")
    if spec is None:
        return None
    if not isinstance(spec, str) or not _IMPORT_PATH.match(spec):
        raise ConfigError(f"{key}.preprocess",
                          f"must be an import path 'package.module:function', got {spec!r}")
    # (imported by load_config and on the workers, never here: a reader's or the scheduler
    # plugin's process parses the config without the user's module)
    return spec


def _tokenizer(tok: Any) -> TokenizerConfig:
    _check_keys(tok, "tokenizer", _names(TokenizerConfig))
    kind = tok.get("kind", TokenizerConfig.kind)
    if kind not in KNOWN_TOKENIZERS:
        raise ConfigError("tokenizer.kind",
                          f"unknown tokenizer {kind!r} (known: {', '.join(KNOWN_TOKENIZERS)})")
    so = _storage_options(tok.get("storage_options", {}), "tokenizer.storage_options")
    ids: dict[str, int | None] = {}
    for k in ("eod_id", "pad_id", "image_token_id"):
        ids[k] = None if tok.get(k) is None else _int(tok, k, "tokenizer", lo=0)
    if kind == "bytes":
        for k in ("path", "eod_id", "pad_id", "storage_options", "image_token_id"):
            if k in tok:
                raise ConfigError(f"tokenizer.{k}", "only applies to kind 'hf' (the byte "
                                  "tokenizer has fixed ids: 256 ends a document, 257 pads, "
                                  "258 is an image patch)")
        return TokenizerConfig()
    cfg = TokenizerConfig(kind=kind, path=_str(tok, "path", "tokenizer"), storage_options=so,
                          **ids)
    return cfg


def _storage_options(so: Any, key: str) -> dict[str, Any]:
    """A ``storage_options`` mapping at config key ``key``, as a dict: its type named where
    it is none (never its value, which may hold credentials), and a key that is not a string
    refused here (it failed at the listing, "keywords must be strings", blamed on ``uri``;
    a review)."""
    if not isinstance(so, Mapping):
        raise ConfigError(key, f"must be a mapping, got {type(so).__name__}")
    bad = [k for k in so if not isinstance(k, str)]
    if bad:
        raise ConfigError(key, f"its keys are fsspec's option names, strings; got {bad[0]!r}")
    return dict(so)


def _weight_steps(sources: tuple[SourceConfig, ...]) -> list[int]:
    """The steps at which the sources' weights take every value they take relative to each
    other: step 0, each breakpoint, the step before it, and a step after the last."""
    steps = {0.0}
    for s in sources:
        steps.update(s.weight.breakpoints())
        steps.update(b - 1 for b in s.weight.breakpoints() if b >= 1)
    return [int(st) for st in sorted(steps) + [max(steps) + 1]]


def rows_kept_empty(max_per_rank: int, micro_batches: int, sources: Sequence[SourceConfig],
                    weights: Mapping[str, float]) -> str | None:
    """Why ``weights`` (source name -> weight) leave rows empty under ``long_context.
    max_per_rank``, or ``None``: where every source of weight > 0 has ``context: long`` and
    ``max_per_rank`` is below ``micro_batches``, a rank gets at most ``max_per_rank``
    pieces a step and its other rows are all padding.  The rule of the config (at every
    step of its weights) and of a live change of the mix
    (:meth:`~msd_dask.core.plan.Planner.set_weights`)."""
    if not 0 < max_per_rank < micro_batches:
        return None
    if any(s.context != "long" and weights.get(s.name, 0.0) > 0 for s in sources):
        return None
    return (f"every source of weight > 0 has context: long, so a rank gets at most "
            f"max_per_rank = {max_per_rank} pieces a step, and {micro_batches - max_per_rank} of "
            f"its batch.micro_batches = {micro_batches} rows would be empty")


def _validate_weights(sources: tuple[SourceConfig, ...]) -> None:
    for st in _weight_steps(sources):
        total = sum(s.weight.at(int(st)) for s in sources)
        if total <= 0:
            raise ConfigError("sources", f"source weights sum to 0 at step {int(st)}")
        if not math.isfinite(total):
            raise ConfigError("sources", f"source weights sum to {total} at step {int(st)}: "
                              "too large (only their ratios matter: scale them down)")


def parse_config(cfg: str | os.PathLike[str] | Mapping[str, Any] | Config) -> Config:
    """Parse and validate a service configuration, without touching its sources' storage.

    :func:`msd_dask.load_config` also checks each source's files and the tokenizer.

    Parameters
    ----------
    cfg : str, path, mapping or Config
        A YAML file path, a YAML string containing a mapping, or an already
        parsed mapping.  A :class:`Config` is returned as it is.

    Returns
    -------
    Config

    Raises
    ------
    ConfigError
        Naming the offending key and the reason; where the config file is missing,
        unreadable or empty, naming the file (its ``key`` is ``"<root>"``).
    """
    if isinstance(cfg, Config):
        return cfg
    if isinstance(cfg, str | os.PathLike):
        text = str(cfg)
        from_file = isinstance(cfg, os.PathLike) or "\n" not in text and os.path.exists(text)
        if from_file:
            try:
                with open(cfg, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:  # a Path that is missing, a folder, unreadable
                raise _ConfigFileError("<root>", f"cannot read config file {text!r}: "
                                       f"{e.strerror or e}") from None
            except UnicodeDecodeError as e:  # (a data file given for the config, say)
                raise _ConfigFileError("<root>", f"config file {text!r} is not UTF-8 text "
                                       f"(byte {e.start}: {e.reason}); a config is a YAML "
                                       "file") from None
        path = str(cfg) if from_file else None
        try:
            data = yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader
        except yaml.YAMLError as e:
            raise ConfigError("<root>", f"not valid YAML: {_yaml_said(e, path)}") from e
        if path is not None and data is None:
            raise _ConfigFileError("<root>", f"config file {path!r} is empty")
        if not from_file and "\n" not in text and not isinstance(data, dict):
            # one line that is no file and no mapping: a path with a typo, most likely
            raise _ConfigFileError("<root>", f"no config file {text!r} (a config is the path "
                                   "of a YAML file, or YAML text)")
    else:
        data = cfg
    return _parse(data)


class _ConfigFileError(ConfigError):
    """A :class:`~msd_dask.errors.ConfigError` about the config file itself (missing,
    unreadable, empty): its message is the reason alone, naming the file, not ``key``
    (``"<root>"``: no key of the config to name)."""

    def __init__(self, key: str, reason: str):
        super().__init__(key, reason)
        self.args = (reason,)


def _yaml_said(e: yaml.YAMLError, path: str | None) -> str:
    """What the YAML parser said, on one line: the file, where, the problem and what it
    was parsing (its own message spans six lines and quotes the text)."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return " ".join(str(e).split())
    where = (f"{path!r}, " if path is not None else "") + (
        f"line {mark.line + 1}, column {mark.column + 1}")
    said = f"{where}: {getattr(e, 'problem', None) or e}"
    context, at = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        said += f" ({context}" + (f" from line {at.line + 1}" if at is not None else "") + ")"
    return said


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, which also reads ``2e-5`` as a float: PyYAML follows YAML 1.1,
    where a float needs a dot (``2.0e-5``), and would hand ``cost.quadratic: 2e-5`` over as
    a string; and which refuses a key given twice in one mapping, where PyYAML keeps the
    last value (a second ``sources:`` block would drop the first without a word)."""

    def construct_document(self, node: yaml.Node) -> Any:
        _refuse_repeated_keys(node, "", set())
        return super().construct_document(node)


def _refuse_repeated_keys(node: yaml.Node, path: str, walked: set[int]) -> None:
    """Raise :class:`ConfigError` naming the first key given twice in a mapping of ``node``
    (``path``: its key path, as the config's errors name keys).  ``walked``: the nodes
    looked at already (an alias is the node it names: each is looked at once, and an
    alias inside its own anchor ends)."""
    if id(node) in walked:
        return
    walked.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else None
            at = f"{path}.{name}" if path else str(name)
            if name is not None and name != "<<":
                if name in seen:
                    raise ConfigError(at, f"given twice (lines {seen[name] + 1} and "
                                          f"{key.start_mark.line + 1}): its second value would "
                                          "replace the first")
                seen[name] = key.start_mark.line
            _refuse_repeated_keys(value, at, walked)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_repeated_keys(item, f"{path}[{i}]", walked)


# YAML 1.1's numbers, but for two forms read silently as other numbers than they look:
# base 60 (``seq_len: 1:04`` is 64, ``until: 1:30`` 90) and octal (``0100`` is 64); such a
# value stays a string, which the key's check then refuses by name
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers
            if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?
                   |\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?
                   |[-+]?\.(?:inf|Inf|INF)
                   |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"""^(?:[-+]?0b[0-1_]+
                   |[-+]?(?:0|[1-9][0-9_]*)
                   |[-+]?0x[0-9a-fA-F_]+)$""", re.X),
    list("-+0123456789"))
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _parse(d: Any) -> Config:
    _check_keys(d, "", _names(Config), {"name", "sources", "batch"})
    name = _str(d, "name", "")
    if "/" in name or "\0" in name or name != name.strip():
        # (it names files: the host agent's socket, /tmp/msd-dask-UID/agent-NAME.sock; and a
        # name with spaces around it is not the one `msd-dask stats NAME` is given)
        raise ConfigError("name", "must hold no '/' and no NUL, nor start or end with "
                          f"blanks, got {name!r}")
    par = d.get("parallel", {})
    _check_keys(par, "parallel", _names(ParallelConfig))
    order = par.get("order", ParallelConfig.order)
    if not isinstance(order, str) or sorted(order.split("-")) != sorted(MESH_AXES):
        raise ConfigError("parallel.order", f"must order all of tp, cp, dp, pp joined by '-', got {order!r}")
    parallel = ParallelConfig(
        order=order, **{a: _int(par, a, "parallel", getattr(ParallelConfig, a)) for a in MESH_AXES})
    if parallel.world_size > MAX_INT:
        # (ranks travel as int32, and start-up lays out every rank: such a world passed
        # `msd-dask validate` and ran out of memory at start; a review)
        largest = max(MESH_AXES, key=lambda a: getattr(parallel, a))
        raise ConfigError(f"parallel.{largest}", "the mesh has "
                          + " x ".join(f"{a} {getattr(parallel, a)}" for a in MESH_AXES)
                          + f" = {parallel.world_size} ranks: at most {MAX_INT} (2**31 - 1)")
    b = d["batch"]
    _check_keys(b, "batch", _names(BatchConfig), {"seq_len"})
    batch = BatchConfig(seq_len=_int(b, "seq_len", "batch"),
                        micro_batches=_int(b, "micro_batches", "batch", BatchConfig.micro_batches))
    if not cp_divides(batch.seq_len, parallel.cp):
        raise ConfigError("batch.seq_len", f"must be divisible by 2 x parallel.cp = "
                          f"{2 * parallel.cp} (each context-parallel rank takes two of that "
                          f"many chunks of every row), got {batch.seq_len}")
    step_tokens = parallel.dp * batch.micro_batches * batch.seq_len
    if step_tokens > MAX_STEP_TOKENS:
        raise ConfigError("batch.seq_len", f"a step of parallel.dp {parallel.dp} x "
                          f"batch.micro_batches {batch.micro_batches} x batch.seq_len "
                          f"{batch.seq_len} = {step_tokens} tokens: at most {MAX_STEP_TOKENS} "
                          "(2**40)")
    tokenizer = _tokenizer(d.get("tokenizer", {}))
    cost = d.get("cost", {})
    _check_keys(cost, "cost", _names(CostConfig))
    fit = cost.get("fit", CostConfig.fit)
    if not isinstance(fit, bool):
        raise ConfigError("cost.fit", f"must be true or false, got {fit!r}")
    # (near 1e300 the fit's sums overflowed, a warning and a model of NaNs' making; a review)
    prior_weight = _num(cost, "prior_weight", "cost", CostConfig.prior_weight,
                        hi=MAX_PRIOR_WEIGHT)
    shape = cost.get("model")
    if shape is None:
        cost_cfg = CostConfig(
            linear=_num(cost, "linear", "cost", CostConfig.linear),
            quadratic=_num(cost, "quadratic", "cost", CostConfig.quadratic),
            fit=fit, prior_weight=prior_weight,
        )
    else:
        _check_keys(shape, "cost.model", {"hidden_size", "layers"}, {"hidden_size", "layers"})
        model = {k: _int(shape, k, "cost.model") for k in ("hidden_size", "layers")}
        linear, quadratic = transformer_coefficients(model["hidden_size"], model["layers"])
        for k, derived in (("linear", linear), ("quadratic", quadratic)):
            # to_dict() writes the derived values next to the model: they must agree
            if k in cost and not math.isclose(_num(cost, k, "cost"), derived, rel_tol=1e-9):
                raise ConfigError(f"cost.{k}", f"conflicts with cost.model, which gives {derived!r} "
                                  "(give one or the other)")
        cost_cfg = CostConfig(linear=linear, quadratic=quadratic, model=model, fit=fit,
                              prior_weight=prior_weight)
    problem = cost_model_problem(cost_cfg.linear, cost_cfg.quadratic, batch.seq_len)
    if problem is not None:  # (a model's coefficients are never both 0)
        raise ConfigError("cost.model" if shape is not None else "cost", problem)
    srcs = d["sources"]
    if not isinstance(srcs, list) or not srcs:
        raise ConfigError("sources", "must be a non-empty list of sources")
    sources = tuple(_source(s, f"sources[{i}]") for i, s in enumerate(srcs))
    seen: dict[str, int] = {}
    for i, s in enumerate(sources):
        if s.name in seen:
            raise ConfigError(f"sources[{i}].name", f"duplicate source name {s.name!r} "
                              f"(also sources[{seen[s.name]}])")
        seen[s.name] = i
    _validate_weights(sources)
    patch_of: dict[int, int] = {}  # image sources' patch size -> first source index
    for i, s in enumerate(sources):
        if s.image is None:
            continue
        patch_of.setdefault(s.image.patch, i)
        if len(patch_of) > 1:
            raise ConfigError(f"sources[{i}].image.patch", f"must equal that of "
                              f"sources[{min(patch_of.values())}] (one batch holds the "
                              f"patches of all sources), got {s.image.patch}")
        if s.image.tokens > batch.seq_len:
            raise ConfigError(f"sources[{i}].image", f"an image is (size/patch)² = "
                              f"{s.image.tokens} image tokens, more than batch.seq_len "
                              f"{batch.seq_len}")
        if tokenizer.kind == "hf" and tokenizer.image_token_id is None:
            raise ConfigError("tokenizer.image_token_id", f"is required by the image+text "
                              f"source sources[{i}] (the id of an image patch)")
    seed = d.get("seed", Config.seed)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        # (the streams are seeded with 32 bits of it: a larger seed would repeat a smaller one's)
        raise ConfigError("seed", f"must be an integer in [0, 2**32), got {seed!r}")
    balance = d.get("balance", Config.balance)
    if balance not in KNOWN_BALANCE:
        raise ConfigError("balance",
                          f"unknown strategy {balance!r} (known: {', '.join(KNOWN_BALANCE)})")
    lc = d.get("long_context", {})
    _check_keys(lc, "long_context", _names(LongContextConfig))
    mode = lc.get("mode", LongContextConfig.mode)
    if mode not in ("spread", "grouped"):
        raise ConfigError("long_context.mode", f"must be 'spread' or 'grouped', got {mode!r}")
    long_context = LongContextConfig(mode=mode,
                                     max_per_rank=_int(lc, "max_per_rank", "long_context",
                                                       LongContextConfig.max_per_rank, lo=0))
    if mode == "grouped" and long_context.max_per_rank:  # (taken and not applied: a review)
        raise ConfigError("long_context.max_per_rank", "applies to mode 'spread' only (mode "
                          "'grouped' places long pieces on steps of their own); got "
                          f"{long_context.max_per_rank} with mode 'grouped'")
    # (accepted where every source was long: a rank then got at most k pieces a step, and
    # its other rows were all padding, a loss of 0/0 per micro-batch; and where a phase of
    # the weights gave the short sources 0: a review)
    for st in _weight_steps(sources):
        empty = rows_kept_empty(long_context.max_per_rank, batch.micro_batches, sources,
                                {s.name: s.weight.at(st) for s in sources})
        if empty is not None:
            raise ConfigError("long_context.max_per_rank",
                              f"at step {st}, {empty}: set it to at least micro_batches, or 0 "
                              "(no limit)")
    oc = d.get("outliers", {})
    _check_keys(oc, "outliers", _names(OutlierConfig))
    no_hold = long_context.places_long_pieces() and any(s.context == "long" for s in sources)
    ml = oc.get("min_length", OutlierConfig.min_length)
    if isinstance(ml, str):
        if ml != "auto":
            raise ConfigError("outliers.min_length", f"must be 'auto', a number of tokens or a "
                              f"fraction of batch.seq_len, got {ml!r}")
        if no_hold:  # the default: off where held pieces would land against the layout
            ml = 0
    elif isinstance(ml, float):
        if ml != 0 and not MIN_OUTLIER_SHARE <= ml < 1:
            raise ConfigError("outliers.min_length", f"a fraction of batch.seq_len must be "
                              f"at least {MIN_OUTLIER_SHARE} (1/32: shorter, nearly every piece "
                              f"is an outlier) and below 1, or 0 (off), got {ml!r}")
    else:
        ml = _int(oc, "min_length", "outliers", 0, lo=0)
    outliers = OutlierConfig(min_length=ml,
                             group=_int(oc, "group", "outliers", OutlierConfig.group, lo=0),
                             max_wait=_int(oc, "max_wait", "outliers", OutlierConfig.max_wait))
    if outliers.group > parallel.dp * batch.micro_batches:
        # (released a row each: the pieces over the rows were carried, behind the next group)
        raise ConfigError("outliers.group", f"must be at most the step's rows, parallel.dp × "
                          f"batch.micro_batches = {parallel.dp * batch.micro_batches} (0: that "
                          f"many), got {outliers.group}")
    if outliers.min_length and outliers.min_length != "auto" and no_hold:
        raise ConfigError("outliers.min_length", "cannot be combined with long_context.mode "
                          "'grouped' or long_context.max_per_rank while a source has context: "
                          "long (held pieces are released a row each at the front of a step, "
                          "wherever the layout wants them)")
    if not isinstance(outliers.min_length, str) and outliers.min_length > batch.seq_len:
        raise ConfigError("outliers.min_length", f"must be <= batch.seq_len ({batch.seq_len}), "
                          f"got {outliers.min_length} (a fraction such as 0.5 follows seq_len)")
    if isinstance(outliers.min_length, int) and 0 < outliers.min_length < (
            shortest := shortest_outlier(batch.seq_len)):
        raise ConfigError("outliers.min_length", f"must be 0 (off) or at least {shortest} "
                          f"tokens, 1/32 of batch.seq_len {batch.seq_len} (shorter, nearly every "
                          f"piece is an outlier), got {outliers.min_length}")
    sc = d.get("scaling", {})
    _check_keys(sc, "scaling", _names(ScalingConfig))
    policy = sc.get("policy", ScalingConfig.policy)
    if policy not in ("fixed", "adaptive"):
        raise ConfigError("scaling.policy", f"must be 'fixed' or 'adaptive', got {policy!r}")
    scaling = ScalingConfig(
        policy=policy,
        min_loaders=_int(sc, "min_loaders", "scaling", ScalingConfig.min_loaders),
        max_loaders=_int(sc, "max_loaders", "scaling", ScalingConfig.max_loaders),
        headroom=_num(sc, "headroom", "scaling", ScalingConfig.headroom, lo=1.0),
        starve_fraction=_num(sc, "starve_fraction", "scaling", ScalingConfig.starve_fraction),
        cooldown=_num(sc, "cooldown", "scaling", ScalingConfig.cooldown),
        scale_down_after=_num(sc, "scale_down_after", "scaling", ScalingConfig.scale_down_after),
        lookahead=_int(sc, "lookahead", "scaling", ScalingConfig.lookahead),
        interval=_num(sc, "interval", "scaling", ScalingConfig.interval, lo=0.05),
        roles_per_worker=_int(sc, "roles_per_worker", "scaling", ScalingConfig.roles_per_worker, lo=0),
    )
    if scaling.starve_fraction >= 1:
        # (a fraction of the window: 1 or more turned the reactive rule off, silently; a review)
        raise ConfigError("scaling.starve_fraction", "a fraction of the window the planner "
                          f"waited for a source: must be below 1, got {scaling.starve_fraction}")
    if scaling.max_loaders < scaling.min_loaders:
        raise ConfigError("scaling.max_loaders", f"must be >= scaling.min_loaders "
                          f"({scaling.min_loaders}), got {scaling.max_loaders}")
    for i, src in enumerate(sources):  # a source's own bounds, or scaling's where it has none
        lo = src.min_loaders or scaling.min_loaders
        hi = src.max_loaders or scaling.max_loaders
        if hi < lo:
            k = "max_loaders" if src.max_loaders else "min_loaders"
            raise ConfigError(f"sources[{i}].{k}", f"the source's bounds are min {lo}, max {hi} "
                              f"(0 takes scaling's): max must be >= min")
        if src.loaders > hi:
            # (started with it, a planner re-created after a loss clamps it: the count would
            # change on recovery, silently)
            raise ConfigError(f"sources[{i}].loaders", f"must be at most the source's "
                              f"max_loaders, {hi} (0 takes scaling's), got {src.loaders}: "
                              f"raise sources[{i}].max_loaders or scaling.max_loaders")
    prefetch = _int(d, "prefetch", "", Config.prefetch)
    round_steps = _int(d, "round_steps", "", Config.round_steps, lo=0)
    if round_steps > prefetch:
        raise ConfigError("round_steps", f"must be <= prefetch ({prefetch}): a round is planned "
                          f"only when every constructor has room for it, got {round_steps}")
    constructors = _int(d, "constructors", "", Config.constructors, lo=0)
    if constructors > parallel.dp:
        # (each serves whole DP groups: the ones beyond dp had none and still took a role on
        # a worker; a review)
        raise ConfigError("constructors", f"must be at most parallel.dp ({parallel.dp}): a "
                          f"constructor serves whole DP groups, got {constructors}")
    return Config(
        outliers=outliers,
        scaling=scaling,
        long_context=long_context,
        name=name,
        sources=sources,
        batch=batch,
        seed=seed,
        parallel=parallel,
        tokenizer=tokenizer,
        prefetch=prefetch,
        round_steps=round_steps,
        cost=cost_cfg,
        constructors=constructors,
        timeout=_num(d, "timeout", "", Config.timeout, lo=0.001, hi=MAX_TIMEOUT),
        balance=balance,
    )
