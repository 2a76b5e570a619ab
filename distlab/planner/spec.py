"""What the planner plans for: the model (:class:`ModelSpec`), the cluster (:class:`Cluster`), how it trains
(:class:`Options`) and how it splits (:class:`Layout`), with the presets, the JSON files and the checks that a
layout can run at all (:func:`layout_problems`)."""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, fields, replace

from distlab import memory, metrics, models, schedules, sizing, tensor_parallel

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
    # A mixture of experts (chapter 13; experts = 0: dense). Each MoE block's feed-forward: a router (experts x
    # hidden, replicated under TP), ``experts`` routed SwiGLU experts of width ``expert_ffn`` of which each token
    # visits ``top_k``, and ``shared_experts`` of the same width that every token visits. The first
    # ``dense_layers`` blocks keep the dense ``ffn`` (DeepSeek-V3's first three).
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    # attention's parameters per block when they are not grouped-query attention's (DeepSeek's multi-head latent
    # attention: :func:`mla_attention_params`); 0: from the heads
    attention_params: int = 0
    # the width of a head's queries and keys, and of its values, when they are not hidden / heads (0): DeepSeek's
    # multi-head latent attention scores with 128 + 64 = 192 (the rotary part beside the rest) and mixes values
    # of 128 per head (DeepSeek-V3 report, section 2.1.1; config.json qk_nope_head_dim, qk_rope_head_dim,
    # v_head_dim). They set attention's FLOPs (:meth:`attention_flops_per_token`)
    qk_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.is_moe else 0

    def expert_params(self) -> int:
        """One SwiGLU expert: 3 matrices of hidden x expert_ffn."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def kv_dim_per_tp_rank(self, tp: int) -> int:
        """Keys' (or values') width on one TP rank: its share of the key/value heads, one whole head where TP
        exceeds them (each rank keeps a replica of the head its query heads share)."""
        return max(self.kv_heads // tp, 1) * self.head_dim

    def block_params(self, moe: bool = False) -> dict:
        """One block's parameters: ``sharded`` (split by TP: the matrices and column-parallel biases),
        ``replicated`` (norms, the biases added after a row-parallel matrix, a MoE block's router) and ``experts``
        (a MoE block's routed experts, all of them: whole experts over EP's ep x tp ranks, or each expert's width
        over TP without EP)."""
        h, f = self.hidden, self.ffn
        if self.architecture == "gpt":
            attention = h * h + 2 * h * self.kv_dim + (h + 2 * self.kv_dim)  # q, k, v weights and biases
            return {"sharded": attention + h * h + 2 * h * f + f, "replicated": 4 * h + 2 * h, "experts": 0}
        attention = self.attention_params or 2 * h * h + 2 * h * self.kv_dim
        if not moe:
            return {"sharded": attention + 3 * h * f, "replicated": 2 * h, "experts": 0}
        return {"sharded": attention + self.shared_experts * self.expert_params(),
                "replicated": 2 * h + self.experts * h, "experts": self.experts * self.expert_params()}

    def block_active_params(self, moe: bool = False) -> int:
        """The parameters one token uses in a block: all of a dense block; a MoE block's top-k experts only."""
        block = self.block_params(moe)
        return block["sharded"] + block["replicated"] + (self.top_k * self.expert_params() if moe else 0)

    def embedding_params(self) -> dict:
        positions = self.seq_len * self.hidden if self.architecture == "gpt" else 0
        return {"sharded": self.vocab * self.hidden, "replicated": positions}

    def head_params(self, tied_copy: bool = True) -> dict:
        """Final norm and output projection (for a tied GPT, the copy a separate last stage holds)."""
        norm = 2 * self.hidden if self.architecture == "gpt" else self.hidden
        output = 0 if self.architecture == "gpt" and not tied_copy else self.vocab * self.hidden
        return {"sharded": output, "replicated": norm}

    def num_params(self) -> int:
        """Every parameter stored (a MoE model: every expert)."""
        dense, moe = self.layers - self.moe_layers, self.moe_layers
        return (sum(self.embedding_params().values()) + dense * sum(self.block_params().values())
                + moe * sum(self.block_params(moe=True).values()) + sum(self.head_params(tied_copy=False).values()))

    def active_params(self) -> int:
        """The parameters one token uses (a MoE model: its top-k routed experts, not the others)."""
        return self.num_params() - self.moe_layers * (self.experts - self.top_k) * self.expert_params()

    def matmul_params(self) -> int:
        """The parameters that multiply a token (the active ones but the embedding lookup and position table): 6
        FLOPs each per token."""
        return self.active_params() - self.vocab * self.hidden * (self.architecture != "gpt") \
            - self.embedding_params()["replicated"]

    def attention_flops_per_token(self) -> float:
        """One block's attention core, training FLOPs per token over the full s x s square (as PaLM and Megatron
        count it): forward q k^T (2 s d_qk a head) and the mix of values (2 s d_v a head), backward twice that:
        6 s heads (d_qk + d_v). With d_qk = d_v = h / heads this is the familiar 12 h s; DeepSeek-V3's latent
        attention (192 and 128 over 128 heads, hidden 7,168) does 2.9 times that."""
        qk = self.qk_head_dim or self.head_dim
        v = self.v_head_dim or self.head_dim
        return 6 * self.seq_len * self.heads * (qk + v)

    def flops_per_token(self) -> float:
        """Training FLOPs per token, 6 N + L x attention (12 L h s for standard heads:
        ``metrics.transformer_flops_per_token``'s accounting)."""
        return 6 * self.matmul_params() + self.layers * self.attention_flops_per_token()

    def config(self) -> models.TransformerConfig:
        """The course's TransformerConfig of the same sizes (what the activation and TP formulas take)."""
        return models.TransformerConfig(vocab_size=self.vocab, dim=self.hidden, n_layers=self.layers,
                                        n_heads=self.heads, ffn_hidden=self.ffn, seq_len=self.seq_len)

    def to_dict(self) -> dict:
        return asdict(self)


def mla_attention_params(hidden: int, heads: int, q_lora: int, kv_lora: int, qk_nope: int, qk_rope: int,
                         v_head: int) -> int:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a rank-``q_lora`` bottleneck, keys and values
    from a shared rank-``kv_lora`` latent plus a rotary key of ``qk_rope``, with the two bottlenecks' norms."""
    query = hidden * q_lora + q_lora + q_lora * heads * (qk_nope + qk_rope)
    key_value = hidden * (kv_lora + qk_rope) + kv_lora + kv_lora * heads * (qk_nope + v_head)
    return query + key_value + heads * v_head * hidden


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


def mixtral_spec(name: str, shape: dict, seq_len: int = 4096, global_batch: int = 1024) -> ModelSpec:
    """A Mixtral shape as a planner model: every block a MoE block, experts as wide as the ``ffn``."""
    return ModelSpec(name, shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"], shape["ffn"],
                     shape["vocab"], seq_len, 1, global_batch, "llama",
                     "Mixtral of Experts (Jiang et al., 2024), Table 1", experts=shape["experts"],
                     top_k=shape["top_k"], expert_ffn=shape["ffn"])



# Mixtral 8x7B (Jiang et al., 2024, Table 1): 8 experts of width 14,336 in every block, top-2
MIXTRAL_8X7B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000,
                "experts": 8, "top_k": 2}
MODELS["mixtral-8x7b"] = mixtral_spec("mixtral-8x7b", MIXTRAL_8X7B)

# DeepSeek-V3 (DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, 2024): 61 blocks, hidden 7,168,
# multi-head latent attention (128 heads; q_lora_rank 1,536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head
# 128: its config.json), the first 3 blocks dense (ffn 18,432), the other 58 MoE with 1 shared + 256 routed experts
# of width 2,048, top-8; vocabulary 129,280; sequences of 4,096, batch 15,360 sequences at the end of its ramp
# (section 4.2). Published: 671 B parameters in all, 37 B activated per token (abstract); the multi-token
# prediction module (14 B more) is left out, as the 671 B leaves it out.
MODELS["deepseek-v3"] = ModelSpec("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, 4096, 1, 15360, "llama",
                        "DeepSeek-V3 Technical Report (DeepSeek-AI, 2024), section 4.2 and config.json",
                        experts=256, top_k=8, expert_ffn=2048, shared_experts=1, dense_layers=3,
                        attention_params=mla_attention_params(7168, 128, 1536, 512, 128, 64, 128),
                        qk_head_dim=128 + 64, v_head_dim=128)


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
    # the time model's constants, one set per GPU type (GPU_CONSTANTS): the share of the dense peak that the
    # model's FLOPs reach as one number (quick estimates: chapter 13's; the step time does not read it);
    # gemm_time_share, the kernel-gap factor: the step time computes at planner.gemm's block rate (its GEMMs at their
    # shapes' rate, its norms, softmax and element-wise kernels at the memory's) times this factor, which covers what
    # the block model leaves out (gaps between kernels, launches, what is not modelled); the latency of one step of a
    # ring inside a node and across nodes
    compute_efficiency: float = 0.5
    gemm_time_share: float = 0.7
    intra_node_latency_s: float = 3.4e-6
    inter_node_latency_s: float = 14e-6

    def to_dict(self) -> dict:
        return asdict(self)


# One set of constants per GPU type, the same for every run of the validation table (distlab.planner.published):
# gemm_time_share, the kernel-gap factor the step time multiplies the block rate by, is fitted once per GPU type
# against that table (published.fitted_efficiency, tested to give it back) and stated in chapter 11.3;
# compute_efficiency is not fitted and the step time does not read it: the one-number share of the peak that quick
# estimates use (chapter 13's, and 11.3's comparison with a flat rate); the latencies are
# NCCL's own cost model for the Simple protocol of a ring step (src/graph/tuning.cc, hwLat: NVLink 3.4 us,
# network 14 us), which its tuner uses to choose between algorithms.
GPU_CONSTANTS = {
    "A100": {"compute_efficiency": 0.56, "gemm_time_share": 0.7, "intra_node_latency_s": 3.4e-6, "inter_node_latency_s": 14e-6},
    "H100": {"compute_efficiency": 0.57, "gemm_time_share": 0.72, "intra_node_latency_s": 3.4e-6, "inter_node_latency_s": 14e-6},
    "V100": {"compute_efficiency": 0.5, "gemm_time_share": 0.5, "intra_node_latency_s": 3.4e-6, "inter_node_latency_s": 14e-6},
}

CLUSTERS: dict[str, Cluster] = {
    "a100-40gb": Cluster("a100-40gb", 4, 40 * GIB, metrics.PEAK_FLOPS[("A100", "bf16")], "bf16",
                         tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S,
                         tensor_parallel.SLINGSHOT11_NIC_BYTES_PER_S,
                         "Derecho-like: 4 x A100-40GB, NVLink 3, one Slingshot 11 NIC (200 Gb/s) per GPU",
                         **GPU_CONSTANTS["A100"]),
    "a100-80gb": Cluster("a100-80gb", 8, 80 * GIB, metrics.PEAK_FLOPS[("A100", "bf16")], "bf16",
                         tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S, 200e9 / 8,
                         "DGX A100: 8 x A100-80GB, NVLink 3, one 200 Gb/s InfiniBand HDR NIC per GPU",
                         **GPU_CONSTANTS["A100"]),
    "h100-80gb": Cluster("h100-80gb", 8, 80 * GIB, metrics.PEAK_FLOPS[("H100", "bf16")], "bf16",
                         900e9 / 2, 400e9 / 8,
                         "DGX H100: 8 x H100-80GB SXM, NVLink 4 (900 GB/s both ways), one 400 Gb/s NDR NIC per GPU",
                         **GPU_CONSTANTS["H100"]),
    "v100-32gb": Cluster("v100-32gb", 8, 32 * GIB, 125e12, "fp16", 300e9 / 2, 4 * 100e9 / 8 / 8,
                         "DGX-1: 8 x V100-32GB SXM2 (fp16 tensor cores 125 TFLOP/s dense; no bf16), NVLink 2, "
                         "four 100 Gb/s InfiniBand NICs for the eight GPUs (NVIDIA's DGX-1 white paper)",
                         **GPU_CONSTANTS["V100"]),
}


# Its cluster (section 3.1-3.2): 2,048 H800 GPUs, 8 a node over NVLink and NVSwitch; InfiniBand across nodes.
# "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)" (section 3.2.2): the
# bandwidths a GPU reaches, used here as the links. The H800 computes as an H100 SXM (989 TFLOP/s dense bf16).
CLUSTERS["h800-80gb"] = Cluster("h800-80gb", 8, 80 * GIB, metrics.PEAK_FLOPS[("H100", "bf16")], "bf16", 160e9, 50e9,
               "DeepSeek-V3's cluster: 8 x H800 a node, NVLink 160 GB/s and InfiniBand 50 GB/s per GPU "
               "(its report, section 3.2.2)", **GPU_CONSTANTS["H100"])
# --------------------------------------------------------------------------------------------------
# Options and layouts
# --------------------------------------------------------------------------------------------------

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


CHECKPOINTING = ("none", "selective", "full")  # the search tries them in this order and keeps the first that fits


@dataclass(frozen=True)
class Options:
    """How the model trains. Every field is printed beside the plans it produces. A field left at None is a
    setting the search chooses for each layout (:func:`distlab.planner.search.tune`); :func:`evaluate` alone
    reads None as the value in brackets."""

    zero_stage: int | None = None          # 0 DDP, 1, 2, 3 FSDP; None: the search tries ZERO_STAGES
    context_parallel: int | None = None    # CP degree; None: the search tries those of long enough shares
    cp_min_tokens: int = 8192              # the search's CP: at least this many tokens of a sequence per rank
    # FSDP: free the weights after each forward and gather them again for backward. [True without PP; False
    # under PP, as chapter 09's scripts and torchtitan set it there: planner.spec.reshards_after_forward]
    reshard_after_forward: bool | None = None
    # FSDP without PP under gradient accumulation: keep the weights gathered and the gradients unsharded from
    # the first microbatch to the last (FSDP2's set_reshard_after_backward(False), set_requires_gradient_sync
    # (False), which torch's pipeline stage also sets, and reshard_after_forward=False): one gather and one
    # reduce-scatter a step [False]
    fsdp_keep_gathered: bool | None = None
    # FSDP under PP: when a stage's reduce-scatters (and HSDP's all-reduces) run. "after_backward": in the
    # REDUCE_GRAD action torch's pipeline schedules put right after each chunk's last backward (torch 2.13
    # pipelining/schedules.py, _add_reduce_grad; stage.py, perform_reduce_grad; every backward before runs with
    # set_requires_gradient_sync(False)), which ends in FSDP's finalize_backward: the compute stream waits for them.
    # "last_backward": during the last microbatch's backward, as DDP under torch's stage (stage.py,
    # backward_maybe_with_nosync) and Megatron's overlapped gradient reduction run. DDP and ZeRO-1/2 always take the
    # second.
    pp_fsdp_grad_sync: str = "after_backward"
    # FSDP under PP: torch's schedule.step(return_outputs=True), its default (pipelining/schedules.py:745), keeps every
    # microbatch's output (the logits) on the last stage until the next step (planner.memory.kept_output_bytes). The
    # course's scripts pass False (chapters 07 and 09), as the planner assumes [False]
    pp_return_outputs: bool = False
    # "full": every block recomputed in backward (True); "selective": attention's core only (Korthikanti et
    # al. 2022); "none" (False) [full]
    activation_checkpointing: bool | str | None = None
    flash_attention: bool = True           # False: attention saves its s x s probabilities (what selective drops)
    # full checkpointing under PyTorch's non-reentrant checkpoint stops recomputing once backward has every tensor
    # it needs: before a block's last collective (torch.utils.checkpoint's default early stop, measured in chapter
    # 08's sp_transformer.py); False: the whole block re-runs (Megatron's recompute), every forward collective again
    recompute_early_stop: bool = True
    precision: str = "mixed"               # "mixed" (bf16/fp16 compute, fp32 master) or "fp32"
    # SP with TP [on whenever tp > 1]: DTensor's costs no extra bytes (its all-gathers and reduce-scatters replace
    # TP's all-reduces) but one all-gather a block under PyTorch's early-stopped full recomputation (which re-issues
    # the block's all-gathers and stops before its last reduce-scatter); Megatron's gathers each region's input
    # again in backward (below)
    sequence_parallel: bool | None = None
    # the layers' kind. True: torch's modules (DTensor's parallelize_module, measured in chapter 06), whose TP
    # regions save their all-gathered input under SP. False: Megatron's own layers (planner.memory.megatron_layers):
    # a region saves its input's sequence shard and gathers it again in backward (Korthikanti et al. 2022: one more
    # all-gather a region in backward, which Megatron overlaps with the input gradient's matmul and the planner
    # counts as exposed), fused kernels save less (planner.memory.block_activation_bytes)
    sp_saves_gathered_inputs: bool = True
    # Megatron-LM's scatter/gather of pipeline sends without SP (Narayanan et al. 2021): each TP rank sends 1/tp
    pp_scatter_gather: bool = False
    # CP's attention: "ring" (keys and values passed around, hidden behind attention's blocks: chapter 08) or
    # "all_gather" (Llama 3, section 3.3.2: keys and values all-gathered, their gradients reduce-scattered, on the
    # critical path)
    cp_attention: str = "ring"
    schedule: str = "interleaved_1f1b"     # with 1 chunk this is 1F1B
    chunks: int | None = None              # stages per rank (interleaved_1f1b) [1]
    search_micro_batch: bool = True        # the search tries micro-batches of 1, 2, 4, 8 sequences
    async_tp: bool = False                 # TP's collectives overlapped with the matmuls they feed (async TP)
    # EP's all-to-alls overlapped with another microbatch's compute (DeepSeek-V3's DualPipe): hidden as far as the
    # stage's compute lasts; False: on the critical path, between the router, the experts and the next block
    ep_overlap: bool = False
    # EP's all-to-all as DeepSeek-V3 runs it (its report, section 3.2.2): node-limited routing sends a token to at
    # most this many nodes, one copy a node over the network, forwarded over NVLink to the GPUs of its experts
    # there (and combined the reverse way); 0: every copy straight to its expert's rank (uniform over the group)
    ep_node_limit: int = 0
    # bytes per element of the dispatch (and of backward's gradient dispatch); 0: the compute dtype's. DeepSeek-V3
    # dispatches in FP8 with a scale per 128 elements, 1 + 4/128, and combines in bf16 (section 3.3.3)
    ep_dispatch_bytes: float = 0.0
    reserve_bytes: float = 4 * GIB         # CUDA context, NCCL buffers, fragmentation (chapter 09's reserve)
    prefetched_units: int = 2              # FSDP blocks gathered at once beside the root (computing + prefetched)
    ddp_bucket_view: bool = False          # DDP: gradient_as_bucket_view (else its buckets copy the fp32 grads)
    # gradient buckets of DDP and ZeRO, in parameters; None: Megatron-Core's rule, max(40M, 1M x dp): larger
    # buckets on larger rings, since every bucket's collective pays the ring's 2 (n - 1) latencies
    bucket_params: int | None = None
    # NCCL's all-reduce algorithm over nodes: "auto", the faster of ring and tree for each call (NCCL's tuner,
    # src/graph/tuning.cc); "ring", as NCCL_ALGO=Ring forces it
    nccl_algorithm: str = "auto"

    def to_dict(self) -> dict:
        return asdict(self)


def checkpointing(options: Options) -> str:
    """The activation checkpointing mode: "none", "selective" or "full" (None and True: full)."""
    mode = options.activation_checkpointing
    mode = "full" if mode is None or mode is True else "none" if mode is False else mode
    if mode not in CHECKPOINTING:
        raise ValueError(f"activation checkpointing must be one of {CHECKPOINTING}, not {mode!r}")
    return mode


def sequence_parallel(options: Options, layout: Layout) -> bool:
    """Whether SP is on: as set, or (None) whenever there is TP to pair it with."""
    return layout.tp > 1 if options.sequence_parallel is None else bool(options.sequence_parallel)


def chunks(options: Options) -> int:
    """Stages per rank: the interleaved schedule's chunks (1 when unset), 1 for the other schedules."""
    return (options.chunks or 1) if options.schedule == "interleaved_1f1b" else 1


def reshards_after_forward(options: Options, layout: Layout) -> bool:
    """FSDP's ``reshard_after_forward``: as set, or (None) True without PP and False under PP."""
    if options.reshard_after_forward is None:
        return layout.pp == 1
    return bool(options.reshard_after_forward)


def keeps_gathered(options: Options, layout: Layout) -> bool:
    """FSDP keeps the gradients unsharded over the step's microbatches and reduces them once: always under PP
    (torch's pipeline stage, whose weights then follow :func:`pipeline_fsdp_gathers`), and without PP when
    ``fsdp_keep_gathered``, which keeps the weights gathered too."""
    return layout.zero_stage == 3 and (layout.pp > 1 or bool(options.fsdp_keep_gathered))


def pipeline_fsdp_gathers(model: ModelSpec, layout: Layout, stage: int, options: Options) -> float:
    """Under PP, how many times each FSDP unit of pipeline rank ``stage`` is all-gathered in a step, averaged over
    the rank's chunks, as torch 2.13 runs it (``distlab.schedules.fsdp_all_gathers``, tested equal to torch's
    steps): a single-stage schedule (GPipe, 1F1B) gathers once without resharding after forward, M + 1 times with
    it; the interleaved runtime unshards and reshards chunks through a window of 3
    (``schedules.add_unshard_reshard``), so more than 3 chunks a rank are gathered again and again."""
    return _pipeline_gathers(options.schedule, layout.pp, microbatches(model, layout), chunks(options), stage,
                             reshards_after_forward(options, layout))


@functools.lru_cache(maxsize=1024)
def _pipeline_gathers(schedule: str, pp: int, num_micro: int, v: int, stage: int, reshard: bool) -> float:
    order = _pipeline_order(schedule, pp, num_micro, v)
    total = sum(schedules.fsdp_all_gathers(order.actions[stage], reshard, runtime=v > 1).values())
    return total // v if total % v == 0 else total / v


@functools.lru_cache(maxsize=256)   # one order serves every stage of the layout (the search asks for each)
def _pipeline_order(schedule: str, pp: int, num_micro: int, v: int):
    if v > 1:
        return schedules.interleaved_1f1b(pp, num_micro, v, torch_rounds=True)
    return schedules.build("gpipe" if schedule == "gpipe" else "1f1b", pp, num_micro)


def pipeline_gathered_share(options: Options) -> float:
    """Under PP, the largest share of a rank's FSDP weights gathered at once: the whole stage under a
    single-stage schedule (the last backward leaves them all gathered), 3 of V chunks under torch's interleaved
    runtime (its window, ``schedules.FSDP_ACTIVE_STAGES``)."""
    v = chunks(options)
    return min(schedules.FSDP_ACTIVE_STAGES, v) / v


PP_FSDP_GRAD_SYNC = ("after_backward", "last_backward")


def reduces_after_backward(options: Options, layout: Layout) -> bool:
    """FSDP's gradient reduction (and HSDP's all-reduce) runs after each chunk's last backward, exposed (the compute
    stream waits for it): FSDP under PP as torch's pipeline stage runs it (``Options.pp_fsdp_grad_sync``)."""
    if options.pp_fsdp_grad_sync not in PP_FSDP_GRAD_SYNC:
        raise ValueError(f"pp_fsdp_grad_sync must be one of {PP_FSDP_GRAD_SYNC}, not {options.pp_fsdp_grad_sync!r}")
    return layout.zero_stage == 3 and layout.pp > 1 and options.pp_fsdp_grad_sync == "after_backward"


def bucket_params(options: Options, layout: Layout) -> int:
    """Parameters per gradient bucket (Megatron-Core's default: max(40M, 1M x the data-parallel size))."""
    if options.bucket_params is not None:
        return options.bucket_params
    return max(40_000_000, 1_000_000 * layout.dp * layout.cp)


ZERO_STAGES = (0, 1, 3)  # what the search tries when Options.zero_stage is None: DDP, ZeRO-1, FSDP


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    zero_stage: int = 0
    shard: int = 0   # HSDP (ZeRO-3 only): FSDP shards over groups of this many dp ranks and replicates across them;
    #                  0: FSDP over all of dp x cp
    ep: int = 1      # expert parallelism (a MoE model): the ranks of one EP group, torchtitan's ``ep`` with expert TP
    #                  off (``distributed/parallel_dims.py``: "EP would borrow all cp and tp and some dp_shard
    #                  degree", ep % (cp x tp) == 0): every cp and tp rank and ep / (cp x tp) consecutive dp ranks

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def fsdp_ways(self) -> int:
        """The ranks a parameter's (ZeRO) shards are spread over: HSDP's shard group, else dp x cp."""
        return self.shard or self.dp * self.cp

    @property
    def replicas(self) -> int:
        """HSDP's replicas of each shard (1 without HSDP)."""
        return self.dp * self.cp // self.shard if self.shard else 1

    @property
    def ep_group(self) -> int:
        """The ranks one all-to-all spans (1 without EP): ``ep``, as torchtitan counts it. It borrows every cp and tp
        rank and ``ep_dp`` consecutive dp ranks (``parallel_dims.py``, expert TP off), as chapter 13's ``--tp``
        script runs it: each TP rank routes 1/tp of the tokens to whole experts spread over the group."""
        return self.ep

    @property
    def ep_dp(self) -> int:
        """The data-parallel ranks one EP group borrows: ep / (cp x tp)."""
        return max(1, self.ep // (self.cp * self.tp))

    @property
    def expert_shards(self) -> int:
        """The ranks a MoE block's routed experts are spread over: whole experts over the EP group, or, without
        EP, each expert's width over TP."""
        return self.ep if self.ep > 1 else self.tp

    @property
    def expert_dp(self) -> int:
        """The ranks of a stage that hold the same experts (one per EP group), over which the experts' gradients
        are reduced and their ZeRO state sharded: dp x cp x tp / ``expert_shards``."""
        return self.dp * self.cp * self.tp // self.expert_shards

    def label(self) -> str:
        text = f"tp={self.tp},pp={self.pp},dp={self.dp}"
        return (text + (f",cp={self.cp}" if self.cp > 1 else "")) + f",zero={self.zero_stage}" \
            + (f",shard={self.shard}" if self.shard else "") + (f",ep={self.ep}" if self.ep > 1 else "")


def parse_layout(text: str, zero_stage: int = 0) -> Layout:
    """``"tp=8,pp=8,dp=16"`` (any order; cp=, zero=, shard= and ep= optional) as a :class:`Layout`; ValueError if
    malformed."""
    sizes = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        key, _, value = part.partition("=")
        if key not in ("tp", "pp", "dp", "cp", "zero", "shard", "ep") or not value.isdigit():
            raise ValueError(f"--layout {text!r}: write it like tp=8,pp=8,dp=16 (keys tp, pp, dp, cp, zero, shard, "
                             "ep)")
        sizes["zero_stage" if key == "zero" else key] = int(value)
    sizes.setdefault("zero_stage", zero_stage)
    return Layout(**sizes)


def layout_problems(model: ModelSpec, cluster: Cluster, layout: Layout, gpus: int | None = None,
                    options: Options = Options()) -> list[str]:
    """Every reason ``layout`` cannot run ``model`` on ``gpus`` GPUs of ``cluster`` (empty when it can)."""
    t, p, d, c = layout.tp, layout.pp, layout.dp, layout.cp
    if min(t, p, d, c, layout.ep) < 1:
        return [f"every size must be at least 1, not {layout.label()}"]
    problems = []
    if gpus is not None and layout.gpus != gpus:
        problems.append(f"tp x pp x dp x cp = {layout.gpus} is not the {gpus} GPUs")
    if layout.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage must be 0, 1, 2 or 3, not {layout.zero_stage}")
    if layout.shard:
        if layout.zero_stage != 3 or c != 1:
            problems.append(f"HSDP (shard={layout.shard}) is FSDP's (ZeRO-3), without CP here")
        if not 1 < layout.shard < d or d % layout.shard:
            problems.append(f"HSDP's shard group {layout.shard} must divide dp {d} into 2 or more replicas")
    if model.is_moe:
        if model.architecture != "llama":
            problems.append("a mixture of experts is modelled on the LLaMA-style block only")
        if not 1 <= model.top_k <= model.experts:
            problems.append(f"top-k {model.top_k} must be between 1 and the {model.experts} experts")
        if model.experts % layout.expert_shards and layout.ep > 1:
            problems.append(f"{model.experts} experts do not split over EP {layout.ep}")
        if layout.ep == 1 and model.expert_ffn % t:
            problems.append(f"expert width {model.expert_ffn} does not split over TP {t}")
    elif layout.ep > 1:
        problems.append(f"EP {layout.ep} needs a mixture-of-experts model; {model.name} is dense")
    if layout.ep > 1 and (layout.ep % (c * t) or d % layout.ep_dp):
        problems.append(f"EP {layout.ep} must be a multiple of cp x tp = {c * t} that divides dp x cp x tp = "
                        f"{d * c * t} (EP borrows every cp and tp rank and some data-parallel ones, as torchtitan)")
    if layout.ep > 1 and layout.shard:
        problems.append("EP beside HSDP is not modelled")
    if t > cluster.gpus_per_node:
        problems.append(f"TP {t} is larger than a node's {cluster.gpus_per_node} GPUs (TP stays on NVLink)")
    for label, value in (("attention heads", model.heads), ("key/value heads", model.kv_heads),
                         ("hidden size", model.hidden), ("feed-forward size", model.ffn)):
        if value % t:
            problems.append(f"{value} {label} do not split over TP {t}")
    if p > model.layers:
        problems.append(f"PP {p} is more stages than the {model.layers} layers")
    v = chunks(options)
    if v > 1 and p * v > model.layers + 2:
        problems.append(f"PP {p} x {v} chunks is more stages than the {model.layers} layers (and the embedding "
                        "and the head, which may take a stage of their own)")
    sp = sequence_parallel(options, layout)
    if model.seq_len % c or (sp and (model.seq_len // c) % t):
        problems.append(f"sequence length {model.seq_len} does not split over CP {c}" + (f" x SP {t}" if sp else ""))
    if model.global_batch % (d * model.micro_batch):
        problems.append(f"global batch {model.global_batch} does not split into dp x micro-batch = "
                        f"{d} x {model.micro_batch} equal parts")
    elif v == 1 and p > 1 and options.schedule != "gpipe" and microbatches(model, layout) < p:
        # torch 2.13's Schedule1F1B refuses fewer microbatches than stages (pipelining/schedules.py:1020-1024)
        problems.append(f"1F1B needs at least as many microbatches as the {p} stages, not "
                        f"{microbatches(model, layout)} (torch's Schedule1F1B refuses fewer)")
    elif v > 1 and p > 1 and layout.zero_stage == 3:
        # FSDP's gathers are counted on torch's own interleaved order (pipeline_fsdp_gathers), which needs this
        m = microbatches(model, layout)
        if m % max(1, m // p):
            problems.append(f"torch's interleaved 1F1B needs the {m} microbatches to be a multiple of its "
                            f"max(1, M // P) = {m // p} rounds")
    return problems




def stage_layers(layers: int, pp: int, stage: int) -> int:
    """Layers of stage ``stage`` when ``layers`` do not divide: the first ``layers % pp`` stages take one more."""
    return layers // pp + (1 if stage < layers % pp else 0)



def stage_layer_kinds(model: ModelSpec, pp: int, stage: int) -> tuple[int, int]:
    """(dense blocks, MoE blocks) of stage ``stage``: the model's first ``dense_layers`` blocks are dense."""
    start = sum(stage_layers(model.layers, pp, s) for s in range(stage))
    layers = stage_layers(model.layers, pp, stage)
    dense = min(layers, max(0, model.dense_layers - start)) if model.is_moe else layers
    return dense, layers - dense


def microbatches(model: ModelSpec, layout: Layout) -> int:
    """Microbatches per step on one replica: global batch / (dp x micro-batch)."""
    return max(1, model.global_batch // (layout.dp * model.micro_batch))



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

