"""Chapter 02's tables, recomputed from labkit.widgets: the test fails when the chapter (chapters/02_why_distributed.md,
every page through coursetools.chapters) drifts.

Memory is in GiB (an A100 "40GB" has 40 GiB), as chapters/00_conventions.md says."""

from pathlib import Path

from coursetools import chapters
from distlab import memory, metrics
from labkit import widgets

TEXT = chapters.text("02")
GIB, A100 = widgets.GIB, widgets.GPUS["A100-40GB"]


def flat(text: str) -> str:
    """The text with every run of whitespace made one space: a phrase may be rewrapped, not reworded."""
    return " ".join(text.split())


def says(phrase: str) -> None:
    assert flat(phrase) in flat(TEXT), f"chapter 02 no longer says {phrase!r}: the code computes it; update the text"
    if phrase.startswith("|"):   # a table row renders only on one line: verbatim, not just its words
        assert phrase in TEXT, f"chapter 02's table row {phrase!r} is no longer one line of its table"


def test_the_memory_wall_table():
    for row in widgets.fit_table("A100-40GB", gpus=1, zero_stage=0):
        says(f"| {row['model']} | {row['state_gib_per_gpu']:,.1f} GiB | {'yes' if row['fits'] else 'no'} | "
             f"{row['min_gpus_fully_sharded']} |")
    # the sentence on units: counting 40 x 10^9 bytes per GPU gives other GPU counts
    wrong = [widgets.min_gpus_to_fit(n, 40e9, 3) for n in widgets.MODEL_SIZES.values()]
    right = [row["min_gpus_fully_sharded"] for row in widgets.fit_table("A100-40GB", gpus=1, zero_stage=0)]
    says(f"the last column\nreads {', '.join(map(str, wrong))} instead of {', '.join(map(str, right))}")
    # 40 x 10^9 is less than 40 x 2^30, so the count can only come out higher, never lower
    assert all(w >= r for w, r in zip(wrong, right)) and any(w > r for w, r in zip(wrong, right))
    says("your count of GPUs comes out one higher than the course's")
    assert "one higher or lower" not in TEXT
    says(f"A 7B model's weights alone, {memory.training_state_bytes(7e9, 'mixed').params / GIB:.1f} GiB in bf16")


def test_the_zero_table_for_a_7b_model_on_four_gpus():
    labels = {0: "replicated (DDP)", 1: "ZeRO-1: optimizer state sharded", 2: "ZeRO-2: and gradients",
              3: "ZeRO-3 / FSDP: and weights"}
    fits = []
    for stage, label in labels.items():
        per_gpu = widgets.state_bytes_per_gpu(7e9, 4, stage)
        replicated, sharded = widgets.bytes_per_param(stage)
        formula = "16" if stage == 0 else "16/n" if stage == 3 else f"{replicated:g} + {sharded:g}/n"
        says(f"| {label} | {formula} | {per_gpu / GIB:.1f} GiB |")
        fits.append(widgets.fit(7e9, 4, A100, stage).fits)
    assert fits == [False, False, True, True]  # "Only the last two fit in 40 GiB"
    says("| strategy | bytes per parameter on each GPU (n = 4) | per GPU |")
    says("Only the last two fit in 40 GiB")


def test_the_compute_wall_table():
    for row in widgets.fit_table("A100-40GB", gpus=1):
        n, d = row["params"], row["tokens"]
        mantissa, exponent = f"{widgets.training_flops(n, d):.1e}".split("e")
        days = [widgets.training_days(n, d, gpus=g) for g in (1, 4, 512)]
        on_512 = f"{days[2]:.2f}" if days[2] < 0.1 else f"{days[2]:.1f}" if days[2] < 100 else f"{days[2]:.0f}"
        says(f"| {row['model']} | {d / 1e9:,.0f} B | {mantissa} x 10^{int(exponent)} | {days[0]:,.0f} | "
             f"{days[1]:,.0f} | {on_512} |")
    says(f"2 T tokens for a 7B model are {widgets.training_days(7e9, 2e12, gpus=1024):.1f} days on 1,024 A100s")
    ratio = metrics.peak_flops("H100", "bf16") / metrics.peak_flops("A100", "bf16")
    says(f"An H100 ({metrics.peak_flops('H100', 'bf16') / 1e12:.0f} TFLOP/s bf16) is {ratio:.1f} times an A100")
    says(f"a compute-optimal 7B model takes {widgets.training_days(7e9, 140e9):.0f} A100-days")


def test_the_exercise_answer_and_the_explorer_start():
    ddp = widgets.largest_model_that_fits(4, A100, 0, activation_bytes=10 * GIB)
    fsdp = widgets.largest_model_that_fits(4, A100, 3, activation_bytes=10 * GIB)
    # the answers stay here, not on the page that sets the exercise
    assert f"{ddp / 1e9:.2f} B" not in TEXT and f"{fsdp / 1e9:.2f} B" not in TEXT, "the page gives the answer away"
    assert (round(ddp / 1e9, 2), round(fsdp / 1e9, 2)) == (2.01, 8.05)
    says(f"a 7B model needs {widgets.state_bytes_per_gpu(7e9) / GIB:.1f} GiB")
    box = widgets.does_it_fit_explorer()
    assert box.controls["params"].value * 1e9 == 7e9 and box.controls["gpus"].value == 4
    says("The explorer starts at the 7B model on 4 A100-40GB of the tables above")


def test_attention_is_a_few_percent_only_at_short_sequences():
    # LLaMA-2-7B's shape (distlab.sizing.LLAMA_SHAPES["7B"]; written out here: importing sizing imports torch)
    vocab, d, layers, ffn = 32000, 4096, 32, 11008
    weights_that_multiply = vocab * d + layers * (4 * d * d + 3 * d * ffn + 2 * d) + d   # all but the embedding
    shares = [12 * layers * d * tokens / (6 * weights_that_multiply) for tokens in (512, 4096)]  # 12 L d T over 6 N
    says(f"it adds {shares[0]:.1%} at 512 tokens and {shares[1]:.1%} at 4,096")


def test_the_flop_counter_ignores_causal_masking():
    """The line chapter 02 cites, read from torch's source (found without importing torch): the sdpa FLOP count
    takes the three shapes only, never is_causal."""
    import importlib.util

    source = (Path(importlib.util.find_spec("torch").origin).parent / "utils" / "flop_counter.py").read_text()
    lines = source.splitlines()
    assert lines[284] == "def sdpa_flop_count(query_shape, key_shape, value_shape):"
    body = source[source.index(lines[284]):source.index("\ndef ", source.index(lines[284]) + 1)]
    assert "is_causal" not in body and "causal" not in body
    assert lines[317].strip() == "# NB: We aren't accounting for causal attention here"
    says("(\"NB: We aren't accounting for causal attention here\", line 318)")
    says("`torch/utils/flop_counter.py:285`, `sdpa_flop_count(query_shape, key_shape, value_shape)`")
    assert lines[504] == "def sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape):"
    backward = source[source.index(lines[504]):source.index("\ndef ", source.index(lines[504]) + 1)]
    assert "causal" not in backward
    says("about half of the attention FLOPs that the counter and 12 L d T record (the backward's\n   count, "
         "`sdpa_backward_flop_count` at line 505, takes only the shapes too)")


def test_training_carries_eight_times_the_weights():
    mixed = memory.training_state_bytes(7e9, "mixed")
    assert mixed.total / mixed.params == 8
    says("training\ncarries eight times the bytes of the weights")


def test_the_two_ways_picture_is_the_zero_table():
    """02_two_ways.png draws each GPU's state from the same functions as the ZeRO table: replicated when the batch is
    cut, a quarter of every part when the model is; its alt text says the two numbers."""
    from coursetools.drawings import ch02

    ways = ch02.two_ways_per_gpu(7e9, 4)
    assert ways["data parallel"]["state_gib"] * GIB == widgets.state_bytes_per_gpu(7e9, 4, 0)
    assert ways["model parallel"]["state_gib"] * GIB == widgets.state_bytes_per_gpu(7e9, 4, 3)
    says(f"the\ntraining state of a 7B model is {ways['data parallel']['state_gib']:.1f} GiB on each")
    says(f"passes its activations on; {ways['model parallel']['state_gib']:.1f} GiB each")


def test_the_measured_sentence_states_the_scripts_tolerance():
    """The 4-rank run's loss check: 1e-5 on a CPU, ten times wider on a GPU, as the script asks."""
    script = (Path(__file__).resolve().parents[2] / "scripts" / "02_why_distributed"
              / "compute_and_memory_per_rank.py").read_text()
    assert "tolerance=metrics.fp32_tolerance(1e-5, rt.device)" in script
    assert metrics.fp32_tolerance(1e-5, "cpu") == 1e-5 and metrics.fp32_tolerance(1e-5, "cuda") == 1e-4
    says("the mean of the ranks' losses equals the single-device loss to 1e-5")
    says("within 1e-5 in fp32 (ten\n   times wider on a GPU")


def test_autocast_and_bf16_weights_both_come_to_16_bytes():
    fp32, mixed = memory.training_state_bytes(7e9, "fp32"), memory.training_state_bytes(7e9, "mixed")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4 * 7e9, 4 * 7e9, 8 * 7e9)
    assert fp32.total == mixed.total == 16 * 7e9
    says("keeps fp32 weights and gradients and casts to bf16 on the fly: 4 + 4 + 8 bytes")
    says("exactly as in chapter 01's fp32 training and under autocast")


def test_terms_are_defined_before_the_tables_use_them():
    flat = " ".join(TEXT.split())
    for term, definition in (("| on 4 (one node) |", "one **node** (one machine"),
                             ("| replicated (DDP) |", "**Sharded** means each of n GPUs keeps 1/n")):
        assert definition in flat and flat.index(definition) < flat.index(term), term
    says("each then divides by the\nnumber of GPUs")
    says("runs one data-parallel step on 4 ranks. A **rank** is one process of the job")


def test_the_lab_expands_ddp_where_it_first_uses_it():
    import json

    lab = json.loads((Path(__file__).resolve().parents[2] / "notebooks/02_why_distributed.ipynb").read_text())
    text = " ".join(" ".join("".join(c["source"]) for c in lab["cells"] if c["cell_type"] == "markdown").split())
    first, expansion = text.index("DDP"), "`DistributedDataParallel`, "
    assert text[first - len(expansion):first] == expansion, "lab 02 uses DDP before it says what it is"
