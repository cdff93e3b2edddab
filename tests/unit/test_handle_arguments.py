"""A ``DataService`` call's seconds are checked before anything connects: a string reached
Dask's time parser, whose ``KeyError`` ("Invalid time unit") named no argument (a review of
the service handle)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from msd_dask import DataService


@pytest.mark.parametrize("kwargs, says", [
    ({"timeout": "x"}, "connect: timeout must be a finite number of seconds > 0, got 'x'"),
    ({"timeout": 0}, "connect: timeout must be a finite number of seconds > 0, got 0"),
    ({"timeout": math.inf}, "connect: timeout must be a finite number of seconds > 0"),
    ({"wait": -1}, "connect: wait must be a finite number of seconds >= 0, got -1"),
    ({"wait": True}, "connect: wait must be a finite number of seconds >= 0, got True"),
])
def test_connect_names_a_wait_that_is_not_seconds(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=f"DataService.{says}"):
        DataService.connect("tcp://198.18.0.1:8786", "svc", **kwargs)


def test_stop_and_start_name_a_timeout_that_is_not_seconds() -> None:
    with pytest.raises(ValueError, match="DataService.stop: timeout must be a finite number "
                                         "of seconds > 0, got '30'"):
        DataService.stop("tcp://198.18.0.1:8786", "svc", timeout="30")  # type: ignore[arg-type]
    cfg = {"name": "svc", "batch": {"seq_len": 8},
           "sources": [{"name": "a", "uri": "memory://nowhere/*.jsonl", "format": "jsonl"}]}
    with pytest.raises(ValueError, match="DataService.start: timeout must be a finite number "
                                         "of seconds > 0, got nan"):
        DataService.start(cfg, "tcp://198.18.0.1:8786", timeout=math.nan)
