"""coursetools.jobs: the course's checked submission (python -m coursetools.jobs submit) against stand-ins for
Slurm's and PBS's commands on PATH, and the job rules that moved out of jobs/common.sh's bash.

The stand-ins answer as the real commands do for what is asked: sinfo lists a partition only when it exists;
scontrol show config prints the accounting settings of the site under test (the test cluster of tests/slurm has no
accounting, so the account rules are proven here); sacctmgr lists the user's associations; qstat -Q fails for an
unknown queue; sbatch and qsub record their arguments (a refused submission leaves no record: nothing queued).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from coursetools import jobs

ROOT = Path(__file__).resolve().parents[2]
JOB = "slurm/04_data_parallel.sbatch"  # its header: --ntasks-per-node=4, --gpus-per-node=4, no partition (sites/)
PBS_JOB = "pbs/04_data_parallel.pbs"  # its header: -q main, select=1:ncpus=64:ngpus=4:mpiprocs=4, no -A


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Stand-ins on PATH; site.set(enforce=..., accounting=..., assoc=..., default=...) describes the cluster."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    scripts = {
        # as Slurm's sinfo: -p names a partition, hidden ones included (-p sets all_flag), and refuses -a beside it
        "sinfo": 'while [[ $# -gt 0 ]]; do [[ $1 == -p ]] && p=$2; [[ $1 == -a ]] && a=1; shift; done\n'
                 '[[ -n ${a:-} && -n ${p:-} ]] && { echo "sinfo: error: Conflicting options, -a and -p, specified." >&2; exit 1; }\n'
                 f'{{ grep -qx "$p" {state}/partitions || [[ $p == hidden ]]; }} && echo "$p"; exit 0',
        "scontrol": f'cat {state}/config',
        "sacctmgr": f'[[ -e {state}/dbd_down ]] && {{ echo "sacctmgr: error: Problem talking to the database" >&2; exit 1; }}\n'
                    'for w in "$@"; do case $w in account=*) a=${w#account=} ;; format=DefaultAccount) d=1 ;; esac; done\n'
                    f'if [[ -n ${{d:-}} ]]; then cat {state}/default; else grep -x "$a" {state}/assoc; fi; exit 0',
        "qstat": f'[[ $1 == -Q ]] && grep -qx "$2" {state}/queues || {{ echo "qstat: Unknown queue $2" >&2; exit 170; }}',
        "sbatch": f'printf "%s\\n" "$@" > {state}/sbatch.args; echo 4242',
        "qsub": f'printf "%s\\n" "$@" > {state}/qsub.args; echo 4242.desched1',
    }
    for name, body in scripts.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_ / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    monkeypatch.chdir(ROOT)

    class Site:
        def set(self, enforce="none", accounting="accounting_storage/none", assoc=(), default=""):
            (state / "partitions").write_text("gpu\ndebug\n")
            (state / "queues").write_text("main\ndevelop\n")
            (state / "config").write_text(f"Configuration data as of 2026-11-26T19:00:00\n"
                                          f"AccountingStorageEnforce = {enforce}\n"
                                          f"AccountingStorageType   = {accounting}\nClusterName = ci\n")
            (state / "assoc").write_text("".join(f"{a}\n" for a in assoc))
            (state / "default").write_text(f"{default}\n" if default else "")

        def submitted(self, tool="sbatch"):
            path = state / f"{tool}.args"
            return path.read_text().splitlines() if path.exists() else None

    s = Site()
    s.set()
    return s


def submit(*argv):
    return jobs.main(["submit", *argv])


def refused(capsys, *argv, **env):
    """The submission is refused with one line, exit 2; returns the line."""
    code = jobs.main(["submit", *argv]) if not env else _main_env(argv, env)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("distlab: error: "), (code, err)
    return err[0]


def _main_env(argv, env):
    old = dict(os.environ)
    os.environ.update(env)
    try:
        return jobs.main(["submit", *argv])
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_a_known_partition_submits_the_same_words(site):
    assert submit("-N", "2", JOB) == 0
    assert site.submitted() == ["-N", "2", JOB]


def test_an_unknown_partition_is_refused_before_sbatch(site, capsys):
    line = refused(capsys, "-p", "nosuch", JOB)
    assert "partition 'nosuch' does not exist" in line and "pass -p <partition>" in line
    assert site.submitted() is None  # nothing queued
    refused(capsys, "--partition=nosuch", JOB)
    refused(capsys, "-pnosuch", JOB)
    assert submit("-p", "debug", JOB) == 0


def test_the_partition_is_read_as_sbatch_reads_it(site, capsys, tmp_path):
    # the environment overrides a header's --partition (the course's headers name none), the command line both
    refused(capsys, JOB, SBATCH_PARTITION="nosuch")
    assert _main_env(["-p", "gpu", JOB], {"SBATCH_PARTITION": "nosuch"}) == 0
    headed = tmp_path / "headed.sbatch"
    headed.write_text((ROOT / JOB).read_text().replace("#SBATCH --nodes=1", "#SBATCH --partition=nosuch\n#SBATCH --nodes=1"))
    refused(capsys, str(headed))
    assert _main_env([str(headed)], {"SBATCH_PARTITION": "gpu"}) == 0


def test_an_account_is_required_where_the_site_enforces_associations(site, capsys):
    site.set(enforce="associations,limits", accounting="accounting_storage/slurmdbd", assoc=["proj1"])
    line = refused(capsys, JOB, USER="ann")
    assert "charges every job to an account" in line and "-A <account>" in line and "user=ann" in line
    assert site.submitted() is None
    assert submit("-A", "proj1", JOB) == 0
    assert "account 'proj2' is not one of yours" in refused(capsys, "--account=proj2", JOB)
    assert _main_env([JOB], {"SBATCH_ACCOUNT": "proj1"}) == 0
    site.set(enforce="safe", accounting="accounting_storage/slurmdbd", assoc=["proj1"], default="proj1")
    assert submit(JOB) == 0  # the user's default account is charged
    site.set(enforce="safe", accounting="accounting_storage/slurmdbd", assoc=["proj1"])  # safe sets associations
    assert "charges every job to an account" in refused(capsys, JOB)


def test_no_accounting_no_account_rule(site):
    site.set()  # the test cluster's: accounting_storage/none, enforce none
    assert submit("-A", "anything", JOB) == 0 and submit(JOB) == 0


def test_tasks_a_node_must_match_the_gpus_a_node(site, capsys):
    line = refused(capsys, "--ntasks-per-node=1", JOB)
    assert line == ("distlab: error: --ntasks-per-node=1 but --gpus-per-node=4: one task a GPU, ask "
                    "--ntasks-per-node=4 (or DISTLAB_LAUNCHER=torchrun: one agent a node)")
    assert submit("--ntasks-per-node=2", "--gpus-per-node=gpu:2", JOB) == 0
    assert _main_env(["--ntasks-per-node=1", JOB], {"DISTLAB_LAUNCHER": "torchrun"}) == 0


def test_pbs_queue_account_and_ranks_a_gpu(site, capsys):
    assert "queue 'nosuch' does not exist" in refused(capsys, "-A", "UABC0001", "-q", "nosuch", PBS_JOB)
    assert "no account: pass -A <project>" in refused(capsys, PBS_JOB)
    assert site.submitted("qsub") is None
    line = refused(capsys, "-A", "UABC0001", "-l", "select=2:ncpus=64:ngpus=4:mpiprocs=1", PBS_JOB)
    assert "mpiprocs=1 but ngpus=4: one rank a GPU, ask mpiprocs=4" in line
    assert submit("-A", "UABC0001", "-q", "develop", PBS_JOB) == 0
    assert site.submitted("qsub") == ["-A", "UABC0001", "-q", "develop", PBS_JOB]
    assert _main_env([PBS_JOB], {"DISTLAB_REQUIRE_ACCOUNT": "0"}) == 0


def test_bad_input_from_the_command_line_is_one_line_without_a_traceback(site):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "coursetools.jobs", "submit", "-p", "nosuch", JOB], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    missing = subprocess.run([sys.executable, "-m", "coursetools.jobs", "submit", "slurm/nosuch.sbatch"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no such job file" in missing.stderr and "Traceback" not in missing.stderr


# ---------------------------------------------------------------------------------------------------------------
# The rules that moved out of jobs/common.sh (tests/unit/test_pbs_common_rules.py drives them through the bash too)
# ---------------------------------------------------------------------------------------------------------------
DATA = ROOT / "tests" / "pbs" / "data"


@pytest.mark.parametrize("duration, expected", [("00:20:00", 1200), ("12:00:00", 43200), ("90", 90), ("01:30", 90),
                                                ("08:09", 489)])  # 08 and 09 are decimal, not octal
def test_seconds(duration, expected):
    assert jobs.seconds(duration) == expected


@pytest.mark.parametrize("bad", ["", "1:2:3:4", "1h", "-5", "１２"])
def test_seconds_refuses_what_is_not_a_duration(bad):
    with pytest.raises(ValueError):
        jobs.seconds(bad)
    assert jobs.main(["seconds", bad]) == 1


def test_transport_details_and_warnings_from_ncclS_files(tmp_path):
    assert jobs.nccl_transport(jobs.read_lines([str(DATA / "nccl_info_ofi_cxi.log")])) == "OFI (aws-ofi-nccl, provider cxi)"
    both = jobs.read_lines([str(DATA / "nccl_info_ofi_cxi.log"), str(DATA / "nccl_info_socket.log")])
    assert jobs.nccl_transport(both).startswith("Socket (TCP on [0]hsn0:")  # the last file read wins
    assert jobs.nccl_transport([]).startswith("none reported")
    assert jobs.nccl_details(["x NCCL INFO Channel 00/0 : 0[0] -> 4[0] [send] via NET/AWS Libfabric/0/GDRDMA",
                              "x NCCL INFO Channel 01/0 : 0[0] -> 4[0] [send] via NET/AWS Libfabric/1"]) == [
        "GPUDirect RDMA: yes (1 of 2 network send channels)", "net plugin: none reported"]
    folder = tmp_path / "nccl"
    folder.mkdir()
    warn = "dec0001:1:2 [0] NCCL WARN NET/OFI Unable to find a protocol that works"
    for i in range(7):
        (folder / f"nccl.dec000{i}.1.log").write_text(f"x NCCL INFO fine\n{warn}\n")
    got = jobs.nccl_warnings(str(folder))
    assert got[0] == f"NCCL WARN lines: 7, in {folder}/ (one file a rank); the first:" and len(got) == 6
    assert got[1] == f"    nccl.dec0000.1.log:{warn}"
    assert jobs.nccl_warnings(str(tmp_path / "none")) == []


@pytest.mark.parametrize("metrics, complete", [
    ({"extra": {}, "checks": [{"passed": True}]}, True),
    ({"extra": {"stopped_by": "deadline"}, "checks": [{"passed": True}]}, False),
    ({"extra": {}, "checks": [{"passed": True}, {"passed": False}]}, False),
    ({"extra": {}, "checks": []}, False),
    (None, False),  # no metrics file, or not JSON
])
def test_a_run_is_complete_when_its_checks_passed_and_it_was_not_stopped(tmp_path, metrics, complete):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(metrics) if metrics is not None else "{not json")
    assert jobs.run_complete(str(path)) is complete
    assert jobs.main(["complete", str(path)]) == (0 if complete else 1)


def test_chain_variables_carry_a_list_with_colons():
    # qsub -v and sbatch --export split at every comma: DISTLAB_ONLY=a.py,b.py would reach the next job as a.py
    assert jobs.chain_vars(["DISTLAB_CHAIN=1", "DISTLAB_DRILL_DIR=/s/drill", "DISTLAB_ONLY=a.py,b.py", "DISTLAB_ONLY2="]) \
        == "DISTLAB_CHAIN=1,DISTLAB_DRILL_DIR=/s/drill,DISTLAB_ONLY=a.py:b.py,DISTLAB_ONLY2="
    with pytest.raises(jobs.BadInput):
        jobs.chain_vars(["not a pair"])


def test_both_readmes_teach_the_checked_submission_with_the_lines_it_prints(site, capsys):
    slurm_readme, pbs_readme = ((ROOT / d / "README.md").read_text() for d in ("slurm", "pbs"))
    assert "python -m coursetools.jobs submit -A <account> -N 2 slurm/04_data_parallel.sbatch" in slurm_readme
    assert 'python -m coursetools.jobs submit -A "$PBS_ACCOUNT" pbs/04_data_parallel.pbs' in pbs_readme
    flat = " ".join(slurm_readme.split())
    assert refused(capsys, "-p", "gpu2", JOB).removeprefix("distlab: error: ") in flat
    assert refused(capsys, "-A", "x", "-q", "mian", PBS_JOB).removeprefix("distlab: error: ") in " ".join(pbs_readme.split())


# ---------------------------------------------------------------------------------------------------------------
# Review of issue 30's submission path: what the job will see, -l lists, commands that hang or are missing
# ---------------------------------------------------------------------------------------------------------------
def test_a_select_inside_a_comma_list_of_resources_is_checked(site, capsys):
    # qsub -l takes a comma list (select=...,place=scatter): the select is read wherever it stands in it
    for resources in ("select=1:ncpus=64:ngpus=4:mpiprocs=1,place=scatter",
                      "place=scatter,select=1:ncpus=64:ngpus=4:mpiprocs=1"):
        assert "mpiprocs=1 but ngpus=4" in refused(capsys, "-A", "X", "-l", resources, PBS_JOB)
    assert submit("-A", "X", "-l", "select=1:ncpus=64:ngpus=4:mpiprocs=4,place=scatter", PBS_JOB) == 0


def test_the_launcher_exemption_is_read_where_the_job_will_see_it(site, capsys):
    one_rank = ["-A", "X", "-l", "select=1:ncpus=64:ngpus=4:mpiprocs=1"]
    # qsub hands the job only -v's variables (all of them with -V): the submitting shell's are not the job's
    assert submit(*one_rank, "-v", "DISTLAB_ONLY=a.py,DISTLAB_LAUNCHER=torchrun", PBS_JOB) == 0
    assert "ask mpiprocs=4 (or -v DISTLAB_LAUNCHER=torchrun" in refused(capsys, *one_rank, PBS_JOB,
                                                                       DISTLAB_LAUNCHER="torchrun")
    assert _main_env([*one_rank, "-V", PBS_JOB], {"DISTLAB_LAUNCHER": "torchrun"}) == 0
    # sbatch hands on the shell's environment (ALL, the default) and --export's values; NONE hands on neither
    assert submit("--export=ALL,DISTLAB_LAUNCHER=torchrun", "--ntasks-per-node=1", JOB) == 0
    refused(capsys, "--export=NONE", "--ntasks-per-node=1", JOB, DISTLAB_LAUNCHER="torchrun")
    refused(capsys, "--export=ALL,DISTLAB_LAUNCHER=srun", "--ntasks-per-node=1", JOB, DISTLAB_LAUNCHER="torchrun")


def test_a_command_that_hangs_or_is_missing_is_one_line(site, capsys, monkeypatch, tmp_path):
    sinfo = tmp_path / "bin" / "sinfo"
    sinfo.write_text("#!/bin/bash\nexec sleep 5\n")
    monkeypatch.setattr(jobs, "COMMAND_TIMEOUT_S", 0.2)
    assert "sinfo did not answer" in refused(capsys, "-p", "gpu", JOB)
    (tmp_path / "bin" / "qsub").unlink()
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{Path(shutil.which('grep')).parent}")  # the stand-ins' grep
    assert "qsub not found" in refused(capsys, "-A", "X", PBS_JOB)


def test_an_account_without_association_is_accepted_where_associations_are_not_enforced(site, capsys):
    # slurmctld's job_mgr.c: without ACCOUNTING_ENFORCE_ASSOCS it takes the job and charges the default account
    site.set(enforce="nojobs", accounting="accounting_storage/slurmdbd", assoc=["proj1"], default="proj1")
    assert submit("-A", "proj2", JOB) == 0
    site.set(enforce="qos", accounting="accounting_storage/slurmdbd", assoc=["proj1"], default="proj1")
    assert "account 'proj2' is not one of yours" in refused(capsys, "-A", "proj2", JOB)


def test_a_hidden_partition_exists_and_an_unanswered_sacctmgr_refuses_nothing(site, tmp_path):
    # sinfo -p NAME lists a hidden partition too; sinfo -a -p is refused (the Slurm tier's sinfo said so)
    assert submit("-p", "hidden", JOB) == 0
    # slurmdbd down: sacctmgr fails; sbatch decides (slurmctld keeps its own copy of the associations)
    site.set(enforce="associations", accounting="accounting_storage/slurmdbd")
    (tmp_path / "state" / "dbd_down").write_text("")
    assert submit(JOB) == 0 and submit("-A", "proj1", JOB) == 0


def test_the_header_is_read_as_sbatch_reads_it(site, capsys, tmp_path):
    # src/sbatch/opt.c: "#SBATCH" at the line's start only, quotes group and are removed, an unquoted # ends it
    job = tmp_path / "edited.sbatch"
    job.write_text('#!/bin/bash\n#SBATCH --partition="gpu" # the course\'s\n  #SBATCH -p nosuch\n'
                   '#SBATCH --ntasks-per-node=4 --gpus-per-node=4#x\nsrun hostname\n#SBATCH -p nosuch\n')
    assert submit(str(job)) == 0
    job.write_text('#!/bin/bash\n#SBATCH -p "gpu\n')
    assert "unmatched quote" in refused(capsys, str(job))
