"""Lab 03's "Exercise 1: what each rank ends with" (labkit.exercises.ch03.check_collectives): a right answer passes,
a stub is "not written yet", and each plausible wrong answer is rejected with the hint that names it."""

from __future__ import annotations

import pytest
import torch

from labkit.exercises import ch03 as ex
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong


@pytest.fixture(autouse=True)
def raise_when_unwritten(monkeypatch):
    monkeypatch.setenv("DISTLAB_INCOMPLETE_EXERCISE", "raise")


def stub(inputs):
    raise NotImplementedError


# written here as a learner would, not imported: the check module holds no answer to import
def reduce_scatter(inputs):
    return list(torch.stack(inputs).sum(0).chunk(len(inputs)))


def all_to_all(inputs):
    n = len(inputs)
    return [torch.cat([x.chunk(n)[r] for x in inputs]) for r in range(n)]


def test_the_right_answers_pass():
    assert ex.check_collectives(reduce_scatter, all_to_all)
    # a tuple of tensors, or integer tensors, are the same answer
    assert ex.check_collectives(lambda xs: tuple(reduce_scatter(xs)), lambda xs: [t.long() for t in all_to_all(xs)])


@pytest.mark.parametrize("wrong, hint", [
    (lambda xs: [torch.stack(xs).sum(0) for _ in xs], "all-reduce's answer"),
    (lambda xs: [reduce_scatter(xs)[(r + 1) % len(xs)] for r in range(len(xs))], "where the ring's first phase"),
    (lambda xs: [x.chunk(len(xs))[r] for r, x in enumerate(xs)], "rank r's own input"),
    (lambda xs: [torch.stack(xs).mean(0).chunk(len(xs))[r] for r in range(len(xs))], "chunk r of the sum"),
    (lambda xs: torch.stack(xs).sum(0), "list of"),
])
def test_a_wrong_reduce_scatter_is_rejected(wrong, hint):
    with pytest.raises(ExerciseWrong, match=hint):
        ex.check_collectives(wrong, all_to_all)


@pytest.mark.parametrize("wrong, hint", [
    (lambda xs: [x.clone() for x in xs], "own tensor, unchanged"),
    (lambda xs: [torch.cat(xs) for _ in xs], "all-gather's answer"),
    (lambda xs: [torch.cat([x.chunk(len(xs))[r] for x in reversed(xs)]) for r in range(len(xs))], "wrong order"),
    (lambda xs: [torch.cat([xs[r].chunk(len(xs))[j] for j in reversed(range(len(xs)))]) for r in range(len(xs))],
     "chunk r of every rank"),
    (lambda xs: all_to_all(xs)[:-1], "list of"),
])
def test_a_wrong_all_to_all_is_rejected(wrong, hint):
    with pytest.raises(ExerciseWrong, match=hint):
        ex.check_collectives(reduce_scatter, wrong)


def test_a_stub_is_not_written_yet():
    with pytest.raises(ExerciseIncomplete):
        ex.check_collectives(stub, all_to_all)
    with pytest.raises(ExerciseIncomplete):
        ex.check_collectives(reduce_scatter, stub)


def test_the_lab_holds_the_exercise_and_its_check():
    import nbformat
    from pathlib import Path

    from coursetools import chapters

    assert chapters.lab_exercises("03")[:2] == ["Exercise 1: what each rank ends with",
                                                "Exercise 2: ring all-reduce, step by step"]
    cells = nbformat.read(Path(__file__).resolve().parents[2] / "notebooks" / "03_communication.ipynb", 4).cells
    assert any("check" in c.metadata.get("tags", []) and "check_collectives(reduce_scatter, all_to_all)" in c.source
               for c in cells)


# the right numbers in the wrong container: the check says to return a 1-D tensor per rank, and why
@pytest.mark.parametrize("wrong, said", [
    (lambda xs: [t.tolist() for t in reduce_scatter(xs)],
     r"The right numbers, but as a Python list.*1-D tensor per rank"),
    (lambda xs: [tuple(t.tolist()) for t in reduce_scatter(xs)],
     r"as a Python tuple.*1-D tensor per rank, shape \(1,\)"),
    (lambda xs: [t.numpy() for t in reduce_scatter(xs)], r"as a numpy.ndarray.*1-D tensor per rank"),
    (lambda xs: [t.unsqueeze(0) for t in reduce_scatter(xs)], r"shape \(1, 1\).*1-D tensor per rank, shape \(1,\)"),
    (lambda xs: [t[0] for t in reduce_scatter(xs)], r"shape \(\).*1-D tensor per rank"),
])
def test_a_reduce_scatter_in_the_wrong_container_is_told_so(wrong, said):
    with pytest.raises(ExerciseWrong, match=said):
        ex.check_collectives(wrong, all_to_all)


@pytest.mark.parametrize("wrong, said", [
    (lambda xs: [torch.stack([x.chunk(len(xs))[r] for x in xs]) for r in range(len(xs))],
     r"The right numbers, but as a tensor of shape \(2, 1\).*1-D tensor per rank, shape \(2,\).*torch\.cat"),
    (lambda xs: [t.tolist() for t in all_to_all(xs)], r"as a Python list.*1-D tensor per rank, shape \(2,\)"),
    (lambda xs: [[t.tolist()] for t in all_to_all(xs)], r"as a Python list.*1-D tensor per rank"),
])
def test_an_all_to_all_in_the_wrong_container_is_told_so(wrong, said):
    with pytest.raises(ExerciseWrong, match=said):
        ex.check_collectives(reduce_scatter, wrong)


def test_wrong_numbers_in_a_list_are_still_named_by_their_slip():
    with pytest.raises(ExerciseWrong, match=r"a Python list, not a 1-D tensor.*1-D tensor per rank.*all-reduce's") as c:
        ex.check_collectives(lambda xs: [torch.stack(xs).sum(0).tolist() for _ in xs], all_to_all)
    assert "right numbers" not in str(c.value)
