"""The rules of pbs/common.sh, one bash function at a time: which network NCCL chose (from recorded
NCCL_DEBUG=INFO logs), where the aws-ofi-nccl plugin is found, where a job writes, and the per-rank report.

Each test sources common.sh with DISTLAB_FUNCTIONS_ONLY=1 (functions defined, no job set up) and calls one
function, so a rule is checked without a PBS job, a GPU or a Slingshot network.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from coursetools import jobs

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "pbs" / "data"
OFI_LOG = DATA / "nccl_info_ofi_cxi.log"
SOCKET_LOG = DATA / "nccl_info_socket.log"
# the shell running the tests must not leak its own settings into the rules under test
LEAKY = ("PBS_", "DISTLAB_", "NCCL_", "FI_", "GLOO_", "MASTER_", "PMI_", "PALS_", "MPICH_", "SCRATCH",
         "CONDA_PREFIX", "LD_LIBRARY_PATH")


def bash(snippet: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``snippet`` after sourcing pbs/common.sh's functions only."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(LEAKY)}
    # DISTLAB_PYTHON: the job's python, which the rules written in Python (coursetools.jobs) run with
    clean.update({"DISTLAB_FUNCTIONS_ONLY": "1", "DISTLAB_SITE_SCRATCH": "/nonexistent/site-scratch",
                  "DISTLAB_PYTHON": sys.executable} | env)
    return subprocess.run(["bash", "-c", f"source pbs/common.sh || exit 9\n{snippet}"], cwd=ROOT, env=clean,
                          capture_output=True, text=True, timeout=30)


def out(snippet: str, **env: str) -> str:
    result = bash(snippet, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip()


# ---------------------------------------------------------------------------------------------------
# Which transport NCCL chose, from its INFO lines
# ---------------------------------------------------------------------------------------------------


def test_transport_from_a_recorded_libfabric_log():
    assert out(f"distlab_nccl_transport {OFI_LOG}") == "OFI (aws-ofi-nccl, provider cxi)"


def test_transport_from_a_recorded_socket_log():
    assert out(f"distlab_nccl_transport {SOCKET_LOG}") == (
        "Socket (TCP on [0]hsn0:10.150.1.17<0> [1]hsn1:10.150.1.18<0> [2]hsn2:10.150.1.19<0> [3]hsn3:10.150.1.20<0>)")


@pytest.mark.parametrize("lines, expected", [
    # aws-ofi-nccl 1.14 and later: "Selected provider is %s, fabric is %s (found %d nics)"; 1.12+ names itself
    # "Libfabric" unless NCCL_NET="AWS Libfabric" asked for the old name
    (["NCCL INFO NET/OFI Selected provider is cxi, fabric is cxi (found 4 nics)", "NCCL INFO Using network Libfabric"],
     "OFI (aws-ofi-nccl, provider cxi)"),
    (["NCCL INFO NET/OFI Selected provider is cxi, fabric is cxi (found 4 nics)"], "OFI (aws-ofi-nccl, provider cxi)"),
    (["NCCL INFO NET/Socket : Using [0]hsn0:10.0.0.1<0>"], "Socket (TCP on [0]hsn0:10.0.0.1<0>)"),
    (["NCCL INFO NET/IB : Using [0]mlx5_0:1/IB", "NCCL INFO Using network IB"], "IB"),
    (["NCCL version 2.21.5+cuda12.4", "checks: 3/3 passed"], "none reported"),
])
def test_transport_from_other_lines(lines, expected):
    # the rule itself, in coursetools.jobs (distlab_nccl_transport calls it: the recorded logs above go through bash)
    assert jobs.nccl_transport([f"dec0001:1:1 [0] {line}" for line in lines]).startswith(expected)


def test_transport_of_several_logs_and_of_none():
    assert out(f"distlab_nccl_transport {SOCKET_LOG} {OFI_LOG}").startswith("OFI")  # the last one read wins
    assert out("distlab_nccl_transport /nonexistent.log").startswith("none reported")


def test_sockets_on_a_slingshot_node_print_one_loud_warning():
    lines = out(f"distlab_report_transport {SOCKET_LOG}", DISTLAB_NETWORK="slingshot").splitlines()
    assert lines[0].startswith("distlab: NCCL transport: Socket (TCP on [0]hsn0")
    assert "WARNING: NCCL IS USING TCP SOCKETS ON A SLINGSHOT NODE" in lines[1]
    assert [ln for ln in lines if "WARNING" in ln] == [lines[1]]  # one, then the GPUDirect and plugin lines
    ofi = out(f"distlab_report_transport {OFI_LOG}", DISTLAB_NETWORK="slingshot").splitlines()
    assert not [ln for ln in ofi if "WARNING" in ln] and ofi[-1] == "distlab: NCCL net plugin: AWS Libfabric (v6)"
    # no Slingshot: sockets are all there is, nothing to warn about
    assert "WARNING" not in out(f"distlab_report_transport {SOCKET_LOG}", DISTLAB_NETWORK="none")


# ---------------------------------------------------------------------------------------------------
# Where the aws-ofi-nccl plugin is found, and what NCCL is told
# ---------------------------------------------------------------------------------------------------


def plugin(folder: Path, name: str = "libnccl-net.so") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("")
    return folder / name


def test_plugin_search_order(tmp_path):
    explicit, on_path, conda = tmp_path / "explicit", tmp_path / "ld", tmp_path / "env"
    for folder in (explicit, on_path, conda / "lib"):
        plugin(folder)
    env = dict(LD_LIBRARY_PATH=f"/nonexistent:{on_path}", CONDA_PREFIX=str(conda))
    assert out("distlab_find_nccl_plugin", DISTLAB_NCCL_PLUGIN_DIR=str(explicit), **env) == f"{explicit}/libnccl-net.so"
    assert out("distlab_find_nccl_plugin", **env) == f"{on_path}/libnccl-net.so"
    assert out("distlab_find_nccl_plugin", CONDA_PREFIX=str(conda)) == f"{conda}/lib/libnccl-net.so"
    missing = bash("distlab_find_nccl_plugin", LD_LIBRARY_PATH=str(tmp_path / "empty"))
    assert missing.returncode == 1 and missing.stdout == ""


def test_plugin_names_of_newer_aws_ofi_nccl(tmp_path):
    # newer builds install libnccl-net-ofi.so too; libnccl-net.so is preferred (NCCL opens it by default)
    only_ofi = plugin(tmp_path / "a", "libnccl-net-ofi.so")
    assert out("distlab_find_nccl_plugin", LD_LIBRARY_PATH=str(tmp_path / "a")) == str(only_ofi)
    plugin(tmp_path / "a", "libnccl-net.so")
    assert out("distlab_find_nccl_plugin", LD_LIBRARY_PATH=str(tmp_path / "a")) == str(tmp_path / "a" / "libnccl-net.so")


NETWORK = 'DISTLAB_NNODES=2; distlab_network_env; env | grep -E "^(NCCL_NET|NCCL_NET_PLUGIN|LD_LIBRARY_PATH)=" | sort'


def test_a_plugin_found_anywhere_is_put_on_the_library_path_and_required(tmp_path):
    plugin(tmp_path / "site", "libnccl-net-ofi.so")
    lines = out(NETWORK, DISTLAB_NETWORK="slingshot", DISTLAB_NCCL_PLUGIN_DIR=str(tmp_path / "site"),
                LD_LIBRARY_PATH="/usr/lib/other").splitlines()
    assert f"LD_LIBRARY_PATH={tmp_path / 'site'}:/usr/lib/other" in lines
    assert "NCCL_NET=AWS Libfabric" in lines  # NCCL fails at start rather than falling back to sockets
    assert "NCCL_NET_PLUGIN=ofi" in lines  # only libnccl-net-ofi.so: NCCL must be told its name


def test_no_plugin_leaves_nccl_net_unset_and_says_so(tmp_path):
    result = bash(NETWORK, DISTLAB_NETWORK="slingshot", LD_LIBRARY_PATH=str(tmp_path))
    assert "NCCL_NET=" not in result.stdout
    assert "no aws-ofi-nccl plugin found" in result.stdout


# ---------------------------------------------------------------------------------------------------
# Where a job writes: scratch, never over an earlier run
# ---------------------------------------------------------------------------------------------------

RUN_DIR = 'DISTLAB_NODES=dec0001; distlab_make_run_dir; echo "RUN_DIR=$DISTLAB_RUN_DIR"'


def run_dir_of(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout + result.stderr
    return next(ln for ln in result.stdout.splitlines() if ln.startswith("RUN_DIR="))[len("RUN_DIR="):]


def test_scratch_order(tmp_path):
    ours, sites_var, site = tmp_path / "ours", tmp_path / "scratch", tmp_path / "glade"
    for folder in (ours, sites_var, site):
        folder.mkdir()
    env = dict(SCRATCH=str(sites_var), DISTLAB_SITE_SCRATCH=str(site))
    assert out("distlab_scratch", DISTLAB_SCRATCH=str(ours), **env) == str(ours)
    assert out("distlab_scratch", **env) == str(sites_var)
    assert out("distlab_scratch", SCRATCH=str(tmp_path / "gone"), DISTLAB_SITE_SCRATCH=str(site)) == str(site)
    assert bash("distlab_scratch", SCRATCH=str(tmp_path / "gone")).returncode == 1


def test_run_directory_goes_to_scratch_and_says_what_it_writes(tmp_path):
    result = bash(RUN_DIR, SCRATCH=str(tmp_path), PBS_JOBID="777.desched1")
    assert run_dir_of(result) == f"{tmp_path}/distlab/runs/777.desched1"
    assert (tmp_path / "distlab" / "runs" / "777.desched1" / "hosts.txt").read_text() == "dec0001\n"
    assert f"this job writes to {tmp_path}/distlab/runs/777.desched1: " in result.stdout


def test_without_scratch_the_run_directory_is_in_the_repository(tmp_path):
    job = f"rules-test-{os.getpid()}"
    try:
        result = bash(RUN_DIR, PBS_JOBID=job, HOME=str(tmp_path))  # a laptop or CI: the course is not in $HOME
        assert run_dir_of(result) == str(ROOT / "runs" / job)
        assert "no scratch folder" in result.stdout
    finally:
        subprocess.run(["rm", "-rf", str(ROOT / "runs" / job)], check=True)


def test_a_batch_job_never_writes_into_a_repository_in_home(tmp_path):
    job = f"{os.getpid()}.desched1"  # a job id no earlier run can have left a folder for
    result = bash(RUN_DIR, PBS_JOBID=job, HOME=str(ROOT.parent))  # the course cloned into $HOME
    assert result.returncode == 2 and "the repository is in $HOME" in result.stderr
    assert not (ROOT / "runs" / job).exists()
    assert run_dir_of(bash(RUN_DIR, PBS_JOBID=job, HOME=str(ROOT.parent), SCRATCH=str(tmp_path))) == (
        f"{tmp_path}/distlab/runs/{job}")


def test_a_run_directory_that_holds_files_is_refused(tmp_path):
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "checkpoint.pt").write_text("a user's data")
    result = bash(RUN_DIR, DISTLAB_RUN_DIR=str(earlier))
    assert result.returncode == 2 and "already holds files" in result.stderr
    assert (earlier / "checkpoint.pt").read_text() == "a user's data" and not (earlier / "hosts.txt").exists()
    assert run_dir_of(bash(RUN_DIR, DISTLAB_RUN_DIR=str(earlier), DISTLAB_RUN_DIR_REUSE="1")) == str(earlier)
    (tmp_path / "empty").mkdir()
    assert run_dir_of(bash(RUN_DIR, DISTLAB_RUN_DIR=str(tmp_path / "empty"))) == str(tmp_path / "empty")


# ---------------------------------------------------------------------------------------------------
# The per-rank GPU report: python -m distlab.runtime under the job's own launcher
# ---------------------------------------------------------------------------------------------------


def test_rank_map_is_launched_like_every_script(tmp_path):
    fake_pals = tmp_path / "opt" / "cray" / "pals" / "bin" / "mpiexec"
    fake_pals.parent.mkdir(parents=True)
    fake_pals.write_text("#!/bin/sh\necho 'mpiexec version 1.2.12'\n")
    fake_pals.chmod(0o755)
    snippet = ("DISTLAB_NODES='dec0001 dec0002' DISTLAB_NNODES=2; distlab_make_run_dir >/dev/null; "
               "distlab_detect_mpiexec; DISTLAB_PYTHON=python3 DISTLAB_DRY_RUN=1 distlab_rank_map; "
               "tail -n 1 \"$DISTLAB_RUN_DIR/commands.sh\"")
    result = bash(snippet, DISTLAB_MPIEXEC=str(fake_pals), DISTLAB_RUN_DIR=str(tmp_path / "run"), DISTLAB_DEVICE="cuda")
    assert result.returncode == 0, result.stdout + result.stderr
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    assert command == [str(fake_pals), "-n", "8", "--ppn", "4", "--cpu-bind", "none", "python3", "-u", "-m",
                       "distlab.runtime", "--device", "cuda", "--metrics-out", str(tmp_path / "run" / "rank_map.json")]


def test_rank_map_output_names_host_rank_local_rank_devices_and_gpu():
    """The module the job runs, alone on this machine: one rank, its line, its checks (CPU: "uses cpu")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LEAKY + ("RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    result = subprocess.run([sys.executable, "-m", "distlab.runtime", "--device", "cpu", "--verbose"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=env | {"CUDA_VISIBLE_DEVICES": "3"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0  local rank 0  CUDA_VISIBLE_DEVICES=3  uses cpu" in result.stdout
    # --verbose: every rank's own line as it joins the job (runtime.start), with how it found its place
    verbose = [ln for ln in result.stdout.splitlines() if ln.startswith("[rank 0] host ")]
    assert len(verbose) == 1 and verbose[0].endswith("uses cpu  [single; single node: MASTER_ADDR = 127.0.0.1; "
                                                     "MASTER_PORT derived (default)]"), result.stdout
    assert "checks: 5/5 passed" in result.stdout and "[PASS] each rank's cores are on its GPU's NUMA node, no core shared on a node" in result.stdout


def test_the_transport_goes_into_the_run_summary(tmp_path):
    snippet = (f"DISTLAB_NODES=dec0001 DISTLAB_NNODES=1; distlab_make_run_dir >/dev/null; DISTLAB_RESULTS=('ok bandwidth.py 9s'); "
               f"distlab_report_transport {SOCKET_LOG} >/dev/null; distlab_finish")
    result = bash(snippet, DISTLAB_RUN_DIR=str(tmp_path / "run"), DISTLAB_NETWORK="slingshot")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "run" / "summary.txt").read_text().splitlines()
    assert summary[1:3] == ["  ok bandwidth.py 9s", "  NCCL transport: Socket (TCP on [0]hsn0:10.150.1.17<0> "
                            "[1]hsn1:10.150.1.18<0> [2]hsn2:10.150.1.19<0> [3]hsn3:10.150.1.20<0>)"]
    assert summary[3].startswith("  WARNING: NCCL IS USING TCP SOCKETS ON A SLINGSHOT NODE")


# ---------------------------------------------------------------------------------------------------
# Threads per rank: PBS's OMP_NUM_THREADS (the chunk's ncpus) is replaced, not kept
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env, expected", [
    ({"OMP_NUM_THREADS": "64", "NCPUS": "64"}, "16"),   # what PBS gives a Derecho job without ompthreads=
    ({"NCPUS": "64", "DISTLAB_GPUS_PER_NODE": "8"}, "8"),
    ({"OMP_NUM_THREADS": "64", "NCPUS": "64", "DISTLAB_OMP_THREADS": "4"}, "4"),
    ({"NCPUS": "2", "DISTLAB_GPUS_PER_NODE": "4"}, "1"),  # never 0
])
def test_every_rank_gets_its_share_of_the_nodes_cores(env, expected):
    assert out("distlab_omp_threads; echo $OMP_NUM_THREADS", **env) == expected


def test_a_bad_thread_count_stops_the_job():
    result = bash("distlab_omp_threads", DISTLAB_OMP_THREADS="many")
    assert result.returncode == 2 and "DISTLAB_OMP_THREADS=many is not a positive integer" in result.stderr


def test_the_rank_map_names_threads_and_libraries_and_fails_oversubscription():
    from distlab import runtime

    maps = ("7f00-7f01 r-xp 00000000 00:2f 1 /glade/u/apps/cuda/11.8/lib64/libcudart.so.11.0\n"
            "7f02-7f03 r-xp 00000000 00:2f 2 /conda/envs/distlab/lib/python3.11/site-packages/nvidia/nccl/lib/"
            "libnccl.so.2\n7f04-7f05 rw-p 00000000 00:00 0 \n")
    found = runtime.loaded_libraries(maps)
    assert found == {"libcudart": "/glade/u/apps/cuda/11.8/lib64/libcudart.so.11.0",
                     "libnccl": "/conda/envs/distlab/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"}
    rank = {"host": "dec0001", "omp_num_threads": "64", "torch_threads": 64, "cores": 64, "torch": "2.13.0",
            "cuda": "12.8", "nccl": "2.27.5", **found}
    line = runtime.format_software(rank)
    assert line.startswith("OMP_NUM_THREADS=64  torch threads 64 of 64 cores  torch 2.13.0, CUDA 12.8, NCCL 2.27.5")
    assert "libcudart /glade/u/apps/cuda/11.8/lib64/libcudart.so.11.0" in line
    assert runtime.oversubscribed_hosts([rank] * 4) == ["dec0001: 256 threads on 64 cores"]
    assert runtime.oversubscribed_hosts([{**rank, "torch_threads": 16}] * 4) == []


# ---------------------------------------------------------------------------------------------------
# Walltime, chained jobs and a tee that outlives SIGTERM
# ---------------------------------------------------------------------------------------------------

# what `qstat -f` prints of a running Derecho job (abridged; a long value folded onto a tab-led line, as PBS does)
QSTAT_F = """Job Id: 4242.desched1
    Job_Name = distlab-12-ops
    resources_used.walltime = 00:01:40
    job_state = R
    queue = main
    Resource_List.select = 2:ncpus=64:ngpus=4:mpiprocs=4:ompthreads=16:mem=480GB:
\tcpu_type=milan
    Resource_List.walltime = 00:20:00
"""


def fake_pbs(tmp_path):
    """Stand-ins for qstat (prints QSTAT_F), qsub and qdel (each records its arguments and prints a job id)."""
    (tmp_path / "qstat.out").write_text(QSTAT_F)
    tools = {}
    for name, body in (("qstat", f'cat {tmp_path}/qstat.out'),
                       ("qsub", f'printf "%s\\n" "$@" > {tmp_path}/qsub.args; echo 4243.desched1'),
                       ("qdel", f'printf "%s\\n" "$@" > {tmp_path}/qdel.args')):
        tool = tmp_path / name
        tool.write_text(f"#!/bin/bash\n{body}\n")
        tool.chmod(0o755)
        tools[f"DISTLAB_{name.upper()}"] = str(tool)
    return tools


@pytest.mark.parametrize("duration, seconds", [("00:20:00", 1200), ("12:00:00", 43200), ("90", 90), ("01:30", 90)])
def test_pbs_durations(duration, seconds):
    assert jobs.seconds(duration) == seconds  # coursetools.jobs; distlab_seconds calls it (the deadline test below)


def test_a_folded_qstat_value_is_read_whole(tmp_path):
    tools = fake_pbs(tmp_path)
    assert out("distlab_qstat_field Resource_List.select", PBS_JOBID="4242.desched1", **tools) == (
        "2:ncpus=64:ngpus=4:mpiprocs=4:ompthreads=16:mem=480GB:cpu_type=milan")
    assert out("distlab_qstat_field queue", PBS_JOBID="4242.desched1", **tools) == "main"


def test_the_deadline_is_the_jobs_end_less_the_margin(tmp_path):
    tools = fake_pbs(tmp_path)
    got = out('now=$(date +%s); distlab_deadline >/dev/null; echo $((DISTLAB_DEADLINE - now))',
              PBS_JOBID="4242.desched1", **tools)
    # walltime - used - margin, from the moment the job read its clock: up to a few seconds after the test's `now`
    # (the two durations are read by python on the way, slow to start on a loaded machine)
    assert 1200 - 100 - 120 <= int(got) <= 1200 - 100 - 120 + 3
    assert out('distlab_deadline >/dev/null; echo "${DISTLAB_DEADLINE:-none}"') == "none"  # no PBS job: none
    assert out("distlab_deadline >/dev/null; echo $DISTLAB_DEADLINE", PBS_WALLTIME="600",
               DISTLAB_WALLTIME_MARGIN="60").isdigit()
    short = bash("distlab_deadline", PBS_WALLTIME="60")
    assert short.returncode == 2 and "is not longer than DISTLAB_WALLTIME_MARGIN" in short.stderr


def test_the_deadline_counts_from_the_jobs_start_time_not_the_sampled_walltime_used(tmp_path):
    # stime is set when the job starts (OpenPBS req_runjob.c); resources_used.walltime is the MoM's last sample,
    # up to 120 s old: here it says 10 s, but the job started 100 s ago, and the deadline counts from the start
    import time

    tools = fake_pbs(tmp_path)
    started = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(time.time() - 100))
    (tmp_path / "qstat.out").write_text(QSTAT_F.replace("00:01:40", "00:00:10") + f"    stime = {started}\n")
    got = out('now=$(date +%s); distlab_deadline >/dev/null; echo $((DISTLAB_DEADLINE - now))',
              PBS_JOBID="4242.desched1", **tools)
    assert 1200 - 100 - 120 - 2 <= int(got) <= 1200 - 100 - 120 + 1



@pytest.mark.parametrize("started_ago, said", [
    (1230, ["distlab: SIGTERM at the walltime: ", "not launched train_ddp.py: the job reached its walltime (SIGTERM)",
            "  not-launched train_ddp.py (walltime)"]),
    (100, ["distlab: SIGTERM: ", "not launched train_ddp.py: the job got SIGTERM", "  not-launched train_ddp.py (SIGTERM)"]),
])
def test_a_sigterm_past_the_walltime_is_named_by_pbss_name_for_the_limit(tmp_path, started_ago, said):
    # PBS's MoM ends a job whose walltime used passed Resource_List.walltime ("walltime N exceeded limit M", OpenPBS
    # src/resmom/mom_main.c:6023-6037): a SIGTERM at or after the job's end (stime + walltime) is that, named
    # "walltime" as PBS names it, as Slurm's job names its "time limit"; a qdel before it is a plain SIGTERM
    import time

    tools = fake_pbs(tmp_path)
    started = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(time.time() - started_ago))
    (tmp_path / "qstat.out").write_text(QSTAT_F + f"    stime = {started}\n")
    (tmp_path / "run").mkdir()
    done = bash("distlab_deadline >/dev/null; echo end=$((${DISTLAB_JOB_END:-0} - $(date +%s))); distlab_on_sigterm; "
                "distlab_launch scripts/04_data_parallel/train_ddp.py; distlab_finish", PBS_JOBID="4242.desched1",
                DISTLAB_RUN_DIR=str(tmp_path / "run"), DISTLAB_NNODES="1", DISTLAB_NODES="n1", **tools)
    lines = done.stdout.splitlines()
    assert abs(int(lines[0].removeprefix("end=")) - (1200 - started_ago)) <= 3, lines[0]
    assert lines[1].startswith(said[0]) and f"distlab: {said[1]}" in lines and said[2] in lines, done.stdout
    assert done.returncode == 1, done.stdout + done.stderr  # stopped before its scripts ran: not a success
    readme = " ".join((ROOT / "pbs" / "README.md").read_text().split())
    assert "`SIGTERM at the walltime`, and each launch held back reads `not-launched NAME (walltime)`" in readme

@pytest.mark.parametrize("queue, kill_delay", [("gpu", 30), ("gpu", None), ("", None)])
def test_the_term_trap_names_the_queues_kill_delay(tmp_path, queue, kill_delay):
    # PBS's SIGKILL follows its TERM by the queue's kill_delay (qstat -Qf; 10 s where the queue sets none: OpenPBS
    # src/server/req_runjob.c:948, 991-994), at the MoM's next poll (coursetools.jobs.mom_sigkill_after): the trap's
    # line says so, from pbs/common.sh, not from a default of the shared jobs/common.sh
    tools = fake_pbs(tmp_path)
    listing = f"Queue: gpu\n    queue_type = Execution\n" + (f"    kill_delay = {kill_delay}\n" if kill_delay else "")
    (tmp_path / "qstat.queue").write_text(listing)
    (tmp_path / "qstat").write_text(f'#!/bin/bash\nif [[ $1 == -Qf ]]; then [[ $2 == gpu ]] && cat {tmp_path}/qstat.queue; '
                                    f'else cat {tmp_path}/qstat.out; fi\n')
    said = out("distlab_deadline >/dev/null; DISTLAB_CURRENT=fault_drill.py DISTLAB_CHECKPOINTING=fault_drill.py "
               "distlab_on_sigterm", PBS_JOBID="4242.desched1", PBS_QUEUE=queue, **tools)
    delay = kill_delay or 10
    walltime = jobs.mom_sigkill_after(0, delay)
    qdel = [jobs.mom_sigkill_after(last, delay) for last in range(jobs.MAX_CHECK_POLL_TIME)]
    whose = f"the queue's kill_delay, {delay} s" if kill_delay else "kill_delay, 10 s unless the queue sets another"
    assert (f"before the KILL, about {walltime} s after the walltime's TERM, {min(qdel)} to {max(qdel)} s after a "
            f"qdel's ({whose}, at the MoM's next poll; none after qsig -s TERM)") in said, said
    assert (walltime, min(qdel), max(qdel)) == ((48, 38, 48) if kill_delay == 30 else (10, 10, 25))


def test_a_rerun_job_writes_a_folder_of_its_own_and_finds_its_checkpoints(tmp_path):
    # qrerun (or a lost node) runs the job again with the same PBS_JOBID; PBS sets no variable for it, but qstat -f's
    # run_count counts the runs (OpenPBS req_runjob.c adds one each time the job is sent to run)
    tools = fake_pbs(tmp_path)
    run = tmp_path / "run"
    (run / "fault_drill").mkdir(parents=True)
    snippet = 'distlab_restart_count; DISTLAB_NODES=n1 distlab_make_run_dir >/dev/null && echo "$DISTLAB_RUN_DIR|$DISTLAB_JOB_RUN_DIR"'
    (tmp_path / "qstat.out").write_text(QSTAT_F + "    run_count = 2\n")
    assert out(snippet, PBS_JOBID="4242.desched1", DISTLAB_RUN_DIR=str(run), **tools) == f"{run}.restart1|{run}"
    (tmp_path / "qstat.out").write_text(QSTAT_F + "    run_count = 1\n")  # the first run: the folder is refused
    first = bash(snippet, PBS_JOBID="4242.desched1", DISTLAB_RUN_DIR=str(run), **tools)
    assert first.returncode == 2 and "already holds files" in first.stderr


def test_the_chained_job_keeps_the_select_line_walltime_and_queue(tmp_path):
    # submitted to the routing queue main, running in the execution queue gpu (qstat's queue = ... too): the
    # successor goes to main, the queue that takes submissions
    tools = fake_pbs(tmp_path)
    (tmp_path / "qstat.out").write_text(QSTAT_F.replace("queue = main", "queue = gpu"))
    # the settings the job was given (qsub -v) go on too: qsub hands the next job only its -v variables; not this
    # job's own run folder, nor the chain's count, which the caller names
    job = out("distlab_chain_next pbs/12_hpc_operations.pbs DISTLAB_CHAIN=1 DISTLAB_ONLY=a.py,b.py", PBS_JOBID="4242.desched1",
              PBS_QUEUE="gpu", PBS_O_QUEUE="main", PBS_ACCOUNT="UABC0001", DISTLAB_CONDA_ENV="mine",
              DISTLAB_DRILL_STEPS="1000", DISTLAB_RUN_DIR="/scratch/run1", DISTLAB_CHAIN="2", **tools)
    assert job == "4243.desched1"
    args = (tmp_path / "qsub.args").read_text().splitlines()
    assert args[:-2] == [
        "-W", "depend=afterany:4242.desched1", "-A", "UABC0001", "-q", "main",
        "-l", "select=2:ncpus=64:ngpus=4:mpiprocs=4:ompthreads=16:mem=480GB:cpu_type=milan",
        "-l", "walltime=00:20:00", "-v"] and args[-1] == "pbs/12_hpc_operations.pbs"
    variables = args[-2].split(",")  # qsub -v splits at commas: a list goes on with colons
    assert variables[-2:] == ["DISTLAB_CHAIN=1", "DISTLAB_ONLY=a.py:b.py"]
    assert {"DISTLAB_CONDA_ENV=mine", "DISTLAB_DRILL_STEPS=1000"} <= set(variables)
    assert not any(v.startswith(("DISTLAB_RUN_DIR=", "DISTLAB_FUNCTIONS_ONLY=", "DISTLAB_CHAIN=2")) for v in variables)


def test_the_chained_job_keeps_the_users_agent_timeout_and_nccl_debug(tmp_path):
    # qsub hands the next job only its -v variables: the user's TORCH_ELASTIC_SHUTDOWN_TIMEOUT and NCCL_DEBUG go on as
    # the header says (else the successor's agents fall back to the margin, and NCCL to WARN); the values this job set
    # for itself (the margin, NCCL's WARN default) do not, as the successor makes its own
    tools = fake_pbs(tmp_path)

    def carried(**env: str) -> list[str]:
        out("distlab_network_env; distlab_chain_next pbs/12_hpc_operations.pbs DISTLAB_CHAIN=1",
            PBS_JOBID="4242.desched1", DISTLAB_NETWORK="slingshot", DISTLAB_NNODES="1", DISTLAB_SYS_NET=str(tmp_path),
            **tools, **env)
        args = (tmp_path / "qsub.args").read_text().splitlines()
        return args[args.index("-v") + 1].split(",")

    given = carried(TORCH_ELASTIC_SHUTDOWN_TIMEOUT="300", NCCL_DEBUG="INFO")
    assert {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=300", "NCCL_DEBUG=INFO"} <= set(given), given
    own = carried()  # the job's own: the margin (120) and, on Slingshot, WARN
    assert not any(v.startswith(("TORCH_ELASTIC_SHUTDOWN_TIMEOUT=", "NCCL_DEBUG=")) for v in own), own
    header = " ".join((ROOT / "pbs" / "12_hpc_operations.pbs").read_text().replace("#", " ").split())
    assert ("each with this job's select line, walltime and queue, its DISTLAB_* settings, and the "
            "TORCH_ELASTIC_SHUTDOWN_TIMEOUT and NCCL_DEBUG you gave it (qsub -v; no other variable is carried)") in header


@pytest.mark.parametrize("extra, checks, cancelled", [
    ({}, [{"passed": True}], True),                                   # complete: the successor is not needed
    ({"stopped_by": "deadline"}, [{"passed": True}], False),         # stopped early: the chain goes on
    ({}, [{"passed": False}], False),                                 # a failed run: kept for a look
])
def test_a_completed_run_cancels_the_chains_next_job(tmp_path, extra, checks, cancelled):
    import json

    tools = fake_pbs(tmp_path)
    metrics = tmp_path / "fault_drill.json"
    metrics.write_text(json.dumps({"extra": extra, "checks": checks}))
    # the successor's id, noted by distlab_chain_successor: gone with the successor, so that a rerun chains afresh
    (tmp_path / "chain_next").write_text("4243.desched1\n")
    out(f"DISTLAB_PYTHON={sys.executable}; distlab_chain_done 4243.desched1 {metrics}", DISTLAB_JOB_RUN_DIR=str(tmp_path),
        **tools)
    assert (tmp_path / "qdel.args").exists() == cancelled
    assert (tmp_path / "chain_next").exists() != cancelled
    if cancelled:
        assert (tmp_path / "qdel.args").read_text().split() == ["4243.desched1"]


@pytest.mark.parametrize("tee", ["distlab_tee", "tee"])
def test_the_log_outlives_a_sigterm_to_the_whole_job(tmp_path, tee):
    # PBS signals every process of the job: the ranks (here: a loop that, like fault_drill.py, catches SIGTERM and
    # goes on to its checkpoint line) and the tee of their output. Plain tee dies and the rank's next line breaks
    # its pipe; distlab_tee keeps the log to the last line.
    import signal
    import time

    log = tmp_path / "job.log"
    rank = ("trap 'echo SIGTERM seen' TERM; for i in 1 2 3 4 5 6; do echo step $i; sleep 0.2; done; "
            "echo checkpoint written")
    job = subprocess.Popen(["bash", "-c", f"source pbs/common.sh || exit 9\n"
                                          f"bash -c {shlex.quote(rank)} | {tee} {log}"],
                           cwd=ROOT, env={**os.environ, "DISTLAB_FUNCTIONS_ONLY": "1"}, start_new_session=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    os.killpg(job.pid, signal.SIGTERM)
    job.wait(timeout=10)
    time.sleep(1.5)  # the rank goes on after the job's shell is gone
    kept = log.read_text()
    if tee == "distlab_tee":
        assert "checkpoint written" in kept and "step 6" in kept
    else:
        assert "checkpoint written" not in kept  # the check can fail: plain tee loses the end


# ---------------------------------------------------------------------------------------------------
# NCCL's own lines: one file a rank in the run folder; GPUDirect RDMA and the net plugin read from them
# ---------------------------------------------------------------------------------------------------

# NCCL's format strings (src/transport/net.cc, src/plugin/net.cc) filled in; hosts and pids made up
SEND_GDR = "dec0001:4128:4190 [0] NCCL INFO Channel 00/0 : 0[0] -> 4[0] [send] via NET/AWS Libfabric/0/GDRDMA"
SEND_HOST = "dec0001:4128:4190 [0] NCCL INFO Channel 01/0 : 0[0] -> 4[0] [send] via NET/AWS Libfabric/1"
LOADED = "dec0001:4128:4128 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v9)"
TOO_OLD = ["dec0001:4128:4128 [0] NCCL INFO NET/Plugin: Failed to find ncclNetPlugin_v10 symbol.",
           "dec0001:4128:4128 [0] NCCL INFO NET/Plugin: Failed to find ncclNetPlugin_v9 symbol."]
# NCCL >= 2.28.3 says it once, with the library's path (src/plugin/net.cc:100 at v2.28.3-1)
UNSUPPORTED = ["dec0001:4128:4128 [0] NCCL INFO External network plugin /opt/ofi/lib/libnccl-net.so is unsupported"]
NO_PLUGIN = "GPUDirect RDMA: not reported (no network channel in the logs: one node, or NCCL_DEBUG_SUBSYS without NET)"


@pytest.mark.parametrize("lines, expected", [
    ([LOADED, SEND_GDR, SEND_HOST], ["GPUDirect RDMA: yes (1 of 2 network send channels)",
                                     "net plugin: Libfabric (v9)"]),
    ([LOADED, SEND_HOST], ["GPUDirect RDMA: no (0 of 1 network send channels: the NIC reaches GPU memory through "
                           "host buffers)", "net plugin: Libfabric (v9)"]),
    (TOO_OLD, [NO_PLUGIN, "net plugin: none loaded (Failed to find ncclNetPlugin_v10 symbol: a plugin older than "
                          "this NCCL's interface, or not a net plugin; NCCL falls back to its own sockets)"]),
    (UNSUPPORTED + ["x"], [NO_PLUGIN, "net plugin: none loaded (External network plugin /opt/ofi/lib/libnccl-net.so is "
                                      "unsupported: a plugin older than this NCCL's interface, or not a net plugin; "
                                      "NCCL falls back to its own sockets)"]),
])
def test_gpudirect_rdma_and_the_net_plugin_from_ncclS_lines(tmp_path, lines, expected):
    # two ranks' files, as NCCL_DEBUG_FILE=.../nccl.%h.%p.log writes them; the rule is coursetools.jobs's, through
    # bash once (distlab_nccl_details), the other cases called directly
    (tmp_path / "nccl.dec0001.4128.log").write_text("\n".join(lines[:1]) + "\n")
    (tmp_path / "nccl.dec0001.4129.log").write_text("\n".join(lines[1:]) + "\n")
    files = sorted(str(p) for p in tmp_path.glob("nccl.*.log"))
    assert jobs.nccl_details(jobs.read_lines(files)) == expected
    if lines[0] == LOADED:
        assert out(f"distlab_nccl_details {tmp_path}/nccl.*.log").splitlines() == expected


def test_ncclS_debug_file_is_one_a_rank_in_the_run_folder(tmp_path):
    got = out(f"DISTLAB_RUN_DIR={tmp_path}; DISTLAB_NETWORK=none; distlab_network_env >/dev/null; "
              "echo $NCCL_DEBUG_FILE")
    assert got == f"{tmp_path}/nccl/nccl.%h.%p.log" and (tmp_path / "nccl").is_dir()
    assert out("distlab_network_env >/dev/null; echo $NCCL_DEBUG_FILE", NCCL_DEBUG_FILE="/mine/%h.log",
               DISTLAB_NETWORK="none") == "/mine/%h.log"


def test_the_transport_launch_gets_ncclS_info_lines_on_a_slingshot_node_unless_the_user_set_nccl_debug(tmp_path):
    # distlab_network_env exports NCCL_DEBUG=WARN on Slingshot before a job's launches: pbs/03's bandwidth launch
    # must still run with INFO (its transport report reads those lines), and a user's own choice must win
    (tmp_path / "net" / "hsn0").mkdir(parents=True)
    env = {"DISTLAB_SYS_NET": str(tmp_path / "net"), "DISTLAB_NETWORK": "auto", "DISTLAB_NNODES": "2"}
    show = "distlab_network_env >/dev/null; echo $NCCL_DEBUG; distlab_nccl_info printenv NCCL_DEBUG NCCL_DEBUG_SUBSYS"
    assert out(show, **env).split() == ["WARN", "INFO", "INIT,NET"]
    assert out(show, NCCL_DEBUG="TRACE", **env).split() == ["TRACE", "TRACE", "INIT,NET"]
    job = (ROOT / "pbs" / "03_communication.pbs").read_text()
    assert "distlab_nccl_info distlab_launch scripts/03_communication/bandwidth.py" in job


def test_ncclS_warn_lines_are_named_in_the_summary(tmp_path):
    (tmp_path / "nccl").mkdir()
    warn = "dec0001:4128:4190 [0] NCCL WARN NET/OFI Unable to find a protocol that works"
    (tmp_path / "nccl" / "nccl.dec0001.4128.log").write_text(f"x NCCL INFO fine\n{warn}\n")
    (tmp_path / "nccl" / "nccl.dec0002.77.log").write_text("x NCCL INFO fine\n")
    got = out("distlab_nccl_warnings", DISTLAB_RUN_DIR=str(tmp_path)).splitlines()
    assert got == [f"NCCL WARN lines: 1, in {tmp_path}/nccl/ (one file a rank); the first:",
                   f"    nccl.dec0001.4128.log:{warn}"]
    (tmp_path / "nccl" / "nccl.dec0001.4128.log").write_text("x NCCL INFO fine\n")
    assert out("distlab_nccl_warnings", DISTLAB_RUN_DIR=str(tmp_path)) == ""
