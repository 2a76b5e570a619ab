"""Chapter 01's ladder on the CPU: the switches' pieces (distlab.speed), the device-time breakdown of a profile
(distlab.profiling.device_time_by_kind) and the ladder runner's pure functions (coursetools.gpu_ladder), the last
on the ladder measured on an H100 (chapters/figures/data/01_gpu_ladder.json)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coursetools import gpu_ladder
from distlab import models, profiling, speed

REPO = Path(__file__).resolve().parents[2]
MEASURED = json.loads((REPO / "chapters/figures/data/01_gpu_ladder.json").read_text())


def test_a_checkpointed_block_gives_the_blocks_outputs_and_gradients():
    cfg = models.preset("tiny")
    model = models.build_transformer(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    plain = model(tokens)
    plain.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for name, block in list(model.layers.items()):
        model.layers[name] = speed.CheckpointedBlock(block)
    again = model(tokens)
    again.square().mean().backward()
    assert torch.equal(plain, again)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name.replace(".block.", ".")]), name


@pytest.mark.parametrize("name, device, precision, refused", [
    ("cudnn", "cpu", "fp32", True), ("efficient", "cpu", "bf16", True), ("flash", "cuda", "fp32", True),
    ("cudnn", "cuda", "fp32", True), ("flash", "cpu", "fp32", False), ("math", "cpu", "fp32", False),
    ("cudnn", "cuda", "bf16", False), ("efficient", "cuda", "fp32", False), ("auto", "cuda", "fp32", False)])
def test_attention_kernels_are_refused_where_they_cannot_run(name, device, precision, refused):
    assert (speed.attention_backend_problem(name, device, precision) is not None) == refused


def test_the_math_attention_kernel_equals_the_cpus_flash_kernel():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    with speed.attention_backend("math"):
        math = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with speed.attention_backend("flash"):
        flash = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(math, flash, atol=1e-6)
    with pytest.raises(ValueError, match="choose from"):
        speed.attention_backend("fastest")


def _kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_device_time_by_kind_sorts_kernels_and_finds_the_idle_gaps():
    trace = {"traceEvents": [
        _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 50),
        _kernel("fmha_cutlassF_bf16_aligned_64x64", 50, 10),      # cutlass in its name, but attention
        _kernel("triton_poi_fused_mul_silu_0", 70, 5),             # a gap of 10 us before it
        _kernel("void at::native::multi_tensor_apply_kernel<...>", 75, 15),
        _kernel("Memcpy DtoD", 95, 5, cat="gpu_memcpy"),           # a gap of 5 us before it
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},   # host work: not the device's
    ]}
    out = profiling.device_time_by_kind(trace)
    seconds = {k: round(v * 1e6) for k, v in out["seconds"].items()}
    assert seconds == {"matrix multiplies": 50, "attention": 10, profiling.OTHER_KERNELS: 5, "optimizer": 15,
                       "memory copies and sets": 5, profiling.DEVICE_IDLE: 15}
    assert round(out["window_seconds"] * 1e6) == 100 and out["kernels"] == 4
    assert out["attention_kernels"] == ["fmha_cutlassF_bf16_aligned_64x64"]
    with pytest.raises(ValueError, match="no GPU kernel"):
        profiling.device_time_by_kind({"traceEvents": trace["traceEvents"][-1:]})


# Kernel names as an H100 profile prints them (torch 2.11-2.13, CUDA 12-13): cuBLAS (nvjet, sm90 xmma, split-K),
# cuDNN's and flash's attention, inductor's fused Triton kernels, fused AdamW, ATen's elementwise and loss kernels
H100_KERNELS = [
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matrix multiplies"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas",
     "matrix multiplies"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>",
     "matrix multiplies"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "matrix multiplies"),
    *((name, "attention") for name in MEASURED["profile"]["device_time_by_kind"]["attention_kernels"]),   # cuDNN's
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false>>",
     "attention"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float, cutlass::arch::Sm80>)",
     "attention"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", profiling.OTHER_KERNELS),
    ("triton_poi_fused_mul_silu_1", profiling.OTHER_KERNELS),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4, true>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, double, double, double, double, double, bool, bool, float*, float*>",
     "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul>>",
     profiling.OTHER_KERNELS),
    ("void (anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, (anonymous namespace)::"
     "LogSoftMaxForwardEpilogue>", profiling.OTHER_KERNELS),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>",
     profiling.OTHER_KERNELS),
]


@pytest.mark.parametrize("name, kind", H100_KERNELS, ids=[n[:32] for n, _ in H100_KERNELS])
def test_h100_kernel_names_are_filed_under_their_kind(name, kind):
    assert profiling.kernel_kind(name) == kind


def test_the_measured_ladder_reads_back_and_its_best_rung_is_the_fastest_that_trained():
    rows = MEASURED["rungs"]
    best = gpu_ladder.best_rung(rows)
    trained_a100 = [r for r in rows if r.get("preset") == "a100" and r.get("tokens_per_s")
                    and not any(n.startswith(gpu_ladder.TRAINING_CHECKS) for n in r["failed_checks"])]
    assert best["tokens_per_s"] == max(r["tokens_per_s"] for r in trained_a100)
    # a rung whose loss did not fall is never the best, however fast
    fast_but_untrained = dict(best, name="x", tokens_per_s=best["tokens_per_s"] * 2,
                              failed_checks=["loss falls (mean of last 3 steps < 90% of the first)"])
    assert gpu_ladder.best_rung([*rows, fast_but_untrained])["name"] == best["name"]
    table = gpu_ladder.render_table(MEASURED)
    assert "NVIDIA H100 80GB HBM3" in table and "matrix multiplies" in table and best["name"] in table


def test_a_rung_row_from_metrics_and_from_a_crash():
    rung = gpu_ladder.RUNGS[1]
    metrics = {"throughput": {"tokens_per_s": 1000.0, "achieved_flops_per_s": 494.5e12, "device_name": "NVIDIA H100",
                              "step_seconds": 1.0, "mfu": 0.5, "peak_dtype": "bf16", "flops_per_token": 4.945e11},
               "memory": {"device": {"peak_allocated_bytes": 2**30}}, "config": {"batch": 4, "preset": "a100"},
               "losses": [3.0, 2.0], "checks": [{"name": "loss falls", "passed": True}]}
    row = gpu_ladder.rung_row(rung, 0, 12.0, metrics, "")
    assert row["status"] == "passed" and row["mfu_bf16_peak"] == pytest.approx(0.5)
    crashed = gpu_ladder.rung_row(rung, 1, 3.0, None, "Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory\n")
    assert crashed["status"] == "failed" and "out of memory" in crashed["reason"]


def test_the_ladder_without_a_gpu_says_so_and_exits_2():
    done = subprocess.run([sys.executable, "-m", "coursetools.gpu_ladder"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and done.stderr.startswith("config error:"), done.stderr
