"""Bad input under ``on_error: fail`` (a clear error naming source, file and row) and
``on_error: skip`` (quarantined and counted; every other document still delivered once).

Every service of the module starts on one embedded cluster (the one ``DataService.start``
makes for ``n_workers=1, threads_per_worker=2``) and is closed before the next starts."""

from __future__ import annotations

import json
import os
import time
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from msd_dask import DataService, ServiceError
from msd_dask.core.stream import SourceStream
from msd_dask.errors import ConfigError, DataError


def _texts(f: int, n: int) -> list[str]:
    rng = np.random.default_rng(f)
    return [f"doc {f}/{i} " + "lorem ipsum " * int(rng.integers(2, 30)) for i in range(n)]


def _parquet(root: str, files: int = 3, rows: int = 20, binary: bool = False) -> set[str]:
    os.makedirs(root, exist_ok=True)
    keys = set()
    for f in range(files):
        texts = _texts(f, rows)
        col = pa.array([t.encode() for t in texts], pa.binary()) if binary else texts
        pq.write_table(pa.table({"text": col}), f"{root}/part-{f}.parquet", row_group_size=5)
        keys |= {f"part-{f}.parquet:{i}" for i in range(rows)}
    return keys


def _jsonl(root: str, files: int = 3, rows: int = 20, suffix: str = ".jsonl.zst") -> set[str]:
    os.makedirs(root, exist_ok=True)
    keys = set()
    for f in range(files):
        data = "".join(json.dumps({"text": t}) + "\n" for t in _texts(f, rows)).encode()
        if suffix.endswith(".zst"):
            data = zstandard.ZstdCompressor().compress(data)
        with open(f"{root}/part-{f}{suffix}", "wb") as fh:
            fh.write(data)
        keys |= {f"part-{f}{suffix}:{i}" for i in range(rows)}
    return keys


def _cfg(root: str, fmt: str, on_error: str, pattern: str) -> dict:
    return {"name": f"bad-{on_error}", "seed": 3, "parallel": {"dp": 1},
            "batch": {"seq_len": 512, "micro_batches": 2}, "prefetch": 2, "timeout": 30,
            "sources": [{"name": "bad", "uri": f"{root}/{pattern}", "format": fmt,
                         "on_error": on_error, "shuffle_window": 1, "read_ahead": 2}]}


@pytest.fixture(scope="module")
def address():
    from msd_dask.service.handle import _embedded_cluster

    cluster = _embedded_cluster(1, 2, None)
    try:
        yield cluster.scheduler_address
    finally:
        cluster.close()


def _fails(address: str, cfg: dict, *match: str) -> tuple[str, float]:
    """Read until the service reports the error; check it names ``match``.

    Returns the message and the seconds from the last batch read (or from the first
    request, if none was) to the error.
    """
    with DataService.start(cfg, address) as svc:
        reader = svc.reader(0)
        last = time.monotonic()
        with pytest.raises(ServiceError) as ei:
            for _ in range(200):
                next(reader)
                last = time.monotonic()
        delay = time.monotonic() - last
    msg = str(ei.value)
    for m in match:
        assert m in msg, (m, msg)
    return msg, delay


def _skips(address: str, cfg: dict, good: set[str], after_start=None) -> dict:
    """Read one whole epoch; every good document exactly once, nothing else.  Returns stats."""
    with DataService.start(cfg, address) as svc:
        if after_start is not None:
            after_start()
        reader = svc.reader(0)
        seen: list[str] = []
        extra = 2  # steps read after the first of epoch 1 (a piece is carried one step at most)
        for _ in range(200):
            b = next(reader)
            eps = [e for row in b.epochs for e in row]
            docs = [(k, c) for row in b.documents for (_, k, c) in row]
            seen += [k for (k, c), e in zip(docs, eps, strict=True) if e == 0 and c == 0]
            if eps and max(eps) >= 1:
                extra -= 1
                if extra < 0:
                    break
        stats = svc.stats()["sources"]["bad"]
    assert sorted(seen) == sorted(good)  # exactly once over the good documents
    return stats


def _quarantined(stats: dict) -> set[str]:
    """Basenames (``file`` or ``file:row``) of what was quarantined (counted once per epoch)."""
    return {os.path.basename(entry.split(" ")[2].rstrip(":")) if entry.startswith("epoch ")
            else os.path.basename(entry.split("file '")[1].split("'")[0])
            for entry in stats["quarantined"]}


def test_corrupt_parquet(tmp_path, address):
    root = str(tmp_path / "pq")
    keys = _parquet(root)
    path = f"{root}/part-1.parquet"
    off = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    with open(path, "r+b") as fh:  # corrupt row group 1 (rows 5-9); the footer stays readable
        fh.seek(off)
        fh.write(b"\xff" * 40)
    _fails(address, _cfg(root, "parquet", "fail", "*.parquet"), "source 'bad'", "part-1.parquet",
           "cannot read parquet")
    good = keys - {f"part-1.parquet:{i}" for i in range(5, 10)}
    stats = _skips(address, _cfg(root, "parquet", "skip", "*.parquet"), good)
    assert stats["quarantined_files"] >= 1 and stats["quarantined_docs"] == 0
    assert _quarantined(stats) == {"part-1.parquet"}
    # a file whose footer is garbage is refused at start, or left out under skip
    with open(f"{root}/part-1.parquet", "wb") as fh:
        fh.write(b"not parquet at all")
    with pytest.raises(DataError, match="source 'bad', file '.*part-1.parquet'"):
        DataService.start(_cfg(root, "parquet", "fail", "*.parquet"), address)
    good = {k for k in keys if not k.startswith("part-1.")}
    stats = _skips(address, _cfg(root, "parquet", "skip", "*.parquet"), good)
    assert stats["quarantined_files"] == 1  # left out at start: once
    assert _quarantined(stats) == {"part-1.parquet"}


def test_truncated_jsonl_zst(tmp_path, address):
    root = str(tmp_path / "js")
    keys = _jsonl(root)
    path = f"{root}/part-2.jsonl.zst"
    data = open(path, "rb").read()
    with open(path, "wb") as fh:
        fh.write(data[:len(data) * 2 // 3])
    _fails(address, _cfg(root, "jsonl", "fail", "*.jsonl.zst"), "source 'bad'", "part-2.jsonl.zst",
           "zstd")
    good = {k for k in keys if not k.startswith("part-2.")}
    stats = _skips(address, _cfg(root, "jsonl", "skip", "*.jsonl.zst"), good)
    assert stats["quarantined_files"] >= 1 and stats["quarantined_docs"] == 0
    assert _quarantined(stats) == {"part-2.jsonl.zst"}


def _last_in_epoch0(cfg: dict, root: str, suffix: str, files: int) -> str:
    """The file the stream reads last in epoch 0 (the one safe to delete after start)."""
    from msd_dask.formats import Unit

    units = [Unit(f"{root}/part-{f}{suffix}", 0, 0) for f in range(files)]
    stream = SourceStream("bad", units, cfg["seed"], 1, 512)
    assert stream._salt == zlib.crc32(b"bad")
    return units[int(stream.unit_order(0)[-1])].path


def test_missing_file_deleted_after_start(tmp_path, address):
    root = str(tmp_path / "js")
    files = 8
    keys = _jsonl(root, files=files, rows=20, suffix=".jsonl")
    cfg = _cfg(root, "jsonl", "fail", "*.jsonl")
    cfg["prefetch"] = 1
    victim = _last_in_epoch0(cfg, root, ".jsonl", files)
    name = os.path.basename(victim)
    backup = open(victim, "rb").read()
    with DataService.start(cfg, address) as svc:
        os.remove(victim)
        reader = svc.reader(0)
        with pytest.raises(ServiceError, match=f"source 'bad', file '.*{name}'.*No such file"):
            for _ in range(200):
                next(reader)
    with open(victim, "wb") as fh:
        fh.write(backup)
    cfg = dict(cfg)
    cfg["sources"] = [dict(cfg["sources"][0], on_error="skip")]
    good = {k for k in keys if not k.startswith(name)}
    stats = _skips(address, cfg, good, after_start=lambda: os.remove(victim))
    assert stats["quarantined_files"] >= 1 and _quarantined(stats) == {name}


def _bad_rows(root: str) -> set[str]:
    """:func:`_jsonl` (``.jsonl``) with row 3 of ``part-0.jsonl`` lacking ``text`` and row 7's
    ``text`` not text.  Returns the keys of every row."""
    keys = _jsonl(root, suffix=".jsonl")
    path = f"{root}/part-0.jsonl"
    lines = open(path).read().splitlines()
    lines[3] = json.dumps({"body": "no text here"})
    lines[7] = json.dumps({"text": 42})
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return keys


def test_row_without_text_field(tmp_path, address):
    root = str(tmp_path / "js")
    keys = _bad_rows(root)
    _fails(address, _cfg(root, "jsonl", "fail", "*.jsonl"), "source 'bad'", "part-0.jsonl", "row 3",
           "missing field 'text'")
    good = keys - {"part-0.jsonl:3", "part-0.jsonl:7"}
    stats = _skips(address, _cfg(root, "jsonl", "skip", "*.jsonl"), good)
    assert stats["quarantined_docs"] >= 2 and stats["quarantined_files"] == 0
    assert _quarantined(stats) == {"part-0.jsonl:3", "part-0.jsonl:7"}
    assert any("part-0.jsonl:3" in k and "missing field" in k for k in stats["quarantined"])
    assert any("part-0.jsonl:7" in k and "not text" in k for k in stats["quarantined"])


def test_a_failing_service_reports_its_error_promptly(tmp_path, address):
    # the error reached the reader about 10 s after its last batch: the planner first waited
    # for the scheduler to report a lost worker, which bad input never is
    root = str(tmp_path / "js")
    _bad_rows(root)
    _, delay = _fails(address, _cfg(root, "jsonl", "fail", "*.jsonl"), "row 3",
                      "missing field 'text'")
    assert delay < 4.0, f"the error came {delay:.1f} s after the last batch"


def test_invalid_utf8_in_binary_column(tmp_path, address):
    root = str(tmp_path / "pq")
    keys = _parquet(root, binary=True)
    texts = [t.encode() for t in _texts(2, 20)]
    texts[11] = b"bad \xff\xfe bytes"
    pq.write_table(pa.table({"text": pa.array(texts, pa.binary())}), f"{root}/part-2.parquet",
                   row_group_size=5)
    _fails(address, _cfg(root, "parquet", "fail", "*.parquet"), "source 'bad'", "part-2.parquet",
           "row 11", "not valid UTF-8")
    stats = _skips(address, _cfg(root, "parquet", "skip", "*.parquet"), keys - {"part-2.parquet:11"})
    assert stats["quarantined_docs"] >= 1 and _quarantined(stats) == {"part-2.parquet:11"}


def test_empty_source_is_refused_at_start(tmp_path, address):
    root = str(tmp_path / "empty")
    os.makedirs(root)
    with pytest.raises(ConfigError, match="sources\\[0\\].uri"):
        DataService.start(_cfg(root, "parquet", "fail", "*.parquet"), address)
    cfg = _cfg(root, "parquet", "skip", "*.parquet")
    with open(f"{root}/a.parquet", "wb") as fh:
        fh.write(b"garbage")
    with pytest.raises(DataError, match="source 'bad': no readable units"):
        DataService.start(cfg, address)
    with pytest.raises(ConfigError, match="sources\\[0\\].on_error"):
        DataService.start(dict(cfg, sources=[dict(cfg["sources"][0], on_error="ignore")]), address)


def test_run_says_a_start_check_in_one_line(tmp_path):
    """``msd-dask run`` of a config whose source matches no file printed the worker's
    "Compute Failed" and a traceback (the listing task raised on the embedded cluster's
    worker, which shares the command's terminal) before its one-line error (a review of
    bad input): the check's error comes back as a value, and the command says one line."""
    import subprocess
    import sys

    import yaml

    good = str(tmp_path / "good")
    _jsonl(good, files=1, rows=5)
    cfg = _cfg(good, "jsonl", "fail", "*.jsonl.zst")
    cfg["sources"].append(dict(cfg["sources"][0], name="gone", uri=str(tmp_path / "nope.jsonl")))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "msd_dask.cli", "run", str(path), "--steps", "2",
                           "--workers", "1"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr
    assert "Compute Failed" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "msd-dask run: error: config key 'sources[1].uri': path "), proc.stderr
