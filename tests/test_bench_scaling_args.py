"""``scripts/bench_scaling.py --costly`` takes a short name of msd_dask.examples.preprocess."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))

import bench_scaling  # noqa: E402

from msd_dask.config import resolve_import_path  # noqa: E402
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
