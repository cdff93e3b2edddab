"""Outlier delay through the service: held pieces are delivered exactly once with their text
(``tests/unit/test_outliers.py``: the planner alone)."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from msd_dask import DataService, load_config
from msd_dask.core.stream import Piece
from msd_dask.sources.discover import discover_units

from checks import check_content, check_exactly_once, read_steps, shares
from corpus import config, write_corpus


def test_service_delivers_held_pieces_exactly_once_with_their_text(tmp_path) -> None:
    """Held pieces wait in the planner while loaders move on: their units must stay readable."""
    texts = write_corpus(str(tmp_path))
    cfg = config(str(tmp_path), name="outliers", outliers={"min_length": 257})
    with DataService.start(cfg, n_workers=2, threads_per_worker=1) as svc:
        readers = [svc.reader(r) for r in range(2)]  # alive: state_dict counts what they returned
        recs = read_steps(svc, 200, readers=readers)
        state = svc.state_dict()
    assert state["step"] == 199
    tokens = check_content(recs, texts, 512)
    # pieces drawn by step 199 but held (or carried) then count as delivered later: without
    # them the epochs they belong to look incomplete
    units, _ = discover_units(load_config(cfg))
    later = [Piece.from_tuple(t) for t in state["planner"]["carry"]]
    later += [Piece.from_tuple(t) for t, _ in state["planner"]["held"]]
    assert later, "nothing was pending at the end: the check below would not need it"
    docs = [(q.source, f"{os.path.basename(units[q.source][q.unit][0])}:{q.row}", q.chunk)
            for q in later]
    pending = {"documents": [docs], "epochs": [[q.epoch for q in later]]}
    epochs = check_exactly_once([*recs, pending], texts, 512)
    assert epochs["code"] >= 1 and epochs["prose"] >= 1, epochs
    got = shares(tokens)
    assert abs(got["code"] - 0.7) < 0.02, got
    by_step: dict[int, int] = {}
    for rec in recs:
        for cu in rec["cu_seqlens"]:
            by_step[rec["step"]] = by_step.get(rec["step"], 0) + int((np.diff(cu) >= 257).sum())
    counts = Counter(by_step.values())
    assert counts[4] >= 5 and set(counts) <= {0, 4}, counts  # a row each, or none
