"""Bytes each GPU moves per step, per mesh dimension, and which link each dimension crosses."""

from __future__ import annotations

import functools
import math

from distlab import comm, hybrid_pipeline, moe, tensor_parallel
from distlab.planner.memory import stage_config, stage_params
from distlab.planner.spec import (Cluster, Layout, ModelSpec, Options, bucket_params, checkpointing, chunks,
                                  keeps_gathered, microbatches, pipeline_fsdp_gathers, reshards_after_forward,
                                  sequence_parallel, stage_layer_kinds, stage_layers)


def comm_per_step(model: ModelSpec, layout: Layout, stage: int, options: Options = Options(),
                  gpus_per_node: int | None = None) -> dict:
    """Collectives of one step on one GPU of stage ``stage``, per mesh dimension: ``{dimension: {collective:
    payload bytes}}`` (payload: the whole tensor a collective is about, summed over calls; ring bytes sent
    follow from ``comm.bytes_sent_per_rank``).

    * tp: ``tensor_parallel.tp_comm_formula`` on this stage's layers, per microbatch, the embedding row on the
      first stage, output and loss rows on the last; with full checkpointing the blocks' forward collectives
      run again in backward: per block and microbatch without SP 2 forward + 2 backward + 2 recomputed = 6
      all-reduces when the whole block re-runs (``recompute_early_stop=False``, Megatron), 5 under PyTorch's
      non-reentrant checkpoint, which stops before the block's last collective (both measured in chapter
      08's sp_transformer.py); selective checkpointing recomputes only attention's core, no TP collective;
    * dp: ``comm.zero_step_bytes`` of this stage's TP share (all-gathers in the compute dtype, gradients
      reduced in fp32). ZeRO-1 reduce-scatters the fp32 gradients and all-gathers the updated parameters in the
      compute dtype, as Megatron's distributed optimizer does: in mixed precision 4 + 2 bytes a parameter where
      DDP's fp32 all-reduce moves 4 + 4, 0.75 of DDP's bytes (chapter 05's from-scratch ZeRO-1 all-reduces
      instead, to keep it short). ZeRO-2 reduce-scatters after every microbatch's backward (DeepSpeed's
      stage_1_and_2.py:1767-1768 reduces each micro-step when it partitions gradients; ZeRO-1 at the last). FSDP
      without PP repeats its collectives for every accumulated microbatch, unless it keeps the weights
      gathered (``fsdp_keep_gathered``); under PP it reduces once (torch's pipeline stage) and gathers as often
      as torch's schedule makes it (``spec.pipeline_fsdp_gathers``: once a step under 1F1B without resharding
      after forward, again and again through the interleaved runtime's window of 3 chunks);
    * pp: ``hybrid_pipeline.pp_send_bytes`` (activations forward, their gradients backward, every microbatch
      and chunk); under SP a rank sends its sequence shard (1/tp of the activation), as Megatron-Core does
      (``schedules.py``: the shape's sequence divided by TP only under SP); without SP the whole tensor, unless
      Megatron-LM's 2021 scatter/gather optimisation (Narayanan et al. 2021, on by default since Megatron-LM
      commit 72e4230b) sends 1/tp from each TP rank;
    * replicate (HSDP, ``layout.shard``): FSDP's all-gathers and reduce-scatters run in the shard group (dp);
      after each reduce-scatter, the rank's gradient shard (1/shard of the unit's) is all-reduced with its peers
      of the other replicas (measured in chapter 09's ``fsdp_tp_hybrid.py --replicate``);
    * cp: ring attention (``tensor_parallel.ring_comm_formula``, chapter 08's measured ring) per layer and
      microbatch: this rank's keys and values around the ring in forward (again when recomputed, fully or
      selectively), and in backward with their gradients, blocks of b x s/cp x kv_dim.
    """
    return {dimension: {name: entry["payload"] for name, entry in collectives.items()}
            for dimension, collectives in ledger(model, layout, stage, options, gpus_per_node).items()}


def collective_calls(model: ModelSpec, layout: Layout, stage: int, options: Options = Options(),
                     gpus_per_node: int | None = None) -> dict:
    """How many collectives (or messages) one GPU of stage ``stage`` issues per step, per mesh dimension,
    ``{dimension: {collective: calls}}``: the count each call's latency multiplies. dp: one call per gradient
    bucket (:func:`distlab.planner.spec.bucket_params`) for DDP and ZeRO-1/2, one per FSDP unit and gather."""
    return {dimension: {name: entry["calls"] for name, entry in collectives.items()}
            for dimension, collectives in ledger(model, layout, stage, options, gpus_per_node).items()}


@functools.lru_cache(maxsize=8192)  # the search asks again for the same stage; every argument is frozen
def ledger(model: ModelSpec, layout: Layout, stage: int, options: Options = Options(),
           gpus_per_node: int | None = None) -> dict:
    """``{dimension: {collective: {"payload": bytes, "calls": count}}}`` of one step: what
    :func:`comm_per_step` and :func:`collective_calls` read. ``gpus_per_node``: where EP's node-limited dispatch
    (``options.ep_node_limit``) needs to know how many nodes its group spans."""
    number_bytes = 4 if options.precision == "fp32" else 2
    layers = stage_layers(model.layers, layout.pp, stage)
    num_micro = microbatches(model, layout)
    seq = model.seq_len // layout.cp
    sp = sequence_parallel(options, layout)
    result = {"tp": {}, "dp": {}, "pp": {}, "cp": {}, "replicate": {}, "ep": {}, "expert_dp": {}}

    def add(dimension, collective, payload, calls):
        entry = result[dimension].setdefault(collective, {"payload": 0, "calls": 0})
        entry["payload"] += payload
        entry["calls"] += calls

    if layout.tp > 1:
        # a MoE block's rows are a dense block's, as in torchtitan's TP plan for a MoE layer: under SP its input
        # all-gathered and its output reduce-scattered like a feed-forward's (PrepareModuleInputOutput(Shard(1) ->
        # Replicate, Partial -> Shard(1)) on "moe"); with EP beside TP each TP rank then routes 1/tp of the tokens
        # (ReordererSequenceParallel; the all-to-all below, over Layout.ep_group), without EP TP splits each expert's
        # width. Chapter 13's --tp script (no SP) measures two all-gathers a block where these rows count two
        # all-reduces (a ring all-reduce sends twice an all-gather's bytes): an overcount left
        cfg = stage_config(model, layers, seq)
        rows = tensor_parallel.tp_comm_formula(cfg, model.micro_batch, seq, layout.tp, sequence_parallel=sp,
                                               bytes_per_element=number_bytes)
        keep = {"blocks", "norm weights"} | ({"embedding"} if stage == 0 else set()) \
            | ({"output", "loss"} if stage == layout.pp - 1 else set())
        block_output = "reduce_scatter" if sp else "all_reduce"  # the feed-forward's row-parallel output
        for row in rows:
            if row["where"] not in keep:
                continue
            times = 1 if row["where"] == "norm weights" else num_micro
            calls = row["calls"]
            if checkpointing(options) == "full" and row["where"] == "blocks" and row["phase"] == "forward":
                # the recomputed forward issues the block's collectives again; stopped early, all but its last
                skipped = layers if options.recompute_early_stop and row["collective"] == block_output else 0
                calls += row["calls"] - skipped
            add("tp", row["collective"], row["payload_bytes"] // row["calls"] * calls * times, calls * times)
        if sp and not options.sp_saves_gathered_inputs and checkpointing(options) != "full":
            # Megatron's SP saved each region's input as its shard: backward gathers it again, twice a block
            one = model.micro_batch * seq * model.hidden * number_bytes
            add("tp", "all_gather", 2 * layers * num_micro * one, 2 * layers * num_micro)
    dense, moe_blocks = stage_layer_kinds(model, layout.pp, stage)
    if layout.dp * layout.cp > 1:
        params = stage_params(model, layout, stage)
        kept = keeps_gathered(options, layout)

        reshard = reshards_after_forward(options, layout)

        def zero(dimension, count, units):
            per_step = comm.zero_step_bytes(count, 2 if layout.zero_stage == 1 else layout.zero_stage,
                                            param_bytes=number_bytes if layout.zero_stage >= 1 else 4, grad_bytes=4,
                                            reshard_after_forward=reshard and not kept)
            if layout.zero_stage == 3 and layout.pp > 1:
                # torch's pipeline schedules: each unit gathered as often as the schedule makes it (the
                # interleaved runtime's window of 3 chunks, or after each forward when resharding), its
                # gradients reduce-scattered once, in REDUCE_GRAD
                gathers = pipeline_fsdp_gathers(model, layout, stage, options)
                add(dimension, "all_gather", per_step["all_gather"] * gathers, units * gathers)
                add(dimension, "reduce_scatter", per_step["reduce_scatter"], units)
                return per_step["reduce_scatter"], units
            if layout.zero_stage == 3:
                times = 1 if kept else num_micro
                gathers = 1 if kept or not reshard else 2
                add(dimension, "all_gather", per_step["all_gather"] * times, gathers * units * times)
                add(dimension, "reduce_scatter", per_step["reduce_scatter"] * times, units * times)
                return per_step["reduce_scatter"] * times, units * times
            buckets = math.ceil(count / bucket_params(options, layout))
            for name, payload in per_step.items():
                # ZeRO-2 reduces its gradients into their shards after every microbatch's backward (DeepSpeed:
                # reduce_ready_partitions_and_remove_grads; FSDP2 too, unless set_requires_gradient_sync(False)
                # keeps whole gradients: torch fsdp/_fully_shard/_fully_shard.py:413-420); DDP and ZeRO-1 once
                times = num_micro if layout.zero_stage == 2 and name == "reduce_scatter" else 1
                add(dimension, name, payload * times, buckets * times)
            return 0, 0

        # one call per FSDP unit and gather: the blocks, and the stage's root (chapter 09's parallelize_stage),
        # which holds the embedding on the first stage, the head on the last, both when pp = 1 (one unit, not
        # two: the counted step of the dry run found it). Without keeping the weights gathered, FSDP gathers and
        # reduce-scatters again for every accumulated microbatch
        scattered, calls = zero("dp", params["total"] - params["experts"],
                                layers + (stage == 0 or stage == layout.pp - 1))
        if layout.shard:   # HSDP: each reduced gradient shard all-reduced with the other replicas
            add("replicate", "all_reduce", scattered / layout.shard, calls)
        if params["experts"] and layout.expert_dp > 1:   # the experts' own ZeRO, over the ranks holding them
            zero("expert_dp", params["experts"], moe_blocks)
    if layout.pp > 1:
        v = chunks(options)
        one = model.micro_batch * seq * model.hidden * number_bytes
        sent = hybrid_pipeline.pp_send_bytes([stage + k * layout.pp for k in range(v)], layout.pp * v, num_micro,
                                             model.micro_batch, seq, model.hidden, number_bytes)
        # each TP rank sends 1/tp of the boundary tensor: its sequence shard under SP, or a slice with Megatron's
        # scatter/gather (all-gathered over NVLink on arrival; Options.pp_scatter_gather); else the whole tensor
        split = layout.tp if sp or options.pp_scatter_gather else 1
        add("pp", "send", sent / split, round(sent / one))
    if layout.ep > 1 and moe_blocks:
        # per MoE block and microbatch: dispatch and combine forward, both again backward (a gradient dispatch where
        # forward combined, a gradient combine where it dispatched), and forward again when fully recomputed. Under
        # TP each rank routes 1/tp of the tokens (torchtitan), else every TP rank would send the same ones
        tokens = model.micro_batch * seq // layout.tp
        dispatch = options.ep_dispatch_bytes or number_bytes
        directions = 2 + (checkpointing(options) == "full")   # dispatch-like (and combine-like) calls a block
        calls = 2 * directions * moe_blocks * num_micro
        element_bytes = directions * (dispatch + number_bytes) * moe_blocks * num_micro
        copies = ep_copies_per_token(model, layout, options, gpus_per_node)
        for link, count in copies.items():
            add("ep", f"all_to_all_{link}", tokens * count * model.hidden * element_bytes, calls / len(copies))
    if layout.cp > 1 and options.cp_attention == "all_gather":
        # Llama 3's CP: each layer all-gathers the sequence's keys and values (this TP rank's heads: kv_dim / tp),
        # again when recomputed, and reduce-scatters their gradients in backward
        kv = 2 * model.micro_batch * model.seq_len * model.kv_dim_per_tp_rank(layout.tp) * number_bytes
        again = 1 if checkpointing(options) == "none" else 2
        add("cp", "all_gather", kv * again * layers * num_micro, again * layers * num_micro)
        add("cp", "reduce_scatter", kv * layers * num_micro, layers * num_micro)
    elif layout.cp > 1:
        # this TP rank's key/value heads only, as in the all-gather above
        ring = tensor_parallel.ring_comm_formula(
            model.micro_batch * seq * model.kv_dim_per_tp_rank(layout.tp) * number_bytes, layout.cp)
        again = 1 if checkpointing(options) == "none" else 2
        hops = (layout.cp - 1) * again + layout.cp
        add("cp", "send", (ring["forward"] * again + ring["backward"]) * layers * num_micro,
            hops * layers * num_micro)
    return result


def ep_copies_per_token(model: ModelSpec, layout: Layout, options: Options, gpus_per_node: int | None = None) -> dict:
    """Copies of one token's hidden vector that leave its rank in one dispatch, by link, under uniform routing:
    ``{"nvlink": ..., "network": ...}``, or ``{"any": ...}`` when the link is the group's geometry's to decide
    (:func:`all_to_all_seconds`).

    * Straight to the experts (``ep_node_limit`` 0): top-k copies, each to another rank with probability
      (ep - 1) / ep: ``{"any": top_k (ep - 1) / ep}``.
    * DeepSeek-V3's node-limited dispatch (``ep_node_limit`` M, over an EP group of n nodes of g GPUs): the token
      goes to M of the n nodes, its own among them with probability M / n, so M (n - 1) / n copies cross the
      network (one a node, however many of its experts are there); in each node the copy is forwarded over NVLink
      to the GPUs of its experts there, all but those on the GPU that received it: top-k (g - 1) / g copies.
      Two experts on one GPU are counted twice (an upper bound DeepSeek's kernels may beat)."""
    if not options.ep_node_limit:
        return {"any": model.top_k * moe.uniform_leaving_share(layout.ep_group)}
    if gpus_per_node is None:
        raise ValueError("node-limited routing (ep_node_limit) needs the cluster's GPUs per node")
    if layout.ep_group > gpus_per_node and layout.ep_group % gpus_per_node:
        raise ValueError(f"node-limited routing models EP groups of whole nodes, not {layout.ep_group} ranks on "
                         f"nodes of {gpus_per_node}")
    g = min(layout.ep_group, gpus_per_node)
    nodes = max(1, layout.ep_group // g)
    chosen = min(options.ep_node_limit, nodes)
    return {"network": chosen * (nodes - 1) / nodes, "nvlink": model.top_k * (g - 1) / g}


def group_sizes(layout: Layout) -> dict:
    """The ranks of one group of each dimension: dp is FSDP's (or DDP's) group, over dp x cp, or HSDP's shard;
    ep the experts' all-to-all group, expert_dp the ranks that hold the same experts."""
    return {"tp": layout.tp, "dp": layout.fsdp_ways, "pp": layout.pp, "cp": layout.cp, "replicate": layout.replicas,
            "ep": layout.ep_group, "expert_dp": layout.expert_dp}


def crosses_nodes(layout: Layout, dimension: str, cluster: Cluster) -> bool:
    """Whether a group of ``dimension`` spans nodes, with DeviceMesh's order (pp, dp, cp, tp): tp innermost;
    under HSDP dp is (replicate, shard), the shard inside. A group of size n whose members are ``stride`` ranks
    apart spans ``stride x n`` consecutive ranks."""
    if dimension == "replicate" and not layout.shard:
        return False   # no replicas: no group
    if layout.shard and dimension in ("dp", "replicate"):
        inner = layout.cp * layout.tp
        size, stride = (layout.shard, inner) if dimension == "dp" else (layout.replicas, inner * layout.shard)
        return size > 1 and stride * size > cluster.gpus_per_node
    if dimension == "ep":   # an EP group is ep consecutive ranks (every cp and tp rank, ep_dp dp ranks)
        return layout.ep > 1 and layout.ep > cluster.gpus_per_node
    if dimension == "expert_dp":   # one rank of each EP group (or of each TP group without EP): the stage's span
        return layout.expert_dp > 1 and layout.dp * layout.cp * layout.tp > cluster.gpus_per_node
    if dimension == "dp":   # FSDP's group over dp x cp, members tp ranks apart
        return layout.fsdp_ways > 1 and layout.tp * layout.fsdp_ways > cluster.gpus_per_node
    order = ("pp", "dp", "cp", "tp")
    sizes = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}
    stride = math.prod(sizes[d] for d in order[order.index(dimension) + 1:])
    return sizes[dimension] > 1 and stride * sizes[dimension] > cluster.gpus_per_node


def bytes_sent(dimension: str, collectives: dict, group: int) -> float:
    """Bytes one GPU sends for ``collectives`` on a ring of ``group`` ranks (point-to-point: the payload)."""
    if dimension == "cp" and "send" not in collectives:   # all-gather CP: ring collectives
        return float(sum(comm.bytes_sent_per_rank(name, payload, group) for name, payload in collectives.items()))
    if dimension in ("pp", "cp", "ep"):   # messages, and an all-to-all's bytes that leave the rank
        return float(sum(collectives.values()))
    return float(sum(comm.bytes_sent_per_rank(name, payload, group) for name, payload in collectives.items()))



def ring_steps(collective: str, group: int) -> int:
    """Steps of a ring collective, each paying one latency: 2 (n - 1) for an all-reduce, n - 1 for an all-gather
    or reduce-scatter, 1 for a message or an all-to-all (its sends to every peer go out at once)."""
    if collective in ("send", "all_to_all"):
        return 1
    return (2 if collective == "all_reduce" else 1) * (group - 1)


def dimension_seconds(model: ModelSpec, cluster: Cluster, layout: Layout, stage: int,
                      options: Options = Options()) -> dict:
    """Seconds each mesh dimension's traffic of one step takes on its link, ``{dimension: {"bandwidth",
    "latency", "total"}}``: bytes sent / link bandwidth, plus each call's step latencies (a ring of 1,024 ranks is
    not free even for small messages). A ring call over several nodes pays the network's latency on the steps that
    leave a node and NVLink's on the rest (``comm.ring_latency``, NCCL's split); an all-reduce over nodes takes
    NCCL's tree instead where the tree is faster (``Options.nccl_algorithm``): 2 log2(nodes) network steps, up and
    down (tuning.cc:416), at a little less bandwidth (``comm.tree_all_reduce_latency``)."""
    sizes = group_sizes(layout)
    payloads = comm_per_step(model, layout, stage, options, cluster.gpus_per_node)
    calls = collective_calls(model, layout, stage, options, cluster.gpus_per_node)
    result = {}
    for dimension, collectives in payloads.items():
        if dimension == "ep":
            result["ep"] = all_to_all_seconds(layout, cluster, collectives, sum(calls["ep"].values()))
            continue
        across = crosses_nodes(layout, dimension, cluster)
        link = cluster.inter_node_bytes_per_s if across else cluster.intra_node_bytes_per_s
        latency = cluster.inter_node_latency_s if across else cluster.intra_node_latency_s
        # a ring over nodes leaves each node on one edge: of what its k ranks in the node send, one rank's share
        # crosses the network, over the k NICs they share (one a GPU); pp and cp's messages go rank to rank
        nics = ranks_in_node(layout, dimension, cluster) if across and dimension not in ("pp", "cp") else 1
        size = sizes[dimension]
        bandwidth = bytes_sent(dimension, collectives, size) / (link * nics)
        waits = 0.0
        for name, payload in collectives.items():
            n_calls = calls[dimension].get(name, 0)
            if ring_steps(name, size) == 1 or dimension in ("pp", "cp"):   # messages: one step on their link
                waits += n_calls * ring_steps(name, size) * latency
                continue
            nodes = -(-size // ranks_in_node(layout, dimension, cluster)) if across else 1
            ring = n_calls * comm.ring_latency(name, size, nodes, cluster.intra_node_latency_s,
                                               cluster.inter_node_latency_s)
            if name == "all_reduce" and nodes > 1 and options.nccl_algorithm == "auto":
                # NCCL picks the faster of ring and tree for each call (tuning.cc's ncclTopoGetAlgoTime)
                ring_bandwidth = comm.bytes_sent_per_rank(name, payload, size) / (link * nics)
                slower = ring_bandwidth * (comm.tree_all_reduce_bandwidth_ratio(size) - 1)
                tree = n_calls * comm.tree_all_reduce_latency(size, nodes) + slower
                if tree < ring:
                    bandwidth, ring = bandwidth + slower, tree - slower
            waits += ring
        result[dimension] = {"bandwidth": bandwidth, "latency": waits, "total": bandwidth + waits}
    return result


def ranks_in_node(layout: Layout, dimension: str, cluster: Cluster) -> int:
    """The ranks of one group of ``dimension`` that share a node (DeviceMesh's order (pp, dp, cp, tp), tp innermost;
    under HSDP dp is (replicate, shard)): a group of size n whose members are ``stride`` ranks apart has
    gpus_per_node / stride of them in a node, at least 1 and at most n."""
    # dp's group is FSDP's over dp x cp (or HSDP's shard, without CP): its members are tp ranks apart
    inner = {"tp": 1, "cp": layout.tp, "dp": layout.tp, "pp": layout.dp * layout.cp * layout.tp,
             "replicate": layout.cp * layout.tp * (layout.shard or 1), "expert_dp": layout.expert_shards}
    size = group_sizes(layout)[dimension]
    if dimension == "ep":
        return ep_ranks_in_node(layout, cluster)
    return max(1, min(size, cluster.gpus_per_node // inner[dimension]))


def ep_ranks_in_node(layout: Layout, cluster: Cluster) -> int:
    """The ranks of one EP group (``Layout.ep_group``: ep consecutive ranks) in one node."""
    return min(layout.ep_group, cluster.gpus_per_node)


def all_to_all_seconds(layout: Layout, cluster: Cluster, leaving: dict | float, calls: int) -> dict:
    """The EP all-to-alls of a step on their links. ``leaving``: bytes that leave a rank, ``{"all_to_all_any":
    bytes}`` (or a number) when every copy goes straight to its expert's rank (uniform routing: those for the EP
    group's other ranks in the same node cross NVLink, the rest the network), or ``{"all_to_all_nvlink": ...,
    "all_to_all_network": ...}`` as DeepSeek-V3's node-limited dispatch splits them (:func:`ep_copies_per_token`).
    Both links carry their share at once (NCCL and DeepSeek's kernels send to every peer together), so the slower
    sets the time; each call pays one latency of the farthest link. The group's ranks in a node:
    :func:`ep_ranks_in_node`."""
    if not isinstance(leaving, dict):
        leaving = {"all_to_all_any": leaving}
    group = layout.ep_group
    if group == 1 or not calls:
        return {"bandwidth": 0.0, "latency": 0.0, "total": 0.0, "intra_node_bytes": 0.0, "inter_node_bytes": 0.0}
    if "all_to_all_any" in leaving:
        in_node = ep_ranks_in_node(layout, cluster)
        inside = leaving["all_to_all_any"] * (in_node - 1) / (group - 1)
        outside = leaving["all_to_all_any"] - inside
    else:
        inside, outside = leaving.get("all_to_all_nvlink", 0.0), leaving.get("all_to_all_network", 0.0)
    bandwidth = max(inside / cluster.intra_node_bytes_per_s, outside / cluster.inter_node_bytes_per_s)
    latency = calls * (cluster.inter_node_latency_s if outside else cluster.intra_node_latency_s)
    return {"bandwidth": bandwidth, "latency": latency, "total": bandwidth + latency,
            "intra_node_bytes": inside, "inter_node_bytes": outside}
