"""coursetools.lab_check's verdict on a lab's cells (pure; the browser run itself is `make lab-check`, in .ci/run)."""

from coursetools import lab_check


def cell(source="x = 1", count=1, *outputs):
    return {"source": source, "count": count, "outputs": list(outputs)}


def stderr(text):
    return {"type": "stream", "name": "stderr", "ename": None, "evalue": None, "text": text}


def test_a_clean_run_has_no_problem():
    assert lab_check.problems_of("05_fully_sharded", [cell(), cell("print(2)", 2)], [], student=False) == []


def test_an_error_a_warning_and_an_unrun_cell_are_each_named():
    error = {"type": "error", "name": None, "ename": "AssertionError", "evalue": "wrong answer", "text": ""}
    cells = [cell("check(a)", 1, error),
             cell("run()", 2, stderr("x.py:3: FutureWarning: all_reduce is deprecated\n  warnings.warn(")),
             cell("later()", None)]
    found = lab_check.problems_of("05_fully_sharded", cells, [], student=False)
    assert any("AssertionError: wrong answer" in f for f in found)
    assert any("FutureWarning: all_reduce is deprecated" in f for f in found)
    assert any(f.startswith("not run: later()") for f in found)


def test_expected_errors_on_stderr_are_not_warnings():
    """Chapter 12's planted hangs print gloo's timeouts on purpose: stderr without a warning passes."""
    cells = [cell("hang()", 1, stderr("[rank1]: RuntimeError: ... Timed out waiting 5000ms\n"))]
    assert lab_check.problems_of("12_hpc_operations", cells, [], student=False) == []


def test_a_widget_that_opens_on_other_values_fails():
    assert lab_check.problems_of("11_choosing_a_strategy", [cell()], ["70b", "h100-80gb", "preset"], False) == []
    found = lab_check.problems_of("11_choosing_a_strategy", [cell()], ["1b", "a100-40gb"], student=False)
    assert found == ["widget opened on ['1b', 'a100-40gb'], its cell passed ['70b', 'h100-80gb']"]


def test_a_run_beside_another_open_notebook_or_unfinished_fails():
    """JupyterLab's Run All acts on the notebook it calls current: another one open makes the verdict a race's."""
    assert lab_check.run_problems({"state": "done", "kernel": "idle", "others": []}, 300) == []
    beside = lab_check.run_problems({"state": "done", "kernel": "idle", "others": ["01_single_device_baseline.ipynb"]},
                                    300)
    assert beside == ["other notebooks open beside it: 01_single_device_baseline.ipynb"]
    unfinished = lab_check.run_problems({"state": "running", "kernel": "busy"}, 300)
    assert unfinished == ["Run All did not finish (running, kernel busy) within 300 s"]
