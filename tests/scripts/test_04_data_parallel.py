"""Chapter 04: data parallelism by hand and with DDP, on 4 CPU ranks."""

import pytest
from helpers import assert_all_checks_passed, assert_config_error

from labkit import launch

FROM_SCRATCH = "scripts/04_data_parallel/ddp_from_scratch.py"
TRAIN_DDP = "scripts/04_data_parallel/train_ddp.py"
TINY_PARAM_BYTES = 123_200 * 4  # the tiny transformer's fp32 parameters


def test_ddp_from_scratch_matches_single_device_under_torchrun():
    result = launch.run(FROM_SCRATCH, nproc=4, args=["--steps", "3"], launcher="torchrun", stream=False)
    metrics = assert_all_checks_passed(result, min_checks=7)
    names = " ".join(c["name"] for c in metrics["checks"])
    assert "single-device gradients" in names and "single-device parameters" in names
    (allreduce,) = metrics["comm"]
    assert allreduce["measured_bytes"] == allreduce["analytic_bytes"] == TINY_PARAM_BYTES
    # derived (the ring model x the measured payload), and labelled so; the measured payload is checked above
    assert allreduce["sent_bytes_per_rank_derived"] == 2 * 3 / 4 * allreduce["measured_bytes"]
    # MFU against the peak of the dtype the run used (fp32 on a CPU), the first step left out of the timing
    assert metrics["throughput"]["peak_dtype"] == metrics["config"]["precision"] == "fp32"
    assert metrics["throughput"]["timed_steps"] == 2


@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_from_scratch_trains_any_model_like_one_device(nproc):
    """A frozen first block and frozen norms (no gradient to average), a head tied to the embedding (averaged once),
    a bias of 127 and two parameter groups: one device with the same groups gives the same weights."""
    metrics = assert_all_checks_passed(launch.run(FROM_SCRATCH, nproc=nproc, args=["--steps", "3", "--any-model"],
                                                  stream=False), min_checks=7)
    trainable = 115_071 - (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64) - 3 * 64   # the first block and the 3 other norms
    assert metrics["comm"][0]["measured_bytes"] == 4 * trainable


def test_a_comm_hook_that_waits_fails_only_the_overlap_check():
    """It launches every bucket as early as DDP does, so "launched before the last gradient" passes; only the check
    that backward computed while a bucket was in flight sees that nothing overlapped."""
    result = launch.run(TRAIN_DDP, nproc=4, args=["--steps", "3", "--bucket-mb", "0.1", "--planted-bug", "waiting-hook"],
                        stream=False, check=False)
    assert result.returncode == 1
    assert [c["name"] for c in result.metrics["checks"] if not c["passed"]] == [
        "backward computed while a bucket was being all-reduced (a gradient became ready while one was in flight)"]
    assert result.metrics["extra"]["overlap"]["grads_ready_while_in_flight"] == 0


def test_the_training_sampler_reshuffles_each_epoch_and_a_loop_without_set_epoch_fails():
    """Past an epoch (4 global batches a epoch by default): the sampler the loop trains from, gathered from every rank,
    covers the dataset once, and its order changes with the epoch; a loop that never calls set_epoch fails only that."""
    right = assert_all_checks_passed(launch.run(TRAIN_DDP, nproc=4, args=["--steps", "5"], stream=False), min_checks=8)
    assert "the training sampler's order changed with the epoch (set_epoch was called)" in [
        c["name"] for c in right["checks"]]
    wrong = launch.run(TRAIN_DDP, nproc=4, args=["--steps", "5", "--planted-bug", "no-set-epoch"], stream=False,
                       check=False)
    assert wrong.returncode == 1 and [c["name"] for c in wrong.metrics["checks"] if not c["passed"]] == [
        "the training sampler's order changed with the epoch (set_epoch was called)"]


def test_train_ddp_compare_buckets_and_no_sync():
    args = ["--steps", "3", "--compare", "--accumulation", "2", "--bucket-mb", "0.1", "--gradient-as-bucket-view"]
    result = launch.run(TRAIN_DDP, nproc=4, args=args, stream=False)
    metrics = assert_all_checks_passed(result, min_checks=13)
    extra = metrics["extra"]
    # accumulation: the first micro-step of every optimizer step sends nothing, the last sends every gradient
    assert extra["micro_step_bytes"] == [[0, TINY_PARAM_BYTES]] * 3
    # DDP's first step uses one bucket; then buckets of ~0.1 MB rebuilt in the order gradients were ready
    assert extra["buckets_per_step"][0] == 1 and extra["buckets_per_step"][1:] == [4, 4]
    assert sum(b["bytes"] for b in extra["buckets"]) == TINY_PARAM_BYTES
    assert [b["bytes"] for b in extra["buckets"]] == [131_328, 114_944, 147_712, 98_816]  # as chapter 04 lists them
    assert extra["buckets"][0]["params"][0] == "output.weight"  # backward starts at the output layer
    # the picture's data: every gradient became ready before its bucket was all-reduced
    timeline = extra["backward_timeline"]
    launched = {e["bucket"]: e["t"] for e in timeline if e["kind"] == "all_reduce"}
    assert all(e["t"] <= launched[e["bucket"]] for e in timeline if e["kind"] == "grad_ready")
    # the overlap, measured: each bucket's all-reduce from launch to finish, inside backward, the first one
    # launched while backward was still computing
    overlap = extra["overlap"]
    assert len(overlap["buckets"]) == 4
    assert all(overlap["backward_start"] <= b["launch"] < b["end"] <= overlap["backward_end"] for b in overlap["buckets"])
    assert min(b["launch"] for b in overlap["buckets"]) < overlap["last_gradient"]
    assert 0.0 <= overlap["hidden_fraction"] <= 1.0
    assert any(c["name"].startswith("communication began while backward") and c["passed"] for c in metrics["checks"])


def test_train_ddp_default_one_bucket():
    result = launch.run(TRAIN_DDP, nproc=4, args=["--steps", "2"], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=6)
    assert metrics["comm"][0]["measured_bytes"] == TINY_PARAM_BYTES
    assert metrics["extra"]["buckets_per_step"] == [1, 1]  # 0.5 MB of gradients fit one 25 MB bucket


def test_batch_not_divisible_by_world_exits_2():
    assert_config_error(FROM_SCRATCH, ["--batch", "6"], "does not split over 4 ranks")


def test_batch_not_divisible_by_world_times_accumulation_exits_2():
    assert_config_error(TRAIN_DDP, ["--batch", "8", "--accumulation", "4"], "does not split into 4 ranks x 4")
