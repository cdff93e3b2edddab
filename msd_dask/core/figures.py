"""Per-source and per-rank figures from the roles' own stats (pure, no Dask).

Shared by :meth:`msd_dask.DataService.stats` and the scheduler plugin's
dashboard and Prometheus metrics, so both report the same numbers.  At
thousands of ranks the dashboard and the metrics show :func:`rank_summary`
(quantiles and the slowest ranks), not a line per rank; the planner makes it
from :func:`rank_columns` before it answers the plugin's poll.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: ranks the summary names one by one, the slowest first
SLOWEST = 8
#: the dashboard's JSON lists every rank up to this many ranks
RANKS_LISTED = 64
#: the counters of a loader's ``stats()`` that only grow: the planner adds those of the
#: loaders gone from a slot (lost, replaced, retired) to the slot's
#: (``RoleSupervisor.loader_stats``), so that a source's never go back
LOADER_COUNTERS = ("docs_read", "tokens_read", "units_read", "tokens_fetched", "read_seconds",
                   "cpu_seconds", "cpu_wait_seconds", "quarantined_docs", "quarantined_files")


def source_figures(planner: Mapping[str, Any], loader_stats: Mapping[str, Sequence[Mapping[str, Any]]],
                   listed_out: Mapping[str, Sequence[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Figures of every source, summed over its loaders.

    Parameters
    ----------
    planner : mapping
        The planner's ``stats()``: ``tokens_planned`` and ``weights`` per source.
    loader_stats : mapping
        ``{source: [stats() of each of its loaders]}``.
    listed_out : mapping, optional
        Files left out when the units were listed (``on_error: skip``), per source.
    """
    listed_out = listed_out or {}
    total = sum(planner["tokens_planned"].values()) or 1
    out = {}
    for name, ls in loader_stats.items():
        counted = {c: sum(x.get(c, 0) for x in ls) for c in LOADER_COUNTERS}
        tokens_read, read_seconds = counted["tokens_read"], counted["read_seconds"]
        out[name] = {
            "loaders": len(ls),
            # loaders that did not answer (a lost worker's, until the planner re-creates
            # them): their figures are their last answer's
            "loaders_unanswered": sum(1 for x in ls if x.get("error")),
            "docs_read": counted["docs_read"],
            "tokens_read": tokens_read,
            "tokens_buffered": sum(x["tokens_buffered"] for x in ls),
            "units_buffered": sum(x["units_buffered"] for x in ls),
            "tokens_fetched": counted["tokens_fetched"],
            "tokens_planned": planner["tokens_planned"][name],
            "share": planner["tokens_planned"][name] / total,
            "weight": planner["weights"][name],
            "read_seconds": read_seconds,
            "seconds_per_token": read_seconds / tokens_read if tokens_read else 0.0,
            # 0 when a loader has measured none yet (every loader measures, pools included)
            "cpu_seconds": counted["cpu_seconds"] if all(x.get("cpu_seconds") for x in ls)
            else 0.0,
            "cpu_wait_seconds": counted["cpu_wait_seconds"],
            "threads": ls[0].get("threads", 1) if ls else 1,
            # bad input skipped under on_error: skip (counted per read, so per epoch)
            "quarantined_docs": counted["quarantined_docs"],
            "quarantined_files": counted["quarantined_files"] + len(listed_out.get(name, [])),
            "quarantined": list(listed_out.get(name, []))
            + [k for x in ls for k in x.get("quarantined", [])],
        }
    return out


def rank_figures(constructor_stats: Sequence[Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
    """Queue depth and last claimed step of every rank, from the constructors' ``stats()``."""
    ranks: dict[int, dict[str, Any]] = {}
    for c in constructor_stats:
        for r, depth in c["queue_depth"].items():
            ranks[int(r)] = {"queue_depth": depth, "last_claimed": c["last_claimed"].get(r)}
    return ranks


def rank_columns(constructor_stats: Sequence[Mapping[str, Any]]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every rank's id, queue depth and last claimed step (``-1``: none yet), as arrays in
    the constructors' order, from their ``stats()``.

    What :func:`rank_summary` takes: at 16,384 ranks, three arrays of a few hundred KB
    where :func:`rank_figures` makes a dict per rank (tens of milliseconds).
    """
    ids, depths, claims = [], [], []
    for c in constructor_stats:
        depth, claimed = c["queue_depth"], c["last_claimed"]
        n = len(depth)
        ids.append(np.fromiter((int(r) for r in depth), dtype=np.int64, count=n))
        depths.append(np.fromiter(depth.values(), dtype=np.int64, count=n))
        claims.append(np.fromiter((-1 if (v := claimed.get(r)) is None else v for r in depth),
                                  dtype=np.int64, count=n))
    if not ids:
        none = np.zeros(0, dtype=np.int64)
        return none, none.copy(), none.copy()
    return np.concatenate(ids), np.concatenate(depths), np.concatenate(claims)


def rank_summary(rank: np.ndarray, depth: np.ndarray, claimed: np.ndarray,
                 slowest: int = SLOWEST) -> dict[str, Any]:
    """Any number of ranks in a few numbers.

    Parameters
    ----------
    rank, depth, claimed : ndarray of int
        Each rank's id, queue depth and last claimed step (``-1``: none yet), in any
        order (:func:`rank_columns`).
    slowest : int
        How many of the least advanced ranks to name.

    Returns
    -------
    dict
        ``ranks`` (how many), ``waiting`` (ranks that have claimed no step yet),
        ``queue_depth`` and ``last_claimed`` (``min``, ``p50``, ``p90``, ``max``
        over the ranks, the quantiles by nearest rank: at least half, at least 90%
        of the ranks at or below, each a value some rank has; ``last_claimed`` over
        those that claimed a step, ``None`` if none did), ``lag`` (steps between the
        most and the least advanced rank, waiting ranks counted at step -1), and ``slowest``: up to
        ``slowest`` ranks, least advanced first (ties: the deeper queue, then
        the lower rank), each ``{"rank", "last_claimed", "queue_depth"}``
        (``last_claimed`` ``None`` for a waiting rank).
    """
    if not len(rank):
        return {"ranks": 0, "waiting": 0, "queue_depth": None, "last_claimed": None, "lag": 0,
                "slowest": []}
    started = claimed >= 0

    def quantiles(x: np.ndarray) -> dict[str, int] | None:
        if not len(x):
            return None
        # nearest rank: the least value at or below which are at least half (at least 90%)
        # of the ranks, a value some rank has ("lower" rounded down: with 2 ranks the p90
        # was the smaller; a review)
        q = np.quantile(x, [0.5, 0.9], method="inverted_cdf")
        return {"min": int(x.min()), "p50": int(q[0]), "p90": int(q[1]), "max": int(x.max())}

    order = np.lexsort((rank, -depth, claimed))[:slowest]
    return {
        "ranks": len(rank),
        "waiting": int((~started).sum()),
        "queue_depth": quantiles(depth),
        "last_claimed": quantiles(claimed[started]),
        "lag": int(claimed.max() - claimed.min()),
        "slowest": [{"rank": int(rank[i]), "last_claimed": int(claimed[i]) if claimed[i] >= 0
                     else None, "queue_depth": int(depth[i])} for i in order.tolist()],
    }


#: the fields of a constructor's ``stats()`` that hold a value per rank it serves
CONSTRUCTOR_PER_RANK = ("queue_depth", "last_claimed", "shown", "returned", "returned_by",
                        "report_after", "unclaimed")


def brief_stats(stats: Mapping[str, Any], listed: int = RANKS_LISTED) -> dict[str, Any]:
    """:meth:`~msd_dask.DataService.stats` as ``msd-dask stats`` prints it by default: with
    ``rank_summary`` (:func:`rank_summary`), and beyond ``listed`` ranks without the values
    per rank (``ranks`` empty, and each constructor's :data:`CONSTRUCTOR_PER_RANK` fields
    replaced by ``ranks``, how many it serves): at 16,384 ranks those are ten lines of JSON
    per rank.

    Parameters
    ----------
    stats : mapping
        What :meth:`~msd_dask.DataService.stats` returned.
    listed : int
        The most ranks shown one by one.

    Returns
    -------
    dict
        ``stats`` with ``rank_summary`` added (a copy: ``stats`` is left as it is).
    """
    cons = stats.get("constructors", [])
    out = dict(stats, rank_summary=rank_summary(*rank_columns(cons)))
    if len(stats.get("ranks", {})) > listed:
        out["ranks"] = {}
        out["constructors"] = [
            dict({k: v for k, v in c.items() if k not in CONSTRUCTOR_PER_RANK},
                 ranks=len(c.get("queue_depth", {})))
            for c in cons]
    return out
