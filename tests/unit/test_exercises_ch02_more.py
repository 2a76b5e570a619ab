"""Lab 02's second exercise (labkit.exercises.ch02.check_month_of_a100s): the right numbers pass, a stub is "not
written yet", and each plausible slip is rejected with the hint that names it."""

from __future__ import annotations

import math

import pytest

from labkit.exercises import ch02 as ex
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong

N = 3e9
DAYS = 6 * N * 20 * N / (0.4 * 312e12) / 86400     # written out: the widgets' function is what the check uses


def test_the_right_answer_passes(capsys):
    ex.check_month_of_a100s(DAYS, math.ceil(DAYS / 30))
    assert "Correct" in capsys.readouterr().out
    assert math.ceil(DAYS / 30) == 4 and round(DAYS / 30) == 3   # the case tells rounding up from rounding


def test_the_expected_answer_is_the_widgets_days():
    from labkit import widgets

    days, gpus = ex.expected_month_of_a100s(N)
    assert days == widgets.training_days(N, 20 * N) and math.isclose(days, DAYS, rel_tol=1e-12) and gpus == 4


@pytest.mark.parametrize("days, named", [
    (2 * N * 20 * N / (0.4 * 312e12) / 86400, "forward pass alone"),
    (6 * N * 20 * N / 312e12 / 86400, "40% of 312 TFLOP/s"),
    (6 * N * 20 * N / (0.4 * 19.5e12) / 86400, "fp32 one"),
    (6 * N * 20 * N / (0.4 * 312e12) / 3600, "86,400 seconds"),
    (DAYS * 1.1, "too large for rounding"),
])
def test_a_wrong_day_count_is_rejected_and_named(days, named):
    with pytest.raises(ExerciseWrong, match=named):
        ex.check_month_of_a100s(days, math.ceil(days / 30))


@pytest.mark.parametrize("gpus, named", [(3, "round up"), (3.34, "whole number"), (5, "not the fewest"),
                                         (True, "whole number")])
def test_a_wrong_gpu_count_is_rejected(gpus, named):
    with pytest.raises(ExerciseWrong, match=named):
        ex.check_month_of_a100s(DAYS, gpus)


def test_a_stub_is_not_written_yet():
    with pytest.raises(ExerciseIncomplete, match="a100_days"):
        ex.check_month_of_a100s(None, None)
    with pytest.raises(ExerciseIncomplete, match="a100s_for_a_month"):
        ex.check_month_of_a100s(DAYS, None)


@pytest.mark.parametrize("gpus", ["four", [4], object()])
def test_a_gpu_count_that_is_no_number_is_named_not_crashed(gpus):
    with pytest.raises(ExerciseWrong, match="whole number"):
        ex.check_month_of_a100s(DAYS, gpus)


def test_a_whole_number_written_as_text_or_a_float_passes(capsys):
    ex.check_month_of_a100s(DAYS, 4.0)
    ex.check_month_of_a100s(str(DAYS), "4.0")
    assert capsys.readouterr().out.count("Correct") == 2


def test_a_model_that_needs_one_a100_passes(capsys):
    days, gpus = ex.expected_month_of_a100s(1e9)
    assert gpus == 1 and math.isclose(days, 6 * 1e9 * 20e9 / (0.4 * 312e12) / 86400, rel_tol=1e-12)
    ex.check_month_of_a100s(days, gpus, 1e9)
    out = capsys.readouterr().out
    assert "Correct" in out and "1 A100 finishes" in out and "would take" not in out


@pytest.mark.parametrize("days", [100, 100.0, round(DAYS, -1), DAYS * 0.995])
def test_a_rounded_day_count_is_told_not_to_round(days):
    assert not math.isclose(days, DAYS, rel_tol=1e-3)   # 100 is 0.16% off the 100.16 days
    with pytest.raises(ExerciseWrong, match="don't round"):
        ex.check_month_of_a100s(days, 4)
