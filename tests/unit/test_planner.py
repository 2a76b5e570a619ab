"""The planner (chapter 11) against independent answers: parameter counts of models built on the meta device,
chapter 09's sizing guide, the chapter 07 simulator's bubble and activation peaks, and the search's rules.

The measured runs (memory and communication of chapters 05 and 09 scripts) are in
tests/scripts/test_11_choosing_a_strategy.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn as nn

from distlab import models, planner, schedules, sizing

# ---- parameter counts: every preset against a model built on the meta device -----------------------------


class MetaLlama(nn.Module):
    """A LLaMA-style decoder written from the published description, independent of the planner's formula:
    grouped-query attention, SwiGLU, RMSNorm weights, untied embedding and output."""

    def __init__(self, s: planner.ModelSpec):
        super().__init__()
        kv = s.kv_heads * (s.hidden // s.heads)
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList()
        for _ in range(s.layers):
            block = nn.ModuleDict({"q": nn.Linear(s.hidden, s.hidden, bias=False),
                                   "k": nn.Linear(s.hidden, kv, bias=False), "v": nn.Linear(s.hidden, kv, bias=False),
                                   "o": nn.Linear(s.hidden, s.hidden, bias=False),
                                   "gate": nn.Linear(s.hidden, s.ffn, bias=False),
                                   "up": nn.Linear(s.hidden, s.ffn, bias=False),
                                   "down": nn.Linear(s.ffn, s.hidden, bias=False),
                                   "norm1": nn.RMSNorm(s.hidden), "norm2": nn.RMSNorm(s.hidden)})
            self.blocks.append(block)
        self.norm = nn.RMSNorm(s.hidden)
        self.output = nn.Linear(s.hidden, s.vocab, bias=False)


class MetaGPT(nn.Module):
    """GPT-2/3 style: torch's own TransformerEncoderLayer (biased attention and MLP, two LayerNorms), learned
    positions, a final LayerNorm, the output tied to the token embedding (so counted once)."""

    def __init__(self, s: planner.ModelSpec):
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.positions = nn.Embedding(s.seq_len, s.hidden)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(s.hidden, s.heads, s.ffn) for _ in range(s.layers))
        self.norm = nn.LayerNorm(s.hidden)


def meta_count(module_class, spec) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in module_class(spec).parameters())


@pytest.mark.parametrize("name", [name for name, spec in planner.MODELS.items() if not spec.is_moe])
def test_parameter_count_equals_the_model_built_on_the_meta_device(name):
    """(The mixtures of experts: tests/unit/test_planner_moe.py builds theirs.)"""
    spec = planner.MODELS[name]
    built = meta_count(MetaGPT if spec.architecture == "gpt" else MetaLlama, spec)
    assert spec.num_params() == built


def test_the_course_transformer_counts_as_the_planner_says():
    cfg = models.preset("small")
    with torch.device("meta"):
        built = models.count_params(models.Transformer(cfg))
    assert planner.from_config(cfg, 1, 1).num_params() == built


def test_published_sizes_are_the_named_ones():
    billions = {name: spec.num_params() / 1e9 for name, spec in planner.MODELS.items()}
    assert round(billions["gpt3-175b"]) == 175 and round(billions["mt-nlg-530b"]) == 530
    assert round(billions["405b"]) == 406 and round(billions["70b"]) == 69


def test_mixture_of_experts_total_and_active_parameters_against_a_meta_model():
    shape = planner.MIXTRAL_8X7B
    counted = planner.moe_params(**shape)

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.ModuleList(nn.Linear(shape["hidden"], shape["ffn"], bias=False) for _ in range(2))
            self.down = nn.Linear(shape["ffn"], shape["hidden"], bias=False)

    spec = planner.ModelSpec("moe", shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"], 0,
                             shape["vocab"], 1)
    with torch.device("meta"):
        dense = sum(p.numel() for p in MetaLlama(spec).parameters())  # ffn = 0: attention, norms, embeddings
        expert = sum(p.numel() for p in Expert().parameters())
        router = sum(p.numel() for p in nn.Linear(shape["hidden"], shape["experts"], bias=False).parameters())
    assert counted["total"] == dense + shape["layers"] * (shape["experts"] * expert + router)
    assert counted["active"] == dense + shape["layers"] * (shape["top_k"] * expert + router)
    # the name "8x7B" suggests 56 B; stored are 46.7 B, used per token 12.9 B
    assert round(counted["total"] / 1e9, 1) == 46.7 and round(counted["active"] / 1e9, 1) == 12.9


# ---- chapter 09's sizing guide: the same memory, part by part ----------------------------------------------


@pytest.mark.parametrize("name", list(sizing.LLAMA_SHAPES))
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_memory_equals_the_sizing_guide_but_fsdps_buffers(name, sequence_parallel):
    assumptions = replace(sizing.Assumptions(), sequence_parallel=sequence_parallel)
    cluster = planner.CLUSTERS["a100-40gb"]
    options = planner.Options(zero_stage=3, sequence_parallel=sequence_parallel)
    for dp in (1, 2, 8, 20):
        spec = replace(planner.MODELS[name.lower()], global_batch=dp)  # one micro-batch per replica, as sizing
        guide = sizing.memory_per_gpu(name, dp, 4, assumptions)
        plan = planner.evaluate(spec, cluster, planner.Layout(tp=4, dp=dp, zero_stage=3), options)
        m = plan.memory_per_gpu_bytes
        assert (m["params"], m["grads"], m["optimizer"]) == pytest.approx(
            (guide.state.params, guide.state.grads, guide.state.optimizer), rel=1e-12)
        # FSDP's buffers differ: the guide counts its largest unit gathered twice and that unit's fp32 gradients;
        # the planner counts what FSDP2 holds during a block's backward (tests/unit/test_planner_fsdp_buffers.py):
        # the root (embedding, output layer, final norm) gathered beside two blocks, the head's and a block's bf16
        # gradients, one block's fp32 reduce-scatter input. By hand from the guide's shape, this TP rank's share of
        # the matrices and the norm weights whole (replicated over TP; sizing divides them by TP too: kilobytes)
        shape, h = sizing.LLAMA_SHAPES[name], spec.hidden
        block, head = (shape.block_params() - 2 * h) / 4 + 2 * h, shape.vocab_size * h / 4 + h
        root = head + shape.vocab_size * h / 4
        assert m["temporary"] == pytest.approx(2 * (root + 2 * block) + 2 * (head + block) + 4 * block, rel=1e-12)
        norm_rounding = 2 * 8 * spec.hidden
        assert guide.fsdp_unit == pytest.approx((2 * 2 + 4) * max(root, block), rel=1e-3)
        assert m["activations"] == pytest.approx(guide.activations, rel=1e-12)
        assert abs(m["total"] - guide.total - (m["temporary"] - guide.fsdp_unit)) <= norm_rounding


def test_fewest_nodes_equal_the_sizing_guide():
    cluster = planner.CLUSTERS["a100-40gb"]
    for name in sizing.LLAMA_SHAPES:
        nodes = sizing.min_nodes(name)
        spec = planner.MODELS[name.lower()]
        fits = [planner.evaluate(replace(spec, global_batch=n), cluster, planner.Layout(tp=4, dp=n, zero_stage=3),
                                 planner.Options(zero_stage=3, sequence_parallel=False)).fits
                for n in (nodes - 1, nodes) if n >= 1]
        assert fits[-1] and (len(fits) == 1 or not fits[0]), name


# ---- pipelines: bubble and activations in flight against the chapter 07 simulator ---------------------------

TINY = planner.from_config(models.preset("tiny"), 1, 1)


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
@pytest.mark.parametrize("pp,num_micro", [(2, 4), (4, 8), (4, 4)])
def test_bubble_equals_the_simulated_timeline(schedule, chunks, pp, num_micro):
    spec = replace(TINY, layers=8, global_batch=num_micro)
    options = planner.Options(schedule=schedule, chunks=chunks, zero_stage=0)
    plan = planner.evaluate(spec, planner.CLUSTERS["a100-40gb"], planner.Layout(pp=pp), options)
    simulated = schedules.bubble_fraction_from_timeline(
        schedules.simulate(schedules.build(schedule, pp, num_micro, chunks)))
    assert plan.bubble["of_step"] == pytest.approx(simulated, abs=1e-9)
    share = plan.bubble["of_step"]
    assert plan.bubble["of_ideal"] == pytest.approx(share / (1 - share))  # the two ways of quoting it


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 1),
                                             ("interleaved_1f1b", 2)])
def test_activations_in_flight_equal_the_schedules_peaks(schedule, chunks):
    # one chunk a rank is plain 1F1B, as every label says (search.CHUNKS, the settings' "1F1B", and FSDP's gathers,
    # counted on schedules.build("1f1b")), not torch's interleaved class run with one stage a rank
    simulated = "1f1b" if (schedule, chunks) == ("interleaved_1f1b", 1) else schedule
    from coursetools import chapters
    from distlab.planner.search import CHUNKS

    assert CHUNKS == (1, 2, 4, 8)   # page 11.1 names the search's chunks, one as plain 1F1B
    assert "chunks per rank (chapter 07): 1 (plain 1F1B), 2, 4 or 8" in " ".join(chapters.text("11").split())
    for pp, num_micro in ((2, 2), (4, 8), (4, 3), (8, 16)):
        if schedule == "interleaved_1f1b" and num_micro % pp:
            continue
        peaks = schedules.peak_activations(schedules.build(simulated, pp, num_micro, chunks))
        for stage in range(pp):
            # the simulator counts (chunk, microbatch) pairs; the planner whole-stage units
            assert planner.in_flight(schedule, pp, stage, num_micro, chunks) * chunks == peaks[stage]


# ---- the search and its rules -----------------------------------------------------------------------------


def test_search_ranks_fitting_layouts_by_throughput_and_gives_every_rejection_a_reason():
    plans = planner.search(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], 64)
    fitting = [p for p in plans if p.fits]
    assert fitting and plans[: len(fitting)] == fitting
    speeds = [p.tokens_per_second for p in fitting]
    assert speeds == sorted(speeds, reverse=True)
    for plan in plans[len(fitting):]:
        assert plan.reason and plan.reason != "fits"
    assert all(p.layout.tp <= 8 and p.layout.gpus == 64 for p in plans)
    assert len({p.layout for p in plans}) == len(plans)


def test_layout_problems_name_each_reason():
    spec, cluster = planner.MODELS["70b"], planner.CLUSTERS["a100-40gb"]
    problems = planner.layout_problems(spec, cluster, planner.Layout(tp=8, pp=3, dp=3), gpus=64)
    text = " | ".join(problems)
    assert "is not the 64 GPUs" in text and "larger than a node" in text and "global batch 1024" in text


def test_memory_parts_shrink_as_the_zero_stages_say():
    spec, cluster = replace(planner.MODELS["7b"], global_batch=8), planner.CLUSTERS["a100-80gb"]
    parts = {z: planner.evaluate(spec, cluster, planner.Layout(dp=8, zero_stage=z)).memory_per_gpu_bytes
             for z in (0, 1, 2, 3)}
    # bytes a parameter (params, grads, optimizer) by hand: DDP under autocast (fp32 weights and gradients, two
    # moments); ZeRO-1 as Megatron's distributed optimizer (bf16 weights, fp32 gradients, the master copy and the
    # moments over 8); ZeRO-2 and FSDP as the ZeRO paper counts them (2 + 2 + 12, each sharded part over 8)
    expected = {0: (4, 4, 8), 1: (2, 4, 12 / 8), 2: (2, 2 / 8, 12 / 8), 3: (2 / 8, 2 / 8, 12 / 8)}
    n = spec.num_params()
    for z, by_hand in expected.items():
        assert [parts[z][part] / n for part in ("params", "grads", "optimizer")] == pytest.approx(by_hand, rel=1e-3), z


def test_a_node_crossing_is_read_from_the_mesh_order():
    cluster = planner.CLUSTERS["h100-80gb"]
    layout = planner.Layout(tp=8, pp=2, dp=4)
    assert not planner.crosses_nodes(layout, "tp", cluster)
    assert planner.crosses_nodes(layout, "dp", cluster) and planner.crosses_nodes(layout, "pp", cluster)
    assert not planner.crosses_nodes(planner.Layout(tp=2, dp=4), "dp", cluster)


def test_parse_layout():
    assert planner.parse_layout("tp=8,pp=8,dp=16") == planner.Layout(8, 8, 16, 1, 0)
    assert planner.parse_layout("dp=2, tp=4, zero=3") == planner.Layout(4, 1, 2, 1, 3)
    with pytest.raises(ValueError, match="write it like"):
        planner.parse_layout("tp8")


# ---- context parallelism in the search -----------------------------------------------------------------------


def test_the_search_tries_cp_only_where_each_rank_keeps_its_minimum_of_a_sequence():
    options = planner.Options()
    assert options.cp_min_tokens == 8192
    degrees = {seq: planner.cp_degrees(replace(planner.MODELS["70b"], seq_len=seq), 64) for seq in (4096, 32768, 131072)}
    assert degrees == {4096: [1], 32768: [1, 2, 4], 131072: [1, 2, 4, 8, 16]}
    # --cp N: exactly that degree, where it divides what TP and PP leave
    fixed = planner.Options(context_parallel=4)
    assert planner.cp_degrees(planner.MODELS["70b"], 64, fixed) == [4] and planner.cp_degrees(
        planner.MODELS["70b"], 6, fixed) == []
    layouts = planner.candidate_layouts(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], 64, fixed)
    assert layouts and {layout.cp for layout in layouts} == {4} and all(layout.gpus == 64 for layout in layouts)


def test_long_sequences_make_the_search_choose_cp_and_short_ones_never_see_it():
    cluster = planner.CLUSTERS["h100-80gb"]
    short = planner.search(planner.MODELS["70b"], cluster, 64)
    assert all(p.layout.cp == 1 for p in short if p.fits)
    left_out = [p for p in short if p.layout.cp > 1]
    assert left_out and all("fewer than the search's 8192 (--cp-min-tokens)" in p.reason for p in left_out)
    longest = replace(planner.MODELS["70b"], seq_len=131072, global_batch=32)
    plans = planner.search(longest, cluster, 64)
    assert plans[0].fits and plans[0].layout.cp > 1
    # the decision path's "without SP, nothing without CP fits"
    without_sp = planner.search(longest, cluster, 64, planner.Options(sequence_parallel=False))
    assert not any(p.fits for p in without_sp if p.layout.cp == 1)
    # the rule is what keeps CP off 4K sequences: without it, CP would win there on the estimate alone
    free = planner.search(planner.MODELS["70b"], cluster, 64, planner.Options(cp_min_tokens=1))
    assert free[0].layout.cp > 1


def test_cp_divides_activations_and_shards_the_state_over_dp_x_cp():
    spec, cluster = replace(planner.MODELS["7b"], seq_len=32768, global_batch=64), planner.CLUSTERS["h100-80gb"]
    options = planner.Options(activation_checkpointing=False)
    plain, split = (planner.evaluate(spec, cluster, layout, options, 8).memory_per_gpu_bytes
                    for layout in (planner.Layout(dp=8, zero_stage=3), planner.Layout(dp=2, cp=4, zero_stage=3)))
    assert split["params"] == plain["params"] and split["optimizer"] == plain["optimizer"]  # 8 ways either way
    # chapter 08's formula (measured there) on a quarter of the tokens: less than a third of the activations
    assert split["activations"] < plain["activations"] / 3


def test_the_long_context_layout_of_llama3_fits_where_its_8k_layout_does_not():
    """At the published settings the 8K layout (no recomputation) does not fit the planner; the 128K one, whose
    recomputation the paper leaves unstated, fits with the planner's (full) and ranks near the top."""
    rows = {r["claim"]: r for r in planner.published_table()}
    short, long = rows["Llama 3 405B, 8K tokens, 16,384 H100"], rows["Llama 3 405B, 128K tokens, 16,384 H100"]
    assert long["fits"] and long["rank"] <= 10 and "cp=16" in long["layout"]
    assert not short["fits"] and short["gib_per_gpu"] > 80


def test_grouped_query_attention_saves_k_and_v_at_their_own_width():
    """Derived: the course's model (every head for k and v) is what chapter 08 measures; with GQA the formula keeps
    k and v at kv_dim wide, and nothing else changes."""
    from distlab import tensor_parallel

    spec = planner.MODELS["70b"]
    cfg, b, s, t = spec.config(), 1, 4096, 8
    full = tensor_parallel.activation_bytes(cfg, b, s, t)
    assert tensor_parallel.activation_bytes(cfg, b, s, t, kv_dim=spec.hidden) == full
    gqa = tensor_parallel.activation_bytes(cfg, b, s, t, kv_dim=spec.kv_dim)
    assert spec.kv_dim == spec.hidden // 8
    assert full["per_layer"] - gqa["per_layer"] == 2 * b * s * (spec.hidden - spec.kv_dim) // t * 4
    assert {k: v for k, v in gqa.items() if k not in ("attention", "per_layer", "total")} == \
        {k: v for k, v in full.items() if k not in ("attention", "per_layer", "total")}


# ---- the time model's mechanisms ------------------------------------------------------------------------------


@pytest.mark.parametrize("precision,share", [("fp32", 1.0), ("mixed", 0.75)])
def test_zero1_sends_three_quarters_of_ddp_in_mixed_precision(precision, share):
    """Eight microbatches a step. By hand, per parameter on a ring of 8: DDP all-reduces fp32 gradients once,
    2 x 7/8 x 4 bytes; ZeRO-1 reduce-scatters them (7/8 x 4) and all-gathers the updated parameters, 7/8 x 4 in
    fp32 and 7/8 x 2 in bf16: 1 and 0.75 of DDP's bytes. Neither reduces before the last microbatch."""
    spec, layout = replace(planner.MODELS["7b"], global_batch=64), planner.Layout(dp=8, zero_stage=1)
    options = planner.Options(precision=precision)
    params = planner.stage_params(spec, layout, 0)["total"]
    zero1 = planner.comm_per_step(spec, layout, 0, options)["dp"]
    ddp = planner.comm_per_step(spec, replace(layout, zero_stage=0), 0, options)["dp"]
    assert planner.bytes_sent("dp", ddp, 8) == pytest.approx(2 * 7 / 8 * 4 * params)
    assert planner.bytes_sent("dp", zero1, 8) == pytest.approx(share * 2 * 7 / 8 * 4 * params)


def test_zero2_reduce_scatters_after_every_microbatch():
    """DeepSpeed's ZeRO-2 reduces each microbatch's gradients into their shards (it keeps no whole gradient):
    with 8 microbatches, 8 reduce-scatters of the fp32 gradients and one bf16 all-gather, by hand on a ring of 8."""
    spec, layout = replace(planner.MODELS["7b"], global_batch=64), planner.Layout(dp=8, zero_stage=2)
    params = planner.stage_params(spec, layout, 0)["total"]
    zero2 = planner.comm_per_step(spec, layout, 0, planner.Options())["dp"]
    assert planner.bytes_sent("dp", zero2, 8) == pytest.approx((8 * 7 / 8 * 4 + 7 / 8 * 2) * params)
    calls = planner.collective_calls(spec, layout, 0, planner.Options())["dp"]
    assert calls["reduce_scatter"] == 8 * calls["all_gather"]


def test_fsdp_under_pp_gathers_as_torchs_schedules_do():
    """FSDP under PP, counted as torch 2.13 runs it (tests/unit/test_pipeline_fsdp.py holds the counts to torch's
    steps). 70B (80 layers) on PP 8 x dp 8, 32 microbatches. Interleaved x8: torch's runtime re-gathers rank 0's
    chunks through its window of 3, 47 gathers of a chunk a step (6, 6, 8, 5, 5, 5, 8, 4), not one each; its
    gradients are reduce-scattered once, and at most 3 of the 8 chunks' bf16 weights are gathered at once. 1F1B
    without resharding after forward (the default under PP, as chapter 09's scripts set it): one gather a step;
    with it, M + 1 = 33 (each forward after a forward, each backward after a forward)."""
    spec = replace(planner.MODELS["70b"], global_batch=256)
    layout = planner.Layout(pp=8, dp=8, zero_stage=3)
    units = 10 + 1          # 10 blocks and the first stage's root (the embedding)
    interleaved = planner.Options(schedule="interleaved_1f1b", chunks=8)
    calls = planner.collective_calls(spec, layout, 0, interleaved)["dp"]
    assert calls["all_gather"] == pytest.approx(units * 47 / 8) and calls["reduce_scatter"] == units
    one_f = planner.Options(schedule="1f1b")
    assert planner.collective_calls(spec, layout, 0, one_f)["dp"]["all_gather"] == units
    resharding = planner.collective_calls(spec, layout, 0, replace(one_f, reshard_after_forward=True))["dp"]
    assert resharding["all_gather"] == 33 * units and resharding["reduce_scatter"] == units
    weights = 2 * planner.stage_params(spec, layout, 0)["total"]
    gradients = 4 * planner.stage_params(spec, layout, 0)["total"]
    assert planner.temporary_bytes(spec, layout, 0, interleaved) == pytest.approx(3 / 8 * weights + gradients)
    assert planner.temporary_bytes(spec, layout, 0, one_f) == pytest.approx(weights + gradients)
    # torch refuses an interleaved M that is not a multiple of its max(1, M // P) rounds: 25 over 3 rounds
    h100 = planner.CLUSTERS["h100-80gb"]
    problems = planner.layout_problems(replace(spec, global_batch=200), h100, layout, 64, interleaved)
    assert problems == ["torch's interleaved 1F1B needs the 25 microbatches to be a multiple of its max(1, M // P) = "
                        "3 rounds"]
    assert not planner.layout_problems(replace(spec, global_batch=240), h100, layout, 64, interleaved)   # 30 = 3 x 10


def test_pipeline_sends_are_split_over_tp_under_sp_or_megatrons_scatter_gather():
    """A boundary tensor of b s h = 1 x 4,096 x 4,096 bf16 numbers, 8 microbatches, 2 stages: stage 0 sends 8
    activations and receives 8 gradients' worth of sends, so it sends 8 x 32 MiB; each of 4 TP ranks a quarter
    of that under SP or scatter/gather, all of it otherwise."""
    spec = replace(planner.MODELS["7b"], global_batch=8)
    layout = planner.Layout(tp=4, pp=2, dp=1)
    one = 4096 * 4096 * 2
    sends = {name: planner.comm_per_step(spec, layout, 0, planner.Options(schedule="1f1b", **kw))["pp"]["send"]
             for name, kw in (("sp", {}), ("plain", {"sequence_parallel": False}),
                              ("scatter", {"sequence_parallel": False, "pp_scatter_gather": True}))}
    assert sends == {"sp": 8 * one / 4, "plain": 8 * one, "scatter": 8 * one / 4}


def test_megatrons_sp_gathers_each_regions_input_again_in_backward():
    """Megatron's layers under SP (ColumnParallelLinear saves its input's shard): two all-gathers a block more in
    backward than DTensor's, each of the b s h gathered input: 32 blocks x 8 microbatches x 2 x 1 x 4,096 x
    4,096 x 2 bytes."""
    spec = replace(planner.MODELS["7b"], global_batch=8)
    layout = planner.Layout(tp=4, dp=1)
    options = planner.Options(activation_checkpointing="selective")
    dtensor = planner.comm_per_step(spec, layout, 0, options)["tp"]["all_gather"]
    megatron = planner.comm_per_step(spec, layout, 0, replace(options, sp_saves_gathered_inputs=False))["tp"]
    assert megatron["all_gather"] - dtensor == 32 * 8 * 2 * 4096 * 4096 * 2


def test_dtensors_sequence_parallel_is_on_with_tp_and_costs_no_extra_bytes():
    spec = replace(planner.MODELS["7b"], global_batch=8)
    layout = planner.Layout(tp=4, dp=2, zero_stage=3)
    assert planner.spec.sequence_parallel(planner.Options(), layout)
    assert not planner.spec.sequence_parallel(planner.Options(), planner.Layout(dp=8))
    # the same bytes without recomputation, and when whole blocks are recomputed; under PyTorch's early stop the
    # recomputation re-issues the feed-forward's all-gather but not its all-reduce: one all-gather a block more
    whole = dict(activation_checkpointing="full", recompute_early_stop=False)
    on, off = (planner.comm_per_step(spec, layout, 0, planner.Options(sequence_parallel=sp, **whole))["tp"]
               for sp in (True, False))
    blocks_on = on["all_gather"] + on["reduce_scatter"]
    assert planner.bytes_sent("tp", {"all_gather": on["all_gather"], "reduce_scatter": on["reduce_scatter"]}, 4) == \
        pytest.approx(planner.bytes_sent("tp", {"all_reduce": off["all_reduce"]}, 4), rel=0.01)
    assert blocks_on > 0


def test_fsdp_kept_gathered_gathers_once_and_holds_the_weights_and_fp32_gradients():
    spec = replace(planner.MODELS["7b"], global_batch=64)  # 8 microbatches per replica
    layout = planner.Layout(dp=8, zero_stage=3)
    kept, resharded = (planner.Options(fsdp_keep_gathered=k, activation_checkpointing="full") for k in (True, False))
    assert planner.microbatches(spec, layout) == 8
    once = planner.comm_per_step(spec, layout, 0, kept)["dp"]
    every = planner.comm_per_step(spec, layout, 0, resharded)["dp"]
    assert every["reduce_scatter"] == 8 * once["reduce_scatter"] and every["all_gather"] == 16 * once["all_gather"]
    params = planner.stage_params(spec, layout, 0)["total"]
    assert planner.temporary_bytes(spec, layout, 0, kept) == 2 * params + 4 * params
    faster = planner.evaluate(spec, planner.CLUSTERS["h100-80gb"], layout, kept)
    slower = planner.evaluate(spec, planner.CLUSTERS["h100-80gb"], layout, resharded)
    assert faster.comm_seconds["dp"] < slower.comm_seconds["dp"] / 7


def test_checkpointing_modes_trade_memory_for_flops():
    spec = replace(planner.MODELS["7b"], global_batch=8)
    layout = planner.Layout(tp=2, dp=4, zero_stage=3)
    memory = {}
    for flash in (True, False):
        for mode in planner.CHECKPOINTING:
            options = planner.Options(activation_checkpointing=mode, flash_attention=flash)
            memory[flash, mode] = planner.activation_bytes(spec, layout, 0, options)
    # full keeps only block inputs; selective drops exactly the s x s probabilities a non-flash attention saves
    assert memory[True, "full"] < memory[True, "selective"] == memory[True, "none"]
    scores = spec.layers * spec.micro_batch * spec.heads // 2 * spec.seq_len * spec.seq_len * 2
    assert memory[False, "none"] - memory[False, "selective"] == scores
    flops = {mode: planner.stage_flops(spec, layout, 0, planner.Options(activation_checkpointing=mode))
             for mode in planner.CHECKPOINTING}
    attention_forward = 4 * spec.hidden * spec.seq_len * spec.layers * spec.global_batch * spec.seq_len / (4 * 2)
    assert flops["none"]["recompute"] == 0 and flops["selective"]["recompute"] == pytest.approx(attention_forward)
    assert flops["full"]["recompute"] > 5 * flops["selective"]["recompute"]
    assert {f["model"] for f in flops.values()} == {flops["none"]["model"]}  # MFU never counts recomputation


def test_model_flops_summed_over_stages_are_the_models_flops_per_token():
    spec = planner.MODELS["405b"]
    layout = planner.Layout(tp=8, pp=16, dp=128, zero_stage=1)
    total = sum(planner.stage_flops(spec, layout, s)["model"] for s in range(16)) * 8 * 128
    expected = spec.flops_per_token() * spec.global_batch * spec.seq_len
    assert total == pytest.approx(expected, rel=2e-3)  # the final norm counted as a matmul by one, not the other


def test_a_ring_over_nodes_pays_the_network_latency_only_where_it_leaves_a_node():
    """1B under DDP on 1,024 H100s, 8 a node (128 nodes), counted by hand from NCCL's tuning.cc: a ring all-reduce
    has 2 x 1,023 = 2,046 steps, of which 2 x 127 = 254 leave a node (14 us each) and 1,792 stay on NVLink (3.4 us):
    9.6488 ms a call. NCCL's tree: 2 x (7 NVLink steps x 4.0 us + log2(128) = 7 network steps x 14 us) = 252 us."""
    spec = replace(planner.MODELS["1b"], global_batch=1024)
    cluster = planner.CLUSTERS["h100-80gb"]
    layout = planner.Layout(tp=1, dp=1024, zero_stage=0)
    buckets = planner.collective_calls(spec, layout, 0, planner.Options())["dp"]["all_reduce"]
    assert buckets == 2   # 1.1 B parameters in buckets of max(40M, 1M x dp) = 1,024 M
    ring = planner.dimension_seconds(spec, cluster, layout, 0, planner.Options(nccl_algorithm="ring"))["dp"]
    assert ring["latency"] == pytest.approx(2 * 9.6488e-3)
    tree = planner.dimension_seconds(spec, cluster, layout, 0, planner.Options())["dp"]
    assert tree["latency"] == pytest.approx(2 * 252e-6)
    assert tree["total"] < ring["total"] and tree["bandwidth"] > ring["bandwidth"]
    # with PyTorch DDP's 25 MiB buckets (6.5M fp32 numbers) the same ring waits far longer
    small = planner.dimension_seconds(spec, cluster, layout, 0, planner.Options(bucket_params=25 * 2**20 // 4,
                                                                                nccl_algorithm="ring"))["dp"]
    assert small["latency"] > 50 * ring["latency"] and small["bandwidth"] == ring["bandwidth"]


def test_a_ring_inside_one_node_pays_nvlink_latency_only():
    """DDP over the 8 GPUs of one H100 node: 14 steps of 3.4 us, no tree (NCCL's tree is for crossing nodes)."""
    spec = replace(planner.MODELS["1b"], global_batch=64)
    layout = planner.Layout(tp=1, dp=8, zero_stage=0)
    seconds = planner.dimension_seconds(spec, planner.CLUSTERS["h100-80gb"], layout, 0, planner.Options())["dp"]
    calls = planner.collective_calls(spec, layout, 0, planner.Options())["dp"]["all_reduce"]
    assert seconds["latency"] == pytest.approx(calls * 14 * 3.4e-6)


def test_tune_picks_the_fastest_fitting_variant_and_the_search_uses_it():
    spec, cluster = planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"]
    layout = planner.Layout(tp=4, pp=4, dp=4, zero_stage=1)
    tuned = planner.tune(spec, cluster, layout, planner.Options(), 64)
    brute = [planner.evaluate(s, cluster, layout, o, 64) for s, o in planner.variants(spec, layout, planner.Options())]
    assert len(brute) >= 8 and tuned.tokens_per_second == max(p.tokens_per_second for p in brute if p.fits)
    assert tuned.settings["chunks"] > 1  # interleaving shrinks the bubble
    searched = next(p for p in planner.search(spec, cluster, 64) if p.layout == layout)
    assert searched.tokens_per_second == tuned.tokens_per_second


def test_the_validation_band_can_fail():
    """The band check is not vacuous: one efficiency too high for the A100 rows, or no exposed TP, and rows leave."""
    runs = [run for run in planner.published.RUNS if run.cluster.name.startswith("a100")]
    hot = [planner.published.validate(replace(run, cluster=replace(run.cluster, gemm_time_share=0.81)))
           for run in runs]
    assert any(not r["passes"] for r in hot)
    overlapped = [planner.published.validate(replace(run, options=replace(run.options, async_tp=True)))
                  for run in runs]
    assert any(not r["passes"] for r in overlapped)


def test_a_ring_over_nodes_is_charged_per_nic_not_per_gpu():
    """FSDP over 64 GPUs of Derecho (4 a node, one NIC each): the ring leaves a node on one edge, so what each rank
    sends crosses the network shared by the node's 4 ranks' NICs: the dimension's bandwidth time is a quarter of one
    NIC's. TP 4 beside it leaves one dp rank a node: one NIC each, as before (chapter 09's per-NIC count)."""
    from distlab.planner.communication import bytes_sent, comm_per_step, dimension_seconds, ranks_in_node

    derecho = planner.CLUSTERS["a100-40gb"]
    spec = planner.MODELS["7b"]
    for layout, nics in ((planner.Layout(dp=64, zero_stage=3), 4), (planner.Layout(tp=4, dp=16, zero_stage=3), 1),
                         (planner.Layout(tp=2, dp=32, zero_stage=3), 2)):
        assert ranks_in_node(layout, "dp", derecho) == nics
        sent = bytes_sent("dp", comm_per_step(spec, layout, 0, planner.Options())["dp"], layout.dp)
        seconds = dimension_seconds(spec, derecho, layout, 0, planner.Options())["dp"]
        assert seconds["bandwidth"] == pytest.approx(sent / (derecho.inter_node_bytes_per_s * nics))
    # inside one node nothing crosses the network: NVLink, every rank its own link
    one_node = planner.Layout(dp=4, zero_stage=3)
    sent = bytes_sent("dp", comm_per_step(spec, one_node, 0, planner.Options())["dp"], 4)
    assert dimension_seconds(spec, derecho, one_node, 0, planner.Options())["dp"]["bandwidth"] == pytest.approx(
        sent / derecho.intra_node_bytes_per_s)


@pytest.mark.parametrize("layout", [planner.Layout(dp=64, zero_stage=3), planner.Layout(tp=2, dp=32, zero_stage=3),
                                    planner.Layout(tp=1, dp=8, cp=8, zero_stage=3),
                                    planner.Layout(tp=2, dp=1, cp=4, zero_stage=3),
                                    planner.Layout(tp=2, pp=2, dp=4, cp=2, zero_stage=3),
                                    planner.Layout(tp=2, dp=16, zero_stage=3, shard=2),
                                    planner.Layout(tp=4, pp=4, dp=2, cp=2, zero_stage=1)],
                         ids=lambda layout: layout.label())
def test_ranks_in_a_node_and_crossing_counted_from_the_rank_grid(layout):
    """Independent of the planner's strides: lay the ranks out as DeviceMesh (pp, dp, cp, tp) does (HSDP's dp as
    (replicate, shard)), take the group of rank 0 in each dimension, and count its members in rank 0's node."""
    import itertools

    derecho = planner.CLUSTERS["a100-40gb"]
    from distlab.planner.communication import crosses_nodes, ranks_in_node

    shape = {"pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp}
    coords = list(itertools.product(*(range(n) for n in shape.values())))   # rank = index, tp fastest

    def group(varying):   # the ranks that share rank 0's coordinates except in ``varying``
        keep = [k for k in shape if k not in varying]
        return [r for r, c in enumerate(coords) if all(c[list(shape).index(k)] == 0 for k in keep)]

    members = {"tp": group({"tp"}), "cp": group({"cp"}), "pp": group({"pp"}),
               "dp": group({"dp", "cp"}) if not layout.shard else [r for r in group({"dp"})
                                                                     if coords[r][1] < layout.shard]}
    if layout.shard:
        members["replicate"] = [r for r in group({"dp"}) if coords[r][1] % layout.shard == 0]
    for dimension, ranks in members.items():
        in_node = sum(r < derecho.gpus_per_node for r in ranks)
        spans = len({r // derecho.gpus_per_node for r in ranks}) > 1
        assert crosses_nodes(layout, dimension, derecho) == spans, dimension
        if spans and dimension not in ("pp",):
            assert ranks_in_node(layout, dimension, derecho) == in_node, dimension


def test_an_unknown_schedule_is_named_in_a_clear_error():
    with pytest.raises(ValueError, match="schedule must be one of"):
        planner.in_flight("zigzag", 4, 0, 8)


@pytest.mark.parametrize("zero, shard", [(3, 0), (3, 2), (0, 0), (1, 0)], ids=["fsdp", "hsdp", "ddp", "zero1"])
def test_fsdp_under_pp_reduces_after_the_last_backward(zero, shard):
    """torch 2.13's pipeline stage reduces an FSDP stage's gradients in REDUCE_GRAD, after its last backward
    (stage.py, perform_reduce_grad): nothing hides them. DDP (and ZeRO-1, Megatron's overlapped reduction) reduce
    during the last backward. Without PP the rule does not apply. Independent of the formula: compare the two
    settings of ``pp_fsdp_grad_sync`` and the pp = 1 layout."""
    spec = planner.MODELS["7b"]
    cluster = planner.CLUSTERS["a100-40gb"]
    layout = planner.Layout(tp=2, pp=2, dp=16, zero_stage=zero, shard=shard)
    after, during = (planner.stage_time(spec, cluster, layout, 1, planner.Options(
        zero_stage=zero, activation_checkpointing="full", pp_fsdp_grad_sync=mode)) for mode in
        ("after_backward", "last_backward"))
    dimension = "replicate" if shard else "dp"
    if zero == 3:
        # the reduction's seconds are all exposed after; during, at least part hides behind the last backward
        assert after["exposed"][dimension] > during["exposed"][dimension]
        total = after["seconds"][dimension]["total"]
        if shard:
            assert after["exposed"]["replicate"] == pytest.approx(total)
        else:
            assert after["exposed"]["dp"] >= total * 0.5   # the reduce-scatter's share of dp's bytes: half
    else:
        assert after["exposed"] == during["exposed"]
    flat = planner.Layout(tp=2, pp=1, dp=32, zero_stage=zero, shard=shard)
    a, d = (planner.stage_time(spec, cluster, flat, 0, planner.Options(zero_stage=zero, pp_fsdp_grad_sync=mode))
            for mode in ("after_backward", "last_backward"))
    assert a["exposed"] == d["exposed"]


def test_pp_fsdp_grad_sync_names_its_choices():
    with pytest.raises(ValueError, match="pp_fsdp_grad_sync"):
        planner.reduces_after_backward(planner.Options(pp_fsdp_grad_sync="overlapped"),
                                       planner.Layout(pp=2, dp=2, zero_stage=3))


@pytest.mark.parametrize("attention", ["ring", "all_gather"])
def test_cp_moves_only_this_tp_ranks_key_value_heads(attention):
    """Under TP each rank holds heads / tp of the keys and values: CP passes (or gathers) only those, one whole head
    where TP exceeds the key/value heads (GQA's replicated head). Counted from the shapes, not the planner's helper."""
    from distlab.planner.communication import comm_per_step

    mha = planner.replace(planner.MODELS["7b"], seq_len=32768)
    options = planner.Options(zero_stage=3, cp_attention=attention, activation_checkpointing="none")

    def cp_bytes(spec, tp):
        return sum(comm_per_step(spec, planner.Layout(tp=tp, dp=1, cp=4, zero_stage=3), 0, options)["cp"].values())

    assert cp_bytes(mha, 2) * 2 == cp_bytes(mha, 1)
    gqa = planner.replace(mha, kv_heads=2)             # 2 key/value heads of 128 wide
    assert cp_bytes(gqa, 2) * 2 == cp_bytes(gqa, 1)    # one head a rank
    assert cp_bytes(gqa, 4) == cp_bytes(gqa, 2)        # still one head a rank: replicated, not split


def test_a_plan_changed_by_its_caller_does_not_change_the_next_search():
    """search answers a repeated question from its cache: each caller gets plans of its own, so one that edits
    what it got (a notebook, a table builder) cannot change the next caller's answer."""
    question = (planner.MODELS["1b"], planner.CLUSTERS["a100-80gb"], 8)
    first = planner.search(*question)
    assert first[0].fits
    first[0].problems.append("edited by the caller")
    first[0].exposed_seconds["dp"] = 99.0
    again = planner.search(*question)
    assert again[0].fits and again[0].exposed_seconds.get("dp") != 99.0


def test_the_experts_fsdp_reduction_under_pp_is_exposed_too():
    """torch runs an expert's reduce-scatters in the same REDUCE_GRAD as the other parameters (the experts are
    parameters of the stage's FSDP units): under PP nothing hides them either."""
    spec = planner.MODELS["mixtral-8x7b"]
    cluster = planner.CLUSTERS["h100-80gb"]
    layout = planner.Layout(tp=2, pp=4, dp=8, zero_stage=3, ep=2)
    after, during = (planner.stage_time(spec, cluster, layout, 1, planner.Options(
        zero_stage=3, pp_fsdp_grad_sync=mode)) for mode in ("after_backward", "last_backward"))
    total = after["seconds"]["expert_dp"]["total"]
    assert total > 0 and after["exposed"]["expert_dp"] == pytest.approx(total)
    assert during["exposed"]["expert_dp"] < total


def test_zero2s_reduce_scatters_hide_behind_each_microbatchs_backward():
    """ZeRO-2 reduce-scatters after every microbatch (DeepSpeed stage_1_and_2.py:1767-1768: partition_gradients),
    from the backward hooks of that microbatch: each hides behind its own microbatch's backward, not all M behind
    the last one. 7B on one 8-GPU H100 node, 8 microbatches of one 4,096-token sequence: one reduce-scatter of the
    fp32 gradients moves 7/8 x 4 B x N over NVLink; one microbatch's backward does at least 4 N x 4,096 FLOPs
    (two matmuls a weight, 2 FLOPs a multiply-add) even at the full dense peak. By hand, the first is shorter."""
    spec, layout = replace(planner.MODELS["7b"], global_batch=64), planner.Layout(dp=8, zero_stage=2)
    cluster = planner.CLUSTERS["h100-80gb"]
    options = planner.Options(activation_checkpointing="none")   # the spec's micro-batch: 1
    n = planner.stage_params(spec, layout, 0)["total"]
    one_reduce_scatter = 7 / 8 * 4 * n / cluster.intra_node_bytes_per_s + 7 * 3.4e-6
    one_backward_at_least = 4 * n * spec.seq_len / cluster.peak_flops
    assert 8 * one_reduce_scatter > one_backward_at_least > one_reduce_scatter
    from distlab.planner import step_time

    exposed = step_time.stage_time(spec, cluster, layout, 0, options)["exposed"]["dp"]
    assert exposed == pytest.approx(0.0, abs=1e-3)


def test_one_chunk_a_rank_needs_as_many_microbatches_as_stages():
    """torch's Schedule1F1B refuses M < P (pipelining/schedules.py:1020-1024): the planner never proposes it."""
    spec, h100 = planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"]
    spec = replace(spec, global_batch=32)
    layout = planner.Layout(tp=8, pp=8, dp=8, zero_stage=1)          # M = 32 / 8 = 4 < P = 8
    problems = planner.layout_problems(spec, h100, layout, 512, planner.Options(chunks=1))
    assert any("1F1B needs at least as many microbatches" in p for p in problems)
    assert not planner.layout_problems(spec, h100, layout, 512, planner.Options(chunks=2))
    small = replace(planner.MODELS["7b"], global_batch=16)
    plans = planner.search(small, h100, 64)
    tuned = [p for p in plans if p.settings]
    assert tuned and not [p for p in tuned if p.layout.pp > 1 and p.settings.get("chunks", 1) == 1
                          and small.global_batch // (p.layout.dp * p.settings["micro_batch"]) < p.layout.pp]
