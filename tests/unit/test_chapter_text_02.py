"""Chapter 02's tables, recomputed from labkit.widgets: the test fails when chapters/02_why_distributed.md drifts.

Memory is in GiB (an A100 "40GB" has 40 GiB), as chapters/00_conventions.md says."""

from pathlib import Path

from distlab import memory, metrics
from labkit import widgets

TEXT = (Path(__file__).resolve().parents[2] / "chapters" / "02_why_distributed.md").read_text()
GIB, A100 = widgets.GIB, widgets.GPUS["A100-40GB"]


def says(phrase: str) -> None:
    assert phrase in TEXT, f"chapter 02 no longer says {phrase!r}: the code computes it; update the text"


def test_the_memory_wall_table():
    for row in widgets.fit_table("A100-40GB", gpus=1, zero_stage=0):
        says(f"| {row['model']} | {row['state_gib_per_gpu']:,.1f} GiB | {'yes' if row['fits'] else 'no'} | "
             f"{row['min_gpus_fully_sharded']} |")
    # the sentence on units: counting 40 x 10^9 bytes per GPU gives other GPU counts
    wrong = [widgets.min_gpus_to_fit(n, 40e9, 3) for n in widgets.MODEL_SIZES.values()]
    says(f"the last column reads {', '.join(map(str, wrong))}")
    says(f"The weights alone, {memory.training_state_bytes(7e9, 'mixed').params / GIB:.1f} GiB in bf16")


def test_the_zero_table_for_a_7b_model_on_four_gpus():
    labels = {0: "replicated (DDP)", 1: "ZeRO-1: optimizer state sharded", 2: "ZeRO-2: and gradients",
              3: "ZeRO-3 / FSDP: and weights"}
    fits = []
    for stage, label in labels.items():
        per_gpu = widgets.state_bytes_per_gpu(7e9, 4, stage)
        replicated, sharded = widgets.bytes_per_param(stage)
        formula = "16" if stage == 0 else "16/4" if stage == 3 else f"{replicated:g} + {sharded:g}/4"
        says(f"| {label} | {formula} | {per_gpu / GIB:.1f} GiB |")
        fits.append(widgets.fit(7e9, 4, A100, stage).fits)
    assert fits == [False, False, True, True]  # "Only the last two fit in 40 GiB"
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
    says(f"({ddp / 1e9:.2f} B and {fsdp / 1e9:.2f} B parameters.)")
    says(f"a 7B model needs {widgets.state_bytes_per_gpu(7e9) / GIB:.1f} GiB")
    box = widgets.does_it_fit_explorer()
    assert box.controls["params"].value * 1e9 == 7e9 and box.controls["gpus"].value == 4
    says("The explorer starts at the 7B model on 4 A100-40GB of the tables above")
