"""Lab 01's exercise checks (the single-device baseline): the parameter count of a model and the bytes of its
training state, each a number the learner computes and :func:`check_value` compares with the library's count.
"""

from __future__ import annotations

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, check_value

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_value"]
