"""Fixed vs adaptive loaders when one source is ~20x costlier per token, side by side in one run.

Two sources of the demo corpus with equal weights.  ``--mode io``: the cheap one
waits 2 ms per KiB on a store (`msd_dask.examples.preprocess:store_1x`), the costly
one 40 ms per KiB (`store_20x`; waiting releases the GIL).  ``--mode cpu``: the
costly one burns about 40 ms of CPU per KiB (`cpu_bound`, hashing that releases
the GIL like image decoding; ``--costly`` picks another preprocessor, e.g.
`cpu_bound_py` (a short name is one of `msd_dask.examples.preprocess`), which
holds it, with ``--pool process:2``).

A consumer emulates a training job: one reader per DP rank, each claiming up to
``--prefetch`` batches ahead in a background thread (`msd_dask.torch.Prefetcher`, as
`MsdIterableDataset(prefetch=k)` does), and every step it takes all ranks' batches,
then "computes" for ``--step-seconds``: it asks for ``ranks × seq_len /
step_seconds`` tokens/s (the demand, printed).  Reported per allocation:
delivered tokens/s, the fraction of time the consumer waited for data (over the
run, and over its second half, "conv."), the loaders per source over time (plotted
to ``--plot``), when each source's count last changed and how often it reversed.
A third run, "no costly", has no costly source (``--mode io``: both sources behind
`store_1x`; ``--mode cpu``: no preprocessing): what this machine delivers at this
demand when no source is costly, and the service's own CPU per token then
(``--no-reference`` skips it; ``--reference-only`` runs it alone, for comparing
the service's own CPU between two versions).  "CPU conv." is the cores every process of the run
(consumer, scheduler, workers) used after convergence.  ``--prefetch 0`` takes the
batches in the consumer's thread, one rank after the other (the consumer of earlier
versions of this benchmark).

``--mode cpu`` also measures what the machine's cores allow, right before and right
after each adaptive run (its ratio uses the higher of the two, so other load while
either was measured cannot raise it): the costly and the cheap source read,
preprocessed and tokenized by one process per core (no service) for a few seconds
each; the mix of the two at equal weights gives the most tokens/s these cores can
prepare.  A second figure needs no other moment of the machine: the cores' rate
implied by the adaptive run's own loaders, their CPU seconds per token over its
second half.  With the service's own CPU per token (from the "no costly" run) added
to the costly source's, the same cores allow less: the bound the service can reach
on them.  ``--repeat N`` runs the adaptive allocation N times (each between two
measurements) and reports each ratio and their median.

    python scripts/bench_scaling.py --mode io --seconds 50 --plot docs/scaling.png
    python scripts/bench_scaling.py --mode cpu --seconds 50
    python scripts/bench_scaling.py --mode cpu --seconds 50 --micro-batches 4 --step-seconds 0.16
    python scripts/bench_scaling.py --mode cpu --seconds 50 --repeat 3
    python scripts/bench_scaling.py --mode cpu --seconds 25 --reference-only

``--micro-batches 4 --step-seconds 0.16``: the same demand in four times fewer,
larger steps (4 rows of 4096 tokens per rank every 160 ms), where the service's
per-step messages cost a quarter as much per token.  ``--service-prefetch 8``: the
same steps in rounds of 7 instead of 3 (the service's ``prefetch``, 4 by default).
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import statistics
import sys
import threading
import time
from typing import Any

RANKS = 2
SEQ_LEN = 4096
PREP = "msd_dask.examples.preprocess:"


def preprocess_path(name: str) -> str:
    """The full import path of a preprocessor: ``name`` as given if it has a ``:``, else
    the function of that name in :mod:`msd_dask.examples.preprocess`.

    Raises
    ------
    ValueError
        If ``name`` has no ``:`` and is not a function of that module.
    """
    if ":" in name:
        return name
    from msd_dask.examples import preprocess

    known = sorted(k for k, v in vars(preprocess).items()
                   if inspect.isfunction(v) and not k.startswith("_")
                   and v.__module__ == preprocess.__name__)
    if name not in known:
        raise ValueError(f"--costly {name!r}: not a function of {PREP[:-1]} (one of "
                         f"{', '.join(known)}), nor a full path 'package.module:function'")
    return PREP + name


def make_config(data: str, policy: str, mode: str, costly: str | None = None,
                pool: dict[str, Any] | None = None, read_ahead_tokens: int = 0,
                micro_batches: int = 1, prefetch: int = 4) -> dict[str, Any]:
    """The service config of one allocation (``policy``: ``fixed`` or ``adaptive``)."""
    costly = costly or (PREP + "store_20x" if mode == "io" else PREP + "cpu_bound")
    cheap = PREP + "store_1x" if mode == "io" else None
    src: list[dict[str, Any]] = [
        {"name": "code", "uri": f"{data}/code/*.parquet", "format": "parquet", "weight": 0.5,
         "loaders": 1, "preprocess": cheap},
        {"name": "costly", "uri": f"{data}/prose/*.jsonl.zst", "format": "jsonl",
         "weight": 0.5, "loaders": 1, "preprocess": costly},
    ]
    if pool:
        src[1]["pool"] = dict(pool)
    if read_ahead_tokens:
        for s in src:
            s["read_ahead_tokens"] = read_ahead_tokens
    for s in src:
        if s["preprocess"] is None:
            del s["preprocess"]
    return {
        "name": f"scaling-{policy}", "seed": 1, "parallel": {"dp": RANKS},
        "batch": {"seq_len": SEQ_LEN, "micro_batches": micro_batches}, "prefetch": prefetch,
        "timeout": 120,
        # the policy's defaults (docs/elastic.md): max_loaders 8, headroom 1.25, cooldown 5 s,
        # scale_down_after 30 s, lookahead 200 steps
        "scaling": {"policy": policy},
        "sources": src,
    }


class _Plain:
    """A reader taken from in the consumer's thread (``--prefetch 0``)."""

    def __init__(self, reader: Any):
        self.reader = reader

    def get(self, timeout: float | None = None) -> Any:
        return next(self.reader)

    def close(self, timeout: float = 0.0) -> None:
        pass


#: the CPU seconds each process of this one's tree had when last seen, by (pid, start time)
_CPU_SEEN: dict[tuple[int, float], float] = {}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its children (the cluster's nannies and workers), a
    child gone since its last look counted at what it had then: a child that exited within a
    window took all its CPU out of the sum, and the window's CPU came out negative (a
    review).  (A child that starts and ends between two looks is not seen.)"""
    import psutil

    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            with p.oneshot():
                t = p.cpu_times()
                _CPU_SEEN[(p.pid, p.create_time())] = t.user + t.system
        except psutil.Error:
            pass
    return sum(_CPU_SEEN.values())


def _policy_state(dask_scheduler: Any) -> dict[str, Any]:
    """The adaptive policy's CPU measurements and caps, per service."""
    plugin = dask_scheduler.plugins.get("msd_dask")
    if plugin is None:
        return {}
    return {n: {"cpu_fraction": dict(s.cpu_fraction), "cpu_caps": dict(s.cpu_caps),
                "saturated": dict(s.saturated)} for n, s in plugin._scalers.items()}


def run(cfg: dict[str, Any], seconds: float, step_seconds: float, workers: int,
        prefetch: int, idle: float = 0.0) -> dict[str, Any]:
    """One allocation; with ``idle`` seconds, then the CPU per second of every process
    while the readers hold their batches and take none (the service's cost with no
    step: Dask's heartbeats and monitors, the service's once-a-second control plane)."""
    from msd_dask import DataService
    from msd_dask.torch import Prefetcher

    with DataService.start(cfg, n_workers=workers, threads_per_worker=1,
                           loader_threads=1) as svc:
        readers: list[Any] = [
            Prefetcher(svc.reader(r), prefetch, name=f"rank-{r}") if prefetch else
            _Plain(svc.reader(r)) for r in range(RANKS)]
        timeline: list[tuple[float, dict[str, int]]] = []
        stop = threading.Event()
        t_start = time.perf_counter()

        def poll() -> None:  # off the consumer's path: it only takes batches and computes
            while not stop.is_set():
                now = time.perf_counter() - t_start
                try:
                    timeline.append((now, dict(svc.stats()["planner"]["loaders"])))
                except Exception:  # noqa: BLE001 - a missed sample is only a gap in the plot
                    pass
                stop.wait(1.0)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        waited = tokens = 0.0
        conv_wait = conv_time = conv_tokens = 0.0
        cpu0 = None
        half: dict[str, list[dict[str, Any]]] = {}
        while (now := time.perf_counter() - t_start) < seconds:
            if now > seconds / 2 and cpu0 is None:
                cpu0 = _cpu_seconds()
                half = svc.planner.loader_stats().result()
            t0 = time.perf_counter()
            batches = [rd.get(timeout=cfg["timeout"]) for rd in readers]
            w = time.perf_counter() - t0
            n = sum(b.num_tokens for b in batches)
            time.sleep(step_seconds)  # the training step
            step = time.perf_counter() - t0
            waited += w
            tokens += n
            if now > seconds / 2:  # after the policy had time to converge
                conv_wait += w
                conv_time += step
                conv_tokens += n
        elapsed = time.perf_counter() - t_start
        if not conv_time:  # (its figures were printed as 0: a 0% wait, 0 us/token; a review)
            print(f"warning: no step started in the second half of the {seconds:g} s run: the "
                  "figures after convergence are not measured (nan); give more --seconds",
                  file=sys.stderr, flush=True)
            conv_time = conv_tokens = math.nan
        cpu = _cpu_seconds() - (cpu0 or 0.0)
        stop.set()
        poller.join(5)
        idle_cpu = 0.0
        if idle:  # (the poller stopped: the bench's own look at the service is not counted)
            time.sleep(3.0)  # the readers' and the constructors' prefetch fill up
            c0, t0 = _cpu_seconds(), time.perf_counter()
            time.sleep(idle)
            idle_cpu = (_cpu_seconds() - c0) / (time.perf_counter() - t0)
        loaders = svc.planner.loader_stats().result()
        policy = svc.client.run_on_scheduler(_policy_state).get(cfg["name"], {})
        for rd in readers:
            rd.close(timeout=1.0)
    cost = {s: (sum(x["read_seconds"] for x in ls) / max(sum(x["tokens_read"] for x in ls), 1),
                ls[0]["threads"] if ls else 1) for s, ls in loaders.items()}
    return {"tokens_per_s": tokens / elapsed, "wait": waited / elapsed,
            "converged_tokens_per_s": conv_tokens / conv_time,
            "converged_wait": conv_wait / conv_time,
            "timeline": timeline, "cost": cost, "policy": policy,
            "loader_cpu_per_token": loader_cpu_per_token(half, loaders),
            # CPU of every process (consumer, scheduler, workers) after convergence
            "converged_cores": cpu / conv_time,
            "converged_cpu_per_token": cpu / conv_tokens,
            # of that CPU, the loaders' reading, preprocessing and tokenizing
            "converged_read_cpu_per_token":
                loader_cpu_seconds(half, loaders) / conv_tokens,
            "idle_cpu_per_s": idle_cpu}


def dask_floor(workers: int, seconds: float) -> float:
    """CPU seconds per second of every process of an embedded Dask cluster of ``workers``
    one-thread workers and a client, with the service's Dask settings and nothing to do:
    what Dask itself costs :func:`run`'s processes."""
    import dask
    from distributed import Client, LocalCluster

    from msd_dask.service import EMBEDDED_DASK_CONFIG

    with dask.config.set(EMBEDDED_DASK_CONFIG), \
            LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                         dashboard_address=":0") as cluster, Client(cluster):
        time.sleep(3.0)
        c0, t0 = _cpu_seconds(), time.perf_counter()
        time.sleep(seconds)
        return (_cpu_seconds() - c0) / (time.perf_counter() - t0)


def _loader_window(before: dict[str, list[dict[str, Any]]],
                   after: dict[str, list[dict[str, Any]]]) -> dict[str, tuple[float, int]]:
    """Per source, the CPU seconds its loaders spent reading, preprocessing and tokenizing,
    and the tokens they read, between two ``loader_stats()`` (slots are matched by number;
    a slot added between counts from 0)."""
    out = {}
    for source, ls in after.items():
        old = {x["slot"]: x for x in before.get(source, [])}
        cpu = sum(x["cpu_seconds"] - old.get(x["slot"], {}).get("cpu_seconds", 0.0) for x in ls)
        tokens = sum(x["tokens_read"] - old.get(x["slot"], {}).get("tokens_read", 0) for x in ls)
        out[source] = (cpu, tokens)
    return out


def loader_cpu_seconds(before: dict[str, list[dict[str, Any]]],
                       after: dict[str, list[dict[str, Any]]]) -> float:
    """Every source's loaders' CPU seconds between two ``loader_stats()``."""
    return sum(cpu for cpu, _tokens in _loader_window(before, after).values())


def loader_cpu_per_token(before: dict[str, list[dict[str, Any]]],
                         after: dict[str, list[dict[str, Any]]]) -> dict[str, float]:
    """Each source's CPU seconds per token read by its loaders between two
    ``loader_stats()`` (nan where they read nothing)."""
    return {source: cpu / tokens if tokens > 0 else float("nan")
            for source, (cpu, tokens) in _loader_window(before, after).items()}


def changes(timeline: list[tuple[float, dict[str, int]]], source: str
            ) -> tuple[float, int, int]:
    """``(time of the last change, changes, reversals)`` of a source's loader count."""
    last, n, rev, direction, prev = 0.0, 0, 0, 0, None
    for t, d in timeline:
        c = d.get(source)
        if prev is not None and c is not None and c != prev:
            sign = 1 if c > prev else -1
            rev += direction != 0 and sign != direction
            direction, last, n = sign, t, n + 1
        prev = c if c is not None else prev
    return last, n, rev


def _rate_worker(src_cfg: dict[str, Any], units: list[int], deadline: float) -> tuple[int, float]:
    from msd_dask.core.config import parse_config
    from msd_dask.formats import get_format
    from msd_dask.sources.documents import read_unit
    from msd_dask.sources.storage import open_source
    from msd_dask.sources.tokenizer import ByteTokenizer

    src = parse_config(src_cfg).sources[0]
    files = open_source(src.uri, src.storage_options)
    fmt = get_format(src.format)
    all_units = [u for p in files.paths for u in fmt.units(files.fs, p)]
    tok = ByteTokenizer()
    t0 = time.perf_counter()
    n = 0
    for i in units:
        n += sum(len(d) for d in read_unit(src, files.fs, all_units[i % len(all_units)], tok))
        if time.time() > deadline:
            break
    return n, time.perf_counter() - t0


def raw_rate(cfg: dict[str, Any], source: str, procs: int, seconds: float) -> float:
    """Tokens/s ``procs`` processes read + preprocess + tokenize ``source`` at, no service."""
    from concurrent.futures import ProcessPoolExecutor

    one = {"name": "raw", "batch": {"seq_len": SEQ_LEN},
           "sources": [dict(next(s for s in cfg["sources"] if s["name"] == source),
                            loaders=1)]}
    one["sources"][0].pop("pool", None)
    deadline = time.time() + seconds
    with ProcessPoolExecutor(procs) as ex:
        futs = [ex.submit(_rate_worker, one, list(range(p, 100_000, procs)), deadline)
                for p in range(procs)]
        res = [f.result() for f in futs]
    return sum(n for n, _ in res) / max(max(t for _, t in res), 1e-9)


def cores_allow(cfg: dict[str, Any], cores: int, seconds: float = 8.0, one_core: bool = True
                ) -> tuple[dict[str, float], float, float]:
    """What the cores allow with no service: each source's tokens/s on ``cores`` processes,
    the costly source's on one (``nan`` without ``one_core``), and the equal-weight mix of
    the two rates."""
    rates = {s: raw_rate(cfg, s, cores, seconds) for s in ("costly", "code")}
    one = raw_rate(cfg, "costly", 1, seconds) if one_core else float("nan")
    return rates, one, 1.0 / (0.5 / rates["costly"] + 0.5 / rates["code"])


def reference_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config of the "no costly" run: ``--mode io``, both sources behind ``store_1x``;
    ``--mode cpu``, no preprocessing."""
    ref = make_config(args.data, "fixed", args.mode,
                      PREP + "store_1x" if args.mode == "io" else None,
                      read_ahead_tokens=args.read_ahead_tokens,
                      micro_batches=args.micro_batches, prefetch=args.service_prefetch)
    if args.mode == "cpu":
        ref["sources"][1].pop("preprocess", None)
    return ref


def _reference_only(args: argparse.Namespace, seconds: float, demand: float) -> int:
    """``--reference-only``: the "no costly" run alone, and the service's own CPU per token."""
    r = run(reference_config(args), seconds, args.step_seconds, args.workers, args.prefetch,
            idle=args.idle_seconds)
    print(f"no costly source ({args.mode} mode), {seconds:.0f}s, {args.workers} workers on "
          f"{os.cpu_count() or 1} cores; demand {demand:,.0f} tokens/s")
    print(f"delivered {r['tokens_per_s']:,.0f} tokens/s ({r['converged_tokens_per_s']:,.0f} "
          f"after convergence), waited {r['wait']:.1%} ({r['converged_wait']:.1%})")
    print(f"service's own CPU with no costly source: {r['converged_cpu_per_token'] * 1e6:.2f} "
          f"us/token ({r['converged_cores']:.2f} cores at {r['converged_tokens_per_s']:,.0f} "
          "tokens/s)")
    print(_without_reading(r))
    if args.idle_seconds:
        print(_idle_share(r, dask_floor(args.workers, args.idle_seconds)))
    return 0


def _idle_share(r: dict[str, Any], floor: float) -> str:
    """The line that splits a run's CPU per token into what its processes cost per second
    with no step (Dask's own part, measured on a bare cluster, and the service's) and what
    the steps add."""
    rate = r["converged_tokens_per_s"] or 1.0
    idle, own = r["idle_cpu_per_s"], r["converged_cpu_per_token"]
    return (f"with no step taken its processes use {idle * 1e3:.1f} ms of CPU per second "
            f"({idle / rate * 1e6:.2f} us/token at this rate), a bare Dask cluster of as many "
            f"workers with the service's Dask settings {floor * 1e3:.1f}; the steps add "
            f"{(own - idle / rate) * 1e6:.2f} us/token")


def _without_reading(r: dict[str, Any]) -> str:
    """The line that splits a run's CPU per token: its loaders' reading (rows, preprocessing,
    tokenizing) and everything else (planning, building, delivering, Dask itself)."""
    own, read = r["converged_cpu_per_token"], r["converged_read_cpu_per_token"]
    return (f"of which its loaders' reading and tokenizing {read * 1e6:.2f} us/token; "
            f"everything else (planning, building, delivering, Dask) {(own - read) * 1e6:.2f} "
            "us/token")


def _pool(text: str) -> dict[str, Any]:
    """``--pool``'s ``KIND[:SIZE]`` as a config's ``pool`` (``process:two`` raised
    ``ValueError`` after the corpus was written; a review)."""
    kind, _, size = text.partition(":")
    if kind not in ("thread", "process") or size and not (size.isdigit() and int(size) > 0):
        raise argparse.ArgumentTypeError(f"expected thread or process[:SIZE], SIZE a whole "
                                         f"number > 0, got {text!r}")
    return {"kind": kind, "size": int(size) if size else 1}


def main(argv: list[str] | None = None) -> int:
    from cli_types import natural, non_negative_float, positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/scaling",
                   help="demo corpus with 64 prose shards (written if missing): a source "
                        "needs many units for several loaders to share it")
    p.add_argument("--mode", choices=["io", "cpu"], default="io")
    p.add_argument("--costly", help="preprocess of the costly source: a function of "
                                    "msd_dask.examples.preprocess by its name (e.g. "
                                    "cpu_bound_py) or a full path package.module:function "
                                    "(default: store_20x for io, cpu_bound for cpu)")
    p.add_argument("--pool", type=_pool,
                   help="the costly source's pool as KIND:SIZE, e.g. process:2 "
                                  "(default: the loader's one thread)")
    p.add_argument("--read-ahead-tokens", type=natural, default=0,
                   help="variant: sources[].read_ahead_tokens of both sources (default: the "
                        "service's, prefetch whole steps)")
    p.add_argument("--seconds", type=positive_float, default=60.0, help="per allocation")
    p.add_argument("--step-seconds", type=positive_float, default=0.04,
                   help="emulated compute per step (sets the demand)")
    p.add_argument("--micro-batches", type=positive_int, default=1,
                   help="rows of seq_len tokens per rank and step (the demand grows with it; "
                        "scale --step-seconds with it to keep the demand and take fewer, "
                        "larger steps)")
    p.add_argument("--prefetch", type=natural, default=2,
                   help="batches each rank claims ahead (0: claim in the consumer's thread)")
    p.add_argument("--service-prefetch", type=positive_int, default=4,
                   help="the service's prefetch: unclaimed steps each constructor holds; "
                        "rounds are one step fewer (default 4)")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 2)
    p.add_argument("--plot", help="write the loaders-over-time plot here (PNG)")
    p.add_argument("--quick", action="store_true", help="25 s per allocation")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="adaptive runs (cpu mode: each between two measurements of what the "
                        "cores allow); the summary gives the median")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the third run, with no costly source (io: both store_1x; cpu: "
                        "no preprocessing), which also measures the service's own CPU")
    p.add_argument("--reference-only", action="store_true",
                   help="only that third run: the service's own CPU per token (cpu mode), "
                        "and what it delivers at this demand")
    p.add_argument("--idle-seconds", type=non_negative_float, default=None,
                   help="with --reference-only: then measure the processes' CPU per second "
                        "with no step taken for this long, and a bare Dask cluster's (0: "
                        "neither; default 10)")
    args = p.parse_args(argv)
    if args.reference_only and args.no_reference:
        p.error("--reference-only and --no-reference exclude each other")
    if args.idle_seconds is None:
        args.idle_seconds = 10.0
    elif not args.reference_only:  # (the three runs measure no idle time: it would be lost)
        p.error("--idle-seconds applies to --reference-only alone")
    if args.reference_only:  # (the run without a costly source, alone: none of these applies)
        given = [opt for opt, value in (("--plot", args.plot), ("--costly", args.costly),
                                        ("--pool", args.pool),
                                        ("--repeat", args.repeat != 1)) if value]
        if given:
            p.error(f"{', '.join(given)} do(es) not apply to --reference-only (its one run "
                    "has no costly source and no adaptive loaders)")
    if args.costly:
        try:
            args.costly = preprocess_path(args.costly)
        except ValueError as e:
            p.error(str(e))
    import dask

    # process pools (``--pool process:N``) need workers that may start processes
    dask.config.set({"distributed.worker.daemon": False})
    if not os.path.isdir(os.path.join(args.data, "code")):
        from msd_dask.examples.demo import write_demo_corpus

        write_demo_corpus(args.data, prose_shards=64, code_shards=16, row_group_size=16)
    seconds = 25.0 if args.quick else args.seconds
    pool = args.pool
    cores = os.cpu_count() or 1
    mb = args.micro_batches
    demand = RANKS * SEQ_LEN * mb / args.step_seconds
    ceiling = None
    allow: list[tuple[dict[str, float], float, float]] = []
    if args.reference_only:
        return _reference_only(args, seconds, demand)
    raw = make_config(args.data, "fixed", args.mode, args.costly, pool, args.read_ahead_tokens)
    cfgs = {policy: make_config(args.data, policy, args.mode, args.costly, pool,
                                args.read_ahead_tokens, mb, args.service_prefetch)
            for policy in ("fixed", "adaptive")}
    res = {"fixed": run(cfgs["fixed"], seconds, args.step_seconds, args.workers, args.prefetch)}
    if args.mode == "cpu":
        allow.append(cores_allow(raw, cores))
    runs = []
    for _ in range(args.repeat):
        r = run(cfgs["adaptive"], seconds, args.step_seconds, args.workers, args.prefetch)
        if args.mode == "cpu":
            # what the cores allow, measured right before and right after this run: its
            # ratio is taken to the higher, so other load on the machine while either was
            # measured cannot raise it
            allow.append(cores_allow(raw, cores, one_core=False))
            r["ceiling"] = max(allow[-2][2], allow[-1][2])
        runs.append(r)
    # the run the summary lines and the plot show: the median one (by its ratio to what the
    # cores allow in cpu mode, else by tokens/s after convergence; the lower middle one of
    # an even number)
    order = sorted(range(len(runs)), key=lambda i: runs[i]["converged_tokens_per_s"]
                   / runs[i].get("ceiling", 1.0))
    mid = order[(len(runs) - 1) // 2]
    median = runs[mid]
    res.update({"adaptive": median} if len(runs) == 1 else
               {f"adaptive {i}": r for i, r in enumerate(runs, 1)})
    costly = cfgs["adaptive"]["sources"][1]["preprocess"].rsplit(":", 1)[-1]
    if not args.no_reference:
        # what this machine delivers at this demand when no source is costly, and (cpu mode)
        # what the service itself costs in CPU per token then
        res["no costly"] = run(reference_config(args), seconds, args.step_seconds,
                               args.workers, args.prefetch)
    if allow:
        rates, _, ceiling = max(allow, key=lambda a: a[2])
    print(f"mode {args.mode}: costly source '{costly}'"
          + (f" on a {pool['kind']} pool of {pool['size']}" if pool else "")
          + f", equal weights, {seconds:.0f}s per allocation, {args.workers} workers on "
          f"{cores} cores")
    spt, threads = res["fixed"]["cost"]["costly"]
    fixed_max = threads / spt / 0.5 if spt else float("nan")
    print(f"demand: {RANKS} ranks x {SEQ_LEN}" + (f" x {mb} micro-batches" if mb > 1 else "")
          + f" tokens every {args.step_seconds * 1000:.0f} ms "
          f"of compute (prefetch {args.prefetch}, the service's {args.service_prefetch}) = "
          f"{demand:,.0f} tokens/s; one costly loader "
          f"measured {spt * 1e6:.1f} us/token busy, so the fixed allocation supplies at most "
          f"{fixed_max:,.0f} tokens/s ({demand / fixed_max:.1f}x below the demand)")
    for i, (r, one, c) in enumerate(allow):
        when = "before adaptive run 1" if i == 0 else f"after adaptive run {i}"
        print(f"cores allow ({when}): costly source {r['costly']:,.0f} tokens/s on "
              f"{cores} processes" + (f" ({one:,.0f} on 1)" if one == one else "")
              + f", cheap {r['code']:,.0f}; at equal weights {c:,.0f} tokens/s")
    print(f"{'allocation':<12}{'tokens/s':>12}{'wait':>8}{'tokens/s conv.':>16}"
          f"{'wait conv.':>12}{'CPU conv.':>11}{'final loaders':>26}  last change / changes / "
          "reversals")
    for k, r in res.items():
        final = r["timeline"][-1][1] if r["timeline"] else {}
        ch = "  ".join(f"{s} {t:.0f}s/{n}/{v}" for s in ("code", "costly")
                       for t, n, v in [changes(r["timeline"], s)])
        print(f"{k:<12}{r['tokens_per_s']:>12,.0f}{r['wait']:>8.1%}"
              f"{r['converged_tokens_per_s']:>16,.0f}{r['converged_wait']:>12.1%}"
              f"{r['converged_cores']:>11.2f}{str(final):>26}  {ch}")
    if len(runs) > 1:
        print(f"the lines below take adaptive run {mid + 1}, the median")
    ratio = median["tokens_per_s"] / max(res["fixed"]["tokens_per_s"], 1e-9)
    conv = (median["converged_tokens_per_s"]
            / max(res["fixed"]["converged_tokens_per_s"], 1e-9))
    print(f"adaptive / fixed tokens/s: {ratio:.2f} over the run, {conv:.2f} after convergence")
    print(f"adaptive / demand: {median['converged_tokens_per_s'] / demand:.1%} "
          "after convergence")
    pol = median["policy"]
    if pol.get("cpu_caps") or pol.get("saturated"):
        print("adaptive policy: CPU fraction of the loaders' busy time "
              + ", ".join(f"{s} {f:.2f}" for s, f in pol["cpu_fraction"].items())
              + f"; CPU cap {pol['cpu_caps']}; saturated {pol['saturated']}")
    if ceiling is not None and "no costly" in res:
        # the service's own CPU per token (no costly source) on top of the costly hashing
        own = res["no costly"]["converged_cpu_per_token"]
        bound = cores / (0.5 * cores / rates["costly"] + own)
        print(f"service's own CPU with no costly source: {own * 1e6:.2f} us/token "
              f"({res['no costly']['converged_cores']:.2f} cores at "
              f"{res['no costly']['converged_tokens_per_s']:,.0f} tokens/s); with it these "
              f"cores allow at most {bound:,.0f} tokens/s, {bound / ceiling:.1%} of {ceiling:,.0f}")
        print(_without_reading(res["no costly"]))
    if ceiling is not None:
        # each adaptive run against the higher of the measurements right before and after it;
        # and against the cores' rate implied by its own loaders' CPU per token in the same
        # seconds (no other moment of the machine in it)
        shares = []
        for i, r in enumerate(runs, 1):
            cpt = dict(r["loader_cpu_per_token"])
            if cpt["code"] != cpt["code"]:  # nan: the cheap source read nothing in the window,
                cpt["code"] = 0.0           # so it cost no CPU then (the ceiling only rises)
            shares.append(r["converged_tokens_per_s"] / r["ceiling"])
            line = (f"adaptive run {i} / what the cores allow: {shares[-1]:.1%} after convergence "
                    f"(of {r['ceiling']:,.0f}, the higher of the measurements around it); ")
            if cpt["costly"] == cpt["costly"]:
                inrun = cores / (0.5 * cpt["costly"] + 0.5 * cpt["code"])
                line += (f"{r['converged_tokens_per_s'] / inrun:.1%} of {inrun:,.0f} tokens/s, "
                         f"what its loaders' CPU per token ({cpt['costly'] * 1e6:.1f} us costly, "
                         f"{cpt['code'] * 1e6:.2f} us cheap) allows {cores} cores")
            else:
                line += "its costly loaders finished no unit in the second half: no in-run figure"
            print(line)
        # the lower median: the run the lines above the table's take
        print(f"adaptive / what the cores allow: {statistics.median_low(shares):.1%} after "
              f"convergence" + (f" (median of {len(runs)} runs, lowest {min(shares):.1%})"
                                if len(runs) > 1 else "")
              + f" (fixed: {res['fixed']['converged_tokens_per_s'] / ceiling:.1%} of the "
              f"highest, {ceiling:,.0f})")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for policy, style in (("adaptive", "-"), ("fixed", ":")):
            tl = (median if policy == "adaptive" else res[policy])["timeline"]
            for src in ("code", "costly"):
                ax.step([t for t, _ in tl], [d[src] for _, d in tl], style, where="post",
                        label=f"{policy}: {src}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("loaders")
        ax.set_title(f"loaders per source ({args.mode}-bound costly source '{costly}')")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
