"""``sources[].read_ahead_tokens``: the tokens loaders keep read ahead of the planner are capped.

Units can be large (a whole file), so ``read_ahead`` units per source can hold
a lot of tokens.  The cap bounds the units assigned after the current shuffle
window by their tokens (at least one is always assigned); it changes which
units are read early, never which documents form a step (on a service:
``tests/integration/test_read_ahead_service.py``).
"""

from __future__ import annotations

import pytest

from msd_dask import load_config
from msd_dask.core.config import ConfigError
from msd_dask.roles.planner import ahead_within
from msd_dask.sources.discover import discover_units
from msd_dask.sources.documents import read_unit
from msd_dask.sources.storage import open_source
from msd_dask.sources.tokenizer import ByteTokenizer

from corpus import config


def test_ahead_within_keeps_the_prefix_under_the_cap_and_at_least_one_unit() -> None:
    assert ahead_within([10, 20, 30], 30) == 2
    assert ahead_within([10, 20, 30], 60) == 3
    assert ahead_within([10, 20, 30], 29) == 1
    assert ahead_within([100, 1, 1], 5) == 1  # one unit even when it alone exceeds the cap
    assert ahead_within([0, 0, 5], 4) == 2  # empty units cost nothing
    assert ahead_within([5, None, 1], 100) == 1  # an unknown size ends the prefix ...
    assert ahead_within([None, 5], 100) == 1  # ... but never the first unit
    assert ahead_within([], 100) == 0


@pytest.mark.parametrize("value", [-1, 1.5, "many", True])
def test_bad_read_ahead_tokens_names_the_key(corpus, value) -> None:
    root, _ = corpus
    cfg = config(root)
    cfg["sources"][1]["read_ahead_tokens"] = value
    with pytest.raises(ConfigError, match=r"sources\[1\]\.read_ahead_tokens"):
        load_config(cfg)


def test_default_read_ahead_tokens_is_zero_meaning_prefetch_steps(corpus) -> None:
    root, _ = corpus
    assert load_config(config(root)).sources[0].read_ahead_tokens == 0


def test_upcoming_asks_the_planner_once_per_call_and_keeps_what_it_chose(corpus) -> None:
    """``PlannerActor._upcoming`` takes the window and the read-ahead from one
    ``upcoming_units`` call: the same units as asking for the window separately, at
    every position of the stream (windows and epochs crossed by planning steps)."""
    import numpy as np

    from msd_dask.roles.planner import PlannerActor

    root, _ = corpus
    c = load_config(config(root))
    units, roots = discover_units(c)
    co = PlannerActor(c.to_dict(), units, roots)
    planner = co.planner
    ask = planner.upcoming_units
    calls: list[tuple[str, int]] = []

    def counted(source: str, n: int) -> list[tuple[int, int]]:
        calls.append((source, n))
        return ask(source, n)

    planner.upcoming_units = counted  # type: ignore[method-assign]
    lengths = {}
    for s in c.sources:
        fs = open_source(s.uri, s.storage_options).fs
        tok = ByteTokenizer()
        for i, u in enumerate(co.units[s.name]):
            lengths[(s.name, i)] = np.array([len(d) for d in read_unit(s, fs, u, tok)])
            co._unit_tokens[s.name][i] = int(lengths[(s.name, i)].sum())
    co._ahead_cap = {s.name: 300 for s in c.sources}  # small: the token cap decides
    epochs = set()
    for _ in range(60):
        for s in c.sources:
            for read_ahead in (0, 1, 3, 100):
                calls.clear()
                got = co._upcoming(s.name, read_ahead)
                assert calls == [(s.name, read_ahead)]
                # what asking for the window separately chose
                keys, window = ask(s.name, read_ahead), len(ask(s.name, 0))
                known = co._unit_tokens[s.name]
                est = [float(known[u]) for _, u in keys[window:]]
                want = keys[:window + max(ahead_within(est, 300), 1)]
                assert got == want
        epochs.add(planner.streams["code"].epoch)
        planner.plan_step(lambda source, e, u: lengths[(source, u)])
    assert len(epochs) > 1  # the stream crossed an epoch


def test_adaptive_policy_reads_the_whole_next_window_ahead(corpus) -> None:
    """The planner needs the lengths of every unit of a window when it moves there; read
    on demand behind a slow store, that stalled the readers at each window change
    (bench_scaling --mode io: 11.5% wait after convergence, 1.0% with this).  Under the
    adaptive policy the read-ahead holds the whole next window whatever the token cap."""
    import numpy as np

    from msd_dask.roles.planner import PlannerActor

    root, _ = corpus
    raw = config(root, scaling={"policy": "adaptive"})
    raw["sources"][0].update(shuffle_window=3, read_ahead=8)
    c = load_config(raw)
    units, roots = discover_units(c)
    co = PlannerActor(c.to_dict(), units, roots)
    planner = co.planner
    lengths = {}
    for s in c.sources:
        fs = open_source(s.uri, s.storage_options).fs
        for i, u in enumerate(co.units[s.name]):
            lengths[(s.name, i)] = np.array([len(d) for d in read_unit(s, fs, u, ByteTokenizer())])
            co._unit_tokens[s.name][i] = int(lengths[(s.name, i)].sum())
    co._ahead_cap = {s.name: 1 for s in c.sources}  # the cap alone: one unit after the window
    st = planner.streams["code"]
    checked = 0
    for _ in range(40):
        got = co._upcoming("code", 8)
        keys = planner.upcoming_units("code", 8)
        nxt = [(e, u) for e, u in keys
               if (e, st.window_of(e, u)) != (st.epoch, st.window)][:st.window_size]
        assert set(nxt) <= set(got), (nxt, got)
        checked += len(nxt) == st.window_size
        planner.plan_step(lambda source, e, u: lengths[(source, u)])
    assert checked > 10


def test_spreading_units_moves_only_the_units_not_read_yet(corpus) -> None:
    """A loader slot added to ``code``: ``spread_units`` moves units its first slot has not
    read yet, not those whose lengths it reported already (the planner had not needed
    them yet); a review found them moved too, released and read again."""
    import asyncio

    import numpy as np

    from msd_dask.roles.planner import PlannerActor

    root, _ = corpus
    c = load_config(config(root))
    units, roots = discover_units(c)
    log: list[tuple[str, int, list]] = []

    class Slot:
        def __init__(self, slot: int):
            self.slot = slot

        async def assign(self, keys: list) -> None:
            log.append(("assign", self.slot, keys))

        async def release(self, keys: list) -> None:
            log.append(("release", self.slot, keys))

        async def metadata(self, epoch: int, unit: int) -> np.ndarray:
            return np.array([5, 6])

    async def run() -> None:
        co = PlannerActor(c.to_dict(), units, roots)
        slots = {0: Slot(0), 1: Slot(1)}
        co.roles.loader = lambda source, slot: slots[slot]  # type: ignore[method-assign]
        co.roles.resolve = lambda source, slot: slot  # type: ignore[method-assign]
        co.roles.active = {"code": [0, 1], "prose": [0]}
        loop = asyncio.get_running_loop()
        for u in range(6):  # units 0-3 read and reported by slot 0, units 4 and 5 not yet
            k = ("code", 0, u)
            co._owner[k] = 0
            co._meta_tasks[k] = fut = loop.create_future()
            if u < 4:
                fut.set_result(np.array([5, 6]))
        assert co._outstanding("code") == {0: 2}
        await co.spread_units("code")
        assert log == [("assign", 1, [(0, 5)]), ("release", 0, [(0, 5)])]

    asyncio.run(run())
