"""Choosing a strategy (chapter 11): memory, communication, bubble and step time of a (pp, dp, cp, tp) layout,
and a search over every layout of a GPU count.

Inputs are three small dataclasses: a :class:`ModelSpec` (a named preset or your own sizes), a
:class:`Cluster` (GPUs per node, memory, dense peak, bandwidths) and :class:`Options` (ZeRO stage, FSDP
reshard, activation checkpointing, precision, sequence parallelism, pipeline schedule, micro-batch). A
:class:`Layout` says how many ways each dimension splits. :func:`evaluate` returns a :class:`Plan`: memory
per GPU by part, bytes each GPU sends per step per mesh dimension, the bubble, the estimated step time, MFU,
and whether it fits (and why not). :func:`search` evaluates every valid layout and ranks them.

Conventions (chapters/00_conventions.md), used everywhere here:

* memory in GiB (2^30 bytes): a "40 GB" A100 has 40 GiB; bandwidths in GB/s (10^9 bytes/s), one direction;
* peaks are dense (no sparsity): A100 bf16 312 TFLOP/s, H100 SXM 989 (from ``distlab.metrics.PEAK_FLOPS``);
* the bubble is quoted both ways: (P-1)/(V M) of the ideal time, and (P-1)/(V M + P-1) of the step.

Nothing here is new arithmetic where the course already has it: the training state is
``memory.zero_state_bytes``, the activations ``tensor_parallel.activation_bytes`` (the fp32 formula measured
equal on CPU ranks, scaled to bf16 as ``distlab.sizing`` does), the TP collectives
``tensor_parallel.tp_comm_formula``, the DP collectives ``comm.zero_step_bytes``, the pipeline sends
``hybrid_pipeline.pp_send_bytes``, the bubble ``schedules.bubble_fraction``, ring bytes
``comm.bytes_sent_per_rank``. The tests prove the result against measured runs (chapters 05 and 09), the
meta-device models, the chapter 07 simulator and chapter 09's sizing guide.

Everything a plan states about a real cluster is *derived* (a model of the hardware, not a measurement).

The package keeps one idea per file, so a reader finds the memory model without the search:

* ``spec``: the model, the cluster, the options and the layout, presets and JSON files, what makes a layout invalid;
* ``memory``: memory per GPU by part; ``communication``: bytes per mesh dimension and the links they cross;
* ``step_time``: :func:`evaluate` and its :class:`Plan` (bubble, overlap, step time, MFU);
* ``search``: every layout of a GPU count ranked; ``published``: published runs reproduced and checked;
* ``dry_run``: the layout built at its full world size on a fake process group; ``chapter_tables``: the tables
  chapter 11 pastes.
"""

from dataclasses import replace  # noqa: F401  (planner.replace: the widgets and tests vary a ModelSpec)

from distlab.planner.spec import *  # noqa: F401,F403
from distlab.planner.memory import *  # noqa: F401,F403
from distlab.planner.communication import *  # noqa: F401,F403
from distlab.planner.step_time import *  # noqa: F401,F403
from distlab.planner.search import *  # noqa: F401,F403
from distlab.planner.published import *  # noqa: F401,F403
from distlab.planner.chapter_tables import *  # noqa: F401,F403
