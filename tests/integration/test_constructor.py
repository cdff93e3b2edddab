"""A DataConstructor actor on an in-process cluster: rounds, room and claims at the edges."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from distributed.utils_test import gen_cluster

from msd_dask.core.packing import from_wire, join_pieces
from msd_dask.roles.constructor import DataConstructor

from checks import step_pieces


class ToyLoader:
    """A loader that answers every piece with ``end - start + 1`` copies of its row."""

    async def fetch(self, requests):
        return join_pieces([np.full(int(e) - int(s) + 1, int(r), dtype=np.uint16)
                            for _ep, _u, r, s, e in requests])


def _step(step: int, dp: int = 0, n: int = 4) -> tuple:
    row = [("toy", 0, 0, 0, step, 0, n, 0, f"f:{step}")]
    return (step, step_pieces({dp: [row]} if dp is not None else {}), {"rank_cost": [1.0]})


async def _constructor(c, prefetch: int = 2, timeout: float = 2.0):
    loader = await c.submit(ToyLoader, actor=True)
    con = await c.submit(DataConstructor, "ct", 0, {0: [0]}, 8, 0, prefetch, timeout,
                         actor=True)
    await con.setup({"toy": {0: loader}})
    return con


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_claim_takes_all_its_steps_or_none(c, s, a):
    con = await _constructor(c)
    await con.submit([_step(0), _step(1)])
    with pytest.raises(KeyError, match=r"\[5\]"):
        await con.claim([0, 5], 0)  # step 5 is never published
    # step 0 was not taken by the failed claim
    got = [from_wire(p) for p in await con.claim([0, 1], 0)]
    assert [p["step"] for p in got] == [0, 1]
    assert got[1]["input_ids"][0, :4].tolist() == [1, 1, 1, 1]
    assert (await con.stats())["returned"] == {0: -1}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_close_releases_a_planner_waiting_for_room(c, s, a):
    con = await _constructor(c, prefetch=2)
    # accepted, then waits for room for one more step, which no reader frees
    waiting = asyncio.ensure_future(con.submit([_step(0), _step(1)], 1))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    await con.close()
    await asyncio.wait_for(waiting, 5)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_steps_without_work_for_this_constructor_hold_no_room(c, s, a):
    con = await _constructor(c, prefetch=2)
    # more constructors than DP ranks: this one has nothing in these steps
    for i in range(0, 8, 2):  # rounds of 2 as the planner sends them, each waiting for room
        await asyncio.wait_for(con.submit([_step(i, dp=None), _step(i + 1, dp=None)], 2), 5)
    assert (await con.stats())["held_steps"] == 0
