"""What the chapter's two pipeline hybrids share (``pp_dp_hybrid.py``, ``hybrid_3d.py``): their flags and the
checks of their configuration, the single-device reference, a pipeline stage that can also synchronise its
gradients after every microbatch, and how results spread over a mesh come back to rank 0.

Chapter 07's pipeline pieces (torch's schedules by name, the stage cut out of the transformer, the stopwatch
on every pass) are imported from ``scripts/07_pipeline_parallel/common_pipeline.py``, not copied.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "07_pipeline_parallel"))

from common_pipeline import (add_training_flags, check_pipeline_config, resolve_training_flags,  # noqa: E402
                             schedule_help)
from distlab import data, hybrid, hybrid_pipeline, metrics, models, runtime, tensor_parallel  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# Against the single-device run, fp32 (chapter 07's pp_train.py gives the long story): microbatches add their
# gradients in another order than one big batch, DP averages in yet another, TP sums partial products: losses
# and gradients agree to ~1e-7. AdamW divides by sqrt(v) + eps, so a weight whose gradient is itself rounding
# noise moves by a fraction of lr on a rounding difference: parameters are compared at lr / 10. A real mistake
# (a missing 1/M or 1/dp, a gradient reduced twice or not at all, a wrong slice) is off by 1e-3 or more, and the
# step-0 gradients catch a scale error that AdamW would hide.
LOSS_TOLERANCE = 1e-5
GRAD_TOLERANCE = 1e-5


def param_tolerance(lr: float) -> float:
    return lr / 10


# ---- flags and configuration ------------------------------------------------------------------------------

def add_hybrid_flags(parser, *, pp: int, tp: bool) -> None:
    """The mesh, pipeline and training flags both scripts take (``--tp`` only where TP exists)."""
    parser.add_argument("--config", metavar="FILE.json", default=None,
                        help=f"load the run's settings from a JSON file (flags given override it); reference "
                             f"layouts in {CONFIG_DIR.relative_to(CONFIG_DIR.parents[2])}/")
    parser.add_argument("--pp", type=runtime.positive_int, default=pp, help=f"pipeline-parallel degree: stages' ranks (default {pp})")
    parser.add_argument("--dp", type=runtime.positive_int, default=None, help="data-parallel degree (default: the ranks left over)")
    if tp:
        parser.add_argument("--tp", type=runtime.positive_int, default=2, help="tensor-parallel degree, inside a node (default 2)")
    parser.add_argument("--gpus-per-node", type=runtime.positive_int, default=None,
                        help="ranks per node, for the TP-across-nodes warning (default: the launcher's)")
    parser.add_argument("--schedule", default="1F1B", help=f"torch's schedule: {schedule_help()}")
    parser.add_argument("--microbatches", type=runtime.positive_int, default=4, help="M, microbatches per step and replica")
    parser.add_argument("--stages-per-rank", type=runtime.positive_int, default=None,
                        help="V, stages per rank (interleaved schedules; default: the schedule's own)")
    add_training_flags(parser)  # --batch --layers --lr --reference
    hybrid.add_precision_flag(parser)


def parse_with_config(parser, script: str):
    """Arguments with ``--config`` applied; a problem with the file is kept for ``check_hybrid_config``."""
    quiet_known_torch_warnings()
    for action in parser._actions:
        if action.dest == "layers":
            action.help = ("transformer blocks, a multiple of pp x stages-per-rank (default: 4 for tiny, the "
                           "preset's otherwise)")
    args, problem = hybrid_pipeline.merge_config_file(parser, sys.argv[1:], script)
    args.config_problem = problem
    if not hasattr(args, "tp"):
        args.tp = 1
    if args.layers is None and args.preset == "tiny":
        args.layers = 4   # fills pp = 2 with V = 2; chapter 07's default of 8 would only cost time here
    cfg = resolve_training_flags(args)   # layers and reference, from the preset where not given
    hybrid.resolve_precision(args)
    return args, cfg


# torch's schedules that split a backward into the input gradient (I) and the weight gradient (W). Under them a DDP
# stage (dp > 1) trains wrong on torch 2.13: pp_dp_hybrid.py --dp-mode ddp measured losses and step-0 gradients
# off the single device's by 1e-2, half the dp bytes on some stages (ZBVZeroBubble, InterleavedZeroBubble), a
# stopped run (DualPipeV); FSDP stages pass every check under all three
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def check_hybrid_config(args, cfg, world_size: int) -> None:
    """Every rank, before the process group forms: a bad run stops with one line and exit 2."""
    runtime.require(args.config_problem is None, args.config_problem or "")
    tp = args.tp
    if args.dp is None:
        args.dp = max(1, world_size // max(1, args.pp * tp))
    problems = hybrid.mesh_shape_problems(world_size, args.pp, args.dp, tp)
    runtime.require(not problems, "; ".join(problems))
    runtime.require(getattr(args, "dp_mode", "fsdp") in ("ddp", "fsdp"),
                    f"--dp-mode {getattr(args, 'dp_mode', None)!r}: choose ddp or fsdp")
    args.chunks = check_pipeline_config(args.schedule, args.pp, args.microbatches, args.stages_per_rank)
    runtime.require(not (getattr(args, "dp_mode", "fsdp") == "ddp" and args.dp > 1 and args.schedule in SPLIT_BACKWARD),
                    f"--dp-mode ddp with --schedule {args.schedule}: DDP stages under a schedule that splits the "
                    f"backward (I, then W) train wrong on torch 2.13 (measured); use --dp-mode fsdp, or GPipe, "
                    f"1F1B, Interleaved1F1B")
    runtime.require(args.steps >= 2, f"--steps {args.steps}: need at least 2 (step 1 is the one measured)")
    problems = hybrid_pipeline.pipeline_split_problems(layers=args.layers, pp=args.pp, stages_per_rank=args.chunks,
                                                       batch=args.batch, dp=args.dp, microbatches=args.microbatches)
    problems += tensor_parallel.tp_config_problems(cfg, tp) if tp > 1 else []
    runtime.require(not problems, "; ".join(problems))


def quiet_known_torch_warnings() -> None:
    """Two messages of torch 2.13 that say nothing about these runs, on every rank (8 ranks: a wall of text):
    FSDP2 warns when a module returns a view (an in-place op on it would skip a hook; nothing here writes
    in place), and DTensor when gathering a (dp, tp)-sharded tensor whole takes two all-gathers (done once,
    to compare with the single-device run)."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def warn_if_tp_crosses_nodes(rt, args) -> list[str]:
    """TP larger than a node runs, slowly: say so (rank 0), and return the warnings for the metrics."""
    warnings = hybrid.mesh_shape_warnings(args.tp, args.gpus_per_node or rt.local_world_size)
    for line in warnings:
        rt.print(line)
    return warnings


def resolved_config(args, cfg, world_size: int) -> dict:
    """What the run actually used: every flag after --config and defaults, the mesh and the model."""
    config = {key: value for key, value in vars(args).items() if key != "config_problem"}
    return {**config, "mesh": {"pp": args.pp, "dp": args.dp, "tp": args.tp}, "world_size": world_size,
            "model": cfg.to_dict()}


# ---- the single-device reference ---------------------------------------------------------------------------

def single_device_run(cfg, args, device) -> dict:
    """The whole model on one device, trained on each step's whole global batch: losses, step-0 gradients and
    final parameters by name. Built from the seed alone, as the parallel model is: an independent answer."""
    return models.train_reference(cfg, seed=args.seed, lr=args.lr, steps=args.steps, batch=args.batch, device=device,
                                  clip_grad_norm=getattr(args, "clip_grad_norm", None),
                                  grads_at_step=getattr(args, "first_step", 0))


def check_against_single_device(report, reference, all_params, all_first_grads, lr, first_step: int = 0,
                                precision: str = "fp32") -> None:
    """The checks against :func:`single_device_run` (on rank 0): every parameter name, the losses of every step,
    the first step's gradients and the parameters after training, each gathered from the stages that hold them.
    A run resumed from a checkpoint ran steps ``first_step`` on; the single-device run ran them all, unbroken.
    A bf16 run is held to bf16's tolerances (``distlab.metrics``) against the fp32 single-device run."""
    names = sorted(reference["params"])
    report.check("the stages' parameter names are the whole model's", sorted(all_params) == names,
                 f"{len(all_params)} names", f"{len(names)} names")
    resumed = f" (steps {first_step}-{first_step + len(report.losses) - 1} after resuming; it ran every step)" \
        if first_step else " (every step)"
    if precision == "bf16":
        report.check_close("losses equal the single-device run's" + resumed[:-1] + "; bf16 tolerance)", report.losses,
                           reference["losses"][first_step:], metrics.BF16_LOSS_TOLERANCE)
        metrics.check_bf16_tensors(report, all_first_grads, reference["first_grads"], kind="grad",
                                   tolerance=metrics.BF16_GRAD_RELATIVE_TOLERANCE,
                                   label=f"step-{first_step} gradients equal the single-device run's (each parameter; "
                                         f"bf16: its largest difference / its largest gradient)")
        metrics.check_bf16_tensors(report, all_params, reference["params"], kind="param",
                                   tolerance=metrics.bf16_param_mean_tolerance(lr),
                                   label="parameters after training equal the single-device run's (each "
                                         "parameter's mean |difference|, bf16 tolerance)")
        return
    report.check_close("losses equal the single-device run's" + resumed, report.losses,
                       reference["losses"][first_step:], LOSS_TOLERANCE)
    report.check_close(f"step-{first_step} gradients equal the single-device run's (every parameter)",
                       [all_first_grads[n] for n in names], [reference["first_grads"][n] for n in names],
                       GRAD_TOLERANCE)
    report.check_close("parameters after training equal the single-device run's",
                       [all_params[n] for n in names], [reference["params"][n] for n in names], param_tolerance(lr))


def replica_batch(step: int, args, cfg, dp_rank: int, device):
    """This data-parallel replica's rows of the step's global batch (inputs, targets), on the device."""
    tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
    return data.split_inputs_targets(data.shard_rows(tokens, dp_rank, args.dp).to(device))


# ---- a stage that can synchronise its gradients after every microbatch -------------------------------------

def pipeline_stage_class():
    """``PipelineStage`` with a switch, ``sync_every_microbatch``, for measuring what torch saves.

    torch's schedules already synchronise the data-parallel gradients once per step: a DDP stage runs every
    backward but the last under ``no_sync()``; an FSDP stage runs them all with
    ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)`` and reduce-scatters in the
    schedule's REDUCE_GRAD action, after the last microbatch (``stage.py``: ``backward_maybe_with_nosync``,
    ``perform_reduce_grad``). With the switch on, every microbatch's backward synchronises instead: the naive
    PP + DP, whose extra bytes the scripts measure.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward
    from torch.nn.parallel import DistributedDataParallel
    from torch.nn.parallel.distributed import _find_tensors

    class SwitchableSyncStage(PipelineStage):
        sync_every_microbatch = False
        # when the stage's REDUCE_GRAD ran and which collectives it issued: (stage, start, end, [collective, ...]),
        # read from ``call_log`` (a CommCounter's live ``calls`` list, set by the script for the step it measures)
        reduce_grad_log: list | None = None
        call_log: list | None = None

        def perform_reduce_grad(self, grad_scale_factor):
            before = len(self.call_log) if self.call_log is not None else 0
            start = time.perf_counter()
            super().perform_reduce_grad(grad_scale_factor)
            if self.reduce_grad_log is not None:
                issued = [c.collective for c in self.call_log[before:]] if self.call_log is not None else []
                self.reduce_grad_log.append((self.stage_index, start, time.perf_counter(), issued))

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            if not self.sync_every_microbatch:
                return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            assert backward_type == "full", "per-microbatch sync is shown with full backwards only"
            if isinstance(self.submod, DistributedDataParallel):
                # what DDP's forward does outside no_sync(): arm the reducer, so this backward all-reduces
                self.submod.reducer.prepare_for_backward(list(_find_tensors(bwd_kwargs["stage_output"])))
            elif isinstance(self.submod, FSDPModule):
                self.submod.set_requires_gradient_sync(True)      # reduce-scatter after this backward
                self.submod.set_reshard_after_backward(False)     # keep the parameters: only the sync differs
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                   bwd_kwargs["input_values"])
            return grads, None

    return SwitchableSyncStage


def supports_sync_every_microbatch(schedule: str) -> bool:
    """Schedules that run whole backwards (no zero-bubble split): the ones the per-microbatch variant covers."""
    return schedule in ("GPipe", "1F1B", "Interleaved1F1B")


# ---- results spread over the mesh, brought to every rank ---------------------------------------------------

def gather_named(tensors: dict) -> dict:
    """Union of every rank's ``{name: tensor}`` (ranks that hold nothing to report pass {}), on every rank."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tensors)
    merged = {}
    for part in everyone:
        merged.update(part)
    return merged


def full_named(module, *, grads: bool = False) -> dict:
    """A stage's parameters (or gradients) by the full model's names, whole: DTensors (FSDP, TP) gathered over
    their mesh (a collective for every rank of the stage), DDP's ``module.`` prefix removed, on the CPU.

    Always a copy: ``Tensor.cpu()`` on a tensor already on the CPU returns the tensor itself (torch 2.13,
    ``_tensor_docs.py:1281``: "no copy is performed"), and so may ``full_tensor()`` of a DTensor that is not
    sharded; the step-0 gradients kept for the check would then be the live ones, which clipping scales in place
    (``nn/utils/clip_grad.py:173``, ``_foreach_mul_``) before the check reads them."""
    result = {}
    for name, param in module.named_parameters():
        value = param.grad if grads else param.detach()
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        result[name.removeprefix("module.")] = value.detach().to("cpu", copy=True)
    return result


def replica_losses(step_losses: list | None, last_stage_here: bool, report_here: bool) -> list[float]:
    """The global loss of every step: the mean over dp replicas of each replica's mean microbatch loss.

    Losses come back only on the last stage's ranks (one per dp replica and, with TP, per TP rank: identical);
    ``report_here`` picks one rank per replica."""
    mine = step_losses if (last_stage_here and report_here) else None
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    replicas = [losses for losses in everyone if losses is not None]
    return [sum(values) / len(values) for values in zip(*replicas)]

