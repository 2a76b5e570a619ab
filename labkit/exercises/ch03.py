"""Lab 03's exercise checks (communication).

* :func:`check_collectives`: what each rank ends with after a reduce-scatter and an all-to-all, written by the
  learner as functions of every rank's input (one process, no network), checked on 2 to 5 ranks against the
  definitions of chapter 03, with a hint that names the usual mistake (all-reduce's answer, the chunk where the
  ring leaves it, a rank's own tensor, all-gather's answer).
* :func:`check_function`: the ring all-reduce written by hand on a simulated ring, called on several inputs and
  compared with the sum (the compare function is the notebook's).

Each raises :class:`ExerciseIncomplete` while the exercise is a stub and :class:`ExerciseWrong` with a hint when
the answer is wrong.
"""

from __future__ import annotations

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, call_learner, check_function, learner_check

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_collectives", "check_function"]

# (ranks, elements per chunk) the collectives are checked on: a chunk of one element, of several, and 2 to 5 ranks
COLLECTIVE_CASES = [(2, 1), (3, 2), (4, 2), (5, 3), (4, 1)]


def _inputs(ranks: int, chunk: int):
    """Every rank's tensor: distinct whole numbers (rank r's are 100 r, 100 r + 1, ...), so every chunk of every
    rank, and every sum of chunks, can be told apart, and sums are exact."""
    import torch

    return [100.0 * r + torch.arange(ranks * chunk, dtype=torch.float32) for r in range(ranks)]


def _chunks(tensor, ranks: int):
    return list(tensor.chunk(ranks))


def _same(got, want) -> bool:
    import torch

    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got.float(), want.float())


def _outputs(name: str, function, inputs):
    ranks = len(inputs)
    got = call_learner(name, function, [x.clone() for x in inputs])
    if got is None:
        raise ExerciseIncomplete(f"`{name}` is not written yet. It returned None.")
    got = list(got) if isinstance(got, (list, tuple)) else got
    if not isinstance(got, list) or len(got) != ranks:
        raise ExerciseWrong(f"`{name}` on {ranks} ranks should return a list of {ranks} tensors, one a rank; "
                            f"got {type(got).__name__}" + (f" of {len(got)}" if isinstance(got, list) else "") + ".")
    return got


def _as_numbers(output):
    """(``output``'s numbers as a 1-D tensor, or None if they cannot be read; what its container is, or None when it
    is already a 1-D tensor)."""
    import torch

    if isinstance(output, torch.Tensor):
        return (output, None) if output.dim() == 1 else (output.flatten(), f"a tensor of shape {tuple(output.shape)}")
    kind = type(output)
    what = f"a Python {kind.__name__}" if kind.__module__ == "builtins" else f"a {kind.__module__}.{kind.__qualname__}"
    try:
        return torch.as_tensor(output, dtype=torch.float64).flatten(), what
    except (TypeError, ValueError, RuntimeError):
        return None, what


def _judge(name: str, ranks: int, chunk: int, r: int, output, want, slips, hint: str, container_tip: str = ""):
    """Raise :class:`ExerciseWrong` unless ``output`` is ``want``, a 1-D tensor: first the container (a list, a
    2-D tensor) when that is wrong, then the first of ``slips`` ((wrong answer, its hint) pairs) the numbers match."""
    values, what = _as_numbers(output)
    if what is None and _same(output, want):
        return
    for wrong, slip in slips:
        if values is not None and _same(values, wrong):
            hint = slip
            break
    if what is not None:
        fix = f"Return a 1-D tensor per rank, shape ({want.numel()},) here{container_tip}."
        right = values is not None and _same(values, want)
        hint = (f"The right numbers, but as {what}. {fix}" if right else
                f"Each rank's answer is {what}, not a 1-D tensor. {fix} {hint}")
    raise ExerciseWrong(f"`{name}` on {ranks} ranks of {ranks * chunk} numbers: rank {r} ends with "
                        f"{_shown(output)}, which is not what the collective leaves there. {hint}")


def _check_reduce_scatter(reduce_scatter, ranks: int, chunk: int) -> None:
    import torch

    inputs = _inputs(ranks, chunk)
    total = torch.stack(inputs).sum(0)
    got = _outputs("reduce_scatter", reduce_scatter, inputs)
    for r, output in enumerate(got):
        slips = [
            (total, "That is the whole sum on every rank: all-reduce's answer. Rank r keeps only chunk r of it."),
            (_chunks(total, ranks)[(r + 1) % ranks], "That is chunk (r + 1) mod n, where the ring's first phase "
                                                     "leaves it. The collective's definition puts chunk r on rank r."),
            (_chunks(inputs[r], ranks)[r], "That is chunk r of rank r's own input: add chunk r of every rank's input."),
        ]
        _judge("reduce_scatter", ranks, chunk, r, output, _chunks(total, ranks)[r], slips,
               "Rank r ends with chunk r of the sum over the ranks: n times smaller than its input.")


def _check_all_to_all(all_to_all, ranks: int, chunk: int) -> None:
    import torch

    inputs = _inputs(ranks, chunk)
    got = _outputs("all_to_all", all_to_all, inputs)
    for r, output in enumerate(got):
        hint = "Chunk j of rank i goes to rank j, so rank r ends with chunk r of every rank, in rank order."
        slips = [
            (inputs[r], "That is rank r's own tensor, unchanged: " + hint[0].lower() + hint[1:]),
            (torch.cat(inputs), "That is every rank's whole tensor: all-gather's answer, n times larger. " + hint),
            (torch.cat([_chunks(x, ranks)[r] for x in reversed(inputs)]),
             "The right chunks, in the wrong order: rank 0's chunk comes first."),
        ]
        _judge("all_to_all", ranks, chunk, r, output, torch.cat([_chunks(x, ranks)[r] for x in inputs]), slips, hint,
               ": torch.cat joins the chunks end to end, where torch.stack makes a table of them")


def _shown(value) -> str:
    tolist = getattr(value, "tolist", None)
    return str(tolist()) if callable(tolist) else repr(value)


@learner_check
def check_collectives(reduce_scatter, all_to_all) -> None:
    """``reduce_scatter(inputs)`` and ``all_to_all(inputs)``: ``inputs`` holds every rank's 1-D tensor (the same
    length, n chunks); each returns the list of what every rank ends with."""
    for ranks, chunk in COLLECTIVE_CASES:
        _check_reduce_scatter(reduce_scatter, ranks, chunk)
    for ranks, chunk in COLLECTIVE_CASES:
        _check_all_to_all(all_to_all, ranks, chunk)
    print(f"Correct on 2 to 5 ranks: reduce-scatter leaves rank r chunk r of the sum (its input / n); all-to-all "
          f"gives rank r chunk r of every rank (a transpose of the ranks-by-chunks table). Run one after the "
          f"other, reduce-scatter then all-gather, and you have all-reduce.")
