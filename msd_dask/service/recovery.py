"""The owner's side of a service: keep the planner's state, re-create a lost planner.

The process that started the service (``owner``) keeps the last state the
planner can resume from (:meth:`PlannerKeeper.keep_checkpoint`) and holds its
roles' keys (:meth:`PlannerKeeper.pin`).  When the planner's worker is lost it
closes the roles the lost planner leaves behind, starts a new planner (a new
*generation*) from that state and publishes it again under the same name
(:meth:`PlannerKeeper.recover`); readers follow through their
:class:`~msd_dask.service.link.PlannerLink` (docs/resume.md).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, NoReturn

from msd_dask.dask_internals import STATS_SHARED, actor_address, bound_actor, scheduler_workers
from msd_dask.errors import RESTART_HINT, ServiceError, ServiceTimeoutError
from msd_dask.service.link import PlannerLink
from msd_dask.service.placement import REGISTRY_PREFIX, ROLES_PREFIX, place_planner

__all__ = ["PlannerKeeper"]

_log = logging.getLogger("msd_dask.service")

#: seconds the owner waits for the planner's checkpoint
CHECKPOINT_WAIT = 10.0

#: planners lost in a row, each within :data:`SHORT_LIVED` seconds of its start and before it
#: planned past the furthest step planned before, after which the owner stops re-creating
#: them: something kills the workers the service's roles start on (a preprocess, decoder or
#: tokenizer that crashes its process on a document), and each re-creation takes it to
#: another worker
FUTILE_LIMIT = 5

#: seconds within which a re-created planner lost again counts towards :data:`FUTILE_LIMIT`
SHORT_LIVED = 120.0


#: seconds each worker's answer to :func:`close_roles_everywhere` is waited for
CLOSE_ROLES_WAIT = 30.0


def close_roles_everywhere(client: Any, name: str, sources: list[str],
                           timeout: float = CLOSE_ROLES_WAIT) -> dict[str, Any]:
    """Close every role of service ``name`` (of ``sources``' loaders) on every worker, by
    its key (:func:`~msd_dask.roles.supervisor.close_service_roles`): what a planner lost
    with its worker leaves behind.  Returns each worker's answer (an exception where one
    failed, or did not answer within ``timeout`` seconds).

    Each worker is asked on its own, all at once: asked together, one frozen worker made
    the whole look wait 60 s and fail naming none, the others' answers lost (a review).
    """
    from msd_dask.roles.supervisor import (
        close_service_roles,  # the owner only: readers never import roles
    )

    workers = sorted(scheduler_workers(client, timeout))

    def one(worker: str) -> Any:
        try:
            return client.run(close_service_roles, name, sources, workers=[worker],
                              on_error="return", callback_timeout=timeout)[worker]
        except Exception as e:  # noqa: BLE001 - said by the caller, naming the worker
            return e

    if not workers:
        return {}
    # (one deadline for all: a pool's queue made it a timeout per 32 frozen workers)
    deadline = time.monotonic() + timeout
    pool = concurrent.futures.ThreadPoolExecutor(min(len(workers), 32),
                                                 thread_name_prefix="msd-close")
    try:
        asked = {w: pool.submit(one, w) for w in workers}
        concurrent.futures.wait(asked.values(), timeout=max(0.0, deadline - time.monotonic()))
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    late = TimeoutError(f"did not answer within {timeout:g}s")
    unasked = TimeoutError(f"not asked within {timeout:g}s (32 workers at a time, and those "
                           "before it did not answer)")
    return {w: f.result() if f.done() and not f.cancelled() else unasked if f.cancelled()
            else late for w, f in asked.items()}


def unanswered_workers(answers: dict[str, Any]) -> list[str]:
    """The workers of :func:`close_roles_everywhere`'s ``answers`` that did not answer, or
    failed: their roles of the service may stay open until they go."""
    return sorted(w for w, a in answers.items() if isinstance(a, BaseException))


class PlannerKeeper:
    """Watches the planner of the service ``link`` reads from (owner only).

    Parameters
    ----------
    link : PlannerLink
        The owner's link; the keeper switches it to each re-created planner.
    recipe : dict
        What re-creating the planner needs: ``units``, ``roots``,
        ``loader_threads`` and the ``resume`` state the service started from.
    interval : float
        Seconds between two checks of the planner.
    """

    def __init__(self, link: PlannerLink, recipe: dict[str, Any], interval: float = 1.0):
        self.link = link
        self.recipe = recipe
        self.interval = interval
        #: the planner's last :meth:`PlannerActor.checkpoint`
        self.checkpoint: dict[str, Any] | None = None
        #: the roles' keys held from the dataset ``msd_roles/<name>`` (None: none yet)
        self.pinned: list[str] | None = None
        #: the highest planner generation this keeper published
        self._published = int(link.generation)
        #: the generations whose re-created planner failed to start (their roles closed)
        self._failed: set[int] = set()
        #: the worker the last re-created planner failed to start on (the next goes elsewhere)
        self._not_started_on: set[str] = set()
        #: held while a checkpoint is kept or the planner re-created
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        #: why the keeper stopped re-creating the planner (None: it has not)
        self.gave_up: str | None = None
        #: the service was stopped from elsewhere (or its name taken) while this process was
        #: out of reach: its owner's close leaves the name and the roles alone
        self.stopped_elsewhere = False
        #: planners lost in a row short-lived and without progress (:data:`FUTILE_LIMIT`)
        self._futile = 0
        #: files the short-lived planners waited for from their loaders, how often
        self._suspects: dict[str, int] = {}
        #: when the current generation started, the generation last counted as lost
        self._started = time.monotonic()
        self._counted = -1
        #: the furthest step any generation planned (by its checkpoints), before the
        #: current one started; whether the current one planned past it
        start = recipe.get("resume")  # (a service resumed from a state plans after its step)
        self._furthest = self._before = int(start.get("step", -1)) if isinstance(start, dict) else -1
        self._progressed = False
        #: the files the current generation last said it waits for
        self._reading: list[str] = []

    def start(self) -> None:
        """Keep a first checkpoint and watch the planner in a thread."""
        try:
            self.keep_checkpoint()
        except Exception as e:  # noqa: BLE001 - the watcher tries again
            _log.warning("msd_dask %s: no planner checkpoint yet: %r", self.link.name, e)
        self._watcher = threading.Thread(target=self._watch, daemon=True,
                                         name=f"msd-{self.link.name}-watch")
        self._watcher.start()

    def stop(self, timeout: float) -> None:
        """Stop watching (waits up to ``timeout`` seconds for a recovery under way)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout)

    def keep_checkpoint(self, stats_age: float = 0.0) -> None:
        """Keep the planner's last checkpoint, and hold the keys of the roles it names.

        A checkpoint of the step and weights version already kept, from the same planner
        generation, comes without its state (``have`` of
        :meth:`msd_dask.roles.planner.PlannerActor.checkpoint`): the kept state
        stays.

        Parameters
        ----------
        stats_age : float
            The checkpoint may take the constructors' answers from a round of asks up
            to this many seconds old (the watcher's, once a second, shares the plugin's
            round); ``0``: it asks them.
        """
        with self._lock:
            generation = self.link.generation
            last = self.checkpoint
            have = version = None
            if last is not None and last.get("generation") == generation:
                have, version = last["step"], last.get("version")
            try:
                ck = dict(self.link.planner.checkpoint(have=have, have_version=version,
                                                       stats_age=stats_age)
                          .result(timeout=CHECKPOINT_WAIT))
            except TimeoutError:
                raise ServiceTimeoutError(
                    f"service {self.link.name!r}: the planner did not send its checkpoint "
                    f"within {CHECKPOINT_WAIT:.0f}s (it answers between steps: a step that "
                    "takes longer to plan delays it)") from None
            if ck["state"] is None and last is not None:
                ck["state"] = last["state"]
            ck["generation"] = generation
            self.checkpoint = ck
            self._note_progress(ck)
            self.pin(ck.get("keys", []))

    def _note_progress(self, ck: dict[str, Any]) -> None:
        """Take in what the current generation's checkpoint ``ck`` says it planned and reads."""
        planned = int(ck.get("planned", -1)) - 1  # (its last planned step)
        if planned > self._before:
            self._progressed = True
        self._furthest = max(self._furthest, planned)
        self._reading = list(ck.get("reading", []))

    def _generation_started(self) -> None:
        """A re-created planner started: its progress is counted from here."""
        self._started, self._before, self._progressed = time.monotonic(), self._furthest, False
        self._reading = []

    def _count_loss(self) -> None:
        """Count the current generation lost (once, whatever the tries to re-create it): a
        short-lived one that planned nothing past what the ones before it planned adds to
        :attr:`_futile`, any other starts the count again."""
        generation = self.link.generation
        if generation == self._counted:
            return
        self._counted = generation
        short = time.monotonic() - self._started < SHORT_LIVED
        if short and not self._progressed:
            self._futile += 1
            for where in dict.fromkeys(self._reading + self._lost_reading(generation)):
                self._suspects[where] = self._suspects.get(where, 0) + 1
        else:
            self._futile, self._suspects = 0, {}

    def _lost_reading(self, generation: int) -> list[str]:
        """The files generation ``generation``'s lost loaders were reading, as its planner
        left them on the scheduler (:func:`~msd_dask.roles.keys.lost_reading_key`)."""
        from msd_dask.roles.keys import lost_reading_key  # (the owner only)

        client = self.link.client
        try:  # (Client.get_metadata, with a timeout)
            left = client.sync(client.scheduler.get_metadata, callback_timeout=5,
                               keys=lost_reading_key(self.link.name), default=None)
        except Exception:  # noqa: BLE001 - a hint for an error message
            return []
        if not isinstance(left, dict) or left.get("generation") != generation:
            return []
        return [str(f) for f in left.get("files", [])]

    def _give_up(self) -> None:
        """Stop re-creating the planner, and say why to every reader (published with the
        registry: a reader of the service raises it, see
        :meth:`~msd_dask.service.link.PlannerLink.raise_if_lost`)."""
        link = self.link
        lost: dict[str, int] = {}  # the roles lost meanwhile, by name
        for e in (self.checkpoint or {}).get("events", []):
            if e.get("why") == "lost" and e.get("role") != "planner":
                what = f"{e.get('role')} {e.get('name')}"
                lost[what] = lost.get(what, 0) + 1
        suspects = sorted(self._suspects, key=lambda w: -self._suspects[w])[:6]
        self.gave_up = (
            f"service {link.name!r}: its planner was lost with its worker {self._futile} times "
            f"in a row, each within {SHORT_LIVED:g}s of its start and before it planned "
            + ("a step" if self._furthest < 0 else f"past step {self._furthest}")
            + ": something kills the workers the service's roles start "
            "on, and re-creating them takes it to other workers; the owner stopped "
            "re-creating the planner. A preprocess, decoder or tokenizer that crashes its "
            "process on a document (a segfault, os._exit, running out of memory) does this: "
            "the workers' logs say how they exited"
            + (f"; its lost loaders were reading (most often first) {', '.join(suspects)}"
               if suspects else "")
            + (f"; the roles lost with their workers: "
               f"{', '.join(f'{w} ({n}x)' for w, n in lost.items())}" if lost else "")
            + f". Once the cause is fixed, {RESTART_HINT}")
        _log.error("msd_dask %s", self.gave_up)
        link.failed = self.gave_up
        try:
            registry = dict(link.registry, failed=self.gave_up)
            link.client.publish_dataset(registry, name=REGISTRY_PREFIX + link.name,
                                        override=True, callback_timeout=link.config.timeout)
        except Exception as e:  # noqa: BLE001 - this process's readers know it all the same
            _log.warning("msd_dask %s: could not tell the readers why the planner is not "
                         "re-created: %r", link.name, e)

    def pin(self, keys: list[str]) -> None:
        """Hold the roles' keys from a published dataset.

        Only the planner's own client asks Dask for its roles' keys, so when the
        planner's worker dies Dask forgets every role at once: removed from their
        workers' actors, still running, and out of reach.  Held here, they stay
        reachable until :meth:`recover` has closed them.
        """
        from distributed import Future

        keys = sorted(keys)
        if keys == self.pinned:
            return
        client = self.link.client
        futures: list[Any] = [Future(k, client) for k in keys]
        client.publish_dataset(futures, name=ROLES_PREFIX + self.link.name, override=True,
                               callback_timeout=10)
        self.pinned = keys

    def _watch(self) -> None:
        """Keep the planner's last checkpoint; re-create the planner if it is lost."""
        said = None  # the failure logged last (a failure that stays is logged once)
        while not self._stop.wait(self.interval):
            if self.gave_up is not None:
                return
            try:
                if self.planner_lost():
                    self.recover()
                else:
                    self.keep_checkpoint(stats_age=STATS_SHARED)
                said = None
            except Exception as e:  # noqa: BLE001 - logged; the next round tries again
                if self._stop.is_set():
                    return
                if repr(e) != said:
                    said = repr(e)
                    _log.warning("msd_dask %s: watching the planner: %s (said once while it "
                                 "lasts)", self.link.name, said)

    def planner_lost(self) -> bool:
        """Whether the link's planner is to be re-created: lost with its worker, or one
        whose start failed (it answers, its roles closed): a reader of this process may
        have switched the link to it, published until the failure."""
        return (self.link.generation in self._failed
                or self.link.planner_lost(confirm=True))

    def recover(self) -> None:
        """Re-create the lost planner from the last checkpoint."""
        link = self.link
        with self._lock:
            if not link.published_as_mine():
                # stopped from elsewhere while this process was out of reach (msd-dask stop
                # saw it gone), perhaps started again by another: re-created, it would take
                # the name back
                _log.warning("msd_dask %s: the service was stopped from elsewhere (or its name "
                             "taken) while this process was out of reach: not re-creating "
                             "its planner; this process no longer serves it", link.name)
                # (said to whoever watches the link: msd-dask serve watched on, warning that
                # a live worker's planner was lost, for ever; a review)
                link.failed = (f"service {link.name!r} was stopped from elsewhere (msd-dask "
                               "stop), or its name taken, while this process was out of "
                               "reach: this process no longer serves it")
                self.stopped_elsewhere = True
                self._stop.set()
                return
            self._count_loss()
            if self._futile >= FUTILE_LIMIT:
                self._give_up()
                return
            # without a checkpoint (lost before the first one), from where this service
            # started: readers skip what they have, the plans are the same
            resume = self.recipe.get("resume")
            ck = self.checkpoint or {"state": resume, "had": {}, "recovered": {},
                                     "events": [],
                                     "step": (resume or {}).get("step", "-1 (the start)")}
            t0 = time.monotonic()
            _log.warning("msd_dask %s: the planner on %s was lost; re-creating it from the "
                         "state after step %s", link.name, actor_address(link.planner),
                         ck["step"])
            closed, had = self._close_lost_roles(ck)
            old = link.registry
            registry = place_planner(
                link.client, link.config, self.recipe["units"], self.recipe["roots"],
                ck["state"], self.recipe["loader_threads"], constructors=old.get("constructors"),
                # (above any generation published: an attempt that failed after publishing
                # took its number, and processes that adopted it switch only to a higher one)
                generation=max(link.generation, self._published) + 1, had=had,
                lost={"from": actor_address(link.planner), "recovered": ck["recovered"],
                      "events": ck["events"], "loaders": ck.get("loaders", {}),
                      "counted": ck.get("counted", {})},
                avoid=self._not_started_on)
            registry["quarantined"] = old.get("quarantined", {})
            registry["owner"] = link.client.id
            try:
                self._start_generation(registry)
            except BaseException:
                # the next attempt goes to another worker while one runs (a running worker
                # whose threads are all busy took every retry; a review)
                self._not_started_on = {registry["planner_worker"]}
                raise
            self._not_started_on = set()
            self._generation_started()
            old["planner"].release()
            link.announce_generation()
            _log.warning("msd_dask %s: planner re-created (generation %d) in %.1fs; closed "
                         "the old roles: %s", link.name, link.generation,
                         time.monotonic() - t0, closed)
            self.keep_checkpoint()

    def _close_lost_roles(self, ck: dict[str, Any]) -> tuple[dict[str, Any], dict[int, int]]:
        """Close the roles the lost planner leaves behind (they stop publishing and free
        their memory); returns what each worker answered and the last step each rank
        showed it has (from the checkpoint and the closed constructors): not the last
        step handed to it, whose answer may not have reached it (the new constructors
        would then never send it the steps re-planned up to there)."""
        closed = close_roles_everywhere(self.link.client, self.link.name,
                                        [s.name for s in self.link.config.sources])
        had = {int(r): int(s) for r, s in ck["had"].items()}
        for res in closed.values():
            if isinstance(res, dict):
                for r, st in res["shown"].items():
                    had[int(r)] = max(had.get(int(r), -1), int(st))
        return closed, had

    def _start_generation(self, registry: dict[str, Any]) -> None:
        """Set up the new planner of ``registry``, publish it and switch the link to it.

        If it fails, the registry and the link are the lost planner's again
        (:meth:`_fall_back`): the next watch round re-creates it.
        """
        link = self.link
        client, cfg = link.client, link.config
        was: tuple[Any, ...] | None = None  # the link before the publish (the lost planner)
        try:  # (a worker that left first fails this attempt at once: the next places again)
            planner = bound_actor(client, registry["planner"], registry["planner_worker"],
                                  cfg.name, "the re-created planner", cfg.timeout)
        except BaseException as e:
            registry["planner"].release()
            # (the watcher logged Dask's bare TimeoutError, naming neither the role nor the
            # worker; a review)
            self._raise_timed_out(registry, f"start on {registry['planner_worker']}", e)
        doing = "set up its roles"  # (what a timeout names)
        try:
            planner.setup().result(timeout=cfg.timeout)
            if self._stop.is_set():  # closed meanwhile (its close waited for this no longer)
                raise ServiceError(f"msd_dask {cfg.name}: closed while its planner was "
                                   "re-created: the new one is not published")
            doing = "publish its registry on the scheduler"
            # (a publish that timed out may still be done: from here, a failure falls back)
            was = (link.registry, link.planner, link.constructors)
            client.publish_dataset(registry, name=REGISTRY_PREFIX + self.link.name,
                                   override=True, callback_timeout=cfg.timeout)
            self._published = max(self._published, int(registry["generation"]))
            doing = "hand over its constructors' handles"
            handles = planner.handles(False).result(timeout=cfg.timeout)
            self.link.adopt(registry, planner, handles["constructors"])
            doing = "start planning"
            planner.start().result(timeout=cfg.timeout)
        except BaseException as e:  # this attempt's planner goes; a retry publishes a higher one
            try:
                planner.close_roles().result(timeout=30)
            except Exception:  # noqa: BLE001 - best effort: its worker may be the trouble
                pass
            finally:
                registry["planner"].release()
            if was is not None:
                self._failed.add(int(registry["generation"]))
                self._fall_back(was)
            self._raise_timed_out(registry, doing, e)

    def _raise_timed_out(self, registry: dict[str, Any], doing: str, e: BaseException) -> NoReturn:
        """Raise ``e`` as a re-created planner's attempt raises it (from the handler that
        caught it): a timeout of Dask's (which says only 'timed out after 300 s.') as a
        :class:`ServiceTimeoutError` naming the role, its generation and what it did not do
        in time; any other error as it is (not as its own cause, which ``raise e from e``
        made it)."""
        if isinstance(e, TimeoutError) and not isinstance(e, ServiceTimeoutError):
            cfg = self.link.config
            raise ServiceTimeoutError(
                f"msd_dask {cfg.name}: the re-created planner (generation "
                f"{registry['generation']}) did not {doing} within {cfg.timeout:g}s (the "
                "config's timeout)") from e
        raise e

    def _fall_back(self, was: tuple[Any, ...]) -> None:
        """Publish the lost planner's registry again and switch the link back to it, after
        a re-created planner failed once its own registry may be published (``was``: the
        link's ``registry``, ``planner`` and ``constructors`` before).  The failed planner
        answers, its roles closed: left on it, the link would not find it lost, and
        nothing would re-create it.  Readers elsewhere that switched to it switch again to
        the next one, published with a higher generation."""
        link, cfg = self.link, self.link.config
        if not self._stop.is_set():  # (a close unpublishes the service)
            try:  # (first: a look at the published registry switches to it no more)
                link.client.publish_dataset(was[0], name=REGISTRY_PREFIX + link.name,
                                            override=True, callback_timeout=cfg.timeout)
            except Exception as e:  # noqa: BLE001 - said; the link goes back all the same
                _log.warning("msd_dask %s: could not publish the lost planner's registry "
                             "again after its re-creation failed (waited up to %gs, the "
                             "config's timeout): %r", link.name, cfg.timeout, e)
        registry, planner, constructors = was
        # (a reader's look may switch it to the failed one again meanwhile: the watcher
        # still re-creates it, see planner_lost)
        if link.generation in self._failed and planner is not None:
            link.adopt(registry, planner, constructors)
