"""The host agent without Dask: a :class:`HostAgent` over fake group readers serves rank
readers in threads through its Unix socket and shared memory; every rank gets every step
once and in order, a group is read once, the agent stays at most ``prefetch`` steps ahead
of a group's slowest rank, and every wait that fails says what it waited for."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from msd_dask.batch import Batch
from msd_dask.core.config import Config, parse_config
from msd_dask.core.packing import from_wire, to_wire
from msd_dask.errors import ServiceError, ServiceTimeoutError
from msd_dask.service import DataService
from msd_dask.service.agent import (
    HostAgent,
    WireBatch,
    local_groups,
    new_block_name,
    own_folder,
    parse_ranks,
    write_block,
)
from msd_dask.service.agent_client import (
    AGENT_ENV,
    BLOCK_PREFIX,
    MAX_SOCKET_PATH,
    AgentHandle,
    AgentReader,
    agent_path,
    default_socket,
    frame,
    read_block,
    recv,
    send,
)

from checks import next_in_a_thread, wait_until
from corpus import config


def _config(**parallel: int) -> Config:
    return parse_config(config("/nonexistent", name="agentunit", timeout=5,
                               parallel=parallel or {"dp": 2, "tp": 2}))


def fake_payload(step: int, group: int, *, images: bool = False) -> dict[str, Any]:
    """A rank's packed batch (a constructor's, before :func:`to_wire`) whose every number
    says its step and group; numpy scalars among its plain fields, as a constructor's may."""
    base = 1000 * group + step
    ids = np.full((2, 8), base, dtype=np.int64)
    ids[1, 5:] = 0
    return {
        "step": np.int64(step), "input_ids": ids, "labels": ids + 1,
        "position_ids": np.tile(np.arange(8), (2, 1)),
        "cu_seqlens": [np.array([0, 3, 8], dtype=np.int32), np.array([0, 5], dtype=np.int32)],
        "documents": [[("code", f"f{base}.parquet:0", 0), ("prose", "p.jsonl:1", np.int64(2))],
                      [("code", f"f{base}.parquet:1", 0)]],
        "cost": np.float64(base) / 3, "epochs": [[0, np.int64(1)], [0]],
        "pixel_values": np.full((3, 12), step % 256, dtype=np.uint8) if images else None,
        "image_spans": [[(0, 3), None], [None]] if images else None,
    }


def fake_wire(step: int, group: int, **kw: Any) -> WireBatch:
    """:func:`fake_payload` as a group reader of the agent hands it out: its wire form."""
    return WireBatch(to_wire(fake_payload(step, group, **kw)))


def direct(batch: WireBatch, rank: int) -> Batch:
    """What a direct reader makes of the same payload."""
    return Batch.from_payload(from_wire(batch.wire), rank)


def assert_same(got: Batch, want: Batch) -> None:
    """Every field of ``got`` equals ``want``'s, the tensors with their dtypes."""
    assert (got.step, got.rank) == (want.step, want.rank)
    for name in ("input_ids", "labels", "position_ids", "cp_index", "pixel_values"):
        a, b = getattr(want, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (got.cu_seqlens is None) == (want.cu_seqlens is None)
    if want.cu_seqlens is not None and got.cu_seqlens is not None:
        assert [c.tolist() for c in got.cu_seqlens] == [c.tolist() for c in want.cu_seqlens]
        assert [c.dtype for c in got.cu_seqlens] == [c.dtype for c in want.cu_seqlens]
    assert got.documents == want.documents and got.epochs == want.epochs
    assert got.cost == want.cost and got.image_spans == want.image_spans
    assert got.num_tokens == want.num_tokens


class FakeGroupReader:
    """A group's reader: batches of steps ``0, 1, ...`` (after a loaded state); times out
    from ``fail_at`` on (or once at ``fail_once_at``), fails at ``error_at``, if given."""

    def __init__(self, group: int, ranks: list[int], fail_at: int | None = None,
                 delay: float = 0.0, fail_once_at: int | None = None,
                 error_at: int | None = None):
        self.group, self.ranks, self.fail_at, self.delay = group, ranks, fail_at, delay
        self.fail_once_at, self.error_at = fail_once_at, error_at
        self.timeouts = 0
        self.next_step = 0
        self.reads = 0
        self.loaded: list[Mapping[str, Any]] = []
        self.taken: int | None = None
        self.step_times: list[tuple[float, int | None]] = []

    def __next__(self) -> WireBatch:
        if self.delay:
            time.sleep(self.delay)
        if self.fail_at is not None and self.next_step >= self.fail_at:
            raise ServiceTimeoutError(f"rank {self.ranks[0]} waited 5s for step {self.next_step}")
        if self.error_at == self.next_step:  # (a reader loaded past it reads on)
            raise ServiceError(f"constructor 0 failed to build step {self.next_step}")
        if self.fail_once_at == self.next_step and not self.timeouts:
            self.timeouts += 1
            raise ServiceTimeoutError(f"rank {self.ranks[0]} waited 5s for step {self.next_step}")
        self.reads += 1
        self.next_step += 1
        return fake_wire(self.next_step - 1, self.group)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loaded.append(dict(state))
        self.next_step = int(state["step"]) + 1

    def report_step_time(self, seconds: float, step: int | None = None) -> None:
        self.step_times.append((seconds, step))

    def mark_taken(self, step: int) -> None:
        assert self.taken is None or step >= self.taken
        self.taken = step

    def report_returned(self) -> None:
        return None


def _blocks_left() -> list[str]:
    prefix = f"{BLOCK_PREFIX}{os.getpid()}-"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


@pytest.fixture(autouse=True)
def _short_start_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group whose other ranks never ask is read after the agent's START_GRACE (2 s);
    most tests here read one rank of a pair, so they wait it (2 s each, a minute of the
    suite): half a second does, as the test of the grace itself reads it here."""
    from msd_dask.service import agent as agent_module

    monkeypatch.setattr(agent_module, "START_GRACE", 0.5)


@contextmanager
def running_agent(tmp_path: Any, ranks: list[int], *, prefetch: int = 3,
                  cfg: Config | None = None, check_blocks: bool = True,
                  state: Any = None, **fake: Any) -> Iterator[tuple[HostAgent, dict]]:
    """A :class:`HostAgent` serving ``ranks`` in a thread; yields it and its fake readers
    (by the group's first rank).  Checks on exit that no block of this process is left
    (``check_blocks``: not while another agent of the process runs)."""
    cfg = cfg or _config()
    readers: dict[int, FakeGroupReader] = {}

    def open_reader(first: int, others: list[int]) -> FakeGroupReader:
        readers[first] = FakeGroupReader(cfg.parallel.coords(first)["dp"], [first, *others], **fake)
        return readers[first]

    agent = HostAgent("agentunit", cfg, ranks, open_reader, str(tmp_path / "agent.sock"),
                      prefetch=prefetch, state=state)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    assert agent.ready.wait(10)
    try:
        yield agent, readers
    finally:
        agent.stop()
        thread.join(10)
        assert not thread.is_alive()
        assert not os.path.exists(agent.path)
        assert not check_blocks or _blocks_left() == []


def _read(handle: AgentHandle, rank: int, steps: int, out: dict[int, list[Batch]],
          errors: list[BaseException]) -> None:
    try:
        reader = handle.reader(rank)
        out[rank] = [next(reader) for _ in range(steps)]
        reader.close()
    except BaseException as e:  # noqa: BLE001 - the test reports it
        errors.append(e)


def _pair(agent: HostAgent) -> tuple[AgentHandle, AgentReader, AgentReader]:
    """A handle on ``agent`` and readers of ranks 0 and 1."""
    handle = AgentHandle.connect(agent.path, "agentunit")
    return handle, handle.reader(0), handle.reader(1)


def test_readers_dropped_without_close_let_their_connections_go(tmp_path: Any) -> None:
    """``for batch in handle.reader(r): ... break``, once per evaluation: the handle held
    every such reader, so each kept its socket in the rank and a socket and a task in the
    agent until the handle closed (a review of the reader path)."""
    import gc

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))  # (the agent's sockets too: in a thread here)

    def settled(tasks: int, files: int) -> bool:
        gc.collect()
        return wait_until(lambda: len(agent._tasks) <= tasks and fds() <= files)

    with running_agent(tmp_path, [0]) as (agent, _readers):
        handle = AgentHandle.connect(agent.path, "agentunit")
        for step in range(21):
            for batch in handle.reader(0):
                assert batch.step == step
                break
            if step == 0:  # (the agent's reading of the rank's group has started)
                gc.collect()
                time.sleep(0.5)
                tasks, files = len(agent._tasks), fds()
        assert settled(tasks, files), (len(agent._tasks), tasks, fds(), files)
        assert len(handle._readers) == 0
        handle.close()


def test_parse_ranks_and_groups() -> None:
    assert parse_ranks("0-3") == [0, 1, 2, 3]
    assert parse_ranks("8-9,2,4-5") == [2, 4, 5, 8, 9]
    for bad in ("3-1", "a-b", "-1"):
        with pytest.raises(ValueError, match="ranks"):
            parse_ranks(bad)
    # a typo's billion ranks are refused before a list of them is built (review)
    with pytest.raises(ValueError, match="'0-1000000000' holds 1,000,000,001 ranks; one host "
                                         "serves at most 65,536"):
        parse_ranks("0-1000000000")
    # (the parts together: each under the limit, 131,072 ranks in two passed; a review)
    with pytest.raises(ValueError, match=r"131,072 ranks up to '65536-131071'; one host serves "
                                         r"at most 65,536"):
        parse_ranks("0-65535,65536-131071")
    assert len(parse_ranks("0-32767,32768-65535,0-9")) == 65_536
    assert local_groups(_config(), [0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert local_groups(_config(dp=2, tp=2, pp=2), [4, 5, 6, 7]) == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="outside"):
        local_groups(_config(), [4])


def test_agent_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AGENT_ENV, raising=False)
    assert agent_path("demo") is None
    assert agent_path("demo", True) == f"/tmp/msd-dask-{os.getuid()}/agent-demo.sock"
    assert agent_path("demo", "/x.sock") == "/x.sock"
    monkeypatch.setenv(AGENT_ENV, "/y.sock")
    assert agent_path("demo") == "/y.sock"
    assert agent_path("demo", False) is None
    monkeypatch.setenv(AGENT_ENV, "")
    assert agent_path("demo") is None


def _round_trip(batch: WireBatch, rank: int) -> Batch:
    """``batch`` written to a shared block and read back as ``rank``'s (the block unlinked;
    the message through JSON, as it goes over the socket)."""
    shm, msg = write_block(batch, new_block_name())
    try:
        return read_block(json.loads(json.dumps(msg)), rank)
    finally:
        shm.close()
        shm.unlink()


@pytest.mark.parametrize("images", [False, True])
def test_block_round_trip(images: bool) -> None:
    payload = fake_payload(7, 1, images=images)
    if images:
        payload["cp_index"] = np.arange(4, dtype=np.int64)
    batch = WireBatch(to_wire(payload))
    got = _round_trip(batch, 3)
    assert got.rank == 3 and got.step == 7
    want = direct(batch, 3)
    assert_same(got, want)
    assert (got.cp_index is not None) == images and (got.pixel_values is not None) == images
    assert got.input_ids is not None and got.input_ids.dtype == torch.long
    assert got.cu_seqlens is not None and all(c.dtype == torch.int32 for c in got.cu_seqlens)
    assert got.num_tokens == 13


def test_middle_pipeline_stage_block_has_no_tensors() -> None:
    payload = fake_payload(0, 0)
    payload["input_ids"] = payload["labels"] = payload["position_ids"] = None
    payload["cu_seqlens"] = None
    batch = WireBatch(to_wire(payload))
    got = _round_trip(batch, 1)
    assert got.input_ids is None and got.cu_seqlens is None and got.num_tokens == 0
    assert_same(got, direct(batch, 1))


#: a process writing two blocks as the agent does, then killed (no clean-up of its own)
KILLED_WRITER = """
import os, signal
import numpy as np
from multiprocessing import resource_tracker
from msd_dask.service.agent import WireBatch, write_block
from msd_dask.service.agent import new_block_name

blocks = [write_block(WireBatch({"step": s, "ids": np.arange(8)}), new_block_name())[0]
          for s in range(2)]
print(" ".join(b.name for b in blocks), resource_tracker._resource_tracker._pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_agent_leaves_no_block_and_starts_no_resource_tracker() -> None:
    """The agent's blocks are files under /dev/shm, not registered with Python's resource
    tracker (a python process per agent): a shell started with the first block removes
    those left once the agent is gone, killed too."""
    res = subprocess.run([sys.executable, "-c", KILLED_WRITER], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == -signal.SIGKILL, res.stderr
    *names, tracker = res.stdout.split()
    assert len(names) == 2 and tracker == "None"
    assert wait_until(lambda: not any(os.path.exists(os.path.join("/dev/shm", n)) for n in names),
                      timeout=10), names


def _watcher_after_a_block(name: str) -> int:
    """Write and free block ``name``; the pid of the watcher then running."""
    import msd_dask.service.agent as agent_module

    shm, _ = write_block(WireBatch(to_wire(fake_payload(1, 0))), name)
    shm.close()
    shm.unlink()
    assert agent_module._watcher is not None
    owner, shell, _fd = agent_module._watcher
    assert owner == os.getpid() and os.waitpid(shell, os.WNOHANG) == (0, 0)
    return shell


def test_a_dead_watcher_is_started_again() -> None:
    """The next block after the watcher died starts a new one (as SharedMemory restarts
    a dead resource tracker)."""
    first = _watcher_after_a_block(new_block_name())
    os.kill(first, signal.SIGKILL)

    def zombie() -> bool:  # dead, not reaped: the agent reaps it
        with open(f"/proc/{first}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"

    assert wait_until(zombie, timeout=10)
    assert _watcher_after_a_block(new_block_name()) != first


def _tracked_round_trip(name: str) -> None:
    """A batch written to block ``name`` is a tracked
    :class:`~multiprocessing.shared_memory.SharedMemory` and reads back the same."""
    from multiprocessing.shared_memory import SharedMemory

    batch = WireBatch(to_wire(fake_payload(2, 0)))
    shm, msg = write_block(batch, name)
    try:
        assert isinstance(shm, SharedMemory)
        assert_same(read_block(json.loads(json.dumps(msg)), 1), direct(batch, 1))
    finally:
        shm.close()
        shm.unlink()


def test_a_block_not_named_for_this_process_is_a_tracked_shared_memory() -> None:
    """A name outside this process's ``BLOCK_PREFIX<pid>-`` (the shell removes only those)
    gets a SharedMemory, which its resource tracker removes if the process is killed."""
    _tracked_round_trip(f"{BLOCK_PREFIX}x{os.getpid()}-rt")


def test_without_a_watcher_a_block_is_a_tracked_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the watcher cannot start (no ``/bin/sh``), the agent's blocks are
    SharedMemory, removed by Python's resource tracker if the agent is killed."""
    import msd_dask.service.agent as agent_module

    def no_shell(*args: Any, **kwargs: Any) -> int:
        raise FileNotFoundError(2, "No such file or directory", "/bin/sh")

    monkeypatch.setattr(agent_module, "_watcher", None)
    monkeypatch.setattr(agent_module.os, "posix_spawn", no_shell)
    _tracked_round_trip(new_block_name())


def test_every_rank_gets_every_step_once_in_order(tmp_path: Any) -> None:
    steps = 12
    with running_agent(tmp_path, [0, 1, 2, 3]) as (agent, readers):
        handle = DataService.connect("tcp://nowhere:1", "agentunit", agent=agent.path)
        assert isinstance(handle, AgentHandle) and handle.ranks == [0, 1, 2, 3]
        out: dict[int, list[Batch]] = {}
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_read, args=(handle, r, steps, out, errors))
                   for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert errors == []
        assert not any(t.is_alive() for t in threads) and sorted(out) == [0, 1, 2, 3]
        assert sorted(readers) == [0, 2]  # one reader per (dp, cp, pp) group
        assert readers[0].ranks == [0, 1] and readers[2].ranks == [2, 3]
        for rank, batches in out.items():
            assert [b.step for b in batches] == list(range(steps))
            assert all(b.rank == rank for b in batches)
            group = rank // 2
            for b in batches:
                assert_same(b, direct(fake_wire(b.step, group), rank))
        for a, b in zip(out[0], out[1], strict=True):  # tensor-parallel peers: the same
            assert torch.equal(a.labels, b.labels) and a.documents == b.documents
        for r in readers.values():
            assert r.reads <= steps + agent.prefetch
            # the state it reports: what every rank took (the last ack may be on its way)
            assert wait_until(lambda r=r: r.taken == steps - 1, 5), r.taken
        # every block every rank took is unlinked: those left hold the steps read ahead
        def ahead() -> int:
            return sum(r.reads - steps for r in readers.values())

        assert wait_until(lambda: len(_blocks_left()) == ahead() == 2 * agent.prefetch, 5), \
            (_blocks_left(), ahead())


def test_backpressure_and_a_slow_peer_is_named(tmp_path: Any) -> None:
    with running_agent(tmp_path, [0, 1], prefetch=2) as (agent, readers):
        handle = AgentHandle.connect(agent.path, "agentunit")
        fast, slow = handle.reader(0, timeout=1.0), handle.reader(1, timeout=1.0)
        t = threading.Thread(target=next, args=(slow,))
        t.start()
        assert next(fast).step == 0
        t.join(10)
        assert slow.step == 0
        assert [next(fast).step for _ in range(2)] == [1, 2]
        with pytest.raises(ServiceTimeoutError, match=r"rank 0 waited 1s for step 3 .*ahead "
                                                      r"of rank\(s\) \[1\]"):
            next(fast)
        assert readers[0].reads == 3  # never more than prefetch ahead of rank 1
        assert [next(slow).step for _ in range(3)] == [1, 2, 3]
        assert next(fast).step == 3
        handle.close()


def test_reading_starts_when_every_rank_of_the_group_asked(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from msd_dask.service import agent as agent_module

    monkeypatch.setattr(agent_module, "START_GRACE", 5.0)  # (longer than the reader waits)
    with running_agent(tmp_path, [0, 1]) as (agent, readers):
        handle = AgentHandle.connect(agent.path, "agentunit")
        r0 = handle.reader(0, timeout=0.5)
        with pytest.raises(ServiceTimeoutError, match=r"rank\(s\) \[1\] did not ask"):
            next(r0)
        assert readers == {}
        handle.close()


def test_one_thread_reads_a_group_one_rank_after_the_other(tmp_path: Any) -> None:
    """Without its peers, a group is read START_GRACE seconds after its first rank asked."""
    from msd_dask.service import agent as agent_module

    with running_agent(tmp_path, [0, 1], prefetch=2) as (agent, readers):
        handle, r0, r1 = _pair(agent)
        t0 = time.monotonic()
        got = [(next(r0).step, next(r1).step) for _ in range(5)]
        assert got == [(s, s) for s in range(5)]
        grace = agent_module.START_GRACE  # (this module's, see _short_start_grace)
        assert grace <= time.monotonic() - t0 < grace + 3
        handle.close()


def test_a_late_rank_behind_the_start_is_refused(tmp_path: Any) -> None:
    with running_agent(tmp_path, [0, 1]) as (agent, readers):
        handle, r0, r1 = _pair(agent)
        r0.load_state_dict({"rank": 0, "step": 3})
        assert next(r0).step == 4  # after START_GRACE, from step 4
        with pytest.raises(ServiceError, match=r"rank 1 asked .* for step 0, but the agent began "
                                               r"reading ranks \[0, 1\] after step 3"):
            next(r1)
        handle.close()


def test_load_state_dict_skips_and_the_group_reader_skips_too(tmp_path: Any) -> None:
    with running_agent(tmp_path, [0, 1]) as (agent, readers):
        handle, r0, r1 = _pair(agent)
        r0.load_state_dict({"rank": 0, "step": 4})
        r1.load_state_dict({"rank": 1, "step": 6})
        assert r0.state_dict() == {"service": "agentunit", "rank": 0, "step": 4}
        got: dict[int, list[int]] = {}
        t = threading.Thread(target=lambda: got.update({1: [next(r1).step for _ in range(2)]}))
        t.start()
        got[0] = [next(r0).step for _ in range(4)]
        t.join(10)
        assert got == {0: [5, 6, 7, 8], 1: [7, 8]}
        # the lowest step both have
        assert readers[0].loaded == [{"service": "agentunit", "rank": 0, "step": 4}]
        assert r0.state_dict() == {"service": "agentunit", "rank": 0, "step": 8}
        with pytest.raises(ValueError, match="rank 1 loaded into rank 0"):
            r0.load_state_dict({"rank": 1, "step": 3})
        handle.close()


def test_an_agents_reader_refuses_an_older_state_once_it_returned_batches(
        tmp_path: Any) -> None:
    """A reader behind the agent that returned step 8 kept a state of step 3 loaded then
    without a word and read on from 8: the rank believed it went back.  It now refuses it,
    naming both steps, and reads on; its own step or a later one it takes."""
    from msd_dask.errors import ServiceError

    with running_agent(tmp_path, [0, 1]) as (agent, readers):
        handle, r0, r1 = _pair(agent)
        got: dict[int, list[int]] = {}
        t = threading.Thread(target=lambda: got.update({1: [next(r1).step for _ in range(4)]}))
        t.start()
        got[0] = [next(r0).step for _ in range(2)]
        for state in ({"rank": 0, "step": 0}, {"rank": 0, "step": None}):
            with pytest.raises(ServiceError, match=r"rank 0: a reader at step 1 cannot load "
                               r"(the state of step 0|a state of no step)"):
                r0.load_state_dict(state)
        assert r0.state_dict() == {"service": "agentunit", "rank": 0, "step": 1}
        r0.load_state_dict({"rank": 0, "step": 1})  # its own: nothing changes
        got[0] += [next(r0).step]
        r0.load_state_dict({"rank": 0, "step": 3})  # a later one: step 3 is skipped
        got[0] += [next(r0).step]
        t.join(10)
        assert got == {0: [0, 1, 2, 4], 1: [0, 1, 2, 3]}
        # the handle's next reader of rank 0 starts after step 4; a state of no step loaded
        # into it before its first batch is its position, and the one after it starts there
        # too (a direct reader's ledger did so, the agent's kept step 4)
        again = handle.reader(0)
        assert again.state_dict() == {"service": "agentunit", "rank": 0, "step": 4}
        again.load_state_dict({"rank": 0, "step": None})
        assert handle.reader(0).state_dict() == {"service": "agentunit", "rank": 0, "step": None}
        handle.close()


def test_step_times_are_forwarded(tmp_path: Any) -> None:
    with running_agent(tmp_path, [0, 1]) as (agent, readers):
        handle, r0, r1 = _pair(agent)
        with pytest.raises(ValueError, match="no step"):
            r0.report_step_time(1.0)
        t = threading.Thread(target=next, args=(r1,))
        t.start()
        next(r0)
        t.join(10)
        r0.report_step_time(0.25)
        r1.report_step_time(0.5, step=0)
        # a time that is no finite number of seconds >= 0 is the caller's error, at the call:
        # a NaN sent on ended the rank's connection, and its next batch named a malformed
        # message (a review of the cost fit)
        for bad in (float("nan"), float("inf"), -1.0, "1.0", True):
            with pytest.raises(ValueError, match=rf"rank 0: report_step_time takes .* got "
                                                 rf"{re.escape(repr(bad))}"):
                r0.report_step_time(bad)  # type: ignore[arg-type]
        assert r0.step == 0 and r0.report_step_time(0.125) is None
        handle.close()
        deadline = time.monotonic() + 5
        while len(readers[0].step_times) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(readers[0].step_times) == [(0.125, 0), (0.25, 0), (0.5, 0)]


def test_a_failed_group_reader_is_told_to_its_ranks(tmp_path: Any) -> None:
    with running_agent(tmp_path, [0, 1], fail_at=1) as (agent, _):
        handle, r0, r1 = _pair(agent)
        t = threading.Thread(target=next, args=(r1,))
        t.start()
        assert next(r0).step == 0
        t.join(10)
        with pytest.raises(ServiceTimeoutError, match=r"could not read ranks \[0, 1\].*waited 5s"):
            next(r0)
        handle.close()


def test_a_failed_group_reader_still_serves_the_steps_it_read_before(tmp_path: Any) -> None:
    """The group's reader reads steps 0-2, then fails (not a timeout).  A rank taking the
    steps read before the failure counted as one that had loaded a later state: the group
    was reset, the blocks its peer was handed unlinked under it, and the peer refused
    with advice to load a state nobody had loaded (a review of the agent).  Each rank
    now gets steps 0-2, then the error; the group is read again only for a rank asking
    from past every step read (a later state loaded)."""
    with running_agent(tmp_path, [0, 1], error_at=3) as (agent, readers):
        handle, r0, r1 = _pair(agent)
        t = threading.Thread(target=next, args=(r1,))
        t.start()
        assert next(r0).step == 0
        t.join(10)
        first = readers[0]
        assert wait_until(lambda: agent.groups[0].error is not None, 10)  # step 3 failed
        assert [next(r0).step, next(r0).step] == [1, 2]
        assert [next(r1).step, next(r1).step] == [1, 2]  # its blocks are still there
        for reader in (r0, r1):
            with pytest.raises(ServiceError, match=r"could not read ranks \[0, 1\]: "
                                                   r"ServiceError: constructor 0 failed"):
                next(reader)
        assert readers[0] is first  # not read again
        for rank, reader in ((0, r0), (1, r1)):  # a later state loaded: read again from it
            reader.load_state_dict({"rank": rank, "step": 5})
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(next(r1).step))
        t.start()
        assert next(r0).step == 6
        t.join(10)
        assert got == [6] and readers[0] is not first and readers[0].loaded == [
            {"service": "agentunit", "rank": 0, "step": 5}]
        handle.close()


def _past_the_failure(agent: HostAgent, timeout: float) -> tuple[AgentHandle, AgentReader,
                                                                  AgentReader]:
    """Ranks 0 and 1 of a group whose reader fails at step 3: rank 1 has taken step 0, and
    rank 0 (``timeout``) steps 0-2 and the error, then loads the state of step 5."""
    handle = AgentHandle.connect(agent.path, "agentunit")
    r0, r1 = handle.reader(0, timeout=timeout), handle.reader(1, timeout=10)
    t = threading.Thread(target=next, args=(r1,))
    t.start()
    assert next(r0).step == 0
    t.join(10)
    assert wait_until(lambda: agent.groups[0].error is not None, 10)  # step 3 failed
    assert [next(r0).step, next(r0).step] == [1, 2]
    with pytest.raises(ServiceError, match="constructor 0 failed"):
        next(r0)
    r0.load_state_dict({"rank": 0, "step": 5})
    return handle, r0, r1


def test_a_rank_past_a_failure_waits_for_its_peers_to_take_the_steps_read_before(
        tmp_path: Any) -> None:
    """The group's reader fails at step 3; rank 0 takes steps 0-2 and the error, loads a
    later state and asks again while rank 1 has taken step 0 alone: the group was read
    again at once, the blocks of steps 1 and 2 unlinked under rank 1 and its record
    cleared, so it was refused the steps its peer trained on (a review of the agent).
    Rank 0 now waits until rank 1 has them, then the group is read from its state."""
    with running_agent(tmp_path, [0, 1], error_at=3) as (agent, readers):
        handle, r0, r1 = _past_the_failure(agent, 10)
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(next(r0).step))
        t.start()
        time.sleep(0.3)
        assert sorted(agent.groups[0].blocks) == [1, 2] and got == []  # kept for rank 1
        assert [next(r1).step, next(r1).step] == [1, 2]
        t.join(10)
        assert got == [6]  # then read again from rank 0's state
        r1.load_state_dict({"rank": 1, "step": 5})
        assert next(r1).step == 6
        handle.close()


def test_a_rank_past_a_failure_is_told_which_peers_it_waited_for(tmp_path: Any) -> None:
    """As above, with rank 1 never taking the steps read before the failure: rank 0's wait
    ends at its timeout, naming rank 1 and the steps."""
    with running_agent(tmp_path, [0, 1], error_at=3) as (agent, readers):
        handle, r0, r1 = _past_the_failure(agent, 1)
        with pytest.raises(ServiceTimeoutError, match=r"waited 1s for rank\(s\) \[1\] of its "
                                                       r"group to take those steps first"):
            next(r0)
        assert sorted(agent.groups[0].blocks) == [1, 2]
        handle.close()


def test_a_rank_past_a_failure_is_answered_by_the_agent_within_its_timeout(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, rank 1 taking the steps read before the failure after 1.2 s of rank 0's
    2 s: the agent waited up to the rank's ``timeout`` for the peer, then up to the
    ``timeout`` again for the step, while the rank's socket waits the ``timeout`` and
    ANSWER_MARGIN only, so the rank gave up first and blamed the agent ("got no answer;
    is `msd-dask agent` running?") while it ran and waited (a review of the agent).  One
    deadline bounds the agent's whole answer: the rank hears, within its ``timeout``, the
    agent's own account of what it waited for."""
    from msd_dask.service import agent as agent_module
    from msd_dask.service import agent_client

    monkeypatch.setattr(agent_client, "ANSWER_MARGIN", 0.5)
    # (rank 1 does not ask again, so the group read again waits for it this long)
    monkeypatch.setattr(agent_module, "START_GRACE", 5.0)
    with running_agent(tmp_path, [0, 1], error_at=3) as (agent, readers):
        handle, r0, r1 = _past_the_failure(agent, 2)

        def peer() -> None:
            time.sleep(1.2)  # (it computes)
            assert [next(r1).step, next(r1).step] == [1, 2]

        t = threading.Thread(target=peer)
        t.start()
        t0 = time.monotonic()
        with pytest.raises(ServiceTimeoutError, match=r"rank 0 waited 2s for step 6 from the "
                                                       r"agent at .*rank\(s\) \[1\] did not ask"):
            next(r0)
        assert time.monotonic() - t0 < 2.4  # (before the rank's own 2.5 s)
        t.join(10)
        handle.close()


def test_a_group_readers_timeout_is_told_once_and_the_agent_reads_on(tmp_path: Any) -> None:
    """The service is slow once (the group's reader times out at step 2): the ranks waiting
    get the timeout, as a direct reader's would, and their next requests get steps 2, 3, 4
    (a timeout used to end the group's reading for good: every later request failed).
    Each read takes 0.3 s, so the ranks wait for step 2 when its read times out."""
    with running_agent(tmp_path, [0, 1], fail_once_at=2, delay=0.3) as (_agent, readers):
        handle = AgentHandle.connect(_agent.path, "agentunit")
        r0, r1 = handle.reader(0, timeout=10), handle.reader(1, timeout=10)
        got: dict[int, list[Any]] = {0: [], 1: []}

        def read(rank: int, reader: Any) -> None:
            for _ in range(6):
                try:
                    got[rank].append(next(reader).step)
                except ServiceTimeoutError as e:
                    got[rank].append(str(e))

        threads = [threading.Thread(target=read, args=(r, rd)) for r, rd in ((0, r0), (1, r1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for rank in (0, 1):
            assert got[rank][:2] == [0, 1] and got[rank][3:] == [2, 3, 4], got
            assert re.search(r"could not read ranks \[0, 1\].*waited 5s for step 2", got[rank][2])
        assert readers[0].timeouts == 1 and readers[0].reads <= 5 + _agent.prefetch
        handle.close()


def test_a_stop_before_the_agent_serves_is_not_lost(tmp_path: Any) -> None:
    """``stop()`` before ``run()`` began serving (a signal right after ``msd-dask agent``
    installed its handlers): the agent stops as soon as it serves (it used to serve on)."""
    agent = HostAgent("agentunit", _config(), [0, 1], lambda f, o: FakeGroupReader(0, [f, *o]),
                      str(tmp_path / "agent.sock"))
    agent.stop()
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and not os.path.exists(agent.path)


@pytest.mark.parametrize("reason", [None, "lost the scheduler at tcp://198.18.0.1:8786"])
def test_a_closing_agent_is_told_to_waiting_ranks(tmp_path: Any, reason: str | None) -> None:
    """...and why, where the agent stops for a reason (``msd-dask agent`` that lost its
    scheduler: its ranks were told only that the agent waited for their step)."""
    with running_agent(tmp_path, [0, 1]) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")
        r0 = handle.reader(0, timeout=30)
        t, errors = next_in_a_thread(r0)
        time.sleep(0.3)
        agent.stop(reason)
        t.join(10)
        assert len(errors) == 1 and isinstance(errors[0], ServiceError)
        said = str(errors[0])
        assert f"the agent at {agent.path} is closing (rank 0 waited for step 0)" in said
        assert said.endswith("closing (rank 0 waited for step 0)" if reason is None
                             else f": {reason}"), said


def test_refused_ranks_and_services(tmp_path: Any) -> None:
    with running_agent(tmp_path, [2, 3]) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")
        with pytest.raises(ServiceError, match=r"serves ranks 2-3 .*not rank 0"):
            handle.reader(0)
        with pytest.raises(ServiceError, match="serves service 'agentunit', not 'other'"):
            AgentHandle.connect(agent.path, "other")


@pytest.mark.parametrize("rank", [4, 1000, -1])
def test_a_rank_outside_the_world_is_refused_behind_an_agent_as_directly(tmp_path: Any,
                                                                         rank: int) -> None:
    """A rank outside the mesh, read through an agent that serves the whole world, was told
    to start the agent with ``--ranks`` covering it, which the agent refuses at start (a
    review): it gets a direct reader's ``ValueError``, from the rank's handle, and the
    agent's own refusal of such a hello says the same."""
    import socket

    with running_agent(tmp_path, [0, 1, 2, 3]) as (agent, _):  # (dp=2 tp=2: 4 ranks)
        handle = AgentHandle.connect(agent.path, "agentunit")
        with pytest.raises(ValueError, match=rf"^rank {rank} is outside \[0, 4\): service "
                                             r"'agentunit' is laid out for 4 ranks "
                                             r"\(dp=2 tp=2 cp=1 pp=1\)$"):
            handle.reader(rank)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(agent.path)
        sock.sendall(frame({"op": "hello", "rank": rank, "service": "agentunit"}))
        assert recv(sock) == {"error": f"rank {rank} is outside [0, 4): service 'agentunit' "
                                       "is laid out for 4 ranks (dp=2 tp=2 cp=1 pp=1)"}
        sock.close()
        handle.close()


@pytest.mark.parametrize("prefetch", [79, 1000, 2.5, 0])
def test_an_agent_reading_further_ahead_than_the_states_kept_is_refused(tmp_path: Any,
                                                                        prefetch: Any) -> None:
    """The service keeps the states of the steps a rank may be at back to what its agent
    took, up to 4 x kept_states: an agent reading further ahead left its ranks' step with
    no state, and ``state_dict()`` was refused (a review).  Its ``prefetch`` is at most
    ``agent_prefetch_limit`` (78 at the service's prefetch 4), a whole number (2.5 was
    read as 2)."""
    from msd_dask.roles.planner import agent_prefetch_limit

    cfg = _config()
    assert agent_prefetch_limit(cfg) == 3 * (4 + 2 * 3 + 16) == 78
    path = str(tmp_path / "a.sock")
    with pytest.raises(ValueError, match=rf"^the agent's prefetch must be a whole number from 1 "
                                         rf"to 78 \(.*\), got {prefetch!r}$"):
        HostAgent("agentunit", cfg, [0], lambda f, o: FakeGroupReader(0, [f]), path,
                  prefetch=prefetch)
    assert HostAgent("agentunit", cfg, [0], lambda f, o: FakeGroupReader(0, [f]), path,
                     prefetch=78).prefetch == 78


def test_no_agent_fails_at_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AGENT_ENV, str(tmp_path / "none.sock"))
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match=r"no msd-dask agent answers at .*none\.sock.*"
                                           r"is `msd-dask agent` running"):
        DataService.connect("tcp://nowhere:1", "agentunit", timeout=30)
    assert time.monotonic() - t0 < 2


def test_a_stale_socket_is_replaced(tmp_path: Any) -> None:
    import socket

    path = str(tmp_path / "agent.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)  # bound, never listening: what a killed agent leaves
    s.close()
    with running_agent(tmp_path, [0, 1]) as (agent, _):
        assert AgentHandle.connect(agent.path, "agentunit").ranks == [0, 1]
        with pytest.raises(ServiceError, match="already serves"):
            HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]),
                      agent.path).run()


def test_a_socket_path_naming_a_file_is_refused_and_the_file_kept(tmp_path: Any) -> None:
    """``--socket`` naming an existing file that is no socket (a typo: the agent's own log,
    say): it was taken for a stale socket and deleted (a review of the agent).  The agent
    refuses it, naming the path, and leaves the file as it was."""
    victim = tmp_path / "agent.log"
    victim.write_text("important log lines\n")
    agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]),
                      str(victim))
    stopper = threading.Timer(5, agent.stop)  # (one that serves there is stopped)
    stopper.start()
    try:
        with pytest.raises(ServiceError, match=rf"socket path {re.escape(str(victim))} names "
                                               r"an existing file that is not a socket; pass "
                                               r"another --socket"):
            agent.run()
    finally:
        stopper.cancel()
    assert victim.read_text() == "important log lines\n"


def test_a_socket_path_locked_by_a_stuck_process_is_an_error_naming_it(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent starting waited for good on the lock of its socket path held by another
    process (an agent stuck while binding), saying nothing (a review of the agent)."""
    import fcntl

    from msd_dask.service import agent as agent_module

    monkeypatch.setattr(agent_module, "BIND_WAIT", 0.5)
    path = str(tmp_path / "agent.sock")
    held = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]), path)
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match=rf"another process held {re.escape(path)}\.lock "
                                               r"for 0\.5s"):
            agent.run()
        assert time.monotonic() - t0 < 5
    finally:
        os.close(held)


def test_a_stop_inside_the_agents_own_locked_section_returns(tmp_path: Any) -> None:
    """msd-dask agent's signal handler calls stop() in the main thread, which may be inside
    serve()'s locked section when the signal comes: a lock that is not re-entrant then
    never returns (a review of the agent)."""
    agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]),
                      str(tmp_path / "agent.sock"))
    done = threading.Event()

    def signal_inside() -> None:
        with agent._stop_lock:  # (where the signal handler may interrupt the main thread)
            agent.stop()
        done.set()

    threading.Thread(target=signal_inside, daemon=True).start()
    assert done.wait(5)
    agent.run()  # a stop asked before serve began: it returns at once


def _start_two_at_once(path: str) -> None:
    """Two agents on ``path``, started at one moment: one serves, the other is refused;
    stopping the one that serves removes the socket."""
    agents = [HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]), path)
              for _ in range(2)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def go(agent: HostAgent) -> None:
        barrier.wait()
        try:
            agent.run()
        except ServiceError as e:
            errors.append(e)

    threads = [threading.Thread(target=go, args=(a,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    assert wait_until(lambda: sum(a.ready.is_set() for a in agents) + len(errors) == 2, 10), \
        "both agents started or were refused within 10 s"
    serving = [a for a in agents if a.ready.is_set()]
    assert len(serving) == 1 and len(errors) == 1, (len(serving), errors)
    assert "already serves" in str(errors[0])
    assert AgentHandle.connect(path, "agentunit").ranks == [0]
    serving[0].stop()
    for t in threads:
        t.join(10)
    assert not os.path.exists(path)


def test_two_agents_started_at_once_on_one_socket_one_serves(tmp_path: Any) -> None:
    """Two agents started at the same moment on one path: both passed the check for a
    live socket, then asyncio removed the file and bound its own, so both served, the
    first unreachable (8 of 30 starts, review), and its exit removed the live one's file."""
    for _ in range(10):
        _start_two_at_once(str(tmp_path / "race.sock"))


def test_the_torch_adapter_reads_through_the_agent(tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from msd_dask.torch import MsdIterableDataset

    with running_agent(tmp_path, [0, 1]) as (agent, readers):
        monkeypatch.setenv(AGENT_ENV, agent.path)
        sets = [MsdIterableDataset("tcp://nowhere:1", "agentunit", r, steps=3) for r in (0, 1)]
        sets[1].load_state_dict({"rank": 1, "step": 0})
        got: dict[int, list[int]] = {}
        t = threading.Thread(target=lambda: got.update({1: [b["step"] for b in sets[1]]}))
        t.start()
        got[0] = [b["step"] for b in sets[0]]
        t.join(10)
        assert got == {0: [0, 1, 2], 1: [1, 2, 3]}
        sets[0].report_step_time(0.5)
        assert sets[1].state_dict() == {"service": "agentunit", "rank": 1, "step": 3}
        for ds in sets:
            ds.close()
        assert wait_until(lambda: readers[0].step_times == [(0.5, 2)], 5)


#: a rank process reading STEPS batches through the torch adapter behind the agent named
#: by MSD_DASK_AGENT, then printing its steps and the modules it imported
LEAN_RANK = """
import json, sys
from msd_dask.torch import MsdIterableDataset

ds = MsdIterableDataset("tcp://nowhere:1", "agentunit", int(sys.argv[1]), steps=2)
steps = [b["step"] for b in ds]
ds.close()
print(json.dumps({"steps": steps, "modules": sorted(sys.modules)}))
"""

#: the whole of msd_dask a rank behind an agent needs: its batch, the wire form and the
#: agent's client (not the service's handle, the config, the direct reader, nor yaml)
RANK_SIDE = {"msd_dask", "msd_dask.errors", "msd_dask.batch", "msd_dask.core",
             "msd_dask.core.packing", "msd_dask.service", "msd_dask.service.agent_client",
             "msd_dask.torch"}


def test_a_rank_behind_the_agent_imports_only_the_agents_client(tmp_path: Any) -> None:
    """Two rank processes read through the torch adapter behind an agent (each a rank of
    one TP group): they get their steps, and import of msd_dask only
    :data:`RANK_SIDE`, no Dask and no yaml (each rank's modules cost its host memory,
    docs/benchmarks.md, Memory)."""
    with running_agent(tmp_path, [0, 1]) as (agent, _readers):
        env = {**os.environ, AGENT_ENV: agent.path}
        procs = [subprocess.Popen([sys.executable, "-c", LEAN_RANK, str(r)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in (0, 1)]
        outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        got = json.loads(out.strip().splitlines()[-1])
        assert got["steps"] == [0, 1]
        mods = set(got["modules"])
        assert {m for m in mods if m.startswith("msd_dask")} == RANK_SIDE
        assert not {"distributed", "dask", "tornado", "yaml", "pyarrow", "fsspec"} & {
            m.split(".")[0] for m in mods}


def test_service_operations_through_the_agent_say_where_to_call_them(tmp_path: Any) -> None:
    """A rank behind the agent has no Dask client: ``stats()``, ``set_weights()`` etc. raise
    one clear error naming the agent and what to do, not a bare ``AttributeError``."""
    import inspect

    from msd_dask.service.agent_client import DIRECT_ONLY, AgentHandle

    # every operation of DataService that the agent's handle lacks is named
    ops = {a for a, v in inspect.getmembers(DataService)
           if not a.startswith("_") and (callable(v) or isinstance(v, property))}
    assert ops - set(dir(AgentHandle)) <= DIRECT_ONLY
    assert DIRECT_ONLY - {"client"} <= ops
    with running_agent(tmp_path, [0, 1]) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")
        for op in ("stats", "set_weights", "consumed_step", "client"):
            with pytest.raises(AttributeError, match=rf"DataService\.{op} is not available "
                               r"through the host agent .*agent=False"):
                getattr(handle, op)
        with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
            handle.nonsense  # noqa: B018 - the attribute access is what is tested
        assert not hasattr(handle, "stats")
        handle.close()


def test_an_answer_after_the_rank_gave_up_is_not_taken_for_the_next_request(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that stopped waiting (its agent answered late: a stalled event loop, say)
    and asks again gets every step once: the late answer to the request it gave up on
    is not read as the answer to the next one."""
    from msd_dask.service import agent_client

    # the rank gives up 0.7 s before the agent's own timeout: its answer comes late
    monkeypatch.setattr(agent_client, "ANSWER_MARGIN", -0.7)
    with running_agent(tmp_path, [0], delay=0.5) as (agent, _readers):
        handle = AgentHandle.connect(agent.path, "agentunit")
        reader = handle.reader(0, timeout=1.0)
        with pytest.raises(ServiceTimeoutError, match="step 0"):
            next(reader)  # gave up after 0.3 s; the agent answers step 0 at 0.5 s
        time.sleep(2.0)  # the agent holds steps 0-2 now: the next requests are answered at once
        steps = [next(reader).step for _ in range(3)]
        handle.close()
    assert steps == [0, 1, 2]


def test_two_agents_in_one_process_name_their_blocks_apart(tmp_path: Any) -> None:
    """Two agents of one process (or of two processes with the same pid sharing
    ``/dev/shm``: containers of one host) numbered their blocks alike from 0: the second's
    first block failed with FileExistsError and its group with it."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with running_agent(tmp_path / "a", [0]) as (first, _), \
            running_agent(tmp_path / "b", [0], check_blocks=False) as (second, _):
        for agent in (first, second):
            handle = AgentHandle.connect(agent.path, "agentunit")
            reader = handle.reader(0)
            assert [next(reader).step for _ in range(3)] == [0, 1, 2]
            handle.close()


def test_a_full_shm_is_an_error_naming_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block that does not fit in what is left of ``/dev/shm`` (64 MiB in a default
    Docker container): the agent was killed by SIGBUS at its first write through the
    mapping, saying nothing; it is an OSError naming the directory and what to do."""
    import subprocess

    from msd_dask.service import agent as agent_module

    small = tmp_path / "shm"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    try:
        monkeypatch.setattr(agent_module, "SHM_DIR", str(small))
        batch = WireBatch({"step": 0, "ids": np.zeros(1 << 20, dtype=np.int32)})  # 4 MiB
        with pytest.raises(OSError, match=rf"no room in {small} for a block of 4,194,304 bytes"):
            write_block(batch, new_block_name())
        assert os.listdir(small) == []
        shm, _ = write_block(WireBatch({"step": 1, "ids": np.zeros(1024, dtype=np.int32)}),
                             new_block_name())  # what fits still does
        shm.close()
        shm.unlink()
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_the_agents_timeout_is_its_ranks_default(tmp_path: Any) -> None:
    """``msd-dask agent --timeout 600`` against a service of ``timeout: 300``: the ranks were
    told 300 s, so a rank gave up ("the agent is waiting for step N") while its agent still
    waited for the step (review)."""
    agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]),
                      str(tmp_path / "t.sock"), timeout=600.0)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    assert agent.ready.wait(10)
    try:
        handle = AgentHandle.connect(agent.path, "agentunit")
        assert handle.timeout == 600.0 and handle.reader(0).timeout == 600.0
        handle.close()
    finally:
        agent.stop()
        thread.join(10)
    default = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]),
                        str(tmp_path / "d.sock"))
    assert default.timeout == _config().timeout


@pytest.mark.parametrize("bad", [b"not json", json.dumps({"op": "next"}).encode()])
def test_a_malformed_message_is_answered_and_the_agent_serves_on(tmp_path: Any,
                                                                 bad: bytes) -> None:
    """A message that is not the protocol (bad JSON, a request without ``after``) ended in
    an unhandled exception of the connection's task, a traceback in the log (review): the
    rank is told, the connection closed, and the agent serves the others."""
    import socket
    import struct

    with running_agent(tmp_path, [0, 1]) as (agent, _):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(agent.path)
        sock.sendall(frame({"op": "hello", "rank": 0, "service": "agentunit"}))
        assert "ok" in recv(sock)
        sock.sendall(struct.pack("!I", len(bad)) + bad)
        answer = recv(sock)
        assert answer is not None and "malformed message" in answer["error"]
        assert recv(sock) is None  # hung up
        sock.close()
        handle = AgentHandle.connect(agent.path, "agentunit")
        reader = handle.reader(1)
        assert next(reader).step == 0
        handle.close()


def test_a_rank_restarted_from_an_older_state_behind_the_agent_is_told(tmp_path: Any) -> None:
    """Behind the agent, a rank handed steps 0-3 that restarts from the state of step 1 got
    step 4 next, silently (review; a direct reader says so): it is told, as a direct one.
    The refusal used to come after the next step was handed out and taken, so loading
    the state it named was refused again, a step further on each time (a review of the
    agent): the agent refuses before it hands anything out.  A new reader with no state
    (a restarted process, another handle) is refused too, where it silently went on
    after the steps its rank took; the same handle's next reader goes on after them."""
    with running_agent(tmp_path, [0]) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")
        first = handle.reader(0)
        assert [next(first).step for _ in range(4)] == [0, 1, 2, 3]
        first.close()
        again = handle.reader(0)
        again.load_state_dict({"rank": 0, "step": 1})
        for _ in range(2):  # (nothing is handed out by a refusal)
            with pytest.raises(ServiceError, match=r"rank 0: asked the agent at .* for step 2, "
                                                   r"but this rank took the steps up to 3 from "
                                                   r"it already .* load the state of step 3"):
                next(again)
        again.load_state_dict({"rank": 0, "step": 3})  # as the error says
        assert next(again).step == 4
        other = AgentHandle.connect(agent.path, "agentunit")  # a restarted process
        for _ in range(2):
            with pytest.raises(ServiceError, match=r"rank 0: a new reader with no state asked "
                                                   r"the agent at .* for its first step, but "
                                                   r"this rank took the steps up to 4"):
                next(other.reader(0))
        other.close()
        assert next(handle.reader(0)).step == 5  # this handle's next reader: after step 4
        handle.close()


def test_a_rank_takes_the_services_state_through_the_agent(tmp_path: Any) -> None:
    """docs/resume.md's recipe (rank 0 saves ``svc.state_dict(step)``) raised behind the
    agent, the deployment docs/deployment.md recommends (review).  The agent answers it
    with its own handle's ``state_dict``, refusals of the same kind."""
    from msd_dask.errors import ServiceError, ServiceTimeoutError

    asked: list[int | None] = []

    def state(step: int | None) -> dict[str, Any]:
        asked.append(step)
        if step == 99:
            raise ValueError("step 99 is not planned yet")
        if step == 7:
            raise ServiceTimeoutError("the planner did not answer within 8s")
        if step == 8:
            raise ServiceError("no constructor knows rank 3")
        return {"format": "x", "step": 4 if step is None else step}

    with running_agent(tmp_path, [0, 1], state=state) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")
        assert handle.state_dict(3) == {"format": "x", "step": 3}
        assert handle.state_dict() == {"format": "x", "step": 4}
        for step, error, says in ((99, ValueError, "step 99 is not planned yet"),
                                  (7, ServiceTimeoutError, "did not answer within 8s"),
                                  (8, ServiceError, "no constructor knows rank 3")):
            with pytest.raises(error, match=rf"the state of service 'agentunit', asked of the "
                                            rf"agent at .*: .*{says}"):
                handle.state_dict(step)
        assert asked == [3, None, 99, 7, 8]
        # the direct handle's refusals: 5.7 was taken for step 5, True for step 1, and a
        # numpy integer raised JSON's TypeError naming nothing (a review)
        assert handle.state_dict(np.int64(5)) == {"format": "x", "step": 5}
        for bad in (5.7, "5", True):
            with pytest.raises(ValueError, match=r"state_dict: step must be a step \(an "
                                                 rf"integer\), got {bad!r}"):
                handle.state_dict(bad)
        assert asked == [3, None, 99, 7, 8, 5]
        # and the agent refuses what a client of another version would send it
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(agent.path)
        send(sock, {"op": "hello", "service": "agentunit", "state_dict": 5.7})
        answer = recv(sock)
        sock.close()
        assert answer["kind"] == "value" and "5.7, not a step number" in answer["error"]
        assert asked == [3, None, 99, 7, 8, 5]
        handle.close()
    with running_agent(tmp_path, [0, 1]) as (agent, _):  # an agent with no service handle
        with pytest.raises(ServiceError, match="has no service handle"):
            AgentHandle.connect(agent.path, "agentunit").state_dict(3)


def test_a_state_that_waits_on_the_service_does_not_hold_the_agents_stop(tmp_path: Any) -> None:
    """The agent took the service's state in the loop's default executor: at stop,
    ``asyncio.run`` waited for a state_dict stuck on the service (which waits up to several
    times its timeout), silently (an audit of the waits)."""
    release = threading.Event()

    def state(step: int | None) -> dict[str, Any]:
        release.wait(60)  # the service does not answer
        return {"format": "x", "step": 0}

    asked = threading.Event()

    def ask(path: str) -> None:
        asked.set()
        try:
            AgentHandle.connect(path, "agentunit").state_dict(3)
        except Exception:  # noqa: BLE001 - the agent stops meanwhile
            pass

    t0 = time.monotonic()
    try:
        with running_agent(tmp_path, [0, 1], state=state) as (agent, _):
            threading.Thread(target=ask, args=(agent.path,), daemon=True).start()
            assert asked.wait(5)
            time.sleep(0.5)  # the agent is taking the state
        # (running_agent's exit joined the agent's thread within 10 s)
        assert time.monotonic() - t0 < 15
    finally:
        release.set()


def test_a_block_gone_before_it_is_copied_is_one_error_naming_the_rank(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block unlinked before the rank copied it (the agent stopped or was killed) reached
    the rank as a bare FileNotFoundError naming a /dev/shm file (a review of the agent)."""
    from msd_dask.service import agent_client

    def gone(msg: Any, rank: int) -> Any:
        raise FileNotFoundError(2, "No such file or directory", f"/dev/shm/{msg['block']}")

    with running_agent(tmp_path, [0]) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")
        reader = handle.reader(0)
        monkeypatch.setattr(agent_client, "read_block", gone)
        with pytest.raises(ServiceError, match=r"rank 0 could not copy step 0 from the agent "
                                               r"at .*FileNotFoundError.*did `msd-dask agent` exit"):
            next(reader)
        monkeypatch.undo()
        handle.close()


@pytest.mark.parametrize("sent", [b"", frame({"op": "hello"})[:6]], ids=["nothing", "half"])
def test_a_connection_that_sends_no_hello_is_closed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture,
                                                    sent: bytes) -> None:
    """A connection that never sent its hello (or half of one) held its task until the
    agent stopped, the agent waiting on it silently (an audit of the waits): it is closed
    after :data:`HELLO_TIMEOUT`, with a warning naming the socket and the wait."""
    import logging
    import socket

    from msd_dask.service import agent as agent_module

    monkeypatch.setattr(agent_module, "HELLO_TIMEOUT", 0.3)
    with caplog.at_level(logging.WARNING, logger="msd_dask.agent"), \
            running_agent(tmp_path, [0, 1]) as (agent, _):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(agent.path)
        sock.sendall(sent)
        assert wait_until(lambda: len(agent._tasks) == 1)  # the connection's
        t0 = time.monotonic()
        assert sock.recv(1) == b""  # closed, nothing said
        assert time.monotonic() - t0 < 5
        assert wait_until(lambda: not agent._tasks)
        sock.close()
        handle = AgentHandle.connect(agent.path, "agentunit")  # the agent serves on
        assert next(handle.reader(0)).step == 0
        handle.close()
    assert [r.getMessage() for r in caplog.records
            if "no hello" in r.getMessage()] == [
        f"msd-dask agent: a connection to {agent.path} sent no hello within 0.3s; closing it"]


def _said_hello(path: str, rank: int) -> Any:
    """A raw socket to the agent at ``path``, which said the hello of ``rank`` and was
    answered."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(frame({"op": "hello", "rank": rank, "service": "agentunit"}))
    assert "ok" in recv(sock)
    return sock


@pytest.mark.parametrize("cut", [2, 10], ids=["half-a-header", "half-a-body"])
def test_a_rank_that_sends_half_a_message_is_closed(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture,
                                                    cut: int) -> None:
    """After its hello, a rank that sent the first bytes of a message and not the rest
    held its connection and its task until it disconnected, the agent waiting on it
    silently (an audit of the waits): the connection is closed after
    :data:`MESSAGE_TIMEOUT`, with a warning naming the rank, the socket and the wait, and
    the agent serves its other ranks meanwhile and after, that rank's too."""
    import logging

    from msd_dask.service import agent as agent_module

    monkeypatch.setattr(agent_module, "MESSAGE_TIMEOUT", 0.3)
    with caplog.at_level(logging.WARNING, logger="msd_dask.agent"), \
            running_agent(tmp_path, [0, 1], cfg=_config(dp=2)) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")  # rank 1, well behaved
        other = handle.reader(1)
        assert next(other).step == 0
        sock = _said_hello(agent.path, 0)
        t0 = time.monotonic()  # (before the agent's wait for the rest begins)
        sock.sendall(frame({"op": "next", "after": -1, "timeout": 5})[:cut])
        assert next(other).step == 1  # served while rank 0's message hangs
        assert sock.recv(1) == b""  # closed, nothing said
        assert 0.29 < time.monotonic() - t0 < 5
        sock.close()
        assert next(other).step == 2  # the agent serves on
        assert next(handle.reader(0)).step == 0  # rank 0 too, connected again
        handle.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"msd-dask agent: rank 0 on {agent.path} sent the start of a message and not the "
        "rest within 0.3s; closing its connection"]


def test_a_rank_silent_between_messages_is_not_closed(tmp_path: Any,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A rank is silent between its messages for as long as it computes a step: only a
    message begun is bounded (:data:`MESSAGE_TIMEOUT`), a rank silent after its hello or
    after a whole message for several times that bound is served on, and not warned of."""
    import logging

    from msd_dask.service import agent as agent_module

    monkeypatch.setattr(agent_module, "MESSAGE_TIMEOUT", 0.2)
    with caplog.at_level(logging.WARNING, logger="msd_dask.agent"), \
            running_agent(tmp_path, [0, 1], cfg=_config(dp=2)) as (agent, _):
        sock = _said_hello(agent.path, 0)
        for step in range(2):
            time.sleep(1.0)  # five times the bound, silent
            sock.sendall(frame({"op": "next", "after": step - 1, "timeout": 5}))
            answer = recv(sock)
            assert answer is not None and answer.get("step") == step, answer
            sock.sendall(frame({"op": "ack", "step": step}))
        sock.sendall(frame({"op": "bye"}))
        assert sock.recv(1) == b""  # closed by its bye
        sock.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize(("hello", "bad", "field"), [
    (True, b'{"op": "next", "after": Infinity, "timeout": 5}', "after"),
    (True, b'{"op": "next", "after": -1, "timeout": 1e400}', "timeout"),
    (True, b'{"op": "next", "after": -1, "timeout": NaN}', "timeout"),
    (True, b'{"op": "next", "after": -1, "timeout": 1' + b"0" * 400 + b"}", "timeout"),
    (True, b'{"op": "ack", "step": -Infinity}', "step"),
    (True, b'{"op": "ack", "step": NaN}', "step"),
    (True, b'{"op": "next", "after": "abc", "timeout": 5}', "after"),
    (False, b'{"op": "hello", "rank": Infinity, "service": "agentunit"}', "rank"),
], ids=["after-inf", "timeout-1e400", "timeout-nan", "timeout-huge-int", "ack-inf", "ack-nan",
         "after-text", "rank-inf"])
def test_a_number_that_is_no_number_is_a_malformed_message(tmp_path: Any, hello: bool,
                                                           bad: bytes, field: str) -> None:
    """``Infinity`` (which Python's JSON reads and writes) or ``1e400`` as a step: ``int()``
    raised OverflowError, which the connection did not take for a malformed message, so
    it closed without an answer (review).  A wait of NaN or of an integer beyond a float's
    range is no number of seconds either.  The rank is told which field, as for any
    malformed message, and the agent serves on."""
    import socket
    import struct

    with running_agent(tmp_path, [0, 1]) as (agent, _):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(agent.path)
        if hello:
            sock.sendall(frame({"op": "hello", "rank": 0, "service": "agentunit"}))
            assert "ok" in recv(sock)
        sock.sendall(struct.pack("!I", len(bad)) + bad)
        answer = recv(sock)
        assert answer is not None and "malformed message" in answer["error"], answer
        assert f"field {field!r} is " in answer["error"] and "not a finite number" in answer["error"]
        assert agent.path in answer["error"]
        assert recv(sock) is None  # hung up
        sock.close()
        handle = AgentHandle.connect(agent.path, "agentunit")
        assert next(handle.reader(1)).step == 0
        handle.close()


def test_a_message_nested_too_deeply_is_a_malformed_message(tmp_path: Any) -> None:
    """JSON nested past Python's recursion limit made ``json.loads`` raise RecursionError,
    which closed the connection with no answer and a traceback in the log (a review)."""
    import socket
    import struct

    bad = b"[" * 100_000 + b"]" * 100_000
    with running_agent(tmp_path, [0, 1]) as (agent, _):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(agent.path)
        sock.sendall(struct.pack("!I", len(bad)) + bad)
        answer = recv(sock)
        assert answer is not None and "malformed message" in answer["error"], answer
        assert "nested too deeply" in answer["error"] and agent.path in answer["error"]
        sock.close()
        handle = AgentHandle.connect(agent.path, "agentunit")
        assert next(handle.reader(0)).step == 0
        handle.close()


def test_the_state_of_step_infinity_is_refused(tmp_path: Any) -> None:
    """``state_dict`` of step ``Infinity``: an OverflowError taken for the service's."""
    import socket

    with running_agent(tmp_path, [0, 1], state=lambda step: {"step": step}) as (agent, _):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(agent.path)
        sock.sendall(frame({"op": "hello", "service": "agentunit", "state_dict": float("inf")}))
        answer = recv(sock)
        assert answer is not None and answer["kind"] == "value", answer
        assert answer["error"] == (f"the agent at {agent.path} was asked for the state of step "
                                   "inf, not a step number")
        sock.close()


@pytest.mark.parametrize("late", [False, True], ids=["during-stop", "after-stop"])
def test_a_block_written_as_the_agent_stops_is_unlinked(tmp_path: Any,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        late: bool) -> None:
    """A block still being written when the agent stopped: the stop cancelled the read
    awaiting it, so no one unlinked it, and it stayed in /dev/shm as long as the process
    lived (an agent in a process that lives on; ``msd-dask agent``'s watcher removed it at
    exit).  The stop waits for it and unlinks it (``during-stop``); written after the stop
    gave up waiting, its writer unlinks it (``after-stop``)."""
    from msd_dask.service import agent as agent_module

    names: list[str] = []
    written, release = threading.Event(), threading.Event()
    write_block = agent_module.write_block

    def slow_write(batch: WireBatch, name: str, group: int | None = None) -> Any:
        names.append(name)
        out = write_block(batch, name, group)
        written.set()  # the block is in /dev/shm; the write is not over
        release.wait(30)
        return out

    monkeypatch.setattr(agent_module, "write_block", slow_write)
    if late:
        monkeypatch.setattr(agent_module, "STOP_WRITES_WAIT", 0.1)
    agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]),
                      str(tmp_path / "agent.sock"), prefetch=1)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()

    def left() -> list[str]:
        return [n for n in names if os.path.exists(os.path.join("/dev/shm", n))]

    try:
        assert agent.ready.wait(10)
        handle = AgentHandle.connect(agent.path, "agentunit")
        reader = handle.reader(0, timeout=30)

        def ask() -> None:
            try:
                next(reader)
            except ServiceError:  # the agent stops meanwhile
                pass

        threading.Thread(target=ask, daemon=True).start()
        assert written.wait(10)
        assert len(left()) == 1
        agent.stop()
        assert wait_until(lambda: not agent._tasks)  # the read awaiting the write: cancelled
        if late:
            thread.join(10)
            assert not thread.is_alive() and len(left()) == 1  # the stop gave up waiting
        release.set()
        thread.join(10)
        assert not thread.is_alive()
        assert wait_until(lambda: not left(), timeout=5), left()
        handle.close()
    finally:
        release.set()
        agent.stop()
        thread.join(10)
        for name in left():  # (a failure leaves nothing behind)
            os.unlink(os.path.join("/dev/shm", name))


def _shm_full_at_step_2(monkeypatch: pytest.MonkeyPatch, agent: list[HostAgent],
                        times: int) -> list[str]:
    """Have the agent's writes of step 2's block fail ``times`` times (ENOSPC: /dev/shm
    full), the first once rank 0 of ``agent[0]`` asked for step 2 (its third request), so
    that it waits when it fails; the names of the blocks refused."""
    import errno

    from msd_dask.service import agent as agent_module

    write = agent_module.write_block
    refused: list[str] = []

    def full(batch: WireBatch, name: str, group: int | None = None) -> Any:
        if batch.step == 2 and len(refused) < times:
            if not refused:
                assert wait_until(lambda: agent[0].groups[0].requests >= 3, 10)
            refused.append(name)
            raise OSError(errno.ENOSPC, "no room in /dev/shm for a block (for now)")
        return write(batch, name, group)

    monkeypatch.setattr(agent_module, "write_block", full)
    return refused


def test_a_block_that_could_not_be_written_is_written_at_the_next_request(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm full for a moment: the write of step 2's block failed once, and the step,
    taken from the service already, was dropped; the group's reading ended, every later
    request got the same error though /dev/shm had room again, and only a later state
    (skipping step 2) or a restart of the agent went on (a review of the agent).  The
    rank waiting then is told; the step is kept and written at its next request: every
    step once, in order, none read from the service twice, no block left."""
    agent: list[HostAgent] = []
    refused = _shm_full_at_step_2(monkeypatch, agent, times=1)
    with running_agent(tmp_path, [0], cfg=_config(dp=2), prefetch=1) as (served, readers):
        agent.append(served)
        handle = AgentHandle.connect(served.path, "agentunit")
        reader = handle.reader(0, timeout=10)
        got = [next(reader).step for _ in range(2)]
        with pytest.raises(ServiceError, match=r"could not write step 2 of ranks \[0\] into "
                                               r"shared memory \(OSError: .*no room in "
                                               r"/dev/shm.*\); it tries again at the next "
                                               r"request"):
            next(reader)
        got += [next(reader).step for _ in range(3)]
        assert got == [0, 1, 2, 3, 4] and len(refused) == 1
        assert readers[0].reads <= 5 + served.prefetch  # (steps 0-4, and what it reads ahead)
        assert served.groups[0].error is None
        handle.close()


def test_a_block_that_stays_unwritable_is_the_groups_error(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """As above, /dev/shm staying full: each request is told and tries again, and after
    WRITE_TRIES tries the failure is the group's error, naming the step lost and the
    state that goes on after it (a failure that persists ends the reading, as a failed
    read does; a passing one does not)."""
    from msd_dask.service.agent import WRITE_TRIES

    agent: list[HostAgent] = []
    refused = _shm_full_at_step_2(monkeypatch, agent, times=100)
    with running_agent(tmp_path, [0], cfg=_config(dp=2), prefetch=1) as (served, readers):
        agent.append(served)
        handle = AgentHandle.connect(served.path, "agentunit")
        reader = handle.reader(0, timeout=10)
        assert [next(reader).step for _ in range(2)] == [0, 1]
        for _ in range(WRITE_TRIES - 1):
            with pytest.raises(ServiceError, match="it tries again at the next request"):
                next(reader)
        for _ in range(2):  # (the group's error now, told to every request)
            with pytest.raises(ServiceError, match=rf"could not write step 2 of ranks \[0\] "
                                                   rf"into shared memory .*at each of "
                                                   rf"{WRITE_TRIES} tries .*the step is lost: "
                                                   r"load the state of step 2 on every rank"):
                next(reader)
        assert len(refused) == WRITE_TRIES and readers[0].reads == 3  # (step 2 read once)
        reader.load_state_dict({"rank": 0, "step": 2})  # as the error says
        assert next(reader).step == 3
        handle.close()


def test_ranks_that_skip_ahead_mid_stream_have_their_reader_skip_too(tmp_path: Any) -> None:
    """Every rank of a group loads a later state mid-stream (step 40 after step 1): the
    group's reader was not told (only a state loaded before its start was), so it read
    every step skipped from the service, 43 reads, each dropped as no rank lacked it (a
    review of the agent).  It now loads the state too and claims from there, as a direct
    reader does, so the constructor releases the steps skipped without sending them."""
    with running_agent(tmp_path, [0], cfg=_config(dp=2), prefetch=2) as (agent, readers):
        handle = AgentHandle.connect(agent.path, "agentunit")
        reader = handle.reader(0)
        assert [next(reader).step for _ in range(2)] == [0, 1]
        reader.load_state_dict({"rank": 0, "step": 40})
        assert [next(reader).step for _ in range(2)] == [41, 42]
        assert readers[0].loaded == [{"service": "agentunit", "rank": 0, "step": 40}]
        # steps 0-3 (1 and 2 ahead of step 1), then 41-44 (2 ahead of step 42)
        assert readers[0].reads <= 8, readers[0].reads
        handle.close()


def test_the_agents_socket_is_private_before_it_listens(tmp_path: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket was made 0600 after ``listen()``: meanwhile another user of the host could
    connect with the umask's mode and take a rank's steps (a review of the agent).  Its mode
    is the owner's alone by the time it listens."""
    import socket as socket_module
    import stat
    import types

    from msd_dask.service import agent as agent_module

    path = str(tmp_path / "a.sock")
    modes: list[int] = []

    class Recording(socket_module.socket):
        def listen(self, *args: Any) -> None:
            modes.append(stat.S_IMODE(os.stat(path).st_mode))
            super().listen(*args)

    monkeypatch.setattr(agent_module, "socket", types.SimpleNamespace(
        socket=Recording, AF_UNIX=socket_module.AF_UNIX, SOCK_STREAM=socket_module.SOCK_STREAM))
    old = os.umask(0o022)
    try:
        agent = HostAgent.__new__(HostAgent)
        agent.path, agent.group = path, None
        agent._bind_locked().close()
    finally:
        os.umask(old)
    assert modes == [0o600]


def test_closing_a_reader_that_waits_ends_the_wait_and_leaves_the_step(tmp_path: Any) -> None:
    """``reader.close()`` from another thread while ``next(reader)`` waited for a slow step
    (``MsdIterableDataset(prefetch>0).close()``, whose prefetch thread is in ``next()``)
    only closed the socket, which did not wake the thread: it waited until the agent
    answered, then failed naming a lost agent ("Bad file descriptor"; a review).  The wait
    ends at once with the error of a closed direct reader, and the step it waited for
    stays with the agent for the rank's next reader."""
    with running_agent(tmp_path, [0], delay=2.0) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")
        reader = handle.reader(0, timeout=30)
        t, errors = next_in_a_thread(reader)
        time.sleep(0.3)  # (the agent reads step 0 until 2 s)
        t0 = time.monotonic()
        reader.close()
        t.join(10)
        assert time.monotonic() - t0 < 1.0
        assert len(errors) == 1 and isinstance(errors[0], ServiceError), errors
        assert str(errors[0]) == "rank 0: the reader is closed"
        again = handle.reader(0, timeout=30)
        assert [next(again).step for _ in range(2)] == [0, 1]
        handle.close()


def test_a_step_that_comes_as_the_reader_closes_is_left_to_the_next_reader(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that came while another thread closed the reader was acknowledged to the
    agent, which serves it no more, and returned by the closed reader (to a prefetching
    dataset that dropped it): the rank's next reader was refused, the step lost (a
    review).  It is not acknowledged; the closed reader raises as a direct one, and the
    next reader of the rank gets the step."""
    from msd_dask.service import agent_client

    with running_agent(tmp_path, [0]) as (agent, _):
        handle = AgentHandle.connect(agent.path, "agentunit")
        reader = handle.reader(0)
        copy = agent_client.read_block

        def closed_meanwhile(msg: Mapping[str, Any], rank: int) -> Batch:
            reader.close()  # (another thread's close, as this one copies the block)
            return copy(msg, rank)

        monkeypatch.setattr(agent_client, "read_block", closed_meanwhile)
        with pytest.raises(ServiceError, match=r"^rank 0: the reader is closed$"):
            next(reader)
        monkeypatch.setattr(agent_client, "read_block", copy)
        again = handle.reader(0)
        assert [next(again).step for _ in range(2)] == [0, 1]
        handle.close()


#: a process that connects to the agent at argv[1] as rank argv[2] (the protocol's hello, no
#: msd_dask), prints the answer, and holds the connection until a line on stdin
HOLDER = """
import json, socket, struct, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
body = json.dumps({"op": "hello", "rank": int(sys.argv[2]), "service": "agentunit"}).encode()
sock.sendall(struct.pack("!I", len(body)) + body)
size = struct.unpack("!I", sock.recv(4, socket.MSG_WAITALL))[0]
print(sock.recv(size, socket.MSG_WAITALL).decode(), flush=True)
sys.stdin.readline()
"""


def _hold(path: str, rank: int) -> tuple[subprocess.Popen, dict[str, Any]]:
    """A process that holds a connection of ``rank`` to the agent at ``path``, and the
    agent's answer to its hello."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, path, str(rank)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


def test_a_rank_read_by_another_running_process_is_refused(tmp_path: Any) -> None:
    """Two processes with one rank (a stale one still running as torchrun starts its
    replacement, a wrong ``LOCAL_RANK``) both got the same steps from the agent, which kept
    what a rank has per rank, not per connection; then one failed with a misleading
    message (a review).  The second process is refused at once, naming the first; once
    the first ended (killed: torchrun restarts the rank) or closed its connection, the
    rank is the next process's.  A second connection of one process (a reader that dials
    again) is no other process: it is served."""
    with running_agent(tmp_path, [0]) as (agent, _):
        stale, answer = _hold(agent.path, 0)
        procs = [stale]
        try:
            assert answer.get("ok"), answer
            handle = AgentHandle.connect(agent.path, "agentunit")
            with pytest.raises(ServiceError, match=(
                    rf"^rank 0: the agent at {re.escape(agent.path)} refuses rank 0 to pid "
                    rf"{os.getpid()}: rank 0 is already read through this agent by pid "
                    rf"{stale.pid}, .*\(two processes with one rank: a stale one, or "
                    r"LOCAL_RANK wrong\?\)")):
                handle.reader(0)
            stale.kill()  # (its connection ends with it)
            stale.wait()
            readers: list[AgentReader] = []

            def taken() -> bool:
                try:
                    readers.append(handle.reader(0))
                except ServiceError:
                    return False
                return True

            assert wait_until(taken, 5)
            assert next(readers[0]).step == 0
            again = handle.reader(0)  # this process again: served
            other, answer = _hold(agent.path, 0)
            procs.append(other)
            assert f"by pid {os.getpid()}," in answer.get("error", ""), answer
            readers[0].close()
            again.close()
            assert wait_until(lambda: 0 not in agent._holders, 5)
            late, answer = _hold(agent.path, 0)  # (this process lives on, its readers closed)
            procs.append(late)
            assert answer.get("ok"), answer
            handle.close()
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


#: a process writing two blocks as the agent does, then waiting to be killed
WAITING_WRITER = """
import sys
import numpy as np
from msd_dask.service.agent import WireBatch, new_block_name, write_block

blocks = [write_block(WireBatch({"step": s, "ids": np.arange(8)}), new_block_name())[0]
          for s in range(2)]
print(" ".join(b.name for b in blocks), flush=True)
sys.stdin.readline()
"""


def test_a_kill_of_the_agents_process_group_leaves_no_block() -> None:
    """A kill of the agent's whole process group (``kill -9 -PGID``, a launcher ending a
    job's processes so) killed the watcher of its blocks with it, a shell of the same
    group, and every block stayed in /dev/shm (a review).  The watcher is in a session
    of its own: it outlives the group and removes them."""
    proc = subprocess.Popen([sys.executable, "-c", WAITING_WRITER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None
    names: list[str] = []
    try:
        names = proc.stdout.readline().split()
        assert len(names) == 2
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: not any(os.path.exists(os.path.join("/dev/shm", n))
                                          for n in names), timeout=10), names
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for n in names:  # (a failed run leaves none behind)
            if os.path.exists(os.path.join("/dev/shm", n)):
                os.unlink(os.path.join("/dev/shm", n))


def test_a_socket_path_too_long_is_one_error_naming_it(tmp_path: Any) -> None:
    """A socket path longer than a Unix socket's may be (107 bytes on Linux; the default
    path of a service name over 82 characters): the agent connected to the service, then
    exited with "AF_UNIX path too long", naming neither the path nor the limit, and left
    ``<path>.lock``; a rank said no agent answered there (a review).  The agent refuses it
    as it is made, before it connects, and a rank as it dials, each naming the path, its
    length and the limit; the longest path that fits is served."""
    base = str(tmp_path) + "/"
    fits = base + "a" * (MAX_SOCKET_PATH - len(base))
    long = fits + "a"

    def refused(path: str) -> str:
        return (rf"^the agent's socket path {re.escape(path)} is {len(path)} bytes long.*; a "
                rf"Unix domain socket's path may have at most {MAX_SOCKET_PATH} bytes: pass a "
                rf"shorter `msd-dask agent --socket` and name the same path in {AGENT_ENV}$")

    with pytest.raises(ValueError, match=refused(long)):
        HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]), long)
    assert not os.path.exists(long + ".lock")
    with pytest.raises(ValueError, match=refused(long)):
        AgentHandle.connect(long, "agentunit")
    room = MAX_SOCKET_PATH - len(default_socket(""))  # (the longest name whose default fits)
    name = "n" * (room + 1)
    default = default_socket(name)
    with pytest.raises(ValueError, match=rf"\(the default socket path of service '{name}': one "
                                         rf"of a name longer than {room} bytes is too long\)"):
        agent_path(name, True)
    with pytest.raises(ValueError, match=refused(default)):
        HostAgent(name, _config(), [0], lambda f, o: FakeGroupReader(0, [f]), default)
    assert agent_path("n" * room, True) == default_socket("n" * room)
    agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]), fits)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert agent.ready.wait(10)
        assert AgentHandle.connect(fits, "agentunit").ranks == [0]
    finally:
        agent.stop()
        thread.join(10)


def _socket_of_another_user(path: str, uid: int, ready: Any) -> None:
    """A child that binds ``path`` as ``uid`` and accepts connections (another user's
    socket in a shared folder)."""
    os.setgid(uid)
    os.setuid(uid)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(8)
    ready.set()
    while True:
        conn, _ = srv.accept()
        conn.recv(1)  # (holds it; the parent's dial is what the test looks at)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a socket as another user")
def test_a_socket_of_another_user_is_not_taken_for_the_agent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone may bind a path in a shared ``/tmp``: another user's socket at the agent's
    path, bound before the job's agent, fed the job's ranks its own batches and states (a
    review).  A rank reads only from an agent of its own uid, root's, or the uid
    ``MSD_DASK_AGENT_UID`` names (a sidecar's)."""
    import multiprocessing
    import shutil
    import tempfile

    from msd_dask.service.agent_client import AGENT_UID_ENV, AgentHandle

    shared = tempfile.mkdtemp(prefix="msd-shared-")  # (as /tmp is: anyone may bind there)
    os.chmod(shared, 0o1777)
    path = os.path.join(shared, "agent.sock")
    nobody = 65534
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_socket_of_another_user, args=(path, nobody, ready), daemon=True)
    child.start()
    try:
        assert ready.wait(10)
        with pytest.raises(ServiceError, match=rf"runs as uid {nobody}, neither this process's "
                                               rf"\(0\) nor root's.*{AGENT_UID_ENV}={nobody}"):
            AgentHandle.connect(path, "svc", timeout=2)
        monkeypatch.setenv(AGENT_UID_ENV, str(nobody))
        # (accepted at the dial: the silent peer then times out the hello)
        with pytest.raises(ServiceTimeoutError, match="did not answer within 1s"):
            AgentHandle.connect(path, "svc", timeout=1)
    finally:
        child.kill()
        child.join(5)
        shutil.rmtree(shared, ignore_errors=True)


def test_a_block_name_that_is_not_an_agents_is_refused() -> None:
    """A rank opens only an agent's block under SHM_DIR: not another file a message names."""
    from msd_dask.service.agent_client import read_block

    for name in ("../../etc/passwd", "msd-agent-1/../../x", "other-file"):
        with pytest.raises(ValueError, match="not the name of an agent's block"):
            read_block({"block": name, "pid": 1, "layout": {}, "meta": {}}, 0)


def test_the_default_socket_is_in_a_folder_of_the_users_own(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The default socket was ``/tmp/msd-dask-agent-NAME.sock``: any user's process could bind
    that path first and keep the agent from starting.  It is in ``msd-dask-UID/`` now, a
    folder the agent makes with mode 0700 and refuses, naming it, where another user owns
    it, others may use it, or it is no folder (a link another user put there)."""
    import stat

    from msd_dask.service import agent_client

    monkeypatch.setattr(agent_client, "AGENT_SOCKET",
                        str(tmp_path / "msd-dask-{uid}" / "agent-{name}.sock"))
    folder = tmp_path / f"msd-dask-{os.getuid()}"
    path = default_socket("agentunit")
    assert path == str(folder / "agent-agentunit.sock") and agent_path("agentunit", True) == path
    agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]), path)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert agent.ready.wait(10)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.getuid()
        assert AgentHandle.connect(path, "agentunit").ranks == [0]
    finally:
        agent.stop()
        thread.join(10)
    own_folder(str(folder))  # (made already, and the user's: taken as it is)
    folder.chmod(0o777)
    with pytest.raises(ServiceError, match=rf"^{folder}, the folder of the agent's default "
                                           r"socket, has mode 777: other users may use it"):
        own_folder(str(folder))
    folder.chmod(0o700)
    if os.getuid() == 0:  # (only root can give a folder to another user)
        os.chown(folder, 12345, -1)
        with pytest.raises(ServiceError, match=r"belongs to user id 12345, not to this "
                                               r"process's \(0\); pass --socket"):
            HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]),
                      path).run()
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ServiceError, match="is not a folder"):
        own_folder(str(link))


def test_a_job_of_another_world_size_is_refused_behind_an_agent(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A direct reader refuses a job whose ``WORLD_SIZE`` is not the service's ranks (a
    smaller one read a round, then every rank waited out its timeout); behind an agent
    nothing checked it (a review).  The agent says the service's ranks and mesh in its
    hello; a rank's reader refuses the job as a direct reader does, with its message."""
    path = str(tmp_path / "a.sock")
    agent = HostAgent("agentunit", _config(), [0, 1], lambda f, o: FakeGroupReader(0, [f, *o]),
                      path)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert agent.ready.wait(10)
        handle = AgentHandle.connect(path, "agentunit")
        assert handle.world_size == 4
        monkeypatch.setenv("WORLD_SIZE", "8")
        with pytest.raises(ValueError, match=r"^rank 1: service 'agentunit' is laid out for 4 "
                                             r"ranks \(dp=2 tp=2 cp=1 pp=1\), but this "
                                             r"process's WORLD_SIZE is 8"):
            handle.reader(1)
        monkeypatch.setenv("WORLD_SIZE", "4")
        handle.reader(1).close()
    finally:
        agent.stop()
        thread.join(10)


@pytest.mark.parametrize("parallel", [{"dp": 4}, {"dp": 2, "tp": 2}], ids=["tp1", "tp2"])
def test_an_agent_s_group_reader_never_checks_the_agent_s_world_size(
        monkeypatch: pytest.MonkeyPatch, parallel: dict[str, int]) -> None:
    """An agent's reader of a group runs in the agent, whose ``WORLD_SIZE`` (a launcher's,
    a sidecar's) is not the job's: its ranks check theirs (``AgentHandle.reader``).  It was
    checked all the same where the group held one rank (tp = 1), which failed the agent
    (a review); a direct reader in the job still checks it."""
    from msd_dask.reader import Reader
    from msd_dask.service.agent import AgentGroupReader

    class Link:  # what a reader uses of its link when it is made
        config = _config(**parallel)
        name, closed = "agentunit", False
        constructors = [type("C", (), {"key": "c0"})()]
        handles = (0, constructors)

        def on_new_generation(self, f: object) -> None:
            pass

    monkeypatch.setenv("WORLD_SIZE", "2")
    group = [0, 1] if parallel.get("tp") else [0]
    reader = AgentGroupReader(Link(), 0, timeout=5, also=group[1:])  # type: ignore[arg-type]
    assert reader.ranks == group
    with pytest.raises(ValueError, match=r"^rank 0: service 'agentunit' is laid out for 4 "
                                         r"ranks .*this process's WORLD_SIZE is 2"):
        Reader(Link(), 0, timeout=5)  # type: ignore[arg-type]


def test_a_reader_is_a_context_manager_that_closes_it(tmp_path: Any) -> None:
    """``with handle.reader(rank) as reader:`` closes the reader on leaving, as a file does:
    the agent learns the last step it returned, and the reader refuses more."""
    with running_agent(tmp_path, [0]) as (agent, _readers):
        with AgentHandle.connect(agent.path, "agentunit") as handle:
            with handle.reader(0) as reader:
                assert next(reader).step == 0
            with pytest.raises(ServiceError, match="rank 0: the reader is closed"):
                next(reader)
            assert handle.reader(0).state_dict()["step"] == 0  # (the next goes on after it)


def _read_as(path: str, uid: int, out: Any) -> None:
    """A child that reads rank 0's first step from the agent at ``path`` as ``uid`` (and its
    group), and puts the step or the error's words in ``out``."""
    from msd_dask.service.agent_client import AgentHandle

    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    try:
        with AgentHandle.connect(path, "agentunit", timeout=5).reader(0, timeout=5) as reader:
            out.put(next(reader).step)
    except Exception as e:  # noqa: BLE001 - said to the parent
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to read as another user")
@pytest.mark.parametrize("group", [None, 65534])
def test_an_agent_shares_its_socket_and_blocks_with_the_group_it_is_given(group: int | None
                                                                          ) -> None:
    """A rank of another user (an agent in a sidecar container of its own user) could
    neither connect nor map a block, both mode 0600, and was told the agent was not running
    or had exited (a review).  ``group`` shares both (``msd-dask agent --group``); without
    it, the rank is told whose they are."""
    import multiprocessing
    import shutil
    import tempfile

    nobody = 65534
    shared = tempfile.mkdtemp(prefix="msd-group-")  # (a folder the other user may enter)
    os.chmod(shared, 0o755)
    path = os.path.join(shared, "agent.sock")
    agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]), path,
                      group=group)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert agent.ready.wait(10)
        # (spawned: a fork of this process, whose agent runs in a thread, could inherit a
        # lock held at the fork)
        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        child = ctx.Process(target=_read_as, args=(path, nobody, out), daemon=True)
        child.start()
        got = out.get(timeout=30)
        child.join(10)
    finally:
        agent.stop()
        thread.join(10)
        shutil.rmtree(shared, ignore_errors=True)
    if group is None:
        assert isinstance(got, str) and "permission denied on" in got, got
        assert "owned by uid 0" in got and "mode 600" in got and "--group" in got, got
    else:
        assert got == 0, got


def test_a_socket_whose_backlog_is_full_is_not_taken_for_a_stale_one(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live agent whose listen backlog is full for a moment (stopped, or busy with a burst
    of connections) answers a connect at once with EAGAIN: taken for a stale socket, it was
    removed and a second agent served the same ranks (a review).  It is refused as an agent
    that takes no connection; a socket no one listens on is still replaced."""
    import socket as socket_module

    from msd_dask.service import agent as agent_module

    monkeypatch.setattr(agent_module, "BIND_WAIT", 0.5)
    path = str(tmp_path / "agent.sock")
    live = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
    live.bind(path)
    live.listen(0)  # (never accepts: its backlog fills at once)
    waiting = []
    try:
        while True:
            s = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            waiting.append(s)
        inode = os.stat(path).st_ino
        second = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]),
                           path)
        refused: list[BaseException] = []

        def run() -> None:
            try:
                second.run()
            except ServiceError as e:
                refused.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert wait_until(lambda: refused or second.ready.is_set(), 10)
        if second.ready.is_set():  # (it took the live one's path: stopped, then failed)
            second.stop()
            thread.join(10)
        assert refused and "takes no connection within 0.5s" in str(refused[0]), refused
        assert os.stat(path).st_ino == inode  # (the live one's socket stays)
    finally:
        for s in waiting:
            s.close()
        live.close()
    # no one listens now: a stale socket, replaced
    agent = HostAgent("agentunit", _config(), [0], lambda f, o: FakeGroupReader(0, [f]), path)
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        assert agent.ready.wait(10)
    finally:
        agent.stop()
        thread.join(10)
