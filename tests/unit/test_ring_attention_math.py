"""Context parallelism's pure pieces: sequence chunks per rank, causal work per rank, the online-softmax merge."""

import pytest
import torch
import torch.nn.functional as F

from distlab.tensor_parallel import (attention_with_lse, block_kind, causal_blocks_per_rank, chunk_positions,
                                     merge_attention_blocks, ring_chunks)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_chunk_is_held_once(layout, world):
    held = sorted(c for rank in range(world) for c in ring_chunks(rank, world, layout))
    assert held == list(range(2 * world))


def test_zigzag_balances_the_causal_work_and_contiguous_does_not():
    assert causal_blocks_per_rank(4, "zigzag") == [9, 9, 9, 9]
    assert causal_blocks_per_rank(4, "contiguous") == [3, 7, 11, 15]
    for world in (2, 4, 8):
        chunks = 2 * world
        total = chunks * (chunks + 1) // 2  # the lower triangle of chunk x chunk blocks, diagonal included
        assert sum(causal_blocks_per_rank(world, "zigzag")) == total == sum(causal_blocks_per_rank(world, "contiguous"))
        assert len(set(causal_blocks_per_rank(world, "zigzag"))) == 1


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError):
        ring_chunks(0, 4, "striped")


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse_equals_sdpa(causal):
    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)
    out, lse = attention_with_lse(q, k, v, causal=causal)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    assert lse.shape == (2, 4, 16)


def test_merging_blocks_of_keys_equals_attention_over_all_keys():
    q, k, v = torch.randn(2, 3, 12, 8), torch.randn(2, 3, 30, 8), torch.randn(2, 3, 30, 8)
    full, full_lse = attention_with_lse(q, k, v)
    blocks = [attention_with_lse(q, k[..., s, :], v[..., s, :]) for s in (slice(0, 7), slice(7, 20), slice(20, 30))]
    out, lse = blocks[0]
    for block in blocks[1:]:
        out, lse = merge_attention_blocks(out, lse, *block)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse)
    swapped, _ = merge_attention_blocks(*blocks[1], *blocks[0])  # the order of the blocks does not matter
    torch.testing.assert_close(merge_attention_blocks(*blocks[0], *blocks[1])[0], swapped)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_simulated_ring_equals_causal_attention(layout):
    """The ring of ring_attention.py, one process: every rank's queries against every rank's chunks."""
    world, chunk = 4, 3
    q, k, v = torch.randn(3, 1, 2, 2 * world * chunk, 8).unbind(0)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for rank in range(world):
        mine = ring_chunks(rank, world, layout)
        outputs = []
        for query_chunk in mine:
            rows = slice(query_chunk * chunk, (query_chunk + 1) * chunk)
            out = lse = None
            for step in range(world):
                owner = (rank - step) % world
                for key_chunk in ring_chunks(owner, world, layout):
                    kind = block_kind(query_chunk, key_chunk)
                    if kind == "skipped":
                        continue
                    cols = slice(key_chunk * chunk, (key_chunk + 1) * chunk)
                    block = attention_with_lse(q[..., rows, :], k[..., cols, :], v[..., cols, :],
                                               causal=kind == "diagonal")
                    out, lse = block if out is None else merge_attention_blocks(out, lse, *block)
            outputs.append(out)
        positions = chunk_positions(mine, chunk)
        torch.testing.assert_close(torch.cat(outputs, dim=-2), expected[..., positions, :])


def test_the_librarys_merge_keeps_a_row_that_has_seen_no_key_at_zero_and_passes_the_labs_check():
    """Both log-sum-exps -inf (a causal query whose keys in both blocks lie in its future): out 0, lse -inf, no nan.
    The lab's own check (causal blocks merged in reverse order) accepts the library's merge too."""
    import torch

    from distlab import tensor_parallel
    from labkit.exercises import ch08

    out = torch.zeros(2, 3, 4)
    lse = torch.full((2, 3), float("-inf"))
    merged, merged_lse = tensor_parallel.merge_attention_blocks(out, lse, out, lse)
    assert not torch.isnan(merged).any() and (merged == 0).all() and torch.isneginf(merged_lse).all()
    ch08.check_merge_attention_blocks(tensor_parallel.merge_attention_blocks)


# ---- the other ways (distlab.context_parallel): work per ring step, bytes per method, the Ulysses head check ----


def test_ring_step_work_adds_up_to_the_blocks_per_rank_and_times_the_ring_by_its_slowest_rank():
    from distlab import context_parallel as cpm

    for layout in ("zigzag", "contiguous"):
        work = cpm.ring_step_work(4, layout, diagonal=1.0)
        assert [sum(row[r] for row in work) for r in range(4)] == causal_blocks_per_rank(4, layout)
    assert cpm.ring_step_work(4, "zigzag", 0.5) == [[2.0] * 4] * 4            # balanced at every step
    assert cpm.ring_step_work(4, "contiguous", 0.5)[1] == [0.0, 4.0, 4.0, 4.0]  # rank 0 idles, keys from its future
    assert (cpm.ring_time_in_blocks(4, "contiguous", 1.0), cpm.ring_time_in_blocks(4, "zigzag", 1.0)) == (15, 9)
    assert (cpm.ring_time_in_blocks(4, "contiguous", 0.5), cpm.ring_time_in_blocks(4, "zigzag", 0.5)) == (14, 8)


def test_what_each_way_hands_its_collectives():
    from distlab import context_parallel as cpm
    from distlab.tensor_parallel import ring_comm_formula

    shard, world = 8192, 4
    ring = cpm.cp_comm_payloads("ring", shard, world)
    assert {phase: ring[phase]["send"] for phase in ring} == ring_comm_formula(shard, world)
    assert cpm.cp_comm_payloads("all-gather", shard, world) == {"forward": {"all_gather": 65536},
                                                                "backward": {"reduce_scatter": 65536}}
    assert cpm.cp_comm_payloads("torch alltoall", shard, world)["backward"] == {"all_to_all": 7 * 2 * shard}
    ulysses = cpm.cp_bytes_sent_per_rank("ulysses", shard, world, q_shard_bytes=4 * shard)  # GQA: Q 4x K
    assert ulysses["forward"] == 3 / 4 * (2 * 4 * shard + 2 * shard)
    with pytest.raises(ValueError):
        cpm.cp_comm_payloads("striped", shard, world)


def test_a_ring_step_hides_its_transfer_above_the_same_chunk_whatever_the_sequence():
    from distlab import context_parallel as cpm

    n = cpm.ring_break_even_tokens_per_rank(32, 4, 312e12, 300e9)
    assert n == pytest.approx(312e12 * 4 * 2 / (32 * 300e9))
    below, above = (cpm.ring_step_seconds(round(n * f), 32, 4, 128, 312e12, 300e9) for f in (0.5, 2))
    assert below["compute"] < below["transfer"] and above["compute"] > above["transfer"]
    assert cpm.ring_break_even_tokens_per_rank(32, 32, 312e12, 300e9) == pytest.approx(8 * n)  # no GQA: 8x longer


def test_ulysses_heads_that_do_not_split_and_native_on_a_cpu_are_refused_before_any_collective():
    import argparse
    import sys
    from pathlib import Path

    from distlab import runtime

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "08_sequence_parallel"))
    try:
        import ring_attention
    finally:
        sys.path.pop(0)
    args = argparse.Namespace(seq_len=64, heads=6, native=False, device="cpu", methods=list(ring_attention.METHODS))
    with pytest.raises(runtime.ConfigError, match="--heads 6 does not split over 4 ranks"):
        ring_attention.check_config(args, 4)
    ring_attention.check_config(argparse.Namespace(**{**vars(args), "methods": ["ring"]}), 4)  # the ring does not care
    # PyTorch's context_parallel covers only CUDA kernels: --native on a CPU is refused the same way
    with pytest.raises(runtime.ConfigError, match="--native runs PyTorch's context_parallel"):
        ring_attention.check_config(argparse.Namespace(**{**vars(args), "heads": 4, "native": True}), 4)


def test_the_labs_check_rejects_a_merge_through_exp_that_overflows():
    """exp(lse_a) + exp(lse_b) is the same sum as logaddexp until an lse passes 88 (fp32's exp overflows): the lab's
    check has a case with lse up to 311, so a merge that overflows there is wrong, not merely unstable."""
    import torch

    from labkit.exercises import ch08

    def through_exp(out_a, lse_a, out_b, lse_b):
        lse = torch.log(torch.exp(lse_a) + torch.exp(lse_b))
        out = torch.exp(lse_a - lse).unsqueeze(-1) * out_a + torch.exp(lse_b - lse).unsqueeze(-1) * out_b
        return out.nan_to_num(0.0), lse

    with pytest.raises(ch08.ExerciseWrong, match="overflows"):
        ch08.check_merge_attention_blocks(through_exp)


def test_torch_sends_dk_dv_in_fp32_under_bf16_twice_the_bf16_bytes():
    """torch 2.13's context-parallel backward accumulates dK, dV in fp32 (convert_to_f32) and sends the accumulators:
    measured on its own functions in bf16, on one gloo rank in this process (its dK, dV hop still runs: one
    all-to-all of P = 1), against the formula, which says twice a bf16 (dK, dV)."""
    import torch.distributed as dist

    from distlab import comm
    from distlab import context_parallel as cpm

    generator = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(2, 4, 16, 16, generator=generator).bfloat16() for _ in range(4))
    shard = k.numel() * k.element_size()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for rotate_method in cpm.ROTATE_METHODS:
            counters = {"forward": comm.CommCounter(), "backward": comm.CommCounter()}
            out = cpm.torch_ring_attention(q, k, v, grad_out, rotate_method, phase_counters=counters)
            assert all(t.dtype == torch.bfloat16 for t in out)          # what the caller gets back is bf16
            measured = counters["backward"].by_collective()["all_to_all"]["payload_bytes"]
            formula = cpm.cp_comm_payloads(f"torch {rotate_method}", shard, 1, dtype_bytes=2)["backward"]["all_to_all"]
            assert measured == formula == 2 * (2 * shard)               # dK and dV, fp32: twice their bf16 bytes
    finally:
        dist.destroy_process_group()
    # at P = 4 the backward's dK, dV hops: 4 of them, fp32, beside K and V's bf16 ones
    assert cpm.cp_comm_payloads("torch alltoall", shard, 4, dtype_bytes=2)["backward"] == {
        "all_to_all": 3 * 2 * shard + 4 * 2 * 2 * shard}
    assert cpm.cp_comm_payloads("ring", shard, 4, dtype_bytes=2) == cpm.cp_comm_payloads("ring", shard, 4)
