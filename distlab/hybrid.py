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

import contextlib
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


# --------------------------------------------------------------------------------------------------
# 2-D FSDP x TP (fsdp_tp_hybrid.py): parameters per rank and communication per mesh dimension
# --------------------------------------------------------------------------------------------------

EMBEDDING_PLANS = ("usual", "alternative")


def _chunk_rows(rows: int, parts: int, index: int) -> int:
    """Rows of piece ``index`` when ``torch.chunk`` cuts ``rows`` into ``parts`` (FSDP2's dim-0 split):
    pieces of ceil(rows / parts), the last ones shorter or empty (10 rows on 4 ranks: 3, 3, 3, 1)."""
    size = -(-rows // parts)
    return max(0, min(size, rows - index * size))


def tp_local_shapes(cfg, tp: int, embedding_plan: str = "usual") -> dict:
    """Shape of every parameter on one TP rank, ``{name: (rows, columns)}`` (norm weights: ``(H, 1)``).

    The blocks follow chapter 06's plan: wq, wk, wv, w1, w3 column-wise (their output rows split), wo and
    w2 row-wise (their input columns split), norms replicated. ``usual``: embedding split by vocabulary
    (rows) and head column-wise (rows); ``alternative``: embedding split by hidden size (columns) and head
    row-wise (columns).
    """
    if embedding_plan not in EMBEDDING_PLANS:
        raise ValueError(f"embedding_plan must be one of {EMBEDDING_PLANS}, not {embedding_plan!r}")
    h, f, v = cfg.dim, cfg.ffn_hidden, cfg.vocab_size
    by_vocabulary = embedding_plan == "usual"
    shapes = {"tok_embeddings.weight": (v // tp, h) if by_vocabulary else (v, h // tp)}
    for i in range(cfg.n_layers):
        block = f"layers.{i}."
        shapes.update({block + "attention_norm.weight": (h, 1), block + "ffn_norm.weight": (h, 1)})
        shapes.update({block + f"attention.{name}.weight": (h // tp, h) for name in ("wq", "wk", "wv")})
        shapes[block + "attention.wo.weight"] = (h, h // tp)
        shapes.update({block + f"feed_forward.{name}.weight": (f // tp, h) for name in ("w1", "w3")})
        shapes[block + "feed_forward.w2.weight"] = (h, f // tp)
    shapes["norm.weight"] = (h, 1)
    shapes["output.weight"] = (v // tp, h) if by_vocabulary else (v, h // tp)
    return shapes


def hybrid_param_count_per_rank(cfg, dp: int, tp: int, dp_rank: int = 0, embedding_plan: str = "usual") -> dict:
    """Parameters one rank of a dp x tp mesh stores: its TP slice of every weight, cut once more along dim 0
    into ``dp`` pieces by FSDP (piece ``dp_rank``; uneven rows give the last ranks less).

    ``{"blocks": .., "root": .., "total": ..}`` (root: embedding, final norm, head). With every dim 0
    divisible, total = (matrices / tp + norms) / dp.
    """
    blocks = root = 0
    for name, (rows, columns) in tp_local_shapes(cfg, tp, embedding_plan).items():
        count = _chunk_rows(rows, dp, dp_rank) * columns
        if name.startswith("layers."):
            blocks += count
        else:
            root += count
    return {"blocks": blocks, "root": root, "total": blocks + root}


def hybrid_state_bytes(cfg, dp: int, tp: int, dp_rank: int = 0, embedding_plan: str = "usual"):
    """fp32 training state of one rank (a :class:`distlab.memory.StateBytes`): 4 bytes of parameter, 4 of
    gradient and 8 of AdamW moments for each parameter it stores (:func:`hybrid_param_count_per_rank`)."""
    from distlab.memory import StateBytes

    held = hybrid_param_count_per_rank(cfg, dp, tp, dp_rank, embedding_plan)["total"]
    return StateBytes(4 * held, 4 * held, 8 * held)


def fsdp_unit_params(cfg, tp: int, embedding_plan: str = "usual", dp: int = 1) -> dict:
    """Parameters of one FSDP unit on one TP rank (what the unit's all-gather rebuilds over dp):
    ``{"block": .., "root": ..}``; each block is one unit, the root (embedding, final norm, head) another.
    FSDP pads each parameter's dim 0 to a multiple of ``dp`` (equal pieces on the wire): counted here."""
    shapes = tp_local_shapes(cfg, tp, embedding_plan)
    padded = {name: -(-rows // dp) * dp * columns for name, (rows, columns) in shapes.items()}
    block = sum(count for name, count in padded.items() if name.startswith("layers.0."))
    root = sum(count for name, count in padded.items() if not name.startswith("layers."))
    return {"block": block, "root": root}


def fsdp_tp_comm_formula(cfg, batch: int, seq_len: int, dp: int, tp: int, *, sequence_parallel: bool = False,
                         embedding_plan: str = "usual", reshard_after_forward: bool = True,
                         bytes_per_element: int = 4, reduce_bytes_per_element: int | None = None,
                         replicate: int = 1) -> list:
    """The collectives of one training step on a dp x tp mesh, per mesh dimension, as rows
    ``{dimension, phase, where, collective, calls, payload_bytes}`` (payload summed over the calls).

    **tp** (each TP group works on its replica's batch / dp sequences): chapter 06's rows
    (:func:`distlab.tensor_parallel.tp_comm_formula`), with ``where`` either ``blocks`` (2 all-reduces of
    B x S x H per block forward and 2 backward; all-gather + reduce-scatter pairs under SP) or
    ``outside blocks`` (embedding, head, final norm, loss). Under SP the norm weights' gradient all-reduces
    run inside backward (FSDP's post-backward hook finishes them before its reduce-scatter).
    The ``alternative`` embedding plan replaces the outside rows: forward, an all-gather of B x S x H (the
    embedding's hidden-size shards) and an all-reduce of the B x S x V logits (the head's partial sums);
    backward, an all-gather of B x S x H (the head's input gradient); no loss_parallel reductions.

    **dp** (FSDP2 over the ``dp`` ranks holding the same TP slice): per unit (each block, and the root),
    an all-gather of the unit's TP-local parameters before forward, another before backward
    (``reshard_after_forward``), and a reduce-scatter of its gradients. Groups of one rank carry nothing:
    no rows for a dimension of size 1.

    ``bytes_per_element`` is the size of an activation and of a gathered weight (2 under bf16), and
    ``reduce_bytes_per_element`` that of a reduced gradient (FSDP's ``reduce_dtype``: 4 under the course's
    bf16 policy; by default the same as ``bytes_per_element``); ``loss_parallel``'s statistics are fp32 always.

    **replicate** (HSDP x TP, ``replicate`` > 1: FSDP on a (replicate, shard) mesh with ``dp`` the shard size):
    the batch splits over replicate x dp groups; FSDP's all-gathers and reduce-scatters stay inside a shard
    group, and each rank all-reduces its reduced gradient shard (1/dp of the unit) with its peers of the other
    replicas, once per unit.
    """
    reduce_bytes = reduce_bytes_per_element or bytes_per_element
    from distlab.tensor_parallel import tp_comm_formula

    rows: dict[tuple, dict] = {}

    def add(dimension, phase, where, collective, calls, payload_each):
        key = (dimension, phase, where, collective)
        row = rows.setdefault(key, {"dimension": dimension, "phase": phase, "where": where,
                                    "collective": collective, "calls": 0, "payload_bytes": 0})
        row["calls"] += calls
        row["payload_bytes"] += calls * payload_each

    if tp > 1:
        replica_batch = batch // (dp * replicate)
        activation = replica_batch * seq_len * cfg.dim * bytes_per_element
        for row in tp_comm_formula(cfg, replica_batch, seq_len, tp, sequence_parallel=sequence_parallel,
                                   bytes_per_element=bytes_per_element):
            if embedding_plan == "alternative" and row["where"] != "blocks":
                continue  # written below
            if row["where"] == "norm weights":  # 2 per block, and the final norm
                # partial sums of the norm weights' gradients, reduced in the compute dtype by FSDP's hook before
                # it casts them to reduce_dtype (measured: 2 bytes a number under bf16)
                add("tp", "backward", "blocks", row["collective"], 2 * cfg.n_layers, cfg.dim * bytes_per_element)
                add("tp", "backward", "outside blocks", row["collective"], 1, cfg.dim * bytes_per_element)
                continue
            where = "blocks" if row["where"] == "blocks" else "outside blocks"
            add("tp", row["phase"], where, row["collective"], row["calls"], row["payload_bytes"] // row["calls"])
        if embedding_plan == "alternative":
            add("tp", "forward", "outside blocks", "all_gather", 1, activation)
            add("tp", "forward", "outside blocks", "all_reduce", 1,
                replica_batch * seq_len * cfg.vocab_size * bytes_per_element)
            add("tp", "backward", "outside blocks", "all_gather", 1, activation)
    if dp > 1:
        units = fsdp_unit_params(cfg, tp, embedding_plan, dp)
        for unit, count in (("block", cfg.n_layers), ("root", 1)):
            unit_bytes = units[unit] * bytes_per_element
            # a unit is recognised by its size when measured: a root as large as a block counts as one
            where = "blocks" if unit == "block" or units["root"] == units["block"] else "root"
            add("dp", "forward", where, "all_gather", count, unit_bytes)
            if reshard_after_forward:
                add("dp", "backward", where, "all_gather", count, unit_bytes)
            add("dp", "backward", where, "reduce_scatter", count, units[unit] * reduce_bytes)
    if replicate > 1:
        units = fsdp_unit_params(cfg, tp, embedding_plan, dp)
        for unit, count in (("block", cfg.n_layers), ("root", 1)):
            where = "blocks" if unit == "block" or units["root"] == units["block"] else "root"
            add("replicate", "backward", where, "all_reduce", count, units[unit] // dp * reduce_bytes)
    return list(rows.values())


def measured_fsdp_tp_comm_rows(calls, cfg, tp: int, embedding_plan: str = "usual",
                               bytes_per_element: int = 4, dp: int = 1,
                               reduce_bytes_per_element: int | None = None) -> list:
    """Group the collectives a :class:`distlab.comm.ModuleCommCounter` recorded into the rows of
    :func:`fsdp_tp_comm_formula`.

    The mesh dimension comes from who issued the call: FSDP2 calls ``torch.distributed`` collectives on
    its dp group (``source == "c10d"``), DTensor issues functional collectives on the tp group. Calls on a
    group of one rank move nothing and are left out. A TP call is in ``blocks`` when a block's module
    issued it. An FSDP call's unit is read from its size (a block's or the root's TP-local parameters),
    not from the module running at the time: FSDP prefetches, gathering the next unit's weights while
    the current one computes. A size that is neither becomes a row of its own, ``unknown unit``.
    """
    unit_params = fsdp_unit_params(cfg, tp, embedding_plan, dp)
    reduce_bytes = reduce_bytes_per_element or bytes_per_element
    units = {(collective, unit_params[unit] * size): where
             for collective, size in (("all_gather", bytes_per_element), ("reduce_scatter", reduce_bytes))
             for unit, where in (("root", "root"), ("block", "blocks"))}
    # HSDP: FSDP's only all-reduce is of a reduced gradient shard (1/dp of the unit) across the replicas
    units.update({("all_reduce", unit_params[unit] // dp * reduce_bytes): where
                  for unit, where in (("root", "root"), ("block", "blocks"))})
    rows: dict[tuple, dict] = {}
    for call in calls:
        if call.group_size == 1:
            continue
        if call.source == "c10d":
            dimension = "replicate" if call.collective == "all_reduce" else "dp"
            where = units.get((call.collective, call.payload_bytes), "unknown unit")
        else:
            dimension = "tp"
            where = "blocks" if ".layers." in f".{call.module}." else "outside blocks"
        key = (dimension, call.phase, where, call.collective)
        row = rows.setdefault(key, {"dimension": dimension, "phase": call.phase, "where": where,
                                    "collective": call.collective, "calls": 0, "payload_bytes": 0})
        row["calls"] += 1
        row["payload_bytes"] += call.payload_bytes
    return list(rows.values())


def join_fsdp_tp_comm_rows(measured: list, formula: list, dp: int, tp: int, replicate: int = 1) -> list:
    """One row per (dimension, phase, where, collective) found in either list, measured beside formula,
    with the bytes each rank sends on a ring over that dimension's group (``sent_bytes_per_rank_derived``:
    the ring model applied to the measured payload): ``tensor_parallel.join_comm_rows`` with a group per row."""
    from distlab.tensor_parallel import join_comm_rows

    sizes = {"dp": dp, "tp": tp, "replicate": replicate}
    return join_comm_rows(measured, formula, lambda row: sizes[row["dimension"]],
                          keys=("dimension", "phase", "where", "collective"))


def mesh_group_problems(mesh, rank: int, shape, names: dict | None = None) -> list:
    """Where this rank's process groups, read from the DeviceMesh itself (``mesh.get_group(dim)``), differ from
    the grid arithmetic of :func:`groups_of_rank` (empty: they agree). ``mesh`` has named dimensions among
    ``pp``, ``dp``, ``tp``, or others mapped onto them by ``names`` (HSDP's ``{"replicate": "dp", "shard":
    "tp"}``); ``shape`` is the job's (pp, dp, tp). A mesh built in another order (``(tp, dp)`` instead of
    ``(dp, tp)``) puts TP across nodes and every numeric check still passes; this one does not."""
    import torch.distributed as dist

    expected = groups_of_rank(rank, shape)
    names = names or {}
    problems = []
    for dim in mesh.mesh_dim_names:
        read = dist.get_process_group_ranks(mesh.get_group(dim))
        want = expected[names.get(dim, dim)]
        if read != want:
            problems.append(f"rank {rank}: its {dim} group from the mesh is {read}, the grid says {want}")
    return problems


def every_rank_agrees(problems: list, group=None) -> list:
    """Every rank's problems gathered onto every rank (an object all-gather): one rank's wrong group fails the
    check wherever the report is written."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problems, group=group)
    return [p for rank_problems in gathered for p in rank_problems]


def data_of_rank(rank: int, shape, batch: int) -> dict:
    """What ``rank`` of a (pp, dp, tp) job reads of each step's global batch of ``batch`` sequences, as chapter 09's
    scripts feed it (``common_hybrid_pipeline.replica_batch``: ``data.shard_rows`` by the dp coordinate):

    * ``rows``: the replica's contiguous rows, ``batch / dp`` of them: the same for every TP rank of a replica
      (TP splits the weights, not the batch), different across dp;
    * ``inputs``: only the first pipeline stage reads token ids; the others receive activations from the stage
      before them;
    * ``labels``: only the last stage reads the targets, for the loss."""
    sizes = _shape_dict(shape)
    where = grid_coordinates(rank, sizes)
    per_replica = batch // sizes["dp"]
    first, last = where["pp"] == 0, where["pp"] == sizes["pp"] - 1
    rows = range(where["dp"] * per_replica, (where["dp"] + 1) * per_replica)
    return {"rank": rank, **where, "rows": rows,
            "inputs": "token ids" if first else f"activations from stage {where['pp'] - 1}",
            "labels": "targets" if last else "none"}


def config_difference(saved: dict, wanted: dict) -> str:
    """The settings two model configurations disagree on, as ``name saved -> wanted`` (for a one-line error)."""
    keys = sorted(set(saved) | set(wanted))
    return ", ".join(f"{k} {saved.get(k)} -> {wanted.get(k)}" for k in keys if saved.get(k) != wanted.get(k))


# ---- precision: fp32 where a run is compared exactly, bf16 where it is meant to be fast --------------------------

PRECISIONS = ("fp32", "bf16")


def add_precision_flag(parser) -> None:
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="fp32 (default for tiny: checks exact to rounding) or bf16 (default for a100): bf16 "
                             "weights all-gathered and computed, gradients reduced and AdamW run in fp32")


def resolve_precision(args) -> str:
    """``args.precision`` filled in from the preset: what the chapter's tables assume on the cluster (bf16), and
    exact comparisons on a laptop (fp32)."""
    if args.precision is None:
        args.precision = "bf16" if args.preset == "a100" else "fp32"
    return args.precision


def precision_bytes(precision: str) -> dict:
    """Bytes of one number in each kind of traffic under ``precision`` (the course's policy, below):
    activations and gathered weights in the compute dtype, reduced gradients in fp32."""
    compute = 2 if precision == "bf16" else 4
    return {"bytes_per_element": compute, "reduce_bytes_per_element": 4}


def mixed_precision_policy(precision: str, root: bool = False):
    """FSDP2's policy for ``precision``: under bf16 each unit all-gathers and computes in bf16 and
    reduce-scatters its gradients in fp32 (``reduce_dtype``), and the sharded weights AdamW updates stay fp32.
    The root also hands back its output (the logits) in fp32, so the loss is computed in fp32."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                output_dtype=torch.float32 if root else None)


@contextlib.contextmanager
def quiet_redistribution():
    """Gathering a 2-D sharded weight whole (FSDP over dp and TP) takes one all-gather per mesh dimension, and
    torch warns that this is "suboptimal" each time. A check that gathers once per parameter does it on purpose:
    the warning is silenced inside the block."""
    import logging

    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
