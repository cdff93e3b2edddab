"""Loader memory (PSS) of per-rank HF ``datasets`` streaming loaders against msd_dask, side by side.

``R`` ranks × ``W`` DataLoader workers per rank × ``S`` sources, every one a
real process.  The ``S`` sources are the demo's ``code`` and ``prose``
replicated ``S/2`` times as separate sources (same files, their own names,
weights divided evenly: 0.6 / 0.4 in total), so a per-rank loader opens the
state of every source in every loader worker, as it would with ``S`` real
sources.  Sequence length and micro-batches are the demo config's.

Baseline (``scripts/baselines.py``): ``R`` rank processes, each with a
``DataLoader(num_workers=W)`` over ``split_dataset_by_node(interleave_datasets(
[load_dataset(..., streaming=True) per source], probabilities))``; the loader
workers tokenize and pack.

msd_dask: a ``dask scheduler`` and ``--dask-workers`` ``dask worker``
processes hosting the roles, with the Dask settings docs/deployment.md gives for
the service's workers (``msd_dask.service.EMBEDDED_DASK_CONFIG``, as the embedded
cluster has them) and ``--no-nanny``, with the environment a nanny gives its
worker (``distributed.nanny.pre-spawn-environ``: ``MALLOC_TRIM_THRESHOLD_`` and
those settings' ``MALLOC_ARENA_MAX``), the process that started the service (it holds
the service's client, like ``msd-dask serve``), and ``R`` training processes
each reading its rank through ``msd_dask.torch.MsdIterableDataset``.  The
msd_dask side runs once per ``--read-ahead`` value (default: the config's, then
``nocap``): what the loaders keep tokenized ahead of the planner, which is what
their memory grows with -- ``config``: the sources' ``read_ahead`` (8 units)
and ``read_ahead_tokens`` (0: ``prefetch`` whole steps' tokens); ``nocap``:
8 units, no token cap (the default before the cap); an integer ``n``:
``read_ahead: n`` units, no token cap.  The tokens they hold at the measurement
(``stats()``, × 2 bytes for a vocabulary of up to 65,536 ids, as uint16, else × 4) are reported as a part of
the workers' PSS.

Every rank consumes ``--warm`` batches, then all processes hold still (``--settle``,
2 s) and their PSS (``psutil.Process.memory_full_info().pss``: private pages plus each
shared page divided by the number of processes mapping it) is summed, ``--samples``
(three) samples one second apart, mean taken.  A bare ``python -c "import torch"``
process runs alongside in each phase; "reader adds" is a reader process's PSS
minus the bare one's.  Reported:

* baseline loaders: rank processes + their loader workers minus one bare
  process per rank (what the loaders add to the training processes);
* baseline total: the same with the training processes' own python+torch;
* msd_dask: scheduler + workers + the starting process + ``R`` × what a reader
  adds, per read-ahead variant.

The headline ratio is baseline loaders / msd_dask total: both sides count
only what the loaders add (msd_dask's side never includes the training
processes' own python+torch).  Baseline total / msd_dask total, which counts
the ``R`` training processes on the baseline side only, is printed below it
for comparison with earlier runs.

``--agents N`` (comma-separated, default ``0``): ``0`` is the above, the readers
connect to the service directly (each its own Dask client); ``N > 0`` splits the
``R`` ranks into ``N`` simulated hosts of consecutive ranks, each with one
``msd-dask agent`` process for its ranks (started after the service and before the
readers, each on its own socket in a temporary directory), and each reader gets
``MSD_DASK_AGENT`` of its host's agent (no Dask client in the training process).
The agents are part of the service on each host: msd_dask's total counts their PSS
(with their children, the shell that removes an agent's shared-memory blocks if it
is killed, shown apart; the shared-memory blocks they hold are mapped by them, so in
it) plus ``R`` × what a reader adds.  The
msd_dask side runs once per read-ahead value and agent count, all in one table.

``--cluster-env KEY=VALUE`` adds a variable to the environment of the dask
scheduler and workers only, as a deployment sets it for ``dask scheduler`` /
``dask worker`` (e.g. ``ARROW_DEFAULT_MEMORY_POOL=system``, to measure a
setting before recommending it); nothing else gets it.

    python scripts/bench_memory.py --quick      # (R, W, S) = (8, 2, 8)
    python scripts/bench_memory.py              # (16, 4, 16)
    python scripts/bench_memory.py --agents 0,2 # also with the 16 ranks as 2 hosts of 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from cli_types import natural, non_negative_float, positive_float, positive_int  # noqa: E402

GiB = 1024 ** 3
#: the service's name
_NAME = "benchmem"


# ------------------------------------------------------------------ children
def _hold(msg: str = "ready") -> None:
    print(msg, flush=True)
    sys.stdin.readline()


def child_bare() -> None:
    import torch  # noqa: F401

    _hold()


def child_hf(a: argparse.Namespace) -> None:
    import warnings

    import baselines

    warnings.filterwarnings("ignore", message="This DataLoader will create")

    sources = baselines.demo_sources(a.root, replicas=a.sources // 2)
    dl = baselines.hf_loader(sources, a.rank, a.ranks, a.workers, a.seq_len, a.micro_batches,
                             seed=a.rank)
    it = iter(dl)
    for _ in range(a.warm):
        next(it)
    _hold()
    os._exit(0)  # do not wait for the loader workers to drain


def child_serve(a: argparse.Namespace) -> None:
    """Start the service; answer ``stats`` lines with the loaders' buffers; stop on anything else."""
    import baselines

    from msd_dask import DataService
    from msd_dask.core.config import parse_config

    base = parse_config(a.config).to_dict()  # files: checked on a worker
    cfg = baselines.source_config(base, baselines.demo_sources(a.root, replicas=a.sources // 2))
    cfg["name"] = _NAME
    cfg["parallel"] = {"dp": a.ranks}
    cfg["batch"] = {"seq_len": a.seq_len, "micro_batches": a.micro_batches}
    for src in cfg["sources"]:
        if a.read_ahead_one:
            src["read_ahead"] = a.read_ahead_one
        if a.read_ahead_tokens_one is not None:
            src["read_ahead_tokens"] = a.read_ahead_tokens_one
    svc = DataService.start(cfg, a.address)
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "stats":
            break
        sources = svc.stats()["sources"].values()
        print(json.dumps({"tokens_buffered": sum(int(x["tokens_buffered"]) for x in sources),
                          "loaders": sum(int(x["loaders"]) for x in sources)}), flush=True)
    svc.close()


def child_reader(a: argparse.Namespace) -> None:
    from torch.utils.data import DataLoader

    from msd_dask.torch import MsdIterableDataset

    ds = MsdIterableDataset(a.address, _NAME, a.rank, connect_timeout=120)
    it = iter(DataLoader(ds, batch_size=None, num_workers=0))
    for _ in range(a.warm):
        next(it)
    _hold()
    os._exit(0)


# ------------------------------------------------------------------ parent
class Procs:
    """Child processes of this script, each in its own session, stopped by pid.

    A child started with ``argv`` (another program) is stopped with SIGTERM; this
    script's own children when a line reaches their stdin.  Its process group is killed
    once it exited (what it left behind) or 30 s later (it too).
    """

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self.term: set[str] = set()

    def start(self, key: str, args: list[str], env: dict[str, str] | None = None,
              argv: list[str] | None = None) -> None:
        """Start ``key``: this script with ``args``, or ``argv``; ``env`` added to the
        environment it inherits."""
        if argv is not None:
            self.term.add(key)
        self.procs[key] = subprocess.Popen(
            argv or [sys.executable, os.path.abspath(__file__), *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, start_new_session=True,
            env=None if env is None else dict(os.environ, **env))

    def wait_ready(self, keys: list[str], timeout: float, ready: str = "ready") -> None:
        """Wait for a line starting with ``ready`` from each of ``keys`` (``timeout`` s in all)."""
        import select

        import psutil

        deadline = time.monotonic() + timeout
        for k in keys:
            p = self.procs[k]
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{k} not ready (no line {ready!r}) after {timeout:.0f}s")
                if psutil.virtual_memory().available < 2 * GiB:
                    raise MemoryError("less than 2 GiB of memory left: stopping")
                r, _, _ = select.select([p.stdout], [], [], 1.0)
                if r:
                    line = p.stdout.readline()  # type: ignore[union-attr]
                    if line.startswith(ready):
                        break
                    if line == "" and p.poll() is not None:
                        raise RuntimeError(f"{k} exited with {p.returncode} before it was ready")

    def ask(self, key: str, line: str, timeout: float = 60) -> str:
        """Send ``line`` to child ``key`` and return its one-line answer."""
        import select

        p = self.procs[key]
        p.stdin.write(line + "\n")  # type: ignore[union-attr]
        p.stdin.flush()  # type: ignore[union-attr]
        r, _, _ = select.select([p.stdout], [], [], timeout)
        if not r:
            raise TimeoutError(f"{key} did not answer {line!r} in {timeout:.0f}s")
        return p.stdout.readline()  # type: ignore[union-attr]

    def stop(self, keys: list[str] | None = None) -> None:
        """Stop ``keys`` (default: all), killing those still there after 30 s; never raises."""
        keys = list(self.procs) if keys is None else [k for k in keys if k in self.procs]
        for k in keys:
            p = self.procs[k]
            try:
                if k in self.term:
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                else:
                    p.stdin.write("\n")  # type: ignore[union-attr]
                    p.stdin.flush()  # type: ignore[union-attr]
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 30
        for k in keys:
            p = self.procs.pop(k)
            self.term.discard(k)
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{k} (pid {p.pid}) still running 30 s after it was told to stop: killed",
                      file=sys.stderr)
            # the child's own process group: it if still there, and what it left behind (a rank
            # leaves its DataLoader workers, which may be blocked on a queue nobody reads)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                print(f"{k} (pid {p.pid}) still there 30 s after SIGKILL", file=sys.stderr)
            for f in (p.stdin, p.stdout):
                with contextlib.suppress(OSError):
                    f.close()  # type: ignore[union-attr]


def pss_tree(pid: int) -> tuple[int, int]:
    """(PSS of the process, PSS of its descendants) in bytes."""
    import psutil

    p = psutil.Process(pid)
    own = p.memory_full_info().pss
    kids = 0
    for c in p.children(recursive=True):
        try:
            kids += c.memory_full_info().pss
        except psutil.NoSuchProcess:
            pass
    return own, kids


def sample(pids: dict[str, int], n: int = 3) -> dict[str, tuple[float, float]]:
    """Mean (own, descendants) PSS per key over ``n`` samples one second apart."""
    acc = {k: [0.0, 0.0] for k in pids}
    for i in range(n):
        if i:
            time.sleep(1.0)
        for k, pid in pids.items():
            own, kids = pss_tree(pid)
            acc[k][0] += own / n
            acc[k][1] += kids / n
    return {k: (v[0], v[1]) for k, v in acc.items()}


def run_baseline(a: argparse.Namespace, common: list[str], timeout: float) -> dict[str, float]:
    procs = Procs()
    try:
        procs.start("bare", ["--child", "bare"])
        for r in range(a.ranks):
            procs.start(f"rank{r}", ["--child", "hf", "--rank", str(r), *common])
        procs.wait_ready(list(procs.procs), timeout)
        time.sleep(a.settle)
        m = sample({k: p.pid for k, p in procs.procs.items()}, a.samples)
    finally:
        procs.stop()
    bare = m.pop("bare")[0]
    ranks = sum(v[0] for v in m.values())
    workers = sum(v[1] for v in m.values())
    return {"bare": bare, "ranks": ranks, "workers": workers, "total": ranks + workers,
            "loaders": ranks - a.ranks * bare + workers}


def _token_bytes(config: str) -> float:
    """Bytes a loader holds per token: uint16 for vocabularies up to 65,536 ids, else int32."""
    from msd_dask import load_config
    from msd_dask.sources.tokenizer import make_tokenizer

    return 2.0 if make_tokenizer(load_config(config).tokenizer).vocab_size <= 1 << 16 else 4.0


#: threads of each dask worker
_DASK_THREADS = 2
#: read-ahead variants: name -> (sources' read_ahead, read_ahead_tokens); None: the config's
_NO_CAP = 10 ** 15


def _variant(v: str) -> tuple[int | None, int | None]:
    v = v.strip()
    if v == "config":
        return None, None
    if v == "nocap":
        return None, _NO_CAP
    return int(v), _NO_CAP


def _read_aheads(text: str) -> list[str]:
    """``--read-ahead``'s values, each ``config``, ``nocap`` or a number of units >= 1: checked
    before anything runs (a typo failed after the baseline's minutes, and 0 ran the config's
    read-ahead under a column saying "0, no token cap"; a review)."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    for v in values:
        if v not in ("config", "nocap") and not (v.isdigit() and int(v) >= 1):
            raise argparse.ArgumentTypeError(f"expected config, nocap or a number of units "
                                             f">= 1, got {v!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


def _variant_head(v: str, default_ra: int) -> str:
    v = v.strip()
    if v == "config":
        return f"read_ahead {default_ra} (config)"
    if v == "nocap":
        return f"{default_ra}, no token cap"
    return f"{v}, no token cap"


def start_cluster(tmp: str, workers: int, env: dict[str, str]
                  ) -> tuple[str, list[subprocess.Popen]]:
    """A ``dask scheduler`` and ``workers`` ``dask worker`` processes (``--no-nanny``, with
    the nanny's environment) for msd_dask, ``env`` added to their environment only.

    Returns the scheduler's address and the processes (scheduler first).
    """
    from bench_scheduler_bytes import _start_cluster, environ

    from msd_dask.service import EMBEDDED_DASK_CONFIG

    # a variable of --cluster-env wins over the same one of the settings' nanny environment
    config = {k: v for k, v in EMBEDDED_DASK_CONFIG.items() if k.rsplit(".", 1)[-1] not in env}
    with environ(env):
        return _start_cluster(tmp, workers, count=False, nthreads=_DASK_THREADS, config=config)


def _agent_counts(text: str, ranks: int) -> list[int]:
    """``--agents``: comma-separated agent counts, each from 0 (direct) to ``ranks``."""
    out = []
    for part in text.split(","):
        try:
            n = int(part.strip())
        except ValueError:
            raise SystemExit(f"--agents wants comma-separated integers, got {text!r}") from None
        if not 0 <= n <= ranks:
            raise SystemExit(f"--agents {n}: want 0 (direct) to {ranks} (one rank per host)")
        out.append(n)
    return out


def _hosts(ranks: int, n: int) -> list[list[int]]:
    """Ranks ``0 .. ranks-1`` as ``n`` simulated hosts of consecutive ranks (sizes differ by
    at most one)."""
    return [list(range(i * ranks // n, (i + 1) * ranks // n)) for i in range(n)]


def _agents_head(n: int, ranks: int) -> str:
    """A column's second head: how its readers read."""
    if n == 0:
        return "direct"
    sizes = sorted({len(h) for h in _hosts(ranks, n)})
    each = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    return f"{n} agent{'s' if n > 1 else ''} x {each} ranks"


def _blocks(pid: int) -> list[str]:
    """The shared memory blocks of the agent process ``pid`` (files under /dev/shm)."""
    import glob

    from msd_dask.service.agent_client import BLOCK_PREFIX, SHM_DIR

    return glob.glob(os.path.join(SHM_DIR, f"{BLOCK_PREFIX}{pid}-*"))


def _blocks_bytes(pids: list[int]) -> int:
    """Bytes the agents ``pids`` hold in shared memory blocks now."""
    total = 0
    for pid in pids:
        for path in _blocks(pid):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(path).st_blocks * 512
    return total


def _remove_blocks(pid: int) -> None:
    """Unlink what the agent ``pid`` left in shared memory (it was killed)."""
    for path in _blocks(pid):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def start_agents(procs: Procs, address: str, ranks: int, n: int, tmp: str,
                 timeout: float) -> dict[int, str]:
    """One ``msd-dask agent`` per simulated host, each on its own socket under ``tmp``;
    returns each rank's socket once every agent serves."""
    socket_of: dict[int, str] = {}
    paths = {}
    for i, host in enumerate(_hosts(ranks, n)):
        key, path = f"agent{i}", os.path.join(tmp, f"agent{i}.sock")
        if len(path.encode()) > 100:
            raise RuntimeError(f"{path}: too long for a Unix socket (set a shorter TMPDIR)")
        procs.start(key, [], argv=[
            sys.executable, "-m", "msd_dask.cli", "agent", "--scheduler", address,
            "--name", _NAME, "--ranks", f"{host[0]}-{host[-1]}", "--socket", path])
        paths[key] = path
        socket_of.update(dict.fromkeys(host, path))
    procs.wait_ready(list(paths), timeout, ready="agent of")
    for key, path in paths.items():
        if not (os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode)):
            raise RuntimeError(f"{key} said it serves, but {path} is not a socket")
    return socket_of


def run_msd(a: argparse.Namespace, common: list[str], timeout: float,
            variant: tuple[int | None, int | None], agents: int = 0) -> dict[str, float]:
    """msd_dask's processes, its sources' ``read_ahead`` and ``read_ahead_tokens`` set to
    ``variant`` (``None``: the config's); the readers read through ``agents`` host agents
    (0: directly)."""
    read_ahead, read_ahead_tokens = variant
    from bench_scheduler_bytes import stop_cluster

    from msd_dask.service.agent_client import AGENT_ENV

    with tempfile.TemporaryDirectory(prefix="bm-") as tmp:
        address, cluster = start_cluster(tmp, a.dask_workers, _cluster_env(a.cluster_env))
        procs = Procs()
        agent_pids: list[int] = []
        try:
            procs.start("serve", ["--child", "serve", "--address", address, *common,
                                  *(["--read-ahead-one", str(read_ahead)]
                                    if read_ahead is not None else []),
                                  *(["--read-ahead-tokens-one", str(read_ahead_tokens)]
                                    if read_ahead_tokens is not None else [])])
            procs.wait_ready(["serve"], timeout)
            socket_of = {}
            if agents:
                socket_of = start_agents(procs, address, a.ranks, agents, tmp, timeout)
                agent_pids = [procs.procs[f"agent{i}"].pid for i in range(agents)]
            procs.start("bare", ["--child", "bare"])
            for r in range(a.ranks):
                procs.start(f"rank{r}", ["--child", "reader", "--rank", str(r),
                                         "--address", address, *common],
                            env={AGENT_ENV: socket_of.get(r, "")})  # "": directly
            procs.wait_ready([k for k in procs.procs if k == "bare" or k.startswith("rank")],
                             timeout)
            time.sleep(a.settle)
            pids = {k: p.pid for k, p in procs.procs.items()}
            pids["scheduler"] = cluster[0].pid
            for i, w in enumerate(cluster[1:]):
                pids[f"worker{i}"] = w.pid
            m = sample(pids, a.samples)
            blocks = _blocks_bytes(agent_pids)
            held = json.loads(procs.ask("serve", "stats"))
        finally:
            try:  # the readers, then the agents, then the service and its cluster
                procs.stop([k for k in procs.procs if k == "bare" or k.startswith("rank")])
                procs.stop([k for k in procs.procs if k.startswith("agent")])
                for pid in agent_pids:
                    _remove_blocks(pid)
                procs.stop()
            finally:
                stop_cluster(cluster)
    bare = m["bare"][0]
    readers = [m[f"rank{r}"][0] for r in range(a.ranks)]
    out = {"bare": bare, "scheduler": m["scheduler"][0],
           "workers": sum(m[f"worker{i}"][0] for i in range(a.dask_workers)),
           "serve": m["serve"][0], "reader_adds": sum(x - bare for x in readers) / a.ranks,
           "token_buffers": _token_bytes(a.config) * held["tokens_buffered"],
           "loaders": held["loaders"], "hosts": agents,
           # an agent with its children (the watcher of its shared-memory blocks)
           "agents": sum(sum(m[f"agent{i}"]) for i in range(agents)),
           "agent_children": sum(m[f"agent{i}"][1] for i in range(agents)),
           "agent_blocks": blocks}
    out["total"] = (out["scheduler"] + out["workers"] + out["serve"] + out["agents"]
                    + a.ranks * out["reader_adds"])
    return out


def _cluster_env(pairs: list[str]) -> dict[str, str]:
    """``--cluster-env KEY=VALUE`` options as a dict (a malformed one is refused)."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--cluster-env wants KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def _compiled_copy(root: str) -> str:
    """Copy the msd_dask package under ``root``, compile it, put ``root`` first on PYTHONPATH.

    Returns where the child processes import msd_dask from (checked).
    """
    import compileall
    import shutil

    import msd_dask

    src = os.path.dirname(os.path.abspath(msd_dask.__file__))
    dst = os.path.join(root, "msd_dask")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    if not compileall.compile_dir(dst, quiet=1):
        raise RuntimeError(f"could not compile {dst}")
    os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    probe = ("import msd_dask.service, msd_dask.core.config, sys; "
             "print(msd_dask.__file__, msd_dask.core.config.__cached__)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=root).stdout.split()
    if not out[0].startswith(dst) or not os.path.exists(out[1]):
        raise RuntimeError(f"children would not import the compiled copy: {out}")
    return os.path.dirname(out[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", "-R", type=positive_int, default=16)
    p.add_argument("--workers", "-W", type=positive_int, default=4, help="DataLoader workers per rank")
    p.add_argument("--sources", "-S", type=positive_int, default=16, help="even: the demo's 2 sources × S/2")
    p.add_argument("--quick", action="store_true", help="(R, W, S) = (8, 2, 8)")
    p.add_argument("--smoke", action="store_true",
                   help="(R, W, S) = (2, 1, 2), 1 warm batch, 1 sample after 0.5 s (CI)")
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--root", default="data/demo")
    p.add_argument("--seq-len", type=positive_int, default=None, help="default: the config's")
    p.add_argument("--micro-batches", type=positive_int, default=None, help="default: the config's")
    p.add_argument("--warm", type=natural, default=3, help="batches each rank reads before measuring")
    p.add_argument("--settle", type=non_negative_float, default=2.0,
                   help="seconds every process holds still before the first PSS sample")
    p.add_argument("--samples", type=positive_int, default=3, help="PSS samples, one second apart")
    p.add_argument("--dask-workers", type=positive_int, default=2)
    p.add_argument("--read-ahead", type=_read_aheads, default=["config", "nocap"],
                   help="msd_dask runs, one per comma-separated value: 'config' (the sources' "
                        "read_ahead units and read_ahead_tokens cap), 'nocap' (the config's "
                        "units, no token cap), or N (N units, no token cap)")
    p.add_argument("--agents", default="0", metavar="N[,N...]",
                   help="msd_dask runs, one per comma-separated value (and --read-ahead value): "
                        "0 (default), each reader connects to the service directly; N > 0, the "
                        "R ranks as N simulated hosts, each with one `msd-dask agent` its "
                        "readers read through (MSD_DASK_AGENT), the agents counted in msd_dask's "
                        "total (e.g. --agents 0,2: both, side by side)")
    p.add_argument("--cluster-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in the environment of the dask scheduler and workers only, as a "
                        "deployment sets it for `dask scheduler` / `dask worker` (repeatable; "
                        "e.g. ARROW_DEFAULT_MEMORY_POOL=system); the HF side, the starting "
                        "process and the readers do not get it")
    p.add_argument("--timeout", type=positive_float, default=600)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--bytecode", action="store_true",
                   help="every process (both sides) loads msd_dask from compiled bytecode, as a "
                        "regular install has it: a compiled copy of the package goes first on "
                        "PYTHONPATH (this machine sets PYTHONDONTWRITEBYTECODE=1, so by default "
                        "each process compiles msd_dask's modules from source)")
    # child roles
    p.add_argument("--child", choices=["bare", "hf", "serve", "reader"], help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--read-ahead-one", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--read-ahead-tokens-one", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.quick:
        a.ranks, a.workers, a.sources = 8, 2, 8
    if a.smoke:
        a.ranks, a.workers, a.sources, a.warm, a.settle, a.samples = 2, 1, 2, 1, 0.5, 1
    if a.sources < 2 or a.sources % 2:
        p.error("--sources must be even and at least 2")
    _cluster_env(a.cluster_env)
    agent_counts = _agent_counts(a.agents, a.ranks)
    if a.child:
        {"bare": lambda: child_bare(), "hf": lambda: child_hf(a), "serve": lambda: child_serve(a),
         "reader": lambda: child_reader(a)}[a.child]()
        return 0

    # a SIGTERM unwinds like Ctrl-C: every child, socket and shared memory block is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bytecode_dir = tempfile.TemporaryDirectory() if a.bytecode else None
    if bytecode_dir is not None:
        print(f"msd_dask loaded from bytecode: {_compiled_copy(bytecode_dir.name)}")

    from msd_dask import load_config

    cfg = load_config(a.config)
    a.seq_len = a.seq_len or cfg.batch.seq_len
    a.micro_batches = a.micro_batches or cfg.batch.micro_batches
    common = ["--ranks", str(a.ranks), "--workers", str(a.workers), "--sources", str(a.sources),
              "--config", a.config, "--root", a.root, "--seq-len", str(a.seq_len),
              "--micro-batches", str(a.micro_batches), "--warm", str(a.warm)]
    variants = a.read_ahead
    default_ra = cfg.sources[0].read_ahead
    t0 = time.perf_counter()
    hf = run_baseline(a, common, a.timeout)
    cols = [(v, n) for v in variants for n in agent_counts]
    msds = [run_msd(a, common, a.timeout, _variant(v), n) for v, n in cols]
    secs = time.perf_counter() - t0
    mib = 1024 ** 2
    print(f"(R, W, S) = ({a.ranks}, {a.workers}, {a.sources}); seq_len {a.seq_len} x "
          f"{a.micro_batches} micro-batches; {a.warm} batches read per rank; "
          f"{a.dask_workers} dask workers x {_DASK_THREADS} threads; {os.cpu_count()} cores; "
          f"{secs:.0f} s" + ("; msd_dask from bytecode (--bytecode)" if a.bytecode else "")
          + "".join(f"; dask scheduler and workers with {kv}" for kv in a.cluster_env))
    print(f"bare python+torch process: {hf['bare'] / mib:.0f} MiB (baseline run), "
          + ", ".join(f"{m['bare'] / mib:.0f}" for m in msds) + " MiB (msd_dask runs)")
    print(f"{'pipeline':<50}{'PSS MiB':>10}")
    for name, v in [
        ("HF streaming: rank processes", hf["ranks"]),
        (f"HF streaming: {a.ranks * a.workers} DataLoader workers", hf["workers"]),
        ("HF streaming total (ranks + workers)", hf["total"]),
        ("HF streaming loaders (total - R x bare)", hf["loaders"]),
    ]:
        print(f"{name:<50}{v / mib:>10,.0f}")
    heads = [_variant_head(v, default_ra) for v, _ in cols]
    print(f"{'msd_dask':<50}" + "".join(f"{h:>22}" for h in heads))
    with_agents = agent_counts != [0]
    if with_agents:
        print(f"{'  readers read':<50}"
              + "".join(f"{_agents_head(n, a.ranks):>22}" for _, n in cols))
    rows: list[tuple[str, list[float | None], str]] = [
        ("scheduler", [m["scheduler"] for m in msds], "mib"),
        (f"{a.dask_workers} workers (all roles)", [m["workers"] for m in msds], "mib"),
        ("  of which loaders' token buffers "
         + ("(uint16)" if _token_bytes(a.config) == 2 else "(int32)"),
         [m["token_buffers"] for m in msds], "mib"),
        ("process that started the service", [m["serve"] for m in msds], "mib"),
        *([("host agents (with their children)", [m["agents"] if m["hosts"] else None
                                                   for m in msds], "mib"),
           ("  of which shared-memory blocks", [m["agent_blocks"] if m["hosts"] else None
                                                for m in msds], "mib"),
           ("  of which their children", [m["agent_children"] if m["hosts"] else None
                                          for m in msds], "mib")] if with_agents else []),
        ("what a reader adds to a training process", [m["reader_adds"] for m in msds], "mib"),
        (f"R x what a reader adds (R = {a.ranks})", [a.ranks * m["reader_adds"] for m in msds],
         "mib"),
        ("msd_dask total", [m["total"] for m in msds], "mib"),
        ("ratio HF loaders / msd_dask total (goal >= 13.5)",  # the headline: like for like
         [hf["loaders"] / m["total"] for m in msds], "x"),
        ("ratio HF total / msd_dask total (HF incl. torch)", [hf["total"] / m["total"] for m in msds],
         "x"),
    ]
    for name, vals, unit in rows:
        cells = ["-" if v is None else f"{v / mib:,.0f}" if unit == "mib" else f"{v:.1f}"
                 for v in vals]
        print(f"{name:<50}" + "".join(f"{c:>22}" for c in cells))
    step_tokens = a.ranks * a.micro_batches * a.seq_len
    cap = cfg.sources[0].read_ahead_tokens or cfg.prefetch * step_tokens
    print(f"config: read_ahead {default_ra} units and read_ahead_tokens "
          f"{cfg.sources[0].read_ahead_tokens} (0: prefetch x dp x micro_batches x seq_len = "
          f"{cfg.prefetch} x {a.ranks} x {a.micro_batches} x {a.seq_len} = {cap:,} tokens) per "
          "source after its shuffle window; ratios: HF loaders excludes the R training "
          "processes' own python+torch, as msd_dask total does")
    if with_agents:
        print("with agents: msd_dask total counts them (part of the service on each host); "
              "goal with 2 agents of 8 ranks at (16, 4, 16): ratio HF loaders / msd_dask >= 20")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"R": a.ranks, "W": a.workers, "S": a.sources, "hf": hf,
                       "cluster_env": _cluster_env(a.cluster_env),
                       # "hosts": agents (0: direct), "agents": their PSS
                       "msd": [dict(m, read_ahead=v) for m, (v, _) in zip(msds, cols, strict=True)]},
                      f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
