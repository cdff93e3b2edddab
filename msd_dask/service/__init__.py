"""The service as its users hold it, and what stands behind that handle.

``handle`` (:class:`DataService`: start, connect, readers, live re-mixing,
stats, checkpoints, close), ``link`` (a process's link to the current planner,
which follows it to a successor), ``recovery`` (the starting process
re-creating a lost planner), ``placement`` (placing the planner on the
cluster and cleaning up after a close), ``agent`` (the host agent: one Dask
client per host) and ``agent_client`` (a rank process's side of the agent).

The public names are imported on first use (PEP 562 ``__getattr__``): a rank
process behind a host agent imports :mod:`~msd_dask.service.agent_client` and
nothing of the handle (docs/benchmarks.md, Memory).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from msd_dask.service.handle import EMBEDDED_DASK_CONFIG, DataService

__all__ = ["DataService", "EMBEDDED_DASK_CONFIG"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("msd_dask.service.handle"), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
