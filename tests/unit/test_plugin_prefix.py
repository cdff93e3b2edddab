"""The plugin's pages under the dashboard's prefix (``dask scheduler --dashboard-prefix``):
the prefix the plugin reads off the scheduler's routes, and the API URL the status page
derives from its own address.  They were served at ``/msd/...`` whatever the prefix, and the
page fetched ``/msd/api/status``, which a reverse proxy serving the dashboard under a path
of its own does not forward.  (Served by a real scheduler: tests/integration/test_dashboard_prefix.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
from types import SimpleNamespace

import pytest

from msd_dask.plugin.scheduler import _http_prefix, _page


def _routed(prefix: str | None) -> SimpleNamespace:
    """A scheduler's HTTP application as Dask builds it, with its default routes under
    ``prefix`` (Dask's own code: ``Scheduler(http_prefix=prefix)`` without a scheduler)."""
    import dask
    from distributed.http.routing import RoutingApplication
    from distributed.http.utils import get_handlers

    modules = dask.config.get("distributed.scheduler.http.routes")
    return SimpleNamespace(http_application=RoutingApplication(
        get_handlers(server=None, modules=modules, prefix=prefix)))


@pytest.mark.parametrize("prefix, expected", [
    (None, ""), ("/", ""), ("", ""), ("/dask", "/dask"), ("dask/", "/dask"),
    ("/a/b/", "/a/b"), ("/status", "/status")])
def test_the_prefix_is_read_off_the_schedulers_routes(prefix: str | None, expected: str) -> None:
    """Every way Dask takes a prefix (``--dashboard-prefix dask``, ``/dask/``...), one whose
    name is also a route's too."""
    assert _http_prefix(_routed(prefix)) == expected


def test_no_routes_no_prefix() -> None:
    assert _http_prefix(SimpleNamespace()) == ""


_STUBS = """
const urls=[];
globalThis.location={pathname:%s,search:%s};
globalThis.fetch=u=>{urls.push(u);return Promise.resolve({json:()=>Promise.resolve({services:{}})})};
globalThis.document={getElementById:()=>({})};
globalThis.setInterval=()=>0;
"""


@pytest.mark.parametrize("path, search, api", [
    ("/msd/status", "", "/msd/api/status"),
    ("/msd/status/", "", "/msd/api/status"),
    ("/dask/msd/status", "", "/dask/msd/api/status"),
    ("/a/b/msd/status/", "", "/a/b/msd/api/status"),
    # behind a proxy that serves the dashboard under a path of its own (and a token)
    ("/user/me/proxy/8787/dask/msd/status", "?token=x",
     "/user/me/proxy/8787/dask/msd/api/status?token=x")])
def test_the_page_asks_the_api_beside_it(path: str, search: str, api: str) -> None:
    """The page's own script (in Node), at ``path``: the URL it fetches its figures from."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("no Node.js on this machine to run the page's script")
    page = _page()
    script = page[page.index("<script>") + len("<script>"):page.index("</script>")]
    program = (_STUBS % (json.dumps(path), json.dumps(search)) + script
               + "\nsetTimeout(()=>console.log(JSON.stringify(urls)),50);")
    out = subprocess.run([node, "-e", program], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [api]
