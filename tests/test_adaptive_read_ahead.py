"""Under the adaptive policy and a tight ``read_ahead_tokens`` cap every loader gets units to read.

The adaptive policy adds loaders to read more units at once; with one unit read ahead of
the planner (a token cap as small as a unit) the added loaders would have nothing to read.
A fixed allocation keeps the cap (``tests/test_read_ahead.py``: loaders' memory).
"""

from __future__ import annotations

import pytest
from test_read_ahead import _run, _unit_tokens

from msd_dask import load_config
from msd_dask.core.stream import SourceStream
from msd_dask.formats import Unit
from msd_dask.service import discover_units

from checks import check_content, check_exactly_once
from corpus import config, write_corpus

pytestmark = [pytest.mark.integration]


def test_every_loader_reads_ahead_under_a_tight_token_cap(tmp_path) -> None:
    root = str(tmp_path)
    texts = write_corpus(root, code_files=6, code_rows=21)  # 18 code units of 7 rows
    # the adaptive policy, held at 3 loaders by the source's bounds
    cfg = config(root, scaling={"policy": "adaptive"})
    cfg["sources"][0].update(loaders=3, shuffle_window=2, read_ahead=8, read_ahead_tokens=1,
                             min_loaders=3, max_loaders=3)
    units, tokens = _unit_tokens(cfg, "code")
    recs, held, state = _run(cfg, steps=4)
    check_content(recs, texts, 512)
    check_exactly_once(recs, texts, 512)
    pos = state["streams"]["code"]
    assert pos["epoch"] == 0, pos
    stream = SourceStream("code", [Unit(*u) for u in discover_units(load_config(cfg))[0]["code"]],
                          load_config(cfg).seed, 2, 512)
    assert [u.path for u in stream.units] == [u.path for u in units]
    upto = [u for w in range(pos["window"] + 1) for u in stream.window_units(0, w)]
    after = [u for w in range(pos["window"] + 1, pos["window"] + 6)
             for u in stream.window_units(0, w)]
    # the cap alone allows one unit after the window; the policy the next window (2 units)
    # and two per loader after it (6)
    one = sum(tokens[u] for u in upto + after[:1])
    eight = sum(tokens[u] for u in upto + after[:8])
    assert one < held <= eight, (one, held, eight, pos)
