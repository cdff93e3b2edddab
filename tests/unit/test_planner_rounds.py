"""The planning loop's rounds (``PlannerActor._loop`` with stand-ins for its roles)."""

from __future__ import annotations

import asyncio
from typing import Any

from msd_dask import load_config
from msd_dask.roles.planner import PlannerActor
from msd_dask.sources.discover import discover_units

from corpus import config
from planner_roles import FakeRoles, unit_lengths


def test_lengths_the_loaders_reported_are_planned_with_at_once(corpus: Any,
                                                               monkeypatch: Any) -> None:
    """Lengths a loader had reported reached the planning thread only after an attempt at a
    step failed for want of them (``NeedMetadata``): every new window threw an attempt away
    and cut its round short, though read-ahead had fetched them long before (with loaders
    that answer at once, rounds of 3, 3, 2, 3, 2, ...; a review).  Before each step the
    loop takes in what was reported: no attempt misses a length reported before it."""
    import msd_dask.roles.planner as planner_module
    from msd_dask.core.stream import NeedMetadata

    root, _ = corpus
    cfg = load_config(config(root))
    units, roots = discover_units(cfg)
    monkeypatch.setattr(planner_module, "split_plan", lambda plan, *args, **kw: [None])
    monkeypatch.setattr(planner_module, "pack_works", lambda works, threads=1: [b""])
    reported: list[set[Any]] = []  # before each attempt, the lengths reported
    missed: list[Any] = []  # lengths an attempt lacked though they were reported before it

    async def run() -> FakeRoles:
        actor = PlannerActor(cfg.to_dict(), units, roots)
        roles = FakeRoles(cfg, unit_lengths(cfg, actor.units))
        actor.roles = roles  # type: ignore[assignment]
        plan_next = actor._plan_next
        take = actor._take_reported_lengths

        def taken() -> None:
            reported.append({k for k, t in actor._meta_tasks.items() if t.done()}
                            | set(actor._meta))
            take()

        def counted() -> Any:
            try:
                return plan_next()
            except NeedMetadata as nm:
                missed.extend(k for k in ((nm.source, e, u) for e, u in nm.units)
                              if k in reported[-1])
                raise

        actor._take_reported_lengths = taken  # type: ignore[method-assign]
        actor._plan_next = counted  # type: ignore[method-assign]
        loop = asyncio.ensure_future(actor._loop())
        while sum(map(len, roles.submitted)) < 30 and not loop.done():
            await asyncio.sleep(0.02)
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
        assert not roles.told, roles.told
        return roles

    roles = asyncio.run(run())
    steps = [s for r in roles.submitted for s in r]
    assert len(steps) >= 30 and steps == list(range(len(steps)))
    assert missed == []
    assert len(reported) >= len(steps)
