"""labkit.forkexec: a program a scheduler starts, forked from the fork server, behaves as the interpreter would run it:
its arguments, folder, environment and standard streams; its exit code or the signal that killed it; signals passed
on; nothing outliving its client (under Slurm, nothing of the program's whole tree); anything it does not serve
handed to the real interpreter."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit import forkserver

FORKEXEC = str(Path(__file__).resolve().parents[2] / "labkit" / "forkexec.py")


@pytest.fixture(scope="module")
def env():
    path = os.environ.get(forkserver.SOCKET_ENV) or forkserver.start_server()
    return dict(os.environ, **{forkserver.SOCKET_ENV: path})


def run(env, *argv, **kw):
    return subprocess.run([sys.executable, FORKEXEC, *argv], env=env, capture_output=True, text=True, timeout=60,
                          **kw)


def started(env, code):
    process = subprocess.Popen([sys.executable, FORKEXEC, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    first = process.stdout.readline().strip()    # the program is running (and has set its handlers)
    return process, first


def test_a_script_gets_its_arguments_folder_environment_and_streams(env, tmp_path):
    script = tmp_path / "prog.py"
    script.write_text("import os, sys\nprint(sys.argv, sys.path[0] == os.path.dirname(__file__), os.getcwd(),"
                      " os.environ['ONLY_HERE'], sys.stdin.read().strip())\nprint('to stderr', file=sys.stderr)\n"
                      "sys.exit(3)\n")
    done = run(env | {"ONLY_HERE": "yes"}, "-u", str(script), "a", "b", cwd=tmp_path, input="from stdin\n")
    assert done.returncode == 3
    assert done.stdout.strip() == f"[{str(script)!r}, 'a', 'b'] True {tmp_path} yes from stdin"
    assert done.stderr.strip() == "to stderr"


def test_modules_code_and_uncaught_exceptions_as_the_interpreter_runs_them(env):
    assert run(env, "-m", "json.tool", "--help").stdout.startswith("usage: python -m json.tool")
    code = run(env, "-c", "import sys, torch; print(sys.argv, 'torch' in sys.modules)", "x")
    assert (code.returncode, code.stdout.strip()) == (0, "['-c', 'x'] True")
    # distlab.runtime ends a clean run with os._exit from an atexit handler: the code still reaches the caller
    left = run(env, "-c", "import atexit, os\natexit.register(lambda: os._exit(5))\nprint('done')")
    assert (left.returncode, left.stdout.strip()) == (5, "done")
    raised = run(env, "-c", "raise ValueError('boom')")
    assert raised.returncode == 1 and raised.stderr.strip().endswith("ValueError: boom"), raised.stderr


def test_signals_reach_the_program_and_it_ends_as_it_would(env):
    process, first = started(env, "import time; print('up', flush=True); time.sleep(60)")
    assert first == "up"
    process.send_signal(signal.SIGTERM)
    assert process.wait(10) == -signal.SIGTERM           # killed by the same signal, as a caller sees it
    process, _ = started(env, "import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: sys.exit(7))\n"
                              "print('up', flush=True)\ntime.sleep(60)")
    process.send_signal(signal.SIGUSR1)                  # a walltime warning, handled by the program
    assert process.wait(10) == 7
    killed = run(env, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed.returncode == -signal.SIGKILL
    aborted = run(env, "-c", "import os; os.abort()")    # a crash: the signal that ended it, not a guess
    assert aborted.returncode == -signal.SIGABRT


def test_a_program_does_not_outlive_its_client(env):
    process, first = started(env, "import os, time; print(os.getpid(), flush=True); time.sleep(60)")
    program = int(first)
    assert program != process.pid                        # a fork of the server, not the client itself
    process.kill()                                       # SIGKILL: no chance to pass anything on
    process.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(program, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(program, signal.SIGKILL)
    pytest.fail("the program outlived its client")


def ended(pid: int, within: float = 10) -> bool:
    """Whether ``pid`` is gone (or a zombie nobody reaps yet) within ``within`` seconds (0: now)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except OSError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# An agent as torchrun starts its workers, each in a session of its own (torch 2.13 distributed/elastic/
# multiprocessing/subprocess_handler/subprocess_handler.py:64-66): a plain child, and a worker started through this
# wrapper (as PYTHON_EXEC does), itself a client whose program is forked from the server, a child of neither. It prints
# both pids: the plain child's and the worker program's (which that program prints first).
AGENT = ("import subprocess, sys, time\n"
         "plain = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
         f"worker = subprocess.Popen([sys.executable, {FORKEXEC!r}, '-c',\n"
         "                            'import os, time; print(os.getpid(), flush=True); time.sleep(60)'],\n"
         "                           start_new_session=True, stdout=subprocess.PIPE, text=True)\n"
         "print(plain.pid, worker.stdout.readline().strip(), flush=True)\ntime.sleep(60)\n")


@pytest.mark.parametrize("whole_tree", [True, False])
def test_a_signal_and_a_kill_reach_the_programs_descendants_only_for_a_whole_tree(env, whole_tree):
    """DISTLAB_FORKEXEC_WHOLE_TREE=1 (the Slurm tier): the client stands in for a task's whole process tree, which
    Slurm's proctrack/linuxproc signals process by process. A TERM to it reaches the agent's plain child and, through
    the worker's own client, the worker program; so does the kill when the client is killed. Without it, only the
    agent: both outlive it, as they would a `kill PID` of a real agent (the 1 s wait there can only miss a late
    death, not invent one)."""
    settings = env | {"DISTLAB_FORKEXEC_WHOLE_TREE": "1" if whole_tree else "0"}
    for how in ("TERM to the client", "the client killed"):
        process, first = started(settings, AGENT)
        descendants = [int(pid) for pid in first.split()]
        try:
            if how == "TERM to the client":
                process.send_signal(signal.SIGTERM)
                assert process.wait(10) == -signal.SIGTERM
            else:
                process.kill()
                process.wait(10)
            gone = [ended(pid, within=10 if whole_tree else 1) for pid in descendants]
            assert gone == [whole_tree, whole_tree], (how, descendants)
        finally:
            for pid in descendants:
                if not ended(pid, within=0):     # only a process still there: a gone pid may be another's by now
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


def test_what_it_does_not_serve_goes_to_the_real_interpreter(env):
    for argv in (["-S", "-c", "import sys; print('torch' in sys.modules)"],      # an option it leaves alone
                 ["-c", "import sys; print('torch' in sys.modules)"]):       # no server exported
        settings = env if argv[0] == "-S" else {k: v for k, v in env.items() if k != forkserver.SOCKET_ENV}
        assert run(settings, *argv).stdout.strip() == "False", argv     # a fresh interpreter: torch not loaded


def test_a_rank_that_imports_torch_starts_in_a_fraction_of_an_interpreters_time(env):
    code = "import torch, torch.distributed"
    start = time.monotonic()
    run(env, "-c", code)
    forked = time.monotonic() - start
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    fresh = time.monotonic() - start
    assert forked < fresh / 2, (forked, fresh)
