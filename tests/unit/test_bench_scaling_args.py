"""``scripts/bench_scaling.py``: its arguments, and the pure helpers of its figures."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))

import bench_scaling  # noqa: E402

from msd_dask.core.config import resolve_import_path  # noqa: E402
from msd_dask.examples import preprocess  # noqa: E402


def test_short_name_is_the_example_preprocessor_and_a_full_path_is_kept() -> None:
    path = bench_scaling.preprocess_path("cpu_bound_py")
    assert path == "msd_dask.examples.preprocess:cpu_bound_py"
    assert resolve_import_path(path) is preprocess.cpu_bound_py
    assert bench_scaling.preprocess_path("mypkg.mod:fn") == "mypkg.mod:fn"
    cfg = bench_scaling.make_config("data", "fixed", "cpu", path)
    assert cfg["sources"][1]["preprocess"] == path


@pytest.mark.parametrize("name", ["no_such_fn", "CPU_HASH_BYTES", "_WS", "Any"])
def test_unknown_short_name_is_refused_naming_the_known_ones(name, capsys) -> None:
    with pytest.raises(ValueError, match=rf"--costly '{name}': not a function of "
                                         r"msd_dask\.examples\.preprocess \(one of .*cpu_bound_py"):
        bench_scaling.preprocess_path(name)
    with pytest.raises(SystemExit) as exc:  # before any service or measurement starts
        bench_scaling.main(["--mode", "cpu", "--costly", name])
    assert exc.value.code == 2
    assert f"--costly '{name}'" in capsys.readouterr().err


def test_loader_cpu_per_token_counts_the_window_between_two_polls() -> None:
    """Per source: the CPU seconds its loaders added between the polls over the tokens they
    read then; a slot added between the polls counts from 0, one with no new token is nan."""
    before = {"costly": [{"slot": 0, "cpu_seconds": 1.0, "tokens_read": 1000}],
              "code": [{"slot": 0, "cpu_seconds": 0.5, "tokens_read": 10}]}
    after = {"costly": [{"slot": 0, "cpu_seconds": 3.0, "tokens_read": 2000},
                        {"slot": 1, "cpu_seconds": 2.0, "tokens_read": 1000}],
             "code": [{"slot": 0, "cpu_seconds": 0.5, "tokens_read": 10}]}
    got = bench_scaling.loader_cpu_per_token(before, after)
    assert got["costly"] == pytest.approx(4.0 / 2000)
    assert got["code"] != got["code"]  # nan: nothing read in the window
    # all sources together, what the reference run takes out of the service's own CPU
    assert bench_scaling.loader_cpu_seconds(before, after) == pytest.approx(4.0)


@pytest.mark.parametrize("flag, value, says", [
    ("--repeat", "0", "a whole number > 0"), ("--service-prefetch", "0", "a whole number > 0"),
    # (a ZeroDivisionError, and ValueError's own words after the corpus was written; a review)
    ("--step-seconds", "0", "a number > 0"), ("--seconds", "-5", "a number > 0"),
    ("--pool", "process:two", "thread or process"), ("--pool", "fork:2", "thread or process"),
])
def test_bad_values_are_refused_before_anything_runs(flag, value, says, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_scaling.main(["--mode", "cpu", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected {says}" in err and repr(value) in err, err


def test_reference_only_and_no_reference_are_refused_together(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_scaling.main(["--mode", "cpu", "--reference-only", "--no-reference"])
    assert exc.value.code == 2
    assert "exclude each other" in capsys.readouterr().err


def test_the_reference_run_has_no_costly_preprocessing() -> None:
    """``--reference-only`` runs the config of the full run's "no costly" one: cpu mode
    drops the costly source's preprocessing, io mode puts both behind ``store_1x``."""
    import argparse

    def args(mode: str) -> argparse.Namespace:
        return argparse.Namespace(data="d", mode=mode, read_ahead_tokens=0, micro_batches=2,
                                  service_prefetch=8)

    cpu, io = bench_scaling.reference_config(args("cpu")), bench_scaling.reference_config(args("io"))
    assert all("preprocess" not in s for s in cpu["sources"])
    assert [s["preprocess"] for s in io["sources"]] == [bench_scaling.PREP + "store_1x"] * 2
    assert cpu["prefetch"] == 8 and cpu["batch"]["micro_batches"] == 2
    assert cpu["scaling"]["policy"] == "fixed"


def test_the_service_prefetch_is_the_configs() -> None:
    cfg = bench_scaling.make_config("data", "adaptive", "cpu", prefetch=8)
    assert cfg["prefetch"] == 8
    assert bench_scaling.make_config("data", "adaptive", "cpu")["prefetch"] == 4


def test_a_negative_idle_time_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_scaling.main(["--mode", "cpu", "--reference-only", "--idle-seconds", "-1"])
    assert exc.value.code == 2
    assert "argument --idle-seconds: expected a number >= 0, got '-1'" in capsys.readouterr().err


def test_an_idle_time_without_the_reference_alone_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_scaling.main(["--mode", "cpu", "--idle-seconds", "5"])
    assert exc.value.code == 2
    assert "--idle-seconds applies to --reference-only alone" in capsys.readouterr().err


def test_the_idle_share_splits_the_cpu_per_token() -> None:
    """0.05 CPU seconds per second with no step, at 100,000 tokens/s, are 0.5 us of a run's
    1.5 us/token: the steps add the other 1.0."""
    r = {"converged_tokens_per_s": 100_000.0, "idle_cpu_per_s": 0.05,
         "converged_cpu_per_token": 1.5e-6}
    line = bench_scaling._idle_share(r, 0.025)
    assert "50.0 ms of CPU per second (0.50 us/token at this rate)" in line, line
    assert "service's Dask settings 25.0; the steps add 1.00 us/token" in line, line
