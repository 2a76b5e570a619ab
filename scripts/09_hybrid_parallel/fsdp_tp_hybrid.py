"""2-D parallelism: tensor parallelism inside a node, FSDP across nodes, on one DeviceMesh ("dp", "tp").

The shared LLaMA-style transformer on a ``dp x tp`` mesh. Each TP group (``tp`` consecutive ranks: one
node) splits every block by the plan of chapter 06 (heads of attention, columns of the feed-forward, the
vocabulary); each of the ``dp`` TP groups takes 1/dp of the global batch; and FSDP2 shards every TP shard
once more, over the ``dp`` ranks that hold the same TP shard (one per node). A rank therefore stores
1/(dp x tp) of every matrix; the per-layer all-reduces of TP stay on NVLink and only FSDP's once-per-unit
all-gathers and reduce-scatters cross the network.

It proves, against a single-device run built independently from the same seed and the same global batch:

* losses equal at every step, gradients at step 0, parameters at the end;
* per-rank parameters, gradients and AdamW state measured off the local shards = the formula
  (``distlab.hybrid.hybrid_state_bytes``);
* the collectives of one step, measured per mesh dimension = the formula
  (``distlab.hybrid.fsdp_tp_comm_formula``): TP all-reduces per block over ``tp``, FSDP all-gathers and
  reduce-scatters per unit over ``dp``.

``--embedding-plan``: ``usual`` splits the embedding row-wise (by vocabulary) and the output head
column-wise with ``loss_parallel`` (logits never gathered); ``alternative`` is the plan one of our source
texts prints, embedding column-wise (by hidden size) and head row-wise. Both train like one device (the
checks say so for either); what differs is the traffic, measured: the alternative all-reduces the whole
B x S x V logits every step and leaves every rank holding all of them, where the usual plan sends B x S x H
and keeps 1/tp of the logits. V is many times H in a language model (32,000 vs 2,048 in the a100 preset):
use the usual plan.

    torchrun --standalone --nproc_per_node=4 scripts/09_hybrid_parallel/fsdp_tp_hybrid.py --dp 2 --tp 2
    torchrun --standalone --nproc_per_node=4 scripts/09_hybrid_parallel/fsdp_tp_hybrid.py --embedding-plan alternative
    mpiexec -n 8 --ppn 4 python scripts/09_hybrid_parallel/fsdp_tp_hybrid.py --preset a100   # tp 4 x dp 2
"""

import argparse
import contextlib
import json
import sys
import runpy
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.profiler import record_function

from distlab import comm, data, hybrid, memory, metrics, models, profiling, runtime, tensor_parallel


def mesh_shape(args, world_size, ranks_per_node):
    """(dp, tp): as given, else TP over the ranks of a node and DP over the nodes (of a replica, with HSDP)."""
    world_size //= args.replicate
    default_dp, default_tp = hybrid.default_mesh_shape(world_size, ranks_per_node)
    tp = args.tp or (world_size // args.dp if args.dp else default_tp)
    dp = args.dp or max(1, world_size // tp)
    return dp, tp


def check_config(args, world_size):
    runtime.require(world_size % args.replicate == 0,
                    f"--replicate {args.replicate} does not divide the {world_size} ranks into replicas")
    dp, tp = mesh_shape(args, world_size, runtime.launcher_env().local_world_size)
    problems = hybrid.mesh_shape_problems(world_size, args.replicate, dp, tp)
    runtime.require(not problems, "; ".join(problems))
    cfg = tensor_parallel.model_from_args(args)  # also fills in args.batch and args.seq_len
    problems = tensor_parallel.tp_config_problems(cfg, tp, batch=args.batch, seq_len=args.seq_len,
                                                  sequence_parallel=args.sequence_parallel)
    runtime.require(not problems, "; ".join(problems))
    runtime.require(args.batch % (args.replicate * dp) == 0,
                    f"--batch {args.batch} does not split over {args.replicate * dp} data-parallel ranks")
    runtime.require(args.steps >= 2, f"--steps {args.steps}: need at least 2 (step 1's communication is measured)")
    runtime.require(args.planted_bug != "tp-on-dp-group" or (dp == tp and args.replicate == 1),
                    f"--planted-bug {args.planted_bug} needs --dp = --tp and no --replicate (the wrong group must "
                    f"have the size of the right one), not dp {dp} x tp {tp}")
    runtime.require(args.planted_bug != "data-by-global-rank" or tp > 1,
                    f"--planted-bug {args.planted_bug} needs --tp > 1 (ranks that must read the same rows)")
    for flag, name in (("data_shard_from", "data_shard"), ("wrappers_from", "apply_wrappers")):
        path = getattr(args, flag)
        runtime.require(path is None or (Path(path).is_file() and callable(runpy.run_path(path).get(name))),
                        f"--{flag.replace('_', '-')} {path}: no such file, or it defines no {name}()")
    runtime.require(not (args.data_shard_from and args.planted_bug == "data-by-global-rank"),
                    "--data-shard-from replaces the rows each rank reads: not with --planted-bug data-by-global-rank")
    runtime.require(not (args.sequence_parallel and args.embedding_plan == "alternative"),
                    "--sequence-parallel goes with the usual embedding plan only")
    runtime.require(args.timeline_out is None or (args.steps >= 3 and not args.sequence_parallel),
                    "--timeline-out profiles step 2 of a run without --sequence-parallel (its norm weights' "
                    "gradient all-reduces look like FSDP's flat buffers): need --steps >= 3")


def tp_plan(embedding_plan, sequence_parallel):
    """Chapter 06's plan for the blocks; the embedding and the head as ``embedding_plan`` says."""
    plan = tensor_parallel.transformer_tp_plan(sequence_parallel)
    if embedding_plan == "alternative":
        # The embedding split by hidden size: each rank looks up H/tp columns of every token, then an
        # all-gather rebuilds B x S x H. The head split by its input (H): each rank multiplies its H/tp slice
        # and the full B x S x V logits are summed by an all-reduce (no loss_parallel: logits are whole).
        plan["tok_embeddings"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["output"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    return plan


def build_hybrid_model(cfg, args, mesh, device):
    """The model on the 2-D mesh: tensor parallel over mesh["tp"] first, then FSDP over mesh["dp"] (HSDP: over
    mesh["replicate", "dp"], sharded over dp and replicated over replicate).

    Why in that order: parallelize_module turns each weight into a DTensor on the TP mesh, holding this
    rank's TP slice. fully_shard then sees those DTensors and shards each one's local slice once more along
    dim 0 over dp: the parameter becomes a DTensor on the 2-D (dp, tp) mesh, and FSDP's all-gathers rebuild
    the TP slice (not the full weight) just before a block runs, over the dp ranks only. The other order
    would shard full weights over dp first and TP could no longer choose its own split.
    """
    # FSDP warns when a unit returns a view (an in-place op on it would skip its pre-backward hook); the
    # alternative head's all-reduced logits are one, and nothing here modifies them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model = models.build_transformer(cfg, args.seed, device)  # same seed: the full weights of one device

    def tp(dim="tp"):   # the TP plan over mesh[dim]
        parallelize_module(model, mesh[dim], tp_plan(args.embedding_plan, args.sequence_parallel))

    def fsdp(dim="dp"):   # fully_shard over mesh[dim] (2-D with the replicas: HSDP)
        policy = hybrid.mixed_precision_policy(args.precision)
        fsdp_mesh = mesh["replicate", dim] if getattr(args, "replicate", 1) > 1 else mesh[dim]
        for block in model.layers.values():  # one FSDP unit per block, then the root (embedding, norm, head)
            fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=args.reshard_after_forward, mp_policy=policy)
        fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=args.reshard_after_forward,
                    mp_policy=hybrid.mixed_precision_policy(args.precision, root=True))

    if getattr(args, "wrappers_from", None):   # chapter 14's lab: the learner's apply_wrappers(tp, fsdp), run here
        learner_function(args.wrappers_from, "apply_wrappers")(tp, fsdp)
    elif getattr(args, "planted_bug", None) == "fsdp-before-tp":   # the mistake: the wrappers' order reversed
        fsdp()
        tp()
    else:
        tp()
        fsdp()
    return model


def learner_function(path, name):
    """Chapter 14's lab: the function ``name`` from the learner's file (the fix, run inside the job)."""
    return runpy.run_path(path)[name]


def step_timeline(prof, device) -> list[dict]:
    """The profiled step as rows ``{lane, kind, start, end}`` (seconds): the compute, forward and backward spans,
    and each collective on the link of its mesh dimension: FSDP's on flat buffers (dp), DTensor's on
    activations (tp; see ``profiling.flat_buffer``)."""
    rows = profiling.timeline(profiling.trace_of(prof), device.type)
    for row in rows:
        if row["lane"] == "communication":
            row["lane"] = "dp" if profiling.flat_buffer(row) else "tp"
        row.pop("input_dims", None)
    return rows


def compare_embedding_plans(cfg, args, dp, tp, ledger, report, rt):
    """What the embedding and the head communicate under each plan (formula), beside this run's measurement.

    The usual plan sends the embedding's output once (an all-reduce of B x S x H) and keeps the logits split
    over the vocabulary (loss_parallel: three small all-reduces of B x S numbers); the alternative sends
    the embedding's output as an all-gather (half the bytes per rank on a ring) but sums the whole
    B x S x V logits with an all-reduce, and every rank then holds all of them. V is many times H in a
    language model (32,000 vs 2,048 for the a100 preset), so the usual plan is the one to use.
    """
    if tp == 1:
        return
    sent = {}
    for plan in hybrid.EMBEDDING_PLANS:
        rows = hybrid.fsdp_tp_comm_formula(cfg, args.batch, args.seq_len, dp, tp, embedding_plan=plan,
                                           sequence_parallel=args.sequence_parallel and plan == "usual")
        sent[plan] = sum(comm.bytes_sent_per_rank(r["collective"], r["payload_bytes"], tp) for r in rows
                         if r["dimension"] == "tp" and r["where"] == "outside blocks")
    measured = sum(r["sent_bytes_per_rank_derived"] for r in ledger
                   if r["dimension"] == "tp" and r["where"] == "outside blocks")
    logits_per_rank = {"usual": args.batch // dp * args.seq_len * cfg.vocab_size // tp * 4,
                       "alternative": args.batch // dp * args.seq_len * cfg.vocab_size * 4}
    rt.print(f"\nembedding + head + loss, bytes each rank sends per step over tp (derived, ring model): usual plan "
             f"{sent['usual']:,.0f}, alternative {sent['alternative']:,.0f} (formula); this run "
             f"({args.embedding_plan}) {measured:,.0f} (from the measured payloads). Logits held per rank: usual "
             f"{logits_per_rank['usual']:,} B, alternative {logits_per_rank['alternative']:,} B (derived). "
             f"Both plans train like one device (the checks above); the usual one sends "
             f"{'less' if sent['usual'] < sent['alternative'] else 'more'} and keeps the logits split.")
    report.extra["embedding_plans"] = {"sent_bytes_per_rank_outside_blocks_derived": sent,
                                       "this_plan_derived_from_measured": measured,
                                       "logits_bytes_per_rank": logits_per_rank, "this_plan": args.embedding_plan}


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=4)
    p.add_argument("--dp", type=runtime.positive_int, default=None, help="data-parallel (FSDP) degree (default: the number of nodes)")
    p.add_argument("--tp", type=runtime.positive_int, default=None, help="tensor-parallel degree (default: the ranks of a node)")
    p.add_argument("--replicate", type=runtime.positive_int, default=1,
                   help="HSDP x TP: this many replicas of the dp x tp mesh, FSDP sharding inside each and "
                        "all-reducing the gradient shards across them (default 1: FSDP x TP)")
    p.add_argument("--sequence-parallel", action="store_true", help="split the activations between TP regions")
    p.add_argument("--embedding-plan", choices=["usual", "alternative"], default="usual",
                   help="usual: embedding row-wise, head column-wise + loss_parallel; alternative: embedding "
                        "column-wise, head row-wise (what one of our source texts prints)")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="FSDP frees each block's gathered weights after forward (2 all-gathers per unit and step)")
    p.add_argument("--timeline-out", metavar="FILE.json", default=None,
                   help="profile step 2 and write rank 0's measured timeline (compute, tp link, dp link) as JSON: "
                        "the data of chapter 09's figure")
    p.add_argument("--planted-bug", choices=["tp-on-dp-group", "fsdp-before-tp", "data-by-global-rank"],
                   default=None,
                   help="a mistake to find (lab 09): the model's mesh built with its dimension names swapped, so "
                        "TP's all-reduces run on the dp group (ranks that read other rows) and FSDP on the tp group; "
                        "the data still follows the grid. Needs --dp = --tp; fsdp-before-tp: fully_shard applied "
                        "before the TP plan (torch refuses: the weights are already DTensors on the dp mesh); "
                        "data-by-global-rank (chapter 14): the model's mesh right, but each rank reads the rows of "
                        "its global rank out of the world (DistributedSampler's defaults), not its dp coordinate")
    p.add_argument("--data-shard-from", metavar="FILE.py", default=None,
                   help="chapter 14's lab: a file defining data_shard(mesh) -> (index, count), which of count equal "
                        "slices of the batch this rank reads, given the model's (dp, tp) mesh (the learner's fix)")
    p.add_argument("--wrappers-from", metavar="FILE.py", default=None,
                   help="chapter 14's lab: a file defining apply_wrappers(tp, fsdp), which calls tp(dim) (the TP "
                        "plan over mesh[dim]) and fsdp(dim) (fully_shard over mesh[dim]) in its order")
    hybrid.add_precision_flag(p)
    tensor_parallel.add_model_flags(p)  # --batch --seq-len --dim --heads --ffn-hidden --lr
    args = p.parse_args()
    hybrid.resolve_precision(args)

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = tensor_parallel.model_from_args(args)
        dp, tp = mesh_shape(args, rt.world_size, rt.local_world_size)
        bf16 = args.precision == "bf16"   # compared with the fp32 single-device run at bf16's tolerances
        report = metrics.Report(__file__, rt, config={**vars(args), "dp": dp, "tp": tp, "replicate": args.replicate,
                                                      "model": cfg.to_dict()})
        # Losses and step-0 gradients: chapter 06's fp32 tolerances (sums in another order). Parameters after
        # the last step: AdamW divides by sqrt(v), so a weight whose gradient is mostly rounding noise can move
        # by up to ~lr per step whichever way the noise points; a wrong gradient moves every weight by ~lr.
        # On a GPU each fp32 tolerance is widened by metrics.GPU_FP32_TOLERANCE_FACTOR (other summation orders).
        tolerance = {name: metrics.fp32_tolerance(value, rt.device)
                     for name, value in {**tensor_parallel.TOLERANCE[args.preset], "param": args.lr / 10}.items()}
        for warning in hybrid.mesh_shape_warnings(tp, rt.local_world_size):
            rt.print(warning)

        # 1. The single-device reference first, so its memory is free before the hybrid model is built.
        reference = models.train_reference(cfg, seed=args.seed, lr=args.lr, steps=args.steps, batch=args.batch,
                                           seq_len=args.seq_len, device=rt.device)
        reference_losses, reference_grads, reference_final = (reference["losses"], reference["first_grads"],
                                                              reference["params"])
        if rt.device.type == "cuda":
            torch.cuda.empty_cache()

        # 2. The 2-D mesh: tp innermost, so a TP group is tp consecutive ranks (one node; see rank_grid.py).
        #    HSDP x TP adds the replicas outermost: (replicate, dp, tp), FSDP sharding over dp inside a replica.
        replicas = args.replicate
        if replicas > 1:
            mesh = init_device_mesh(rt.device.type, (replicas, dp, tp), mesh_dim_names=("replicate", "dp", "tp"))
        else:
            mesh = init_device_mesh(rt.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        replica = mesh.get_local_rank("replicate") if replicas > 1 else 0
        dp_rank = mesh.get_local_rank("dp")
        data_rank, data_ranks = replica * dp + dp_rank, replicas * dp   # which rows of the batch this rank reads
        shard, shards = data_rank, data_ranks   # the loader's coordinate: the model mesh's dp coordinate
        by_global_rank = args.planted_bug == "data-by-global-rank"   # THE PLANTED BUG: DistributedSampler's
        if by_global_rank:   # defaults (rank = the global rank, num_replicas = the world), the same rows per rank:
            shard, shards = rt.rank, rt.world_size   # a step reads tp x the batch, and a TP group's ranks differ
        if args.data_shard_from:   # chapter 14's lab: the learner's choice of rows, run here
            chosen = learner_function(args.data_shard_from, "data_shard")(mesh)
            rt.require(isinstance(chosen, (tuple, list)) and len(chosen) == 2 and 0 <= int(chosen[0]) < int(chosen[1])
                       and args.batch % int(chosen[1]) == 0,
                       f"data_shard(mesh) returned {chosen!r}: (index, count), 0 <= index < count, count divides "
                       f"the batch of {args.batch}")
            shard, shards = int(chosen[0]), int(chosen[1])
        if args.planted_bug == "tp-on-dp-group":   # THE PLANTED BUG: the names swapped, "tp" is the outer dim
            model_mesh = init_device_mesh(rt.device.type, (dp, tp), mesh_dim_names=("tp", "dp"))
        else:
            model_mesh = mesh
        refused = None
        try:
            model = build_hybrid_model(cfg, args, model_mesh, rt.device)
        except ValueError as error:   # fsdp-before-tp: torch 2.13 refuses to re-distribute a DTensor FSDP made on
            refused = str(error).splitlines()[0][:200]   # another mesh (tensor/_api.py:953-957), on every rank
        report.check("the TP plan was applied before FSDP (parallelize_module, then fully_shard)", refused is None,
                     refused or "built", "a model built")
        if refused is not None:
            sys.exit(report.finish(args.metrics_out))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        # the groups as the model's mesh made them (not as arithmetic says they should be), checked on every rank
        mine = {dim: dist.get_process_group_ranks(model_mesh.get_group(dim)) for dim in model_mesh.mesh_dim_names}
        wrong = hybrid.every_rank_agrees(hybrid.mesh_group_problems(model_mesh, rt.rank, (replicas, dp, tp),
                                                                    names={"replicate": "pp"}))
        report.check("every rank's TP and FSDP groups, read from the mesh, = distlab.hybrid's grid", not wrong,
                     "; ".join(wrong[:2]) or "all agree", "tp innermost: tp consecutive ranks")
        rt.print(f"{rt.world_size} ranks as {f'replicate {replicas} x ' if replicas > 1 else ''}dp {dp} x tp {tp}; "
                 f"rank 0's TP group {mine['tp']}, its FSDP group {mine['dp']}"
                 + (f", its replicate group {mine['replicate']}" if replicas > 1 else "")
                 + f" (read from the mesh); embedding plan {args.embedding_plan}"
                 + (", sequence parallel" if args.sequence_parallel else ""))

        # 3. Train. A TP group shares one slice of the batch: every TP rank of replica d sees rows d/dp.
        counter = comm.ModuleCommCounter()  # step 1 (step 0 also pays one-off set-up)
        state = None
        # the whole step (forward, backward, gradient sync, optimizer), from step 2 (0 pays one-off set-up and the
        # gradient check, 1 the byte counter): MFU's one definition, as pp_dp_hybrid.py and hybrid_3d.py
        clock = metrics.StepClock(rt.sync, skip=2)
        for step in range(args.steps):
            clock.start()
            tokens = data.token_batch(step, args.batch * (tp if by_global_rank else 1), args.seq_len,
                                      cfg.vocab_size, args.seed)
            inputs, targets = data.split_inputs_targets(data.shard_rows(tokens, shard, shards).to(rt.device))
            usual = args.embedding_plan == "usual"
            profiled = args.timeline_out is not None and step == 2
            with counter if step == 1 else contextlib.nullcontext(), \
                    loss_parallel() if usual else contextlib.nullcontext(), \
                    profiling.one_step(rt.device) if profiled else contextlib.nullcontext() as prof:
                with record_function("forward"):
                    loss = models.lm_loss(model(inputs), targets)
                with record_function(profiling.BACKWARD_LABEL):
                    loss.backward()
                rt.sync()
                if profiled:
                    prof.step()
            if profiled:
                timeline = step_timeline(prof, rt.device)
            # (Under SP the norm weights' gradients are partial sums over sequence shards: FSDP's post-backward
            # hook all-reduces them over tp before its reduce-scatter over dp, so nothing is left to reduce.)
            if step == 0 and bf16:   # each tensor against its own largest gradient: bf16 keeps 8 bits
                errors = {}          # (distlab.metrics says more); gathered one tensor at a time
                with hybrid.quiet_redistribution():
                    for name, param in model.named_parameters():
                        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                        errors.update(metrics.bf16_tensor_errors({name: grad}, {name: reference_grads[name]},
                                                                 kind="grad"))
                        del grad
                metrics.check_bf16_errors(report, errors, kind="grad", tolerance=metrics.BF16_GRAD_RELATIVE_TOLERANCE,
                                          label="step-0 gradients equal single-device (each parameter; bf16: its "
                                                "largest difference / its largest gradient)")
            elif step == 0:
                with hybrid.quiet_redistribution():
                    difference = tensor_parallel.max_gradient_difference(model, reference_grads)
                report.check("step-0 gradients equal single-device (every parameter)",
                             difference <= tolerance["grad"], difference, tolerance["grad"])
            optimizer.step()
            clock.stop()
            if step == 1:
                state = memory.ledger(model, optimizer)  # parameters, gradients and AdamW moments all exist now
            optimizer.zero_grad(set_to_none=True)
            local = loss.full_tensor() if isinstance(loss, DTensor) else loss  # the same on every TP rank
            global_loss = local.detach().clone()
            for dim in ("dp", "replicate") if replicas > 1 else ("dp",):  # the mean over every data-parallel rank
                dist.all_reduce(global_loss, group=mesh.get_group(dim))
            report.losses.append(global_loss.item() / data_ranks)
            rt.print(f"step {step}: loss {report.losses[-1]:.6f}   single device {reference_losses[step]:.6f}")
        report.check_close("losses equal single-device (every step" + ("; bf16 tolerance)" if bf16 else ")"),
                           report.losses, reference_losses,
                           tolerance=metrics.BF16_LOSS_TOLERANCE if bf16 else tolerance["loss"])


        # 4. Parameters at the end: every weight gathered whole (a collective), against the reference's.
        with hybrid.quiet_redistribution():
            final = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                     for name, p in model.named_parameters()}
        if bf16:   # a few near-zero gradients step differently in bf16: each tensor's mean difference
            metrics.check_bf16_tensors(report, final, reference_final, kind="param",
                                       tolerance=metrics.bf16_param_mean_tolerance(args.lr),
                                       label="parameters after the last step equal single-device (each parameter's "
                                             "mean |difference|, bf16 tolerance)")
        else:
            final_difference = max(metrics.max_abs_diff(final[name], reference_final[name]) for name in final)
            report.check("parameters after the last step equal single-device (every parameter)",
                         final_difference <= tolerance["param"], final_difference, tolerance["param"])

        # 5. Memory per rank: measured off the local shards (at step 1, after the optimizer step) = formula.
        formula_state = hybrid.hybrid_state_bytes(cfg, dp, tp, dp_rank, args.embedding_plan)
        for part in ("params", "grads", "optimizer"):
            report.check_equal(f"{part} bytes on this rank = formula (1/(dp x tp) of the matrices, 1/dp of the "
                               f"norms)", getattr(state, part), int(getattr(formula_state, part)))
        report.memory = {"measured": state.as_dict(), "analytic": formula_state.as_dict(),
                         "single_device": memory.training_state_bytes(cfg.num_params(), "fp32").as_dict(),
                         "tp_only": memory.training_state_bytes(
                             tensor_parallel.tp_param_count_per_rank(cfg, tp)["total"], "fp32").as_dict(),
                         "device": metrics.memory_snapshot(rt.device)}
        rt.print(f"\nstate per rank: {state.total:,.0f} B measured, {formula_state.total:,.0f} B formula; one "
                 f"device {report.memory['single_device']['total']:,.0f} B, TP alone "
                 f"{report.memory['tp_only']['total']:,.0f} B")

        # 6. The communication of step 1, per mesh dimension: measured = formula.
        number_bytes = hybrid.precision_bytes(args.precision)   # bf16 activations and weights, fp32 gradients
        formula = hybrid.fsdp_tp_comm_formula(cfg, args.batch, args.seq_len, dp, tp,
                                              sequence_parallel=args.sequence_parallel,
                                              embedding_plan=args.embedding_plan,
                                              reshard_after_forward=args.reshard_after_forward,
                                              replicate=replicas, **number_bytes)
        measured = hybrid.measured_fsdp_tp_comm_rows(counter.calls, cfg, tp, args.embedding_plan, dp=dp,
                                                     **number_bytes)
        ledger = hybrid.join_fsdp_tp_comm_rows(measured, formula, dp, tp, replicas)
        rt.print(f"\ncommunication of one training step per mesh dimension (replica batch {args.batch // data_ranks} x "
                 f"{args.seq_len} tokens, H = {cfg.dim}, V = {cfg.vocab_size}):")
        width = max(len(row["dimension"]) for row in ledger)
        rt.print(f"  {'dim':{width}s} {'phase':8s} {'where':14s} {'collective':14s} {'calls':>5s} {'measured':>10s} "
                 f"{'formula':>10s}  sent per rank (derived: ring model x measured)")
        for row in ledger:
            rt.print(f"  {row['dimension']:{width}s} {row['phase']:8s} {row['where']:14s} {row['collective']:14s} "
                     f"{row['measured_calls']:5d} {row['measured_bytes']:10,d} {row['analytic_bytes']:10,d}  "
                     f"{row['sent_bytes_per_rank_derived']:,.0f}")
            report.add_comm(row["collective"], row["measured_bytes"], row["analytic_bytes"],
                            dimension=row["dimension"], phase=row["phase"], where=row["where"],
                            measured_calls=row["measured_calls"], analytic_calls=row["analytic_calls"],
                            sent_bytes_per_rank_derived=row["sent_bytes_per_rank_derived"])
        for dimension in ("tp", "dp") + (("replicate",) if replicas > 1 else ()):
            rows = [r for r in ledger if r["dimension"] == dimension]
            mismatched = [f"{r['phase']}/{r['where']}/{r['collective']}" for r in rows
                          if (r["measured_bytes"], r["measured_calls"]) != (r["analytic_bytes"], r["analytic_calls"])]
            report.check(f"{dimension} communication of one step = formula (calls and bytes of every collective)",
                         not mismatched, mismatched or len(rows), "every row equal")
        compare_embedding_plans(cfg, args, dp, tp, ledger, report, rt)
        if args.timeline_out is not None:   # the profiled step's collectives per link = the counted step's
            in_trace = {dim: sum(r["lane"] == dim for r in timeline) for dim in ("tp", "dp")}
            counted = {dim: sum(r["measured_calls"] for r in ledger if r["dimension"] == dim) for dim in ("tp", "dp")}
            report.check_equal("the profiled step's collectives per mesh dimension = the counted step's",
                               in_trace, counted)
            if rt.is_main:
                Path(args.timeline_out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.timeline_out).write_text(json.dumps({
                    "script": "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py", "argv": sys.argv[1:],
                    "rank": rt.rank, "world_size": rt.world_size, "dp": dp, "tp": tp, "device": str(rt.device),
                    "torch": torch.__version__, "model": cfg.to_dict(), "batch": args.batch, "seq_len": args.seq_len,
                    "step": 2, "rows": timeline}, indent=1))
                rt.print(f"wrote {args.timeline_out}")

        report.throughput = clock.throughput(args.batch * args.seq_len, cfg=cfg, seq_len=args.seq_len,
                                             device=rt.device, num_devices=rt.world_size,
                                             dtype=args.precision)   # MFU against the peak of the dtype used
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
