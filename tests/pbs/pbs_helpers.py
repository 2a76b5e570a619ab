"""Helpers of the PBS job tests: paths, a fake PBS_NODEFILE, and bash runs that cannot hang."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PBS_DIR = ROOT / "pbs"
CHAPTER_JOBS = sorted(PBS_DIR.glob("[0-9][0-9]_*.pbs"))
PREFLIGHT_JOB = PBS_DIR / "preflight.pbs"
ALL_JOBS = CHAPTER_JOBS + [PBS_DIR / "jupyterlab.pbs", PREFLIGHT_JOB, ROOT / "tests" / "pbs" / "probe.pbs"]
BIN = Path(sys.executable).parent


def tool(name: str) -> str | None:
    """A tool of this virtualenv (mpiexec, shellcheck), else one on PATH."""
    candidate = BIN / name
    return str(candidate) if candidate.exists() else shutil.which(name)


def shellcheck_warnings(shellcheck: str, root: Path, common: list[str], jobs: list[str]) -> list[str]:
    """shellcheck's warnings, one line each: the common files with -x (each follows what it sources), the job files
    each on its own. -x on a job file would re-read and re-check jobs/common.sh for every job file (1.4 CPU s a job
    file, about 24 s a tier on a loaded machine) for one difference: on its own, a job file that sets a variable
    only the common files read gets SC2034 ("appears unused"). That finding is dropped when a common file reads the
    name; every other finding stays."""
    import json
    read_in_common = "\n".join((root / name).read_text() for name in common)
    found = []
    for options, files in ((["-x"], common), ([], jobs)):
        result = subprocess.run([shellcheck, *options, "--severity=warning", "--format=json1", *files], cwd=root,
                                capture_output=True, text=True, timeout=300)  # a hang's guard: loaded, over 60 s
        assert result.returncode in (0, 1) and result.stdout, result.stderr  # 1: it found something
        for c in json.loads(result.stdout)["comments"]:
            name = c["message"].split()[0]
            if (files is jobs and c["code"] == 2034
                    and re.search(r"\$\{?" + re.escape(name) + r"\b", read_in_common)):
                continue
            found.append(f"{c['file']}:{c['line']}: SC{c['code']} ({c['level']}): {c['message']}")
    return found


# Variables that would leak from the shell running the tests into the fake job.
LEAKY_PREFIXES = ("PBS_", "DISTLAB_", "NCCL_", "FI_", "MASTER_", "PMI_", "PALS_", "OMPI_", "SLURM_",
                  "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MPICH_", "TORCHELASTIC_", "PET_",
                  "OMP_NUM_THREADS", "CONDA_DEFAULT_ENV", "GLOO_", "SCRATCH", "CONDA_PREFIX", "LD_LIBRARY_PATH")


@dataclass
class BashResult:
    returncode: int
    output: str

    def lines(self) -> list[str]:
        return self.output.splitlines()

    def values(self) -> dict[str, str]:
        """NAME=value lines printed by the snippet."""
        return dict(ln.split("=", 1) for ln in self.lines() if "=" in ln and ln.split("=", 1)[0].isidentifier())


def run_bash(command: list[str] | str, env: dict, timeout: float = 30) -> BashResult:
    """Run bash in the repository root in its own process group; on timeout kill the whole group."""
    argv = ["bash", "-c", command] if isinstance(command, str) else command
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{argv} did not finish in {timeout} s:\n{output[-4000:]}")
    return BashResult(proc.returncode, output)


def write_nodefile(path: Path, hosts: list[str], per_node: int) -> Path:
    """A PBS_NODEFILE as PBS Pro writes it: each host repeated mpiprocs times, hosts in order."""
    path.write_text("".join(f"{host}\n" * per_node for host in hosts))
    return path
