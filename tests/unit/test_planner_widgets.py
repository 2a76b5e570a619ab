"""The planner's widgets, headless: what the explorer shows, the bars, the exercises' verdicts."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

from distlab import planner  # noqa: E402
from labkit import planner_widgets


def test_explorer_shows_the_best_fitting_layouts_and_their_table():
    plans, text = planner_widgets.explorer_view("70b", "h100-80gb", 64)
    best = planner.search(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], 64)
    assert [p.layout for p in plans] == [p.layout for p in best[:6]] and all(p.fits for p in plans)
    assert f"| 1 | {best[0].layout.label()} |" in text


def test_explorer_at_long_sequences_keeps_the_tokens_and_reaches_for_cp():
    spec = planner_widgets.with_sequence_length(planner.MODELS["70b"], 131072)
    preset = planner.MODELS["70b"]
    assert spec.seq_len * spec.global_batch == preset.seq_len * preset.global_batch
    assert planner_widgets.with_sequence_length(preset, "preset") is preset
    plans, text = planner_widgets.explorer_view("70b", "h100-80gb", 64, seq_len=131072)
    assert plans and all(p.fits and p.layout.cp > 1 for p in plans) and ",cp=" in text
    short, _ = planner_widgets.explorer_view("70b", "h100-80gb", 64)
    assert all(p.layout.cp == 1 for p in short)


def test_explorer_says_why_nothing_fits():
    plans, text = planner_widgets.explorer_view("405b", "a100-40gb", 8)
    assert plans and not any(p.fits for p in plans) and "nothing fits on 8 x a100-40gb; the closest: needs" in text
    assert planner_widgets.explorer_view("7b", "a100-40gb", 0)[1] == "**GPUs must be at least 1, not 0**"


def test_memory_bars_stack_the_parts_against_the_gpu_line():
    plans, _ = planner_widgets.explorer_view("13b", "a100-40gb", 16, top=3)
    ax = planner_widgets.draw_memory_bars(plans)
    widths = [patch.get_width() for patch in ax.patches]
    assert len(widths) == 3 * len(planner_widgets.PARTS)
    assert sum(widths[: len(planner_widgets.PARTS)]) == sum(planner_widgets.memory_parts_gib(plans[0]).values())
    assert ax.lines[0].get_xdata()[0] == 40


def test_layout_verdicts():
    assert planner_widgets.layout_verdict(None).ok is None
    assert planner_widgets.layout_verdict((8, 8, 1)).ok is False
    best = planner.search(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], 64)[0].layout
    assert planner_widgets.layout_verdict(best).ok is True
    ddp = planner_widgets.layout_verdict(planner.Layout(dp=64, zero_stage=0))
    assert ddp.ok is False and "does not fit" in ddp.message
    wrong_size = planner_widgets.layout_verdict(planner.Layout(tp=8, pp=8, dp=8, zero_stage=1), gpus=64)
    assert wrong_size.ok is False and "is not the 64 GPUs" in wrong_size.message


def test_the_notebooks_exercise_checks_reject_plausible_wrong_answers():
    import pytest

    from labkit.exercises import _ch11_reference as reference
    from labkit.exercises import ch11 as exercises

    spec, a100 = exercises.nodes_case("13b", 16384), planner.CLUSTERS["a100-40gb"]
    right = reference._fewest_fsdp_nodes(spec, a100)
    exercises.check_fewest_nodes(right, reference._held_gib(spec, a100, right), "13b", "a100-40gb", 16384)
    for slip in (right - 1, right + 1):  # the state alone, rounded up, and a node more "to be safe"
        with pytest.raises(exercises.ExerciseWrong):
            exercises.check_fewest_nodes(slip, reference._held_gib(spec, a100, slip), "13b", "a100-40gb", 16384)
    with pytest.raises(exercises.ExerciseIncomplete):
        exercises.check_true("layout_70b", planner_widgets.layout_verdict(None).ok, "")
    for slip in (planner.Layout(tp=8, pp=1, dp=8, zero_stage=3),  # FSDP re-gathers for every microbatch
                 planner.Layout(dp=64, zero_stage=1)):            # ZeRO-1 keeps a whole replica of the weights
        verdict = planner_widgets.layout_verdict(slip)
        with pytest.raises(exercises.ExerciseWrong):
            exercises.check_true("layout_70b", verdict.ok, verdict.message)


def test_the_memory_legend_covers_no_bar():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from distlab import planner
    from labkit import planner_widgets

    plans = planner.search(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], 64)[:8]
    ax = planner_widgets.draw_memory_bars(plans)
    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for patch in ax.patches]
    assert bars and not any(legend.overlaps(bar) for bar in bars)
    plt.close(fig)
