"""A step's packed work, as the planner's actor keeps it for re-created constructors.

The planner keeps each step's work (every constructor's, packed) until every rank has
received the step, so that a constructor re-created after its worker was lost gets the
steps again (:meth:`~msd_dask.roles.planner.PlannerActor.unclaimed_steps`).  That copy is
read on such a recovery, and once to hand the step's round to the constructors: a work
in a file leaves memory as soon as it is planned, not after its round.  At dp 16,384 ×
128K a step's work takes up to 45 MiB packed, and the planner keeps ``prefetch`` of them
and more: a sixth of the planner's 1 GiB.  A step's work of :data:`SPILL_FROM` bytes or
more is therefore kept in a file of the planner's worker's local directory (where Dask
spills its own data), not in memory; a smaller one (dp 16,384 × 4K: about 4 MiB a step)
stays in memory.
"""

from __future__ import annotations

import logging
import os
import tempfile
import weakref
from collections.abc import Sequence
from itertools import accumulate

__all__ = ["SPILL_FROM", "KeptWork", "local_directory"]

_log = logging.getLogger(__name__)

#: the fewest bytes of a step's packed work kept in a file rather than in memory
SPILL_FROM = 1 << 23


class KeptWork:
    """Each constructor's packed work of one step, kept in memory or in a file.

    Parameters
    ----------
    step : int
        The step (named by errors and by the file).
    parts : sequence of bytes
        Each constructor's packed work, in order.
    directory : str or None
        Where a large work goes (the worker's local directory); ``None`` keeps every work
        in memory.
    spill_from : int, optional
        The fewest bytes, all parts together, written to a file (default
        :data:`SPILL_FROM`).

    Notes
    -----
    A work that cannot be written (the directory gone, the disk full) is kept in memory,
    with a warning (once per directory until a work is written there again).  The file
    goes with the object (garbage collected or :meth:`close`\\ d).
    """

    def __init__(self, step: int, parts: Sequence[bytes], directory: str | None,
                 spill_from: int | None = None) -> None:
        self.step = step
        self._parts: list[bytes] | None = list(parts)
        self._bounds = [0, *accumulate(map(len, parts))]
        #: the file holding the parts, one after the other (None: kept in memory)
        self.path: str | None = None
        if directory is None or self._bounds[-1] < (SPILL_FROM if spill_from is None
                                                     else spill_from):
            return
        try:
            fd, path = tempfile.mkstemp(prefix=f"msd-kept-step-{step}-", dir=directory)
        except OSError as e:
            _failed(directory, f"step {step}'s work ({self._bounds[-1]} bytes) kept in memory: "
                               f"no file in {directory}: {e}")
            return
        self._finalizer = weakref.finalize(self, _remove, path)
        try:
            with open(fd, "wb") as f:
                f.writelines(self._parts)
        except OSError as e:
            self._finalizer()
            _failed(directory, f"step {step}'s work ({self._bounds[-1]} bytes) kept in memory: "
                               f"writing {path} failed: {e}")
            return
        _failing.discard(directory)
        self.path, self._parts = path, None

    def __len__(self) -> int:
        return len(self._bounds) - 1

    @property
    def nbytes(self) -> int:
        """The bytes of every part together."""
        return self._bounds[-1]

    @property
    def in_memory(self) -> int:
        """The bytes this object holds in memory (0 where the work is in a file)."""
        return 0 if self._parts is None else self._bounds[-1]

    def part(self, i: int) -> bytes:
        """Constructor ``i``'s packed work (read back from the file where it is in one).

        Raises
        ------
        OSError
            The file can no longer be read; the message names it and the step.
        """
        if self._parts is not None:
            return self._parts[i]
        start, end = self._bounds[i], self._bounds[i + 1]
        assert self.path is not None
        try:
            with open(self.path, "rb") as f:
                data = os.pread(f.fileno(), end - start, start)
        except OSError as e:
            raise OSError(f"step {self.step}'s work, kept in {self.path}, cannot be read "
                          f"back for constructor {i}: {e}") from e
        if len(data) != end - start:
            raise OSError(f"step {self.step}'s work, kept in {self.path}, was cut short: "
                          f"constructor {i}'s part ends at byte {end}, the file at "
                          f"{start + len(data)}")
        return data

    def parts(self) -> list[bytes]:
        """Every constructor's packed work, in order (read back where it is in a file)."""
        return [self.part(i) for i in range(len(self))]

    def close(self) -> None:
        """Remove the file now (where there is one); idempotent."""
        if self.path is not None:
            self._finalizer()


#: the directories where writing a work failed, not warned of again until one is written
_failing: set[str] = set()


def _failed(directory: str, message: str) -> None:
    if directory not in _failing:
        _failing.add(directory)
        _log.warning("msd_dask: %s (said once until a step's work is written there again)",
                     message)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def local_directory() -> str | None:
    """This Dask worker's local directory, where large kept works go (``None`` outside a
    worker: a test, or the simulator)."""
    try:
        from distributed import get_worker

        return str(get_worker().local_directory)
    except (ValueError, ImportError):
        return None
