"""msd_dask: an elastic multi-source data service for foundation-model training on Dask.

Roles (after MegaScale-Data): source loaders, one planner, data constructors
and per-rank readers.  The public surface is small; everything else lives in
modules that the package layout makes easy to find.

The public names are imported on first use (PEP 562 ``__getattr__``), so that
a process importing one module of the package (the scheduler unpickling
:mod:`msd_dask.plugin.scheduler`, a worker unpickling a role) does not import the whole
service, and no process imports ``torch`` before it builds a batch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from msd_dask.errors import ConfigError, DataError, ServiceError, ServiceTimeoutError

if TYPE_CHECKING:
    from msd_dask.batch import Batch
    from msd_dask.core.config import Config
    from msd_dask.reader import Reader
    from msd_dask.service import DataService
    from msd_dask.sources.check import load_config

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "Config",
    "ConfigError",
    "DataError",
    "DataService",
    "Reader",
    "ServiceError",
    "ServiceTimeoutError",
    "load_config",
]

#: public name -> the module defining it, imported on first access
_LAZY = {
    "Batch": ".batch",
    "Config": ".core.config",
    "load_config": ".sources.check",
    "DataService": ".service",
    "Reader": ".reader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
