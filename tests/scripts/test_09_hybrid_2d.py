"""Chapter 09, 2-D: the rank grid of both orders against DeviceMesh, and FSDP x TP on a (dp, tp) mesh equal
to one device with its memory and its communication per mesh dimension equal to the formulas.

Four launches, shared by the tests through module-scoped fixtures: rank_grid on 4 ranks, fsdp_tp_hybrid
on 2 x 2 with the usual plan (under the real torchrun), with the alternative embedding plan, and with
sequence parallelism (FSDP keeping gathered weights); then the bad inputs (4 more, each seconds). The
fake worlds of rank_grid run inside the test process.
"""

from __future__ import annotations

import pytest
from helpers import assert_all_checks_passed, assert_config_error

from distlab import hybrid, models
from labkit import launch

GRID = "scripts/09_hybrid_parallel/rank_grid.py"
HYBRID = "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py"
TINY = models.preset("tiny")


def _check(metrics, name_start):
    matches = [c for c in metrics["checks"] if c["name"].startswith(name_start)]
    assert matches, f"no check named {name_start!r}: {[c['name'] for c in metrics['checks']]}"
    return matches[0]


def _rows(metrics, dimension, where=None):
    return [r for r in metrics["comm"] if r["dimension"] == dimension and where in (None, r["where"])]


# ---- rank_grid.py -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grid_run():
    return launch.run(GRID, nproc=4, args=["--dp", "2", "--tp", "2", "--gpus-per-node", "2"], stream=False)


def test_hand_built_groups_equal_device_mesh_and_every_group_all_reduces(grid_run):
    metrics = assert_all_checks_passed(grid_run, min_checks=4)
    for name in ("hand-built device_mesh-order groups = DeviceMesh's groups", "all-reduce of rank ids = sum"):
        assert _check(metrics, name)["passed"]
    # 3 groups per order (pp, dp, tp) and 3 DeviceMesh groups: 9 all-reduces of one int64 per rank
    assert metrics["comm"][0]["measured_calls"] == 9 and metrics["comm"][0]["measured_bytes"] == 72


def test_the_copied_order_puts_tp_across_nodes(grid_run):
    crossing = grid_run.metrics["extra"]["crossing_groups"]
    assert crossing["device_mesh"]["tp"] == [] and crossing["device_mesh"]["dp"] == [[0, 2], [1, 3]]
    assert crossing["hybrid_context"]["tp"] == [[0, 2], [1, 3]]
    assert "The copied HybridParallelContext order puts TP across nodes" in grid_run.output


def run_in_this_process(script, args, tmp_path, capsys):
    """``python script args`` inside the test's process (a fake world needs no launcher): exit code,
    output, metrics. Cheaper than a launch: torch is already imported."""
    import json
    import runpy
    import sys

    metrics_file = tmp_path / "metrics.json"
    saved_argv = sys.argv
    sys.argv = [script, *args, "--metrics-out", str(metrics_file)]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as done:
        code = done.code
    finally:
        sys.argv = saved_argv
    output = capsys.readouterr()
    return code, output.out + output.err, json.loads(metrics_file.read_text()) if metrics_file.exists() else None


def test_fake_world_of_16_checks_every_rank_and_finds_the_issue_example(tmp_path, capsys):
    code, output, metrics = run_in_this_process(GRID, ["--world", "16", "--pp", "2", "--dp", "2", "--tp", "4"],
                                                tmp_path, capsys)
    assert code == 0, output
    assert metrics["world_size"] == 16 and [c["passed"] for c in metrics["checks"]] == [True]
    assert metrics["extra"]["crossing_group_counts"]["hybrid_context"]["tp"] == 4   # all 4 TP groups cross
    assert metrics["extra"]["crossing_group_counts"]["device_mesh"]["tp"] == 0
    assert "its TP group [0, 2, 4, 6] spans nodes" in output


def test_fake_world_warns_when_tp_is_larger_than_a_node(tmp_path, capsys):
    code, output, _ = run_in_this_process(GRID, ["--world", "8", "--dp", "1", "--tp", "8"], tmp_path, capsys)
    assert code == 0, output
    assert "warning: --tp 8 is larger than the 4 ranks of a node" in output


def test_fake_world_bad_mesh_is_a_config_error(tmp_path, capsys):
    code, output, metrics = run_in_this_process(GRID, ["--world", "12", "--pp", "2", "--dp", "2", "--tp", "4"],
                                                tmp_path, capsys)
    assert code == 2 and metrics is None
    assert output.strip() == "config error: the mesh pp x dp x tp = 2 x 2 x 4 = 16 ranks is not the world size 12"


# ---- fsdp_tp_hybrid.py ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def usual_run(tmp_path_factory):
    # the chapter's one run under the real launcher, with its step 2 profiled (the chapter's timeline figure)
    timeline = tmp_path_factory.mktemp("timeline") / "timeline.json"
    return launch.run(HYBRID, nproc=4, args=["--dp", "2", "--tp", "2", "--steps", "3", "--timeline-out",
                                             str(timeline)], launcher="torchrun", stream=False)


@pytest.fixture(scope="module")
def alternative_run():
    return launch.run(HYBRID, nproc=4, args=["--dp", "2", "--tp", "2", "--embedding-plan", "alternative",
                                             "--steps", "3"], stream=False)


@pytest.fixture(scope="module")
def sequence_parallel_run():
    return launch.run(HYBRID, nproc=4, args=["--dp", "2", "--tp", "2", "--sequence-parallel",
                                             "--no-reshard-after-forward", "--steps", "3"], stream=False)


@pytest.fixture(scope="module")
def bf16_run():
    # the sequence-parallel run again in bf16 (the a100 preset's precision): every kind of collective at once
    return launch.run(HYBRID, nproc=4, args=["--dp", "2", "--tp", "2", "--sequence-parallel",
                                             "--no-reshard-after-forward", "--steps", "3", "--precision", "bf16"],
                      stream=False)


@pytest.mark.parametrize("run", ["usual_run", "alternative_run", "sequence_parallel_run", "bf16_run"])
def test_2d_mesh_trains_like_one_device(run, request):
    metrics = assert_all_checks_passed(request.getfixturevalue(run), min_checks=8)
    for name in ("step-0 gradients equal single-device", "losses equal single-device",
                 "parameters after the last step equal single-device", "params bytes on this rank = formula",
                 "optimizer bytes on this rank = formula", "tp communication of one step = formula",
                 "dp communication of one step = formula"):
        assert _check(metrics, name)["passed"]
    assert metrics["config"]["dp"] == 2 and metrics["config"]["tp"] == 2


def test_usual_run_memory_and_communication_per_dimension(usual_run):
    metrics = usual_run.metrics
    assert _check(metrics, "the profiled step's collectives per mesh dimension = the counted step's")["passed"]
    replica_activation = 2 * 32 * 64 * 4  # batch 4 / dp 2, S 32, H 64, fp32
    per_block_tp = {(r["phase"]): r for r in _rows(metrics, "tp", "blocks")}
    for phase in ("forward", "backward"):  # 2 all-reduces per block each way, over the TP group only
        row = per_block_tp[phase]
        assert row["collective"] == "all_reduce" and row["measured_calls"] == 2 * TINY.n_layers
        assert row["measured_bytes"] == 2 * TINY.n_layers * replica_activation
    units = hybrid.fsdp_unit_params(TINY, 2)
    dp_rows = {(r["phase"], r["where"], r["collective"]): r for r in _rows(metrics, "dp")}
    assert dp_rows[("forward", "blocks", "all_gather")]["measured_calls"] == TINY.n_layers
    assert dp_rows[("backward", "blocks", "all_gather")]["measured_bytes"] == TINY.n_layers * units["block"] * 4
    assert dp_rows[("backward", "root", "reduce_scatter")]["measured_calls"] == 1
    # every rank holds 1/(dp x tp) of the matrices and 1/dp of the norms: 16 bytes per parameter it holds
    held = (TINY.num_params() - (2 * TINY.n_layers + 1) * TINY.dim) // 4 + (2 * TINY.n_layers + 1) * TINY.dim // 2
    assert metrics["memory"]["measured"]["total"] == 16 * held
    assert metrics["memory"]["measured"]["total"] < metrics["memory"]["single_device"]["total"] / 3.9


def test_alternative_embedding_plan_is_correct_but_sends_the_logits(usual_run, alternative_run):
    usual, alternative = usual_run.metrics, alternative_run.metrics
    outside = {r["collective"]: r for r in _rows(alternative, "tp", "outside blocks") if r["phase"] == "forward"}
    logits = 2 * 32 * TINY.vocab_size * 4  # the replica's B x S x V, fp32, all-reduced over tp
    assert outside["all_reduce"]["measured_bytes"] == logits
    assert outside["all_gather"]["measured_bytes"] == 2 * 32 * TINY.dim * 4  # the embedding's H shards
    sent = [sum(r["sent_bytes_per_rank_derived"] for r in _rows(m, "tp", "outside blocks"))
            for m in (usual, alternative)]
    assert sent[0] < sent[1]
    assert alternative["extra"]["embedding_plans"]["this_plan_derived_from_measured"] == sent[1]
    assert usual["extra"]["embedding_plans"]["sent_bytes_per_rank_outside_blocks_derived"]["alternative"] == sent[1]
    assert usual["losses"] == pytest.approx(alternative["losses"], abs=1e-5)
    # the blocks and FSDP do not care which plan the embedding and head follow
    assert _rows(usual, "dp") == _rows(alternative, "dp")


def test_sequence_parallel_turns_block_all_reduces_into_gather_scatter_pairs(sequence_parallel_run):
    metrics = sequence_parallel_run.metrics
    block_rows = {(r["phase"], r["collective"]): r for r in _rows(metrics, "tp", "blocks")}
    assert block_rows[("forward", "all_gather")]["measured_calls"] == 2 * TINY.n_layers
    assert block_rows[("forward", "reduce_scatter")]["measured_calls"] == 2 * TINY.n_layers
    assert ("forward", "all_reduce") not in block_rows
    assert block_rows[("backward", "all_reduce")]["measured_bytes"] == 2 * TINY.n_layers * TINY.dim * 4  # norms
    assert not [r for r in _rows(metrics, "dp") if r["phase"] == "backward" and r["collective"] == "all_gather"]


def test_bf16_halves_activations_and_gathered_weights_not_the_reduced_gradients(sequence_parallel_run, bf16_run):
    # against the fp32 run's measured bytes, row by row (not against the formula the script already checked):
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) gathers and computes in bf16 and reduces in fp32
    fp32 = {(r["dimension"], r["phase"], r["where"], r["collective"]): r for r in sequence_parallel_run.metrics["comm"]}
    bf16 = {(r["dimension"], r["phase"], r["where"], r["collective"]): r for r in bf16_run.metrics["comm"]}
    assert fp32.keys() == bf16.keys()
    for key, row in bf16.items():
        dimension, _, where, collective = key
        loss_statistics = where == "outside blocks" and collective == "all_reduce" and key[1] == "forward"
        halves = not (dimension == "dp" and collective == "reduce_scatter") and not loss_statistics
        assert row["measured_bytes"] * (2 if halves else 1) == fp32[key]["measured_bytes"], key
    assert [c for c in bf16_run.metrics["checks"] if "bf16 tolerance" in c["name"]]
    assert bf16_run.metrics["config"]["precision"] == "bf16"
    assert sequence_parallel_run.metrics["config"]["precision"] == "fp32"  # tiny's default: exact checks


def test_hsdp_times_tp_on_a_3d_mesh_equals_one_device_with_each_dimensions_bytes():
    # (replicate, dp, tp) = (2, 2, 2) on 8 ranks: TP inside, FSDP sharding over dp inside a replica, and each
    # gradient shard all-reduced over the replicas; every dimension's calls and bytes = the formula's
    result = launch.run(HYBRID, nproc=8, args=["--dp", "2", "--tp", "2", "--replicate", "2", "--steps", "2"],
                        stream=False, timeout=240)
    metrics = assert_all_checks_passed(result, min_checks=10)
    assert _check(metrics, "replicate communication of one step = formula")["passed"]
    replicate = _rows(metrics, "replicate")
    assert {r["collective"] for r in replicate} == {"all_reduce"}
    assert sum(r["measured_calls"] for r in replicate) == TINY.n_layers + 1      # one per FSDP unit
    assert not [r for r in _rows(metrics, "dp") if r["collective"] == "all_reduce"]
    # the shard is 1/dp of a unit, all-reduced: as many bytes as the unit's reduce-scatter, over dp
    shard_sums = {r["where"]: r["measured_bytes"] for r in replicate}
    scatters = {r["where"]: r["measured_bytes"] for r in _rows(metrics, "dp") if r["collective"] == "reduce_scatter"}
    assert {w: 2 * b for w, b in shard_sums.items()} == scatters
    assert "its replicate group [0, 4]" in result.output


# ---- bad input --------------------------------------------------------------------------------------------


def test_the_planted_wrong_group_fails_the_group_and_single_device_checks_not_the_byte_counts():
    """Lab 09's bug: TP's all-reduces on the dp group (the mesh's names swapped, the data by the grid). No hang, no
    crash, the bytes per dimension still equal the formula: the group check and the single-device comparison
    fail, and the run exits 1."""
    result = launch.run(HYBRID, nproc=4, args=["--dp", "2", "--tp", "2", "--planted-bug", "tp-on-dp-group",
                                               "--steps", "2"], stream=False, check=False)
    assert result.returncode == 1, result.output[-2000:]
    checks = {c["name"]: c for c in result.metrics["checks"]}
    failed = {name for name, c in checks.items() if not c["passed"]}
    assert failed == {"every rank's TP and FSDP groups, read from the mesh, = distlab.hybrid's grid",
                      "step-0 gradients equal single-device (every parameter)",
                      "losses equal single-device (every step)",
                      "parameters after the last step equal single-device (every parameter)"}, failed
    assert "its tp group from the mesh is [0, 2], the grid says [0, 1]" in checks[
        "every rank's TP and FSDP groups, read from the mesh, = distlab.hybrid's grid"]["value"]
    assert checks["losses equal single-device (every step)"]["value"] > 0.1   # a wrong sum, not rounding


def test_the_planted_bug_needs_groups_of_one_size_exits_2():
    assert_config_error(HYBRID, ["--dp", "4", "--tp", "1", "--planted-bug", "tp-on-dp-group"],
                        "--planted-bug tp-on-dp-group needs --dp = --tp")


def test_mesh_that_is_not_the_world_exits_2():
    assert_config_error(HYBRID, ["--dp", "3", "--tp", "2"],
                        "pp x dp x tp = 1 x 3 x 2 = 6 ranks is not the world size 4")


def test_replicas_that_do_not_divide_the_world_exit_2():
    assert_config_error(HYBRID, ["--replicate", "3"], "--replicate 3 does not divide the 4 ranks into replicas")


def test_heads_that_do_not_split_over_tp_exit_2():
    assert_config_error(HYBRID, ["--dp", "1", "--tp", "4", "--heads", "2"], "2 attention heads do not split over 4")


def test_batch_that_does_not_split_over_dp_exits_2():
    assert_config_error(HYBRID, ["--dp", "4", "--tp", "1", "--batch", "6"],
                        "--batch 6 does not split over 4 data-parallel ranks")


def test_rank_grid_mesh_that_is_not_the_world_exits_2():
    assert_config_error(GRID, ["--pp", "2", "--dp", "2", "--tp", "2"], "= 8 ranks is not the world size 4")
