"""Pictures of a (pp, dp, tp) rank grid laid on nodes x GPUs, each process group in its own colour (chapter 09).

A job of ``pp x dp x tp`` ranks runs on nodes of ``gpus_per_node`` GPUs, filled in rank order (ranks 0..3 on
the first node of 4). Colouring the ranks by the group they share in one dimension shows at a glance which
groups stay inside a node (NVLink) and which cross the network; drawing both rank orders of
``distlab.hybrid.RANK_ORDERS`` side by side shows why the order matters.

Everything that decides a picture is a plain function (:func:`mesh_cells`, :func:`crossing_summary`,
:func:`mesh_html`, :func:`explorer_html`); :func:`draw_mesh` and :func:`draw_orders` draw with matplotlib and
:func:`mesh_explorer` wires ipywidgets to :func:`explorer_html`. The grid arithmetic is ``distlab.hybrid``'s.
"""

from __future__ import annotations

import html
import math

from distlab import hybrid

# Distinguishable fills (matplotlib's tab20); a group's colour is its index here.
# Reds are left out: red marks a group that crosses nodes.
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
           "#aec7e8", "#ffbb78", "#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]
ORDER_LABELS = {"device_mesh": "DeviceMesh order (pp, dp, tp): tp innermost",
                "hybrid_context": "HybridParallelContext order (pp, tp, dp): dp innermost"}
CROSSING_COLOUR = "#c0392b"


def colour_of(group_index: int) -> str:
    return PALETTE[group_index % len(PALETTE)]


def mesh_cells(shape, order: str = "device_mesh", gpus_per_node: int = 4) -> list[dict]:
    """One cell per rank: ``{"rank", "node", "gpu", "pp", "dp", "tp", "group": {dim: index}, "crosses": {dim: bool}}``.

    ``gpu`` is the rank's place in its node (its local rank); ``group[dim]`` numbers the groups of that
    dimension as ``hybrid.grid_groups`` lists them; ``crosses[dim]`` says whether that group spans nodes.
    """
    groups = hybrid.grid_groups(shape, order)
    index_of = {dim: {rank: i for i, members in enumerate(groups[dim]) for rank in members} for dim in groups}
    crossing = {dim: {tuple(g) for g in hybrid.groups_crossing_nodes(groups[dim], gpus_per_node)} for dim in groups}
    cells = []
    for row in hybrid.grid_table(shape, order, gpus_per_node):
        rank = row["rank"]
        cells.append({**row, "gpu": rank % gpus_per_node,
                      "group": {dim: index_of[dim][rank] for dim in groups},
                      "crosses": {dim: tuple(groups[dim][index_of[dim][rank]]) in crossing[dim] for dim in groups}})
    return cells


def crossing_summary(shape, gpus_per_node: int = 4) -> dict:
    """``{order: {dim: (groups crossing nodes, groups)}}`` for both rank orders."""
    crossing = hybrid.crossing_groups_by_order(shape, gpus_per_node)
    return {order: {dim: (len(crossing[order][dim]), len(hybrid.grid_groups(shape, order)[dim]))
                    for dim in hybrid.DIMENSIONS}
            for order in hybrid.RANK_ORDERS}


def _check(shape, gpus_per_node: int, colour_by: str) -> tuple:
    pp, dp, tp = (int(x) for x in shape)
    if min(pp, dp, tp) < 1 or gpus_per_node < 1:
        raise ValueError(f"pp, dp, tp and GPUs per node must be at least 1, not {(pp, dp, tp)}, {gpus_per_node}")
    if colour_by not in hybrid.DIMENSIONS:
        raise ValueError(f"colour_by must be one of {hybrid.DIMENSIONS}, not {colour_by!r}")
    return pp, dp, tp


def mesh_html(shape, order: str = "device_mesh", gpus_per_node: int = 4, colour_by: str = "tp") -> str:
    """The mesh as an HTML table: one row per node, one cell per GPU, coloured by the ``colour_by`` group;
    a cell whose group crosses nodes has a red border."""
    pp, dp, tp = _check(shape, gpus_per_node, colour_by)
    cells = mesh_cells((pp, dp, tp), order, gpus_per_node)
    nodes = math.ceil(len(cells) / gpus_per_node)
    rows = [f"<b>{html.escape(ORDER_LABELS.get(order, order))}</b>",
            '<table style="border-collapse:separate;border-spacing:3px">']
    for node in range(nodes):
        tds = [f'<td style="padding:2px 6px"><b>node {node}</b></td>']
        for gpu in range(gpus_per_node):
            rank = node * gpus_per_node + gpu
            if rank >= len(cells):
                tds.append('<td style="border:1px dashed #bbb;width:70px">idle GPU</td>')
                continue
            c = cells[rank]
            border = f"3px solid {CROSSING_COLOUR}" if c["crosses"][colour_by] else "3px solid transparent"
            tds.append(f'<td title="rank {rank}" style="background:{colour_of(c["group"][colour_by])};color:white;'
                       f'border:{border};padding:4px 6px;text-align:center;font-family:monospace">'
                       f'rank {rank}<br>pp{c["pp"]} dp{c["dp"]} tp{c["tp"]}</td>')
        rows.append("<tr>" + "".join(tds) + "</tr>")
    rows.append("</table>")
    crossing = crossing_summary((pp, dp, tp), gpus_per_node)[order][colour_by]
    rows.append(f"{colour_by.upper()} groups crossing a node (red border): {crossing[0]} of {crossing[1]}")
    return "\n".join(rows)


def explorer_html(pp: int, dp: int, tp: int, gpus_per_node: int = 4, colour_by: str = "tp") -> str:
    """Both rank orders side by side, with a warning where TP leaves a node."""
    _check((pp, dp, tp), gpus_per_node, colour_by)
    title = (f"<b>pp {pp} x dp {dp} x tp {tp} = {pp * dp * tp} ranks on "
             f"{math.ceil(pp * dp * tp / gpus_per_node)} node(s) of {gpus_per_node} GPUs, coloured by "
             f"{colour_by.upper()} group</b>")
    panes = "".join('<td style="vertical-align:top;padding-right:24px">'
                    f"{mesh_html((pp, dp, tp), order, gpus_per_node, colour_by)}</td>" for order in hybrid.RANK_ORDERS)
    notes = [html.escape(w) for w in hybrid.mesh_shape_warnings(tp, gpus_per_node)]
    summary = crossing_summary((pp, dp, tp), gpus_per_node)
    if summary["hybrid_context"]["tp"][0] and not summary["device_mesh"]["tp"][0]:
        notes.append("The HybridParallelContext order puts TP groups across nodes (dp > 1 and tp x dp > GPUs per "
                     "node): every layer's all-reduces would run on the network instead of NVLink.")
    return "<br>".join([title, f"<table><tr>{panes}</tr></table>", *notes])


def draw_mesh(shape, order: str = "device_mesh", gpus_per_node: int = 4, colour_by: str = "tp", ax=None,
              title: str | None = None):
    """Draw the mesh with matplotlib: nodes as rows, GPUs as columns, groups of ``colour_by`` in colours,
    crossing groups outlined in red. Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    pp, dp, tp = _check(shape, gpus_per_node, colour_by)
    cells = mesh_cells((pp, dp, tp), order, gpus_per_node)
    nodes = math.ceil(len(cells) / gpus_per_node)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.3 * gpus_per_node + 1, 0.9 * nodes + 0.8))
    for c in cells:
        x, y = c["gpu"], nodes - 1 - c["node"]
        crosses = c["crosses"][colour_by]
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=colour_of(c["group"][colour_by]),
                               edgecolor=CROSSING_COLOUR if crosses else "white", linewidth=3 if crosses else 1))
        ax.text(x + 0.5, y + 0.5, f"{c['rank']}\npp{c['pp']} dp{c['dp']} tp{c['tp']}", ha="center",
                va="center", color="white", fontsize=8, family="monospace")
    ax.set_xlim(0, gpus_per_node)
    ax.set_ylim(0, nodes)
    ax.set_xticks([g + 0.5 for g in range(gpus_per_node)], [f"GPU {g}" for g in range(gpus_per_node)])
    ax.set_yticks([nodes - 1 - n + 0.5 for n in range(nodes)], [f"node {n}" for n in range(nodes)])
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    crossing = crossing_summary((pp, dp, tp), gpus_per_node)[order][colour_by]
    ax.set_title(title or f"{ORDER_LABELS.get(order, order)}\n{colour_by} groups crossing a node: "
                          f"{crossing[0]} of {crossing[1]}", fontsize=9)
    return ax


def draw_orders(shape, gpus_per_node: int = 4, colour_by: str = "tp"):
    """Both rank orders side by side (a matplotlib figure)."""
    import matplotlib.pyplot as plt

    pp, dp, tp = _check(shape, gpus_per_node, colour_by)
    nodes = math.ceil(pp * dp * tp / gpus_per_node)
    fig, axes = plt.subplots(1, 2, figsize=(2 * (1.3 * gpus_per_node + 1), 0.9 * nodes + 1.2))
    for ax, order in zip(axes, hybrid.RANK_ORDERS):
        draw_mesh((pp, dp, tp), order, gpus_per_node, colour_by, ax=ax)
    fig.suptitle(f"pp {pp} x dp {dp} x tp {tp}, coloured by {colour_by} group", fontsize=10)
    fig.tight_layout()
    return fig


def mesh_explorer(pp: int = 1, dp: int = 2, tp: int = 4, gpus_per_node: int = 4, colour_by: str = "tp"):
    """The interactive mesh (ipywidgets): pp, dp, tp, GPUs per node and the dimension to colour, over
    :func:`explorer_html`. Returns the widget box (``.controls``, ``.output``, ``.update``); on the website,
    ``widgets.static_view`` of its first view."""
    from labkit import widgets

    if widgets.static_pages():
        return widgets.static_view(explorer_html(pp=pp, dp=dp, tp=tp, gpus_per_node=gpus_per_node,
                                                 colour_by=colour_by))
    import ipywidgets as w

    controls = {"pp": w.IntSlider(value=pp, min=1, max=8, description="pp"),
                "dp": w.IntSlider(value=dp, min=1, max=8, description="dp"),
                "tp": w.IntSlider(value=tp, min=1, max=8, description="tp"),
                "gpus_per_node": w.IntSlider(value=gpus_per_node, min=1, max=8, description="GPUs/node"),
                "colour_by": w.Dropdown(options=list(hybrid.DIMENSIONS), value=colour_by, description="colour by")}
    out = w.HTML()

    def update(_=None):
        values = {name: control.value for name, control in controls.items()}
        out.value = explorer_html(**values)

    for control in controls.values():
        control.observe(update, names="value")
    update()
    box = w.VBox([w.HBox([controls["pp"], controls["dp"], controls["tp"]]),
                  w.HBox([controls["gpus_per_node"], controls["colour_by"]]), out])
    box.controls, box.output, box.update = controls, out, update
    return box
