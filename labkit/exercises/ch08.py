"""Lab 08's exercise checks (sequence and context parallelism): the online-softmax merge of two blocks of attention,
the step ring attention repeats (:func:`check_merge_attention_blocks`), and Ulysses' all-to-all that trades each
rank's sequence shard for a shard of the heads (:func:`check_swap_to_heads`).
"""

from __future__ import annotations

import math

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, learner_check, sentence, wrong_tensor
from labkit.exercises.checks import _not_done, _ok, _short  # the shared feedback helpers

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_merge_attention_blocks", "check_swap_to_heads"]


# --------------------------------------------------------------------------------------------------
# Checks of one exercise each: they look at more than the final number, so a plausible wrong answer that
# happens to give it (an unsharded optimizer, loss statistics counted in the wrong phase) is still caught.
# tests/unit/test_exercises_reject_wrong.py feeds each one the wrong answers it must reject.
# --------------------------------------------------------------------------------------------------


def _block_attention(q, k, v, query_positions, key_positions, causal: bool):
    """Attention of q over one block of keys, and its log-sum-exp; a query that sees no key of the block
    (causal, all its keys in the future) gets out = 0 and lse = -inf, as FlashAttention returns."""
    import torch

    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(key_positions[None, :] > query_positions[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
    return out, lse


@learner_check
def check_merge_attention_blocks(merge, *, hint: str = "") -> None:
    """Notebook 08: the online-softmax merge, block by block against full softmax attention.

    Without a mask: keys split in two and three blocks, and once with scores large enough that exp(lse)
    overflows fp32 (lse above 88), which a merge through exp(lse_a) + exp(lse_b) cannot survive. With a causal
    mask: a query sees no key of a block in its future, so that block's lse is -inf for it, and merged in reverse
    order (a ring can deliver the blocks in any order) a query can have seen no key on either side yet: its out
    must stay 0 and its lse -inf, not nan. The merged lse is compared too: the next merge needs it.
    """
    import torch

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, length, 8, generator=generator) for length in (24, 24, 24))
    positions = torch.arange(24)
    # (label, cuts, causal, merged last block first, scale of the queries: at 60 two thirds of the rows have lse
    # past 88.7, where fp32's exp overflows; up to 311)
    cases = [("no mask, keys cut at 10", [10], False, False, 1.0),
             ("no mask, keys cut at 4 and 17", [4, 17], False, False, 1.0),
             ("no mask, keys cut at 10, scores large enough that exp(lse) overflows fp32", [10], False, False, 60.0),
             ("causal, keys cut at 8 and 16", [8, 16], True, False, 1.0),
             ("causal, keys cut at 8 and 16, merged last block first", [8, 16], True, True, 1.0)]
    for label, cuts, causal, reverse, scale in cases:
        queries = q * scale
        full_out, full_lse = _block_attention(queries, k, v, positions, positions, causal)
        edges = [0, *cuts, 24]
        blocks = [_block_attention(queries, k[..., a:b, :], v[..., a:b, :], positions, positions[a:b], causal)
                  for a, b in zip(edges, edges[1:])]
        blocks = blocks[::-1] if reverse else blocks
        out, lse = blocks[0]
        try:
            for block_out, block_lse in blocks[1:]:
                out, lse = merge(out, lse, block_out, block_lse)
        except NotImplementedError:
            raise _not_done("merge_attention_blocks", hint) from None
        for what, got, expected in (("out", out, full_out), ("lse", lse, full_lse)):
            if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
                raise ExerciseWrong(f"`merge_attention_blocks`, {label}: {what} should be a tensor of shape "
                                    f"{tuple(expected.shape)}, got {_short(got)}. {hint}".strip())
            if torch.isinf(got).any() and not torch.isinf(expected).any():
                raise ExerciseWrong(f"`merge_attention_blocks`, {label}: {what} has inf where full attention has none: "
                                    f"exp of a large lse overflows; combine the lses with logaddexp and weight each "
                                    f"output by exp(its lse - lse), which is at most 1. {hint}".strip())
            if torch.isnan(got).any():
                raise ExerciseWrong(f"`merge_attention_blocks`, {label}: {what} has nan: a query that has seen no "
                                    f"key yet has lse -inf on both sides, and exp(-inf - (-inf)) is nan; keep its "
                                    f"out 0 and lse -inf. {hint}".strip())
            if not torch.allclose(got.double(), expected.double(), atol=1e-5, rtol=1e-5):
                how = wrong_tensor(got, expected, atol=1e-5, rtol=1e-5, reference="full attention")
                raise ExerciseWrong(f"`merge_attention_blocks`, {label}: {what} {sentence(how)} {hint}".strip())
    _ok(f"merge_attention_blocks passed {len(cases)} cases (causal ones with fully masked rows included)")


def _heads(first: int, count: int) -> str:
    """'head 3' for a group of one, 'heads 2 to 3' for more."""
    return f"head {first}" if count == 1 else f"heads {first} to {first + count - 1}"


@learner_check
def check_swap_to_heads(swap, *, hint: str = "") -> None:
    """Notebook 08: Ulysses' all-to-all, played for every rank in one process. ``swap(shards)`` takes the c ranks'
    tensors, rank r's (B, a, S/c, d): its own contiguous positions of every head. It returns the c tensors after the
    all-to-all, rank j's (B, a/c, S, d): every position of head group j (heads j a/c .. (j + 1) a/c - 1).

    The cases: one head a rank (4 heads on 4 ranks), two heads a rank (8 on 4), and 4 heads on 2 ranks. With two
    heads or more a rank, handing rank j every c-th head (j, j + c, ...) gives the right shapes and wrong heads; with
    blocks put together in another order than the ranks', the positions come out of sequence order. The answer must
    not call a collective: the c ranks are the list, in this one process.
    """
    import torch

    generator = torch.Generator().manual_seed(8)
    for ranks, heads in ((4, 4), (4, 8), (2, 4)):
        batch, n, dim = 2, 3, 5
        full = torch.randn(batch, heads, ranks * n, dim, generator=generator)   # the whole sequence, every head
        shards = [full[:, :, r * n:(r + 1) * n].clone() for r in range(ranks)]
        label = f"{heads} heads on {ranks} ranks"
        try:
            got = swap([shard.clone() for shard in shards])
        except NotImplementedError:
            raise _not_done("swap_to_heads", hint) from None
        if not isinstance(got, (list, tuple)) or len(got) != ranks:
            raise ExerciseWrong(f"`swap_to_heads`, {label}: return a list of {ranks} tensors, one a rank, got "
                                f"{_short(got)}. {hint}".strip())
        group = heads // ranks
        for j, tensor in enumerate(got):
            expected = full[:, j * group:(j + 1) * group]
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(expected.shape):
                raise ExerciseWrong(f"`swap_to_heads`, {label}: rank {j} should hold (B, a/c, S, d) = "
                                    f"{tuple(expected.shape)}: all {ranks * n} positions of {group} head(s), got "
                                    f"{_short(tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tensor)}. "
                                    f"{hint}".strip())
            if torch.equal(tensor, expected):
                continue
            if torch.equal(tensor, full[:, j::ranks]):
                raise ExerciseWrong(f"`swap_to_heads`, {label}: rank {j} got every {ranks}th head ({j}, {j + ranks}, "
                                    f"...); it must get the contiguous group, {_heads(j * group, group)}, as "
                                    f"attention's heads are laid out. {hint}".strip())
            if sorted(tensor.flatten().tolist()) == sorted(expected.flatten().tolist()):
                raise ExerciseWrong(f"`swap_to_heads`, {label}: rank {j} holds the right numbers in the wrong places: "
                                    f"put the received blocks together along the sequence, in rank order (rank i's "
                                    f"block holds positions {n} i to {n} i + {n - 1}). {hint}".strip())
            raise ExerciseWrong(f"`swap_to_heads`, {label}: rank {j} does not hold {_heads(j * group, group)} of "
                                f"the whole sequence: rank i sends head group j of its positions to rank j. "
                                f"{hint}".strip())
    _ok("swap_to_heads: every rank holds the whole sequence of its heads (one head a rank and two), so attention can "
        "now run whole on each rank; the inverse all-to-all brings the output back to sequence shards")
