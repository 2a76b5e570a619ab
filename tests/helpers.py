"""Assertions and settings shared by the tests."""

from __future__ import annotations

import os
import time
from pathlib import Path

from labkit import launch


def assert_all_checks_passed(result: launch.LaunchResult, min_checks: int = 1) -> dict:
    """Every check in the run's metrics passed, and there were some: a run that checks nothing proves nothing."""
    assert result.returncode == 0, result.tail()
    metrics = result.metrics
    assert metrics is not None, "the script wrote no metrics file"
    for key in ("script", "world_size", "device", "config", "losses", "checks", "comm", "memory", "throughput"):
        assert key in metrics, f"metrics lack {key!r}"
    checks = metrics["checks"]
    assert len(checks) >= min_checks, f"expected at least {min_checks} checks, got {len(checks)}"
    failed = [c for c in checks if not c["passed"]]
    assert not failed, f"failed checks: {failed}"
    return metrics


def assert_config_error(script: str, args, expected_text: str, nproc: int = 4, launcher: str = "auto",
                        max_seconds: float = 30) -> launch.LaunchResult:
    """A bad configuration: exit code 2 on every rank, one clear line each, no Python traceback, quickly."""
    result = launch.run(script, nproc=nproc, args=args, stream=False, check=False, launcher=launcher,
                        metrics=False, timeout=max_seconds + 30)
    assert result.returncode in (1, 2) if launcher == "torchrun" else result.returncode == 2, result.tail()
    error_lines = [ln for ln in result.lines if ln.startswith("config error")]
    if launcher == "torchrun":
        # torchrun's agent stops the other ranks as soon as one fails, so not every rank may get to print
        assert 1 <= len(error_lines) <= nproc, f"expected 'config error' lines:\n{result.tail()}"
    else:
        assert len(error_lines) == nproc, f"expected one 'config error' line per rank:\n{result.tail()}"
    assert all(expected_text in ln for ln in error_lines), f"{expected_text!r} not in {error_lines}"
    script_tracebacks = [ln for ln in result.lines if ln.startswith("Traceback")]
    if launcher != "torchrun":  # torchrun's own agent prints a traceback of ChildFailedError; ranks must not
        assert not script_tracebacks, result.tail()
        assert set(result.rank_exit_codes.values()) == {2}, result.rank_exit_codes
    else:
        assert "exitcode  : 2" in result.output, result.tail()
    assert result.seconds < max_seconds, f"took {result.seconds:.1f} s to fail"
    return result


def assert_usage_error(script: str, args, flag: str, nproc: int = 4, max_seconds: float = 30) -> launch.LaunchResult:
    """A flag's value refused by its type (``distlab.runtime.positive_int``, ...): argparse's one error line naming
    the flag on every rank, exit code 2 on every rank, no traceback, before any process group exists."""
    result = launch.run(script, nproc=nproc, args=args, stream=False, check=False, metrics=False,
                        timeout=max_seconds + 30)
    errors = [ln for ln in result.lines if f"error: argument {flag}: " in ln]
    assert len(errors) == nproc and set(result.rank_exit_codes.values()) == {2}, result.tail()
    assert not [ln for ln in result.lines if ln.startswith("Traceback")], result.tail()
    assert result.seconds < max_seconds, f"took {result.seconds:.1f} s to fail"
    return result


def scheduler_python() -> str:
    """The interpreter the Slurm and PBS tiers give their jobs (DISTLAB_PYTHON): a wrapper that runs each rank as a
    child of make test's fork server (``labkit.forkexec``: torch imported once, not once a rank), and hands anything
    else, or everything when no server is exported to the job, to this interpreter unchanged."""
    global _SCHEDULER_PYTHON
    if _SCHEDULER_PYTHON is None:
        import atexit
        import shutil
        import sys
        import tempfile
        from pathlib import Path

        folder = Path(tempfile.mkdtemp(prefix="distlab-python-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        wrapper = folder / "python"
        forkexec = Path(__file__).resolve().parents[1] / "labkit" / "forkexec.py"
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{forkexec}" "$@"\n')
        wrapper.chmod(0o755)
        _SCHEDULER_PYTHON = str(wrapper)
    return _SCHEDULER_PYTHON


_SCHEDULER_PYTHON: str | None = None


def forked_kernels() -> str:
    """A Jupyter data folder (for JUPYTER_PATH, which Jupyter searches before the virtualenv's) whose ``python3``
    kernel is the virtualenv's, started through :func:`scheduler_python`: make test's notebook kernels fork from the
    server that imported torch once, a second a kernel sooner (28 full notebooks and learner's copies, and the
    site's build). The spec is the virtualenv's own, less its ``-X`` option (the debugger's; forkexec hands
    interpreter options to the real interpreter)."""
    import json
    import sys
    from pathlib import Path

    installed = Path(sys.prefix) / "share" / "jupyter" / "kernels" / "python3" / "kernel.json"
    spec = json.loads(installed.read_text())
    spec["argv"] = [scheduler_python(), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    folder = Path(scheduler_python()).parent / "jupyter"
    (folder / "kernels" / "python3").mkdir(parents=True, exist_ok=True)
    (folder / "kernels" / "python3" / "kernel.json").write_text(json.dumps(spec, indent=1))
    return str(folder)


def slurm_task_settings() -> dict[str, str]:
    """What a Slurm job of the tier is given so that every program it starts forks from make test's server: its
    interpreter (DISTLAB_PYTHON) and torchrun's for its workers (PYTHON_EXEC, torch 2.13 distributed/run.py:953) are
    the wrapper, and each wrapper stands in for its task's whole process tree. Slurm signals and kills every process
    of that tree (the test cluster's proctrack/linuxproc walks /proc for them: kill_tree.c, kill_proc_tree), and a
    forked program is outside it: so the wrapper passes a signal on to the program and all its descendants, and
    takes them with it when it is killed (labkit/forkexec.py, WHOLE_TREE_ENV). A torchrun agent's descendants are
    its workers' wrappers, which inherit the setting and do the same for each worker."""
    from labkit import forkexec

    return {"DISTLAB_PYTHON": scheduler_python(), "PYTHON_EXEC": scheduler_python(), forkexec.WHOLE_TREE_ENV: "1"}


def forkexec_settings() -> dict[str, str]:
    """A job's settings that make its ranks fork from make test's server (empty when no server runs): the
    environment the PBS tier hands its jobs is cleaned of DISTLAB_*, the server's socket with it."""
    import os

    from labkit import forkserver

    socket_path = os.environ.get(forkserver.SOCKET_ENV)
    return {"DISTLAB_PYTHON": scheduler_python(), forkserver.SOCKET_ENV: socket_path} if socket_path else {}


def lab_cells(number: str, student: bool = False) -> list[dict]:
    """A chapter's lab as one list of cells, its notebooks in working order (``coursetools.chapters.labs``: chapter
    14's lab is three notebooks): the full lab's, or with ``student`` the learner's copies'."""
    import json

    from coursetools import chapters

    cells = []
    for lab in chapters.labs(number):
        path = lab.parent / "student" / lab.name if student else lab
        cells += json.loads(path.read_text())["cells"]
    return cells


def full_notebook_done(name: str) -> Path:
    """The file that says the full notebook ``name`` has run its last cell in this make test (tests/conftest.py
    writes it), under the replay cache every process of the run shares."""
    return Path(os.environ["DISTLAB_LAUNCH_CACHE"]) / "full-notebooks-run" / name


def wait_for_full_notebook(request, notebook: Path, timeout_s: float = 240) -> None:
    """When the full ``notebook`` runs in this pytest session too (make test: nbval, on any worker), wait until
    its last cell has run, so that its learner's copy replays every run it made. A session without it waits for
    nothing. The notebooks are handed out before the copies (tests/conftest.py), so the wait ends: a lab runs in
    under a minute, and 240 s fails it before pytest-timeout's 300 s would."""
    if not any(item.nodeid.split("::")[0] == f"notebooks/{notebook.name}" for item in request.session.items):
        return
    done = full_notebook_done(notebook.name)
    deadline = time.monotonic() + timeout_s
    while not done.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the full notebook {notebook.name} did not finish within {timeout_s:.0f} s")
        time.sleep(0.5)
