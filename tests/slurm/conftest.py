"""The Slurm tier: one real two-node Slurm cluster (coursetools.slurm_cluster) for the whole session."""

from __future__ import annotations

import pytest

from coursetools.slurm_cluster import SlurmCluster, SlurmUnavailable

# KillWait: the seconds between the time limit's SIGTERM and its SIGKILL (slurm.conf.5: 30 by default; slurmd waits
# at least 5: MAX(kill_wait, 5) in _rpc_terminate_job). The limit-reached job's ranks end a 3 s step and write their
# checkpoint within it. Half a site's default, it keeps scancel's wait in the tests short.
KILL_WAIT = 15


@pytest.fixture(scope="session")
def cluster():
    """slurmctld, munged and two slurmd (n1, n2), started once; stopped by their PIDs when the session ends."""
    slurm = SlurmCluster(kill_wait=KILL_WAIT)
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
