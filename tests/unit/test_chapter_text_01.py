"""Chapter 01's numbers, recomputed: the test fails when chapters/01_single_device_baseline.md drifts from the code."""

from pathlib import Path

from distlab import memory, metrics, models

TEXT = (Path(__file__).resolve().parents[2] / "chapters" / "01_single_device_baseline.md").read_text()
GIB = 2**30


def says(phrase: str) -> None:
    assert phrase in TEXT, f"chapter 01 no longer says {phrase!r}: the code computes it; update the text"


def test_training_state_of_the_tiny_and_a100_presets():
    tiny, a100 = models.preset("tiny"), models.preset("a100")
    state = memory.training_state_bytes(tiny.num_params())
    says(f"For the `tiny` preset, {tiny.num_params():,} parameters, that is {state.params:,} bytes of parameters")
    says(f"{state.optimizer:,} of AdamW moments: {state.total:,} bytes")
    says(f"For the `a100` preset, {a100.num_params():,} parameters, it is\n"
         f"{memory.training_state_bytes(a100.num_params()).total / GIB:.1f} GiB before")


def test_activation_predictions():
    tiny, a100 = models.preset("tiny"), models.preset("a100")
    says(f"`tiny` preset at batch 8, it predicts {memory.transformer_activation_bytes(tiny, 8):,} bytes")
    per_sequence = memory.transformer_activation_bytes(a100, 1)
    says(f"it predicts {per_sequence / GIB:.2f} GiB per sequence")
    state = memory.training_state_bytes(a100.num_params()).total
    at_batch_4 = state + 4 * per_sequence
    says(f"together take {at_batch_4 / GIB:.1f} GiB")
    assert 0.9 < at_batch_4 / (40 * GIB) < 1.0  # "fills an A100-40GB (40 GiB) to the brim"


def test_flops_per_token_and_mfu():
    tiny, a100 = models.preset("tiny"), models.preset("a100")
    says(f"For the `tiny` preset that is {metrics.transformer_flops_per_token(tiny):,.0f} FLOPs per token")
    per_token = metrics.transformer_flops_per_token(a100)
    says(f"for the `a100` preset {per_token / 1e9:.2f} GFLOPs per token")
    says(f"40% MFU on one A100 in bf16 means\n{0.4 * metrics.peak_flops('A100', 'bf16') / per_token:,.0f} tokens")
    says(f"on an H100, {0.4 * metrics.peak_flops('H100', 'bf16') / per_token:,.0f}")
    says(f"A run at 5,000 tokens per second on an A100 is at {100 * metrics.mfu(5000, per_token, 'A100', 'bf16'):.1f}%")


def test_the_peak_table_is_the_library_table():
    def tflops(gpu, dtype):
        return f"{metrics.peak_flops(gpu, dtype) / 1e12:g} TFLOP/s"

    says(f"| A100 | {tflops('A100', 'bf16')} | {tflops('A100', 'tf32')} | {tflops('A100', 'fp32')} |")
    says(f"| H100 (SXM) | {tflops('H100 SXM', 'bf16')} | {tflops('H100 SXM', 'tf32')} | {tflops('H100 SXM', 'fp32')} |")


def test_the_activation_count_uses_the_conventions_symbols():
    # width d (chapter 01's name for h), a heads: upper-case H never names the heads
    says("**10d + 2 + a + 4F numbers per token**")
    assert " H heads" not in TEXT
