"""labkit.forkrun's folder of error files (``forkrun-errors-*``, one a launch) does not pile up in the temporary
folder: removed when the launcher ends, a Ctrl-C included; left by a launcher killed with SIGKILL (a timeout's kill)
and then removed by the next launcher, never while its launcher or a rank still lives. Each launch here runs in a
temporary folder of its own (TMPDIR), which a launch forked from the fork server reads as a new interpreter would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from labkit import forkexec, forkserver, launch
from labkit.forkrun import ERRORS_PREFIX

FORKEXEC = str(Path(forkexec.__file__).resolve())


@pytest.fixture
def tmpdir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(forkserver.ENABLE_ENV, "1")
    monkeypatch.delenv("DISTLAB_LAUNCH_CACHE", raising=False)   # every launch here must really run
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    return scratch


def errors_folders(scratch: Path) -> list[Path]:
    return sorted(scratch.glob(ERRORS_PREFIX + "*"))


def wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "waited too long"
        time.sleep(0.05)


def test_a_killed_launchers_folder_is_removed_by_the_next_but_not_while_it_lives(tmpdir_env, tmp_path):
    scratch = tmpdir_env
    sleeps, quick = tmp_path / "sleeps.py", tmp_path / "quick.py"
    sleeps.write_text("import time\ntime.sleep(60)\n")
    quick.write_text("print('done')\n")

    def run(script, **kw):
        return launch.run(str(script), nproc=2, stream=False, metrics=False, cwd=tmp_path,
                          env={"TMPDIR": str(scratch)}, **kw)

    killed: list[BaseException] = []

    def sleeper():
        try:
            run(sleeps, timeout=6)
        except launch.LaunchError as error:   # past its timeout: the launcher and its ranks get a SIGKILL
            killed.append(error)

    thread = threading.Thread(target=sleeper)
    thread.start()
    wait_for(lambda: len(errors_folders(scratch)) == 1)   # the launch honours TMPDIR
    alive = errors_folders(scratch)[0]
    assert run(quick).returncode == 0
    assert errors_folders(scratch) == [alive]             # a live launcher's folder is kept; the quick one's removed
    thread.join(timeout=60)
    assert killed and killed[0].result.returncode == -9
    assert errors_folders(scratch) == [alive]             # a SIGKILL leaves it ...
    assert run(quick).returncode == 0
    assert errors_folders(scratch) == []                  # ... to the next launcher


def test_a_ctrl_c_removes_the_folder(tmpdir_env, tmp_path):
    """Ctrl-C in a terminal interrupts the launcher and its ranks (one process group): here the wrapper stands in for
    the terminal, passing an INT to the launcher and every process under it."""
    scratch = tmpdir_env
    script = tmp_path / "sleeps.py"
    script.write_text("import os, time\nos.write(1, b'started\\n')\ntime.sleep(60)\n")
    socket_path = os.environ.get(forkserver.SOCKET_ENV) or forkserver.start_server()
    env = dict(os.environ, TMPDIR=str(scratch), **{forkserver.SOCKET_ENV: socket_path,
                                                   forkexec.WHOLE_TREE_ENV: "1"})
    errors_log = (tmp_path / "stderr").open("w")   # runpy's warning: the server had imported labkit.forkrun
    process = subprocess.Popen([sys.executable, FORKEXEC, "-m", "labkit.forkrun", "--nproc", "2", str(script)],
                               env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=errors_log, text=True)
    try:
        started = [process.stdout.readline(), process.stdout.readline()]
        assert started == ["started\n"] * 2 and len(errors_folders(scratch)) == 1
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)
    finally:
        process.kill()
        errors_log.close()
    assert process.returncode != 0, (tmp_path / "stderr").read_text()
    assert errors_folders(scratch) == []
