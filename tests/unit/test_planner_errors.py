"""What the planner's readers are told when its loop fails: the round being handed over,
not the next step, which was never planned (found by a review, by running it)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from msd_dask import load_config
from msd_dask.roles.planner import PlannerActor
from msd_dask.sources.discover import discover_units

from corpus import config
from planner_roles import FakeRoles, unit_lengths


def _told(corpus: Any, monkeypatch: Any, split: Any, scaling_fails: int = 0) -> list[str]:
    """What the readers of a planner are told whose constructors refuse every round, its
    steps split by ``split`` (in place of ``split_plan``); with ``scaling_fails``, whose
    constructors take every round and whose ``scaling_fails``-th look at the scaling
    fails."""
    import msd_dask.roles.planner as planner_module

    root, _ = corpus
    cfg = load_config(config(root))
    units, roots = discover_units(cfg)

    class Roles(FakeRoles):  # constructors that refuse every round, or a scaling that fails
        looks = 0

        async def apply_scaling(self) -> None:
            self.looks += 1
            if self.looks == scaling_fails:
                raise RuntimeError(f"scaling look {self.looks} failed")

        async def submit(self, steps: list[Any], room: int) -> None:
            if not scaling_fails:
                raise RuntimeError(f"constructor 0 refused steps {[s for s, *_ in steps]}")

    roles = Roles(cfg)

    async def run() -> None:
        actor = PlannerActor(cfg.to_dict(), units, roots)
        # every unit's lengths known: the loop plans without loaders
        for (source, unit), lengths in unit_lengths(cfg, actor.units).items():
            for epoch in range(3):
                actor._meta[(source, epoch, unit)] = lengths
        actor.roles = roles  # type: ignore[assignment]
        monkeypatch.setattr(planner_module, "split_plan", split)
        monkeypatch.setattr(planner_module, "pack_works", lambda works, threads=1: [b""])
        await actor._loop()

    asyncio.run(run())
    return roles.told


def test_a_round_that_cannot_be_handed_over_is_named(corpus: Any, monkeypatch: Any) -> None:
    assert _told(corpus, monkeypatch, lambda plan, *args: [None]) == [
        "planner failed at handing over steps 0-2: constructor 0 refused steps [0, 1, 2]"]


def test_a_step_that_cannot_be_split_is_named(corpus: Any, monkeypatch: Any) -> None:
    """A step is split for the constructors as it is planned, after the planner moved on
    to the next: a failed split named that next step (a review)."""
    def split(plan: Any, *args: Any) -> list[Any]:
        if plan.step == 1:
            raise KeyError(("code", 0, 7))
        return [None]

    assert _told(corpus, monkeypatch, split) == ["planner failed at step 1: ('code', 0, 7)"]


def test_a_failure_between_rounds_names_the_next_step(corpus: Any, monkeypatch: Any) -> None:
    """A failure after a round was handed over (healing, scaling, the read-ahead) named the
    last step planned, which ranks had already (a review): it names the next one."""
    assert _told(corpus, monkeypatch, lambda plan, *args: [None], scaling_fails=2) == [
        "planner failed at step 3: scaling look 2 failed"]


def test_a_wait_for_a_source_under_way_counts_as_starved_as_it_goes() -> None:
    """The planner counted a wait for a source's lengths only when the wait ended: a 10 s
    stall showed as no wait for ten polls, then as 10 s in one, so the adaptive policy's
    reactive rule came late and then over-corrected (a review of the plugin)."""
    import time as time_module

    planner = PlannerActor.__new__(PlannerActor)
    planner._meta_wait = {"a": 1.5, "b": 0.0}
    planner._meta_waiting = ("b", time_module.monotonic() - 2.0)  # waiting for 2 s now
    got = planner._starved_seconds()
    assert got["a"] == 1.5 and 2.0 <= got["b"] < 3.0
    planner._meta_waiting = None
    assert planner._starved_seconds() == {"a": 1.5, "b": 0.0}


def test_bad_input_is_logged_as_its_message_and_a_bug_with_its_traceback(
        corpus: Any, monkeypatch: Any, caplog: Any) -> None:
    """``msd-dask run`` over a corrupt file printed 55 lines of the planner's traceback
    before the one-line error naming the file (a newcomer's review): a DataError is its
    message alone; anything else keeps its traceback for the bug report."""
    import logging

    from msd_dask.errors import DataError

    def bad(plan: Any, *args: Any) -> list[Any]:
        raise DataError("source 'code', file 'x.parquet', row 3: no field 'text'")

    with caplog.at_level(logging.ERROR, logger="msd_dask.roles.planner"):
        assert _told(corpus, monkeypatch, bad) == [
            "planner failed at step 0: source 'code', file 'x.parquet', row 3: no field 'text'"]
    (rec,) = [r for r in caplog.records if r.name == "msd_dask.roles.planner"]
    assert rec.exc_info is None and "row 3: no field 'text'" in rec.getMessage()
    caplog.clear()

    def bug(plan: Any, *args: Any) -> list[Any]:
        raise KeyError(("code", 0, 7))

    with caplog.at_level(logging.ERROR, logger="msd_dask.roles.planner"):
        _told(corpus, monkeypatch, bug)
    (rec,) = [r for r in caplog.records if r.name == "msd_dask.roles.planner"]
    assert rec.exc_info is not None


def test_step_time_reports_are_kept_by_step_and_go_with_their_features() -> None:
    """The reports of step times were one set of ``(step, rank)``, rebuilt whole on the
    planner's event loop at every planned step once the features of ``4 × keep`` steps were
    held: 0.7 s a step at dp 16,384 (a review).  They are kept by step, and the oldest
    step's go with its features; a rank's second report of a step still counts once."""
    from collections import OrderedDict

    class Fitter:
        observed: list[float] = []

        def plausible(self, *args: Any) -> bool:
            return True

        def observe_sums(self, sum_lengths: float, sum_squares: float, seconds: float) -> None:
            self.observed.append(seconds)

    planner = PlannerActor.__new__(PlannerActor)
    planner._keep, planner.fitter, planner.set_aside = 1, Fitter(), 0
    planner._step_features, planner._reported, planner._reports_seen = OrderedDict(), {}, {}
    features = np.ones((2, 2))

    async def run() -> None:
        for step in range(12):
            planner._keep_features(step, features)
            for _ in range(2):  # (a rank's report of a step sent twice)
                await planner.report_step_time(step, 0, 1.0 + step)
            await planner.report_step_time(step, 1, 1.0 + step)

    asyncio.run(run())
    assert list(planner._step_features) == list(range(8, 12))
    assert sorted(planner._reported) == list(range(8, 12))
    assert all(ranks == {0, 1} for ranks in planner._reported.values())
    # each rank's report of each step once: two per step, the first WARMUP_REPORTS of each
    # rank set aside
    from msd_dask.roles.planner import WARMUP_REPORTS
    assert planner._reports_seen == {0: 12, 1: 12}
    assert len(Fitter.observed) + planner.set_aside == 24
    assert planner.set_aside == 2 * WARMUP_REPORTS
    # a late report of a step whose features went is not counted
    asyncio.run(planner.report_step_time(3, 0, 9.0))
    assert planner._reports_seen[0] == 12 and 3 not in planner._reported
