"""Domain parallelism in training, combined with data parallelism on a 2-D mesh ("dp", "domain").

A small CNN (convolutions with GroupNorm between them) learns to predict the next step of a field. The
ranks form a mesh of ``dp x domain``: the ``domain`` ranks of one row split every field into tiles (halos
exchanged before each convolution, as in halo_conv.py), and the ``dp`` rows each take their share of the
global batch. The weights are replicated on every rank. What it takes to train like one device:

* **the norms' statistics** are sums over the whole field: each tile sums its cells, an all-reduce over the
  domain group completes them (two per norm: the mean, then the variance around it);
* **the loss** on a tile is its squared error divided by the size of the whole global batch, so the tiles'
  and the rows' losses add up to the global mean;
* **the gradients** of the weights are therefore partial sums: all-reduced over ``domain``, then over ``dp``.

The script proves that losses at every step, gradients at step 0 and parameters at the end equal the one-device
run on the whole global batch; that skipping the statistics' reduction is wrong (and by how much); and that
the bytes of every collective, measured, equal the formula.

    torchrun --standalone --nproc_per_node=4 scripts/10_domain_parallel/domain_train.py
    torchrun --standalone --nproc_per_node=4 scripts/10_domain_parallel/domain_train.py --dp 2 --split h
"""

import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from distlab import comm, domain, metrics, runtime

# fp32 tolerances against the one-device run, relative to the largest value compared. Tiles and rows sum
# the same terms in another order (the field's statistics, the loss, the gradients): measured about 2e-6 on CPU.
# Parameters after AdamW steps: a weight whose gradient is as small as the rounding noise moves by up to ~lr
# whatever the noise says (chapter 04 explains): absolute tolerance lr / 10. On a GPU cuDNN's algorithm
# differs per shape (TF32 off below): tolerances 10x looser.
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


def relative_difference(actual, expected) -> float:
    scale = max(float(torch.as_tensor(e).detach().abs().max()) for e in expected)
    return metrics.max_abs_diff(list(actual), list(expected)) / max(scale, 1e-30)


def check_config(args, world_size):
    dp = args.dp
    runtime.require(dp >= 1 and world_size % dp == 0,
                    f"--dp {dp} does not divide the {world_size} ranks into a dp x domain mesh")
    runtime.require(args.batch % dp == 0, f"--batch {args.batch} does not split over --dp {dp} rows of the mesh")
    runtime.require(args.hidden % args.groups == 0, f"--hidden {args.hidden} does not split into --groups {args.groups}")
    grid = domain.TileGrid(*domain.grid_shape(args.split, world_size // dp), args.height, args.width,
                         periodic_width=args.periodic_width)
    problems = domain.tile_problems(grid, halo=1)  # 3 x 3 convolutions, one exchange of 1 cell per layer
    runtime.require(not problems, "; ".join(problems))


def train_single_device(args, device):
    """The reference: the whole global batch of whole fields on one device."""
    model = domain.build_field_cnn(args.seed, device, channels=args.channels, hidden=args.hidden, groups=args.groups,
                                   periodic_width=args.periodic_width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses, first_grads = [], None
    for step in range(args.steps):
        fields, targets = domain.field_batch(step, args.batch, args.channels, args.height, args.width, args.seed)
        loss = torch.nn.functional.mse_loss(model(fields.to(device)), targets.to(device))
        loss.backward()
        if step == 0:
            first_grads = [p.grad.detach().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, first_grads, [p.detach().clone() for p in model.parameters()]


def main():
    p = runtime.parser(__doc__, steps=4)
    p.add_argument("--dp", type=runtime.positive_int, default=1, help="data-parallel rows of the mesh; domain = ranks / dp")
    p.add_argument("--split", choices=["h", "hw"], default="hw", help="tiles: bands of rows (h) or a grid (hw)")
    p.add_argument("--periodic-width", action="store_true",
                   help="the field wraps east-west, as a global latitude-longitude grid: a circular halo across the "
                        "edge (latitude stays zero-padded)")
    p.add_argument("--batch", type=runtime.positive_int, default=4, help="global batch (fields per step), split over dp")
    p.add_argument("--channels", type=runtime.positive_int, default=2, help="channels of the field (e.g. temperature, pressure)")
    p.add_argument("--hidden", type=runtime.positive_int, default=8, help="channels inside the network")
    p.add_argument("--groups", type=runtime.positive_int, default=2, help="GroupNorm groups")
    p.add_argument("--height", type=runtime.positive_int, default=32, help="field height (cells)")
    p.add_argument("--width", type=runtime.positive_int, default=32, help="field width (cells)")
    runtime.add_lr_flag(p)
    args = p.parse_args()

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        torch.backends.cudnn.allow_tf32 = False  # compare fp32 with fp32
        tolerance = TOLERANCE[rt.device.type]
        dp, domain_size = args.dp, rt.world_size // args.dp
        report = metrics.Report(__file__, rt, config={**vars(args), "domain": domain_size})

        # The mesh: rows are data-parallel replicas, columns the tiles of one field.
        mesh = init_device_mesh(rt.device.type, (dp, domain_size), mesh_dim_names=("dp", "domain"))
        domain_group, dp_group = mesh.get_group("domain"), mesh.get_group("dp")
        tile_rank, dp_rank = mesh.get_local_rank("domain"), mesh.get_local_rank("dp")
        grid = domain.TileGrid(*domain.grid_shape(args.split, domain_size), args.height, args.width,
                         periodic_width=args.periodic_width)
        rows, cols = grid.tile_slices(tile_rank)
        local_batch = args.batch // dp
        samples = slice(dp_rank * local_batch, (dp_rank + 1) * local_batch)
        rt.print(f"mesh dp {dp} x domain {domain_size}: each field in {grid.rows} x {grid.cols} tiles of "
                 f"{grid.tile_height} x {grid.tile_width}, {local_batch} of {args.batch} fields per row")

        reference_losses, reference_grads, reference_params = train_single_device(args, rt.device)

        model = domain.build_field_cnn(args.seed, rt.device, channels=args.channels, hidden=args.hidden,
                                       groups=args.groups, periodic_width=args.periodic_width)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        global_cells = args.batch * args.channels * args.height * args.width
        counter, started = comm.CommCounter(), None
        for step in range(args.steps):
            if step == 1:
                rt.sync()
                started = time.perf_counter()
            fields, targets = domain.field_batch(step, args.batch, args.channels, args.height, args.width, args.seed)
            tile_in = fields[samples, :, rows, cols].to(rt.device)
            tile_target = targets[samples, :, rows, cols].to(rt.device)
            with counter if step == 0 else comm.CommCounter():
                prediction = domain.tile_field_cnn(model, tile_in, grid, tile_rank, domain_group)
                # my share of the global mean: the tiles' and rows' shares add up to it
                loss = ((prediction - tile_target) ** 2).sum() / global_cells
                loss.backward()
                for param in model.parameters():
                    dist.all_reduce(param.grad, group=domain_group)  # the tiles of one field
                    dist.all_reduce(param.grad, group=dp_group)      # the rows of the batch
            if step == 0:
                grad_diff = relative_difference([q.grad for q in model.parameters()], reference_grads)
                report.check("step-0 gradients = one device (relative)", grad_diff <= tolerance, grad_diff, tolerance)
                with torch.no_grad():  # the mistake: each tile normalised by its own statistics
                    wrong = domain.tile_field_cnn(model, tile_in, grid, tile_rank, domain_group,
                                                  reduce_statistics=False)
                    local_norm_error = metrics.max_abs_diff(wrong, prediction)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)
            report.losses.append(total.item())
            rt.print(f"step {step}: loss {report.losses[-1]:.6f}   one device {reference_losses[step]:.6f}")
        rt.sync()
        elapsed = time.perf_counter() - started if started else float("nan")

        loss_diff = relative_difference(report.losses, reference_losses)
        report.check("losses every step = one device (relative)", loss_diff <= tolerance, loss_diff, tolerance)
        report.check_close("parameters at the end = one device", [q.detach() for q in model.parameters()],
                           reference_params, tolerance=args.lr / 10)
        worst_local_norm_error = torch.tensor([local_norm_error], dtype=torch.float64, device=rt.device)
        dist.all_reduce(worst_local_norm_error, op=dist.ReduceOp.MAX)
        rt.print(f"without reducing the norms' statistics over the tiles the step-0 output would differ by up to "
                 f"{worst_local_norm_error.item():.3f}")
        if domain_size > 1:  # with one tile per field its statistics are the field's
            report.check("norms with tile-only statistics differ from the field's (the reduction matters)",
                         worst_local_norm_error.item() > 100 * tolerance, worst_local_norm_error.item(),
                         f"> {100 * tolerance:g}")

        # Communication of step 0, measured, against the formula. Halo messages: one exchange per convolution,
        # the same bytes back in the backward pass. All-reduces: two statistics per norm and sample group,
        # forward and backward; the gradients once per mesh dimension (a group of one still counts a call).
        # The first convolution's input is data, which needs no gradient: its halo is not sent back.
        halo_bytes = [domain.halo_send_bytes(grid, tile_rank, conv.kernel_size[0] // 2, conv.in_channels, local_batch)
                      for conv in model.convs]
        halo_formula = sum(halo_bytes) + sum(halo_bytes[1:])
        param_bytes = sum(q.numel() * q.element_size() for q in model.parameters())
        statistics_bytes = len(model.norms) * 2 * 2 * local_batch * args.groups * 4  # (mean, var) x (fwd, bwd)
        allreduce_formula = statistics_bytes + 2 * param_bytes
        report.add_comm("send", counter.total("send"), halo_formula, mesh_dim="domain", what="halo, fwd + bwd")
        report.add_comm("all_reduce", counter.total("all_reduce"), allreduce_formula, mesh_dim="domain + dp",
                        what="norm statistics (domain) + gradients (domain, then dp)",
                        gradient_bytes_per_dim=param_bytes, statistics_bytes=statistics_bytes)
        rt.print(f"\nstep-0 communication of rank {rt.rank}: halo sends {counter.total('send'):,} B "
                 f"(formula {halo_formula:,}); all-reduces {counter.total('all_reduce'):,} B (formula "
                 f"{allreduce_formula:,}: statistics {statistics_bytes:,} + gradients 2 x {param_bytes:,})")
        report.check("bytes of step 0 (halo sends, all-reduces) = formula",
                     all(r["measured_bytes"] == r["analytic_bytes"] for r in report.comm),
                     [r["measured_bytes"] for r in report.comm], [r["analytic_bytes"] for r in report.comm])
        report.extra = {"reference_losses": reference_losses, "local_norm_error": worst_local_norm_error.item(),
                        "grid": [grid.rows, grid.cols], "tile": [grid.tile_height, grid.tile_width]}
        report.throughput = metrics.throughput(args.batch * args.height * args.width, elapsed, args.steps - 1)
        report.throughput["unit"] = "cells/s (tokens_per_s counts grid cells)"
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
