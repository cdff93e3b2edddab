"""A DataConstructor's bookkeeping of held and claimed batches, in one process, without Dask:
what it answers for a fully claimed ``(step, dp)`` and that the work per claimed batch does
not grow with the DP ranks it serves (a constructor can serve hundreds of DP ranks)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import numpy as np
import pytest

from msd_dask.core.packing import from_wire, join_pieces
from msd_dask.roles.constructor import DataConstructor

from checks import step_pieces


class CountingStep(int):
    """A step number that counts the order comparisons made with it (as either operand)."""

    compared = 0

    def _count(self) -> None:
        CountingStep.compared += 1

    def __lt__(self, other: object) -> bool:
        self._count()
        return int(self) < other  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        self._count()
        return int(self) <= other  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        self._count()
        return int(self) > other  # type: ignore[operator]

    def __ge__(self, other: object) -> bool:
        self._count()
        return int(self) >= other  # type: ignore[operator]


def _bare(members: dict[int, list[int]], timeout: float = 30.0) -> DataConstructor:
    """A constructor whose conditions exist (as :meth:`DataConstructor.setup` makes them)."""
    con = DataConstructor("unit", 0, members, 8, 0, prefetch=4, timeout=timeout)
    con._room = asyncio.Condition()
    con._built = asyncio.Condition()
    return con


def test_a_claimed_batch_is_gone_as_long_as_a_rebuilt_window_set_keeps_it() -> None:
    """Fully claimed pairs, some out of order, some old ones again: the constructor answers
    "gone" exactly as a set that, past 4,096 pairs, keeps the pairs of the 63 steps
    before the one just claimed and every later one."""
    rng = random.Random(7)

    async def replay(dp_ranks: int, steps: int) -> None:
        con = _bare({d: [d] for d in range(dp_ranks)})
        model: set[tuple[int, int]] = set()
        for step in range(steps):
            done = [(step, d) for d in range(dp_ranks)]
            # a few late claims of recent steps and re-sent steps far older than the window
            done += [(max(0, step - rng.randrange(1, 200)), rng.randrange(dp_ranks))
                     for _ in range(rng.randrange(3))]
            rng.shuffle(done)
            for s, d in done:
                await con._done(s, d)
                model.add((s, d))
                if len(model) > 4096:
                    model = {k for k in model if k[0] > s - 64}
                assert len(con._gone) == len(model)
            probes = [(s, d) for s in range(max(0, step - 300), step + 2)
                      for d in range(dp_ranks)]
            assert {p for p in probes if p in con._gone} == {p for p in probes if p in model}

    asyncio.run(replay(3, 1600))
    asyncio.run(replay(70, 90))


@pytest.mark.parametrize("dp_ranks", [64, 256, 1024])
def test_forgetting_old_claims_costs_the_same_per_batch_whatever_the_dp_ranks(dp_ranks: int) -> None:
    """80 steps (past the 64-step window) of ``dp_ranks`` batches each, all claimed: the
    step comparisons made to forget old pairs stay a few per claimed batch, and only
    the window's pairs are kept."""

    async def replay() -> None:
        con = _bare({d: [d] for d in range(dp_ranks)})
        CountingStep.compared = 0
        pairs = 0
        for step in range(80):
            s = CountingStep(step)
            for d in range(dp_ranks):
                await con._done(s, d)
                pairs += 1
                # a rebuilt set compares every pair it keeps: up to 64 × dp_ranks per batch
                assert CountingStep.compared <= 4 * pairs + 64, (step, d)
            assert len(con._gone) <= max(4096, 65 * dp_ranks)
        assert (79, dp_ranks - 1) in con._gone

    asyncio.run(replay())


class ToyLoader:
    """Answers every piece with ``end - start + 1`` copies of its row."""

    key = "toy"

    async def fetch(self, requests: np.ndarray) -> Any:
        return join_pieces([np.full(int(e) - int(s) + 1, int(r), dtype=np.uint16)
                            for _ep, _u, r, s, e in requests])


class ToyQueue:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    async def put(self, item: dict[str, Any]) -> None:
        self.items.append(item)


def test_claims_skips_and_mark_had_release_only_their_groups_batches() -> None:
    """Two DP groups of two ranks: a claim finds its rank's group, ``mark_had`` releases
    only the rank's group's batches up to its step, a fully claimed step frees its room
    and a claim of it again fails at once (it is gone, not awaited)."""

    async def run() -> None:
        members = {0: [0, 1], 1: [2, 3]}
        con = _bare(members, timeout=60.0)
        con.loaders = {"toy": {0: ToyLoader()}}
        queues = {r: ToyQueue() for rs in members.values() for r in rs}
        con._queues = dict(queues)
        con._work = asyncio.Queue()
        con._task = asyncio.create_task(con._builder())

        def work(step: int) -> tuple:
            return (step, step_pieces({d: [[("toy", 0, 0, 0, 10 * step + d, 0, 3, 0,
                                                f"f:{10 * step + d}")]] for d in members}),
                    {"rank_cost": [1.0, 1.0]})

        await con.submit([work(0), work(1), work(2)])
        got = [from_wire(b) for b in await con.claim([0, 1], 2)]
        assert [(b["step"], b["dp"]) for b in got] == [(0, 1), (1, 1)]
        assert got[1]["input_ids"][0, :3].tolist() == [11] * 3
        await con.skip(0, 3)  # step 0 of group 1 fully claimed
        await con.mark_had(1, 1)  # rank 1 has steps 0 and 1: group 0 waits on rank 0 only
        assert (await con.stats())["unclaimed"] == {
            "0/0": [0], "1/0": [0], "1/1": [3], "2/0": [0, 1], "2/1": [2, 3]}
        await con.claim([0], 0)
        stats = await con.stats()
        assert stats["held_steps"] == 2 and "0/0" not in stats["unclaimed"]
        with pytest.raises(KeyError, match="already claimed"):
            await asyncio.wait_for(con.claim([0], 1), 5.0)
        with pytest.raises(KeyError, match="not served"):
            await con.claim([2], 4)
        assert [t["steps"] for t in queues[1].items] == [[0, 1, 2]]
        await con.close()
        con._task.cancel()

    asyncio.run(run())
