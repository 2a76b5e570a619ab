"""Chapter 14: every broken run shows its symptom, caught by its script's own checks (a hang: ended by the
process-group timeout, named by its journal), and the fix makes the symptom go away with the run equal to one device.

One launch per distinct command: cases that share a fixed run (three of train_ddp's, two of fsdp_tp_hybrid's)
launch it once. A run an earlier chapter's test already makes with the same arguments is not launched again:
COVERED_ELSEWHERE names that test (tests/unit/test_broken_runs.py checks it exists and runs those arguments).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.distributed as dist
from helpers import assert_config_error

from labkit import broken_runs
from labkit.exercises import ch14

# (case, fixed) -> the test of an earlier chapter that launches the same command and asserts the same outcome
COVERED_ELSEWHERE = {
    ("mismatched-collectives", False): ("tests/scripts/test_12_hpc_operations.py",
                                        "test_every_hang_ends_with_its_diagnosis"),
    ("mismatched-collectives", True): ("tests/scripts/test_12_hpc_operations.py",
                                       "test_every_hang_ends_with_its_diagnosis"),
    ("loss-averaged-twice", True): ("tests/scripts/test_04_data_parallel.py",
                                    "test_ddp_from_scratch_matches_single_device_under_torchrun"),
    ("bf16-gradient-reduction", True): ("tests/scripts/test_05_fully_sharded.py",
                                        "test_fsdp_reshard_after_forward_gathers_twice"),
    ("checkpoint-one-shard", True): ("tests/scripts/test_05_fully_sharded.py",
                                     "test_checkpoint_interrupt_resume_and_reshard_4_to_2"),
    ("per-rank-init", True): ("tests/scripts/test_05_fully_sharded.py",
                              "test_hsdp_shards_in_a_group_and_all_reduces_the_shards_across_replicas"),
    ("resume-without-rng", False): ("tests/scripts/test_12_hpc_operations.py",
                                    "test_a_checkpoint_without_the_data_position_and_the_rngs_resumes_into_other_data"),
}
# The lab (notebooks/14_when_it_goes_wrong.ipynb) launches these same commands in the same folders: under make test
# the launch cache lets each run once, by whichever comes first (tests/scripts/conftest.py); the serial ones run anew.
SHARES_RUNS_WITH_THE_LAB = True
CASES = [run for run in broken_runs.BROKEN_RUNS]
BROKEN = [pytest.param(run, id=run.name) for run in CASES if (run.name, False) not in COVERED_ELSEWHERE]
# A fixed run whose check is a time (the bubble against its target, the ranks' arrival spread) passes by a margin
# a loaded machine can eat: run with the machine to itself (make test's serial phase). Their broken runs fail by
# far more than any load adds (a 0.3 s sleep; a bubble that only latency can raise above its formula).
TIMED = {"too-few-microbatches", "slow-rank"}
FIXED = [pytest.param(run, id=run.name, marks=[pytest.mark.serial] if run.name in TIMED else [])
         for run in CASES if (run.name, True) not in COVERED_ELSEWHERE]


@pytest.fixture(scope="module")
def launched():
    """``launched(case, fixed)``: the run's LaunchResult, launched once per distinct command in this module, in
    run_case's own folder (build/broken_runs/KEY-broken|fixed) as the lab's are: the lab replays these runs."""
    results = {}

    def get(run: broken_runs.BrokenRun, fixed: bool, args=None):
        prepare = run.fixed_prepare_args if fixed else run.prepare_args
        args = tuple(args) if args is not None else (run.fixed_args if fixed else run.args)
        key = (run.script, prepare, args)
        if key not in results:
            results[key] = broken_runs.run_case(run.name, fixed=fixed, args_override=args, stream=False, timeout=90)
        return results[key]

    return get


@pytest.mark.parametrize("run", BROKEN)
def test_the_planted_mistake_shows_its_symptom_and_the_script_catches_it(run, launched):
    result = launched(run, fixed=False)
    seen = broken_runs.symptom_seen(run, result.metrics, result.output)
    assert not seen, (seen, result.tail())
    if run.first_failure:   # an error one rank raises: every rank's traceback, torch's summary last (forkrun's)
        codes = result.rank_exit_codes
        assert result.returncode == 1 and set(codes.values()) == {1} and len(codes) == run.nproc, result.tail()
        assert result.metrics is None and [line for line in result.lines if line.startswith("Traceback")]
        SYMPTOMS[run.name](result.metrics, result)
        view = ch14.shown(result)
        assert run.name not in view.output.lower() and not [w for w in CAUSE_WORDS[run.name]
                                                             if w in view.output.lower()], view.output[-2000:]
        return
    assert not [line for line in result.lines if line.startswith("Traceback")], result.tail()
    if run.hang:    # ended by the 2 s process-group timeout, with the journal, not by the test's timeout
        assert result.returncode == 0 and result.metrics["extra"]["seconds_to_diagnosis"] < 9, result.tail()
        assert f"diagnosis: {run.hang_cause}" in result.output
    else:           # exit 1 (on every rank that checks: some comparisons run on rank 0 alone), not a crash
        codes = result.rank_exit_codes
        assert result.returncode == 1 and codes[0] == 1 and set(codes.values()) <= {0, 1}, result.tail()
        assert any(line.lstrip().startswith("[FAIL]") for line in result.lines), result.tail()
    SYMPTOMS.get(run.name, lambda metrics, result: None)(result.metrics, result)
    view = ch14.shown(result)   # what the lab shows of it: never its case's name, nor words that say the cause
    seen = (view.output + json.dumps(view.metrics)).lower()
    assert run.name not in seen and not [w for w in CAUSE_WORDS[run.name] if w in seen], \
        [w for w in (run.name, *CAUSE_WORDS[run.name]) if w in seen]
    assert view.metrics["checks"] and [c["passed"] for c in view.metrics["checks"]].count(False) >= (not run.hang)
    if run.name == "loss-on-wrong-stage":   # the last stage's own losses are the fixed run's (one launch, cached)
        fixed = launched(run, fixed=True).metrics["losses"]
        assert result.metrics["extra"]["last_stage_losses"] == pytest.approx(fixed, abs=1e-6), fixed


# Words that would name each case's cause in what the lab shows (lower case).
CAUSE_WORDS = {
    "same-samples-every-rank": ("same samples", "samplers' first epoch"), "no-set-epoch": ("set_epoch",),
    "accumulation-never-syncs": ("no_sync",), "loss-averaged-twice": ("averaged twice", "divided twice"),
    "uneven-inputs": ("skipped collective", "uneven", "fewest"),
    "checkpoint-one-shard": ("one shard", "rank 0's shard"),
    "bf16-gradient-reduction": ("bfloat16", "reduce_dtype", "bf16"), "data-by-global-rank": ("global rank",),
    "loss-on-wrong-stage": ("wrong stage",), "too-few-microbatches": ("too few",),
    "fsdp-before-tp": ("before fsdp", "tp plan was applied"),
    "mismatched-collectives": ("mismatched", "different collectives"),
    "resume-without-rng": ("without rng", "without_rng", "rng"), "slow-rank": ("slow_rank", "sleep", "straggler"),
    "optimizer-before-sharding": ("before shard", "before fully_shard", "optimizer_from"),
    "full-state-on-rank-0": ("skipped collective", "gather_on_every_rank", "only on rank 0"),
    "rank-0-evaluation": ("late rank", "evaluate_on_every_rank", "busy alone"),
    "unused-parameter": ("unused_head", "unused-parameter", "extra head", "find_unused"),
    "nan-from-one-rank": ("masked", "nan_rank", "0/0", "every target", "nan-from"),
    "local-grad-norm": ("local-grad", "to_local", "clip_from", "own shards"),
    "per-rank-init": ("per-rank", "seed + rank", "model_seed", "own seed", "built from the seed"),
    "global-batch-grows": ("grows", "tuned", "micro_batch_size", "recipe"),
    "token-mean-per-micro-batch": ("token-mean", "token_loss", "own tokens", "per micro-batch"),
    "stage-grad-norm": ("stage-grad", "own stages", "clip_gradients"),
    "token-out-of-vocabulary": ("vocabulary", "bad_token", "bad token", "onebadtoken", "added token"),
}


def data_shard(mesh):   # a wrong fix of data-by-global-rank, as a learner would write it: the global rank again
    return dist.get_rank(), dist.get_world_size()


def apply_wrappers(tp, fsdp):   # a wrong fix of fsdp-before-tp: the order unchanged
    fsdp("dp")
    tp("tp")


def shard_and_optimizer(model, shard, adamw):   # a wrong fix of optimizer-before-sharding: the order unchanged
    optimizer = adamw(model.parameters())
    shard(model)
    return optimizer


def clip_gradients(model, max_norm):   # a wrong fix of local-grad-norm: each rank's own shards' norm
    local = [p.grad.to_local() for p in model.parameters()]
    norm = torch.nn.utils.get_total_norm(local)
    torch._foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def model_seed(seed, rank):   # a wrong fix of per-rank-init: the replicas agree, but a replica's shards come from
    return seed + rank % 2    # two different models (ranks 0 and 2 hold the same shard, as do 1 and 3)


@pytest.mark.parametrize("name, function, flag", [("data-by-global-rank", data_shard, "--data-shard-from"),
                                                  ("fsdp-before-tp", apply_wrappers, "--wrappers-from"),
                                                  ("optimizer-before-sharding", shard_and_optimizer,
                                                   "--optimizer-from"),
                                                  ("per-rank-init", model_seed, "--model-seed-from"),
                                                  ("local-grad-norm", clip_gradients, "--clip-from")])
def test_a_wrong_fix_of_the_learners_own_code_fails_in_the_job(name, function, flag, tmp_path, monkeypatch):
    """The lab writes the learner's function to a file the script loads and calls on every rank: a wrong one fails
    the job's own checks there (the right one is the lab's, under nbval)."""
    monkeypatch.setattr(ch14, "LEARNER_DIR", tmp_path)
    path = ch14.learner_file(function, function.__name__)
    result = broken_runs.run_case(name, fixed=True, run_dir=tmp_path / "run", stream=False, timeout=90,
                                  args_override=broken_runs.case(name).fixed_args + (flag, path))
    assert result.returncode == 1 and broken_runs.fix_holds(broken_runs.case(name), result.metrics), result.tail()


def one_other_seed(seed, rank):   # a right fix of per-rank-init: one seed on every rank, not the run's
    return seed + 1


def test_any_one_seed_shared_by_every_rank_fixes_per_rank_init(tmp_path, monkeypatch):
    """The chapter's fix is one seed on every rank, not the run's --seed: a shared seed other than --seed passes
    (the one-device reference is built from the seed rank 0 built its model from, by its own path)."""
    monkeypatch.setattr(ch14, "LEARNER_DIR", tmp_path)
    path = ch14.learner_file(one_other_seed, "model_seed")
    case = broken_runs.case("per-rank-init")
    result = broken_runs.run_case(case.name, fixed=True, run_dir=tmp_path / "run", stream=False, timeout=90,
                                  args_override=case.fixed_args + ("--model-seed-from", path))
    assert broken_runs.fix_holds(case, result.metrics) == [], result.tail()



def clip_and_log_the_local_piece(model, max_norm):   # a right clip, but the norm logged is this rank's shards'
    logged = torch.nn.utils.get_total_norm([p.grad.to_local() for p in model.parameters()])
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if norm.item() != norm.full_tensor().item():   # torch 2.13: the norm returned is already reduced (Replicate):
        # (tests/unit/test_chapter_text_14.py: why); .item() on a Partial DTensor would not reduce
        raise RuntimeError(f"clip_grad_norm_ returned an unreduced norm: {norm.placements}")
    return logged


def test_a_right_clip_that_logs_each_ranks_piece_of_the_norm_is_not_local_grad_norm(tmp_path, monkeypatch):
    """A right clip whose logged norm is taken before it is reduced (each rank's own shards): the ranks log what
    local-grad-norm logs, pieces of one norm, but the weights equal one device's. The case's check is the weights,
    so this run is not the case. (clip_grad_norm_'s own returned norm is reduced in torch 2.13: .item() on it is
    the whole norm on every rank, which the learner's function checks in the job.)"""
    monkeypatch.setattr(ch14, "LEARNER_DIR", tmp_path)
    path = ch14.learner_file(clip_and_log_the_local_piece, "clip_gradients")
    case = broken_runs.case("local-grad-norm")
    result = broken_runs.run_case(case.name, fixed=True, run_dir=tmp_path / "run", stream=False, timeout=90,
                                  args_override=case.fixed_args + ("--clip-from", path))
    norms = result.metrics["extra"]["rank_grad_norms"][0]
    one_device = result.metrics["extra"]["one_device_grad_norms"][0]
    assert max(norms) - min(norms) > 0.01 and math.isclose(sum(n * n for n in norms), one_device ** 2,
                                                           rel_tol=1e-4), result.tail()
    failed = {c["name"] for c in result.metrics["checks"] if not c["passed"]}
    assert not any(name.startswith("parameters = single-device parameters") for name in failed), failed
    assert broken_runs.symptom_seen(case, result.metrics) != [], "a right clip logged by pieces read as the bug"

# Wrong fixes as a learner would write them, each run inside the job by its script's --fix-from (or the setting's
# flag): (case, the run's arguments, the learner's file or None, the checks that must fail or the hang's diagnosis).
# The three functions train_ddp.py loads share one launch: each breaks a check of its own.
WRONG_DDP = """from torch.utils.data import DistributedSampler


def rank_sampler(dataset, rank, world_size):   # each rank its own seed: the shares overlap
    return DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=rank)


def epoch_indices(sampler, epoch):             # the epoch never set
    return list(sampler)


def synchronises(micro_step, accumulation):    # every micro-batch all-reduces
    return True
"""
WRONG_IN_THE_JOB = {
    "same-samples-every-rank": (broken_runs.DDP_RUN, WRONG_DDP,
                                ("the training samplers' first epoch", "the training sampler's order changed",
                                 "bytes all-reduced per optimizer step")),
    "loss-averaged-twice": (("--steps", "3"), "def gradient_scales(world_size):\n    return 1 / world_size, 1 / world_size\n",
                            ("averaged gradients = single-device gradients",)),
    "uneven-inputs": (broken_runs.case("uneven-inputs").args,
                      "def agreed_batches(batch_counts):\n    return max(batch_counts)\n", "skipped collective"),
    "mismatched-collectives": (broken_runs.case("mismatched-collectives").args,
                               "def sync(rank, tensor, collectives):\n    if rank == 0:\n"
                               "        collectives.broadcast(tensor, src=0)\n    else:\n"
                               "        collectives.all_reduce(tensor)\n", "mismatched collectives"),
    "loss-on-wrong-stage": (ch14.V_SCHEDULE, "def loss_rank(stage_ranks):\n    return max(stage_ranks)\n",
                            ("losses equal the single-device run's",)),
    "bf16-gradient-reduction": (("--steps", "3", "--reduce-dtype", "float16"), None,
                                ("reduce_scatter bytes per step = formula",)),
    "checkpoint-one-shard": (broken_runs.case("checkpoint-one-shard").fixed_args,
                             "def full_from_shards(shards):\n    return shards[0]\n",
                             ("model written by 4 ranks, read by 4: every value equal",)),
    "resume-without-rng": (broken_runs.case("resume-without-rng").fixed_args, None,
                           ("steps lost = death step - last checkpoint before it",)),
    "slow-rank": (broken_runs.case("slow-rank").args,
                  "def straggler(ranks):\n    return max(ranks, key=lambda r: r['kinds']['communication'])['rank']\n",
                  ("no straggler",)),
    "full-state-on-rank-0": (broken_runs.case("full-state-on-rank-0").args,   # no hang, but four files
                             "def save_model(rank, gather_full_state, save):\n    save(gather_full_state())\n",
                             ("one file written, by rank 0",)),
    "rank-0-evaluation": (broken_runs.case("rank-0-evaluation").args,   # no hang, but every batch four times
                          "def evaluation_share(batches, rank, world_size):\n    return list(range(batches))\n",
                          ("every validation batch evaluated once",)),
    "unused-parameter": (broken_runs.DDP_RUN,   # the head's weight left out, its bias still wrapped
                         "def without_gradient(grads):\n    return [n for n, g in grads.items() if g is None][:1]\n",
                         ("every step's forward ran",)),
    # wrong fixes that end without a hang: each fails a check of what the fix must achieve, not the hang's
    "uneven-inputs/none": (broken_runs.case("uneven-inputs").args,   # no rank trains at all
                           "def agreed_batches(batch_counts):\n    return 0\n",
                           ("the agreed number of batches is one every rank can train",
                            "every batch that all ranks hold was trained, on every rank")),
    "uneven-inputs/negative": (broken_runs.case("uneven-inputs").args,
                               "def agreed_batches(batch_counts):\n    return -1\n",
                               ("the agreed number of batches is one every rank can train",
                                "every batch that all ranks hold was trained, on every rank")),
    "uneven-inputs/one-short": (broken_runs.case("uneven-inputs").args,   # drops a batch every rank holds
                                "def agreed_batches(batch_counts):\n    return min(batch_counts) - 1\n",
                                ("every batch that all ranks hold was trained, on every rank",)),
    "mismatched-collectives/nothing": (broken_runs.case("mismatched-collectives").args,   # no synchronisation
                                       "def sync(rank, tensor, collectives):\n    pass\n",
                                       ("the weights are the same on every rank after sync",)),
    "full-state-on-rank-0/empty": (broken_runs.case("full-state-on-rank-0").args,   # a file, but no gather
                                   "def save_model(rank, gather_full_state, save):\n    if rank == 0:\n"
                                   "        save({})\n", ("rank 0 saved every weight whole",)),
    "token-mean-per-micro-batch": (broken_runs.UNEVEN_RUN,   # each micro-batch's own mean, as the bug had it
                                   "def token_loss(per_token, mask, step_tokens, world_size):\n"
                                   "    return (per_token * mask).sum() / mask.sum()\n",
                                   ("DDP loss = single-device loss", "DDP gradients = single-device gradients")),
    "token-mean-per-micro-batch/batch": (broken_runs.UNEVEN_RUN,   # the 2-rank recipe's per-rank batch, kept
                                         "def micro_batch_size(global_batch, world_size, accumulation):\n"
                                         "    return global_batch // (2 * accumulation)\n",
                                         ("sequences per optimizer step = the global batch asked for",
                                          "DDP loss = single-device loss")),
    "nan-from-one-rank": (broken_runs.case("nan-from-one-rank").args,   # read in the run with the fault: the step
                          "import math\n\n\ndef first_nonfinite(rank_losses):\n"   # every rank shows, too late
                          "    for step, losses in enumerate(rank_losses):\n"
                          "        if not any(map(math.isfinite, losses)):\n"
                          "            return step, 0\n", (ch14.FIRST_NONFINITE_CHECK,)),
    "local-grad-norm": (broken_runs.CLIP_RUN,   # each rank's own shards' norm, as the bug had it (--clip-from)
                        "import torch\n\n\ndef clip_gradients(model, max_norm):\n"
                        "    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]\n"
                        "    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))\n"
                        "    for g in grads:\n"
                        "        g.mul_(min(1.0, max_norm / (float(norm) + 1e-6)))\n"
                        "    return norm\n",
                        ("every rank computed the same gradient norm", "parameters = single-device parameters")),
    "stage-grad-norm": (broken_runs.PIPELINE_CLIP_RUN,   # torch's clip on this rank's stages, as the bug had it
                        "import torch\n\n\ndef clip_gradients(parameters, max_norm):\n"
                        "    return torch.nn.utils.clip_grad_norm_(parameters, max_norm).item()\n",
                        ("every rank computed the same gradient norm", "parameters after training equal")),
    "rank-0-evaluation/lopsided": (broken_runs.case("rank-0-evaluation").args,   # under the timeout, unequal
                                   "def evaluation_share(batches, rank, world_size):\n"
                                   "    return [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9], [10, 11]][rank]\n",
                                   ("each rank evaluated an equal share",)),
}


GUARDS = {   # run 25's guard as a learner would write it: (its source, what the job with the token planted shows)
    "right": ("def tokens_in_vocabulary(tokens, vocab_size):\n"
              "    return ((tokens >= 0) & (tokens < vocab_size)).all(dim=1)\n", None),
    "off-by-one": ("def tokens_in_vocabulary(tokens, vocab_size):\n    return (tokens <= vocab_size).all(dim=1)\n",
                   "stops"),
    "too-strict": ("def tokens_in_vocabulary(tokens, vocab_size):\n"
                   "    return (tokens < vocab_size - 1).all(dim=1)\n", ch14.GUARD_CHECK),
}


@pytest.mark.parametrize("guard", list(GUARDS))
def test_the_token_guard_is_judged_in_the_job_with_the_token_planted(guard, tmp_path):
    """The lab's run 25 fix on its 2 ranks (ch14.FIX_NPROC): the right guard leaves out the one sequence holding the
    id, and the run equals one device leaving out the same (every check passes, the guard's too); a guard that lets
    the id through stops the job again, rank 1 first with the IndexError; one that leaves out more fails its check."""
    source, shows = GUARDS[guard]
    (tmp_path / "fix.py").write_text(source)
    case = broken_runs.case("token-out-of-vocabulary")
    result = broken_runs.run_case(case.name, run_dir=tmp_path / "run", stream=False, timeout=90,
                                  extra_args=("--fix-from", str(tmp_path / "fix.py")),
                                  nproc=ch14.FIX_NPROC[case.name])
    if shows is None:
        assert result.returncode == 0 and broken_runs.fix_holds(case, result.metrics) == [], result.tail()
        guarded = next(c for c in result.metrics["checks"] if c["name"].startswith(ch14.GUARD_CHECK))
        assert guarded["passed"] and guarded["value"] == "1 left out, 0 wrongly", guarded
        assert max(result.metrics["extra"]["diffs"]["baseline_loss"]) < 1e-5   # one device, leaving out the same
    elif shows == "stops":
        failures = broken_runs.failure_summary(result.output)
        assert result.metrics is None and failures[0]["rank"] == 1, result.tail()
        assert failures[0]["error"] == "IndexError: index out of range in self"
    else:
        failed = [c["name"] for c in result.metrics["checks"] if not c["passed"]]
        assert result.returncode == 1 and [name for name in failed if name.startswith(shows)], failed


@pytest.mark.parametrize("name", list(WRONG_IN_THE_JOB))
def test_a_wrong_fix_fails_inside_the_job(name, tmp_path):
    """The learner's answer enters the job (a file the script loads on every rank, or a setting's flag), on as many
    ranks as the lab runs it (ch14.FIX_NPROC), and a plausible wrong one fails the job's own checks there. For a case that resumes, the interrupted job runs with it
    too. The resume's wrong answer holds every part a checkpoint can: loss_history, written back on the restart,
    erases the record of the step trained twice."""
    args, source, failing = WRONG_IN_THE_JOB[name]
    name = name.split("/")[0]   # "case/which wrong fix": a case tried with more than one wrong fix
    extra = ()
    if source is not None:
        (tmp_path / "fix.py").write_text(source)
        extra = ("--fix-from", str(tmp_path / "fix.py"))
    if name == "resume-without-rng":
        extra = ("--checkpoint-holds", ",".join(ch14.CHECKPOINT_PARTS))
    if name == "local-grad-norm":   # train_fsdp.py's flag for a learner's clip (check_fix_clip)
        extra = ("--clip-from", str(tmp_path / "fix.py"))
    result = broken_runs.run_case(name, fixed=True, run_dir=tmp_path / "run", stream=False, timeout=90,
                                  args_override=args, extra_args=extra, nproc=ch14.FIX_NPROC.get(name))   # as the lab
    assert result.metrics is not None, result.tail()
    if isinstance(failing, str):   # a hang: the journal names it, and the script's timeout ended it
        assert result.metrics["extra"]["cause"] == failing, result.tail()
        return
    failed = {c["name"] for c in result.metrics["checks"] if not c["passed"]}
    assert result.returncode == 1 and all(any(f.startswith(p) for f in failed) for p in failing), (failed,
                                                                                                   result.tail())


@pytest.mark.parametrize("run", FIXED)
def test_the_fix_removes_the_symptom_and_the_run_equals_one_device(run, launched):
    result = launched(run, fixed=True)
    assert result.returncode == 0, result.tail()
    assert not broken_runs.fix_holds(run, result.metrics), broken_runs.fix_holds(run, result.metrics)
    GONE.get(run.name, lambda metrics, result: None)(result.metrics, result)


@pytest.mark.parametrize("run", [pytest.param(r, id=r.name) for r in CASES if r.wrong_fixes])
def test_a_plausible_wrong_fix_leaves_the_symptom(run, launched):
    for args, why in run.wrong_fixes:
        result = launched(run, fixed=False, args=args)
        assert not broken_runs.symptom_seen(run, result.metrics), f"{args} ({why}) passed: {result.tail()}"


def test_bf16_reduction_drifts_further_from_one_device_on_more_ranks(launched, tmp_path):
    """The symptom's second half: each rank's bf16 partial sum rounds once more, so 4 ranks drift more than 2."""
    run = broken_runs.case("bf16-gradient-reduction")
    two = broken_runs.run_case(run.name, nproc=2, run_dir=tmp_path, stream=False, timeout=90)
    assert not broken_runs.symptom_seen(run, two.metrics)

    def gradient_error(metrics):
        return next(c["value"] for c in metrics["checks"] if c["name"].startswith(run.failing_checks[0]))

    assert gradient_error(two.metrics) < gradient_error(launched(run, fixed=False).metrics)


# ---- what a user sees, case by case (beyond the checks): the symptom with the bug, its absence with the fix ----

def _rank_losses_equal(metrics):
    return [len(set(step)) == 1 for step in metrics["extra"]["rank_losses"]]


def _same_samples(metrics, result):
    assert all(_rank_losses_equal(metrics)), metrics["extra"]["rank_losses"]  # identical losses on every rank


def _no_set_epoch(metrics, result):
    diffs = metrics["extra"]["diffs"]["baseline_loss"]   # one device's loss, step by step: right for epoch 0 only
    assert max(diffs[:4]) < 1e-5 and diffs[4] > 1e-3, diffs


def _never_syncs(metrics, result):
    assert metrics["extra"]["micro_step_bytes"][-1] == [0, 0]
    assert not any(_rank_losses_equal(metrics)[1:]), metrics["extra"]["rank_losses"]
    gaps = metrics["extra"]["diffs"]["baseline_loss"]   # the symptom: off one device after the first update, more
    assert gaps[0] < 1e-5 and all(b > a for a, b in zip(gaps[1:], gaps[2:])) and gaps[1] > 1e-2, gaps  # every step


def _averaged_twice(metrics, result):   # AdamW hides the gradients' scale from the loss: the symptom's own bound
    bound = float(re.search(r"within (\S+) of one device's", broken_runs.case("loss-averaged-twice").symptom)[1])
    assert max(metrics["extra"]["loss_diffs"]) < bound, (metrics["extra"]["loss_diffs"], bound)


def _uneven(metrics, result):
    states = {int(r): j["state"] for r, j in metrics["extra"]["journals"].items()}
    assert states == {0: "timed out", 1: "timed out", 2: "timed out", 3: "finished"}, states


def _one_shard(metrics, result):
    earlier, now = metrics["extra"]["earlier_losses"], metrics["extra"]["losses_by_step"]
    first = str(metrics["extra"]["first_step"])
    assert abs(now[first] - earlier[first]) > 0.1, (now, earlier)   # the loss jumps at the resume
    one_device = metrics["extra"]["uninterrupted_losses"]           # and stays above one device's, the gap shrinking
    gaps = [now[step] - one_device[int(step)] for step in sorted(now, key=int)]
    assert all(gap > 0.1 for gap in gaps) and all(b < a for a, b in zip(gaps, gaps[1:])), gaps


def _optimizer_before_sharding(metrics, result):
    """The gradients are right, yet AdamW holds nothing and the loss does not fall (one device's does)."""
    checks = {c["name"]: c for c in metrics["checks"]}
    assert checks["step-0 gradients (gathered from the shards) = single-device gradients"]["passed"], checks
    assert checks["optimizer bytes on this rank = ZeRO-3 table (16/N bytes per parameter in all)"]["value"] == 0
    losses, one_device = metrics["losses"], metrics["extra"]["baseline_losses"]
    assert losses[-1] > losses[0] - 0.05 and one_device[-1] < one_device[0] - 0.3, (losses, one_device)


def _data_by_global_rank(metrics, result):
    """Off one device from step 0, yet the model's mesh and every byte count are right: the data, not the groups."""
    passed = {c["name"]: c["passed"] for c in metrics["checks"]}
    assert passed["every rank's TP and FSDP groups, read from the mesh, = distlab.hybrid's grid"], passed
    assert all(passed[name] for name in passed if "communication of one step = formula" in name), passed
    assert not passed["losses equal single-device (every step)"], passed


def _bf16_reduction(metrics, result):
    scatter = next(c for c in metrics["comm"] if c["collective"] == "reduce_scatter")
    assert scatter["measured_bytes"] * 2 == scatter["analytic_bytes"], scatter


def _loss_on_wrong_stage(metrics, result):
    passed = {c["name"]: c["passed"] for c in metrics["checks"]}
    assert all(math.isnan(x) for x in metrics["losses"]), metrics["losses"]
    assert passed["parameters after training equal the single-device run's"]   # the training itself is right
    assert all(math.isfinite(x) for x in metrics["extra"]["last_stage_losses"])    # the tell-apart: read there


def _too_few_microbatches(metrics, result):
    bubble = metrics["extra"]["bubble"]
    assert bubble["formula"] == pytest.approx(0.6) and bubble["measured"] > 0.5, bubble


def _fsdp_before_tp(metrics, result):
    assert any("Cannot distribute a DTensor" in line for line in result.lines)   # torch's refusal, in the check
    quoted = broken_runs.case("fsdp-before-tp").symptom.split("'")[1]           # the registry quotes torch's words
    assert all(part.strip() in metrics["checks"][0]["value"] for part in quoted.split("...")), quoted
    assert set(result.rank_exit_codes.values()) == {1}, result.rank_exit_codes     # every rank stops at once


def _slow_rank(metrics, result):
    kinds = {row["rank"]: row["kinds"] for row in metrics["extra"]["ranks"]}
    # the late rank's extra time is compute (real work: a sleep would show as idle), over 2 profiled steps of 0.3 s;
    # a CPU shared by 4 ranks leaves part of it idle (waiting for a core between products)
    assert kinds[1]["compute"] > 0.2 + max(kinds[r]["compute"] for r in (0, 2, 3)), kinds   # a third, on a busy CPU
    assert all(kinds[r]["communication"] > 0.4 for r in (0, 2, 3)), kinds
    # waiting for the late rank is its peers' communication, not the late rank's own (ch12, issue 45 item 8): each
    # peer waits out every one of its 0.3 s delays, the late rank only for a peer the loaded CPU descheduled (0.45 of
    # a peer's seen inside make test), so it is at least one delay below each peer's, not a fixed fraction of it
    assert kinds[1]["communication"] + 0.3 < min(kinds[r]["communication"] for r in (0, 2, 3)), kinds


def _full_state_on_rank_0(metrics, result):
    """Rank 0 alone waits, in an all-gather after the last step; the three others have finished."""
    journals = {int(r): j for r, j in metrics["extra"]["journals"].items()}
    assert {r: j["state"] for r, j in journals.items()} == {0: "timed out", 1: "finished", 2: "finished",
                                                           3: "finished"}, journals
    stuck = journals[0]["calls"][-1]
    assert stuck["op"] == "all_gather" and not stuck["done"], stuck
    assert "all_gather" in metrics["extra"]["flight_recorder"]["0"], metrics["extra"]["flight_recorder"]


def _rank_0_evaluation(metrics, result):
    """Every rank ends in the same all-reduce; rank 0 was busy alone before it for longer than the timeout."""
    journals = {int(r): j for r, j in metrics["extra"]["journals"].items()}
    assert {j["state"] for j in journals.values()} == {"timed out"}, journals
    assert len({(j["calls"][-1]["label"], j["calls"][-1]["op"]) for j in journals.values()}) == 1, journals
    alone = journals[0]["calls"][-2]
    timeout = float(broken_runs.HANG_TIMEOUT[1])
    assert alone["op"] == "compute" and alone["seconds"] > timeout, alone
    assert not any(c["op"] == "compute" for r in (1, 2, 3) for c in journals[r]["calls"]), journals


def _per_rank_init(metrics, result):
    """The replicas apart before the first step, by the symptom's amount, and as far apart after every step."""
    gaps = metrics["extra"]["replica_weight_gaps"]
    said = float(re.search(r"differ by the same amount \(([\d.]+)\)", broken_runs.case("per-rank-init").symptom)[1])
    assert len(gaps) == 4 and round(gaps[0], 1) == said and max(gaps) - min(gaps) < 0.01 * gaps[0], (gaps, said)
    diffs = metrics["extra"]["loss_diffs"]   # off one device before any update, further at every step
    assert diffs[0] > 1e-3 and all(b > a for a, b in zip(diffs, diffs[1:])), diffs


def _unused_parameter(metrics, result):
    """Step 0 all-reduces nothing; at step 1 every rank stops with torch 2.13's own words, which the registry quotes."""
    assert metrics["extra"]["micro_step_bytes"] == [[0, 0]], metrics["extra"]
    assert any(line.startswith("step   0") and "all-reduced [0, 0] B" in line for line in result.lines)
    refused = next(c for c in metrics["checks"] if c["name"] == "every step's forward ran")
    quoted = broken_runs.case("unused-parameter").symptom.split("'")[1]
    assert refused["value"].startswith(f"step 1: {quoted}. This error indicates that your module has parameters "
                                       "that were not used in producing loss."), refused
    assert "Parameter indices which did not receive grad for rank 0:" in refused["value"], refused
    assert set(result.rank_exit_codes.values()) == {1}, result.rank_exit_codes


def _nan_from_one_rank(metrics, result):
    """One rank's own loss goes nan first, alone; a step later every rank's; before, the run is one device's."""
    losses = metrics["extra"]["rank_losses"]
    first = int(re.search(r"nan from step (\d+)", broken_runs.case("nan-from-one-rank").symptom)[1])
    assert all(map(math.isfinite, sum(losses[:first], []))), losses
    assert [math.isfinite(loss) for loss in losses[first]] == [True, True, False, True], losses[first]
    assert not any(map(math.isfinite, sum(losses[first + 1:], []))), losses
    assert max(metrics["extra"]["diffs"]["baseline_loss"][:first]) < 1e-5, metrics["extra"]["diffs"]
    assert math.isnan(metrics["losses"][first])


def _local_grad_norm(metrics, result):
    """Each rank logs another norm, the numbers the symptom states; their squares add up to one device's squared."""
    norms, one_device = metrics["extra"]["rank_grad_norms"], metrics["extra"]["one_device_grad_norms"]
    low, high, whole = map(float, re.search(r"\(([\d.]+) to ([\d.]+) at step 0\), none near one device's \(([\d.]+)\)",
                                            broken_runs.case("local-grad-norm").symptom).groups())
    assert (round(min(norms[0]), 2), round(max(norms[0]), 2), round(one_device[0], 2)) == (low, high, whole), norms
    # step 0, where the gradients are one device's: the ranks' norms are pieces of its norm (later the weights differ)
    assert math.sqrt(sum(n * n for n in norms[0])) == pytest.approx(one_device[0], rel=1e-5), (norms[0], one_device)
    assert all(max(ranks) - min(ranks) > 0.02 for ranks in norms), norms   # and they differ at every step
    assert metrics["extra"]["param_diffs"][0] > 3e-4 and metrics["extra"]["loss_diffs"][0] < 1e-6   # the update


def _single_device_losses(result):
    """Each step's loss and one device's, as the run prints them ("step N  loss X ... | single-device Y")."""
    found = [re.search(r"loss (\S+) .*\| single-device (\S+)", line) for line in result.lines
             if line.startswith("step")]
    return [(float(m[1]), float(m[2])) for m in found if m]


def _global_batch_grows(metrics, result):
    """The first line's global batch is twice the recipe's; the loss drops below one device's when the grown run
    starts its second pass over the samples, which one device has not yet finished reading once."""
    said = broken_runs.case("global-batch-grows").symptom
    grown, recipe = map(int, re.search(r"global batch (\d+) where the recipe's is (\d+)", said).groups())
    assert metrics["config"]["batch"] == recipe and grown == 2 * recipe, metrics["config"]
    assert any(line.startswith(f"tiny transformer") and f"global batch {grown} = 4 ranks" in line
               for line in result.lines), result.tail()
    # an epoch of the run's samples takes half the steps: from the step a second epoch begins, the grown run
    # re-reads samples it has trained on, and its loss drops below one device's most there
    samples = metrics["config"]["samples"]
    turn, worst, grown_epoch, recipe_epoch = re.search(
        r"most at step (\d+) \(([\d.]+) below\), where a second epoch starts: \d+ samples, (\d+) steps an epoch, "
        r"not (\d+)", said).groups()
    assert (int(grown_epoch), int(recipe_epoch)) == (samples // grown, samples // recipe) and int(turn) == samples // grown
    pairs = _single_device_losses(result)
    gaps = [one - run for run, one in pairs]
    assert len(pairs) == 5 and max(range(5), key=gaps.__getitem__) == int(turn), pairs
    assert round(max(gaps), 2) == float(worst), pairs
    assert abs(gaps[0]) < 0.02 and gaps[int(turn)] > 5 * abs(gaps[0]), gaps   # step 0: the same weights, other samples
    # the recap's and the picture's words for it: below one device, most where the grown run's second epoch begins
    from coursetools.drawings.ch14 import PATHS

    assert PATHS["global-batch-grows"][0] == "below one device, most in its 2nd epoch"
    assert min(gaps) > 0, gaps   # below at every step of this run; most at step `turn`, the second epoch's first (above)
    passed = {c["name"]: c["passed"] for c in metrics["checks"]}   # the ranks agree, and the from-scratch version
    assert passed["replicas identical after training"] and passed["DDP gradients = from-scratch gradients (every step)"]


def _token_mean(metrics, result):
    """Off one device from the first step by the symptom's amount; the replicas agree and the bytes are right."""
    said = broken_runs.case("token-mean-per-micro-batch").symptom
    diffs = metrics["extra"]["diffs"]["baseline_loss"]
    assert diffs[0] > 1e-3 and round(max(diffs), 2) == float(re.search(r"\(([\d.]+) at worst\)", said)[1]), diffs
    passed = {c["name"]: c["passed"] for c in metrics["checks"]}
    assert passed["replicas identical after training"], passed
    assert passed["bytes all-reduced per optimizer step = parameter bytes (comm hook, every step)"], passed


def _stage_grad_norm(metrics, result):
    """Each rank logs its stages' norm, the numbers the symptom states; their squares add up to one device's."""
    norms, one_device = metrics["extra"]["rank_grad_norms"], metrics["extra"]["one_device_grad_norms"]
    low, high, whole = map(float, re.search(r"\(([\d.]+) to ([\d.]+) at step 0\), none near one device's \(([\d.]+)\)",
                                            broken_runs.case("stage-grad-norm").symptom).groups())
    assert (round(min(norms[0]), 2), round(max(norms[0]), 2), round(one_device[0], 2)) == (low, high, whole), norms
    assert math.sqrt(sum(n * n for n in norms[0])) == pytest.approx(one_device[0], rel=1e-5), (norms[0], one_device)
    passed = {c["name"]: c["passed"] for c in metrics["checks"]}
    assert passed["first step's gradients equal the single-device run's"], passed   # right until the clip
    # "the weights leave one device's at the first update": already past the script's own tolerance (lr / 10) after
    # step 0, though AdamW's first step barely depends on a gradient's scale (it does where a gradient is near eps)
    diffs, lr = metrics["extra"]["param_diffs"], metrics["config"]["lr"]
    assert "leave one device's at the first update" in broken_runs.case("stage-grad-norm").symptom
    assert diffs[0] > lr / 10 and diffs[-1] > diffs[0], diffs


def _token_out_of_vocabulary(metrics, result):
    """Step 0 trains; at step 1 rank 3 raises IndexError in the embedding lookup, first, and the three others fail in
    the step's all-reduce on gloo's lost peer; torch's summary (forkrun prints torchrun's) names rank 3 the root cause.
    The id and the vocabulary the registry states are the run's: the tiny model's vocabulary, and that id."""
    import importlib.util
    import sys

    from distlab import models

    case = broken_runs.case("token-out-of-vocabulary")
    rank = case.first_failure[0]
    steps = [line for line in result.lines if line.startswith("step")]
    assert len(steps) == 1 and steps[0].startswith("step   0"), steps   # one step trained, then it stopped
    failures = broken_runs.failure_summary(result.output)
    root, others = failures[0], failures[1:]
    assert root["root"] and (root["rank"], root["error"]) == (rank, "IndexError: index out of range in self"), root
    summary = result.output[result.output.index("Root Cause (first observed failure):"):]
    assert "in embedding" in summary and "self.tok_embeddings(tokens)" in summary   # the lookup, in its traceback
    assert sorted(f["rank"] for f in others) == [r for r in range(4) if r != rank], failures
    assert all("by peer" in f["error"] and "gloo" in f["error"] for f in others), others   # lost the peer that left
    assert f"Rank {rank}'s ends in IndexError: 'index out of range in self'" in case.symptom
    assert "at step 1" in case.symptom and "Connection closed by peer" in case.symptom
    vocabulary = models.preset("tiny").vocab_size
    assert f"holds token id {vocabulary}, one past the embedding's last row (the tiny model's {vocabulary} ids)" \
        in case.cause and f"rank {rank} reads at step 1" in case.cause
    sys.path.insert(0, str(broken_runs.launch.REPO_ROOT / "scripts" / "04_data_parallel"))
    spec = importlib.util.spec_from_file_location("train_ddp", broken_runs.launch.REPO_ROOT / case.script)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert (script.BAD_TOKEN_STEP, script.BAD_TOKEN_RANK) == (1, rank)


SYMPTOMS = {"same-samples-every-rank": _same_samples, "no-set-epoch": _no_set_epoch,
            "accumulation-never-syncs": _never_syncs, "loss-averaged-twice": _averaged_twice,
            "uneven-inputs": _uneven, "checkpoint-one-shard": _one_shard, "bf16-gradient-reduction": _bf16_reduction,
            "loss-on-wrong-stage": _loss_on_wrong_stage, "too-few-microbatches": _too_few_microbatches,
            "fsdp-before-tp": _fsdp_before_tp, "slow-rank": _slow_rank, "data-by-global-rank": _data_by_global_rank,
            "optimizer-before-sharding": _optimizer_before_sharding, "full-state-on-rank-0": _full_state_on_rank_0,
            "rank-0-evaluation": _rank_0_evaluation, "per-rank-init": _per_rank_init,
            "local-grad-norm": _local_grad_norm, "nan-from-one-rank": _nan_from_one_rank,
            "unused-parameter": _unused_parameter, "global-batch-grows": _global_batch_grows,
            "token-mean-per-micro-batch": _token_mean, "stage-grad-norm": _stage_grad_norm,
            "token-out-of-vocabulary": _token_out_of_vocabulary}


def _distinct_losses(metrics, result):
    assert not any(_rank_losses_equal(metrics)), metrics["extra"]["rank_losses"]


def _no_hang(metrics, result):
    states = {j["state"] for j in metrics["extra"]["journals"].values()}
    assert states == {"finished"}, states


def _full_state_saved(metrics, result):
    _no_hang(metrics, result)
    saved = [c for c in metrics["checks"] if c["name"].startswith("rank 0 saved every weight whole")]
    assert saved and saved[0]["passed"], metrics["checks"]


def _evaluation_shared(metrics, result):
    _no_hang(metrics, result)
    alone = [c["seconds"] for j in metrics["extra"]["journals"].values() for c in j["calls"] if c["op"] == "compute"]
    assert len(alone) == 4 and max(alone) < float(broken_runs.HANG_TIMEOUT[1]), alone   # each rank's share


def _one_norm(metrics, result):
    norms, one_device = metrics["extra"]["rank_grad_norms"], metrics["extra"]["one_device_grad_norms"]
    assert all(n == pytest.approx(whole, rel=1e-5) for ranks, whole in zip(norms, one_device) for n in ranks)
    assert min(one_device) > float(broken_runs.CLIP_RUN[-1])   # every step clips


def _all_finite(metrics, result):
    assert all(map(math.isfinite, sum(metrics["extra"]["rank_losses"], []))), metrics["extra"]["rank_losses"]


def _one_pipeline_norm(metrics, result):
    norms, one_device = metrics["extra"]["rank_grad_norms"], metrics["extra"]["one_device_grad_norms"]
    assert all(n == pytest.approx(whole, rel=1e-5) for ranks, whole in zip(norms, one_device) for n in ranks)
    assert max(metrics["extra"]["param_diffs"]) < metrics["config"]["lr"] / 100   # the weights stay one device's
    assert min(one_device) > float(broken_runs.PIPELINE_CLIP_RUN[-1])   # every step clips


GONE = {"stage-grad-norm": _one_pipeline_norm, "same-samples-every-rank": _distinct_losses, "nan-from-one-rank": _all_finite, "local-grad-norm": _one_norm, "uneven-inputs": _no_hang,
        "full-state-on-rank-0": _full_state_saved, "rank-0-evaluation": _evaluation_shared}


def test_the_same_run_with_every_target_kept_equals_one_device(launched):
    """token-mean-per-micro-batch's symptom names its own tell-apart: the lengths. The planted run itself, its mean
    over each micro-batch's own kept tokens, with every target kept (--keep-every-target in place of
    --uneven-lengths): micro-batches of equal counts, whose mean of means is one device's mean."""
    case = broken_runs.case("token-mean-per-micro-batch")
    assert "--uneven-lengths" in case.args and "--planted-bug" in case.args
    even = launched(case, fixed=False,
                    args=[a if a != "--uneven-lengths" else "--keep-every-target" for a in case.args])
    assert even.returncode == 0 and not broken_runs.fix_holds(case, even.metrics), even.tail()
    assert even.metrics["config"]["planted_bug"] == case.name and even.metrics["config"]["keep_every_target"]
    assert max(even.metrics["extra"]["diffs"]["baseline_loss"]) < 1e-5, even.metrics["extra"]["diffs"]


def test_the_token_mean_mistake_without_a_mask_is_refused_on_every_rank():
    """Without --uneven-lengths or --keep-every-target no loss is masked, so the mistake would not be planted: a
    learner who drops the flag to keep every target would run correct code and learn nothing. One line, exit 2."""
    assert_config_error(broken_runs.TRAIN_DDP, ["--planted-bug", "token-mean-per-micro-batch", "--steps", "1"],
                        "--planted-bug token-mean-per-micro-batch", nproc=2)

def test_under_torchrun_the_error_one_rank_raises_leaves_the_others_stopped_by_the_agent():
    """The chapter's own command for token-out-of-vocabulary, under torchrun: rank 3's IndexError is the root cause,
    and torchrun's agent SIGTERMs every other rank at once (torch/distributed/elastic/multiprocessing/api.py:988-992),
    so each is listed stopped, with gloo's lost peer if it got to print it, or with the signal alone if it was still
    waiting: such a rank prints nothing. The fork launcher's run (above) gives them a few seconds: all three print
    gloo's error. The chapter says both. torch's root cause is the smallest whole-second timestamp, the first found
    of equals: a lower rank that lost rank 3 in the same second and was found in the same poll is named instead (CI
    saw rank 2), with rank 3's IndexError under "Failures" at the same time. The chapter says that too."""
    from labkit import launch

    case = broken_runs.case("token-out-of-vocabulary")
    result = launch.run(case.script, nproc=case.nproc, args=case.args, launcher="torchrun", stream=False, timeout=120,
                        check=False)
    assert result.returncode != 0 and result.metrics is None, result.tail()
    failures = broken_runs.failure_summary(result.output)
    rank = case.first_failure[0]
    raised = next(f for f in failures if f["rank"] == rank)
    assert raised["error"] == "IndexError: index out of range in self" and raised["exitcode"] == 1, failures
    named = failures[0]
    assert named["root"] and (named is raised or (named["rank"] < rank and named["time"] == raised["time"]
                                                  and "by peer" in named["error"])), failures
    others = [f for f in failures if f is not raised]
    assert sorted(f["rank"] for f in others) == [r for r in range(case.nproc) if r != rank], failures
    # every other rank failed on its lost peer or was stopped by the agent's SIGTERM
    assert all(f["exitcode"] == -15 or "by peer" in f["error"] for f in others), others
    assert all("by peer" in (f["error"] or "") or (f["error"] or "").startswith("Signal 15") for f in others), others
    # a rank the agent stopped before it saw the lost peer wrote no error file: its signal alone. Whether any was
    # still waiting is a race (on 2 loaded cores all three had raised before the agent's poll), so it is not asserted
    assert broken_runs.symptom_seen(case, result.metrics, result.output) == []
