"""``make gpu-check``: the course's scripts on the GPUs of this machine, in one command, under 10 minutes.

    make gpu-check                                  # = python -m coursetools.gpu_check
    python -m coursetools.gpu_check --plan-only         # what it would run here, and why not the rest
    python -m coursetools.gpu_check --plan-only --gpus 4 --gpu-memory-gib 40     # ... on another machine
    python -m coursetools.gpu_check --render build/gpu_check/summary.json        # the table again

On a machine with one or more NVIDIA GPUs it

1. finds the GPUs (name, memory) in a child process, so this process never holds a CUDA context;
2. runs every chapter script of ``RUNS`` with ``--device cuda`` through ``labkit.launch`` (torchrun: CUDA
   does not survive the fork launcher), each with a timeout, one rank per GPU (NCCL allows no more), bf16
   where the script offers it; the single-device baseline on the ``a100`` preset in bf16 comes first;
3. times a large device-to-device copy (device memory bandwidth);
4. writes ``summary.json`` (every run's status and metrics, and the figures below) and ``summary.txt`` (the
   table) under ``--out`` (default ``build/gpu_check``), with each run's output in ``logs/``.

The figures: the baseline's tokens/s (measured), achieved TFLOP/s and MFU against the dense bf16 peak of
the GPU found (derived: tokens/s x the model FLOPs per token of ``metrics.transformer_flops_per_token``);
the peak predicted by phase (``distlab.memory.predict_step_peak``: forward/backward or the optimizer step) against
``torch.cuda.max_memory_allocated`` for the baseline and the FSDP script at a size that fits, failing the check past
``MEMORY_MARGIN`` (2%); PyTorch's native context parallelism (``ring_attention.py --native``);
NCCL bus bandwidth from ``scripts/03_communication/bandwidth.py`` with 2+ GPUs.

World sizes: each script runs on one rank per GPU present. On a one-GPU machine the scripts that need two
ranks or more (a ring, a tensor or pipeline split) are listed as skipped, with the reason; the others run on
one rank. A script that refuses the world size it is given (its ``config error`` line) is reported as
"cannot run here", not as a failure; a failed check, a crash or a timeout fails the check (exit 1).

It only reads GPU properties, launches the course's scripts and times a copy: it never changes a GPU
setting (no persistence mode, clocks or resets). Without a GPU it says so in one line and exits 2.
The summary logic is pure functions (``plan_runs``, ``run_result``, ``summarize``, ``render_table``),
unit-tested on CPU with a synthetic recorded example (``tests/unit/data/gpu_check_example.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from distlab import runtime  # no torch: the parent never imports it (the probe runs in a child)

REPO_ROOT = Path(__file__).resolve().parent.parent
TIME_BUDGET_S = 540           # the chapter runs; discovery and the copy benchmark fit in the rest of 10 minutes
MIN_RUN_SECONDS = 20          # with less budget left than this, a run is not started
FIT_FRACTION = 0.85           # a model "fits" when predicted peak <= this share of the GPU's memory
MEMORY_MARGIN = 0.02          # max_memory_allocated = the phase model's peak within 2% (distlab.memory.PEAK_MARGIN)
NO_GPU_EXIT_CODE = 2
GB = 1e9                      # bandwidths and rates: GB/s = 10^9 bytes per second
# grouped against looped experts: both accumulate in fp32 and round the same intermediates, so they differ by the
# order of the sums only: a few ulps of the dtype (bf16's ulp at 1 is 7.8e-3)
GROUPED_TOLERANCE = {"bf16": 2e-2, "fp32": 1e-5}
GIB = 1024**3                 # memory sizes: GiB = 2^30 bytes, as torch reports them


# --------------------------------------------------------------------------------------------------
# The runs: one table. Every script in scripts/ is here or in NOT_ON_GPU (a unit test keeps it so).
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One launch of a chapter script on the GPUs.

    ``world``: "all" = one rank per GPU present, "one" = a single GPU, "half" = half of them (to reload a
    checkpoint on another number of ranks). ``min_gpus``: the script's own rule (a ring needs 2 ranks).
    ``role``: which figure of the summary it feeds, if any. In ``args``, ``{workdir}`` is the output folder,
    ``{world}`` the world size and ``{half}`` half of it (a 2-D mesh: tp 2 x dp world/2).
    """

    name: str
    script: str
    args: tuple = ()
    world: str = "all"
    min_gpus: int = 1
    timeout_s: int = 90
    role: str = ""


CH01, CH02, CH03 = "scripts/01_single_device_baseline", "scripts/02_why_distributed", "scripts/03_communication"
CH04, CH05, CH06 = "scripts/04_data_parallel", "scripts/05_fully_sharded", "scripts/06_tensor_parallel"
CH07, CH08 = "scripts/07_pipeline_parallel", "scripts/08_sequence_parallel"
CH09, CH10, CH12 = "scripts/09_hybrid_parallel", "scripts/10_domain_parallel", "scripts/12_hpc_operations"

# In order: the figures first, so a run out of time loses chapter checks, not the baseline.
RUNS: tuple[Run, ...] = (
    Run("baseline_a100_bf16", f"{CH01}/train_baseline.py", ("--preset", "a100", "--precision", "bf16", "--steps", "10"),
        world="one", timeout_s=150, role="baseline"),
    Run("fsdp_a100_memory", f"{CH05}/train_fsdp.py", ("--preset", "a100", "--batch", "{world}", "--steps", "3"),
        timeout_s=150, role="memory_fsdp"),
    Run("nccl_bandwidth", f"{CH03}/bandwidth.py",
        ("--min-bytes", "1M", "--max-bytes", "1G", "--iters", "10", "--warmup", "3"), min_gpus=2, timeout_s=90,
        role="nccl_bandwidth"),
    Run("ring_attention_native", f"{CH08}/ring_attention.py", ("--native",), min_gpus=2, timeout_s=60, role="native_cp"),
    Run("baseline_tiny", f"{CH01}/train_baseline.py"),
    Run("compute_and_memory_per_rank", f"{CH02}/compute_and_memory_per_rank.py"),
    Run("collectives", f"{CH03}/collectives.py", min_gpus=2),
    Run("ring_allreduce", f"{CH03}/ring_allreduce.py", min_gpus=2),
    Run("process_groups", f"{CH03}/process_groups.py", min_gpus=2),
    Run("ddp_from_scratch", f"{CH04}/ddp_from_scratch.py"),                       # fp32: compared with one device
    Run("ddp_from_scratch_bf16", f"{CH04}/ddp_from_scratch.py", ("--precision", "bf16", "--no-reference")),
    Run("train_ddp_compare", f"{CH04}/train_ddp.py", ("--compare",)),
    Run("train_ddp_bf16", f"{CH04}/train_ddp.py", ("--precision", "bf16")),
    Run("zero_stage1", f"{CH05}/zero_from_scratch.py", ("--stage", "1")),
    Run("zero_stage2", f"{CH05}/zero_from_scratch.py", ("--stage", "2")),
    Run("zero3_from_scratch", f"{CH05}/zero3_from_scratch.py"),                 # fp32: = one device and FSDP2
    Run("zero3_from_scratch_bf16", f"{CH05}/zero3_from_scratch.py", ("--mixed-precision",)),
    Run("train_fsdp", f"{CH05}/train_fsdp.py"),
    Run("train_fsdp_bf16", f"{CH05}/train_fsdp.py", ("--mixed-precision",)),
    Run("train_fsdp_compiled", f"{CH05}/train_fsdp.py", ("--mixed-precision", "--compile")),   # torchtitan's order
    Run("checkpoint_interrupt", f"{CH05}/checkpoint_resume.py", ("--stop-after", "3", "--save-dir", "{workdir}/ckpt")),
    Run("checkpoint_resume", f"{CH05}/checkpoint_resume.py", ("--resume", "--save-dir", "{workdir}/ckpt")),
    Run("checkpoint_reshard", f"{CH05}/checkpoint_resume.py", ("--world-size-check", "--save-dir", "{workdir}/ckpt"),
        world="half"),
    Run("tp_from_scratch", f"{CH06}/tp_from_scratch.py", min_gpus=2),
    Run("tp_transformer", f"{CH06}/tp_transformer.py", min_gpus=2),
    Run("tp_transformer_compiled", f"{CH06}/tp_transformer.py", ("--compile",), min_gpus=2),   # NCCL's events: "nccl:"
    Run("pp_manual", f"{CH07}/pp_manual.py", min_gpus=2),
    Run("pp_schedules", f"{CH07}/pp_schedules.py", ("--schedule", "1F1B"), min_gpus=2),
    Run("pp_train_1f1b", f"{CH07}/pp_train.py", ("--schedule", "1F1B"), min_gpus=2),
    Run("pp_train_zbv", f"{CH07}/pp_train.py", ("--schedule", "ZBVZeroBubble"), min_gpus=2),
    Run("sp_transformer", f"{CH08}/sp_transformer.py", min_gpus=2),
    Run("ring_attention", f"{CH08}/ring_attention.py", min_gpus=2),
    Run("rank_grid", f"{CH09}/rank_grid.py", ("--gpus-per-node", "{world}"), min_gpus=2),
    Run("fsdp_tp_hybrid", f"{CH09}/fsdp_tp_hybrid.py", ("--tp", "2", "--dp", "{half}"), min_gpus=2),
    Run("pp_dp_hybrid_ddp", f"{CH09}/pp_dp_hybrid.py", ("--dp-mode", "ddp"), min_gpus=2),
    Run("pp_dp_hybrid_fsdp", f"{CH09}/pp_dp_hybrid.py", ("--dp-mode", "fsdp"), min_gpus=2),
    Run("hybrid_3d", f"{CH09}/hybrid_3d.py", ("--pp", "2", "--tp", "2"), min_gpus=4),   # dp: the ranks left over
    Run("halo_conv", f"{CH10}/halo_conv.py", min_gpus=2),
    Run("domain_train", f"{CH10}/domain_train.py", min_gpus=2),
    # a planted hang must end in seconds with its diagnosis on NCCL too (its watchdog, not gloo's timeout)
    Run("deadlocks_none", f"{CH12}/deadlocks.py", ("--hang", "none"), min_gpus=4, timeout_s=60),
    Run("deadlocks_skipped_barrier", f"{CH12}/deadlocks.py", ("--hang", "skipped-barrier"), min_gpus=4, timeout_s=60),
    # the planner's layout run by chapter 09's script: predicted state per GPU = measured, step time beside it
    Run("plan_measure", "scripts/11_choosing_a_strategy/plan.py", ("--measure", "--preset", "tiny"), min_gpus=2),
    # a plain run (no rank killed): DCP checkpoints of a DDP model on the GPUs, losses = one device
    Run("fault_drill", f"{CH12}/fault_drill.py", ("--run-dir", "{workdir}/fault_drill")),
    # the trace's NCCL kernels counted against CommCounter; FSDP2 must overlap on a GPU (CUDA streams)
    Run("profile_step_ddp", f"{CH12}/profile_step.py", ("--strategy", "ddp", "--trace-dir", "{workdir}/traces")),
    Run("profile_step_fsdp", f"{CH12}/profile_step.py", ("--strategy", "fsdp", "--trace-dir", "{workdir}/traces")),
    # each knob's buckets, bytes and saved activations against its formula on NCCL and CUDA (the microbatch
    # sweep needs 2 GPUs: on one it is left out)
    Run("tuning", f"{CH12}/tuning.py"),
    # the MoE layer's experts over every GPU: NCCL's all-to-all with uneven splits, = one device
    Run("ep_from_scratch", "scripts/13_expert_parallel/ep_from_scratch.py"),
    Run("moe_transformer", "scripts/13_expert_parallel/moe_transformer.py", ("--batch", "{world}")),
    # the same at the a100 preset's widths (the PBS job's): Adam's near-zero-gradient flips counted, not refused
    Run("moe_transformer_a100", "scripts/13_expert_parallel/moe_transformer.py",
        ("--preset", "a100", "--batch", "{world}"), timeout_s=150),
    # TP for attention beside EP: each TP pair routes half of its tokens; NCCL's all-gather over TP
    Run("moe_transformer_tp", "scripts/13_expert_parallel/moe_transformer.py", ("--tp", "2", "--batch", "{world}"),
        min_gpus=2),
)

# Scripts deliberately left out, each with its reason. (common_*.py files are helpers, not scripts.)
NOT_ON_GPU: dict[str, str] = {}


@dataclass(frozen=True)
class Planned:
    """A run as it will be launched here: its world size and arguments, or why it is skipped."""

    run: Run
    world_size: int
    args: tuple
    skip: str | None = None


def world_size_of(run: Run, gpu_count: int) -> int:
    return {"all": gpu_count, "one": 1, "half": max(1, gpu_count // 2)}[run.world]


def fsdp_a100_peak_bytes(world_size: int, batch: int) -> int:
    """Predicted peak of one rank of train_fsdp.py --preset a100, by phase (``memory.predict_step_peak``): the
    ZeRO-3 shards, the activations of its rows (the fp32 formula with 2-byte activations: bf16 compute; an estimate
    for planning), the loss gradients and FSDP's gathered units in forward/backward; 20/N bytes a parameter in the
    foreach AdamW step."""
    from distlab import memory, models

    cfg = models.preset("a100_large")
    state = memory.zero_state_bytes(cfg.num_params(), world_size, 3, precision="fp32")
    rows = max(1, batch // world_size)
    units = memory.fsdp_unit_bytes(cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.num_params(), param_bytes=2)
    return memory.predict_step_peak(state, memory.transformer_activation_bytes(cfg, rows, dtype_bytes=2), rows,
                                    cfg.seq_len, cfg.vocab_size, fsdp_units=units).peak


def plan_runs(gpu_count: int, gpu_memory_bytes: int, workdir: str | os.PathLike, runs=RUNS) -> list[Planned]:
    """Which runs this machine gets, with which world size and arguments (``--device cuda`` added), and why not."""
    planned = []
    for run in runs:
        world = world_size_of(run, gpu_count)
        args = tuple(a.replace("{workdir}", str(workdir)).replace("{world}", str(world))
                     .replace("{half}", str(max(1, world // 2))) for a in run.args)
        args += ("--device", "cuda")
        skip = None
        if gpu_count < run.min_gpus:
            skip = f"needs {run.min_gpus}+ GPUs (NCCL: one rank per GPU), {gpu_count} present"
        elif run.role == "memory_fsdp":
            predicted = fsdp_a100_peak_bytes(world, world)
            if predicted > FIT_FRACTION * gpu_memory_bytes:
                skip = (f"does not fit: predicted {predicted / GIB:.1f} GiB per rank on {world} GPU(s) > "
                        f"{FIT_FRACTION:.0%} of {gpu_memory_bytes / GIB:.1f} GiB")
        planned.append(Planned(run, world, args, skip))
    return planned


# --------------------------------------------------------------------------------------------------
# One run's outcome, from what labkit.launch returned (pure)
# --------------------------------------------------------------------------------------------------


def run_result(planned: Planned, returncode: int | None, output: str, seconds: float, metrics: dict | None,
               timed_out: bool = False, limit_s: float | None = None) -> dict:
    """The summary's row for one run. Status: passed, failed, crashed, timeout, bad flags, cannot run here, skipped.

    ``passed`` needs exit code 0 *and* a metrics file whose checks all passed, at least one of them.
    """
    row = {"name": planned.run.name, "script": planned.run.script, "world_size": planned.world_size,
           "command": shlex.join(["torchrun", "--standalone", f"--nproc_per_node={planned.world_size}",
                                  planned.run.script, *planned.args]),
           "role": planned.run.role, "seconds": round(seconds, 1), "checks_passed": 0, "checks_total": 0,
           "failed_checks": [], "reason": None, "metrics": None}
    if planned.skip is not None:
        return {**row, "status": "skipped", "reason": planned.skip}
    lines = output.splitlines()
    config_errors = [ln for ln in lines if ln.startswith("config error")]
    if metrics is not None:
        checks = metrics.get("checks", [])
        row.update(checks_passed=sum(bool(c["passed"]) for c in checks), checks_total=len(checks),
                   failed_checks=[c["name"] for c in checks if not c["passed"]],
                   metrics={k: v for k, v in metrics.items() if k != "timeline"})  # timelines: long, not needed
    # A rank that exits 2 makes torchrun's agent exit 1: the output, not the exit code, tells what happened.
    if timed_out:
        # the limit, not the clock: stopping torchrun and its ranks takes seconds more on a busy machine
        limit = planned.run.timeout_s if limit_s is None else limit_s
        status, reason = "timeout", f"killed at its {limit:.0f} s limit"
    elif returncode in (1, 2) and config_errors:
        status, reason = "cannot run here", config_errors[0]
    elif returncode in (1, 2) and any("error: unrecognized arguments" in ln or "error: argument" in ln for ln in lines):
        status, reason = "bad flags", next(ln for ln in lines if "error:" in ln)
    elif returncode == 0 and metrics is not None and row["checks_total"] > 0 and not row["failed_checks"]:
        status = "passed"
        reason = None
    elif returncode == 1 and row["failed_checks"]:
        status, reason = "failed", f"{len(row['failed_checks'])} check(s) failed"
    else:
        from labkit.launch import first_error

        status = "crashed"
        reason = first_error(output) or (f"exit code {returncode}" + ("" if metrics is not None else ", no metrics"))
        if returncode == 0:
            reason = "exit code 0 but " + ("no metrics file" if metrics is None else "no checks / a failed check")
    return {**row, "status": status, "reason": reason}


FAILING = ("failed", "crashed", "timeout", "bad flags")


# --------------------------------------------------------------------------------------------------
# The summary and its table (pure: the unit tests feed them a recorded example)
# --------------------------------------------------------------------------------------------------


def copy_bandwidth_gb_per_s(nbytes: int, seconds_per_copy: float) -> float:
    """Device memory bandwidth of a copy: it reads ``nbytes`` and writes ``nbytes``, so 2 x nbytes are moved
    (STREAM's Copy counts the same way). In GB/s, 1 GB = 10^9 bytes."""
    return 2 * nbytes / seconds_per_copy / GB


MEMORY_EXPLANATION = (
    "Predicted by phase (distlab.memory.predict_step_peak), because not everything is alive at once: with "
    "zero_grad(set_to_none=True) the gradients are created in backward while the activations are freed. "
    "Forward/backward peaks at the top of backward: weights, AdamW moments, every saved activation (read off the "
    "tensors) and the loss's two fp32 gradients of B x T x V numbers (plus FSDP's gathered root), or under FSDP "
    "while a block's backward runs (the root's weights and gradients, the block's units: memory.fsdp_unit_bytes). "
    "The optimizer step holds weights, gradients, moments and foreach AdamW's temporary (_foreach_sqrt of exp_avg_sq: "
    "4 B a parameter), 20 B a parameter. The peak is the larger phase; max_memory_allocated must equal it within the "
    "margin. What the model leaves out does not shrink with it: allocator rounding (blocks are multiples of 512 B) "
    "and kernel workspaces (cuBLAS), about 70 MiB on an H200, so a prediction under 6 GiB is not checked.")


def _baseline_figures(row: dict, gpu_name: str) -> dict:
    from distlab import metrics as metrics_module

    throughput = (row.get("metrics") or {}).get("throughput") or {}
    precision = (row.get("metrics") or {}).get("config", {}).get("precision")
    tokens_per_s, flops_per_token = throughput.get("tokens_per_s"), throughput.get("flops_per_token")
    if not tokens_per_s or not flops_per_token:
        return {"status": row["status"], "reason": row.get("reason") or "no throughput in the metrics"}
    achieved = tokens_per_s * flops_per_token
    peak = metrics_module.peak_flops(gpu_name, "bf16")
    return {"status": row["status"], "gpu": gpu_name, "precision": precision,
            "tokens_per_s": tokens_per_s, "tokens_per_s_is": "measured",
            "flops_per_token": flops_per_token, "achieved_tflops": achieved / 1e12,
            "bf16_peak_tflops": None if peak is None else peak / 1e12,
            "mfu": None if peak is None else achieved / peak,
            "achieved_tflops_and_mfu_are": "derived: measured tokens/s x formula FLOPs/token (6N + 12LdT)",
            "mfu_note": None if peak is not None else f"no dense bf16 peak known for {gpu_name!r}: no MFU claimed",
            "step_seconds": throughput.get("step_seconds")}


def _verdict(passed) -> str:
    return "not checked (under memory.PEAK_CHECK_MIN_BYTES)" if passed is None else "PASS" if passed else "FAIL"


def _memory_row(row: dict, margin: float = MEMORY_MARGIN) -> dict:
    """The peak predicted by phase (distlab.memory.predict_step_peak) from the run's own figures (the state read off
    its tensors after a step, the activations read off the saved tensors, its rows, sequence length and vocabulary)
    against the allocator's peak, for one run's rank 0; ``passed``: within ``margin`` of the prediction, None (not
    checked) under ``memory.PEAK_CHECK_MIN_BYTES`` predicted, as the scripts do (fixed costs: cuBLAS's workspaces)."""
    from distlab import memory as memory_model

    metrics = row.get("metrics") or {}
    memory, config = metrics.get("memory") or {}, metrics.get("config") or {}
    device = memory.get("device") or {}
    measured = device.get("peak_allocated_bytes")
    out = {"run": row["name"], "status": row["status"], "world_size": row["world_size"]}
    if measured is None:
        return {**out, "reason": row.get("reason") or "no CUDA allocator figures in the metrics"}
    model = config["model"]

    def state_of(figures):
        return memory_model.StateBytes(*(int(figures[k]) for k in ("params", "grads", "optimizer")))

    if "measured_state" in memory:   # train_baseline.py: the whole model on one device
        state, activations, rows, units = (state_of(memory["measured_state"]), memory["measured_activations"],
                                           config["batch"], None)
    else:                            # train_fsdp.py: this rank's shards, its rows, FSDP2's gathered units
        state, activations = state_of(memory["measured"]), memory["saved_activation_bytes"]
        rows = config["batch"] // row["world_size"]
        shard = row["world_size"] // config.get("replicate", 1)   # HSDP: the table is over the shard group
        num_params = round(sum(memory["analytic"][k] for k in ("params", "grads", "optimizer")) * shard
                           / 16)    # the ZeRO-3 table: 16 B a parameter over the shard group's ranks
        units = memory_model.fsdp_unit_bytes(model["vocab_size"], model["dim"], model["n_layers"], num_params,
                                             param_bytes=2 if config.get("mixed_precision") else 4)
    phases = memory_model.predict_step_peak(state, activations, rows, model["seq_len"], model["vocab_size"],
                                            fsdp_units=units)
    predicted = phases.peak
    return {**out, "phases": phases.as_dict()["phases"], "peak_phase": phases.peak_phase,
            "predicted_bytes": predicted, "peak_allocated_bytes": measured, "reserved_bytes": device.get("reserved_bytes"),
            "difference_bytes": measured - predicted, "ratio": measured / predicted, "margin": margin,
            "passed": (memory_model.within_margin(predicted, measured, margin)
                       if predicted >= memory_model.PEAK_CHECK_MIN_BYTES else None)}


def _nccl_figures(row: dict) -> dict:
    rows = ((row.get("metrics") or {}).get("extra") or {}).get("bandwidth") or []
    if not rows:
        return {"status": row["status"], "reason": row.get("reason")}
    best = {}
    for r in rows:
        if r["collective"] not in best or r["busbw"] > best[r["collective"]]["busbw"]:
            best[r["collective"]] = r
    return {"status": row["status"], "world_size": row["world_size"], "unit": "GB/s (10^9 bytes/s)",
            "convention": "bus bandwidth = payload / time x 2(n-1)/n (all-reduce) or (n-1)/n (all-gather, "
                          "reduce-scatter), as nccl-tests; best over payload sizes",
            "peak_bus_bandwidth": {c: {"busbw_gb_per_s": r["busbw"] / GB, "payload_bytes": r["bytes"]}
                                   for c, r in best.items()}}


def summarize(machine: dict, results: list[dict], copy_bandwidth: dict | None, when: str | None = None) -> dict:
    """The JSON summary: the machine, every run's row, and the figures the issue asks for."""
    by_role = {r["role"]: r for r in results if r.get("role")}
    gpu_name = machine["gpus"][0]["name"]
    counts = {}
    for r in results:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    memory = [_memory_row(by_role[role]) for role in ("baseline", "memory_fsdp") if role in by_role]
    summary = {"when": when, "machine": machine, "counts": counts,
               # a measured peak off the phase model by more than its margin fails the check, as a failed run does
               "ok": not any(r["status"] in FAILING for r in results) and all(m.get("passed") is not False for m in memory),
               "runs": results,
               "baseline": _baseline_figures(by_role["baseline"], gpu_name) if "baseline" in by_role else None,
               "memory": memory,
               "memory_explanation": MEMORY_EXPLANATION,
               "native_context_parallel": None, "nccl_bus_bandwidth": None, "device_memory_bandwidth": copy_bandwidth}
    if "native_cp" in by_role:
        row = by_role["native_cp"]
        native = [c for c in ((row.get("metrics") or {}).get("checks") or []) if c["name"].startswith("native")]
        summary["native_context_parallel"] = {"status": row["status"], "reason": row.get("reason"),
                                              "checks": native}
    if "nccl_bandwidth" in by_role:
        summary["nccl_bus_bandwidth"] = _nccl_figures(by_role["nccl_bandwidth"])
    return summary


def torch_pin_note(torch_version: str, requirements: str) -> str | None:
    """A note when this torch is not the one ``requirements.txt`` pins (a GPU node's own image, say): a crash on
    a torch API that the pinned version has is then the version's doing, not the GPU's. None when they agree."""
    pinned = next((line.split("==", 1)[1].strip() for line in requirements.splitlines()
                   if line.strip().startswith("torch==")), None)
    if pinned is None or torch_version.split("+")[0] == pinned:
        return None
    return (f"torch {torch_version} here, the course pins torch=={pinned}: a run that crashes on a torch API "
            f"(AttributeError: no attribute, TypeError: unexpected keyword) needs the pinned version, "
            f"not a fix for the GPU")


def select_runs(plan: list[Planned], only: list[str] | None) -> list[Planned]:
    """The runs named by ``--only`` (every run when None), in the table's order; an unknown name is refused."""
    if not only:
        return plan
    unknown = sorted(set(only) - {p.run.name for p in plan})
    if unknown:
        raise runtime.ConfigError(f"--only {' '.join(unknown)}: no such run (see --plan-only for the names)")
    return [p for p in plan if p.run.name in only]


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.2f} GiB"


def render_table(summary: dict) -> str:
    """The summary as text: the machine, one line per run, then the figures."""
    machine = summary["machine"]
    gpus = machine["gpus"]
    out = []
    if machine.get("note"):
        out.append(f"NOTE: {machine['note']}")
    out.append(f"gpu-check {summary.get('when') or ''}: {len(gpus)} x {gpus[0]['name']} "
               f"({gpus[0]['memory_bytes'] / GIB:.1f} GiB), torch {machine.get('torch')}, CUDA {machine.get('cuda')}")
    out.append("")
    out.append(f"{'run':<28} {'ranks':>5} {'status':<15} {'checks':>7} {'seconds':>8}  reason")
    for r in summary["runs"]:
        checks = f"{r['checks_passed']}/{r['checks_total']}" if r["checks_total"] else "-"
        out.append(f"{r['name']:<28} {r['world_size']:>5} {r['status']:<15} {checks:>7} {r['seconds']:>8.1f}  "
                   f"{r['reason'] or ''}".rstrip())
    out.append(f"overall: {'PASS' if summary['ok'] else 'FAIL'} "
               f"({', '.join(f'{n} {s}' for s, n in sorted(summary['counts'].items()))})")
    base = summary.get("baseline")
    out.append("")
    if base and base.get("tokens_per_s"):
        mfu = (f"MFU {base['mfu']:.1%} of {base['bf16_peak_tflops']:.0f} TFLOP/s (dense bf16 peak of {base['gpu']})"
               if base["mfu"] is not None else base["mfu_note"])
        out.append(f"baseline (a100 preset, {base['precision']}, 1 GPU): {base['tokens_per_s']:,.0f} tokens/s "
                   f"(measured); {base['achieved_tflops']:.1f} TFLOP/s achieved, {mfu} (derived)")
    elif base:
        out.append(f"baseline: {base['status']}: {base.get('reason')}")
    for m in summary["memory"]:
        if "phases" not in m:
            out.append(f"memory, {m['run']}: {m['status']}: {m.get('reason')}")
            continue
        out.append(f"memory, {m['run']} (rank 0 of {m['world_size']}): {_verdict(m['passed'])}, predicted "
                   f"peak {_gib(m['predicted_bytes'])} ({m['peak_phase']}), max_memory_allocated "
                   f"{_gib(m['peak_allocated_bytes'])} (ratio {m['ratio']:.3f}, difference {_gib(m['difference_bytes'])}, "
                   f"margin {m['margin']:.0%}), reserved {_gib(m['reserved_bytes'])}")
        for phase, figures in m["phases"].items():
            out.append(f"    {phase}: {_gib(figures['total'])} = "
                       + " + ".join(f"{term} {_gib(nbytes)}" for term, nbytes in figures["terms"].items()))
    if summary["memory"]:
        out.append(f"    the model: {summary['memory_explanation']}")
    native = summary.get("native_context_parallel")
    if native:
        worst = max((c["value"] for c in native["checks"] if isinstance(c.get("value"), (int, float))), default=None)
        out.append(f"native context parallelism (ring_attention.py --native): {native['status']}"
                   + (f", largest relative difference {worst:.1e}" if worst is not None else "")
                   + (f" ({native['reason']})" if native.get("reason") else ""))
    copy = summary.get("device_memory_bandwidth")
    if copy:
        out.append(f"device memory bandwidth: {copy['gb_per_s']:.0f} GB/s ({copy['convention']})")
    grouped = summary.get("experts_grouped_against_loop")
    if grouped and "error" in grouped:
        out.append(f"chapter 13's experts, grouped against loop: not compared ({grouped['error']})")
    elif grouped:
        t = grouped["seconds_forward_backward"]
        out.append(f"chapter 13's experts, grouped matrix multiply against a loop ({grouped['experts']} experts, "
                   f"{grouped['rows']} rows, {grouped['dtype']}): {'PASS' if grouped['passed'] else 'FAIL'}, largest "
                   f"relative difference {grouped['largest_relative_difference']:.1e} (tolerance "
                   f"{grouped['tolerance']:.0e}); forward + backward {t['grouped'] * 1e3:.2f} ms grouped, "
                   f"{t['looped'] * 1e3:.2f} ms looped (measured), x{grouped['speedup']:.2f}; the layer's forward "
                   f"uses {'grouped_mm' if grouped['grouped_mm_in_forward'] else 'the loop'} here")
    nccl = summary.get("nccl_bus_bandwidth")
    if nccl and nccl.get("peak_bus_bandwidth"):
        parts = [f"{c} {v['busbw_gb_per_s']:.1f} GB/s at {v['payload_bytes'] / 2**20:.0f} MiB"
                 for c, v in nccl["peak_bus_bandwidth"].items()]
        out.append(f"NCCL bus bandwidth, {nccl['world_size']} GPUs: " + ", ".join(parts))
    elif nccl:
        out.append(f"NCCL bus bandwidth: {nccl['status']}: {nccl.get('reason')}")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------
# What touches the GPU: done in child processes, so this process never holds a CUDA context
# --------------------------------------------------------------------------------------------------


def _probe() -> dict:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": properties.name, "memory_bytes": properties.total_memory,
                         "capability": f"{properties.major}.{properties.minor}"})
    return {"gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None}


def _measure_copy(nbytes: int = GIB, copies: int = 20, repeats: int = 5, device: str = "cuda") -> dict:
    """Time ``copies`` device-to-device copies of ``nbytes``, ``repeats`` times; keep the fastest block.

    (``device="cpu"`` exists so a unit test runs this code on a machine without a GPU; the figure is a GPU's.)
    """
    import torch

    def wait():  # CUDA copies are queued: the clock may be read only when the queue is empty
        if device == "cuda":
            torch.cuda.synchronize()

    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):  # warm-up: the first copies pay for set-up
        target.copy_(source)
    blocks = []
    for _ in range(repeats):
        wait()
        started = time.perf_counter()
        for _ in range(copies):
            target.copy_(source)
        wait()
        blocks.append((time.perf_counter() - started) / copies)
    seconds = min(blocks)
    return {"gb_per_s": copy_bandwidth_gb_per_s(nbytes, seconds), "bytes_per_copy": nbytes, "seconds_per_copy": seconds,
            "device": torch.cuda.get_device_name(0) if device == "cuda" else device,
            "convention": "a copy of S bytes moves 2S (S read + S written), as STREAM's Copy; GB = 10^9 bytes; "
                          f"best of {repeats} blocks of {copies} copies of {nbytes / 2**20:.0f} MiB, GPU 0"}


def _compare_expert_paths(device: str = "cuda", dtype_name: str = "bf16", rows: int = 32768, experts: int = 8,
                          dim: int = 1024, hidden: int = 2816, repeats: int = 10) -> dict:
    """Chapter 13's experts two ways on the same rows: ``Experts.grouped`` (torch's grouped matrix multiply, one
    kernel per weight) against ``Experts.looped`` (a matrix multiply per expert). Outputs and every gradient are
    compared; each path's forward + backward is timed (device synchronised before each clock read), best of
    ``repeats``. One expert gets no row: the grouped kernel must handle an empty group; and each path first takes
    the gradient of ``out.sum()`` (zero strides), which the grouped kernel's backward once refused.

    (``device="cpu"`` lets a unit test run it without a GPU: torch's CPU grouped_mm is a loop of its own.)
    """
    import torch

    from distlab import moe

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]

    def wait():
        if device == "cuda":
            torch.cuda.synchronize()

    torch.manual_seed(0)
    layer = moe.Experts(experts, dim, hidden).to(device)
    counts = torch.distributions.Multinomial(rows, torch.ones(experts)).sample().long()
    counts[-1] += counts[0]   # expert 0 gets no row
    counts[0] = 0
    counts = counts.tolist()
    x = torch.randn(rows, dim, device=device, dtype=dtype)
    upstream = torch.randn(rows, dim, device=device, dtype=dtype)
    results, seconds = {}, {}
    for name in ("grouped", "looped"):
        path = getattr(layer, name)
        inputs = x.clone().requires_grad_(True)
        path(inputs, counts).sum().backward()   # a gradient with zero strides, as a loss.sum() sends back
        inputs.grad = None
        layer.zero_grad(set_to_none=True)
        out = path(inputs, counts)
        out.backward(upstream)
        # copies: the timed backward passes below accumulate into these very .grad tensors
        results[name] = [t.detach().float().clone() for t in (out, inputs.grad, layer.w1.grad, layer.w3.grad,
                                                               layer.w2.grad)]
        blocks = []
        for _ in range(repeats):
            wait()
            started = time.perf_counter()
            path(inputs, counts).backward(upstream)
            wait()
            blocks.append(time.perf_counter() - started)
        seconds[name] = min(blocks)

    def relative(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()

    names = ("output", "input gradient", "w1 gradient", "w3 gradient", "w2 gradient")
    differences = {n: relative(g, lo) for n, g, lo in zip(names, results["grouped"], results["looped"])}
    largest = max(differences.values())
    flops = 3 * 2 * 3 * rows * dim * hidden       # three matrices, 2 FLOPs a multiply-add, forward + 2 x backward
    return {"device": torch.cuda.get_device_name(0) if device == "cuda" else device, "dtype": dtype_name,
            "grouped_mm_in_forward": moe.grouped_mm_available(x), "rows": rows, "experts": experts, "dim": dim,
            "hidden": hidden, "counts": counts, "relative_difference": differences,
            "largest_relative_difference": largest, "tolerance": GROUPED_TOLERANCE[dtype_name],
            "passed": largest <= GROUPED_TOLERANCE[dtype_name],
            "seconds_forward_backward": seconds, "speedup": seconds["looped"] / seconds["grouped"],
            "tflops": {n: flops / t / 1e12 for n, t in seconds.items()},
            "tflops_are": "derived: 18 x rows x dim x hidden FLOPs / measured seconds"}


def _in_child(what: str, timeout: float = 120) -> dict:
    done = subprocess.run([sys.executable, "-m", "coursetools.gpu_check", "--child", what], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed in a child process:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _no_gpu_here() -> str | None:
    """Why this machine cannot run the check, or None. Cheap first (no torch import without a device node)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return "no NVIDIA GPU visible (CUDA_VISIBLE_DEVICES is empty)"
    if not any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):  # dxg: WSL2
        return "no NVIDIA GPU on this machine (no /dev/nvidia* device)"
    return None


def _launch(planned: Planned, logs: Path, budget_left: float, budget_s: float = TIME_BUDGET_S) -> dict:
    from labkit import launch

    if planned.skip is not None:
        return run_result(planned, None, "", 0.0, None)
    if budget_left < MIN_RUN_SECONDS:
        return run_result(Planned(planned.run, planned.world_size, planned.args,
                                  f"time budget of {budget_s:.0f} s spent"), None, "", 0.0, None)
    timeout = min(planned.run.timeout_s, budget_left)
    print(f"  {planned.run.name}: {planned.world_size} rank(s), timeout {timeout:.0f} s ...", end=" ", flush=True)
    try:
        result = launch.run(planned.run.script, nproc=planned.world_size, args=list(planned.args),
                            launcher="torchrun", timeout=timeout, stream=False, check=False,
                            env={"DISTLAB_PG_TIMEOUT": str(int(timeout))})
        row = run_result(planned, result.returncode, result.output, result.seconds, result.metrics)
        output = result.output
    except launch.LaunchError as error:  # raised only for a timeout when check=False
        row = run_result(planned, None, error.result.output, error.result.seconds, None, timed_out=True,
                         limit_s=timeout)
        output = error.result.output
    (logs / f"{planned.run.name}.log").write_text(row["command"] + "\n" + output)
    print(f"{row['status']} ({row['seconds']:.0f} s)" + (f": {row['reason']}" if row["reason"] else ""), flush=True)
    return row


def _plan_text(plan: list[Planned]) -> str:
    return "\n".join(f"  {p.run.name:<28} {p.world_size} rank(s)  "
                     + (f"SKIP: {p.skip}" if p.skip else shlex.join([p.run.script, *p.args])) for p in plan)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="build/gpu_check", help="folder of summary.json, summary.txt and logs/")
    p.add_argument("--plan-only", action="store_true", help="print what would run here (or on --gpus), run nothing")
    p.add_argument("--gpus", type=runtime.positive_int, default=None, help="with --plan-only: plan for this many GPUs")
    p.add_argument("--gpu-memory-gib", type=runtime.positive_float, default=40.0, help="with --plan-only --gpus: memory of each")
    p.add_argument("--budget-s", type=runtime.positive_float, default=TIME_BUDGET_S,
                   help=f"seconds for all the script runs (default {TIME_BUDGET_S}); a run is not started with "
                        f"less than {MIN_RUN_SECONDS} s left")
    p.add_argument("--only", nargs="+", metavar="RUN", default=None,
                   help="run only these (names as --plan-only lists them): rerun one failure, say")
    p.add_argument("--render", metavar="SUMMARY_JSON", default=None, help="print the table of a summary.json")
    p.add_argument("--child", choices=["probe", "copy", "grouped_mm"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:  # runs in a child process: one line of JSON
        child = {"probe": _probe, "copy": _measure_copy, "grouped_mm": _compare_expert_paths}[args.child]
        print(json.dumps(child()))
        return 0
    if args.render:
        print(render_table(json.loads(Path(args.render).read_text())))
        return 0
    out = Path(args.out)
    if args.plan_only and args.gpus is not None:
        print(_plan_text(plan_runs(args.gpus, int(args.gpu_memory_gib * GIB), out)))
        return 0

    reason = _no_gpu_here()
    machine = None if reason else _in_child("probe")
    if machine is not None and not machine["gpus"]:
        reason = f"no CUDA GPU visible to torch {machine['torch']} (CUDA {machine['cuda']})"
    if reason:
        sys.stderr.write(f"config error: {reason}: make gpu-check needs an NVIDIA GPU; nothing was run\n")
        return NO_GPU_EXIT_CODE

    gpus = machine["gpus"]
    try:
        plan = select_runs(plan_runs(len(gpus), min(g["memory_bytes"] for g in gpus), out.resolve()), args.only)
    except runtime.ConfigError as error:
        sys.stderr.write(f"config error: {error}\n")
        return NO_GPU_EXIT_CODE
    machine["note"] = machine.get("note") or torch_pin_note(machine["torch"],
                                                            (REPO_ROOT / "requirements.txt").read_text())
    print(f"gpu-check: {len(gpus)} x {gpus[0]['name']}, torch {machine['torch']}, CUDA {machine['cuda']}")
    if machine["note"]:
        print(f"NOTE: {machine['note']}")
    if args.plan_only:
        print(_plan_text(plan))
        return 0
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "ckpt", ignore_errors=True)  # the checkpoint runs start from an empty folder
    started = time.monotonic()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results = [_launch(planned, logs, args.budget_s - (time.monotonic() - started), args.budget_s)
               for planned in plan]
    try:
        copy = _in_child("copy")
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        copy = None
        print(f"device memory bandwidth: not measured ({str(error).splitlines()[0]})")
    try:
        grouped = _in_child("grouped_mm")
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        grouped = {"error": str(error).splitlines()[0]}
        print(f"grouped matrix multiply: not compared ({grouped['error']})")
    summary = summarize(machine, results, copy, when)
    summary["experts_grouped_against_loop"] = grouped
    summary["ok"] = summary["ok"] and grouped.get("passed", False)
    table = render_table(summary)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "summary.txt").write_text(table + "\n")
    print("\n" + table)
    print(f"\nwritten: {out / 'summary.json'}, {out / 'summary.txt'}, logs in {logs} "
          f"({time.monotonic() - started:.0f} s in all)")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
