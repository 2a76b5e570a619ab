"""Run a course script on N ranks from a notebook or a test, stream its output live, return its metrics.

    result = launch.run("scripts/03_communication/collectives.py", nproc=4)
    result.metrics["checks"]            # the script's metrics JSON, as a dict

Two ways to start the ranks, same script, same environment variables (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT):

* ``torchrun``: what you type on a cluster. Each rank imports torch itself: 8-16 s for 4 ranks on 2 cores.
* ``fork``: one process imports torch once, then forks the ranks: 2-5 s. Safe on CPU only (CUDA does not
  survive fork), so it is used only when the run is on CPU. Notebooks and tests use it to stay fast.

``launcher="auto"`` picks fork for CPU runs and torchrun otherwise; ``DISTLAB_LAUNCH_MODE`` (auto, fork
or torchrun) overrides it. (The PBS jobs' ``DISTLAB_LAUNCHER`` is another thing: mpiexec or torchrun per node.)
A failing run raises :class:`LaunchError` with the tail of its output (unless ``check=False``).

``DISTLAB_LAUNCH_CACHE=DIR`` (set by the test suite only) replays a run already made in the same test
session with the same inputs: the learner's copy of a notebook launches exactly what the full notebook
launched a minute earlier, so the suite does not pay for it twice. A run is a function of its inputs only if
the key holds all of them, and a replay is the run only if it leaves what the run left. So the key is every
source file the run depends on (the script, its folder's helpers, the ``distlab`` package: see
:func:`run_dependencies`), the arguments, the ranks, the launcher, the environment the ranks get (see
:data:`KEYED_ENVIRONMENT`), and the contents of every file or folder an argument names (a checkpoint to resume
from: :func:`file_arguments`); and a replay restores the files and folders those arguments name as the run
left them (the checkpoint an interrupted run wrote, which the resumed run reads next). An edit anywhere in
them can never replay a stale result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from labkit import forkserver

REPO_ROOT = Path(__file__).resolve().parent.parent
TAIL_LINES = 40

# Lines a learner need not see, left out of the live output (kept in the result's output and the logs): the
# profiler's own trace points, "USDT:... SyncActivityProfilerHandler.cpp:52] profiler_start", eight a profiled run.
NOT_SHOWN = ("USDT:",)


class LaunchError(RuntimeError):
    def __init__(self, message: str, result: "LaunchResult"):
        super().__init__(message)
        self.result = result


@dataclass
class LaunchResult:
    command: list[str]
    returncode: int
    output: str
    seconds: float
    metrics: dict | None = None
    rank_exit_codes: dict = field(default_factory=dict)

    @property
    def lines(self) -> list[str]:
        return self.output.splitlines()

    def tail(self, n: int = TAIL_LINES) -> str:
        return "\n".join(self.lines[-n:])


# An interpreter for torchrun's agent and ranks in place of this one: make test names a wrapper that forks each
# from its fork server (labkit/forkexec.py, tests/helpers.py), torch imported once, not five times a launch.
RANK_PYTHON_ENV = "DISTLAB_RANK_PYTHON"


def torchrun_invocation(torchrun_args, script, args=()) -> list[str]:
    """The command that runs torchrun (``torchrun_args``: its own options) on ``script`` from here: this interpreter,
    or under make test the rank-interpreter wrapper (RANK_PYTHON_ENV) for the agent and, through --no-python, for
    each rank, forked from the fork server (labkit.forkexec)."""
    python = os.environ.get(RANK_PYTHON_ENV)
    if python:
        return [python, "-m", "torch.distributed.run", *torchrun_args, "--no-python", python, "-u", str(script),
                *map(str, args)]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args, str(script), *map(str, args)]


def torchrun_command(script: str, nproc: int, args=()) -> list[str]:
    """The command a person would type (shown before every launch, so a learner can copy it)."""
    return ["torchrun", "--standalone", f"--nproc_per_node={nproc}", str(script), *map(str, args)]


def _wants_cpu(args) -> bool:
    args = [str(a) for a in args]
    for i, a in enumerate(args):
        if a == "--device" and i + 1 < len(args):
            return args[i + 1] == "cpu" or (args[i + 1] == "auto" and not _has_cuda())
        if a.startswith("--device="):
            value = a.split("=", 1)[1]
            return value == "cpu" or (value == "auto" and not _has_cuda())
    return not _has_cuda()


def _has_cuda() -> bool:
    # Without importing torch in the caller: nvidia-smi's presence and a visible device are enough to decide.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl"))


def child_environment(extra: dict | None = None, base: dict | None = None) -> dict:
    """The ranks' environment: this one, unbuffered output, one OpenMP thread, a process-group timeout, and the
    folder holding this ``distlab`` first on ``PYTHONPATH``: the ranks import the library that launched them,
    also from a Python where the course was never ``pip install -e``'d (a GPU node's own PyTorch image: there
    every rank died with ``No module named 'distlab'``, seen on an H200)."""
    child_env = dict(os.environ if base is None else base, PYTHONUNBUFFERED="1", **(extra or {}))
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.setdefault("DISTLAB_PG_TIMEOUT", "120")
    library_root = str(Path(__file__).resolve().parent.parent)
    child_env["PYTHONPATH"] = os.pathsep.join([library_root, *filter(None, [child_env.get("PYTHONPATH")])])
    return child_env


def run(script: str | os.PathLike, nproc: int = 4, args=(), *, launcher: str = "auto", timeout: float = 180,
        stream: bool = True, check: bool = True, env: dict | None = None, cwd: str | os.PathLike | None = None,
        metrics: bool = True, replay: bool = True) -> LaunchResult:
    """Run ``script`` on ``nproc`` ranks and return its :class:`LaunchResult` (with ``metrics`` loaded).

    ``--metrics-out`` is added (a temporary file) unless ``args`` already has it or ``metrics=False``.
    ``replay=False`` (a test's second try of a run that reads a clock): run it even when this session's replay
    cache holds it, and keep this run in its place, so that whoever replays it next gets this one.
    """
    cwd = Path(cwd) if cwd else REPO_ROOT
    script = Path(script)
    args = [str(a) for a in args]
    launcher = os.environ.get("DISTLAB_LAUNCH_MODE", launcher)
    if launcher == "auto":
        launcher = "fork" if _wants_cpu(args) else "torchrun"
    if launcher not in ("fork", "torchrun"):
        raise ValueError(f"launcher must be auto, fork or torchrun, not {launcher!r}")

    tmpdir = tempfile.TemporaryDirectory(prefix="distlab-")
    metrics_path = None
    if metrics and "--metrics-out" not in args and not any(a.startswith("--metrics-out=") for a in args):
        metrics_path = Path(tmpdir.name) / "metrics.json"
        args += ["--metrics-out", str(metrics_path)]
    elif metrics:
        i = next(i for i, a in enumerate(args) if a.startswith("--metrics-out"))
        metrics_path = Path(args[i].split("=", 1)[1] if "=" in args[i] else args[i + 1])
        if not metrics_path.is_absolute():
            metrics_path = cwd / metrics_path

    if launcher == "torchrun":
        command = torchrun_invocation(["--standalone", f"--nproc_per_node={nproc}"], script, args)
    else:
        command = [sys.executable, "-m", "labkit.forkrun", f"--nproc={nproc}", str(script), *args]

    child_env = child_environment(env)
    cache_file = _cache_file(script, cwd, nproc, launcher, args, metrics_path, env, child_env)
    if replay and cache_file is not None and cache_file.exists():
        result = _replay(cache_file, script, check, stream, metrics_path, file_arguments(args, cwd, metrics_path))
        tmpdir.cleanup()
        _note_launch(cache_file, script, replayed=True, seconds=0.0)
        return result

    shown = torchrun_command(script, nproc, [a for a in args if a != str(metrics_path)
                                               and a != "--metrics-out"] if metrics_path else args)
    if stream:
        print(f"$ {shlex.join(shown)}" + ("   [started by fork: same script, faster on CPU]"
                                          if launcher == "fork" else ""), flush=True)

    started = time.perf_counter()
    process = None
    if launcher == "fork" and forkserver.enabled():   # make test: forked from a process that imported torch once
        try:
            process = forkserver.start(command[3:], cwd, child_env)
        except (OSError, RuntimeError) as error:       # no server (a socket path too long, say): a forkrun of its own
            print(f"[launch] fork server unavailable ({error}); starting forkrun directly", file=sys.stderr)
    if process is None:
        process = subprocess.Popen(command, cwd=cwd, env=child_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
    lines: list[str] = []

    def pump():
        for line in process.stdout:
            lines.append(line)
            if stream and not line.startswith(NOT_SHOWN):
                print(line, end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_past_its_timeout(process, launcher)
        reader.join(timeout=5)
        result = LaunchResult(command, -9, "".join(lines), time.perf_counter() - started)
        tmpdir.cleanup()
        raise LaunchError(f"{script} did not finish within {timeout:.0f} s (killed). Last output:\n"
                          f"{result.tail()}", result) from None
    reader.join(timeout=10)
    output = "".join(lines)
    result = LaunchResult(command, process.returncode, output, time.perf_counter() - started,
                          rank_exit_codes=_rank_exit_codes(output))
    if metrics_path is not None and metrics_path.exists():
        result.metrics = json.loads(metrics_path.read_text())
    tmpdir.cleanup()
    _note_launch(cache_file, script, replayed=False, seconds=result.seconds)
    if cache_file is not None:
        _store(cache_file, {"command": command, "returncode": result.returncode, "output": output,
                            "seconds": result.seconds, "metrics": result.metrics,
                            "rank_exit_codes": result.rank_exit_codes}, file_arguments(args, cwd, metrics_path))
    if check and result.returncode != 0:
        raise LaunchError(_failure_message(script, result), result)
    return result


_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt|Exit)\b.*")


def first_error(output: str) -> str | None:
    """The first exception line of a run: when one rank fails, its peers fail after it (connection reset by
    peer), so the first one is the cause. Config errors are found too."""
    for line in output.splitlines():
        if line.startswith("config error") or _EXCEPTION_LINE.match(line):
            return line.strip()
    return None


def _failure_message(script, result: "LaunchResult") -> str:
    cause = first_error(result.output)
    return (f"{script} exited with code {result.returncode} after {result.seconds:.1f} s."
            + (f"\nFirst error: {cause}" if cause else "") + f"\nLast output:\n{result.tail()}")


def _rank_exit_codes(output: str) -> dict[int, int]:
    """Exit code of each rank, from the fork launcher's closing lines (``rank R exited with code C``)."""
    codes = {}
    for line in output.splitlines():
        if line.startswith("[forkrun] rank ") and " exited with code " in line:
            rank = int(line.split()[2])
            codes[rank] = int(line.rsplit(" ", 1)[1])
    return codes


# How long torchrun's agent gets to stop its workers after a TERM before its process group is killed.
AGENT_STOP_S = 10


def stop_past_its_timeout(process, launcher: str) -> None:
    """End a run that outlived its timeout, ranks and all.

    A fork launch's ranks are in its process group: one SIGKILL ends them. torchrun starts each worker in a session
    of its own (torch 2.13 distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py:64-66,
    start_new_session), so killing torchrun's group would leave the ranks running, a GPU's memory held by them. A
    TERM first: the agent passes it to its workers and waits for them to exit (its shutdown; the TERM ends a rank
    at once unless the rank handles it), then whatever is left of the group is killed."""
    if launcher == "torchrun":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=AGENT_STOP_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# The variables of the ranks' environment that can change what a run computes or prints, and so belong in the
# cache's key. The rest (PATH, a kernel's JPY_* or pytest's PYTEST_CURRENT_TEST, which differ between two callers
# launching the same run) do not. DISTLAB_LAUNCH_CACHE and the fork server's variables (its socket differs from
# one make test phase to the next) choose how a run is started, not what it does.
KEYED_ENVIRONMENT = ("DISTLAB_", "TORCH", "NCCL_", "GLOO_", "OMP_", "MKL_", "KMP_", "CUDA_", "MASTER_",
                     "PYTHONHASHSEED", "PYTHONPATH")
# Each make test phase starts its own fork server and rank-interpreter wrapper (RANK_PYTHON_ENV), at new paths:
# keyed, no run of one phase would replay in the next. The timeline plugin's folder changes no run either. Nor
# does inductor's cache folder, which torch writes into its own process's environment the first time it asks for
# it (torch 2.13 _inductor/runtime/cache_dir_utils.py:14-19, cache_dir): keyed, the runs of a process that had
# compiled something (a make test worker, a lab's kernel) never replayed in one that had not (every learner's copy).
NOT_KEYED = ("DISTLAB_LAUNCH_CACHE", "DISTLAB_FORK_SERVER", "DISTLAB_FORK_SERVER_SOCKET", RANK_PYTHON_ENV,
             "DISTLAB_TEST_TIMELINE", "TORCHINDUCTOR_CACHE_DIR")


def file_arguments(args: list[str], cwd: Path, metrics_path=None) -> list[Path]:
    """The files and folders a run's arguments name, its metrics file aside: what a script may read (a checkpoint
    to resume from) or write (a checkpoint, a trace) besides its metrics. An argument names a path when it holds a
    path separator or names something that exists (``--save-dir build/x``, ``--trace-dir=/tmp/t``)."""
    paths = []
    for arg in args:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if value.startswith("-") or not value:
            continue
        path = Path(value) if Path(value).is_absolute() else cwd / value
        if metrics_path is not None and path == Path(metrics_path):
            continue
        if os.sep in value or path.exists():
            paths.append(path)
    return paths


def _state_of(path: Path) -> list:
    """What is at ``path``: nothing, a file's bytes, or a folder's files and their bytes (as hashes)."""
    def digest(file: Path) -> str:
        return hashlib.sha256(file.read_bytes()).hexdigest()

    if path.is_file():
        return ["file", digest(path)]
    if path.is_dir():
        return ["folder", [[str(f.relative_to(path)), digest(f)] for f in sorted(path.rglob("*")) if f.is_file()]]
    return ["nothing"]


def _cache_file(script: Path, cwd: Path, nproc: int, launcher: str, args: list[str], metrics_path,
                env: dict | None = None, child_env: dict | None = None) -> Path | None:
    folder = os.environ.get("DISTLAB_LAUNCH_CACHE")
    path = script if script.is_absolute() else cwd / script
    if not folder or not path.exists():
        return None
    key = hashlib.sha256(f"{path.parent.name}/{path.name}".encode())  # which script: its folder's other
    dependency_digests = []
    for source in run_dependencies(path):                              # scripts are among its dependencies
        key.update(f"{source.parent.name}/{source.name}".encode())     # an edit to any of them is a new key:
        key.update(source.read_bytes())                                # never a stale replay
        dependency_digests.append((str(source), hashlib.sha256(source.read_bytes()).hexdigest()[:12]))
    ranks_environment = child_env if child_env is not None else child_environment(env)
    keyed = sorted((name, value) for name, value in ranks_environment.items()
                   if name.startswith(KEYED_ENVIRONMENT) and name not in NOT_KEYED)
    files = [[str(p), _state_of(p)] for p in file_arguments(args, cwd, metrics_path)]  # what the run will read
    key.update(json.dumps([nproc, launcher, [a for a in args if a != str(metrics_path)],
                           sorted((env or {}).items()), keyed, files]).encode())
    Path(folder).mkdir(parents=True, exist_ok=True)
    _KEY_INPUTS[key.hexdigest()[:24]] = {"environment": keyed, "args": args, "cwd": str(cwd),
                                         "sources": hashlib.sha256(str(sorted(dependency_digests)).encode()).hexdigest()[:12]}
    return Path(folder) / f"{key.hexdigest()[:24]}.json"


_KEY_INPUTS: dict = {}   # a key's inputs, for the test timeline's notes


def _note_launch(cache_file: Path | None, script: Path, replayed: bool, seconds: float) -> None:
    """make test with DISTLAB_TEST_TIMELINE=folder (coursetools.test_timeline): one line a launch, in one write, so
    that the account can tell the runs replayed from those run twice (two tests asking for the same run at once)."""
    folder = os.environ.get("DISTLAB_TEST_TIMELINE")
    if not folder:
        return
    note = {"key": cache_file.stem if cache_file else None, "script": f"{script.parent.name}/{script.name}",
            "replayed": replayed, "seconds": round(seconds, 2), "start": round(time.time() - seconds, 2),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
            "inputs": _KEY_INPUTS.get(cache_file.stem) if cache_file else None}   # what a missed replay differed in
    with contextlib.suppress(OSError), open(os.path.join(folder, "launches.jsonl"), "a") as log:
        log.write(json.dumps(note) + "\n")   # O_APPEND, one write: whole lines from every process


def run_dependencies(script: Path) -> list[Path]:
    """Every source file a run of ``script`` depends on: the script, the Python files of its folder (its
    chapter's ``common_*.py`` helpers), the whole ``distlab`` library (its sub-packages too) and the launcher
    that starts the ranks (this module and ``forkrun``). The replay cache keys on them all."""
    script = Path(script).resolve()
    here = Path(__file__).resolve().parent
    library = REPO_ROOT / "distlab"
    files = {script, *script.parent.glob("*.py"), *library.rglob("*.py"), here / "launch.py", here / "forkrun.py"}
    return sorted(files)


def _store(cache_file: Path, saved: dict, paths: list[Path]) -> None:
    """Keep a run for replay: its files first (each named path as the run left it, or a note that it left
    nothing there), then its record, each moved into place whole, so that a reader in another process finds
    either no entry or a complete one. Two processes storing the same run store the same thing: the first wins."""
    if paths:
        files = cache_file.with_suffix(".files")
        staging = Path(tempfile.mkdtemp(prefix=files.name + "-", dir=cache_file.parent))
        for index, path in enumerate(paths):
            if path.is_dir():
                shutil.copytree(path, staging / str(index))
            elif path.is_file():
                shutil.copy2(path, staging / str(index))
        try:
            os.rename(staging, files)
        except OSError:         # another process stored this run first
            shutil.rmtree(staging, ignore_errors=True)
    record = cache_file.with_suffix(f".{os.getpid()}.tmp")
    record.write_text(json.dumps({**saved, "files": [str(p) for p in paths]}))
    os.replace(record, cache_file)


def _replay(cache_file: Path, script: Path, check: bool, stream: bool, metrics_path,
            paths: list[Path]) -> LaunchResult:
    saved = json.loads(cache_file.read_text())
    if metrics_path is not None and saved["metrics"] is not None:  # a caller may read the file itself
        Path(metrics_path).parent.mkdir(parents=True, exist_ok=True)
        Path(metrics_path).write_text(json.dumps(saved["metrics"]))
    # The named paths held what they held before the run (their contents are in the key): leave them as it did.
    files = cache_file.with_suffix(".files")
    for index, path in enumerate(paths):
        kept = files / str(index)
        if _state_of(path) == _state_of(kept):
            continue            # an input the run only read, or an output already there: left untouched
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        if kept.is_dir():
            shutil.copytree(kept, path)
        elif kept.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(kept, path)
    result = LaunchResult(saved["command"], saved["returncode"], saved["output"], saved["seconds"],
                          saved["metrics"], {int(k): v for k, v in saved["rank_exit_codes"].items()})
    if stream:
        print(f"[replayed from this test session's earlier run of {script}]", flush=True)
        print("".join(ln for ln in result.output.splitlines(keepends=True) if not ln.startswith(NOT_SHOWN)),
              end="", flush=True)
    if check and result.returncode != 0:
        raise LaunchError(_failure_message(script, result), result)
    return result
