"""coursetools.test_timeline: the idle cores of each half second are charged to the tests running then."""

import json

from coursetools import test_timeline


def test_idle_cores_are_shared_among_the_tests_running(tmp_path, monkeypatch):
    monkeypatch.setattr(test_timeline.os, "cpu_count", lambda: 2)
    tests = [{"test": "tests/a.py::waits", "worker": "gw0", "start": 0.0, "end": 2.0},
             {"test": "tests/b.py::computes", "worker": "gw1", "start": 1.0, "end": 2.0}]
    (tmp_path / "tests-gw0-1.jsonl").write_text("\n".join(json.dumps(t) for t in tests))
    # 0-1 s: one test, half a core busy; 1-2 s: two tests, both cores busy
    samples = [{"t": 0.5, "busy_cores": 0.5}, {"t": 1.0, "busy_cores": 0.5},
               {"t": 1.5, "busy_cores": 2.0}, {"t": 2.0, "busy_cores": 2.0}]
    (tmp_path / "cpu.jsonl").write_text("\n".join(json.dumps(s) for s in samples))
    rows = {r["file"]: r for r in test_timeline.account(tmp_path)}
    assert rows["tests/a.py"]["idle"] == 1.5 and rows["tests/b.py"]["idle"] == 0
    assert rows["tests/a.py"]["busy"] == 0.5 + 1.0 and rows["tests/b.py"]["busy"] == 1.0
    assert rows["tests/a.py"]["wall"] == 2.0 and rows["tests/b.py"]["wall"] == 1.0


def test_the_launch_account_tells_replays_from_runs_started_twice(tmp_path, monkeypatch):
    """labkit.launch notes every launch; two callers asking for one run before either stored it both run it."""
    import textwrap
    import threading

    from coursetools import test_timeline
    from labkit import launch

    monkeypatch.setenv("DISTLAB_TEST_TIMELINE", str(tmp_path))
    monkeypatch.setenv("DISTLAB_LAUNCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(launch, "run_dependencies", lambda script: [script])
    script = tmp_path / "slow.py"
    script.write_text(textwrap.dedent("""
        import time
        time.sleep(1.0)
    """))
    run = lambda: launch.run(script, nproc=1, stream=False, metrics=False, launcher="fork")  # noqa: E731
    together = [threading.Thread(target=run) for _ in range(2)]
    for thread in together:
        thread.start()
    for thread in together:
        thread.join()
    run()                                    # stored by then: replayed
    seen = test_timeline.launches(tmp_path)
    assert (seen["ran"], seen["replayed"], seen["again"]) == (2, 1, 1), seen
    assert seen["again_seconds"] >= 1.0 and seen["by_script"][0][0] == f"{tmp_path.name}/slow.py"


def test_cpu_is_charged_to_the_test_that_started_a_program_or_else_to_its_script(tmp_path):
    tests = [{"test": "tests/a.py::one", "worker": "gw0", "start": 0.0, "end": 2.0, "cpu": 1.5},
             {"test": "tests/a.py::two", "worker": "gw0", "start": 2.0, "end": 3.0, "cpu": 0.5}]
    (tmp_path / "tests-gw0-1.jsonl").write_text("\n".join(json.dumps(t) for t in tests))
    programs = [{"kind": "forkrun", "argv": ["--nproc", "4", "/r/scripts/05_x/train.py", "--steps", "2"],
                 "cwd": "/r", "cpu": 10.0, "wall": 3.0, "test": "tests/a.py::one"},
                {"kind": "forkrun", "argv": ["--nproc", "4", "/r/scripts/05_x/train.py"], "cwd": "/r/notebooks",
                 "cpu": 4.0, "wall": 2.0, "test": ""}]
    (tmp_path / "programs.jsonl").write_text("\n".join(json.dumps(p) for p in programs))
    cpu = test_timeline.cpu_account(tmp_path)
    assert dict(cpu["by_file"]) == {"tests/a.py": 12.0, "(no test) notebooks/": 4.0}
    assert cpu["by_script"] == [("05_x/train.py", 14.0)] and (cpu["tests"], cpu["programs"]) == (2.0, 14.0)
