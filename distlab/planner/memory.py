"""Memory per GPU of a layout, by part: training state, activations, temporary buffers, reserve."""

from __future__ import annotations

import functools
from dataclasses import replace

from distlab import memory, models, moe, tensor_parallel
from distlab.planner.spec import (PIPELINE_SCHEDULES, Layout, ModelSpec, Options, bucket_params, checkpointing, chunks,
                                  keeps_gathered, microbatches, pipeline_gathered_share, reshards_after_forward,
                                  sequence_parallel, stage_layer_kinds, stage_layers)


@functools.lru_cache(maxsize=8192)
def stage_params(model: ModelSpec, layout: Layout, stage: int) -> dict:
    """Parameters one TP rank of pipeline stage ``stage`` holds: ``{"sharded", "replicated", "experts",
    "total"}`` (the sharded ones already divided by TP; ``experts``: this rank's routed experts, 1/ep of each MoE
    block's: whole experts over its EP group's ep ranks, or 1/tp of each expert's width without EP), and its FSDP
    units: ``largest_unit`` (a block, or the root), ``largest_block``, ``root_unit`` (the stage's embedding and
    head, one unit: chapter 05's ``apply_fsdp``, chapter 09's ``parallelize_stage``) and ``head`` (the final norm
    and the output layer, the root's parameters whose gradients backward computes first)."""
    dense, moe = stage_layer_kinds(model, layout.pp, stage)
    blocks = [(dense, model.block_params()), (moe, model.block_params(moe=True))]
    sharded = sum(n * block["sharded"] for n, block in blocks)
    replicated = sum(n * block["replicated"] for n, block in blocks)
    experts = sum(n * block["experts"] for n, block in blocks) / layout.expert_shards
    units = [block["sharded"] / layout.tp + block["replicated"] + block["experts"] / layout.expert_shards
             for n, block in blocks if n]
    root_sharded = root_replicated = 0
    if stage == 0:
        embedding = model.embedding_params()
        root_sharded += embedding["sharded"]
        root_replicated += embedding["replicated"]
    if stage == layout.pp - 1:
        head = model.head_params(tied_copy=layout.pp > 1)
        root_sharded += head["sharded"]
        root_replicated += head["replicated"]
    blocks_largest = max(units, default=0)
    root = root_sharded / layout.tp + root_replicated
    if root:
        units.append(root)
    head = model.head_params(tied_copy=layout.pp > 1) if stage == layout.pp - 1 else {"sharded": 0, "replicated": 0}
    sharded_per_rank = (sharded + root_sharded) / layout.tp
    return {"sharded": sharded_per_rank, "replicated": replicated + root_replicated, "experts": experts,
            "total": sharded_per_rank + replicated + root_replicated + experts, "largest_unit": max(units),
            "largest_block": blocks_largest, "root_unit": root,
            "head": head["sharded"] / layout.tp + head["replicated"]}



def in_flight(schedule: str, pp: int, stage: int, num_microbatches: int, chunks: int = 1,
              per_round: int | None = None) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak, in whole-stage units (closed forms of
    ``schedules.peak_activations``, tested equal to it): GPipe M; 1F1B min(P - s, M); interleaved
    min((V-1)N + 2(P-1-s) + 1, V M) chunk-microbatches of 1/V of a stage each, N the microbatches a round as
    torch's ``ScheduleInterleaved1F1B`` sets it, M // max(1, M // P) (P when P divides M, Megatron's), which warms up
    (V-1) N + 2 (P-1-s) ops (``_get_warmup_ops``). A smaller N would hold less but stalls the pipeline here: the
    course's simulator deadlocks at P 16, V 8, N 5.

    One chunk a rank (V = 1) is plain 1F1B, as the search (``search.CHUNKS``), the settings ("1F1B") and FSDP's
    gathers (``spec._pipeline_order``) take it: ``Schedule1F1B``'s P - s, not the 2 (P-1-s) + 1 that torch's
    interleaved class would warm up with one stage a rank (its ``multiply_factor`` is 2 whatever the stages)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "1f1b" or (schedule == "interleaved_1f1b" and chunks == 1):
        return min(pp - stage, num_microbatches)
    if schedule == "interleaved_1f1b":
        n = per_round or num_microbatches // max(1, num_microbatches // pp)
        return min((chunks - 1) * n + 2 * (pp - 1 - stage) + 1, chunks * num_microbatches) / chunks
    raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, not {schedule!r}")


def stage_config(model: ModelSpec, layers: int, seq_len: int) -> models.TransformerConfig:
    return replace(model.config(), n_layers=max(layers, 1), seq_len=seq_len)


def megatron_layers(options: Options) -> bool:
    """Whether the blocks are Megatron's own layers (``Options.sp_saves_gathered_inputs`` False): fused kernels that
    save less than torch's modules (:func:`block_activation_bytes`)."""
    return not options.sp_saves_gathered_inputs


def block_activation_bytes(model: ModelSpec, b: int, seq: int, tp: int, sp: bool, options: Options = Options()
                           ) -> float:
    """What one block saves for backward on one TP rank, for ``b`` sequences of ``seq`` tokens, without attention's
    s x s probabilities (:func:`activation_bytes` adds them where they are kept).

    Torch's modules (DTensor's ``parallelize_module``, the course's layers): ``tensor_parallel.activation_bytes``,
    the fp32 formula measured on CPU ranks, scaled to 2-byte numbers in mixed precision; a GPT block's GELU MLP
    saves two f-wide tensors (fc2's input and GELU's input) where the course's unfused SwiGLU saves four.

    Megatron's layers (:func:`megatron_layers`), counted as Korthikanti et al. (2022, section 4.1) count them: each
    LayerNorm or RMSNorm saves its input; each TP region's first matmul its input, as its sequence shard under SP
    (``ColumnParallelLinear`` saves its input and all-gathers it again in backward: Megatron-LM
    ``megatron/core/tensor_parallel/layers.py:604,667-680``); attention its q, k, v and output; a GPT block's
    MLP GELU's input and fc2's input (4h each) and two 1-byte dropout masks; a Llama block's fused SwiGLU its input
    (fc1's output, 2f wide: ``megatron/core/fusions/fused_bias_swiglu.py:235``) and fc2's input (f wide). A GPT
    block is then sbh (10 + 24/t) bytes, and 34 sbh / t under SP (the paper's equations 2 and 6). Flash attention
    adds its fp32 log-sum-exp per head."""
    if not megatron_layers(options):
        per_rank = tensor_parallel.activation_bytes(stage_config(model, 1, seq), b, seq, tp, sequence_parallel=sp,
                                                    kv_dim=model.kv_dim)
        per_layer = per_rank["per_layer"]
        if model.architecture == "gpt":
            per_layer -= 2 * b * seq * model.ffn // tp * 4   # GELU: 2 of the formula's 4 f-wide tensors
        return per_layer * (4 if options.precision == "fp32" else 2) / 4
    number_bytes = 4 if options.precision == "fp32" else 2
    tokens, h = b * seq, model.hidden
    kv = model.kv_dim_per_tp_rank(tp) * tp
    gpt = model.architecture == "gpt"
    # the sequence-parallel region: two norm inputs, the two regions' inputs; GPT's two dropout masks (1 byte)
    region = (4 * h * number_bytes + (2 * h if gpt else 0)) * tokens
    ffn = (2 if gpt else 3) * model.ffn
    split = (2 * h + 2 * kv + ffn) * number_bytes * tokens
    log_sum_exp = 4 * tokens * model.heads if options.flash_attention else 0
    return region / (tp if sp else 1) + (split + log_sum_exp) / tp


def activation_bytes(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> float:
    """Saved activations on one GPU of stage ``stage`` at its peak (the start of backward).

    Per microbatch, from ``tensor_parallel.activation_bytes`` (the fp32 formula measured on CPU ranks) on this
    stage's layers with the sequence split over CP. Mixed precision saves the blocks in 2-byte numbers
    (the head's log-softmax stays fp32). Checkpointing (:func:`distlab.planner.spec.checkpointing`):

    * ``full``: each block keeps its input (split over TP under SP) and one block is live again in backward;
    * ``selective`` (Korthikanti et al. 2022): every block keeps what the formula counts, but not attention's
      s x s probabilities, which its backward recomputes; with a flash-attention kernel (``flash_attention``,
      the formula's attention) there are none to drop, so selective saves what ``none`` saves;
    * ``none``: every block keeps everything, and without flash attention also the probabilities,
      heads x s x s per sequence (in the compute dtype, split over TP by heads).

    Times the microbatches in flight (:func:`in_flight`). The head (log-softmax over this rank's vocabulary)
    is on the last stage; the embedding output is the first block's input, already counted.
    """
    layers = stage_layers(model.layers, layout.pp, stage)
    dense, moe_blocks = stage_layer_kinds(model, layout.pp, stage)
    seq = model.seq_len // layout.cp
    b = model.micro_batch
    sp = sequence_parallel(options, layout)
    per_rank = tensor_parallel.activation_bytes(stage_config(model, layers, seq), b, seq, layout.tp,
                                                sequence_parallel=sp, kv_dim=model.kv_dim)
    number_bytes = 4 if options.precision == "fp32" else 2
    one_block = block_activation_bytes(model, b, seq, layout.tp, sp, options)
    blocks = [one_block] * dense
    if moe_blocks:
        # a MoE block: the block without its feed-forward, plus moe.saved_activation_bytes (measured on the
        # course's layer) for this rank's tokens: under TP each rank routes 1/tp of them (torchtitan)
        routed = moe.saved_activation_bytes(b * seq // layout.tp, model.hidden, model.expert_ffn, model.experts,
                                            model.top_k, model.shared_experts)
        blocks += [block_activation_bytes(replace(model, ffn=0), b, seq, layout.tp, sp, options)
                   + routed * number_bytes / 4] * moe_blocks
    mode = checkpointing(options)
    if mode == "full":
        block_input = b * seq * model.hidden * number_bytes / (layout.tp if sp else 1)
        per_microbatch, live = layers * block_input, max(blocks, default=0)
    else:
        scores = 0 if options.flash_attention or mode == "selective" else \
            b * model.heads // layout.tp * seq * model.seq_len * number_bytes
        per_microbatch, live = sum(blocks) + layers * scores, 0
    if layout.cp > 1 and options.cp_attention == "all_gather" and mode != "full":
        # all-gather CP: backward needs the whole sequence's keys and values of this rank's heads; kept from forward
        per_microbatch += layers * 2 * b * (model.seq_len - seq) * model.kv_dim_per_tp_rank(layout.tp) * number_bytes
    held = in_flight(options.schedule, layout.pp, stage, microbatches(model, layout), chunks(options))
    head = per_rank["head"] if stage == layout.pp - 1 else 0
    # the last backward runs beside all M kept outputs (their copy, after it: memory_per_gpu)
    return held * per_microbatch + live + head + kept_output_bytes(model, layout, stage, options)


def kept_output_bytes(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> float:
    """The logits torch's pipeline schedules keep on the last stage: every microbatch's output, b s V/t each, in
    fp32 (the root's ``output_dtype``, ``distlab.hybrid.mixed_precision_policy``), until the next step clears
    them (torch 2.13 pipelining/stage.py:907-908; cleared by the next step's ``clear_runtime_states``, schedules.py:772,
    stage.py:609-611). Only for the layouts the planner runs under torch's stage (FSDP under PP), and only with
    ``Options.pp_return_outputs``: ``step``'s default, which the course's scripts turn off."""
    if not (options.pp_return_outputs and layout.zero_stage == 3 and layout.pp > 1 and stage == layout.pp - 1):
        return 0
    return microbatches(model, layout) * model.micro_batch * (model.seq_len // layout.cp) * model.vocab / layout.tp * 4


def state_bytes(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> memory.StateBytes:
    """Parameters, gradients and optimizer state on one GPU: ``memory.zero_state_bytes`` over dp (and cp,
    whose ranks hold the same weights and shard them too, as FSDP over dp x cp does) of this stage's TP share;
    under HSDP over its shard group only (the replicas hold the same shards); a MoE stage's routed experts over
    the ranks that hold the same experts (:attr:`Layout.expert_dp`)."""
    params = stage_params(model, layout, stage)
    state = memory.zero_state_bytes(params["total"] - params["experts"], layout.fsdp_ways, layout.zero_stage,
                                    options.precision)
    if params["experts"]:
        # the experts: ZeRO over the ranks that hold the same experts (dp x cp x tp / ep), as torchtitan's FSDP
        experts = memory.zero_state_bytes(params["experts"], layout.expert_dp, layout.zero_stage, options.precision)
        state = memory.StateBytes(state.params + experts.params, state.grads + experts.grads,
                                  state.optimizer + experts.optimizer)
    return in_mixed_precision(state, layout, options)


def fp32_weights_and_gradients(layout: Layout, options: Options = Options()) -> tuple[bool, bool]:
    """Whether a mixed-precision run keeps (its weights, its gradients) in fp32 instead of the ZeRO paper's bf16
    (``memory.training_state_bytes``: 2 + 2 + 12 bytes a parameter, an fp32 master copy in the optimizer).

    * DDP (ZeRO 0) with torch's layers runs as chapter 04 runs it: bf16 autocast over fp32 weights, so its
      gradients are fp32 too, and the optimizer keeps only the two moments: 4 + 4 + 8 bytes. Torch's DDP copies the
      gradients into buckets of their own dtype (``gradient_as_bucket_view``'s saving "will be equal to the total
      gradients size", torch 2.13 ``nn/parallel/distributed.py:731-735``; counted in
      tests/unit/test_planner_ddp.py): 4 bytes more, and the all-reduce moves 4 (``communication.ledger``).
    * ZeRO-1 runs as Megatron-Core's distributed optimizer: bf16 weights, fp32 gradients in one buffer that its
      buckets are views of, reduce-scattered in fp32 (4), the fp32 master copy and moments sharded: 2 + 4 + 12/d.
    * Megatron's own layers keep a bf16 run's gradients in fp32 under ZeRO 0 to 2 (megatron/training/
      arguments.py:1214-1216, accumulate_allreduce_grads_in_fp32): 2 + 4 + 12.
    * FSDP (ZeRO 3) and ZeRO-2 with torch's layers: the ZeRO paper's 2 + 2 + 12, sharded.
    """
    if options.precision != "mixed" or layout.zero_stage >= 3:
        return False, False
    autocast = layout.zero_stage == 0 and not megatron_layers(options)
    return autocast, autocast or layout.zero_stage == 1 or megatron_layers(options)


def in_mixed_precision(state: memory.StateBytes, layout: Layout, options: Options = Options()) -> memory.StateBytes:
    """``state`` as counted by ``memory.zero_state_bytes`` (the ZeRO paper's mixed precision), recounted with the
    weights and gradients :func:`fp32_weights_and_gradients` keeps in fp32 (an fp32 weight is its own master)."""
    weights, gradients = fp32_weights_and_gradients(layout, options)
    return memory.StateBytes(state.params * (2 if weights else 1), state.grads * (2 if gradients else 1),
                             state.optimizer * (2 / 3 if weights else 1))


def temporary_bytes(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> float:
    """Buffers that live during the step. FSDP (ZeRO-3) resharding every microbatch: :func:`fsdp_backward_buffers`
    (the root kept gathered through backward, ``prefetched_units`` blocks, the unsharded gradients, one
    reduce-scatter input). Kept gathered
    over the microbatches (PP, or ``fsdp_keep_gathered``): the stage's whole weights (under torch's interleaved
    runtime 3 of its V chunks: ``spec.pipeline_gathered_share``), and, with more than one
    microbatch, its unsharded gradients, accumulated in fp32 until the last backward reduces them (FSDP2 upcasts
    them to the reduce dtype: ``FSDPParam.to_accumulated_grad_if_needed``); without resharding after forward
    the whole weights too. DDP: torch's buckets, a second copy of the gradients in their dtype (fp32 under
    autocast: :func:`fp32_weights_and_gradients`; none with ``gradient_as_bucket_view``). ZeRO-1 (Megatron-Core's
    distributed optimizer) and Megatron's layers: none, their buckets are views of the gradient buffer. ZeRO-2: two
    buckets."""
    params = stage_params(model, layout, stage)
    param_bytes = 4 if options.precision == "fp32" else 2
    if layout.zero_stage == 3 and not keeps_gathered(options, layout):
        return fsdp_backward_buffers(params, param_bytes, options.prefetched_units,
                                     reshards_after_forward(options, layout), stage_layers(model.layers, layout.pp,
                                                                                           stage))
    if layout.zero_stage == 3:
        accumulated = params["total"] if microbatches(model, layout) > 1 else params["largest_unit"]
        # under PP at most 3 chunks' weights at once with torch's interleaved runtime (its window); the gradients
        # of every chunk stay unsharded until REDUCE_GRAD
        gathered = pipeline_gathered_share(options) if layout.pp > 1 else 1.0
        return param_bytes * params["total"] * gathered + 4 * accumulated
    if layout.dp * layout.cp == 1:
        return 0.0
    if layout.zero_stage == 2:
        return 2 * 4 * min(params["total"], bucket_params(options, layout))
    if layout.zero_stage == 1 or megatron_layers(options) or options.ddp_bucket_view:
        return 0.0   # the distributed optimizer's and Megatron's buckets are views of their one gradient buffer
    # torch's DDP: buckets of the gradients' own dtype, a second copy of them (fp32 under autocast)
    return state_bytes(model, layout, stage, options).grads


def fsdp_backward_buffers(params: dict, param_bytes: int, prefetched_units: int, reshard_after_forward: bool,
                          layers: int) -> float:
    """FSDP2's buffers at their peak, one microbatch, no PP: while a block computes its backward, as torch 2.13 runs
    it (counted to the byte by torch's ``FSDPMemTracker`` in tests/unit/test_planner_fsdp_buffers.py):

    * gathered, in the compute dtype: the root unit, the whole backward long. Its inputs (token ids) need no
      gradient, so it gets no post-backward hook (``_fsdp_param_group.py:898-900``); it is resharded and reduced only
      in the root's final callback, after all of autograd (``_fsdp_state.py:412-415``). Beside it the block that
      computes and the one prefetched (``prefetched_units``), or, without resharding after forward, every block whose
      backward has not run;
    * unsharded gradients, in the compute dtype: the head's (the output layer's and the final norm's, computed
      first and reduced with the root's, last) and the computing block's;
    * the previous block's reduce-scatter input, in the reduce dtype (fp32): FSDP keeps one in flight
      (``reduce_scatter_max_input_buffers``, 1 by default).

    The largest block stands for every block. With fewer than three blocks this counts a block's buffers more than
    the backward holds. Earlier moments hold less for every preset: the forward, and the root's own reduction at
    the end."""
    root, block = params["root_unit"], params["largest_block"]
    grads = param_bytes * (params["head"] + block)
    if reshard_after_forward:
        return param_bytes * (root + prefetched_units * block) + grads + 4 * block
    # kept from forward: the blocks not yet through backward, less the one resharded before its reduce-scatter
    return param_bytes * (root + (layers - 1) * block) + grads + max(param_bytes, 4) * block


def memory_per_gpu(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> dict:
    """The larger of a stage's two moments: its backward (the state, the activations with the kept outputs, the
    temporary buffers); and, where torch's pipeline keeps the outputs (:func:`kept_output_bytes`), the step's final
    ``torch.cat`` of them (``_merge_outputs``, torch 2.13 schedules.py:794-797, :1995-1997). By then backward has
    freed the activations, and the stage's REDUCE_GRAD (schedules.py:1177, stage.py:1164-1191: FSDP's
    post_backward, _fsdp_param_group.py:626-638) has dropped the unsharded gradients and resharded the weights:
    the state, the reserve and two copies of the outputs are left."""
    state = state_bytes(model, layout, stage, options)
    parts = {"params": state.params, "grads": state.grads, "optimizer": state.optimizer,
             "activations": activation_bytes(model, layout, stage, options),
             "temporary": temporary_bytes(model, layout, stage, options), "reserve": options.reserve_bytes}
    kept = kept_output_bytes(model, layout, stage, options)
    if 2 * kept > parts["activations"] + parts["temporary"]:
        parts["activations"], parts["temporary"] = 2 * kept, 0.0   # the copy's moment is the larger
    parts["total"] = sum(parts.values())
    return parts

