"""``python labkit/forkexec.py [-u] (SCRIPT | -m MODULE | -c CODE) [ARGS...]``: a Python program run as a child of
the fork server (torch already imported there) instead of an interpreter that imports torch again.

Why: a rank that a scheduler starts (srun, mpiexec, torchrun's agent) is a new interpreter, and its first 2 s go to
``import torch``. The Slurm and PBS test tiers start about a hundred of them in ``make test``, on two cores. Given as
the jobs' ``DISTLAB_PYTHON`` (tests/conftest.py writes a two-line wrapper), this small client, which imports nothing
heavy, asks the server that ``make test`` already runs (:mod:`labkit.forkserver`) to fork the program with this
process's arguments, working directory, environment, CPU affinity, umask and standard input, output and error, and
then stands in for it: the signals it gets (TERM from srun or torchrun, USR1 from a walltime warning, INT) are passed
to the program, and it exits as the program did (the same exit code, or killed by the same signal: the server's
child that forked the program waits for it and reports which). If this client dies (SIGKILL after a job's
KillWait), that child kills the program.

The program is not in the client's process tree, so a scheduler that signals a task's whole tree (Slurm's
proctrack/linuxproc walks /proc for every descendant of the task and signals each: kill_tree.c, kill_proc_tree)
would reach the client only. With ``DISTLAB_FORKEXEC_WHOLE_TREE=1`` in its environment the client stands in for
that tree: a signal it gets goes to the program and to every descendant the program has at that moment, and if the
client is killed, the program and all its descendants are killed. A torchrun agent's workers, in sessions of their
own, are among them; started through this wrapper too (PYTHON_EXEC), each is a client that inherits the setting and
passes what it gets on to its own program in turn. One pass: a process forked between the walk and the kill escapes
it. The Slurm tier sets it; without it only the program is signalled or killed, as a plain ``kill PID`` of an
interpreter would be (what labkit.launch's own timeout must cope with: torchrun's workers outlive a killed agent).

Whatever it does not serve, it hands to the real interpreter unchanged (``os.execv``): any other interpreter option,
a program on standard input, no server (``DISTLAB_FORK_SERVER_SOCKET`` unset or gone). What differs from a fresh
interpreter is what differs in every fork launch (:mod:`labkit.forkrun`): the modules torch loaded at import time
already loaded, and torch's thread count fixed when the server imported it (one thread: OMP_NUM_THREADS=1 there).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

SOCKET_ENV = "DISTLAB_FORK_SERVER_SOCKET"   # as labkit.forkserver.SOCKET_ENV (this client imports nothing of labkit)
WHOLE_TREE_ENV = "DISTLAB_FORKEXEC_WHOLE_TREE"   # "1": signal and kill the program's descendants too
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def descendants(top: int) -> list[int]:
    """Every live process below ``top`` (children, their children, ...), found as Slurm's proctrack/linuxproc finds a
    task's: each /proc/PID/stat's parent, zombies left out (kill_tree.c, _build_hashtbl and _get_list)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()   # after "(comm)", which may hold spaces
            state, parent = fields[0], int(fields[1])
        except (OSError, IndexError, ValueError):                    # gone meanwhile, or unreadable: skipped
            continue
        if state != b"Z":
            children.setdefault(parent, []).append(int(name))
    found, waiting = [], [top]
    while waiting:
        below = children.get(waiting.pop(), [])
        found += below
        waiting += below
    return found


def signal_program(pid: int, number: int, whole_tree: bool) -> None:
    """Send ``number`` to the program, and with ``whole_tree`` to each of its descendants too (the tree read
    first, before the program can go and its children be handed to another parent). A descendant that is a client
    of this server itself (a torchrun worker started through PYTHON_EXEC) passes the signal on to its own program."""
    for target in [pid, *(descendants(pid) if whole_tree else [])]:
        try:
            os.kill(target, number)
        except OSError:                                  # gone, or not ours to signal: the others still get it
            pass


def parse(argv: list[str]) -> dict | None:
    """The program the interpreter's arguments name: {"mode": "script"|"module"|"code", "target", "args",
    "unbuffered"}; None for anything this client leaves to the real interpreter."""
    unbuffered = False
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "-u":
            unbuffered = True
            i += 1
            continue
        if word in ("-m", "-c"):
            if i + 1 >= len(argv):
                return None
            mode = "module" if word == "-m" else "code"
            return {"mode": mode, "target": argv[i + 1], "args": argv[i + 2:], "unbuffered": unbuffered}
        if word.startswith("-"):
            return None   # -S, -W..., -X..., -, --: the real interpreter's business
        return {"mode": "script", "target": word, "args": argv[i + 1:], "unbuffered": unbuffered}
    return None           # no program: an interactive interpreter


def _real_interpreter(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def main(argv: list[str]) -> None:
    program = parse(argv)
    path = os.environ.get(SOCKET_ENV)
    if program is None or not path:
        _real_interpreter(argv)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        connection.close()
        _real_interpreter(argv)
    env = dict(os.environ)
    if program["unbuffered"]:
        env["PYTHONUNBUFFERED"] = "1"
    mask = os.umask(0)
    os.umask(mask)
    # The handlers come first: a signal that arrives before the program's pid does is passed on once it is known
    # (a program can print, and be signalled by whoever reads it, before this client has read that pid).
    program_pid = [0]
    pending: list[int] = []

    whole_tree = env.get(WHOLE_TREE_ENV) == "1"

    def forward(number, _frame):
        if not program_pid[0]:
            pending.append(number)
            return
        signal_program(program_pid[0], number, whole_tree)

    for number in FORWARDED:
        signal.signal(number, forward)
    request = json.dumps({"kind": "exec", "program": program, "cwd": os.getcwd(), "env": env, "umask": mask,
                          "affinity": sorted(os.sched_getaffinity(0))}).encode()
    socket.send_fds(connection, [len(request).to_bytes(8, "big") + request], [0, 1, 2])

    received = b""

    def line() -> str:
        nonlocal received
        while b"\n" not in received:
            chunk = connection.recv(64)
            if not chunk:
                return ""
            received += chunk
        text, received = received.split(b"\n", 1)
        return text.decode()

    program_pid[0] = int(line() or 0)
    if program_pid[0]:                                   # (no pid: the server went; nothing to pass anything to)
        for number in pending:
            forward(number, None)
    how, _, value = line().partition(" ")
    sys.stdout.flush()
    if how == "exit":
        os._exit(int(value))
    # killed by a signal: end the same way, so the caller sees what it would have (no report at all: the server
    # went, and with it the program's parent: say SIGKILL)
    number = int(value) if how == "signal" else signal.SIGKILL
    if number != signal.SIGKILL:   # SIGKILL's disposition cannot be set (and needs no resetting)
        signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)
    os._exit(128 + number)


# --------------------------------------------------------------------------------------------------
# In the fork server's child (labkit.forkserver calls this after fork)
# --------------------------------------------------------------------------------------------------


def be_the_program(request: dict, fds: list[int], connection: socket.socket) -> None:
    """In the fork server's child: fork the program of the request, and report how it ended. Never returns.

    This child stays between the server and the program as its parent, so that it can wait for it: it tells the
    client the program's pid, reports its exit code or the signal that killed it, and kills it (and, where the client
    stands in for a whole tree, its descendants) if the client goes (closes the connection) first."""
    import select

    program = 0
    ended = False
    whole_tree = request["env"].get(WHOLE_TREE_ENV) == "1"
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # the server ignores SIGCHLD: this child must wait
        started = time.monotonic()
        program = os.fork()
        if program == 0:
            connection.close()
            _run(request, fds)                           # never returns
        for fd in fds:
            os.close(fd)
        connection.sendall(f"{program}\n".encode())
        while True:
            done, status = os.waitpid(program, os.WNOHANG)
            if done:
                ended = True
                break
            readable, _, _ = select.select([connection], [], [], 0.05)
            if readable:
                try:
                    gone = not connection.recv(64)
                except OSError:                          # reset: gone as surely as closed
                    gone = True
                if gone:                                 # the client was killed: the program goes too
                    break
        if ended:
            from labkit import forkserver

            forkserver.note_cpu("exec", [request["program"]["target"], *request["program"]["args"]], started,
                                request)
            how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else \
                f"exit {os.waitstatus_to_exitcode(status)}"
            connection.sendall(f"{how}\n".encode())
    finally:
        if program and not ended:                        # whatever went wrong here, nothing outlives the client
            try:
                signal_program(program, signal.SIGKILL, whole_tree)   # the tree is read before the program goes
                os.waitpid(program, 0)
            except Exception:  # noqa: BLE001 - this child must still reach its os._exit below
                pass
        os._exit(0)


def run_as_main(mode: str, target: str, args: list[str], *, before=None, report=None) -> int:
    """Run a program as the interpreter runs ``__main__``, in this process, and return the exit code the interpreter
    would give. ``mode`` is "script" (a file), "module" (``-m``) or "code" (``-c``); ``target`` the file, the module
    or the code; ``args`` its arguments. Each mode sets ``sys.argv`` and ``sys.path[0]`` as ``python`` does.

    The exit code: 0 when it returns; a SystemExit's code (its message, if it is text, printed to stderr, and 1);
    1 after an uncaught exception, which ``report(type, value, traceback)`` shows (``sys.excepthook``, as the
    interpreter does, unless given). ``before()``, if given, runs after sys.argv and sys.path are set, just before
    the program, and its failures count as the program's. Shared by the fork server's programs (:func:`_run`) and
    :mod:`labkit.forkrun`'s ranks; what the interpreter does on its way out (atexit) is left to the caller."""
    import runpy

    try:
        if mode == "script":
            sys.argv = [target, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))   # as `python script.py` would
        elif mode == "module":
            sys.argv = [target, *args]   # runpy puts the module's file in sys.argv[0]
            sys.path.insert(0, os.getcwd())
        else:
            sys.argv = ["-c", *args]
            sys.path.insert(0, "")
        if before is not None:
            before()
        if mode == "script":
            runpy.run_path(target, run_name="__main__")
        elif mode == "module":
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    except SystemExit as done:
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(done.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - an uncaught exception, reported as the interpreter would
        (report or sys.excepthook)(*sys.exc_info())
        return 1


def take_environment(env: dict[str, str]) -> None:
    """In a child of the fork server: this environment as the process's own, and what the server had computed from
    its own forgotten. tempfile reads TMPDIR once a process (``tempfile.tempdir``, set by the server's imports):
    cleared, the child reads it from this environment, as a new interpreter would (a job's TMPDIR, say)."""
    import tempfile

    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None


def _run(request: dict, fds: list[int]) -> None:
    """Become the program: its streams, folder, environment, umask and CPUs; run it as the interpreter would."""
    import atexit
    import traceback

    code = 1
    try:
        for number in FORWARDED:
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)   # as the interpreter sets them at start
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        take_environment(request["env"])
        os.umask(request["umask"])
        os.sched_setaffinity(0, request["affinity"])
        program = request["program"]
        code = run_as_main(program["mode"], program["target"], program["args"])
        atexit._run_exitfuncs()   # what the interpreter runs on its way out (a script's atexit handlers)
    except BaseException:  # noqa: BLE001 - whatever happened, the client gets an exit code
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
