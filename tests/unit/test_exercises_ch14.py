"""Chapter 14's exercise checks (labkit.exercises.ch14): the diagnosis rejects every look-alike of every case with a
reason that teaches, each fix check rejects the plausible wrong fixes before any run, and a right fix passes only
when the run launched again shows the symptom gone. The runs here are hand-made metrics (no launch): the real runs
are tests/scripts/test_14's and the lab's (nbval)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from labkit import broken_runs
from labkit.exercises import ch14
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong

ROOT = Path(__file__).resolve().parents[2]
NAMES = [run.name for run in broken_runs.BROKEN_RUNS]


@pytest.fixture(autouse=True)
def raise_when_incomplete(monkeypatch):
    monkeypatch.setenv("DISTLAB_INCOMPLETE_EXERCISE", "raise")


def test_every_case_has_a_label_a_part_and_a_menu_entry():
    assert sorted(ch14.LABELS.values()) == sorted(NAMES)
    assert sorted(label for labels in ch14.PARTS.values() for label in labels) == sorted(ch14.LABELS)
    assert set(NAMES) <= set(ch14.CAUSES)
    for run in broken_runs.BROKEN_RUNS:   # every look-alike of the registry is on the menu
        assert all(ch14.look_alike_key(words) in ch14.CAUSES for words in run.look_alikes), run.name


def _right_diagnoses(part):
    return {label: ch14.LABELS[label] for label in ch14.PARTS[part]}


@pytest.mark.parametrize("part", list(ch14.PARTS))
def test_the_right_diagnoses_pass(part, capsys):
    ch14.check_diagnoses(_right_diagnoses(part), part)
    assert capsys.readouterr().out.startswith("Correct:")


@pytest.mark.parametrize("label", list(ch14.LABELS))
def test_every_look_alike_is_rejected_with_what_tells_them_apart(label):
    run = broken_runs.case(ch14.LABELS[label])
    part = next(p for p, labels in ch14.PARTS.items() if label in labels)
    for words in run.look_alikes:
        answer = ch14.look_alike_key(words)
        with pytest.raises(ExerciseWrong) as wrong:
            ch14.check_diagnoses({**_right_diagnoses(part), label: answer}, part)
        assert "look-alike" in str(wrong.value) and run.tell_apart in str(wrong.value), str(wrong.value)


def test_another_wrong_cause_and_an_unknown_key_are_rejected():
    with pytest.raises(ExerciseWrong, match="three questions"):
        ch14.check_diagnoses({**_right_diagnoses("stuck or slow"), "run 2": "checkpoint-one-shard"}, "stuck or slow")
    with pytest.raises(ExerciseWrong, match="not a key"):
        ch14.check_diagnoses({**_right_diagnoses("stuck or slow"), "run 2": "it is slow"}, "stuck or slow")


def test_an_unnamed_run_is_not_written_yet():
    with pytest.raises(ExerciseIncomplete, match="run 3"):
        ch14.check_diagnoses({**_right_diagnoses("stuck or slow"), "run 3": ...}, "stuck or slow")
    with pytest.raises(ExerciseIncomplete):
        ch14.check_diagnoses(None, "stuck or slow")


# ---- the fixes: (check, right answer, plausible wrong answers), one entry per case --------------------------------

class _Bug:   # the broken program of mismatched-collectives: rank 0 broadcasts where the others all-reduce
    @staticmethod
    def sync(rank, tensor, collectives):
        if rank == 0:
            collectives.broadcast(tensor, src=0)
        else:
            collectives.all_reduce(tensor)


def _epoch_without_set_epoch(sampler, epoch):
    return list(sampler)


def _own_permutation(sampler, epoch):   # shuffles by itself: ranks no longer cut one permutation
    order = torch.randperm(len(list(sampler)), generator=torch.Generator().manual_seed(epoch)).tolist()
    return [list(sampler)[i] for i in order]


PROFILE = [{"rank": r, "kinds": {"compute": 0.01, "communication": c, "overlapped": 0.0, "idle": i},
            "before_sync_seconds": 0.31 if r == 1 else 0.01}   # rank 1 reaches backward's all-reduces last
           for r, (i, c) in enumerate(((0.0, 0.6), (0.6, 0.05), (0.01, 0.6), (0.0, 0.6)))]

FIXES = {
    "mismatched-collectives": (ch14.check_fix_collectives, lambda rank, t, c: c.all_reduce(t),
                               [_Bug.sync, lambda rank, t, c: None]),
    "slow-rank": (lambda f: ch14.check_fix_straggler(f, PROFILE),
                  lambda rows: max(rows, key=lambda r: r["kinds"]["idle"])["rank"],
                  [lambda rows: max(rows, key=lambda r: r["kinds"]["communication"])["rank"]]),
    "uneven-inputs": (ch14.check_fix_uneven, min, [max, lambda counts: sum(counts) // len(counts)]),
    "too-few-microbatches": (ch14.check_fix_microbatches, 8, [2, 4, 2.5, "8", 6, 32]),
    "fsdp-before-tp": (ch14.check_fix_wrapper_order, ["tp", "fsdp"], [["fsdp", "tp"], ["tp"]]),
    "loss-on-wrong-stage": (ch14.check_fix_loss_rank, lambda stages, world: (stages - 1) % world,
                            [lambda stages, world: 0, lambda stages, world: stages - 1]),
    "same-samples-every-rank": (
        ch14.check_fix_sampler, lambda d, rank, world: DistributedSampler(d, num_replicas=world, rank=rank, seed=0),
        [lambda d, rank, world: DistributedSampler(d, num_replicas=world, rank=0),
         lambda d, rank, world: DistributedSampler(d, num_replicas=world, rank=0, shuffle=False),
         lambda d, rank, world: DistributedSampler(d, num_replicas=world, rank=rank, seed=rank)]),
    "accumulation-never-syncs": (ch14.check_fix_accumulation, lambda i, n: i == n - 1,
                                 [lambda i, n: False, lambda i, n: True, lambda i, n: i == 0]),
    "no-set-epoch": (ch14.check_fix_set_epoch, lambda s, e: (s.set_epoch(e), list(s))[1],
                     [_epoch_without_set_epoch, _own_permutation]),
    "loss-averaged-twice": (ch14.check_fix_loss_scale, lambda n: (1.0, 1.0 / n),
                            [lambda n: (1.0 / n, 1.0 / n), lambda n: (1.0, 1.0), lambda n: 1.0 / n]),
    "bf16-gradient-reduction": (ch14.check_fix_reduce_dtype, torch.float32, [torch.bfloat16, torch.float16]),
    "tp-on-dp-group": (ch14.check_fix_tp_group, lambda rank, dp, tp: list(range(rank // tp * tp, rank // tp * tp + tp)),
                       [lambda rank, dp, tp: [rank % tp + i * tp for i in range(dp)], lambda rank, dp, tp: rank]),
    "checkpoint-one-shard": (ch14.check_fix_full_state, lambda shards: torch.cat(shards, dim=0),
                             [lambda shards: shards[0], lambda shards: torch.cat(shards, dim=-1),
                              lambda shards: torch.stack(shards)]),
    "resume-without-rng": (ch14.check_fix_resume_state, {"model", "optimizer", "step", "rng", "data_position"},
                           [{"model", "optimizer", "step"}, {"model", "optimizer", "step", "data_position"},
                            {"model", "optimizer", "step", "rng"}]),
}


def test_every_case_has_a_graded_fix():
    assert set(FIXES) == set(NAMES)


def _metrics(run, fixed: bool) -> dict:
    """What the run's metrics say: its symptom's checks failing (broken) or passing (fixed); a hang's diagnosis."""
    checks = [{"name": f"{prefix} (hand-made)", "passed": fixed} for prefix in run.failing_checks]
    checks.append({"name": "the run ended by itself", "passed": True})
    return {"checks": checks, "extra": {"cause": "none" if fixed else run.hang_cause}}


@pytest.fixture
def launched(monkeypatch):
    """Replace the launch: ``launched.fixed`` decides what the run shows; ``launched.calls`` records each launch."""
    state = SimpleNamespace(fixed=True, calls=[], also_failed=[])

    def run(name, fixed=False, args=None):
        case = broken_runs.case(ch14.LABELS.get(name, name))
        state.calls.append((case.name, fixed, args))
        metrics = _metrics(case, state.fixed)
        metrics["checks"] += [{"name": failed, "passed": False} for failed in state.also_failed]
        return SimpleNamespace(metrics=metrics)

    monkeypatch.setattr(ch14, "run", run)
    return state


@pytest.mark.parametrize("name", NAMES)
def test_a_plausible_wrong_fix_fails_before_any_run(name, launched):
    check, _, wrong_answers = FIXES[name]
    assert wrong_answers
    for answer in wrong_answers:
        with pytest.raises(ExerciseWrong):
            check(answer)
    assert not launched.calls   # each was caught on the hand-made cases, no job run for it


@pytest.mark.parametrize("name", NAMES)
def test_the_right_fix_passes_only_when_the_run_again_has_lost_its_symptom(name, launched, capsys):
    check, right, _ = FIXES[name]
    check(right)
    assert capsys.readouterr().out.startswith("Correct:")
    assert launched.calls and launched.calls[-1][0] == name
    launched.fixed = False   # the same answer, but the run still shows the symptom: the check must fail
    with pytest.raises(ExerciseWrong, match="still fails"):
        check(right)


def test_the_lab_runs_straggler_is_the_rank_measured_last_not_the_answers_own_formula(launched):
    """The lab's run is judged by the rank that reached backward's all-reduces last (profile_step's measure), not by
    the model answer's formula over the kinds: a formula that names another rank fails."""
    def by_kinds(rows):
        return max(rows, key=lambda r: r["kinds"]["idle"] - r["kinds"]["communication"])["rank"]

    measured = [dict(row, before_sync_seconds=0.31 if row["rank"] == 3 else 0.01) for row in PROFILE]
    with pytest.raises(ExerciseWrong, match="the lab's run: rank 1, expected rank 3"):
        ch14.check_fix_straggler(by_kinds, measured)


def test_only_the_timing_models_own_check_is_not_judged(launched, capsys):
    """A loaded machine can fail pp_schedules' measured-against-simulated bubble: not the symptom, not one device."""
    launched.also_failed = ["measured bubble equals the simulated one (this run's pass times and latency)"]
    ch14.check_fix_microbatches(8)
    assert capsys.readouterr().out.startswith("Correct:")
    launched.also_failed = ["losses equal the single-device model's"]
    with pytest.raises(ExerciseWrong, match="single-device"):
        ch14.check_fix_microbatches(8)


def test_the_timed_fixes_are_test_14s(monkeypatch):
    """The fixes judged by a time stay out of make test's launch cache: test_14 runs them with the machine to itself."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "scripts"))
    from test_14_when_it_goes_wrong import TIMED

    assert set(ch14.TIMED) == set(TIMED)


def test_a_timed_fix_runs_outside_the_launch_cache(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setenv(ch14.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(ch14.forkserver.ENABLE_ENV, ch14.os.environ.get(ch14.forkserver.ENABLE_ENV, "0"))
    monkeypatch.setattr(ch14.broken_runs, "run_case",
                        lambda name, **kwargs: seen.append((name, ch14.os.environ.get(ch14.CACHE_ENV))))
    monkeypatch.setattr(ch14, "_RUNS", {})
    ch14.run("too-few-microbatches")                 # the broken run: replayed as usual
    ch14.run("too-few-microbatches", fixed=True)     # its fix: judged by a time, never cached
    ch14.run("no-set-epoch", fixed=True)
    assert seen == [("too-few-microbatches", str(tmp_path)), ("too-few-microbatches", None),
                    ("no-set-epoch", str(tmp_path))]
    assert ch14.os.environ[ch14.CACHE_ENV] == str(tmp_path)


def test_the_microbatches_setting_is_what_runs_again(launched):
    ch14.check_fix_microbatches(8)
    (name, fixed, args), = launched.calls
    assert args == broken_runs.case(name).fixed_args   # 8 is the registry's fixed run: the same launch as test_14's


def test_a_stub_is_not_written_yet():
    def stub(*args):
        raise NotImplementedError

    for name, (check, right, _) in FIXES.items():
        with pytest.raises(ExerciseIncomplete):
            check(None if not callable(right) or name == "bf16-gradient-reduction" else stub)


def test_the_learners_copy_does_not_name_the_cases():
    """The lab shows the runs under labels: a case's name is its diagnosis, so the learner's copy never says it."""
    copy = json.loads((ROOT / "notebooks" / "student" / "14_when_it_goes_wrong.ipynb").read_text())
    text = "\n".join("".join(cell["source"]) for cell in copy["cells"])
    assert not [name for name in NAMES if name in text]


def test_the_lab_says_the_job_run_again_is_the_scripts_fix():
    """A fix the learner writes as a function is judged on hand-made cases; the job launched again is the script's
    own fixed run (only the microbatches go in as a flag): the lab must not let a learner think their code ran."""
    lab = json.loads((ROOT / "notebooks" / "14_when_it_goes_wrong.ipynb").read_text())
    opening = "".join(lab["cells"][0]["source"]).replace("\n", " ")
    assert "fixed in the script" in opening and "not inside the job" in opening
