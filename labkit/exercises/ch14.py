"""The checks of chapter 14's exercises: name the cause of a broken run from what it shows, then fix it.

The lab runs the broken runs of :mod:`labkit.broken_runs` under neutral labels (``run 1`` ... ``run 21``: a case's
name is its diagnosis, and this module keeps no map from a label to a case, only a salted hash of each), shows what
a user would see (:func:`run`: the checks and lines that would say the cause hidden or renamed), and asks two
things of each:

* **the diagnosis** (:func:`check_diagnoses`): a key of :data:`CAUSES` for each run. A wrong key is rejected with
  what it would have shown, and which of the run's own evidence to look at again (never the answer);
* **the fix** (``check_fix_*``): a small function or setting. Where the answer can enter the job, the job is
  launched again with it and must pass :func:`labkit.broken_runs.fix_holds`: the symptom gone, every check against
  one device passing. A setting goes in as the script's flag (``check_fix_microbatches``); a function the script
  can call (``check_fix_data_shard``, ``check_fix_wrappers``, ``check_fix_optimizer_order``) is written to a file
  the script loads with its flag (:func:`learner_file`), so it runs inside the job, and a wrong one fails there.
  The other answers (a rule, a list of names) are judged on hand-made cases only: the script's own fixed run would
  not run them, so the job is not launched again for them.

Runs are launched once per kernel (:func:`_launch`); :func:`prefetch` starts the broken runs in the background.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import math
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from labkit import forkserver
from labkit import broken_runs
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
}
LABELS = tuple(_TOKENS)
PARTS = {"stuck or slow": ("run 1", "run 2", "run 3", "run 4"),
         "stops or prints nonsense": ("run 5", "run 6"),
         "ranks that disagree": ("run 7", "run 8", "run 9"),
         "wrong against one device": ("run 10", "run 11", "run 12", "run 13", "run 14", "run 15"),
         "two more jobs that stop": ("run 16", "run 17"),
         "four more runs": ("run 18", "run 19", "run 20", "run 21")}


def _token(name: str) -> str:
    return hashlib.sha256(f"{_SALT}:{name}".encode()).hexdigest()[:16]


def _case(label_or_name: str) -> broken_runs.BrokenRun:
    """The case behind a lab label (found by its hash), or the case of that name."""
    if label_or_name in _TOKENS:
        return next(run for run in broken_runs.BROKEN_RUNS if _token(run.name) == _TOKENS[label_or_name])
    return broken_runs.case(label_or_name)


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
     "error (reset by peer) only where a socket breaks, as on gloo"),
    ("slow-network", "a slow network",
     "every rank slow in its collectives alike, none of them idle while the others wait"),
    ("nondeterministic-kernels", "nondeterministic kernels",
     "differences at fp32 rounding's size (1e-7), the same on any number of ranks, and the right byte counts"),
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
    "checkpoint-one-shard": "a checkpoint saved from one rank's shard and loaded as if it were the whole model",
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
    "learning-rate-too-low": "a learning rate too low",
    "learning-rate-too-high": "a learning rate too high: the run diverges",
    "bf16-overflow": "bf16 overflowing to inf",
    "sum-gradients": "gradients summed over the ranks where they should be averaged",
    "network-failure": "a network failure between nodes",
    "slow-network": "a slow network",
    "nondeterministic-kernels": "nondeterministic kernels (atomics, reduction order)",
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
}


def _evidence(run: broken_runs.BrokenRun) -> str:
    words = [EVIDENCE_WORDS[key] for key in run.evidence if key in EVIDENCE_WORDS]
    return "; ".join(dict.fromkeys(words))


def diagnosis_feedback(label: str, answer: str) -> str | None:
    """None when ``answer`` names run ``label``'s cause, else why not: what the wrong answer would have shown, and
    which of the run's own evidence to look at again (never the right answer, nor the check that singles it out)."""
    if answer in CAUSES and _token(answer) == _TOKENS[label]:
        return None
    if answer not in CAUSES:
        return f"{label}: {answer!r} is not a key of exercises.CAUSES (print it for the menu)."
    run = _case(label)
    look = f"Look again at {_evidence(run)}: what does {label} show there?"
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
    for label in labels:
        run = _case(label)
        print(f"  {label} is {run.name}: {run.cause}")


# ---- running the cases -----------------------------------------------------------------------------------------

_RUNS: dict = {}   # (script, prepare args, args) -> LaunchResult: each distinct command launched once per kernel
# Cases whose fixed run is judged by a time (the bubble against its target, the ranks' arrival spread): make test runs
# the lab while other tests load the machine, so the lab's run of such a fix is kept out of the launch cache, where
# tests/scripts/test_14 (its TIMED, run later with the machine to itself) would replay it.
TIMED = ("too-few-microbatches", "slow-rank")
CACHE_ENV = "DISTLAB_LAUNCH_CACHE"


def _launch(label_or_name: str, fixed: bool = False, args=None):
    """The run of a case (by its lab label or its name), broken or ``fixed`` or with ``args`` instead of the
    case's, launched once per kernel through :func:`labkit.broken_runs.run_case`: the full result, as the script
    wrote it (the lab shows :func:`run`'s view of it)."""
    case = _case(label_or_name)
    prepare = case.fixed_prepare_args if fixed else case.prepare_args
    chosen = tuple(args) if args is not None else (case.fixed_args if fixed else case.args)
    key = (case.script, prepare, chosen)
    if key in _PENDING:   # started by prefetch(): wait for it
        _RUNS[key] = _PENDING.pop(key).result()
    if key not in _RUNS:
        # About thirty launches: each forked from one process that imported torch once (what make test does),
        # not a new interpreter importing it again (2.4 s a launch).
        os.environ.setdefault(forkserver.ENABLE_ENV, "1")
        uncached = case.name in TIMED and (fixed or args is not None)
        cache = os.environ.pop(CACHE_ENV, None) if uncached else None
        try:
            _RUNS[key] = broken_runs.run_case(case.name, fixed=fixed, args_override=args, stream=False)
        finally:
            if cache is not None:
                os.environ[CACHE_ENV] = cache
    return _RUNS[key]


_PENDING: dict = {}   # key -> Future: the broken runs prefetch() started


def _prefetch_order(label: str):
    """The longest runs first (those that resume are two launches; then the runs that also train one device), so
    that the last to finish is a short one."""
    case = _case(label)
    return (not case.prepare_args, not case.script.endswith(("fsdp_tp_hybrid.py", "profile_step.py")),
            LABELS.index(label))
PREFETCH_WORKERS = 3


def prefetch(labels=None, workers: int = PREFETCH_WORKERS) -> None:
    """Start the lab's broken runs (``labels``, default all) in the background, ``workers`` at a time, so that
    :func:`run` finds each done or under way. Much of a broken run is waiting (a hang's timeout, a slow rank's
    sleep, the ranks' start), which another run can use. Broken runs only: a fix is judged by its own run, alone."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ch14-prefetch")
    for label in sorted(labels or LABELS, key=_prefetch_order):
        case = _case(label)
        key = (case.script, case.prepare_args, case.args)
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
}
HIDDEN_LINES = re.compile(r"planting:|diagnosis:|planted|--planted-bug|--hang")
HIDDEN_EXTRA = ("cause", "verdict")
HIDDEN_CONFIG = ("planted_bug", "hang", "resume_without_rng", "stop_at_fewest_batches", "optimizer_from",
                 "data_shard_from", "wrappers_from",   # the flags that load a learner's fix name what it fixes
                 "gather_on_every_rank", "evaluate_on_every_rank", "eval_seconds", "model_seed_from",
                 "clip_from")


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


# ---- the learner's code, run inside the job ------------------------------------------------------------------------
LEARNER_DIR = broken_runs.DEFAULT_RUN_DIR / "learner"
_PRELUDE = ("import math\n\nimport torch\nimport torch.distributed as dist\n"
            "from torch.utils.data import DistributedSampler\n\n\n")


def learner_file(function, name: str) -> str:
    """Write the learner's ``function`` (its source) to a file the script loads with its flag, as ``name``: the
    fix then runs inside the job. The file is named by a hash of its text, so the launch cache (keyed by the
    arguments) never replays another version of the function."""
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
    text = _PRELUDE + source + (f"\n\n{name} = {function.__name__}\n" if function.__name__ != name else "")
    path = Path(LEARNER_DIR) / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(text)
    return str(path)


# A script's check of its own timing model, neither the symptom nor the comparison with one device, that a loaded
# machine can fail (pp_schedules' measured bubble against its simulation from this run's pass times): the lab does
# not judge a learner's fix by it. tests/scripts/test_14 runs the timed fixed runs with the machine to itself.
TIMING_MODEL_CHECKS = ("measured bubble equals the simulated one",)


_LAST_FIX: list = []   # the lab's view of the last fix's run: last_fix_run()


def last_fix_run() -> Shown | None:
    """The last run a fix check launched, as the lab shows runs: its output and metrics, to see why it failed."""
    return _LAST_FIX[-1] if _LAST_FIX else None


def _said(problem: str) -> str:
    """One of fix_holds' problems in the lab's words: a check by its shown name, never one the lab hides."""
    for form in (r"check failed: (.*)", r"check '(.*)\.\.\.' did not run"):
        found = re.fullmatch(form, problem)
        if found:
            name = shown_check_name(found[1])
            what = "failed" if form.startswith("check failed") else "did not run"
            return f"'{name}' {what}" if name else f"one of the script's own checks of the fault {what}"
    if problem.startswith("the journal still finds a hang"):
        return "the job still hangs (every rank's journal ends in a wait)"
    return problem


def _fixed_run_holds(name: str, args=None, why: str = "") -> None:
    """Launch the case's fixed run (or ``args``: the learner's setting, or the flag that loads the learner's code)
    and require that the symptom is gone and it equals one device (:func:`labkit.broken_runs.fix_holds`, less
    :data:`TIMING_MODEL_CHECKS`). A failure says what the run shows, never the cause."""
    case = broken_runs.case(name)
    result = _launch(name, fixed=True, args=args)
    _LAST_FIX.append(shown(result))
    problems = [problem for problem in broken_runs.fix_holds(case, result.metrics)
                if not any(timing in problem for timing in TIMING_MODEL_CHECKS)]
    if problems:
        raise ExerciseWrong(f"the job run with this fix (exit code {result.returncode}) still fails: "
                            f"{'; '.join(_said(p) for p in problems[:3])}. exercises.last_fix_run() shows its "
                            "output and metrics.")
    checks = len((result.metrics or {}).get("checks", []))
    print(f"Correct: {why} The run again: {checks} checks passed, the symptom is gone"
          + (" and the journal finds no hang." if case.hang else ", and it equals one device where it compares."))


def _judged_by_hand(name: str, why: str = "") -> None:
    """A fix whose answer cannot enter the job as it stands (a rule, a list of names): judged on the hand-made
    cases alone. The job is not launched again: the script's own fixed run would not run the learner's code, so it
    could not fail a wrong answer (tests/scripts/test_14 proves that run; the lab leaves it to the reader)."""
    print(f"Correct: {why} Checked on hand-made cases; your code does not run in the job here. The script's own "
          f"fix: labkit.broken_runs.run_case({name!r}, fixed=True).")


def _reference_shards(size: int, world: int, epoch: int = 0, seed: int = 0) -> list[list[int]]:
    from torch.utils.data import DistributedSampler

    shards = []
    for rank in range(world):
        sampler = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


# ---- the fixes, family by family ------------------------------------------------------------------------------

@learner_check
def check_fix_sampler(rank_sampler) -> None:
    """``rank_sampler(dataset, rank, world_size)``: the sampler a rank draws its samples from."""
    for size, world in ((32, 4), (24, 2), (40, 8)):
        dataset = list(range(size))
        shards = []
        for rank in range(world):
            sampler = call_learner("rank_sampler", rank_sampler, dataset, rank, world)
            if sampler is None:
                raise _not_done("rank_sampler", "Return a sampler.")
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(0)
            shards.append(list(sampler))
        together = [i for shard in shards for i in shard]
        if all(shard == shards[0] for shard in shards):
            raise ExerciseWrong(f"on {world} ranks every rank's sampler gives the same {len(shards[0])} samples: "
                                "that is the bug (every rank built as rank 0). Pass each rank its own index.")
        if len(together) > size or len(set(together)) < len(together):
            raise ExerciseWrong(f"on {world} ranks the samplers give {len(together)} indices for {size} samples, "
                                f"{len(together) - len(set(together))} of them twice: each rank must get its own "
                                "share (num_replicas=world_size), and every rank must shuffle with the same seed so "
                                "the shares are cut from one permutation.")
        if set(together) != set(range(size)):
            raise ExerciseWrong(f"on {world} ranks {size - len(set(together))} samples are read by no rank.")
    _judged_by_hand("same-samples-every-rank", why="each rank reads its own quarter of one shared permutation.")


@learner_check
def check_fix_set_epoch(epoch_indices) -> None:
    """``epoch_indices(sampler, epoch)``: the indices the sampler hands out in ``epoch``."""
    from torch.utils.data import DistributedSampler

    for world in (4, 2):
        for rank in range(world):
            sampler = DistributedSampler(range(32), num_replicas=world, rank=rank, shuffle=True, seed=0)
            got = [list(call_learner("epoch_indices", epoch_indices, sampler, epoch) or []) for epoch in range(3)]
            want = [_reference_shards(32, world, epoch)[rank] for epoch in range(3)]
            if got[1] == got[0]:
                raise ExerciseWrong("epoch 1 repeats epoch 0's order: DistributedSampler shuffles with "
                                    "seed + epoch, and the epoch changes only when you call sampler.set_epoch().")
            if got != want:
                raise ExerciseWrong(f"rank {rank} of {world}: the order differs from DistributedSampler's own for "
                                    "epochs 0-2. Every rank must draw the same permutation (seed + epoch) so the "
                                    "shares stay disjoint: set the sampler's epoch, do not shuffle yourself.")
    _judged_by_hand("no-set-epoch", why="a new order every epoch, the same on every rank.")


@learner_check
def check_fix_accumulation(synchronises) -> None:
    """``synchronises(micro_step, accumulation)``: whether this micro-batch runs outside no_sync()."""
    for accumulation in (1, 2, 4):
        got = [bool(call_learner("synchronises", synchronises, i, accumulation)) for i in range(accumulation)]
        want = [i == accumulation - 1 for i in range(accumulation)]
        if got == want:
            continue
        if not any(got):
            raise ExerciseWrong(f"with {accumulation} micro-batches none synchronises: DDP never all-reduces, and "
                                "each replica trains on its own data (the bug).")
        if all(got):
            raise ExerciseWrong(f"with {accumulation} micro-batches every one all-reduces: the gradients are "
                                f"right, but the step moves {accumulation}x the bytes. no_sync() exists to skip "
                                "all but the last.")
        raise ExerciseWrong(f"with {accumulation} micro-batches you synchronise {got}: the all-reduce sums the "
                            "gradients accumulated so far, so the micro-batches after it stay local and the "
                            "replicas drift. Only the last one, when every micro-batch is in.")
    _judged_by_hand("accumulation-never-syncs", why="one all-reduce a step, on the last micro-batch.")


@learner_check
def check_fix_loss_scale(gradient_scales) -> None:
    """``gradient_scales(world_size) -> (loss_scale, reduce_scale)``: each rank's mean loss is multiplied by
    ``loss_scale`` before backward, the gradients summed over the ranks by ``reduce_scale``."""
    for world in (1, 2, 4, 8):
        got = call_learner("gradient_scales", gradient_scales, world)
        if got is None:
            raise _not_done("gradient_scales", "Return (loss_scale, reduce_scale).")
        try:
            product = float(got[0]) * float(got[1])
        except (TypeError, ValueError, IndexError):
            raise ExerciseWrong(f"gradient_scales({world}) returned {got!r}: return a pair of numbers, "
                                "(loss_scale, reduce_scale).") from None
        if math.isclose(product, 1 / world):
            continue
        if math.isclose(product, 1 / world ** 2):
            raise ExerciseWrong(f"on {world} ranks the gradients come out 1/{world} of one device's: divided by N "
                                "twice, once in the loss and once in the average (the bug).")
        if math.isclose(product, 1.0):
            raise ExerciseWrong(f"on {world} ranks the gradients come out {world}x one device's: the sum over the "
                                "ranks of per-rank means needs one division by N.")
        raise ExerciseWrong(f"on {world} ranks the gradients are scaled by {product:g} in all; one device's mean "
                            f"over the global batch needs 1/{world}.")
    _judged_by_hand("loss-averaged-twice", why="one division by N: a mean of per-rank means.")


@learner_check
def check_fix_uneven(agreed_batches) -> None:
    """``agreed_batches(batch_counts)``: how many batches every rank trains, given each rank's shard length."""
    for counts in ([3, 3, 3, 2], [5, 4, 5, 5], [2, 2], [7, 6, 7, 5, 7, 7, 7, 7]):
        got = call_learner("agreed_batches", agreed_batches, list(counts))
        if got == min(counts):
            continue
        if got == max(counts):
            raise ExerciseWrong(f"{counts}: {got} batches is more than the shortest shard holds: that rank runs "
                                "out (an IndexError) and its peers wait in the all-reduce until the timeout.")
        raise ExerciseWrong(f"{counts}: {got} batches; every rank must make the same number of gradient "
                            "all-reduces, and none can make more than its shard holds.")
    _judged_by_hand("uneven-inputs", why="the ranks agree on the shortest shard (an all-reduce MIN of the counts "
                                          "first), so every rank makes the same collectives.")


@learner_check
def check_fix_full_state(full_from_shards) -> None:
    """``full_from_shards(shards)``: a parameter whole again from its FSDP shards, one per rank in rank order."""
    import torch

    for shape, world in (((8, 3), 4), ((6,), 2), ((4, 2, 2), 4)):
        full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        shards = [s.clone() for s in torch.chunk(full, world, dim=0)]   # FSDP2 shards dim 0 (fully_shard)
        got = call_learner("full_from_shards", full_from_shards, shards)
        if not isinstance(got, torch.Tensor):
            raise ExerciseWrong(f"return a tensor, not {type(got).__name__}.")
        if got.shape == shards[0].shape and torch.equal(got, shards[0]):
            raise ExerciseWrong("that is rank 0's shard alone (the bug): under FSDP each rank holds a slice of "
                                "every parameter along dim 0.")
        if got.shape != full.shape:
            raise ExerciseWrong(f"shape {tuple(got.shape)} from shards of {tuple(shards[0].shape)} on {world} "
                                f"ranks; the parameter is {tuple(full.shape)}: FSDP2 shards along dim 0.")
        if not torch.equal(got, full):
            raise ExerciseWrong("the right shape, the wrong values: the shards go back in rank order, along dim 0.")
    _judged_by_hand("checkpoint-one-shard", why="every rank's shard in the checkpoint (torch.distributed.checkpoint "
                                                 "writes each rank's own), the model whole again on resume.")


@learner_check
def check_fix_reduce_dtype(reduce_dtype) -> None:
    """``reduce_dtype``: the dtype FSDP2's MixedPrecisionPolicy sums the gradients in over the ranks."""
    import torch

    if reduce_dtype is None:
        raise _not_done("reduce_dtype", "Set it to a torch dtype.")
    if reduce_dtype == torch.bfloat16:
        raise ExerciseWrong("that is what run 11 already did: look at its reduce-scatter's bytes against the formula, "
                            "and at how far its gradients are from one device's.")
    if reduce_dtype == torch.float16:
        raise ExerciseWrong("fp16 still rounds every partial sum (to 11 significant bits) and overflows above 65504.")
    if reduce_dtype != torch.float32:
        raise ExerciseWrong(f"{reduce_dtype}: the run computes in fp32; reduce in the same precision.")
    _judged_by_hand("bf16-gradient-reduction", why="gradients summed in fp32: the reduce-scatter moves the "
                                                    "formula's bytes and the gradients equal one device's.")


@learner_check
def check_fix_data_shard(data_shard) -> None:
    """``data_shard(mesh) -> (index, count)``: which of ``count`` equal slices of the global batch this rank reads,
    given the model's 2-D DeviceMesh (dims "dp", "tp"). Run inside the job: fsdp_tp_hybrid.py loads it from a file
    (--data-shard-from) on every rank, in place of its own choice of rows."""
    path = learner_file(data_shard, "data_shard")
    _fixed_run_holds("data-by-global-rank", args=broken_runs.HYBRID_RUN + ("--data-shard-from", path),
                     why="the ranks of a TP group read the same rows: the loader's coordinate is the mesh's dp.")


@learner_check
def check_fix_loss_rank(loss_rank) -> None:
    """``loss_rank(stage_ranks)``: the rank whose losses to read, given where each stage lives (``stage_ranks[s]``:
    the rank of stage s), for a looped schedule (stage s on rank s % world_size) or a V-shaped one (two stages a
    rank, the second half in reverse: the last stage back on rank 0)."""
    def looped(stages, world):
        return [s % world for s in range(stages)]

    def v_shaped(world):
        return list(range(world)) + list(reversed(range(world)))

    for stage_ranks in (looped(4, 4), looped(2, 2), looped(8, 4), v_shaped(4), v_shaped(2), looped(6, 3)):
        world = max(stage_ranks) + 1
        got = call_learner("loss_rank", loss_rank, list(stage_ranks))
        want = stage_ranks[-1]
        if got == want:
            continue
        if got == stage_ranks[0]:
            raise ExerciseWrong(f"stages on ranks {stage_ranks}: rank {got} holds the first stage, whose outputs are "
                                "activations; rank 0 printed nan in the run. Which stage's outputs are a loss?")
        raise ExerciseWrong(f"stages on ranks {stage_ranks} ({world} ranks): rank {got}, which holds no stage "
                            "whose outputs are the loss.")
    _judged_by_hand("loss-on-wrong-stage", why="the loss read where the last stage computed it.")


@learner_check
def check_fix_microbatches(microbatches) -> None:
    """``microbatches``: the number of microbatches for the 4-stage GPipe run, which must keep its bubble under the
    run's target (--max-bubble 0.4); it is run again with that setting."""
    if microbatches is None:
        raise _not_done("microbatches", "Set it to a whole number.")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ExerciseWrong(f"microbatches = {microbatches!r}: a whole number of microbatches, at least 1.")
    stages = 4
    formula = (stages - 1) / (microbatches + stages - 1)
    if formula > 0.4:
        raise ExerciseWrong(f"{microbatches} microbatches on {stages} stages: (P - 1) / (M + P - 1) = "
                            f"{formula:.0%} of the step idle before any latency, above the 40% target. As many "
                            "microbatches as stages is not enough; M >= 2P is the rule of thumb.")
    if 16 % microbatches:   # pp_schedules refuses the split (a config error, no metrics): say why before a launch
        raise ExerciseWrong(f"{microbatches} microbatches: the run's batch of 16 sequences does not split into "
                            f"{microbatches} equal microbatches (each microbatch the same shape on every stage).")
    args = broken_runs.PIPELINE_TIMING + ("--microbatches", str(microbatches))
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


class _Recorder:
    """What a learner's ``sync`` may call: each rank's collectives, recorded in order."""

    def __init__(self):
        self.calls = []

    def all_reduce(self, tensor):
        self.calls.append("all_reduce")

    def broadcast(self, tensor, src=0):
        self.calls.append(f"broadcast from {src}")


@learner_check
def check_fix_collectives(sync) -> None:
    """``sync(rank, tensor, collectives)``: the step's synchronisation, calling ``collectives.all_reduce(tensor)``
    or ``collectives.broadcast(tensor, src)``; every rank must make the same calls in the same order."""
    import torch

    calls = {}
    for rank in range(4):
        recorder = _Recorder()
        call_learner("sync", sync, rank, torch.zeros(2), recorder)
        calls[rank] = recorder.calls
    if not any(calls.values()):
        raise ExerciseWrong("no collective at all: the ranks' values are never combined.")
    if len({tuple(c) for c in calls.values()}) > 1:
        raise ExerciseWrong(f"the ranks call {calls}: the collectives at one position must be the same on every "
                            "rank, or each waits for a partner that is in another call (the hang).")
    _judged_by_hand("mismatched-collectives", why="the same collectives on every rank, in the same order.")


@learner_check
def check_fix_resume_state(checkpoint_contents) -> None:
    """``checkpoint_contents``: what a checkpoint must hold for a resume to repeat the uninterrupted run, a set of
    names among "model", "optimizer", "rng", "data_position", "step", "loss_history"."""
    if checkpoint_contents is None:
        raise _not_done("checkpoint_contents", 'Set it to a set of names, e.g. {"model", ...}.')
    known = {"model", "optimizer", "rng", "data_position", "step", "loss_history"}
    chosen = set(checkpoint_contents)
    if chosen - known:
        raise ExerciseWrong(f"unknown names {sorted(chosen - known)}: pick among {sorted(known)}.")
    if chosen == known or "loss_history" in chosen:
        raise ExerciseWrong("what must the next step read from the checkpoint to compute exactly what the "
                            "uninterrupted run did? The losses already printed are not among its inputs: leave "
                            "out what a resume does not need.")
    for name, why in (("model", "the weights"), ("optimizer", "AdamW's moments: without them the first steps "
                      "after a resume move differently"), ("step", "where to start again"),
                      ("data_position", "without it the resumed run reads the epoch from its start: other "
                      "samples"), ("rng", "without it the resumed run draws other random numbers (the shuffle, "
                      "masks) than the uninterrupted one")):
        if name not in chosen:
            raise ExerciseWrong(f"{name!r} is missing: {why}.")
    _judged_by_hand("resume-without-rng", why="model, optimizer, step, data position and every generator: "
                                               "a step trained twice gives the same loss both times.")


@learner_check
def check_fix_straggler(straggler, ranks: list[dict]) -> None:
    """``straggler(ranks)``: the rank that holds the others back, from each rank's time per kind (the profile's
    ``extra.ranks`` rows: {"rank", "kinds": {"compute", "communication", "overlapped", "idle"}})."""
    def rows(idle, communication):
        return [{"rank": r, "kinds": {"compute": 1.0, "communication": c, "overlapped": 0.0, "idle": i}}
                for r, (i, c) in enumerate(zip(idle, communication))]

    cases = [(rows([0.0, 0.0, 0.9, 0.0], [1.0, 1.0, 0.1, 1.0]), 2),
             (rows([0.5, 0.0, 0.0, 0.0], [0.1, 0.6, 0.6, 0.6]), 0),
             # the lab's run: the rank measured to reach backward's all-reduces last (profile_step's own straggler
             # measure), not a formula over the kinds that an answer could share
             (ranks, max(ranks, key=lambda r: r["before_sync_seconds"])["rank"])]
    for index, (case_rows, want) in enumerate(cases):
        got = call_learner("straggler", straggler, case_rows)
        if got == want:
            continue
        which = "the lab's run" if index == len(cases) - 1 else f"hand-made profile #{index + 1}"
        waited = max(case_rows, key=lambda r: r["kinds"]["communication"])["rank"]
        if got == waited:
            raise ExerciseWrong(f"{which}: rank {got} spent the most time in communication, waiting: a victim. "
                                "The straggler arrives last, so it waits least; its extra time is its own "
                                "(idle here: a sleep, a slow disk).")
        raise ExerciseWrong(f"{which}: rank {got}, expected rank {want}.")
    _judged_by_hand("slow-rank", why="without what slowed that rank, no straggler: every rank reaches the "
                                      "all-reduce together, and the run equals one device.")


# ---- the fixes of the later cases ------------------------------------------------------------------------------

@learner_check
def check_fix_full_state_save(save_model) -> None:
    """``save_model(rank, gather_full_state, save)``: the end of an FSDP2 run, called on every rank.
    ``gather_full_state()`` stands for get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
    cpu_offload=True)): it returns the whole model on rank 0 and an empty dict elsewhere; ``save(state)`` writes a
    file. Each rank's calls are recorded as the job's journal would record them."""
    world = 4
    gathered, saved = {}, {}
    for rank in range(world):
        def gather_full_state(rank=rank):
            gathered[rank] = gathered.get(rank, 0) + 1
            return {"weight": "whole"} if rank == 0 else {}

        def save(state, rank=rank):
            saved.setdefault(rank, []).append(state)

        call_learner("save_model", save_model, rank, gather_full_state, save)
    never = [rank for rank in range(world) if not gathered.get(rank)]
    if never:
        raise ExerciseWrong(f"ranks {never} never took part in gather_full_state(), which is a collective on "
                            f"{world} ranks: the ranks that called it would wait there until the timeout.")
    if any(count != 1 for count in gathered.values()):
        raise ExerciseWrong(f"calls of gather_full_state() per rank: {gathered}: every rank must make the same "
                            "collectives, the same number of times, or some wait for a call that never comes.")
    if sorted(saved) != [0] or saved[0] != [{"weight": "whole"}]:
        raise ExerciseWrong(f"files written per rank: { {r: len(s) for r, s in saved.items()} }, holding "
                            f"{[s for states in saved.values() for s in states]}: one file, the whole model, "
                            "written once.")
    _judged_by_hand("full-state-on-rank-0", why="every rank joins the gather and one rank writes the file, so no "
                                                 "rank waits for a peer that has left.")


@learner_check
def check_fix_evaluation(evaluation_share) -> None:
    """``evaluation_share(batches, rank, world_size)``: the validation batches ``rank`` evaluates (a list of the
    batch numbers in ``range(batches)``); the ranks then all-reduce their sums. The evaluation's time on a rank is
    its number of batches."""
    for batches, world in ((12, 4), (10, 4), (3, 4), (16, 8)):
        shares = [call_learner("evaluation_share", evaluation_share, batches, rank, world) for rank in range(world)]
        shares = [sorted(share) for share in shares]
        every = sorted(b for share in shares for b in share)
        if every != list(range(batches)):
            raise ExerciseWrong(f"{batches} batches on {world} ranks: the shares hold {len(every)} batches, "
                                f"{len(set(every))} of them different: the all-reduced sums would count a batch "
                                "twice or miss one.")
        longest = max(len(share) for share in shares)
        if longest > -(-batches // world):
            raise ExerciseWrong(f"{batches} batches on {world} ranks: one rank evaluates {longest} while another "
                                f"evaluates {min(len(share) for share in shares)}: the others wait for it in the "
                                "next all-reduce, and a large validation set makes that wait outlast the timeout.")
    _judged_by_hand("rank-0-evaluation", why="each rank evaluates its part, so no rank keeps the others waiting "
                                              "longer than its share.")


@learner_check
def check_fix_model_seed(model_seed) -> None:
    """``model_seed(seed, rank)``: the seed ``rank`` builds the whole model from before fully_shard (``seed``: the
    run's --seed). Run inside the job: train_fsdp.py loads it from a file (--model-seed-from) on every rank of an
    HSDP run (2 replicas x shard groups of 2)."""
    seeds = {rank: call_learner("model_seed", model_seed, 0, rank) for rank in range(4)}
    if len(set(seeds.values())) > 1:   # caught by hand first: a launch would show the same
        raise ExerciseWrong(f"the seeds per rank are {seeds}: each rank keeps its own slice of the model it built, "
                            "and nothing sends another rank's, so the replicas would start apart.")
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


@learner_check
def check_fix_first_nonfinite(first_nonfinite) -> None:
    """``first_nonfinite(rank_losses)``: ``(step, rank)`` of the first rank whose own loss went non-finite (nan or
    inf), ``rank_losses[step][rank]`` being each rank's loss before the all-reduce; None when every loss is finite.
    Judged on hand-made runs."""
    nan, inf = math.nan, math.inf
    made = {
        "one rank, then all": [[4.1, 4.2, 4.0, 4.3], [3.9, nan, 3.8, 4.0], [nan, nan, nan, nan]],
        "rank 3 at step 0": [[4.1, 4.2, 4.0, inf], [nan, nan, nan, nan]],
        "an inf before any nan": [[4.1, 4.2, 4.0, 4.3], [4.0, 4.1, inf, 4.2], [nan, nan, nan, nan]],
        "a lone nan that did not spread": [[4.1, nan, 4.0, 4.3], [4.0, 4.1, 4.1, 4.2], [nan, nan, nan, nan]],
        "every loss finite": [[4.1, 4.2], [4.0, 4.1]],
    }
    for what, rank_losses in made.items():
        got = call_learner("first_nonfinite", first_nonfinite, copy.deepcopy(rank_losses))
        step, ranks = _first_nonfinite(rank_losses)
        if step < 0:
            if got is not None:
                raise ExerciseWrong(f"{what}: {got!r}, but every loss of that run is finite.")
            continue
        if not (isinstance(got, tuple) and len(got) == 2 and got[0] == step and got[1] in ranks):
            seen = rank_losses[got[0]] if isinstance(got, tuple) and len(got) == 2 and \
                isinstance(got[0], int) and 0 <= got[0] < len(rank_losses) else None
            raise ExerciseWrong(f"{what}: {got!r} is not the first non-finite loss of a rank"
                                + (f" (that step's losses: {seen}); is any rank non-finite at an earlier step? "
                                   "Is inf non-finite too?" if seen is not None else "."))
    _judged_by_hand("nan-from-one-rank", why="the first rank whose own loss went non-finite is where to look for "
                                              "the batch; after the all-reduce every rank is nan.")


@learner_check
def check_fix_without_gradient(without_gradient) -> None:
    """``without_gradient(grads)``: ``grads`` maps each parameter's name to its gradient after one backward (a tensor,
    or None where backward never reached it); return the names DDP's reducer would wait for forever, sorted.
    Judged on hand-made models."""
    import torch

    made = {
        "an extra head": {"embed.weight": torch.ones(2), "head.weight": torch.ones(2), "aux_head.weight": None},
        "two unused, one a bias": {"a.weight": None, "a.bias": None, "b.weight": torch.zeros(2)},
        "a gradient of zeros is still a gradient": {"a.weight": torch.zeros(3), "b.weight": torch.ones(1)},
    }
    for what, grads in made.items():
        want = sorted(name for name, grad in grads.items() if grad is None)
        got = call_learner("without_gradient", without_gradient, dict(grads))
        if not isinstance(got, (list, tuple)) or sorted(got) != want or list(got) != sorted(got):
            raise ExerciseWrong(f"{what}: {got!r} is not the sorted names of the parameters backward never "
                                "reached (is a gradient of zeros a gradient?).")
    _judged_by_hand("unused-parameter", why="those are the parameters to use in the loss, or to leave out of what "
                                             "DDP wraps.")
