"""Stand-ins for what a :class:`~msd_dask.roles.planner.PlannerActor`'s planning loop drives
(its ``roles``), so that unit tests run the real loop without Dask."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from msd_dask.sources.documents import read_unit
from msd_dask.sources.storage import open_source
from msd_dask.sources.tokenizer import ByteTokenizer


def unit_lengths(cfg: Any, units: dict[str, list[Any]]) -> dict[tuple[str, int], np.ndarray]:
    """Each unit's document lengths, read from the corpus: ``(source, unit) -> lengths``."""
    out = {}
    for s in cfg.sources:
        fs = open_source(s.uri, s.storage_options).fs
        for i, u in enumerate(units[s.name]):
            out[(s.name, i)] = np.array([len(d) for d in read_unit(s, fs, u, ByteTokenizer())])
    return out


class FakeRoles:
    """One loader slot per source, whose loaders report ``lengths`` at once (``[1]`` for a
    unit without), constructors that take every round (``submitted``: each round's steps)
    and readers told of a failure (``told``)."""

    constructors = [object()]
    loader_threads = 1

    def __init__(self, cfg: Any, lengths: dict[tuple[str, int], np.ndarray] | None = None):
        self.active = {s.name: [0] for s in cfg.sources}
        self.lengths = lengths or {}
        self.submitted: list[list[int]] = []
        self.told: list[str] = []

    def loader(self, source: str, slot: int) -> Any:
        lengths = self.lengths

        class Loader:
            async def metadata(self, epoch: int, unit: int) -> np.ndarray:
                return lengths.get((source, unit), np.array([1]))

        return Loader()

    async def assign_units(self, *args: Any) -> None:
        pass

    async def release_units(self, *args: Any) -> None:
        pass

    async def wait_room(self, k: int) -> None:
        pass

    async def heal(self, wait: bool = False) -> bool:
        return False

    async def healed_after(self, exc: BaseException) -> bool:
        return False

    async def apply_scaling(self) -> None:
        pass

    async def scale_asked(self) -> None:
        await asyncio.Event().wait()  # (no scale change is asked for)

    def next_slot(self, source: str, owner: Any = None) -> int:
        return 0

    def forget_retired(self, safe: Any) -> int:
        return 0

    async def submit(self, steps: list[Any], room: int) -> None:
        self.submitted.append([s for s, *_ in steps])

    async def notify(self, message: str) -> None:
        self.told.append(message)
