"""msd_dask: an elastic multi-source data service for foundation-model training on Dask.

Roles (after MegaScale-Data): source loaders, one planner, data constructors
and per-rank readers.  The public surface is small; everything else lives in
modules that the package layout makes easy to find.
"""

from .batch import Batch
from .config import Config, load_config
from .errors import ConfigError, DataError, ServiceError, ServiceTimeoutError
from .service import DataService, Reader

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
