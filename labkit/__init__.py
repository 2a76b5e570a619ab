"""labkit: what the labs use beside the library: the launcher a notebook calls, the widgets, the exercises' checks.

launch           run a script on N ranks from a notebook or a test, stream its output, return its metrics
forkrun          torchrun's job started by fork on CPU: imports once, seconds instead of tens (launch's fast path)
forkserver       a server that imported torch once and forks a forkrun per launch (make test, lab 14's many launches)
forkexec         a scheduler's rank (srun, mpiexec, torchrun) forked from that server: make test's Slurm and PBS tiers
widgets          ipywidgets explorers over pure, tested functions (02, 07)
planner_widgets  the planner's bars, tables and explorer (11)
mesh_view        a rank grid drawn on nodes x GPUs, each group coloured (09)
broken_runs      chapter 14's broken runs: each case's script, flags, symptom, cause and fix; run one, judge it (14)
diagnosis_table  chapter 14's diagnosis table and its generated lines, rendered from broken_runs (14)
diagnosis_sources the public reports each broken run comes from, quoted (14)
exercises        the checks each lab's exercises call: ``labkit.exercises.chNN`` for lab NN
"""
