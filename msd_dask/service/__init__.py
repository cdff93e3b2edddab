"""The service as its users hold it, and what stands behind that handle.

``handle`` (:class:`DataService`: start, connect, readers, live re-mixing,
stats, checkpoints, close), ``link`` (a process's link to the current planner,
which follows it to a successor), ``recovery`` (the starting process
re-creating a lost planner) and ``placement`` (placing the planner on the
cluster and cleaning up after a close).
"""

from msd_dask.service.handle import EMBEDDED_DASK_CONFIG, DataService

__all__ = ["DataService", "EMBEDDED_DASK_CONFIG"]
