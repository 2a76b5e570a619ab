"""distlab.hybrid_pipeline: the formulas of the pipeline hybrids (chapter 09) against independent counts, and the
--config files of the reference layouts."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from distlab import hybrid, hybrid_pipeline, models, tensor_parallel
from distlab.comm import CollectiveCall

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "scripts" / "09_hybrid_parallel" / "configs"
sys.path.insert(0, str(REPO / "scripts" / "07_pipeline_parallel"))
from common_pipeline import CHOICES, stage_indices, transformer_stage  # noqa: E402


# ---- what must divide what -----------------------------------------------------------------------------------

def test_split_problems_name_layers_and_batch():
    assert hybrid_pipeline.pipeline_split_problems(layers=8, pp=2, stages_per_rank=2, batch=16, dp=2,
                                                   microbatches=4) == []
    layers, = hybrid_pipeline.pipeline_split_problems(layers=6, pp=2, stages_per_rank=2, batch=16, dp=2,
                                                      microbatches=4)
    assert "6 layers do not split into pp x stages-per-rank = 2 x 2 = 4" in layers
    batch, = hybrid_pipeline.pipeline_split_problems(layers=4, pp=2, stages_per_rank=1, batch=12, dp=2,
                                                     microbatches=4)
    assert "--batch 12 does not split over dp x microbatches = 2 x 4 = 8" in batch
    # a batch smaller than dp x M is refused too (0 rows per microbatch), even when 0 divides
    assert hybrid_pipeline.pipeline_split_problems(layers=4, pp=2, stages_per_rank=1, batch=0, dp=2,
                                                   microbatches=4)


# ---- parameters of a stage -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_stage_param_count_equals_the_stage_modules(num_stages):
    cfg = models.preset("tiny", n_layers=4)
    full = models.build_transformer(cfg)
    counted = [models.count_params(transformer_stage(full, s, num_stages)) for s in range(num_stages)]
    formula = [hybrid_pipeline.stage_param_count(cfg, s, num_stages)["total"] for s in range(num_stages)]
    assert formula == counted
    assert sum(formula) == cfg.num_params()


@pytest.mark.parametrize("tp", [2, 4])
def test_stage_param_count_under_tp_adds_up_to_the_tp_formula(tp):
    cfg = models.preset("tiny", n_layers=4)
    per_stage = [hybrid_pipeline.stage_param_count(cfg, s, 2, tp) for s in range(2)]
    assert sum(p["total"] for p in per_stage) == tensor_parallel.tp_param_count_per_rank(cfg, tp)["total"]


# ---- bytes ---------------------------------------------------------------------------------------------------

def test_gradient_sync_per_microbatch_costs_m_times_once():
    once = hybrid_pipeline.dp_gradient_sync_bytes(1000, 8, "fsdp", every_microbatch=False)
    every = hybrid_pipeline.dp_gradient_sync_bytes(1000, 8, "fsdp", every_microbatch=True)
    assert once == {"all_gather": 4000, "reduce_scatter": 4000}
    assert every == {"all_gather": 4000, "reduce_scatter": 8 * 4000}   # parameters still gathered once
    assert hybrid_pipeline.dp_gradient_sync_bytes(1000, 8, "ddp", every_microbatch=True) == {"all_reduce": 32000}
    with pytest.raises(ValueError):
        hybrid_pipeline.dp_gradient_sync_bytes(1000, 8, "zero2", every_microbatch=False)


def test_pp_sends_count_only_boundaries_between_ranks():
    one = 2 * 32 * 64 * 4   # a microbatch of 2 sequences of 32 tokens of width 64, fp32
    # one stage per rank, 4 ranks: the ends send one way, the middle both ways
    assert [hybrid_pipeline.pp_send_bytes([r], 4, 8, 2, 32, 64) for r in range(4)] == \
           [8 * one, 16 * one, 16 * one, 8 * one]
    # a V on 2 ranks (stages r and 3 - r): rank 1 holds stages 1 and 2, which meet without a message
    v_shape = [stage_indices("ZBVZeroBubble", r, 2, 2) for r in range(2)]
    assert v_shape == [[0, 3], [1, 2]]
    assert [hybrid_pipeline.pp_send_bytes(s, 4, 4, 2, 32, 64) for s in v_shape] == [8 * one, 8 * one]
    # looped (interleaved) on 2 ranks: stages [0, 2] and [1, 3]; every boundary crosses ranks
    looped = [stage_indices("Interleaved1F1B", r, 2, 2) for r in range(2)]
    assert [hybrid_pipeline.pp_send_bytes(s, 4, 4, 2, 32, 64) for s in looped] == [12 * one, 12 * one]


def test_tp_bytes_of_the_whole_model_as_one_stage_match_chapter_06s_formula():
    """One stage holding everything = chapter 06's step, except the head: 06 keeps the logits split for
    loss_parallel (three small all-reduces), a pipeline stage gathers them (one all-gather of the logits)."""
    cfg = models.preset("tiny", n_layers=3)
    batch, seq = 4, 32
    ours = hybrid_pipeline.tp_stage_comm_bytes(cfg, 3, True, True, microbatches=1, microbatch_rows=batch,
                                               seq_len=seq)
    rows = tensor_parallel.tp_comm_formula(cfg, batch, seq, 2)
    all_reduce_06 = sum(r["payload_bytes"] for r in rows if r["collective"] == "all_reduce" and r["where"] != "loss")
    assert ours["all_reduce"] == all_reduce_06
    assert ours["all_gather"] == batch * seq * cfg.vocab_size * 4
    # M microbatches of b rows: M times the bytes of one
    assert hybrid_pipeline.tp_stage_comm_bytes(cfg, 3, True, True, 4, batch, seq)["all_reduce"] == 4 * all_reduce_06


def test_collectives_are_attributed_to_their_mesh_dimension():
    calls = [CollectiveCall("send", 10, 2, "c10d"), CollectiveCall("all_reduce", 20, 2, "functional"),
             CollectiveCall("all_gather", 30, 2, "functional"), CollectiveCall("all_gather", 40, 2, "c10d"),
             CollectiveCall("reduce_scatter", 50, 2, "c10d"), CollectiveCall("send", 1, 2, "c10d")]
    assert hybrid_pipeline.bytes_by_dimension(calls) == {
        "pp": {"send": 11}, "tp": {"all_reduce": 20, "all_gather": 30}, "dp": {"all_gather": 40, "reduce_scatter": 50}}


# ---- --config FILE.json --------------------------------------------------------------------------------------

def _parser():
    p = argparse.ArgumentParser()
    p.add_argument("--config")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--dp-mode", default="ddp")
    p.add_argument("--steps", type=int, default=3)
    return p


def test_config_file_sets_defaults_and_flags_override_it(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"script": "pp_dp_hybrid.py", "description": "x", "pp": 4, "dp-mode": "fsdp",
                                "steps": 7}))
    args, problem = hybrid_pipeline.merge_config_file(_parser(), ["--config", str(path), "--steps", "2"],
                                                      "scripts/09_hybrid_parallel/pp_dp_hybrid.py")
    assert problem is None
    assert (args.pp, args.dp_mode, args.steps) == (4, "fsdp", 2)    # file, file (dashed name), flag


@pytest.mark.parametrize("content, message", [
    (json.dumps({"pp": 2, "tpp": 4}), "unknown setting(s) tpp"),
    (json.dumps({"script": "hybrid_3d.py", "pp": 2}), "is for hybrid_3d.py, not pp_dp_hybrid.py"),
    ("{not json", "is not valid JSON"),
    (json.dumps([1, 2]), "must hold one JSON object"),
])
def test_bad_config_files_are_one_sentence(tmp_path, content, message):
    path = tmp_path / "run.json"
    path.write_text(content)
    _, problem = hybrid_pipeline.merge_config_file(_parser(), ["--config", str(path)], "pp_dp_hybrid.py")
    assert message in problem


def test_missing_config_file():
    _, problem = hybrid_pipeline.merge_config_file(_parser(), ["--config", "/nonexistent/x.json"], "x.py")
    assert problem == "--config /nonexistent/x.json: no such file"


@pytest.mark.parametrize("name, gpus", [("pp_dp_8gpus.json", 8), ("fsdp_pp_8gpus.json", 8),
                                        ("hybrid_3d_16gpus.json", 16)])
def test_reference_layouts_fit_the_gpus_they_are_named_for(name, gpus):
    settings = json.loads((CONFIGS / name).read_text())
    assert (REPO / "scripts" / "09_hybrid_parallel" / settings["script"]).exists()
    pp, dp, tp = settings["pp"], settings["dp"], settings.get("tp", 1)
    assert hybrid.mesh_shape_problems(gpus, pp, dp, tp) == []
    assert hybrid.mesh_shape_warnings(tp, settings.get("gpus_per_node", 4)) == []      # TP inside a node
    chunks = CHOICES[settings["schedule"]].default_stages_per_rank
    cfg = models.preset(settings["preset"])
    assert hybrid_pipeline.pipeline_split_problems(layers=cfg.n_layers, pp=pp, stages_per_rank=chunks,
                                                   batch=settings["batch"], dp=dp,
                                                   microbatches=settings["microbatches"]) == []
    assert settings["microbatches"] >= pp * chunks
    assert tensor_parallel.tp_config_problems(cfg, tp) == []


def _two_gradient_sets(seed=0):
    """The same parameters twice, gradients planted: one set for torch, one for distlab."""
    torch.manual_seed(seed)
    shapes = [(4, 3), (7,), (2, 5)]
    grads = [torch.randn(s) * (1 + i) for i, s in enumerate(shapes)]
    sets = []
    for _ in range(2):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        sets.append(params)
    return sets


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_equals_torchs_on_one_device(norm_type):
    # inf summed infinite powers before (issue 34): inf ** (1 / inf) = 1 for any gradients (seen failing)
    ours, torchs = _two_gradient_sets()
    expected = torch.nn.utils.clip_grad_norm_(torchs, max_norm=0.5, norm_type=norm_type)
    total = hybrid_pipeline.clip_grad_norm_(ours, 0.5, norm_type=norm_type)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    assert expected.item() > 0.5                      # it clipped
    for a, b in zip(ours, torchs):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("norm_type, op", [(2.0, "SUM"), (math.inf, "MAX")])
def test_clip_grad_norm_reduces_over_pp_with_max_for_inf(norm_type, op, monkeypatch):
    # the stages' norms meet in one all-reduce over pp: summed powers, or the largest for the inf-norm
    import torch.distributed as dist
    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, op=dist.ReduceOp.SUM, group=None: seen.append((op, group)))
    ours, _ = _two_gradient_sets()
    hybrid_pipeline.clip_grad_norm_(ours, 0.5, pp_group="pp", norm_type=norm_type)
    assert seen == [(getattr(dist.ReduceOp, op), "pp")]


# ---- where the data-parallel gradient sync runs in a pipeline step (torch 2.13's stage.py) -------------------

# two stages on one rank (interleaved), two microbatches each: (stage, start, end) of every backward
BACKWARDS = [(1, 1.0, 2.0), (0, 2.0, 3.0), (1, 3.0, 4.0), (0, 4.0, 5.0)]


def test_ddp_buckets_inside_each_stages_last_backward_pass():
    launches = [(1, 3.5), (1, 3.9), (0, 4.2)]
    assert hybrid_pipeline.gradient_sync_timing_problems("ddp", BACKWARDS, [], launches, 3) == []


@pytest.mark.parametrize("launches, why", [
    ([(1, 1.5), (1, 3.9), (0, 4.2)], "outside its last backward"),      # synced in an earlier backward too
    ([(1, 3.9), (0, 5.5)], "outside its last backward"),               # after the backward: not overlapped
    ([(1, 3.9)], "no bucket launched"),                                 # a stage that never synced
])
def test_ddp_buckets_elsewhere_fail(launches, why):
    problems = hybrid_pipeline.gradient_sync_timing_problems("ddp", BACKWARDS, [], launches, len(launches))
    assert any(why in p for p in problems), problems


def test_fsdp_reduce_grad_after_each_stages_last_backward_passes():
    reduce_grads = [(1, 4.0, 4.1, ["reduce_scatter"] * 3), (0, 5.0, 5.2, ["reduce_scatter"] * 4)]
    assert hybrid_pipeline.gradient_sync_timing_problems("fsdp", BACKWARDS, reduce_grads, [], 7) == []


@pytest.mark.parametrize("reduce_grads, issued, why", [
    # REDUCE_GRAD of stage 0 before its last backward ended (a sync overlapped with backward, not torch's rule)
    ([(1, 4.0, 4.1, ["reduce_scatter"] * 3), (0, 4.5, 4.6, ["reduce_scatter"] * 4)], 7, "before its last backward"),
    # reduce-scatters issued outside REDUCE_GRAD (per microbatch, say)
    ([(1, 4.0, 4.1, ["reduce_scatter"] * 3), (0, 5.0, 5.2, ["reduce_scatter"] * 4)], 14, "issued inside"),
    # one stage without its REDUCE_GRAD
    ([(1, 4.0, 4.1, ["reduce_scatter"] * 3)], 3, "one each expected"),
])
def test_fsdp_sync_elsewhere_fails(reduce_grads, issued, why):
    problems = hybrid_pipeline.gradient_sync_timing_problems("fsdp", BACKWARDS, reduce_grads, [], issued)
    assert any(why in p for p in problems), problems


def test_a_step_that_issued_no_gradient_collective_fails():
    """Every REDUCE_GRAD in its place but nothing reduced (or the counter saw nothing): not torch's rule either."""
    silent = [(1, 4.0, 4.1, []), (0, 5.0, 5.2, [])]
    assert any("no reduce-scatter" in p for p in hybrid_pipeline.gradient_sync_timing_problems(
        "fsdp", BACKWARDS, silent, [], 0))
    assert any("no all-reduce" in p for p in hybrid_pipeline.gradient_sync_timing_problems(
        "ddp", BACKWARDS, [], [], 0))
