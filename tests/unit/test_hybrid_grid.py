"""The rank grid of chapter 09 (distlab.hybrid), against answers built independently of it:
the issue's closed formulas, ``torch.arange(world).view(...)`` (picotron's way), and DeviceMesh itself
on a fake process group."""

import itertools

import pytest
import torch

from distlab import hybrid

SHAPES = [(1, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1), (2, 2, 2), (2, 2, 4), (3, 2, 4), (1, 4, 1), (2, 3, 5)]


def closed_form_rank(pp_rank, dp_rank, tp_rank, shape, order):
    pp, dp, tp = shape
    if order == "device_mesh":
        return pp_rank * dp * tp + dp_rank * tp + tp_rank
    return pp_rank * tp * dp + tp_rank * dp + dp_rank  # HybridParallelContext: dp innermost


def arange_groups(shape, order):
    """Groups of each dimension from a tensor of rank ids laid out in the order's shape."""
    sizes = dict(zip(("pp", "dp", "tp"), shape))
    dims = hybrid.RANK_ORDERS[order]
    grid = torch.arange(sizes["pp"] * sizes["dp"] * sizes["tp"]).view(*(sizes[d] for d in dims))
    groups = {}
    for dim in ("pp", "dp", "tp"):
        axis = dims.index(dim)
        rows = grid.movedim(axis, -1).reshape(-1, sizes[dim]).tolist()
        groups[dim] = sorted(rows)
    return groups


@pytest.mark.parametrize("order", ["device_mesh", "hybrid_context"])
@pytest.mark.parametrize("shape", SHAPES)
def test_coordinates_follow_the_closed_formula_and_invert(shape, order):
    pp, dp, tp = shape
    seen = set()
    for pp_rank, dp_rank, tp_rank in itertools.product(range(pp), range(dp), range(tp)):
        rank = closed_form_rank(pp_rank, dp_rank, tp_rank, shape, order)
        where = {"pp": pp_rank, "dp": dp_rank, "tp": tp_rank}
        assert hybrid.grid_coordinates(rank, shape, order) == where
        assert hybrid.grid_rank(where, shape, order) == rank
        seen.add(rank)
    assert seen == set(range(pp * dp * tp))


@pytest.mark.parametrize("order", ["device_mesh", "hybrid_context"])
@pytest.mark.parametrize("shape", SHAPES)
def test_groups_equal_the_arange_view_layout(shape, order):
    groups = hybrid.grid_groups(shape, order)
    assert groups == arange_groups(shape, order)
    world = shape[0] * shape[1] * shape[2]
    for dim, size in zip(("pp", "dp", "tp"), shape):
        members = sorted(rank for group in groups[dim] for rank in group)
        assert members == list(range(world)), f"every rank once in the {dim} groups"
        assert all(len(group) == size for group in groups[dim])
        for rank in range(world):
            assert hybrid.groups_of_rank(rank, shape, order)[dim] in groups[dim]
            assert rank in hybrid.groups_of_rank(rank, shape, order)[dim]


def test_the_chapter_example_of_rank_5():
    # 8 ranks, dp 2 x tp 4: in DeviceMesh order rank 5 is the second TP rank of the second DP replica
    assert hybrid.grid_coordinates(5, (1, 2, 4), "device_mesh") == {"pp": 0, "dp": 1, "tp": 1}
    assert hybrid.grid_coordinates(5, (1, 2, 4), "hybrid_context") == {"pp": 0, "dp": 1, "tp": 2}
    assert hybrid.grid_groups((1, 2, 4), "device_mesh")["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hybrid.grid_groups((1, 2, 4), "hybrid_context")["tp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert hybrid.grid_groups((2, 2, 2), "device_mesh")["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_the_issue_example_puts_tp_across_nodes_only_in_the_copied_order():
    shape = (2, 2, 4)  # 16 ranks: pp=2, dp=2, tp=4, on nodes of 4 GPUs
    mesh_tp = hybrid.grid_groups(shape, "device_mesh")["tp"]
    context_tp = hybrid.grid_groups(shape, "hybrid_context")["tp"]
    assert hybrid.groups_crossing_nodes(mesh_tp, 4) == []
    assert hybrid.groups_crossing_nodes(context_tp, 4) == context_tp  # all four cross
    assert context_tp[0] == [0, 2, 4, 6]  # nodes 0 and 1
    # dp = 1: both orders are the same grid, TP stays inside the node
    assert hybrid.grid_groups((4, 1, 4), "hybrid_context") == hybrid.grid_groups((4, 1, 4), "device_mesh")
    # tp * dp within one node: the copied order is slower to spread, but nothing crosses yet
    assert hybrid.groups_crossing_nodes(hybrid.grid_groups((2, 2, 2), "hybrid_context")["tp"], 4) == []


def test_node_of_and_crossing():
    assert [hybrid.node_of(r, 4) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert hybrid.groups_crossing_nodes([[0, 1], [3, 4], [4, 7]], 4) == [[3, 4]]
    with pytest.raises(ValueError):
        hybrid.node_of(0, 0)


@pytest.mark.parametrize("shape", [(1, 2, 4), (2, 2, 4), (4, 8, 8), (2, 3, 5)])
def test_device_mesh_order_equals_device_mesh_itself(shape):
    """DeviceMesh on a fake process group, once per rank: its groups are the ones of "device_mesh" order."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = shape[0] * shape[1] * shape[2]
    assert not dist.is_initialized()
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
            ours = hybrid.groups_of_rank(rank, shape, "device_mesh")
            for dim in ("pp", "dp", "tp"):
                assert dist.get_process_group_ranks(mesh.get_group(dim)) == ours[dim], (rank, dim)
                assert mesh[dim].mesh.tolist() == ours[dim]
            assert hybrid.grid_coordinates(rank, shape, "device_mesh") == dict(
                zip(("pp", "dp", "tp"), mesh.get_coordinate()))
        finally:
            dist.destroy_process_group()


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="outside"):
        hybrid.grid_coordinates(8, (1, 2, 4))
    with pytest.raises(ValueError, match="rank order"):
        hybrid.grid_groups((1, 2, 2), ("pp", "tp", "tp"))
    with pytest.raises(ValueError, match="outside"):
        hybrid.grid_rank({"pp": 0, "dp": 2, "tp": 0}, (1, 2, 4))
    # any permutation is an order; a dict shape works too
    assert hybrid.grid_coordinates(1, {"pp": 2, "dp": 1, "tp": 2}, ("tp", "dp", "pp")) == {"pp": 1, "dp": 0, "tp": 0}


def test_mesh_shape_problems_and_warnings():
    assert hybrid.mesh_shape_problems(8, 2, 2, 2) == []
    assert hybrid.mesh_shape_problems(4, 1, 2, 2) == []
    (problem,) = hybrid.mesh_shape_problems(4, 1, 2, 3)
    assert problem == "the mesh pp x dp x tp = 1 x 2 x 3 = 6 ranks is not the world size 4"
    assert hybrid.mesh_shape_problems(4, 1, 0, 4) == ["--dp must be at least 1, not 0"]
    assert hybrid.mesh_shape_warnings(4, 4) == []
    (warning,) = hybrid.mesh_shape_warnings(8, 4)
    assert warning.startswith("warning: --tp 8 is larger than the 4 ranks of a node")


def test_default_mesh_shape_is_tp_inside_the_node():
    assert hybrid.default_mesh_shape(8, 4) == (2, 4)
    assert hybrid.default_mesh_shape(4, 4) == (1, 4)
    assert hybrid.default_mesh_shape(2, 4) == (1, 2)  # fewer ranks than a node holds
    assert hybrid.default_mesh_shape(6, 4) == (3, 2)  # 4 does not divide 6: the largest common divisor
    assert hybrid.default_mesh_shape(1, 1) == (1, 1)


def test_groups_read_from_the_mesh_are_checked_against_the_grid():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlab import hybrid

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=8)
    try:
        right = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        assert hybrid.mesh_group_problems(right, 1, (1, 2, 4)) == []
        # the mistake the issue names: built as (tp, dp), so a TP group strides across the nodes
        swapped = init_device_mesh("cpu", (4, 2), mesh_dim_names=("tp", "dp"))
        problems = hybrid.mesh_group_problems(swapped, 1, (1, 2, 4))
        assert problems and problems[0].startswith("rank 1: its tp group from the mesh is [1, 3, 5, 7]")
        # HSDP's names map onto the grid's: shard = the consecutive (tp-like) ranks, replicate = the strided ones
        hsdp = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        names = {"replicate": "dp", "shard": "tp"}
        assert hybrid.mesh_group_problems(hsdp, 1, (1, 2, 4), names=names) == []
        backwards = init_device_mesh("cpu", (4, 2), mesh_dim_names=("shard", "replicate"))
        assert hybrid.mesh_group_problems(backwards, 1, (1, 2, 4), names=names)[0].startswith(
            "rank 1: its shard group from the mesh is [1, 3, 5, 7], the grid says [0, 1, 2, 3]")
    finally:
        dist.destroy_process_group()


def test_which_rank_reads_which_data():
    import torch

    from distlab import data, hybrid

    shape, batch = (2, 2, 2), 8
    table = [hybrid.data_of_rank(r, shape, batch) for r in range(8)]
    for row in table:
        same_replica = [t for t in table if t["dp"] == row["dp"]]
        assert all(t["rows"] == row["rows"] for t in same_replica)  # TP ranks (and stages) of a replica: same rows
        assert (row["inputs"] == "token ids") == (row["pp"] == 0) and (row["labels"] == "targets") == (row["pp"] == 1)
    assert table[0]["rows"] != table[2]["rows"]  # another dp coordinate: other rows
    # the rows are the ones the scripts feed (data.shard_rows of the global batch by the dp coordinate)
    tokens = torch.arange(batch)[:, None]
    for row in table:
        assert data.shard_rows(tokens, row["dp"], 2)[:, 0].tolist() == list(row["rows"])
