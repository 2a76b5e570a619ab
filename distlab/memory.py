"""Where training memory goes: predicted from formulas, measured from the tensors themselves.

Four consumers of memory in a training step:

* **parameters**, **gradients** (same shapes), **optimizer state** (AdamW: two fp32 moments per parameter,
  plus an fp32 master copy in mixed precision), which live for the whole run, and
* **activations** saved by the forward pass for the backward pass, which live from forward to backward.

Measured means read off real tensors (``ledger``; ``saved_activation_bytes``), so prediction = measurement
is a test, on a CPU as on a GPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
GIB = 1024**3


@dataclass(frozen=True)
class StateBytes:
    """Bytes of persistent training state on one device."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer, "total": self.total}


def training_state_bytes(num_params: int, precision: str = "fp32", optimizer: str = "adamw") -> StateBytes:
    """Unsharded training state.

    ``precision="fp32"``: 4 B params + 4 B grads + 8 B AdamW moments = 16 B/param.
    ``precision="mixed"`` (bf16 compute, ZeRO paper accounting): 2 B params + 2 B grads + 12 B optimizer
    (fp32 master weights 4 + two moments 8) = 16 B/param as well: mixed precision saves activations and
    time, not state.
    """
    moments = {"adamw": 8, "adam": 8, "sgd_momentum": 4, "sgd": 0}[optimizer]
    if precision == "fp32":
        return StateBytes(4 * num_params, 4 * num_params, moments * num_params)
    if precision == "mixed":
        return StateBytes(2 * num_params, 2 * num_params, (4 + moments) * num_params)
    raise ValueError(f"precision must be 'fp32' or 'mixed', not {precision!r}")


def zero_state_bytes(num_params: int, world_size: int, stage: int, precision: str = "mixed") -> StateBytes:
    """Per-device training state under ZeRO stage 0 (DDP), 1, 2 or 3 with ``world_size`` devices.

    Stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the parameters (FSDP).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, not {stage}")
    full = training_state_bytes(num_params, precision)
    n = world_size
    return StateBytes(full.params / n if stage >= 3 else full.params,
                      full.grads / n if stage >= 2 else full.grads,
                      full.optimizer / n if stage >= 1 else full.optimizer)


# --------------------------------------------------------------------------------------------------
# Measured
# --------------------------------------------------------------------------------------------------


def ledger(model, optimizer=None) -> StateBytes:
    """Bytes of this rank's parameters, gradients and optimizer state, read off the tensors.

    For sharded parameters (DTensor: FSDP2, tensor parallel) only the local shard counts.
    """
    from distlab.metrics import tensor_bytes

    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += [v for v in per_param.values() if hasattr(v, "untyped_storage") and v.dim() > 0]
    return StateBytes(tensor_bytes(params), tensor_bytes(grads), tensor_bytes(state))


def _local_shard(tensor):
    # A wrapper tensor (a DTensor of tensor parallelism or FSDP2, or the AsyncCollectiveTensor a collective
    # returns) holds no storage itself: the plain tensor inside it is what this rank's memory holds.
    # Unwrapped through __tensor_flatten__, not to_local(): no autograd op inside a saved-tensor hook.
    while hasattr(tensor, "__tensor_flatten__"):
        inner_names, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner_names[0])
    return tensor


def _storage_key(tensor) -> tuple:
    local = _local_shard(tensor)
    return (local.untyped_storage().data_ptr(), local.device)


@contextmanager
def saved_activation_bytes(exclude=()):
    """Measure the bytes autograd saves for backward inside the block: ``with ... as saved: loss = f(x)``.

    ``saved.bytes`` counts each distinct storage once and skips leaf tensors that require grad and any
    storage of ``exclude`` (pass ``model.parameters()``: weights saved for backward are not activations).
    """
    import torch

    class Saved:
        bytes = 0
        tensors = 0

    result = Saved()
    seen: set = {_storage_key(p) for p in exclude}

    def pack(tensor):
        storage = _local_shard(tensor).untyped_storage()
        key = _storage_key(tensor)
        is_leaf_weight = tensor.requires_grad and tensor.grad_fn is None
        if not is_leaf_weight:
            if key not in seen:
                seen.add(key)
                result.bytes += storage.nbytes()
                result.tensors += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
