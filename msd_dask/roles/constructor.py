"""Data Constructor: a Dask actor that builds the batches of some DP ranks.

The planner hands it rounds of steps (``round_steps`` at a time).  For a
round it fetches the pieces of its DP ranks straight from the loaders' workers
(actor to actor, never through the client or the scheduler; one message per
loader for the whole round), packs them into rows, keeps the result, and posts
the round's steps to each member rank.  A rank's reader asks this actor for its
next round (:meth:`DataConstructor.next_round`, a call that waits here up to
:data:`POLL` seconds for one) and gets the tensors of its steps in the answer:
readers and constructors talk peer to peer, and nothing per step or per rank
passes through the scheduler.  One batch is built per DP group, whatever the
tensor/context/pipeline parallelism: every member rank claims the same build.
Every message costs the service CPU whatever its size (about 0.5 ms at each end
here), so a round of ``k`` steps costs about ``1/k`` of the messages of single
steps.

DP rank ``dp`` is built by constructor ``dp % n`` of ``n`` (:func:`constructor_of`),
in every planner generation, so a reader knows which constructor to ask.

At most ``prefetch`` steps are held unclaimed; :meth:`DataConstructor.submit`
waits for room, which is the service's backpressure.  The last round handed to a
rank is also kept until the rank shows it has it (its next claim, report or
``mark_had``): a claim that says it lacks that round (the answer was lost with its
connection) is answered the same round again, so a rank still gets every step once.
"""

from __future__ import annotations

import asyncio
import functools
import pickle
import threading
import time
from bisect import bisect_left
from collections import defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from itertools import accumulate, islice
from typing import Any

import numpy as np

from msd_dask.core.gcpause import gc_paused
from msd_dask.core.packing import PieceError, pack_rows, split_pieces, to_wire
from msd_dask.dask_internals import call_remote_actor, client_connected
from msd_dask.roles.direct import direct

__all__ = ["POLL", "DataConstructor", "StepPieces", "StepWork", "constructor_of", "pack_work",
           "pack_works", "unanswered_stats", "unpack_work"]

#: seconds :meth:`DataConstructor.next_round` waits for a round before it answers
#: ``None`` (the reader then looks after a lost planner and asks again)
POLL = 5.0
#: pieces of a step from which its batches are packed in a thread, not on the actor's
#: event loop (a smaller step packs in a few milliseconds; the thread costs each step a
#: hop there and back)
THREAD_PACK_FROM = 4096


def unanswered_stats(index: int, error: str) -> dict[str, Any]:
    """What stands for :meth:`DataConstructor.stats` of constructor ``index`` that did not
    answer (its worker was lost and the planner re-creates it): ``error`` says why, and it
    has no ranks' figures."""
    return {"index": index, "queue_depth": {}, "last_claimed": {}, "error": error,
            "unanswered": True}


def constructor_of(dp: int, n_constructors: int) -> int:
    """The index of the constructor that builds DP rank ``dp``'s batches."""
    return dp % n_constructors


def _at_most(step: int, returned: int | None) -> int:
    """``step``, or ``returned`` if a caller said so and it is lower."""
    return step if returned is None else min(step, int(returned))


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
    costs : (d,) float64
        Each DP rank's cost under the planner's cost model, in the order of ``dps``
        (a batch carries its rank's; the step's cost of every rank, sent to every
        constructor, was 16,384 × 256 floats per step at dp 16,384).
    """

    dps: np.ndarray
    rows: np.ndarray
    lengths: np.ndarray
    pieces: np.ndarray
    sources: tuple[str, ...]
    paths: tuple[str, ...]
    costs: np.ndarray

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


#: One step of a round: (step, this constructor's work)
StepWork = tuple[int, StepPieces]


def pack_work(work: StepPieces) -> bytes:
    """One constructor's work of a step, packed as the planner keeps it for that constructor
    if it is re-created and sends it to a constructor on another worker: its arrays' bytes
    after the rest pickled; an integer array in the narrowest unsigned integers that hold
    it, the piece table column by column; compressed together (zstd level -1) where a
    step's work is large (:func:`pack_works`).

    A column of a constructor's pieces holds values of one kind (a source, a row, a
    length...), mostly small: narrowed, the arrays are about half their bytes, and zstd,
    which takes most of the time of packing, has that much less to compress.  Narrowed,
    they compress at zstd's fast level -1 smaller than the arrays as they are at level 1,
    and in less time than at level 1.  Neither the arrays nor the paths one by one go
    through pickle, which costs tens of microseconds an array and as much as zstd for
    thousands of paths (:func:`_joined`).  A work of a step at dp 16,384 is small (a
    few hundred pieces at 4K), so what is done per array or column, not per value, counts:
    a column's narrow dtype comes from one pass (its largest value as unsigned), and the
    parts are joined (and compressed) in one call.  The result is bytes of their own size
    (zstandard's output buffers are not kept), and :func:`unpack_work` gives back an
    equal work, which pickles to the same bytes.
    """
    return pack_works([work])[0]  # (a step of this work alone)


def _laid_out(works: Sequence[StepPieces]) -> list[bytes]:
    """:func:`pack_work`'s bytes of each of ``works`` before they are compressed.

    The works are laid out together, a field at a time: the arrays of a field (of one
    dtype and number of columns) are transposed into one table of columns, each work's
    largest value of each column comes from one ``reduceat`` and each narrow dtype a
    column needs from one conversion of the column, so most numpy calls are per field,
    not per work and column (at dp 16,384 a step has 256 works or more, of a few hundred
    pieces at 4K, and those calls took most of the time); a work's bytes are then
    slices of the converted columns, joined after its pickled rest.
    """
    k = len(works)
    rests: list[dict[str, Any]] = [{} for _ in range(k)]
    joins: list[dict[str, str]] = [{} for _ in range(k)]
    arrays: list[list[tuple[str, str, tuple[int, ...], list[str]]]] = [[] for _ in range(k)]
    bodies: list[list[Any]] = [[b"", b""] for _ in range(k)]
    for field in fields(StepPieces):  # (vars() of a work: the fields, in this order)
        name = field.name
        values = [getattr(w, name) for w in works]
        groups: dict[tuple[np.dtype[Any], int], list[int]] = defaultdict(list)
        for i, value in enumerate(values):
            if isinstance(value, np.ndarray):  # (-1: not 2-d, laid out as one column)
                groups[(value.dtype, value.shape[1] if value.ndim == 2 else -1)].append(i)
                continue
            text = _joined(value)
            if text is None:
                rests[i][name] = value
            else:
                joins[i][name] = text
        for (kind, width), members in groups.items():
            mine = [values[i] for i in members]
            # the values' rows of ``cols`` columns, one after the other: a 2-d array's own,
            # else one column
            cols = 1 if width < 0 else width
            # (the bookkeeping of a run's values in lists: a step of a few works, at the
            # service's small steps, paid more for numpy calls on tiny arrays than it saved)
            sizes = [len(v) if width >= 0 else v.size for v in mine]
            bounds = [0, *accumulate(sizes)]
            # the values' columns, each contiguous, one after the other: each value's
            # transposed into its place (joining the values first was a pass more over
            # the step's pieces, at dp 16,384 x 128K about 20 ms)
            columns = np.empty((cols, bounds[-1]), dtype=kind)
            for v, a, b in zip(mine, bounds[:-1], bounds[1:], strict=True):
                columns[:, a:b] = v.T if width >= 0 else v.reshape(1, -1)
            dtype = kind.str
            choice = (*_NARROW, dtype)
            own = len(_NARROW)
            # which of ``choice`` each value's column takes (``own``: its own dtype)
            picks = [[own] * cols for _ in mine]
            if kind.kind in "iu" and bounds[-1]:
                some = [m for m, n in enumerate(sizes) if n]
                # as unsigned, a negative value lies past the signed dtype's top
                tops = np.maximum.reduceat(columns.view(dtype.replace("i", "u")),
                                           [bounds[m] for m in some], axis=1).T.tolist()
                past = _past(kind)
                for m, row in zip(some, tops, strict=True):
                    picks[m] = [bisect_left(_TOPS, top) if top <= past else own for top in row]
            # each column in each dtype its values take, as bytes (sliced without numpy)
            converted = [{j: columns[c].astype(choice[j], copy=False).data.cast("B")
                          for j in {p[c] for p in picks}} for c in range(cols)]
            del columns
            itemsize = (*_NARROW_SIZES, kind.itemsize)
            for i, value, a, b, picked in zip(members, mine, bounds[:-1], bounds[1:], picks,
                                              strict=True):
                arrays[i].append((name, dtype, value.shape, [choice[j] for j in picked]))
                bodies[i] += [converted[c][j][a * itemsize[j]:b * itemsize[j]]
                              for c, j in enumerate(picked)]
    out = []
    for rest, joined, laid, body in zip(rests, joins, arrays, bodies, strict=True):
        head = pickle.dumps((rest, joined, laid), protocol=5)
        if len(head) >= 2**31:  # (unpack_work tells laid-out bytes from a zstd frame by this)
            raise ValueError(f"a constructor's work of {len(head)} bytes besides its arrays")
        body[:2] = len(head).to_bytes(_HEAD, "little"), head
        out.append(b"".join(body))
    return out


def pack_works(works: Sequence[StepPieces], threads: int = 1) -> list[bytes]:
    """Each constructor's work of a step, in order, laid out as :func:`pack_work` lays it
    out, and compressed as it compresses it where the whole step is large
    (:func:`pack_work` of one work is this of a step of that work alone).

    The works are laid out in this thread, a run of them at a time
    (:func:`_laid_out`).  A step whose works take
    :data:`_COMPRESS_FROM` bytes or more laid out (dp 16,384 × 32K or 128K) is compressed,
    where the planner keeps ``prefetch`` steps of it within its memory bound: on up to
    ``threads`` of zstd's own threads, which run without the GIL, one call for up to
    :data:`_BATCH_BYTES` of laid-out works (each call starts its threads, about 0.3 ms;
    at dp 16,384 × 128K a step's works, about 80 MiB laid out, stay below the planner's
    peak, its placement's).  A smaller step's works are kept and sent as laid out (at
    dp 16,384 × 4K, 3.6 MiB a step: zstd would take about as long as laying them out,
    to save 1.6 MiB).  (Packing the works themselves on a pool of Python threads is
    slower: laying one out is many small numpy calls under the GIL.)
    """
    out: list[bytes] = []
    laid: list[bytes] = []
    size = total = 0
    # (the thousands of lists and tuples a layout makes are no garbage: Python's collector
    # is paused meanwhile, :func:`~msd_dask.core.gcpause.gc_paused`)
    with gc_paused():
        for chunk in _chunks(works):
            for one in _laid_out(chunk):
                laid.append(one)
                size += len(one)
                total += len(one)
                if size >= _BATCH_BYTES:
                    out += _compressed(laid, threads) if total >= _COMPRESS_FROM else laid
                    laid, size = [], 0
        if laid:
            out += _compressed(laid, threads) if total >= _COMPRESS_FROM else laid
    return out


def _chunks(works: Sequence[StepPieces]) -> Iterator[Sequence[StepPieces]]:
    """``works`` in runs laid out together (:func:`_laid_out`), each of about
    :data:`_LAY_BYTES` of arrays (a work larger than that alone): a run's columns and
    their narrow copies are its temporaries, not the step's (at dp 16,384 × 128K a
    step's pieces take about 170 MiB)."""
    start = size = 0
    for i, w in enumerate(works):
        size += sum(v.nbytes for v in vars(w).values() if isinstance(v, np.ndarray))
        if size >= _LAY_BYTES:
            yield works[start:i + 1]
            start, size = i + 1, 0
    if start < len(works):
        yield works[start:]


def _compressed(laid: list[bytes], threads: int) -> list[bytes]:
    """Each of ``laid`` compressed as :func:`pack_work` does, on up to ``threads`` of zstd's
    threads, each in bytes of its own size."""
    z = _compressor()
    if threads <= 1 or not hasattr(z, "multi_compress_to_buffer"):  # (the cffi backend)
        return [bytes(memoryview(z.compress(b))) for b in laid]
    done = z.multi_compress_to_buffer(laid, threads=threads)
    return [bytes(part) for part in done]


def unpack_work(packed: bytes) -> StepPieces:
    """The work :func:`pack_work` packed (its arrays writable, each its own)."""
    import zstandard

    if packed[:4] == _ZSTD_MAGIC:  # (laid-out bytes start with a length below 2**31)
        raw = memoryview(zstandard.ZstdDecompressor().decompress(packed))
    else:
        raw = memoryview(packed)
    at = _HEAD + int.from_bytes(raw[:_HEAD], "little")
    rest, joined, arrays = pickle.loads(raw[_HEAD:at])
    rest.update((name, tuple(text.split("\0"))) for name, text in joined.items())
    for name, dtype, shape, kinds in arrays:
        value = np.empty(shape, dtype=dtype)
        parts = value.T if value.ndim == 2 else value.reshape(1, -1)
        for part, kind in zip(parts, kinds, strict=True):
            part[:] = np.frombuffer(raw, dtype=kind, count=len(part), offset=at)
            at += len(part) * np.dtype(kind).itemsize
        rest[name] = value
    return StepPieces(**rest)


def _steps_named(steps: list[StepWork]) -> str:
    """``"step 4"``, or ``"steps 4-6"`` for a round of several."""
    if len(steps) == 1:
        return f"step {steps[0][0]}"
    return f"steps {steps[0][0]}-{steps[-1][0]}"


def _joined(value: Any) -> str | None:
    """A tuple of str (a work's paths) as one str, joined by NUL, which no path holds (one
    str pickles in a fraction of the time of thousands); None if ``value`` is not one."""
    if type(value) is not tuple or not value:
        return None
    try:
        joined = "\0".join(value)
    except TypeError:  # not all str
        return None
    return joined if joined.count("\0") == len(value) - 1 else None


#: bytes of the length of :func:`pack_work`'s pickled part, before it
_HEAD = 8

#: the most bytes of laid-out works :func:`pack_works` compresses in one call
_BATCH_BYTES = 1 << 27

#: the fewest bytes of a step's laid-out works :func:`pack_works` compresses (at most
#: :data:`_BATCH_BYTES`: a step is compressed whole or not at all, decided by the time its
#: first batch is)
_COMPRESS_FROM = 1 << 24

#: the first bytes of a zstd frame (its magic number, little-endian)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

#: the unsigned integers an integer array, or a piece table's column, is narrowed to (dtype
#: strings), and the largest value each holds (the narrowest holding a part's largest value
#: is the first whose top is not below it)
_NARROW = ("|u1", "<u2", "<u4")
_TOPS = [int(np.iinfo(np.dtype(k)).max) for k in _NARROW]
_NARROW_SIZES = tuple(np.dtype(k).itemsize for k in _NARROW)

#: about the most bytes of works' arrays :func:`pack_works` lays out together: enough for
#: the calls per run to be spread over dozens of small works (dp 16,384 x 4K: about 30 KB
#: each), few enough for a run's passes to stay near the cores' caches where works are
#: large (x 128K: about 700 KB each; a run of 8 MiB took a third longer there, one of a
#: single work longer still)
_LAY_BYTES = 1 << 21


@functools.cache
def _past(dtype: np.dtype[Any]) -> int:
    """The largest value of integer ``dtype``: read as unsigned, a value of a part past it is
    a negative one (a part with one keeps its dtype)."""
    return int(np.iinfo(dtype).max)


_compressors = threading.local()


def _compressor() -> Any:
    """This thread's zstd compressor for :func:`pack_work` (level -1): a compressor's first
    frame sets up its context, so each thread keeps one (they are not thread-safe)."""
    import zstandard

    z = getattr(_compressors, "z", None)
    if z is None:
        z = _compressors.z = zstandard.ZstdCompressor(level=-1)
    return z


async def _reading(loader: Any) -> str:
    """What ``loader`` says it has been reading longest (``"; it is reading PATH (epoch e)
    for Ns"``), for an error of a fetch that waited on it: a store that hangs or a
    ``preprocess`` that loops, not a lost loader; ``""`` if it does not say within
    :data:`~msd_dask.dask_internals.STATS_WAIT` seconds or reads nothing."""
    from msd_dask.dask_internals import STATS_WAIT

    try:
        st = await asyncio.wait_for(direct(loader).stats(), STATS_WAIT)
        r = st["reading"][0]
    except Exception:  # noqa: BLE001 - lost, or not answering either
        return ""
    return f"; it is reading {r['path']} (epoch {r['epoch']}) for {r['seconds']:.0f}s"


def two_readers(rank: int, holder: tuple[str, str], process: str) -> str:
    """What a reader of ``process`` is told whose rank another connected process reads
    (:meth:`DataConstructor.next_round`; ``holder``: that one's process and client)."""
    return (f"rank {rank} is read by two processes at once: process {holder[0]} (Dask client "
            f"{holder[1]}) took its last round and is still connected, and this process "
            f"({process}) asked for it again; each rank is read by one "
            "process (is RANK computed from LOCAL_RANK, or does an earlier process of this "
            "rank still run?).  Once that process is gone this rank is served again from its "
            "last state")


class DataConstructor:
    """Dask actor building and serving the batches of a set of DP ranks.

    Parameters
    ----------
    service : str
        The service name.
    index : int
        This constructor's index.
    members : dict
        ``{dp_rank: [global ranks of that DP group]}`` this constructor serves.
    seq_len, pad_id, prefetch : int
    timeout : float
        How long to wait for a loader, or for a step a rank claims to be built.
    generation : int
        The planner generation this constructor belongs to (0, then one more each
        time the service re-creates a lost planner); it is in every answer to a reader.
    replacing : bool
        Made to replace a lost or moved constructor: it accepts the steps the planner
        re-sends to it (``submit(..., force=True)``) before any other round.
    """

    def __init__(self, service: str, index: int, members: dict[int, list[int]], seq_len: int,
                 pad_id: int, prefetch: int, timeout: float = 300.0, generation: int = 0,
                 replacing: bool = False):
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
        #: rank -> the steps of each round posted to it and not asked for yet, in order
        self._rounds: defaultdict[int, deque[list[int]]] = defaultdict(deque)
        #: rank -> set when a round is posted to it (or the service has news for every
        #: rank): wakes its reader's waiting :meth:`next_round`
        self._posted: dict[int, asyncio.Event] = {}
        #: what every reader is told once it has asked for every round posted to it:
        #: the planner failed, or the owner closed the service
        self._notice: str | None = None
        self._ready: dict[tuple[int, int], dict[str, Any]] = {}
        self._unclaimed: dict[tuple[int, int], set[int]] = {}
        #: dp -> steps of it in ``_unclaimed``, in the order they were built
        self._unclaimed_steps: defaultdict[int, dict[int, None]] = defaultdict(dict)
        self._held_steps: dict[int, int] = {}  # step -> DP batches of it not fully claimed
        #: the last step :meth:`submit` accepted (-1: none): the planner sends steps in
        #: order, once each, so a step not after it is a round delivered again
        self._accepted = -1
        #: whether rounds may be accepted: a constructor made to replace another waits for
        #: the steps the planner re-sends to it first (:meth:`submit`)
        self._resent = not replacing
        #: made to replace a lost or moved constructor: it knows nothing of what its ranks
        #: returned before, until they claim or report (see ``stats()``)
        self.replacing = bool(replacing)
        self._work: asyncio.Queue[list[StepWork]] | None = None
        self._room: asyncio.Condition | None = None
        self._task: asyncio.Task[None] | None = None
        self._error: str | None = None
        self._closed = False
        #: rank -> last step it already has (from a planner this one's replaced)
        self._had: dict[int, int] = {}
        #: rank -> the last step it showed it has (a claim's ``done``, a report,
        #: ``mark_had``): unlike ``last_claimed``, not a round whose answer may be lost
        self._shown: dict[int, int] = {}
        #: calling rank -> the steps and batches of the last round handed to it, until it
        #: shows it has them (its next claim, report or ``mark_had``): a claim that says
        #: less (the answer was lost on its way) is answered the same round again
        self._last_round: dict[int, tuple[list[int], list[dict[str, Any]]]] = {}
        #: per rank: the process and Dask client whose reader took its last round
        #: (:meth:`next_round`'s ``claimant``), sent again to another process only once
        #: that client is gone
        self._round_holder: dict[int, tuple[str, str]] = {}
        #: per rank: its claims so far; a claim still waiting when a newer one of the rank
        #: came takes no round (its reader gave up on it: its answer would go nowhere)
        self._claims: dict[int, int] = {}
        #: rounds sent again to a rank whose answer was lost
        self.rounds_resent = 0
        self._fetching: str | None = None
        self.published: defaultdict[int, int] = defaultdict(int)
        self.claimed: defaultdict[int, int] = defaultdict(int)
        self.last_claimed: dict[int, int] = {}
        #: rank -> last step it returned as far as this constructor knows: a reader
        #: claims a round when it has returned every step before it (a host agent's
        #: reader, ahead of its ranks, says what they took), and reports the last step
        #: it returned when it then pauses (:meth:`returned_through`)
        self.returned: dict[int, int] = {}
        #: rank -> what last raised ``returned``: ``"claim"`` (the steps before the
        #: round), ``"taken"`` (a claim's ``returned``: what an agent's ranks took),
        #: ``"pause"`` (its report after pausing: exact while it stays paused) or ``"skip"``
        self.returned_by: dict[int, str] = {}
        #: rank -> seconds its reader waits, after its loop stops asking, before it reports
        self.report_after: dict[int, float] = {}
        #: reports received (:meth:`returned_through`): none while readers keep reading
        self.reports = 0
        self.build_seconds = 0.0
        self.fetch_seconds = 0.0
        self.batches_built = 0
        #: rounds built, and posted to member ranks (one per rank and round)
        self.rounds_built = 0
        self.rounds_posted = 0
        #: batches sent to readers: one per call's step, whatever the ranks it was for
        self.batches_sent = 0
        #: tokens fetched from loaders and packed, once per DP group's batch
        self.tokens_built = 0

    async def setup(self, loaders: dict[str, dict[int, Any]],
                    had: dict[int, int] | None = None) -> None:
        """Connect to the loaders and start building.

        ``had``: ``{rank: step}``, steps ranks already have (see :meth:`mark_had`).
        """
        self.loaders = loaders
        for r, step in (had or {}).items():
            if int(r) in self._dp_by_rank:
                self._had[int(r)] = max(self._had.get(int(r), -1), int(step))
                self.last_claimed[int(r)] = max(self.last_claimed.get(int(r), -1), int(step))
                self._show(int(r), int(step))
        self._work = asyncio.Queue()
        self._room = asyncio.Condition()
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
                lambda: len(self._held_steps) + steps <= self.prefetch or self._closed
                or self._error is not None)
        self._raise_failed()

    def _raise_failed(self) -> None:
        """The planner hears a failed build too (its readers do from :meth:`next_round`):
        the failed round's steps stay held, and a wait for room would never end."""
        if self._error is not None:
            raise RuntimeError(self._error)

    async def submit(self, round_steps: list[StepWork] | bytes, room: int = 0,
                     force: bool = False) -> None:
        """Accept a round, ``round_steps``: ``(step, work)`` of each step for this
        constructor's DP ranks.

        The round is fetched (one message per loader for all its steps), built
        and posted (one round per rank for all its steps) together.  Waits
        until there is room for the round, then (``room``) until there is room
        for ``room`` more steps: the planner's next round, without another
        message.  ``force`` skips both waits: the planner re-sends recent
        steps to a re-created constructor.

        A planner on another worker sends the round as ``bytes``: each step's work
        packed as the planner keeps it (:func:`pack_work`),
        pickled together.  Dask would serialise every array of every step on its own,
        with a header of its own, at both ends, and the planner's event loop would
        pickle what its planning thread packed already.

        Steps accepted already are dropped: a call retried after its connection
        failed (:func:`~msd_dask.dask_internals.call_remote_actor`, as Dask's own
        actor calls do) may deliver a round twice, even while the first waits for room.
        A constructor made to replace another (``replacing``) accepts the re-sent steps
        (``force``) before any other round: the planner may send it its next round
        while the re-send is on its way, and a later round first would have the
        re-sent steps dropped.
        """
        assert self._room is not None and self._work is not None
        if isinstance(round_steps, bytes):
            steps = [(step, unpack_work(work)) for step, work in pickle.loads(round_steps)]
        else:
            steps = round_steps
        if self._closed or not (steps or force):
            return
        steps = self._unseen(steps)
        held = sum(1 for _step, work in steps if work)
        async with self._room:
            if not force:
                await self._room.wait_for(lambda: self._closed or self._error is not None or (
                    self._resent and (not steps or len(self._held_steps) + held <= self.prefetch)))
            self._raise_failed()
            steps = self._unseen(steps)  # the same round, delivered again, went first
            if self._closed:
                return
            if force:
                self._resent = True
                self._room.notify_all()
            if steps:
                self._accepted = steps[-1][0]
            for step, work in steps:
                if work:  # a constructor with no DP rank in a step holds nothing of it
                    self._held_steps[step] = len(work)
        if steps:
            self._work.put_nowait(steps)
        if room and not force:  # a round delivered again waits as the first did
            await self.wait_room(room)

    def _unseen(self, steps: list[StepWork]) -> list[StepWork]:
        """``steps`` after the last step accepted (:meth:`submit`)."""
        return [st for st in steps if st[0] > self._accepted]

    async def _builder(self) -> None:
        assert self._work is not None
        while True:
            steps = await self._work.get()
            try:
                await self._build(steps)
            except Exception as e:  # noqa: BLE001 - told to every reader (next_round)
                # (a round is fetched and built together: the error names all of its steps)
                self._error = (f"constructor {self.index} failed to build {_steps_named(steps)}: "
                               f"{e!r}")
                self._wake_all()
                room = self._room
                assert room is not None  # (made with the builder, in setup)
                async with room:  # (the planner waiting for room hears it)
                    room.notify_all()
                return

    async def _build(self, steps: list[StepWork]) -> None:
        t0 = time.perf_counter()
        # one fetch per loader for the whole round
        requests: dict[tuple[str, int], list[tuple[int, int, int, int, int]]] = defaultdict(list)
        where: dict[tuple[str, int], list[tuple[int, int, int, int]]] = defaultdict(list)
        works = [dict(work.items()) for _step, work in steps]
        for (step, _work), work in zip(steps, works, strict=True):
            for dp, rows in work.items():
                for m, row in enumerate(rows):
                    for j, (src, li, epoch, unit, r, start, end, _chunk, _key) in enumerate(row):
                        requests[(src, li)].append((epoch, unit, r, start, end))
                        where[(src, li)].append((step, dp, m, j))
        keys = list(requests)
        self._fetching = f"{_steps_named(steps)} from loaders " + ", ".join(
            f"{s}#{li}" for s, li in keys)
        # each request list as one int64 array: Dask serializes a list of tuples element
        # by element, an array as one buffer
        try:
            results = await asyncio.gather(
                *(self._fetch(src, li, np.asarray(requests[(src, li)], dtype=np.int64))
                  for src, li in keys))
        finally:  # (a failed or cancelled fetch said it fetched for good; a review)
            self._fetching = None
        t1 = time.perf_counter()
        tokens: dict[tuple[int, int, int, int], np.ndarray] = {}
        for k, arrays in zip(keys, results, strict=True):
            if len(arrays) != len(where[k]):  # (Python's "zip() argument 2 is shorter")
                raise RuntimeError(f"loader slot {k[0]}#{k[1]} answered {len(arrays)} pieces "
                                   f"for {len(where[k])} asked of {_steps_named(steps)}")
            for pos, arr in zip(where[k], arrays, strict=True):
                tokens[pos] = arr
        posts: dict[int, list[int]] = defaultdict(list)  # rank -> steps
        for (step, pieces), work in zip(steps, works, strict=True):
            # a large step packed in a thread: on this loop, a round of 64 DP ranks x 8 rows
            # x 128K held the worker (claims, the planner's submits, heartbeats, loaders on
            # it) for seconds (a review of the data path)
            n = sum(len(row) for rows in work.values() for row in rows)
            if n >= THREAD_PACK_FROM:
                batches, built = await asyncio.to_thread(self._pack_step, step, pieces, work,
                                                         tokens)
                if self._closed:  # (meanwhile: what it holds was dropped, nothing to post)
                    return
            else:
                batches, built = self._pack_step(step, pieces, work, tokens)
            self.tokens_built += built
            for dp, packed in batches:
                # ranks that already have this step (they read it from a replaced planner's
                # constructors) are not sent it and not waited for
                waiting = {r for r in self.members[dp] if step > self._had.get(r, -1)}
                if waiting:
                    self._ready[(step, dp)] = packed
                    self._unclaimed[(step, dp)] = waiting
                    self._unclaimed_steps[dp][step] = None
                    for r in waiting:
                        posts[r].append(step)
                else:
                    await self._done(step, dp)
            self.batches_built += len(work)
        self.fetch_seconds += t1 - t0
        self.build_seconds += time.perf_counter() - t1
        self.rounds_built += 1
        for r, posted in posts.items():
            self._rounds[r].append(posted)
            self.published[r] += len(posted)
            self.rounds_posted += 1
            event = self._posted.get(r)
            if event is not None:
                event.set()

    def _pack_step(self, step: int, pieces: StepPieces, work: dict[int, Any],
                   tokens: dict[tuple[int, int, int, int], np.ndarray]
                   ) -> tuple[list[tuple[int, dict[str, Any]]], int]:
        """The batches of ``step``'s DP ranks (``work``: dp -> rows of pieces), packed from
        the fetched ``tokens``: ``([(dp, batch)], tokens built)``.  Reads the actor's
        fixed settings alone, so it may run in a thread."""
        cost_of = dict(zip(pieces.dps.tolist(), pieces.costs.tolist(), strict=True))
        out = []
        built = 0
        for dp, rows in work.items():
            packed_rows = []
            docs = []
            epochs = []
            for m, row in enumerate(rows):
                packed_rows.append([(tokens[(step, dp, m, j)], it[6] - it[5])
                                    for j, it in enumerate(row)])
                docs.append([(it[0], it[8], it[7]) for it in row])
                epochs.append([it[2] for it in row])
            try:
                packed = pack_rows(packed_rows, self.seq_len, self.pad_id)
            except PieceError as e:  # (a piece of other tokens than planned: say whose)
                source, key, chunk = docs[e.row][e.piece]
                raise RuntimeError(f"step {step}, DP rank {dp}, {e}: source {source!r}, "
                                   f"document {key!r}, chunk {chunk}") from e
            built += sum(n for row in packed_rows for _, n in row)
            packed.update(step=step, dp=dp, documents=docs, epochs=epochs, cost=cost_of[dp])
            out.append((dp, packed))
        return out, built

    async def _fetch(self, source: str, slot: int, requests: np.ndarray) -> list[np.ndarray]:
        """Fetch from a loader slot; if its loader is lost or retired, retry on the actor
        the planner puts in that slot (:meth:`set_loaders`) until ``timeout``."""
        from distributed.actor import Actor

        from msd_dask.errors import DataError
        from msd_dask.roles.loader import SourceLoader

        deadline = time.monotonic() + self.timeout
        while True:
            loader = self.loaders[source][slot]

            async def call(h: Any) -> Any:
                # a lost actor's handle raises on access; a loader on this worker is
                # called directly (msd_dask.roles.direct), one on another worker sends
                # its answer as one pickled bytes (SourceLoader.fetch_packed)
                target = direct(h)
                if not isinstance(target, Actor):
                    return await target.fetch(requests)
                return pickle.loads(await call_remote_actor(
                    target, SourceLoader.fetch_packed, requests.tobytes()))

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
                # (only while it has not answered: a loader that answered an error, again
                # and again, was said not to answer, its error, naming the file, lost; a
                # review)
                if not task.done() and time.monotonic() > deadline:
                    task.cancel()
                    raise RuntimeError(f"loader slot {source}#{slot} did not answer within "
                                       f"{self.timeout:.0f}s{await _reading(loader)}")
            if replaced or task.cancelled():
                continue
            e = task.exception()
            if e is None:
                return split_pieces(task.result())
            if isinstance(e, DataError):
                raise e
            if time.monotonic() > deadline:
                raise RuntimeError(f"loader slot {source}#{slot} answered with an error for "
                                   f"{self.timeout:.0f}s, the last: {type(e).__name__}: "
                                   f"{e}") from e
            await asyncio.sleep(0.25)

    # ----------------------------------------------------------------- claims
    async def next_round(self, rank: int, done: int = -1,
                         view: tuple[int, int, int, int] = (0, 1, 0, 1),
                         report_after: float | None = None, wait: float = POLL,
                         ranks: list[int] | None = None,
                         returned: int | None = None,
                         claimant: Sequence[str] | None = None) -> dict[str, Any] | None:
        """Global ``rank``'s next round: the batches of its steps after ``done``.

        Waits up to ``wait`` seconds for a round to be posted to the rank; ``None``
        if none was.  A round's steps the rank already has (``done``: it read them
        before a restart, or from a replaced constructor) are released without
        being sent; a round with no step left is passed over.  Once every round
        posted to the rank was asked for, a failed planner or constructor, or a
        service closed by its owner, answers ``{"error": message, "g"}``.  A claim
        whose ``done`` is before the end of the last round handed to ``rank`` and not
        before its start (that answer never reached the reader) gets the round's
        steps after ``done`` again; any other claim whose ``done`` (0 or more) is
        before the last step handed to ``rank`` (the rank restarted from an older
        state: those steps are gone) is answered ``{"handed": that step, "g"}`` at once.

        Returns
        -------
        dict or None
            ``{"steps": [...], "g": generation, "payloads": [...]}``, each payload as
            :func:`~msd_dask.core.packing.to_wire` sends it
            (:func:`~msd_dask.core.packing.from_wire`); each member rank is handed a
            step once.

        ``view`` is the rank's ``(cp_rank, cp, pp_rank, pp)``: context-parallel
        ranks get their slice of every row, pipeline stages only the tensors
        they need (:func:`msd_dask.core.mesh.view_for_rank`).  ``report_after``: the
        seconds after which the rank's reader reports the last step it returned once
        its training loop stops asking (:data:`msd_dask.reader.REPORT_IDLE`).
        ``ranks``: more ranks of ``rank``'s DP group that take the round with it, sent
        once (a host agent reading for the tensor-parallel ranks of its host); they
        share its ``view`` and ``done``.

        ``returned``: the last step every rank of the call returned (``-1``: none), when
        that is not the step before the round: a host agent claims rounds ahead of its
        ranks and sends the last step they all took
        (:class:`~msd_dask.service.agent.AgentGroupReader`).  By default a claim tells
        this actor the ranks returned every step before the round (a reader claims a
        round once it returned the one before).

        ``claimant``: the reader's process and Dask client, ``("host:pid", client id)``
        (:func:`~msd_dask.reader.claimant_of`).  The last round is sent again to another
        process only once the client of the one that took it is gone (a restarted rank):
        while it is connected, the claim is answered ``{"error": ...}`` naming both (a
        second handle of the same process, another client, is served).
        Two processes reading one rank at once (a global rank computed from
        ``LOCAL_RANK`` on two hosts) both got every step, each answer taken for the other's
        lost one, and trained on the same batches without a word (a review).
        """
        from msd_dask.core.mesh import check_view, view_for_rank

        # (before anything is handed over: a view view_for_rank refused, after the round's
        # steps were marked handed, lost them for the rank; a review)
        check_view(self.seq_len, *view)
        rank = int(rank)
        # (a list when the call came as a message)
        holding = None if claimant is None else (str(claimant[0]), str(claimant[1]))
        others = [int(r) for r in ranks or () if int(r) != rank]
        done = max(int(done), self._had.get(rank, -1))  # what it told this actor it has
        deadline = time.monotonic() + wait
        if self._closed and self._notice is not None:
            return {"error": self._notice, "g": self.generation}
        dp = self._dp_of(rank)
        for r in others:
            if self._dp_of(r) != dp:
                raise KeyError(f"rank {r} is not in the DP group of rank {rank} (DP rank {dp})")
        group = [rank, *others]
        for r in group:
            self._show(r, done)
        if report_after is not None:
            for r in group:
                self.report_after[r] = float(report_after)
        claim = self._claims[rank] = self._claims.get(rank, 0) + 1
        posted = self._posted.setdefault(rank, asyncio.Event())
        skip_by, claim_by = ("skip", "claim") if returned is None else ("taken", "taken")
        while True:
            if self._claims[rank] != claim:
                # the rank claimed again (its connection failed while this call waited,
                # and Dask does not cancel a handler whose comm closed): the newer claim
                # takes the round
                return None
            # (each time: a claim of this rank that took a round while this one waited may
            # have answered nobody)
            again = self._lost_round(rank, done)
            if again is not None:
                holder = self._round_holder.get(rank)
                if (holding is not None and holder is not None and holder[0] != holding[0]
                        and await client_connected(holder[1])):
                    return {"error": two_readers(rank, holder, holding[0]),
                            "g": self.generation}
                steps, batches = again
                self._check_open()
                if holding is not None:
                    self._round_holder[rank] = holding
                self.rounds_resent += 1
                return {"steps": steps, "g": self.generation,
                        "payloads": [to_wire(view_for_rank(b, *view)) for b in batches]}
            handed = self.last_claimed.get(rank, -1)
            if done < handed:
                # the rank restarted from a state older than the steps handed to it (and
                # not a retry of its last round), or a new reader with no state came after
                # one that had steps: they are gone (each step is served once; serving the
                # next round would skip what the earlier reader held unread, silently).
                # Said at once, whatever is posted: a round would wait for room, which
                # may wait for the other DP groups' ranks
                return {"handed": handed, "g": self.generation}
            rounds = self._rounds.get(rank)
            while rounds:
                steps = rounds.popleft()
                had = [s for s in steps if s <= done]
                for s in had:
                    for r in group:
                        await self._release((s, dp), r)
                if had:
                    for r in group:
                        self._drop_posted(r, had[-1])
                        self._raise_returned(r, _at_most(had[-1], returned), skip_by)
                steps = [s for s in steps if s > done]
                if not steps:
                    continue
                self._check_open()
                missing = [s for s in steps if rank not in self._unclaimed.get((s, dp), ())]
                if missing:
                    raise KeyError(f"step(s) {missing} of rank {rank} are not held by "
                                   f"constructor {self.index} (already claimed)")
                # the rank returned every step before this round (it asks when it has none
                # left), unless the caller says it returned less (an agent reads ahead)
                through = _at_most(steps[0] - 1, returned)
                for r in group:
                    self._raise_returned(r, through, claim_by)
                batches = [await self._hand_over((s, dp), group) for s in steps]
                # (kept before the answer is made: one that fails to be made is sent again
                # at the rank's next claim, as one lost on its way)
                self._last_round[rank] = (steps, batches)
                if holding is not None:
                    self._round_holder[rank] = holding
                payloads = [to_wire(view_for_rank(b, *view)) for b in batches]
                self.batches_sent += len(payloads)
                for r in others:
                    self._drop_posted(r, steps[-1])
                return {"steps": steps, "g": self.generation, "payloads": payloads}
            notice = self._error or self._notice
            if notice is not None:
                return {"error": notice, "g": self.generation}
            self._check_open()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            posted.clear()
            try:
                await asyncio.wait_for(posted.wait(), left)
            except TimeoutError:
                pass

    async def next_round_packed(self, rank: int, done: int = -1,
                                view: tuple[int, int, int, int] = (0, 1, 0, 1),
                                report_after: float | None = None, wait: float = POLL,
                                ranks: list[int] | None = None,
                                returned: int | None = None,
                                claimant: Sequence[str] | None = None) -> bytes:
        """:meth:`next_round`'s answer pickled into one ``bytes``: what a reader asks for.

        A Dask message measures the size of every object of an answer and serialises
        each array on its own, with a header of its own; one ``bytes`` costs both ends
        a fraction of that (the copy of the tensors into it is cheap).
        """
        answer = await self.next_round(rank, done, view, report_after, wait, ranks, returned,
                                       claimant)
        return pickle.dumps(answer, protocol=5)

    def _lost_round(self, rank: int, done: int) -> tuple[list[int], list[dict[str, Any]]] | None:
        """The steps after ``done`` of the last round handed to ``rank``, and their batches,
        where its claim says it has every step before that round and not all of the round:
        the answer never reached it (its connection failed after this actor answered), so
        its reader asks again.  ``None`` otherwise; once ``rank`` has the whole round, the
        round is forgotten."""
        self._forget_rounds_through(rank, done)
        last = self._last_round.get(rank)
        if last is None:
            return None
        steps, batches = last
        if done < steps[0] - 1:  # a reader that starts over (e.g. restarted): not a retry
            return None
        return ([s for s in steps if s > done],
                [b for s, b in zip(steps, batches, strict=True) if s > done])

    def _forget_rounds_through(self, rank: int, step: int) -> None:
        """``rank`` has every step up to ``step``: its last round, if that is all of it, is
        not sent again."""
        last = self._last_round.get(rank)
        if last is not None and step >= last[0][-1]:
            del self._last_round[rank]

    async def notify(self, message: str) -> None:
        """Tell every member rank ``message`` (an error) once it has its rounds posted here."""
        self._notice = message
        self._wake_all()

    def _drop_posted(self, rank: int, through: int) -> None:
        """Forget the steps up to ``through`` posted to ``rank`` (another rank of its group
        took them for it)."""
        rounds = self._rounds.get(rank)
        while rounds and rounds[0][-1] <= through:
            rounds.popleft()
        if rounds and rounds[0][0] <= through:
            rounds[0] = [s for s in rounds[0] if s > through]

    def _wake_all(self) -> None:
        for event in self._posted.values():
            event.set()

    async def _release(self, key: tuple[int, int], rank: int) -> None:
        """``rank`` has the batch ``key`` (step, dp) already: stop holding it for the rank."""
        waiting = self._unclaimed.get(key)
        if waiting is not None and rank in waiting:
            waiting.discard(rank)
            self.claimed[rank] += 1
            self.last_claimed[rank] = max(self.last_claimed.get(rank, -1), key[0])
            if not waiting:
                await self._done(*key)

    async def returned_through(self, rank: int, step: int,
                               ranks: list[int] | None = None) -> None:
        """``rank``'s reader returned every step up to ``step`` and then paused (it reports
        when its training loop has not asked for a batch for ``REPORT_IDLE`` seconds);
        ``ranks``: every rank it reads for (see :meth:`next_round`)."""
        group = [int(r) for r in ranks or (rank,)]
        if any(r in self._dp_by_rank for r in group):
            self.reports += 1
        for r in group:
            if r in self._dp_by_rank:
                self._raise_returned(r, int(step), "pause")
                self._forget_rounds_through(r, int(step))
                self._show(r, int(step))

    def _raise_returned(self, rank: int, step: int, by: str) -> None:
        """``rank`` returned every step up to ``step`` (learnt from a ``by``).  A report
        that arrives after a claim of the same step (sent before the reader resumed)
        does not hide the claim; an agent's claim of the same step as a report (it
        reads ahead while its ranks stay paused) does not hide the report, and a report
        hides such a claim."""
        known = self.returned.get(rank, -1)
        if step > known or step == known and (
                by in ("claim", "skip") or by == "pause" and self.returned_by.get(rank) == "taken"):
            self.returned[rank] = step
            self.returned_by[rank] = by

    async def mark_had(self, rank: int, step: int) -> None:
        """``rank`` already has every step up to ``step``: release them for it, now and
        when they are built, and do not send them to it.

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
        self._show(rank, step)
        self._forget_rounds_through(rank, step)
        # only the batches of the rank's DP group wait for it (the groups are disjoint)
        for key, waiting in [((s, dp), self._unclaimed[(s, dp)])
                             for s in self._unclaimed_steps.get(dp, ())]:
            if key[0] <= step and rank in waiting:
                waiting.discard(rank)
                self.claimed[rank] += 1  # (published to it: its queue depth counts it)
                if not waiting:
                    await self._done(*key)

    async def mark_had_all(self, had: dict[int, int]) -> None:
        """:meth:`mark_had` of each ``{rank: step}`` of ``had`` (its ranks of this
        constructor): what the constructor this one replaces saw the ranks show
        (:meth:`steps_shown`)."""
        for rank, step in had.items():
            await self.mark_had(rank, step)

    def _show(self, rank: int, step: int) -> None:
        if step > self._shown.get(rank, -1):
            self._shown[rank] = step

    async def steps_shown(self) -> dict[int, int]:
        """``{rank: step}``: the last step each rank showed this constructor it has (its
        claims' ``done``, its reports): it has every step up to it for sure.  Not the
        steps last handed to it, whose answer may never have reached it.

        A constructor moved to another worker is closed, then asked this, and its
        successor told (:meth:`mark_had_all`): the steps the planner re-sends to the
        successor, which the ranks took from this one meanwhile, are not held there for
        them, taking the room of the next round (a rank that read on from this one and
        one that had moved to the successor waited for each other until the timeout).
        """
        return dict(self._shown)

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

    async def _hand_over(self, key: tuple[int, int], ranks: list[int]) -> dict[str, Any]:
        """Mark the built batch ``key`` (step, dp) claimed by each of ``ranks`` and return it."""
        self._check_open()  # closed while a claim of several steps awaited room
        out = self._ready[key]
        for rank in ranks:
            await self._release(key, rank)
        return out

    async def stats(self) -> dict[str, Any]:
        """Per-rank queue depth (published, not claimed), build timings, errors."""
        return {
            "index": self.index,
            "held_steps": len(self._held_steps),
            "queue_depth": {r: self.published[r] - self.claimed[r]
                            for rs in self.members.values() for r in rs},
            "last_claimed": dict(self.last_claimed),
            # the last step each rank showed it has (see steps_shown)
            "shown": dict(self._shown),
            "returned": dict(self.returned),
            "returned_by": dict(self.returned_by),
            "report_after": dict(self.report_after),
            "reports": self.reports,
            "batches_built": self.batches_built,
            "rounds_built": self.rounds_built,
            "rounds_posted": self.rounds_posted,
            "batches_sent": self.batches_sent,
            "rounds_resent": self.rounds_resent,
            "tokens_built": self.tokens_built,
            "fetch_seconds": self.fetch_seconds,
            "build_seconds": self.build_seconds,
            "error": self._error,
            "closed": self._closed,
            "generation": self.generation,
            "replacing": self.replacing,
            "fetching": self._fetching,
            # held steps and the ranks that have not claimed them yet
            "unclaimed": {f"{st}/{dp}": sorted(rs) for (st, dp), rs in self._unclaimed.items()},
        }

    async def close(self, notice: str | None = None) -> None:
        """Stop building, drop the batches held and the loader handles (they keep the
        loaders' keys alive).

        Without ``notice`` (the service replaced this constructor), readers waiting
        here, or asking later, get ``RuntimeError`` and switch to the service's
        current constructor; with it (the owner closed the service), they are
        answered ``{"error": notice}``.
        """
        if notice is not None:
            self._notice = notice
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        self.loaders = {}
        self._ready.clear()
        self._last_round.clear()
        self._unclaimed.clear()
        self._unclaimed_steps.clear()
        self._wake_all()
        if self._room is not None:  # a planner waiting for room here goes on
            async with self._room:
                self._room.notify_all()
