"""Launcher environment parsing, one launcher at a time, from the variables each one really sets."""

import os

import pytest

from distlab.runtime import (ConfigError, expand_hostlist, format_placement, launcher_env, local_ranks_problems,
                             pick_device, placement, shared_gpus)


def test_alone_is_a_world_of_one():
    env = launcher_env({})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("single", 0, 1, 0)
    assert env.master_addr == "127.0.0.1"


def test_torchrun():
    env = launcher_env({"TORCHELASTIC_RUN_ID": "none", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "4",
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
    again = launcher_env({"PALS_RANKID": "0", "PALS_LOCAL_RANKID": "0", "PMI_SIZE": "8", "PALS_LOCAL_SIZE": "4",
                          "PBS_NODEFILE": "x", "PBS_JOBID": "123.desched1"}, read_file=lambda path: nodefile)
    assert again.master_port == env.master_port, "every rank of one job must derive the same port"
    assert 20000 <= env.master_port < 32000


def test_derived_ports_stay_below_the_ephemeral_range_as_the_pbs_jobs_do():
    # Linux hands out 32768-60999 to outgoing connections: a port derived there may already be taken on the node.
    # The Python rule and pbs/common.sh's (cksum) keep to 20000-31999.
    from distlab.runtime import _port_from_job_id

    ports = [_port_from_job_id(f"{n}.desched1") for n in range(2000)]
    assert min(ports) >= 20000 and max(ports) < 32768
    assert max(ports) > 31000  # the whole range is used, not a corner of it


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
        launcher_env({"PMI_RANK": "0", "PMI_SIZE": "8", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"})


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


# ---------------------------------------------------------------------------------------------------
# Local rank: the launcher's own variable, else another launcher's, else a config error on a shared node
# ---------------------------------------------------------------------------------------------------

PALS_WITHOUT_LOCAL_RANK = {"PALS_RANKID": "5", "PMI_RANK": "5", "PMI_SIZE": "8", "PALS_LOCAL_SIZE": "4",
                           "MASTER_ADDR": "dec0001"}


@pytest.mark.parametrize("fallback", ["MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK",
                                      "PMI_LOCAL_RANK"])
def test_pals_without_its_local_rank_falls_back_to_another_launchers(fallback):
    env = launcher_env(PALS_WITHOUT_LOCAL_RANK | {fallback: "1"})
    assert (env.launcher, env.rank, env.local_rank, env.local_world_size) == ("pals", 5, 1, 4)
    assert any(fallback in note and "PALS_LOCAL_RANKID" in note for note in env.notes), env.notes


def test_the_launchers_own_local_rank_wins_over_the_others():
    env = launcher_env(PALS_WITHOUT_LOCAL_RANK | {"PALS_LOCAL_RANKID": "2", "MPI_LOCALRANKID": "3", "LOCAL_RANK": "0"})
    assert env.local_rank == 2 and not any("local rank from" in note for note in env.notes)
    # torchrun's workers started by mpiexec inherit the agent's PALS variables: LOCAL_RANK still decides
    worker = launcher_env({"TORCHELASTIC_RUN_ID": "none", "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2",
                           "LOCAL_WORLD_SIZE": "4",
                           "PALS_RANKID": "1", "PALS_LOCAL_RANKID": "0", "PALS_LOCAL_SIZE": "1",
                           "MASTER_ADDR": "dec0001"})
    assert (worker.launcher, worker.local_rank, worker.local_world_size) == ("torchrun", 2, 4)


def test_no_local_rank_on_a_node_of_several_ranks_is_a_config_error():
    with pytest.raises(ConfigError, match="every rank would pick GPU 0") as error:
        launcher_env(PALS_WITHOUT_LOCAL_RANK)
    assert "PALS_LOCAL_RANKID" in str(error.value) and "MPI_LOCALRANKID" in str(error.value)
    # one rank per node: local rank 0 is the only possible one
    alone = launcher_env(PALS_WITHOUT_LOCAL_RANK | {"PALS_LOCAL_SIZE": "1"})
    assert alone.local_rank == 0


def test_local_rank_outside_the_node_is_a_config_error():
    with pytest.raises(ConfigError, match="outside 4 rank"):
        launcher_env(PALS_WITHOUT_LOCAL_RANK | {"PALS_LOCAL_RANKID": "4"})


# ---------------------------------------------------------------------------------------------------
# The per-rank placement report (--verbose, python -m distlab.runtime, the preflight job)
# ---------------------------------------------------------------------------------------------------


def where(host, rank, local_rank, gpu="NVIDIA A100-SXM4-40GB", index=None, bus=None):
    index = local_rank if index is None else index
    return {"host": host, "rank": rank, "local_rank": local_rank, "cuda_visible_devices": "0,1,2,3",
            "device": f"cuda:{index}", "gpu": gpu, "gpu_index": index, "bus_id": bus}


def test_placement_on_a_cpu_says_cpu():
    import torch

    got = placement(3, 1, torch.device("cpu"), env={"CUDA_VISIBLE_DEVICES": "2"}, host="dec0002")
    assert got == {"host": "dec0002", "rank": 3, "local_rank": 1, "cuda_visible_devices": "2", "device": "cpu",
                   "gpu": "cpu", "gpu_index": None, "bus_id": None, "cpus": sorted(os.sched_getaffinity(0)),
                   "gpu_numa_node": None, "gpu_numa_cpus": []}
    assert format_placement(got) == "host dec0002  rank 3  local rank 1  CUDA_VISIBLE_DEVICES=2  uses cpu"
    assert placement(0, 0, torch.device("cpu"), env={}, host="x")["cuda_visible_devices"] == "(unset)"
    assert placement(0, 0, torch.device("cpu"), env={"PMI_HOSTNAME": "fake-node-2"})["host"] == "fake-node-2"


def test_placement_line_of_a_gpu_rank():
    line = format_placement(where("dec0001", 5, 1, bus="0000:41:00.0"))
    assert line == ("host dec0001  rank 5  local rank 1  CUDA_VISIBLE_DEVICES=0,1,2,3  "
                    "uses GPU 1 (NVIDIA A100-SXM4-40GB, bus 0000:41:00.0)")


def test_two_ranks_on_one_gpu_of_a_node_are_found():
    good = [where("dec0001", r, r) for r in range(4)] + [where("dec0002", 4 + r, r) for r in range(4)]
    assert shared_gpus(good) == [] and local_ranks_problems(good) == []
    # the bug of a missing local rank: every rank of a node on GPU 0
    bad = [where("dec0001", r, 0, index=0) for r in range(4)] + [where("dec0002", 4, 0)]
    assert shared_gpus(bad) == ["ranks 0, 1, 2, 3 share GPU 0 on dec0001"]
    assert local_ranks_problems(bad) == ["dec0001: local ranks [0, 0, 0, 0], expected [0, 1, 2, 3]"]
    # one GPU per rank through CUDA_VISIBLE_DEVICES: every rank sees "GPU 0", the bus ids differ
    masked = [where("dec0001", r, r, index=0, bus=f"0000:{r:02x}:00.0") for r in range(4)]
    assert shared_gpus(masked) == []
    cpus = [dict(where("h", r, r), gpu="cpu") for r in range(2)] + [dict(where("h", 2, 2), gpu="cpu", gpu_index=0)]
    assert shared_gpus(cpus) == []  # CPU ranks share no GPU


# ---------------------------------------------------------------------------------------------------
# Probes of real launches (issue 45, item 10): each environment as that launcher sets it
# ---------------------------------------------------------------------------------------------------

# `srun -N 2 -n 8 --ntasks-per-node=4 --mpi=pmi2 python x.py`, task 5: Slurm's pmi2 plugin adds PMI_RANK (the
# global task id) and PMI_SIZE (the step's tasks) to srun's own variables (slurm src/plugins/mpi/pmi2/mpi_pmi2.c,
# mpi_p_slurmstepd_task; srun's step variables: src/common/env.c, env_array_for_step).
SRUN_PMI2_TASK_5 = {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "11", "PMI_JOBID": "4242.0",
                    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
                    "SLURM_STEP_NUM_TASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)",
                    "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[012-013]",
                    "SLURM_STEP_NODELIST": "gpu[012-013]", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}


def test_srun_with_the_pmi2_plugin_is_slurms_world_and_node_list():
    env = launcher_env(SRUN_PMI2_TASK_5)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert env.master_addr == "gpu012"  # not 127.0.0.1: two nodes must not rendezvous on localhost


def test_slurm_22_05_cray_shasta_sets_a_rank_and_no_world_size():
    # Slurm 22.05's mpi/cray_shasta sets PALS_RANKID, PALS_NODEID, PALS_APID, PALS_APINFO, PALS_SPOOL_DIR and no
    # size (slurm-22-05-11-1 mpi_cray_shasta.c:202-207; PMI_SIZE and PALS_LOCAL_RANKID came in 23.02, 0dbdbf9399)
    shasta = {k: v for k, v in SRUN_PMI2_TASK_5.items() if not k.startswith("PMI_")} | {
        "PALS_RANKID": "5", "PALS_NODEID": "1", "PALS_APID": "4242.0", "PALS_SPOOL_DIR": "/tmp/x"}
    env = launcher_env(shasta)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert env.master_addr == "gpu012"
    # uneven nodes: "4,3" tasks, this task on the second node
    uneven = launcher_env(shasta | {"SLURM_STEP_NUM_TASKS": "7", "SLURM_NTASKS": "7",
                                    "SLURM_STEP_TASKS_PER_NODE": "4,3", "SLURM_TASKS_PER_NODE": "4,3"})
    assert (uneven.world_size, uneven.local_world_size) == (7, 3)
    # Slurm 23.02 on: PMI_SIZE and PALS_LOCAL_RANKID too; the same answer
    newer = launcher_env(shasta | {"PMI_RANK": "5", "PMI_SIZE": "8", "PALS_LOCAL_RANKID": "1", "PMI_LOCAL_SIZE": "4"})
    assert (newer.launcher, newer.rank, newer.world_size, newer.local_world_size) == ("slurm", 5, 8, 4)


def test_a_stale_rank_and_world_of_one_beside_an_mpi_rank_is_refused():
    # `export RANK=0 WORLD_SIZE=1` left in the shell, then mpiexec: every rank would train alone, silently
    pals = {"PALS_RANKID": "3", "PALS_LOCAL_RANKID": "3", "PMI_RANK": "3", "PMI_SIZE": "4", "PALS_LOCAL_SIZE": "4"}
    with pytest.raises(ConfigError, match="RANK=0 WORLD_SIZE=1 contradict pals's rank 3 of 4") as error:
        launcher_env(pals | {"RANK": "0", "WORLD_SIZE": "1"})
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="contradict slurm's rank 5 of 8"):
        launcher_env(SRUN_PMI2_TASK_5 | {"RANK": "0", "WORLD_SIZE": "1"})
    # the same variables agreeing (a wrapper that copied PMI_RANK to RANK) are no contradiction
    assert launcher_env(pals | {"RANK": "3", "WORLD_SIZE": "4"}).launcher == "pals"


def test_torchrun_is_known_by_its_run_id_and_wins_over_the_agents_variables():
    # torchrun's workers get TORCHELASTIC_RUN_ID (torch local_elastic_agent.py:428); torch itself tests for it
    # (distributed_c10d.py:1403-1409, is_torchelastic_launched). Under mpiexec or srun, one agent a node: the
    # worker inherits the agent's PALS_RANKID=1 of 2, and its own RANK 6 of 8 is right.
    worker = {"TORCHELASTIC_RUN_ID": "job7", "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2",
              "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "dec0001", "MASTER_PORT": "29400",
              "PALS_RANKID": "1", "PMI_RANK": "1", "PMI_SIZE": "2", "PALS_LOCAL_RANKID": "0", "PALS_LOCAL_SIZE": "1"}
    env = launcher_env(worker)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("torchrun", 6, 8, 2, 4)
    with pytest.raises(ConfigError, match="TORCHELASTIC_RUN_ID is set but RANK"):
        launcher_env({"TORCHELASTIC_RUN_ID": "job7"})


def test_rank_and_world_size_alone_are_labkits_fork_launcher():
    # labkit.forkrun sets RANK/WORLD_SIZE/LOCAL_RANK without a run id: that is the world, even inside a batch
    # script's shell (SLURM_PROCID=0 and SLURM_NTASKS, no srun step) or an `srun -n 1` step
    forked = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}
    for around in ({}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"},
                   {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}):
        env = launcher_env(forked | around)
        assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("env", 2, 4, 2), around



def test_device_auto_says_in_one_line_when_a_cuda_build_finds_no_usable_cuda():
    from distlab.runtime import auto_device_note

    too_old = ("CUDA initialization: The NVIDIA driver on your system is too old (found version 12040). Please "
               "update your GPU driver\n(more text)")
    note = auto_device_note("auto", True, False, too_old)
    assert note == ("--device auto: this torch is built for CUDA but CUDA is not usable (CUDA initialization: The "
                    "NVIDIA driver on your system is too old (found version 12040). Please update your GPU driver); "
                    "running on cpu with gloo")
    assert "no GPU is visible" in auto_device_note("auto", True, False, None)
    # a CPU-only build, a usable GPU, or a device asked for by name: nothing to say
    assert auto_device_note("auto", False, False, None) is None
    assert auto_device_note("auto", True, True, None) is None
    assert auto_device_note("cpu", True, False, too_old) is None
