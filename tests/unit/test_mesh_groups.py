"""ParallelConfig.dp_groups / ranks_of_dp: the same ranks, in the same order, as the scan
they replace (every rank whose ``coords`` has that DP index), for every axis order."""

from __future__ import annotations

import itertools

import pytest

from msd_dask.core.config import MESH_AXES, ParallelConfig, parse_config
from msd_dask.service.placement import constructor_members

ORDERS = ["-".join(p) for p in itertools.permutations(MESH_AXES)]
#: (dp, tp, cp, pp): a single rank, each axis > 1 alone, all of them > 1, uneven sizes
MESHES = [(1, 1, 1, 1), (4, 1, 1, 1), (2, 2, 1, 1), (3, 1, 2, 1), (2, 1, 1, 3),
          (3, 2, 2, 2), (5, 8, 1, 2), (1, 2, 3, 2)]


def _scan(p: ParallelConfig, dp: int) -> list[int]:
    """The old definition of ``ranks_of_dp``: scan every rank."""
    return [r for r in range(p.world_size) if p.coords(r)["dp"] == dp]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: "dp{}-tp{}-cp{}-pp{}".format(*m))
def test_same_ranks_and_order_as_the_scan(order: str, mesh: tuple[int, int, int, int]) -> None:
    dp, tp, cp, pp = mesh
    p = ParallelConfig(dp=dp, tp=tp, cp=cp, pp=pp, order=order)
    expected = [_scan(p, d) for d in range(dp)]
    assert p.dp_groups() == expected
    assert [p.ranks_of_dp(d) for d in range(dp)] == expected
    for d in (-1, dp, dp + 3):  # outside [0, dp): no rank, as the scan found
        assert p.ranks_of_dp(d) == [] == _scan(p, d)
    for ranks in expected:  # the first rank is the group's tp = cp = pp = 0 member
        assert all(v == 0 for k, v in p.coords(ranks[0]).items() if k != "dp")


def test_groups_partition_a_large_world() -> None:
    p = ParallelConfig(dp=16_384, tp=8, pp=2, order="tp-dp-cp-pp")
    groups = p.dp_groups()
    assert len(groups) == 16_384 and all(len(g) == 16 for g in groups)
    assert sorted(r for g in groups for r in g) == list(range(p.world_size))
    assert all(g == sorted(g) for g in groups[:: 997])
    for d in (0, 1, 8_191, 16_383):
        assert groups[d] == p.ranks_of_dp(d)
        assert all(p.coords(r)["dp"] == d for r in groups[d])


@pytest.mark.parametrize("n_c", [1, 3, 4, 7])
def test_constructor_members_deal_dp_indices_round_robin(n_c: int) -> None:
    cfg = parse_config({"name": "m", "batch": {"seq_len": 8},
                        "parallel": {"dp": 6, "tp": 2, "cp": 2, "order": "cp-dp-tp-pp"},
                        "sources": [{"name": "a", "uri": "x/*.jsonl", "format": "jsonl"}]})
    members = constructor_members(cfg, n_c)
    assert len(members) == n_c
    # as place_planner built it before: members[dp % n_c][dp] = ranks_of_dp(dp), dp ascending
    expected: list[dict[int, list[int]]] = [{} for _ in range(n_c)]
    for d in range(6):
        expected[d % n_c][d] = _scan(cfg.parallel, d)
    assert members == expected
    assert all(list(m) == sorted(m) for m in members)
