"""The evidence benchmarks run end to end in their ``--smoke`` modes (tiny sizes, each about a minute).

They check that the scripts work, not the figures (those come from the
``--quick`` and full modes, see docs/benchmarks.md).  Skipped when the demo
corpus or Hugging Face ``datasets`` is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "data", "demo")

pytestmark = pytest.mark.slow


def _run(script: str, *args: str, timeout: float = 240) -> str:
    proc = subprocess.run([sys.executable, os.path.join("scripts", script), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module", autouse=True)
def demo_corpus():
    """The benchmarks read configs/demo.yaml, i.e. data/demo: write it if it is missing."""
    if not (os.path.isdir(os.path.join(DEMO, "code")) and os.path.isdir(os.path.join(DEMO, "prose"))):
        from msd_dask.examples.demo import write_demo_corpus

        write_demo_corpus(DEMO)


needs_demo = pytest.mark.usefixtures("demo_corpus")


def _needs_datasets() -> None:
    pytest.importorskip("datasets", reason="the baseline needs Hugging Face `datasets`")


@needs_demo
def test_scheduler_bytes_smoke():
    out = _run("bench_scheduler_bytes.py", "--smoke")
    assert "ratio of scheduler bytes per batch, seq_len 1024 / 256" in out, out


@needs_demo
def test_memory_smoke():
    """The ``nocap`` read-ahead (no token cap); test_bench_memory.py runs ``config``, directly and
    through an agent, and checks its figures (the default ``--read-ahead config,nocap`` ran
    ``config`` directly in both tests)."""
    _needs_datasets()
    out = _run("bench_memory.py", "--smoke", "--read-ahead", "nocap")
    assert "ratio HF total / msd_dask total" in out and "msd_dask total" in out, out
    assert "8, no token cap" in out and "token buffers" in out, out


@needs_demo
def test_throughput_smoke():
    _needs_datasets()
    pytest.importorskip("tokenizers", reason="the BPE run needs Hugging Face `tokenizers`")
    # one tokenizer (~30 s each, the HF loaders' start and shutdown): BPE, the path that
    # trains a tokenizer file; every other integration test reads with the bytes tokenizer
    out = _run("bench_throughput.py", "--smoke", "--tokenizer", "bpe")
    assert "bpe: msd_dask / HF" in out, out
    for pipeline in ("single process (limit)", "HF streaming (per rank)", "msd_dask"):
        assert f"{'bpe':<10}{pipeline}" in out, out
    assert "sched B/batch" in out, out


@needs_demo
def test_train_smoke():
    _needs_datasets()
    out = _run("bench_train.py", "--smoke")
    assert "ratio msd_dask / HF" in out, out
    assert "msd_dask" in out and "HF streaming (per rank)" in out, out


@needs_demo
def test_outliers_quick():
    """The sweep runs the planner itself; its columns hold no timing, so the gain is checked."""
    out = _run("bench_outliers.py", "--quick", "--min-lengths", "1025")
    rows = {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("off ", "1025 "))}
    assert set(rows) == {"off", "1025"}, out
    assert float(rows["1025"][1]) < float(rows["off"][1]) - 0.01, out  # mean imbalance
    assert abs(float(rows["1025"][5]) - 0.6) < 0.01, out               # code's share


def test_scaling_smoke(tmp_path):
    """Both allocations of the elastic-loaders benchmark, a few seconds each, with the plot."""
    png = tmp_path / "scaling.png"
    out = _run("bench_scaling.py", "--mode", "io", "--seconds", "8", "--no-reference",
               "--data", str(tmp_path / "scaling"), "--plot", str(png))
    for allocation in ("fixed", "adaptive"):
        assert any(line.startswith(allocation) for line in out.splitlines()), out
    assert "adaptive / fixed tokens/s" in out and png.stat().st_size > 0, out


@needs_demo
def test_balance_smoke():
    """One step per configuration, both workloads, one micro-batch count."""
    out = _run("bench_balance.py", "--steps", "1", "--micro-batches", "4", "--scale-dp", "64",
               "--scale-steps", "2")
    assert "lognormal, 4 micro-batches per rank, 1 steps" in out, out
    assert "demo, 4 micro-batches per rank, 1 steps" in out, out
    assert "the default planner (composition)" in out and "| 1024 | 4 | 131072 |" in out, out
    assert "the planner end to end at dp = 64" in out and "| 64 × 8 | 131072 |" in out, out


@needs_demo
def test_reader_memory_smoke():
    out = _run("bench_reader_memory.py", "--sources", "2")
    assert "DataService.connect" in out and "all of msd_dask" in out, out


def test_idle_clients_smoke():
    out = _run("bench_idle_clients.py", "--smoke", timeout=120)
    row = [line.split() for line in out.splitlines() if line.split()[:1] == ["8"]]
    assert len(row) == 1 and len(row[0]) == 7, out
    assert float(row[0][1]) > 0 and float(row[0][5]) == 5.0, out  # 8 clients beat every 5 s
