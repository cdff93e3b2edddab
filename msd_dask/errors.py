"""Exceptions raised by msd_dask.

Narrow subclasses of built-in exceptions, so callers can catch what they
expect (``ValueError`` for bad configuration, ``TimeoutError`` for a wait that
ran out) without importing this module.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_TIMEOUT", "ConfigError", "DataError", "SHOWN", "ServiceError", "ServiceTimeoutError",
           "WorkerLeft", "first_of", "storage_blip", "storage_failure", "unanswered"]


class ConfigError(ValueError):
    """A configuration value is invalid.

    Parameters
    ----------
    key : str
        Dotted path of the offending YAML key, e.g. ``sources[1].weight``.
    reason : str
        Why the value was refused.
    """

    def __init__(self, key: str, reason: str):
        self.key = key
        self.reason = reason
        super().__init__(f"config key '{key}': {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # raised in a worker or a pool process, it arrives whole (the default
        # pickling calls __init__ with the message alone, which fails)
        return (type(self), (self.key, self.reason))


class DataError(ValueError):
    """A source file or document cannot be read.

    The message always names the source, the file and, where known, the row.
    """

    def __init__(self, message: str, *, source: str | None = None,
                 path: str | None = None, row: int | None = None):
        self.source = source
        self.path = path
        self.row = row
        where = []
        if source is not None:
            where.append(f"source '{source}'")
        if path is not None:
            where.append(f"file '{path}'")
        if row is not None:
            where.append(f"row {row}")
        prefix = ", ".join(where)
        self.message = message
        super().__init__(f"{prefix}: {message}" if prefix else message)

    def __reduce__(self) -> tuple[Any, ...]:
        # keeps source, path and row when raised in a worker or a pool process
        return (_data_error, (type(self), self.message, self.source, self.path, self.row))


def _data_error(cls: type[DataError], message: str, source: str | None, path: str | None,
                row: int | None) -> DataError:
    return cls(message, source=source, path=path, row=row)


class ServiceTimeoutError(TimeoutError):
    """A wait inside the service ran past its timeout; the message says what for."""


#: the longest timeout of any wait (a year, in seconds): the config's ``timeout``, a
#: reader's, the command line's.  A longer one raises OverflowError in Python's threading
#: and a socket's timeout (an agent's reader with 1e10 failed so, naming nothing; a review)
MAX_TIMEOUT = 365 * 24 * 3600.0


class ServiceError(RuntimeError):
    """The data service is not in a state to answer (closed, not found, failed)."""


class WorkerLeft(ServiceError):
    """The worker a role (or the planner) was placed on left the cluster before it started
    there (Dask would hold it for that worker for ever)."""

    def __init__(self, service: str, role: str, worker: str):
        self.service, self.role, self.worker = service, role, worker
        super().__init__(f"msd_dask {service}: worker {worker} left the cluster before "
                         f"{role} started there")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.service, self.role, self.worker))


#: how many names a message lists before saying how many more (:func:`first_of`), where
#: the list may be long (the files a folder left out, say)
SHOWN = 5


def first_of(items: Sequence[object], most: int) -> str:
    """``items`` for a message: the first ``most``, then how many more."""
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return ", ".join(map(str, items[:most])) + more


#: what readers of a service its owner closed are told (:class:`ServiceError`)
CLOSED_BY_OWNER = "closed by its owner"
#: what readers of a service stopped from elsewhere are told (:class:`ServiceError`)
STOPPED = "stopped with msd-dask stop (DataService.stop): its starting process was gone"
#: what readers are told where the service's planner and registry are gone with its owner:
#: closed by it, or stopped from elsewhere (it said the starting process "was gone" after a
#: clean close, and host agents did not take it for a close; a review)
CLOSED_OR_STOPPED = "closed by its owner (or stopped with msd-dask stop)"
#: the notices of a service closed for good: a reader told one tells its process's others
CLOSED_NOTICES = (CLOSED_BY_OWNER, STOPPED, CLOSED_OR_STOPPED)
#: what a refused new reader after a trial run (a smoke test's readers) does
TRIAL_HINT = ("after a trial run against the service, start the service again (or another "
              "'name') so that training reads from step 0")
RESTART_HINT = ("restart the service from the last DataService.state_dict() (msd-dask serve "
                 "CONFIG --resume STATE_JSON, or DataService.start(cfg, resume=state)); ranks "
                 "reload their Reader.state_dict() so no step is read twice")


def unanswered(e: BaseException, wait: float) -> str:
    """Why a role's ``stats()`` has no answer, for the ``error`` of what stands for it:
    ``e`` is what the wait of ``wait`` seconds for it raised."""
    why = (f"did not answer within {wait:.0f}s" if isinstance(e, TimeoutError)
           else f"did not answer ({type(e).__name__}: {e})")
    return f"{why}; its worker may be lost, and the planner re-creates a lost role"


#: ``OSError`` numbers object stores give a failure of the store, not of the file: a 503
#: (``SlowDown``, ``ServiceUnavailable``: s3fs's ``EBUSY``) and a 500 (``InternalError``:
#: its ``EREMOTEIO``), after their own retries
_BUSY = frozenset(n for n in (errno.EBUSY, getattr(errno, "EREMOTEIO", None), errno.ETIMEDOUT)
                  if n is not None)


@functools.cache
def _client_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """The connection and timeout errors of the HTTP clients object stores read through,
    those installed (s3fs's botocore and aiohttp; gcsfs's and adlfs' aiohttp), and those
    among them that no new try mends (a certificate, a URL)."""
    found: list[type[BaseException]] = []
    never: list[type[BaseException]] = []
    try:
        import botocore.exceptions as boto

        found += [boto.HTTPClientError, boto.ConnectionError, boto.IncompleteReadError]
        never.append(boto.SSLError)
    except ImportError:
        pass
    try:
        import aiohttp

        found.append(aiohttp.ClientError)
        never += [aiohttp.ClientSSLError, aiohttp.InvalidURL]
    except ImportError:
        pass
    return tuple(found), tuple(never)


def storage_blip(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from (``raise ... from``), says the
    storage failed for a moment (a dropped connection, a read that timed out, a busy or
    failing store), not that the file is bad: such a read may be tried again.

    Object stores raise their HTTP clients' errors once their own retries give up
    (botocore's ``EndpointConnectionError``, ``ResponseStreamingError``, aiohttp's
    ``ClientPayloadError``), none of them the built-in ``ConnectionError``: a dropped
    connection on S3 was never tried again, and under ``on_error: skip`` one stopped the
    service (a review).  Not a blip: a file missing or refused (an HTTP 404 or 403, which
    fsspec raises from its client's error), bad input (:class:`DataError`), an HTTP answer
    below 500 but 429, a certificate or a URL; nor an error raised while handling a blip
    (a bug in a handler is no blip: only explicit causes are followed)."""
    blips, never = _client_errors()
    if isinstance(exc, FileNotFoundError | PermissionError | DataError):
        return False
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen and len(seen) < 16:
        seen.add(id(at))
        status = getattr(at, "status", None)  # (aiohttp's ClientResponseError)
        if isinstance(at, never) or (isinstance(status, int) and status < 500
                                     and status != 429):
            return False
        if isinstance(at, (ConnectionError, TimeoutError, *blips)):
            return True
        if isinstance(at, OSError) and at.errno in _BUSY:
            return True
        at = at.__cause__
    return False


def storage_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the storage failed to give a file, not that its content is bad:
    a file missing or not readable, or a :func:`storage_blip`.  A format lets these
    propagate as they are (its callers try a blip again, and name the file), where it
    reports any other error of a read as the file's (corrupt, truncated)."""
    return isinstance(exc, FileNotFoundError | PermissionError) or storage_blip(exc)
