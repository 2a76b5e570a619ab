"""The course's slurm/ jobs, unchanged, under a real two-node Slurm cluster (n1, n2 on this machine).

Each job is submitted as a user would, `sbatch -N 2 slurm/NN_name.sbatch`, with only the shape of the test cluster
said on the command line (two tasks and two GPUs a node: the GPUs are Slurm's count, the ranks run on the CPU with
gloo) and the course's settings in the environment (sbatch hands the environment on). Every job is submitted at
the start, so the cluster runs them side by side; each test waits for its own with scontrol and reads what the job
wrote: every check passed, ranks on both nodes. The node names do not resolve here: DISTLAB_MASTER_ADDR=127.0.0.1.
Each program a job starts with its interpreter (DISTLAB_PYTHON, tests/helpers.py: a chapter job's rank, a torchrun
agent) and each worker a torchrun agent starts (PYTHON_EXEC, torch/distributed/run.py) forks from make test's fork
server, torch imported once (labkit/forkexec.py: signals passed on, the same exit). Slurm signals and kills a task's
whole process tree, and the forked program is outside it; each wrapper stands in for that tree (helpers.py). The
export-list job, handed no server, starts its ranks with the real interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest
from helpers import slurm_task_settings

ROOT = Path(__file__).resolve().parents[2]
SLURM_DIR = ROOT / "slurm"
SHAPE = ["-N", "2", "--ntasks-per-node=2", "--gpus-per-node=2", "--cpus-per-task=1"]


def settings(run_dir: Path, **extra: str) -> dict[str, str]:
    return {"DISTLAB_RUN_DIR": str(run_dir), "DISTLAB_DEVICE": "cpu", "DISTLAB_PRESET": "tiny", "DISTLAB_MODULES": "",
            "DISTLAB_CONDA_ENV": "", "DISTLAB_MASTER_ADDR": "127.0.0.1",
            "DISTLAB_SCRATCH": str(run_dir.parent / "scratch"), "DISTLAB_LAUNCH_TIMEOUT": "150",
            **slurm_task_settings(), **extra}


# the time-limit job's warning: --signal=B:USR1@WARNING
WARNING = 30
# slurmctld checks time limits every PERIODIC_TIMEOUT seconds (src/slurmctld/controller.c:2833, slurmctld.h:105)
PERIODIC_TIMEOUT = 30
# a workshop's reservation: four cores a node, so the other jobs run beside it (the walltime chain runs in it)
RESERVATION = "course"
# what the export-list job is handed (sbatch --export=NAMES): the test's own settings, nothing of a site's
EXPORTED = ("DISTLAB_RUN_DIR", "DISTLAB_DEVICE", "DISTLAB_PRESET", "DISTLAB_PYTHON", "DISTLAB_MASTER_ADDR",
            "DISTLAB_SCRATCH", "DISTLAB_LAUNCH_TIMEOUT", "DISTLAB_ONLY")

# The fault path's jobs (walltime, time limit, requeue) depend on the wrapper standing in for a task's whole process
# tree (helpers.slurm_task_settings): their ranks, a torchrun agent's workers, checkpoint on Slurm's TERM, which
# reaches them through the wrapper (and, were one still alive at Slurm's KILL, the wrapper's death would take it:
# tests/unit/test_forkexec.py).

# The drill's process-group timeout in the jobs where no rank dies: the job file's 20 s is for a death (NCCL's
# survivors leave before torchrun's 30 s SIGKILL); here it would bound only the final barrier, which every rank
# reaches after computing the uninterrupted reference alone, and on a loaded machine (load 11 to 17) one rank was seen
# arriving more than 20 s after the other
PG_TIMEOUT = {"DISTLAB_DRILL_PG_TIMEOUT": "120"}

# name: (job file, extra sbatch options, extra settings)
JOBS = {
    # one script of each chapter job (the tier proves the path; tests/scripts proves every script): the job file,
    # common.sh and srun are the same for every script of a job
    "04": ("04_data_parallel", [], {"DISTLAB_ONLY": "ddp_from_scratch.py"}),
    "05": ("05_fully_sharded", [], {"DISTLAB_ONLY": "zero_from_scratch.py"}),
    "09": ("09_hybrid_parallel", [], {"DISTLAB_ONLY": "rank_grid.py"}),
    "13": ("13_expert_parallel", [], {"DISTLAB_ONLY": "moe_transformer.py"}),
    # a broken run and its fix: the job must call the planted failure ok, and the job ok
    "14": ("14_when_it_goes_wrong", [], {"DISTLAB_ONLY": "ddp_from_scratch.py"}),
    # the rank map only (the PBS tier runs its bandwidth row): where every rank runs, under the jobs' own srun
    "preflight": ("preflight", [], {"DISTLAB_ONLY": "distlab.runtime"}),
    # the walltime path, made to hold on a loaded machine: a 2-minute limit; the first job's deadline 90 s before it
    # (30 s: the job's start-up, which took over 15 s at load 14 while every job of the tier started, and then
    # 24 steps of 1 s or more, a death and a restart, which do not fit in what is left), so the drill (rank 1 dies
    # at step 5, torchrun restarts it) stops at the deadline with a checkpoint and exits 0; the chain's next jobs
    # (sbatch --dependency=afterany) are given a deadline 5 s before their limit (DISTLAB_CHAIN_EXPORT), resume,
    # complete, and cancel the successor they queued in turn. The warning is asked 5 s ahead (a 2-minute limit; the
    # job file's 180 s is for its 20 minutes), and the chain says so again. DISTLAB_ONLY is a list with a comma, whose
    # first name matches no script: a chain that let sbatch --export split it would run nothing in the next job.
    "walltime": ("12_hpc_operations", ["--time=2", "--signal=B:USR1@5", f"--reservation={RESERVATION}"],
                 {"DISTLAB_ONLY": "no_such_script.py,fault_drill.py", "DISTLAB_CHAIN": "3", "DISTLAB_WALLTIME_MARGIN": "90",
                  "DISTLAB_DRILL_STEPS": "24", "DISTLAB_DRILL_STEP_SECONDS": "1",
                  "DISTLAB_CHAIN_SBATCH_ARGS": "--signal=B:USR1@5",
                  "DISTLAB_CHAIN_EXPORT": "DISTLAB_WALLTIME_MARGIN=5"}),
    # the walltime warning as the time to save (test_a_job_warned_before_its_time_limit_...): one task and one GPU
    # a node, --time=2, the warning asked WARNING s ahead; the drill's own deadline is put past the limit (given by
    # hand, a day away), so that only the warning stops it: the case of a step or a checkpoint longer than the
    # margin, or a script that does not watch the deadline. 60 steps of 2 s or more outlast the limit (the warning
    # comes 60 to 90 s in: slurmctld checks every 30 s), so the drill still runs when the warning comes; the ranks
    # mostly sleep. No rank dies (DISTLAB_DRILL_DEATH=0): a warning during torchrun's restart (seen after the death
    # at step 5 on a loaded machine) finds the new ranks before their SIGTERM handler, with no checkpoint.
    # tuning.py is the launch the warning holds back; the successor runs the drill only, unpaced (the pacing changes
    # no loss; paced, at load 19, it ran 4 s a step and outlasted the test's 300 s), under the job file's own warning
    # (180 s ahead) and deadline (120 s ahead): a 10-minute limit, so that neither comes before it completes (with 6
    # minutes, on a loaded machine, the warning stopped it at step 45 of 80), within 500 s (DISTLAB_LAUNCH_TIMEOUT:
    # the others' 150 s is too short here).
    "time-limit": ("12_hpc_operations", ["--ntasks-per-node=1", "--gpus-per-node=1", "--time=2",
                                         f"--signal=B:USR1@{WARNING}"],
                   {"DISTLAB_ONLY": "fault_drill.py,tuning.py", "DISTLAB_CHAIN": "1",
                    "DISTLAB_DEADLINE": str(int(time.time()) + 86400), "DISTLAB_DRILL_STEPS": "60",
                    "DISTLAB_DRILL_DEATH": "0", **PG_TIMEOUT,
                    "DISTLAB_DRILL_STEP_SECONDS": "2", "DISTLAB_CHAIN_SBATCH_ARGS": "--time=10",
                    "DISTLAB_CHAIN_EXPORT": "DISTLAB_ONLY=fault_drill.py,DISTLAB_DRILL_STEP_SECONDS=0",
                    "DISTLAB_LAUNCH_TIMEOUT": "500"}),
    # the time limit itself (test_a_job_that_reaches_its_time_limit_...): the job file's warning turned off
    # (--signal=B:USR1@0: slurmctld sends a warning only for a warn_time above 0, job_mgr.c send_job_warn_signal),
    # --time=1, Slurm's smallest; the drill's own deadline a day away, as above, so that nothing stops it before the
    # limit: 40 steps of 3 s or more outlast the 60 to about 95 s the job lives (the limit is found at slurmctld's
    # first check past the end, every 30 s), and a step and a save fit in KillWait. The successor completes the drill
    # unpaced (pacing changes no loss) under the job file's own warning and deadline, in a 10-minute limit.
    "limit-reached": ("12_hpc_operations", ["--ntasks-per-node=1", "--gpus-per-node=1", "--time=1",
                                            "--signal=B:USR1@0"],
                      {"DISTLAB_ONLY": "fault_drill.py,tuning.py", "DISTLAB_CHAIN": "1",
                       "DISTLAB_DEADLINE": str(int(time.time()) + 86400), "DISTLAB_DRILL_STEPS": "40",
                       "DISTLAB_DRILL_DEATH": "0", "DISTLAB_DRILL_STEP_SECONDS": "3", **PG_TIMEOUT,
                       "DISTLAB_CHAIN_SBATCH_ARGS": "--time=10",
                       "DISTLAB_CHAIN_EXPORT": "DISTLAB_ONLY=fault_drill.py,DISTLAB_DRILL_STEP_SECONDS=0",
                       "DISTLAB_LAUNCH_TIMEOUT": "500"}),
    # a site whose sbatch hands the job no environment (SBATCH_EXPORT=NONE in the site's profile.d): the user names
    # what the job needs with --export=NAMES (no ALL), and sbatch sets SLURM_EXPORT_ENV to the same list, which srun
    # would read as its own --export. No DISTLAB_MODULES, no DISTLAB_CONDA_ENV, no DISTLAB_SITE: the generic profile.
    "export-list": ("preflight", [], {"DISTLAB_ONLY": "distlab.runtime"}),
    # a requeue (scontrol requeue mid-run: a node failure or a preemption does the same): the job runs again with the
    # same id and SLURM_RESTART_COUNT=1, and the fault drill resumes from the first attempt's checkpoint. No rank
    # dies (DISTLAB_DRILL_DEATH=0): the walltime job proves the death and torchrun's restart under Slurm; here each
    # attempt would restart four ranks for it and prove nothing more.
    "requeue": ("12_hpc_operations", ["--time=5"],
                {"DISTLAB_ONLY": "fault_drill.py", "DISTLAB_DRILL_DIR": "", "DISTLAB_DRILL_STEPS": "8",
                 "DISTLAB_DRILL_STEP_SECONDS": "2", "DISTLAB_DRILL_DEATH": "0"}),
    # bad input: one line, exit 2, nothing left queued
    "tasks-not-gpus": ("04_data_parallel", ["--ntasks-per-node=1"], {}),
    "ranks-do-not-fit": ("04_data_parallel", [], {"DISTLAB_NPROCS": "3"}),
    "demo-one-node": ("instructor_demo", ["-N", "1"], {}),
}


@pytest.fixture(scope="module")
def submitted(cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm_course_jobs")
    cluster.run(["scontrol", "create", "reservation", f"ReservationName={RESERVATION}", "Users=root", "StartTime=now",
                 "Duration=30", "Nodes=n1,n2", "CoreCnt=4,4"])
    jobs = {}
    # DISTLAB_TIER_JOBS=name,...: submit only these (one test run by hand: pytest -k NAME); every job by default
    only = [name for name in os.environ.get("DISTLAB_TIER_JOBS", "").split(",") if name]
    for name, (job, options, extra) in JOBS.items():
        if only and name not in only:
            continue
        out = folder / name
        (out / "scratch").mkdir(parents=True)
        env = settings(out / "run", **{"DISTLAB_DRILL_DIR": str(out / "drill"), **extra})
        if name == "export-list":
            for site_setting in ("DISTLAB_MODULES", "DISTLAB_CONDA_ENV"):
                del env[site_setting]
            options = [*options, "--export=" + ",".join(EXPORTED)]
            env["SBATCH_EXPORT"] = "NONE"  # the site's default; the --export above is what the user passes instead
        words = [*SHAPE, *options, "-o", str(out / "slurm-%j.out"), str(SLURM_DIR / f"{job}.sbatch")]
        if name == "04":  # the course's checked way to submit (its partition is real), on the same job
            job_id = submit(cluster, "--parsable", *words, **env).stdout.strip().split(";")[0]
        else:
            job_id = cluster.sbatch(*words, cwd=ROOT, **env)
        jobs[name] = (job_id, out)
    # the requeue, as soon as the first attempt has a checkpoint (whatever the test that reads it is doing then)
    requeued = threading.Thread(target=requeue_once_checkpointed, args=(cluster, *jobs["requeue"]), daemon=True) \
        if "requeue" in jobs else None
    if requeued:
        requeued.start()
    yield jobs
    if requeued:
        requeued.join(timeout=5)


def requeue_once_checkpointed(cluster, job_id: str, out: Path) -> None:
    """scontrol requeue JOB once its first attempt's fault drill has written a checkpoint (Slurm does the same on a
    node failure or a preemption); the job's output then says what happened (the test reads it)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if list((out / "run" / "fault_drill").glob("step_*")):
            cluster.run(["scontrol", "requeue", job_id], check=False)
            return
        if cluster.job(job_id).get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING"):
            return  # ended before a checkpoint: the test says so
        time.sleep(0.2)


def submit(cluster, *words: str, **env: str):
    """python -m coursetools.jobs submit WORDS, with this cluster's Slurm commands; the finished process."""
    return subprocess.run([sys.executable, "-m", "coursetools.jobs", "submit", *words], cwd=ROOT,
                          env=cluster.env(PYTHONPATH=str(ROOT), **env), capture_output=True, text=True, timeout=120)


def finished(cluster, submitted, name, timeout=240):
    job_id, out = submitted[name]
    fields = cluster.wait(job_id, timeout=timeout)
    log = "".join(p.read_text() for p in sorted(out.glob("slurm-*.out")))
    return fields, log, out / "run"


def metrics_of(run: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in run.glob("*.json")}


@pytest.mark.parametrize("name, scripts", [("04", 1), ("05", 1), ("09", 1), ("13", 2)])
def test_chapter_job_passes_every_check_with_ranks_on_both_nodes(cluster, submitted, name, scripts):
    fields, log, run = finished(cluster, submitted, name)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    found = metrics_of(run)
    assert len(found) >= scripts, sorted(found)
    for script, metrics in found.items():
        assert metrics["checks"] and all(c["passed"] for c in metrics["checks"]), (script, metrics["checks"])
        assert metrics["world_size"] == 4, script
    assert "job " in log and "(slurm): 2 node(s) [n1 n2]" in log
    summary = (run / "summary.txt").read_text()
    assert summary.startswith(f"job {submitted[name][0]} on 2 node(s): n1 n2") and "FAILED" not in summary


def test_chapter_14s_broken_run_fails_as_planted_and_its_fix_passes_so_the_job_passes(cluster, submitted):
    fields, log, run = finished(cluster, submitted, "14")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    broken, fixed = (json.loads((run / f"loss-averaged-twice_{kind}.json").read_text()) for kind in ("broken", "fixed"))
    assert [c["name"] for c in broken["checks"] if not c["passed"]][:1] == [
        "averaged gradients = single-device gradients (every step)"] and broken["world_size"] == 4
    assert all(c["passed"] for c in fixed["checks"]) and fixed["world_size"] == 4
    summary = (run / "summary.txt").read_text()
    assert "(broken as planted: loss-averaged-twice)" in summary and "FAILED" not in summary, summary


def test_preflight_job_maps_ranks_on_both_nodes(cluster, submitted):
    fields, log, run = finished(cluster, submitted, "preflight")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    rank_map = json.loads((run / "rank_map.json").read_text())
    assert all(c["passed"] for c in rank_map["checks"])
    ranks = rank_map["extra"]["ranks"]
    assert sorted((r["host"], r["local_rank"]) for r in ranks) == [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
    # what srun set: the cluster's MpiDefault=pmi2 would add PMI_RANK/PMI_SIZE (read as MPICH's); the jobs' srun
    # --mpi=none leaves Slurm's own SLURM_PROCID, SLURM_LOCALID
    assert {r["launcher"] for r in ranks} == {"slurm"}
    assert (run / "preflight.txt").exists() and "ok distlab.runtime" in (run / "summary.txt").read_text()
    assert "distlab: site profile generic-slurm (" in log and "glade" not in log and "ncarenv" not in log


def test_preflight_passes_where_sbatch_hands_the_job_only_the_variables_named(cluster, submitted):
    """SBATCH_EXPORT=NONE sites: sbatch --export=NAMES sets SLURM_EXPORT_ENV=NAMES in the job, which srun reads; the
    jobs' srun --export=ALL hands the tasks the batch shell's environment (MASTER_*, PYTHONPATH, the deadline)."""
    fields, log, run = finished(cluster, submitted, "export-list")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    rank_map = json.loads((run / "rank_map.json").read_text())
    ranks = rank_map["extra"]["ranks"]
    assert sorted((r["host"], r["local_rank"]) for r in ranks) == [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
    assert {r["launcher"] for r in ranks} == {"slurm"} and all(c["passed"] for c in rank_map["checks"])
    # what the batch shell exported reached every task (OMP_NUM_THREADS: set by jobs/common.sh, not in the list)
    assert {r["omp_num_threads"] for r in ranks} == {"1"}, ranks
    assert "distlab: site profile generic-slurm (" in log and "modules: (none)" in log


def test_a_requeued_job_runs_again_and_resumes_from_its_checkpoint(cluster, submitted):
    job_id, out = submitted["requeue"]
    first = out / "run" / "fault_drill"  # requeued by requeue_once_checkpointed once a checkpoint was here
    fields, log, _ = finished(cluster, submitted, "requeue", timeout=300)
    assert fields["Restarts"] == "1", fields
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    rerun = out / "run.restart1"  # the rerun's own folder; the first attempt's stays as it was left
    assert "this job was restarted 1 time(s)" in log and f"writes to {rerun}" in log
    metrics = json.loads((rerun / "fault_drill.json").read_text())
    assert "resuming from" in log and f"{first}/step_" in log, log[-4000:]
    assert all(c["passed"] for c in metrics["checks"]), metrics["checks"]


def chain_next(log: str) -> str | None:
    return next((line.split("next job of the chain: ")[1].split()[0] for line in log.splitlines()
                 if "next job of the chain: " in line), None)


def test_walltime_deadline_checkpoint_and_the_chain_resume_to_the_uninterrupted_result(cluster, submitted):
    fields, log, run = finished(cluster, submitted, "walltime")
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    first = json.loads((run / "fault_drill.json").read_text())
    assert first["extra"].get("stopped_by") == "deadline", first["extra"]  # stopped itself: checkpoint, exit 0
    # and said so before that checkpoint, where the warning's trap looks (DISTLAB_STOPPING_FILE, the launch's own)
    assert json.loads((run / "logs" / "01_fault_drill.stopping").read_text())["by"] == "deadline"
    out = submitted["walltime"][1]
    # follow the chain (sbatch --dependency=afterany): each job resumes from the checkpoint the one before left,
    # in a run folder of its own on the scratch folder, until one completes the run
    job, jobs_log = chain_next(log), log
    for _ in range(3):
        assert job, jobs_log[-3000:]
        fields = cluster.wait(job, timeout=300)
        jobs_log = (out / f"distlab-12-ops.o{job}").read_text()
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), jobs_log[-4000:]
        assert fields["NumNodes"] == "2" and fields["Partition"] == "gpu" and fields["TimeLimit"] == "00:02:00"
        assert fields["Reservation"] == RESERVATION  # the chain stays in the workshop's reservation
        job_run = Path(next(line.split("run directory ")[1] for line in jobs_log.splitlines() if "run directory " in line))
        metrics = json.loads((job_run / "fault_drill.json").read_text())
        if not metrics["extra"].get("stopped_by"):
            break
        job = chain_next(jobs_log)
    assert "resuming from" in jobs_log and all(c["passed"] for c in metrics["checks"]), metrics["checks"]
    assert any(c["name"] == "losses over all attempts = uninterrupted single device" for c in metrics["checks"])
    # the run is complete: the successor this job had queued, if any, is cancelled
    successor = chain_next(jobs_log)
    if successor:
        assert cluster.wait(successor, timeout=60)["JobState"] == "CANCELLED"
        assert f"the chain's next job {successor} is cancelled" in jobs_log


def test_a_job_warned_before_its_time_limit_checkpoints_stops_in_time_and_its_successor_resumes(cluster, submitted):
    """Slurm's own walltime path, end to end. slurmctld checks limits every 30 s (PERIODIC_TIMEOUT): it sends the
    --signal=B:USR1@N warning to the batch shell at the first check within N + 30 s of the end (job_mgr.c,
    send_job_warn_signal). The batch shell's trap then sends the drill's step SIGTERM with scancel --signal=TERM
    (the launch's own step, not the batch step: scancel.1); the ranks write their checkpoint and exit, tuning.py is held
    back (no failure), and the job ends before the limit. Waiting for the limit instead leaves the ranks only
    KillWait between Slurm's TERM and its KILL (the next test). The chained successor resumes from the checkpoint to
    the uninterrupted result."""
    job_id, out = submitted["time-limit"]
    fields, log, run = finished(cluster, submitted, "time-limit", timeout=300)
    lines = log.splitlines()

    def first(text: str) -> int:
        return next((i for i, line in enumerate(lines) if text in line), -1)

    # the warning, in the batch shell while the drill ran: N to N + 30 s before the limit; the trap signals the step
    warned = first("walltime warning from Slurm (USR1) at ")
    assert warned >= 0 and "fault_drill.py's ranks get SIGTERM now (scancel --signal=TERM" in lines[warned], log[-4000:]
    left = int(lines[warned].split(" s before the time limit")[0].rsplit(", ", 1)[1])
    assert WARNING - 2 <= left <= WARNING + PERIODIC_TIMEOUT + 2, lines[warned]
    # then the ranks' checkpoint on that TERM, and the job ends before the limit: no time-out, no SIGKILL
    saved = first("SIGTERM: stopped after step ")
    assert saved > warned, log[-4000:]
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-4000:]
    assert "DUE TO TIME LIMIT" not in log and "forcing job termination" not in log, log[-4000:]
    stopped = json.loads((run / "fault_drill.json").read_text())
    assert stopped["extra"]["stopped_by"] == "signal" and all(c["passed"] for c in stopped["checks"]), stopped
    # the report: the drill was stopped by the warning and tuning.py held back by it, neither a failure
    summary = (run / "summary.txt").read_text().splitlines()
    assert "  not-launched tuning.py (walltime warning)" in summary, summary
    assert any(" fault_drill.py " in line and line.endswith("(walltime warning)") for line in summary), summary
    assert not any("FAILED" in line or "time limit" in line for line in summary), summary
    assert "distlab: not launched tuning.py: Slurm's walltime warning (USR1) came" in lines, log[-4000:]
    # the successor (sbatch --dependency=afterany) resumes from the drill's checkpoint and completes the run
    successor = chain_next(log)
    assert successor, log[-4000:]
    after = cluster.wait(successor, timeout=660)
    after_log = (out / f"distlab-12-ops.o{successor}").read_text()
    assert (after["JobState"], after["ExitCode"]) == ("COMPLETED", "0:0"), after_log[-4000:]
    checkpoint = out / "drill" / f"step_{stopped['extra']['checkpoint_step']:06d}"
    assert f"resuming from {checkpoint} " in after_log, after_log[-4000:]
    after_run = Path(next(line.split("run directory ")[1] for line in after_log.splitlines()
                          if "run directory " in line))
    metrics = json.loads((after_run / "fault_drill.json").read_text())
    assert all(c["passed"] for c in metrics["checks"]) and not metrics["extra"].get("stopped_by"), metrics["checks"]
    assert any(c["name"] == "losses over all attempts = uninterrupted single device" for c in metrics["checks"])


def test_a_job_that_reaches_its_time_limit_saves_within_killwait_times_out_and_its_successor_resumes(cluster,
                                                                                                      submitted):
    """No warning asked: the limit comes while the drill trains. slurmctld finds it at its next 30 s check and times
    the job out (job_mgr.c, job_time_limit: "Time limit exhausted", _job_timed_out, JobState TIMEOUT); slurmd then
    logs "*** JOB N ON n1 CANCELLED AT ... DUE TO TIME LIMIT ***" in every step (SIG_TIME_LIMIT: slurmstepd
    req.c), sends TERM to the ranks' step (_rpc_timelimit), then SIGCONT and TERM to every step, the batch shell's
    included (_rpc_terminate_job), and KILL to what is left KillWait later. The job's srun, TERMed, prints "forcing
    job termination" and asks the controller to SIGKILL its step, which refuses, the job being TIMEOUT already
    (step_launch.c:728-731, stepmgr.c:633-636, job_mgr.c:9856). So the drill's
    ranks end their step and write a checkpoint within KillWait; the batch shell's trap says so, names the time
    limit, and launches nothing more; the successor resumes from that checkpoint to the uninterrupted result."""
    kill_wait = cluster.kill_wait  # tests/slurm/conftest.py's KillWait
    job_id, out = submitted["limit-reached"]
    fields, log, run = finished(cluster, submitted, "limit-reached", timeout=300)
    assert (fields["JobState"], fields["Reason"]) == ("TIMEOUT", "TimeLimit"), log[-4000:]
    assert "walltime warning" not in log, log[-4000:]
    # the time limit, as slurmd's stepd logs it in the batch step (the job's output), then the trap's line
    cancelled = next((line for line in log.splitlines() if f"*** JOB {job_id} ON n1 CANCELLED AT " in line), "")
    assert cancelled.endswith(" DUE TO TIME LIMIT ***"), log[-4000:]
    at = datetime.fromisoformat(cancelled.split(" CANCELLED AT ")[1].split()[0]).timestamp()
    assert (f"distlab: SIGTERM at the time limit: fault_drill.py's ranks stop at the end of their step and write a "
            f"checkpoint if they finish before the KILL, {kill_wait} s after the TERM (KillWait); nothing more is "
            f"launched") in log, log[-4000:]
    # what the ranks did on that TERM: their step ended, every rank agreed, and the checkpoint was written before the
    # KILL (stopped.json is written after it, by rank 0)
    stopped = json.loads((run / "fault_drill.json").read_text())
    assert stopped["extra"]["stopped_by"] == "signal" and all(c["passed"] for c in stopped["checks"]), stopped
    step = stopped["extra"]["checkpoint_step"]
    drill = out / "drill"
    assert (drill / f"step_{step:06d}").is_dir()  # the latest then: the successor resumes from it (below)
    saved = json.loads((drill / "stopped.json").read_text())
    assert saved["step"] == step and at - 1 <= saved["time"] <= at + kill_wait + 1, (cancelled, saved)
    # the job's own report names the time limit: no FAILED, no plain SIGTERM, in the summary or the job's lines
    summary = (run / "summary.txt").read_text().splitlines()
    assert "  not-launched tuning.py (time limit)" in summary, summary
    assert any(line.startswith("  stopped(") and " fault_drill.py " in line and line.endswith("(time limit)")
               for line in summary), summary
    assert not any("FAILED" in line or "SIGTERM" in line for line in summary), summary
    assert "distlab: not launched tuning.py: the job reached its time limit (SIGTERM)" in log
    assert not [line for line in log.splitlines() if line.startswith(("distlab: FAILED", "distlab: SIGTERM:"))], log
    # the successor (sbatch --dependency=afterany) resumes from the checkpoint written at the limit and completes
    successor = chain_next(log)
    assert successor, log[-4000:]
    after = cluster.wait(successor, timeout=300)
    after_log = (out / f"distlab-12-ops.o{successor}").read_text()
    assert (after["JobState"], after["ExitCode"]) == ("COMPLETED", "0:0"), after_log[-4000:]
    assert f"resuming from {drill / f'step_{step:06d}'} " in after_log, after_log[-4000:]
    after_run = Path(next(line.split("run directory ")[1] for line in after_log.splitlines()
                          if "run directory " in line))
    metrics = json.loads((after_run / "fault_drill.json").read_text())
    assert all(c["passed"] for c in metrics["checks"]) and not metrics["extra"].get("stopped_by"), metrics["checks"]
    assert any(c["name"] == "losses over all attempts = uninterrupted single device" for c in metrics["checks"])


@pytest.mark.parametrize("name, line", [
    ("tasks-not-gpus", "distlab: error: --ntasks-per-node=1 but 2 GPU(s) a node: one task a GPU, ask --ntasks-per-node=2"),
    ("ranks-do-not-fit", "distlab: error: 3 ranks do not fit 2 node(s) x 2 GPUs"),
    ("demo-one-node", "distlab: error: the demo shows 2 nodes; this job has 1"),
])
def test_bad_input_ends_the_job_with_one_line_exit_2_and_nothing_queued(cluster, submitted, name, line):
    fields, log, _ = finished(cluster, submitted, name)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0"), log[-3000:]
    errors = [ln for ln in log.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith(line), log[-3000:]
    assert "Traceback" not in log
    assert cluster.run(["squeue", "-h", "-n", fields["JobName"]]).stdout.strip() == ""


def test_an_unknown_partition_is_refused_at_submission_with_one_line(cluster, tmp_path):
    words = [*SHAPE, "-p", "nosuch", "-o", str(tmp_path / "x.out"), str(SLURM_DIR / "04_data_parallel.sbatch")]
    # the course's submission checks the partition with sinfo first: one line that says what to change, exit 2
    checked = submit(cluster, *words, **settings(tmp_path / "run"))
    assert checked.returncode == 2 and checked.stdout == "", checked.stderr
    assert checked.stderr.splitlines() == ["distlab: error: partition 'nosuch' does not exist on this cluster "
                                           "(sinfo -s lists them): pass -p <partition>, or export "
                                           "SBATCH_PARTITION=<partition>"]
    # plain sbatch refuses it too, with its own line and exit 1
    with pytest.raises(RuntimeError, match=r"sbatch: error: invalid partition specified: nosuch"):
        cluster.sbatch(*words, cwd=ROOT, **settings(tmp_path / "run"))
    assert cluster.run(["squeue", "-h"]).stdout.count("nosuch") == 0

