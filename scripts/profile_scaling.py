"""Where the CPU goes in ``bench_scaling.py --mode cpu``: per process, per thread, per role.

Runs one allocation of the scaling benchmark (the same config, consumer and
demand) and, over the second half of the run, samples the CPU seconds of

* the consumer's process (it also runs the embedded scheduler, the scheduler
  plugin and the client's event loop), per thread;
* every worker process, per thread (``MainThread`` is the worker's event loop,
  where the actors' async methods run: the planner, the constructors, the
  loaders' serving; ``msd-load-*`` are the loaders' read threads, where rows are
  read, preprocessed and tokenized), with the roles each worker holds;

plus, from stack samples of every event loop every 10 ms, what the loops do:
idle (in ``select``), or the outermost msd_dask function on the stack, or else
the innermost Dask/Python function.  ``--cheap`` replaces the costly
source's preprocessing by none (both sources cheap): the service's own CPU cost
per step at the same demand.

``--calls`` counts, per process and step, the messages it serves (Dask RPCs by
name, actor calls by role and method, e.g. ``constructor.next_round_packed``), the
calls between roles on one worker (``direct DataConstructor.submit``: no message),
and the CPU of its event loop per task (the coroutine each callback runs, e.g.
``Server._handle_comm``: every message served; ``PeriodicCallback._run``: Dask's
heartbeats and monitors), measured on the loop's thread.

    python scripts/profile_scaling.py --policy adaptive --seconds 40
    python scripts/profile_scaling.py --policy fixed --cheap --seconds 40
    python scripts/profile_scaling.py --policy fixed --cheap --seconds 24 --calls
    python scripts/profile_scaling.py --policy fixed --cheap --seconds 30 --calls --micro-batches 4
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_scaling as bench  # noqa: E402


def _thread_times() -> dict[str, float]:
    """CPU seconds of every thread of this process, by thread name (summed per name)."""
    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = collections.defaultdict(float)
    for t in psutil.Process().threads():
        name = names.get(t.id, "other")
        for prefix in ("msd-load-", "msd-prep-", "Dask-Offload", "ThreadPoolExecutor",
                       "Dask-Default-Threads", "rank-"):
            if name.startswith(prefix):
                name = name.split("_")[0] if prefix != "rank-" else name
                break
        out[name] += t.user_time + t.system_time
        try:  # seconds the thread was runnable but waited for a core
            with open(f"/proc/self/task/{t.id}/schedstat") as f:
                out[name + " (waiting for a core)"] += int(f.read().split()[1]) / 1e9
        except OSError:
            pass
    return dict(out)


_SAMPLES: collections.Counter[str] = collections.Counter()


def _renice_loaders(dask_worker: Any = None, nice: int = 10) -> int:
    """Lower the priority of this worker's loader threads (``msd-load-*``); returns how many."""
    n = 0
    for t in threading.enumerate():
        if t.name.startswith("msd-load-") and t.native_id is not None:
            os.setpriority(os.PRIO_PROCESS, t.native_id, nice)
            n += 1
    return n


def _samples(dask_worker: Any) -> collections.Counter[str]:
    """The sample counts of this process (a worker keeps them on itself: functions of
    ``__main__`` reach a worker by value, with copies of their globals)."""
    if dask_worker is None:
        return _SAMPLES
    if not hasattr(dask_worker, "_msd_samples"):
        dask_worker._msd_samples = collections.Counter()
    return dask_worker._msd_samples


def _where(frame: Any) -> str:
    """What a stack sample of an event loop is doing: idle, or the msd_dask/Dask code running."""
    inner = frame
    outer_msd = None
    f = frame
    while f is not None:
        fn = f.f_code.co_filename
        if "msd_dask" in fn:  # (the last one met, walking outwards: the outermost)
            outer_msd = f"{os.path.basename(fn)}:{f.f_code.co_name}"
        f = f.f_back
    if inner.f_code.co_name in ("select", "poll", "_poll") and "selectors" in \
            inner.f_code.co_filename:
        return "idle (waiting in select)"
    if outer_msd is not None:
        return "msd_dask " + outer_msd
    parts = inner.f_code.co_filename.split(os.sep)
    return "/".join(parts[-2:]) + ":" + inner.f_code.co_name


def _start_sampler(dask_worker: Any = None, interval: float = 0.01,
                   thread: str = "MainThread") -> None:
    """Sample the event loop thread's stack every ``interval`` s (until the process ends)."""
    main = next(t.ident for t in threading.enumerate() if t.name == thread)

    counts = _samples(dask_worker)
    counts.clear()

    def loop() -> None:
        while True:
            frame = sys._current_frames().get(main)
            if frame is not None:
                counts[_where(frame)] += 1
            time.sleep(interval)

    threading.Thread(target=loop, daemon=True, name="msd-sampler").start()


def _count_writes(dask_worker: Any = None) -> None:
    """Count the socket writes of this process (tornado's ``write_to_fd``) and their bytes."""
    from tornado.iostream import IOStream

    if getattr(IOStream.write_to_fd, "_msd_counted", False):
        return
    counts = _samples(dask_worker)
    original = IOStream.write_to_fd

    def write_to_fd(self: Any, data: memoryview) -> int:
        n = original(self, data)
        counts["#writes"] += 1
        counts["#written"] += n
        return n

    write_to_fd._msd_counted = True  # type: ignore[attr-defined]
    IOStream.write_to_fd = write_to_fd  # type: ignore[method-assign]


_ROLES = ("planner", "constructor", "loader")


def _role_of(key: Any) -> str:
    """The role of an actor key ``msd-{service}-{role}-...`` (the key itself if none)."""
    parts = str(key).split("-")
    return next((r for r in _ROLES if r in parts), str(key))


def _count_calls(server: Any, counts: collections.Counter[str]) -> None:
    """Count what ``server`` (a worker or the scheduler) serves, into ``counts``:
    ``"#call rpc {op}"``, ``"#call stream {op}"``, ``"#call rpc {role}.{method}"`` for an
    actor call; ``"#call direct {Class}.{method}"`` for a call between roles on one worker;
    and ``"#loop {task}"``, the CPU seconds of the event loop's callbacks per coroutine
    (``#``: not a stack sample, see :func:`_top`)."""
    import asyncio.events
    import functools
    import inspect

    for kind, table in (("rpc", server.handlers), ("stream", server.stream_handlers)):
        for op, handler in list(table.items()):
            if getattr(handler, "_msd_counted", False):
                continue

            def counted(op: str = op, handler: Any = handler, kind: str = kind) -> Any:
                if inspect.iscoroutinefunction(handler):
                    async def wrapper(*args: Any, **kwargs: Any) -> Any:
                        name = (f"{_role_of(kwargs.get('actor'))}.{kwargs.get('function')}"
                                if op == "actor_execute" else op)
                        counts[f"#call {kind} {name}"] += 1
                        return await handler(*args, **kwargs)
                else:
                    def wrapper(*args: Any, **kwargs: Any) -> Any:
                        counts[f"#call {kind} {op}"] += 1
                        return handler(*args, **kwargs)
                # Dask reads the handler's signature (whether it takes ``comm``)
                out = functools.wraps(handler)(wrapper)
                out._msd_counted = True  # type: ignore[attr-defined]
                return out

            table[op] = counted()
    from msd_dask.roles import direct

    if not getattr(direct._Local, "_msd_counted", False):
        getattr_ = direct._Local.__getattr__

        def local_getattr(self: Any, name: str) -> Any:
            counts[f"#call direct {type(self._obj).__name__}.{name}"] += 1
            return getattr_(self, name)

        direct._Local.__getattr__ = local_getattr  # type: ignore[method-assign]
        direct._Local._msd_counted = True  # type: ignore[attr-defined]
    handle = asyncio.events.Handle
    if getattr(handle._run, "_msd_counted", False):
        return
    run = handle._run
    clock = time.thread_time

    def timed(self: Any) -> None:
        cb = self._callback  # None after the handle ran, if it was cancelled meanwhile
        t0 = clock()
        try:
            run(self)
        finally:
            task = getattr(cb, "__self__", None)
            coro = task.get_coro() if isinstance(task, asyncio.Task) else None
            what = (getattr(coro, "__qualname__", type(coro).__name__) if coro is not None
                    else getattr(cb, "__qualname__", type(cb).__name__))
            counts[f"#loop {what}"] += clock() - t0

    timed._msd_counted = True  # type: ignore[attr-defined]
    handle._run = timed  # type: ignore[method-assign]


def _count_worker_calls(dask_worker: Any) -> None:
    _count_calls(dask_worker, _samples(dask_worker))


def _count_scheduler_calls(dask_scheduler: Any) -> None:
    # kept on the scheduler: a function of ``__main__`` reaches it by value, with copies of
    # its globals, even in this process
    _count_calls(dask_scheduler, _samples(dask_scheduler))


def _scheduler_counts(dask_scheduler: Any) -> dict[str, float]:
    """What :func:`_count_scheduler_calls` counted so far (the consumer's process)."""
    return dict(_samples(dask_scheduler))


def _calls(before: dict[str, float], after: dict[str, float], steps: int) -> list[str]:
    """Lines of :func:`_count_calls`' counts in the window, per step."""
    d = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith(("#call ", "#loop "))}
    steps = max(steps, 1)
    out = [f"      {v / steps:6.3f}/step  {k[6:]}"
           for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if k.startswith("#call ") and v]
    loop = {k[6:]: v for k, v in d.items() if k.startswith("#loop ")}
    if loop:
        out.append(f"    event loop CPU per task: {sum(loop.values()) / steps * 1e3:.2f} ms/step")
        out += [f"      {v / steps * 1e3:6.3f} ms/step  {k}"
                for k, v in sorted(loop.items(), key=lambda kv: -kv[1])[:12]
                if v / steps >= 2e-5]
    return out


def _worker_sample(dask_worker: Any) -> dict[str, Any]:
    return {"threads": _thread_times(), "loop": dict(_samples(dask_worker)),
            "roles": sorted(str(k)[4:].split("-", 1)[-1] for k in dask_worker.state.actors),
            "cpu": sum(os.times()[:2])}


def _top(before: dict[str, int], after: dict[str, int], n: int = 10) -> list[tuple[str, float]]:
    """Share of the event loop's samples of the ``n`` most sampled places, in the window."""
    d = {k: v - before.get(k, 0) for k, v in after.items() if not k.startswith("#")}
    total = sum(d.values()) or 1
    return [(k, v / total) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]


def _writes(before: dict[str, int], after: dict[str, int]) -> tuple[int, int]:
    """Socket writes and bytes written in the window (see :func:`_count_writes`)."""
    return (after.get("#writes", 0) - before.get("#writes", 0),
            after.get("#written", 0) - before.get("#written", 0))


def _constructor_times(svc: Any) -> tuple[float, float, int]:
    """Seconds the constructors spent fetching and packing, and the batches they built."""
    handles = svc.planner.handles().result()["constructors"]
    st = [c.stats().result() for c in handles]
    return (sum(x["fetch_seconds"] for x in st), sum(x["build_seconds"] for x in st),
            sum(x["batches_built"] for x in st))


def _kind(waiting: str | None) -> str:
    """A planner's ``waiting`` line without its unit names."""
    if waiting is None:
        return "planning (not blocked)"
    if "report the lengths" in waiting:
        return waiting.split(" to report")[0].split(" of source ")[-1] + " lengths"
    return " ".join(w for w in waiting.split()[:4] if not w.isdigit())


def _decisions(dask_scheduler: Any) -> list[dict[str, Any]]:
    plugin = dask_scheduler.plugins.get("msd_dask")
    return [d for v in plugin.decisions.values() for d in v] if plugin else []


def main(argv: list[str] | None = None) -> int:
    from cli_types import natural, non_negative_float, positive_float, positive_int

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=["fixed", "adaptive"], default="adaptive")
    p.add_argument("--cheap", action="store_true", help="no preprocessing on the costly source")
    p.add_argument("--seconds", type=positive_float, default=40.0)
    p.add_argument("--data", default="data/scaling")
    p.add_argument("--read-ahead-tokens", type=natural, default=0,
                   help="sources[].read_ahead_tokens of both sources (0: the default)")
    p.add_argument("--costly-loaders", type=natural, default=0,
                   help="loaders of the costly source at the start (0: 1, as the benchmark)")
    p.add_argument("--round-steps", type=natural, default=0,
                   help="the config's round_steps (0: its default, prefetch - 1)")
    p.add_argument("--nice", type=int, default=0,
                   help="variant: run the loaders' read threads at this nice value")
    p.add_argument("--watch", type=non_negative_float, default=0.05,
                   help="seconds between two looks at what the planner is blocked on (0: "
                        "none); each look is a message the planner's worker serves, about 1 ms "
                        "of its CPU per step at the default")
    p.add_argument("--micro-batches", type=positive_int, default=1,
                   help="rows per rank and step; the consumer's step lasts as many times "
                        "0.04 s (the same demand in fewer, larger steps, as bench_scaling's "
                        "--micro-batches 4 --step-seconds 0.16)")
    p.add_argument("--calls", action="store_true",
                   help="count the messages each process serves per step (by RPC, actor role "
                        "and method), the calls between roles on one worker, and its event "
                        "loop's CPU per task")
    args = p.parse_args(argv)
    import psutil

    from msd_dask import DataService
    from msd_dask.torch import Prefetcher

    if args.micro_batches < 1:
        p.error(f"argument --micro-batches: must be an integer >= 1, got {args.micro_batches}")
    cfg = bench.make_config(args.data, args.policy, "cpu", micro_batches=args.micro_batches)
    if args.read_ahead_tokens:
        for s in cfg["sources"]:
            s["read_ahead_tokens"] = args.read_ahead_tokens
    if args.costly_loaders:
        cfg["sources"][1]["loaders"] = args.costly_loaders
    if args.round_steps:
        cfg["round_steps"] = args.round_steps
    if args.cheap:
        cfg["sources"][1].pop("preprocess", None)
    with DataService.start(cfg, n_workers=2, threads_per_worker=1, loader_threads=1) as svc:
        client = svc.client
        waits: collections.Counter[str] = collections.Counter()
        samples: dict[str, Any] = {}
        stop = threading.Event()
        planner = svc.planner

        def watch() -> None:  # what the planning loop is blocked on, every --watch seconds
            while args.watch > 0 and not stop.wait(args.watch):
                try:
                    w = planner.stats().result()["waiting"]
                except Exception as e:  # noqa: BLE001 - a missed sample
                    waits[f"error {e!r}"[:60]] += 1
                    continue
                if samples:
                    waits[_kind(w)] += 1

        threading.Thread(target=watch, daemon=True).start()
        client.run(_start_sampler)
        _start_sampler(thread="IO loop")
        client.run(_count_writes)
        _count_writes()
        if args.calls:
            client.run(_count_worker_calls)
            client.run_on_scheduler(_count_scheduler_calls)
        readers = [Prefetcher(svc.reader(r), 2, name=f"rank-{r}") for r in range(bench.RANKS)]
        me = psutil.Process()
        t_start = time.perf_counter()
        steps = tokens = 0
        waited = 0.0
        while (now := time.perf_counter() - t_start) < args.seconds:
            if args.nice and int(now) != int(now - 0.05):  # new loaders start at normal priority
                client.run(_renice_loaders, nice=args.nice)
            if now > args.seconds / 2 and not samples:
                samples = {"t": time.perf_counter(), "main": _thread_times(),
                           "cons": _constructor_times(svc),
                           "loop": dict(_SAMPLES),
                           "workers": client.run(_worker_sample), "wall": time.time(),
                           "sched": client.run_on_scheduler(_scheduler_counts) if args.calls
                           else {},
                           "main_cpu": sum(me.cpu_times()[:2])}
                steps = tokens = 0
                waited = 0.0
            t0 = time.perf_counter()
            batches = [rd.get(timeout=120) for rd in readers]
            waited += time.perf_counter() - t0
            time.sleep(0.04 * args.micro_batches)
            steps += 1
            tokens += sum(b.num_tokens for b in batches)
        end = {"t": time.perf_counter(), "main": _thread_times(), "loop": dict(_SAMPLES),
               "cons": _constructor_times(svc),
               "workers": client.run(_worker_sample), "main_cpu": sum(me.cpu_times()[:2]),
               "sched": client.run_on_scheduler(_scheduler_counts) if args.calls else {}}
        stop.set()
        loaders = svc.stats()["planner"]["loaders"]
        decisions = client.run_on_scheduler(_decisions)
        for rd in readers:
            rd.close(timeout=1.0)
    dt = end["t"] - samples["t"]
    t0 = decisions[0]["time"] - 1 if decisions else 0
    for d in decisions:
        print(f"  {d['time'] - t0:5.1f}s {d['source']}: {d['from']} -> {d['loaders']} "
              f"(starved {d['starved']:.0%}, consumption {d['consumption']:,.0f}/s)")
    print(f"policy {args.policy}{' (both sources cheap)' if args.cheap else ''}: "
          f"{dt:.1f} s measured, {steps} steps ({steps / dt:.1f}/s), {tokens / dt:,.0f} tokens/s, "
          f"consumer waited {waited / dt:.1%}; loaders {loaders}")
    fetch, build, built = (e - b for b, e in zip(samples["cons"], end["cons"], strict=True))
    print(f"constructors: {built} batches, fetch {fetch / max(built, 1) * 1e3:.1f} ms and pack "
          f"{build / max(built, 1) * 1e3:.1f} ms per batch (wall)")
    n = sum(waits.values()) or 1
    print(f"planner blocked on (share of {args.watch * 1e3:.0f} ms samples): " + ", ".join(
        f"{k} {v / n:.0%}" for k, v in waits.most_common()))
    total = 0.0
    rows = []
    d = {k: end["main"].get(k, 0) - samples["main"].get(k, 0) for k in end["main"]}
    rows.append(("consumer+scheduler", end["main_cpu"] - samples["main_cpu"], d,
                 _top(samples["loop"], end["loop"]), _writes(samples["loop"], end["loop"]),
                 _calls(samples["sched"], end["sched"], steps)))
    for w, e in end["workers"].items():
        s = samples["workers"][w]
        d = {k: e["threads"].get(k, 0) - s["threads"].get(k, 0) for k in e["threads"]}
        rows.append((w.rsplit(":", 1)[-1] + " " + ",".join(e["roles"]), e["cpu"] - s["cpu"],
                     d, _top(s["loop"], e["loop"]), _writes(s["loop"], e["loop"]),
                     _calls(s["loop"], e["loop"], steps)))
    for name, cpu, threads, top, (writes, written), calls in rows:
        total += cpu
        print(f"\n{name}: {cpu / dt:.1%} of a core ({cpu / max(steps, 1) * 1e3:.2f} ms/step; "
              f"{writes / max(steps, 1):.1f} socket writes, {written / max(steps, 1):,.0f} bytes "
              "per step)")
        for t, v in sorted(threads.items(), key=lambda kv: -kv[1]):
            if v / dt >= 0.005:
                print(f"    {t:<28}{v / dt:>7.1%}  {v / max(steps, 1) * 1e3:6.2f} ms/step")
        if top:
            print("    event loop, share of its stack samples:")
            for f, share in top:
                print(f"      {share:6.1%}  {f}")
        if calls:
            print("    messages served and calls between roles on this worker:")
            print("\n".join(calls))
    print(f"\nall processes: {total / dt:.2f} cores, {total / max(steps, 1) * 1e3:.2f} ms of CPU "
          f"per step; {total / dt / (os.cpu_count() or 1):.1%} of the machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
