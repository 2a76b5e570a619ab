"""A pipeline over pp ranks, replicated over dp: PP + DDP, or FSDP + PP, on a 2-D mesh ("pp", "dp").

The shared transformer is cut into pp x V stages (chapter 07's cut: contiguous blocks, embeddings on the
first stage, final norm and output projection on the last). Each stage is then made data parallel over the
ranks that hold the same stage (``--dp-mode ddp``: DistributedDataParallel over the mesh's dp group;
``--dp-mode fsdp``: FSDP2 ``fully_shard`` of each block and of the stage over ``mesh["dp"]``), wrapped in a
``PipelineStage`` on the pp group, and run by any schedule of chapter 07 (``--schedule``). Each dp replica
takes its rows of the global batch and splits them into M microbatches.

**Gradients are synchronised over dp once per step, not once per microbatch.** torch's schedules see to
it (``stage.py``, ``backward_maybe_with_nosync``): a DDP stage runs every backward but the last under
``no_sync()``; an FSDP stage runs them with ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)`` and reduce-scatters once, in the REDUCE_GRAD action after the last
microbatch. Done naively (sync in every backward), ZeRO-2/FSDP with PP pays a reduce-scatter per microbatch,
DDP an all-reduce per microbatch: M times the bytes, for the same gradients. The script runs one extra
step each way and measures both, in bytes, against ``distlab.hybrid_pipeline.dp_gradient_sync_bytes``.

**When that sync runs differs.** DDP's buckets all-reduce *during* the stage's last backward (overlapped with
it); FSDP's reduce-scatters wait for REDUCE_GRAD, *after* the stage's last backward (exposed: the optimizer
step waits for them). The measured step times each bucket's launch and each REDUCE_GRAD against the stage's
backward bars and checks both rules on every rank (``hybrid_pipeline.gradient_sync_timing_problems``).
(FSDP keeps each stage's parameters gathered from the first forward to REDUCE_GRAD,
``reshard_after_forward=False``, as torchtitan does under PP: resharding would all-gather them again for
every microbatch.)

It proves, against a single-device run built independently from the same seed on the same global batch:
losses every step, gradients at step 0, parameters at the end; and measures, each = formula: dp bytes per step
(once and per microbatch), pp bytes sent per rank, parameters / gradients / AdamW state per rank.

**What this replaces.** Older tutorials pipeline with ``torch.distributed.pipeline.sync.Pipe`` (torchgpipe's
GPipe, one process driving several GPUs, data parallelism across processes through the RPC framework).
That module was deprecated in PyTorch 2.3 (pytorch/pytorch#121464) and removed in 2.4
(pytorch/pytorch#127354, June 2024); ``import torch.distributed.pipeline`` fails from 2.4 on (checked below,
on the torch that runs this). Its replacement, new in 2.4 and grown from PiPPy, is
``torch.distributed.pipelining``: one process per stage-holding rank, a ``PipelineStage`` per model chunk,
schedules as objects (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, zero-bubble ones),
point-to-point sends instead of RPC, and composition with DDP / FSDP2 / DTensor on a DeviceMesh, as here.

    torchrun --standalone --nproc_per_node=4 scripts/09_hybrid_parallel/pp_dp_hybrid.py --dp-mode ddp
    torchrun --standalone --nproc_per_node=4 scripts/09_hybrid_parallel/pp_dp_hybrid.py --dp-mode fsdp \\
        --schedule Interleaved1F1B
    mpiexec -n 8 --ppn 4 python scripts/09_hybrid_parallel/pp_dp_hybrid.py \\
        --config scripts/09_hybrid_parallel/configs/pp_dp_8gpus.json
"""

import importlib.util
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from common_hybrid_pipeline import (GRAD_TOLERANCE, add_hybrid_flags, check_against_single_device,
                                    check_hybrid_config, full_named, gather_named, parse_with_config,
                                    pipeline_stage_class, replica_batch, replica_losses, resolved_config,
                                    single_device_run, supports_sync_every_microbatch)
from common_pipeline import gather_timeline, record_actions, stage_indices, torch_schedule, transformer_stage
from distlab import comm, hybrid, hybrid_pipeline, memory, metrics, models, runtime


class BucketLog:
    """A DDP comm hook that notes the bytes of every bucket, then all-reduces it over the dp group as DDP would
    (DDP's reducer calls the process group directly: torch.distributed.all_reduce never sees it)."""

    def __init__(self, dp_group):
        self.dp_group, self.bytes = dp_group, 0
        self.launches = []   # (stage, time) of each bucket's all-reduce: when in the pipeline's step it started

    def hook(self, stage_index, bucket):
        buffer = bucket.buffer()
        self.bytes += buffer.numel() * buffer.element_size()
        self.launches.append((stage_index, time.perf_counter()))
        return allreduce_hook(self.dp_group, bucket)   # average over dp, not over the whole world


def make_data_parallel(module, args, mesh, bucket_log, stage_index: int, last: bool):
    """The stage, data parallel over the ranks that hold the same stage (alone on its stage: left as it is,
    except that FSDP over one rank still gives a bf16 run its mixed-precision policy)."""
    if args.dp == 1 and (args.dp_mode == "ddp" or args.precision == "fp32"):
        return module
    if args.dp_mode == "ddp":
        # find_unused_parameters=True although every parameter is used: on the first step torch 2.13's pipelining
        # infers the shapes passed between stages with a real forward and backward through DDP, outside no_sync,
        # so DDP notes the gradients' ready order twice and its one-off bucket rebuild (which this flag turns
        # off) fails an internal assert on the next forward (measured with GPipe, Interleaved1F1B, ZBV). The
        # flag costs a walk over the autograd graph per step, and no bytes.
        device = next(module.parameters()).device
        wrapped = DistributedDataParallel(module, process_group=mesh.get_group("dp"), find_unused_parameters=True,
                                          device_ids=[device] if device.type == "cuda" else None)
        wrapped.register_comm_hook(state=stage_index, hook=bucket_log.hook)
        return wrapped
    # FSDP2: each block one unit, then the stage's root (embeddings or head). Gathered for the whole step.
    # Under bf16, stages pass bf16 activations; the last hands fp32 logits to the loss.
    for block in module.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False,
                    mp_policy=hybrid.mixed_precision_policy(args.precision))
    return fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False,
                       mp_policy=hybrid.mixed_precision_policy(args.precision, root=last))


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=3)
    p.add_argument("--dp-mode", default="ddp", choices=["ddp", "fsdp"],
                   help="ddp: each stage replicated (PP + DP); fsdp: each stage sharded with FSDP2 (FSDP + PP)")
    add_hybrid_flags(p, pp=2, tp=False)
    args, cfg = parse_with_config(p, __file__)
    with runtime.start(args, validate=lambda world: check_hybrid_config(args, cfg, world)) as rt:
        pp, dp, chunks, microbatches = args.pp, args.dp, args.chunks, args.microbatches
        num_stages = pp * chunks
        report = metrics.Report(__file__, rt, config=resolved_config(args, cfg, rt.world_size))
        rt.print(f"{'PP + DDP' if args.dp_mode == 'ddp' else 'FSDP + PP'} on a (pp, dp) = ({pp}, {dp}) mesh: "
                 f"{args.schedule}, {num_stages} stages of {cfg.n_layers // num_stages} blocks, {dp} replicas x "
                 f"{microbatches} microbatches of {args.batch // (dp * microbatches)} sequences")

        # 1. The single-device answer, first (rank 0; tiny), built from the seed alone.
        reference = single_device_run(cfg, args, rt.device) if args.reference and rt.is_main else None

        # 2. The mesh: pp outermost, dp innermost (ranks 0..dp-1 hold stage 0, ...).
        mesh = init_device_mesh(rt.device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
        pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
        # every rank's groups as the mesh made them, against the grid arithmetic (a mesh built in another order
        # would still train correctly and pass every numeric check, with its groups across the nodes)
        wrong = hybrid.every_rank_agrees(hybrid.mesh_group_problems(mesh, rt.rank, (pp, dp, 1)))
        report.check("every rank's groups, read from the mesh, = distlab.hybrid's grid", not wrong,
                     "; ".join(wrong[:2]) or "all agree", "pp x dp x 1, last innermost")
        mine = stage_indices(args.schedule, pp_rank, pp, chunks)

        # 3. This rank's stages: cut from the whole model, made data parallel, then pipeline stages on the pp group.
        full = models.build_transformer(cfg, seed=args.seed)
        bucket_log = BucketLog(mesh.get_group("dp"))
        wrapped = {s: make_data_parallel(transformer_stage(full, s, num_stages).to(rt.device), args, mesh, bucket_log,
                                         s, last=s == num_stages - 1)
                   for s in mine}
        del full
        Stage = pipeline_stage_class()
        stages = [Stage(wrapped[s], s, num_stages, rt.device, group=mesh.get_group("pp")) for s in mine]
        events, reduce_grads = [], []
        for stage in stages:
            record_actions(stage, events, rt.sync)
            stage.reduce_grad_log = reduce_grads   # when each stage's REDUCE_GRAD ran, and what it issued
        schedule = torch_schedule(args.schedule, stages, microbatches, loss_fn=models.lm_loss)
        parameters = [p for module in wrapped.values() for p in module.parameters()]
        optimizer = torch.optim.AdamW(parameters, lr=args.lr)
        first_here, last_here = 0 in mine, num_stages - 1 in mine
        # bf16 under DDP: autocast (DDP has no public mixed-precision policy); its matmuls run in bf16, and the
        # residual stream (fp32 + bf16 = fp32), what a stage passes on, and the gradients DDP reduces stay fp32.
        # Under FSDP the policy casts the weights instead, and everything a stage computes is bf16.
        autocast = torch.autocast(rt.device.type, dtype=torch.bfloat16,
                                  enabled=args.precision == "bf16" and args.dp_mode == "ddp")
        number_bytes = (hybrid.precision_bytes(args.precision) if args.dp_mode == "fsdp"
                        else hybrid.precision_bytes("fp32"))
        activation_bytes = number_bytes["bytes_per_element"]

        def run_step(step):
            """One pipeline step of this replica on its rows of the global batch; the losses on the last stage."""
            inputs, targets = replica_batch(step, args, cfg, dp_rank, rt.device)
            losses = [] if last_here else None
            with autocast:
                # return_outputs=False: else the last stage keeps every microbatch's logits until the next step
                # (torch 2.13 pipelining/schedules.py:745, stage.py:907-908); the losses come back in losses
                schedule.step(*((inputs,) if first_here else ()), return_outputs=False,
                              **(dict(target=targets, losses=losses) if last_here else {}))
            return torch.stack(losses).mean().item() if last_here else None

        def dp_bytes(counter):
            """Bytes of the dp dimension in the step just run: DDP's buckets (comm hook), or FSDP's collectives."""
            if args.dp_mode == "ddp":
                return {"all_reduce": bucket_log.bytes} if bucket_log.bytes else {}
            return hybrid_pipeline.bytes_by_dimension(counter.calls).get("dp", {})

        # 4. Train; step 1 is measured (step 0 also infers shapes between stages).
        step_losses, first_grads, measured, state = [], {}, {}, None
        sync_timing, sync_seen = ["step 1 was not run (--steps < 2)"], {}
        clock = metrics.StepClock(rt.sync)   # the whole step: schedule and optimizer (MFU's one definition)
        for step in range(args.steps):
            events.clear()
            reduce_grads.clear()
            bucket_log.bytes, bucket_log.launches = 0, []
            dist.barrier()
            t0 = clock.start()
            with comm.CommCounter() as counter:
                for stage in stages:
                    stage.call_log = counter.calls
                step_losses.append(run_step(step))
            for stage in stages:
                stage.call_log = None
            if step == 0 and args.reference:   # the first step is not timed: its gradients, gathered whole
                first_grads = {n: g for module in wrapped.values() for n, g in full_named(module, grads=True).items()}
            optimizer.step()
            clock.stop()
            if step == 1:
                state = memory.ledger(torch.nn.ModuleList(wrapped.values()), optimizer)
                measured = {"dp": dp_bytes(counter),
                            "pp": hybrid_pipeline.bytes_by_dimension(counter.calls).get("pp", {}).get("send", 0)}
                report.timeline = gather_timeline(events if dp_rank == 0 else [], t0, pp_rank)
                # where the dp gradient sync ran in this step, on this rank's clock (torch's rule: DDP inside the
                # stage's last backward, FSDP in REDUCE_GRAD after it)
                backwards = [(stage, start, end) for stage, _, kind, start, end, *_ in events if kind in ("B", "W")]
                # the step's gradient collectives as the counter saw them at the calls, independent of the
                # hook's own list (DDP: the hook's all-reduces over dp; FSDP: its reduce-scatters)
                issued = sum(c.collective == ("reduce_scatter" if args.dp_mode == "fsdp" else "all_reduce")
                             and c.group_size > 1 for c in counter.calls)
                sync_timing = (hybrid_pipeline.gradient_sync_timing_problems(
                    args.dp_mode, backwards, reduce_grads, bucket_log.launches, issued) if dp > 1 else [])
                last_backward_end = {s: max(end for stage, _, end in backwards if stage == s) - t0 for s in mine}
                sync_seen = {"last_backward_end": last_backward_end,
                             "reduce_grad": [(s, start - t0, end - t0) for s, start, end, _ in reduce_grads],
                             "bucket_launches": [(s, at - t0) for s, at in bucket_log.launches]}
            optimizer.zero_grad(set_to_none=True)
        report.losses = replica_losses(step_losses, last_here, True)
        rt.print("losses: " + " ".join(f"{x:.5f}" for x in report.losses))

        # 5. Once per step against once per microbatch: one more batch, each way, no optimizer step.
        sync_modes = {}
        if supports_sync_every_microbatch(args.schedule):
            for every in (False, True):
                for stage in stages:
                    stage.sync_every_microbatch = every
                bucket_log.bytes = 0
                with comm.CommCounter() as counter:
                    run_step(args.steps)
                # this rank's gradients (its shards under FSDP): both ways shard alike, so compare them as they are
                grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone()
                         for module in wrapped.values() for n, p in module.named_parameters()}
                sync_modes["every_microbatch" if every else "once"] = {"bytes": dp_bytes(counter), "grads": grads}
                optimizer.zero_grad(set_to_none=True)
            for stage in stages:
                stage.sync_every_microbatch = False

        # 6. Bring everything to every rank. One rank per stage reports what is the same on its dp peers.
        stage_report = dp_rank == 0
        everything = [None] * rt.world_size
        dist.all_gather_object(everything, {
            "rank": rt.rank, "pp_rank": pp_rank, "dp_rank": dp_rank, "stages": mine, "measured": measured,
            "sync_timing": sync_timing, "sync_seen": sync_seen,
            "state": state.as_dict(),
            "sync_bytes": {mode: v["bytes"] for mode, v in sync_modes.items()},
            "sync_grad_diff": metrics.max_abs_diff(*([modes["grads"][n] for n in sorted(modes["grads"])]
                                                     for modes in (sync_modes["once"], sync_modes["every_microbatch"])))
            if sync_modes else None})
        if args.reference:   # whole tensors, for the comparison only (an a100 run has no reference)
            params_now = {n: t for module in wrapped.values() for n, t in full_named(module).items()}  # collectives
            all_params = gather_named(params_now if stage_report else {})
            all_first_grads = gather_named(first_grads if stage_report else {})

        # ---- checks: one device ----
        if reference is not None:
            check_against_single_device(report, reference, all_params, all_first_grads, args.lr,
                                        precision=args.precision)

        # ---- checks: bytes and memory, every rank against the formulas ----
        def stage_params(stages_of_rank):
            return sum(hybrid_pipeline.stage_param_count(cfg, s, num_stages)["total"] for s in stages_of_rank)

        rows = args.batch // (dp * microbatches)
        dp_wrong, pp_wrong, memory_wrong = [], [], []
        for r in everything:
            params = stage_params(r["stages"])
            formula = hybrid_pipeline.dp_gradient_sync_bytes(params, microbatches, args.dp_mode, False,
                                                             **number_bytes) if dp > 1 else {}
            if r["measured"]["dp"] != {k: v for k, v in formula.items()}:
                dp_wrong.append((r["rank"], r["measured"]["dp"], formula))
            sends = hybrid_pipeline.pp_send_bytes(r["stages"], num_stages, microbatches, rows, cfg.seq_len, cfg.dim,
                                                  activation_bytes)
            if r["measured"]["pp"] != sends:
                pp_wrong.append((r["rank"], r["measured"]["pp"], sends))
            shards = dp if args.dp_mode == "fsdp" else 1
            expected_state = {"params": 4 * params // shards, "grads": 4 * params // shards,
                              "optimizer": 8 * params // shards}
            if any(r["state"][k] != v for k, v in expected_state.items()):
                memory_wrong.append((r["rank"], r["state"], expected_state))
        me = everything[rt.rank]
        my_formula = hybrid_pipeline.dp_gradient_sync_bytes(stage_params(mine), microbatches, args.dp_mode, False,
                                                            **number_bytes)
        for collective, analytic in (my_formula.items() if dp > 1 else []):
            report.add_comm(collective, me["measured"]["dp"].get(collective, 0), analytic, dimension="dp",
                            sync="once per step")
        report.add_comm("send", me["measured"]["pp"], hybrid_pipeline.pp_send_bytes(
            mine, num_stages, microbatches, rows, cfg.seq_len, cfg.dim, activation_bytes), dimension="pp")
        report.check("dp bytes per step = formula, gradients synchronised once per step (every rank)",
                     not dp_wrong, dp_wrong or "all ranks", "== dp_gradient_sync_bytes(once)")
        report.check("pp bytes sent per step = formula (activations forward, gradients back; every rank)",
                     not pp_wrong, pp_wrong or "all ranks", "== pp_send_bytes")
        late = [(r["rank"], problem) for r in everything for problem in r["sync_timing"]]
        where = ("every bucket's all-reduce launched during the stage's last backward (overlapped with it)"
                 if args.dp_mode == "ddp" else
                 "every reduce-scatter issued in REDUCE_GRAD, after the stage's last backward (not overlapped)")
        report.check(f"dp gradient sync where torch 2.13's stage runs it, measured on the step's clock: {where} "
                     f"(every rank)", not late, late[:3] or "all ranks", "stage.py: backward_maybe_with_nosync, "
                     "perform_reduce_grad")
        report.extra["gradient_sync_timing"] = {r["rank"]: r["sync_seen"] for r in everything if r["dp_rank"] == 0}
        report.check(f"parameters, gradients, AdamW state per rank = the stage's "
                     f"{'/ dp (FSDP)' if args.dp_mode == 'fsdp' else '(DDP: replicated)'} (every rank)",
                     not memory_wrong, memory_wrong or "all ranks", "== 4 / 4 / 8 bytes per parameter")
        report.memory = {"measured": me["state"], "per_rank": {r["rank"]: r["state"] for r in everything}}

        if sync_modes and dp > 1:
            wrong = []
            for r in everything:
                params = stage_params(r["stages"])
                for mode, every in (("once", False), ("every_microbatch", True)):
                    formula = hybrid_pipeline.dp_gradient_sync_bytes(params, microbatches, args.dp_mode, every,
                                                                     **number_bytes)
                    if r["sync_bytes"][mode] != formula:
                        wrong.append((r["rank"], mode, r["sync_bytes"][mode], formula))
            gradient_collective = "all_reduce" if args.dp_mode == "ddp" else "reduce_scatter"
            once, every = (me["sync_bytes"][m].get(gradient_collective, 0) for m in ("once", "every_microbatch"))
            report.add_comm(gradient_collective, every, hybrid_pipeline.dp_gradient_sync_bytes(
                stage_params(mine), microbatches, args.dp_mode, True, **number_bytes)[gradient_collective], dimension="dp",
                sync="every microbatch (naive)")
            report.check(f"{gradient_collective} bytes: synchronised every microbatch = {microbatches} x once per "
                         f"step = formula, both ways (every rank)", not wrong, wrong or f"{every} vs {once}",
                         "== dp_gradient_sync_bytes")
            worst = max(r["sync_grad_diff"] for r in everything)
            report.check_close("gradients are the same either way (every rank)", worst, 0.0, GRAD_TOLERANCE)
            report.extra["gradient_sync_bytes"] = {"once": once, "every_microbatch": every,
                                                   "ratio_measured": every / once if once else None}
            rt.print(f"{gradient_collective} of stage {mine} per step: {once:,} B synchronised once, {every:,} B "
                     f"synchronised after each of {microbatches} microbatches")

        report.check("torch.distributed.pipeline (Pipe + RPC) is gone from this torch; pipelining replaces it",
                     importlib.util.find_spec("torch.distributed.pipeline") is None
                     and importlib.util.find_spec("torch.distributed.pipelining") is not None,
                     torch.__version__, "pipeline absent, pipelining present")
        report.extra.update(schedule=args.schedule, stages_of_pp_rank={r: stage_indices(args.schedule, r, pp, chunks)
                                                                       for r in range(pp)},
                            coordinates={r["rank"]: {"pp": r["pp_rank"], "dp": r["dp_rank"]} for r in everything})
        report.throughput = clock.throughput(args.batch * cfg.seq_len, cfg=cfg,
                                             device=rt.device, num_devices=rt.world_size,
                                             dtype=args.precision)   # MFU against the peak of the dtype used
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
