"""The committed runs behind chapter 14's figures (chapters/figures/data/14_*.json) against today's registry and code.

Each file was written by a ``coursetools.figures.measure_*`` function from the registry's own runs. A file made with
other arguments than the registry's, or one today's code would read differently, fails here: measure it again.
"""

from __future__ import annotations

import json
import re

import pytest

from coursetools import figures


def registry():
    return pytest.importorskip("labkit.broken_runs", reason="helper A's registry of broken runs is not here yet")


def test_the_data_parallel_runs_show_what_the_chapter_says():
    broken_runs = registry()
    runs = json.loads(figures.BROKEN_DATA_PARALLEL.read_text())["runs"]
    assert runs["correct"]["argv"] == list(broken_runs.case("same-samples-every-rank").fixed_args)
    for name in figures.DATA_PARALLEL_CASES:
        assert runs[name]["argv"] == list(broken_runs.case(name).args), f"{name}: measure again"
    assert max(runs["correct"]["from_one_device"]) < 1e-5                   # the dashed line is one device's
    assert all(len(set(step)) == 1 for step in runs["same-samples-every-rank"]["rank_losses"])   # one loss a step
    assert all(len(set(step)) == 4 for step in runs["correct"]["rank_losses"][1:])
    spread = [max(step) - min(step) for step in runs["accumulation-never-syncs"]["rank_losses"]]
    assert spread[-1] > 5 * spread[0]                                        # the ranks drift apart
    gaps = runs["no-set-epoch"]["from_one_device"]
    epoch_turn = 4                                                          # 8 samples a step, 32 samples: 4 steps
    assert max(gaps[:epoch_turn]) < 1e-5 < 1e-3 < gaps[epoch_turn]
    assert f"(step {epoch_turn} of {len(gaps)})" in broken_runs.case("no-set-epoch").symptom   # the table's words


def test_the_bf16_runs_reduce_half_the_bytes_and_leave_fp32_rounding():
    from distlab import comm, models

    broken_runs = registry()
    case = broken_runs.case("bf16-gradient-reduction")
    full = comm.zero_step_bytes(models.preset("tiny").num_params(), 3)["reduce_scatter"]
    rows = json.loads(figures.BROKEN_BF16.read_text())["rows"]
    assert sorted({r["world_size"] for r in rows}) == list(figures.BF16_WORLD_SIZES)
    for row in rows:
        bf16 = row["reduce_dtype"] == "bf16"
        assert row["argv"] == list(case.args if bf16 else case.fixed_args)
        assert row["reduce_scatter_bytes"] == (full // 2 if bf16 else full)
        assert row["gradient_passed"] is not bf16
        assert (row["gradient_diff"] > 1e-5) is bf16


def test_the_pipeline_timelines_are_the_registrys_runs_and_hold_their_bubble():
    from distlab import schedules

    broken_runs = registry()
    case = broken_runs.case("too-few-microbatches")
    runs = json.loads(figures.BROKEN_BUBBLE.read_text())["runs"]
    assert [r["argv"] for r in runs] == [list(case.args), list(case.fixed_args)]
    for run in runs:
        events = schedules.from_dicts(run["timeline"])
        assert len(events) == 2 * run["microbatches"] * run["stages"]     # one F and one B a microbatch a stage
        assert schedules.bubble_fraction_from_timeline(events, run["stages"]) == pytest.approx(
            run["bubble"]["measured"])
        assert run["bubble"]["formula"] == pytest.approx(schedules.bubble_fraction(run["stages"], run["microbatches"]))
    assert runs[0]["bubble"]["measured"] > 0.4 >= runs[1]["bubble"]["measured"]   # the --max-bubble target


def test_the_straggler_and_the_hang_are_what_the_registry_and_the_diagnosis_say():
    from distlab import hangs

    broken_runs = registry()
    run = json.loads(figures.BROKEN_STRAGGLER.read_text())
    assert run["slow"]["argv"] == list(broken_runs.case("slow-rank").args)
    # the planted straggler computes longer (real work, not a sleep that would show as idle); the others wait
    computing = {r["rank"]: r["compute"] / r["steps"] for r in run["slow"]["ranks"]}
    waiting = {r["rank"]: r["communication"] / r["steps"] for r in run["slow"]["ranks"]}
    slow = max(computing, key=computing.get)
    assert slow == 1 and all(waiting[r] > 0.2 > waiting[slow] for r in waiting if r != slow)
    assert all(computing[slow] > computing[r] + 0.1 for r in computing if r != slow), computing   # a third of 0.3 s
    hang = broken_runs.case("uneven-inputs")
    assert run["hang"]["argv"] == list(hang.args)
    found = hangs.diagnose({int(r): j for r, j in run["hang"]["journals"].items()})
    assert (found["cause"], found["verdict"]) == (run["hang"]["cause"], run["hang"]["verdict"]) and \
        found["cause"] == hang.hang_cause
    states = sorted(j["state"] for j in run["hang"]["journals"].values())
    assert states == ["finished", "timed out", "timed out", "timed out"]


def test_the_resumes_jump_where_the_chapter_says_and_the_fixed_ones_do_not():
    broken_runs = registry()
    run = json.loads(figures.BROKEN_RESUMES.read_text())
    shard, one_shard = run["checkpoint-one-shard"], broken_runs.case("checkpoint-one-shard")
    assert (shard["broken"]["argv"], shard["fixed"]["argv"]) == (list(one_shard.args), list(one_shard.fixed_args))
    uninterrupted = shard["uninterrupted"]
    for step, loss in shard["fixed"]["losses_by_step"].items():
        assert abs(loss - uninterrupted[int(step)]) < 1e-5                       # DCP's resume: one device's curve
    gaps = {int(s): abs(loss - uninterrupted[int(s)]) for s, loss in shard["broken"]["losses_by_step"].items()}
    assert max(gaps.values()) == pytest.approx(shard["jump"]) == pytest.approx(gaps[shard["first_step"]])
    rng, case = run["resume-without-rng"], broken_runs.case("resume-without-rng")
    assert (rng["broken"]["argv"], rng["fixed"]["argv"]) == (list(case.args), list(case.fixed_args))
    resumed = min(rng["steps_trained_twice"])
    assert rng["broken"]["losses"][:resumed] == rng["fixed"]["losses"][:resumed]   # the same until the resume
    assert abs(rng["broken"]["losses"][resumed] - rng["fixed"]["losses"][resumed]) > 0.05


def test_the_numbers_of_the_registrys_symptoms_are_these_measurements():
    """The diagnosis table prints the registry's symptoms: the numbers they state that these runs measured."""
    from distlab import schedules

    broken_runs = registry()
    rows = json.loads(figures.BROKEN_BF16.read_text())["rows"]
    at = {(r["world_size"], r["reduce_dtype"]): r["gradient_diff"] for r in rows}
    symptom = broken_runs.case("bf16-gradient-reduction").symptom
    bf16 = [v for (_, dtype), v in at.items() if dtype == "bf16"]
    fp32 = max(v for (_, dtype), v in at.items() if dtype == "fp32")
    sizes = sorted({world for world, _ in at})
    assert f"by {min(bf16):.1e} to {max(bf16):.1e} on {sizes[0]} to {sizes[-1]} ranks, where fp32 rounding leaves " \
        f"{fp32:.1e}".replace("e-0", "e-") in symptom
    # 8 ranks measure no more than 4: growth with the rank count is not a symptom to rely on; bf16 keeps 8 bits
    assert "more on 4 ranks than on 2" not in symptom and at[8, "bf16"] <= at[4, "bf16"]
    assert "8 significant bits" in broken_runs.case("bf16-gradient-reduction").cause
    bubble = broken_runs.case("too-few-microbatches")
    assert f"idle {100 * schedules.bubble_fraction(4, 2):.0f}% of the step" in bubble.symptom
    assert [f"= {100 * schedules.bubble_fraction(4, 4):.0f}% idle" in why for _, why in bubble.wrong_fixes] == [True]
    source = (figures.FIGURE_DATA.parents[2] / "scripts" / "12_hpc_operations" / "profile_step.py").read_text()
    # the straggler's 0.3 s is the work it is given (its cause); its trace shows less of it as compute (chapter 14's
    # text test measures how much), so the symptom states no number of seconds
    slow = broken_runs.case("slow-rank")
    assert "SLOW_RANK, SLOW_RANK_SECONDS = 1, 0.3" in source and "given 0.3 s of extra work" in slow.cause
    assert not re.search(r"\d s\b", slow.symptom), slow.symptom
    assert broken_runs.HANG_TIMEOUT == ("--pg-timeout", "2") and "(2 s)" in broken_runs.case("uneven-inputs").symptom
    resumes = json.loads(figures.BROKEN_RESUMES.read_text())
    assert f"({resumes['checkpoint-one-shard']['jump']:.2f} above" in \
        broken_runs.case("checkpoint-one-shard").symptom   # the chapter's 0.39, not a rounder 0.4
    assert f"({resumes['resume-without-rng']['jump']:.2f} apart)" in broken_runs.case("resume-without-rng").symptom
