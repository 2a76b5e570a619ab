"""Context parallelism beside tensor parallelism on 4 CPU ranks (2 CP x 2 TP), for tests/unit/test_planner_cp_tp.py.

The ranks form DeviceMesh (cp, tp), the planner's order (pp, dp, cp, tp) with pp = dp = 1. Each TP rank keeps its
share of the attention heads (a whole key/value head where TP exceeds them, as grouped-query attention replicates
it); each CP rank keeps two zig-zag chunks of the sequence. One attention layer runs forward and backward with
Llama 3's all-gather CP (distlab.context_parallel.all_gather_attention) over the rank's CP group, while CommCounter
records what it sends. Rank 0 writes every rank's groups, its collectives and whether its outputs and its
query, key and value gradients equal full attention on one rank (a replicated key/value head's gradient summed
over its TP group).

    python -m labkit.forkrun ... (launched by the test: labkit.launch.run(..., launcher="fork"))
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from distlab import comm, context_parallel, tensor_parallel

BATCH, HEADS, SEQ, HEAD_DIM = 2, 4, 16, 8


def one_layer(kv_heads: int, cp, tp) -> dict:
    generator = torch.Generator().manual_seed(kv_heads)
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=generator) for _ in range(2))
    grad = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, generator=generator)
    t, c, ways = tp.get_local_rank(), cp.get_local_rank(), tp.size()
    heads = slice(t * HEADS // ways, (t + 1) * HEADS // ways)
    kv_local = max(kv_heads // ways, 1)                      # a whole head where TP exceeds the key/value heads
    first_kv = (t * HEADS // ways) * kv_heads // HEADS       # the key/value head this rank's first query head uses
    kv = slice(first_kv, first_kv + kv_local)
    chunk = SEQ // (2 * cp.size())
    positions = tensor_parallel.chunk_positions(tensor_parallel.ring_chunks(c, cp.size()), chunk)
    every = torch.cat([tensor_parallel.chunk_positions(tensor_parallel.ring_chunks(r, cp.size()), chunk)
                       for r in range(cp.size())])
    mine = [x[:, s][:, :, positions].clone().requires_grad_() for x, s in ((q, heads), (k, kv), (v, kv))]
    with comm.CommCounter() as counter:
        out = context_parallel.all_gather_attention(*mine, positions, every, group=cp.get_group())
        out.backward(grad[:, heads][:, :, positions])
    # full causal attention on this rank alone, the keys repeated for grouped-query attention
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    repeat = HEADS // kv_heads
    reference = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(repeat, 1),
                                               full[2].repeat_interleave(repeat, 1), is_causal=True)
    reference.backward(grad)
    equal = torch.allclose(out, reference[:, heads][:, :, positions], atol=1e-5)
    equal &= torch.allclose(mine[0].grad, full[0].grad[:, heads][:, :, positions], atol=1e-5)
    for index in (1, 2):   # the keys' and the values' gradients
        grad_kv = mine[index].grad.clone()
        if kv_local * ways != kv_heads:   # a replicated head: each TP rank holds its own query heads' share
            dist.all_reduce(grad_kv, group=tp.get_group())
        equal &= torch.allclose(grad_kv, full[index].grad[:, kv][:, :, positions], atol=1e-5)
    return {"calls": [[call.collective, call.payload_bytes, call.group_size] for call in counter.calls],
            "equal": bool(equal)}


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cp, tp = mesh["cp"], mesh["tp"]
    record = {"rank": dist.get_rank(), "cp_group": dist.get_process_group_ranks(cp.get_group()),
              "tp_group": dist.get_process_group_ranks(tp.get_group()),
              "layers": {str(kv): one_layer(kv, cp, tp) for kv in (HEADS, 1)}}
    records = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as handle:
            json.dump({"shape": [BATCH, HEADS, SEQ, HEAD_DIM], "ranks": records}, handle)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
