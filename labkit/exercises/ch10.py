"""Lab 10's exercise checks (domain parallelism): a stack's halo width (:func:`check_value`) and the rows a tile
receives from above (:func:`check_function`).
"""

from __future__ import annotations

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, check_function, check_value

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_function", "check_value"]
