"""The single device made fast: the switches of chapter 01's ladder, each a change of *how* a step runs, never of
*what* it computes (``scripts/01_single_device_baseline/train_baseline.py`` takes them as flags; the tests check
each one's losses against the plain run on the CPU).

* ``attention_backend``: which kernel ``F.scaled_dot_product_attention`` may use (``auto``: PyTorch picks: flash
  or cuDNN on a recent GPU in bf16; ``math``: the unfused reference, which writes the T x T score matrix);
* ``CheckpointedBlock``: activation checkpointing of one transformer block (save its input, recompute its forward
  in backward: memory for time);
* fused AdamW (``torch.optim.AdamW(fused=True)``) and ``torch.compile`` of each block are torch's own switches,
  set in the script where it builds the optimizer and the blocks.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

ATTENTION_BACKENDS = {
    "auto": None,   # PyTorch's own choice, in its order of preference (aten's cuda/sdp_utils.cpp, priority_order:
    # cuDNN first on sm90/sm100 with cuDNN above 9.15, then flash, efficient, math; torch._C._get_sdp_priority_order())
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def attention_backend(name: str):
    """A context in which ``scaled_dot_product_attention`` may use only the named kernel (it raises if that one
    cannot run the call: flash and cuDNN need CUDA and half precision, for example), or PyTorch's choice."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {name!r}: choose from {sorted(ATTENTION_BACKENDS)}")
    backend = ATTENTION_BACKENDS[name]
    return contextlib.nullcontext() if backend is None else sdpa_kernel(backend)


def attention_backend_problem(name: str, device_type: str, precision: str) -> str | None:
    """Why the named attention kernel cannot run here (None when it can): on a CPU PyTorch has the math kernel and
    its own flash kernel (any float dtype); on a GPU, flash and cuDNN take half precision only
    (torch/backends/cuda/__init__.py, ``can_use_flash_attention``, ``can_use_cudnn_attention``)."""
    if device_type == "cpu" and name in ("efficient", "cudnn"):
        return f"--attention {name} is a CUDA kernel: on a CPU choose auto, math or flash"
    if device_type == "cuda" and name in ("flash", "cudnn") and precision != "bf16":
        return f"--attention {name} needs half precision on a GPU: add --precision bf16"
    return None


class CheckpointedBlock(nn.Module):
    """A transformer block whose activations are not kept: forward saves only the block's inputs, and backward
    runs the block's forward again to rebuild what it needs (``torch.utils.checkpoint``, the non-reentrant
    implementation torch recommends). Same outputs and gradients; one more forward of compute per block.

    The block is kept as ``.block``, so its parameters' names gain one part (``layers.0.block.attention...``)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *inputs):
        return checkpoint(self.block, *inputs, use_reentrant=False)


def check_blocks_compiled(report) -> bool:
    """A script's check that ``torch.compile`` really compiled: compiled code runs eager, silently, when something
    turns dynamo off (a Python dispatch mode on the stack does: torch 2.13 ``_dynamo/convert_frame.py`` 2538-2557).
    Counts the graphs dynamo captured in this process; one serves every block that shares its code."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    return report.check("the blocks ran compiled (torch.compile captured a graph)", graphs >= 1, graphs, ">= 1")
