"""The way training jobs use it: real `dask scheduler`/`dask worker` processes, the service
started by `msd-dask serve`, readers in separate Python processes connecting by name."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys

from checks import check_content, check_exactly_once, shares
from cluster import dask_cluster, start_serve
from corpus import config, write_corpus

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/: reader_proc.py, checks.py


def test_serve_and_read_from_other_processes(tmp_path):
    root = str(tmp_path / "corpus")
    texts = write_corpus(root)
    cfg = config(root, name="procs", parallel={"dp": 2, "tp": 2})
    steps = 60
    with dask_cluster(str(tmp_path), n_workers=2) as cl:
        serve = start_serve(cfg, str(tmp_path), cl["address"])
        try:
            env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
            outs = [str(tmp_path / f"r{i}.pkl") for i in range(2)]
            # ranks 0,1 share DP group 0 (tp=2); ranks 2,3 are DP group 1
            readers = [subprocess.Popen([sys.executable, os.path.join(HERE, "reader_proc.py"),
                                         cl["address"], "procs", ranks, str(steps), out], env=env)
                       for ranks, out in zip(("0,2", "1,3"), outs, strict=True)]
            for p in readers:
                assert p.wait(240) == 0
        finally:
            serve.send_signal(signal.SIGINT)
            serve.wait(30)
    recs = []
    for out in outs:
        with open(out, "rb") as f:
            recs.extend(pickle.load(f))
    by_rank = {}
    for r in recs:
        by_rank.setdefault(r["rank"], []).append(r)
    assert sorted(by_rank) == [0, 1, 2, 3]
    for rank, rs in by_rank.items():
        assert [r["step"] for r in rs] == list(range(steps)), rank
    # tensor-parallel peers receive the same batch; DP groups receive different ones
    for a, b in zip(by_rank[0], by_rank[1], strict=True):
        assert (a["input_ids"] == b["input_ids"]).all() and a["documents"] == b["documents"]
    assert any((a["input_ids"] != b["input_ids"]).any()
               for a, b in zip(by_rank[0], by_rank[2], strict=True))
    group = by_rank[0] + by_rank[2]  # one member per DP group
    tokens = check_content(group, texts, 512)
    check_exactly_once(group, texts, 512)
    got = shares(tokens)
    assert abs(got["code"] - 0.7) < 0.05, got


def test_serve_exits_with_a_clear_error_when_the_scheduler_is_lost(tmp_path):
    root = str(tmp_path / "corpus")
    write_corpus(root)
    with dask_cluster(str(tmp_path), n_workers=1) as cl:
        serve = start_serve(config(root, name="lost"), str(tmp_path), cl["address"])
        try:
            cl["scheduler"].kill()  # kill -9: no goodbye to the clients
            cl["scheduler"].wait(10)
            out, _ = serve.communicate(timeout=120)
        finally:
            if serve.poll() is None:
                serve.kill()
    assert serve.returncode == 2  # (as every other error of msd-dask's: a review)
    # the last word is one plain line (Dask may log its own comm errors before it)
    last = out.strip().splitlines()[-1]
    assert last.startswith("msd-dask serve: lost the scheduler") and "state_dict" in last, out
    # and nobody tried to re-create the planner on a scheduler that is gone
    assert "re-creating" not in out, out


def test_serve_resumes_from_a_state_file(tmp_path):
    """``msd-dask serve --resume STATE_JSON``: the restarted service says the step it
    resumes from, and serves from it the batches the first service would have (it printed
    the same banner as a fresh start, and no test ran a resume through the CLI)."""
    import json

    from msd_dask import DataService

    from checks import read_steps, record

    root = str(tmp_path / "corpus")
    write_corpus(root)
    cfg = config(root, name="resumecli")
    with dask_cluster(str(tmp_path), n_workers=1) as cl:
        serve = start_serve(cfg, str(tmp_path), cl["address"])
        try:
            svc = DataService.connect(cl["address"], "resumecli", agent=False)
            try:
                first = read_steps(svc, 7)
                state = svc.state_dict(5)
            finally:
                svc.close()
        finally:
            serve.send_signal(signal.SIGINT)
            serve.wait(60)
        path = tmp_path / "state.json"
        path.write_text(json.dumps(state))
        serve = start_serve(cfg, str(tmp_path), cl["address"], "--resume", str(path),
                            says=f"serving 'resumecli' on {cl['address']} from step 6 "
                                 "(resumed from the state of step 5)")
        try:
            svc = DataService.connect(cl["address"], "resumecli", agent=False)
            try:
                again = [record(next(svc.reader(r)))
                         for r in range(svc.config.parallel.world_size)]
            finally:
                svc.close()
        finally:
            serve.send_signal(signal.SIGINT)
            serve.wait(60)
    want = [r for r in first if r["step"] == 6]
    assert [r["step"] for r in again] == [6] * len(want)
    for a, b in zip(again, want, strict=True):
        assert a["rank"] == b["rank"] and a["documents"] == b["documents"]
        assert (a["input_ids"] == b["input_ids"]).all()


def test_ctrl_c_on_run_stops_it_plainly(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: each worker process of the
    embedded cluster printed a traceback of its own (four in all) while msd-dask run closed
    the cluster anyway (a review of the command line).  Now: exit status 130, no traceback,
    no process left."""
    import json
    import time

    root = str(tmp_path / "corpus")
    write_corpus(root)
    path = str(tmp_path / "run.json")
    with open(path, "w") as f:
        json.dump(config(root, name="ctrlc"), f)
    proc = subprocess.Popen([sys.executable, "-m", "msd_dask.cli", "run", path, "--steps",
                             "1000000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        group = os.getpgid(proc.pid)
        deadline = time.monotonic() + 120
        seen = b""
        while b"step" not in seen and time.monotonic() < deadline:  # (steps are read)
            seen += os.read(proc.stdout.fileno(), 4096)
        os.killpg(group, signal.SIGINT)  # as a terminal's Ctrl-C
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (seen + out).decode(errors="replace")
    assert proc.returncode == 130, out[-2000:]
    assert "Traceback" not in out, out[-4000:]
    deadline = time.monotonic() + 20  # (the workers' processes end a moment after it)
    while (left := subprocess.run(["pgrep", "-g", str(group)], capture_output=True,
                                  text=True).stdout.split()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, subprocess.run(["ps", "-o", "pid,stat,args", "-g", str(group)],
                                    capture_output=True, text=True).stdout
