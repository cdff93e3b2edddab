"""``scripts/bench_startup.py`` runs (``--quick``: a small mesh, no cluster) and prints its table.

It checks the script works, not the figure (docs/benchmarks.md, Start-up).
"""

from __future__ import annotations

import re
import subprocess
import sys

from scripts_import import SCRIPTS


def test_quick_prints_every_phase_the_goal_and_the_old_vs_new_ratio() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPTS / "bench_startup.py"), "--quick", "--repeat", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "dp=64 tp=2" in out and "128 ranks; 16 constructors" in out, out
    for phase in ("parse", "map ranks", "place (service)", "planner setup", "total"):
        assert f"| {phase}" in out, out
    # the verdict is printed (the quick mesh takes milliseconds: it is met, and says nothing)
    assert re.search(r"goal: total <= 10 s: (met|not met)", out), out
    assert "extrapolated to all 64 DP indices" in out and "Ratio old / new" in out, out
