"""Chapter 07's pictures of its mechanisms: the naive relay, then one Gantt chart per schedule (GPipe, 1F1B,
interleaved 1F1B, ZB-H1, ZBV), each the schedule's own order (``distlab.schedules``) run on paper by
``schedules.simulate`` with F = 1, B = 2 (I = W = 1 when the backward is split) and drawn by ``gantt.plot_gantt``.
Every chart is P = 4 ranks and M = 8 microbatches on GPipe's time axis, so a shorter step shows as a shorter row."""

from __future__ import annotations

RANKS, MICROBATCHES = 4, 8


def _longest() -> float:
    """GPipe's step (the longest of the five): every chart shares its time axis."""
    from distlab import schedules

    return max(e.end for e in schedules.simulate(schedules.gpipe(RANKS, MICROBATCHES)))


def draw_naive_relay(fig) -> None:
    """Top: the model cut by depth into 4 stages, one a rank, activations passed right and gradients left. Bottom:
    one batch through that relay (``schedules.naive`` with one microbatch): one rank works at a time."""
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from coursetools.figures import RANK_COLOURS
    from distlab import gantt, schedules

    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [1.0, 1.3]})
    for rank in range(RANKS):
        x = rank * 3.0
        top.add_patch(Rectangle((x, 0), 2.0, 1.2, color=RANK_COLOURS[rank], alpha=0.3))
        top.add_patch(Rectangle((x, 0), 2.0, 1.2, fill=False, lw=1))
        top.text(x + 1.0, 0.6, f"rank {rank}\nstage {rank}: layers {2 * rank}-{2 * rank + 1}", ha="center",
                 va="center", fontsize=8)
        if rank < RANKS - 1:
            top.add_patch(FancyArrowPatch((x + 2.05, 0.9), (x + 2.95, 0.9), arrowstyle="->", mutation_scale=10))
            top.add_patch(FancyArrowPatch((x + 2.95, 0.3), (x + 2.05, 0.3), arrowstyle="->", mutation_scale=10,
                                          color="#DD8452"))
            top.text(x + 2.5, 1.0, "activation", ha="center", va="bottom", fontsize=7)
            top.text(x + 2.5, 0.2, "gradient", ha="center", va="top", fontsize=7, color="#DD8452")
    top.text(11.15, 0.6, "loss", ha="left", va="center", fontsize=8)
    top.set_xlim(-0.2, 11.8)
    top.set_ylim(-0.3, 1.5)
    top.axis("off")
    top.set_title("the model cut by depth: each rank holds 2 of the 8 layers and talks only to its neighbours",
                  fontsize=9)
    timeline = schedules.simulate(schedules.naive(RANKS, 1))
    gantt.plot_gantt(timeline, ax=bottom, title="the whole batch as one unit (P = 4)", time_unit="units of F")
    fig.tight_layout()


def _gantt(fig, schedule, title: str) -> None:
    from distlab import gantt, schedules

    ax = fig.subplots()
    gantt.plot_gantt(schedules.simulate(schedule), ax=ax, title=title, time_unit="units of F")
    legend = ax.get_legend()
    for text in legend.get_texts() if legend else ():     # the pages say "stage"; torch says "chunk"
        if text.get_text() == "paler: a later chunk":
            text.set_text("paler: the rank's second stage")
    ax.set_xlim(0, _longest())
    fig.tight_layout()


def draw_gantt_gpipe(fig) -> None:
    """GPipe: all M forwards, then all M backwards; the fill and the drain marked on the chart."""
    from distlab import schedules

    _gantt(fig, schedules.gpipe(RANKS, MICROBATCHES), "GPipe, P = 4, M = 8")
    ax, end = fig.axes[0], _longest()
    last = RANKS - 1
    fill, drain = (RANKS - 1) * 1.0, (RANKS - 1) * 2.0        # P - 1 forwards, P - 1 backwards (F = 1, B = 2)
    for start, stop, label in ((0.0, fill, "fill"), (end - drain, end, "drain")):
        ax.annotate("", xy=(start, last + 0.15), xytext=(stop, last + 0.15), arrowprops=dict(arrowstyle="<->", lw=1))
        ax.text((start + stop) / 2, last - 0.12, label, ha="center", va="center", fontsize=8)


def draw_gantt_1f1b(fig) -> None:
    from distlab import schedules

    _gantt(fig, schedules.one_f_one_b(RANKS, MICROBATCHES), "1F1B, P = 4, M = 8")


def draw_gantt_interleaved(fig) -> None:
    from distlab import schedules

    _gantt(fig, schedules.interleaved_1f1b(RANKS, MICROBATCHES, 2), "interleaved 1F1B, P = 4, M = 8, V = 2")


def draw_gantt_zb_h1(fig) -> None:
    from distlab import schedules

    _gantt(fig, schedules.zero_bubble_h1(RANKS, MICROBATCHES), "ZB-H1, P = 4, M = 8, F = I = W")


def draw_gantt_zbv(fig) -> None:
    from distlab import schedules

    _gantt(fig, schedules.zbv(RANKS, MICROBATCHES), "ZBV, P = 4, M = 8, F = I = W")


FIGURES = {
    "07_naive_relay.png": (draw_naive_relay, (10, 3.6)),
    "07_gantt_gpipe.png": (draw_gantt_gpipe, (10, 2.3)),
    "07_gantt_1f1b.png": (draw_gantt_1f1b, (10, 2.3)),
    "07_gantt_interleaved.png": (draw_gantt_interleaved, (10, 2.3)),
    "07_gantt_zb_h1.png": (draw_gantt_zb_h1, (10, 2.3)),
    "07_gantt_zbv.png": (draw_gantt_zbv, (16, 2.6)),      # twice the bars of the others: wider, to be read
}
