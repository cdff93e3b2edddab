"""Which states of its recent steps the planner's actor keeps for ``state_dict(step)``: the
last ``kept_states`` steps planned, and every step after the last one every rank returned,
up to ``KEPT_AT_MOST`` times as many.  Behind a host agent with ``--prefetch 40`` the
planner plans about 44 steps past what the ranks returned, and the state of the step they
were at was gone (a review)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_planner_recreated import _actor, _plan

from msd_dask import load_config
from msd_dask.batch import MAX_PREFETCH
from msd_dask.roles.planner import KEPT_AT_MOST, kept_states
from msd_dask.sources.discover import discover_units

from corpus import config


def _service(corpus: Any) -> tuple[Any, Any, Any]:
    """The corpus's config at ``prefetch`` 4 (26 states kept), its units and their roots."""
    root, _ = corpus
    cfg = load_config(config(root, prefetch=4))
    return (cfg, *discover_units(cfg))


def _returned(actor: Any, step: int) -> None:
    """Every constructor answers that every rank returned ``step``."""
    world = actor.cfg.parallel.world_size

    async def stats(max_age: float = 0.0) -> list[dict[str, Any]]:
        return [{"shown": {r: step for r in range(world)},
                 "returned": {r: step for r in range(world)}}]

    actor.roles.constructor_stats = stats  # type: ignore[method-assign]


def test_the_states_after_what_every_rank_returned_are_kept(corpus: Any) -> None:
    cfg, units, roots = _service(corpus)
    keep = kept_states(cfg)
    assert keep == 4 + 2 * 3 + MAX_PREFETCH == 26

    async def run() -> None:
        actor, _ = _actor(cfg, units, roots)
        await _plan(actor, 21)
        _returned(actor, 20)  # the ranks stopped after step 20 (a checkpoint) ...
        assert (await actor.checkpoint())["step"] == 20
        await _plan(actor, 60)  # ... and their agent read 60 steps ahead of them
        assert (await actor.state_at(20))["step"] == 20  # (it was gone after 26 steps)
        # (and the 16 steps before it: a dataset's loop may be that far behind its reader)
        assert list(actor._snapshots) == list(range(20 - MAX_PREFETCH, 81))
        with pytest.raises(ValueError, match="state of step 3 is no longer held"):
            await actor.state_at(3)
        # the ranks go on: what they returned is let go, down to the last 26 steps
        _returned(actor, 75)
        await actor.checkpoint()
        await _plan(actor, 1)
        assert list(actor._snapshots) == list(range(81 - keep + 1, 82))
        with pytest.raises(ValueError, match=r"state of step 2 is no longer held .* from 16 "
                                             r"before the last every rank returned, step 75, "
                                             r"up to 104: it holds steps 56\.\.81\)$"):
            await actor.state_at(2)

    asyncio.run(run())


def test_a_dataset_s_loop_behind_what_its_agent_took_finds_its_state(corpus: Any) -> None:
    """Behind an agent the service learns what a rank's reader took; a dataset prefetching
    ``MAX_PREFETCH`` steps has its loop that far behind, and the agent reads far ahead:
    the loop's step was gone (a review).  The states from ``MAX_PREFETCH`` before what
    every rank returned are kept."""
    cfg, units, roots = _service(corpus)

    async def run() -> None:
        actor, _ = _actor(cfg, units, roots)
        await _plan(actor, 30)
        _returned(actor, 25)  # the readers took step 25, their loops are at step 9
        await actor.checkpoint()
        await _plan(actor, 60)  # the agent reads on
        assert (await actor.state_at(25 - MAX_PREFETCH))["step"] == 9
        assert next(iter(actor._snapshots)) == 9

    asyncio.run(run())


def test_a_re_created_planner_names_the_state_it_started_from(corpus: Any) -> None:
    """A planner re-created from the owner's checkpoint of step 25 holds the states from
    step 25 on: a prefetching dataset's loop at step 9 asked for a state it called "no
    longer held" (a review).  The refusal names the state the planner started from."""
    cfg, units, roots = _service(corpus)

    async def run() -> None:
        old, lengths = _actor(cfg, units, roots)
        await _plan(old, 30)
        with pytest.raises(ValueError, match=r"^state of step -5 is no longer held"):
            await old.state_at(-5)  # (a planner that started afresh: no state before it)
        new, _ = _actor(cfg, units, roots, old._packed_at(25), lengths, generation=1)
        await _plan(new, 3)
        assert (await new.state_at(25))["step"] == 25
        with pytest.raises(ValueError, match=r"^state of step 9 is not held: this planner "
                                             r"started from the state of step 25 \(it was "
                                             r"re-created, or the service resumed from it\); "
                                             r"ask for step 25 or a later one$"):
            await new.state_at(9)
        # once step 25's state is gone too, that advice is wrong: the held steps are named
        await _plan(new, KEPT_AT_MOST * kept_states(cfg))
        with pytest.raises(ValueError, match=r"^state of step 9 is no longer held .* it holds "
                                             r"steps \d+\.\.\d+\)$"):
            await new.state_at(9)

    asyncio.run(run())


def test_the_states_kept_are_bounded_while_a_rank_returns_nothing(corpus: Any) -> None:
    """A rank that never returns a step (or a service whose owner never looks) holds the
    states back to its step only up to ``KEPT_AT_MOST`` times ``kept_states``."""
    cfg, units, roots = _service(corpus)
    most = KEPT_AT_MOST * kept_states(cfg)

    async def run() -> None:
        actor, _ = _actor(cfg, units, roots)
        await _plan(actor, most + 10)
        assert len(actor._snapshots) == most
        assert next(iter(actor._snapshots)) == 10

    asyncio.run(run())


@pytest.mark.parametrize("prefetch", [MAX_PREFETCH + 1, 40])
def test_a_dataset_prefetching_more_than_the_states_kept_is_refused(prefetch: int) -> None:
    """``MsdIterableDataset(prefetch=40)``: its reader returns 40 steps ahead of the loop,
    and ``svc.state_dict(ds.last_step)`` found the loop's step gone (a review)."""
    pytest.importorskip("torch")
    from msd_dask.torch import MsdIterableDataset

    with pytest.raises(ValueError, match=rf"prefetch must be a whole number from 0 to "
                                         rf"{MAX_PREFETCH}, got {prefetch}: the service keeps "
                                         r"the states of "):
        MsdIterableDataset("tcp://198.18.0.1:8786", "svc", 0, prefetch=prefetch)
    MsdIterableDataset("tcp://198.18.0.1:8786", "svc", 0, prefetch=MAX_PREFETCH).close()
