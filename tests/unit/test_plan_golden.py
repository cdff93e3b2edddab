"""The planner's decisions are pinned: sha256 digests of every step of a grid of configurations.

Each digest covers, step by step, the plan (pieces, their order, ranks and rows,
``rank_cost``, ``lower_bound``, weights), ``state_dict()``, ``pending()`` and
``upcoming_units()``, every ``NeedMetadata`` raised (and the state after it), a
weight change and a resume from a JSON state mid-way (see
``scripts/check_planner_equivalence.py``, which also compares a whole, larger
grid with a reference copy of the package).  The digests were computed with the
planner of commit 747b37a, before it was made faster: a change to any decision
fails here.  If a decision is changed on purpose, recompute them with
``python scripts/check_planner_equivalence.py --only golden``.
"""

from __future__ import annotations

import pytest
from scripts_import import load_script

import msd_dask

check = load_script("check_planner_equivalence")

GOLDEN = {
    "sequential-dp16-mb1-out0.0":
        "f484161b817d1c0d0b3b10b55867240ae60a86d025529a7578cfd503225d2683",
    "sequential-dp16-mb1-out0.5":
        "dd62e6ed8de7cc309049a084293d1c3b9e6bab3093a20d78c6f3162a6320dbbe",
    "sequential-dp16-mb8-out0.0":
        "20282fe965eb8f797dc3158573036c0d3f5e817534df769cd533f784585df569",
    "sequential-dp16-mb8-out0.5":
        "1f774a41fc0c3f923adc9061fbaf598071c9800564fcc3fa9ac322c94bb8d11e",
    "lpt-dp16-mb1-out0.0":
        "b29a2aed784e3926188070782e0095768b129be950815c736079b8dc1aaa4ef3",
    "lpt-dp16-mb1-out0.5":
        "add3564e989b2db585089a39fa09a31f7f27391674d21873f32543f226a94784",
    "lpt-dp16-mb8-out0.0":
        "03658e24b7714f8564151dbe033f5646d7fcbb518816413c1781e1afae08d131",
    "lpt-dp16-mb8-out0.5":
        "73e7c23523a7c50bda86c5a31d8c0c24be4995903a366dbb53f421b377404b92",
    "balanced-dp16-mb1-out0.0":
        "7f091df3d6e18a5f5aff0841b149eee52005f77c5ebfa4d3e56ff9be13324370",
    "balanced-dp16-mb1-out0.5":
        "1961937a64f059e69790dd3316137bb5c4821c3c931187dc3b45595ade7d5296",
    "balanced-dp16-mb8-out0.0":
        "c61e76d4a422b8921052b4a43e981115f1973278579b2e3d866cf55be8e9c319",
    "balanced-dp16-mb8-out0.5":
        "75722cc48be36d1672d018361513e2380bbdd9ec052f6359d4417b67951ca5bf",
    "balanced-dp256-mb8-out0.5":
        "8afb2bef26a720385389690b002b5086548cb8a1704344b4d6188d59fabeb3bd",
    "lpt-seq64":
        "3fb2dd47b8b0ae9333a9fab7caabfaee863851dcf87c5e0a80b06b0b999ad786",
    "lpt-seq1024":
        "40f4198c57f67e29ba039090f577a5a140acb0d7b46ffd5bad0a0dc1dc15d5b9",
    "lpt-spread":
        "0f3144c4f8e8967dd8ac5c6d4af89ec9e24754405d4aed0d211df5e76045a191",
    "lpt-grouped":
        "2b18c5c4560e4533597654a0fe9f73dd8e3ce3f5384125cde0c58f4413602ce7",
    "balanced-seq64":
        "2a4dc9cfe4acc330916e625712b96edaec30b02e677301225c428d04b7bd2186",
    "balanced-seq1024":
        "40f4198c57f67e29ba039090f577a5a140acb0d7b46ffd5bad0a0dc1dc15d5b9",
    "balanced-spread":
        "5bb13a424073591625333953f8529673280be3bf73afe25d20776e09533d4e45",
    "balanced-grouped":
        "1fe71e6893d053f9708a3961feb831466cc8f2587770c442e271130436da6e58",
    "balanced-big":
        "2bf5b76f2b3888470bcc44167e1b2137173425bcad9ddb8b82fd25c10ebf4ba8",
    "balanced-no-need":
        "53de9fd14b16110f139026552a5494ccc5992de77d47e45f31d74ee45d2af06e",
}

SPECS = {s.name: s for s in check.specs() if "golden" in s.tags}


def test_the_golden_grid_is_the_scripts() -> None:
    assert set(SPECS) == set(GOLDEN)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_decisions_unchanged(name: str) -> None:
    assert check.digest(msd_dask, SPECS[name]) == GOLDEN[name]

