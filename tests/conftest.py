"""Shared fixtures: the small test corpus, a BPE tokenizer trained on it, and a loopback S3
server (moto's server mode); and how the suite's two processes share the tests.

``pytest`` runs the suite in two processes (pyproject's ``addopts``: pytest-xdist,
``--dist loadgroup``): ``tests/integration`` in one, in its order, and ``tests/unit`` in
the other at a lower CPU priority (``tests/unit/conftest.py``).  The integration tests
start Dask processes and use about one of this machine's two cores on average, in
bursts; the unit tests fill what the bursts leave, and the integration tests' timings
stay what they are alone.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # (before xdist's, which reads the groups)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put every test of a folder in one xdist group: each folder's tests run in one process."""
    for item in items:
        folder = item.path.relative_to(HERE).parts[0]
        item.add_marker(pytest.mark.xdist_group(folder))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The small two-source corpus of ``tests/corpus.py``, once per test module.

    Returns ``(root, {(source, key): text})``.
    """
    from corpus import write_corpus

    root = str(tmp_path_factory.mktemp("corpus"))
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def bpe(corpus, tmp_path_factory):
    """A small byte-level BPE ``tokenizer.json`` trained on the corpus's texts, once per test module."""
    from corpus import train_bpe

    _, texts = corpus
    return train_bpe(list(texts.values()), str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """Start ``python -m moto.server`` on 127.0.0.1 for the session.

    Yields ``{"endpoint_url", "key", "secret", "storage_options"}``; the
    credentials reach s3fs only through ``storage_options`` (no AWS variables
    are set in this process).
    """
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-p", str(port), "-H", "127.0.0.1"],
                            stdout=log, stderr=log, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {proc.returncode}")
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("moto server did not answer within 60s") from None
                time.sleep(0.2)
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": endpoint}}
        yield {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
               "storage_options": options}
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
