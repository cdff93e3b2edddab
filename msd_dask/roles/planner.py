"""The Planner role on the cluster: a Dask actor driving the pure :class:`~msd_dask.core.plan.Planner`.

It assigns units to loaders ahead of the stream, gathers their lengths,
plans rounds of ``round_steps`` steps and hands every constructor the pieces of
its DP ranks.  Constructors accept at most ``prefetch`` unclaimed steps, so
planning runs at most ``prefetch + 1`` steps ahead of the slowest reader's last
claim (readers claim whole rounds: ``prefetch + round_steps`` after the last
step it returned).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from msd_dask.batch import MAX_PREFETCH
from msd_dask.core.config import parse_config
from msd_dask.core.figures import RANKS_LISTED, rank_columns, rank_figures, rank_summary
from msd_dask.dask_internals import STATS_SHARED
from msd_dask.errors import ConfigError, DataError, ServiceError, ServiceTimeoutError
from msd_dask.roles.constructor import StepPieces, pack_works
from msd_dask.roles.direct import direct
from msd_dask.roles.kept_work import KeptWork, local_directory

if TYPE_CHECKING:
    from msd_dask.core.plan import Planner, PlannerSnapshot, StepPlan
    from msd_dask.core.stream import MetaLookup

# The planner's own modules (plan, stream, the role supervisor and the loader module it
# imports, storage: fsspec, zstandard) are imported where the actor runs, not here: a
# training process unpickling this actor's handle imports this module, and every module
# costs each of them memory (tests/unit/test_imports.py).

__all__ = ["PlannedStep", "PlannerActor", "STATE_FORMAT", "ahead_within", "make_state",
           "pack_snapshot", "plan_for_constructors", "planner_state", "unpack_snapshot"]

_log = logging.getLogger("msd_dask.roles.planner")

_T = TypeVar("_T")

#: Version tag of :meth:`DataService.state_dict`'s output.
STATE_FORMAT = "msd_dask.state/1"


#: the planner's counts after a step: the next step, tokens and pieces of each source
Counts = tuple[int, dict[str, int], dict[str, int]]


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """A step as the planner's actor keeps it from its planning until the round is handed
    over (:func:`plan_for_constructors`): no plan, no unpacked work and no snapshot, which
    are each up to 160 MiB at dp 16,384 x 128K."""

    step: int
    #: its pieces
    pieces: int
    #: the units it reads
    used: set[tuple[str, int, int]]
    #: its history record
    record: dict[str, Any]
    #: each DP rank's (ΣL, ΣL²), for the cost fitter (None: not fitted)
    features: np.ndarray | None
    #: the planner's state after it (:func:`_packed_state`)
    after: tuple[Counts, bytes]
    #: each constructor's work, packed (:func:`~msd_dask.roles.constructor.pack_works`;
    #: None: in ``kept``'s file alone, read back to hand the round over)
    work: list[bytes] | None
    #: the work as the actor keeps it until every rank has received the step, in a file
    #: where it is large (:class:`~msd_dask.roles.kept_work.KeptWork`; None: as ``work``)
    kept: KeptWork | None = None


#: seconds :meth:`PlannerActor.state_at` waits for a step of the next round to be planned
STATE_WAIT = 30.0

#: each DP group's first step-time reports after a planner starts, which the cost fit sets
#: aside: a job's first steps compile and warm up (:meth:`PlannerActor.report_step_time`)
WARMUP_REPORTS = 2


def make_state(cfg: Any, step: int, planner: dict[str, Any],
               units: Mapping[str, int] | None = None,
               tokenizer: str | None = None, eod_id: int | None = None) -> dict[str, Any]:
    """The service state after ``step``: a versioned, JSON-able wrapper of a planner state,
    with what the stream order depends on besides the seed: each source's ``units`` (how
    many), ``shuffle_window``, how its documents are read and the tokenizer file's
    SHA-256 (``tokenizer``, :attr:`~msd_dask.sources.tokenizer.Tokenizer.sha256`, where
    the caller has it) (:func:`planner_state` checks them).  ``eod_id``: the tokenizer's
    end-of-document id, where the caller has the tokenizer (see :func:`reading`)."""
    state = {"format": STATE_FORMAT, "name": cfg.name, "seed": cfg.seed,
             "seq_len": cfg.batch.seq_len, "sources": [s.name for s in cfg.sources],
             "shuffle_window": {s.name: s.shuffle_window for s in cfg.sources},
             "reading": reading(cfg, eod_id), "weights": config_weights(cfg), "step": int(step),
             "planner": planner}
    if units is not None:
        state["units"] = {k: int(v) for k, v in units.items()}
    if tokenizer is not None:
        state["tokenizer_sha256"] = tokenizer
    return state


def config_weights(cfg: Any) -> dict[str, Any]:
    """Each source's ``weight`` as the config writes it (a number or a schedule's points),
    which a state records so that a resume under other weights is said
    (:func:`resume_notes`)."""
    return {s.name: s.weight.to_yaml() for s in cfg.sources}


def kept_states(cfg: Any) -> int:
    """How many of the last steps' states the planner's actor keeps at least (for
    ``state_dict(step)`` and its owner's checkpoints): ``prefetch + 2 × round_steps +``
    :data:`~msd_dask.batch.MAX_PREFETCH` (the most a dataset prefetches).  It keeps
    more, up to :data:`KEPT_AT_MOST` times as many, while ranks have not returned them
    (:meth:`PlannerActor.checkpoint` learns what they returned)."""
    return int(cfg.prefetch + 2 * cfg.steps_per_round + MAX_PREFETCH)


#: how many times :func:`kept_states` the planner's actor keeps at most: the states of the
#: steps from :data:`~msd_dask.batch.MAX_PREFETCH` before the last step every rank
#: returned on are kept while they are fewer (a host agent whose ``--prefetch`` is larger
#: than the service's reads that far ahead of its ranks, and its state of step 2 was gone
#: while its ranks were at step 2; a review)
KEPT_AT_MOST = 4


def agent_prefetch_limit(cfg: Any) -> int:
    """The most steps a host agent may read ahead of its ranks (``msd-dask agent
    --prefetch``): the planner plans ``prefetch + round_steps`` past what the agent read,
    and keeps the states back to :data:`~msd_dask.batch.MAX_PREFETCH` before what its
    ranks took up to :data:`KEPT_AT_MOST` times :func:`kept_states` (78 at ``prefetch``
    4), so the state of every step a rank's loop may be at stays held."""
    return int((KEPT_AT_MOST - 1) * kept_states(cfg))


#: each source's settings that decide its documents' lengths in tokens, besides its files
READING_KEYS = ("format", "text_field", "image_field", "image", "preprocess")


#: the tokenizer's settings that do not decide the documents' lengths (:func:`reading`)
_NOT_READING = ("path", "storage_options", "pad_id")


def reading(cfg: Any, eod_id: int | None = None) -> dict[str, Any]:
    """What decides the documents' lengths, and so where a stream's position points: the
    tokenizer's kind and ids (but the padding id) and each source's :data:`READING_KEYS`,
    as the config says them (another tokenizer file of the same kind, or one changed in
    place, is not seen); ``eod_id``, where given, in place of the config's ``eod_id``: the
    id the tokenizer ends documents with, which an ``hf`` tokenizer without one in the
    config takes from its file's special tokens."""
    import json

    d = cfg.to_dict()
    # the tokenizer's kind and ids: not where its file is, nor the credentials to read it
    # (which rotate, and would be written into every state), nor the padding id (it fills
    # the rows' free tokens and counts in no document)
    tokenizer = {k: v for k, v in d["tokenizer"].items() if k not in _NOT_READING}
    if eod_id is not None:
        tokenizer["eod_id"] = int(eod_id)
    # (as JSON has it: a state is compared after a round trip through JSON)
    return json.loads(json.dumps(
        {"tokenizer": tokenizer,
         "sources": {s["name"]: {k: s.get(k) for k in READING_KEYS} for s in d["sources"]}}))


def _reading_differs(was: Any, now: dict[str, Any], configured: dict[str, Any]) -> str | None:
    """The first key whose setting differs between a state's ``reading`` and ``now``'s (the
    tokenizer's ids where known: :func:`reading`), said as the config names it, with both
    values; None if none does.  ``configured``: the config's own (:func:`reading` without
    the tokenizer's ids), which a state of a version that recorded the config's
    ``eod_id`` is compared with."""
    tokenizer = (was.get("tokenizer") or {}) if isinstance(was, dict) else None
    sources = (was.get("sources") or {}) if isinstance(was, dict) else None
    if (not isinstance(tokenizer, dict) or not isinstance(sources, dict)
            or not all(isinstance(v, dict) for v in sources.values())):
        return f"a 'reading' that is not one of a state_dict() ({was!r})"
    # (a state of a version that recorded the padding id too: not compared)
    for k in sorted((set(tokenizer) | set(now["tokenizer"])) - set(_NOT_READING)):
        a, b = tokenizer.get(k), now["tokenizer"].get(k)
        if k == "eod_id" and a is None:
            # a state of a version that recorded the config's (none: the file's): compared
            # with the config's as it was (a spelled-out id other than the file's was
            # refused; a read-back)
            b = configured["tokenizer"].get(k)
        elif k == "eod_id" and b is None:
            # none: the one of the file's special tokens, known only where the tokenizer was
            # made (the planner's actor is given it), not to the config; one spelled out
            # there equal to the file's was refused (a review).  The file itself is checked
            # by its SHA-256
            continue
        if a != b:
            return f"tokenizer.{k} {a!r} but the config has {b!r}"
    index = {name: i for i, name in enumerate(now["sources"])}
    for name, settings in now["sources"].items():
        had = sources.get(name)
        if had is None:
            continue  # (the sources themselves are checked on their own)
        for k in READING_KEYS:
            if had.get(k) != settings.get(k):
                return (f"sources[{index[name]}].{k} {had.get(k)!r} (source {name!r}) but the "
                        f"config has {settings.get(k)!r}")
    return None


def ahead_within(tokens: list[float | None], cap: float) -> int:
    """How many of the units after the current shuffle window to keep read ahead.

    Parameters
    ----------
    tokens : list of float or None
        The tokens of each unit after the window, in stream order (``None``: not
        known yet, not even as an estimate).
    cap : float
        The source's ``read_ahead_tokens``.

    Returns
    -------
    int
        The longest prefix whose tokens sum to at most ``cap``, and at least 1
        (when there is a unit) so the loaders always read ahead of the planner;
        an unknown unit ends the prefix (it is assigned once its size is estimated).
    """
    n, total = 0, 0.0
    for t in tokens:
        if n and (t is None or total + t > cap):
            break
        n += 1
        if t is None:  # the tokens held so far are not known: nothing more
            break
        total += t
    return n


def planner_state(cfg: Any, state: dict[str, Any],
                  units: Mapping[str, int] | None = None,
                  tokenizer: str | None = None, eod_id: int | None = None) -> dict[str, Any]:
    """Check a resume ``state`` against ``cfg`` (and each source's ``units``, how many, the
    tokenizer file's SHA-256, ``tokenizer``, and its end-of-document id, ``eod_id``, where
    the caller has them: the planner's actor does) and return its planner state.

    Raises
    ------
    ServiceError
        For an unknown format, a malformed state, a different seed, ``seq_len``, set of
        sources, ``shuffle_window``, number of units of a source, tokenizer or source
        setting that decides the documents' lengths (:func:`reading`), or tokenizer file
        (a state of a version that did not record the last four is not checked for them).
    """
    if not isinstance(state, dict) or "planner" not in state or "format" not in state:
        raise ServiceError("resume: not a DataService.state_dict() (no 'format'/'planner' key)")
    if state["format"] != STATE_FORMAT:
        raise ServiceError(f"resume: state format {state['format']!r} is not supported "
                           f"(this version reads {STATE_FORMAT!r})")
    missing = sorted({"seed", "seq_len", "sources"} - state.keys())
    if missing or not isinstance(state["planner"], dict):
        lacks = f"lacks {missing}" if missing else "has no 'planner' mapping"
        raise ServiceError(f"resume: the state {lacks}: not a whole DataService.state_dict()")
    lacking = sorted(_PLANNER_KEYS - state["planner"].keys())
    if lacking:
        raise ServiceError(f"resume: the state's 'planner' mapping lacks {lacking}: not a whole "
                           "DataService.state_dict()")
    for key in ("seed", "seq_len", "step"):
        if isinstance(state.get(key), bool) or not isinstance(state.get(key), int):
            raise ServiceError(f"resume: the state's {key!r} is {state.get(key)!r}, not an "
                               "integer")
    inner = state["planner"]["step"]
    if isinstance(inner, bool) or not isinstance(inner, int) or inner != state["step"] + 1:
        raise ServiceError(f"resume: the state is of step {state['step']} but its planner's "
                           f"next step is {inner!r}, not {state['step'] + 1}: not one "
                           "DataService.state_dict()")
    if (not isinstance(state["sources"], list)
            or not all(isinstance(s, str) for s in state["sources"])):
        raise ServiceError(f"resume: the state's 'sources' is {state['sources']!r}, not a list "
                           "of source names")
    if int(state["seed"]) != cfg.seed:
        raise ServiceError(f"resume: the state was taken with seed {state['seed']} (service "
                           f"{state.get('name')!r}) but the config has seed {cfg.seed}; the "
                           "stream order depends on the seed, so it cannot continue exactly")
    if int(state["seq_len"]) != cfg.batch.seq_len:
        raise ServiceError(f"resume: the state was taken with batch.seq_len {state['seq_len']} "
                           f"but the config has {cfg.batch.seq_len} (documents are chunked by it)")
    names = [s.name for s in cfg.sources]
    if sorted(state["sources"]) != sorted(names):
        raise ServiceError(f"resume: the state has sources {sorted(state['sources'])} but the "
                           f"config has {sorted(names)}")
    if state["sources"] != names:
        # (the mix breaks its ties and sums its weights in the sources' order: another order
        # was taken without a word and planned other steps; a review)
        i = next(i for i, (a, b) in enumerate(zip(state["sources"], names, strict=True))
                 if a != b)
        raise ServiceError(f"resume: sources[{i}] is {names[i]!r} but the state's is "
                           f"{state['sources'][i]!r} (the state's order: {state['sources']}); "
                           "the mix depends on the sources' order, so it cannot continue "
                           "exactly: list them in the state's order")
    from msd_dask.core.plan import state_cost, state_overrides

    # (what the owner reads of the planner's state before the planner takes it: a malformed
    # one gave a bare IndexError or TypeError from resume_notes; a review)
    # (as the planner reads them, Planner.load_state_dict: a None, or a change of a source
    # the config does not have, passed here and failed there, after a note; a review)
    try:
        if "cost" in state["planner"]:
            state_cost(state["planner"]["cost"], cfg.batch.seq_len)
        state_overrides(state["planner"]["overrides"], cfg, inner)
    except ValueError as e:
        raise ServiceError(f"resume: the state's planner.{e}") from None
    for key in ("shuffle_window", "units"):  # (mappings of a count per source, where given)
        given = state.get(key)
        if given is None:
            continue
        if not isinstance(given, dict):
            raise ServiceError(f"resume: the state's {key!r} is {given!r}, not a mapping of "
                               "each source's count")
        for name, value in given.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ServiceError(f"resume: the state's {key}[{name!r}] is {value!r}, not an "
                                   "integer")
    for i, s in enumerate(cfg.sources):
        was = (state.get("shuffle_window") or {}).get(s.name)
        if was is not None and was != s.shuffle_window:
            raise ServiceError(
                f"resume: the state was taken with sources[{i}].shuffle_window {was} (source "
                f"{s.name!r}) but the config has {s.shuffle_window}; the stream order depends "
                "on it, so it cannot continue exactly")
        had, has = (state.get("units") or {}).get(s.name), (units or {}).get(s.name)
        if had is not None and has is not None and int(had) != int(has):
            raise ServiceError(
                f"resume: source {s.name!r} had {had} units (files' row groups or chunks) when "
                f"the state was taken and has {has} now ({s.uri}); the stream order depends on "
                "them, so it cannot continue exactly: resume with the same files")
    if "reading" in state:  # (a state of a version that did not record it: not checked)
        differs = _reading_differs(state["reading"], reading(cfg, eod_id), reading(cfg))
        if differs is not None:
            raise ServiceError(
                f"resume: the state was taken with {differs}; the documents' lengths depend "
                "on it and a stream's position counts pieces of them, so it cannot continue "
                "exactly (documents would be skipped or served twice)")
    had = state.get("tokenizer_sha256")
    if had is not None and tokenizer is not None and had != tokenizer:
        raise ServiceError(
            f"resume: the state was taken with a tokenizer file of SHA-256 {str(had)[:12]}…, "
            f"but tokenizer.path {cfg.tokenizer.path!r} now holds one of {tokenizer[:12]}… "
            "(changed in place?); the documents' lengths depend on it and a stream's "
            "position counts pieces of them, so it cannot continue exactly: resume with the "
            "tokenizer file the state was taken with")
    return dict(state["planner"])


def resume_notes(cfg: Any, state: Mapping[str, Any]) -> list[str]:
    """What a resume from ``state`` (checked by :func:`planner_state`) keeps of the state
    where the config says otherwise: the cost model it planned with, and its live weight
    changes, which stay in force over the config's weights.  Both keep the resume exact;
    a user who changed the config to change them is told (the service logs these)."""
    notes = []
    planner = state["planner"]
    cost = planner.get("cost")
    if cost is not None and not (
            math.isclose(float(cost[0]), cfg.cost.linear, rel_tol=1e-9)
            and math.isclose(float(cost[1]), cfg.cost.quadratic, rel_tol=1e-9)):
        # (with cost.fit too: the fit starts from the state's model, the config's was never
        # used, and a changed cost.model went without a word; a review)
        what = ("the cost fit starts from the state's model" if cfg.cost.fit
                else "the state's cost model plans on")
        notes.append(f"resume: {what} (linear {float(cost[0]):g}, quadratic "
                     f"{float(cost[1]):g}), not the config's (linear "
                     f"{cfg.cost.linear:g}, quadratic {cfg.cost.quadratic:g}): the steps after "
                     "the state are planned as they were (start without resume to plan with "
                     "the config's)")
    from msd_dask.core.plan import state_overrides

    first = int(state["step"]) + 1
    overrides = state_overrides(planner.get("overrides", []), cfg, first)
    # the live change in force at the first step resumed, if any (the last from before it)
    in_force = [(start, w) for start, w in overrides if start <= first][-1:]
    # (a state of a version that did not record them: nothing said)
    was = state.get("weights")
    if isinstance(was, dict):
        now = config_weights(cfg)
        changed = [f"sources[{i}].weight {was[name]!r} -> {now[name]!r} (source {name!r})"
                   for i, name in enumerate(now) if name in was and was[name] != now[name]]
        if changed and in_force:  # (it was said to change the mix, which it did not; a review)
            notes.append(f"resume: the config's weights differ from the state's "
                         f"({'; '.join(changed)}) but do not change the mix: the state's live "
                         f"weight change of step {in_force[0][0]} is in force over them")
        elif changed:
            notes.append(f"resume: the config changes the mix from step {first} "
                         f"on: {'; '.join(changed)} (the steps up to the state's were planned with "
                         "the state's)")
    if overrides:
        start, weights = overrides[-1]
        notes.append(f"resume: the state's live weight change of step {start} ({weights}) stays "
                     "in force over the config's weights; set_weights() changes the mix "
                     "again")
    return notes


#: the keys of a planner's state_dict() a resume needs (Planner.load_state_dict)
#: (``held`` too: a state without it was taken, and every held outlier lost; a review)
_PLANNER_KEYS = frozenset({"step", "streams", "mixer", "carry", "held", "overrides", "tokens",
                           "pieces", "cost"})


def split_plan(plan: StepPlan, n: int, owner: Mapping[tuple[str, int, int], int],
               relpath: Mapping[str, Sequence[str]], names: Sequence[str]) -> list[StepPieces]:
    """The work of ``plan`` for each of ``n`` constructors (constructor ``i`` builds DP
    ranks ``i, i + n, ...``) as :class:`~msd_dask.roles.constructor.StepPieces`.

    ``owner``: (source, epoch, unit) -> the loader slot that reads it; ``relpath``: each
    source's units' paths relative to the source; ``names``: the sources.  In numpy from
    the plan's piece table: a loader slot and a path are looked up once per unit of the
    step, and the table is made once, in int32 where every value fits (each
    constructor's arrays are slices, views, of it).
    """
    from msd_dask.core.plan import distinct, unit_keys

    src = plan.table
    total = len(src)
    dp, mb = plan.row_sizes.shape
    # each constructor's DP ranks, in order, and where they start among its rows and pieces
    con_of_dp = np.arange(dp, dtype=np.int64) % n
    dps = np.argsort(con_of_dp, kind="stable").astype(np.int64)
    dp_bound = _bounds(con_of_dp, n)
    n_rows = np.full(dp, mb, dtype=np.int64)
    row_len = np.take(plan.row_sizes, dps, axis=0).reshape(-1).astype(np.int64)
    rank_len = plan.row_sizes.sum(axis=1, dtype=np.int64)
    ends = np.zeros(dp + 1, dtype=np.int64)
    np.cumsum(rank_len[dps], out=ends[1:])
    piece_bound = ends[dp_bound].tolist()
    # a DP rank's pieces follow each other in the plan's table: constructor by constructor
    # they are its runs in the order of ``dps`` (no sort); gathered piece ``j`` of rank
    # ``dps[k]`` is the plan's piece ``j + delta[k]``
    starts = np.zeros(dp, dtype=np.int64)
    np.cumsum(rank_len[:-1], out=starts[1:])
    delta = starts[dps] - ends[:-1]
    del starts
    # the plan's source indices follow its own source list; ours follow ``names``
    index = np.array([list(names).index(s) for s in plan.sources] if total else [],
                     dtype=np.int64)
    # an int32 plan table holds no value of 2**31 or more, and its gather finds whether it
    # holds a negative one (no pass over the plan's table before)
    wide = bool(total) and (len(names) >= 2**31 or (np.iinfo(src.dtype).max >= 2**31 and (
        src.min() < 0 or src.max() >= 2**31)))
    table = _gathered(src, ends, delta, index, wide)
    if table is None:  # a negative value in an int32 plan table
        wide = True
        table = _gathered(src, ends, delta, index, wide)
        assert table is not None  # (never None when wide)
    del ends, delta
    # each unit's loader slot and (source, unit) pair, once per unit: the step's pairs are
    # numbered in (source, unit) order
    first, unit_of = distinct(*unit_keys(table[:, 0], table[:, 2], table[:, 3]))
    units = table[first][:, [0, 2, 3]].astype(np.int64)
    slot_of = np.asarray([owner[(names[a], b, c)] for a, b, c in units.tolist()],
                         dtype=np.int64).reshape(-1).astype(table.dtype)
    span = int(units[:, 2].max()) + 1 if total else 1
    pairs, pair_of = np.unique(units[:, 0] * span + units[:, 2], return_index=True,
                               return_inverse=True)[1:]
    pair_of = pair_of.reshape(-1)
    paths_of = np.empty(len(pairs), dtype=object)
    paths_of[:] = [relpath[names[a]][b] for a, b in units[pairs][:, [0, 2]].tolist()]
    del units, first, pairs
    for a in range(0, total, _SLICE):
        unit = unit_of[a:a + _SLICE]
        table[a:a + _SLICE, 1] = slot_of[unit]
        np.take(pair_of, unit, out=unit)  # each piece's pair, in place of its unit
    pair = unit_of
    del unit_of
    # each constructor's paths: its pairs, numbered from 0 in (source, unit) order
    seen = np.zeros(len(paths_of), dtype=bool)
    number = np.zeros(len(paths_of), dtype=table.dtype)
    paths = []
    for i in range(n):
        p0, p1 = piece_bound[i], piece_bound[i + 1]
        mine = pair[p0:p1]
        seen[mine] = True
        used = seen.nonzero()[0]  # (once per constructor: flatnonzero's wrapper costs 4x more)
        seen[used] = False
        number[used] = np.arange(len(used))
        table[p0:p1, 8] = number[mine]
        paths.append(tuple(paths_of[used].tolist()))
    del pair
    if wide and table.min() >= 0 and table.max() < 2**31:
        table = table.astype(np.int32)
    n_rows = n_rows[dps]
    costs = np.asarray(plan.rank_cost, dtype=np.float64)[dps]
    sources = tuple(names)
    out = []
    for i in range(n):
        d0, d1, p0, p1 = dp_bound[i], dp_bound[i + 1], piece_bound[i], piece_bound[i + 1]
        out.append(StepPieces(dps=dps[d0:d1], rows=n_rows[d0:d1],
                              lengths=row_len[d0 * mb:d1 * mb], pieces=table[p0:p1],
                              sources=sources, paths=paths[i], costs=costs[d0:d1]))
    return out


#: pieces :func:`split_plan` gathers at a time
_SLICE = 1 << 15


def _gathered(src: np.ndarray, ends: np.ndarray, delta: np.ndarray, index: np.ndarray,
              wide: bool) -> np.ndarray | None:
    """:func:`split_plan`'s table of a plan's piece table ``src``, its columns gathered in the
    constructors' order, :data:`_SLICE` pieces at a time (gathered rows stay in cache; each
    slice's positions in ``src`` are made for it, not held for the whole step).

    ``ends``: where each DP rank's pieces end in that order (after a 0); ``delta``: what
    its pieces' positions in ``src`` add to their positions in that order; ``index``: the
    index in the caller's sources of each of the plan's.  int64 if ``wide``, else int32;
    None if not ``wide`` and ``src`` holds a negative value.
    """
    total = len(src)
    # column by column in memory: each column is written here as one run, and laid out
    # for the constructors (pack_works) as one run, not transposed
    table = np.empty((total, 9), dtype=np.int64 if wide else np.int32, order="F")
    same = np.array_equal(index, np.arange(len(index)))
    for a in range(0, total, _SLICE):
        b = min(a + _SLICE, total)
        # the DP ranks with pieces in [a, b), and how many each has there
        k0 = int(np.searchsorted(ends, a, "right")) - 1
        k1 = int(np.searchsorted(ends, b, "left"))
        run = np.minimum(ends[k0 + 1:k1 + 1], b) - np.maximum(ends[k0:k1], a)
        at = np.arange(a, b, dtype=np.int64)
        at += np.repeat(delta[k0:k1], run)
        rows = src.take(at, axis=0)
        if not wide and rows.min() < 0:
            return None
        part = table[a:b]
        part[:, 0] = rows[:, 0] if same else index[rows[:, 0]]
        for col, plan_col in ((2, 1), (3, 2), (4, 3), (5, 5), (6, 6), (7, 4)):
            part[:, col] = rows[:, plan_col]
    return table


def plan_for_constructors(planner: Planner, lookup: MetaLookup, constructors: int,
                          owner: Mapping[tuple[str, int, int], int],
                          relpath: Mapping[str, Sequence[str]], features: bool = False,
                          threads: int = 1, times: list[float] | None = None,
                          clock: Callable[[], float] = time.perf_counter) -> PlannedStep:
    """The next step of ``planner`` as the planner's actor plans it in its planning thread:
    planned (``plan_step``, which may raise ``NeedMetadata``), split into ``constructors``'
    work (:func:`split_plan`) and packed (:func:`~msd_dask.roles.constructor.pack_works`
    on ``threads`` of zstd's threads), with what the actor keeps of it
    (:class:`PlannedStep`), each of which takes a pass over its pieces: the units it
    uses, its history record, each DP rank's (ΣL, ΣL²) where ``features`` (for the cost
    fitter), and the planner's state after it (its counts, and the whole state packed).

    The step's plan, its unpacked work and the snapshot of the state go before this
    returns (at dp 16,384 x 128K a plan's table and its work are each up to 160 MiB);
    where the step is large, the C heap's free pages go back before the split and after
    the packing (:func:`~msd_dask.sources.heap.trim_after`).  ``scripts/bench_balance.py``
    measures this function.

    Parameters
    ----------
    owner, relpath
        As :func:`split_plan` takes them.
    times : list, optional
        Appended the seconds of its three parts: planning (with its units and record),
        splitting, packing the work and the state.
    clock : callable
        What ``times`` are measured by (default wall seconds; ``time.thread_time`` for the
        planning thread's CPU).
    """
    from msd_dask.sources.heap import trim_after

    t0 = clock()
    plan = planner.plan_step(lookup)
    used = plan.units()
    record = {
        "step": plan.step,
        "imbalance": plan.imbalance,
        "lower_bound": plan.lower_bound,
        "max_cost": max(plan.rank_cost),
        "tokens": plan.tokens_by_source(),
        "weights": plan.weights,
    }
    fitted = plan.rank_features() if features else None
    step, pieces, size = plan.step, len(plan.table), plan.table.nbytes
    t1 = clock()
    # what the placement freed goes back before the split, and the split's after the packing
    trim_after(size)
    work = split_plan(plan, constructors, owner, relpath, [x.name for x in planner.cfg.sources])
    del plan  # (its table: as large as the work's)
    t2 = clock()
    packed = pack_works(work, threads)
    del work
    # (split and packing change nothing of the planner's)
    after = _packed_state(planner.snapshot())
    trim_after(size)
    if times is not None:
        times += [t1 - t0, t2 - t1, clock() - t2]
    return PlannedStep(step, pieces, used, record, fitted, after, packed)


def _packed_state(snap: PlannerSnapshot) -> tuple[Counts, bytes]:
    """What the planner's actor keeps of its state after a step: the counts
    :meth:`PlannerActor.stats` shows (next step, tokens, pieces) and the whole state packed
    (:func:`pack_snapshot`), not the snapshot, which holds the step's carried and held
    pieces."""
    return (snap.step, snap.tokens, snap.pieces), pack_snapshot(snap)


def pack_snapshot(snap: PlannerSnapshot) -> bytes:
    """The planner's state after a step, packed as its actor keeps one per recent step
    (:meth:`PlannerActor.state_at`, :meth:`PlannerActor.checkpoint`); :func:`unpack_snapshot`
    gives it back.

    Its piece tables column by column, int32 where every value fits (a column of one
    source or epoch, or of chunk 0, compresses to almost nothing), pickled into a zstd
    stream (level 3; no pickled copy of the tables on the way): 1-5 MiB at dp 16,384 ×
    128K (4.2 where its tables row by row took 7.2), where its JSON form holds a list per
    carried and held piece.
    """
    import io
    import pickle

    import zstandard

    snap = dataclasses.replace(snap, carry=_by_column(snap.carry), held=_by_column(snap.held))
    out = io.BytesIO()
    with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as stream:
        pickle.dump(snap, stream, protocol=5)
    return out.getvalue()


def _by_column(table: np.ndarray) -> np.ndarray:
    """A piece table column by column (Fortran order), int32 where every value fits."""
    from msd_dask.core.stream import fits_int32

    return np.asfortranarray(table, dtype=np.int32 if fits_int32(table) else table.dtype)


def unpack_snapshot(packed: bytes) -> PlannerSnapshot:
    """What :func:`pack_snapshot` packed, its tables row by row again."""
    import io
    import pickle

    import zstandard

    with zstandard.ZstdDecompressor().stream_reader(packed) as stream:
        snap: PlannerSnapshot = pickle.load(io.BufferedReader(stream))
    return dataclasses.replace(snap, carry=np.ascontiguousarray(snap.carry),
                               held=np.ascontiguousarray(snap.held))


def _with_overrides(packed: bytes, overrides: tuple[tuple[int, dict[str, float]], ...]) -> bytes:
    """A packed :class:`~msd_dask.core.plan.PlannerSnapshot` with ``overrides`` (the live
    weight changes) in place of its own."""
    return pack_snapshot(dataclasses.replace(unpack_snapshot(packed), overrides=overrides))


async def _assign(units: list[tuple[int, int]], loader: Any) -> None:
    """Loader ``loader`` reads ``units`` ((epoch, unit) of its source) from now on."""
    await loader.assign(units)


async def _release(units: list[tuple[int, int]], loader: Any) -> None:
    """Loader ``loader`` lets go of ``units`` (another slot reads them now)."""
    await loader.release(units)


def _state_of(packed: bytes) -> dict[str, Any]:
    """The JSON form of a packed :class:`~msd_dask.core.plan.PlannerSnapshot`."""
    state: dict[str, Any] = unpack_snapshot(packed).to_state()
    return state


def _bounds(group: np.ndarray, n: int) -> list[int]:
    """Where each of groups ``0..n-1`` starts (and the end) in ``group`` sorted stably."""
    return [0, *np.cumsum(np.bincount(group, minlength=n)).tolist()]


class PlannerActor:
    """Dask actor holding the service's :class:`~msd_dask.core.plan.Planner` (``self.planner``).

    Parameters
    ----------
    config : dict
        ``Config.to_dict()`` of the service.
    units : dict
        ``{source: [(path, part, row_offset), ...]}``, sorted.
    roots : dict
        ``{source: root directory}``; document keys are file paths relative to it.
    state : dict or bytes, optional
        A :meth:`DataService.state_dict` (or a bare planner state) to resume from,
        or the ``state`` of the :meth:`checkpoint` of the planner this one replaces.
    generation : int
        0, then one more each time the service re-creates a lost planner; its
        constructors put it in every answer to a reader.
    had : dict, optional
        ``{rank: step}``: steps ranks already read from the planner this one
        replaces (the constructors do not send them those).
    lost : dict, optional
        For a re-created planner: ``{"from": worker address of the lost one,
        "recovered": {...}, "events": [...], "loaders": {source: n}, "counted":
        {source: {counter: value}}}`` (the lost planner's recovery counters, continued
        here, its loaders per source, which this one starts with, and their counters,
        which this one's count on from).
    tokenizer_sha256 : str, optional
        The tokenizer file's SHA-256 (:attr:`~msd_dask.sources.tokenizer.Tokenizer.sha256`,
        read where the service is placed, not on this worker): recorded in the states,
        and a resume ``state`` of another file's refused (:func:`planner_state`).
    eod_id : int, optional
        The tokenizer's end-of-document id (read there too): recorded in the states, which
        a config that spells it out, or leaves it to the file, resumes alike.

    Notes
    -----
    A step is planned, split into the constructors' work and packed in a
    thread of this worker (:meth:`_off_loop`), not on its event loop: the loop
    answers this actor's other calls (stats, snapshot, checkpoint, set_weights,
    report_step_time, the loaders' metadata...) and those of the roles the worker
    hosts meanwhile, where a step at dp=16,384 takes seconds.  While the thread
    works, the loop holds ``_plan_lock``, and:

    * the thread reads and changes ``self.planner``, and reads ``_meta`` (through
      :meth:`_lookup`), ``_owner`` and ``_relpath``.  ``_meta`` changes only in the
      planning loop itself (:meth:`_await_meta`, :meth:`_assign_ahead`), which is
      waiting for the thread; what changes ``_owner`` or the planner from another
      call (:meth:`hand_over`, :meth:`spread_units`, :meth:`set_weights`) takes
      ``_plan_lock`` first, so it waits for the step (a weight change lands on the
      next unplanned step, as when the loop planned on the event loop);
    * what reads the planner's state as a whole (:meth:`state`, :meth:`state_at`,
      :meth:`checkpoint`, :meth:`snapshot`) takes ``_plan_lock`` too: it never sees
      a half-planned step;
    * :meth:`stats` answers at once: its step, tokens and pieces come from the
      state after the last planned step (``_counts``, written by the loop), and
      ``planning`` says whether a step is being planned;
    * cancelled while the thread works (:meth:`stop`), the loop does not wait:
      the thread finishes its step, whose result is dropped, and ``_plan_lock`` is
      released then (one step at most).
    """

    def __init__(self, config: dict[str, Any], units: dict[str, list[tuple[str, int, int]]],
                 roots: dict[str, str], state: dict[str, Any] | bytes | None = None, *,
                 members: list[dict[int, list[int]]] | None = None, pad_id: int = 257,
                 loader_threads: int = 1, source_payloads: dict[str, dict[str, Any]] | None = None,
                 tokenizer: dict[str, Any] | None = None, generation: int = 0,
                 had: dict[int, int] | None = None, lost: dict[str, Any] | None = None,
                 tokenizer_sha256: str | None = None, eod_id: int | None = None):
        from msd_dask.core.plan import Planner
        from msd_dask.core.row_placement import planner_threads
        from msd_dask.core.units import Unit
        from msd_dask.roles.supervisor import RoleSupervisor
        from msd_dask.sources.heap import cap_arenas, map_large_blocks
        from msd_dask.sources.storage import SourceFiles

        # before the threads placing a large step's blocks of ranks allocate (their arenas
        # would hold what each frees: see row_placement.planner_threads), and a large step's
        # arrays given back when freed (msd_dask.sources.heap)
        cap_arenas()
        map_large_blocks()
        planner_threads()  # (a bad MSD_DASK_PLANNER_THREADS is refused here, at the start)
        self.cfg = parse_config(config)
        self.generation = int(generation)
        self.had = {int(r): int(s) for r, s in (had or {}).items()}
        self._lost = lost
        self.units = {k: [Unit(*u) for u in v] for k, v in units.items()}
        files = {k: SourceFiles(None, roots[k], []) for k in units}
        self._relpath = {k: [files[k].relpath(u.path) for u in v] for k, v in self.units.items()}
        self.planner = Planner(self.cfg, self.units)
        #: the tokenizer file's SHA-256, which the states record (None: the byte tokenizer,
        #: or not given)
        self.tokenizer_sha256 = tokenizer_sha256
        #: the tokenizer's end-of-document id, which the states record (None: not given)
        self.eod_id = eod_id
        if isinstance(state, bytes):  # the checkpoint of the planner this one replaces
            self.planner.load_snapshot(unpack_snapshot(state))
        elif state is not None:
            self.planner.load_state_dict(
                planner_state(self.cfg, state, {k: len(v) for k, v in self.units.items()},
                              self.tokenizer_sha256, self.eod_id)
                if "format" in state else state)
        #: step the service started at (resumed services do not start at 0)
        self.first_step = self.planner.step
        #: planner state after each recent step (a PlannerSnapshot, packed), for
        #: :meth:`state_at` and :meth:`checkpoint`; bounded because planning runs at most
        #: ``prefetch + round_steps`` steps ahead of any reader, and a checkpoint taken
        #: while a constructor does not answer goes back to its floor, ``prefetch +
        #: round_steps`` behind the last step submitted (:meth:`checkpoint`)
        self._snapshots: OrderedDict[int, bytes] = OrderedDict()
        self._keep = kept_states(self.cfg)
        #: the last step every rank returned, as the last look at every constructor found
        #: it (:meth:`checkpoint`): the states from MAX_PREFETCH steps before it on are
        #: kept beyond ``_keep``, up to :data:`KEPT_AT_MOST` times as many (ranks behind a
        #: host agent that reads far ahead, or a service just started: nothing returned)
        self._returned_by_all = self.first_step - 1
        #: live weight changes made so far (each re-packs the kept states: see set_weights)
        self.weights_version = 0
        #: the last snapshot's step (the next to plan), tokens and pieces, for :meth:`stats`
        self._counts: Counts = (0, {}, {})
        self._snapshot(self.planner.step - 1, *_packed_state(self.planner.snapshot()))
        #: role placement and recovery (see :class:`~msd_dask.roles.supervisor.RoleSupervisor`)
        self.roles = RoleSupervisor(self, members or [dict(enumerate(self.cfg.parallel.dp_groups()))],
                                    pad_id, loader_threads, source_payloads or {}, tokenizer or {})
        if lost:
            self.roles.recovered.update(lost.get("recovered", {}))
            self.roles.events.extend(lost.get("events", []))
            self.roles.loaders_at_setup.update(lost.get("loaders") or {})
            self.roles.count_from(lost.get("counted") or {})
        #: (source, epoch, unit) -> loader slot that reads it
        self._owner: dict[tuple[str, int, int], int] = {}
        #: (source, epoch, unit) -> last step whose plan used it
        self._last_use: dict[tuple[str, int, int], int] = {}
        #: the steps not every rank may have claimed yet: each constructor's work
        #: (pack_work), for re-sending to a re-created constructor, in a file of the
        #: worker's local directory where a step's is large (KeptWork)
        self._recent: OrderedDict[int, KeptWork] = OrderedDict()
        #: where large kept works go (None: not on a worker, kept in memory)
        self._kept_directory = local_directory()
        self._last_submitted = self.planner.step - 1
        self._meta_wait = {s.name: 0.0 for s in self.cfg.sources}
        #: (source, when) of the wait for a source's lengths under way: counted as it goes
        self._meta_waiting: tuple[str, float] | None = None
        self._meta: dict[tuple[str, int, int], np.ndarray] = {}
        self._meta_tasks: dict[tuple[str, int, int], asyncio.Task[Any]] = {}
        #: tokens of each unit as its loader reported them (-1: not read yet), for the
        #: read-ahead token cap; default cap: ``prefetch`` whole steps, the most the
        #: planner can take from one source before readers must claim more steps
        self._unit_tokens = {k: np.full(len(v), -1, dtype=np.int64) for k, v in self.units.items()}
        step_tokens = self.cfg.parallel.dp * self.cfg.batch.micro_batches * self.cfg.batch.seq_len
        self._ahead_cap = {s.name: s.read_ahead_tokens or self.cfg.prefetch * step_tokens
                           for s in self.cfg.sources}
        self._task: asyncio.Task[None] | None = None
        self.error: str | None = None
        #: what the planning loop is blocked on right now (None: planning)
        self.waiting: str | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=1000)
        #: ``cost: {fit: true}``: fits α, β to the step times readers report
        from msd_dask.core.cost import CostFitter

        self.fitter = (CostFitter(self.planner.cost, prior_weight=self.cfg.cost.prior_weight)
                       if self.cfg.cost.fit else None)
        self._step_features: OrderedDict[int, np.ndarray] = OrderedDict()
        #: the DP ranks whose step time came, by step (of the steps in ``_step_features``)
        self._reported: dict[int, set[int]] = {}
        #: reports counted per DP group, and the reports the fit set aside
        self._reports_seen: dict[int, int] = {}
        self.set_aside = 0
        self.imbalance_sum = 0.0
        self.lower_bound_ratio_sum = 0.0
        self.steps_planned = 0
        self.started = time.time()
        #: the planning thread (see the class notes), made at the first step
        self._executor: ThreadPoolExecutor | None = None
        #: held while the planning thread works and the loop takes in its result
        self._plan_lock = asyncio.Lock()
        #: the planning thread's job in flight, and when it started
        self._job: asyncio.Future[Any] | None = None
        self._job_started = 0.0
        #: seconds the last step took to plan (in the planning thread)
        self.plan_seconds = 0.0

    @property
    def constructors(self) -> list[Any]:
        return self.roles.constructors

    async def setup(self) -> None:
        """Create the loaders and constructors, spread across the workers."""
        await self.roles.setup()
        if self._lost:
            self.roles.record_event("planner", "planner", "lost", str(self._lost.get("from")),
                                    self.roles.own_address(),
                                    detail=f", resuming after step {self.first_step - 1}")

    async def handles(self, loaders: bool = True) -> dict[str, Any]:
        """Current actor handles: ``{"constructors": [...], "loaders": {source: {slot: h}}}``.

        ``loaders=False`` leaves the loaders out: a training process unpickling
        a loader's handle imports :mod:`msd_dask.roles.loader` (and its tokenizer), about
        1 MiB for each of the job's ranks, and readers only talk to constructors.
        """
        return {"constructors": list(self.roles.constructors),
                "loaders": self.roles.view() if loaders else {}}

    async def loader_stats(self) -> dict[str, list[dict[str, Any]]]:
        """Stats of every active loader, per source."""
        return await self.roles.loader_stats()

    async def constructor_stats(self) -> list[dict[str, Any]]:
        """Stats of every constructor (:meth:`RoleSupervisor.constructor_stats`)."""
        return await self.roles.constructor_stats()

    async def scale(self, source: str, n: int) -> int:
        """Serve ``source`` with ``n`` loaders (clamped to its bounds); returns the count."""
        return await self.roles.scale(source, int(n))

    async def evacuate(self, workers: list[str]) -> dict[str, int]:
        """Move every role except this planner off ``workers`` (before retiring them)."""
        return await self.roles.evacuate(list(workers))

    async def role_keys(self) -> list[str]:
        """The Dask keys of this planner's loaders and constructors (strings: the
        asking process unpickles no handle)."""
        return self.roles.keys()

    async def close_roles(self, notice: str | None = None) -> None:
        """Stop planning and close every loader and constructor; ``notice``: what the
        constructors tell the readers that ask them for a round afterwards
        (:meth:`~msd_dask.roles.constructor.DataConstructor.close`)."""
        await self.stop()
        if self._executor is not None:  # a step in flight ends on its own (its result dropped)
            self._executor.shutdown(wait=False)
            self._executor = None
        for kept in self._recent.values():  # (their files now, not at a collection of the
            kept.close()                    # actor's cycles; a review)
        self._recent.clear()
        await self.roles.close(notice)

    async def start(self) -> None:
        """Start the planning loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    # ------------------------- what the supervisor asks (roles.supervisor.PlannerSide)
    def next_step(self) -> int:
        """The step this planner plans next."""
        return self.planner.step

    def is_planning(self) -> bool:
        """Whether the planning loop runs."""
        return self._task is not None

    def unclaimed_steps(self, constructor: int) -> list[tuple[int, bytes]]:
        """``(step, constructor i's work packed as kept)`` of the recent steps not every
        rank may have claimed yet, in order (a re-created constructor gets them again)."""
        safe = self._received_by_all()
        return [(step, work.part(constructor)) for step, work in self._recent.items()
                if step > safe]

    async def hand_over(self, source: str, slots: list[int], heir: int) -> None:
        """Give the live units of loader ``slots`` of ``source`` (a slot whose actor was
        replaced, or retired ones) to slot ``heir``, which re-reads them, and ask it for
        the lengths not known yet."""
        resolve = self.roles.resolve
        async with self._plan_lock:  # not while the planning thread reads the owners
            moved = [k for k, s in self._owner.items()
                     if k[0] == source and (s in slots or resolve(source, s) in slots)]
            for k in moved:
                self._owner[k] = heir
        units = [(k[1], k[2]) for k in moved]
        # (heal holds the roles' lock here: a lost heir is given up, and heal hands the
        # slot's units to the actor it re-creates there)
        await self.roles.tell_loader(source, heir, f"take {len(units)} units",
                                     partial(_assign, units))
        for k in moved:
            if k not in self._meta:
                self._ask_again(k)

    async def spread_units(self, source: str) -> None:
        """Re-split the units of ``source`` assigned but not read yet over its active
        loader slots in turn (after slots were added: they help at once instead of after
        the backlog); a unit that moves is released by its old slot."""
        resolve = self.roles.resolve
        async with self._plan_lock:  # not while the planning thread reads the owners
            pending = [k for k in self._owner if k[0] == source and not self._lengths_reported(k)]
            act = self.roles.active[source]
            moves: dict[int, list[tuple[str, int, int]]] = {}
            for i, k in enumerate(pending):
                want = act[i % len(act)]
                if resolve(source, self._owner[k]) != want:
                    moves.setdefault(want, []).append(k)
            olds: dict[int, dict[int, list[tuple[int, int]]]] = {}
            for slot, keys in moves.items():
                old = olds[slot] = {}
                for k in keys:
                    old.setdefault(resolve(source, self._owner[k]), []).append((k[1], k[2]))
                    self._owner[k] = slot
        for slot, keys in moves.items():
            units = [(k[1], k[2]) for k in keys]
            await self.roles.tell_loader(source, slot, f"take {len(units)} units",
                                         partial(_assign, units))
            for k in keys:
                self._ask_again(k)
            for s, ks in olds[slot].items():  # (a lost old slot has nothing left to release)
                await self.roles.tell_loader(source, s, f"release {len(ks)} units",
                                             partial(_release, ks))

    # ------------------------------------------------------------- internals
    def _received_by_all(self) -> int:
        """The last step every rank has received for sure (claimed, and had the answer).

        Once a round's submission returns, every constructor has room for another round: it
        holds at most ``prefetch - round_steps`` unclaimed steps (see
        :class:`~msd_dask.roles.constructor.DataConstructor`), so every rank claimed the
        steps up to ``round_steps`` after this one; of them a rank may lack its last round,
        whose answer was lost on its way (its reader asks again, of a re-created
        constructor too: :meth:`unclaimed_steps` keeps it)."""
        return self._last_submitted - self.cfg.prefetch

    def _lookup(self, source: str, epoch: int, unit: int) -> np.ndarray:
        from msd_dask.core.stream import NeedMetadata

        m = self._meta.get((source, epoch, unit))
        if m is None:
            raise NeedMetadata(source, [(epoch, unit)])
        return m

    async def _assign_ahead(self) -> None:
        # (the planner's tables are replaced, never written to, and only this loop starts a
        # step: read in a thread, as at dp 16,384 x 128K they hold 10^6 pieces, 40-90 ms)
        keep = await asyncio.to_thread(self.planner.pending_units)
        # the units of carried and held pieces first: a live planner gave them out while they
        # were upcoming and keeps them, but a resumed or re-created one starts with no owner
        # for units behind its streams' windows (an outlier held for steps, a piece carried
        # from the last window), and splitting its first step found none (a review)
        pending: dict[str, list[tuple[int, int]]] = {}
        for source, e, u in sorted(keep):
            pending.setdefault(source, []).append((e, u))
        for s in self.cfg.sources:
            keys = self._upcoming(s.name, s.read_ahead)
            keep.update((s.name, e, u) for e, u in keys)
            await self._ensure(s.name, [*pending.get(s.name, ()), *keys])
        # release units the stream has moved past once every step that used them was
        # claimed by all ranks
        safe = self._received_by_all()
        done: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for k in [k for k in self._owner if k not in keep and self._behind(*k)]:
            if self._last_use.get(k, -1) <= safe:
                done.setdefault((k[0], self._owner[k]), []).append((k[1], k[2]))
                del self._owner[k]
                self._meta.pop(k, None)
                self._last_use.pop(k, None)
        for (source, slot), ks in done.items():
            await self.roles.release_units(source, slot, ks)

    def _upcoming(self, source: str, read_ahead: int) -> list[tuple[int, int]]:
        """The current window's units and, after them, at most ``read_ahead`` units
        holding at most the source's read-ahead tokens (:func:`ahead_within`), or, under
        the adaptive policy, the whole next window and two per read thread of the source's
        loaders after it if that is more (at most ``read_ahead``)."""
        keys = self.planner.upcoming_units(source, read_ahead)
        # the current window's units come first: the prefix in the stream's current window
        st = self.planner.streams[source]
        window = 0
        for e, u in keys:
            if e != st.epoch or st.window_of(e, u) != st.window:
                break
            window += 1
        known = self._unit_tokens[source]
        seen = known[known >= 0]
        mean = float(seen.mean()) if len(seen) else None
        est = [float(known[u]) if known[u] >= 0 else mean for _, u in keys[window:]]
        # under the adaptive policy the whole next window, whose units' lengths the planner
        # needs at once when it moves there (read on demand, a slow store stalled every
        # step at each window change), and after it two units per read thread (one read,
        # one queued): the policy sizes loaders by their measured rate, which a loader
        # waiting for its next unit does not reach, and one it adds must have units to
        # read.  Beyond the next window because units are given out as the planner moves:
        # with only that window ahead, a loader that read its share of it first waited for
        # the slowest one; with more ahead it is given
        # more units (PlannerActor._outstanding).  A fixed allocation keeps the cap's bound
        # on memory
        threads = len(self.roles.active.get(source, ())) * self.roles.loader_threads
        least = (st.window_size + 2 * threads if self.cfg.scaling.policy == "adaptive"
                 else 1)
        return keys[:window + max(ahead_within(est, self._ahead_cap[source]), least)]

    def _behind(self, source: str, epoch: int, unit: int) -> bool:
        st = self.planner.streams[source]
        if epoch != st.epoch:
            return epoch < st.epoch
        return st.window_of(epoch, unit) < st.window

    async def _ensure(self, source: str, keys: list[tuple[int, int]]) -> None:
        """Give every ``(epoch, unit)`` of ``source`` an owner and a metadata request."""
        new: dict[int, list[tuple[int, int]]] = {}
        outstanding: dict[int, int] | None = None
        for e, u in keys:
            k = (source, e, u)
            if k not in self._owner:
                if outstanding is None:
                    outstanding = self._outstanding(source)
                li = self.roles.next_slot(source, outstanding)
                outstanding[li] = outstanding.get(li, 0) + 1
                self._owner[k] = li
                new.setdefault(li, []).append((e, u))
        for li, ks in new.items():
            await self.roles.assign_units(source, li, ks)
        for e, u in keys:
            k = (source, e, u)
            if k not in self._meta and k not in self._meta_tasks:
                self._request_meta(k)

    def _lengths_reported(self, k: tuple[str, int, int]) -> bool:
        """Whether unit ``k``'s loader reported its lengths: it read the unit (a unit moved
        to another loader now would be read again)."""
        if k in self._meta:
            return True
        task = self._meta_tasks.get(k)
        return task is not None and task.done() and not task.cancelled()

    def _outstanding(self, source: str) -> dict[int, int]:
        """Units each loader slot of ``source`` was given and has not reported yet."""
        out: dict[int, int] = {}
        for k, li in self._owner.items():
            if k[0] == source and not self._lengths_reported(k):
                out[li] = out.get(li, 0) + 1
        return out

    def _request_meta(self, k: tuple[str, int, int]) -> None:
        loader = self.roles.loader(k[0], self._owner[k])

        async def ask() -> Any:
            # (inside the task: a lost actor's handle raises on the method's lookup, and the
            # wait for the lengths heals the loader and asks again, see _await_meta)
            return await direct(loader).metadata(k[1], k[2])

        task = self._meta_tasks[k] = asyncio.ensure_future(ask())
        task.add_done_callback(lambda t: self._note_tokens(k, t))

    def _ask_again(self, k: tuple[str, int, int]) -> None:
        """Ask the loader that owns unit ``k`` now for its lengths (a request to its
        previous owner is cancelled)."""
        old = self._meta_tasks.pop(k, None)
        if old is not None:
            old.cancel()
        self._request_meta(k)

    def _note_tokens(self, k: tuple[str, int, int], task: asyncio.Future[Any]) -> None:
        """Keep the tokens of a unit its loader reported (for the read-ahead cap)."""
        if not task.cancelled() and task.exception() is None:
            self._unit_tokens[k[0]][k[2]] = int(np.asarray(task.result()).clip(0).sum())

    def _starved_seconds(self) -> dict[str, float]:
        """Seconds the planner waited for each source's lengths, the wait under way included:
        counted only when a wait ended, a 10 s stall showed as nothing for 10 polls, then
        as 10 s in one (the reactive rule came late, then over-corrected: a review)."""
        out = dict(self._meta_wait)
        waiting = self._meta_waiting
        if waiting is not None:
            out[waiting[0]] += time.monotonic() - waiting[1]
        return out

    def _take_reported_lengths(self) -> None:
        """Keep for the planning thread's lookup the lengths the loaders have reported
        (before a step is planned, on the event loop): they reached its table only through
        a failed attempt (:class:`~msd_dask.core.stream.NeedMetadata`), so every new window
        threw a planning attempt away and cut its round short, though read-ahead had
        fetched the lengths long before (a review)."""
        from msd_dask.core.stream import kept_lengths

        done = [(k, task) for k, task in self._meta_tasks.items()
                if task.done() and not task.cancelled() and task.exception() is None]
        for k, task in done:
            del self._meta_tasks[k]
            # (a copy: a loader on this worker hands its own)
            self._meta[k] = kept_lengths(task.result())

    async def _await_meta(self, source: str, units: list[tuple[int, int]]) -> None:
        from msd_dask.core.stream import kept_lengths

        for e, u in units:
            k = (source, e, u)
            if k in self._meta:
                continue
            task = self._meta_tasks.get(k)
            if task is None:  # further ahead than read_ahead (e.g. past empty units)
                await self._ensure(source, [(e, u)])
                task = self._meta_tasks[k]
            self.waiting = (f"loader {self._owner.get(k)} of source {source!r} to report the "
                            f"lengths of {self.units[source][u].path} (epoch {e})")
            t0 = time.monotonic()
            self._meta_waiting = (source, t0)
            try:
                while True:
                    # the request may be replaced meanwhile (a loader re-created, or the unit
                    # moved to an added loader): always wait on the current one
                    task = self._meta_tasks.get(k) or task
                    await asyncio.wait({task}, timeout=1.0)
                    if task.done() and not task.cancelled():
                        exc = task.exception()
                        if exc is None:
                            lengths = task.result()
                            break
                        if not await self.roles.healed_after(exc):
                            raise exc
                        continue
                    if task.cancelled() and self._meta_tasks.get(k) is task:
                        self._request_meta(k)
                        continue
                    if time.monotonic() - t0 > self.cfg.timeout:
                        raise ServiceTimeoutError(
                            f"loader {self._owner.get(k)} of source {source!r} did not report "
                            f"the lengths of {self.units[source][u].path} (epoch {e}) within "
                            f"{self.cfg.timeout:.0f}s")
                    await self.roles.heal()  # a lost loader is re-created and asked again
            finally:
                self._meta_wait[source] += time.monotonic() - t0
                self._meta_waiting = None
            self._meta_tasks.pop(k, None)
            # (a copy: a loader on this worker hands its own)
            self._meta[k] = kept_lengths(lengths)
            self.waiting = None

    # ------------------------------------------------------- the planning thread
    @asynccontextmanager
    async def _planning(self) -> AsyncIterator[None]:
        """Hold ``_plan_lock`` while the block runs :meth:`_off_loop` and takes in its
        result.  Left early while the thread still works (the loop cancelled), the lock is
        released when the thread's job ends, not before: nothing reads a half-planned step."""
        await self._plan_lock.acquire()
        try:
            yield
        finally:
            job = self._job
            if job is not None and not job.done():
                job.add_done_callback(lambda _: self._plan_lock.release())
            else:
                self._plan_lock.release()

    async def _off_loop(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` in the planning thread (inside :meth:`_planning`).  Cancelled, the caller
        returns at once; the thread finishes ``fn`` and its result is dropped."""
        from msd_dask.core.gcpause import gc_paused

        assert self._plan_lock.locked()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix=f"msd-{self.cfg.name}-planner")

        def run() -> _T:
            # what a job makes (a step's pieces, the constructors' work) outlives it, so
            # collector passes meanwhile find nothing (see gcpause; plan_step pauses too)
            with gc_paused():
                return fn()

        self._job_started = time.monotonic()
        job = self._job = asyncio.get_running_loop().run_in_executor(self._executor, run)

        def done(_: asyncio.Future[Any]) -> None:
            if self._job is job:
                self._job = None
            if not job.cancelled():
                job.exception()  # retrieved: when the caller was cancelled, no one else does

        job.add_done_callback(done)
        return await asyncio.shield(job)

    def _plan_next(self) -> PlannedStep:
        """In the planning thread: the next step, planned, split and packed
        (:func:`plan_for_constructors`, which may raise ``NeedMetadata``)."""
        from msd_dask.core.row_placement import planner_threads

        times: list[float] = []
        # (the units it reads are read in its owners, which hand_over and spread_units
        # change only under the planning lock, held meanwhile)
        step = plan_for_constructors(self.planner, self._lookup, len(self.constructors),
                                     self._owner, self._relpath, self.fitter is not None,
                                     planner_threads(), times)
        self.plan_seconds = times[0]
        # the copy kept for re-created constructors; a work written to a file leaves memory
        # now (the round's earlier steps stayed while its later ones were planned, up to
        # 45 MiB each at dp 16,384 x 128K; a review) and is read back to hand the round over
        assert step.work is not None
        kept = KeptWork(step.step, step.work, self._kept_directory)
        return dataclasses.replace(step, kept=kept, work=None if kept.path else step.work)

    async def _loop(self) -> None:
        from msd_dask.core.stream import NeedMetadata

        k = self.cfg.steps_per_round
        handing: list[PlannedStep] = []  # the round being handed over (for an error's message)
        planning = self.planner.step  # the step being planned, split and packed (the same)
        try:
            async with self._plan_lock:  # a step of a cancelled loop still planning ends first
                pass
            self.waiting = (f"constructors to make room for step {self.planner.step} (each "
                            f"holds at most prefetch={self.cfg.prefetch} unclaimed steps)")
            await self._room(self.roles.wait_room(k))
            while True:
                # (the step a failure names: the next one, also where healing, scaling or
                # the read-ahead fails between steps; the last one planned was named, though
                # handed over already, a review)
                planning = self.planner.step
                await self.roles.heal()
                await self.roles.apply_scaling()
                self.waiting = None
                await self._assign_ahead()
                if self.fitter is not None:
                    self.planner.cost = self.fitter.model()
                # a round: up to k steps, cut short where a unit's lengths are not known yet
                planned: list[PlannedStep] = []
                need: NeedMetadata | None = None
                while len(planned) < k:
                    async with self._planning():
                        planning = self.planner.step
                        self._take_reported_lengths()
                        try:
                            step = await self._off_loop(self._plan_next)
                        except NeedMetadata as nm:
                            need = nm
                            break
                        planned.append(step)
                        self._snapshot(step.step, *step.after)
                        for key in step.used:  # its units stay until the step is claimed
                            self._last_use[key] = step.step
                        # kept before any reader can have the step: its step time may come
                        # back while the planner still waits for room after the round
                        self._record(step.record)
                        self._keep_features(step.step, step.features)
                        planning = step.step + 1
                    if len(planned) < k:
                        await self._assign_ahead()  # the next step's units and read-ahead
                if planned:
                    handing = planned
                    await self._submit(planned, k)
                    handing = []
                if need is not None:
                    await self._await_meta(need.source, need.units)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to every reader
            if isinstance(e, (DataError, ConfigError)):  # bad input: its message says it all
                _log.error("msd_dask %s: planner stopped: %s", self.cfg.name, e)
            else:
                _log.exception("msd_dask %s: planner failed", self.cfg.name)
            # (planning the next step, or handing over a round planned already)
            at = (f"step {planning}" if not handing else
                  f"handing over steps {handing[0].step}-{handing[-1].step}")
            self.error = f"planner failed at {at}: {e}"
            await self.roles.notify(self.error)

    async def _submit(self, planned: list[PlannedStep], room: int) -> None:
        """Hand a round to the constructors; return once each has room for ``room`` more
        steps (the next round: one message per constructor and round)."""
        works = []
        for step in planned:
            kept = step.kept or KeptWork(step.step, step.work or [], None)
            self._recent[step.step] = kept
            works.append((step.step, step.work if step.work is not None else
                          await asyncio.to_thread(kept.parts)))
        first, last = planned[0].step, planned[-1].step
        span = f"{first}" if first == last else f"{first}-{last}"
        self.waiting = (f"constructors to make room for step {last + 1} (handing over step "
                        f"{span}; each holds at most prefetch={self.cfg.prefetch} unclaimed "
                        "steps)")
        await self._room(self.roles.submit(works, room))
        del works
        self._last_submitted = last
        # every rank has claimed the steps up to _received_by_all(): never sent again
        safe = self._received_by_all()
        while self._recent and next(iter(self._recent)) <= safe:
            self._recent.popitem(last=False)
        self.roles.forget_retired(safe)
        self.waiting = None

    async def _room(self, wait: Awaitable[None]) -> None:
        """Await ``wait``, the constructors' room for the next round (the readers' pace:
        for as long as training is paused), applying each scale change asked for
        meanwhile (:meth:`RoleSupervisor.scale_asked`), here in the loop, as between two
        rounds: a scale-down frees its workers while training is paused."""
        task = asyncio.ensure_future(wait)
        asked: asyncio.Future[None] | None = None
        try:
            while True:
                asked = asyncio.ensure_future(self.roles.scale_asked())
                await asyncio.wait({task, asked}, return_when=asyncio.FIRST_COMPLETED)
                if task.done():
                    return task.result()
                await self.roles.apply_scaling()
        finally:
            if asked is not None:
                asked.cancel()
            if not task.done():  # (the loop cancelled: its wait with it)
                task.cancel()
            elif not task.cancelled():  # (a scale change failed after the wait did: that
                task.exception()        # one is raised, the wait's marked as seen)

    def _record(self, record: dict[str, Any]) -> None:
        """Count a planned step (its history record, see :meth:`_plan_next`)."""
        self.steps_planned += 1
        self.imbalance_sum += record["imbalance"]
        if record["lower_bound"] > 0:
            self.lower_bound_ratio_sum += record["max_cost"] / record["lower_bound"]
        self.history.append(record)

    # ---------------------------------------------------------------- queries
    async def set_weights(self, weights: dict[str, float], from_step: int | None = None) -> int:
        """Change the mix from ``from_step`` (default: the first unplanned step).

        The kept states of the steps planned already take the change too (it starts after
        all of them): a service resumed from one (:meth:`state_at`), or a planner
        re-created from one (:meth:`checkpoint`), makes the change at the same step."""
        from msd_dask.core.plan import change_step

        async with self._plan_lock:  # after the step being planned, which read the weights
            # a re-created planner re-plans steps ranks had from the lost one (``had``): a
            # change starts after them, or ranks of one step would take their shares of
            # it from two different plans (a review)
            after_had = max(self.had.values(), default=-1) + 1
            from_step = change_step(from_step)  # (refused as the planner refuses it)
            if after_had > self.planner.step:
                from_step = max(after_had, -1 if from_step is None else from_step)
            start = self.planner.set_weights(weights, from_step)
            overrides = tuple((st, dict(w)) for st, w in self.planner.overrides)
            kept = list(self._snapshots.items())
            # (off the loop: a kept state is megabytes at dp 16,384 x 128K)
            repacked = await asyncio.to_thread(
                lambda: [(k, _with_overrides(packed, overrides)) for k, packed in kept])
            self._snapshots.update(repacked)
            self.weights_version += 1
            return start

    def _snapshot(self, step: int, counts: Counts, packed: bytes) -> None:
        """Keep the state after ``step``: its counts and the whole state ``packed``
        (:func:`pack_snapshot`)."""
        self._snapshots[step] = packed
        self._counts = counts
        while len(self._snapshots) > self._keep:
            # (the oldest is a step some rank's training loop may be at: kept, within
            # bounds; a dataset's loop is up to MAX_PREFETCH steps behind what its reader
            # returned, and behind an agent that is what the service learns: a review)
            if next(iter(self._snapshots)) >= self._returned_by_all - MAX_PREFETCH and \
                    len(self._snapshots) <= KEPT_AT_MOST * self._keep:
                break
            self._snapshots.popitem(last=False)
        # the oldest kept state resumes after its step: no one asks for older weights (a
        # weight change goes into every kept state, set_weights)
        self.planner.forget_overridden(next(iter(self._snapshots)) + 1)

    async def state(self) -> dict[str, Any]:
        """The planner's state after the last planned step."""
        async with self._plan_lock:
            snap = self.planner.snapshot()
        # (a list per carried and held piece: seconds at dp 16,384 x 128K, off the loop)
        return await asyncio.to_thread(snap.to_state)

    async def start_step(self) -> int:
        """The first step this service plans (not 0 after a resume)."""
        return self.first_step

    async def state_at(self, step: int) -> dict[str, Any]:
        """The service state after ``step`` (see :func:`make_state`).

        A step of the next round not planned yet is waited for (up to
        :data:`STATE_WAIT` seconds, or half the config's ``timeout`` if shorter: the
        caller waits ``timeout`` for the answer, and gave up first, saying the planner did
        not answer, where the planner's own error says what is wrong; a review).

        Raises
        ------
        ValueError
            If ``step`` was not planned yet, or is older than the snapshots held.
        """
        step = int(step)
        # a step the next round plans (a re-created planner re-plans the few steps after
        # its checkpoint: a rank may be at one of them) is answered once it is planned
        deadline = time.monotonic() + min(0.5 * self.cfg.timeout, STATE_WAIT)
        # (and, on a re-created planner, a step a rank had from the lost one: re-planned
        # within seconds, though at dp 16,384 many steps behind it: a review)
        ahead = max(self.planner.step + self.cfg.steps_per_round - 1,
                    max(self.had.values(), default=-1))
        while (self.planner.step <= step <= ahead and self.error is None
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        async with self._plan_lock:  # a step being planned is answered once it is planned
            packed = self._packed_at(step)
        # (a list per carried and held piece: seconds at dp 16,384 x 128K, off the loop)
        return make_state(self.cfg, step, await asyncio.to_thread(_state_of, packed),
                          {k: len(v) for k, v in self.units.items()}, self.tokenizer_sha256,
                          self.eod_id)

    def _packed_at(self, step: int) -> bytes:
        """The kept snapshot of the state after ``step``, packed."""
        if step not in self._snapshots:
            held = list(self._snapshots)
            if step > held[-1]:
                raise ValueError(f"state of step {step} is not available: step {step} is not "
                                 f"planned yet (last planned step: {held[-1]})")
            # (a planner that started from a state, while that state is held: "no longer
            # held" said; a review)
            if 0 < self.first_step and step < self.first_step - 1 == held[0]:
                raise ValueError(f"state of step {step} is not held: this planner started "
                                 f"from the state of step {self.first_step - 1} (it was "
                                 "re-created, or the service resumed from it); ask for step "
                                 f"{self.first_step - 1} or a later one")
            raise ValueError(f"state of step {step} is no longer held (the service keeps the "
                             f"states of the last {self._keep} steps planned, and of the steps "
                             f"from {MAX_PREFETCH} before the last every rank returned, step "
                             f"{self._returned_by_all}, up to {KEPT_AT_MOST * self._keep}: "
                             f"it holds steps {held[0]}..{held[-1]})")
        return self._snapshots[step]

    async def checkpoint(self, have: int | None = None, have_version: int | None = None,
                         stats_age: float = 0.0) -> dict[str, Any]:
        """What the service's owner keeps to re-create this planner if it is lost.

        Parameters
        ----------
        have, have_version : int, optional
            The ``step`` and ``version`` of the caller's last checkpoint of this
            planner: if the checkpoint is still of that step and version, its ``state``
            is not sent again (``None``; the kept snapshot of a step changes only with
            a live weight change, which raises the version, and the owner polls every
            second while a snapshot is megabytes at dp 16,384 × 128K).
        stats_age : float
            Take every constructor's answers of up to this many seconds ago (a round the
            plugin's poll asked for,
            :data:`~msd_dask.dask_internals.STATS_SHARED`) instead of asking them again:
            the owner's checkpoint once a second; ``0``, ask.

        Returns
        -------
        dict
            ``state``: the planner's state after ``step``, the last step every
            rank has returned as far as its constructor knows (each constructor
            asked, a few seconds at most, or see ``stats_age``; a constructor that does
            not answer counts as a round before the ``prefetch`` steps behind the last
            submitted step,
            which every rank has claimed), as packed
            bytes that a re-created planner takes as its ``state`` (the JSON form
            of :meth:`state_at` is a list per carried and held piece: tens of MB,
            made in seconds, at dp 16,384 × 128K); ``had``: ``{rank: the last step
            it showed its constructor it has}`` (its claims, its reports: not the steps
            last handed to it, whose answer may never have reached it) as far as the
            constructors answered; ``loaders``:
            loaders per source (:meth:`RoleSupervisor.loader_counts`); ``counted``: their
            counters as last seen (:meth:`RoleSupervisor.counted`);
            ``recovered``, ``events``: this planner's recovery counters;
            ``address``: its worker; ``keys``: the Dask keys of its roles;
            ``version``: the live weight changes made so far; ``planned``: the next step
            it plans; ``reading``: the files whose lengths it waits for from its loaders
            (:meth:`files_awaited`).
        """
        had: dict[int, int] = {}
        returned: dict[int, int] = {}
        # (one lost meanwhile: heal re-creates it)
        cons = await self.roles.constructor_stats(max_age=stats_age)
        complete = not any(st.get("unanswered") for st in cons)
        for st in cons:
            had.update({int(r): int(s) for r, s in st.get("shown", {}).items()})
            returned.update({int(r): int(s) for r, s in st.get("returned", {}).items()})
        async with self._plan_lock:  # not while a step is planned (and split)
            # the state after the last step every rank *returned*, not claimed: a planner
            # re-created from it still holds the state of every step a rank may be at
            # (DataService.state_dict() asks for it), and re-plans the few steps after,
            # which readers that have them already skip
            floor = max(self.first_step - 1,
                        self._received_by_all() - self.cfg.steps_per_round)
            world = range(self.cfg.parallel.world_size)
            step = min(returned.get(r, self.first_step - 1) for r in world) if complete else floor
            if complete:  # (the states from MAX_PREFETCH before it on are kept: _snapshot)
                self._returned_by_all = max(self._returned_by_all, step)
            # ranks may have read past what this planner planned (a re-created planner
            # re-plans from its saved state): the state after its last planned step then
            step = min(max(step, floor), next(reversed(self._snapshots)))
            same = step == have and self.weights_version == have_version
            state = None if same else self._packed_at(step)
            return {"state": state, "step": step, "version": self.weights_version,
                    "had": had, "loaders": self.roles.loader_counts(),
                    "counted": self.roles.counted(),
                    "recovered": dict(self.roles.recovered), "events": list(self.roles.events),
                    "address": self.roles.own_address(), "keys": self.roles.keys(),
                    "planned": self.planner.step, "reading": self.files_awaited()}

    def files_awaited(self, most: int = 8,
                      slots: set[tuple[str, int]] | None = None) -> list[str]:
        """The files of the units whose lengths this planner asked its loaders for and has
        not had (``source: path``, at most ``most``; ``slots``: only of these loader slots,
        ``(source, slot)``): first those whose ask failed (their loader was lost
        meanwhile), then those being read, oldest ask first.  The owner names them if the
        service's workers keep dying (:class:`~msd_dask.service.recovery.PlannerKeeper`)."""
        failed: dict[str, None] = {}  # (ordered sets: a file of several units is named once)
        waiting: dict[str, None] = {}
        for (source, epoch, unit), task in self._meta_tasks.items():
            if slots is not None and (source, self._owner.get((source, epoch, unit))) not in slots:
                continue
            if not task.done():
                into = waiting
            elif not task.cancelled() and task.exception() is not None:
                into = failed
            else:
                continue
            into[f"{source}: {self.units[source][unit].path}"] = None
        return list(dict.fromkeys([*failed, *waiting]))[:most]

    async def snapshot(self, since: int = 0, lookahead: int | None = None) -> dict[str, Any]:
        """What the scheduler plugin polls, in one call (each call costs both ends CPU).

        Returns
        -------
        dict
            ``planner``: :meth:`stats`; ``loaders``: :meth:`loader_stats`;
            ``constructors``: how many; ``rank_summary``: the ranks in a few numbers
            (:func:`~msd_dask.core.figures.rank_summary`); ``ranks``: each rank's
            figures (``{str(rank): {"queue_depth", "last_claimed"}}``) up to
            :data:`~msd_dask.core.figures.RANKS_LISTED` ranks, else ``{}``;
            ``history``: :meth:`history_since` ``since``; ``weights_ahead``:
            :meth:`weights_ahead` over ``lookahead`` steps (``None`` without
            ``lookahead``).

        The ranks are summarised here, not by the caller: the constructors' figures of
        every rank (six dicts of 16,384 entries at 16,384 ranks, about 0.9 MB) cost the
        scheduler, where the plugin polls every second, about 17 ms to decode and as much
        again to summarise; the summary, about 450 bytes, costs it nothing to speak of
        (``scripts/bench_poll.py``).
        """
        cons = await self.roles.constructor_stats(max_age=STATS_SHARED)
        loaders = await self.loader_stats()
        columns = rank_columns(cons)
        listed = ({str(r): v for r, v in rank_figures(cons).items()}
                  if len(columns[0]) <= RANKS_LISTED else {})
        summary = rank_summary(*columns)
        del columns
        async with self._plan_lock:  # the planner's figures after a whole step
            return {"planner": await self.stats(), "loaders": loaders,
                    "constructors": len(cons), "rank_summary": summary, "ranks": listed,
                    "history": await self.history_since(since),
                    "weights_ahead": None if lookahead is None else
                    await self.weights_ahead(int(lookahead))}

    async def history_since(self, step: int) -> list[dict[str, Any]]:
        return [h for h in self.history if h["step"] >= step]

    async def weights_ahead(self, lookahead: int) -> dict[str, float]:
        """Largest weight of each source over the next ``lookahead`` steps
        (:meth:`~msd_dask.core.plan.Planner.largest_weights`)."""
        return self.planner.largest_weights(lookahead)

    async def report_step_time(self, step: int, dp_rank: int, seconds: float) -> None:
        """A DP rank computed on ``step`` for ``seconds`` (the first report of a group counts).

        Set aside, not fitted: each DP group's first :data:`WARMUP_REPORTS` reports after
        this planner started (a job's first steps compile and warm up, again after a
        resume), and a time the fit finds implausible
        (:meth:`~msd_dask.core.cost.CostFitter.plausible`); ``stats()["cost_model"]``
        counts them (``set_aside``).
        """
        features = self._step_features.get(int(step))
        if self.fitter is None or features is None:
            return
        reported = self._reported.setdefault(int(step), set())
        if int(dp_rank) in reported:
            return
        reported.add(int(dp_rank))
        seen = self._reports_seen.get(int(dp_rank), 0)
        self._reports_seen[int(dp_rank)] = seen + 1
        sum_lengths, sum_squares = features[int(dp_rank)].tolist()
        if seen < WARMUP_REPORTS or not self.fitter.plausible(sum_lengths, sum_squares, seconds,
                                                              int(step)):
            self.set_aside += 1
            return
        self.fitter.observe_sums(sum_lengths, sum_squares, float(seconds))

    def _keep_features(self, step: int, features: np.ndarray | None) -> None:
        """Keep each DP rank's ``(ΣL, ΣL²)`` of ``step`` (for the cost fitter): 16 bytes
        per rank and step (the pieces' lengths were 3.4M per step at dp 16,384 x 128K,
        for ``4 ×`` the steps whose snapshots are kept).  The oldest step's reports go with
        its features: a rebuild of every report kept, per step, held the event loop 0.7 s
        a step at dp 16,384 (a review)."""
        if features is None:
            return
        self._step_features[step] = features
        while len(self._step_features) > 4 * self._keep:
            old, _ = self._step_features.popitem(last=False)
            self._reported.pop(old, None)

    async def stats(self) -> dict[str, Any]:
        """Planner counters: steps, tokens per source, imbalance, weights in force.

        Answered while a step is planned (in the planning thread): the counters are
        those after the last planned step; ``planning``: whether the planning thread
        works now (planning a step, splitting and packing it), ``planning_for``
        for how many seconds; ``plan_seconds``: how long the last step took to plan.
        """
        n = max(self.steps_planned, 1)
        # the state after the last planned step (the planner's own counters change while
        # the planning thread plans the next)
        last_step, tokens, pieces = self._counts
        job = self._job
        return {
            "steps_planned": last_step,
            "tokens_planned": dict(tokens),
            "pieces_planned": dict(pieces),
            "weights": self.planner.weights_at(last_step),
            "planning": job is not None,
            "planning_for": time.monotonic() - self._job_started if job is not None else 0.0,
            "plan_seconds": self.plan_seconds,
            "mean_imbalance": self.imbalance_sum / n,
            "mean_max_over_lower_bound": self.lower_bound_ratio_sum / n,
            "last": self.history[-1] if self.history else None,
            "error": self.error,
            "waiting": self.waiting,
            "cost_model": {"linear": self.planner.cost.linear,
                           "quadratic": self.planner.cost.quadratic,
                           "fitted": self.fitter is not None,
                           "observations": self.fitter.count if self.fitter else 0,
                           "set_aside": self.set_aside},
            "uptime": time.time() - self.started,
            "starved_seconds": self._starved_seconds(),
            "loaders": {s: len(a) for s, a in self.roles.active.items()},
            "recovered": dict(self.roles.recovered),
            "role_events": list(self.roles.events[-20:]),
        }
