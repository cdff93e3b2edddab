"""Closing a service gives its roles and queues back, so a long-lived cluster can start it again."""

from __future__ import annotations

import time

import pytest
from distributed import Client, LocalCluster

from msd_dask import DataService, ServiceError
from msd_dask.roles.keys import key_prefix
from msd_dask.service.placement import REGISTRY_PREFIX

from checks import check_content, record
from corpus import config

pytestmark = pytest.mark.slow


def _actors(prefix: str, dask_worker=None) -> list[str]:
    return sorted(str(k) for k in dask_worker.state.actors if str(k).startswith(prefix))


def _keys(prefix: str, dask_scheduler=None) -> list[str]:
    return sorted(str(k) for k in dask_scheduler.tasks if str(k).startswith(prefix))


def _left(client: Client, prefix: str) -> tuple[list[str], list[str]]:
    held = [k for ks in client.run(_actors, prefix).values() for k in ks]
    return held, client.run_on_scheduler(_keys, prefix)


def test_close_releases_every_role_and_the_name_starts_again_from_step_0(corpus):
    root, texts = corpus
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address=":0") as cl, \
            Client(cl) as client:
        for round_ in range(3):
            # each service reads 4 steps of the 7 it plans ahead (rounds of 3, prefetch 4):
            # the rest are dropped with the closed service's constructors
            recs = []
            with DataService.start(config(root, name="closing"), cl.scheduler_address) as svc:
                held, _ = _left(client, key_prefix("closing"))
                assert any("loader" in k for k in held) and any("constructor" in k for k in held)
                readers = [svc.reader(r) for r in range(svc.config.parallel.world_size)]
                for step in range(4):
                    for rd in readers:
                        b = next(rd)
                        assert b.step == step, f"service {round_} read step {b.step} first"
                        recs.append(record(b))
            check_content(recs, texts, 512)
            deadline = time.monotonic() + 20
            while (left := _left(client, key_prefix("closing"))) != ([], []):
                assert time.monotonic() < deadline, (
                    f"service {round_} closed 20 s ago; still held (actors, keys): {left}")
                time.sleep(0.25)


def test_a_reader_of_a_closed_service_says_so(corpus):
    root, _ = corpus
    with LocalCluster(n_workers=1, threads_per_worker=2, dashboard_address=":0") as cl:
        with DataService.start(config(root, name="shut"), cl.scheduler_address):
            other = DataService.connect(cl.scheduler_address, "shut")
            reader = other.reader(0)
            for _ in range(3):
                next(reader)
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match="closed by its owner"):
            for _ in range(20):  # the rest of what it holds, then the notice
                next(reader)
        assert time.monotonic() - t0 < 30
        other.close()


class _ErrorLog:
    """A logging handler keeping the ERROR records of a Dask process (with their tracebacks)."""

    def __init__(self) -> None:
        import logging

        class Keep(logging.Handler):
            def __init__(self) -> None:
                super().__init__(logging.ERROR)
                self.lines: list[str] = []

            def emit(self, record: logging.LogRecord) -> None:
                import traceback

                exc = "".join(traceback.format_exception(*record.exc_info)) if record.exc_info else ""
                self.lines.append(f"{record.name}: {record.getMessage()}\n{exc}")

        self.handler = Keep()
        # Dask's own loggers do not propagate to the root logger
        for name in ("", "distributed"):
            logging.getLogger(name).addHandler(self.handler)


def _watch_errors(dask_worker=None, dask_scheduler=None) -> None:
    server = dask_worker if dask_worker is not None else dask_scheduler
    server._msd_test_errors = _ErrorLog()


def _errors_logged(dask_worker=None, dask_scheduler=None) -> list[str]:
    server = dask_worker if dask_worker is not None else dask_scheduler
    return list(server._msd_test_errors.handler.lines)


def test_closing_while_readers_wait_logs_no_error_on_the_cluster(corpus):
    """The owner closes the service while one of its readers waits in a claim and another
    has just returned a step (its report not sent yet): the waiting reader hears the
    notice at once, the other hears it without calling any role, and no worker (nor the
    scheduler) logs a call that reached a role the closed service released."""
    import threading

    root, _ = corpus
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address=":0") as cl, \
            Client(cl) as client:
        client.run(_watch_errors)
        client.run_on_scheduler(_watch_errors)
        svc = DataService.start(config(root, name="closewait", timeout=20), cl.scheduler_address)
        waiting, paused = svc.reader(0), svc.reader(1)
        read: list[int] = []
        ended: list[tuple[float, BaseException]] = []

        def read_on() -> None:  # rank 0 reads ahead until rank 1's steps fill prefetch
            try:
                while True:
                    read.append(next(waiting).step)
            except BaseException as e:  # noqa: BLE001 - what the test looks at
                ended.append((time.monotonic(), e))

        thread = threading.Thread(target=read_on, daemon=True)
        thread.start()
        for _ in range(3):
            next(paused)
        deadline = time.monotonic() + 30
        while len(read) < 4:  # rank 0 is ahead of rank 1: it waits for room in a claim
            assert time.monotonic() < deadline, f"rank 0 read only steps {read} in 30 s"
            assert not ended, ended
            time.sleep(0.02)
        time.sleep(0.3)
        closing = time.monotonic()
        svc.close()
        thread.join(10)
        assert not thread.is_alive(), "the reader waiting in a claim still waits 10 s after close"
        at, error = ended[0]
        assert isinstance(error, ServiceError) and "closed by its owner" in str(error), error
        assert at - closing < 5, f"the waiting reader heard of the close {at - closing:.1f}s later"
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match="closed by its owner"):
            for _ in range(10):  # what it still holds, then the notice
                next(paused)
        assert time.monotonic() - t0 < 5
        time.sleep(2.5)  # past the readers' report of their last steps (REPORT_IDLE)
        logged = [line for lines in client.run(_errors_logged).values() for line in lines]
        logged += client.run_on_scheduler(_errors_logged)
        bad = [line for line in logged
               if "KeyError" in line or "Exception while handling op" in line]
        assert not bad, "the cluster logged after close:\n" + "\n".join(bad)


def test_close_does_not_wait_for_ever_on_a_frozen_scheduler(corpus, tmp_path, caplog,
                                                            monkeypatch):
    """A scheduler that stops answering keeps its TCP connections, and ``close()`` (so
    ``msd-dask serve`` on SIGTERM) waited for ever to unpublish the service (review).  The
    scheduler's part is now waited for ``CLOSE_WAIT`` seconds, and the failure logged."""
    import os
    import signal
    import threading

    from msd_dask.service import handle

    from cluster import dask_cluster

    # the frozen scheduler never answers, so close() waits all of CLOSE_WAIT: a shorter
    # one shows the same bound and the same message
    monkeypatch.setattr(handle, "CLOSE_WAIT", 2.0)
    root, _ = corpus
    with dask_cluster(str(tmp_path), n_workers=1, nthreads=2) as cl:
        svc = DataService.start(config(root, name="frozen"), cl["address"])
        next(svc.reader(0))
        os.kill(cl["scheduler"].pid, signal.SIGSTOP)
        try:
            closing = threading.Thread(target=svc.close, daemon=True)
            t0 = time.monotonic()
            closing.start()
            closing.join(handle.CLOSE_WAIT + 80)
            took = time.monotonic() - t0
            assert not closing.is_alive(), f"close() still waiting after {took:.0f}s"
        finally:
            os.kill(cl["scheduler"].pid, signal.SIGCONT)
    assert f"the scheduler did not answer within {handle.CLOSE_WAIT:g}s" in caplog.text


_OWNER_AND_HANDLE = """
import json, sys, time
from msd_dask import DataService, ServiceError
if __name__ == "__main__":
    svc = DataService.start(json.loads(sys.argv[1]), n_workers=1, threads_per_worker=2)
    other = DataService.connect(svc.address, svc.name, agent=False)
    reader = other.reader(0)
    next(reader)
    svc.close()
    try:
        while True:
            next(reader)
    except ServiceError as e:
        print("reader:", e, flush=True)
    time.sleep(1.0)
"""


def test_closing_an_embedded_cluster_closes_the_processs_other_handles_on_it(corpus):
    """A handle connected in the process that started the service on its embedded cluster
    outlived the cluster: its client tried to reach the scheduler until the process exited
    and logged each try (about 40 lines of tracebacks, a new user's walk).  The owner now
    closes it first: its reader says the handle was closed, and nothing is logged."""
    import json
    import subprocess
    import sys

    root, _ = corpus
    cfg = config(root, name="ownerhandle")
    done = subprocess.run([sys.executable, "-c", _OWNER_AND_HANDLE, json.dumps(cfg)],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "reader:" in done.stdout and "closed" in done.stdout, done.stdout
    assert "ERROR" not in done.stderr and "Traceback" not in done.stderr, done.stderr


_EXITS_WITHOUT_CLOSE = """
import json, sys
from msd_dask import DataService
svc = DataService.start(json.loads(sys.argv[1]), sys.argv[2])
print("read step", next(svc.reader(0)).step, flush=True)
# no svc.close(): the interpreter exits
"""


def _until_gone(client: Client, name: str, what: str) -> None:
    deadline = time.monotonic() + 30
    while (left := _left(client, key_prefix(name))) != ([], []) or \
            REGISTRY_PREFIX + name in map(str, client.list_datasets()):
        assert time.monotonic() < deadline, f"{what}; still held (actors, keys): {left}"
        time.sleep(0.25)


def _starts_again(cfg: dict, address: str) -> None:
    with DataService.start(cfg, address) as svc:
        assert next(svc.reader(0)).step == 0


def test_a_process_exiting_without_closing_its_service_closes_it(corpus, tmp_path):
    """A script that starts a service and ends without close() used to leave it published,
    its roles on their workers and its name taken until the scheduler restarted."""
    import json
    import subprocess
    import sys

    root, _ = corpus
    cfg = config(root, name="exits")
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address=":0") as cl, \
            Client(cl) as client:
        out = subprocess.run([sys.executable, "-c", _EXITS_WITHOUT_CLOSE, json.dumps(cfg),
                              cl.scheduler_address], capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0 and "read step 0" in out.stdout, out.stdout + out.stderr
        assert "exits without closing it: closing it now" in out.stderr, out.stderr
        _until_gone(client, "exits", "the owner exited")
        _starts_again(cfg, cl.scheduler_address)


def test_stop_frees_a_service_whose_starting_process_was_killed(corpus, tmp_path):
    """``msd-dask stop``: refused while the serving process lives, then (it killed -9, so
    nothing closed the service) the roles go, the readers hear it and the name starts again."""
    import signal
    import subprocess
    import sys

    from cluster import start_serve

    root, _ = corpus
    cfg = config(root, name="killed")
    with LocalCluster(n_workers=2, threads_per_worker=2, dashboard_address=":0") as cl, \
            Client(cl) as client:
        addr = cl.scheduler_address

        def stop(name: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "msd_dask.cli", "stop", name,
                                   "--scheduler", addr], capture_output=True, text=True,
                                  timeout=120)

        serve = start_serve(cfg, str(tmp_path), addr)
        try:
            page = serve.stdout.readline()  # (its second line: where the status page is)
            assert page.startswith("status page: http") and "/msd/status" in page, page
            other = DataService.connect(addr, "killed")
            reader = other.reader(0)
            assert next(reader).step == 0
            alive = stop("killed")
            assert alive.returncode == 2 and "still connected" in alive.stderr, alive.stderr
            assert "close it there" in alive.stderr, alive.stderr
            assert next(reader).step == 1  # refused: it still serves
            # set-weights says what a source left out gets
            mixed = subprocess.run([sys.executable, "-m", "msd_dask.cli", "set-weights",
                                    "killed", "code=1", "--scheduler", addr],
                                   capture_output=True, text=True, timeout=120)
            assert mixed.returncode == 0, mixed.stderr
            assert "weights {'code': 1.0, 'prose': 0.0} take effect at step" in mixed.stdout
            assert "(prose not named: weight 0, no longer drawn)" in mixed.stdout, mixed.stdout
            serve.send_signal(signal.SIGKILL)
            serve.wait(30)
        finally:
            if serve.poll() is None:
                serve.kill()
        assert REGISTRY_PREFIX + "killed" in map(str, client.list_datasets())  # left published
        with pytest.raises(ServiceError, match="already running.*msd-dask stop killed"):
            DataService.start(cfg, addr)
        done = stop("killed")
        assert done.returncode == 0 and "stopped service 'killed'" in done.stdout, \
            done.stdout + done.stderr
        _until_gone(client, "killed", "stopped")
        # its readers hear it (no silent wait), and that it was stopped: it was not closed
        # by the owner, which was killed (they were told so)
        with pytest.raises(ServiceError, match="stopped with msd-dask stop"):
            for _ in range(10):
                next(reader)
        other.close()
        unknown = stop("killed")
        assert unknown.returncode == 2 and "no service named 'killed'" in unknown.stderr
        _starts_again(cfg, addr)
