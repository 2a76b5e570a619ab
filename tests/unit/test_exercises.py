import pytest
import torch

from distlab import exercises


def test_value_none_is_incomplete_and_wrong_is_wrong(capsys):
    with pytest.raises(exercises.ExerciseIncomplete, match="not written yet"):
        exercises.check_value("x", None, 3)
    with pytest.raises(exercises.ExerciseWrong, match="expected 3"):
        exercises.check_value("x", 4, 3)
    exercises.check_value("x", 3.0000001, 3)
    assert "Correct" in capsys.readouterr().out


def test_function_stub_is_incomplete():
    def stub(x):
        raise NotImplementedError

    with pytest.raises(exercises.ExerciseIncomplete):
        exercises.check_function("f", stub, [((1,), 2)])
    with pytest.raises(exercises.ExerciseWrong, match="returned 1, expected 2"):
        exercises.check_function("f", lambda x: x, [((1,), 2)])
    exercises.check_function("f", lambda x: 2 * x, [((1,), 2), ((torch.ones(2),), torch.full((2,), 2.0))])


def test_tensor_checks_shape_and_values():
    with pytest.raises(exercises.ExerciseWrong, match="shape"):
        exercises.check_tensor("t", torch.zeros(2), torch.zeros(3))
    with pytest.raises(exercises.ExerciseWrong, match="differs"):
        exercises.check_tensor("t", torch.zeros(3), torch.ones(3))
    exercises.check_tensor("t", torch.ones(3), torch.ones(3))


def test_errors_render_without_traceback():
    assert exercises.ExerciseWrong("msg")._render_traceback_() == ["ExerciseWrong: msg"]

