"""The planner's saved activations against Korthikanti et al. (2022), "Reducing Activation Recomputation in Large
Transformer Models" (arXiv:2205.05198), computed here from the paper's expressions, not from the planner's code.

Per layer, in bytes (2-byte activations, 1-byte dropout masks): sbh (34 + 5 a s / h) without parallelism (its
equation 1); with tensor and sequence parallelism and selective recomputation, 34 s b h / t (its equation 6). With
1F1B the first stage holds p microbatches of L / p layers: L layers' worth, so 34 s b h L / t (its section 4.3).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from distlab import planner
import importlib

from distlab.planner import published

planner_memory = importlib.import_module("distlab.planner.memory")

GIB = 2**30


def korthikanti_first_stage_bytes(s, b, h, t, layers):
    return 34 * s * b * h / t * layers


def test_the_175b_selective_sp_row_holds_what_korthikanti_counts():
    run = next(r for r in published.RUNS if r.label.startswith("Megatron 175B, selective"))
    model = replace(run.model, micro_batch=1)
    options = replace(run.options, schedule="1f1b", chunks=1)
    planned = planner_memory.activation_bytes(model, run.layout, 0, options)
    paper = korthikanti_first_stage_bytes(2048, 1, 12288, 8, 96)
    assert paper / GIB == pytest.approx(9.56, abs=0.01)
    assert planned == pytest.approx(paper, rel=0.10)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_a_gpt_layer_under_tp_sp_and_selective_recomputation_is_34_sbh_over_t(t):
    s, b, h, a = 2048, 2, 6144, 48
    model = published.gpt("gpt", 8, h, a, 51200, s, 64, "test", micro_batch=b)
    options = replace(published.KORTHIKANTI_SELECTIVE, schedule="1f1b", chunks=1)
    planned = planner_memory.activation_bytes(model, planner.Layout(t, 8, 1), 0, options)  # 1 layer, 8 in flight
    assert planned / 8 == pytest.approx(34 * s * b * h / t, rel=0.01)


def test_a_gpt_layer_under_tp_alone_keeps_10_sbh_replicated():
    """Equation 2 without the attention scores (selective): sbh (10 + 24 / t)."""
    s, b, h, a, t = 2048, 1, 6144, 48, 4
    model = published.gpt("gpt", 8, h, a, 51200, s, 64, "test")
    options = replace(published.KORTHIKANTI_SELECTIVE, sequence_parallel=False, schedule="1f1b", chunks=1)
    planned = planner_memory.activation_bytes(model, planner.Layout(t, 8, 1), 0, options)
    assert planned / 8 == pytest.approx(s * b * h * (10 + 24 / t), rel=0.01)


def test_a_llama_layer_under_megatron_sp_saves_three_ffn_wide_tensors():
    """The same count for a Llama block (no dropout; RMSNorm saves its input; grouped-query K and V at their own
    width; Megatron's fused SwiGLU saves fc1's output, 2 f wide, and fc2's input, f wide), by hand:
    2 bytes x (2 norm inputs + 2 region inputs + q + attention output) h + 2 x 2 kv + 3 f, all over t, per token,
    plus flash attention's fp32 log-sum-exp of this rank's heads."""
    spec = planner.MODELS["405b"]
    h, kv, f, t, heads = 16384, 8 * 128, 53248, 8, 128
    by_hand = (2 * (6 * h + 2 * kv + 3 * f)) / t + 4 * heads / t
    assert by_hand == 65088
    model = replace(spec, layers=16, micro_batch=1)
    options = replace(published.LLAMA_PIPELINE, schedule="1f1b", chunks=1)
    planned = planner_memory.activation_bytes(model, planner.Layout(8, 16, 1, 1, 3), 0, options)
    assert planned / 16 / spec.seq_len == pytest.approx(by_hand, rel=0.001)


def test_megatrons_gradients_are_held_in_fp32_as_they_are_reduced():
    """Megatron-LM accumulates and reduces bf16 runs' gradients in fp32 (training/arguments.py sets
    accumulate_allreduce_grads_in_fp32): 4 bytes a parameter in memory, the 4 its reduce-scatter sends, in one
    contiguous buffer whose buckets are views (no second copy)."""
    run = next(r for r in published.RUNS if r.label.startswith("Megatron 175B, selective"))
    params = planner.stage_params(run.model, run.layout, 0)["total"]
    assert planner_memory.state_bytes(run.model, run.layout, 0, run.options).grads == 4 * params
    assert planner_memory.temporary_bytes(run.model, replace(run.layout, dp=2), 0, run.options) == 0
    # with torch's modules ZeRO-2 keeps the ZeRO paper's 2 bytes; ZeRO-1 is Megatron's distributed optimizer
    # either way, fp32 gradients in one buffer (tests/unit/test_planner_ddp.py)
    torch_modules = replace(run.options, sp_saves_gathered_inputs=True)
    assert planner_memory.state_bytes(run.model, replace(run.layout, zero_stage=2), 0, torch_modules).grads == 2 * params
    assert planner_memory.state_bytes(run.model, run.layout, 0, torch_modules).grads == 4 * params
