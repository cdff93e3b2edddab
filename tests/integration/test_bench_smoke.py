"""The evidence benchmarks run end to end in their ``--smoke`` modes (tiny sizes, each about a minute).

They check that the scripts work, not the figures (those come from the
``--quick`` and full modes, see docs/benchmarks.md).  Skipped when the demo
corpus or Hugging Face ``datasets`` is missing.

The selected scripts start together, three at a time (:func:`smokes`): each spends much
of its time starting and stopping clusters or measuring idle processes, so three share
this machine's two cores well.  Each test then checks its own script's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "data", "demo")

pytestmark = pytest.mark.slow

#: each test's script and arguments (``{tmp}``: a directory of its own), the longest first
SMOKES: dict[str, tuple[str, ...]] = {
    "test_train_smoke": ("bench_train.py", "--smoke"),
    "test_throughput_smoke": ("bench_throughput.py", "--smoke", "--tokenizer", "bpe"),
    "test_scaling_smoke": ("bench_scaling.py", "--mode", "io", "--seconds", "4",
                           "--no-reference", "--data", "{tmp}/scaling", "--plot",
                           "{tmp}/scaling.png"),
    # (config read-ahead, directly and through a host agent)
    "test_memory_agents_smoke": ("bench_memory.py", "--smoke", "--read-ahead", "config",
                                 "--agents", "0,1", "--json", "{tmp}/memory.json"),
    "test_many_readers_quick": ("bench_many_readers.py", "--quick", "--json", "{tmp}/many.json"),
    "test_memory_smoke": ("bench_memory.py", "--smoke", "--read-ahead", "nocap"),
    "test_scheduler_bytes_smoke": ("bench_scheduler_bytes.py", "--smoke"),
    "test_reader_memory_smoke": ("bench_reader_memory.py", "--sources", "2"),
    "test_balance_smoke": ("bench_balance.py", "--steps", "1", "--micro-batches", "4",
                           "--scale-dp", "64", "--scale-steps", "2", "--small-steps", "20"),
    "test_idle_clients_smoke": ("bench_idle_clients.py", "--smoke"),
    # (the idle scheduler measured over half the window: over 1 s, its 10-20 ms of CPU a
    # second read as 0 ticks of 10 ms once in a CI run; over 2 s, 2-4 ticks)
    "test_idle_workers_smoke": ("bench_idle_clients.py", "--workers", "2", "--settle", "1",
                                "--window", "4", "--port", "8797"),
    "test_outliers_quick": ("bench_outliers.py", "--quick", "--min-lengths", "1025"),
}
#: what the tests need beyond the demo corpus (they skip without it; the script is not run)
NEEDS: dict[str, tuple[str, ...]] = {
    "test_train_smoke": ("datasets",),
    "test_throughput_smoke": ("datasets", "tokenizers"),
    "test_memory_smoke": ("datasets",),
    "test_memory_agents_smoke": ("datasets",),
}


def _run(script: str, *args: str, timeout: float = 240) -> str:
    # (the repository on the path of the processes a script starts: bench_many_readers'
    # reader processes import it)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, os.path.join("scripts", script), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def smokes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str, tuple[Future[str], str]]]:
    """The selected tests' scripts, started three at a time: test name -> (its stdout, as a
    future; its directory, ``{tmp}``)."""
    if not (os.path.isdir(os.path.join(DEMO, "code")) and os.path.isdir(os.path.join(DEMO, "prose"))):
        # the benchmarks read configs/demo.yaml, i.e. data/demo: write it if it is missing
        from msd_dask.examples.demo import write_demo_corpus

        write_demo_corpus(DEMO)
    selected = {item.name for item in request.session.items
                if getattr(item, "module", None) is request.module}
    pool = ThreadPoolExecutor(3, thread_name_prefix="smoke")
    futures: dict[str, tuple[Future[str], str]] = {}
    for name, (script, *args) in SMOKES.items():
        if name not in selected or not all(_importable(m) for m in NEEDS.get(name, ())):
            continue
        tmp = str(tmp_path_factory.mktemp(name))
        futures[name] = (pool.submit(_run, script, *(a.replace("{tmp}", tmp) for a in args)),
                         tmp)
    yield futures
    for f, _tmp in futures.values():
        f.cancel()
    pool.shutdown(wait=True)


def _out(smokes: dict[str, tuple[Future[str], str]], name: str) -> str:
    """``name``'s script output (each script has its own timeout; this wait allows for the
    scripts ahead of it)."""
    return smokes[name][0].result(timeout=len(smokes) * 240)


def _needs(name: str) -> None:
    """Skip ``name`` when what it needs is missing (its script was not started)."""
    for module in NEEDS.get(name, ()):
        pytest.importorskip(module, reason=f"the benchmark needs `{module}`")


def test_scheduler_bytes_smoke(smokes):
    out = _out(smokes, "test_scheduler_bytes_smoke")
    assert "ratio of scheduler bytes per batch, seq_len 1024 / 256" in out, out


def test_memory_smoke(smokes):
    """The ``nocap`` read-ahead (no token cap); :func:`test_memory_agents_smoke` runs
    ``config``, directly and through an agent, and checks its figures."""
    _needs("test_memory_smoke")
    out = _out(smokes, "test_memory_smoke")
    assert "ratio HF total / msd_dask total" in out and "msd_dask total" in out, out
    assert "8, no token cap" in out and "token buffers" in out, out


def test_memory_agents_smoke(smokes):
    """``--agents 0,1`` measures the readers directly and through a host agent in one run."""
    _needs("test_memory_agents_smoke")
    out = _out(smokes, "test_memory_agents_smoke")
    assert "direct" in out and "1 agent x 2 ranks" in out, out
    assert "host agents (with their children)" in out, out
    assert "read_ahead 8 (config)" in out and "token buffers" in out, out
    assert "ratio HF total / msd_dask total" in out, out
    with open(os.path.join(smokes["test_memory_agents_smoke"][1], "memory.json")) as f:
        direct, agent = json.load(f)["msd"]
    assert (direct["hosts"], direct["agents"], direct["agent_blocks"]) == (0, 0, 0)
    assert agent["hosts"] == 1 and agent["agents"] > 0 and agent["reader_adds"] > 0
    for m in (direct, agent):
        assert m["total"] > 0 and m["scheduler"] > 0 and m["workers"] > 0 and m["serve"] > 0
    assert agent["total"] == pytest.approx(agent["scheduler"] + agent["workers"] + agent["serve"]
                                           + agent["agents"] + 2 * agent["reader_adds"])


def test_many_readers_quick(smokes):
    """``bench_many_readers.py --quick`` (N = 16 and 32 ranks): the script works and every rank
    read every step exactly once (not the figures: docs/many_readers.md)."""
    out = _out(smokes, "test_many_readers_quick")
    for column in ("first batch s", "steps/s", "sched CPU/step ms", "svc CPU/rank-step ms",
                   "sockets sched/worker", "once"):
        assert column in out, out
    rows = [line.split() for line in out.splitlines()
            if line.split()[:2] in (["16", "2"], ["32", "4"])]  # ranks, hosts
    assert [r[0] for r in rows] == ["16", "32"] and all(r[-1] == "yes" for r in rows), out
    with open(os.path.join(smokes["test_many_readers_quick"][1], "many.json")) as f:
        figures = json.load(f)
    assert [f["ranks"] for f in figures] == [16, 32]
    for f in figures:
        assert f["once"] and not f["problems"], f
        assert f["first_batch_s"] > 0 and f["achieved_steps_per_s"] > 0, f
        assert f["sockets_scheduler"] > 0 and f["sockets_worker_max"] > 0, f


def test_throughput_smoke(smokes):
    # one tokenizer (~30 s each, the HF loaders' start and shutdown): BPE, the path that
    # trains a tokenizer file; every other integration test reads with the bytes tokenizer
    _needs("test_throughput_smoke")
    out = _out(smokes, "test_throughput_smoke")
    assert "bpe: msd_dask / HF" in out, out
    for pipeline in ("single process (limit)", "HF streaming (per rank)", "msd_dask"):
        assert f"{'bpe':<10}{pipeline}" in out, out
    assert "sched B/batch" in out, out


def test_train_smoke(smokes):
    _needs("test_train_smoke")
    out = _out(smokes, "test_train_smoke")
    assert "ratio msd_dask outliers+fit / HF" in out, out
    assert "HF streaming (per rank)" in out and "outliers+fit: planner imbalance" in out, out


def test_outliers_quick(smokes):
    """The sweep runs the planner itself; its columns hold no timing, so the gain is checked."""
    out = _out(smokes, "test_outliers_quick")
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("off ", "1025 "))}
    assert set(rows) == {"off", "1025"}, out
    assert float(rows["1025"][1]) < float(rows["off"][1]) - 0.01, out  # mean imbalance
    assert abs(float(rows["1025"][5]) - 0.6) < 0.01, out               # code's share


def test_scaling_smoke(smokes):
    """Both allocations of the elastic-loaders benchmark, a few seconds each, with the plot."""
    out = _out(smokes, "test_scaling_smoke")
    for allocation in ("fixed", "adaptive"):
        assert any(line.startswith(allocation) for line in out.splitlines()), out
    png = os.path.join(smokes["test_scaling_smoke"][1], "scaling.png")
    assert "adaptive / fixed tokens/s" in out and os.path.getsize(png) > 0, out


def test_balance_smoke(smokes):
    """One step per configuration, both workloads, one micro-batch count."""
    out = _out(smokes, "test_balance_smoke")
    assert "lognormal, 4 micro-batches per rank, 1 steps" in out, out
    assert "demo, 4 micro-batches per rank, 1 steps" in out, out
    assert "the default planner (composition)" in out and "| 1024 | 4 | 131072 |" in out, out
    assert "the planner end to end at dp = 64" in out and "| 64 × 8 | 131072 |" in out, out
    assert "the planning thread at a small step" in out and "| interpreted |" in out, out
    assert "| compiled |" in out and "interpreted / compiled: " in out, out


def test_reader_memory_smoke(smokes):
    out = _out(smokes, "test_reader_memory_smoke")
    assert "DataService.connect" in out and "all of msd_dask" in out, out


def test_idle_clients_smoke(smokes):
    out = _out(smokes, "test_idle_clients_smoke")
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["8"]]
    # clients as Dask makes them, then as msd_dask does
    assert [r[1] for r in rows] == ["Dask", "msd_dask"] and {len(r) for r in rows} == {8}, out
    for r in rows:
        assert float(r[2]) > 0 and float(r[6]) == 5.0, out  # 8 clients beat every 5 s


def test_idle_workers_smoke(smokes):
    out = _out(smokes, "test_idle_workers_smoke")
    row = [line.split() for line in out.splitlines() if line.split()[:1] == ["2"]]
    assert len(row) == 1 and len(row[0]) == 6, out
    assert float(row[0][1]) > 0 and float(row[0][4]) == 0.5, out  # 2 workers beat every 0.5 s
