"""The process groups of a (pp, dp, tp) rank grid, built by hand, in two rank orders, against DeviceMesh.

A hybrid job gives every rank three coordinates and puts it in three process groups: its TP group
(all-reduces activations in every layer), its DP group (averages gradients once per step) and its PP group
(passes activations between stages). Which ranks share a group depends on the *rank order*:

* ``hybrid_context``: the order of a widely copied ``HybridParallelContext``, pp outermost, then tp, dp
  innermost: ``rank = pp_rank * tp * dp + tp_rank * dp + dp_rank``;
* ``device_mesh``: what ``init_device_mesh(dev, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))`` builds,
  tp innermost: ``rank = pp_rank * dp * tp + dp_rank * tp + tp_rank``.

The script builds every group of both orders with ``dist.new_group`` (the arithmetic is
``distlab.hybrid``), and proves that

* the hand-built groups of the DeviceMesh order are exactly the groups DeviceMesh builds
  (``mesh.get_group("tp")``, ``mesh["dp"]``, ...) and its coordinates this rank's;
* every group works: an all-reduce of rank ids over each group equals the sum of its members;

and prints which TP groups cross a node boundary (nodes of ``--gpus-per-node``) in each order. Launchers
fill nodes with consecutive ranks, so DeviceMesh's order keeps a TP group on one node, while the copied
order spreads it over ``dp`` ranks apart: across nodes as soon as dp > 1 and tp x dp > GPUs per node.

``--world N`` checks the arithmetic for N ranks in one process, on a fake process group (no launch).

    torchrun --standalone --nproc_per_node=4 scripts/09_hybrid_parallel/rank_grid.py --gpus-per-node 2
    python scripts/09_hybrid_parallel/rank_grid.py --world 16 --pp 2 --dp 2 --tp 4
    python scripts/09_hybrid_parallel/rank_grid.py --world 512 --pp 4 --dp 32 --tp 4
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from distlab import comm, hybrid, metrics, runtime, tensor_parallel

DIMENSIONS = hybrid.DIMENSIONS  # ("pp", "dp", "tp"): the order a shape is given in, whatever the rank order


def resolve_shape(args, world_size):
    """The mesh (pp, dp, tp): --pp (1) and --tp (2 on an even world, else 1) as given, dp fills the rest."""
    pp = args.pp
    tp = args.tp if args.tp is not None else (2 if world_size % 2 == 0 else 1)
    dp = args.dp if args.dp is not None else max(1, world_size // max(1, pp * tp))
    return pp, dp, tp


def check_config(args, world_size):
    runtime.require(args.gpus_per_node >= 1, f"--gpus-per-node must be at least 1, not {args.gpus_per_node}")
    if args.world is not None:
        runtime.require(world_size == 1, f"--world {args.world} builds a fake world in one process: run it with "
                                         f"python, not with {world_size} ranks")
        world_size = args.world
        runtime.require(world_size >= 1, f"--world must be at least 1, not {world_size}")
    problems = hybrid.mesh_shape_problems(world_size, *resolve_shape(args, world_size))
    runtime.require(not problems, "; ".join(problems))


def print_grid(shape, gpus_per_node, say):
    """Every rank's coordinates in both orders, node by node, and the groups of each dimension."""
    tables = {order: hybrid.grid_table(shape, order, gpus_per_node) for order in hybrid.RANK_ORDERS}
    say(f"\nrank -> (pp, dp, tp) in each order; nodes of {gpus_per_node} ranks")
    say(f"  {'rank':>4s} {'node':>4s}   {'device_mesh':>12s}   {'hybrid_context':>14s}")
    for mesh_row, context_row in zip(tables["device_mesh"], tables["hybrid_context"]):
        coordinates = [f"({row['pp']}, {row['dp']}, {row['tp']})" for row in (mesh_row, context_row)]
        say(f"  {mesh_row['rank']:4d} {mesh_row['node']:4d}   {coordinates[0]:>12s}   {coordinates[1]:>14s}")
    for order in hybrid.RANK_ORDERS:
        say(f"\ngroups in {order} order ({' > '.join(hybrid.RANK_ORDERS[order])}, outermost first):")
        for dim, groups in hybrid.grid_groups(shape, order).items():
            say(f"  {dim}: {groups}")


def explain_crossings(shape, gpus_per_node, say) -> dict:
    """Which groups leave a node in each order; a paragraph on why TP across nodes hurts."""
    crossing = hybrid.crossing_groups_by_order(shape, gpus_per_node)
    say(f"\ngroups that cross a node boundary (nodes of {gpus_per_node} ranks):")
    for order, by_dim in crossing.items():
        total = {dim: len(hybrid.grid_groups(shape, order)[dim]) for dim in DIMENSIONS}
        say(f"  {order:15s} " + "   ".join(f"{dim}: {len(by_dim[dim])} of {total[dim]}" for dim in DIMENSIONS))
    if crossing["hybrid_context"]["tp"] and not crossing["device_mesh"]["tp"]:
        # vendor figures (distlab.tensor_parallel): NVLink 3 per direction vs one Slingshot-11 NIC
        nvlink = tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S
        slingshot = tensor_parallel.SLINGSHOT11_NIC_BYTES_PER_S
        say(f"\nThe copied HybridParallelContext order puts TP across nodes: its TP group "
            f"{crossing['hybrid_context']['tp'][0]} spans nodes because dp = {shape[1]} > 1 and tp x dp = "
            f"{shape[2] * shape[1]} > {gpus_per_node} GPUs per node. TP all-reduces the activations 4 times per "
            f"layer and step; across nodes they run over Slingshot (~{slingshot / 1e9:.0f} GB/s per NIC) instead "
            f"of NVLink (~{nvlink / 1e9:.0f} GB/s per direction): ~{nvlink / slingshot:.0f}x less bandwidth (derived from vendor figures) on the most "
            f"frequent collective. DeviceMesh's order (tp innermost) keeps every TP group on one node; it is "
            f"the DP (or PP) groups that cross, and they communicate once per step (or per microbatch).")
    elif crossing["hybrid_context"]["tp"]:
        say("\nTP crosses nodes in both orders: tp is larger than a node.")
    else:
        say("\nNo TP group crosses a node in either order here (try --gpus-per-node 2 with dp > 1, or "
            "--world 16 --pp 2 --dp 2 --tp 4).")
    return crossing


def run_fake_world(args):
    """--world N: DeviceMesh on a fake process group, once per rank, against the arithmetic."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shape = resolve_shape(args, args.world)
    report = metrics.Report(__file__, None, config={**vars(args), "shape": dict(zip(DIMENSIONS, shape))})
    report.world_size = args.world
    print(f"fake world of {args.world} ranks, mesh (pp, dp, tp) = {shape}: DeviceMesh built once per rank")
    for warning in hybrid.mesh_shape_warnings(shape[2], args.gpus_per_node):
        print(warning)
    mismatched = []
    for rank in range(args.world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=args.world)
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=DIMENSIONS)
            ours = hybrid.groups_of_rank(rank, shape, "device_mesh")
            theirs = {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in DIMENSIONS}
            coordinates = dict(zip(DIMENSIONS, mesh.get_coordinate()))
            if theirs != ours or coordinates != hybrid.grid_coordinates(rank, shape, "device_mesh"):
                mismatched.append(rank)
        finally:
            dist.destroy_process_group()
    report.check("DeviceMesh's groups and coordinates = the device_mesh-order arithmetic, every rank",
                 not mismatched, mismatched[:8] or args.world, "every rank equal")
    if args.world <= 64:
        print_grid(shape, args.gpus_per_node, print)
    crossing = explain_crossings(shape, args.gpus_per_node, print)
    report.extra["crossing_group_counts"] = {order: {dim: len(groups) for dim, groups in by_dim.items()}
                                             for order, by_dim in crossing.items()}
    return report.finish(args.metrics_out)


def main():
    p = runtime.parser(__doc__, steps=None)
    p.add_argument("--pp", type=runtime.positive_int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--tp", type=runtime.positive_int, default=None, help="tensor-parallel degree (default 2, or 1 on an odd world)")
    p.add_argument("--dp", type=runtime.positive_int, default=None, help="data-parallel degree (default: world / (pp x tp))")
    p.add_argument("--gpus-per-node", type=runtime.positive_int, default=4,
                   help="ranks per node when the launcher fills nodes in rank order (default 4: Derecho)")
    p.add_argument("--world", type=runtime.positive_int, default=None,
                   help="check a world of N ranks in this one process on a fake process group (no launcher)")
    args = p.parse_args()
    if args.world is not None:
        try:
            check_config(args, runtime.launcher_env().world_size)
        except runtime.ConfigError as error:
            sys.stderr.write(f"config error: {error}\n")
            sys.exit(runtime.CONFIG_ERROR_EXIT_CODE)
        sys.exit(run_fake_world(args))

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        shape = resolve_shape(args, rt.world_size)
        report = metrics.Report(__file__, rt, config={**vars(args), "shape": dict(zip(DIMENSIONS, shape))})
        for warning in hybrid.mesh_shape_warnings(shape[2], args.gpus_per_node):
            rt.print(warning)
        rt.print(f"{rt.world_size} ranks as (pp, dp, tp) = {shape}")

        # 1. Every group of both orders, by hand. new_group is collective over the WHOLE world: every rank
        #    creates every group, in the same order, even the groups it is not a member of (a rank that
        #    skipped one would pair its next new_group with another group's: a hang or crossed groups).
        hand_built = {}  # (order, dim) -> this rank's group handle and members
        for order in hybrid.RANK_ORDERS:
            for dim, groups in hybrid.grid_groups(shape, order).items():
                for members in groups:
                    group = dist.new_group(members)
                    if rt.rank in members:
                        hand_built[(order, dim)] = (group, members)

        # 2. DeviceMesh's own groups (tp innermost).
        mesh = init_device_mesh(rt.device.type, shape, mesh_dim_names=DIMENSIONS)

        # 3. Each group works: all-reduce this rank's id over it; the sum must be the members' sum,
        #    computed from the arithmetic, not from the group. Integer sums: exact on every backend.
        results = {}
        with comm.CommCounter() as counter:
            for (order, dim), (group, members) in hand_built.items():
                total = torch.tensor([rt.rank], dtype=torch.int64, device=rt.device)
                dist.all_reduce(total, group=group)
                results[("hand-built " + order, dim)] = (total.item(), sum(members))
            for dim in DIMENSIONS:
                total = torch.tensor([rt.rank], dtype=torch.int64, device=rt.device)
                dist.all_reduce(total, group=mesh.get_group(dim))
                results[("DeviceMesh", dim)] = (total.item(),
                                                sum(hybrid.groups_of_rank(rt.rank, shape, "device_mesh")[dim]))

        # 4. This rank's view; every rank's verdict is combined so that all ranks report (and exit) alike.
        ours = hybrid.groups_of_rank(rt.rank, shape, "device_mesh")
        mesh_groups = {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in DIMENSIONS}
        verdicts = {
            "hand-built device_mesh-order groups = DeviceMesh's groups (mesh.get_group, every dim, every rank)":
                all(dist.get_process_group_ranks(hand_built[("device_mesh", dim)][0]) == mesh_groups[dim]
                    == mesh[dim].mesh.tolist() == ours[dim] for dim in DIMENSIONS),
            "DeviceMesh coordinates = the device_mesh-order arithmetic (every rank)":
                dict(zip(DIMENSIONS, mesh.get_coordinate())) == hybrid.grid_coordinates(rt.rank, shape),
            "all-reduce of rank ids = sum of members, every group of both orders and of DeviceMesh":
                all(got == expected for got, expected in results.values()),
            "one all-reduce per group and rank (8-byte payloads)":
                counter.count("all_reduce") == len(results) and counter.total("all_reduce") == 8 * len(results),
        }
        for name, passed in verdicts.items():
            everyone = torch.tensor([int(passed)], device=rt.device)
            dist.all_reduce(everyone, op=dist.ReduceOp.MIN)
            report.check(name, everyone.item() == 1, f"{'all' if everyone.item() else 'not all'} "
                                                     f"{rt.world_size} ranks", "every rank")
        report.add_comm("all_reduce", counter.total("all_reduce"), 8 * len(results),
                        measured_calls=counter.count("all_reduce"), analytic_calls=len(results))
        rt.print(f"rank 0 is in: " + ", ".join(f"{order} {dim} {members}" for (order, dim), (_, members)
                                              in hand_built.items()))

        if rt.is_main:
            print_grid(shape, args.gpus_per_node, rt.print)
            crossing = explain_crossings(shape, args.gpus_per_node, rt.print)
            report.extra["crossing_groups"] = crossing
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
