"""The fork server make test uses: the same runs as a forkrun of its own, without importing torch every launch."""

import json
import os
import time

import pytest

from labkit import forkserver, launch

BAD_MESH = ("scripts/09_hybrid_parallel/hybrid_3d.py", ["--pp", "2", "--dp", "2", "--tp", "2"])


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(forkserver.ENABLE_ENV, "1")
    monkeypatch.delenv("DISTLAB_LAUNCH_CACHE", raising=False)   # every launch here must really run


def test_a_forked_launch_is_what_its_own_forkrun_gives_and_faster(server, monkeypatch):
    served = [launch.run(BAD_MESH[0], nproc=4, args=BAD_MESH[1], stream=False, check=False, metrics=False)
              for _ in range(2)]
    monkeypatch.setenv(forkserver.ENABLE_ENV, "0")
    alone = launch.run(BAD_MESH[0], nproc=4, args=BAD_MESH[1], stream=False, check=False, metrics=False)
    for result in served:
        assert result.returncode == alone.returncode == 2
        assert result.rank_exit_codes == alone.rank_exit_codes == {0: 2, 1: 2, 2: 2, 3: 2}
        steady = [sorted(ln for ln in r.lines if "was the first" not in ln) for r in (result, alone)]  # a race
        assert steady[0] == steady[1]
    # the second served launch did not import torch: a fraction of the launch that did
    assert served[1].seconds < alone.seconds / 2, (served[1].seconds, alone.seconds)


def test_a_served_run_trains_reports_metrics_and_sees_its_environment(server, tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import os, sys\n"   # one write a line: two ranks' prints may interleave on a shared pipe
                      "os.write(1, f\"rank {os.environ['RANK']} {os.environ['MY_FLAG']} {os.getcwd()}\\n\".encode())\n"
                      "sys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    result = launch.run(str(script), nproc=2, stream=False, check=False, metrics=False, cwd=tmp_path,
                        env={"MY_FLAG": "seen"})
    assert result.returncode == 3 and result.rank_exit_codes == {0: 0, 1: 3}
    assert sorted(ln for ln in result.lines if ln.startswith("rank")) == [f"rank 0 seen {tmp_path}",
                                                                          f"rank 1 seen {tmp_path}"]
    ddp = launch.run("scripts/04_data_parallel/ddp_from_scratch.py", nproc=4, args=["--steps", "2"], stream=False)
    assert ddp.returncode == 0 and all(c["passed"] for c in ddp.metrics["checks"])


def test_a_served_rank_finds_the_checkpoint_and_pipeline_modules_imported(server, tmp_path):
    """The server imports what the checkpointing and pipeline scripts import (labkit.forkrun.preload), so a rank
    does not import them again every launch (chapter 14's lab: 0.4-0.6 s a rank for DCP)."""
    script = tmp_path / "imported.py"
    script.write_text("import os, sys\n"
                      "wanted = ('torch.distributed.checkpoint', 'torch.distributed.checkpoint.state_dict',\n"
                      "          'torch.distributed.pipelining', 'torch.distributed.algorithms.ddp_comm_hooks')\n"
                      "os.write(1, f\"missing {[m for m in wanted if m not in sys.modules]}\\n\".encode())\n")
    result = launch.run(str(script), nproc=2, stream=False, metrics=False, cwd=tmp_path)
    assert [line for line in result.lines if line.startswith("missing")] == ["missing []"] * 2, result.tail()


def test_a_served_run_past_its_timeout_is_killed_with_its_ranks(server, tmp_path):
    script = tmp_path / "sleeps.py"
    script.write_text("import os, time\nos.write(1, b'started\\n')\ntime.sleep(60)\n")  # one write: no interleaving
    started = time.perf_counter()
    with pytest.raises(launch.LaunchError, match="did not finish within 2 s") as error:
        launch.run(str(script), nproc=2, stream=False, metrics=False, timeout=2, cwd=tmp_path)
    assert error.value.result.returncode == -9 and time.perf_counter() - started < 10
    assert error.value.result.lines.count("started") == 2


def test_without_a_server_a_launch_starts_its_own_forkrun(server, monkeypatch, capsys):
    def no_server():
        raise OSError("AF_UNIX path too long")

    monkeypatch.setattr(forkserver, "start_server", no_server)
    monkeypatch.delenv(forkserver.SOCKET_ENV, raising=False)
    result = launch.run(BAD_MESH[0], nproc=4, args=BAD_MESH[1], stream=False, check=False, metrics=False)
    assert result.returncode == 2 and result.rank_exit_codes == {0: 2, 1: 2, 2: 2, 3: 2}
    assert "fork server unavailable (AF_UNIX path too long)" in capsys.readouterr().err


CHILD = """
from labkit import forkserver, launch
result = launch.run({script!r}, nproc=4, args={args!r}, stream=False, check=False, metrics=False)
print(result.returncode, "own server" if forkserver._started else "parent's server")
"""


def test_a_child_process_forks_from_its_parents_server_or_else_its_own(server, tmp_path):
    """A notebook kernel or a subprocess of a test worker launches from the worker's server (no torch imported
    again); where that server is gone, from one of its own."""
    import os
    import subprocess
    import sys

    code = CHILD.format(script=BAD_MESH[0], args=BAD_MESH[1])
    shared = forkserver.start_server()
    for socket_path, expected in ((shared, "2 parent's server"), (str(tmp_path / "gone"), "2 own server")):
        child = subprocess.run([sys.executable, "-c", code], cwd=launch.REPO_ROOT, capture_output=True, text=True,
                               env=dict(os.environ, **{forkserver.SOCKET_ENV: socket_path}), timeout=120)
        assert child.stdout.strip().splitlines()[-1] == expected, child.stdout + child.stderr
    assert os.environ[forkserver.SOCKET_ENV] == shared      # what this process's children will use


def test_on_by_default_off_when_told(monkeypatch):
    monkeypatch.delenv(forkserver.ENABLE_ENV, raising=False)
    assert forkserver.enabled()                     # a lab's launches: torch imported once, not once a launch
    monkeypatch.setenv(forkserver.ENABLE_ENV, "0")
    assert not forkserver.enabled()


@pytest.mark.skipif(not os.environ.get(forkserver.SOCKET_ENV), reason="make test's fork server is not running")
def test_make_tests_notebook_kernels_fork_from_its_server():
    """make test runs the notebooks on the ``python3`` kernel tests/conftest.py puts first on JUPYTER_PATH: forked
    from the server, it starts with torch already imported (a kernel of its own has not imported it)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys\nprint('torch' in sys.modules)")])
    NotebookClient(nb, timeout=60, startup_timeout=180, kernel_name="python3").execute()
    assert nb.cells[0].outputs[0]["text"].strip() == "True"


def test_a_served_run_notes_the_cpu_its_ranks_used_for_the_test_timeline(server, tmp_path, monkeypatch):
    # make test's timeline (coursetools.test_timeline) charges each run's CPU to its test: the ranks' seconds, which
    # the forkrun waited for, not the forkrun's own few milliseconds
    monkeypatch.setenv("DISTLAB_TEST_TIMELINE", str(tmp_path))
    script = tmp_path / "burns.py"
    script.write_text("import time\nend = time.process_time() + 0.4\nwhile time.process_time() < end:\n    pass\n")
    launch.run(str(script), nproc=2, stream=False, metrics=False, cwd=tmp_path)
    notes = [json.loads(line) for line in (tmp_path / "programs.jsonl").read_text().splitlines()]
    (note,) = [n for n in notes if n["kind"] == "forkrun"]
    assert note["cpu"] >= 0.8 and note["argv"][-1].endswith("burns.py"), note
    assert note["test"] == os.environ["PYTEST_CURRENT_TEST"].split(" ")[0]
