"""The demo corpus: built from this machine's standard library, deterministic, readable."""

from __future__ import annotations

import ast
import importlib
import json
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import zstandard

from msd_dask.examples.demo import docstrings, write_demo_corpus
from msd_dask.formats import get_format
from msd_dask.sources.storage import open_source

CODE_SHARDS, PROSE_SHARDS, ROW_GROUP_SIZE = 3, 2, 16
STDLIB = Path(sysconfig.get_paths()["stdlib"])
LEFT_OUT = {"site-packages", "__pycache__", "test", "tests", "idle_test"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    out = tmp_path_factory.mktemp("demo")
    counts = write_demo_corpus(str(out), code_shards=CODE_SHARDS, prose_shards=PROSE_SHARDS,
                               row_group_size=ROW_GROUP_SIZE)
    return out, counts


def expected_code() -> dict[str, str]:
    """Every stdlib ``*.py`` file the corpus should hold, by relative path."""
    files = {}
    for full in STDLIB.rglob("*.py"):
        rel = full.relative_to(STDLIB)
        if LEFT_OUT & set(rel.parts[:-1]) or not full.is_file():
            continue
        try:
            files[rel.as_posix()] = full.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            pass
    return files


def code_shards(out: Path) -> list[list[dict[str, Any]]]:
    return [pq.read_table(out / "code" / f"part-{i:05d}.parquet").to_pylist()
            for i in range(CODE_SHARDS)]


def prose_shards(out: Path) -> list[list[dict[str, Any]]]:
    shards = []
    for i in range(PROSE_SHARDS):
        with open(out / "prose" / f"part-{i:05d}.jsonl.zst", "rb") as f:
            data = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True).read()
        shards.append([json.loads(line) for line in data.decode("utf-8").splitlines()])
    return shards


def round_robin(shards: list[list[Any]]) -> list[Any]:
    """Undo the dealing of documents to shards: document i is shard i % n, entry i // n."""
    merged = []
    for i in range(sum(len(s) for s in shards)):
        merged.append(shards[i % len(shards)][i // len(shards)])
    return merged


def test_shard_files_exist(corpus: Any) -> None:
    out, counts = corpus
    assert sorted(p.name for p in (out / "code").iterdir()) == [
        f"part-{i:05d}.parquet" for i in range(CODE_SHARDS)]
    assert sorted(p.name for p in (out / "prose").iterdir()) == [
        f"part-{i:05d}.jsonl.zst" for i in range(PROSE_SHARDS)]
    assert counts["code"] > 100 and counts["prose"] > 1000


def test_every_stdlib_file_appears_once_with_its_content(corpus: Any) -> None:
    out, counts = corpus
    rows = round_robin(code_shards(out))
    assert len(rows) == counts["code"]
    paths = [r["path"] for r in rows]
    assert paths == sorted(paths), "documents are dealt to shards in sorted order"
    assert len(set(paths)) == len(paths)
    expected = expected_code()
    assert {r["path"]: r["text"] for r in rows} == expected
    assert {"os.py", "json/decoder.py", "collections/__init__.py"} <= set(expected)
    assert not any(p.startswith(("test/", "site-packages/")) for p in paths)


def test_code_row_groups(corpus: Any) -> None:
    out, _ = corpus
    for i in range(CODE_SHARDS):
        meta = pq.ParquetFile(out / "code" / f"part-{i:05d}.parquet").metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        assert sizes and all(s == ROW_GROUP_SIZE for s in sizes[:-1])
        assert 0 < sizes[-1] <= ROW_GROUP_SIZE
        assert meta.schema.to_arrow_schema().names == ["text", "path"]


def _ast_docstrings(source: bytes) -> list[str]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(n) for n in ast.walk(ast.parse(source)) if isinstance(n, nodes)]
    return [d for d in docs if d and d.strip()]


@pytest.mark.parametrize("relpath", ["json/decoder.py", "textwrap.py", "argparse.py",
                                     "asyncio/tasks.py", "email/message.py"])
def test_prose_matches_ast_docstrings(corpus: Any, relpath: str) -> None:
    out, _ = corpus
    docs = [d for d in round_robin(prose_shards(out)) if d["origin"].startswith(relpath + ":")]
    expected = _ast_docstrings((STDLIB / relpath).read_bytes())
    assert expected, "the sample file has docstrings"
    assert Counter(d["text"] for d in docs) == Counter(expected)
    assert set(docs[0]) == {"text", "origin"}


def test_prose_origins_are_qualnames(corpus: Any) -> None:
    out, _ = corpus
    module = importlib.import_module("json.decoder")
    docs = [d for d in round_robin(prose_shards(out))
            if d["origin"].startswith("json/decoder.py:")]
    assert docs[0]["origin"] == "json/decoder.py:<module>"
    assert docs[0]["text"] == ast.get_docstring(ast.parse((STDLIB / "json/decoder.py")
                                                          .read_bytes()))
    checked = 0
    for d in docs[1:]:
        qualname = d["origin"].split(":", 1)[1]
        if "<locals>" in qualname:
            continue
        obj: Any = module
        for part in qualname.split("."):
            obj = getattr(obj, part)
        assert obj.__qualname__ == qualname
        checked += 1
    assert checked >= 3


def test_prose_counts_and_order(corpus: Any) -> None:
    out, counts = corpus
    docs = round_robin(prose_shards(out))
    assert len(docs) == counts["prose"]
    files = [d["origin"].split(":", 1)[0] for d in docs]
    assert files == sorted(files), "files' docstrings follow the sorted file order"
    assert all(d["text"].strip() for d in docs)


def test_docstrings_in_source_order_with_qualnames() -> None:
    source = '''"""Module."""
class A:
    """Class A."""
    def f(self):
        """A.f."""
        def g():
            """Inner."""
        class B:
            """B."""
    if True:
        async def h(self):
            """A.h."""
    def empty(self):
        """   """
def top():
    pass
try:
    def k():
        """k."""
except ImportError:
    pass
'''
    assert list(docstrings(source)) == [
        ("<module>", "Module."), ("A", "Class A."), ("A.f", "A.f."),
        ("A.f.<locals>.g", "Inner."), ("A.f.<locals>.B", "B."), ("A.h", "A.h."), ("k", "k.")]
    with pytest.raises(SyntaxError):
        list(docstrings("def broken(:\n"))


def test_read_back_through_storage_and_formats(corpus: Any) -> None:
    out, counts = corpus
    code = open_source(f"{out.as_posix()}/code/*.parquet")
    assert len(code.paths) == CODE_SHARDS
    parquet = get_format("parquet")
    rows = [rec for p in code.paths for unit in parquet.units(code.fs, p)
            for _, rec in parquet.read(code.fs, unit, ["path", "text"])]
    assert len(rows) == counts["code"]
    assert {r["path"]: r["text"] for r in rows} == expected_code()

    prose = open_source(f"{out.as_posix()}/prose/*.jsonl.zst")
    assert len(prose.paths) == PROSE_SHARDS
    jsonl = get_format("jsonl")
    docs = [rec for p in prose.paths for unit in jsonl.units(prose.fs, p)
            for _, rec in jsonl.read(prose.fs, unit, ["origin", "text"])]
    assert len(docs) == counts["prose"]
    assert sorted(d["origin"] for d in docs) == sorted(
        d["origin"] for s in prose_shards(out) for d in s)


@pytest.mark.slow
def test_deterministic_and_replaces_stale_shards(corpus: Any, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out, counts = corpus
    stale = [tmp_path / "code" / "part-00009.parquet", tmp_path / "prose" / "part-00002.jsonl.zst"]
    # (a shard's name that is no number is not the demo's: it was deleted too; a review)
    kept = [tmp_path / "code" / "notes.txt", tmp_path / "code" / "part-notes.parquet"]
    for p in [*stale, *kept]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"left over")
    again = write_demo_corpus(tmp_path, code_shards=CODE_SHARDS, prose_shards=PROSE_SHARDS,
                              row_group_size=ROW_GROUP_SIZE, progress=True)
    assert again == counts
    assert "demo corpus" in capsys.readouterr().err
    assert not any(p.exists() for p in stale) and all(p.exists() for p in kept)
    for p in kept:
        p.unlink()
    first = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    second = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
              if p.is_file()}
    assert first.keys() == second.keys()
    assert all(first[k] == second[k] for k in first), "two writes give identical bytes"


@pytest.mark.parametrize("kwargs", [{"code_shards": 0}, {"prose_shards": 0},
                                    {"row_group_size": 0}])
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        write_demo_corpus(tmp_path, **kwargs)


def test_only_the_shards_the_writer_names_are_stale(tmp_path: Path) -> None:
    # part-10.parquet (not a name the writer makes: 5 digits) was deleted, and a name of
    # digits int() does not read ("part-²") made the writer fail (a review)
    from msd_dask.examples.demo import _remove_stale

    names = ["part-00001.parquet", "part-00004.parquet", "part-123456.parquet", "part-10.parquet",
             "part-².parquet", "part-notes.parquet", "part-00004.jsonl"]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    _remove_stale(tmp_path, ".parquet", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["part-00001.parquet", "part-10.parquet", "part-².parquet", "part-notes.parquet",
         "part-00004.jsonl"])

