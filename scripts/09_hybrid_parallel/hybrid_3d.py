"""PP x FSDP x TP on one 3-D DeviceMesh ("pp", "dp", "tp"): the shared transformer, equal to one device.

    init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))     # tp innermost

tp is the innermost dimension, so a TP group is tp consecutive ranks: on one node, where its all-reduces
(four per block and microbatch) run over NVLink. dp groups come next (FSDP's all-gathers and reduce-scatters,
once per step), pp outermost (one activation per microbatch and stage boundary: the lightest traffic, the
one that may cross the slowest links). Each rank:

1. cuts its pipeline stage(s) out of the whole model (chapter 07: contiguous blocks, embeddings first, head last);
2. applies tensor parallelism inside the stage over ``mesh["tp"]`` (chapter 06's plan,
   ``distlab.tensor_parallel.transformer_tp_plan``), *then* FSDP2 over ``mesh["dp"]`` (chapter 05's units: each
   block, then the stage): FSDP shards the TP shards, so it must see them, as torchtitan composes it.
   The head gathers its vocabulary-split logits (``ColwiseParallel(output_layouts=Replicate())``) instead of
   keeping them split for ``loss_parallel``: in a pipeline torch's schedule computes the loss and runs the
   backward, outside any context we could open around them;
3. wraps the stage in a ``PipelineStage`` on ``mesh["pp"]`` and runs ``--schedule``.

Each dp replica trains on its rows of the global batch, split into M microbatches; every TP rank of a replica
sees the same rows. The script proves, against a single-device run built independently from the same seed:
losses every step, gradients at step 0, parameters at the end. It measures, each = formula
(``distlab.hybrid_pipeline``): the bytes of every mesh dimension (pp sends, FSDP all-gathers and reduce-scatters
over dp, TP all-reduces and all-gathers), and parameters, gradients and AdamW state per rank. The measured
timeline of the pipeline dimension (the ranks with dp = tp = 0, one per stage) is in the metrics ``timeline``
(ASCII Gantt chart here; PNG with ``--plot FILE``).

A checkpoint that changes layout: ``--save-after N --checkpoint-dir DIR`` writes a DCP checkpoint (model and
AdamW state, under the whole model's parameter names) after N steps; ``--resume DIR`` starts another job, in any
other layout, from the latest complete one and runs on to ``--steps``. Its losses, first gradients and final
parameters are compared with the single-device run that never stopped: what a user does when a job moves to
another allocation (8 ranks, then 4):

    torchrun --standalone --nproc_per_node=8 scripts/09_hybrid_parallel/hybrid_3d.py --pp 2 --dp 2 --tp 2 \
        --steps 4 --save-after 2 --checkpoint-dir runs/3d
    torchrun --standalone --nproc_per_node=4 scripts/09_hybrid_parallel/hybrid_3d.py --pp 1 --dp 2 --tp 2 \
        --steps 4 --resume runs/3d

``--config FILE.json`` loads a run's settings (flags given override it); the reference layouts are in
``scripts/09_hybrid_parallel/configs/``. Every run writes its resolved configuration into its metrics.

    torchrun --standalone --nproc_per_node=4 scripts/09_hybrid_parallel/hybrid_3d.py --pp 2 --dp 1 --tp 2
    torchrun --standalone --nproc_per_node=8 scripts/09_hybrid_parallel/hybrid_3d.py --pp 2 --dp 2 --tp 2
    mpiexec -n 16 --ppn 4 python scripts/09_hybrid_parallel/hybrid_3d.py \\
        --config scripts/09_hybrid_parallel/configs/hybrid_3d_16gpus.json
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from common_hybrid_pipeline import (GRAD_TOLERANCE, add_hybrid_flags, check_against_single_device,
                                    check_hybrid_config, full_named, gather_named, parse_with_config,
                                    pipeline_stage_class, replica_batch, replica_losses, resolved_config,
                                    single_device_run, warn_if_tp_crosses_nodes)
from common_pipeline import gather_timeline, record_actions, stage_indices, torch_schedule, transformer_stage
from distlab import (checkpointing, comm, gantt, hybrid, hybrid_pipeline, memory, metrics, models, runtime,
                     tensor_parallel)


def stage_tp_plan(stage_module, gather_logits: bool = True) -> dict:
    """Chapter 06's plan, for the modules this stage has; the head gathers its logits (see the docstring), or,
    with ``gather_logits=False``, keeps them split for ``loss_parallel`` as chapter 06 does."""
    plan = tensor_parallel.transformer_tp_plan()
    if gather_logits:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    present = {name for name, child in stage_module.named_children() if child is not None}
    return {pattern: style for pattern, style in plan.items() if pattern.split(".")[0] in present}


def parallelize_stage(module, args, mesh, last: bool = False):
    """TP inside the stage, then FSDP2 over dp; a dimension of size 1 is left out (nothing to split), except
    that a bf16 run keeps FSDP over one rank for its mixed-precision policy (no traffic, one rule for every
    shape: bf16 weights computed, fp32 gradients, fp32 weights for AdamW)."""
    if args.tp > 1:
        parallelize_module(module, mesh["tp"], stage_tp_plan(module))
    # FSDP's mesh: dp, or (replicate, dp) where the mesh has replicas (HSDP: the planner's dry run builds one)
    fsdp_mesh = mesh["replicate", "dp"] if "replicate" in (mesh.mesh_dim_names or ()) else mesh["dp"]
    if args.dp > 1 or args.precision == "bf16":
        # Gathered for the whole step (reshard_after_forward=False): under PP, resharding after each forward
        # would all-gather again for every microbatch. torch's schedule reduce-scatters once, after the last.
        # Stages hand bf16 activations to each other; the last stage hands fp32 logits to the loss.
        for block in module.layers.values():
            fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=False,
                        mp_policy=hybrid.mixed_precision_policy(args.precision))
        fully_shard(module, mesh=fsdp_mesh, reshard_after_forward=False,
                    mp_policy=hybrid.mixed_precision_policy(args.precision, root=last))
    return module


def check_checkpoint_flags(args, cfg) -> None:
    """Every rank, before the process group forms (the folders are on a file system every node sees)."""
    args.first_step, args.resumed_from, args.saved_by = 0, None, None
    if args.save_after is not None:
        runtime.require(args.checkpoint_dir is not None, "--save-after needs --checkpoint-dir DIR")
        runtime.require(args.save_after <= args.steps, f"--save-after {args.save_after}: the run has only "
                                                       f"--steps {args.steps}")
        target = checkpointing.checkpoint_dir(args.checkpoint_dir, args.save_after)
        runtime.require(not target.exists(), f"{target} exists; choose another --checkpoint-dir (a checkpoint is "
                                             f"never overwritten)")
    runtime.require(args.resume is not None or not args.resume_weights_only, "--resume-weights-only needs --resume DIR")
    if args.resume is not None:
        latest = checkpointing.latest_checkpoint(args.resume)
        runtime.require(latest is not None, f"--resume {args.resume}: no complete checkpoint (step_N/.metadata) there")
        args.first_step, args.resumed_from = checkpointing.step_of(latest), latest
        runtime.require(args.steps - args.first_step >= 2,
                        f"--steps {args.steps}: the checkpoint holds {args.first_step} steps; run at least 2 more "
                        f"(the second is the one measured)")
        layout = latest / "layout.json"
        args.saved_by = json.loads(layout.read_text()) if layout.exists() else None
        if args.saved_by is not None:   # another model would fail inside DCP with a shape, or load half of itself
            runtime.require(args.saved_by["model"] == cfg.to_dict(),
                            f"--resume {args.resume}: the checkpoint holds another model "
                            f"({hybrid.config_difference(args.saved_by['model'], cfg.to_dict())})")


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=3)
    add_hybrid_flags(p, pp=2, tp=True)
    p.add_argument("--plot", metavar="FILE", default=None, help="write the measured Gantt chart as a PNG")
    p.add_argument("--clip-grad-norm", type=runtime.positive_float, default=None, metavar="MAX",
                   help="clip the gradients to this total norm over every stage, dp and tp shard (as one device "
                        "would), each step")
    p.add_argument("--save-after", type=runtime.positive_int, default=None, metavar="N",
                   help="write a DCP checkpoint after N steps, into --checkpoint-dir")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="where --save-after writes (DIR/step_N; never overwritten)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="start from the latest complete checkpoint in DIR, saved in this or any other layout")
    p.add_argument("--resume-weights-only", action="store_true",
                   help="the mistake: load the weights but not AdamW's state (the check against one device fails)")
    args, cfg = parse_with_config(p, __file__)

    def validate(world):
        check_hybrid_config(args, cfg, world)
        check_checkpoint_flags(args, cfg)

    with runtime.start(args, validate=validate) as rt:
        pp, dp, tp, chunks, microbatches = args.pp, args.dp, args.tp, args.chunks, args.microbatches
        num_stages = pp * chunks
        report = metrics.Report(__file__, rt, config=resolved_config(args, cfg, rt.world_size))
        report.extra["warnings"] = warn_if_tp_crosses_nodes(rt, args)
        rows = args.batch // (dp * microbatches)
        rt.print(f"3-D mesh (pp, dp, tp) = ({pp}, {dp}, {tp}) on {rt.world_size} ranks: {args.schedule}, "
                 f"{num_stages} stages of {cfg.n_layers // num_stages} blocks; {dp} replicas x {microbatches} "
                 f"microbatches of {rows} sequences; each block split over {tp} TP ranks")

        # 1. The single-device answer (rank 0; tiny), from the seed alone.
        reference = single_device_run(cfg, args, rt.device) if args.reference and rt.is_main else None

        # 2. The mesh and this rank's place in it.
        mesh = init_device_mesh(rt.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(dim) for dim in ("pp", "dp", "tp"))
        # every rank's groups as the mesh made them, against the grid arithmetic (a mesh built in another order
        # would still train correctly and pass every numeric check, with its groups across the nodes)
        wrong = hybrid.every_rank_agrees(hybrid.mesh_group_problems(mesh, rt.rank, (pp, dp, tp)))
        report.check("every rank's groups, read from the mesh, = distlab.hybrid's grid", not wrong,
                     "; ".join(wrong[:2]) or "all agree", "pp x dp x tp, last innermost")
        mine = stage_indices(args.schedule, pp_rank, pp, chunks)

        # 3. Stages: cut, TP, FSDP, then pipeline stages on the pp group.
        full = models.build_transformer(cfg, seed=args.seed)
        modules = {s: parallelize_stage(transformer_stage(full, s, num_stages).to(rt.device), args, mesh,
                                        last=s == num_stages - 1)
                   for s in mine}
        del full
        Stage = pipeline_stage_class()
        stages = [Stage(modules[s], s, num_stages, rt.device, group=mesh.get_group("pp")) for s in mine]
        events = []
        for stage in stages:
            record_actions(stage, events, rt.sync)
        schedule = torch_schedule(args.schedule, stages, microbatches, loss_fn=models.lm_loss)
        optimizer = torch.optim.AdamW([p for m in modules.values() for p in m.parameters()], lr=args.lr)
        first_here, last_here = 0 in mine, num_stages - 1 in mine
        # what a checkpoint holds: this rank's stages under the whole model's names, each tensor as sharded here
        training = checkpointing.TrainingState(checkpointing.StagesOfRank(modules.values()), optimizer)
        layout = {"pp": pp, "dp": dp, "tp": tp, "world_size": rt.world_size, "schedule": args.schedule,
                  "model": cfg.to_dict()}
        if args.resumed_from is not None:
            if args.resume_weights_only:
                checkpointing.load_weights_only(training.model, args.resumed_from)
                training.step = args.first_step
            else:
                checkpointing.load(training, args.resumed_from)   # DCP reshards every tensor into this layout
            saved_by = args.saved_by or {}
            rt.print(f"resumed from {args.resumed_from} ({training.step} steps done), saved by (pp, dp, tp) = "
                     f"({saved_by.get('pp')}, {saved_by.get('dp')}, {saved_by.get('tp')}) on "
                     f"{saved_by.get('world_size')} ranks; now ({pp}, {dp}, {tp}) on {rt.world_size}")
            report.extra["resumed"] = {"from": str(args.resumed_from), "step": training.step, "saved_by": saved_by,
                                       "layout": layout}

        # 4. Train; step 1 is measured (step 0 also infers the shapes passed between stages).
        step_losses, first_grads, measured, state, grad_norms = [], {}, {}, None, []
        clock = metrics.StepClock(rt.sync)   # the whole step: schedule, clipping, optimizer (MFU's one definition)
        first = args.first_step
        for step in range(first, args.steps):
            inputs, targets = replica_batch(step, args, cfg, dp_rank, rt.device)
            events.clear()
            dist.barrier()
            t0 = clock.start()
            losses = [] if last_here else None
            with comm.CommCounter() as counter:
                # return_outputs=False: else the last stage keeps every microbatch's logits until the next step
                # (torch 2.13 pipelining/schedules.py:745, stage.py:907-908); the losses come back in losses
                schedule.step(*((inputs,) if first_here else ()), return_outputs=False,
                              **(dict(target=targets, losses=losses) if last_here else {}))
            if step == first and args.reference:   # the first step is not timed: its gradients, gathered whole
                first_grads = {n: g for m in modules.values() for n, g in full_named(m, grads=True).items()}
            if args.clip_grad_norm is not None:  # the total norm over pp x dp x tp, the same on every rank
                norm = hybrid_pipeline.clip_grad_norm_([p for m in modules.values() for p in m.parameters()],
                                                       args.clip_grad_norm, pp_group=mesh.get_group("pp"))
            optimizer.step()
            clock.stop()
            step_losses.append(torch.stack(losses).mean().item() if last_here else None)
            if args.clip_grad_norm is not None:
                grad_norms.append(norm.item())
            if step == first + 1:
                state = memory.ledger(torch.nn.ModuleList(modules.values()), optimizer)
                measured = hybrid_pipeline.bytes_by_dimension(counter.calls)
                # the pipeline dimension of one replica: the ranks with dp = tp = 0, one row per pp rank
                report.timeline = gather_timeline(events if dp_rank == 0 and tp_rank == 0 else [], t0, pp_rank)
            optimizer.zero_grad(set_to_none=True)
            if args.save_after == step + 1:
                training.step = step + 1
                where = checkpointing.save(training, args.checkpoint_dir)
                if rt.is_main:   # which layout wrote it, for the job that resumes (DCP itself does not need it)
                    (where / "layout.json").write_text(json.dumps(layout))
                rt.print(f"saved {where} after {step + 1} steps")
                report.extra["saved"] = {"to": str(where), "step": step + 1, "layout": layout}
        report.losses = replica_losses(step_losses, last_here, tp_rank == 0)
        rt.print("losses: " + " ".join(f"{x:.5f}" for x in report.losses))

        # 5. Everything to every rank: one rank per stage (dp = tp = 0) reports the whole stage's tensors.
        stage_report = dp_rank == 0 and tp_rank == 0
        if args.reference:   # whole tensors, for the comparison only (an a100 run has no reference)
            params_now = {n: t for m in modules.values() for n, t in full_named(m).items()}   # collectives
            all_params = gather_named(params_now if stage_report else {})
            all_first_grads = gather_named(first_grads if stage_report else {})
        everything = [None] * rt.world_size
        dist.all_gather_object(everything, {"rank": rt.rank, "coordinates": {"pp": pp_rank, "dp": dp_rank,
                                                                             "tp": tp_rank},
                                            "stages": mine, "measured": measured, "state": state.as_dict()})

        # ---- checks: one device ----
        if reference is not None:
            check_against_single_device(report, reference, all_params, all_first_grads, args.lr, first, args.precision)
            if args.clip_grad_norm is not None:
                report.check_close("the total gradient norm over pp x dp x tp = one device's (every step)",
                                   grad_norms, reference["grad_norms"][first:], GRAD_TOLERANCE)
                report.extra["grad_norms"] = grad_norms

        # ---- checks: bytes per mesh dimension and memory per rank, every rank against the formulas ----
        number_bytes = hybrid.precision_bytes(args.precision)   # bf16: activations and weights 2, gradients 4
        activation_bytes = number_bytes["bytes_per_element"]

        def expected_for(stages_of_rank):
            """What a rank holding these stages should send per step, per dimension, and hold."""
            held = sum(hybrid_pipeline.stage_param_count(cfg, s, num_stages, tp)["total"] for s in stages_of_rank)
            expected = {"pp": {"send": hybrid_pipeline.pp_send_bytes(stages_of_rank, num_stages, microbatches, rows,
                                                                     cfg.seq_len, cfg.dim, activation_bytes)}
                        if pp > 1 else {}}
            expected["dp"] = hybrid_pipeline.dp_gradient_sync_bytes(held, microbatches, "fsdp", False,
                                                                    **number_bytes) if dp > 1 else {}
            tp_bytes = {"all_reduce": 0, "all_gather": 0}
            for s in stages_of_rank:
                for collective, value in hybrid_pipeline.tp_stage_comm_bytes(
                        cfg, cfg.n_layers // num_stages, s == 0, s == num_stages - 1, microbatches, rows,
                        cfg.seq_len, activation_bytes).items():
                    tp_bytes[collective] += value
            expected["tp"] = {k: v for k, v in tp_bytes.items() if v} if tp > 1 else {}
            state_bytes = {"params": 4 * held // dp, "grads": 4 * held // dp, "optimizer": 8 * held // dp}
            if 0 in stages_of_rank and tp > 1 and dp == 1 and args.precision == "fp32":
                # Measured, torch 2.13: the gradient of the vocabulary-split embedding (RowwiseParallel) comes
                # back whole (Replicate) on every TP rank, not split like its weight. FSDP (dp > 1) hands each
                # rank a shard in the weight's layout, so there the gradient is the weight's size again.
                state_bytes["grads"] += 4 * cfg.vocab_size * cfg.dim * (tp - 1) // tp
            return expected, state_bytes

        wrong = {"pp": [], "dp": [], "tp": [], "memory": []}
        for r in everything:
            expected, state_bytes = expected_for(r["stages"])
            for dim in ("pp", "dp", "tp"):
                if r["measured"].get(dim, {}) != expected[dim]:
                    wrong[dim].append((r["rank"], r["measured"].get(dim, {}), expected[dim]))
            if any(r["state"][k] != v for k, v in state_bytes.items()):
                wrong["memory"].append((r["rank"], r["state"], state_bytes))
        my_expected, _ = expected_for(mine)
        for dim in ("pp", "dp", "tp"):
            for collective, analytic in my_expected[dim].items():
                report.add_comm(collective, measured.get(dim, {}).get(collective, 0), analytic, dimension=dim)
        for dim, what in (("pp", "activations and their gradients sent between stages"),
                          ("dp", "FSDP all-gather and reduce-scatter, once per step"),
                          ("tp", "TP all-reduces and the head's all-gather, every microbatch")):
            size = {"pp": pp, "dp": dp, "tp": tp}[dim]
            report.check(f"{dim} bytes per step = formula: {what} (every rank)"
                         + ("" if size > 1 else f"; {dim} = 1: none"), not wrong[dim], wrong[dim] or "all ranks",
                         "== distlab.hybrid_pipeline formula")
        report.check("parameters, gradients, AdamW state per rank = the stage's / tp (matrices) / dp (every rank)",
                     not wrong["memory"], wrong["memory"] or "all ranks", "== 4 / 4 / 8 bytes per parameter held")
        report.memory = {"measured": everything[rt.rank]["state"],
                         "per_rank": {r["rank"]: r["state"] for r in everything}}
        report.check_equal("the timeline has one row per pipeline rank and every F and B of every microbatch, once",
                           sorted((e["rank"], e["stage"], e["microbatch"], e["kind"]) for e in report.timeline
                                  if e["kind"] in ("F", "B")),
                           sorted((r, s, m, k) for r in range(pp) for s in stage_indices(args.schedule, r, pp, chunks)
                                  for m in range(microbatches) for k in ("F", "B")))
        report.extra.update(schedule=args.schedule, coordinates={r["rank"]: r["coordinates"] for r in everything},
                            stages_of_pp_rank={r: stage_indices(args.schedule, r, pp, chunks) for r in range(pp)},
                            bytes_by_dimension={r["rank"]: r["measured"] for r in everything})
        report.throughput = clock.throughput(args.batch * cfg.seq_len, cfg=cfg, device=rt.device,
                                             num_devices=rt.world_size,
                                             dtype=args.precision)   # MFU against the peak of the dtype used
        if rt.is_main:
            print(gantt.ascii_gantt(report.timeline, title=f"measured {args.schedule}, pipeline dimension "
                                                           f"(ranks with dp = tp = 0), step 1", time_unit="s"))
            if args.plot:
                gantt.save_gantt_png(report.timeline, args.plot, title=f"measured {args.schedule}, (pp, dp, tp) = "
                                                                        f"({pp}, {dp}, {tp})", time_unit="s")
                print(f"wrote {args.plot}")
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
