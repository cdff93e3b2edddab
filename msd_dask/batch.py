"""The batch a training rank receives.

``torch`` is imported when a batch is built (:meth:`Batch.from_payload`), not
when this module is: the scheduler, the Dask workers hosting the roles and the
process that starts the service import :mod:`msd_dask` without needing torch,
and importing it costs each of them about 100 MiB.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from msd_dask.errors import MAX_TIMEOUT

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_PREFETCH", "Batch", "check_rank", "check_world_size", "is_seconds", "is_whole", "loaded_step",
           "no_going_back", "rank_number", "reader_state", "wait_seconds"]


@dataclass
class Batch:
    """One rank's data for one step.

    Attributes
    ----------
    step : int
        The global step.
    rank : int
        The global rank it was built for.
    input_ids, labels, position_ids : torch.Tensor or None
        ``torch.long``, shape ``[micro_batches, seq_len]``.  Labels are the next
        token inside the same document, ``-100`` at a document's last token and
        on padding: shifted already (a Hugging Face model's ``labels=`` shifts
        again; take the loss against its logits); position ids restart at 0 for
        every piece.  With context
        parallelism ``cp > 1`` a rank holds ``[micro_batches, seq_len / cp]``:
        the positions ``cp_index`` of each row.  With pipeline parallelism only
        the first stage gets ``input_ids``/``position_ids`` and only the last
        ``labels``; the others get ``None``.
    cu_seqlens : list of torch.Tensor or None
        One int32 tensor per micro-batch: piece boundaries from 0 to the used
        length, of the whole row, on every pipeline stage (each runs attention
        layers); with ``cp > 1`` in whole-row positions (``cp_index`` maps the
        rank's columns to them).  The padding
        after the used length belongs to no piece: a varlen attention kernel takes
        the row's first ``cu_seqlens[m][-1]`` tokens.
    documents : list of list of tuple
        For every micro-batch, ``(source, key, chunk)`` of each cu_seqlens
        segment; ``key`` is ``"<path relative to the source root>:<row>"``.
    cost : float
        The rank's cost under the configured cost model.
    epochs : list of list of int
        The source epoch of each document in ``documents``.
    cp_index : torch.Tensor or None
        With ``cp > 1``: the row positions this rank's token tensors hold.
    pixel_values : torch.Tensor or None
        Image+text documents: ``torch.uint8 [patches, patch·patch·3]``, the image
        patches of every micro-batch in order (each patch flattened ``(y, x, rgb)``,
        see :mod:`msd_dask.sources.vision`; normalising is the model's business).  Patch
        ``i`` stands for the ``i``-th image token of the whole rows read row by row
        (with ``cp > 1`` a rank's ``input_ids`` hold only its columns, ``cp_index``:
        ``image_spans`` with ``cu_seqlens`` place each image in the whole row).
        ``None`` when the batch holds no image, and on pipeline stages but the first.
    image_spans : list of list or None
        For every micro-batch, aligned with ``documents`` (the cu_seqlens
        segments): ``(first patch in pixel_values, patches)`` of a segment with an
        image, whose image tokens are the segment's first ``patches`` tokens, or
        ``None`` for a text segment.  ``None`` when the batch holds no image; kept
        on every pipeline stage (where the image tokens are), though only the first
        has ``pixel_values``.
    """

    step: int
    rank: int
    input_ids: torch.Tensor | None
    labels: torch.Tensor | None
    position_ids: torch.Tensor | None
    cu_seqlens: list[torch.Tensor] | None
    documents: list[list[tuple[str, str, int]]]
    cost: float
    epochs: list[list[int]]
    cp_index: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None
    image_spans: list[list[tuple[int, int] | None]] | None = None

    @classmethod
    def from_payload(cls, payload: dict[str, Any], rank: int) -> Batch:
        """Build from what a constructor's ``claim`` returns."""
        import torch

        return cls(
            step=int(payload["step"]),
            rank=rank,
            input_ids=_tensor(payload["input_ids"]),
            labels=_tensor(payload["labels"]),
            position_ids=_tensor(payload["position_ids"]),
            # (copies: the wire form's are views of its one int32 array, which a view kept
            # alive for as long as the batch, three rows' worth of ints a micro-batch)
            cu_seqlens=None if payload["cu_seqlens"] is None else
            [torch.from_numpy(np.array(c, dtype=np.int32)) for c in payload["cu_seqlens"]],
            documents=[[(str(s), str(k), int(c)) for s, k, c in row] for row in payload["documents"]],
            cost=float(payload["cost"]),
            epochs=[[int(e) for e in row] for row in payload["epochs"]],
            cp_index=_tensor(payload.get("cp_index")),
            pixel_values=None if payload.get("pixel_values") is None else
            torch.from_numpy(np.ascontiguousarray(payload["pixel_values"], dtype=np.uint8)),
            image_spans=None if payload.get("image_spans") is None else
            [[None if s is None else (int(s[0]), int(s[1])) for s in row]
             for row in payload["image_spans"]],
        )

    @property
    def num_tokens(self) -> int:
        """Tokens of the DP group's batch that are not padding."""
        if self.cu_seqlens is None:
            return 0
        return int(sum(int(c[-1]) for c in self.cu_seqlens))


def _tensor(a: Any) -> torch.Tensor | None:
    import torch

    return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).long()


def reader_state(rank: int, step: int | None, service: str) -> dict[str, Any]:
    """A reader's saved state, as every reader's ``state_dict()`` returns it:
    ``{"service", "rank", "step"}``, the service's name, the rank and the last step it
    returned (``None``: none).  :func:`loaded_step` reads it back."""
    return {"service": service, "rank": int(rank), "step": None if step is None else int(step)}


def loaded_step(state: Any, rank: int, service: str) -> int | None:
    """The step of a reader's saved ``state`` (:func:`reader_state`, its ``state_dict()``)
    that rank ``rank`` of service ``service`` loads: the last step it returned, ``None`` if
    none.

    A state names its service: the steps of another service are other batches, and a
    reader that took one's step would skip as many steps of its own without a word.  A
    state without ``"service"`` (saved by a version that did not record it) is not
    checked for it.

    Raises
    ------
    ValueError
        ``state`` is not such a mapping (an unknown key, a step that is not a whole number
        >= 0 or None, a service name with no rank), or is another service's or another
        rank's.
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"a reader state is a mapping {{'service', 'rank', 'step'}}, got "
                         f"{type(state).__name__}")
    unknown = sorted(map(str, set(state) - {"service", "rank", "step"}))
    if unknown:
        raise ValueError(f"reader state: unknown key(s) {unknown} (a reader state has "
                         "'service', 'rank' and 'step')")
    if "service" in state:
        if state["service"] != service:
            raise ValueError(
                f"reader state of service {state['service']!r} loaded into a reader of "
                f"service {service!r} (rank {rank}): a reader state holds the position of "
                f"the service it was saved from, and {service!r} serves other batches; "
                f"load the state rank {rank} saved while reading {service!r}, or none to "
                f"read {service!r} from its first step")
        if "rank" not in state:
            raise ValueError(f"reader state of service {service!r} without a 'rank' (loaded "
                             f"into rank {rank}): a state that names its service names its "
                             "rank too; pass the state as state_dict() returned it")
    if "rank" in state and (not is_whole(state["rank"]) or state["rank"] != rank):
        raise ValueError(f"reader state of rank {state['rank']!r} loaded into rank {rank}")
    step = state.get("step")
    if step is not None and (not is_whole(step) or step < 0):
        raise ValueError(f"reader state of rank {rank}: 'step' is {step!r}, not a whole number "
                         ">= 0 or None")
    return None if step is None else int(step)


def no_going_back(step: int | None, at: int, rank: int, service: str) -> None:
    """Refuse a saved state of ``step`` (``None``: of no step) loaded into a reader of rank
    ``rank`` (direct or a host agent's) which has returned batches and is at step ``at``,
    where ``step`` lies before ``at``: service ``service`` serves each step to each rank
    once, so it cannot go back; a state of ``at`` or later is taken (the steps up to it
    are skipped).  Before its first ``next()`` a reader takes any state.

    Raises
    ------
    ServiceError
        Naming both steps and what to do instead.
    """
    from msd_dask.errors import ServiceError

    if step is not None and step >= at:
        return
    if step is None:
        what, again = ("a state of no step (step None)",
                       "to read from the first step again, start the whole job anew")
    else:
        what, again = (f"the state of step {step}",
                       f"to read step {step + 1} and after again, restart the whole job from "
                       f"its checkpoint of step {step}: the service from "
                       f"DataService.state_dict({step}), each rank from its own state")
    raise ServiceError(
        f"rank {rank}: a reader at step {at} cannot load {what}: it returned batches already "
        f"and does not go back, since service {service!r} serves each step once; load a state "
        f"before its first next() (or one of step {at} or later, to skip ahead), or, {again} "
        "(docs/resume.md)")


def is_whole(x: Any) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_seconds(x: Any, zero: bool = False) -> bool:
    """A finite number of seconds (numpy's too, not a bool) > 0, or >= 0 where ``zero``:
    every wait ends (``inf`` would hang silently) and says what it waited for."""
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return False
    value = float(x)
    return math.isfinite(value) and (value >= 0 if zero else value > 0)


def step_number(step: Any, what: str) -> int:
    """``step`` as an ``int``; a ``ValueError`` naming ``what`` (the call) if it is no integer
    (a float was cut to a step, a bool taken for 0 or 1)."""
    if not is_whole(step):
        raise ValueError(f"{what}: step must be a step (an integer), got {step!r}")
    return int(step)


#: the most batches ``MsdIterableDataset(prefetch=...)`` takes ahead of the training loop:
#: the service keeps the states of this many steps besides those it publishes ahead of its
#: readers (:func:`~msd_dask.roles.planner.kept_states`), so ``svc.state_dict(ds.last_step)``
#: finds the step the loop last finished (with ``prefetch=40`` it was gone; a review)
MAX_PREFETCH = 16


def rank_number(rank: Any) -> int:
    """``rank`` as the ``int`` a reader is made for; a ``ValueError`` naming it if it is no
    integer (a rank read from ``os.environ["RANK"]`` is a str: ``int(...)`` it)."""
    if not is_whole(rank):
        raise ValueError(f"rank must be an integer, got {rank!r}")
    return int(rank)


def check_rank(rank: int, service: str, world: int, layout: str) -> None:
    """A ``ValueError`` naming ``rank`` and the mesh if it is outside the ``world`` ranks
    service ``service`` is laid out for (``layout``, as ``"dp=… tp=… cp=… pp=…"``): the one
    refusal of a direct reader and of a reader through a host agent (which said to start
    the agent with ``--ranks`` covering it, and that agent refuses ranks outside the
    world; a review)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside [0, {world}): service {service!r} "
                         f"is laid out for {world} ranks ({layout})")


def check_world_size(rank: int, service: str, world: int, layout: str) -> None:
    """A ``ValueError`` if this process's ``WORLD_SIZE`` (where its launcher set it) is not
    the ``world`` ranks service ``service`` is laid out for (``layout``, as
    ``"dp=… tp=… cp=… pp=…"``): a job of other ranks read a round, then every rank waited
    out its timeout for ranks that never came (a review).  Every reader checks it,
    directly or through a host agent."""
    job = os.environ.get("WORLD_SIZE", "").strip()
    if job.isdigit() and int(job) != world:
        raise ValueError(f"rank {rank}: service {service!r} is laid out for {world} ranks "
                         f"({layout}), but this process's WORLD_SIZE is {job}: start the "
                         "service with the job's layout (its config's parallel:) or the job "
                         "with the service's")


def wait_seconds(timeout: Any, rank: int) -> float:
    """A reader's ``timeout`` as seconds; a ``ValueError`` naming it unless it is a finite
    number > 0 (every wait ends, saying what it waited for: ``inf`` would hang silently)."""
    if not is_seconds(timeout) or float(timeout) > MAX_TIMEOUT:
        raise ValueError(f"rank {rank}: a reader's timeout is a finite number of seconds > 0 "
                         f"and at most {MAX_TIMEOUT:g} (a year), got {timeout!r}")
    return float(timeout)


def step_time(seconds: Any, rank: int) -> float:
    """A rank's reported step time as seconds; a ``ValueError`` naming it unless it is a
    finite number >= 0.  Unchecked, a NaN was dropped without a word on a direct reader
    (the planner's error lost in a fire-and-forget call) and, through a host agent, ended
    the rank's connection: its next batch failed naming a malformed message (a review)."""
    if not is_seconds(seconds, zero=True):
        raise ValueError(f"rank {rank}: report_step_time takes the step's compute time, a "
                         f"finite number of seconds >= 0, got {seconds!r}")
    return float(seconds)
