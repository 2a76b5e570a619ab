import nbformat
import pytest

from coursetools import student

FUNCTION_CELL = '''def ring(x):
    """docstring"""
    ### BEGIN SOLUTION
    total = x * 2
    return total
    ### END SOLUTION
'''

TOP_LEVEL_CELL = '''n = 4
### BEGIN SOLUTION
predicted_bytes = 16 * n
a, b = 1, 2
### END SOLUTION
print("done")'''


def test_function_body_becomes_not_implemented():
    out = student.strip_solutions(FUNCTION_CELL)
    assert "total = x * 2" not in out
    assert '    raise NotImplementedError("exercise not written yet")' in out
    assert out.startswith('def ring(x):\n    """docstring"""')
    compile(out, "cell", "exec")


def test_top_level_assignments_become_none():
    out = student.strip_solutions(TOP_LEVEL_CELL)
    assert "predicted_bytes = None" in out and "a = None" in out and "b = None" in out
    assert "16 * n" not in out
    namespace = {}
    exec(out, namespace)
    assert namespace["predicted_bytes"] is None


def test_unbalanced_markers_are_errors():
    with pytest.raises(student.SolutionMarkerError):
        student.strip_solutions("### BEGIN SOLUTION\nx = 1\n")
    with pytest.raises(student.SolutionMarkerError):
        student.strip_solutions("x = 1\n### END SOLUTION\n")


def test_solution_lines_are_found():
    assert student.solution_lines(TOP_LEVEL_CELL) == ["predicted_bytes = 16 * n", "a, b = 1, 2"]


def test_a_lab_named_in_the_text_becomes_the_learners_copy_of_it():
    """Chapter 14's three notebooks name each other: a learner's copy names the learner's copies (make lab serves
    notebooks/, where the full ones hold the answers); code, and paths already under student/, are left alone."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("Next: `notebooks/14_more_failures.ipynb`, or `notebooks/student/01_a.ipynb`."),
        nbformat.v4.new_code_cell("path = 'notebooks/05_fully_sharded.ipynb'")])
    copy = student.student_notebook(nb, "14_x.ipynb")
    assert copy.cells[1].source == ("Next: `notebooks/student/14_more_failures.ipynb`, or "
                                    "`notebooks/student/01_a.ipynb`.")
    assert copy.cells[2].source == "path = 'notebooks/05_fully_sharded.ipynb'"
    assert "`notebooks/14_x.ipynb`" in copy.cells[0].source   # the header names the full one, on purpose
