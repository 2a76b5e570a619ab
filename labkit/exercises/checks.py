"""What every lab's exercise checks share: the failures a learner sees and the general checks, with feedback a
learner can act on. A lab's own module (``labkit.exercises.chNN``) imports these and adds its exercises' checks.

An exercise cell holds the solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``;
``make student`` (``python -m coursetools.student``) replaces it with a stub: a function body becomes
``raise NotImplementedError``, a top-level assignment ``name = ...`` becomes ``name = None``. The check cell
that follows (tagged ``check``) calls a check of the lab's module, which passes with a short confirmation or
says what to do:

* a wrong answer raises :class:`ExerciseWrong`, everywhere: the cell fails, and so does Run All at that cell and
  the full notebooks under test (nbval);
* an exercise not written yet (still the stub) is :class:`ExerciseIncomplete`. In a Jupyter notebook the check
  prints that it is not written yet and returns, so Run All goes on and a learner who answered exercise 2 first
  sees its check; elsewhere (a script, the unit tests) it raises. ``DISTLAB_INCOMPLETE_EXERCISE=raise`` (or
  ``show``) decides it either way.

In Jupyter an exercise's failure is shown as its message, without a traceback.
"""

from __future__ import annotations

import functools
import math
import os


class ExerciseError(AssertionError):
    """Base of the exercise failures: shown in Jupyter as its message alone."""

    def _render_traceback_(self):  # IPython hook: no traceback wall for a learner
        return [f"{type(self).__name__}: {self}"]


class ExerciseIncomplete(ExerciseError):
    """The exercise has not been written yet (still the stub)."""


class ExerciseWrong(ExerciseError):
    """The exercise runs but gives the wrong answer."""


def _in_jupyter() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def incomplete_is_shown() -> bool:
    """Whether an unwritten exercise is reported and passed over (True) or raised (False): see the module's doc."""
    choice = os.environ.get("DISTLAB_INCOMPLETE_EXERCISE", "")
    return choice == "show" or (choice != "raise" and _in_jupyter())


def learner_check(check):
    """A check function as a learner's notebook runs it: True when the answer is right; an unwritten exercise says
    so and returns False, letting the notebook run on (:func:`incomplete_is_shown`), so a cell that goes on to use
    the answer writes ``if exercises.check_...(...):``; a wrong answer still raises."""
    @functools.wraps(check)
    def run(*args, **kwargs):
        try:
            check(*args, **kwargs)
        except ExerciseIncomplete as missing:
            if not incomplete_is_shown():
                raise
            print(f"Not written yet: {missing} (the rest of the notebook runs on; come back to this one)")
            return False
        return True
    return run


def call_learner(name: str, function, *args):
    """The learner's ``function`` called on ``args``; while it is still the stub (``raise NotImplementedError``)
    the exercise is not written yet."""
    try:
        return function(*args)
    except NotImplementedError:
        raise ExerciseIncomplete(f"`{name}` is not written yet. Fill in its body, then run this cell again.") from None


def _ok(message: str) -> None:
    print(f"Correct: {message}")


def _not_done(name: str, hint: str) -> ExerciseIncomplete:
    return ExerciseIncomplete(f"`{name}` is not written yet. {hint}".strip())


@learner_check
def check_value(name: str, value, expected, *, rtol: float = 1e-6, atol: float = 0.0, hint: str = "") -> None:
    """A number (or sequence of numbers) the learner computed, against the expected one."""
    if value is None or value is Ellipsis:
        raise _not_done(name, hint)
    try:
        values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
        targets = [float(e) for e in expected] if isinstance(expected, (list, tuple)) else [float(expected)]
    except (TypeError, ValueError):
        raise ExerciseWrong(f"`{name}` should be a number, got {type(value).__name__}. {hint}".strip()) from None
    if len(values) != len(targets):
        raise ExerciseWrong(f"`{name}` should have {len(targets)} values, got {len(values)}. {hint}".strip())
    for got, want in zip(values, targets):
        if not math.isclose(got, want, rel_tol=rtol, abs_tol=atol):
            raise ExerciseWrong(f"`{name}` = {got:,.6g}, expected {want:,.6g}. {hint}".strip())
    _ok(f"{name} = {value}")


@learner_check
def check_tensor(name: str, value, expected, *, atol: float = 1e-6, rtol: float = 1e-5, hint: str = "") -> None:
    """A tensor the learner produced, against the reference tensor."""
    import torch

    if value is None or value is Ellipsis:
        raise _not_done(name, hint)
    if not isinstance(value, torch.Tensor):
        raise ExerciseWrong(f"`{name}` should be a torch.Tensor, got {type(value).__name__}. {hint}".strip())
    if value.shape != expected.shape:
        raise ExerciseWrong(f"`{name}` has shape {tuple(value.shape)}, expected {tuple(expected.shape)}. "
                            f"{hint}".strip())
    if not torch.allclose(value.detach().double(), expected.detach().double(), atol=atol, rtol=rtol):
        diff = (value.detach().double() - expected.detach().double()).abs().max().item()
        raise ExerciseWrong(f"`{name}` differs from the reference by up to {diff:.3g} (tolerance {atol:g}). "
                            f"{hint}".strip())
    _ok(f"{name} matches the reference (shape {tuple(value.shape)})")


@learner_check
def check_function(name: str, function, cases, *, compare=None, hint: str = "") -> None:
    """Call the learner's ``function`` on each ``(args, expected)`` case.

    ``compare(got, expected)`` returns None when equal or a string saying how they differ; the default
    compares numbers and tensors closely and anything else with ``==``.
    """
    compare = compare or _default_compare
    for args, expected in cases:
        args = args if isinstance(args, tuple) else (args,)
        try:
            got = function(*args)
        except NotImplementedError:
            raise _not_done(name, hint) from None
        difference = compare(got, expected)
        if difference:
            shown = ", ".join(_short(a) for a in args)
            raise ExerciseWrong(f"`{name}({shown})`: {difference}. {hint}".strip())
    _ok(f"{name} passed {len(cases)} case(s)")


@learner_check
def check_true(name: str, condition, message: str, *, hint: str = "", why: str = "") -> None:
    """A property the learner's work must have, with ``message`` explaining what is wrong otherwise; ``why``
    says, when it holds, why the answer is right (feedback that teaches, not just "correct")."""
    if condition is None:
        raise _not_done(name, hint)
    if not condition:
        raise ExerciseWrong(f"{message} {hint}".strip())
    _ok(f"{name}: {why}" if why else name)


@learner_check
def check_run(name: str, result, *, hint: str = "") -> None:
    """A script run launched from the notebook (a labkit.launch result): every check in its metrics passed."""
    if result is None:
        raise _not_done(name, hint)
    checks = (result.metrics or {}).get("checks", [])
    failed = [c["name"] for c in checks if not c["passed"]]
    if not checks:
        raise ExerciseWrong(f"`{name}`: the run wrote no checks. {hint}".strip())
    if failed:
        raise ExerciseWrong(f"`{name}`: these checks failed: {', '.join(failed)}. {hint}".strip())
    _ok(f"{name}: all {len(checks)} checks of the run passed")


def _default_compare(got, expected) -> str | None:
    try:
        import torch

        if isinstance(expected, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                return f"returned {type(got).__name__}, expected a tensor"
            if got.shape != expected.shape:
                return f"returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
            if not torch.allclose(got.double(), expected.double(), atol=1e-6, rtol=1e-5):
                return f"differs from the reference by up to {(got.double() - expected.double()).abs().max():.3g}"
            return None
    except ImportError:
        pass
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return None if math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12) else f"returned {got}, expected {expected}"
    return None if got == expected else f"returned {_short(got)}, expected {_short(expected)}"


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
