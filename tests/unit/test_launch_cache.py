"""labkit.launch's replay cache: keyed on everything a run depends on, so an edit never replays a stale run."""

import textwrap

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
