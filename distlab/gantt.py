"""Gantt charts of a pipeline timeline: one row per rank, time to the right, idle time visible.

The same events work whether :func:`distlab.schedules.simulate` made them (cost units) or a real run
measured them (seconds, uneven): TimelineEvents or the ``timeline`` dicts of a metrics file.

- :func:`ascii_gantt` returns text for a terminal or a log::

      rank 0 |F0F1F2F3......B0<<F4B1<<F5B2<<...
      rank 3 |......F0B0<<F1B1<<F2B2<<F3B3<<...

  ``F3`` is the forward of microbatch 3, ``B0<<`` a backward (longer, so it continues with ``<``),
  ``I`` an input gradient alone and ``W`` a weight-gradient pass (zero bubble: torch's letters), ``.`` idle.
- :func:`plot_gantt` draws it with matplotlib; :func:`save_gantt_png` writes a PNG.
"""

from __future__ import annotations

import math
from pathlib import Path

from distlab.schedules import TimelineEvent, bubble_fraction_from_timeline, from_dicts

# What continues a pass too long for its label; an input gradient "I" is half a backward, drawn like one.
FILL_CHARACTER = {"F": ">", "B": "<", "I": "<", "W": "="}
IDLE_CHARACTER = "."
KIND_NAMES = {"F": "forward (F)", "B": "backward (B)", "I": "input gradient (I)", "W": "weight gradient (W)"}
KIND_COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868"}
IDLE_COLOUR = "#EEEEEE"
DEFAULT_WIDTH = 100


def _kind_order(kind: str) -> int:
    """F, B, I, W in the order a microbatch meets them; anything else last."""
    return {"F": 0, "B": 1, "I": 2, "W": 3}.get(kind, 4)


def _grid_step(events: list[TimelineEvent], origin: float) -> float | None:
    """The shortest duration, if every start and end is a whole multiple of it (simulated timelines);
    None for measured ones, whose times fall anywhere."""
    step = min((e.end - e.start for e in events if e.end > e.start), default=0.0)
    if step <= 0:
        return None
    for event in events:
        for time in (event.start - origin, event.end - origin):
            units = time / step
            if abs(units - round(units)) > 1e-6:
                return None
    return step


def _columns_per_time(events: list[TimelineEvent], origin: float, makespan: float, columns: int) -> float:
    """Scale of the x axis. Simulated timelines get a whole number of columns (1 or 2) per shortest
    pass, so each pass lines up exactly; anything else is stretched to fill the width."""
    step = _grid_step(events, origin)
    if step is not None:
        for columns_per_step in (2, 1):
            if makespan / step * columns_per_step <= columns:
                return columns_per_step / step
    return columns / makespan


def _draw_row(events: list[TimelineEvent], origin: float, scale: float, columns: int) -> str:
    """One rank's row. A column shows what ran at its midpoint; a pass too short to cover any midpoint
    still marks its column if nothing else is there, so that no pass disappears."""
    cells = [IDLE_CHARACTER] * columns
    for event in sorted(events, key=lambda e: e.start):
        fill = FILL_CHARACTER.get(event.kind, "?")
        first = max(0, math.ceil((event.start - origin) * scale - 0.5 - 1e-9))
        stop = min(columns, math.ceil((event.end - origin) * scale - 0.5 - 1e-9))
        if stop <= first:
            column = min(columns - 1, int((event.start - origin) * scale))
            if cells[column] == IDLE_CHARACTER:
                cells[column] = fill
            continue
        label = f"{event.kind}{event.microbatch}"
        if len(label) > stop - first:
            label = ""
        for offset, column in enumerate(range(first, stop)):
            cells[column] = label[offset] if offset < len(label) else fill
    return "".join(cells)


def ascii_gantt(events, width: int | None = None, title: str | None = None,
                time_unit: str = "time units") -> str:
    """The timeline as text: one row per rank, a time axis, a legend and the measured bubble.

    ``width`` caps every line (default 100 characters). A simulated timeline is drawn with 1 or 2 columns
    per shortest pass so it reads exactly; a measured one is stretched to the width. ``time_unit`` names
    the unit of the event times in the legend ("s" for a measured run).
    """
    events = from_dicts(events)
    if not events:
        raise ValueError("the timeline is empty; there is nothing to draw.")
    width = width or DEFAULT_WIDTH
    ranks = sorted({e.rank for e in events})
    row_label = "rank {:>%d} |" % len(str(ranks[-1]))
    prefix = len(row_label.format(ranks[-1]))
    columns = width - prefix - 1                      # the row ends with "|"
    if columns < 10:
        raise ValueError(f"width {width} leaves {columns} columns for the chart; give at least {prefix + 11}.")
    origin = min(e.start for e in events)
    makespan = max(e.end for e in events) - origin
    if makespan <= 0:
        raise ValueError("every event in the timeline has zero duration; there is nothing to draw.")
    scale = _columns_per_time(events, origin, makespan, columns)
    used = min(columns, max(1, math.ceil(makespan * scale - 1e-9)))

    lines = [title] if title else []
    for rank in ranks:
        row = _draw_row([e for e in events if e.rank == rank], origin, scale, used)
        lines.append(row_label.format(rank) + row + "|")
    end_label = f"{makespan:.4g}"
    lines.append(" " * prefix + "0" + end_label.rjust(used))
    kinds = sorted({e.kind for e in events}, key=_kind_order)
    named = ", ".join(f"{k}n {KIND_NAMES.get(k, k).split(' (')[0]} of microbatch n" for k in kinds)
    fills = " ".join(f"'{FILL_CHARACTER.get(k, '?')}'" for k in kinds)
    lines.append(f"legend: {named}; {fills} mark a pass, or its rest, too short for its label; "
                 f"'{IDLE_CHARACTER}' idle; 1 column = {1 / scale:.3g} {time_unit}")
    bubble = bubble_fraction_from_timeline(events)
    lines.append(f"bubble: {100 * bubble:.2f}% idle (idle time / (ranks x makespan), measured from these events)")
    return "\n".join(_wrap(line, width) for line in lines)


def _wrap(line: str, width: int) -> str:
    """Break a long legend line at spaces so no line is wider than the chart."""
    if len(line) <= width:
        return line
    out, current = [], ""
    for word in line.split(" "):
        if current and len(current) + 1 + len(word) > width:
            out.append(current)
            current = "  " + word
        else:
            current = f"{current} {word}" if current else word
    out.append(current)
    return "\n".join(out)


def plot_gantt(events, ax=None, title: str | None = None, time_unit: str | None = None):
    """Draw the timeline with matplotlib and return the Axes (its figure is ``ax.figure``).

    One row per rank, rank 0 on top; a light grey band behind each row shows idle time; F, B and W have
    their own colours, paler for a rank's later chunks when it holds several stages (interleaved);
    microbatch numbers are written in bars wide enough; the bubble is in the title.
    """
    events = from_dicts(events)
    if not events:
        raise ValueError("the timeline is empty; there is nothing to draw.")
    ranks = sorted({e.rank for e in events})
    if ax is None:
        import matplotlib.pyplot as plt            # lazy: importing distlab must not pick a backend

        _, ax = plt.subplots(figsize=(11, 1.2 + 0.45 * len(ranks)))
    origin = min(e.start for e in events)
    makespan = max(e.end for e in events) - origin
    bar_height = 0.8

    ax.barh(ranks, [makespan] * len(ranks), left=0, height=bar_height, color=IDLE_COLOUR, label="idle",
            zorder=0)
    stages_of_rank = {rank: sorted({e.stage for e in events if e.rank == rank}) for rank in ranks}
    chunk_of = {(rank, stage): stages.index(stage) for rank, stages in stages_of_rank.items() for stage in stages}
    chunks = max(len(stages) for stages in stages_of_rank.values())
    kinds = sorted({e.kind for e in events}, key=_kind_order)
    for kind in kinds:
        for chunk in range(chunks):
            of_kind = [e for e in events if e.kind == kind and chunk_of[e.rank, e.stage] == chunk]
            if not of_kind:
                continue
            ax.barh([e.rank for e in of_kind], [e.end - e.start for e in of_kind],
                    left=[e.start - origin for e in of_kind], height=bar_height,
                    color=KIND_COLOURS.get(kind, "#8172B3"), alpha=1.0 - 0.5 * chunk / max(chunks - 1, 1),
                    edgecolor="white", linewidth=0.5, zorder=1,
                    label=KIND_NAMES.get(kind, kind) if chunk == 0 else "_nolegend_")

    # A label fits when the bar is wider than its text: compare in data units via the axes' pixel width.
    font_size = 7 if len(ranks) > 8 else 8
    character_width = font_size * ax.figure.dpi / 72 * 0.65 * makespan / max(ax.bbox.width, 1.0)
    for event in events:
        label = str(event.microbatch)
        if event.end - event.start >= (len(label) + 0.5) * character_width:
            ax.text((event.start + event.end) / 2 - origin, event.rank, label, ha="center", va="center",
                    fontsize=font_size, color="white", zorder=2)

    ax.set_yticks(ranks)
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_ylim(ranks[-1] + 0.6, ranks[0] - 0.6)     # rank 0 on top
    ax.set_xlim(0, makespan)
    ax.set_xlabel(f"time ({time_unit})" if time_unit else "time")
    bubble = bubble_fraction_from_timeline(events)
    ax.set_title(f"{title + ': ' if title else ''}bubble {100 * bubble:.1f}%")
    handles, _ = ax.get_legend_handles_labels()
    if chunks > 1:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="grey", alpha=0.5, label="paler: a later chunk"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    return ax


def save_gantt_png(events, path, title: str | None = None, dpi: int = 120,
                   time_unit: str | None = None) -> Path:
    """Write the matplotlib chart to ``path`` (PNG) without touching pyplot's state; returns the path."""
    from matplotlib.figure import Figure            # a bare Figure needs no GUI backend

    events = from_dicts(events)
    figure = Figure(figsize=(11, 1.2 + 0.45 * len({e.rank for e in events})), dpi=dpi)
    plot_gantt(events, ax=figure.add_subplot(), title=title, time_unit=time_unit)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=dpi)
    return path
