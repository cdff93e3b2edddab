"""The scheduler plugin's poll over fake published services (no Dask): one service that
does not answer stops no other's figures, and a source's token rate never goes negative when
a loader is retired or re-created (found by a review, each by running it)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from msd_dask.plugin.scheduler import MsdSchedulerPlugin

from corpus import config


class _Handle:
    """What awaiting a registry's ``planner`` gives."""

    def __init__(self, planner: Any):
        self.planner = planner

    def __await__(self) -> Any:
        if False:
            yield
        return self.planner


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
                "constructors": [], "history": [], "weights_ahead": None}


class _Lost:
    async def snapshot(self, since: int, lookahead: int | None) -> dict[str, Any]:
        raise OSError("Timed out trying to connect to tcp://198.18.0.9:4321")


def _plugin(planners: dict[str, Any]) -> MsdSchedulerPlugin:
    registries = {f"msd-{n}": {"config": config("/nonexistent", name=n), "planner": _Handle(p)}
                  for n, p in planners.items()}

    async def get_dataset(key: str) -> dict[str, Any]:
        return registries[key]

    plugin = MsdSchedulerPlugin()
    plugin.scheduler = SimpleNamespace(  # type: ignore[assignment]
        extensions={"publish": SimpleNamespace(datasets={k: object() for k in registries})},
        tasks={}, workers={}, plugins={})
    plugin._client = SimpleNamespace(get_dataset=get_dataset, refcount={})  # type: ignore[assignment]
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
