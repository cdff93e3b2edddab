"""The default checkpoint: ``svc.state_dict()`` with no step, taken while ranks read in other
processes are stopped after returning step K - 1 in the middle of a round, is the state of
step K - 1, and a service resumed from it continues with step K exactly as the
uninterrupted run did; so too when the ranks read through a host agent that reads
ahead of them.  A rank that cannot say what it returned makes the call refuse."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time

import pytest

from msd_dask import DataService
from msd_dask.service.agent_client import AGENT_ENV, connect_agent

from checks import record
from cluster import start_agent, stop_proc
from corpus import config, write_corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: reader_proc.py
M = 6  # steps compared after the state


class Rank:
    """A training process reading one rank (``reader_proc.py --driven``): it reads a step
    when told to and otherwise waits, as a loop stopped at a checkpoint does."""

    def __init__(self, address: str, name: str, rank: int, out: str, agent: str | None = None):
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if agent is not None:  # read through the host agent on socket ``agent``
            env[AGENT_ENV] = agent
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "reader_proc.py"), address, name, str(rank),
             "0", out, "--driven"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self) -> None:
        self.proc.stdin.write("next\n")
        self.proc.stdin.flush()

    def answer(self) -> int:
        line = self.proc.stdout.readline()
        assert line, f"the reader process exited with {self.proc.wait(30)}"
        return int(line)

    def records(self) -> list[dict]:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        assert self.proc.wait(60) == 0
        with open(self.out, "rb") as f:
            return pickle.load(f)


def _constructors(svc: DataService) -> list[dict]:
    return [c.stats().result(timeout=30) for c in svc.constructors]


def _read_until_held(svc: DataService, ranks: list[Rank], first: int, at_least: int) -> int:
    """Read step by step on every rank (all ranks in step) from ``first``, at least
    ``at_least`` steps and until every rank holds a claimed step it has not returned; the
    last step returned."""
    for step in range(first, first + 30):
        for r in ranks:
            r.ask()
        assert [r.answer() for r in ranks] == [step] * len(ranks)
        if step - first + 1 >= at_least:
            claimed = {int(k): v for c in _constructors(svc) for k, v in c["last_claimed"].items()}
            if min(claimed.values()) > step:
                return step
    raise AssertionError("no step found where every rank holds a step it has not returned")


@pytest.mark.parametrize("through_agent", [False, True], ids=["direct", "agent"])
def test_default_state_after_step_k_resumes_with_step_k_plus_1(tmp_path, through_agent):
    """``through_agent``: the ranks read through one ``msd-dask agent``, which claims rounds
    up to ``prefetch`` steps ahead of them: the state is still the step they returned."""
    root = str(tmp_path / "corpus")
    write_corpus(root)
    # rounds of prefetch - 1 = 3 steps: a rank stopped mid-round holds claimed steps
    cfg = config(root, name="defckpt", prefetch=4)
    world = 2
    agent = None
    ranks: list[Rank] = []
    with DataService.start(cfg, n_workers=1, threads_per_worker=2) as svc:
        address = svc.client.scheduler.address
        sock = str(tmp_path / "agent.sock") if through_agent else None
        try:
            if sock is not None:  # one group per rank (dp=2), read ahead ``prefetch`` steps
                agent = start_agent(address, "defckpt", sock, dict(os.environ), "0-1", "0; 1")
            ranks = [Rank(address, "defckpt", r, str(tmp_path / f"r{r}.pkl"), sock)
                     for r in range(world)]
            # the training loop finished step k = last on every rank, which still holds
            # step k + 1 (and maybe more) of its round
            last = _read_until_held(svc, ranks, 0, at_least=5)
            before = sum(c["reports"] for c in _constructors(svc))
            state = svc.state_dict()  # at once: the readers have not reported yet
            cons = _constructors(svc)
            assert state["step"] == last, (state["step"], last)
            assert state == svc.state_dict(last)
            # each rank reported once at the pause: what it returned, nothing it holds
            reports = sum(c["reports"] for c in cons) - before
            assert reports == world, reports
            for c in cons:
                for r, s in c["returned"].items():
                    assert (s, c["returned_by"][r]) == (last, "pause"), (r, c)
            print(f"reports: {before} while reading {last + 1} steps, {reports} at the pause")
            # the uninterrupted run goes on
            for _ in range(M):
                for r in ranks:
                    r.ask()
                assert [r.answer() for r in ranks] == [last + 1 + _] * world
            full = [rec for r in ranks for rec in r.records()]
        finally:
            for r in ranks:
                if r.proc.poll() is None:
                    r.proc.kill()
            if agent is not None:
                stop_proc(agent)
    by_step = {(rec["step"], rec["rank"]): rec for rec in full}
    assert sorted(by_step) == [(s, r) for s in range(last + 1 + M) for r in range(world)]
    with DataService.start(cfg, resume=state, n_workers=1, threads_per_worker=2) as svc:
        readers = [svc.reader(r) for r in range(world)]
        got = [record(next(rd)) for _ in range(M) for rd in readers]
    assert [(g["step"], g["rank"]) for g in got] == [
        (s, r) for s in range(last + 1, last + 1 + M) for r in range(world)]
    for g in got:
        want = by_step[(g["step"], g["rank"])]
        assert g["documents"] == want["documents"], (g["step"], g["rank"])
        assert (g["input_ids"] == want["input_ids"]).all()


def test_default_state_behind_an_agent_reading_far_ahead(tmp_path):
    """An agent with ``--prefetch 40`` reads 40 steps ahead of its rank, and the planner
    plans past them: it kept the states of its last 26 steps only, so the state of the
    step the rank returned was gone, ``state_dict()`` and ``state_dict(k)`` were refused,
    and the error's advice (a later step) skipped steps never trained on (a review).  The
    states after the last step every rank returned are kept."""
    from msd_dask.roles.planner import kept_states

    root = str(tmp_path / "corpus")
    write_corpus(root)
    cfg = config(root, name="farahead", timeout=30, parallel={"dp": 1},
                 batch={"seq_len": 256, "micro_batches": 1})
    sock = str(tmp_path / "agent.sock")
    agent = None
    with DataService.start(cfg, n_workers=1, threads_per_worker=2) as svc:
        address = svc.client.scheduler.address
        try:
            agent = start_agent(address, "farahead", sock, dict(os.environ), "0-0", "0",
                                prefetch=40)
            handle = connect_agent("farahead", sock)
            reader = handle.reader(0)
            assert [next(reader).step for _ in range(3)] == [0, 1, 2]
            # the rank stops after step 2 (a checkpoint); its agent reads on, 40 steps ahead
            ahead = 2 + kept_states(svc.config) + 5
            deadline = time.monotonic() + 120
            while svc.stats()["planner"]["steps_planned"] < ahead:
                assert time.monotonic() < deadline, svc.stats()["planner"]
                time.sleep(0.2)
            assert svc.state_dict()["step"] == 2
            assert svc.state_dict(2)["step"] == 2 == handle.state_dict()["step"]
            reader.close()
            handle.close()
        finally:
            if agent is not None:
                stop_proc(agent)


def test_default_state_refuses_when_a_rank_cannot_report(tmp_path):
    """A rank killed while it held claimed steps never says what it returned: the call
    names the steps the answer lies between and asks for the step."""
    root = str(tmp_path / "corpus")
    write_corpus(root)
    cfg = config(root, name="defrefuse", prefetch=4)
    with DataService.start(cfg, n_workers=1, threads_per_worker=2) as svc:
        # (the call waits the readers' idle time, then this long for their reports: killed
        # ranks never send one, and the answer is the same after any margin)
        svc.report_margin = 0.5
        address = svc.client.scheduler.address
        ranks = [Rank(address, "defrefuse", r, str(tmp_path / f"r{r}.pkl")) for r in range(2)]
        try:
            last = _read_until_held(svc, ranks, 0, at_least=2)
            for r in ranks:
                r.proc.send_signal(signal.SIGKILL)
                r.proc.wait(30)
            with pytest.raises(ValueError, match=r"between -?\d+ and \d+.*state_dict\(step=N\)") as e:
                svc.state_dict()
            low, high = map(int, re.search(r"between (-?\d+) and (\d+)", str(e.value)).groups())
            assert low <= last < high, (low, last, high)
            assert svc.state_dict(last)["step"] == last  # the step, passed, is taken
        finally:
            for r in ranks:
                if r.proc.poll() is None:
                    r.proc.kill()


def test_default_state_counts_the_steps_a_prefetching_dataset_took(tmp_path):
    """``MsdIterableDataset(prefetch=p)``: the reader returned ``p`` steps the loop has not
    had yet, and the default state counts them; ``state_dict(ds.last_step)`` is the loop's."""
    from msd_dask.torch import MsdIterableDataset

    from checks import wait_until

    root = str(tmp_path / "corpus")
    write_corpus(root)
    with DataService.start(config(root, name="defprefetch", prefetch=4), n_workers=1,
                           threads_per_worker=2) as svc:
        address = svc.client.scheduler.address
        datasets = [MsdIterableDataset(address, "defprefetch", r, prefetch=2) for r in range(2)]
        try:
            its = [iter(ds) for ds in datasets]
            for step in range(4):
                assert [next(it)["step"] for it in its] == [step, step]
            assert wait_until(lambda: all(ds.ahead == 2 for ds in datasets), timeout=30)
            assert [ds.last_step for ds in datasets] == [3, 3]
            assert svc.state_dict()["step"] == 3 + 2  # what the readers returned
            assert svc.state_dict(datasets[0].last_step)["step"] == 3
        finally:
            for ds in datasets:
                ds.close()
