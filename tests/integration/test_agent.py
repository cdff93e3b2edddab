"""The host agent on real processes: a `dask scheduler`, `dask worker`s, one `msd-dask agent`
for 4 ranks (2 DP groups x tp 2) and the ranks read in 2 other processes through it with
``MSD_DASK_AGENT`` set: every rank reads every step once and in order, TP peers the same
tensors, the same content as direct readers of an identical service; each batch leaves its
constructor once per DP group (half of what direct readers cause), the rank processes
hold no Dask client, and the agent never loads torch."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from msd_dask.service import DataService
from msd_dask.service.agent_client import AGENT_ENV, BLOCK_PREFIX, SHM_DIR

from checks import check_content, check_exactly_once, read_steps, record, wait_until
from cluster import dask_cluster, start_agent, start_serve, stop_proc
from corpus import config, write_corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: checks.py

#: a training process: read RANKS (comma-separated) for STEPS steps through the agent
#: named by MSD_DASK_AGENT, save the records, say so, and stay until a line on stdin
RANK_PROC = """
import pickle, sys
from msd_dask import DataService
from msd_dask.service.agent_client import AgentHandle
from checks import record

address, name, ranks, steps, out = sys.argv[1:6]
with DataService.connect(address, name, timeout=60) as svc:
    assert isinstance(svc, AgentHandle), type(svc)
    readers = [svc.reader(int(r)) for r in ranks.split(",")]
    recs = [record(next(rd)) for _ in range(int(steps)) for rd in readers]
    states = [rd.state_dict() for rd in readers]
    data_state = svc.state_dict(int(steps) - 1)  # what rank 0 saves (docs/resume.md)
    with open(out, "wb") as f:
        pickle.dump({"records": recs, "states": states, "data_state": data_state}, f)
    print("read", flush=True)
    sys.stdin.readline()
"""


def _clients(svc: DataService, cluster: dict[str, Any]) -> set[int]:
    """The processes outside the cluster with a Dask client at the scheduler: their pids as
    Dask's client ids hold them (``Client-<uuid1 with clock_seq = pid>``, 14 bits)."""
    def ids(dask_scheduler: Any) -> list[str]:
        return list(dask_scheduler.clients)

    inside = {_pid_bits(p.pid) for p in (cluster["scheduler"], *cluster["workers"])}
    return {uuid.UUID(i[-36:]).clock_seq for i in svc.client.run_on_scheduler(ids)
            if i.startswith("Client-")} - inside


def _pid_bits(pid: int) -> int:
    return pid & 0x3FFF


def _sent(svc: DataService) -> int:
    return sum(int(c["batches_sent"]) for c in svc.stats()["constructors"])


def _has_torch(pid: int) -> bool:
    """Whether process ``pid`` loaded torch (its libtorch is mapped into its memory)."""
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def _blocks_of(pid: int) -> list[str]:
    prefix = f"{BLOCK_PREFIX}{pid}-"
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def test_one_agent_serves_a_host_of_tp_ranks(tmp_path):
    root = str(tmp_path / "corpus")
    texts = write_corpus(root)
    steps = 12
    # rounds of one step, the agent one step ahead: the batches sent are exact
    cfg = config(root, name="agentit", parallel={"dp": 2, "tp": 2}, round_steps=1)
    sock = str(tmp_path / "agent.sock")
    env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env[AGENT_ENV] = sock  # the agent itself connects directly all the same
    agent = None
    ranks: list[subprocess.Popen] = []
    with dask_cluster(str(tmp_path), n_workers=2) as cl:
        svc = DataService.start(cfg, cl["address"])
        direct = DataService.start(dict(cfg, name="agentdirect"), cl["address"])
        try:
            assert _clients(svc, cl) == {_pid_bits(os.getpid())}  # the services' owner
            agent = start_agent(cl["address"], "agentit", sock, env, "0-3", "0,1; 2,3", prefetch=1)
            with_agent = {_pid_bits(os.getpid()), _pid_bits(agent.pid)}
            assert _clients(svc, cl) == with_agent  # the host's one client
            outs = [str(tmp_path / f"r{i}.pkl") for i in range(2)]
            # one process reads a rank of each DP group; TP peers are in the other process
            ranks = [subprocess.Popen([sys.executable, "-c", RANK_PROC, cl["address"], "agentit",
                                       rs, str(steps), out], env=env, cwd=HERE,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                     for rs, out in zip(("0,2", "1,3"), outs, strict=True)]
            for p in ranks:
                assert p.stdout.readline().strip() == "read", p.wait(60)
            # the rank processes, alive and done reading, hold no Dask client
            assert _clients(svc, cl) == with_agent
            assert not {_pid_bits(p.pid) for p in ranks} & with_agent
            # the agent served every step without torch; the ranks built their tensors
            assert not _has_torch(agent.pid)
            assert all(_has_torch(p.pid) for p in ranks)
            # each step left its constructor once per DP group; the agent reads at most
            # one step ahead of its slowest rank
            assert wait_until(lambda: _sent(svc) == 2 * (steps + 1), 30), _sent(svc)
            time.sleep(1.0)
            assert _sent(svc) == 2 * (steps + 1)
            owners_state = svc.state_dict(steps - 1)
            want = read_steps(direct, steps)  # 4 direct readers, one per rank
            assert _sent(direct) == 4 * steps
            for p in ranks:
                p.stdin.write("\n")
                p.stdin.flush()
                assert p.wait(60) == 0
            agent_pid = agent.pid
            stop_proc(agent)
            assert agent.returncode == 0, agent.stdout.read()
            assert _blocks_of(agent_pid) == [] and not os.path.exists(sock)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
            if agent is not None:
                stop_proc(agent)
                for name in _blocks_of(agent.pid):  # a failed run leaves nothing behind
                    os.unlink(os.path.join(SHM_DIR, name))
            direct.close()
            svc.close()
    recs = []
    for out in outs:
        with open(out, "rb") as f:
            got = pickle.load(f)
        recs.extend(got["records"])
        assert [s["step"] for s in got["states"]] == [steps - 1] * 2
        assert got["data_state"] == owners_state  # through the agent, the same state
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in recs:
        by_rank.setdefault(r["rank"], []).append(r)
    assert sorted(by_rank) == [0, 1, 2, 3]
    for rank, rs in by_rank.items():
        assert [r["step"] for r in rs] == list(range(steps)), rank
    expected = {(w["rank"], w["step"]): w for w in want}
    for r in recs:  # the same as direct readers of an identical service
        w = expected[(r["rank"], r["step"])]
        for key in ("input_ids", "labels", "position_ids"):
            np.testing.assert_array_equal(r[key], w[key], err_msg=f"{key} {r['rank']} {r['step']}")
        assert [c.tolist() for c in r["cu_seqlens"]] == [c.tolist() for c in w["cu_seqlens"]]
        assert r["documents"] == w["documents"] and r["epochs"] == w["epochs"]
        assert r["cost"] == w["cost"]
    for a, b in zip(by_rank[0], by_rank[1], strict=True):  # TP peers: identical tensors
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
    group = by_rank[0] + by_rank[2]  # one member per DP group
    check_content(group, texts, 512)
    check_exactly_once(group, texts, 512, min_complete=0)  # (12 steps: no piece twice)


def test_a_rank_without_a_running_agent_fails_at_once(tmp_path):
    sock = str(tmp_path / "none.sock")
    env = dict(os.environ, **{AGENT_ENV: sock})
    code = ("from msd_dask import DataService\n"
            "DataService.connect('tcp://127.0.0.1:9', 'agentit', timeout=60).reader(0)\n")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    took = time.monotonic() - t0
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert "ServiceError" in last and f"no msd-dask agent answers at {sock}" in last, res.stderr
    assert "is `msd-dask agent` running on this host?" in last
    assert took < 30, took  # the import, not a wait for the connect timeout


def test_a_group_that_failed_is_read_again_from_a_later_state(tmp_path):
    """An agent killed (-9) took the steps it had read ahead with it: a new agent cannot
    serve its ranks from their own states, and says which state to load.  A rank that
    loaded it got the same error again, for good: the group's failed reader was never
    replaced (found by a chaos run through agents).  It is read again from that state."""
    import re
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from msd_dask.errors import ServiceError
    from msd_dask.service.agent_client import AgentHandle

    root = str(tmp_path / "corpus")
    texts = write_corpus(root)
    cfg = config(root, name="again", parallel={"dp": 2}, timeout=30)
    sock = str(tmp_path / "agent.sock")
    with dask_cluster(str(tmp_path), n_workers=2) as cl, \
            DataService.start(cfg, cl["address"]) as svc:
        agent = start_agent(cl["address"], "again", sock, dict(os.environ), "0-1", "0; 1")
        try:
            with AgentHandle.connect(sock, "again") as h:
                recs = read_steps(h, 5, readers=[h.reader(r) for r in (0, 1)])
                assert wait_until(lambda: (svc.stats()["ranks"][0]["last_claimed"] or -1) > 4, 10)
        finally:
            stop_proc(agent, signal.SIGKILL)  # (its watcher removes its blocks)
        agent = start_agent(cl["address"], "again", sock, dict(os.environ), "0-1", "0; 1")
        try:
            with AgentHandle.connect(sock, "again") as h:
                readers = [h.reader(r) for r in (0, 1)]
                for rd in readers:
                    rd.load_state_dict({"rank": rd.rank, "step": 4})
                with pytest.raises(ServiceError, match="load the state of step") as info:
                    next(readers[0])
                k = int(re.search(r"state of step (\d+)", str(info.value)).group(1))
                assert k > 4
                again = [h.reader(r) for r in (0, 1)]
                for rd in again:
                    rd.load_state_dict({"rank": rd.rank, "step": k})
                # each rank in a thread of its own, as ranks read: the steps after k wait for
                # room that rank 1's group may hold (its old agent read ahead less than
                # rank 0's), which it gives up only once it asks
                with ThreadPoolExecutor(2) as pool:
                    later = [r for rs in pool.map(lambda rd: [record(next(rd)) for _ in range(5)],
                                                  again) for r in rs]
        finally:
            stop_proc(agent)
    assert [(r["rank"], r["step"]) for r in later] == [
        (rank, s) for rank in (0, 1) for s in range(k + 1, k + 6)]
    check_content(recs + later, texts, 512)
    check_exactly_once(recs + later, texts, 512, min_complete=0)  # (no piece twice)


@contextmanager
def _serving_with_agent(tmp_path: Any, name: str, sock: str) -> Iterator[tuple[Any, Any]]:
    """``msd-dask serve`` of service ``name`` over the test corpus on a cluster of one
    worker, and an agent of rank 0 on ``sock``: ``(serve, agent)``, both killed after."""
    import signal

    root = str(tmp_path / "corpus")
    write_corpus(root)
    with dask_cluster(str(tmp_path), n_workers=1) as cl:
        serve = start_serve(config(root, name=name, timeout=60), str(tmp_path), cl["address"])
        agent = start_agent(cl["address"], name, sock, dict(os.environ), "0", "0")
        try:
            yield serve, agent
        finally:
            stop_proc(agent, signal.SIGKILL)
            stop_proc(serve, signal.SIGKILL)


def test_an_agent_whose_service_was_closed_exits_saying_so(tmp_path):
    """After ``msd-dask serve`` was stopped (its owner closed the service) the agent served
    on, answering every rank "closed by its owner", and held its socket: the agent of the
    service's next run was refused, "an agent already serves" (a review of a torchrun job).
    Once a group's reader finds the service closed, the agent exits (status 2) saying so."""

    from msd_dask.errors import ServiceError
    from msd_dask.service.agent_client import AgentHandle

    from cluster import interrupt

    sock = str(tmp_path / "agent.sock")
    with _serving_with_agent(tmp_path, "agentclosed", sock) as (serve, agent):
        with AgentHandle.connect(sock, "agentclosed") as h:
            reader = h.reader(0)
            read_steps(h, 2, readers=[reader])
            interrupt([serve])  # Ctrl-C: serve closes the service and exits
            # (the rank is told the service closed, or, where it asks after the agent
            # exited, that it lost the agent: a CI run under load asked a moment late)
            with pytest.raises(ServiceError,
                               match=r"closed by its owner|stopped|lost the agent at .* did "
                                     r"`msd-dask agent` exit\?"):
                for _ in range(50):  # (its steps read ahead, then the closed service)
                    next(reader)
        out, _ = agent.communicate(timeout=30)
    assert agent.returncode == 2, out
    last = out.strip().splitlines()[-1]
    assert last.startswith("msd-dask agent: ") and "start an agent for the service's next run" \
        in last, out
    assert not os.path.exists(sock) and not _blocks_of(agent.pid)


def test_an_agent_with_no_rank_exits_once_its_service_is_closed(tmp_path):
    """An agent whose ranks were gone (the job ended, or failed) never learnt that
    ``msd-dask serve`` closed the service, and held its socket: the crash-recovery wrapper's
    next agent was refused (a review of the deployment docs).  It looks at whether the
    service is still published every ``PUBLISHED_EVERY`` seconds, and exits saying so."""
    import time

    from msd_dask.cli import PUBLISHED_EVERY

    from cluster import interrupt

    sock = str(tmp_path / "agent.sock")
    with _serving_with_agent(tmp_path, "agentidle", sock) as (serve, agent):
        interrupt([serve])  # Ctrl-C: serve closes the service and exits; no rank reads
        t0 = time.monotonic()
        out, _ = agent.communicate(timeout=PUBLISHED_EVERY + 30)
        took = time.monotonic() - t0
    assert agent.returncode == 2 and took < PUBLISHED_EVERY + 15, (took, out)
    last = out.strip().splitlines()[-1]
    assert "service 'agentidle' is no longer published" in last, out
    assert "start an agent for the service's next run" in last, out
    assert not os.path.exists(sock) and not _blocks_of(agent.pid)


def test_an_agent_whose_scheduler_is_lost_exits_saying_so(tmp_path):
    """Once its Dask client gave up on the scheduler, the agent served on: a rank waiting
    then was told only, at its timeout, that the agent waited for its step, the cause in
    the agent's log (a review).  It exits (status 2) naming the scheduler, as ``msd-dask
    serve`` does, and tells the ranks waiting why."""
    import signal

    from msd_dask.errors import ServiceError
    from msd_dask.service.agent_client import AgentHandle

    root = str(tmp_path / "corpus")
    write_corpus(root)
    sock = str(tmp_path / "agent.sock")
    env = dict(os.environ)
    with dask_cluster(str(tmp_path), n_workers=1) as cl:
        serve = start_serve(config(root, name="agentlost", timeout=60), str(tmp_path),
                            cl["address"])
        agent = start_agent(cl["address"], "agentlost", sock, env, "0", "0")
        try:
            with AgentHandle.connect(sock, "agentlost") as h:
                reader = h.reader(0)
                read_steps(h, 2, readers=[reader])
                cl["scheduler"].kill()  # kill -9: no goodbye to the clients
                cl["scheduler"].wait(10)
                t0 = time.monotonic()
                out, _ = agent.communicate(timeout=60)
                assert time.monotonic() - t0 < 25, out  # (10 s of grace, not Dask's 30)
                with pytest.raises(ServiceError):  # (its steps read ahead, then the agent gone)
                    for _ in range(50):
                        next(reader)
        finally:
            stop_proc(agent, signal.SIGKILL)
            stop_proc(serve, signal.SIGKILL)
    assert agent.returncode == 2, out
    last = out.strip().splitlines()[-1]
    assert last == (f"msd-dask agent: lost the scheduler at {cl['address']}; its ranks cannot be "
                    "served: restart the job from its last checkpoint once the service runs "
                    "again"), out
    assert not _blocks_of(agent.pid)
