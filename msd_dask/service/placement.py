"""Where a service's roles go on the cluster, and what a closed service leaves behind.

:func:`place_planner` starts a service's planner on a worker (it creates the
loaders and constructors itself) and returns the *registry* the service
publishes under ``msd-<name>``; :func:`forget_keys` removes what a closed
service leaves: its roles' keys.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping
from typing import Any

from msd_dask.core.config import Config
from msd_dask.dask_internals import actor_counts, event_set, event_wait, scheduler_workers
from msd_dask.errors import ServiceError

__all__ = ["REGISTRY_PREFIX", "ROLES_PREFIX", "constructor_members", "forget_keys", "place_planner",
           "published_event", "source_payload"]

#: a service's registry is published under this prefix and its name
REGISTRY_PREFIX = "msd-"
#: dataset holding the keys of a service's roles (see :meth:`PlannerKeeper.pin`)
ROLES_PREFIX = "msd_roles/"
#: a scheduler ``Event`` set while a service's registry is published (see
#: :func:`published_event`)
PUBLISHED_PREFIX = "msd-published/"
_log = logging.getLogger("msd_dask.service")


class PublishedEvent:
    """The scheduler ``Event`` of service ``name``: set once its registry is published, cleared
    when it closes.  ``DataService.connect`` waits on it, one call the scheduler holds,
    instead of polling the published datasets: thousands of ranks may start before the
    service.  Each call's answer is waited for a bounded time here too
    (:func:`~msd_dask.dask_internals.event_wait`): a ``TimeoutError`` where the scheduler
    does not answer."""

    def __init__(self, client: Any, name: str):
        self.client, self.name = client, PUBLISHED_PREFIX + name

    def wait(self, timeout: float, answer: float) -> bool:
        """Whether it is set within ``timeout`` seconds, the answer awaited ``answer`` more."""
        return event_wait(self.client, self.name, timeout, answer)

    def set(self, timeout: float) -> None:
        event_set(self.client, self.name, timeout, on=True)

    def clear(self, timeout: float) -> None:
        event_set(self.client, self.name, timeout, on=False)


def published_event(client: Any, name: str) -> PublishedEvent:
    """Service ``name``'s :class:`PublishedEvent` on ``client``'s scheduler."""
    return PublishedEvent(client, name)


def source_payload(cfg: Config, name: str) -> dict[str, Any]:
    """Source ``name``'s config as its loaders get it (without its weight)."""
    d = next(s for s in cfg.to_dict()["sources"] if s["name"] == name)
    d.pop("weight")
    return d


def constructor_members(cfg: Config, n_constructors: int) -> list[dict[int, list[int]]]:
    """``{dp: ranks of that DP group}`` of each of ``n_constructors`` constructors: DP
    index ``dp`` goes to constructor :func:`~msd_dask.roles.constructor.constructor_of`
    (the planner splits a step's rows the same way, and readers ask that one).  One
    pass over the world (:meth:`ParallelConfig.dp_groups`)."""
    from msd_dask.roles.constructor import constructor_of

    members: list[dict[int, list[int]]] = [{} for _ in range(n_constructors)]
    for dp, ranks in enumerate(cfg.parallel.dp_groups()):
        members[constructor_of(dp, n_constructors)][dp] = ranks
    return members


def place_planner(client: Any, cfg: Config,
                  units: dict[str, list[tuple[str, int, int]]], roots: dict[str, str],
                  resume: Mapping[str, Any] | bytes | None,
                  loader_threads: int, *,
                  constructors: int | None = None,
                  generation: int = 0, had: dict[int, int] | None = None,
                  lost: dict[str, Any] | None = None,
                  avoid: Collection[str] = ()) -> dict[str, Any]:
    """Start the planner; it creates the loaders and constructors itself.

    It goes on the running worker holding the fewest actors (any service's; ties to the
    lowest address), as a role does (:func:`~msd_dask.roles.supervisor.pick_workers`), and
    not on a worker of ``avoid`` (one a re-created planner did not start on) while another
    runs: the lowest address took every planner, of every service and generation, and a
    retry went back to the worker it had not started on (a review).

    ``constructors`` (how many; :func:`constructor_members` gives each its DP
    ranks) is kept across generations, so a constructor index means the same DP
    ranks in every generation.  The registry, which every process that
    connects reads, holds that count, not the members: they grow with the world.

    Returns
    -------
    dict
        The registry: ``{"config", "planner" (its future), "constructors", "generation"}``.
    """
    from msd_dask.roles.supervisor import pick_workers
    from msd_dask.sources.tokenizer import make_tokenizer

    # not client.scheduler_info(): the client's periodic identity call (totals only, no
    # workers) can overwrite its answer before it returns, and a planner re-created
    # after a loss would find "no worker"
    workers = sorted(scheduler_workers(client, cfg.timeout, running=True))
    if not workers:
        raise ServiceError(f"no running worker to place the planner of service {cfg.name!r} "
                           "on (every worker is paused or being retired)")
    choices = [w for w in workers if w not in avoid] or workers
    worker = pick_workers(choices, actor_counts(client, choices, cfg.timeout), 1)[0]
    n_c = constructors or cfg.constructors or min(cfg.parallel.dp, len(workers))
    members = constructor_members(cfg, n_c)
    from msd_dask.roles.keys import planner_key
    from msd_dask.roles.planner import PlannerActor  # the starting process only (see planner.py)

    # unique: a service started again under this name right after a close must not
    # find the old planner's key still held (by the plugin's cached registry) and
    # attach to that planner
    key = planner_key(cfg.name, generation)
    tokenizer = make_tokenizer(cfg.tokenizer)
    planner = client.submit(
        PlannerActor, cfg.to_dict(), units, roots,
        resume if isinstance(resume, bytes) else dict(resume) if resume else None,
        members=members, pad_id=tokenizer.pad_id,
        loader_threads=loader_threads,
        source_payloads={s.name: source_payload(cfg, s.name) for s in cfg.sources},
        tokenizer=dataclasses.asdict(cfg.tokenizer), generation=generation, had=had,
        lost=lost, tokenizer_sha256=tokenizer.sha256, eod_id=tokenizer.eod_id, actor=True,
        workers=[worker], pure=False, key=key)
    return {"config": cfg.to_dict(), "planner": planner, "constructors": n_c,
            "generation": generation, "planner_worker": worker}


def forget_keys(client: Any, name: str, keys: list[Any]) -> None:
    """Make Dask forget the closed roles' keys, whoever still holds a reference.

    Every client that unpickled a handle (the planner's worker, constructors,
    the plugin's cached registry) holds a reference to a role's key, and one
    kept past close kept the actor on its worker and the key on the scheduler
    for as long as the cluster ran.  Cancelling with ``force`` releases the
    keys for every client.
    """
    from distributed import Future

    if not keys:
        return
    futures: list[Any] = [Future(k, client) for k in dict.fromkeys(keys)]
    try:
        client.cancel(futures, force=True, reason=f"msd_dask service {name!r} closed")
    except Exception as e:  # noqa: BLE001 - best effort: the cluster may be gone
        _log.warning("msd_dask %s: could not release the roles' keys: %r", name, e)
