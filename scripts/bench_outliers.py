"""Outlier delay on the demo corpus: what the pieces of each step allow, with and without it.

The planner itself (:class:`msd_dask.core.plan.Planner`, the service's code) plans
``--steps`` steps of the demo corpus (``configs/demo.yaml``'s sources, weights
and seed, byte tokenizer) for ``dp`` ranks × ``micro_batches`` rows of
``seq_len`` tokens, once without outlier delay and once per ``min_length`` of
``--min-lengths`` (``outliers: {min_length: ...}``, other keys at their
defaults).  Costs are ``L + r·L²`` with ``r = --ratio`` (β/α).

Columns, means over the steps: ``imbalance`` (max over mean rank cost of the
planner's placement), ``bound`` (:func:`msd_dask.core.balance.capacity_bound` over
the mean: the best any placement of that step's pieces could reach),
``wait`` (the mean of ``1 − 1/imbalance``: the share of a step the other ranks
wait for the slowest, if cost were time), ``fill`` (tokens over the rows'
capacity), the source shares of the planned tokens, and the planner's
milliseconds per step.  No timing enters the other columns, so they are exact
for this corpus and seed.

    python scripts/bench_outliers.py                # dp 2 x 2 rows of 2048 (bench_train's shape)
    python scripts/bench_outliers.py --dp 8 --micro-batches 4 --seq-len 4096
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))

from msd_dask import load_config  # noqa: E402
from msd_dask.core.balance import capacity_bound  # noqa: E402
from msd_dask.core.config import Config  # noqa: E402
from msd_dask.core.cost import CostModel  # noqa: E402
from msd_dask.core.plan import Planner  # noqa: E402
from msd_dask.core.stream import NeedMetadata  # noqa: E402
from msd_dask.formats import Unit  # noqa: E402
from msd_dask.sources.discover import discover_units  # noqa: E402
from msd_dask.sources.documents import read_unit  # noqa: E402
from msd_dask.sources.storage import open_source  # noqa: E402
from msd_dask.sources.tokenizer import make_tokenizer  # noqa: E402


def make_cfg(path: str, dp: int, mb: int, seq_len: int, ratio: float,
             min_length: int | float | str) -> Config:
    d = load_config(path).to_dict()
    d.update(name="bench-outliers", parallel={"dp": dp},
             batch={"seq_len": seq_len, "micro_batches": mb},
             cost={"linear": 1.0, "quadratic": ratio},
             outliers={"min_length": min_length})
    return load_config(d)


class Lengths:
    """Token lengths of the corpus's units, read once (what loaders report to the planner)."""

    def __init__(self, cfg: Config, units: dict[str, list[Unit]]):
        self.cfg, self.units = cfg, units
        self.tok = make_tokenizer(cfg.tokenizer)
        self.cache: dict[tuple[str, int], np.ndarray] = {}

    def __call__(self, source: str, epoch: int, unit: int) -> np.ndarray:
        """The planner's lookup: a unit read already, else ``NeedMetadata`` (as the planner's
        actor has it), so that :func:`run` reads it outside the timed call."""
        got = self.cache.get((source, unit))
        if got is None:
            raise NeedMetadata(source, [(epoch, unit)])
        return got

    def read(self, source: str, unit: int) -> None:
        """Read a unit's documents as the loaders read them, and keep their lengths."""
        if (source, unit) not in self.cache:
            s = self.cfg.source(source)
            files = open_source(s.uri, s.storage_options)
            docs = read_unit(s, files.fs, self.units[source][unit], self.tok)
            self.cache[(source, unit)] = np.array([len(d) for d in docs], dtype=np.int64)


def run(cfg: Config, units: dict[str, list[Unit]], lengths: Lengths, steps: int
        ) -> dict[str, Any]:
    pl = Planner(cfg, units)
    cost = CostModel(cfg.cost.linear, cfg.cost.quadratic)
    dp, mb, seq = cfg.parallel.dp, cfg.batch.micro_batches, cfg.batch.seq_len
    imb, bound, fill, secs = [], [], [], 0.0
    for _ in range(steps):
        while True:
            t0 = time.perf_counter()
            try:
                plan = pl.plan_step(lengths)
                secs += time.perf_counter() - t0
                break
            except NeedMetadata as e:  # read the unit's lengths outside the timed call
                for _, u in e.units:
                    lengths.read(e.source, u)
        ls = np.array([q.length for q in plan.pieces()], dtype=np.int64)
        rank_cost = [float(cost(np.array([q.length for row in r for q in row], dtype=np.int64)).sum())
                     for r in plan.rows]
        mean = sum(rank_cost) / dp
        imb.append(max(rank_cost) / mean)
        bound.append(capacity_bound(ls, cost(ls), dp, mb, seq) / mean)
        fill.append(ls.sum() / (dp * mb * seq))
    total = sum(pl.tokens.values())
    return {"imbalance": float(np.mean(imb)), "bound": float(np.mean(bound)),
            "wait": float(np.mean([1 - 1 / i for i in imb])), "fill": float(np.mean(fill)),
            "shares": {k: v / total for k, v in pl.tokens.items()}, "ms": 1000 * secs / steps}


def _min_length(text: str) -> int | float | str:
    """One value of ``--min-lengths`` as the config takes ``outliers.min_length``: ``auto``,
    a number of tokens, or a fraction of ``seq_len`` such as ``0.5``."""
    text = text.strip()
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:  # (raised ValueError's own words; a review)
        raise argparse.ArgumentTypeError(f"expected auto, a number of tokens or a fraction "
                                         f"of seq_len, got {text!r}") from None
    return int(value) if value.is_integer() and value >= 1 else value


def _min_lengths(text: str) -> list[int | float | str]:
    """``--min-lengths``: comma-separated :func:`_min_length` values."""
    return [_min_length(x) for x in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    from cli_types import non_negative_float, positive_int

    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--dp", type=positive_int, default=2)
    p.add_argument("--micro-batches", type=positive_int, default=2)
    p.add_argument("--seq-len", type=positive_int, default=2048)
    p.add_argument("--ratio", type=non_negative_float, default=1e-3,
                   help="β/α of the cost model (default 1e-3: what bench_train measures on its "
                        "ranks, 0.9-1.4e-3)")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--min-lengths", type=_min_lengths, default=None,
                   help="comma-separated outliers.min_length values (default: seq_len × "
                        "3/8, 1/2 + 1, 3/4, 7/8 and 1)")
    p.add_argument("--quick", action="store_true", help="100 steps")
    a = p.parse_args(argv)
    if a.quick:
        a.steps = 100
    s = a.seq_len
    mins = a.min_lengths or [3 * s // 8, s // 2 + 1, 3 * s // 4, 7 * s // 8, s]
    cfg0 = make_cfg(a.config, a.dp, a.micro_batches, s, a.ratio, 0)
    raw, _ = discover_units(cfg0)
    units = {k: [Unit(*t) for t in v] for k, v in raw.items()}
    lengths = Lengths(cfg0, units)
    weights = {x.name: round(x.weight.at(0), 3) for x in cfg0.sources}
    print(f"demo corpus ({a.config}), weights {weights}; dp {a.dp} x {a.micro_batches} rows of "
          f"{s} tokens; cost L + {a.ratio:g}·L²; {a.steps} steps; the planner's own code")
    head = f"{'outliers.min_length':<22}{'imbalance':>10}{'bound':>8}{'wait':>7}{'fill':>7}"
    head += "".join(f"{n:>9}" for n in weights) + f"{'ms/step':>9}"
    print(head)
    # (untimed: the kernels compiled or loaded, before the first row's steps are timed)
    run(make_cfg(a.config, a.dp, a.micro_batches, s, a.ratio, 0), units, lengths, 2)
    for m in [0, *mins]:
        r = run(make_cfg(a.config, a.dp, a.micro_batches, s, a.ratio, m), units, lengths, a.steps)
        label = "off" if m == 0 else str(m)  # (as given: auto, tokens or a fraction)
        print(f"{label:<22}{r['imbalance']:>10.4f}{r['bound']:>8.4f}{r['wait']:>7.1%}"
              f"{r['fill']:>7.1%}" + "".join(f"{r['shares'][n]:>9.3f}" for n in weights)
              + f"{r['ms']:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
