"""A real two-node Slurm cluster on this one machine, for the tests of the course's Slurm path.

Debian's Slurm (``slurmctld``, ``slurmd``, ``slurm-client``) and ``munge`` run, as root, a controller and two node
daemons (``slurmd -N n1``, ``slurmd -N n2``: Debian builds Slurm with multiple-slurmd) with no network beyond
loopback. Jobs are then submitted with the real ``sbatch``, run by the real ``srun``, read with ``scontrol`` and
cancelled with ``scancel``. The configuration and the start order are the ones measured in shared/SLURM_NOTES.md:

1. a munge key, then ``munged`` on a socket of its own (wait until ``munge -n`` works);
2. ``slurmctld -D``, then ``slurmd -D -N n1`` and ``slurmd -D -N n2``;
3. wait until ``sinfo`` shows both nodes idle.

Everything lives in one temporary folder; every daemon is started here, its PID kept, and stopped by that PID
(never by name: other Slurm or munge processes on the machine are not ours). ``python -m coursetools.slurm_cluster``
starts one, prints how to use it, and stops it on Ctrl-C.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
# One installer at a time on this machine (ensure_installed); root's, as the install is
INSTALL_LOCK = Path(tempfile.gettempdir()) / "distlab-slurm-install.lock"
APT_LOCK_WAIT = 300
NODES = ("n1", "n2")
CPUS_PER_NODE = 16  # more than the machine has: slots for several small jobs at once (config_overrides below)
GPUS_PER_NODE = 8  # count-only GPUs (no device files): each test job asks 2 a node, so four jobs run side by side
# A site's MpiDefault: pmi2, as many sites set it, so srun sets PMI_RANK/PMI_SIZE unless told --mpi=none (the course's
# jobs must still see Slurm's own ranks: tests/slurm asserts the launcher distlab.runtime read)
MPI_DEFAULT = "pmi2"
# AuthInfo's cred_expire (Slurm's default 120 s, at least 5: src/interfaces/cred.c) is also how long a requeued job
# waits before it may start again (src/slurmctld/job_mgr.c, _requeue_delay): 10 s keeps the requeue test short
CRED_EXPIRE = 10
PARTITION = "gpu"  # the partition the course's slurm/ jobs name
# How long slurmctld keeps an ended job's record, which the tests read with scontrol (no slurmdbd here): Slurm's
# default, 300 s (slurm.conf.5, MinJobAge), ran out on a loaded machine before the tier read its bad-input jobs
# ("slurm_load_jobs error: Invalid job id specified")
MIN_JOB_AGE = 3600

SLURM_CONF = """\
ClusterName=ci
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket.2,cred_expire={cred_expire}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
MpiDefault={mpi_default}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge={min_job_age}
KillWait={kill_wait}
FirstJobId={first_job_id}
Waittime=0
{nodes}
PartitionName={partition} Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
"""
NODE_LINE = ("NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory=1000 "
             "Gres=gpu:{gpus} State=UNKNOWN")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installable, not root): the one line the tests skip with."""


def _installed() -> bool:
    return all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey"))


def ensure_installed() -> None:
    """Install Debian's Slurm and munge when a daemon is missing, as .ci/run installs Chromium.

    make test's workers may each start a cluster (the cluster's own tests and the jobs' run on different workers):
    on a machine without Slurm both called apt-get at once, and the second failed on dpkg's lock ("Unable to acquire
    the dpkg frontend lock"), skipping its half of the tier. One process installs under INSTALL_LOCK; the others wait
    for it and find Slurm installed. apt-get itself waits up to APT_LOCK_WAIT s for dpkg's lock held by anything else
    (an unattended upgrade): DPkg::Lock::Timeout, apt 1.9.11 and later; apt-get gives up at once without it."""
    if _installed():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and cannot be here (needs root and apt-get): "
                               "apt-get install slurmctld slurmd slurm-client munge")
    with open(INSTALL_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed():  # another process installed it while this one waited
            return
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        apt = ["apt-get", "-o", f"DPkg::Lock::Timeout={APT_LOCK_WAIT}"]
        install = [*apt, "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:  # a machine whose package lists are stale or absent
            subprocess.run([*apt, "update", "-qq"], env=env, capture_output=True)
            done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {last}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """``with SlurmCluster() as cluster: cluster.sbatch(...)``: two idle nodes inside, every daemon gone after."""

    def __init__(self, kill_wait: int = 5, mpi_default: str = MPI_DEFAULT):
        # a folder of its own under /tmp, not pytest's (mode 700): munged wants execute for all on its socket's path
        self.root = Path(tempfile.mkdtemp(prefix="distlab-slurm-"))
        self.kill_wait = kill_wait
        self.mpi_default = mpi_default
        self.processes: dict[str, subprocess.Popen] = {}
        self.conf = self.root / "slurm.conf"

    # ---- start and stop ---------------------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        try:
            self.start(timeout=20)
        except BaseException:
            self.stop(keep_logs=True)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> None:
        ensure_installed()
        root = self.root
        for sub in ("munge", "state", "log", "run", *(f"spool/{n}" for n in NODES)):
            (root / sub).mkdir(parents=True, exist_ok=True)
        for folder in (root, root / "munge"):  # munged refuses a socket path without execute for all on the way
            folder.chmod(0o755)
        ports = [_free_port() for _ in range(2 + len(NODES))]
        nodes = "\n".join(NODE_LINE.format(name=n, port=p, cpus=CPUS_PER_NODE, gpus=GPUS_PER_NODE)
                          for n, p in zip(NODES, ports[2:]))
        # gres.conf beside slurm.conf: GPUs that Slurm counts and hands out. A GPU needs a File= (slurmd ignores a
        # file-less one and the node turns INVAL); plain files stand in for /dev/nvidiaN, nothing is bound to them.
        (root / "dev").mkdir(exist_ok=True)
        for i in range(GPUS_PER_NODE):
            (root / "dev" / f"nvidia{i}").touch()
        (root / "gres.conf").write_text(f"AutoDetect=off\nName=gpu File={root}/dev/nvidia[0-{GPUS_PER_NODE - 1}]\n")
        # Job ids from a random start: the jobs derive MASTER_PORT from their id (distlab_port_from_job_id), so two
        # test clusters on one machine (two checkouts' test runs) numbering both from 1 would give their jobs the
        # same port at the same time (EADDRINUSE seen on job 2's port, 30962, beside another checkout's tier).
        first_job_id = secrets.randbelow(9_000_000) + 1_000_000
        self.conf.write_text(SLURM_CONF.format(root=root, first_job_id=first_job_id, ctld_port=ports[0], slurmd_port=ports[1],
                                               kill_wait=self.kill_wait, min_job_age=MIN_JOB_AGE, nodes=nodes, node_list=",".join(NODES),
                                               mpi_default=self.mpi_default, cred_expire=CRED_EXPIRE,
                                               partition=PARTITION))
        key, socket_path = root / "munge" / "munge.key", root / "munge" / "munge.socket.2"
        subprocess.run(["mungekey", "-c", "-b", "1024", "-k", str(key)], check=True, capture_output=True)
        self._spawn("munged", ["munged", "-F", f"--key-file={key}", f"--socket={socket_path}",
                               f"--pid-file={root}/run/munged.pid", f"--log-file={root}/log/munged.log",
                               f"--seed-file={root}/munge/munged.seed"])
        self._wait("munge", lambda: subprocess.run(["munge", "-S", str(socket_path), "-n"],
                                                   capture_output=True).returncode == 0, timeout)
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in NODES:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._start_reaper()
        self._wait("two idle nodes", lambda: self.run(["sinfo", "-h", "-t", "idle", "-o", "%D"],
                                                      check=False).stdout.strip() == str(len(NODES)), timeout)

    def _start_reaper(self) -> None:
        """A watcher that outlives this process: should it die without stop() (killed, a test run cut short), the
        watcher sends SIGTERM to the daemons this object started, by their PIDs, and removes the folder."""
        pids = " ".join(str(p.pid) for p in self.processes.values())
        watch = (f"import os, shutil, signal, time\n"
                 f"while True:\n"
                 f"    time.sleep(0.5)\n"
                 f"    try:\n        os.kill({os.getpid()}, 0)\n    except ProcessLookupError:\n        break\n"
                 f"for pid in [{pids.replace(' ', ', ')}]:\n"
                 f"    try:\n        os.kill(pid, signal.SIGTERM)\n    except ProcessLookupError:\n        pass\n"
                 f"time.sleep(3)\nshutil.rmtree({str(self.root)!r}, ignore_errors=True)\n")
        self.reaper = subprocess.Popen([sys.executable, "-c", watch], start_new_session=True,
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")
        self.processes[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.env(), start_new_session=True)
        log.close()

    def _wait(self, what: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.processes.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm test cluster did not reach {what} "
                                   f"({'exited: ' + ', '.join(dead) if dead else f'{timeout:g} s'}); logs in "
                                   f"{self.root / 'log'}")
            time.sleep(0.1)

    reaper: subprocess.Popen | None = None

    def stop(self, keep_logs: bool = False) -> None:
        """Stop the daemons this object started, by their PIDs, the node daemons first; KILL what outlives 10 s.
        Jobs still queued or running are cancelled first (scancel), so that their job steps end with them."""
        if self.processes.get("slurmctld") and self.processes["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--partition", PARTITION], check=False)
            deadline = time.monotonic() + 10
            while self.run(["squeue", "-h"], check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        for name in reversed(list(self.processes)):
            process = self.processes[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for name, process in self.processes.items():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        if self.reaper is not None and self.reaper.poll() is None:  # stopped properly: the watcher is not needed
            self.reaper.kill()
            self.reaper.wait()
        if not keep_logs:  # a cluster that failed to start keeps its logs, for the error's "logs in ..."
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- clients ----------------------------------------------------------------------------------------------
    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a client command: SLURM_CONF names this cluster; no Slurm job variables leak in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        return env | {"SLURM_CONF": str(self.conf)} | extra

    def run(self, argv: list[str], check: bool = True, **env: str) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, env=self.env(**env), capture_output=True, text=True, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def sbatch(self, *args: str, cwd: str | os.PathLike | None = None, **env: str) -> str:
        """Submit; the job's id."""
        done = subprocess.run(["sbatch", "--parsable", *args], env=self.env(**env), cwd=cwd, capture_output=True,
                              text=True, timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (kept MinJobAge seconds after the end; no sacct without slurmdbd)."""
        text = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        fields = {}
        for word in text.split():
            key, sep, value = word.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait(self, job_id: str, timeout: float = 120) -> dict[str, str]:
        """Wait until the job has ended; its fields. A job still running at the timeout is cancelled first."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "SIGNALING",
                                              "STAGE_OUT", "RESIZING", "REQUEUED"):
                return fields
            if time.monotonic() > deadline:
                self.run(["scancel", job_id], check=False)
                raise TimeoutError(f"Slurm job {job_id} still {fields.get('JobState')} after {timeout:g} s")
            time.sleep(0.2)


def main() -> int:
    try:
        with SlurmCluster() as cluster:
            print(f"two idle nodes; in another shell:\n  export SLURM_CONF={cluster.conf}\n  sinfo\n"
                  "Ctrl-C stops every daemon this started.", flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
    except SlurmUnavailable as exc:
        print(f"slurm_cluster: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())
