"""``python -m labkit.forkrun --nproc=4 script.py [args]``: torchrun's job, started by fork (CPU only).

Importing torch costs each rank seconds; here the parent imports it once and forks the ranks, each with
the environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). The script runs unchanged, as ``__main__``. When a rank fails, the others get a few seconds
to finish their own report and are then stopped, unlike torchrun, whose agent stops them at once
(torch/distributed/elastic/multiprocessing/api.py:988-992): under torchrun a rank still waiting prints nothing.
The launcher exits with the first failing rank's code (so a configuration error exits 2) and prints every rank's
exit code.

Each rank gets its own ``TORCHELASTIC_ERROR_FILE``, as torchrun's agent gives it (torch/distributed/elastic/
multiprocessing/api.py:384-390): a script whose entry point is decorated with torch's ``@record`` writes an uncaught
exception there, traceback and time. When a rank failed and one wrote that file, the launcher ends with the summary
torchrun prints, torch's own ``ChildFailedError`` ("Root Cause (first observed failure)": the earliest error file,
its rank and its traceback; the other failed or stopped ranks under "Failures"). The failures are ordered by when
each happened (an error file's time, to the nanosecond, then the order the ranks exited), where torch's agent orders
them by the second and the order its polls found them.

CUDA does not survive fork: use torchrun for GPU runs (``labkit.launch`` does).

The error files' folder (``forkrun-errors-*`` in the temporary folder) is removed when the launcher ends, and when it
cannot (a launcher killed by SIGKILL: a timeout's kill, the kernel out of memory), by the next launcher: each folder
holds a lock for as long as its launcher or one of its ranks lives (an flock, which the kernel releases with the last
process holding it), and a launcher removes the folders whose lock it can take.

``DISTLAB_P2P_LOG=DIR`` (tests only) records every point-to-point operation each rank issues in
``DIR/rank{r}.jsonl`` (:class:`distlab.comm.P2PRecorder`), so a test can replay them under NCCL's rules.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback

from distlab.runtime import free_port, write_whole_lines
from labkit.forkexec import run_as_main

GRACE_SECONDS = 5.0
ERRORS_PREFIX = "forkrun-errors-"
IN_USE = "in-use"     # the lock file of an error files' folder


def make_errors_folder() -> str:
    """A new folder for the ranks' error files, locked while this process (and the ranks it forks, which share the
    lock) lives; the folders of launchers that died without removing theirs removed first."""
    remove_abandoned_errors_folders()
    folder = tempfile.mkdtemp(prefix=ERRORS_PREFIX)
    lock = os.open(os.path.join(folder, IN_USE), os.O_CREAT | os.O_RDWR, 0o600)  # not inherited by an exec
    fcntl.flock(lock, fcntl.LOCK_EX)   # held until the last process with this descriptor ends: never closed here
    return folder


def remove_abandoned_errors_folders() -> None:
    """Remove the error files' folders no process holds any more. A folder without its lock file is left alone
    (its launcher is between making it and locking it, or it is not one of ours)."""
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), ERRORS_PREFIX + "*")):
        try:
            lock = os.open(os.path.join(folder, IN_USE), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue      # its launcher or one of its ranks is alive
        else:
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(lock)


def _error_file(folder: str, rank: int) -> str:
    """Where rank ``rank`` writes an uncaught exception (``@record``): torchrun's agent's layout, a folder a rank."""
    return os.path.join(folder, str(rank), "error.json")


def _run_rank(rank: int, nproc: int, port: int, script: str, script_args: list[str], errors: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GROUP_RANK="0", ROLE_RANK=str(rank), TORCHELASTIC_ERROR_FILE=_error_file(errors, rank))
    write_whole_lines()   # before the script: its tracebacks too
    # A rank's failure is printed with traceback, not sys.excepthook: a script's hook (distlab.runtime's) is not
    # called here, and no atexit handler runs (the rank leaves through os._exit).
    code = run_as_main("script", script, script_args, before=lambda: _record_point_to_point(rank),
                       report=traceback.print_exception)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _record_point_to_point(rank: int) -> None:
    folder = os.environ.get("DISTLAB_P2P_LOG")
    if not folder:
        return
    import json

    from distlab.comm import P2PRecorder

    log = open(os.path.join(folder, f"rank{rank}.jsonl"), "a", buffering=1)  # noqa: SIM115 - open until os._exit
    # Each note is written as it happens: the rank leaves through os._exit, which runs no cleanup.
    P2PRecorder(sink=lambda note: log.write(json.dumps([note.kind, note.peer, note.batch]) + "\n")).__enter__()


def preload() -> None:
    """The expensive imports, once, before forking. No thread pool has started yet, so fork is safe."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    # torch.optim and DTensor import torch._dynamo on first use: 1.5 s each rank, 4-6 s for 4 ranks on 2 cores.
    import torch._dynamo  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    # What the checkpointing, pipeline and DDP-hook scripts import, each rank anew every launch otherwise: DCP with
    # fsspec 0.4-0.6 s a rank, pipelining 0.2 s. Measured on chapter 14's runs, the CPU of a launch's four ranks
    # fell by a quarter to a half (a checkpoint resume 4.9 -> 3.7 s, a full-state hang 1.1 -> 0.5 s). torch's own
    # modules only: a server lives as long as its kernel, and the course's code is read fresh by every launch.
    import torch.distributed.algorithms.ddp_comm_hooks  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.pipelining  # noqa: F401
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401 - @record, and the failure summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    options = parser.parse_args()

    preload()

    port = free_port()
    errors = make_errors_folder()   # each rank's TORCHELASTIC_ERROR_FILE, in a folder of its own
    for rank in range(options.nproc):
        os.makedirs(os.path.dirname(_error_file(errors, rank)))
    try:
        return _run_ranks(options, port, errors)
    finally:   # a Ctrl-C included; a SIGKILL leaves the folder to the next launcher
        shutil.rmtree(errors, ignore_errors=True)


def _run_ranks(options: argparse.Namespace, port: int, errors: str) -> int:
    children: dict[int, int] = {}
    for rank in range(options.nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, options.nproc, port, options.script, options.script_args, errors)
        children[pid] = rank
    pids = {rank: pid for pid, rank in children.items()}

    exit_codes: dict[int, int] = {}
    first_failure: int | None = None
    first_failed_rank: int | None = None
    deadline = None
    while len(exit_codes) < options.nproc:
        if deadline is not None and time.monotonic() > deadline:
            for pid, rank in children.items():
                if rank not in exit_codes:
                    os.kill(pid, signal.SIGKILL)
            deadline = None
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.02)
            continue
        code = os.waitstatus_to_exitcode(status)
        exit_codes[children[pid]] = code
        if code != 0 and first_failure is None:
            first_failure = code if code > 0 else 1
            first_failed_rank = children[pid]
            deadline = time.monotonic() + GRACE_SECONDS

    summary = None
    if first_failure is not None:
        failed = failure_order(exit_codes, errors)
        first_failed_rank, first_failure = failed[0], max(exit_codes[failed[0]], 1)
        summary = torch_summary(options.script, failed, exit_codes, pids, errors)
        print(f"[forkrun] rank {first_failed_rank} was the first to exit with an error", file=sys.stderr,
              flush=True)
        for rank in sorted(exit_codes):
            print(f"[forkrun] rank {rank} exited with code {exit_codes[rank]}", file=sys.stderr, flush=True)
    if summary is not None:   # as torchrun ends: its agent's ChildFailedError, the root cause last
        sys.stderr.write(f"[forkrun] torchrun would end with: ChildFailedError:{summary}\n")
        sys.stderr.flush()
    return first_failure if first_failure is not None else 0


def failure_order(exit_codes: dict[int, int], errors: str) -> list[int]:
    """The failed ranks, first failure first: those that wrote an error file by the file's time (nanoseconds), then
    the others in the order they exited (``exit_codes``' order, as the launcher saw them end)."""
    failed = [rank for rank, code in exit_codes.items() if code != 0]
    written = {rank: os.stat(_error_file(errors, rank)).st_mtime_ns for rank in failed
               if os.path.isfile(_error_file(errors, rank))}
    return sorted(failed, key=lambda rank: (rank not in written, written.get(rank, 0), failed.index(rank)))


def torch_summary(script: str, failed: list[int], exit_codes: dict[int, int], pids: dict[int, int],
                  errors: str) -> str | None:
    """torch's own ChildFailedError message for these failures (torch/distributed/elastic/multiprocessing/errors/
    __init__.py:205-315), built from torch's ProcessFailure of each failed rank, as torchrun's agent builds it
    (torch/distributed/elastic/multiprocessing/api.py:964-980); None when no rank wrote an error file (no @record:
    the summary would say only "To enable traceback see ...")."""
    if not any(os.path.isfile(_error_file(errors, rank)) for rank in failed):
        return None
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {rank: ProcessFailure(local_rank=rank, pid=pids[rank], exitcode=exit_codes[rank],
                                     error_file=_error_file(errors, rank)) for rank in failed}
    return ChildFailedError(script, failures).format_msg()   # named as torchrun names it: the script as given


if __name__ == "__main__":
    sys.exit(main())
