"""The checks a lab's exercises call: one module per lab, ``chNN`` for ``notebooks/NN_*.ipynb``.

A lab imports its own module as ``from labkit.exercises import chNN as exercises`` and its check cells call
``exercises.check_...``. ``checks`` holds what every lab shares: the failures a learner sees
(``ExerciseIncomplete``, ``ExerciseWrong``), ``learner_check`` (an unwritten exercise lets Run All go on) and the
general checks (``check_value``, ``check_function``, ``check_tensor``, ``check_true``); a lab's module adds the
checks of its own exercises, which look at more than the final number so that a plausible wrong answer is caught.

checks   the shared failures and general checks
ch01 ... ch14    each lab's checks
_ch11_reference  lab 11's reference answers, imported by ch11's checks when they run (not by the lab)
"""
