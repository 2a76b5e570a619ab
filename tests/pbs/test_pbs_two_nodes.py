"""A two-node PBS job, end to end, on one machine: a real MPICH mpiexec (Hydra) runs the job's ranks.

The fake PBS_NODEFILE names two hosts that both resolve to this machine ("localhost" and "127.0.0.1"),
2 lines each as PBS writes them for mpiprocs=2. `-launcher fork` makes Hydra start every rank locally,
yet it places them as on two nodes: ranks 0,1 on the first "node", 2,3 on the second, local ranks 0,1,0,1.
The job runs unchanged: pbs/common.sh reads the nodes, picks MASTER_ADDR, builds the mpiexec (or
mpiexec + torchrun) command; the ranks find each other through distlab.runtime and talk over gloo.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from pbs_helpers import PBS_DIR, ROOT, run_bash, tool, write_nodefile

from helpers import forkexec_settings

from distlab.runtime import free_port

PROBE_JOB = ROOT / "tests" / "pbs" / "probe.pbs"
LAUNCH_TIMEOUT_S = 60  # inside the job (DISTLAB_LAUNCH_TIMEOUT); the test's own limit is above it


@pytest.fixture
def two_nodes(job_env, tmp_path):
    mpiexec = tool("mpiexec")
    if mpiexec is None or "HYDRA" not in run_bash([mpiexec, "--version"], job_env).output:
        pytest.skip("needs MPICH's mpiexec (pip install mpich)")
    write_nodefile(tmp_path / "nodefile", ["localhost", "127.0.0.1"], 2)
    return job_env | {
        "DISTLAB_MPIEXEC": mpiexec,
        "DISTLAB_MPIEXEC_ARGS": "-launcher fork",
        "DISTLAB_GPUS_PER_NODE": "2",
        "DISTLAB_DEVICE": "cpu",
        "DISTLAB_PRESET": "tiny",
        "DISTLAB_LAUNCH_TIMEOUT": str(LAUNCH_TIMEOUT_S),
        "DISTLAB_MASTER_PORT": str(free_port()),  # tests may run beside other jobs on this machine
        # each rank forked from make test's fork server (torch imported once); the preflight job below keeps the
        # real interpreter, so one job of the tier starts its ranks exactly as a site does
        **forkexec_settings(),
    }


def run_job(job: Path, env: dict):
    start = time.monotonic()
    result = run_bash(["bash", str(job)], env, timeout=LAUNCH_TIMEOUT_S + 30)
    return result, time.monotonic() - start


def ranks_of(run_dir: Path) -> list[dict]:
    metrics = json.loads((run_dir / "probe.json").read_text())
    assert metrics["world_size"] == 4
    assert metrics["checks"] and all(c["passed"] for c in metrics["checks"]), metrics["checks"]
    return sorted(metrics["extra"]["ranks"], key=lambda r: r["rank"])


def test_mpiexec_job_on_two_nodes(two_nodes, tmp_path):
    env = two_nodes
    result, _ = run_job(PROBE_JOB, env)
    assert result.returncode == 0, result.output
    run = tmp_path / "run"
    ranks = ranks_of(run)
    assert [r["launcher"] for r in ranks] == ["mpich"] * 4  # PMI_RANK / PMI_SIZE / MPI_LOCALRANKID
    assert [r["node"] for r in ranks] == ["localhost", "localhost", "127.0.0.1", "127.0.0.1"]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["local_world_size"] for r in ranks] == [2] * 4  # MPI_LOCALNRANKS
    assert {r["master_addr"] for r in ranks} == {"localhost"}  # first host of PBS_NODEFILE
    assert {r["master_port"] for r in ranks} == {env["DISTLAB_MASTER_PORT"]}
    assert (run / "hosts.txt").read_text() == "localhost\n127.0.0.1\n"
    assert "-n 4 -ppn 2 -f" in (run / "commands.sh").read_text()
    assert "ok job_probe.py" in (run / "summary.txt").read_text()
    assert "checks: 2/2 passed" in (run / "logs" / "01_job_probe.log").read_text()


def test_torchrun_job_on_two_nodes(two_nodes, tmp_path):
    result, _ = run_job(PROBE_JOB, two_nodes | {"DISTLAB_LAUNCHER": "torchrun"})
    assert result.returncode == 0, result.output
    ranks = ranks_of(tmp_path / "run")
    assert [r["launcher"] for r in ranks] == ["torchrun"] * 4
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["local_world_size"] for r in ranks] == [2] * 4
    # One agent per node, each with 2 workers: consecutive ranks share a node. Which node gets ranks 0,1 is
    # torch's choice (c10d rendezvous sorts the agents), not necessarily the first host.
    nodes = [r["node"] for r in ranks]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and {nodes[0], nodes[2]} == {"localhost", "127.0.0.1"}
    assert "torch.distributed.run --nnodes=2 --nproc-per-node=2" in (tmp_path / "run" / "commands.sh").read_text()


def test_a_rank_that_stops_fails_the_job_quickly(two_nodes, tmp_path):
    """--device cuda on a CPU machine: every rank stops with exit code 2; mpiexec and the job end, no hang."""
    result, seconds = run_job(PROBE_JOB, two_nodes | {"DISTLAB_DEVICE": "cuda"})
    assert result.returncode == 1, result.output
    assert "config error" in result.output and "no CUDA GPU" in result.output
    assert "FAILED" in (tmp_path / "run" / "summary.txt").read_text()
    assert seconds < LAUNCH_TIMEOUT_S


def test_chapter_job_on_two_nodes(two_nodes, tmp_path):
    """The real chapter 03 job, running the real collectives script on 2 nodes x 2 ranks."""
    script = ROOT / "scripts" / "03_communication" / "collectives.py"
    if not script.exists():
        pytest.skip(f"{script.relative_to(ROOT)} is not written yet")
    result, _ = run_job(PBS_DIR / "03_communication.pbs", two_nodes | {"DISTLAB_ONLY": "collectives.py"})
    assert result.returncode == 0, result.output
    metrics = json.loads((tmp_path / "run" / "collectives.json").read_text())
    assert metrics["world_size"] == 4
    assert metrics["checks"] and all(c["passed"] for c in metrics["checks"]), metrics["checks"]
    assert "skip bandwidth.py" in result.output


def test_checkpoint_round_trip_job_on_two_nodes(two_nodes, tmp_path):
    """The real chapter 05 job: checkpoint on 2 nodes x 2 ranks, interrupt, resume, reload on half the ranks."""
    result, _ = run_job(PBS_DIR / "05_fully_sharded.pbs", two_nodes | {"DISTLAB_ONLY": "checkpoint_resume.py"})
    assert result.returncode == 0, result.output
    run = tmp_path / "run"
    worlds = {}
    for name in ("checkpoint_interrupted", "checkpoint_resumed", "checkpoint_tiny_saved", "checkpoint_resharded"):
        metrics = json.loads((run / f"{name}.json").read_text())
        assert metrics["checks"] and all(c["passed"] for c in metrics["checks"]), (name, metrics["checks"])
        worlds[name] = metrics["world_size"]
    assert worlds == {"checkpoint_interrupted": 4, "checkpoint_resumed": 4, "checkpoint_tiny_saved": 4,
                      "checkpoint_resharded": 2}


def test_preflight_job_on_two_nodes(two_nodes, tmp_path):
    """pbs/preflight.pbs end to end with the real mpiexec: the rank map and the bandwidth script (DISTLAB_ONLY keeps
    it short; test_pbs_job_files checks that the full list covers every script), then its table."""
    env = two_nodes | {"DISTLAB_ONLY": "distlab.runtime:bandwidth.py", "PREFLIGHT_BW_MAX_BYTES": "64K",
                       "DISTLAB_PYTHON": sys.executable}   # the real interpreter a rank (the fixture's forks the rest)
    result, _ = run_job(PBS_DIR / "preflight.pbs", env)
    assert result.returncode == 0, result.output
    run = tmp_path / "run"
    table = (run / "preflight.txt").read_text()
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.endswith(("cpu", "-"))}
    # script, result, checks passed of all, step time, bus bandwidth, device: read back from the metrics files
    rank_map = json.loads((run / "rank_map.json").read_text())
    assert rows["rank"][2:4] == ["ok", f"{len(rank_map['checks'])}/{len(rank_map['checks'])}"]
    bandwidth = json.loads((run / "bandwidth.json").read_text())
    checks = f"{len(bandwidth['checks'])}/{len(bandwidth['checks'])}"
    busbw = max(r["busbw"] for r in bandwidth["extra"]["bandwidth"] if r["collective"] == "all_reduce")
    assert rows["bandwidth.py"][1:3] == ["ok", checks] and rows["bandwidth.py"][4:6] == [f"{busbw / 1e9:.3g}", "GB/s"]
    # where each rank ran: two "nodes", local ranks 0,1 on each, no GPU
    placements = [ln.strip() for ln in table.splitlines() if ln.strip().startswith("host ")]
    assert placements == [f"host {host}  rank {rank}  local rank {rank % 2}  CUDA_VISIBLE_DEVICES=(unset)  uses cpu"
                          for rank, host in enumerate(["localhost", "localhost", "127.0.0.1", "127.0.0.1"])]
    assert "NCCL transport: none reported" in table  # gloo on CPUs: no NCCL communicator
    assert "skip train_baseline.py" in result.output
    summary = (run / "summary.txt").read_text()
    assert "ok distlab.runtime" in summary and "ok bandwidth.py" in summary and "NCCL transport" in summary
