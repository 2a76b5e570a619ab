import pytest
import torch

from labkit.exercises import checks as exercises
from labkit.exercises import ch05, ch06, ch08


def test_value_none_is_incomplete_and_wrong_is_wrong(capsys):
    with pytest.raises(exercises.ExerciseIncomplete, match="not written yet"):
        exercises.check_value("x", None, 3)
    with pytest.raises(exercises.ExerciseWrong, match="off by one") as wrong:
        exercises.check_value("x", 4, 3)
    assert "3" not in str(wrong.value)                      # never the answer
    with pytest.raises(exercises.ExerciseWrong, match="factor of two"):
        exercises.check_value("x", 6, 3)
    with pytest.raises(exercises.ExerciseWrong, match="bits"):
        exercises.check_value("bytes", 8 * 4096, 4096)
    with pytest.raises(exercises.ExerciseWrong, match="GiB"):
        exercises.check_value("gib", 12.5 * 2**30 / 1e9, 12.5)
    with pytest.raises(exercises.ExerciseWrong, match="too large"):   # not a whole number: a direction is safe
        exercises.check_value("share", 0.31, 0.0519)
    exercises.check_value("x", 3.0000001, 3)
    assert "Correct" in capsys.readouterr().out


def test_function_stub_is_incomplete():
    def stub(x):
        raise NotImplementedError

    with pytest.raises(exercises.ExerciseIncomplete):
        exercises.check_function("f", stub, [((1,), 2)])
    with pytest.raises(exercises.ExerciseWrong, match=r"returned 5: off by a factor of two") as wrong:
        exercises.check_function("f", lambda x: x, [((5,), 10)])
    assert "10" not in str(wrong.value)
    exercises.check_function("f", lambda x: 2 * x, [((1,), 2), ((torch.ones(2),), torch.full((2,), 2.0))])


def test_tensor_checks_shape_and_values():
    with pytest.raises(exercises.ExerciseWrong, match="shape"):
        exercises.check_tensor("t", torch.zeros(2), torch.zeros(3))
    with pytest.raises(exercises.ExerciseWrong, match="differs from the reference in 3 of 3 elements"):
        exercises.check_tensor("t", torch.zeros(3), torch.ones(3))
    with pytest.raises(exercises.ExerciseWrong, match="1 of 3 elements, all by one factor: off by a factor of eight"):
        exercises.check_tensor("t", torch.tensor([1.0, 16.0, 3.0]), torch.tensor([1.0, 2.0, 3.0]))
    exercises.check_tensor("t", torch.ones(3), torch.ones(3))


def test_errors_render_without_traceback():
    assert exercises.ExerciseWrong("msg")._render_traceback_() == ["ExerciseWrong: msg"]



def _stub(*args):
    raise NotImplementedError("exercise not written yet")


def test_exercise_checks_report_a_stub_as_not_written_yet():
    """The learner's copy calls each check with a stub: not written yet, never 'wrong' and never a traceback."""
    with pytest.raises(exercises.ExerciseIncomplete, match="zero1_adamw_step"):
        ch05.check_zero1_adamw_step(_stub)
    with pytest.raises(exercises.ExerciseIncomplete, match="column_parallel_linear"):
        ch06.check_parallel_linears(_stub, _stub)
    with pytest.raises(exercises.ExerciseIncomplete, match="row_parallel_linear"):
        ch06.check_parallel_linears(lambda x, shards: [x @ w.T for w in shards], _stub)
    with pytest.raises(exercises.ExerciseIncomplete, match="merge_attention_blocks"):
        ch08.check_merge_attention_blocks(_stub)
    with pytest.raises(exercises.ExerciseIncomplete, match="min_gpus"):
        ch05.check_min_gpus("min_gpus", None, num_params=13e9, stage=3, gpu_gib=40, reserve_gib=12)
    with pytest.raises(exercises.ExerciseIncomplete, match="saved_gib"):
        ch05.check_zero3_saving("saved_gib", None)


def test_block_attention_of_a_fully_masked_row_is_zero_with_lse_minus_infinity():
    q, k, v = torch.randn(4, 8), torch.randn(3, 8), torch.randn(3, 8)
    out, lse = ch08._block_attention(q, k, v, torch.arange(4), torch.arange(2, 5), causal=True)
    assert torch.isneginf(lse[:2]).all() and (out[:2] == 0).all()      # queries 0, 1 see none of keys 2-4
    assert torch.isfinite(lse[2:]).all()
    torch.testing.assert_close(out[3], torch.softmax(q[3] @ k[:2].T / 8**0.5, -1) @ v[:2])  # query 3: keys 2, 3


def test_a_right_answer_says_why(capsys):
    from labkit.exercises import checks as exercises

    exercises.check_true("layout_70b", True, "does not fit", why="tp=4,pp=4,dp=4 fits; it reaches 100% of the best")
    assert capsys.readouterr().out.strip() == "Correct: layout_70b: tp=4,pp=4,dp=4 fits; it reaches 100% of the best"
