"""A source in a format of your own, named in the config by import path: the workers import
it, list and read its files, and every document comes once an epoch, its tokens its text."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

from msd_dask import DataService
from msd_dask.errors import ConfigError

from checks import check_content, check_exactly_once, read_steps

FORMAT = "msd_dask.examples.text_lines:TextLinesFormat"


def _lines(root: str) -> dict[tuple[str, str], str]:
    """Two text files (one gzip-compressed), blank lines among the documents; the texts by
    (source, document key)."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(5)
    texts = {}
    for f, suffix in ((0, ".txt"), (1, ".txt.gz")):
        lines = []
        for i in range(40):
            if i % 7 == 3:
                lines.append("")  # a blank line: no document, its row kept
                continue
            text = f"line {f}/{i} naïve " + "words " * int(rng.integers(1, 120))
            lines.append(text)
            texts[("lines", f"part-{f}{suffix}:{i}")] = text
        data = ("\n".join(lines) + "\n").encode()
        with open(f"{root}/part-{f}{suffix}", "wb") as fh:
            fh.write(gzip.compress(data) if suffix.endswith(".gz") else data)
    return texts


def _cfg(root: str) -> dict:
    return {"name": "own-format", "seed": 1, "parallel": {"dp": 2},
            "batch": {"seq_len": 256, "micro_batches": 2}, "prefetch": 2, "timeout": 60,
            "sources": [{"name": "lines", "uri": f"{root}/part-*", "format": FORMAT,
                         "shuffle_window": 8}]}


def test_a_format_named_by_import_path_serves_every_line_once(tmp_path):
    root = str(tmp_path / "lines")
    texts = _lines(root)
    with DataService.start(_cfg(root), n_workers=1, threads_per_worker=2) as svc:
        recs = read_steps(svc, 40)
        # another process would connect to the embedded cluster by the handle's address
        other = DataService.connect(svc.address, "own-format", agent=False)
        try:
            assert other.config == svc.config and other.address == svc.address
        finally:
            other.close()
    check_content(recs, texts, 256)
    epochs = check_exactly_once(recs, texts, 256)
    assert epochs["lines"] >= 1, epochs


def test_a_format_that_does_not_import_is_refused_at_start(tmp_path):
    root = str(tmp_path / "lines")
    _lines(root)
    cfg = _cfg(root)
    cfg["sources"][0]["format"] = "msd_dask.examples.text_lines:NoSuchFormat"
    with pytest.raises(ConfigError, match=r"sources\[0\]\.format.*NoSuchFormat.*importable on "
                       "every worker") as info:
        DataService.start(cfg, n_workers=1, threads_per_worker=1)
    assert info.value.key == "sources[0].format"
