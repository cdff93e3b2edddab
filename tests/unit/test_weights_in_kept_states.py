"""A live ``set_weights`` reaches the states the planner keeps for the steps it planned
already: a service resumed from ``state_at(k)``, or a planner re-created from its
``checkpoint()``, makes the change at the same step as the live service (found by a review:
the kept states lacked it, so a resumed service kept the old mix)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from test_planner_recreated import _plan, without_dask

from msd_dask import load_config
from msd_dask.core.plan import Planner, StepPlan
from msd_dask.roles.planner import PlannerActor, unpack_snapshot
from msd_dask.sources.discover import discover_units
from msd_dask.sources.documents import read_unit
from msd_dask.sources.storage import open_source
from msd_dask.sources.tokenizer import ByteTokenizer

from corpus import config

NEW = {"code": 0.05, "prose": 0.95}


def _actor(corpus: Any) -> tuple[Any, PlannerActor, Any]:
    """The config, a planner's actor on the corpus (no Dask worker) and its lookup."""
    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)
    actor = PlannerActor(cfg.to_dict(), units, roots)
    lengths: dict[tuple[str, int], np.ndarray] = {}
    for s in cfg.sources:
        fs = open_source(s.uri, s.storage_options).fs
        for i, u in enumerate(actor.units[s.name]):
            lengths[(s.name, i)] = np.array([len(d) for d in read_unit(s, fs, u,
                                                                         ByteTokenizer())])

    def lookup(source: str, epoch: int, unit: int) -> np.ndarray:
        return lengths[(source, unit)]

    actor._lookup = lookup  # type: ignore[method-assign]
    without_dask(actor)  # (no Dask worker holds this actor here: its checkpoint names none)
    return cfg, actor, lookup


def _plans(actor: PlannerActor) -> dict[int, StepPlan]:
    """Every plan the actor's planner makes from now on, by step (the actor keeps none)."""
    plans: dict[int, StepPlan] = {}
    plan_step = actor.planner.plan_step

    def keeping(lookup: Any) -> StepPlan:
        plan = plan_step(lookup)
        plans[plan.step] = plan
        return plan

    actor.planner.plan_step = keeping  # type: ignore[method-assign]
    return plans


def test_weight_changes_every_step_keep_the_planner_bounded(corpus: Any) -> None:
    """A change made every step was kept for ever (each call one more entry, each step a
    pass over them all); the actor now forgets those no kept state can see, and every kept
    state still plans the changes the live planner made.  The ranks keep up: each step,
    the owner's checkpoint finds they returned the step before (the states of the steps
    they have not returned are kept beyond the count, test_kept_states.py)."""
    cfg, actor, lookup = _actor(corpus)
    world = cfg.parallel.world_size

    async def stats(max_age: float = 0.0) -> list[dict[str, Any]]:
        step = actor.planner.step - 2
        return [{"shown": dict.fromkeys(range(world), step),
                 "returned": dict.fromkeys(range(world), step)}]

    actor.roles.constructor_stats = stats  # type: ignore[method-assign]

    async def run() -> None:
        live = _plans(actor)
        for k in range(60):
            await actor.checkpoint()
            await actor.set_weights({"code": 1.0 + k % 5, "prose": 1.0 + k % 3})
            if k % 7 == 0:  # made ahead, then replaced by the next steps' changes
                await actor.set_weights({"code": 9.0, "prose": 1.0},
                                        from_step=actor.planner.step + 2)
            await _plan(actor, 1)
            assert len(actor.planner.overrides) <= actor._keep + 3, actor.planner.overrides
        # every kept state, each resumed, plans the steps after it as the live planner did
        # (a review: the oldest alone did not tell a threshold one step too early)
        for kept in list(actor._snapshots):
            resumed = Planner(cfg, actor.units)
            resumed.load_state_dict((await actor.state_at(kept))["planner"])
            for step in range(kept + 1, max(live) + 1):
                p = resumed.plan_step(lookup)
                assert p.step == step and p.weights == live[step].weights, (kept, step)
                assert np.array_equal(p.table, live[step].table)

    asyncio.run(run())


def test_a_weight_change_reaches_the_kept_states(corpus: Any) -> None:
    cfg, actor, lookup = _actor(corpus)

    async def run() -> None:
        await _plan(actor, 10)
        before = await actor.checkpoint()
        start = await actor.set_weights(NEW)
        assert start == 10
        live = _plans(actor)
        await _plan(actor, 10)
        # the readers are at step 7: a resume from its state changes the mix at step 10
        resumed = Planner(cfg, actor.units)
        resumed.load_state_dict((await actor.state_at(7))["planner"])
        again = {}
        for _ in range(13):
            p = resumed.plan_step(lookup)
            again[p.step] = p
        for step in (10, 15, 19):
            assert again[step].weights == live[step].weights
            assert again[step].weights["prose"] > 0.9
            assert np.array_equal(again[step].table, live[step].table)
        # the owner's next checkpoint of the same step comes with the changed state
        ck = await actor.checkpoint(have=before["step"], have_version=before["version"])
        assert ck["step"] == before["step"] and ck["version"] == before["version"] + 1
        assert ck["state"] is not None and unpack_snapshot(ck["state"]).overrides[-1][0] == 10
        same = await actor.checkpoint(have=ck["step"], have_version=ck["version"])
        assert same["state"] is None

    asyncio.run(run())
