"""scripts/bench_many_readers.py ``--quick`` end to end (N = 16 and 32 ranks, about 40 s).

It checks that the script works and that every rank read every step exactly once,
not the figures (docs/many_readers.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.slow


def test_many_readers_quick(tmp_path):
    out_json = tmp_path / "many.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    proc = subprocess.run([sys.executable, os.path.join("scripts", "bench_many_readers.py"),
                           "--quick", "--json", str(out_json)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for column in ("first batch s", "steps/s", "sched CPU/step ms", "svc CPU/rank-step ms",
                   "sockets sched/worker", "once"):
        assert column in out, out
    rows = [line.split() for line in out.splitlines()
            if line.split()[:2] in (["16", "2"], ["32", "4"])]  # ranks, hosts
    assert [r[0] for r in rows] == ["16", "32"] and all(r[-1] == "yes" for r in rows), out
    figures = json.loads(out_json.read_text())
    assert [f["ranks"] for f in figures] == [16, 32]
    for f in figures:
        assert f["once"] and not f["problems"], f
        assert f["first_batch_s"] > 0 and f["achieved_steps_per_s"] > 0, f
        assert f["sockets_scheduler"] > 0 and f["sockets_worker_max"] > 0, f
