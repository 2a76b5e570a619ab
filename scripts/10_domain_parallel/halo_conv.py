"""Domain parallelism: a field split into tiles over the ranks, halos exchanged, a convolution stack on tiles.

The field (batch x channels x height x width, like one time step of a weather model) is split along the
height (``--split h``: each rank holds a band of rows) or along both height and width (``--split hw``: a
grid of tiles). Before the convolutions run, every rank swaps the cells along its edges with its neighbours
(the halo), through point-to-point messages wrapped in an autograd function, so the backward pass sends the
halo's gradient back to the rank that owns those cells.

How wide a halo: as far as the stack sees, its receptive radius, the sum of ``k // 2`` over its layers
(``--exchange once``: one exchange of that width, then unpadded convolutions), or ``k // 2`` before every
layer (``--exchange per-layer``). The script proves that

* the output on every tile equals the same cells of the one-device output;
* the gradient of the input on every tile (it crosses tile edges through the halo) and the gradients of the
  weights (summed over tiles) equal the one-device gradients;
* the bytes each rank sends, measured on the messages posted, equal the formula, forward and backward.

    torchrun --standalone --nproc_per_node=4 scripts/10_domain_parallel/halo_conv.py
    torchrun --standalone --nproc_per_node=4 scripts/10_domain_parallel/halo_conv.py --split hw --exchange per-layer
"""

import sys

import torch
import torch.distributed as dist

from distlab import comm, domain, metrics, runtime

# fp32 tolerances against the one-device stack, relative to the largest value compared (outputs ~1, input
# gradients ~1, weight gradients ~100: each sums over every cell of the field). A tile's convolution sums the
# same products as the full field's, but the kernel may block the sum differently for another image size,
# and the weight gradients add the tiles' partial sums in another order: measured <= 2e-6 relative on CPU.
# On a GPU, cuDNN picks its algorithm per shape; TF32 is switched off below so both sides multiply in full
# fp32, and the tolerance allows for the different summation orders of those algorithms.
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


def relative_difference(actual, expected) -> float:
    """Largest absolute difference over the largest absolute expected value."""
    scale = max(float(e.detach().abs().max()) for e in (expected if isinstance(expected, list) else [expected]))
    return metrics.max_abs_diff(actual, expected) / max(scale, 1e-30)


def parse_channels(text: str) -> tuple[int, ...]:
    return tuple(int(c) for c in text.split(","))


def check_config(args, world_size):
    channels = parse_channels(args.channels)
    runtime.require(len(channels) >= 2 and min(channels) >= 1,
                    f"--channels {args.channels}: give at least two positive channel counts, e.g. 4,16,4")
    runtime.require(args.kernel % 2 == 1, f"--kernel {args.kernel} is even: a centred stencil needs an odd kernel")
    runtime.require(args.batch >= 1, f"--batch {args.batch}: need at least one field")
    rows, cols = domain.grid_shape(args.split, world_size)
    grid = domain.TileGrid(rows, cols, args.height, args.width,
                         periodic_width=args.periodic_width)
    halo = domain.receptive_radius([args.kernel] * (len(channels) - 1))
    width = halo if args.exchange == "once" else args.kernel // 2
    problems = domain.tile_problems(grid, width)
    runtime.require(not problems, "; ".join(problems))


def main():
    p = runtime.parser(__doc__, steps=None)
    p.add_argument("--split", choices=["h", "hw"], default="h",
                   help="h: bands of rows; hw: a grid of tiles (rows x cols as square as the rank count allows)")
    p.add_argument("--periodic-width", action="store_true",
                   help="the field wraps east-west (a global latitude-longitude grid): a circular halo across the edge")
    p.add_argument("--exchange", choices=["once", "per-layer"], default="once",
                   help="once: one halo of the stack's receptive radius; per-layer: k//2 before every layer")
    p.add_argument("--height", type=runtime.positive_int, default=32, help="field height (cells)")
    p.add_argument("--width", type=runtime.positive_int, default=32, help="field width (cells)")
    p.add_argument("--channels", default="4,16,16,4", help="channels in and out of each layer, comma-separated")
    p.add_argument("--kernel", type=runtime.positive_int, default=3, help="kernel size of every layer (odd)")
    p.add_argument("--batch", type=runtime.positive_int, default=2, help="fields per batch")
    args = p.parse_args()
    channels = parse_channels(args.channels)

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        report = metrics.Report(__file__, rt, config=vars(args))
        torch.backends.cudnn.allow_tf32 = False  # compare fp32 with fp32 (see TOLERANCE)
        tolerance = TOLERANCE[rt.device.type]
        grid = domain.TileGrid(*domain.grid_shape(args.split, rt.world_size), args.height, args.width,
                         periodic_width=args.periodic_width)
        row, col = grid.coords(rt.rank)
        rows, cols = grid.tile_slices(rt.rank)

        # Every rank draws the same global field and the same "upstream gradient" (the seed decides), and
        # builds the same weights. The one-device reference runs on each rank on the whole field.
        generator = torch.Generator().manual_seed(args.seed)
        field = torch.randn(args.batch, channels[0], args.height, args.width, generator=generator).to(rt.device)
        upstream = torch.randn(args.batch, channels[-1], args.height, args.width, generator=generator).to(rt.device)
        model = domain.build_conv_stack(channels, args.kernel, args.seed, rt.device, args.periodic_width)
        reference = domain.build_conv_stack(channels, args.kernel, args.seed, rt.device, args.periodic_width)
        rt.print(f"field {args.batch} x {channels[0]} x {args.height} x {args.width} split into {grid.rows} x "
                 f"{grid.cols} tiles of {grid.tile_height} x {grid.tile_width}; stack of {len(channels) - 1} "
                 f"{args.kernel}x{args.kernel} convolutions, receptive radius {model.radius}; exchange: "
                 f"{args.exchange}")

        # 1. One device: the whole field. Loss = sum(output * upstream), so d loss / d output = upstream.
        whole_field = field.clone().requires_grad_(True)
        expected = reference(whole_field)
        (expected * upstream).sum().backward()

        # 2. Tiles: my cells only, plus the halo my neighbours send.
        tile = grid.tile(field, rt.rank).clone().requires_grad_(True)
        with comm.CommCounter() as forward_messages:
            output = domain.tile_conv_stack(model, tile, grid, rt.rank, exchange=args.exchange)
        with comm.CommCounter() as backward_messages:
            (output * upstream[..., rows, cols]).sum().backward()
        for param in model.parameters():  # each tile contributed its part of every weight's gradient
            dist.all_reduce(param.grad)

        # 3. Proof, on every tile; the worst difference over all ranks decides.
        def worst(value: float) -> float:
            t = torch.tensor([value], device=rt.device, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        output_diff = worst(relative_difference(output, expected[..., rows, cols]))
        report.check("output on every tile = the same cells of the one-device output (relative)",
                     output_diff <= tolerance, output_diff, tolerance)
        input_grad_diff = worst(relative_difference(tile.grad, whole_field.grad[..., rows, cols]))
        report.check("input gradient on every tile = one device (flows back across tile edges)",
                     input_grad_diff <= tolerance, input_grad_diff, tolerance)
        weight_grad_diff = worst(max(relative_difference(p.grad, q.grad)
                                     for p, q in zip(model.parameters(), reference.parameters())))
        report.check("weight gradients summed over tiles = one device", weight_grad_diff <= tolerance,
                     weight_grad_diff, tolerance)

        # 4. Bytes sent: counted on the messages this rank posted, against the formula, gathered from all ranks.
        formula = domain.stack_send_bytes(model, grid, rt.rank, args.batch, args.exchange,
                                          element_size=field.element_size())
        sent = torch.tensor([forward_messages.total("send"), backward_messages.total("send"), formula,
                             forward_messages.count("send")], device=rt.device, dtype=torch.int64)
        per_rank = [torch.zeros_like(sent) for _ in range(rt.world_size)]
        dist.all_gather(per_rank, sent)
        rt.print(f"\nbytes sent per rank (one forward, one backward; {args.exchange} exchange):")
        rt.print(f"  {'rank':>4s} {'tile (row, col)':>15s} {'messages':>8s} {'forward':>10s} {'backward':>10s} "
                 f"{'formula':>10s}")
        for r, values in enumerate(per_rank):
            fwd, bwd, expected_bytes, messages = (int(v) for v in values)
            rt.print(f"  {r:4d} {str(grid.coords(r)):>15s} {messages:8d} {fwd:10,d} {bwd:10,d} {expected_bytes:10,d}")
            report.add_comm("send", fwd, expected_bytes, phase="forward", rank=r, messages=messages)
            report.add_comm("send", bwd, expected_bytes, phase="backward", rank=r)
        mismatched = [row_ for row_ in report.comm if row_["measured_bytes"] != row_["analytic_bytes"]]
        report.check("bytes sent by every rank, forward and backward = formula", not mismatched,
                     len(mismatched), "0 rows differ")
        tile_cells = grid.tile_height * grid.tile_width
        report.extra = {"grid": [grid.rows, grid.cols], "tile": [grid.tile_height, grid.tile_width],
                        "receptive_radius": model.radius, "my_tile": [row, col],
                        "halo_to_tile_ratio": domain.halo_to_tile_ratio(grid.tile_height, grid.tile_width,
                                                                        model.radius, args.split),
                        "tile_cells": tile_cells}
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
