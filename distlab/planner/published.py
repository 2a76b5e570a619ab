"""Published, measured training runs, and the planner held against them (chapter 11's validation table).

Every row is a run a paper measured: model, layout, batch, sequence length, GPU count, and the throughput or MFU
it states, with the paper and table. Papers count differently, so every row is converted to the chapter's one
definition of MFU (:func:`mfu_from_published`): model FLOPs per token 6 N + 12 L h s (N the parameters that
multiply, the output projection included; attention over the full s x s square, as PaLM and Megatron count it;
recomputation not counted), tokens per second, and the dense bf16 peak of the GPU. What a paper does not state
(the micro-batch, the chunks of an interleaved schedule) the planner chooses for the layout (``search.tune``);
what it states is fixed.

The planner's time model has one set of constants per GPU type (``spec.GPU_CONSTANTS``), the same for every row.
A row passes when the predicted MFU is within ``BAND`` (relative) of the published one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from distlab.planner.search import rank_of, search, tune
from distlab.planner.spec import (CLUSTERS, GIB, MIXTRAL_8X7B, MODELS, Cluster, Layout, ModelSpec, Options,  # noqa: F401
                                  mixtral_spec)
from distlab.planner.step_time import Plan

BAND = 0.15  # a published 41 % must be predicted between 35 % and 47 %


def gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, seq_len: int, global_batch: int,
        source: str, micro_batch: int = 1) -> ModelSpec:
    """A GPT-style model as Megatron trains it (LayerNorm, biases, 4h GELU MLP, learned positions, tied output)."""
    return ModelSpec(name, layers, hidden, heads, heads, 4 * hidden, vocab, seq_len, micro_batch, global_batch, "gpt",
                     source)


def megatron_flops_per_token(model: ModelSpec) -> float:
    """The FLOPs per token that Megatron-LM's papers count, with full recomputation: 96 l h^2 (1 + s/6h +
    V/16lh) per token (Narayanan et al. 2021, section 5.1 and appendix): four passes over the blocks (forward,
    recomputed forward, backward counted twice), three over the output layer."""
    l, h, s, v = model.layers, model.hidden, model.seq_len, model.vocab
    return 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


@dataclass(frozen=True)
class PublishedRun:
    """One published, measured run. ``stated`` is what the paper gives, one of: ``("mfu", x)`` (an MFU counted
    as ours), ``("megatron_tflops", x)`` (TFLOP/s per GPU counted by :func:`megatron_flops_per_token`),
    ``("iteration_seconds", x)`` (seconds per step of the whole global batch)."""

    label: str
    source: str
    model: ModelSpec
    cluster: Cluster
    layout: Layout
    options: Options
    stated: tuple
    quoted: str  # the row as the paper prints it
    miss: str = ""  # why the planner misses this row at its published settings (a row with a reason must miss)

    @property
    def gpus(self) -> int:
        return self.layout.gpus


def mfu_from_published(run: PublishedRun) -> float:
    """The run's MFU in the chapter's one definition (model FLOPs, no recomputation, dense peak)."""
    kind, value = run.stated
    model, peak = run.model, run.cluster.peak_flops
    if kind == "mfu":
        return value
    if kind == "megatron_tflops":
        tokens_per_second = value * 1e12 * run.gpus / megatron_flops_per_token(model)
    elif kind == "iteration_seconds":
        tokens_per_second = model.global_batch * model.seq_len / value
    else:
        raise ValueError(f"unknown published figure {kind!r}")
    return tokens_per_second * model.flops_per_token() / (run.gpus * peak)


H100, A100 = CLUSTERS["h100-80gb"], CLUSTERS["a100-80gb"]
LLAMA3 = "Llama Team (2024), The Llama 3 Herd of Models, Table 4"
MEGATRON = "Narayanan et al. (2021), Efficient Large-Scale Language Model Training on GPU Clusters, Table 1"
KORTHIKANTI = ("Korthikanti et al. (2022), Reducing Activation Recomputation in Large Transformer Models: its MFU as "
               "NVIDIA/Megatron-LM's README states it")
MTNLG = "Smith et al. (2022), Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, sections 2.4 and 3"
# Llama 3 at its published settings (section 3.3.2, sources: llama3_*): no activation checkpointing at 8K tokens;
# FSDP that shards gradients and optimizer states and keeps the weights gathered after forward (the planner's
# reshard_after_forward=False under PP; torch's interleaved runtime, which the planner models, still re-gathers all
# but 3 of a rank's chunks, and keeps the stage's gradients unsharded in fp32 until the last microbatch: torch's
# pipeline stage, not necessarily Meta's); CP that all-gathers keys and values. Not
# stated, the planner's: V = 8 stages a rank (126 layers + the embedding and head chunks = 128 = 16 x 8), mb 1,
# Megatron's sequence parallelism (TP's region inputs saved as their shard, gathered again in backward), torch's
# microbatches a round (the paper's "N=5" is its Figure 6's, on 4 ranks), and the 128K row's recomputation, of which
# the paper says nothing: whole blocks, as Megatron's layers recompute them (recompute_early_stop=False, as
# MEGATRON_FULL), not PyTorch's checkpoint, which stops before a block's last GEMM and collective
LLAMA_PIPELINE = Options(zero_stage=3, schedule="interleaved_1f1b", chunks=8, sequence_parallel=True,
                         search_micro_batch=False, activation_checkpointing="none",
                         sp_saves_gathered_inputs=False, cp_attention="all_gather", recompute_early_stop=False)
LLAMA_LONG = replace(LLAMA_PIPELINE, activation_checkpointing=None)
LLAMA_MISS = ("does not fit without recomputation: the interleaved warm-up keeps 143 chunk-microbatches (128 at "
              "16,384 GPUs) on the first stage; Meta tuned its schedule and freed tensors in ways the paper does not "
              "quantify")
# Megatron-LM (2020-2022): its own layers, full recomputation of whole blocks, no flash attention; gradients
# all-reduced by its local DDP from 39B up (run_table_1.sh: DDP=local) and by torch's DDP below (DDP=torch: the 1.7B,
# 3.6B, 7.5B and 18B rows, which these settings count as local DDP too; none of them has PP, and none is among the
# runs the A100's factor is fitted to); the micro-batch and the chunks of each Table 1 row are fixed by NVIDIA's
# examples/sc21/run_table_1.sh (source megatron_sc21_run_table_1_*)
MEGATRON_FULL = Options(zero_stage=0, activation_checkpointing="full", flash_attention=False,
                        sequence_parallel=False, recompute_early_stop=False, search_micro_batch=False,
                        sp_saves_gathered_inputs=False,  # Megatron's own layers (planner.memory.megatron_layers)
                        pp_scatter_gather=True)          # on by default in Megatron-LM since February 2021


# Korthikanti et al.'s runs: selective recomputation with sequence parallelism; their micro-batch not found, chosen
KORTHIKANTI_SELECTIVE = replace(MEGATRON_FULL, activation_checkpointing="selective", sequence_parallel=True,
                                search_micro_batch=True)


def megatron_settings(micro_batch: int, chunks: int) -> Options:
    """A Table 1 row's schedule as run_table_1.sh sets it (chunks 1: plain 1F1B)."""
    return replace(MEGATRON_FULL, schedule="interleaved_1f1b" if chunks > 1 else "1f1b", chunks=chunks)


# Megatron-Core on H100 (NVIDIA/Megatron-LM README, weak scaling, its table an image: images/model_table.png): GPT
# models of vocabulary 131,072 and 4,096-token sequences, TP/PP/DP and batch as the table prints them, DP, TP and PP
# communication overlapped ("--overlap-grad-reduce, --overlap-param-gather", "--tp-comm-overlap"). Not stated, the
# planner's: the micro-batch, the interleave, the recomputation, ZeRO-1 (its distributed optimizer), and Megatron's
# sequence parallelism saving each TP region's input as its shard
MEGATRON_CORE = Options(zero_stage=1, async_tp=True, chunks=None, activation_checkpointing=None,
                        sp_saves_gathered_inputs=False,   # Megatron's SP, as for Llama 3: the planner's reading
                        recompute_early_stop=False)       # Megatron's recompute, where the search tries it
MEGATRON_CORE_README = "NVIDIA/Megatron-LM README, weak scaling (its table is an image, read by eye)"
MTNLG_SCALING = "Smith et al. (2022), MT-NLG 530B, section 2.4, as quoted by cli99/llm-analysis"


def megatron_core_gpt(name: str, layers: int, hidden: int, heads: int, global_batch: int) -> ModelSpec:
    return gpt(name, layers, hidden, heads, 131072, 4096, global_batch, MEGATRON_CORE_README)


# MT-NLG 530B (sections 2.2 and 3, as quoted): 105 layers, hidden 20480, 128 heads, 2048 tokens, batch 1920; its
# vocabulary was not found (Megatron's 51,200 here); 1F1B without interleaving (DeepSpeed's pipeline)
# DeepSpeed's pipeline engine carries MT-NLG's stages: it sends each TP rank's whole activation (no Megatron
# scatter/gather)
MTNLG_SETTINGS = replace(megatron_settings(1, 1), pp_scatter_gather=False)
MTNLG_530B = gpt("mt-nlg-530b", 105, 20480, 128, 51200, 2048, 1920, MTNLG)

RUNS: tuple[PublishedRun, ...] = (
    PublishedRun("Llama 3 405B, 8K tokens, 8,192 H100", LLAMA3, MODELS["405b"], H100, Layout(8, 16, 64, 1, 3),
                 LLAMA_PIPELINE, ("mfu", 0.43), "8,192 GPUs, TP 8, CP 1, PP 16, DP 64, seq 8,192, batch/DP 32, "
                 "16M tokens, 430 TFLOPs/GPU, 43 % BF16 MFU", LLAMA_MISS),
    PublishedRun("Llama 3 405B, 8K tokens, 16,384 H100", LLAMA3, MODELS["405b"], H100, Layout(8, 16, 128, 1, 3),
                 LLAMA_PIPELINE, ("mfu", 0.41), "16,384 GPUs, TP 8, CP 1, PP 16, DP 128, seq 8,192, batch/DP 16, "
                 "16M tokens, 400 TFLOPs/GPU, 41 % BF16 MFU", LLAMA_MISS),
    PublishedRun("Llama 3 405B, 128K tokens, 16,384 H100", LLAMA3,
                 replace(MODELS["405b"], seq_len=131072, global_batch=128), H100, Layout(8, 16, 8, 16, 3),
                 LLAMA_LONG, ("mfu", 0.38), "16,384 GPUs, TP 8, CP 16, PP 16, DP 8, seq 131,072, batch/DP 16, "
                 "16M tokens, 380 TFLOPs/GPU, 38 % BF16 MFU"),
    PublishedRun("MT-NLG 530B, 2,240 A100", MTNLG, MTNLG_530B,
                 A100, Layout(8, 35, 8, 1, 1), MTNLG_SETTINGS,
                 ("iteration_seconds", 60.1), "280 DGX A100 nodes (2,240 GPUs), TP 8, PP 35, DP 8, batch 1920, "
                 "seq 2048: 60.1 s per iteration, 126 TFLOP/s per GPU"),
    PublishedRun("MT-NLG 530B, 2,800 A100", MTNLG_SCALING,
                 MTNLG_530B, A100, Layout(8, 35, 10, 1, 1),
                 MTNLG_SETTINGS, ("iteration_seconds", 50.2),
                 "350 DGX A100 servers (2,800 GPUs), replicas of 280 GPUs (TP 8, PP 35), batch 1920, seq 2048: 50.2 s "
                 "per iteration, 121 TFLOP/s per GPU"),
    PublishedRun("MT-NLG 530B, 3,360 A100", MTNLG_SCALING,
                 MTNLG_530B, A100, Layout(8, 35, 12, 1, 1),
                 MTNLG_SETTINGS, ("iteration_seconds", 44.4),
                 "420 DGX A100 servers (3,360 GPUs), replicas of 280 GPUs (TP 8, PP 35), batch 1920, seq 2048: 44.4 s "
                 "per iteration, 113 TFLOP/s per GPU"),
    PublishedRun("Megatron 145.6B, 1,536 A100", MEGATRON, gpt("gpt-145.6b", 80, 12288, 96, 51200, 2048, 2304,
                                                              MEGATRON, micro_batch=2),
                 A100, Layout(8, 8, 24, 1, 0), megatron_settings(2, 2), ("megatron_tflops", 148),
                 "145.6B: 96 heads, hidden 12288, 80 layers, TP 8, PP 8, 1536 GPUs, batch 2304, 148 TFLOP/s, 47 %"),
    PublishedRun("Megatron 310.1B, 1,920 A100", MEGATRON, gpt("gpt-310.1b", 96, 16384, 128, 51200, 2048, 2160,
                                                              MEGATRON, micro_batch=1),
                 A100, Layout(8, 16, 15, 1, 0), megatron_settings(1, 2), ("megatron_tflops", 155),
                 "310.1B: 128 heads, hidden 16384, 96 layers, TP 8, PP 16, 1920 GPUs, batch 2160, 155 TFLOP/s, 50 %"),
    PublishedRun("Megatron 529.6B, 2,520 A100", MEGATRON, gpt("gpt-529.6b", 105, 20480, 128, 51200, 2048, 2520,
                                                              MEGATRON, micro_batch=1),
                 A100, Layout(8, 35, 9, 1, 0), megatron_settings(1, 3), ("megatron_tflops", 163),
                 "529.6B: 128 heads, hidden 20480, 105 layers, TP 8, PP 35, 2520 GPUs, batch 2520, 163 TFLOP/s, 52 %"),
    PublishedRun("Megatron 1T, 3,072 A100", MEGATRON, gpt("gpt-1t", 128, 25600, 160, 51200, 2048, 3072, MEGATRON, micro_batch=1),
                 A100, Layout(8, 64, 6, 1, 0), megatron_settings(1, 1), ("megatron_tflops", 163),
                 "1008.0B: 160 heads, hidden 25600, 128 layers, TP 8, PP 64, 3072 GPUs, batch 3072, 163 TFLOP/s, 52 %"),
    PublishedRun("Megatron 175B, selective recomputation, 64 A100", KORTHIKANTI,
                 gpt("gpt-175b", 96, 12288, 96, 51200, 2048, 64, KORTHIKANTI), A100, Layout(8, 8, 1, 1, 1),
                 KORTHIKANTI_SELECTIVE,
                 ("mfu", 0.514), "175B: MFU 51.4 %, HFU 52.8 %, selective recomputation and sequence parallelism, "
                 "measured with a data-parallel size of one (Megatron-LM README); its layout and batch (TP 8, PP 8, "
                 "batch 64 here) were not found in a source"),
    PublishedRun("Megatron 22B, selective recomputation, 8 A100", KORTHIKANTI,
                 gpt("gpt-22b", 48, 6144, 64, 51200, 2048, 4, KORTHIKANTI), A100, Layout(8, 1, 1, 1, 1),
                 KORTHIKANTI_SELECTIVE,
                 ("mfu", 0.415), "22B: MFU 41.5 %, HFU 43.7 %, selective recomputation and sequence parallelism, "
                 "measured with a data-parallel size of one (Megatron-LM README); its layout and batch (TP 8, PP 1, "
                 "batch 4 here) were not found in a source"),
    PublishedRun("Megatron-Core 177B, 2,304 H100", MEGATRON_CORE_README,
                 megatron_core_gpt("gpt-177b", 96, 12288, 96, 1152), H100, Layout(8, 6, 48, 1, 1), MEGATRON_CORE,
                 ("mfu", 0.44), "177B: 96 heads, hidden 12288, 96 layers, TP 8, PP 6, DP 48, 2304 GPUs, batch 1152, "
                 "432.8 TFLOP/s per GPU, MFU 44 %"),
    PublishedRun("Megatron-Core 462B, 6,144 H100", MEGATRON_CORE_README,
                 megatron_core_gpt("gpt-462b", 112, 18432, 144, 3072), H100, Layout(8, 16, 48, 1, 1), MEGATRON_CORE,
                 ("mfu", 0.47), "462B: 144 heads, hidden 18432, 112 layers, TP 8, PP 16, DP 48, 6144 GPUs, batch 3072, "
                 "459.9 TFLOP/s per GPU, MFU 47 %"),
)


# Where each row was read (keys of distlab.planner.sources: SOURCES, read in the work itself, or SECONDARY, read in a
# quotation of it): the figure first, then the settings fixed from the work. tests/unit/test_planner_sources.py
# checks that every row has them and that the quoted words hold the row's figure and settings.
RUN_SOURCES: dict[str, tuple[str, ...]] = {
    "Llama 3 405B, 8K tokens, 8,192 H100": ("llama3_table4", "llama3_no_activation_checkpointing", "llama3_fsdp",
                                            "llama3_pipeline_schedule", "llama3_table3_shape"),
    "Llama 3 405B, 8K tokens, 16,384 H100": ("llama3_table4", "llama3_no_activation_checkpointing", "llama3_fsdp",
                                             "llama3_pipeline_schedule", "llama3_table3_shape"),
    "Llama 3 405B, 128K tokens, 16,384 H100": ("llama3_table4", "llama3_cp_all_gather", "llama3_fsdp",
                                               "llama3_pipeline_schedule", "llama3_table3_shape"),
    "MT-NLG 530B, 2,240 A100": ("mtnlg_iteration_times", "mtnlg_shape_and_layout"),
    "MT-NLG 530B, 2,800 A100": ("mtnlg_iteration_times", "mtnlg_shape_and_layout"),
    "MT-NLG 530B, 3,360 A100": ("mtnlg_iteration_times", "mtnlg_shape_and_layout"),
    "Megatron-Core 177B, 2,304 H100": ("megatron_readme_h100_weak_scaling_table", "megatron_readme_h100_text"),
    "Megatron-Core 462B, 6,144 H100": ("megatron_readme_h100_weak_scaling_table", "megatron_readme_h100_text"),
    "Megatron 145.6B, 1,536 A100": ("megatron_sc21_table1", "megatron_sc21_run_table_1_145b"),
    "Megatron 310.1B, 1,920 A100": ("megatron_sc21_table1", "megatron_sc21_run_table_1_310b"),
    "Megatron 529.6B, 2,520 A100": ("megatron_sc21_table1", "megatron_sc21_run_table_1_530b"),
    "Megatron 1T, 3,072 A100": ("megatron_sc21_table1", "megatron_sc21_run_table_1_1t"),
    "Megatron 175B, selective recomputation, 64 A100": ("korthikanti_megatron_readme_mfu_hfu",),
    "Megatron 22B, selective recomputation, 8 A100": ("korthikanti_megatron_readme_mfu_hfu",),
}


def source_of(key: str):
    """The :class:`distlab.planner.sources.Source` of ``key``, read in the work or (SECONDARY) in a quotation."""
    from distlab.planner.sources import SECONDARY, SOURCES

    return SOURCES.get(key) or SECONDARY[key]


def validate(run: PublishedRun) -> dict:
    """One run: the planner's plan for the published layout (the unstated settings tuned), its MFU beside the
    published one, the relative error, and whether it is inside the band."""
    plan: Plan = tune(run.model, run.cluster, run.layout, run.options, run.gpus)
    published = mfu_from_published(run)
    error = plan.mfu / published - 1
    return {"label": run.label, "source": run.source, "quoted": run.quoted, "layout": run.layout.label(),
            "gpus": run.gpus, "fits": plan.fits, "gib_per_gpu": plan.memory_per_gpu_bytes["total"] / GIB,
            "settings": plan.describe_settings(), "published_mfu": published, "predicted_mfu": plan.mfu,
            "error": error, "passes": plan.fits and abs(error) <= BAND, "miss": run.miss, "plan": plan}


def validation_table() -> list[dict]:
    return [validate(run) for run in RUNS]


def validation_markdown() -> str:
    lines = ["| run (source) | layout | GPUs | settings (the planner's where unstated) | fits (GiB) | published "
             "MFU, our definition | predicted (derived) | error | counted (fits, and within 15 %) |",
             "|---|---|---:|---|---|---:|---:|---:|---|"]
    for r in validation_table():
        lines.append(f"| {r['label']} | {r['layout']} | {r['gpus']:,} | {r['settings']} | "
                     f"{'yes' if r['fits'] else 'no'} ({r['gib_per_gpu']:.1f}) | {r['published_mfu']:.1%} | "
                     f"{r['predicted_mfu']:.1%} | {r['error']:+.0%} | "
                     f"{'yes' if r['passes'] else 'NO: ' + (r['miss'] or 'no reason given')} |")
    return "\n".join(lines)


PUBLISHED = tuple({"run": run} for run in RUNS[:3])


def published_table() -> list[dict]:
    """Llama 3's published layouts and their place in the search over the same GPUs and settings."""
    rows = []
    for run in RUNS[:3]:
        plan = tune(run.model, run.cluster, run.layout, run.options, run.gpus)
        plans = search(run.model, run.cluster, run.gpus, replace(run.options, zero_stage=None, chunks=None,
                                                                  search_micro_batch=True,
                                                                  activation_checkpointing=None))
        top = plans[0]
        rows.append({"claim": run.label, "gpus": run.gpus, "layout": run.layout.label(), "fits": plan.fits,
                     "gib_per_gpu": plan.memory_per_gpu_bytes["total"] / GIB, "mfu": plan.mfu,
                     "rank": rank_of(plans, run.layout), "fitting": sum(p.fits for p in plans),
                     "candidates": len(plans), "best": top.layout.label(), "best_mfu": top.mfu})
    return rows


def published_table_markdown() -> str:
    lines = ["| published layout | fits at its published settings (derived) | GiB per GPU (derived) | MFU (derived) | "
             "place among layouts that fit, at the planner's settings | the planner's first choice (MFU) |",
             "|---|---|---:|---:|---:|---|"]
    for r in published_table():
        lines.append(f"| {r['claim']} | {'yes' if r['fits'] else 'no'} | {r['gib_per_gpu']:.1f} | {r['mfu']:.0%} | "
                     f"{r['rank'] or '-'} of {r['fitting']} | {r['best']} ({r['best_mfu']:.0%}) |")
    return "\n".join(lines)


# Mixture of experts: a published table that lists total parameters as the per-token ones (or the reverse)
# gets the memory (all experts are stored) or the compute (only top_k run) wrong. Mixtral 8x7B's shape is
# spec.MIXTRAL_8X7B; 8x22B's:
MIXTRAL_8X22B = {"layers": 56, "hidden": 6144, "heads": 48, "kv_heads": 8, "ffn": 16384, "vocab": 32768,
                 "experts": 8, "top_k": 2}


def moe_params(layers, hidden, heads, kv_heads, ffn, vocab, experts, top_k) -> dict:
    """Total (stored: every expert) and active (used per token: top_k experts) parameters of a LLaMA-style
    mixture of experts with a router per layer: the planner's own count (:class:`ModelSpec`)."""
    spec = mixtral_spec("moe", dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                                    vocab=vocab, experts=experts, top_k=top_k))
    return {"total": spec.num_params(), "active": spec.active_params(), "naive_name": experts * 7e9}


# DeepSeek-V3's published sizes (its abstract): 671 B parameters in all, 37 B activated per token
DEEPSEEK_V3_PUBLISHED = {"total": 671e9, "active": 37e9}
DEEPSEEK_V3, H800 = MODELS["deepseek-v3"], CLUSTERS["h800-80gb"]
# Its layout (section 3.2): 16-way pipeline parallelism (DualPipe), 64-way expert parallelism across 8 nodes,
# ZeRO-1 data parallelism, no tensor parallelism: dp = 2,048 / 16 = 128, EP groups of 64 dp ranks.
DEEPSEEK_V3_LAYOUT = Layout(tp=1, pp=16, dp=128, zero_stage=1, ep=64)
# How it moves tokens (section 3.2.2, 3.3.3): node-limited routing, at most 4 nodes a token, one copy a node over
# InfiniBand forwarded over NVLink; the dispatch in FP8 (a scale per 128 values), the combine in bf16; DualPipe
# overlaps the all-to-alls with another microbatch's compute
DEEPSEEK_V3_OPTIONS = Options(ep_overlap=True, ep_node_limit=4, ep_dispatch_bytes=1 + 4 / 128)
# "180K H800 GPU hours" per trillion training tokens (section 1): a measured throughput, 1e12 / (180e3 x 3600)
# tokens a second per GPU, in FP8 mixed precision with DualPipe hiding the all-to-alls
DEEPSEEK_V3_GPU_HOURS_PER_TRILLION_TOKENS = 180e3


def fitted_efficiency(gpu: str, grid=tuple(x / 100 for x in range(50, 101))) -> float:
    """The kernel-gap factor that ``spec.GPU_CONSTANTS`` states for ``gpu`` (``gemm_time_share``, the block rate's
    multiplier), found again: on a grid of 0.01, the value whose largest relative error over that GPU's rows is smallest (one
    constant for all of its rows; the named misses left out: they do not fit at their published settings)."""
    rows = [run for run in RUNS if run.cluster.name.startswith(gpu.lower()) and not run.miss]   # named misses out

    def worst(share):
        return max(abs(validate(replace(run, cluster=replace(run.cluster, gemm_time_share=share)))["error"])
                   for run in rows)

    return min(grid, key=worst)


# Megatron-LM's Table 1 (Narayanan et al. 2021), all ten rows, at the settings NVIDIA's examples/sc21/run_table_1.sh
# gives each (source megatron_sc21_run_table_1_all): (billions, heads, hidden, layers, TP, PP, GPUs, batch, published
# TFLOP/s per GPU, micro-batch, virtual stages a rank). Vocabulary 51,200 and 2,048 tokens (megatron_sc21_setup);
# every row recomputes whole blocks; the five largest interleave where the script sets layers per virtual stage.
MEGATRON_TABLE1 = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
)


def megatron_table1_runs() -> list[PublishedRun]:
    """Table 1's rows as published runs, at their published settings (nothing chosen to match)."""
    runs = []
    for size, heads, hidden, layers, tp, pp, gpus, batch, tflops, micro_batch, virtual in MEGATRON_TABLE1:
        model = gpt(f"gpt-{size}b", layers, hidden, heads, 51200, 2048, batch, MEGATRON, micro_batch=micro_batch)
        runs.append(PublishedRun(f"Megatron {size}B, {gpus:,} A100", MEGATRON, model, A100,
                                 Layout(tp, pp, gpus // (tp * pp), 1, 0), megatron_settings(micro_batch, virtual),
                                 ("megatron_tflops", tflops), f"{size}B: {tflops} TFLOP/s per GPU"))
    return runs


def megatron_tflops(run: PublishedRun, mfu: float) -> float:
    """An MFU (the chapter's count) as Megatron's TFLOP/s per GPU (its count: recomputation included)."""
    tokens_per_second_per_gpu = mfu * run.cluster.peak_flops / run.model.flops_per_token()
    return tokens_per_second_per_gpu * megatron_flops_per_token(run.model) / 1e12


def megatron_width_table() -> list[dict]:
    """Per-GPU TFLOP/s as Table 1 publishes them beside the planner's, at each row's published settings (no flash
    kernel: Megatron's 2021 attention), with where a block's time goes on one TP rank (planner.gemm): the share of
    the peak the GEMMs of the weights reach, the share of the block's time spent on attention's ``s x s`` work
    (its score GEMMs, the softmax and dropout over the scores), the block's share of the peak as a whole, and
    whether the row is one of the runs the A100's constant is fitted to (:func:`fitted_efficiency`)."""
    from distlab.planner.gemm import TIME_PARTS, block_rate, block_time_parts, hardware_of, linear_gemm_efficiency

    def key(run):
        return run.model.hidden, run.model.layers, run.layout.tp, run.layout.pp, run.gpus

    fitted = {key(run) for run in RUNS if run.cluster.name.startswith("a100") and not run.miss}
    rows = []
    for run in megatron_table1_runs():
        plan = tune(run.model, run.cluster, run.layout, run.options, run.gpus)
        model, hardware, flash = plan_model(run, plan), hardware_of(run.cluster), run.options.flash_attention
        tp = run.layout.tp
        predicted = megatron_tflops(run, plan.mfu)
        parts = block_time_parts(model, hardware, tp, flash_attention=flash)
        share = {name: seconds / sum(parts.values()) for name, seconds in parts.items()}
        rows.append({"label": run.label, "hidden": run.model.hidden, "tp": tp, "width_per_rank": run.model.hidden // tp,
                     "published": run.stated[1], "predicted": predicted, "fits": plan.fits,
                     "error": predicted / run.stated[1] - 1, "flash_attention": flash, "in_fit": key(run) in fitted,
                     "linear_efficiency": linear_gemm_efficiency(model, hardware, tp),
                     "time_shares": share, "scores_share": share[TIME_PARTS[1]] + share[TIME_PARTS[2]],
                     "block_efficiency": block_rate(model, hardware, tp, flash_attention=flash) / hardware.peak_flops})
    return rows


def plan_model(run: PublishedRun, plan: Plan) -> ModelSpec:
    """The run's model at the micro-batch its plan ran."""
    return replace(run.model, micro_batch=plan.settings.get("micro_batch", run.model.micro_batch))


def megatron_width_markdown() -> str:
    lines = ["| Table 1 row | hidden, TP | weights' GEMMs: share of peak (derived) | s x s work: share of the block's "
             "time (derived) | the block: share of peak (derived) | published TFLOP/s per GPU | planner (derived) | "
             "error | in the A100 fit |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in megatron_width_table():
        lines.append(f"| {r['label']} | {r['hidden']:,}, {r['tp']} | {r['linear_efficiency']:.0%} | "
                     f"{r['scores_share']:.0%} | {r['block_efficiency']:.0%} | {r['published']} | "
                     f"{r['predicted']:.0f} | {r['error']:+.0%} | {'yes' if r['in_fit'] else 'no'} |")
    return "\n".join(lines)
