"""A ``torch.utils.data.IterableDataset`` over one rank's batches of a running service.

The service already builds whole batches (``[micro_batches, seq_len]`` per rank
and step), so the adapter is meant for ``DataLoader(ds, batch_size=None,
num_workers=0)``: no collation, no loader worker processes (the work is done
by the service's roles on the Dask cluster, not in the training process).

Example
-------
>>> from torch.utils.data import DataLoader
>>> from msd_dask.torch import MsdIterableDataset
>>> ds = MsdIterableDataset("tcp://head:8786", "demo", rank)        # doctest: +SKIP
>>> for batch in DataLoader(ds, batch_size=None, num_workers=0):   # doctest: +SKIP
...     loss = model(batch["input_ids"], position_ids=batch["position_ids"],
...                  cu_seqlens=batch["cu_seqlens"], labels=batch["labels"])
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch.utils.data

from .batch import Batch

__all__ = ["MsdIterableDataset", "batch_to_dict"]


def batch_to_dict(batch: Batch) -> dict[str, Any]:
    """The fields of a :class:`~msd_dask.Batch` as a dict.

    Parameters
    ----------
    batch : Batch

    Returns
    -------
    dict
        ``input_ids``, ``labels``, ``position_ids`` (``torch.long``,
        ``[micro_batches, seq_len]``), ``cu_seqlens`` (list of int32 tensors, one
        per micro-batch), ``documents``, ``epochs``, ``step``, ``rank``, ``cost``
        and ``num_tokens`` (tokens that are not padding).
    """
    return {
        "input_ids": batch.input_ids,
        "labels": batch.labels,
        "position_ids": batch.position_ids,
        "cu_seqlens": batch.cu_seqlens,
        "documents": batch.documents,
        "epochs": batch.epochs,
        "step": batch.step,
        "rank": batch.rank,
        "cost": batch.cost,
        "num_tokens": batch.num_tokens,
    }


class MsdIterableDataset(torch.utils.data.IterableDataset):
    """One global rank's batches of the service ``name``, as a torch ``IterableDataset``.

    The connection is opened lazily on the first ``iter()`` (so the dataset can
    be built before the service is up and pickled into spawned processes) and
    kept for later iterations: a second ``iter()`` continues with the next step
    rather than starting over, like the service itself.

    Parameters
    ----------
    address : str
        The Dask scheduler the service runs on (``tcp://host:port``).
    name : str
        The service's ``name``.
    rank : int
        The global rank whose batches to yield.
    steps : int, optional
        Stop after this many batches per ``iter()`` (default: never stop).
    timeout : float, optional
        Seconds a reader waits for a batch (default: the service config's).
    connect_timeout : float
        Seconds to wait for the service to appear on the scheduler.

    Notes
    -----
    Use ``DataLoader(ds, batch_size=None, num_workers=0)``.  With
    ``num_workers > 0`` every loader worker would be a second reader of the
    same rank, so iterating in a loader worker raises ``RuntimeError``.

    :meth:`state_dict` / :meth:`load_state_dict` carry the reader's position,
    so a restarted rank skips the steps it has already trained on.
    """

    def __init__(self, address: str, name: str, rank: int, *, steps: int | None = None,
                 timeout: float | None = None, connect_timeout: float = 30.0):
        super().__init__()
        self.address = address
        self.name = name
        self.rank = int(rank)
        self.steps = steps
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._service: Any = None
        self._reader: Any = None
        self._pending_state: Mapping[str, Any] | None = None

    def _connect(self) -> Any:
        if self._reader is None:
            from .service import DataService

            self._service = DataService.connect(self.address, self.name,
                                                timeout=self.connect_timeout)
            self._reader = self._service.reader(self.rank, timeout=self.timeout)
            if self._pending_state is not None:
                self._reader.load_state_dict(self._pending_state)
                self._pending_state = None
        return self._reader

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if torch.utils.data.get_worker_info() is not None:
            raise RuntimeError("MsdIterableDataset must be read with DataLoader(num_workers=0): "
                               "each loader worker would be another reader of rank "
                               f"{self.rank}")
        reader = self._connect()
        n = 0
        while self.steps is None or n < self.steps:
            yield batch_to_dict(next(reader))
            n += 1

    def state_dict(self) -> dict[str, Any]:
        """``{"rank", "step"}``: the last step handed out (``None`` before the first)."""
        if self._reader is None:
            return dict(self._pending_state or {"rank": self.rank, "step": None})
        return dict(self._reader.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Skip every step up to ``state["step"]`` (see :meth:`msd_dask.Reader.load_state_dict`)."""
        if self._reader is None:
            if state.get("rank", self.rank) != self.rank:
                raise ValueError(f"reader state of rank {state['rank']} loaded into rank {self.rank}")
            self._pending_state = dict(state)
        else:
            self._reader.load_state_dict(state)

    def close(self) -> None:
        """Disconnect from the service (the service keeps running)."""
        if self._service is not None:
            self._service.close()
        self._service = None
        self._reader = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_service"] = None
        state["_reader"] = None
        return state
