"""A fork server: torch imported once, a ``labkit.forkrun`` forked per launch.

Every fork launch (``launch.run`` on CPU) would start ``python -m labkit.forkrun``, whose first 2.4 s go to importing
torch before it forks the ranks: most of a configuration-error test, a third of a short run, and a lab launches ten
to thirty runs. So the first fork launch of a process starts this server, which imports what forkrun imports and
waits on a Unix socket; each launch asks it to fork a child that *is* the forkrun of that launch (the same
``forkrun.main``, the launch's arguments, working directory and environment, its output on a pipe the caller
reads), so the caller sees what ``subprocess.Popen`` would give it: the output, a process group to kill on a
timeout, the exit code. ``DISTLAB_FORK_SERVER=0`` turns it off: each launch then starts its own forkrun. The same
server also forks whole programs for :mod:`labkit.forkexec` (a scheduler's ranks in the test tiers).

The server's socket is exported to the processes its starter starts afterwards (``DISTLAB_FORK_SERVER_SOCKET``):
make test starts one server a phase, before its pytest workers (tests/conftest.py), and the workers, their notebook
kernels and their subprocesses fork their launches from it instead of importing torch in a server of their own. A process that finds no server answering there starts its own.

Fork is safe here for the reason it is safe in forkrun: the server imports, never computes, so no thread pool has
started when it forks. The server leaves when the process that started it does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ENABLE_ENV = "DISTLAB_FORK_SERVER"
SOCKET_ENV = "DISTLAB_FORK_SERVER_SOCKET"   # a server started by this process or its parent, for its children
_started: dict = {}   # this process's server: {"process": Popen, "path": socket path}
_starting = threading.Lock()   # a lab's background launches (chapter 14) must not start one server each


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


# --------------------------------------------------------------------------------------------------
# The client: what launch.run uses instead of subprocess.Popen
# --------------------------------------------------------------------------------------------------


class ForkedRun:
    """A forkrun forked by the server, with Popen's few members that launch.run uses."""

    def __init__(self, path: str, argv: list[str], cwd: str, env: dict):
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.connect(path)    # a server gone: the caller starts another (no pipe left open behind)
        except OSError:
            self._socket.close()
            raise
        read_end, write_end = os.pipe()
        request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env}).encode()
        socket.send_fds(self._socket, [len(request).to_bytes(8, "big") + request], [write_end])
        os.close(write_end)   # the child holds the only writing end: EOF when it and its ranks have exited
        self.stdout = os.fdopen(read_end, "r", buffering=1)
        self._received = b""
        self.pid = int(self._line())   # the child's pid, also its process group (it calls setsid)
        self.returncode: int | None = None

    def _line(self) -> str:
        """The next line the child sent; '' when it closed the connection without one (it was killed)."""
        while b"\n" not in self._received:
            chunk = self._socket.recv(64)   # raises socket.timeout, and the partial line stays in _received
            if not chunk:
                return ""
            self._received += chunk
        line, self._received = self._received.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        self._socket.settimeout(timeout)
        try:
            line = self._line()
        except (TimeoutError, socket.timeout):
            raise subprocess.TimeoutExpired(["labkit.forkrun"], timeout) from None
        self.returncode = int(line) if line.strip() else -signal.SIGKILL   # no code: it was killed
        self._socket.close()
        return self.returncode


def start(argv: list[str], cwd, env: dict) -> ForkedRun:
    """Fork ``python -m labkit.forkrun *argv`` in ``cwd`` with ``env``, from this process's server (or the one its
    parent exported: see :data:`SOCKET_ENV`)."""
    shared = os.environ.get(SOCKET_ENV)
    if shared and _started.get("path") != shared:
        try:
            return ForkedRun(shared, argv, cwd, env)
        except OSError:                 # that server has gone (its starter exited): start one of this process's
            os.environ.pop(SOCKET_ENV, None)
    return ForkedRun(start_server(), argv, cwd, env)


def start_server() -> str:
    """This process's server, started if it is not running: its socket's path, also exported to the processes
    this one starts from now on."""
    with _starting:
        return _start_server()


def _start_server() -> str:
    process = _started.get("process")
    if process is not None and process.poll() is None:
        return _started["path"]
    # a Unix socket's path must fit in 108 bytes: /tmp when it exists, whatever TMPDIR says
    folder = tempfile.mkdtemp(prefix="dlfs-", dir="/tmp" if os.path.isdir("/tmp") else None)
    path = os.path.join(folder, "socket")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop(SOCKET_ENV, None)
    process = subprocess.Popen([sys.executable, "-m", "labkit.forkserver", path], env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the fork server did not start (exit code {process.poll()})")
        time.sleep(0.05)
    _started.update(process=process, path=path)
    os.environ[SOCKET_ENV] = path
    atexit.register(shutil.rmtree, folder, ignore_errors=True)   # after the kill below (atexit runs last first)
    atexit.register(process.kill)
    return path


# --------------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------------


TIMELINE = os.environ.get("DISTLAB_TEST_TIMELINE")   # make test's timeline folder, read as the server starts


def note_cpu(kind: str, argv: list[str], started: float, request: dict) -> None:
    """make test with DISTLAB_TEST_TIMELINE: the CPU seconds a forked program used, its own and its waited
    children's (a forkrun's ranks, a kernel's), one line in ``programs.jsonl``. Unlike a machine-wide sample this
    does not depend on what else ran at the time, so the timeline can say which runs cost the most CPU."""
    folder = request["env"].get("DISTLAB_TEST_TIMELINE") or TIMELINE
    if not folder:
        return
    times = os.times()
    note = {"kind": kind, "argv": [str(a)[:200] for a in argv][:12], "cwd": request.get("cwd"),
            "cpu": round(times.user + times.system + times.children_user + times.children_system, 2),
            "wall": round(time.monotonic() - started, 2), "test": request["env"].get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
    with contextlib.suppress(OSError), open(os.path.join(folder, "programs.jsonl"), "a") as log:
        log.write(json.dumps(note) + "\n")   # O_APPEND, one write: whole lines from every process


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    size = int.from_bytes(message[:8], "big")
    body = message[8:]
    while len(body) < size:
        body += connection.recv(size - len(body))
    return json.loads(body), fds


def _be_the_forkrun(request: dict, output_fd: int, connection: socket.socket) -> None:
    """In the forked child: become ``python -m labkit.forkrun`` of the request, report the exit code, leave."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # forkrun waits for its ranks
        os.setsid()
        connection.sendall(f"{os.getpid()}\n".encode())
        os.dup2(output_fd, 1)
        os.dup2(output_fd, 2)
        os.close(output_fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(request["cwd"])
        from labkit import forkexec

        forkexec.take_environment(request["env"])
        sys.argv = ["labkit.forkrun", *request["argv"]]
        from labkit import forkrun

        started = time.monotonic()
        code = forkrun.main()
        note_cpu("forkrun", request["argv"], started, request)
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    except BaseException:  # noqa: BLE001 - whatever happened, the caller gets an exit code
        traceback.print_exc()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        connection.sendall(f"{code}\n".encode())
    finally:
        os._exit(code)


def serve(path: str) -> None:
    from labkit import forkrun

    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    server.listen(16)
    os.rename(path + ".tmp", path)   # the path appears only once the server listens
    # Listening before the imports: whoever started the server goes on at once (make test's pytest workers collect
    # their tests meanwhile, 4 s sooner); a request that comes first waits in the backlog, and none is forked from
    # here until torch is imported.
    forkrun.preload()
    server.settimeout(1.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)   # children are reaped by the kernel; their caller gets the code
    while os.getppid() == parent:                   # the process that started it is gone: leave too
        try:
            connection, _ = server.accept()
        except (TimeoutError, socket.timeout):
            continue
        connection.settimeout(None)
        request, fds = _receive(connection)
        if os.fork() == 0:
            server.close()
            if request.get("kind") == "exec":   # a program a scheduler started (labkit.forkexec's client)
                from labkit import forkexec

                forkexec.be_the_program(request, fds, connection)
            _be_the_forkrun(request, fds[0], connection)
        for fd in fds:
            os.close(fd)
        connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
