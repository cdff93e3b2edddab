"""A process's readers share their looks for re-created roles (PlannerLink.refresh(max_age)):
thousands of ranks whose claims wait must not each call the planner every 2 s."""

from __future__ import annotations

import threading
import time
from typing import Any

from msd_dask.core.config import parse_config
from msd_dask.errors import ServiceTimeoutError
from msd_dask.service.link import PlannerLink


class _Done:
    def __init__(self, value: Any, delay: float = 0.0):
        self.value, self.delay = value, delay

    def result(self, timeout: float | None = None) -> Any:
        time.sleep(self.delay)
        return self.value


class _Planner:
    """Answers ``handles`` after ``delay`` seconds and counts the calls."""

    def __init__(self, delay: float):
        self.calls = 0
        self.delay = delay
        self.lock = threading.Lock()

    def handles(self, _with_loaders: bool) -> _Done:
        with self.lock:
            self.calls += 1
        return _Done({"constructors": ["c0", "c1"]}, self.delay)


def _link(planner: _Planner) -> PlannerLink:
    cfg = parse_config({"name": "link", "batch": {"seq_len": 64}, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    return PlannerLink(None, cfg, {"planner": _Done(planner)})


def test_readers_of_a_process_share_one_look_per_interval() -> None:
    planner = _Planner(delay=0.2)
    link = _link(planner)
    threads = [threading.Thread(target=link.refresh, kwargs={"max_age": 2.0}) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert planner.calls == 1
    assert link.constructors == ["c0", "c1"]
    link.refresh(max_age=2.0)
    assert planner.calls == 1     # still fresh
    link.refresh()                # a forced look (a lost role) always calls
    assert planner.calls == 2


def test_a_stale_look_is_renewed() -> None:
    planner = _Planner(delay=0.0)
    link = _link(planner)
    link.refresh(max_age=0.2)
    time.sleep(0.3)
    link.refresh(max_age=0.2)
    assert planner.calls == 2


class _Failing(_Planner):
    def handles(self, _with_loaders: bool) -> _Done:
        with self.lock:
            self.calls += 1
        raise OSError("the planner's worker is unreachable")


class _Link(PlannerLink):
    """No published successor; a look that fails gives up at once (no scheduler here)."""

    def adopt_published(self, ask: float = 5.0) -> bool:
        return False

    def raise_if_lost(self, deadline: float | None = None, cause: BaseException | None = None,
                      **_kw: Any) -> None:
        time.sleep(0.3)  # the wait a real look spends before it gives up
        raise ServiceTimeoutError(f"the planner did not answer ({cause!r})")


def test_a_failed_look_is_not_repeated_by_every_waiting_reader() -> None:
    """Readers queued behind a look that fails get its error, not one more wait each."""
    planner = _Failing(delay=0.0)
    link = _Link(None, _link(planner).config, {"planner": _Done(planner)})
    errors: list[BaseException] = []

    def look() -> None:
        try:
            link.refresh(max_age=2.0)
        except ServiceTimeoutError as e:
            errors.append(e)

    threads = [threading.Thread(target=look) for _ in range(8)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(errors) == 8 and planner.calls == 1
    assert time.monotonic() - t0 < 2.0   # one failing look, not eight in a row


class _Slow(_Planner):
    """Answers ``handles`` at once; its ``set_weights`` never answers (counted)."""

    def __init__(self) -> None:
        super().__init__(delay=0.0)
        self.sets = 0

    def set_weights(self, weights: dict[str, float]) -> Any:
        with self.lock:
            self.sets += 1

        class _Never:
            def result(self, timeout: float | None = None) -> Any:
                time.sleep(min(timeout or 0.0, 0.2))
                raise TimeoutError(f"timed out after {timeout} s.")

        return _Never()


def test_a_call_the_same_planner_does_not_answer_is_sent_once() -> None:
    """The planner answers other calls but not this one: the request is not sent again
    (``set_weights`` must not run twice) and the error names the service (a review found
    it sent twice, then a bare ``TimeoutError('timed out after 5 s.')``)."""
    import pytest

    planner = _Slow()
    link = _link(planner)
    with pytest.raises(ServiceTimeoutError, match=r"service 'link': the planner did not answer "
                       r"set_weights\(\) within 300s .* a change it asked for may still be made"):
        link.call(lambda p: p.set_weights({"a": 1.0}), "set_weights()")
    assert planner.sets == 1 and link.generation == 0


def test_a_timeout_the_planner_answers_is_its_own_message() -> None:
    """The planner answered with a timeout of its own (a loader of a scale that did not
    answer): it was taken for the planner not answering, looked for again, and re-raised
    as "the planner did not answer within 300s" (a review of the handle)."""
    import pytest

    class _Busy(_Planner):
        def scale(self, source: str, n: int) -> Any:
            class _Raises:
                def result(self, timeout: float | None = None) -> Any:
                    raise ServiceTimeoutError("loader 1 of source 'a' did not take its units "
                                              "within 300s")
            return _Raises()

    planner = _Busy(delay=0.0)
    link = _link(planner)
    with pytest.raises(ServiceTimeoutError, match="^loader 1 of source 'a' did not take"):
        link.call(lambda p: p.scale("a", 2))
    assert planner.calls == 0  # not looked for again: it answered


class _SlowCheckpoint:
    """A planner whose checkpoint does not come within the owner's wait."""

    def checkpoint(self, **_kw: Any) -> Any:
        class _Late:
            def result(self, timeout: float | None = None) -> Any:
                raise TimeoutError(f"timed out after {timeout} s.")
        return _Late()


def test_a_checkpoint_that_does_not_come_is_a_timeout_naming_it() -> None:
    """``retire_workers`` keeps the planner's checkpoint after moving the roles; a planner
    slow to send it gave a bare ``TimeoutError('timed out after 10 s.')`` (review)."""
    import types

    import pytest

    from msd_dask.service.recovery import PlannerKeeper

    link = types.SimpleNamespace(name="rct", generation=0, planner=_SlowCheckpoint())
    keeper = PlannerKeeper(link, {})  # type: ignore[arg-type]
    with pytest.raises(ServiceTimeoutError,
                       match=r"service 'rct': the planner did not send its checkpoint within 10s"):
        keeper.keep_checkpoint()


class _LostPlanner(_Planner):
    """A planner whose worker is gone: a call to it fails."""

    def set_weights(self, weights: dict[str, float]) -> Any:
        raise OSError("Timed out trying to connect to tcp://198.18.0.9:4321")


def test_a_re_created_planner_that_does_not_answer_is_named() -> None:
    """The request sent once more, to the planner that replaced a lost one, ended in a bare
    ``TimeoutError`` when that one did not answer (an audit of the waits)."""
    import pytest

    link = _link(_LostPlanner(delay=0.0))
    successor = _Slow()

    def refresh(max_age: float = 0.0, timeout: float | None = None) -> None:  # (finds the
        link.planner, link.generation = successor, 1                        # re-created one)

    link.refresh = refresh  # type: ignore[method-assign]
    with pytest.raises(ServiceTimeoutError, match=r"the planner of generation 1, re-created for "
                       r"the lost one, did not answer set_weights\(\) within 300s"):
        link.call(lambda p: p.set_weights({"a": 1.0}), "set_weights()")
    assert successor.sets == 1


class _Frozen(_Planner):
    """A planner whose worker is frozen: no call of it answers."""

    def handles(self, _with_loaders: bool) -> Any:
        return _LostFuture()

    def set_weights(self, weights: dict[str, float]) -> Any:
        return _LostFuture()


def test_a_call_to_a_frozen_planner_ends_within_the_timeout_naming_the_request() -> None:
    """The planner's worker frozen: ``stats()`` and ``set_weights()`` waited the config's
    timeout for the answer, then as long again looking for a successor, and said only that
    'the planner did not answer' (the weights were changed once the worker resumed; a
    review).  One wait of ``timeout`` for both, and the error names the request."""
    import pytest

    cfg = parse_config({"name": "link", "batch": {"seq_len": 64}, "timeout": 1, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    published = _Done(_Frozen(delay=0.0))
    published.status = "finished"  # type: ignore[attr-defined]  # (its future: not lost)
    link = PlannerLink(None, cfg, {"planner": published})
    link.adopt_published = lambda ask=5.0: False  # type: ignore[method-assign]  # (no scheduler)
    t0 = time.monotonic()
    with pytest.raises(ServiceTimeoutError, match=r"service 'link': set_weights\(\) got no answer "
                       r"within 1s: .*\(a change it asked for may still be made"):
        link.call(lambda p: p.set_weights({"a": 1.0}), "set_weights()")
    assert time.monotonic() - t0 < 2.0


class _LostFuture:
    """The published planner's future once its worker is gone: its result never comes."""

    status = "lost"

    def result(self, timeout: float | None = None) -> Any:
        raise TimeoutError(f"timed out after {timeout} s.")


def test_a_link_to_a_planner_whose_handle_never_came_says_so() -> None:
    """A link made while the planner was lost waited the config's timeout (300 s) for its
    handle, then refresh quoted ``AttributeError: 'NoneType' object has no attribute
    'handles'`` (an audit of the waits).  The handle is waited for 5 s, and the error says
    what was lost."""
    import pytest

    cfg = parse_config({"name": "link", "batch": {"seq_len": 64}, "timeout": 1, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    t0 = time.monotonic()
    link = PlannerLink(None, cfg, {"planner": _LostFuture()})
    assert link.planner is None
    with pytest.raises(ServiceTimeoutError) as info:
        link.refresh()
    assert time.monotonic() - t0 < 10
    assert "was lost with its worker" in str(info.value), info.value
    assert "AttributeError" not in repr(info.value.__cause__ or info.value), info.value


def test_a_re_created_planner_that_does_not_set_up_is_named(monkeypatch: Any) -> None:
    """Re-creating a lost planner let Dask's bare ``TimeoutError`` out of each step (its
    setup, publishing, its handles, its start): the owner's log said 'timed out after
    300 s.' and nothing of what (an audit of the waits)."""
    import types

    import pytest

    from msd_dask.service import recovery

    class _Released:
        released = False

        def release(self) -> None:
            self.released = True

    class _Stuck:
        def setup(self) -> Any:
            class _Never:
                def result(self, timeout: float | None = None) -> Any:
                    raise TimeoutError(f"timed out after {timeout} s.")
            return _Never()

        def close_roles(self) -> Any:
            return _Done(None)

    cfg = parse_config({"name": "rct", "batch": {"seq_len": 64}, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    link = types.SimpleNamespace(name="rct", generation=0, client=None, config=cfg)
    keeper = recovery.PlannerKeeper(link, {})  # type: ignore[arg-type]
    monkeypatch.setattr(recovery, "bound_actor", lambda *a, **k: _Stuck())
    future = _Released()
    with pytest.raises(ServiceTimeoutError, match=r"msd_dask rct: the re-created planner "
                       r"\(generation 1\) did not set up its roles within 300s"):
        keeper._start_generation({"planner": future, "planner_worker": "tcp://w:1",
                                  "generation": 1})
    assert future.released  # (this attempt's planner goes)


class _Published(_Done):
    """The published planner's future, its worker alive (``status`` as Dask's)."""

    status = "finished"


def _published(planner: _Planner) -> PlannerLink:
    """A link to ``planner``, published and alive (its looks go the whole way)."""
    return PlannerLink(None, _link(planner).config, {"planner": _Published(planner)})


def test_a_look_going_on_is_waited_for_the_callers_timeout_only() -> None:
    """A reader whose claim waits finds another reader of its process looking for the
    roles (a slow planner): it waits for that look its own timeout at most, then goes on
    with the handles as they are (its own deadline then decides)."""
    planner = _Planner(delay=2.0)
    link = _link(planner)
    first = threading.Thread(target=link.refresh, kwargs={"max_age": 2.0})
    first.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    link.refresh(max_age=2.0, timeout=0.3)
    waited = time.monotonic() - t0
    first.join(10)
    assert 0.25 <= waited < 1.5, waited
    assert planner.calls == 1 and link.constructors == ["c0", "c1"]


def test_a_short_look_that_failed_is_not_every_readers_answer() -> None:
    """A look cut short by one reader near its deadline fails within that reader's time;
    readers that may wait longer look for themselves (they got 'did not answer within
    0.1s' for the next 2 s: review), those that may not get its error at once."""
    import pytest

    planner = _Failing(delay=0.0)
    link = _published(planner)
    with pytest.raises(ServiceTimeoutError, match=r"within 0.3s"):
        link.refresh(max_age=2.0, timeout=0.3)
    calls = planner.calls
    with pytest.raises(ServiceTimeoutError, match=r"within 0.3s"):
        link.refresh(max_age=2.0, timeout=0.2)  # no longer than that look: its error
    assert planner.calls == calls
    with pytest.raises(ServiceTimeoutError, match=r"within 0.6s"):
        link.refresh(max_age=2.0, timeout=0.6)  # longer: a look of its own
    assert planner.calls > calls


class _Hung(_Planner):
    """A planner whose ``handles`` call never answers: its result waits its whole timeout."""

    def handles(self, _with_loaders: bool) -> Any:
        with self.lock:
            self.calls += 1

        class _Never:
            def result(self, timeout: float | None = None) -> Any:
                time.sleep(timeout or 0.0)
                raise TimeoutError(f"timed out after {timeout} s.")

        return _Never()


def test_a_look_waits_the_callers_timeout_not_the_configs() -> None:
    """A reader's timeout shorter than the config's (300 s here) bounds its look for the
    roles: a planner that does not answer was waited for the config's timeout, whatever
    the reader had asked (an audit of the waits); and each call to the planner inside a
    look waited 5 s whatever the caller's time (a hung planner: review)."""
    import pytest

    for planner in (_Failing(delay=0.0), _Hung(delay=0.0)):
        link = _published(planner)
        t0 = time.monotonic()
        with pytest.raises(ServiceTimeoutError, match=r"did not answer within 0.5s"):
            link.refresh(timeout=0.5)
        assert time.monotonic() - t0 < 2.0
        assert planner.calls >= 1
    # a reader's remaining time is any float: said to a tenth of a second
    with pytest.raises(ServiceTimeoutError, match=r"did not answer within 0.5s \(its worker"):
        link.refresh(timeout=0.54321)


class _Datasets:
    """A client whose scheduler holds ``registry`` under the service's name (None: none)."""

    def __init__(self, registry: Any, cid: str = "owner-1"):
        self.registry, self.id = registry, cid

    def get_dataset(self, name: str, default: Any = None, callback_timeout: Any = None) -> Any:
        return default if self.registry is None else self.registry


def test_a_service_stopped_elsewhere_is_not_re_created_by_its_owner(monkeypatch: Any) -> None:
    """``msd-dask stop`` checks the owner is gone; an owner only out of reach a while (a
    partition) came back, found its planner cancelled and re-created it, taking the name
    back from whoever started it since (review).  Its keeper now re-creates only a
    service whose registry is still its own."""
    import types

    from msd_dask.service import recovery

    placed: list[Any] = []
    monkeypatch.setattr(recovery, "place_planner", lambda *a, **k: placed.append(a))
    for registry in (None, {"owner": "someone-else"}):
        link = _link(_Planner(0.0))
        link.client = _Datasets(registry)  # type: ignore[assignment]
        keeper = recovery.PlannerKeeper(link, {})
        keeper._close_lost_roles = types.MethodType(  # type: ignore[method-assign]
            lambda self, ck: ({}, {}), keeper)
        keeper.recover()
        assert placed == [] and keeper._stop.is_set()
    # its own registry still published: it goes on to re-create the planner
    link = _link(_Planner(0.0))
    link.client = _Datasets({"owner": "owner-1"})  # type: ignore[assignment]
    keeper = recovery.PlannerKeeper(link, {"units": {}, "roots": {}, "loader_threads": 1})
    keeper._close_lost_roles = types.MethodType(  # type: ignore[method-assign]
        lambda self, ck: ({}, {}), keeper)
    monkeypatch.setattr(recovery, "place_planner", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("placing")))
    import pytest

    with pytest.raises(RuntimeError, match="placing"):
        keeper.recover()


class _Owner:
    """The owner's client: a scheduler with ``workers`` holding the published datasets."""

    id, status = "owner-1", "running"

    def __init__(self, workers: list[str]):
        import types

        self.workers = workers
        self.datasets: dict[str, Any] = {}
        self.scheduler = types.SimpleNamespace(ncores=None, ncores_running=None)

    def sync(self, rpc: Any, callback_timeout: Any = None) -> dict[str, int]:
        return {w: 1 for w in self.workers}  # (the scheduler's ``ncores``)

    def publish_dataset(self, data: Any, name: str, override: bool = False,
                        callback_timeout: Any = None) -> None:
        self.datasets[name] = data

    def get_dataset(self, name: str, default: Any = None, callback_timeout: Any = None) -> Any:
        return self.datasets.get(name, default)


class _Generation:
    """A planner's actor handle, bound to ``client``, on the worker ``address``."""

    def __init__(self, client: Any, address: str, starts: bool = True):
        self._client, self._address = client, address
        self.starts, self.closed = starts, False

    def setup(self) -> _Done:
        return _Done(None)

    def handles(self, _with_loaders: bool) -> _Done:
        return _Done({"constructors": []})

    def start(self) -> Any:
        if self.starts:
            return _Done(None)
        return _LostFuture()  # (its start is not answered in time)

    def close_roles(self) -> _Done:
        self.closed = True
        return _Done(None)

    def checkpoint(self, **_: Any) -> _Done:
        return _Done({"state": None, "had": {}, "recovered": {}, "events": [], "step": 5})


class _Key(_Published):
    """A registry's planner future, its handle's key held (``release``: let go)."""

    def release(self) -> None:
        pass


def test_a_re_created_planner_that_does_not_start_is_re_created_again(monkeypatch: Any) -> None:
    """A re-created planner whose start failed had its roles closed, but the owner's link
    and the published registry stayed on it: it answers, its worker alive, so the watcher
    kept its checkpoint and never re-created it (review).  The lost planner's registry is
    published again and the link goes back to it; the next round re-creates it."""
    import pytest

    from msd_dask.service import recovery
    from msd_dask.service.placement import REGISTRY_PREFIX

    cfg = parse_config({"name": "rct", "batch": {"seq_len": 64}, "timeout": 1, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    client = _Owner(["tcp://w:2"])
    lost = _Generation(client, "tcp://w:1")  # (its worker is gone)
    was = {"planner": _Key(lost), "generation": 0, "owner": client.id, "constructors": 1}
    client.datasets[REGISTRY_PREFIX + "rct"] = was
    link = PlannerLink(client, cfg, was, owner=True)
    keeper = recovery.PlannerKeeper(link, {"units": {}, "roots": {}, "loader_threads": 1})
    planners = [_Generation(client, "tcp://w:2", starts=False), _Generation(client, "tcp://w:2")]
    monkeypatch.setattr(recovery, "close_roles_everywhere", lambda *a: {})
    monkeypatch.setattr(recovery, "place_planner", lambda *a, generation, **k: {
        "planner": _Key(planners.pop(0)), "planner_worker": "tcp://w:2", "constructors": 1,
        "generation": generation})
    monkeypatch.setattr(recovery, "bound_actor", lambda client, future, *a: future.result())
    assert keeper.planner_lost()
    failed = planners[0]
    with pytest.raises(ServiceTimeoutError, match=r"generation 1\) did not start planning"):
        keeper.recover()
    assert failed.closed
    assert link.generation == 0 and link.planner is lost and client.datasets[REGISTRY_PREFIX + "rct"] is was
    assert keeper.planner_lost()  # (the next watch round re-creates it)
    # a reader's look that switched the link to the failed one before it went back
    link.adopt({"planner": _Key(failed), "generation": 1, "owner": client.id}, failed, [])
    assert keeper.planner_lost()
    keeper.recover()
    assert link.generation == 2 and client.datasets[REGISTRY_PREFIX + "rct"]["generation"] == 2
    assert not keeper.planner_lost()


def test_a_re_created_planner_that_does_not_start_is_tried_on_another_worker(
        monkeypatch: Any) -> None:
    """A re-created planner that did not start on its worker (running, every thread busy)
    was logged as Dask's bare TimeoutError, and every retry went to the same worker (a
    review).  The error names the role and the worker; the next attempt goes elsewhere."""
    import pytest

    from msd_dask.service import recovery
    from msd_dask.service.placement import REGISTRY_PREFIX

    cfg = parse_config({"name": "rct", "batch": {"seq_len": 64}, "timeout": 1, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    client = _Owner(["tcp://w:1", "tcp://w:2"])
    lost = _Generation(client, "tcp://w:0")
    was = {"planner": _Key(lost), "generation": 0, "owner": client.id, "constructors": 1}
    client.datasets[REGISTRY_PREFIX + "rct"] = was
    link = PlannerLink(client, cfg, was, owner=True)
    keeper = recovery.PlannerKeeper(link, {"units": {}, "roots": {}, "loader_threads": 1})
    avoided: list[set[str]] = []

    def place(*a: Any, generation: int, avoid: Any = (), **k: Any) -> dict[str, Any]:
        avoided.append(set(avoid))
        worker = next(w for w in client.workers if w not in avoid)
        return {"planner": _Key(_Generation(client, worker)), "planner_worker": worker,
                "constructors": 1, "generation": generation}

    refused = RuntimeError("its worker refused the actor")

    def bound(client: Any, future: Any, worker: str, *a: Any) -> Any:
        if worker == "tcp://w:1":
            raise TimeoutError("Timed out after 1 s.")
        if worker == "tcp://w:0":
            raise refused
        return future.result()

    monkeypatch.setattr(recovery, "close_roles_everywhere", lambda *a: {})
    monkeypatch.setattr(recovery, "place_planner", place)
    monkeypatch.setattr(recovery, "bound_actor", bound)
    with pytest.raises(ServiceTimeoutError, match=r"the re-created planner \(generation 1\) did "
                                                  r"not start on tcp://w:1 within 1s"):
        keeper.recover()
    keeper.recover()
    assert avoided == [set(), {"tcp://w:1"}]
    assert link.generation == 1 and link.planner._address == "tcp://w:2"  # (none published)
    # any other failure is raised as it is, not as its own cause (it was, a read-back)
    client.workers.insert(0, "tcp://w:0")
    link.registry["planner"] = _Key(lost)  # (lost again)
    keeper._not_started_on = set()
    with pytest.raises(RuntimeError) as info:
        keeper.recover()
    assert info.value is refused and info.value.__cause__ is None


def test_a_successor_found_late_is_waited_for_what_is_left_of_the_timeout() -> None:
    """The planner lost at once, its successor found near the end of the one wait and
    frozen: the successor was waited for a whole timeout more (a read-back: 3.8 s at a
    timeout of 2).  It gets what is left."""
    import pytest

    class _Future:
        def __init__(self, error: BaseException, sleep: bool = False) -> None:
            self.error, self.sleep = error, sleep

        def result(self, timeout: float | None = None) -> Any:
            if self.sleep:
                time.sleep(timeout or 0.0)
            raise self.error

    class _Gone:
        def set_weights(self, weights: dict[str, float]) -> _Future:
            return _Future(ConnectionError("its worker is gone"))

    class _Stuck:
        def set_weights(self, weights: dict[str, float]) -> _Future:
            return _Future(TimeoutError("timed out"), sleep=True)

    cfg = parse_config({"name": "link", "batch": {"seq_len": 64}, "timeout": 2, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    link = PlannerLink(None, cfg, {"planner": _Done(_Gone())})

    def refresh(max_age: float = 0.0, timeout: float | None = None) -> None:
        time.sleep(max(0.0, (timeout or 0.0) - 0.3))  # (the owner re-creates it meanwhile)
        link.planner, link.generation = _Stuck(), 1

    link.refresh = refresh  # type: ignore[method-assign]
    t0 = time.monotonic()
    with pytest.raises(ServiceTimeoutError, match=r"re-created for the lost one, did not "
                       r"answer set_weights\(\) within 2s \(a change it asked for may still"):
        link.call(lambda p: p.set_weights({"a": 1.0}), "set_weights()")
    assert time.monotonic() - t0 < 2.6


class _SlowOnce:
    """The registry's future of a live planner whose first fetch timed out (a busy
    scheduler while many ranks connect), then answers."""

    def __init__(self, planner: _Planner):
        self.planner, self.asked = planner, 0

    def result(self, timeout: float | None = None) -> Any:
        self.asked += 1
        if self.asked == 1:
            raise TimeoutError("the scheduler is busy")
        return self.planner


def test_a_planners_handle_that_did_not_come_at_first_is_fetched_again() -> None:
    """The link fetched the planner's handle once, when it was made: a fetch that timed out
    left it without one for good, and every look and call of the process failed against a
    live planner, "the planner's handle could not be fetched" (a review)."""
    cfg = parse_config({"name": "link", "batch": {"seq_len": 64}, "timeout": 3, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    planner = _Planner(delay=0.0)
    future = _SlowOnce(planner)
    link = _Link(None, cfg, {"planner": future})
    assert link.planner is None
    link.refresh()
    assert link.planner is planner and future.asked == 2
    assert link.constructors == ["c0", "c1"] and planner.calls == 1


def test_a_service_gone_with_its_owner_is_a_close_every_reader_and_agent_knows() -> None:
    """Readers of a service whose planner and registry went with its owner were told it was
    "closed by its owner, or stopped ...: its starting process was gone", after a clean
    close, and a host agent, which exits at once on a close it knows, took it for none and
    read on until its next 15 s look (a review)."""
    from msd_dask.errors import CLOSED_NOTICES, ServiceError

    class Gone:
        status = "lost"

        def result(self, timeout: float | None = None) -> Any:
            raise TimeoutError("lost")

    class Client:
        status = "running"

        def run_on_scheduler(self, *args: Any, **kwargs: Any) -> bool:
            return False  # (the owner's client is gone)

        def get_dataset(self, *args: Any, **kwargs: Any) -> None:
            return None  # (its registry too: closed)

    cfg = parse_config({"name": "link", "batch": {"seq_len": 64}, "sources": [
        {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})
    link = PlannerLink(Client(), cfg, {"planner": Gone(), "owner": "client-1"})
    try:
        link.raise_if_lost()
    except ServiceError as e:
        said = str(e)
    else:
        raise AssertionError("a service gone with its owner was not said to be")
    assert link.closed and link.notice in CLOSED_NOTICES
    assert said == "service 'link': closed by its owner (or stopped with msd-dask stop)"


def test_a_look_for_a_successor_keeps_to_its_timeout(monkeypatch: Any) -> None:
    """A lost planner and a scheduler that does not answer: each ask of the scheduler waited
    its own fixed 5 s, refresh(timeout=1) raised after 11 s saying 1, and a call with the
    config's timeout of 2 after 12 (a review).  Each ask waits what is left of the wait."""
    import pytest

    from msd_dask.service import link as link_module

    class _Never:
        status = "lost"

        def result(self, timeout: float | None = None) -> Any:
            time.sleep(timeout or 0.0)
            raise TimeoutError(f"timed out after {timeout} s.")

    class _Lost:
        def handles(self, _with_loaders: bool) -> _Never:
            return _Never()

        def set_weights(self, weights: dict[str, float]) -> _Never:
            return _Never()

    class _Frozen:
        status, id = "running", "reader-1"

        def get_dataset(self, name: str, default: Any = None,
                        callback_timeout: float | None = None) -> Any:
            time.sleep(callback_timeout or 0.0)
            raise TimeoutError(f"timed out after {callback_timeout} s.")

        def run_on_scheduler(self, fn: Any, *a: Any, callback_timeout: float | None = None,
                             **k: Any) -> Any:
            time.sleep(callback_timeout or 0.0)
            raise TimeoutError(f"timed out after {callback_timeout} s.")

    cfg = parse_config({"name": "ov", "timeout": 2, "batch": {"seq_len": 8}, "sources": [
        {"name": "a", "uri": "memory://a", "format": "jsonl"}]})
    monkeypatch.setattr(link_module, "bind_actor", lambda handle, client: handle)
    link = PlannerLink(_Frozen(), cfg, {"planner": _Done(_Lost()), "owner": "owner-1"})
    link.registry["planner"] = _Never()  # (its future: lost with its worker)
    for wait, call in ((1.0, lambda: link.refresh(timeout=1)),
                       (2.0, lambda: link.call(lambda p: p.set_weights({"a": 1.0}),
                                               "set_weights()"))):
        t0 = time.monotonic()
        with pytest.raises(ServiceTimeoutError, match=rf"within {wait:g}s"):
            call()
        assert time.monotonic() - t0 < wait + 1.5
