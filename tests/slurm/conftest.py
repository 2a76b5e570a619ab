"""The Slurm tier: one real two-node Slurm cluster (coursetools.slurm_cluster) for the whole session."""

from __future__ import annotations

import pytest

from coursetools.slurm_cluster import SlurmCluster, SlurmUnavailable


@pytest.fixture(scope="session")
def cluster():
    """slurmctld, munged and two slurmd (n1, n2), started once; stopped by their PIDs when the session ends."""
    slurm = SlurmCluster()
    try:
        slurm.start()
    except SlurmUnavailable as exc:
        slurm.stop()
        pytest.skip(str(exc))
    except BaseException:
        slurm.stop()
        raise
    yield slurm
    slurm.stop()
