"""Training the course's transformer with torch.distributed.pipelining: same losses as on one device.

The model is built whole on every rank from the seed, then each rank keeps only its stages: a contiguous
block of ``layers`` (the ModuleDict keeps its keys, so ``layers.5.attention.wq.weight`` is called that on
the rank that holds it, as in the full model), plus the token embeddings on the first stage and the final
norm and output projection on the last. Each stage becomes a ``PipelineStage``, the rank's stages go to
the ``--schedule`` (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), and
every step is one ``schedule.step(...)``: M microbatches forward and backward in the schedule's order,
gradients accumulated and scaled by 1/M, then each rank's AdamW updates its own stages.

It proves the pipeline changes *when* work happens, not *what* is computed: a single-device model, trained
on rank 0 on the same global batch with the same seed, has the same loss at every step and the same
parameters at the end, within fp32 rounding.

    torchrun --standalone --nproc_per_node=4 scripts/07_pipeline_parallel/pp_train.py --schedule 1F1B
    torchrun --standalone --nproc_per_node=4 scripts/07_pipeline_parallel/pp_train.py --schedule ZBVZeroBubble
"""

import sys
import time

import torch
import torch.distributed as dist

from common_pipeline import (add_training_flags, check_pipeline_config, gather_timeline, layers_of_stage,
                             record_actions, resolve_training_flags, schedule_help, stage_indices, torch_schedule,
                             transformer_stage)
from distlab import data, metrics, models, runtime

# fp32: microbatches sum their gradients in another order than one big batch: losses and gradients agree to
# ~5e-7. AdamW divides each gradient by sqrt(v) + eps, so a weight whose gradient is itself ~eps moves by a
# good part of lr on a rounding difference (measured: one entry in ten thousand off by ~2e-5 = lr / 150 after
# 4 steps); a real bug moves most weights by ~lr every step. Parameters: lr / 10. And because AdamW does not
# care about a gradient's scale, the first step's gradients are checked too (a missing 1/M would pass the
# loss check alone).
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5
# On a GPU these widen 10x: its kernels sum in other, partly nondeterministic orders (metrics.fp32_tolerance).


def stage_sum_of_squares(parameters) -> "torch.Tensor":
    """The squares of this rank's gradients, summed: one term of the whole model's squared norm."""
    grads = [p.grad for p in parameters if p.grad is not None]
    return sum((g.double().pow(2).sum() for g in grads), torch.zeros((), dtype=torch.float64, device=grads[0].device))


def clip_whole_model(parameters, max_norm: float) -> float:
    """Clip by the whole model's norm: each rank's sum of squares, all-reduced over the stages, then every rank
    scales its own gradients by the same factor (torch's clip_grad_norm_ on one stage's plain tensors sees that
    stage alone). Returns the norm."""
    parameters = list(parameters)
    total = stage_sum_of_squares(parameters)
    dist.all_reduce(total)
    norm = total.sqrt().item()
    scale = min(1.0, max_norm / (norm + 1e-6))
    for p in parameters:
        if p.grad is not None:
            p.grad.mul_(scale)
    return norm


def check_config(args, world_size):
    args.chunks = check_pipeline_config(args.schedule, world_size, args.microbatches, args.stages_per_rank)
    runtime.require(args.steps >= 1, f"--steps {args.steps}: need at least one step")
    runtime.require(args.batch % args.microbatches == 0 and args.batch >= args.microbatches,
                    f"--batch {args.batch} does not split into {args.microbatches} equal microbatches")
    stages = world_size * args.chunks
    runtime.require(args.layers >= stages, f"{stages} stages ({world_size} ranks x {args.chunks}) but only "
                                           f"{args.layers} layers: every stage needs at least one layer (--layers)")
    runtime.require(args.planted_bug != "loss-on-wrong-stage"
                    or stages - 1 not in stage_indices(args.schedule, 0, world_size, args.chunks),
                    f"--planted-bug loss-on-wrong-stage: under {args.schedule} rank 0 holds the last stage too, "
                    "so the loss it reads is right: plant it under a schedule whose last stage is elsewhere")
    runtime.require(args.planted_bug != "stage-grad-norm" or args.max_grad_norm is not None,
                    "--planted-bug stage-grad-norm clips the gradients: it needs --max-grad-norm")


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=4)
    p.add_argument("--schedule", default="1F1B", help=f"torch's schedule: {schedule_help()}")
    p.add_argument("--microbatches", type=runtime.positive_int, default=8, help="M, microbatches per step")
    p.add_argument("--stages-per-rank", type=runtime.positive_int, default=None,
                   help="V, stages per rank (interleaved schedules; default: the schedule's own)")
    add_training_flags(p)  # --batch --layers --lr --reference
    p.add_argument("--max-grad-norm", type=runtime.positive_float, default=None,
                   help="clip the gradients to this total norm, the whole model's, before each update (and the "
                        "single-device run's with clip_grad_norm_)")
    p.add_argument("--planted-bug", choices=["loss-on-wrong-stage", "stage-grad-norm"], default=None,
                   help="a mistake the checks must catch: the loss read on rank 0, whose first stage computes none; "
                        "with --max-grad-norm, torch.nn.utils.clip_grad_norm_ on each rank's own stages (the norm of "
                        "those stages alone)")
    runtime.add_fix_flag(p, "loss_rank(stage_ranks) (the rank whose losses to read, given the rank of each stage), "
                            "clip_gradients(parameters, max_norm) (with --max-grad-norm: clip this rank's stages' "
                            "gradients, in place, to the whole model's total norm max_norm; return that norm)")
    args = p.parse_args()
    cfg = resolve_training_flags(args)
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        from torch.distributed.pipelining import PipelineStage

        fixes = runtime.learner_fixes(args.fix_from, ("loss_rank", "clip_gradients"))   # chapter 14's lab
        rt.require(not (fixes and args.planted_bug), "--fix-from replaces the choice --planted-bug breaks")

        ranks, chunks, microbatches = rt.world_size, args.chunks, args.microbatches
        num_stages = ranks * chunks
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})
        mine = stage_indices(args.schedule, rt.rank, ranks, chunks)
        rt.print(f"{args.schedule}: {cfg.n_layers} layers in {num_stages} stages "
                 + ", ".join(f"{s}:{layers_of_stage(cfg.n_layers, num_stages, s)}" for s in range(num_stages))
                 + f"; rank r holds stages {[stage_indices(args.schedule, r, ranks, chunks) for r in range(ranks)]}")

        with_reference = args.reference
        full = models.build_transformer(cfg, seed=args.seed)          # on the CPU: only a stage goes to the device
        modules = {s: transformer_stage(full, s, num_stages).to(rt.device) for s in mine}
        stages = [PipelineStage(modules[s], s, num_stages, rt.device) for s in mine]
        events = []
        for stage in stages:
            record_actions(stage, events, rt.sync)
        schedule = torch_schedule(args.schedule, stages, microbatches, loss_fn=models.lm_loss)
        optimizer = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=args.lr)
        first_here, last_here = 0 in mine, num_stages - 1 in mine

        reference = reference_optimizer = None
        if with_reference and rt.is_main:   # the single-device run, in lockstep
            reference = full.to(rt.device)
            reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=args.lr)
        else:
            del full

        losses, reference_losses, step_seconds = [], [], []
        rank_grad_norms, one_device_grad_norms = [], []   # --max-grad-norm: the norm each rank computed, per step
        param_diffs = []   # --max-grad-norm: the weights' largest distance from one device's after each step
        mine_params = [p for m in modules.values() for p in m.parameters()]
        first_grads = reference_first_grads = None
        for step in range(args.steps):
            tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed).to(rt.device)
            inputs, targets = data.split_inputs_targets(tokens)
            events.clear()
            rt.sync()
            dist.barrier()
            t0 = time.perf_counter()
            step_losses = [] if last_here else None
            # return_outputs=False: else the last stage keeps every microbatch's logits until the next step
            # (torch 2.13 pipelining/schedules.py:745, stage.py:907-908); the losses come back in step_losses
            schedule.step(*((inputs,) if first_here else ()), return_outputs=False,
                          **(dict(target=targets, losses=step_losses) if last_here else {}))
            if step == 0 and with_reference:
                first_grads = {n: p.grad.detach().cpu().clone() for m in modules.values()   # before any clip
                               for n, p in m.named_parameters()}
            if args.max_grad_norm is not None:
                if args.planted_bug == "stage-grad-norm":   # the mistake: torch's clip on this rank's stages alone,
                    # plain tensors, so the norm is theirs, not the whole model's, and each rank scales by its own
                    norm = torch.nn.utils.clip_grad_norm_(mine_params, args.max_grad_norm).item()
                else:
                    norm = float(fixes.get("clip_gradients", clip_whole_model)(mine_params, args.max_grad_norm))
                each = [None] * ranks
                dist.all_gather_object(each, norm)   # what each rank's log would print
                rank_grad_norms.append(each)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            rt.sync()                       # on a GPU, wait for the step's kernels before reading the clock
            step_seconds.append(time.perf_counter() - t0)
            losses.append(torch.stack(step_losses).mean().item() if last_here else None)
            if args.planted_bug == "loss-on-wrong-stage" and rt.rank == 0:  # the mistake: the loss read on rank 0,
                losses[-1] = torch.tensor(step_losses or []).mean().item()  # the first stage: no loss there, nan
            if reference is not None:
                loss = models.lm_loss(reference(inputs), targets)
                loss.backward()
                if step == 0:
                    reference_first_grads = {n: p.grad.detach().cpu().clone() for n, p in reference.named_parameters()}
                if args.max_grad_norm is not None:
                    one_device_grad_norms.append(
                        torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm).item())
                reference_optimizer.step()
                reference_optimizer.zero_grad(set_to_none=True)
                reference_losses.append(loss.item())
            if with_reference and args.max_grad_norm is not None:   # when a clip moves the weights from one device's
                stages_now = [None] * ranks
                dist.all_gather_object(stages_now, {n: p.detach().cpu() for m in modules.values()
                                                    for n, p in m.named_parameters()})
                if reference is not None:
                    now = dict(reference.named_parameters())
                    param_diffs.append(max((t - now[n].detach().cpu()).abs().max().item()
                                           for g in stages_now for n, t in g.items()))
        report.timeline = gather_timeline(events, t0, rt.rank)

        # Bring the losses (on the last stage's rank) and every stage's parameters to rank 0.
        mine_state = {name: p.detach().cpu() for m in modules.values() for name, p in m.named_parameters()} \
            if with_reference else {}
        gathered = [None] * ranks
        dist.all_gather_object(gathered, {"losses": losses, "params": mine_state, "grads": first_grads,
                                          "last": last_here})
        losses = next(g["losses"] for g in gathered if g["losses"][0] is not None)
        if "loss_rank" in fixes:   # the losses of the rank the learner's loss_rank() names: nan where it computed none
            stage_ranks = [next(r for r in range(ranks) if s in stage_indices(args.schedule, r, ranks, chunks))
                           for s in range(num_stages)]
            read = fixes["loss_rank"](stage_ranks)
            rt.print(f"loss_rank({stage_ranks}) = {read!r}")
            named = gathered[read]["losses"] if isinstance(read, int) and 0 <= read < ranks else None
            losses = [float("nan") if x is None else x for x in (named or [None] * args.steps)]
        report.extra["last_stage_losses"] = next(g["losses"] for g in gathered if g["last"])   # where they are made
        report.losses = losses
        timed = step_seconds[1:] or step_seconds   # the first step pays one-off costs: left out
        report.throughput = {**metrics.throughput(args.batch * cfg.seq_len, sum(timed), len(timed), cfg=cfg,
                                                  device=rt.device, dtype="fp32", num_devices=ranks),
                             "step_seconds": step_seconds}
        if rt.is_main:
            if with_reference:
                pipeline_grads = {name: t for g in gathered for name, t in g["grads"].items()}
                pipeline_params = {name: t for g in gathered for name, t in g["params"].items()}
                names = sorted(n for n, _ in reference.named_parameters())
                reference_params = dict(reference.named_parameters())
                report.check("the stages' parameter names are the full model's", sorted(pipeline_params) == names,
                             f"{len(pipeline_params)} names", f"{len(names)} names")
                report.check_close("losses equal the single-device run's", losses, reference_losses,
                                   metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
                report.check_close("first step's gradients equal the single-device run's",
                                   [pipeline_grads[n] for n in names], [reference_first_grads[n] for n in names],
                                   metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))
                report.check_close("parameters after training equal the single-device run's",
                                   [pipeline_params[n] for n in names],
                                   [reference_params[n].detach().cpu() for n in names], args.lr / 10)
                print(f"losses   pipeline: {' '.join(f'{x:.5f}' for x in losses)}\n"
                      f"    single device: {' '.join(f'{x:.5f}' for x in reference_losses)}")
            report.check("the loss fell", losses[-1] < losses[0] or args.steps == 1, losses[-1] - losses[0], "< 0")
        if args.max_grad_norm is not None:   # what any user's log shows: each rank's gradient norm
            report.extra["rank_grad_norms"] = rank_grad_norms
            report.extra["one_device_grad_norms"] = one_device_grad_norms
            report.extra["param_diffs"] = param_diffs
            report.check("every rank computed the same gradient norm (every step)",
                         all(max(norms) - min(norms) <= 1e-5 * max(norms) for norms in rank_grad_norms),
                         max(max(norms) - min(norms) for norms in rank_grad_norms), "<= 1e-5 of the norm")
        report.extra.update(
            schedule=args.schedule,
            stages_of_rank={r: stage_indices(args.schedule, r, ranks, chunks) for r in range(ranks)},
            layers_of_stage={s: layers_of_stage(cfg.n_layers, num_stages, s) for s in range(num_stages)})
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
