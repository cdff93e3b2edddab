"""Per-source and per-rank figures from the roles' own stats (pure, no Dask).

Shared by :meth:`msd_dask.DataService.stats` and the scheduler plugin's
dashboard and Prometheus metrics, so both report the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


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
        tokens_read = sum(x["tokens_read"] for x in ls)
        read_seconds = sum(x["read_seconds"] for x in ls)
        cpu_seconds = sum(x.get("cpu_seconds", 0.0) for x in ls)
        out[name] = {
            "loaders": len(ls),
            "docs_read": sum(x["docs_read"] for x in ls),
            "tokens_read": tokens_read,
            "tokens_buffered": sum(x["tokens_buffered"] for x in ls),
            "units_buffered": sum(x["units_buffered"] for x in ls),
            "tokens_fetched": sum(x["tokens_fetched"] for x in ls),
            "tokens_planned": planner["tokens_planned"][name],
            "share": planner["tokens_planned"][name] / total,
            "weight": planner["weights"][name],
            "read_seconds": read_seconds,
            "seconds_per_token": read_seconds / tokens_read if tokens_read else 0.0,
            # 0 when a loader has measured none yet (every loader measures, pools included)
            "cpu_seconds": cpu_seconds if all(x.get("cpu_seconds") for x in ls) else 0.0,
            "cpu_wait_seconds": sum(x.get("cpu_wait_seconds", 0.0) for x in ls),
            "threads": ls[0].get("threads", 1) if ls else 1,
            # bad input skipped under on_error: skip (counted per read, so per epoch)
            "quarantined_docs": sum(x.get("quarantined_docs", 0) for x in ls),
            "quarantined_files": sum(x.get("quarantined_files", 0) for x in ls)
            + len(listed_out.get(name, [])),
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
