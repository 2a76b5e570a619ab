"""Lab 11's exercise checks (choosing a strategy): the fewest nodes for a model (:func:`check_value`) and a layout
that fits, judged by the planner's verdict (:func:`check_true`).
"""

from __future__ import annotations

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, check_true, check_value

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_true", "check_value"]
