"""Every test of ``tests/integration`` starts real Dask processes (a scheduler, workers, a
client; in this process or in subprocesses): each is marked ``integration``, so
``pytest -m "not integration"`` (or ``pytest tests/unit``) runs only the fast, pure ones."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # the hook sees every collected item: mark only this folder's
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
