"""Lab 08's second exercise (labkit.exercises.ch08.check_swap_to_heads, Ulysses' all-to-all played for every rank in
one process): the right answer passes, a stub is "not written yet", and each plausible wrong answer is rejected with
the hint that names its slip."""

from __future__ import annotations

import pytest
import torch

from labkit.exercises import ch08 as ex
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong


@pytest.fixture(autouse=True)
def raise_when_unwritten(monkeypatch):
    monkeypatch.setenv("DISTLAB_INCOMPLETE_EXERCISE", "raise")


def right(shards):
    sent = [shard.chunk(len(shards), dim=1) for shard in shards]             # sent[i][j]: rank i's head group j
    return [torch.cat([sent[i][j] for i in range(len(shards))], dim=2) for j in range(len(shards))]


def strided_heads(shards):
    p = len(shards)
    return [torch.cat([shard[:, j::p] for shard in shards], dim=2) for j in range(p)]


def reversed_ranks(shards):
    sent = [shard.chunk(len(shards), dim=1) for shard in shards]
    return [torch.cat([sent[i][j] for i in reversed(range(len(shards)))], dim=2) for j in range(len(shards))]


def reshaped_not_swapped(shards):
    # one rank's own positions reshaped into the target shape: the right shape, other ranks' numbers never arrive
    p = len(shards)
    return [s.reshape(s.shape[0], s.shape[1] // p, s.shape[2] * p, s.shape[-1]) for s in shards]


def unswapped(shards):
    return list(shards)


def stub(shards):
    raise NotImplementedError


def test_the_right_swap_passes(capsys):
    assert ex.check_swap_to_heads(right)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, says", [
    (strided_heads, "every 4th head"),
    (reversed_ranks, "in rank order"),
    (reshaped_not_swapped, "rank i sends head group j"),
    (unswapped, "should hold \\(B, a/c, S, d\\)"),
    (lambda shards: right(shards)[:-1], "a list of 4 tensors"),
])
def test_a_plausible_wrong_swap_is_rejected_with_its_slip_named(wrong, says):
    with pytest.raises(ExerciseWrong, match=says):
        ex.check_swap_to_heads(wrong)


def test_a_stub_is_not_written_yet():
    with pytest.raises(ExerciseIncomplete):
        ex.check_swap_to_heads(stub)


def test_the_librarys_own_swap_needs_a_process_group_so_importing_it_does_not_pass():
    from distlab import context_parallel

    with pytest.raises(Exception) as caught:
        ex.check_swap_to_heads(lambda shards: [context_parallel.sequence_to_heads(s) for s in shards])
    assert not isinstance(caught.value, ExerciseIncomplete)


def test_a_group_of_one_head_is_named_as_one_head():
    """With one head a rank (4 heads on 4 ranks, the first case) the message names "head 2", not "heads 2 to 2"."""
    def wrong_heads(shards):   # right shapes, but each rank gets its neighbour's head group
        swapped = right(shards)
        return swapped[1:] + swapped[:1]

    with pytest.raises(ExerciseWrong) as caught:
        ex.check_swap_to_heads(wrong_heads)
    message = str(caught.value)
    assert "4 heads on 4 ranks" in message and "does not hold head 0 of the whole sequence" in message
    assert " to 0" not in message
