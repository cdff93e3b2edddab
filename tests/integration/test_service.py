"""The service end to end on an embedded LocalCluster: content, exactly-once, mix, determinism."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from msd_dask import DataService, ServiceError, ServiceTimeoutError

from checks import check_content, check_exactly_once, read_steps, shares, wait_until
from corpus import config


def test_content_exactly_once_and_mix(corpus):
    root, texts = corpus
    cfg = config(root)
    with DataService.start(cfg, n_workers=2, threads_per_worker=1) as svc:
        recs = read_steps(svc, 200)
        stats = svc.stats()
    tokens = check_content(recs, texts, 512)
    epochs = check_exactly_once(recs, texts, 512)
    assert epochs["code"] >= 1 and epochs["prose"] >= 1, epochs
    got = shares(tokens)
    assert abs(got["code"] - 0.7) < 0.02 and abs(got["prose"] - 0.3) < 0.02, got
    # the service's own counters agree with what the readers saw: every source's tokens
    # were planned and fetched from its loaders, and at most the steps planned past the
    # 200 read (up to prefetch + 1 ahead) more
    planner = stats["planner"]
    ahead = planner["steps_planned"] - 200
    assert 0 <= ahead <= cfg["prefetch"] + 1, planner["steps_planned"]
    step_tokens = 2 * 2 * 512  # dp x micro_batches x seq_len
    for src, n in tokens.items():
        assert n <= planner["tokens_planned"][src] <= n + ahead * step_tokens, (src, n, planner)
        fetched = stats["sources"][src]["tokens_fetched"]
        assert n <= fetched <= planner["tokens_planned"][src], (src, n, fetched)
    assert all(r["queue_depth"] <= cfg["prefetch"] + 1 for r in stats["ranks"].values())
    for m in range(2):
        assert all(len(rec["cu_seqlens"][m]) >= 1 for rec in recs)


def _dask_periodic(dask_worker=None, dask_scheduler=None):
    s = dask_worker or dask_scheduler
    return {k: pc.callback_time for k, pc in s.periodic_callbacks.items()}


def _dashboard_hosts(dask_scheduler=None):
    return [sock.getsockname()[0] for sock in dask_scheduler.http_server._sockets.values()]


def _heap_environ():
    import os

    return {k: os.environ.get(k) for k in ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_")}


def test_embedded_cluster_runs_without_dasks_fast_periodic_work(corpus):
    """The embedded cluster's workers run no stack profiler and tick every 200 ms (Dask:
    every 10 and 20 ms), its memory checks every 500 ms (100 ms): an idle cluster's CPU
    (docs/benchmarks.md, elastic loaders); their C heap has 2 arenas, beside Dask's own
    settings of the heap (docs/deployment.md); this process's own config is left as it
    was."""
    import dask
    import distributed  # noqa: F401 - its config defaults

    from msd_dask.service import EMBEDDED_DASK_CONFIG

    root, _ = corpus
    before = {k: dask.config.get(k, None) for k in EMBEDDED_DASK_CONFIG}
    with DataService.start(config(root), n_workers=2, threads_per_worker=1) as svc:
        next(svc.reader(0))
        # the dashboard on loopback, as the scheduler is (it listened on every address, in
        # plain HTTP even with TLS; a review)
        dashboard = svc.client.run_on_scheduler(_dashboard_hosts)
        assert dashboard and set(dashboard) == {"127.0.0.1"}, dashboard
        workers = svc.client.run(_dask_periodic)
        scheduler = svc.client.run_on_scheduler(_dask_periodic)
        heaps = svc.client.run(_heap_environ)
    assert list(heaps.values()) == [{"MALLOC_ARENA_MAX": "2", "MALLOC_TRIM_THRESHOLD_": "65536"}] * 2
    assert len(workers) == 2
    for pcs in workers.values():
        assert "profile" not in pcs and "profile-cycle" not in pcs, pcs
        assert pcs["tick"] == 200 and pcs["memory_monitor"] == 500, pcs
    assert scheduler["tick"] == 200, scheduler
    assert {k: dask.config.get(k, None) for k in EMBEDDED_DASK_CONFIG} == before


def test_roles_are_placed_whatever_the_clients_cached_identity(corpus, monkeypatch):
    """The planner is placed on the workers the scheduler has now, not on the client's
    cached identity: the client's periodic identity call (totals only, no workers) can
    overwrite ``Client.scheduler_info()``'s answer before it returns, and a service
    (or a planner re-created after a loss) then found "no worker".  Here the cache
    always holds what that call leaves."""
    from distributed import Client
    from distributed.client import SchedulerInfo

    def totals_only(self, n_workers=-1, **kwargs):
        return SchedulerInfo(self.sync(self.scheduler.identity, n_workers=0))

    monkeypatch.setattr(Client, "scheduler_info", totals_only)
    root, texts = corpus
    with DataService.start(config(root, name="cached"), n_workers=2,
                           threads_per_worker=1) as svc:
        assert svc.client.scheduler_info()["workers"] == {}
        recs = read_steps(svc, 6)
        n_constructors = svc.link.registry["constructors"]
    check_content(recs, texts, 512)
    # one constructor per DP rank up to one per worker (dp 2): the placement saw both
    assert n_constructors == 2


def test_same_seed_same_batches_whatever_the_workers(corpus):
    root, texts = corpus
    runs = []
    for workers, code_loaders in ((1, 1), (2, 3)):
        cfg = config(root)
        cfg["sources"][0]["loaders"] = code_loaders
        with DataService.start(cfg, n_workers=workers, threads_per_worker=1) as svc:
            runs.append(read_steps(svc, 30))
    for a, b in zip(*runs, strict=True):
        assert a["documents"] == b["documents"]
        assert (a["input_ids"] == b["input_ids"]).all()
    # and another seed changes the stream
    cfg = config(root, seed=8)
    with DataService.start(cfg, n_workers=1, threads_per_worker=1) as svc:
        other = read_steps(svc, 5)
    assert [r["documents"] for r in other] != [r["documents"] for r in runs[0][:10]]


def test_rounds_send_fewer_messages_and_the_same_batches(corpus):
    """``round_steps``: a round's steps are fetched, built, published and claimed together
    (one round posted per rank and round), and what every rank reads does not change."""
    root, texts = corpus
    runs, posted, published = [], [], []
    for k in (1, 3):
        cfg = config(root, name=f"rounds{k}", prefetch=4, round_steps=k)
        with DataService.start(cfg, n_workers=2, threads_per_worker=1) as svc:
            runs.append(read_steps(svc, 40))
            cons = svc.stats()["constructors"]
        posted.append(sum(c["rounds_posted"] for c in cons))
        published.append(sum(c["rounds_built"] for c in cons))
        check_content(runs[-1], texts, 512)
        check_exactly_once(runs[-1], texts, 512)
    for a, b in zip(*runs, strict=True):
        assert a["documents"] == b["documents"] and a["step"] == b["step"]
        assert (a["input_ids"] == b["input_ids"]).all() and (a["labels"] == b["labels"]).all()
    # k = 1: a round per rank and step; k = 3: about a third (rounds cut short where a
    # unit's lengths are not known yet are the rest)
    world = 2
    assert posted[0] >= 40 * world, posted
    assert posted[1] <= 0.5 * posted[0], posted
    assert published[1] <= 0.5 * published[0], published


def test_one_rank_read_by_two_processes_at_once_is_refused_naming_both(corpus, tmp_path):
    """Two processes reading one rank at once (a global rank computed from LOCAL_RANK on two
    hosts) both got every step, each claim taken for a retry of the other's lost answer:
    they trained on the same batches without a word (a review of a torchrun job).  The
    second process's claim is refused while the first is connected, naming both; the
    first reads on.  (A second handle of one process, or a restarted process once the
    first is gone, is served as before: tests/integration/test_reader_again.py.)"""
    import os
    import select

    root, _ = corpus
    here = os.path.dirname(os.path.dirname(__file__))
    with DataService.start(config(root, name="tworeaders"), n_workers=1) as svc:
        procs = [subprocess.Popen(
            [sys.executable, os.path.join(here, "reader_proc.py"), svc.address, "tworeaders",
             "0", "0", str(tmp_path / f"r{i}.pkl"), "--driven"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", "")))
            for i in range(2)]

        def answers() -> list[str]:
            for p in procs:
                if p.poll() is None:
                    p.stdin.write("next\n")
                    p.stdin.flush()
            out = []
            for p in procs:
                ready, _, _ = select.select([p.stdout], [], [], 90)
                out.append(p.stdout.readline().strip() if ready else "(no answer)")
            return out

        try:
            other = svc.reader(1)  # (rank 1 reads too: the steps go on)
            first = answers()
            next(other)
            assert sorted(first) == ["", "0"], first  # one read step 0, the other ended
            refused = procs[first.index("")]
            refused.wait(30)
            err = refused.stderr.read()
            assert refused.returncode != 0 and "rank 0 is read by two processes at once" in err \
                and "LOCAL_RANK" in err, err
            served = procs[first.index("0")]
            served.stdin.write("next\n")
            served.stdin.flush()
            assert served.stdout.readline().strip() == "1"
        finally:
            for p in procs:
                p.kill()
                p.wait(10)


def test_consumed_step_counts_only_returned_steps(corpus):
    """Readers claim whole rounds: steps a rank holds but has not returned are not consumed,
    and the steps it returned are, once its reader pauses (it reports them)."""
    root, _ = corpus
    cfg = config(root, name="consumed", prefetch=4, round_steps=3)
    with DataService.start(cfg, n_workers=1, threads_per_worker=2) as svc:
        other = DataService.connect(svc.client.scheduler.address, "consumed")
        readers = [other.reader(r) for r in range(2)]  # not this object's readers
        for _ in range(30):  # until every rank holds a step it has not returned
            for reader in readers:
                step = next(reader).step
            claimed = min(c["last_claimed"][r] for c in svc.stats()["constructors"]
                          for r in c["last_claimed"])
            if claimed > step:
                break
        assert claimed > step, "no rank holds a step it has not returned: nothing to check"
        # the constructors know every rank returned the steps before its last round, and
        # the last step it returned once its reader has paused REPORT_IDLE seconds (the
        # call waits for that): never a step it only holds
        assert svc.consumed_step() == step
        assert svc.state_dict()["step"] == step
        # a reader of the asking process counts the last step it returned
        assert other.consumed_step() == step and other.state_dict()["step"] == step
        # close(), as an agent's reader has it (a script runs the same with and without),
        # and as a context manager's exit (with svc.reader(rank) as reader:)
        with readers[0]:
            pass
        with pytest.raises(ServiceError, match="rank 0: the reader is closed"):
            next(readers[0])
        for reader in readers:
            reader.close()
            reader.close()
        with pytest.raises(ServiceError, match="rank 1: the reader is closed"):
            next(readers[1])
        assert svc.consumed_step() == step


def test_connect_by_name_and_errors(corpus):
    root, _ = corpus
    with DataService.start(config(root, name="named"), n_workers=1) as svc:
        addr = svc.client.scheduler.address
        with pytest.raises(ServiceError, match="no service named 'nope'"):
            DataService.connect(addr, "nope", timeout=1)
        # an operator's command for a mistyped name: told at once, with the running names
        # (it waited its 30 s connect timeout first)
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match=r"no service named 'nope' on .* \(running: "
                                               r"\['named'\]\)"):
            DataService.connect(addr, "nope", wait=0)
        stats = subprocess.run([sys.executable, "-m", "msd_dask.cli", "stats", "nope",
                                "--scheduler", addr], capture_output=True, text=True, timeout=60)
        assert time.monotonic() - t0 < 20, "waited for a service that is not running"
        assert stats.returncode == 2 and "no service named 'nope'" in stats.stderr \
            and "'named'" in stats.stderr, stats.stderr
        with pytest.raises(ServiceError, match="already running"):
            DataService.start(config(root, name="named"), addr)
        with DataService.connect(addr, "named") as other:
            b = next(other.reader(1))
            assert b.step == 0 and b.rank == 1
            with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\): service 'named' "
                                                 r"is laid out for 2 ranks \(dp=2 tp=1"):
                other.reader(2)
            # a job of another size (torchrun's WORLD_SIZE) is told at once: a smaller one
            # read a round, then each rank waited out its timeout for ranks that never came
            # (a review of a torchrun job)
            with pytest.MonkeyPatch.context() as env:
                env.setenv("WORLD_SIZE", "3")
                with pytest.raises(ValueError, match=r"rank 0: service 'named' is laid out for "
                                                     r"2 ranks \(dp=2 .*WORLD_SIZE is 3"):
                    other.reader(0)
                env.setenv("WORLD_SIZE", "2")
                assert other.reader(0).rank == 0
        # a closed handle says so at once (a reader was made and failed at its first step;
        # the link read "None/msd/status"; a review)
        for closed_call in (lambda: other.reader(0), lambda: other.dashboard_link,
                            lambda: other.retire_workers([])):
            with pytest.raises(ServiceError, match="service 'named': "):
                closed_call()
        # rank 0 alone can read up to prefetch steps; then it waits for rank 1 no longer
        # than its timeout and says what it waited for
        r0 = svc.reader(0, timeout=2)
        with pytest.raises(ServiceTimeoutError, match="rank 0 waited 2s for"):
            for _ in range(10):
                next(r0)


def test_a_failed_connect_leaves_no_client_open():
    """A service whose planner is lost with its owner: each ``connect`` raises, and closes
    the Dask client it opened (a review found one more client left open per attempt)."""
    import gc

    from distributed import Client, LocalCluster

    from msd_dask.core.config import parse_config
    from msd_dask.service.placement import REGISTRY_PREFIX, published_event

    def lost() -> None:
        raise RuntimeError("the planner's worker was lost")

    def open_clients() -> int:
        gc.collect()
        return sum(type(o) is Client and o.status == "running" for o in gc.get_objects())

    cfg = parse_config(config("/nonexistent", name="lost-owner", timeout=5))
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=None) as cluster, Client(cluster) as owner:
        planner = owner.submit(lost, pure=False)
        with pytest.raises(RuntimeError):
            planner.result()
        owner.publish_dataset({"config": cfg.to_dict(), "planner": planner, "constructors": 1,
                               "generation": 0, "owner": "a client that is gone"},
                              name=REGISTRY_PREFIX + "lost-owner")
        published_event(owner, "lost-owner").set(30)
        before = open_clients()
        for _ in range(3):
            with pytest.raises(ServiceError):
                DataService.connect(cluster.scheduler_address, "lost-owner", timeout=5)
        assert open_clients() == before


def test_start_places_the_planner_on_a_running_worker_and_cleans_up_a_failed_start(
        corpus, monkeypatch):
    """The first worker is paused (over its memory limit, say): the planner goes to the
    other (it went to the first, sorted by address, and start() waited for ever).  A start
    that fails after publishing the service leaves nothing published: the same name starts
    again (a review found both by running them)."""
    from distributed import Client, LocalCluster
    from distributed.core import Status

    from msd_dask.service import handle as handle_module

    def pause(dask_worker) -> None:  # type: ignore[no-untyped-def]
        dask_worker.status = Status.paused

    root, _ = corpus
    cfg = config(root, name="paused-first", timeout=20)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, memory_limit=0,
                      dashboard_address=None) as cluster, Client(cluster) as c:
        first, second = sorted(c.scheduler_info()["workers"])
        c.run(pause, workers=[first])

        def refuse(self) -> None:  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt  # Ctrl-C after the service was published

        with monkeypatch.context() as m:
            m.setattr(handle_module.PlannerKeeper, "start", refuse)
            with pytest.raises(KeyboardInterrupt):
                DataService.start(cfg, cluster.scheduler_address)
        assert not [d for d in c.list_datasets() if str(d).startswith("msd-")]
        with DataService.start(cfg, cluster.scheduler_address) as svc:
            assert svc.planner._address == second
            assert next(svc.reader(0)).step == 0


def test_the_plugin_polls_a_service_on_a_cluster_in_this_process(corpus):
    """On a cluster in the owner's process (``LocalCluster(processes=False)``) the plugin's
    poll awaited the planner's published future, there the owner's, which its client did
    not hold: every poll failed with ``AttributeError`` and the service never reached the
    dashboard or ``/metrics`` (a review).  It is polled as on any cluster."""
    from distributed import LocalCluster

    async def poll(dask_scheduler):  # type: ignore[no-untyped-def]
        plugin = dask_scheduler.plugins["msd_dask"]
        t0 = time.monotonic()
        while plugin._client is None and time.monotonic() - t0 < 30:  # (its first period)
            await asyncio.sleep(0.1)
        await plugin.poll()
        return sorted(plugin.services), dict(plugin.poll_errors), \
            plugin.services.get("inproc", {}).get("planner", {}).get("steps_planned", 0)

    root, _ = corpus
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                      dashboard_address=None) as cluster:
        with DataService.start(config(root, name="inproc", timeout=30),
                               cluster.scheduler_address) as svc:
            assert next(svc.reader(0)).step == 0
            services, errors, planned = svc.client.run_on_scheduler(poll)
            assert (services, errors) == (["inproc"], {})
            assert planned >= 1


def test_two_handles_in_one_process_are_independent(corpus):
    """Two ranks' handles in one process (two datasets, two clients): the actor handles one
    fetched were bound to the other's client (the process's last one), so closing one made
    the other's reads fail after the whole timeout, naming a lost constructor (review)."""
    root, _ = corpus
    with DataService.start(config(root, name="twohandles", timeout=30), n_workers=1,
                           threads_per_worker=2) as svc:
        address = svc.client.scheduler.address
        a = DataService.connect(address, "twohandles")
        b = DataService.connect(address, "twohandles")
        a.refresh()  # (as a reader does, looking for re-created constructors)
        assert all(c._client is a.client for c in a.constructors)
        assert a.planner._client is a.client
        b.close()
        reader = a.reader(0)
        assert [next(reader).step for _ in range(3)] == [0, 1, 2]
        a.close()


def test_a_reader_state_of_another_service_is_refused(corpus):
    """Rank 0's state of service 'statea' after step 4, loaded into rank 0 of service
    'stateb' (another seed), was taken: 'stateb''s reader skipped its steps 0-4 without a
    word (a review).  A state names its service; another service's is refused, naming
    both, by the direct reader and the torch dataset, and the reader reads its own first
    step; a state without the service's name (an earlier version's) is still taken."""
    from msd_dask.torch import MsdIterableDataset

    root, _ = corpus
    one = {"parallel": {"dp": 1}, "timeout": 20}
    with DataService.start(config(root, name="statea", **one), n_workers=1,
                           threads_per_worker=2) as a, \
            DataService.start(config(root, name="stateb", seed=99, **one), a.address) as b:
        ra = a.reader(0)
        assert [next(ra).step for _ in range(5)] == [0, 1, 2, 3, 4]
        state = ra.state_dict()
        refused = (r"reader state of service 'statea' loaded into a reader of service "
                   r"'stateb' \(rank 0\): .* load the state rank 0 saved while reading "
                   r"'stateb', or none")
        rb = b.reader(0)
        with pytest.raises(ValueError, match=refused):
            rb.load_state_dict(state)
        assert next(rb).step == 0  # nothing of 'stateb' was skipped
        ds = MsdIterableDataset(b.address, "stateb", 0)
        with pytest.raises(ValueError, match=refused):
            ds.load_state_dict(state)
        assert state == {"service": "statea", "rank": 0, "step": 4}
        assert rb.state_dict() == {"service": "stateb", "rank": 0, "step": 0}
        rb.load_state_dict({"rank": 0, "step": 2})  # (saved without the name: not checked)
        assert next(rb).step == 3
        rb.close()


def _user_clients(dask_scheduler) -> list[str]:  # type: ignore[no-untyped-def]
    """The scheduler's clients of user processes (not the workers' own)."""
    return sorted(c for c in dask_scheduler.clients
                  if c.startswith("Client-") and not c.startswith(("Client-worker",
                                                                   "Client-msd-plugin")))


def test_a_handle_dropped_without_close_closes_its_client(corpus):
    """A ``DataService.connect`` handle (or a torch dataset) dropped without ``close()`` --
    the training loop raised -- left its Dask client connected until the process exited:
    the scheduler's cost per client, a socket, heartbeats, an IO thread (a review).  Its
    client closes once the handle is garbage-collected, after the dropped reader's report
    of its last step; a handle dropped while its reader is in use is not closed under it;
    and the close does not wait on the client's own IO loop when it runs there."""
    import gc

    from msd_dask.torch import MsdIterableDataset

    root, _ = corpus
    with DataService.start(config(root, name="dropped", parallel={"dp": 1}, timeout=20),
                           n_workers=1, threads_per_worker=2) as svc:
        mine = set(svc.client.run_on_scheduler(_user_clients))

        def others() -> set[str]:
            gc.collect()
            return set(svc.client.run_on_scheduler(_user_clients)) - mine

        def train() -> None:
            reader = DataService.connect(svc.address, "dropped").reader(0)
            for batch in reader:  # (the handle dropped at once: the reader keeps it)
                gc.collect()
                if batch.step == 2:
                    raise RuntimeError("loss is nan")

        with pytest.raises(RuntimeError, match="loss is nan"):
            train()
        assert wait_until(lambda: not others(), 10), others()
        assert svc.consumed_step() == 2  # (the dropped reader's report arrived first)

        for prefetch in (0, 2):
            ds = MsdIterableDataset(svc.address, "dropped", 0, prefetch=prefetch)
            ds.load_state_dict({"rank": 0, "step": svc.consumed_step()})
            it = iter(ds)
            next(it)
            assert len(others()) == 1
            del it, ds
            assert wait_until(lambda: not others(), 10), others()

        handle = DataService.connect(svc.address, "dropped")
        handle.client.loop.add_callback(handle._finalizer)  # (run on the client's IO loop)
        assert wait_until(lambda: handle.client.status == "closed", 10)
        handle.close()


def test_run_summary_compares_the_mix_with_the_weights_of_the_steps_served(corpus, tmp_path,
                                                                             capsys):
    """``msd-dask run``'s summary printed the planner's current weights, those of its last
    planned step (steps ahead): with a schedule that changes just after the steps served
    it compared the mix with the wrong target (review: 0.892 delivered against 0.5)."""
    import json

    import yaml

    from msd_dask.cli import main

    root, _ = corpus
    cfg = config(root, name="runmix")
    cfg["sources"][0]["weight"] = [{"until": 10, "weight": 0.9}, {"weight": 0.1}]
    cfg["sources"][1]["weight"] = 0.1
    path = tmp_path / "runmix.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path), "--steps", "10", "--workers", "1", "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    assert summary["mix"]["code"]["weight"] == pytest.approx(0.9)
    assert summary["mix"]["prose"]["weight"] == pytest.approx(0.1)
    # the run's embedded cluster is closed by the time the summary is printed: no link to it
    assert summary["dashboard"] is None
