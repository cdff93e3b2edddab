"""Balance of rank costs: naive sequential packing against msd_dask's ``balanced``.

For each workload and each ``dp × seq_len`` configuration, steps are filled the
way :class:`msd_dask.core.plan.Planner` fills them: documents, chunked into pieces
of at most ``seq_len`` tokens, are taken in stream order while they fit in the
step's ``dp × micro_batches × seq_len`` tokens, after the pieces carried over
from the step before.  Each step is assigned twice, on the same pieces:
``sequential`` (the naive baseline: rows filled in stream order, as a per-rank
loader packs) and the planner's own placement with ``balanced`` (the default,
:func:`msd_dask.core.row_placement.place_step`); the carry follows the planner.  Costs use the
default cost model (``L + L² / (12·4096)``).

Workloads:

``lognormal``
    Synthetic, heavy-tailed: document lengths ``lognormal(7, 2)`` (median
    about 1,100 tokens, mean about 7,000), capped at the longest context
    (131,072 tokens).
``demo``
    The demo corpus's documents (``msd-dask demo-corpus data/demo``: standard
    library modules and their docstrings), byte-tokenized, in a seeded
    shuffle; skipped when ``--root`` has no corpus.

Columns, per configuration (means over the steps; the time is the median):
naive imbalance (max over mean rank cost), msd_dask imbalance, msd_dask max
over ``lower_bound`` (``max(mean rank, largest piece)``), msd_dask max over
``capacity_bound`` (which also counts the full rows: what the pieces allow),
pieces per step, and msd_dask planning time per step.

    python scripts/bench_balance.py --quick --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))

from msd_dask.core.balance import assign, build_assignment, capacity_bound, lower_bound  # noqa: E402
from msd_dask.core.cost import CostModel  # noqa: E402
from msd_dask.core.row_placement import place_step  # noqa: E402

LONGEST_CONTEXT = 131072
DPS = (8, 64, 1024)
SEQ_LENS = (4096, 32768, 131072)


# ----------------------------------------------------------------------------- workloads


def lognormal_docs(seed: int, mu: float = 7.0, sigma: float = 2.0) -> Iterator[np.ndarray]:
    """Endless batches of heavy-tailed document lengths."""
    rng = np.random.default_rng(seed)
    while True:
        yield np.clip(np.rint(rng.lognormal(mu, sigma, 1 << 16)), 1, LONGEST_CONTEXT).astype(
            np.int64)


def demo_lengths(root: str) -> np.ndarray | None:
    """Byte-tokenizer lengths (text bytes + end of document) of the demo corpus."""
    code = sorted(glob.glob(os.path.join(root, "code", "*.parquet")))
    prose = sorted(glob.glob(os.path.join(root, "prose", "*.jsonl.zst")))
    if not code and not prose:
        return None
    import pyarrow.parquet as pq
    import zstandard

    out: list[int] = []
    for path in code:
        texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
        out.extend(len(t.encode("utf-8")) + 1 for t in texts if t)
    for path in prose:
        with open(path, "rb") as f:
            raw = zstandard.ZstdDecompressor().stream_reader(f).read()
        for line in raw.splitlines():
            if line.strip():
                text = json.loads(line)["text"]
                if text:
                    out.append(len(text.encode("utf-8")) + 1)
    return np.array(out, dtype=np.int64)


def corpus_docs(lengths: np.ndarray, seed: int) -> Iterator[np.ndarray]:
    """The corpus's documents, reshuffled every epoch."""
    rng = np.random.default_rng(seed)
    while True:
        yield lengths[rng.permutation(len(lengths))]


class PieceStream:
    """Pieces of at most ``seq_len`` tokens, in document order."""

    def __init__(self, docs: Iterator[np.ndarray], seq_len: int):
        self.docs, self.seq_len = docs, seq_len
        self.buf = np.zeros(0, dtype=np.int64)

    def _more(self) -> None:
        d = next(self.docs)
        n = -(-d // self.seq_len)                       # chunks per document
        pieces = np.full(int(n.sum()), self.seq_len, dtype=np.int64)
        last = np.cumsum(n) - 1
        pieces[last] = d - (n - 1) * self.seq_len
        self.buf = np.concatenate([self.buf, pieces])

    def fill(self, carry: np.ndarray, capacity: int) -> np.ndarray:
        """``carry`` then pieces in order while the step's tokens allow (as the planner)."""
        room = capacity - int(carry.sum())
        while True:
            csum = np.cumsum(self.buf)
            k = int(np.searchsorted(csum, room, side="right"))
            if k < len(self.buf):
                taken, self.buf = self.buf[:k], self.buf[k:]
                return np.concatenate([carry, taken])
            self._more()


# ---------------------------------------------------------------------------- measuring


@dataclass
class Row:
    dp: int
    seq_len: int
    pieces: float
    naive: float
    ours: float
    over_lb: float
    over_cap: float
    ms: float


def run_config(docs: Iterator[np.ndarray], dp: int, mb: int, seq_len: int, steps: int,
               cost: CostModel) -> Row:
    stream = PieceStream(docs, seq_len)
    carry = np.zeros(0, dtype=np.int64)
    capacity = dp * mb * seq_len
    naive, ours, over_lb, over_cap, ms, count = [], [], [], [], [], []
    for _ in range(steps):
        lengths = stream.fill(carry, capacity)
        costs = cost(lengths)
        n = assign(lengths, costs, dp, mb, seq_len, "sequential")
        t0 = time.perf_counter()
        rank, micro = place_step(lengths, costs, len(carry), dp, mb, seq_len, "balanced")
        ms.append((time.perf_counter() - t0) * 1e3)
        a = build_assignment(rank, micro, lengths, costs, dp, mb)
        ok = a.placed
        naive.append(n.imbalance)
        ours.append(a.imbalance)
        top = float(a.rank_cost.max())
        over_lb.append(top / lower_bound(costs[ok], dp))
        over_cap.append(top / capacity_bound(lengths[ok], costs[ok], dp, mb, seq_len))
        count.append(len(lengths))
        carry = lengths[~ok]
    return Row(dp, seq_len, float(np.mean(count)), float(np.mean(naive)), float(np.mean(ours)),
               float(np.mean(over_lb)), float(np.mean(over_cap)), float(np.median(ms)))


HEADER = ("| dp | seq_len | pieces/step | naive imbalance | msd_dask imbalance "
          "| max / lower bound | max / capacity bound | ms / step |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|")


def fmt(r: Row) -> str:
    return (f"| {r.dp} | {r.seq_len} | {r.pieces:,.0f} | {r.naive:.3f} | {r.ours:.3f} "
            f"| {r.over_lb:.4f} | {r.over_cap:.4f} | {r.ms:.1f} |")


def write_section(path: str, text: str) -> None:
    """Replace (or append) the ``## Balance`` section of ``path``."""
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmarks\n"
    section = "## Balance\n\n" + text.strip() + "\n"
    m = re.search(r"^## Balance\n.*?(?=^## |\Z)", old, flags=re.M | re.S)
    if m:
        new = old[:m.start()] + section + ("\n" if old[m.end():] else "") + old[m.end():]
    else:
        new = old.rstrip("\n") + "\n\n" + section
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 steps per configuration (< 3 min)")
    p.add_argument("--steps", type=int, default=None, help="steps per configuration (default 8)")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[4, 1])
    p.add_argument("--root", default="data/demo", help="demo corpus (skipped if absent)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", metavar="MD", help="put the tables under '## Balance' in MD")
    args = p.parse_args(argv)
    steps = args.steps or (2 if args.quick else 8)
    cost = CostModel()

    workloads: list[tuple[str, object]] = [("lognormal", None)]
    demo = demo_lengths(args.root)
    if demo is None:
        print(f"no demo corpus under {args.root}: skipping it")
    else:
        workloads.append(("demo", demo))

    started = time.perf_counter()
    blocks = []
    for name, data in workloads:
        for mb in args.micro_batches:
            title = f"{name}, {mb} micro-batch{'es' if mb > 1 else ''} per rank, {steps} steps"
            print(f"\n{title}\n{HEADER}", flush=True)
            lines = []
            for dp in DPS:
                for seq_len in SEQ_LENS:
                    docs = (lognormal_docs(args.seed) if data is None
                            else corpus_docs(data, args.seed))  # type: ignore[arg-type]
                    line = fmt(run_config(docs, dp, mb, seq_len, steps, cost))
                    print(line, flush=True)
                    lines.append(line)
            blocks.append(f"**{title}**\n\n{HEADER}\n" + "\n".join(lines))
    took = time.perf_counter() - started
    print(f"\ntook {took:.0f} s")

    if args.write:
        cmd = "python scripts/bench_balance.py" + (" --quick" if args.quick else "") + (
            f" --steps {args.steps}" if args.steps else "")
        intro = (
            f"Command: `{cmd}` ({took:.0f} s on the shared 2-core development machine, so\n"
            "the times are noisy).  Steps are filled as the planner fills them (pieces in\n"
            "stream order while the step's `dp × micro_batches × seq_len` tokens allow, after\n"
            "the carried pieces) and assigned twice, on the same pieces: naive = `sequential`\n"
            "(rows filled in stream order, as per-rank loaders pack), msd_dask = `balanced`\n"
            "(the default), with the default cost model `L + L²/(12·4096)`.  Imbalance is max\n"
            "over mean rank cost; lower bound = `max(mean rank, largest piece)`; capacity\n"
            "bound also counts the full rows (what the pieces allow, see `docs/balance.md`);\n"
            "means over the steps, median time.  `lognormal`: document lengths\n"
            "`lognormal(7, 2)` capped at 131,072 tokens; `demo`: the demo corpus's documents\n"
            "(`msd-dask demo-corpus data/demo`), byte-tokenized.\n\n"
            "**Reading it.** With 4 micro-batches per rank `balanced` is within a fraction of\n"
            "a percent of what the pieces allow (the capacity bound), where naive packing\n"
            "is up to twice the mean, worse the longer the context.  With one\n"
            "micro-batch per rank, the rank holding the longest piece can be no lighter than\n"
            "that piece, far above the mean at 32K-128K context: `balanced` sits at that\n"
            "bound, and the remaining imbalance is the pieces', not the planner's.")
        write_section(args.write, intro + "\n\n" + "\n\n".join(blocks))
        print(f"wrote the '## Balance' section of {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
