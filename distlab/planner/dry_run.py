"""The chosen layout built at its full world size, in one process: ``plan.py --dry-run``.

On a fake process group (``torch.testing._internal.distributed.fake_pg``: every collective returns at once and
moves nothing) and on the meta device (shapes, no storage), for a rank of the first, a middle and the last pipeline
stage, at the layout's full world size:

1. DeviceMesh ``(pp, dp, tp)`` (``(pp, dp, cp, tp)`` with CP) is built and every sampled rank's groups and
   coordinates are checked against chapter 09's grid arithmetic (:func:`check_mesh`);
2. the course's model (``distlab.models.Transformer``, with the layout's grouped-query attention) is cut into
   that rank's pipeline stage by chapter 07's ``transformer_stage`` and parallelized by chapter 09's
   ``hybrid_3d.parallelize_stage``: chapter 06's TP plan on ``mesh["tp"]``, then ``fully_shard`` over the
   data-parallel ranks (dp x cp: CP ranks hold the same weights and shard them too);
3. a real AdamW step runs on the meta shards, and the rank's parameter, gradient and optimizer-state bytes are
   read from its DTensor local shards, then compared with the planner's ``state_bytes``.

How each ZeRO stage is read: FSDP2 implements ZeRO-3 only, so the stage is built twice, TP alone (what DDP and
ZeRO-1/2 keep whole on every data-parallel rank) and TP + ``fully_shard`` (each rank's 1/dp shard). Parameters are
read from the sharded build under ZeRO-3 and from the TP build otherwise; gradients from the sharded build under
ZeRO-2 and 3; optimizer state from the sharded build under ZeRO-1 to 3. The model is built in fp32 (the master
weights); mixed precision's accounting (``memory.training_state_bytes``) is then applied to the bytes read:
parameters and gradients in bf16 are half the fp32 shards', the optimizer holds AdamW's two moments (read from the
optimizer after its step) plus the fp32 master weights (the fp32 shards). Where the planner keeps weights or
gradients in fp32 instead (DDP under autocast, ZeRO-1's and Megatron's fp32 gradients:
``planner.memory.fp32_weights_and_gradients``), they are read whole, and fp32 weights need no master copy. FSDP2 splits a tensor's first dimension
in ceil(n / dp) rows, so the first ranks may hold a little more than 1/dp of it: that padding is counted and
named, and the planner's bytes plus the padding must equal what the shards hold.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from distlab import hybrid, memory, models
from distlab.planner.memory import fp32_weights_and_gradients, in_mixed_precision, state_bytes
from distlab.planner.spec import Layout, ModelSpec, Options

GIB = memory.GIB
REPO = Path(__file__).resolve().parents[2]


def mesh_shape(layout: Layout) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The DeviceMesh of a layout, outermost first: (pp, dp, tp); with CP (pp, dp, cp, tp); under HSDP
    (pp, replicate, dp, tp), dp being the shard group (inside: a node's ranks) and replicate the copies of it."""
    if layout.shard:
        return ("pp", "replicate", "dp", "tp"), (layout.pp, layout.replicas, layout.shard, layout.tp)
    if layout.cp > 1:
        return ("pp", "dp", "cp", "tp"), (layout.pp, layout.dp, layout.cp, layout.tp)
    return hybrid.DIMENSIONS, (layout.pp, layout.dp, layout.tp)


def check_mesh(layout: Layout, sample: int = 64) -> list[int]:
    """DeviceMesh (pp, dp, tp), or (pp, dp, cp, tp) with CP, on a fake process group for sampled ranks of the
    world; the ranks whose groups or coordinates differ from ``distlab.hybrid``'s grid (empty: the mesh
    arithmetic holds). With CP the grid is chapter 09's (pp, dp x cp, tp): DeviceMesh's dp and cp groups are
    the strided and the consecutive parts of its dp x cp group (cp varies faster, as it is nearer tp)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, grid = layout.gpus, (layout.pp, layout.dp * layout.cp, layout.tp)
    names, shape = mesh_shape(layout)
    # the grid's dp group split in two (CP, or HSDP): the outer part strided, the inner part consecutive
    split = {4: (names[1], names[2], shape[2])}.get(len(names))
    step = max(1, world // sample)
    ranks = sorted(set(range(0, world, step)) | {world - 1})
    wrong = []
    for rank in ranks:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            theirs = {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in names}
            coordinates = dict(zip(names, mesh.get_coordinate()))
            expected, where = hybrid.groups_of_rank(rank, grid), hybrid.grid_coordinates(rank, grid)
            if split:
                outer, inner, n = split
                both, index = expected["dp"], where["dp"]  # the whole dp group, and this rank's place in it
                expected = {"pp": expected["pp"], outer: both[index % n::n],
                            inner: both[index - index % n:index - index % n + n], "tp": expected["tp"]}
                where = {"pp": where["pp"], outer: index // n, inner: index % n, "tp": where["tp"]}
            if theirs != expected or coordinates != where:
                wrong.append(rank)
        finally:
            dist.destroy_process_group()
    print(f"dry run: DeviceMesh ({', '.join(names)}) = {shape} built on a fake process group of {world} ranks for "
          f"{len(ranks)} of them; groups and coordinates = distlab.hybrid's grid: "
          f"{'every one' if not wrong else f'NOT for ranks {wrong[:8]}'}")
    return wrong


def _chapter_code(with_plan: bool = False):
    """Chapter 07's ``transformer_stage`` and chapter 09's ``parallelize_stage`` (and, ``with_plan``, its
    ``stage_tp_plan``), imported from their scripts."""
    for folder in ("07_pipeline_parallel", "09_hybrid_parallel"):
        path = str(REPO / "scripts" / folder)
        if path not in sys.path:
            sys.path.insert(0, path)
    with contextlib.redirect_stderr(io.StringIO()):
        common_pipeline = importlib.import_module("common_pipeline")
        hybrid_3d = importlib.import_module("hybrid_3d")
    if with_plan:
        return common_pipeline.transformer_stage, hybrid_3d.parallelize_stage, hybrid_3d.stage_tp_plan
    return common_pipeline.transformer_stage, hybrid_3d.parallelize_stage


def course_config(spec: ModelSpec) -> models.TransformerConfig:
    """The course's transformer of ``spec``'s sizes (LLaMA-style; grouped-query attention kept)."""
    if spec.architecture != "llama":
        raise ValueError(f"the dry run builds the course's LLaMA-style transformer; {spec.name} is "
                         f"{spec.architecture!r} (LayerNorm, biases, tied output): evaluate it without --dry-run")
    return replace(spec.config(), n_kv_heads=spec.kv_heads, seq_len=min(spec.seq_len, 16))


def _shard_bytes_of(tensor) -> int:
    """Bytes of this rank's piece of ``tensor``: a DTensor's local shard, or the tensor itself."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _shard_bytes(module) -> int:
    """fp32 bytes of this rank's parameter shards."""
    return sum(_shard_bytes_of(p) for p in module.parameters())


def _measured_state(unsharded, sharded, zero_stage: int, precision: str, fp32_grads: bool = False,
                    fp32_weights: bool = False) -> tuple[dict, dict]:
    """The training state one rank holds under ZeRO stage ``zero_stage``, read off two builds of the same modules
    (the module docstring says how): parameters, gradients and master weights from the unsharded or the sharded
    build, AdamW's moments from a real step on the meta shards. Returns the bytes by part and the fp32 bytes of
    each build (``{"tp", "sharded"}``). In mixed precision the bf16 parts are half the fp32 shards read, the
    gradients too unless ``fp32_grads`` (an fp32 gradient buffer), the weights unless ``fp32_weights`` (autocast
    over fp32 weights, which need no master copy: ``memory.fp32_weights_and_gradients``)."""
    import torch

    built = {"tp": _shard_bytes(unsharded), "sharded": _shard_bytes(sharded)}
    source = sharded if zero_stage >= 1 else unsharded
    for p in source.parameters():
        p.grad = torch.empty_like(p)
    optimizer = torch.optim.AdamW(source.parameters(), lr=1e-4, foreach=False)
    with contextlib.redirect_stderr(io.StringIO()):
        optimizer.step()
    moments = sum(_shard_bytes_of(v) for state in optimizer.state.values() for v in state.values()
                  if hasattr(v, "dim") and v.dim() > 0)
    params32 = built["sharded"] if zero_stage >= 3 else built["tp"]
    grads32 = built["sharded"] if zero_stage >= 2 else built["tp"]
    master32 = built["sharded"] if zero_stage >= 1 else built["tp"]
    if precision == "fp32":
        return {"params": params32, "grads": grads32, "optimizer": moments}, built
    return {"params": params32 if fp32_weights else params32 / 2, "grads": grads32 if fp32_grads else grads32 / 2,
            "optimizer": moments + (0 if fp32_weights else master32)}, built


def dry_run_rank(spec: ModelSpec, layout: Layout, options: Options, rank: int, full_model=None) -> dict:
    """One rank: its stage built at the full world size on the fake process group, bytes read and compared."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    transformer_stage, parallelize_stage = _chapter_code()
    data_parallel = layout.dp * layout.cp      # the ranks that hold the same weights
    ways = layout.fsdp_ways                    # the ranks their shards are spread over (HSDP: the shard group)
    world = layout.gpus
    coordinates = hybrid.grid_coordinates(rank, (layout.pp, data_parallel, layout.tp))
    stage = coordinates["pp"]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        if layout.shard:   # FSDP over mesh["replicate", "dp"]: HSDP (parallelize_stage sees the replicate dim)
            names, shape = mesh_shape(layout)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        else:
            mesh = init_device_mesh("cpu", (layout.pp, data_parallel, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
        if full_model is None:
            with torch.device("meta"):
                full_model = models.Transformer(course_config(spec))
        quiet = contextlib.redirect_stderr(io.StringIO())
        with quiet:
            tp_only = parallelize_stage(transformer_stage(full_model, stage, layout.pp),
                                        SimpleNamespace(tp=layout.tp, dp=1, precision="fp32"), mesh)
            sharded = parallelize_stage(transformer_stage(full_model, stage, layout.pp),
                                        SimpleNamespace(tp=layout.tp, dp=data_parallel, precision="fp32"), mesh)
        fp32_weights, fp32_grads = fp32_weights_and_gradients(layout, options)
        measured, built = _measured_state(tp_only, sharded, layout.zero_stage, options.precision, fp32_grads,
                                          fp32_weights)
    finally:
        dist.destroy_process_group()
    planned = state_bytes(spec, layout, stage, options)
    planner_bytes = {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer}
    # what FSDP2's ceil split adds on this rank beyond an exact 1/ways of its TP shards (negative on the last
    # ranks, which hold fewer rows), per part (in the part's bytes per fp32 byte)
    pad32 = built["sharded"] - built["tp"] / ways
    scale = {"params": (0.5 if options.precision != "fp32" else 1) * (layout.zero_stage >= 3),
             "grads": (0.5 if options.precision != "fp32" and not fp32_grads else 1) * (layout.zero_stage >= 2),
             "optimizer": (2 + (options.precision != "fp32")) * (layout.zero_stage >= 1)}
    padding = {part: pad32 * scale[part] for part in measured}
    equal = all(math.isclose(measured[part], planner_bytes[part] + padding[part], rel_tol=1e-9, abs_tol=1)
                for part in measured)
    return {"rank": rank, "stage": stage, "coordinates": coordinates, "measured": measured,
            "planner": planner_bytes, "padding_bytes": padding, "equal": equal}


def sampled_ranks(layout: Layout) -> list[int]:
    """A rank of the first, a middle and the last pipeline stage; at dp and tp coordinate 0 (and
    the last dp rank, whose shards a ceil split makes smallest)."""
    ways = layout.dp * layout.cp
    stages = sorted({0, layout.pp // 2, layout.pp - 1})
    ranks = [hybrid.grid_rank({"pp": s, "dp": 0, "tp": 0}, (layout.pp, ways, layout.tp)) for s in stages]
    ranks.append(hybrid.grid_rank({"pp": layout.pp - 1, "dp": ways - 1, "tp": layout.tp - 1},
                                  (layout.pp, ways, layout.tp)))
    return sorted(set(ranks))


def dry_run(spec: ModelSpec, layout: Layout, options: Options = Options(), gpus: int | None = None) -> dict:
    """The layout at its full world size (see the module's docstring): the mesh check and every sampled rank."""
    import torch

    if gpus is not None and gpus != layout.gpus:
        raise ValueError(f"the layout {layout.label()} has {layout.gpus} GPUs, not {gpus}")
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        mesh_ok = not check_mesh(layout, sample=16)
    with torch.device("meta"):
        full_model = models.Transformer(course_config(spec))
    ranks = [dry_run_rank(spec, layout, options, rank, full_model) for rank in sampled_ranks(layout)]
    return {"world": layout.gpus, "layout": layout.label(), "model": spec.name, "mesh_ok": mesh_ok, "ranks": ranks,
            "equal": mesh_ok and all(r["equal"] for r in ranks), "seconds": time.perf_counter() - start}


def dry_run_markdown(result: dict) -> str:
    """The ranks' bytes, read from their fp32 shards (bf16 parts halved), beside the planner's (GiB), one row a
    rank."""
    lines = [f"| rank of {result['world']:,} | stage | from its fp32 shards (bf16 parts halved): params + grads + "
             "optimizer (GiB) | "
             "the planner's (GiB) | FSDP padding (bytes) | measured = planner's + padding |",
             "|---:|---:|---|---|---:|---|"]
    for r in result["ranks"]:
        seen = " + ".join(f"{r['measured'][p] / GIB:.3f}" for p in ("params", "grads", "optimizer"))
        planned = " + ".join(f"{r['planner'][p] / GIB:.3f}" for p in ("params", "grads", "optimizer"))
        lines.append(f"| {r['rank']:,} | {r['stage']} | {seen} | {planned} | "
                     f"{sum(r['padding_bytes'].values()):,.0f} | {'yes' if r['equal'] else 'NO'} |")
    return "\n".join(lines)


def stand_in(spec: ModelSpec) -> ModelSpec:
    """A GPT-architecture spec as the course's LLaMA-style model of the same depth, width, heads and vocabulary
    (the dry run builds only the course's model): the layout's world size, mesh and shards are the real ones,
    the per-parameter details (biases, LayerNorm, a 4h GELU MLP for SwiGLU's 3 matrices) are not."""
    if spec.architecture == "llama":
        return spec
    return replace(spec, architecture="llama", kv_heads=spec.heads, ffn=spec.ffn, name=f"{spec.name} (LLaMA-style stand-in)")


def dry_run_published(run) -> dict:
    """A published run's layout at its full world size (``run`` has .model, .layout, .options): the planner asked
    about the model that is built (a LLaMA-style stand-in for a GPT architecture, say so)."""
    result = dry_run(stand_in(run.model), run.layout, run.options)
    result["stand_in"] = run.model.architecture != "llama"
    return result


# ------------------------------------------------------------------------------------------------
# Expert parallelism at the full world size (a MoE layout)
# ------------------------------------------------------------------------------------------------


def expert_mesh_shape(layout: Layout) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The planner's order for a MoE layout: dp split into (expert_dp, ep_dp); an EP group is ep_dp consecutive dp
    ranks with all their cp and tp ranks (torchtitan's ep = ep_dp x cp x tp)."""
    return (("pp", "expert_dp", "ep_dp", "cp", "tp"),
            (layout.pp, layout.dp // layout.ep_dp, layout.ep_dp, layout.cp, layout.tp))


def dry_run_experts(spec: ModelSpec, layout: Layout, cluster, options: Options = Options()) -> dict:
    """A MoE layout's expert parallelism built at its full world size on a fake process group, for a rank of the
    first stage that holds MoE blocks, of a middle one and of the last:

    1. DeviceMesh (pp, expert_dp, ep_dp, cp, tp): the rank's EP group read from the mesh (its ep_dp, cp and tp
       dimensions flattened into one group, as torchtitan's ``parallel_dims.py`` builds EP without expert TP), its
       nodes counted (``cluster.gpus_per_node`` ranks a node) against the planner's
       (``communication.ep_ranks_in_node``; whether it crosses nodes);
    2. one MoE block of the model's sizes on the meta device, spread over that EP group by chapter 13's
       ``moe.ExpertParallelMoE``: the experts it keeps x the stage's MoE blocks = the planner's
       ``stage_params(...)["experts"]``; its router and shared experts = the planner's MoE block's;
    3. the experts' ZeRO: ``fully_shard`` of those experts over ``mesh["expert_dp"]`` (each expert's rows when a
       rank holds fewer experts than that group has ranks) and a real AdamW step on the meta shards, read as
       :func:`dry_run_rank` reads a stage = ``memory.zero_state_bytes`` of the planner's
       expert parameters over ``layout.expert_dp``.

    Attention is not built (DeepSeek's MLA is not the course's), nor TP's side of the blocks."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlab import moe
    from distlab.planner.communication import crosses_nodes, ep_ranks_in_node
    from distlab.planner.memory import stage_params
    from distlab.planner.spec import stage_layer_kinds

    if not spec.is_moe or layout.ep < 2:
        raise ValueError("the expert dry run builds EP layouts of a MoE model")
    start = time.perf_counter()
    names, shape = expert_mesh_shape(layout)
    stages = [s for s in range(layout.pp) if stage_layer_kinds(spec, layout.pp, s)[1]]
    sampled = sorted({stages[0], stages[len(stages) // 2], stages[-1]})
    layer_cfg = moe.MoEConfig(dim=spec.hidden, ffn_hidden=spec.expert_ffn, num_experts=spec.experts,
                              top_k=spec.top_k, shared_expert=spec.shared_experts > 0)
    if spec.shared_experts > 1:
        raise ValueError("chapter 13's layer has at most one shared expert")
    with torch.device("meta"):
        full_layer = moe.MoE(layer_cfg)
    in_node = ep_ranks_in_node(layout, cluster)
    rows = []
    for stage in sampled:
        rank = stage * (layout.gpus // layout.pp)      # the stage's first rank
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.gpus)
        try:
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
            group = mesh["ep_dp", "cp", "tp"]._flatten("ep").get_group()
            members = dist.get_process_group_ranks(group)
            per_node = {}
            for r in members:
                per_node[r // cluster.gpus_per_node] = per_node.get(r // cluster.gpus_per_node, 0) + 1
            layer = moe.ExpertParallelMoE(full_layer, group)
            experts = sum(p.numel() for p in layer.experts.parameters())
            replicated = {"router": sum(p.numel() for p in layer.router.parameters()),
                          "shared": sum(p.numel() for p in layer.shared.parameters()) if layer.shared else 0}
            unsharded = copy.deepcopy(layer.experts)
            quiet = contextlib.redirect_stderr(io.StringIO())
            # FSDP shards dim 0, here the experts: fewer of them than ranks would leave some ranks all and others
            # none, so those shard each expert's rows instead (torchtitan's shard_placement_fn does the same)
            ways = layout.expert_dp
            with quiet:
                fully_shard(layer.experts, mesh=mesh["expert_dp"],
                            shard_placement_fn=lambda p: Shard(0) if p.shape[0] % ways == 0 else Shard(1))
            measured, _ = _measured_state(unsharded, layer.experts, layout.zero_stage, options.precision,
                                          *reversed(fp32_weights_and_gradients(layout, options)))
        finally:
            dist.destroy_process_group()
        blocks = stage_layer_kinds(spec, layout.pp, stage)[1]
        measured = {part: value * blocks for part, value in measured.items()}
        planned_experts = stage_params(spec, layout, stage)["experts"]
        planned = in_mixed_precision(memory.zero_state_bytes(planned_experts, layout.expert_dp, layout.zero_stage,
                                                             options.precision), layout, options)
        planner_bytes = {"params": planned.params, "grads": planned.grads, "optimizer": planned.optimizer}
        moe_block = spec.block_params(moe=True)
        row = {"rank": rank, "stage": stage, "moe_blocks": blocks, "ep_group_nodes": len(per_node),
               "ep_ranks_per_node": max(per_node.values()), "planner_ep_ranks_per_node": in_node,
               "planner_crosses_nodes": crosses_nodes(layout, "ep", cluster),
               "experts_on_rank": experts * blocks, "planner_experts_on_rank": planned_experts,
               "router": replicated["router"], "planner_router": moe_block["replicated"] - 2 * spec.hidden,
               "shared": replicated["shared"], "planner_shared": spec.shared_experts * spec.expert_params(),
               "measured": measured, "planner": planner_bytes}
        row["equal"] = (row["ep_ranks_per_node"] == in_node and row["planner_crosses_nodes"] == (len(per_node) > 1)
                        and row["experts_on_rank"] == planned_experts and row["router"] == row["planner_router"]
                        and row["shared"] == row["planner_shared"]
                        and all(math.isclose(measured[k], planner_bytes[k], rel_tol=1e-9) for k in measured))
        rows.append(row)
    return {"world": layout.gpus, "layout": layout.label(), "model": spec.name, "ranks": rows,
            "equal": all(r["equal"] for r in rows), "seconds": time.perf_counter() - start}


def dry_run_experts_markdown(result: dict) -> str:
    lines = ["| rank | stage | MoE blocks | EP group: nodes, ranks a node (planner) | experts' parameters on the rank "
             "(planner) | their state, GiB: params, grads, optimizer (planner) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["ranks"]:
        gib = ", ".join(f"{r['measured'][k] / GIB:.2f}" for k in ("params", "grads", "optimizer"))
        planned = ", ".join(f"{r['planner'][k] / GIB:.2f}" for k in ("params", "grads", "optimizer"))
        lines.append(f"| {r['rank']:,} | {r['stage']} | {r['moe_blocks']} | {r['ep_group_nodes']}, "
                     f"{r['ep_ranks_per_node']} ({r['planner_ep_ranks_per_node']}) | {r['experts_on_rank']:,} "
                     f"({r['planner_experts_on_rank']:,.0f}) | {gib} ({planned}) |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# One training step's collectives at the full world size (forward and backward of one microbatch)
# ------------------------------------------------------------------------------------------------
#
# Meta tensors do not run a step through FSDP2: ``fully_shard`` refuses parameters left on meta at its lazy
# init (``FSDPParamGroup._validate_no_meta_params``) and all-gathers into buffers on the mesh's device. So the
# step runs on real CPU tensors of a *narrow* copy of the model: the same depth, heads, KV heads and layout, at the
# same full world size, with a head size of 8 (the widths change, the collectives' number and place do not). The
# planner is asked about the same narrow model: its calls must equal the counted ones, and its bytes the counted
# ones less FSDP's ceil-split padding, which is computed from the TP shards' shapes and named.

NARROW_HEAD_DIM = 8


def narrow_spec(spec: ModelSpec, layout: Layout) -> ModelSpec:
    """``spec`` with a head size of 8 (heads, KV heads and layers kept), a vocabulary of 64 rows a TP rank, 16
    tokens, one sequence a microbatch and one microbatch a step: small enough to run a stage on a CPU."""
    hidden = spec.heads * NARROW_HEAD_DIM
    ffn = math.ceil(spec.ffn / spec.hidden * hidden / layout.tp) * layout.tp
    return replace(spec, hidden=hidden, ffn=ffn, vocab=64 * layout.tp, seq_len=16, micro_batch=1,
                   global_batch=layout.dp, architecture="llama", name=f"{spec.name}, narrowed")


# what the counted step runs: FSDP2 over dp with the weights kept gathered (as chapter 09's hybrid_3d.py), no SP,
# no recomputation, fp32, one microbatch
COUNTED_OPTIONS = Options(zero_stage=3, activation_checkpointing="none", sequence_parallel=False, precision="fp32",
                          fsdp_keep_gathered=True, search_micro_batch=False, chunks=1)


def _count_stage(job: tuple) -> dict:
    """In a fresh (forked) process: one stage's forward and backward of one microbatch on the fake process group,
    its collectives counted per mesh dimension (DTensor's functional collectives are TP's, c10d's are FSDP's)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlab import comm

    spec, layout, rank = job
    torch.set_num_threads(1)
    transformer_stage, _, stage_tp_plan = _chapter_code(with_plan=True)
    coordinates = hybrid.grid_coordinates(rank, (layout.pp, layout.dp, layout.tp))
    stage, last = coordinates["pp"], coordinates["pp"] == layout.pp - 1
    cfg = replace(spec.config(), n_kv_heads=spec.kv_heads)
    with torch.device("meta"):
        full = models.Transformer(cfg)
    part = transformer_stage(full, stage, layout.pp).to_empty(device="cpu")  # values do not matter: nothing moves
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.gpus)
    try:
        names, shape = mesh_shape(layout)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        fsdp_mesh = mesh["replicate", "dp"] if layout.shard else mesh["dp"]   # HSDP: shard on dp, replicate across
        ways = layout.fsdp_ways
        if layout.tp > 1:
            # chapter 09's stage plan with the head's logits kept split for loss_parallel (what the planner's TP
            # rows count; hybrid_3d.py gathers them instead, for torch's pipeline schedule)
            parallelize_module(part, mesh["tp"], stage_tp_plan(part, gather_logits=False))
        # FSDP2 splits each TP shard's first dimension in ceil(rows / dp) rows a rank: the padding is known
        shards = [p.to_local() if hasattr(p, "to_local") else p for p in part.parameters()]
        exact = sum(t.numel() * t.element_size() for t in shards)
        padded = memory.fsdp_padded_bytes(shards, ways)
        if layout.dp > 1:  # as chapter 09's parallelize_stage: a dimension of size 1 is left out
            for block in part.layers.values():
                fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=False)
            fully_shard(part, mesh=fsdp_mesh, reshard_after_forward=False)
        inputs = (torch.randint(0, cfg.vocab_size, (1, cfg.seq_len)) if stage == 0
                  else torch.randn(1, cfg.seq_len, cfg.dim, requires_grad=True))
        with comm.CommCounter() as counter, loss_parallel():
            out = part(inputs)
            if last:
                models.lm_loss(out, torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))).backward()
            else:
                out.backward(torch.ones_like(out))  # the gradient the next stage would send back
    finally:
        dist.destroy_process_group()
    counted: dict = {}
    for call in counter.calls:
        # DTensor's functional collectives are TP's; FSDP's are c10d's: under HSDP its all-reduce is the replicas'
        dimension = ("tp" if call.source == "functional" else
                     "replicate" if layout.shard and call.collective == "all_reduce" else "dp")
        entry = counted.setdefault(dimension, {}).setdefault(call.collective, {"payload": 0, "calls": 0})
        entry["payload"] += call.payload_bytes
        entry["calls"] += 1
    return {"rank": rank, "stage": stage, "counted": counted, "padding_bytes": padded - exact}


def count_step(spec: ModelSpec, layout: Layout, ranks: list[int] | None = None) -> dict:
    """One step of one microbatch at ``layout``'s full world size under FSDP (ZeRO-3), for a rank of the first, a
    middle and the last pipeline stage, each in a forked process (torch caches DTensor's plans by mesh, which
    outlive a destroyed process group): its TP and FSDP collectives counted and compared with the planner's ledger
    of the same narrow model. Equal: every call
    count equal; TP bytes equal; FSDP bytes = the planner's + the named padding (for each of all-gather and
    reduce-scatter)."""
    import multiprocessing

    from distlab.planner.communication import ledger

    if layout.cp > 1:
        raise ValueError("the counted step covers pp x dp x tp layouts (context parallelism: chapter 08's scripts)")
    layout = replace(layout, zero_stage=3)  # what FSDP2 builds (ZeRO-1/2 move the same bytes in other calls)
    narrow = narrow_spec(spec, layout)
    ranks = sampled_ranks(layout) if ranks is None else ranks
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(processes=min(2, len(ranks)), maxtasksperchild=1) as pool:
        results = pool.map(_count_stage, [(narrow, layout, rank) for rank in ranks], chunksize=1)
    for r in results:
        planned = ledger(narrow, layout, r["stage"], COUNTED_OPTIONS)
        r["planner"] = {d: {name: dict(e) for name, e in planned[d].items()} for d in COUNTED_DIMENSIONS
                        if planned[d]}
        r["padding"] = {d: padding_of(d, r, layout) for d in COUNTED_DIMENSIONS}
        expected = {d: {name: {"calls": e["calls"], "payload": e["payload"] + r["padding"][d]}
                        for name, e in collectives.items()} for d, collectives in r["planner"].items()}
        r["equal"] = expected == r["counted"]
    return {"world": layout.gpus, "layout": layout.label(), "model": narrow.name, "ranks": results,
            "equal": all(r["equal"] for r in results), "seconds": time.perf_counter() - start}


COUNTED_DIMENSIONS = ("tp", "dp", "replicate")


def padding_of(dimension: str, rank_result: dict, layout: Layout) -> float:
    """FSDP's padding in a dimension's payload: the whole of it in dp's gathers and reduce-scatters, a shard's
    share in HSDP's all-reduce (of the gradient shard), none in TP's."""
    padding = rank_result["padding_bytes"]
    return {"dp": padding, "replicate": padding / max(layout.shard, 1)}.get(dimension, 0)


def count_step_markdown(result: dict) -> str:
    """Counted against the planner, one row a rank and mesh dimension: calls and bytes of each collective."""
    lines = [f"| rank of {result['world']:,} | stage | dimension | counted: calls, MiB | the planner's: calls, MiB "
             "| FSDP padding (MiB) | counted = planner's + padding |", "|---:|---:|---|---|---|---:|---|"]
    for r in result["ranks"]:
        for dimension in COUNTED_DIMENSIONS:
            counted, planned = r["counted"].get(dimension, {}), r["planner"].get(dimension, {})
            if dimension == "replicate" and not counted and not planned:
                continue   # not HSDP

            def show(collectives):
                return ", ".join(f"{name} {e['calls']} x, {e['payload'] / 2**20:.2f}"
                                 for name, e in sorted(collectives.items())) or "none"
            padding = r["padding"][dimension] / 2**20
            lines.append(f"| {r['rank']:,} | {r['stage']} | {dimension} | {show(counted)} | {show(planned)} | "
                         f"{padding:.2f} | {'yes' if r['equal'] else 'NO'} |")
    return "\n".join(lines)


def fsdp_buffers_counted(cfg: models.TransformerConfig, world: int, batch: int, mixed: bool,
                         reshard_after_forward: bool, steps: int = 2) -> dict:
    """FSDP2's buffers of one rank, counted by torch's own ``FSDPMemTracker``
    (``torch/distributed/_tools/fsdp2_mem_tracker.py``, which files every storage a TorchDispatchMode sees under
    the FSDP role it plays) at their peak in forward and in backward: ``{"forward": {...}, "backward": {...}}``,
    each ``{"gathered", "gradients", "reduce_scatter", "total"}`` in bytes.

    The course's transformer, sharded as chapter 05's ``train_fsdp.py`` shards it (``apply_fsdp``: each block, then
    the root), on a fake process group of ``world`` ranks, CPU tensors, ``batch`` sequences; ``mixed``: bf16
    compute, fp32 reduction. Gathered: the unsharded parameters and the all-gather outputs not yet copied out.
    Gradients: the unsharded ones, filed as such from the op that makes them (the tracker itself files them only at
    their unit's post-backward, which the root reaches last). The last of ``steps`` steps is read (the first
    initialises FSDP lazily)."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.testing._internal.distributed.fake_pg import FakeStore

    path = str(REPO / "scripts" / "05_fully_sharded")
    if path not in sys.path:
        sys.path.insert(0, path)
    with contextlib.redirect_stderr(io.StringIO()):
        apply_fsdp = importlib.import_module("train_fsdp").apply_fsdp
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch.manual_seed(0)
        model = apply_fsdp(models.Transformer(cfg), reshard_after_forward=reshard_after_forward,
                           mixed_precision=mixed)
        units = [model, *model.layers.values()]
        fsdp_params = [p for unit in units for p in unit._get_fsdp_state()._fsdp_param_group.fsdp_params]
        cpu, peaks = torch.device("cpu"), {}

        class Tracker(FSDPMemTracker):
            def _update_peak_stats(self, peak_state):   # after every op
                super()._update_peak_stats(peak_state)
                for p in fsdp_params:
                    unsharded = getattr(p, "_unsharded_param", None)
                    if unsharded is not None and unsharded.grad is not None:
                        self._update_and_maybe_create_winfos(unsharded.grad, _FSDPRefType.UNSHARDED_GRAD,
                                                             update_existing=True)
                snap = self._curr_mem_snap.get(cpu, {})
                parts = {"gathered": snap.get(_FSDPRefType.UNSHARDED_PARAM, 0) + snap.get(_FSDPRefType.ALL_GATHER, 0),
                         "gradients": snap.get(_FSDPRefType.UNSHARDED_GRAD, 0),
                         "reduce_scatter": snap.get(_FSDPRefType.REDUCE_SCATTER, 0)}
                parts["total"] = sum(parts.values())
                phase = "backward" if self._mod_tracker.is_bw else "forward"
                if parts["total"] > peaks.get(phase, {"total": -1})["total"]:
                    peaks[phase] = parts

        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
        tracker = Tracker(model)
        with tracker, contextlib.redirect_stderr(io.StringIO()):
            for _ in range(steps):
                peaks.clear()
                tracker.reset_mod_stats()
                models.lm_loss(model(tokens), tokens).backward()
    finally:
        dist.destroy_process_group()
    return dict(peaks)
