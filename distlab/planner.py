"""Choosing a strategy (chapter 11): memory, communication, bubble and step time of a (pp, dp, cp, tp) layout,
and a search over every layout of a GPU count.

Inputs are three small dataclasses: a :class:`ModelSpec` (a named preset or your own sizes), a
:class:`Cluster` (GPUs per node, memory, dense peak, bandwidths) and :class:`Options` (ZeRO stage, FSDP
reshard, activation checkpointing, precision, sequence parallelism, pipeline schedule, micro-batch). A
:class:`Layout` says how many ways each dimension splits. :func:`evaluate` returns a :class:`Plan`: memory
per GPU by part, bytes each GPU sends per step per mesh dimension, the bubble, the estimated step time, MFU,
and whether it fits (and why not). :func:`search` evaluates every valid layout and ranks them.

Conventions (chapters/00_conventions.md), used everywhere here:

* memory in GiB (2^30 bytes): a "40 GB" A100 has 40 GiB; bandwidths in GB/s (10^9 bytes/s), one direction;
* peaks are dense (no sparsity): A100 bf16 312 TFLOP/s, H100 SXM 989 (from ``distlab.metrics.PEAK_FLOPS``);
* the bubble is quoted both ways: (P-1)/(V M) of the ideal time, and (P-1)/(V M + P-1) of the step.

Nothing here is new arithmetic where the course already has it: the training state is
``memory.zero_state_bytes``, the activations ``tensor_parallel.activation_bytes`` (the fp32 formula measured
equal on CPU ranks, scaled to bf16 as ``distlab.sizing`` does), the TP collectives
``tensor_parallel.tp_comm_formula``, the DP collectives ``comm.zero_step_bytes``, the pipeline sends
``hybrid_pipeline.pp_send_bytes``, the bubble ``schedules.bubble_fraction``, ring bytes
``comm.bytes_sent_per_rank``. The tests prove the result against measured runs (chapters 05 and 09), the
meta-device models, the chapter 07 simulator and chapter 09's sizing guide.

Everything a plan states about a real cluster is *derived* (a model of the hardware, not a measurement).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace

from distlab import comm, hybrid_pipeline, memory, metrics, models, schedules, sizing, tensor_parallel

GIB = memory.GIB
GB = 1e9

# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and the batch it trains on.

    ``architecture="llama"``: RMSNorm, SwiGLU (3 matrices of ``hidden x ffn``), grouped-query attention,
    untied embedding and output, no biases, rotary positions. ``"gpt"``: LayerNorm with bias, a 2-matrix GELU
    MLP with biases, biased attention projections, learned positions, output tied to the embedding (under
    PP the last stage keeps its own copy of the tied matrix, as Megatron does).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    micro_batch: int = 1
    global_batch: int = 1
    architecture: str = "llama"
    source: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def block_params(self) -> dict:
        """One block's parameters: ``sharded`` (split by TP: the matrices and column-parallel biases) and
        ``replicated`` (norms and the biases added after a row-parallel matrix)."""
        h, f = self.hidden, self.ffn
        if self.architecture == "gpt":
            attention = h * h + 2 * h * self.kv_dim + (h + 2 * self.kv_dim)  # q, k, v weights and biases
            return {"sharded": attention + h * h + 2 * h * f + f, "replicated": 4 * h + 2 * h}
        return {"sharded": 2 * h * h + 2 * h * self.kv_dim + 3 * h * f, "replicated": 2 * h}

    def embedding_params(self) -> dict:
        positions = self.seq_len * self.hidden if self.architecture == "gpt" else 0
        return {"sharded": self.vocab * self.hidden, "replicated": positions}

    def head_params(self, tied_copy: bool = True) -> dict:
        """Final norm and output projection (for a tied GPT, the copy a separate last stage holds)."""
        norm = 2 * self.hidden if self.architecture == "gpt" else self.hidden
        output = 0 if self.architecture == "gpt" and not tied_copy else self.vocab * self.hidden
        return {"sharded": output, "replicated": norm}

    def num_params(self) -> int:
        block = self.block_params()
        return (sum(self.embedding_params().values()) + self.layers * (block["sharded"] + block["replicated"])
                + sum(self.head_params(tied_copy=False).values()))

    def matmul_params(self) -> int:
        """The parameters that multiply (all but the embedding lookup and position table): 6 FLOPs each per token."""
        return self.num_params() - self.vocab * self.hidden * (self.architecture != "gpt") \
            - self.embedding_params()["replicated"]

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6 N + 12 L h s (``metrics.transformer_flops_per_token``'s accounting)."""
        return 6 * self.matmul_params() + 12 * self.layers * self.hidden * self.seq_len

    def config(self) -> models.TransformerConfig:
        """The course's TransformerConfig of the same sizes (what the activation and TP formulas take)."""
        return models.TransformerConfig(vocab_size=self.vocab, dim=self.hidden, n_layers=self.layers,
                                        n_heads=self.heads, ffn_hidden=self.ffn, seq_len=self.seq_len)

    def to_dict(self) -> dict:
        return asdict(self)


def from_llama_shape(shape: sizing.LlamaShape, seq_len: int = 4096, global_batch: int = 1024) -> ModelSpec:
    return ModelSpec(shape.name.lower(), shape.n_layers, shape.dim, shape.n_heads, shape.n_kv_heads,
                     shape.ffn_hidden, shape.vocab_size, seq_len, 1, global_batch, "llama", shape.source)


def from_config(cfg: models.TransformerConfig, micro_batch: int, global_batch: int, name: str = "course") -> ModelSpec:
    """The course's own transformer (chapters 01-09): multi-head attention, untied, LLaMA-style."""
    return ModelSpec(name, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_heads, cfg.ffn_hidden, cfg.vocab_size,
                     cfg.seq_len, micro_batch, global_batch, "llama", "distlab.models")


# LLaMA-style 1B-70B: chapter 09's shapes (distlab.sizing), written once. Batches: ~4M tokens a step.
MODELS: dict[str, ModelSpec] = {name.lower(): from_llama_shape(shape) for name, shape in sizing.LLAMA_SHAPES.items()}
MODELS["405b"] = ModelSpec("405b", 126, 16384, 128, 8, 53248, 128256, 8192, 1, 2048, "llama",
                           "LLaMA 3.1 405B (Llama Team, 2024: 126 layers, 16M tokens a step)")
MODELS["gpt3-175b"] = ModelSpec("gpt3-175b", 96, 12288, 96, 96, 4 * 12288, 50257, 2048, 1, 1536, "gpt",
                                "GPT-3 175B (Brown et al., 2020: batch 3.2M tokens)")
MODELS["mt-nlg-530b"] = ModelSpec("mt-nlg-530b", 105, 20480, 128, 128, 4 * 20480, 50257, 2048, 1, 1920, "gpt",
                                  "Megatron-Turing NLG 530B (Smith et al., 2022: batch 1920)")


# --------------------------------------------------------------------------------------------------
# Clusters
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """One kind of node. Bandwidths are per GPU and one direction; ``peak_flops`` is dense, for ``dtype``."""

    name: str
    gpus_per_node: int
    gpu_bytes: float
    peak_flops: float
    dtype: str
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


CLUSTERS: dict[str, Cluster] = {
    "a100-40gb": Cluster("a100-40gb", 4, 40 * GIB, metrics.PEAK_FLOPS[("A100", "bf16")], "bf16",
                         tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S,
                         tensor_parallel.SLINGSHOT11_NIC_BYTES_PER_S,
                         "Derecho-like: 4 x A100-40GB, NVLink 3, one Slingshot 11 NIC (200 Gb/s) per GPU"),
    "a100-80gb": Cluster("a100-80gb", 8, 80 * GIB, metrics.PEAK_FLOPS[("A100", "bf16")], "bf16",
                         tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S, 200e9 / 8,
                         "DGX A100: 8 x A100-80GB, NVLink 3, one 200 Gb/s InfiniBand HDR NIC per GPU"),
    "h100-80gb": Cluster("h100-80gb", 8, 80 * GIB, metrics.PEAK_FLOPS[("H100", "bf16")], "bf16",
                         900e9 / 2, 400e9 / 8,
                         "DGX H100: 8 x H100-80GB SXM, NVLink 4 (900 GB/s both ways), one 400 Gb/s NDR NIC per GPU"),
    "v100-32gb": Cluster("v100-32gb", 8, 32 * GIB, 125e12, "fp16", 300e9 / 2, 100e9 / 8,
                         "8 x V100-32GB SXM2 (fp16 tensor cores 125 TFLOP/s dense; no bf16), NVLink 2, "
                         "100 Gb/s per GPU"),
}


# --------------------------------------------------------------------------------------------------
# Options and layouts
# --------------------------------------------------------------------------------------------------

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


@dataclass(frozen=True)
class Options:
    """How the model trains. Every field is printed beside the plans it produces."""

    zero_stage: int | None = None          # 0 DDP, 1, 2, 3 FSDP; None: the search tries ZERO_STAGES
    context_parallel: int | None = None    # CP degree; None: the search tries those of long enough shares
    cp_min_tokens: int = 8192              # the search's CP: at least this many tokens of a sequence per rank
    reshard_after_forward: bool = True     # FSDP: gather again for backward (PP keeps stages gathered instead)
    activation_checkpointing: bool = True  # every block recomputed in backward
    precision: str = "mixed"               # "mixed" (bf16/fp16 compute, fp32 master) or "fp32"
    sequence_parallel: bool = False        # Megatron SP: activations between TP regions split over TP
    schedule: str = "1f1b"
    chunks: int = 1                        # stages per rank (interleaved_1f1b)
    reserve_bytes: float = 4 * GIB         # CUDA context, NCCL buffers, fragmentation (chapter 09's reserve)
    prefetched_units: int = 2              # FSDP units gathered at once (computing + prefetched)
    ddp_bucket_view: bool = False          # DDP: gradient_as_bucket_view (else its buckets copy the grads)
    bucket_bytes: float = 25 * 2**20       # DDP/ZeRO bucket size (DDP's bucket_cap_mb=25)
    compute_efficiency: float = 0.6        # share of the dense peak the matrix multiplies reach (assumed)

    def to_dict(self) -> dict:
        return asdict(self)


ZERO_STAGES = (0, 1, 3)  # what the search tries when Options.zero_stage is None: DDP, ZeRO-1, FSDP


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    zero_stage: int = 0

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def label(self) -> str:
        text = f"tp={self.tp},pp={self.pp},dp={self.dp}"
        return (text + (f",cp={self.cp}" if self.cp > 1 else "")) + f",zero={self.zero_stage}"


def parse_layout(text: str, zero_stage: int = 0) -> Layout:
    """``"tp=8,pp=8,dp=16"`` (any order; cp= and zero= optional) as a :class:`Layout`; ValueError if malformed."""
    sizes = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        key, _, value = part.partition("=")
        if key not in ("tp", "pp", "dp", "cp", "zero") or not value.isdigit():
            raise ValueError(f"--layout {text!r}: write it like tp=8,pp=8,dp=16 (keys tp, pp, dp, cp, zero)")
        sizes["zero_stage" if key == "zero" else key] = int(value)
    sizes.setdefault("zero_stage", zero_stage)
    return Layout(**sizes)


def layout_problems(model: ModelSpec, cluster: Cluster, layout: Layout, gpus: int | None = None,
                    options: Options = Options()) -> list[str]:
    """Every reason ``layout`` cannot run ``model`` on ``gpus`` GPUs of ``cluster`` (empty when it can)."""
    t, p, d, c = layout.tp, layout.pp, layout.dp, layout.cp
    if min(t, p, d, c) < 1:
        return [f"every size must be at least 1, not {layout.label()}"]
    problems = []
    if gpus is not None and layout.gpus != gpus:
        problems.append(f"tp x pp x dp x cp = {layout.gpus} is not the {gpus} GPUs")
    if layout.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage must be 0, 1, 2 or 3, not {layout.zero_stage}")
    if t > cluster.gpus_per_node:
        problems.append(f"TP {t} is larger than a node's {cluster.gpus_per_node} GPUs (TP stays on NVLink)")
    for label, value in (("attention heads", model.heads), ("key/value heads", model.kv_heads),
                         ("hidden size", model.hidden), ("feed-forward size", model.ffn)):
        if value % t:
            problems.append(f"{value} {label} do not split over TP {t}")
    if p > model.layers:
        problems.append(f"PP {p} is more stages than the {model.layers} layers")
    if p * options.chunks > model.layers:
        problems.append(f"PP {p} x {options.chunks} chunks is more stages than the {model.layers} layers")
    if model.seq_len % c or (options.sequence_parallel and (model.seq_len // c) % t):
        problems.append(f"sequence length {model.seq_len} does not split over CP {c}"
                        + (f" x SP {t}" if options.sequence_parallel else ""))
    if model.global_batch % (d * model.micro_batch):
        problems.append(f"global batch {model.global_batch} does not split into dp x micro-batch = "
                        f"{d} x {model.micro_batch} equal parts")
    return problems


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


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
                "tokens_per_second": self.tokens_per_second, "worst_stage": self.worst_stage}


def stage_layers(layers: int, pp: int, stage: int) -> int:
    """Layers of stage ``stage`` when ``layers`` do not divide: the first ``layers % pp`` stages take one more."""
    return layers // pp + (1 if stage < layers % pp else 0)


def stage_params(model: ModelSpec, layout: Layout, stage: int) -> dict:
    """Parameters one TP rank of pipeline stage ``stage`` holds: ``{"sharded", "replicated", "total"}``
    (the sharded ones already divided by TP), and its largest FSDP unit (a block, or the embedding/head)."""
    block = model.block_params()
    layers = stage_layers(model.layers, layout.pp, stage)
    sharded = layers * block["sharded"]
    replicated = layers * block["replicated"]
    units = [block["sharded"] / layout.tp + block["replicated"]] if layers else []
    root_sharded = root_replicated = 0
    if stage == 0:
        embedding = model.embedding_params()
        root_sharded += embedding["sharded"]
        root_replicated += embedding["replicated"]
    if stage == layout.pp - 1:
        head = model.head_params(tied_copy=layout.pp > 1)
        root_sharded += head["sharded"]
        root_replicated += head["replicated"]
    if root_sharded or root_replicated:
        units.append(root_sharded / layout.tp + root_replicated)
    sharded_per_rank = (sharded + root_sharded) / layout.tp
    return {"sharded": sharded_per_rank, "replicated": replicated + root_replicated,
            "total": sharded_per_rank + replicated + root_replicated, "largest_unit": max(units)}


def microbatches(model: ModelSpec, layout: Layout) -> int:
    """Microbatches per step on one replica: global batch / (dp x micro-batch)."""
    return max(1, model.global_batch // (layout.dp * model.micro_batch))


def in_flight(schedule: str, pp: int, stage: int, num_microbatches: int, chunks: int = 1) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak, in whole-stage units (closed forms of
    ``schedules.peak_activations``, tested equal to it): GPipe M; 1F1B min(P - s, M); interleaved
    min((V-1)P + 2(P-1-s) + 1, V M) chunk-microbatches of 1/V of a stage each."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "1f1b":
        return min(pp - stage, num_microbatches)
    if schedule == "interleaved_1f1b":
        return min((chunks - 1) * pp + 2 * (pp - 1 - stage) + 1, chunks * num_microbatches) / chunks
    raise ValueError(f"schedule must be one of {PIPELINE_SCHEDULES}, not {schedule!r}")


def _stage_config(model: ModelSpec, layers: int, seq_len: int) -> models.TransformerConfig:
    return replace(model.config(), n_layers=max(layers, 1), seq_len=seq_len)


def activation_bytes(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> float:
    """Saved activations on one GPU of stage ``stage`` at its peak (the start of backward).

    Per microbatch, from ``tensor_parallel.activation_bytes`` (the fp32 formula measured on CPU ranks) on this
    stage's layers with the sequence split over CP. Mixed precision saves the blocks in 2-byte numbers
    (the head's log-softmax stays fp32). Checkpointed: each block keeps its input (split over TP under SP)
    and one block is live again in backward. Times the microbatches in flight (:func:`in_flight`). The head
    (log-softmax over this rank's vocabulary) is on the last stage; the embedding output is the first block's
    input, already counted.
    """
    layers = stage_layers(model.layers, layout.pp, stage)
    seq = model.seq_len // layout.cp
    b = model.micro_batch
    per_rank = tensor_parallel.activation_bytes(_stage_config(model, layers, seq), b, seq, layout.tp,
                                                sequence_parallel=options.sequence_parallel, kv_dim=model.kv_dim)
    number_bytes = 4 if options.precision == "fp32" else 2
    one_block = per_rank["per_layer"] * number_bytes / 4
    if options.activation_checkpointing:
        block_input = b * seq * model.hidden * number_bytes / (layout.tp if options.sequence_parallel else 1)
        per_microbatch, live = layers * block_input, one_block
    else:
        per_microbatch, live = layers * one_block, 0
    held = in_flight(options.schedule, layout.pp, stage, microbatches(model, layout), options.chunks)
    head = per_rank["head"] if stage == layout.pp - 1 else 0
    return held * per_microbatch + live + head


def state_bytes(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> memory.StateBytes:
    """Parameters, gradients and optimizer state on one GPU: ``memory.zero_state_bytes`` over dp (and cp,
    whose ranks hold the same weights and shard them too, as FSDP over dp x cp does) of this stage's TP share."""
    held = stage_params(model, layout, stage)["total"]
    return memory.zero_state_bytes(held, layout.dp * layout.cp, layout.zero_stage, options.precision)


def temporary_bytes(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> float:
    """Buffers that live during the step. FSDP (ZeRO-3): ``prefetched_units`` gathered copies of the largest
    unit plus its full gradient before the reduce-scatter (``distlab.sizing``'s accounting); without resharding
    after forward (and under PP) every unit stays gathered until its backward: the stage's whole weights.
    DDP and ZeRO-1:
    DDP's buckets, a second copy of the gradients (none with ``gradient_as_bucket_view``). ZeRO-2: two buckets."""
    params = stage_params(model, layout, stage)
    param_bytes = 4 if options.precision == "fp32" else 2
    if layout.zero_stage == 3 and (options.reshard_after_forward and layout.pp == 1):
        # even on one rank: FSDP's unsharded (bf16) copies are made unit by unit
        return (options.prefetched_units * param_bytes + 4) * params["largest_unit"]
    if layout.zero_stage == 3:
        # kept gathered from forward to backward (no reshard, or a pipeline stage): the whole stage's weights
        return param_bytes * params["total"] + 4 * params["largest_unit"]
    if layout.dp * layout.cp == 1:
        return 0.0
    if layout.zero_stage == 2:
        return 2 * options.bucket_bytes
    grads = state_bytes(model, replace(layout, zero_stage=0), stage, options).grads
    return 0.0 if options.ddp_bucket_view else grads


def memory_per_gpu(model: ModelSpec, layout: Layout, stage: int, options: Options = Options()) -> dict:
    state = state_bytes(model, layout, stage, options)
    parts = {"params": state.params, "grads": state.grads, "optimizer": state.optimizer,
             "activations": activation_bytes(model, layout, stage, options),
             "temporary": temporary_bytes(model, layout, stage, options), "reserve": options.reserve_bytes}
    parts["total"] = sum(parts.values())
    return parts


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
        cfg = _stage_config(model, layers, seq)
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


def rejected(layout: Layout, cluster: Cluster, problems: list[str]) -> Plan:
    """A layout that is not evaluated, with its reasons."""
    return Plan(layout, {"total": float("nan")}, cluster.gpu_bytes, {}, {}, {}, float("inf"), float("inf"),
                0.0, 0.0, problems)


def evaluate(model: ModelSpec, cluster: Cluster, layout: Layout, options: Options = Options(),
             gpus: int | None = None) -> Plan:
    """One layout: memory per GPU (the stage that needs most), communication, bubble, time, MFU; derived."""
    problems = layout_problems(model, cluster, layout, gpus, options)
    if problems:
        return rejected(layout, cluster, problems)
    memories = {s: memory_per_gpu(model, layout, s, options) for s in {0, layout.pp - 1}}
    worst = max(memories, key=lambda s: memories[s]["total"])
    sizes = {"tp": layout.tp, "dp": layout.dp * layout.cp, "pp": layout.pp, "cp": layout.cp}
    # communication and its time: the busier of the first and last stage
    comm_by_stage = {s: comm_per_step(model, layout, s, options) for s in {0, layout.pp - 1}}
    seconds_by_stage = {}
    for s, per_dimension in comm_by_stage.items():
        seconds_by_stage[s] = {}
        for dimension, collectives in per_dimension.items():
            link = cluster.inter_node_bytes_per_s if crosses_nodes(layout, dimension, cluster) \
                else cluster.intra_node_bytes_per_s
            seconds_by_stage[s][dimension] = bytes_sent(dimension, collectives, sizes[dimension]) / link
    busiest = max(seconds_by_stage, key=lambda s: sum(seconds_by_stage[s].values()))
    comm_seconds = seconds_by_stage[busiest]
    comm_bytes = {d: {"payload": c, "sent": bytes_sent(d, c, sizes[d])} for d, c in comm_by_stage[busiest].items()}

    # compute: model FLOPs per GPU per step, recomputation adds one forward (2 of the 6), at an assumed efficiency
    tokens = model.global_batch * model.seq_len
    model_flops_per_gpu = model.flops_per_token() * tokens / layout.gpus
    hardware_flops = model_flops_per_gpu * (8 / 6 if options.activation_checkpointing else 1)
    compute = hardware_flops / (cluster.peak_flops * options.compute_efficiency)
    num_micro = microbatches(model, layout)
    chunks = options.chunks if options.schedule == "interleaved_1f1b" else 1
    share = schedules.bubble_fraction(layout.pp, num_micro, chunks)
    bubble = {"of_step": share, "of_ideal": (layout.pp - 1) / (chunks * num_micro),
              "seconds": compute * share / (1 - share)}
    # what does not overlap: TP's collectives sit between matmuls (all exposed); DP's hide behind compute up
    # to the compute's length; PP's sends delay the fill and the drain only (2 (P-1) transfers of one
    # microbatch); CP's ring hides behind attention (12 L h s of the flops per token)
    exposed = comm_seconds.get("tp", 0.0)
    exposed += max(0.0, comm_seconds.get("dp", 0.0) - compute)
    if layout.pp > 1:
        exposed += comm_seconds["pp"] / (2 * num_micro) * 2 * (layout.pp - 1)
    if layout.cp > 1:
        attention_share = 12 * model.layers * model.hidden * model.seq_len / model.flops_per_token()
        exposed += max(0.0, comm_seconds["cp"] - compute * attention_share)
    step = compute + bubble["seconds"] + exposed
    mfu = model_flops_per_gpu / (step * cluster.peak_flops)
    return Plan(layout, memories[worst], cluster.gpu_bytes, comm_bytes, comm_seconds, bubble, step, compute, mfu,
                tokens / step, [], worst)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_degrees(model: ModelSpec, ways: int, options: Options = Options()) -> list[int]:
    """The CP degrees the search evaluates where ``ways`` GPUs are left after TP and PP: ``options.context_parallel``
    when it is set; else 1 and every divisor of ``ways`` that leaves each rank at least ``options.cp_min_tokens``
    tokens of a sequence (an assumption, stated: the estimate counts CP's bytes, which hide behind attention, but
    not what CP costs on short shares, where smaller blocks keep the matrix units less busy and every ring step of
    every layer adds a message's latency; LLaMA 3 405B used CP 16 only for its 128K-token stage, 8K per rank)."""
    if options.context_parallel is not None:
        return [options.context_parallel] if ways % options.context_parallel == 0 else []
    return [c for c in divisors(ways) if c == 1 or model.seq_len // c >= options.cp_min_tokens]


def candidate_layouts(model: ModelSpec, cluster: Cluster, gpus: int, options: Options = Options()) -> list[Layout]:
    """Every (tp, pp, cp, dp) with tp x pp x cp x dp = gpus: tp a divisor of the node, every CP degree (only
    ``options.context_parallel`` when it is set), each ZeRO stage tried. Sizes that do not divide the model (heads
    over TP, layers over PP, the sequence over CP, the batch over DP) stay in the list: :func:`evaluate` rejects
    them with their reason, and :func:`search` the CP degrees :func:`cp_degrees` leaves out."""
    stages = (options.zero_stage,) if options.zero_stage is not None else ZERO_STAGES
    layouts = []
    for tp in divisors(cluster.gpus_per_node):
        if gpus % tp:
            continue
        for pp in divisors(gpus // tp):
            rest = gpus // (tp * pp)
            for cp in divisors(rest) if options.context_parallel is None else cp_degrees(model, rest, options):
                for stage in stages:
                    layouts.append(Layout(tp, pp, rest // cp, cp, stage))
    return layouts


def search_rule_problems(model: ModelSpec, layout: Layout, options: Options = Options()) -> list[str]:
    """The search's own reason to leave a layout out (a CP share shorter than ``options.cp_min_tokens``)."""
    if layout.cp in cp_degrees(model, layout.cp * layout.dp, options):
        return []
    return [f"CP {layout.cp} leaves {model.seq_len // layout.cp} tokens of a sequence per rank, fewer than the "
            f"search's {options.cp_min_tokens} (--cp-min-tokens): the estimate does not see what short shares cost"]


def search(model: ModelSpec, cluster: Cluster, gpus: int, options: Options = Options()) -> list[Plan]:
    """Every layout of ``gpus`` GPUs evaluated: those that fit first, by estimated tokens/s, then the others
    with their reasons (invalid ones, and those the search's CP rule leaves out, last)."""
    plans = []
    for layout in candidate_layouts(model, cluster, gpus, options):
        rule = search_rule_problems(model, layout, options)
        plans.append(rejected(layout, cluster, layout_problems(model, cluster, layout, gpus, options) + rule)
                     if rule else evaluate(model, cluster, layout, options, gpus))
    return sorted(plans, key=lambda p: (not p.fits, bool(p.problems), -p.tokens_per_second,
                                        p.memory_per_gpu_bytes.get("total", 0)))


def best(model: ModelSpec, cluster: Cluster, gpus: int, options: Options = Options()) -> Plan | None:
    plans = search(model, cluster, gpus, options)
    return plans[0] if plans and plans[0].fits else None


def rank_of(plans: list[Plan], layout: Layout) -> int | None:
    """1-based place of ``layout`` among the plans that fit; None when it does not fit."""
    fitting = [p.layout for p in plans if p.fits]
    return fitting.index(layout) + 1 if layout in fitting else None


def fewest_nodes(model: ModelSpec, cluster: Cluster, options: Options = Options(), max_nodes: int = 512) -> int | None:
    """The fewest nodes on which some layout fits (the search on each node count)."""
    for nodes in range(1, max_nodes + 1):
        if best(model, cluster, nodes * cluster.gpus_per_node, options):
            return nodes
    return None


# --------------------------------------------------------------------------------------------------
# Published layouts, reproduced
# --------------------------------------------------------------------------------------------------

PUBLISHED = (
    {"model": "gpt3-175b", "cluster": "v100-32gb", "gpus": 1024, "layout": Layout(8, 8, 16, 1, 1),
     "options": Options(schedule="1f1b"), "claim": "GPT-3 175B on 1024 V100 (TP 8, PP 8, DP 16)"},
    {"model": "mt-nlg-530b", "cluster": "a100-80gb", "gpus": 2240, "layout": Layout(8, 35, 8, 1, 1),
     "options": Options(schedule="1f1b"), "claim": "MT-NLG 530B on 2240 A100-80GB (TP 8, PP 35, DP 8)"},
    {"model": "405b", "cluster": "h100-80gb", "gpus": 16384, "layout": Layout(8, 16, 128, 1, 1),
     "options": Options(schedule="interleaved_1f1b", chunks=2, sequence_parallel=True),
     "claim": "LLaMA 3 405B on 16K H100 (TP 8, PP 16, DP 128, sequence parallel, interleaved 1F1B)"},
    {"model": "405b", "cluster": "h100-80gb", "gpus": 16384, "layout": Layout(8, 16, 8, 16, 1),
     "sizes": {"seq_len": 131072, "global_batch": 128},  # its long-context stage: 16M tokens a step, 128K each
     "options": Options(schedule="interleaved_1f1b", chunks=2, sequence_parallel=True),
     "claim": "LLaMA 3 405B, 128K-token sequences, on 16K H100 (TP 8, CP 16, PP 16, DP 8)"},
)


def published_table() -> list[dict]:
    """Each published layout: evaluated, and its place in the search over the same GPUs (ZeRO-1, as each used
    a sharded optimizer; the search also tries DDP and FSDP)."""
    rows = []
    for entry in PUBLISHED:
        model, cluster = replace(MODELS[entry["model"]], **entry.get("sizes", {})), CLUSTERS[entry["cluster"]]
        plan = evaluate(model, cluster, entry["layout"], entry["options"], entry["gpus"])
        plans = search(model, cluster, entry["gpus"], entry["options"])
        top = plans[0]
        rows.append({"claim": entry["claim"], "model": entry["model"], "cluster": entry["cluster"],
                     "gpus": entry["gpus"], "layout": entry["layout"].label(), "fits": plan.fits,
                     "gib_per_gpu": plan.memory_per_gpu_bytes["total"] / GIB, "mfu": plan.mfu,
                     "rank": rank_of(plans, entry["layout"]), "fitting": sum(p.fits for p in plans),
                     "candidates": len(plans), "best": top.layout.label(), "best_mfu": top.mfu})
    return rows


def published_table_markdown() -> str:
    lines = ["| published layout | fits (derived) | GiB per GPU (derived) | MFU (derived) | place among "
             "layouts that fit | the planner's first choice (MFU) |", "|---|---|---:|---:|---:|---|"]
    for r in published_table():
        lines.append(f"| {r['claim']} | {'yes' if r['fits'] else 'no'} | {r['gib_per_gpu']:.1f} | {r['mfu']:.0%} | "
                     f"{r['rank']} of {r['fitting']} | {r['best']} ({r['best_mfu']:.0%}) |")
    return "\n".join(lines)


# Mixture of experts: a published table that lists total parameters as the per-token ones (or the reverse)
# gets the memory (all experts are stored) or the compute (only top_k run) wrong. Mixtral 8x7B's shape:
MIXTRAL_8X7B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000,
                "experts": 8, "top_k": 2}


def moe_params(layers, hidden, heads, kv_heads, ffn, vocab, experts, top_k) -> dict:
    """Total (stored: every expert) and active (used per token: top_k experts) parameters of a LLaMA-style
    mixture of experts with a router per layer."""
    kv_dim = kv_heads * hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim
    expert = 3 * hidden * ffn
    shared = 2 * vocab * hidden + hidden + layers * (attention + 2 * hidden + hidden * experts)
    return {"total": shared + layers * experts * expert, "active": shared + layers * top_k * expert,
            "naive_name": experts * 7e9}


# --------------------------------------------------------------------------------------------------
# Presets and files
# --------------------------------------------------------------------------------------------------


def model_from_file(path) -> ModelSpec:
    """A ModelSpec from JSON with its field names (``name, layers, hidden, heads, kv_heads, ffn, vocab,
    seq_len``, optional ``micro_batch, global_batch, architecture``). ValueError with the reason if not."""
    data = json.loads(open(path).read())
    known = {f.name for f in fields(ModelSpec)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{path}: unknown model fields {sorted(unknown)}; known: {sorted(known)}")
    data.setdefault("name", str(path))
    data.setdefault("kv_heads", data.get("heads"))
    try:
        return ModelSpec(**data)
    except TypeError as error:
        raise ValueError(f"{path}: {error}") from None


def cluster_from_file(path) -> Cluster:
    """A Cluster from JSON (``gpus_per_node, gpu_gib, peak_tflops, dtype, intra_node_gb_per_s,
    inter_node_gb_per_s``: GiB, dense TFLOP/s and GB/s one way, as a data sheet quotes them)."""
    data = json.loads(open(path).read())
    needed = ("gpus_per_node", "gpu_gib", "peak_tflops", "intra_node_gb_per_s", "inter_node_gb_per_s")
    missing = [k for k in needed if k not in data]
    if missing:
        raise ValueError(f"{path}: missing cluster fields {missing}")
    return Cluster(data.get("name", str(path)), int(data["gpus_per_node"]), data["gpu_gib"] * GIB,
                   data["peak_tflops"] * 1e12, data.get("dtype", "bf16"), data["intra_node_gb_per_s"] * GB,
                   data["inter_node_gb_per_s"] * GB, data.get("source", ""))


# --------------------------------------------------------------------------------------------------
# The chapter's tables (chapters/11_choosing_a_strategy.md pastes them; tests/unit/test_chapter_text_11.py
# recomputes them)
# --------------------------------------------------------------------------------------------------


def _gib(plan: Plan) -> str:
    total = plan.memory_per_gpu_bytes.get("total", float("nan"))
    return f"{total / GIB:.1f} GiB" if total == total else "-"


def _verdict(plan: Plan) -> str:
    return (f"fits, {_gib(plan)}, MFU {plan.mfu:.0%}" if plan.fits
            else f"does not fit: {plan.reason}" if plan.problems else f"does not fit ({_gib(plan)})")


def _best_with(plans: list[Plan], condition) -> Plan | None:
    return next((p for p in plans if condition(p.layout)), None)


def decision_path() -> list[dict]:
    """The chapter's decision path, each step a question, a case, and what the planner says (derived)."""
    c = CLUSTERS
    steps = []
    one = evaluate(MODELS["1b"], c["a100-80gb"], Layout(), Options(), 1)
    plans = search(MODELS["1b"], c["a100-80gb"], 8)
    ddp = _best_with(plans, lambda l: l.zero_stage == 0 and l.tp == l.pp == 1)
    steps.append({"question": "Does it fit on one GPU? Then DDP.", "case": "1B on A100-80GB",
                  "answer": f"one GPU: {_verdict(one)}; on 8, DDP (dp=8): {_verdict(ddp)}, "
                            f"place {rank_of(plans, ddp.layout)} of {sum(p.fits for p in plans)}"})
    plans = search(MODELS["7b"], c["a100-40gb"], 8)
    ddp, fsdp = (evaluate(MODELS["7b"], c["a100-40gb"], Layout(dp=8, zero_stage=z)) for z in (0, 3))
    steps.append({"question": "Too big for a replica per GPU? Shard it: FSDP (ZeRO-3).",
                  "case": "7B on 2 nodes of 4 x A100-40GB",
                  "answer": f"DDP: {_verdict(ddp)}; FSDP dp=8: {_verdict(fsdp)}; best: "
                            f"{plans[0].layout.label()} ({plans[0].mfu:.0%})"})
    plans = search(MODELS["70b"], c["a100-40gb"], 64)
    fsdp = evaluate(MODELS["70b"], c["a100-40gb"], Layout(dp=64, zero_stage=3))
    steps.append({"question": "Layers too wide, activations too big? TP inside a node.",
                  "case": "70B on 16 nodes of 4 x A100-40GB",
                  "answer": f"FSDP alone (dp=64): {_verdict(fsdp)}; best: {plans[0].layout.label()}, "
                            f"{_verdict(plans[0])}"})
    plans = search(MODELS["405b"], c["h100-80gb"], 1024)
    flat = _best_with(plans, lambda l: l.pp == 1)
    steps.append({"question": "Still too big, or many nodes? PP across nodes.", "case": "405B on 1024 H100-80GB",
                  "answer": f"best without PP ({flat.layout.label()}): {_verdict(flat)}; best: "
                            f"{plans[0].layout.label()}, {_verdict(plans[0])}"})
    long = replace(MODELS["70b"], seq_len=32768, global_batch=128)
    no_sp, sp, cp = (evaluate(long, c["h100-80gb"], layout, Options(sequence_parallel=s), 64)
                     for layout, s in ((Layout(8, 8, 1, 1, 1), False), (Layout(8, 8, 1, 1, 1), True),
                                       (Layout(8, 4, 1, 2, 1), True)))
    longest = replace(MODELS["70b"], seq_len=131072, global_batch=32)
    plans = search(longest, c["h100-80gb"], 64)
    closest = min((p for p in plans if p.layout.cp == 1 and not p.problems),
                  key=lambda p: p.memory_per_gpu_bytes["total"])
    steps.append({"question": "Long sequences? SP with TP, then CP.",
                  "case": "70B, 32K then 128K tokens, 64 H100-80GB",
                  "answer": f"32K, tp=8,pp=8: activations {no_sp.memory_per_gpu_bytes['activations'] / GIB:.1f} GiB "
                            f"without SP, {sp.memory_per_gpu_bytes['activations'] / GIB:.1f} GiB with SP; "
                            f"tp=8,pp=4,cp=2 with SP: {_verdict(cp)}; 128K without SP: nothing without CP fits "
                            f"(closest {closest.layout.label()}: {_verdict(closest)}); the search's choice: "
                            f"{plans[0].layout.label()}, {_verdict(plans[0])}"})
    return steps


def decision_path_markdown() -> str:
    lines = ["| question | case | what the planner says (derived) |", "|---|---|---|"]
    lines += [f"| {s['question']} | {s['case']} | {s['answer']} |" for s in decision_path()]
    return "\n".join(lines)


TRADEOFF_LAYOUTS = (Layout(1, 8, 8, 1, 3), Layout(2, 8, 4, 1, 3), Layout(8, 8, 1, 1, 1), Layout(8, 1, 8, 1, 3),
                    Layout(8, 2, 4, 1, 1), Layout(8, 4, 2, 1, 1), Layout(2, 2, 16, 1, 3), Layout(1, 2, 32, 1, 3))


def tradeoffs_markdown(model: str = "70b", cluster: str = "h100-80gb", gpus: int = 64) -> str:
    """Raising one degree at the others' expense: memory, the seconds of each dimension, bubble, MFU."""
    lines = [f"| {model} on {gpus} x {cluster} | GiB per GPU | TP s | DP s | PP s | bubble (of the step) | "
             "MFU |", "|---|---:|---:|---:|---:|---:|---:|"]
    for layout in TRADEOFF_LAYOUTS:
        plan = evaluate(MODELS[model], CLUSTERS[cluster], layout, Options(), gpus)
        s = plan.comm_seconds
        lines.append(f"| {layout.label()} | {plan.memory_per_gpu_bytes['total'] / GIB:.1f} | {s['tp']:.2f} | "
                     f"{s['dp']:.2f} | {s['pp']:.2f} | {plan.bubble['of_step']:.1%} | {plan.mfu:.1%} |")
    return "\n".join(lines)


def sizing_check_markdown() -> str:
    """Chapter 09's guide (TP = a node, FSDP over nodes) against the planner's search over every layout."""
    lines = ["| model | chapter 09: fewest nodes, TP 4 x FSDP | planner: fewest nodes, any layout | "
             "its layout there |", "|---|---:|---:|---|"]
    for name in sizing.LLAMA_SHAPES:
        spec = MODELS[name.lower()]
        nodes = fewest_nodes(spec, CLUSTERS["a100-40gb"])
        plan = best(spec, CLUSTERS["a100-40gb"], nodes * CLUSTERS["a100-40gb"].gpus_per_node)
        lines.append(f"| {name} | {sizing.min_nodes(name)} | {nodes} | {plan.layout.label()} |")
    return "\n".join(lines)


def moe_markdown() -> str:
    counted = moe_params(**MIXTRAL_8X7B)
    return (f"Mixtral 8x7B: {counted['total'] / 1e9:.1f} B parameters stored (every expert), "
            f"{counted['active'] / 1e9:.1f} B used per token (2 of 8 experts), not the "
            f"{counted['naive_name'] / 1e9:.0f} B its name suggests. Memory follows the {counted['total'] / 1e9:.1f} B "
            f"({16 * counted['total'] / GIB:.0f} GiB of mixed-precision AdamW state); "
            f"FLOPs per token follow the {counted['active'] / 1e9:.1f} B.")
