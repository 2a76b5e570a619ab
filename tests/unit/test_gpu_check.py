"""make gpu-check (coursetools.gpu_check) on a machine without a GPU: the refusal, the run table, the plan, and the
summary and table built from a recorded example.

The example (tests/unit/data/gpu_check_example.json) is a SYNTHETIC fixture: invented numbers in the shape of a
run on 4 x A100-40GB, so the expected figures below are worked out by hand from those invented inputs. No GPU
figure of the course comes from it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distlab import runtime
from coursetools import gpu_check
from coursetools.gpu_check import NOT_ON_GPU, RUNS, Planned, Run, plan_runs, render_table, run_result, summarize

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = Path(__file__).parent / "data" / "gpu_check_example.json"
GIB = 1024**3


# ---- without a GPU: one line, exit 2 ------------------------------------------------------------------


def test_refuses_without_a_gpu_in_one_line_with_exit_2():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU, even where the tests run on a GPU machine
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "coursetools.gpu_check"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("config error: no NVIDIA GPU") and "nothing was run" in lines[0], lines
    assert time.perf_counter() - started < 10


def test_refuses_without_a_gpu_device_node():
    if any(Path(node).exists() for node in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        pytest.skip("this machine has a GPU device node")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run([sys.executable, "-m", "coursetools.gpu_check"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("config error: no NVIDIA GPU on this machine (no /dev/nvidia* device): make gpu-check "
                           "needs an NVIDIA GPU; nothing was run\n")


def test_make_target_runs_the_module():
    done = subprocess.run(["make", "--no-print-directory", "-n", "gpu-check", "GPU_CHECK_ARGS=--plan-only"], cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert re.search(r"python -m coursetools\.gpu_check --plan-only$", done.stdout.strip()), done.stdout


def test_never_changes_gpu_settings():
    source = Path(gpu_check.__file__).read_text()
    for forbidden in ("nvidia-smi", "set_per_process_memory_fraction", "-pm", "--applications-clocks", "-rgc"):
        assert forbidden not in source, forbidden


# ---- the run table covers every script ------------------------------------------------------------------


def chapter_scripts() -> set[str]:
    # common_*.py are a chapter's helpers, imported by its scripts (CONTRIBUTING.md), not scripts
    return {p.relative_to(REPO).as_posix() for p in REPO.glob("scripts/*/*.py") if not p.name.startswith("common_")}


def test_every_script_is_run_on_gpu_or_excluded_with_a_reason():
    in_table = {run.script for run in RUNS}
    missing = chapter_scripts() - in_table - set(NOT_ON_GPU)
    assert not missing, f"add these to gpu_check.RUNS, or to NOT_ON_GPU with the reason: {sorted(missing)}"
    assert not in_table & set(NOT_ON_GPU), "a script is both run and excluded"
    assert all(reason.strip() for reason in NOT_ON_GPU.values())
    for script in in_table | set(NOT_ON_GPU):
        assert (REPO / script).is_file(), f"{script} does not exist"


def test_run_names_unique_and_figures_fed():
    names = [run.name for run in RUNS]
    assert len(names) == len(set(names))
    roles = [run.role for run in RUNS if run.role]
    assert sorted(roles) == ["baseline", "memory_fsdp", "native_cp", "nccl_bandwidth"]
    baseline = next(run for run in RUNS if run.role == "baseline")
    assert baseline.world == "one" and "a100" in baseline.args and "bf16" in baseline.args
    assert RUNS[0] is baseline, "the baseline runs first: a run out of time must not lose the main figure"
    assert sum(run.timeout_s for run in RUNS if run.role) < gpu_check.TIME_BUDGET_S


def defined_flags(script: str) -> set[str]:
    """Every --flag spelled in the script, its chapter's helpers, and the shared parsers it uses."""
    path = REPO / script
    sources = [path, *path.parent.glob("common_*.py"), REPO / "distlab" / "runtime.py",
               REPO / "distlab" / "tensor_parallel.py"]
    return {flag for source in sources for flag in re.findall(r"[\"'](--[a-z0-9-]+)[\"']", source.read_text())}


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_every_flag_of_a_run_exists_in_its_script(run):
    flags = defined_flags(run.script)
    for arg in run.args:
        if arg.startswith("--"):
            plain = "--" + arg[len("--no-"):] if arg.startswith("--no-") else arg  # BooleanOptionalAction
            assert arg in flags or plain in flags, f"{run.script} has no flag {arg}"


def test_flag_check_can_fail():
    assert "--precision" in defined_flags("scripts/04_data_parallel/train_ddp.py")
    assert "--precision" not in defined_flags("scripts/03_communication/collectives.py")


# ---- the plan ------------------------------------------------------------------------------------------


def by_name(plan) -> dict[str, Planned]:
    return {p.run.name: p for p in plan}


def test_plan_one_gpu_skips_what_needs_two_and_runs_the_rest_on_one_rank(tmp_path):
    plan = by_name(plan_runs(1, 80 * GIB, tmp_path))
    for name in ("nccl_bandwidth", "ring_attention_native", "collectives", "tp_transformer", "pp_train_zbv"):
        assert plan[name].skip == "needs 2+ GPUs (NCCL: one rank per GPU), 1 present", name
    for name in ("baseline_a100_bf16", "baseline_tiny", "train_ddp_compare", "train_fsdp", "checkpoint_reshard"):
        assert plan[name].skip is None and plan[name].world_size == 1, name
    assert all(p.args[-2:] == ("--device", "cuda") for p in plan.values())


def test_plan_four_gpus(tmp_path):
    plan = by_name(plan_runs(4, 40 * GIB, tmp_path))
    assert not [p.run.name for p in plan.values() if p.skip]
    sizes = {name: p.world_size for name, p in plan.items()}
    assert sizes.pop("baseline_a100_bf16") == 1 and sizes.pop("checkpoint_reshard") == 2
    assert set(sizes.values()) == {4}
    assert plan["fsdp_a100_memory"].args == ("--preset", "a100", "--batch", "4", "--steps", "3", "--device", "cuda")
    assert plan["checkpoint_resume"].args[:3] == ("--resume", "--save-dir", f"{tmp_path}/ckpt")


def test_plan_fsdp_memory_run_only_where_it_fits(tmp_path):
    # a100_large: 3,367,676,928 parameters; the foreach AdamW step holds 20 B each (shards: 20/N), the peak on 1, 2
    # and 4 GPUs: 62.7 GiB on one GPU (BENCHMARKS.md's H200 measured 62.80), 31.4 on 2, 15.7 on 4
    assert "does not fit: predicted 62.7 GiB per rank on 1 GPU(s) > 85% of 40.0 GiB" == \
        by_name(plan_runs(1, 40 * GIB, tmp_path))["fsdp_a100_memory"].skip
    assert by_name(plan_runs(2, 40 * GIB, tmp_path))["fsdp_a100_memory"].skip is None   # 31.4 < 34 GiB
    assert by_name(plan_runs(1, 80 * GIB, tmp_path))["fsdp_a100_memory"].skip is None   # 62.7 < 68 GiB
    for gpus in (1, 2, 4):
        assert gpu_check.fsdp_a100_peak_bytes(gpus, gpus) == 3_367_676_928 * 20 // gpus


# ---- one run's status ----------------------------------------------------------------------------------

PLANNED = Planned(Run("x", "scripts/01_single_device_baseline/train_baseline.py"), 2, ("--device", "cuda"))


def metrics_with(*passed):
    return {"checks": [{"name": f"c{i}", "passed": p, "value": 0, "tolerance": 0} for i, p in enumerate(passed)],
            "timeline": [1, 2, 3], "throughput": {}}


@pytest.mark.parametrize("returncode, output, metrics, timed_out, status, reason", [
    (0, "checks: 2/2 passed", metrics_with(True, True), False, "passed", None),
    (1, "checks: 1/2 passed", metrics_with(True, False), False, "failed", "1 check(s) failed"),
    (0, "", metrics_with(), False, "crashed", "exit code 0 but no checks / a failed check"),
    (0, "", None, False, "crashed", "exit code 0 but no metrics file"),
    (2, "config error (rank 0): heads 3 do not split\nconfig error (rank 1): heads 3 do not split", None, False,
     "cannot run here", "config error (rank 0): heads 3 do not split"),
    (1, "config error (rank 1): heads 3 do not split\n  exitcode  : 2 (pid: 7)", None, False,  # as under torchrun
     "cannot run here", "config error (rank 1): heads 3 do not split"),
    (2, "usage: x.py\nx.py: error: unrecognized arguments: --nope", None, False, "bad flags",
     "x.py: error: unrecognized arguments: --nope"),
    (1, "usage: x.py\nx.py: error: argument --preset: invalid choice: 'huge'", None, False, "bad flags",
     "x.py: error: argument --preset: invalid choice: 'huge'"),
    (1, "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory.", None, False, "crashed",
     "torch.OutOfMemoryError: CUDA out of memory."),
    (None, "step 0", None, True, "timeout", "killed at its 90 s limit"),
])
def test_run_status(returncode, output, metrics, timed_out, status, reason):
    row = run_result(PLANNED, returncode, output, 61.0, metrics, timed_out)
    assert (row["status"], row["reason"]) == (status, reason)
    if metrics is not None:
        assert "timeline" not in row["metrics"]


def test_skipped_run_is_not_launched_and_not_a_failure():
    row = run_result(Planned(PLANNED.run, 1, (), skip="needs 2+ GPUs"), None, "", 0.0, None)
    assert (row["status"], row["reason"]) == ("skipped", "needs 2+ GPUs")
    machine = {"gpus": [{"name": "GPU", "memory_bytes": GIB}]}
    cannot = run_result(PLANNED, 2, "config error (rank 0): no", 3.0, None)
    assert summarize(machine, [row, cannot], None)["ok"] is True
    assert summarize(machine, [row, run_result(PLANNED, 1, "", 3.0, None)], None)["ok"] is False


# ---- the summary and the table, from the recorded (synthetic) example ---------------------------------


@pytest.fixture(scope="module")
def example():
    return json.loads(EXAMPLE.read_text())


@pytest.fixture(scope="module")
def summary(example, tmp_path_factory):
    machine = example["machine"]
    plan = by_name(plan_runs(len(machine["gpus"]), machine["gpus"][0]["memory_bytes"], tmp_path_factory.mktemp("w")))
    rows = [run_result(plan[launch["name"]], launch["returncode"], launch["output"], launch["seconds"],
                       launch["metrics"], launch["timed_out"]) for launch in example["launches"]]
    return summarize(machine, rows, example["copy_bandwidth"], example["when"])


def test_example_is_marked_synthetic(example):
    assert "SYNTHETIC" in example["_note"] and "none is a measurement" in example["_note"]
    assert example["machine"]["note"] == example["_note"]
    assert all("synthetic" in gpu["name"] for gpu in example["machine"]["gpus"])


def test_summary_statuses(summary):
    assert summary["counts"] == {"passed": 26, "failed": 1}
    assert summary["ok"] is False
    failed = [r for r in summary["runs"] if r["status"] != "passed"]
    assert [(r["name"], r["failed_checks"]) for r in failed] == [
        ("pp_schedules", ["measured bubble = simulated bubble (within 5 points)"])]


def test_summary_baseline_throughput_and_mfu(summary):
    base = summary["baseline"]
    assert base["tokens_per_s"] == 10_000.0 and base["tokens_per_s_is"] == "measured"
    # a100 preset: 6 x (1,364,297,728 - 32,000 x 2,048) + 12 x 24 x 2,048 x 1,024 = 8,396,550,144 FLOPs/token
    assert base["flops_per_token"] == 8_396_550_144
    assert base["achieved_tflops"] == pytest.approx(83.96550144, rel=1e-12)
    assert base["bf16_peak_tflops"] == 312 and base["gpu"] == "NVIDIA A100-SXM4-40GB (synthetic fixture)"
    assert base["mfu"] == pytest.approx(83.96550144 / 312, rel=1e-12)  # 26.9 %
    assert base["achieved_tflops_and_mfu_are"].startswith("derived")


def test_summary_mfu_uses_the_gpu_found_not_the_script(example, summary):
    machine = {**example["machine"], "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * GIB}]}
    h100 = summarize(machine, summary["runs"], None)["baseline"]
    assert h100["bf16_peak_tflops"] == 989 and h100["mfu"] == pytest.approx(83.96550144 / 989, rel=1e-12)
    unknown = summarize({**machine, "gpus": [{"name": "NVIDIA L4", "memory_bytes": GIB}]}, summary["runs"], None)
    assert unknown["baseline"]["mfu"] is None and "no dense bf16 peak" in unknown["baseline"]["mfu_note"]


def test_summary_memory_model_against_allocator(summary):
    """The peak predicted by phase from the fixture's own figures, term by term (written out by hand here)."""
    baseline, fsdp = summary["memory"]
    N = 1_364_297_728                                  # the a100 preset; fp32 weights, gradients, AdamW moments
    loss_gradients = 2 * 4 * 1024 * 32000 * 4          # two fp32 B x T x V tensors, batch 4
    assert baseline["phases"]["forward/backward"]["total"] == 4 * N + 8 * N + 8_000_000_000 + loss_gradients
    assert baseline["phases"]["optimizer step"]["total"] == 20 * N        # + foreach AdamW's 4 B a parameter
    assert baseline["peak_phase"] == "optimizer step" and baseline["predicted_bytes"] == 20 * N
    assert baseline["peak_allocated_bytes"] == 33_000_000_000
    assert baseline["ratio"] == pytest.approx(33_000_000_000 / (20 * N)) and not baseline["passed"]  # 21% off
    # FSDP on 4 ranks: a quarter of the state; at the top of backward the loss gradients and the root unit, later
    # (the larger here) the root unit, the root's bf16 gradients and ~10 B a parameter of one block under bf16
    n, root = 3_367_676_928, 2 * 32000 * 3072 + 3072
    block = (n - root) // 28
    top_of_backward = 12 * n // 4 + 3_000_000_000 + 2 * 1 * 1024 * 32000 * 4 + 2 * root
    forward_backward = 12 * n // 4 + 3_000_000_000 + 2 * root + 2 * (32000 * 3072 + 3072) + (2 + 2 + 2 + 4) * block
    assert forward_backward > top_of_backward
    assert fsdp["run"] == "fsdp_a100_memory" and fsdp["world_size"] == 4
    assert fsdp["phases"]["forward/backward"]["total"] == forward_backward
    assert fsdp["predicted_bytes"] == fsdp["phases"]["optimizer step"]["total"] == 20 * n // 4
    assert fsdp["difference_bytes"] == 18_000_000_000 - 20 * n // 4 and not fsdp["passed"]
    assert not summary["ok"]
    for cause in ("rounding", "workspace", "set_to_none", "_foreach_sqrt"):
        assert cause in summary["memory_explanation"]


@pytest.mark.parametrize("measured_over_predicted, passes", [(1.0, True), (1.019, True), (0.981, True),
                                                             (1.021, False), (0.979, False)])
def test_memory_check_passes_within_its_margin_only(summary, measured_over_predicted, passes):
    """The comparison itself: a run's allocator peak within 2% of the phase model's, either way, passes."""
    row = next(r for r in summary["runs"] if r["name"] == "baseline_a100_bf16")
    predicted = summary["memory"][0]["predicted_bytes"]
    metrics = json.loads(json.dumps(row["metrics"]))
    metrics["memory"]["device"]["peak_allocated_bytes"] = round(measured_over_predicted * predicted)
    memory_row = gpu_check._memory_row({**row, "metrics": metrics})
    assert memory_row["passed"] is passes and memory_row["margin"] == gpu_check.MEMORY_MARGIN == 0.02


def test_an_hsdp_run_counts_the_model_once(summary):
    """train_fsdp --replicate 2 on 4 ranks writes the ZeRO-3 table over its shard group of 2: the same model, the
    same gathered units as the plain FSDP run's."""
    row = next(r for r in summary["runs"] if r["name"] == "fsdp_a100_memory")
    metrics = json.loads(json.dumps(row["metrics"]))
    metrics["config"]["replicate"] = 2
    metrics["memory"]["analytic"] = {k: 2 * v for k, v in metrics["memory"]["analytic"].items()}
    hsdp = gpu_check._memory_row({**row, "metrics": metrics})
    assert hsdp["phases"]["forward/backward"] == summary["memory"][1]["phases"]["forward/backward"]


def test_a_small_predicted_peak_is_reported_not_checked(summary):
    """Under memory.PEAK_CHECK_MIN_BYTES (cuBLAS's workspaces alone are over 2% there) the row says so, as the
    scripts do, and neither passes nor fails the summary: the fixture's baseline shrunk to the tiny preset's size."""
    row = next(r for r in summary["runs"] if r["name"] == "baseline_a100_bf16")
    metrics = json.loads(json.dumps(row["metrics"]))
    metrics["memory"]["measured_state"] = {"params": 492_800, "grads": 492_800, "optimizer": 985_600}
    metrics["memory"]["measured_activations"] = 3_230_788
    metrics["memory"]["device"]["peak_allocated_bytes"] = 40 * 2**20     # 35 MiB of workspaces over 5 MiB
    memory_row = gpu_check._memory_row({**row, "metrics": metrics})
    assert memory_row["predicted_bytes"] < 2**30 and memory_row["passed"] is None
    assert "not checked" in gpu_check.render_table({**summary, "memory": [memory_row]})
    from distlab import memory
    assert f"a prediction under {memory.PEAK_CHECK_MIN_BYTES // 2**30} GiB is not checked" in gpu_check.MEMORY_EXPLANATION


def test_the_smallest_term_of_the_h200_baseline_is_over_the_margin():
    """The a100 preset at batch 4 (BENCHMARKS.md's H200 run, 29.78 GiB measured): its smallest term, the loss
    gradients, is 3.3% of the peak, so a model that left it out would fail the 2% margin."""
    from distlab import memory

    assert memory.loss_gradient_bytes(4, 1024, 32000) / (29.78 * GIB) == pytest.approx(0.0328, abs=1e-4)
    assert memory.loss_gradient_bytes(4, 1024, 32000) / (29.78 * GIB) > gpu_check.MEMORY_MARGIN


def test_summary_bandwidths_and_native_cp(summary):
    nccl = summary["nccl_bus_bandwidth"]["peak_bus_bandwidth"]
    assert nccl == {"all_reduce": {"busbw_gb_per_s": 200.0, "payload_bytes": 2**30},
                    "all_gather": {"busbw_gb_per_s": 140.0, "payload_bytes": 2**25},
                    "reduce_scatter": {"busbw_gb_per_s": 160.0, "payload_bytes": 2**30}}
    assert summary["device_memory_bandwidth"]["gb_per_s"] == 1300.0
    native = summary["native_context_parallel"]
    assert native["status"] == "passed" and [c["value"] for c in native["checks"]] == [2e-6, 7e-6, 9e-6, 3e-6]


def test_copy_bandwidth_counts_read_and_write_in_gb():
    assert gpu_check.copy_bandwidth_gb_per_s(2**30, 1e-3) == pytest.approx(2 * 1.073741824 / 1e-3)


def test_table(summary):
    table = render_table(summary)
    lines = table.splitlines()
    assert lines[0].startswith("NOTE: SYNTHETIC FIXTURE")
    assert lines[1].startswith("gpu-check SYNTHETIC (no date: not a run): 4 x NVIDIA A100-SXM4-40GB (synthetic "
                               "fixture) (39.6 GiB), torch 2.13.0+cu126, CUDA 12.6")
    assert sum(1 for ln in lines if re.match(r"\w+\s+[124]\s+(passed|failed)\s", ln)) == 27
    assert re.search(r"^pp_schedules\s+4\s+failed\s+3/4\s+12\.0\s+1 check\(s\) failed$", table, re.M)
    assert "overall: FAIL (1 failed, 26 passed)" in lines
    assert ("baseline (a100 preset, bf16, 1 GPU): 10,000 tokens/s (measured); 84.0 TFLOP/s achieved, MFU 26.9% of "
            "312 TFLOP/s (dense bf16 peak of NVIDIA A100-SXM4-40GB (synthetic fixture)) (derived)") in lines
    assert any(ln.startswith("memory, baseline_a100_bf16 (rank 0 of 1): FAIL, predicted peak 25.41 GiB (optimizer "
                             "step), max_memory_allocated 30.73 GiB (ratio 1.209") for ln in lines)
    assert any(ln.startswith("    forward/backward: 23.67 GiB = weights 5.08 GiB + optimizer state 10.16 GiB + saved "
                             "activations 7.45 GiB + loss gradients") for ln in lines)
    assert "native context parallelism (ring_attention.py --native): passed, largest relative difference 9.0e-06" in lines
    assert any(ln.startswith("device memory bandwidth: 1300 GB/s (a copy of S bytes moves 2S") for ln in lines)
    assert ("NCCL bus bandwidth, 4 GPUs: all_reduce 200.0 GB/s at 1024 MiB, all_gather 140.0 GB/s at 32 MiB, "
            "reduce_scatter 160.0 GB/s at 1024 MiB") in lines
    assert render_table(json.loads(json.dumps(summary))) == table  # summary.json renders the same table


# ---- the parts that run things, exercised on CPU -------------------------------------------------------


def test_launch_collects_a_real_run_and_writes_its_log(tmp_path, monkeypatch):
    # the GPU path with --device cpu: launched, metrics read back, status, log file. (Started by fork, 2-3 s
    # faster than the torchrun gpu-check uses; test_launch_timeout_and_spent_budget goes through torchrun.)
    monkeypatch.setenv("DISTLAB_LAUNCH_MODE", "fork")
    monkeypatch.delenv("DISTLAB_LAUNCH_CACHE", raising=False)  # a real run, never a replay
    run = Run("baseline_cpu", "scripts/01_single_device_baseline/train_baseline.py", timeout_s=60)
    row = gpu_check._launch(Planned(run, 1, ("--steps", "8", "--device", "cpu")), tmp_path, budget_left=60)
    assert row["status"] == "passed", row
    assert row["checks_total"] >= 4 and row["metrics"]["device"] == "cpu"
    log = (tmp_path / "baseline_cpu.log").read_text().splitlines()
    assert log[0] == ("torchrun --standalone --nproc_per_node=1 scripts/01_single_device_baseline/train_baseline.py "
                      "--steps 8 --device cpu")
    assert any(line.startswith("checks: ") for line in log)


def test_launch_timeout_and_spent_budget(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTLAB_LAUNCH_CACHE", raising=False)
    run = Run("slow", "scripts/01_single_device_baseline/train_baseline.py", timeout_s=1)
    row = gpu_check._launch(Planned(run, 1, ("--steps", "500", "--device", "cpu")), tmp_path, budget_left=60)
    assert (row["status"], row["reason"]) == ("timeout", "killed at its 1 s limit")
    assert row["seconds"] >= 1  # the clock, kept beside the limit
    spent = gpu_check._launch(Planned(run, 1, ()), tmp_path, budget_left=gpu_check.MIN_RUN_SECONDS - 1)
    assert (spent["status"], spent["reason"]) == ("skipped", "time budget of 540 s spent")


def test_copy_measurement_code_runs(monkeypatch):
    copy = gpu_check._measure_copy(nbytes=2**20, copies=2, repeats=2, device="cpu")
    assert copy["gb_per_s"] == pytest.approx(2 * 2**20 / copy["seconds_per_copy"] / 1e9)
    assert "2S (S read + S written)" in copy["convention"] and "1 MiB" in copy["convention"]


def test_grouped_against_loop_check_runs_and_can_fail(monkeypatch, summary):
    """The GPU's grouped-experts check, run here on the CPU in fp32: it passes, and fails when the grouped path
    is wrong (its offsets off by one row)."""
    small = dict(device="cpu", dtype_name="fp32", rows=256, experts=4, dim=32, hidden=64, repeats=1)
    result = gpu_check._compare_expert_paths(**small)
    assert result["passed"] and result["counts"][0] == 0 and sum(result["counts"]) == 256
    assert set(result["seconds_forward_backward"]) == {"grouped", "looped"}
    from distlab import moe

    real = moe.Experts.grouped

    def off_by_one(self, x, counts):
        return real(self, x, [counts[0] + 1, counts[1] - 1, *counts[2:]])

    monkeypatch.setattr(moe.Experts, "grouped", off_by_one)
    broken = gpu_check._compare_expert_paths(**small)
    assert not broken["passed"] and broken["largest_relative_difference"] > 1e-2
    table = render_table({**summary, "experts_grouped_against_loop": broken})
    assert "grouped matrix multiply against a loop (4 experts, 256 rows, fp32): FAIL" in table


def test_probe_finds_no_gpu_here():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu_check._probe()["gpus"] == [] and gpu_check._probe()["nccl"] is None


def test_cli_plan_for_another_machine_and_render(tmp_path, capsys, summary):
    assert gpu_check.main(["--plan-only", "--gpus", "2", "--gpu-memory-gib", "80"]) == 0
    plan = capsys.readouterr().out.splitlines()
    assert len(plan) == len(RUNS)
    assert re.match(r"  hybrid_3d\s+2 rank\(s\)  SKIP: needs 4\+ GPUs", next(ln for ln in plan if "hybrid_3d" in ln))
    saved = tmp_path / "summary.json"
    saved.write_text(json.dumps(summary))
    assert gpu_check.main(["--render", str(saved)]) == 0
    assert capsys.readouterr().out == render_table(summary) + "\n"


def test_only_selects_runs_and_refuses_unknown_names(tmp_path):
    plan = gpu_check.plan_runs(1, 140 * GIB, tmp_path)
    chosen = gpu_check.select_runs(plan, ["profile_step_fsdp", "baseline_a100_bf16"])
    assert [p.run.name for p in chosen] == ["baseline_a100_bf16", "profile_step_fsdp"]  # the table's order
    assert gpu_check.select_runs(plan, None) == plan
    with pytest.raises(runtime.ConfigError, match="no_such_run"):
        gpu_check.select_runs(plan, ["baseline_tiny", "no_such_run"])


def test_a_torch_other_than_the_pin_is_named():
    """On an H200 image with torch 2.11 two runs crashed on 2.13 APIs (dist.all_gather_single, DDP's
    forward_sync_buffers): the summary says the version is the cause."""
    requirements = "# pins\nnumpy==2.3.0\ntorch==2.13.0\n"
    assert gpu_check.torch_pin_note("2.13.0+cu128", requirements) is None
    note = gpu_check.torch_pin_note("2.11.0+cu130", requirements)
    assert "2.11.0+cu130" in note and "torch==2.13.0" in note
    assert gpu_check.torch_pin_note("2.11.0", "numpy==2.3.0\n") is None
