"""distlab: the shared toolkit of the course. One job per module; no chapter logic lives here.

runtime   join a job (torchrun, mpiexec, srun, alone); device, backend, seed, timeout, config errors
models    the MLP and the LLaMA-style transformer, presets tiny .. a100
data      deterministic synthetic data: the same global batch whatever the world size
metrics   the metrics file, checks, throughput, FLOPs, MFU
memory    training-state and activation memory: formulas, and measured from the tensors
comm      ring cost model, bus bandwidth, measured bytes per collective
tensor_parallel  the TP/SP plan of the shared transformer, its formulas, ring-attention maths
schedules pipeline schedules as data, the simulator, bubble maths
gantt     ASCII and matplotlib Gantt charts of any timeline
launch    run a script on N ranks from a notebook or a test (forkrun: the fast CPU launcher)
widgets   ipywidgets explorers over pure, tested functions
exercises the checks that notebook exercises call
student   the learner's copies of the notebooks (make student)
"""

__version__ = "0.1.0"
