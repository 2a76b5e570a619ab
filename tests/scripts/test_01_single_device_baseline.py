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


def test_a_gpu_attention_kernel_on_the_cpu_is_a_config_error():
    from helpers import assert_config_error

    assert_config_error(SCRIPT, ["--attention", "cudnn", "--steps", "2"], "--attention cudnn is a CUDA kernel",
                        nproc=1)
