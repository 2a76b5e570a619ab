"""Lab 05's exercise checks (fully sharded data parallelism): ZeRO-1 by hand (:func:`check_zero1_adamw_step`), the
ZeRO-2 state on 8 GPUs (:func:`check_value`), the fewest GPUs under ZeRO-3 (:func:`check_min_gpus`), and the weights
ZeRO-3 by hand saves at the a100 preset (:func:`check_zero3_saving`).
"""

from __future__ import annotations

import math

from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, learner_check, check_value
from labkit.exercises.checks import _default_compare, _not_done, _ok, _short  # the shared feedback helpers

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_value", "check_zero1_adamw_step", "check_min_gpus",
           "check_zero3_saving"]


# --------------------------------------------------------------------------------------------------
# Checks of one exercise each: they look at more than the final number, so a plausible wrong answer that
# happens to give it (an unsharded optimizer, loss statistics counted in the wrong phase) is still caught.
# tests/unit/test_exercises_reject_wrong.py feeds each one the wrong answers it must reject.
# --------------------------------------------------------------------------------------------------


@learner_check
def check_zero1_adamw_step(function, *, lr: float = 0.01, hint: str = "") -> None:
    """Notebook 05, exercise 1: ZeRO-1 by hand.

    ``function(weight, grad, world_size, lr)`` returns ``(new_weight, optimizers)``. The new weight must equal
    one AdamW step over the whole weight, and ``optimizers[r]`` (rank r's optimizer) must hold the moments of
    rank r's slice ``grad.chunk(world_size)[r]`` only: 1/N of the state, with the values of that slice. The
    moments are checked too because AdamW's first step is about ``lr * sign(grad)``: a gradient N times too
    big, or a slice stepped by the wrong rank's optimizer, would not show in the weights.
    """
    import torch

    generator = torch.Generator().manual_seed(0)
    for numel, world in ((12, 4), (10, 4), (7, 3)):  # 10 and 7 do not split evenly: the last slices are shorter
        weight, grad = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator)
        whole = torch.nn.Parameter(weight.clone())
        whole.grad = grad.clone()
        reference = torch.optim.AdamW([whole], lr=lr)
        reference.step()
        case = f"`zero1_adamw_step(weight of {numel}, grad, {world})`"
        try:
            result = function(weight.clone(), grad.clone(), world, lr)
        except NotImplementedError:
            raise _not_done("zero1_adamw_step", hint) from None
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ExerciseWrong(f"{case} should return (new_weight, optimizers), got {_short(result)}. {hint}".strip())
        new_weight, optimizers = result
        difference = _default_compare(new_weight, whole.detach())
        if difference:
            raise ExerciseWrong(f"{case}: the new weight {difference}. {hint}".strip())
        slices = reference.state[whole]["exp_avg"].chunk(world)
        if not isinstance(optimizers, (list, tuple)) or len(optimizers) != len(slices):
            raise ExerciseWrong(f"{case}: return one optimizer per rank ({len(slices)}), got "
                                f"{_short(optimizers)}. {hint}".strip())
        for rank, (optimizer, first_moment) in enumerate(zip(optimizers, slices)):
            states = list(getattr(optimizer, "state", {}).values())
            held = sum(t.numel() for state in states for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
            if held != 2 * first_moment.numel():
                raise ExerciseWrong(
                    f"{case}: rank {rank}'s optimizer holds {held} moment values; ZeRO-1 keeps only those of its "
                    f"slice, 2 x {first_moment.numel()} (1/N of one optimizer's 2 x {numel}). {hint}".strip())
            mine = torch.cat([state["exp_avg"].flatten() for state in states if "exp_avg" in state] or [torch.zeros(0)])
            difference = _default_compare(mine, first_moment)
            if difference:
                raise ExerciseWrong(f"{case}: rank {rank}'s first moment (exp_avg) {difference}: it should be "
                                    f"that of slice {rank} of the gradient. {hint}".strip())
    _ok("zero1_adamw_step: the weights equal one AdamW, and each rank holds the moments of its slice only (1/N)")


def smallest_world_size(num_params: float, stage: int, gpu_gib: float, reserve_gib: float) -> int:
    """The fewest GPUs (any count) whose ZeRO-``stage`` training state leaves ``reserve_gib`` of ``gpu_gib`` free."""
    from distlab import memory

    budget = (gpu_gib - reserve_gib) * memory.GIB
    return next(n for n in range(1, 1_000_000)
                if memory.zero_state_bytes(int(num_params), n, stage).total <= budget)


@learner_check
def check_min_gpus(name: str, value, *, num_params: float, stage: int, gpu_gib: float, reserve_gib: float,
                   hint: str = "") -> None:
    """Notebook 05, exercise 3: the fewest GPUs for a model under ZeRO, with memory kept for activations.

    The exercise's numbers are chosen so that the usual slips give answers different from the right one
    (the test shows it); when the value is one of them, the message says which.
    """
    if value is None or value is Ellipsis:
        raise _not_done(name, hint)
    right = smallest_world_size(num_params, stage, gpu_gib, reserve_gib)
    if value == right:
        _ok(f"{name} = {value}")
        return
    gb_per_gib = 2**30 / 1e9
    slips = [  # (what a slip gives, what the message says): two slips may give the same value
        (smallest_world_size(num_params, stage, gpu_gib, 0),
         f"that leaves nothing for activations: keep {reserve_gib:g} GiB of the {gpu_gib:g} free"),
        (smallest_world_size(num_params * gb_per_gib, stage, gpu_gib, reserve_gib),
         "that counts GB (1e9 bytes) against a budget in GiB (2^30 bytes): divide the bytes by 2**30"),
        (2 ** math.ceil(math.log2(right)), "that is a power of two, not the smallest number: ZeRO shards over any "
                                           "number of GPUs"),
    ]
    slip = " or ".join(message for slip_value, message in slips if slip_value == value) or (
        f"under ZeRO-{stage} each GPU holds the sharded state, 16 / N bytes per parameter at stage 3; find the "
        f"smallest N whose state fits in {gpu_gib:g} - {reserve_gib:g} GiB")
    raise ExerciseWrong(f"`{name}` = {value}: {slip}. {hint}".strip())


def zero3_weights_saved_gib(preset: str = "a100", world: int = 4, bytes_per_weight: int = 4,
                            largest_unit: str = "largest") -> float:
    """GiB of weights one GPU no longer holds at its peak under ZeRO-3 by hand, against ZeRO-2 (which keeps every
    weight): ZeRO-2's whole model, less ZeRO-3's slices (1/N) and its largest unit whole. The units are
    ``zero3_from_scratch.py``'s (the embedding, each block, the final norm with the head), counted on a model built
    on the meta device. ``largest_unit="block"`` gives the answer of a learner who takes a block for the largest."""
    import torch

    from distlab import models

    with torch.device("meta"):
        model = models.Transformer(models.preset(preset))
    count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    units = {"embedding": count(model.tok_embeddings), "block": count(model.layers["0"]),
             "head": count(model.norm, model.output)}
    whole = count(model)
    peak_unit = max(units.values()) if largest_unit == "largest" else units[largest_unit]
    return bytes_per_weight * (whole - whole / world - peak_unit) / 2**30


@learner_check
def check_zero3_saving(name: str, value, *, preset: str = "a100", world: int = 4, hint: str = "") -> None:
    """Notebook 05, exercise 2: the GiB of weights ZeRO-3 by hand saves on one GPU at its peak, against ZeRO-2.

    Names the usual slips: a block taken for the largest unit (at the a100 preset the head is larger), the
    gathered unit forgotten, bf16 weights where the sketch keeps fp32, GB where the answer is in GiB."""
    if value is None or value is Ellipsis:
        raise _not_done(name, hint)
    right = zero3_weights_saved_gib(preset, world)
    close = lambda a, b: math.isclose(float(a), b, rel_tol=1e-3)  # noqa: E731
    if close(value, right):
        _ok(f"{name} = {float(value):.3f} GiB: ZeRO-2's whole model, less the slices and the largest unit, the head")
        return
    slips = [
        (zero3_weights_saved_gib(preset, world, largest_unit="block"),
         "that takes a block for the largest unit; at this preset the head (the norm and a vocabulary-wide output "
         "layer) is larger"),
        (zero3_weights_saved_gib(preset, world) + 4 * _largest_unit_weights(preset) / 2**30,
         "that forgets the unit that is whole at the peak: a rank holds its slices and the unit being used"),
        (zero3_weights_saved_gib(preset, world, bytes_per_weight=2),
         "that counts 2 bytes a weight; zero3_from_scratch.py keeps fp32 weights, 4 bytes"),
        (right * 2**30 / 1e9, "that is in GB (10^9 bytes); the answer is in GiB (2^30 bytes)"),
    ]
    slip = " or ".join(message for slip_value, message in slips if close(value, slip_value)) or (
        "ZeRO-2 keeps every weight (4 B each); ZeRO-3's peak is its slices (1/N) plus the largest unit, whole")
    raise ExerciseWrong(f"`{name}` = {value}: {slip}. {hint}".strip())


def _largest_unit_weights(preset: str) -> int:
    """Weights of the largest of ``zero3_from_scratch.py``'s units (at a100 the head; at a100_large a block)."""
    import torch

    from distlab import models

    with torch.device("meta"):
        model = models.Transformer(models.preset(preset))
    count = lambda *modules: sum(p.numel() for m in modules for p in m.parameters())  # noqa: E731
    return max(count(model.tok_embeddings), count(model.layers["0"]), count(model.norm, model.output))
