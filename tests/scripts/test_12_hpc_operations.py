"""Chapter 12: every planted hang ends by itself within seconds, with a diagnosis that names its cause."""

import pytest
from helpers import assert_all_checks_passed, assert_config_error

from distlab import launch

DEADLOCKS = "scripts/12_hpc_operations/deadlocks.py"


@pytest.mark.parametrize("hang, cause", [("mismatched-collectives", "mismatched collectives"),
                                         ("skipped-barrier", "skipped collective"), ("wrong-group", "wrong group"),
                                         ("few-microbatches", "too few messages"),
                                         ("unpaired-p2p", "unpaired point-to-point"), ("none", "none")])
def test_every_hang_ends_with_its_diagnosis(hang, cause):
    result = launch.run(DEADLOCKS, nproc=4, args=["--hang", hang, "--pg-timeout", "2"], stream=False, timeout=60)
    metrics = assert_all_checks_passed(result, min_checks=2)
    assert metrics["extra"]["cause"] == cause
    assert metrics["extra"]["seconds_to_diagnosis"] < 9  # 2 s timeouts: one for the stuck call, one for a peer's next
    assert f"diagnosis: {cause}" in result.output
    timed_out = [r for r, j in metrics["extra"]["journals"].items() if j["state"] == "timed out"]
    # a hang ends because a rank's own call raised at the timeout (not because a peer was killed)
    assert bool(timed_out) == (hang != "none")


def test_deadlocks_need_four_ranks():
    assert_config_error(DEADLOCKS, [], "the scenarios are written for 4 ranks", nproc=2)
