"""Data parallelism by hand: broadcast the weights once, then average the gradients after every backward.

Each of N ranks holds a full replica of the model and trains on its own N-th of the global batch. Two
collectives make the replicas behave like one model trained on the whole batch:

1. ``broadcast`` rank 0's weights at the start (here every rank deliberately builds *different* weights,
   seed + rank, so the broadcast visibly matters);
2. after ``loss.backward()``, ``all_reduce`` every gradient (sum) and divide by N: every rank now holds the
   gradient of the mean loss over the global batch, and takes the same AdamW step.

The script proves it: a single-device run on the same global batch (on rank 0, in lockstep) gives the same
loss and the same parameters at every step, within fp32 rounding; every replica ends identical; and the
bytes all-reduced per step equal the parameter bytes (each rank sends 2(N-1)/N of them on a ring).

    torchrun --standalone --nproc_per_node=4 scripts/04_data_parallel/ddp_from_scratch.py
"""

import argparse
import sys
import time

import torch
import torch.distributed as dist

from distlab import comm, data, metrics, models, runtime

# fp32 tolerances. The N partial gradients are summed in another order than one big sum, so results
# differ by a few ulps, never more:
# * losses: measured <= 1e-6 (values ~4): tolerance 1e-5;
# * gradients: measured 2e-8 to 4e-7 (largest gradients ~5e-2): tolerance 1e-5;
# * parameters: AdamW divides each gradient by sqrt(v) + eps, so a weight whose gradient is near zero
#   (as small as the rounding noise) moves by up to ~lr whatever the noise says: measured up to 2e-5 after
#   12 steps at lr 3e-3. Tolerance lr / 10: far below what wrong data does (~lr per step on every weight).
#   Note that Adam is blind to a gradient's scale: a forgotten division by N leaves the parameters almost
#   unchanged, which is why the gradients are checked, not only the parameters.
# On a GPU, the loss and gradient tolerances widen by metrics.GPU_FP32_TOLERANCE_FACTOR (10x: its kernels sum
# in other, partly nondeterministic orders); the parameter tolerance (lr / 10) already covers that.
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5


def param_tolerance(lr: float) -> float:
    return lr / 10


def check_config(args, world_size):
    runtime.require(args.steps >= 1, f"--steps {args.steps}: need at least one step")
    if args.batch is not None:
        runtime.require(args.batch >= world_size and args.batch % world_size == 0,
                        f"--batch {args.batch} does not split over {world_size} ranks "
                        f"(the global batch must be a multiple of the world size)")
    with_reference = args.reference if args.reference is not None else args.preset == "tiny"
    runtime.require(not (with_reference and args.precision == "bf16"),
                    "the single-device comparison checks fp32 equality: use --precision fp32 or --no-reference")


# ---- the two collectives of data parallelism ----------------------------------------------------


@torch.no_grad()
def broadcast_parameters(model, src=0):
    """Make every replica start from rank ``src``'s weights."""
    for param in model.parameters():
        dist.broadcast(param, src=src)


@torch.no_grad()
def average_gradients(model):
    """Replace each rank's gradient by the mean over ranks: the gradient of the global-batch loss.

    Each rank's loss is the mean over its B/N samples, so the mean of the N local gradients is the gradient
    of the mean over all B samples (gloo has no AVG reduction: sum, then divide).
    """
    world_size = dist.get_world_size()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.div_(world_size)


@torch.no_grad()
def scaled_sum_gradients(model, scale: float):
    """Chapter 14's lab: each rank's gradient summed over the ranks, times the learner's ``scale``."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.mul_(scale)


def replica_fingerprint(model) -> torch.Tensor:
    """One float64 number per parameter tensor: equal on every rank if (and in practice only if) the replicas are."""
    return torch.stack([p.detach().double().sum() + p.detach().double().abs().sum() for p in model.parameters()])


def replicas_identical(model) -> bool:
    mine = replica_fingerprint(model).cpu()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(mine, other) for other in everyone)


def make_optimizer(model, args):
    """AdamW over the trainable parameters: one group, or with --any-model two (distlab.models.parameter_groups)."""
    return torch.optim.AdamW(models.parameter_groups(model, args.lr, any_model=args.any_model), lr=args.lr)


def build(cfg, seed, args, device):
    model = models.build_transformer(cfg, seed=seed, device=device)
    return models.make_any_model(model) if args.any_model else model


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=10)
    p.add_argument("--batch", type=runtime.positive_int, default=None,
                   help="global batch, sequences per step, split over the ranks (default: 8; 16 for a100)")
    runtime.add_lr_flag(p)
    p.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="auto: fp32 when comparing with a single device, else bf16 autocast on a GPU, fp32 on a CPU")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                   help="train a single-device reference on rank 0 in lockstep and compare every step "
                        "(default: on for tiny; off for a100, whose reference would not fit beside the replica)")
    p.add_argument("--planted-bug", choices=["loss-averaged-twice"], default=None,
                   help="a mistake the checks must catch: each rank divides its loss by the world size before "
                        "backward, and average_gradients divides again (gradients 1/N of the right ones)")
    runtime.add_fix_flag(p, "gradient_scales(world_size) -> (loss_scale, reduce_scale): each rank's mean loss is "
                            "multiplied by loss_scale before backward, the gradients summed over the ranks by "
                            "reduce_scale")
    p.add_argument("--any-model", action="store_true",
                   help="head tied to the embedding, the first block and every norm frozen, a head bias of 127, two "
                        "parameter groups: a frozen parameter has no gradient to average, a tied one is averaged once")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        fixes = runtime.learner_fixes(args.fix_from, ("gradient_scales",))
        rt.require(not (fixes and args.planted_bug), "--fix-from replaces the scaling --planted-bug plants")
        loss_scale, reduce_scale = 1.0, None   # the script's own: each rank's mean loss, the sum divided by N
        if fixes:   # chapter 14's lab: the learner's two scales, used on every rank below
            scales = fixes["gradient_scales"](rt.world_size)
            rt.require(isinstance(scales, (tuple, list)) and len(scales) == 2
                       and all(isinstance(x, (int, float)) for x in scales),
                       f"gradient_scales({rt.world_size}) returned {scales!r}, not two numbers")
            loss_scale, reduce_scale = map(float, scales)
        cfg = models.preset(args.preset, **({"vocab_size": 127} if args.any_model else {}))
        args.batch = args.batch or (16 if args.preset == "a100" else 8)
        rt.require(args.batch % rt.world_size == 0, f"--batch {args.batch} does not split over {rt.world_size} ranks")
        with_reference = args.reference if args.reference is not None else args.preset == "tiny"
        precision = args.precision if args.precision != "auto" else (
            "bf16" if rt.device_type == "cuda" and not with_reference else "fp32")
        report = metrics.Report(__file__, rt, config={**vars(args), "precision": precision, "model": cfg.to_dict()})
        # Every rank builds its own weights (seed + rank: different on purpose), then takes rank 0's.
        model = build(cfg, args.seed + rt.rank, args, rt.device)
        num_params = models.count_params(model)  # a tied weight once
        rt.print(f"{args.preset} transformer{' (any-model)' if args.any_model else ''}: {num_params:,} parameters; "
                 f"global batch {args.batch} = "
                 f"{rt.world_size} ranks x {args.batch // rt.world_size} sequences of {cfg.seq_len} tokens; "
                 f"{precision}, {rt.device}")

        differed = not replicas_identical(model)
        broadcast_parameters(model, src=0)
        report.check("replicas differed before the broadcast", differed or rt.world_size == 1)
        report.check("replicas identical after the broadcast", replicas_identical(model))
        optimizer = make_optimizer(model, args)
        autocast = torch.autocast(rt.device_type, dtype=torch.bfloat16, enabled=precision == "bf16")

        reference = ref_optimizer = None
        if with_reference and rt.rank == 0:
            reference = build(cfg, args.seed, args, rt.device)  # rank 0's seed
            ref_optimizer = make_optimizer(reference, args)
        loss_diffs, grad_diffs, param_diffs, ref_losses = [], [], [], []

        trainable = [p for p in model.parameters() if p.requires_grad]   # a frozen parameter has no gradient
        param_bytes = sum(p.numel() * p.element_size() for p in trainable)
        bytes_per_step, seconds = [], []
        for step in range(args.steps):
            tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
            inputs, targets = data.split_inputs_targets(data.shard_rows(tokens, rt.rank, rt.world_size).to(rt.device))
            rt.sync()
            started = time.perf_counter()
            with autocast:
                loss = models.lm_loss(model(inputs), targets)
            if args.planted_bug == "loss-averaged-twice":   # the mistake: a mean over the ranks here, and
                (loss / rt.world_size).backward()            # average_gradients divides by N again
            else:
                (loss * loss_scale if fixes else loss).backward()
            with comm.CommCounter() as counter:
                if reduce_scale is None:
                    average_gradients(model)  # the whole of data parallelism, after backward
                else:
                    scaled_sum_gradients(model, reduce_scale)
            bytes_per_step.append(counter.total("all_reduce"))
            rt.sync()
            seconds.append(time.perf_counter() - started)

            if reference is not None:  # the single-device run: same global batch, same step
                ref_inputs, ref_targets = data.split_inputs_targets(tokens.to(rt.device))
                with autocast:
                    ref_loss = models.lm_loss(reference(ref_inputs), ref_targets)
                ref_loss.backward()
                grad_diffs.append(metrics.max_abs_diff([p.grad for p in trainable],
                                                       [p.grad for p in reference.parameters() if p.requires_grad]))
                ref_optimizer.step()
                ref_optimizer.zero_grad(set_to_none=True)
                ref_losses.append(ref_loss.item())

            started = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rt.sync()
            seconds[-1] += time.perf_counter() - started

            # the loss of the global batch: the mean of the ranks' losses (equal shard sizes)
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            global_loss = global_loss.item() / rt.world_size
            report.losses.append(global_loss)
            if reference is not None:
                loss_diffs.append(abs(global_loss - ref_losses[-1]))
                param_diffs.append(metrics.max_abs_diff(list(model.parameters()), list(reference.parameters())))
                rt.print(f"step {step:3d}  loss {global_loss:.6f}  single-device {ref_losses[-1]:.6f}  "
                         f"max |diff|: loss {loss_diffs[-1]:.1e}  grads {grad_diffs[-1]:.1e}  "
                         f"params {param_diffs[-1]:.1e}")
            else:
                rt.print(f"step {step:3d}  loss {global_loss:.6f}  ({seconds[-1] * 1e3:.0f} ms)")

        # ---- communication: measured = analytic ----
        sent = comm.bytes_sent_per_rank("all_reduce", bytes_per_step[-1], rt.world_size)  # ring model x measured
        report.add_comm("all_reduce", bytes_per_step[-1], param_bytes, sent_bytes_per_rank_derived=sent,
                        calls=len(trainable))
        rt.print(f"all-reduced per step: {bytes_per_step[-1]:,} B (trainable parameter bytes: {param_bytes:,} B); "
                 f"on a ring each rank sends 2(N-1)/N of it = {sent:,.0f} B (derived: the ring model)")
        report.check("bytes all-reduced per step = trainable parameter bytes (every step)",
                     all(b == param_bytes for b in bytes_per_step), bytes_per_step[-1], f"== {param_bytes}")

        if rt.rank == 0 and reference is not None:
            report.check_close("loss = single-device loss (every step)", max(loss_diffs), 0.0,
                               metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
            report.check_close("averaged gradients = single-device gradients (every step)", max(grad_diffs), 0.0,
                               metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))
            report.check_close("parameters = single-device parameters (every step)", max(param_diffs), 0.0,
                               param_tolerance(args.lr))
            report.extra["reference_losses"] = ref_losses
            report.extra["loss_diffs"] = loss_diffs
            report.extra["grad_diffs"] = grad_diffs
            report.extra["param_diffs"] = param_diffs
        elif reference is None:
            rt.print("single-device comparison off (--no-reference); the replicas are still checked")
        report.check("replicas identical after training", replicas_identical(model))

        timed = seconds[1:] or seconds   # the first step pays one-off costs (allocator, first kernels): left out
        report.throughput = metrics.throughput(args.batch * cfg.seq_len, sum(timed), len(timed), cfg=cfg,
                                               device=rt.device, dtype=precision, num_devices=rt.world_size)
        report.memory = {"device": metrics.memory_snapshot(rt.device)}
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
