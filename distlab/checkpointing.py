"""Distributed checkpoints (DCP) of a training run: what a checkpoint holds, where the latest one is.

``torch.distributed.checkpoint`` has every rank write its own shards plus one metadata file; loading reads that
map, on the same or another number of ranks. A run folder holds one sub-folder per checkpoint, ``step_NNNNNN``
(the number of optimizer steps done); a checkpoint counts only once its ``.metadata`` exists, which DCP writes
last, so a job killed in the middle of a save leaves no half checkpoint behind that a restart would trust.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


class TrainingState(Stateful):
    """The model's and the optimizer's state (sharded where they are) and the number of steps done."""

    def __init__(self, model, optimizer, step: int = 0):
        self.model, self.optimizer, self.step = model, optimizer, step

    def state_dict(self):
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state, "step": self.step}

    def load_state_dict(self, state):
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.step = state["step"]


def checkpoint_dir(run_dir, step: int) -> Path:
    return Path(run_dir) / f"step_{step:06d}"


def checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first."""
    return sorted(p.parent for p in Path(run_dir).glob("step_*/.metadata"))


def latest_checkpoint(run_dir) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def save(state: TrainingState, run_dir) -> Path:
    import torch.distributed.checkpoint as dcp

    path = checkpoint_dir(run_dir, state.step)
    dcp.save({"training": state}, checkpoint_id=str(path))
    return path


def load(state: TrainingState, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load({"training": state}, checkpoint_id=str(path))
