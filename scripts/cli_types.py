"""argparse types the scripts share: a number that must be in range is refused by argparse,
naming the option and the value, before anything runs (a review found options taken as 0 or
failing with a traceback after minutes of work)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

__all__ = ["bounded", "natural", "natural_list", "non_negative_float", "positive_float",
           "positive_int", "positive_list"]


def bounded(cast: Callable[[str], Any], least: float, above: bool) -> Callable[[str], Any]:
    """An argparse type: ``cast(text)``, finite, at least ``least`` (``above``: more than it);
    else argparse's error naming the option and the value."""
    what = f"{'a whole number' if cast is int else 'a number'} {'>' if above else '>='} {least:g}"

    def parse(text: str) -> Any:
        try:
            v = cast(text)
        except ValueError:
            v = math.nan
        if not (v > least if above else v >= least) or math.isinf(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v

    return parse


positive_int = bounded(int, 0, above=True)
natural = bounded(int, 0, above=False)
positive_float = bounded(float, 0.0, above=True)
non_negative_float = bounded(float, 0.0, above=False)


def _listed(item: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return [item(p) for p in parts]

    return parse


#: a comma-separated list of whole numbers > 0 (``"128,512"``)
positive_list = _listed(positive_int)
#: a comma-separated list of whole numbers >= 0
natural_list = _listed(natural)


if __name__ == "__main__":  # a module of the scripts, not a script: say what it holds
    import sys

    print(__doc__)
    print("  bounded(cast, least, above)  a type of numbers from least (or above it)")
    print("  positive_int, natural        whole numbers > 0, >= 0")
    print("  positive_float               numbers > 0 (seconds, rates)")
    print("  non_negative_float           numbers >= 0")
    print("  positive_list, natural_list  comma-separated whole numbers > 0, >= 0")
    print()
    print("The scripts that take numbers use them; run one of them with --help.")
    sys.exit(0 if sys.argv[1:] in ([], ["-h"], ["--help"]) else 2)
