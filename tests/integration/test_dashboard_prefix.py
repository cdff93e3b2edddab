"""The plugin's pages on a scheduler that serves its dashboard under a prefix
(``dask scheduler --dashboard-prefix``, for a reverse proxy that forwards only that path):
they were served at ``/msd/...`` whatever the prefix, and ``DataService.dashboard_link``
left the prefix out."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

from msd_dask import DataService

from cluster import dask_cluster, http_get
from corpus import config, write_corpus

PREFIX = "/dask/x"


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_the_pages_are_served_under_the_dashboards_prefix(tmp_path: Path) -> None:
    root = str(tmp_path / "corpus")
    write_corpus(root)
    with dask_cluster(str(tmp_path), n_workers=1, preload="msd_dask.plugin",
                      dashboard_prefix=PREFIX) as cl:
        with DataService.start(config(root, name="pfx"), cl["address"]) as svc:
            port = svc.client.scheduler_info()["services"]["dashboard"]
            host = f"http://127.0.0.1:{port}"
            # Dask's own link leaves the prefix out (its template has none): the service's
            # link has it
            assert svc.dashboard_link.endswith(f":{port}{PREFIX}/msd/status"), svc.dashboard_link
            page = http_get(svc.dashboard_link)
            assert "msd_dask services" in page
            assert "msd_dask services" in http_get(host + PREFIX + "/msd/status/")
            deadline = time.monotonic() + 30
            while "pfx" not in json.loads(http_get(host + PREFIX + "/msd/api/status"))["services"]:
                assert time.monotonic() < deadline, "the plugin never reported the service"
                time.sleep(0.5)
            status = json.loads(http_get(host + PREFIX + "/msd/api/status/"))["services"]["pfx"]
            assert set(status["sources"]) == {"code", "prose"}
            # only under the prefix, as Dask's own pages (the prefix's proxy forwards
            # nothing else)
            assert _status(host + "/msd/status") == _status(host + "/msd/api/status") == 404
            assert _status(host + PREFIX + "/status") != 404
