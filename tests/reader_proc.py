"""A training process stand-in: connect by name, read some ranks, save what it got.

Usage: python reader_proc.py ADDRESS NAME RANKS STEPS OUT.pkl
(RANKS is a comma-separated list).
"""

from __future__ import annotations

import pickle
import sys

from msd_dask import DataService

from checks import record


def main() -> None:
    address, name, ranks, steps, out = sys.argv[1:6]
    with DataService.connect(address, name, timeout=60) as svc:
        readers = [svc.reader(int(r)) for r in ranks.split(",")]
        recs = [record(next(rd)) for _ in range(int(steps)) for rd in readers]
    with open(out, "wb") as f:
        pickle.dump(recs, f)


if __name__ == "__main__":
    main()
