"""Where training memory goes: predicted from formulas, measured from the tensors themselves.

Four consumers of memory in a training step:

* **parameters**, **gradients** (same shapes), **optimizer state** (AdamW: two fp32 moments per parameter,
  plus an fp32 master copy in mixed precision), which live for the whole run, and
* **activations** saved by the forward pass for the backward pass, which live from forward to backward.

Measured means read off real tensors (``ledger``; ``saved_activation_bytes``), so prediction = measurement
is a test, on a CPU as on a GPU.

They are not all alive at once: the peak comes in one of two phases of a step, forward/backward or the optimizer
step (``predict_step_peak``), checked against the allocator's peak on a GPU and against the profiler's allocation
events on a CPU (``cpu_allocation_peaks``).
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


class StorageLedger:
    """The bytes of watched tensors' storages still alive, read off the storages themselves.

    ``watch(tensor)`` keeps a weak reference to the tensor's storage: torch keeps one Python object per storage for
    as long as any tensor (a view, a tensor autograd saved, a request in flight) points at it, so a storage counts
    until it is really freed, or resized to 0. ``measure(event)`` sums the storages alive, each once, and records
    it; ``peak`` is the largest sum. Chapter 05 measures ZeRO-3's gathered weights this way, chapter 08 the K and V
    blocks a ring holds. What is never watched (a copy made inside a function) is not counted.
    """

    def __init__(self):
        import weakref

        self._ref = weakref.ref
        self._alive: dict[int, object] = {}   # id of the storage object -> its weak reference
        self.events: list[dict] = []
        self.peak = 0

    def watch(self, *tensors) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self._alive[id(storage)] = self._ref(storage)

    def alive_bytes(self) -> int:
        self._alive = {key: ref for key, ref in self._alive.items() if ref() is not None}
        return sum(ref().nbytes() for ref in self._alive.values())

    def measure(self, event: str, **details) -> int:
        alive = self.alive_bytes()
        self.peak = max(self.peak, alive)
        self.events.append({"event": event, "bytes": alive, **details})
        return alive


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


# --------------------------------------------------------------------------------------------------
# The peak, phase by phase: what is alive together
# --------------------------------------------------------------------------------------------------
#
# Adding every consumer up overstates the peak: with ``zero_grad(set_to_none=True)`` the gradients are created in
# backward while the activations are freed, and the optimizer step runs after both phases are over. A step has
# two phases, and the peak is the larger of the two:
#
# * **forward/backward**, at the top of backward: the weights and the optimizer state (no gradient yet), every
#   saved activation, and the loss's two fp32 gradients of B x T x V numbers (:func:`loss_gradient_bytes`);
# * **optimizer step**: weights, gradients, optimizer state, and what the optimizer allocates while it runs.

# torch 2.13, torch/optim/adam.py:790 (``_multi_tensor_adam``, the foreach AdamW that CUDA takes by default:
# optim/optimizer.py:178-183 picks it when every parameter is a CUDA tensor, DTensors included,
# distributed/tensor/__init__.py:74): ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` is a new fp32
# tensor per parameter, alive until :794-799's ``_foreach_addcdiv_``; every other update is in place. The for-loop
# AdamW (the CPU's default) allocates its temporaries one parameter at a time.
FOREACH_ADAMW_TEMPORARY_BYTES_PER_PARAM = 4


def loss_gradient_bytes(batch: int, seq_len: int, vocab_size: int) -> int:
    """The fp32 gradients that backward holds at once while it differentiates ``lm_loss``: ``nll_loss``'s
    gradient with respect to the log-probabilities and ``log_softmax``'s with respect to the logits, B x T x V
    numbers each, 4 bytes a number (``lm_loss`` computes in fp32 under autocast too)."""
    return 2 * batch * seq_len * vocab_size * 4


@dataclass(frozen=True)
class PhasePeaks:
    """Predicted bytes alive at the peak of each phase of a training step, term by term."""

    phases: dict

    def total(self, phase: str) -> int:
        return int(sum(self.phases[phase].values()))

    @property
    def peak_phase(self) -> str:
        """The phase that holds the step's peak."""
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    def as_dict(self) -> dict:
        return {"phases": {name: {"terms": dict(terms), "total": self.total(name)} for name, terms in self.phases.items()},
                "peak_phase": self.peak_phase, "peak_bytes": self.peak}


FORWARD_BACKWARD, OPTIMIZER_STEP = "forward/backward", "optimizer step"


def peak_by_phase(state: StateBytes, activations: int, loss_gradients: int, optimizer_temporary: int = 0,
                  forward_backward_extra: dict | None = None, during_backward: dict | None = None) -> PhasePeaks:
    """The two phases of a step (after the first, once the optimizer state exists). Forward/backward peaks at the top
    of backward (the terms listed above), or, when the activations are few, at its end (weights, optimizer state and
    every gradient), or, given ``during_backward``, while a later part of backward runs (weights, optimizer state,
    the saved activations, counted whole, and those terms): whichever is largest, with its terms.

    ``state``: this device's weights, gradients and optimizer state (``ledger`` after a step, or the formulas);
    ``activations``: the bytes saved for backward (``saved_activation_bytes`` or the formula); ``loss_gradients``:
    :func:`loss_gradient_bytes`; ``optimizer_temporary``: what the optimizer step allocates
    (``FOREACH_ADAMW_TEMPORARY_BYTES_PER_PARAM`` x parameters for foreach AdamW); ``forward_backward_extra``: more
    terms alive at the top of backward (FSDP's root unit, gathered); ``during_backward``: what is alive while a block's
    backward runs, after the loss gradients are freed (FSDP's units: :func:`fsdp_unit_bytes`).
    """
    top_of_backward = {"weights": state.params, "optimizer state": state.optimizer, "saved activations": activations,
                       "loss gradients (fp32, 2 x B x T x V)": loss_gradients, **(forward_backward_extra or {})}
    # with few activations the phase peaks at its end instead: every gradient made, every activation freed
    end_of_backward = {"weights": state.params, "optimizer state": state.optimizer, "gradients": state.grads}
    candidates = [top_of_backward, end_of_backward]
    if during_backward:
        candidates.append({"weights": state.params, "optimizer state": state.optimizer, "saved activations": activations,
                           **during_backward})
    forward_backward = max(candidates, key=lambda terms: sum(terms.values()))
    step = {"weights": state.params, "gradients": state.grads, "optimizer state": state.optimizer,
            "optimizer temporaries": optimizer_temporary}
    return PhasePeaks({FORWARD_BACKWARD: forward_backward, OPTIMIZER_STEP: step})


# A measured peak (the CUDA allocator's max_memory_allocated) = the predicted peak within 2%, either way. On one H200
# (torch 2.11) the phase model was 0.2% and 0.1% off (BENCHMARKS.md: 29.71 against 29.78 GiB, 62.73 against 62.80);
# allocator rounding and kernel workspaces are tens of MiB. The smallest term at the a100 preset, the loss gradients
# (0.98 GiB, 3.3% of the baseline's peak), is over the margin: a term left out fails the check.
PEAK_MARGIN = 0.02
# On a CPU, against the profiler's allocation events (tests/unit/test_memory.py): measured 0.02% to 0.3% off in both
# phases of its two runs (what the model leaves out: a loss, a step counter, small buffers), where the smallest term
# it checks is 12% of its phase.
CPU_PEAK_MARGIN = 0.01


def within_margin(predicted: int, measured: int, margin: float = PEAK_MARGIN) -> bool:
    """Measured = predicted within a relative ``margin`` (0.02: 2% of the prediction), either way."""
    return abs(measured - predicted) <= margin * predicted


# max_memory_allocated also counts what no tensor of the model holds, and it does not shrink with the model: cuBLAS's
# workspaces come from the caching allocator (8,519,680 B still allocated after one 1 x 1 Linear on an A10G,
# pytorch/pytorch#95668; 32 MiB a workspace on Hopper, pytorch/pytorch#120925), and kernels' scratch. Both H200 runs
# measured 68 and 74 MiB over the prediction, at 30 GiB as at 63 (tests/unit/test_memory.py recomputes them): a fixed
# cost, over the 2% of any peak under 3.6 GiB (the tiny preset predicts 4.7 MiB). So the GPU check holds a prediction
# of PEAK_CHECK_MIN_BYTES or more, where that cost is 1.2% at most; a smaller run reports both figures, checks nothing.
PEAK_CHECK_MIN_BYTES = 6 * GIB


def check_allocator_peak(report, predicted: int, measured: int, say=print) -> bool | None:
    """A script's GPU check: ``measured`` (max_memory_allocated) = ``predicted`` (the phase model's peak) within
    ``PEAK_MARGIN``, recorded in ``report``, where the prediction is ``PEAK_CHECK_MIN_BYTES`` or more. Below it,
    one line (``say``) gives both figures and why nothing is checked, and the answer is None."""
    if predicted < PEAK_CHECK_MIN_BYTES:
        say(f"peak memory: max_memory_allocated {measured / GIB:.3f} GiB, predicted {predicted / GIB:.3f} GiB; not "
            f"checked under {PEAK_CHECK_MIN_BYTES / GIB:.0f} GiB, where the allocator's fixed costs (cuBLAS "
            f"workspaces: about 70 MiB on an H200) exceed the {PEAK_MARGIN:.0%} margin")
        return None
    return report.check(f"peak memory (max_memory_allocated) = predicted by phase within {PEAK_MARGIN:.0%}",
                        within_margin(predicted, measured), round(measured / predicted, 4), f"1 +- {PEAK_MARGIN}")


@contextmanager
def cpu_allocation_peaks():
    """Measure the peak of the bytes allocated on the CPU inside each named phase, from the profiler's allocation
    events (``torch.profiler`` with ``profile_memory=True``): ``with cpu_allocation_peaks() as peaks:`` then
    ``with peaks.phase("optimizer step"): ...``. After the block, ``peaks.by_phase[name]`` is the most bytes
    alive at once inside that phase (the largest over its repetitions), counting every allocation made since the
    block began; build the model inside it, so its weights are counted too.
    """
    from torch.autograd import DeviceType
    from torch.autograd.profiler import profile, record_function

    class Peaks:
        by_phase: dict = {}
        overall = 0

        @staticmethod
        def phase(name):
            return record_function(f"phase: {name}")

    result = Peaks()
    result.by_phase = {}
    # torch.autograd.profiler.profile, which torch.profiler.profile wraps: the wrapper's start imports torch._inductor
    # (torch/profiler/profiler.py:295, 3 s on a loaded 2-core machine) for a CUDA-graph setting a CPU run never reads
    with profile(profile_memory=True, record_shapes=False) as prof:
        yield result
    # the events torch's own profiler tables read (torch 2.13, autograd/profiler.py:624-637: "[memory]" records,
    # nbytes() > 0 an allocation, < 0 a free, CPU memory when device_type() is CPU, MKLDNN or IDEEP)
    events = prof.kineto_results.events()
    ranges = [(e.name()[len("phase: "):], e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
              if e.name().startswith("phase: ")]
    cpu = (DeviceType.CPU, DeviceType.MKLDNN, DeviceType.IDEEP)
    allocations = sorted((e.start_ns(), e.nbytes()) for e in events
                         if e.name() == "[memory]" and e.device_type() in cpu)
    alive = 0
    for when, nbytes in allocations:
        alive += nbytes
        result.overall = max(result.overall, alive)
        for name, start, end in ranges:
            if start <= when <= end:
                result.by_phase[name] = max(result.by_phase.get(name, 0), alive)


ROOT_GATHERED = "root unit, gathered for backward"


def fsdp_unit_bytes(vocab_size: int, dim: int, n_layers: int, num_params: int, param_bytes: int,
                    reduce_bytes: int = 4) -> dict:
    """What FSDP2 holds beyond the shards while a block's backward runs, for ``distlab.models.Transformer`` sharded a
    unit per block plus the root (``train_fsdp.apply_fsdp``), from torch 2.13's code (fsdp/_fully_shard/):

    * the root unit (embedding, final norm, output), gathered through backward: its output's hook gathers it at
      the top of backward (_fsdp_state.py:452) and its post-backward reshards it only in the final callback. Left to
      its default the root is not even resharded after forward (_fsdp_state.py:203-207); train_fsdp's explicit
      ``reshard_after_forward=True`` reshards it there, which changes the bytes sent, not this peak;
    * the root's unsharded gradients (the output layer's and the final norm's, ``param_bytes`` each), made at the top
      of backward and reduce-scattered only at its end: the root's inputs, token ids, need no gradient, so its
      post-backward runs in the final callback (_fsdp_state.py:411-415);
    * the block whose backward runs: its gathered weights and its unsharded gradients (``param_bytes`` each);
    * the next block's all-gather output (_fsdp_collectives.py:351), prefetched while this one computes;
    * the previous block's reduce-scatter input, in ``reduce_bytes`` (fp32 under mixed precision:
      _fsdp_collectives.py:597), kept until this block's post-backward (_fsdp_param_group.py:647-658: one input
      buffer in flight by default); each block copies its gradients in only after resharding its weights (:637-638).

    About 10 bytes a parameter of a block under bf16 mixed precision (2 + 2 + 2 + 4), 16 in fp32, besides the root's.
    The root's gathered weights are also alive at the top of backward (``ROOT_GATHERED``); the rest comes after the
    loss gradients are freed. An estimate: the course has measured FSDP's peak on one GPU only, where the optimizer
    step holds it.
    """
    root = 2 * vocab_size * dim + dim
    block = (num_params - root) // n_layers
    return {ROOT_GATHERED: root * param_bytes,
            "the root's unsharded gradients (output, final norm)": (vocab_size * dim + dim) * param_bytes,
            "a block's gathered weights": block * param_bytes,
            "the next block's all-gather output (prefetched)": block * param_bytes,
            "the block's unsharded gradients": block * param_bytes,
            "the previous block's reduce-scatter input": block * reduce_bytes}


def predict_step_peak(state: StateBytes, activations: int, rows: int, seq_len: int, vocab_size: int,
                      foreach: bool = True, fsdp_units: dict | None = None) -> PhasePeaks:
    """The peak of a training step of the course's transformer, by phase, on one device: ``state`` (this device's
    fp32 weights, gradients and AdamW moments), ``activations`` (saved for backward), ``rows`` sequences of
    ``seq_len`` tokens on this device; ``foreach``: AdamW's foreach path (CUDA's default; the CPU's is the for-loop,
    whose temporaries are one parameter's and left out); ``fsdp_units``: :func:`fsdp_unit_bytes` under FSDP2."""
    temporary = FOREACH_ADAMW_TEMPORARY_BYTES_PER_PARAM * (state.params // 4) if foreach else 0  # fp32 weights
    top_extra = {ROOT_GATHERED: fsdp_units[ROOT_GATHERED]} if fsdp_units else None
    return peak_by_phase(state, activations, loss_gradient_bytes(rows, seq_len, vocab_size), temporary, top_extra,
                         fsdp_units)
