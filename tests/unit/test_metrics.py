"""FLOPs, MFU, peaks and the metrics report."""

import json
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distlab import data, metrics, models


def test_peak_flops_of_the_gpus_the_course_quotes():
    assert metrics.peak_flops("NVIDIA A100-SXM4-40GB", "bf16") == 312e12
    assert metrics.peak_flops("NVIDIA A100-SXM4-40GB", "tf32") == 156e12
    assert metrics.peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5e12
    assert metrics.peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert metrics.peak_flops("NVIDIA H100 PCIe", "bf16") == pytest.approx(756e12)
    assert metrics.peak_flops("cpu") is None and metrics.peak_flops(None) is None
    assert metrics.peak_flops("NVIDIA GeForce GTX 1080") is None


def test_amd_peaks_are_per_device_and_none_where_the_name_is_two_boards():
    # third-party copies of AMD's tables (metrics.AMD_PEAK_FLOPS): 383.0 TF bf16 an MI250X module of two GCDs, each
    # a device to PyTorch; 1307.4 TF an MI300X
    assert metrics.peak_flops("AMD Instinct MI250X", "bf16") == 383.0e12 / 2
    assert metrics.peak_flops("AMD Instinct MI250X", "fp16") == 383.0e12 / 2
    assert metrics.peak_flops("AMD Instinct MI300X", "bf16") == 1307.4e12
    # libdrm's name for device 0x740C rev 01 is both boards (the MI250's module peak is 362.1 TF): no MFU claimed
    assert metrics.peak_flops("AMD Instinct MI250X / MI250", "bf16") is None
    assert metrics.peak_flops("AMD Instinct MI300A", "bf16") is None  # another board (an APU), not in the table
    assert metrics.mfu(1e5, 1e9, "AMD Instinct MI250X / MI250") is None


def test_mfu_is_none_where_no_peak_is_known():
    assert metrics.mfu(1e6, 1e9, "cpu") is None
    # 100 k tokens/s x 1.56 GFLOP/token on one A100 = 156 TFLOP/s = half of 312
    assert metrics.mfu(1e5, 1.56e9, "A100", "bf16") == pytest.approx(0.5)
    assert metrics.mfu(4e5, 1.56e9, "A100", "bf16", num_devices=4) == pytest.approx(0.5)


def test_flops_per_token_formula():
    cfg = models.preset("tiny")
    matmul_params = cfg.num_params() - cfg.vocab_size * cfg.dim
    assert metrics.transformer_flops_per_token(cfg) == 6 * matmul_params + 12 * cfg.n_layers * cfg.dim * cfg.seq_len
    assert metrics.transformer_flops_per_token(cfg) == 739_200  # chapter 01 quotes it
    a100 = models.preset("a100")
    assert round(metrics.transformer_flops_per_token(a100) / 1e9, 2) == 8.40


def test_six_flops_per_weight_per_token_is_what_the_matmuls_do():
    """FlopCounterMode over forward + backward: the matrix products are exactly 6 x weights x tokens."""
    cfg = models.preset("tiny")
    model = models.build_transformer(cfg)
    inputs, targets = data.split_inputs_targets(data.token_batch(0, 4, cfg.seq_len, cfg.vocab_size))
    with FlopCounterMode(display=False) as counter:
        models.lm_loss(model(inputs), targets).backward()
    matmul_weights = sum(p.numel() for name, p in model.named_parameters()
                         if p.dim() == 2 and "tok_embeddings" not in name)
    mm_flops = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    assert mm_flops == 6 * matmul_weights * inputs.numel()


def test_report_checks_and_exit_code(tmp_path, capsys):
    report = metrics.Report("scripts/01_x/y.py", config={"steps": 3, "fn": print})
    assert report.script == "01_x/y.py" and report.config == {"steps": 3}  # unserialisable values dropped
    report.check_close("close", [1.0, 2.0], [1.0, 2.0 + 1e-9], tolerance=1e-6)
    report.check_equal("equal", 5, 5)
    assert report.finish(tmp_path / "m.json") == 0
    written = json.loads((tmp_path / "m.json").read_text())
    for key in ("script", "world_size", "device", "config", "losses", "checks", "comm", "memory", "throughput"):
        assert key in written
    report.check("fails", False)
    assert report.finish() == 1
    assert "[FAIL] fails" in capsys.readouterr().out


def test_tensor_bytes_counts_a_storage_once():
    t = torch.zeros(10)
    assert metrics.tensor_bytes([t, t[:5], t.view(2, 5), None]) == 40
    assert metrics.tensor_bytes([t, torch.zeros(3, dtype=torch.float64)]) == 40 + 24


def test_max_abs_diff():
    assert metrics.max_abs_diff([1.0, [2.0, 3.0]], [1.0, [2.0, 3.5]]) == 0.5
    assert metrics.max_abs_diff(torch.ones(2), torch.ones(3)) == float("inf")
    assert metrics.max_abs_diff([1.0], [1.0, 2.0]) == float("inf")


def test_chapter_01_mfu_numbers():
    """a100 preset: tokens/s that 40% MFU means on one A100 and one H100 (bf16), and MFU at 5,000 tokens/s."""
    per_token = metrics.transformer_flops_per_token(models.preset("a100"))
    assert round(0.4 * metrics.peak_flops("A100", "bf16") / per_token) == 14_863
    assert round(0.4 * metrics.peak_flops("H100", "bf16") / per_token) == 47_115
    assert round(metrics.mfu(5000, per_token, "A100", "bf16"), 3) == 0.135


def test_throughput_block():
    from distlab import metrics, models

    cfg = models.preset("tiny")
    block = metrics.throughput(1000, 2.0, 4, cfg=cfg, device="cpu")
    assert block["tokens_per_s"] == 2000 and block["step_seconds"] == 0.5 and block["timed_steps"] == 4
    assert block["flops_per_token"] == metrics.transformer_flops_per_token(cfg)
    assert block["achieved_flops_per_s"] == 2000 * block["flops_per_token"]
    assert block["mfu"] is None and block["peak_flops"] is None, "no MFU is claimed on a CPU"
    assert metrics.throughput(1000, 0.0, 0)["tokens_per_s"] is None  # nothing timed: nothing claimed
    assert metrics.throughput(10, 1.0, 1, cfg=cfg, seq_len=8)["flops_per_token"] == \
        metrics.transformer_flops_per_token(cfg, 8)


def test_every_script_states_the_dtype_its_mfu_is_measured_against():
    """MFU against the fp32 peak for a bf16 run is 16x too high on an A100: every throughput call says its dtype."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "scripts"
    missing = []
    for script in sorted(root.glob("0[1-8]_*/*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "metrics.throughput" \
                    and "dtype" not in {k.arg for k in node.keywords}:
                missing.append(f"{script.parent.name}/{script.name}:{node.lineno}")
    assert not missing, f"metrics.throughput without dtype=: {missing}"


def test_a_bf16_run_is_measured_against_the_bf16_peak():
    from distlab import metrics

    fp32 = metrics.mfu(1000.0, 1e9, "NVIDIA A100-SXM4-40GB", "fp32")
    bf16 = metrics.mfu(1000.0, 1e9, "NVIDIA A100-SXM4-40GB", "bf16")
    assert fp32 / bf16 == 312 / 19.5 == 16.0   # the error the wrong peak makes


def test_fp32_tolerance_widens_on_a_gpu_only():
    import torch

    from distlab import metrics

    assert metrics.fp32_tolerance(1e-5, torch.device("cpu")) == 1e-5
    assert metrics.fp32_tolerance(1e-5, torch.device("cuda", 0)) == 1e-5 * metrics.GPU_FP32_TOLERANCE_FACTOR


def test_device_clock_on_a_cpu_counts_seconds_from_its_origin():
    import time

    from distlab import metrics

    clock = metrics.DeviceClock("cpu")
    time.sleep(0.01)
    assert 0.009 < clock.seconds(clock.mark()) < 1.0


def test_a_check_line_stays_short_whatever_the_values():
    from distlab import metrics

    report = metrics.Report("x.py", None)
    timeline = [{"rank": r, "start": 0.1 * r, "end": 0.1 * r + 0.05, "lane": "compute"} for r in range(40)]
    report.check("the measured timeline is ordered", True, timeline, timeline)
    report.check_equal("bytes per rank", list(range(300)), list(range(300)))
    report.check("loss", True, 0.123456, 1e-5)
    lines = report.checks_table().splitlines()
    assert all(len(line) < 260 for line in lines), lines
    assert "(40 items: 4 entries: {rank, start, end, ...}" in lines[0] and "(300 items: 0, 1, ...," in lines[1]
    assert lines[2] == "  [PASS] loss  (0.123, tolerance 1e-05)"
    assert report.checks[0]["value"] == timeline  # the metrics file keeps every item


def test_another_ranks_failed_checks_are_named_with_its_rank(capsys):
    """Rank 0 prints the table; a check that failed on another rank only (its own memory, its shard) must not
    leave the job failing with rank 0's table all green and nothing said."""
    from distlab import metrics

    report = metrics.Report("x.py", None)
    report.rank = 3
    report.check("memory of this rank", False, 640512, "<= 427008")
    report.check("loss", True, 0.1, 1e-5)
    assert report.finish() == 1
    assert capsys.readouterr().out.strip() == "rank 3:  [FAIL] memory of this rank  (640512, tolerance <= 427008)"


def test_step_clock_synchronises_before_each_reading_and_skips_the_first_steps(monkeypatch):
    # MFU's one definition (issue 34): whole steps, the device synchronised before the clock is read
    events, now = [], iter(range(100))
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: events.append("clock") or float(next(now)))
    clock = metrics.StepClock(lambda: events.append("sync"), skip=1)
    for _ in range(3):
        clock.start()
        clock.stop()
    assert events == ["sync", "clock"] * 6
    block = clock.throughput(100)
    assert block["timed_steps"] == 2 and block["step_seconds"] == 1.0 and block["tokens_per_s"] == 100.0
    assert "whole steps" in block["timed"]


def test_every_hybrid_of_chapter_09_times_whole_steps_with_the_one_clock():
    # pp_dp_hybrid.py and hybrid_3d.py timed the schedule alone, fsdp_tp_hybrid.py the whole step: now each
    # times through StepClock, stopped after the optimizer step (and after clipping, where it clips)
    import re
    folder = Path(__file__).resolve().parents[2] / "scripts" / "09_hybrid_parallel"
    for name in ("pp_dp_hybrid.py", "hybrid_3d.py", "fsdp_tp_hybrid.py"):
        source = (folder / name).read_text()
        # no stopwatch of its own: the one perf_counter allowed stamps when a DDP bucket was launched (where in the
        # step the gradient sync ran, pp_dp_hybrid.py), on the clock the timeline's bars use, not a step time
        stamps = [line for line in source.splitlines() if "perf_counter" in line]
        assert all("launches.append" in line for line in stamps) and "metrics.throughput(" not in source, name
        assert "metrics.StepClock(rt.sync" in source and "clock.throughput(" in source, name
        body = source[source.index("clock.start()"):source.index("clock.stop()")]
        assert re.search(r"optimizer\.step\(\)\s*$", body), name        # the optimizer step is inside the clock
        if "clip_grad_norm_(" in source:
            assert "clip_grad_norm_(" in body, name


def test_a_nan_is_the_worst_difference_wherever_it_stands():
    """max() skips a nan that is not first: a run gone nan after step 2 would pass every check against one device."""
    import math

    from distlab import metrics

    assert max([1e-7, math.nan]) == 1e-7   # the trap
    assert math.isnan(metrics.worst([1e-7, 2e-7, math.nan])) and metrics.worst([1e-7, 3e-7]) == 3e-7
    assert metrics.worst([]) == 0.0
    assert math.isnan(metrics.max_abs_diff([1.0, 2.0, 3.0], [1.0, 2.0, math.nan]))
    report = metrics.Report.__new__(metrics.Report)
    report.checks = []
    assert not report.check_close("loss = one device's", metrics.worst([0.0, math.nan]), 0.0, 1e-5)
