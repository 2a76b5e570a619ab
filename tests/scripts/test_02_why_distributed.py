"""Chapter 02: data parallelism divides the FLOPs of a step over the ranks, but not the memory."""

from helpers import assert_all_checks_passed, assert_config_error

from labkit import launch

SCRIPT = "scripts/02_why_distributed/compute_and_memory_per_rank.py"


def test_compute_divides_memory_does_not_under_torchrun():
    result = launch.run(SCRIPT, nproc=4, launcher="torchrun", stream=False)
    metrics = assert_all_checks_passed(result, min_checks=5)
    flops = metrics["throughput"]["flops_per_rank"]
    assert len(flops) == 4 and len(set(flops)) == 1
    assert sum(flops) == metrics["throughput"]["one_device_flops"]
    assert metrics["memory"]["state_bytes_per_rank"] == [metrics["memory"]["full_state_bytes"]] * 4


def test_batch_that_does_not_split_is_a_config_error():
    assert_config_error(SCRIPT, ["--batch", "6"], "does not split over 4 ranks")
