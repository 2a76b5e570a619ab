"""A layout evaluated: :func:`evaluate` returns a :class:`Plan` (memory, communication, bubble, step time, MFU)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from distlab import schedules
from distlab.planner.gemm import block_rate, hardware_of
from distlab.planner.communication import bytes_sent, comm_per_step, dimension_seconds, group_sizes
from distlab.planner.memory import memory_per_gpu, stage_params
from distlab.planner.spec import (GIB, Cluster, Layout, ModelSpec, Options, checkpointing, chunks, keeps_gathered,
                                  layout_problems, microbatches, pipeline_fsdp_gathers, reduces_after_backward,
                                  sequence_parallel, stage_layer_kinds, stage_layers)


@dataclass
class Plan:
    """A layout evaluated: memory per GPU by part, communication per dimension, time. All derived."""

    layout: Layout
    memory_per_gpu_bytes: dict
    gpu_bytes: float
    comm_bytes_per_gpu: dict
    comm_seconds: dict
    bubble: dict
    step_seconds: float
    compute_seconds: float
    mfu: float
    tokens_per_second: float
    problems: list = field(default_factory=list)
    worst_stage: int = 0
    exposed_seconds: dict = field(default_factory=dict)  # the communication left on the critical path
    settings: dict = field(default_factory=dict)         # micro-batch, schedule, checkpointing, SP, FSDP mode
    compute_flops: float = 0.0   # what one GPU of the stage that sets the step computes: model FLOPs + recompute

    def describe_settings(self) -> str:
        """The settings in a few words: ``mb 1, 1F1B x8, full ckpt, SP``."""
        s = self.settings
        if not s:
            return ""
        words = [f"mb {s['micro_batch']}"]
        if self.layout.pp > 1:
            words.append(f"interleaved x{s['chunks']}" if s["chunks"] > 1 else "1F1B" if s["schedule"] != "gpipe"
                         else "GPipe")
        words.append({"none": "no ckpt", "selective": "selective ckpt", "full": "full ckpt"}[s["checkpointing"]])
        if s["sequence_parallel"]:
            words.append("SP")
        if s.get("async_tp"):
            words.append("async TP")
        if s["fsdp_keep_gathered"] and self.layout.pp == 1:
            words.append("FSDP kept gathered")
        return ", ".join(words)

    @property
    def fits(self) -> bool:
        return not self.problems and self.memory_per_gpu_bytes["total"] <= self.gpu_bytes

    @property
    def reason(self) -> str:
        if self.problems:
            return "; ".join(self.problems)
        if not self.fits:
            parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.memory_per_gpu_bytes.items() if k != "total")
            return (f"needs {self.memory_per_gpu_bytes['total'] / GIB:.1f} GiB per GPU ({parts}) "
                    f"> {self.gpu_bytes / GIB:.0f} GiB")
        return "fits"

    def to_dict(self) -> dict:
        return {"layout": asdict(self.layout), "label": self.layout.label(), "fits": self.fits,
                "reason": self.reason, "memory_per_gpu_bytes": self.memory_per_gpu_bytes,
                "gpu_bytes": self.gpu_bytes, "comm_bytes_per_gpu": self.comm_bytes_per_gpu,
                "comm_seconds": self.comm_seconds, "bubble": self.bubble, "step_seconds": self.step_seconds,
                "compute_seconds": self.compute_seconds, "mfu": self.mfu,
                "tokens_per_second": self.tokens_per_second, "worst_stage": self.worst_stage,
                "exposed_seconds": self.exposed_seconds, "settings": self.settings}


def rejected(layout: Layout, cluster: Cluster, problems: list[str]) -> Plan:
    """A layout that is not evaluated, with its reasons."""
    return Plan(layout, {"total": float("nan")}, cluster.gpu_bytes, {}, {}, {}, float("inf"), float("inf"),
                0.0, 0.0, problems)


def last_gemm_flops(model: ModelSpec, moe: bool = False) -> float:
    """FLOPs per token of a block's last GEMM, which full recomputation under PyTorch's non-reentrant checkpoint
    never runs again (``Options.recompute_early_stop``). Its pack hook stops the recomputation once the last tensor
    the forward saved is saved again (torch 2.13 ``utils/checkpoint.py:1128-1131``, ``_StopRecomputationError``).
    That tensor is the input of the block's last GEMM, so the GEMM does not run again, nor what follows it (its
    row-parallel collective: ``communication.ledger``). A dense block's is the MLP's down projection (LLaMA's w2,
    GPT's fc2), 2 h f; a MoE block's the shared expert's down projection where it has one (``distlab.moe``: it runs
    after the routed experts, whose outputs the weighting by the router saves), else none. Counted on torch's
    checkpoint, with and without the early stop, in tests/unit/test_planner_recompute.py."""
    if not moe:
        return 2 * model.hidden * model.ffn
    return 2 * model.hidden * model.expert_ffn * model.shared_experts


def stage_flops(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> dict:
    """FLOPs one GPU of stage ``stage`` computes in a step: ``model`` (what MFU counts: 6 per matmul parameter
    and token, and attention's :meth:`ModelSpec.attention_flops_per_token` per layer, 12 h s for standard heads,
    the full s x s square as PaLM and Megatron count it), ``recompute`` (full: the blocks' forward again, 2 per
    parameter + a third of attention's, less each block's last GEMM under PyTorch's early stop
    (:func:`last_gemm_flops`); selective: attention's core forward, a third; none: 0), ``forward`` and
    ``attention`` (the share CP's ring hides behind). Split over tp x cp."""
    layers = stage_layers(model.layers, layout.pp, stage)
    dense, moe_blocks = stage_layer_kinds(model, layout.pp, stage)
    # the parameters a token uses in this stage's blocks (a MoE block: its top-k experts): with EP a rank computes
    # other ranks' tokens in its experts, as many as it sends away under uniform routing, so the FLOPs per rank hold
    active = dense * model.block_active_params() + moe_blocks * model.block_active_params(moe=True)
    attention = model.attention_flops_per_token()   # 12 h s for standard heads
    head = sum(model.head_params(tied_copy=True).values()) if stage == layout.pp - 1 else 0
    mode = checkpointing(options)
    recompute = {"full": 2 * active + layers * attention / 3, "selective": layers * attention / 3, "none": 0}[mode]
    if mode == "full" and options.recompute_early_stop:
        recompute -= dense * last_gemm_flops(model) + moe_blocks * last_gemm_flops(model, moe=True)
    tokens = model.global_batch * model.seq_len / layout.dp / (layout.tp * layout.cp)
    return {"model": tokens * (6 * active + layers * attention + 6 * head),
            "recompute": tokens * recompute,
            "forward": tokens * (2 * active + layers * attention / 3 + 2 * head),
            "attention": tokens * layers * attention * (1 + (mode != "none") / 3)}


def compute_rate(model: ModelSpec, cluster: Cluster, layout: Layout, options: Options = Options()) -> float:
    """FLOP/s one GPU reaches on the model's compute: the block rate of one TP rank (planner.gemm.block_rate: the
    block's FLOPs over the time of its GEMMs at their shapes' roofline plus a fixed cost each, and of its norms,
    softmax and element-wise kernels at the memory's rate) x the kernel-gap factor (``Cluster.gemm_time_share``,
    fitted once per GPU type), which covers what the block model leaves out: gaps between kernels, launches."""
    rate = block_rate(model, hardware_of(cluster), layout.tp, layout.cp, model.micro_batch, options.flash_attention,
                      layout.ep, sequence_parallel(options, layout))
    return rate * cluster.gemm_time_share


def stage_time(model: ModelSpec, cluster: Cluster, layout: Layout, stage: int, options: Options = Options()) -> dict:
    """One stage's step without the bubble: its compute at the block rate x ``gemm_time_share``, and the
    communication that does not hide behind it, per dimension (seconds):

    * tp sits on the critical path between dependent matmuls: all of it (``async_tp``: what exceeds compute);
    * dp hides as far as the schedule lets it: DDP and ZeRO-1 reduce the gradients during the last
      microbatch's backward, ZeRO-2 each microbatch's during that microbatch's backward, and ZeRO gathers the
      updated parameters during the next step's first forward (Megatron's overlap of both); FSDP kept gathered without PP likewise; FSDP under PP gathers first during the first forward,
      gathers again (``spec.pipeline_fsdp_gathers``) behind the step's compute, and, as torch's pipeline stage
      runs it, reduce-scatters after each chunk's last backward, and the compute stream waits for them
      (``Options.pp_fsdp_grad_sync``): exposed; FSDP resharding every microbatch hides each microbatch's gathers
      and reduce-scatters behind that microbatch's compute, except the first unit's gather, which nothing
      precedes;
    * replicate (HSDP) hides behind backward, like the reduce-scatters it follows (under PP: exposed with them);
    * cp hides behind attention's compute;
    * pp is counted by :func:`evaluate` (the fill and the drain).
    """
    flops = stage_flops(model, layout, stage, options)
    rate = compute_rate(model, cluster, layout, options)
    compute = (flops["model"] + flops["recompute"]) / rate
    m = microbatches(model, layout)
    forward, backward = flops["forward"] / rate / m, compute / m - flops["forward"] / rate / m
    seconds = dimension_seconds(model, cluster, layout, stage, options)
    exposed = {"tp": seconds["tp"]["total"] if not options.async_tp else max(0.0, seconds["tp"]["total"] - compute)}
    payload = comm_per_step(model, layout, stage, options, cluster.gpus_per_node)["dp"]
    after = reduces_after_backward(options, layout)
    dp = seconds["dp"]["total"]
    if dp:
        gathered = payload.get("all_gather", 0)
        share = gathered / sum(payload.values())  # split the dimension's time by bytes (same ring, same link)
        gather, reduce = dp * share, dp * (1 - share)
        group = layout.fsdp_ways
        if layout.zero_stage == 3 and not keeps_gathered(options, layout):
            unit = stage_params(model, layout, stage)["largest_unit"] * (4 if options.precision == "fp32" else 2)
            first = unit * (group - 1) / group / _link(cluster, layout, "dp")[0] + (group - 1) * _link(
                cluster, layout, "dp")[1]
            exposed["dp"] = m * (max(0.0, dp / m - (forward + backward)) + first)
        elif layout.zero_stage == 2:
            # ZeRO-2 reduce-scatters each microbatch's gradients from that microbatch's backward hooks (DeepSpeed,
            # stage_1_and_2.py:1767-1768): each of the M hides behind its own microbatch's backward
            exposed["dp"] = max(0.0, gather - forward) + m * max(0.0, reduce / m - backward)
        elif layout.zero_stage == 3 and layout.pp > 1:
            # torch's pipeline schedules: each unit's first gather of the step is prefetched and hides behind the
            # first micro-batch's forward of the stage, as far as it lasts (the step's very first unit's own wait,
            # one unit's gather, is left out: milliseconds in a step of seconds, chapter 11.3); the re-gathers (the interleaved runtime's window, or resharding after forward) are issued ahead of
            # the compute that needs them (the runtime's async unshard, FSDP's prefetch) and hide behind the step
            again = 1 - 1 / pipeline_fsdp_gathers(model, layout, stage, options)
            exposed["dp"] = (max(0.0, gather * (1 - again) - forward) + max(0.0, gather * again - compute)
                             + max(0.0, reduce - (0.0 if after else backward)))
        else:
            exposed["dp"] = max(0.0, gather - forward) + max(0.0, reduce - (0.0 if after else backward))
    else:
        exposed["dp"] = 0.0
    # HSDP's all-reduces over the replicas follow each unit's reduce-scatter: hidden as far as the backward of
    # each microbatch lasts, or (kept gathered) of the last microbatch; under PP, after it, with the reduce-scatters
    replicate = seconds["replicate"]["total"]
    if layout.zero_stage == 3 and not keeps_gathered(options, layout):
        exposed["replicate"] = m * max(0.0, replicate / m - backward)
    else:
        exposed["replicate"] = max(0.0, replicate - (0.0 if after else backward))
    # the ring hides behind attention's blocks; Llama 3's all-gathers sit on the critical path (its section 3.3.2)
    exposed["cp"] = seconds["cp"]["total"] if options.cp_attention == "all_gather" else \
        max(0.0, seconds["cp"]["total"] - flops["attention"] / rate)
    # EP's all-to-alls sit between the router and the experts, and the experts and the next block: on the
    # critical path, unless ``ep_overlap`` (DeepSeek-V3's DualPipe) hides them behind another microbatch's compute. The
    # experts' gradient collectives hide behind backward like the replicas' all-reduces
    exposed["ep"] = max(0.0, seconds["ep"]["total"] - compute) if options.ep_overlap else seconds["ep"]["total"]
    expert_dp = seconds["expert_dp"]["total"]
    if layout.zero_stage == 3 and not keeps_gathered(options, layout):
        exposed["expert_dp"] = m * max(0.0, expert_dp / m - backward)
    else:
        # under PP the experts' reduce-scatters run in the same REDUCE_GRAD as the rest: after each chunk's last
        # backward
        exposed["expert_dp"] = max(0.0, expert_dp - (0.0 if after else backward))
    return {"compute": compute, "forward_per_microbatch": forward, "exposed": exposed, "seconds": seconds,
            "flops": flops}


def _link(cluster: Cluster, layout: Layout, dimension: str) -> tuple[float, float]:
    from distlab.planner.communication import crosses_nodes

    across = crosses_nodes(layout, dimension, cluster)
    return ((cluster.inter_node_bytes_per_s, cluster.inter_node_latency_s) if across
            else (cluster.intra_node_bytes_per_s, cluster.intra_node_latency_s))


def evaluate(model: ModelSpec, cluster: Cluster, layout: Layout, options: Options = Options(),
             gpus: int | None = None) -> Plan:
    """One layout with concrete settings (None read as in :class:`Options`): memory per GPU (the stage that
    needs most), communication, bubble, step time, MFU; all derived.

    The step is set by the slowest stage (of the first, which holds the most layers and the embedding, and
    the last, which holds the head; of a MoE model also the first with the most MoE blocks): its compute and exposed communication, times (1 + bubble of the ideal
    time), plus the pipeline's sends on the fill and the drain (2 (P - 1) transfers of one microbatch's
    activation) and every message's latency. MFU = model FLOPs (no recomputation) / (step x dense peak).
    """
    problems = layout_problems(model, cluster, layout, gpus, options)
    if problems:
        return rejected(layout, cluster, problems)
    stages = {0, layout.pp - 1}
    if model.is_moe:   # the first stage with the most MoE blocks: its experts may outweigh the ends' extra parts
        stages.add(max(range(layout.pp), key=lambda s: (stage_layer_kinds(model, layout.pp, s)[1], -s)))
    stages = sorted(stages)
    memories = {s: memory_per_gpu(model, layout, s, options) for s in stages}
    worst = max(memories, key=lambda s: memories[s]["total"])
    times = {s: stage_time(model, cluster, layout, s, options) for s in stages}
    busy = {s: t["compute"] + sum(t["exposed"][d] for d in ("tp", "dp", "cp", "replicate", "ep", "expert_dp"))
            for s, t in times.items()}
    slowest = max(busy, key=busy.get)
    timing = times[slowest]
    m, v = microbatches(model, layout), chunks(options)
    share = schedules.bubble_fraction(layout.pp, m, v)
    bubble_seconds = busy[slowest] * (layout.pp - 1) / (v * m)
    exposed = dict(timing["exposed"])
    exposed["pp"] = 0.0
    if layout.pp > 1:
        pp = timing["seconds"]["pp"]
        sends = sum(comm_per_step(model, layout, slowest, options, cluster.gpus_per_node)["pp"].values())
        calls = max(1, round(pp["latency"] / _link(cluster, layout, "pp")[1])) if pp["latency"] else 1
        exposed["pp"] = 2 * (layout.pp - 1) * pp["bandwidth"] / calls + pp["latency"] if sends else 0.0
    step = busy[slowest] + bubble_seconds + exposed["pp"]
    tokens = model.global_batch * model.seq_len
    model_flops_per_gpu = model.flops_per_token() * tokens / layout.gpus
    mfu = model_flops_per_gpu / (step * cluster.peak_flops)
    comm_seconds = {d: t["total"] for d, t in timing["seconds"].items()}
    comm = comm_per_step(model, layout, slowest, options, cluster.gpus_per_node)
    sizes = group_sizes(layout)
    comm_bytes = {d: {"payload": c, "sent": bytes_sent(d, c, sizes[d])} for d, c in comm.items()}
    bubble = {"of_step": share, "of_ideal": (layout.pp - 1) / (v * m), "seconds": bubble_seconds}
    settings = {"micro_batch": model.micro_batch, "schedule": options.schedule if layout.pp > 1 else "none",
                "chunks": v, "checkpointing": checkpointing(options),
                "sequence_parallel": sequence_parallel(options, layout),
                "fsdp_keep_gathered": keeps_gathered(options, layout),
                "async_tp": bool(options.async_tp) and layout.tp > 1}
    return Plan(layout, memories[worst], cluster.gpu_bytes, comm_bytes, comm_seconds, bubble, step,
                timing["compute"], mfu, tokens / step, [], worst, exposed, settings,
                timing["flops"]["model"] + timing["flops"]["recompute"])
