"""Chapter 06's picture of where a transformer block's communication sits under tensor parallelism: f and g.

Drawn from the course's own plan (``distlab.tensor_parallel.transformer_tp_plan``): each region the plan declares
with ``PrepareModuleInput`` is entered through f (forward identity, backward all-reduce), its ``ColwiseParallel``
linears are drawn cut by output columns, its ``RowwiseParallel`` one cut by input rows and left through g
(forward all-reduce, backward identity).
"""

from __future__ import annotations

REGION_LABELS = {"attention": "attention:\neach rank on\nits own heads", "feed_forward": "silu(w1 x) * w3 x\non local columns"}


def block_regions() -> list[dict]:
    """The regions of one block, in order, read off the plan: {name, column: [linears], row: [linears]}."""
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    from distlab.tensor_parallel import transformer_tp_plan

    plan = {name[len("layers.*."):]: style for name, style in transformer_tp_plan().items()
            if name.startswith("layers.*.")}
    regions = [name for name, style in plan.items() if isinstance(style, PrepareModuleInput)]
    order = ["attention", "feed_forward"]                      # the order of the block's forward
    return [{"name": region,
             "column": [n.split(".")[-1] for n, s in plan.items()
                        if n.startswith(region + ".") and isinstance(s, ColwiseParallel)],
             "row": [n.split(".")[-1] for n, s in plan.items()
                     if n.startswith(region + ".") and isinstance(s, RowwiseParallel)]}
            for region in sorted(regions, key=order.index)]


def _operator(ax, x, y, letter, colour):
    from matplotlib.patches import Circle

    ax.add_patch(Circle((x, y), 0.32, facecolor="white", edgecolor=colour, lw=1.6))
    ax.text(x, y, letter, ha="center", va="center", fontsize=11, fontweight="bold", color=colour)


def draw_f_and_g_in_a_block(fig) -> None:
    from matplotlib.patches import FancyBboxPatch

    from coursetools.figures import RANK_COLOURS, _matrix   # here: coursetools.figures imports this module

    ax = fig.subplots()
    grey, mid = ["#bbbbbb"], 2.0
    _matrix(ax, 0, 1.4, 0.7, 1.2, "x on\nevery rank", grey)
    x = 1.3
    for i, region in enumerate(block_regions()):
        _operator(ax, x, mid, "f", "#7b3294")
        x += 0.6
        width = 0.75 * (len(region["column"]) + len(region["row"])) + 2.4
        ax.add_patch(FancyBboxPatch((x - 0.1, 0.55), width, 2.95, boxstyle="round,pad=0.05", facecolor="#f4f4f4",
                                    edgecolor="#999999", lw=0.8))
        ax.text(x - 0.05 + width / 2, 3.3, f"region: {region['name']}", ha="center", va="center", fontsize=8)
        for name in region["column"]:
            _matrix(ax, x + 0.05, 1.3, 0.55, 1.4, f"{name}\ncolumn", RANK_COLOURS, "cols", fontsize=6.5)
            x += 0.75
        ax.text(x + 1.1, mid, REGION_LABELS.get(region["name"], "local"), ha="center", va="center", fontsize=7)
        x += 2.25
        for name in region["row"]:
            _matrix(ax, x, 1.3, 0.55, 1.4, f"{name}\nrow", RANK_COLOURS, "rows", fontsize=6.5)
            x += 0.75
        x += 0.35
        _operator(ax, x, mid, "g", "#008837")
        x += 0.55
        if i == 0:
            ax.text(x, mid, "+", ha="center", va="center", fontsize=12)
            ax.text(x, mid - 0.45, "residual", ha="center", va="top", fontsize=6.5)
            x += 0.55
    _matrix(ax, x, 1.4, 0.7, 1.2, "output on\nevery rank", grey)
    ax.text(0.0, -0.25, "f: forward, identity (every rank has x); backward, all-reduce the input gradient",
            fontsize=7.5, color="#7b3294", va="center")
    ax.text(0.0, -0.65, "g: forward, all-reduce the partial sums; backward, identity", fontsize=7.5,
            color="#008837", va="center")
    ax.set_xlim(-0.2, x + 0.9)
    ax.set_ylim(-0.9, 3.8)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("one transformer block on 4 TP ranks (colours): two regions, each entered through f and left "
                 "through g", fontsize=9)


FIGURES = {"06_f_and_g_in_a_block.png": (draw_f_and_g_in_a_block, (10, 3.2))}
