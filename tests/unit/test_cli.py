"""``msd-dask``'s arguments and errors, in this process (no cluster): a bad argument or a
missing file is one line naming it, not a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from msd_dask.cli import main


@pytest.mark.parametrize("argv, says", [
    (["run", "c.yaml", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    (["run", "c.yaml", "--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    (["run", "c.yaml", "--steps", "ten"], "argument --steps: must be an integer, got 'ten'"),
    (["agent", "--scheduler", "tcp://198.18.0.1:8786", "--name", "x", "--ranks", "0-7",
      "--timeout", "0"], "argument --timeout: must be a number of seconds > 0, got 0"),
])
def test_a_bad_argument_is_refused_by_name(argv: list[str], says: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """``run --steps 0`` used to divide by zero after starting a cluster, ``--workers 0``
    to wait for ever."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_a_missing_resume_file_is_one_error(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The state file is read before any connection (the address is never reached)."""
    missing = tmp_path / "state.json"
    code = main(["serve", "c.yaml", "--scheduler", "tcp://198.18.0.1:8786",
                 "--resume", str(missing)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("msd-dask serve: error: ") and str(missing) in err
    assert "Traceback" not in err


_FORMAT = "msd_dask.state/1"  # (STATE_FORMAT: a test of the format's change fails below)


@pytest.mark.parametrize("content, says", [
    (json.dumps({"format": _FORMAT})[:-1] + ', "planner": ', "not a JSON state_dict: Expecting value"),
    (json.dumps([["format", _FORMAT]]), "not a DataService.state_dict()"),
    (json.dumps({"format": _FORMAT, "planner": {}, "seq_len": 8, "sources": ["a"]}),
     "the state lacks ['seed']"),
    (json.dumps({"format": _FORMAT, "planner": [], "seed": 0, "seq_len": 8, "sources": ["a"]}),
     "the state has no 'planner' mapping"),
])
def test_a_bad_resume_file_is_one_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        content: str, says: str) -> None:
    """A state file that is not JSON gave a message without the file; a list or a state
    without 'seed' a traceback (review).  Each is one line, before any connection."""
    from msd_dask.roles.planner import STATE_FORMAT

    assert STATE_FORMAT == _FORMAT
    config = tmp_path / "c.yaml"
    config.write_text("name: a\nbatch: {seq_len: 8}\nsources:\n"
                      "  - {name: a, uri: 'memory://a/*.jsonl', format: jsonl}\n")
    state = tmp_path / "state.json"
    state.write_text(content)
    code = main(["serve", str(config), "--scheduler", "tcp://198.18.0.1:8786",
                 "--resume", str(state)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("msd-dask serve: error: ") and says in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    if "JSON" in says:
        assert str(state) in err


def test_a_mistyped_config_path_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "configs/tyop.yaml"]) == 2
    assert "no config file 'configs/tyop.yaml'" in capsys.readouterr().err


def test_help_keeps_the_tls_example_on_two_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """A single backslash at the end of a line of the help's example joined it with the
    next (a review found the command run together)."""
    from msd_dask.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--scheduler tls://head:8786 \\\n      --tls-ca-file ca.pem" in capsys.readouterr().out
