"""``DataService.connect``'s look for a service, each of its scheduler calls bounded on this
side (with a stand-in client): against a scheduler that stopped answering, its connection
open, every rank's connect waited for ever (a review)."""

from __future__ import annotations

from typing import Any

import pytest

from msd_dask.errors import ServiceError, ServiceTimeoutError
from msd_dask.service.handle import DataService


class _Scheduler:
    def __init__(self, client: _Client):
        self.client = client

    async def event_wait(self, name: str, timeout: float) -> bool:
        return self.client.published

    async def event_set(self, name: str) -> None:  # pragma: no cover - not called here
        pass

    event_clear = event_set


class _Client:
    """Answers as a scheduler does, or (``frozen``) raises what a lapsed ``callback_timeout``
    raises; records the bound of every call."""

    def __init__(self, frozen: bool = False, published: bool = False):
        self.frozen, self.published = frozen, published
        self.bounds: list[tuple[str, float | None]] = []
        self.scheduler = _Scheduler(self)

    def _call(self, what: str, callback_timeout: float | None) -> None:
        self.bounds.append((what, callback_timeout))
        if self.frozen:
            raise TimeoutError(f"timed out after {callback_timeout} s.")

    def get_dataset(self, key: str, default: Any = None,
                    callback_timeout: float | None = None) -> Any:
        self._call("get_dataset", callback_timeout)
        return default

    def list_datasets(self, callback_timeout: float | None = None) -> list[str]:
        self._call("list_datasets", callback_timeout)
        return ["msd-other"]

    def sync(self, rpc: Any, *, callback_timeout: float | None = None, **kwargs: Any) -> Any:
        import asyncio

        self._call(rpc.__name__, callback_timeout)
        return asyncio.run(rpc(**kwargs))


def test_a_scheduler_that_does_not_answer_is_named_within_the_bound() -> None:
    client = _Client(frozen=True)
    with pytest.raises(ServiceTimeoutError, match=r"the scheduler at tcp://s:1 did not answer "
                                                  r"within 3s while service 'svc' was looked "
                                                  r"for"):
        DataService._published_registry(client, "tcp://s:1", "svc", 60.0, 3.0)
    assert client.bounds == [("get_dataset", 3.0)]


def test_every_call_of_the_look_is_bounded() -> None:
    client = _Client()
    with pytest.raises(ServiceError, match=r"no service named 'svc' on tcp://s:1 after 0s "
                                           r"\(running: \['other'\]\)"):
        DataService._published_registry(client, "tcp://s:1", "svc", 0.2, 3.0)
    what = [w for w, _ in client.bounds]
    assert what[0] == "get_dataset" and "event_wait" in what and what[-1] == "list_datasets"
    assert all(bound is not None and bound <= 3.2 + 1e-9 for _, bound in client.bounds)


def test_asking_whether_a_client_is_connected_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    # a frozen scheduler held a constructor's claim handler for ever (a review): after
    # ASK_WAIT, the client is taken to be there
    import asyncio
    import types

    import distributed

    from msd_dask import dask_internals

    async def never(**_: Any) -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    worker = types.SimpleNamespace(scheduler=types.SimpleNamespace(run_function=never))
    monkeypatch.setattr(distributed, "get_worker", lambda: worker)
    monkeypatch.setattr(dask_internals, "ASK_WAIT", 0.05)
    assert asyncio.run(asyncio.wait_for(dask_internals.client_connected("c-1"), 5)) is True
