"""A GEMM's speed from its shape: the roofline (its arithmetic intensity against the GPU's memory bandwidth and
peak) plus a fixed cost a kernel, and a transformer block's GEMMs on one TP rank (:func:`block_gemms`).

One GEMM multiplies an ``m x k`` matrix by a ``k x n`` one, ``batch`` times (attention's per-head products). It
does ``2 batch m n k`` FLOPs and, at best, reads both inputs and writes its output once:
``bytes = element_bytes * batch * (m k + k n + m n)``. Its time (:func:`gemm_seconds`) is

    fixed + max(flops / sustained, bytes / bandwidth)

* ``sustained``: the largest matmul rate measured on the GPU (Bekman's Maximum Achievable Matmul FLOPS: A100 SXM
  271.2 TFLOP/s of 312, H100 SXM 794.5 of 989; source ``mamf_a100_h100``). A tensor core never reaches its peak;
  this is how close the best shapes come;
* ``bandwidth``: the HBM bandwidth (A100 80 GB 2.039 TB/s, 40 GB 1.555, H100 SXM 3.35): a GEMM whose intensity
  is below ``sustained / bandwidth`` FLOPs a byte waits on memory (the roofline's slope);
* ``fixed``: what a small GEMM costs whatever its size, charged to GEMMs only (the other kernels of a block are
  charged their bytes alone): OpenXLA's measured H100 table (``xla_h100_matmul_table``) times a 256 x 256 x 256
  product at 5.2 us in all. Its memory term (393,216 bytes / 3.35 TB/s = 0.12 us) comes on top, so the model runs
  that point 2 % slower than measured. No A100 table was found; the A100 is given the H100's fixed cost.

The measured table checks the model (tests/unit/test_planner_gemm.py): its points, which the model was not fitted
to beyond the two numbers above, fall within the band the test states.

Assumed, not measured: the V100's sustained rate is its peak (no measured rate was found), and a custom cluster
(``--cluster-config``) gets its peak with no memory limit, so its norms and softmax cost nothing; both make such
clusters' compute look faster than a measured GPU's would.

Backward does each GEMM twice (the input's gradient and the weight's) over the same three sizes, so a GEMM's
efficiency is the same forward and backward, and a block's efficiency (:func:`block_efficiency`) holds for its
recomputation too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The matmul hardware of each GPU type: dense bf16/fp16 peak, measured sustained matmul rate, HBM bandwidth and the
# fixed cost of one GEMM kernel (sources: planner.sources, keys in SOURCE_KEYS)
FIXED_SECONDS = 256 ** 3 * 2 / 6452775384615   # XLA's H100 256^3 bf16 GEMM: 33.6 MFLOP at 6.45 TFLOP/s = 5.2 us


@dataclass(frozen=True)
class MatmulHardware:
    peak_flops: float
    sustained_flops: float   # the best measured matmul rate (MAMF); the peak where none was measured
    hbm_bytes_per_s: float
    fixed_seconds: float = FIXED_SECONDS


MATMUL_HARDWARE = {
    "a100-80gb": MatmulHardware(312e12, 271.2e12, 2.039e12),
    "a100-40gb": MatmulHardware(312e12, 271.2e12, 1.555e12),
    "h100-80gb": MatmulHardware(989e12, 794.5e12, 3.35e12),
    "h800-80gb": MatmulHardware(989e12, 794.5e12, 3.35e12),   # an H100 SXM's compute and memory
    "v100-32gb": MatmulHardware(125e12, 125e12, 0.9e12),       # no measured rate found: the peak
}
SOURCE_KEYS = ("mamf_a100_h100", "xla_h100_matmul_table", "a100_hbm_bandwidth", "h100_sxm_pcie_spec_table",
               "v100_hbm_bandwidth", "flash_attention_causal_flops")


# OpenXLA's measured H100 table (source xla_h100_matmul_table): (m, n, k) -> bf16 FLOP/s, 20 of its b = 1 entries
# as the file prints them. Only the 256^3 entry sets the model (FIXED_SECONDS); the others check it.
XLA_H100_BF16 = {
    (256, 256, 256): 6452775384615, (512, 512, 512): 40721398058252, (1024, 1024, 1024): 236298816901408,
    (2048, 2048, 2048): 631984593290170, (4096, 4096, 4096): 783328793548203,
    (1024, 2048, 256): 139519467775467, (4096, 512, 512): 238821580071174, (256, 2048, 4096): 285873755058572,
    (4096, 1024, 512): 343707370038412, (2048, 512, 2048): 347714321243523, (4096, 4096, 256): 392162828341855,
    (256, 4096, 4096): 412026793553338, (4096, 1024, 4096): 738474431911967, (1024, 4096, 4096): 738474431911967,
    (2048, 4096, 4096): 753643516181744, (4096, 2048, 4096): 758434522012648, (512, 4096, 4096): 644116271145770,
    (4096, 256, 4096): 376223484232655, (2048, 1024, 4096): 653127630170316, (256, 256, 4096): 84307618090452,
}


def hardware_of(cluster) -> MatmulHardware:
    """The matmul hardware of a planner cluster (by its name's GPU; a custom cluster: its peak, no memory limit)."""
    for name, hardware in MATMUL_HARDWARE.items():
        if cluster.name.startswith(name):
            return hardware
    return MatmulHardware(cluster.peak_flops, cluster.peak_flops, float("inf"))


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int
    n: int
    k: int
    batch: int = 1
    element_bytes: int = 2

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k

    @property
    def bytes(self) -> float:
        return float(self.element_bytes * self.batch * (self.m * self.k + self.k * self.n + self.m * self.n))

    @property
    def intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.flops / self.bytes


def roofline_flops(gemm: Gemm, hardware: MatmulHardware) -> float:
    """The roofline's attainable rate: the sustained rate, or what the bandwidth feeds at this intensity."""
    return min(hardware.sustained_flops, gemm.intensity * hardware.hbm_bytes_per_s)


def gemm_seconds(gemm: Gemm, hardware: MatmulHardware) -> float:
    """One GEMM's time: the fixed cost of a kernel, plus the slower of its FLOPs and its bytes."""
    return hardware.fixed_seconds + gemm.flops / roofline_flops(gemm, hardware)


def gemm_efficiency(gemm: Gemm, hardware: MatmulHardware) -> float:
    """The share of the dense peak one GEMM reaches."""
    return gemm.flops / gemm_seconds(gemm, hardware) / hardware.peak_flops


def block_gemms(model, tp: int = 1, cp: int = 1, micro_batch: int | None = None, flash_attention: bool = True,
                ep: int = 1) -> list[Gemm]:
    """The GEMMs of one transformer block's forward on one TP rank, for one micro-batch: rows are the
    micro-batch's tokens (``b s / cp``: TP's regions see the whole sequence shard, gathered under SP), columns
    split by TP (column-parallel: q, k, v, the MLP's up; row-parallel: the output projection and the MLP's down
    split their inner size).

    Attention's core: without a flash kernel, two batched GEMMs a head (the ``s x s`` scores, then the mix of the
    values), each writing or reading the ``s x s`` scores in HBM; with one, a single fused kernel whose traffic is
    q, k, v and the output (its FLOPs are compute-bound at any length a transformer trains on).

    A MoE block's routed experts: each of the ``experts / ep`` local experts sees ``b s top_k / experts`` tokens of
    each of the ep ranks (uniform routing)."""
    b = model.micro_batch if micro_batch is None else micro_batch
    h, heads, d = model.hidden, model.heads, model.head_dim
    tokens = b * model.seq_len // cp
    local_heads = max(heads // tp, 1)
    kv = model.kv_dim_per_tp_rank(tp)
    gemms = [Gemm("qkv", tokens, h // tp + 2 * kv, h)]
    if flash_attention:
        # one fused kernel: 4 s^2 d FLOPs a head over the full square (the chapter's count), traffic q, k, v, out
        core = Gemm("attention (fused)", tokens, model.seq_len, 2 * d, local_heads)
        gemms.append(_fused(core, tokens, model.seq_len, d, local_heads, b))
    else:
        gemms += [Gemm("scores q k^T", tokens // b, model.seq_len, d, b * local_heads),
                  Gemm("probabilities x v", tokens // b, d, model.seq_len, b * local_heads)]
    gemms.append(Gemm("output projection", tokens, h, h // tp))
    if model.is_moe:
        local = max(model.experts // ep, 1)
        rows = max(tokens * model.top_k * ep // model.experts, 1)
        gemms += [Gemm("experts up", rows, 2 * model.expert_ffn, h, local),
                  Gemm("experts down", rows, h, model.expert_ffn, local)]
    else:
        up = 2 * model.ffn if model.architecture == "llama" else model.ffn   # SwiGLU: gate and up
        gemms += [Gemm("mlp up", tokens, up // tp, h), Gemm("mlp down", tokens, h, model.ffn // tp)]
    return gemms


@dataclass(frozen=True)
class _FusedAttention(Gemm):
    traffic: float = 0.0

    @property
    def bytes(self) -> float:
        return self.traffic


def _fused(core: Gemm, tokens: int, seq_len: int, d: int, heads: int, b: int) -> Gemm:
    # q and the output: tokens x d a head; k and v: the whole sequence's (a CP rank receives them all)
    traffic = core.element_bytes * heads * (2 * tokens * d + 2 * b * seq_len * d)
    return _FusedAttention(core.name, core.m, core.n, core.k, core.batch, core.element_bytes, traffic)


def block_efficiency(model, hardware: MatmulHardware, tp: int = 1, cp: int = 1, micro_batch: int | None = None,
                     flash_attention: bool = True, ep: int = 1) -> float:
    """The share of the dense peak a block's GEMMs reach together: their FLOPs over their summed times."""
    gemms = block_gemms(model, tp, cp, micro_batch, flash_attention, ep)
    return sum(g.flops for g in gemms) / sum(gemm_seconds(g, hardware) for g in gemms) / hardware.peak_flops


def block_elementwise_bytes(model, tp: int = 1, cp: int = 1, micro_batch: int | None = None,
                            flash_attention: bool = True, sequence_parallel: bool = False,
                            scores_only: bool = False) -> float:
    """HBM bytes of one block's forward kernels that are not GEMMs, for one micro-batch on one TP rank, each kernel
    reading its inputs and writing its output once (its roofline: they do a few FLOPs a byte, so memory sets their
    time; no fixed cost is charged to them). Per token: two norms (read and write the width), two residual adds
    (read two, write one; GPT's are Megatron's bias-dropout-residual adds, which also write a 1-byte dropout mask),
    the MLP's activation (GELU: read and write the ffn share; SwiGLU: read two, write one, as one fused kernel,
    where ``distlab.models`` runs SiLU and the product as two) and, without a flash
    kernel, attention's scale-mask-softmax (read and write the ``heads / tp x s`` scores) and, in GPT, its dropout
    (read, write, a mask). A Llama block has no bias and no dropout. The norms and adds see the whole width on every
    TP rank without SP (Megatron replicates them), a 1/tp share under SP. ``scores_only``: the softmax and dropout
    over the scores alone. RoPE's element-wise work on the queries and keys is not counted."""
    b = model.micro_batch if micro_batch is None else micro_batch
    tokens = b * model.seq_len // cp
    width = model.hidden // tp if sequence_parallel else model.hidden
    llama = model.architecture == "llama"
    per_score = 2.0 if llama else 4.5                     # softmax; GPT's dropout reads, writes and masks them too
    scores = 0.0 if flash_attention else per_score * max(model.heads // tp, 1) * model.seq_len
    if scores_only:
        return 2.0 * tokens * scores
    elements = 2 * 2 * width + 2 * (3.0 if llama else 3.5) * width
    elements += (3 if llama else 2) * model.ffn // tp
    return 2.0 * tokens * (elements + scores)


ATTENTION_CORE = ("scores q k^T", "probabilities x v", "attention (fused)")
# The share of the s x s square a fused (flash) attention kernel is timed at. The planner times the full square, as
# MFU counts it; a causal flash kernel skips the blocks above the diagonal, and FlashAttention's own benchmark counts
# its causal FLOPs as half the square's (source flash_attention_causal_flops). The chapter states what halving would
# change (tests/unit/test_chapter_text_11.py sets 0.5 and reports the 405B 128K row).
FUSED_ATTENTION_WORK = 1.0
TIME_PARTS = ("GEMMs of the weights", "attention's s x s GEMMs", "softmax and dropout over the scores",
              "norms, adds, activation", "GEMMs' fixed costs")


def block_time_parts(model, hardware: MatmulHardware, tp: int = 1, cp: int = 1, micro_batch: int | None = None,
                     flash_attention: bool = True, ep: int = 1, sequence_parallel: bool = False) -> dict:
    """Where one block's forward time goes on one TP rank (seconds, keys :data:`TIME_PARTS`): the GEMMs of the
    weights (their roofline time), attention's core (the ``s x s`` products, or the fused kernel), the softmax and
    dropout over the scores, the other kernels that are not GEMMs, and the fixed cost every GEMM pays."""
    gemms = block_gemms(model, tp, cp, micro_batch, flash_attention, ep)
    core = sum(g.flops * (FUSED_ATTENTION_WORK if g.name == "attention (fused)" else 1) / roofline_flops(g, hardware)
               for g in gemms if g.name in ATTENTION_CORE)
    linear = sum(g.flops / roofline_flops(g, hardware) for g in gemms if g.name not in ATTENTION_CORE)
    everything = block_elementwise_bytes(model, tp, cp, micro_batch, flash_attention, sequence_parallel)
    scores = block_elementwise_bytes(model, tp, cp, micro_batch, flash_attention, sequence_parallel, True)
    return dict(zip(TIME_PARTS, (linear, core, scores / hardware.hbm_bytes_per_s,
                                 (everything - scores) / hardware.hbm_bytes_per_s,
                                 len(gemms) * hardware.fixed_seconds)))


def linear_gemm_efficiency(model, hardware: MatmulHardware, tp: int = 1, cp: int = 1,
                           micro_batch: int | None = None) -> float:
    """The share of the dense peak the block's GEMMs of the weights (q, k, v, the output projection, the MLP) reach
    together, each with its fixed cost."""
    gemms = [g for g in block_gemms(model, tp, cp, micro_batch) if g.name not in ATTENTION_CORE]
    return sum(g.flops for g in gemms) / sum(gemm_seconds(g, hardware) for g in gemms) / hardware.peak_flops


@functools.lru_cache(maxsize=4096)   # the search asks again for the same block; every argument is frozen
def block_rate(model, hardware: MatmulHardware, tp: int = 1, cp: int = 1, micro_batch: int | None = None,
               flash_attention: bool = True, ep: int = 1, sequence_parallel: bool = False) -> float:
    """FLOP/s one GPU reaches on a block: its GEMMs at their shapes' rate, its other kernels at the memory's. The
    same for every pass (backward does twice the forward's GEMMs over the same sizes and, at the roofline, reads
    and writes about twice its bytes; a recomputed forward repeats the forward), so one forward sets it."""
    flops = sum(g.flops for g in block_gemms(model, tp, cp, micro_batch, flash_attention, ep))
    parts = block_time_parts(model, hardware, tp, cp, micro_batch, flash_attention, ep, sequence_parallel)
    return flops / sum(parts.values())
