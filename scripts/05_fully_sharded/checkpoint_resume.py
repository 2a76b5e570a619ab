"""Distributed checkpoints (DCP): save a sharded model and optimizer, resume after an interruption, reshard.

With FSDP no rank holds the whole model, so no rank can write it alone. ``torch.distributed.checkpoint``
has every rank write its own shards, plus one metadata file that says which piece of which tensor is where.
Loading reads that map: the job that loads may have another number of ranks (the pieces are cut again).

Three ways to run it, one checkpoint folder (``--save-dir``):

1. train, checkpoint every ``--save-every`` steps, and stop early with ``--stop-after`` (the interruption:
   the steps after the last checkpoint are lost);
2. ``--resume``: load the latest checkpoint and train on to ``--steps``. The steps trained again repeat the
   interrupted run's losses exactly, and every loss equals an uninterrupted single-device run's;
3. ``--world-size-check``: load the latest checkpoint with another number of ranks (written by 4, read by
   2) and compare the model and the optimizer state with the full copy saved beside it: exactly equal.

    torchrun --standalone --nproc_per_node=4 scripts/05_fully_sharded/checkpoint_resume.py --stop-after 3
    torchrun --standalone --nproc_per_node=4 scripts/05_fully_sharded/checkpoint_resume.py --resume
    torchrun --standalone --nproc_per_node=2 scripts/05_fully_sharded/checkpoint_resume.py --world-size-check
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from common_fully_sharded import LOSS_TOLERANCE, Baseline, param_tolerance
from distlab import data, metrics, models, runtime
from distlab.checkpointing import TrainingState  # model and optimizer shards, and the step count
from train_fsdp import PRESETS, apply_fsdp, full_parameters, materialize_on_meta

DEFAULT_SAVE_DIR = "runs/05_fully_sharded/checkpoints"
ONE_RANKS_MODEL = "model_from_rank0.pt"   # --planted-bug checkpoint-one-shard's file
LEARNERS_MODEL = "model_full_from_shards.pt"   # --fix-from's file: the parameters the learner's code made whole


def checkpoints(save_dir) -> list[Path]:
    return sorted(Path(save_dir).glob("step_*/.metadata"))


def latest_checkpoint(save_dir) -> Path:
    return checkpoints(save_dir)[-1].parent


def check_config(args, world_size):
    runtime.require(args.save_every >= 1, f"--save-every {args.save_every}: must be at least 1")
    runtime.require(args.batch % world_size == 0, f"--batch {args.batch} does not split over {world_size} ranks")
    runtime.require(not (args.resume and args.world_size_check), "--resume and --world-size-check exclude each other")
    found = checkpoints(args.save_dir)
    if args.resume or args.world_size_check:
        runtime.require(bool(found), f"no checkpoint in {args.save_dir}: train without --resume first")
    else:
        runtime.require(not found, f"{args.save_dir} already holds checkpoints "
                                   f"({', '.join(f.parent.name for f in found)}): pass --resume to continue, "
                                   "or a fresh --save-dir")
    if args.planted_bug == "checkpoint-one-shard" and (args.resume or args.world_size_check):
        one = latest_checkpoint(args.save_dir) / ONE_RANKS_MODEL   # rank 0's shards, shaped for its world size
        runtime.require(one.exists(), f"{one} is missing: train with --planted-bug checkpoint-one-shard first")
        written_by = json.loads(one.parent.with_suffix(".json").read_text())["world_size"]
        runtime.require(written_by == world_size, f"--planted-bug checkpoint-one-shard: rank 0's shards of a "
                                                  f"{written_by}-rank run fit {written_by} ranks, not {world_size}")
    fixes = runtime.learner_fixes(args.fix_from, ("full_from_shards",))
    runtime.require(not (fixes and args.planted_bug), "--fix-from replaces the saving --planted-bug breaks")
    if fixes and (args.resume or args.world_size_check):
        mine = latest_checkpoint(args.save_dir) / LEARNERS_MODEL
        runtime.require(mine.exists(), f"{mine} is missing: train with the same --fix-from first")
    if args.world_size_check:
        full = latest_checkpoint(args.save_dir).with_suffix(".full.pt")
        runtime.require(full.exists(), f"{full} is missing: the full copy is written with tiny models only")
    if args.stop_after is not None:
        runtime.require(0 < args.stop_after < args.steps,
                        f"--stop-after {args.stop_after} must be between 1 and --steps - 1 ({args.steps - 1})")


def full_state(model, optimizer) -> dict:
    """The whole model and optimizer state on rank 0's CPU (a collective: every rank calls it)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def flat_tensors(state, prefix="") -> dict:
    """Every tensor of a nested state dict, keyed by its path (to compare two states entry by entry)."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        out = {}
        for key, value in state.items():
            out.update(flat_tensors(value, f"{prefix}/{key}"))
        return out
    if isinstance(state, (list, tuple)):
        out = {}
        for i, value in enumerate(state):
            out.update(flat_tensors(value, f"{prefix}/{i}"))
        return out
    return {prefix: torch.tensor(float(state))} if isinstance(state, (int, float)) else {}


def compare_states(report, name, loaded, saved) -> None:
    loaded, saved = flat_tensors(loaded), flat_tensors(saved)
    report.check(f"{name}: same entries", sorted(loaded) == sorted(saved), len(loaded), f"== {len(saved)}")
    if sorted(loaded) == sorted(saved):
        report.check_close(f"{name}: every value equal (exact)", [loaded[k] for k in sorted(saved)],
                           [saved[k] for k in sorted(saved)], tolerance=0.0)


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=6)
    p.add_argument("--save-dir", default=DEFAULT_SAVE_DIR, help=f"checkpoint folder (default {DEFAULT_SAVE_DIR})")
    p.add_argument("--save-every", type=runtime.positive_int, default=2, help="checkpoint after every K steps")
    p.add_argument("--stop-after", type=runtime.positive_int, default=None, metavar="S",
                   help="simulate an interruption: stop after S steps (the steps since the last checkpoint are lost)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--world-size-check", action="store_true",
                   help="load the latest checkpoint on this number of ranks and compare with the full copy")
    p.add_argument("--batch", type=runtime.positive_int, default=8, help="global batch, sequences per step")
    runtime.add_lr_flag(p)
    p.add_argument("--planted-bug", choices=["checkpoint-one-shard"], default=None,
                   help="a mistake the checks must catch: rank 0 saves the model it holds (one shard of each weight) "
                        "with torch.save beside the checkpoint, and --resume copies that file into every rank's own shards")
    runtime.add_fix_flag(p, "full_from_shards(shards) (a parameter whole again from its FSDP shards, rank 0's first): "
                            "every rank gathers its shards, rank 0 saves the learner's whole parameters beside the "
                            "checkpoint, and --resume gives every rank its rows of them")
    args = p.parse_args()
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = models.preset(PRESETS[args.preset])
        world, tiny = rt.world_size, args.preset == "tiny"
        save_dir = Path(args.save_dir)
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})
        fsdp_options = dict(mixed_precision=not tiny)  # a100: bf16 compute, as in train_fsdp.py
        model = (apply_fsdp(models.build_transformer(cfg, seed=args.seed, device=rt.device), **fsdp_options)
                 if tiny else materialize_on_meta(cfg, args.seed, rt.device, **fsdp_options))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        training = TrainingState(model, optimizer)
        log_file = save_dir / "losses.json"
        earlier_losses = json.loads(log_file.read_text()) if log_file.exists() else {}

        if args.resume or args.world_size_check:
            # DCP reads into the tensors state_dict() returns (for a fresh AdamW, get_state_dict creates them).
            step_dir = latest_checkpoint(save_dir)
            written_by = json.loads(step_dir.with_suffix(".json").read_text())["world_size"]
            dcp.load({"training": training}, checkpoint_id=step_dir)
            if args.planted_bug == "checkpoint-one-shard":   # the mistake, its second half: every rank loads rank 0's
                saved = torch.load(step_dir / ONE_RANKS_MODEL, map_location=rt.device)   # file as if whole: each
                with torch.no_grad():                             # rank's shard becomes rank 0's shard
                    for name, param in model.named_parameters():
                        param.to_local().copy_(saved[name])
            if args.fix_from:   # the learner's whole parameters, saved by rank 0: every rank takes its own rows
                whole = torch.load(step_dir / LEARNERS_MODEL, map_location=rt.device)
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        local, full = param.to_local(), whole.get(name)
                        if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(param.shape):
                            local.zero_()   # not the parameter whole: nothing to take rows of
                            continue
                        rows = torch.chunk(full, world, dim=0)   # FSDP2's rows of dim 0 (fully_shard)
                        if rt.rank < len(rows):
                            local.copy_(rows[rt.rank].reshape(local.shape))
            rt.print(f"loaded {step_dir} (written by {written_by} ranks) on {world} ranks: {training.step} steps done")
            if tiny:
                saved = torch.load(step_dir.with_suffix(".full.pt"), weights_only=False) if rt.rank == 0 else None
                loaded = full_state(model, optimizer)
                if rt.rank == 0:
                    compare_states(report, f"model written by {written_by} ranks, read by {world}",
                                   loaded["model"], saved["model"])
                    compare_states(report, f"optimizer written by {written_by} ranks, read by {world}",
                                   loaded["optimizer"], saved["optimizer"])
            report.extra.update(written_by=written_by, read_by=world, loaded_step=training.step)
        if not args.world_size_check:
            train(args, rt, cfg, model, optimizer, training, report, earlier_losses)
        code = report.finish(args.metrics_out)
    sys.exit(code)


def save_through_learner(path, model, rank, world) -> dict | None:
    """Every rank's shard of every parameter gathered (a collective: on every rank), then made whole on rank 0 by
    the learner's ``full_from_shards(shards)``: {name: what it returned} on rank 0, None elsewhere."""
    join = runtime.learner_fixes(path, ("full_from_shards",))["full_from_shards"]
    whole = {}
    for name, param in model.named_parameters():
        shards = [None] * world
        dist.all_gather_object(shards, param.to_local().detach().cpu())
        if rank == 0:
            whole[name] = join([shard.clone() for shard in shards])
    return whole if rank == 0 else None


def train(args, rt, cfg, model, optimizer, training, report, earlier_losses):
    """Train from ``training.step`` to --stop-after or --steps, checkpointing, and check against the baseline."""
    world, tiny = rt.world_size, args.preset == "tiny"
    save_dir = Path(args.save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    log_file = save_dir / "losses.json"
    # The uninterrupted run to compare with: one device, from step 0 (re-trained up to the resume point).
    baseline = Baseline(cfg, args.seed, args.lr, rt.device) if tiny and rt.rank == 0 else None
    first = training.step
    if baseline is not None:
        for step in range(first):
            baseline.step(data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, args.seed).to(rt.device))

    last = args.stop_after if args.stop_after is not None else args.steps
    losses = {}
    for step in range(first, last):
        # data is a function of the step number: resuming needs nothing but the step count
        tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
        inputs, targets = data.split_inputs_targets(data.shard_rows(tokens, rt.rank, world).to(rt.device))
        loss = models.lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().float().clone()
        dist.all_reduce(global_loss)
        losses[step] = global_loss.item() / world
        training.step = step + 1
        line = f"step {step:3d}  loss {losses[step]:.6f}"
        if baseline is not None:
            baseline.step(tokens.to(rt.device))
            line += f"  uninterrupted single-device {baseline.losses[-1]:.6f}"
        if str(step) in earlier_losses:
            line += f"  (before the interruption: {earlier_losses[str(step)]:.6f})"
        if training.step % args.save_every == 0:
            step_dir = save_dir / f"step_{training.step:06d}"
            dcp.save({"training": training}, checkpoint_id=step_dir)  # every rank writes its own shards
            if args.planted_bug == "checkpoint-one-shard" and rt.rank == 0:   # the mistake (DDP's habit): rank 0
                torch.save({name: param.to_local() for name, param in model.named_parameters()},   # saves the
                           step_dir / ONE_RANKS_MODEL)   # model it holds, under FSDP its own shard of each weight
            if args.fix_from:   # every rank's shard of each parameter, to rank 0: the learner's code joins them
                learners_model = save_through_learner(args.fix_from, model, rt.rank, world)
                if rt.rank == 0:
                    torch.save(learners_model, step_dir / LEARNERS_MODEL)
            full = full_state(model, optimizer) if tiny else None     # a full copy, to check reloads against
            if rt.rank == 0:
                step_dir.with_suffix(".json").write_text(json.dumps({"world_size": world, "step": training.step}))
                if full is not None:
                    torch.save(full, step_dir.with_suffix(".full.pt"))
            line += f"  -> saved {step_dir}"
        rt.print(line)
        if rt.rank == 0:  # the loss log survives the interruption: the resumed run compares against it
            log_file.write_text(json.dumps({**earlier_losses, **{str(s): v for s, v in losses.items()}}))
    report.losses = [losses[s] for s in sorted(losses)]
    report.extra.update(first_step=first, last_step=last, losses_by_step=losses, earlier_losses=earlier_losses,
                        uninterrupted_losses=baseline.losses if baseline is not None else None)

    if args.stop_after is not None:
        lost = last - (last // args.save_every) * args.save_every
        rt.print(f"interrupted after {last} steps: the last checkpoint holds {last - lost}; {lost} step(s) lost")
    params_now = full_parameters(model)
    if baseline is not None:
        steps = sorted(losses)
        report.check_close(f"losses = uninterrupted single-device run (steps {steps[0]}-{steps[-1]})",
                           [losses[s] for s in steps], baseline.losses[first:],
                           metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
        report.check_close("parameters = uninterrupted single-device run", params_now,
                           list(baseline.model.parameters()), param_tolerance(args.lr))
    repeated = [s for s in sorted(losses) if args.resume and str(s) in earlier_losses]
    if repeated:
        exact = 0.0 if rt.device_type == "cpu" else LOSS_TOLERANCE  # GPU kernels need not repeat bitwise
        report.check_close(f"steps trained again after the resume repeat the interrupted run's losses "
                           f"(steps {repeated[0]}-{repeated[-1]})", [losses[s] for s in repeated],
                           [earlier_losses[str(s)] for s in repeated], tolerance=exact)
    if not tiny:
        report.check("losses finite", all(v == v and abs(v) < 1e4 for v in losses.values()))


if __name__ == "__main__":
    main()
