"""A training process's side of the host agent: its protocol, its socket and a rank's reader.

A rank process behind ``msd-dask agent`` (:mod:`msd_dask.service.agent`) reads its
batches through this module alone: a Unix socket to the agent and the agent's shared
memory blocks, no Dask client.  It imports only the standard library, numpy and
msd_dask's batch and wire form (not the service's handle, its config or Dask), so a
rank behind an agent costs its host as little memory as a process can
(docs/benchmarks.md, Memory); :class:`msd_dask.torch.MsdIterableDataset` and
``DataService.connect`` use it when :data:`AGENT_ENV` names a socket.

The protocol, one connection per rank reader, each message a 4-byte length and a
JSON object:

* rank → agent ``{"op": "hello", "rank", "service"}``; the agent answers
  ``{"ok", "ranks", "timeout"}`` or ``{"error"}`` (a rank it does not serve, another
  service, a rank another running process reads through it).  Without ``rank``: a
  probe (:meth:`AgentHandle.connect`).
* ``{"op": "next", "after", "timeout"}``: the first step after ``after`` the rank does
  not have; the agent answers ``{"step", "block", "layout", "meta"}`` once it holds
  one (``block``: the name of a POSIX shared memory block, on Linux the file
  ``/dev/shm/<block>`` (:func:`~msd_dask.service.agent.write_block`), holding the numpy arrays of the step's
  wire form (:func:`~msd_dask.core.packing.to_wire`) at the offsets of ``layout``,
  ``meta`` its other fields) or ``{"error", "kind"}``
  after ``timeout`` seconds or when its own reader failed.  The agent keeps the wire
  form and never imports torch (about 100 MiB); each rank builds its
  :class:`~msd_dask.batch.Batch` as a direct reader does.
* ``{"op": "ack", "step"}``: the rank copied the step out; once every rank of the
  group has a step, the agent unlinks its block.
* ``{"op": "step_time", "step", "seconds"}``: forwarded to the planner
  (:meth:`~msd_dask.reader.Reader.report_step_time`).
* ``{"op": "bye"}``: the reader is closed.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from msd_dask.batch import (
    Batch,
    check_rank,
    check_world_size,
    loaded_step,
    no_going_back,
    rank_number,
    reader_state,
    step_number,
    step_time,
    wait_seconds,
)
from msd_dask.core.packing import from_wire
from msd_dask.errors import ServiceError, ServiceTimeoutError

__all__ = [
    "AGENT_ENV",
    "AGENT_SOCKET",
    "BLOCK_PREFIX",
    "HEADER",
    "SHM_DIR",
    "AgentHandle",
    "AgentReader",
    "DIRECT_ONLY",
    "MAX_SOCKET_PATH",
    "agent_path",
    "check_socket_path",
    "connect_agent",
    "default_socket",
    "frame",
    "read_block",
    "recv",
    "send",
]

#: the environment variable naming the agent's socket: set, ``DataService.connect``
#: reads through the agent (no Dask client in the training process)
AGENT_ENV = "MSD_DASK_AGENT"
#: the agent's socket by default, from the user's id and the service's name
#: (:func:`default_socket`): in a folder of the user's own, which the agent makes with mode
#: 0700 and refuses if another user owns it or may write to it (as tmux's
#: ``/tmp/tmux-UID``): in ``/tmp`` itself another user's process could bind the path
#: first and keep the agent from starting
AGENT_SOCKET = "/tmp/msd-dask-{uid}/agent-{name}.sock"
#: the prefix of the agent's shared memory blocks (``/dev/shm/`` on Linux), then its pid
BLOCK_PREFIX = "msd-agent-"
#: where POSIX shared memory blocks are files (Linux)
SHM_DIR = "/dev/shm"
#: seconds a rank waits for the agent's answer beyond its own ``timeout`` (the agent
#: answers a wait that timed out itself, saying why, within that ``timeout``: one deadline
#: for all it waits for, so the margin is only the answer's way back)
ANSWER_MARGIN = 10.0
#: the longest path a Unix domain socket may have, in bytes: ``sun_path`` of
#: ``sockaddr_un`` (108 bytes on Linux, 104 on macOS and the BSDs) less its closing NUL
MAX_SOCKET_PATH = 107 if sys.platform.startswith("linux") else 103


def default_socket(name: str) -> str:
    """The agent socket of service ``name`` by default for this process's user
    (:data:`AGENT_SOCKET`)."""
    return AGENT_SOCKET.format(uid=os.getuid(), name=name)


def check_socket_path(path: str, name: str | None = None) -> str:
    """``path`` if a Unix domain socket may have it, else a ``ValueError`` naming it, its
    length and the limit (:data:`MAX_SOCKET_PATH`).

    Checked before anything is connected: a path too long failed only once the agent had
    connected to the service (``AF_UNIX path too long``, no path, no limit, and its
    ``<path>.lock`` left behind), and a rank took it for an agent not running (a review).
    ``name``: the service, to say so when ``path`` is its default (:func:`default_socket`).
    """
    size = len(os.fsencode(path))
    if size <= MAX_SOCKET_PATH:
        return path
    default = ""
    if name is not None and path == default_socket(name):
        room = MAX_SOCKET_PATH - len(os.fsencode(default_socket("")))
        default = (f" (the default socket path of service {name!r}: one of a name longer "
                   f"than {room} bytes is too long)")
    raise ValueError(f"the agent's socket path {path} is {size} bytes long{default}; a Unix "
                     f"domain socket's path may have at most {MAX_SOCKET_PATH} bytes: pass a "
                     f"shorter `msd-dask agent --socket` and name the same path in {AGENT_ENV}")


def agent_path(name: str, agent: str | bool | None = None) -> str | None:
    """The agent socket a process of service ``name`` reads through; ``None``: read directly.

    ``agent``: a socket path, ``True`` (:func:`default_socket` of ``name``), ``False``
    (directly, whatever the environment says) or ``None`` (the path in
    :data:`AGENT_ENV` if set and not empty, else directly).

    Raises
    ------
    ValueError
        The default path of ``name`` is too long for a Unix domain socket
        (:func:`check_socket_path`).
    """
    if agent is False:
        return None
    if agent is True:
        return check_socket_path(default_socket(name), name)
    if agent is None:
        return os.environ.get(AGENT_ENV) or None
    return str(agent)


def connect_agent(name: str, agent: str | bool | None = None, *,
                  timeout: float = 30.0) -> AgentHandle | None:
    """The handle of the agent a process of service ``name`` reads through
    (:func:`agent_path` of ``agent``), ``None`` if it reads directly.

    Raises
    ------
    ServiceError
        No agent answers at the socket, or it serves another service.
    ValueError
        The socket's path is too long for a Unix domain socket (:func:`check_socket_path`).
    """
    path = agent_path(name, agent)
    return None if path is None else AgentHandle.connect(path, name, timeout=timeout)


# ------------------------------------------------------------------ wire

#: a message's length, before its JSON
HEADER = struct.Struct("!I")


def frame(msg: Mapping[str, Any]) -> bytes:
    """``msg`` as the protocol sends it: its JSON's length (:data:`HEADER`), then the JSON."""
    data = json.dumps(msg).encode()
    return HEADER.pack(len(data)) + data


def send(sock: socket.socket, msg: Mapping[str, Any]) -> None:
    """Send one message on a blocking socket."""
    sock.sendall(frame(msg))


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """The next message on a blocking socket, ``None`` if the other end closed the connection."""
    head = _recv_exactly(sock, HEADER.size)
    if head is None:
        return None
    data = _recv_exactly(sock, HEADER.unpack(head)[0])
    return None if data is None else dict(json.loads(data))


@contextmanager
def _mapped(name: str, owner: int) -> Iterator[Any]:
    """The shared memory block ``name`` of the agent process ``owner``, mapped read-only.

    On Linux the block is the file ``/dev/shm/<name>``, mapped directly: attaching a
    :class:`SharedMemory` would register the block with this process's resource
    tracker (one more process per rank, started on first use), which would unlink
    it when this process exits, though the agent owns it.
    """
    path = os.path.join(SHM_DIR, name)
    if os.path.isdir(SHM_DIR):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with open(fd, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            yield m
        return
    from multiprocessing import resource_tracker
    from multiprocessing.shared_memory import SharedMemory

    shm = SharedMemory(name=name)
    try:
        if os.getpid() != owner:  # the agent unlinks it, not this process's tracker
            resource_tracker.unregister(f"/{shm.name}", "shared_memory")
        yield shm.buf
    finally:
        shm.close()


def read_block(msg: Mapping[str, Any], rank: int) -> Batch:
    """The :class:`Batch` of global ``rank`` from a block message of :func:`write_block`
    (the arrays are copied out; the block is left to the agent): the wire form rebuilt,
    made a batch as a direct :class:`~msd_dask.reader.Reader` makes it.  A block name that
    is not an agent's (``BLOCK_PREFIX…``, no folder) is refused: the rank opens no other
    file the message names."""
    name = str(msg["block"])
    if not name.startswith(BLOCK_PREFIX) or "/" in name or "\0" in name:
        raise ValueError(f"field 'block' is {name!r}, not the name of an agent's block")
    with _mapped(name, int(msg["pid"])) as buf:
        arrays = {key: np.ndarray(shape, np.dtype(dtype), buffer=buf, offset=offset).copy()
                  for key, (offset, dtype, shape) in msg["layout"].items()}
    return Batch.from_payload(from_wire({**msg["meta"], **arrays}), rank)


# ------------------------------------------------------------- rank side


def _dial(path: str, timeout: float, what: str) -> socket.socket:
    """A connection to the agent at ``path``, or a :class:`ServiceError` saying it is not there
    (a ``ValueError`` if no Unix domain socket can have that path)."""
    check_socket_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
    except PermissionError as e:
        sock.close()
        # (said as "is the agent running?": it was, as another user; a review)
        raise ServiceError(f"{what}: {_refused_by_mode(path, e)}") from None
    except OSError as e:
        sock.close()
        raise ServiceError(
            f"{what}: no msd-dask agent answers at {path} ({type(e).__name__}: {e}); is "
            f"`msd-dask agent` running on this host? ({AGENT_ENV} names its socket; unset it "
            "to read without the agent)") from None
    creds = peer_creds(sock)
    uid = None if creds is None else creds[1]
    if uid is not None and uid not in trusted_uids():
        sock.close()
        raise ServiceError(
            f"{what}: the process that answers at {path} runs as uid {uid}, neither this "
            f"process's ({os.getuid()}) nor root's: another user's socket, not this job's "
            f"agent, is refused (its batches would be trained on).  Start the agent on a path "
            f"of your own (--socket, and {AGENT_ENV} for the ranks), or, where the agent runs "
            f"as another user on purpose, set {AGENT_UID_ENV}={uid}")
    return sock


#: the uid of an agent a rank accepts besides its own and root's (a sidecar container's)
AGENT_UID_ENV = "MSD_DASK_AGENT_UID"

#: where an agent's blocks are (Linux), named where a rank may not open one
SHM_BLOCKS = "/dev/shm"


def _refused_by_mode(path: str, e: OSError) -> str:
    """What to say where this process may not use the agent's socket or blocks (``e``)."""
    try:
        st = os.stat(e.filename or path)
        whose = f"owned by uid {st.st_uid}, group {st.st_gid}, mode {st.st_mode & 0o777:o}"
    except OSError:
        whose = "not this process's to use"
    return (f"permission denied on {e.filename or path} ({whose}) to uid {os.getuid()}: an "
            "agent shares its socket and blocks with its own user only, or with the group "
            "`msd-dask agent --group` names (this process in it)")

#: ``struct ucred`` of ``SO_PEERCRED`` (Linux): the peer's pid, uid and gid
_PEER_CREDS = struct.Struct("iII")


def peer_creds(sock: socket.socket) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket
    (``SO_PEERCRED``, Linux); ``None`` where that is unknown (another system).  The agent
    reads the pid of each rank's process, a rank the uid of the agent's."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        pid, uid, gid = _PEER_CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, option,
                                                          _PEER_CREDS.size))
    except (OSError, struct.error):
        return None
    return int(pid), int(uid), int(gid)


def trusted_uids() -> set[int]:
    """The uids whose agent a rank reads from: its own, root's and ``$MSD_DASK_AGENT_UID``'s.
    Anyone may create a path in a shared ``/tmp``: without this check another user's
    socket there, bound before the job's agent, fed the job's ranks its own batches and
    states (a review)."""
    uids = {os.getuid(), 0}
    raw = os.environ.get(AGENT_UID_ENV, "").strip()
    if raw:
        try:
            uids.add(int(raw))
        except ValueError:
            raise ValueError(f"{AGENT_UID_ENV}={raw!r}: expected a uid (a whole number)") from None
    return uids


def _ask(sock: socket.socket, path: str, msg: Mapping[str, Any], what: str) -> dict[str, Any]:
    """The agent's answer to ``msg`` (an error it answers is in it)."""
    try:
        send(sock, msg)
        answer = recv(sock)
    except TimeoutError:
        raise ServiceTimeoutError(f"{what}: the agent at {path} did not answer within "
                                  f"{sock.gettimeout():.0f}s") from None
    if answer is None:
        raise ServiceError(f"{what}: the agent at {path} closed the connection")
    return answer


def _hello(sock: socket.socket, path: str, msg: Mapping[str, Any], what: str) -> dict[str, Any]:
    answer = _ask(sock, path, msg, what)
    if "error" in answer:
        raise ServiceError(f"{what}: {answer['error']}")
    return answer


class AgentReader:
    """Iterator over one global rank's batches, read from the host's agent.

    Made by :meth:`AgentHandle.reader`; the API of :class:`~msd_dask.reader.Reader`:
    ``next()`` returns the rank's next :class:`~msd_dask.batch.Batch` (every step once,
    in order), :meth:`state_dict` / :meth:`load_state_dict`, :meth:`report_step_time`
    and :meth:`close`.  No Dask client: one Unix socket to the agent, the tensors
    copied out of the agent's shared memory.
    """

    #: the handle's record of the last steps returned, kept up to date (see ``__init__``)
    _ledger: dict[int, int] | None = None

    def __init__(self, path: str, name: str, rank: int, *, timeout: float,
                 ledger: dict[int, int] | None = None):
        self.path = path
        self.name = name
        self.rank = rank_number(rank)
        self.timeout = wait_seconds(timeout, self.rank)
        #: rank -> the last step returned or loaded, kept up to date for the handle (its
        #: next reader of the rank starts after it, as a direct handle's does)
        self._ledger = ledger
        self.step: int | None = None
        #: the step of the last state loaded (:meth:`load_state_dict`)
        self._loaded: int | None = None
        self._closed = False
        #: guards :attr:`_closed`, :attr:`_sock` and :attr:`_busy` against :meth:`close`
        #: from another thread, and the ack of a step with its return (a step acked is the
        #: rank's: the agent serves it no more, so it is returned, or the reader not closed)
        self._lock = threading.RLock()  # (a signal handler that closes it in the thread
        # that holds it would wait on itself)
        #: a :meth:`__next__` is under way (a :meth:`close` then sends no ``bye``: the
        #: agent reads that connection's next message only once it answered the request)
        self._busy = False
        #: the connection to the agent; ``None`` after a request it may still answer
        #: (:meth:`__next__` timed out or lost it): the next request dials again
        self._sock: socket.socket | None = None
        self._sock = self._connect()

    def _connect(self) -> socket.socket:
        sock = _dial(self.path, self.timeout, f"rank {self.rank}")
        try:
            _hello(sock, self.path, {"op": "hello", "rank": self.rank, "service": self.name},
                   f"rank {self.rank}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _drop(self) -> None:
        """Close a connection whose last request the agent may still answer: that answer,
        read by a later request, would be taken for the later one's (a step twice)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def state_dict(self) -> dict[str, Any]:
        """``{"service", "rank", "step"}``: the service's name, the rank, and the later of the
        last step returned and of the state loaded, ``None`` if neither (as a direct
        reader's: a state saved behind the agent loads into a direct reader, and back)."""
        steps = [s for s in (self.step, self._loaded) if s is not None]
        return reader_state(self.rank, max(steps) if steps else None, self.name)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on after the step of ``state``, as :meth:`msd_dask.Reader.load_state_dict`: any
        state of the rank (of its service) before the first batch, once one was returned a
        state of the step it is at or a later one (skipping the steps up to it), else a
        :class:`~msd_dask.errors.ServiceError` naming both steps; a state of another service
        or rank is a ``ValueError`` (:func:`~msd_dask.batch.loaded_step`)."""
        step = loaded_step(state, self.rank, self.name)
        if self.step is not None:
            no_going_back(step, self.state_dict()["step"], self.rank, self.name)
        self._loaded = step
        self._keep_ledger()

    def _keep_ledger(self) -> None:
        # (-1: no step, as a Reader's; a state of no step loaded before the first batch
        # clears what an earlier reader of the rank had)
        last = self.state_dict()["step"]
        if self._ledger is not None:
            self._ledger[self.rank] = -1 if last is None else int(last)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __enter__(self) -> AgentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        """:meth:`close`, as a direct :class:`~msd_dask.reader.Reader`'s."""
        self.close()

    def _raise_if_closed(self) -> None:
        """The error a closed direct :class:`~msd_dask.reader.Reader` raises, if closed."""
        if self._closed:
            raise ServiceError(f"rank {self.rank}: the reader is closed")

    def __next__(self) -> Batch:
        with self._lock:
            self._raise_if_closed()
            sock = self._sock
        if sock is None:
            sock = self._connect()
        with self._lock:
            if self._closed:  # (by another thread while this one dialled)
                sock.close()
                self._raise_if_closed()
            self._sock, self._busy = sock, True
        try:
            return self._next_from(sock)
        finally:
            with self._lock:
                self._busy = False

    def _next_from(self, sock: socket.socket) -> Batch:
        """:meth:`__next__` on the connection ``sock``.

        A :meth:`close` from another thread (a prefetching thread's reader, closed with
        its dataset) shuts ``sock`` down, which ends the wait for the agent's answer at
        once, and this raises what a closed direct reader raises: it waited for the whole
        answer, and then named a lost agent (a review).  A step answered meanwhile is not
        acknowledged: the agent keeps it for the rank's next reader.
        """
        after = max(-1 if self.step is None else self.step,
                    -1 if self._loaded is None else self._loaded)
        waiting = f"step {after + 1}"
        try:
            send(sock, {"op": "next", "after": after, "timeout": self.timeout})
            sock.settimeout(self.timeout + ANSWER_MARGIN)
            answer = recv(sock)
        except TimeoutError:
            self._drop()
            raise ServiceTimeoutError(
                f"rank {self.rank} waited {self.timeout + ANSWER_MARGIN:.0f}s for {waiting} "
                f"from the agent at {self.path} and got no answer; is `msd-dask agent` "
                "running?") from None
        except OSError as e:
            self._drop()
            self._raise_if_closed()  # (the socket that close() shut and closed)
            raise ServiceError(f"rank {self.rank} lost the agent at {self.path} while asking "
                               f"for {waiting} ({type(e).__name__}: {e}); did `msd-dask agent` "
                               "exit?") from None
        if answer is None:
            self._drop()
            self._raise_if_closed()  # (the end of the connection close() shut down)
            raise ServiceError(f"rank {self.rank}: the agent at {self.path} closed the "
                               f"connection while rank {self.rank} waited for {waiting}; did "
                               "`msd-dask agent` exit?")
        self._raise_if_closed()
        if "error" in answer:
            err = ServiceTimeoutError if answer.get("kind") == "timeout" else ServiceError
            raise err(f"service {self.name!r}: {answer['error']}")
        try:
            batch = read_block(answer, self.rank)
        except PermissionError as e:
            self._drop()
            raise ServiceError(f"rank {self.rank} could not copy step {answer.get('step')}: "
                               f"{_refused_by_mode(SHM_BLOCKS, e)}") from None
        except OSError as e:  # (its block gone: the agent stopped, or was killed)
            self._drop()
            self._raise_if_closed()
            raise ServiceError(f"rank {self.rank} could not copy step {answer.get('step')} "
                               f"from the agent at {self.path} ({type(e).__name__}: {e}); did "
                               "`msd-dask agent` exit?") from None
        with self._lock:  # (closed while the block was copied: not acknowledged, not returned)
            self._raise_if_closed()
            try:
                send(sock, {"op": "ack", "step": batch.step})
            except OSError:
                self._drop()  # the agent learns the step from the next request's ``after``
            # (the agent refuses a request from before the steps this rank took, before it
            # hands anything out)
            self.step = batch.step
            self._keep_ledger()
        return batch

    def report_step_time(self, seconds: float, step: int | None = None) -> None:
        """Report how long this rank computed on a step (default: the last one returned);
        the agent forwards it to the planner.  Fire and forget."""
        seconds = step_time(seconds, self.rank)
        step = self.step if step is None else step
        if step is None:
            raise ValueError("report_step_time: no step was read yet")
        if self._sock is not None:
            try:
                send(self._sock, {"op": "step_time", "step": int(step), "seconds": float(seconds)})
            except OSError:
                pass

    def close(self) -> None:
        """Close the connection to the agent (idempotent; from any thread).

        A :meth:`__next__` waiting in another thread ends at once with the error of a
        closed reader, and the step it waited for is left to the rank's next reader: the
        socket is shut down, which wakes the thread's wait (closing it alone did not: the
        thread waited for the agent's answer, up to the reader's ``timeout``).
        """
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
            busy = self._busy
        if sock is None:
            return
        if not busy:  # (a request under way: the agent reads no message before it answers)
            try:
                send(sock, {"op": "bye"})
            except OSError:
                pass
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            pass
        sock.close()

    def __del__(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close()


#: what a :class:`~msd_dask.service.DataService` handle has and an :class:`AgentHandle`
#: has not: operations on the service, for its owner or a process connected directly
DIRECT_ONLY = frozenset({"address", "client", "planner", "generation", "constructors", "refresh",
                         "set_weights", "scale_loaders", "retire_workers", "stats",
                         "consumed_step", "dashboard_link", "start", "stop"})


class AgentHandle:
    """A training process's handle on a service read through the host's agent.

    What ``DataService.connect`` returns when :data:`AGENT_ENV` is set (or with
    ``agent=``): :meth:`reader` gives :class:`AgentReader`\\ s; the process holds no
    Dask client.  :meth:`state_dict` is the agent's answer (the data-plane state a
    checkpoint saves from rank 0).  The other operations on the service (stats,
    weights, scaling) are the service owner's or a directly connected process's:
    asking this handle for one (:data:`DIRECT_ONLY`) raises an ``AttributeError`` that
    says so.
    """

    def __init__(self, path: str, name: str, info: Mapping[str, Any]):
        self.path = path
        self.name = name
        #: the global ranks the agent serves
        self.ranks: list[int] = [int(r) for r in info["ranks"]]
        #: the service's ``timeout``: a reader's default
        self.timeout = float(info["timeout"])
        #: the ranks the service is laid out for, and its mesh (``None``: an agent of a
        #: version that does not say them)
        self.world_size: int | None = info.get("world_size")
        self._layout = str(info.get("layout", ""))
        # (weak, as DataService's: a reader dropped without close() lets its socket, and
        # the agent its connection, go)
        self._readers: weakref.WeakSet[AgentReader] = weakref.WeakSet()
        #: rank -> the last step its readers from this handle returned (or loaded)
        self._returned: dict[int, int] = {}

    @classmethod
    def connect(cls, path: str, name: str, *, timeout: float = 30.0) -> AgentHandle:
        """Ask the agent at ``path`` whether it serves service ``name`` (fails at once if no
        agent answers there)."""
        what = f"service {name!r}"
        sock = _dial(path, timeout, what)
        try:
            info = _hello(sock, path, {"op": "hello", "service": name}, what)
        finally:
            sock.close()
        return cls(path, name, info)

    def reader(self, rank: int, *, timeout: float | None = None) -> AgentReader:
        """An iterator over the batches of global ``rank`` (one of the agent's ranks).

        Raises
        ------
        ValueError
            ``rank`` is outside the service's mesh, or this process's ``WORLD_SIZE`` is not
            the service's ranks (as a direct reader refuses them:
            :func:`~msd_dask.batch.check_rank`, :func:`~msd_dask.batch.check_world_size`).
        """
        if self.world_size is not None:  # (behind an agent, the job was never checked)
            world = int(self.world_size)
            check_world_size(rank_number(rank), self.name, world, self._layout)
            check_rank(rank_number(rank), self.name, world, self._layout)
        reader = AgentReader(self.path, self.name, rank, ledger=self._returned,
                             timeout=self.timeout if timeout is None else timeout)
        last = self._returned.get(rank, -1)
        if last >= 0:  # (as DataService.reader: after its earlier reader's step)
            reader.load_state_dict(reader_state(rank, last, self.name))
        self._readers.add(reader)
        return reader

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """:meth:`DataService.state_dict <msd_dask.service.handle.DataService.state_dict>`,
        taken by the agent (its Dask client): the same state, the same refusals
        (``ValueError`` for a step the service cannot describe)."""
        what = f"the state of service {self.name!r}"
        # (refused here as the direct handle refuses it: the agent took int(step), 5.7 for
        # step 5, and a numpy integer failed JSON's encoding; a review)
        if step is not None:
            step = step_number(step, "state_dict")
        # (the agent asks the constructors what the ranks returned, then the planner: each
        # within the service's timeout)
        sock = _dial(self.path, 3 * self.timeout + 30, what)
        try:
            answer = _ask(sock, self.path, {"op": "hello", "service": self.name,
                                            "state_dict": step}, what)
        finally:
            sock.close()
        if "error" in answer:
            error = {"value": ValueError, "timeout": ServiceTimeoutError}.get(
                answer.get("kind", ""), ServiceError)
            raise error(f"{what}, asked of the agent at {self.path}: {answer['error']}")
        return dict(answer["state"])

    def close(self) -> None:
        """Close this handle's readers (the agent and the service keep running)."""
        for reader in list(self._readers):
            reader.close()
        self._readers.clear()

    def __enter__(self) -> AgentHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, attr: str) -> Any:
        # (called only for names the handle lacks)
        if attr in DIRECT_ONLY:
            raise AttributeError(
                f"DataService.{attr} is not available through the host agent ({self.path}): "
                f"this process reads service {self.name!r} with no Dask client. Call it in "
                "the process that started the service, or in one connected directly: "
                "DataService.connect(address, name, agent=False)")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {attr!r}")
