"""Faults and walltime: a training run that survives a dead rank and the end of its allocation.

Data-parallel training (DDP) of the course transformer that writes a distributed checkpoint (DCP) every
``--save-every`` steps into ``--run-dir`` and, when started again on the same folder, resumes from the latest
one. Two things end real jobs early, and the script handles both:

* **A rank dies** (a node fails). ``--kill-rank R --kill-at-step K`` makes rank R exit at step K, on the first
  attempt only. The other ranks learn it from their next collective and leave with one line instead of hanging:
  on gloo at once (the socket closes); on NCCL at the process-group timeout, since a survivor waits inside an NCCL
  collective, where neither a Python signal handler nor an ``except`` runs until the call returns
  (``TORCH_NCCL_BLOCKING_WAIT=1``, set below, makes it return with an error at the timeout rather than the
  watchdog killing the process). torchrun's agent meanwhile sends the survivors SIGTERM and, 30 s later, SIGKILL
  (``torch.distributed.elastic``: ``LocalElasticAgent._shutdown``, ``PContext.close(timeout=30)``). This script's
  own SIGTERM handler (for the walltime, below) only notes the signal, so SIGTERM does not end a survivor stuck in
  an NCCL collective: a process-group timeout under 30 s lets it leave with its line, a longer one ends it by
  SIGKILL. The 30 s wait comes from that handler and the agent, not from NCCL. Under
  ``torchrun --max-restarts=1`` the agent then starts every rank again; they resume from the last checkpoint
  and finish. The steps after that checkpoint are trained twice (the steps lost); time to detect is from the
  death to the restart.
* **The walltime runs out.** PBS gives no warning: once the walltime has passed, the first node's MoM sends
  SIGTERM to the job's processes on that node at its next poll (up to 120 s late in a long job), and SIGKILL once
  ``kill_delay`` (10 s by default) has passed, at its next poll, about 10 s later: too little for a step and a
  checkpoint of a real model. The MoM signals its own tasks' sessions (the job shell, ``mpiexec``, ``tee``): a rank,
  on that node or another, gets the TERM only if it runs in such a session or ``mpiexec`` passes it on, which the
  course has not checked under Cray PALS; the all-reduce below makes one rank that saw it enough. So the run stops
  itself first: ``--deadline`` (seconds since the epoch; pbs/common.sh exports ``DISTLAB_DEADLINE``, the job's end less a
  margin) is checked after every step, and when the next step and a checkpoint, timed as the longest seen so far,
  would pass it, every rank agrees (an all-reduce of the flag), writes a checkpoint and exits 0; the next job in
  the chain (``qsub -W depend=afterany:JOBID``) resumes. A SIGTERM is caught the same way: the ranks finish their
  step, save and exit 0. But ``qdel`` sends SIGKILL after its SIGTERM too, 10 to about 25 s later (``kill_delay``,
  at the MoM's next polls), so only a step and a save shorter than that end in a checkpoint. ``qsig -s TERM JOBID``
  sends the TERM alone, with no SIGKILL after it: where the ranks get it (above), the job stops with time to save
  (under torchrun the agent still SIGKILLs its workers ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` s after its own TERM: 30
  by default, the margin, 120 s, in the course's jobs, which export it under both schedulers); where they do not,
  only the deadline saves.

The data is what a real run reads: a finite dataset (``--samples`` sequences) in a shuffled order, epoch after
epoch, and each step masks a random tenth of the input tokens (an augmentation drawn from torch's global random
number generator, the same stream on every rank). So a checkpoint must hold the data position and every random
number generator as well as the model and the optimizer (``distlab.checkpointing.TrainingState`` with a loader and
the rank), and the drill proves it holds enough. ``--resume-without-rng`` shows the mistake: a run resumed from
the model and optimizer alone reads other samples and draws other masks, and the check against one device fails.

When the run completes it proves that every step's loss, across however many attempts, equals an
uninterrupted single-device run (the same data order and masks, on one device), and reports the steps lost and
the time to detect.

    torchrun --standalone --nproc_per_node=4 --max-restarts=1 scripts/12_hpc_operations/fault_drill.py \\
        --run-dir runs/drill --kill-rank 1 --kill-at-step 5
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

from distlab import checkpointing, data, metrics, models, runtime

LOSS_TOLERANCE = 1e-5  # fp32, DDP's averaged gradients vs one device: rounding only (chapter 04)
MASK_FRACTION = 0.1    # of the input tokens replaced by random ones each step
LOSSES_FILE, FAILURE_FILE, STOPPED_FILE = "losses.jsonl", "failure.json", "stopped.json"
STOP_REQUESTED = {"signal": None}


# What a checkpoint can hold (--checkpoint-holds): the script's own holds all but the loss history.
HOLDABLE = ("model", "optimizer", "step", "rng", "data_position", "loss_history")


def held_names(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in HOLDABLE]
    if unknown:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not among {', '.join(HOLDABLE)}")
    return names


def stop_checkpoint_is_whole(run_dir: Path, state, world_size: int) -> tuple[bool, Path | None, int]:
    """Whether the checkpoint a stop wrote, read back from disk, is the latest in the folder (the one the next job
    resumes from) and its metadata names every rank's part; with the latest folder and the ranks looked for. It looks
    only for what ``state`` holds: no rank's generators after --resume-without-rng, no step when --checkpoint-holds
    leaves it out (chapter 14's lab)."""
    latest = checkpointing.latest_checkpoint(run_dir)
    ranks = world_size if state.rank is not None else 0
    holds_step = "step" in getattr(state, "held", ("step",))
    whole = (latest == checkpointing.checkpoint_dir(run_dir, state.step)
             and checkpointing.records_every_rank(latest, ranks, step=holds_step))
    return whole, latest, ranks


def agreed_stop_verdict(run_dir: Path, state, world_size: int, rank: int, device) -> tuple[bool, Path | None, int]:
    """stop_checkpoint_is_whole as rank 0 reads it, broadcast to every rank: so every rank exits with the same code.
    A rank on another node reads the shared folder through its own file-system client, which can miss a file just
    written there for a few seconds (an NFS client's attribute cache). Its own reading would fail a good stop, and its
    torchrun agent, its restart unused, would restart every worker. The other ranks get no folder back (None)."""
    whole, latest = False, None
    if rank == 0:
        whole, latest, _ = stop_checkpoint_is_whole(run_dir, state, world_size)
    verdict = torch.tensor([1.0 if whole else 0.0], device=device)
    dist.broadcast(verdict, src=0)
    return bool(verdict.item()), latest, world_size if state.rank is not None else 0


class HeldState(checkpointing.TrainingState):
    """A checkpoint holding only ``held`` (names of HOLDABLE): what is not held is not saved, and a resume keeps
    what the fresh start made of it. ``loss_history``: rank 0's loss record, written back on a resume."""

    def __init__(self, model, optimizer, loader, rank, held, record: Path, main: bool):
        super().__init__(model, optimizer, loader=loader if "data_position" in held else None,
                         rank=rank if "rng" in held else None)
        self.held, self.record, self.main = held, record, main

    def state_dict(self):
        state = super().state_dict()
        for name in ("model", "optimizer", "step"):
            if name not in self.held:
                del state[name]
        if "loss_history" in self.held and self.main:
            state["loss_history"] = self.record.read_text() if self.record.exists() else ""
        return state

    def load_state_dict(self, state):
        options = checkpointing.LAYOUT_FREE
        if "model" in self.held:
            set_model_state_dict(self.model, state["model"], options=options)
        if "optimizer" in self.held:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        if "step" in self.held:
            self.step = state["step"]
        if self.loader is not None:
            self.loader.load_state_dict(state["data"])
        if self.rank is not None:
            runtime.set_rng_state(state[f"rng_rank{self.rank}"])
        if "loss_history" in state:
            self.record.write_text(state["loss_history"])


def check_config(args, world_size):
    runtime.require(args.batch % world_size == 0, f"--batch {args.batch} does not split over {world_size} ranks")
    runtime.require(args.save_every >= 1, f"--save-every {args.save_every}: must be at least 1")
    runtime.require(not (args.checkpoint_holds is not None and args.resume_without_rng),
                    "--checkpoint-holds says what a checkpoint holds, --resume-without-rng too: not both")
    if args.kill_rank is not None:
        runtime.require(0 <= args.kill_rank < world_size, f"--kill-rank {args.kill_rank}: no such rank")
        runtime.require(args.kill_at_step is not None and 0 < args.kill_at_step < args.steps,
                        f"--kill-at-step must be between 1 and --steps - 1 ({args.steps - 1})")
    run_dir = Path(args.run_dir)
    if run_dir.exists():
        ours = {LOSSES_FILE, FAILURE_FILE, STOPPED_FILE, "metrics.json"}
        foreign = [p.name for p in run_dir.iterdir() if p.name not in ours and not p.name.startswith("step_")]
        runtime.require(not foreign, f"--run-dir {run_dir} holds files this script did not write "
                                     f"({', '.join(sorted(foreign)[:3])}): choose an empty or new folder")


def augment(inputs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Replace a random tenth of the tokens by random tokens, drawn from torch's global generator: the whole global
    batch on every rank (the same stream everywhere), so each rank's rows equal one device's."""
    mask = torch.rand(inputs.shape) < MASK_FRACTION
    noise = torch.randint(0, vocab_size, inputs.shape)
    return torch.where(mask, noise, inputs)


def global_batch(loader, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's whole batch, on the CPU: the loader's next rows, inputs augmented, targets as they are."""
    inputs, targets = data.split_inputs_targets(loader.next_batch())
    return augment(inputs, vocab_size), targets


def single_device_losses(cfg, args, device) -> list[float]:
    """The uninterrupted run on one device: the same seed, data order and masks, every step's whole batch."""
    runtime.seed_everything(args.seed)  # the global generators as runtime.start left them
    loader = data.ShuffledLoader(args.samples, args.batch, cfg.seq_len, cfg.vocab_size, args.seed)
    model = models.build_transformer(cfg, seed=args.seed, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        inputs, targets = global_batch(loader, cfg.vocab_size)
        loss = models.lm_loss(model(inputs.to(device)), targets.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def note_the_resume(failure: Path, step: int) -> None:
    """Rank 0, as an attempt starts: if a rank died since the last attempt began (the dead rank's record lacks
    ``resumed_from``), note the step this attempt resumes from, for the check at the end. Called before the barrier
    that every rank passes before its first step: the dying rank of this attempt writes its record after it."""
    if failure.exists():
        died = json.loads(failure.read_text())
        if "resumed_from" not in died:
            failure.write_text(json.dumps({**died, "resumed_from": step}))


def on_sigterm(signum, frame):
    STOP_REQUESTED["signal"] = signum  # acted on at the end of the step, by every rank together


def main():
    p = runtime.parser(__doc__, steps=8)
    p.add_argument("--run-dir", default=os.path.join(os.environ.get("DISTLAB_RUN_DIR", "runs"), "fault_drill"),
                   help="checkpoints and the loss record (default: $DISTLAB_RUN_DIR/fault_drill, else runs/fault_drill)")
    p.add_argument("--save-every", type=runtime.positive_int, default=2, help="checkpoint every this many steps")
    p.add_argument("--batch", type=runtime.positive_int, default=8, help="global batch (sequences per step)")
    p.add_argument("--samples", type=runtime.positive_int, default=20,
                   help="sequences in the dataset, read in a new shuffled order each epoch (20: 2.5 steps an epoch)")
    p.add_argument("--resume-without-rng", action="store_true",
                   help="the mistake: checkpoint only the model and the optimizer (no data position, no RNGs)")
    p.add_argument("--checkpoint-holds", type=held_names, default=None, metavar="NAMES",
                   help=f"what each checkpoint holds, names among {', '.join(HOLDABLE)}, comma-separated (default: "
                        "all but loss_history; loss_history: rank 0's loss record, written back on a resume)")
    runtime.add_lr_flag(p)
    p.add_argument("--kill-rank", type=runtime.nonnegative_int, default=None, help="this rank dies (first attempt only)")
    p.add_argument("--kill-at-step", type=runtime.positive_int, default=None, help="... at the start of this step")
    p.add_argument("--step-seconds", type=runtime.nonnegative_float, default=0.0, help="sleep this long per step (to give a signal time)")
    deadline = os.environ.get("DISTLAB_DEADLINE")
    p.add_argument("--deadline", type=runtime.positive_float, default=float(deadline) if deadline else None,
                   metavar="EPOCH_SECONDS", help="stop, checkpoint written, before this time (default: "
                   "$DISTLAB_DEADLINE, which pbs/common.sh sets from the job's walltime)")
    p.add_argument("--stopping-file", default=os.environ.get("DISTLAB_STOPPING_FILE") or None, metavar="PATH",
                   help="written when the run begins to stop at its deadline, before that checkpoint (default: "
                   "$DISTLAB_STOPPING_FILE, set by the course's jobs: Slurm's walltime warning then lets the save end)")
    args = p.parse_args()
    # NCCL: a timed-out collective raises in this thread (read when the process group is created; gloo ignores it)
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")

    with runtime.start(args, validate=lambda world: check_config(args, world)) as rt:
        # which start of the job this is, the same on every node (each torchrun agent counts only its own restarts)
        attempt = rt.attempt
        started_at = time.time()
        run_dir = Path(args.run_dir)
        report = metrics.Report(__file__, rt, config={**vars(args), "attempt": attempt})
        signal.signal(signal.SIGTERM, on_sigterm)

        model = DDP(models.build_transformer("tiny", seed=args.seed, device=rt.device))
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        cfg = model.module.cfg
        loader = data.ShuffledLoader(args.samples, args.batch, cfg.seq_len, cfg.vocab_size, args.seed)
        if args.checkpoint_holds is not None:   # chapter 14's lab: what the learner says a checkpoint must hold
            state = HeldState(model, optimizer, loader, rt.rank, args.checkpoint_holds, run_dir / LOSSES_FILE,
                              rt.is_main)
        elif args.resume_without_rng:
            state = checkpointing.TrainingState(model, optimizer)
        else:
            state = checkpointing.TrainingState(model, optimizer, loader=loader, rank=rt.rank)
        latest = checkpointing.latest_checkpoint(run_dir)
        if latest is not None:
            checkpointing.load(state, latest)
            rt.print(f"attempt {attempt}: resuming from {latest} (step {state.step})")
        else:
            rt.print(f"attempt {attempt}: no checkpoint in {run_dir}: starting at step 0")
        if rt.is_main:
            run_dir.mkdir(parents=True, exist_ok=True)
            note_the_resume(run_dir / FAILURE_FILE, state.step)
        dist.barrier()  # no rank dies (--kill-at-step) before rank 0 has read the last death's record
        longest = {"step": 0.0, "save": 0.0}  # seconds: what the next step and a checkpoint may take
        # the step of the last checkpoint this attempt can resume from: the one it started from, then each it writes
        # (a stop's lies off the --save-every grid: a chained job's rank may die just after resuming from it)
        last_saved = state.step

        try:
            for step in range(state.step, args.steps):
                if rt.rank == args.kill_rank and step == args.kill_at_step and attempt == 0:
                    (run_dir / FAILURE_FILE).write_text(json.dumps({"rank": rt.rank, "step": step, "time": time.time(),
                                                                    "last_checkpoint": last_saved}))
                    print(f"[rank {rt.rank}] dies at step {step} (a node fails)", flush=True)
                    os._exit(1)
                step_started = time.perf_counter()
                inputs, targets = global_batch(loader, cfg.vocab_size)
                inputs, targets = (data.shard_rows(t, rt.rank, rt.world_size).to(rt.device) for t in (inputs, targets))
                loss = models.lm_loss(model(inputs), targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                state.step = step + 1
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)
                mean_loss = mean_loss.item() / rt.world_size
                if rt.is_main:
                    with open(run_dir / LOSSES_FILE, "a") as record:
                        record.write(json.dumps({"step": step, "loss": mean_loss, "attempt": attempt,
                                                 "time": time.time()}) + "\n")
                rt.print(f"step {step}: loss {mean_loss:.6f}")
                time.sleep(args.step_seconds)
                longest["step"] = max(longest["step"], time.perf_counter() - step_started)
                out_of_time = (args.deadline is not None and state.step < args.steps
                               and time.time() + longest["step"] + max(longest["save"], longest["step"]) > args.deadline)
                stop = torch.tensor([1.0 if STOP_REQUESTED["signal"] else 0.0, float(out_of_time)], device=rt.device)
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # what any rank saw stops all of them
                by = "signal" if stop[0].item() else "deadline" if stop[1].item() else None
                if by == "deadline" and rt.is_main and args.stopping_file:
                    # the job's batch shell reads it: a walltime warning now sends no SIGTERM, whose torchrun agent
                    # would SIGKILL the ranks during this save (slurm/common.sh, distlab_on_walltime_warning)
                    Path(args.stopping_file).write_text(json.dumps({"step": state.step, "time": time.time(), "by": by}))
                if state.step % args.save_every == 0 or state.step == args.steps or by:
                    save_started = time.perf_counter()
                    where = checkpointing.save(state, run_dir)
                    last_saved = state.step
                    longest["save"] = max(longest["save"], time.perf_counter() - save_started)
                    rt.print(f"  checkpoint {where.name}")
                if by:
                    if rt.is_main:
                        (run_dir / STOPPED_FILE).write_text(json.dumps({"step": state.step, "time": time.time(),
                                                                         "by": by}))
                    why = "SIGTERM" if by == "signal" else (
                        f"deadline in {args.deadline - time.time():.1f} s, less than a step "
                        f"({longest['step']:.2f} s) and a checkpoint ({longest['save']:.2f} s)")
                    rt.print(f"{why}: stopped after step {step} with checkpoint step_{state.step:06d} written; "
                             "start the job again (a chained qsub) to resume")
                    # read back from disk, not taken from the save's return: the folder the next job resumes from
                    # (the latest with its metadata) must be this one, and its metadata must name every rank's part;
                    # rank 0 reads it, and every rank takes its verdict (agreed_stop_verdict)
                    whole, latest, ranks = agreed_stop_verdict(run_dir, state, rt.world_size, rt.rank, rt.device)
                    report.check("the stop's checkpoint is the latest in the folder and records every rank",
                                 whole, str(latest) if rt.is_main else "rank 0's reading",
                                 f"step_{state.step:06d}, with {ranks} ranks' generators")
                    report.extra = {"stopped_by": by, "checkpoint_step": state.step,
                                    "seconds_left": None if args.deadline is None else args.deadline - time.time()}
                    code = report.finish(args.metrics_out)
                    # no rank leaves before rank 0 has written the stop record, the line and the metrics: on two or
                    # more nodes the first torchrun agent to exit (1, after a TERM) has srun's --kill-on-bad-exit
                    # kill the others (slurm/common.sh, distlab_ranks_command)
                    dist.barrier()
                    sys.exit(code)
        except (RuntimeError, dist.DistBackendError) as error:
            # A peer is gone: leave now, with one line, rather than wait for collectives that cannot complete
            # (one write, newline included, so the lines of several ranks do not interleave).
            sys.stdout.write(f"[rank {rt.rank}] lost a peer at step {state.step} after "
                             f"{time.time() - started_at:.1f} s: {str(error).splitlines()[0][:140]}; exiting "
                             "(torchrun --max-restarts restarts the job)\n")
            sys.stdout.flush()
            os._exit(1)

        # Completed: the whole trajectory, over every attempt, against the uninterrupted single-device run.
        expected = single_device_losses(cfg, args, rt.device)  # uninterrupted, one device, from the seed
        records = [json.loads(line) for line in (run_dir / LOSSES_FILE).read_text().splitlines()]
        last_per_step = {r["step"]: r["loss"] for r in records}  # a step trained twice: its last value
        trained_twice = sorted({r["step"] for r in records if sum(q["step"] == r["step"] for q in records) > 1})
        report.losses = [last_per_step.get(s, float("nan")) for s in range(args.steps)]
        report.check("every step trained, over all attempts", sorted(last_per_step) == list(range(args.steps)),
                     len(last_per_step), args.steps)
        report.check_close("losses over all attempts = uninterrupted single device", report.losses, expected,
                           LOSS_TOLERANCE)
        repeated = [max(abs(r["loss"] - last_per_step[r["step"]]) for r in records if r["step"] == s)
                    for s in trained_twice]
        if trained_twice:
            report.check("a step trained twice gives the same loss both times (the checkpoint is exact)",
                         max(repeated) == 0.0, max(repeated), 0.0)
        failure = run_dir / FAILURE_FILE
        extra = {"attempts": max(r["attempt"] for r in records) + 1, "steps_lost": len(trained_twice),
                 "steps_trained_twice": trained_twice}
        if failure.exists():
            died = json.loads(failure.read_text())
            extra.update(died_at_step=died["step"], seconds_to_restart=started_at - died["time"])
            # the latest checkpoint written before this death, on the --save-every grid or not, and the steps after
            # it trained again (a chained job's earlier death trained others twice)
            last_save = died["last_checkpoint"]
            # where the first attempt after the death started (note_the_resume): a resume from an older checkpoint
            # (the latest missing or unreadable) trains every step the count below looks for and more, and is still
            # exact, so neither that count nor the losses would see it
            report.check("the first attempt after the death resumed from the last checkpoint written before it",
                         died.get("resumed_from") == last_save, died.get("resumed_from"), last_save)
            lost = [s for s in trained_twice if last_save <= s < died["step"]]
            report.check("steps lost = death step - last checkpoint before it", len(lost) == died["step"] - last_save,
                         len(lost), died["step"] - last_save)
            rt.print(f"rank {died['rank']} died at step {died['step']}; the job was running again "
                     f"{extra['seconds_to_restart']:.1f} s later; {len(trained_twice)} step(s) trained twice")
        report.extra = extra
        code = report.finish(args.metrics_out)
    sys.exit(code)


if __name__ == "__main__":
    main()
