"""A live ``set_weights`` reaches the states the planner keeps for the steps it planned
already: a service resumed from ``state_at(k)``, or a planner re-created from its
``checkpoint()``, makes the change at the same step as the live service (found by a review:
the kept states lacked it, so a resumed service kept the old mix)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from test_planner_recreated import _plan

from msd_dask import load_config
from msd_dask.core.plan import Planner
from msd_dask.roles.planner import PlannerActor, _unpacked
from msd_dask.sources.discover import discover_units
from msd_dask.sources.documents import read_unit
from msd_dask.sources.storage import open_source
from msd_dask.sources.tokenizer import ByteTokenizer

from corpus import config

NEW = {"code": 0.05, "prose": 0.95}


def test_a_weight_change_reaches_the_kept_states(corpus: Any) -> None:
    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)

    async def run() -> None:
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
        # (no Dask worker holds this actor here: its checkpoint names none)
        actor.roles.own_address = lambda: "tcp://198.18.0.2:0"  # type: ignore[method-assign]

        await _plan(actor, 10)
        before = await actor.checkpoint()
        start = await actor.set_weights(NEW)
        assert start == 10
        live = {p.step: p for p in await _plan(actor, 10)}
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
        assert ck["state"] is not None and _unpacked(ck["state"]).overrides[-1][0] == 10
        same = await actor.checkpoint(have=ck["step"], have_version=ck["version"])
        assert same["state"] is None

    asyncio.run(run())
