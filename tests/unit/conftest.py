"""``tests/unit`` holds pure tests: none starts a Dask scheduler, worker, nanny, cluster or
client (those are ``tests/integration``'s).  A test that tries fails here, naming the folder
it belongs in."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_dask(monkeypatch: pytest.MonkeyPatch) -> None:
    from distributed import Client, LocalCluster, Nanny, Scheduler, Worker

    def refuse(self: object, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"a test of tests/unit started a Dask {type(self).__name__}: "
                             "it belongs in tests/integration")

    for cls in (Client, LocalCluster, Nanny, Scheduler, Worker):
        monkeypatch.setattr(cls, "__init__", refuse)
