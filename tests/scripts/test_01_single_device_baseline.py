"""Chapter 01: the reference training loop proves itself alone, under torchrun, and refuses bad flags."""

import json
import subprocess
import sys

from helpers import assert_all_checks_passed, assert_usage_error

from labkit import launch

SCRIPT = "scripts/01_single_device_baseline/train_baseline.py"


def test_baseline_alone_with_python(tmp_path):
    """`python train_baseline.py`: no launcher at all, a world of one."""
    out = tmp_path / "metrics.json"
    done = subprocess.run([sys.executable, SCRIPT, "--steps", "6", "--metrics-out", str(out)], cwd=launch.REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = json.loads(out.read_text())
    assert metrics["world_size"] == 1 and len(metrics["losses"]) == 6
    assert metrics["losses"][-1] < metrics["losses"][0]
    names = " ".join(c["name"] for c in metrics["checks"])
    for expected in ("loss falls", "same seed", "16 bytes/param", "saved activations"):
        assert expected in names
    assert all(c["passed"] for c in metrics["checks"]), metrics["checks"]
    throughput = metrics["throughput"]
    assert throughput["tokens_per_s"] > 0 and throughput["flops_per_token"] > 0
    assert throughput["mfu"] is None and "MFU: not reported on cpu" in done.stdout  # no MFU claimed on a CPU
    memory = metrics["memory"]
    assert memory["measured_state"] == memory["predicted_state"]
    assert memory["measured_activations"] == memory["predicted_activations"]


def test_four_ranks_under_torchrun_train_identical_replicas():
    result = launch.run(SCRIPT, nproc=4, args=["--steps", "4"], launcher="torchrun", stream=False)
    metrics = assert_all_checks_passed(result, min_checks=6)
    assert metrics["world_size"] == 4
    assert any("replicas trained identically" in c["name"] for c in metrics["checks"])


def test_zero_steps_is_a_usage_error():
    assert_usage_error(SCRIPT, ["--steps", "0"], "--steps")


def test_the_ladders_switches_change_how_not_what(tmp_path):
    """Chapter 01's ladder: compiled blocks (inductor's C++ on the CPU) with fused AdamW, and activation checkpointing
    with the unfused math attention (the CPU's default is its flash kernel), each train the plain run's losses.
    Tolerance 1e-5: fp32, only the order of sums may differ (measured: equal to the last digit here); a 0.1% change
    planted in the checkpointed block fails it. The compiled run's graph is the one chapter 05's FSDP test compiles
    (8 rows of 32 tokens a rank): inductor's cache on disk serves the second. The GPU measures them."""
    runs = {"plain": [], "compiled": ["--compile", "--fused-adamw", "--profile-out", str(tmp_path / "p.json")],
            "checkpointed": ["--activation-checkpointing", "--attention", "math"]}
    metrics = {}
    for name, extra in runs.items():
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, SCRIPT, "--steps", "4", *extra, "--metrics-out", str(out)],
                              cwd=launch.REPO_ROOT, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        metrics[name] = json.loads(out.read_text())
    plain = metrics["plain"]["losses"]
    for name in ("compiled", "checkpointed"):
        assert len(metrics[name]["losses"]) == len(plain) == 4
        assert max(abs(a - b) for a, b in zip(metrics[name]["losses"], plain)) <= 1e-5, name
        assert not any("saved activations measured" in c["name"] for c in metrics[name]["checks"])
    # one graph for every block (and both runs): the blocks share their code, their weights are the graph's inputs
    # (chapter 01: "One compiled graph serves all 24 blocks")
    assert [c["value"] for c in metrics["compiled"]["checks"] if c["name"].startswith("the blocks ran compiled")] == [1]
    # checkpointed blocks keep only their inputs: far fewer saved bytes
    assert metrics["checkpointed"]["memory"]["measured_activations"] < metrics["plain"]["memory"]["measured_activations"] / 2
    assert not (tmp_path / "p.json").exists()  # the device-time breakdown is of GPU kernels: none on a CPU


def test_a_gpu_attention_kernel_on_the_cpu_is_a_config_error():
    from helpers import assert_config_error

    assert_config_error(SCRIPT, ["--attention", "cudnn", "--steps", "2"], "--attention cudnn is a CUDA kernel",
                        nproc=1)
