"""distlab: the library the chapters teach and the scripts import. Each module is one mechanism, named after it;
the chapter that teaches it is in brackets. What the labs use lives in ``labkit``, what builds and checks the
course in ``coursetools``: neither is needed to read or run a script.

Every script stands on these:
runtime          join a job (torchrun, mpiexec, srun, alone); device, backend, seed, timeout, config errors (03, 12)
models           the MLP and the LLaMA-style transformer, presets tiny .. a100 (01)
data             deterministic synthetic data: the same global batch whatever the world size (01, 04)
metrics          the metrics file, checks, throughput, FLOPs, MFU, tolerances on CPU and GPU (01)
memory           training-state and activation memory: formulas, and measured from the tensors (01, 02, 05)
speed            the single-GPU ladder's switches: attention kernel, activation checkpointing of a block (01)

Communication and data parallelism:
comm             ring cost model, bus bandwidth, measured bytes per collective, point-to-point pairing rules (03-06)

Model parallelism:
tensor_parallel  the TP/SP plan of the shared transformer, its formulas, ring-attention maths (06, 08)
context_parallel all-gather CP, Ulysses and torch's own context-parallel attention; bytes and ring timing (08)
schedules        pipeline schedules as data, the simulator, bubble maths (07)
gantt            ASCII and matplotlib Gantt charts of any timeline, simulated or measured (07, 09, 12)
hybrid           the (pp, dp, tp) rank grid in both rank orders; 2-D FSDP x TP formulas (09)
hybrid_pipeline  pipelines combined with DP/FSDP and TP: what must divide what, bytes per dimension (09)
domain           tiles of a grid, halo exchange as an autograd function, halo formulas (10)
moe              mixture of experts: router, experts, expert parallelism by all-to-all, capacity, balance (13)
moe_reference    the same layer written apart, one token at a time: what chapter 13's scripts check moe against (13)

Planning:
sizing           chapter 09's sizing guide: LLaMA-style 1B-70B on 4 x A100-40GB nodes, derived (09)
planner          memory, communication, bubble and step time of a layout; the search over layouts (11, 13)

Operations:
checkpointing    distributed checkpoints (DCP) of a run: what one holds, where the latest is (05, 12)
hangs            a journal of every rank's calls and the diagnosis of a hang from it (12)
profiling        time per kind and communication overlap read from a torch.profiler trace (12)
"""

__version__ = "0.1.0"
