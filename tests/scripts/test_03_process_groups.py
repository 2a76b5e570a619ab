"""Chapter 03, process groups: each subgroup's all-reduce equals the sum of its members; bad groups exit 2."""

import pytest
from helpers import assert_all_checks_passed, assert_config_error

from labkit import launch

SCRIPT = "scripts/03_communication/process_groups.py"


@pytest.fixture(scope="module")
def grid_run():
    """One 4-rank run, 2 x 2 grid: row groups [0, 1], [2, 3]; column groups [0, 2], [1, 3]."""
    return launch.run(SCRIPT, nproc=4, stream=False)


def test_every_subgroup_sums_its_own_members(grid_run):
    metrics = assert_all_checks_passed(grid_run, min_checks=7)
    names = {c["name"] for c in metrics["checks"]}
    for kind in ("row", "column"):
        assert f"every {kind} group's all-reduce equals the sum of its members' contributions" in names
        assert f"{kind} groups: the sum is the group's, not the world's" in names
    assert metrics["extra"]["rows"] == [[0, 1], [2, 3]] and metrics["extra"]["columns"] == [[0, 2], [1, 3]]


def test_the_collectives_ran_on_groups_of_two(grid_run):
    rows = grid_run.metrics["comm"]
    assert [r["group_size"] for r in rows] == [2, 2]
    assert all(r["measured_bytes"] == r["analytic_bytes"] == 8 * 4 for r in rows)
    assert all(r["sent_bytes_per_rank_derived"] == 8 * 4 for r in rows)  # 2(n-1)/n = 1 on two ranks


def test_a_group_size_that_does_not_divide_the_world_is_a_config_error():
    assert_config_error(SCRIPT, ["--group-size", "3"], "does not divide the 4 ranks")
