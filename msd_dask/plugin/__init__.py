"""The scheduler plugin: the dashboard page, Prometheus metrics and the adaptive loader policy.

Install it at scheduler start with ``dask scheduler --preload msd_dask.plugin``
(:func:`dask_setup`), or let :meth:`msd_dask.DataService.start` register it.
"""

from msd_dask.plugin.scheduler import MsdSchedulerPlugin, dask_setup

__all__ = ["MsdSchedulerPlugin", "dask_setup"]
