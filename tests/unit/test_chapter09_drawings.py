"""Chapter 09's two pictures of its mechanisms are the mechanisms: the 2-D-sharded weight is what torch stores on
each rank of a (dp, tp) = (2, 2) mesh, and the rings' hops are the groups distlab.hybrid builds."""

from __future__ import annotations

import pytest

from coursetools.drawings import ch09
from distlab import hybrid


def _owners_from_torch(style: str) -> list[list[tuple[int, int]]]:
    """Each rank in turn on a fake 4-rank world: TP (one linear, column- or row-wise), then FSDP over dp; the
    weight holds its own flat index, so each rank's local shard says which elements it stores."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    owners = [[None] * 8 for _ in range(8)]
    blocks = {}
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
            with torch.no_grad():
                model[0].weight.copy_(torch.arange(64.0).reshape(8, 8))
            plan = ColwiseParallel() if style == "colwise" else RowwiseParallel()
            parallelize_module(model, mesh["tp"], {"0": plan}, src_data_rank=None)   # each rank slices locally
            fully_shard(model, mesh=mesh["dp"])
            weight = model[0].weight
            local = weight.to_local()
            coordinate = tuple(mesh.get_coordinate())
            # torch's own account of the shard: its shape and global offset on this rank of the (dp, tp) mesh (the
            # weight's own mesh answers (0, 0) on every fake rank, so the mesh built here is passed)
            shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
            blocks[coordinate] = (tuple(shape), tuple(offset))
        finally:
            dist.destroy_process_group()
        for index in local.flatten().tolist():
            i, j = divmod(int(index), 8)
            assert owners[i][j] is None
            owners[i][j] = coordinate
    return owners, blocks


@pytest.mark.parametrize("style, tp_dim", [("colwise", 0), ("rowwise", 1)])
def test_the_two_d_weight_picture_is_what_each_rank_stores(style, tp_dim):
    drawn = ch09.two_d_owners(8, 2, 2, tp_dim)
    owners, blocks = _owners_from_torch(style)
    assert drawn == owners
    # each rank's block, as torch's shape and global offset give it, is the block the picture colours for that rank
    assert len(blocks) == 4
    for coordinate, ((rows, cols), (row0, col0)) in blocks.items():
        cells = {(i, j) for i in range(8) for j in range(8) if drawn[i][j] == coordinate}
        assert cells == {(i, j) for i in range(row0, row0 + rows) for j in range(col0, col0 + cols)}, coordinate


def test_the_column_wise_weight_is_strided_over_dp():
    # what the caption says: dp rank 0 holds rows 0, 1, 4 and 5, one piece of each TP half
    owners = ch09.two_d_owners(8, 2, 2, 0)
    assert [i for i in range(8) if owners[i][0][0] == 0] == [0, 1, 4, 5]


def test_the_rings_cross_the_nodes_as_the_chapter_counts():
    fsdp = ch09.ring_hops(list(range(8)), 4)
    assert [(s, r) for s, r, crosses in fsdp if crosses] == [(3, 4), (7, 0)]
    copied_tp = hybrid.grid_groups((1, 2, 4), "hybrid_context")["tp"][0]
    assert copied_tp == [0, 2, 4, 6]
    hops = ch09.ring_hops(copied_tp, 4)
    assert sum(not crosses for _, _, crosses in hops) == 2 and sum(crosses for _, _, crosses in hops) == 2
    # 2 of the group's 4 ranks on each node: the bytes leaving a node go out over 2 NICs
    assert {sum(hybrid.node_of(r, 4) == node for r in copied_tp) for node in (0, 1)} == {2}
