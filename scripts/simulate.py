"""Simulator of synchronous data-parallel training: per-rank loaders against msd_dask (issue 7).

N ranks train in lock step.  A rank's step time is its compute plus the time
it waits for its own data; the step waits for the slowest rank.

Compute
    The cost model ``α·L + β·L²`` of :class:`msd_dask.core.cost.CostModel` in
    seconds, derived from a stated model: dense layers ``24·H²·layers`` FLOPs
    per token forward, causal attention ``2·L²·H·layers`` FLOPs per document
    forward, both ×3 for forward + backward, divided by an achieved FLOP/s:
    ``α = 72·H²·layers / F`` and ``β = 6·H·layers / F`` (so ``β/α = 1/(12·H)``).
Documents
    Per source, lognormal lengths (median, sigma: a heavy tail where a tiny
    share of documents holds a large share of tokens), truncated at the
    context length and chunked to ``seq_len`` (default: the context length).
    Each source has a preprocessing cost in seconds per token.
(a) Baseline: per-rank loaders
    Each rank draws its own documents (source chosen at random per piece with
    the token shares of the weights), packs them with
    :func:`msd_dask.core.balance.sequential` and preprocesses them with its own
    ``W`` workers: data time = Σ preprocessing cost / W, overlapped with the
    previous step (the loader prefetches while the previous step runs, the
    barrier included): wait = max(0, data − previous step time).
(b) msd_dask
    The planner itself, end to end: a :class:`msd_dask.core.plan.Planner` built
    from a :class:`msd_dask.core.config.Config` holding the simulator's parameters
    (dp, micro_batches, seq_len, the sources and weights, ``cost`` = α, β,
    ``balance`` = the strategy, ``outliers`` with ``--outliers``) plans every
    step through its ``lookup(source, epoch, unit) -> lengths`` callable, as a
    service does with its loaders' metadata: the source streams' unit and
    document shuffles, the mixer, the fill loop, the carry, the outlier delay
    and the placement are all the planner's code.  Loaders are pooled:
    ``N × W`` workers in total, shared by demand, so the step waits only if the
    total preprocessing time exceeds the pooled capacity over the previous step.
Corpus
    Both sides read the same synthetic corpus (:class:`Corpus`): per source,
    units of ``unit_docs`` documents whose lengths are a pure function of the
    seed, the source and the unit; the baseline reads the units in order, the
    planner in its own shuffled order, so over an epoch both see the same
    documents.  A cell's corpus holds 1.5× the tokens it plans (no repeats).

Reported per (dp, context): imbalance (max/mean rank compute) of both, the
baseline's stall fraction, speedups (compute balance only, stalls only,
total = baseline step time / msd_dask step time), rows filled, useful tokens
and useful work (``α·l + β·l²`` of the placed pieces) per second of msd_dask
over the baseline, the tokens the planner still holds or carries at the end
(over those it placed: with the outlier delay, long pieces drawn but not
trained yet, so the step-time speedups favour it and work per second is the
fair total), and the wall-clock of ``Planner.plan_step`` per step (the
lookup's synthetic lengths included).
Every parameter is printed first.

    python scripts/simulate.py --quick
    python scripts/simulate.py --dp 64 1024 16384 --context 4096 32768 131072 --steps 8
    python scripts/simulate.py --steps 8 --outliers 0.5     # the planner's outlier delay on
    python scripts/simulate.py --control-plane              # the control plane's utilisation

``--control-plane`` prints another table instead (:func:`control_plane`): how busy the
scheduler, the planner and the constructors are at ``--cp-ranks`` ranks and a
``--cp-step-seconds`` step, from per-message costs (``--cp-*``, defaults measured by
``scripts/bench_many_readers.py``; docs/many_readers.md), for the ``queue`` design
(tickets through the scheduler's ``distributed.Queue``, up to commit 4c9bf24) and the
``direct`` one, which puts nothing on the scheduler per step (readers ask their
constructor for each round directly, since 276d230).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from msd_dask.core.balance import sequential
from msd_dask.core.config import Config, parse_config
from msd_dask.core.cost import CostModel
from msd_dask.core.plan import Planner, StepPlan
from msd_dask.formats import Unit

from cli_types import natural, non_negative_float, positive_float, positive_int

__all__ = ["SourceSpec", "SimConfig", "CellResult", "Corpus", "simulate", "planner_config",
           "default_strategy", "model_coefficients", "balance_bound", "main", "steps_for",
           "ControlPlaneCosts", "ControlPlaneRow", "control_plane"]


def default_strategy() -> str:
    """The balance strategy a service uses when the config names none."""
    return str(Config.__dataclass_fields__["balance"].default)


@dataclass(frozen=True)
class SourceSpec:
    """One source: token share, preprocessing seconds per token, lognormal lengths."""

    name: str
    weight: float
    prep: float
    median: float = 1024.0
    sigma: float = 2.0


DEFAULT_SOURCES = (SourceSpec("text", 0.7, 5e-7), SourceSpec("image", 0.3, 1e-5))


@dataclass(frozen=True)
class SimConfig:
    dp: int
    context: int
    seq_len: int = 0            # 0: the context length
    micro_batches: int = 1
    steps: int = 4
    hidden: int = 4096
    layers: int = 32
    flops: float = 4e14         # achieved FLOP/s per rank
    workers: int = 4            # loader workers per rank (baseline); pooled N×W for msd_dask
    sources: tuple[SourceSpec, ...] = DEFAULT_SOURCES
    strategy: str = field(default_factory=default_strategy)
    seed: int = 0
    plan_timeout: float = 0.0   # seconds per plan_step call, 0: none (then in process)
    outliers: float = 0.0       # the planner's outliers.min_length (0: off; < 1: a fraction of seq_len)
    unit_docs: int = 4096       # documents per unit of the synthetic corpus
    keep_plans: bool = False    # keep every StepPlan in CellResult.plans (small configs only)

    @property
    def row(self) -> int:
        return self.seq_len or self.context


def model_coefficients(hidden: int, layers: int, flops: float) -> tuple[float, float]:
    """``(α, β)`` in seconds: ``α·L + β·L²`` is a document's forward+backward time."""
    alpha = 3 * 24 * hidden * hidden * layers / flops
    beta = 3 * 2 * hidden * layers / flops
    return alpha, beta


def balance_bound(seq_len: int, hidden: int) -> float:
    """Upper bound of the compute-balance gain with equal tokens per rank.

    A rank of ``T`` tokens costs between ``α·T`` (tiny documents) and
    ``α·T + β·T·seq_len`` (every piece ``seq_len`` long, as ``Σ l² ≤ seq_len·Σ l``);
    the balanced step costs at least the mean ``≥ α·T``.  So
    ``baseline max / msd_dask max ≤ 1 + (β/α)·seq_len = 1 + seq_len / (12·H)``.
    """
    return 1.0 + seq_len / (12.0 * hidden)


def planner_config(cfg: SimConfig) -> Config:
    """The service config the simulated planner runs with: the simulator's own parameters."""
    alpha, beta = model_coefficients(cfg.hidden, cfg.layers, cfg.flops)
    ml: float | int = cfg.outliers if 0 < cfg.outliers < 1 else int(cfg.outliers)
    return parse_config({
        "name": "simulate",
        "seed": cfg.seed,
        "batch": {"seq_len": cfg.row, "micro_batches": cfg.micro_batches},
        "parallel": {"dp": cfg.dp},
        "balance": cfg.strategy,
        "cost": {"linear": alpha, "quadratic": beta},
        "outliers": {"min_length": ml},
        "sources": [{"name": s.name, "uri": f"memory://simulate/{s.name}/*.parquet",
                     "format": "parquet", "weight": s.weight} for s in cfg.sources],
    })


class Corpus:
    """The synthetic corpus both sides read: lengths of each unit's documents, per source.

    Unit ``u`` of source ``i`` holds ``unit_docs`` lognormal lengths (the source's
    median and sigma) drawn from a generator seeded by ``(seed, i, u)`` and
    truncated at ``context``: the same in every epoch, whoever reads it.

    Parameters
    ----------
    sources : tuple of SourceSpec
    context : int
    seed : int
    n_units : int
        Units per source.
    unit_docs : int
    """

    def __init__(self, sources: Sequence[SourceSpec], context: int, seed: int, n_units: int,
                 unit_docs: int):
        self.sources = {s.name: (i, s) for i, s in enumerate(sources)}
        self.context, self.seed, self.n_units, self.unit_docs = context, seed, n_units, unit_docs

    def units(self) -> dict[str, list[Unit]]:
        """Every source's units, sorted, as the planner takes them."""
        return {name: [Unit(f"{name}/unit-{u:07d}") for u in range(self.n_units)]
                for name in self.sources}

    def lengths(self, source: str, unit: int) -> np.ndarray:
        i, s = self.sources[source]
        rng = np.random.default_rng([self.seed, i, unit])
        docs = np.exp(rng.normal(np.log(s.median), s.sigma, self.unit_docs))
        return np.clip(np.ceil(docs), 1, self.context).astype(np.int64)

    def __call__(self, source: str, epoch: int, unit: int) -> np.ndarray:
        """The planner's ``lookup``: a unit's document lengths (the same every epoch)."""
        return self.lengths(source, unit)


class PieceSource:
    """The baseline's piece stream of one source: the corpus's units in order, chunked."""

    def __init__(self, corpus: Corpus, name: str, seq_len: int):
        self.corpus, self.name, self.seq_len = corpus, name, seq_len
        self.unit = 0
        self.buf = np.zeros(0, dtype=np.int64)
        self.pos = 0

    def _refill(self, need: int) -> None:
        blocks = [self.buf[self.pos:]]
        have = len(blocks[0])
        while have < need:
            docs = self.corpus.lengths(self.name, self.unit % self.corpus.n_units)
            self.unit += 1
            k = -(-docs // self.seq_len)                     # chunks per document
            pieces = np.full(int(k.sum()), self.seq_len, dtype=np.int64)
            last = np.cumsum(k) - 1
            pieces[last] = docs - (k - 1) * self.seq_len
            blocks.append(pieces)
            have += len(pieces)
        self.buf, self.pos = np.concatenate(blocks), 0

    def take(self, n: int) -> np.ndarray:
        if self.pos + n > len(self.buf):
            self._refill(n)
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def peek_block(self, n: int) -> np.ndarray:
        if self.pos + n > len(self.buf):
            self._refill(n)
        return self.buf[self.pos:self.pos + n]


@dataclass
class CellResult:
    """One (dp, context) cell; msd_dask fields are ``nan`` when the planner ran past its time limit."""

    cfg: SimConfig
    steps_run: int
    pieces_per_step: float   # pieces msd_dask placed per step
    imb_base: float          # mean over steps of max/mean rank compute
    imb_msd: float
    stall_frac_base: float   # share of the baseline's time spent waiting for data
    stall_frac_msd: float
    speedup_balance: float   # Σ max compute (baseline) / Σ max compute (msd_dask)
    speedup_stalls: float    # Σ baseline step time / Σ baseline compute-only step time
    speedup_total: float     # Σ baseline step time / Σ msd_dask step time
    speedup_ideal: float     # Σ baseline step time / Σ (lower bound of any assignment, no stalls)
    fill_base: float         # useful tokens / capacity
    fill_msd: float
    plan_ms: float           # wall-clock of Planner.plan_step per step
    plan_timed_out: bool
    bound: float
    pending: float = float("nan")   # tokens held or carried by the planner at the end / tokens placed
    work_gain: float = float("nan")  # useful work (α·l + β·l² of placed pieces) per second, msd / base
    per_step: dict[str, list[float]] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)

    @property
    def tokens_gain(self) -> float:
        """Useful tokens per second, msd_dask over baseline (total speedup × fill ratio)."""
        return self.speedup_total * self.fill_msd / self.fill_base


def _base_fill(streams: list[PieceSource], probs: np.ndarray, rng: np.random.Generator, budget: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank loaders' draws: source at random per piece, until ``budget`` tokens."""
    mean_len = max(1.0, float(np.mean([s.peek_block(4096).mean() for s in streams])))
    out_l: list[np.ndarray] = []
    out_s: list[np.ndarray] = []
    left = budget
    while left > 0:
        n = int(left / mean_len * 1.2) + 64
        choice = rng.choice(len(streams), size=n, p=probs)
        lens = np.empty(n, dtype=np.int64)
        counts = np.bincount(choice, minlength=len(streams))
        blocks = [s.peek_block(int(c)) for s, c in zip(streams, counts, strict=True)]
        for i in range(len(streams)):
            lens[choice == i] = blocks[i][:counts[i]]
        cum = np.cumsum(lens)
        k = int(np.searchsorted(cum, left, side="right"))
        taken = np.bincount(choice[:k], minlength=len(streams))
        for s, t in zip(streams, taken, strict=True):
            s.take(int(t))
        out_l.append(lens[:k])
        out_s.append(choice[:k])
        left -= int(cum[k - 1]) if k else 0
        if k < n:
            break
    return np.concatenate(out_l), np.concatenate(out_s)


def corpus_for(cfg: SimConfig) -> Corpus:
    """The cell's corpus, sized to hold 1.5× the tokens the cell plans (so no document repeats)."""
    probe = Corpus(cfg.sources, cfg.context, cfg.seed, 1, 65536)
    wsum = sum(s.weight for s in cfg.sources)
    need = 1.5 * cfg.steps * cfg.dp * cfg.micro_batches * cfg.row
    n_units = max(int(need * s.weight / wsum / (float(probe.lengths(s.name, 0).mean()) * cfg.unit_docs))
                  for s in cfg.sources)
    return Corpus(cfg.sources, cfg.context, cfg.seed, n_units + 8, cfg.unit_docs)


def _msd_steps(cfg: SimConfig, corpus: Corpus, planned: Callable[[float], None] | None = None
               ) -> Iterator[dict[str, Any]]:
    """Plan ``cfg.steps`` steps with the planner; per step, what the simulation needs of it.

    ``planned(seconds)`` is called as soon as each ``plan_step`` returns.
    """
    alpha, beta = model_coefficients(cfg.hidden, cfg.layers, cfg.flops)
    dense = alpha * cfg.micro_batches * cfg.row
    prep = {s.name: s.prep for s in cfg.sources}
    pl = Planner(planner_config(cfg), corpus.units())
    for _ in range(cfg.steps):
        t0 = time.perf_counter()
        plan = pl.plan_step(corpus)
        secs = time.perf_counter() - t0
        if planned is not None:
            planned(secs)
        sq = np.zeros(cfg.dp)
        tokens = data = 0.0
        pieces = largest = 0
        for r, rank in enumerate(plan.rows):
            s = 0
            for row in rank:
                for p in row:
                    n = p.end - p.start
                    s += n * n
                    tokens += n
                    data += n * prep[p.source]
                    largest = max(largest, n)
                pieces += len(row)
            sq[r] = s
        yield {"comp": dense + beta * sq, "data": data, "tokens": tokens, "pieces": pieces,
               "work": alpha * tokens + beta * float(sq.sum()),
               "ideal": dense + beta * max(float(sq.sum()) / cfg.dp, float(largest) ** 2), "plan_s": secs,
               "pending": float(sum(p.length for p in pl.pending())),
               "plan": plan if cfg.keep_plans else None}


def _msd_child(conn: Any, cfg: SimConfig, corpus: Corpus) -> None:  # pragma: no cover - forked child
    for rec in _msd_steps(cfg, corpus, conn.send):
        conn.send(rec)
    conn.close()


def _msd_limited(cfg: SimConfig, corpus: Corpus) -> Iterator[dict[str, Any] | None]:
    """:func:`_msd_steps`, in a forked child when ``cfg.plan_timeout > 0``; ``None`` (then the
    end) when a step runs past the limit."""
    if cfg.plan_timeout <= 0:
        yield from _msd_steps(cfg, corpus)
        return
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_msd_child, args=(child, cfg, corpus), daemon=True)
    proc.start()
    child.close()
    try:
        for _ in range(cfg.steps):
            # the limit is per plan_step call (its time comes first); then the step's record
            if not parent.poll(cfg.plan_timeout) or parent.recv() > cfg.plan_timeout:
                yield None
                return
            yield parent.recv()
    finally:
        proc.terminate()
        proc.join()


def simulate(cfg: SimConfig) -> CellResult:
    """Run one (dp, context) cell for ``cfg.steps`` steps; both sides read the same corpus.

    True compute of a rank: ``α·(rows × seq_len) + β·Σ l²`` (rows are fixed-shape, so padding goes
    through the dense layers; attention is per piece).  The planner balances the service's own cost
    model ``α·l + β·l²`` (:class:`msd_dask.core.cost.CostModel`) with the same α, β.
    """
    alpha, beta = model_coefficients(cfg.hidden, cfg.layers, cfg.flops)
    cost = CostModel(linear=alpha, quadratic=beta)
    seq_len, dp, mb, W = cfg.row, cfg.dp, cfg.micro_batches, cfg.workers
    capacity = dp * mb * seq_len
    dense = alpha * mb * seq_len
    prep = np.array([s.prep for s in cfg.sources])
    wsum = sum(s.weight for s in cfg.sources)
    weights = {s.name: s.weight / wsum for s in cfg.sources}
    corpus = corpus_for(cfg)

    # ---------------- baseline: per-rank loaders, sequential packing, own workers
    base_streams = [PieceSource(corpus, s.name, seq_len) for s in cfg.sources]
    # per-piece source probabilities giving the weights' token shares
    mean_piece = np.array([s.peek_block(65536).mean() for s in base_streams])
    probs = np.array([weights[s.name] for s in cfg.sources]) / mean_piece
    probs /= probs.sum()
    rng = np.random.default_rng([cfg.seed, 7])
    carry_b = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    keys = ("comp_b", "step_b", "imb_b", "fill_b", "work_b", "ideal", "comp_m", "step_m", "imb_m",
            "fill_m", "work_m", "plan_s", "pieces")
    rec: dict[str, list[float]] = {k: [] for k in keys}
    prev: float | None = None
    for _ in range(cfg.steps):
        l_new, s_new = _base_fill(base_streams, probs, rng, capacity - int(carry_b[0].sum()))
        lb, sb = np.concatenate([carry_b[0], l_new]), np.concatenate([carry_b[1], s_new])
        a = sequential(lb, cost(lb), dp, mb, seq_len)
        ok = a.rank >= 0
        comp = dense + np.bincount(a.rank[ok], weights=beta * lb[ok] ** 2.0, minlength=dp)
        data = np.bincount(a.rank[ok], weights=lb[ok] * prep[sb[ok]], minlength=dp) / W
        carry_b = (lb[~ok], sb[~ok])
        window = prev if prev is not None else float(comp.max())   # step 0: prefetched at start
        prev = float((comp + np.maximum(0.0, data - window)).max())
        rec["comp_b"].append(float(comp.max()))
        rec["step_b"].append(prev)
        rec["imb_b"].append(float(comp.max() / comp.mean()))
        rec["fill_b"].append(float(lb[ok].sum()) / capacity)
        rec["work_b"].append(float(cost(lb[ok]).sum()))

    # ---------------- msd_dask: the planner (global mix, fill, outlier delay, balance), pooled loaders
    timed_out = False
    pending = float("nan")
    plans: list[StepPlan] = []
    prev = None
    for m in _msd_limited(cfg, corpus):
        if m is None:
            timed_out = True
            rec["plan_s"].append(cfg.plan_timeout)   # the step that ran past the limit
            break
        comp = m["comp"]
        window = prev if prev is not None else float(comp.max())
        prev = float(comp.max()) + max(0.0, m["data"] / (dp * W) - window)
        rec["plan_s"].append(m["plan_s"])
        rec["pieces"].append(float(m["pieces"]))
        rec["ideal"].append(m["ideal"])
        rec["comp_m"].append(float(comp.max()))
        rec["step_m"].append(prev)
        rec["imb_m"].append(float(comp.max() / comp.mean()))
        rec["fill_m"].append(m["tokens"] / capacity)
        rec["work_m"].append(m["work"])
        pending = m["pending"]
        if m["plan"] is not None:
            plans.append(m["plan"])

    S = {k: float(np.sum(v)) if v else float("nan") for k, v in rec.items()}
    M = {k: float(np.mean(v)) if v else float("nan") for k, v in rec.items()}
    nan = float("nan")
    return CellResult(
        cfg=cfg, steps_run=len(rec["step_b"]), pieces_per_step=M["pieces"],
        imb_base=M["imb_b"], imb_msd=nan if timed_out else M["imb_m"],
        stall_frac_base=1.0 - S["comp_b"] / S["step_b"],
        stall_frac_msd=nan if timed_out else 1.0 - S["comp_m"] / S["step_m"],
        speedup_balance=nan if timed_out else S["comp_b"] / S["comp_m"],
        speedup_stalls=S["step_b"] / S["comp_b"],
        speedup_total=nan if timed_out else S["step_b"] / S["step_m"],
        speedup_ideal=nan if timed_out else S["step_b"] / S["ideal"],
        fill_base=M["fill_b"], fill_msd=nan if timed_out else M["fill_m"],
        plan_ms=1e3 * M["plan_s"],
        plan_timed_out=timed_out, bound=balance_bound(seq_len, cfg.hidden),
        pending=nan if timed_out else pending / (S["fill_m"] * capacity),
        work_gain=nan if timed_out else (S["work_m"] / S["step_m"]) / (S["work_b"] / S["step_b"]),
        per_step=rec, plans=plans,
    )


# ------------------------------------------------------------------------------------ control plane
@dataclass(frozen=True)
class ControlPlaneCosts:
    """Per-message CPU costs of the control plane, in seconds (defaults: see docs/many_readers.md).

    Attributes
    ----------
    sched_rank_step : float
        The scheduler's CPU per rank and step with the ``queue`` design, net of its
        idle load (``bench_many_readers.py``: sched CPU/step ÷ ranks).
    queue_op : float
        One ``distributed.Queue`` put or get on the scheduler.
    connect : float
        The scheduler's CPU per client that connects (one per training process).
    plan_rank_step : float
        The planner's ``plan_step`` time per DP rank and step (one planner, one thread).
    constructor_rank_step : float
        Constructor CPU per rank and step (packing, hand-over), summed over constructors.
    client_beat : float
        The scheduler's CPU per connected client and heartbeat interval (the client's
        heartbeat; a Dask client's ``identity`` call too, which msd_dask's clients stop),
        in both designs.  Dask stretches a
        client's interval with the number of clients (:func:`client_interval`), so the
        idle load of ``n`` clients is ``n × client_beat / client_interval(n)``: at most
        about 20 beats a second, whatever ``n``.
    scheduler_idle : float
        Cores a scheduler uses with nothing connected (its own periodic callbacks).
    worker_beat : float
        The scheduler's CPU per worker heartbeat; a worker beats every
        ``heartbeat_interval(workers)`` s (Dask's rule: about 200 beats a second at most).
    """

    # bench_many_readers.py, queue design (commit 4c9bf24), 1,024 ranks, rounds of
    # MEASURED_ROUND_STEPS steps: control_plane scales it to other rounds
    sched_rank_step: float = 250e-6
    # one put or get: the figure above is 2 of them per rank and round, plus the replies
    queue_op: float = 0.3e-3
    # a training process's client; bench_many_readers.py: 4-9 ms per host (client + 8 readers)
    connect: float = 9e-3
    # bench_balance.py, the planner end to end at dp 16,384 × 8 rows per rank × 4K: 87-102 ms
    # (a quiet machine to a busy one), the upper end
    plan_rank_step: float = 0.102 / 16384
    # bench_many_readers.py, the direct design at 1,024 ranks: 0.64 ms per rank-step, every
    # role of the workers (the planner's too) net of their idle load, rounded up: an upper
    # bound for the constructors (steps of 256-token rows; per message, not per token)
    constructor_rank_step: float = 0.7e-3
    # bench_idle_clients.py, clients as msd_dask makes them (no periodic identity call):
    # 0.40-0.81 ms per client and interval with 128 and 512 clients (Dask's own clients
    # 0.82-1.16 in the same runs), rounded up
    client_beat: float = 1.0e-3
    # bench_idle_clients.py: "idle cores" of a scheduler with nothing connected, 0.016-0.022
    # (docs/many_readers.md), rounded up
    scheduler_idle: float = 0.025
    # bench_idle_clients.py --workers 24 / 48: 0.29 / 0.31 ms per worker heartbeat
    worker_beat: float = 0.30e-3


#: the rounds (steps per ticket) :attr:`ControlPlaneCosts.sched_rank_step` was measured with
MEASURED_ROUND_STEPS = 3


def client_interval(clients: int) -> float:
    """Seconds between two heartbeats (and ``identity`` calls) of each of ``clients`` Dask
    clients: the scheduler tells every client ``10 × heartbeat_interval(clients)`` (Dask's
    own rule, ``distributed.scheduler.heartbeat_interval``)."""
    from distributed.scheduler import heartbeat_interval

    return 10.0 * heartbeat_interval(clients)


@dataclass(frozen=True)
class ControlPlaneRow:
    """One design at one size: each role's busy fraction of a step (1.0: saturated)."""

    design: str
    ranks: int
    dp: int
    scheduler: float          # from the per-message model (queue ops, clients, Dask's own)
    scheduler_measured: float  # from the measured per-rank-step CPU (+ the rest); nan: none
    planner: float
    constructor: float        # each of the constructors (the load is shared evenly)
    connect_s: float          # the scheduler's CPU seconds to connect every client
    dask: float = 0.0         # of the scheduler's: Dask's own (idle, workers' heartbeats)

    @property
    def busiest(self) -> float:
        """The largest busy fraction among the roles (> 1: the step cannot be held), the
        scheduler's measured figure included where there is one."""
        measured = [] if math.isnan(self.scheduler_measured) else [self.scheduler_measured]
        return max(self.scheduler, self.planner, self.constructor, *measured)


def control_plane(costs: ControlPlaneCosts, ranks: int, step_seconds: float, round_steps: int = 3,
                  tp: int = 8, constructors: int = 32, clients: int | None = None,
                  workers: int = 0) -> list[ControlPlaneRow]:
    """Each role's utilisation (busy seconds per step / ``step_seconds``) at ``ranks`` ranks.

    ``queue``: every rank's reader takes one ticket per round of ``round_steps``
    steps from its ``distributed.Queue`` on the scheduler, which a constructor put
    there: 2 queue operations per rank and round (``scheduler``), or the measured CPU
    per rank-step, scaled from its rounds of :data:`MEASURED_ROUND_STEPS` steps to
    ``round_steps`` (``scheduler_measured``).  ``direct``: readers ask their
    constructor for each round directly (the rank → constructor map is fixed), so
    nothing per step reaches the scheduler; the constructors are charged one more
    request per rank and round, at a queue operation's cost (an upper bound: in
    msd_dask that request replaced the claim, so they answer no more calls).  In both,
    the scheduler carries the idle load of ``clients`` clients (default one per
    rank; see :attr:`ControlPlaneCosts.client_beat`), the planner plans ``ranks / tp`` DP
    ranks per step, and the constructors share the per-rank-step packing evenly.

    Parameters
    ----------
    costs : ControlPlaneCosts
    ranks : int
    step_seconds : float
    round_steps : int
        Steps per ticket (the config's ``round_steps``, default ``prefetch - 1`` = 3).
    tp : int
        Ranks per DP group (they share one plan entry).
    constructors : int
    clients : int, optional
        Connected clients (default ``ranks``: one training process per rank).
    workers : int
        The cluster's workers: with them the scheduler carries Dask's own load, its idle
        load and the workers' heartbeats (``0``: left out, the service's readers' part
        alone).

    Returns
    -------
    list of ControlPlaneRow
        ``queue`` then ``direct``.
    """
    clients = ranks if clients is None else clients
    # (negative workers or clients gave negative loads, a NaN step NaN loads that the
    # busiest role's max skipped; a review)
    if ranks < 1 or round_steps < 1 or tp < 1 or constructors < 1 or clients < 0 or \
            workers < 0 or not (math.isfinite(step_seconds) and step_seconds > 0):
        raise ValueError("ranks, round_steps, tp and constructors must be >= 1, clients and "
                         "workers >= 0, step_seconds a finite number > 0")
    dp = max(1, ranks // tp)
    from distributed.scheduler import heartbeat_interval

    dask = (costs.scheduler_idle + workers * costs.worker_beat / heartbeat_interval(workers)
            if workers else 0.0)
    idle = clients * costs.client_beat / client_interval(clients) + dask
    planner = costs.plan_rank_step * dp / step_seconds
    packing = costs.constructor_rank_step * ranks / step_seconds / constructors
    per_round = ranks / round_steps / step_seconds   # rank-rounds per second
    connect = clients * costs.connect
    return [
        ControlPlaneRow("queue", ranks, dp, idle + 2 * costs.queue_op * per_round,
                        idle + costs.sched_rank_step * MEASURED_ROUND_STEPS / round_steps * ranks
                        / step_seconds, planner, packing,
                        connect, dask),
        ControlPlaneRow("direct", ranks, dp, idle, idle, planner,
                        packing + costs.queue_op * per_round / constructors, connect, dask),
    ]


def print_control_plane(args: argparse.Namespace) -> None:
    """The ``--control-plane`` table, with the costs it used."""
    c = ControlPlaneCosts(args.cp_sched_rank_step, args.cp_queue_op, args.cp_connect,
                          args.cp_plan_rank_step, args.cp_constructor_rank_step,
                          args.cp_client_beat, args.cp_scheduler_idle, args.cp_worker_beat)
    print("# control plane: each role's busy fraction of a step (1.00: saturated)")
    print(f"step {args.cp_step_seconds:g} s, round_steps {args.cp_round_steps}, tp {args.cp_tp}, "
          f"{args.cp_constructors} constructors, one client per {args.cp_ranks_per_client} "
          f"rank(s), {args.cp_workers} workers")
    print(f"costs: scheduler {c.sched_rank_step * 1e6:.1f} us per rank-step (measured), queue op "
          f"{c.queue_op * 1e3:.2f} ms, connect {c.connect * 1e3:.1f} ms per client, "
          f"{c.client_beat * 1e3:.2f} ms per client heartbeat, {c.worker_beat * 1e3:.2f} ms per "
          f"worker heartbeat, {c.scheduler_idle:.3f} cores idle; planner "
          f"{c.plan_rank_step * 1e6:.1f} us per DP rank-step; constructors "
          f"{c.constructor_rank_step * 1e3:.3f} ms per rank-step")
    hdr = (f"{'ranks':>7} {'dp':>6} {'design':<8} {'scheduler':>9} {'(measured)':>10} "
           f"{'of it Dask':>10} {'planner':>8} {'constructor':>11} {'busiest':>8} "
           f"{'connect s':>9}")
    print(hdr)
    print("-" * len(hdr))
    for n in args.cp_ranks:
        for r in control_plane(c, n, args.cp_step_seconds, args.cp_round_steps, args.cp_tp,
                               args.cp_constructors, -(-n // args.cp_ranks_per_client),
                               args.cp_workers):
            print(f"{r.ranks:>7} {r.dp:>6} {r.design:<8} {r.scheduler:>9.2f} "
                  f"{r.scheduler_measured:>10.2f} {r.dask:>10.2f} {r.planner:>8.2f} "
                  f"{r.constructor:>11.2f} {r.busiest:>8.2f} {r.connect_s:>9.0f}")


# ---------------------------------------------------------------------------------------------- CLI
def _parse_source(text: str) -> SourceSpec:
    parts = text.split(":")
    if len(parts) not in (3, 5):
        raise argparse.ArgumentTypeError("source is name:weight:prep_s_per_token[:median:sigma]")
    try:
        name, w, p = parts[0], float(parts[1]), float(parts[2])
        extra = [float(x) for x in parts[3:]]
    except ValueError:
        raise argparse.ArgumentTypeError(f"source is name:weight:prep_s_per_token"
                                         f"[:median:sigma] of numbers, got {text!r}") from None
    if not (w >= 0 and p >= 0 and all(map(math.isfinite, (w, p, *extra)))):
        raise argparse.ArgumentTypeError(f"a source's weight and seconds per token are finite "
                                         f"numbers >= 0, got {text!r}")
    if extra and not (extra[0] >= 1 and extra[1] >= 0):
        # (a median of 0 made 261,881 one-token pieces with only numpy's warning; a review)
        raise argparse.ArgumentTypeError(f"a source's median length is >= 1 token and its "
                                         f"sigma >= 0, got {text!r}")
    return SourceSpec(name, w, p, *extra)


def _min_length(text: str) -> float:
    v = float(text)
    if not v >= 0 or math.isinf(v) or (v >= 1 and not v.is_integer()):  # (nan passed; a review)
        raise argparse.ArgumentTypeError("MIN_LENGTH is tokens (an integer), a fraction of seq_len in "
                                         f"(0, 1), or 0 (off), got {text}")
    return v


def _tail_share(spec: SourceSpec, context: int, seed: int, top: float = 0.01) -> float:
    """Share of tokens held by the longest ``top`` of documents (after truncation at ``context``)."""
    rng = np.random.default_rng([seed, 99])
    d = np.clip(np.ceil(np.exp(rng.normal(np.log(spec.median), spec.sigma, 200_000))), 1, context)
    d = np.sort(d)[::-1]
    return float(d[: int(len(d) * top)].sum() / d.sum())


def steps_for(dp: int, tokens_per_rank: int, steps: int, token_budget: float) -> int:
    """Fewer steps for big cells: at most ``token_budget`` tokens per cell, at least 2 steps."""
    return int(max(2, min(steps, token_budget // (dp * tokens_per_rank))))




def main(argv: Sequence[str] | None = None) -> int:
    from msd_dask.core.balance import STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=positive_int, nargs="+", default=[64, 1024, 16384],
                    help="DP ranks, one table row each (default 64 1024 16384)")
    ap.add_argument("--context", type=positive_int, nargs="+", default=[4096, 32768, 131072],
                    help="context lengths in tokens (default 4096 32768 131072)")
    ap.add_argument("--seq-len", type=natural, default=0,
                    help="row length (default 0: the context length)")
    ap.add_argument("--micro-batches", type=positive_int, default=8,
                    help="rows of seq_len per rank per step (gradient accumulation; default 8)")
    ap.add_argument("--steps", type=positive_int, default=8,
                    help="steps per cell, before the token budget (default 8)")
    ap.add_argument("--token-budget", type=positive_float, default=2.0**33,
                    help="max tokens simulated per cell (fewer steps for big cells, at least 2; "
                         "default 2**33)")
    ap.add_argument("--hidden", type=positive_int, default=4096,
                    help="the model's hidden size H (default 4096)")
    ap.add_argument("--layers", type=positive_int, default=32,
                    help="the model's layers (default 32)")
    ap.add_argument("--flops", type=positive_float, default=4e14,
                    help="achieved FLOP/s per rank (default 4e14)")
    ap.add_argument("--workers", type=positive_int, default=4,
                    help="loader workers per rank (default 4)")
    ap.add_argument("--source", type=_parse_source, action="append",
                    help="name:weight:prep_s_per_token[:median:sigma] (repeat; default "
                         + " and ".join(f"{s.name}:{s.weight:g}:{s.prep:g}:{s.median:g}:{s.sigma:g}"
                                        for s in DEFAULT_SOURCES) + ")")
    ap.add_argument("--strategy", default=default_strategy(), choices=sorted(STRATEGIES),
                    help=f"the planner's balance strategy (default {default_strategy()})")
    ap.add_argument("--seed", type=int, default=0, help="the corpus's and planner's seed (default 0)")
    ap.add_argument("--plan-timeout", type=positive_float, default=300.0,
                    help="seconds one Planner.plan_step call may take before the cell reports it "
                         "timed out (default 300)")
    ap.add_argument("--outliers", type=_min_length, default=0.0, metavar="MIN_LENGTH",
                    help="the planner's outlier delay, outliers.min_length: tokens, or a fraction of "
                         "seq_len if < 1 (e.g. 0.5); 0: off (default)")
    ap.add_argument("--unit-docs", type=positive_int, default=4096,
                    help="documents per unit of the corpus (default 4096)")
    ap.add_argument("--quick", action="store_true",
                    help="2 steps, a token budget of 2**30 and a 15 s planner limit")
    ap.add_argument("--plot", default="", help="write a PNG of the speedups here")
    cp = ap.add_argument_group("control plane", "--control-plane prints each role's busy "
                               "fraction of a step at scale instead of simulating (the "
                               "per-message costs below; docs/many_readers.md)")
    d = ControlPlaneCosts()
    cp.add_argument("--control-plane", action="store_true", help="print the table and exit")
    cp.add_argument("--cp-ranks", type=positive_int, nargs="+", default=[4096, 16384],
                    help="rank counts (default 4096 16384)")
    cp.add_argument("--cp-step-seconds", type=positive_float, default=1.0,
                    help="the training step in seconds (default 1)")
    cp.add_argument("--cp-round-steps", type=positive_int, default=3,
                    help="steps per round: one ticket or request per rank and round (default 3)")
    cp.add_argument("--cp-tp", type=positive_int, default=8, help="ranks per DP group (default 8)")
    cp.add_argument("--cp-constructors", type=positive_int, default=32,
                    help="constructors sharing the packing (default 32)")
    cp.add_argument("--cp-ranks-per-client", type=positive_int, default=1,
                    help="ranks per Dask client: 1, one training process per rank (default); "
                         "8, one process per host of 8 GPUs")
    cp.add_argument("--cp-workers", type=natural, default=256,
                    help="the cluster's workers, whose heartbeats the scheduler handles "
                         "(default 256; 0: leave Dask's own load out)")
    for name, what in (("sched_rank_step", "scheduler CPU s per rank-step, queue design (measured)"),
                       ("queue_op", "s per distributed.Queue put or get on the scheduler"),
                       ("connect", "scheduler CPU s per client connect"),
                       ("plan_rank_step", "planner s per DP rank-step"),
                       ("constructor_rank_step", "constructor CPU s per rank-step (all of them)"),
                       ("client_beat", "scheduler CPU s per client and heartbeat interval"),
                       ("scheduler_idle", "cores of a scheduler with nothing connected"),
                       ("worker_beat", "scheduler CPU s per worker heartbeat")):
        cp.add_argument("--cp-" + name.replace("_", "-"), type=non_negative_float,
                        default=getattr(d, name),
                        help=f"{what} (default {getattr(d, name):.3g})")
    args = ap.parse_args(argv)
    if args.control_plane:
        print_control_plane(args)
        return 0
    if args.quick:
        args.steps, args.token_budget = min(args.steps, 2), 2.0**30
        args.plan_timeout = min(args.plan_timeout, 15.0)
    sources = tuple(args.source) if args.source else DEFAULT_SOURCES
    # (a name given twice, or weights of 0, failed after the header as a traceback naming a
    # YAML key; a review)
    names = [s.name for s in sources]
    if len(set(names)) < len(names):
        ap.error(f"--source: a source's name is given twice: {names}")
    if not sum(s.weight for s in sources) > 0:
        ap.error("--source: the sources' weights sum to 0")
    alpha, beta = model_coefficients(args.hidden, args.layers, args.flops)

    print("# msd_dask simulator (issue 7) — parameters")
    print(f"model: hidden={args.hidden} layers={args.layers} achieved={args.flops:.3g} FLOP/s per rank")
    print(f"  α = 72·H²·layers/F = {alpha:.4g} s/token   β = 6·H·layers/F = {beta:.4g} s/token²"
          f"   β/α = 1/(12·H) = {beta / alpha:.4g}")
    row = args.seq_len or "context"
    print(f"batch: micro_batches={args.micro_batches} seq_len={row}"
          f"   steps={args.steps} (capped by token budget {args.token_budget:.3g} tokens/cell, min 2)"
          f"   planner limit {args.plan_timeout:g} s/step")
    print("compute of a rank: α·(micro_batches·seq_len) + β·Σ piece² (rows are fixed-shape: padding goes"
          " through the dense layers)")
    print(f"loaders: W={args.workers} workers per rank (baseline own; msd_dask pooled N×W)"
          f"   strategy={args.strategy} (Config.balance default: {default_strategy()})   seed={args.seed}")
    oc = planner_config(SimConfig(dp=1, context=max(args.context), seq_len=args.seq_len,
                                  outliers=args.outliers, sources=sources)).outliers
    print("msd_dask: msd_dask.core.plan.Planner end to end (Config from these parameters, lookup = the "
          f"corpus); shuffle_window={planner_config(SimConfig(dp=1, context=1)).sources[0].shuffle_window}"
          " units; outlier delay "
          + (f"ON: outliers.min_length={oc.min_length:g}"
             + (f" (pieces > {oc.min_length:g}·seq_len)" if 0 < oc.min_length < 1 else " tokens")
             + f", group={oc.group or 'dp×micro_batches rows'}, max_wait={oc.max_wait} steps"
             if args.outliers else "off (outliers.min_length=0)"))
    print(f"corpus: per source, units of {args.unit_docs} documents, lengths a function of (seed, source,"
          " unit); the baseline reads units in order, the planner in its shuffled order; each cell's"
          " corpus holds 1.5× the tokens it plans")
    for s in sources:
        print(f"source {s.name}: weight={s.weight} prep={s.prep:.3g} s/token  lognormal median={s.median:g} "
              f"sigma={s.sigma:g}  top-1% docs hold {100 * _tail_share(s, 1 << 62, args.seed):.0f}% of "
              "tokens before truncation; after: "
              + ", ".join(f"{100 * _tail_share(s, c, args.seed):.0f}% @ctx {c}" for c in args.context))
    for s in sources:
        print(f"  {s.name}: a rank of only this source stalls the baseline when prep/W > α "
              f"(= {s.prep / args.workers:.3g} vs {alpha:.3g} s/token: "
              f"{'yes' if s.prep / args.workers > alpha else 'no'})")
    print("bound on the balance gain with equal tokens per rank: 1 + seq_len/(12·H) = "
          + ", ".join(f"{balance_bound(args.seq_len or c, args.hidden):.3f} @ctx {c}" for c in args.context))
    print()
    hdr = (f"{'dp':>6} {'context':>7} {'steps':>5} {'pieces/st':>9} {'imb base':>8} {'imb msd':>7} "
           f"{'bound':>6} {'stall% b':>8} {'spd bal':>7} {'spd stall':>9} {'spd tot':>7} {'spd LB':>6} "
           f"{'fill b/m %':>11} {'tok/s x':>7} {'work/s x':>8} {'held%':>5} {'plan ms/st':>10}")
    print(hdr)
    print("-" * len(hdr))
    results = []
    for ctx in args.context:
        for dp in args.dp:
            per_rank = (args.seq_len or ctx) * args.micro_batches
            cfg = SimConfig(dp=dp, context=ctx, seq_len=args.seq_len, micro_batches=args.micro_batches,
                            steps=steps_for(dp, per_rank, args.steps, args.token_budget), hidden=args.hidden,
                            layers=args.layers, flops=args.flops, workers=args.workers, sources=sources,
                            strategy=args.strategy, seed=args.seed, plan_timeout=args.plan_timeout,
                            outliers=args.outliers, unit_docs=args.unit_docs)
            r = simulate(cfg)
            results.append(r)
            plan = f"{'>' if r.plan_timed_out else ''}{r.plan_ms:.0f}"
            print(f"{dp:>6} {ctx:>7} {r.steps_run:>5} {r.pieces_per_step:>9.0f} {r.imb_base:>8.3f} "
                  f"{r.imb_msd:>7.3f} {r.bound:>6.3f} {100 * r.stall_frac_base:>8.2f} "
                  f"{r.speedup_balance:>7.3f} {r.speedup_stalls:>9.3f} {r.speedup_total:>7.3f} "
                  f"{r.speedup_ideal:>6.3f} {100 * r.fill_base:>5.1f}/{100 * r.fill_msd:<5.1f} "
                  f"{r.tokens_gain:>7.3f} {r.work_gain:>8.3f} {100 * r.pending:>5.1f} {plan:>10}",
                  flush=True)
    if args.plot:
        _plot(results, args.plot)
        print(f"\nplot: {args.plot}")
    return 0


def _plot(results: list[CellResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    dps = sorted({r.cfg.dp for r in results})
    for dp in dps:
        rs = sorted((r for r in results if r.cfg.dp == dp), key=lambda r: r.cfg.context)
        x = [r.cfg.context for r in rs]
        line = axes[0].plot(x, [r.speedup_total for r in rs], "o-", label=f"step time, dp={dp}")[0]
        axes[0].plot(x, [r.speedup_ideal for r in rs], "^:", color=line.get_color(),
                     label=f"limit of any assignment, dp={dp}")
        axes[0].plot(x, [r.tokens_gain for r in rs], "s--", color=line.get_color(),
                     label=f"useful tokens/s, dp={dp}")
        axes[1].plot(x, [r.imb_base for r in rs], "o-", label=f"baseline, dp={dp}")
        axes[1].plot(x, [r.imb_msd for r in rs], "x--", label=f"msd_dask, dp={dp}")
    # (each cell's own bound, of its row length: with --seq-len the line took the context
    # for L, and drew 1.083-1.667 where the table said 1.021; a review)
    bounds = {r.cfg.context: r.bound for r in results}
    axes[0].plot(sorted(bounds), [bounds[c] for c in sorted(bounds)], "k:",
                 label="bound 1+L/(12H)")
    axes[0].plot([4096, 8192, 16384], [1.71, 2.63, 3.09], "rs", label="MegaScale-Data (paper)")
    for ax, t in zip(axes, ("speedup (baseline / msd_dask step time)", "max/mean rank compute"),
                     strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(t)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="upper left", ncol=2 if ax is axes[0] else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())

