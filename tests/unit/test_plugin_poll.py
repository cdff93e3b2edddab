"""The scheduler plugin's poll over fake published services (no Dask): one service that
does not answer stops no other's figures, and a source's token rate never goes negative when
a loader is retired or re-created (found by a review, each by running it)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from msd_dask.core.figures import rank_columns, rank_summary
from msd_dask.plugin.scheduler import MsdSchedulerPlugin

from corpus import config


def _loader(tokens: int) -> dict[str, Any]:
    return dict(tokens_read=tokens, read_seconds=1.0, docs_read=10, tokens_buffered=0,
                units_buffered=0, tokens_fetched=0)


class _Planner:
    """Answers ``snapshot``; ``code`` has loaders reading ``per_loader[i]`` tokens at poll i."""

    def __init__(self, per_loader: list[list[int]] | None = None):
        self.per_loader = per_loader or [[1000]]
        self.calls = 0

    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        code = self.per_loader[min(self.calls, len(self.per_loader) - 1)]
        self.calls += 1
        return {"planner": {"tokens_planned": {"code": 10, "prose": 5},
                            "weights": {"code": 0.7, "prose": 0.3},
                            "loaders": {"code": len(code), "prose": 1}, "steps_planned": 3,
                            "mean_imbalance": 1.0, "starved_seconds": {}},
                "loaders": {"code": [_loader(t) for t in code], "prose": [_loader(100)]},
                "constructors": 0, "rank_summary": rank_summary(*rank_columns([])),
                "ranks": {}, "history": [], "weights_ahead": None}


class _Lost:
    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        raise OSError("Timed out trying to connect to tcp://198.18.0.9:4321")


def _plugin(planners: dict[str, Any]) -> MsdSchedulerPlugin:
    registries = {f"msd-{n}": {"config": config("/nonexistent", name=n), "planner": p}
                  for n, p in planners.items()}

    async def get_dataset(key: str) -> dict[str, Any]:
        return registries[key]

    plugin = MsdSchedulerPlugin()
    plugin.planner_of = lambda registry, client: registry["planner"]  # type: ignore[method-assign]
    plugin.scheduler = SimpleNamespace(  # type: ignore[assignment]
        extensions={"publish": SimpleNamespace(datasets={k: object() for k in registries})},
        tasks={}, workers={}, plugins={MsdSchedulerPlugin.name: plugin})

    async def close() -> None:
        pass

    plugin._client = SimpleNamespace(get_dataset=get_dataset, refcount={},  # type: ignore[assignment]
                                     close=close)
    return plugin


def test_a_service_that_does_not_answer_stops_no_other(caplog: pytest.LogCaptureFixture) -> None:
    """Service ``a``'s planner is unreachable: ``b`` still gets its figures and the roles it
    wants, every poll (a failure used to end the poll, before any later service); ``a``'s
    failure is logged once, not every poll."""
    plugin = _plugin({"a": _Lost(), "b": _Planner()})

    async def polls() -> None:
        for _ in range(3):
            await plugin.poll()

    with caplog.at_level("WARNING", logger="msd_dask.plugin"):
        asyncio.run(polls())
    assert sorted(plugin.services) == ["b"] and sorted(plugin._wanted) == ["b"]
    assert "OSError" in plugin.poll_errors["a"] and "b" not in plugin.poll_errors
    assert sum("service 'a' did not answer its poll" in r.getMessage()
               for r in caplog.records) == 1


def test_a_retired_loader_does_not_make_the_rate_negative() -> None:
    """Two loaders read 1,000,000 tokens each; one is retired and the other reads 10,000
    more: the source's rate keeps its last value instead of about -990,000/s; then it
    follows the new loader count again."""
    plugin = _plugin({"b": _Planner([[0, 0], [1_000_000, 1_000_000], [1_010_000], [1_030_000]])})

    async def polls() -> list[float]:
        rates = []
        for _ in range(4):
            await plugin.poll()
            await asyncio.sleep(0.05)
            rates.append(plugin.rates.get("b", {}).get("code", 0.0))
        return rates

    first, second, third, fourth = asyncio.run(polls())
    assert first == 0.0 and second > 0 and third == second and 0 < fourth < second


class _Steps(_Planner):
    """A planner whose snapshots report the imbalance of steps ``since``..``since + 4``."""

    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        snap = await super().snapshot(since, lookahead)
        snap["history"] = [{"step": s, "imbalance": 1.0} for s in range(since, since + 5)]
        return snap


def test_a_service_started_again_under_its_name_between_polls_starts_afresh() -> None:
    """A service closed and started again under the same name between two polls (a
    restart takes 0.1-0.2 s, the polls are 1 s apart): the plugin held on to the old one's
    config (its policy, its sources) and went on with its imbalance history; a planner
    re-created by the same owner keeps them."""
    plugin = _plugin({"svc": _Steps()})
    published = plugin.scheduler.extensions["publish"].datasets  # type: ignore[attr-defined]
    registry = {"config": config("/nonexistent", name="svc"), "planner": _Steps(),
                "owner": "client-1"}

    async def get_dataset(key: str) -> dict[str, Any]:
        return registry

    plugin._client.get_dataset = get_dataset  # type: ignore[attr-defined]

    async def poll_published_anew(new: dict[str, Any]) -> None:
        nonlocal registry
        registry = new
        published["msd-svc"] = object()
        await plugin.poll()

    async def run() -> tuple[list[int], Any, list[int], Any]:
        for _ in range(3):
            await plugin.poll()
        # the same owner re-created the planner: history and config stay
        await poll_published_anew(dict(registry, planner=_Steps()))
        kept = [s for s, _ in plugin.imbalance["svc"]]
        kept_cfg = plugin._configs["svc"]
        cfg = config("/nonexistent", name="svc", scaling={"policy": "adaptive"})
        await poll_published_anew({"config": cfg, "planner": _Steps(), "owner": "client-2"})
        return kept, kept_cfg, [s for s, _ in plugin.imbalance["svc"]], plugin._configs["svc"]

    kept, kept_cfg, steps, cfg = asyncio.run(run())
    assert kept == list(range(20)) and kept_cfg.scaling.policy == "fixed"
    assert steps == list(range(5)) and cfg.scaling.policy == "adaptive"


@pytest.mark.parametrize("interval, evaluations", [(1.0, 9), (3.0, 3), (0.2, 9)])
def test_the_adaptive_policy_is_evaluated_every_scaling_interval(
        monkeypatch: pytest.MonkeyPatch, interval: float, evaluations: int) -> None:
    """``scaling.interval`` is the seconds between evaluations of the policy (it was
    documented and validated, and every poll evaluated it); the plugin polls more often
    where it is shorter than a second.  Ten polls one (fake) second apart."""
    import msd_dask.plugin.scheduler as module

    clock = [1000.0]
    monkeypatch.setattr(module, "time", SimpleNamespace(time=lambda: clock[0],
                                                        monotonic=lambda: clock[0]))
    plugin = _plugin({"svc": _Planner()})
    cfg = config("/nonexistent", name="svc", scaling={"policy": "adaptive", "interval": interval})

    async def get_dataset(key: str) -> dict[str, Any]:
        return {"config": cfg, "planner": _Planner()}

    plugin._client.get_dataset = get_dataset  # type: ignore[attr-defined]
    spans: list[float] = []

    async def scale(name: str, registry: Any, snap: dict[str, Any], prev: dict[str, Any]) -> None:
        spans.append(snap["time"] - prev["time"])

    monkeypatch.setattr(plugin, "_scale", scale)

    async def polls() -> None:
        for _ in range(10):
            await plugin.poll()
            clock[0] += 1.0

    asyncio.run(polls())
    assert len(spans) == evaluations
    assert spans == [max(1.0, interval)] * evaluations  # each over the time since the last
    assert plugin.period() == min(1.0, interval)


def test_metrics_show_every_live_plugin_and_none_closed() -> None:
    """Two plugins in one process (two embedded clusters): ``/metrics`` (prometheus_client's
    one registry) showed only the last one started, and still showed it once closed."""
    from prometheus_client import REGISTRY, generate_latest

    from msd_dask.plugin import scheduler as module

    first, second = _plugin({"alpha": _Planner()}), _plugin({"beta": _Planner()})

    def services() -> set[str]:
        text = generate_latest(REGISTRY).decode()
        return {svc for svc in ("alpha", "beta")
                if f'msd_steps_planned{{service="{svc}"}}' in text}

    async def run() -> list[set[str]]:
        await first.poll()
        await second.poll()
        module._register_collector(first)
        module._register_collector(second)
        seen = [services()]
        second._client = None  # (a fake: nothing to close)
        await second.close()
        seen.append(services())
        first._client = None
        await first.close()
        seen.append(services())
        return seen

    assert asyncio.run(run()) == [{"alpha", "beta"}, {"alpha"}, set()]


def test_a_planner_that_does_not_apply_its_scaling_stalls_no_other_service(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Applying an adaptive service's decision waited on its planner without a timeout,
    inside the one poll loop of every service (review): a planner that stopped answering
    there stalled every service's figures.  The wait is bounded (``SCALE_WAIT``) and counted
    as that service's poll error; the next service is polled."""
    import msd_dask.plugin.scheduler as module

    monkeypatch.setattr(module, "SCALE_WAIT", 0.2)
    plugin = _plugin({"a": _Planner(), "b": _Planner()})
    cfg = config("/nonexistent", name="a", scaling={"policy": "adaptive", "interval": 0.2})

    async def get_dataset(key: str) -> dict[str, Any]:
        if key == "msd-a":
            return {"config": cfg, "planner": _Planner()}
        return {"config": config("/nonexistent", name="b"), "planner": _Planner()}

    plugin._client.get_dataset = get_dataset  # type: ignore[attr-defined]

    async def scale(name: str, registry: Any, snap: dict[str, Any], prev: dict[str, Any]) -> None:
        if name == "a":
            await asyncio.Event().wait()  # a planner that never answers scale()

    monkeypatch.setattr(plugin, "_scale", scale)

    async def polls() -> None:
        for _ in range(3):
            await asyncio.wait_for(plugin.poll(), 5)
            await asyncio.sleep(0.25)

    asyncio.run(polls())
    # (it said 'TimeoutError()': not what took too long, nor whose)
    assert "applying the scaling decisions of 'a' took more than 0.2s" in plugin.poll_errors["a"]
    assert "b" in plugin.services and "b" not in plugin.poll_errors


def test_a_decision_is_recorded_while_the_planner_applies_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decision the planner took longer than the poll's SCALE_WAIT to apply (new loaders
    waiting for new workers) was applied, but not in the plugin's decisions (the status
    page's scaling log): it was recorded after the planner answered (review).  It is
    recorded first, marked applied once the planner answers."""
    from msd_dask.core.config import parse_config
    from msd_dask.core.figures import source_figures
    from msd_dask.core.scaling import Scaler

    class _Slow:
        async def scale(self, source: str, n: int) -> int:
            if source == "prose":
                await asyncio.Event().wait()  # still creating the loaders
            return n

    plugin = _plugin({})
    plugin._configs["svc"] = parse_config(config("/nonexistent", name="svc",
                                                 scaling={"policy": "adaptive"}))
    monkeypatch.setattr(Scaler, "decide", lambda self, now, loads: {"code": 3, "prose": 2})
    planner = {"tokens_planned": {"code": 10, "prose": 5}, "starved_seconds": {},
               "loaders": {"code": 2, "prose": 1}, "weights": {"code": 0.7, "prose": 0.3}}
    loader = dict(_loader(1000), cpu_seconds=0.5, cpu_wait_seconds=0.0)
    snap = {"time": 10.0, "planner": planner, "weights_ahead": planner["weights"],
            "sources": source_figures(planner, {"code": [loader] * 2, "prose": [loader]})}
    prev = dict(snap, time=9.0)

    async def run() -> None:
        await asyncio.wait_for(plugin._scale("svc", _Slow(), snap, prev),
                               0.2)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(run())
    got = [(d["source"], d["loaders"], d["from"], d.get("applied", True))
           for d in plugin.decisions["svc"]]
    assert got == [("code", 3, 2, True), ("prose", 2, 1, False)]


class _Silent:
    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        await asyncio.Event().wait()  # a planner that never answers
        raise AssertionError


def test_a_planner_that_does_not_answer_its_stats_is_named(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The poll's bound on a service's stats said 'TimeoutError()' (an audit of the waits)."""
    import msd_dask.plugin.scheduler as module

    monkeypatch.setattr(module, "POLL_WAIT", 0.2)
    plugin = _plugin({"a": _Silent(), "b": _Planner()})
    asyncio.run(asyncio.wait_for(plugin.poll(), 5))
    assert "the planner of 'a' did not answer its stats within 0.2s" in plugin.poll_errors["a"]
    assert "b" in plugin.services and "b" not in plugin.poll_errors


def test_a_planner_that_does_not_answer_holds_back_no_other_services_figures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The services were polled one after another: ``b``'s figures waited for ``a``'s
    planner, which never answers, until its POLL_WAIT ran out (every poll, on the page and
    in ``/metrics``).  They are polled together: ``b``'s figures come while the poll still
    waits for ``a``, whose failure is recorded as before."""
    import msd_dask.plugin.scheduler as module

    # (long against a poll of a fake, short for the test: the poll must still be waiting
    # for 'a' when 'b' is refreshed, whatever the machine's load)
    monkeypatch.setattr(module, "POLL_WAIT", 3.0)
    plugin = _plugin({"a": _Silent(), "b": _Planner()})  # 'a' first, as published

    async def run() -> bool:
        poll = asyncio.create_task(plugin.poll())
        while "b" not in plugin.services and not poll.done():
            await asyncio.sleep(0.01)
        waiting = not poll.done()  # 'b' refreshed while 'a' was not answering
        await asyncio.wait_for(poll, 30)
        return waiting

    assert asyncio.run(run()), "b's figures waited for a's POLL_WAIT"
    assert "b" in plugin.services and "b" not in plugin.poll_errors
    assert "did not answer its stats within 3s" in plugin.poll_errors["a"]


class _CountedSilent(_Silent):
    def __init__(self) -> None:
        self.calls = 0

    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        self.calls += 1
        return await super().snapshot(since, lookahead)


def test_the_next_polls_do_not_wait_for_a_service_that_does_not_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Polled together, every poll still waited for ``a``'s planner, which never answers,
    until its POLL_WAIT ran out: ``b`` was refreshed once per POLL_WAIT, not once per
    period.  The plugin's loop waits at most its period; ``a``'s poll carries over (it is
    not asked again meanwhile) while ``b`` is polled every time."""
    import msd_dask.plugin.scheduler as module

    monkeypatch.setattr(module, "POLL_WAIT", 30.0)
    silent, planner = _CountedSilent(), _Planner()
    plugin = _plugin({"a": silent, "b": planner})

    async def run() -> None:
        for _ in range(3):
            await asyncio.wait_for(plugin.poll(wait=0.2), 10)
        assert planner.calls == 3 and silent.calls == 1
        assert "a" in plugin._polling and "b" in plugin.services
        under_way = list(plugin._polling.values())
        await plugin.close()  # (its polls under way end with it)
        await asyncio.wait(under_way, timeout=10)
        assert all(t.cancelled() for t in under_way)

    asyncio.run(run())


class _Hangs(_Planner):
    """Answers its first ``answers`` polls, then never."""

    def __init__(self, answers: int) -> None:
        super().__init__()
        self.answers = answers

    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        self.answers -= 1
        if self.answers < 0:
            await asyncio.Event().wait()
        return await super().snapshot(since, lookahead)


def test_figures_of_a_service_that_stopped_answering_say_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A planner answers two polls, then hangs; another never answered one.  /metrics kept
    the first's last tokens/s with nothing to say they were stale (an alert on the rate
    never fired), and the second was on neither the page nor /metrics (a review):
    ``msd_poll_ok`` says which answered their last poll, ``msd_poll_answered_timestamp_seconds``
    when, and the status names the service that never answered, with its error."""
    from prometheus_client import REGISTRY, generate_latest

    from msd_dask.plugin import scheduler as module

    monkeypatch.setattr(module, "POLL_WAIT", 0.05)
    plugin = _plugin({"hangs": _Hangs(answers=2), "lost": _Lost()})

    def metrics() -> dict[str, float]:
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in generate_latest(REGISTRY).decode().splitlines()
                if line.startswith("msd_poll_")}

    async def run() -> list[dict[str, float]]:
        module._register_collector(plugin)
        seen = []
        for _ in range(3):
            await plugin.poll()
            seen.append(metrics())
        plugin._client = None  # (a fake: nothing to close)
        await plugin.close()
        return seen

    t0 = time.time()
    _, answered, failed = asyncio.run(run())  # (its second poll answered, its third not)
    assert answered['msd_poll_ok{service="hangs"}'] == 1.0
    assert failed['msd_poll_ok{service="hangs"}'] == 0.0
    at = 'msd_poll_answered_timestamp_seconds{service="hangs"}'
    assert t0 <= failed[at] == answered[at] <= time.time()  # when it last answered
    assert failed['msd_poll_ok{service="lost"}'] == 0.0
    assert 'msd_poll_answered_timestamp_seconds{service="lost"}' not in failed
    status = plugin.status()
    assert "lost" not in status["services"] and "OSError" in status["unanswered"]["lost"]
    assert "did not answer its stats" in status["services"]["hangs"]["poll_error"]


class _Ranks(_Planner):
    """:class:`_Planner` with ``n`` ranks behind its constructors (some lagging)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        import numpy as np

        snap = await super().snapshot(since, lookahead)
        rng = np.random.default_rng(0)
        snap["rank_summary"] = rank_summary(np.arange(self.n), rng.integers(0, 4, self.n),
                                            rng.integers(-1, 100, self.n))
        return snap


def test_a_services_metrics_series_do_not_grow_with_its_ranks() -> None:
    """docs/elastic.md: a service has 27 series plus 7 per source whatever its number of
    ranks (it said "about 30": 40 with two sources, 41 since msd_planner_failed; a
    review)."""
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from msd_dask.plugin import scheduler as module

    def series(n_ranks: int) -> int:
        plugin = _plugin({"many": _Ranks(n_ranks)})
        asyncio.run(plugin.poll())
        module._register_collector(plugin)
        try:
            families = text_string_to_metric_families(generate_latest(REGISTRY).decode())
            return sum(1 for f in families for s in f.samples
                       if s.name.startswith("msd_") and s.labels.get("service") == "many")
        finally:
            module._unregister_collector(plugin)

    assert series(16) == series(16_384) == series(8) == 27 + 7 * 2
    # below 8 ranks, two fewer per missing place among the slowest; no ranks known, no
    # queue-depth quantiles either (the doc said 26 + 7 per source at any size; a review)
    assert [series(n) for n in (4, 1, 0)] == [27 + 14 - 8, 27 + 14 - 14, 27 + 14 - 20]


class _Failed(_Planner):
    """A planner that stopped planning at step 5 (its error), and answers every poll."""

    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        snap = await super().snapshot(since, lookahead)
        snap["planner"]["error"] = "planner failed at step 5: DataError('bad row')"
        return snap


def test_metrics_say_which_planner_stopped_planning() -> None:
    """A planner that failed still answers every poll: ``msd_poll_ok`` read 1 and no series
    said it had stopped, so the alert docs/elastic.md advised never fired (a review).
    ``msd_planner_failed`` is 1 for it, 0 for a planner that plans."""
    from prometheus_client import REGISTRY, generate_latest

    from msd_dask.plugin import scheduler as module

    plugin = _plugin({"dead": _Failed(), "alive": _Planner()})
    asyncio.run(plugin.poll())
    module._register_collector(plugin)
    try:
        lines = generate_latest(REGISTRY).decode().splitlines()
    finally:
        module._unregister_collector(plugin)
    said = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith(("msd_planner_failed", "msd_poll_ok"))}
    assert said == {'msd_planner_failed{service="dead"}': 1.0,
                    'msd_planner_failed{service="alive"}': 0.0,
                    'msd_poll_ok{service="dead"}': 1.0, 'msd_poll_ok{service="alive"}': 1.0}
    assert "step 5" in plugin.status()["services"]["dead"]["error"]


class _Counting(_Planner):
    """A planner whose ``tokens_planned`` and starved seconds start at ``start`` and grow
    by 100 a poll."""

    def __init__(self, start: int):
        super().__init__()
        self.start = start

    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        snap = await super().snapshot(since, lookahead)
        count = self.start + 100 * self.calls
        snap["planner"]["tokens_planned"] = {"code": count, "prose": count}
        snap["planner"]["starved_seconds"] = {"code": count / 100, "prose": count / 100}
        return snap


def test_a_re_created_planners_first_window_is_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A planner re-created by the service's owner counts on from the owner's last
    checkpoint, behind the lost one, and its waits from 0: the adaptive policy's next
    window spanned the two planners, negative consumption and starvation, which dropped a
    source's floor and started its scale-down timer (a review).  The new planner's first
    poll starts the next window."""
    import msd_dask.plugin.scheduler as module

    clock = [1000.0]
    monkeypatch.setattr(module, "time", SimpleNamespace(time=lambda: clock[0],
                                                        monotonic=lambda: clock[0]))
    plugin = _plugin({"svc": _Planner()})
    published = plugin.scheduler.extensions["publish"].datasets  # type: ignore[attr-defined]
    cfg = config("/nonexistent", name="svc", scaling={"policy": "adaptive", "interval": 1.0})
    registry = {"config": cfg, "planner": _Counting(10_000), "owner": "client-1",
                "generation": 0}

    async def get_dataset(key: str) -> dict[str, Any]:
        return registry

    plugin._client.get_dataset = get_dataset  # type: ignore[attr-defined]
    windows: list[tuple[float, float]] = []  # (tokens planned, starved s) over each window

    async def scale(name: str, reg: Any, snap: dict[str, Any], prev: dict[str, Any]) -> None:
        now, then = snap["planner"], prev["planner"]
        windows.append((sum(now["tokens_planned"].values()) - sum(then["tokens_planned"].values()),
                        now["starved_seconds"]["code"] - then["starved_seconds"]["code"]))

    monkeypatch.setattr(plugin, "_scale", scale)

    async def polls() -> None:
        nonlocal registry
        for i in range(8):
            if i == 4:  # re-created from a checkpoint behind the lost planner's counts
                registry = dict(registry, planner=_Counting(5_000), generation=1)
                published["msd-svc"] = object()
            await plugin.poll()
            clock[0] += 1.0

    asyncio.run(polls())
    assert len(windows) == 6  # one a poll, but none across the two planners
    assert windows == [(200.0, 1.0)] * 6, windows


def test_rounds_planned_at_once_do_not_ratchet_the_loaders_up() -> None:
    """2 s steps of 131,072 tokens planned in rounds of 3: the consumption of one poll's
    window was no token or a whole round, and the proactive target followed the rounds up
    at once and never down (1 loader's worth held at 5; a review).  Measured over
    ``scale_down_after``, it is the steps' rate."""
    from msd_dask.core.config import parse_config
    from msd_dask.core.figures import source_figures

    class _Scaled:
        def __init__(self) -> None:
            self.calls: list[tuple[str, int]] = []

        async def scale(self, source: str, n: int) -> int:
            self.calls.append((source, n))
            return n

    plugin = _plugin({})
    plugin._configs["svc"] = parse_config(config("/nonexistent", name="svc",
                                                 scaling={"policy": "adaptive"}))
    planner = _Scaled()

    def snap(t: int) -> dict[str, Any]:
        half = 3 * 131_072 * (t // 6 + 1) // 2  # each source's tokens planned so far
        figures = {"tokens_planned": {"code": half, "prose": half}, "starved_seconds": {},
                   "loaders": {"code": 1, "prose": 1}, "weights": {"code": 0.5, "prose": 0.5}}
        loader = dict(_loader(half), read_seconds=half * 2e-5, cpu_seconds=half * 1e-6,
                      cpu_wait_seconds=0.0)
        return {"time": float(t), "planner": figures, "weights_ahead": figures["weights"],
                "sources": source_figures(figures, {"code": [loader], "prose": [loader]})}

    async def run() -> None:
        for t in range(1, 120):
            await plugin._scale("svc", planner, snap(t), snap(t - 1))

    asyncio.run(run())
    assert planner.calls == [] and plugin._targets["svc"] == {"code": 1, "prose": 1}
