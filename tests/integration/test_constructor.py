"""A DataConstructor actor on an in-process cluster: rounds, room and claims at the edges."""

from __future__ import annotations

import asyncio

import numpy as np
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
    return (step, step_pieces({dp: [row]} if dp is not None else {}))


async def _constructor(c, prefetch: int = 2, timeout: float = 2.0):
    loader = await c.submit(ToyLoader, actor=True)
    con = await c.submit(DataConstructor, "ct", 0, {0: [0]}, 8, 0, prefetch, timeout,
                         actor=True)
    await con.setup({"toy": {0: loader}})
    return con


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_round_is_handed_over_once_and_a_waiting_reader_gets_the_next_at_once(c, s, a):
    con = await _constructor(c, prefetch=4)
    await con.submit([_step(0), _step(1)])
    got = await con.next_round(0, -1)
    assert got["steps"] == [0, 1] and got["g"] == 0
    batches = [from_wire(p) for p in got["payloads"]]
    assert [b["step"] for b in batches] == [0, 1]
    assert batches[1]["input_ids"][0, :4].tolist() == [1, 1, 1, 1]
    assert (await con.stats())["returned"] == {0: -1}
    # nothing more posted: after its wait, the call answers None (no error, no traceback)
    t0 = asyncio.get_running_loop().time()
    assert await con.next_round(0, 1, wait=0.3) is None
    assert asyncio.get_running_loop().time() - t0 >= 0.3
    # a call waiting when the next round is built answers then, not at the end of its wait
    waiting = asyncio.ensure_future(con.next_round(0, 1, wait=30.0))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    t0 = asyncio.get_running_loop().time()
    await con.submit([_step(2)])
    got = await asyncio.wait_for(waiting, 10)
    assert got["steps"] == [2] and asyncio.get_running_loop().time() - t0 < 5
    assert (await con.stats())["returned"] == {0: 1}


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
