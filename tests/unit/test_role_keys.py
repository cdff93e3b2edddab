"""A service's roles are told apart from another's by their whole keys, not a prefix:
the service ``train`` re-creating its lost planner closed the roles of ``train-eval``
on the same scheduler, and retiring ``train``'s workers waited for ``train-eval``'s
keys (a review of the recovery path)."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace
from typing import Any

import pytest

from msd_dask.dask_internals import keys_on
from msd_dask.roles.constructor import DataConstructor
from msd_dask.roles.keys import (
    constructor_key,
    is_role_of,
    loader_key,
    planner_key,
    role_pattern,
)
from msd_dask.roles.loader import SourceLoader

#: services sharing one scheduler whose names start alike, and with regular
#: expressions' characters; each with its sources
SERVICES = {
    "train": ["web", "code"],
    "train-eval": ["web"],
    "train-loader-web": ["x"],
    "train-constructor-1": ["web"],
    "a.b": ["s+t"],
    "a-b": ["s"],
    "": ["web"],
    # names whose dashes made the fields split two ways (a review): train's source
    # eval-constructor against train-loader-eval's constructors, and a-loader-b against
    # train-loader-a's source b
    "train2": ["eval-constructor", "a-loader-b", "50%-off"],
    "train2-loader-eval": ["web"],
    "train2-loader-a": ["b"],
}


def _keys(service: str, sources: list[str]) -> dict[str, str]:
    keys = {"planner": planner_key(service, 0), "planner g3": planner_key(service, 3)}
    for i in (0, 1, 12):
        keys[f"constructor {i}"] = constructor_key(service, i)
    for s in sources:
        for slot in (0, 7):
            keys[f"loader {s} {slot}"] = loader_key(service, s, slot)
    return keys


@pytest.mark.parametrize("service", list(SERVICES))
def test_a_pattern_matches_its_own_roles_and_no_other_services(service: str) -> None:
    pattern = role_pattern(service, SERVICES[service])
    for other, sources in SERVICES.items():
        for what, key in _keys(other, sources).items():
            mine = other == service and not what.startswith("planner")
            assert is_role_of(key, pattern) == mine, (service, other, what, key)


def test_keys_are_new_each_time_and_end_in_eight_hex_digits() -> None:
    a, b = constructor_key("s", 0), constructor_key("s", 0)
    assert a != b
    assert re.fullmatch(r"msd-s-constructor-0-[0-9a-f]{8}", a)
    assert re.fullmatch(r"msd-s-loader-web-3-[0-9a-f]{8}", loader_key("s", "web", 3))
    assert re.fullmatch(r"msd-s-planner-g2-[0-9a-f]{8}", planner_key("s", 2))


class _Worker:  # what close_service_roles looks at on a worker
    def __init__(self, actors: dict[str, Any]):
        self.state = SimpleNamespace(actors=actors)


class _Loader(SourceLoader):
    """A loader that holds nothing (close_service_roles calls its ``close`` alone)."""

    def __init__(self) -> None:
        self.closed = False

    async def close(self) -> None:
        self.closed = True


def test_closing_a_services_roles_leaves_another_services_alone() -> None:
    from msd_dask.roles.supervisor import close_service_roles

    async def run() -> None:
        members = {0: [0]}
        mine = DataConstructor("train", 0, members, 8, 0, prefetch=4)
        other = DataConstructor("train-eval", 0, members, 8, 0, prefetch=4)
        my_loader, other_loader = _Loader(), _Loader()
        worker = _Worker({constructor_key("train", 0): mine,
                          constructor_key("train-eval", 0): other,
                          loader_key("train", "web", 0): my_loader,
                          loader_key("train-eval", "web", 0): other_loader})
        out = await close_service_roles("train", ["web"], dask_worker=worker)
        assert out["closed"] == 2
        assert mine._closed and my_loader.closed
        assert not other._closed and not other_loader.closed
        await other.close()

    asyncio.run(run())


def test_retiring_waits_for_its_own_keys_alone() -> None:
    held = [constructor_key("train", 0), loader_key("train-eval", "web", 0),
            constructor_key("train-eval", 1), planner_key("train", 0)]
    running = [loader_key("train", "web", 2), "unrelated-task-1"]
    scheduler = SimpleNamespace(workers={"tcp://w:1": SimpleNamespace(
        has_what=[SimpleNamespace(key=k) for k in held],
        processing=[SimpleNamespace(key=k) for k in running])})
    got = keys_on(scheduler, ["tcp://w:1", "tcp://gone:2"], pattern=role_pattern("train", ["web"]))
    assert got == [held[0], running[0]]
