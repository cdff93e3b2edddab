"""``tests/unit`` holds pure tests: none starts a Dask scheduler, worker, nanny, cluster or
client (those are ``tests/integration``'s).  A test that tries fails here, naming the folder
it belongs in.

Run beside the integration tests (``tests/conftest.py``), the process of the unit tests
lowers its CPU priority first, so that the integration tests' processes take the cores
whenever they want them."""

from __future__ import annotations

import os

import pytest

#: the nice value of the unit tests' process when it runs beside the integration tests
BESIDE_NICE = 10


def _beside_others() -> bool:
    """Whether this is one of pytest-xdist's worker processes (the suite's default)."""
    return "PYTEST_XDIST_WORKER" in os.environ


@pytest.fixture(autouse=True, scope="session")
def _lower_priority() -> None:
    if _beside_others() and os.nice(0) < BESIDE_NICE:
        os.nice(BESIDE_NICE - os.nice(0))


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
    it do (see ``test_kernels.start_early``).  Not in an xdist worker: each collects every
    test, and the one that runs the integration tests would start it for nothing (the test
    starts it itself)."""
    if _beside_others():
        return
    for item in session.items:
        if item.name == "test_kernels_are_compiled_in_a_child_and_loaded_from_its_cache":
            item.module.start_early()  # type: ignore[attr-defined]
            return
