"""Context parallelism besides the hand-written ring (chapter 08): all-gather CP, Ulysses, and PyTorch's own.

Chapter 08's ``ring_attention.py`` writes the ring itself, where each rank's keys and values travel rank to rank
with send/recv. It runs the other ways next to it, from here, and checks every one against full causal attention:

* :func:`all_gather_attention`, **all-gather CP** (what Llama 3 ran; torch 2.13's ``context_parallel`` gathers K and
  V this way by default, though it merges block by block and gathers again in backward): every rank all-gathers
  the whole sequence's K and V once, attends its own queries to them under the causal mask of its positions, and
  in backward reduce-scatters dK and dV home. One collective each way instead
  of P - 1 hops, but the latency is not hidden behind attention and each rank holds K and V of the whole sequence.
* :func:`ulysses_attention`, **Ulysses** (DeepSpeed-Ulysses): an all-to-all swaps the sequence shard for a head
  shard, so each rank holds the whole sequence for H/P heads and runs ordinary causal attention; a second
  all-to-all swaps back. P cannot exceed the number of (key/value) heads.
* :func:`torch_ring_attention`, **PyTorch's own** context-parallel attention (``_templated_ring_attention`` and its
  backward, the functions ``context_parallel`` runs for each attention call), with either rotate method, on a CPU:
  they take the block attention as an argument, and this hands them torch's CPU flash-attention kernel
  (``context_parallel`` itself covers only CUDA kernels).

Formulas for what each sends (:func:`cp_comm_payloads`, :func:`cp_bytes_sent_per_rank`), the causal work of each ring
step (:func:`ring_step_work`), and when a ring step's transfer hides behind its attention
(:func:`ring_step_seconds`, :func:`ring_break_even_tokens_per_rank`) are pure functions, each tested.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab.tensor_parallel import NVLINK3_A100_PER_DIRECTION_BYTES_PER_S, block_kind, ring_chunks

# torch 2.13's context parallelism lives here (torch/distributed/tensor/experimental/_context_parallel/_attention.py;
# the public module torch.distributed.tensor.experimental._attention re-exports part of it).
TORCH_CP_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"
ROTATE_METHODS = ("allgather", "alltoall")

# A ring hop goes to one neighbour, over the links between those two GPUs only. In a node of 4 A100s wired to each
# other without an NVSwitch (the course's 4 x A100 nodes; NVIDIA's HGX A100 4-GPU board) each GPU's 12 NVLink 3 links
# are split 4 to each of the 3 others (nvidia-smi topo -m prints NV4 between each pair): 100 GB/s a direction to a
# neighbour, the 200 GB/s both ways together that NVIDIA's "Introducing NVIDIA HGX A100" blog gives as the 4-GPU
# board's A100-to-A100 peer bandwidth; a third of the 300 that an NVSwitch gives any pair on 8-GPU boards.
NVLINK3_A100_4GPU_PEER_BYTES_PER_S = NVLINK3_A100_PER_DIRECTION_BYTES_PER_S * 4 / 12


# --------------------------------------------------------------------------------------------------
# All-gather context parallelism
# --------------------------------------------------------------------------------------------------


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 in forward; in backward each rank's gradient of the gathered tensor is summed over
    ranks and scattered, its own shard home: a reduce-scatter (sequence parallelism's pair, the other way round)."""

    @staticmethod
    def forward(ctx, shard, group):
        ctx.group = group
        world = dist.get_world_size(group)
        gathered = shard.new_empty((world * shard.shape[0],) + tuple(shard.shape[1:]))
        dist.all_gather_single(gathered, shard.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        shard = grad.new_empty((grad.shape[0] // world,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_single(shard, grad.contiguous(), group=ctx.group)
        return shard, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         every_rank_positions: torch.Tensor, group=None) -> torch.Tensor:
    """Causal attention of this rank's queries against the whole sequence's keys, gathered once.

    q, k, v: (B, H, n, D) at this rank's ``positions`` (n = S/P, any order: zig-zag works as is);
    ``every_rank_positions``: every rank's positions, concatenated in rank order (what the gather lines up).
    The gathered keys need not be in sequence order: attention does not care about the order of its keys, only
    the mask does, and the mask is built from positions.
    """
    # K and V of this rank in one message, the sequence first so that the gather concatenates along it
    mine = torch.stack([k, v]).permute(3, 0, 1, 2, 4)                     # (n, 2, B, H, D)
    gathered = _GatherSequence.apply(mine, group).permute(1, 2, 3, 0, 4)  # (2, B, H, S, D): every rank's K, V
    keys, values = gathered[0], gathered[1]
    visible = every_rank_positions.unsqueeze(0) <= positions.unsqueeze(1)  # key position <= query position
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible.to(q.device))


# --------------------------------------------------------------------------------------------------
# Ulysses: all-to-all over heads
# --------------------------------------------------------------------------------------------------


def _swap(blocks: torch.Tensor, group) -> torch.Tensor:
    """Block j of dim 0 goes to rank j; block i of the result came from rank i. Differentiable: backward swaps
    the gradients back (torch 2.13's functional all-to-all has autograd, _functional_collectives.py:592-603)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    return all_to_all_single_autograd(blocks.contiguous(), None, None, group or dist.group.WORLD)


def sequence_to_heads(x: torch.Tensor, group=None) -> torch.Tensor:
    """(B, H, n, D) for this rank's n positions, all heads -> (B, H/P, P n, D): the whole sequence, H/P heads.
    Ranks must hold contiguous shards (rank r: positions r n .. (r + 1) n - 1), so rank order is sequence order."""
    world = dist.get_world_size(group)
    batch, heads, n, dim = x.shape
    blocks = x.reshape(batch, world, heads // world, n, dim).transpose(0, 1)  # block j: head group j, to rank j
    received = _swap(blocks, group)                                           # block i: rank i's positions
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world, world * n, dim)


def heads_to_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """The inverse: (B, H/P, S, D) -> (B, H, S/P, D), this rank's positions with every head."""
    world = dist.get_world_size(group)
    batch, heads, seq, dim = x.shape
    blocks = x.reshape(batch, heads, world, seq // world, dim).permute(2, 0, 1, 3, 4)  # block i: rank i's positions
    received = _swap(blocks, group)                                                    # block j: head group j
    return received.transpose(0, 1).reshape(batch, world * heads, seq // world, dim)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> torch.Tensor:
    """Causal attention over a sequence split contiguously over ranks: swap to heads, attend, swap back."""
    q, k, v = (sequence_to_heads(t, group) for t in (q, k, v))
    return heads_to_sequence(F.scaled_dot_product_attention(q, k, v, is_causal=True), group)


# --------------------------------------------------------------------------------------------------
# PyTorch's own context-parallel attention, with the block attention handed in
# --------------------------------------------------------------------------------------------------


def _cpu_block_attention(query, key, value, is_causal, **_):
    """One block, forward: torch's CPU flash-attention kernel, which returns the output and its log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal)


def _cpu_block_attention_backward(*, grad_out, query, key, value, out, logsumexp, is_causal, **_):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal)


def torch_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                         rotate_method: str, group=None, phase_counters: dict | None = None) -> tuple[torch.Tensor, ...]:
    """torch 2.13's context-parallel attention on this rank's head-and-tail (zig-zag) shards: (out, dq, dk, dv).

    ``context_parallel`` patches ``scaled_dot_product_attention`` so that each call on a sharded tensor runs
    ``_templated_ring_attention`` (forward) and ``_templated_ring_attention_backward`` with a CUDA kernel for each
    block; its handlers cover only CUDA kernels, so on a CPU this calls the same two functions with the CPU kernel.
    ``rotate_method``: "allgather" (torch's default) or "alltoall" (a ring, each hop an all-to-all that is a
    permutation: every rank sends its whole buffer to the next). dK and dV always travel by "alltoall".
    ``phase_counters``: {"forward": counter, "backward": counter}, context managers entered around each phase
    (:class:`distlab.comm.CommCounter`).
    """
    import contextlib
    import importlib

    cp = importlib.import_module(TORCH_CP_MODULE)
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method must be one of {ROTATE_METHODS}, not {rotate_method!r}")
    group = group or dist.group.WORLD
    saved = (cp._cp_options.rotate_method, cp._cp_options.enable_load_balance)
    cp.set_rotate_method(rotate_method)
    cp._cp_options.enable_load_balance = True  # head-and-tail shards: what context_parallel's default load balancer makes
    phase_counters = phase_counters or {}
    try:
        with phase_counters.get("forward", contextlib.nullcontext()):
            out, lse = cp._templated_ring_attention(group, 2, _cpu_block_attention, q, k, v, is_causal=True)[:2]
        with phase_counters.get("backward", contextlib.nullcontext()):
            grads = cp._templated_ring_attention_backward(group, 2, _cpu_block_attention_backward, grad_out,
                                                          "grad_out", q, k, v, out, lse, is_causal=True)[:3]
    finally:
        cp._cp_options.rotate_method, cp._cp_options.enable_load_balance = saved
    return (out, *grads)


# --------------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------------

CP_METHODS = ("ring", "all-gather", "ulysses", "torch allgather", "torch alltoall")


# torch 2.13 accumulates dK and dV in fp32 whatever the inputs' dtype (_ContextParallelOptions.convert_to_f32 = True,
# _context_parallel/_attention.py:75, 512-515) and sends those accumulators round the ring (:625-627): under bf16 its
# dK, dV hops move twice the bytes of a bf16 dK, dV.
TORCH_CP_GRAD_BYTES = 4


def cp_comm_payloads(method: str, kv_shard_bytes: int, world_size: int,
                     q_shard_bytes: int | None = None, dtype_bytes: int = 4) -> dict[str, dict[str, int]]:
    """Payload bytes one rank hands to each kind of collective in one attention, {phase: {collective: bytes}}
    (payloads as :class:`distlab.comm.CommCounter` measures them: a send's message, an all-gather's gathered output,
    a reduce-scatter's and an all-to-all's input). ``kv_shard_bytes``: this rank's K (or V); ``q_shard_bytes``: its
    Q (or output), K's size unless given (GQA makes K and V smaller than Q); ``dtype_bytes``: bytes of one of their
    numbers (2 under bf16). torch's own sends dK and dV in fp32 whatever that is (:data:`TORCH_CP_GRAD_BYTES`).

    * ``ring`` (ring_attention.py): forward P - 1 sends of (K, V); backward P - 1 of (K, V, dK, dV), 1 of (dK, dV).
    * ``all-gather`` (by hand): forward one all-gather of the whole sequence's (K, V), kept for backward; backward
      one reduce-scatter of (dK, dV).
    * ``ulysses``: forward all-to-alls of q, k, v and of the output; backward the same four, reversed.
    * ``torch allgather``: forward one all-gather of (K, V); backward another (nothing was kept) and P permuting
      all-to-alls of (dK, dV), the ring's dK, dV hops, in fp32.
    * ``torch alltoall``: the ring with each hop a permuting all-to-all: forward P - 1 of (K, V), backward P - 1 of
      (K, V) and P of (dK, dV), in fp32.
    """
    q_shard_bytes = kv_shard_bytes if q_shard_bytes is None else q_shard_bytes
    kv, p = 2 * kv_shard_bytes, world_size
    dkv = kv * TORCH_CP_GRAD_BYTES // dtype_bytes       # torch's dK, dV: fp32 accumulators (bf16: twice K, V)
    if method == "ring":
        return {"forward": {"send": (p - 1) * kv}, "backward": {"send": (p - 1) * 2 * kv + kv}}
    if method == "all-gather":
        return {"forward": {"all_gather": p * kv}, "backward": {"reduce_scatter": p * kv}}
    if method == "ulysses":
        both = 2 * q_shard_bytes + kv
        return {"forward": {"all_to_all": both}, "backward": {"all_to_all": both}}
    if method == "torch allgather":
        return {"forward": {"all_gather": p * kv}, "backward": {"all_gather": p * kv, "all_to_all": p * dkv}}
    if method == "torch alltoall":
        return {"forward": {"all_to_all": (p - 1) * kv}, "backward": {"all_to_all": (p - 1) * kv + p * dkv}}
    raise ValueError(f"method must be one of {CP_METHODS}, not {method!r}")


def cp_bytes_sent_per_rank(method: str, kv_shard_bytes: int, world_size: int,
                           q_shard_bytes: int | None = None, dtype_bytes: int = 4) -> dict[str, float]:
    """Bytes one rank puts on the wire, {phase: bytes}, from :func:`cp_comm_payloads`: a send and torch's permuting
    all-to-all send their whole payload (to one rank); an all-gather, a reduce-scatter and Ulysses' even all-to-all
    send (P-1)/P of it (the rest stays home)."""
    p = world_size
    whole = method in ("ring", "torch alltoall")
    sent = {}
    for phase, payloads in cp_comm_payloads(method, kv_shard_bytes, world_size, q_shard_bytes, dtype_bytes).items():
        total = 0.0
        for collective, payload in payloads.items():
            permutes = collective == "send" or whole or (method == "torch allgather" and collective == "all_to_all")
            total += payload if permutes else payload * (p - 1) / p
        sent[phase] = total
    return sent


def ring_step_work(world_size: int, layout: str = "zigzag", diagonal: float = 0.5) -> list[list[float]]:
    """Attention work of each rank at each ring step, ``work[step][rank]``, in full chunk x chunk blocks: a block
    below the diagonal counts 1, a diagonal (half-masked) block ``diagonal`` (1 counts blocks, 0.5 counts scores)."""
    work = []
    for step in range(world_size):
        row = []
        for rank in range(world_size):
            owner = (rank - step) % world_size
            kinds = [block_kind(q, k) for q in ring_chunks(rank, world_size, layout)
                     for k in ring_chunks(owner, world_size, layout)]
            row.append(sum(1.0 if kind == "full" else diagonal for kind in kinds if kind != "skipped"))
        work.append(row)
    return work


def ring_time_in_blocks(world_size: int, layout: str = "zigzag", diagonal: float = 0.5) -> float:
    """The ring's time in blocks: each step lasts as long as its busiest rank (the next hop waits for it)."""
    return sum(max(row) for row in ring_step_work(world_size, layout, diagonal))


def ring_step_seconds(tokens_per_rank: int, heads: int, kv_heads: int, head_dim: int, peak_flops: float,
                      link_bytes_per_s: float, number_bytes: int = 2) -> dict[str, float]:
    """One zig-zag ring step away from the diagonal, one sequence, forward: the attention a rank computes (its
    n = S/P queries against n visiting keys, half of the n x n pairs: 2 chunk x chunk blocks, 2 n^2 H D FLOPs
    counting a multiply-add as 2) at ``peak_flops``, and the transfer of the next K, V (2 n H_kv D numbers) at
    ``link_bytes_per_s`` in one direction. Neither depends on S, only on n, and the transfer on H_kv (GQA)."""
    n = tokens_per_rank
    return {"compute": 2 * n * n * heads * head_dim / peak_flops,
            "transfer": 2 * n * kv_heads * head_dim * number_bytes / link_bytes_per_s}


def ring_break_even_tokens_per_rank(heads: int, kv_heads: int, peak_flops: float, link_bytes_per_s: float,
                                    number_bytes: int = 2) -> float:
    """The tokens per rank n = S/P above which a ring step computes longer than it transfers (at peak FLOP/s: a
    slower kernel hides the transfer sooner): n = peak x H_kv x bytes / (H x link), from :func:`ring_step_seconds`."""
    return peak_flops * kv_heads * number_bytes / (heads * link_bytes_per_s)
