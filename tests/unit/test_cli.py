"""``msd-dask``'s arguments and errors, in this process (no cluster): a bad argument or a
missing file is one line naming it, not a traceback."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from msd_dask.cli import main


@pytest.mark.parametrize("argv, says", [
    (["run", "c.yaml", "--steps", "0"], "argument --steps: must be an integer >= 1, got 0"),
    (["run", "c.yaml", "--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    (["run", "c.yaml", "--steps", "ten"], "argument --steps: must be an integer, got 'ten'"),
    (["agent", "--scheduler", "tcp://198.18.0.1:8786", "--name", "x", "--ranks", "0-7",
      "--timeout", "0"], "argument --timeout: must be a number of seconds > 0, got 0"),
    (["stats", "s", "--scheduler", "tcp://198.18.0.1:8786", "--wait", "-1"],
     "argument --wait: must be a number of seconds >= 0, got -1"),
    (["set-weights", "s", "code=1", "--scheduler", "tcp://198.18.0.1:8786", "--wait", "inf"],
     "argument --wait: must be a number of seconds >= 0, got inf"),
    # (these exited 1 with another format: review)
    (["set-weights", "s", "code", "--scheduler", "tcp://198.18.0.1:8786"],
     "argument SOURCE=WEIGHT: expected SOURCE=WEIGHT, got 'code'"),
    (["set-weights", "s", "code=x", "--scheduler", "tcp://198.18.0.1:8786"],
     "argument SOURCE=WEIGHT: the weight of 'code' is not a number: 'x'"),
    (["set-weights", "s", "code=-1", "--scheduler", "tcp://198.18.0.1:8786"],
     "argument SOURCE=WEIGHT: the weight of 'code' must be a finite number >= 0, got -1"),
    # (a timeout past a socket's range was taken: every rank then died of OverflowError
    # in its socket's settimeout, and stats --wait 1e20 in msgpack; a review)
    (["agent", "--scheduler", "tcp://198.18.0.1:8786", "--name", "x", "--ranks", "0-7",
      "--timeout", "1e10"], "argument --timeout: must be at most 31536000 seconds (a year), "
                            "got 1e10"),
    (["stats", "s", "--scheduler", "tcp://198.18.0.1:8786", "--wait", "1e20"],
     "argument --wait: must be at most 31536000 seconds (a year), got 1e20"),
    # (demo-corpus "$OUT", the variable unset, wrote the corpus into the current directory)
    (["demo-corpus", ""], "argument out_dir: an empty path (a shell variable not set?)"),
    (["demo-corpus", " "], "argument out_dir: an empty path (a shell variable not set?)"),
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
    assert str(state) in err  # (each names the file: a review of the command line)


def test_a_tls_file_that_is_not_there_is_named(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A missing certificate gave "error: [Errno 2] No such file or directory", naming
    neither the file nor the option (a review of the command line)."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here")
    code = main(["stats", "demo", "--scheduler", "tls://198.18.0.1:8786", "--tls-ca-file",
                 str(ca), "--tls-cert", str(tmp_path / "x.pem"), "--tls-key", str(ca)])
    err = capsys.readouterr().err
    assert code == 2 and f"msd-dask stats: error: --tls-cert {tmp_path / 'x.pem'}: no such " \
        "file" in err, err


def test_a_tls_certificate_and_a_key_that_do_not_match_are_named(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key of another certificate, or the key given as the certificate, gave a bare
    OpenSSL message naming neither option nor file ("[X509: KEY_VALUES_MISMATCH]", "[SSL]
    PEM lib"; a review)."""
    pytest.importorskip("cryptography")
    from distributed.security import Security

    one, other = Security.temporary(), Security.temporary()
    files = {"ca": one.tls_ca_file, "cert": one.tls_client_cert, "key": other.tls_client_key,
             "own_key": one.tls_client_key}
    for name, pem in files.items():
        (tmp_path / f"{name}.pem").write_text(pem)
    p = {name: str(tmp_path / f"{name}.pem") for name in files}
    for cert, key in ((p["cert"], p["key"]), (p["own_key"], p["own_key"])):
        code = main(["stats", "demo", "--scheduler", "tls://198.18.0.1:8786", "--tls-ca-file",
                     p["ca"], "--tls-cert", cert, "--tls-key", key])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"msd-dask stats: error: --tls-cert {cert} and "
                                            f"--tls-key {key} are not a certificate and its "
                                            "key ("), err
        assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["validate"], ["run"], ["serve", "--scheduler",
                                                           "tcp://198.18.0.1:8786"]])
@pytest.mark.parametrize("path", ["configs/tyop.yaml", "*.yaml", "!x.yaml", "cfg: x.yaml"])
def test_a_mistyped_config_path_is_named(command: list[str], path: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """One line naming the file (it began "config key '<root>'", a key there is not); a
    path that does not exist is no YAML text (``*.yaml`` the shell left unexpanded was
    refused in the YAML parser's words, over six lines: a review)."""
    assert main([command[0], path, *command[1:]]) == 2
    assert capsys.readouterr().err == f"msd-dask {command[0]}: error: cannot read config " \
        f"file {path!r}: no such file\n"


def test_an_empty_or_null_resume_is_refused(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``--resume ""`` (``--resume "$STATE"``, the variable unset) and a file holding
    ``null`` started the service from step 0, saying nothing: the steps trained on were
    served again (a review)."""
    null = tmp_path / "null.json"
    null.write_text("null")
    for resume, says in (("", "--resume: an empty path (a shell variable not set?)"),
                         (str(null), f"--resume {null}: not a JSON state_dict: it holds null")):
        assert main(["serve", "c.yaml", "--scheduler", "tcp://198.18.0.1:8786",
                     "--resume", resume]) == 2
        assert f"msd-dask serve: error: {says}" in capsys.readouterr().err


def test_run_refuses_workers_with_a_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    """``--workers`` sizes the embedded cluster only: with ``--scheduler`` it was ignored
    without a word (a review)."""
    assert main(["run", "c.yaml", "--scheduler", "tcp://198.18.0.1:8786",
                 "--workers", "8"]) == 2
    assert "--workers sizes the embedded cluster" in capsys.readouterr().err


def test_run_refuses_tls_options_without_a_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    """``--tls-*`` are a client's credentials: an embedded cluster cannot start with them
    alone, and it failed deep in Dask ("Cluster failed to start"; a review)."""
    assert main(["run", "c.yaml", "--tls-ca-file", "ca.pem", "--tls-cert", "c.pem",
                 "--tls-key", "c.key"]) == 2
    assert "--tls-* are a client's credentials for a --scheduler" in capsys.readouterr().err


def test_an_embedded_cluster_with_a_clients_tls_alone_is_refused_naming_what_it_needs(
        tmp_path: Any) -> None:
    """A client's certificate alone cannot start an embedded cluster's scheduler and
    workers: refused, naming the missing settings, before any process starts."""
    from distributed.security import Security

    from msd_dask import DataService, ServiceError

    cfg = {"name": "tls", "batch": {"seq_len": 16},
           "sources": [{"name": "s", "uri": str(tmp_path / "d.jsonl"), "format": "jsonl"}]}
    (tmp_path / "d.jsonl").write_text('{"text": "x"}\n')
    sec = Security(tls_ca_file=__file__, tls_client_cert=__file__, tls_client_key=__file__,
                   require_encryption=True)
    with pytest.raises(ServiceError, match=r"needs certificates for its scheduler and workers "
                                           r"too \(tls_scheduler_cert, tls_worker_cert"):
        DataService.start(cfg, security=sec)


def test_a_source_whose_name_holds_an_equals_sign_can_be_weighted() -> None:
    """``pro=se=0.5`` split at the first '=': the source could never be weighted from the
    command line (a review)."""
    from msd_dask.cli import _source_weight

    assert _source_weight("pro=se=0.5") == ("pro=se", 0.5)


def test_the_agents_help_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    """Its description was one line of 270 characters, and the socket's default path was
    broken at a hyphen (a review)."""
    with pytest.raises(SystemExit):
        main(["agent", "--help"])
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100, out
    assert "/tmp/msd-dask-UID/agent-NAME.sock" in out


def test_help_keeps_the_tls_example_on_two_lines(capsys: pytest.CaptureFixture[str]) -> None:
    """A single backslash at the end of a line of the help's example joined it with the
    next (a review found the command run together)."""
    from msd_dask.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--scheduler tls://head:8786 \\\n      --tls-ca-file ca.pem" in capsys.readouterr().out


class _ServeLink:
    """What ``serve`` asks each second: the planner times out once, then a call fails on a
    closed comm while the scheduler still answers, then it answers (and serve is stopped)."""

    def __init__(self) -> None:
        self.calls = 0
        self.failed = None  # (the owner re-creates a lost planner)

    def call(self, request: Any, what: str = "") -> dict[str, Any]:
        import os
        import signal

        from msd_dask.errors import ServiceTimeoutError

        self.calls += 1
        if self.calls == 1:
            raise ServiceTimeoutError("service 's': the planner did not answer within 8s")
        if self.calls == 2:
            raise OSError("comm closed")  # (distributed's CommClosedError is an OSError)
        os.kill(os.getpid(), signal.SIGTERM)  # the operator stops it
        return {"error": None}


class _ServeHandle:
    name = "s"

    def __init__(self) -> None:
        self.link = _ServeLink()
        self.client = type("Client", (), {"status": "running"})()
        self.closed = False

    def __enter__(self) -> _ServeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True


def test_serve_keeps_serving_while_the_planner_does_not_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A planner that did not answer (ServiceTimeoutError is an OSError) made serve say it
    lost the scheduler and close the whole service, though the scheduler was fine and this
    process re-creates a lost planner (review).  It now warns and goes on; a failed call
    ends serve only if the scheduler does not answer either."""
    import signal

    from msd_dask import cli
    from msd_dask.service import DataService

    handle = _ServeHandle()
    monkeypatch.setattr(DataService, "start", lambda *a, **k: handle)
    (tmp_path / "c.yaml").write_text("(not read: the service's start is a stand-in)")
    monkeypatch.setattr(cli, "_scheduler_answers", lambda client: True)
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        code = main(["serve", str(tmp_path / "c.yaml"), "--scheduler", "tcp://198.18.0.1:8786"])
    finally:
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    err = capsys.readouterr().err
    assert code == 0 and handle.link.calls == 3 and handle.closed, err
    assert "msd-dask serve: warning: service 's': the planner did not answer" in err
    assert "lost the scheduler" not in err


@pytest.mark.parametrize("command", ["validate", "demo-corpus", "run", "serve", "set-weights",
                                     "agent", "stats", "stop"])
def test_every_argument_has_help(command: str) -> None:
    """``set-weights``' SOURCE=WEIGHT and --scheduler, and ``stats --scheduler`` had no help
    text (review)."""
    from msd_dask.cli import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command")
    parser = sub.choices[command]  # type: ignore[index]
    for action in parser._actions:
        if action.dest != "help":
            assert action.help, f"msd-dask {command} {action.option_strings or action.dest}"


def test_a_source_given_twice_to_set_weights_is_refused(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    """``code=1 code=2`` kept 2 without a word (a config refuses a key given twice); refused
    before anything connects (the scheduler's address here is never reached)."""
    assert main(["set-weights", "s", "code=1", "prose=1", "code=2",
                 "--scheduler", "tcp://198.18.0.1:8786"]) == 2
    assert "source(s) ['code'] given twice" in capsys.readouterr().err


def _config(tmp_path: Path, source: str) -> Path:
    """``tmp_path/c.yaml``: service ``v`` of rows of 8 tokens over one source, ``source``
    the entries of its mapping (``name: web, uri: ..., format: jsonl``)."""
    path = tmp_path / "c.yaml"
    path.write_text(f"name: v\nbatch: {{seq_len: 8}}\nsources:\n  - {{{source}}}\n")
    return path


def _one_file_source(tmp_path: Path, fmt: str) -> None:
    """``tmp_path/data/a.<fmt>`` of three records with a ``text`` field and an ``id``."""
    records = [{"id": i, "text": f"document {i}"} for i in range(3)]
    (tmp_path / "data").mkdir()
    if fmt == "jsonl":
        (tmp_path / "data" / "a.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), tmp_path / "data" / "a.parquet")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_validate_reads_the_fields_of_each_sources_first_record(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str) -> None:
    """A misspelt ``text_field`` passed ``msd-dask validate`` and failed only once a
    loader read the file (an audit).  Now validate names the source, the file, the row
    and what the record has; the right field passes and is listed."""
    _one_file_source(tmp_path, fmt)
    uri = str(tmp_path / "data" / f"*.{fmt}")
    for field in ("txt", "text"):
        _config(tmp_path, f"name: web, uri: '{uri}', format: {fmt}, text_field: {field}")
        code = main(["validate", str(tmp_path / "c.yaml")])
        out, err = capsys.readouterr()
        if field == "txt":
            assert code == 2 and "Traceback" not in err, err
            assert "missing field 'txt'" in err and f"a.{fmt}" in err, err
            assert "source 'web'" in err and "row 0" in err and "id, text)" in err, err
        else:
            assert code == 0, err
            assert f"'text' read from the first record of {tmp_path}/data/a.{fmt}" in out, out


def test_validate_reads_a_folders_first_file_of_its_format(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A folder uri beside a README.md: validate read the README (the first file, sorted)
    as parquet and failed, where the service reads only the parquet files."""
    _one_file_source(tmp_path, "parquet")
    (tmp_path / "data" / "README.md").write_text("# a dataset card\n")
    _config(tmp_path, f"name: web, uri: '{tmp_path}/data', format: parquet")
    code = main(["validate", str(tmp_path / "c.yaml")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"'text' read from the first record of {tmp_path}/data/a.parquet" in out, out


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_validate_reads_on_past_a_bad_first_file_of_a_source_that_skips(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], on_error: str) -> None:
    """A corrupt first file: validate refused a source under ``on_error: skip``, which the
    service starts, setting that file aside (a review of bad input).  It now reads the next
    file and warns of the one set aside; under ``fail`` the first file's error stands.  (A
    file whose first row alone is bad is not set aside: tests/unit/test_bad_documents.py.)"""
    _one_file_source(tmp_path, "jsonl")
    (tmp_path / "data" / "0.jsonl.gz").write_bytes(b"not gzip\n")  # (sorted first)
    _config(tmp_path, f"name: web, uri: '{tmp_path}/data/*.jsonl*', format: jsonl, "
                      f"on_error: {on_error}")
    code = main(["validate", str(tmp_path / "c.yaml")])
    out, err = capsys.readouterr()
    if on_error == "fail":
        assert code == 2 and "0.jsonl.gz" in err and "corrupt gzip stream" in err, err
        return
    assert code == 0, err
    assert f"'text' read from the first record of {tmp_path}/data/a.jsonl" in out, out
    assert (f"warning: set aside (on_error: skip): source 'web', file '{tmp_path}/data/"
            "0.jsonl.gz'") in out, out


def test_validate_warns_once_of_a_file_set_aside_when_listed_and_when_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: Any) -> None:
    """A corrupt first parquet file under ``on_error: skip`` is set aside both where its
    units are listed and where its first record is read: validate printed it twice, and
    the listing logged it a third time, "source 'web' quarantined source 'web', ..." (a
    review).  It is said once."""
    _one_file_source(tmp_path, "parquet")
    (tmp_path / "data" / "0.parquet").write_bytes(b"not parquet")  # (sorted first)
    _config(tmp_path, f"name: web, uri: '{tmp_path}/data/*.parquet', format: parquet, "
                      "on_error: skip")
    assert main(["validate", str(tmp_path / "c.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.count("0.parquet") == 2, out  # (the warning, and the file in the list)
    assert out.count("warning: set aside (on_error: skip): source 'web', file") == 1, out
    assert "0.parquet" not in caplog.text, caplog.text


def test_validate_warns_of_the_files_a_folder_source_leaves_out(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The start logs the files of a folder ``uri`` its format does not read; validate,
    where a user looks first, said nothing of them (a review)."""
    _one_file_source(tmp_path, "jsonl")
    (tmp_path / "data" / "b.json").write_text('{"text": "left out"}\n')
    _config(tmp_path, f"name: web, uri: '{tmp_path}/data', format: jsonl")
    assert main(["validate", str(tmp_path / "c.yaml")]) == 0
    out = capsys.readouterr().out
    assert (f"warning: left out 1 other file(s) of folder '{tmp_path}/data' that format "
            "'jsonl' does not read: b.json") in out, out


@pytest.mark.parametrize("bad", [b"\x1f\x8bnot gzip", b"{not json\n"], ids=["unreadable", "bad-rows"])
def test_validate_reads_on_past_many_bad_files_of_a_source_that_skips(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: bytes) -> None:
    """Under ``on_error: skip``, 8 files before a good one: 8 unreadable files were warnings,
    8 files of one bad row each made validate fail, though the service skips those rows
    and reads on (a review).  Both are warnings now, and the rest not checked."""
    (tmp_path / "data").mkdir()
    gz = b"\x1f\x8b" in bad
    for i in range(8):
        (tmp_path / "data" / (f"p{i}.jsonl.gz" if gz else f"p{i}.jsonl")).write_bytes(bad)
    (tmp_path / "data" / "p9.jsonl").write_text('{"text": "a good document"}\n')
    _config(tmp_path, f"name: web, uri: '{tmp_path}/data/*.jsonl*', format: jsonl, "
                      "on_error: skip")
    assert main(["validate", str(tmp_path / "c.yaml")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "no record in its first 8 files" in out, out
    assert out.count("warning: set aside" if gz else "warning: row skipped") == 8, out


def test_validate_says_when_the_first_file_has_no_record(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty first file says nothing of the fields: validate said it read them from
    its first record (review)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("")
    _config(tmp_path, f"name: web, uri: '{tmp_path}/data/*.jsonl', format: jsonl, "
                      "text_field: txt")
    # a source whose every file is empty has no document: the start fails at its first step
    # (validate said OK; a review)
    assert main(["validate", str(tmp_path / "c.yaml")]) == 2
    err = capsys.readouterr().err
    assert "source 'web': none of its 1 file(s) holds a record" in err, err
    # the next file's record is read (it stopped at the empty first one, every field
    # unchecked: a review), and its missing field named
    b = tmp_path / "data" / "b.jsonl"
    for content, code, says in (
            ('{"text": "b"}\n', 2, f"file '{b}', row 0: missing field 'txt'"),
            ('{"txt": "b"}\n', 0, f"'txt' read from the first record of {b}"),
            ('{"txt": 7}\n', 2, f"file '{b}', row 0: field 'txt' is int, not text"),
            ("\n", 2, "none of its 2 file(s) holds a record")):
        b.write_text(content)
        assert main(["validate", str(tmp_path / "c.yaml")]) == code
        said = capsys.readouterr()
        assert says in (said.err if code else said.out), said
    # more files than validate reads: the rest are not checked for a record
    for i in range(8):
        (tmp_path / "data" / f"c{i}.jsonl").write_text("")
    (tmp_path / "data" / "z.jsonl").write_text('{"txt": "z"}\n')
    assert main(["validate", str(tmp_path / "c.yaml")]) == 0
    out = capsys.readouterr().out
    assert "no record in its first 8 files" in out and "'txt' not checked" in out, out


def test_validate_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """``msd-dask validate c.yaml | head -1`` printed ``error: [Errno 32] Broken pipe`` and
    exited 2 (once in four it aborted): now it stops quietly, with SIGPIPE's status."""
    import subprocess
    import sys

    _one_file_source(tmp_path, "jsonl")
    _config(tmp_path, f"name: web, uri: '{tmp_path}/data/*.jsonl', format: jsonl")
    read, write = os.pipe()
    os.close(read)  # (the reader is gone before the first line: every write breaks the pipe)
    try:
        done = subprocess.run([sys.executable, "-m", "msd_dask.cli", "validate",
                               str(tmp_path / "c.yaml")], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 141, (done.returncode, done.stderr)


def test_a_relative_glob_that_matches_nothing_says_where_it_looked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Run from another directory, validate said only "glob 'data/...' matches no file"."""
    _config(tmp_path, "name: web, uri: 'data/web/*.jsonl', format: jsonl")
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "c.yaml"]) == 2
    err = capsys.readouterr().err
    assert "'sources[0].uri'" in err and f"as '{tmp_path}/data/web/*.jsonl'" in err, err


@pytest.mark.parametrize("uri, what", [("data/web/nope", "path"), ("data/web", "path"),
                                       ("data/web/*.jsonl", "glob"),
                                       ("data/web/part-0[01].jsonl", "glob"),
                                       ("data/{web,code}.jsonl", "glob")])
def test_a_uri_that_matches_nothing_is_called_a_path_or_a_glob(
        uri: str, what: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A plain path (no ``*``, ``?``, ``[`` nor braces) that matches nothing was called a
    glob too (a review)."""
    (tmp_path / "data" / "web").mkdir(parents=True)  # (an empty folder: no file either)
    _config(tmp_path, f"name: web, uri: '{uri}', format: jsonl")
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "c.yaml"]) == 2
    err = capsys.readouterr().err
    assert f"config key 'sources[0].uri': {what} '{uri}' matches no file" in err, err


def test_validate_names_a_format_that_does_not_read_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``format: jsonl`` over parquet files said only "row 0: invalid UTF-8: invalid start
    byte at byte 7" (a review): one line naming the key, the format, a file and the format
    that reads it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "code").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": ["x"]}), tmp_path / "code" / f"part-0000{i}.parquet")
    _config(tmp_path, "name: code, uri: 'code/*.parquet', format: jsonl")
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "c.yaml"]) == 2
    assert capsys.readouterr().err == (
        "msd-dask validate: error: config key 'sources[0].format': source 'code' has format "
        "'jsonl', but its files end in .parquet (e.g. 'part-00000.parquet'), which format "
        "'parquet' reads\n")


def _constructor(index: int, ranks: range) -> dict[str, Any]:
    """A constructor's ``stats()`` as it answers, serving ``ranks`` (rank r claimed step r)."""
    return {"index": index, "batches_built": 3, "queue_depth": {r: 1 for r in ranks},
            "last_claimed": {r: r for r in ranks}, "shown": {r: r for r in ranks},
            "returned": {r: r for r in ranks}, "returned_by": {r: r for r in ranks},
            "report_after": {}, "unclaimed": {"5/0": list(ranks)}}


@pytest.mark.parametrize("n_ranks, every", [(8, False), (200, False), (200, True)])
def test_stats_prints_a_summary_of_many_ranks(n_ranks: int, every: bool,
                                              capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``msd-dask stats`` printed every rank and each constructor's six dicts per rank: about
    ten lines of JSON per rank, 160,000 at 16,384 ranks (a review).  Beyond 64 ranks it
    prints the summary the dashboard shows (quantiles, the slowest ranks) and how many ranks
    each constructor serves; ``--ranks`` prints them all."""
    from msd_dask.core.figures import rank_figures
    from msd_dask.service import DataService

    half = n_ranks // 2
    cons = [_constructor(0, range(half)), _constructor(1, range(half, n_ranks))]

    class _Handle:
        def __enter__(self) -> _Handle:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def stats(self) -> dict[str, Any]:
            return {"sources": {}, "planner": {"steps_planned": 9},
                    "ranks": rank_figures(cons), "constructors": cons}

    monkeypatch.setattr(DataService, "connect", lambda *a, **k: _Handle())
    assert main(["stats", "demo", "--scheduler", "tcp://198.18.0.1:8786",
                 *(["--ranks"] if every else [])]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["planner"] == {"steps_planned": 9}
    if every:
        assert "rank_summary" not in out and len(out["ranks"]) == n_ranks
        assert out["constructors"] == json.loads(json.dumps(cons))
        return
    summary = out["rank_summary"]
    assert summary["ranks"] == n_ranks and summary["slowest"][0] == {
        "rank": 0, "last_claimed": 0, "queue_depth": 1}
    assert summary["last_claimed"]["max"] == n_ranks - 1
    if n_ranks <= 64:
        assert len(out["ranks"]) == n_ranks and out["constructors"] == json.loads(json.dumps(cons))
    else:
        assert out["ranks"] == {}
        assert out["constructors"] == [{"index": i, "batches_built": 3, "ranks": half}
                                       for i in range(2)]


def test_agent_refuses_a_socket_path_too_long_before_connecting(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``msd-dask agent --socket`` with a path past a Unix socket's 107 bytes connected to the
    service first (here an address no scheduler answers at), then failed with "AF_UNIX path
    too long", naming neither the path nor the limit (a review)."""
    import time

    path = "/tmp/" + "a" * 120 + ".sock"
    t0 = time.monotonic()
    code = main(["agent", "--scheduler", "tcp://198.18.0.1:8786", "--name", "x", "--ranks",
                 "0-7", "--socket", path])
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - t0 < 5, err
    assert f"msd-dask agent: error: the agent's socket path {path} is 130 bytes long" in err
    assert "at most 107 bytes" in err


@pytest.mark.parametrize("command", [
    ["run", "configs/demo.yaml"], ["serve", "configs/demo.yaml"], ["stats", "demo"],
    ["stop", "demo"], ["set-weights", "demo", "code=1"], ["agent", "demo"]])
def test_an_empty_scheduler_address_names_the_option(command: list[str],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``--scheduler "$SCHED"`` with the variable unset: Dask's "missing port number in
    address ''" named no option (a review)."""
    with pytest.raises(SystemExit) as info:
        main([*command, "--scheduler", " "])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --scheduler: an empty address" in err, err


@pytest.mark.parametrize("address, says", [
    ("ucx://127.0.0.1:1", "a scheduler is dialled over tcp, tls, ws, wss, not ucx://"),
    ("inproc://x", "not inproc://"),
    ("tcp://127.0.0.1:notaport", "expected HOST:PORT with a port from 1 to 65535"),
    ("tcp://127.0.0.1:99999", "expected HOST:PORT with a port from 1 to 65535"),
    ("tcp://host", "expected HOST:PORT"),
])
@pytest.mark.parametrize("command", [["stats", "demo"], ["agent", "demo"]])
def test_an_address_dask_cannot_dial_names_the_option(command: list[str], address: str, says: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # ucx:// failed as a traceback, a bad port as Python's "invalid literal for int()" or a
    # wait for a port out of range, naming no option (a review)
    with pytest.raises(SystemExit) as info:
        main([*command, "--scheduler", address])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --scheduler: {address!r}: " in err and says in err, err


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:8786", "127.0.0.1:8786", "tls://[::1]:8786",
                                     " ws://h.example:80 "])
def test_an_address_dask_dials_is_taken(address: str) -> None:
    from msd_dask.cli import _nonempty_address

    assert _nonempty_address(address) == address.strip()


def test_an_agent_sharing_with_a_group_needs_a_socket_path(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The default socket folder is the user's alone (mode 0700): ``--group`` without
    ``--socket`` is an error of the command, said before anything connects."""
    assert main(["agent", "--scheduler", "tcp://198.18.0.1:8786", "--name", "svc",
                 "--ranks", "0-7", "--group", "0"]) == 2
    err = capsys.readouterr().err
    assert "msd-dask agent: error: --group needs --socket" in err, err


_OWN_FORMATS = '''
from msd_dask.formats import Unit


class Rows:
    suffixes = (".txt",)

    def units(self, fs, path):
        return [Unit(path)]

    def read(self, fs, unit, fields):
        yield 0, {"text": "a line"}


class TupleUnits(Rows):
    def units(self, fs, path):
        return [(path, 0, 0)]


class NoneUnits(Rows):
    def units(self, fs, path):
        return None


class NotARecord(Rows):
    def read(self, fs, unit, fields):
        yield 0, "a line"


class BadSuffixes(Rows):
    suffixes = (".txt", None)
'''


@pytest.mark.parametrize("name, says", [
    ("TupleUnits", "units\\(\\) of file '.*a.txt' gave \\('.*a.txt', 0, 0\\), not a list of "
                   "msd_dask.formats.Unit"),
    ("NoneUnits", "units\\(\\) of file '.*a.txt' gave None, not a list of "
                  "msd_dask.formats.Unit"),
    ("NotARecord", "read a str from file '.*a.txt', row 0, not a record"),
    ("BadSuffixes", "has suffixes \\('.txt', None\\): a string, or a tuple of strings"),
])
def test_validate_refuses_a_format_that_breaks_its_contract(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        name: str, says: str) -> None:
    """A format of one's own whose units() gave tuples or None, whose records were no mapping,
    or whose suffixes held a None passed validate and stopped the start with Python's words
    in a worker's traceback, naming neither the source nor the format (a review): the key
    ``sources[0].format`` is named, at validate and at the start's listing."""
    import re

    from msd_dask.errors import ConfigError
    from msd_dask.sources.check import load_config
    from msd_dask.sources.discover import discover_units

    (tmp_path / "ownfmts.py").write_text(_OWN_FORMATS)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("a line\n")
    cfg = _config(tmp_path, f"name: web, uri: '{tmp_path}/data/a.txt', format: 'ownfmts:{name}'")
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "sources[0].format" in err and re.search(says, err), err
    if name in ("TupleUnits", "NoneUnits"):
        with pytest.raises(ConfigError, match=r"sources\[0\]\.format.*" + says):
            discover_units(load_config(str(cfg)))
    assert main(["validate", str(_config(tmp_path, f"name: web, uri: '{tmp_path}/data/a.txt', "
                                                   "format: 'ownfmts:Rows'"))]) == 0


def test_validate_lists_every_files_units_as_the_start_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """validate read the first file alone: a later file that cannot be read said OK, and the
    start stopped on it (a review).  Under ``on_error: skip`` such files are set aside, as
    the service does, and 8 unreadable files before a good one are no error."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "data" / "p0.parquet")
    (tmp_path / "data" / "p1.parquet").write_bytes(b"not parquet")
    cfg = _config(tmp_path, f"name: web, uri: '{tmp_path}/data/*.parquet', format: parquet")
    assert main(["validate", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "p1.parquet" in err and "cannot read parquet" in err, err
    skip = _config(tmp_path, f"name: web, uri: '{tmp_path}/data/*.parquet', format: parquet, "
                             "on_error: skip")
    assert main(["validate", str(skip)]) == 0
    out = capsys.readouterr().out
    assert "2 file(s), 1 unit(s)" in out and "set aside (on_error: skip)" in out, out
    # eight unreadable files first: validate refused, where the service sets them aside
    (tmp_path / "data" / "p0.parquet").rename(tmp_path / "data" / "p9.parquet")
    for i in range(8):
        (tmp_path / "data" / f"p{i}.parquet").write_bytes(b"not parquet")
    assert main(["validate", str(skip)]) == 0
    out = capsys.readouterr().out
    assert "9 file(s), 1 unit(s)" in out and out.count("set aside (on_error: skip)") >= 8, out


def test_an_agent_says_what_it_waits_for_before_it_connects(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A wrong ``--name`` or an unreachable scheduler was 30 s of silence before the error (a
    review): an agent that waits says what for, and how long (not at once: its first line is
    that it serves, which wrappers wait for)."""
    import time

    from msd_dask import cli
    from msd_dask.errors import ServiceTimeoutError
    from msd_dask.service import DataService

    asked: list[float] = []

    def connect(address: str, name: str, **kwargs: Any) -> Any:
        asked.append(kwargs["timeout"])
        time.sleep(0.5)  # (the scheduler or the service does not answer at once)
        print("(connecting)", file=sys.stderr)
        raise ServiceTimeoutError(f"no service named {name!r} on {address} after 30s")

    monkeypatch.setattr(DataService, "connect", connect)
    monkeypatch.setattr(cli, "AGENT_WAIT_SAID", 0.1)
    code = main(["agent", "--scheduler", "tcp://198.18.0.1:8786", "--name", "nosuch",
                 "--ranks", "0-1"])
    err = capsys.readouterr().err
    assert code == 2 and asked == [cli.AGENT_CONNECT], err
    first, connecting = err.splitlines()[:2]
    assert first == ("msd-dask agent: waiting for service 'nosuch' on tcp://198.18.0.1:8786 "
                     "(up to 30 s for the scheduler and the service)"), err
    assert connecting == "(connecting)" and "no service named 'nosuch'" in err, err
