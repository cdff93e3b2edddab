"""The service on a TLS-secured Dask cluster (distributed.security.Security)."""

from __future__ import annotations

import pytest
from distributed.security import Security

from msd_dask import DataService

from checks import check_content, record
from corpus import config, write_corpus

pytestmark = pytest.mark.integration


def test_service_over_tls(tmp_path):
    pytest.importorskip("cryptography")
    root = str(tmp_path / "c")
    texts = write_corpus(root)
    sec = Security.temporary()
    with DataService.start(config(root, name="tls"), n_workers=1, security=sec) as svc:
        address = svc.client.scheduler.address
        assert address.startswith("tls://")
        workers = svc.client.scheduler_info()["workers"]
        assert workers and all(w.startswith("tls://") for w in workers)
        # a training process connects with its own credentials and reads over TLS
        with DataService.connect(address, "tls", security=sec) as other:
            readers = [other.reader(r) for r in range(2)]
            recs = [record(next(rd)) for _ in range(5) for rd in readers]
        # without credentials the scheduler cannot even be reached
        with pytest.raises(Exception):  # noqa: B017 - distributed raises a few kinds here
            DataService.connect(address, "tls", timeout=3)
    check_content(recs, texts, 512)
