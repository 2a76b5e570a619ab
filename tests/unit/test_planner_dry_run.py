"""The planner at the full world size: the chosen layout's real model built for a rank of the first, a middle and
the last pipeline stage on a fake process group, in one process on the meta device, its shards' bytes against the planner's state bytes."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from distlab import models, planner
from distlab.planner import dry_run


def test_llama3_405b_on_16384_ranks_equals_the_planner_in_seconds():
    run = planner.published.RUNS[1]
    assert run.layout.gpus == 16384 and (run.layout.tp, run.layout.pp, run.layout.dp) == (8, 16, 128)
    start = time.process_time()   # CPU seconds (about 8 here): make test's loaded cores stretch the wall clock
    result = dry_run.dry_run(run.model, run.layout, run.options)
    assert time.process_time() - start < 30
    assert result["mesh_ok"] and result["equal"] and result["world"] == 16384
    stages = {r["stage"] for r in result["ranks"]}
    assert {0, 15} <= stages and len(stages) >= 3  # the first, a middle and the last stage
    first = next(r for r in result["ranks"] if r["stage"] == 0)
    # FSDP's shards: the planner's bytes plus FSDP2's ceil-split padding, named
    assert first["measured"]["params"] == first["planner"]["params"] + first["padding_bytes"]["params"]
    # the ceil split of FSDP2 named, not hidden: the last data-parallel rank holds less than 1/dp
    last = max(result["ranks"], key=lambda r: r["rank"])
    assert last["padding_bytes"]["optimizer"] < 0 < first["padding_bytes"]["optimizer"]


@pytest.mark.parametrize("run", planner.published.RUNS, ids=lambda run: run.label)
def test_every_layout_of_the_validation_table_dry_runs(run):
    result = dry_run.dry_run_published(run)
    assert result["mesh_ok"] and result["equal"], dry_run.dry_run_markdown(result)
    assert result["stand_in"] == (run.model.architecture == "gpt")


def test_uneven_shards_are_named_as_padding():
    spec = replace(planner.MODELS["7b"], global_batch=3)
    layout = planner.Layout(dp=3, zero_stage=3)  # 32000 x 4096 embedding rows over 3: a ceil split
    result = dry_run.dry_run(spec, layout, planner.Options(activation_checkpointing="full"))
    assert result["equal"]
    pads = [sum(r["padding_bytes"].values()) for r in result["ranks"]]
    assert any(p != 0 for p in pads)


def test_the_comparison_fails_when_the_planner_or_the_build_is_wrong(monkeypatch):
    run = planner.published.RUNS[1]
    real = dry_run.state_bytes

    def forgets_the_norms(spec, layout, stage, options):  # a planner that drops the blocks' norm weights
        right = real(spec, layout, stage, options)
        norms = 2 * planner.stage_layers(spec.layers, layout.pp, stage) * spec.hidden * 2  # two a block, bf16
        return replace(right, params=right.params - norms)

    monkeypatch.setattr(dry_run, "state_bytes", forgets_the_norms)
    assert not dry_run.dry_run_rank(run.model, run.layout, run.options, 0)["equal"]
    monkeypatch.setattr(dry_run, "state_bytes", real)
    assert dry_run.dry_run_rank(run.model, run.layout, run.options, 0)["equal"]
    # a planner asked about another layout (half the data-parallel ranks) than the one built
    monkeypatch.setattr(dry_run, "state_bytes",
                        lambda spec, layout, stage, options: real(spec, replace(layout, dp=64), stage, options))
    assert not dry_run.dry_run_rank(run.model, run.layout, run.options, 0)["equal"]


def test_a_gpt_model_is_refused_by_name_and_the_course_model_has_grouped_query_attention():
    with pytest.raises(ValueError, match="LLaMA-style"):
        dry_run.course_config(planner.MODELS["gpt3-175b"])
    cfg = dry_run.course_config(planner.MODELS["405b"])
    assert cfg.n_kv_heads == 8 and cfg.kv_dim == 1024
    import torch

    small = models.TransformerConfig(n_kv_heads=2)  # 4 query heads share 2 key/value heads
    model = models.Transformer(small)
    assert models.count_params(model) == small.num_params()
    assert model.layers["0"].attention.wk.weight.shape == (small.kv_dim, small.dim)
    assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, small.vocab_size)


# ---- one step's collectives at the full world size, on a narrow copy of the model ----------------------------

COUNTED_RUNS = [planner.published.RUNS[i] for i in (1, 3, 7, 9)]  # 405B; MT-NLG, 1T (GPT stand-ins); 22B, dp 1


@pytest.mark.parametrize("run", COUNTED_RUNS, ids=lambda run: run.label)
def test_a_step_counted_at_the_full_world_size_equals_the_planners_collectives(run):
    spec = dry_run.stand_in(run.model)
    result = dry_run.count_step(spec, run.layout)
    assert result["equal"], dry_run.count_step_markdown(result)
    assert result["world"] == run.layout.gpus
    narrow = dry_run.narrow_spec(spec, run.layout)
    for r in result["ranks"]:
        layers = planner.stage_layers(spec.layers, run.layout.pp, r["stage"])
        first, last = r["stage"] == 0, r["stage"] == run.layout.pp - 1
        # counted, not copied: 4 all-reduces a block, the embedding's 1, the head's 1 and loss_parallel's 3
        assert r["counted"]["tp"]["all_reduce"]["calls"] == 4 * layers + first + 4 * last
        activation = narrow.seq_len * narrow.hidden * 4
        assert r["counted"]["tp"]["all_reduce"]["payload"] == (4 * layers + first + last) * activation \
            + 3 * last * narrow.seq_len * 4
        if run.layout.dp > 1:  # one gather and one reduce-scatter a FSDP unit: the blocks and the root
            assert r["counted"]["dp"]["all_gather"]["calls"] == layers + (first or last)
        else:
            assert "dp" not in r["counted"]


def test_the_counted_step_fails_a_planner_that_counts_wrong(monkeypatch):
    from distlab.planner import communication

    run = planner.published.RUNS[1]
    real = communication.ledger

    def buckets(model, layout, stage, options):  # FSDP's traffic as ZeRO-1/2's: the same bytes, in buckets
        return real(model, replace(layout, zero_stage=2), stage, options)

    def forgets_the_embedding(model, layout, stage, options):
        result = real(model, layout, stage, options)
        reduce = dict(result["tp"]["all_reduce"])
        reduce["calls"] -= 1 if stage == 0 else 0
        return {**result, "tp": {**result["tp"], "all_reduce": reduce}}

    for wrong in (buckets, forgets_the_embedding):
        monkeypatch.setattr(communication, "ledger", wrong)
        assert not dry_run.count_step(run.model, run.layout, ranks=[0])["equal"], wrong.__name__
    monkeypatch.setattr(communication, "ledger", real)
    assert dry_run.count_step(run.model, run.layout, ranks=[0])["equal"]


# ---- HSDP (shard inside a node, replicate across) and pp = 1 at the full world size ----------------------------

HSDP_70B = planner.Layout(tp=2, pp=8, dp=256, zero_stage=3, shard=2)   # 4,096 A100s: shard = a node's dp ranks


def test_hsdp_builds_at_the_full_world_size_and_equals_the_planner():
    """FSDP2 on a (replicate, dp) mesh at 4,096 fake ranks: the mesh's groups are the grid's (replicate strided,
    the shard group consecutive, inside a node), each rank holds 1/shard of its TP shards (state = the planner's),
    and one step issues FSDP's gathers and reduce-scatters in the shard group and an all-reduce a unit across the
    replicas, each = the planner's ledger."""
    spec = planner.MODELS["70b"]
    result = dry_run.dry_run(spec, HSDP_70B, planner.Options())
    assert result["mesh_ok"] and result["equal"] and result["world"] == 4096
    counted = dry_run.count_step(spec, HSDP_70B)
    assert counted["equal"], dry_run.count_step_markdown(counted)
    for r in counted["ranks"]:
        units = planner.stage_layers(spec.layers, 8, r["stage"]) + (r["stage"] in (0, 7))
        assert r["counted"]["replicate"]["all_reduce"]["calls"] == units
        # the all-reduce carries the reduced gradient shard: 1/shard of the reduce-scatter's payload
        assert r["counted"]["replicate"]["all_reduce"]["payload"] * 2 == r["counted"]["dp"]["reduce_scatter"]["payload"]


def test_the_hsdp_comparison_fails_a_planner_without_the_replicas(monkeypatch):
    from distlab.planner import communication

    spec, real = planner.MODELS["70b"], communication.ledger

    def no_replicas(model, layout, stage, options):   # HSDP priced as FSDP over the shard group alone
        return {**real(model, layout, stage, options), "replicate": {}}

    monkeypatch.setattr(communication, "ledger", no_replicas)
    assert not dry_run.count_step(spec, HSDP_70B, ranks=[0])["equal"]


def test_a_single_stage_has_one_root_unit():
    """With pp = 1 the root holds the embedding and the head: one FSDP unit, not two (the planner counted two
    until the counted step showed 33 gathers for 7B's 32 blocks)."""
    spec = planner.MODELS["7b"]
    layout = planner.Layout(tp=1, pp=1, dp=64, zero_stage=3)
    result = dry_run.count_step(spec, layout, ranks=[0])
    assert result["equal"], dry_run.count_step_markdown(result)
    assert result["ranks"][0]["counted"]["dp"]["all_gather"]["calls"] == spec.layers + 1
