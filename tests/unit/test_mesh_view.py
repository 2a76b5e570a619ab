"""The mesh pictures of chapter 09 (labkit.mesh_view): placement and colours checked against a grid built here
with torch.arange(...).view(...), the HTML and the widget without a browser, the matplotlib drawing headless."""

from __future__ import annotations

import re

import pytest

from labkit import mesh_view


def arange_groups(shape, order, dim):
    """The groups of ``dim`` read off ``arange(world).view(sizes in rank order)``: independent of distlab.hybrid."""
    torch = pytest.importorskip("torch")
    sizes = dict(zip(("pp", "dp", "tp"), shape))
    dims = {"device_mesh": ("pp", "dp", "tp"), "hybrid_context": ("pp", "tp", "dp")}[order]
    grid = torch.arange(sizes["pp"] * sizes["dp"] * sizes["tp"]).view(*(sizes[d] for d in dims))
    axis = dims.index(dim)
    moved = grid.movedim(axis, -1).reshape(-1, sizes[dim])
    return sorted(sorted(row.tolist()) for row in moved)


@pytest.mark.parametrize("order", ["device_mesh", "hybrid_context"])
@pytest.mark.parametrize("shape", [(1, 2, 4), (2, 2, 4), (2, 1, 2), (1, 4, 2)])
def test_cells_sharing_a_colour_are_exactly_a_group(shape, order):
    cells = mesh_view.mesh_cells(shape, order, gpus_per_node=4)
    for dim in ("pp", "dp", "tp"):
        by_colour = {}
        for c in cells:
            by_colour.setdefault(c["group"][dim], []).append(c["rank"])
        assert sorted(sorted(g) for g in by_colour.values()) == arange_groups(shape, order, dim)


def test_eight_ranks_on_two_nodes_in_both_orders():
    mesh = mesh_view.mesh_cells((1, 2, 4), "device_mesh", 4)
    assert [(c["node"], c["gpu"]) for c in mesh] == [(n, g) for n in range(2) for g in range(4)]
    assert not any(c["crosses"]["tp"] for c in mesh) and all(c["crosses"]["dp"] for c in mesh)
    context = mesh_view.mesh_cells((1, 2, 4), "hybrid_context", 4)
    # dp innermost: rank 1 is dp 1 on node 0, and TP group 0 is [0, 2, 4, 6], over both nodes
    assert (context[1]["dp"], context[1]["tp"]) == (1, 0)
    assert context[0]["group"]["tp"] == context[2]["group"]["tp"] == context[4]["group"]["tp"]
    assert all(c["crosses"]["tp"] for c in context) and not any(c["crosses"]["dp"] for c in context)
    assert mesh_view.crossing_summary((1, 2, 4), 4) == {
        "device_mesh": {"pp": (0, 8), "dp": (4, 4), "tp": (0, 2)},
        "hybrid_context": {"pp": (0, 8), "dp": (0, 4), "tp": (2, 2)}}


def test_small_dp_times_tp_keeps_tp_in_a_node_in_both_orders():
    # tp x dp = 4 fits one node of 4: the copied order is harmless there (the chapter's condition)
    summary = mesh_view.crossing_summary((2, 2, 2), 4)
    assert summary["device_mesh"]["tp"][0] == summary["hybrid_context"]["tp"][0] == 0


def test_html_has_every_rank_once_and_marks_crossing_groups():
    page = mesh_view.mesh_html((2, 2, 4), "hybrid_context", 4, "tp")
    assert sorted(int(r) for r in re.findall(r'title="rank (\d+)"', page)) == list(range(16))
    assert page.count(f"3px solid {mesh_view.CROSSING_COLOUR}") == 16
    assert "4 of 4" in page and page.count("<tr>") == 4
    calm = mesh_view.mesh_html((2, 2, 4), "device_mesh", 4, "tp")
    assert mesh_view.CROSSING_COLOUR not in calm and "0 of 4" in calm
    partial = mesh_view.mesh_html((1, 1, 3), "device_mesh", 4, "tp")  # 3 ranks on a node of 4
    assert "idle GPU" in partial


def test_explorer_html_warns_where_it_should():
    both = mesh_view.explorer_html(2, 2, 4, 4)
    assert "HybridParallelContext" in both and "DeviceMesh" in both and "across nodes" in both
    assert "across nodes" not in mesh_view.explorer_html(1, 1, 4, 4)
    assert "larger than the 4 ranks of a node" in mesh_view.explorer_html(1, 1, 8, 4)
    with pytest.raises(ValueError):
        mesh_view.explorer_html(0, 2, 2)
    with pytest.raises(ValueError):
        mesh_view.mesh_html((1, 2, 2), colour_by="cp")


def test_the_widget_updates_from_its_controls():
    pytest.importorskip("ipywidgets")
    box = mesh_view.mesh_explorer(pp=1, dp=1, tp=4)
    assert "across nodes" not in box.output.value
    box.controls["dp"].value = 2  # observed: the picture refreshes without a browser
    assert "across nodes" in box.output.value
    box.controls["colour_by"].value = "dp"
    assert "DP groups crossing a node (red border): 4 of 4" in box.output.value


def test_drawing_draws_one_box_per_rank():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig = mesh_view.draw_orders((1, 2, 4), 4)
    try:
        left, right = fig.axes
        assert len(left.patches) == len(right.patches) == 8
        red = [p for p in right.patches if matplotlib.colors.to_hex(p.get_edgecolor()) == mesh_view.CROSSING_COLOUR]
        assert len(red) == 8 and "2 of 2" in right.get_title() and "0 of 2" in left.get_title()
    finally:
        plt.close(fig)
