"""Chapter 13's exercise checks (labkit.exercises.ch13): a correct answer passes, a stub is "not written yet", and
each plausible wrong answer is rejected with the hint that names it."""

from __future__ import annotations

import pytest
import torch

from labkit.exercises import ch13 as ex
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong


@pytest.fixture(autouse=True)
def raise_when_unwritten(monkeypatch):
    monkeypatch.setenv("DISTLAB_INCOMPLETE_EXERCISE", "raise")


def stub(*args):
    raise NotImplementedError


def test_dispatch_bytes():
    assert ex.check_dispatch_bytes(lambda t, k, h, b, ep: t * k * h * b * (ep - 1) / ep)
    with pytest.raises(ExerciseWrong, match="never leave it"):
        ex.check_dispatch_bytes(lambda t, k, h, b, ep: t * k * h * b)               # every assignment counted
    with pytest.raises(ExerciseWrong, match="top_k rows"):
        ex.check_dispatch_bytes(lambda t, k, h, b, ep: t * h * b * (ep - 1) / ep)   # one row a token
    with pytest.raises(ExerciseIncomplete):
        ex.check_dispatch_bytes(stub)


def test_ep_choice():
    assert ex.check_ep_choice(lambda *case: ex.reference_ep(*case))
    assert ex.reference_ep(64, 1.0, 10.0, 4, 8) == (8, True) and ex.reference_ep(8, 4.0, 20.0, 4, 4) == (2, False)
    with pytest.raises(ExerciseWrong, match="every all-to-all crosses nodes"):   # every GPU, always
        ex.check_ep_choice(lambda e, g, f, n, nodes: (min(e, n * nodes), min(e, n * nodes) > n))
    with pytest.raises(ExerciseWrong, match="a GPU holds 8 experts"):  # ignores memory
        ex.check_ep_choice(lambda e, g, f, n, nodes: (1, False))
    with pytest.raises(ExerciseIncomplete):
        ex.check_ep_choice(stub)


def test_dropless_capacity():
    routing = [(torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]]), 4)]
    right = lambda chosen, e: int(torch.bincount(chosen.reshape(-1), minlength=e).max()) * e / chosen.numel()
    assert ex.check_dropless_capacity(right, routing)
    with pytest.raises(ExerciseWrong, match="the busiest expert decides"):
        ex.check_dropless_capacity(lambda chosen, e: 1.0, routing)                  # the mean load, not the busiest
    with pytest.raises(ExerciseWrong, match="is enough"):
        ex.check_dropless_capacity(lambda chosen, e: 4.0, routing)                  # drops nothing, but too large
    with pytest.raises(ExerciseWrong, match="rounds its capacity up"):              # drops nothing thanks to the ceil
        ex.check_dropless_capacity(lambda chosen, e: 0.9 * right(chosen, e), routing)
    with pytest.raises(ExerciseIncomplete):
        ex.check_dropless_capacity(stub, routing)
