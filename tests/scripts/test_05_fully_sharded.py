"""Chapter 05: ZeRO by hand, FSDP2, distributed checkpoints, on 4 CPU ranks."""

import pytest
from helpers import assert_all_checks_passed, assert_config_error

from labkit import launch

ZERO = "scripts/05_fully_sharded/zero_from_scratch.py"
ZERO3 = "scripts/05_fully_sharded/zero3_from_scratch.py"
FSDP = "scripts/05_fully_sharded/train_fsdp.py"
CHECKPOINT = "scripts/05_fully_sharded/checkpoint_resume.py"
P = 123_200  # parameters of the tiny transformer


def comm_of(metrics):
    return {c["collective"]: c for c in metrics["comm"]}


def test_zero1_under_torchrun_matches_ddp_and_costs_one_and_a_half_ddp():
    result = launch.run(ZERO, nproc=4, args=["--stage", "1", "--steps", "3"], launcher="torchrun", stream=False)
    metrics = assert_all_checks_passed(result, min_checks=9)
    comm = comm_of(metrics)
    assert comm["all_reduce"]["measured_bytes"] == comm["all_gather"]["measured_bytes"] == 4 * P
    # the ring model applied to the *measured* payloads, against DDP's all-reduce of every gradient (chapter 04
    # measures that payload = 4 P): 1.5 x
    derived = sum(c["sent_bytes_per_rank_derived"] for c in metrics["comm"])
    assert derived == 1.5 * (2 * 3 / 4 * 4 * P) == metrics["extra"]["sent_bytes_per_rank_derived"]["zero"]
    # measured, as opposed to derived: the payloads handed to the collectives, twice DDP's all-reduce
    assert metrics["extra"]["payload_bytes_per_step"] == {"zero_measured": 2 * 4 * P, "ddp_formula": 4 * P}
    assert any(c["name"].startswith("gradient shards = DDP") for c in metrics["checks"])
    assert metrics["memory"]["measured"] == {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P / 4,
                                             "total": 4 * P + 4 * P + 2 * P}


def test_zero2_shards_gradients_and_costs_what_ddp_costs():
    metrics = assert_all_checks_passed(launch.run(ZERO, nproc=4, args=["--stage", "2", "--steps", "3"], stream=False),
                                       min_checks=9)
    assert set(comm_of(metrics)) == {"reduce_scatter", "all_gather"}
    assert sum(c["sent_bytes_per_rank_derived"] for c in metrics["comm"]) == 2 * 3 / 4 * 4 * P  # DDP's, from measured
    assert any(c["name"].startswith("rank 0's gradient shards") for c in metrics["checks"])
    assert metrics["memory"]["measured"]["grads"] == 4 * P / 4


def test_fsdp_reshard_after_forward_gathers_twice():
    metrics = assert_all_checks_passed(launch.run(FSDP, nproc=4, args=["--steps", "3"], stream=False), min_checks=11)
    comm = comm_of(metrics)
    assert comm["all_gather"]["measured_bytes"] == 2 * 4 * P and comm["reduce_scatter"]["measured_bytes"] == 4 * P
    assert metrics["memory"]["measured"]["total"] == 16 * P / 4  # 16 bytes per parameter, over 4 ranks


def test_fsdp_no_reshard_gathers_once_and_checkpointing_saves_activations():
    plain = launch.run(FSDP, nproc=4, args=["--steps", "2", "--no-reshard-after-forward"], stream=False)
    checkpointed = launch.run(FSDP, nproc=4, args=["--steps", "2", "--no-reshard-after-forward",
                                                    "--activation-checkpointing"], stream=False)
    for result in (plain, checkpointed):
        metrics = assert_all_checks_passed(result, min_checks=11)
        assert comm_of(metrics)["all_gather"]["measured_bytes"] == 4 * P
    saved = [r.metrics["memory"]["saved_activation_bytes"] for r in (plain, checkpointed)]
    assert saved[1] < saved[0] / 5, saved  # chapter 05: "less than a fifth" on the tiny model


def test_fsdp_bf16_mixed_precision_cpu_offload_meta_init():
    args = ["--steps", "3", "--mixed-precision", "--cpu-offload", "--init", "meta"]
    metrics = assert_all_checks_passed(launch.run(FSDP, nproc=4, args=args, stream=False), min_checks=11)
    comm = comm_of(metrics)
    assert comm["all_gather"]["measured_bytes"] == 2 * 2 * P  # bf16 all-gathers: half the bytes
    assert comm["reduce_scatter"]["measured_bytes"] == 4 * P   # gradients reduced in fp32
    assert any("bf16 tolerance" in c["name"] for c in metrics["checks"])
    # the reference is built from the seed, not copied from the shards: the gathered shards equal it exactly
    initial = [c for c in metrics["checks"] if c["name"].startswith("initial full weights")]
    assert initial and initial[0]["value"] == 0


def test_checkpoint_interrupt_resume_and_reshard_4_to_2(tmp_path):
    save = ["--save-dir", str(tmp_path / "ckpt"), "--steps", "5", "--save-every", "2"]
    first = assert_all_checks_passed(launch.run(CHECKPOINT, nproc=4, args=save + ["--stop-after", "3"],
                                                stream=False), min_checks=2)
    assert sorted((tmp_path / "ckpt").glob("step_*/.metadata"))[0].parent.name == "step_000002"
    resumed = assert_all_checks_passed(launch.run(CHECKPOINT, nproc=4, args=save + ["--resume"], stream=False),
                                       min_checks=7)
    assert resumed["extra"]["first_step"] == 2  # step 2 was lost with the interruption and is trained again
    assert resumed["losses"][0] == first["losses"][2]
    resharded = assert_all_checks_passed(launch.run(CHECKPOINT, nproc=2, args=save + ["--world-size-check"],
                                                    stream=False), min_checks=4)
    assert (resharded["extra"]["written_by"], resharded["extra"]["read_by"]) == (4, 2)
    assert resharded["extra"]["loaded_step"] == 4
    entries = [c["value"] for c in resharded["checks"] if "same entries" in c["name"]]
    assert entries == [21, 73]  # chapter 05: 21 model tensors, 73 optimizer entries


def test_uneven_shards_train_and_reshard_on_3_ranks(tmp_path):
    """3 ranks: no parameter of the tiny model has a row count 3 divides (128 rows: 43, 43, 42), so every shard is
    uneven; FSDP2 still equals one device, its state sums to the model's within padding, and a checkpoint written by
    4 ranks reads back on 3."""
    uneven = assert_all_checks_passed(launch.run(FSDP, nproc=3, args=["--steps", "2", "--batch", "6"], stream=False),
                                      min_checks=11)
    assert any("within padding" in c["name"] for c in uneven["checks"])
    save = ["--save-dir", str(tmp_path / "ckpt"), "--steps", "3", "--save-every", "2", "--batch", "12"]
    assert_all_checks_passed(launch.run(CHECKPOINT, nproc=4, args=save, stream=False), min_checks=2)
    resharded = assert_all_checks_passed(launch.run(CHECKPOINT, nproc=3, args=save + ["--world-size-check"],
                                                    stream=False), min_checks=4)
    assert (resharded["extra"]["written_by"], resharded["extra"]["read_by"]) == (4, 3)


def test_hsdp_shards_in_a_group_and_all_reduces_the_shards_across_replicas():
    # 2 replicas x shard groups of 2 (chapter 09): worked by hand from P, the tiny model's parameters
    metrics = assert_all_checks_passed(launch.run(FSDP, nproc=4, args=["--steps", "3", "--replicate", "2"],
                                                  stream=False), min_checks=14)
    comm = comm_of(metrics)
    assert comm["all_gather"]["measured_bytes"] == 2 * 4 * P and comm["reduce_scatter"]["measured_bytes"] == 4 * P
    assert comm["all_reduce"]["measured_bytes"] == 4 * P // 2  # each rank's gradient shard, over the replicas
    assert {c["collective"]: c["group_size"] for c in metrics["comm"]} == {
        "all_gather": 2, "reduce_scatter": 2, "all_reduce": 2}
    assert metrics["memory"]["measured"]["total"] == 16 * P / 2  # divided by the shard group, not the world
    assert metrics["extra"]["replica_weight_gaps"] == [0.0] * 4   # the replicas equal before and after each step


def test_hsdp_with_shard_groups_of_one_all_reduces_whole_gradients():
    # --replicate 4 on 4 ranks: nothing sharded, nothing gathered or reduce-scattered, the whole gradient
    # all-reduced over the 4 replicas (DDP's bytes). The formula said 0 and the check failed (issue 34; seen)
    metrics = assert_all_checks_passed(launch.run(FSDP, nproc=4, args=["--steps", "2", "--replicate", "4"],
                                                  stream=False), min_checks=14)
    comm = comm_of(metrics)
    assert comm["all_gather"]["measured_bytes"] == comm["reduce_scatter"]["measured_bytes"] == 0
    assert comm["all_reduce"]["measured_bytes"] == comm["all_reduce"]["analytic_bytes"] == 4 * P
    assert metrics["memory"]["measured"]["total"] == 16 * P


def test_hsdp_that_does_not_divide_the_ranks_exits_2():
    assert_config_error(FSDP, ["--replicate", "3"], "--replicate 3 does not divide the 4 ranks")


def test_bad_batch_exits_2():
    assert_config_error(FSDP, ["--batch", "6"], "does not split over 4 ranks")


def test_checkpoint_refuses_to_overwrite_or_to_resume_nothing(tmp_path):
    assert_config_error(CHECKPOINT, ["--save-dir", str(tmp_path), "--resume"], "no checkpoint in")


def test_fsdp_planted_bugs_fail_the_checks_that_name_them():
    """A root-only fully_shard (one unit: the whole model gathered at once) and gradients N times too large pass
    every loss and byte check; the call counts and the step-0 gradients catch them (under bf16 only the gradients)."""
    failed = lambda result: [c["name"] for c in result.metrics["checks"] if not c["passed"]]  # noqa: E731
    root_only = launch.run(FSDP, nproc=4, args=["--steps", "2", "--planted-bug", "root-only"], stream=False,
                           check=False)
    assert root_only.returncode == 1 and failed(root_only) == [
        "all_gather calls per step = 6 (3 units: each block and the root, twice)",
        "reduce_scatter calls per step = 3 (3 units: each block and the root)"]
    summed = launch.run(FSDP, nproc=4, args=["--steps", "2", "--planted-bug", "sum-gradients", "--mixed-precision"],
                        stream=False, check=False)
    assert summed.returncode == 1 and failed(summed) == [
        "step-0 gradients (gathered from the shards) = single-device fp32 gradients (each tensor's largest "
        "difference / its own largest gradient, bf16 tolerance)"]


# ---- any model: frozen norms, a head tied to the embedding, a bias no rank count divides, two parameter groups ----

@pytest.mark.parametrize("stage, nproc", [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_zero_by_hand_trains_any_model_like_ddp_and_one_device(stage, nproc):
    result = launch.run(ZERO, nproc=nproc, args=["--stage", str(stage), "--steps", "3", "--any-model"], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=11)
    names = {c["name"] for c in metrics["checks"]}
    assert "parameters = single-device parameters (every step)" in names
    assert metrics["memory"]["measured"]["grads"] < metrics["memory"]["measured"]["params"]  # frozen: no gradient


# ---- ZeRO-3 by hand ----

BLOCK_BYTES = 4 * (4 * 64 * 64 + 3 * 64 * 192 + 2 * 64)   # one block of the tiny transformer, fp32


def test_zero3_by_hand_equals_one_device_and_fsdp2_and_keeps_one_unit_whole():
    metrics = assert_all_checks_passed(launch.run(ZERO3, nproc=4, stream=False), min_checks=12)
    comm = comm_of(metrics)
    assert comm["all_gather"]["measured_bytes"] == 2 * 4 * P == comm["all_gather"]["fsdp2_measured_bytes"]
    assert comm["reduce_scatter"]["measured_bytes"] == 4 * P == comm["reduce_scatter"]["fsdp2_measured_bytes"]
    memory = metrics["memory"]
    assert memory["gathered_peak_bytes"] == BLOCK_BYTES < 4 * P      # one block whole at a time, not the model
    assert memory["copy_out_peak_bytes"] == 2 * BLOCK_BYTES          # inside a gather: its buffer and the copies
    timeline = [e["event"] for e in memory["timeline"]]
    for unit in ("tok_embeddings", "layers.0", "layers.1", "head"):  # each unit: gathered twice, reduced once
        assert timeline.count(f"{unit}: gathered for forward") == timeline.count(f"{unit}: gathered for backward") == 1
        assert f"{unit}: gradient reduce-scattered, dropped" in timeline
    assert max(e["bytes"] for e in memory["timeline"]) == BLOCK_BYTES and memory["timeline"][-1]["bytes"] == 0


def test_zero3_with_fsdp2s_free_and_refill_equals_fsdp2_and_keeps_one_unit_whole():
    """FSDP2's way instead of notes: the tensors autograd saved have their storages freed after forward (resize_(0))
    and refilled in place before backward. free-before-backward is this minus the refill (it fails, above)."""
    metrics = assert_all_checks_passed(launch.run(ZERO3, nproc=4, args=["--backward-weights", "refill", "--steps", "2"],
                                                  stream=False), min_checks=12)
    memory = metrics["memory"]
    assert memory["gathered_peak_bytes"] == BLOCK_BYTES and memory["timeline"][-1]["bytes"] == 0
    assert memory["storages_refilled_in_place"] == 2 * 21              # every parameter's, both steps
    assert comm_of(metrics)["all_gather"]["measured_bytes"] == 2 * 4 * P == comm_of(metrics)["all_gather"][
        "fsdp2_measured_bytes"]


def test_zero3_in_bf16_equals_fsdp2_mixed_precision_and_gathers_half_the_bytes():
    metrics = assert_all_checks_passed(launch.run(ZERO3, nproc=4, args=["--mixed-precision", "--steps", "3"],
                                                  stream=False), min_checks=11)
    comm = comm_of(metrics)
    assert comm["all_gather"]["measured_bytes"] == 2 * 2 * P and comm["reduce_scatter"]["measured_bytes"] == 4 * P
    fsdp = next(c for c in metrics["checks"] if c["name"] == "loss = FSDP2 fully_shard's (every step)")
    assert fsdp["value"] == 0                          # the same bf16 arithmetic, step for step
    assert metrics["memory"]["gathered_peak_bytes"] == BLOCK_BYTES // 2


def test_zero3_prefetch_gathers_the_next_unit_ahead_and_keeps_two_whole():
    metrics = assert_all_checks_passed(launch.run(ZERO3, nproc=4, args=["--prefetch", "--steps", "2"], stream=False),
                                       min_checks=13)
    assert metrics["memory"]["gathered_peak_bytes"] == 2 * BLOCK_BYTES          # this block and the next
    assert comm_of(metrics)["all_gather"]["measured_bytes"] == 2 * 4 * P         # the same traffic, earlier
    timeline = metrics["extra"]["prefetch_timeline"]
    assert {g["unit"] for g in timeline["gathers"] if g["prefetched"] and g["phase"] == "forward"} == {
        "layers.0", "layers.1", "head"}
    assert [c["unit"] for c in timeline["computes"]] == ["tok_embeddings", "layers.0", "layers.1", "head"]
    passed = {c["name"] for c in metrics["checks"] if c["passed"]}   # the timing checks a late issue fails (below)
    assert {"forward: each unit's gather issued before the unit ahead computed, waited for after it",
            "backward: each unit's gather issued before the unit ahead began its backward, waited for after",
            "some prefetched gather was done before it was needed (work.is_completed() at the wait, every step)"} <= passed
    assert {g["unit"] for g in timeline["gathers"] if g["prefetched"] and g["phase"] == "backward"} == {
        "tok_embeddings", "layers.0", "layers.1"}


def test_zero3_gathering_on_first_use_skips_the_embeddings_second_gather():
    metrics = assert_all_checks_passed(launch.run(ZERO3, nproc=4, args=["--backward-gather", "on-first-use",
                                                                        "--steps", "2"], stream=False), min_checks=9)
    assert comm_of(metrics)["all_gather"]["measured_bytes"] == 2 * 4 * P - 4 * 128 * 64   # the embedding once
    timeline = [e["event"] for e in metrics["memory"]["timeline"]]
    assert "tok_embeddings: gathered for backward" not in timeline and "layers.0: gathered for backward" in timeline


@pytest.mark.parametrize("nproc", [2, 4])
def test_zero3_by_hand_trains_any_model(nproc):
    metrics = assert_all_checks_passed(launch.run(ZERO3, nproc=nproc, args=["--any-model", "--steps", "3"],
                                                  stream=False), min_checks=11)
    assert next(c for c in metrics["checks"] if c["name"] == "frozen parameters untouched")["value"] == "12 frozen"
    assert metrics["memory"]["root_bytes"] == 4 * 127 * 64           # the tied embedding and head: used by two units
    timeline = [e["event"] for e in metrics["memory"]["timeline"]]    # the all-frozen first block: dropped when
    assert "layers.0: dropped after its backward (all frozen: nothing to reduce)" in timeline   # backward is through


def test_zero3_planted_bugs_fail_their_checks():
    freed = launch.run(ZERO3, nproc=4, args=["--planted-bug", "free-before-backward"], stream=False, check=False)
    assert freed.returncode == 1
    assert [c["name"] for c in freed.metrics["checks"] if not c["passed"]] == [
        "backward ran: the weights it needed were there"]
    kept = launch.run(ZERO3, nproc=4, args=["--planted-bug", "keep-saved-weights"], stream=False, check=False)
    assert kept.returncode == 1 and kept.metrics["memory"]["gathered_peak_bytes"] == 3 * BLOCK_BYTES  # two blocks
    assert [c["name"] for c in kept.metrics["checks"] if not c["passed"]] == [   # kept by autograd, one gathered again
        "gathered parameters alive at any moment <= root + largest unit (measured on the storages)",
        "inside a gather's copy-out, gathered parameters alive <= root + largest unit + one gather's buffer "
        "(measured on the storages)",
        "at every gather and drop, bytes alive = bytes the units hold (measured on the storages)"]
    # each next unit's gather issued only once the unit ahead has computed: the same bytes, the same memory, every
    # answer right, and only the timestamps of issue against compute show it (forward and backward)
    late = launch.run(ZERO3, nproc=4, args=["--prefetch", "--planted-bug", "late-prefetch", "--steps", "1"],
                      stream=False, check=False)
    timing = ["forward: each unit's gather issued before the unit ahead computed, waited for after it",
              "backward: each unit's gather issued before the unit ahead began its backward, waited for after"]
    late_failed = [c["name"] for c in late.metrics["checks"] if not c["passed"]]
    assert late.returncode == 1 and late_failed[:2] == timing and late_failed[2:] in (
        [], ["some prefetched gather was done before it was needed (work.is_completed() at the wait, every step)"])
    # (a gather issued late is seldom done by its wait: the third check may fail as well)


def test_zero3_bad_batch_exits_2():
    assert_config_error(ZERO3, ["--batch", "6"], "does not split over 4 ranks")
