"""Chapter 10's pictures of its mechanism: the halo exchange of a 2 x 2 grid of tiles, drawn from the exchange run
on labels (each cell carries the rank that owns it) in the order ``distlab.domain.halo_exchange`` runs it: rows up
and down first, then columns left and right of the tile already padded with those rows, so the corners arrive."""

from __future__ import annotations

from distlab import domain

ZERO = -1            # a cell beyond the field's edge: zero padding, as the one-device convolution pads


def exchange_on_labels(grid: domain.TileGrid, width: int):
    """The halo exchange on labels: returns ``(after_rows, after_columns, messages)``.

    ``after_rows[r]`` and ``after_columns[r]`` are rank r's tile (a list of rows of owner ranks, ``ZERO`` beyond
    the field's edge) after the up/down and after the left/right exchange; ``messages`` lists ``(sender,
    receiver, phase, cells)``, one for each strip a rank posts (the bytes ``domain.halo_send_bytes`` counts).
    """
    owner = [[None] * grid.width for _ in range(grid.height)]
    for rank in range(grid.size):
        rows, cols = grid.tile_slices(rank)
        for i in range(rows.start, rows.stop):
            for j in range(cols.start, cols.stop):
                owner[i][j] = rank
    tiles = {}
    for rank in range(grid.size):
        rows, cols = grid.tile_slices(rank)
        tiles[rank] = [owner[i][cols.start:cols.stop] for i in range(rows.start, rows.stop)]
    messages = []

    def strip(peer, take, size, phase, receiver):
        if peer is None:
            return [[ZERO] * size for _ in range(width)] if phase == "rows" else [[ZERO] * width for _ in range(size)]
        part = take(peer)
        messages.append((peer, receiver, phase, sum(len(row) for row in part)))
        return part

    after_rows = {}
    for rank in range(grid.size):
        near, tile = grid.neighbours(rank), tiles[rank]
        above = strip(near["up"], lambda p: [list(r) for r in tiles[p][-width:]], len(tile[0]), "rows", rank)
        below = strip(near["down"], lambda p: [list(r) for r in tiles[p][:width]], len(tile[0]), "rows", rank)
        after_rows[rank] = above + [list(r) for r in tile] + below
    after_columns = {}
    for rank in range(grid.size):
        near, tile = grid.neighbours(rank), after_rows[rank]
        west = strip(near["left"], lambda p: [r[-width:] for r in after_rows[p]], len(tile), "columns", rank)
        east = strip(near["right"], lambda p: [r[:width] for r in after_rows[p]], len(tile), "columns", rank)
        after_columns[rank] = [w + r + e for w, r, e in zip(west, tile, east)]
    return after_rows, after_columns, messages


def _cells(ax, x0, y0, labels, own, title=None):
    """Draw a tile's cells from ``(x0, y0)`` (top left): own cells solid with their owner's number, halo cells pale
    and hatched, zero padding grey and blank."""
    from matplotlib.patches import Rectangle

    from coursetools.figures import RANK_COLOURS  # here, not at the top: coursetools.figures imports this module

    for i, row in enumerate(labels):
        for j, label in enumerate(row):
            mine = own(i, j)
            colour = "#dddddd" if label == ZERO else RANK_COLOURS[label]
            ax.add_patch(Rectangle((x0 + j, y0 + i), 1, 1, facecolor=colour, alpha=0.9 if mine else 0.45,
                                   edgecolor="white" if mine else "black", linewidth=0.6,
                                   hatch=None if mine else "//"))
            if label != ZERO:   # a padding cell stays blank: a "0" would read as rank 0's
                ax.text(x0 + j + 0.5, y0 + i + 0.5, str(label), ha="center", va="center", fontsize=6,
                        color="white" if mine else "black")
    if title:
        ax.text(x0 + len(labels[0]) / 2, y0 - 0.4, title, ha="center", va="bottom", fontsize=7)


def draw_halo_exchange(fig) -> None:
    grid, width = domain.TileGrid(2, 2, 8, 8), 1
    after_rows, after_columns, messages = exchange_on_labels(grid, width)
    size, gap = 4, 3
    axes = fig.subplots(1, 3, gridspec_kw={"width_ratios": [1, 1, 0.75]})
    arrow = {"arrowstyle": "->", "linewidth": 1.0, "color": "black"}

    def corner(rank, padded_rows, padded_cols):
        row, col = grid.coords(rank)
        return col * (size + 2 * width + gap) + (width if not padded_cols else 0), \
            row * (size + 2 * width + gap) + (width if not padded_rows else 0)

    ax = axes[0]
    for rank in range(grid.size):
        x0, y0 = corner(rank, True, False)
        _cells(ax, x0, y0, after_rows[rank], lambda i, j: width <= i < width + size, f"rank {rank}")
    for sender, receiver, phase, _ in messages:
        if phase != "rows":
            continue
        (sx, sy), (rx, ry) = corner(sender, True, False), corner(receiver, True, False)
        down = grid.coords(receiver)[0] > grid.coords(sender)[0]
        start = (sx + size / 2 + (0.6 if down else -0.6), sy + (width + size - 0.5 if down else width + 0.5))
        end = (rx + size / 2 + (0.6 if down else -0.6), ry + (0.5 if down else width + size + 0.5))
        ax.annotate("", xy=end, xytext=start, arrowprops=arrow)
    ax.set_title("1. rows up and down: each tile\nreceives its neighbours' edge rows", fontsize=8)

    ax = axes[1]
    for rank in range(grid.size):
        x0, y0 = corner(rank, True, True)
        _cells(ax, x0, y0, after_columns[rank],
               lambda i, j: width <= i < width + size and width <= j < width + size, f"rank {rank}")
    for sender, receiver, phase, _ in messages:
        if phase != "columns":
            continue
        (sx, sy), (rx, ry) = corner(sender, True, True), corner(receiver, True, True)
        right = grid.coords(receiver)[1] > grid.coords(sender)[1]
        y = sy + (size + 2 * width) / 2 + (0.7 if right else -0.7)
        start = (sx + (width + size - 0.5 if right else width + 0.5), y)
        end = (rx + (0.5 if right else width + size + 0.5), y)
        ax.annotate("", xy=end, xytext=start, arrowprops=arrow)
    ax.set_title("2. columns left and right, taller by the\nrows just received: the corners travel too",
                 fontsize=8)

    ax = axes[2]
    _cells(ax, 0, 0, after_columns[0], lambda i, j: width <= i < width + size and width <= j < width + size)
    ax.annotate("rank 3's corner,\ncarried by rank 1", xy=(size + 1.5, size + 1.5), xytext=(size + 2.3, size + 4.2),
                fontsize=7, arrowprops={"arrowstyle": "->", "linewidth": 0.8}, annotation_clip=False)
    ax.text(0, -0.6, "grey, blank: zero padding\nbeyond the field's edge", fontsize=7, va="bottom")
    ax.set_title("rank 0 ready for a 3 x 3\nconvolution: its halo, 1 cell wide", fontsize=8)

    for ax in axes:
        ax.set_aspect("equal")
        ax.autoscale_view()
        ax.invert_yaxis()
        ax.axis("off")
    for ax in axes[:2]:
        ax.set_xlim(-0.5, 2 * (size + 2 * width) + gap + 0.5)
        ax.set_ylim(2 * (size + 2 * width) + gap + 0.5, -1.5)
    axes[2].set_xlim(-0.5, size + 2 * width + 4)
    axes[2].set_ylim(size + 2 * width + 5, -2)
    fig.suptitle("The halo exchange on a 2 x 2 grid of tiles of an 8 x 8 field (each cell shows the rank that "
                 "owns it; hatched: a halo cell, received)", fontsize=9)


FIGURES = {"10_halo_exchange.png": (draw_halo_exchange, (11, 4.2))}
