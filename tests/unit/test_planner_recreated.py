"""The planner's actor without Dask.  A planner re-created from the owner's checkpoint
re-plans steps some ranks had from the lost one (``had``): a weight change then starts
after them, the state of such a step is waited for, not refused; a checkpoint taken while a
constructor does not answer finds its floor's state kept, whatever the prefetch (each found
by a review of the planner); and a planned step keeps only its packed work."""

from __future__ import annotations

import asyncio
import gc
import time
from collections import defaultdict
from types import SimpleNamespace
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
    without_dask(actor)
    return actor, lengths


def without_dask(actor: PlannerActor) -> None:
    """Stand-ins for what a planner's actor has of Dask: its worker's address, two
    constructors to split the steps for, and every unit read by loader slot 0."""
    actor.roles.own_address = lambda: "tcp://198.18.0.2:0"  # type: ignore[method-assign]
    actor.roles.constructors = [SimpleNamespace(key=f"constructor-{i}") for i in range(2)]
    actor._owner = defaultdict(int)


async def _plan(actor: PlannerActor, n: int) -> list[Any]:
    """What the planning loop does per step."""
    plans = []
    for _ in range(n):
        async with actor._planning():
            p = await actor._off_loop(actor._plan_next)
        actor._snapshot(p.step, *p.after)
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
            assert now[step].work == was[step].work
        assert now[9].record["weights"]["prose"] == pytest.approx(0.95)

    asyncio.run(run())


@pytest.mark.parametrize("from_step", [12.9, "x", True])
def test_a_re_created_planner_refuses_a_from_step_that_is_no_step(corpus: Any,
                                                                   from_step: Any) -> None:
    """A re-created planner, its ranks' steps ahead of it, took ``int(from_step)`` before the
    planner's check: 12.9 was taken as step 12, and ``'x'`` raised int()'s own words without
    naming ``set_weights``; a first planner refuses both (a review)."""
    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)

    async def run() -> None:
        for had in (None, {0: 8, 1: 3}):
            new, _ = _actor(cfg, units, roots, generation=1, had=had)
            with pytest.raises(ValueError, match=r"set_weights: from_step must be a step \(an "
                                                 rf"integer\), got {from_step!r}"):
                await new.set_weights(NEW, from_step)
            assert new.planner.overrides == []

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


def test_a_step_never_planned_is_refused_before_the_caller_gives_up(corpus: Any) -> None:
    """The planner waited the config's whole ``timeout`` for a step of its next round, as
    long as its caller (``DataService.state_dict``) waits for the answer: the caller gave up
    first and said the planner did not answer, where the planner says the step is not
    planned yet (a review).  It waits half of it."""
    root, _ = corpus
    cfg = load_config(config(root, prefetch=4, timeout=2))
    units, roots = discover_units(cfg)

    async def run() -> None:
        actor, _ = _actor(cfg, units, roots)  # (its loop does not run: nothing is planned)
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="step 1 is not planned yet"):
            await actor.state_at(1)
        assert 0.9 < time.monotonic() - t0 < 2.0

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


def test_a_planned_step_keeps_neither_its_plan_nor_its_unpacked_work(corpus: Any) -> None:
    """The planning loop holds a round of steps until the constructors have room for it: it
    held each step's plan and, handing the round over, every step's unpacked work too (at
    dp 16,384 x 128K each up to 160 MiB, and a round of three was most of the planner's
    memory).  A planned step now keeps its work packed alone, and a constructor on the
    planner's worker gets it unpacked, in arrays of its own; nor the snapshot of the
    planner's state, which holds the step's carried and held pieces (a review), only its
    counts and the state packed."""
    from msd_dask.core.plan import PlannerSnapshot, StepPlan
    from msd_dask.roles.constructor import StepPieces, unpack_work

    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)

    def alive() -> list[Any]:
        gc.collect()
        return [o for o in gc.get_objects() if type(o) in (StepPlan, StepPieces, PlannerSnapshot)]

    before = {id(o) for o in alive()}  # (what other tests of this process may hold)

    async def run() -> tuple[list[Any], list[Any]]:
        actor, _ = _actor(cfg, units, roots)
        planned = await _plan(actor, cfg.steps_per_round)
        # (while the actor lives)
        return planned, [o for o in alive() if id(o) not in before]

    planned, alive = asyncio.run(run())
    assert not alive, alive
    assert [p.step for p in planned] == list(range(cfg.steps_per_round))
    # each constructor's packed work is a whole work: its ranks' rows, and nothing shared
    works = [unpack_work(w) for w in planned[0].work]
    assert [list(w.dps) for w in works] == [[0], [1]]
    assert all(len(w.pieces) for w in works)
    assert not np.shares_memory(works[0].pieces, works[1].pieces)


def _with_roles(actor: PlannerActor, lengths: dict[tuple[str, int], np.ndarray]) -> None:
    """As :func:`without_dask`, but the units keep their real owners: one loader slot per
    source, told its units at once and answering their lengths at once."""
    without_dask(actor)
    actor._owner = {}
    del actor._lookup  # (the actor's own: a unit not given out yet asks for its lengths)

    async def told(*args: Any, **kwargs: Any) -> None:
        return None

    def answered(k: tuple[str, int, int]) -> None:
        actor._meta[k] = lengths[(k[0], k[2])]

    actor.roles.next_slot = lambda source, outstanding=None: 0  # type: ignore[method-assign]
    actor.roles.assign_units = told  # type: ignore[method-assign]
    actor.roles.release_units = told  # type: ignore[method-assign]
    actor.roles.active = {s.name: [0] for s in actor.cfg.sources}
    actor._request_meta = answered  # type: ignore[method-assign]


async def _loop_step(actor: PlannerActor) -> Any:
    """A step as the planning loop takes it: its units given out first, then planned (the
    lengths of a unit not known yet fetched, and planned again)."""
    from msd_dask.core.stream import NeedMetadata

    await actor._assign_ahead()
    while True:
        try:
            async with actor._planning():
                p = await actor._off_loop(actor._plan_next)
            break
        except NeedMetadata as nm:
            await actor._ensure(nm.source, nm.units)
    actor._snapshot(p.step, *p.after)
    return p


def test_a_resumed_planner_gives_out_the_units_of_its_carried_pieces(corpus: Any) -> None:
    """A planner resumed from a state (``resume=``, ``msd-dask serve --resume``) or re-created
    from the owner's checkpoint gave loaders only the units of its streams' windows and
    read-ahead: a piece carried from a unit behind them (or an outlier held for steps) had
    no owner, and splitting the first step raised ``KeyError`` (a review of the resume
    path).  Resumed at such a step, both plan the next step as the live planner did."""
    import json

    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)

    async def run() -> None:
        live, lengths = _actor(cfg, units, roots)
        _with_roles(live, lengths)
        behind: set[Any] = set()
        for _ in range(60):
            p = await _loop_step(live)
            upcoming = {(s.name, e, u) for s in cfg.sources
                        for e, u in live._upcoming(s.name, s.read_ahead)}
            behind = live.planner.pending_units() - upcoming
            if behind:
                break
        assert behind, "no step left a piece behind the streams' windows"
        k = p.step
        after = (await _loop_step(live)).work
        for state in (json.loads(json.dumps(await live.state_at(k))), live._packed_at(k)):
            again, _ = _actor(cfg, units, roots, state, lengths)
            _with_roles(again, lengths)
            assert (await _loop_step(again)).work == after

    asyncio.run(run())


@pytest.mark.parametrize("in_files", [False, True], ids=["in-memory", "in-files"])
def test_a_round_lost_on_its_way_with_its_constructor_reaches_the_re_created_one(
        corpus: Any, in_files: bool, tmp_path: Any, monkeypatch: Any) -> None:
    """Rank 0 is handed its first round and the answer is lost on its way (its constructor's
    worker went down, taking the connection with it) while rank 1, of the same DP group,
    reads on.  The planner goes as far as the constructor's room lets it, then the service
    re-creates the constructor with the steps the planner keeps
    (:meth:`PlannerActor.unclaimed_steps`): rank 0, asking again for its first step, gets
    the lost round, the same batches, then the steps rank 1 read meanwhile.  The planner
    keeps the steps after ``last submitted - prefetch``: a rank claimed every step up to
    ``prefetch - round_steps`` behind, and may lack its last round of them.  ``in-files``:
    each step's work is kept in a file of the worker's local directory, as a large one is
    (:class:`~msd_dask.roles.kept_work.KeptWork`), and each file goes with its step."""
    from test_constructor_bookkeeping import ToyLoader

    from msd_dask.core.packing import from_wire
    from msd_dask.roles.constructor import DataConstructor, unpack_work

    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)
    k = cfg.steps_per_round

    async def constructor() -> DataConstructor:
        """Constructor 0 of the two (DP rank 0: ranks 0 and 1), its loaders answering at once."""
        con = DataConstructor("lost", 0, {0: [0, 1]}, cfg.batch.seq_len, 0,
                              prefetch=cfg.prefetch, timeout=30.0)
        con._room, con._work = asyncio.Condition(), asyncio.Queue()
        con.loaders = {s.name: {0: ToyLoader()} for s in cfg.sources}
        con._task = asyncio.create_task(con._builder())
        return con

    async def run() -> None:
        actor, _ = _actor(cfg, units, roots)
        if in_files:
            monkeypatch.setattr("msd_dask.roles.kept_work.SPILL_FROM", 1)
            actor._kept_directory = str(tmp_path)
        old = await constructor()

        async def submit(steps: list[tuple[int, list[bytes]]], room: int) -> None:
            await old.submit([(s, unpack_work(work[0])) for s, work in steps], room)

        actor.roles.submit = submit  # type: ignore[method-assign]
        lost: dict[str, Any] = {}
        read = -1  # rank 1's last step
        for _ in range(4):  # rounds, each handed over as the planning loop does
            planned = await _plan(actor, k)
            # (a work in a file is not held in memory too while the round is planned)
            assert [p.work is None for p in planned] == [in_files] * k
            submitted = asyncio.ensure_future(actor._submit(planned, k))
            del planned
            if not lost:
                lost = await old.next_round(0, -1, wait=30)  # never reaches rank 0
            got = await old.next_round(1, read, wait=5)
            if got is not None:
                read = got["steps"][-1]
            await asyncio.sleep(0.2)
            if not submitted.done():  # the constructor is full: rank 0 holds it back
                submitted.cancel()
                break
        assert lost["steps"] == list(range(k)) and read >= k
        # a file for each step kept (a step every rank had goes with its file)
        assert len(list(tmp_path.iterdir())) == (len(actor._recent) if in_files else 0)
        # the worker is lost: the old constructor with it, and the round it handed rank 0
        new = await constructor()
        await new.submit([(s, unpack_work(w)) for s, w in actor.unclaimed_steps(0)], 0,
                         force=True)
        again = await new.next_round(0, -1, wait=30)
        assert again["steps"][:k] == lost["steps"]
        for a, b in zip(lost["payloads"], again["payloads"], strict=False):
            assert (from_wire(a)["input_ids"] == from_wire(b)["input_ids"]).all()
        # and then the steps rank 1 read meanwhile, which rank 1 is not handed again
        assert (await new.next_round(0, k - 1, wait=30))["steps"] == list(range(k, read + 1))
        assert await new.next_round(1, read, wait=0.2) is None
        for con in (old, new):
            task = con._task
            await con.close()
            task.cancel()

        async def closed(notice: Any = None) -> None:
            pass

        actor.roles.close = closed  # type: ignore[method-assign]
        await actor.close_roles()  # (the files go with the service, not at a collection)
        assert not list(tmp_path.iterdir()) and not actor._recent

    asyncio.run(run())


def test_a_loader_lost_as_its_lengths_are_asked_for_fails_the_ask_not_the_planner(
        corpus: Any) -> None:
    """A lost actor's handle raises as soon as a method is looked up: asking a loader whose
    worker had just died for a unit's lengths raised in the planning loop itself, and the
    planner failed for good ("planner failed at step 0: Worker holding Actor was lost"),
    where a lost loader is re-created and asked again (found by crashing workers
    with a preprocess).  The ask fails instead, as a call to a lost worker does."""
    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    units, roots = discover_units(cfg)

    class Lost:
        key = "loader-lost"

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError("Worker holding Actor was lost.  Status: error")

    async def run() -> None:
        actor, lengths = _actor(cfg, units, roots)
        _with_roles(actor, lengths)
        del actor._request_meta  # (the actor's own)
        actor.roles.loader = lambda source, slot: Lost()  # type: ignore[method-assign]
        await actor._ensure("code", [(0, 0)])
        with pytest.raises(RuntimeError, match="Actor was lost"):
            await actor._meta_tasks[("code", 0, 0)]

    asyncio.run(run())
