"""A process's link to a service's current planner: what a handle and its readers share.

The planner may be lost with its worker; the process that started the service
re-creates it (a new *generation*, :mod:`msd_dask.service.recovery`) and publishes it
again under the same name.  A :class:`PlannerLink` holds the handles of the
current generation (planner, constructors), switches to a newer one when the
current planner stops answering, and tells this process's readers when it did
(they tell the new constructors which steps they have).  It is the
:class:`~msd_dask.reader.ServiceLink` a :class:`~msd_dask.reader.Reader` reads through.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from msd_dask.core.config import Config
from msd_dask.dask_internals import (
    ASK_WAIT,
    actor_address,
    bind_actor,
    call_actor,
    has_client,
    scheduler_workers,
)
from msd_dask.errors import (
    CLOSED_BY_OWNER,
    CLOSED_OR_STOPPED,
    RESTART_HINT,
    ServiceError,
    ServiceTimeoutError,
)
from msd_dask.service.placement import REGISTRY_PREFIX

__all__ = ["PlannerLink"]

_log = logging.getLogger("msd_dask.service")


#: seconds a link waits for the published planner's handle (there at once for a planner
#: that lives; a lost one's may never come, and the link looks for its successor)
HANDLE_WAIT = 5.0

def _ask(deadline: float) -> float:
    """How long an ask of the scheduler may wait before ``deadline`` (a monotonic time): what
    is left of it, at least 0.1 s and at most
    :data:`~msd_dask.dask_internals.ASK_WAIT`."""
    return min(ASK_WAIT, max(0.1, deadline - time.monotonic()))


class PlannerLink:
    """The current planner generation of service ``cfg.name``, as seen from this process.

    Parameters
    ----------
    client : distributed.Client
    cfg : Config
    registry : dict
        The published registry (see :func:`msd_dask.service.placement.place_planner`).
    owner : bool
        Whether this process started the service (and re-creates a lost planner).
    """

    def __init__(self, client: Any, cfg: Config, registry: dict[str, Any], *,
                 owner: bool = False):
        self.client = client
        #: the scheduler's address (said where it is lost: a closed client has none)
        self.scheduler_address: str = getattr(getattr(client, "scheduler", None), "address",
                                              None) or "?"
        self.config = cfg
        self.name = cfg.name
        self.owner = owner
        #: set when this process's handle closes (a closed owner re-creates nothing), or
        #: once a reader hears that the owner closed the service (:meth:`close`): then no
        #: reader of this process calls a role any more
        self.closed = False
        #: why it closed: what a reader raises then (``None`` while open)
        self.notice: str | None = None
        #: why the owner stopped re-creating the lost planner (published with its
        #: registry; ``None``: it re-creates it)
        self.failed: str | None = registry.get("failed")
        #: held while a reader's call is sent (:meth:`send`) or the link closes
        self._sending = threading.Lock()
        self.registry = registry
        #: the planner's generation: 0, then one more each time a lost one is re-created
        self.generation = int(registry.get("generation", 0))
        #: held while the planner handle, its generation and the constructors change
        self._swap = threading.Lock()
        #: one refresh with ``max_age`` at a time; when the last one finished (monotonic),
        #: and when the last one failed, why, and how long it had waited at most
        self._refreshing = threading.Lock()
        self._refreshed_at = float("-inf")
        self._failed: tuple[float, Exception | None, float] = (0.0, None, 0.0)
        self.planner: Any = None
        self._fetch_planner(HANDLE_WAIT)
        self.constructors: list[Any] = []
        #: (generation, constructors of that generation), replaced together
        self.handles: tuple[int, list[Any]] = (-1, [])
        self._listeners: list[weakref.WeakMethod[Callable[[], None]]] = []
        self._listeners_lock = threading.Lock()

    def _fetch_planner(self, wait: float) -> Any:
        """The planner's handle, fetched from this link's registry within ``wait`` seconds
        where it has none yet: a published planner's handle is there at once, a lost one's
        may never come.  A fetch that timed out (a busy scheduler while many ranks connect)
        is tried again by the next look: it was never fetched again, and every call of the
        process failed against a live planner (a review).  ``None`` where it did not come."""
        with self._swap:
            planner, registry, gen = self.planner, self.registry, self.generation
        if planner is not None:
            return planner
        try:
            planner = bind_actor(registry["planner"].result(timeout=wait), self.client)
        except Exception:  # noqa: BLE001 - a lost planner: refresh finds its successor
            return None
        with self._swap:
            if gen == self.generation and self.planner is None:
                self.planner = planner
            return self.planner

    def close(self, notice: str) -> None:
        """Send no call to a role any more: this process's handle closed, or the owner
        closed the service (``notice``: what a reader raises, after ``service 'name': ``).

        The owner's close releases the roles' actors once it closed them: a call sent
        after that reaches a worker that no longer holds its actor, and the worker logs
        an error (``KeyError`` in ``actor_execute``) for a service that closed cleanly.
        Once this returns, no :meth:`send` sends anything.
        """
        with self._sending:
            if not self.closed:
                self.closed, self.notice = True, notice

    def check_open(self) -> None:
        """Raise :class:`ServiceError` (the close's notice) if the link is closed."""
        if self.closed:
            raise ServiceError(f"service {self.name!r}: {self.notice or CLOSED_BY_OWNER}")

    def send(self, handle: Any, method: Callable[..., Any], /, *args: Any,
             **kwargs: Any) -> concurrent.futures.Future[Any]:
        """:func:`~msd_dask.dask_internals.call_actor` of ``method`` on ``handle``, unless the
        link is closed: then :class:`ServiceError` and nothing is sent (a reader's claim,
        its report of the steps it returned)."""
        with self._sending:  # not sent after close() returned: the roles may be released
            self.check_open()
            return call_actor(handle, method, *args, **kwargs)

    def refresh(self, max_age: float = 0.0, timeout: float | None = None) -> None:
        """Fetch the current constructor handles (they change when a role is re-created).

        If the planner does not answer, switch to the one the service re-created
        after losing it (published under the same name, a higher generation).
        With ``max_age``, none if one finished less than ``max_age`` seconds ago,
        and one at a time per process (the readers of a process whose claims wait
        share one call to the planner per interval; one that failed that recently
        raises its error again).  ``timeout``: the most the call waits, where the
        caller's own bound is shorter than the config's ``timeout`` (a reader's); with
        ``max_age``, a call that finds another look of the process going on waits for
        it that long, then returns (the handles as they are).

        Raises
        ------
        ServiceError
            The planner was lost and the process that started the service is gone,
            so nothing can re-create it.
        ServiceTimeoutError
            The planner did not answer, and no successor appeared, within the
            config's ``timeout`` (or ``timeout``).
        """
        wait = self.config.timeout if timeout is None else min(timeout, self.config.timeout)
        if not max_age:  # a lost role: look now (concurrently with the process's others)
            self._refresh(wait)
            self._refreshed_at = time.monotonic()
            return
        if not self._refreshing.acquire(timeout=wait):
            return  # (the look going on is not done: the caller's own deadline decides)
        try:
            now = time.monotonic()
            if now - self._refreshed_at < max_age:
                return
            failed_at, error, waited = self._failed
            # the look that just failed, not one more full wait per reader (unless this
            # caller may wait longer than that look could: a reader near its deadline)
            if error is not None and now - failed_at < max_age and wait <= waited:
                raise error
            try:
                self._refresh(wait)
            except Exception as e:
                self._failed = (time.monotonic(), e, wait)
                raise
            self._refreshed_at, self._failed = time.monotonic(), (0.0, None, 0.0)
        finally:
            self._refreshing.release()

    def _refresh(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        while True:
            self.check_open()  # a closed service's planner may be released already
            with self._swap:
                planner, gen = self.planner, self.generation
            try:  # short waits: a call to a lost actor may hang instead of failing
                if planner is None:  # (its handle did not come: lost with its worker?)
                    planner = self._fetch_planner(min(HANDLE_WAIT,
                                                      max(0.1, deadline - time.monotonic())))
                if planner is None:
                    raise ServiceError("the planner's handle could not be fetched from the "
                                       "scheduler (lost with its worker?)")
                left = max(0.1, deadline - time.monotonic())
                handles = planner.handles(False).result(timeout=min(5.0, left))
            except Exception as e:  # noqa: BLE001 - lost or busy: look for a successor
                # (each ask of the scheduler within what is left of the wait: with a lost
                # planner and a scheduler that did not answer, refresh(timeout=1) raised
                # after 11 s, saying 1; a review)
                if self.adopt_published(_ask(deadline)):
                    continue
                self.raise_if_lost(deadline, e, within=wait)
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                continue
            with self._swap:
                if gen == self.generation:
                    self.constructors = [bind_actor(h, self.client)
                                         for h in handles["constructors"]]
                    self.handles = (gen, self.constructors)
                    return

    def call(self, request: Callable[[Any], Any], what: str = "a request") -> Any:
        """``request(planner)``'s result (an actor call); once more on its successor if
        the planner was lost (not to the same planner: a request such as ``set_weights``
        must not run twice).  :class:`ServiceError` if the link is closed (nothing sent);
        :class:`ServiceTimeoutError` naming the request (``what``, as ``"set_weights()"``)
        if the planner, still the service's, did not answer within the config's
        ``timeout`` (the look for a successor within it too)."""
        self.check_open()
        generation = self.generation
        timeout = self.config.timeout
        deadline = time.monotonic() + timeout
        try:
            return request(self.planner).result(timeout=timeout)
        except (KeyError, ValueError, ServiceError, ServiceTimeoutError):
            raise  # (the planner's own answer: a ServiceTimeoutError of its own says what for)
        except Exception as e:  # noqa: BLE001 - lost or not answering: find the current one
            try:
                # (within what is left: the look waited a whole timeout more, and its error
                # named neither the request nor that it may still be carried out; a review)
                self.refresh(timeout=max(0.1, deadline - time.monotonic()))
            except ServiceTimeoutError as lost:
                raise ServiceTimeoutError(
                    f"service {self.name!r}: {what} got no answer within {timeout:.0f}s: "
                    f"{lost} (a change it asked for may still be made if the planner "
                    "answers later)") from e
            if self.generation == generation:  # the same planner: it answers, but not this
                if isinstance(e, TimeoutError):
                    raise ServiceTimeoutError(
                        f"service {self.name!r}: the planner did not answer {what} within "
                        f"{timeout:.0f}s (it answers other calls: a role it waited on may "
                        "be stuck on a busy or unreachable worker; a change it asked for "
                        "may still be made)") from e
                raise
            try:  # the planner that replaced the lost one, within what is left of the wait
                return request(self.planner).result(
                    timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError as again:
                raise ServiceTimeoutError(
                    f"service {self.name!r}: the planner of generation {self.generation}, "
                    f"re-created for the lost one, did not answer {what} within "
                    f"{timeout:.0f}s (a change it asked for may still be made)") from again

    def planner_lost(self, *, confirm: bool = False) -> bool:
        """Whether the current planner is lost with its worker.

        Without ``confirm``: whether Dask reports the planner's future lost (no
        call).  With ``confirm`` (the owner, before re-creating it): also when its
        worker is no longer among the scheduler's, but only while the scheduler
        answers (a lost scheduler cancels every future too, but then there is
        nothing to re-create the planner on).
        """
        fut = self.registry.get("planner")
        lost = fut is not None and fut.status in ("error", "lost", "cancelled")
        if not confirm:
            return lost
        if self.client.status != "running":
            return False
        try:
            workers = scheduler_workers(self.client, 5)
        except Exception:  # noqa: BLE001 - scheduler unreachable: nothing to do from here
            return False
        return lost or actor_address(self.planner) not in workers

    def scheduler_lost(self) -> str | None:
        """What to say where this process's Dask client is not connected to the scheduler;
        ``None`` while it is.  A lost scheduler cancels every future of the client, so the
        planner's looked lost with its worker, and readers and calls said so, naming a
        worker still alive (a review)."""
        status = getattr(self.client, "status", "running")  # (no client: nothing to lose)
        if status == "running":
            return None
        return (f"this process lost its connection to the scheduler at {self.scheduler_address} (its Dask "
                f"client is {status}); a scheduler lost takes the service's roles with it: "
                f"once it runs again, {RESTART_HINT}")

    def owner_alive(self, ask: float = ASK_WAIT) -> bool:
        """Whether the process that started the service is still connected (True if unknown,
        or the scheduler does not answer within ``ask`` seconds)."""
        if self.owner:
            return not self.closed
        cid = self.registry.get("owner")
        if cid is None:
            return True
        try:
            return bool(self.client.run_on_scheduler(has_client, cid, callback_timeout=ask))
        except Exception:  # noqa: BLE001 - unknown: assume it is
            return True

    def adopt_published(self, ask: float = ASK_WAIT) -> bool:
        """Switch to the published planner if it is a newer generation; returns whether it was
        (``False`` where the scheduler does not answer within ``ask`` seconds, or the new
        planner's handle does not come within them)."""
        try:
            reg = self.client.get_dataset(REGISTRY_PREFIX + self.name, default=None,
                                          callback_timeout=ask)
            if reg is not None and reg.get("failed"):
                self.failed = str(reg["failed"])
            if reg is None or int(reg.get("generation", 0)) <= self.generation:
                return False
            planner = bind_actor(reg["planner"].result(timeout=min(HANDLE_WAIT, ask)),
                                 self.client)
        except Exception:  # noqa: BLE001 - not there yet, or unreachable: try again later
            return False
        with self._swap:
            gen = int(reg.get("generation", 0))
            if gen <= self.generation:
                return False
            self.registry, self.planner, self.generation = reg, planner, gen
        _log.warning("msd_dask %s: switched to the re-created planner (generation %d)",
                     self.name, gen)
        return True

    def adopt(self, registry: dict[str, Any], planner: Any, constructors: list[Any]) -> None:
        """Switch to the planner the owner re-created (``registry``'s generation)."""
        gen = int(registry["generation"])
        with self._swap:
            self.registry, self.generation = registry, gen
            self.planner = bind_actor(planner, self.client)
            self.constructors = [bind_actor(h, self.client) for h in constructors]
            self.handles = (gen, self.constructors)

    def raise_if_lost(self, deadline: float | None = None, cause: BaseException | None = None,
                      *, within: float | None = None) -> None:
        """Raise if the planner is lost for good, or (past ``deadline``, ``within`` seconds
        of the look's start: the config's ``timeout`` if not given) did not answer."""
        within = self.config.timeout if within is None else within
        ask = ASK_WAIT if deadline is None else _ask(deadline)
        gone = self.scheduler_lost()
        if gone is not None:  # (not the planner's worker: said once the wait is over)
            if deadline is not None and time.monotonic() > deadline:
                raise ServiceTimeoutError(f"service {self.name!r}: {gone}") from cause
            return
        lost = self.planner_lost()
        where = actor_address(self.planner) or "?"
        if lost and self.failed is not None:  # its owner gave up re-creating it
            raise ServiceError(self.failed)
        if lost and not self.owner_alive(ask):
            if self._unpublished(ask):  # (its owner gone: closed at its exit, or stopped)
                notice = CLOSED_OR_STOPPED
                self.close(notice)  # this process's other readers call no role
                raise ServiceError(f"service {self.name!r}: {notice}")
            raise ServiceError(
                f"the planner of service {self.name!r} was lost with its worker {where}, and "
                f"the process that started the service is gone, so nothing can re-create it; "
                f"{RESTART_HINT}")
        if deadline is not None and time.monotonic() > deadline:
            if lost:
                raise ServiceTimeoutError(
                    f"the planner of service {self.name!r} was lost with its worker {where} "
                    f"and was not re-created within {round(within, 1):g}s; "
                    f"{RESTART_HINT}")
            raise ServiceTimeoutError(
                f"the planner of service {self.name!r} did not answer within "
                f"{round(within, 1):g}s (its worker may be lost): {cause!r}")

    def published_as_mine(self) -> bool:
        """Whether the service's registry is still the one this owner published (``True``
        if the scheduler does not answer): ``False`` once the service was stopped from
        elsewhere (``msd-dask stop`` while this process was out of reach) or another
        service took its name since."""
        try:
            reg = self._registry_now()
        except Exception:  # noqa: BLE001 - unknown: not known to be taken
            return True
        return reg is not None and reg.get("owner") == self.client.id

    def published_no_more(self) -> bool:
        """Whether the service's name no longer holds this service: closed by its owner,
        stopped, or another service started under the name since (another owner);
        ``False`` if the scheduler does not answer."""
        try:
            now = self._registry_now()
        except Exception:  # noqa: BLE001 - unknown: not known to be gone
            return False
        return now is None or now.get("owner") != self.registry.get("owner")

    def _unpublished(self, ask: float = ASK_WAIT) -> bool:
        """Whether the service's registry is gone: its owner closed it (one that crashed
        leaves it published); ``False`` if the scheduler does not answer within ``ask``."""
        try:
            return self._registry_now(ask) is None
        except Exception:  # noqa: BLE001 - unknown: not known to be closed
            return False

    def _registry_now(self, ask: float = ASK_WAIT) -> dict[str, Any] | None:
        """The registry the service's name holds on the scheduler now (None: none); raises
        where the scheduler does not answer within ``ask`` seconds."""
        return self.client.get_dataset(REGISTRY_PREFIX + self.name, default=None,
                                       callback_timeout=ask)

    # ------------------------------------------------------------- readers
    def on_new_generation(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (a bound method: held weakly) at each :meth:`announce_generation`."""
        with self._listeners_lock:
            self._listeners = [w for w in self._listeners if w() is not None]
            self._listeners.append(weakref.WeakMethod(listener))

    def announce_generation(self) -> None:
        """After the planner was re-created: every reader of this process tells the new
        constructors which steps it has.  All of them, not only the one that noticed:
        ranks read one after the other in one thread would otherwise wait for each other
        (a constructor holds at most ``prefetch`` steps a rank has not released)."""
        with self._listeners_lock:
            listeners = [w() for w in self._listeners]
        for listener in listeners:
            if listener is not None:
                listener()
