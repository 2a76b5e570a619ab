"""Lab 07's exercise checks (pipeline parallelism): a 1F1B schedule written by hand (:func:`check_function`), the
microbatches a bubble target needs and an interleaved bubble (:func:`check_value`).
"""

from __future__ import annotations

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, check_function, check_value

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_function", "check_value"]
