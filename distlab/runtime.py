"""Join a distributed job, whoever started it, and leave it cleanly.

Every script of the course starts the same way::

    args = runtime.parser(__doc__, ...).parse_args()
    with runtime.start(args) as rt:          # rank, world size, device, process group
        rt.require(args.batch % rt.world_size == 0, "...")   # checked on every rank, before any collective
        ...

What this module decides, once, for every script:

* **Who am I?** ``launcher_env()`` reads the variables that torchrun (known by ``TORCHELASTIC_RUN_ID``),
  mpiexec (Cray PALS, MPICH/PMI, OpenMPI) or Slurm's srun (with or without an MPI plugin) set, refuses a
  ``RANK``/``WORLD_SIZE`` that contradicts them, and falls back to a world of one.
* **Which attempt?** Under torchrun the ranks agree on it through the agent's store (``agree_on_attempt``),
  so the keys of a failed attempt are never read by the next one, on one node or several.
* **Where is rank 0?** ``MASTER_ADDR``/``MASTER_PORT`` when the launcher (or our PBS job) sets them;
  otherwise the first host of the Slurm or PBS node list, and a port derived from the job id.
* **Which device and backend?** cuda+nccl when a GPU is present, else cpu+gloo; ``--device`` overrides,
  and asking for cuda where there is none is a configuration error.
* **Bad configuration** is a ``ConfigError``: every rank prints one line and exits with code 2 within
  seconds, before any collective could hang.
* **Every process group has a timeout** (``--pg-timeout``, default 300 s; ``DISTLAB_PG_TIMEOUT`` overrides).
* **Which GPU is mine?** The local rank picks it. A launcher that sets no local rank of its own (a Cray PALS
  job without ``PALS_LOCAL_RANKID``) falls back to the other launchers' variables; none at all on a node with
  several ranks is a configuration error, not every rank on GPU 0.
* **Which cores?** In the course's jobs (``DISTLAB_GPU_AFFINITY=numa``) a GPU rank moves its threads to its GPU's
  NUMA node, read from sysfs (``bind_to_gpu``): on nodes whose GPUs are wired in another order than the launcher's
  blocks of cores, task i's cores are otherwise far from GPU i. The rank map checks it.
* **Where am I?** ``--verbose`` (or ``DISTLAB_VERBOSE=1``) makes every rank print its host, rank, local rank,
  ``CUDA_VISIBLE_DEVICES`` and the GPU it uses. ``python -m distlab.runtime`` does only that, for every rank
  of a job, and checks that no two ranks of a node share a GPU (the PBS preflight job runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import io
import os
import random
import re
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_ERROR_EXIT_CODE = 2
CHECK_FAILED_EXIT_CODE = 1
DEFAULT_PG_TIMEOUT_S = 300
DEFAULT_MASTER_PORT = 29500


class ConfigError(Exception):
    """A configuration that cannot run: reported as one line, exit code 2, on every rank."""


# --------------------------------------------------------------------------------------------------
# Who am I? Reading the launcher's environment (pure functions: unit-tested per launcher)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LauncherEnv:
    """Where this process sits in the job, as its launcher described it."""

    launcher: str  # "torchrun", "pals", "mpich", "openmpi", "slurm", "env" (RANK/WORLD_SIZE alone) or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    notes: tuple[str, ...] = field(default=())  # how master_addr/port were found, for --verbose runs


def _int(env: dict, *names: str) -> int | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None
    return None


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm/PBS compressed host list: ``"dec[0001-0003,0007],login1"`` -> 4 names + ``login1``."""
    hosts: list[str] = []
    # split on commas that are not inside brackets
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


# Derived ports stay in 20000-31999, as jobs/common.sh's distlab_port_from_job_id: below Linux's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default), where the kernel picks the local ports of outgoing
# connections, so with that default range, and only then, a derived port is never already taken by some process's
# outgoing connection on that node (a site that widens the range loses this: chapter 12.4 says so).
PORT_RANGE = (20000, 32000)


def _port_from_job_id(job_id: str) -> int:
    # Every rank of one job derives the same port; two jobs sharing a node rarely collide.
    digest = int(hashlib.sha256(job_id.encode()).hexdigest(), 16)
    low, high = PORT_RANGE
    return low + digest % (high - low)


# Every launcher's name for "my rank on this node" and "ranks on this node". A launcher's own variable is read
# first; the others are the fallback (a Cray PALS job without PALS_LOCAL_RANKID still has MPICH's
# MPI_LOCALRANKID, and so on), so a missing variable never silently puts every rank on GPU 0.
LOCAL_RANK_VARIABLES = ("PALS_LOCAL_RANKID", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                        "SLURM_LOCALID", "LOCAL_RANK")
LOCAL_SIZE_VARIABLES = ("PALS_LOCAL_SIZE", "PALS_PPN", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE",
                        "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE")


def _first_set(env: dict, own: tuple[str, ...], everyone: tuple[str, ...]) -> tuple[int | None, str | None]:
    """The first of ``own``, then of ``everyone``, that is set: (value, variable name), or (None, None)."""
    for name in own + tuple(n for n in everyone if n not in own):
        value = _int(env, name)
        if value is not None:
            return value, name
    return None, None


def _slurm_tasks_on_node(tasks_per_node: str, node_id: int | None) -> int | None:
    """This node's task count from Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``"4(x2),3"``: 4, 4, 3)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ConfigError(f"cannot read Slurm's tasks per node {tasks_per_node!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if node_id is not None and 0 <= node_id < len(counts):
        return counts[node_id]
    return counts[0] if len(set(counts)) == 1 else None


# Which MPI layer set the rank, in order: Cray PALS also sets PMI_RANK, so PALS is tested before MPICH.
# (name, rank variable, world-size variables, its own local rank variables, its own local size variables)
MPI_LAYERS = (
    ("pals", "PALS_RANKID", ("PMI_SIZE", "PALS_SIZE"), ("PALS_LOCAL_RANKID",), ("PALS_LOCAL_SIZE", "PALS_PPN")),
    ("openmpi", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",)),
    ("mpich", "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"), ("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE")),
)


def launcher_env(env: dict | None = None, read_file=None) -> LauncherEnv:
    """Work out rank, world size, local rank and the rendezvous address from ``env`` (default os.environ).

    * torchrun is known by ``TORCHELASTIC_RUN_ID``, which its agent gives every worker (torch's own test,
      ``torch.distributed.is_torchelastic_launched``): its RANK/WORLD_SIZE win over the agent's inherited MPI
      or Slurm variables.
    * An MPI layer (Cray PALS ``PALS_RANKID``, OpenMPI ``OMPI_COMM_WORLD_RANK``, MPICH ``PMI_RANK``) or Slurm's
      srun (``SLURM_PROCID``). When srun started the task itself (``srun --mpi=pmi2`` or ``--mpi=cray_shasta``
      set the MPI rank, equal to ``SLURM_PROCID``), the world size, the tasks on this node and rank 0's host
      come from Slurm's own variables: the MPI plugin may set only the rank (Slurm 22.05's cray_shasta).
    * ``RANK``/``WORLD_SIZE`` without ``TORCHELASTIC_RUN_ID`` (labkit.forkrun, a hand-made wrapper) are used
      when no launcher of several ranks says otherwise; a stale ``RANK=0 WORLD_SIZE=1`` beside an MPI or
      srun rank of a larger world is a configuration error, not every rank training alone.
    * Nothing set: a world of one.
    """
    env = dict(os.environ if env is None else env)
    read_file = read_file or (lambda path: open(path).read())
    notes: list[str] = []

    # What each layer says: (launcher, rank, world, its own local rank variables, its own local size variables)
    mpi = next(((name, _int(env, rank_var), _int(env, *world_vars), own_local, own_size, rank_var)
                for name, rank_var, world_vars, own_local, own_size in MPI_LAYERS if env.get(rank_var) is not None),
               None)
    # srun's task variables. A batch script's shell has SLURM_PROCID=0 and SLURM_NTASKS too, which whatever it
    # starts inherits; SLURM_STEP_NUM_TASKS is set only in the tasks of an srun step (Slurm's env.c).
    srun_rank = _int(env, "SLURM_PROCID")
    step_world = _int(env, "SLURM_STEP_NUM_TASKS")
    srun_world = step_world if step_world is not None else _int(env, "SLURM_NTASKS")
    slurm_local_world = None
    tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if tasks_per_node:
        slurm_local_world = _slurm_tasks_on_node(tasks_per_node, _int(env, "SLURM_NODEID"))

    if env.get("TORCHELASTIC_RUN_ID") is not None:
        launcher = "torchrun"
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        own_local, own_size = ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)
        slurm_local_world = None  # the agent's srun step, not the workers'
        if rank is None or world is None:
            raise ConfigError("TORCHELASTIC_RUN_ID is set but RANK or WORLD_SIZE is not: start the script with "
                              "torchrun itself, not from inside one of its workers")
    else:
        # srun started this task itself, an MPI plugin (--mpi=pmi2, cray_shasta) adding its rank variables
        started_by_srun = srun_rank is not None and (
            (mpi is None and srun_world is not None)
            or (mpi is not None and step_world is not None and mpi[1] == srun_rank and mpi[2] in (None, step_world)))
        if started_by_srun:
            launcher, rank, world = "slurm", srun_rank, srun_world
            own_local, own_size = ("SLURM_LOCALID",), ()
            if mpi is not None:
                notes.append(f"srun's MPI plugin set {mpi[5]}; world, tasks per node and rank 0 from Slurm")
        elif mpi is not None:
            launcher, rank, world, own_local, own_size = mpi[:5]
            slurm_local_world = None
        else:
            launcher, rank, world = "single", 0, 1
            own_local, own_size = (), ()
            slurm_local_world = None

        explicit_rank, explicit_world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if explicit_rank is not None and explicit_world is not None:
            one_rank_launcher = launcher == "single" or (world is not None and world <= 1) or (
                launcher == "slurm" and step_world is None)  # a batch script's shell, not an srun step
            if one_rank_launcher:
                # labkit.forkrun, or a wrapper's variables: a launcher of one rank started this world
                launcher, rank, world = "env", explicit_rank, explicit_world
                own_local, own_size = ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",)
                slurm_local_world = None
            elif (explicit_rank, explicit_world) != (rank, world):
                said = f"rank {rank} of {world}" if world is not None else f"rank {rank}"
                raise ConfigError(
                    f"RANK={explicit_rank} WORLD_SIZE={explicit_world} contradict {launcher}'s {said}, and no "
                    "TORCHELASTIC_RUN_ID says torchrun set them: unset RANK and WORLD_SIZE (a stale export?)")

    if world is None or rank is None:
        raise ConfigError(f"launcher {launcher!r} set a rank but no world size; check the launch command")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside a world of size {world}")
    if launcher == "single":
        local_rank, local_world = 0, 1
    else:
        local_world = slurm_local_world
        if local_world is None:
            local_world, _ = _first_set(env, own_size, LOCAL_SIZE_VARIABLES)
        if local_world is None:
            local_world = world
        local_rank, found = _first_set(env, own_local, LOCAL_RANK_VARIABLES)
        if local_rank is None:
            if local_world > 1:
                names = own_local + tuple(n for n in LOCAL_RANK_VARIABLES if n not in own_local)
                raise ConfigError(
                    f"{launcher} launched {local_world} ranks on this node but set no local rank (none of "
                    f"{', '.join(names)}): every rank would pick GPU 0. Launch as pbs/common.sh does "
                    "(mpiexec or torchrun), or export LOCAL_RANK for each rank")
            local_rank = 0
        elif own_local and found not in own_local:
            notes.append(f"local rank from {found} ({' / '.join(own_local)} not set)")
    if not 0 <= local_rank < local_world:
        raise ConfigError(f"local rank {local_rank} is outside {local_world} rank(s) on this node")

    # Where is rank 0?
    master_addr = env.get("MASTER_ADDR")
    if master_addr:
        notes.append("MASTER_ADDR from the environment")
    elif launcher == "slurm" and (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")):
        nodelist = "SLURM_STEP_NODELIST" if env.get("SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
        master_addr = expand_hostlist(env[nodelist])[0]
        notes.append(f"MASTER_ADDR = first host of {nodelist}")
    elif env.get("PBS_NODEFILE") and world > local_world:
        lines = [ln.strip() for ln in read_file(env["PBS_NODEFILE"]).splitlines() if ln.strip()]
        master_addr = lines[0]
        notes.append("MASTER_ADDR = first host of PBS_NODEFILE")
    elif world <= local_world:
        master_addr = "127.0.0.1"
        notes.append("single node: MASTER_ADDR = 127.0.0.1")
    else:
        raise ConfigError(
            f"{world} ranks over several nodes and no MASTER_ADDR: export MASTER_ADDR=<first node> "
            "(pbs/common.sh does this for you)"
        )

    master_port = _int(env, "MASTER_PORT")
    if master_port is None:
        job_id = env.get("PBS_JOBID") or env.get("SLURM_JOB_ID")
        master_port = _port_from_job_id(job_id) if job_id else DEFAULT_MASTER_PORT
        notes.append(f"MASTER_PORT derived ({'job id' if job_id else 'default'})")
    return LauncherEnv(launcher, rank, world, local_rank, local_world, master_addr, master_port, tuple(notes))


# --------------------------------------------------------------------------------------------------
# Command-line flags shared by every script
# --------------------------------------------------------------------------------------------------


# Types of numeric flags. Every numeric flag of the course's scripts uses one of these (a test reads each script's
# parser and fails on a plain int or float): 0 or a negative value where it makes no sense ends as argparse's one
# usage line and exit 2 on every rank, before any process group exists, never a ZeroDivisionError on every rank.
def _number(kind, minimum: float, strict: bool, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {what}, not {text}")
        return value

    parse.__name__ = what.replace(" ", "_").replace("a_", "", 1)  # argparse names the type in its messages
    return parse


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose every error is one line, ``config error: ...``, and exit code 2 (argparse prints
    its usage first): for a command a learner types, such as chapter 11's plan.py, whose other bad input ends the
    same way."""

    def error(self, message):
        self.exit(CONFIG_ERROR_EXIT_CODE, f"config error: {message} (see {self.prog} --help)\n")


positive_int = _number(int, 0, True, "a positive integer")
nonnegative_int = _number(int, 0, False, "a non-negative integer")
positive_float = _number(float, 0.0, True, "a positive number")
nonnegative_float = _number(float, 0.0, False, "a non-negative number")
NUMBER_TYPES = (positive_int, nonnegative_int, positive_float, nonnegative_float)


# AdamW's learning rate by model size. The laptop presets learn fast at 3e-3, and the checks' tolerances are
# stated there. A 1.3 B model does not: the a100 preset in bf16, 10 steps, no warm-up, on one H200 (2026-11-26,
# BENCHMARKS.md), mean loss of the last 3 steps / first step: 1.01 at 3e-3 (diverged), 0.705 at 3e-4 (spiking),
# 0.416 at 1e-4 (smooth). So the GPU presets default to LARGE_MODEL_LR.
LARGE_MODEL_LR = 1e-4
LARGE_PRESETS = ("a100", "a100_large", "llama3_8b_slice")


def default_lr(preset: str | None, small_model_lr: float) -> float:
    return LARGE_MODEL_LR if preset in LARGE_PRESETS else small_model_lr


class CourseParser(argparse.ArgumentParser):
    """The scripts' parser: after parsing, an ``--lr`` left unset takes its preset's default (``default_lr``)."""

    small_model_lr: float | None = None

    def parse_known_args(self, args=None, namespace=None):
        namespace, rest = super().parse_known_args(args, namespace)
        if self.small_model_lr is not None and getattr(namespace, "lr", 0.0) is None:
            namespace.lr = default_lr(getattr(namespace, "preset", None), self.small_model_lr)
        return namespace, rest


def add_lr_flag(p: CourseParser, small_model_lr: float = 3e-3) -> None:
    """``--lr``, whose default follows the model: ``small_model_lr`` for the laptop presets, LARGE_MODEL_LR for
    the a100 ones."""
    if not isinstance(p, CourseParser):
        raise TypeError("add_lr_flag needs the parser of runtime.parser (it sets the default after parsing)")
    p.small_model_lr = small_model_lr
    p.add_argument("--lr", type=positive_float, default=None,
                   help=f"AdamW learning rate (default {small_model_lr:g}; {LARGE_MODEL_LR:g} for the a100 presets, "
                        f"where {small_model_lr:g} diverges)")


def add_fix_flag(p: argparse.ArgumentParser, functions: str) -> None:
    """``--fix-from FILE.py``: chapter 14's lab runs a learner's fix inside the job. The file defines some of
    ``functions`` (their signatures, for the help); the script calls each it defines on every rank, in place of its
    own code there (:func:`learner_fixes`)."""
    p.add_argument("--fix-from", metavar="FILE.py", default=None,
                   help=f"a file defining {functions}: each one it defines runs on every rank in place of the "
                        "script's own code there (a learner's fix, judged by this run's checks)")


def learner_fixes(path: str | None, names: tuple[str, ...]) -> dict:
    """The functions among ``names`` that the file ``path`` defines ({} without a file). Call it before the first
    collective: a file that is missing, does not run, or defines none of ``names`` is a :class:`ConfigError` (one
    line, exit 2 on every rank), not a traceback on some ranks and a wait on the others."""
    if path is None:
        return {}
    import runpy

    try:
        defined = runpy.run_path(str(path))
    except Exception as error:   # the learner's file: any error it raises is bad input, said in one line
        raise ConfigError(f"--fix-from {path}: {type(error).__name__}: {error}") from None
    found = {name: defined[name] for name in names if callable(defined.get(name))}
    require(bool(found), f"--fix-from {path} defines none of {', '.join(names)}")
    return found


def parser(description: str | None, *, presets: tuple[str, ...] | None = None, steps: int | None = 10,
           seed: int = 0) -> CourseParser:
    """The flags every script shares (``--device``, ``--seed``, ``--metrics-out``, ...); add your own after."""
    p = CourseParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda (NCCL) when a GPU is present, else cpu (gloo)")
    if presets:
        p.add_argument("--preset", choices=list(presets), default=presets[0],
                       help="model size: tiny runs in seconds on a laptop CPU; a100 shows the point on 4 x A100-40GB")
    if steps is not None:
        p.add_argument("--steps", type=positive_int, default=steps, help="training steps")
    p.add_argument("--seed", type=nonnegative_int, default=seed, help="seed of model init and data (same on every rank)")
    p.add_argument("--metrics-out", metavar="FILE", default=None, help="write the metrics JSON here (rank 0)")
    p.add_argument("--pg-timeout", type=positive_float, default=None, metavar="SECONDS",
                   help=f"process-group timeout (default {DEFAULT_PG_TIMEOUT_S}, or $DISTLAB_PG_TIMEOUT)")
    p.add_argument("--verbose", action="store_true",
                   help="every rank prints where it runs: host, rank, local rank, CUDA_VISIBLE_DEVICES, its GPU "
                        "(also $DISTLAB_VERBOSE=1)")
    return p


# --------------------------------------------------------------------------------------------------
# The running job
# --------------------------------------------------------------------------------------------------


def pick_device(requested: str, local_rank: int, cuda_available: bool, cuda_count: int) -> tuple[str, str]:
    """Return (device string, backend). Pure, so it is unit-tested without a GPU."""
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, not {requested!r}")
    if requested == "cuda" and not cuda_available:
        raise ConfigError("--device cuda was asked for but no CUDA GPU is visible on this node")
    if requested == "cpu" or (requested == "auto" and not cuda_available):
        return "cpu", "gloo"
    return f"cuda:{local_rank % max(cuda_count, 1)}", "cuda:nccl,cpu:gloo"


def auto_device_note(requested: str, cuda_built: bool, cuda_available: bool, warning: str | None) -> str | None:
    """The one line ``--device auto`` prints when this torch is built for CUDA and CUDA is not usable.

    ``torch.cuda.is_available()`` never raises: a driver too old for the wheel's CUDA, or no GPU, makes it return
    False with at most a warning ("CUDA initialization: The NVIDIA driver on your system is too old ..."), and
    ``auto`` would then train on the CPU with gloo, silently. A CPU-only build says nothing (it is meant)."""
    if requested != "auto" or cuda_available or not cuda_built:
        return None
    why = warning.strip().splitlines()[0] if warning and warning.strip() else "no GPU is visible on this node"
    return f"--device auto: this torch is built for CUDA but CUDA is not usable ({why}); running on cpu with gloo"


def _bus_id(props) -> str | None:
    """A device's PCI address as sysfs names it (``0000:c1:00.0``), from torch's device properties."""
    if getattr(props, "pci_bus_id", None) is None:
        return None
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def placement(rank: int, local_rank: int, device, env: dict | None = None, host: str | None = None,
              sysfs: str | os.PathLike = "/sys") -> dict:
    """Where this rank runs: host, rank, local rank, CUDA_VISIBLE_DEVICES, the GPU it uses ("cpu" if none), the
    cores it may run on, and its GPU's NUMA node and that node's cores (sysfs).

    The GPU is named by what CUDA reports for it: model, index among the visible devices, PCI bus id (the
    one identity that two ranks of a node can compare, whatever CUDA_VISIBLE_DEVICES renumbered).
    """
    env = os.environ if env is None else env
    # MPICH's Hydra names the node from its host file (what tells two fake nodes on one machine apart)
    # (Slurm: the node daemon's name, SLURMD_NODENAME: the Slurm test cluster's two nodes share one machine)
    host = host or env.get("PMI_HOSTNAME") or env.get("SLURMD_NODENAME") or socket.gethostname()
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    where = {"host": host, "rank": rank, "local_rank": local_rank,
             "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES", "(unset)"), "device": str(device),
             "gpu": "cpu", "gpu_index": None, "bus_id": None, "cpus": cpus, "gpu_numa_node": None,
             "gpu_numa_cpus": []}
    if getattr(device, "type", None) == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        bus = _bus_id(props)
        node, node_cpus = gpu_numa_node(bus, sysfs)
        where.update(gpu=props.name, gpu_index=device.index, bus_id=bus, gpu_numa_node=node, gpu_numa_cpus=node_cpus)
    return where


# --------------------------------------------------------------------------------------------------
# Which cores? A rank's threads beside its GPU (pure functions over a sysfs tree: unit-tested on a fake one)
# --------------------------------------------------------------------------------------------------
# A GPU hangs off one NUMA node; its rank's threads run best on that node's cores (host copies, the data loader, the
# CPU side of NCCL). Launchers bind task i to the i-th block of cores, and on nodes whose GPUs are wired in another
# order, such as Frontier's (OLCF's Frontier user guide: GPUs 4, 5 on NUMA 0, 2, 3 on NUMA 1, 6, 7 on NUMA 2, 0, 1 on
# NUMA 3), task i's cores are far from GPU i. Linux says where a PCI device sits: /sys/bus/pci/devices/<bus
# id>/numa_node (-1: unknown) and local_cpulist, the CPUs of that node (drivers/pci/pci-sysfs.c,
# pci_dev_show_local_cpu: every online CPU when the node is unknown).


def parse_cpulist(text: str) -> list[int]:
    """The kernel's CPU list format, ``0-7,64-71``, as the CPUs in its order."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def format_cpulist(cpus) -> str:
    """The inverse of :func:`parse_cpulist`: ``{0, 1, 2, 64}`` -> ``0-2,64``."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges)


def gpu_numa_node(bus_id: str | None, sysfs: str | os.PathLike = "/sys") -> tuple[int | None, list[int]]:
    """The NUMA node of the PCI device ``bus_id`` (``0000:c1:00.0``) and the CPUs local to it, in their order;
    ``(None, [])`` when sysfs does not say (no such device, no NUMA, ``numa_node`` -1)."""
    if not bus_id:
        return None, []
    device = Path(sysfs) / "bus" / "pci" / "devices" / bus_id.lower()
    try:
        node = int((device / "numa_node").read_text())
        cpus = parse_cpulist((device / "local_cpulist").read_text())
    except (OSError, ValueError):
        return None, []
    return (node, cpus) if node >= 0 and cpus else (None, [])


def _physical_cores(cpus: list[int], sysfs: str | os.PathLike = "/sys") -> list[list[int]]:
    """``cpus`` grouped by physical core, in the order of each core's first CPU: Linux lists a CPU's hardware
    threads in ``devices/system/cpu/cpu<N>/topology/thread_siblings_list``, as torch's ``--numa-binding`` reads it
    (torch 2.13, torch/numa/binding.py:397-403). A CPU whose siblings sysfs does not give is a core of its own."""
    cores: dict[int, list[int]] = {}
    for cpu in cpus:
        try:
            siblings = parse_cpulist((Path(sysfs) / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
                                      / "thread_siblings_list").read_text())
        except (OSError, ValueError):
            siblings = [cpu]
        cores.setdefault(min(siblings, default=cpu), []).append(cpu)
    return sorted(cores.values(), key=lambda threads: threads[0])


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on: its cgroup's cpuset (Slurm's task/cgroup confines a step to the job's cores
    there), else its own affinity. Not only the affinity: srun --cpu-bind=cores has already put the task on a block
    of cores, often another NUMA node's, and binding may move it anywhere in the cpuset."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for name, file in (("", "cpuset.cpus.effective"), ("cpuset", "cpuset.effective_cpus")):
                if controllers == name or (name and name in controllers.split(",")):
                    folder = Path("/sys/fs/cgroup", *(["cpuset"] if name else []), path.lstrip("/"))
                    with contextlib.suppress(OSError, ValueError):
                        cpus = set(parse_cpulist((folder / file).read_text()))
                        if cpus:
                            return cpus
    return set(os.sched_getaffinity(0))


def node_gpus(bus_id: str, sysfs: str | os.PathLike = "/sys") -> list[str]:
    """The node's GPUs as sysfs lists them, by bus id: every PCI device of the vendor and class of ``bus_id``'s.
    A rank that sees only its own GPU (--gpus-per-task=1, --gpu-bind=closest or single) learns its neighbours here."""
    devices = Path(sysfs) / "bus" / "pci" / "devices"

    def kind(device: Path) -> tuple[str, str] | None:
        try:
            return (device / "vendor").read_text().strip(), (device / "class").read_text().strip()
        except OSError:
            return None

    mine = kind(devices / bus_id.lower())
    if mine is None:
        return [bus_id.lower()]
    with contextlib.suppress(OSError):
        return sorted(d.name for d in devices.iterdir() if kind(d) == mine)
    return [bus_id.lower()]


def gpu_local_cpus(local_rank: int, rank_bus_ids: list[str | None], sysfs: str | os.PathLike = "/sys",
                   allowed: set[int] | None = None) -> tuple[int | None, list[int]]:
    """The NUMA node of local rank ``local_rank``'s GPU and the cores it should run on: that node's CPUs this
    process may use (``allowed``, default :func:`allowed_cpus`, as torch's ``--numa-binding=exclusive`` takes only
    the allowed CPUs of a node, torch/numa/binding.py:561-566), shared among the node's GPUs that sit on that NUMA
    node. ``rank_bus_ids[j]`` is local rank j's GPU; where one is unknown (the rank sees only its own GPU), the
    node's GPUs come from sysfs (:func:`node_gpus`). The share is whole physical cores (both hardware threads),
    cut in equal parts in the order of the cores, a part a GPU. ``(None, [])`` when sysfs does not say."""
    mine = rank_bus_ids[local_rank]
    node, cpus = gpu_numa_node(mine, sysfs)
    if node is None:
        return None, []
    allowed = allowed_cpus() if allowed is None else allowed
    cpus = [cpu for cpu in cpus if cpu in allowed] or cpus
    gpus = rank_bus_ids if all(rank_bus_ids) else node_gpus(mine, sysfs)
    sharing = [bus.lower() for bus in gpus if gpu_numa_node(bus, sysfs)[0] == node]
    k, index = len(sharing), sharing.index(mine.lower())
    cores = _physical_cores(cpus, sysfs)
    share = sorted(cpu for core in cores[len(cores) * index // k:len(cores) * (index + 1) // k] for cpu in core)
    return node, share or cpus


def affinity_problems(placements: list[dict]) -> list[str]:
    """Ranks whose allowed CPUs are not all on their GPU's NUMA node (each placement: ``rank``, ``gpu_numa_node``,
    ``gpu_numa_cpus``, ``cpus``, ``host``; a GPU whose node sysfs does not give is not judged), and ranks of one
    host whose GPUs sysfs placed that share cores (two ranks' threads on one core)."""
    problems = []
    for where in placements:
        if where.get("gpu_numa_node") is None or not where.get("cpus"):
            continue
        outside = sorted(set(where["cpus"]) - set(where["gpu_numa_cpus"]))
        if outside:
            problems.append(f"rank {where['rank']} on {where.get('host', '?')}: cores "
                            f"{format_cpulist(outside)} are not on its GPU's NUMA node {where['gpu_numa_node']} "
                            f"({format_cpulist(where['gpu_numa_cpus'])})")
    judged = [w for w in placements if w.get("gpu_numa_node") is not None and w.get("cpus")]
    for i, one in enumerate(judged):
        for other in judged[i + 1:]:
            shared = set(one["cpus"]) & set(other["cpus"])
            if one.get("host") == other.get("host") and shared:
                problems.append(f"ranks {one['rank']} and {other['rank']} on {one.get('host', '?')} share cores "
                                f"{format_cpulist(shared)}")
    return problems


def bind_to_gpu(local_rank: int, rank_bus_ids: list[str | None], sysfs: str | os.PathLike = "/sys",
                setaffinity=None, allowed: set[int] | None = None) -> str:
    """Move this process (and the threads it starts later) to its GPU's share of cores (:func:`gpu_local_cpus`).
    One line saying what was done, or why not: sysfs does not say, or the kernel refuses the cores (Linux keeps the
    part of a mask inside the cpuset and fails only when none is; the share is taken from the allowed CPUs first).
    ``runtime.start`` calls it where ``DISTLAB_GPU_AFFINITY=numa``, as the course's jobs set it."""
    node, cpus = gpu_local_cpus(local_rank, rank_bus_ids, sysfs, allowed)
    if node is None:
        return "GPU affinity: the GPU's NUMA node is unknown (sysfs); the launcher's binding stays"
    if setaffinity is None:
        setaffinity = _bind_threads
    try:
        setaffinity(0, set(cpus))
    except OSError as error:  # cores outside the job's cpuset (task/cgroup)
        return f"GPU affinity: cannot bind to {format_cpulist(cpus)} ({error.strerror}); the launcher's binding stays"
    return f"GPU affinity: cores {format_cpulist(cpus)} (NUMA node {node}, the GPU's)"


def _bind_threads(pid: int, cpus: set[int]) -> None:
    """This thread to ``cpus``, and the process's threads already started with the same binding (CUDA's), as
    torch's own ``torchrun --numa-binding`` does (torch 2.13, torch/numa/binding.py:291-316)."""
    before = os.sched_getaffinity(pid)
    os.sched_setaffinity(pid, cpus)
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):
                if os.sched_getaffinity(int(tid)) == before:
                    os.sched_setaffinity(int(tid), cpus)


def format_placement(where: dict) -> str:
    """One line per rank, the same on every launcher: what ``--verbose`` and the preflight job print."""
    gpu = "cpu" if where["gpu"] == "cpu" else (
        f"GPU {where['gpu_index']} ({where['gpu']}" + (f", bus {where['bus_id']})" if where["bus_id"] else ")"))
    cores = ""
    if where.get("gpu_numa_node") is not None and where.get("cpus"):
        cores = (f"  cores {format_cpulist(where['cpus'])} (the GPU's NUMA node {where['gpu_numa_node']}: "
                 f"{format_cpulist(where['gpu_numa_cpus'])})")
    return (f"host {where['host']}  rank {where['rank']}  local rank {where['local_rank']}  "
            f"CUDA_VISIBLE_DEVICES={where['cuda_visible_devices']}  uses {gpu}{cores}")


def loaded_libraries(maps: str | None = None) -> dict:
    """The CUDA runtime and the NCCL this process loaded, as paths (None: not loaded), read from /proc/self/maps.

    A ``module load cuda`` can put an older libcudart ahead of the one torch was built with on LD_LIBRARY_PATH
    (undefined-symbol errors at import, or a silent mix): this names the files each rank really mapped."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:  # not Linux
            maps = ""
    found: dict = {"libcudart": None, "libnccl": None}
    for line in maps.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        name = os.path.basename(path)
        for library in found:
            if found[library] is None and name.startswith((library + ".so", library + "-")):
                found[library] = path
    return found


def software(env: dict | None = None) -> dict:
    """What a rank runs with beside its GPU: its OpenMP threads (PBS sets OMP_NUM_THREADS to the chunk's ncpus,
    64 on Derecho, unless ``ompthreads`` is asked for), torch's intra-op threads, the node's cores, the CUDA and
    NCCL libraries loaded."""
    import torch

    env = os.environ if env is None else env
    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    return {"omp_num_threads": env.get("OMP_NUM_THREADS", "(unset)"), "torch_threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            **loaded_libraries()}


def format_software(where: dict) -> str:
    """The line under a rank's placement: threads, then the libraries it loaded."""
    libraries = "  ".join(f"{name} {where[name]}" for name in ("libcudart", "libnccl") if where.get(name))
    versions = f"torch {where['torch']}" + (f", CUDA {where['cuda']}" if where.get("cuda") else "") \
        + (f", NCCL {where['nccl']}" if where.get("nccl") else "")
    return (f"OMP_NUM_THREADS={where['omp_num_threads']}  torch threads {where['torch_threads']} of "
            f"{where['cores']} cores  {versions}" + (f"  {libraries}" if libraries else ""))


def oversubscribed_hosts(placements: list[dict]) -> list[str]:
    """Hosts whose ranks run more threads together than the host has cores (4 ranks x 64 threads on 64 cores)."""
    threads: dict[str, int] = {}
    cores: dict[str, int] = {}
    for where in placements:
        threads[where["host"]] = threads.get(where["host"], 0) + int(where["torch_threads"])
        cores[where["host"]] = int(where["cores"] or 0)
    return [f"{host}: {threads[host]} threads on {cores[host]} cores" for host in sorted(threads)
            if cores[host] and threads[host] > cores[host]]


def shared_gpus(placements: list[dict]) -> list[str]:
    """GPUs that more than one rank of a node uses (NCCL refuses them: "Duplicate GPU detected")."""
    users: dict[tuple, list[int]] = {}
    for where in placements:
        if where["gpu"] != "cpu":
            users.setdefault((where["host"], where["bus_id"] or where["gpu_index"]), []).append(where["rank"])
    return [f"ranks {', '.join(map(str, sorted(ranks)))} share GPU {gpu} on {host}"
            for (host, gpu), ranks in sorted(users.items(), key=str) if len(ranks) > 1]


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is optional for distlab's users
        pass
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every random number generator a training step may draw from, as this rank holds it: Python's ``random``,
    numpy's global one (if numpy is installed), torch's CPU generator and each CUDA device's. A checkpoint that
    leaves them out resumes with other dropout masks, other augmentations, another shuffle."""
    import pickle

    import torch

    state = {"python": pickle.dumps(random.getstate()), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = pickle.dumps(np.random.get_state())
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` returned (the generators it found then)."""
    import pickle

    import torch

    random.setstate(pickle.loads(state["python"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(pickle.loads(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


@dataclass
class Runtime:
    """What a script needs to know about the job it runs in."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: "object"  # torch.device
    backend: str
    launcher: str
    pg_timeout_s: float
    exit_code: int | None = None  # set by metrics.Report.finish: how the run ended
    attempt: int = 0  # under torchrun: which start of the job this is (0 first), the same on every rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.type

    def print(self, *args, **kwargs) -> None:
        """Print from rank 0 only, flushed, so lines of 4 ranks do not interleave."""
        if self.rank == 0:
            print(*args, **kwargs, flush=True)

    def print_all(self, *args, **kwargs) -> None:
        """Print from every rank, prefixed with the rank."""
        print(f"[rank {self.rank}]", *args, **kwargs, flush=True)

    def require(self, condition: bool, message: str) -> None:
        """Stop every rank with one clear line and exit code 2 when ``condition`` is false.

        Call it before the first collective, with the same arguments on every rank, so every rank stops.
        """
        require(condition, message)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def sync(self) -> None:
        """Wait for queued device work, so wall-clock timings mean something on GPUs."""
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def write_whole_lines() -> None:
    """Send each line of this rank's output in one write, as soon as it ends.

    The ranks of a job share one pipe or one output file, and the launchers set PYTHONUNBUFFERED so output
    arrives as it happens. Unbuffered, ``print("a", "b")`` makes four writes ("a", " ", "b", newline), and
    another rank's words land between them: ``checks: 2/3 passedrank 2: [FAIL] ...``. Line buffering keeps
    the promptness (a line goes out when it ends) and makes each line one write; a write of up to 4 KiB to a
    pipe is never split (POSIX PIPE_BUF).
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def _config_error_exit(message: str, rank: int | None) -> None:
    who = f" (rank {rank})" if rank is not None else ""
    # one write, newline included: ranks sharing a pipe must not interleave their lines (print writes twice)
    sys.stderr.write(f"config error{who}: {message}\n")
    sys.stderr.flush()
    # os._exit: no atexit handlers or destructors that might wait on peers that already left
    sys.stdout.flush()
    os._exit(CONFIG_ERROR_EXIT_CODE)


def require(condition: bool, message: str) -> None:
    """Raise :class:`ConfigError` (one line, exit code 2 on every rank) when ``condition`` is false."""
    if not condition:
        raise ConfigError(message)


@contextlib.contextmanager
def start(args: argparse.Namespace | None = None, *, validate=None, device: str | None = None,
          seed: int | None = None, pg_timeout_s: float | None = None, rendezvous_timeout_s: float | None = None):
    """Join the job, set device, backend and seed, and yield a :class:`Runtime`; leave cleanly at the end.

    ``validate(world_size)`` runs on every rank before the process group is formed, so a configuration that
    cannot work (a mesh that does not divide the world) stops before any rank waits on another. A
    :class:`ConfigError` raised there or inside the block (``rt.require``) prints one line and exits 2.

    The ranks wait for each other while the group forms (the store's rendezvous, then the backend's connections:
    gloo's connectFullMesh and its store waits use the group's timeout) as long as the process-group timeout, unless
    ``rendezvous_timeout_s`` is longer. Then the group forms under that longer timeout, and the process-group timeout
    is set on the group and its store once it has formed: a drill's timeout of seconds must not fail ranks that start
    a few seconds apart.
    """
    write_whole_lines()
    import torch
    import torch.distributed as dist

    device = device or getattr(args, "device", None) or "auto"
    seed = seed if seed is not None else getattr(args, "seed", 0)
    timeout = pg_timeout_s or getattr(args, "pg_timeout", None) or float(
        os.environ.get("DISTLAB_PG_TIMEOUT", DEFAULT_PG_TIMEOUT_S))

    rank = None
    attempt = 0
    try:
        where = launcher_env()
        rank = where.rank
        if validate is not None:
            validate(where.world_size)
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cuda_available = torch.cuda.is_available()
        warning = next((str(w.message) for w in caught if "CUDA" in str(w.message)), None)
        note = auto_device_note(device, torch.backends.cuda.is_built(), cuda_available, warning)
        if note and where.rank == 0:
            sys.stderr.write(note + "\n")  # one write: one line
            sys.stderr.flush()
        device_name, backend = pick_device(device, where.local_rank, cuda_available,
                                           torch.cuda.device_count() if cuda_available else 0)
        torch_device = torch.device(device_name)
        if torch_device.type == "cuda":
            torch.cuda.set_device(torch_device)
            # the course's jobs ask for it (jobs/common.sh: DISTLAB_GPU_AFFINITY=numa); a run by hand keeps its binding
            if os.environ.get("DISTLAB_GPU_AFFINITY") == "numa":
                # before torch starts its thread pools: the threads it starts later inherit the binding. The other
                # local ranks' GPUs are known when every rank sees the node's GPUs; a rank that sees only its own
                # (one GPU a task) leaves them None, and gpu_local_cpus reads the node's GPUs from sysfs
                count = torch.cuda.device_count()
                buses = [_bus_id(torch.cuda.get_device_properties(j % count))
                         if count >= where.local_world_size or j == where.local_rank else None
                         for j in range(where.local_world_size)]
                where = dataclasses.replace(where, notes=(*where.notes, bind_to_gpu(where.local_rank, buses)))
        else:
            # Ranks sharing a CPU share its cores: one thread pool each would oversubscribe them.
            cores = os.cpu_count() or 1
            torch.set_num_threads(max(1, cores // where.local_world_size))
        os.environ.setdefault("MASTER_ADDR", where.master_addr)
        os.environ.setdefault("MASTER_PORT", str(where.master_port))
        # how long the ranks wait for each other while the group forms (see the docstring); the timeout after
        joining = max(timeout, rendezvous_timeout_s or 0.0)
        joined_store = None
        if not dist.is_initialized():
            kwargs = dict(backend=backend, rank=where.rank, world_size=where.world_size,
                          timeout=datetime.timedelta(seconds=joining))
            if where.world_size == 1:
                kwargs["store"] = dist.HashStore()  # alone: no rendezvous, no port
            elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                # Under torchrun the agent serves the store on MASTER_PORT and keeps it across restarts
                # (--max-restarts): gloo would read the dead attempt's addresses from it and fail to connect
                # ("connectFullMesh failed ... Connection refused"; torch 2.13). One prefix per attempt.
                # TORCHELASTIC_RESTART_COUNT cannot name the attempt: each agent counts its own restarts, and one
                # restarted because another node rejoined does not count (torch elastic/agent/server/api.py:
                # 940-968; pytorch#108158, #135712). The attempt's rank 0 numbers it for everyone instead.
                agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                            where.world_size, is_master=False,
                                            timeout=datetime.timedelta(seconds=joining))
                attempt = agree_on_attempt(agent_store, where.rank, where.world_size, joining)
                kwargs["store"] = dist.PrefixStore(f"distlab/attempt_{attempt}", agent_store)
                joined_store = agent_store
            elif joining > timeout:
                # the store env:// makes (torch distributed/rendezvous.py, _env_rendezvous_handler: rank 0 serves it
                # on MASTER_PORT), made here to wait longer; init_process_group would prefix it "default_pg" itself
                # (distributed_c10d.py, init_process_group), and the journals of deadlocks.py read it so
                joined_store, _, _ = next(dist.rendezvous("env://", where.rank, where.world_size,
                                                          timeout=datetime.timedelta(seconds=joining)))
                kwargs["store"] = dist.PrefixStore("default_pg", joined_store)
            else:
                # env:// and not tcp://: under torchrun the agent already serves the store on MASTER_PORT
                # and workers must join it as clients (TORCHELASTIC_USE_AGENT_STORE).
                kwargs["init_method"] = "env://"
            if torch_device.type == "cuda":
                kwargs["device_id"] = torch_device
            dist.init_process_group(**kwargs)
            if joining > timeout:   # formed: the collectives' timeout from now on (torch's _set_pg_timeout sets it on
                # the group's gloo or NCCL backend, distributed_c10d.py:1616-1661)
                dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
            if joined_store is not None:
                joined_store.set_timeout(datetime.timedelta(seconds=timeout))
        _subgroups_inherit_timeout(timeout)
        seed_everything(seed)
        rt = Runtime(where.rank, where.world_size, where.local_rank, where.local_world_size, torch_device,
                     backend, where.launcher, timeout, attempt=attempt)
        if getattr(args, "verbose", False) or os.environ.get("DISTLAB_VERBOSE") == "1":
            notes = f"  [{where.launcher}; {'; '.join(where.notes)}]" if where.notes else f"  [{where.launcher}]"
            # one write per rank, so the lines of several ranks do not interleave
            sys.stdout.write(f"[rank {rt.rank}] {format_placement(placement(rt.rank, rt.local_rank, torch_device))}"
                             f"{notes}\n")
            sys.stdout.flush()
    except ConfigError as error:
        _config_error_exit(str(error), rank)
        raise  # unreachable; keeps type checkers calm

    try:
        yield rt
        if dist.is_initialized():
            if rt.world_size > 1:
                dist.barrier()  # every rank is done with every collective before any group goes away
            # a group of one rank can abort at teardown too ("terminate called without an active exception")
            _exit_without_teardown_at_interpreter_exit(rt)
    except ConfigError as error:
        _config_error_exit(str(error), rt.rank)
    finally:
        if dist.is_initialized():
            # A gloo group joins its worker threads in its destructor, with the GIL held; a worker still
            # releasing the last collective's tensors needs the GIL: a deadlock at exit (seen when DDP's
            # reducer, which holds the group, was freed with the script's frame). Keeping the group objects
            # until the interpreter ends means none is destroyed in that window (forkrun ends with os._exit).
            with contextlib.suppress(Exception):
                _GROUPS_KEPT_UNTIL_EXIT.extend(dist.distributed_c10d._world.pg_map)
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def agree_on_attempt(store, rank: int, world_size: int, timeout_s: float, retry_s: float = 1.0) -> int:
    """Number this start of the job the same on every rank, through torchrun's agent store (0 the first).

    The agent's store outlives the workers, so it still holds the keys of a failed attempt, and a worker must
    not read them as its peers'. Rank 0 draws a new number from a counter and announces it. Every other rank
    answers the announcement with a token of its own and waits for rank 0 to echo that token: an announcement
    left by a dead attempt's rank 0 is never answered, so after ``retry_s`` the rank reads it again.
    """
    import uuid

    import torch.distributed as dist

    wait = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        attempt = store.add("distlab/attempts", 1) - 1
        store.set("distlab/announced", str(attempt))
        hello = [f"distlab/attempt_{attempt}/hello/{r}" for r in range(1, world_size)]
        if hello:
            store.wait(hello, wait)
        for key in hello:
            store.set(f"distlab/attempt_{attempt}/ack/{store.get(key).decode()}", "1")
        return attempt
    token = uuid.uuid4().hex
    give_up = datetime.datetime.now() + wait
    while True:
        attempt = int(store.get("distlab/announced"))  # waits for the first announcement
        store.set(f"distlab/attempt_{attempt}/hello/{rank}", token)
        try:
            store.wait([f"distlab/attempt_{attempt}/ack/{token}"], datetime.timedelta(seconds=retry_s))
            return attempt
        except dist.DistStoreError:
            if datetime.datetime.now() > give_up:
                raise


def _subgroups_inherit_timeout(seconds: float) -> None:
    """Give every process group created later the job's timeout, not PyTorch's default.

    ``new_group`` and DeviceMesh's subgroups, made without a ``timeout=``, take
    ``distributed_c10d._get_default_timeout(backend)``: 30 minutes on gloo, 10 on NCCL, whatever the world
    group was given. A hang inside a tensor-parallel or pipeline subgroup would then wait that long. That
    function reads these two module globals when a group is made, so setting them once makes every later group
    (DeviceMesh's included) time out like the world group.
    """
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)
    distributed_c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=seconds)


_GROUPS_KEPT_UNTIL_EXIT: list = []
_UNCAUGHT = {"seen": False}


def _exit_without_teardown_at_interpreter_exit(rt: Runtime) -> None:
    """After a clean multi-rank run, end the process with ``os._exit`` when the interpreter exits.

    Tearing a gloo group down can crash or hang at the very end of a run that succeeded: its destructor
    joins worker threads while holding the GIL (a deadlock when a worker needs it), and a group still alive
    at interpreter shutdown aborts in C++ ("terminate called without an active exception": seen under
    torchrun about one run in ten). Nothing is left to do by then (the metrics file is written, output
    flushed), so the process leaves without destroying anything, with the exit code the script's report
    decided (``Report.finish`` records it on the runtime). forkrun ends its ranks the same way.
    """
    import atexit

    previous_hook = sys.excepthook

    def note_uncaught(*info):  # an exception after the run: exit 1 as Python would, not the report's code
        _UNCAUGHT["seen"] = True
        previous_hook(*info)

    def leave():
        if rt.exit_code is None:
            return  # the script did not finish a report: leave the normal way
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if _UNCAUGHT["seen"] else rt.exit_code)

    sys.excepthook = note_uncaught
    atexit.register(leave)


def free_port() -> int:
    """A TCP port free right now on this machine, for a job launched from a notebook or a test. Rank 0 binds it
    seconds later, so it is drawn at random below the kernel's ephemeral range (Linux's ip_local_port_range,
    32768-60999 by default), where no outgoing connection and no bind to port 0 can take it meanwhile: gloo opens
    dozens of those a job, and two test workers launch side by side. The kernel's own choice where that range
    leaves no room below it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    # and below the ports jobs derive from their id (PORT_RANGE): a test's launch beside a scheduler's job on this
    # machine never takes the port that job's rank 0 is about to bind
    high = min(low, PORT_RANGE[0])
    draw = random.SystemRandom()
    with _port_claims() as claims:
        for _ in range(50 if high > 12000 else 0):
            port = draw.randrange(10000, high)
            if port in claims:   # handed to another launch that may not have bound it yet
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            claims[port] = time.time()
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_CLAIM_S = 120   # how long a drawn port stays another launch's: its rank 0 binds it within seconds


@contextlib.contextmanager
def _port_claims():
    """The ports :func:`free_port` handed out in the last PORT_CLAIM_S seconds on this machine, by any process of
    this user, read and written under an exclusive lock (a file per user in /tmp, fcntl.flock). A port is free when
    drawn but is bound only when its launch's rank 0 starts: two launches drawing at once (two test workers, a
    notebook beside a test) could otherwise both get it, and one's ranks would join the other's store."""
    import fcntl
    import json

    path = Path(os.environ.get("DISTLAB_PORT_CLAIMS", f"/tmp/distlab-port-claims-{os.getuid()}.json"))
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        try:
            claims = {int(port): when for port, when in json.loads(handle.read() or "{}").items()}
        except (ValueError, AttributeError):
            claims = {}   # a file cut short by a killed process: start again
        now = time.time()
        claims = {port: when for port, when in claims.items() if now - when < PORT_CLAIM_S}
        yield claims
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(claims))
        handle.flush()


# --------------------------------------------------------------------------------------------------
# python -m distlab.runtime: where every rank of a job runs (the PBS preflight job's first launch)
# --------------------------------------------------------------------------------------------------


def local_ranks_problems(placements: list[dict]) -> list[str]:
    """Hosts whose ranks do not have the local ranks 0..n-1 (a launcher variable read wrong, or missing)."""
    by_host: dict[str, list[int]] = {}
    for where in placements:
        by_host.setdefault(where["host"], []).append(where["local_rank"])
    return [f"{host}: local ranks {sorted(found)}, expected {list(range(len(found)))}"
            for host, found in sorted(by_host.items()) if sorted(found) != list(range(len(found)))]


def rank_map(argv: list[str] | None = None) -> int:
    """Every rank reports where it runs; rank 0 prints the map and checks it.

    Run it under the job's own launcher, as the PBS preflight job does, so that "no GPU visible to the
    ranks", "two ranks on one GPU" or "every rank thinks it is local rank 0" show up before a chapter runs:

        mpiexec -n 8 --ppn 4 python -m distlab.runtime --device cuda --metrics-out rank_map.json
    """
    import torch.distributed as dist

    from distlab import metrics

    args = parser(rank_map.__doc__, steps=None).parse_args(argv)
    with start(args) as rt:
        report = metrics.Report(__file__, rt, config=vars(args))
        mine = dict(placement(rt.rank, rt.local_rank, rt.device), launcher=rt.launcher, **software())
        everyone = [None] * rt.world_size
        dist.all_gather_object(everyone, mine)
        everyone.sort(key=lambda where: where["rank"])
        rt.print(f"rank map: {rt.world_size} rank(s), launcher {rt.launcher}, device {rt.device_type}")
        for where in everyone:
            rt.print("  " + format_placement(where))
            rt.print("      " + format_software(where))
        report.check_equal("every rank reported", [w["rank"] for w in everyone], list(range(rt.world_size)))
        problems = local_ranks_problems(everyone)
        report.check("local ranks of each host are 0..n-1", not problems, "; ".join(problems) or "yes")
        shared = shared_gpus(everyone)
        report.check("no two ranks of a node share a GPU", not shared, "; ".join(shared) or "none shared")
        misplaced = affinity_problems(everyone)
        report.check("each rank's cores are on its GPU's NUMA node, no core shared on a node", not misplaced, "; ".join(misplaced) or "yes")
        crowded = oversubscribed_hosts(everyone)
        report.check("the ranks' threads do not outnumber a node's cores (OMP_NUM_THREADS per rank)", not crowded,
                     "; ".join(crowded) or "no")
        report.extra["ranks"] = everyone
        code = report.finish(args.metrics_out)
    return code


if __name__ == "__main__":
    # run through the imported module, so that there is one distlab.runtime (not a second __main__ copy)
    from distlab import runtime as _runtime

    sys.exit(_runtime.rank_map())

