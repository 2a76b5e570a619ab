"""The "does it fit?" explorer: its answers come from pure functions, checked here without a browser.

The tables of chapter 02 quote these numbers; the tests pin them.
"""

import math

import pytest

from distlab import memory, metrics
from labkit import widgets

GB = widgets.GB
GIB = widgets.GIB
A100 = widgets.GPUS["A100-40GB"]


def test_an_a100_40gb_has_40_gib():
    """chapters/00_conventions.md: memory in GiB; the A100 "40GB" reports 40,960 MiB."""
    assert A100 == 40 * 2**30 == 40_960 * 2**20 and GIB == 2**30 and GB == 10**9


@pytest.mark.parametrize("stage, expected", [(0, (16, 0)), (1, (4, 12)), (2, (2, 14)), (3, (0, 16))])
def test_bytes_per_param_split_into_replicated_and_sharded(stage, expected):
    assert widgets.bytes_per_param(stage) == expected
    for gpus in (1, 4, 8):
        replicated, sharded = expected
        assert widgets.state_bytes_per_gpu(1e9, gpus, stage) == pytest.approx((replicated + sharded / gpus) * 1e9)
        assert widgets.state_bytes_per_gpu(1e9, gpus, stage) == memory.zero_state_bytes(1e9, gpus, stage).total


def test_chapter_02_memory_wall_table():
    """16 B/param: 1B needs 14.9 GiB (fits a 40 GiB A100), 7B 104.3 GiB, 13B 193.7, 70B 1,043.1 (none fit)."""
    rows = {r["model"]: r for r in widgets.fit_table("A100-40GB", gpus=1, zero_stage=0)}
    assert {m: round(r["state_gib_per_gpu"], 1) for m, r in rows.items()} == {
        "1B": 14.9, "7B": 104.3, "13B": 193.7, "70B": 1043.1}
    assert {m: r["fits"] for m, r in rows.items()} == {"1B": True, "7B": False, "13B": False, "70B": False}
    # fully sharded over enough A100-40GB: ceil(16 N / 40 GiB); counting 40 GB instead gives 6 and 28
    assert {m: r["min_gpus_fully_sharded"] for m, r in rows.items()} == {"1B": 1, "7B": 3, "13B": 5, "70B": 27}
    assert [math.ceil(16 * n / 40e9) for n in (13e9, 70e9)] == [6, 28]  # the GB mistake is visible


def test_chapter_02_compute_wall_table():
    """6 N D with D = 20 N tokens, one A100 at 312 TFLOP/s bf16 and 40% MFU."""
    rows = {r["model"]: r for r in widgets.fit_table("A100-40GB", gpus=1)}
    days = {m: round(r["days"]) for m, r in rows.items()}
    assert days == {"1B": 11, "7B": 545, "13B": 1881, "70B": 54532}
    assert widgets.training_flops(7e9, 140e9) == pytest.approx(5.88e21)
    # LLaMA-2-7B's 2 T tokens on 1024 A100s at 40% MFU: about a week
    assert widgets.training_days(7e9, 2e12, gpus=1024) == pytest.approx(7.6, abs=0.05)
    # an H100 is 989/312 times faster at the same MFU
    assert widgets.training_days(7e9, 140e9, gpu="H100-80GB") == pytest.approx(545.3 * 312 / 989, rel=1e-3)


def test_fit_and_min_gpus_agree():
    for stage in (0, 1, 2, 3):
        for num_params in (0.5e9, 3e9, 7e9, 20e9, 70e9):
            needed = widgets.min_gpus_to_fit(num_params, A100, stage, activation_bytes=5 * GB)
            if needed is None:
                assert not widgets.fit(num_params, 4096, A100, stage, 5 * GB).fits
                continue
            assert widgets.fit(num_params, needed, A100, stage, 5 * GB).fits
            if needed > 1:
                assert not widgets.fit(num_params, needed - 1, A100, stage, 5 * GB).fits


def test_replicated_state_never_fits_by_adding_gpus():
    assert widgets.min_gpus_to_fit(7e9, A100, zero_stage=0) is None
    assert widgets.min_gpus_to_fit(2e9, A100, zero_stage=0) == 1
    # ZeRO-1 keeps 4 B/param replicated: 70B needs 280 GB on every GPU, so never fits a 40 GiB card
    assert widgets.min_gpus_to_fit(70e9, A100, zero_stage=1) is None


def test_largest_model_that_fits():
    # the chapter's exercise: one node of 4 A100-40GB, 10 GiB of each GPU kept for activations
    assert widgets.largest_model_that_fits(4, A100, 0, activation_bytes=10 * GIB) == pytest.approx(30 * 2**30 / 16)
    assert widgets.largest_model_that_fits(4, A100, 3, activation_bytes=10 * GIB) == pytest.approx(4 * 30 * 2**30 / 16)
    assert round(widgets.largest_model_that_fits(4, A100, 3, activation_bytes=10 * GIB) / 1e9, 2) == 8.05
    for stage in (0, 1, 2, 3):
        largest = widgets.largest_model_that_fits(8, A100, stage, 2 * GB)
        assert widgets.fit(largest * 0.999, 8, A100, stage, 2 * GB).fits
        assert not widgets.fit(largest * 1.001, 8, A100, stage, 2 * GB).fits


def test_explorer_html_states_the_verdict():
    html = widgets.explorer_html(7e9, 4, "A100-40GB", 3, activation_gib=5)
    assert "fits" in html and "NOT" not in html and "26.1 GiB" in html  # 16 x 7e9 / 4 bytes = 26.1 GiB per GPU
    assert "of 40 GiB" in html
    html = widgets.explorer_html(7e9, 4, "A100-40GB", 0)
    assert "does NOT fit" in html and "no number of GPUs" in html
    assert "days" in html


def test_explorer_widget_updates_from_its_controls():
    box = widgets.does_it_fit_explorer(num_params=7e9, gpus=4, zero_stage=0)
    assert "does NOT fit" in box.output.value
    # it starts exactly at the chapter's 7 B model (a log slider showed 7.08e9)
    assert box.controls["params"].value * 1e9 == 7e9 and "<b>7 B parameters on 4 x A100-40GB" in box.output.value
    assert "104.3 GiB" in box.output.value
    box.controls["strategy"].value = 3  # observed: the answer refreshes without a browser
    assert "fits" in box.output.value and "NOT" not in box.output.value
    box.controls["params"].value = 405
    assert "does NOT fit" in box.output.value


def test_gpus_must_be_positive():
    with pytest.raises(ValueError):
        widgets.fit(1e9, 0)
    assert math.isclose(widgets.fit(1e9, 1).fraction_used, 16e9 / (40 * 2**30))


def test_chapter_02_sharding_a_7b_model_over_four_gpus():
    per_gpu = [round(widgets.state_bytes_per_gpu(7e9, 4, stage) / GIB, 1) for stage in (0, 1, 2, 3)]
    assert per_gpu == [104.3, 45.6, 35.9, 26.1]
    assert [widgets.fit(7e9, 4, A100, s).fits for s in (0, 1, 2, 3)] == [False, False, True, True]
    days = {gpus: widgets.training_days(7e9, 140e9, gpus=gpus) for gpus in (1, 4, 512)}
    assert [round(days[1]), round(days[4]), round(days[512], 1)] == [545, 136, 1.1]
    assert round(widgets.training_days(70e9, 1.4e12, gpus=512)) == 107


def test_chapter_02_compute_table_on_a_node_and_on_512_gpus():
    table = {r["model"]: r for r in widgets.fit_table("A100-40GB", gpus=1)}
    on_a_node = {m: round(widgets.training_days(r["params"], r["tokens"], gpus=4)) for m, r in table.items()}
    assert on_a_node == {"1B": 3, "7B": 136, "13B": 470, "70B": 13633}
    on_512 = {m: float(f"{widgets.training_days(r['params'], r['tokens'], gpus=512):.2g}") for m, r in table.items()}
    assert on_512 == {"1B": 0.022, "7B": 1.1, "13B": 3.7, "70B": 110.0}
    flops = [f"{6 * r['params'] * r['tokens']:.1e}" for r in table.values()]
    assert flops == ["1.2e+20", "5.9e+21", "2.0e+22", "5.9e+23"]
    assert memory.training_state_bytes(7e9, "mixed").params == 14e9  # a 7B model's bf16 weights: 14 GB
    assert round(memory.training_state_bytes(7e9, "mixed").params / GIB, 1) == 13.0  # = 13.0 GiB
    assert round(metrics.peak_flops("H100", "bf16") / metrics.peak_flops("A100", "bf16"), 1) == 3.2  # H100 vs A100
