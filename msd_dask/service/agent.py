"""The host agent: one Dask client per host, batches to the host's ranks through shared memory.

``msd-dask agent --scheduler ADDR --name SERVICE --ranks A-B`` runs one
:class:`HostAgent` per host.  It connects to the service once (the host's one Dask
client), groups its ranks by their ``(dp, cp, pp)`` coordinates (the ranks of a
group, tensor-parallel peers, receive the same tensors) and reads each group with
one :class:`~msd_dask.reader.Reader` whose ``also`` names the group's other ranks,
so the group's constructor sends each batch once per host.

The training processes of the host connect to the agent's Unix domain socket
instead of to Dask, through :mod:`msd_dask.service.agent_client` (the protocol, the
socket's path and a rank's :class:`~msd_dask.service.agent_client.AgentReader`).

The agent reads a group at most ``prefetch`` steps ahead of the group's slowest
rank.  It starts reading a group once each of its ranks asked for a first step,
from the lowest step they all lack (a rank restarted from
:meth:`~msd_dask.service.agent_client.AgentReader.load_state_dict` skips what it has;
so does the group's reader).
What the service learns the group returned is the slowest rank's last step, not the
last step the agent read (:class:`AgentGroupReader`): each claim of a round carries it
(the constructor takes it, not the steps before the round, for the group's ranks),
and once the agent stops reading (its ranks stopped, and it read ``prefetch`` steps
ahead) the group's reader reports it, as a direct reader reports a pause.  So
:meth:`DataService.consumed_step`, and ``DataService.state_dict()`` without a step,
taken while every rank is stopped after returning step ``k``, is step ``k``, whatever
the ``prefetch``: the steps the agent read ahead are served again after a resume.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import json
import logging
import math
import mmap
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from msd_dask.batch import check_rank, is_whole, reader_state
from msd_dask.core.config import Config
from msd_dask.errors import TRIAL_HINT, ServiceError, ServiceTimeoutError
from msd_dask.reader import Reader
from msd_dask.service.agent_client import (
    AGENT_ENV,
    BLOCK_PREFIX,
    HEADER,
    SHM_DIR,
    check_socket_path,
    default_socket,
    frame,
    peer_creds,
)

__all__ = [
    "AgentGroupReader",
    "HostAgent",
    "WireBatch",
    "block_prefix",
    "local_groups",
    "new_block_name",
    "parse_ranks",
]

_log = logging.getLogger("msd_dask.agent")

#: seconds after a group's first rank asked for a step before the agent starts reading
#: the group without its ranks that did not ask yet, from the lowest step those that
#: asked lack (normally every rank of a group asks at once, with the same state)
START_GRACE = 2.0
#: seconds the agent waits for a new connection's hello (a rank sends it as it connects):
#: a connection that sends none is closed, not held (with its task) until the agent stops
HELLO_TIMEOUT = 30.0
#: seconds the agent waits for the rest of a rank's message once its first byte came: a
#: rank writes each message whole (one ``sendall`` of a small frame on a local socket), so
#: a message cut short is a stalled or broken client, whose connection is closed, not held
#: (with its task) until the rank disconnects.  The wait for a message's first byte stays
#: unbounded: a rank may be silent between its steps for as long as it computes
MESSAGE_TIMEOUT = 10.0
#: seconds the agent's stop waits for the blocks being written to be written (each then
#: unlinked); a write that takes longer unlinks its block itself once done
STOP_WRITES_WAIT = 10.0
#: seconds an agent starting waits for another agent on its socket path to bind it or
#: leave (the lock on ``<path>.lock``), and for an agent found there to answer
BIND_WAIT = 30.0
#: tries of one step's block (the first, then one at each request of a rank after each
#: failure) before a failed write is the group's error: ``/dev/shm`` full for a moment
#: costs the ranks waiting then an error and no step; one that stays full ends the
#: group's reading, as a failed read does
WRITE_TRIES = 3
#: bytes each array of a block is aligned to
_ALIGN = 64
#: the watcher of a process's blocks (:func:`_watch_blocks`): a POSIX shell that waits for
#: the end of a pipe only the process holds, then removes the files ``$1/$2*``
_WATCH = 'trap "" INT TERM HUP; read -r _; rm -f -- "$1/$2"*'

T = TypeVar("T")


#: the most ranks one host agent serves (a typo such as 0-1000000000 is refused at once)
MAX_HOST_RANKS = 65536


def parse_ranks(text: str) -> list[int]:
    """Ranks from ``"A-B"`` (both included), ``"A,B,C"`` or a mix (``"0-3,8"``), ascending."""
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"ranks {text!r}: expected A-B or A,B,C with integers") from None
        if a < 0 or b < a:
            raise ValueError(f"ranks {text!r}: {part!r} is not a range A-B with 0 <= A <= B")
        if b - a >= MAX_HOST_RANKS:  # (checked before a list of them is built)
            raise ValueError(f"ranks {text!r}: {part!r} holds {b - a + 1:,} ranks; one host "
                             f"serves at most {MAX_HOST_RANKS:,}")
        out.update(range(a, b + 1))
        if len(out) > MAX_HOST_RANKS:  # (the parts together: 131,072 in two passed; a review)
            raise ValueError(f"ranks {text!r}: {len(out):,} ranks up to {part!r}; one host "
                             f"serves at most {MAX_HOST_RANKS:,}")
    return sorted(out)


def local_groups(cfg: Config, ranks: Sequence[int]) -> list[list[int]]:
    """``ranks`` grouped by their ``(dp, cp, pp)`` coordinates: the ranks of a group read
    the same tensors.  Groups in order of their lowest rank, each ascending."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for r in sorted(set(ranks)):
        c = cfg.parallel.coords(r)  # raises ValueError outside the world
        groups.setdefault((c["dp"], c["cp"], c["pp"]), []).append(r)
    return sorted(groups.values())


# ------------------------------------------------------------------ wire


async def _arecv(stream: asyncio.StreamReader,
                 rest_within: float | None = None) -> dict[str, Any] | None:
    """The next message on ``stream``, ``None`` once the other end closed the connection.

    Parameters
    ----------
    stream : asyncio.StreamReader
        The connection.
    rest_within : float, optional
        Seconds the rest of the message may take once its first byte came (default:
        unbounded).  The wait for the first byte is never bounded here: a caller that
        bounds the whole message wraps the call in a timeout of its own.

    Raises
    ------
    TimeoutError
        The message began and its rest did not come within ``rest_within``.
    ValueError
        The message is no JSON, or JSON nested too deeply.
    """
    try:
        first = await stream.readexactly(1)
        # (a timeout of None is no deadline; asyncio.timeout, unlike wait_for in 3.11,
        # starts no task, once per message of every rank)
        async with asyncio.timeout(rest_within):
            head = first + await stream.readexactly(HEADER.size - 1)
            body = await stream.readexactly(HEADER.unpack(head)[0])
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    try:
        return dict(json.loads(body))
    except RecursionError:  # (JSON nested past Python's limit: no message of the protocol)
        raise ValueError(f"a message of {len(body)} bytes nested too deeply") from None


async def _asend(writer: asyncio.StreamWriter, msg: Mapping[str, Any]) -> None:
    writer.write(frame(msg))
    await writer.drain()


def _int_field(msg: Mapping[str, Any], key: str) -> int:
    """``msg[key]`` as an int; a ValueError naming the field if it is not a finite number
    (``int()`` of an infinite float, which Python's JSON reads from ``Infinity`` or
    ``1e400``, raises OverflowError, which is no malformed message to the connection; of
    NaN or of text, a ValueError that does not name the field)."""
    value = msg[key]
    try:
        return int(value)
    except (OverflowError, ValueError):
        raise ValueError(f"field {key!r} is {value!r:.40}, not a finite number") from None


def _float_field(msg: Mapping[str, Any], key: str) -> float:
    """``msg[key]`` as a finite float; a ValueError naming the field if it is not one
    (``float()`` of an integer beyond a float's range raises OverflowError; an infinite
    or NaN wait or step time is no number of seconds either)."""
    value = msg[key]
    try:
        out = float(value)
    except OverflowError:
        out = math.inf
    if not math.isfinite(out):
        raise ValueError(f"field {key!r} is {value!r:.40}, not a finite number")
    return out


# ---------------------------------------------------------- shared blocks


@dataclass
class WireBatch:
    """One step of a group of ranks as its constructor sent it: the wire form of
    :func:`~msd_dask.core.packing.to_wire` (its numpy arrays and plain fields), no
    tensors.  What an :class:`AgentGroupReader` hands out and :func:`write_block` stores."""

    wire: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.wire["step"])


def _plain(value: Any) -> Any:
    """A field of a wire form as JSON: numpy scalars and arrays as Python numbers and
    lists, tuples as lists."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class SharedBlock(Protocol):
    """A shared memory block :func:`write_block` made: a
    :class:`~multiprocessing.shared_memory.SharedMemory` or its Linux file (:class:`_FileBlock`)."""

    @property
    def name(self) -> str:
        """The block's name (``block`` of its message)."""

    @property
    def buf(self) -> memoryview | None:
        """The block's bytes, writable while the block is open (a closed SharedMemory: ``None``)."""

    def close(self) -> None:
        """Unmap the block from this process."""

    def unlink(self) -> None:
        """Remove the block (once every process unmapped it, its memory is freed)."""


class _FileBlock:
    """A shared memory block as the file ``SHM_DIR/<name>`` (Linux), created and mapped
    as :class:`~multiprocessing.shared_memory.SharedMemory` creates one (mode 0600),
    but not registered with Python's resource tracker, a python process of its own
    (about 8 MiB) per agent: :func:`_watch_blocks` removes the blocks of a process
    that is killed."""

    def __init__(self, name: str, size: int, group: int | None = None):
        self.name = name
        self._path = os.path.join(SHM_DIR, name)
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            if group is not None:  # (the ranks of another user in it map it too)
                os.fchown(fd, -1, group)
                os.fchmod(fd, 0o660)
            try:
                # the pages taken now: a sparse file (ftruncate) on a full tmpfs killed the
                # process with SIGBUS at the first write through the mapping
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                raise OSError(errno.ENOSPC, f"no room in {SHM_DIR} for a block of {size:,} "
                              f"bytes ({name}): make it larger (docker run --shm-size, a "
                              "Kubernetes emptyDir of medium Memory) or lower the agent's "
                              "--prefetch") from None
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:
        os.unlink(self._path)


#: ``(pid, watcher, fd)``: the process whose blocks the watcher removes, the watcher's
#: pid and the end of its pipe the process holds (:func:`_watch_blocks`)
_watcher: tuple[int, int, int] | None = None
_watcher_lock = threading.Lock()


#: ``(pid, prefix)``: this process's block prefix (:func:`block_prefix`)
_prefix: tuple[int, str] | None = None
#: numbers of this process's blocks, whatever agent writes them
_block_numbers = itertools.count()


def block_prefix() -> str:
    """The names of this process's blocks begin with ``BLOCK_PREFIX<pid>-<token>-``:
    the token, drawn once per process (and after a fork), tells apart processes with the
    same pid that share ``SHM_DIR`` (containers of one host with its ``/dev/shm``)."""
    global _prefix
    pid = os.getpid()
    if _prefix is None or _prefix[0] != pid:
        _prefix = (pid, f"{BLOCK_PREFIX}{pid}-{secrets.token_hex(4)}-")
    return _prefix[1]


def new_block_name() -> str:
    """A name for a new block of this process: :func:`block_prefix`, a number no agent of
    the process used (two agents in one process used the same numbers) and a random token:
    another user who listed ``SHM_DIR`` could create the next numbers' files first, and
    each write failed on them until the group's reading gave up (a review)."""
    return f"{block_prefix()}{next(_block_numbers)}-{secrets.token_hex(4)}"


def _watch_blocks() -> None:
    """Make sure a watcher removes this process's blocks (``SHM_DIR/<block_prefix()>*``)
    once the process is gone, however it ended.

    The watcher, started once per process (again if it died), is ``/bin/sh`` reading a
    pipe whose writing end only this process holds: when the process ends (killed too),
    the read ends and the shell removes whatever blocks are left.  Like Python's resource
    tracker, which :class:`~multiprocessing.shared_memory.SharedMemory` starts for this,
    it ignores SIGINT and SIGTERM (and SIGHUP), but it costs a shell, not a python process.
    It runs in a session of its own: in the process's process group, a kill of the whole
    group (``kill -9 -PGID``, a launcher ending a job's processes so) killed the watcher
    with the process, and its blocks stayed in :data:`SHM_DIR` (a review).  A kill of
    every process of a cgroup (a container stopped, say) still takes it.
    """
    global _watcher
    with _watcher_lock:
        pid = os.getpid()
        if _watcher is not None:
            owner, shell, fd = _watcher
            if owner == pid:
                try:
                    if os.waitpid(shell, os.WNOHANG) == (0, 0):
                        return  # still running
                except ChildProcessError:  # reaped elsewhere: gone too
                    pass
            os.close(fd)  # a dead watcher's pipe, or a forked parent's (its watcher stays)
            _watcher = None
        read_end, write_end = os.pipe()
        argv = ["sh", "-c", _WATCH, "msd-dask-agent-blocks", SHM_DIR, block_prefix()]
        actions = [(os.POSIX_SPAWN_DUP2, read_end, 0)]
        try:
            try:
                shell = os.posix_spawn("/bin/sh", argv, os.environ, file_actions=actions,
                                       setsid=True)
            except NotImplementedError:  # (no POSIX_SPAWN_SETSID: a process group of its own)
                shell = os.posix_spawn("/bin/sh", argv, os.environ, file_actions=actions,
                                       setpgroup=0)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        _watcher = (pid, shell, write_end)


def _new_block(name: str, size: int, group: int | None = None) -> SharedBlock:
    """A new shared memory block ``name`` of ``size`` bytes, removed if this process is
    killed: a :class:`_FileBlock` watched by :func:`_watch_blocks` when the name is one of
    this process's (:func:`block_prefix`), blocks are files (Linux) and the watcher
    runs, else a :class:`~multiprocessing.shared_memory.SharedMemory` (its resource
    tracker).  ``group``: a group id the block is shared with (mode 0660; a
    :class:`_FileBlock` only)."""
    if name.startswith(block_prefix()) and os.path.isdir(SHM_DIR):
        try:
            _watch_blocks()
        except OSError as e:  # no /bin/sh: Python's resource tracker instead
            _log.debug("msd-dask agent: no watcher of its blocks (%s); SharedMemory instead", e)
            if group is not None:
                raise OSError(f"an agent sharing its blocks with a group needs /bin/sh to "
                              f"watch them ({e})") from None
        else:
            return _FileBlock(name, size, group)
    if group is not None:
        raise OSError(f"an agent sharing its blocks with a group needs them as files of "
                      f"{SHM_DIR} (Linux)")
    from multiprocessing.shared_memory import SharedMemory

    return SharedMemory(name=name, create=True, size=size)


def write_block(batch: WireBatch, name: str,
                group: int | None = None) -> tuple[SharedBlock, dict[str, Any]]:
    """Write the numpy arrays of ``batch``'s wire form into a new shared memory block ``name``
    (shared with the group id ``group``, where given: :func:`_new_block`).

    Returns
    -------
    (SharedBlock, dict)
        The block (the caller unlinks it; if this process is killed, the blocks it did
        not unlink are removed for it, see :func:`_new_block`) and the message a rank
        reads it with: ``{"step", "block", "pid", "layout": {field: [offset, dtype,
        shape]}, "meta"}`` (``pid``: this process's; ``meta``: the wire form's other
        fields, as JSON).
    """
    arrays = {k: np.ascontiguousarray(v) for k, v in batch.wire.items()
              if isinstance(v, np.ndarray)}
    layout: dict[str, list[Any]] = {}
    size = 0
    for key, a in arrays.items():
        layout[key] = [size, a.dtype.str, list(a.shape)]
        size += -(-a.nbytes // _ALIGN) * _ALIGN
    shm = _new_block(name, max(size, 1), group)
    try:
        assert shm.buf is not None
        for key, a in arrays.items():
            view: np.ndarray = np.ndarray(a.shape, a.dtype, buffer=shm.buf, offset=layout[key][0])
            view[...] = a
            del view
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    meta = {k: _plain(v) for k, v in batch.wire.items() if k not in arrays}
    return shm, {"step": batch.step, "block": shm.name, "pid": os.getpid(), "layout": layout,
                 "meta": meta}




# ------------------------------------------------------------ agent side


class GroupReader(Protocol):
    """What :class:`HostAgent` needs of the reader of one group of its ranks."""

    def __next__(self) -> WireBatch:
        """The group's next step, its wire form (blocks)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Skip every step up to ``state["step"]``."""

    def report_step_time(self, seconds: float, step: int | None = None) -> None:
        """Forward a rank's compute time on ``step`` to the planner."""

    def mark_taken(self, step: int) -> None:
        """Every rank of the group has ``step`` and the steps before it."""

    def report_returned(self) -> Any:
        """Tell the service the group's last step taken (best effort; a future or ``None``)."""


class AgentGroupReader(Reader):
    """A :class:`~msd_dask.reader.Reader` of a group of ranks for :class:`HostAgent`: what
    it tells the constructor it returned is the last step every rank of the group took
    from the agent (:meth:`mark_taken`), not the last step the agent read ahead: its
    claims say so (:meth:`_returned_through`), and so does its :meth:`state_dict` (what
    it reports when it pauses).  It hands out each step's wire form
    (:class:`WireBatch`): the agent never builds tensors, and never imports torch."""

    #: the last step every rank of the group has (``None``: none yet)
    taken: int | None = None
    #: (what it returned is what its ranks took: the agent reports that itself)
    REPORT_WHEN_DROPPED = False
    #: (it runs in the agent: its ranks check their job's WORLD_SIZE, AgentHandle.reader)
    IN_JOB = False

    def _batch(self, wire: dict[str, Any]) -> WireBatch:  # type: ignore[override]
        """The payload as it came, its wire form (Reader's own code reads only the
        ``step`` of what it holds)."""
        return WireBatch(wire)

    def __next__(self) -> WireBatch:  # type: ignore[override]
        batch = super().__next__()
        assert isinstance(batch, WireBatch)
        return batch

    def mark_taken(self, step: int) -> None:
        """Every rank of the group has ``step`` and the steps before it: reported once the
        reader pauses, as a step it returns is (its ranks may take steps read ahead while
        it waits for the service, after the reporter told an older one)."""
        if self.taken is None or step > self.taken:
            self.taken = int(step)
            self._report_when_idle()

    def state_dict(self) -> dict[str, Any]:
        """``{"service", "rank", "step"}``: the last step every rank of the group took."""
        return reader_state(self.rank, self.taken, self.link.name)

    def _returned_through(self) -> int:
        """The last step every rank of the group took (``-1``: none), sent with each claim:
        the agent claims rounds ahead of its ranks, so the step before a round is not
        what they returned."""
        return -1 if self.taken is None else self.taken


class _WriteFailed(Exception):
    """The block of a step could not be written :data:`WRITE_TRIES` times: the group's
    error, its message as the ranks are told it."""


@dataclass
class _Block:
    """One step of a group held in shared memory."""

    step: int
    shm: SharedBlock
    message: dict[str, Any]

    def unlink(self) -> None:
        _discard(self.shm)


def _discard(shm: SharedBlock) -> None:
    """Unmap and remove ``shm`` (one removed already is gone)."""
    try:
        shm.close()
        shm.unlink()
    except FileNotFoundError:
        pass


@dataclass
class _Group:
    """A group of the agent's ranks read together, and what its ranks have."""

    ranks: list[int]
    reader: GroupReader | None = None
    #: per rank: the last step it has (taken, or skipped); -1: none
    has: dict[int, int] = field(default_factory=dict)
    #: the ranks that asked for a first step (reading starts when all did)
    asked: set[int] = field(default_factory=set)
    #: ranks that had not asked when reading started: taken to have what the others had
    assumed: set[int] = field(default_factory=set)
    #: steps read and not yet taken by every rank, ascending
    blocks: dict[int, _Block] = field(default_factory=dict)
    last_read: int = -1
    reading: bool = False
    #: the group reader's failure (``(message, kind)``), told to every rank that asks
    #: for a step after the last one read (a rank that asks from past that, having
    #: loaded a later state, has the group read again)
    error: tuple[str, str] | None = None
    #: the passing failures of the group's reading so far (a timeout of its reader, a
    #: block it could not write yet), and the last one's ``(message, kind)``: told to the
    #: ranks waiting when it came, as a direct reader's; the agent then reads on
    notices: int = 0
    notice: tuple[str, str] = ("", "error")
    #: requests for a step its ranks made so far (after a timeout the reader waits for one)
    requests: int = 0
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def slowest(self) -> int:
        return min(self.has.get(r, -1) for r in self.ranks)

    def first_after(self, rank: int) -> _Block | None:
        have = self.has.get(rank, -1)
        return next((b for s, b in self.blocks.items() if s > have), None)


@dataclass
class _Holder:
    """The connection that reads a rank through the agent (:meth:`HostAgent._hold`)."""

    #: the process that connected (``None``: unknown)
    pid: int | None
    stream: asyncio.StreamReader

    def is_open(self) -> bool:
        """Whether the process has not closed the connection (as far as the agent read)."""
        return not self.stream.at_eof()


def _peer_pid(writer: asyncio.StreamWriter) -> int | None:
    """The pid of the process at the other end of a Unix socket connection (``SO_PEERCRED``,
    Linux); ``None`` where that is unknown: another system, or a process in a pid
    namespace the agent does not see (its pid reads 0)."""
    sock = writer.get_extra_info("socket")
    creds = None if sock is None else peer_creds(sock)
    return creds[0] if creds is not None and creds[0] > 0 else None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's)
        pass
    return True


async def _wait_until(changed: asyncio.Condition, predicate: Callable[[], bool],
                      deadline: float) -> bool:
    """Wait on ``changed`` (held) until ``predicate()`` holds, at most until ``deadline``
    (:func:`time.monotonic`); whether it holds.

    A predicate that holds already is true at once, with no time left too (``wait_for``
    of no time left cancels even a wait that would not have waited, in Python 3.11).
    """
    if predicate():
        return True
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    try:
        await asyncio.wait_for(changed.wait_for(predicate), left)
    except TimeoutError:
        return predicate()
    return True


def _in_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """``fn(*args)`` in a new daemon thread, as a future of the running loop: a call stuck
    on the service (a reader waits up to its ``timeout``) does not keep the process
    from exiting, as it would in the loop's default executor."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        value: Any
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            ok, value = False, e
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the agent stopped and its loop closed: no one awaits it
            pass

    threading.Thread(target=run, name="msd-agent-call", daemon=True).start()
    return fut


def own_folder(path: str) -> None:
    """Make ``path`` a folder of this user's own (mode 0700) if it is not there; refuse one
    another user owns, one other users may enter or write to, and anything not a folder
    (a symbolic link, say), naming it: the folder of the agent's default socket
    (:func:`~msd_dask.service.agent_client.default_socket`) is in ``/tmp``, where anyone
    could have made it first."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    why = None
    if not stat.S_ISDIR(st.st_mode):
        why = "is not a folder"
    elif st.st_uid != os.getuid():
        why = f"belongs to user id {st.st_uid}, not to this process's ({os.getuid()})"
    elif st.st_mode & 0o077:
        why = (f"has mode {stat.S_IMODE(st.st_mode):o}: other users may use it (chmod 700 "
               "it if it is yours)")
    if why is not None:
        raise ServiceError(f"{path}, the folder of the agent's default socket, {why}; pass "
                           f"--socket a path in a folder of your own, and name it in "
                           f"{AGENT_ENV} for the ranks")


class HostAgent:
    """Serves a host's ranks their batches from one connection to the service.

    Parameters
    ----------
    name : str
        The service's name (a rank asking for another service is refused).
    config : Config
        The service's configuration (its mesh and ``timeout``).
    ranks : sequence of int
        The global ranks of this host.
    open_reader : callable
        ``open_reader(first, others)``: the reader of a group of ranks (its lowest
        rank, the others), e.g. an :class:`AgentGroupReader` of the service's link
        (:meth:`for_service`).
    path : str
        The Unix domain socket to serve on (replaced if it is a stale socket); a path
        longer than a Unix socket's may be is a ``ValueError`` here, naming it
        (:func:`~msd_dask.service.agent_client.check_socket_path`), before anything is
        connected or bound.
    prefetch : int, optional
        Steps the agent reads ahead of a group's slowest rank (default: the
        config's ``prefetch``).
    timeout : float, optional
        What the agent tells its ranks to wait for a step by default (default: the
        config's ``timeout``); :meth:`for_service` gives it its group readers' wait.
    state : callable, optional
        ``state(step)``: the service's :meth:`~msd_dask.service.handle.DataService.state_dict`,
        which the agent answers a rank's :meth:`AgentHandle.state_dict
        <msd_dask.service.agent_client.AgentHandle.state_dict>` with (run in a thread).
    group : int, optional
        A group id the agent shares its socket and blocks with (mode 0660; Linux), for
        ranks of another user in that group (a sidecar container's agent); by default
        they are the agent's user's alone (mode 0600).
    """

    def __init__(self, name: str, config: Config, ranks: Sequence[int],
                 open_reader: Callable[[int, list[int]], GroupReader], path: str, *,
                 prefetch: int | None = None, timeout: float | None = None,
                 state: Callable[[int | None], dict[str, Any]] | None = None,
                 group: int | None = None):
        self.name = name
        #: the group id the socket and blocks are shared with (None: the user's alone)
        self.group = group
        self._state = state
        self.config = config
        self.path = check_socket_path(path, name)
        #: seconds the agent waits for a step (default: the service's ``timeout``), and its
        #: ranks' default wait: a rank that gave up sooner would fail while the agent waits
        self.timeout = config.timeout if timeout is None else float(timeout)
        from msd_dask.roles.planner import agent_prefetch_limit

        # (the service keeps the states of the steps its ranks may be at only so far behind
        # what the agent reads: past it, state_dict() of a rank's step was refused; a review)
        most = agent_prefetch_limit(config)
        given = config.prefetch if prefetch is None else prefetch
        if not is_whole(given) or not 1 <= given <= most:
            raise ValueError(f"the agent's prefetch must be a whole number from 1 to {most} "
                             "(the service keeps the states of the steps its ranks may be at "
                             f"that far behind what the agent reads), got {given!r}")
        self.prefetch = int(given)
        self.groups = [_Group(g) for g in local_groups(config, ranks)]
        self.ranks = [r for g in self.groups for r in g.ranks]
        self._group_of = {r: g for g in self.groups for r in g.ranks}
        #: rank -> the connection that reads it now, and its process (:meth:`_hold`)
        self._holders: dict[int, _Holder] = {}
        self._open_reader = open_reader
        self._server: asyncio.AbstractServer | None = None
        #: the inode of the socket file this agent bound (it removes only that one)
        self._socket_inode = -1
        self._stopped: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: :meth:`stop` was called (before :meth:`serve` began, too: a signal right after
        #: ``msd-dask agent`` installed its handlers); with the lock, it is never lost
        self._stop_requested = False
        #: why the agent stops, told to the ranks waiting then (:meth:`stop`)
        self.stop_reason: str | None = None
        # (re-entrant: msd-dask agent's signal handler calls stop() in the main thread,
        # which may be inside serve()'s locked section when the signal comes)
        self._stop_lock = threading.RLock()
        self._tasks: set[asyncio.Task[None]] = set()
        #: guards the three below, shared with the threads that write blocks
        #: (:meth:`_write_block`): a block written as the agent stops is unlinked once
        self._blocks_lock = threading.Lock()
        #: blocks written and not yet held by their group (the read that awaits one may
        #: be cancelled by the stop meanwhile): :meth:`_free_all` unlinks them
        self._unplaced: dict[str, SharedBlock] = {}
        #: blocks being written now (the stop waits for them, :data:`STOP_WRITES_WAIT`)
        self._writing = 0
        #: :meth:`_free_all` ran: a block written from now on is unlinked by its writer
        self._closing = False
        #: set once the socket accepts connections (:meth:`run` in another thread)
        self.ready = threading.Event()

    @classmethod
    def for_service(cls, service: Any, ranks: Sequence[int], path: str | None = None, *,
                    prefetch: int | None = None, timeout: float | None = None,
                    group: int | None = None) -> HostAgent:
        """An agent of a :class:`~msd_dask.service.handle.DataService` connected directly:
        each group read by an :class:`AgentGroupReader` of its link (``group``: see the
        class)."""
        cfg = service.config
        wait = cfg.timeout if timeout is None else float(timeout)

        def open_reader(first: int, others: list[int]) -> GroupReader:
            return AgentGroupReader(service.link, first, timeout=wait, also=others)

        return cls(service.name, cfg, ranks, open_reader,
                   path or default_socket(service.name), prefetch=prefetch,
                   timeout=wait, state=service.state_dict, group=group)

    # ------------------------------------------------------------ serving
    async def serve(self) -> None:
        """Serve until :meth:`stop`; then free every block and remove the socket."""
        stopped = asyncio.Event()
        with self._stop_lock:
            self._loop, self._stopped = asyncio.get_running_loop(), stopped
            if self._stop_requested:
                stopped.set()
        listening = self._bind()
        self._server = await asyncio.start_unix_server(self._connection, sock=listening)
        self.ready.set()
        try:
            await stopped.wait()
        finally:
            self._server.close()
            for g in self.groups:  # the ranks waiting hear that the agent closes
                async with g.changed:
                    g.changed.notify_all()
            await asyncio.sleep(0.1)
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._wait_writes()
            self._free_all()
            with self._path_lock():  # (only the socket this agent bound, not one bound since)
                try:
                    if os.stat(self.path).st_ino == self._socket_inode:
                        os.unlink(self.path)
                except FileNotFoundError:
                    pass

    def run(self) -> None:
        """:meth:`serve` in a new event loop (returns once stopped)."""
        asyncio.run(self.serve())

    def stop(self, reason: str | None = None) -> None:
        """Stop serving (from any thread; the ranks waiting are told the agent closes, and
        ``reason``, why, if given).  Called before :meth:`serve` began, serve returns as
        soon as it has begun."""
        with self._stop_lock:
            self._stop_requested = True
            if reason is not None and self.stop_reason is None:
                self.stop_reason = reason
            loop, stopped = self._loop, self._stopped
        if loop is None or stopped is None:
            return
        try:
            loop.call_soon_threadsafe(stopped.set)
        except RuntimeError:  # the loop is closed already
            pass

    def report_returned(self, timeout: float = 5.0) -> None:
        """Tell the service the last step every rank of each group took (best effort)."""
        deadline = time.monotonic() + timeout
        for g in self.groups:
            if g.reader is None:
                continue
            try:
                call = g.reader.report_returned()
                if call is not None:
                    call.result(timeout=max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a lost constructor learns nothing
                pass

    def _bind(self) -> socket.socket:
        """The agent's listening socket at :attr:`path`, bound and listening.

        Bound here, not by asyncio's ``start_unix_server(path=...)``, which removes any
        file at the path first: two agents started at once on one path both served, the
        socket file the second's, the first's unreachable (and its exit removed the
        second's file).  A path in use is an agent's that answers (refused), or a stale
        one (removed, then bound again).  Agents starting on one path do this one at a
        time, under a lock on ``<path>.lock`` (left in place: removing it would let two
        agents lock two files).
        """
        if self.path == default_socket(self.name):
            own_folder(os.path.dirname(self.path))
        with self._path_lock():
            return self._bind_locked()

    @contextmanager
    def _path_lock(self) -> Iterator[None]:
        """Held while an agent binds :attr:`path` or removes it."""
        import fcntl

        # (not through a symbolic link another user put in a shared folder; a review)
        lock = os.open(self.path + ".lock",
                       os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + BIND_WAIT
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise ServiceError(
                            f"another process held {self.path}.lock for {BIND_WAIT:g}s (an "
                            "agent starting or stopping on this socket path, stuck?); stop "
                            "it or pass another --socket") from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(lock)  # (releases the lock)

    def _bind_locked(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                sock.bind(self.path)
            except OSError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                self._remove_stale_socket()
                sock.bind(self.path)
            # the host's ranks run as the agent's user, or in its group where given; set
            # before it listens (no other user's connect is taken while the mode is still
            # the umask's)
            if self.group is not None:
                os.chown(self.path, -1, self.group)
            os.chmod(self.path, 0o600 if self.group is None else 0o660)
            sock.listen(100)
            self._socket_inode = os.stat(self.path).st_ino
        except BaseException:
            sock.close()
            raise
        return sock

    def _remove_stale_socket(self) -> None:
        """Remove a socket left by an agent that is gone; refuse one that answers, and a
        path that is no socket (a typo naming a file, the agent's own log, say, which
        would be deleted as a stale socket)."""
        try:
            mode = os.lstat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise ServiceError(f"the agent's socket path {self.path} names an existing file "
                               "that is not a socket; pass another --socket (the agent "
                               "removes only a stale socket there)")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(BIND_WAIT)
        deadline = time.monotonic() + BIND_WAIT
        try:
            while True:
                try:
                    probe.connect(self.path)
                except BlockingIOError:
                    # (a Unix socket whose backlog is full answers at once, EAGAIN: its
                    # agent lives, stopped or busy; taken for stale, its socket was removed
                    # and two agents read the same ranks; a review)
                    if time.monotonic() < deadline:
                        time.sleep(0.05)
                        continue
                    raise TimeoutError from None
                break
        except TimeoutError:
            raise ServiceError(f"an agent on {self.path} takes no connection within "
                               f"{BIND_WAIT:g}s; stop it or pass another --socket") from None
        except (ConnectionRefusedError, FileNotFoundError):  # (no one listens: stale)
            with suppress(FileNotFoundError):
                os.unlink(self.path)
        else:
            raise ServiceError(f"an agent already serves on {self.path}; stop it or pass "
                               "another --socket")
        finally:
            probe.close()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _connection(self, stream: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            await self._talk(stream, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except (ValueError, KeyError, TypeError, OverflowError) as e:  # not the protocol: say so, hang up
            _log.warning("msd-dask agent: a malformed message on %s: %r", self.path, e)
            try:
                await _asend(writer, {"error": f"the agent at {self.path} got a malformed "
                                      f"message ({type(e).__name__}: {e}); is the rank's "
                                      "msd_dask the agent's version?", "kind": "error"})
            except ConnectionError:
                pass
        finally:
            writer.close()

    async def _talk(self, stream: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            # (a rank sends its hello as it connects; a peer that sends none, or half of
            # one, held the connection and its task until the agent stopped)
            hello = await asyncio.wait_for(_arecv(stream), HELLO_TIMEOUT)
        except TimeoutError:
            _log.warning("msd-dask agent: a connection to %s sent no hello within %gs; "
                         "closing it", self.path, HELLO_TIMEOUT)
            return
        if hello is None or hello.get("op") != "hello":
            return
        parallel = self.config.parallel
        info = {"ok": True, "service": self.name, "ranks": self.ranks,
                "timeout": self.timeout, "world_size": parallel.world_size,
                "layout": parallel.layout}
        if hello.get("service") not in (None, self.name):
            await _asend(writer, {"error": f"the agent at {self.path} serves service "
                                  f"{self.name!r}, not {hello['service']!r}"})
            return
        if "state_dict" in hello:  # a rank's AgentHandle.state_dict(step)
            answer = await self._state_dict(hello["state_dict"])
            # (megabytes of JSON at dp 16,384: encoded off the loop that serves the ranks)
            writer.write(await asyncio.to_thread(frame, answer))
            await writer.drain()
            return
        if "rank" not in hello:  # a probe
            await _asend(writer, info)
            return
        rank = _int_field(hello, "rank")
        group = self._group_of.get(rank)
        try:  # (a rank outside the world: no --ranks can cover it)
            check_rank(rank, self.name, parallel.world_size, parallel.layout)
        except ValueError as e:
            await _asend(writer, {"error": str(e)})
            return
        if group is None:
            await _asend(writer, {"error": f"the agent at {self.path} serves ranks "
                                  f"{_ranges(self.ranks)} of service {self.name!r}, not rank "
                                  f"{rank}; start this host's agent with --ranks covering it"})
            return
        holder = _Holder(_peer_pid(writer), stream)
        refusal = self._hold(rank, holder)
        if refusal is not None:
            await _asend(writer, {"error": refusal, "kind": "error"})
            return
        try:
            await _asend(writer, info)
            await self._serve_rank(stream, writer, group, rank)
        finally:
            if self._holders.get(rank) is holder:
                del self._holders[rank]

    def _hold(self, rank: int, holder: _Holder) -> str | None:
        """Make ``holder`` the connection that reads ``rank``; why not, if another process
        reads it now.

        The agent keeps what a rank has per rank, not per connection: two processes with
        one rank (a stale one still running as torchrun starts its replacement, a wrong
        ``LOCAL_RANK``) both got the same steps, then one failed with a misleading message
        (a review).  A connection of the same process (a reader that dials again after a
        timeout, a second reader of the rank) replaces the rank's; so does one of another
        process once the rank's connection ended, or its process did (a rank restarted).
        Where the processes are unknown (no ``SO_PEERCRED``; a peer in another pid
        namespace) the new connection is taken, as before.
        """
        held = self._holders.get(rank)
        if (held is not None and holder.pid is not None and held.pid is not None
                and held.pid != holder.pid and held.is_open() and _alive(held.pid)):
            return (f"the agent at {self.path} refuses rank {rank} to pid {holder.pid}: rank "
                    f"{rank} is already read through this agent by pid {held.pid}, which "
                    "runs and holds its connection (two processes with one rank: a stale "
                    "one, or LOCAL_RANK wrong?); stop that process or close its reader "
                    "first")
        self._holders[rank] = holder
        return None

    async def _serve_rank(self, stream: asyncio.StreamReader, writer: asyncio.StreamWriter,
                          group: _Group, rank: int) -> None:
        """Answer the requests of ``rank``'s connection until it ends."""
        while True:
            try:
                # (unbounded between messages, as a rank is silent while it computes; a
                # message begun and never finished held the connection and its task
                # until the rank disconnected, the agent waiting on it silently)
                msg = await _arecv(stream, rest_within=MESSAGE_TIMEOUT)
            except TimeoutError:
                _log.warning("msd-dask agent: rank %d on %s sent the start of a message and "
                             "not the rest within %gs; closing its connection", rank,
                             self.path, MESSAGE_TIMEOUT)
                return
            if msg is None:
                return
            op = msg.get("op")
            if op == "next":
                await _asend(writer, await self._next(group, rank, _int_field(msg, "after"),
                                                      _float_field(msg, "timeout")))
            elif op == "ack":
                await self._taken(group, rank, _int_field(msg, "step"))
            elif op == "step_time" and group.reader is not None:
                self._spawn(_in_thread(group.reader.report_step_time,
                                       _float_field(msg, "seconds"), _int_field(msg, "step")))
            elif op == "bye":
                return

    async def _state_dict(self, step: int | None) -> dict[str, Any]:
        """The answer to a rank asking for the service's ``state_dict(step)``: ``{"state"}``,
        or ``{"error", "kind"}`` with the refusal's text and kind (``value``: a step the
        service cannot describe, ``timeout``, or ``service``)."""
        if self._state is None:
            return {"error": f"the agent at {self.path} has no service handle to take the "
                    "state from", "kind": "service"}
        if step is not None and not is_whole(step):  # (5.7 was taken for step 5)
            return {"error": f"the agent at {self.path} was asked for the state of step "
                    f"{step!r:.40}, not a step number", "kind": "value"}
        want = None if step is None else int(step)
        try:
            # (a daemon thread: a state that waits on the service, up to several times its
            # timeout, does not hold the agent's stop, as the loop's executor would)
            state = await _in_thread(self._state, want)
        except ValueError as e:
            return {"error": str(e), "kind": "value"}
        except TimeoutError as e:
            return {"error": str(e), "kind": "timeout"}
        except Exception as e:  # noqa: BLE001 - told to the rank that asked
            return {"error": f"{type(e).__name__}: {e}", "kind": "service"}
        return {"state": state}

    async def _next(self, g: _Group, rank: int, after: int, timeout: float) -> dict[str, Any]:
        """The message of ``rank``'s first step after ``after`` it lacks, once read, or an
        error after ``timeout`` seconds, saying what it waited for.

        ``timeout`` bounds the whole answer, one deadline for every wait in it (a rank past
        a failure waits for its peers, then for its step): the rank's socket waits only
        ``timeout`` and :data:`~msd_dask.service.agent_client.ANSWER_MARGIN`, and a
        rank that gave up first would blame an agent that is running."""
        assert self._stopped is not None
        deadline = time.monotonic() + timeout
        async with g.changed:
            if g.error is not None and after > g.last_read:
                # a rank past every step read before the failure loaded a later state (as
                # the error may have told it); a rank still taking the steps read before it
                # is no such rank: resetting then unlinked its peers' blocks (a review).
                # Nor is the group read again while a peer that asked still takes them:
                # their blocks stay until it has them (another review)
                def behind() -> list[int]:
                    return [r for r in g.ranks if r != rank and r in g.asked
                            and r not in g.assumed and g.has.get(r, -1) < g.last_read]

                if not await _wait_until(g.changed, lambda: (
                        not behind() or g.error is None
                        or self._stopped is not None and self._stopped.is_set()), deadline):
                    return {"error": f"rank {rank} asked the agent at {self.path} for step "
                            f"{after + 1} (a later state than the steps up to {g.last_read} "
                            f"read before the group's reader failed), and waited {timeout:.0f}s "
                            f"for rank(s) {behind()} of its group to take those steps first",
                            "kind": "timeout"}
                if g.error is not None:
                    self._reset(g)
            if rank in g.assumed and after < g.has[rank]:
                return {"error": f"rank {rank} asked the agent at {self.path} for step "
                        f"{after + 1}, but the agent began reading ranks {g.ranks} after step "
                        f"{g.has[rank]}, the state the other ranks loaded; load the same "
                        "state on every rank of the group (or restart the agent)",
                        "kind": "error"}
            had = g.has.get(rank, -1)
            if rank not in g.assumed and after < had:
                # the rank took the steps up to ``had`` from this agent (it acknowledged
                # them) and asks again from an older state (restarted, or a second reader):
                # refused before anything is handed out (each step is served once)
                return {"error": self._taken_already(rank, after, had), "kind": "error"}
            g.assumed.discard(rank)
            g.has[rank] = max(had, after)
            if not g.asked:
                self._spawn(self._start_later(g))
            g.asked.add(rank)
            self._free(g)
            if g.asked >= set(g.ranks):
                self._start(g)
            g.requests += 1
            g.changed.notify_all()
            seen = g.notices

            def ready() -> bool:
                return (g.first_after(rank) is not None or g.error is not None
                        or g.notices > seen
                        or self._stopped is not None and self._stopped.is_set())

            # (only the time left: the wait for the peers above took its share)
            if not await _wait_until(g.changed, ready, deadline):
                return {"error": self._why_waiting(g, rank, timeout), "kind": "timeout"}
            block = g.first_after(rank)
            if block is not None:
                return block.message
            if g.error is not None:
                return {"error": g.error[0], "kind": g.error[1]}
            if g.notices > seen:
                return {"error": g.notice[0], "kind": g.notice[1]}
            why = "" if self.stop_reason is None else f": {self.stop_reason}"
            return {"error": f"the agent at {self.path} is closing (rank {rank} waited for step "
                    f"{g.has.get(rank, -1) + 1}){why}", "kind": "closed"}

    def _taken_already(self, rank: int, after: int, had: int) -> str:
        """Why ``rank``, which took every step up to ``had``, is refused the step after
        ``after`` (worded as a direct reader's refusal)."""
        head = f"rank {rank}: "
        if after < 0:
            return head + (
                f"a new reader with no state asked the agent at {self.path} for its first "
                f"step, but this rank took the steps up to {had} from it already (an earlier "
                "reader; the agent reads ahead of its readers: possibly past the last step "
                "one returned) and the service serves each step once: load the state of the "
                "last step this rank returned (reader.load_state_dict(state), the state_dict() "
                "saved with its checkpoint), or resume the whole job from "
                f"DataService.state_dict(step) (docs/resume.md); {TRIAL_HINT}")
        return head + (
            f"asked the agent at {self.path} for step {after + 1}, but this rank took the "
            f"steps up to {had} from it already and the service serves each step once: "
            "resume the whole job from DataService.state_dict(step) (docs/resume.md), or "
            f"load the state of step {had} or later on this rank")

    def _why_waiting(self, g: _Group, rank: int, timeout: float) -> str:
        want = g.has.get(rank, -1) + 1
        head = (f"rank {rank} waited {timeout:.0f}s for step {want} from the agent at "
                f"{self.path}: ")
        missing = sorted(set(g.ranks) - g.asked)
        if not g.reading:
            return head + (f"the agent reads for ranks {g.ranks} together and rank(s) {missing} "
                           "did not ask for a step yet (not started on this host?)")
        if g.last_read - g.slowest() >= self.prefetch:
            slow = [r for r in g.ranks if g.has.get(r, -1) == g.slowest()]
            never = [r for r in slow if r not in g.asked]
            return head + (f"the agent holds {self.prefetch} step(s) ahead of rank(s) {slow} of "
                           "the same group, which did not take them"
                           + (f" (rank(s) {never} never asked: not started on this host?)"
                              if never else ""))
        return head + (f"the agent is waiting for step {g.last_read + 1} of service "
                       f"{self.name!r} (msd-dask agent's log says more)")

    def _reset(self, g: _Group) -> None:
        """Forget ``g``'s failed reader: it is read again, as from the start, once its ranks
        ask (a rank that loaded a later state after the failure, e.g. as the error told it
        to; a new direct reader would do the same)."""
        _log.warning("msd-dask agent: reading ranks %s again after: %s", g.ranks, g.error)
        g.error, g.reader, g.reading, g.last_read = None, None, False, -1
        g.asked.clear()
        g.assumed.clear()
        g.has.clear()
        for block in g.blocks.values():
            block.unlink()
        g.blocks.clear()

    def _start(self, g: _Group) -> None:
        """Start reading ``g`` after the last step every rank that asked has; the ranks
        that did not ask yet are taken to have it too (:data:`START_GRACE`)."""
        if g.reading:
            return
        g.reading = True
        start = min(g.has[r] for r in g.asked)
        for r in g.ranks:
            if r not in g.asked:
                g.has[r] = start
                g.assumed.add(r)
        self._spawn(self._read(g))

    async def _start_later(self, g: _Group) -> None:
        """Start reading ``g`` :data:`START_GRACE` seconds after its first rank asked, if
        not all did (one process reading several ranks of a group one after another)."""
        await asyncio.sleep(START_GRACE)
        async with g.changed:
            self._start(g)
            g.changed.notify_all()

    async def _taken(self, g: _Group, rank: int, step: int) -> None:
        async with g.changed:
            g.has[rank] = max(g.has.get(rank, -1), step)
            self._free(g)
            g.changed.notify_all()

    def _free(self, g: _Group) -> None:
        """Unlink the blocks every rank of ``g`` has; tell its reader."""
        slowest = g.slowest()
        for step in [s for s in g.blocks if s <= slowest]:
            g.blocks.pop(step).unlink()
        if slowest >= 0 and g.reader is not None:
            g.reader.mark_taken(slowest)

    async def _read(self, g: _Group) -> None:
        """Read ``g``'s steps while its slowest rank is less than ``prefetch`` behind."""
        assert self._stopped is not None
        first, others = g.ranks[0], g.ranks[1:]
        try:
            reader = await _in_thread(self._open_reader, first, others)
            start = g.slowest()
            if start >= 0:
                reader.load_state_dict(reader_state(first, start, self.name))
                reader.mark_taken(start)
            g.reader, g.last_read = reader, max(g.last_read, start)
            #: a step read whose block is not written yet (its write failed), and the
            #: tries of that write so far: written at the next request, not read again
            batch: WireBatch | None = None
            tries = 0
            while not self._stopped.is_set():
                if batch is None:
                    async with g.changed:
                        await g.changed.wait_for(
                            lambda: g.last_read - g.slowest() < self.prefetch
                            or self._stopped is not None and self._stopped.is_set())
                        self._skip_read(g, reader)
                    if self._stopped.is_set():
                        return
                    try:
                        batch = await _in_thread(reader.__next__)
                    except (ServiceTimeoutError, TimeoutError) as e:
                        # the service was slow: the ranks waiting now are told, as a direct
                        # reader's caller would be, and the group reader (its state intact)
                        # reads on at the next request of a rank, as a direct reader would
                        _log.warning("msd-dask agent: reading ranks %s timed out: %s",
                                     g.ranks, e)
                        await self._tell_and_wait(g, (
                            f"the agent at {self.path} could not read ranks {g.ranks}: "
                            f"{type(e).__name__}: {e}", "timeout"))
                        continue
                    tries = 0
                block = None
                if batch.step > g.slowest():  # some rank lacks it: into shared memory
                    try:
                        written = await _in_thread(self._write_block, batch, new_block_name())
                    except OSError as e:
                        # /dev/shm full for a moment, say: the step, taken from the service
                        # already, is kept and written at the next request (dropped, it
                        # would be lost to every rank); a failure that persists is the
                        # group's
                        tries += 1
                        what = (f"the agent at {self.path} could not write step {batch.step} "
                                f"of ranks {g.ranks} into shared memory "
                                f"({type(e).__name__}: {e})")
                        if tries >= WRITE_TRIES:
                            raise _WriteFailed(
                                f"{what}, at each of {tries} tries (the last {tries - 1} at "
                                "the ranks' requests after it failed); the step is lost: load "
                                f"the state of step {batch.step} on every rank of the group to "
                                "go on after it (or restart the agent)") from None
                        _log.warning("msd-dask agent: %s; trying again at the next request",
                                     what)
                        await self._tell_and_wait(
                            g, (f"{what}; it tries again at the next request", "error"))
                        continue
                    if written is None:  # the agent stopped meanwhile (and unlinked it)
                        return
                    block = _Block(batch.step, *written)
                async with g.changed:
                    g.last_read = batch.step
                    if block is not None:
                        with self._blocks_lock:  # the group's now, unlinked with it
                            self._unplaced.pop(block.shm.name, None)
                        g.blocks[batch.step] = block
                        self._free(g)  # every rank may have skipped it meanwhile
                    g.changed.notify_all()
                batch = None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - told to every rank of the group that asks
            kind = "timeout" if isinstance(e, ServiceTimeoutError | TimeoutError) else "error"
            _log.error("msd-dask agent: reading ranks %s failed: %s", g.ranks, e)
            async with g.changed:
                g.error = (str(e) if isinstance(e, _WriteFailed) else
                           f"the agent at {self.path} could not read ranks {g.ranks}: "
                           f"{type(e).__name__}: {e}", kind)
                g.changed.notify_all()

    def _skip_read(self, g: _Group, reader: GroupReader) -> None:
        """Have ``reader`` go on after the slowest rank of ``g`` if every rank is past what it
        read (each loaded a later state mid-stream): it claims from there, so the
        constructor releases the steps skipped without sending them, as for a direct
        reader's state (else it would read each from the service, to drop it)."""
        skip = g.slowest()
        if skip > g.last_read:
            _log.info("msd-dask agent: ranks %s skip to step %d; their reader goes on after it "
                      "(it read the steps up to %d)", g.ranks, skip, g.last_read)
            reader.load_state_dict(reader_state(g.ranks[0], skip, self.name))
            g.last_read = skip

    async def _tell_and_wait(self, g: _Group, notice: tuple[str, str]) -> None:
        """Tell the ranks of ``g`` waiting now ``notice`` (a passing failure, ``(message,
        kind)``), then wait for the next request of a rank (or the stop): the agent reads
        on then, as a direct reader's caller would by asking again."""
        async with g.changed:
            g.notices += 1
            g.notice = notice
            g.changed.notify_all()
            await g.changed.wait_for(functools.partial(self._asked_since, g, g.requests))

    def _asked_since(self, g: _Group, requests: int) -> bool:
        """Whether a rank of ``g`` asked for a step after its ``requests``-th request, or
        the agent stops."""
        return g.requests > requests or self._stopped is not None and self._stopped.is_set()

    def _write_block(self, batch: WireBatch, name: str) -> tuple[SharedBlock, dict[str, Any]] | None:
        """:func:`write_block` (in a thread of :meth:`_read`), the block then the agent's
        to unlink until its group holds it; ``None`` if the agent stopped before it was
        written, the block unlinked here.

        The stop cancels the read that awaits the write, so no one else learns of the
        block: it was left in :data:`SHM_DIR` until the process exited (at once for
        ``msd-dask agent``, whose watcher removed it; never, for an agent in a process
        that lives on).
        """
        with self._blocks_lock:
            if self._closing:
                return None
            self._writing += 1
        try:
            shm, msg = write_block(batch, name, self.group)
        except BaseException:
            with self._blocks_lock:
                self._writing -= 1
            raise
        with self._blocks_lock:
            self._writing -= 1
            if not self._closing:
                self._unplaced[shm.name] = shm
                return shm, msg
        _discard(shm)
        return None

    async def _wait_writes(self) -> None:
        """Wait for the blocks being written, at most :data:`STOP_WRITES_WAIT` seconds, so
        that a stopped agent leaves none (one written later is unlinked by its writer)."""
        deadline = time.monotonic() + STOP_WRITES_WAIT
        while self._writing and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._writing:
            _log.warning("msd-dask agent at %s: %d block(s) still being written %gs after it "
                         "began to stop; each is unlinked once written", self.path,
                         self._writing, STOP_WRITES_WAIT)

    def _free_all(self) -> None:
        """Unlink every block of the agent: its groups', those written but not yet placed
        in a group; a block written from now on is unlinked by its writer."""
        with self._blocks_lock:
            self._closing = True
            unplaced = list(self._unplaced.values())
            self._unplaced.clear()
        for shm in unplaced:
            _discard(shm)
        for g in self.groups:
            for block in g.blocks.values():
                block.unlink()
            g.blocks.clear()


def _ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"``."""
    parts: list[str] = []
    for r in sorted(ranks):
        if parts and r == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)
