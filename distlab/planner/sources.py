"""Every published figure the planner and chapters 11 and 13 state, with where it was read and the words quoted.

Three dicts:

* ``SOURCES``: read in the primary source itself (the paper's own text, the repository file at a commit, the
  vendor's own repository), quoted verbatim (``...`` marks a cut; table rows are quoted as the extracted text
  prints them, cells separated by ``|``).
* ``SECONDARY``: the primary source could not be read here; the figure was read in a third party's copy or
  quotation of it. Use with care; each says whose words they are.
* ``NOT_FOUND``: looked for, not found in any primary (or usable secondary) source here.

The ``DISAGREEMENTS`` comment block at the end lists every place where the code or the chapter text states a
figure that differs from what was found.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    work: str  # "Dubey et al. (2024), The Llama 3 Herd of Models, arXiv:2407.21783"
    where: str  # "section 3.3.2" / "Table 4" / "NVIDIA/Megatron-LM examples/sc21/run_table_1.sh at <commit sha>"
    quote: str  # the exact words/row, verbatim (trim with ... only)
    url: str = ""


LLAMA3 = "Llama Team, AI @ Meta (2024), The Llama 3 Herd of Models, arXiv:2407.21783"
LLAMA3_URL = "https://arxiv.org/abs/2407.21783"
MEGATRON_SC21 = ("Narayanan et al. (2021), Efficient Large-Scale Language Model Training on GPU Clusters Using "
                 "Megatron-LM, SC21, arXiv:2104.04473")
MEGATRON_SC21_URL = "https://arxiv.org/abs/2104.04473"
DSV3 = "DeepSeek-AI (2024), DeepSeek-V3 Technical Report, arXiv:2412.19437"
DSV3_URL = "https://arxiv.org/abs/2412.19437"
MIXTRAL = "Jiang et al. (2024), Mixtral of Experts, arXiv:2401.04088"
MIXTRAL_URL = "https://arxiv.org/abs/2401.04088"
# commits of the repositories read (git directories fetched with the search tool's fetch, or read_file)
MEGATRON_SC21_FIRST_COMMIT = "de7dc40f883ceed06344051c3c7ebd57da59cc53"  # 2021-08-10, first run_table_1.sh
MEGATRON_SC21_2022_COMMIT = "79a3bb6bf2c85b748c46749dd0695e23310d4e16"  # 2022-07-24, same numbers, new flag name
MEGATRON_HEAD = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # NVIDIA/Megatron-LM snapshot read (2026-08-22)
MEGATRON_MOE_README_COMMIT = "7cbcca674d12929e34c2fe030590af19230989ca"  # 2026-01-27, last README with "468 TFLOPS"
MEGATRON_MFU_README_COMMIT = "841f789f482905e7913db888c986ca6084b1f38c"  # 2022-05-19, README MFU/HFU table
DSV3_REPO_HEAD = "9b4e9788e4a3a731f7567338ed15d3ec549ce03b"  # deepseek-ai/DeepSeek-V3 snapshot read (2025-08-28)
DSV3_CONFIG_COMMIT = "4c2fdb8f55e049553b9f4f1a3241f86d739c8cf8"  # last commit touching config_671B.json
TORCHTITAN_BENCH_COMMIT = "31a17bfdb70bab6f62a13d21816a5339b911d6e3"
TORCHTITAN_PERF_DOC_COMMIT = "041336434916bdc0f88c1f89fda176fd3c2092e4"
# the torchtitan commit the H100 benchmark ran (its "Versions and Dates" table: 9dec370, 2024/12/26)
TORCHTITAN_BENCH_RUN_COMMIT = "9dec370ad26b5f8e9a7333a0e36165018262644b"
NCCL_COMMIT = "b6475625fbcaa2c3c0e50eed2fa1255d7514d4a2"
NCCL_HEAD = "5067397c2676d5aed50042fc39e5c8ee96eb0027"  # NVIDIA/nccl snapshot read (2026-06-11), tuning.cc
XLA_MATMUL_TABLE_COMMIT = "372d578bb861cc5804e56d37d93aec931a59762c"  # tensorflow/tensorflow, the version read
DEEPSPEED_HEAD = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"  # deepspeedai/DeepSpeed snapshot read
TORCHTITAN_BENCH_URL = ("https://github.com/pytorch/torchtitan/blob/" + TORCHTITAN_BENCH_COMMIT
                        + "/benchmarks/llama3_h100_202412_torchtitan.md")
MEGATRON_MOE_README_URL = ("https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_MOE_README_COMMIT
                           + "/megatron/core/transformer/moe/README.md")

SOURCES: dict[str, Source] = {
    "deepseek_v3_dualpipe_two_copies": Source(
        work="DeepSeek-AI (2024), DeepSeek-V3 Technical Report, arXiv:2412.19437",
        where="section 3.2.1, after Table 2",
        quote="Although DualPipe requires keeping two copies of the model parameters, this does not significantly "
              "increase the memory consumption since we use a large EP size during training.",
        url="https://arxiv.org/abs/2412.19437"),
    # ------------------------------------------------------------------------------------------------------
    # 1. Llama 3 (arXiv:2407.21783)
    # ------------------------------------------------------------------------------------------------------
    "llama3_table4": Source(
        LLAMA3, "Table 4 (section 3.3.2), PDF text",
        "GPUs TP CP PP DP Seq. Len. Batch size/DP Tokens/Batch TFLOPs/GPU BF16 MFU\n"
        "8,192 8 1 16 64 8,192 32 16M 430 43%\n"
        "16,384 8 1 16 128 8,192 16 16M 400 41%\n"
        "16,384 8 16 16 8 131,072 16 16M 380 38%\n"
        "Table 4 Scaling configurations and MFU for each stage of Llama 3 405B pre-training. See text and Figure 5 "
        "for descriptions of each type of parallelism.",
        LLAMA3_URL),
    "llama3_table4_html_128k_row": Source(
        LLAMA3 + " (arXiv HTML rendering, July 23, 2024 version)", "Table 4, third row, as the arXiv HTML prints it",
        "| 16,384 | 8 | 16 | 16 | 4 | 131,072 | 16 | 16M | 380 | 38% |  -- the HTML rendering prints DP 4 for the "
        "128K row; the PDF (and 8 x 16 x 16 x DP = 16,384) gives DP 8",
        "https://arxiv.org/html/2407.21783"),
    "llama3_mfu_38_43": Source(
        LLAMA3, "section 3.3.2, GPU utilization",
        "Through careful tuning of the parallelism configuration, hardware, and software, we achieve an overall BF16 "
        "Model FLOPs Utilization (MFU; Chowdhery et al. (2023)) of 38-43% for the configurations shown in Table 4. "
        "The slight drop in MFU to 41% on 16K GPUs with DP=128 compared to 43% on 8K GPUs with DP=64 is due to the "
        "lower batch size per DP group needed to keep the global tokens per batch constant during training.",
        LLAMA3_URL),
    "llama3_no_activation_checkpointing": Source(
        LLAMA3, "section 3.3.2, Pipeline parallelism improvements (last sentence)",
        "Finally, to reduce memory cost, based on detailed memory allocation profiling, we proactively deallocate "
        "tensors that will not be used for future computation, including the input and output tensors of each "
        "pipeline stage, that will not be used for future computation. With these optimizations, we could pre-train "
        "Llama 3 on sequences of 8K tokens without activation checkpointing.",
        LLAMA3_URL),
    "llama3_fsdp": Source(
        LLAMA3, "section 3.3.2",
        "We use fully sharded data parallelism (FSDP; ...), which shards the model, optimizer, and gradients while "
        "implementing data parallelism which processes data in parallel on multiple GPUs and synchronizes after each "
        "training step. Our use of FSDP for Llama 3 shards optimizer states and gradients, but for model shards we "
        "do not reshard after forward computation to avoid an extra all-gather communication during backward passes.",
        LLAMA3_URL),
    "llama3_pipeline_schedule": Source(
        LLAMA3, "section 3.3.2, Pipeline parallelism improvements",
        "To address these issues, we modify our pipeline schedule as shown in Figure 6, which allows setting N "
        "flexibly—in this case N=5, which can run a arbitrary number of micro-batches in each batch. ... To balance "
        "the pipeline, we reduce one Transformer layer each from the first and the last stages, respectively. This "
        "means that the first model chunk on the first stage has only the embedding, and the last model chunk on the "
        "last stage has only output projection and loss calculation. To reduce pipeline bubbles, we use an "
        "interleaved schedule (Narayanan et al., 2021) with V pipeline stages on one pipeline rank. Overall pipeline "
        "bubble ratio is (PP-1)/(V*M). Further, we adopt asynchronous point-to-point communication in PP ... "
        "[V, the number of stages a rank holds, is not given a value anywhere in the section; Figure 6 illustrates "
        "8 stages on 4 ranks]",
        LLAMA3_URL),
    "llama3_pipeline_imbalance": Source(
        LLAMA3, "section 3.3.2, Pipeline parallelism improvements (challenges)",
        "Memory imbalance. Existing pipeline parallelism implementations lead to imbalanced resource consumption. "
        "The first stage consumes more memory due to the embedding and the warm-up micro-batches. Computation "
        "imbalance. After the last layer of the model, we need to calculate output and loss, making this stage the "
        "execution latency bottleneck.",
        LLAMA3_URL),
    "llama3_cp_all_gather": Source(
        LLAMA3, "section 3.3.2, Context parallelism for long sequences",
        "In CP, we partition across the sequence dimension, and specifically we partition the input sequence into "
        "2 × CP chunks so each CP rank receives two chunks for better load balancing. ... Different from existing CP "
        "implementations that overlap communication and computation in a ring-like structure (Liu et al., 2023), our "
        "CP implementation adopts an all-gather based method where we first all-gather the key (K) and value (V) "
        "tensors, and then compute attention output for the local query (Q) tensor chunk. Although the all-gather "
        "communication latency is exposed in the critical path, we still adopt this approach ...",
        LLAMA3_URL),
    "llama3_parallelism_order": Source(
        LLAMA3, "section 3.3.2, Network-aware parallelism configuration; Figure 5 caption",
        "The order of parallelism dimensions, [TP, CP, PP, DP], is optimized for network communication. The "
        "innermost parallelism requires the highest network bandwidth and lowest latency, and hence is usually "
        "constrained to within the same server. ... GPUs are divided into parallelism groups in the order of "
        "[TP, CP, PP, DP], where DP stands for FSDP.",
        LLAMA3_URL),
    "llama3_table3_shape": Source(
        LLAMA3, "Table 3 (section 3.2)",
        "| | 8B | 70B | 405B | ... | Layers | 32 | 80 | 126 | Model Dimension | 4,096 | 8192 | 16,384 | "
        "FFN Dimension | 14,336 | 28,672 | 53,248 | Attention Heads | 32 | 64 | 128 | Key/Value Heads | 8 | 8 | 8 | "
        "... Activation Function | SwiGLU | Vocabulary Size | 128,000 | Positional Embeddings | RoPE (θ = 500,000) | "
        "Table 3: Overview of the key hyperparameters of Llama 3.",
        LLAMA3_URL),
    "llama3_405b_shape_text": Source(
        LLAMA3, "section 3.2",
        "Llama 3 405B uses an architecture with 126 layers, a token representation dimension of 16,384, and 128 "
        "attention heads; see Table 3 for details. ... We use grouped query attention (GQA; Ainslie et al. (2023)) "
        "with 8 key-value heads ... We use a vocabulary with 128K tokens.",
        LLAMA3_URL),
    "llama3_compute": Source(
        LLAMA3, "section 3.3.1, Compute",
        "Llama 3 405B is trained on up to 16K H100 GPUs, each running at 700W TDP with 80GB HBM3, using Meta's Grand "
        "Teton AI server platform (Meta, 2022). Each server is equipped with eight GPUs and two CPUs. Within a server, "
        "the eight GPUs are connected via NVLink.",
        LLAMA3_URL),
    "llama3_network": Source(
        LLAMA3, "section 3.3.1, Network",
        "Llama 3 405B used RDMA over Converged Ethernet (RoCE) fabric based on the Arista 7800 and Minipack2 Open "
        "Compute Project OCP rack switches. Smaller models in the Llama 3 family were trained using Nvidia Quantum2 "
        "Infiniband fabric. Both RoCE and Infiniband clusters leverage 400 Gbps interconnects between GPUs.",
        LLAMA3_URL),
    # ------------------------------------------------------------------------------------------------------
    # 2. Megatron-LM, Narayanan et al. 2021 (SC21)
    # ------------------------------------------------------------------------------------------------------
    "megatron_sc21_table1": Source(
        MEGATRON_SC21, "Table 1 (section 5.1)",
        "Number of parameters (billion) | Attention heads | Hidden size | Number of layers | Tensor model-parallel "
        "size | Pipeline model-parallel size | Number of GPUs | Batch size | Achieved teraFlOP/s per GPU | Percentage "
        "of theoretical peak FLOP/s | Achieved aggregate petaFLOP/s\n"
        "1.7 | 24 | 2304 | 24 | 1 | 1 | 32 | 512 | 137 | 44% | 4.4\n"
        "3.6 | 32 | 3072 | 30 | 2 | 1 | 64 | 512 | 138 | 44% | 8.8\n"
        "7.5 | 32 | 4096 | 36 | 4 | 1 | 128 | 512 | 142 | 46% | 18.2\n"
        "18.4 | 48 | 6144 | 40 | 8 | 1 | 256 | 1024 | 135 | 43% | 34.6\n"
        "39.1 | 64 | 8192 | 48 | 8 | 2 | 512 | 1536 | 138 | 44% | 70.8\n"
        "76.1 | 80 | 10240 | 60 | 8 | 4 | 1024 | 1792 | 140 | 45% | 143.8\n"
        "145.6 | 96 | 12288 | 80 | 8 | 8 | 1536 | 2304 | 148 | 47% | 227.1\n"
        "310.1 | 128 | 16384 | 96 | 8 | 16 | 1920 | 2160 | 155 | 50% | 297.4\n"
        "529.6 | 128 | 20480 | 105 | 8 | 35 | 2520 | 2520 | 163 | 52% | 410.2\n"
        "1008.0 | 160 | 25600 | 128 | 8 | 64 | 3072 | 3072 | 163 | 52% | 502.0\n"
        "Table 1: Weak-scaling throughput for GPT models ranging from 1 billion to 1 trillion parameters.",
        MEGATRON_SC21_URL),
    "megatron_sc21_flops_eq3": Source(
        MEGATRON_SC21, "section 5.1, equation (3)",
        r"Considering just these GEMMs, the number of FLOPs per iteration is (more details in the Appendix): "
        r"F = 96Bslh^{2} \left( 1 + \frac{s}{6h} + \frac{V}{16lh} \right). (3) This is a lower bound for the true "
        r"FLOP count but should be close to the actual value. ... We also note that equation (3) assumes activation "
        r"recomputation and takes into account the floating-point operations associated with the extra forward pass.",
        MEGATRON_SC21_URL),
    "megatron_sc21_setup": Source(
        MEGATRON_SC21, "section 5.1",
        "In particular, we use the interleaved pipeline schedule with the scatter/gather optimization enabled. All "
        "models use a vocabulary size (denoted by V) of 51,200 (multiple of 1024) and a sequence length (s) of 2048.",
        MEGATRON_SC21_URL),
    "megatron_sc21_a100_peak_and_selene": Source(
        MEGATRON_SC21, "section 5 (evaluation setup)",
        "Each cluster node has 8 NVIDIA 80-GB A100 GPUs [6], connected to each other by NVLink and NVSwitch [9]. Each "
        "node has eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs for application communication ... The peak device "
        "throughput of an A100 GPU with 16-bit precision is 312 teraFLOP/s.",
        MEGATRON_SC21_URL),
    "megatron_sc21_gpt3_1024_a100": Source(
        MEGATRON_SC21, "section 5.1, Training Time Estimates",
        "Let us consider the GPT-3 model with P=175 billion parameters as an example. This model was trained on "
        "T=300 billion tokens. On n=1024 A100 GPUs using batch size 1536, we achieve X=140 teraFLOP/s per GPU. As a "
        "result, the time required to train this model is 34 days.",
        MEGATRON_SC21_URL),
    "megatron_sc21_script_common": Source(
        "NVIDIA/Megatron-LM", f"examples/sc21/CONFIG.sh (history; removed at HEAD {MEGATRON_HEAD})",
        '--micro-batch-size ${MBS} \\ --global-batch-size ${GBS} \\ ... --DDP-impl ${DDP} \\ ... --seq-length 2048 '
        '\\ --max-position-embeddings 2048 \\ ... --fp16 \\ --loss-scale 8192 "',
        "https://github.com/NVIDIA/Megatron-LM/tree/" + MEGATRON_SC21_2022_COMMIT + "/examples/sc21"),
    "megatron_sc21_run_table_1_76b": Source(
        "NVIDIA/Megatron-LM", f"examples/sc21/run_table_1.sh at {MEGATRON_SC21_FIRST_COMMIT} (2021-08-10)",
        'elif [ ${MODEL_SIZE} == "76B" ]; then TP=8 PP=4 MBS=2 GBS=1792 NLS=60 HS=10240 NAH=80 DDP=local '
        'NNODES=128 MEGATRON_EXTRA_PARAMS="--checkpoint-activations --num-layers-per-virtual-pipeline-stage 5"  '
        '[60 layers / PP 4 = 15 per rank, 5 per virtual stage: 3 chunks a rank]',
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_SC21_FIRST_COMMIT + "/examples/sc21/run_table_1.sh"),
    "megatron_sc21_run_table_1_145b": Source(
        "NVIDIA/Megatron-LM", f"examples/sc21/run_table_1.sh at {MEGATRON_SC21_FIRST_COMMIT} (2021-08-10)",
        'elif [ ${MODEL_SIZE} == "145B" ]; then TP=8 PP=8 MBS=2 GBS=2304 NLS=80 HS=12288 NAH=96 DDP=local '
        'NNODES=192 MEGATRON_EXTRA_PARAMS="--checkpoint-activations --num-layers-per-virtual-pipeline-stage 5 "  '
        '[80 layers / PP 8 = 10 per rank, 5 per virtual stage: 2 chunks a rank; micro-batch 2]',
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_SC21_FIRST_COMMIT + "/examples/sc21/run_table_1.sh"),
    "megatron_sc21_run_table_1_310b": Source(
        "NVIDIA/Megatron-LM", f"examples/sc21/run_table_1.sh at {MEGATRON_SC21_FIRST_COMMIT} (2021-08-10)",
        'elif [ ${MODEL_SIZE} == "310B" ]; then TP=8 PP=16 MBS=1 GBS=2160 NLS=96 HS=16384 NAH=128 DDP=local '
        'NNODES=240 MEGATRON_EXTRA_PARAMS="--checkpoint-activations --num-layers-per-virtual-pipeline-stage 3 "  '
        '[96 / 16 = 6 per rank, 3 per virtual stage: 2 chunks a rank; micro-batch 1]',
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_SC21_FIRST_COMMIT + "/examples/sc21/run_table_1.sh"),
    "megatron_sc21_run_table_1_530b": Source(
        "NVIDIA/Megatron-LM", f"examples/sc21/run_table_1.sh at {MEGATRON_SC21_FIRST_COMMIT} (2021-08-10)",
        'elif [ ${MODEL_SIZE} == "530B" ]; then TP=8 PP=35 MBS=1 GBS=2520 NLS=105 HS=20480 NAH=128 DDP=local '
        'NNODES=315 MEGATRON_EXTRA_PARAMS="--checkpoint-activations --num-layers-per-virtual-pipeline-stage 1 "  '
        '[105 / 35 = 3 per rank, 1 per virtual stage: 3 chunks a rank; micro-batch 1]',
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_SC21_FIRST_COMMIT + "/examples/sc21/run_table_1.sh"),
    "megatron_sc21_run_table_1_1t": Source(
        "NVIDIA/Megatron-LM", f"examples/sc21/run_table_1.sh at {MEGATRON_SC21_FIRST_COMMIT} (2021-08-10)",
        'elif [ ${MODEL_SIZE} == "1T" ]; then TP=8 PP=64 MBS=1 GBS=3072 NLS=128 HS=25600 NAH=160 DDP=local '
        'NNODES=384 MEGATRON_EXTRA_PARAMS="--checkpoint-activations "  '
        '[no --num-layers-per-virtual-pipeline-stage: the non-interleaved schedule, 2 layers a rank; micro-batch 1]',
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_SC21_FIRST_COMMIT + "/examples/sc21/run_table_1.sh"),
    "megatron_sc21_run_table_1_2022": Source(
        "NVIDIA/Megatron-LM", f"examples/sc21/run_table_1.sh at {MEGATRON_SC21_2022_COMMIT} (2022-07-24)",
        'elif [ ${MODEL_SIZE} == "145B" ]; then TP=8 PP=8 MBS=2 GBS=2304 NLS=80 ... MEGATRON_EXTRA_PARAMS='
        '"--recompute-method uniform --num-layers-per-virtual-pipeline-stage 5 " ... [same MBS and virtual-stage '
        'values for every row as the 2021 file; only --checkpoint-activations became --recompute-method uniform]',
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_SC21_2022_COMMIT + "/examples/sc21/run_table_1.sh"),
    # ------------------------------------------------------------------------------------------------------
    # 3. Korthikanti et al. 2022: only the Megatron-LM README table (NVIDIA's own repository) was read
    # ------------------------------------------------------------------------------------------------------
    "korthikanti_megatron_readme_mfu_hfu": Source(
        "NVIDIA/Megatron-LM README (points to Korthikanti et al. 2022, arXiv:2205.05198)",
        f"README.md at {MEGATRON_MFU_README_COMMIT} (2022-05-19)",
        "The following table shows both model (MFU) and hardware (HFU) FLOPs utilization for select configurations up "
        "to 1T parameters (see our paper for a description of how these are calculated). As the model size "
        "increases, we achieve better GPU utilization and for the one trillion parameter model, we reach a MFU and "
        "HFU of 56.3% and 57.0%, respectively. Note that these numbers are also measured on benchmark runs and in "
        "this case are measured using a data parallel size of one. ...\n"
        "| Model Size | Model FLOPs Utilization | Hardware FLOPs Utilization |\n"
        "| 22B | 41.5% | 43.7% |\n| 175B | 51.4% | 52.8% |\n| 530B | 56.0% | 57.0% |\n| 1T | 56.3% | 57.0% |",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_MFU_README_COMMIT + "/README.md"),
    # ------------------------------------------------------------------------------------------------------
    # 5. Megatron-LM README: H100 weak and strong scaling
    # ------------------------------------------------------------------------------------------------------
    "megatron_readme_h100_text": Source(
        "NVIDIA/Megatron-LM README", f"README.md, Performance Benchmarking, at {MEGATRON_HEAD}",
        "The codebase efficiently trains models from 2B to 462B parameters across thousands of GPUs, achieving up to "
        "**47% Model FLOP Utilization (MFU)** on H100 clusters. ... Benchmark Configuration: - Vocabulary size: "
        "131,072 tokens - Sequence length: 4,096 tokens ... - Communication optimizations: Fine-grained overlapping "
        "with DP (`--overlap-grad-reduce`, `--overlap-param-gather`), TP (`--tp-comm-overlap`), and PP (enabled by "
        "default) ... - 6,144 H100 GPUs: Successfully benchmarked 462B parameter model training. - Superlinear "
        "scaling: MFU increases from 41% to 47–48% with model size. ... Our weak scaled results show superlinear "
        "scaling (MFU increases from 41% for the smallest model considered to 47-48% for the largest models); this is "
        "because larger GEMMs have higher arithmetic intensity and are consequently more efficient to execute.",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_HEAD + "/README.md"),
    "megatron_readme_h100_strong_scaling": Source(
        "NVIDIA/Megatron-LM README",
        f"README.md, Strong Scaling Results, at {MEGATRON_HEAD}; figure images/strong_scaling.png",
        "This test strong scales the standard GPT-3 model (slightly more than 175 billion parameters due to larger "
        "vocabulary size) from 96 H100 GPUs to 4,608 GPUs, using the same batch size of 1,152 sequences throughout. "
        "Communication becomes more exposed at larger scale, leading to a reduction in MFU from 47% to 42%.  "
        "[the per-GPU-count numbers are only in images/strong_scaling.png: a log-log plot of aggregate petaFLOP/s "
        "against GPUs, every point labelled 177B, legend 'Megatron-Core r0.8.0' and 'Perfect linear scaling'; no "
        "per-point MFU is printed]",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_HEAD + "/images/strong_scaling.png"),
    "megatron_readme_h100_weak_scaling_table": Source(
        "NVIDIA/Megatron-LM README", f"images/model_table.png at {MEGATRON_HEAD} (an image; transcribed by eye)",
        "Model size | Attention heads | Hidden size | Number of layers | Tensor MP size | Pipeline MP size | "
        "Data-parallel size | Number of GPUs | Batch size | Per-GPU teraFLOP/s | MFU | Aggregate petaFLOP/s\n"
        "1.7B | 16 | 2048 | 24 | 1 | 1 | 48 | 48 | 192 | 408.8 | 41% | 19.6\n"
        "7.1B | 32 | 4096 | 30 | 2 | 1 | 48 | 96 | 192 | 465.9 | 47% | 44.7\n"
        "16B | 48 | 6144 | 32 | 4 | 1 | 48 | 192 | 192 | 489.1 | 49% | 93.9\n"
        "32B | 56 | 7168 | 48 | 8 | 1 | 48 | 384 | 192 | 459.6 | 46% | 176.5\n"
        "70B | 64 | 8192 | 84 | 8 | 2 | 48 | 768 | 384 | 419.7 | 42% | 322.3\n"
        "119B | 80 | 10240 | 92 | 8 | 4 | 48 | 1536 | 768 | 420.5 | 43% | 645.9\n"
        "177B | 96 | 12288 | 96 | 8 | 6 | 48 | 2304 | 1152 | 432.8 | 44% | 997.2\n"
        "314B | 128 | 16384 | 96 | 8 | 8 | 48 | 3072 | 1536 | 474.4 | 48% | 1457.4\n"
        "462B | 144 | 18432 | 112 | 8 | 16 | 48 | 6144 | 3072 | 459.9 | 47% | 2825.6",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_HEAD + "/images/model_table.png"),
    # ------------------------------------------------------------------------------------------------------
    # 6. torchtitan
    # ------------------------------------------------------------------------------------------------------
    "torchtitan_llama31_8b_h100_8gpu": Source(
        "pytorch/torchtitan", f"benchmarks/llama3_h100_202412_torchtitan.md at {TORCHTITAN_BENCH_COMMIT}, Table 1",
        "**Table 1** 1D Parallelism (FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. "
        "Selective activation checkpointing.\n| Techniques | TPS/GPU | Memory(GiB) |\n| FSDP | 5,762 | 82.4 |\n"
        "| FSDP + torch.compile | 6,667 | 77.0 |\n| FSDP + torch.compile + Float8 | 8,532 | 76.8 |",
        TORCHTITAN_BENCH_URL),
    "torchtitan_llama31_8b_h100_128gpu": Source(
        "pytorch/torchtitan", f"benchmarks/llama3_h100_202412_torchtitan.md at {TORCHTITAN_BENCH_COMMIT}, Table 3",
        "**Table 3** 1D Parallelism (FSDP). Llama 3.1 8B model. 128 GPUs. Local batch size 2, global batch size 256. "
        "Selective activation checkpointing.\n| Techniques | TPS/GPU | Memory(GiB) |\n| FSDP | 5,605 | 67.0 |\n"
        "| FSDP + torch.compile | 6,514 | 62.0 |\n| FSDP + torch.compile + Float8 | 8,380 | 61.8 |  "
        "[the sequence length of Tables 1 and 3 is not stated in the file]",
        TORCHTITAN_BENCH_URL),
    "torchtitan_h100_hardware_and_mfu": Source(
        "pytorch/torchtitan", f"benchmarks/llama3_h100_202412_torchtitan.md at {TORCHTITAN_BENCH_COMMIT}",
        "- Each H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak memory bandwidth. - Hosts are "
        "inter-connected with backend RDMA network with 400 Gb/s per GPU. - We used the default 500W power limit ... "
        "We note that the 1D Llama 3.1 8B model training on 8 or 128 H100 GPUs without Float8 achieves 33% to 39% "
        "MFU[^2] (with or without torch.compile, respectively). ... [^2]: In our test we used HBM2e-based SXM H100 "
        "with lower TDP, the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value. So "
        "this MFU number is lower than actual MFU because we use the peak number of SXM directly.",
        TORCHTITAN_BENCH_URL),
    "torchtitan_llama3_8b_toml": Source(
        "pytorch/torchtitan", f"train_configs/llama3_8b.toml at {TORCHTITAN_BENCH_RUN_COMMIT}",
        '[model]\nname = "llama3"\nflavor = "8B"\n... [training]\nbatch_size = 1\nseq_len = 8192  '
        "[the 8B training config at the torchtitan commit the H100 benchmark's 'Versions and Dates' table names "
        "(9dec370, 2024/12/26); the benchmark file does not state its sequence length]",
        f"https://github.com/pytorch/torchtitan/blob/{TORCHTITAN_BENCH_RUN_COMMIT}/train_configs/llama3_8b.toml"),
    "torchtitan_bf16_weights_and_compile_order": Source(
        "pytorch/torchtitan", f"torchtitan/config_manager.py and torchtitan/parallelisms/parallelize_llama.py at "
        f"{TORCHTITAN_BENCH_RUN_COMMIT}",
        '"--training.mixed_precision_param", type=str, default="bfloat16", ... torch dtype to use for parameters when '
        "applying mixed precision via FSDP. ... # turn on per-TransformerBlock compile after AC wrapping and before "
        "FSDP ... Apply torch.compile to each TransformerBlock, which makes compilation efficient due to repeated "
        "structure.",
        f"https://github.com/pytorch/torchtitan/blob/{TORCHTITAN_BENCH_RUN_COMMIT}/torchtitan/config_manager.py"),
    "torchtitan_llama3_a100": Source(
        "pytorch/torchtitan", f"docs/performance.md at {TORCHTITAN_PERF_DOC_COMMIT}",
        "Below are the WPS (word per second, or more accurately, token per second) and MFU (model FLOPS utilization) "
        "results which torchtitan achieves on Llama 3 models with FSDP2 on 64 A100 (80GB) GPUs. ...\n"
        "| Model size | Batch size | Activation checkpoiting | WPS | MFU |\n"
        "| 8B | 1 | selective layer | 2904 | 56.8% |\n"
        "| 8B | 1 | selective op | 2973 | 58.2% |\n| 70B | 1 | full | 331 | 51.7% |",
        "https://github.com/pytorch/torchtitan/blob/" + TORCHTITAN_PERF_DOC_COMMIT + "/docs/performance.md"),
    # ------------------------------------------------------------------------------------------------------
    # 7. DeepSeek-V3 (arXiv:2412.19437) and its repository
    # ------------------------------------------------------------------------------------------------------
    "deepseek_v3_abstract": Source(
        DSV3, "Abstract",
        "We present DeepSeek-V3, a strong Mixture-of-Experts (MoE) language model with 671B total parameters with 37B "
        "activated for each token. ... Despite its excellent performance, DeepSeek-V3 requires only 2.788M H800 GPU "
        "hours for its full training.",
        DSV3_URL),
    "deepseek_v3_training_costs_table1": Source(
        DSV3, "Table 1 (section 1)",
        "Training Costs | Pre-Training | Context Extension | Post-Training | Total\n"
        "in H800 GPU Hours | 2664K | 119K | 5K | 2788K\nin USD | $5.328M | $0.238M | $0.01M | $5.576M\n"
        "Table 1 | Training costs of DeepSeek-V3, assuming the rental price of H800 is $2 per GPU hour.",
        DSV3_URL),
    "deepseek_v3_180k_gpu_hours_per_trillion": Source(
        DSV3, "section 1 (also repeated in section 4.4.2)",
        "During the pre-training stage, training DeepSeek-V3 on each trillion tokens requires only 180K H800 GPU "
        "hours, i.e., 3.7 days on our cluster with 2048 H800 GPUs.",
        DSV3_URL),
    "deepseek_v3_cluster": Source(
        DSV3, "section 3.1",
        "DeepSeek-V3 is trained on a cluster equipped with 2048 NVIDIA H800 GPUs. Each node in the H800 cluster "
        "contains 8 GPUs connected by NVLink and NVSwitch within nodes. Across different nodes, InfiniBand (IB) "
        "interconnects are utilized to facilitate communications.",
        DSV3_URL),
    "deepseek_v3_parallel_layout": Source(
        DSV3, "section 3.2",
        "On the whole, DeepSeek-V3 applies 16-way Pipeline Parallelism (PP) (Qi et al., 2023a), 64-way Expert "
        "Parallelism (EP) (Lepikhin et al., 2021) spanning 8 nodes, and ZeRO-1 Data Parallelism (DP) (Rajbhandari et "
        "al., 2020). ... Finally, we meticulously optimize the memory footprint during training, thereby enabling us "
        "to train DeepSeek-V3 without using costly Tensor Parallelism (TP).",
        DSV3_URL),
    "deepseek_v3_comp_comm_ratio": Source(
        DSV3, "section 3.2.1",
        "For DeepSeek-V3, the communication overhead introduced by cross-node expert parallelism results in an "
        "inefficient computation-to-communication ratio of approximately 1:1. To tackle this challenge, we design an "
        "innovative pipeline parallelism algorithm called DualPipe ... In this overlapping strategy, we can ensure "
        "that both all-to-all and PP communication can be fully hidden during execution.",
        DSV3_URL),
    "deepseek_v3_dualpipe_table2": Source(
        DSV3, "Table 2 (section 3.2.1)",
        "Method | Bubble | Parameter | Activation\n1F1B | (PP - 1)(F + B) | 1× | PP\n"
        "ZB1P | (PP - 1)(F + B - 2W) | 1× "
        "| PP\nDualPipe (Ours) | (PP/2 - 1)(F&B + B - 3W) | 2× | PP + 1",
        DSV3_URL),
    "deepseek_v3_links_and_node_limit": Source(
        DSV3, "section 3.2.2",
        "To be specific, in our cluster, cross-node GPUs are fully interconnected with IB, and intra-node "
        "communications are handled via NVLink. NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB "
        "(50 GB/s). To effectively leverage the different bandwidths of IB and NVLink, we limit each token to be "
        "dispatched to at most 4 nodes, thereby reducing IB traffic. For each token, when its routing decision is "
        "made, it will first be transmitted via IB to the GPUs with the same in-node index on its target nodes. Once "
        "it reaches the target nodes, we will endeavor to ensure that it is instantaneously forwarded via NVLink to "
        "specific GPUs that host their target experts, without being blocked by subsequently arriving tokens. ... "
        "each token can efficiently select an average of 3.2 experts per node without incurring additional overhead "
        "from NVLink. ... Overall, under such a communication strategy, only 20 SMs are sufficient to fully utilize "
        "the bandwidths of IB and NVLink.",
        DSV3_URL),
    "deepseek_v3_recomputation": Source(
        DSV3, "section 3.2.3 and section 3.3.3",
        "Recomputation of RMSNorm and MLA Up-Projection. We recompute all RMSNorm operations and MLA up-projections "
        "during back-propagation, thereby eliminating the need to persistently store their output activations. ... "
        "(2) Inputs of the SwiGLU operator in MoE. To further reduce the memory cost, we cache the inputs of the "
        "SwiGLU operator and recompute its output in the backward pass.",
        DSV3_URL),
    "deepseek_v3_fp8_dispatch_bf16_combine": Source(
        DSV3, "section 3.3.3, Low-Precision Communication",
        "To alleviate this challenge, we quantize the activation before MoE up-projections into FP8 and then apply "
        "dispatch components, which is compatible with FP8 Fprop in MoE up-projections. ... A similar strategy is "
        "applied to the activation gradient before MoE down-projections. For both the forward and backward combine "
        "components, we retain them in BF16 to preserve training precision in critical parts of the training "
        "pipeline.",
        DSV3_URL),
    "deepseek_v3_model_hparams": Source(
        DSV3, "section 4.2, Model Hyper-Parameters",
        "We set the number of Transformer layers to 61 and the hidden dimension to 7168. ... In MLA, we set the "
        "number of attention heads n_h to 128 and the per-head dimension d_h to 128. The KV compression dimension "
        "d_c is set to 512, and the query compression dimension d'_c is set to 1536. For the decoupled queries and "
        "key, we set the per-head dimension d^R_h to 64. We substitute all FFNs except for the first three layers "
        "with MoE layers. Each MoE layer consists of 1 shared expert and 256 routed experts, where the intermediate "
        "hidden dimension of each expert is 2048. Among the routed experts, 8 experts will be activated for each "
        "token, and each token will be ensured to be sent to at most 4 nodes. The multi-token prediction depth D is "
        "set to 1 ... Under this configuration, DeepSeek-V3 comprises 671B total parameters, of which 37B are "
        "activated for each token.",
        DSV3_URL),
    "deepseek_v3_mla_qk_head_dim": Source(
        DSV3, "section 2.1.1, equations (4), (9), (10)",
        r"k_{t,i} = [k^C_{t,i}; k^R_t], (4) ... q_{t,i} = [q^C_{t,i}; q^R_{t,i}], (9) ... o_{t,i} = \sum_j "
        r"Softmax_j( q^T_{t,i} k_{j,i} / \sqrt{d_h + d^R_h} ) v^C_{j,i}, (10)  [so a query/key head is d_h + d^R_h "
        r"= 128 + 64 = 192 wide and a value head d_h = 128, with section 4.2's values]",
        DSV3_URL),
    "deepseek_v3_train_hparams": Source(
        DSV3, "section 4.2, Training Hyper-Parameters",
        "We set the maximum sequence length to 4K during pre-training, and pre-train DeepSeek-V3 on 14.8T tokens. ... "
        "We employ a batch size scheduling strategy, where the batch size is gradually increased from 3072 to 15360 "
        "in the training of the first 469B tokens, and then keeps 15360 in the remaining training. We leverage "
        "pipeline parallelism to deploy different layers of a model on different GPUs, and for each layer, the "
        "routed experts will be uniformly deployed on 64 GPUs belonging to 8 nodes. As for the node-limited routing, "
        "each token will be sent to at most 4 nodes (i.e., M = 4). For auxiliary-loss-free load balancing, we set "
        "the bias update speed γ to 0.001 for the first 14.3T tokens, and to 0.0 for the remaining 500B tokens. For "
        "the balance loss, we set α to 0.0001, just to avoid extreme imbalance within any single sequence. The MTP "
        "loss weight λ is set to 0.3 for the first 10T tokens, and to 0.1 for the remaining 4.8T tokens.",
        DSV3_URL),
    "deepseek_v3_gating_and_bias": Source(
        DSV3, "section 2.1.2",
        "Slightly different from DeepSeek-V2, DeepSeek-V3 uses the sigmoid function to compute the affinity scores, "
        "and applies a normalization among all selected affinity scores to produce the gating values. ... Note that "
        "the bias term is only used for routing. ... At the end of each step, we will decrease the bias term by γ if "
        "its corresponding expert is overloaded, and increase it by γ if its corresponding expert is underloaded, "
        "where γ is a hyper-parameter called bias update speed.",
        DSV3_URL),
    "deepseek_v3_seq_wise_loss": Source(
        DSV3, "section 2.1.2, equations (17)-(20)",
        "Complementary Sequence-Wise Auxiliary Loss. ... L_Bal = α Σ_{i=1}^{N_r} f_i P_i, (17) f_i = N_r/(K_r T) "
        "Σ_{t=1}^{T} 1(s_{i,t} ∈ Topk({s_{j,t}|1 ⩽ j ⩽ N_r}, K_r)), (18) ... where the balance factor α is a "
        "hyper-parameter, which will be assigned an extremely small value for DeepSeek-V3",
        DSV3_URL),
    "deepseek_v3_node_limited_routing": Source(
        DSV3, "section 2.1.2, Node-Limited Routing",
        "In short, we ensure that each token will be sent to at most M nodes, which are selected according to the "
        "sum of the highest K_r/M affinity scores of the experts distributed on each node. Under this constraint, our "
        "MoE training framework can nearly achieve full computation-communication overlap. ... DeepSeek-V3 does not "
        "drop any tokens during training.",
        DSV3_URL),
    "deepseek_v3_config_671b": Source(
        "deepseek-ai/DeepSeek-V3 (GitHub)",
        f"inference/configs/config_671B.json at {DSV3_REPO_HEAD} (last changed in {DSV3_CONFIG_COMMIT})",
        '{ "vocab_size": 129280, "dim": 7168, "inter_dim": 18432, "moe_inter_dim": 2048, "n_layers": 61, '
        '"n_dense_layers": 3, "n_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, '
        '"n_activated_experts": 8, "n_expert_groups": 8, "n_limited_groups": 4, "route_scale": 2.5, '
        '"score_func": "sigmoid", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, '
        '"qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "fp8" }  [this is the GitHub inference config; the HF '
        'config.json field names (routed_scaling_factor, n_group, topk_group) were not read here]',
        "https://github.com/deepseek-ai/DeepSeek-V3/blob/" + DSV3_REPO_HEAD + "/inference/configs/config_671B.json"),
    "deepseek_v3_readme_mtp_14b": Source(
        "deepseek-ai/DeepSeek-V3 (GitHub)", f"README.md at {DSV3_REPO_HEAD}",
        "The total size of DeepSeek-V3 models on Hugging Face is 685B, which includes 671B of the Main Model weights "
        "and 14B of the Multi-Token Prediction (MTP) Module weights.",
        "https://github.com/deepseek-ai/DeepSeek-V3/blob/" + DSV3_REPO_HEAD + "/README.md"),
    # ------------------------------------------------------------------------------------------------------
    # 8. Mixtral
    # ------------------------------------------------------------------------------------------------------
    "mixtral_8x7b_table1": Source(
        MIXTRAL, "Table 1 (section 2)",
        "| Parameter | Value |\n| dim | 4096 |\n| n_layers | 32 |\n| head_dim | 128 |\n| hidden_dim | 14336 |\n"
        "| n_heads | 32 |\n| n_kv_heads | 8 |\n| context_len | 32768 |\n| vocab_size | 32000 |\n| num_experts | 8 |\n"
        "| top_k_experts | 2 |\nTable 1: Model architecture.",
        MIXTRAL_URL),
    "mixtral_8x7b_47b_13b": Source(
        MIXTRAL, "Abstract; section 3, Size and Efficiency",
        "As a result, each token has access to 47B parameters, but only uses 13B active parameters during inference. "
        "... [section 3:] As a sparse Mixture-of-Experts model, Mixtral only uses 13B active parameters for each "
        "token. ... The memory costs for serving Mixtral are proportional to its sparse parameter count, 47B, which "
        "is still smaller than Llama 2 70B.",
        MIXTRAL_URL),
    "mixtral_8x7b_hf_config": Source(
        "mistralai/Mixtral-8x7B-Instruct-v0.1 (Hugging Face)",
        "config.json at eba92302a2861cdc0098cc54bc9f17cb2c47eb61",
        '"hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral", '
        '"num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, '
        '"num_local_experts": 8, ... "router_aux_loss_coef": 0.02, ... "vocab_size": 32000',
        "https://huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1/blob/"
        "eba92302a2861cdc0098cc54bc9f17cb2c47eb61/config.json"),
    "megatron_moe_readme_468_tflops": Source(
        "NVIDIA/Megatron-LM", f"megatron/core/transformer/moe/README.md at {MEGATRON_MOE_README_COMMIT} (line 3)",
        "Megatron-Core MoE provides comprehensive parallelism strategies, seamlessly integrating Expert Parallelism "
        "with tensor, data, sequence, and pipeline parallelism. With MCore v0.9, we've achieved remarkable "
        "performance of **468 TFLOPS** for Mixtral 8X7B bf16 training.  [the sentence states no GPU, layout or "
        "sequence length; the same README's reference mapping, below, is for MCore v0.8 on 8xH100 servers]",
        MEGATRON_MOE_README_URL),
    "megatron_moe_readme_mixtral_mapping": Source(
        "NVIDIA/Megatron-LM", f"megatron/core/transformer/moe/README.md at {MEGATRON_MOE_README_COMMIT}, "
                              "Reference Best Parallel Mapping",
        "Here are the reference parallel mappings of MCore v0.8 for Mixtral 8x7B and 8x22B models:\n"
        "| Model | Vocab Size| Dispatcher | Precision | #GPUs | SEQ LEN | TP | EP | PP | VP | MBS | GBS |\n"
        "| Mixtral 8x7B(Dropless) | 32K | All-to-All | BF16 | 64 | 4096 | 1 | 8 | 4 | 8 | 1 | 256 |\n"
        "| Mixtral 8x22B(Dropless) | 32K | All-to-All | BF16 | 128 | 4096 | 4 | 2 | 8 | 7 | 1 | 256 |\n"
        "Detailed Benchmark Information: Server: - 8xH100 80GB HBM3 - NVLink 4th Generation - InfiniBand 8x400 Gbit/s",
        MEGATRON_MOE_README_URL),
    "mixtral_8x22b_config_community": Source(
        "mistral-community/Mixtral-8x22B-v0.1 (Hugging Face; the community conversion, not mistralai's repo)",
        "config.json at 42a1ba7 (refs/pr/19 view)",
        '"hidden_size": 6144, "intermediate_size": 16384, "max_position_embeddings": 65536, "model_type": "mixtral", '
        '"num_attention_heads": 48, "num_experts_per_tok": 2, "num_hidden_layers": 56, "num_key_value_heads": 8, '
        '"num_local_experts": 8, ... "vocab_size": 32000',
        "https://huggingface.co/mistral-community/Mixtral-8x22B-v0.1/blob/refs%2Fpr%2F19/config.json"),
    # ------------------------------------------------------------------------------------------------------
    # 9. GPU and network figures read in a primary source
    # ------------------------------------------------------------------------------------------------------
    "a100_bf16_peak_312": Source(
        MEGATRON_SC21 + " (NVIDIA authors)", "section 5 (evaluation setup)",
        "The peak device throughput of an A100 GPU with 16-bit precision is 312 teraFLOP/s.",
        MEGATRON_SC21_URL),
    "dgx_h100_8x400_ib": Source(
        "NVIDIA/Megatron-LM", f"megatron/core/transformer/moe/README.md at {MEGATRON_MOE_README_COMMIT}",
        "Server: - 8xH100 80GB HBM3 - NVLink 4th Generation - InfiniBand 8x400 Gbit/s",
        MEGATRON_MOE_README_URL),
    "dgx_a100_8x200_hdr": Source(
        MEGATRON_SC21, "section 5 (evaluation setup)",
        "Each node has eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs for application communication, with an "
        "additional two HCAs per node for dedicated storage.",
        MEGATRON_SC21_URL),
    "h800_links_deepseek": Source(
        DSV3, "section 3.2.2", "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s).",
        DSV3_URL),
    # ------------------------------------------------------------------------------------------------------
    # 10. Other published numbers the planner states
    # ------------------------------------------------------------------------------------------------------
    "nccl_hwlat_ring_simple": Source(
        "NVIDIA/nccl", f"src/graph/tuning.cc at {NCCL_COMMIT}",
        "static float hwLat [3][NCCL_NUM_ALGORITHMS][NCCL_NUM_PROTOCOLS] = "
        "{ /* NVLINK */ { /* Tree (LL/LL128/Simple)*/ "
        "{ .6, 1.25, 28 }, /* Ring (LL/LL128/Simple)*/ { .6, 1.9, 3.4 }, ... /* NET */ { /* Tree (LL/LL128/Simple)*/ "
        "{ 5.0, 8.5, 28 }, /* Ring (LL/LL128/Simple)*/ { 2.7, 4.0, 14.0 }, ...  [older NCCL (commit "
        "01afd20a77b5804e0ecf1042509dd9d20ebf9e93) had NET Ring Simple 9.6; the tree's Simple 28 here is 4.0 over "
        "NVLink and 14 across nodes at NCCL_HEAD: nccl_hwlat_tree_head]",
        "https://github.com/NVIDIA/nccl/blob/" + NCCL_COMMIT + "/src/graph/tuning.cc"),
    "megatron_core_ddp_bucket_size": Source(
        "NVIDIA/Megatron-LM", f"megatron/core/distributed/distributed_data_parallel_config.py at {MEGATRON_HEAD}",
        "bucket_size: Optional[int] = None \"\"\"Maximum number of parameters in each bucket. "
        "If unspecified, MCore uses "
        "a default value of max(40000000, 1000000 * dp_size) parameters (larger DP sizes need larger buckets to "
        "ensure collectives do not become latency-bound).\"\"\"",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_HEAD
        + "/megatron/core/distributed/distributed_data_parallel_config.py"),
    # what Megatron's own layers save and send (planner.memory.block_activation_bytes, communication.ledger)
    "megatron_column_parallel_saves_input_shard": Source(
        "NVIDIA/Megatron-LM", f"megatron/core/tensor_parallel/layers.py:604 and 667-680 at {MEGATRON_HEAD}",
        "ctx.save_for_backward(input, weight) ... if ctx.sequence_parallel: dim_size = list(input.size()) "
        "dim_size[0] = dim_size[0] * tp_group.size() ... handle = dist_all_gather_func( all_gather_buffer, input, "
        "group=tp_group, async_op=True )",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_HEAD + "/megatron/core/tensor_parallel/layers.py"),
    "megatron_fused_swiglu_saves_its_input": Source(
        "NVIDIA/Megatron-LM", f"megatron/core/fusions/fused_bias_swiglu.py:221-235 (SwiGLUFunction) at {MEGATRON_HEAD}",
        "def forward(ctx, input, fp8_input_store, cpu_offload_input, clamp_value): ... input_for_backward = "
        "input.to(torch.float8_e4m3fn) if fp8_input_store else input ... ctx.save_for_backward(input_for_backward)",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_HEAD + "/megatron/core/fusions/fused_bias_swiglu.py"),
    "megatron_fp32_gradients_for_bf16": Source(
        "NVIDIA/Megatron-LM", f"megatron/training/arguments.py:1213-1217 at {MEGATRON_HEAD}",
        "elif not args.accumulate_allreduce_grads_in_fp32 and args.main_grads_dtype == torch.float32: "
        "args.accumulate_allreduce_grads_in_fp32 = True print_rank_0('accumulate and all-reduce gradients in fp32 "
        "for bfloat16 data type.')",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_HEAD + "/megatron/training/arguments.py"),
    "megatron_scatter_gather_on_by_default": Source(
        "NVIDIA/Megatron-LM", "commit 72e4230bb5cf7afbc46ca9ddf166fef9b5d7a6d6 (2021-02-16), megatron/arguments.py",
        "Turn scatter-gather optimization on by default ... group.add_argument('--no-scatter-gather-tensors-in-"
        "pipeline', action='store_false', help='Use scatter/gather to optimize communication of tensors in pipeline', "
        "dest='scatter_gather_tensors_in_pipeline')",
        "https://github.com/NVIDIA/Megatron-LM/commit/72e4230bb5cf7afbc46ca9ddf166fef9b5d7a6d6"),
    "megatron_core_pp_sends_split_only_under_sp": Source(
        "NVIDIA/Megatron-LM", f"megatron/core/pipeline_parallel/schedules.py:1184-1187 at {MEGATRON_HEAD}",
        "tensor_shape = [seq_length, micro_batch_size, config.hidden_size] tensor_shape[0] = tensor_shape[0] // "
        "cp_group.size() if config.sequence_parallel: tensor_shape[0] = tensor_shape[0] // tp_group.size()",
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_HEAD + "/megatron/core/pipeline_parallel/schedules.py"),
    # NCCL's latency model (distlab.comm.ring_latency, tree_all_reduce_latency)
    "nccl_ring_latency_split": Source(
        "NVIDIA/nccl", f"src/graph/tuning.cc:411-412 at {NCCL_HEAD}",
        "int nInterSteps = nNodes == 1 ? 0 : coll == ncclFuncAllReduce ? 2 * (nNodes - 1) : nNodes - 1; "
        "comm->latencies[coll][a][p] += (nsteps - nInterSteps) * intraLat + nInterSteps * interLat;",
        "https://github.com/NVIDIA/nccl/blob/" + NCCL_HEAD + "/src/graph/tuning.cc"),
    "nccl_ring_plateau": Source(
        "NVIDIA/nccl", f"src/graph/tuning.cc:647-649 at {NCCL_HEAD}",
        "if (algorithm == NCCL_ALGO_RING && protocol == NCCL_PROTO_SIMPLE && comm->nNodes > 1 && coll == "
        "ncclFuncAllReduce && nBytes / (comm->nChannels * comm->nRanks) >= 64) { lat *= comm->minCompCap < 80 ? 1.9 "
        ": 1.4; // Plateau effect of ring",
        "https://github.com/NVIDIA/nccl/blob/" + NCCL_HEAD + "/src/graph/tuning.cc"),
    "nccl_hwlat_tree_head": Source(
        "NVIDIA/nccl", f"src/graph/tuning.cc:156-171 at {NCCL_HEAD}",
        "// hwLatencies { /* NVLINK */ { { 0.6, 1.25, 4.0 }, { 0.6, 1.9, 3.4 }, /* Tree (LL/LL128/Simple), Ring "
        "(LL/LL128/Simple)*/ ... /* NET */ { { 5.0, 8.5, 14 }, { 2.7, 4.0, 14.0 }, /* Tree (LL/LL128/Simple), Ring "
        "(LL/LL128/Simple)*/",
        "https://github.com/NVIDIA/nccl/blob/" + NCCL_HEAD + "/src/graph/tuning.cc"),
    "nccl_tree_all_reduce": Source(
        "NVIDIA/nccl", f"src/graph/tuning.cc:331, 379-380 and 414-416 at {NCCL_HEAD}",
        "if (a == NCCL_ALGO_TREE && coll == ncclFuncAllReduce) busBw = std::min(busBw * .92, graphs[a]->nChannels * "
        "perChMaxTreeBw); ... if (a == NCCL_ALGO_RING || a == NCCL_ALGO_NVLS || a == NCCL_ALGO_NVLS_TREE) ratio *= "
        "(1.0 * nRanks) / nsteps; else ratio *= .5; ... } else if (a == NCCL_ALGO_TREE) { if (coll == "
        "ncclFuncAllReduce) { comm->latencies[coll][a][p] += 2 * ((nRanks / nNodes - 1) * intraLat + log2i(nNodes) "
        "* interLat);",
        "https://github.com/NVIDIA/nccl/blob/" + NCCL_HEAD + "/src/graph/tuning.cc"),
    "korthikanti_530b_abstract": Source(
        "Korthikanti et al. (2022), Reducing Activation Recomputation in Large Transformer Models, arXiv:2205.05198",
        "abstract (as Hugging Face's paper page prints it)",
        "For example, when training a 530B parameter GPT-3 style model on 2240 NVIDIA A100 GPUs, we achieve a Model "
        "Flops Utilization of 54.2%, which is 29% faster than the 42.1% we achieve using recomputation.",
        "https://huggingface.co/papers/2205.05198"),
    "deepspeed_zero2_reduces_every_micro_step": Source(
        "deepspeedai/DeepSpeed", f"deepspeed/runtime/zero/stage_1_and_2.py:1767-1768 at {DEEPSPEED_HEAD}",
        "def reduce_ready_partitions_and_remove_grads(self, param, i): if self.partition_gradients or "
        "self.is_gradient_accumulation_boundary() or self.zenflow:",
        "https://github.com/deepspeedai/DeepSpeed/blob/" + DEEPSPEED_HEAD + "/deepspeed/runtime/zero/stage_1_and_2.py"),
    # ------------------------------------------------------------------------------------------------------
    # GEMM speed by shape (planner.gemm) and Table 1's settings for every row
    # ------------------------------------------------------------------------------------------------------
    "mamf_a100_h100": Source(
        "S. Bekman, Machine Learning Engineering Open Book (stas00/ml-engineering): his measurements with "
        "mamf-finder.py",
        "compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS comparison table', BF16 (the v2 table)",
        "The following measurements are for `matmul` with BF16 and FP8 inputs (no sparsity) TFLOPS ... Using a mean "
        "of 100 iterations after 50 warmup iterations for each shape. ... | Accelerator | MAMF | Theory | Efficiency "
        "| Best Shape MxNxK | torch ver | ... | NVIDIA A100 SXM | 271.2 | 312 | 86.9% | 1024x10240x5120 | "
        "2.6.0+cu126 | ... | NVIDIA H100 SXM | 794.5 | 989 | 80.3% | 2048x2048x13312 | 2.7.0+cu126 |",
        "https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md"),
    "xla_h100_matmul_table": Source(
        "OpenXLA (in tensorflow/tensorflow), its default matmul performance table for the GPU cost model",
        f"third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h at {XLA_MATMUL_TABLE_COMMIT}",
        'constexpr char kDefaultMatmulPTable[] = R"pb( entries { key: "sm_90" value { ... entries { b: 1 m: 256 '
        'n: 256 k: 256 flops { key: "bf16xbf16->bf16" value: 6452775384615 } ... entries { b: 1 m: 1024 n: 1024 '
        'k: 1024 flops { key: "bf16xbf16->bf16" value: 236298816901408 } ... entries { b: 1 m: 4096 n: 4096 '
        'k: 4096 flops { key: "bf16xbf16->bf16" value: 783328793548203 } ... b: 1 m: 1024 n: 2048 k: 256 flops { key: '
        '"bf16xbf16->bf16" value: 139519467775467 } ... b: 1 m: 4096 n: 512 k: 512 flops { key: "bf16xbf16->bf16" '
        'value: 238821580071174 } ... b: 1 m: 256 n: 2048 k: 4096 flops { key: "bf16xbf16->bf16" value: '
        '285873755058572 } ... b: 1 m: 4096 n: 1024 k: 512 flops { key: "bf16xbf16->bf16" value: 343707370038412 } '
        '... b: 1 m: 2048 n: 2048 k: 2048 flops { key: "bf16xbf16->bf16" value: 631984593290170 } ... b: 1 m: 4096 '
        'n: 4096 k: 256 flops { key: "bf16xbf16->bf16" value: 392162828341855 } ... b: 1 m: 2048 n: 512 k: 2048 '
        'flops { key: "bf16xbf16->bf16" value: 347714321243523 }  [FLOP/s measured on sm_90 (H100); '
        'planner.gemm.XLA_H100_BF16 copies 20 of its b = 1 entries, each as the file prints it]',
        "https://github.com/tensorflow/tensorflow/blob/" + XLA_MATMUL_TABLE_COMMIT
        + "/third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h"),
    "flash_attention_causal_flops": Source(
        "Dao-AILab/flash-attention, its benchmark of FlashAttention-2 against PyTorch's attention",
        "benchmarks/benchmark_flash_attention.py at c082294e0f6c01d46318694a6f3e0274225a9683, def flops",
        'def flops(batch, seqlen, headdim, nheads, causal, mode="fwd"): ... f = 4 * batch * seqlen**2 * nheads * '
        'headdim // (2 if causal else 1)',
        "https://github.com/Dao-AILab/flash-attention/blob/c082294e0f6c01d46318694a6f3e0274225a9683/benchmarks/"
        "benchmark_flash_attention.py"),
    "megatron_sc21_run_table_1_all": Source(
        "NVIDIA/Megatron-LM", f"examples/sc21/run_table_1.sh at {MEGATRON_SC21_2022_COMMIT} (2022-07-24)",
        'if [ ${MODEL_SIZE} == "1.7B" ]; then TP=1 PP=1 MBS=16 GBS=512 NLS=24 HS=2304 NAH=24 DDP=torch ... '
        'elif [ ${MODEL_SIZE} == "3.6B" ]; then TP=2 PP=1 MBS=16 GBS=512 NLS=30 HS=3072 NAH=32 DDP=torch ... '
        'elif [ ${MODEL_SIZE} == "7.5B" ]; then TP=4 PP=1 MBS=16 GBS=512 NLS=36 HS=4096 NAH=32 DDP=torch ... '
        'elif [ ${MODEL_SIZE} == "18B" ]; then TP=8 PP=1 MBS=8 GBS=1024 NLS=40 HS=6144 NAH=48 DDP=torch ... '
        'elif [ ${MODEL_SIZE} == "39B" ]; then TP=8 PP=2 MBS=4 GBS=1536 NLS=48 HS=8192 NAH=64 DDP=local ... '
        'MEGATRON_EXTRA_PARAMS="--recompute-method uniform " elif [ ${MODEL_SIZE} == "76B" ]; then TP=8 PP=4 MBS=2 '
        'GBS=1792 NLS=60 HS=10240 NAH=80 DDP=local NNODES=128 MEGATRON_EXTRA_PARAMS="--recompute-method uniform '
        '--num-layers-per-virtual-pipeline-stage 5"  [the four largest: as megatron_sc21_run_table_1_145b, _310b, '
        '_530b, _1t; 8 GPUs a node]',
        "https://github.com/NVIDIA/Megatron-LM/blob/" + MEGATRON_SC21_2022_COMMIT + "/examples/sc21/run_table_1.sh"),
}

# Figures read only in a third party's copy or quotation of the primary source.
SECONDARY: dict[str, Source] = {
    "a100_hbm_bandwidth": Source(
        "NVIDIA A100 datasheet -- as G. Lockwood's notes give it, citing nvidia-a100-datasheet-us-nvidia-1758950-r4",
        "glennklockwood.com/garden/processors/A100, Specifications",
        "A100 40G SXM4 ... 40 GB HBM2 (5 stacks) ... 1.555 TB/s ... A100 80G SXM4 ... 80 GB HBM2e (5 stacks) ... "
        "2.039 GB/s  [the page's own typo for TB/s]",
        "https://glennklockwood.com/garden/processors/A100"),
    "v100_hbm_bandwidth": Source(
        "NVIDIA's A100 80GB announcement -- as AnandTech's specification table gives it",
        "anandtech.com/show/16250, NVIDIA Accelerator Specification Comparison",
        "A100 (80GB) A100 (40GB) V100 ... Memory Bandwidth 2.0TB/sec 1.6TB/sec 900GB/sec",
        "https://www.anandtech.com/show/16250/nvidia-announces-a100-80gb-ampere-gets-hbm2e-memory-upgrade"),
    "korthikanti_activation_formula": Source(
        "Korthikanti et al. (2022), Reducing Activation Recomputation in Large Transformer Models, arXiv:2205.05198 "
        "-- its equation 1 as AWS's Neuron documentation quotes it",
        "awsdocs-neuron, libraries/neuronx-distributed/activation_memory_reduction (v2.28.1)",
        "The total activation memory without any parallelism comes to about: .. math:: \\text{Activations memory "
        "per layer} = \\text{sbh} \\left(34 + \\frac{5as}{h}\\right)",
        "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/libraries/neuronx-distributed/"
        "activation_memory_reduction.html"),
    "korthikanti_530b_54_2_vs_42_1": Source(
        "Korthikanti et al. (2022), Reducing Activation Recomputation in Large Transformer Models, arXiv:2205.05198 "
        "-- as quoted in a public study note (search-index file id 58839454230; repository not named by the index)",
        "the paper's abstract / end-to-end results, per the note",
        "Concrete example from the paper: 530B GPT-3-style model on 2240 A100s reaches **54.2% MFU** with SP + "
        "selective recompute, vs 42.1% with vanilla TP + full recompute.",
        "https://arxiv.org/abs/2205.05198"),
    "mtnlg_iteration_times": Source(
        "Smith et al. (2022), Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, arXiv:2201.11990 -- as "
        "quoted by cli99/llm-analysis examples/megatron-turing-nlg/README.md (read on a web mirror of GitHub)",
        "paper section 2.4, per llm-analysis",
        "As reported in Section 2.4 of the paper, with global batch size 1920 on 280, 350, and 420 DGX A100 servers "
        "(each has 8 A100-SXM 40GB GPUs), the latency per iteration observed is 60.1, 50.2, and 44.4 seconds "
        "respectively. These correspond to 126, 121, and 113 TFLOP/s per GPU, respectively.  [llm-analysis says "
        "40GB; NVIDIA/Microsoft's announcement, quoted elsewhere, says each DGX A100 has eight 80GB A100s]",
        "https://github.com/cli99/llm-analysis/blob/main/examples/megatron-turing-nlg/README.md"),
    "mtnlg_shape_and_layout": Source(
        "Smith et al. (2022), arXiv:2201.11990 -- as quoted in two public study notes (index ids 69433185650 and "
        "70869466217; repositories not named by the index)",
        "paper section 3 (model configuration) and section 2.2 (3D parallelism), per the notes",
        '"The number of layers, hidden dimensions, attention heads are 105, 20480, and 128, respectively. The '
        'sequence length is 2048 and global batch size is 1920. We used 8-way tensor and 35-way pipeline '
        'parallelism." ... "Each 530 billion parameter model replica spans 280 NVIDIA A100 GPUs, with 8-way '
        'tensor-slicing within a node and 35-way pipeline parallelism across nodes"',
        "https://arxiv.org/abs/2201.11990"),
    "h100_sxm_pcie_spec_table": Source(
        "NVIDIA H100 specification table -- as reproduced by a reseller (HPC Tech, Japan); NVIDIA's own datasheet was "
        "not in the stored corpora",
        "archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html",
        "NVIDIA H100 SXM | NVIDIA H100 PCIe | ... TF32 Tensor コア | 989 TFLOPS* | 756 TFLOPS* | BFLOAT16 Tensor コア | "
        "1,979 TFLOPS* | 1,513 TFLOPS* | FP16 Tensor コア | 1,979 TFLOPS* | 1,513 TFLOPS* | ... GPU メモリ | 80 GB | "
        "80 GB | GPU メモリ帯域幅 | 3,350 GB/sec | 2000 GB/sec | ... TDP | 700 W | 300-350 W | ... 相互接続 | NVLink: "
        "900GB/秒 PCIe Gen5: 128GB/秒 | NVLINK: 600GB/秒 PCIe Gen5: 128GB/秒 | * Shown with sparsity. Specifications "
        "1/2 lower without sparsity.",
        "https://archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html"),
    "a100_datasheet_table": Source(
        "NVIDIA A100 datasheet -- as tabulated by G. Lockwood's notes, citing "
        "nvidia-a100-datasheet-us-nvidia-1758950-r4",
        "glennklockwood.com/garden/processors/A100",
        "A100 80G SXM4 ... 80 GB HBM2e (5 stacks) ... 2.039 GB/s ... Data Type | Vector | Matrix | Sparse | ... "
        "BF16 | 312 | 624 | ... 300+300 GB/s NVLink (D2D)  [the page's 'Matrix' column holds the dense and "
        "'Sparse' the sparse figure; its '2.039 GB/s' is its own typo for TB/s]",
        "https://glennklockwood.com/garden/processors/A100"),
    "dgx1_v100_four_100g_ib": Source(
        "NVIDIA, DGX-1 with Tesla V100 System Architecture (white paper) -- as quoted by leslivresblancs.fr",
        "introduction of the white paper, per the quoting page",
        "DGX-1 features 8 NVIDIA® Tesla® V100 GPU accelerators connect through NVIDIA® NVLinkTM, the NVIDIA "
        "highperformance GPU interconnect, in a hybrid cube-mesh network. Together with dual-socket Intel Xeon CPUs "
        "and four 100 Gb InfiniBand network interface cards, DGX-1 provides unprecedented performance for deep "
        "learning training.",
        "https://leslivresblancs.fr/livre/informatique-et-logiciels/intelligence-artificielle/"
        "nvidia-dgx-1-tesla-v100-system"),
    "mixtral_8x22b_instruct_vocab_32768": Source(
        "mistralai/Mixtral-8x22B-Instruct-v0.1 config -- as copied into derived models' config.json "
        "(_name_or_path: mistralai/Mixtral-8x22B-Instruct-v0.1)",
        "huggingface.co/jsfs11/MixtralxWizardLM2-8x22B-SLERP-v0.2 and sosoai/hansoldeco-Mixtral-8x22B-Instruct-v1",
        '"hidden_size": 6144, "intermediate_size": 16384, ... "num_attention_heads": 48, "num_experts_per_tok": 2, '
        '"num_hidden_layers": 56, "num_key_value_heads": 8, "num_local_experts": 8, ... "vocab_size": 32768',
        "https://huggingface.co/sosoai/hansoldeco-Mixtral-8x22B-Instruct-v1/blame/"
        "ee92e9b8a5c36da5b3639e87d8d8a7d3893e5c93/config.json"),
}

NOT_FOUND: dict[str, str] = {
    "korthikanti_primary_text": (
        "NOT FOUND in the primary text: Korthikanti et al.'s equations (1: sbh (34 + 5as/h); 2: sbh (10 + 24/t + "
        "5as/(ht)) under TP; 6: 34 sbh/t under TP, SP and selective recomputation) and any table of activation GiB "
        "for its 175B, 530B and 1T models (the '10.6 GiB' for 175B an issue cites). Equation 1 was read in AWS's "
        "quotation (SECONDARY['korthikanti_activation_formula']); 2 and 6 in two public codes that implement the paper "
        "(shivam-raval96/idyll-js python/memory/formulas/utils.py, comment '# eq (6)'). Under 1F1B the planner's "
        "175B row would plan 34 sbhL/t = 9.56 GiB for its first stage; interleaved x8, as the row runs, 71/64 of it "
        "(Megatron's warm-up, schedules.py:964-965), 10.61 GiB."),
    "korthikanti_table_configs_and_iteration_times": (
        "NOT FOUND: Korthikanti et al. 2022 Table 3 (model configs, GPUs per row) and the end-to-end iteration times "
        "(full recompute vs present work: 13.75 s for 175B and 1.10 s for 22B under a 'Table 5' label, "
        "and the '175B: TP 8, PP 8, 64 GPUs, batch 64' / '22B: TP 8, PP 1, 8 GPUs, batch 4' rows). Only the MFU/HFU "
        "per size was read (Megatron-LM README, SOURCES['korthikanti_megatron_readme_mfu_hfu'], which says DP = 1). "
        "Searched for again in the pages and docs indexes (arXiv 2205.05198, Table 3, Table 5, the four sizes' "
        "layouts, 13.75 s) and by find_string in the code index: the abstract (Hugging Face's paper page) and a "
        "secondary summary that gives Table 4's per-layer times and Table 5's speed-ups, neither Table 3's layouts "
        "and batches nor an iteration time. So the layouts stay the course's, unverified, and no test converts an "
        "iteration time for these rows."),
    "mtnlg_primary_text": (
        "NOT FOUND in the primary text: MT-NLG's 60.1/50.2/44.4 s per iteration and 126/121/113 TFLOP/s per GPU, and "
        "its shape; only secondary quotations (SECONDARY['mtnlg_*']). MT-NLG's vocabulary size: NOT FOUND."),
    "nvidia_h100_datasheet": (
        "NOT FOUND: NVIDIA's own H100 datasheet/product page (SXM and NVL columns, 'with sparsity' footnote, HBM "
        "bandwidth). A reseller's copy of the SXM/PCIe table was read (SECONDARY['h100_sxm_pcie_spec_table'])."),
    "h100_nvl_dense_bf16": "NOT FOUND: H100 NVL dense BF16 TFLOP/s and HBM bandwidth in any NVIDIA source.",
    "h800_peak": (
        "NOT FOUND: any NVIDIA statement of the H800's BF16 peak (spec.py assumes it equals the H100 SXM's 989 "
        "TFLOP/s); only DeepSeek's measured link speeds (SOURCES['h800_links_deepseek'])."),
    "a100_nvlink_600_primary": (
        "NOT FOUND in an NVIDIA primary source here: A100 NVLink 600 GB/s (read only in secondary copies, e.g. "
        "SECONDARY['a100_datasheet_table'] '300+300 GB/s NVLink')."),
    "h100_nvlink_900_primary": (
        "NOT FOUND in an NVIDIA primary source here: H100 NVLink 900 GB/s (reseller copy only, "
        "SECONDARY['h100_sxm_pcie_spec_table'])."),
    "v100_fp16_125": (
        "NOT FOUND in an NVIDIA primary source: V100 SXM2 125 TFLOP/s tensor (fp16); third-party pages only (the "
        "pre-launch Volta table on several pages says 'Peak Tensor Core TFLOP/s* ... 120')."),
    "deepseek_v3_hf_config_json": (
        "NOT FOUND: deepseek-ai/DeepSeek-V3's Hugging Face config.json (routed_scaling_factor, n_group, topk_group) is "
        "not in the stored corpora; the GitHub inference config (SOURCES['deepseek_v3_config_671b']) gives the same "
        "quantities as route_scale 2.5, n_expert_groups 8, n_limited_groups 4."),
    "mixtral_8x22b_official_config": (
        "NOT FOUND: mistralai/Mixtral-8x22B-v0.1's own config.json or announcement with the shape; the community "
        "conversion (vocab 32000) and Instruct-derived configs (vocab 32768) were read instead."),
    "megatron_h100_strong_scaling_per_point": (
        "NOT FOUND as numbers: the per-GPU-count MFU of Megatron's 96 -> 4,608 H100 strong-scaling run; the README "
        "gives only 'from 47% to 42%' and the figure plots aggregate petaFLOP/s without labels."),
    "gpt3_no_layout_claim": (
        "NOT CHECKED: chapter 11's statement that the GPT-3 paper gives neither a GPU count nor parallel degrees."),
}


# DISAGREEMENTS (file:line -- what it says -- what the source says), as the source search found them before the
# planner's correction. Chapter 11 is cited by its section heading: "then" quotes its words when this was found,
# "now" its words today. Since then (issue 29): 1 fixed (Llama 3 at 8K runs without recomputation, a named miss);
# 2 fixed in part (FSDP kept gathered; the planner's unsharded fp32 gradients under PP said in chapter 11); 3 fixed
# (V = 8 stated as the planner's); 4 fixed (all-gather CP modelled); 5 stated as the planner's assumption; 6 fixed
# (run_table_1.sh's settings); 7 fixed (local DDP, zero 0); 8 said in chapter 11 (not found); 9 fixed (sections 2.4
# and 3); 10 fixed (v100-32gb: four 100 Gb/s NICs for 8 GPUs); 12, 13 fixed (abstract and sections 3 / 4.2); 14 fixed
# ("caches the experts' SwiGLU inputs"); 11, 15 and 16 stand as recorded (a rounding, a community config, a PDF/HTML
# difference).
#
# 1. distlab/planner/published.py:81-84 (LLAMA_PIPELINE) and chapter 11, "The planner against published runs" (the
#    Llama 3 rows; then "..., full ckpt, SP", now "mb 1, interleaved x8, no ckpt, SP" at 8K): the comment said "the
#    paper does not say how it recomputes: the planner's choice", and every Llama 3 row ran full checkpointing.
#    Llama 3 section 3.3.2: "With these optimizations, we could pre-train Llama 3 on sequences of 8K tokens without
#    activation checkpointing." (SOURCES['llama3_no_activation_checkpointing']; for the 128K row the paper says
#    nothing about recomputation.) Chapter 11 now: "It runs no activation checkpointing at 8K tokens".
# 2. distlab/planner/published.py:83 (zero_stage=1) and chapter 11, "The planner against published runs" (the Llama 3
#    rows; then "zero=1", now "tp=8,pp=16,dp=64,zero=3"): Llama 3 shards more than the optimizer state: "Our use of
#    FSDP for Llama 3 shards optimizer states and gradients, but for model shards we do not reshard after forward
#    computation" (SOURCES['llama3_fsdp']): gradients sharded (ZeRO-2 like), weights kept gathered between forward
#    and backward. Chapter 11 now: "Its FSDP shards gradients and optimizer states and keeps the weights gathered
#    after forward."
# 3. distlab/planner/published.py:81-82 and chapter 11, "Llama 3's layouts in the search" (then "an interleaved
#    schedule of 8 chunks on 16 stages: 128 virtual stages" / "with 8 chunks a rank there are 128 virtual stages"):
#    the paper never gives V (the stages a rank holds): "we use an interleaved schedule ... with V pipeline stages on
#    one pipeline rank" (SOURCES['llama3_pipeline_schedule']). What it states is one layer fewer on the first and
#    last stage so that "the first model chunk on the first stage has only the embedding, and the last model chunk
#    on the last stage has only output projection and loss calculation"; V = 8 is an inference (126 + 2 = 128 =
#    16 x 8 if each chunk holds one layer), not a published figure. Chapter 11 now: "The paper does not say how many
#    chunks a rank holds; 8 would make 128 slots of one layer" ("Llama 3's layouts in the search") and "the chunks
#    a rank: 8, for 126 layers and the embedding and head chunks in 128 slots" ("The planner against published
#    runs", among what the planner chooses).
# 4. chapter 11, "The planner against published runs" (then "a causal ring attention over 128K tokens") and "Llama
#    3's layouts in the search" (then "attention over 128K positions and the ring's traffic"): Llama 3's CP is not a
#    ring: "Different from existing CP implementations that overlap communication and computation in a ring-like
#    structure ..., our CP implementation adopts an all-gather based method where we first all-gather the key (K)
#    and value (V) tensors" (SOURCES['llama3_cp_all_gather']). Chapter 11 now: "Its context parallelism all-gathers
#    keys and values (on the critical path, as the paper says)" and "attention over 128K positions and CP's
#    all-gathers on the critical path, as the paper says they are".
# 5. distlab/planner/published.py:83 (sequence_parallel=True) and chapter 11, "The planner against published runs"
#    (the Llama 3 rows' "SP"): Llama 3 does not say it uses sequence parallelism (it cites Korthikanti et al. among
#    TP references only). Not stated, not contradicted. Chapter 11 now, among what the planner chooses: "sequence
#    parallelism as Megatron runs it, which the paper does not mention".
# 6. distlab/planner/published.py:85-86 ("the micro-batch and the chunks are not stated") and chapter 11, "The
#    planner against published runs" (then "What a paper does not state (the micro-batch, the interleaved chunks)
#    the planner chooses"): NVIDIA's own script for Table 1 states both (examples/sc21/run_table_1.sh at
#    de7dc40f883ceed06344051c3c7ebd57da59cc53). Chapter 11 now: "Megatron's micro-batch and interleave come from
#    NVIDIA's `examples/sc21/run_table_1.sh`". Row by row, that section's table, then and now, vs the script:
#      - 145.6B: then "mb 2, interleaved x8", now "mb 2, interleaved x2, full ckpt" -- script: MBS=2,
#        --num-layers-per-virtual-pipeline-stage 5 with 80 layers on PP 8 = 2 chunks a rank (interleaved x2).
#      - 310.1B: then "mb 1, interleaved x4", now "mb 1, interleaved x2, full ckpt" -- script: MBS=1, 3 layers per
#        virtual stage of 6 a rank = x2.
#      - 529.6B: then "mb 1, interleaved x2", now "mb 1, interleaved x3, full ckpt" -- script: MBS=1, 1 layer per
#        virtual stage of 3 a rank = x3.
#      - 1T: then "mb 1, interleaved x2", now "mb 1, 1F1B, full ckpt" -- script: MBS=1 and no virtual-pipeline flag:
#        the non-interleaved 1F1B schedule (while the paper's section 5.1 says "we use the interleaved pipeline
#        schedule with the scatter/gather optimization enabled" for Table 1: the paper and its script disagree for
#        1T; chapter 11 now: "Part of the 1T row's miss is the schedule").
# 7. distlab/planner/published.py:87 (MEGATRON_FULL zero_stage=1): the SC21 runs used Megatron's local DDP
#    (`DDP=local` / `--DDP-impl local`) with fp16; no distributed (ZeRO-1) optimizer appears in the script or the
#    paper. Not a number the paper prints, but the planner fixes it as if stated.
# 8. distlab/planner/published.py:79 (KORTHIKANTI = "... Table 5") and :120-129 (175B: "TP 8, PP 8, 64 GPUs, batch 64
#    ... 13.75 s per iteration, MFU 51.4 %"; 22B: "TP 8, PP 1, 8 GPUs, batch 4 ... 1.10 s per iteration, MFU 41.5 %"):
#    the MFUs 51.4 % and 41.5 % match NVIDIA's README (measured "using a data parallel size of one"), but the table
#    number, the layouts, batches and iteration times were NOT FOUND in a source here; unverified, not contradicted.
# 9. distlab/planner/published.py:80 (MTNLG = "..., section 3") and :101-104: the iteration times / TFLOP/s are in the
#    MT-NLG paper's section 2.4 per the secondary quotation (the shape and batch are in section 3); the figures
#    themselves (280 nodes, 60.1 s, 126 TFLOP/s, batch 1920, seq 2048, TP 8, PP 35, 105 layers, 20480 hidden, 128
#    heads) agree with the secondary quotations. Internal: published.py:101 builds MT-NLG with vocab 51200 while
#    spec.py:160 MODELS["mt-nlg-530b"] uses 50257; MT-NLG's vocabulary was NOT FOUND.
# 10. distlab/planner/spec.py:242-244 ("v100-32gb": inter-node 100e9 / 8, "100 Gb/s per GPU"): NVIDIA's DGX-1 V100
#    white paper (secondary copy) gives "four 100 Gb InfiniBand network interface cards" for 8 GPUs, i.e. 50 Gb/s per
#    GPU on a DGX-1. (Holds only if the cluster is meant to be a DGX-1; the code does not name it.)
# 11. distlab/planner/spec.py:156 (Llama 3 405B vocab 128256): Table 3 of the paper prints "Vocabulary Size |
#    128,000" and the text "a vocabulary with 128K tokens"; 128,256 is the released tokenizer's size (not read here).
#    A few-hundredths-of-a-percent effect; not a contradiction of the 128K.
# 12. chapters/13_expert_parallel.md:19 (DeepSeek-V3 "671 B | 37 B | ... Technical Report, section 2"): section 2 of
#    the report does not state 671B/37B; they are in the Abstract, section 1 and section 4.2
#    (SOURCES['deepseek_v3_abstract'], ['deepseek_v3_model_hparams']).
# 13. chapters/13_expert_parallel.md:18 (Mixtral "47 B | 13 B | ... Mixtral of Experts, section 2"): section 2
#    (2.1) defines sparse vs active parameter counts but states neither number; 47B and 13B are in the Abstract and
#    section 3, Size and Efficiency (SOURCES['mixtral_8x7b_47b_13b']).
# 14. chapters/13_expert_parallel.md:238-239 ("recomputes whole blocks where DeepSeek recomputes only its norms and
#    latent projections"): DeepSeek also caches the SwiGLU inputs of its MoE and recomputes the SwiGLU output in the
#    backward pass (section 3.3.3, SOURCES['deepseek_v3_recomputation']); "only" leaves that out.
# 15. distlab/planner/published.py:189-190 (MIXTRAL_8X22B vocab 32768): the community conversion of the base model
#    (mistral-community/Mixtral-8x22B-v0.1) has vocab_size 32000; the Instruct model's config (via derived copies)
#    has 32768; mistralai's own base config was NOT FOUND. Other shape fields (56, 6144, 48, 8, 16384, 8, top-2) agree.
# 16. Llama 3 Table 4, 128K row: the arXiv HTML rendering prints DP 4, the PDF prints DP 8. published.py:97-100 and
#    chapter 11's 128K row ("The planner against published runs": "tp=8,pp=16,dp=8,cp=16,zero=3") use DP 8, which
#    agrees with the PDF and with 8 x 16 x 16 x 8 = 16,384 GPUs; recorded so that no one "corrects" it from the HTML
#    page (SOURCES['llama3_table4_html_128k_row']).
# Figures checked and found to agree (no disagreement): Llama 3 Table 4 (all three rows: GPUs, TP, CP, PP, DP 64/128/8,
# seq, batch/DP 32/16/16, 16M tokens, 430/400/380 TFLOPs, 43/41/38 %), Table 3 (126, 16384, 53248, 128 heads, 8 KV),
# H100 80GB HBM3 700 W, 8 GPUs/server on NVLink, 400 Gbps; Megatron Table 1 rows 145.6B/310.1B/529.6B/1008.0B
# (heads, hidden, layers, TP, PP, GPUs, batch, 148/155/163/163 TFLOP/s, 47/50/52/52 %) and eq. (3); A100 312 TFLOP/s;
# DeepSeek-V3 671B/37B, 2.788M and 180K GPU hours, 2,048 H800 at 8 a node, 160/50 GB/s, PP 16 / EP 64 over 8 nodes /
# ZeRO-1 / no TP, M = 4, FP8 dispatch / BF16 combine, 61 layers, 3 dense (inter_dim 18432), 1 shared + 256 routed of
# 2048, top-8, hidden 7168, MLA 128/128/512/1536/64, v 128, vocab 129280, seq 4K, batch ramp to 15360, alpha 0.0001,
# gamma 0.001, route_scale 2.5, MTP 14B; Mixtral 8x7B Table 1 (spec.py:174-175); NCCL hwLat NVLink ring Simple 3.4 us
# and NET ring Simple 14.0 us (current NCCL; older versions had 9.6); Megatron-Core bucket max(40M, 1M x dp).
