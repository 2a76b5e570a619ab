"""Fixtures of the PBS job tests: the environment of a fake PBS job."""

from __future__ import annotations

import os
import sys

import pytest
from pbs_helpers import LEAKY_PREFIXES, ROOT, tool, write_nodefile


@pytest.fixture
def job_env(tmp_path):
    """Environment of a fake 2-node PBS job (dec0001, dec0002; 4 GPUs each); tests adjust it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKY_PREFIXES)}
    env.update(
        PBS_NODEFILE=str(write_nodefile(tmp_path / "nodefile", ["dec0001", "dec0002"], 4)),
        PBS_JOBID="4242.desched1",
        PBS_O_WORKDIR=str(ROOT),
        DISTLAB_RUN_DIR=str(tmp_path / "run"),
        DISTLAB_RUN_DIR_REUSE="1",  # tests run jobs again in one folder; test_pbs_common checks the refusal
        DISTLAB_SITE_SCRATCH=str(tmp_path / "no-site-scratch"),
        DISTLAB_MODULES="",
        DISTLAB_CONDA_ENV="",
        DISTLAB_PREFLIGHT="0",
        DISTLAB_PYTHON=sys.executable,
        DISTLAB_MPIEXEC=tool("mpiexec") or "mpiexec",
        DISTLAB_DEVICE="cpu",
        DISTLAB_PRESET="tiny",
    )
    return env


@pytest.fixture
def fake_pals(tmp_path):
    """A stand-in for Cray PALS's mpiexec, found by its path, for jobs that are only printed (dry runs)."""
    folder = tmp_path / "opt" / "cray" / "pals" / "1.2" / "bin"
    folder.mkdir(parents=True)
    fake = folder / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec version 1.2.12'\n")
    fake.chmod(0o755)
    return str(fake)
