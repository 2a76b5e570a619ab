"""Which TP / PP / DP / FSDP layout for my model on my cluster, and will it fit? The planner of chapter 11.

A search prints every layout of --gpus GPUs ranked by estimated throughput among those that fit, then the
rejected ones with their reason; --layout evaluates one layout (memory per GPU by part, communication per
mesh dimension, bubble, step time, MFU). Every number is derived from the course's formulas
(``distlab.planner``), which the tests prove against measured runs of chapters 05 and 09.

    python scripts/11_choosing_a_strategy/plan.py --model 70b --gpus 64 --cluster h100-80gb
    python scripts/11_choosing_a_strategy/plan.py --model gpt3-175b --gpus 1024 --cluster v100-32gb \\
        --layout tp=8,pp=8,dp=16 --zero 1
    python scripts/11_choosing_a_strategy/plan.py --model 13b --gpus 16 --cluster a100-40gb --json
    python scripts/11_choosing_a_strategy/plan.py --model 70b --gpus 256 --cluster a100-80gb --dry-run
    python scripts/11_choosing_a_strategy/plan.py --model 70b --gpus 64 --cluster h100-80gb --seq-len 131072 \\
        --global-batch 32 --dry-run                       # long sequences: the search reaches for CP

--dry-run builds the chosen layout at its full world size on a fake process group, in this one process
(``distlab.planner.dry_run``): the DeviceMesh of sampled ranks checked against the grid arithmetic
(``distlab.hybrid``), and for a rank of the first, a middle and the last pipeline stage the real model of its stage,
parallelized by the course's own code, its state bytes read from the shards against the planner's: no GPU, no launcher. Bad input ends with one line ``config error: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from distlab import hybrid, planner, runtime

GIB = planner.GIB


def parse_args(argv=None):
    p = runtime.OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="7b", help=f"a preset: {', '.join(planner.MODELS)} (default 7b)")
    p.add_argument("--model-config", help="a JSON file with ModelSpec's fields (layers, hidden, heads, ...)")
    p.add_argument("--cluster", default="a100-40gb", help=f"a preset: {', '.join(planner.CLUSTERS)}")
    p.add_argument("--cluster-config", help="a JSON file: gpus_per_node, gpu_gib, peak_tflops, "
                                            "intra_node_gb_per_s, inter_node_gb_per_s")
    p.add_argument("--gpus", type=runtime.positive_int, default=None, help="GPUs in the job (default: one node, or the --layout's)")
    p.add_argument("--layout", help="evaluate one layout, like tp=8,pp=8,dp=16 (cp= and zero= optional)")
    p.add_argument("--zero", type=runtime.nonnegative_int, default=None, choices=[0, 1, 2, 3],
                   help="ZeRO stage (0 DDP, 3 FSDP); default: the search tries 0, 1 and 3; --layout uses 1")
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="FSDP gathers the weights again for backward: an explicit True on every unit, the root "
                        "included, not torch's default (default: yes without PP; no under PP, as chapter 09's "
                        "scripts set it)")
    p.add_argument("--activation-checkpointing", choices=["search", "full", "selective", "none"], default="search",
                   help="full: recompute every block in backward; selective: attention's core only; none; "
                        "search (default): the fastest that fits, for each layout")
    p.add_argument("--precision", choices=["mixed", "fp32"], default="mixed")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="Megatron SP with TP (default: on whenever tp > 1). With torch's layers it moves no extra "
                        "bytes but one all-gather a block under PyTorch's early-stopped full recomputation")
    p.add_argument("--async-tp", action="store_true", help="TP's collectives overlapped with the matmuls they feed")
    p.add_argument("--ep-overlap", action="store_true",
                   help="a MoE model: EP's all-to-alls hidden behind another microbatch's compute (DeepSeek-V3's "
                        "DualPipe); default: on the critical path")
    p.add_argument("--cp", type=runtime.positive_int, default=None,
                   help="context parallelism degree the search uses (default: 1 and every degree that leaves "
                        "each rank --cp-min-tokens of a sequence)")
    p.add_argument("--cp-min-tokens", type=runtime.positive_int, default=planner.Options().cp_min_tokens,
                   help="the search's CP: tokens of a sequence each rank keeps at least (default %(default)s)")
    p.add_argument("--schedule", choices=planner.PIPELINE_SCHEDULES, default="interleaved_1f1b",
                   help="pipeline schedule (default interleaved_1f1b; with 1 chunk it is 1F1B)")
    p.add_argument("--chunks", type=runtime.positive_int, default=None,
                   help="stages per rank of interleaved_1f1b (default: the search tries 1, 2, 4 and 8)")
    p.add_argument("--micro-batch", type=runtime.positive_int, default=None,
                   help="sequences per microbatch (default: the search tries 1, 2, 4 and 8)")
    p.add_argument("--global-batch", type=runtime.positive_int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--seq-len", type=runtime.positive_int, default=None, help="tokens per sequence (default: the preset's)")
    p.add_argument("--top", type=runtime.positive_int, default=12, help="rows of the ranked table to print (default 12)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--dry-run", action="store_true", help="build the chosen layout at its full world size on a "
                                                          "fake process group and check it against the planner")
    p.add_argument("--measure", action="store_true",
                   help="run under a launcher (every rank): plan the course's --preset transformer on this job's "
                        "GPUs (pp 1, FSDP x TP: what chapter 09's fsdp_tp_hybrid.py runs), run that layout with it, "
                        "and print predicted beside measured memory and step time (rank 0)")
    p.add_argument("--preset", choices=["tiny", "a100"], default="a100", help="--measure: the course's model")
    p.add_argument("--steps", type=runtime.positive_int, default=4, help="--measure: training steps of the run (first 2 untimed)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="--measure: the run's device")
    p.add_argument("--metrics-out", help="write the result as JSON to this file (rank 0)")
    return p.parse_args(argv)


def preset_or_file(kind: str, name: str, path: str | None, presets: dict, load):
    """The ``--{kind}-config`` file's model or cluster when given, else the preset ``name``; ConfigError (one
    line, exit 2) when the file does not load or the name is unknown."""
    if path:
        try:
            return load(path)
        except (OSError, ValueError) as error:
            raise runtime.ConfigError(f"--{kind}-config: {error}") from None
    runtime.require(name in presets, f"unknown {kind} {name!r}; choose from {', '.join(presets)}")
    return presets[name]


def resolve(args):
    """Model, cluster, options and GPU count from the flags; ConfigError (one line, exit 2) when they do not make
    sense."""
    model = preset_or_file("model", args.model, args.model_config, planner.MODELS, planner.model_from_file)
    cluster = preset_or_file("cluster", args.cluster, args.cluster_config, planner.CLUSTERS,
                             planner.cluster_from_file)
    overrides = {k: v for k, v in (("micro_batch", args.micro_batch), ("global_batch", args.global_batch),
                                   ("seq_len", args.seq_len)) if v is not None}
    model = replace(model, **overrides)
    for label, value in (("--micro-batch", model.micro_batch), ("--global-batch", model.global_batch),
                         ("--seq-len", model.seq_len), ("--chunks", args.chunks or 1), ("--top", args.top),
                         ("--cp", 1 if args.cp is None else args.cp), ("--cp-min-tokens", args.cp_min_tokens)):
        runtime.require(value >= 1, f"{label} must be at least 1, not {value}")
    gpus = args.gpus if args.gpus is not None else None if args.layout else cluster.gpus_per_node
    runtime.require(gpus is None or gpus >= 1, f"--gpus must be at least 1, not {gpus}")
    runtime.require(args.cp is None or not args.layout, "--cp sets the search's CP: with --layout write cp= in it")
    runtime.require(args.cp is None or gpus % args.cp == 0, f"--cp {args.cp} does not divide the {gpus} GPUs")
    options = planner.Options(zero_stage=args.zero, reshard_after_forward=args.reshard_after_forward,
                              activation_checkpointing=None if args.activation_checkpointing == "search"
                              else args.activation_checkpointing, precision=args.precision,
                              sequence_parallel=args.sequence_parallel, schedule=args.schedule,
                              chunks=args.chunks if args.schedule == "interleaved_1f1b" else 1,
                              search_micro_batch=args.micro_batch is None, async_tp=args.async_tp,
                              ep_overlap=args.ep_overlap,
                              context_parallel=args.cp, cp_min_tokens=args.cp_min_tokens)
    return model, cluster, options, gpus


def gib(value: float) -> str:
    return f"{value / GIB:6.1f}"


def describe(plan: planner.Plan, model, cluster, say=print) -> None:
    """One layout in words: memory by part against the GPU, communication per dimension, time."""
    say(f"layout {plan.layout.label()} on {plan.layout.gpus} x {cluster.name}: "
        + ("fits" if plan.fits else f"does NOT fit ({plan.reason})")
        + (f"; settings: {plan.describe_settings()}" if plan.settings else ""))
    if plan.problems:
        return
    m = plan.memory_per_gpu_bytes
    say(f"  memory per GPU, GiB (derived; pipeline stage {plan.worst_stage}, the fullest): "
        + " + ".join(f"{k} {v / GIB:.2f}" for k, v in m.items() if k != "total")
        + f" = {m['total'] / GIB:.2f} of {cluster.gpu_bytes / GIB:.0f}")
    for dimension, seconds in plan.comm_seconds.items():
        if seconds:
            data = plan.comm_bytes_per_gpu[dimension]
            payload = ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in data["payload"].items())
            say(f"  {dimension}: {payload} per step; each GPU sends {data['sent'] / 1e9:.3g} GB, "
                f"{seconds:.3g} s on its link, {plan.exposed_seconds.get(dimension, 0.0):.3g} s of it exposed "
                f"(derived)")
    b = plan.bubble
    say(f"  bubble: {b['of_step']:.1%} of the step, {b['of_ideal']:.1%} of the ideal time ({b['seconds']:.3g} s)")
    # the rate the step time used: the stage's model FLOPs and recomputation over its compute seconds
    rate = plan.compute_flops / plan.compute_seconds / cluster.peak_flops
    say(f"  step {plan.step_seconds:.3g} s (compute {plan.compute_seconds:.3g} s at "
        f"{rate:.0%} of peak), {plan.tokens_per_second:,.0f} tokens/s, "
        f"MFU {plan.mfu:.1%} of {cluster.peak_flops / 1e12:.0f} TFLOP/s {cluster.dtype} dense (all derived)")


def print_table(plans, top: int) -> None:
    fitting = [p for p in plans if p.fits]
    width = max([28] + [len(p.layout.label()) for p in plans[:2 * top] + fitting[:top]])  # HSDP's labels are longer
    print(f"{'#':>3s}  {'layout':{width}s} {'GiB/GPU':>8s} {'step s':>8s} {'tokens/s':>12s} {'MFU':>6s}  {'bubble':>6s}  "
          "settings")
    for i, plan in enumerate(fitting[:top], 1):
        print(f"{i:3d}  {plan.layout.label():{width}s} {gib(plan.memory_per_gpu_bytes['total']):>8s} "
              f"{plan.step_seconds:8.3g} {plan.tokens_per_second:12,.0f} {plan.mfu:6.1%}  {plan.bubble['of_step']:6.1%}  "
              f"{plan.describe_settings()}")
    rejected = [p for p in plans if not p.fits]
    print(f"\n{len(fitting)} of {len(plans)} layouts fit; rejected ({len(rejected)}), first {min(top, len(rejected))}:")
    for plan in rejected[:top]:
        print(f"     {plan.layout.label():{width}s} {plan.reason}")


def dry_run(plan: planner.Plan, model, options, cluster) -> int:
    """--dry-run: the plan's layout at its full world size on a fake process group (``distlab.planner.dry_run``):
    the mesh's groups against the grid, and each sampled rank's state bytes read from its fp32 shards (bf16 parts
    halved) against the planner's (a MoE layout: its EP groups and its experts, chapter 13's layer). 0 when everything
    agrees, 1 otherwise."""
    from distlab.planner import dry_run as full_world

    if model.is_moe:
        if plan.layout.ep < 2:
            print(f"dry run: {model.name} is a mixture of experts; the dry run builds its EP layouts, not "
                  f"{plan.layout.label()}")
            return 1
        result = full_world.dry_run_experts(model, plan.layout, cluster, options)
        print(full_world.dry_run_experts_markdown(result))
        print(f"dry run: {len(result['ranks'])} ranks of {result['world']:,}: EP groups read from the DeviceMesh, "
              f"chapter 13's ExpertParallelMoE and fully_shard over the experts' data-parallel ranks built in "
              f"{result['seconds']:.1f} s; EP groups' nodes, experts and their state = the planner's: "
              f"{'equal' if result['equal'] else 'NOT equal'} (attention is not built)")
        return 0 if result["equal"] else 1

    wrong = full_world.check_mesh(plan.layout)
    spec = full_world.stand_in(model)
    if spec is not model:
        print(f"dry run: {model.name} is a {model.architecture} model; the course's LLaMA-style model of its sizes "
              "is built instead (the planner is asked about that same model)")
    settings = replace(options, activation_checkpointing=plan.settings.get("checkpointing"),
                       chunks=plan.settings.get("chunks"))
    result = full_world.dry_run(replace(spec, micro_batch=plan.settings.get("micro_batch", spec.micro_batch)),
                                plan.layout, settings)
    print(full_world.dry_run_markdown(result))
    verdict = "equal" if result["equal"] else "NOT equal"
    print(f"dry run: {len(result['ranks'])} ranks of {result['world']:,} built with the course's TP plan, "
          f"fully_shard and pipeline split in {result['seconds']:.1f} s; state bytes read from their shards = "
          f"the planner's (FSDP padding named): {verdict}")
    counted = {"equal": True}
    if plan.layout.cp == 1:
        # a step's collectives, counted at the same world size on a narrow copy of the model (see count_step)
        counted = full_world.count_step(spec, plan.layout)
        print(full_world.count_step_markdown(counted))
        print(f"dry run: one microbatch's forward and backward on those ranks ({counted['model']}: head size "
              f"{full_world.NARROW_HEAD_DIM}, same depth, heads and layout) in {counted['seconds']:.1f} s; TP and "
              f"FSDP collectives counted = the planner's (calls; bytes, FSDP padding named): "
              f"{'equal' if counted['equal'] else 'NOT equal'}")
    else:
        print("dry run: a step's collectives are counted for pp x dp x tp layouts; context parallelism's ring is "
              "measured by chapter 08's scripts")
    return 0 if result["equal"] and counted["equal"] and not wrong else 1


HYBRID = "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py"


def measure(args) -> int:
    """--measure: every rank plans the same layout (pure arithmetic, no collective), then runs it with chapter 09's
    fsdp_tp_hybrid.py in this process; rank 0 prints and writes predicted beside measured."""
    import runpy
    import tempfile
    from pathlib import Path

    from distlab import metrics, models, tensor_parallel

    where = runtime.launcher_env()
    try:
        cluster = preset_or_file("cluster", args.cluster, args.cluster_config, planner.CLUSTERS,
                                 planner.cluster_from_file)
        runtime.require(args.steps >= 3, f"--steps {args.steps}: --measure times the steps after the first two")
    except (OSError, ValueError, runtime.ConfigError) as error:
        sys.stderr.write(f"config error (rank {where.rank}): {error}\n")
        return runtime.CONFIG_ERROR_EXIT_CODE
    # the script trains in fp32 (state 16 B per parameter; compute at the fp32 dense peak)
    cluster = replace(cluster, peak_flops=metrics.PEAK_FLOPS[("A100", "fp32")], dtype="fp32") \
        if cluster.name.startswith("a100") else cluster
    cfg = models.preset(args.preset)
    batch = tensor_parallel.DEFAULT_BATCH[args.preset]
    options = planner.Options(zero_stage=3, precision="fp32", activation_checkpointing=False,
                              sequence_parallel=False, fsdp_keep_gathered=False)
    plans = []
    for tp in planner.divisors(where.world_size):
        dp = where.world_size // tp
        spec = planner.from_config(cfg, micro_batch=max(1, batch // dp), global_batch=batch)
        plans.append(planner.evaluate(spec, cluster, planner.Layout(tp=tp, dp=dp, zero_stage=3), options,
                                      where.world_size))
    fitting = sorted((p for p in plans if p.fits), key=lambda p: -p.tokens_per_second)
    if not fitting:
        reasons = "; ".join(f"{p.layout.label()}: {p.reason}" for p in plans)
        sys.stderr.write(f"config error (rank {where.rank}): no FSDP x TP layout of {where.world_size} ranks runs "
                         f"the {args.preset} model ({reasons})\n")
        return runtime.CONFIG_ERROR_EXIT_CODE
    plan = fitting[0]
    say = print if where.rank == 0 else (lambda *a, **k: None)
    say(f"planner: {plan.layout.label()} for the {args.preset} transformer on {where.world_size} ranks; "
        f"running it with {HYBRID}")
    measured_file = Path(tempfile.gettempdir()) / f"distlab-plan-measure-{where.master_port}.json"
    if where.rank == 0:
        measured_file.unlink(missing_ok=True)   # a stale file of an earlier run on this port must not be read
    saved_argv = sys.argv
    sys.argv = [HYBRID, "--dp", str(plan.layout.dp), "--tp", str(plan.layout.tp), "--preset", args.preset,
                "--device", args.device, "--steps", str(args.steps), "--metrics-out", str(measured_file)]
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[2] / HYBRID), run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code or 0
    finally:
        sys.argv = saved_argv
    if where.rank != 0:
        return code
    if not measured_file.exists():
        sys.stderr.write(f"{HYBRID} wrote no metrics (exit {code}): nothing to compare\n")
        return code or runtime.CHECK_FAILED_EXIT_CODE
    run = json.loads(measured_file.read_text())
    measured_file.unlink()   # read once; leave nothing behind in the temporary folder
    state, predicted = run["memory"]["measured"], plan.memory_per_gpu_bytes
    device = run["memory"].get("device", {})
    peak = device.get("peak_allocated_bytes")
    rows = [(part, predicted[part], state[part]) for part in ("params", "grads", "optimizer")]
    rows.append(("peak allocated (all parts but the reserve)", predicted["total"] - predicted["reserve"], peak))
    rows.append(("step seconds", plan.step_seconds, run["throughput"].get("step_seconds")))
    print(f"\n{'':44s} {'predicted (derived)':>20s} {'measured':>16s}")
    for name, guess, seen in rows:
        shown = "-" if seen is None else (f"{seen:16.3g}" if name == "step seconds" else f"{seen:16,.0f}")
        print(f"{name:44s} {guess:20.3g} {shown:>16s}" if name == "step seconds" else
              f"{name:44s} {guess:20,.0f} {shown:>16s}")
    # the planner proves itself on what the run measured exactly: the training state of a rank
    state_equal = all(int(guess) == seen for _, guess, seen in rows[:3])
    checks = run["checks"] + [{"name": "training state per GPU: planner (derived) = measured (params, grads, "
                                       "optimizer)", "passed": state_equal,
                               "value": [seen for _, _, seen in rows[:3]], "tolerance": "equal"}]
    print(f"planner's state per GPU = measured: {'PASS' if state_equal else 'FAIL'}")
    if args.metrics_out:
        Path(args.metrics_out).write_text(json.dumps({
            "script": "11_choosing_a_strategy/plan.py", "world_size": where.world_size, "device": run["device"],
            "config": vars(args), "losses": run["losses"], "checks": checks, "comm": run["comm"],
            "memory": run["memory"], "throughput": run["throughput"], "plan": plan.to_dict(),
            "measured_run": HYBRID, "rows": [{"what": n, "predicted": g, "measured": m} for n, g, m in rows],
            "measured_checks_passed": all(c["passed"] for c in run["checks"])}, default=str))
    return code if code or state_equal else runtime.CHECK_FAILED_EXIT_CODE


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.measure:
        code = measure(args)
        # the chapter 09 run registered an exit hook that ends the process with *its* report's code (it skips
        # tearing gloo down): leave now with ours, which adds the planner's own check
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        model, cluster, options, gpus = resolve(args)
        if args.layout:
            try:
                layout = planner.parse_layout(args.layout, zero_stage=1 if args.zero is None else args.zero)
            except (ValueError, TypeError) as error:
                raise runtime.ConfigError(str(error)) from None
            gpus = gpus or layout.gpus  # --layout alone: the job is the layout's GPUs
            plans = [planner.tune(model, cluster, layout, options, gpus)]
            runtime.require(not plans[0].problems, f"--layout {args.layout}: {plans[0].reason}")
        else:
            plans = planner.search(model, cluster, gpus, options)
            runtime.require(any(p.fits for p in plans),
                            f"{model.name} fits in no layout of {gpus} x {cluster.name} (the closest: "
                            f"{min(plans, key=lambda p: p.memory_per_gpu_bytes.get('total', float('inf'))).reason})"
                            if plans else f"no layout of {gpus} GPUs exists on {cluster.gpus_per_node}-GPU nodes")
    except runtime.ConfigError as error:
        sys.stderr.write(f"config error: {error}\n")
        return runtime.CONFIG_ERROR_EXIT_CODE

    if args.metrics_out:
        from pathlib import Path
        Path(args.metrics_out).write_text(json.dumps({"script": "11_choosing_a_strategy/plan.py", "gpus": gpus,
                                                      "layouts": [p.to_dict() for p in plans]}))
    if args.json:
        if args.layout:
            print(json.dumps(plans[0].to_dict()))
        else:
            print(json.dumps({"model": model.to_dict(), "cluster": cluster.to_dict(), "gpus": gpus,
                              "options": options.to_dict(), "layouts": [p.to_dict() for p in plans]}))
    else:
        print(f"{model.name}: {model.num_params() / 1e9:.2f} B parameters, {model.layers} layers, hidden "
              f"{model.hidden}, {model.heads} heads ({model.kv_heads} key/value), batch {model.global_batch} x "
              f"{model.seq_len} tokens, micro-batch {model.micro_batch}")
        print(f"cluster: {cluster.source or cluster.name}; {gpus} GPUs ({gpus / cluster.gpus_per_node:g} nodes)")
        print(f"options: {options.to_dict()}\n")
        if not args.layout:
            print_table(plans, args.top)
            print("\nbest layout:")
        describe(plans[0], model, cluster)
    if args.dry_run:
        return dry_run(plans[0], model, options, cluster)
    return 0


if __name__ == "__main__":
    sys.exit(main())
