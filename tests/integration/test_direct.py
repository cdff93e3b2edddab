"""msd_dask.roles.direct: a role calls a role on its own worker as an object, others as a handle."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from distributed import get_worker
from distributed.actor import Actor
from distributed.utils_test import gen_cluster

from msd_dask.roles.direct import direct


class Target:
    def __init__(self) -> None:
        self.finished = 0

    async def echo(self, x):
        return {"x": x, "worker": get_worker().address}

    async def slow(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        self.finished += 1
        return self.finished

    async def count(self) -> int:
        return self.finished

    def plain(self) -> int:
        return 1


class Caller:
    async def setup(self, target) -> None:
        self.target = target

    async def kind(self) -> str:
        return "handle" if isinstance(direct(self.target), Actor) else "object"

    async def echo(self, x):
        return await direct(self.target).echo(x)

    async def cancel_a_slow_call(self) -> int:
        """Cancel the wait for a 0.2 s call after 0.05 s; how many calls finished by 0.5 s."""
        task = asyncio.ensure_future(direct(self.target).slow(0.2))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.45)
        return await direct(self.target).count()

    async def plain(self) -> None:
        direct(self.target).plain()


async def _pair(c, caller_on, target_on):
    target = await c.submit(Target, workers=[target_on], actor=True)
    caller = await c.submit(Caller, workers=[caller_on], actor=True)
    await caller.setup(target)
    return caller, target


X = {"a": [1, (2, "three")], "n": np.arange(5, dtype=np.int32)}


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_role_on_the_same_worker_is_called_as_an_object(c, s, a):
    caller, target = await _pair(c, a.address, a.address)
    assert await caller.kind() == "object"
    got, remote = await caller.echo(X), await target.echo(X)
    assert got["worker"] == remote["worker"] == a.address
    assert got["x"]["a"] == remote["x"]["a"] == X["a"]
    np.testing.assert_array_equal(got["x"]["n"], remote["x"]["n"])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_a_role_on_another_worker_is_called_through_its_handle(c, s, a, b):
    caller, target = await _pair(c, a.address, b.address)
    assert await caller.kind() == "handle"
    got = await caller.echo(X)
    assert got["worker"] == b.address and got["x"]["a"] == X["a"]


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_outside_a_worker_the_handle_is_returned(c, s, a):
    target = await c.submit(Target, actor=True)
    assert direct(target) is target


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_cancelling_the_wait_does_not_cancel_the_callee(c, s, a):
    # as on another worker: the caller stops waiting, the callee's work still completes
    caller, _ = await _pair(c, a.address, a.address)
    assert await caller.kind() == "object"  # the direct path, not the handle's
    assert await caller.cancel_a_slow_call() == 1


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_plain_method_is_refused_by_name(c, s, a):
    caller, _ = await _pair(c, a.address, a.address)
    with pytest.raises(TypeError, match=r"Target\.plain is not an async method"):
        await caller.plain()
