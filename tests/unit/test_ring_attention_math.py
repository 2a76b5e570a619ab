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
