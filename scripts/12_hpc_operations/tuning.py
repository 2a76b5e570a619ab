"""Tuning, measured: what five knobs of chapters 04-07 buy, each swept in one launch, every row measured.

Each knob gets a table; each measured number stands beside the formula it should equal, where one exists:

* ``buckets``: DDP's ``bucket_cap_mb`` (chapter 04). A comm hook sees every bucket DDP all-reduces: how many
  per step and the bytes of each, beside DDP's own rule (``distlab.comm.ddp_bucket_sizes``: walk the gradients
  in backward's order, close a bucket once it holds the cap); and, from the clock, whether the first
  all-reduce was launched before backward's last gradient was ready (communication overlapping backward).
* ``bucket-view``: ``gradient_as_bucket_view``. The gradient and bucket memory read from the tensors themselves:
  the distinct storages under ``p.grad`` and under the buffers the comm hook saw. Without the flag the
  gradients and the buckets are two copies; with it the gradients live inside the buckets: one copy, 4 bytes
  per parameter (fp32) saved.
* ``checkpointing``: activation checkpointing of every block (on each rank's own replica: it changes no
  communication). Bytes autograd saves for backward, measured with saved-tensor hooks
  (``distlab.memory.saved_activation_bytes``) beside ``memory.transformer_activation_bytes``; block forwards
  per step counted (checkpointing runs each block twice); forward + backward time, median of ``--repeats``.
* ``bf16``: FSDP2 (chapter 05's ``apply_fsdp``) with ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)`` against fp32: all-gather and reduce-scatter bytes per step counted by
  ``distlab.comm.CommCounter``, beside ``comm.zero_step_bytes``.
* ``microbatches``: a pipeline of one stage per rank (torch's GPipe) whose stages take a known time (chapter
  07's ``TimedStage``: T ms forward, 2T backward, ``--stage-compute-ms``). Every forward and backward is timed
  on every rank; the idle share of the step, measured, beside ``(P-1)/(M+P-1)``.

Checks: bucket counts and bytes = DDP's rule, every rank; with several buckets communication began before
backward's last gradient, with one it waited for it; the gradient memory halves under the view, saving 4 bytes x
parameters; saved activations = the formula (fp32 on a CPU) and fall under checkpointing, which runs every block
twice; FSDP2's bytes = the formula under fp32 and under bf16; the measured bubble shrinks as microbatches grow.
Times are reported, never asserted beyond that ordering: on a shared CPU they are what the machine gave.

    torchrun --standalone --nproc_per_node=4 scripts/12_hpc_operations/tuning.py
    torchrun --standalone --nproc_per_node=4 scripts/12_hpc_operations/tuning.py --knobs buckets,bucket-view
"""

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

SCRIPTS = Path(__file__).resolve().parent.parent
for chapter in ("04_data_parallel", "05_fully_sharded", "07_pipeline_parallel"):
    sys.path.insert(0, str(SCRIPTS / chapter))
from common_pipeline import gather_timeline, record_actions, torch_schedule  # noqa: E402 - chapter 07's stopwatch
from pp_schedules import TimedStage  # noqa: E402 - chapter 07's stage of known duration
from train_ddp import BucketLog  # noqa: E402 - chapter 04's comm hook with a clock
from train_fsdp import apply_fsdp  # noqa: E402 - chapter 05's sharding

from distlab import comm, data, memory, metrics, models, runtime, schedules  # noqa: E402

KNOBS = ("buckets", "bucket-view", "checkpointing", "bf16", "microbatches")


def numbers(text: str, kind=float) -> list:
    """``"25,0.1"`` -> [25.0, 0.1]; a word that is not a number is a configuration error."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        runtime.require(False, f"{text!r} is not a comma-separated list of {kind.__name__} numbers")


def check_config(args, world_size):
    args.knobs = [k.strip() for k in args.knobs.split(",") if k.strip()] if args.knobs_given else list(KNOBS)
    if not args.knobs_given and world_size == 1:   # one rank: no pipeline to measure
        args.knobs.remove("microbatches")
    unknown = [k for k in args.knobs if k not in KNOBS]
    runtime.require(not unknown, f"unknown knob(s) {', '.join(unknown)}; choose from {', '.join(KNOBS)} (or all)")
    runtime.require(args.knobs, "--knobs names no knob")
    args.bucket_mb, args.microbatches = numbers(args.bucket_mb), numbers(args.microbatches, int)
    runtime.require(args.bucket_mb and all(mb > 0 for mb in args.bucket_mb),
                    f"--bucket-mb {args.bucket_mb}: every bucket cap must hold something (> 0 MB)")
    runtime.require(args.view_bucket_mb > 0, f"--view-bucket-mb {args.view_bucket_mb}: a bucket must hold something")
    runtime.require(args.ddp_steps >= 2, f"--ddp-steps {args.ddp_steps}: DDP builds its buckets during step 0, "
                                         f"so at least 2 steps")
    runtime.require(args.repeats >= 1, f"--repeats {args.repeats}: time at least one forward + backward")
    args.batch = args.batch or 2 * world_size
    runtime.require(args.batch % world_size == 0, f"--batch {args.batch} does not split over {world_size} ranks")
    if "microbatches" in args.knobs:
        runtime.require(world_size >= 2, "the microbatches knob needs a pipeline of at least 2 ranks (one stage "
                                         "each); leave it out of --knobs on one rank")
        runtime.require(len(set(args.microbatches)) >= 2 and min(args.microbatches) >= 1,
                        f"--microbatches {args.microbatches}: at least two different counts, each >= 1")
        runtime.require(args.stage_compute_ms > 0, f"--stage-compute-ms {args.stage_compute_ms}: the stages need "
                                                   f"a known duration (> 0) for the bubble to be measured")
        runtime.require(args.pipeline_steps >= 1, f"--pipeline-steps {args.pipeline_steps}: time at least one step")


def gather(rt, value) -> list:
    everyone = [None] * rt.world_size
    dist.all_gather_object(everyone, value)
    return everyone


def rank_batch(args, cfg, rt, step):
    tokens = data.token_batch(step, args.batch, cfg.seq_len, cfg.vocab_size, seed=args.seed)
    # the rank's own rows, copied: a slice would keep the whole global batch alive (saved for backward)
    return data.split_inputs_targets(data.shard_rows(tokens, rt.rank, rt.world_size).clone().to(rt.device))


# ---- DDP: buckets, and the memory of gradient_as_bucket_view ----------------------------------------------------

def ddp_run(cfg, args, rt, bucket_mb: float, bucket_view: bool) -> dict:
    """A few DDP steps; what the comm hook saw in the last one (buckets rebuilt in gradient-ready order after
    step 0), when, and the gradient and bucket memory at the end of its backward."""
    model = models.build_transformer(cfg, seed=args.seed, device=rt.device)
    ddp = DDP(model, device_ids=[rt.device] if rt.device_type == "cuda" else None, bucket_cap_mb=bucket_mb,
              gradient_as_bucket_view=bucket_view, forward_sync_buffers=False)
    log = BucketLog(model, rt.device)
    buffers = []   # the bucket buffers the hook was handed: DDP's own, not copies

    def hook(state, bucket):
        buffers.append(bucket.buffer())
        return log.hook(state, bucket)

    ddp.register_comm_hook(state=None, hook=hook)
    for step in range(args.ddp_steps):
        model.zero_grad(set_to_none=True)
        inputs, targets = rank_batch(args, cfg, rt, step)
        log.start_micro_step()
        buffers.clear()
        loss = models.lm_loss(ddp(inputs), targets)
        log.mark_backward("start")
        loss.backward()
        log.mark_backward("end")
        rt.sync()
    grads = [p.grad for p in model.parameters()]
    bucket_storages = {b.untyped_storage().data_ptr() for b in buffers}
    overlap = log.overlap()
    first_launch = min((b["launch"] for b in overlap["buckets"]), default=float("inf"))   # none: a check fails
    return {"bucket_mb": bucket_mb, "bucket_view": bucket_view, "loss": loss.item(),
            "bucket_bytes": [b["bytes"] for b in log.buckets],
            "first_launch_before_last_gradient": first_launch < overlap["last_gradient"],
            "hidden_fraction": overlap["hidden_fraction"],
            "grad_storages": len({g.untyped_storage().data_ptr() for g in grads}),
            "grads_in_buckets": all(g.untyped_storage().data_ptr() in bucket_storages for g in grads),
            "grads_outside_buckets": all(g.untyped_storage().data_ptr() not in bucket_storages for g in grads),
            "grad_bytes": metrics.tensor_bytes(grads), "buffer_bytes": metrics.tensor_bytes(buffers),
            "distinct_bytes": metrics.tensor_bytes(grads + buffers)}


def knob_buckets(cfg, args, rt, report, runs):
    param_bytes = [p.numel() * 4 for p in models.build_transformer(cfg).parameters()]
    backward_order = list(reversed(param_bytes))   # layers run in the order they are defined
    rows = []
    rt.print(f"\n== DDP bucket_cap_mb: the all-reduces of step {args.ddp_steps - 1} (comm hook), beside DDP's "
             f"bucketing rule ==")
    rt.print(f"{'cap MB':>7} {'cap bytes':>11} {'buckets':>8} {'rule':>5}  {'bytes per all-reduce (hook)':<34}"
             f"{'total':>9}  began before the last gradient")
    for bucket_mb in args.bucket_mb:
        everyone = gather(rt, runs(bucket_mb, False))
        mine = everyone[0]
        rule = comm.ddp_bucket_sizes(backward_order, bucket_mb)
        began = [row["first_launch_before_last_gradient"] for row in everyone]
        sizes = mine["bucket_bytes"]
        shown = " ".join(f"{b:,}" for b in sizes) if len(sizes) <= 4 else \
            f"{len(sizes)} of {min(sizes):,} to {max(sizes):,}"
        rt.print(f"{bucket_mb:>7g} {int(bucket_mb * comm.MIB):>11,} {len(sizes):>8} {len(rule):>5}  {shown:<34}"
                 f"{sum(sizes):>9,}  on {sum(began)} of {len(began)} ranks")
        report.check(f"bucket_cap_mb {bucket_mb:g}: buckets and bytes of each all-reduce (comm hook) = DDP's rule, "
                     f"every rank", all(row["bucket_bytes"] == rule for row in everyone), sizes, f"== {rule}")
        report.add_comm("all_reduce", sum(sizes), sum(param_bytes), knob="buckets", bucket_cap_mb=bucket_mb,
                        buckets=len(sizes), buckets_rule=len(rule), bucket_bytes=sizes)
        if len(rule) > 1:   # the hooks run in backward's thread: a bucket is launched as soon as it is full
            report.check(f"bucket_cap_mb {bucket_mb:g}: the first all-reduce began before backward's last gradient "
                         f"was ready (overlap), every rank", all(began), sum(began), f"== {len(began)}")
        else:
            report.check(f"bucket_cap_mb {bucket_mb:g}: one bucket waits for backward's last gradient, every rank",
                         not any(began), sum(began), "== 0")
        rows.append({"bucket_mb": bucket_mb, "cap_bytes": int(bucket_mb * comm.MIB), "buckets": len(sizes),
                     "buckets_rule": len(rule), "bucket_bytes": sizes, "bucket_bytes_rule": rule,
                     "total_bytes": sum(sizes), "ranks_began_before_last_gradient": sum(began),
                     "hidden_fraction": [row["hidden_fraction"] for row in everyone]})
    rt.print(f"(the gradients: {sum(param_bytes):,} bytes; the rule walks them in backward's order)")
    return rows


def knob_bucket_view(cfg, args, rt, report, runs):
    num_params = cfg.num_params()
    rt.print(f"\n== gradient_as_bucket_view: gradient and bucket memory, from the storages (bucket_cap_mb "
             f"{args.view_bucket_mb:g}) ==")
    rt.print(f"{'view':>6} {'grad storages':>14} {'grads B':>9} {'buckets B':>10} {'grads + buckets B':>18}  copies")
    rows = {}
    for view in (False, True):
        everyone = gather(rt, runs(args.view_bucket_mb, view))
        mine = everyone[0]
        copies = mine["distinct_bytes"] / (4 * num_params)
        rt.print(f"{str(view):>6} {mine['grad_storages']:>14} {mine['grad_bytes']:>9,} {mine['buffer_bytes']:>10,} "
                 f"{mine['distinct_bytes']:>18,}  {copies:g}")
        where = "grads_in_buckets" if view else "grads_outside_buckets"
        report.check(f"gradient_as_bucket_view={view}: the gradients' storages are "
                     f"{'inside' if view else 'apart from'} the bucket buffers, every rank",
                     all(row[where] for row in everyone))
        expected = (2 - view) * 4 * num_params
        report.check(f"gradient_as_bucket_view={view}: gradients + buckets = {2 - view} x 4 bytes x parameters "
                     f"(distinct storages), every rank", all(row["distinct_bytes"] == expected for row in everyone),
                     mine["distinct_bytes"], f"== {expected}")
        rows[str(view)] = {k: mine[k] for k in ("grad_storages", "grad_bytes", "buffer_bytes", "distinct_bytes")}
    saving = rows["False"]["distinct_bytes"] - rows["True"]["distinct_bytes"]
    rt.print(f"saved: {saving:,} B = 4 B x {num_params:,} parameters (fp32): one copy of the gradients")
    # storage accounting (the distinct storages under p.grad and the buckets), not an allocator's measurement
    report.check_equal("gradient_as_bucket_view saves 4 bytes x parameters (fp32), counted from the storages",
                       saving, 4 * num_params)
    return {**rows, "saving_bytes": saving}


# ---- activation checkpointing -----------------------------------------------------------------------------------

def knob_checkpointing(cfg, args, rt, report):
    rows_per_rank = args.batch // rt.world_size
    inputs, targets = rank_batch(args, cfg, rt, 0)
    variants = {}
    for on in (False, True):
        model = models.build_transformer(cfg, seed=args.seed, device=rt.device)
        block_forwards = [0]
        for block in model.layers.values():
            if on:
                checkpoint(block)   # keep the block's input, recompute the rest in backward (as train_fsdp does)
            block.register_forward_pre_hook(lambda *_: block_forwards.__setitem__(0, block_forwards[0] + 1))
        with memory.saved_activation_bytes(exclude=model.parameters()) as saved:
            loss = models.lm_loss(model(inputs), targets)
        loss.backward()                                    # also the warm-up of the timing below
        model.zero_grad(set_to_none=True)
        variants[on] = {"model": model, "saved_bytes": saved.bytes, "saved_tensors": saved.tensors,
                        "block_forwards": block_forwards[0], "seconds": [],
                        "formula_bytes": memory.transformer_activation_bytes(cfg, rows_per_rank, checkpointed=on),
                        "loss": loss.item()}
    for _ in range(args.repeats):          # off and on in turn: a slow moment of the machine hits both
        for on, v in variants.items():
            rt.sync()
            started = time.perf_counter()
            models.lm_loss(v["model"](inputs), targets).backward()
            rt.sync()
            v["seconds"].append(time.perf_counter() - started)
            v["model"].zero_grad(set_to_none=True)
    off, on = variants[False], variants[True]
    median = {k: statistics.median(v["seconds"]) for k, v in variants.items()}
    rt.print(f"\n== activation checkpointing: saved for backward (saved-tensor hooks) and time, {rows_per_rank} x "
             f"{cfg.seq_len} tokens ==")
    rt.print(f"{'checkpointing':>13} {'saved B':>9} {'formula B':>10} {'tensors':>8} {'block forwards':>15} "
             f"{'ms (median of ' + str(args.repeats) + ')':>18}")
    for key, v in variants.items():
        rt.print(f"{'on' if key else 'off':>13} {v['saved_bytes']:>9,} {v['formula_bytes']:>10,} "
                 f"{v['saved_tensors']:>8} {v['block_forwards']:>15} {1e3 * median[key]:>18.1f}")
    memory_ratio, time_ratio = on["saved_bytes"] / off["saved_bytes"], median[True] / median[False]
    rt.print(f"checkpointing keeps {100 * memory_ratio:.1f}% of the saved bytes for {time_ratio:.2f}x the forward + "
             f"backward time (not checked)")
    same = gather(rt, (off["saved_bytes"], on["saved_bytes"], off["block_forwards"], on["block_forwards"]))
    report.check("saved activations fall under checkpointing (measured), every rank",
                 all(a > b for a, b, _, _ in same), on["saved_bytes"], f"< {off['saved_bytes']}")
    if rt.device_type == "cpu":   # the formula is fp32 on a CPU; a GPU's attention kernels save other tensors
        for key, v in variants.items():
            report.check_equal(f"saved activations, checkpointing {'on' if key else 'off'} = "
                               f"memory.transformer_activation_bytes", v["saved_bytes"], v["formula_bytes"])
    layers = cfg.n_layers
    report.check("every block ran once forward without checkpointing and twice with it (recomputed in backward), "
                 "every rank", all(f == layers and g == 2 * layers for _, _, f, g in same),
                 [off["block_forwards"], on["block_forwards"]], f"== [{layers}, {2 * layers}]")
    report.memory["activation_checkpointing"] = {
        str(key): {k: v[k] for k in ("saved_bytes", "formula_bytes", "saved_tensors", "block_forwards")}
        | {"median_seconds": median[key], "seconds": v["seconds"]} for key, v in variants.items()}
    return {"memory_ratio": memory_ratio, "time_ratio": time_ratio}


# ---- FSDP2 mixed precision ----------------------------------------------------------------------------------

def knob_bf16(cfg, args, rt, report):
    num_params, world = cfg.num_params(), rt.world_size
    rt.print("\n== FSDP2 mixed precision: bytes per step (CommCounter), beside comm.zero_step_bytes ==")
    rt.print(f"{'param_dtype':>11} {'all-gather B':>13} {'formula':>9} {'calls':>6} {'reduce-scatter B':>17} "
             f"{'formula':>9} {'calls':>6}")
    rows = {}
    for mixed in (False, True):
        model = apply_fsdp(models.build_transformer(cfg, seed=args.seed, device=rt.device), mixed_precision=mixed)
        formula = dict(param_bytes=2 if mixed else 4, grad_bytes=4)
        if world == 1:   # one rank: FSDP skips the collectives
            formula = dict(param_bytes=0, grad_bytes=0)
        expected = comm.zero_step_bytes(num_params, 3, **formula)
        # FSDP pads dim 0 of every parameter to a multiple of N (none for tiny on 4 ranks): what it may add
        padded = comm.zero_step_bytes(sum(-(-p.shape[0] // world) * world * p[0].numel()
                                          for p in model.parameters()), 3, **formula)
        per_step = []
        for step in range(2):
            inputs, targets = rank_batch(args, cfg, rt, step)
            with comm.CommCounter() as counter:
                models.lm_loss(model(inputs), targets).backward()
            rt.sync()
            model.zero_grad(set_to_none=True)
            per_step.append(counter.by_collective())
        name = "bf16" if mixed else "fp32"
        row = {}
        for collective in ("all_gather", "reduce_scatter"):
            measured = [s.get(collective, {}).get("payload_bytes", 0) for s in per_step]
            calls = per_step[-1].get(collective, {}).get("calls", 0)
            extra = padded[collective] - expected[collective]
            report.check(f"{name}: {collective} bytes per step (CommCounter) = comm.zero_step_bytes(param_bytes="
                         f"{formula['param_bytes']}), every step", all(0 <= b - expected[collective] <= extra
                                                                      for b in measured),
                         measured[-1], f"== {expected[collective]}" + (f" + padding <= {extra}" if extra else ""))
            report.add_comm(collective, measured[-1], expected[collective], knob="bf16", param_dtype=name, calls=calls)
            row[collective] = {"measured": measured[-1], "formula": expected[collective], "calls": calls}
        rows[name] = row
        ag, rs = row["all_gather"], row["reduce_scatter"]
        rt.print(f"{name:>11} {ag['measured']:>13,} {ag['formula']:>9,} {ag['calls']:>6} {rs['measured']:>17,} "
                 f"{rs['formula']:>9,} {rs['calls']:>6}")
    if world > 1:
        halved = rows["bf16"]["all_gather"]["measured"] / rows["fp32"]["all_gather"]["measured"]
        rt.print(f"bf16 all-gathers {halved:.2f} of fp32's bytes; gradients are still reduced in fp32")
    return rows


# ---- microbatches against the bubble ----------------------------------------------------------------------------

def knob_microbatches(args, rt, report):
    ranks, pause = rt.world_size, args.stage_compute_ms / 1000
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(args.seed)
    modules = [TimedStage(args.dim) for _ in range(ranks)]   # every rank builds all: its own is modules[rank]
    rt.print(f"\n== microbatches against the bubble: GPipe, {ranks} stages of {args.stage_compute_ms:g} ms forward, "
             f"{2 * args.stage_compute_ms:g} ms backward ==")
    rt.print(f"{'M':>4} {'step ms':>8} {'passes ms':>10} {'ideal ms':>9} {'idle share, measured':>21} "
             f"{'formula (P-1)/(M+P-1)':>22}")
    rows = []
    for microbatches in args.microbatches:
        module = modules[rt.rank].to(rt.device)
        stage = PipelineStage(module, rt.rank, ranks, rt.device)
        events = []
        record_actions(stage, events, rt.sync)
        schedule = torch_schedule("GPipe", [stage], microbatches, loss_fn=F.mse_loss)
        bubbles, seconds, spans = [], [], []
        for step in range(1 + args.pipeline_steps):   # step 0 sets torch's buffers up, without pauses: not timed
            module.compute_s = pause if step else 0.0
            generator = torch.Generator().manual_seed(args.seed * 1000 + step)
            x = torch.randn(2 * microbatches, args.dim, generator=generator)
            target = torch.randn(2 * microbatches, args.dim, generator=generator)
            events.clear()
            module.zero_grad(set_to_none=True)
            rt.sync()
            dist.barrier()
            started = time.perf_counter()
            # return_outputs=False: else the last stage keeps every microbatch's output until the next step
            schedule.step(*((x.to(rt.device),) if rt.rank == 0 else ()), return_outputs=False,
                          **(dict(target=target.to(rt.device)) if rt.rank == ranks - 1 else {}))
            rt.sync()
            if step:
                seconds.append(time.perf_counter() - started)
                timeline = gather_timeline(events, started, rt.rank)
                # the passes' span: the first forward's start to the last backward's end, what the idle share divides
                spans.append(max(e["end"] for e in timeline) - min(e["start"] for e in timeline))
                bubbles.append(schedules.bubble_fraction_from_timeline(timeline, ranks))
        median = sorted(range(len(bubbles)), key=bubbles.__getitem__)[(len(bubbles) - 1) // 2]
        measured, formula = bubbles[median], schedules.bubble_fraction(ranks, microbatches)
        ideal = (microbatches + ranks - 1) * 3 * pause   # M + P - 1 slots of forward (T) + backward (2T)
        rt.print(f"{microbatches:>4} {1e3 * seconds[median]:>8.0f} {1e3 * spans[median]:>10.0f} {1e3 * ideal:>9.0f} "
                 f"{100 * measured:>20.1f}% {100 * formula:>21.1f}%")
        rows.append({"microbatches": microbatches, "measured": measured, "formula": formula,
                     "measured_per_step": bubbles, "step_seconds": seconds, "passes_seconds": spans,
                     "ideal_step_seconds": ideal})
    by_count = sorted(rows, key=lambda r: r["microbatches"])
    shrinking = all(a["measured"] > b["measured"] for a, b in zip(by_count, by_count[1:]))
    report.check("the measured bubble shrinks as the microbatches grow (median of the timed steps)", shrinking,
                 [round(r["measured"], 3) for r in by_count], "strictly decreasing")
    rt.print(f"(measured: idle / (ranks x passes ms), from every forward's and backward's timestamps, median of "
             f"{args.pipeline_steps} steps;\n the formula charges nothing for hand-offs between ranks, which the clock "
             "counts as idle)")
    return rows


def main():
    p = runtime.parser(__doc__, presets=("tiny",), steps=None)
    p.add_argument("--knobs", default="all", help=f"comma-separated, from {', '.join(KNOBS)} (default: all)")
    p.add_argument("--batch", type=runtime.positive_int, default=None, help="global batch, sequences (default: 2 per rank)")
    p.add_argument("--bucket-mb", default="25,0.1,0.025", help="DDP bucket_cap_mb values to sweep (MiB, as DDP)")
    p.add_argument("--view-bucket-mb", type=runtime.positive_float, default=0.1, help="bucket_cap_mb of the gradient_as_bucket_view runs")
    p.add_argument("--ddp-steps", type=runtime.positive_int, default=3, help="DDP steps per setting; the last is measured")
    p.add_argument("--repeats", type=runtime.positive_int, default=5, help="timed forward + backward per checkpointing setting")
    p.add_argument("--microbatches", default="4,8,16", help="pipeline microbatch counts M to sweep")
    p.add_argument("--stage-compute-ms", type=runtime.nonnegative_float, default=5.0,
                   help="each pipeline stage pauses T ms forward, 2T backward (sleeps: 4 ranks share 2 cores)")
    p.add_argument("--pipeline-steps", type=runtime.positive_int, default=3, help="timed pipeline steps per M (the median is kept)")
    p.add_argument("--dim", type=runtime.positive_int, default=32, help="width of each pipeline stage's Linear")
    args = p.parse_args()
    args.knobs_given = args.knobs != "all"   # all, on one rank, leaves the pipeline out; named, it must run
    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        if not args.knobs_given and rt.world_size == 1:
            rt.print("one rank: no pipeline to measure, the microbatches knob is left out")
        cfg = models.preset(args.preset)
        report = metrics.Report(__file__, rt, config={**vars(args), "model": cfg.to_dict()})
        rt.print(f"tuning: {rt.world_size} rank(s) on {rt.device_type}, the {args.preset} transformer "
                 f"({cfg.num_params():,} parameters), global batch {args.batch}")
        ddp_runs = {}

        def runs(bucket_mb, bucket_view):   # one DDP run per setting, shared by the two DDP knobs
            if (bucket_mb, bucket_view) not in ddp_runs:
                ddp_runs[bucket_mb, bucket_view] = ddp_run(cfg, args, rt, bucket_mb, bucket_view)
            return ddp_runs[bucket_mb, bucket_view]

        started = time.perf_counter()
        if "buckets" in args.knobs:
            report.extra["buckets"] = knob_buckets(cfg, args, rt, report, runs)
        if "bucket-view" in args.knobs:
            report.extra["bucket_view"] = knob_bucket_view(cfg, args, rt, report, runs)
            report.memory["gradient_as_bucket_view"] = report.extra["bucket_view"]
        if "checkpointing" in args.knobs:
            report.extra["checkpointing"] = knob_checkpointing(cfg, args, rt, report)
        if "bf16" in args.knobs:
            report.extra["bf16"] = knob_bf16(cfg, args, rt, report)
        if "microbatches" in args.knobs:
            report.extra["microbatches"] = knob_microbatches(args, rt, report)
        report.losses = [run["loss"] for run in ddp_runs.values()]
        report.throughput = {"seconds": time.perf_counter() - started}
        report.memory["device"] = metrics.memory_snapshot(rt.device)
        rt.print()
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
