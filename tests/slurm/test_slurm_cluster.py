"""Jobs under a real Slurm cluster: two nodes (n1, n2) on this machine, submitted with sbatch -N 2 and read back.

The jobs are submitted at once at the start (the cluster runs them side by side) and each test waits for its own.
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

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "tests" / "pbs" / "job_probe.py"
DEADLOCKS = ROOT / "scripts" / "12_hpc_operations" / "deadlocks.py"


def write_job(folder: Path, name: str, body: str) -> Path:
    path = folder / f"{name}.sbatch"
    path.write_text("#!/bin/bash\n" + textwrap.dedent(body))
    return path


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """Every job of this module, submitted before any test waits: {name: (job id, its folder)}."""
    folder = tmp_path_factory.mktemp("slurm_jobs")
    env = {"MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PY": sys.executable}
    submitted = {}
    # one task a rank, two a node: distlab.runtime reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID
    tasks = write_job(folder, "tasks", f"""\
        srun "$PY" {PROBE} --device cpu --metrics-out "$OUT/probe.json"
        """)
    # one torchrun agent a node, c10d rendezvous on the first node, two workers each
    agents = write_job(folder, "agents", f"""\
        port=$((20000 + SLURM_JOB_ID % 12000))
        srun --nodes=2 --ntasks=2 --ntasks-per-node=1 bash -c 'exec "$PY" -m torch.distributed.run --nnodes=2 --nproc-per-node=2 \\
            --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:'$port' --rdzv-id=$SLURM_JOB_ID \\
            --rdzv-conf=is_host=$((SLURM_NODEID == 0)) {PROBE} --device cpu --metrics-out "$OUT/probe.json"'
        """)
    # a real hang (the last rank skips a barrier) with a process-group timeout far away: only scancel ends it,
    # and each rank must leave its journal and its flight recorder in the run folder
    hung = write_job(folder, "hung", f"""\
        srun "$PY" {DEADLOCKS} --device cpu --hang skipped-barrier --pg-timeout 300 --trace-dir "$OUT/trace"
        """)
    for name, script, args in (("tasks", tasks, ["--ntasks-per-node=2"]), ("agents", agents, ["--ntasks-per-node=2"]),
                               ("hung", hung, ["--ntasks-per-node=2"])):
        out = folder / name
        out.mkdir()
        job = cluster.sbatch("-N", "2", *args, "-o", str(out / "slurm-%j.out"), "-J", name, str(script),
                             cwd=ROOT, OUT=str(out), **env)
        submitted[name] = (job, out)
    yield submitted


def probe_ranks(cluster, job, out: Path) -> list[dict]:
    fields = cluster.wait(job, timeout=120)
    log = "".join(p.read_text() for p in out.glob("slurm-*.out"))
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log[-3000:]
    metrics = json.loads((out / "probe.json").read_text())
    assert metrics["checks"] and all(c["passed"] for c in metrics["checks"]), metrics["checks"]
    return metrics["extra"]["ranks"]


def test_one_task_a_rank_reads_slurms_variables_on_both_nodes(cluster, jobs):
    ranks = probe_ranks(cluster, *jobs["tasks"])
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    assert {r["launcher"] for r in ranks} == {"slurm"}
    assert sorted((r["node"], r["local_rank"]) for r in ranks) == [("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]


def test_one_torchrun_agent_a_node_with_c10d_rendezvous(cluster, jobs):
    ranks = probe_ranks(cluster, *jobs["agents"])
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    assert {r["launcher"] for r in ranks} == {"torchrun"} and {r["local_world_size"] for r in ranks} == {2}


def test_a_hung_job_cancelled_with_scancel_leaves_its_journals_and_flight_recorder(cluster, jobs):
    import time

    job, out = jobs["hung"]
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
