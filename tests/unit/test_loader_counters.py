"""A source's counters never go back when a loader is re-created or retired.

A loader re-created after its worker was lost (or moved, or a slot retired by
scaling down) starts from zero: the source's ``tokens_read``, which the
dashboard and ``/metrics`` take rates of, went back as soon as the new loader
answered (``tests/integration/test_recovery.py`` saw it on a busy machine).
:meth:`RoleSupervisor.loader_stats` adds the counters of the loaders gone from a
slot to the slot's, as they last answered.  Without Dask: stand-in handles.
"""

from __future__ import annotations

import asyncio
import types
from typing import Any

from msd_dask.core.figures import LOADER_COUNTERS, source_figures
from msd_dask.roles.supervisor import RoleSupervisor


class _Loader:
    def __init__(self, key: str, source: str, slot: int, tokens: int):
        self.key, self._address = key, f"tcp://w:{slot}"
        self.source, self.slot, self.tokens = source, slot, tokens
        self.lost = False

    async def stats(self) -> dict[str, Any]:
        if self.lost:
            raise OSError("Timed out trying to connect")
        counters = {c: self.tokens if c == "tokens_read" else 1 for c in LOADER_COUNTERS}
        return {**counters, "source": self.source, "index": self.slot, "tokens_buffered": 0,
                "units_buffered": 0, "threads": 1}


def _supervisor() -> RoleSupervisor:
    planner = types.SimpleNamespace(cfg=None)
    return RoleSupervisor(planner, [], 0, 1, {}, {})  # type: ignore[arg-type]


def _tokens(sup: RoleSupervisor) -> tuple[int, list[int]]:
    stats = asyncio.run(sup.loader_stats())["a"]
    planner = {"tokens_planned": {"a": 1}, "weights": {"a": 1.0}}
    return (source_figures(planner, {"a": stats})["a"]["tokens_read"],
            [st["tokens_read"] for st in stats])


def test_counters_go_on_from_a_lost_loader_and_a_retired_slot(monkeypatch: Any) -> None:
    import msd_dask.roles.supervisor as module

    monkeypatch.setattr(module, "STATS_WAIT", 0.5)
    sup = _supervisor()
    old = [_Loader("l-a-0-g0", "a", 0, 100), _Loader("l-a-1-g0", "a", 1, 50),
           _Loader("l-a-2-g0", "a", 2, 30)]
    sup._slots = {"a": {i: (h, None) for i, h in enumerate(old)}}
    sup._alias = {"a": {}}
    assert _tokens(sup) == (180, [100, 50, 30])
    old[0].tokens = 120
    old[0].lost = True  # its worker lost: its last answer stands for it
    assert _tokens(sup) == (180, [100, 50, 30])
    # re-created: the new loader has read 5 tokens so far (its units again)
    sup._slots["a"][0] = (_Loader("l-a-0-g1", "a", 0, 5), None)
    assert _tokens(sup) == (185, [105, 50, 30])
    # slot 2 retired, its units to slot 1
    del sup._slots["a"][2]
    sup._alias["a"][2] = 1
    assert _tokens(sup) == (185, [105, 80])
    # and the counters keep counting
    sup._slots["a"][0][0].tokens = 40
    assert _tokens(sup) == (220, [140, 80])


def test_a_retired_slot_forgotten_before_its_last_answer_is_counted_on_a_live_one(
        monkeypatch: Any) -> None:
    # forget_retired forgot slot 2 before a poll saw its loader gone: its last answer went
    # to an entry of its own, kept for ever (one per scale event, a review of the elastic
    # paths); it goes to a live slot's now, counted all the same
    import msd_dask.roles.supervisor as module

    monkeypatch.setattr(module, "STATS_WAIT", 0.5)
    sup = _supervisor()
    loaders = [_Loader(f"l-a-{i}-g0", "a", i, 10 * (i + 1)) for i in range(3)]
    sup._slots = {"a": {i: (h, None) for i, h in enumerate(loaders)}}
    sup._alias = {"a": {}}
    assert _tokens(sup) == (60, [10, 20, 30])
    newest = 2
    for cycle in range(5):  # retire the newest slot (forgotten at once), add a new one
        del sup._slots["a"][newest]
        assert _tokens(sup)[0] == 60 + 30 * cycle
        newest += 1
        sup._slots["a"][newest] = (_Loader(f"l-a-{newest}-g0", "a", newest, 30), None)
        assert _tokens(sup)[0] == 60 + 30 * (cycle + 1)
    assert set(sup._gone["a"]) <= set(sup._slots["a"]), sup._gone


class _Slow(_Loader):
    """A loader whose answer takes ``delay`` seconds."""

    delay = 0.0

    async def stats(self) -> dict[str, Any]:
        await asyncio.sleep(self.delay)
        return await super().stats()


def test_a_loader_retired_while_a_poll_awaits_its_answer_is_counted_once(
        monkeypatch: Any) -> None:
    """Poll A asks loader 0, slow to answer; meanwhile slot 0 is retired and poll B moves
    its last answer into the slot's past; then A's answer came and was recorded as the
    loader's last, and the next poll moved it too: its counters were counted twice, for
    good (a review: 3,000 tokens where 2,000 were read).  What it read after its last
    answer goes there once, and a poll does not report a loader retired meanwhile."""
    import msd_dask.roles.supervisor as module

    monkeypatch.setattr(module, "STATS_WAIT", 5.0)
    sup = _supervisor()

    x, y = _Slow("l-a-0-g0", "a", 0, 1000), _Loader("l-a-1-g0", "a", 1, 500)
    sup._slots = {"a": {0: (x, None), 1: (y, None)}}
    sup._alias = {"a": {}}

    def total(stats: dict[str, list[dict[str, Any]]]) -> int:
        return sum(int(st["tokens_read"]) for st in stats["a"])

    async def run() -> list[int]:
        seen = [total(await sup.loader_stats())]
        x.tokens, x.delay = 1500, 0.3  # (it read more; its worker slow to answer)
        a = asyncio.ensure_future(sup.loader_stats())
        await asyncio.sleep(0.05)
        del sup._slots["a"][0]  # retired: its units to slot 1
        sup._alias["a"][0] = 1
        seen.append(total(await sup.loader_stats()))  # (its answer before, into the past)
        seen.append(total(await a))
        seen += [total(await sup.loader_stats()) for _ in range(2)]
        return seen

    assert asyncio.run(run()) == [1500, 1500, 2000, 2000, 2000]

    # a loader retired during the first poll it answers (added, then soon retired): its
    # answer was dropped by the first version of this fix, its counters lost for good (a
    # read-back)
    z = _Slow("l-a-2-g0", "a", 2, 1000)
    z.delay = 0.3
    sup._slots["a"][2] = (z, None)

    async def first_answer() -> list[int]:
        a = asyncio.ensure_future(sup.loader_stats())
        await asyncio.sleep(0.05)
        del sup._slots["a"][2]  # retired: its units to slot 1
        sup._alias["a"][2] = 1
        seen = [total(await a)]
        seen += [total(await sup.loader_stats()) for _ in range(2)]
        return seen

    assert asyncio.run(first_answer()) == [3000, 3000, 3000]


def test_a_re_created_planners_loaders_count_on_from_the_lost_ones(monkeypatch: Any) -> None:
    """A planner re-created after its worker was lost made new loaders that counted from
    zero: ``msd_source_tokens_read``, which dashboards take rates of, dropped (a review).
    The lost planner's checkpoint carries its loaders' counters as last seen
    (``counted``), and the new planner's count on from them."""
    import msd_dask.roles.supervisor as module

    monkeypatch.setattr(module, "STATS_WAIT", 0.5)
    lost = _supervisor()
    lost._slots = {"a": {0: (_Loader("l-a-0-g0", "a", 0, 100), None),
                         1: (_Loader("l-a-1-g0", "a", 1, 50), None)}}
    lost._alias = {"a": {}}
    lost._slots["a"][0] = (_Loader("l-a-0-g0b", "a", 0, 100), None)  # (one re-created before)
    assert _tokens(lost) == (150, [100, 50])
    del lost._slots["a"][1]  # slot 1 retired, its units to slot 0
    lost._alias["a"][1] = 0
    assert _tokens(lost) == (150, [150])
    counted = lost.counted()
    assert counted["a"]["tokens_read"] == 150
    new = _supervisor()  # (the re-created planner's: its loaders read their units again)
    new._slots = {"a": {0: (_Loader("l-a-0-g1", "a", 0, 20), None),
                        1: (_Loader("l-a-1-g1", "a", 1, 10), None)}}
    new._alias = {"a": {}}
    new.count_from(counted)
    assert _tokens(new)[0] == 180
    new._slots["a"][1][0].tokens = 40
    assert _tokens(new)[0] == 210
    assert new.counted()["a"]["tokens_read"] == 210  # (and a second loss counts on again)


def test_a_re_created_planner_takes_the_counters_its_owner_kept(corpus: Any) -> None:
    """The owner passes the lost planner's ``counted`` (from its checkpoint) to the new
    planner's actor with the rest of what was lost: its loaders count on from them."""
    from msd_dask import load_config
    from msd_dask.roles.planner import PlannerActor
    from msd_dask.sources.discover import discover_units

    from corpus import config

    root, _ = corpus
    cfg = load_config(config(root))
    units, roots = discover_units(cfg)
    counted = {s.name: {c: 7.0 for c in LOADER_COUNTERS} for s in cfg.sources}

    async def make() -> PlannerActor:
        return PlannerActor(cfg.to_dict(), units, roots, None, generation=1,
                            lost={"from": "tcp://w:1", "recovered": {"planner": 1},
                                  "events": [], "loaders": {}, "counted": counted})

    actor = asyncio.run(make())
    assert actor.roles.counted() == counted


def test_a_sources_only_loader_replaced_while_asked_keeps_its_count(monkeypatch) -> None:
    """The one loader of a source re-created (heal, a move) while a poll waited for its
    answer: the poll had no loader for the source, its ``tokens_read`` read 0 and the next
    poll's jumped back (a review).  Its successor stands in, the count going on."""
    from msd_dask.roles import supervisor as module

    monkeypatch.setattr(module, "STATS_WAIT", 5.0)
    sup = _supervisor()

    old = _Slow("l-a-0-g0", "a", 0, 1000)
    sup._slots = {"a": {0: (old, None)}}
    sup._alias = {"a": {}}

    def tokens(stats: dict[str, list[dict[str, Any]]]) -> int:
        planner = {"tokens_planned": {"a": 1}, "weights": {"a": 1.0}}
        return int(source_figures(planner, stats)["a"]["tokens_read"])

    async def run() -> list[int]:
        seen = [tokens(await sup.loader_stats())]
        old.tokens, old.delay = 1200, 0.3
        asked = asyncio.ensure_future(sup.loader_stats())
        await asyncio.sleep(0.05)
        sup._slots["a"][0] = (_Loader("l-a-0-g1", "a", 0, 10), None)  # re-created meanwhile
        seen.append(tokens(await asked))
        seen.append(tokens(await sup.loader_stats()))
        return seen

    assert asyncio.run(run()) == [1000, 1200, 1210]
