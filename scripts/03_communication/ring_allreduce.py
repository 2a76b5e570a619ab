"""Ring all-reduce written with send/recv, checked against ``dist.all_reduce`` and the byte formula.

The tensor of every rank is cut into n chunks. Ranks form a ring and talk only to their neighbours:
each step, every rank sends one chunk to the right and receives one from the left, all at once.

1. **reduce-scatter**, n - 1 steps: at step s rank r sends chunk (r - s) mod n and adds the chunk
   (r - s - 1) mod n it receives into its own. Afterwards rank r holds the full sum of chunk (r + 1) mod n.
2. **all-gather**, n - 1 steps: at step s rank r sends chunk (r + 1 - s) mod n, a finished one, and stores
   the chunk (r - s) mod n it receives. Afterwards every rank holds every summed chunk.

Each rank sends 2 (n - 1) chunks of S / n bytes: 2 (n - 1) / n x S, whatever the number of ranks; this is
why the ring is bandwidth-optimal. The notebook of chapter 03 simulates the same steps in one process.

    torchrun --standalone --nproc_per_node=4 scripts/03_communication/ring_allreduce.py
"""

import sys
import time

import torch
import torch.distributed as dist

from distlab import comm, metrics, runtime


def check_config(args, world_size):
    runtime.require(world_size >= 2, "a ring needs at least 2 ranks: torchrun --standalone --nproc_per_node=4 ...")
    runtime.require(args.numel >= world_size,
                    f"--numel {args.numel} is fewer elements than the {world_size} ranks: every rank needs a chunk")


def exchange(send: torch.Tensor, receive: torch.Tensor, right: int, left: int) -> None:
    """Send to the right neighbour while receiving from the left one, as one batch: NCCL posts the two
    together, so nobody waits forever even on a ring of 2, where right and left are the same rank (an
    isend then an irecv to one peer share one NCCL stream, and two ranks both sending first would hang)."""
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, receive, left)])
    for request in requests:
        request.wait()


def ring_all_reduce(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Sum ``tensor`` over all ranks, in place, using only send/recv between ring neighbours."""
    chunks = list(tensor.tensor_split(world))  # views: updating a chunk updates the tensor
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(world - 1):  # reduce-scatter
        send, receive = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[receive])
        exchange(chunks[send], incoming, right, left)
        chunks[receive] += incoming
    for step in range(world - 1):  # all-gather
        send, receive = (rank + 1 - step) % world, (rank - step) % world
        incoming = torch.empty_like(chunks[receive])
        exchange(chunks[send], incoming, right, left)
        chunks[receive].copy_(incoming)
    return tensor


def contribution(rank: int, numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1000 + rank))


def main():
    p = runtime.parser(__doc__, steps=None)
    p.add_argument("--numel", type=runtime.positive_int, default=4096, help="elements of each rank's tensor (need not divide by n)")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        report = metrics.Report(__file__, rt, config=vars(args))
        world, rank = rt.world_size, rt.rank
        mine = contribution(rank, args.numel, args.seed).to(rt.device)
        payload = mine.numel() * mine.element_size()

        with comm.CommCounter() as counter:
            rt.sync()
            started = time.perf_counter()
            ours = ring_all_reduce(mine.clone(), rank, world)
            rt.sync()
            ring_seconds = time.perf_counter() - started
        theirs = mine.clone()
        rt.sync()
        started = time.perf_counter()
        dist.all_reduce(theirs)
        rt.sync()
        library_seconds = time.perf_counter() - started

        definition = torch.stack([contribution(r, args.numel, args.seed).double() for r in range(world)]).sum(0)
        sent = counter.total("send")
        stats = torch.tensor([metrics.max_abs_diff(ours, theirs), metrics.max_abs_diff(ours, definition),
                              float(sent), float(counter.count("send"))], dtype=torch.float64)
        every = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(every, stats)
        every = torch.stack(every)

        rt.print(f"{world} ranks, {args.numel} floats each ({payload:,} B); chunks of "
                 f"{[c.numel() for c in mine.tensor_split(world)]} elements")
        rt.print(f"ring all-reduce {ring_seconds * 1e3:.2f} ms, dist.all_reduce {library_seconds * 1e3:.2f} ms "
                 f"(rank 0)")
        for r in range(world):
            rt.print(f"  rank {r}: sent {int(every[r, 3])} messages, {int(every[r, 2]):,} B")
        # Sums in another order differ in the last bits: equal to float32 precision, not bit for bit.
        report.check_close("ring all-reduce = dist.all_reduce on every rank", every[:, 0].max().item(), 0.0, 1e-5)
        report.check_close("ring all-reduce = sum of every rank's tensor (the definition)",
                           every[:, 1].max().item(), 0.0, 1e-5)
        report.check_equal("every rank sent 2(n-1) messages", every[:, 3].int().tolist(), [2 * (world - 1)] * world)
        report.check_equal("bytes sent by all ranks together = 2(n-1) x S", int(every[:, 2].sum()),
                           2 * (world - 1) * payload)
        analytic = comm.bytes_sent_per_rank("all_reduce", payload, world)
        if args.numel % world == 0:  # equal chunks: every rank sends exactly its share
            report.check_equal("bytes sent per rank = 2(n-1)/n x S (comm.bytes_sent_per_rank)", sent, int(analytic))
        report.add_comm("all_reduce (ring of send/recv)", sent, int(analytic), messages=2 * (world - 1))
        report.throughput = {"ring_seconds": ring_seconds, "library_seconds": library_seconds}
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
