"""Chapter 14's exercise checks (labkit.exercises.ch14): the diagnosis rejects every look-alike of every case with a
reason that teaches, each fix check rejects the plausible wrong fixes before any run, and a right fix passes only
when the run launched again shows the symptom gone. The runs here are hand-made metrics (no launch): the real runs
are tests/scripts/test_14's and the lab's (nbval)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from coursetools import chapters
from helpers import lab_cells
from labkit import broken_runs
from labkit.exercises import ch14
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong

ROOT = Path(__file__).resolve().parents[2]
NAMES = [run.name for run in broken_runs.BROKEN_RUNS]
# The answer key, kept here (tests are not importable from labkit): the lab's runs in order.
ANSWERS = dict(zip([f"run {i}" for i in range(1, 26)], (
    "mismatched-collectives", "slow-rank", "uneven-inputs", "too-few-microbatches", "fsdp-before-tp",
    "loss-on-wrong-stage", "same-samples-every-rank", "accumulation-never-syncs", "no-set-epoch",
    "loss-averaged-twice", "bf16-gradient-reduction", "data-by-global-rank", "checkpoint-one-shard",
    "resume-without-rng", "optimizer-before-sharding", "rank-0-evaluation", "full-state-on-rank-0",
    "per-rank-init", "local-grad-norm", "nan-from-one-rank", "unused-parameter", "global-batch-grows",
    "token-mean-per-micro-batch", "stage-grad-norm", "token-out-of-vocabulary")))


@pytest.fixture(autouse=True)
def raise_when_incomplete(monkeypatch):
    monkeypatch.setenv("DISTLAB_INCOMPLETE_EXERCISE", "raise")


def test_every_case_has_a_label_a_part_and_a_menu_entry():
    assert tuple(ANSWERS) == ch14.LABELS and {label: _name_of(label) for label in ch14.LABELS} == ANSWERS
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
        look = ch14._part_evidence(label)   # the part's evidence: the run's own among it, not it alone
        assert "look alike" in said and look in said and ch14._evidence(run), said
        assert all(words in look for words in ch14._evidence(run).split("; ")), (look, ch14._evidence(run))
        assert run.name not in said and run.tell_apart not in said and run.cause not in said, said


def _name_of(label):
    """A label's case, found as the module finds it: by the salted hash of its name."""
    return next(run.name for run in broken_runs.BROKEN_RUNS if ch14._token(run.name) == ch14._TOKENS[label])


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


def test_no_function_called_with_a_label_and_no_run_kept_names_the_labels_case(monkeypatch):
    """Beyond the values labkit exports: no function of the module, called with a label (its launches stubbed),
    returns that label's case or its name (``_case("run 25").name`` did), and after prefetch() the keys of the runs
    it keeps (_PENDING, then _RUNS) do not spell the arguments, which hold each run's --planted-bug in the lab's
    order."""
    import inspect
    import sys

    from labkit import launch

    def launched(name, fixed=False, args_override=None, extra_args=(), nproc=None, **kwargs):
        """What run_case returns, as the real one words it: the command with the case's flags, the output and the
        metrics the script writes (its planting line, its config)."""
        case = broken_runs.case(name)
        args = [str(a) for a in (args_override if args_override is not None else
                                 case.fixed_args if fixed else case.args)] + [str(a) for a in extra_args]
        return launch.LaunchResult([sys.executable, "-m", "labkit.forkrun", f"--nproc={nproc or case.nproc}",
                                    case.script, *args], 1, f"planting: {name}\nstep 0  loss 4.86\n", 1.0,
                                   {"config": {"planted_bug": name, "hang": name}, "checks": [], "extra": {}})

    monkeypatch.setattr(ch14, "_RUNS", {})
    monkeypatch.setattr(ch14, "_PENDING", {})
    monkeypatch.setattr(ch14.broken_runs, "run_case", launched)
    ch14.prefetch(workers=1)
    for future in list(ch14._PENDING.values()):
        future.result()
    for label in ch14.LABELS:
        result = ch14._launch(label)   # from _PENDING into _RUNS
        said = json.dumps([getattr(result, field) for field in ("command", "output", "metrics")], default=str)
        assert not [name for name in NAMES if name in said], (label, said)   # nor --planted-bug NAME, --hang NAME
    for result in ch14._RUNS.values():
        said = json.dumps([str(value) for value in vars(result).values()])
        assert not [name for name in NAMES if name in said], said
    kept = list(ch14._PENDING) + list(ch14._RUNS)
    assert kept and not [key for key in kept for name in NAMES if name in repr(key)], kept
    for values in (list(ch14._PENDING), list(ch14._RUNS)):
        for answers in _answers_from(values):
            assert not any(answers.get(label) == ANSWERS[label] for label in ch14.LABELS), values
    functions = [(name, f) for name, f in inspect.getmembers(ch14, inspect.isfunction) if f.__module__ == ch14.__name__]
    assert len(functions) > 10
    for name, function in functions:
        for label in ch14.LABELS:
            try:
                value = function(label)
            except Exception:   # noqa: BLE001 - a function that needs more, or another kind of argument
                continue
            assert getattr(value, "name", value) != ANSWERS[label], (name, label)
            assert not any(case in str(getattr(value, "__dict__", value)) for case in NAMES), (name, label)


def test_a_wrong_guess_points_at_evidence_no_one_run_of_its_part_has_alone():
    """The feedback on a wrong answer names what to look at again: the same for every run of the part, so that it
    cannot be mapped back to one case through the registry's evidence."""
    for part, labels in ch14.PARTS.items():
        looks = set()
        for label in labels:
            wrong = next(key for key in ch14.CAUSES if key not in NAMES)   # a distractor: wrong for every run
            said = ch14.diagnosis_feedback(label, wrong)
            looks.add(re.search(r"Look again at (.*): what does", said)[1])
        assert len(looks) == 1, (part, looks)


def test_a_network_failure_guessed_for_the_error_one_rank_raises_is_told_apart_by_that_error():
    """Review finding 6: the run of token-out-of-vocabulary shows gloo's 'Connection closed by peer' too, so what a
    network failure would show must name what this run has and a network failure has not: one rank's own error
    first."""
    label = next(label for label, name in ANSWERS.items() if name == "token-out-of-vocabulary")
    part = next(p for p, labels in ch14.PARTS.items() if label in labels)
    with pytest.raises(ExerciseWrong) as wrong:
        ch14.check_diagnoses({**_right_diagnoses(part), label: "network-failure"}, part)
    assert "no rank raising an error of its own" in str(wrong.value) and "token-out-of-vocabulary" not in \
        str(wrong.value)


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
# Every answer runs inside the job: a function from a file the script loads (its flag), a setting as a flag. The
# right answers and the wrong ones are functions defined with def (the job loads their source), named right_* and
# wrong_*: the stand-in launch below passes a run exactly when the file holds a right_* function.

def right_sync(rank, tensor, collectives):
    collectives.all_reduce(tensor)


def wrong_sync_rank_zero_broadcasts(rank, tensor, collectives):   # the broken program itself
    if rank == 0:
        collectives.broadcast(tensor, src=0)
    else:
        collectives.all_reduce(tensor)


def wrong_sync_nothing(rank, tensor, collectives):
    return None


def right_straggler(ranks):
    return min(ranks, key=lambda row: row["kinds"]["communication"])["rank"]


def wrong_straggler_most_waiting(ranks):   # the rank that waited longest: a victim
    return max(ranks, key=lambda row: row["kinds"]["communication"])["rank"]


def right_agreed_batches(batch_counts):
    return min(batch_counts)


def wrong_agreed_batches_longest(batch_counts):
    return max(batch_counts)


def wrong_agreed_batches_mean(batch_counts):
    return sum(batch_counts) // len(batch_counts)


def right_apply_wrappers(tp, fsdp):
    tp("tp")
    fsdp("dp")


def wrong_apply_wrappers_fsdp_first(tp, fsdp):
    fsdp("dp")
    tp("tp")


def wrong_apply_wrappers_tp_only(tp, fsdp):
    tp("tp")


def right_loss_rank(stage_ranks):
    return stage_ranks[-1]


def wrong_loss_rank_zero(stage_ranks):
    return 0


def wrong_loss_rank_last_rank(stage_ranks):   # world_size - 1: right for looped schedules only
    return max(stage_ranks)


def right_rank_sampler(dataset, rank, world_size):
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=0)


def wrong_rank_sampler_rank_zero(dataset, rank, world_size):
    return DistributedSampler(dataset, num_replicas=world_size, rank=0)


def wrong_rank_sampler_own_seed(dataset, rank, world_size):
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=rank)


def right_synchronises(micro_step, accumulation):
    return micro_step == accumulation - 1


def wrong_synchronises_never(micro_step, accumulation):
    return False


def wrong_synchronises_always(micro_step, accumulation):
    return True


def right_epoch_indices(sampler, epoch):
    sampler.set_epoch(epoch)
    return list(sampler)


def wrong_epoch_indices_no_set_epoch(sampler, epoch):
    return list(sampler)


def right_gradient_scales(world_size):
    return 1.0, 1.0 / world_size


def wrong_gradient_scales_twice(world_size):
    return 1.0 / world_size, 1.0 / world_size


def wrong_gradient_scales_sum(world_size):
    return 1.0, 1.0


def right_data_shard(mesh):
    return mesh.get_local_rank("dp"), mesh["dp"].size()


def wrong_data_shard_global_rank(mesh):   # the bug: DistributedSampler's defaults
    return dist.get_rank(), dist.get_world_size()


def wrong_data_shard_rank_mod_dp(mesh):   # a grid laid out the other way from the mesh's
    return dist.get_rank() % mesh["dp"].size(), mesh["dp"].size()


def right_shard_and_optimizer(model, shard, adamw):
    shard(model)
    return adamw(model.parameters())


def wrong_shard_and_optimizer_optimizer_first(model, shard, adamw):
    optimizer = adamw(model.parameters())
    shard(model)
    return optimizer


def right_full_from_shards(shards):
    return torch.cat(shards, dim=0)


def wrong_full_from_shards_rank_zero(shards):
    return shards[0]


def wrong_full_from_shards_last_dim(shards):
    return torch.cat(shards, dim=-1)


def right_save_model(rank, gather_full_state, save):
    state = gather_full_state()
    if rank == 0:
        save(state)


def wrong_save_model_rank_0_only(rank, gather_full_state, save):   # the bug: the collective under `if rank == 0:`
    if rank == 0:
        save(gather_full_state())


def wrong_save_model_every_rank_saves(rank, gather_full_state, save):
    save(gather_full_state())


def right_evaluation_share(batches, rank, world_size):
    return list(range(rank, batches, world_size))


def wrong_evaluation_share_rank_0(batches, rank, world_size):   # the bug itself
    return list(range(batches)) if rank == 0 else []


def wrong_evaluation_share_everything(batches, rank, world_size):
    return list(range(batches))


def right_model_seed(seed, rank):
    return seed


def wrong_model_seed_per_rank(seed, rank):   # the bug: the replicas start apart
    return seed + rank


def right_clip_gradients(model, max_norm):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def wrong_clip_gradients_local_shards(model, max_norm):   # the bug: each rank's own norm
    local = [p.grad.to_local() for p in model.parameters()]
    norm = torch.nn.utils.get_total_norm(local)
    torch._foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def right_without_gradient(grads):
    return sorted(name for name, grad in grads.items() if grad is None)


def wrong_without_gradient_first_only(grads):   # the head's weight, not its bias: a bucket still never completes
    return [name for name, grad in grads.items() if grad is None][:1]


def wrong_without_gradient_the_used_ones(grads):
    return [name for name, grad in grads.items() if grad is not None]


def right_micro_batch_size(global_batch, world_size, accumulation):
    return global_batch // (world_size * accumulation)


def wrong_micro_batch_size_recipes(global_batch, world_size, accumulation):   # the bug: the 2-rank recipe's
    return global_batch // (2 * accumulation)


def wrong_micro_batch_size_no_accumulation(global_batch, world_size, accumulation):
    return global_batch // world_size


def right_token_loss(per_token, mask, step_tokens, world_size):
    return (per_token * mask).sum() * world_size / step_tokens


def wrong_token_loss_own_mean(per_token, mask, step_tokens, world_size):   # the bug: each micro-batch's own mean
    return (per_token * mask).sum() / mask.sum()


def wrong_token_loss_no_world(per_token, mask, step_tokens, world_size):   # DDP's average divides by N again
    return (per_token * mask).sum() / step_tokens


def right_stage_clip(parameters, max_norm):
    parameters = list(parameters)
    total = sum(p.grad.double().pow(2).sum() for p in parameters)
    dist.all_reduce(total)
    norm = total.sqrt().item()
    for p in parameters:
        p.grad.mul_(min(1.0, max_norm / (norm + 1e-6)))
    return norm


def wrong_stage_clip_torchs_on_one_stage(parameters, max_norm):   # the bug: one stage's norm
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm).item()


def _first_nonfinite(rank_losses):
    for step, losses in enumerate(rank_losses):
        for rank, loss in enumerate(losses):
            if not math.isfinite(loss):
                return step, rank
    return None


def right_first_nonfinite(rank_losses):
    return _first_nonfinite(rank_losses)


def wrong_first_nonfinite_all_ranks(rank_losses):   # the step every rank shows: after the all-reduce, too late
    return _first_all_nonfinite(rank_losses)


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


def test_first_nonfinite_runs_in_the_job_then_on_made_up_runs_with_an_inf_and_with_none(launched):
    """The job's losses hold a nan, never an inf: a reading that skips infs passes in the job and fails on the made-up
    runs that follow it, one launch in all."""
    launched.judge = lambda case, args: True
    with pytest.raises(ExerciseWrong, match="Is inf non-finite too") as wrong:
        ch14.check_fix_first_nonfinite(_first_nan_only)
    assert len(launched.calls) == 1 and "nan-from-one-rank" not in str(wrong.value)
    (name, fixed, args), = launched.calls
    assert args[:len(broken_runs.case(name).args)] == broken_runs.case(name).args   # the run with its fault


def right_tokens_in_vocabulary(tokens, vocab_size):
    return ((tokens >= 0) & (tokens < vocab_size)).all(dim=1)


def wrong_tokens_in_vocabulary_off_by_one(tokens, vocab_size):   # lets id vocab_size through: the embedding raises
    return (tokens <= vocab_size).all(dim=1)


def wrong_tokens_in_vocabulary_too_strict(tokens, vocab_size):   # leaves out the sequences holding the last id too
    return (tokens < vocab_size - 1).all(dim=1)


def wrong_tokens_in_vocabulary_keep_all(tokens, vocab_size):
    return torch.ones(len(tokens), dtype=torch.bool)


RIGHT_HOLDS = {"model", "optimizer", "step", "rng", "data_position"}
FIXES = {
    "mismatched-collectives": (ch14.check_fix_collectives, right_sync,
                               [wrong_sync_rank_zero_broadcasts, wrong_sync_nothing]),
    "slow-rank": (ch14.check_fix_straggler, right_straggler, [wrong_straggler_most_waiting]),
    "uneven-inputs": (ch14.check_fix_uneven, right_agreed_batches,
                      [wrong_agreed_batches_longest, wrong_agreed_batches_mean]),
    "too-few-microbatches": (ch14.check_fix_microbatches, 8, [2, 4]),
    "fsdp-before-tp": (ch14.check_fix_wrappers, right_apply_wrappers,
                       [wrong_apply_wrappers_fsdp_first, wrong_apply_wrappers_tp_only]),
    "loss-on-wrong-stage": (ch14.check_fix_loss_rank, right_loss_rank,
                            [wrong_loss_rank_zero, wrong_loss_rank_last_rank]),
    "same-samples-every-rank": (ch14.check_fix_sampler, right_rank_sampler,
                                [wrong_rank_sampler_rank_zero, wrong_rank_sampler_own_seed]),
    "accumulation-never-syncs": (ch14.check_fix_accumulation, right_synchronises,
                                 [wrong_synchronises_never, wrong_synchronises_always]),
    "no-set-epoch": (ch14.check_fix_set_epoch, right_epoch_indices, [wrong_epoch_indices_no_set_epoch]),
    "loss-averaged-twice": (ch14.check_fix_loss_scale, right_gradient_scales,
                            [wrong_gradient_scales_twice, wrong_gradient_scales_sum]),
    "bf16-gradient-reduction": (ch14.check_fix_reduce_dtype, torch.float32, [torch.bfloat16, torch.float16]),
    "data-by-global-rank": (ch14.check_fix_data_shard, right_data_shard,
                            [wrong_data_shard_global_rank, wrong_data_shard_rank_mod_dp]),
    "optimizer-before-sharding": (ch14.check_fix_optimizer_order, right_shard_and_optimizer,
                                  [wrong_shard_and_optimizer_optimizer_first]),
    "checkpoint-one-shard": (ch14.check_fix_full_state, right_full_from_shards,
                             [wrong_full_from_shards_rank_zero, wrong_full_from_shards_last_dim]),
    "resume-without-rng": (ch14.check_fix_resume_state, RIGHT_HOLDS,
                           [{"model", "optimizer", "step"}, {"model", "optimizer", "step", "data_position"},
                            {"model", "optimizer", "step", "rng"}, set(ch14.CHECKPOINT_PARTS)]),
    "full-state-on-rank-0": (ch14.check_fix_full_state_save, right_save_model,
                             [wrong_save_model_rank_0_only, wrong_save_model_every_rank_saves]),
    "rank-0-evaluation": (ch14.check_fix_evaluation, right_evaluation_share,
                          [wrong_evaluation_share_rank_0, wrong_evaluation_share_everything]),
    "per-rank-init": (ch14.check_fix_model_seed, right_model_seed, [wrong_model_seed_per_rank]),
    "local-grad-norm": (ch14.check_fix_clip, right_clip_gradients, [wrong_clip_gradients_local_shards]),
    "unused-parameter": (ch14.check_fix_without_gradient, right_without_gradient,
                         [wrong_without_gradient_first_only, wrong_without_gradient_the_used_ones]),
    "nan-from-one-rank": (ch14.check_fix_first_nonfinite, right_first_nonfinite, [wrong_first_nonfinite_all_ranks]),
    "global-batch-grows": (ch14.check_fix_micro_batch, right_micro_batch_size,
                           [wrong_micro_batch_size_recipes, wrong_micro_batch_size_no_accumulation]),
    "token-mean-per-micro-batch": (ch14.check_fix_token_loss, right_token_loss,
                                   [wrong_token_loss_own_mean, wrong_token_loss_no_world]),
    "stage-grad-norm": (ch14.check_fix_stage_clip, right_stage_clip, [wrong_stage_clip_torchs_on_one_stage]),
    "token-out-of-vocabulary": (ch14.check_fix_tokens_in_vocabulary, right_tokens_in_vocabulary,
                                [wrong_tokens_in_vocabulary_off_by_one, wrong_tokens_in_vocabulary_too_strict,
                                 wrong_tokens_in_vocabulary_keep_all]),
}
# The flag that carries each answer into the job: a function's file, or a setting's value.
FLAGS = {name: "--fix-from" for name in FIXES}
FLAGS.update({"data-by-global-rank": "--data-shard-from", "fsdp-before-tp": "--wrappers-from",
              "optimizer-before-sharding": "--optimizer-from", "too-few-microbatches": "--microbatches",
              "bf16-gradient-reduction": "--reduce-dtype", "resume-without-rng": "--checkpoint-holds",
              "per-rank-init": "--model-seed-from", "local-grad-norm": "--clip-from"})
RIGHT_SETTINGS = {"--microbatches": "8", "--reduce-dtype": "float32", "--checkpoint-holds": ",".join(sorted(RIGHT_HOLDS))}


def test_every_case_has_a_graded_fix():
    assert set(FIXES) == set(NAMES)


def _metrics(run, fixed: bool) -> dict:
    """What the run's metrics say: its symptom's checks failing (broken) or passing (fixed); a hang's diagnosis."""
    def named(prefix):   # a check the lab renames keeps the beginning the lab knows it by
        return next((old for old in ch14.RENAMED_CHECKS if old.startswith(prefix)), prefix) + " (hand-made)"

    checks = [{"name": named(prefix), "passed": fixed} for prefix in run.failing_checks]
    checks += [{"name": named(prefix), "passed": True} for prefix in run.fixed_checks]
    if run.name == "nan-from-one-rank":   # the learner's reading, checked by the run that has the fault
        checks.append({"name": ch14.FIRST_NONFINITE_CHECK + " (hand-made)", "passed": fixed})
    if run.name == "token-out-of-vocabulary":   # the learner's guard, checked by the run that has the fault
        checks.append({"name": ch14.GUARD_CHECK + " (hand-made)", "passed": fixed})
    checks.append({"name": "the run ended by itself", "passed": True})
    return {"checks": checks, "extra": {"cause": "none" if fixed else run.hang_cause}}


def _answer(flag: str, args) -> str:
    """What a launch carried of the learner's answer: the value after ``flag``."""
    return args[list(args).index(flag) + 1]


def _judge_by_answer(case, args, flag):
    """A stand-in for the job's own checks: it passes exactly when the answer it was given is a right one."""
    value = _answer(flag, args)
    if flag in RIGHT_SETTINGS:
        return value == RIGHT_SETTINGS[flag]
    return "def right_" in open(value).read()


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Replace the launch: ``launched.judge(case, args)`` (or ``launched.fixed``) decides what the run shows;
    ``launched.calls`` records each launch as (case, fixed, args with the extra ones appended)."""
    state = SimpleNamespace(fixed=True, calls=[], also_failed=[])

    def run(name, fixed=False, args=None, extra=(), nproc=None):
        case = broken_runs.case(name)
        args = tuple(args if args is not None else (case.fixed_args if fixed else case.args)) + tuple(extra)
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


@pytest.mark.parametrize("name", list(FIXES))
def test_every_fix_runs_the_learners_answer_in_the_job_and_the_job_decides(name, launched, capsys):
    """Right and wrong answers alike are launched with the learner's own answer (a file named by its text, or the
    setting's value), and the job's verdict is the check's: a wrong answer fails because the job failed, with a
    message that names neither the case nor its cause (the real jobs: tests/scripts/test_14 and the lab)."""
    check, right, wrong_answers = FIXES[name]
    flag = FLAGS[name]
    launched.judge = lambda case, args: _judge_by_answer(case, args, flag)
    check(right)
    assert capsys.readouterr().out.startswith("Correct:")
    assert launched.calls and {call[0] for call in launched.calls} == {name}
    answers = {_answer(flag, launched.calls[-1][2])}
    for answer in wrong_answers:
        before = len(launched.calls)
        with pytest.raises(ExerciseWrong, match="still fails") as wrong:
            check(answer)
        assert len(launched.calls) > before   # judged by a run of the job, not before it
        said = str(wrong.value).lower()
        assert name not in said and not [w for w in CAUSE_WORDS.get(name, ()) if w in said], said
        answers.add(_answer(flag, launched.calls[-1][2]))
    assert len(answers) == 1 + len(wrong_answers)   # each answer went into the job as itself
    for _, _, args in launched.calls:
        # the straggler's fault stays, and so do the nan and the token: the learner's code finds them (or guards the
        # job against them) in the run that has them
        assert "--planted-bug" not in args or name in ("slow-rank", "nan-from-one-rank", "token-out-of-vocabulary")
    launched.fixed, launched.judge = False, None   # the right answer, but the run still shows the symptom
    with pytest.raises(ExerciseWrong, match="still fails"):
        check(right)


# Words of each case's cause that a fix's message must not say (the lab's messages come from the job's checks).
CAUSE_WORDS = {"loss-on-wrong-stage": ("last stage",), "slow-rank": ("straggler",), "uneven-inputs": ("shortest",),
               "bf16-gradient-reduction": ("bf16", "bfloat16"), "resume-without-rng": ("rng",)}


@pytest.mark.parametrize("name", [n for n in FIXES if callable(FIXES[n][1]) and FLAGS[n] == "--fix-from"])
def test_a_function_the_job_cannot_load_is_said_at_once(name, launched):
    check = FIXES[name][0]
    with pytest.raises(ExerciseWrong, match="define it with def"):
        check(lambda *args: None)
    assert not launched.calls


def test_the_loss_rank_runs_under_a_looped_and_a_v_shaped_schedule(launched):
    """world_size - 1 is right under 1F1B and wrong under a V schedule, where the last stage is back on rank 0:
    the check runs the job under both, and the answer fails in the second."""
    launched.judge = lambda case, args: "ZBVZeroBubble" not in args   # what max(stage_ranks) does in the job
    with pytest.raises(ExerciseWrong, match="still fails"):
        ch14.check_fix_loss_rank(wrong_loss_rank_last_rank)
    assert [("--schedule" in args) for _, _, args in launched.calls] == [False, True]
    assert launched.calls[1][2][:2] == ch14.V_SCHEDULE


def test_the_checkpoint_parts_are_the_drills():
    source = (ROOT / "scripts" / "12_hpc_operations" / "fault_drill.py").read_text()
    held = re.search(r"^HOLDABLE = \(([^)]*)\)", source, flags=re.M)[1]
    assert set(ch14.CHECKPOINT_PARTS) == {name.strip().strip('"') for name in held.split(",") if name.strip()}


def test_a_fix_that_stops_the_job_before_its_checks_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(ch14, "LEARNER_DIR", tmp_path)
    monkeypatch.setattr(ch14, "_launch", lambda *a, **k: SimpleNamespace(
        metrics=None, returncode=2, seconds=1.0, rank_exit_codes={0: 2},
        output="config error (rank 0): gradient_scales(4) returned 0.25, not two numbers"))
    with pytest.raises(ExerciseWrong, match="not two numbers"):
        ch14.check_fix_loss_scale(wrong_gradient_scales_sum)


def test_only_the_timing_models_own_check_is_not_judged(launched, capsys):
    """A loaded machine can fail pp_schedules' measured-against-simulated bubble (not the symptom, not one device) and
    its measured bubble against the target: the fix is judged by the counted bubble, which no load moves."""
    for clock in ("measured bubble equals the simulated one (this run's pass times and latency)",
                  "measured bubble within the throughput target (--max-bubble)"):
        launched.also_failed = [clock]
        ch14.check_fix_microbatches(8)
        assert capsys.readouterr().out.startswith("Correct:")
    launched.also_failed = ["counted bubble within the throughput target (--max-bubble): the order every rank ran, "
                            "in passes"]
    with pytest.raises(ExerciseWrong, match="counted bubble"):
        ch14.check_fix_microbatches(8)
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


def test_no_fix_is_a_coin_flip():
    """The wrappers' order is a function whose every choice (order and dimension) runs in the job, not one of two
    names; the checkpoint's contents are judged by the drill run with them, so naming every part is not a pass
    (loss_history written back on a restart erases the record of the steps trained twice)."""
    assert not hasattr(ch14, "check_fix_wrapper_order")
    assert FIXES["resume-without-rng"][2][-1] == set(ch14.CHECKPOINT_PARTS)


def test_the_learners_copy_does_not_name_the_cases():
    """The lab shows the runs under labels: a case's name is its diagnosis, so the learner's copy never says it."""
    text = "\n".join("".join(cell["source"]) for cell in lab_cells("14", student=True))   # every notebook of the lab
    assert not [name for name in NAMES if name in text]


def test_the_lab_says_every_fix_runs_inside_the_job():
    """Every check runs the job again with the learner's answer, the reading of the losses too: the lab says so, and
    says of no answer that it is judged outside the job."""
    for lab in chapters.labs("14"):   # each notebook's opening
        opening = " ".join("".join(json.loads(lab.read_text())["cells"][0]["source"]).split())
        assert "every check runs the job again with your answer" in opening and "hand-made" not in opening, lab.name
    text = " ".join("".join(cell["source"]) for cell in lab_cells("14"))
    assert "hand-made" not in text and "does not run in the job" not in text
    assert "reading of the evidence, not code the job runs" not in text


def test_every_fix_comes_after_every_diagnosis_and_its_prompt_starts_from_the_symptom():
    """A fix prompt says what to change, so it would sort the runs: the lab asks for the fixes once all are named."""
    sources = ["".join(cell["source"]) for cell in lab_cells("14")]   # every notebook of the lab, in working order
    diagnosed = {part: next(i for i, s in enumerate(sources) if "check_diagnoses(" in s and f'"{part}"' in s)
                 for part in ch14.PARTS}
    prompted = {label: next(i for i, s in enumerate(sources) if f"**{label.capitalize()}**" in s)
                for label in ch14.LABELS}
    for part, labels in ch14.PARTS.items():   # every fix asked before a part is named is another part's, named
        earlier = [label for label, i in prompted.items() if i < diagnosed[part]]
        assert all(diagnosed[next(p for p, ls in ch14.PARTS.items() if label in ls)] < prompted[label]
                   for label in earlier) and not set(earlier) & set(labels), (part, earlier)
    first_fix = min(i for i, s in enumerate(sources) if "check_fix_" in s)
    assert sum(i < first_fix for i in diagnosed.values()) >= 3   # the first parts are all named before any fix
    for label in ch14.LABELS:
        prompt = next(s for s in sources if f"**{label.capitalize()}**" in s)
        assert ANSWERS[label] not in prompt and "broadcast ... else" not in prompt, prompt


def test_the_three_data_parallel_fixes_share_one_run_and_each_is_named_by_its_check(launched, capsys):
    """Runs 7, 8 and 9's functions go into one train_ddp.py run, one file holding all three; a check that fails is
    said with the function it judges (never with the answer)."""
    judged = {"rank_sampler": "the training samplers' first epoch", "epoch_indices": "the training sampler's order",
              "synchronises": "bytes all-reduced per optimizer step"}

    def judge(case, args):
        text = open(_answer("--fix-from", args)).read()
        launched.also_failed = [f"{judged[name]} (hand-made)" for name in judged if f"def wrong_{name}" in text]
        return True   # the case's own checks pass: only the wrong function's check fails

    launched.judge = judge
    ch14.check_fix_ranks_that_disagree(right_rank_sampler, right_synchronises, right_epoch_indices)
    assert capsys.readouterr().out.startswith("Correct:") and len(launched.calls) == 1
    text = open(_answer("--fix-from", launched.calls[0][2])).read()
    assert all(f"def right_{name}" in text and f"{name} = right_{name}" in text for name in judged)
    with pytest.raises(ExerciseWrong, match=r"synchronises\(\): 'bytes all-reduced") as wrong:
        ch14.check_fix_ranks_that_disagree(right_rank_sampler, wrong_synchronises_always, right_epoch_indices)
    assert "rank_sampler()" not in str(wrong.value) and "micro_step == accumulation - 1" not in str(wrong.value)
    with pytest.raises(ExerciseWrong, match=r"rank_sampler\(\): one of the script's own checks"):
        ch14.check_fix_ranks_that_disagree(wrong_rank_sampler_own_seed, right_synchronises, right_epoch_indices)
    assert len(launched.calls) == 3


def test_the_fixes_run_on_fewer_ranks_only_where_the_scripts_checks_hold_on_any_number():
    """2 ranks where a script's checks do not depend on the world size; deadlocks.py (written for 4), the (2, 2)
    mesh and the checkpoint's "written by 4 ranks" checks keep the case's 4."""
    assert set(ch14.FIX_NPROC) <= set(NAMES) and set(ch14.FIX_NPROC.values()) == {2}
    for name in ch14.FIX_NPROC:
        assert broken_runs.case(name).script not in (broken_runs.DEADLOCKS, broken_runs.FSDP_TP_HYBRID,
                                                     broken_runs.CHECKPOINT_RESUME), name
    # run 22's per-rank batch tuned on 2 ranks is right on 2; the HSDP run is 2 replicas x 2 shards
    assert "token-mean-per-micro-batch" not in ch14.FIX_NPROC and "global-batch-grows" not in ch14.FIX_NPROC
    assert "per-rank-init" not in ch14.FIX_NPROC


def test_the_batch_and_the_token_fixes_share_one_run_and_each_is_named_by_its_check(launched, capsys):
    """Runs 22 and 23's functions go into one train_ddp.py --uneven-lengths run; a wrong micro_batch_size() fails
    the sequences-per-step check, said with its name (a wrong token_loss() leaves that check passing)."""
    def judge(case, args):
        text = open(_answer("--fix-from", args)).read()
        launched.also_failed = ["sequences per optimizer step = the global batch asked for (--batch) (hand-made)"] \
            if "def wrong_micro_batch_size" in text else []
        return "def wrong_token_loss" not in text

    launched.judge = judge
    ch14.check_fix_batch_and_tokens(right_micro_batch_size, right_token_loss)
    assert capsys.readouterr().out.startswith("Correct:") and len(launched.calls) == 1
    (name, _, args), = launched.calls
    assert name == "token-mean-per-micro-batch" and "--uneven-lengths" in args
    with pytest.raises(ExerciseWrong, match=r"micro_batch_size\(\): 'sequences per optimizer step") as wrong:
        ch14.check_fix_batch_and_tokens(wrong_micro_batch_size_recipes, right_token_loss)
    assert "world_size * accumulation" not in str(wrong.value)
    with pytest.raises(ExerciseWrong, match="still fails") as wrong:
        ch14.check_fix_batch_and_tokens(right_micro_batch_size, wrong_token_loss_own_mean)
    assert "micro_batch_size()" not in str(wrong.value)


def test_prefetch_starts_the_runs_in_the_labs_order(monkeypatch):
    """A part's cell waits for its own runs only: the broken runs start part by part, in the lab's order."""
    started = []
    monkeypatch.setattr(ch14, "_RUNS", {})
    monkeypatch.setattr(ch14, "_PENDING", {})
    monkeypatch.setattr(ch14.broken_runs, "run_case", lambda name, **kwargs: started.append(name))
    ch14.prefetch(workers=1)
    for future in list(ch14._PENDING.values()):
        future.result()
    assert started == [ANSWERS[label] for labels in ch14.PARTS.values() for label in labels]
    assert started[:7] == [ANSWERS[label] for label in ch14.LABELS[:6] + ("run 25",)]   # part 2 holds it


def test_each_notebook_prefetches_its_own_runs_in_the_labs_order(monkeypatch):
    """The lab is three notebooks (ch14.NOTEBOOKS): each starts exactly its own parts' broken runs, part by part;
    a name that is not a notebook, or labels given beside one, is refused."""
    monkeypatch.setattr(ch14.broken_runs, "run_case", lambda name, **kwargs: started.append(name))
    for notebook, parts in ch14.NOTEBOOKS.items():
        started = []
        monkeypatch.setattr(ch14, "_RUNS", {})
        monkeypatch.setattr(ch14, "_PENDING", {})
        ch14.prefetch(workers=1, notebook=notebook)
        for future in list(ch14._PENDING.values()):
            future.result()
        assert started == [ANSWERS[label] for part in parts for label in ch14.PARTS[part]], notebook
    assert sorted(ANSWERS[label] for parts in ch14.NOTEBOOKS.values() for part in parts
                  for label in ch14.PARTS[part]) == sorted(ANSWERS.values())   # every run in one notebook
    with pytest.raises(ValueError, match="one of"):
        ch14.prefetch(notebook="14_no_such_notebook")
    with pytest.raises(ValueError, match="not both"):
        ch14.prefetch(["run 1"], notebook="14_when_it_goes_wrong")


def test_the_token_guard_runs_in_the_job_with_the_fault_and_a_job_that_still_stops_says_where(monkeypatch, tmp_path):
    """Run 25's guard runs in train_ddp.py with the token planted (the case's broken arguments, on 2 ranks): without
    it every id is in range and any function would pass. A guard that lets the id through stops the job again, and
    the message gives torch's first observed failure, rank and error, never the guard to write."""
    calls = []
    stopped = ("[forkrun] torchrun would end with: ChildFailedError:\n=====\ntrain_ddp.py FAILED\n-----\nFailures:\n"
               "[1]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 1)\n  traceback : Traceback (most recent "
               "call last):\n  RuntimeError: Connection closed by peer\n-----\nRoot Cause (first observed failure):\n"
               "[0]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1 (pid: 2)\n  traceback : Traceback (most "
               "recent call last):\n  IndexError: index out of range in self\n=====\n")

    def launch(name, fixed=False, args=None, extra=(), nproc=None):
        calls.append((name, tuple(args) + tuple(extra), nproc))
        return SimpleNamespace(metrics=None, returncode=1, seconds=1.0, rank_exit_codes={0: 1, 1: 1}, output=stopped)

    monkeypatch.setattr(ch14, "_launch", launch)
    monkeypatch.setattr(ch14, "LEARNER_DIR", tmp_path)
    with pytest.raises(ExerciseWrong, match="still stops") as wrong:
        ch14.check_fix_tokens_in_vocabulary(wrong_tokens_in_vocabulary_off_by_one)
    said = str(wrong.value)
    assert "rank 1's IndexError: index out of range in self" in said and "vocab_size" not in said, said
    (name, args, nproc), = calls
    case = broken_runs.case(name)
    assert name == "token-out-of-vocabulary" and args[:len(case.args)] == case.args and nproc == 2
    assert args[len(case.args)] == "--fix-from"


def test_the_guards_check_says_what_the_guard_does_and_is_the_one_the_job_emits():
    """The guard keeps a sequence with an id outside the vocabulary out of the model's input (the lookup would raise
    otherwise), and its targets out of the loss: the check's name says the input, not only the loss. train_ddp.py
    emits the check under that name, so ch14.GUARD_CHECK finds it."""
    import ast

    assert "model's input" in ch14.GUARD_CHECK and "left out of the loss" not in ch14.GUARD_CHECK
    script = (ROOT / "scripts" / "04_data_parallel" / "train_ddp.py").read_text()
    emitted = [node.args[0].value for node in ast.walk(ast.parse(script))
               if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "check" and node.args
               and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)]
    assert [name for name in emitted if name.startswith(ch14.GUARD_CHECK)], emitted


def test_every_naming_exercise_asks_its_guiding_questions_and_sync_says_what_it_must_achieve():
    """The learner's review, findings 17 and 18: every "name the cause" exercise asks what to look at (Exercises 3 and
    4 were bare headings), and run 1's fix says what sync() must leave behind, as deadlocks.py checks it: the same
    tensor on every rank, each having started with its own, and no rank left waiting."""
    for path in ("the lab", "the learner's copy"):
        sources = ["".join(cell["source"]) for cell in lab_cells("14", student=path != "the lab")]
        naming = [s for s in sources if s.startswith("### Exercise") and "name the cause" in s.splitlines()[0]]
        assert len(naming) == 7, path
        for cell in naming:
            assert "?" in cell.split("\n", 1)[-1] and "\n" in cell, cell.splitlines()[0]
        run_1 = next(s for s in sources if "### Exercise 4: fix each run" in s)
        assert "every rank must hold the same tensor, each having started with its own" in " ".join(run_1.split())
    script = (ROOT / "scripts" / "12_hpc_operations" / "deadlocks.py").read_text()
    assert "the weights are the same on every rank after sync (each rank's, rank + 1 before)" in script
