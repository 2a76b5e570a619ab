"""The checks of chapter 14's exercises: name the cause of a broken run from what it shows, then fix it.

The lab runs the broken runs of :mod:`labkit.broken_runs` under neutral labels (``run 1`` ... ``run 25``: a case's
name is its diagnosis, and this module keeps no map from a label to a case, only a salted hash of each; no function
returns a label's case, and the runs it keeps are keyed by a hash). That hides the answers from a glance, not from
a determined reader: the module must launch each run with its flag, and can hash every key of the menu. It shows what
a user would see (:func:`run`: the checks and lines that would say the cause hidden or renamed), and asks two
things of each:

* **the diagnosis** (:func:`check_diagnoses`): a key of :data:`CAUSES` for each run. A wrong key is rejected with
  what it would have shown, and which of the run's own evidence to look at again (never the answer);
* **the fix** (``check_fix_*``): a small function or setting, run inside the job. A function is written to
  a file (:func:`learner_file`) that the case's script loads with its flag (``--fix-from``, or the older
  ``--data-shard-from``, ``--wrappers-from``, ``--optimizer-from``) and calls on every rank in place of its own
  code; a setting goes in as the script's flag (``--microbatches``, ``--reduce-dtype``, ``--checkpoint-holds``).
  The fix passes only when that run passes its own checks (:func:`labkit.broken_runs.fix_holds`): the symptom
  gone, every check against one device passing. A wrong fix fails there, and the message says which of the run's
  checks failed, never the answer.

Runs are launched once per kernel (:func:`_launch`); :func:`prefetch` starts the broken runs in the background.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
import math
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from labkit import forkserver
from labkit import broken_runs, launch
from labkit.exercises.checks import ExerciseWrong, _not_done, call_learner, learner_check

# The lab's order, by the chapter's three questions: stuck or slow? stops or prints nonsense? do the ranks agree?
# does the run agree with one device? A case's name is its diagnosis, so this module holds no map from a label to
# a case: each label keeps a salted hash of its case's name (_token), and a diagnosis passes when its hash is the
# label's. The lab finds a label's case to launch by the same hash.
_SALT = "distlab-ch14"
_TOKENS = {
    "run 1": "871aa3d958335dca",
    "run 2": "ee74028d59c760bb",
    "run 3": "ca24825ee1b56bc3",
    "run 4": "94a2aa6d04558e8d",
    "run 5": "315403087366780c",
    "run 6": "d11063e10b3afe09",
    "run 7": "db22af29f23fa616",
    "run 8": "43e3f2d680a99e5c",
    "run 9": "029893b7d4243f9d",
    "run 10": "89acd143c596521d",
    "run 11": "9b6b0a2f15886bb7",
    "run 12": "a58ac0b3dd5e8f68",
    "run 13": "e7572dc9d519b3e4",
    "run 14": "f1f28a0108253ac8",
    "run 15": "8390c774cbfb6e23",
    "run 16": "1dd839f17ef9fac0",
    "run 17": "d8c3617ca71fb45c",
    "run 18": "8bbd032f6712da95",
    "run 19": "a3844941c58f838e",
    "run 20": "d1f11d3bfe1bef41",
    "run 21": "36c79c33376d1e22",
    "run 22": "7e0ccfa19b94b445",
    "run 23": "4ef8e7a123d81f4e",
    "run 24": "71d08388d01e9bb4",
    "run 25": "1e2517f5c57750bb",
}
LABELS = tuple(_TOKENS)
PARTS = {"stuck or slow": ("run 1", "run 2", "run 3", "run 4"),
         "stops or prints nonsense": ("run 5", "run 6", "run 25"),
         "ranks that disagree": ("run 7", "run 8", "run 9"),
         "wrong against one device": ("run 10", "run 11", "run 12", "run 13", "run 14", "run 15"),
         "two more jobs that stop": ("run 16", "run 17"),
         "four more runs": ("run 18", "run 19", "run 20", "run 21"),
         "three more wrong numbers": ("run 22", "run 23", "run 24")}
# The lab is three notebooks, each under a minute on 2 cores (about 30 s each in lab-check, BENCHMARKS.md): the
# chapter's first two questions (stuck or slow? do the ranks agree?, with part 2's runs that stop) and their fixes; its third (does the run agree with one device?), whose FSDP, TP and
# checkpoint runs are the lab's heaviest; then more failures of every kind. Each prefetches its own parts' runs
# (prefetch(notebook=...)).
NOTEBOOKS = {"14_when_it_goes_wrong": ("stuck or slow", "stops or prints nonsense", "ranks that disagree"),
             "14_against_one_device": ("wrong against one device",),
             "14_more_failures": ("two more jobs that stop", "four more runs", "three more wrong numbers")}


def _token(name: str) -> str:
    return hashlib.sha256(f"{_SALT}:{name}".encode()).hexdigest()[:16]


def _run_key(*parts) -> str:
    """The key of a distinct command in :data:`_RUNS` and :data:`_PENDING`: a hash of its parts, so that their keys
    do not spell the arguments (which name a planted case)."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


# Plausible wrong causes that are not cases of the registry: (key, the registry's words, what it would show).
DISTRACTORS = (
    ("learning-rate-too-low", "a learning rate too low",
     "every rank and one device alike learning slowly: the run would still equal one device trained at that rate"),
    ("learning-rate-too-high", "a diverging run (a learning rate too high)",
     "losses that grow, then inf or nan, and weights that leave one device's as they blow up"),
    ("bf16-overflow", "bf16 overflow",
     "inf or nan in the weights too, not only in what is printed (bf16 has fp32's range: it rarely overflows)"),
    ("sum-gradients", "sum-gradients (N times too large, train_fsdp.py)",
     "gradients N times one device's (summed where they should be averaged), not 1/N of them"),
    ("network-failure", "a network failure",
     "on NCCL, most often a watchdog timeout: every rank waiting in the same collective until the timeout, none "
     "finished and none in another call (pytorch#118369: 'the network or NCCL layer broke down'); a connection "
     "error (reset by peer) only where a socket breaks, as on gloo, with no rank raising an error of its own (an "
     "exception outside the collectives) before the others' connection errors"),
    ("slow-network", "a slow network",
     "every rank slow in its collectives alike, none of them idle while the others wait"),
    ("nondeterministic-kernels", "nondeterministic kernels",
     "differences at fp32 rounding's size (1e-7), the same on any number of ranks, and the right byte counts"),
    ("norm-logged-unreduced", "a norm logged before it is reduced",
     "each rank logging its own piece of one norm, while the weights after the first clipped step equal one "
     "device's: the clip was right, only the log is a piece"),
    ("lr-schedule-restarted", "a learning-rate schedule restarted",
     "a resumed run whose first steps move differently, while the reloaded weights equal the saved ones"),
    ("mesh-does-not-divide-world", "a mesh that does not divide the world",
     "a configuration error at init_device_mesh naming the world size, before any module is touched"),
    ("mesh-names-swapped", "a mesh with its dimension names swapped",
     "a failed group check: the groups read back from the model's mesh differ from the rank grid (rank 0's TP "
     "group [0, 2], not [0, 1])"),
)
_DISTRACTOR_BY_WORDS = {words: key for key, words, _ in DISTRACTORS}
_DISTRACTOR_SHOWS = {key: shows for key, _, shows in DISTRACTORS}

# The menu a learner picks from: every case's name and every distractor's key, with a line saying what it means.
CAUSES = {
    "same-samples-every-rank": "every rank reads the same samples (no sampler, or one seed for all)",
    "no-set-epoch": "the sampler's epoch is never set: every epoch repeats the first one's order",
    "accumulation-never-syncs": "gradient accumulation that never synchronises, the last micro-batch too",
    "loss-averaged-twice": "the loss divided by the world size, and the gradients averaged over the ranks again",
    "uneven-inputs": "the ranks' shards of data of unequal length: one runs out first",
    "checkpoint-one-shard": "a checkpoint saved from one rank's shard and copied into every rank's shards",
    "bf16-gradient-reduction": "gradients summed over the ranks in bf16",
    "optimizer-before-sharding": "the optimizer built before the model was sharded",
    "data-by-global-rank": "each rank's data chosen by its global rank, not by its place on the model's mesh",
    "loss-on-wrong-stage": "the loss read on a pipeline stage that does not compute it",
    "too-few-microbatches": "fewer microbatches than pipeline stages",
    "fsdp-before-tp": "FSDP applied before the tensor-parallel plan",
    "mismatched-collectives": "ranks that call different collectives at the same point of the program",
    "resume-without-rng": "a resume without the random number generators and the data position",
    "slow-rank": "one rank slower than the others every step",
    "full-state-on-rank-0": "a full state dict gathered under `if rank == 0:`",
    "per-rank-init": "each rank's model initialised from its own seed before sharding",
    "unused-parameter": "a parameter the forward never uses, wrapped by DDP as it is",
    "nan-from-one-rank": "a nan on one rank, spread to every rank by the gradient all-reduce",
    "local-grad-norm": "gradients clipped by the norm of each rank's own shards, never reduced over the ranks",
    "rank-0-evaluation": "work one rank does alone that outlasts the process group's timeout",
    "stage-grad-norm": "gradients clipped by each pipeline stage's own norm, never reduced over the stages",
    "token-mean-per-micro-batch": "a loss averaged over each micro-batch's own tokens, not over the whole step's",
    "global-batch-grows": "a per-rank batch kept when the world size changed: the global batch changed with it",
    "token-out-of-vocabulary": "a token id the model's vocabulary does not hold, in one rank's data",
    "learning-rate-too-low": "a learning rate too low",
    "learning-rate-too-high": "a learning rate too high: the run diverges",
    "bf16-overflow": "bf16 overflowing to inf",
    "sum-gradients": "gradients summed over the ranks where they should be averaged",
    "network-failure": "a network failure between nodes",
    "slow-network": "a slow network",
    "nondeterministic-kernels": "nondeterministic kernels (atomics, reduction order)",
    "norm-logged-unreduced": "a gradient norm logged on each rank before it is reduced over the ranks",
    "lr-schedule-restarted": "a learning-rate schedule restarted from its first step on resume",
    "mesh-does-not-divide-world": "a device mesh whose shape does not divide the world size",
    "mesh-names-swapped": "a device mesh built with its dimension names swapped",
}


def look_alike_key(words: str) -> str:
    """The menu key of a registry look-alike: a case's name, or a distractor's key from the registry's words."""
    return words if words in CAUSES and words not in _DISTRACTOR_SHOWS else _DISTRACTOR_BY_WORDS[words]


def _would_show(key: str) -> str:
    if key in _DISTRACTOR_SHOWS:
        return _DISTRACTOR_SHOWS[key] + "."
    return broken_runs.case(key).symptom


# What a user would look at, for each kind of evidence a case names (the registry's ``evidence`` keys): a wrong
# diagnosis is pointed at the evidence of the run's own symptom, never at the answer or its tell-apart.
EVIDENCE_WORDS = {
    "extra.rank_losses": "the losses per rank, step by step",
    "extra.diffs.baseline_loss": "the distance from one device's loss, step by step",
    "extra.micro_step_bytes": "the bytes all-reduced in each micro-batch",
    "extra.grad_diffs": "the gradients against one device's",
    "extra.loss_diffs": "the losses against one device's",
    "extra.param_diffs": "the weights against one device's",
    "extra.journals": "each rank's journal of calls: where each one waits, and which have finished",
    "extra.losses_by_step": "the losses after the resume, step by step",
    "extra.earlier_losses": "the losses before the stop",
    "extra.uninterrupted_losses": "one device's uninterrupted losses",
    "extra.bubble": "the share of the step each rank is idle, against the schedule's formula",
    "extra.ranks": "each rank's time by kind (compute, communication, idle)",
    "extra.timeline": "the timeline per rank",
    "extra.flight_recorder": "the flight recorder's last collectives per rank",
    "extra.replica_weight_gaps": "the replicas' weights compared, before the first step and after each",
    "extra.rank_grad_norms": "the gradient norm each rank logs, step by step",
    "extra.one_device_grad_norms": "one device's gradient norm, step by step",
    "losses": "the losses printed at every step",
    "comm": "the bytes each collective moved, against its formula",
    "checks": "the checks against one device",
    "throughput": "the time a step takes",
    "timeline": "the timeline per rank",
    "extra": "what the run recorded of each attempt",
    "output": "the run's output, rank by rank: its lines and its errors",
}


def _evidence(run: broken_runs.BrokenRun) -> str:
    words = [EVIDENCE_WORDS[key] for key in run.evidence if key in EVIDENCE_WORDS]
    return "; ".join(dict.fromkeys(words))


def _part_evidence(label: str) -> str:
    """What every run of ``label``'s part is read by, together: one run's own evidence would single out its case."""
    part = next(labels for labels in PARTS.values() if label in labels)
    runs = [case for each in part for case in broken_runs.BROKEN_RUNS if _token(case.name) == _TOKENS[each]]
    keys = dict.fromkeys(key for case in runs for key in case.evidence)
    return "; ".join(dict.fromkeys(EVIDENCE_WORDS[key] for key in keys if key in EVIDENCE_WORDS))


def diagnosis_feedback(label: str, answer: str) -> str | None:
    """None when ``answer`` names run ``label``'s cause, else why not: what the wrong answer would have shown, and
    which of the run's own evidence to look at again (never the right answer, nor the check that singles it out)."""
    if answer in CAUSES and _token(answer) == _TOKENS[label]:
        return None
    if answer not in CAUSES:
        return f"{label}: {answer!r} is not a key of exercises.CAUSES (print it for the menu)."
    run = next(case for case in broken_runs.BROKEN_RUNS if _token(case.name) == _TOKENS[label])
    look = f"Look again at {_part_evidence(label)}: what does {label} show there?"
    if answer in {look_alike_key(w) for w in run.look_alikes}:
        return f"{label} is not {answer}, though the two look alike: {answer} would show: {_would_show(answer)} {look}"
    return (f"{label} is not {answer}: {answer} would show: {_would_show(answer)} That is not what {label} "
            f"shows: ask the chapter's three questions again (stuck or slow? do the ranks agree? does the run "
            f"agree with one device?). {look}")


@learner_check
def check_diagnoses(diagnoses, part: str) -> None:
    """``diagnoses``: {"run N": a key of CAUSES} for every run of ``part`` (a key of PARTS)."""
    if diagnoses is None:
        raise _not_done("diagnoses", "Name a cause (a key of exercises.CAUSES) for each run of this part.")
    labels = PARTS[part]
    missing = [label for label in labels if diagnoses.get(label) in (None, ...)]
    if missing:
        raise _not_done("diagnoses", f"Still to name: {', '.join(missing)}.")
    for label in labels:
        reason = diagnosis_feedback(label, diagnoses[label])
        if reason:
            raise ExerciseWrong(reason)
    print("Correct:")
    for label in labels:   # every answer given was right: the causes, as the registry says them
        run = next(case for case in broken_runs.BROKEN_RUNS if _token(case.name) == _TOKENS[label])
        print(f"  {label} is {run.name}: {run.cause}")


# ---- running the cases -----------------------------------------------------------------------------------------

_RUNS: dict = {}   # _run_key(script, prepare args, args) -> LaunchResult: each distinct command launched once per kernel
# Cases whose fixed run is judged by a time (the bubble against its target, the ranks' arrival spread): make test runs
# the lab while other tests load the machine, so the lab's run of such a fix is kept out of the launch cache, where
# tests/scripts/test_14 (its TIMED, run later with the machine to itself) would replay it.
TIMED = ("too-few-microbatches", "slow-rank")
CACHE_ENV = "DISTLAB_LAUNCH_CACHE"


def _launch(label_or_name: str, fixed: bool = False, args=None, extra=(), nproc=None):
    """The run of a case (by its lab label or its name), broken or ``fixed`` or with ``args`` instead of the
    case's, ``extra`` added to the interrupted job's arguments and the run's, launched once per kernel through
    :func:`labkit.broken_runs.run_case`: the full result, as the script wrote it (the lab shows :func:`run`'s view
    of it)."""
    case = next((case for case in broken_runs.BROKEN_RUNS if _token(case.name) == _TOKENS.get(label_or_name)), None) \
        or broken_runs.case(label_or_name)
    prepare = case.fixed_prepare_args if fixed else case.prepare_args
    chosen = tuple(args) if args is not None else (case.fixed_args if fixed else case.args)
    key = _run_key(case.script, prepare, chosen, *((tuple(extra),) if extra else ()), *((nproc,) if nproc else ()))
    if key in _PENDING:   # started by prefetch(): wait for it
        _RUNS[key] = _PENDING.pop(key).result()
    if key not in _RUNS:
        # About thirty launches: each forked from one process that imported torch once (what make test does),
        # not a new interpreter importing it again (2.4 s a launch).
        os.environ.setdefault(forkserver.ENABLE_ENV, "1")
        uncached = case.name in TIMED and (fixed or args is not None)
        cache = os.environ.pop(CACHE_ENV, None) if uncached else None
        try:
            _RUNS[key] = broken_runs.run_case(case.name, fixed=fixed, args_override=args, extra_args=extra,
                                              nproc=nproc, stream=False)
        finally:
            if cache is not None:
                os.environ[CACHE_ENV] = cache
    _RUNS[key] = _unnamed(_RUNS[key])
    return _RUNS[key]


_CASE_NAMES = re.compile("|".join(sorted((re.escape(case.name) for case in broken_runs.BROKEN_RUNS), key=len,
                                         reverse=True)))


def _unnamed(result):
    """A launch's result with no case's name left in it: the command cut after its script (its arguments, such as
    --planted-bug NAME, name the case), and each name in the output and the metrics replaced. The checks and their
    values stay: the fix checks read them."""
    if not isinstance(result, launch.LaunchResult):
        return result
    command = list(result.command)
    script = next((i for i, part in enumerate(command) if str(part).endswith(".py")), len(command) - 1)
    text = json.dumps(result.metrics) if result.metrics is not None else None
    return dataclasses.replace(result, command=command[:script + 1],
                               output=_CASE_NAMES.sub("(hidden)", result.output),
                               metrics=None if text is None else json.loads(_CASE_NAMES.sub("(hidden)", text)))


_PENDING: dict = {}   # key -> Future: the broken runs prefetch() started


def _prefetch_order(label: str):
    """The lab's order: each part's runs start before the next part's (run 25 with part 2's), so a part's cell waits
    for its own runs only, and a notebook of several parts (the first, the third) runs its first part's cells while
    the later parts' runs use the cores. Longest first had every cell of part 1 wait for the two-launch resumes:
    measured on 2 cores when the lab was one notebook (session 13), it took 76-81 s that way, 49-66 s this way."""
    return [each for labels in PARTS.values() for each in labels].index(label)
PREFETCH_WORKERS = 3


def prefetch(labels=None, workers: int = PREFETCH_WORKERS, *, notebook: str | None = None) -> None:
    """Start the lab's broken runs (``labels``, or those of ``notebook``'s parts, a key of :data:`NOTEBOOKS`;
    default all) in the background, ``workers`` at a time, so that :func:`run` finds each done or under way. Much
    of a broken run is waiting (a hang's timeout, a slow rank's sleep, the ranks' start), which another run can
    use. Broken runs only: a fix is judged by its own run, alone."""
    from concurrent.futures import ThreadPoolExecutor

    if notebook is not None:
        if labels is not None:
            raise ValueError("give labels or a notebook, not both")
        if notebook not in NOTEBOOKS:
            raise ValueError(f"notebook {notebook!r}: one of {sorted(NOTEBOOKS)}")
        labels = [label for part in NOTEBOOKS[notebook] for label in PARTS[part]]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ch14-prefetch")
    for label in sorted(labels or LABELS, key=_prefetch_order):
        case = next(case for case in broken_runs.BROKEN_RUNS if _token(case.name) == _TOKENS[label])
        key = _run_key(case.script, case.prepare_args, case.args)
        if key not in _RUNS and key not in _PENDING:
            _PENDING[key] = pool.submit(broken_runs.run_case, case.name, stream=False)
    pool.shutdown(wait=False)


# ---- what the lab shows of a run: what a user's own tools would show, never the case or its cause -----------------
# The scripts check themselves with the course's instrumentation, and some of those checks, or the lines a hang's
# journal prints, say what was planted. The lab hides them (HIDDEN_CHECKS, HIDDEN_LINES, HIDDEN_EXTRA) and renames
# the checks whose name says the cause (RENAMED_CHECKS) to what was measured; a run's folder is named by a hash.
HIDDEN_CHECKS = ("the training samplers' first epoch", "the training sampler's order changed with the epoch",
                 "micro-steps inside no_sync()", "the diagnosis names the planted cause",
                 "DistributedSampler: the ranks' shards")
RENAMED_CHECKS = {
    "the TP plan was applied before FSDP (parallelize_module, then fully_shard)": "the model was built",
    "no straggler: every rank reaches backward's all-reduces with the others":
        "every rank reaches backward's all-reduces with the others",
    "initial full weights (gathered from the shards) = the single-device model's, built from the seed":
        "initial full weights (gathered from the shards) = the single-device model's",
    # its name would make "how many sequences does a step train on?" a matter of matching words: the count it
    # measured stays, beside the run's first line and the recipe's --batch
    "sequences per optimizer step = the global batch asked for (--batch)": "sequences per optimizer step",
}
HIDDEN_LINES = re.compile(r"planting:|diagnosis:|planted|--planted-bug|--hang")
HIDDEN_EXTRA = ("cause", "verdict")
HIDDEN_CONFIG = ("planted_bug", "hang", "resume_without_rng", "stop_at_fewest_batches", "optimizer_from",
                 "data_shard_from", "wrappers_from", "fix_from", "reduce_dtype",
                 "checkpoint_holds", "gather_on_every_rank", "evaluate_on_every_rank",
                 "eval_seconds", "model_seed_from", "clip_from")   # the flags that load a learner's fix name what it fixes


def shown_check_name(name: str) -> str | None:
    """A check's name as the lab shows it: renamed where it says the cause, None where the lab hides it."""
    if name.startswith(HIDDEN_CHECKS):
        return None
    for old, new in RENAMED_CHECKS.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _shown_line(line: str) -> str | None:
    if HIDDEN_LINES.search(line) or any(hidden in line for hidden in HIDDEN_CHECKS):
        return None
    for old, new in RENAMED_CHECKS.items():
        line = line.replace(old, new)
    return line


@dataclass
class Shown:
    """What the lab shows of a run: its exit codes, time, output and metrics as a user would see them."""
    returncode: int
    seconds: float
    rank_exit_codes: dict
    output: str
    metrics: dict | None

    @property
    def lines(self) -> list[str]:
        return self.output.splitlines()


def shown(result) -> Shown:
    """The lab's view of a launch's result (:data:`HIDDEN_CHECKS` and the rest filtered out)."""
    metrics = copy.deepcopy(result.metrics)
    if metrics is not None:
        metrics["checks"] = [dict(c, name=shown_check_name(c["name"])) for c in metrics.get("checks", [])
                             if shown_check_name(c["name"]) is not None]
        for key in HIDDEN_EXTRA:
            (metrics.get("extra") or {}).pop(key, None)
        for key in HIDDEN_CONFIG:
            (metrics.get("config") or {}).pop(key, None)
    output = "\n".join(line for line in map(_shown_line, result.output.splitlines()) if line is not None)
    return Shown(result.returncode, result.seconds, dict(result.rank_exit_codes), output, metrics)


def run(label: str) -> Shown:
    """Run ``label`` of the lab (its broken run), launched once per kernel, as a user would see it."""
    if label not in _TOKENS:
        raise KeyError(f"{label!r} is not one of the lab's runs: {', '.join(LABELS)}")
    return shown(_launch(label))


def per_step(run: Shown) -> list[str]:
    """What each rank logged, step by step, as any user can print it: its own loss (before the all-reduce), and the
    gradient norm it clipped by beside one device's, where the run computed one device's alongside (the script's
    recorded ``rank_losses``, ``rank_grad_norms`` and ``one_device_grad_norms``; nothing is run again)."""
    extra = (run.metrics or {}).get("extra") or {}
    lines = [f"step {step}: each rank's own loss {[round(loss, 4) for loss in losses]}"
             for step, losses in enumerate(extra.get("rank_losses", []))]
    one_device = extra.get("one_device_grad_norms") or []
    for step, norms in enumerate(extra.get("rank_grad_norms", [])):
        line = f"step {step}: gradient norm logged by each rank {[round(norm, 3) for norm in norms]}"
        if step < len(one_device):
            line += f"; one device's {one_device[step]:.3f}"
        lines.append(line)
    return lines


def failures(run: Shown) -> list[str]:
    """torch's failure summary at the end of a run's output, as any torchrun user reads it (labkit.forkrun prints
    the same: torch's ChildFailedError), one line a failed rank: the root cause first, then the others, each with its
    exit code and the first line of its error (nothing is run again; [] when the output has no summary)."""
    lines = []
    for failure in broken_runs.failure_summary(run.output) or []:
        where = "Root Cause (first observed failure)" if failure["root"] else "Failures"
        lines.append(f"{where}: rank {failure['rank']}, exit code {failure['exitcode']}: "
                     f"{(failure['error'] or '')[:150]}")
    return lines


# ---- the learner's code, run inside the job ------------------------------------------------------------------------
LEARNER_DIR = broken_runs.DEFAULT_RUN_DIR / "learner"
_PRELUDE = ("import math\n\nimport torch\nimport torch.distributed as dist\n"
            "from torch.utils.data import DistributedSampler\n\n\n")


def learner_file(function, name: str) -> str:
    """Write the learner's ``function`` (its source) to a file the script loads with its flag, as ``name``: the
    fix then runs inside the job. The file is named by a hash of its text, so the launch cache (keyed by the
    arguments) never replays another version of the function."""
    return learner_files({name: function})


def learner_files(functions: dict) -> str:
    """:func:`learner_file` for several functions, {name: function}, in one file: one launch runs them all."""
    text = _PRELUDE + "".join(_learner_source(function, name) for name, function in functions.items())
    path = Path(LEARNER_DIR) / f"{'-'.join(functions)}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(text)
    return str(path)


def _learner_source(function, name: str) -> str:
    if function is None or function is ...:
        raise _not_done(name, f"Write {name}().")
    if not callable(function) or getattr(function, "__name__", "<lambda>") == "<lambda>":
        raise ExerciseWrong(f"{name}: define it with def (the job loads its source from a file).")
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        raise ExerciseWrong(f"{name}: its source cannot be read; define it with def in a cell.") from None
    if "raise NotImplementedError" in source:   # the learner's copy's stub
        raise _not_done(name, f"Write {name}().")
    return source + (f"\n\n{name} = {function.__name__}\n" if function.__name__ != name else "") + "\n\n"


# Checks of a clock that a loaded machine can fail, where the run also checks the same thing on a count: the lab
# does not judge a learner's fix by them. pp_schedules' measured bubble against its simulation from this run's pass
# times (its timing model); its measured bubble against --max-bubble, judged instead by the counted bubble of the
# order every rank ran (one failed at load 7). tests/scripts/test_14 runs the timed fixed runs with the machine to
# itself, every check counting.
TIMING_MODEL_CHECKS = ("measured bubble equals the simulated one", "measured bubble within the throughput target")


_LAST_FIX: list = []   # the lab's view of the last fix's run: last_fix_run()


def last_fix_run() -> Shown | None:
    """The last run a fix check launched, as the lab shows runs: its output and metrics, to see why it failed."""
    return _LAST_FIX[-1] if _LAST_FIX else None


def _said(problem: str, blame=()) -> str:
    """One of fix_holds' problems in the lab's words: a check by its shown name, never one the lab hides; with
    ``blame`` ((check beginning, function name), ...), the learner's function that check judges, first."""
    for form in (r"check failed: (.*)", r"check '(.*)\.\.\.' did not run"):
        found = re.fullmatch(form, problem)
        if found:
            name = shown_check_name(found[1])
            what = "failed" if form.startswith("check failed") else "did not run"
            said = f"'{name}' {what}" if name else f"one of the script's own checks of the fault {what}"
            whose = next((function for beginning, function in blame if found[1].startswith(beginning)), None)
            return f"{whose}(): {said}" if whose else said
    if problem.startswith("the journal still finds a hang"):
        return "the job still hangs (every rank's journal ends in a wait)"
    return problem


FIX_FLAG = "--fix-from"   # the flag of every script that runs a learner's function in place of its own code
# The fixes judged on 2 ranks: their scripts' checks hold on any number, and 2 ranks on the lab's 2 cores take a half
# to a third of 4's time (measured), which keeps the lab's fix runs within its minute. The others need 4 ranks:
# deadlocks.py's scenarios, the (2, 2) mesh, the checkpoint's "written by 4 ranks" checks, the HSDP run's 2 x 2,
# and run 22's recipe (a per-rank batch tuned on 2 ranks is right on 2).
FIX_NPROC = {"same-samples-every-rank": 2, "loss-averaged-twice": 2, "bf16-gradient-reduction": 2,
             "optimizer-before-sharding": 2, "loss-on-wrong-stage": 2, "slow-rank": 2, "resume-without-rng": 2,
             "stage-grad-norm": 2, "nan-from-one-rank": 2, "local-grad-norm": 2, "unused-parameter": 2,
             "token-out-of-vocabulary": 2}


def _fix_in_job(name: str, function, function_name: str, why: str, args=None, say: bool = True) -> None:
    """Write the learner's ``function`` to a file, launch case ``name``'s job with it (``args``: the case's fixed
    run unless given; the flag goes to the interrupted job too, for a case that resumes) and pass only when the
    job's own checks do."""
    path = learner_file(function, function_name)
    _fixed_run_holds(name, args=args, extra=(FIX_FLAG, path), why=why, say=say)


def _fixed_run_holds(name: str, args=None, why: str = "", extra=(), say: bool = True, blame=()) -> None:
    """Launch the case's fixed run (or ``args``: the learner's setting, or the flag that loads the learner's code)
    and require that the symptom is gone and it equals one device (:func:`labkit.broken_runs.fix_holds`, less
    :data:`TIMING_MODEL_CHECKS`). A failure says what the run shows, never the cause."""
    case = broken_runs.case(name)
    result = _launch(name, fixed=True, args=args, extra=extra, nproc=FIX_NPROC.get(name))
    _LAST_FIX.append(shown(result))
    problems = [problem for problem in broken_runs.fix_holds(case, result.metrics)
                if not any(timing in problem for timing in TIMING_MODEL_CHECKS)]
    if result.metrics is None:   # it stopped before its checks: a configuration error, or the learner's code raised
        said = [line for line in result.output.splitlines() if "config error" in line or "Error" in line]
        raise ExerciseWrong(f"the job run with this fix stopped (exit code {result.returncode}) before its checks"
                            + (f": {said[-1].strip()[:300]}" if said else "") + ". exercises.last_fix_run() shows "
                            "its output.")
    if problems:
        raise ExerciseWrong(f"the job run with this fix (exit code {result.returncode}) still fails: "
                            f"{'; '.join(_said(p, blame) for p in problems[:3])}. exercises.last_fix_run() shows its "
                            "output and metrics.")
    checks = len((result.metrics or {}).get("checks", []))
    if not say:
        return
    print(f"Correct: {why} The run again: {checks} checks passed, the symptom is gone"
          + (" and the journal finds no hang." if case.hang else ", and it equals one device where it compares."))


# ---- the fixes, family by family: each one run inside the job --------------------------------------------------

@learner_check
def check_fix_sampler(rank_sampler) -> None:
    """``rank_sampler(dataset, rank, world_size)``: the sampler a rank draws its samples from. Run inside the job:
    train_ddp.py loads it from a file (--fix-from) on every rank and trains from the sampler it returns."""
    _fix_in_job("same-samples-every-rank", rank_sampler, "rank_sampler",
                why="each rank reads its own share of one permutation shared by all.")


@learner_check
def check_fix_set_epoch(epoch_indices) -> None:
    """``epoch_indices(sampler, epoch)``: the indices the sampler hands out in ``epoch``. Run inside the job:
    train_ddp.py calls it (--fix-from) at every epoch's start, on every rank, and draws that epoch from them."""
    _fix_in_job("no-set-epoch", epoch_indices, "epoch_indices", why="a new order every epoch, the same on every rank.")


@learner_check
def check_fix_accumulation(synchronises) -> None:
    """``synchronises(micro_step, accumulation)``: whether this micro-batch runs outside no_sync(). Run inside the
    job: train_ddp.py asks it (--fix-from) for every micro-batch, on every rank."""
    _fix_in_job("accumulation-never-syncs", synchronises, "synchronises",
                why="one all-reduce a step, once every micro-batch's gradient is in.")


# train_ddp.py's checks that each function of runs 7, 8 and 9 answers for (their one run names whose check failed)
DATA_PARALLEL_CHECKS = (("the training samplers' first epoch", "rank_sampler"),
                        ("the training sampler's order changed", "epoch_indices"),
                        ("bytes all-reduced per optimizer step", "synchronises"),
                        ("micro-steps inside no_sync()", "synchronises"))


@learner_check
def check_fix_ranks_that_disagree(rank_sampler, synchronises, epoch_indices) -> None:
    """Part 3's three fixes in one run of train_ddp.py: the three functions in one file (--fix-from), each
    called on every rank where the script's own code was (what check_fix_sampler, check_fix_accumulation and
    check_fix_set_epoch do one at a time). A check of the run that fails is said with the function it judges."""
    path = learner_files({"rank_sampler": rank_sampler, "synchronises": synchronises, "epoch_indices": epoch_indices})
    _fixed_run_holds("same-samples-every-rank", extra=(FIX_FLAG, path), blame=DATA_PARALLEL_CHECKS,
                     why="each rank its own share of one permutation, a new order every epoch, one all-reduce a "
                         "step: train_ddp.py with your three functions equals one device.")


@learner_check
def check_fix_loss_scale(gradient_scales) -> None:
    """``gradient_scales(world_size) -> (loss_scale, reduce_scale)``: each rank's mean loss is multiplied by
    ``loss_scale`` before backward, the gradients summed over the ranks by ``reduce_scale``. Run inside the job:
    ddp_from_scratch.py calls it (--fix-from) on every rank and scales by what it returns."""
    _fix_in_job("loss-averaged-twice", gradient_scales, "gradient_scales",
                why="one division by N in all: the sum of per-rank mean gradients, divided once.")


@learner_check
def check_fix_uneven(agreed_batches) -> None:
    """``agreed_batches(batch_counts)``: how many batches every rank trains, given every rank's shard length. Run
    inside the job: deadlocks.py gathers the counts and calls it (--fix-from) on every rank, then each rank trains
    that many batches, stopping early if its shard runs out."""
    case = broken_runs.case("uneven-inputs")
    _fix_in_job(case.name, agreed_batches, "agreed_batches", args=case.args,
                why="every rank makes the same number of gradient all-reduces, none more than its shard holds.")


@learner_check
def check_fix_full_state(full_from_shards) -> None:
    """``full_from_shards(shards)``: a parameter whole again from its FSDP shards, one per rank in rank order. Run
    inside the job: checkpoint_resume.py (--fix-from) gathers every rank's shards, rank 0 saves what your function
    makes of them, and the resumed job gives every rank its rows of that."""
    _fix_in_job("checkpoint-one-shard", full_from_shards, "full_from_shards",
                why="the parameters whole again, so that every rank reloads its own rows.")


REDUCE_DTYPES = ("float32", "bfloat16", "float16")   # train_fsdp.py's --reduce-dtype choices


@learner_check
def check_fix_reduce_dtype(reduce_dtype) -> None:
    """``reduce_dtype``: the dtype FSDP2's MixedPrecisionPolicy sums the gradients in over the ranks. The job is
    run again with it (train_fsdp.py --reduce-dtype)."""
    import torch

    if reduce_dtype is None:
        raise _not_done("reduce_dtype", "Set it to a torch dtype.")
    name = str(reduce_dtype).removeprefix("torch.") if isinstance(reduce_dtype, torch.dtype) else None
    if name not in REDUCE_DTYPES:
        raise ExerciseWrong(f"{reduce_dtype!r}: the script takes one of torch.{', torch.'.join(REDUCE_DTYPES)}.")
    case = broken_runs.case("bf16-gradient-reduction")
    _fixed_run_holds(case.name, args=case.fixed_args + ("--reduce-dtype", name),
                     why=f"gradients summed in {name}: the reduce-scatter moves the formula's bytes and the "
                         "gradients equal one device's.")


# A V-shaped schedule: its last stage is on rank 0, where a looped schedule's is on the last rank.
V_SCHEDULE = ("--schedule", "ZBVZeroBubble")


@learner_check
def check_fix_loss_rank(loss_rank) -> None:
    """``loss_rank(stage_ranks)``: the rank whose losses to read, given where each stage lives (``stage_ranks[s]``:
    the rank of stage s). Run inside the job, twice: pp_train.py (--fix-from) reads the losses where it says, under
    1F1B (stage s on rank s) and under ZBVZeroBubble (two stages a rank, the second half in reverse)."""
    case = broken_runs.case("loss-on-wrong-stage")
    _fix_in_job(case.name, loss_rank, "loss_rank", why="", say=False)
    _fix_in_job(case.name, loss_rank, "loss_rank", args=case.fixed_args + V_SCHEDULE,
                why="the losses read where the last stage computes them, under a looped and a V-shaped schedule.")


@learner_check
def check_fix_collectives(sync) -> None:
    """``sync(rank, tensor, collectives)``: the step's synchronisation, calling ``collectives.all_reduce(tensor)``
    or ``collectives.broadcast(tensor, src)``. Run inside the job: deadlocks.py calls it (--fix-from) on every
    rank, with its own collectives, where the broken run hung."""
    case = broken_runs.case("mismatched-collectives")
    _fix_in_job(case.name, sync, "sync", args=case.args,
                why="the same collectives on every rank, in the same order: the job finishes and the weights agree.")


CHECKPOINT_PARTS = ("model", "optimizer", "rng", "data_position", "step", "loss_history")   # fault_drill's HOLDABLE


@learner_check
def check_fix_resume_state(checkpoint_contents) -> None:
    """``checkpoint_contents``: what a checkpoint must hold for a resume to repeat the uninterrupted run, a set of
    names among "model", "optimizer", "rng", "data_position", "step", "loss_history". The drill is run again, killed
    and restarted, with checkpoints that hold exactly those (fault_drill.py --checkpoint-holds)."""
    if checkpoint_contents is None:
        raise _not_done("checkpoint_contents", 'Set it to a set of names, e.g. {"model", ...}.')
    if isinstance(checkpoint_contents, str) or not all(isinstance(n, str) for n in checkpoint_contents):
        raise ExerciseWrong("give a set of names (strings), e.g. {\"model\", ...}.")
    chosen = set(checkpoint_contents)
    if chosen - set(CHECKPOINT_PARTS):
        raise ExerciseWrong(f"unknown names {sorted(chosen - set(CHECKPOINT_PARTS))}: pick among "
                            f"{sorted(CHECKPOINT_PARTS)}.")
    _fixed_run_holds("resume-without-rng", extra=("--checkpoint-holds", ",".join(sorted(chosen))),
                     why="with what the checkpoint holds, a step trained twice gives the same loss both times.")


@learner_check
def check_fix_straggler(straggler) -> None:
    """``straggler(ranks)``: the rank that holds the others back, from each rank's row of the profile (the run's
    ``extra.ranks``: {"rank", "kinds": {"compute", "communication", "overlapped", "idle"}, "before_sync_seconds",
    ...}). Run inside the job: profile_step.py (--fix-from) calls it on the profiled steps' rows, removes the extra
    work of the rank it names (as draining that rank's node would), and measures more steps."""
    case = broken_runs.case("slow-rank")
    _fix_in_job(case.name, straggler, "straggler", args=case.args,
                why="the rank the others waited for: without its extra work every rank reaches the all-reduce "
                    "together.")


@learner_check
def check_fix_data_shard(data_shard) -> None:
    """``data_shard(mesh) -> (index, count)``: which of ``count`` equal slices of the global batch this rank reads,
    given the model's 2-D DeviceMesh (dims "dp", "tp"). Run inside the job: fsdp_tp_hybrid.py loads it from a file
    (--data-shard-from) on every rank, in place of its own choice of rows."""
    path = learner_file(data_shard, "data_shard")
    _fixed_run_holds("data-by-global-rank", args=broken_runs.HYBRID_RUN + ("--data-shard-from", path),
                     why="the ranks of a TP group read the same rows: the loader's coordinate is the mesh's dp.")


@learner_check
def check_fix_microbatches(microbatches) -> None:
    """``microbatches``: the number of microbatches for the 4-stage GPipe run, which must keep its bubble under the
    run's target (--max-bubble 0.4); it is run again with that setting."""
    if microbatches is None:
        raise _not_done("microbatches", "Set it to a whole number.")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ExerciseWrong(f"microbatches = {microbatches!r}: a whole number of microbatches, at least 1.")
    args = broken_runs.PIPELINE_TIMING + ("--microbatches", str(microbatches))
    formula = (4 - 1) / (microbatches + 4 - 1)   # the run's 4 stages
    _fixed_run_holds("too-few-microbatches", args=args,
                     why=f"{microbatches} microbatches: (P - 1) / (M + P - 1) = {formula:.0%} idle by the formula.")


@learner_check
def check_fix_optimizer_order(shard_and_optimizer) -> None:
    """``shard_and_optimizer(model, shard, adamw)``: call ``shard(model)`` (fully_shard on each block and the root)
    and return ``adamw(parameters)``, in the order you choose. Run inside the job: train_fsdp.py loads it from a
    file (--optimizer-from) on every rank."""
    path = learner_file(shard_and_optimizer, "shard_and_optimizer")
    _fixed_run_holds("optimizer-before-sharding", args=("--steps", "3", "--optimizer-from", path),
                     why="AdamW built on the sharded parameters, the ones backward fills.")


@learner_check
def check_fix_wrappers(apply_wrappers) -> None:
    """``apply_wrappers(tp, fsdp)``: build the model by calling ``tp(dim)`` (the tensor-parallel plan over the
    mesh's dimension ``dim``) and ``fsdp(dim)`` (fully_shard over ``dim``), "dp" or "tp", in the order you choose.
    Run inside the job: fsdp_tp_hybrid.py loads it from a file (--wrappers-from) on every rank."""
    path = learner_file(apply_wrappers, "apply_wrappers")
    _fixed_run_holds("fsdp-before-tp", args=broken_runs.HYBRID_RUN + ("--wrappers-from", path),
                     why="the TP plan first, then fully_shard on the dp mesh (torchtitan's order).")

# ---- the fixes of the later cases: each one run inside the job -------------------------------------------------

@learner_check
def check_fix_full_state_save(save_model) -> None:
    """``save_model(rank, gather_full_state, save)``: the end of an FSDP2 run, called on every rank.
    ``gather_full_state()`` is get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True)), a collective: it returns the whole model on rank 0 and an empty dict elsewhere;
    ``save(state)`` writes the file. Run inside the job: deadlocks.py (--fix-from) calls it on every rank."""
    case = broken_runs.case("full-state-on-rank-0")   # the broken run's arguments: your code replaces its end
    _fix_in_job(case.name, save_model, "save_model", args=case.args,
                why="every rank joins the gather and one rank writes the file, so no rank waits for a peer that "
                    "has left.")


@learner_check
def check_fix_evaluation(evaluation_share) -> None:
    """``evaluation_share(batches, rank, world_size)``: the validation batches ``rank`` evaluates (a list of batch
    numbers in ``range(batches)``). Run inside the job: deadlocks.py (--fix-from) has each rank evaluate the
    batches it returns, each batch costing the same time, then all-reduces the counts and sums."""
    case = broken_runs.case("rank-0-evaluation")   # the broken run's arguments: your code replaces its evaluation
    _fix_in_job(case.name, evaluation_share, "evaluation_share", args=case.args,
                why="each rank evaluates its part, so no rank keeps the others waiting longer than its share.")


@learner_check
def check_fix_model_seed(model_seed) -> None:
    """``model_seed(seed, rank)``: the seed ``rank`` builds the whole model from before fully_shard (``seed``: the
    run's --seed). Run inside the job: train_fsdp.py loads it from a file (--model-seed-from) on every rank of an
    HSDP run (2 replicas x shard groups of 2)."""
    path = learner_file(model_seed, "model_seed")
    _fixed_run_holds("per-rank-init", args=broken_runs.HSDP_RUN + ("--model-seed-from", path),
                     why="every rank builds the same model, so its slices fit together and the replicas agree.")


@learner_check
def check_fix_clip(clip_gradients) -> None:
    """``clip_gradients(model, max_norm)``: clip the FSDP2 model's gradients (DTensors, each rank holding its
    shards) to the total norm ``max_norm`` and return that norm. Run inside the job: train_fsdp.py loads it from a
    file (--clip-from) on every rank and calls it after each backward."""
    path = learner_file(clip_gradients, "clip_gradients")
    _fixed_run_holds("local-grad-norm", args=broken_runs.CLIP_RUN + ("--clip-from", path),
                     why="every rank computes the whole model's norm and scales its shards by the same factor.")


def _first_nonfinite(rank_losses) -> tuple[int, list[int]]:
    for step, losses in enumerate(rank_losses):
        ranks = [rank for rank, loss in enumerate(losses) if not math.isfinite(loss)]
        if ranks:
            return step, ranks
    return -1, []


# train_ddp.py's check of a learner's first_nonfinite(), run on the job's own losses per rank (--fix-from)
FIRST_NONFINITE_CHECK = "first_nonfinite() names the step and the rank where the first non-finite loss began"


@learner_check
def check_fix_first_nonfinite(first_nonfinite) -> None:
    """``first_nonfinite(rank_losses)``: ``(step, rank)`` of the first rank whose own loss went non-finite (nan or
    inf), ``rank_losses[step][rank]`` being each rank's loss before the all-reduce; None when every loss is finite.
    Run inside the job: train_ddp.py (--fix-from) calls it on every rank with the losses each rank printed, and
    checks the answer against where its fault began. Then tried on made-up runs of losses: an inf, none at all."""
    case = broken_runs.case("nan-from-one-rank")   # the run with the fault: your function reads its losses
    path = learner_file(first_nonfinite, "first_nonfinite")
    result = _launch(case.name, args=case.args, extra=(FIX_FLAG, path), nproc=FIX_NPROC.get(case.name))
    _LAST_FIX.append(shown(result))
    judged = [c for c in (result.metrics or {}).get("checks", []) if c["name"].startswith(FIRST_NONFINITE_CHECK)]
    if not judged:
        said = [line for line in result.output.splitlines() if "config error" in line or "Error" in line]
        raise ExerciseWrong(f"the job run with this function stopped (exit code {result.returncode}) before its "
                            "check" + (f": {said[-1].strip()[:300]}" if said else "") + ". exercises.last_fix_run() "
                            "shows its output.")
    if not judged[0]["passed"]:
        raise ExerciseWrong(f"the job run with this function still fails: on the run's own losses it returned "
                            f"{judged[0].get('value')}, not where the first non-finite loss began. Is any rank's loss "
                            "non-finite at an earlier step? exercises.last_fix_run() shows the losses per rank.")
    nan, inf = math.nan, math.inf
    made = {
        "an inf before any nan": [[4.1, 4.2, 4.0, 4.3], [4.0, 4.1, inf, 4.2], [nan, nan, nan, nan]],
        "rank 3 at step 0": [[4.1, 4.2, 4.0, inf], [nan, nan, nan, nan]],
        "every loss finite": [[4.1, 4.2], [4.0, 4.1]],
    }
    for what, rank_losses in made.items():
        got = call_learner("first_nonfinite", first_nonfinite, copy.deepcopy(rank_losses))
        step, ranks = _first_nonfinite(rank_losses)
        if step < 0:
            if got is not None:
                raise ExerciseWrong(f"{what}: {got!r}, but every loss of that made-up run is finite.")
            continue
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and got[0] == step and got[1] in ranks):
            raise ExerciseWrong(f"{what}: {got!r} is not the first non-finite loss of a rank in that made-up run. "
                                "Is inf non-finite too?")
    print("Correct: the first rank whose own loss went non-finite is where to look for the batch; after the "
          "all-reduce every rank is nan. Run inside the job on its own losses, then on made-up runs with an inf and "
          "with none.")


@learner_check
def check_fix_without_gradient(without_gradient) -> None:
    """``without_gradient(grads)``: ``grads`` maps each parameter's name to its gradient after one backward (a tensor,
    or None where backward never reached it); return the names to leave out of what DDP reduces. Run inside the
    job: train_ddp.py (--fix-from) builds the model with its extra head, runs one local backward before DDP wraps
    it, calls your function on every rank, and freezes the parameters it names."""
    _fix_in_job("unused-parameter", without_gradient, "without_gradient",
                why="those are the parameters backward never reaches: left out of DDP's buckets, every bucket "
                    "completes and the run equals one device.")


# ---- the fixes of part 7: each one run inside the job --------------------------------------------------------
# A wrong micro_batch_size() changes the sequences a step trains on; a wrong token_loss() leaves them right and
# changes only the loss and the gradients: the check that judges each function.
MORE_NUMBERS_CHECKS = (("sequences per optimizer step", "micro_batch_size"),)


@learner_check
def check_fix_micro_batch(micro_batch_size) -> None:
    """``micro_batch_size(global_batch, world_size, accumulation)``: the sequences of one micro-batch on one rank.
    Run inside the job: train_ddp.py calls it (--fix-from) on every rank of a 4-rank run and draws that many."""
    _fix_in_job("global-batch-grows", micro_batch_size, "micro_batch_size",
                why="the recipe's global batch, whatever the number of ranks.")


@learner_check
def check_fix_token_loss(token_loss) -> None:
    """``token_loss(per_token, mask, step_tokens, world_size)``: the loss a micro-batch backpropagates. Run inside
    the job: train_ddp.py --uneven-lengths calls it (--fix-from) for every micro-batch, on every rank."""
    _fix_in_job("token-mean-per-micro-batch", token_loss, "token_loss",
                why="one mean over every kept token of the step, whatever the lengths of its micro-batches.")


@learner_check
def check_fix_batch_and_tokens(micro_batch_size, token_loss) -> None:
    """Two fixes in one run of train_ddp.py, 4 ranks, 2 micro-batches a step, each sequence keeping a loss on its
    first targets only (--uneven-lengths). ``micro_batch_size(global_batch, world_size, accumulation)``: the
    sequences of one micro-batch on one rank. ``token_loss(per_token, mask, step_tokens, world_size)``: the loss a
    micro-batch backpropagates, from its per-token losses, its mask of kept targets (both [sequences, targets])
    and ``step_tokens``, the targets kept in the whole step (every micro-batch of every rank). Both run inside the
    job (--fix-from), on every rank."""
    path = learner_files({"micro_batch_size": micro_batch_size, "token_loss": token_loss})
    _fixed_run_holds("token-mean-per-micro-batch", extra=(FIX_FLAG, path), blame=MORE_NUMBERS_CHECKS,
                     why="the recipe's global batch on any number of ranks, and one mean over every kept token of "
                         "the step: train_ddp.py with your two functions equals one device.")


@learner_check
def check_fix_stage_clip(clip_gradients) -> None:
    """``clip_gradients(parameters, max_norm)``: clip this rank's pipeline stages' gradients (plain tensors), in
    place, to the whole model's total norm ``max_norm``, and return that norm. Run inside the job: pp_train.py
    loads it (--fix-from) on every rank and calls it after each step's backward."""
    _fix_in_job("stage-grad-norm", clip_gradients, "clip_gradients",
                why="one norm for the whole model, so every stage scales its gradients by the same factor.")


# train_ddp.py's check of a learner's tokens_in_vocabulary(), against the truth, in the run with the fault (--fix-from)
GUARD_CHECK = ("the sequences kept out of the model's input and the loss are those that hold an id outside the "
               "vocabulary")


def _stopped(result) -> str:
    """Why a job stopped before its checks, as its output says it: a configuration error's line, or the first
    failure of torch's summary (its rank and error), or the last error line."""
    said = [line.strip() for line in result.output.splitlines() if line.startswith("config error")]
    if said:
        return said[-1][:300]
    failures = broken_runs.failure_summary(result.output) or []
    if failures:
        return f"torch's summary names rank {failures[0]['rank']}'s {(failures[0]['error'] or '')[:200]} as the " \
               "first observed failure"
    said = [line.strip() for line in result.output.splitlines() if "Error" in line]
    return said[-1][:300] if said else "no error line"


@learner_check
def check_fix_tokens_in_vocabulary(tokens_in_vocabulary) -> None:
    """``tokens_in_vocabulary(tokens, vocab_size)``: which sequences of a micro-batch the model may take, one bool a
    sequence (``tokens``: a tensor of token ids, sequences x positions; the embedding has rows 0 to vocab_size - 1).
    Run inside the job, the one with the fault: train_ddp.py (--fix-from) calls it on every rank before each
    forward, gives a sequence it rejects no loss (every rank still runs the step: no rank waits for a missing one),
    and trains one device beside the run leaving out the same sequences. The job checks your verdicts against the
    ids: every sequence that would stop the run left out, and no other (each one left out is data lost)."""
    case = broken_runs.case("token-out-of-vocabulary")   # the run with the fault: your function guards it
    path = learner_file(tokens_in_vocabulary, "tokens_in_vocabulary")
    result = _launch(case.name, args=case.args, extra=(FIX_FLAG, path), nproc=FIX_NPROC.get(case.name))
    _LAST_FIX.append(shown(result))
    if result.metrics is None:
        raise ExerciseWrong(f"the job run with this function still stops (exit code {result.returncode}) before its "
                            f"checks: {_stopped(result)}. exercises.last_fix_run() shows its output.")
    problems = broken_runs.fix_holds(case, result.metrics)
    if not any(c["name"].startswith(GUARD_CHECK) for c in result.metrics.get("checks", [])):
        problems.append(f"check '{GUARD_CHECK}...' did not run")
    if problems:
        raise ExerciseWrong(f"the job run with this function (exit code {result.returncode}) still fails: "
                            f"{'; '.join(_said(p) for p in problems[:3])}. exercises.last_fix_run() shows its output "
                            "and metrics.")
    print("Correct: a sequence the embedding has no row for never reaches it, and only those are left out; every "
          "rank still runs each step, so none waits for another. The job ran with the fault and equals one device "
          "leaving out the same sequences. Then find where the id came from: the model's vocabulary and the "
          "tokenizer's.")
