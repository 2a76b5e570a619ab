"""Every numeric flag of every script, swept with 0 and a negative value.

The flags are read from each script's own argument parser (captured as the script builds it), so a flag added
tomorrow is swept without editing this file. A numeric flag must use one of ``distlab.runtime``'s number types:
a plain ``int`` or ``float`` fails here, since it lets ``--groups 0`` through to a ZeroDivisionError on every rank.
A value the flag refuses must end as argparse's one usage error naming the flag, exit code 2, before any process
group exists (the same line on every rank under torchrun); the end-to-end run below shows that under 4 ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

from distlab import runtime

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in REPO.glob("scripts/*/*.py") if not p.name.startswith("common_"))


class _Captured(Exception):
    pass


def script_parser(path: Path) -> argparse.ArgumentParser:
    """The parser ``path`` builds, caught as the script asks it to parse (nothing of the script runs after)."""
    def catch(self, *args, **kwargs):
        raise _Captured(self)

    saved = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, sys.argv[:])
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = catch
    sys.argv = [str(path)]
    sys.path.insert(0, str(path.parent))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(str(path), run_name="__main__")
    except _Captured as caught:
        return caught.args[0]
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args, sys.argv[:] = saved
        sys.path.remove(str(path.parent))
    raise AssertionError(f"{path} parsed no arguments")


def numeric_flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The flags whose type turns "1" into a number (a list of names, a path or a choice is not one)."""
    return [a for a in parser._actions if a.option_strings and a.type is not None and a.type is not str
            and not isinstance(a.type, argparse.FileType) and _makes_a_number(a.type)]


def _makes_a_number(kind) -> bool:
    try:
        return isinstance(kind("1"), (int, float))
    except (argparse.ArgumentTypeError, TypeError, ValueError):
        return False


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[int | None, str]:
    """argparse's exit code (None: it parsed) and what it printed."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as stop:
        return stop.code, err.getvalue()
    return None, err.getvalue()


PARSERS = {path: script_parser(path) for path in SCRIPTS}


def test_every_script_is_swept_and_has_numeric_flags():
    assert len(SCRIPTS) >= 28
    assert all(numeric_flags(p) for p in PARSERS.values())


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_zero_and_negative_values_end_as_one_usage_error(path):
    parser = PARSERS[path]
    for action in numeric_flags(parser):
        flag = action.option_strings[0]
        assert action.type in runtime.NUMBER_TYPES, (
            f"{path.name} {flag}: type {getattr(action.type, '__name__', action.type)}; use runtime.positive_int, "
            "nonnegative_int, positive_float or nonnegative_float")
        zero_allowed = action.type in (runtime.nonnegative_int, runtime.nonnegative_float)
        for value in ("-1",) + (() if zero_allowed else ("0",)):
            code, err = parse(parser, [flag, value])
            assert code == 2, (path.name, flag, value)
            lines = [ln for ln in err.splitlines() if "error:" in ln]
            assert len(lines) == 1 and f"argument {flag}" in lines[0] and "Traceback" not in err, err
        if zero_allowed:  # 0 passes this flag (the parse may stop later, at another flag's rule: not this one's)
            code, err = parse(parser, [flag, "0"])
            assert f"argument {flag}" not in err, err


def test_the_sweep_catches_a_plain_int_and_a_number_type_that_lets_zero_through():
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=2)
    assert numeric_flags(parser)[0].type not in runtime.NUMBER_TYPES
    wrong = argparse.ArgumentParser()
    wrong.add_argument("--groups", type=runtime.nonnegative_int)  # declared as allowing 0
    assert parse(wrong, ["--groups", "0"])[0] is None
    right = argparse.ArgumentParser()
    right.add_argument("--groups", type=runtime.positive_int)
    code, err = parse(right, ["--groups", "0"])
    assert code == 2 and "argument --groups: must be a positive integer, not 0" in err
    assert "argument --groups: 'x' is not a positive integer" in parse(right, ["--groups", "x"])[1]
