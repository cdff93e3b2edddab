"""msd_dask.dask_internals' actor calls: arguments msgpack carries travel as they are, the
others as Dask serialises them, and the callee gets the same values either way."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from distributed.protocol import Serialize
from distributed.utils_test import gen_cluster

from msd_dask.dask_internals import _actor_message, _plain, call_actor, call_remote_actor


class Target:
    async def echo(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"args": list(args), "kwargs": kwargs}

    async def fail(self) -> None:
        raise KeyError("no such rank")


class Caller:
    async def setup(self, target: Any) -> None:
        self.target = target

    async def echo(self, *args: Any, **kwargs: Any) -> Any:
        return await call_remote_actor(self.target, Target.echo, *args, **kwargs)

    async def fail(self) -> None:
        await call_remote_actor(self.target, Target.fail)


def test_only_what_msgpack_carries_as_it_is_is_sent_plain() -> None:
    for value in (1, 2.5, "a", b"\x00\x01", True, None, [1, 2], (0, 1, 0, 1), []):
        assert _plain(value), value
    for value in (np.int64(1), np.arange(3), [np.int64(1)], {"a": 1}, [[1]], {1, 2}):
        assert not _plain(value), value

    class Handle:
        key = "k"

    msg = _actor_message(Handle(), "next_round", (3, np.int64(4), (0, 1, 0, 1)),
                         {"ranks": [3], "view": np.arange(2)})
    assert msg["args"][0] == 3 and msg["args"][2] == (0, 1, 0, 1)
    assert isinstance(msg["args"][1], Serialize) and isinstance(msg["kwargs"]["view"], Serialize)
    assert msg["kwargs"]["ranks"] == [3] and (msg["function"], msg["actor"]) == ("next_round", "k")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1), ("127.0.0.1", 1)])
async def test_a_call_from_another_worker_gets_the_values_it_sends(c, s, a, b):
    target = await c.submit(Target, workers=[b.address], actor=True)
    caller = await c.submit(Caller, workers=[a.address], actor=True)
    await caller.setup(target)
    arr = np.arange(6, dtype=np.int64)
    got = await caller.echo(1, b"raw", [2, 3], arr, view=(0, 1), n=np.int32(7), f=0.5)
    assert got["args"][:2] == [1, b"raw"]
    assert list(got["args"][2]) == [2, 3]  # msgpack hands a list over as a tuple
    np.testing.assert_array_equal(got["args"][3], arr)
    assert tuple(got["kwargs"]["view"]) == (0, 1) and got["kwargs"]["f"] == 0.5
    assert got["kwargs"]["n"] == 7 and isinstance(got["kwargs"]["n"], np.int32)
    with pytest.raises(KeyError, match="no such rank"):
        await caller.fail()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_a_call_from_a_thread_gets_the_values_it_sends(c, s, a):
    target = await c.submit(Target, workers=[a.address], actor=True)

    def from_thread() -> Any:
        return call_actor(target, Target.echo, 5, (0, 1, 0, 1), report_after=1.0,
                          ranks=[5, 6]).result(timeout=10)

    got = await asyncio.get_running_loop().run_in_executor(None, from_thread)
    assert got["args"] == [5, (0, 1, 0, 1)]
    assert got["kwargs"]["report_after"] == 1.0 and list(got["kwargs"]["ranks"]) == [5, 6]


@gen_cluster(client=False, nthreads=[],
             config={"distributed.client.scheduler-info-interval": "20ms",
                     "distributed.client.heartbeat": "60s"})
async def test_a_client_whose_identity_refresh_stopped_makes_no_identity_calls(s):
    """Every Dask client asks the scheduler for its identity periodically (here every 20 ms);
    a service's client stops that (msd_dask.service.handle)."""
    from distributed import Client

    from msd_dask.dask_internals import stop_identity_refresh

    calls = []
    identity = s.handlers["identity"]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return identity(*args, **kwargs)

    s.handlers["identity"] = counted
    for stop in (False, True):
        async with Client(s.address, asynchronous=True) as c:
            if stop:
                stop_identity_refresh(c)
            await asyncio.sleep(0.1)  # (a call under way when it stopped is answered)
            calls.clear()
            await asyncio.sleep(0.5)
            made = len(calls)
        if stop:
            assert made == 0
        else:
            assert made >= 5  # ~25 in 0.5 s: the refresh a service's client does without
