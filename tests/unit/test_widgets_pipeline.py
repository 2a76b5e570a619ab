"""Chapter 07's schedule explorer: its logic, without a browser."""

import pytest

from distlab import schedules
from labkit import widgets


@pytest.mark.parametrize("name, chunks, expected", [
    ("naive", 1, 3 / 4),
    ("gpipe", 1, 3 / 11),
    ("1f1b", 1, 3 / 11),                         # the same bubble as GPipe
    ("interleaved_1f1b", 2, 3 / 19),             # (P-1)/(V*M+P-1)
    ("zero_bubble", 1, 3 / 27),                  # (P-1)/(3M+P-1) with F = B = W
])
def test_summary_bubble_for_4_ranks_8_microbatches(name, chunks, expected):
    summary = widgets.pipeline_summary(name, 4, 8, chunks)
    assert summary["error"] is None
    assert summary["bubble"] == pytest.approx(expected)
    if summary["formula"] is not None:
        assert summary["formula"] == pytest.approx(summary["bubble"])
    # Every schedule does the same work: M x (F + B) = 24 units per rank; the bubble is the rest.
    assert summary["makespan"] * (1 - summary["bubble"]) == pytest.approx(summary["ideal_makespan"])


def test_v_applies_to_interleaved_only():
    assert widgets.pipeline_summary("1f1b", 4, 8, chunks=3)["chunks"] == 1
    assert widgets.pipeline_summary("interleaved_1f1b", 4, 8, chunks=3)["chunks"] == 3


def test_peak_activations_show_why_1f1b_exists():
    gpipe = widgets.pipeline_summary("gpipe", 4, 8)["peak_activations"]
    one_f_one_b = widgets.pipeline_summary("1f1b", 4, 8)["peak_activations"]
    assert gpipe == {0: 8, 1: 8, 2: 8, 3: 8}
    assert one_f_one_b == {0: 4, 1: 3, 2: 2, 3: 1}
    interleaved = widgets.pipeline_summary("interleaved_1f1b", 4, 8, 2)["peak_activation_layers"]
    assert interleaved[0] == pytest.approx(4 + 3 / 2)          # P + (P-1)/V rank-layers' worth


def test_a_setting_the_schedule_cannot_run_is_explained_not_raised():
    summary = widgets.pipeline_summary("interleaved_1f1b", 4, 6, 2)
    assert "multiple" in summary["error"]
    html = widgets.pipeline_explorer_html("interleaved_1f1b", 4, 6, 2)
    assert "cannot run" in html and "<pre" not in html


def test_html_has_the_chart_the_bubble_and_the_formula():
    html = widgets.pipeline_explorer_html("1f1b", 4, 8)
    assert "<pre" in html and "rank 3 |" in html
    assert "27.3%" in html and "(P-1)/(M+P-1)" in html
    zero = widgets.pipeline_explorer_html("zero_bubble", 4, 8)
    assert "11.1%" in zero and "GPipe and 1F1B: 27.3%" in zero


def test_the_widget_updates_when_a_slider_moves():
    pytest.importorskip("ipywidgets")
    box = widgets.pipeline_explorer("gpipe", 4, 8, 2)
    assert box.controls["chunks"].disabled                     # V means nothing to GPipe
    box.controls["schedule"].value = "interleaved_1f1b"
    assert not box.controls["chunks"].disabled
    assert f"{100 * schedules.bubble_fraction(4, 8, 2):.1f}%" in box.output.value
    box.controls["microbatches"].value = 16
    assert f"{100 * schedules.bubble_fraction(4, 16, 2):.1f}%" in box.output.value


def test_the_largest_setting_draws_quickly():
    """0.06 s of CPU on a laptop core. Timed in CPU seconds: on make test's loaded cores the wall clock of the same
    call reached 2.2 s (s16a), time spent waiting for a core, not drawing."""
    import time

    started = time.process_time()
    widgets.pipeline_explorer_html("interleaved_1f1b", 16, 64, 4)
    assert time.process_time() - started < 2.0
