"""Chapter 09's pipeline hybrids on CPU ranks: PP + DDP and FSDP + PP (pp_dp_hybrid.py), PP x FSDP x TP
(hybrid_3d.py) in the shapes 2x1x2, 2x2x1, 1x2x2 on 4 ranks and 2x2x2 on 8, each equal to one device with its
bytes and memory = formula; the 8-rank run's checkpoint resumed on 4 ranks in two other layouts; bad
configurations exit 2 on every rank. One launch per run, asserted many ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import assert_all_checks_passed, assert_config_error

from distlab import hybrid
from labkit import launch

PP_DP = "scripts/09_hybrid_parallel/pp_dp_hybrid.py"
HYBRID_3D = "scripts/09_hybrid_parallel/hybrid_3d.py"
CONFIGS = "scripts/09_hybrid_parallel/configs"
ONE_DEVICE = ("losses equal the single-device", "step-0 gradients equal", "parameters after training equal")


def _check(metrics, name_start):
    matches = [c for c in metrics["checks"] if c["name"].startswith(name_start)]
    assert matches, f"no check named {name_start!r}: {[c['name'] for c in metrics['checks']]}"
    return matches[0]


def _assert_equal_to_one_device(metrics):
    for name in ONE_DEVICE:
        assert _check(metrics, name)["passed"]


# ---- pp_dp_hybrid.py -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pp_ddp():
    # (the chapter's run under the real torchrun is fsdp_tp_hybrid's, in test_09_hybrid_2d.py)
    return launch.run(PP_DP, nproc=4, args=["--dp-mode", "ddp", "--schedule", "GPipe", "--steps", "2"],
                      stream=False)


@pytest.fixture(scope="module")
def fsdp_pp():
    return launch.run(PP_DP, nproc=4, args=["--dp-mode", "fsdp", "--schedule", "Interleaved1F1B", "--steps", "2"],
                      stream=False)


@pytest.mark.parametrize("run, collective", [("pp_ddp", "all_reduce"), ("fsdp_pp", "reduce_scatter")])
def test_pp_dp_equals_one_device_and_syncs_gradients_once_per_step(run, collective, request):
    metrics = assert_all_checks_passed(request.getfixturevalue(run), min_checks=10)
    _assert_equal_to_one_device(metrics)
    assert _check(metrics, "torch.distributed.pipeline (Pipe + RPC) is gone")["passed"]
    # the naive way (sync in every microbatch's backward) sends M = 4 times the gradient bytes
    sync = metrics["extra"]["gradient_sync_bytes"]
    assert sync["every_microbatch"] == 4 * sync["once"] > 0
    naive = [c for c in metrics["comm"] if c.get("sync") == "every microbatch (naive)"]
    assert [c["collective"] for c in naive] == [collective]
    assert naive[0]["measured_bytes"] == naive[0]["analytic_bytes"] == sync["every_microbatch"]
    assert metrics["config"]["mesh"] == {"pp": 2, "dp": 2, "tp": 1}
    assert len(metrics["losses"]) == 2 and metrics["losses"][1] < metrics["losses"][0]
    # where the once-per-step sync ran (torch 2.13's stage.py): DDP's buckets inside each stage's last backward,
    # FSDP's REDUCE_GRAD after it; read from the measured step's clock on each stage's reporting rank
    assert _check(metrics, "dp gradient sync where torch 2.13's stage runs it")["passed"]
    for rank, seen in metrics["extra"]["gradient_sync_timing"].items():
        ends = {int(s): t for s, t in seen["last_backward_end"].items()}
        if collective == "all_reduce":
            # (torch's REDUCE_GRAD runs for a DDP stage too, and only scales: the buckets went before it)
            assert seen["bucket_launches"], (rank, seen)
            assert all(at <= ends[s] for s, at in seen["bucket_launches"]), (rank, seen)
        else:
            assert sorted(s for s, *_ in seen["reduce_grad"]) == sorted(ends), (rank, seen)
            assert all(start >= ends[s] for s, start, _ in seen["reduce_grad"]), (rank, seen)


def test_fsdp_pp_interleaves_two_stages_per_rank(fsdp_pp):
    metrics = fsdp_pp.metrics
    assert metrics["extra"]["stages_of_pp_rank"] == {"0": [0, 2], "1": [1, 3]}
    assert metrics["memory"]["per_rank"]["0"]["params"] * 2 == metrics["memory"]["per_rank"]["0"]["optimizer"]
    assert {e["rank"] for e in metrics["timeline"]} == {0, 1}


# ---- hybrid_3d.py ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def run_3d(tmp_path_factory):
    """Each shape launched once, the first time a test asks for it."""
    runs = {}

    def get(shape):
        if shape not in runs:
            runs[shape] = SHAPES[shape](tmp_path_factory)
        return runs[shape]
    return get


def _pp_tp(_):
    # 2x1x2, and a node of 1 "GPU": TP crosses nodes, a warning, not an error. It clips (every step: 0.5 is
    # below each step's norm) with dp = 1, where the step-0 gradients kept for the check were the live tensors,
    # clipped in place before the check read them: 0.019 against 1e-5 before full_named copied (issue 34; seen)
    return launch.run(HYBRID_3D, nproc=4, args=["--pp", "2", "--dp", "1", "--tp", "2", "--gpus-per-node", "1",
                                                "--steps", "2", "--clip-grad-norm", "0.5"], stream=False)


def _pp_fsdp(_):
    # 2x2x1 with a zero-bubble V schedule: stages 0 and 3 on pp rank 0, 1 and 2 on pp rank 1
    return launch.run(HYBRID_3D, nproc=4, args=["--pp", "2", "--dp", "2", "--tp", "1", "--schedule", "ZBVZeroBubble",
                                                "--steps", "2"], stream=False)


def _fsdp_tp(tmp_path_factory):
    # 1x2x2 from a --config file, with a flag overriding the file
    path = tmp_path_factory.mktemp("config") / "fsdp_tp.json"
    path.write_text(json.dumps({"script": "hybrid_3d.py", "pp": 1, "dp": 2, "tp": 2, "schedule": "GPipe",
                                "steps": 5}))
    return launch.run(HYBRID_3D, nproc=4, args=["--config", str(path), "--steps", "2"], stream=False)


def _all_three(tmp_path_factory):
    # 2x2x2 on 8 ranks (slow on 2 cores: once), interleaved: 4 stages; it also writes the checkpoint after step 2
    # that the tests of a layout change resume on 4 ranks
    folder = tmp_path_factory.mktemp("checkpoints_2x2x2")
    return launch.run(HYBRID_3D, nproc=8, args=["--pp", "2", "--dp", "2", "--tp", "2", "--schedule",
                                                "Interleaved1F1B", "--steps", "4", "--save-after", "2",
                                                "--checkpoint-dir", str(folder)], stream=False, timeout=240)


SHAPES = {"2x1x2": _pp_tp, "2x2x1": _pp_fsdp, "1x2x2": _fsdp_tp, "2x2x2": _all_three}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_3d_shapes_equal_one_device_with_bytes_and_memory_per_dimension_equal_formula(shape, run_3d):
    metrics = assert_all_checks_passed(run_3d(shape), min_checks=9)
    _assert_equal_to_one_device(metrics)
    pp, dp, tp = map(int, shape.split("x"))
    assert metrics["config"]["mesh"] == {"pp": pp, "dp": dp, "tp": tp}
    assert metrics["world_size"] == pp * dp * tp
    for dim, size in (("pp", pp), ("dp", dp), ("tp", tp)):
        assert _check(metrics, f"{dim} bytes per step = formula")["passed"]
        rows = [c for c in metrics["comm"] if c["dimension"] == dim]
        assert bool(rows) == (size > 1), (dim, rows)        # a dimension of size 1 sends nothing
        assert all(c["measured_bytes"] == c["analytic_bytes"] > 0 for c in rows)
    coordinates = metrics["extra"]["coordinates"]
    assert sorted((c["pp"], c["dp"], c["tp"]) for c in coordinates.values()) == \
        sorted((a, b, c) for a in range(pp) for b in range(dp) for c in range(tp))
    # DeviceMesh's order: tp innermost, so a TP group is consecutive ranks; distlab.hybrid's grid agrees
    assert all(int(rank) == (c["pp"] * dp + c["dp"]) * tp + c["tp"] for rank, c in coordinates.items())
    assert all(hybrid.grid_coordinates(int(rank), (pp, dp, tp), "device_mesh") == c for rank, c in coordinates.items())
    # the Gantt chart of the pipeline dimension: one row per pp rank
    assert {e["rank"] for e in metrics["timeline"]} == set(range(pp))
    if shape == "2x1x2":   # clipped every step, dp = 1: the step-0 gradients are the unclipped ones
        assert min(metrics["extra"]["grad_norms"]) > 0.5
        assert _check(metrics, "the total gradient norm over pp x dp x tp")["passed"]


def test_3d_clips_by_the_total_norm_over_every_stage_and_shard():
    # 2 x 2 x 2 on 8 ranks, a max norm below every step's norm (so every step clips): the total norm over
    # pp x dp x tp equals one device's clip_grad_norm_ at every step, and so do the losses and parameters after.
    # Without the pp all-reduce (each stage's own norm) the check fails by 0.34 (tried).
    result = launch.run(HYBRID_3D, nproc=8, args=["--clip-grad-norm", "0.5"], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=11)
    assert min(metrics["extra"]["grad_norms"]) > 0.5  # clipping was active
    assert any("total gradient norm over pp x dp x tp" in c["name"] for c in metrics["checks"])


def test_3d_timeline_and_warning(run_3d):
    metrics = run_3d("2x1x2").metrics
    assert metrics["extra"]["warnings"] and "larger than the 1 ranks of a node" in metrics["extra"]["warnings"][0]
    assert "warning: --tp 2 is larger" in run_3d("2x1x2").output
    zbv = run_3d("2x2x1").metrics
    assert zbv["extra"]["stages_of_pp_rank"] == {"0": [0, 3], "1": [1, 2]}
    assert {e["kind"] for e in zbv["timeline"]} == {"F", "B", "W"}     # zero bubble: weight gradients apart


def test_3d_writes_its_resolved_configuration(run_3d):
    config = run_3d("1x2x2").metrics["config"]
    assert config["steps"] == 2 and config["schedule"] == "GPipe"      # the flag beat the file; the file's schedule
    assert config["config"].endswith("fsdp_tp.json") and config["model"]["n_layers"] == 4
    assert config["chunks"] == 1 and config["reference"] is True


@pytest.mark.parametrize("script, args, fp32_run, ratio", [
    # FSDP's policy: stages pass bf16 activations (half of 2x1x2's fp32 bytes); FSDP over the one dp rank
    # carries the policy alone
    (HYBRID_3D, ["--pp", "2", "--dp", "1", "--tp", "2", "--schedule", "GPipe"], "2x1x2", 2),
    # DDP under autocast: the matmuls run in bf16, the residual stream a stage passes on stays fp32
    (PP_DP, ["--dp-mode", "ddp", "--schedule", "GPipe"], "pp_ddp", 1),
])
def test_bf16_runs_match_one_device_at_bf16_tolerance_with_their_bytes(script, args, fp32_run, ratio, run_3d,
                                                                       request):
    result = launch.run(script, nproc=4, args=args + ["--precision", "bf16", "--steps", "2"], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=9)
    assert len([c for c in metrics["checks"] if "bf16" in c["name"]]) == 3   # losses, gradients, parameters
    fp32 = (run_3d(fp32_run) if script == HYBRID_3D else request.getfixturevalue(fp32_run)).metrics
    assert fp32["config"]["precision"] == "fp32"

    def sends(m):
        return sorted(r["measured_bytes"] for r in m["comm"] if r["dimension"] == "pp")
    assert sends(metrics) and [ratio * b for b in sends(metrics)] == sends(fp32)


# ---- a checkpoint that changes layout: saved by 2x2x2 on 8 ranks, resumed on 4 -----------------------------------

def _saved_checkpoints(run_3d):
    saved = run_3d("2x2x2").metrics["extra"]["saved"]
    assert saved["step"] == 2 and saved["layout"]["world_size"] == 8
    return str(Path(saved["to"]).parent)


@pytest.mark.parametrize("pp, dp, tp", [(1, 2, 2), (1, 1, 4)])
def test_3d_checkpoint_resumes_in_another_layout_equal_to_the_run_that_never_stopped(pp, dp, tp, run_3d):
    # steps 2 and 3 on 4 ranks, from what 8 ranks in another layout wrote: losses, the step-2 gradients and the
    # final parameters equal the single-device run of steps 0-3 with no stop (and the 8-rank run's own losses).
    # 1x1x4 changes TP across the resume (2 -> 4: every matrix, the vocabulary-split embedding and head too,
    # resharded into quarters), and pp and dp with it; 2x1x2 is resumed by the weights-only test below
    folder = _saved_checkpoints(run_3d)
    result = launch.run(HYBRID_3D, nproc=4, args=["--pp", str(pp), "--dp", str(dp), "--tp", str(tp), "--schedule",
                                                  "GPipe", "--steps", "4", "--resume", folder], stream=False)
    metrics = assert_all_checks_passed(result, min_checks=9)
    for name in ("losses equal the single-device run's (steps 2-3 after resuming", "step-2 gradients equal",
                 "parameters after training equal"):
        assert _check(metrics, name)["passed"]
    resumed = metrics["extra"]["resumed"]
    assert resumed["step"] == 2 and resumed["saved_by"]["world_size"] == 8 and resumed["saved_by"]["tp"] == 2
    assert (resumed["layout"]["pp"], resumed["layout"]["dp"], resumed["layout"]["tp"]) == (pp, dp, tp)
    assert metrics["losses"] == pytest.approx(run_3d("2x2x2").metrics["losses"][2:], abs=1e-5)
    assert "saved by (pp, dp, tp) = (2, 2, 2) on 8 ranks; now" in result.output


def test_3d_resume_with_the_weights_alone_fails_the_check(run_3d):
    # the mistake a script that saves model.state_dict() alone makes: a fresh AdamW after the restart
    result = launch.run(HYBRID_3D, nproc=4, args=["--pp", "2", "--dp", "1", "--tp", "2", "--schedule", "GPipe",
                                                  "--steps", "4", "--resume", _saved_checkpoints(run_3d),
                                                  "--resume-weights-only"], stream=False, check=False)
    assert result.returncode == 1
    losses = _check(result.metrics, "losses equal the single-device run's")
    assert not losses["passed"]
    # the drift chapter 09 states, measured here
    from coursetools import chapters

    chapter = " ".join(chapters.text("09").split())   # all of the chapter's pages
    assert f"drifts (by {losses['value']:.2f} on the second step)" in chapter
    assert not _check(result.metrics, "parameters after training equal")["passed"]


def test_3d_checkpoint_flags_refuse_bad_input(run_3d, tmp_path):
    folder = _saved_checkpoints(run_3d)
    assert_config_error(HYBRID_3D, ["--resume", str(tmp_path)], "no complete checkpoint")
    assert_config_error(HYBRID_3D, ["--resume", folder, "--layers", "8", "--steps", "4"], "holds another model (n_layers 4 -> 8)")
    assert_config_error(HYBRID_3D, ["--resume", folder, "--steps", "3"], "run at least 2 more")
    assert_config_error(HYBRID_3D, ["--save-after", "2", "--checkpoint-dir", folder], "exists; choose another")
    assert_config_error(HYBRID_3D, ["--save-after", "5", "--checkpoint-dir", str(tmp_path)], "has only --steps 3")


# ---- bad input: one line, exit 2, every rank ---------------------------------------------------------------------

@pytest.mark.parametrize("script, args, message", [
    (HYBRID_3D, ["--pp", "2", "--dp", "2", "--tp", "2"], "2 x 2 x 2 = 8 ranks is not the world size 4"),
    (HYBRID_3D, ["--config", f"{CONFIGS}/hybrid_3d_16gpus.json"], "2 x 2 x 4 = 16 ranks is not the world size 4"),
    # the file's settings are the script's flags (an unknown one would stop it first: "unknown setting")
    (PP_DP, ["--config", f"{CONFIGS}/fsdp_pp_8gpus.json"], "2 x 4 x 1 = 8 ranks is not the world size 4"),
    (PP_DP, ["--schedule", "Interleaved1F1B", "--layers", "6"], "6 layers do not split into pp x stages-per-rank"),
    (PP_DP, ["--batch", "12"], "--batch 12 does not split over dp x microbatches = 2 x 4 = 8"),
    (HYBRID_3D, ["--dp", "1", "--microbatches", "1", "--batch", "4"],
     "needs at least as many microbatches as stages"),
])
def test_bad_configurations_exit_2_on_every_rank(script, args, message):
    assert_config_error(script, args, message)


def test_ddp_under_a_schedule_that_splits_the_backward_is_refused(monkeypatch):
    """--dp-mode ddp under ZBVZeroBubble, InterleavedZeroBubble or DualPipeV ran and failed its own checks (losses and
    gradients off one device's, half the dp bytes; DualPipeV stopped): refused in one line now, in-process (the
    check runs before the process group forms); FSDP under them, and DDP under the others, still accepted."""
    import argparse
    import importlib
    import sys

    from distlab import runtime

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts" / "09_hybrid_parallel"))
    common = importlib.import_module("common_hybrid_pipeline")
    monkeypatch.setattr(sys, "argv", sys.argv[:1])

    def args(mode, schedule):
        return argparse.Namespace(config_problem=None, tp=1, pp=2, dp=2, dp_mode=mode, schedule=schedule,
                                  microbatches=4, stages_per_rank=None, steps=2, layers=8, batch=8)

    assert getattr(common, "SPLIT_BACKWARD", None) == ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    for schedule in common.SPLIT_BACKWARD:
        with pytest.raises(runtime.ConfigError, match=f"--dp-mode ddp with --schedule {schedule}: ") as refused:
            common.check_hybrid_config(args("ddp", schedule), None, 4)
        assert "\n" not in str(refused.value)
        common.check_hybrid_config(args("fsdp", schedule), None, 4)
    for schedule in ("GPipe", "1F1B", "Interleaved1F1B"):
        common.check_hybrid_config(args("ddp", schedule), None, 4)
