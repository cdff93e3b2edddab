"""A source's relative local path is fixed where the user gave it (``anchored``): the
units are listed on a worker, whose working directory may differ.  Every local form
fsspec reads as a relative path must be anchored, or a worker in another directory
reads other files, or none (review: ``file://demo/...`` and ``simplecache::demo/...``
were left relative, ``file:demo/...`` became ``<cwd>/file:demo/...``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from msd_dask.sources.check import anchored
from msd_dask.sources.storage import list_files


@pytest.mark.parametrize("uri", [
    "demo/a/*.jsonl", "./demo/a/*.jsonl", "file://demo/a/*.jsonl", "file:demo/a/*.jsonl",
    "local://demo/a/*.jsonl", "simplecache::demo/a/*.jsonl", "simplecache::file://demo/a/*.jsonl",
])
def test_a_relative_local_uri_lists_the_same_files_from_another_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uri: str) -> None:
    (tmp_path / "user" / "demo" / "a").mkdir(parents=True)
    (tmp_path / "worker" / "demo" / "a").mkdir(parents=True)  # a decoy where the worker runs
    for side in ("user", "worker"):
        (tmp_path / side / "demo" / "a" / f"{side}.jsonl").write_text('{"text": "x"}\n')
    monkeypatch.chdir(tmp_path / "user")
    fixed = anchored(uri)
    assert str(tmp_path / "user") in fixed
    monkeypatch.chdir(tmp_path / "worker")
    files = list_files(fixed)
    assert [Path(f).name for f in files] == ["user.jsonl"], (fixed, files)


@pytest.mark.parametrize("uri", [
    "s3://bucket/a/*.parquet", "simplecache::s3://bucket/a/*.parquet", "memory://a/*.jsonl",
    "/data/a/*.jsonl", "file:///data/a/*.jsonl",
])
def test_remote_and_absolute_uris_are_unchanged(uri: str) -> None:
    assert anchored(uri) == uri
