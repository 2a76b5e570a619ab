"""labkit.launch reads a run's output: the cause of a failure, each rank's exit code."""

from labkit.launch import _rank_exit_codes, first_error


def test_first_error_finds_the_cause_before_the_peers_connection_resets():
    output = ("step 0\nTraceback (most recent call last):\n  File 'x.py'\nRuntimeError: probe failure on rank 2\n"
              "Traceback (most recent call last):\nRuntimeError: [gloo] Connection reset by peer\n")
    assert first_error(output) == "RuntimeError: probe failure on rank 2"
    assert first_error("config error (rank 0): --tp 3 does not divide 4\n").startswith("config error")
    assert first_error("all fine\n") is None


def test_rank_exit_codes_are_read_from_the_fork_launcher():
    output = "[forkrun] rank 1 was the first to exit with an error\n[forkrun] rank 0 exited with code 2\n[forkrun] rank 1 exited with code 2\n"
    assert _rank_exit_codes(output) == {0: 2, 1: 2}


def test_the_profilers_trace_points_are_not_shown_to_the_learner(capsys, tmp_path):
    import sys

    from labkit import launch

    script = tmp_path / "noisy.py"
    script.write_text("print('USDT:2026-11-25 02:42:11 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start')\n"
                      "print('step 0: loss 1.0')\n")
    result = launch.run(str(script), nproc=1, launcher="fork", metrics=False, stream=True, check=True,
                        cwd=str(tmp_path))
    shown = capsys.readouterr().out
    assert "step 0: loss 1.0" in shown and "USDT" not in shown
    assert "USDT:" in result.output  # kept for the logs


def test_the_ranks_import_the_library_that_launched_them(tmp_path):
    """A GPU node's own PyTorch, where the course was never pip-installed: ``python -S`` skips site-packages
    (and with it the editable install), so only PYTHONPATH can find distlab, and the ranks' environment puts it
    there. Without it every rank died with ``No module named 'distlab'`` (seen on an H200)."""
    import subprocess
    import sys

    import distlab
    from labkit.launch import child_environment

    env = child_environment({"DISTLAB_PG_TIMEOUT": "7"}, base={"PYTHONPATH": "/elsewhere", "PATH": "/usr/bin"})
    root = str(__import__("pathlib").Path(distlab.__file__).resolve().parent.parent)
    assert env["PYTHONPATH"].split(":") == [root, "/elsewhere"] and env["DISTLAB_PG_TIMEOUT"] == "7"
    done = subprocess.run([sys.executable, "-S", "-c", "import distlab; print(distlab.__file__)"],
                          env=child_environment(base={}), cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
