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
    """The model's and the optimizer's state (sharded where they are) and the number of steps done; with a
    ``loader`` (``distlab.data.ShuffledLoader``) its position in the data, and with a ``rank`` that rank's random
    number generators (``runtime.rng_state``: Python, numpy, torch, CUDA), under a key of its own, since each
    rank's differ. A run resumed from all of it continues exactly where it stopped; from the model and optimizer
    alone, it reads other samples and draws other random numbers (chapter 12's fault drill shows both)."""

    def __init__(self, model, optimizer, step: int = 0, loader=None, rank: int | None = None):
        self.model, self.optimizer, self.step = model, optimizer, step
        self.loader, self.rank = loader, rank

    def state_dict(self):
        from distlab import runtime

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, "step": self.step}
        if self.loader is not None:
            state["data"] = self.loader.state_dict()
        if self.rank is not None:
            state[f"rng_rank{self.rank}"] = runtime.rng_state()
        return state

    def load_state_dict(self, state):
        from distlab import runtime

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        self.step = state["step"]
        if self.loader is not None:
            self.loader.load_state_dict(state["data"])
        if self.rank is not None:
            runtime.set_rng_state(state[f"rng_rank{self.rank}"])


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
