"""Lab 04's exercise checks (data parallelism): gradients averaged by hand (:func:`check_function`) and the bytes
a ring all-reduce sends, predicted then compared with the run's measured bytes (:func:`check_value`).
"""

from __future__ import annotations

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, check_function, check_value

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_function", "check_value"]
