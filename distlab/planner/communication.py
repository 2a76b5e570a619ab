"""Bytes each GPU moves per step, per mesh dimension, and which link each dimension crosses."""

from __future__ import annotations

import math

from distlab import comm, hybrid_pipeline, tensor_parallel
from distlab.planner.memory import stage_config, stage_params
from distlab.planner.spec import Cluster, Layout, ModelSpec, Options, microbatches, stage_layers


def comm_per_step(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> dict:
    """Collectives of one step on one GPU of stage ``stage``, per mesh dimension: ``{dimension: {collective:
    payload bytes}}`` (payload: the whole tensor a collective is about, summed over calls; ring bytes sent
    follow from ``comm.bytes_sent_per_rank``).

    * tp: ``tensor_parallel.tp_comm_formula`` on this stage's layers, per microbatch, the embedding row on the
      first stage, output and loss rows on the last; with checkpointing the blocks' forward collectives run
      again in backward;
    * dp: ``comm.zero_step_bytes`` of this stage's TP share (all-gathers in the compute dtype, gradients
      reduced in fp32); FSDP without PP repeats its collectives for every accumulated microbatch; under
      PP it keeps a stage gathered for the whole step and reduces once (torchtitan's choice);
    * pp: ``hybrid_pipeline.pp_send_bytes`` (activations forward, their gradients backward, every microbatch);
    * cp: ring attention (``tensor_parallel.ring_comm_formula``, chapter 08's measured ring) per layer and
      microbatch: this rank's keys and values around the ring in forward (again when recomputed), and in
      backward with their gradients, blocks of b x s/cp x kv_dim.
    """
    number_bytes = 4 if options.precision == "fp32" else 2
    layers = stage_layers(model.layers, layout.pp, stage)
    num_micro = microbatches(model, layout)
    seq = model.seq_len // layout.cp
    result = {"tp": {}, "dp": {}, "pp": {}, "cp": {}}
    if layout.tp > 1:
        cfg = stage_config(model, layers, seq)
        rows = tensor_parallel.tp_comm_formula(cfg, model.micro_batch, seq, layout.tp,
                                               sequence_parallel=options.sequence_parallel,
                                               bytes_per_element=number_bytes)
        keep = {"blocks", "norm weights"} | ({"embedding"} if stage == 0 else set()) \
            | ({"output", "loss"} if stage == layout.pp - 1 else set())
        for row in rows:
            if row["where"] not in keep:
                continue
            payload = row["payload_bytes"] * (1 if row["where"] == "norm weights" else num_micro)
            if options.activation_checkpointing and row["where"] == "blocks" and row["phase"] == "forward":
                payload *= 2  # the recomputed forward issues its collectives again
            result["tp"][row["collective"]] = result["tp"].get(row["collective"], 0) + payload
    if layout.dp * layout.cp > 1:
        held = stage_params(model, layout, stage)["total"]
        result["dp"] = comm.zero_step_bytes(held, layout.zero_stage,
                                            param_bytes=number_bytes if layout.zero_stage >= 1 else 4,
                                            grad_bytes=4,
                                            reshard_after_forward=options.reshard_after_forward and layout.pp == 1)
        if layout.zero_stage == 3 and layout.pp == 1:
            # FSDP without a pipeline gathers and reduce-scatters again for every accumulated microbatch
            result["dp"] = {name: payload * num_micro for name, payload in result["dp"].items()}
    if layout.pp > 1:
        sent = hybrid_pipeline.pp_send_bytes([stage], layout.pp, num_micro, model.micro_batch, seq,
                                             model.hidden, number_bytes)
        result["pp"] = {"send": sent}
    if layout.cp > 1:
        ring = tensor_parallel.ring_comm_formula(model.micro_batch * seq * model.kv_dim * number_bytes, layout.cp)
        per_layer = ring["forward"] * (2 if options.activation_checkpointing else 1) + ring["backward"]
        result["cp"] = {"send": per_layer * layers * num_micro}
    return result


def crosses_nodes(layout: Layout, dimension: str, cluster: Cluster) -> bool:
    """Whether a group of ``dimension`` spans nodes, with DeviceMesh's order (pp, dp, cp, tp): tp innermost.
    A group of size n whose members are ``stride`` ranks apart spans ``stride x n`` consecutive ranks."""
    order = ("pp", "dp", "cp", "tp")
    sizes = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}
    stride = math.prod(sizes[d] for d in order[order.index(dimension) + 1:])
    return sizes[dimension] > 1 and stride * sizes[dimension] > cluster.gpus_per_node


def bytes_sent(dimension: str, collectives: dict, group: int) -> float:
    """Bytes one GPU sends for ``collectives`` on a ring of ``group`` ranks (point-to-point: the payload)."""
    if dimension in ("pp", "cp"):
        return float(sum(collectives.values()))
    return float(sum(comm.bytes_sent_per_rank(name, payload, group) for name, payload in collectives.items()))

