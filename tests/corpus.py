"""A small two-source corpus with known texts, for integration tests."""

from __future__ import annotations

import io
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard


def _text(rng: np.random.Generator, tag: str, long_tail: bool) -> str:
    n = int(rng.lognormal(5.0, 1.2)) if long_tail else int(rng.integers(1, 300))
    words = ["alpha", "béta", "γάμμα", "delta", "ε", "zeta 🙂", "eta\n", "theta\t"]
    body = " ".join(words[int(i)] for i in rng.integers(0, len(words), size=max(n // 5, 0)))
    return f"{tag}: {body}"


def write_corpus(root: str, *, seed: int = 0, code_files: int = 4, code_rows: int = 20,
                 prose_files: int = 3, prose_rows: int = 30) -> dict[tuple[str, str], str]:
    """Write ``root/code/*.parquet`` and ``root/prose/*.jsonl.zst``.

    Returns ``{(source, key): text}`` with keys as the service reports them.
    """
    rng = np.random.default_rng(seed)
    texts: dict[tuple[str, str], str] = {}
    os.makedirs(f"{root}/code", exist_ok=True)
    os.makedirs(f"{root}/prose", exist_ok=True)
    for f in range(code_files):
        rows = [_text(rng, f"code {f}/{i}", True) for i in range(code_rows)]
        pq.write_table(pa.table({"text": rows, "id": list(range(code_rows))}),
                       f"{root}/code/part-{f}.parquet", row_group_size=7)
        for i, t in enumerate(rows):
            texts[("code", f"part-{f}.parquet:{i}")] = t
    for f in range(prose_files):
        buf = io.StringIO()
        for i in range(prose_rows):
            t = _text(rng, f"prose {f}/{i}", False)
            buf.write(json.dumps({"text": t}) + "\n")
            texts[("prose", f"part-{f}.jsonl.zst:{i}")] = t
        with open(f"{root}/prose/part-{f}.jsonl.zst", "wb") as fh:
            fh.write(zstandard.ZstdCompressor().compress(buf.getvalue().encode()))
    return texts


def config(root: str, **overrides: Any) -> dict[str, Any]:
    """A service config over :func:`write_corpus`'s output."""
    cfg: dict[str, Any] = {
        "name": "itest",
        "seed": 7,
        "parallel": {"dp": 2},
        "batch": {"seq_len": 512, "micro_batches": 2},
        # the defaults: rounds of prefetch - 1 = 3 steps (one message per role and round)
        "prefetch": 4,
        "timeout": 60,
        "sources": [
            {"name": "code", "uri": f"{root}/code/*.parquet", "format": "parquet",
             "weight": 0.7, "loaders": 2, "shuffle_window": 2},
            {"name": "prose", "uri": f"{root}/prose/*.jsonl.zst", "format": "jsonl",
             "weight": 0.3},
        ],
    }
    cfg.update(overrides)
    return cfg
