"""The service's roles as Dask actors, and their supervision.

``loader`` (Source Loader: one source's share of units), ``planner`` (the one
decision point, driving :mod:`msd_dask.core.plan`), ``constructor`` (Data
Constructor: fetch, pack and keep each DP group's batch), ``supervisor``
(placing the roles on workers and re-creating them when a worker goes) and
``direct`` (calls between roles on one worker without its loopback connection) and
``keys`` (the roles' Dask keys, made and told apart per service).
"""
