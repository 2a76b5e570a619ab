"""FSDP2: ``fully_shard`` each transformer block and the root, and train: ZeRO-3 as PyTorch ships it.

Every parameter is split along dim 0 over the N ranks (a DTensor: each rank stores 1/N of it), and so are its
gradient and its AdamW moments: 16 bytes per parameter become 16/N. A block's full weights exist only while
the block runs: FSDP all-gathers them just before its forward and frees them after; before its backward it
gathers them again, and the gradients leave by reduce-scatter.

* ``--no-reshard-after-forward`` keeps each block's gathered weights from forward to backward (ZeRO-2-like
  traffic: one all-gather per step instead of two, for more memory in between);
* ``--mixed-precision`` all-gathers and computes in bf16 and reduces gradients in fp32 (the sharded weights
  and AdamW stay fp32);
* ``--activation-checkpointing`` saves only each block's input and recomputes the rest in backward;
* ``--cpu-offload`` keeps the shards, gradients and AdamW state in host memory (the step runs on the CPU);
* ``--replicate R`` is HSDP (hybrid sharded data parallelism), what most multi-node FSDP jobs run:
  ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh shards each parameter over the N / R ranks of a shard
  group (one node: NVLink) and replicates the shards over the R groups (across nodes): all-gathers and
  reduce-scatters stay inside the shard group, and one all-reduce of each gradient shard crosses the nodes.

Checks: same step-0 gradients (gathered from the shards), losses and parameters as the single-device baseline
(fp32 tolerance, or the documented bf16 one: the gradients are what catch a wrong scale under bf16); per-rank bytes
of parameters, gradients and optimizer state measured from the local shards (distlab.memory.ledger) = the ZeRO-3
table; all-gather and reduce-scatter bytes per step = the formula (distlab.comm.zero_step_bytes) for the chosen
reshard setting, in one call a unit (``--planted-bug`` plants what these two catch: root-only, sum-gradients). Under
bf16 each gradient and parameter is held to its own scale (``metrics.check_bf16_tensors``). The peak is predicted by
phase (``memory.predict_step_peak`` with FSDP2's gathered units) and, on a GPU, checked against the allocator's;
``--preset a100`` (no single-device run to compare with) must train: finite losses, the last below the first.

    torchrun --standalone --nproc_per_node=4 scripts/05_fully_sharded/train_fsdp.py
    torchrun --standalone --nproc_per_node=4 scripts/05_fully_sharded/train_fsdp.py --no-reshard-after-forward
    torchrun --standalone --nproc_per_node=4 scripts/05_fully_sharded/train_fsdp.py --preset a100   # 4 x A100-40GB
"""

import argparse
import math
import runpy
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor

from common_fully_sharded import (BF16_LOSS_TOLERANCE, GRAD_TOLERANCE, LOSS_TOLERANCE, Baseline,
                                  bf16_param_mean_tolerance, mean_abs_diff, param_tolerance)
from distlab.metrics import BF16_GRAD_RELATIVE_TOLERANCE
from distlab import comm, data, hybrid, memory, metrics, models, runtime, speed

PRESETS = {"tiny": "tiny", "a100": "a100_large"}  # a100: ~3.3 B parameters, too big for one A100-40GB with DDP


def check_config(args, world_size):
    runtime.require(args.steps >= 2, f"--steps {args.steps}: need at least 2 steps (memory is read at step 2)")
    if args.batch is not None:
        runtime.require(args.batch % world_size == 0, f"--batch {args.batch} does not split over {world_size} ranks")
    runtime.require(world_size % args.replicate == 0,
                    f"--replicate {args.replicate} does not divide the {world_size} ranks into (replicate, shard)")
    learner = args.optimizer_from
    runtime.require(learner is None or (Path(learner).is_file()
                                        and callable(runpy.run_path(learner).get("shard_and_optimizer"))),
                    f"--optimizer-from {learner}: no such file, or it defines no shard_and_optimizer()")
    runtime.require(not (args.planted_bug == "optimizer-before-sharding" or learner) or args.init == "seed",
                    "--planted-bug optimizer-before-sharding and --optimizer-from build the whole model before "
                    "sharding: they need --init seed")
    runtime.require(args.planted_bug != "local-grad-norm" and not args.clip_from or args.max_grad_norm is not None,
                    "--planted-bug local-grad-norm and --clip-from clip the gradients: they need --max-grad-norm")
    clipper = args.clip_from
    runtime.require(clipper is None or (Path(clipper).is_file()
                                        and callable(runpy.run_path(clipper).get("clip_gradients"))),
                    f"--clip-from {clipper}: no such file, or it defines no clip_gradients()")
    seeder = args.model_seed_from
    runtime.require(seeder is None or (Path(seeder).is_file() and callable(runpy.run_path(seeder).get("model_seed"))),
                    f"--model-seed-from {seeder}: no such file, or it defines no model_seed()")
    runtime.require(not (args.planted_bug == "per-rank-init" or seeder) or args.init == "seed",
                    "--planted-bug per-rank-init and --model-seed-from build the whole model on every rank: they "
                    "need --init seed")
    runtime.require(not (args.reduce_dtype and args.planted_bug == "bf16-gradient-reduction"),
                    "--reduce-dtype sets what --planted-bug bf16-gradient-reduction plants: not both")
    runtime.require(args.preset != "a100" or args.init != "seed",
                    "--preset a100 --init seed would build 3.3 B parameters on every rank before sharding: use meta")


REDUCE_DTYPES = ("float32", "bfloat16", "float16")
PLANTED_BUGS = ("root-only", "sum-gradients", "bf16-gradient-reduction", "optimizer-before-sharding", "per-rank-init",
                "local-grad-norm")


def apply_fsdp(model, *, reshard_after_forward=True, mixed_precision=False, cpu_offload=False,
               activation_checkpointing=False, pin_memory=False, mesh=None, planted_bug=None, compile_blocks=False,
               reduce_dtype=None):
    """Shard each transformer block, then the root (embeddings, final norm, output), in that order.

    Each ``fully_shard`` call makes one unit: its parameters are gathered and freed together. Blocks first,
    so the root's unit holds only what no block holds. ``mesh``: None shards over every rank; a 2-D
    ``(replicate, shard)`` DeviceMesh makes it HSDP. ``compile_blocks``: ``torch.compile`` each block before it is
    sharded, as torchtitan does (FSDP's gathers and reductions run in its hooks, outside the compiled code).
    ``reduce_dtype``: a torch dtype's name, the dtype the gradients are reduce-scattered in (None: the policy's).
    """
    mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
                 else MixedPrecisionPolicy())
    if planted_bug == "bf16-gradient-reduction":  # the mistake: gradients summed over the ranks in bf16 (to halve
        mp_policy = MixedPrecisionPolicy(param_dtype=mp_policy.param_dtype, reduce_dtype=torch.bfloat16)  # bytes)
    if reduce_dtype is not None:
        mp_policy = MixedPrecisionPolicy(param_dtype=mp_policy.param_dtype, reduce_dtype=getattr(torch, reduce_dtype))
    policy = dict(reshard_after_forward=reshard_after_forward, mesh=mesh, mp_policy=mp_policy,
                  offload_policy=CPUOffloadPolicy(pin_memory=pin_memory) if cpu_offload else OffloadPolicy())
    for block in model.layers.values():
        if activation_checkpointing:
            checkpoint(block)  # recompute the block in backward; no wrapper module: paths and names unchanged
        if compile_blocks:
            block.compile()
        if planted_bug != "root-only":   # the mistake: one unit, the whole model gathered at once
            fully_shard(block, **policy)
    fully_shard(model, **policy)
    return model


def initial_value(cfg, name: str, shape, seed: int, index: int) -> torch.Tensor:
    """Parameter ``name``'s initial values, whole, from the seed alone: the transformer's own rule
    (``models._init_transformer_``: its standard deviations), drawn from a generator of this parameter's own,
    seeded (seed, index). The same on every rank and every device; built one parameter at a time, so the
    peak memory is the largest parameter, not the model."""
    full = torch.empty(shape)
    one_parameter = types.SimpleNamespace(cfg=cfg, named_parameters=lambda: [(name, full)])
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed * 100_003 + index)
        models._init_transformer_(one_parameter)
    return full


def materialize_on_meta(cfg, seed, device, **fsdp_options):
    """Build on the meta device (no memory), shard, then allocate the local shards and fill each with its rows
    of the parameter's initial value (:func:`initial_value`)."""
    with torch.device("meta"):
        model = models.Transformer(cfg)
    apply_fsdp(model, **fsdp_options)
    model.to_empty(device="cpu" if fsdp_options.get("cpu_offload") else device)
    # Every rank computes the whole parameter and keeps its own rows (src_data_rank=None: no communication).
    # Drawing the shards directly (nn.init on DTensors) would depend on the device's random streams, and on a
    # CPU every rank would draw the same values unless seeded apart; then no single-device model could be
    # built to check against.
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            full = initial_value(cfg, name, param.shape, seed, index)
            rows = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(rows)
    # Buffers are not sharded and to_empty left them uninitialised: recompute them, on the compute device
    # (with CPU offload the shards live on the host, but the rotary tables are used where the layers run).
    cos, sin = models.rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    return model


def single_device_model(cfg, seed: int, init: str, device):
    """The single-device reference, built from the seed by its own path, never copied from the sharded model:
    ``models.build_transformer`` for ``--init seed``; for ``--init meta``, a plain model whose every parameter
    is :func:`initial_value`, whole."""
    if init == "seed":
        return models.build_transformer(cfg, seed=seed, device=device)
    model = models.Transformer(cfg)
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            param.copy_(initial_value(cfg, name, param.shape, seed, index))
    return model.to(device)


REPLICA_TOLERANCE = 1e-6   # every replica applies the same all-reduced gradient: 0 measured on gloo


def replica_weight_gap(model, replicate_group) -> float:
    """The largest difference between two replicas' sums of each local shard (HSDP): every replica holds the same
    shards, so 0 unless they started apart (an all-gather of one number a parameter, over the replicate group)."""
    sums = torch.stack([p.to_local().detach().double().sum() for p in model.parameters()])
    every = [torch.empty_like(sums) for _ in range(dist.get_world_size(replicate_group))]
    dist.all_gather(every, sums, group=replicate_group)
    return max((other - sums).abs().max().item() for other in every)


def clip_gradients(model, max_norm: float, args, world: int) -> list[float]:
    """Clip the sharded model's gradients to ``max_norm`` and return the total norm each rank computed (gathered
    from every rank, as their logs would show them). clip_grad_norm_ on the DTensor gradients reduces the norm over
    the ranks; the planted mistake takes each rank's local shards, whose norm is a piece of the whole."""
    if getattr(args, "clip_learner", None):   # chapter 14's lab: the learner's clipping, run here
        norm = args.clip_learner(model, max_norm)
    elif args.planted_bug == "local-grad-norm":   # the norm of this rank's shards, and its shards scaled by it
        local = [p.grad.to_local() for p in model.parameters()]
        norm = torch.nn.utils.get_total_norm(local)
        torch._foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0))   # clip_grad_norm_'s own rule
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    norm = (norm.full_tensor() if hasattr(norm, "full_tensor") else torch.as_tensor(norm)).detach()
    norm = norm.to(device=next(model.parameters()).device, dtype=torch.float64).reshape(1)
    every = [torch.empty_like(norm) for _ in range(world)]
    dist.all_gather(every, norm)
    return [n.item() for n in every]


def full_parameters(model) -> list[torch.Tensor]:
    """Every parameter, gathered whole (a collective: every rank calls it)."""
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def main():
    p = runtime.parser(__doc__, presets=("tiny", "a100"), steps=5)
    p.add_argument("--batch", type=runtime.positive_int, default=None, help="global batch, sequences per step (default: 8; 16 for a100)")
    runtime.add_lr_flag(p)
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                   help="free each block's gathered weights after its forward (ZeRO-3); --no-...: keep them "
                        "until backward (one all-gather per step fewer)")
    p.add_argument("--mixed-precision", action="store_true",
                   help="bf16 parameters for compute and all-gather, fp32 gradient reduction (on for a100)")
    p.add_argument("--reduce-dtype", choices=REDUCE_DTYPES, default=None,
                   help="MixedPrecisionPolicy's reduce_dtype, the dtype the gradients are reduce-scattered in "
                        "(default: float32, the policy's own under --mixed-precision and without it)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward")
    p.add_argument("--cpu-offload", action="store_true", help="shards, gradients and AdamW state in host memory")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block before sharding it, as torchtitan does (chapter 01's ladder)")
    p.add_argument("--replicate", type=runtime.positive_int, default=1,
                   help="HSDP: shard over N / R ranks (a node), replicate over R groups (default 1: plain FSDP)")
    p.add_argument("--init", choices=["auto", "seed", "meta"], default="auto",
                   help="seed: build the whole model on every rank, then shard (tiny); meta: build on the meta "
                        "device and initialise the shards only (default for a100)")
    p.add_argument("--planted-bug", choices=PLANTED_BUGS, default=None,
                   help="a mistake the checks must catch: root-only (no unit per block), sum-gradients (the "
                        "loss summed over the ranks, not averaged: gradients N times too large), "
                        "bf16-gradient-reduction (gradients reduce-scattered in bf16: rounded as they are summed), "
                        "optimizer-before-sharding (AdamW built on the parameters fully_shard then replaces; "
                        "needs --init seed), per-rank-init (each rank builds the model from its own seed: "
                        "fully_shard keeps each rank's own slice and broadcasts nothing), local-grad-norm (with "
                        "--max-grad-norm: each rank clips its shards by the norm of its own shards alone)")
    p.add_argument("--optimizer-from", metavar="FILE.py", default=None,
                   help="chapter 14's lab: a file defining shard_and_optimizer(model, shard, adamw), which calls "
                        "shard(model) and returns adamw(parameters) in its order (the learner's fix, run here)")
    p.add_argument("--model-seed-from", metavar="FILE.py", default=None,
                   help="chapter 14's lab: a file defining model_seed(seed, rank), the seed this rank builds the "
                        "model from before fully_shard (the learner's fix, run here)")
    p.add_argument("--max-grad-norm", type=runtime.positive_float, default=None,
                   help="clip the gradients to this total norm before each step (the whole model's norm; the "
                        "single-device run clips alike)")
    p.add_argument("--clip-from", metavar="FILE.py", default=None,
                   help="chapter 14's lab: a file defining clip_gradients(model, max_norm), which clips the sharded "
                        "model's gradients and returns their total norm (the learner's fix, run here)")
    args = p.parse_args()
    args.init = args.init if args.init != "auto" else ("meta" if args.preset == "a100" else "seed")
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        cfg = models.preset(PRESETS[args.preset])
        world = rt.world_size
        args.batch = args.batch or (16 if args.preset == "a100" else 8)
        if args.preset == "a100":
            args.mixed_precision = True  # bf16 compute: what makes 3.3 B parameters train at speed
        compare = args.preset == "tiny"
        num_params = cfg.num_params()
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})
        rt.print(f"FSDP2 on {world} ranks: {PRESETS[args.preset]} transformer, {num_params:,} parameters, global batch "
                 f"{args.batch}; reshard_after_forward={args.reshard_after_forward}, mixed precision="
                 f"{'bf16/fp32' if args.mixed_precision else 'off'}, activation checkpointing="
                 f"{args.activation_checkpointing}, CPU offload={args.cpu_offload}, init={args.init}"
                 + (", compiled blocks" if args.compile else ""))

        # HSDP's mesh: shard groups of N / R consecutive ranks (inside a node), replicas across (chapter 09)
        shard = world // args.replicate
        mesh = None
        if args.replicate > 1:
            mesh = init_device_mesh(rt.device_type, (args.replicate, shard), mesh_dim_names=("replicate", "shard"))
            wrong = hybrid.every_rank_agrees(hybrid.mesh_group_problems(
                mesh, rt.rank, (1, args.replicate, shard), names={"replicate": "dp", "shard": "tp"}))
            report.check("every rank's shard group is N / R consecutive ranks, its replicate group strided (read "
                         "from the mesh)", not wrong, "; ".join(wrong[:2]) or "all agree", "shard innermost")
            rt.print(f"HSDP: {args.replicate} replicas x shard groups of {shard}; rank 0's shard group "
                     f"{dist.get_process_group_ranks(mesh.get_group('shard'))}, its replicate group "
                     f"{dist.get_process_group_ranks(mesh.get_group('replicate'))}")
        fsdp_options = dict(reshard_after_forward=args.reshard_after_forward, mixed_precision=args.mixed_precision, mesh=mesh,
                            cpu_offload=args.cpu_offload, activation_checkpointing=args.activation_checkpointing,
                            pin_memory=args.cpu_offload and rt.device_type == "cuda",  # pinning needs a GPU
                            planted_bug=args.planted_bug, compile_blocks=args.compile, reduce_dtype=args.reduce_dtype)
        model_seed = args.seed   # the seed this rank built the whole model from; rank 0's seeds the reference too
        if args.optimizer_from:   # chapter 14's lab: the learner's order of sharding and AdamW, run here
            learner = runpy.run_path(args.optimizer_from)["shard_and_optimizer"]
            model = models.build_transformer(cfg, seed=args.seed, device=rt.device)
            optimizer = learner(model, lambda module: apply_fsdp(module, **fsdp_options),
                                lambda params: torch.optim.AdamW(params, lr=args.lr))
            rt.require(isinstance(optimizer, torch.optim.Optimizer),
                       f"shard_and_optimizer() returned {type(optimizer).__name__}, not the optimizer")
        elif args.planted_bug == "optimizer-before-sharding":   # the mistake: AdamW given the parameters that
            model = models.build_transformer(cfg, seed=args.seed, device=rt.device)   # fully_shard then replaces
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)            # (_fsdp_param.py:325-331)
            model = apply_fsdp(model, **fsdp_options)
        elif args.init == "seed":
            # The planted mistake: each rank seeds its own model. DDP would broadcast rank 0's weights at
            # construction (torch 2.13, nn/parallel/distributed.py:1065-1073); fully_shard keeps this rank's own
            # slice of what it was given and sends nothing (fsdp/_fully_shard/_fsdp_param.py:298-299).
            seed = args.seed + rt.rank if args.planted_bug == "per-rank-init" else args.seed
            if args.model_seed_from:   # chapter 14's lab: the learner's seed, run here
                seed = runpy.run_path(args.model_seed_from)["model_seed"](args.seed, rt.rank)
                rt.require(isinstance(seed, int), f"model_seed() returned {seed!r}, not an int")
            model_seed = seed
            model = apply_fsdp(models.build_transformer(cfg, seed=seed, device=rt.device), **fsdp_options)
        else:
            model = materialize_on_meta(cfg, args.seed, rt.device, **fsdp_options)
        if args.planted_bug != "optimizer-before-sharding" and not args.optimizer_from:
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        baseline = None
        if compare:
            start_weights = full_parameters(model)  # collective: every rank
            if rt.rank == 0:   # built from the seed, independently: a sharding or init bug cannot leak into it. The
                # seed is the one rank 0 built its model from (--seed, or a learner's model_seed(): any one seed
                # shared by every rank is a right fix of per-rank-init); the data still come from --seed
                baseline = Baseline(cfg, args.seed, args.lr, rt.device, max_grad_norm=args.max_grad_norm,
                                    model=single_device_model(cfg, model_seed, args.init, rt.device))
                report.check_close("initial full weights (gathered from the shards) = the single-device model's, "
                                   "built from the seed", start_weights, list(baseline.model.parameters()), 0.0)
        local = next(iter(model.parameters())).to_local()
        rt.print(f"tok_embeddings.weight {tuple(next(iter(model.parameters())).shape)} -> this rank holds "
                 f"{tuple(local.shape)} on {local.device}")

        rank_grad_norms = []   # --max-grad-norm: per step, the total norm each rank computed
        if args.clip_from:
            args.clip_learner = runpy.run_path(args.clip_from)["clip_gradients"]
        replica_gaps = []   # HSDP: the largest difference between two replicas' sums of each local shard
        if args.replicate > 1:
            replica_gaps.append(replica_weight_gap(model, mesh.get_group("replicate")))
        names = [n for n, _ in model.named_parameters()]  # fully_shard keeps the names: the baseline's, by name
        loss_diffs, param_diffs, param_mean_diffs, measured_comm, seconds = [], [], [], [], []
        one_device_norms = []
        param_errors = {}   # bf16: each parameter's mean |difference| from the baseline, the largest over the steps
        state = activations = None
        for step in range(args.steps):
            tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
            inputs, targets = data.split_inputs_targets(data.shard_rows(tokens, rt.rank, world).to(rt.device))
            rt.sync()
            started = time.perf_counter()
            # compiled blocks: no dispatch mode (dynamo would skip them); FSDP2's collectives are c10d calls
            with comm.CommCounter(functional=not args.compile) as counter:
                if step == 0:
                    with memory.saved_activation_bytes(exclude=model.parameters()) as saved:
                        loss = models.lm_loss(model(inputs), targets)
                    activations = saved.bytes
                else:
                    loss = models.lm_loss(model(inputs), targets)
                # all-gathers again (if resharded) and reduce-scatters, unit by unit. The planted mistake: each
                # rank's loss summed over the ranks where it should be averaged (gradients N times too large)
                (loss * world if args.planted_bug == "sum-gradients" else loss).backward()
            if step == 0 and compare:  # the averaged gradients, gathered whole (a collective: every rank)
                grads0 = [q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
                          for q in model.parameters()]
            if args.max_grad_norm is not None:   # each rank's total norm, as its log would print it
                rank_grad_norms.append(clip_gradients(model, args.max_grad_norm, args, world))
            optimizer.step()     # on the local shards only: no communication
            if step == 1:        # parameters, gradients and AdamW moments all exist now
                state = memory.ledger(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
            rt.sync()
            seconds.append(time.perf_counter() - started)
            measured_comm.append(counter.by_collective())
            global_loss = loss.detach().float().clone()
            dist.all_reduce(global_loss)
            report.losses.append(global_loss.item() / world)
            line = f"step {step:3d}  loss {report.losses[-1]:.6f}  ({seconds[-1] * 1e3:.0f} ms)"
            if args.replicate > 1:
                replica_gaps.append(replica_weight_gap(model, mesh.get_group("replicate")))
                line += f"  replicas' weights apart by {replica_gaps[-1]:.2e}"
            if compare:
                params_now = full_parameters(model)
                if baseline is not None:
                    baseline.step(tokens.to(rt.device))
                    if args.max_grad_norm is not None:
                        one_device_norms.append(baseline.grad_norm)
                    if step == 0:   # Adam hides a gradient's scale from losses and weights: look at the gradients
                        grad_diff = metrics.max_abs_diff([g.float() for g in grads0], baseline.grads)
                        grad_errors = metrics.bf16_tensor_errors(dict(zip(names, grads0)), dict(zip(names, baseline.grads)),
                                                                 kind="grad")
                    loss_diffs.append(abs(report.losses[-1] - baseline.losses[-1]))
                    param_diffs.append(metrics.max_abs_diff(params_now, list(baseline.model.parameters())))
                    param_mean_diffs.append(mean_abs_diff(params_now, list(baseline.model.parameters())))
                    for name, error in metrics.bf16_tensor_errors(dict(zip(names, params_now)), baseline.state(),
                                                                  kind="param").items():
                        param_errors[name] = max(error, param_errors.get(name, 0.0))
                    line += f"  single-device {baseline.losses[-1]:.6f}"
            rt.print(line)

        if args.max_grad_norm is not None:   # what any user's log shows: each rank's gradient norm
            report.extra["rank_grad_norms"] = rank_grad_norms
            report.check("every rank computed the same gradient norm (every step)",
                         all(max(norms) - min(norms) <= 1e-5 * max(norms) for norms in rank_grad_norms),
                         max(max(norms) - min(norms) for norms in rank_grad_norms), "<= 1e-5 of the norm")
            if baseline is not None:
                report.extra["one_device_grad_norms"] = one_device_norms
        if args.replicate > 1:   # what any HSDP user can check: the replicas must hold the same weights
            report.check_close("the replicas hold the same weights (each local shard's sum, before training and "
                               "after every step)", max(replica_gaps), 0.0, REPLICA_TOLERANCE)
            report.extra["replica_weight_gaps"] = replica_gaps

        # ---- communication: measured = formula ----
        formula = dict(stage=3, param_bytes=2 if args.mixed_precision else 4, grad_bytes=4,
                       reshard_after_forward=args.reshard_after_forward)
        analytic = comm.zero_step_bytes(num_params, **formula)
        if shard == 1:  # one rank a shard group: nothing to gather or reduce, and FSDP skips the collectives
            formula["param_bytes"] = formula["grad_bytes"] = 0
            analytic = comm.zero_step_bytes(num_params, **formula)
        # FSDP pads dim 0 of every parameter to a multiple of its shard group: what that adds, if any (none for
        # tiny, N = 4)
        padded_params = sum(-(-p.shape[0] // shard) * shard * p[0].numel() for p in model.parameters())
        padded = comm.zero_step_bytes(padded_params, **formula)
        group_of = {"all_gather": shard, "reduce_scatter": shard}
        if args.replicate > 1:  # HSDP: each rank's reduced gradient shard, all-reduced over the replicas; with a
            # shard group of one rank (--replicate N) the shard is the whole gradient, all-reduced as DDP would
            # (FSDP skips only the reduce-scatter there: torch 2.13, fsdp/_fully_shard/_fsdp_collectives.py:618
            # reduce-scatters if world_size > 1, :634 all-reduces over the replicate group whenever it has one)
            grad_bytes = 4
            analytic["all_reduce"] = num_params * grad_bytes // shard
            padded["all_reduce"] = padded_params * grad_bytes // shard
            group_of["all_reduce"] = args.replicate
        for collective, expected in analytic.items():
            per_step = [m.get(collective, {}).get("payload_bytes", 0) for m in measured_comm]
            calls = measured_comm[-1].get(collective, {}).get("calls", 0)
            # one collective a unit (each block and the root), all-gathered twice when it reshards after forward
            units = cfg.n_layers + 1
            expected_calls = units * (2 if collective == "all_gather" and args.reshard_after_forward else 1)
            if shard == 1 and collective != "all_reduce":   # a shard group of one rank: FSDP skips them
                expected_calls = 0
            report.check_equal(f"{collective} calls per step = {expected_calls} ({units} units: each block and the "
                               "root" + (", twice)" if expected_calls > units else ")"),
                               [m.get(collective, {}).get("calls", 0) for m in measured_comm][-1], expected_calls)
            report.add_comm(collective, per_step[-1], expected, calls=calls,  # ring model x measured payload:
                            group_size=group_of[collective],
                            sent_bytes_per_rank_derived=comm.bytes_sent_per_rank(collective, per_step[-1],
                                                                                 group_of[collective]))
            extra = padded[collective] - expected
            report.check(f"{collective} bytes per step = formula (every step)",
                         all(0 <= b - expected <= extra for b in per_step), per_step[-1],
                         f"== {expected}" + (f" + padding <= {extra}" if extra else ""))
            rt.print(f"{collective}: {per_step[-1]:,} B per step in {calls} calls (formula {expected:,} B) in groups "
                     f"of {group_of[collective]}; each rank sends "
                     f"{comm.bytes_sent_per_rank(collective, per_step[-1], group_of[collective]):,.0f} B (derived: ring model)")

        # ---- memory: measured from the local shards = the ZeRO-3 table ----
        # FSDP2 keeps fp32 shards even under mixed precision (bf16 copies exist only while gathered), so the
        # persistent state is the fp32 table's: 4 + 4 + 8 bytes per parameter, divided by N.
        table = memory.zero_state_bytes(num_params, shard, 3, precision="fp32")  # HSDP: over the shard group
        totals = torch.tensor([state.params, state.grads, state.optimizer], dtype=torch.float64)
        dist.all_reduce(totals)  # summed over ranks: the full model's state, exactly, even with uneven shards
        # The ledger reads the shards FSDP made; the peak is more: forward/backward adds the activations, the loss
        # gradients and FSDP's gathered units, the foreach AdamW step 4 B a parameter of the shards
        # (distlab.memory.predict_step_peak, fsdp_unit_bytes)
        units = memory.fsdp_unit_bytes(cfg.vocab_size, cfg.dim, cfg.n_layers, num_params,
                                       param_bytes=2 if args.mixed_precision else 4)
        phases = memory.predict_step_peak(state, activations, args.batch // world, cfg.seq_len, cfg.vocab_size,
                                          foreach=rt.device_type == "cuda" and not args.cpu_offload,
                                          fsdp_units=units)
        device_memory = metrics.memory_snapshot(rt.device)
        report.memory = {"measured": state.as_dict(), "analytic": table.as_dict(),
                         "ddp": memory.zero_state_bytes(num_params, world, 0, precision="fp32").as_dict(),
                         "saved_activation_bytes": activations, "shard_device": str(local.device),
                         "predicted_peak": phases.as_dict(), "device": device_memory}
        rt.print(f"rank {rt.rank} predicted peak {phases.peak:,} B, in the {phases.peak_phase} phase ("
                 + ", ".join(f"{name} {phases.total(name):,} B" for name in phases.phases) + ")")
        if rt.device_type == "cuda" and not args.cpu_offload:  # the allocator's peak against the phase model
            if baseline is not None:   # rank 0 of a comparison also holds the single-device model, its state and batch
                rt.print("peak memory: not checked on rank 0, which also holds the single-device baseline")
            else:                      # from memory.PEAK_CHECK_MIN_BYTES predicted (cuBLAS's workspaces: fixed costs)
                memory.check_allocator_peak(report, phases.peak, device_memory["peak_allocated_bytes"], say=rt.print)
        if not compare:   # a100: no single device to compare with; the run must still train
            report.check("every loss is finite and the last below the first",
                         all(map(math.isfinite, report.losses)) and report.losses[-1] < report.losses[0],
                         [round(x, 4) for x in report.losses], "finite, falling")
        rt.print(f"rank {rt.rank} state: params {state.params:,} B, grads {state.grads:,} B, AdamW "
                 f"{state.optimizer:,} B = {state.total / num_params:.2f} bytes/param (DDP: 16); saved activations "
                 f"{activations:,} B")
        even = all(p.shape[0] % shard == 0 for p in model.parameters())  # else shards differ by a row
        padding = 16 * sum(-p.shape[0] % shard * p[0].numel() for p in model.parameters())  # bytes, all state
        for part, total in zip(("params", "grads", "optimizer"), totals.tolist()):
            if even:
                report.check_equal(f"{part} bytes on this rank = ZeRO-3 table (16/N bytes per parameter in all)",
                                   getattr(state, part), int(getattr(table, part)))
            report.check_close(f"{part} bytes summed over ranks = the whole model's"
                               + (f" x {args.replicate} replicas" if args.replicate > 1 else "")
                               + ("" if even else " (within padding)"), total, getattr(table, part) * world,
                               tolerance=0 if even else padding * args.replicate)
        report.check_equal("shards live on the host" if args.cpu_offload else "shards live on the device",
                           local.device.type, "cpu" if args.cpu_offload else rt.device_type)

        if compare and rt.rank == 0:
            if args.mixed_precision:  # bf16 against the fp32 baseline: see common_fully_sharded.py
                # each tensor against its own scale (distlab.metrics.bf16_tensor_errors): halved q/k gradients or
                # norm weights that lost their AdamW state hide under the whole model's largest gradient or mean
                metrics.check_bf16_errors(report, grad_errors, kind="grad", tolerance=BF16_GRAD_RELATIVE_TOLERANCE,
                                          label="step-0 gradients (gathered from the shards) = single-device fp32 "
                                                "gradients (each tensor's largest difference / its own largest "
                                                "gradient, bf16 tolerance)")
                report.check_close("loss = single-device fp32 loss (every step, bf16 tolerance)", max(loss_diffs), 0.0,
                                   BF16_LOSS_TOLERANCE)
                metrics.check_bf16_errors(report, param_errors, kind="param",
                                          tolerance=bf16_param_mean_tolerance(args.lr),
                                          label="parameters = single-device fp32 parameters (each parameter's mean "
                                                "|difference|, every step, bf16 tolerance)")
            else:
                report.check_close("step-0 gradients (gathered from the shards) = single-device gradients",
                                   grad_diff, 0.0, metrics.fp32_tolerance(GRAD_TOLERANCE, rt.device))
                report.check_close("loss = single-device loss (every step)", max(loss_diffs), 0.0,
                                   metrics.fp32_tolerance(LOSS_TOLERANCE, rt.device))
                report.check_close("parameters = single-device parameters (every step)", max(param_diffs), 0.0,
                                   param_tolerance(args.lr))
            report.extra.update(loss_diffs=loss_diffs, param_diffs=param_diffs, param_mean_diffs=param_mean_diffs,
                                baseline_losses=baseline.losses)
        report.throughput = metrics.throughput(args.batch * cfg.seq_len, sum(seconds[1:]), len(seconds) - 1,
                                               cfg=cfg, device=rt.device, num_devices=rt.world_size,
                                               dtype="bf16" if args.mixed_precision else "fp32")
        if args.compile:   # compiled code runs silently eager when something disables dynamo
            speed.check_blocks_compiled(report)
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
