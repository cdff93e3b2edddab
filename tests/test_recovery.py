"""Lost roles: kill -9 the worker holding a loader, or a constructor, mid-run.

Real `dask scheduler`/`dask worker` processes (no nanny: the killed worker stays dead).
All ranks continue; every step reaches every rank exactly once and every document of an
epoch is delivered exactly once."""

from __future__ import annotations

import os
import signal
import time

import pytest

from msd_dask import DataService

from checks import check_content, check_exactly_once, record
from cluster import dask_cluster
from corpus import config, write_corpus

pytestmark = [pytest.mark.integration, pytest.mark.slow]
STEPS = 70


def _roles(svc):
    """worker address -> set of roles ('coordinator', 'constructor', 'loader')."""
    out: dict[str, set[str]] = {}
    out.setdefault(svc.coordinator._address, set()).add("coordinator")
    svc.refresh()
    for c in svc.constructors:
        out.setdefault(c._address, set()).add("constructor")
    for stats in svc.coordinator.loader_stats().result().values():
        for s in stats:
            out.setdefault(s["worker"], set()).add("loader")
    return out


def _run_with_kill(tmp_path, role):
    root = str(tmp_path / "corpus")
    texts = write_corpus(root)
    cfg = config(root, name=f"kill-{role}", timeout=90)
    cfg["sources"][1]["loaders"] = 2
    with dask_cluster(str(tmp_path), n_workers=4) as cl:
        with DataService.start(cfg, cl["address"]) as svc:
            roles = _roles(svc)
            # prefer a worker holding only that role; else one holding it with loaders
            # (never the planner's own worker: the planner cannot move)
            victims = sorted((w for w, r in roles.items()
                              if role in r and "coordinator" not in r),
                             key=lambda w: len(roles[w]))
            assert victims, f"no worker holds a {role} without the planner: {roles}"
            pid = svc.client.run(os.getpid)[victims[0]]
            readers = [svc.reader(r) for r in range(2)]
            recs = []
            for step in range(STEPS):
                if step == 25:
                    os.kill(pid, signal.SIGKILL)
                for rd in readers:
                    b = next(rd)
                    assert b.step == step and b.rank == rd.rank, (step, b.step, rd.rank)
                    recs.append(record(b))
            stats = svc.stats()
            # the lost role was re-created on a surviving worker
            deadline = time.monotonic() + 10
            while not stats["planner"]["recovered"].get(role):
                assert time.monotonic() < deadline, stats["planner"]["role_events"]
                time.sleep(0.5)
                stats = svc.stats()
            assert victims[0] not in _roles(svc)
    # every step reached every rank exactly once, in order (asserted above), and the
    # documents are the source text, each exactly once per source epoch
    assert len(recs) == 2 * STEPS
    check_content(recs, texts, 512)
    epochs = check_exactly_once(recs, texts, 512)
    assert min(epochs.values()) >= 1, epochs


def test_kill_worker_holding_a_loader(tmp_path):
    _run_with_kill(tmp_path, "loader")


def test_kill_worker_holding_a_constructor(tmp_path):
    _run_with_kill(tmp_path, "constructor")
