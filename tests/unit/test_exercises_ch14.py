"""Chapter 14's exercise checks (labkit.exercises.ch14): the diagnosis rejects every look-alike of every case with a
reason that teaches, each fix check rejects the plausible wrong fixes before any run, and a right fix passes only
when the run launched again shows the symptom gone. The runs here are hand-made metrics (no launch): the real runs
are tests/scripts/test_14's and the lab's (nbval)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from labkit import broken_runs
from labkit.exercises import ch14
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong

ROOT = Path(__file__).resolve().parents[2]
NAMES = [run.name for run in broken_runs.BROKEN_RUNS]
# The answer key, kept here (tests are not importable from labkit): the lab's runs in order.
ANSWERS = dict(zip([f"run {i}" for i in range(1, 22)], (
    "mismatched-collectives", "slow-rank", "uneven-inputs", "too-few-microbatches", "fsdp-before-tp",
    "loss-on-wrong-stage", "same-samples-every-rank", "accumulation-never-syncs", "no-set-epoch",
    "loss-averaged-twice", "bf16-gradient-reduction", "data-by-global-rank", "checkpoint-one-shard",
    "resume-without-rng", "optimizer-before-sharding", "rank-0-evaluation", "full-state-on-rank-0",
    "per-rank-init", "local-grad-norm", "nan-from-one-rank", "unused-parameter")))


@pytest.fixture(autouse=True)
def raise_when_incomplete(monkeypatch):
    monkeypatch.setenv("DISTLAB_INCOMPLETE_EXERCISE", "raise")


def test_every_case_has_a_label_a_part_and_a_menu_entry():
    assert tuple(ANSWERS) == ch14.LABELS and {label: ch14._case(label).name for label in ch14.LABELS} == ANSWERS
    assert sorted(ANSWERS.values()) == sorted(NAMES)
    assert sorted(label for labels in ch14.PARTS.values() for label in labels) == sorted(ch14.LABELS)
    assert set(NAMES) <= set(ch14.CAUSES)
    for run in broken_runs.BROKEN_RUNS:   # every look-alike of the registry is on the menu
        assert all(ch14.look_alike_key(words) in ch14.CAUSES for words in run.look_alikes), run.name


def _right_diagnoses(part):
    return {label: ANSWERS[label] for label in ch14.PARTS[part]}


@pytest.mark.parametrize("part", list(ch14.PARTS))
def test_the_right_diagnoses_pass(part, capsys):
    ch14.check_diagnoses(_right_diagnoses(part), part)
    assert capsys.readouterr().out.startswith("Correct:")


@pytest.mark.parametrize("label", list(ch14.LABELS))
def test_every_look_alike_is_rejected_pointing_at_the_evidence_not_at_the_answer(label):
    run = broken_runs.case(ANSWERS[label])
    part = next(p for p, labels in ch14.PARTS.items() if label in labels)
    for words in run.look_alikes:
        answer = ch14.look_alike_key(words)
        with pytest.raises(ExerciseWrong) as wrong:
            ch14.check_diagnoses({**_right_diagnoses(part), label: answer}, part)
        said = str(wrong.value)
        assert "look alike" in said and ch14._evidence(run) in said and ch14._evidence(run), said
        assert run.name not in said and run.tell_apart not in said and run.cause not in said, said


def _answers_from(value):
    """Every way a value importable from labkit could be read as the lab's answers: by label, or in order."""
    labels = ch14.LABELS
    if isinstance(value, dict):
        yield {label: value.get(label) for label in labels}
        yield dict(zip(labels, value.values()))
        yield dict(zip(labels, value.keys()))
    if isinstance(value, (list, tuple)):
        yield dict(zip(labels, value))
        yield dict(zip(labels, (getattr(v, "name", v) for v in value)))


def test_no_answer_built_from_what_labkit_exports_passes_a_part():
    """The learner's copy imports labkit: no label-to-case map, list of cases in the lab's order or tell-apart text
    there may pass check_diagnoses (the right answers, from this file, do)."""
    import importlib

    modules = [importlib.import_module(name) for name in (
        "labkit.exercises.ch14", "labkit.broken_runs", "labkit.diagnosis_sources", "labkit.diagnosis_table",
        "labkit.exercises.checks", "labkit.exercises")]
    tried = 0
    for module in modules:
        for attribute, value in vars(module).items():
            for answers in _answers_from(value):
                answers = {k: v for k, v in answers.items() if isinstance(v, str) and v in ch14.CAUSES}
                for part, labels in ch14.PARTS.items():
                    if all(label in answers for label in labels):
                        tried += 1
                        assert any(ch14.diagnosis_feedback(label, answers[label]) for label in labels), \
                            f"{module.__name__}.{attribute} answers part {part!r}"
    assert tried   # the registry's own order, at least, was tried
    for part in ch14.PARTS:
        assert not any(ch14.diagnosis_feedback(label, ANSWERS[label]) for label in ch14.PARTS[part])


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


class _Shard:   # data_shard(mesh) -> (index, count), run inside the job (fsdp_tp_hybrid.py --data-shard-from)
    @staticmethod
    def right(mesh):
        return mesh.get_local_rank("dp"), mesh["dp"].size()

    @staticmethod
    def global_rank(mesh):   # the bug: DistributedSampler's defaults
        return dist.get_rank(), dist.get_world_size()

    @staticmethod
    def rank_mod_dp(mesh):   # a grid laid out the other way from the mesh's
        return dist.get_rank() % mesh["dp"].size(), mesh["dp"].size()


class _Wrappers:   # apply_wrappers(tp, fsdp), run inside the job (fsdp_tp_hybrid.py --wrappers-from)
    @staticmethod
    def right(tp, fsdp):
        tp("tp")
        fsdp("dp")

    @staticmethod
    def fsdp_first(tp, fsdp):
        fsdp("dp")
        tp("tp")

    @staticmethod
    def tp_only(tp, fsdp):
        tp("tp")


class _Optimizer:   # shard_and_optimizer(model, shard, adamw), run inside the job (train_fsdp.py --optimizer-from)
    @staticmethod
    def right(model, shard, adamw):
        shard(model)
        return adamw(model.parameters())

    @staticmethod
    def optimizer_first(model, shard, adamw):
        optimizer = adamw(model.parameters())
        shard(model)
        return optimizer


class _Seed:   # model_seed(seed, rank), run inside the job (train_fsdp.py --model-seed-from)
    @staticmethod
    def right(seed, rank):
        return seed

    @staticmethod
    def per_rank(seed, rank):   # the bug: caught on hand-made ranks, before any launch
        return seed + rank

    @staticmethod
    def same_but_not_the_runs(seed, rank):   # the replicas agree, but the model is not the run's --seed's
        return seed + 1


def _first_nonfinite(rank_losses):
    for step, losses in enumerate(rank_losses):
        for rank, loss in enumerate(losses):
            if not math.isfinite(loss):
                return step, rank
    return None


def _first_all_nonfinite(rank_losses):   # the step every rank shows: after the all-reduce, too late
    for step, losses in enumerate(rank_losses):
        if not any(map(math.isfinite, losses)):
            return step, 0
    return None


def _first_nan_only(rank_losses):   # misses an inf
    for step, losses in enumerate(rank_losses):
        for rank, loss in enumerate(losses):
            if math.isnan(loss):
                return step, rank
    return None


def _last_rank_first_seen(rank_losses):   # the right step, the last non-finite rank of it: right unless two are
    for step, losses in enumerate(rank_losses):
        bad = [rank for rank, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:
            return step, len(losses) - 1
    return None


class _Clip:   # clip_gradients(model, max_norm), run inside the job (train_fsdp.py --clip-from)
    @staticmethod
    def right(model, max_norm):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    @staticmethod
    def local_shards(model, max_norm):   # the bug: each rank's own norm
        local = [p.grad.to_local() for p in model.parameters()]
        norm = torch.nn.utils.get_total_norm(local)
        torch._foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm


class _SaveModel:   # save_model(rank, gather_full_state, save): the end of an FSDP2 run, on every rank
    @staticmethod
    def right(rank, gather_full_state, save):
        state = gather_full_state()
        if rank == 0:
            save(state)

    @staticmethod
    def rank_0_only(rank, gather_full_state, save):   # the bug: the collective under `if rank == 0:`
        if rank == 0:
            save(gather_full_state())

    @staticmethod
    def every_rank_saves(rank, gather_full_state, save):
        save(gather_full_state())

    @staticmethod
    def gathers_twice_on_0(rank, gather_full_state, save):
        state = gather_full_state()
        if rank == 0:
            save(gather_full_state())


IN_THE_JOB = {"data-by-global-rank": "--data-shard-from", "fsdp-before-tp": "--wrappers-from",
              "optimizer-before-sharding": "--optimizer-from", "per-rank-init": "--model-seed-from",
              "local-grad-norm": "--clip-from"}


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
    "fsdp-before-tp": (ch14.check_fix_wrappers, _Wrappers.right, [_Wrappers.fsdp_first, _Wrappers.tp_only]),
    "loss-on-wrong-stage": (ch14.check_fix_loss_rank, lambda stage_ranks: stage_ranks[-1],
                            [lambda stage_ranks: 0, lambda stage_ranks: max(stage_ranks),   # world_size - 1: not V
                             lambda stage_ranks: (len(stage_ranks) - 1) % (max(stage_ranks) + 1)]),
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
    "data-by-global-rank": (ch14.check_fix_data_shard, _Shard.right, [_Shard.global_rank, _Shard.rank_mod_dp]),
    "optimizer-before-sharding": (ch14.check_fix_optimizer_order, _Optimizer.right, [_Optimizer.optimizer_first]),
    "checkpoint-one-shard": (ch14.check_fix_full_state, lambda shards: torch.cat(shards, dim=0),
                             [lambda shards: shards[0], lambda shards: torch.cat(shards, dim=-1),
                              lambda shards: torch.stack(shards)]),
    "resume-without-rng": (ch14.check_fix_resume_state, {"model", "optimizer", "step", "rng", "data_position"},
                           [{"model", "optimizer", "step"}, {"model", "optimizer", "step", "data_position"},
                            {"model", "optimizer", "step", "rng"},
                            {"model", "optimizer", "step", "rng", "data_position", "loss_history"}]),
    "unused-parameter": (ch14.check_fix_without_gradient,
                         lambda grads: sorted(name for name, grad in grads.items() if grad is None),
                         [lambda grads: sorted(n for n, g in grads.items() if g is None or not g.any()),   # zeros
                          lambda grads: [n for n, g in grads.items() if g is not None],
                          lambda grads: [n for n, g in grads.items() if g is None][:1]]),
    "nan-from-one-rank": (ch14.check_fix_first_nonfinite, _first_nonfinite,
                          [_first_all_nonfinite, _first_nan_only, _last_rank_first_seen]),
    "local-grad-norm": (ch14.check_fix_clip, _Clip.right, [_Clip.local_shards]),
    "per-rank-init": (ch14.check_fix_model_seed, _Seed.right, [_Seed.same_but_not_the_runs]),
    "full-state-on-rank-0": (ch14.check_fix_full_state_save, _SaveModel.right,
                             [_SaveModel.rank_0_only, _SaveModel.every_rank_saves, _SaveModel.gathers_twice_on_0]),
    "rank-0-evaluation": (ch14.check_fix_evaluation, lambda n, rank, world: list(range(rank, n, world)),
                          [lambda n, rank, world: list(range(n)) if rank == 0 else [],
                           lambda n, rank, world: list(range(n)),
                           lambda n, rank, world: list(range(rank * (n // world), (rank + 1) * (n // world))),
                           lambda n, rank, world: [b for b in range(n) if b % world == rank] + ([0] if rank else [])]),
}


def test_every_case_has_a_graded_fix():
    assert set(FIXES) == set(NAMES)


def _metrics(run, fixed: bool) -> dict:
    """What the run's metrics say: its symptom's checks failing (broken) or passing (fixed); a hang's diagnosis."""
    checks = [{"name": f"{prefix} (hand-made)", "passed": fixed} for prefix in run.failing_checks]
    checks.append({"name": "the run ended by itself", "passed": True})
    return {"checks": checks, "extra": {"cause": "none" if fixed else run.hang_cause}}


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Replace the launch: ``launched.fixed`` decides what the run shows; ``launched.calls`` records each launch."""
    state = SimpleNamespace(fixed=True, calls=[], also_failed=[])

    def run(name, fixed=False, args=None):
        case = ch14._case(name)
        state.calls.append((case.name, fixed, args))
        fixed_here = state.fixed if state.judge is None else state.judge(case, args)
        metrics = _metrics(case, fixed_here)
        metrics["checks"] += [{"name": failed, "passed": False} for failed in state.also_failed]
        return SimpleNamespace(metrics=metrics, returncode=0 if fixed_here else 1, seconds=1.0, rank_exit_codes={},
                               output="")

    state.judge = None
    monkeypatch.setattr(ch14, "_launch", run)
    monkeypatch.setattr(ch14, "LEARNER_DIR", tmp_path / "learner")
    return state


@pytest.mark.parametrize("name", [n for n in NAMES if n not in IN_THE_JOB])
def test_a_plausible_wrong_fix_fails_before_any_run(name, launched):
    check, _, wrong_answers = FIXES[name]
    assert wrong_answers
    for answer in wrong_answers:
        with pytest.raises(ExerciseWrong):
            check(answer)
    assert not launched.calls   # each was caught on the hand-made cases, no job run for it


@pytest.mark.parametrize("name", list(IN_THE_JOB))
def test_a_fix_run_inside_the_job_is_the_learners_own_code(name, launched):
    """The job gets the learner's function as a file (its flag), named by its text: the right one and each wrong
    one are launched as themselves, and the job's verdict is the check's (the real jobs: tests/scripts/test_14)."""
    check, right, wrong_answers = FIXES[name]
    launched.judge = lambda case, args: open(args[args.index(IN_THE_JOB[name]) + 1]).read().count("def right")
    check(right)
    paths = []
    for answer in wrong_answers:
        with pytest.raises(ExerciseWrong, match="still fails") as wrong:
            check(answer)
        assert name not in str(wrong.value)
        paths.append(launched.calls[-1][2][launched.calls[-1][2].index(IN_THE_JOB[name]) + 1])
    first = launched.calls[0][2]
    assert first[:-2] == broken_runs.case(name).fixed_args and "--planted-bug" not in first
    assert len({first[-1], *paths}) == 1 + len(wrong_answers)   # one file per version of the function
    with pytest.raises(ExerciseWrong, match="define it with def"):
        check(lambda *args: None)


def test_seeds_that_differ_between_ranks_are_caught_before_any_launch(launched):
    with pytest.raises(ExerciseWrong, match="start apart") as wrong:
        ch14.check_fix_model_seed(_Seed.per_rank)
    assert not launched.calls and "per-rank-init" not in str(wrong.value)


# The fixes whose answer goes into the job (a flag, or the learner's function loaded from a file); the others are
# judged on hand-made cases, and the job is not run again (it would not run the learner's code).
LAUNCHED = {"too-few-microbatches", *IN_THE_JOB}


@pytest.mark.parametrize("name", [n for n in NAMES if n not in LAUNCHED])
def test_a_fix_that_cannot_enter_the_job_is_judged_by_hand_without_a_launch(name, launched, capsys):
    check, right, _ = FIXES[name]
    check(right)
    said = capsys.readouterr().out
    assert said.startswith("Correct:") and "does not run in the job" in said and not launched.calls


@pytest.mark.parametrize("name", sorted(LAUNCHED))
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
    ch14._launch("too-few-microbatches")                 # the broken run: replayed as usual
    ch14._launch("too-few-microbatches", fixed=True)     # its fix: judged by a time, never cached
    ch14._launch("no-set-epoch", fixed=True)
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


def test_the_second_pass_checks_are_not_coin_flips_nor_name_the_bug(launched):
    """A V schedule's last stage is on rank 0 (world_size - 1 fails); every name at once is not a checkpoint's
    contents; the bf16 answer is pointed at its evidence, not told it is the bug."""
    with pytest.raises(ExerciseWrong, match=r"\[0, 1, 2, 3, 3, 2, 1, 0\]"):
        ch14.check_fix_loss_rank(lambda stage_ranks: max(stage_ranks))
    with pytest.raises(ExerciseWrong, match="leave out"):
        ch14.check_fix_resume_state({"model", "optimizer", "rng", "data_position", "step", "loss_history"})
    with pytest.raises(ExerciseWrong) as wrong:
        ch14.check_fix_reduce_dtype(torch.bfloat16)
    assert "bug" not in str(wrong.value) and "bf16" not in str(wrong.value) and "bytes" in str(wrong.value)
    assert not hasattr(ch14, "check_fix_wrapper_order")   # two orders: a coin flip; now a function run in the job


def test_the_learners_copy_does_not_name_the_cases():
    """The lab shows the runs under labels: a case's name is its diagnosis, so the learner's copy never says it."""
    copy = json.loads((ROOT / "notebooks" / "student" / "14_when_it_goes_wrong.ipynb").read_text())
    text = "\n".join("".join(cell["source"]) for cell in copy["cells"])
    assert not [name for name in NAMES if name in text]


def test_the_lab_says_which_fixes_run_inside_the_job():
    """Runs 5, 12, 15, 18 and 19's functions run inside the job; the others are tried on hand-made cases, then the script's own
    fixed run is launched: the lab must not let a learner think every function ran in the job."""
    lab = json.loads((ROOT / "notebooks" / "14_when_it_goes_wrong.ipynb").read_text())
    opening = " ".join("".join(lab["cells"][0]["source"]).split())
    assert "For runs 5, 12, 15, 18 and 19 the script loads your function itself" in opening and "the job is not run again with them" in opening
    in_job = sorted(label for label in ch14.LABELS if ANSWERS[label] in IN_THE_JOB)
    assert in_job == ["run 12", "run 15", "run 18", "run 19", "run 5"]


def test_every_fix_comes_after_every_diagnosis_and_its_prompt_starts_from_the_symptom():
    """A fix prompt says what to change, so it would sort the runs: the lab asks for the fixes once all are named."""
    lab = json.loads((ROOT / "notebooks" / "14_when_it_goes_wrong.ipynb").read_text())
    sources = ["".join(cell["source"]) for cell in lab["cells"]]
    diagnosed = {part: next(i for i, s in enumerate(sources) if "check_diagnoses(" in s and f'"{part}"' in s)
                 for part in ch14.PARTS}
    prompted = {label: next(i for i, s in enumerate(sources) if f"**{label.capitalize()}**" in s)
                for label in ch14.LABELS}
    for part, labels in ch14.PARTS.items():   # every fix asked before a part is named is another part's, named
        earlier = [label for label, i in prompted.items() if i < diagnosed[part]]
        assert all(diagnosed[next(p for p, ls in ch14.PARTS.items() if label in ls)] < prompted[label]
                   for label in earlier) and not set(earlier) & set(labels), (part, earlier)
    first_fix = min(i for i, s in enumerate(sources) if "check_fix_" in s)
    assert sum(i < first_fix for i in diagnosed.values()) >= 4   # the first parts are all named before any fix
    for label in ch14.LABELS:
        prompt = next(s for s in sources if f"**{label.capitalize()}**" in s)
        assert ANSWERS[label] not in prompt and "broadcast ... else" not in prompt, prompt
