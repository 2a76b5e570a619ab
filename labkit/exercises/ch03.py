"""Lab 03's exercise checks (communication): an all-reduce on a ring written by hand, called on several inputs
by :func:`check_function` and compared with the sum.
"""

from __future__ import annotations

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, check_function

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_function"]
