"""The owner stops re-creating a planner lost again and again without progress (something
kills the workers the service's roles start on), and only then: a planner that planned past
the furthest step planned before, or lived long, starts the count again."""

from __future__ import annotations

from typing import Any

from msd_dask.service import recovery
from msd_dask.service.recovery import FUTILE_LIMIT, PlannerKeeper


class _Link:
    name, generation, client = "svc", 0, None


def _lost(keeper: PlannerKeeper, planned: int | None = None,
          reading: list[str] | None = None) -> None:
    """The current generation checkpointed ``planned`` (its next step to plan) and
    ``reading``, if given, then was lost; the next one starts."""
    if planned is not None:
        keeper._note_progress({"planned": planned, "reading": reading or []})
    keeper._count_loss()
    keeper._count_loss()  # (a failed try to re-create it counts nothing more)
    keeper.link.generation += 1
    keeper._generation_started()


def test_only_planners_lost_in_a_row_without_progress_count() -> None:
    keeper = PlannerKeeper(_Link(), {})  # type: ignore[arg-type]
    _lost(keeper, planned=10)  # it planned steps 0-9 first
    assert keeper._futile == 0
    _lost(keeper, planned=10)  # re-planned up to step 9 again
    _lost(keeper)  # lost before its first checkpoint
    assert keeper._futile == 2
    _lost(keeper, planned=13)  # past step 9: progress
    assert keeper._futile == 0
    for n in range(1, FUTILE_LIMIT + 1):
        _lost(keeper, planned=13, reading=["a: f1", "b: f2"] if n % 2 else ["a: f1"])
        assert keeper._futile == n
    assert keeper._suspects == {"a: f1": FUTILE_LIMIT, "b: f2": (FUTILE_LIMIT + 1) // 2}


def test_a_planner_that_lived_long_starts_the_count_again(monkeypatch: Any) -> None:
    keeper = PlannerKeeper(_Link(), {})  # type: ignore[arg-type]
    _lost(keeper)
    _lost(keeper)
    assert keeper._futile == 2
    monkeypatch.setattr(recovery, "SHORT_LIVED", 0.0)  # (every generation lived long)
    _lost(keeper)
    assert keeper._futile == 0 and not keeper._suspects


def test_giving_up_tells_the_readers_why() -> None:
    """The reason, naming the files the lost loaders were reading, is the link's (this
    process's readers) and published with the registry (every other reader's, see
    PlannerLink.raise_if_lost)."""
    published: list[dict[str, Any]] = []

    class _Client:
        scheduler = type("Rpc", (), {"get_metadata": None})

        def publish_dataset(self, registry: dict[str, Any], **kw: Any) -> None:
            published.append(registry)

        def sync(self, *a: Any, **kw: Any) -> Any:  # (the scheduler's metadata)
            return {"generation": keeper.link.generation, "files": ["prose: crash.jsonl"]}

    link: Any = _Link()
    link.client, link.registry, link.failed = _Client(), {"generation": 0}, None
    link.config = type("Config", (), {"timeout": 5})()
    keeper = PlannerKeeper(link, {})
    for _ in range(FUTILE_LIMIT):
        _lost(keeper)
    keeper._give_up()
    assert keeper.gave_up is not None and "prose: crash.jsonl" in keeper.gave_up
    assert f"lost with its worker {FUTILE_LIMIT} times in a row" in keeper.gave_up
    assert link.failed == keeper.gave_up == published[0]["failed"]


def test_a_resumed_service_counts_progress_from_its_state() -> None:
    """A service resumed after step 40 whose first planner is lost before planning step 41
    made no progress (it counted as if it had, from step -1)."""
    keeper = PlannerKeeper(_Link(), {"resume": {"step": 40}})  # type: ignore[arg-type]
    _lost(keeper, planned=41)  # its next step: 41, nothing planned yet
    assert keeper._futile == 1
