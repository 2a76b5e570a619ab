"""Context parallelism: causal attention over a sequence split across ranks, K and V passed around a ring.

Each rank holds the queries, keys and values of its part of the sequence. Attention needs every query
against every (earlier) key, so the key/value blocks travel: at step s, rank r works on the block that
rank r - s owns, while sending the block it holds to rank r + 1. Each query keeps a running output and
log-sum-exp, and every new block is folded in with the online-softmax merge
(`distlab.tensor_parallel.merge_attention_blocks`): after P steps each query has seen every key, and no
rank ever held the S x S score matrix. The blocks of K and V a rank holds are measured on their storages
(`distlab.memory.StorageLedger`) once the next block's buffer exists: three in forward (its own, kept for backward,
the one it computes with and the one arriving), because each step lets go of the block it is done with (a view or
a finished request kept one step longer would make it four), and five in backward (its own K, V, and two messages
of K, V, dK, dV). The blocks logged as computed are identified by what arrived (their first key row), not by plan.

Backward runs the same ring: the key/value blocks travel again, this time with their gradients, which
every rank adds to on the way; one last hop brings each block's finished dK, dV home. The forward posts each hop
before computing, so on a GPU the transfer can run behind the attention; the backward computes, then sends and
waits (dK, dV must be finished before they move), so as written it does not overlap. On a CPU, with 4 ranks on 2
cores, neither is measured to overlap.

The causal mask makes the work uneven: with contiguous shards rank 0 (the start of the sequence) attends to
almost nothing and the last rank to everything. Zig-zag sharding gives each rank one early and one late
chunk of 2P, and the same work. The script counts the attention blocks each rank computes for both layouts
and proves that outputs and gradients equal full causal attention.

Then it runs the other ways to split attention by sequence (``--methods``; `distlab.context_parallel`) on the same
q, k, v and checks each against full attention, and torch's against this ring, counting what each sends:

* all-gather CP (Llama 3's; torch's default): gather the whole sequence's K and V once, reduce-scatter dK, dV;
* Ulysses: an all-to-all swaps the sequence shard for a head shard, attention runs whole, a second swaps back;
* torch: PyTorch 2.13's own context-parallel attention with each rotate method, "allgather" (its default: every
  rank ends up holding all of K and V) and "alltoall" (a ring, like this one).

    torchrun --standalone --nproc_per_node=4 scripts/08_sequence_parallel/ring_attention.py
    torchrun --standalone --nproc_per_node=4 scripts/08_sequence_parallel/ring_attention.py --native   # CUDA only
"""

import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import comm, context_parallel, memory, metrics, runtime
from distlab.tensor_parallel import (attention_with_lse, block_kind, chunk_positions,
                                     merge_attention_blocks, ring_chunks, ring_comm_formula)

SHAPES = {"tiny": {"batch": 2, "heads": 4, "seq_len": 64, "head_dim": 16},
          "a100": {"batch": 1, "heads": 16, "seq_len": 16384, "head_dim": 128}}
# Largest difference relative to the largest value: fp32 softmax sums in another order (~1e-7 relative).
TOLERANCE = 1e-5
# On a GPU these widen 10x: its kernels sum in other, partly nondeterministic orders (metrics.fp32_tolerance).
METHODS = ("ring", "all-gather", "ulysses", "torch")
# keep-own-block: the ring forgets to take the block that arrived and computes with its own at every step. The
# outputs are wrong, and the blocks logged as computed (what really arrived) no longer cover the causal triangle.
PLANTED_BUGS = ("keep-own-block",)


def ring_pass(tensor, rank, world_size):
    """Send ``tensor`` to the next rank and receive the previous rank's, asynchronously."""
    received = torch.empty_like(tensor)
    # One batch: on NCCL a send on its own may wait for its matching receive, and two ranks that both start
    # by sending to each other (a ring of 2) would wait forever. Posted together, they cannot.
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, (rank + 1) % world_size),
                                       dist.P2POp(dist.irecv, received, (rank - 1) % world_size)])
    return received, requests


def block_pairs(my_chunks, owner, world_size, layout):
    """(i, j, kind) for my i-th chunk of queries against the owner's j-th chunk of keys, masked ones left out."""
    for i, query_chunk in enumerate(my_chunks):
        for j, key_chunk in enumerate(ring_chunks(owner, world_size, layout)):
            kind = block_kind(query_chunk, key_chunk)
            if kind != "skipped":
                yield i, j, kind


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries (its two chunks) against the whole sequence's keys."""

    @staticmethod
    def forward(ctx, q, k, v, layout, log, planted_bug=None):
        rank, world = dist.get_rank(), dist.get_world_size()
        my_chunks = ring_chunks(rank, world, layout)
        chunk = q.shape[-2] // 2
        queries = q.split(chunk, dim=-2)
        out, lse = [None, None], [None, None]
        ledger = memory.StorageLedger()    # the K and V blocks this rank holds, read off their storages
        ledger.watch(k, v)                 # its own, kept for backward
        travelling = torch.stack([k, v])  # one message per hop
        ledger.watch(travelling)
        for step in range(world):
            owner = (rank - step) % world
            if step < world - 1:  # start the next hop first: it runs while this block computes
                arriving, requests = ring_pass(travelling, rank, world)
                ledger.watch(arriving)
            held = ledger.measure(f"step {step}: the next block's buffer allocated")   # the most this step holds
            keys, values = travelling[0].split(chunk, dim=-2), travelling[1].split(chunk, dim=-2)
            kinds, computed = [], []
            for i, j, kind in block_pairs(my_chunks, owner, world, layout):
                block_out, block_lse = attention_with_lse(queries[i], keys[j], values[j], causal=kind == "diagonal")
                if out[i] is None:
                    out[i], lse[i] = block_out, block_lse
                else:
                    out[i], lse[i] = merge_attention_blocks(out[i], lse[i], block_out, block_lse)
                kinds.append(kind)
                # what was computed: my query chunk, and the first key row of the block that really arrived (the
                # caller finds which chunk of the sequence it is): not the chunk the ring meant to send
                computed.append([my_chunks[i], keys[j][0, 0, 0].clone()])   # read after the loop: no sync here
            log.append({"step": step, "owner": owner, "blocks": kinds, "computed": computed, "kv_bytes_held": held})
            del keys, values                  # done with this block: no view of it may outlive the step
            if step < world - 1:
                for request in requests:
                    request.wait()
                del requests                  # a finished request still points at the block it sent
                if planted_bug != "keep-own-block":
                    travelling = arriving
                del arriving
        for entry in log:                     # the first key rows, as numbers, once the ring is done
            entry["computed"] = [[query_chunk, row.tolist()] for query_chunk, row in entry["computed"]]
        out, lse = torch.cat(out, dim=-2), torch.cat(lse, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.log = layout, log
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world = dist.get_rank(), dist.get_world_size()
        my_chunks = ring_chunks(rank, world, ctx.layout)
        chunk, scale = q.shape[-2] // 2, 1.0 / math.sqrt(q.shape[-1])
        grad_out = grad_out.contiguous()
        # softmax backward needs, per query, sum_j P_ij dP_ij = sum_d dO_id O_id: the final output's.
        delta = (grad_out * out).sum(-1, keepdim=True)
        grad_q = torch.zeros_like(q)
        ledger = memory.StorageLedger()
        ledger.watch(k, v)
        travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # K, V and their gradients
        ledger.watch(travelling)
        for step in range(world):
            owner = (rank - step) % world
            keys, values, grad_keys, grad_values = (t.split(chunk, dim=-2) for t in travelling)
            for i, j, kind in block_pairs(my_chunks, owner, world, ctx.layout):
                rows = slice(i * chunk, (i + 1) * chunk)
                scores = (q[..., rows, :] @ keys[j].transpose(-1, -2)) * scale
                if kind == "diagonal":
                    mask = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
                    scores = scores.masked_fill(~mask, float("-inf"))
                probs = torch.exp(scores - lse[..., rows].unsqueeze(-1))  # recomputed, never stored
                grad_values[j].add_(probs.transpose(-1, -2) @ grad_out[..., rows, :])
                grad_scores = probs * (grad_out[..., rows, :] @ values[j].transpose(-1, -2) - delta[..., rows, :])
                grad_q[..., rows, :] += grad_scores @ keys[j] * scale
                grad_keys[j].add_(grad_scores.transpose(-1, -2) @ q[..., rows, :] * scale)
            del keys, values, grad_keys, grad_values   # views of the block about to leave: none outlives the step
            # Pass the block on with the gradients added so far; after the last step only dK, dV travel,
            # one hop further: home to their owner.
            arriving, requests = ring_pass(travelling if step < world - 1 else travelling[2:].contiguous(), rank, world)
            ledger.watch(arriving)
            ctx.log[step]["kv_bytes_held_backward"] = ledger.measure(f"backward step {step}: buffer allocated")
            for request in requests:
                request.wait()
            del requests
            travelling = arriving
            del arriving
        return grad_q, travelling[0], travelling[1], None, None, None


def check_config(args, world_size):
    runtime.require(world_size >= 2, "context parallelism needs at least 2 ranks: launch with "
                                     "torchrun --standalone --nproc_per_node=4")
    chunks = 2 * world_size
    runtime.require(args.seq_len % chunks == 0,
                    f"sequence length {args.seq_len} does not split into {chunks} chunks (2 per rank, "
                    f"{world_size} ranks)")
    if "ulysses" in args.methods:
        runtime.require(args.heads % world_size == 0,
                        f"Ulysses gives each rank whole heads: --heads {args.heads} does not split over {world_size} "
                        f"ranks (or leave ulysses out of --methods)")
    if args.native:
        cuda = torch.cuda.is_available() and args.device != "cpu"
        runtime.require(cuda, "--native runs PyTorch's context_parallel, whose ring covers only the CUDA "
                              "attention kernels: run it on GPUs, or drop --native on a CPU")


def expected_blocks_per_rank(world_size: int, layout: str) -> list[int]:
    """Chunk blocks a rank computes under a causal mask, counted by hand: query chunk c attends to chunks
    0..c, c + 1 blocks. Zig-zag (chunks r and 2P-1-r): (r + 1) + (2P - r) = 2P + 1 on every rank;
    contiguous (chunks 2r and 2r+1): (2r + 1) + (2r + 2) = 4r + 3."""
    return [2 * world_size + 1 if layout == "zigzag" else 4 * r + 3 for r in range(world_size)]


def run_native(args, rt, q, k, v, grad_out, reference, report):
    """PyTorch's own context parallelism: SDPA patched to run its ring attention, buffers sharded head-and-tail
    (zig-zag), once with each rotate method: "allgather" (torch 2.13's default) and "alltoall" (a ring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard, set_rotate_method

    mesh = init_device_mesh("cuda", (rt.world_size,), mesh_dim_names=("cp",))
    for rotate_method in context_parallel.ROTATE_METHODS:
        set_rotate_method(rotate_method)
        q_, k_, v_, grad_ = (t.detach().clone() for t in (q, k, v, grad_out))
        with torch_context_parallel(mesh, buffers=[q_, k_, v_, grad_], buffer_seq_dims=[2, 2, 2, 2],
                              no_restore_buffers={q_, k_, v_, grad_}):
            for t in (q_, k_, v_):
                t.requires_grad_()  # now this rank's shard: a leaf of its own
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
            out.backward(grad_)
        gathered = context_parallel_unshard(mesh, [out.detach(), q_.grad, k_.grad, v_.grad], [2, 2, 2, 2])
        for name, got, want in zip(("output", "dQ", "dK", "dV"), gathered, reference):
            diff = metrics.max_abs_diff(got, want) / want.abs().max().item()
            # 1e-4: the CUDA kernels (memory-efficient attention) sum in their own order and precision.
            report.check(f"native context_parallel ({rotate_method}): {name} equals full attention (relative)",
                         diff <= 1e-4, diff, 1e-4)
    set_rotate_method("allgather")  # back to torch 2.13's default (_context_parallel/_attention.py:77)


def run_other_methods(args, rt, q, k, v, grad_out, reference, ring_result, report):
    """All-gather CP, Ulysses and torch's own, on the same q, k, v: each against full attention, torch's against
    this script's ring (zig-zag), and the payloads each hands to its collectives against the formula."""
    rank, world = rt.rank, rt.world_size
    chunk = args.seq_len // (2 * world)
    zigzag = chunk_positions(ring_chunks(rank, world, "zigzag"), chunk).to(rt.device)
    every_rank = torch.cat([chunk_positions(ring_chunks(r, world, "zigzag"), chunk) for r in range(world)]).to(rt.device)
    contiguous = torch.arange(rank * 2 * chunk, (rank + 1) * 2 * chunk, device=rt.device)  # Ulysses: no zig-zag

    def autograd_run(positions, attend):
        mine = [t[..., positions, :].clone().requires_grad_() for t in (q, k, v)]
        with comm.CommCounter() as forward_comm:
            out = attend(*mine)
        with comm.CommCounter() as backward_comm:
            out.backward(grad_out[..., positions, :])
        return [out.detach()] + [t.grad for t in mine], {"forward": forward_comm, "backward": backward_comm}

    runs = {}
    if "all-gather" in args.methods:
        runs["all-gather"] = zigzag, *autograd_run(
            zigzag, lambda q_, k_, v_: context_parallel.all_gather_attention(q_, k_, v_, zigzag, every_rank))
    if "ulysses" in args.methods:
        runs["ulysses"] = contiguous, *autograd_run(contiguous, context_parallel.ulysses_attention)
    if "torch" in args.methods and rt.device.type == "cpu":  # on GPUs: --native runs context_parallel itself
        for rotate_method in context_parallel.ROTATE_METHODS:
            counters = {"forward": comm.CommCounter(), "backward": comm.CommCounter()}
            mine = [t[..., zigzag, :].contiguous() for t in (q, k, v, grad_out)]
            result = context_parallel.torch_ring_attention(*mine, rotate_method, phase_counters=counters)
            runs[f"torch {rotate_method}"] = zigzag, list(result), counters
    elif "torch" in args.methods:
        rt.print("torch's own: on GPUs --native runs context_parallel itself (this route uses torch's CPU kernel)")

    shard_bytes = q[..., zigzag, :].numel() * q.element_size()  # K (or V) of one rank; Q the same size here
    report.extra["methods"] = {}
    for method, (positions, results, counters) in runs.items():
        tolerance = metrics.fp32_tolerance(TOLERANCE, rt.device)
        for name, got, want in zip(("output", "dQ", "dK", "dV"), results, reference):
            diff = metrics.max_abs_diff(got, want[..., positions, :]) / want.abs().max().item()
            report.check(f"{method}: {name} of my positions equals full attention (relative)", diff <= tolerance,
                         diff, tolerance)
        if method.startswith("torch"):  # torch's own against the ring and the all-gather by hand (same positions)
            by_hand = {"ring": ring_result, "all-gather": runs.get("all-gather", (None, None))[1]}
            for other, theirs in ((name, found) for name, found in by_hand.items() if found is not None):
                diff = max(metrics.max_abs_diff(got, want) / want.abs().max().item()
                           for got, want in zip(results, theirs))
                report.check(f"{method}: output, dQ, dK, dV equal this script's {other} (zig-zag, relative)",
                             diff <= tolerance, diff, tolerance)
        formula = context_parallel.cp_comm_payloads(method, shard_bytes, world, dtype_bytes=q.element_size())
        measured = {phase: {name: entry["payload_bytes"] for name, entry in counter.by_collective().items()}
                    for phase, counter in counters.items()}
        for phase in ("forward", "backward"):
            report.check_equal(f"{method}: payload bytes per collective in {phase} = formula", measured[phase],
                               formula[phase])
        report.extra["methods"][method] = {
            "payload_bytes": measured, "formula": formula,
            "sent_bytes_per_rank_derived": context_parallel.cp_bytes_sent_per_rank(method, shard_bytes, world,
                                                                                   dtype_bytes=q.element_size()),
            "calls": {phase: counter.count() for phase, counter in counters.items()}}
        rt.print(f"{method:16s}: payloads {measured}")


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=None)
    p.add_argument("--layout", choices=["both", "zigzag", "contiguous"], default="both",
                   help="how the sequence is split over ranks (both: run and compare the two)")
    p.add_argument("--batch", type=runtime.positive_int, default=None, help="sequences (default: the preset's)")
    p.add_argument("--heads", type=runtime.positive_int, default=None, help="attention heads (default: the preset's)")
    p.add_argument("--seq-len", type=runtime.positive_int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--head-dim", type=runtime.positive_int, default=None, help="dimension of each head (default: the preset's)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="what to run: this script's ring, all-gather CP, Ulysses, torch's own with both rotate "
                        "methods (on a CPU; on GPUs --native runs context_parallel itself); default: all")
    p.add_argument("--native", action="store_true",
                   help="also run PyTorch's context_parallel (CUDA only; a config error on a CPU)")
    p.add_argument("--planted-bug", choices=PLANTED_BUGS, default=None, help="a mistake the checks must catch")
    args = p.parse_args()
    for key, value in SHAPES[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        rank, world = rt.rank, rt.world_size
        report = metrics.Report(__file__, rt, config=vars(args))
        chunk = args.seq_len // (2 * world)
        shape = (args.batch, args.heads, args.seq_len, args.head_dim)
        generator = torch.Generator().manual_seed(args.seed)  # the same full q, k, v everywhere
        q, k, v, grad_out = (torch.randn(shape, generator=generator).to(rt.device) for _ in range(4))

        # The answer: full causal attention on one device.
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        reference_out = F.scaled_dot_product_attention(*full, is_causal=True)
        reference_out.backward(grad_out)
        reference = [reference_out.detach()] + [t.grad for t in full]

        layouts = ["zigzag", "contiguous"] if args.layout == "both" else [args.layout]
        if "ring" not in args.methods:
            layouts = []
        report.extra["ring"] = {}
        ring_result = None  # the zig-zag ring's output and gradients, torch's own is checked against them
        for layout in layouts:
            positions = chunk_positions(ring_chunks(rank, world, layout), chunk).to(rt.device)
            mine = [t[..., positions, :].clone().requires_grad_() for t in (q, k, v)]
            log = []
            with comm.CommCounter() as forward_comm:
                out = RingAttention.apply(*mine, layout, log, args.planted_bug)
            with comm.CommCounter() as backward_comm:
                out.backward(grad_out[..., positions, :])

            if layout == "zigzag":
                ring_result = [out.detach()] + [t.grad for t in mine]
            for name, got, want in zip(("output", "dQ", "dK", "dV"), [out] + [t.grad for t in mine], reference):
                diff = metrics.max_abs_diff(got, want[..., positions, :]) / want.abs().max().item()
                report.check(f"{layout}: {name} of my positions equals full attention (relative)",
                             diff <= metrics.fp32_tolerance(TOLERANCE, rt.device), diff,
                             metrics.fp32_tolerance(TOLERANCE, rt.device))

            # Work per rank: attention blocks computed, gathered from every rank.
            logs = [None] * world
            dist.all_gather_object(logs, log)
            blocks = [sum(len(entry["blocks"]) for entry in rank_log) for rank_log in logs]
            # which chunk of the sequence each block that was computed with really was: its first key row, found
            # among the whole sequence's chunks (-1: a block that is no chunk of K at all)
            first_rows = {c: k[0, 0, c * chunk].tolist() for c in range(2 * world)}
            for rank_log in logs:
                for entry in rank_log:
                    entry["computed"] = [[q_chunk, next((c for c, row in first_rows.items() if row == key_row), -1)]
                                         for q_chunk, key_row in entry["computed"]]
            computed = sorted((q_chunk, k_chunk) for rank_log in logs for entry in rank_log
                              for q_chunk, k_chunk in entry["computed"])
            causal_triangle = [(q_chunk, k_chunk) for q_chunk in range(2 * world) for k_chunk in range(q_chunk + 1)]
            report.check(f"{layout}: the blocks computed cover the causal triangle, each block once",
                         computed == causal_triangle, f"{len(computed)} blocks", f"{len(causal_triangle)} blocks")
            report.check_equal(f"{layout}: attention blocks per rank (counted as computed) = "
                               + ("2P + 1 on every rank" if layout == "zigzag" else "4r + 3 on rank r"),
                               blocks, expected_blocks_per_rank(world, layout))
            # Memory: the K and V blocks alive at each step, read off their storages (one block = one rank's K and V)
            block_bytes = 2 * mine[1].numel() * mine[1].element_size()
            held = [[entry["kv_bytes_held"] / block_bytes for entry in rank_log] for rank_log in logs]
            held_backward = [[entry["kv_bytes_held_backward"] / block_bytes for entry in rank_log] for rank_log in logs]
            report.check(f"{layout}: forward holds at most three blocks of K and V at once: its own, the one it "
                         f"computes with, the one arriving (measured on the storages, every rank, every step)",
                         max(map(max, held)) <= 3, max(map(max, held)), "<= 3")
            report.memory[layout] = {"kv_blocks_held_forward": held, "kv_blocks_held_backward": held_backward}
            report.extra["ring"][layout] = {"blocks_per_rank": blocks, "steps": logs,
                                            "chunks": [ring_chunks(r, world, layout) for r in range(world)]}
            rt.print(f"{layout:10s}: chunks per rank {[ring_chunks(r, world, layout) for r in range(world)]}, "
                     f"attention blocks per rank {blocks} (busiest / average "
                     f"{max(blocks) / (sum(blocks) / world):.2f}); K, V blocks held at most: forward "
                     f"{max(map(max, held)):g}, backward {max(map(max, held_backward)):g} (measured)")

            # Communication: every rank sends the same, whatever the layout.
            shard_bytes = mine[1].numel() * mine[1].element_size()
            formula = ring_comm_formula(shard_bytes, world)
            for phase, counter in (("forward", forward_comm), ("backward", backward_comm)):
                report.add_comm("send", counter.total("send"), formula[phase], phase=phase, layout=layout,
                                calls=counter.count("send"))
                report.check_equal(f"{layout}: bytes sent per rank in {phase} = formula", counter.total("send"),
                                   formula[phase])

        if "zigzag" in layouts and "contiguous" in layouts:
            zigzag, contiguous = (report.extra["ring"][name]["blocks_per_rank"] for name in ("zigzag", "contiguous"))
            report.check("zig-zag balances the causal work (every rank the same), contiguous does not",
                         len(set(zigzag)) == 1 and len(set(contiguous)) > 1, {"zigzag": zigzag,
                                                                               "contiguous": contiguous})
        run_other_methods(args, rt, q, k, v, grad_out, reference, ring_result, report)
        if args.native:
            run_native(args, rt, q, k, v, grad_out, reference, report)
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
