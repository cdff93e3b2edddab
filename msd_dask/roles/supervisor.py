"""Placement, scaling and recovery of a service's loaders and constructors.

Dask actors are not resilient: a lost worker loses its actors and nothing
restarts them, and ``Adaptive`` cannot retire a worker that holds one.  The
planner therefore creates the roles itself and keeps them alive:

* **slots** — a source's loaders live in numbered slots.  Units are assigned
  to a slot, and a planned piece names the slot, never the actor, so a slot's
  actor can be replaced (lost worker) or its units handed to another slot
  (scale-down, evacuation) without re-planning: the stream, and so every
  step's documents, does not depend on which loader reads a unit.
* **recovery** — :meth:`RoleSupervisor.heal` compares the roles' workers with the
  scheduler's live workers; a lost loader is re-created in its slot and
  re-reads the slot's live units; a lost constructor is re-created and the
  recent steps are sent to it again (it skips the steps a reader says it has).
* **scaling** — :meth:`RoleSupervisor.scale` adds slots (each on the worker holding
  the fewest roles) or retires them (the slot on such a worker first, so that a
  worker left with none can go); a retired slot's units move to a remaining slot,
  which re-reads them at once.
* **the planner itself** cannot heal itself: the process that started the
  service re-creates it (:class:`~msd_dask.service.DataService`), after
  closing the roles it leaves behind (:func:`close_service_roles`).

Loaders keep a unit until the planner releases it, after every step using it
was claimed by all ranks, so re-sending a step never finds its tokens gone.

The supervisor owns the roles; the planner owns the units (which slot reads
each) and the recent steps.  What the supervisor needs from the planner is
:class:`PlannerSide`: when a slot's actor is replaced or retired, the planner
moves the slot's units itself (:meth:`PlannerSide.hand_over`).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import pickle
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from msd_dask import dask_internals
from msd_dask.core.figures import LOADER_COUNTERS
from msd_dask.core.scaling import ScalingPolicy, pick_loader
from msd_dask.dask_internals import (
    STATS_WAIT,
    actor_address,
    call_remote_actor,
    release_actor,
    worker_actors,
)
from msd_dask.errors import (
    DataError,
    ServiceError,
    ServiceTimeoutError,
    WorkerLeft,
    first_of,
    unanswered,
)
from msd_dask.roles import constructor as constructor_role
from msd_dask.roles import loader as loader_role
from msd_dask.roles.constructor import DataConstructor, unpack_work
from msd_dask.roles.direct import direct
from msd_dask.roles.keys import (
    constructor_key,
    is_role_of,
    loader_key,
    lost_reading_key,
    not_its_roles,
    role_pattern,
)
from msd_dask.roles.loader import SourceLoader

if TYPE_CHECKING:
    from msd_dask.core.config import Config
    from msd_dask.core.units import Unit

__all__ = ["PlannerSide", "RoleSupervisor", "close_service_roles", "pick_retiring",
           "pick_workers"]

_log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: seconds :meth:`RoleSupervisor.close` waits for a change of the roles going on (a scale,
#: a heal) to end, so that the roles it made are closed with the others
CLOSE_WAIT = 10.0
#: seconds a failed creation waits for the handles of the roles it made, to close them
#: (best effort: their futures are released all the same)
ABANDON_WAIT = 5.0
#: seconds :meth:`RoleSupervisor.close` waits for each role to close (all at once)
ROLE_CLOSE_WAIT = 5.0
#: loaders gone from their slots whose counters :meth:`RoleSupervisor.loader_stats` keeps
#: at hand for an answer of theirs that comes late (a poll under way as they went)
MOVED_KEPT = 256

#: One planned step as the planner hands it over: ``(step, [each constructor's work, packed
#: as the planner keeps it])`` (:func:`~msd_dask.roles.constructor.pack_works`)
StepRound = tuple[int, list[bytes]]


async def _hand_round(constructor: Any, steps: list[tuple[int, bytes]], room: int,
                      force: bool = False) -> None:
    """The one way a round reaches a constructor (:meth:`DataConstructor.submit`).

    ``steps``: ``(step, work)``, the constructor's work of each step packed as the planner
    keeps it.  A constructor on another worker gets the packed bytes, pickled together
    (see its ``submit``); one on this worker (:func:`~msd_dask.roles.direct.direct`) the
    work unpacked, arrays of its own: a view of the step's whole work would keep that
    alive, up to 160 MiB at dp 16,384 x 128K, as long as the constructor holds the step.
    """
    from distributed.actor import Actor

    if isinstance(constructor, Actor):
        await call_remote_actor(constructor, DataConstructor.submit,
                                pickle.dumps(steps, protocol=5), room, force)
    else:
        await constructor.submit([(s, unpack_work(packed)) for s, packed in steps], room, force)


class PlannerSide(Protocol):
    """What a :class:`RoleSupervisor` needs from the planner that owns it.

    The planner (:class:`~msd_dask.roles.planner.PlannerActor`) keeps which loader
    slot reads each unit and the lengths it asked for; the supervisor tells it
    when a slot's units must move, and it moves them.
    """

    #: the service's config
    cfg: Config
    #: the planner's generation (see :class:`~msd_dask.roles.planner.PlannerActor`)
    generation: int
    #: ``{rank: step}``: steps ranks read from the planner this one replaces
    had: dict[int, int]
    #: ``{source: units}``, sorted (a loader gets them all; the planner assigns them)
    units: dict[str, list[Unit]]

    def next_step(self) -> int:
        """The step the planner plans next."""
        ...

    def is_planning(self) -> bool:
        """Whether the planning loop runs (scaling then waits for the next step)."""
        ...

    def unclaimed_steps(self, constructor: int) -> list[tuple[int, bytes]]:
        """The recent steps not every rank may have claimed yet, in order, with
        constructor ``constructor``'s work of each, packed as the planner keeps it
        (:func:`~msd_dask.roles.constructor.pack_work`): a re-created constructor gets
        them again."""
        ...

    async def hand_over(self, source: str, slots: list[int], heir: int) -> None:
        """Give the live units of loader ``slots`` of ``source`` to slot ``heir``, which
        re-reads them, and ask it for their lengths again."""
        ...

    async def spread_units(self, source: str) -> None:
        """Re-split the units of ``source`` assigned but not read yet over its active
        slots (after slots were added, so they help at once)."""
        ...

    def files_awaited(self, most: int = 8,
                      slots: set[tuple[str, int]] | None = None) -> list[str]:
        """The files whose lengths the planner asked loader ``slots`` for and has not had
        (``source: path``)."""
        ...


class RoleSupervisor:
    """The planner's loaders and constructors (see the module docstring)."""

    def __init__(self, planner: PlannerSide, members: list[dict[int, list[int]]],
                 pad_id: int, loader_threads: int, payloads: dict[str, dict[str, Any]],
                 tokenizer: dict[str, Any]):
        self.planner = planner
        self.cfg = planner.cfg
        self.members = members
        self.pad_id = pad_id
        self.loader_threads = loader_threads
        self.payloads = payloads
        self.tokenizer = tokenizer
        self.constructors: list[Any] = []
        self._cfuts: list[Any] = []
        #: source -> slot -> (actor handle, future keeping it alive)
        self._slots: dict[str, dict[int, tuple[Any, Any]]] = {}
        #: each loader's last stats() answer, by actor key (see loader_stats)
        self._last_stats: dict[str, dict[str, Any]] = {}
        #: source -> slot -> the counters (LOADER_COUNTERS) of the loaders gone from the
        #: slot, summed from their last answers (see loader_stats)
        self._gone: dict[str, dict[int, dict[str, float]]] = {}
        #: the loaders whose counters went into :attr:`_gone` lately: actor key -> (source,
        #: slot, the counters moved), for an answer of theirs that comes after (a poll
        #: under way as they were retired), at most :data:`MOVED_KEPT` of them
        self._moved: OrderedDict[str, tuple[str, int, dict[str, float]]] = OrderedDict()
        #: when the last round of constructor_stats asks started, and its answers
        self._cons_stats: tuple[float, asyncio.Future[list[dict[str, Any]]]] | None = None
        #: source -> retired slot -> slot that took its units over (steps planned before it
        #: retired may name it: see forget_retired)
        self._alias: dict[str, dict[int, int]] = {}
        #: source -> retired slot -> the first step planned after it retired
        self._retired: dict[str, dict[int, int]] = {}
        #: source -> slots that take new units, in round-robin order
        self.active: dict[str, list[int]] = {}
        self._rr: dict[str, itertools.count[int]] = {}
        self._seq: dict[str, itertools.count[int]] = {}
        self._targets: dict[str, int] = {}
        #: set by :meth:`scale`, cleared by :meth:`apply_scaling` (see :meth:`scale_asked`)
        self._scale_asked = asyncio.Event()
        #: the count apply_scaling is reaching, per source (taken out of _targets)
        self._applying: dict[str, int] = {}
        #: source -> why its last scale-up stopped short (a loader that could not be added)
        self.add_failed: dict[str, str] = {}
        #: loaders per source :meth:`setup` creates where not the config's count: a
        #: re-created planner's are the lost one's (:meth:`loader_counts`), so what
        #: ``scale_loaders`` or the adaptive policy chose outlives the planner
        self.loaders_at_setup: dict[str, int] = {}
        self._evacuating: set[str] = set()
        self._client: Any = None
        self._lock = asyncio.Lock()
        #: set by :meth:`close`: no role is made from then on (one being made is closed)
        self._closed = False
        #: constructors that did not take the loaders' last view (:meth:`_push_loaders`)
        self._untold: set[int] = set()
        self._last_check = 0.0
        self.recovered = Counter[str]()
        self.events: list[dict[str, Any]] = []

    # ------------------------------------------------------------- creation
    async def setup(self) -> None:
        """Create every constructor, then every source's loaders, spread across the workers.

        One look at the scheduler's workers places them all (:func:`pick_workers`, the
        same choices as placing them one at a time); every actor is submitted before
        any is awaited, so start-up costs no round trip per role.
        """
        from distributed import get_client

        self._client = get_client()
        roles: list[tuple[str, Callable[[str], Any]]] = [
            (f"constructor {i}", partial(self._submit_constructor, i))
            for i in range(len(self.members))]
        loader_slots: list[tuple[str, int]] = []
        for s in self.cfg.sources:
            self._slots[s.name] = {}
            self._alias[s.name] = {}
            self._retired[s.name] = {}
            self.active[s.name] = []
            self._rr[s.name] = itertools.count()
            self._seq[s.name] = itertools.count()
            units = self._loader_units(s.name)
            lo, hi = self.bounds(s.name)
            # (the config's count within the source's bounds, as a re-created planner takes
            # the lost one's: a count below min_loaders started as given, and rose to the
            # min on recovery, silently; a review)
            n = max(lo, min(hi, int(self.loaders_at_setup.get(s.name, s.loaders))))
            for _ in range(n):
                slot = next(self._seq[s.name])
                loader_slots.append((s.name, slot))
                roles.append((f"loader {s.name}#{slot}",
                              partial(self._submit_loader, s.name, slot, units=units)))
        where = await self._place(len(roles))
        made = await self._created([(name, w, submit(w))
                                    for (name, submit), w in zip(roles, where, strict=True)])
        n_c = len(self.members)
        for handle, fut in made[:n_c]:
            self.constructors.append(handle)
            self._cfuts.append(fut)
        for (source, slot), pair in zip(loader_slots, made[n_c:], strict=True):
            self._slots[source][slot] = pair
            self.active[source].append(slot)
        set_up = partial(_set_up, self.view(), self.planner.had)
        made_up = await self._watched_each(
            [(c, f"constructor {i}", set_up) for i, c in enumerate(self.constructors)],
            "finish its setup")
        for i, ok in enumerate(made_up):
            if not ok:
                raise WorkerLeft(self.cfg.name, f"constructor {i}",
                                 str(actor_address(self.constructors[i])))

    async def _workers(self, placeable: bool = False) -> list[str]:
        """Workers the scheduler knows; ``placeable``: only running ones (not paused, closing
        or being retired), where a new role can start.

        Asks for the workers' thread counts (``ncores``, ``ncores_running``), not the
        scheduler's ``identity``: :meth:`heal` asks twice a second, and ``identity``
        carries every worker's metrics, which the scheduler builds and this worker
        reads each time.

        Raises
        ------
        ServiceTimeoutError
            The scheduler did not answer within the config's ``timeout``.
        """
        scheduler = self._client.scheduler
        ask = scheduler.ncores_running() if placeable else scheduler.ncores()
        try:
            threads = await asyncio.wait_for(ask, self.cfg.timeout)
        except TimeoutError:
            raise ServiceTimeoutError(
                f"msd_dask {self.cfg.name}: the scheduler did not list its workers within "
                f"{self.cfg.timeout:g}s (the config's timeout)") from None
        return sorted(threads)

    async def _place(self, n: int = 1) -> list[str]:
        """The workers for ``n`` new roles placed one after the other, each on the live
        worker holding the fewest roles (the planner's own counts as one): one look at the
        scheduler's workers (:func:`pick_workers`)."""
        workers = await self._placeable()
        return pick_workers(workers, await self._role_load(workers), n)

    async def _placeable(self) -> list[str]:
        """The workers a new role may go to: running, and not being emptied."""
        return [w for w in await self._workers(placeable=True) if w not in self._evacuating]

    async def _role_load(self, workers: list[str]) -> Counter[str]:
        """Roles per worker: this service's (the planner's own counts as one), and on
        ``workers`` every other actor the scheduler lists (another service's roles on a
        shared cluster: a worker holding any actor is one ``Adaptive`` cannot retire, and
        counting this service's alone spread its roles onto another's busiest workers).

        The others are best effort: a scheduler that does not answer within the config's
        ``timeout`` leaves this service's count alone (said in the log).
        """
        load = Counter(a for a in map(actor_address, self._all_role_handles()) if a is not None)
        load[self.own_address()] += 1
        try:
            actors = await asyncio.wait_for(
                self._client.run_on_scheduler(dask_internals.actors_on, workers=workers,
                                              asynchronous=True),
                self.cfg.timeout)
        except Exception as e:  # noqa: BLE001 - its own roles still place
            _log.warning("msd_dask %s: could not count the other actors on the workers (%r); "
                         "placing by this service's roles alone", self.cfg.name, e)
            return load
        sources = [s.name for s in self.cfg.sources]
        for w, keys in actors.items():
            load[w] += len(not_its_roles(keys, self.cfg.name, sources))
        return load

    def _all_role_handles(self) -> list[Any]:
        return [h for h, _ in self._all_loaders()] + list(self.constructors)

    def own_address(self) -> str:
        """The address of the worker this supervisor (and its planner) runs on."""
        from distributed import get_worker

        return str(get_worker().address)

    def _submit_constructor(self, index: int, where: str, replacing: bool = False) -> Any:
        return self._client.submit(
            DataConstructor, self.cfg.name, index, self.members[index], self.cfg.batch.seq_len,
            self.pad_id, self.cfg.prefetch, self.cfg.timeout, self.planner.generation,
            replacing=replacing, actor=True, workers=[where],
            allow_other_workers=False, pure=False,
            key=constructor_key(self.cfg.name, index))

    def _loader_units(self, source: str) -> list[tuple[Any, ...]]:
        return [(u.path, u.part, u.row_offset) for u in self.planner.units[source]]

    def _submit_loader(self, source: str, slot: int, where: str,
                       units: list[tuple[Any, ...]]) -> Any:
        return self._client.submit(
            SourceLoader, self.payloads[source], units, self.tokenizer, slot,
            self.loader_threads, actor=True, workers=[where], allow_other_workers=False,
            pure=False, key=loader_key(self.cfg.name, source, slot))

    async def _created(self, submitted: list[tuple[str, str, Any]]) -> list[tuple[Any, Any]]:
        """``(actor handle, future)`` of each role submitted as ``(name, worker, future)``,
        once every one is created: waits for them all, then fetches the handles in one
        gather.  If a role failed, the first in order raises its error, with a note naming
        the role and its worker; the roles created with it are closed and released.

        A role is bound to its worker: if that worker leaves the cluster first, Dask would
        hold the role for it for ever.  Every
        :data:`~msd_dask.dask_internals.CREATE_CHECK` seconds the wait looks
        at the scheduler's workers, and raises :class:`WorkerLeft` (naming the first such
        role) once one is gone; after the config's ``timeout`` a
        :class:`~msd_dask.errors.ServiceTimeoutError` names the roles still waited for.
        Either way the roles of the call are closed and released.
        """
        futs = [f for _, _, f in submitted]
        # waits until each is done, without a round trip (a failure is raised below)
        waiting = asyncio.ensure_future(asyncio.gather(
            *(f.exception(asynchronous=True) for f in futs), return_exceptions=True))
        deadline = time.monotonic() + self.cfg.timeout
        try:
            while not (await asyncio.wait({waiting}, timeout=dask_internals.CREATE_CHECK))[0]:
                workers = set(await self._workers())
                pending = [(n, w) for n, w, f in submitted if f.status == "pending"]
                gone = [(n, w) for n, w in pending if w not in workers]
                if gone:
                    raise WorkerLeft(self.cfg.name, *gone[0])
                if time.monotonic() >= deadline:
                    raise ServiceTimeoutError(
                        f"msd_dask {self.cfg.name}: waited {self.cfg.timeout:g}s (the config's "
                        f"timeout) for {first_of([f'{n} on {w}' for n, w in pending], 4)} to be "
                        "created; the workers are alive but did not start them "
                        "(paused for memory, or busy)")
            made = [f for f in futs if f.status == "finished"]
            try:  # (a handle of an actor whose worker left a moment ago may never come)
                handles = await asyncio.wait_for(self._client.gather(made, asynchronous=True),
                                                 self.cfg.timeout) if made else []
            except TimeoutError:
                raise ServiceTimeoutError(
                    f"msd_dask {self.cfg.name}: the handles of "
                    f"{first_of([n for n, _, f in submitted if f in made], 4)}, created, did "
                    f"not come from the scheduler within {self.cfg.timeout:g}s (the config's "
                    "timeout)") from None
            if self._closed:  # (closed while they were made: no role outlives the close)
                raise ServiceError(f"msd_dask {self.cfg.name}: closed while "
                                   f"{first_of([n for n, _, _ in submitted], 4)} were created")
        except BaseException:
            # every way out but the roles' own failure (below): a worker left, a timeout,
            # the scheduler not answering, the planning loop cancelled (the service closed)
            # closes and releases what was made, else it stays on its worker for good
            await asyncio.shield(self._abandon(submitted))
            raise
        finally:
            waiting.cancel()
            waiting.add_done_callback(_observe)
        if len(made) == len(futs):
            return list(zip(handles, futs, strict=True))
        await _close_made(made, handles)
        name, where, fut = next(r for r in submitted if r[2].status != "finished")
        try:
            await fut
            raise RuntimeError(f"{fut.key} did not finish")  # pragma: no cover - it failed
        except BaseException as e:
            e.add_note(f"msd_dask {self.cfg.name}: creating {name} on {where}")
            raise
        finally:
            for f in futs:
                if f.status != "finished":
                    f.release()

    async def _abandon(self, submitted: list[tuple[str, str, Any]]) -> None:
        """Close and release the roles of ``submitted``, created or not."""
        futs = [f for _, _, f in submitted]
        made = [f for f in futs if f.status == "finished"]
        handles = []
        if made:
            with contextlib.suppress(Exception):
                handles = await asyncio.wait_for(
                    self._client.gather(made, asynchronous=True), ABANDON_WAIT)
        await _close_made(made, handles)
        for f in futs:  # (those not created; a second release does nothing)
            f.release()

    async def _placed(self, name: str, submit: Callable[[str], Any]) -> tuple[Any, Any]:
        """One role (a replacement or an added loader), placed on the live worker with the
        fewest roles, and placed again if that worker leaves before the role starts.

        Where no worker runs (every one paused, for memory, or being retired), it waits
        for one up to the config's ``timeout``, then a :class:`ServiceTimeoutError` names
        the role: a bare ``RuntimeError("no worker left to place a role on")`` ended the
        service, naming neither, for a pause that would pass (a review)."""
        since = time.monotonic()
        while True:
            workers = await self._placeable()
            if not workers:
                if time.monotonic() - since >= self.cfg.timeout:
                    raise ServiceTimeoutError(
                        f"msd_dask {self.cfg.name}: no running worker to re-create {name} on "
                        f"within {self.cfg.timeout:g}s (the config's timeout): every worker is "
                        "paused or being retired")
                await asyncio.sleep(dask_internals.CREATE_CHECK)
                continue
            where = pick_workers(workers, await self._role_load(workers), 1)[0]
            try:
                return (await self._created([(name, where, submit(where))]))[0]
            except WorkerLeft as e:
                _log.warning("%s; placing it again", e)

    async def _new_constructor(self, index: int) -> tuple[Any, Any]:
        """A constructor to replace constructor ``index`` (it takes the re-sent steps first)."""
        return await self._placed(f"constructor {index}", partial(
            self._submit_constructor, index, replacing=True))

    async def _new_loader(self, source: str, slot: int) -> tuple[Any, Any]:
        return await self._placed(f"loader {source}#{slot}", partial(
            self._submit_loader, source, slot, units=self._loader_units(source)))

    async def _add_slot(self, source: str) -> int:
        slot = next(self._seq[source])
        self._slots[source][slot] = await self._new_loader(source, slot)
        self.active[source].append(slot)
        return slot

    # ---------------------------------------------------------------- lookup
    def resolve(self, source: str, slot: int) -> int:
        """The slot that reads the units of ``slot`` now (a retired slot's heir)."""
        seen = set()
        while slot in self._alias[source]:
            if slot in seen:  # pragma: no cover - aliases never form a cycle
                raise RuntimeError(f"loader slot alias cycle in {source!r}")
            seen.add(slot)
            slot = self._alias[source][slot]
        return slot

    def loader(self, source: str, slot: int) -> Any:
        """The actor handle reading the units of ``source``'s ``slot``."""
        return self._slots[source][self.resolve(source, slot)][0]

    async def tell_loader(self, source: str, slot: int, what: str,
                          call: Callable[[Any], Awaitable[Any]]) -> bool:
        """``call(loader)`` on the actor of ``source``'s loader ``slot``, for a caller that may
        hold the roles' lock (:meth:`heal`, scaling, retiring a slot), watched as
        :meth:`_watched` does: ``False`` if the loader's worker left (:meth:`heal`
        re-creates the slot and hands it the slot's units again)."""
        return await self._watched(self.loader(source, slot), f"loader {source}#{slot}",
                                   what, call)

    async def _watched(self, h: Any, role: str, what: str,
                       call: Callable[[Any], Awaitable[Any]]) -> bool:
        """:meth:`_watched_each` of one call."""
        return (await self._watched_each([(h, role, call)], what))[0]

    async def _watched_each(self, calls: list[tuple[Any, str, Callable[[Any], Awaitable[Any]]]],
                            what: str) -> list[bool]:
        """``call(h)`` on each role ``h``'s actor, together, each given up if its worker
        leaves the cluster meanwhile: a call to a lost actor does not fail, it waits for
        good, and with it whatever waits for the roles' lock.  The workers are looked at
        once every :data:`~msd_dask.dask_internals.CREATE_CHECK` seconds for all the calls
        (hundreds of constructors set up at once ask the scheduler once).  Returns, per
        call, whether it was made (``False``: its worker left).

        Raises
        ------
        ServiceTimeoutError
            A worker stayed but its call did not end within the config's ``timeout`` (the
            roles and ``what`` they were asked name it).
        """
        async def run(h: Any, call: Callable[[Any], Awaitable[Any]]) -> Any:
            return await call(direct(h))  # (in a coroutine: a lost actor's handle raises here)

        tasks = [asyncio.ensure_future(run(h, call)) for h, _, call in calls]
        where = {t: (actor_address(h), role) for t, (h, role, _) in zip(tasks, calls, strict=True)}
        gone: set[asyncio.Future[Any]] = set()
        pending = set(tasks)
        deadline = time.monotonic() + self.cfg.timeout
        try:
            while pending:
                pending = (await asyncio.wait(pending, timeout=dask_internals.CREATE_CHECK))[1]
                if not pending:
                    break
                workers = set(await self._workers())
                for t in [t for t in pending if where[t][0] not in workers]:
                    gone.add(t)
                    pending.discard(t)
                    t.cancel()
                if pending and time.monotonic() >= deadline:
                    late = [f"{where[t][1]} on {where[t][0]}" for t in tasks if t in pending]
                    raise ServiceTimeoutError(
                        f"msd_dask {self.cfg.name}: {first_of(late, 4)} did not {what} within "
                        f"{self.cfg.timeout:g}s (the config's timeout); the workers are alive "
                        "but do not answer (paused for memory, or busy)")
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
        made = []
        for t in tasks:
            worker, role = where[t]
            error = None if t in gone else t.exception()
            if error is not None and not await self._left(worker, 5.0):
                raise error
            left = t in gone or error is not None
            if left:
                _log.warning("msd_dask %s: %s on %s left before it could %s", self.cfg.name,
                             role, worker, what)
            made.append(not left)
        return made

    def forget_retired(self, claimed: int) -> int:
        """Forget the retired slots no step still to be built may name: those retired
        before step ``claimed + 1`` (every step up to ``claimed`` was claimed by every rank,
        so built, and is never sent again).  Their counters go to their heirs'.  Under an
        adaptive policy that adds and retires loaders all run long, the slots ever used
        (sent to every constructor with each change of loaders) no longer grow without
        bound.  Returns how many were forgotten."""
        forgotten = 0
        for source, retired in self._retired.items():
            done = [slot for slot, at in retired.items() if at <= claimed + 1]
            heirs = {slot: self.resolve(source, slot) for slot in done}  # (before any goes)
            gone = self._gone.get(source, {})
            for slot in done:
                counted = gone.pop(slot, None)
                if counted is not None:
                    into = gone.setdefault(heirs[slot], dict.fromkeys(LOADER_COUNTERS, 0))
                    for c in LOADER_COUNTERS:
                        into[c] += counted[c]
                del self._alias[source][slot], retired[slot]
            forgotten += len(done)
        return forgotten

    def view(self) -> dict[str, dict[int, Any]]:
        """Slot -> actor handle for every slot ever used (retired slots point at their heir)."""
        out: dict[str, dict[int, Any]] = {}
        for source, slots in self._slots.items():
            every = set(slots) | set(self._alias[source])
            out[source] = {s: self.loader(source, s) for s in every}
        return out

    def _all_loaders(self) -> list[tuple[Any, Any]]:
        return [v for slots in self._slots.values() for v in slots.values()]

    def keys(self) -> list[str]:
        """The Dask keys of every current loader and constructor."""
        return [str(c.key) for c in self.constructors] + [str(h.key) for h, _ in self._all_loaders()]

    def next_slot(self, source: str, outstanding: Mapping[int, int] | None = None) -> int:
        """The active slot of ``source`` to give a new unit to
        (:func:`~msd_dask.core.scaling.pick_loader`: fewest ``outstanding`` units, else in turn)."""
        return pick_loader(self.active[source], outstanding, next(self._rr[source]))

    def counted(self) -> dict[str, dict[str, float]]:
        """Each source's :data:`~msd_dask.core.figures.LOADER_COUNTERS` as :meth:`loader_stats`
        last saw them (its loaders' last answers and those of the loaders gone): what a
        planner re-created after this one's loss counts on from (:meth:`count_from`)."""
        out = {source: dict.fromkeys(LOADER_COUNTERS, 0.0) for source in self._slots}
        for last in self._last_stats.values():
            into = out.get(str(last["source"]))
            if into is not None:
                for c in LOADER_COUNTERS:
                    into[c] += last.get(c, 0)
        for source, slots in self._gone.items():
            for gone in slots.values():
                for c in LOADER_COUNTERS:
                    out.setdefault(source, dict.fromkeys(LOADER_COUNTERS, 0.0))[c] += gone[c]
        return out

    def count_from(self, counted: Mapping[str, Mapping[str, float]]) -> None:
        """Count each source's loaders on from ``counted`` (:meth:`counted` of the planner
        this one replaces): a re-created planner's loaders start from zero, and a source's
        ``tokens_read`` on ``/metrics``, which dashboards take rates of, went back (a
        review).  Counted as a slot's loaders gone (:meth:`loader_stats` adds them to a
        live loader of the source)."""
        for source, counters in counted.items():
            gone = self._gone.setdefault(str(source), {}).setdefault(
                0, dict.fromkeys(LOADER_COUNTERS, 0))
            for c in LOADER_COUNTERS:
                gone[c] += counters.get(c, 0)

    async def loader_stats(self) -> dict[str, list[dict[str, Any]]]:
        """Every loader's ``stats()`` by source, with its ``slot`` and ``worker``.

        A loader that does not answer within :data:`STATS_WAIT` seconds (its worker was
        lost, and heal re-creates it) is given by its last answer, with ``error`` saying
        why (:func:`~msd_dask.roles.loader.unanswered_stats`): a monitor polling the
        service does not fail while it recovers.

        The counters of :data:`~msd_dask.core.figures.LOADER_COUNTERS` go on from those
        of the loaders gone from the slot (a lost loader's successor, or a retired slot's
        heir, :meth:`resolve`), as they last answered: a new loader starts from zero, and
        a source's figures, which a dashboard takes rates of, went back.
        """

        def current(source: str, slot: int, h: Any) -> bool:
            return self._slots.get(source, {}).get(slot, (None, None))[0] is h

        async def one(source: str, slot: int, h: Any) -> dict[str, Any]:
            key = str(h.key)
            try:
                st = dict(await asyncio.wait_for(direct(h).stats(), STATS_WAIT))
            except Exception as e:  # noqa: BLE001 - lost meanwhile: heal re-creates it
                st = loader_role.unanswered_stats(source, slot, self._last_stats.get(key),
                                                  unanswered(e, STATS_WAIT))
            else:
                # an answer is the loader's last, moved into _gone once it is gone; but one
                # that comes after another call moved the loader's earlier answer there (it
                # was retired while this call waited) adds only what it read since: recorded
                # as its last, it was counted twice, for good (a review)
                if current(source, slot, h) or key not in self._moved:
                    self._last_stats[key] = dict(st, slot=slot)
                else:
                    at, into, moved = self._moved[key]
                    gone = self._gone.get(at, {}).get(into)
                    for c in LOADER_COUNTERS:
                        more = max(0, st.get(c, 0) - moved[c])
                        moved[c] += more
                        if gone is not None:
                            gone[c] += more
            return dict(st, slot=slot, worker=actor_address(h))

        pairs = [(source, slot, h) for source, slots in self._slots.items()
                 for slot, (h, _) in sorted(slots.items())]
        got = await asyncio.gather(*(one(*p) for p in pairs))
        keys = {str(h.key) for slots in self._slots.values() for h, _ in slots.values()}
        for key in [k for k in self._last_stats if k not in keys]:
            last = self._last_stats.pop(key)  # a loader replaced or retired: kept counted
            source, slot = str(last["source"]), int(last["slot"])
            current_slots = sorted(self._slots.get(source, {}))
            if (current_slots and slot not in current_slots
                    and slot not in self._alias.get(source, {})):
                # a slot forget_retired forgot already: on a live one, or each such retired
                # loader would stay an entry of its own (one per scale event, a review)
                slot = current_slots[0]
            gone = self._gone.setdefault(source, {}).setdefault(
                slot, dict.fromkeys(LOADER_COUNTERS, 0))
            for c in LOADER_COUNTERS:
                gone[c] += last.get(c, 0)
            self._moved[key] = (source, slot, {c: last.get(c, 0) for c in LOADER_COUNTERS})
            while len(self._moved) > MOVED_KEPT:
                self._moved.popitem(last=False)
        out: dict[str, list[dict[str, Any]]] = {source: [] for source in self._slots}
        for (source, slot, h), st in zip(pairs, got, strict=True):
            if current(source, slot, h):  # (one retired meanwhile is counted in _gone)
                out[source].append(st)
            elif slot in self._slots.get(source, {}):
                # replaced while asked: its successor, not asked, stands in with zero
                # counters, which the replaced one's (in _gone) go on from; with none, a
                # source of one loader read 0 tokens for a poll, and the rates a dashboard
                # takes of them went back and up again (a review)
                new = self._slots[source][slot][0]
                out[source].append(dict(
                    loader_role.unanswered_stats(source, slot, None,
                                                 "re-created while its stats were asked"),
                    slot=slot, worker=actor_address(new)))
        for source, slots in self._gone.items():
            live = {st["slot"]: st for st in out.get(source, [])}
            for slot, counted in slots.items():
                heir = self.resolve(source, slot) if source in self._alias else slot
                into = live.get(heir) or next(iter(live.values()), None)
                if into is not None:  # (a source with no loader: nothing to count on)
                    for c in LOADER_COUNTERS:
                        into[c] = into.get(c, 0) + counted[c]
        return out

    async def constructor_stats(self, max_age: float = 0.0) -> list[dict[str, Any]]:
        """Every constructor's ``stats()``, asked at once; one that does not answer within
        :data:`~msd_dask.dask_internals.STATS_WAIT` seconds (its worker was lost, and
        heal re-creates it) is given by :func:`~msd_dask.roles.constructor.unanswered_stats`.

        With ``max_age``, the answers of a round of asks still under way (a lost
        constructor's takes ``STATS_WAIT``), or that started less than ``max_age`` seconds
        ago, serve instead: the owner's checkpoint and the
        plugin's poll each ask once a second, a message to every constructor each time
        (256 of them at dp 16,384), and share one round.
        """
        shared = self._cons_stats
        if shared is not None and max_age > 0 and (
                not shared[1].done() or time.monotonic() - shared[0] < max_age):
            return list(await asyncio.shield(shared[1]))

        async def one(i: int, c: Any) -> dict[str, Any]:
            try:
                return dict(await asyncio.wait_for(direct(c).stats(), STATS_WAIT))
            except Exception as e:  # noqa: BLE001 - lost meanwhile: heal re-creates it
                return constructor_role.unanswered_stats(i, unanswered(e, STATS_WAIT))

        asked = asyncio.ensure_future(
            asyncio.gather(*(one(i, c) for i, c in enumerate(self.constructors))))
        self._cons_stats = (time.monotonic(), asked)
        return list(await asyncio.shield(asked))

    # -------------------------------------------------------------- calls
    async def assign_units(self, source: str, slot: int, keys: list[tuple[int, int]]) -> None:
        """Queue ``(epoch, unit)`` keys on a loader slot (:meth:`SourceLoader.assign`)."""
        await self._on_loader(source, slot, lambda loader: loader.assign(keys),
                              f"take {len(keys)} unit(s)")

    async def release_units(self, source: str, slot: int, keys: list[tuple[int, int]]) -> None:
        """Let a loader slot drop units (:meth:`SourceLoader.release`)."""
        await self._on_loader(source, slot, lambda loader: loader.release(keys),
                              f"let go of {len(keys)} unit(s)")

    async def _on_loader(self, source: str, slot: int,
                         call: Callable[[Any], Awaitable[_T]], what: str) -> _T:
        """``call(loader)`` on a loader slot's actor; if its worker is lost meanwhile, on
        the actor re-created in that slot instead (a call to a lost actor may hang, not fail).

        Raises
        ------
        ServiceTimeoutError
            The loader's worker stayed but the call (``what`` it was asked) did not end
            within the config's ``timeout``.
        """
        async def run(h: Any) -> _T:
            # inside a coroutine: a lost actor's handle raises on attribute access
            return await call(direct(h))

        while True:
            h = self.loader(source, slot)
            # (each actor asked has the whole timeout: the one re-created for a loader lost
            # late in the wait was found past the first one's deadline, and named frozen
            # before it was asked anything; a review)
            deadline = time.monotonic() + self.cfg.timeout
            task = asyncio.ensure_future(run(h))
            replaced = False
            while not task.done():
                if time.monotonic() > deadline:
                    task.cancel()
                    task.add_done_callback(_observe)
                    raise ServiceTimeoutError(
                        f"loader {source}#{slot} on {actor_address(h)} was asked to {what} "
                        f"and did not answer within {self.cfg.timeout:g}s (the config's "
                        "timeout); its worker is alive (frozen, or its event loop blocked?)")
                await asyncio.wait({task}, timeout=1.0)
                if task.done():
                    break
                await self.heal()
                # (whoever re-created it: another heal, a move off a retiring worker, found
                # the loss first, and this call waited on the lost actor until its timeout;
                # a review)
                if self.loader(source, slot) is not h:
                    task.cancel()
                    task.add_done_callback(_observe)
                    replaced = True
                    break
            if replaced or task.cancelled():
                continue
            exc = task.exception()
            if exc is None:
                return task.result()
            await self.healed_after(exc)
            if self.loader(source, slot) is not h:
                continue
            raise exc

    async def wait_room(self, steps: int) -> None:
        """Return once every constructor has room for ``steps`` more steps
        (:meth:`DataConstructor.wait_room`); survives constructors lost meanwhile."""
        await self._on_constructors(lambda i, c: c.wait_room(steps))

    async def submit(self, steps: list[StepRound], room: int) -> None:
        """Hand every constructor its share of a round of ``steps`` and return once each
        has room for ``room`` more (:meth:`DataConstructor.submit`); survives constructors
        lost meanwhile: one re-created got the recent steps already, so it is not sent them
        again, but waited for until it has the room (else the planner would take the
        steps it still holds for claimed by every rank, and not keep them for its
        successor)."""
        async def submit(i: int, constructor: Any) -> None:
            await _hand_round(constructor, [(s, packed[i]) for s, packed in steps], room)

        await self._on_constructors(submit, again=lambda i, c: c.wait_room(room))

    async def _on_constructors(self, call: Callable[[int, Any], Awaitable[Any]],
                               again: Callable[[int, Any], Awaitable[Any]] | None = None
                               ) -> None:
        """``call(i, constructor)`` on every constructor; survive constructors lost meanwhile.

        A constructor re-created (or moved) meanwhile is called with ``again`` instead
        (default: ``call``).
        """
        def run(i: int, fn: Callable[[int, Any], Awaitable[Any]]) -> asyncio.Future[Any]:
            async def one() -> Any:
                # inside a coroutine: a lost actor's handle raises on attribute access
                return await fn(i, direct(self.constructors[i]))
            return asyncio.ensure_future(one())

        then = call if again is None else again
        handles = list(self.constructors)
        pending = {i: run(i, call) for i in range(len(handles))}
        try:
            while pending:
                done, _ = await asyncio.wait(pending.values(), timeout=1.0)
                for i, t in list(pending.items()):
                    if t in done:
                        if t.exception() is None:
                            del pending[i]
                        else:
                            await self.heal(wait=True)
                            if self.constructors[i] is handles[i]:
                                raise t.exception()  # type: ignore[misc]
                            handles[i] = self.constructors[i]
                            pending[i] = run(i, then)
                # a constructor replaced meanwhile (lost, or moved off a retiring worker by
                # evacuate while it stays alive): its pending call is made again of the new one
                if pending and (await self.heal() or any(
                        self.constructors[i] is not handles[i] for i in pending)):
                    for i in list(pending):
                        if self.constructors[i] is not handles[i]:
                            gone = pending.pop(i)
                            gone.cancel()
                            gone.add_done_callback(_observe)
                            handles[i] = self.constructors[i]
                            pending[i] = run(i, then)
        finally:  # raised early: the other calls must not fail unobserved later
            for t in pending.values():
                t.cancel()
                t.add_done_callback(_observe)

    # ------------------------------------------------------------- recovery
    async def healed_after(self, exc: BaseException) -> bool:
        """After a role's call failed with ``exc``: :meth:`heal` (waiting for the scheduler
        to notice a lost worker), unless ``exc`` is bad input (:class:`DataError`), which no
        lost worker raises: that is reported at once, not after the wait."""
        return not isinstance(exc, DataError) and await self.heal(wait=True)

    async def heal(self, wait: bool = False) -> bool:
        """Re-create roles whose worker is gone; returns whether anything was re-created.

        Checks at most every half second unless ``wait`` (after a failed call:
        then it waits up to a few seconds for the scheduler to notice the loss).
        """
        now = time.monotonic()
        if not wait and now - self._last_check < 0.5:
            return False
        self._last_check = now
        async with self._lock:
            if self._closed:
                return False
            healed = await self._heal(wait)
            if self._untold:  # (a re-created constructor took the view at its setup)
                await self._push_loaders(self._untold)
            return healed

    async def _heal(self, wait: bool, gone_only: bool = False) -> bool:
        """:meth:`heal`'s work, under the lock.  ``gone_only``: only the roles of workers
        that left the cluster, not those of workers being evacuated (:meth:`evacuate`
        moves them itself, closing the old ones)."""
        deadline = time.monotonic() + (10.0 if wait else 0.0)
        while True:
            workers = set(await self._workers())
            # a retired worker gone from the cluster is no longer excluded: its address
            # may join again (a worker kept after retire_workers(close=False) stays out)
            self._evacuating &= workers
            alive = workers if gone_only else workers - self._evacuating
            lost_l = [(s, slot) for s, slots in self._slots.items()
                      for slot, (h, _) in slots.items() if actor_address(h) not in alive]
            lost_c = [i for i, c in enumerate(self.constructors)
                      if actor_address(c) not in alive]
            if lost_l or lost_c or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.25)
        if lost_l:
            await self._tell_lost_reading(lost_l)
        for source, slot in lost_l:
            await self._replace_loader(source, slot, "lost")
        for i in lost_c:  # re-created constructors get the current loaders in setup
            await self._replace_constructor(i, "lost")
        if lost_l:
            await self._push_loaders()
        return bool(lost_l or lost_c)

    async def _tell_lost_reading(self, lost: list[tuple[str, int]]) -> None:
        """Leave on the scheduler the files the ``lost`` loader slots were reading
        (:func:`~msd_dask.roles.keys.lost_reading_key`): if what killed their worker was
        one of them, the re-created loader takes it to another worker, this one perhaps,
        and the owner names them once it stops re-creating the planner."""
        files = self.planner.files_awaited(slots=set(lost))
        if files:
            with contextlib.suppress(Exception):  # (best effort: a hint for an error message)
                await asyncio.wait_for(self._client.scheduler.set_metadata(
                    keys=lost_reading_key(self.cfg.name),
                    value={"generation": self.planner.generation, "files": files}), 5)

    async def _replace_loader(self, source: str, slot: int, why: str,
                              replaced: list[tuple[Any, Any]] | None = None) -> None:
        """Put a new loader in ``source``'s ``slot`` and hand it the slot's units.  The old
        one is dropped here if it was lost, else appended to ``replaced`` (its handle and
        future) as soon as the new one holds the slot, even if the hand-over fails: the
        caller closes it once the constructors fetch from the new one (:meth:`_move_off`)."""
        old_h, old_f = self._slots[source][slot]
        self._slots[source][slot] = await self._new_loader(source, slot)
        new = self._slots[source][slot][0]
        self.record_event("loader", f"{source}#{slot}", why, actor_address(old_h),
                          actor_address(new))
        if why == "lost":
            _drop((old_h, old_f))
        elif replaced is not None:
            replaced.append((old_h, old_f))
        await self.planner.hand_over(source, [slot], slot)

    async def _replace_constructor(self, i: int, why: str) -> None:
        old, old_f = self.constructors[i], self._cfuts[i]
        moved = why != "lost"
        try:
            while True:
                handle, fut = await self._set_up_constructor(i)
                was, was_f = self.constructors[i], self._cfuts[i]
                self.constructors[i], self._cfuts[i] = handle, fut
                self._untold.discard(i)  # (set up with the loaders' current view)
                if was is not old:  # one placed here before, whose worker left
                    _drop((was, was_f))
                self.record_event("constructor", str(i), why, actor_address(was),
                                  actor_address(handle))
                # steps that may not have been claimed by every rank yet go to the new one
                # (taken with the assignment, no await between: a round the planner sends
                # it meanwhile waits for them, see DataConstructor.submit); watched, as a
                # call to an actor whose worker left waits for good, and so would heal,
                # holding the roles' lock
                resent = self.planner.unclaimed_steps(i)
                if await self._watched(handle, f"re-created constructor {i}",
                                       f"take the {len(resent)} steps not claimed by every "
                                       "rank yet", partial(_hand_round, steps=resent, room=0,
                                                           force=True)):
                    break
                why = "lost"  # its worker left before it had them: placed again
        finally:  # (also where the new one's worker died meanwhile: heal re-creates it)
            if self.constructors[i] is not old:  # (else none was made: the old one stays)
                if moved:  # the old one stops publishing, and frees its batches
                    with contextlib.suppress(Exception):  # (its worker may be frozen, or gone)
                        await asyncio.wait_for(old.close(), 30)
                        # what ranks took from the old one meanwhile is not held for them
                        # by the new one (see DataConstructor.steps_shown)
                        shown = await asyncio.wait_for(old.steps_shown(), 10)
                        await asyncio.wait_for(self.constructors[i].mark_had_all(shown), 30)
                _drop((old, old_f))

    async def _set_up_constructor(self, i: int) -> tuple[Any, Any]:
        """A new constructor ``i``, set up: ``(handle, future)``, not a current role yet."""
        while True:
            handle, fut = await self._new_constructor(i)
            try:
                if await self._watched(handle, f"re-created constructor {i}",
                                       "finish its setup",
                                       partial(_set_up, self.view(), self.planner.had)):
                    return handle, fut
            except Exception:
                _drop((handle, fut))
                raise
            # its worker left before it was set up (while it is not a current role, heal
            # would not find it): placed again
            _drop((handle, fut))

    async def _left(self, worker: str | None, wait: float = 10.0) -> bool:
        """Whether ``worker`` left the cluster, waiting up to ``wait`` seconds for the
        scheduler to notice (a worker killed a moment ago is still listed)."""
        if worker is None:
            return False
        deadline = time.monotonic() + wait
        while worker in await self._workers():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.25)
        return True

    def record_event(self, role: str, name: str, why: str, old: str | None, new: str | None,
                     detail: str = "") -> None:
        """Count and log a role re-created, moved, added or retired (:attr:`events`, the
        last 100; ``why``: ``lost``, ``moved``, ``added`` or ``retired``).

        ``old``, ``new``: the workers it was on and is on now; ``detail`` ends the log line.
        """
        self.recovered[role] += 1
        ev = {"time": time.time(), "role": role, "name": name, "why": why, "from": old,
              "to": new, "step": self.planner.next_step()}
        self.events.append(ev)
        del self.events[:-100]
        what = {"lost": f"lost on {old}, re-created on {new}",
                "moved": f"moved from {old} to {new}",
                "added": f"added on {new}",
                "retired": f"retired from {old}; its units went to the loader on {new}"}[why]
        _log.warning("msd_dask %s: %s %s %s%s", self.cfg.name, role, name, what, detail)

    async def _push_loaders(self, only: Iterable[int] | None = None) -> None:
        """Tell the constructors (``only`` these indices) the loaders' current view.  One
        that does not take it is named in the log and told again at the next :meth:`heal`
        (a constructor missing it fetches from a retired loader's closed actor until its
        timeout, and names that loader, not itself)."""
        view = self.view()
        which = range(len(self.constructors)) if only is None else sorted(only)

        async def push(c: Any) -> None:
            # a lost constructor raises, heal re-creates it; one on a frozen worker is not
            # waited for under the lock for ever (heal re-creates it once Dask drops the worker)
            await asyncio.wait_for(c.set_loaders(view), self.cfg.timeout)

        told = await asyncio.gather(*(push(self.constructors[i]) for i in which),
                                    return_exceptions=True)
        for i, got in zip(which, told, strict=True):
            if isinstance(got, BaseException):
                if i not in self._untold:
                    _log.warning("msd_dask %s: constructor %d on %s did not take the loaders' "
                                 "new view (%r); told again at the next round", self.cfg.name,
                                 i, actor_address(self.constructors[i]), got)
                self._untold.add(i)
            else:
                self._untold.discard(i)

    # -------------------------------------------------------------- scaling
    def loader_counts(self) -> dict[str, int]:
        """Loaders per source: the count asked for (:meth:`scale`) where not applied yet or
        being applied, else the active ones."""
        return {s: self._targets.get(s, self._applying.get(s, len(slots)))
                for s, slots in self.active.items()}

    def bounds(self, source: str) -> tuple[int, int]:
        """The least and most loaders ``source`` may have (the config's scaling bounds)."""
        return ScalingPolicy.from_config(self.cfg).bounds(source)

    async def scale(self, source: str, n: int) -> int:
        """Ask for ``n`` loaders on ``source``; applied before the next step is planned, or
        at once where the planning loop waits for the constructors' room (training paused:
        see :meth:`scale_asked`)."""
        if source not in self._slots:
            raise KeyError(f"no source {source!r}")
        if self._closed:  # (the plugin's policy may ask a closed service's planner)
            return len(self.active[source])
        lo, hi = self.bounds(source)
        target = self._targets[source] = max(lo, min(hi, n))
        self._scale_asked.set()
        if not self.planner.is_planning():  # not planning: apply now (which clears it)
            await self.apply_scaling()
            if self._closed:
                return len(self.active[source])
            failed = self.add_failed.get(source)
            if failed is not None and len(self.active[source]) < target:
                raise ServiceError(failed)  # (the caller asked for these loaders now)
        return target

    async def scale_asked(self) -> None:
        """Return once :meth:`scale` asked for a change not applied yet: the planning loop
        applies it while it waits for the constructors' room (training paused, a
        scale-down frees its workers then, not once training goes on), in its own
        coroutine, as between two rounds."""
        await self._scale_asked.wait()

    async def apply_scaling(self) -> None:
        """Add or retire loader slots to reach the counts :meth:`scale` asked for."""
        async with self._lock:
            self._scale_asked.clear()
            if self._closed:
                self._targets.clear()
                return
            changed = False
            while self._targets:
                # taken out before it is applied: a scale() of the source while this one
                # is applied (an operator and the adaptive policy, say) puts its own back,
                # and it is applied next, not dropped
                source = next(iter(self._targets))
                n = self._applying[source] = self._targets.pop(source)
                try:
                    changed |= await self._reach(source, n)
                finally:
                    del self._applying[source]
            if changed:
                await self._push_loaders()

    async def _reach(self, source: str, n: int) -> bool:
        """Add or retire ``source``'s loader slots until it has ``n``; whether any changed."""
        act = self.active[source]
        before = len(act)
        self.add_failed.pop(source, None)
        while len(act) < n:
            try:
                slot = await self._add_slot(source)
            except Exception as e:  # noqa: BLE001 - loaders beyond its own are extra capacity
                # (its worker paused for memory, no worker placeable, its creation timed
                # out): the source keeps the loaders it has, and the service goes on;
                # raised, it ended the planning loop and every reader with it
                if self._closed:
                    break  # (closed meanwhile: nothing to say)
                self.add_failed[source] = (
                    f"msd_dask {self.cfg.name}: could not add a loader to source {source!r} "
                    f"({type(e).__name__}: {e}); it keeps its {len(act)}")
                _log.warning("%s", self.add_failed[source])
                break
            self.record_event("loader", f"{source}#{slot}", "added", "-",
                              actor_address(self._slots[source][slot][0]))
        grew = len(act) > before
        if grew:  # the units not read yet: added loaders help at once
            await self.planner.spread_units(source)
        shrank = len(act) > n
        if shrank:
            # every slot to retire chosen first (each counted off its worker for the next),
            # so that their units go to a slot that stays, not to one retired next
            where = {s: actor_address(self._slots[source][s][0]) for s in act}
            load = await self._role_load(sorted({w for w in where.values() if w}))
            going = []
            while len(act) > n:
                slot = pick_retiring(act, where, load)
                act.remove(slot)
                going.append(slot)
                load[where[slot] or ""] -= 1
            # each to the slots that stay in turn (all to the first, 8 -> 4 gave one loader
            # the units of five, over its memory bound, to read alone; a review)
            for i, slot in enumerate(going):
                await self._retire_slot(source, slot, act[i % len(act)])
        return grew or shrank

    async def _retire_slot(self, source: str, slot: int, heir: int) -> None:
        h, f = self._slots[source].pop(slot)
        self._alias[source][slot] = heir
        await self.planner.hand_over(source, [slot], heir)
        # (the steps planned from now on are split with the heir's slot: hand_over took the
        # planning lock, and a step is split under it)
        self._retired[source][slot] = self.planner.next_step()
        self.record_event("loader", f"{source}#{slot}", "retired", actor_address(h),
                          actor_address(self.loader(source, heir)))
        await self._push_loaders()
        try:
            await asyncio.wait_for(h.close(), 30)
        except Exception:  # noqa: BLE001 - its worker may be gone already, or frozen
            pass
        _drop((h, f))

    async def evacuate(self, workers: list[str]) -> dict[str, int]:
        """Move loaders and constructors off ``workers``; returns how many moved."""
        if self.own_address() in workers:
            raise ValueError(f"the planner itself runs on {self.own_address()}; it cannot "
                             "move (restart the service from a state_dict instead)")
        async with self._lock:
            if self._closed:
                raise ServiceError(f"msd_dask {self.cfg.name}: closed; no role moves")
            self._evacuating.update(workers)
            moved = Counter[str](
                loaders=sum(actor_address(h) in workers for h, _ in self._all_loaders()),
                constructors=sum(actor_address(c) in workers for c in self.constructors))
            while True:
                try:
                    await self._move_off(workers)
                    break
                except Exception:
                    # another worker was lost meanwhile (the one a moved role was just
                    # placed on, say): re-create its roles, then move the others on
                    if not await self._heal(wait=True, gone_only=True):
                        # the move failed: the roles still on ``workers`` stay current
                        # (heal would take them for lost, and drop them unclosed)
                        self._evacuating.difference_update(workers)
                        raise
        return {k: n for k, n in moved.items() if n}

    async def _move_off(self, workers: list[str]) -> None:
        """Re-create the loaders and constructors on ``workers`` elsewhere (under the lock)."""
        moved: list[tuple[Any, Any]] = []  # the old loaders, replaced in their slots
        try:
            for source, slots in self._slots.items():
                for slot, (h, _) in list(slots.items()):
                    if actor_address(h) in workers:
                        await self._replace_loader(source, slot, "moved", moved)
        finally:
            # (also where a move failed halfway: the loaders replaced so far are closed,
            # not left on the worker being retired, which a retry finds empty of them)
            await self._push_loaders()
            for old in moved:  # (alive: it stops reading and frees its units, threads, pool)
                with contextlib.suppress(Exception):  # (its worker may be frozen, or gone)
                    await asyncio.wait_for(direct(old[0]).close(), 30)
                _drop(old)
        for i, c in enumerate(list(self.constructors)):
            if actor_address(c) in workers:
                await self._replace_constructor(i, "moved")

    async def notify(self, message: str) -> None:
        """Have every constructor tell its ranks ``message`` (an error), once they have
        every round posted to them (best effort: a lost constructor tells nothing)."""
        async def tell(c: Any) -> None:
            # (looked up here: a lost actor's handle raises on the method's lookup, and
            # raised in the list of calls, so that no constructor told its ranks; a review)
            await asyncio.wait_for(c.notify(message), 5)

        await asyncio.gather(*(tell(c) for c in self.constructors), return_exceptions=True)

    async def close(self, notice: str | None = None) -> None:
        """Close every constructor and loader and let Dask forget their actors; ``notice``:
        what the constructors tell readers that ask them afterwards.

        No role is made from then on (:meth:`scale`, :meth:`heal` and :meth:`evacuate` do
        nothing; a role being made is closed as it comes): a change going on is waited
        for up to :data:`CLOSE_WAIT` seconds, so that the roles it made are among those
        closed.
        """
        self._closed = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._lock.acquire(), CLOSE_WAIT)
            self._lock.release()  # (nothing takes it again: every change checks _closed)

        # the constructors first (they stop fetching from the loaders)
        await _close_all(self.constructors, notice)
        await _close_all([h for h, _ in self._all_loaders()])
        # the handles' own futures too: released only through the submit futures, the
        # roles' keys stayed on the scheduler and their actors on the workers after close
        _drop(*zip(self.constructors, self._cfuts, strict=True), *self._all_loaders())


async def close_service_roles(name: str, sources: list[str],
                              dask_worker: Any = None) -> dict[str, Any]:
    """Close the loaders and constructors of service ``name`` (whose sources are
    ``sources``) held by this worker: by their whole keys
    (:func:`~msd_dask.roles.keys.role_pattern`), never another service's.

    Run on every worker (``client.run``) by the process that re-creates a lost
    planner, before it starts the new one: the old roles must stop building
    and give their memory back (their readers switch to the new ones).  Returns
    ``{"closed": n, "shown": {rank: step}}``, the last step each rank showed the closed
    constructors it has (:meth:`~msd_dask.roles.constructor.DataConstructor.steps_shown`).
    """
    pattern = role_pattern(name, sources)
    closed = 0
    last: dict[int, int] = {}
    for key, role in list(worker_actors(dask_worker).items()):
        if not is_role_of(key, pattern) or not isinstance(role, DataConstructor | SourceLoader):
            continue
        try:
            await asyncio.wait_for(role.close(), 5)
        except Exception as e:  # noqa: BLE001 - best effort: closing the others matters more
            _log.warning("msd_dask %s: could not close %s: %r", name, key, e)
            continue
        closed += 1
        if isinstance(role, DataConstructor):
            for r, step in (await role.steps_shown()).items():
                last[int(r)] = max(last.get(int(r), -1), int(step))
    return {"closed": closed, "shown": last}


def pick_workers(workers: Iterable[str], load: Mapping[str, int], n: int) -> list[str]:
    """The workers ``n`` new roles go to, placed one after the other: each on the worker of
    ``workers`` (distinct addresses) holding the fewest roles, ties to the lowest address.

    ``load`` counts each worker's roles before these (missing: none); every role placed
    counts on its worker for the next.  Equal to taking ``min(workers, key=lambda w:
    (load[w], w))`` and adding one to the chosen worker's count, ``n`` times, in
    O(W + n log W): a heap of ``(count, address)`` whose top is exactly that minimum, and
    only the chosen worker's entry changes.
    """
    heap = [(load.get(w, 0), w) for w in workers]
    if n and not heap:
        raise RuntimeError("no worker left to place a role on")
    heapq.heapify(heap)
    out = []
    for _ in range(n):
        count, w = heap[0]
        out.append(w)
        heapq.heapreplace(heap, (count + 1, w))
    return out


def pick_retiring(slots: Sequence[int], where: Mapping[int, str | None],
                  load: Mapping[str, int]) -> int:
    """The loader slot of ``slots`` (active, oldest first) a scale-down retires: the one on
    the worker holding the fewest roles, ties to the newest slot.

    A worker left with no role is one ``Adaptive`` may retire (it never retires a role
    holder), so a scale-down empties the least used worker first, where retiring the newest
    slot alone left every worker one role each after loaders had been spread over them.

    Parameters
    ----------
    slots : sequence of int
        The source's active slots, oldest first.
    where : mapping
        Slot -> address of the worker holding its loader (``None``: unknown, counted as a
        worker of no other role).
    load : mapping
        Address -> roles of the service on that worker (missing: none).
    """
    if not slots:
        raise ValueError("no active loader slot to retire")
    return min(reversed(slots), key=lambda s: load.get(where.get(s) or "", 0))


def _observe(task: asyncio.Future[Any]) -> None:
    """Retrieve a finished task's exception (it was given up on; nothing else will)."""
    if not task.cancelled():
        task.exception()


async def _close_all(roles: Sequence[Any], *args: Any) -> None:
    """``close(*args)`` every role of ``roles`` at once, each waited for up to
    :data:`ROLE_CLOSE_WAIT` seconds; best effort (a role's worker may be gone, or frozen:
    one after the other, the roles of a frozen worker took that wait each, and the owner's
    close gave up before the last of them)."""
    async def close(role: Any) -> None:
        with contextlib.suppress(Exception):
            # (looked up here: a lost actor's handle raises on the method's lookup)
            await asyncio.wait_for(role.close(*args), ROLE_CLOSE_WAIT)

    await asyncio.gather(*(close(role) for role in roles))


async def _close_made(made: list[Any], handles: list[Any]) -> None:
    """Close the roles created of a call that failed (``made``: their futures, ``handles``
    their handles, if fetched) and let Dask forget them (:func:`_drop`)."""
    await _close_all(handles)
    if handles:
        _drop(*zip(handles, made, strict=True))


async def _set_up(view: dict[str, dict[int, Any]], had: dict[int, int], constructor: Any) -> None:
    """A constructor's setup: the loaders' handles, and the steps ranks had read."""
    await constructor.setup(view, had)


def _drop(*roles: tuple[Any, Any]) -> None:
    """Let Dask forget roles' actors: release every future that keeps their keys alive.

    ``roles`` are ``(handle, submit future)`` pairs; one garbage collection after
    them all (it finds the cycles that still hold a future)."""
    import gc

    for handle, fut in roles:
        release_actor(handle)
        fut.release()
    gc.collect()
