"""Tensor, sequence and context parallelism of the shared transformer: the plan, and the formulas.

Used by chapters 06 (tensor parallel), 08 (sequence and context parallel) and 09 (hybrid):

* **The plan.** :func:`transformer_tp_plan` is the declarative ``{module name: style}`` dict that
  ``parallelize_module`` applies to :class:`distlab.models.Transformer` (torchtitan's names)::

      tok_embeddings      RowwiseParallel   (vocabulary split; one all-reduce of the output)
      layers.*.attention  PrepareModuleInput  (one DTensor input: the q/k/v input gradients add up first)
      attention.wq/wk/wv  ColwiseParallel   (heads split; attention runs on plain local tensors)
      attention.wo        RowwiseParallel   (partial sums; one all-reduce, or a reduce-scatter under SP)
      feed_forward.w1/w3  ColwiseParallel,  feed_forward.w2  RowwiseParallel
      output              ColwiseParallel   (vocabulary split; logits stay sharded for loss_parallel)

  With ``sequence_parallel=True`` the norms run on sequence shards (``SequenceParallel``) and the
  activations between the tensor-parallel regions stay sharded along the sequence.
* **Validation.** :func:`tp_config_problems` lists what does not split, before any process group forms.
* **Formulas**, each equal to a measurement in a test: communication of one training step
  (:func:`tp_comm_formula`), saved activations per rank (:func:`activation_bytes`), parameters per rank
  (:func:`tp_param_count_per_rank`), TP communication time against compute (:func:`tp_comm_time_per_layer`).
* **Context parallelism** pieces that are pure functions: which sequence chunks a rank holds
  (:func:`ring_chunks`), how many attention blocks each rank computes (:func:`causal_blocks_per_rank`),
  attention on one block with its log-sum-exp (:func:`attention_with_lse`) and the online-softmax merge of two
  blocks (:func:`merge_attention_blocks`).
"""

from __future__ import annotations

import math

import torch

from distlab import runtime

# Link speeds quoted by the chapters (vendor figures). NVLink 3 on an A100: 12 links x 50 GB/s = 600 GB/s
# in total per GPU, 300 GB/s in each direction. Slingshot-11: 200 Gb/s per NIC and direction = 25 GB/s.
NVLINK3_A100_TOTAL_BYTES_PER_S = 600e9
NVLINK3_A100_PER_DIRECTION_BYTES_PER_S = NVLINK3_A100_TOTAL_BYTES_PER_S / 2
SLINGSHOT11_NIC_BYTES_PER_S = 200e9 / 8


# --------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------


def transformer_tp_plan(sequence_parallel: bool = False, region_inputs: bool = True) -> dict:
    """The tensor-parallel plan of :class:`distlab.models.Transformer` as ``{module name pattern: style}``.

    ``region_inputs=False`` leaves out the two ``PrepareModuleInput`` entries (possible without sequence
    parallelism only): each column-parallel linear then turns the replicated input into a DTensor of its
    own, and backward all-reduces wq's, wk's, wv's, w1's and w3's input gradients separately, 5 all-reduces
    per block instead of 2 (see :func:`tp_comm_formula`).

    Attention and feed-forward outputs of the column-parallel linears are plain local tensors
    (``use_local_output=True``): attention views them as ``(B, T, -1, head_dim)`` and so computes this
    rank's heads, on CPU as on GPU (SDPA on DTensors has no CPU sharding rule). The logits stay a DTensor
    sharded over the vocabulary: compute the loss inside ``loss_parallel()``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    if not sequence_parallel:
        # Activations between the TP regions are replicated: every rank holds all B x S x H of them.
        residual = Replicate()
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "layers.*.attention.wo": RowwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(),
        }
    else:
        # Activations between the TP regions are split along the sequence (dim 1); they stay DTensors so
        # that the model still sees the global sequence length (its rotary tables depend on it).
        residual = Shard(1)
        plan = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "norm": SequenceParallel(),
        }
    if not region_inputs and sequence_parallel:
        raise ValueError("sequence parallelism needs the PrepareModuleInput entries (they all-gather)")
    plan.update({
        # One DTensor enters each TP region: the input gradients of wq, wk, wv (and of w1, w3) add up as
        # partial sums, and one all-reduce (or reduce-scatter) finishes them, not one per linear.
        "layers.*.attention": PrepareModuleInput(input_layouts=(residual, None, None),
                                                 desired_input_layouts=(Replicate(), None, None)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(residual,),
                                                    desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "output": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False),
    })
    if not region_inputs:
        del plan["layers.*.attention"], plan["layers.*.feed_forward"]
    return plan


def parallelize_transformer(model, mesh, sequence_parallel: bool = False, region_inputs: bool = True):
    """Apply :func:`transformer_tp_plan` to ``model`` on the 1-D ``mesh`` (in place; returns the model)."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, transformer_tp_plan(sequence_parallel, region_inputs))


def reduce_partial_gradients(model) -> int:
    """All-reduce the gradients that backward left as partial sums; return how many there were.

    Under sequence parallelism each rank sees only its part of the sequence, so the gradients of the
    norm weights (replicated parameters) come out of backward as ``Partial`` DTensors: each rank holds its
    sequence shard's contribution. Megatron all-reduces them explicitly; so do we, once per weight, right
    after backward (left alone, the optimizer would reduce them lazily, once per use).
    """
    from torch.distributed.tensor import DTensor, Replicate

    reduced = 0
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)
            reduced += 1
    return reduced


def max_gradient_difference(model, reference_grads: dict) -> float:
    """Largest |gradient - reference| over every parameter of a (tensor-)parallel ``model``.

    ``reference_grads`` maps parameter names to the single-device gradients (on any device). Each sharded
    gradient is gathered whole (``full_tensor``, a collective: call it on every rank) one parameter at a
    time, so at most one full gradient is held at once.
    """
    from torch.distributed.tensor import DTensor

    from distlab.metrics import max_abs_diff

    largest = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        largest = max(largest, max_abs_diff(grad.cpu(), reference_grads[name].cpu()))
        del grad
    return largest


# --------------------------------------------------------------------------------------------------
# What must divide what
# --------------------------------------------------------------------------------------------------


# The model-shape flags of the tensor- and sequence-parallel scripts, and how closely they must match one device.
DEFAULT_BATCH = {"tiny": 4, "a100": 2}  # a100: the single-device reference (16 B/param AdamW state) must fit 40 GB
# fp32 sums in another order differ in the last bits (~1e-8 here); AdamW's 1/sqrt(v) magnifies that in later
# steps' losses. A TP mistake (a missing reduction, a wrong slice) is off by 1e-3 or more.
TOLERANCE = {"tiny": {"loss": 1e-5, "grad": 1e-6}, "a100": {"loss": 1e-4, "grad": 1e-5}}


def add_model_flags(parser) -> None:
    """--batch, --seq-len, --dim, --heads, --kv-heads, --ffn-hidden, --lr: shapes to try a split with (preset's by
    default)."""
    parser.add_argument("--batch", type=runtime.positive_int, default=None, help="sequences per step (default: 4 tiny, 2 a100)")
    parser.add_argument("--seq-len", type=runtime.positive_int, default=None, help="tokens per sequence (default: the preset's)")
    parser.add_argument("--dim", type=runtime.positive_int, default=None, help="hidden size H (default: the preset's)")
    parser.add_argument("--heads", type=runtime.positive_int, default=None, help="attention heads (default: the preset's)")
    parser.add_argument("--kv-heads", type=runtime.positive_int, default=None,
                        help="key/value heads, fewer than --heads for grouped-query attention (default: the preset's)")
    parser.add_argument("--ffn-hidden", type=runtime.positive_int, default=None, help="feed-forward hidden size (default: the preset's)")
    runtime.add_lr_flag(parser, 1e-3)


def model_from_args(args):
    """The preset with the flags' overrides; fills in ``args.batch`` and ``args.seq_len`` where not given."""
    from distlab import models

    args.batch = args.batch or DEFAULT_BATCH[args.preset]
    args.seq_len = args.seq_len or models.preset(args.preset).seq_len
    overrides = {name: value for name, value in (("dim", args.dim), ("n_heads", args.heads),
                                                 ("n_kv_heads", getattr(args, "kv_heads", None)),
                                                 ("ffn_hidden", args.ffn_hidden)) if value is not None}
    return models.preset(args.preset, **overrides)



def tp_config_problems(cfg, tp: int, *, batch: int | None = None, seq_len: int | None = None,
                       sequence_parallel: bool = False) -> list[str]:
    """Every reason ``cfg`` cannot be split over ``tp`` ranks (empty when it can), one sentence each."""
    problems = []
    if tp < 1:
        return [f"the tensor-parallel degree must be at least 1, not {tp}"]
    if cfg.dim % cfg.n_heads:
        problems.append(f"hidden size {cfg.dim} is not a multiple of the {cfg.n_heads} heads")
    if cfg.n_heads % tp:
        problems.append(f"{cfg.n_heads} attention heads do not split over {tp} TP ranks")
    if cfg.n_kv_heads is not None and cfg.n_heads % cfg.n_kv_heads:
        problems.append(f"{cfg.n_heads} attention heads do not share {cfg.n_kv_heads} key/value heads evenly")
    elif cfg.n_kv_heads is not None and cfg.n_kv_heads % tp:   # each rank needs whole key/value heads for its
        problems.append(f"{cfg.n_kv_heads} key/value heads do not split over {tp} TP ranks (grouped-query "  # queries
                        f"attention: with more TP ranks than key/value heads, each would have to be replicated)")
    if cfg.dim % tp:
        problems.append(f"hidden size {cfg.dim} does not split over {tp} TP ranks")
    if cfg.ffn_hidden % tp:
        problems.append(f"feed-forward hidden size {cfg.ffn_hidden} does not split over {tp} TP ranks")
    if cfg.vocab_size % tp:
        problems.append(f"vocabulary {cfg.vocab_size} does not split over {tp} TP ranks")
    seq = seq_len if seq_len is not None else cfg.seq_len
    if seq > cfg.seq_len:
        problems.append(f"sequence length {seq} is longer than the model's {cfg.seq_len}")
    if sequence_parallel and seq % tp:
        problems.append(f"sequence length {seq} does not split over {tp} ranks")
    if batch is not None and batch < 1:
        problems.append(f"batch must be at least 1, not {batch}")
    return problems


# --------------------------------------------------------------------------------------------------
# Communication of one training step
# --------------------------------------------------------------------------------------------------


def tp_comm_formula(cfg, batch: int, seq_len: int, tp: int, *, sequence_parallel: bool = False,
                    region_inputs: bool = True, bytes_per_element: int = 4) -> list[dict]:
    """The collectives of one training step of the TP plan, as rows ``{phase, where, collective, calls,
    payload_bytes}`` (payload: the full B x S x H tensor a collective is about, summed over its calls).

    Without SP, each block all-reduces B x S x H twice forward (after wo and after w2) and twice backward
    (the input gradients of the attention and feed-forward regions). The vocabulary-split embedding adds one
    forward all-reduce, the vocabulary-split output projection one backward, and ``loss_parallel`` three
    small forward all-reduces of B x S fp32 numbers (max logit, sum of exponentials, log-probability of the target).

    With SP each all-reduce becomes an all-gather (into the TP region) plus a reduce-scatter (out of it) of
    the same payload, and the norm weights' gradients need one all-reduce of H numbers each.

    ``region_inputs=False`` (the plan without PrepareModuleInput): 5 backward all-reduces per block.
    """
    layers = cfg.n_layers
    activation = batch * seq_len * cfg.dim * bytes_per_element
    loss_stats = batch * seq_len * 4  # loss_parallel reduces fp32 statistics
    rows = []

    def add(phase, where, collective, calls, payload_each):
        rows.append({"phase": phase, "where": where, "collective": collective, "calls": calls,
                     "payload_bytes": calls * payload_each})

    if not sequence_parallel:
        add("forward", "embedding", "all_reduce", 1, activation)
        add("forward", "blocks", "all_reduce", 2 * layers, activation)
        add("forward", "loss", "all_reduce", 3, loss_stats)
        add("backward", "output", "all_reduce", 1, activation)
        add("backward", "blocks", "all_reduce", (2 if region_inputs else 5) * layers, activation)
    else:
        add("forward", "embedding", "reduce_scatter", 1, activation)
        add("forward", "blocks", "all_gather", 2 * layers, activation)
        add("forward", "blocks", "reduce_scatter", 2 * layers, activation)
        add("forward", "output", "all_gather", 1, activation)
        add("forward", "loss", "all_reduce", 3, loss_stats)
        add("backward", "output", "reduce_scatter", 1, activation)
        add("backward", "blocks", "all_gather", 2 * layers, activation)
        add("backward", "blocks", "reduce_scatter", 2 * layers, activation)
        add("backward", "embedding", "all_gather", 1, activation)
        add("after backward", "norm weights", "all_reduce", 2 * layers + 1, cfg.dim * bytes_per_element)
    return rows


def where_in_transformer(module_name: str) -> str:
    """The row of :func:`tp_comm_formula` a collective belongs to, from the module that issued it
    (as :class:`distlab.comm.ModuleCommCounter` records it)."""
    if module_name == "Global":
        return "loss"  # loss_parallel's reductions run outside every module
    if ".layers." in f".{module_name}.":
        return "blocks"
    if module_name.endswith("output"):
        return "output"
    # The embedding's collective runs in a hook after the embedding module has returned (forward), or in
    # backward once the tracker has left the blocks: the root module is where it shows up.
    return "embedding"


def measured_comm_rows(calls, *, phase: str | None = None, where: str | None = None) -> list[dict]:
    """Group measured collectives into the rows of :func:`tp_comm_formula`.

    ``calls`` come from a :class:`distlab.comm.ModuleCommCounter` (each knows its module and phase); for a
    plain :class:`distlab.comm.CommCounter` give ``phase`` and ``where`` for all of them.
    """
    rows: dict[tuple, dict] = {}
    for call in calls:
        key = (phase or call.phase, where or where_in_transformer(call.module), call.collective)
        row = rows.setdefault(key, {"phase": key[0], "where": key[1], "collective": key[2], "calls": 0,
                                    "payload_bytes": 0})
        row["calls"] += 1
        row["payload_bytes"] += call.payload_bytes
    return list(rows.values())


def step_totals(rows: list[dict]) -> list[dict]:
    """Rows of calls and payload bytes summed per collective over every phase and place: one step's totals, as
    ``{"phase": "step", "where": "all", collective, calls, payload_bytes}`` (for what only a step's totals can be
    measured of: compiled code, counted off the profiler)."""
    totals: dict[str, dict] = {}
    for row in rows:
        total = totals.setdefault(row["collective"], {"phase": "step", "where": "all", "collective": row["collective"],
                                                      "calls": 0, "payload_bytes": 0})
        total["calls"] += row["calls"]
        total["payload_bytes"] += row["payload_bytes"]
    return list(totals.values())


def join_comm_rows(measured: list[dict], formula: list[dict], world_size, *,
                   keys: tuple = ("phase", "where", "collective")) -> list[dict]:
    """One row per ``keys`` (by default (phase, where, collective)) present in either list: measured and formula
    side by side, with the bytes each rank sends on a ring (:func:`distlab.comm.bytes_sent_per_rank`).
    ``world_size``: the ring's size, or a function of a row's keys (``{"dimension": ..}`` -> that group's size)."""
    from distlab.comm import bytes_sent_per_rank

    def key(row):
        return tuple(row[name] for name in keys)

    measured_by_key = {key(r): r for r in measured}
    formula_by_key = {key(r): r for r in formula}
    joined = []
    for k in list(formula_by_key) + [k for k in measured_by_key if k not in formula_by_key]:
        m = measured_by_key.get(k, {"calls": 0, "payload_bytes": 0})
        f = formula_by_key.get(k, {"calls": 0, "payload_bytes": 0})
        row = dict(zip(keys, k))
        group = world_size(row) if callable(world_size) else world_size
        joined.append({**row, "measured_calls": m["calls"], "analytic_calls": f["calls"],
                       "measured_bytes": m["payload_bytes"], "analytic_bytes": f["payload_bytes"],
                       # the ring model applied to the measured payload: derived, not measured
                       "sent_bytes_per_rank_derived": bytes_sent_per_rank(row["collective"], m["payload_bytes"],
                                                                          group)})
    return joined


def tp_comm_time_per_layer(cfg, tp: int, link_bytes_per_s: float, peak_flops: float, *,
                           bytes_per_element: int = 2, seq_len: int | None = None) -> dict:
    """Per token and layer: seconds of TP all-reduces on a ring over ``link_bytes_per_s`` (one direction)
    against seconds of matmul FLOPs at ``peak_flops`` on one of the ``tp`` GPUs (training: 6 FLOPs per
    parameter and token, plus attention's 12 x S x H). No overlap is assumed: the ratio says how hard the
    communication is to hide."""
    seq_len = seq_len or cfg.seq_len
    # 4 all-reduces of H numbers per token (2 forward, 2 backward); a ring all-reduce sends 2 (n-1)/n of it
    sent = 4 * 2 * (tp - 1) / tp * cfg.dim * bytes_per_element
    flops = (6 * (4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_hidden) + 12 * cfg.dim * seq_len) / tp
    comm_s, compute_s = sent / link_bytes_per_s, flops / peak_flops
    return {"sent_bytes": sent, "flops": flops, "comm_s": comm_s, "compute_s": compute_s,
            "comm_over_compute": comm_s / compute_s}


# --------------------------------------------------------------------------------------------------
# Memory per rank
# --------------------------------------------------------------------------------------------------


def tp_param_count_per_rank(cfg, tp: int) -> dict:
    """Parameters one TP rank holds: every matrix split ``tp`` ways, the norm weights replicated."""
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    sharded = cfg.num_params() - norms
    return {"sharded": sharded // tp, "replicated": norms, "total": sharded // tp + norms}


def activation_bytes(cfg, batch: int, seq_len: int, tp: int = 1, *, sequence_parallel: bool = False,
                     kv_dim: int | None = None) -> dict:
    """Bytes autograd saves for backward on one rank, training the shared transformer in fp32 with the TP plan.

    Exactly what :func:`distlab.memory.saved_activation_bytes` measures on a CPU (weights, buffers and the
    input batch excluded). Per layer, in fp32 numbers, with b, s, h, f, a = batch, sequence, hidden,
    feed-forward hidden, heads and t = TP degree::

        2 norms      2 x (2 b s h + b s)       input, normalised input, 1/rms   (/ t under SP)
        TP inputs    2 x b s h                 what wq/wk/wv and w1/w3 multiply (replicated even under SP:
                                               DTensor saves the all-gathered input; Megatron re-gathers it)
        attention    (4 b s h + b s a) / t     q, k, v, output of this rank's heads, and log-sum-exp
        SwiGLU       4 b s f / t               w1 x, silu(w1 x), w3 x, their product

    The head adds the final norm (2 b s h + b s, / t under SP), the output projection's input (b s h), the
    log-softmax of this rank's vocabulary shard (b s v / t), the int64 targets (8 bytes each) and one scalar.

    ``kv_dim``: the width of k and v under grouped-query attention (the course's model has every head: h,
    the default, measured). A smaller one is derived: k and v are saved at their own width.
    """
    b, s, h, f, a, v, t = batch, seq_len, cfg.dim, cfg.ffn_hidden, cfg.n_heads, cfg.vocab_size, tp
    kv = h if kv_dim is None else kv_dim
    sp = t if sequence_parallel else 1
    fp32 = 4
    norms = 2 * (2 * b * s * h + b * s) // sp * fp32
    tp_inputs = 2 * b * s * h * fp32
    attention = (2 * b * s * h + 2 * b * s * kv + b * s * a) // t * fp32
    swiglu = 4 * b * s * f // t * fp32
    per_layer = norms + tp_inputs + attention + swiglu
    head = ((2 * b * s * h + b * s) // sp + b * s * h + b * s * v // t + 1) * fp32 + b * s * 8
    return {"norms": norms * cfg.n_layers, "tp_inputs": tp_inputs * cfg.n_layers,
            "attention": attention * cfg.n_layers, "swiglu": swiglu * cfg.n_layers, "head": head,
            "per_layer": per_layer, "total": per_layer * cfg.n_layers + head}


# --------------------------------------------------------------------------------------------------
# Context parallelism: attention over sequence shards
# --------------------------------------------------------------------------------------------------


def ring_comm_formula(kv_shard_bytes: int, world_size: int) -> dict:
    """Bytes one rank of a ring-attention group sends, for one attention (chapter 08's ring_attention.py
    measures it; chapter 11's planner uses it): forward P-1 hops of (K, V); backward P-1 hops of
    (K, V, dK, dV) and a last one of (dK, dV). ``kv_shard_bytes``: this rank's K (or V) block."""
    return {"forward": (world_size - 1) * 2 * kv_shard_bytes,
            "backward": (world_size - 1) * 4 * kv_shard_bytes + 2 * kv_shard_bytes}


def ring_chunks(rank: int, world_size: int, layout: str = "zigzag") -> list[int]:
    """The two sequence chunks (of ``2 x world_size``) that ``rank`` holds.

    ``contiguous``: chunks 2r and 2r+1, so rank 0 holds the start of the sequence and, under a causal mask,
    has almost nothing to attend to. ``zigzag``: chunks r and 2P-1-r, one early and one late, so every
    rank does the same amount of attention work.
    """
    if layout == "contiguous":
        return [2 * rank, 2 * rank + 1]
    if layout == "zigzag":
        return [rank, 2 * world_size - 1 - rank]
    raise ValueError(f"layout must be 'contiguous' or 'zigzag', not {layout!r}")


def chunk_positions(chunks: list[int], chunk_len: int) -> torch.Tensor:
    """Global token positions of a rank's chunks, in the order the rank stores them."""
    return torch.cat([torch.arange(c * chunk_len, (c + 1) * chunk_len) for c in chunks])


def block_kind(query_chunk: int, key_chunk: int) -> str:
    """Under a causal mask a (query chunk, key chunk) block is ``full``, ``diagonal`` or ``skipped``."""
    if key_chunk < query_chunk:
        return "full"
    return "diagonal" if key_chunk == query_chunk else "skipped"


def causal_blocks_per_rank(world_size: int, layout: str = "zigzag") -> list[int]:
    """Attention blocks (chunk x chunk) each rank computes in one ring pass under a causal mask."""
    counts = []
    for rank in range(world_size):
        mine = ring_chunks(rank, world_size, layout)
        visiting = [c for other in range(world_size) for c in ring_chunks(other, world_size, layout)]
        counts.append(sum(block_kind(q, k) != "skipped" for q in mine for k in visiting))
    return counts


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v over one block, and the log-sum-exp of each query's scores.

    q (..., Sq, D), k and v (..., Sk, D); ``causal`` masks key j > query i (for a diagonal block, where
    queries and keys are the same positions). Returns out (..., Sq, D) and lse (..., Sq).
    """
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge_attention_blocks(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax merge: attention over keys A and B from attention over A and over B alone.

    Each block's output is normalised by its own sum of exponentials exp(lse); the merged one by the sum
    of both, exp(lse_a) + exp(lse_b). So weight each output by its share of that sum, computed stably.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    # A query that has seen no key on either side yet (causal: every key of both blocks in its future) has
    # lse = -inf on both sides, and exp(-inf - (-inf)) is nan: its weights are 0 instead, its output stays 0.
    reference = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(lse_a - reference).unsqueeze(-1) * out_a + torch.exp(lse_b - reference).unsqueeze(-1) * out_b
    return out, lse
