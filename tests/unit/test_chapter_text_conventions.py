"""chapters/00_conventions.md: every number on it recomputed, every chapter linking it, the presets it describes."""

import re
from pathlib import Path

from coursetools import chapters as course_chapters
from distlab import metrics, models
from labkit import widgets
from distlab import tensor_parallel as tp

REPO = Path(__file__).resolve().parents[2]
CHAPTERS = REPO / "chapters"
TEXT = (CHAPTERS / "00_conventions.md").read_text()


def says(phrase: str) -> None:
    assert phrase in TEXT, f"the conventions page no longer says {phrase!r}: the code computes it; update it"


def test_every_chapter_links_the_conventions_page():
    numbers = [n for n in course_chapters.numbers() if n < "10"]
    assert len(numbers) >= 8
    for number in numbers:   # on any of the chapter's pages
        assert "(00_conventions.md)" in course_chapters.text(number), f"chapter {number} does not link the conventions page"


def test_gb_and_gib():
    a100 = widgets.GPUS["A100-40GB"]
    says(f"**40 GiB** = {a100:,} bytes of HBM")
    assert a100 == 40 * widgets.GIB and widgets.GIB == 2**30 and widgets.GB == 10**9
    says(f"is 112 GB = {16 * 7e9 / widgets.GIB:.1f} GiB")
    says(f"chapter 02's 13 B model needs {widgets.min_gpus_to_fit(13e9, a100, 3)} A100-40GB fully sharded, "
         f"not {widgets.min_gpus_to_fit(13e9, 40e9, 3)}")


def test_the_peak_table_is_the_library_table():
    def tflops(gpu, dtype):
        return f"{metrics.peak_flops(gpu, dtype) / 1e12:g} TFLOP/s"

    says(f"| A100 | {tflops('A100', 'bf16')} | {tflops('A100', 'tf32')} | {tflops('A100', 'fp32')} |")
    says(f"| H100 SXM | {tflops('H100 SXM', 'bf16')} | {tflops('H100 SXM', 'tf32')} | {tflops('H100 SXM', 'fp32')} |")


def test_unidirectional_bandwidths_are_the_librarys():
    says(f"NVLink 3 on an A100 is sold as {tp.NVLINK3_A100_TOTAL_BYTES_PER_S / 1e9:.0f} GB/s")
    says(f"**{tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S / 1e9:.0f} GB/s** each way")
    says(f"A Slingshot-11 NIC is 200 Gb/s = **{tp.SLINGSHOT11_NIC_BYTES_PER_S / 1e9:.0f} GB/s** each way")


def test_the_presets_described_are_the_code_presets():
    named = set(re.findall(r"`(tiny|small|a100|a100_large|llama3_8b_slice)`", TEXT.split("## Presets")[1]))
    assert named == set(models.PRESETS), "the presets page must name exactly distlab.models.PRESETS"
    a100, large = models.preset("a100"), models.preset("a100_large")
    says(f"(L = {a100.n_layers}, h = {a100.dim}, a = {a100.n_heads}, S = {a100.seq_len}, "
         f"{a100.num_params() / 1e9:.2f} B parameters)")
    says(f"the `a100_large` transformer ({large.num_params() / 1e9:.2f} B parameters)")
    says(f"under TP 4, B = {tp.DEFAULT_BATCH['a100']}, fp32")
    says(f"the `a100` transformer's {a100.n_layers} layers over the pipeline stages")
    scripts = REPO / "scripts"
    assert "4 for a100" in (scripts / "01_single_device_baseline" / "train_baseline.py").read_text()
    for script in ("04_data_parallel/train_ddp.py", "05_fully_sharded/train_fsdp.py"):
        assert "16 for a100" in (scripts / script).read_text(), script
    presets_02 = (scripts / "02_why_distributed" / "compute_and_memory_per_rank.py").read_text()
    assert 'presets=("tiny", "small")' in presets_02  # "02: no a100 preset"
