"""A training process stand-in: connect by name, read some ranks, save what it got.

Usage: python reader_proc.py ADDRESS NAME RANKS STEPS OUT.pkl [--driven]
(RANKS is a comma-separated list).  ``--driven``: read one step on every rank for
each line ``next`` on stdin, answering the steps read on stdout, and stop at ``quit``
(or end of input) instead of reading STEPS steps: a test decides when this process
reads and when it pauses, as a training loop does at a checkpoint.
"""

from __future__ import annotations

import pickle
import sys

from msd_dask import DataService

from checks import record


def main() -> None:
    address, name, ranks, steps, out = sys.argv[1:6]
    driven = "--driven" in sys.argv[6:]
    with DataService.connect(address, name, timeout=60) as svc:
        readers = [svc.reader(int(r)) for r in ranks.split(",")]
        if driven:
            recs = []
            for line in sys.stdin:
                if line.strip() != "next":
                    break
                got = [record(next(rd)) for rd in readers]
                recs.extend(got)
                print(" ".join(str(g["step"]) for g in got), flush=True)
        else:
            recs = [record(next(rd)) for _ in range(int(steps)) for rd in readers]
    with open(out, "wb") as f:
        pickle.dump(recs, f)


if __name__ == "__main__":
    main()
