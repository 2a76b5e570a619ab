"""The learner's copies: up to date, free of solutions, and failing exactly at their check cells.

The full notebooks themselves run under nbval (``make test`` passes ``--nbval-lax notebooks/NN_*.ipynb``).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from distlab import student

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = student.full_notebooks(REPO / "notebooks")
CELL_TIMEOUT_S = 180


def _ids(paths):
    return [p.stem for p in paths]


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
    assert len(checks) >= len(exercises), f"{path.name}: {len(exercises)} exercises but {len(checks)} check cells"
    for cell in checks:
        assert "exercises.check" in cell.source, f"a check cell of {path.name} calls no distlab.exercises check"
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
def test_student_copy_fails_exactly_at_its_check_cells(path):
    copy_path = REPO / "notebooks" / "student" / path.name
    nb = nbformat.read(copy_path, as_version=4)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(copy_path.parent)}})
    client.execute()
    failures = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.outputs if o.output_type == "error"]
        is_check = "check" in cell.metadata.get("tags", [])
        if is_check:
            if not errors:
                failures.append(f"cell {index}: a check cell passed in the learner's copy (a check that cannot fail)")
            elif errors[0].ename != "ExerciseIncomplete":
                failures.append(f"cell {index}: check failed with {errors[0].ename}: {errors[0].evalue}")
            elif "not written yet" not in errors[0].evalue:
                failures.append(f"cell {index}: unhelpful message {errors[0].evalue!r}")
        elif errors:
            failures.append(f"cell {index}: a non-check cell failed: {errors[0].ename}: {errors[0].evalue}")
    assert not failures, "\n".join(failures)
