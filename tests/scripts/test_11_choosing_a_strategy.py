"""Chapter 11: the planner's memory and communication equal what chapter 05 and 09 scripts measure on CPU ranks,
and plan.py's search, --layout, --json, --dry-run and bad inputs.

Three launches, each shared by its tests through a module-scoped fixture (4 ranks, fork launcher):
fsdp_tp_hybrid.py on a 2 x 2 (dp x tp) mesh with FSDP resharding after forward, train_fsdp.py on 4 ranks
keeping the weights gathered (reshard_after_forward=False, ZeRO-2 like traffic), and sp_transformer.py (TP 4
with and without sequence parallelism: saved activations and TP traffic). The planner is evaluated for
the same layout and model; it never sees the measurement. plan.py runs in this process (no launch needed).
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from helpers import assert_all_checks_passed

from distlab import models, planner
from distlab.planner import dry_run
from labkit import launch

HYBRID = "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py"
FSDP = "scripts/05_fully_sharded/train_fsdp.py"
SEQUENCE_PARALLEL = "scripts/08_sequence_parallel/sp_transformer.py"
PLAN = "scripts/11_choosing_a_strategy/plan.py"
CPU = planner.Cluster("cpu", 4, 1e12, 1e12, "fp32", 1e9, 1e9)  # memory and links do not matter here
MEASURED_OPTIONS = dict(precision="fp32", activation_checkpointing=False, reserve_bytes=0)
# the planner's activations (bf16-scaled on GPUs, here fp32) against the saved tensors measured on CPU ranks:
# stated margin 1 % (what the CPU runs give is exact; GPU kernels save a little more, chapter 01 and 08)
ACTIVATION_MARGIN = 0.01


def summed_by_collective(rows, dimension=None):
    """Measured payload bytes of one step per collective (of one mesh dimension)."""
    totals = {}
    for row in rows:
        if dimension is None or row.get("dimension") == dimension:
            totals[row["collective"]] = totals.get(row["collective"], 0) + row["measured_bytes"]
    return totals


# ---- chapter 09: FSDP x TP on 2 x 2 ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_run():
    result = launch.run(HYBRID, nproc=4, args=["--dp", "2", "--tp", "2", "--steps", "2"], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=4)
    config = metrics["config"]
    cfg = models.preset(config["preset"], seq_len=config["seq_len"])
    spec = planner.from_config(cfg, micro_batch=config["batch"] // 2, global_batch=config["batch"])
    options = planner.Options(zero_stage=3, reshard_after_forward=True, sequence_parallel=False,
                              **MEASURED_OPTIONS)
    return metrics, spec, planner.Layout(tp=2, dp=2, zero_stage=3), options


def test_state_per_rank_equals_the_measured_fsdp_tp_run_to_the_byte(hybrid_run):
    metrics, spec, layout, options = hybrid_run
    predicted = planner.state_bytes(spec, layout, 0, options)
    measured = metrics["memory"]["measured"]
    assert (predicted.params, predicted.grads, predicted.optimizer) == (
        measured["params"], measured["grads"], measured["optimizer"])


def test_communication_per_dimension_equals_the_measured_ledger(hybrid_run):
    metrics, spec, layout, options = hybrid_run
    predicted = planner.comm_per_step(spec, layout, 0, options)
    for dimension in ("tp", "dp"):
        measured = summed_by_collective(metrics["comm"], dimension)
        assert measured and predicted[dimension] == measured, dimension
    assert not predicted["pp"] and not predicted["cp"]


# ---- chapter 05: FSDP2 on 4 ranks, weights kept after forward -------------------------------------------


@pytest.fixture(scope="module")
def fsdp_run():
    result = launch.run(FSDP, nproc=4, args=["--steps", "2", "--no-reshard-after-forward"], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=8)
    config = metrics["config"]
    cfg = models.preset(config["preset"])
    spec = planner.from_config(cfg, micro_batch=config["batch"] // 4, global_batch=config["batch"])
    options = planner.Options(zero_stage=3, reshard_after_forward=False, **MEASURED_OPTIONS)
    return metrics, spec, planner.Layout(dp=4, zero_stage=3), options


def test_state_per_rank_equals_the_measured_fsdp_run_to_the_byte(fsdp_run):
    metrics, spec, layout, options = fsdp_run
    predicted = planner.state_bytes(spec, layout, 0, options)
    measured = metrics["memory"]["measured"]
    assert (predicted.params, predicted.grads, predicted.optimizer) == (
        measured["params"], measured["grads"], measured["optimizer"])


def test_fsdp_traffic_without_resharding_equals_the_measured_bytes(fsdp_run):
    metrics, spec, layout, options = fsdp_run
    predicted = planner.comm_per_step(spec, layout, 0, options)["dp"]
    assert predicted == summed_by_collective(metrics["comm"])
    # and resharding would have gathered twice: the planner tells the two settings apart
    resharded = planner.comm_per_step(spec, layout, 0, planner.Options(zero_stage=3, **MEASURED_OPTIONS))["dp"]
    assert resharded["all_gather"] == 2 * predicted["all_gather"]


def test_gathered_weights_kept_from_forward_to_backward_are_what_the_ops_saved(fsdp_run):
    """Without resharding every unit stays gathered until its backward: the planner's temporary buffer. The
    run's saved tensors hold them (every matrix a matmul keeps; the embedding keeps only its indices). The buffer
    itself, gathered weights, unsharded gradients and the reduce-scatter input at the backward's peak, equals what
    torch's FSDPMemTracker counts for the same model, sharded the same way, on a fake group of as many ranks."""
    metrics, spec, layout, options = fsdp_run
    measured = metrics["memory"]["saved_activation_bytes"]
    activations = planner.activation_bytes(spec, layout, 0, options)
    gathered_weights = 4 * (spec.num_params() - spec.vocab * spec.hidden)
    assert abs(activations + gathered_weights - measured) / measured <= 0.01
    config = metrics["config"]
    counted = dry_run.fsdp_buffers_counted(models.preset(config["preset"]), layout.dp, spec.micro_batch,
                                           mixed=False, reshard_after_forward=False)
    assert planner.temporary_bytes(spec, layout, 0, options) == counted["backward"]["total"]
    assert counted["backward"]["gathered"] >= gathered_weights


# ---- chapter 08: TP and TP + SP on 4 ranks: activations and TP traffic ----------------------------------


@pytest.fixture(scope="module")
def sequence_parallel_run():
    result = launch.run(SEQUENCE_PARALLEL, nproc=4, args=["--steps", "2"], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=4)
    config = metrics["config"]
    cfg = models.preset(config["preset"])
    spec = replace(planner.from_config(cfg, micro_batch=config["batch"], global_batch=config["batch"]),
                   seq_len=config["seq_len"])
    return metrics, spec, planner.Layout(tp=4)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_activations_within_the_stated_margin_of_the_measured_saved_tensors(sequence_parallel,
                                                                            sequence_parallel_run):
    metrics, spec, layout = sequence_parallel_run
    options = planner.Options(sequence_parallel=sequence_parallel, **MEASURED_OPTIONS)
    label = "TP 4 + SP" if sequence_parallel else "TP 4"
    measured = metrics["memory"]["activation_bytes"][label]["measured"]
    predicted = planner.activation_bytes(spec, layout, 0, options)
    assert abs(predicted - measured) / measured <= ACTIVATION_MARGIN, (predicted, measured)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp_traffic_with_and_without_sp_equals_the_measured_ledger(sequence_parallel, sequence_parallel_run):
    metrics, spec, layout = sequence_parallel_run
    options = planner.Options(sequence_parallel=sequence_parallel, **MEASURED_OPTIONS)
    rows = [r for r in metrics["comm"] if r.get("plan") == ("tp+sp" if sequence_parallel else "tp")]
    assert planner.comm_per_step(spec, layout, 0, options)["tp"] == summed_by_collective(rows)


# ---- plan.py ------------------------------------------------------------------------------------------


def run_plan(args, capsys):
    """plan.py inside this process: exit code and output (stdout + stderr)."""
    saved = sys.argv
    sys.argv = [PLAN, *args]
    try:
        runpy.run_path(PLAN, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code
    finally:
        sys.argv = saved
    output = capsys.readouterr()
    return code, output.out, output.err


# ---- chapter 08: ring attention on 4 ranks (context parallelism) ------------------------------------------


RING = "scripts/08_sequence_parallel/ring_attention.py"


def test_cp_traffic_equals_the_bytes_ring_attention_sent():
    """One attention layer of the ring script's tiny shape as a ModelSpec (multi-head: K and V as wide as Q); the
    planner's CP bytes per rank (forward and backward) against what the script's ranks sent."""
    metrics = assert_all_checks_passed(launch.run(RING, nproc=4, stream=False), min_checks=15)
    sent = sum(r["measured_bytes"] for r in metrics["comm"] if r["layout"] == "zigzag")
    shape = runpy.run_path(str(launch.REPO_ROOT / RING), run_name="ring")["SHAPES"]["tiny"]
    hidden = shape["heads"] * shape["head_dim"]
    spec = planner.ModelSpec("ring", 1, hidden, shape["heads"], shape["heads"], 4 * hidden, 100, shape["seq_len"],
                             shape["batch"], shape["batch"])
    options = planner.Options(**MEASURED_OPTIONS)
    predicted = planner.comm_per_step(spec, planner.Layout(cp=4), 0, options)["cp"]["send"]
    assert predicted == sent == (3 * 2 + 3 * 4 + 2) * 8192
    # recomputed (activation checkpointing): the forward ring runs again
    again = planner.comm_per_step(spec, planner.Layout(cp=4), 0, replace(options, activation_checkpointing=True))
    assert again["cp"]["send"] == sent + 3 * 2 * 8192


def test_search_prints_the_ranked_table_and_the_best_layout(capsys):
    code, out, _ = run_plan(["--model", "70b", "--gpus", "64", "--cluster", "h100-80gb"], capsys)
    assert code == 0 and "best layout:" in out and "layouts fit; rejected" in out
    best = planner.search(planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"], 64)[0]
    assert f"  1  {best.layout.label()}" in out


def test_json_search_lists_layouts_best_first(capsys):
    code, out, _ = run_plan(["--model", "13b", "--gpus", "16", "--cluster", "a100-40gb", "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["layouts"][0]["fits"] and data["gpus"] == 16
    speeds = [p["tokens_per_second"] for p in data["layouts"] if p["fits"]]
    assert speeds == sorted(speeds, reverse=True)


def test_one_layout_as_json_has_fits_reason_memory_and_step_time(capsys):
    code, out, _ = run_plan(["--model", "gpt3-175b", "--gpus", "1024", "--cluster", "v100-32gb",
                             "--layout", "tp=8,pp=8,dp=16", "--json"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["fits"] is True and plan["reason"] == "fits" and plan["step_seconds"] > 0
    parts = plan["memory_per_gpu_bytes"]
    assert {"params", "grads", "optimizer", "activations", "temporary"} <= set(parts)
    assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    # DDP (ZeRO 0) does not fit the same layout: the reason says by how much
    code, out, _ = run_plan(["--model", "gpt3-175b", "--cluster", "v100-32gb", "--layout", "tp=8,pp=8,dp=16,zero=0",
                             "--json"], capsys)
    plan = json.loads(out)
    assert code == 0 and plan["fits"] is False and "GiB per GPU" in plan["reason"]


def test_dry_run_builds_the_mesh_of_hundreds_of_ranks(capsys):
    code, out, _ = run_plan(["--model", "70b", "--gpus", "256", "--cluster", "a100-80gb", "--dry-run"], capsys)
    assert code == 0 and "fake process group of 256 ranks" in out and "grid: every one" in out
    assert "FSDP collectives counted = the planner's (calls; bytes, FSDP padding named): equal" in out


def test_dry_run_with_cp_builds_a_4d_mesh_and_fails_when_it_is_built_wrong(capsys, monkeypatch):
    long = ["--model", "70b", "--gpus", "64", "--cluster", "h100-80gb", "--seq-len", "131072", "--global-batch", "32"]
    code, out, _ = run_plan(long + ["--dry-run"], capsys)
    assert code == 0 and "DeviceMesh (pp, dp, cp, tp) = (1, 8, 8, 1)" in out and "grid: every one" in out
    assert "state bytes read from their shards = the planner's (FSDP padding named): equal" in out
    # the check can fail: a mesh whose dp and cp are swapped (cp outer) is caught
    from torch.distributed import device_mesh

    real = device_mesh.init_device_mesh

    def swapped(device, shape, mesh_dim_names):
        if len(shape) != 4:  # the stages' (pp, dp x cp, tp) mesh of the shard check: left as it is
            return real(device, shape, mesh_dim_names=mesh_dim_names)
        pp, dp, cp, tp = shape
        return real(device, (pp, cp, dp, tp), mesh_dim_names=("pp", "cp", "dp", "tp"))

    monkeypatch.setattr(device_mesh, "init_device_mesh", swapped)
    code, out, _ = run_plan(long + ["--dry-run"], capsys)
    assert code == 1 and "NOT for ranks" in out


def test_cp_flag_fixes_the_searchs_degree(capsys):
    code, out, _ = run_plan(["--model", "70b", "--gpus", "64", "--cluster", "h100-80gb", "--cp", "2", "--json"],
                            capsys)
    assert code == 0 and {p["layout"]["cp"] for p in json.loads(out)["layouts"]} == {2}


@pytest.mark.parametrize("args,expected", [
    (["--model", "70b", "--gpus", "64", "--cp", "3"], "--cp 3 does not divide the 64 GPUs"),
    (["--model", "70b", "--layout", "tp=8,dp=8", "--cp", "2"], "with --layout write cp= in it"),
    (["--model", "175b"], "unknown model '175b'"),
    (["--cluster", "tpu-v5"], "unknown cluster 'tpu-v5'"),
    (["--model", "405b", "--gpus", "8", "--cluster", "a100-40gb"], "fits in no layout of 8"),
    (["--model", "70b", "--gpus", "64", "--layout", "tp=8,pp=3,dp=3"], "is not the 64 GPUs"),
    (["--model", "70b", "--layout", "tp=3,dp=2"], "do not split over TP 3"),
    (["--model", "70b", "--layout", "tp8"], "write it like tp=8"),
])
def test_bad_input_is_one_line_and_exit_2(args, expected, capsys):
    code, out, err = run_plan(args, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("config error: ") and expected in lines[0], err


@pytest.mark.parametrize("flag", ["--gpus", "--cp-min-tokens", "--global-batch"])
def test_a_zero_count_is_one_config_error_line_and_exit_2(flag, capsys):
    code, out, err = run_plan(["--model", "70b", flag, "0"], capsys)
    assert code == 2 and err.splitlines() == [
        f"config error: argument {flag}: must be a positive integer, not 0 (see plan.py --help)"], err


def test_bad_model_file_and_the_real_process_exit_code(tmp_path):
    bad = tmp_path / "model.json"
    bad.write_text(json.dumps({"layers": 2, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 100, "seq_len": 16,
                               "colour": "red"}))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, PLAN, "--model-config", str(bad)], capture_output=True, text=True,
                          cwd=launch.REPO_ROOT, timeout=60)
    assert done.returncode == 2 and time.perf_counter() - started < 30
    assert len(done.stderr.strip().splitlines()) == 1 and "unknown model fields ['colour']" in done.stderr


def test_the_notebooks_side_by_side_table_is_all_equal(hybrid_run):
    from labkit import planner_widgets

    rows = planner_widgets.predicted_vs_measured(hybrid_run[0], dp=2, tp=2)
    assert len(rows) >= 6 and all(r["predicted"] == r["measured"] for r in rows)
    assert "| NO |" not in planner_widgets.rows_markdown(rows)


def test_measure_runs_the_planned_layout_and_prints_predicted_beside_measured(tmp_path):
    """What the PBS job runs on the cluster, on 4 CPU ranks under the real torchrun: every rank plans, then
    runs chapter 09's script; the predicted state equals the measured one."""
    out = tmp_path / "plan.json"
    result = launch.run(PLAN, nproc=4, args=["--measure", "--preset", "tiny", "--device", "cpu", "--steps", "3",
                                             "--metrics-out", str(out)], launcher="torchrun", stream=False,
                        metrics=False)
    assert result.returncode == 0, result.tail()
    data = json.loads(out.read_text())
    assert data["measured_checks_passed"] and data["world_size"] == 4
    assert all(c["passed"] for c in data["checks"]) and data["checks"][-1]["name"].startswith("training state per GPU")
    rows = {r["what"]: r for r in data["rows"]}
    for part in ("params", "grads", "optimizer"):
        assert rows[part]["predicted"] == rows[part]["measured"]
    assert "predicted (derived)" in result.output and result.output.count("planner: tp=") == 1


def test_model_and_cluster_from_files(tmp_path, capsys):
    model = tmp_path / "model.json"
    model.write_text(json.dumps({"name": "mine", "layers": 24, "hidden": 2048, "heads": 16, "ffn": 5632,
                                 "vocab": 32000, "seq_len": 2048, "global_batch": 64}))
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"gpus_per_node": 4, "gpu_gib": 40, "peak_tflops": 312, "intra_node_gb_per_s": 300,
                                   "inter_node_gb_per_s": 25}))
    code, out, _ = run_plan(["--model-config", str(model), "--cluster-config", str(cluster), "--gpus", "8", "--json"],
                            capsys)
    data = json.loads(out)
    assert code == 0 and data["model"]["kv_heads"] == 16 and data["cluster"]["gpu_bytes"] == 40 * planner.GIB
    spec, machine = planner.model_from_file(model), planner.cluster_from_file(cluster)
    assert data["layouts"][0]["label"] == planner.search(spec, machine, 8)[0].layout.label()


@pytest.mark.parametrize("early_stop", [True, False])
def test_tp_traffic_of_a_checkpointed_step_equals_the_planners(early_stop, sequence_parallel_run):
    """The recomputed forward's collectives, counted in a run (every block checkpointed, with and without torch's
    early stop) against the planner's, and against the uncheckpointed run: not only in the text."""
    metrics, spec, layout = sequence_parallel_run
    options = planner.Options(**{**MEASURED_OPTIONS, "activation_checkpointing": "full"}, sequence_parallel=False,
                              recompute_early_stop=early_stop)
    label = "tp+checkpointing" + ("" if early_stop else " without early stop")
    measured = summed_by_collective([r for r in metrics["comm"] if r.get("plan") == label])
    plain = summed_by_collective([r for r in metrics["comm"] if r.get("plan") == "tp"])
    assert measured and planner.comm_per_step(spec, layout, 0, options)["tp"] == measured
    block_forward = 2 * spec.layers * spec.micro_batch * spec.seq_len * spec.hidden * 4  # 2 all-reduces a block
    assert measured["all_reduce"] - plain["all_reduce"] == block_forward // (2 if early_stop else 1)


def test_dry_run_of_deepseek_v3s_published_layout_builds_its_ep_groups(capsys):
    """A MoE layout: plan.py --dry-run builds its EP side at 2,048 ranks (chapter 13)."""
    code, out, _ = run_plan(["--model", "deepseek-v3", "--cluster", "h800-80gb", "--layout",
                             "tp=1,pp=16,dp=128,zero=1,ep=64", "--ep-overlap", "--dry-run"], capsys)
    assert code == 0, out
    assert "fits" in out and "ep: all_to_all" in out
    assert "EP groups' nodes, experts and their state = the planner's: equal" in out


def test_one_layout_prints_the_compute_rate_the_step_used(capsys):
    """The step line's "at N% of peak" is the rate the step time used (the model's FLOPs and the recomputation over
    the compute seconds), not the one-number GPU_CONSTANTS compute_efficiency, which the step time never reads."""
    from distlab.planner.step_time import compute_rate

    spec, cluster = planner.MODELS["70b"], planner.CLUSTERS["h100-80gb"]
    layout = planner.Layout(tp=4, pp=4, dp=4, zero_stage=1)
    code, out, _ = run_plan(["--model", "70b", "--gpus", "64", "--cluster", "h100-80gb", "--layout",
                             "tp=4,pp=4,dp=4,zero=1"], capsys)
    plan = planner.tune(spec, cluster, layout, planner.Options(), 64)
    options = replace(planner.Options(), activation_checkpointing=plan.settings["checkpointing"],
                      sequence_parallel=plan.settings["sequence_parallel"], chunks=plan.settings["chunks"])
    rate = compute_rate(replace(spec, micro_batch=plan.settings["micro_batch"]), cluster, layout, options)
    share = rate / cluster.peak_flops
    assert f"(compute {plan.compute_seconds:.3g} s at {share:.0%} of peak)" in out
    assert f"{share:.0%}" != f"{cluster.compute_efficiency:.0%}"   # 55 % here, the constant 57 %
    assert plan.compute_flops / plan.compute_seconds == pytest.approx(rate, rel=1e-12)
