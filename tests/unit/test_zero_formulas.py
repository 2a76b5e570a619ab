"""The ZeRO / FSDP / DDP formulas chapters 04 and 05 quote: bytes per step and training state per GPU."""

import math

import pytest

from distlab import comm, memory, models

P = models.preset("tiny").num_params()


def gib(num_params, world, stage):
    return memory.zero_state_bytes(int(num_params), world, stage).total / memory.GIB


def test_ddp_moves_the_gradient_bytes_and_each_rank_sends_two_times_n_minus_one_over_n():
    assert P == 123_200
    step = comm.zero_step_bytes(P, 0)
    assert step == {"all_reduce": 4 * P} == {"all_reduce": 492_800}
    assert comm.step_bytes_sent_per_rank(step, 4) == 739_200 == 2 * 3 / 4 * 4 * P


@pytest.mark.parametrize("world", [2, 4, 8, 64])
def test_zero_stages_cost_relative_to_ddp(world):
    ddp = comm.step_bytes_sent_per_rank(comm.zero_step_bytes(P, 0), world)
    sent = {stage: comm.step_bytes_sent_per_rank(comm.zero_step_bytes(P, stage), world) for stage in (1, 2, 3)}
    assert math.isclose(sent[1], 1.5 * ddp)  # our ZeRO-1: an all-reduce, then an all-gather
    assert math.isclose(sent[2], ddp)        # reduce-scatter + all-gather = an all-reduce
    assert math.isclose(sent[3], 1.5 * ddp)  # FSDP: the weights are gathered twice
    no_reshard = comm.zero_step_bytes(P, 3, reshard_after_forward=False)
    assert math.isclose(comm.step_bytes_sent_per_rank(no_reshard, world), ddp)


def test_fsdp_bf16_halves_the_all_gather_not_the_fp32_reduce_scatter():
    assert comm.zero_step_bytes(P, 3, param_bytes=2) == {"all_gather": 2 * 2 * P, "reduce_scatter": 4 * P}


def test_zero_step_bytes_rejects_unknown_stage():
    with pytest.raises(ValueError):
        comm.zero_step_bytes(P, 4)


def test_sixteen_bytes_per_parameter_divided_by_n():
    assert memory.zero_state_bytes(P, 1, 0).total == 16 * P
    for stage, per_param in ((1, 2 + 2 + 12 / 4), (2, 2 + (2 + 12) / 4), (3, 16 / 4)):
        assert memory.zero_state_bytes(P, 4, stage).total == per_param * P
    fp32 = memory.zero_state_bytes(P, 4, 3, precision="fp32")  # what FSDP2 keeps: fp32 shards
    assert (fp32.params, fp32.grads, fp32.optimizer) == (P, P, 2 * P)


def test_the_chapter_numbers_for_7b_and_13b_on_a100_40gb():
    # chapter 05's table, GiB per GPU: DDP, ZeRO-1, ZeRO-2, ZeRO-3
    assert [round(gib(7e9, 4, s), 1) for s in range(4)] == [104.3, 45.6, 35.9, 26.1]
    assert [round(gib(7e9, 8, s), 1) for s in range(4)] == [104.3, 35.9, 24.4, 13.0]
    assert [round(gib(7e9, 16, s), 1) for s in range(4)] == [104.3, 31.0, 18.7, 6.5]
    assert [round(gib(13e9, 4, s), 1) for s in range(4)] == [193.7, 84.8, 66.6, 48.4]
    assert [round(gib(13e9, 8, s), 1) for s in range(4)] == [193.7, 66.6, 45.4, 24.2]
    assert [round(gib(13e9, 16, s), 1) for s in range(4)] == [193.7, 57.5, 34.8, 12.1]
    # the smallest power of two that leaves >= 10 GiB of a 40 GiB A100 under ZeRO-3 (exercise 2)
    assert next(n for n in (1, 2, 4, 8, 16) if gib(13e9, n, 3) <= 30) == 8


def test_the_a100_large_preset_needs_fsdp_on_a100_40gb():
    num_params = models.preset("a100_large").num_params()
    assert round(num_params / 1e9, 2) == 3.37
    assert gib(num_params, 1, 0) > 40           # 50.2 GiB: DDP does not fit one A100-40GB, before activations
    assert round(gib(num_params, 1, 0), 1) == 50.2
    assert round(gib(num_params, 4, 3), 1) == 12.5  # FSDP on 4: a quarter


def test_the_chapter_04_numbers_for_the_a100_preset():
    num_params = models.preset("a100").num_params()
    assert num_params == 1_364_297_728
    step = comm.zero_step_bytes(num_params, 0)  # fp32 gradients (autocast keeps fp32 weights)
    assert round(step["all_reduce"] / 1e9, 2) == 5.46
    assert round(comm.step_bytes_sent_per_rank(step, 4) / 1e9, 2) == 8.19
    assert round(memory.training_state_bytes(num_params, "fp32").total / memory.GIB, 1) == 20.3
