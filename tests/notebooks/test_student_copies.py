"""The learner's copies: up to date, free of solutions, and failing exactly at their check cells.

The full notebooks themselves run under nbval (``make test`` passes ``--nbval-lax notebooks/NN_*.ipynb``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest
from helpers import wait_for_full_notebook
from nbclient import NotebookClient

from coursetools import student

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = student.full_notebooks(REPO / "notebooks")
CELL_TIMEOUT_S = 180
LAUNCH_SHOWN = "$ torchrun "   # what labkit.launch prints as it starts a run (a replay says so instead)


def _ids(paths):
    return [p.stem for p in paths]


def _defined_names(source: str) -> list[str]:
    """The names an exercise cell defines at its top level: its functions and the variables it assigns."""
    tree = ast.parse(source)
    names = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks/NN_name.ipynb found"


def test_student_copies_are_up_to_date():
    assert student.main([str(REPO / "notebooks"), "--check"]) == 0, "run `make student` and commit the result"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_every_exercise_has_a_check(path):
    nb = nbformat.read(path, as_version=4)
    exercises = [c for c in nb.cells if c.cell_type == "code" and student.has_solution(c.source)]
    checks = [c for c in nb.cells if "check" in c.metadata.get("tags", [])]
    assert exercises, f"{path.name} has no exercise (### BEGIN SOLUTION)"
    # a check cell may grade several exercises (chapter 14 judges runs 7, 8 and 9's functions in one launch): each
    # exercise's answer, the names its cell defines, must reach a check cell
    checked = "\n".join(c.source for c in checks)
    unchecked = [names for names in map(_defined_names, (c.source for c in exercises))
                 if not any(re.search(rf"\b{re.escape(name)}\b", checked) for name in names)]
    assert not unchecked, f"{path.name}: exercises no check cell grades: {unchecked}"
    for cell in checks:
        assert "exercises.check" in cell.source, f"a check cell of {path.name} calls no labkit.exercises check"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs, f"{path.name} is stored with outputs: clear them"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_student_copy_contains_no_solution(path):
    full = nbformat.read(path, as_version=4)
    copy = nbformat.read(REPO / "notebooks" / "student" / path.name, as_version=4)
    copy_text = "\n".join(c.source for c in copy.cells)
    leaked = [line for c in full.cells for line in student.solution_lines(c.source) if line in copy_text]
    assert not leaked, f"solution lines leaked into the learner's copy: {leaked[:3]}"
    assert student.BEGIN not in copy_text


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_student_copy_runs_to_the_end_and_says_what_is_not_written(path, request):
    # Run All in the learner's copy, every exercise still a stub: each check cell says its exercise is not written
    # yet, and the notebook runs on to its last cell (a learner who answers exercise 2 first sees its check)
    copy_path = REPO / "notebooks" / "student" / path.name
    wait_for_full_notebook(request, path)   # make test runs the full notebook beside: its runs, replayed here
    nb = nbformat.read(copy_path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, startup_timeout=180, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(copy_path.parent)}})
    client.execute()
    failures = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        text = "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        if errors:
            failures.append(f"cell {index} failed: {errors[0].ename}: {errors[0].evalue}")
        elif "check" in cell.metadata.get("tags", []):
            if "Correct:" in text:
                failures.append(f"cell {index}: a check cell passed in the learner's copy (a check that cannot fail)")
            elif "Not written yet: " not in text or "not written yet" not in text.split("Not written yet: ", 1)[1]:
                failures.append(f"cell {index}: no 'not written yet' message: {text[:200]!r}")
    if request.config.getoption("expect_replays"):
        # make test: the full notebook ran first on the same cache. A run its cell starts again, not replayed,
        # means the cache's key took in something that differs between two processes: it once re-ran them all
        full_cells = {c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"}
        failures += [f"cell {index} started its run again instead of replaying the full notebook's: {line}"
                     for index, cell in enumerate(nb.cells) if cell.cell_type == "code" and cell.source in full_cells
                     for output in cell.outputs if output.output_type == "stream"
                     for line in output.get("text", "").splitlines() if line.startswith(LAUNCH_SHOWN)]
    assert not failures, "\n".join(failures)


def test_in_a_notebook_an_unwritten_exercise_runs_on_and_a_wrong_one_stops():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("from labkit.exercises import checks as exercises\nexercises.check_value('x', None, 3)"),
        nbformat.v4.new_code_cell("exercises.check_value('y', 4, 3)"),
        nbformat.v4.new_code_cell("print('after the wrong answer')"),
    ])
    with pytest.raises(Exception) as stopped:  # Run All stops at the wrong answer, as the full notebooks do
        NotebookClient(nb, timeout=60, startup_timeout=180, kernel_name="python3",
                       resources={"metadata": {"path": str(REPO)}}).execute()
    assert "ExerciseWrong" in str(stopped.value)
    shown = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert shown.startswith("Not written yet: `x` is not written yet.")
    assert not nb.cells[2].outputs  # never reached
