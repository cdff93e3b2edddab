"""Data Constructor: a Dask actor that builds the batches of some DP ranks.

The planner hands it rounds of steps (``round_steps`` at a time).  For a
round it fetches the pieces of its DP ranks straight from the loaders' workers
(actor to actor, never through the client or the scheduler; one message per
loader for the whole round), packs them into rows, keeps the result, and puts
a small ticket ``{"steps", "c", "dp", "g"}`` into each member rank's
``distributed.Queue`` (``g``: the generation of the planner that planned the
steps, see :class:`~msd_dask.service.DataService`).  A rank's reader claims the
tensors of the ticket's steps from this actor directly
(:meth:`DataConstructor.claim`), so no batch bytes pass through the scheduler.
One batch is built per DP group, whatever the tensor/context/pipeline
parallelism: every member rank claims the same build.  Every message costs the
service CPU whatever its size (about 0.5 ms at each end here), so a round of
``k`` steps costs about ``1/k`` of the messages of single steps.

At most ``prefetch`` steps are held unclaimed; :meth:`DataConstructor.submit`
waits for room, which is the service's backpressure.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from msd_dask.core.packing import pack_rows, split_pieces, to_wire
from msd_dask.roles.direct import direct

__all__ = ["DataConstructor", "StepPieces", "StepWork", "queue_name"]


def queue_name(service: str, rank: int) -> str:
    """Name of the ``distributed.Queue`` of a global rank's tickets."""
    return f"msd-{service}-rank-{rank}"


#: A planned piece as a constructor builds it (:meth:`StepPieces.items`):
#: (source, loader index, epoch, unit, row, start, end, chunk, key)
WorkItem = tuple[str, int, int, int, int, int, int, int, str]


@dataclass(frozen=True)
class StepPieces:
    """One constructor's work of one step, in columns: a handful of int arrays, which
    Dask sends as buffers (per-piece tuples were serialised one by one on the event
    loop, and kept by the planner for re-sending: ≈1 GB for 10 steps at 16K × 4K).
    The planner builds it (:func:`msd_dask.roles.planner.split_plan`).

    Attributes
    ----------
    dps : (d,) int64
        The DP ranks, in increasing order.
    rows : (d,) int64
        How many micro-batch rows each DP rank has; the rows follow each other, the
        DP ranks' in the order of ``dps``.
    lengths : (r,) int64
        How many pieces each row has; the pieces follow each other, the rows' in order.
    pieces : (n, 9) int32 (int64 if a value does not fit)
        Columns: source (index in ``sources``), loader slot, epoch, unit, row, start,
        end, chunk, path (index in ``paths``).
    sources : tuple of str
        Source names.
    paths : tuple of str
        Units' paths relative to their source; a piece's document key is
        ``f"{paths[path]}:{row}"``.
    """

    dps: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    pieces: np.ndarray
    sources: tuple[str, ...]
    paths: tuple[str, ...]

    def __len__(self) -> int:
        """DP ranks (0: this constructor has nothing of the step)."""
        return len(self.dps)

    def items(self) -> Iterator[tuple[int, list[list[WorkItem]]]]:
        """``(dp rank, [row: [WorkItem, ...], ...])`` for each DP rank, in order."""
        names, paths = self.sources, self.paths
        pieces = iter(self.pieces.tolist())
        lengths = iter(self.lengths.tolist())
        for dp, n_rows in zip(self.dps.tolist(), self.rows.tolist(), strict=True):
            yield dp, [[(names[s], li, ep, u, r, a, b, ch, f"{paths[p]}:{r}")
                        for s, li, ep, u, r, a, b, ch, p in islice(pieces, n)]
                       for n in islice(lengths, n_rows)]


#: One step of a round: (step, this constructor's work, {"rank_cost": [...]})
StepWork = tuple[int, StepPieces, dict[str, Any]]


class _FinishedPairs:
    """The ``(step, dp)`` batches every member rank has claimed (``key in pairs``).

    Once it holds more than ``keep`` pairs, adding one forgets the pairs of the
    steps ``window`` or more before the added step, as a set rebuilt with
    ``{k for k in pairs if k[0] > step - window}`` would, but it keeps the pairs by
    step, with a heap of the steps, and drops whole steps: the work is O(1)
    amortised per pair whatever the number of DP ranks per step (a rebuilt set
    costs every pair kept, about ``window`` × DP ranks, for every pair added).
    """

    def __init__(self, keep: int = 4096, window: int = 64):
        self.keep = keep
        self.window = window
        self._dps: dict[int, set[int]] = {}  # step -> its DP ranks held
        self._steps: list[int] = []  # heap of the steps of _dps
        self._n = 0

    def add(self, step: int, dp: int) -> None:
        dps = self._dps.get(step)
        if dps is None:
            dps = self._dps[step] = set()
            heapq.heappush(self._steps, step)
        if dp not in dps:
            dps.add(dp)
            self._n += 1
        if self._n > self.keep:
            cut = step - self.window
            while self._steps and self._steps[0] <= cut:
                self._n -= len(self._dps.pop(heapq.heappop(self._steps)))

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple) or len(key) != 2:
            return False
        dps = self._dps.get(key[0])
        return dps is not None and key[1] in dps

    def __len__(self) -> int:
        return self._n


class DataConstructor:
    """Dask actor building and serving the batches of a set of DP ranks.

    Parameters
    ----------
    service : str
        The service name (queue names derive from it).
    index : int
        This constructor's index.
    members : dict
        ``{dp_rank: [global ranks of that DP group]}`` this constructor serves.
    seq_len, pad_id, prefetch : int
    timeout : float
        How long to wait for a loader, or for a step a rank claims to be built.
    generation : int
        The planner generation this constructor belongs to (0, then one more each
        time the service re-creates a lost planner); it is in every ticket.
    """

    def __init__(self, service: str, index: int, members: dict[int, list[int]], seq_len: int,
                 pad_id: int, prefetch: int, timeout: float = 300.0, generation: int = 0):
        self.timeout = float(timeout)
        self.generation = int(generation)
        self.service = service
        self.index = index
        self.members = {int(k): [int(r) for r in v] for k, v in members.items()}
        #: global rank -> its DP rank (a claim looks it up, not through every group)
        self._dp_by_rank: dict[int, int] = {}
        for d, ranks in self.members.items():
            for r in ranks:
                self._dp_by_rank.setdefault(r, d)
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.prefetch = prefetch
        self.loaders: dict[str, dict[int, Any]] = {}
        self._queues: dict[int, Any] = {}
        self._ready: dict[tuple[int, int], dict[str, Any]] = {}
        self._unclaimed: dict[tuple[int, int], set[int]] = {}
        #: dp -> steps of it in ``_unclaimed``, in the order they were built
        self._unclaimed_steps: defaultdict[int, dict[int, None]] = defaultdict(dict)
        self._held_steps: dict[int, int] = {}  # step -> DP batches of it not fully claimed
        self._gone = _FinishedPairs()  # (step, dp) fully claimed
        self._built: asyncio.Condition | None = None
        self._work: asyncio.Queue[list[StepWork]] | None = None
        self._room: asyncio.Condition | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._closed = False
        #: rank -> last step it already has (from a planner this one's replaced)
        self._had: dict[int, int] = {}
        self._fetching: str | None = None
        self.published: defaultdict[int, int] = defaultdict(int)
        self.claimed: defaultdict[int, int] = defaultdict(int)
        self.last_claimed: dict[int, int] = {}
        #: rank -> last step it returned as far as this constructor knows: a reader
        #: claims a round when it has returned every step before it, and reports the
        #: last step it returned when it then pauses (:meth:`returned_through`)
        self.returned: dict[int, int] = {}
        #: rank -> what last raised ``returned``: ``"claim"`` (the steps before the
        #: round), ``"pause"`` (its report after pausing: exact while it stays paused)
        #: or ``"skip"``
        self.returned_by: dict[int, str] = {}
        #: rank -> seconds its reader waits, after its loop stops asking, before it reports
        self.report_after: dict[int, float] = {}
        #: reports received (:meth:`returned_through`): none while readers keep reading
        self.reports = 0
        self.build_seconds = 0.0
        self.fetch_seconds = 0.0
        self.batches_built = 0
        #: rounds built and tickets put (one per member rank and round)
        self.rounds_built = 0
        self.tickets_put = 0
        #: tokens fetched from loaders and packed, once per DP group's batch
        self.tokens_built = 0

    async def setup(self, loaders: dict[str, dict[int, Any]],
                    had: dict[int, int] | None = None) -> None:
        """Connect to the loaders and create the member ranks' queues.

        ``had``: ``{rank: step}``, steps ranks already have (see :meth:`mark_had`).
        """
        from distributed import Queue, get_client

        self.loaders = loaders
        for r, step in (had or {}).items():
            if int(r) in self._dp_by_rank:
                self._had[int(r)] = max(self._had.get(int(r), -1), int(step))
                self.last_claimed[int(r)] = max(self.last_claimed.get(int(r), -1), int(step))
        client = get_client()
        for ranks in self.members.values():
            for r in ranks:
                self._queues[r] = await Queue(queue_name(self.service, r), client=client)
        self._work = asyncio.Queue()
        self._room = asyncio.Condition()
        self._built = asyncio.Condition()
        self._task = asyncio.create_task(self._builder())

    async def set_loaders(self, loaders: dict[str, dict[int, Any]]) -> None:
        """Replace the loader handles (slot -> actor; after the planner re-created one)."""
        import gc

        self.loaders = loaders
        gc.collect()  # old handles hold their actors' keys until they are collected

    # ------------------------------------------------------------- submission
    async def wait_room(self, steps: int = 1) -> None:
        """Return once this constructor can accept ``steps`` more steps.

        The planner plans a round only when every constructor has room for it,
        so a weight change lands at most ``prefetch`` steps after the last
        claimed one.
        """
        assert self._room is not None
        async with self._room:
            await self._room.wait_for(
                lambda: len(self._held_steps) + steps <= self.prefetch or self._closed)

    async def submit(self, steps: list[StepWork], room: int = 0, force: bool = False) -> None:
        """Accept a round: ``(step, work, info)`` of each step for this constructor's DP ranks.

        The round is fetched (one message per loader for all its steps), built
        and published (one ticket per rank for all its steps) together.  Waits
        until there is room for the round, then (``room``) until there is room
        for ``room`` more steps: the planner's next round, without another
        message.  ``force`` skips both waits: the planner re-sends recent
        steps to a re-created constructor.
        """
        assert self._room is not None and self._work is not None
        if self._closed or not steps:
            return
        held = sum(1 for _step, work, _info in steps if work)
        async with self._room:
            if not force:
                await self._room.wait_for(
                    lambda: len(self._held_steps) + held <= self.prefetch or self._closed)
            if self._closed:
                return
            for step, work, _info in steps:
                if work:  # a constructor with no DP rank in a step holds nothing of it
                    self._held_steps[step] = len(work)
        self._work.put_nowait(steps)
        if room and not force:
            await self.wait_room(room)

    async def _builder(self) -> None:
        assert self._work is not None
        while True:
            steps = await self._work.get()
            try:
                await self._build(steps)
            except Exception as e:  # noqa: BLE001 - turned into error tickets for the readers
                first = steps[0][0]
                self._error = f"constructor {self.index} failed to build step {first}: {e!r}"
                for q in self._queues.values():
                    await q.put({"error": self._error, "step": first, "g": self.generation})
                return

    async def _build(self, steps: list[StepWork]) -> None:
        t0 = time.perf_counter()
        # one fetch per loader for the whole round
        requests: dict[tuple[str, int], list[tuple[int, int, int, int, int]]] = defaultdict(list)
        where: dict[tuple[str, int], list[tuple[int, int, int, int]]] = defaultdict(list)
        works = [dict(work.items()) for _step, work, _info in steps]
        for (step, _work, _info), work in zip(steps, works, strict=True):
            for dp, rows in work.items():
                for m, row in enumerate(rows):
                    for j, (src, li, epoch, unit, r, start, end, _chunk, _key) in enumerate(row):
                        requests[(src, li)].append((epoch, unit, r, start, end))
                        where[(src, li)].append((step, dp, m, j))
        keys = list(requests)
        span = f"{steps[0][0]}" if len(steps) == 1 else f"{steps[0][0]}-{steps[-1][0]}"
        self._fetching = f"step {span} from loaders " + ", ".join(f"{s}#{li}" for s, li in keys)
        # each request list as one int64 array: Dask serializes a list of tuples element
        # by element, an array as one buffer
        results = await asyncio.gather(
            *(self._fetch(src, li, np.asarray(requests[(src, li)], dtype=np.int64))
              for src, li in keys))
        self._fetching = None
        t1 = time.perf_counter()
        tokens: dict[tuple[int, int, int, int], np.ndarray] = {}
        for k, arrays in zip(keys, results, strict=True):
            for pos, arr in zip(where[k], arrays, strict=True):
                tokens[pos] = arr
        tickets: dict[tuple[int, int], list[int]] = defaultdict(list)  # (rank, dp) -> steps
        for (step, _work, info), work in zip(steps, works, strict=True):
            for dp, rows in work.items():
                packed_rows = []
                docs = []
                epochs = []
                for m, row in enumerate(rows):
                    packed_rows.append([(tokens[(step, dp, m, j)], it[6] - it[5])
                                        for j, it in enumerate(row)])
                    docs.append([(it[0], it[8], it[7]) for it in row])
                    epochs.append([it[2] for it in row])
                packed = pack_rows(packed_rows, self.seq_len, self.pad_id)
                self.tokens_built += sum(n for row in packed_rows for _, n in row)
                packed.update(step=step, dp=dp, documents=docs, epochs=epochs,
                              cost=float(info["rank_cost"][dp]))
                # ranks that already have this step (they read it from a replaced planner's
                # constructors) get no ticket and are not waited for
                waiting = {r for r in self.members[dp] if step > self._had.get(r, -1)}
                if waiting:
                    self._ready[(step, dp)] = packed
                    self._unclaimed[(step, dp)] = waiting
                    self._unclaimed_steps[dp][step] = None
                    for r in waiting:
                        tickets[(r, dp)].append(step)
                else:
                    await self._done(step, dp)
            self.batches_built += len(work)
        self.fetch_seconds += t1 - t0
        self.build_seconds += time.perf_counter() - t1
        assert self._built is not None
        async with self._built:
            self._built.notify_all()
        self.rounds_built += 1
        for (r, dp), ticket in sorted(tickets.items()):
            await self._queues[r].put({"steps": ticket, "c": self.index, "dp": dp,
                                       "g": self.generation})
            self.published[r] += len(ticket)
            self.tickets_put += 1

    async def _fetch(self, source: str, slot: int, requests: np.ndarray) -> list[np.ndarray]:
        """Fetch from a loader slot; if its loader is lost or retired, retry on the actor
        the planner puts in that slot (:meth:`set_loaders`) until ``timeout``."""
        from msd_dask.errors import DataError

        deadline = time.monotonic() + self.timeout
        while True:
            loader = self.loaders[source][slot]

            async def call(h: Any) -> Any:
                # a lost actor's handle raises on access; a loader on this worker is
                # called directly (msd_dask.roles.direct)
                return await direct(h).fetch(requests)

            task = asyncio.ensure_future(call(loader))
            # a call to a lost worker's actor can hang: give up on it as soon as the
            # planner has put another actor in the slot
            replaced = False
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and self.loaders[source][slot].key != loader.key:
                    task.cancel()
                    replaced = True
                    break
                if time.monotonic() > deadline:
                    task.cancel()
                    raise RuntimeError(f"loader slot {source}#{slot} did not answer within "
                                       f"{self.timeout:.0f}s")
            if replaced or task.cancelled():
                continue
            e = task.exception()
            if e is None:
                return split_pieces(task.result())
            if isinstance(e, DataError) or time.monotonic() > deadline:
                raise e
            await asyncio.sleep(0.25)

    # ----------------------------------------------------------------- claims
    async def claim(self, steps: list[int], rank: int,
                    view: tuple[int, int, int, int] = (0, 1, 0, 1),
                    report_after: float | None = None) -> list[dict[str, Any]]:
        """The batches of global ``rank`` for ``steps`` (each member claims a step once),
        each as :func:`~msd_dask.core.packing.to_wire` sends it (:func:`~msd_dask.core.packing.from_wire`).

        ``view`` is the rank's ``(cp_rank, cp, pp_rank, pp)``: context-parallel
        ranks get their slice of every row, pipeline stages only the tensors
        they need (:func:`msd_dask.core.mesh.view_for_rank`).  ``report_after``: the
        seconds after which the rank's reader reports the last step it returned once
        its training loop stops asking (:data:`msd_dask.reader.REPORT_IDLE`).
        """
        from msd_dask.core.mesh import view_for_rank

        dp = self._dp_of(rank)
        if report_after is not None:
            self.report_after[rank] = float(report_after)
        for step in steps:  # all built first: a claim takes all its steps or none
            await self._wait_built(int(step), dp)
        self._check_open()
        missing = [s for s in steps if (int(s), dp) not in self._ready]
        if missing:
            raise KeyError(f"step(s) {missing} of rank {rank} are not held by constructor "
                           f"{self.index} (already claimed, or never published)")
        # the rank returned every step before this round (it claims when it has none left)
        self._raise_returned(rank, int(steps[0]) - 1, "claim")
        return [to_wire(view_for_rank(await self._hand_over((int(step), dp), rank), *view))
                for step in steps]

    async def skip(self, step: int, rank: int) -> None:
        """Mark ``step`` claimed by ``rank`` without sending it (a resumed rank had it)."""
        await self._take(step, rank)
        self._raise_returned(rank, int(step), "skip")

    async def returned_through(self, rank: int, step: int) -> None:
        """``rank``'s reader returned every step up to ``step`` and then paused (it reports
        when its training loop has not asked for a batch for ``REPORT_IDLE`` seconds)."""
        rank = int(rank)
        if rank in self._dp_by_rank:
            self.reports += 1
            self._raise_returned(rank, int(step), "pause")

    def _raise_returned(self, rank: int, step: int, by: str) -> None:
        """``rank`` returned every step up to ``step`` (learnt from a ``by``).  A report
        that arrives after a claim of the same step (sent before the reader resumed)
        does not hide the claim."""
        known = self.returned.get(rank, -1)
        if step > known or (step == known and by != "pause"):
            self.returned[rank] = step
            self.returned_by[rank] = by

    async def mark_had(self, rank: int, step: int) -> None:
        """``rank`` already has every step up to ``step``: release them for it, now and
        when they are built, and send it no ticket for them.

        A reader calls this when the service re-created its lost planner: the new
        planner re-plans the steps after its saved state, some of which the rank
        had read already; without this the constructor would hold them for the
        rank (and stop at ``prefetch`` such steps) until its reader skipped them.
        """
        rank, step = int(rank), int(step)
        dp = self._dp_by_rank.get(rank)
        if dp is None:
            return
        self._had[rank] = max(self._had.get(rank, -1), step)
        self.last_claimed[rank] = max(self.last_claimed.get(rank, -1), step)
        # only the batches of the rank's DP group wait for it (the groups are disjoint)
        for key, waiting in [((s, dp), self._unclaimed[(s, dp)])
                             for s in self._unclaimed_steps.get(dp, ())]:
            if key[0] <= step and rank in waiting:
                waiting.discard(rank)
                if not waiting:
                    await self._done(*key)

    async def _done(self, step: int, dp: int) -> None:
        """Every member rank has ``step``'s batch of ``dp``: drop it, make room."""
        assert self._room is not None
        self._ready.pop((step, dp), None)
        self._unclaimed.pop((step, dp), None)
        steps = self._unclaimed_steps.get(dp)
        if steps is not None:
            steps.pop(step, None)
            if not steps:
                del self._unclaimed_steps[dp]
        self._gone.add(step, dp)
        async with self._room:
            if step in self._held_steps:
                self._held_steps[step] -= 1
                if self._held_steps[step] <= 0:
                    del self._held_steps[step]
            self._room.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            # not a KeyError: readers take this as "switch to the service's current roles"
            raise RuntimeError(f"constructor {self.index} (generation {self.generation}) of "
                               f"service {self.service!r} was closed")

    def _dp_of(self, rank: int) -> int:
        self._check_open()
        dp = self._dp_by_rank.get(rank)
        if dp is None:
            raise KeyError(f"rank {rank} is not served by constructor {self.index}")
        return dp

    async def _wait_built(self, step: int, dp: int) -> None:
        """Wait (up to ``timeout``) until ``step`` of ``dp`` is built, if it is not gone:
        a re-sent step (after this constructor was re-created) may still be building."""
        key = (step, dp)
        if key not in self._ready and key not in self._gone:
            assert self._built is not None
            async with self._built:
                try:
                    await asyncio.wait_for(
                        self._built.wait_for(lambda: key in self._ready or self._closed
                                             or self._error is not None),
                        self.timeout)
                except TimeoutError:
                    pass

    async def _take(self, step: int, rank: int) -> dict[str, Any]:
        key = (int(step), self._dp_of(rank))
        await self._wait_built(*key)
        self._check_open()
        if key not in self._ready:
            raise KeyError(f"step {step} of rank {rank} is not held by constructor "
                           f"{self.index} (already claimed, or never published)")
        return await self._hand_over(key, rank)

    async def _hand_over(self, key: tuple[int, int], rank: int) -> dict[str, Any]:
        """Mark the built batch ``key`` (step, dp) claimed by ``rank`` and return it."""
        self._check_open()  # closed while a claim of several steps awaited room
        out = self._ready[key]
        waiting = self._unclaimed[key]
        waiting.discard(rank)
        self.claimed[rank] += 1
        self.last_claimed[rank] = max(self.last_claimed.get(rank, -1), key[0])
        if not waiting:
            await self._done(*key)
        return out

    async def stats(self) -> dict[str, Any]:
        """Per-rank queue depth (published, not claimed), build timings, errors."""
        return {
            "index": self.index,
            "held_steps": len(self._held_steps),
            "queue_depth": {r: self.published[r] - self.claimed[r]
                            for rs in self.members.values() for r in rs},
            "last_claimed": dict(self.last_claimed),
            "returned": dict(self.returned),
            "returned_by": dict(self.returned_by),
            "report_after": dict(self.report_after),
            "reports": self.reports,
            "batches_built": self.batches_built,
            "rounds_built": self.rounds_built,
            "tickets_put": self.tickets_put,
            "tokens_built": self.tokens_built,
            "fetch_seconds": self.fetch_seconds,
            "build_seconds": self.build_seconds,
            "error": self._error,
            "closed": self._closed,
            "generation": self.generation,
            "fetching": self._fetching,
            # held steps and the ranks that have not claimed them yet
            "unclaimed": {f"{st}/{dp}": sorted(rs) for (st, dp), rs in self._unclaimed.items()},
        }

    async def close(self) -> None:
        """Stop building, drop the batches held and the loader handles (they keep the
        loaders' keys alive).  Claims waiting here, or made later, raise
        ``RuntimeError``: readers then switch to the service's current constructor."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        self.loaders = {}
        self._ready.clear()
        self._unclaimed.clear()
        self._unclaimed_steps.clear()
        if self._built is not None:
            async with self._built:
                self._built.notify_all()
        if self._room is not None:  # a planner waiting for room here goes on
            async with self._room:
                self._room.notify_all()
