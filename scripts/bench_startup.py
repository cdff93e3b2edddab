"""Start-up time of a service for a large device mesh, phase by phase, without a cluster.

What a service does before its first step that grows with the world size
(``dp × tp × cp × pp`` ranks), timed on this machine:

parse
    :func:`msd_dask.core.config.parse_config` of a dict with the ``parallel``
    section and one tiny source (every training process does this too).
map ranks
    the constructors' ``members`` (constructor → ``{dp: the ranks of that DP
    group}``) for the default number of constructors, ``min(dp, workers)``
    (:func:`msd_dask.service.placement.constructor_members`).
place (service)
    :func:`msd_dask.service.placement.place_planner` against a stand-in client
    that has ``--workers`` workers and pickles what ``submit`` would send to the
    planner's worker, then pickling the registry the service publishes (the
    constructor count, not the members).  Nothing is sent anywhere.
planner setup
    on the planner's side: unpickling those arguments, ``PlannerActor(...)``
    (parses the config, builds its planner and role supervisor) and, for every
    constructor, pickling its members and running ``DataConstructor.__init__``
    (what each constructor's worker does when it is created).

Not counted: discovering the sources' units (storage I/O) and the messages of
a real cluster (creating the actors).

The old rank mapping (``ranks_of_dp`` scanned every rank for each DP index) is
timed in the same run on ``--old-sample`` DP indices spread over ``[0, dp)``
and extrapolated to all ``dp`` of them (it is linear in them); its groups are
checked against the new ones on those indices.

    python scripts/bench_startup.py                 # dp = 16,384 × tp = 8: 131,072 ranks
    python scripts/bench_startup.py --quick         # dp = 64 × tp = 2, seconds
    python scripts/bench_startup.py --dp 4096 --tp 8 --pp 4 --order tp-cp-dp-pp
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from typing import Any

GOAL_S = 10.0


class _Future:
    """What the stand-in client's ``submit`` returns: a key, like a Dask future."""

    def __init__(self, key: str):
        self.key = key


class _StandInClient:
    """Enough of a ``distributed.Client`` for :func:`place_planner`: ``workers`` workers,
    and a ``submit`` that pickles the function's arguments (what Dask would send)."""

    def __init__(self, workers: int):
        self._workers = {f"tcp://10.0.{i // 250}.{i % 250}:9000": 1 for i in range(workers)}
        self.sent: bytes = b""
        self.scheduler = self  # ``client.scheduler.ncores(_running)``: the scheduler's RPCs

    def ncores(self) -> dict[str, int]:
        return self._workers

    def ncores_running(self) -> dict[str, int]:
        return self._workers

    def sync(self, fn: Any, *args: Any, callback_timeout: float | None = None,
             **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def run_on_scheduler(self, fn: Any, *, workers: list[str],
                         callback_timeout: float | None = None) -> dict[str, list[str]]:
        return {w: [] for w in workers}  # (``actors_on``: a cluster holding no actor yet)

    def submit(self, fn: Any, *args: Any, key: str, **kwargs: Any) -> _Future:
        for dask_kw in ("actor", "workers", "pure", "allow_other_workers"):
            kwargs.pop(dask_kw, None)
        self.sent = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        return _Future(key)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {"name": "startup", "batch": {"seq_len": 4096, "micro_batches": 1},
            "constructors": args.constructors,
            "parallel": {"dp": args.dp, "tp": args.tp, "cp": args.cp, "pp": args.pp,
                         "order": args.order},
            "sources": [{"name": "tiny", "uri": "memory://startup/*.jsonl", "format": "jsonl"}]}


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_once(args: argparse.Namespace) -> dict[str, Any]:
    """Each phase's seconds (one run), and what they produced (sizes, for the table)."""
    from msd_dask.core.config import parse_config
    from msd_dask.roles.constructor import DataConstructor
    from msd_dask.roles.planner import PlannerActor
    from msd_dask.service.placement import constructor_members, place_planner

    raw = _config(args)
    t_parse, cfg = _timed(lambda: parse_config(raw))
    n_c = cfg.constructors or min(cfg.parallel.dp, args.workers)
    t_map, members = _timed(lambda: constructor_members(cfg, n_c))

    client = _StandInClient(args.workers)
    units = {"tiny": [("memory://startup/a.jsonl", 0, 0)]}
    roots = {"tiny": "memory://startup"}

    def place() -> tuple[dict[str, Any], bytes]:
        registry = place_planner(client, cfg, units, roots, None, 1, constructors=n_c)
        published = dict(registry, planner=registry["planner"].key)
        return registry, pickle.dumps(published, protocol=pickle.HIGHEST_PROTOCOL)

    t_place, (_registry, published) = _timed(place)

    def planner_setup() -> int:
        a, kw = pickle.loads(client.sent)
        planner = PlannerActor(*a, **kw)
        c = planner.cfg
        for i, m in enumerate(planner.roles.members):
            DataConstructor(c.name, i, pickle.loads(pickle.dumps(m)), c.batch.seq_len, 257,
                            c.prefetch, c.timeout, planner.generation)
        return len(planner.roles.members)

    t_setup, n_built = _timed(planner_setup)
    assert n_built == n_c
    return {"parse": t_parse, "map ranks": t_map, "place (service)": t_place,
            "planner setup": t_setup, "constructors": n_c, "sent_bytes": len(client.sent),
            "registry_bytes": len(published), "cfg": cfg, "members": members}


def old_vs_new(cfg: Any, sample: int) -> dict[str, float]:
    """The old scan on ``sample`` DP indices (extrapolated to all) against ``dp_groups``."""
    p = cfg.parallel

    def scan(d: int) -> list[int]:  # ranks_of_dp as it was: every rank, for one DP index
        return [r for r in range(p.world_size) if p.coords(r)["dp"] == d]

    n = max(1, min(sample, p.dp))
    picks = sorted({(i * (p.dp - 1)) // max(1, n - 1) for i in range(n)})
    t_new, groups = _timed(p.dp_groups)
    t0 = time.perf_counter()
    for d in picks:
        if scan(d) != groups[d]:
            raise AssertionError(f"DP group {d}: the old scan and dp_groups differ")
    per_index = (time.perf_counter() - t0) / len(picks)
    return {"sampled": len(picks), "old_per_index": per_index, "old_all": per_index * p.dp,
            "new_all": t_new}


def main(argv: list[str] | None = None) -> int:
    from cli_types import natural, positive_int

    ap = argparse.ArgumentParser(
        description="Time a service's start-up for a large device mesh, without a cluster: "
                    "parsing the config, mapping ranks to DP groups and constructors, and the "
                    "pure part of placing the planner and its constructors.  Prints each "
                    "phase's seconds, the total against the goal (<= 10 s), and the old rank "
                    "mapping's time (a sample of DP indices, extrapolated) beside the new one.",
        epilog="Example: python scripts/bench_startup.py --dp 4096 --tp 8 --pp 4 --repeat 3")
    ap.add_argument("--dp", type=positive_int, default=16_384,
                    help="data-parallel size (default %(default)s)")
    ap.add_argument("--tp", type=positive_int, default=8, help="tensor-parallel size (default %(default)s)")
    ap.add_argument("--cp", type=positive_int, default=1, help="context-parallel size (default %(default)s)")
    ap.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size (default %(default)s)")
    ap.add_argument("--order", default="tp-cp-dp-pp",
                    help="mesh axes from fastest-varying to slowest, as parallel.order "
                         "(default %(default)s)")
    ap.add_argument("--workers", type=positive_int, default=256,
                    help="Dask workers of the stand-in cluster (default %(default)s); the "
                         "service's default number of constructors is min(dp, workers)")
    ap.add_argument("--constructors", type=natural, default=0,
                    help="the config's `constructors` (default 0: min(dp, workers))")
    ap.add_argument("--old-sample", type=natural, default=4,
                    help="DP indices on which to time the old per-index scan "
                         "(default %(default)s; 0: skip it)")
    ap.add_argument("--repeat", type=positive_int, default=1,
                    help="runs of the phases, each phase's fastest reported (default %(default)s)")
    ap.add_argument("--quick", action="store_true",
                    help="a small mesh (dp = 64 × tp = 2, 16 workers, in place of --dp, --tp, --cp, --pp "
                         "and --workers): checks the script, not the figure")
    args = ap.parse_args(argv)
    if args.quick:
        args.dp, args.tp, args.cp, args.pp, args.workers = 64, 2, 1, 1, 16

    # imported first, as a worker has them before it creates a role: the phases time work
    import msd_dask.core.cost  # noqa: F401
    import msd_dask.core.plan  # noqa: F401
    import msd_dask.roles.planner  # noqa: F401
    import msd_dask.sources.storage  # noqa: F401
    import msd_dask.sources.tokenizer  # noqa: F401

    phases = ("parse", "map ranks", "place (service)", "planner setup")
    runs = [run_once(args) for _ in range(max(1, args.repeat))]
    best = {k: min(r[k] for r in runs) for k in phases}
    last = runs[-1]
    cfg = last["cfg"]
    p = cfg.parallel
    total = sum(best.values())
    print(f"mesh dp={p.dp} tp={p.tp} cp={p.cp} pp={p.pp} order={p.order}: {p.world_size:,} ranks; "
          f"{last['constructors']} constructors (workers={args.workers}); "
          f"{'fastest of ' + str(len(runs)) + ' runs' if len(runs) > 1 else 'one run'}")
    print()
    print(f"| {'phase':<16} | {'seconds':>8} |")
    print(f"|{'-' * 18}|{'-' * 9}:|")
    for k in phases:
        print(f"| {k:<16} | {best[k]:>8.3f} |")
    print(f"| {'total':<16} | {total:>8.3f} |")
    verdict = "met" if total <= GOAL_S else "NOT met"
    print(f"\ngoal: total <= {GOAL_S:.0f} s: {verdict} ({total:.2f} s)")
    print(f"sent to the planner's worker: {last['sent_bytes'] / 1e6:.2f} MB; "
          f"registry published: {last['registry_bytes'] / 1e6:.2f} MB")

    if args.old_sample > 0:
        o = old_vs_new(cfg, args.old_sample)
        print(f"\nrank mapping, old vs new (same run): the old scan (every rank for each DP index) "
              f"took {o['old_per_index'] * 1e3:.1f} ms per DP index, mean of {o['sampled']} "
              f"sampled indices; extrapolated to all {p.dp:,} DP indices: {o['old_all']:.1f} s. "
              f"New, dp_groups() for all of them: {o['new_all'] * 1e3:.1f} ms. "
              f"Ratio old / new: {o['old_all'] / o['new_all']:,.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
