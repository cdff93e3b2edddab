"""The Dask keys of a service's roles: made here, and recognised here.

A role's key is ``msd-{service}-planner[-g{generation}]-{hex}``,
``msd-{service}-constructor-{index}-{hex}`` or
``msd-{service}-loader-{source}-{slot}-{hex}``, ``{hex}`` eight random hex
digits (a service started again under its name never finds the old roles' keys).
Service names are free text, so a prefix does not tell services apart: every key
of a service ``train-eval`` starts with ``msd-train-``.  :func:`role_pattern`
matches a loader's or constructor's whole key, given the service's sources, and
no key of another service.  In a key, a service's or source's ``-`` is written
``%2D`` (and ``%`` ``%25``): the fields between the dashes are then one split, where
the loaders of service ``train``'s source ``eval-constructor`` matched the
constructors of service ``train-loader-eval`` (a review).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable

__all__ = ["constructor_key", "is_role_of", "key_prefix", "loader_key", "lost_reading_key",
           "not_its_roles", "planner_key", "planner_pattern", "role_pattern"]


def _tail() -> str:
    return uuid.uuid4().hex[:8]


def lost_reading_key(service: str) -> list[str]:
    """The scheduler's metadata key under which the planner of ``service`` leaves the files
    its lost loaders were reading (:meth:`RoleSupervisor.heal
    <msd_dask.roles.supervisor.RoleSupervisor.heal>`), for the owner to name if the
    service's workers keep dying (:class:`~msd_dask.service.recovery.PlannerKeeper`)."""
    return ["msd_dask", service, "lost_reading"]


def _field(name: str) -> str:
    """``name`` as a key writes it: with no ``-``, so that a key's fields split one way."""
    return name.replace("%", "%25").replace("-", "%2D")


def key_prefix(service: str) -> str:
    """What every key of a role of ``service`` starts with (keys of a service whose name
    starts with ``service`` may too: :func:`role_pattern` tells them apart)."""
    return f"msd-{_field(service)}-"


def planner_key(service: str, generation: int) -> str:
    """A new key for the planner of ``service`` (generation 0 unnumbered)."""
    return f"{key_prefix(service)}planner" + (f"-g{generation}" if generation else "") + \
        f"-{_tail()}"


def constructor_key(service: str, index: int) -> str:
    """A new key for constructor ``index`` of ``service``."""
    return f"{key_prefix(service)}constructor-{index}-{_tail()}"


def loader_key(service: str, source: str, slot: int) -> str:
    """A new key for the loader in ``slot`` of ``source`` of ``service``."""
    return f"{key_prefix(service)}loader-{_field(source)}-{slot}-{_tail()}"


def role_pattern(service: str, sources: Iterable[str]) -> str:
    """A regular expression (for :func:`is_role_of`) that matches the whole key of every
    loader and constructor of ``service``, whose sources are ``sources``, and no other
    key: not its planner's, and none of another service (whose name may start with
    ``service``)."""
    names = "|".join(re.escape(_field(s)) for s in sorted(set(sources), key=len, reverse=True))
    loader = f"|loader-(?:{names})-[0-9]+" if names else ""
    return f"{re.escape(key_prefix(service))}(?:constructor-[0-9]+{loader})-[0-9a-f]{{8}}"


def planner_pattern(service: str) -> str:
    """A regular expression (for :func:`is_role_of`) that matches the whole key of every
    planner of ``service`` (each generation's, :func:`planner_key`) and no other key."""
    return f"{re.escape(key_prefix(service))}planner(?:-g[0-9]+)?-[0-9a-f]{{8}}"


def is_role_of(key: object, pattern: str) -> bool:
    """Whether ``key`` is the key of a role :func:`role_pattern` made ``pattern`` for."""
    return re.fullmatch(pattern, str(key)) is not None


def not_its_roles(keys: Iterable[object], service: str, sources: Iterable[str]) -> list[str]:
    """The keys of ``keys`` that are no role of ``service`` (whose sources are ``sources``):
    neither a loader's or constructor's (:func:`role_pattern`) nor a planner's
    (:func:`planner_pattern`), e.g. another service's actors on a worker."""
    ours = (role_pattern(service, sources), planner_pattern(service))
    return [str(k) for k in keys if not any(is_role_of(k, p) for p in ours)]
