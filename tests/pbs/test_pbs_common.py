"""pbs/common.sh in a fake job: node discovery, settings, mpiexec flavours, the launch commands it builds."""

from __future__ import annotations

import os
import shlex
import shutil

import pytest
from pbs_helpers import ROOT, run_bash, write_nodefile

SHOW = "NODES NNODES MASTER_ADDR MASTER_PORT RUN_DIR HOSTFILE FLAVOR LAUNCHER".split()
PRINT_VARS = (
    'printf "NODES=%s\\nNNODES=%s\\nMASTER_ADDR=%s\\nMASTER_PORT=%s\\nRUN_DIR=%s\\nHOSTFILE=%s\\nFLAVOR=%s\\n'
    'LAUNCHER=%s\\n" "$DISTLAB_NODES" "$DISTLAB_NNODES" "$MASTER_ADDR" "$MASTER_PORT" "$DISTLAB_RUN_DIR" '
    '"$DISTLAB_HOSTFILE" "$DISTLAB_MPIEXEC_FLAVOR" "$DISTLAB_LAUNCHER"'
)


def source_common(env, after: str = PRINT_VARS, before: str = ""):
    return run_bash(f"{before}\nsource pbs/common.sh\n{after}", env)


def cksum_port(job_id: str, env) -> int:
    out = run_bash(f"printf '%s' {shlex.quote(job_id)} | cksum", env).output.split()[0]
    return 20000 + int(out) % 12000


def launch_command(env, *args: str) -> list[str]:
    """The words distlab_launch would run (dry run), read back from the run directory's commands.sh."""
    result = source_common(env | {"DISTLAB_DRY_RUN": "1"},
                           after=f"distlab_launch {' '.join(map(shlex.quote, args))}; echo rc=$?")
    assert result.values().get("rc") == "0", result.output
    commands = (ROOT / env["DISTLAB_RUN_DIR"] / "commands.sh").read_text().splitlines()
    return shlex.split(commands[-1])


# ---------------------------------------------------------------------------------------------------
# Node discovery
# ---------------------------------------------------------------------------------------------------


def test_nodes_are_the_unique_hosts_of_the_nodefile_in_order(job_env, tmp_path):
    write_nodefile(tmp_path / "nodefile", ["dec0107", "dec0002", "dec0050"], 4)  # PBS order, not sorted
    result = source_common(job_env)
    assert result.returncode == 0, result.output
    v = result.values()
    assert v["NODES"] == "dec0107 dec0002 dec0050"
    assert v["NNODES"] == "3"
    assert v["MASTER_ADDR"] == "dec0107"
    assert (tmp_path / "run" / "hosts.txt").read_text() == "dec0107\ndec0002\ndec0050\n"
    assert v["HOSTFILE"] == str(tmp_path / "run" / "hosts.txt")


def test_one_node_job(job_env, tmp_path):
    write_nodefile(tmp_path / "nodefile", ["deg0001.hsn.de.hpc.ucar.edu"], 4)
    v = source_common(job_env).values()
    assert (v["NODES"], v["NNODES"], v["MASTER_ADDR"]) == ("deg0001.hsn.de.hpc.ucar.edu", "1",
                                                          "deg0001.hsn.de.hpc.ucar.edu")


def test_blank_lines_and_spaces_in_the_nodefile_are_ignored(job_env, tmp_path):
    (tmp_path / "nodefile").write_text("dec0001\n  dec0001  \n\ndec0002\ndec0002\n\n")
    v = source_common(job_env).values()
    assert (v["NODES"], v["NNODES"]) == ("dec0001 dec0002", "2")


def test_master_port_comes_from_the_job_id(job_env):
    port = int(source_common(job_env).values()["MASTER_PORT"])
    assert port == cksum_port("4242.desched1", job_env)
    assert 20000 <= port < 32000  # below Linux's ephemeral ports (32768+)
    other = int(source_common(job_env | {"PBS_JOBID": "4243.desched1"}).values()["MASTER_PORT"])
    assert other != port


def test_master_address_and_port_can_be_overridden(job_env):
    v = source_common(job_env | {"DISTLAB_MASTER_ADDR": "dec0002-hsn0", "DISTLAB_MASTER_PORT": "29999"}).values()
    assert (v["MASTER_ADDR"], v["MASTER_PORT"]) == ("dec0002-hsn0", "29999")


def test_run_directory_defaults_to_runs_job_id(job_env, tmp_path):
    job_id = f"pbs-test-{os.getpid()}"
    run_dir = ROOT / "runs" / job_id
    try:
        # no scratch and the course not in $HOME (a laptop, CI): the repository's runs/ folder
        result = run_bash('DISTLAB_RUN_DIR=; source pbs/common.sh; echo "RUN_DIR=$DISTLAB_RUN_DIR"',
                          job_env | {"PBS_JOBID": job_id, "HOME": str(tmp_path)})
        assert result.values()["RUN_DIR"] == str(run_dir)
        assert (run_dir / "hosts.txt").exists() and (run_dir / "logs").is_dir()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.parametrize("nodefile, message", [
    (None, "PBS_NODEFILE is not set"),
    ("missing", "cannot be read"),
    ("empty", "lists no hosts"),
])
def test_no_usable_nodefile_stops_with_one_line(job_env, tmp_path, nodefile, message):
    env = dict(job_env)
    if nodefile is None:
        del env["PBS_NODEFILE"]
    elif nodefile == "missing":
        env["PBS_NODEFILE"] = str(tmp_path / "no-such-file")
    else:
        (tmp_path / "nodefile").write_text("\n")
    result = source_common(env, after="echo SHOULD_NOT_RUN")
    assert result.returncode == 2
    assert result.lines() == [ln for ln in result.lines() if ln.startswith("distlab: error:")], result.output
    assert len(result.lines()) == 1 and message in result.output


@pytest.mark.parametrize("setting, message", [
    ({"DISTLAB_LAUNCHER": "srun"}, "use mpiexec or torchrun"),
    ({"DISTLAB_GPUS_PER_NODE": "four"}, "not a positive integer"),
    ({"DISTLAB_MPIEXEC_FLAVOR": "openmpi"}, "use auto, pals or hydra"),
    ({"DISTLAB_MPIEXEC": "/nonexistent/mpiexec"}, "mpiexec not found"),
    ({"DISTLAB_PYTHON": "/nonexistent/python"}, "no such command"),
    ({"DISTLAB_NETWORK": "infiniband"}, "use auto, slingshot or none"),
])
def test_bad_settings_stop_with_one_line(job_env, setting, message):
    result = source_common(job_env | setting, after="echo SHOULD_NOT_RUN")
    assert result.returncode == 2, result.output
    assert "SHOULD_NOT_RUN" not in result.output
    errors = [ln for ln in result.lines() if ln.startswith("distlab: error:")]
    assert len(errors) == 1 and message in errors[0], result.output


def test_common_sh_refuses_to_be_run_instead_of_sourced(job_env):
    result = run_bash(["bash", "pbs/common.sh"], job_env)
    assert result.returncode == 2 and "sourced" in result.output


# ---------------------------------------------------------------------------------------------------
# Software and network settings
# ---------------------------------------------------------------------------------------------------

FAKE_MODULE_AND_CONDA = """
module() { echo "MODULE_CALL=$*"; }
conda() { case $1 in shell.bash) echo ':' ;; activate) echo "CONDA_CALL=activate $2" ;; esac; }
"""


def test_modules_and_conda_environment_are_loaded(job_env):
    env = job_env | {"DISTLAB_MODULES": "ncarenv cuda conda", "DISTLAB_CONDA_ENV": "distlab"}
    v = source_common(env, before=FAKE_MODULE_AND_CONDA).values()
    assert v["MODULE_CALL"] == "load ncarenv cuda conda"
    assert v["CONDA_CALL"] == "activate distlab"


def test_without_module_or_conda_commands_the_job_goes_on(job_env):
    del job_env["DISTLAB_MODULES"], job_env["DISTLAB_CONDA_ENV"]  # the defaults
    result = source_common(job_env)
    assert result.returncode == 0, result.output
    assert "no 'module' command here" in result.output and "no conda here" in result.output


def test_module_command_is_set_up_when_the_batch_shell_lacks_it(job_env, tmp_path):
    init = tmp_path / "lmod.sh"
    init.write_text('module() { echo "MODULE_CALL=$*"; }\n')
    v = source_common(job_env | {"DISTLAB_MODULES": "cuda", "DISTLAB_MODULE_INIT": f"/nonexistent {init}"}).values()
    assert v["MODULE_CALL"] == "load cuda"


def test_a_failing_module_load_stops_the_job(job_env):
    result = source_common(job_env | {"DISTLAB_MODULES": "nosuchmodule"}, before="module() { return 1; }")
    assert result.returncode == 2 and "module load nosuchmodule failed" in result.output


def test_preflight_refuses_cuda_where_torch_sees_no_gpu(job_env):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = source_common(job_env | {"DISTLAB_PREFLIGHT": "1", "DISTLAB_DEVICE": "cuda"}, after="echo SHOULD_NOT_RUN")
    assert result.returncode == 2, result.output
    assert "torch " in result.output  # the preflight line: python, torch and CUDA versions
    assert "no GPU is visible but DISTLAB_DEVICE=cuda" in result.output


def test_slingshot_settings_keep_values_already_set(job_env, tmp_path):
    (tmp_path / "net" / "hsn0").mkdir(parents=True)  # a Slingshot node, as /sys/class/net shows it
    after = 'env | grep -E "^(NCCL|FI|MPICH|GLOO)_" | sort'
    v = source_common(job_env | {"NCCL_DEBUG": "INFO", "DISTLAB_SYS_NET": str(tmp_path / "net")}, after=after).values()
    assert v["NCCL_SOCKET_IFNAME"] == "hsn"
    assert v["GLOO_SOCKET_IFNAME"] == "hsn0"  # gloo needs one exact name: the first Slingshot interface
    assert v["NCCL_DEBUG"] == "INFO"  # set by the user: kept
    assert v["FI_CXI_DISABLE_HOST_REGISTER"] == "1" and v["FI_PROVIDER"] == "cxi"
    assert v["NCCL_CROSS_NIC"] == "1"
    assert "NCCL_NET_GDR_LEVEL" not in v  # not measured stable on Derecho: left to NCCL (pbs/README.md)
    assert v["MPICH_GPU_SUPPORT_ENABLED"] == "0"
    assert "NCCL_NET" not in v  # no aws-ofi-nccl plugin here: NCCL would refuse to start
    for off in ({"DISTLAB_NETWORK": "none"}, {"DISTLAB_SYS_NET": str(tmp_path / "no-hsn")}):
        result = source_common(job_env | off, after=after)
        # the network left alone; NCCL_DEBUG_FILE, where NCCL writes its lines, is set on every node
        assert not any(k.startswith(("NCCL_", "FI_", "GLOO_")) and k != "NCCL_DEBUG_FILE"
                       for k in result.values()), result.output
    assert "no Slingshot interface" in result.output


def test_nccl_uses_the_libfabric_plugin_when_one_is_installed(job_env, tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnccl-net.so").write_text("")
    v = source_common(job_env | {"LD_LIBRARY_PATH": f"/nonexistent:{tmp_path / 'lib'}", "DISTLAB_NETWORK": "slingshot"},
                      after='echo "NCCL_NET=${NCCL_NET:-}"').values()
    assert v["NCCL_NET"] == "AWS Libfabric"


# ---------------------------------------------------------------------------------------------------
# mpiexec flavours and the commands distlab_launch builds
# ---------------------------------------------------------------------------------------------------


def test_mpich_mpiexec_is_recognised_as_hydra(job_env):
    assert source_common(job_env).values()["FLAVOR"] == "hydra"


@pytest.mark.parametrize("version, flavor", [
    ("mpiexec version 1.2.12", "pals"),  # found under /opt/cray/pals
    ("HYDRA build details:\n    Version: 4.1.2", "hydra"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "hydra"),
])
def test_flavor_is_detected(job_env, fake_pals, version, flavor):
    with open(fake_pals, "w") as f:
        f.write(f"#!/bin/sh\ncat <<'EOF'\n{version}\nEOF\n")
    assert source_common(job_env | {"DISTLAB_MPIEXEC": fake_pals}).values()["FLAVOR"] == flavor


def test_open_mpi_is_refused_and_an_unknown_mpiexec_is_taken_for_pals(job_env, tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (Open MPI) 4.1.5'\n")
    fake.chmod(0o755)
    result = source_common(job_env | {"DISTLAB_MPIEXEC": str(fake)})
    assert result.returncode == 2 and "Open MPI" in result.output
    fake.write_text("#!/bin/sh\necho 'something else'\n")
    result = source_common(job_env | {"DISTLAB_MPIEXEC": str(fake)})
    assert result.values()["FLAVOR"] == "pals" and "assuming Cray PALS" in result.output


def test_pals_launch_one_rank_per_gpu(job_env, fake_pals):
    cmd = launch_command(job_env | {"DISTLAB_MPIEXEC": fake_pals}, "tests/pbs/job_probe.py", "--device", "cuda")
    assert cmd == [fake_pals, "-n", "8", "--ppn", "4", "--cpu-bind", "none",
                   job_env["DISTLAB_PYTHON"], "-u", "tests/pbs/job_probe.py", "--device", "cuda"]


def test_pals_launch_with_depth_binding(job_env, fake_pals):
    cmd = launch_command(job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_DEPTH": "16"}, "tests/pbs/job_probe.py")
    assert cmd[:9] == [fake_pals, "-n", "8", "--ppn", "4", "--depth", "16", "--cpu-bind", "depth"]


def test_hydra_launch_names_the_hostfile(job_env, tmp_path):
    cmd = launch_command(job_env | {"DISTLAB_MPIEXEC_ARGS": "-launcher fork"}, "tests/pbs/job_probe.py")
    assert cmd[1:9] == ["-n", "8", "-ppn", "4", "-f", str(tmp_path / "run" / "hosts.txt"), "-launcher", "fork"]


def test_torchrun_launch_one_agent_per_node(job_env, fake_pals):
    env = job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_LAUNCHER": "torchrun"}
    cmd = launch_command(env, "tests/pbs/job_probe.py", "--device", "cuda")
    port = cksum_port("4242.desched1", job_env)
    assert cmd[:7] == [fake_pals, "-n", "2", "--ppn", "1", "--cpu-bind", "none"]
    run = cmd[cmd.index("torch.distributed.run") + 1:]
    assert run == ["--nnodes=2", "--nproc-per-node=4", "--rdzv-backend=c10d", f"--rdzv-endpoint=dec0001:{port}",
                   "--rdzv-id=4242.desched1-1", "--max-restarts=0", "tests/pbs/job_probe.py", "--device", "cuda"]
    wrapper = cmd[cmd.index("-c") + 1]
    assert "PET_RDZV_CONF=is_host" in wrapper  # the first node's agent hosts the rendezvous


@pytest.mark.parametrize("nprocs, expected", [("1", ["-n", "1", "--ppn", "1"]), ("4", ["-n", "4", "--ppn", "4"])])
def test_fewer_ranks_than_gpus(job_env, fake_pals, nprocs, expected):
    cmd = launch_command(job_env | {"DISTLAB_MPIEXEC": fake_pals, "DISTLAB_NPROCS": nprocs}, "tests/pbs/job_probe.py")
    assert cmd[1:5] == expected


def test_ranks_that_do_not_fit_the_nodes_stop_the_job(job_env):
    result = source_common(job_env | {"DISTLAB_NPROCS": "12"}, after="distlab_launch tests/pbs/job_probe.py")
    assert result.returncode == 2 and "do not fit 2 node(s) x 4 GPUs" in result.output


def test_only_and_missing_scripts(job_env, tmp_path):
    env = job_env | {"DISTLAB_DRY_RUN": "1", "DISTLAB_ONLY": "other.py:job_probe.py"}
    result = source_common(env, after="distlab_launch tests/pbs/probe.pbs; distlab_launch tests/pbs/job_probe.py; "
                                      "DISTLAB_ONLY= DISTLAB_DRY_RUN=0 distlab_launch scripts/no_such.py; echo rc=$?; "
                                      "distlab_finish")
    assert "skip probe.pbs" in result.output and "skip job_probe.py" not in result.output
    assert "missing no_such.py" in (tmp_path / "run" / "summary.txt").read_text()
    assert result.values()["rc"] == "2"
    assert result.returncode == 1  # distlab_finish: a launch failed


# ---------------------------------------------------------------------------------------------------
# SIGTERM (qdel, the walltime): the job shell reports, says "checkpoint" only for a script that writes one, and
# launches nothing more
# ---------------------------------------------------------------------------------------------------

SIGTERM_JOB = """source pbs/common.sh || exit 2
DISTLAB_CHECKPOINTING=${CHECKPOINTING:-} distlab_launch "$RANK_SCRIPT" --steps 3
distlab_launch "$RANK_SCRIPT" --steps 3
distlab_finish
"""


@pytest.mark.parametrize("checkpointing", ["rank.py", ""])
def test_after_a_sigterm_the_job_launches_nothing_and_says_checkpoint_only_for_a_checkpointing_script(
        checkpointing, job_env, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    # one "rank": prints, then runs on 2 s after the job shell got its SIGTERM; the shell's trap runs at once
    # (distlab_launch waits in the background), so it reports before the scheduler's SIGKILL would come
    rank = tmp_path / "rank.py"
    rank.write_text("import sys, time\nprint('started', flush=True)\ntime.sleep(2)\nprint('rank done', flush=True)\n")
    launcher = tmp_path / "mpiexec"  # starts the command after the launcher's options, once
    launcher.write_text('#!/bin/bash\nwhile [[ $1 != "$DISTLAB_PYTHON" ]]; do shift; done\nexec "$@"\n')
    launcher.chmod(0o755)
    env = job_env | {"DISTLAB_MPIEXEC": str(launcher), "DISTLAB_MPIEXEC_FLAVOR": "pals", "DISTLAB_NPROCS": "1",
                     "RANK_SCRIPT": str(rank), "CHECKPOINTING": checkpointing, "DISTLAB_PYTHON": sys.executable}
    job = subprocess.Popen(["bash", "-c", SIGTERM_JOB], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 20
    while not list((tmp_path / "run" / "logs").glob("01_*.log")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    job.send_signal(signal.SIGTERM)  # the job's shell only: the rank goes on to its end
    output, _ = job.communicate(timeout=30)
    said = [line for line in output.splitlines() if "SIGTERM" in line]
    if checkpointing:
        # a checkpoint only if the step and the save end before PBS's SIGKILL (qdel and the walltime send one
        # kill_delay after their TERM; qsig -s TERM sends none: OpenPBS src/resmom/requests.c:1986-1991, :2058-2094)
        assert ("distlab: SIGTERM: rank.py's ranks stop at the end of their step and write a checkpoint if they finish "
                "before the KILL, about 10 s after the walltime's TERM, 10 to 25 s after a qdel's (kill_delay, 10 s "
                "unless the queue sets another, at the MoM's next poll; none after qsig -s TERM); nothing more is "
                "launched") in said, output
    else:
        assert not any("checkpoint written" in s or "write a checkpoint" in s for s in said), output
        assert any("no checkpoint is written" in s for s in said), output
    assert "distlab: not launched rank.py: the job got SIGTERM" in output and output.count("rank done") == 1, output
    assert output.index("distlab: SIGTERM: ") < output.index("rank done"), output  # the trap ran during the launch
    assert "ok rank.py" in output and job.returncode == 1  # the first launch ended well; the job did not finish


def test_torchruns_agents_get_the_jobs_margin_to_save_after_a_qsig_term(job_env):
    """qsig -s TERM sends the TERM alone (OpenPBS src/resmom/requests.c:2058-2094): the ranks' torchrun agents then
    SIGKILL them TORCH_ELASTIC_SHUTDOWN_TIMEOUT s later, 30 by default (torch 2.13 distributed/launcher/api.py:145-149),
    too short for a real model's step and save. The PBS job exports the margin it budgets for them, as Slurm's does;
    a value given wins."""
    show = 'echo "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"; bash -c \'echo "agent=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"\''
    env = {k: v for k, v in job_env.items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    assert source_common(env, after=show).output.split()[-2:] == ["120", "agent=120"]  # exported to the agents
    assert source_common(env | {"DISTLAB_WALLTIME_MARGIN": "300"}, after=show).output.split()[-2:] == ["300", "agent=300"]
    assert source_common(env | {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}, after=show).output.split()[-2:] == ["45", "agent=45"]
