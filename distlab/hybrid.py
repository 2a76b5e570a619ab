"""Hybrid parallelism (chapter 09): the rank grid of a (pp, dp, tp) mesh, and the 2-D FSDP x TP formulas.

**The grid.** A job of ``pp x dp x tp`` ranks is a 3-D grid: every rank has one coordinate per dimension,
and the ranks that differ only in one coordinate form one process group of that dimension (a TP group
all-reduces activations, a DP group averages gradients, a PP group passes activations stage to stage).
Which rank gets which coordinates is a choice, the *rank order*, named here outermost dimension first:

    ``"device_mesh"``      ("pp", "dp", "tp"): ``rank = pp_rank * dp * tp + dp_rank * tp + tp_rank``.
                           What ``init_device_mesh(dev, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``
                           builds: tp innermost, so a TP group is ``tp`` consecutive ranks, on one node.
    ``"hybrid_context"``   ("pp", "tp", "dp"): ``rank = pp_rank * tp * dp + tp_rank * dp + dp_rank``.
                           The order of a widely copied ``HybridParallelContext``: dp innermost, so the
                           members of a TP group are ``dp`` ranks apart, and a TP group spans nodes as
                           soon as ``dp > 1`` and ``tp * dp`` exceeds the GPUs of a node.

Launchers number ranks node by node (ranks ``0 .. g-1`` on the first node of ``g`` GPUs), so the rank
order decides which groups talk over NVLink inside a node and which over the network between nodes.

Pure functions, no process group: :func:`grid_coordinates`, :func:`grid_rank`, :func:`grid_groups`,
:func:`groups_of_rank`, :func:`node_of`, :func:`groups_crossing_nodes`, :func:`mesh_shape_problems`,
:func:`mesh_shape_warnings`, :func:`default_mesh_shape`, :func:`crossing_groups_by_order`, :func:`grid_table`.
"""

from __future__ import annotations

import math

DIMENSIONS = ("pp", "dp", "tp")  # how a shape is always given: (pp, dp, tp), whatever the rank order

RANK_ORDERS = {
    "device_mesh": ("pp", "dp", "tp"),  # init_device_mesh(..., (pp, dp, tp)): tp innermost
    "hybrid_context": ("pp", "tp", "dp"),  # the copied HybridParallelContext: dp innermost
}


def _shape_dict(shape) -> dict:
    """``(pp, dp, tp)`` or ``{"pp": .., "dp": .., "tp": ..}`` as a dict."""
    if isinstance(shape, dict):
        return {dim: int(shape[dim]) for dim in DIMENSIONS}
    pp, dp, tp = shape
    return {"pp": int(pp), "dp": int(dp), "tp": int(tp)}


def _order_tuple(order) -> tuple:
    """A rank order by name (a key of :data:`RANK_ORDERS`) or as dimension names, outermost first."""
    dims = RANK_ORDERS.get(order, order) if isinstance(order, str) else tuple(order)
    if sorted(dims) != sorted(DIMENSIONS):
        raise ValueError(f"a rank order names pp, dp and tp once each (or one of {sorted(RANK_ORDERS)}), "
                         f"not {order!r}")
    return tuple(dims)


def grid_coordinates(rank: int, shape, order="device_mesh") -> dict:
    """The ``{"pp": .., "dp": .., "tp": ..}`` coordinates of ``rank`` in a grid of ``shape = (pp, dp, tp)``.

    The innermost dimension of ``order`` varies fastest: in ``"device_mesh"`` order rank 5 of (1, 2, 4) is
    ``dp 1, tp 1``; in ``"hybrid_context"`` order it is ``tp 2, dp 1``.
    """
    sizes, dims = _shape_dict(shape), _order_tuple(order)
    world = math.prod(sizes.values())
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a grid of {world} ranks")
    coordinates = {}
    for dim in reversed(dims):  # innermost first: rank = ((c0 * n1 + c1) * n2 + c2)
        rank, coordinates[dim] = divmod(rank, sizes[dim])
    return {dim: coordinates[dim] for dim in DIMENSIONS}


def grid_rank(coordinates: dict, shape, order="device_mesh") -> int:
    """The rank at ``coordinates`` (``{"pp", "dp", "tp"}``): the inverse of :func:`grid_coordinates`."""
    sizes, dims = _shape_dict(shape), _order_tuple(order)
    rank = 0
    for dim in dims:  # outermost first
        if not 0 <= coordinates[dim] < sizes[dim]:
            raise ValueError(f"{dim} coordinate {coordinates[dim]} is outside 0..{sizes[dim] - 1}")
        rank = rank * sizes[dim] + coordinates[dim]
    return rank


def grid_groups(shape, order="device_mesh") -> dict:
    """The process groups of each dimension: ``{"pp": [[ranks], ...], "dp": [...], "tp": [...]}``.

    A group of dimension d holds the ranks whose other two coordinates are equal, listed in the order of
    their d coordinate (that is the group rank each gets). Groups are sorted by their first member.
    Every rank is in exactly one group per dimension.
    """
    sizes, _ = _shape_dict(shape), _order_tuple(order)
    world = math.prod(sizes.values())
    groups = {}
    for dim in DIMENSIONS:
        others = [d for d in DIMENSIONS if d != dim]
        found: dict[tuple, list] = {}
        for rank in range(world):
            where = grid_coordinates(rank, sizes, order)
            found.setdefault(tuple(where[d] for d in others), [None] * sizes[dim])[where[dim]] = rank
        groups[dim] = sorted(found.values(), key=lambda members: members[0])
    return groups


def groups_of_rank(rank: int, shape, order="device_mesh") -> dict:
    """The group of each dimension that ``rank`` belongs to: ``{"pp": [..], "dp": [..], "tp": [..]}``."""
    sizes = _shape_dict(shape)
    where = grid_coordinates(rank, sizes, order)
    return {dim: [grid_rank({**where, dim: i}, sizes, order) for i in range(sizes[dim])] for dim in DIMENSIONS}


def node_of(rank: int, gpus_per_node: int) -> int:
    """The node a rank runs on, when the launcher fills nodes in rank order (torchrun, mpiexec --ppn, PBS)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be at least 1, not {gpus_per_node}")
    return rank // gpus_per_node


def groups_crossing_nodes(groups: list, gpus_per_node: int) -> list:
    """The groups (lists of ranks) whose members sit on more than one node: their traffic leaves the node."""
    return [group for group in groups if len({node_of(rank, gpus_per_node) for rank in group}) > 1]


def mesh_shape_problems(world: int, pp: int = 1, dp: int = 1, tp: int = 1) -> list:
    """Every reason a (pp, dp, tp) mesh cannot run on ``world`` ranks (empty when it can), one sentence each."""
    problems = [f"--{name} must be at least 1, not {value}" for name, value in (("pp", pp), ("dp", dp), ("tp", tp))
                if value < 1]
    if not problems and pp * dp * tp != world:
        problems.append(f"the mesh pp x dp x tp = {pp} x {dp} x {tp} = {pp * dp * tp} ranks is not the world "
                        f"size {world}")
    return problems


def mesh_shape_warnings(tp: int, gpus_per_node: int) -> list:
    """What runs but runs badly: a TP group larger than a node puts its per-layer all-reduces on the network."""
    if tp > gpus_per_node:
        return [f"warning: --tp {tp} is larger than the {gpus_per_node} ranks of a node: every layer's TP "
                f"all-reduces cross the network between nodes (Slingshot, ~25 GB/s) instead of NVLink"]
    return []


def default_mesh_shape(world: int, ranks_per_node: int) -> tuple:
    """The usual 2-D layout ``(dp, tp)``: TP over the ranks of a node, data parallel over the nodes."""
    tp = max(1, min(ranks_per_node, world))
    if world % tp:
        tp = math.gcd(world, tp)
    return world // tp, tp


def crossing_groups_by_order(shape, gpus_per_node: int) -> dict:
    """For each rank order of :data:`RANK_ORDERS`, the groups of each dimension that span several nodes:
    ``{"device_mesh": {"pp": [...], "dp": [...], "tp": [...]}, "hybrid_context": {...}}``."""
    return {order: {dim: groups_crossing_nodes(groups, gpus_per_node)
                    for dim, groups in grid_groups(shape, order).items()}
            for order in RANK_ORDERS}


def grid_table(shape, order="device_mesh", gpus_per_node: int | None = None) -> list:
    """One row per rank: ``{"rank", "node", "pp", "dp", "tp"}`` (node only when ``gpus_per_node`` is given);
    what a picture of the mesh (nodes x GPUs, coloured by group) is drawn from."""
    world = math.prod(_shape_dict(shape).values())
    rows = []
    for rank in range(world):
        row = {"rank": rank, **grid_coordinates(rank, shape, order)}
        if gpus_per_node is not None:
            row["node"] = node_of(rank, gpus_per_node)
        rows.append(row)
    return rows
