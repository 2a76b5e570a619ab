"""``make gpu-ladder``: chapter 01's ladder on one GPU, rung by rung, in one command (under 8 minutes: 456 s, H100).

    python -m coursetools.gpu_ladder                       # every rung, then the best one profiled
    python -m coursetools.gpu_ladder --only bf16 compiled  # chosen rungs
    python -m coursetools.gpu_ladder --render build/gpu_ladder/ladder.json

Each rung is one run of ``scripts/01_single_device_baseline/train_baseline.py`` with the switches of the rung before
it and one more (``RUNGS``): the same model, data and losses (the script's own checks, and on the CPU the tests,
prove that no switch changes what is computed); only how the step runs changes. For each rung it keeps tokens/s
(measured, over the steps after the first), MFU against the GPU's dense bf16 peak (derived: tokens/s x the model's
FLOPs per token / the peak; one denominator for every rung, the fp32 one too, so the rungs compare), the peak of
allocated memory (measured), and the checks. The ``compiled_batch16`` rung also profiles one more step, untimed
(``--profile-out``): where a step's device time goes (``distlab.profiling.device_time_by_kind``).

Writes ``ladder.json`` (every rung's figures and the profile) and ``ladder.txt`` (the table) under ``--out``;
chapter 01's figure and table are drawn from a copy kept in ``chapters/figures/data/01_gpu_ladder.json``.
Without a GPU: one line, exit 2. It never changes a GPU setting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from coursetools import gpu_check
from labkit import launch

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "scripts/01_single_device_baseline/train_baseline.py"
TIME_BUDGET_S = 400
STEPS = 12
GIB = 1024**3


@dataclass(frozen=True)
class Rung:
    name: str
    what: str        # the change from the rung before, in a few words
    args: tuple
    timeout_s: int = 120


A100 = ("--preset", "a100", "--steps", str(STEPS))
BEST_FLAGS = ("--precision", "bf16", "--fused-adamw", "--compile")
RUNGS: tuple[Rung, ...] = (
    Rung("fp32", "fp32, eager (TF32 off, PyTorch's default: matrix multiplies without tensor cores)",
         (*A100, "--precision", "fp32")),
    Rung("bf16", "bf16 autocast (the course's default on a GPU)", (*A100, "--precision", "bf16")),
    Rung("bf16_math_attention", "attention on the unfused math kernel (what SDPA's fused kernels spare)",
         (*A100, "--precision", "bf16", "--attention", "math")),
    Rung("fused_adamw", "+ fused AdamW (one kernel for the optimizer step)", (*A100, "--precision", "bf16", "--fused-adamw")),
    Rung("compiled", "+ torch.compile of each block", (*A100, *BEST_FLAGS), timeout_s=180),
    Rung("compiled_batch16", "+ batch 16 (was 4): fills more of the GPU; profiled",
         (*A100, *BEST_FLAGS, "--batch", "16", "--profile-out", "{out}/profile.json"), timeout_s=180),
    Rung("llama3_8b_slice", "Llama 3 8B's layers (8 of 32), 8,192 tokens, batch 1, compiled",
         ("--preset", "llama3_8b_slice", "--steps", "8", *BEST_FLAGS, "--batch", "1"), timeout_s=200),
    Rung("checkpointed_batch16", "+ activation checkpointing (memory for time)",
         (*A100, *BEST_FLAGS, "--batch", "16", "--activation-checkpointing"), timeout_s=180),
    Rung("bf16_cudnn_attention", "attention on cuDNN's kernel instead of PyTorch's choice",
         (*A100, "--precision", "bf16", "--attention", "cudnn")),
)


def rung_row(rung: Rung, returncode: int | None, seconds: float, metrics: dict | None, output: str) -> dict:
    """One rung's figures from its metrics file (pure: unit-tested with a recorded example)."""
    row = {"name": rung.name, "what": rung.what, "args": list(rung.args), "returncode": returncode,
           "seconds": round(seconds, 1)}
    if metrics is None:
        lines = [line for line in output.strip().splitlines() if line.strip()]
        row.update(status="failed", reason=(lines[-1] if lines else "no output")[:300])
        return row
    throughput, device = metrics["throughput"], metrics["memory"].get("device", {})
    from distlab import metrics as course_metrics   # here, not at the top: this process never imports torch

    peak_bf16 = course_metrics.peak_flops(throughput.get("device_name"), "bf16")
    achieved = throughput.get("achieved_flops_per_s")
    failed = [c["name"] for c in metrics["checks"] if not c["passed"]]
    row.update(status="passed" if not failed else "checks failed", failed_checks=failed,
               tokens_per_s=throughput.get("tokens_per_s"), step_seconds=throughput.get("step_seconds"),
               flops_per_token=throughput.get("flops_per_token"), achieved_flops_per_s=achieved,
               mfu_bf16_peak=(achieved / peak_bf16) if achieved and peak_bf16 else None,
               peak_dtype=throughput.get("peak_dtype"), mfu_own_dtype=throughput.get("mfu"),
               peak_allocated_bytes=device.get("peak_allocated_bytes"),
               batch=metrics["config"].get("batch"), preset=metrics["config"].get("preset"),
               first_loss=metrics["losses"][0] if metrics["losses"] else None,
               last_loss=metrics["losses"][-1] if metrics["losses"] else None,
               device_time_by_kind=metrics.get("extra", {}).get("device_time_by_kind"))
    return row


TRAINING_CHECKS = ("loss falls", "same seed")   # a rung is usable only if it trained, and repeatably


def best_rung(rows: list[dict], preset: str = "a100") -> dict | None:
    """The fastest rung of ``preset`` that trained (its loss fell, its losses repeat). A failed memory check is
    shown in the table but does not disqualify a rung's speed."""
    def trained(row):
        return row.get("tokens_per_s") and not any(name.startswith(TRAINING_CHECKS)
                                                   for name in row.get("failed_checks", []))
    ok = [r for r in rows if r.get("preset") == preset and trained(r)]
    return max(ok, key=lambda r: r["tokens_per_s"]) if ok else None


def render_table(ladder: dict) -> str:
    lines = [f"chapter 01's ladder: {ladder['machine']['gpus'][0]['name']}, torch {ladder['machine']['torch']}, "
             f"{ladder['when']}",
             f"{'rung':<22} {'tokens/s':>9} {'MFU(bf16)':>9} {'peak GiB':>8}  status / change"]
    for r in ladder["rungs"]:
        if r.get("tokens_per_s"):
            lines.append(f"{r['name']:<22} {r['tokens_per_s']:>9,.0f} {r['mfu_bf16_peak'] or 0:>9.1%} "
                         f"{(r['peak_allocated_bytes'] or 0) / GIB:>8.1f}  {r['status']}: {r['what']}"
                         + (f" [failed: {'; '.join(r['failed_checks'])}]" if r.get("failed_checks") else ""))
        else:
            lines.append(f"{r['name']:<22} {'-':>9} {'-':>9} {'-':>8}  {r['status']}: {r.get('reason', '')}")
    profile = ladder.get("profile")
    if profile and profile.get("device_time_by_kind"):
        kinds = profile["device_time_by_kind"]
        lines.append(f"profile of {profile['name']} (one step, {kinds['window_seconds'] * 1e3:.1f} ms on the device, "
                     f"{kinds['kernels']} kernels):")
        for kind, sec in sorted(kinds["seconds"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {kind:<48} {sec * 1e3:8.2f} ms  {sec / kinds['window_seconds']:6.1%}")
        lines.append("  attention kernels: " + ", ".join(kinds.get("attention_kernels", [])))
    return "\n".join(lines)


def ladder_markdown(ladder: dict) -> str:
    """Chapter 01's table of a measured ladder: each rung's change, tokens/s, MFU against the bf16 peak, peak memory,
    and the checks that failed (kept in step with the chapter by tests/unit/test_chapter_text_01.py)."""
    lines = ["| rung | what changed | tokens/s | MFU (bf16 peak) | peak memory | checks |", "|---|---|---|---|---|---|"]
    for r in ladder["rungs"]:
        if not r.get("tokens_per_s"):
            continue
        checks = "all passed" if not r["failed_checks"] else "failed: " + "; ".join(
            name.split(" (")[0] for name in r["failed_checks"])
        lines.append(f"| `{r['name']}` | {r['what']} | {r['tokens_per_s']:,.0f} | {r['mfu_bf16_peak']:.1%} | "
                     f"{r['peak_allocated_bytes'] / GIB:.1f} GiB | {checks} |")
    return "\n".join(lines)


def device_time_markdown(ladder: dict) -> str:
    """The profiled rung's step by kind of kernel, as a table."""
    kinds = ladder["profile"]["device_time_by_kind"]
    lines = ["| where the device's time went | ms | share |", "|---|---|---|"]
    for kind, seconds in sorted(kinds["seconds"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {seconds * 1e3:.1f} | {seconds / kinds['window_seconds']:.1%} |")
    lines.append(f"| one step, {kinds['kernels']:,} kernels | {kinds['window_seconds'] * 1e3:.1f} | 100% |")
    return "\n".join(lines)


def _run(rung: Rung, out: Path, timeout: float, extra=(), device: str = "cuda") -> dict:
    """One rung, in a process of its own (a fresh CUDA context and allocator: each rung's peak is its own).
    ``device="cpu"`` lets a test run this code without a GPU."""
    metrics_file = out / f"{rung.name}.json"
    metrics_file.unlink(missing_ok=True)
    args = [a.replace("{out}", str(out)) for a in (*rung.args, *extra)]
    command = [sys.executable, SCRIPT, "--device", device, *args, "--metrics-out", str(metrics_file)]
    print(f"  {rung.name}: {' '.join(command[2:])}", flush=True)
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                              env=launch.child_environment())   # finds distlab where it is not pip-installed
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        returncode, output = None, f"timed out after {timeout:.0f} s\n{expired.stdout or ''}"
    seconds = time.monotonic() - started
    (out / f"{rung.name}.log").write_text(output if isinstance(output, str) else output.decode(errors="replace"))
    metrics = json.loads(metrics_file.read_text()) if metrics_file.exists() else None
    row = rung_row(rung, returncode, seconds, metrics, output if isinstance(output, str) else "")
    print(f"    {row['status']} in {seconds:.0f} s" + (f": {row['tokens_per_s']:,.0f} tokens/s, "
                                                       f"MFU {row['mfu_bf16_peak'] or 0:.1%}"
                                                       if row.get("tokens_per_s") else ""), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="build/gpu_ladder", help="folder of ladder.json, ladder.txt and each rung's log")
    p.add_argument("--only", nargs="+", metavar="RUNG", default=None, choices=[r.name for r in RUNGS])
    p.add_argument("--budget-s", type=float, default=TIME_BUDGET_S, help="seconds for all the runs")
    p.add_argument("--render", metavar="LADDER_JSON", default=None, help="print the table of a ladder.json")
    args = p.parse_args(argv)
    if args.render:
        print(render_table(json.loads(Path(args.render).read_text())))
        return 0
    reason = gpu_check._no_gpu_here()
    machine = None if reason else gpu_check._in_child("probe")
    if machine is not None and not machine["gpus"]:
        reason = f"no CUDA GPU visible to torch {machine['torch']}"
    if reason:
        sys.stderr.write(f"config error: {reason}: the ladder needs an NVIDIA GPU; nothing was run\n")
        return gpu_check.NO_GPU_EXIT_CODE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-ladder: {machine['gpus'][0]['name']}, torch {machine['torch']}, CUDA {machine['cuda']}", flush=True)
    started = time.monotonic()
    rows = []
    for rung in (r for r in RUNGS if args.only is None or r.name in args.only):
        left = args.budget_s - (time.monotonic() - started)
        if left < 30:
            rows.append({"name": rung.name, "what": rung.what, "args": list(rung.args), "status": "skipped",
                         "reason": f"time budget of {args.budget_s:.0f} s spent"})
            continue
        rows.append(_run(rung, out, min(rung.timeout_s, left)))
    ladder = {"machine": machine, "rungs": rows,
              "when": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    best = best_rung(rows)
    ladder["profile"] = next((r for r in rows if r.get("device_time_by_kind")), None)
    table = render_table(ladder)
    (out / "ladder.json").write_text(json.dumps(ladder, indent=1))
    (out / "ladder.txt").write_text(table + "\n")
    print("\n" + table, flush=True)
    return 0 if best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
