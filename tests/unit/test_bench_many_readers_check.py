"""``scripts/bench_many_readers.py``'s own exactly-once verdict: what it catches."""

from __future__ import annotations

from typing import Any

import pytest
from scripts_import import load_script


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_script("bench_many_readers")


def _results(bench: Any, ranks: int, steps: int) -> dict[int, dict[str, Any]]:
    """Every rank read steps 0..steps-1; a DP group (a host's ranks) the same batches."""
    return {r: {"steps": list(range(steps)),
                "crcs": [r // bench.HOST_RANKS * 1000 + s for s in range(steps)]}
            for r in range(ranks)}


def test_every_rank_every_step_once_is_clean(bench: Any) -> None:
    assert bench.check_once(_results(bench, 2 * bench.HOST_RANKS, 5), 5,
                            2 * bench.HOST_RANKS) == []


def test_what_it_catches(bench: Any) -> None:
    ranks = 2 * bench.HOST_RANKS
    res = _results(bench, ranks, 5)
    del res[3]  # a rank whose host wrote nothing for it
    assert bench.check_once(res, 5, ranks) == ["1 rank(s) reported nothing: [3]"]
    res = _results(bench, ranks, 5)
    res[1]["steps"] = [0, 1, 1, 3, 4]  # a step twice, one lost
    res[2]["error"] = "ServiceTimeoutError: rank 2 waited"
    res[bench.HOST_RANKS]["crcs"][2] += 1  # one member of a DP group got another batch
    problems = bench.check_once(res, 5, ranks)
    assert "rank 1 read steps [0, 1, 1, 3, 4]" in problems
    assert "rank 2: ServiceTimeoutError: rank 2 waited" in problems
    assert "DP group 1: its ranks got different batches" in problems
    assert len(problems) == 3, problems


@pytest.mark.parametrize("args, says", [
    (["--idle-seconds", "-1"], "argument --idle-seconds: expected a number > 0, got '-1'"),
    (["--idle-seconds", "0"], "argument --idle-seconds: expected a number > 0, got '0'"),
    (["--steps", "1"], "argument --steps: expected a whole number >= 2, got '1'"),
    (["--dask-workers", "0"], "argument --dask-workers: expected a whole number > 0, got '0'"),
    (["--timeout", "nan"], "argument --timeout: expected a number > 0, got 'nan'"),
    (["--step-seconds", "inf"], "argument --step-seconds: expected a number > 0, got 'inf'"),
])
def test_a_bad_option_is_refused_before_anything_starts(bench: Any, args: list[str], says: str,
                                                        capsys: Any) -> None:
    # --idle-seconds -1 failed after every host connected, 0 made each net figure the gross
    # one, --steps 1 printed only nan, --dask-workers 0 a traceback after the scheduler
    # started (a review)
    with pytest.raises(SystemExit):
        bench.main(args)
    assert says in capsys.readouterr().err
