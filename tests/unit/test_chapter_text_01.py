"""Chapter 01's numbers, recomputed: the test fails when the chapter's pages (chapters/01_single_device_baseline.md,
chapters/01.2_where_the_time_goes.md) drift from the code."""

import json
from pathlib import Path

from coursetools import chapters, gpu_ladder

from distlab import memory, metrics, models

TEXT = chapters.text("01")   # every page: a claim may sit on either, or in "How we know"
GIB = 2**30


def flat(text: str) -> str:
    """The text with every run of whitespace made one space: a phrase may be rewrapped, not reworded."""
    return " ".join(text.split())


def says(phrase: str) -> None:
    assert flat(phrase) in flat(TEXT), f"chapter 01 no longer says {phrase!r}: the code computes it; update the text"
    if phrase.startswith("|"):   # a table row renders only on one line: verbatim, not just its words
        assert phrase in TEXT, f"chapter 01's table row {phrase!r} is no longer one line of its table"


def test_training_state_of_the_tiny_and_a100_presets():
    tiny, a100 = models.preset("tiny"), models.preset("a100")
    state = memory.training_state_bytes(tiny.num_params())
    says(f"For the `tiny` preset, {tiny.num_params():,} parameters, that is {state.params:,} bytes of parameters")
    says(f"{state.optimizer:,} of AdamW moments: {state.total:,} bytes")
    says(f"For the `a100` preset, {a100.num_params():,} parameters, it is\n"
         f"{memory.training_state_bytes(a100.num_params()).total / GIB:.1f} GiB before")


def test_the_vocabulary_share_of_the_activations():
    """The loss's V numbers a token are a few percent of the activations for both presets, the smaller share at
    V = 32,000 (the blocks grow with d and F too); only the Llama 3 slice, V = 128,256 over 8 layers, makes it large."""
    shares = {}
    for name, batch in (("tiny", 8), ("a100", 4), ("llama3_8b_slice", 1)):
        cfg = models.preset(name)
        parts = memory.transformer_activation_breakdown(cfg, batch)
        shares[name] = parts["loss (log-softmax)"] / sum(parts.values())
    tiny, a100 = models.preset("tiny"), models.preset("a100")
    assert shares["a100"] < shares["tiny"] < 0.05 < 0.1 < shares["llama3_8b_slice"]
    per_block = 10 * a100.dim + 2 + a100.n_heads + 4 * a100.ffn_hidden
    says(f"{shares['tiny']:.1%} of the `tiny` preset's activations at batch 8 and {shares['a100']:.1%} of the "
         f"`a100` preset's at batch 4")
    says(f"{a100.vocab_size:,} numbers a token against {a100.n_layers} x {per_block:,} for the blocks")
    llama = models.preset("llama3_8b_slice")
    says(f"trains has {llama.vocab_size:,} words over {llama.n_layers} layers: its loss holds "
         f"{shares['llama3_8b_slice']:.0%} of its activations")
    assert not any(claim in flat(TEXT) for claim in ("small for a vocabulary of 128", "large for one of 32,000"))


def test_activation_predictions():
    tiny, a100 = models.preset("tiny"), models.preset("a100")
    says(f"`tiny` preset at batch 8, it predicts {memory.transformer_activation_bytes(tiny, 8):,} bytes")
    per_sequence = memory.transformer_activation_bytes(a100, 1)
    says(f"it predicts {per_sequence / GIB:.2f} GiB per sequence")
    state = memory.training_state_bytes(a100.num_params())
    at_batch_4 = state.total + 4 * per_sequence
    says(f"add up to {at_batch_4 / GIB:.1f} GiB")
    peak = memory.predict_step_peak(state, 4 * per_sequence, 4, a100.seq_len, a100.vocab_size)
    assert peak.peak_phase == "forward/backward"
    says(f"So the peak is {peak.peak / GIB:.1f} GiB, in\nforward/backward")
    assert 0.75 < peak.peak / (40 * GIB) < 0.9  # "most of an A100-40GB"


# Measured on one H200, torch 2.11 (BENCHMARKS.md, 2026-11-26): the baseline (a100 preset, bf16 autocast, batch 4)
# predicted 33.82 GiB when every consumer was added up, of which 20.33 GiB training state, so its saved activations
# (read off the tensors) were 13.49 GiB; max_memory_allocated 29.78 GiB. train_fsdp.py --preset a100 on one rank
# (a100_large, bf16 mixed precision, one sequence): 54.74 GiB added up, 62.80 GiB measured. Throughput: 27,758 to
# 28,434 tokens/s; 1 GiB copies at 4,229 to 4,266 GB/s.
H200_BF16_ACTIVATIONS_GIB, H200_BASELINE_PEAK_GIB, H200_FSDP_PEAK_GIB = 13.49, 29.78, 62.80
H200_TOKENS_PER_S, H200_COPY_GB_PER_S = (27_758, 28_434), (4_229, 4_266)


def test_bf16_autocast_saves_17_percent_not_half():
    fp32 = memory.transformer_activation_bytes(models.preset("a100"), 4) / GIB
    says(f"13.49 GiB under bf16 autocast against the {fp32:.2f} GiB of the fp32 formula, "
         f"{1 - H200_BF16_ACTIVATIONS_GIB / fp32:.0%} less")


def test_the_peak_by_phase_against_the_h200():
    a100, large = models.preset("a100"), models.preset("a100_large")
    n = a100.num_params()
    baseline = memory.predict_step_peak(memory.training_state_bytes(n), round(H200_BF16_ACTIVATIONS_GIB * GIB), 4,
                                        a100.seq_len, a100.vocab_size)
    fb, step = (baseline.phases[p] for p in ("forward/backward", "optimizer step"))
    says(f"forward/backward holds {(fb['weights'] + fb['optimizer state']) / GIB:.2f} GiB of weights\nand moments, "
         f"{H200_BF16_ACTIVATIONS_GIB:.2f} GiB of saved activations (read off the tensors) and "
         f"{fb['loss gradients (fp32, 2 x B x T x V)'] / GIB:.2f} GiB of loss gradients, "
         f"{baseline.total('forward/backward') / GIB:.2f} GiB;\nthe optimizer step "
         f"{baseline.total('optimizer step') / GIB:.2f} GiB")
    assert baseline.peak_phase == "forward/backward" and step["optimizer temporaries"] == 4 * n
    assert memory.within_margin(baseline.peak, H200_BASELINE_PEAK_GIB * GIB)
    says(f"`torch.cuda.max_memory_allocated` measured\n{H200_BASELINE_PEAK_GIB:.2f} GiB")
    m = large.num_params()
    fsdp = memory.predict_step_peak(memory.training_state_bytes(m), 0, 1, large.seq_len, large.vocab_size)
    says(f"its optimizer step, {fsdp.total('optimizer step') / GIB:.2f} GiB at 20 bytes per parameter")
    says(f"{H200_FSDP_PEAK_GIB:.2f} GiB measured")
    # the summed consumers against the two measured peaks: too much for the baseline, too little for a100_large
    says(f"{33.82 - H200_BASELINE_PEAK_GIB:.0f} GiB too much for the first, and "
         f"{H200_FSDP_PEAK_GIB - 54.74:.0f} GiB too little for the second, whose peak holds AdamW's temporary")
    assert memory.within_margin(20 * m, H200_FSDP_PEAK_GIB * GIB)
    says(f"{m / 1e9:.2f} B-parameter `a100_large` preset")
    says(f"each equal the prediction within {memory.CPU_PEAK_MARGIN:.0%} in both phases")
    says(f"within {memory.PEAK_MARGIN:.0%} (`memory.PEAK_MARGIN`)")



def test_flops_per_token_and_mfu():
    tiny, a100 = models.preset("tiny"), models.preset("a100")
    says(f"For the `tiny` preset that is {metrics.transformer_flops_per_token(tiny):,.0f} FLOPs per token")
    per_token = metrics.transformer_flops_per_token(a100)
    says(f"for the `a100` preset {per_token / 1e9:.2f} GFLOPs per token")
    low, high = (t * per_token for t in H200_TOKENS_PER_S)
    says(f"{H200_TOKENS_PER_S[0]:,} to {H200_TOKENS_PER_S[1]:,} tokens per second: times {per_token / 1e9:.2f} GFLOPs "
         f"per token, {low / 1e12:.0f} to {high / 1e12:.0f} TFLOP/s, **{high / metrics.peak_flops('H200', 'bf16'):.0%} "
         f"MFU** ({100 * low / metrics.peak_flops('H200', 'bf16'):.1f} to {high / metrics.peak_flops('H200', 'bf16'):.1%})")
    # foreach AdamW's eight passes (torch/optim/adam.py): decay 8, lerp 12, mul 8, addcmul 12, sqrt 8, div 8, add 8,
    # addcdiv 16 bytes a parameter
    passes = (8, 12, 8, 12, 8, 8, 8, 16)
    adamw_bytes = sum(passes) * models.preset("a100").num_params()
    assert adamw_bytes // models.preset("a100").num_params() == 80 and len(passes) == 8
    says(f"about {sum(passes)} bytes per parameter each step: each of its eight `_foreach_` operations reads one "
         f"to three fp32 tensors and writes one, {', '.join(map(str, passes[:-1]))} and {passes[-1]} bytes a parameter")
    says(f"{adamw_bytes / 1e9:.0f} GB for the `a100` preset: at\nleast {adamw_bytes / (H200_COPY_GB_PER_S[1] * 1e9) * 1e3:.1f} ms "
         f"even at {H200_COPY_GB_PER_S[1]:,} GB/s, the faster of the H200's measured memory copies "
         f"({H200_COPY_GB_PER_S[0]:,} to {H200_COPY_GB_PER_S[1]:,} GB/s)")
    says(f"the `a100` preset at\n5,000 tokens per second on an A100 would be at "
         f"{100 * metrics.mfu(5000, per_token, 'A100', 'bf16'):.1f}%")


def test_the_peak_table_is_the_library_table():
    def tflops(gpu, dtype):
        return f"{metrics.peak_flops(gpu, dtype) / 1e12:g} TFLOP/s"

    says(f"| A100 | {tflops('A100', 'bf16')} | {tflops('A100', 'tf32')} | {tflops('A100', 'fp32')} |")
    says(f"| H100 (SXM), H200 (SXM) | {tflops('H100 SXM', 'bf16')} | {tflops('H100 SXM', 'tf32')} | "
         f"{tflops('H100 SXM', 'fp32')} |")
    for name in ("NVIDIA H100 NVL", "NVIDIA H200 NVL"):   # torch.cuda.get_device_name's spelling
        says(f"| H100 NVL, H200 NVL | {tflops(name, 'bf16')} | {tflops(name, 'tf32')} | {tflops(name, 'fp32')} |")
    assert metrics.peak_flops("NVIDIA H200", "bf16") == metrics.peak_flops("H100 SXM", "bf16")  # the SXM module
    says(f'"BFLOAT16 Tensor Core {2 * metrics.peak_flops("H100 NVL", "bf16") / 1e12:,.0f} TFLOPS" and "TF32 Tensor\n'
         f'Core {2 * metrics.peak_flops("H100 NVL", "tf32") / 1e12:.0f} TFLOPS"')


def test_the_activation_count_uses_the_conventions_symbols():
    # width d (chapter 01's name for h), a heads: upper-case H never names the heads
    says("**10d + 2 + a + 4F numbers per token**")
    assert " H heads" not in TEXT


def test_the_tuned_runs_mfu_is_quoted_from_the_stored_sources():
    from distlab.planner.sources import SOURCES

    h100 = SOURCES["torchtitan_h100_hardware_and_mfu"].quote
    a100 = SOURCES["torchtitan_llama3_a100"].quote
    assert "achieves 33% to 39% MFU" in h100 and "8 or 128 H100 GPUs" in h100
    assert all(f"| {mfu}% |" in a100 for mfu in ("56.8", "58.2", "51.7")) and "64 A100" in a100
    says("torchtitan's published runs report 33% to 39% MFU for Llama 3.1 8B on 8 and 128\nH100s, and 51.7% to 58.2% "
         "for Llama 3 8B and 70B on 64 A100s")


def test_the_foreach_adamw_line_cited():
    """torch 2.13's foreach AdamW allocates one fp32 tensor a parameter at the line the chapter cites."""
    import importlib.util

    adam = (Path(importlib.util.find_spec("torch").origin).parent / "optim" / "adam.py").read_text().splitlines()
    assert adam[789].strip() == "exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)"
    says("`torch._foreach_sqrt(exp_avg_sq)` into a new fp32\n  tensor for every parameter (torch 2.13, "
         "`torch/optim/adam.py:790`)")
    assert memory.FOREACH_ADAMW_TEMPORARY_BYTES_PER_PARAM == 4


def test_the_gpu_peak_check_applies_from_6_gib():
    """The fixed costs the allocator counts (the H200 runs' excess over the prediction) and the size from which the
    scripts check the peak (memory.PEAK_CHECK_MIN_BYTES), recomputed."""
    a100, large, tiny = models.preset("a100"), models.preset("a100_large"), models.preset("tiny")
    baseline = memory.predict_step_peak(memory.training_state_bytes(a100.num_params()),
                                        round(H200_BF16_ACTIVATIONS_GIB * GIB), 4, a100.seq_len, a100.vocab_size).peak
    fixed = [H200_BASELINE_PEAK_GIB * GIB - baseline, H200_FSDP_PEAK_GIB * GIB - 20 * large.num_params()]
    small = memory.predict_step_peak(memory.training_state_bytes(tiny.num_params()),
                                     memory.transformer_activation_bytes(tiny, 8), 8, tiny.seq_len, tiny.vocab_size).peak
    says(f"where the prediction is {memory.PEAK_CHECK_MIN_BYTES / GIB:.0f} GiB or more (`memory.PEAK_CHECK_MIN_BYTES`)")
    says(f"both H200 runs measured {fixed[0] / 2**20:.0f} and {fixed[1] / 2**20:.0f} MiB over the prediction")
    says(f"over 2% of any peak under {max(fixed) / memory.PEAK_MARGIN / GIB:.1f} GiB")
    says(f"For the `tiny` preset's {small / 2**20:.1f} MiB the script prints both\nfigures and checks nothing")


# ---- the ladder on one GPU (measured: chapters/figures/data/01_gpu_ladder.json; derived figures computed here) ----
LADDER = json.loads((Path(__file__).resolve().parents[2] / "chapters/figures/data/01_gpu_ladder.json").read_text())
RUNG = {r["name"]: r for r in LADDER["rungs"]}
H100_COPY_GB_PER_S = 2990  # the device-to-device copy gpu-check measured on the same H100 (BENCHMARKS.md)


def ladder_figures() -> dict:
    """Every derived figure of the ladder section, from the measured rungs and the course's formulas."""
    full_8b = models.preset("llama3_8b_slice", n_layers=32)
    a100 = models.preset("a100")
    per_token_8b = metrics.transformer_flops_per_token(full_8b)
    best, kinds = RUNG["compiled_batch16"], LADDER["profile"]["device_time_by_kind"]
    gemm_flops_per_token = best["flops_per_token"] - 12 * a100.n_layers * a100.dim * a100.seq_len
    adam_bytes = 28 * a100.num_params()   # fused AdamW: reads p, g, m, v (16 B), writes p, m, v (12 B)
    slice_equiv = RUNG["llama3_8b_slice"]["achieved_flops_per_s"] / per_token_8b   # 8B-sized tokens/s
    return {
        "FP32_OWN": f"{RUNG['fp32']['mfu_own_dtype']:.1%}",
        "MATH_SLOWER": f"{1 - RUNG['bf16_math_attention']['tokens_per_s'] / RUNG['bf16']['tokens_per_s']:.0%}",
        "MATH_GIB": f"{(RUNG['bf16_math_attention']['peak_allocated_bytes'] - RUNG['bf16']['peak_allocated_bytes']) / GIB:.1f}",
        "ADAM_GB": f"{adam_bytes / 1e9:.1f}",
        "ADAM_MS": f"{adam_bytes / (H100_COPY_GB_PER_S * 1e9) * 1e3:.1f}",
        "COMPILE_GAIN": f"{RUNG['compiled']['tokens_per_s'] / RUNG['fused_adamw']['tokens_per_s'] - 1:.0%}",
        "CKPT_COST": f"{1 - RUNG['checkpointed_batch16']['tokens_per_s'] / best['tokens_per_s']:.0%}",
        "GEMM_RATE": f"{gemm_flops_per_token * best['batch'] * a100.seq_len / kinds['seconds']['matrix multiplies'] / 1e12:.0f}",
        "TT_FLOPS": f"{per_token_8b / 1e9:.2f}",
        "TT_MFU_EAGER": f"{5762 * per_token_8b / metrics.peak_flops('H100', 'bf16'):.1%}",
        "TT_MFU_COMPILED": f"{6667 * per_token_8b / metrics.peak_flops('H100', 'bf16'):.1%}",
        "SLICE_MFU": f"{RUNG['llama3_8b_slice']['mfu_bf16_peak']:.1%}",
        "SLICE_EQUIV": f"{slice_equiv:,.0f}",
        # where the slice's 8B-sized tokens/s sits against torchtitan's 5,762 (eager) and 6,667 (compiled)
        "SLICE_VS_TT": ("just below torchtitan's eager figure" if slice_equiv < 5762 else
                        "between torchtitan's eager and compiled figures" if slice_equiv < 6667 else
                        "above torchtitan's compiled figure"),
        "BF16_GAIN": f"{RUNG['bf16']['tokens_per_s'] / RUNG['fp32']['tokens_per_s']:.1f} times the tokens per second",
        "FP32_SLOWER": f"{metrics.peak_flops('H100', 'bf16') / metrics.peak_flops('H100', 'fp32'):.0f} times slower",
        "BLOCKS": f"all {a100.n_layers} blocks",
        "CKPT_GIB": f"from {best['peak_allocated_bytes'] / GIB:.1f} to "
                    f"{RUNG['checkpointed_batch16']['peak_allocated_bytes'] / GIB:.1f} GiB",
        "STEP_MS": f"({best['step_seconds'] * 1e3:.1f} ms, the mean of the timed steps)",
        "OUTSIDE_MS": f"{(best['step_seconds'] - kinds['window_seconds']) * 1e3:.0f} ms longer",
        "STATE_8B": f"{16 * full_8b.num_params() / 1e9:.0f} GB of fp32 training state",
        "LADDER_TABLE": gpu_ladder.ladder_markdown(LADDER),
        "DEVICE_TIME_TABLE": gpu_ladder.device_time_markdown(LADDER),
    }


def test_the_ladder_section_states_the_measured_and_derived_figures():
    from distlab.planner.sources import SOURCES

    table1 = SOURCES["torchtitan_llama31_8b_h100_8gpu"].quote
    assert "| FSDP | 5,762 |" in table1 and "| FSDP + torch.compile | 6,667 |" in table1
    # the settings named as differing: torchtitan's 8,192 tokens and its FSDP's bf16 weights, at the benchmark's commit
    assert "seq_len = 8192" in SOURCES["torchtitan_llama3_8b_toml"].quote
    assert 'mixed_precision_param", type=str, default="bfloat16"' in SOURCES["torchtitan_bf16_weights_and_compile_order"].quote
    assert models.preset("llama3_8b_slice", n_layers=32).num_params() == 8_030_261_248  # Llama 3 8B's count
    # the ladder's section of the body, and its comparison with torchtitan's runs in "How we know"
    raw = (TEXT.split("### The ladder")[1].split("\n## ")[0]
           + TEXT.split("### Against a published run")[1].split("\n### ")[0])
    section = flat(raw)
    for key, value in ladder_figures().items():
        assert flat(value) in section, f"{key}: the ladder section no longer says {value!r}; update the text"
        if key.endswith("_TABLE"):   # a table renders only row by row: its lines verbatim, not just its words
            assert value in raw, f"{key}: the ladder section's table is no longer {value!r} line for line"
    # the heading spans the whole ladder: from the fp32 rung (the lowest) to the best
    mfus = [r["mfu_bf16_peak"] for r in LADDER["rungs"] if "mfu_bf16_peak" in r]   # the rungs that ran
    low, high = min(mfus), max(mfus)
    assert low == RUNG["fp32"]["mfu_bf16_peak"]
    says(f"### The ladder: from {low:.0%} to {high:.0%} on one GPU")
    assert "47.8% MFU" in section and f"{RUNG['compiled_batch16']['mfu_bf16_peak']:.1%}" == "47.8%"
    # the compiled rung's failed peak check is not explained away: the batch-16 compiled rung passed the same check
    assert any(c.startswith("peak memory") for c in RUNG["compiled"]["failed_checks"])
    assert not RUNG["compiled_batch16"]["failed_checks"] and "compiled rung passed the same check" in section


def test_the_two_phases_worked_in_fp32():
    """The formula's worked number (fp32, batch 4) and its implications: the sum overstates the peak by 4 GiB, and at
    batch 1 the optimizer step holds the peak."""
    a100 = models.preset("a100")
    state = memory.training_state_bytes(a100.num_params())
    phases = {b: memory.predict_step_peak(state, memory.transformer_activation_bytes(a100, b), b, a100.seq_len,
                                          a100.vocab_size) for b in (1, 4)}
    top = phases[4].phases["forward/backward"]
    says(f"{(top['weights'] + top['optimizer state']) / GIB:.2f} GiB of weights and moments, "
         f"{top['saved activations'] / GIB:.2f} GiB of activations and\n"
         f"{top['loss gradients (fp32, 2 x B x T x V)'] / GIB:.2f} GiB of loss gradients make "
         f"{phases[4].total('forward/backward') / GIB:.1f} GiB; the optimizer step holds "
         f"{phases[4].total('optimizer step') / GIB:.2f} GiB")
    assert phases[4].peak_phase == "forward/backward" and phases[1].peak_phase == "optimizer step"
    says("At batch 1 the activations are a\nquarter as large, and the optimizer step holds the peak instead")
    overstated = (state.total + memory.transformer_activation_bytes(a100, 4) - phases[4].peak) / GIB
    assert round(overstated) == 4 and round(overstated / 40, 1) == 0.1
    says("overstate the\npeak by 4 GiB at batch 4: a plan made from the sum wastes a tenth of the GPU")
    # and the sum can fall short: at batch 1 the optimizer step's foreach temporary is none of the four consumers
    summed_1 = (state.total + memory.transformer_activation_bytes(a100, 1)) / GIB
    assert summed_1 < phases[1].peak / GIB and phases[1].phases["optimizer step"]["optimizer temporaries"] > 0
    says(f"At batch 1 the sum falls short instead: {summed_1:.1f} GiB against the optimizer step's "
         f"{phases[1].total('optimizer step') / GIB:.2f}, because AdamW's temporary is none of the four consumers")
    tiny = models.preset("tiny")
    assert memory.transformer_activation_bytes(tiny, 8) > memory.training_state_bytes(tiny.num_params()).total
    says("already more than its whole training state")
    assert 0.5 <= state.total / (40 * GIB) < 0.55
    says("Half of a 40 GiB GPU is gone before training starts")
    bf16 = memory.predict_step_peak(state, round(H200_BF16_ACTIVATIONS_GIB * GIB), 4, a100.seq_len, a100.vocab_size)
    says(f"29.78 GiB, {H200_BASELINE_PEAK_GIB * GIB / bf16.peak - 1:.1%} over the phase\nmodel")


def test_the_step_picture_is_the_phase_model():
    """01_step_memory.png is drawn from the phase model: its top of backward and its optimizer step are
    memory.predict_step_peak's two phases, and the step's sum of everything is never reached."""
    from coursetools.drawings import ch01

    a100 = models.preset("a100")
    state = memory.training_state_bytes(a100.num_params())
    activations = memory.transformer_activation_bytes(a100, 4)
    phases = memory.predict_step_peak(state, activations, 4, a100.seq_len, a100.vocab_size)
    moments = {name: sum(terms.values()) for name, terms in ch01.step_memory_timeline("a100", 4)}
    assert moments["top of backward"] == phases.total("forward/backward")
    assert moments["optimizer step"] == phases.total("optimizer step")
    assert max(moments.values()) == phases.peak < state.total + activations


def test_the_time_figures_and_their_conclusions():
    a100 = models.preset("a100")
    per_token = metrics.transformer_flops_per_token(a100)
    step_flops = per_token * 4 * a100.seq_len
    says(f"{step_flops / 1e12:.0f} TFLOPs of\nwork: about a tenth of a second even on a GPU that sustains 300 TFLOP/s")
    assert 0.09 < step_flops / 300e12 < 0.13
    adamw_ms = 80 * a100.num_params() / (H200_COPY_GB_PER_S[1] * 1e9) * 1e3
    # the H200's step is its 4 x 1024 tokens over its measured tokens/s: the faster run's step is the shorter
    fast, slow = (4 * a100.seq_len / tokens_per_s * 1e3 for tokens_per_s in reversed(H200_TOKENS_PER_S))
    says(f"out of a step of {fast:.0f} to {slow:.0f} ms")
    says(f"A step's {4 * a100.seq_len:,} tokens at those rates take {fast:.0f} to {slow:.0f} ms")
    assert adamw_ms / slow >= 1 / 6 and adamw_ms / fast < 1 / 5
    says("So at least a sixth of the step is the optimizer alone")
    gemm = float(ladder_figures()["GEMM_RATE"]) * 1e12 / metrics.peak_flops("H100", "bf16")
    says(f"723 TFLOP/s (their FLOPs over their time), {gemm:.0%} of the bf16 peak")


def test_the_h200_peak_is_read_with_its_bf16_activations():
    """Page 1's measured peak names the run's bf16 activations and the phase model's prediction with them, and the
    pitfall's 'overstated' is the fp32 formula over the measurement (not the measurement under it)."""
    a100 = models.preset("a100")
    fp32 = memory.transformer_activation_bytes(a100, 4) / GIB
    bf16 = memory.predict_step_peak(memory.training_state_bytes(a100.num_params()),
                                    round(H200_BF16_ACTIVATIONS_GIB * GIB), 4, a100.seq_len, a100.vocab_size)
    says(f"where the saved activations measured\n{H200_BF16_ACTIVATIONS_GIB:.2f} GiB instead of the fp32 formula's "
         f"{fp32:.2f}")
    says(f"With them the phase model predicts {bf16.peak / GIB:.2f} GiB")
    says(f"which overstated this run by {fp32 / H200_BF16_ACTIVATIONS_GIB - 1:.0%}\n"
         f"({fp32 - H200_BF16_ACTIVATIONS_GIB:.2f} GiB)")


def test_the_activation_count_names_the_a100_shape():
    a100 = models.preset("a100")
    says(f"the `a100` preset has d = {a100.dim}, a = {a100.n_heads},\nF = {a100.ffn_hidden} and a vocabulary of "
         f"V = {a100.vocab_size:,} words")


def test_the_training_memory_caption_says_the_sum_is_not_the_peak():
    from coursetools import figures

    tiny = models.preset("tiny")
    parts = figures.training_memory_of("tiny")["predicted"]
    peak = memory.predict_step_peak(memory.training_state_bytes(tiny.num_params()),
                                    memory.transformer_activation_bytes(tiny, 8), 8, tiny.seq_len, tiny.vocab_size)
    assert peak.peak < sum(parts.values())
    says(f"for `tiny` the bar reaches {sum(parts.values()) / 2**20:.2f} MiB, while the larger phase holds "
         f"{peak.peak / 2**20:.2f} MiB")


def test_the_ladder_conclusions_are_computed():
    a100 = models.preset("a100")
    best, kinds = RUNG["compiled_batch16"], LADDER["profile"]["device_time_by_kind"]
    tokens = best["batch"] * a100.seq_len
    rate = tokens * best["flops_per_token"] / kinds["window_seconds"]
    says(f"the step's {tokens:,} tokens at {best['flops_per_token'] / 1e9:.2f} GFLOPs each in "
         f"{kinds['window_seconds'] * 1e3:.1f} ms would run at {rate / 1e12:.0f} TFLOP/s, "
         f"{rate / metrics.peak_flops('H100', 'bf16'):.1%} MFU")
    says(f"The H100's `bf16` rung reaches {RUNG['bf16']['mfu_bf16_peak']:.1%} where the H200 above reached "
         f"{H200_TOKENS_PER_S[1] * metrics.transformer_flops_per_token(a100) / metrics.peak_flops('H200', 'bf16'):.0%}")
    says(f"the H200's copies measured {H200_COPY_GB_PER_S[0] / H100_COPY_GB_PER_S:.1f} times faster "
         f"({H200_COPY_GB_PER_S[0]:,} against {H100_COPY_GB_PER_S:,} GB/s)")
    says(f"at least 12.8 ms at the\n  {H100_COPY_GB_PER_S:,} GB/s this H100's memory copies measured")


def test_the_exercises_name_what_the_lab_checks():
    import json
    import re

    from labkit.exercises import ch01

    lab = json.loads((Path(__file__).resolve().parents[2] / "notebooks/01_single_device_baseline.ipynb").read_text())
    cell = next("".join(c["source"]) for c in lab["cells"] if "exercise_cfg = models.TransformerConfig(" in "".join(c["source"]))
    cfg = dict(re.findall(r"(\w+)=(\d+)", cell.split("TransformerConfig(")[1].split(")")[0]))
    says(f"(V = {cfg['vocab_size']}, d = {cfg['dim']}, L = {cfg['n_layers']} layers, F = {cfg['ffn_hidden']})")
    batches = [b for _, b in ch01.STEP_PEAK_CASES]
    assert {p for p, _ in ch01.STEP_PEAK_CASES} == {"a100"}
    says(f"checks it on the `a100` preset at batch sizes {', '.join(map(str, batches[:-1]))} and {batches[-1]}")


def test_the_lab_writes_the_data_rule_as_the_chapter_does():
    lab = json.loads((Path(__file__).resolve().parents[2] / "notebooks/01_single_device_baseline.ipynb").read_text())
    cells = "".join("".join(c["source"]) for c in lab["cells"])
    says("`next = (5 * prev + 3) mod vocab`")
    assert "`next = (5 * prev + 3) mod 128`" in cells and "5 * prev + 3 mod" not in cells
