"""Gantt charts: the ASCII chart reads exactly for small schedules, fits 100 columns for big ones, and the
matplotlib chart has one row of bars per rank."""

import random
import re

import pytest

from distlab import gantt, schedules


def simulated(name, ranks, microbatches, chunks=1):
    return schedules.simulate(schedules.build(name, ranks, microbatches, chunks))


def rows(chart):
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^rank +(\d+) \|(.*)\|$", chart, re.MULTILINE)}


def bubble_percent(chart):
    return float(re.search(r"^bubble: ([0-9.]+)%", chart, re.MULTILINE).group(1))


def measured_timeline(ranks=4, microbatches=8, seed=0):
    """A 1F1B run as a real one would report it: seconds since the epoch, jittered, uneven durations."""
    rng = random.Random(seed)
    epoch = 1.7e9
    out = []
    for event in simulated("1f1b", ranks, microbatches):
        start = epoch + event.start * 0.013 + rng.uniform(0, 0.002)
        duration = (event.end - event.start) * rng.uniform(0.008, 0.015)
        out.append(dict(event.to_dict(), start=start, end=start + duration))
    return out


def test_small_1f1b_chart_reads_exactly_two_columns_per_time_unit():
    chart = gantt.ascii_gantt(simulated("1f1b", 4, 8), title="1F1B, 4 ranks, 8 microbatches")
    assert chart.splitlines()[0] == "1F1B, 4 ranks, 8 microbatches"
    row = rows(chart)
    # F = 1 unit = 2 columns, B = 2 units = 4 columns, makespan 3 (M + P - 1) = 33 units = 66 columns.
    assert row[0] == "F0F1F2F3............B0<<F4B1<<F5B2<<F6B3<<F7B4<<..B5<<..B6<<..B7<<"
    assert row[3] == "......F0B0<<F1B1<<F2B2<<F3B3<<F4B4<<F5B5<<F6B6<<F7B7<<............"
    assert all(len(r) == 66 for r in row.values())
    assert "1 column = 0.5 time units" in chart
    assert bubble_percent(chart) == 27.27                          # 3 / 11


def test_gpipe_chart_shows_every_forward_before_any_backward():
    row = rows(gantt.ascii_gantt(simulated("gpipe", 4, 8)))
    for rank, cells in row.items():
        labels = re.findall(r"[FBW]\d+", cells)
        assert labels == [f"F{m}" for m in range(8)] + [f"B{m}" for m in range(8)]
        assert cells.startswith("." * 2 * rank)                      # the fill of the pipeline


def test_zero_bubble_chart_shows_weight_gradients():
    chart = gantt.ascii_gantt(simulated("zero_bubble", 4, 8))
    assert rows(chart)[0].startswith("F0F1F2F3......I0W0F4I1W1")           # torch's letters: I, then W
    assert "Wn weight gradient" in chart and "In input gradient" in chart
    assert bubble_percent(chart) == pytest.approx(100 * 3 / 27, abs=0.005)


@pytest.mark.parametrize("name, chunks", [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved_1f1b", 2)])
def test_big_chart_fits_100_columns_with_every_rank_legend_and_bubble(name, chunks):
    events = simulated(name, 8, 64, chunks)
    chart = gantt.ascii_gantt(events)
    assert max(len(line) for line in chart.splitlines()) <= 100
    assert sorted(rows(chart)) == list(range(8))
    assert all(len(r) >= 70 for r in rows(chart).values())           # stretched to use the width
    assert "legend:" in chart and "'.' idle" in chart
    assert bubble_percent(chart) == round(100 * schedules.bubble_fraction_from_timeline(events), 2)


def test_width_option_caps_every_line():
    chart = gantt.ascii_gantt(simulated("1f1b", 8, 64), width=80)
    assert max(len(line) for line in chart.splitlines()) <= 80
    with pytest.raises(ValueError, match="width"):
        gantt.ascii_gantt(simulated("1f1b", 2, 2), width=12)


def test_measured_timeline_in_seconds_with_uneven_durations():
    events = measured_timeline()
    chart = gantt.ascii_gantt(events, time_unit="s")
    assert max(len(line) for line in chart.splitlines()) <= 100
    row = rows(chart)
    assert sorted(row) == [0, 1, 2, 3]
    for rank, cells in row.items():
        busy = sum(c != "." for c in cells)
        assert 0.5 * len(cells) < busy < len(cells)                   # mostly busy, some idle, nothing lost
        assert "F0" in cells and "B7" in cells
    assert re.search(r"1 column = [0-9.e-]+ s", chart)
    assert bubble_percent(chart) == round(100 * schedules.bubble_fraction_from_timeline(events), 2)


def test_a_pass_shorter_than_a_column_still_shows():
    events = [{"rank": 0, "stage": 0, "microbatch": 0, "kind": "F", "start": 0.0, "end": 100.0},
              {"rank": 1, "stage": 1, "microbatch": 0, "kind": "B", "start": 50.0, "end": 50.01}]
    row = rows(gantt.ascii_gantt(events))
    assert row[1].count("<") == 1 and set(row[1]) == {".", "<"}


def test_empty_timeline_is_refused():
    with pytest.raises(ValueError, match="empty"):
        gantt.ascii_gantt([])


def bar_rows(ax):
    """Row centres of the pass bars (not the idle background), per kind label."""
    by_label = {}
    for container in ax.containers:
        if container.get_label() == "idle":
            continue
        centres = {round(bar.get_y() + bar.get_height() / 2, 6) for bar in container}
        by_label.setdefault(container.get_label(), set()).update(centres)
    return by_label


def test_plot_gantt_draws_one_row_per_rank_under_agg(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = simulated("zero_bubble", 4, 8)
    ax = gantt.plot_gantt(events, title="ZB-H1")
    try:
        by_label = bar_rows(ax)
        assert set(by_label) == {"forward (F)", "input gradient (I)", "weight gradient (W)"}
        assert set().union(*by_label.values()) == {0, 1, 2, 3}
        bars = sum(len(c) for c in ax.containers if c.get_label() != "idle")
        assert bars == len(events)
        bottom, top = ax.get_ylim()
        assert top < bottom                                           # rank 0 on top
        assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
        assert "11.1%" in ax.get_title() and "ZB-H1" in ax.get_title()
        legend = {t.get_text() for t in ax.get_legend().get_texts()}
        assert {"idle", "forward (F)", "input gradient (I)", "weight gradient (W)"} <= legend
        assert any(t.get_text() == "7" for t in ax.texts)             # microbatch labels in the bars
    finally:
        plt.close(ax.figure)


def test_plot_gantt_on_given_axes_with_measured_dicts_and_interleaved_chunks():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure()
    ax = figure.add_subplot()
    assert gantt.plot_gantt(measured_timeline(8, 16), ax=ax, time_unit="s") is ax
    assert set().union(*bar_rows(ax).values()) == set(range(8))
    assert ax.get_xlabel() == "time (s)"

    ax = Figure().add_subplot()
    gantt.plot_gantt(simulated("interleaved_1f1b", 4, 8, 2), ax=ax)
    assert any("later chunk" in t.get_text() for t in ax.get_legend().get_texts())


def test_save_gantt_png_writes_a_png(tmp_path):
    path = gantt.save_gantt_png(simulated("1f1b", 4, 8), tmp_path / "gantt.png", title="1F1B")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
