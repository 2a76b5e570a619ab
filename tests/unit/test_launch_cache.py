"""labkit.launch's replay cache: keyed on everything a run depends on, so an edit never replays a stale run."""

import os
import shutil
import textwrap
from pathlib import Path

from labkit import launch

SCRIPT = textwrap.dedent("""
    import os
    from helper_of_this_chapter import GREETING
    if os.environ["RANK"] == "0":
        print(GREETING, flush=True)
""")


def _chapter(tmp_path, greeting):
    folder = tmp_path / "scripts" / "99_cache"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hello.py").write_text(SCRIPT)
    (folder / "helper_of_this_chapter.py").write_text(f"GREETING = {greeting!r}\n")
    return folder / "hello.py"


def test_the_key_covers_the_script_its_chapter_helpers_distlab_and_the_launcher():
    files = {f"{p.parent.name}/{p.name}" for p in launch.run_dependencies(
        launch.REPO_ROOT / "scripts/07_pipeline_parallel/pp_manual.py")}
    assert {"07_pipeline_parallel/pp_manual.py", "07_pipeline_parallel/common_pipeline.py",
            "distlab/schedules.py", "distlab/models.py", "labkit/launch.py", "labkit/forkrun.py", "distlab/runtime.py",
            "planner/spec.py"} <= files


def test_an_edit_to_any_dependency_or_the_environment_changes_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_LAUNCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "run_dependencies", lambda script: sorted(script.parent.glob("*.py")))
    script = _chapter(tmp_path, "hello")

    def key(env=None):
        return launch._cache_file(script, tmp_path, 2, "fork", [], None, env)

    first = key()
    assert key() == first                                   # same inputs, same key
    (script.parent / "helper_of_this_chapter.py").write_text("GREETING = 'edited'\n")
    assert key() != first                                   # the chapter's helper changed
    assert key({"DISTLAB_X": "1"}) != key()                 # another environment is another run
    assert launch._cache_file(script, tmp_path, 4, "fork", [], None) != key()
    # another script of the same chapter folder has the same dependencies, but is another run
    sibling = script.parent / "goodbye.py"
    sibling.write_text(SCRIPT)
    assert launch._cache_file(sibling, tmp_path, 2, "fork", [], None) != key()


def test_a_run_is_replayed_until_a_helper_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_LAUNCH_CACHE", str(tmp_path / "cache"))
    # Only the chapter's own files: distlab may be edited by someone else while this test runs.
    monkeypatch.setattr(launch, "run_dependencies", lambda script: sorted(script.parent.glob("*.py")))
    script = _chapter(tmp_path, "first version")
    run = lambda: launch.run(script, nproc=2, stream=False, metrics=False, launcher="fork")  # noqa: E731
    assert "first version" in run().output
    _chapter(tmp_path, "second version")            # a learner edits the helper, not the script
    assert "second version" in run().output, "a stale run was replayed"
    assert "second version" in run().output
    assert len(list((tmp_path / "cache").iterdir())) == 2


WRITER = textwrap.dedent("""
    import argparse, os, pathlib
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--note", default="")
    options = parser.parse_args()
    folder = pathlib.Path(options.save_dir)
    if os.environ["RANK"] == "0":
        if options.resume:
            print("resumed from", (folder / "state.txt").read_text(), flush=True)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "state.txt").write_text("step 3" + options.note)
""")


def test_a_replay_leaves_the_files_the_run_left_and_the_key_holds_the_files_it_reads(tmp_path, monkeypatch):
    """A resumed run is a function of the checkpoint it reads: the first run's replay must write that checkpoint
    (the cache of before this test replayed the output only, and the resume that followed found nothing), and a
    resume from another checkpoint is another run."""
    monkeypatch.setenv("DISTLAB_LAUNCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "run_dependencies", lambda script: [script])
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    saved = tmp_path / "run" / "checkpoint"
    run = lambda *args: launch.run(script, nproc=1, args=["--save-dir", saved, *args], stream=False,  # noqa: E731
                                   metrics=False, launcher="fork")
    run()
    assert (saved / "state.txt").read_text() == "step 3"
    shutil.rmtree(saved)                           # what run_case does before an interrupted job
    run()                                          # replayed: it must leave its checkpoint as the real run did
    assert (saved / "state.txt").read_text() == "step 3"
    assert "resumed from step 3" in run("--resume").output
    (saved / "state.txt").write_text("step 5")     # another checkpoint in the same folder: another run
    assert "resumed from step 5" in run("--resume").output
    assert (saved / "state.txt").read_text() == "step 5"   # a run that only read its folder leaves it alone
    assert launch.file_arguments(["--save-dir", "a/b", "--steps", "3", "--out=/x/y", "--metrics-out", "m/n.json"],
                                 tmp_path, tmp_path / "m/n.json") == [tmp_path / "a/b", Path("/x/y")]


def test_the_ranks_environment_is_part_of_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTLAB_LAUNCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "run_dependencies", lambda script: sorted(script.parent.glob("*.py")))
    script = _chapter(tmp_path, "hello")
    first = launch._cache_file(script, tmp_path, 2, "fork", [], None)
    monkeypatch.setenv("DISTLAB_PG_TIMEOUT", "7")            # a test's own timeout changes what the run does
    assert launch._cache_file(script, tmp_path, 2, "fork", [], None) != first
    monkeypatch.delenv("DISTLAB_PG_TIMEOUT")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")   # which caller launches it does not
    monkeypatch.setenv("DISTLAB_FORK_SERVER", "0")
    monkeypatch.setenv("DISTLAB_FORK_SERVER_SOCKET", "/tmp/another-phase/socket")   # each phase starts its own
    monkeypatch.setenv(launch.RANK_PYTHON_ENV, "/tmp/another-phase/python")          # and its own wrapper
    monkeypatch.setenv("DISTLAB_TEST_TIMELINE", "/tmp/another-timeline")
    assert launch._cache_file(script, tmp_path, 2, "fork", [], None) == first
    # torch names inductor's cache folder in the environment of a process that asked for it (a worker that compiled)
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()
    assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
    assert launch._cache_file(script, tmp_path, 2, "fork", [], None) == first


def test_a_second_try_runs_again_and_takes_the_failed_runs_place(tmp_path, monkeypatch):
    """A test retries a run whose check reads a clock: its retry must run (a replay repeats the failure), and what
    replays it afterwards (the lab) must get the retry."""
    monkeypatch.setenv("DISTLAB_LAUNCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "run_dependencies", lambda script: [script])
    script = tmp_path / "clock.py"
    script.write_text("import time\nprint('started at', time.time_ns(), flush=True)\n")
    run = lambda **kw: launch.run(script, nproc=1, stream=False, metrics=False, launcher="fork", **kw)  # noqa: E731
    first = run()
    assert run().output == first.output                    # replayed
    second = run(replay=False)
    assert second.output != first.output                   # really run again
    assert run().output == second.output                   # and replayed from then on
