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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the long child process of a collected test that can run while the tests before
    it do (see ``test_kernels.start_early``)."""
    for item in session.items:
        if item.name == "test_kernels_are_compiled_in_a_child_and_loaded_from_its_cache":
            item.module.start_early()  # type: ignore[attr-defined]
            return
