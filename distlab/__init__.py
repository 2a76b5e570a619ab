"""distlab: the shared toolkit of the course. One job per module; no chapter logic lives here.

runtime          join a job (torchrun, mpiexec, srun, alone); device, backend, seed, timeout, config errors
models           the MLP and the LLaMA-style transformer, presets tiny .. a100
data             deterministic synthetic data: the same global batch whatever the world size
metrics          the metrics file, checks, throughput, FLOPs, MFU, tolerances on CPU and GPU
memory           training-state and activation memory: formulas, and measured from the tensors
comm             ring cost model, bus bandwidth, measured bytes per collective, point-to-point pairing rules
tensor_parallel  the TP/SP plan of the shared transformer, its formulas, ring-attention maths
schedules        pipeline schedules as data, the simulator, bubble maths
gantt            ASCII and matplotlib Gantt charts of any timeline
hybrid           the (pp, dp, tp) rank grid in both rank orders; 2-D FSDP x TP formulas (chapter 09)
hybrid_pipeline  pipelines combined with DP/FSDP and TP: what must divide what, bytes per dimension (09)
sizing           chapter 09's sizing guide: LLaMA-style 1B-70B on 4 x A100-40GB nodes, derived
mesh_view        a rank grid drawn on nodes x GPUs, each group coloured (09)
domain           tiles of a grid, halo exchange as an autograd function, halo formulas (chapter 10)
planner          memory, communication, bubble and step time of a layout; the search over layouts (11)
planner_widgets  the planner's bars, tables and explorer (11)
moe              mixture of experts: router, experts, expert parallelism by all-to-all, capacity, balance (13)
checkpointing    distributed checkpoints (DCP) of a run: what one holds, where the latest is (05, 12)
hangs            a journal of every rank's calls and the diagnosis of a hang from it (12)
profiling        time per kind and communication overlap read from a torch.profiler trace (12)
launch           run a script on N ranks from a notebook or a test (forkrun: the fast CPU launcher)
forkrun          torchrun's job started by fork on CPU: imports once, seconds instead of tens
forkserver       make test's fork server: torch imported once per test process, a forkrun forked per launch
widgets          ipywidgets explorers over pure, tested functions
figures          the chapters' pictures, drawn from the library's own functions (make figures)
exercises        the checks that notebook exercises call
exercises_hybrid      ... of chapter 09's exercises (rank grid, layout, TP plan)
exercises_operations  ... of chapter 12's exercises (a profiler timeline, a hang's journals)
exercises_moe    ... of chapter 13's exercises (dispatch bytes, the EP degree, a dropless capacity)
student          the learner's copies of the notebooks (make student); the notebooks' normal form
demo_report      one HTML summary of a PBS job's runs, for an instructor (pbs/instructor_demo.pbs)
gpu_check        make gpu-check: every script on the GPUs present, one JSON summary and a table
site             make site: the course laid out as a Sphinx source folder (chapters, labs, scripts, jobs)
site_check       make site-check: the website read in headless Chromium (DevTools protocol)
lab_check        make lab-check: every lab and learner's copy run in JupyterLab in headless Chromium
"""

__version__ = "0.1.0"
