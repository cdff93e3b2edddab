"""The service reading ``s3://`` sources from a real S3 server on loopback (moto's server mode).

Worker processes get the endpoint and credentials only through each source's
``storage_options`` in the config.
"""

from __future__ import annotations

import json
import os

import pytest

from msd_dask import DataService, load_config
from msd_dask.sources.storage import list_files

from checks import check_content, check_exactly_once, read_steps, shares
from corpus import config, write_corpus

SEQ = 256


@pytest.fixture(scope="module")
def s3_corpus(s3_server, tmp_path_factory):
    """The test corpus plus 50 small JSON-lines files, uploaded to ``s3://msd-test``."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3_server["storage_options"])
    fs.mkdir("msd-test")
    root = str(tmp_path_factory.mktemp("s3corpus"))
    texts = write_corpus(root, code_rows=12, prose_rows=15)
    many: dict[tuple[str, str], str] = {}
    os.makedirs(f"{root}/many")
    for f in range(50):
        with open(f"{root}/many/doc-{f:02d}.jsonl", "w") as fh:
            for i in range(4):
                t = f"many {f}/{i}: " + "xyz " * (f % 7 + i)
                fh.write(json.dumps({"text": t}) + "\n")
                many[("many", f"doc-{f:02d}.jsonl:{i}")] = t
    for d in ("code", "prose", "many"):
        fs.put(f"{root}/{d}/", f"msd-test/{d}/", recursive=True)
    fs.invalidate_cache()
    return texts, many


def _s3_config(s3_server, **overrides):
    cfg = config("s3://msd-test", batch={"seq_len": SEQ, "micro_batches": 2}, **overrides)
    for s in cfg["sources"]:
        s["storage_options"] = s3_server["storage_options"]
    return cfg


def test_s3_glob_lists_the_keys(s3_server, s3_corpus):
    so = s3_server["storage_options"]
    assert len(list_files("s3://msd-test/many/*.jsonl", so)) == 50
    assert len(list_files("s3://msd-test/code/*.parquet", so)) == 4
    cfg = load_config(_s3_config(s3_server))
    assert cfg.sources[0].uri == "s3://msd-test/code/*.parquet"


def test_s3_sources_content_exactly_once_and_mix(s3_server, s3_corpus):
    texts, _ = s3_corpus
    with DataService.start(_s3_config(s3_server), n_workers=2, threads_per_worker=1) as svc:
        recs = read_steps(svc, 70)
    tokens = check_content(recs, texts, SEQ)
    epochs = check_exactly_once(recs, texts, SEQ)
    assert epochs["code"] >= 1 and epochs["prose"] >= 1, epochs
    got = shares(tokens)
    assert abs(got["code"] - 0.7) < 0.02 and abs(got["prose"] - 0.3) < 0.02, got


def test_s3_glob_over_many_small_keys(s3_server, s3_corpus):
    texts, many = s3_corpus
    cfg = _s3_config(s3_server)
    cfg["sources"][1] = {"name": "many", "uri": "s3://msd-test/many/*.jsonl", "format": "jsonl",
                         "weight": 0.5, "loaders": 2, "shuffle_window": 8,
                         "storage_options": s3_server["storage_options"]}
    cfg["sources"][0]["weight"] = 0.5
    with DataService.start(cfg, n_workers=2, threads_per_worker=1) as svc:
        recs = read_steps(svc, 30)
    both = {**texts, **many}
    check_content(recs, both, SEQ)
    epochs = check_exactly_once(recs, both, SEQ, min_complete=0)
    assert epochs["many"] >= 1, epochs  # (30 steps: whole epochs of the small source)


def test_s3_folder_keys_and_console_folder_markers_are_no_data_files(s3_server):
    """A glob or a folder over S3 listed a folder (a key prefix) and the zero-byte
    ``prefix/`` key the S3 console's "Create folder" makes as data files: once the glob
    had filled s3fs's listing cache, ``isdir`` was False for both, and a parquet source
    failed to start ("Parquet file size is 0 bytes").  The listing's own detail decides."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    from msd_dask.sources.discover import discover_units
    from msd_dask.sources.storage import open_source

    so = s3_server["storage_options"]
    fs = s3fs.S3FileSystem(**so)
    fs.mkdir("msd-folders")
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["x", "y"]}), buf)
    fs.pipe("msd-folders/shards/a.parquet", buf.getvalue())
    fs.pipe("msd-folders/shards/sub/b.parquet", buf.getvalue())
    fs.pipe("msd-folders/shards/empty/", b"")  # (the console's "Create folder")
    fs.invalidate_cache()
    top, both = ["msd-folders/shards/a.parquet"], ["msd-folders/shards/a.parquet",
                                                   "msd-folders/shards/sub/b.parquet"]
    for uri, paths in [("s3://msd-folders/shards/*", top), ("s3://msd-folders/shards/**", both),
                       ("s3://msd-folders/shards", both), ("s3://msd-folders/shards/", both)]:
        assert open_source(uri, so).paths == paths, uri
        cfg = load_config({"name": "f", "batch": {"seq_len": 64}, "sources": [
            {"name": "s", "uri": uri, "format": "parquet", "storage_options": so}]})
        units, _ = discover_units(cfg)
        assert sorted({path for path, _, _ in units["s"]}) == paths, uri


def test_a_source_changed_on_s3_is_listed_and_read_as_it_is_now(s3_server):
    """fsspec hands every caller of one URL and options the same filesystem object, whose
    listing cache never expires: a process that had listed a source listed it so again
    after keys were added, deleted and rewritten, and read a rewritten key by its old
    ETag (FileExpired, reported as a corrupt parquet file), so a service started again
    over the changed files failed as before (a review).  Listed and read anew now."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    from msd_dask.core.config import TokenizerConfig
    from msd_dask.core.units import Unit
    from msd_dask.sources.discover import discover_units
    from msd_dask.sources.documents import read_unit
    from msd_dask.sources.storage import source_filesystem
    from msd_dask.sources.tokenizer import make_tokenizer

    def parquet(texts: list[str], group: int) -> bytes:
        out = io.BytesIO()
        pq.write_table(pa.table({"text": texts}), out, row_group_size=group)
        return out.getvalue()

    so = s3_server["storage_options"]
    writer = s3fs.S3FileSystem(skip_instance_cache=True, **so)
    writer.mkdir("msd-changed")
    writer.pipe("msd-changed/a.parquet", parquet([f"a{i}" for i in range(10)], 5))
    writer.pipe("msd-changed/b.parquet", parquet([f"b{i}" for i in range(10)], 5))
    cfg = load_config({"name": "changed", "batch": {"seq_len": 64}, "sources": [
        {"name": "s", "uri": "s3://msd-changed/*.parquet", "format": "parquet",
         "storage_options": so}]})
    first, _ = discover_units(cfg)
    assert sorted(first["s"]) == [("msd-changed/a.parquet", 0, 0), ("msd-changed/a.parquet", 1, 5),
                                  ("msd-changed/b.parquet", 0, 0), ("msd-changed/b.parquet", 1, 5)]
    writer.pipe("msd-changed/c.parquet", parquet([f"c{i}" for i in range(10)], 5))
    writer.rm("msd-changed/b.parquet")
    writer.pipe("msd-changed/a.parquet", parquet([f"A{i}" for i in range(12)], 4))
    again, _ = discover_units(cfg)
    assert sorted(again["s"]) == [("msd-changed/a.parquet", 0, 0), ("msd-changed/a.parquet", 1, 4),
                                  ("msd-changed/a.parquet", 2, 8), ("msd-changed/c.parquet", 0, 0),
                                  ("msd-changed/c.parquet", 1, 5)]
    tok = make_tokenizer(TokenizerConfig())
    fs = source_filesystem(cfg.sources[0].uri, so)
    docs = read_unit(cfg.sources[0], fs, Unit("msd-changed/a.parquet", 1, 4), tok, [])
    assert [tok.decode(d) for d in docs] == ["A4", "A5", "A6", "A7"]
