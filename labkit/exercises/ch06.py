"""Lab 06's exercise checks (tensor parallelism): the column- and row-parallel linears by hand
(:func:`check_parallel_linears`) and the bytes of one step phase by phase (:func:`check_bytes_per_phase`).
"""

from __future__ import annotations

import math

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, learner_check, sentence, wrong_number
from labkit.exercises.checks import _default_compare, _not_done, _ok, _short  # the shared feedback helpers

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_parallel_linears", "check_bytes_per_phase"]


# --------------------------------------------------------------------------------------------------
# Checks of one exercise each: they look at more than the final number, so a plausible wrong answer that
# happens to give it (an unsharded optimizer, loss statistics counted in the wrong phase) is still caught.
# tests/unit/test_exercises_reject_wrong.py feeds each one the wrong answers it must reject.
# --------------------------------------------------------------------------------------------------


@learner_check
def check_parallel_linears(column_parallel_linear, row_parallel_linear, *, ranks: int = 4, hint: str = "") -> None:
    """Notebook 06, exercise 1: the column- and row-parallel linears, forward and weight gradients.

    ``column_parallel_linear(x, weight_shards)`` returns each rank's output columns; ``row_parallel_linear(
    x_shards, weight_shards)`` the summed output. Both are compared with ``x @ W^T`` and, after a backward
    of ``sum(out * upstream)``, each rank's weight gradient with its slice of ``upstream^T x``. Shapes are
    checked before the backward, so a wrong one is reported as such rather than as an error inside it.
    """
    import torch

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 12, generator=generator)           # nn.Linear layout: (out, in)
    x, upstream = torch.randn(6, 12, generator=generator), torch.randn(6, 8, generator=generator)
    expected_out, expected_grad = x @ weight.T, upstream.T @ x  # d sum(out * upstream) / dW = upstream^T x
    for kind, function, split_dim in (("column", column_parallel_linear, 0), ("row", row_parallel_linear, 1)):
        name = f"{kind}_parallel_linear"
        shards = [w.clone().requires_grad_() for w in weight.chunk(ranks, dim=split_dim)]
        try:
            if kind == "column":
                outputs = function(x, shards)
                shapes = [tuple(o.shape) if isinstance(o, torch.Tensor) else None for o in outputs] \
                    if isinstance(outputs, (list, tuple)) else None
                if shapes != [(6, 8 // ranks)] * ranks:
                    raise ExerciseWrong(f"`{name}` should return a list of {ranks} tensors of shape "
                                        f"{(6, 8 // ranks)} (one per rank), got {_short(shapes or outputs)}. "
                                        f"{hint}".strip())
                out = torch.cat(list(outputs), dim=-1)
            else:
                out = function(list(x.chunk(ranks, dim=-1)), shards)
                if not isinstance(out, torch.Tensor) or out.shape != expected_out.shape:
                    raise ExerciseWrong(f"`{name}` should return the full output, a tensor of shape "
                                        f"{tuple(expected_out.shape)}, got {_short(getattr(out, 'shape', out))}. "
                                        f"{hint}".strip())
        except NotImplementedError:
            raise _not_done(name, hint) from None
        difference = _default_compare(out.detach(), expected_out)
        if difference:
            raise ExerciseWrong(f"`{name}`: the output {difference}. {hint}".strip())
        if out.requires_grad:
            (out * upstream).sum().backward()
        if any(s.grad is None for s in shards):
            raise ExerciseWrong(f"`{name}`: no gradient reached the weight shards: keep them in the graph "
                                f"(no .detach(), no torch.no_grad()). {hint}".strip())
        difference = _default_compare(torch.cat([s.grad for s in shards], dim=split_dim), expected_grad)
        if difference:
            raise ExerciseWrong(f"`{name}`: the weight gradients {difference}. {hint}".strip())
    _ok("column_parallel_linear and row_parallel_linear: outputs and weight gradients equal nn.Linear's")


@learner_check
def check_bytes_per_phase(name: str, predicted: dict, comm_rows, *, hint: str = "") -> None:
    """Notebook 06, exercise 2: the payload bytes of one step, phase by phase, against the measured ledger.

    ``predicted`` is ``{phase: bytes}``; ``comm_rows`` the run's ``metrics["comm"]`` (rows with ``phase`` and
    ``measured_bytes``). Each phase is compared, not only the total: the loss statistics counted in backward,
    or the embedding's all-reduce counted twice and the output's forgotten, give the right total.
    """
    if predicted is None or any(value is None or value is Ellipsis for value in dict(predicted).values()):
        raise _not_done(name, hint)
    measured: dict[str, int] = {}
    for row in comm_rows:
        measured[row["phase"]] = measured.get(row["phase"], 0) + row["measured_bytes"]
    if set(predicted) != set(measured):
        raise ExerciseWrong(f"`{name}` should give one number per phase, {sorted(measured)}; got "
                            f"{sorted(predicted)}. {hint}".strip())
    # the measured bytes are the answer: a wrong phase is told its kind of mistake, not what was measured
    wrong = [f"{phase}: predicted {float(predicted[phase]):,.0f} B, "
             f"{wrong_number(predicted[phase], measured[phase])}"
             for phase in measured if not math.isclose(float(predicted[phase]), measured[phase], rel_tol=1e-9)]
    if wrong:
        moved = math.isclose(sum(float(v) for v in predicted.values()), sum(measured.values()), rel_tol=1e-9)
        said = ("the total is right, but some bytes are counted in the wrong phase (which phase does each collective "
                "run in?): " if moved else "") + "; ".join(wrong)
        raise ExerciseWrong(f"`{name}`: {sentence(said)} {hint}".strip())
    _ok(f"{name}: " + ", ".join(f"{phase} {measured[phase]:,} B" for phase in measured) + " (measured)")
