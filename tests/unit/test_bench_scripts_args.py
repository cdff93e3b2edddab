"""Options of the benchmark scripts that a review found broken: bench_outliers'
``--min-lengths`` took only integers (``0.5`` and ``auto`` are config values), and
bench_balance's ``--write`` recorded a command other than the one run."""

from __future__ import annotations

import os
import sys
from typing import Any

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "scripts")
sys.path.insert(0, SCRIPTS)

import bench_balance  # noqa: E402
import bench_outliers  # noqa: E402


def test_min_lengths_are_the_configs_values() -> None:
    assert [bench_outliers._min_length(x) for x in "auto,0.5,1500, 0.375".split(",")] == \
        ["auto", 0.5, 1500, 0.375]


def test_write_records_the_command_run(tmp_path: Any) -> None:
    out = tmp_path / "bench.md"
    out.write_text("# Benchmarks\n")
    args = ["--quick", "--micro-batches", "1", "--no-compose", "--scale-dp", "0",
            "--small-steps", "0", "--root", str(tmp_path / "none")]
    assert bench_balance.main([args[0], "--write", str(out), *args[1:]]) == 0
    text = out.read_text()
    assert ("Command: `python scripts/bench_balance.py --quick --micro-batches 1 --no-compose "
            f"--scale-dp 0 --small-steps 0 --root {tmp_path / 'none'}`") in text
    assert "**End to end**" not in text  # (no such table was made)


def test_write_keeps_the_sections_prose_and_takes_the_runs_tables(tmp_path: Any) -> None:
    """``--write`` into a Balance section there already replaced the whole section with the
    script's own short prose: the prose people had written there, what the figures mean,
    was lost (found rewriting docs/benchmarks.md).  Now only the tables (by title) and the
    command change; a run with none of the section's tables writes nothing."""
    import pytest

    out = tmp_path / "bench.md"
    out.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    args = ["--quick", "--micro-batches", "1", "--no-compose", "--scale-dp", "0",
            "--small-steps", "0", "--root", str(tmp_path / "none")]
    assert bench_balance.main(["--write", str(out), *args]) == 0
    first = out.read_text()
    edited = first.replace("**Reading it.**", "**Reading it.** Written by hand.")
    table = next(line for line in first.split("\n") if line.startswith("| 8 |"))
    edited = edited.replace(table, "| 8 | stale |")
    edited = edited.replace("--scale-dp 0", "--scale-dp 0 --old")
    out.write_text(edited)
    assert bench_balance.main(["--write", str(out), *args[:1], "--steps", "1", *args[1:]]) == 0
    again = out.read_text()
    assert "Written by hand." in again and "| 8 | stale |" not in again
    assert "Command: `python scripts/bench_balance.py --quick --steps 1 --micro-batches 1" in again
    assert "--old" not in again and again.count("## Balance") == 1 and "kept" in again
    # a section with none of the run's tables: refused, the file as it was
    other = again.replace("**lognormal, 1 micro-batch", "**lognormal, one micro-batch")
    out.write_text(other)
    with pytest.raises(SystemExit, match="none of the tables"):
        bench_balance.main(["--write", str(out), *args])
    assert out.read_text() == other


def _scripts() -> list[str]:
    return sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".py"))


def test_every_script_answers_help() -> None:
    """Each script under ``scripts/`` answers ``--help`` with what it does (baselines.py, a
    module the benchmarks share, printed nothing and exited 0: review)."""
    import subprocess

    assert "baselines.py" in _scripts()
    for name in _scripts():
        res = subprocess.run([sys.executable, os.path.join(SCRIPTS, name), "--help"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, (name, res.stderr[-2000:])
        assert len(res.stdout.splitlines()) >= 10, (name, res.stdout)


def test_bench_poll_measures_what_reaches_the_scheduler(capsys: Any) -> None:
    """The poll's answer to the scheduler stays a few hundred bytes whatever the ranks, where
    the constructors' stats as they are grow with them."""
    import bench_poll

    assert bench_poll.main(["--ranks", "256,2048", "--repeat", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["256", "2,048"]
    small, large = (int(r[4].replace(",", "")) for r in rows)
    whole = [int(r[-1].replace(",", "")) for r in rows]
    assert small < 1000 and large < 1000 and whole[1] > 8 * whole[0] > 8 * large
