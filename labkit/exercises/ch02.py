"""Lab 02's exercise checks (why distributed): the largest model that fits under DDP and under FSDP, numbers
compared by :func:`check_value`.
"""

from __future__ import annotations

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, check_value

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_value"]
