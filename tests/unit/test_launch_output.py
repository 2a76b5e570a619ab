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


def test_the_fork_launcher_ends_with_torchs_failure_summary_when_a_rank_recorded_its_error(tmp_path):
    """Each rank has its own TORCHELASTIC_ERROR_FILE, as under torchrun: a script whose main carries torch's @record
    writes its uncaught exception there, and the launcher ends with torch's ChildFailedError message, the rank that
    failed first as the root cause, its traceback in it, a rank that failed later under "Failures". A script without
    @record writes no file, and the launcher prints no summary (torchrun's would say only "To enable traceback
    see ...")."""
    from labkit import broken_runs, launch

    script = tmp_path / "raises.py"
    script.write_text(
        "import os, time\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n\n\n"
        "@record\n"
        "def main():\n"
        "    rank = int(os.environ['RANK'])\n"
        "    assert os.environ['TORCHELASTIC_ERROR_FILE'].endswith(f'/{rank}/error.json')\n"
        "    if rank == 1:\n"
        "        raise ValueError('rank 1 read a bad record')\n"
        "    time.sleep(1.5)\n"
        "    raise RuntimeError('rank 0 lost its peer')\n\n\n"
        "main()\n")
    result = launch.run(str(script), nproc=2, launcher="fork", metrics=False, stream=False, check=False,
                        cwd=str(tmp_path), replay=False)
    assert result.returncode == 1 and result.rank_exit_codes == {0: 1, 1: 1}, result.output
    assert "[forkrun] rank 1 was the first to exit with an error" in result.output
    assert "[forkrun] torchrun would end with: ChildFailedError:" in result.output and "raises.py FAILED" in result.output
    root, other = broken_runs.failure_summary(result.output)
    assert (root["rank"], root["root"], root["error"]) == (1, True, "ValueError: rank 1 read a bad record")
    assert (other["rank"], other["root"], other["error"]) == (0, False, "RuntimeError: rank 0 lost its peer")
    assert result.output.index("Failures:") < result.output.index("Root Cause (first observed failure):")
    unrecorded = tmp_path / "plain.py"
    unrecorded.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('no record')\n")
    result = launch.run(str(unrecorded), nproc=2, launcher="fork", metrics=False, stream=False, check=False,
                        cwd=str(tmp_path), replay=False)
    assert result.returncode == 1 and "ValueError: no record" in result.output
    assert "ChildFailedError" not in result.output and broken_runs.failure_summary(result.output) is None
