"""Process groups beyond the world: ``dist.new_group`` and a collective on each subgroup.

``init_process_group`` joins every rank into one group, the *world*. Parallel strategies need smaller ones:
the ranks of one tensor-parallel team, the ranks that hold the same shard in data parallelism. Lay the N
ranks out as a grid of ``N / K`` rows of K ranks (``arange(N).view(N // K, K)``, as picotron and chapter 09 do):

* a **row** group is K neighbouring ranks, [0, 1], [2, 3] for N = 4, K = 2 (a tensor-parallel team inside a node);
* a **column** group is the ranks K apart, [0, 2], [1, 3] (the data-parallel replicas of one shard).

Two rules make groups work. Every rank calls ``new_group`` for **every** group, in the same order, including the
groups it is not a member of (creating a group is itself a collective over the world). And a collective on a group
is called by that group's members only; the other ranks are not involved.

Each rank contributes small integers that any rank can recompute (``collectives.contribution``), all-reduces them
over its row group and then over its column group, and checks that each result equals the sum of the contributions
of that group's members, computed from the grid independently of torch's groups, and differs from the sum over the
world. ``distlab.comm.CommCounter`` records the size of the group each call ran on. A broadcast from each row's
first rank shows that ``src`` is a *global* rank while ``dist.get_group_rank`` numbers the ranks inside a group.

    torchrun --standalone --nproc_per_node=4 scripts/03_communication/process_groups.py
    torchrun --standalone --nproc_per_node=4 scripts/03_communication/process_groups.py --group-size 4
"""

import sys

import torch
import torch.distributed as dist

from collectives import contribution  # what every rank puts in: the same definition as collectives.py
from distlab import comm, metrics, runtime


def check_config(args, world_size):
    runtime.require(world_size >= 2,
                    "process groups need at least 2 ranks: torchrun --standalone --nproc_per_node=4 ...")
    runtime.require(args.group_size >= 1 and world_size % args.group_size == 0,
                    f"--group-size {args.group_size} does not divide the {world_size} ranks into equal groups")
    runtime.require(args.numel >= 1, f"--numel {args.numel} must be at least 1")


def rank_grid(world_size: int, group_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The row groups (K neighbouring ranks) and the column groups (ranks K apart), from arithmetic alone."""
    rows = [[row * group_size + i for i in range(group_size)] for row in range(world_size // group_size)]
    columns = [[row[i] for row in rows] for i in range(group_size)]
    return rows, columns


def main():
    p = runtime.parser(__doc__, steps=None)
    p.add_argument("--group-size", type=runtime.positive_int, default=2, help="K, ranks per row group (must divide the world size)")
    p.add_argument("--numel", type=runtime.positive_int, default=8, help="numbers each rank contributes")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        report = metrics.Report(__file__, rt, config=vars(args))
        rows, columns = rank_grid(rt.world_size, args.group_size)
        # Every rank creates every group, in the same order, member or not.
        row_groups = [dist.new_group(ranks) for ranks in rows]
        column_groups = [dist.new_group(ranks) for ranks in columns]
        my_row = next(i for i, ranks in enumerate(rows) if rt.rank in ranks)
        my_column = next(i for i, ranks in enumerate(columns) if rt.rank in ranks)
        rt.print(f"{rt.world_size} ranks as {len(rows)} x {args.group_size}: "
                 f"row groups {rows}, column groups {columns}")

        mine = contribution(rt.rank, args.numel, args.seed).to(rt.device)
        everyone = [contribution(r, args.numel, args.seed) for r in range(rt.world_size)]
        world_sum = torch.stack(everyone).sum(0)
        with comm.CommCounter() as counter:
            over_row = mine.clone()
            dist.all_reduce(over_row, group=row_groups[my_row])
            over_column = mine.clone()
            dist.all_reduce(over_column, group=column_groups[my_column])
            leader = mine.clone()
            dist.broadcast(leader, src=rows[my_row][0], group=row_groups[my_row])  # src: a global rank

        for kind, result, members in (("row", over_row, rows[my_row]), ("column", over_column, columns[my_column])):
            expected = torch.stack([everyone[r] for r in members]).sum(0)  # the definition, not the collective
            error = torch.tensor(metrics.max_abs_diff(result.cpu(), expected), device=rt.device)
            dist.all_reduce(error, op=dist.ReduceOp.MAX)  # the worst rank decides
            report.check(f"every {kind} group's all-reduce equals the sum of its members' contributions",
                         error.item() == 0.0, error.item(), 0.0)
            differs = torch.tensor(float(len(members) == rt.world_size or not torch.equal(result.cpu(), world_sum)),
                                   device=rt.device)
            dist.all_reduce(differs, op=dist.ReduceOp.MIN)
            report.check(f"{kind} groups: the sum is the group's, not the world's", differs.item() == 1.0)
        leader_error = metrics.max_abs_diff(leader.cpu(), everyone[rows[my_row][0]])
        report.check("broadcast from each row's first rank (src is a global rank)", leader_error == 0.0,
                     leader_error, 0.0)
        group_ranks = [dist.get_group_rank(row_groups[my_row], rt.rank),
                       dist.get_group_rank(column_groups[my_column], rt.rank)]
        report.check_equal("group ranks number the members from 0 (rank's place in its row and its column)",
                           group_ranks, [rows[my_row].index(rt.rank), columns[my_column].index(rt.rank)])

        sizes = [call.group_size for call in counter.calls]
        report.check_equal("the counter saw each collective on its group's size, not the world's", sizes,
                           [len(rows[my_row]), len(columns[my_column]), len(rows[my_row])])
        payload = args.numel * mine.element_size()
        for call in counter.calls[:2]:
            report.add_comm("all_reduce", call.payload_bytes, payload, group_size=call.group_size,
                            sent_bytes_per_rank_derived=comm.bytes_sent_per_rank("all_reduce", payload,
                                                                                 call.group_size))
        report.extra.update(rows=rows, columns=columns)
        shown = [None] * rt.world_size  # what each rank ended with, printed by rank 0 (outside the counter)
        dist.all_gather_object(shown, (over_row.int().tolist(), over_column.int().tolist()))
        for r in range(rt.world_size):
            rt.print(f"  rank {r}: put in {everyone[r].int().tolist()}, "
                     f"row sum {shown[r][0]}, column sum {shown[r][1]}")
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
