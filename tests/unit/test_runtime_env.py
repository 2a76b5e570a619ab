"""Launcher environment parsing, one launcher at a time, from the variables each one really sets."""

import pytest

from distlab.runtime import ConfigError, expand_hostlist, launcher_env, pick_device


def test_alone_is_a_world_of_one():
    env = launcher_env({})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("single", 0, 1, 0)
    assert env.master_addr == "127.0.0.1"


def test_torchrun():
    env = launcher_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                        "MASTER_ADDR": "dec0001", "MASTER_PORT": "29400"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("torchrun", 5, 8, 1, 4)
    assert (env.master_addr, env.master_port) == ("dec0001", 29400)


def test_cray_pals_multi_node_reads_pbs_nodefile():
    nodefile = "dec0007.hsn.de.hpc.ucar.edu\n" * 4 + "dec0008.hsn.de.hpc.ucar.edu\n" * 4
    env = launcher_env({"PALS_RANKID": "6", "PALS_LOCAL_RANKID": "2", "PMI_RANK": "6", "PMI_SIZE": "8",
                        "PALS_LOCAL_SIZE": "4", "PBS_NODEFILE": "/var/spool/pbs/aux/123",
                        "PBS_JOBID": "123.desched1"}, read_file=lambda path: nodefile)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("pals", 6, 8, 2, 4)
    assert env.master_addr == "dec0007.hsn.de.hpc.ucar.edu"
    again = launcher_env({"PALS_RANKID": "0", "PMI_SIZE": "8", "PALS_LOCAL_SIZE": "4",
                          "PBS_NODEFILE": "x", "PBS_JOBID": "123.desched1"}, read_file=lambda path: nodefile)
    assert again.master_port == env.master_port, "every rank of one job must derive the same port"
    assert 20000 <= env.master_port < 40000


def test_mpich_hydra():
    env = launcher_env({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("mpich", 3, 4, 1, 2)


def test_openmpi():
    env = launcher_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("openmpi", 2, 4, 2)
    assert env.master_addr == "127.0.0.1"  # single node: everything local


def test_slurm_finds_master_in_nodelist():
    env = launcher_env({"SLURM_PROCID": "4", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0",
                        "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[012-013]",
                        "SLURM_JOB_ID": "777"})
    assert (env.launcher, env.rank, env.world_size, env.local_world_size) == ("slurm", 4, 8, 4)
    assert env.master_addr == "gpu012"


def test_multi_node_without_master_is_a_config_error():
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        launcher_env({"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALNRANKS": "4"})


def test_rank_outside_world_is_a_config_error():
    with pytest.raises(ConfigError, match="outside"):
        launcher_env({"RANK": "4", "WORLD_SIZE": "4"})


def test_non_integer_is_a_config_error():
    with pytest.raises(ConfigError, match="not an integer"):
        launcher_env({"RANK": "zero", "WORLD_SIZE": "4"})


@pytest.mark.parametrize("hostlist, hosts", [
    ("dec0001", ["dec0001"]),
    ("dec[0001-0003]", ["dec0001", "dec0002", "dec0003"]),
    ("gpu[1,3-4],login1", ["gpu1", "gpu3", "gpu4", "login1"]),
])
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_pick_device():
    assert pick_device("auto", 0, False, 0) == ("cpu", "gloo")
    assert pick_device("cpu", 3, True, 4) == ("cpu", "gloo")
    assert pick_device("auto", 5, True, 4) == ("cuda:1", "cuda:nccl,cpu:gloo")
    with pytest.raises(ConfigError, match="no CUDA GPU"):
        pick_device("cuda", 0, False, 0)
