"""What every lab's exercise checks share: the failures a learner sees and the general checks, with feedback a
learner can act on. A lab's own module (``labkit.exercises.chNN``) imports these and adds its exercises' checks.

An exercise cell holds the solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``;
``make student`` (``python -m coursetools.student``) replaces it with a stub: a function body becomes
``raise NotImplementedError``, a top-level assignment ``name = ...`` becomes ``name = None``. The check cell
that follows (tagged ``check``) calls a check of the lab's module, which passes with a short confirmation or
says what to do:

* a wrong answer raises :class:`ExerciseWrong`, everywhere: the cell fails, and so does Run All at that cell and
  the full notebooks under test (nbval). Its message says what kind of mistake the answer looks like
  (:func:`wrong_number`, :func:`wrong_tensor`: a factor of two, bits for bytes, off by one), never the expected
  answer, which a learner could otherwise copy from a wrong guess (tests/unit/test_exercises_never_give_the_answer.py);
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
    for index, (got, want) in enumerate(zip(values, targets)):
        if not math.isclose(got, want, rel_tol=rtol, abs_tol=atol):
            which = f"`{name}`" if len(values) == 1 else f"value {index + 1} of `{name}`"
            raise ExerciseWrong(f"{which} = {got:,.6g}: {sentence(wrong_number(got, want))} "
                                f"{hint}".strip())
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
        raise ExerciseWrong(f"`{name}` {sentence(wrong_tensor(value, expected, atol=atol, rtol=rtol))} {hint}".strip())
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
            raise ExerciseWrong(f"`{name}({shown})`: {sentence(difference)} {hint}".strip())
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
                return f"returned {type(got).__name__}, where a tensor is wanted"
            if got.shape != expected.shape:
                return f"returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
            if not torch.allclose(got.double(), expected.double(), atol=1e-6, rtol=1e-5):
                return wrong_tensor(got, expected, atol=1e-6, rtol=1e-5)
            return None
    except ImportError:
        pass
    numbers = (int, float)
    if isinstance(expected, numbers) and isinstance(got, numbers) and not isinstance(got, bool) \
            and not isinstance(expected, bool):
        if math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12):
            return None
        return f"returned {got:,.6g}: {wrong_number(got, expected)}"
    if got == expected:
        return None
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        if len(got) != len(expected):
            return f"returned {_short(got)}: {len(got)} items, where {len(expected)} are wanted"
        first = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
        return f"returned {_short(got)}: item {first} is the first that is wrong"
    return f"returned {_short(got)}, which is not the reference's answer"


# A wrong number's message says what kind of mistake it looks like, never the number expected (a learner must not
# be able to read the answer off a wrong guess): the ratios a usual slip gives are recognised and named, in words, so
# that no digit of the message is mistaken for the answer.
_RATIO_SLIPS = (
    (2.0, "off by a factor of two: is something counted twice, or once where it happens twice (both directions, two "
          "copies, forward and backward)?"),
    (8.0, "off by a factor of eight: bits where bytes are meant, or bytes where bits are?"),
    (2**30 / 1e9, "off by the ratio of a GiB (two to the 30th bytes) to a GB (ten to the 9th): the units are mixed"),
    (2**20 / 1e6, "off by the ratio of a MiB (two to the 20th bytes) to a MB (ten to the 6th): the units are mixed"),
    (2**40 / 1e12, "off by the ratio of a TiB (two to the 40th bytes) to a TB (ten to the 12th): the units are mixed"),
    (1024.0, "off by one binary unit step (KiB, MiB, GiB) too many or too few"),
    (1e3, "off by a factor of a thousand: a unit prefix (k, M, G, T) or a conversion too many or too few?"),
    (1e6, "off by a factor of a million: a unit prefix (k, M, G, T) or a conversion too many or too few?"),
    (1e9, "off by a factor of a billion: a unit prefix (k, M, G, T) or a conversion too many or too few?"),
    (3600.0, "off by the seconds in an hour: seconds against hours?"),
    (86400.0, "off by the seconds in a day: seconds against days?"),
    (24.0, "off by the hours in a day: hours against days?"),
)

# whole factors a count per rank, per GPU or per layer takes an answer off by (world sizes, layer counts), in words
_WHOLE_FACTORS = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 9: "nine", 10: "ten", 12: "twelve",
                  16: "sixteen", 32: "thirty-two", 64: "sixty-four", 128: "a hundred and twenty-eight"}


def _named_slip(ratio: float) -> str | None:
    """The usual slip that takes an answer ``ratio`` times off, in words, or None."""
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-4)  # noqa: E731  a slip's ratio, to within rounding
    if close(ratio, -1.0):
        return "the size looks right, but the sign is wrong"
    for factor, words in _RATIO_SLIPS:
        if close(ratio, factor) or close(ratio, 1 / factor):
            return words
    for factor, words in _WHOLE_FACTORS.items():
        if close(ratio, factor) or close(ratio, 1 / factor):
            return (f"off by a whole factor of {words}: something counted once per rank (or per GPU, step, layer) "
                    f"where it is counted once in all, or the reverse?")
    return None


# a whole-number answer below this gets no "too large" or "too small": a learner would find it in a few guesses
SMALL_WHOLE = 10_000


def sentence(text: str) -> str:
    """``text`` ended as a sentence: a full stop unless it ends with one, or with a question."""
    return text if text.endswith((".", "?", "!")) else text + "."


def wrong_number(got: float, want: float) -> str:
    """What kind of mistake ``got`` looks like against ``want``, in words that never give ``want`` away: a ratio
    a usual slip gives (2, 8, GiB against GB, a whole factor such as the world size), the wrong sign, off by one,
    close but rounded; a direction only where ``want`` is no small whole number (halving a range of a few
    thousand whole numbers finds one in a dozen guesses; a real number, or a count of bytes, to the tolerance takes
    some twenty, each with the work of a new answer)."""
    got, want = float(got), float(want)
    if math.isnan(got) or math.isinf(got):
        return f"{got} is no finite number: look for a division by zero or an overflow"
    if want == 0:
        return "the answer is smaller in size than that: what cancels out, or what is never counted?"
    ratio = got / want
    if want.is_integer() and got.is_integer() and abs(got - want) == 1:
        return "off by one: does the count include its first (or last) one, or one too many?"
    if ratio > 0 and math.isclose(ratio, 1.0, rel_tol=0.01):
        return ("close, but farther off than rounding allows: keep every digit to the end, don't round on the way, "
                "and check each constant")
    slip = _named_slip(ratio)
    if slip:
        return slip
    if want.is_integer() and abs(want) < SMALL_WHOLE:
        return "not the answer, nor what a usual slip gives: go through the steps of the hint again"
    size = "more than ten times too" if ratio > 10 or 0 < ratio < 0.1 else "too"
    way = "large" if abs(got) > abs(want) else "small"
    return f"{size} {way} for rounding or a usual slip: go through the steps of the hint again"


def wrong_tensor(got, want, *, atol: float, rtol: float, reference: str = "the reference") -> str:
    """How tensor ``got`` differs from ``want`` (the same shape), without giving ``want``'s numbers away: how many
    elements are off, and the pattern a usual slip gives (a factor, the sign, a transpose, rounding)."""
    import torch

    got, want = got.detach().double(), want.detach().double()
    off = ~torch.isclose(got, want, atol=atol, rtol=rtol)
    said = f"differs from {reference} in {int(off.sum())} of {want.numel()} elements"
    nonzero = want[off] != 0
    if bool(nonzero.any()):
        ratios = got[off][nonzero] / want[off][nonzero]
        if bool(torch.allclose(ratios, ratios[0].expand_as(ratios), rtol=1e-3)) and bool(nonzero.all()):
            ratio = float(ratios[0])
            if math.isclose(ratio, 1.0, rel_tol=0.01):
                return f"{said}, each by about rounding's size: a dtype, an epsilon or a rounded constant?"
            slip = _named_slip(ratio)
            if slip:
                return f"{said}, all by one factor: {slip}"
    if want.dim() == 2 and want.shape[0] == want.shape[1] and torch.allclose(got, want.T, atol=atol, rtol=rtol):
        return f"{said}: it is {reference} transposed"
    if torch.allclose(torch.sort(got.flatten()).values, torch.sort(want.flatten()).values, atol=atol, rtol=rtol):
        return f"{said}: the right numbers in the wrong places (an order, an index or a transpose)"
    return said


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
