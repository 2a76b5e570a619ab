"""Every collective on N ranks, each result checked against its definition, each byte count against the formula.

Rank r contributes ``contribution(r)``: a few numbers that any rank can recompute, so every rank checks
what it received against what the definition says it must receive, computed independently from what
all ranks put in (not from the collective itself):

=================  ==========================================================  ====================
collective         every rank ends with                                        payload S (bytes)
=================  ==========================================================  ====================
broadcast          rank 0's tensor                                             the tensor
all-reduce (sum)   the sum of all ranks' tensors                               the tensor
all-gather         all ranks' tensors, concatenated in rank order              the gathered output
reduce-scatter     chunk r of the sum                                          the input
all-to-all         chunk r of every rank's tensor, in rank order               the input
send/recv (ring)   the tensor of the rank to its left (rank - 1)               the tensor
=================  ==========================================================  ====================

The bytes each call carried are recorded by ``distlab.comm.CommCounter`` and compared with the payload
the table predicts from the tensor size and the number of ranks.

    torchrun --standalone --nproc_per_node=4 scripts/03_communication/collectives.py
"""

import sys

import torch
import torch.distributed as dist

from distlab import comm, metrics, runtime

FLOAT_BYTES = 4


def check_config(args, world_size):
    runtime.require(world_size >= 2, "collectives need at least 2 ranks: torchrun --standalone --nproc_per_node=4 ...")
    runtime.require(args.numel >= 1 and args.numel % world_size == 0,
                    f"--numel {args.numel} must be a positive multiple of the {world_size} ranks "
                    "(reduce-scatter and all-to-all cut it into one chunk per rank)")


def contribution(rank: int, numel: int, seed: int) -> torch.Tensor:
    """What rank ``rank`` puts in: small integers as floats, so sums are exact in any order."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(-9, 10, (numel,), generator=generator).float()


def expected_results(rank: int, world: int, numel: int, seed: int) -> dict:
    """Each collective's result on ``rank``, straight from the definitions."""
    every = [contribution(r, numel, seed) for r in range(world)]
    chunk = numel // world
    mine = slice(rank * chunk, (rank + 1) * chunk)
    return {
        "broadcast": every[0],
        "all_reduce": torch.stack(every).sum(0),
        "all_gather": torch.cat(every),
        "reduce_scatter": torch.stack(every).sum(0)[mine],
        "all_to_all": torch.cat([t[mine] for t in every]),
        "send_recv": every[(rank - 1) % world],
    }


def run_collectives(rank: int, world: int, numel: int, seed: int, device) -> dict:
    """Each collective once, on this rank's contribution. Returns what came out."""
    x = contribution(rank, numel, seed).to(device)
    out = {}

    t = x.clone()
    dist.broadcast(t, src=0)
    out["broadcast"] = t

    t = x.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    out["all_reduce"] = t

    t = torch.empty(world * numel, device=device)
    dist.all_gather_single(t, x)
    out["all_gather"] = t

    t = torch.empty(numel // world, device=device)
    dist.reduce_scatter_single(t, x, op=dist.ReduceOp.SUM)
    out["reduce_scatter"] = t

    t = torch.empty(numel, device=device)
    dist.all_to_all_single(t, x)
    out["all_to_all"] = t

    # Point to point around a ring: everyone sends right and receives from the left at the same time, as
    # one batch. Blocking sends first would wait for receivers that never come; on NCCL even isend then irecv
    # between the same two ranks (a ring of 2) can hang unless the two are posted together like this.
    t = torch.empty(numel, device=device)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world),
                                       dist.P2POp(dist.irecv, t, (rank - 1) % world)])
    for request in requests:
        request.wait()
    out["send_recv"] = t
    return out


def analytic_payload(collective: str, numel: int, world: int) -> int:
    """Payload S in bytes, as the table of the docstring defines it, from the sizes alone."""
    per_rank = numel * FLOAT_BYTES
    return world * per_rank if collective == "all_gather" else per_rank


def main():
    p = runtime.parser(__doc__, steps=None)
    p.add_argument("--numel", type=runtime.positive_int, default=8, help="numbers each rank contributes (a multiple of the ranks)")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        report = metrics.Report(__file__, rt, config=vars(args))
        world = rt.world_size
        with comm.CommCounter() as counter:
            results = run_collectives(rt.rank, world, args.numel, args.seed, rt.device)
        expected = expected_results(rt.rank, world, args.numel, args.seed)

        # Each rank's worst difference, then the worst over ranks (outside the counter: not part of the lesson).
        diffs = torch.tensor([metrics.max_abs_diff(results[name].cpu(), expected[name]) for name in expected],
                             device=rt.device)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)

        if args.numel <= 16:  # small enough to read: what went in and what came out, on every rank
            shown = [None] * world
            dist.all_gather_object(shown, {k: v.cpu().int().tolist() for k, v in results.items()})
            rt.print("what each rank put in:")
            for r in range(world):
                rt.print(f"  rank {r}: {contribution(r, args.numel, args.seed).int().tolist()}")
            for name in expected:
                rt.print(f"{name}:")
                for r in range(world):
                    rt.print(f"  rank {r}: {shown[r][name]}")

        calls = {c.collective: c for c in counter.calls}
        rt.print(f"{'collective':>14} {'payload S':>10} {'formula':>10} {'sent/rank (ring model, derived)':>32}")
        for (name, diff) in zip(expected, diffs.tolist()):
            counted = "send" if name == "send_recv" else name
            call = calls[counted]
            analytic = analytic_payload(name, args.numel, world)
            sent = comm.bytes_sent_per_rank(counted, call.payload_bytes, world)  # ring model x measured payload
            rt.print(f"{name:>14} {call.payload_bytes:>10} {analytic:>10} {sent:>32.0f}")
            report.check(f"{name}: every rank holds what the definition says", diff == 0.0, diff, 0.0)
            report.check_equal(f"{name}: bytes counted = payload formula", call.payload_bytes, analytic)
            report.add_comm(name, call.payload_bytes, analytic, sent_bytes_per_rank_derived=sent, group_size=world)
        report.check_equal("one call counted per collective", counter.count(), len(expected))
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
