"""A planner re-created from the owner's checkpoint re-plans steps some ranks had from the
lost one (``had``): a weight change then starts after them, the state of such a step is
waited for, not refused; and a checkpoint taken while a constructor does not answer finds
its floor's state kept, whatever the prefetch (each found by a review of the planner)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from msd_dask import load_config
from msd_dask.roles.planner import PlannerActor
from msd_dask.sources.discover import discover_units
from msd_dask.sources.documents import read_unit
from msd_dask.sources.storage import open_source
from msd_dask.sources.tokenizer import ByteTokenizer

from corpus import config

NEW = {"code": 0.05, "prose": 0.95}


def _actor(cfg: Any, units: Any, roots: Any, state: Any = None,
           lengths: dict[tuple[str, int], np.ndarray] | None = None,
           **kwargs: Any) -> tuple[PlannerActor, dict[tuple[str, int], np.ndarray]]:
    """A planner actor without Dask, its units' lengths read from the corpus."""
    actor = PlannerActor(cfg.to_dict(), units, roots, state, **kwargs)
    if lengths is None:
        lengths = {}
        for s in cfg.sources:
            fs = open_source(s.uri, s.storage_options).fs
            for i, u in enumerate(actor.units[s.name]):
                lengths[(s.name, i)] = np.array([len(d) for d in read_unit(s, fs, u,
                                                                             ByteTokenizer())])
    known = lengths
    actor._lookup = lambda source, epoch, unit: known[(source, unit)]  # type: ignore[method-assign]
    actor.roles.own_address = lambda: "tcp://198.18.0.2:0"  # type: ignore[method-assign]
    return actor, lengths


async def _plan(actor: PlannerActor, n: int) -> list[Any]:
    """What the planning loop does per step."""
    plans = []
    for _ in range(n):
        async with actor._planning():
            p, _used, _record, _features, after = await actor._off_loop(actor._plan_next)
        actor._snapshot(p.step, *after)
        plans.append(p)
    return plans


def test_a_weight_change_on_a_re_created_planner_starts_after_what_ranks_had(corpus: Any) -> None:
    """Rank 0 had steps up to 8 from the lost planner, rank 1 up to 3, the checkpoint is
    the state after step 3: a change made right after the re-creation started at step 4,
    so rank 1 took its share of steps 4-8 from another plan than rank 0's."""
    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)

    async def run() -> None:
        old, lengths = _actor(cfg, units, roots)
        was = {p.step: p for p in await _plan(old, 12)}
        new, _ = _actor(cfg, units, roots, old._packed_at(3), lengths, generation=1,
                        had={0: 8, 1: 3})
        assert await new.set_weights(NEW) == 9
        now = {p.step: p for p in await _plan(new, 8)}
        for step in range(4, 9):  # re-planned as the lost planner planned them
            np.testing.assert_array_equal(now[step].table, was[step].table)
        assert now[9].weights["prose"] == pytest.approx(0.95)

    asyncio.run(run())


def test_the_state_of_a_step_ranks_had_from_the_lost_planner_is_waited_for(corpus: Any) -> None:
    """Right after the re-creation (from the state after step 3, ranks at step 9), the state
    of step 9 was refused at once as 'not planned yet', while it is re-planned within
    seconds (at dp 16,384, a minute): a training checkpoint taken then failed."""
    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)

    async def run() -> None:
        old, lengths = _actor(cfg, units, roots)
        await _plan(old, 12)
        want = await old.state_at(9)
        new, _ = _actor(cfg, units, roots, old._packed_at(3), lengths, generation=1,
                        had={0: 9, 1: 9})

        async def replan() -> None:  # the new planning loop, a step every 0.2 s
            for _ in range(8):
                await asyncio.sleep(0.2)
                await _plan(new, 1)

        loop = asyncio.ensure_future(replan())
        t0 = time.monotonic()
        assert await new.state_at(9) == want
        assert time.monotonic() - t0 > 0.5  # (waited for: steps 4-9 re-planned first)
        await loop

    asyncio.run(run())


@pytest.mark.parametrize("prefetch", [4, 18, 32])
def test_a_checkpoint_while_a_constructor_does_not_answer_finds_its_state(
        corpus: Any, prefetch: int) -> None:
    """The planner waits for room with a round planned past the last one submitted; a
    constructor does not answer (its worker was lost, when a checkpoint matters most), so
    the checkpoint takes its floor, prefetch + round_steps behind the last step
    submitted.  From prefetch 18 its state was no longer kept, and the checkpoint failed."""
    root, _ = corpus
    cfg = load_config(config(root, prefetch=prefetch))
    units, roots = discover_units(cfg)
    k = cfg.steps_per_round

    async def run() -> None:
        actor, _ = _actor(cfg, units, roots)
        await _plan(actor, 6 * k)  # five rounds submitted, the sixth planned
        actor._last_submitted = 5 * k - 1

        async def stats(max_age: float = 0.0) -> list[dict[str, Any]]:
            return [{"shown": {0: 0}, "returned": {0: 0}},
                    {"unanswered": "no answer within 5s"}]

        actor.roles.constructor_stats = stats  # type: ignore[method-assign]
        ck = await actor.checkpoint()
        # the floor: prefetch + round_steps behind the last step submitted, its state kept
        assert ck["step"] == (5 * k - 1) - prefetch - k and ck["state"] is not None

    asyncio.run(run())
