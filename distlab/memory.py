"""Where training memory goes: predicted from formulas, measured from the tensors themselves.

Four consumers of memory in a training step:

* **parameters**, **gradients** (same shapes), **optimizer state** (AdamW: two fp32 moments per parameter,
  plus an fp32 master copy in mixed precision), which live for the whole run, and
* **activations** saved by the forward pass for the backward pass, which live from forward to backward.

Measured means read off real tensors (``ledger``; ``saved_activation_bytes``), so prediction = measurement
is a test, on a CPU as on a GPU.
"""

from __future__ import annotations

import math

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


def fsdp_padded_bytes(tensors, ways: int) -> int:
    """Bytes of ``tensors`` once FSDP2 has split each one's first dimension over ``ways`` ranks: its rows padded to
    ceil(rows / ways) a rank, so every shard is equal (what it all-gathers and reduce-scatters)."""
    total = 0
    for t in tensors:
        rows, rest = t.shape[0], t[0].numel() if t.dim() > 1 else 1
        total += math.ceil(rows / ways) * ways * rest * t.element_size()
    return total


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


# --------------------------------------------------------------------------------------------------
# Predicted activations of the shared transformer (chapter 01)
# --------------------------------------------------------------------------------------------------


def transformer_activation_breakdown(cfg, batch: int, seq_len: int | None = None, dtype_bytes: int = 4,
                                     include_loss: bool = True, checkpointed: bool = False) -> dict:
    """Bytes autograd saves for backward in one fp32 forward of ``distlab.models.Transformer``, by part.

    Counted tensor by tensor from what each operation keeps for its backward (per token, d = dim,
    F = ffn_hidden, H = heads, V = vocab), as ``saved_activation_bytes`` measures it on a CPU:

    * each RMSNorm keeps its input x, the 1/rms scale (1 number) and the normalised x before and after the
      weight (3 d + 1): the linear layers after it keep that last one, already counted;
    * attention keeps q and k after the rotation, v, the attention output and one log-sum-exp per head
      (4 d + H); the rotation keeps the two cos/sin tables (once, as they are buffers);
    * SwiGLU keeps w1 x, w3 x, silu(w1 x) and their product (4 F);
    * so one block keeps 2 (3 d + 1) + 4 d + H + 4 F = 10 d + 2 + H + 4 F numbers per token;
    * the final RMSNorm keeps 3 d + 1 and the loss keeps the log-softmax (V) per token, plus the int64
      targets (a copy, as flattening the (B, T) slice of the batch cannot be a view, except when B = 1),
      its 4-byte normaliser, and the int64 token ids (the (B, T+1) batch the inputs are a view of).

    ``include_loss=False`` predicts a forward without ``lm_loss``: the logits are then not saved by anything.
    ``checkpointed=True``: every block under activation checkpointing keeps only its input (d numbers per
    token) and recomputes the rest in backward. Under bf16 autocast (GPUs) the mix of dtypes differs; this formula is the fp32 one.
    """
    seq_len = seq_len or cfg.seq_len
    tokens = batch * seq_len
    d, hidden, heads = cfg.dim, cfg.ffn_hidden, cfg.n_heads
    per_block = (d if checkpointed else 10 * d + 2 + heads + 4 * hidden) * dtype_bytes * tokens
    parts = {
        "blocks": cfg.n_layers * per_block,
        "final norm": (3 * d + 1) * dtype_bytes * tokens,
        "rope tables": 2 * cfg.seq_len * (cfg.head_dim // 2) * 4,
        "token ids": batch * (seq_len + 1) * 8,
    }
    if include_loss:
        targets_copy = tokens * 8 if batch > 1 else 0
        parts["loss (log-softmax)"] = cfg.vocab_size * 4 * tokens + targets_copy + 4
    return parts


def transformer_activation_bytes(cfg, batch: int, seq_len: int | None = None, dtype_bytes: int = 4,
                                 include_loss: bool = True, checkpointed: bool = False) -> int:
    """Total of :func:`transformer_activation_breakdown`: equals ``saved_activation_bytes`` (fp32, CPU)."""
    return int(sum(transformer_activation_breakdown(cfg, batch, seq_len, dtype_bytes, include_loss,
                                                    checkpointed).values()))
