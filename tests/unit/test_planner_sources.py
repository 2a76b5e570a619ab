"""Every published run the planner is held against carries its source, and the quoted words hold what the row says.

The quotes live in distlab/planner/sources.py, each read in the paper or the repository (or, SECONDARY, in a
quotation of it). These tests do not trust the rows: they parse the quoted text and compare."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distlab import planner
from distlab.planner.published import RUN_SOURCES, RUNS, source_of
from distlab.planner.sources import NOT_FOUND, SECONDARY, SOURCES


def test_every_published_row_names_its_sources_and_each_has_a_quote():
    assert set(RUN_SOURCES) == {run.label for run in RUNS}, "a published row without its sources"
    for run in RUNS:
        for key in RUN_SOURCES[run.label]:
            source = source_of(key)
            assert source.work and source.where and len(source.quote) > 40, key


def test_every_source_says_where_it_was_read():
    for key, source in {**SOURCES, **SECONDARY}.items():
        assert source.work and source.where and source.quote, key
    assert not set(SOURCES) & set(SECONDARY) and not set(SOURCES) & set(NOT_FOUND)


def _table_row(quote: str, first: str) -> list[str]:
    for line in quote.splitlines():
        cells = [c.strip() for c in line.split("|")] if "|" in line else line.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in the quote")


@pytest.mark.parametrize("run", [r for r in RUNS if r.label.startswith("Llama 3")], ids=lambda r: r.label)
def test_llama_rows_equal_table_4(run):
    quote = SOURCES["llama3_table4"].quote
    rows = [line.split() for line in quote.splitlines() if line[:1].isdigit()]
    gpus, tp, cp, pp, dp, seq, batch_per_dp, _, tflops, mfu = next(
        r for r in rows if int(r[0].replace(",", "")) == run.gpus and int(r[5].replace(",", "")) == run.model.seq_len)
    layout = run.layout
    assert (layout.tp, layout.cp, layout.pp, layout.dp) == (int(tp), int(cp), int(pp), int(dp))
    assert run.model.global_batch == int(batch_per_dp) * layout.dp
    assert run.stated == ("mfu", int(mfu.rstrip("%")) / 100)


def test_llamas_published_settings_are_the_papers():
    options = planner.published.LLAMA_PIPELINE
    assert "without activation checkpointing" in SOURCES["llama3_no_activation_checkpointing"].quote
    assert options.activation_checkpointing == "none"
    assert "do not reshard after forward" in SOURCES["llama3_fsdp"].quote and all(
        r.layout.zero_stage == 3 for r in RUNS[:3])   # FSDP; under PP the planner keeps a stage gathered
    assert "all-gather the key (K) and value (V)" in SOURCES["llama3_cp_all_gather"].quote
    assert options.cp_attention == "all_gather"
    # "N=5" is the paper's Figure 6 (4 ranks), not a setting of the 405B run: the planner does not take it
    assert "N=5" in SOURCES["llama3_pipeline_schedule"].quote and not hasattr(options, "microbatches_per_round")


@pytest.mark.parametrize("key,label", [("megatron_sc21_run_table_1_145b", "Megatron 145.6B, 1,536 A100"),
                                       ("megatron_sc21_run_table_1_310b", "Megatron 310.1B, 1,920 A100"),
                                       ("megatron_sc21_run_table_1_530b", "Megatron 529.6B, 2,520 A100"),
                                       ("megatron_sc21_run_table_1_1t", "Megatron 1T, 3,072 A100")])
def test_megatron_rows_run_at_run_table_1s_settings(key, label):
    """The micro-batch and the interleave of NVIDIA's examples/sc21/run_table_1.sh, read from the quoted line."""
    run = next(r for r in RUNS if r.label == label)
    line = SOURCES[key].quote
    value = {k: int(v) for k, v in re.findall(r"\b(TP|PP|MBS|GBS|NLS|HS|NAH)=(\d+)", line)}
    per_virtual = re.search(r"--num-layers-per-virtual-pipeline-stage (\d+)", line)
    chunks = value["NLS"] // value["PP"] // int(per_virtual.group(1)) if per_virtual else 1
    assert (run.layout.tp, run.layout.pp) == (value["TP"], value["PP"])
    assert (run.model.layers, run.model.hidden, run.model.heads) == (value["NLS"], value["HS"], value["NAH"])
    assert run.model.global_batch == value["GBS"] and run.model.micro_batch == value["MBS"]
    assert planner.chunks(run.options) == chunks and not run.options.search_micro_batch
    assert (run.options.schedule == "interleaved_1f1b") == (chunks > 1)
    # and the figure: Table 1's row of the same size
    size = label.split()[1].rstrip(",").rstrip("B").replace("1T", "1008.0")
    row = _table_row(SOURCES["megatron_sc21_table1"].quote, size)
    assert run.stated == ("megatron_tflops", int(row[8])) and int(row[6]) == run.gpus


def test_the_secondary_and_readme_rows_hold_their_figures():
    assert "60.1" in SECONDARY["mtnlg_iteration_times"].quote
    assert next(r for r in RUNS if r.label.startswith("MT-NLG")).stated == ("iteration_seconds", 60.1)
    readme = SOURCES["korthikanti_megatron_readme_mfu_hfu"].quote
    for size, label in (("175B", "Megatron 175B"), ("22B", "Megatron 22B")):
        row = next(line for line in readme.splitlines() if line.startswith(f"| {size} "))
        mfu = float(row.split("|")[2].strip().rstrip("%")) / 100
        assert next(r for r in RUNS if r.label.startswith(label)).stated == ("mfu", mfu)


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def test_the_model_shapes_are_the_papers():
    """Llama 3 405B (Table 3), Mixtral 8x7B (Table 1) and DeepSeek-V3 (section 4.2), read from the quoted words. The
    405B's vocabulary is the released tokenizer's 128,256, the paper's "128,000" rounded (sources.py's DISAGREEMENTS
    11): allowed within 0.5 %."""
    llama = planner.MODELS["405b"]
    cells = [c.strip() for c in SOURCES["llama3_table3_shape"].quote.split("|")]

    def row(name):
        return _number(cells[cells.index(name) + 3])   # columns 8B, 70B, 405B

    assert (llama.layers, llama.hidden, llama.ffn, llama.heads, llama.kv_heads) == (
        row("Layers"), row("Model Dimension"), row("FFN Dimension"), row("Attention Heads"), row("Key/Value Heads"))
    assert abs(llama.vocab / _number(cells[cells.index("Vocabulary Size") + 1]) - 1) < 0.005
    table = {c[0]: c[1] for c in (line.strip("| ").split(" | ") for line in
                                  SOURCES["mixtral_8x7b_table1"].quote.splitlines()) if len(c) == 2}
    mixtral = planner.MODELS["mixtral-8x7b"]
    assert (mixtral.hidden, mixtral.layers, mixtral.ffn, mixtral.heads, mixtral.kv_heads, mixtral.vocab,
            mixtral.experts, mixtral.top_k) == tuple(int(table[k]) for k in (
                "dim", "n_layers", "hidden_dim", "n_heads", "n_kv_heads", "vocab_size", "num_experts",
                "top_k_experts"))
    deepseek, words = planner.DEEPSEEK_V3, SOURCES["deepseek_v3_model_hparams"].quote
    for phrase in (f"layers to {deepseek.layers}", f"hidden dimension to {deepseek.hidden}",
                   f"n_h to {deepseek.heads}", f"1 shared expert and {deepseek.experts} routed experts",
                   f"dimension of each expert is {deepseek.expert_ffn}", f"Among the routed experts, {deepseek.top_k}",
                   "except for the first three layers", f"at most {planner.DEEPSEEK_V3_OPTIONS.ep_node_limit} nodes",
                   "671B total parameters, of which 37B"):
        assert phrase in words, phrase
    assert deepseek.dense_layers == 3 and deepseek.qk_head_dim == 128 + 64 and deepseek.v_head_dim == 128
    assert "d_h + d^R_h" in SOURCES["deepseek_v3_mla_qk_head_dim"].quote


def test_deepseeks_published_figures_are_quoted():
    assert planner.DEEPSEEK_V3_PUBLISHED == {"total": 671e9, "active": 37e9}
    assert "671B total parameters with 37B activated" in SOURCES["deepseek_v3_abstract"].quote
    assert planner.DEEPSEEK_V3_GPU_HOURS_PER_TRILLION_TOKENS == 180e3
    assert "each trillion tokens requires only 180K H800 GPU hours" in \
        SOURCES["deepseek_v3_180k_gpu_hours_per_trillion"].quote
    layout, words = planner.DEEPSEEK_V3_LAYOUT, SOURCES["deepseek_v3_parallel_layout"].quote
    assert f"{layout.pp}-way Pipeline" in words and f"{layout.ep}-way Expert" in words and "ZeRO-1" in words
    assert layout.tp == 1 and "without using costly Tensor Parallelism" in words and layout.zero_stage == 1
    links = SOURCES["h800_links_deepseek"].quote
    h800 = planner.H800
    assert f"{h800.intra_node_bytes_per_s / 1e9:.0f} GB/s" in links and f"({h800.inter_node_bytes_per_s / 1e9:.0f} GB/s)" \
        in links
    assert "quantize the activation before MoE up-projections into FP8" in \
        SOURCES["deepseek_v3_fp8_dispatch_bf16_combine"].quote and planner.DEEPSEEK_V3_OPTIONS.ep_dispatch_bytes > 1
    assert "we retain them in BF16" in SOURCES["deepseek_v3_fp8_dispatch_bf16_combine"].quote


def test_the_clusters_peaks_and_links_are_quoted_or_named_not_found():
    assert "312 teraFLOP/s" in SOURCES["a100_bf16_peak_312"].quote
    assert planner.CLUSTERS["a100-80gb"].peak_flops == 312e12
    # the H100 SXM's bf16 "1,979 TFLOPS*", "* Shown with sparsity": dense is half (a reseller's copy of NVIDIA's table)
    assert "1,979 TFLOPS*" in SECONDARY["h100_sxm_pcie_spec_table"].quote and \
        abs(planner.CLUSTERS["h100-80gb"].peak_flops / (1979e12 / 2) - 1) < 0.001
    assert "v100_fp16_125" in NOT_FOUND and "nvidia_h100_datasheet" in NOT_FOUND   # said so, not hidden
    assert "four 100 Gb InfiniBand network interface cards" in SECONDARY["dgx1_v100_four_100g_ib"].quote
    assert planner.CLUSTERS["v100-32gb"].inter_node_bytes_per_s == 4 * 100e9 / 8 / 8
    assert "eight NVIDIA Mellanox 200Gbps HDR" in SOURCES["dgx_a100_8x200_hdr"].quote
    assert planner.CLUSTERS["a100-80gb"].inter_node_bytes_per_s == 200e9 / 8
    assert "InfiniBand 8x400 Gbit/s" in SOURCES["dgx_h100_8x400_ib"].quote
    assert planner.CLUSTERS["h100-80gb"].inter_node_bytes_per_s == 400e9 / 8
    ring = SOURCES["nccl_hwlat_ring_simple"].quote
    assert "Ring (LL/LL128/Simple)*/ { .6, 1.9, 3.4 }" in ring and "Ring (LL/LL128/Simple)*/ { 2.7, 4.0, 14.0 }" in ring
    assert {c["intra_node_latency_s"] for c in planner.GPU_CONSTANTS.values()} == {3.4e-6}
    assert {c["inter_node_latency_s"] for c in planner.GPU_CONSTANTS.values()} == {14e-6}
    assert "max(40000000, 1000000 * dp_size)" in SOURCES["megatron_core_ddp_bucket_size"].quote
    # the tree's step latencies (distlab.comm, 11.3's "4 us") from NCCL_HEAD's table, not the older commit's 28
    tree = SOURCES["nccl_hwlat_tree_head"].quote
    nvlink, net = (tuple(float(x) for x in row.split(",")) for row in
                   re.findall(r"\{ \{ ([\d., ]+) \}, \{ [\d., ]+ \}, /\* Tree \(LL/LL128/Simple\)", tree))
    from distlab import comm
    assert nvlink == tuple(v * 1e6 for v in comm.NCCL_TREE_STEP_LATENCY_S["nvlink"].values()) == (0.6, 1.25, 4.0)
    assert net == tuple(round(v * 1e6, 6) for v in comm.NCCL_TREE_STEP_LATENCY_S["network"].values()) == (5.0, 8.5, 14.0)
    chapter = " ".join((Path(__file__).parents[2] / "chapters/11.3_the_planners_model.md").read_text().split())
    assert "its `tuning.cc:156-171` holds the tree's 4.0 and 14 (an older commit's table had 28 for both)." in chapter
    assert "Tree (LL/LL128/Simple)*/ { .6, 1.25, 28 }" in SOURCES["nccl_hwlat_ring_simple"].quote


def test_the_new_measured_rows_hold_their_figures():
    mtnlg = SECONDARY["mtnlg_iteration_times"].quote
    assert "60.1, 50.2, and 44.4 seconds" in mtnlg and "280, 350, and 420 DGX A100 servers" in mtnlg
    rows = {r.label: r for r in RUNS}
    for nodes, seconds in ((280, 60.1), (350, 50.2), (420, 44.4)):
        run = rows[f"MT-NLG 530B, {nodes * 8:,} A100"]
        assert run.stated == ("iteration_seconds", seconds) and run.gpus == nodes * 8
        assert run.layout.tp * run.layout.pp == 280 and run.model.global_batch == 1920   # replicas of 280 GPUs
    table = SOURCES["megatron_readme_h100_weak_scaling_table"].quote
    for size, label in (("177B", "Megatron-Core 177B, 2,304 H100"), ("462B", "Megatron-Core 462B, 6,144 H100")):
        cells = _table_row(table, size)
        heads, hidden, layers, tp, pp, dp, gpus, batch = (int(c) for c in cells[1:9])
        run = rows[label]
        assert (run.model.heads, run.model.hidden, run.model.layers) == (heads, hidden, layers)
        assert (run.layout.tp, run.layout.pp, run.layout.dp, run.gpus, run.model.global_batch) == (tp, pp, dp, gpus,
                                                                                                    batch)
        assert run.stated == ("mfu", int(cells[10].rstrip("%")) / 100)
        assert (run.model.seq_len, run.model.vocab) == (4096, 131072)
    words = SOURCES["megatron_readme_h100_text"].quote
    assert "Vocabulary size: 131,072" in words and "Sequence length: 4,096" in words and "--tp-comm-overlap" in words
    assert all(rows[label].options.async_tp for label in ("Megatron-Core 177B, 2,304 H100",
                                                          "Megatron-Core 462B, 6,144 H100"))
    assert "468 TFLOPS" in SOURCES["megatron_moe_readme_468_tflops"].quote
    assert planner.chapter_tables.MIXTRAL_MCORE_TFLOPS == 468


def test_chapter_13s_account_of_deepseeks_routing_is_the_reports():
    from coursetools import chapters

    text = " ".join(chapters.text("13").split())   # every page of the chapter
    train = SOURCES["deepseek_v3_train_hparams"].quote
    config = SOURCES["deepseek_v3_config_671b"].quote
    for claim, evidence in ((("γ of 0.001", "14.3T tokens and 0 after"), "bias update speed γ to 0.001 for the first "
                             "14.3T tokens, and to 0.0"),
                            (("α = 0.0001", "just to avoid extreme imbalance within any single sequence"),
                             "we set α to 0.0001, just to avoid extreme imbalance within any single sequence"),
                            (("at most 4 of the 8 nodes",), "each token will be sent to at most 4 nodes (i.e., M = 4)")):
        assert evidence in train and all(c in text for c in claim), claim
    assert '"route_scale": 2.5' in config and "scaled by 2.5 (`route_scale`" in text
    assert '"score_func": "sigmoid"' in config and "sigmoid affinities" in text
    assert "normalization among all selected affinity scores" in SOURCES["deepseek_v3_gating_and_bias"].quote
    assert "sum of the highest K_r/M affinity scores" in SOURCES["deepseek_v3_node_limited_routing"].quote


def test_the_mechanisms_read_in_megatron_nccl_and_deepspeed_are_quoted():
    """What planner.memory and planner.communication take from the frameworks' code, in the quoted words."""
    from distlab import comm

    assert "ctx.save_for_backward(input, weight)" in SOURCES["megatron_column_parallel_saves_input_shard"].quote
    assert "ctx.save_for_backward(input_for_backward)" in SOURCES["megatron_fused_swiglu_saves_its_input"].quote
    assert "accumulate and all-reduce gradients in fp32" in SOURCES["megatron_fp32_gradients_for_bf16"].quote
    assert planner.published.MEGATRON_FULL.pp_scatter_gather and "on by default" in \
        SOURCES["megatron_scatter_gather_on_by_default"].quote
    assert "if config.sequence_parallel" in SOURCES["megatron_core_pp_sends_split_only_under_sp"].quote
    assert "2 * (nNodes - 1)" in SOURCES["nccl_ring_latency_split"].quote
    tree = SOURCES["nccl_tree_all_reduce"].quote
    assert "busBw * .92" in tree and "ratio *= .5" in tree and "log2i(nNodes) * interLat" in tree
    assert comm.NCCL_TREE_BANDWIDTH_SHARE == 0.92 * 0.5
    assert "self.partition_gradients or" in SOURCES["deepspeed_zero2_reduces_every_micro_step"].quote
    assert "34 +" in SECONDARY["korthikanti_activation_formula"].quote


def test_korthikantis_530b_figures_are_read_in_the_papers_abstract():
    """54.2 % and 42.1 % on 2,240 A100s are in the abstract of arXiv:2205.05198 (Hugging Face's paper page prints it);
    chapter 11 says so instead of 'found only in a quotation'."""
    from pathlib import Path

    source = SOURCES["korthikanti_530b_abstract"]
    assert "2240 NVIDIA A100 GPUs" in source.quote and "54.2%" in source.quote and "42.1%" in source.quote
    assert "korthikanti_530b_primary" not in NOT_FOUND
    from coursetools import chapters

    chapter = " ".join(chapters.text("11").split())   # every page of chapter 11
    assert "found only in a quotation" not in chapter
    assert "It is stated in the paper's abstract, without its layout or batch." in chapter


def test_the_selective_rows_take_only_the_readmes_mfu_and_name_the_rest_not_found():
    """Korthikanti et al.'s Table 3 (layouts, batches) and iteration times were not found: the two rows state the
    README's MFU, say their layout is the course's, and no test converts an iteration time for them."""
    from pathlib import Path

    missing = NOT_FOUND["korthikanti_table_configs_and_iteration_times"]
    assert "13.75 s" in missing and "Table 3" in missing and "Searched for again" in missing
    for label in ("Megatron 175B, selective recomputation, 64 A100", "Megatron 22B, selective recomputation, 8 A100"):
        row = next(r for r in RUNS if r.label == label)
        assert row.stated[0] == "mfu" and "were not found in a source" in row.quoted
    text_test = (Path(__file__).parent / "test_chapter_text_11.py").read_text()
    assert "13.75" not in text_test and "Korthikanti's MFU from its time" not in text_test
