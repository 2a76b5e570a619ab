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


@pytest.mark.parametrize("name", list(planner.MODELS))
def test_parameter_count_equals_the_model_built_on_the_meta_device(name):
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
def test_memory_equals_the_sizing_guide(name, sequence_parallel):
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
        # the one difference: sizing divides a unit's norm weights by TP too; the planner keeps them whole
        # (replicated). At most two norms of (2 + 2 + 4) bytes per number in a unit: kilobytes of gigabytes
        norm_rounding = 2 * 8 * spec.hidden
        assert 0 <= m["temporary"] - guide.fsdp_unit <= norm_rounding
        assert m["activations"] == pytest.approx(guide.activations, rel=1e-12)
        assert abs(m["total"] - guide.total) <= norm_rounding and plan.fits == guide.fits


def test_fewest_nodes_equal_the_sizing_guide():
    cluster = planner.CLUSTERS["a100-40gb"]
    for name in sizing.LLAMA_SHAPES:
        nodes = sizing.min_nodes(name)
        spec = planner.MODELS[name.lower()]
        fits = [planner.evaluate(replace(spec, global_batch=n), cluster, planner.Layout(tp=4, dp=n, zero_stage=3),
                                 planner.Options(zero_stage=3)).fits for n in (nodes - 1, nodes) if n >= 1]
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


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_activations_in_flight_equal_the_schedules_peaks(schedule, chunks):
    for pp, num_micro in ((2, 2), (4, 8), (4, 3), (8, 16)):
        if schedule == "interleaved_1f1b" and num_micro % pp:
            continue
        peaks = schedules.peak_activations(schedules.build(schedule, pp, num_micro, chunks))
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
    assert parts[1]["optimizer"] == pytest.approx(parts[0]["optimizer"] / 8)
    assert parts[2]["grads"] == pytest.approx(parts[1]["grads"] / 8) and parts[2]["params"] == parts[1]["params"]
    assert parts[3]["params"] == pytest.approx(parts[2]["params"] / 8)


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
    assert not any(p.fits for p in plans if p.layout.cp == 1)  # the decision path's "nothing without CP fits"
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


def test_the_long_context_layout_of_llama3_needs_what_its_8k_layout_needs():
    rows = {r["claim"]: r for r in planner.published_table()}
    short, long = (next(r for claim, r in rows.items() if claim.startswith(start))
                   for start in ("LLaMA 3 405B on 16K", "LLaMA 3 405B, 128K"))
    assert long["fits"] and long["rank"] <= 10 and "cp=16" in long["layout"]
    assert long["gib_per_gpu"] == pytest.approx(short["gib_per_gpu"], rel=1e-12)


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
