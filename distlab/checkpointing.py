"""Distributed checkpoints (DCP) of a training run: what a checkpoint holds, where the latest one is.

``torch.distributed.checkpoint`` has every rank write its own shards plus one metadata file; loading reads that
map, on the same or another number of ranks. A run folder holds one sub-folder per checkpoint, ``step_NNNNNN``
(the number of optimizer steps done); a checkpoint counts only once its ``.metadata`` exists, which DCP writes
last, so a job killed in the middle of a save leaves no half checkpoint behind that a restart would trust.
"""

from __future__ import annotations

from pathlib import Path

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

# The optimizer's state keyed by each parameter's name ("state.layers.0.attention.wq.weight.exp_avg",
# "param_groups.layers.0.attention.wq.weight.lr"), one entry a tensor or a number, as torchtitan saves it: a
# rank of another layout (fewer pipeline stages, another TP or dp degree) holds other parameters in another
# order and finds its own by name. (torch's nested form, param groups as lists of names, also resumed across the
# layouts of chapter 09 when tried with torch 2.13; the flat one leaves nothing to a rank's order.)
LAYOUT_FREE = StateDictOptions(flatten_optimizer_state_dict=True)


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

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=LAYOUT_FREE)
        state = {"model": model_state, "optimizer": optimizer_state, "step": self.step}
        if self.loader is not None:
            state["data"] = self.loader.state_dict()
        if self.rank is not None:
            state[f"rng_rank{self.rank}"] = runtime.rng_state()
        return state

    def load_state_dict(self, state):
        from distlab import runtime

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=LAYOUT_FREE)
        self.step = state["step"]
        if self.loader is not None:
            self.loader.load_state_dict(state["data"])
        if self.rank is not None:
            runtime.set_rng_state(state[f"rng_rank{self.rank}"])


class StagesOfRank(nn.Module):
    """The pipeline stages one rank holds, as one module whose parameter names are the whole model's.

    Each stage is a copy of the model with the parts it does not run deleted (``transformer_stage``): its names
    are already the whole model's ("layers.5.attention.wq.weight"). A rank with two stages (interleaved
    schedules) would otherwise need a ModuleList, whose names start with the stage's position on this rank
    ("1.layers.5..."), which another layout does not share. This module holds the same submodules (no copy),
    merged: what a checkpoint writes under a name, any layout reads under that name.
    """

    def __init__(self, stages):
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            for name, child in stage.named_children():
                if child is None:
                    continue
                if name == "layers":
                    self.layers.update(child)
                else:
                    setattr(self, name, child)


def checkpoint_dir(run_dir, step: int) -> Path:
    return Path(run_dir) / f"step_{step:06d}"


def step_of(path) -> int:
    """The number of optimizer steps a checkpoint folder ``step_NNNNNN`` holds."""
    return int(Path(path).name.removeprefix("step_"))


def checkpoints(run_dir) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first."""
    return sorted(p.parent for p in Path(run_dir).glob("step_*/.metadata"))


def latest_checkpoint(run_dir) -> Path | None:
    found = checkpoints(run_dir)
    return found[-1] if found else None


def records_every_rank(path, world_size: int, step: bool = True) -> bool:
    """Whether DCP reads back the checkpoint's metadata, the map it writes last, once every rank's part is written,
    and that map holds the step (unless ``step`` is false: a checkpoint told not to hold it, chapter 14's
    ``--checkpoint-holds``) and the generators of each of ``world_size`` ranks (a ``TrainingState`` saved with its
    ``rank``). A folder with no metadata, or with one cut short or foreign, does not."""
    import torch.distributed.checkpoint as dcp

    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception:  # missing, truncated or not DCP's: any failure to read it back means not a whole checkpoint
        return False
    every_rank = all(any(key.startswith(f"training.rng_rank{rank}.") for key in saved) for rank in range(world_size))
    return (not step or "training.step" in saved) and every_rank


def save(state: TrainingState, run_dir) -> Path:
    import torch.distributed.checkpoint as dcp

    path = checkpoint_dir(run_dir, state.step)
    dcp.save({"training": state}, checkpoint_id=str(path))
    return path


def load(state: TrainingState, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load({"training": state}, checkpoint_id=str(path))


def load_weights_only(model, path) -> None:
    """The mistake chapter 09 shows: the weights of a checkpoint, into a fresh optimizer (AdamW's moments zero,
    its step count 0), as a script that saves only ``model.state_dict()`` would resume. The loss moves on
    from the right place, then drifts from the run that never stopped."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    state = {"training": {"model": get_model_state_dict(model, options=LAYOUT_FREE)}}
    dcp.load(state, checkpoint_id=str(path))   # reads only the keys asked for
    set_model_state_dict(model, state["training"]["model"], options=LAYOUT_FREE)
