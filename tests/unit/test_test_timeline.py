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
