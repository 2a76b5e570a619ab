"""The Slurm tier: one real two-node Slurm cluster (coursetools.slurm_cluster) for the whole session."""

from __future__ import annotations

import pytest

from coursetools.slurm_cluster import SlurmCluster, SlurmUnavailable

# KillWait: the seconds between the time limit's SIGTERM and its SIGKILL (slurm.conf.5: 30 by default; slurmd waits
# at least 5: MAX(kill_wait, 5) in _rpc_terminate_job). The limit-reached job's ranks end a 3 s step, write their
# checkpoint and exit within it, and the batch shell then reports what it did not launch. Slurm's default: with 15 s,
# on CI's 2 loaded cores, the ranks saved in time but their agents and srun ended after the KILL, which took the
# batch shell before its last summary. A longer KillWait costs nothing when the ranks end sooner: the KILL goes only
# to what is left.
KILL_WAIT = 30


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
