"""``DataService.start`` lists the sources' units on a Dask worker, not where it runs.

Reading parquet footers needs pyarrow and fsspec (~30 MiB in the process that
starts the service, docs/benchmarks.md, Memory); a worker reads them instead.
Each starter here runs in a fresh interpreter against real ``dask scheduler`` /
``dask worker`` processes, so what it imports can be checked.  The error texts
of a file that cannot be listed are checked by tests/integration/test_bad_input.py (it
starts services the same way); here: that the error arrives as the same
:class:`DataError`, its fields intact, from a worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from msd_dask import DataService, load_config
from msd_dask.errors import DataError, ServiceTimeoutError
from msd_dask.sources.discover import discover_units

from cluster import dask_cluster
from corpus import config, train_bpe, write_corpus

#: the libraries of the file formats and storage (distributed imports zstandard itself)
_FORMAT_LIBS = {"pyarrow", "fsspec", "s3fs"}
_FORMAT_MODULES = {"msd_dask.formats", "msd_dask.sources.storage"}

_STARTER = r"""
import json, sys
from msd_dask import DataService
from msd_dask.errors import DataError
out = {}
try:
    svc = DataService.start(json.loads(sys.argv[2]), sys.argv[1])
except DataError as e:
    out["error"] = {"type": type(e).__name__, "message": str(e), "source": e.source,
                    "path": e.path, "row": e.row}
else:
    out["units"], out["roots"] = svc.keeper.recipe["units"], svc.keeper.recipe["roots"]
    svc.close()
out["modules"] = sorted(sys.modules)
print(json.dumps(out))
"""


def _start_elsewhere(address: str, cfg: dict, cwd: str) -> dict:
    """Run ``DataService.start(cfg, address)`` in a fresh interpreter in ``cwd``."""
    res = subprocess.run([sys.executable, "-c", _STARTER, address, json.dumps(cfg)],
                         capture_output=True, text=True, timeout=240, cwd=cwd)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with dask_cluster(str(tmp_path_factory.mktemp("cluster")), n_workers=1, nthreads=2) as c:
        yield c


def test_the_starter_lists_no_file_itself(cluster, tmp_path):
    """Units listed on the worker: the same as listed here, and the starting process
    imports no format library.  The config's paths are relative to the starter's
    directory, which is not the worker's: they are resolved where the user gave them."""
    root = str(tmp_path)
    write_corpus(root)
    cfg = config(root, name="remote-listing")
    expected_units, expected_roots = discover_units(load_config(cfg))
    cfg["sources"] = [dict(s, uri=os.path.relpath(s["uri"], root)) for s in cfg["sources"]]
    assert not any(os.path.isabs(s["uri"]) for s in cfg["sources"])
    assert os.path.realpath(os.getcwd()) != os.path.realpath(root)  # the workers' directory

    got = _start_elsewhere(cluster["address"], cfg, cwd=root)

    assert "error" not in got, got.get("error")
    assert got["roots"] == expected_roots
    assert {k: [tuple(u) for u in v] for k, v in got["units"].items()} == expected_units
    assert any(p.endswith(".parquet") for p, _, _ in expected_units["code"])
    loaded = set(got["modules"])
    assert not {m.split(".")[0] for m in loaded} & _FORMAT_LIBS, sorted(
        {m.split(".")[0] for m in loaded} & _FORMAT_LIBS)
    assert not loaded & _FORMAT_MODULES, sorted(loaded & _FORMAT_MODULES)


def test_a_relative_tokenizer_path_is_resolved_where_the_user_gave_it(cluster, tmp_path):
    """``tokenizer.path`` relative to the starter's directory: the workers, in another
    directory, load the same file (it failed there: 'cannot load tokenizer')."""
    root = str(tmp_path)
    write_corpus(root)
    texts = ["hello world, some text to train on. " * 20, "def f(x): return x\n" * 20]
    train_bpe(texts, os.path.join(root, "tok.json"))
    cfg = config(root, name="relative-tokenizer")
    cfg["sources"] = [dict(s, uri=os.path.relpath(s["uri"], root)) for s in cfg["sources"]]
    cfg["tokenizer"] = {"kind": "hf", "path": "tok.json"}
    assert os.path.realpath(os.getcwd()) != os.path.realpath(root)  # the workers' directory

    got = _start_elsewhere(cluster["address"], cfg, cwd=root)

    assert "error" not in got, got.get("error")
    assert set(got["units"]) == {s["name"] for s in cfg["sources"]}


def test_a_corrupt_footer_is_the_same_data_error(cluster, tmp_path):
    """A parquet file whose footer cannot be read fails the start with the DataError the
    worker raised: its type, message and fields as :func:`discover_units` gives them here."""
    root = str(tmp_path)
    write_corpus(root)
    bad = os.path.join(root, "code", "part-2.parquet")
    with open(bad, "wb") as fh:
        fh.write(b"not parquet at all")
    cfg = config(root, name="remote-bad-footer")
    with pytest.raises(DataError) as local:
        discover_units(load_config(cfg))

    got = _start_elsewhere(cluster["address"], cfg, cwd=root)

    assert got.get("error") == {"type": "DataError", "message": str(local.value),
                                "source": "code", "path": bad, "row": None}
    assert not {m.split(".")[0] for m in got["modules"]} & _FORMAT_LIBS


def test_no_worker_is_a_clear_timeout(tmp_path, caplog):
    """An external scheduler without workers: the start says after 2 s what it waits for
    (msd-dask serve printed nothing for the config's timeout, 5 minutes by default: a
    review of the command line), then, at its timeout, that none came."""
    import logging

    write_corpus(str(tmp_path))
    with dask_cluster(str(tmp_path), n_workers=0) as c, \
            caplog.at_level(logging.WARNING, logger="msd_dask.service"):
        t0 = time.monotonic()
        with pytest.raises(ServiceTimeoutError, match=r"no Dask worker joined the scheduler at "
                           rf"{c['address']} within 3s"):
            DataService.start(config(str(tmp_path), name="no-worker"), c["address"], timeout=3)
        assert time.monotonic() - t0 < 30
    assert f"waiting up to 3s for a Dask worker to join the scheduler at {c['address']}" \
        in caplog.text


def test_a_listing_that_does_not_finish_is_a_clear_timeout(tmp_path):
    """The worker's only thread is busy: the listing waits the config's ``timeout``."""
    from distributed import Client

    write_corpus(str(tmp_path))
    with dask_cluster(str(tmp_path), n_workers=1, nthreads=1) as c, \
            Client(c["address"], timeout=30) as other:
        other.wait_for_workers(1, timeout=30)
        busy = other.submit(time.sleep, 60, pure=False)
        try:
            while not other.processing() or not any(other.processing().values()):
                time.sleep(0.05)
            cfg = config(str(tmp_path), name="slow-listing", timeout=2)
            with pytest.raises(ServiceTimeoutError, match=r"listing the units of service "
                               r"'slow-listing''s 2 source\(s\) \(code, prose\) on .* did not "
                               r"finish within 2s"):
                DataService.start(cfg, c["address"])
            assert not busy.done()  # the worker's thread was busy all along
        finally:
            # stopped, the worker would wait for the sleep, then run the queued listing
            for w in c["workers"]:
                w.kill()
                w.wait(10)
