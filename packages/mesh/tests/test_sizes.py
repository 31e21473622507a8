"""ParallelismSizes resolution: the happy paths and a table of bad layouts with their exact messages."""

from __future__ import annotations

import pytest

from automodel.mesh import ParallelismSizes


def test_dp_is_derived_from_world_size() -> None:
    layout = ParallelismSizes(tp_size=2, pp_size=2, cp_size=2).resolve(16)
    assert (layout.dp, layout.dp_shard, layout.dp_replicate) == (2, 2, 1)
    assert layout.dp_cp == 4 and layout.dp_shard_cp == 4


def test_hsdp_and_moe_sizes() -> None:
    layout = ParallelismSizes(dp_replicate_size=2, cp_size=2, ep_size=4).resolve(16)
    assert (layout.dp, layout.dp_replicate, layout.dp_shard) == (8, 2, 4)
    assert (layout.ep, layout.ep_shard) == (4, 4)
    assert layout.fsdp_enabled and layout.dp_replicate_enabled and layout.cp_enabled and layout.ep_enabled
    assert not layout.tp_enabled and not layout.pp_enabled


def test_explicit_dp_size_that_fits_is_accepted() -> None:
    assert ParallelismSizes(dp_size=4, tp_size=2).resolve(8).dp == 4


BAD_LAYOUTS = [
    # (sizes kwargs, world_size, expected message fragment)
    (
        dict(tp_size=3),
        8,
        "world_size 8 is not divisible by pp_size*cp_size*tp_size = 3 (pp_size=1, cp_size=1, tp_size=3)",
    ),
    (
        dict(tp_size=2, pp_size=2, cp_size=2),
        12,
        "world_size 12 is not divisible by pp_size*cp_size*tp_size = 8",
    ),
    (dict(pp_size=16), 8, "pp_size*cp_size*tp_size = 16"),
    (dict(dp_replicate_size=3), 8, "dp_replicate_size=3 must divide dp_size=8"),
    (dict(dp_replicate_size=4), 4, "dp_replicate_size=4 equals dp_size=4"),
    (dict(dp_replicate_size=2, tp_size=2), 4, "dp_replicate_size=2 equals dp_size=2"),
    (dict(ep_size=3), 8, "dp_size*cp_size = 8 (dp_size=8, cp_size=1) is not divisible by ep_size=3"),
    (
        dict(ep_size=8, tp_size=2),
        8,
        "dp_size*cp_size = 4 (dp_size=4, cp_size=1) is not divisible by ep_size=8",
    ),
    (dict(dp_size=3), 8, "dp_size=3 does not fit world_size 8"),
    (dict(dp_size=4, tp_size=4), 8, "dp_size=4 does not fit world_size 8"),
    (dict(tp_size=0), 8, "tp_size must be >= 1, got 0"),
    (dict(pp_size=-2), 8, "pp_size must be >= 1, got -2"),
    (dict(cp_size=2.0), 8, "cp_size must be a positive int, got 2.0 (float)"),
    (dict(ep_size="2"), 8, "ep_size must be a positive int, got '2' (str)"),
    (dict(tp_size=True), 8, "tp_size must be a positive int, got True (bool)"),
    (dict(dp_replicate_size=0), 8, "dp_replicate_size must be >= 1, got 0"),
    (dict(), 0, "world_size must be >= 1, got 0"),
]


@pytest.mark.parametrize(("kwargs", "world_size", "message"), BAD_LAYOUTS)
def test_bad_layout_is_a_value_error_naming_the_values(kwargs: dict, world_size: int, message: str) -> None:
    with pytest.raises(ValueError) as err:
        ParallelismSizes(**kwargs).resolve(world_size)
    assert message in str(err.value)


def test_coordinates_and_groups_follow_row_major_order() -> None:
    layout = ParallelismSizes(tp_size=2, pp_size=2, dp_replicate_size=2, cp_size=1).resolve(16)
    # dims (pp=2, dp_replicate=2, dp_shard=2, cp=1, tp=2): rank 13 = 1*8 + 1*4 + 0*2 + 1
    assert layout.coordinates(13) == {
        "pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1, "ep_shard": 2, "ep": 0,
    }  # fmt: skip
    assert layout.group_ranks(13, "tp") == [12, 13]
    assert layout.group_ranks(13, "pp") == [5, 13]
    assert layout.group_ranks(13, "dp") == [9, 11, 13, 15]
    assert layout.group_ranks(13, "dp_shard_cp") == [13, 15]
    with pytest.raises(ValueError, match="rank 16 is outside world_size 16"):
        layout.coordinates(16)
    with pytest.raises(ValueError, match="unknown mesh axis 'sp'"):
        layout.group_ranks(0, "sp")
