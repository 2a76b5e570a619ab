"""Lab 02's exercise checks (why distributed).

* Exercise 1: the largest model that fits under DDP and under FSDP, numbers compared by :func:`check_value`.
* Exercise 2, :func:`check_month_of_a100s`: the A100-days of a compute-optimal run (6 N D FLOPs, D = 20 N, 40% of
  the bf16 peak) and the fewest A100s that finish it within 30 days, against ``labkit.widgets.training_days``;
  each usual slip (2 N D, the MFU forgotten, the fp32 peak, days rounded, GPUs rounded to the nearest) is named;
  an answer that is no number is refused as such.
"""

from __future__ import annotations

import math

from labkit.exercises.checks import (ExerciseIncomplete, ExerciseWrong, check_value, learner_check, sentence,
                                     wrong_number)

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_value", "check_month_of_a100s", "expected_month_of_a100s"]

MONTH_DAYS = 30
MFU = 0.4
TOKENS_PER_PARAM = 20
# an answer this close that is not within 0.1% was rounded on the way: the check says not to round
ROUNDED_REL_TOL = 0.01


def expected_month_of_a100s(num_params: float) -> tuple[float, int]:
    """(A100-days, the fewest A100s that finish within a month) of a compute-optimal run of ``num_params``."""
    from labkit import widgets

    days = widgets.training_days(num_params, TOKENS_PER_PARAM * num_params, gpus=1, gpu="A100-40GB", mfu=MFU)
    return days, math.ceil(days / MONTH_DAYS)


def _day_slips(num_params: float) -> dict[str, float]:
    from distlab import metrics

    tokens, peak = TOKENS_PER_PARAM * num_params, metrics.peak_flops("A100", "bf16")
    seconds = 86400
    return {
        "That is 2 N D FLOPs, the forward pass alone. Training is 6 N D: forward, and two products in backward.":
            2 * num_params * tokens / (peak * MFU) / seconds,
        "The GPU does not run at its peak: divide by 40% of 312 TFLOP/s, not by all of it.":
            6 * num_params * tokens / peak / seconds,
        "312 TFLOP/s is the bf16 peak; that looks like the fp32 one (19.5 TFLOP/s).":
            6 * num_params * tokens / (metrics.peak_flops("A100", "fp32") * MFU) / seconds,
        "D is 20 tokens a parameter: 20 N tokens in all, not 20 N x 10^9.":
            6 * num_params * tokens * 1e9 / (peak * MFU) / seconds,
        "Those are hours? A day is 86,400 seconds.": 6 * num_params * tokens / (peak * MFU) / 3600,
    }


@learner_check
def check_month_of_a100s(a100_days, a100s_for_a_month, num_params: float = 3e9) -> None:
    """``a100_days``: days of one A100 for a compute-optimal run of ``num_params`` (D = 20 N tokens, 6 N D FLOPs,
    40% MFU, bf16); ``a100s_for_a_month``: the fewest A100s that finish it within 30 days (an integer)."""
    days, gpus = expected_month_of_a100s(num_params)
    if a100_days is None or a100_days is Ellipsis:
        raise ExerciseIncomplete("`a100_days` is not written yet.")
    try:
        got_days = float(a100_days)
    except (TypeError, ValueError):
        raise ExerciseWrong(f"`a100_days` should be a number, got {type(a100_days).__name__}.") from None
    if not math.isclose(got_days, days, rel_tol=1e-3):
        slip = next((why for why, wrong in _day_slips(num_params).items()
                     if math.isclose(got_days, wrong, rel_tol=1e-3)), "")
        if not slip and math.isclose(got_days, days, rel_tol=ROUNDED_REL_TOL):
            # how far off is not said: with the learner's own number it would give the answer away
            slip = ("That is within 1% but not within the 0.1% the check asks: close. Keep every digit to the end, "
                    "and don't round.")
        rule = "6 N D FLOPs over 40% of 312 TFLOP/s, in days."
        raise ExerciseWrong(f"`a100_days` = {got_days:,.4g}: "
                            + (slip or f"{sentence(wrong_number(got_days, days))} {rule}"))
    if a100s_for_a_month is None or a100s_for_a_month is Ellipsis:
        raise ExerciseIncomplete("`a100s_for_a_month` is not written yet.")
    try:
        got_gpus = float(a100s_for_a_month)
    except (TypeError, ValueError):
        got_gpus = math.nan
    if isinstance(a100s_for_a_month, bool) or not got_gpus.is_integer():
        raise ExerciseWrong(f"`a100s_for_a_month` = {a100s_for_a_month!r}: a number of GPUs is a whole number. Round "
                            f"the GPUs a month needs up.")
    if int(got_gpus) != gpus:
        # rounded to the nearest (or down): that many GPUs take more than a month, which the learner can check
        short = int(got_gpus) in (round(days / MONTH_DAYS), math.floor(days / MONTH_DAYS)) and got_gpus >= 1
        hint = (f"{int(got_gpus)} A100s take {days / got_gpus:.1f} days, over a month: round up, not to the nearest."
                if short else f"That is not the fewest A100s that finish within {MONTH_DAYS} days: the days on one "
                              f"A100 over the {MONTH_DAYS} days of a month, rounded up.")
        raise ExerciseWrong(f"`a100s_for_a_month` = {a100s_for_a_month}: {hint}")
    fewer = f", {gpus - 1} would take {days / (gpus - 1):.1f}" if gpus > 1 else ""
    print(f"Correct: {days:,.1f} A100-days; {gpus} A100{'s finish' if gpus > 1 else ' finishes'} in "
          f"{days / gpus:.1f} days{fewer}.")
