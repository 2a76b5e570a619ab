"""The planner with mixture-of-experts models (chapter 13): counts against published sizes, EP's state, bytes and
links against independent counts, the full-world EP dry run (and a planner bug it catches), chapter 13's table."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from coursetools import chapters
from distlab import memory as course_memory
from distlab import moe, planner
from distlab.planner import dry_run
from distlab.planner.communication import all_to_all_seconds, comm_per_step, crosses_nodes

DEEPSEEK, H800, LAYOUT = planner.DEEPSEEK_V3, planner.H800, planner.DEEPSEEK_V3_LAYOUT
MIXTRAL, H100 = planner.MODELS["mixtral-8x7b"], planner.CLUSTERS["h100-80gb"]


def test_deepseek_v3_counts_are_its_published_sizes():
    """671 B stored, 37 B used per token (its abstract): the planner's count of its config.json shape."""
    assert math.isclose(DEEPSEEK.num_params(), 671e9, rel_tol=1e-3)
    assert math.isclose(DEEPSEEK.active_params(), 37e9, rel_tol=0.02)
    # a dense reading of the same shape (every expert active) would be 18 times the compute
    assert DEEPSEEK.num_params() / DEEPSEEK.active_params() > 17


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def meta_moe_count(spec, mla: dict | None = None) -> int:
    """A MoE decoder written from its published description, built block by block on the meta device (one dense
    block and one MoE block, counted and multiplied: 58 x 256 experts would be 45,000 modules): attention (grouped
    query, or MLA's matrices from ``mla``), two RMSNorms, a SwiGLU, or a router, routed experts and shared ones."""
    from torch import nn

    def swiglu(width):
        return nn.ModuleList(nn.Linear(spec.hidden, width, bias=False) for _ in range(2)).append(
            nn.Linear(width, spec.hidden, bias=False))

    def attention():
        if mla:
            return nn.ModuleList([nn.Linear(spec.hidden, mla["q_lora"], bias=False), nn.RMSNorm(mla["q_lora"]),
                                  nn.Linear(mla["q_lora"], spec.heads * (mla["nope"] + mla["rope"]), bias=False),
                                  nn.Linear(spec.hidden, mla["kv_lora"] + mla["rope"], bias=False),
                                  nn.RMSNorm(mla["kv_lora"]),
                                  nn.Linear(mla["kv_lora"], spec.heads * (mla["nope"] + mla["v"]), bias=False),
                                  nn.Linear(spec.heads * mla["v"], spec.hidden, bias=False)])
        kv = spec.kv_heads * spec.hidden // spec.heads
        return nn.ModuleList([nn.Linear(spec.hidden, spec.hidden, bias=False), nn.Linear(spec.hidden, kv, bias=False),
                              nn.Linear(spec.hidden, kv, bias=False), nn.Linear(spec.hidden, spec.hidden, bias=False)])

    with torch.device("meta"):
        norms = _count(nn.ModuleList([nn.RMSNorm(spec.hidden), nn.RMSNorm(spec.hidden)]))
        dense = _count(attention()) + norms + _count(swiglu(spec.ffn))
        moe_block = (_count(attention()) + norms + _count(nn.Linear(spec.hidden, spec.experts, bias=False))
                     + (spec.experts + spec.shared_experts) * _count(swiglu(spec.expert_ffn)))
        ends = _count(nn.Embedding(spec.vocab, spec.hidden)) + _count(nn.RMSNorm(spec.hidden)) + _count(
            nn.Linear(spec.hidden, spec.vocab, bias=False))
    return ends + spec.dense_layers * dense + (spec.layers - spec.dense_layers) * moe_block


def test_moe_counts_equal_models_built_on_the_meta_device():
    mla = {"q_lora": 1536, "kv_lora": 512, "nope": 128, "rope": 64, "v": 128}   # DeepSeek-V3's config.json
    assert DEEPSEEK.num_params() == meta_moe_count(DEEPSEEK, mla)
    assert MIXTRAL.num_params() == meta_moe_count(MIXTRAL)


def test_mla_attention_is_what_its_matrices_hold():
    """Multi-head latent attention, counted matrix by matrix from DeepSeek-V3's config.json."""
    h, heads = 7168, 128
    matrices = [h * 1536, 1536 * heads * 192, h * (512 + 64), 512 * heads * (128 + 128), heads * 128 * h]
    norms = 1536 + 512
    assert planner.mla_attention_params(h, heads, 1536, 512, 128, 64, 128) == sum(matrices) + norms


def test_dense_layers_come_first_and_moe_blocks_fill_the_rest():
    kinds = [planner.stage_layer_kinds(DEEPSEEK, 16, s) for s in range(16)]
    assert kinds[0] == (3, 1) and kinds[1] == (0, 4) and kinds[-1] == (0, 3)
    assert sum(d for d, _ in kinds) == 3 and sum(m for _, m in kinds) == 58
    assert planner.stage_layer_kinds(planner.MODELS["7b"], 4, 0) == (8, 0)   # dense models: every block dense


def test_flops_follow_the_active_parameters():
    dense_reading = replace(DEEPSEEK, top_k=DEEPSEEK.experts)
    assert DEEPSEEK.flops_per_token() < dense_reading.flops_per_token() / 10
    assert DEEPSEEK.matmul_params() == DEEPSEEK.active_params() - DEEPSEEK.vocab * DEEPSEEK.hidden


def test_latent_attentions_flops_count_its_own_head_widths():
    """DeepSeek-V3's attention scores with 192 numbers a head (128 + a rotary 64) and mixes values of 128, over 128
    heads, while hidden / heads is 56: counted as a dense model's 12 h s it would be 2.9 times too few."""
    s, heads, layers = DEEPSEEK.seq_len, 128, 61
    by_hand = 3 * (2 * s * heads * 192 + 2 * s * heads * 128)   # forward q k^T and p v, backward twice that
    assert DEEPSEEK.attention_flops_per_token() == by_hand
    assert by_hand / (12 * 7168 * s) == pytest.approx(2.857, abs=1e-3)
    assert DEEPSEEK.flops_per_token() == 6 * DEEPSEEK.matmul_params() + layers * by_hand
    assert DEEPSEEK.flops_per_token() / 1e9 == pytest.approx(281.2, abs=0.1)   # the "about 281 G"
    llama = planner.MODELS["405b"]   # standard heads: the familiar 12 h s
    assert llama.attention_flops_per_token() == 12 * llama.hidden * llama.seq_len


def test_node_limited_dispatch_sends_one_copy_a_node_over_the_network_then_nvlink():
    """DeepSeek-V3's dispatch (its report, section 3.2.2): EP 64 over 8 nodes of 8, a token to at most 4 nodes, its
    own node among them half the time (4 of 8): 3.5 network copies, not the 8 x 56/64 = 7 of copies sent straight
    to their experts; in the node, forwarded over NVLink to 8 x 7/8 GPUs. FP8 dispatch (a scale per 128 values),
    bf16 combine, forward and backward (and forward again under full recomputation)."""
    options = planner.DEEPSEEK_V3_OPTIONS
    assert planner.ep_copies_per_token(DEEPSEEK, LAYOUT, options, 8) == {"network": 3.5, "nvlink": 7.0}
    tokens, micro, blocks = 4096, planner.microbatches(DEEPSEEK, LAYOUT), 4
    per_element = 2 * ((1 + 4 / 128) + 2)   # forward and backward, each a dispatch-like and a combine-like
    sent = comm_per_step(DEEPSEEK, LAYOUT, 1, replace(options, activation_checkpointing="none"), 8)["ep"]
    assert sent["all_to_all_network"] == pytest.approx(tokens * 3.5 * 7168 * per_element * blocks * micro)
    assert sent["all_to_all_nvlink"] == pytest.approx(tokens * 7.0 * 7168 * per_element * blocks * micro)
    # a limit above the group's nodes limits nothing: every other node of the group, (n - 1) copies
    assert planner.ep_copies_per_token(DEEPSEEK, replace(LAYOUT, ep=16), options, 8)["network"] == pytest.approx(1)
    with pytest.raises(ValueError, match="GPUs per node"):
        planner.ep_copies_per_token(DEEPSEEK, LAYOUT, options)
    # the time: both links at once, the slower sets it
    links = all_to_all_seconds(LAYOUT, H800, sent, 10)
    assert links["bandwidth"] == pytest.approx(max(sent["all_to_all_network"] / 50e9, sent["all_to_all_nvlink"] / 160e9))


def test_experts_state_is_sharded_over_ep_and_their_zero_over_the_ranks_holding_them():
    stage = 1   # four MoE blocks
    params = planner.stage_params(DEEPSEEK, LAYOUT, stage)
    assert params["experts"] == 4 * 256 // 64 * 3 * 7168 * 2048
    state = planner.state_bytes(DEEPSEEK, LAYOUT, stage)
    shared = course_memory.zero_state_bytes(params["total"] - params["experts"], 128, 1)
    experts = course_memory.zero_state_bytes(params["experts"], 2, 1)
    # ZeRO-1 as Megatron's distributed optimizer: its gradients fp32, twice the ZeRO paper's bf16 ones
    assert state.total == pytest.approx(shared.total + experts.total + shared.grads + experts.grads)
    # EP 32 holds twice the experts a rank, their optimizer state over 4 ranks instead of 2: the same per rank
    half = replace(LAYOUT, ep=32)
    assert planner.stage_params(DEEPSEEK, half, stage)["experts"] == 2 * params["experts"]


def test_the_all_to_all_bytes_of_a_step():
    options = planner.Options(activation_checkpointing="none")
    micro = planner.microbatches(DEEPSEEK, LAYOUT)
    one = moe.dispatch_bytes(4096, 8, 7168, 2, 63 / 64)
    assert comm_per_step(DEEPSEEK, LAYOUT, 1, options)["ep"]["all_to_all_any"] == pytest.approx(4 * 4 * micro * one)
    full = planner.Options(activation_checkpointing="full")
    assert comm_per_step(DEEPSEEK, LAYOUT, 1, full)["ep"]["all_to_all_any"] == pytest.approx(6 * 4 * micro * one)
    # under TP each rank routes 1/tp of the tokens (the bytes a rank sends halve with TP 2) to experts spread over
    # the EP group's 64 ranks, 32 dp ranks x their 2 tp ranks (torchtitan's ep = 64, expert TP off; chapter 13's
    # --tp script)
    tp2 = replace(LAYOUT, tp=2, dp=64, ep=64)
    assert tp2.ep_group == 64 and tp2.ep_dp == 32 and planner.stage_params(DEEPSEEK, tp2, 1)["experts"] == planner.stage_params(
        DEEPSEEK, LAYOUT, 1)["experts"]
    assert comm_per_step(DEEPSEEK, tp2, 1, options)["ep"]["all_to_all_any"] == pytest.approx(
        4 * 4 * planner.microbatches(DEEPSEEK, tp2) * moe.dispatch_bytes(2048, 8, 7168, 2, 63 / 64))


def test_experts_split_over_the_ep_groups_ranks_and_over_tp_alone_by_width():
    mixtral = planner.MODELS["mixtral-8x7b"]
    assert planner.layout_problems(mixtral, H800, planner.Layout(tp=4, dp=4, ep=16)) == \
        ["8 experts do not split over EP 16"]
    assert planner.layout_problems(mixtral, H800, planner.Layout(tp=2, dp=4, ep=8)) == []
    # torchtitan's rule: EP borrows every tp (and cp) rank, so ep is a multiple of cp x tp dividing dp x cp x tp
    assert planner.layout_problems(mixtral, H800, planner.Layout(tp=2, dp=4, ep=4)) == []
    assert any("must be a multiple of cp x tp = 2" in p
               for p in planner.layout_problems(mixtral, H800, planner.Layout(tp=2, dp=4, ep=3)))
    assert any("divides dp x cp x tp = 6" in p
               for p in planner.layout_problems(mixtral, H800, planner.Layout(tp=2, dp=3, ep=4)))
    assert planner.layout_problems(mixtral, H800, planner.Layout(tp=8, dp=1)) == []   # each expert's width / 8
    assert [layout.ep for layout in planner.candidate_layouts(mixtral, H800, 16, planner.Options(zero_stage=1))
            if layout.tp == 2 and layout.pp == 1 and layout.cp == 1] == [1, 2, 4, 8]


def test_the_all_to_all_crosses_nvlink_and_the_network_by_where_the_ep_ranks_are():
    inside = replace(LAYOUT, ep=8)
    assert not crosses_nodes(inside, "ep", H800) and crosses_nodes(LAYOUT, "ep", H800)
    assert crosses_nodes(LAYOUT, "expert_dp", H800) and not crosses_nodes(replace(LAYOUT, ep=128), "expert_dp", H800)
    one_node = all_to_all_seconds(inside, H800, 7e9, 10)
    assert one_node["inter_node_bytes"] == 0 and one_node["bandwidth"] == pytest.approx(7e9 / 160e9)
    eight = all_to_all_seconds(LAYOUT, H800, 63e9, 10)
    assert eight["inter_node_bytes"] == pytest.approx(56e9) and eight["intra_node_bytes"] == pytest.approx(7e9)
    assert eight["bandwidth"] == pytest.approx(56e9 / 50e9)   # the network is the slower of the two
    # TP 2 beside EP 16: a group of 16 ranks, 8 of them (4 dp ranks x their 2 tp ranks) in each node of 8
    tp2 = replace(LAYOUT, tp=2, dp=64, ep=16)
    assert tp2.ep_group == 16 and tp2.ep_dp == 8 and crosses_nodes(tp2, "ep", H800)
    split = all_to_all_seconds(tp2, H800, 15e9, 10)
    assert split["intra_node_bytes"] == pytest.approx(7e9) and split["inter_node_bytes"] == pytest.approx(8e9)


def test_the_published_layout_fits_and_the_heaviest_moe_stage_sets_the_step():
    plan = planner.tune(DEEPSEEK, H800, LAYOUT, planner.Options(ep_overlap=True))
    assert plan.fits
    options = planner.Options(activation_checkpointing=plan.settings["checkpointing"], chunks=plan.settings["chunks"],
                              ep_overlap=True)
    middle = planner.stage_time(DEEPSEEK, H800, LAYOUT, 1, options)
    assert plan.step_seconds >= middle["compute"] + sum(middle["exposed"].values())
    hidden, exposed = plan.exposed_seconds["ep"], planner.tune(DEEPSEEK, H800, LAYOUT).exposed_seconds["ep"]
    assert hidden < exposed


@pytest.mark.parametrize("layout,needle", [
    (planner.Layout(dp=128, pp=16, ep=48), "256 experts do not split over EP 48"),
    (planner.Layout(dp=96, pp=16, ep=64, zero_stage=1), "EP 64 must be a multiple of cp x tp = 1 that divides dp x cp x tp = 96"),
])
def test_bad_ep_layouts_are_named(layout, needle):
    gpus = layout.gpus
    assert any(needle in p for p in planner.layout_problems(DEEPSEEK, H800, layout, gpus))


def test_ep_on_a_dense_model_and_beside_hsdp_are_refused():
    dense = planner.layout_problems(planner.MODELS["7b"], H100, planner.Layout(dp=8, ep=2), 8)
    assert any("needs a mixture-of-experts model" in p for p in dense)
    hsdp = planner.layout_problems(MIXTRAL, H100, planner.Layout(dp=16, ep=2, zero_stage=3, shard=8), 16)
    assert any("EP beside HSDP" in p for p in hsdp)
    assert planner.parse_layout("tp=1,pp=16,dp=128,zero=1,ep=64") == LAYOUT
    assert LAYOUT.label() == "tp=1,pp=16,dp=128,zero=1,ep=64"


def test_the_search_tries_ep_and_finds_it_worth_it_for_mixtral():
    plans = [p for p in planner.search(MIXTRAL, H100, 64) if p.fits]
    assert plans[0].layout.ep > 1 and any(p.layout.ep == 1 for p in plans)


# ---- the full-world dry run ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,layout,cluster", [
    (DEEPSEEK, LAYOUT, H800),
    (MIXTRAL, planner.Layout(tp=1, pp=2, dp=32, zero_stage=3, ep=8), H100),
    # TP beside EP: the all-to-all over ep = 16 ranks (8 dp ranks x their 2 tp ranks), 8 of them in each node of 8
    (DEEPSEEK, planner.Layout(tp=2, pp=16, dp=64, zero_stage=1, ep=16), H800),
])
def test_the_ep_layout_built_at_full_world_size_equals_the_planner(spec, layout, cluster):
    result = dry_run.dry_run_experts(spec, layout, cluster)
    assert result["equal"], dry_run.dry_run_experts_markdown(result)
    assert result["world"] == layout.gpus and len(result["ranks"]) >= 2


def test_the_dry_run_fails_a_planner_that_forgets_ep(monkeypatch):
    import importlib

    planner_memory = importlib.import_module("distlab.planner.memory")

    real = planner_memory.stage_params.__wrapped__

    def experts_not_split(model, layout, stage):
        params = dict(real(model, layout, stage))
        params["experts"] *= layout.expert_shards
        return params

    monkeypatch.setattr(planner_memory, "stage_params", experts_not_split)
    assert not dry_run.dry_run_experts(DEEPSEEK, LAYOUT, H800)["equal"]


def test_the_dry_run_fails_an_ep_group_strided_across_the_data_parallel_ranks(monkeypatch):
    def strided(layout):   # ep outermost: an EP group of ranks 16 apart, not the planner's consecutive ones
        return ("ep_dp", "pp", "expert_dp", "cp", "tp"), (layout.ep_dp, layout.pp, layout.dp // layout.ep_dp,
                                                          layout.cp, layout.tp)

    monkeypatch.setattr(dry_run, "expert_mesh_shape", strided)
    assert not dry_run.dry_run_experts(MIXTRAL, planner.Layout(tp=1, pp=2, dp=32, zero_stage=3, ep=8), H100)["equal"]


# ---- chapter 13 ----------------------------------------------------------------------------------------------


def test_chapter_13_pastes_the_planners_table_and_its_numbers():
    text = chapters.text("13")   # every page of the chapter
    numbers = planner.moe_at_scale()
    assert planner.moe_at_scale_markdown(numbers) in text, planner.moe_at_scale_markdown(numbers)
    flat = " ".join(text.split())
    assert f"{numbers['tokens_per_gpu_hidden']:,.0f} tokens/s a GPU against the measured 1,543" in flat
    worth = numbers["tokens_per_gpu_hidden"] / numbers["tokens_per_gpu_exposed"] - 1
    assert f"would run at {numbers['tokens_per_gpu_exposed']:,.0f}: hiding them is worth {worth:.0%}" in flat
    assert f"37.6 B against \"37 B\"" in flat and numbers["fits"]
    assert "EP groups span 8 nodes of 8 ranks" in flat and "(4 of 256 a block)" in flat
    gap = numbers["tokens_per_gpu_hidden"] / numbers["tokens_per_gpu_published"] - 1
    assert f"against the measured 1,543 ({gap:.0%})" in flat
    assert f"{numbers['compute_to_all_to_all']:.1f} : 1 in the planner" in flat
    assert f"the planner predicts {numbers['mixtral_mapping_mfu']:.1%}" in flat and numbers["mixtral_mapping_fits"]
    assert f"(MCore v0.9, {numbers['mixtral_published_mfu']:.1%} of the H100's bf16 peak, if" in flat
    assert f"about {numbers['mixtral_mapping_mfu'] / numbers['mixtral_published_mfu'] - 1:+.0%}" in flat
    # the body's conclusion (page 13.2): the hidden all-to-alls' gap to the measured, and the busiest stage's times
    assert f"leave the planner's {numbers['tokens_per_gpu_hidden']:,.0f} tokens/s a GPU within {-gap:.0%} of the " \
           f"measured 1,543" in flat
    assert f"take {numbers['all_to_all_s']:.1f} s against {numbers['compute_s']:.1f} s of compute" in flat
    # the body says why the planner's and the published columns differ (the sources are in How we know)
    assert (f"So its compute : all-to-all ratio, {numbers['compute_to_all_to_all']:.1f} : 1, is above the report's "
            f"1 : 1") in flat and numbers["compute_to_all_to_all"] > 1
    assert (f"so its {numbers['mixtral_mapping_mfu']:.1%} is above the published "
            f"{numbers['mixtral_published_mfu']:.1%}") in flat
    assert numbers["mixtral_mapping_mfu"] > numbers["mixtral_published_mfu"]


def test_the_dry_run_fails_a_planner_whose_ep_group_leaves_tp_out(monkeypatch):
    """With TP beside EP the all-to-all group is ep ranks, every tp rank in it (torchtitan's convention): a planner
    that read ep as dp ranks and left TP out would see a group of 2 where the mesh builds one of 4 (all in one
    node), and send over the wrong share."""
    layout = planner.Layout(tp=2, pp=16, dp=64, zero_stage=1, ep=4)
    assert dry_run.dry_run_experts(DEEPSEEK, layout, H800)["equal"]
    monkeypatch.setattr(planner.Layout, "ep_group", property(lambda self: self.ep // self.tp))
    result = dry_run.dry_run_experts(DEEPSEEK, layout, H800)
    assert not result["equal"]
    assert {(r["ep_ranks_per_node"], r["planner_ep_ranks_per_node"]) for r in result["ranks"]} == {(4, 2)}
