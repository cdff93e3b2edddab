"""The public surface of msd_dask, and the pure core's independence from distributed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import msd_dask

EXPECTED = {
    "Batch",
    "Config",
    "ConfigError",
    "DataError",
    "DataService",
    "Reader",
    "ServiceError",
    "ServiceTimeoutError",
    "load_config",
}

PURE_CORE = ["core.config", "core.stream", "core.mixing", "core.packing", "core.plan", "core.balance",
             "core.cost", "sources.tokenizer"]


def test_all_is_exactly_the_public_names() -> None:
    assert len(msd_dask.__all__) == len(set(msd_dask.__all__))
    assert set(msd_dask.__all__) == EXPECTED


def test_public_names_are_importable() -> None:
    for name in EXPECTED:
        obj = getattr(msd_dask, name)
        assert obj is not None
    ns: dict[str, object] = {}
    exec("from msd_dask import *", ns)
    assert EXPECTED <= set(ns)


def test_errors_are_builtin_subclasses() -> None:
    assert issubclass(msd_dask.ConfigError, ValueError)
    assert issubclass(msd_dask.DataError, ValueError)
    assert issubclass(msd_dask.ServiceTimeoutError, TimeoutError)
    assert issubclass(msd_dask.ServiceError, RuntimeError)


def test_version() -> None:
    assert isinstance(msd_dask.__version__, str) and msd_dask.__version__


def test_pure_core_does_not_import_distributed() -> None:
    code = (
        "import importlib, json, sys\n"
        f"for m in {PURE_CORE!r}:\n"
        "    importlib.import_module('msd_dask.' + m)\n"
        "print(json.dumps(sorted(k for k in sys.modules\n"
        "                        if k == 'distributed' or k.startswith('distributed.'))))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []


def test_unknown_attribute_raises_attribute_error() -> None:
    """Public names load on first use; anything else is still an AttributeError."""
    with pytest.raises(AttributeError, match="no_such_name"):
        msd_dask.no_such_name  # noqa: B018
    assert EXPECTED <= set(dir(msd_dask))


def test_connect_without_an_address_says_where_to_find_one(monkeypatch) -> None:
    # (a Dask Client given no address starts a cluster of its own, where no service runs:
    # connect waited its whole timeout there and said the service was not on None)
    monkeypatch.delenv("MSD_DASK_AGENT", raising=False)
    with pytest.raises(ValueError, match=r"no scheduler address.*\.address"):
        msd_dask.DataService.connect(None, "demo", timeout=0.1)  # type: ignore[arg-type]
