"""The service on a TLS-secured Dask cluster (distributed.security.Security)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys

import pytest
from distributed.security import Security

from msd_dask import DataService
from msd_dask.errors import ServiceError

from checks import check_content, read_steps, wait_until
from cluster import dask_cluster, start_serve, workers_info
from corpus import config, write_corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: reader_proc.py, checks.py


def _polled(dask_scheduler=None) -> list[str]:
    """The services the scheduler plugin has figures of."""
    return sorted(dask_scheduler.plugins["msd_dask"].services)


def test_service_over_tls(tmp_path):
    pytest.importorskip("cryptography")
    root = str(tmp_path / "c")
    texts = write_corpus(root)
    sec = Security.temporary()
    with DataService.start(config(root, name="tls"), n_workers=1, security=sec) as svc:
        address = svc.client.scheduler.address
        assert address.startswith("tls://")
        workers = workers_info(svc.client)
        assert workers and all(w.startswith("tls://") for w in workers)
        # a training process connects with its own credentials and reads over TLS
        with DataService.connect(address, "tls", security=sec) as other:
            readers = [other.reader(r) for r in range(2)]
            recs = read_steps(other, 5, readers=readers)
        # the torch adapter takes the same credentials (it had no way to: a review)
        from msd_dask.torch import MsdIterableDataset

        ds = MsdIterableDataset(address, "tls", 0, steps=1, security=sec)
        ds.load_state_dict({"service": "tls", "rank": 0, "step": 4})  # (rank 0 returned 0-4)
        try:
            (batch,) = list(ds)
            assert batch["rank"] == 0 and batch["step"] == 5
        finally:
            ds.close()
        # the scheduler plugin's own client reaches the service over TLS too: it polled
        # nothing (and logged that at DEBUG) on a TLS cluster (a review of the plugin)
        assert wait_until(lambda: "tls" in svc.client.run_on_scheduler(_polled), timeout=30)
        # without credentials the service refuses at once, saying where to put them
        with pytest.raises(ServiceError, match="uses TLS but no credentials"):
            DataService.connect(address, "tls", timeout=3)
        # and a certificate of another authority is refused by the scheduler itself
        with pytest.raises(OSError):
            DataService.connect(address, "tls", security=Security.temporary(), timeout=3)
        # credentials with a plain address, a plain connection to the TLS scheduler, and a
        # Security with no client certificate: each a bare Dask RuntimeError, a "Connection
        # reset by peer" or a TypeError about an ssl_context (a review); each now says what
        # to give
        plain = "tcp://" + address.removeprefix("tls://")
        with pytest.raises(ServiceError, match=r"the TLS credentials given require an "
                                               r"encrypted connection: give the scheduler's "
                                               r"tls://\.\.\. address"):
            DataService.connect(plain, "tls", security=sec, timeout=3)
        with pytest.raises(ServiceError, match=r"closed the connection .*: if it uses TLS, "
                                               r"give its tls://\.\.\. address"):
            DataService.connect(plain, "tls", timeout=3)
        with pytest.raises(ServiceError, match=r"uses TLS but the security given has no "
                                               r"client certificate"):
            DataService.connect(address, "tls", security=Security(tls_ca_file=sec.tls_ca_file),
                                timeout=3)
    check_content(recs, texts, 512)


def _write_credentials(tmp_path) -> dict[str, str]:
    """One temporary self-signed certificate as files, the way dask's --tls-* options take them."""
    sec = Security.temporary()
    paths = {}
    for name, pem in (("ca", sec.tls_ca_file), ("cert", sec.tls_scheduler_cert),
                      ("key", sec.tls_scheduler_key)):
        path = tmp_path / f"{name}.pem"
        path.write_text(pem)
        paths[name] = str(path)
    return paths


def test_cli_processes_over_tls(tmp_path):
    """`dask scheduler/worker --tls-*`, `msd-dask serve --tls-*`, readers configured by Dask's
    own config (environment), each a separate process; a client without credentials is refused."""
    pytest.importorskip("cryptography")
    root = str(tmp_path / "c")
    texts = write_corpus(root)
    tls = _write_credentials(tmp_path)
    steps = 20
    with dask_cluster(str(tmp_path), n_workers=2, tls=tls) as cl:
        assert cl["address"].startswith("tls://")
        # (its connect hint names the credentials: pasted as printed, it was refused)
        serve = start_serve(config(root, name="tlsprocs"), str(tmp_path), cl["address"],
                            "--tls-ca-file", tls["ca"], "--tls-cert", tls["cert"],
                            "--tls-key", tls["key"],
                            says=f"connect with DataService.connect({cl['address']!r}, "
                                 "'tlsprocs', security=Security(...))")
        try:
            env = dict(os.environ,
                       PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       DASK_DISTRIBUTED__COMM__TLS__CA_FILE=tls["ca"],
                       DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT=tls["cert"],
                       DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY=tls["key"],
                       DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION="True")
            out = str(tmp_path / "r.pkl")
            reader = subprocess.Popen([sys.executable, os.path.join(HERE, "reader_proc.py"),
                                       cl["address"], "tlsprocs", "0,1", str(steps), out], env=env)
            assert reader.wait(240) == 0
            # without credentials the scheduler cannot be reached, and the CLI says so
            bare = subprocess.run(
                [sys.executable, "-m", "msd_dask.cli", "stats", "tlsprocs", "--scheduler",
                 cl["address"]], capture_output=True, text=True, timeout=120)
            assert bare.returncode == 2 and "uses TLS but no credentials" in bare.stderr, bare.stderr
            bare = subprocess.run(
                [sys.executable, "-m", "msd_dask.cli", "stats", "tlsprocs", "--scheduler",
                 cl["address"], "--tls-ca-file", tls["ca"]], capture_output=True, text=True,
                timeout=60)
            assert bare.returncode == 2 and "error: --tls-ca-file, --tls-cert and --tls-key go " \
                "together" in bare.stderr, bare.stderr
        finally:
            serve.send_signal(signal.SIGINT)
            serve.wait(30)
    with open(out, "rb") as f:
        recs = pickle.load(f)
    assert sorted((r["step"], r["rank"]) for r in recs) == [(s, r) for s in range(steps)
                                                            for r in (0, 1)]
    check_content(recs, texts, 512)
