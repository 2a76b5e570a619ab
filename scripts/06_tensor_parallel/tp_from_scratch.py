"""Tensor parallelism from scratch: column- and row-parallel linear layers built from plain collectives.

Two autograd functions carry all the communication (Megatron-LM calls them f and g):

* `copy_to_tensor_parallel` (f): identity forward, all-reduce of the gradient backward. It sits where a
  replicated activation enters a column-parallel layer: each rank's layer sees only its columns, so each
  computes only its part of the input's gradient, and the parts must be summed.
* `reduce_from_tensor_parallel` (g): all-reduce forward, identity backward. It sits after a row-parallel
  layer, whose ranks each hold a partial sum of the output.

A column-parallel layer followed by a row-parallel one needs nothing in between: the column layer's output
shard is exactly the row layer's input shard. So the shared model's SwiGLU feed-forward (w1, w3 by
columns, w2 by rows) and its attention (wq, wk, wv by heads, wo by rows) each cost one all-reduce forward
and one backward, whatever their width. The script proves, against `nn.Linear` and the unsplit blocks of
`distlab.models`, that outputs and every gradient are equal, and counts the collectives.

    torchrun --standalone --nproc_per_node=4 scripts/06_tensor_parallel/tp_from_scratch.py
"""

import copy
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from distlab import comm, metrics, models, runtime

# Largest difference relative to the largest value: fp32 sums over the split dimension are added in another
# order (~1e-7 relative); a wrong split or a missing reduction is off by order 1.
TOLERANCE = 1e-5
# On a GPU these widen 10x: its kernels sum in other, partly nondeterministic orders (metrics.fp32_tolerance).


def relative_diff(actual, expected) -> float:
    return metrics.max_abs_diff(actual, expected) / max(expected.detach().abs().max().item(), 1e-30)


# -------------------------------------------------------------------------------------------------
# The two communication operators
# -------------------------------------------------------------------------------------------------


class CopyToTensorParallel(torch.autograd.Function):
    """f: forward the replicated input unchanged; backward, sum the ranks' partial input gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: sum the ranks' partial outputs; backward, the (replicated) gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, partial):
        total = partial.contiguous().clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad


def copy_to_tensor_parallel(x):
    return CopyToTensorParallel.apply(x)


def reduce_from_tensor_parallel(x):
    return ReduceFromTensorParallel.apply(x)


# -------------------------------------------------------------------------------------------------
# The two layers
# -------------------------------------------------------------------------------------------------


def my_slice(size: int, rank: int, world_size: int) -> slice:
    per_rank = size // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


class ColumnParallelLinear(nn.Module):
    """y[:, my columns] = x W[my rows]^T (+ b[my columns]). nn.Linear stores W as (out, in): the output
    columns of y are the rows of W. Input replicated, output split; no communication forward."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int, copy_input: bool = True):
        super().__init__()
        rows = my_slice(full.out_features, rank, world_size)
        self.weight = nn.Parameter(full.weight.detach()[rows].clone())
        self.bias = nn.Parameter(full.bias.detach()[rows].clone()) if full.bias is not None else None
        # A block whose input feeds several column layers (q, k, v) applies f once at its entry instead.
        self.copy_input = copy_input

    def forward(self, x):
        if self.copy_input:
            x = copy_to_tensor_parallel(x)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x[:, my features] W[:, my features]^T, then + b. Input split, output
    replicated: one all-reduce forward. The bias is added once, after the sum, not once per rank."""

    def __init__(self, full: nn.Linear, rank: int, world_size: int):
        super().__init__()
        columns = my_slice(full.in_features, rank, world_size)
        self.weight = nn.Parameter(full.weight.detach()[:, columns].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x_shard):
        y = reduce_from_tensor_parallel(F.linear(x_shard, self.weight))
        return y + self.bias if self.bias is not None else y


# -------------------------------------------------------------------------------------------------
# The shared model's blocks, split: same code, linears swapped, one f at the entry
# -------------------------------------------------------------------------------------------------


class TensorParallelBlock(nn.Module):
    """A copy of ``block`` (the shared model's FeedForward or Attention) whose linears are split:
    ``column`` ones by output features, ``row`` ones by input features. Its forward is the block's own,
    behind one f: the block's code does not change (attention views with -1 heads, so it computes the
    local heads)."""

    def __init__(self, block: nn.Module, column: list[str], row: list[str], rank: int, world_size: int):
        super().__init__()
        self.inner = copy.deepcopy(block)
        for name in column:
            setattr(self.inner, name, ColumnParallelLinear(getattr(block, name), rank, world_size,
                                                           copy_input=False))
        for name in row:
            setattr(self.inner, name, RowParallelLinear(getattr(block, name), rank, world_size))

    def forward(self, x, *args):
        return self.inner(copy_to_tensor_parallel(x), *args)


# -------------------------------------------------------------------------------------------------
# Proof
# -------------------------------------------------------------------------------------------------


def compare(report, name, rank, world, x, full_block, split_block, column, row, *args):
    """Run the unsplit and the split block on the same x and upstream gradient; compare the output, the
    input gradient and the gradient of every weight slice. Returns the collectives the split one issued."""
    x_full = x.clone().requires_grad_()
    x_split = x.clone().requires_grad_()
    y_full = full_block(x_full, *args)
    upstream = torch.randn(y_full.shape, generator=torch.Generator().manual_seed(1)).to(x.device)
    (y_full * upstream).sum().backward()

    with comm.CommCounter() as forward_comm:
        y_split = split_block(x_split, *args)
    # A column layer alone returns its output shard: compare it with the matching columns.
    expected = y_full[..., my_slice(y_full.shape[-1], rank, world)] if y_split.shape != y_full.shape else y_full
    upstream_mine = upstream[..., my_slice(y_full.shape[-1], rank, world)] if y_split.shape != y_full.shape \
        else upstream
    with comm.CommCounter() as backward_comm:
        (y_split * upstream_mine).sum().backward()

    inner = getattr(split_block, "inner", None)
    diffs = {"output": relative_diff(y_split, expected), "input gradient": relative_diff(x_split.grad, x_full.grad)}
    for layer_name in column + row:
        full_layer = getattr(full_block, layer_name) if layer_name else full_block
        split_layer = getattr(inner, layer_name) if layer_name else split_block
        if layer_name in column:
            cut = (my_slice(full_layer.out_features, rank, world), slice(None))
        else:
            cut = (slice(None), my_slice(full_layer.in_features, rank, world))
        diffs[f"{layer_name or 'weight'} gradient"] = relative_diff(split_layer.weight.grad,
                                                                   full_layer.weight.grad[cut])
    report.check(f"{name}: output, input gradient and weight gradients equal the unsplit one (relative)",
                 max(diffs.values()) <= metrics.fp32_tolerance(TOLERANCE, x.device), max(diffs.values()),
                 metrics.fp32_tolerance(TOLERANCE, x.device))
    return forward_comm, backward_comm


def check_config(args, world_size):
    runtime.require(args.dim % args.heads == 0, f"hidden size {args.dim} is not a multiple of {args.heads} heads")
    runtime.require(args.heads % world_size == 0,
                    f"{args.heads} attention heads do not split over {world_size} TP ranks")
    runtime.require(args.ffn_hidden % world_size == 0,
                    f"feed-forward hidden size {args.ffn_hidden} does not split over {world_size} TP ranks")
    runtime.require(args.dim % world_size == 0, f"hidden size {args.dim} does not split over {world_size} TP ranks")


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=None)
    p.add_argument("--batch", type=runtime.positive_int, default=None, help="sequences (default: 4 tiny, 2 a100)")
    p.add_argument("--seq-len", type=runtime.positive_int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--dim", type=runtime.positive_int, default=None, help="hidden size H (default: the preset's)")
    p.add_argument("--heads", type=runtime.positive_int, default=None, help="attention heads (default: the preset's)")
    p.add_argument("--ffn-hidden", type=runtime.positive_int, default=None, help="feed-forward hidden size (default: the preset's)")
    args = p.parse_args()
    base = models.preset(args.preset)
    args.batch = args.batch or {"tiny": 4, "a100": 2}[args.preset]
    args.seq_len = args.seq_len or base.seq_len
    args.dim, args.heads = args.dim or base.dim, args.heads or base.n_heads
    args.ffn_hidden = args.ffn_hidden or base.ffn_hidden

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        rank, world = rt.rank, rt.world_size
        cfg = models.preset(args.preset, dim=args.dim, n_heads=args.heads, ffn_hidden=args.ffn_hidden,
                            seq_len=args.seq_len)
        report = metrics.Report(__file__, rt, config=vars(args))
        torch.manual_seed(args.seed)  # the same weights and inputs on every rank
        x = torch.randn(args.batch, args.seq_len, args.dim, device=rt.device)
        activation_bytes = x.numel() * x.element_size()

        # 1. One linear layer, each way, against nn.Linear (with a bias, to see where it goes).
        linear_in = nn.Linear(args.dim, args.ffn_hidden, device=rt.device)
        compare(report, "ColumnParallelLinear vs nn.Linear", rank, world, x, linear_in,
                ColumnParallelLinear(linear_in, rank, world), [""], [])
        linear_out = nn.Linear(args.ffn_hidden, args.dim, device=rt.device)
        hidden = torch.randn(args.batch, args.seq_len, args.ffn_hidden, device=rt.device)
        hidden_full = hidden.clone().requires_grad_()
        y_full = linear_out(hidden_full)
        y_full.sum().backward()
        row = RowParallelLinear(linear_out, rank, world)
        mine = my_slice(args.ffn_hidden, rank, world)
        hidden_mine = hidden[..., mine].clone().requires_grad_()
        y_row = row(hidden_mine)
        y_row.sum().backward()
        diff = max(relative_diff(y_row, y_full), relative_diff(hidden_mine.grad, hidden_full.grad[..., mine]),
                   relative_diff(row.weight.grad, linear_out.weight.grad[:, mine]),
                   relative_diff(row.bias.grad, linear_out.bias.grad))
        report.check("RowParallelLinear vs nn.Linear: output, input slice gradient, weight and bias gradients (relative)",
                     diff <= metrics.fp32_tolerance(TOLERANCE, rt.device), diff, metrics.fp32_tolerance(TOLERANCE, rt.device))

        # 2. The Megatron feed-forward: w1, w3 by columns, w2 by rows; and attention split by heads.
        model = models.build_transformer(cfg, args.seed, rt.device)
        feed_forward = model.layers["0"].feed_forward
        attention = model.layers["0"].attention
        cos, sin = model.rope_cos[:args.seq_len], model.rope_sin[:args.seq_len]
        ffn_comm = compare(report, "feed-forward (SwiGLU) split over ranks", rank, world, x, feed_forward,
                           TensorParallelBlock(feed_forward, ["w1", "w3"], ["w2"], rank, world),
                           ["w1", "w3"], ["w2"])
        attn_comm = compare(report, f"attention split by heads ({args.heads // world} per rank)", rank, world, x,
                            attention, TensorParallelBlock(attention, ["wq", "wk", "wv"], ["wo"], rank, world),
                            ["wq", "wk", "wv"], ["wo"], cos, sin)

        # 3. The price: per block one all-reduce of B x S x H forward and one backward.
        rt.print(f"\ncollectives of one block (B x S x H = {args.batch} x {args.seq_len} x {args.dim}, "
                 f"{activation_bytes:,} bytes):")
        for block, (forward_comm, backward_comm) in (("feed_forward", ffn_comm), ("attention", attn_comm)):
            for phase, counter in (("forward", forward_comm), ("backward", backward_comm)):
                measured = counter.total("all_reduce")
                rt.print(f"  {block:12s} {phase:8s} {counter.count('all_reduce')} all-reduce, {measured:,} bytes "
                         f"(formula: 1 x {activation_bytes:,})")
                report.add_comm("all_reduce", measured, activation_bytes, phase=phase, where=block,
                                measured_calls=counter.count(), analytic_calls=1)
                report.check_equal(f"{block} {phase}: one all-reduce of B x S x H", (counter.count(), measured),
                                   (1, activation_bytes))

        # 4. The two tracks agree: the same feed-forward split by DTensor's parallelize_module (chapter's
        #    second half, tp_transformer.py) gives the same local output and the same weight-shard gradients.
        fresh = models.build_transformer(cfg, args.seed, rt.device).layers["0"].feed_forward
        mesh = init_device_mesh(rt.device.type, (world,), mesh_dim_names=("tp",))
        by_dtensor = parallelize_module(copy.deepcopy(fresh), mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                                                     "w2": RowwiseParallel()})
        by_hand = TensorParallelBlock(fresh, ["w1", "w3"], ["w2"], rank, world)
        x_dtensor, x_hand = x.clone().requires_grad_(), x.clone().requires_grad_()   # the input's gradient too:
        y_dtensor, y_hand = by_dtensor(x_dtensor), by_hand(x_hand)                   # f's all-reduce in backward
        y_dtensor.sum().backward()
        y_hand.sum().backward()
        diff = max([relative_diff(y_hand, y_dtensor), relative_diff(x_hand.grad, x_dtensor.grad)] + [
            relative_diff(getattr(by_hand.inner, n).weight.grad, getattr(by_dtensor, n).weight.grad.to_local())
            for n in ("w1", "w2", "w3")])
        report.check("from scratch = DTensor ColwiseParallel/RowwiseParallel (output, input gradient, weight-shard "
                     "gradients)",
                     diff <= metrics.fp32_tolerance(TOLERANCE, rt.device), diff, metrics.fp32_tolerance(TOLERANCE, rt.device))
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
