"""The Slurm test cluster itself: it stops every daemon it started, even when its owner dies; a hung job is ended by
scancel and leaves its evidence. (The course's own jobs under it: test_slurm_jobs.py; one task a rank and one
torchrun agent a node are proven there, by the chapter jobs and by the fault drill.)

The node names do not resolve here, so each job is given MASTER_ADDR=127.0.0.1 (shared/SLURM_NOTES.md, gotchas).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from coursetools.slurm_cluster import SlurmCluster
from helpers import slurm_task_settings

ROOT = Path(__file__).resolve().parents[2]
DEADLOCKS = ROOT / "scripts" / "12_hpc_operations" / "deadlocks.py"


def write_job(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.sbatch"
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    return path


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Every job of this module, submitted before any test waits: {name: (job id, its folder)}."""
    folder = tmp_path_factory.mktemp("slurm_jobs")
    # each rank forks from make test's fork server (its wrapper standing in for the task's tree: helpers.py)
    task = slurm_task_settings()
    env = {"MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PY": task["DISTLAB_PYTHON"],
           **task}
    submitted = {}
    # a real hang (the last rank skips a barrier) with a process-group timeout far away: only scancel ends it,
    # and each rank must leave its journal and its flight recorder in the run folder
    hung = write_job(folder, "hung", f"""\
        srun "$PY" {DEADLOCKS} --device cpu --hang skipped-barrier --pg-timeout 300 --trace-dir "$OUT/trace"
        """)
    for name, script, args in (("hung", hung, ["--ntasks-per-node=2"]),):
        out = folder / name
        out.mkdir()
        job = cluster.sbatch("-N", "2", *args, "-o", str(out / "slurm-%j.out"), "-J", name, str(script),
                             cwd=ROOT, OUT=str(out), **env)
        submitted[name] = (job, out)
    yield submitted


def test_a_hung_job_cancelled_with_scancel_leaves_its_journals_and_flight_recorder(cluster, jobs):
    import time

    job, out = jobs["hung"]
    # the cluster numbers its jobs from a random start: the jobs derive MASTER_PORT from their id, and two test
    # clusters on one machine counting from 1 gave two jobs one port at once (EADDRINUSE)
    assert int(job) >= 1_000_000, job
    journals = out / "trace" / "journals"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # hung: every rank has a journal and one waits in a call
        found = [json.loads(p.read_text()) for p in journals.glob("rank_*.json")] if journals.is_dir() else []
        if len(found) == 4 and any(j["calls"] and not j["calls"][-1]["done"] for j in found):
            break
        time.sleep(0.5)
    time.sleep(1)
    cluster.run(["scancel", job])
    fields = cluster.wait(job, timeout=60)
    assert fields["JobState"] == "CANCELLED"
    left = {int(p.stem.split("_")[1]): json.loads(p.read_text()) for p in journals.glob("rank_*.json")}
    assert sorted(left) == [0, 1, 2, 3] and {j["state"] for j in left.values()} == {"cancelled"}
    stuck = [r for r, j in left.items() if not j["calls"][-1]["done"]]
    assert stuck, left  # the journals show the hang: ranks stuck in a call
    from distlab import hangs
    assert hangs.diagnose(left)["cause"] == "skipped collective"  # read from the files the job left
    assert sorted(p.name for p in (out / "trace" / "manual").iterdir()) == [f"trace_rank_{r}" for r in range(4)]


def test_the_cluster_stops_every_daemon_it_started():
    with SlurmCluster() as own:
        pids = [p.pid for p in own.processes.values()]
        assert len(pids) == 4  # munged, slurmctld, two slurmd
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert signal  # (imported for readers who stop a cluster by hand: kill -TERM <pid>, never pkill)


def test_a_killed_owner_leaves_no_daemon():
    # a test run cut short (SIGKILL, a timeout): the watcher started with the cluster stops its daemons by PID
    import subprocess
    import time

    owner = subprocess.Popen([sys.executable, "-c", "from coursetools.slurm_cluster import SlurmCluster\n"
                              "c = SlurmCluster(); c.start()\n"
                              "print(' '.join(str(p.pid) for p in c.processes.values()), flush=True)\n"
                              "import time; time.sleep(120)"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pids = [int(pid) for pid in owner.stdout.readline().split()]
    assert len(pids) == 4
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            break
        time.sleep(0.2)
    assert not alive
