"""Each chapter's pictures of its mechanisms, a module a chapter (``ch04.py``...), each with its own ``FIGURES``
(file name -> (draw function, size in inches)). ``coursetools.figures`` gathers them into its ``FIGURES``: ``make
figures`` draws them and ``tests/unit/test_figures.py`` checks them like every other figure. A drawing here is made
from a model of the mechanism (the algorithm run on labels or sizes), never from a measured run."""
