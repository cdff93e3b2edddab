"""Where a service's planner goes (``place_planner``, with a stand-in for the cluster): the
running worker holding the fewest actors, not one a re-created planner did not start on."""

from __future__ import annotations

from typing import Any

import pytest

from msd_dask.core.config import parse_config
from msd_dask.service.placement import place_planner


class _Cluster:
    """Enough of a synchronous ``distributed.Client``: running workers, the actors each holds
    (``answers``: whether the scheduler answers that count), and a ``submit`` that records
    the worker asked for."""

    def __init__(self, actors: dict[str, int], answers: bool = True):
        self.actors, self.answers = actors, answers
        self.scheduler = self
        self.placed: list[str] = []

    def ncores_running(self) -> dict[str, int]:
        return dict.fromkeys(self.actors, 1)

    def run_on_scheduler(self, fn: Any, *, workers: list[str],
                         callback_timeout: float | None = None) -> dict[str, list[str]]:
        if not self.answers:
            raise OSError("the scheduler did not answer")
        return {w: [f"actor-{i}" for i in range(self.actors[w])] for w in workers}

    def sync(self, fn: Any, *args: Any, callback_timeout: float | None = None,
             **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    def submit(self, fn: Any, *args: Any, workers: list[str], **kwargs: Any) -> str:
        self.placed.extend(workers)
        return kwargs["key"]


CFG = parse_config({"name": "pp", "batch": {"seq_len": 64}, "sources": [
    {"name": "a", "uri": "mem://a/*.parquet", "format": "parquet"}]})


@pytest.mark.parametrize("actors, avoid, answers, worker", [
    # the fewest actors, whoever's (the lowest address took every planner, of every service)
    ({"tcp://w:1": 7, "tcp://w:2": 0, "tcp://w:3": 0}, (), True, "tcp://w:2"),
    ({"tcp://w:1": 2, "tcp://w:2": 3, "tcp://w:3": 1}, (), True, "tcp://w:3"),
    # not where the last re-created planner did not start, while another runs
    ({"tcp://w:1": 7, "tcp://w:2": 0, "tcp://w:3": 0}, ("tcp://w:2",), True, "tcp://w:3"),
    ({"tcp://w:1": 0}, ("tcp://w:1",), True, "tcp://w:1"),
    # a scheduler that does not count: by address
    ({"tcp://w:2": 0, "tcp://w:1": 7}, (), False, "tcp://w:1"),
])
def test_the_planner_goes_to_the_running_worker_with_the_fewest_actors(
        actors: dict[str, int], avoid: tuple[str, ...], answers: bool, worker: str) -> None:
    cluster = _Cluster(actors, answers)
    registry = place_planner(cluster, CFG, {"a": []}, {"a": "mem://a"}, None, 1, avoid=avoid)
    assert cluster.placed == [worker] and registry["planner_worker"] == worker
