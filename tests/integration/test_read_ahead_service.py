"""``sources[].read_ahead_tokens`` on a service: what loaders hold read ahead is capped.

The cap changes which units are read early, never which documents form a step
(``tests/unit/test_read_ahead.py``: the cap and the planner's read-ahead alone).

Under the adaptive policy and a tight ``read_ahead_tokens`` cap every loader gets units to read:
the adaptive policy adds loaders to read more units at once; with one unit read ahead of
the planner (a token cap as small as a unit) the added loaders would have nothing to read.
A fixed allocation keeps the cap (loaders' memory).
"""

from __future__ import annotations

import time

from msd_dask import DataService, load_config
from msd_dask.core.stream import SourceStream
from msd_dask.formats import Unit
from msd_dask.roles.loader import read_unit
from msd_dask.sources.discover import discover_units
from msd_dask.sources.storage import open_source
from msd_dask.sources.tokenizer import ByteTokenizer

from checks import check_content, check_exactly_once, read_steps
from corpus import config, write_corpus


def _unit_tokens(cfg: dict, source: str) -> tuple[list[Unit], list[int]]:
    """The source's units as the service lists them, and the tokens each holds."""
    c = load_config(cfg)
    units = [Unit(*u) for u in discover_units(c)[0][source]]
    src = c.source(source)
    fs = open_source(src.uri, src.storage_options).fs
    tok = ByteTokenizer()
    return units, [sum(len(d) for d in read_unit(src, fs, u, tok)) for u in units]


def _run(cfg: dict, steps: int) -> tuple[list[dict], int, dict]:
    """Read ``steps`` steps on every rank, wait until the planner and loaders hold still.

    Returns the records, the tokens the ``code`` loaders hold and the planner's state.
    """
    with DataService.start(cfg, n_workers=1, threads_per_worker=1) as svc:
        readers = [svc.reader(r) for r in range(svc.config.parallel.world_size)]
        recs = read_steps(svc, steps, readers=readers)
        deadline = time.monotonic() + 60
        last = -1
        while True:  # planning blocks once the constructors are full; loaders finish reading
            st = svc.stats()
            held = st["sources"]["code"]["tokens_buffered"]
            if "make room" in (st["planner"]["waiting"] or "") and held == last:
                break
            assert time.monotonic() < deadline, st["planner"]["waiting"]
            last = held
            time.sleep(0.5)
        state = svc.link.call(lambda p: p.state())
    return recs, held, state


def test_token_cap_bounds_what_loaders_hold_and_keeps_the_batches(tmp_path) -> None:
    root = str(tmp_path)
    texts = write_corpus(root, code_files=6, code_rows=21)  # 18 code units of 7 rows
    base = config(root)
    base["sources"][0].update(loaders=1, shuffle_window=2, read_ahead=8)
    units, tokens = _unit_tokens(base, "code")
    assert len(units) == 18
    runs = {}
    for cap in (10 ** 9, 1):  # no cap in effect; one unit after the window
        cfg = config(root)
        cfg["sources"][0].update(loaders=1, shuffle_window=2, read_ahead=8, read_ahead_tokens=cap)
        runs[cap] = _run(cfg, steps=4)
    (recs_all, held_all, _), (recs_cap, held_cap, state) = runs[10 ** 9], runs[1]
    # the same documents form every step, token for token
    assert [r["documents"] for r in recs_cap] == [r["documents"] for r in recs_all]
    for a, b in zip(recs_cap, recs_all, strict=True):
        assert (a["input_ids"] == b["input_ids"]).all()
    check_content(recs_cap, texts, 512)
    check_exactly_once(recs_cap, texts, 512, min_complete=0)  # (4 steps: no piece twice)
    # what the capped loader may hold: the windows up to the planner's (units behind it
    # are released once every rank claimed the steps that used them) and one unit after
    pos = state["streams"]["code"]
    assert pos["epoch"] == 0, pos
    stream = SourceStream("code", units, load_config(base).seed, 2, 512)
    upto = [u for w in range(pos["window"] + 1) for u in stream.window_units(0, w)]
    after = stream.window_units(0, pos["window"] + 1)[:1]
    bound = sum(tokens[u] for u in upto + after)
    assert 0 < held_cap <= bound, (held_cap, bound, pos)
    # without the cap the loader holds read_ahead = 8 units after the window: more
    assert held_all > bound, (held_all, bound, pos)


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
    check_exactly_once(recs, texts, 512, min_complete=0)  # (4 steps: no piece twice)
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
