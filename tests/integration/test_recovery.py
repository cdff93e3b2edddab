"""Lost roles: kill -9 the worker holding a loader, a constructor or the planner, mid-run.

Real `dask scheduler`/`dask worker` processes (no nanny: the killed worker stays dead).
All ranks continue; every step reaches every rank exactly once and every document of an
epoch is delivered exactly once.  A planner nobody can re-create (the process that
started the service is gone too) is reported to readers at once, saying what to do."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
from distributed import Client

from msd_dask import DataService, ServiceError
from msd_dask.roles.keys import key_prefix

from checks import check_content, check_exactly_once, record
from cluster import dask_cluster
from corpus import config, write_corpus

pytestmark = pytest.mark.slow
STEPS = 70


def _roles(svc):
    """worker address -> set of roles ('planner', 'constructor', 'loader')."""
    out: dict[str, set[str]] = {}
    out.setdefault(svc.planner._address, set()).add("planner")
    svc.refresh()
    for c in svc.constructors:
        out.setdefault(c._address, set()).add("constructor")
    for stats in svc.planner.loader_stats().result().values():
        for s in stats:
            out.setdefault(s["worker"], set()).add("loader")
    return out


def _current_keys(svc):
    """The Dask keys of the service's current loaders and constructors."""
    handles = svc.planner.handles().result(timeout=30)
    return sorted([*(c.key for c in handles["constructors"]),
                   *(h.key for slots in handles["loaders"].values() for h in slots.values())])


@contextmanager
def _served(tmp_path, cfg, address):
    """``msd-dask serve`` in another process; yields ``(process, connected DataService)``."""
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "msd_dask.cli", "serve", str(path),
                                 "--scheduler", address], stdout=log, stderr=log)
        try:
            with DataService.connect(address, cfg["name"], timeout=60) as svc:
                yield proc, svc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


@contextmanager
def _service(tmp_path, cfg, address, serve):
    if serve:
        with _served(tmp_path, cfg, address) as (_, svc):
            yield svc
    else:
        with DataService.start(cfg, address) as svc:
            yield svc


def _run_with_kill(tmp_path, role, n_workers=4, serve=False):
    """Kill -9 the worker of ``role`` at step 25 of 70; ``serve``: the service runs in a
    ``msd-dask serve`` process, the readers here only connect to it."""
    root = str(tmp_path / "corpus")
    texts = write_corpus(root)
    cfg = config(root, name=f"kill-{role}", timeout=90)
    cfg["sources"][1]["loaders"] = 2
    with dask_cluster(str(tmp_path), n_workers=n_workers) as cl:
        with Client(cl["address"], timeout=60) as c:  # the roles spread over all workers
            c.wait_for_workers(n_workers, timeout=60)
        with _service(tmp_path, cfg, cl["address"], serve) as svc:
            roles = _roles(svc)
            if role == "planner":
                victims = [svc.planner._address]
                if n_workers == 2:  # the second constructor goes to the planner's worker
                    assert "constructor" in roles[victims[0]], roles
            else:
                # prefer a worker holding only that role; else one holding it with loaders
                # (not the planner's own worker: that is the planner case)
                victims = sorted((w for w, r in roles.items()
                                  if role in r and "planner" not in r),
                                 key=lambda w: len(roles[w]))
            assert victims, f"no worker holds a {role} without the planner: {roles}"
            pid = svc.client.run(os.getpid)[victims[0]]
            readers = [svc.reader(r) for r in range(2)]
            recs = []
            for step in range(STEPS):
                if step == 25:
                    os.kill(pid, signal.SIGKILL)
                for rd in readers:
                    b = next(rd)
                    assert b.step == step and b.rank == rd.rank, (step, b.step, rd.rank)
                    recs.append(record(b))
            stats = svc.stats()
            # the lost role was re-created on a surviving worker
            deadline = time.monotonic() + 10
            while not stats["planner"]["recovered"].get(role):
                assert time.monotonic() < deadline, stats["planner"]["role_events"]
                time.sleep(0.5)
                stats = svc.stats()
            assert victims[0] not in _roles(svc)
            if role == "planner":
                assert svc.generation == 1
                ev = [e for e in stats["planner"]["role_events"] if e["role"] == "planner"]
                assert len(ev) == 1 and ev[0]["from"] == victims[0], ev
                # the roles the lost planner left behind were closed, and Dask forgot them
                # once nothing referenced them: only the current roles remain
                def _service_keys(dask_scheduler, prefix):  # by value: the scheduler
                    return sorted(str(k) for k in dask_scheduler.tasks  # cannot import tests
                                  if str(k).startswith(prefix)
                                  and not str(k).startswith(prefix + "planner"))

                want = _current_keys(svc)
                deadline = time.monotonic() + 20
                while (got := svc.client.run_on_scheduler(
                        _service_keys, prefix=key_prefix(cfg["name"]))) != want:
                    assert time.monotonic() < deadline, (sorted(set(got) - set(want)),
                                                         sorted(set(want) - set(got)))
                    gc.collect()
                    time.sleep(0.5)
    # every step reached every rank exactly once, in order (asserted above), and the
    # documents are the source text, each exactly once per source epoch
    assert len(recs) == 2 * STEPS
    check_content(recs, texts, 512)
    epochs = check_exactly_once(recs, texts, 512)
    assert min(epochs.values()) >= 1, epochs


def test_kill_worker_holding_a_loader(tmp_path):
    _run_with_kill(tmp_path, "loader")


def test_kill_worker_holding_a_constructor(tmp_path):
    _run_with_kill(tmp_path, "constructor")


def test_kill_worker_holding_the_planner(tmp_path):
    _run_with_kill(tmp_path, "planner")


def test_kill_worker_holding_the_planner_of_a_served_service(tmp_path):
    """The planner re-created by a `msd-dask serve` process: readers elsewhere find it."""
    _run_with_kill(tmp_path, "planner", serve=True)


def test_kill_worker_holding_the_planner_and_a_constructor(tmp_path):
    """The rank of the lost constructor read past the planner's last kept state: the new
    constructors learn it from the readers, not only from the old constructors."""
    _run_with_kill(tmp_path, "planner", n_workers=2)


def test_stats_answer_while_the_roles_of_a_lost_worker_are_re_created(tmp_path):
    """``svc.stats()`` polled right after the worker of a constructor and loaders is killed
    never raises: until their successors answer, a lost loader counts by its last answer
    (``loaders_unanswered``) and a lost constructor has ``error`` set."""
    with _three_workers(tmp_path, "stats-kill", 90) as (cl, cfg, _):
        cfg["sources"][1]["loaders"] = 2
        with DataService.start(cfg, cl["address"]) as svc:
            roles = _roles(svc)
            victims = sorted(w for w, r in roles.items()
                             if "constructor" in r and "loader" in r and "planner" not in r)
            assert victims, roles
            readers = [svc.reader(r) for r in range(2)]
            for step in range(3):
                assert [next(rd).step for rd in readers] == [step, step]
            before = svc.stats()["sources"]
            lost = {i for i, c in enumerate(svc.constructors) if c._address == victims[0]}
            os.kill(svc.client.run(os.getpid)[victims[0]], signal.SIGKILL)
            seen: list[tuple[int, bool]] = []
            deadline = time.monotonic() + 60
            while True:
                st = svc.stats()  # raised "Worker holding Actor was lost" for ~1 s
                unanswered = sum(s["loaders_unanswered"] for s in st["sources"].values())
                failed = {c["index"] for c in st["constructors"] if c.get("error")}
                assert failed <= lost, (failed, lost)  # never a live one
                seen.append((unanswered, bool(failed)))
                for name, src in st["sources"].items():  # no counter goes back
                    assert src["tokens_read"] >= before[name]["tokens_read"], (name, src)
                recovered = st["planner"]["recovered"]
                if (recovered.get("loader") and recovered.get("constructor")
                        and seen[-1] == (0, False)):
                    break
                assert time.monotonic() < deadline, (recovered, seen[-5:])
                time.sleep(0.05)
            assert victims[0] not in _roles(svc)
            assert len(st["ranks"]) == 2, st["ranks"]
            for step in range(3, 6):  # and the ranks read on
                assert [next(rd).step for rd in readers] == [step, step]


def test_loaders_scaled_by_hand_stay_scaled_after_the_planner_is_re_created(tmp_path):
    """``scale_loaders`` (policy fixed: nothing else scales) survives the loss of the
    planner: the re-created one serves the source with as many loaders, not the config's
    count again."""
    with _three_workers(tmp_path, "scaled", 90) as (cl, cfg, texts):
        with DataService.start(cfg, cl["address"]) as svc:
            readers = [svc.reader(r) for r in range(2)]
            recs = []

            def read(steps: range) -> None:
                for step in steps:
                    for rd in readers:
                        b = next(rd)
                        assert b.step == step, (b.step, step)
                        recs.append(record(b))

            read(range(5))
            pid = svc.client.run(os.getpid)[svc.planner._address]
            # killed at once: before the owner's next periodic checkpoint (a second)
            assert svc.scale_loaders("prose", 3) == 3
            os.kill(pid, signal.SIGKILL)
            read(range(5, 30))
            deadline = time.monotonic() + 30
            while (svc.generation != 1
                   or svc.stats()["sources"]["prose"]["loaders"] != 3):
                assert time.monotonic() < deadline, (svc.generation, svc.stats()["sources"])
                time.sleep(0.5)
            assert svc.stats()["sources"]["code"]["loaders"] == 2  # the config's
            read(range(30, 35))
    check_content(recs, texts, 512)
    check_exactly_once(recs, texts, 512, min_complete=0)  # (35 steps: no piece twice)


def test_a_reader_with_a_short_timeout_follows_its_re_created_constructor(tmp_path):
    """A reader whose ``timeout`` is shorter than one claim's wait (7 s) timed out on the
    call to its lost constructor before it looked for the re-created one, so every later
    request went to the lost one again and timed out too, for good (found by a chaos run
    through host agents, whose group readers read on after a timeout).  The request after
    a timeout goes to the new constructor."""
    from msd_dask import ServiceTimeoutError

    with _three_workers(tmp_path, "short-timeout", 6) as (cl, cfg, texts):
        with DataService.start(cfg, cl["address"]) as svc:
            readers = [svc.reader(r) for r in range(2)]
            recs: dict[int, list] = {0: [], 1: []}
            for _ in range(4):
                for rd in readers:
                    recs[rd.rank].append(record(next(rd)))
            roles = _roles(svc)
            victim = next((w for w, r in roles.items()
                           if "constructor" in r and "planner" not in r), None)
            assert victim is not None, roles
            os.kill(svc.client.run(os.getpid)[victim], signal.SIGKILL)
            timeouts = {0: 0, 1: 0}
            deadline = time.monotonic() + 90
            for _ in range(4, 10):  # step by step (a rank alone stalls after prefetch steps)
                for rd in readers:  # a timeout or two while its constructor is re-created
                    while True:
                        assert time.monotonic() < deadline, (timeouts, recs)
                        try:
                            recs[rd.rank].append(record(next(rd)))
                            break
                        except ServiceTimeoutError:
                            timeouts[rd.rank] += 1
            assert [r["step"] for r in recs[0]] == [r["step"] for r in recs[1]] == list(range(10))
            assert sum(timeouts.values()) <= 4, timeouts
    check_content(recs[0] + recs[1], texts, 512)
    check_exactly_once(recs[0] + recs[1], texts, 512, min_complete=0)  # (10 steps)


def test_planner_lost_with_its_owner_is_reported(tmp_path):
    """The serving process and the planner's worker both killed: nothing can re-create the
    planner, and a reader says so at once instead of waiting out its timeout."""
    root = str(tmp_path / "corpus")
    write_corpus(root)
    cfg = config(root, name="orphan", timeout=60)
    with dask_cluster(str(tmp_path), n_workers=2) as cl, \
            _served(tmp_path, cfg, cl["address"]) as (serve, svc):
        readers = [svc.reader(r, timeout=60) for r in range(2)]
        for step in range(3):
            assert [next(rd).step for rd in readers] == [step, step]
        pid = svc.client.run(os.getpid)[svc.planner._address]
        serve.kill()
        serve.wait(10)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as ei:
            for rd in readers * 10:
                next(rd)
        # at once, not after the readers' 60 s timeout
        assert time.monotonic() - t0 < 30
        msg = str(ei.value)
        assert "planner of service 'orphan' was lost" in msg, msg
        assert "process that started the service is gone" in msg, msg
        assert "--resume" in msg and "state_dict" in msg, msg


def test_an_unchanged_checkpoint_is_not_sent_again(tmp_path):
    """The owner polls the planner's checkpoint every second; a checkpoint of the step the
    owner already keeps comes without its state (megabytes at scale), and the owner keeps
    the state it has: still the very bytes of that step's checkpoint."""
    root = str(tmp_path / "corpus")
    write_corpus(root)
    cfg = config(root, name="checkpoint-again", timeout=60)
    with dask_cluster(str(tmp_path), n_workers=2) as cl:
        with DataService.start(cfg, cl["address"]) as svc:
            keeper = svc.keeper
            assert keeper is not None
            # no rank read yet: the checkpoint stays at the step before the first
            ck = svc.planner.checkpoint().result(timeout=30)
            assert isinstance(ck["state"], bytes) and ck["state"]
            again = svc.planner.checkpoint(have=ck["step"],
                                           have_version=ck["version"]).result(timeout=30)
            assert (again["step"], again["state"]) == (ck["step"], None)
            other = svc.planner.checkpoint(have=ck["step"] - 1,
                                           have_version=ck["version"]).result(timeout=30)
            assert other["state"] == ck["state"]
            keeper.keep_checkpoint()
            keeper.keep_checkpoint()  # (the second one without the state)
            assert keeper.checkpoint is not None
            assert (keeper.checkpoint["step"], keeper.checkpoint["state"]) == (ck["step"], ck["state"])
            # every rank reads: the checkpoint moves on, and the owner keeps the new state
            readers = [svc.reader(r) for r in range(2)]
            for _ in range(5):
                for rd in readers:
                    next(rd)
            keeper.keep_checkpoint()
            now = svc.planner.checkpoint().result(timeout=30)
            assert now["step"] > ck["step"]
            assert (keeper.checkpoint["step"], keeper.checkpoint["state"]) == (now["step"], now["state"])
            # a live weight change re-packs the kept states: the owner takes the new one
            svc.set_weights({"code": 0.1, "prose": 0.9})
            keeper.keep_checkpoint()
            assert keeper.checkpoint["version"] == now["version"] + 1
            if keeper.checkpoint["step"] == now["step"]:
                assert keeper.checkpoint["state"] != now["state"]


@contextmanager
def _three_workers(tmp_path, name, timeout):
    """A cluster of three ``dask worker`` processes, all joined, a config ``name`` over the
    test corpus, and the corpus's texts."""
    root = str(tmp_path / "corpus")
    texts = write_corpus(root)
    with dask_cluster(str(tmp_path), n_workers=3) as cl:
        with Client(cl["address"], timeout=60) as c:
            c.wait_for_workers(3, timeout=60)
        yield cl, config(root, name=name, timeout=timeout), texts


def test_after_a_recovered_planner_the_default_state_is_the_step_returned(tmp_path):
    """Readers returned step 3 of the round 3..5 they claimed, then the planner's worker is
    killed: the re-created planner starts after the last step every rank *returned* (it
    started after the last step claimed, 5), so ``consumed_step()`` and the default
    ``state_dict()`` say 3, the state of step 3 is still held, and the readers go on at 4
    (a review found: they said 5, and resuming from that skipped steps 4 and 5)."""
    with _three_workers(tmp_path, "recovered-default", 60) as (cl, cfg, _):
        with DataService.start(cfg, cl["address"]) as svc:
            readers = [svc.reader(r) for r in range(2)]
            for step in range(4):
                for rd in readers:
                    assert next(rd).step == step
            assert svc.consumed_step() == 3
            time.sleep(1.5)  # the owner keeps a checkpoint every second
            pid = svc.client.run(os.getpid)[svc.planner._address]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while svc.generation == 0:
                assert time.monotonic() < deadline, "the planner was not re-created"
                time.sleep(0.5)
            assert svc.planner.start_step().result(timeout=30) <= 4
            assert svc.consumed_step() == 3
            assert svc.state_dict()["step"] == 3
            assert svc.state_dict(3)["step"] == 3
            for step in range(4, 8):
                for rd in readers:
                    assert next(rd).step == step


def test_a_re_creation_that_fails_after_publishing_is_retried_with_a_new_generation(
        tmp_path, monkeypatch):
    """The owner's first attempt to re-create the lost planner fails after publishing it
    (its ``handles`` did not answer), while another process adopted that planner: the
    retry publishes a higher generation, which that process then adopts, and both read on
    (a review found the retry reused the generation number: the other process never
    switched and its reader timed out on a closed constructor)."""
    from msd_dask.service.link import PlannerLink

    with _three_workers(tmp_path, "generation-retry", 20) as (cl, cfg, _):
        with DataService.start(cfg, cl["address"]) as svc, \
                DataService.connect(cl["address"], cfg["name"], agent=False) as other:
            adopt, attempts = PlannerLink.adopt, []

            def flaky(self, registry, planner, constructors):  # type: ignore[no-untyped-def]
                attempts.append(registry["generation"])
                if len(attempts) == 1:
                    assert other.link.adopt_published()  # another process took it
                    raise TimeoutError("the new planner's handles() did not answer")
                return adopt(self, registry, planner, constructors)

            monkeypatch.setattr(PlannerLink, "adopt", flaky)
            os.kill(svc.client.run(os.getpid)[svc.planner._address], signal.SIGKILL)
            deadline = time.monotonic() + 90
            while svc.generation == 0:
                assert time.monotonic() < deadline, attempts
                time.sleep(0.5)
            assert attempts == [1, 2] and svc.generation == 2
            assert other.link.generation == 1 and other.link.adopt_published()
            assert other.link.generation == 2
            assert next(other.reader(1, timeout=30)).step == 0
            assert next(svc.reader(0, timeout=30)).step == 0


def test_workers_killed_by_a_document_stop_the_re_creations_with_a_clear_error(tmp_path):
    """A preprocess that ends its process on one document (as a native decoder's segfault
    or an out-of-memory kill would): its worker dies, the loader is re-created on another
    worker, which dies too, and so on, the planner with them (its worker takes the
    re-created loaders).  The owner re-created the planner for as long as it ran (56
    times in 60 s here), and every rank waited out its timeout to be told "the planner was
    lost with its worker and not re-created".  The owner stops after a few planners lost
    in a row without progress, every rank is told why at once, naming the file, and
    the workers stop dying."""
    root = str(tmp_path / "data")
    write_corpus(root)
    with open(f"{root}/crash.jsonl", "w") as f:
        for i in range(10):
            text = "CRASH-ME" if i == 4 else "fine " * 30
            f.write(json.dumps({"text": f"doc {i} {text}"}) + "\n")
    cfg = config(root, name="crash", timeout=120)
    cfg["sources"][1].update(uri=f"{root}/crash.jsonl",
                             preprocess="msd_dask.examples.preprocess:crash_on_marker")
    t0 = time.monotonic()
    with DataService.start(cfg, n_workers=2, threads_per_worker=1) as svc:
        with pytest.raises(ServiceError) as info:
            for _ in svc.reader(0):
                pass
        took = time.monotonic() - t0
        message = str(info.value)
        workers = set(svc.client.scheduler_info()["workers"])
        time.sleep(3)  # nothing is re-created any more: the workers stay
        assert set(svc.client.scheduler_info()["workers"]) == workers
    assert "was lost with its worker 5 times in a row" in message, message
    assert f"prose: {root}/crash.jsonl" in message, message
    assert took < 60, took  # (not the rank's timeout, 120 s)
