"""Chapter 14's broken runs: a plausible mistake planted in one of the course's scripts, what a user sees, the fix.

Each :class:`BrokenRun` names a script of an earlier chapter and the arguments that plant the mistake (``args``:
``--planted-bug NAME`` where the mistake is in the code; a setting where it is a setting, such as too few
microbatches; ``--hang NAME`` for chapter 12's hangs), the arguments of the fixed run (``fixed_args``: the bug
gone, or the corrective setting), what a user sees (``symptom``, never the cause) and where in the run's metrics
(``evidence``), the cause, the one check that tells it from its look-alikes, and the checks of the script that
fail with the bug and pass with the fix (``failing_checks``; for a hang, the journal's diagnosis ``hang_cause``; for
an error one rank raises, ``first_failure``: that rank and its error, which torch's failure summary must name as the
root cause), and what the same mistake shows on GPUs under NCCL (``on_nccl``). :data:`SEEN_BY` says which evidence any user's
tools show and which only the course's instrumentation does.

    from labkit import broken_runs
    result = broken_runs.run_case("accumulation-never-syncs")            # the broken run (fork launcher on CPU)
    broken_runs.symptom_seen(broken_runs.case("accumulation-never-syncs"), result.metrics)   # -> [] (nothing missing)
    fixed = broken_runs.run_case("accumulation-never-syncs", fixed=True)  # every check passes, = one device

Every run takes seconds on 4 CPU ranks; a hang ends by a 2 s process-group timeout, with each rank's journal of
calls and a diagnosis (chapter 12's ``distlab.hangs``). A case that resumes (``prepare_args``) first runs the
interrupted job, then the resume, in one folder: ``{run_dir}`` in the arguments.

Left out: dropout with the same random stream on every tensor-parallel rank where it must differ (or the reverse).
Not a limit of torch 2.13: the course's models have no dropout (``distlab.models``: the transformer every chapter
checks against one device is deterministic), so no script has a random stream to get wrong; adding dropout to the
shared model would change every chapter's single-device reference.

From a job (``pbs/14_when_it_goes_wrong.pbs``): ``python -m labkit.broken_runs check NAME METRICS.json [--fixed]
[--output LOG]`` says whether a run's metrics (and, for an error one rank raises, its output) show the case's symptom
(or, with ``--fixed``, that it is gone), exit 0 or 1.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from labkit import launch

FAMILIES = ("data", "data parallelism", "FSDP", "tensor parallelism", "pipelines", "composition", "operations")
HANG_TIMEOUT = ("--pg-timeout", "2")   # seconds a hang waits before the process group gives up
DEFAULT_RUN_DIR = launch.REPO_ROOT / "build" / "broken_runs"   # {run_dir}'s parent unless the caller gives one

TRAIN_DDP = "scripts/04_data_parallel/train_ddp.py"
DDP_FROM_SCRATCH = "scripts/04_data_parallel/ddp_from_scratch.py"
TRAIN_FSDP = "scripts/05_fully_sharded/train_fsdp.py"
CHECKPOINT_RESUME = "scripts/05_fully_sharded/checkpoint_resume.py"
PP_TRAIN = "scripts/07_pipeline_parallel/pp_train.py"
PP_SCHEDULES = "scripts/07_pipeline_parallel/pp_schedules.py"
FSDP_TP_HYBRID = "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py"
DEADLOCKS = "scripts/12_hpc_operations/deadlocks.py"
FAULT_DRILL = "scripts/12_hpc_operations/fault_drill.py"
PROFILE_STEP = "scripts/12_hpc_operations/profile_step.py"

# Runs shared by several cases: the same fixed run proves each of their fixes (one launch in the tests).
DDP_RUN = ("--steps", "5", "--accumulation", "2", "--compare")   # 2 epochs, 2 micro-batches, against one device
UNEVEN_RUN = DDP_RUN + ("--uneven-lengths",)   # each sequence keeps a loss on its first 1 to S of its S targets
HYBRID_RUN = ("--dp", "2", "--tp", "2", "--steps", "2")
HSDP_RUN = ("--steps", "3", "--replicate", "2")   # 2 replicas x shard groups of 2
CLIP_RUN = ("--steps", "3", "--max-grad-norm", "0.5")   # one device's gradient norm is above 0.5: every step clips
CHECKPOINTS = ("--save-dir", "{run_dir}", "--steps", "5", "--save-every", "2")   # stopped after 3: step 2 is lost
PIPELINE_CLIP_RUN = ("--max-grad-norm", "0.5")   # 4 stages, 1F1B; one device's norm is above 0.5: every step clips
PIPELINE_TIMING = ("--schedule", "GPipe", "--stage-compute-ms", "10", "--steps", "3", "--max-bubble", "0.4")


# Who can see each kind of evidence a case names (``BrokenRun.evidence``): "user", any user's own tools (the losses
# each rank prints, the logs, the time a step takes, torch.profiler's trace, torch's flight recorder); "course",
# only this course's instrumentation (a one-device reference trained beside the run, a comm hook's byte counts,
# the journals of calls chapter 12's distlab.hangs keeps, the scripts' checks against one device).
SEEN_BY = {
    "extra.rank_losses": "user", "losses": "user", "extra.losses_by_step": "user", "extra.earlier_losses": "user",
    "extra": "user", "throughput": "user", "timeline": "user", "extra.timeline": "user", "extra.ranks": "user",
    "extra.bubble": "user", "extra.flight_recorder": "user", "output": "user",
    "extra.diffs.baseline_loss": "course", "extra.grad_diffs": "course", "extra.loss_diffs": "course",
    "extra.param_diffs": "course", "extra.uninterrupted_losses": "course", "extra.micro_step_bytes": "course",
    "comm": "course", "checks": "course", "extra.journals": "course", "extra.cause": "course",
    "extra.verdict": "course", "extra.rank_grad_norms": "user", "extra.one_device_grad_norms": "course",
    "extra.replica_weight_gaps": "user",   # each replica's shards summed and compared: any HSDP user can
}

@dataclass(frozen=True)
class BrokenRun:
    name: str                   # kebab-case; the --planted-bug (or --hang) value where the mistake is in the code
    family: str                 # one of FAMILIES
    script: str                 # path from the repository's root
    args: tuple[str, ...]       # the broken run, on ``nproc`` CPU ranks
    fixed_args: tuple[str, ...]  # the same script, the mistake gone or the corrective setting given
    symptom: str                # what a user sees, never the cause
    evidence: tuple[str, ...]   # where in the metrics JSON: keys ("extra.rank_losses") or "checks"; "output":
    #                             the lines the run printed (an error's message)
    cause: str
    tell_apart: str             # the one check that tells it from its look-alikes
    look_alikes: tuple[str, ...]  # other cases' names, or a plausible wrong cause in a few words
    fix: str                    # the fix, in a sentence
    fix_kind: str               # "setting": a flag in fixed_args (--microbatches 8, --stop-at-fewest-batches) or one
    #                             value in the code (a reduce dtype, a mesh's names, the wrappers' order); "function":
    #                             code the learner writes
    failing_checks: tuple[str, ...] = ()  # beginnings of check names that fail with the bug, pass with the fix
    hang_cause: str | None = None       # a hang: the diagnosis its journal must give (the fixed run's: "none")
    fixed_checks: tuple[str, ...] = ()  # beginnings of checks a fixed run must also run and pass (what a hang's fix
    #                                     must achieve besides ending: a fix that drops the work ends too)
    prepare_args: tuple[str, ...] = ()  # a run before ``args`` in the same {run_dir}: the interrupted job
    fixed_prepare_args: tuple[str, ...] = ()
    wrong_fixes: tuple[tuple[tuple[str, ...], str], ...] = ()  # (args, why it is wrong): still broken
    first_failure: tuple = ()   # an error one rank raises: (that rank, its error's words on a CPU, on a GPU); the
    #                             run stops, and torch's failure summary names that rank's error as the root cause
    nproc: int = 4
    gpu_note: str | None = None   # why the GPU job leaves it out (None: it runs there)
    on_nccl: str = ""   # what the same mistake shows on GPUs under NCCL, beside the CPU run (one table cell)

    @property
    def hang(self) -> bool:
        return self.hang_cause is not None

    def command(self, fixed: bool = False, run_dir: str = "RUN_DIR") -> list[str]:
        """The command a person types for the broken (or fixed) run."""
        return launch.torchrun_command(self.script, self.nproc, fill(self.fixed_args if fixed else self.args, run_dir))


def fill(args, run_dir) -> list[str]:
    return [str(a).replace("{run_dir}", str(run_dir)) for a in args]


BROKEN_RUNS: tuple[BrokenRun, ...] = (
    # ---- data ------------------------------------------------------------------------------------------------
    BrokenRun(
        name="same-samples-every-rank", family="data", script=TRAIN_DDP,
        on_nccl="The same: NCCL sums the same gradients gloo does, so every rank prints the same loss; nothing in "
                "NCCL's logs.",
        args=DDP_RUN + ("--planted-bug", "same-samples-every-rank"), fixed_args=DDP_RUN,
        symptom="Every rank prints the same loss at every step, and the global loss departs from one device's "
                "trained on the same global batch.",
        evidence=("extra.rank_losses", "extra.diffs.baseline_loss", "checks"),
        cause="Each rank's DistributedSampler was built with rank 0's index: all ranks read the same quarter of the "
              "data (a loader with no sampler, shuffled with one seed on every rank, also gives all ranks the same "
              "samples).",
        tell_apart="The losses per rank: equal to the last digit at every step (same weights, same samples); with "
                   "each rank on its own samples they differ.",
        look_alikes=("no-set-epoch", "loss-averaged-twice", "a learning rate too low"),
        fix="Give each rank its own share: DistributedSampler(dataset, num_replicas=world_size, rank=rank).",
        fix_kind="function",
        wrong_fixes=((DDP_RUN + ("--planted-bug", "same-samples-every-rank", "--no-shuffle"),
                      "the order is not the problem: without shuffling every rank still reads rank 0's share"),),
        failing_checks=("the training samplers' first epoch: disjoint shards covering the dataset",
                        "DDP loss = single-device loss")),
    BrokenRun(
        name="no-set-epoch", family="data", script=TRAIN_DDP,
        on_nccl="The same: the order is the sampler's, whatever the backend; nothing in NCCL's logs.",
        args=DDP_RUN + ("--planted-bug", "no-set-epoch"), fixed_args=DDP_RUN,
        symptom="The loss equals one device's for the whole first epoch, then departs from it at the first step "
                "of the second (step 4 of 5).",
        evidence=("extra.diffs.baseline_loss", "losses", "checks"),
        cause="The loop never calls sampler.set_epoch(epoch): DistributedSampler shuffles with seed + epoch, so "
              "every epoch repeats the first one's order.",
        tell_apart="When the difference from one device starts: exactly at the epoch's turn, not at step 0.",
        look_alikes=("same-samples-every-rank", "resume-without-rng"),
        fix="Call sampler.set_epoch(epoch) before each epoch's first batch.",
        fix_kind="function",
        failing_checks=("the training sampler's order changed with the epoch", "DDP loss = single-device loss")),
    BrokenRun(
        name="token-out-of-vocabulary", family="data", script=TRAIN_DDP,
        on_nccl="The lookup trips a device-side assert, reported at a later CUDA call ('CUDA error: device-side "
                "assert triggered'); CUDA_LAUNCH_BLOCKING=1 reports it at the lookup. Rank 3's own NCCL watchdog may "
                "abort it (SIGABRT) before @record writes. The others wait until stopped.",
        args=DDP_RUN + ("--planted-bug", "token-out-of-vocabulary"), fixed_args=DDP_RUN,
        symptom="Step 0 trains; at step 1 the job stops. Rank 3's ends in IndexError: 'index out of range in self'; "
                "the others' in gloo's lost peer ('Connection closed by peer') or some, stopped at once by "
                "torchrun, in nothing.",
        evidence=("output",),
        cause="A sequence rank 3 reads at step 1 holds token id 128, one past the embedding's last row (the tiny "
              "model's 128 ids), a tokenizer's added token. Rank 3 raises alone; the others fail or are "
              "stopped when it exits.",
        tell_apart="The first failure, torchrun's 'Root Cause (first observed failure)' (with @record): one rank's "
                   "own exception, before the others' errors, which name the peer that left; a network failure "
                   "starts with no rank's exception.",
        look_alikes=("a network failure", "unused-parameter", "uneven-inputs"),
        fix="Find the record (the summary names the rank, the last step printed the step), then size the model's "
            "vocabulary for every id the tokenizer makes (len(tokenizer), not its base vocabulary). Guard the data on "
            "the CPU, before the forward: a sequence with an id outside 0 to V - 1 is kept out of the model's input "
            "(its ids replaced, its targets masked), not only out of the loss, every rank still running the step.",
        fix_kind="function",
        first_failure=(3, "IndexError: index out of range in self", "CUDA error: device-side assert triggered")),
    # ---- data parallelism ----------------------------------------------------------------------------------------
    BrokenRun(
        name="accumulation-never-syncs", family="data parallelism", script=TRAIN_DDP,
        on_nccl="The same numbers; a GPU profile of the step shows no NCCL all-reduce kernel at all, and the step is "
                "quicker than it should be.",
        args=DDP_RUN + ("--planted-bug", "accumulation-never-syncs"), fixed_args=DDP_RUN,
        symptom="The loss leaves one device's after the first update and the gap grows at every step; the ranks' "
                "weights no longer agree after training; the comm hook saw 0 bytes all-reduced per step.",
        evidence=("extra.rank_losses", "extra.micro_step_bytes", "comm", "checks"),
        cause="Every micro-batch, the last one too, ran under no_sync(): DDP never all-reduced a gradient, so each "
              "replica trained on its own data alone.",
        tell_apart="The bytes all-reduced per optimizer step: 0, where they should equal the parameter bytes.",
        look_alikes=("same-samples-every-rank", "bf16-gradient-reduction"),
        fix="Run the last micro-batch of each step outside no_sync() (the others inside).",
        fix_kind="function",
        failing_checks=("bytes all-reduced per optimizer step = parameter bytes", "replicas identical after training",
                        "DDP gradients = single-device gradients")),
    BrokenRun(
        name="loss-averaged-twice", family="data parallelism", script=DDP_FROM_SCRATCH,
        on_nccl="The same: the division happens in the program, whatever the backend; nothing in NCCL's logs.",
        args=("--steps", "3", "--planted-bug", "loss-averaged-twice"), fixed_args=("--steps", "3"),
        symptom="The losses stay within 1e-4 of one device's (AdamW hides a gradient's scale), but the averaged "
                "gradients are not one device's: a quarter of them on 4 ranks.",
        evidence=("extra.grad_diffs", "extra.loss_diffs", "checks"),
        cause="Each rank divides its loss by the world size before backward, and average_gradients divides the "
              "summed gradients by it again: gradients 1/N of the right ones.",
        tell_apart="The gradient check against one device (the loss check passes): the ratio is exactly 1/N.",
        look_alikes=("sum-gradients (N times too large, train_fsdp.py)", "a learning rate too low"),
        fix="Divide once: each rank's mean loss, then the sum of the gradients over the ranks divided by N.",
        fix_kind="function",
        failing_checks=("averaged gradients = single-device gradients",)),
    BrokenRun(
        name="nan-from-one-rank", family="data parallelism", script=TRAIN_DDP,
        on_nccl="The same: NCCL sums a nan like any number and hands it to every rank; nothing in NCCL's logs.",
        args=DDP_RUN + ("--planted-bug", "nan-from-one-rank"), fixed_args=DDP_RUN,
        symptom="The printed loss is nan from step 2 on, after falling like one device's; from step 3 every rank's "
                "own loss is nan too, and the replicas' weights are nan.",
        evidence=("extra.rank_losses", "losses", "checks"),
        cause="On rank 2, one micro-batch had every target masked, and its loss was a sum over the kept tokens "
              "divided by their count: 0/0. Its gradient is nan too, and DDP's all-reduce averages it into every "
              "rank's gradient.",
        tell_apart="The ranks' own losses at the first nan step: one rank alone is nan and the others are finite; "
                   "a step later all are (a learning rate too high grows every rank's loss first).",
        look_alikes=("a diverging run (a learning rate too high)", "bf16 overflow", "loss-on-wrong-stage"),
        fix="Find the first rank whose own loss went non-finite, then its batch: divide by max(count, 1), so the "
            "batch adds a zero loss and still runs its backward; skip a step only by a decision every rank shares "
            "(an all-reduced flag), or the ranks that run it wait. Check the local loss before backward: after the "
            "all-reduce every rank looks alike.",
        fix_kind="function",
        failing_checks=("every rank's loss is finite", "DDP loss = single-device loss")),
    BrokenRun(
        name="unused-parameter", family="data parallelism", script=TRAIN_DDP,
        on_nccl="The same RuntimeError, from DDP's reducer; nothing in NCCL's logs.",
        args=DDP_RUN + ("--planted-bug", "unused-parameter"), fixed_args=DDP_RUN,
        symptom="Step 0 trains, but its line says 0 bytes all-reduced; at step 1 every rank stops with "
                "RuntimeError: 'Expected to have finished reduction in the prior iteration before starting a new "
                "one' (torch's words).",
        evidence=("output", "checks", "extra.micro_step_bytes"),
        cause="A parameter the forward never uses (an extra head) was wrapped by DDP without "
              "find_unused_parameters: its gradient never comes, so its bucket is never all-reduced, and the next "
              "forward refuses to start (torch/csrc/distributed/c10d/reducer.cpp, ensure_prior_reduction_finished).",
        tell_apart="The error's next sentence and its 'Parameter indices which did not receive grad' line name "
                   "what never got a gradient; a data or sampler mistake trains on without an error.",
        look_alikes=("mismatched-collectives", "accumulation-never-syncs", "a network failure"),
        fix="Use every parameter in the loss or leave it out of the model DDP wraps; find_unused_parameters=True "
            "also works, at the cost of a walk of the autograd graph every step.",
        fix_kind="function",
        failing_checks=("every step's forward ran",)),
    BrokenRun(
        name="token-mean-per-micro-batch", family="data parallelism", script=TRAIN_DDP,
        on_nccl="The same numbers; nothing in NCCL's logs, and the fix's count of tokens is one more all-reduce of "
                "a single number a step.",
        args=UNEVEN_RUN + ("--planted-bug", "token-mean-per-micro-batch"), fixed_args=UNEVEN_RUN,
        symptom="No error, the replicas agree and each all-reduce moves the parameter bytes, but the loss is off "
                "one device's from the first step (0.09 at worst), the gradients too; with every target kept the "
                "run equals one device.",
        evidence=("extra.diffs.baseline_loss", "checks"),   # a user's per-rank losses look as a right run's do
        cause="Each micro-batch's loss was the mean over its own kept tokens, over the micro-batches, then DDP "
              "averaged the ranks: a mean of means, where a short micro-batch's token weighs more. One device takes "
              "one mean over the step's kept tokens.",
        tell_apart="The lengths: with every target kept the same run equals one device, and the gap follows the "
                   "spread of the micro-batches' token counts (the replicas agree, the bytes are right).",
        look_alikes=("loss-averaged-twice", "same-samples-every-rank", "nondeterministic kernels"),
        fix="Sum each micro-batch's token losses and divide by the kept tokens of the whole step, every micro-batch "
            "of every rank (one all-reduce of the count), times the world size that DDP's average divides by.",
        fix_kind="function",
        failing_checks=("DDP loss = single-device loss", "DDP gradients = single-device gradients")),
    BrokenRun(
        name="global-batch-grows", family="data parallelism", script=TRAIN_DDP,
        on_nccl="The same numbers; nothing in NCCL's logs. Each GPU's memory stays what it was on fewer GPUs (its "
                "own batch did not change), and its step time nearly so: the loss curve and the steps an epoch differ.",
        args=DDP_RUN + ("--planted-bug", "global-batch-grows"), fixed_args=DDP_RUN,
        symptom="No error; the first line says global batch 16 where the recipe's is 8, and the loss falls below "
                "one device's, most at step 2 (0.13 below), where a second epoch starts: 32 samples, 2 steps an "
                "epoch, not 4.",
        evidence=("output", "losses", "extra.diffs.baseline_loss", "checks"),
        cause="The per-rank batch of a recipe tuned on 2 ranks was kept on 4: the global batch doubled with the "
              "world, so an epoch takes half the steps and one step of the learning rate does something else.",
        tell_apart="Sequences per optimizer step, ranks x micro-batches x sequences each: twice the recipe's, and "
                   "half the steps an epoch, while each step's gradients are right for that larger batch (the "
                   "from-scratch version agrees).",
        look_alikes=("same-samples-every-rank", "a diverging run (a learning rate too high)", "no-set-epoch"),
        fix="Keep the global batch when the world changes: each rank's micro-batch = global batch / (world size x "
            "accumulation steps); where the global batch is meant to grow, retune the learning rate and the "
            "schedule's steps for it.",
        fix_kind="function",
        failing_checks=("sequences per optimizer step = the global batch asked for", "DDP loss = single-device loss",
                        "DDP gradients = single-device gradients")),
    BrokenRun(
        name="uneven-inputs", family="data parallelism", script=DEADLOCKS,
        on_nccl="The three ranks wait in the all-reduce for NCCL's default timeout, 10 minutes; then each logs "
                "\"Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., OpType=ALLREDUCE, ...)\" and is "
                "taken down (SIGABRT).",
        args=("--hang", "uneven-inputs", *HANG_TIMEOUT, "--trace-dir", "{run_dir}"),
        fixed_args=("--hang", "uneven-inputs", "--stop-at-fewest-batches", *HANG_TIMEOUT, "--trace-dir", "{run_dir}"),
        symptom="The job stops progressing at the end of an epoch: three ranks wait in a gradient all-reduce until "
                "the process group's timeout (2 s) while the last rank has already finished.",
        evidence=("extra.journals", "extra.cause", "extra.verdict", "extra.flight_recorder"),
        cause="The ranks' shards of the data are unequal: the last rank has one batch fewer, leaves the loop, and "
              "its peers wait for its all-reduce.",
        tell_apart="The journal: one rank 'finished' with one all-reduce fewer than the others, which are stuck in "
                   "the same call (a straggler's peers would finish the call, late).",
        look_alikes=("mismatched-collectives", "slow-rank", "a network failure"),
        fix="Agree on the shortest shard first (all-reduce MIN of the batch counts) and all train that many "
            "(DistributedSampler's equal shards, or DDP's join() context, whose finished ranks shadow the others' "
            "all-reduces, also end the hang); a longer timeout only waits longer.",
        fix_kind="setting", hang_cause="skipped collective",
        fixed_checks=("the agreed number of batches is one every rank can train",
                      "every batch that all ranks hold was trained, on every rank")),
    # ---- FSDP --------------------------------------------------------------------------------------------------
    BrokenRun(
        name="checkpoint-one-shard", family="FSDP", script=CHECKPOINT_RESUME,
        on_nccl="The same jump. Gathering the full state dict under `if rank == 0:` hangs instead: the other ranks "
                "never join its all-gathers, and the watchdog ends rank 0 at the timeout.",
        prepare_args=CHECKPOINTS + ("--stop-after", "3", "--planted-bug", "checkpoint-one-shard"),
        args=CHECKPOINTS + ("--resume", "--planted-bug", "checkpoint-one-shard"),
        fixed_prepare_args=CHECKPOINTS + ("--stop-after", "3"), fixed_args=CHECKPOINTS + ("--resume",),
        symptom="Training resumes without an error, but the loss jumps up at the first step after the resume "
                "(0.39 above the interrupted run's loss at that step) and stays above one device's to the end of "
                "the run, the gap shrinking.",
        evidence=("extra.losses_by_step", "extra.earlier_losses", "extra.uninterrupted_losses", "checks"),
        cause="Rank 0 saved its model with torch.save (DDP's habit): under FSDP that is its shard of each "
              "weight. The resume copied that file into every rank's own shards; the shapes match, so every rank's "
              "shard became rank 0's.",
        tell_apart="The reloaded state against the full copy saved beside the checkpoint: unequal at once, before "
                   "any training step.",
        look_alikes=("resume-without-rng", "a learning-rate schedule restarted"),
        fix="Save and load with torch.distributed.checkpoint (every rank writes and reads its own shards), or "
            "gather the full state dict on every rank and save it from rank 0 (get_model_state_dict with "
            "full_state_dict=True is a collective: called under `if rank == 0:` it hangs); load that file back "
            "with set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, "
            "broadcast_from_rank0=True)), which gives each rank its own shards.",
        fix_kind="function",
        failing_checks=("model written by 4 ranks, read by 4: every value equal",
                        "losses = uninterrupted single-device run",
                        "steps trained again after the resume repeat the interrupted run's losses")),
    BrokenRun(
        name="bf16-gradient-reduction", family="FSDP", script=TRAIN_FSDP,
        on_nccl="FSDP2 asks NCCL to average in bf16 (ReduceOp.AVG), rounding inside NCCL's own reduction, whose order"
                " is not gloo's: the error's size differs from these CPU numbers. Measure it there.",
        args=("--steps", "3", "--planted-bug", "bf16-gradient-reduction"), fixed_args=("--steps", "3"),
        symptom="Gradients differ from one device's by 1.8e-4 to 2.7e-4 on 2 to 8 ranks, where fp32 rounding leaves "
                "1.5e-8; the reduce-scatter moves half the bytes the formula says.",
        evidence=("extra.param_diffs", "comm", "checks"),
        cause="The gradients are summed over the ranks in bf16, every partial sum rounded to 8 significant bits: "
              "here MixedPrecisionPolicy(reduce_dtype=torch.bfloat16); the usual way in is the default, "
              "param_dtype=torch.bfloat16 with reduce_dtype left None, which reduces in the compute dtype "
              "(torch/distributed/fsdp/_fully_shard/_fsdp_api.py:33-40).",
        tell_apart="The reduce-scatter bytes per step: half the fp32 formula's (a wrong data split would leave them "
                   "right, a skipped synchronisation would move none).",
        look_alikes=("accumulation-never-syncs", "nondeterministic kernels"),
        fix="Reduce in fp32: set reduce_dtype=torch.float32 whenever param_dtype is bf16, never leave it None "
            "(this run computes in fp32; train_fsdp's --mixed-precision computes in bf16 and reduces in fp32).",
        fix_kind="setting",
        failing_checks=("step-0 gradients (gathered from the shards) = single-device gradients",
                        "parameters = single-device parameters", "reduce_scatter bytes per step = formula")),
    BrokenRun(
        name="optimizer-before-sharding", family="FSDP", script=TRAIN_FSDP,
        on_nccl="The same: no error, a flat loss. Memory does not shrink by the number of ranks: the optimizer "
                "keeps the unsharded parameters alive, and allocates no state.",
        args=("--steps", "3", "--planted-bug", "optimizer-before-sharding"), fixed_args=("--steps", "3"),
        symptom="No error, and the step-0 gradients equal one device's, but the loss does not fall while one "
                "device's does, and AdamW holds no state: 0 bytes of moments on every rank.",
        evidence=("losses", "extra.loss_diffs", "checks"),
        cause="AdamW was built on model.parameters() before fully_shard, which replaces every parameter with a "
              "new sharded one (torch/distributed/fsdp/_fully_shard/_fsdp_param.py:325-331): the optimizer holds "
              "the old tensors, which no gradient reaches, so no weight ever moves.",
        tell_apart="AdamW's state after a step: 0 bytes, while the gradients equal one device's (a learning rate "
                   "too low would still fill the moments and move every weight a little).",
        look_alikes=("a learning rate too low", "bf16-gradient-reduction"),
        fix="Build the optimizer after fully_shard, on the sharded model's parameters: fully_shard(model), then "
            "AdamW(model.parameters()).",
        fix_kind="function",
        failing_checks=("optimizer bytes on this rank = ZeRO-3 table", "loss = single-device loss")),
    BrokenRun(
        name="full-state-on-rank-0", family="FSDP", script=DEADLOCKS,
        on_nccl="Rank 0's watchdog logs \"Watchdog caught collective operation timeout: WorkNCCL(SeqNum=..., "
                "OpType=_ALLGATHER_BASE, ...)\" after 10 minutes.",
        args=("--hang", "full-state-on-rank-0", *HANG_TIMEOUT, "--trace-dir", "{run_dir}"),
        fixed_args=("--hang", "full-state-on-rank-0", "--gather-on-every-rank", *HANG_TIMEOUT,
                    "--trace-dir", "{run_dir}"),
        symptom="Training ends, but the job does not: three ranks have finished, and rank 0 waits in an all-gather "
                "while saving the model until the process group's timeout (2 s).",
        evidence=("extra.journals", "extra.flight_recorder"),
        cause="get_model_state_dict(full_state_dict=True) ran under `if rank == 0:`: it all-gathers every sharded "
              "weight (torch/distributed/_state_dict_utils.py:275-279), a collective the other ranks never call.",
        tell_apart="The journal: rank 0 alone waits, in an all-gather after the last step, and every other rank "
                   "has finished (uneven-inputs is the reverse: one rank finished, the rest wait in an all-reduce).",
        look_alikes=("uneven-inputs", "mismatched-collectives", "a network failure"),
        fix="Gather on every rank and save from rank 0: get_model_state_dict(model, options=StateDictOptions("
            "full_state_dict=True, cpu_offload=True)) keeps the result on rank 0 alone; or save shards with "
            "torch.distributed.checkpoint.",
        fix_kind="function", hang_cause="skipped collective",
        fixed_checks=("one file written, by rank 0", "rank 0 saved every weight whole")),
    BrokenRun(
        name="per-rank-init", family="FSDP", script=TRAIN_FSDP,
        on_nccl="The same: no error, the replicas apart; nothing in NCCL's logs.",
        args=HSDP_RUN + ("--planted-bug", "per-rank-init"), fixed_args=HSDP_RUN,
        symptom="No error and the loss falls, but it is off one device's before any update, further every step; the "
                "replicas' weights, each shard summed, differ by the same amount (6.2) before step 0 and after each "
                "step.",
        evidence=("extra.replica_weight_gaps", "extra.loss_diffs", "checks"),
        cause="Each rank built the model from its own seed before fully_shard, which keeps each rank's slice and "
              "broadcasts nothing (torch/distributed/fsdp/_fully_shard/_fsdp_param.py:298-299; DDP broadcasts, "
              "torch/nn/parallel/distributed.py:1065-1073): the replicas start apart and never meet.",
        tell_apart="The replicas' weights before the first step: apart already, and apart by the same amount after "
                   "every step (a data or gradient mistake starts them equal; only the weights' start differs).",
        look_alikes=("data-by-global-rank", "checkpoint-one-shard", "nondeterministic kernels"),
        fix="Build the model from the same seed on every rank before fully_shard (or build it on the meta device "
            "and initialise the shards after sharding, where DTensor keeps the random streams consistent); seed "
            "the data, not the weights, by rank.",
        fix_kind="function",
        failing_checks=("initial full weights (gathered from the shards) = the single-device model's",
                        "the replicas hold the same weights", "loss = single-device loss")),
    BrokenRun(
        name="local-grad-norm", family="FSDP", script=TRAIN_FSDP,
        on_nccl="The same norms, one per rank; nothing in NCCL's logs.",
        args=CLIP_RUN + ("--planted-bug", "local-grad-norm"), fixed_args=CLIP_RUN,
        symptom="No error, and the step-0 gradients equal one device's, but the weights leave one device's at the "
                "first update; each rank logs another gradient norm (0.53 to 0.58 at step 0), none near one "
                "device's (1.11).",
        evidence=("extra.rank_grad_norms", "extra.one_device_grad_norms", "extra.param_diffs", "checks"),
        cause="The gradients were clipped by the norm of each rank's own shards (p.grad.to_local()), never reduced "
              "over the ranks: each rank scales its shards by its own factor. On the DTensor gradients "
              "clip_grad_norm_ all-reduces the norm (torch/distributed/tensor/_ops/_math_ops.py:66-79).",
        tell_apart="The weights after the first clipped step against one device's: off with the bug, equal with a "
                   "right clip. The ranks' norms cannot tell: a right clip that logs each rank's unreduced piece "
                   "shows the same norms.",
        look_alikes=("loss-averaged-twice", "bf16-gradient-reduction", "a norm logged before it is reduced"),
        fix="Clip with torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) on the sharded (DTensor) "
            "parameters, which reduces the norm over the ranks; by hand, all-reduce the sum of squares first (and "
            "over the pipeline stages too). Log the reduced norm the clip used, not a rank's piece.",
        fix_kind="function",
        failing_checks=("every rank computed the same gradient norm", "parameters = single-device parameters")),
    # ---- tensor parallelism ------------------------------------------------------------------------------------
    BrokenRun(
        name="data-by-global-rank", family="tensor parallelism", script=FSDP_TP_HYBRID,
        on_nccl="The same numbers; nothing in NCCL's logs, since every collective still has all its partners.",
        args=HYBRID_RUN + ("--planted-bug", "data-by-global-rank"), fixed_args=HYBRID_RUN,
        symptom="No error and no hang: the losses are off one device's from the first step, yet the groups read "
                "back from the model's mesh are right and every collective moves the bytes its formula says.",
        evidence=("losses", "comm", "checks"),
        cause="Each rank picked its rows of the data by its global rank (DistributedSampler's "
              "defaults), not by its dp coordinate on the model's mesh: a TP group's two ranks read different "
              "rows, and TP's all-reduces sum activations of different samples.",
        tell_apart="The rows each rank reads, against the model's mesh: the ranks of one TP group must read the "
                   "same rows, and here they differ while the mesh's groups are right (a mesh built wrong fails "
                   "the group check instead).",
        look_alikes=("same-samples-every-rank", "fsdp-before-tp", "a mesh with its dimension names swapped"),
        fix="Take the loader's data-parallel coordinate from the model's mesh: DistributedSampler(dataset, "
            "num_replicas=mesh['dp'].size(), rank=mesh.get_local_rank('dp')).",
        fix_kind="function",
        failing_checks=("step-0 gradients equal single-device", "losses equal single-device")),
    # ---- pipelines -----------------------------------------------------------------------------------------------
    BrokenRun(
        name="loss-on-wrong-stage", family="pipelines", script=PP_TRAIN,
        on_nccl="The same nan on rank 0; nothing in NCCL's logs, since every send still has its receive.",
        args=("--planted-bug", "loss-on-wrong-stage"), fixed_args=(),
        symptom="The loss printed at every step is nan, yet the weights after training equal one device's.",
        evidence=("losses", "checks"),
        cause="The loss is read on rank 0, which holds the first stage: the schedule computes the loss on the "
              "last stage only, so rank 0's list of losses is empty and its mean is nan.",
        tell_apart="The last stage's own losses: finite and equal to one device's, while rank 0 reads nan from "
                   "the first step (a diverging run's loss would be wrong on the last stage too).",
        look_alikes=("a diverging run (a learning rate too high)", "bf16 overflow"),
        fix="Read the losses on the rank that holds the last stage (or send them from there).",
        fix_kind="function",
        failing_checks=("losses equal the single-device run's", "the loss fell")),
    BrokenRun(
        name="stage-grad-norm", family="pipelines", script=PP_TRAIN,
        on_nccl="The same norms, one per stage; nothing in NCCL's logs, since no collective was left out of a "
                "pairing: the reduction was never written.",
        args=PIPELINE_CLIP_RUN + ("--planted-bug", "stage-grad-norm"), fixed_args=PIPELINE_CLIP_RUN,
        symptom="No error, and the first step's gradients equal one device's, but the weights leave one device's at "
                "the first update; each rank logs another gradient norm (0.37 to 0.77 at step 0), none near one "
                "device's (1.20).",
        evidence=("extra.rank_grad_norms", "extra.one_device_grad_norms", "checks"),
        cause="Each rank called torch.nn.utils.clip_grad_norm_ on its own stages' parameters: plain tensors, so "
              "the norm is those stages' alone (torch/nn/utils/clip_grad.py:95-107, no process group), and each "
              "rank scales its gradients by its own factor.",
        tell_apart="The ranks' gradient norms: they differ, and their squares add up to one device's norm squared "
                   "(pieces of one norm, one per stage); with FSDP2 too, DTensors reduce over their own mesh, never "
                   "the stages.",
        look_alikes=("local-grad-norm", "loss-on-wrong-stage", "nondeterministic kernels"),
        fix="All-reduce the stages' sums of squares over the pipeline group, take the root, and scale every "
            "stage's gradients by max_norm / norm (when above 1): one norm, one factor everywhere.",
        fix_kind="function",
        failing_checks=("every rank computed the same gradient norm", "parameters after training equal the "
                        "single-device run's")),
    BrokenRun(
        name="too-few-microbatches", family="pipelines", script=PP_SCHEDULES,
        on_nccl="The same idle share, as gaps between each GPU's kernels in a profile.",
        args=PIPELINE_TIMING + ("--microbatches", "2"), fixed_args=PIPELINE_TIMING + ("--microbatches", "8"),
        symptom="Correct but slow: the timeline shows each rank idle 60% of the step (the fill and the drain, "
                "where in the step depending on the rank).",
        evidence=("extra.bubble", "throughput", "timeline"),
        cause="2 microbatches for 4 stages under GPipe, the schedule this run chooses (torch 2.13's Schedule1F1B "
              "refuses fewer microbatches than stages): the fill and drain, (P - 1) / (M + P - 1) of the step, "
              "dominate.",
        tell_apart="The measured bubble equals the formula (P - 1) / (M + P - 1): the idle time is the schedule's, "
                   "not a slow stage's (which would push it above the formula).",
        look_alikes=("slow-rank", "a slow network"),
        fix="More microbatches than stages: --microbatches 8 (M >= 2P).",
        fix_kind="setting",
        failing_checks=("measured bubble within the throughput target",
                        "counted bubble within the throughput target"),
        wrong_fixes=((PIPELINE_TIMING + ("--microbatches", "4"),
                      "as many microbatches as stages still leaves (P-1)/(M+P-1) = 43% idle"),)),
    # ---- composition ---------------------------------------------------------------------------------------------
    BrokenRun(
        name="fsdp-before-tp", family="composition", script=FSDP_TP_HYBRID,
        on_nccl="The same ValueError on every rank, before any NCCL call: DTensor refuses it, not the backend.",
        args=HYBRID_RUN + ("--planted-bug", "fsdp-before-tp"), fixed_args=HYBRID_RUN,
        symptom="Every rank stops before the first step with ValueError: 'Cannot distribute a DTensor with device "
                "mesh DeviceMesh((dp=2), ...) to a different device mesh DeviceMesh((tp=2), ...)'.",
        evidence=("output", "checks"),
        cause="fully_shard ran before parallelize_module: the weights are already DTensors on the dp mesh, and "
              "torch 2.13 refuses to distribute a DTensor onto another mesh (torch/distributed/tensor/_api.py:"
              "953-957).",
        tell_apart="The error comes from parallelize_module, before any collective: a configuration, not a hang "
                   "or a wrong number.",
        look_alikes=("data-by-global-rank", "a mesh that does not divide the world"),
        fix="Apply the TP plan first, then fully_shard each block and the root (torchtitan's order).",
        fix_kind="setting",
        failing_checks=("the TP plan was applied before FSDP",)),
    # ---- operations ------------------------------------------------------------------------------------------------
    BrokenRun(
        name="mismatched-collectives", family="operations", script=DEADLOCKS,
        on_nccl="Undefined: NCCL may pair the broadcast with the all-reduces and return wrong values, or wait until "
                "the watchdog's timeout. TORCH_DISTRIBUTED_DEBUG=DETAIL names the mismatch at the call.",
        args=("--hang", "mismatched-collectives", *HANG_TIMEOUT, "--trace-dir", "{run_dir}"),
        fixed_args=("--hang", "none", *HANG_TIMEOUT, "--trace-dir", "{run_dir}"),
        symptom="The job hangs at its first collective until the process group's timeout; every rank is stuck, "
                "none has finished.",
        evidence=("extra.journals", "extra.cause", "extra.verdict", "extra.flight_recorder"),
        cause="Rank 0 broadcasts where the others all-reduce: the collectives at one position of the program "
              "differ between ranks.",
        tell_apart="The journal: all ranks stuck at the same position on the same group, in different operations.",
        look_alikes=("uneven-inputs", "slow-rank"),
        fix="Every rank issues the same collectives on a group in the same order (no rank-dependent branch around "
            "them).",
        fix_kind="function", hang_cause="mismatched collectives",
        fixed_checks=("the weights are the same on every rank after sync",),
        gpu_note="two different collectives paired on NCCL are undefined behaviour, not a clean hang (chapter 12)"),
    BrokenRun(
        name="resume-without-rng", family="operations", script=FAULT_DRILL,
        on_nccl="The same, and the CUDA generators join the state to save: without them every random draw on the GPU "
                "differs after the restart too.",
        prepare_args=("--run-dir", "{run_dir}", "--kill-rank", "1", "--kill-at-step", "5", "--resume-without-rng"),
        args=("--run-dir", "{run_dir}", "--resume-without-rng"),
        fixed_prepare_args=("--run-dir", "{run_dir}", "--kill-rank", "1", "--kill-at-step", "5"),
        fixed_args=("--run-dir", "{run_dir}"),
        symptom="After the restart the loss of a step trained twice is not what it was the first time (0.10 apart), "
                "and the run no longer follows one device's.",
        evidence=("losses", "extra", "checks"),
        cause="The checkpoint held the model and the optimizer only: the resumed run reads the data from the "
              "start of the epoch's order and replaces other input tokens at random (the drill's augmentation).",
        tell_apart="The step trained twice: the weights reloaded are the ones saved (checkpoint-one-shard's are "
                   "not), yet the loss differs, so the inputs changed, not the model.",
        look_alikes=("checkpoint-one-shard", "no-set-epoch"),
        fix="Checkpoint the data position and every random number generator with the model and the optimizer "
            "(distlab.checkpointing.TrainingState with the loader and the rank).",
        fix_kind="function",
        failing_checks=("losses over all attempts = uninterrupted single device",
                        "a step trained twice gives the same loss both times")),
    BrokenRun(
        name="slow-rank", family="operations", script=PROFILE_STEP,
        on_nccl="The peers' NCCL kernels spin while waiting: full utilisation at low power. A profile shows their "
                "all-reduce kernels longer; the straggler's compute kernels longer when its GPU is the slow part, "
                "otherwise a gap before its first kernel each step.",
        args=("--trace-dir", "{run_dir}", "--planted-bug", "slow-rank"), fixed_args=("--trace-dir", "{run_dir}"),
        symptom="Every step takes longer on every rank, yet the job never times out; in the trace one rank "
                "computes longer than the others, while the three others spend that time in communication.",
        evidence=("extra.ranks", "extra.timeline", "throughput", "checks"),
        cause="One rank is slower than the rest every step (here it is given 0.3 s of extra work: a rank given more "
              "work, a slower or throttled device), and every collective waits for it.",
        tell_apart="The timeline per rank: the steps complete (a hang's do not), and the same rank reaches each "
                   "all-reduce last while the others wait in it.",
        look_alikes=("uneven-inputs", "too-few-microbatches", "a slow network"),
        fix="Find what slows that rank (its node, its data) and remove it; the run without the fault equals one "
            "device and has no straggler.",
        fix_kind="function",
        wrong_fixes=((("--trace-dir", "{run_dir}", "--planted-bug", "slow-rank", "--bucket-mb", "25"),
                      "the time in communication is waiting for the late rank: other buckets do not shorten it"),),
        failing_checks=("no straggler",)),
    BrokenRun(
        name="rank-0-evaluation", family="operations", script=DEADLOCKS,
        on_nccl="The waiting ranks' watchdogs log \"Watchdog caught collective operation timeout: "
                "WorkNCCL(SeqNum=..., OpType=ALLREDUCE, ...)\" after 10 minutes.",
        args=("--hang", "rank-0-evaluation", *HANG_TIMEOUT, "--trace-dir", "{run_dir}"),
        fixed_args=("--hang", "rank-0-evaluation", "--evaluate-on-every-rank", *HANG_TIMEOUT,
                    "--trace-dir", "{run_dir}"),
        symptom="The job stops between two steps: ranks 1 to 3 give up in the next all-reduce after the process "
                "group's timeout (2 s); rank 0 reaches that all-reduce later, and fails in it too.",
        evidence=("extra.journals", "extra.flight_recorder"),
        cause="Rank 0 evaluates the model alone between two steps (`if rank == 0: evaluate()`) for 1.5 times the "
              "timeout while the others wait in the next step's all-reduce: a straggler that outlasts the timeout "
              "becomes a hang.",
        tell_apart="The journal: every rank ends in the same collective (none skipped or mismatched), and the last "
                   "to arrive was busy alone just before, longer than the timeout (a slow rank's peers wait less "
                   "and the steps complete).",
        look_alikes=("slow-rank", "uneven-inputs", "a network failure"),
        fix="Share the evaluation: each rank evaluates its part of the validation set and the sums are "
            "all-reduced; raising the timeout only waits longer, and a longer evaluation breaks it again.",
        fix_kind="function", hang_cause="late rank",
        fixed_checks=("every validation batch evaluated once", "each rank evaluated an equal share")),
)


def case(name: str) -> BrokenRun:
    for run in BROKEN_RUNS:
        if run.name == name:
            return run
    raise KeyError(f"no broken run named {name!r}; there are: {', '.join(r.name for r in BROKEN_RUNS)}")


def run_case(name: str, fixed: bool = False, *, run_dir: str | Path | None = None, args_override=None,
             nproc: int | None = None, extra_args=(), **launch_kwargs) -> launch.LaunchResult:
    """Launch case ``name``, broken or ``fixed``, through :func:`labkit.launch.run` (the fork launcher on a CPU;
    the launch cache where the caller has one) and return its result, metrics loaded. A case that resumes first
    runs its interrupted job in ``run_dir`` (default: ``build/broken_runs/KEY-broken`` or ``-fixed``, KEY a hash
    of the name: the same folder every time, so that a learner's copy of the lab replays the full lab's launch:
    its arguments, the folder among them, are the cache's key). ``args_override``: other arguments for the same
    script (a wrong fix, say); ``nproc``: another number of ranks than the case's; ``extra_args``: arguments added
    to the interrupted job's and to the run's (chapter 14's lab: the flag that loads a learner's fix into both). A broken run fails its
    checks: ``check`` defaults to False. One run at a time in a folder (a lock beside it): tests/scripts/test_14
    and the lab, run side by side by make test, use the same folders, and the second replays the first from the
    launch cache."""
    run = case(name)
    kind = "fixed" if fixed else "broken"
    folder = Path(run_dir) if run_dir is not None else DEFAULT_RUN_DIR / f"{folder_key(name)}-{kind}"
    launch_kwargs.setdefault("check", False)
    launch_kwargs.setdefault("timeout", 120)
    prepare = run.fixed_prepare_args if fixed else run.prepare_args
    args = args_override if args_override is not None else (run.fixed_args if fixed else run.args)
    prepare, args = (tuple(prepare) + tuple(extra_args) if prepare else ()), tuple(args) + tuple(extra_args)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if prepare or run_dir is None:
            # Each run starts from nothing: it finds no file of an earlier run (an interrupted job's checkpoint, a
            # trace), and the launch cache, which keys on what the folder holds, replays it wherever it ran before.
            shutil.rmtree(folder, ignore_errors=True)
        if prepare:
            launch.run(run.script, nproc=nproc or run.nproc, args=fill(prepare, folder), metrics=False,
                       **{**launch_kwargs, "check": False})   # a killed rank's job fails: that is the interruption
        return launch.run(run.script, nproc=nproc or run.nproc, args=fill(args, folder), **launch_kwargs)


def folder_key(name: str) -> str:
    """The default run folder's name for a case: a hash, so that the paths a run prints never name its case (the
    lab shows runs under neutral labels)."""
    import hashlib

    return "case-" + hashlib.sha256(f"broken-run:{name}".encode()).hexdigest()[:10]


def _failed_checks(metrics: dict) -> set[str]:
    return {c["name"] for c in metrics.get("checks", []) if not c["passed"]}


_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b.*")   # as labkit.launch's


def failure_summary(output: str) -> list[dict] | None:
    """torch's failure summary in a run's output, the ``ChildFailedError`` message torchrun ends with (and
    labkit.forkrun with it): each failed rank as {"rank", "exitcode", "error", "root"}, the root cause ("Root Cause
    (first observed failure)") first, then the others as the summary lists them, with "time" as the summary gives it
    (whole seconds, "2026-12-03_04:17:59"; missing from a summary without time lines). "error" is the first exception line
    of the rank's traceback, or the summary's words where it has none ("Signal 15 (SIGTERM) received by PID ...",
    "To enable traceback see ..." without @record). None when the output holds no summary."""
    lines = output.splitlines()
    roots = [i for i, line in enumerate(lines) if line.strip() == "Root Cause (first observed failure):"]
    if not roots:
        return None
    root = roots[-1]
    start = max((i for i, line in enumerate(lines[:root]) if line.strip() == "Failures:"), default=root)
    found, entry, traceback = [], None, False
    for i, line in enumerate(lines[start:], start):
        if re.fullmatch(r"\[\d+\]:", line.strip()):
            entry, traceback = {"root": i > root, "error": None}, False
            found.append(entry)
        elif set(line.strip()) in ({"="}, {"-"}):
            if i > root and found and found[-1]["root"]:
                break
            entry = None
        elif entry is not None:
            field = re.match(r"\s+(time|rank|exitcode|traceback)\s*: ?(.*)", line)
            if field and not traceback:
                name, value = field.groups()
                if name == "time":
                    entry["time"] = value.strip()
                elif name == "rank":
                    entry["rank"] = int(value.split()[0])
                elif name == "exitcode":
                    entry["exitcode"] = int(value.split()[0])
                else:
                    traceback = True
                    entry["error"] = None if value.startswith("Traceback") else value.strip()
            elif traceback and entry["error"] is None and _EXCEPTION.match(line.strip()):
                entry["error"] = line.strip()
    found = [f for f in found if "rank" in f]
    return sorted(found, key=lambda f: not f["root"]) or None


def first_failure_seen(run: BrokenRun, metrics: dict | None, output: str | None) -> list[str]:
    """What is missing for an error one rank raises (``run.first_failure``): the run stopped before its report, the
    error in its output, and, where the output ends with torch's failure summary (torchrun, labkit.forkrun), that
    rank named the root cause with that error, every other rank listed as failed or stopped after it. On a GPU that
    rank's own NCCL watchdog may abort it (SIGABRT: TORCH_NCCL_RETHROW_CUDA_ERRORS, on by default) before @record
    writes: then its signal as the root cause, with the GPU error in the log, shows the case. [] when it is all
    there. Without a summary (a launcher that is not torchrun: mpiexec, srun) the error alone is looked for."""
    rank, *words = run.first_failure
    problems = [] if metrics is None else ["the run wrote its metrics: it ran to its end"]
    if output is None:
        return problems + ["the run's output was not given: the error is read there"]
    failures = failure_summary(output)
    on_gpu = words[1:]   # on a GPU the faulting rank's own NCCL watchdog may abort it (SIGABRT) before @record
    if failures is None:
        if not any(word in output for word in words):
            problems.append(f"no rank's output says {words[0]!r}")
        return problems
    root = failures[0]
    # torch's root cause is the failure with the smallest timestamp, in whole seconds; of those in one second, the
    # first the agent found, and in one poll it looks at its ranks in order. A peer that lost this rank in the same
    # second and has a lower rank can be named instead: then this rank is under "Failures", with the same time.
    tied = next((f for f in failures[1:] if f["rank"] == rank and root["rank"] < rank and f.get("time")
                 and f.get("time") == root.get("time") and "by peer" in (root["error"] or "")), None)
    if tied is not None:
        root, failures = tied, [tied] + [f for f in failures if f is not tied]
    elif not root["root"] or root["rank"] != rank:
        problems.append(f"the summary's root cause is rank {root['rank']}, not rank {rank}")
    aborted = (root["error"] or "").startswith("Signal 6 (SIGABRT)") and any(word in output for word in on_gpu)
    if not aborted and not any(word in (root["error"] or "") for word in words):
        problems.append(f"the root cause's error is {root['error']!r}, not {words[0]!r}")
    others = [f for f in failures[1:] if any(word in (f["error"] or "") for word in words)]
    if others:
        problems.append(f"rank {others[0]['rank']} raised the same error: not one rank's")
    if len(failures) < run.nproc:
        problems.append(f"the summary lists {len(failures)} failed ranks of {run.nproc}: some rank went on")
    return problems


def symptom_seen(run: BrokenRun, metrics: dict | None, output: str | None = None) -> list[str]:
    """What is missing for the broken run's metrics to show the case's symptom: [] when it is all there. An error
    one rank raises is read in the run's ``output`` (:func:`first_failure_seen`)."""
    if run.first_failure:
        return first_failure_seen(run, metrics, output)
    if metrics is None:
        return ["the run wrote no metrics"]
    if run.hang:
        cause = (metrics.get("extra") or {}).get("cause")
        return [] if cause == run.hang_cause else [f"the journal's diagnosis is {cause!r}, not {run.hang_cause!r}"]
    failed = _failed_checks(metrics)
    return [f"check '{prefix}...' did not fail" for prefix in run.failing_checks
            if not any(name.startswith(prefix) for name in failed)]


def fix_holds(run: BrokenRun, metrics: dict | None) -> list[str]:
    """What is wrong with a fixed run's metrics: [] when every check passed (the symptom's checks among them,
    against one device where the script compares) and, for a hang, the journal finds none."""
    if metrics is None:
        return ["the run wrote no metrics"]
    problems = [f"check failed: {name}" for name in sorted(_failed_checks(metrics))]
    names = [c["name"] for c in metrics.get("checks", [])]
    problems += [f"check '{prefix}...' did not run" for prefix in run.failing_checks + run.fixed_checks
                 if not any(name.startswith(prefix) for name in names)]
    if run.hang and (metrics.get("extra") or {}).get("cause") != "none":
        problems.append(f"the journal still finds a hang: {(metrics.get('extra') or {}).get('cause')!r}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.broken_runs", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the cases, one a line: name, family, script")
    check = sub.add_parser("check", help="does a run's metrics file show the case's symptom (or, --fixed, not)?")
    check.add_argument("name")
    check.add_argument("metrics", type=Path)
    check.add_argument("--fixed", action="store_true", help="the fixed run: every check passes")
    check.add_argument("--output", type=Path, default=None,
                       help="the run's output (its log): where an error one rank raises is read")
    options = parser.parse_args(argv)
    if options.command == "list":
        for run in BROKEN_RUNS:
            print(f"{run.name:26} {run.family:20} {run.script}")
        return 0
    run = case(options.name)
    metrics = json.loads(options.metrics.read_text()) if options.metrics.exists() else None
    output = options.output.read_text(errors="replace") if options.output and options.output.exists() else None
    problems = fix_holds(run, metrics) if options.fixed else symptom_seen(run, metrics, output)
    what = "fixed: every check passes" if options.fixed else "broken as planted: the symptom is there"
    print(f"{run.name}: {what}" if not problems else f"{run.name}: NOT {what}: {'; '.join(problems)}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
