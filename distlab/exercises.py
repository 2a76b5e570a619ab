"""Checks that a notebook's exercise cells call, with feedback a learner can act on.

An exercise cell holds the solution between ``### BEGIN SOLUTION`` and ``### END SOLUTION``;
``make student`` (``python -m distlab.student``) replaces it with a stub: a function body becomes
``raise NotImplementedError``, a top-level assignment ``name = ...`` becomes ``name = None``. The check cell
that follows (tagged ``check``) calls a function of this module, which passes with a short confirmation or
says what to do:

* a wrong answer raises :class:`ExerciseWrong`, everywhere: the cell fails, and so does Run All at that cell and
  the full notebooks under test (nbval);
* an exercise not written yet (still the stub) is :class:`ExerciseIncomplete`. In a Jupyter notebook the check
  prints that it is not written yet and returns, so Run All goes on and a learner who answered exercise 2 first
  sees its check; elsewhere (a script, the unit tests) it raises. ``DISTLAB_INCOMPLETE_EXERCISE=raise`` (or
  ``show``) decides it either way.

In Jupyter an exercise's failure is shown as its message, without a traceback.
"""

from __future__ import annotations

import functools
import math
import os


class ExerciseError(AssertionError):
    """Base of the exercise failures: shown in Jupyter as its message alone."""

    def _render_traceback_(self):  # IPython hook: no traceback wall for a learner
        return [f"{type(self).__name__}: {self}"]


class ExerciseIncomplete(ExerciseError):
    """The exercise has not been written yet (still the stub)."""


class ExerciseWrong(ExerciseError):
    """The exercise runs but gives the wrong answer."""


def _in_jupyter() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def incomplete_is_shown() -> bool:
    """Whether an unwritten exercise is reported and passed over (True) or raised (False): see the module's doc."""
    choice = os.environ.get("DISTLAB_INCOMPLETE_EXERCISE", "")
    return choice == "show" or (choice != "raise" and _in_jupyter())


def learner_check(check):
    """A check function as a learner's notebook runs it: True when the answer is right; an unwritten exercise says
    so and returns False, letting the notebook run on (:func:`incomplete_is_shown`), so a cell that goes on to use
    the answer writes ``if exercises.check_...(...):``; a wrong answer still raises."""
    @functools.wraps(check)
    def run(*args, **kwargs):
        try:
            check(*args, **kwargs)
        except ExerciseIncomplete as missing:
            if not incomplete_is_shown():
                raise
            print(f"Not written yet: {missing} (the rest of the notebook runs on; come back to this one)")
            return False
        return True
    return run


def _ok(message: str) -> None:
    print(f"Correct: {message}")


def _not_done(name: str, hint: str) -> ExerciseIncomplete:
    return ExerciseIncomplete(f"`{name}` is not written yet. {hint}".strip())


@learner_check
def check_value(name: str, value, expected, *, rtol: float = 1e-6, atol: float = 0.0, hint: str = "") -> None:
    """A number (or sequence of numbers) the learner computed, against the expected one."""
    if value is None or value is Ellipsis:
        raise _not_done(name, hint)
    try:
        values = [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
        targets = [float(e) for e in expected] if isinstance(expected, (list, tuple)) else [float(expected)]
    except (TypeError, ValueError):
        raise ExerciseWrong(f"`{name}` should be a number, got {type(value).__name__}. {hint}".strip()) from None
    if len(values) != len(targets):
        raise ExerciseWrong(f"`{name}` should have {len(targets)} values, got {len(values)}. {hint}".strip())
    for got, want in zip(values, targets):
        if not math.isclose(got, want, rel_tol=rtol, abs_tol=atol):
            raise ExerciseWrong(f"`{name}` = {got:,.6g}, expected {want:,.6g}. {hint}".strip())
    _ok(f"{name} = {value}")


@learner_check
def check_tensor(name: str, value, expected, *, atol: float = 1e-6, rtol: float = 1e-5, hint: str = "") -> None:
    """A tensor the learner produced, against the reference tensor."""
    import torch

    if value is None or value is Ellipsis:
        raise _not_done(name, hint)
    if not isinstance(value, torch.Tensor):
        raise ExerciseWrong(f"`{name}` should be a torch.Tensor, got {type(value).__name__}. {hint}".strip())
    if value.shape != expected.shape:
        raise ExerciseWrong(f"`{name}` has shape {tuple(value.shape)}, expected {tuple(expected.shape)}. "
                            f"{hint}".strip())
    if not torch.allclose(value.detach().double(), expected.detach().double(), atol=atol, rtol=rtol):
        diff = (value.detach().double() - expected.detach().double()).abs().max().item()
        raise ExerciseWrong(f"`{name}` differs from the reference by up to {diff:.3g} (tolerance {atol:g}). "
                            f"{hint}".strip())
    _ok(f"{name} matches the reference (shape {tuple(value.shape)})")


@learner_check
def check_function(name: str, function, cases, *, compare=None, hint: str = "") -> None:
    """Call the learner's ``function`` on each ``(args, expected)`` case.

    ``compare(got, expected)`` returns None when equal or a string saying how they differ; the default
    compares numbers and tensors closely and anything else with ``==``.
    """
    compare = compare or _default_compare
    for args, expected in cases:
        args = args if isinstance(args, tuple) else (args,)
        try:
            got = function(*args)
        except NotImplementedError:
            raise _not_done(name, hint) from None
        difference = compare(got, expected)
        if difference:
            shown = ", ".join(_short(a) for a in args)
            raise ExerciseWrong(f"`{name}({shown})`: {difference}. {hint}".strip())
    _ok(f"{name} passed {len(cases)} case(s)")


@learner_check
def check_true(name: str, condition, message: str, *, hint: str = "", why: str = "") -> None:
    """A property the learner's work must have, with ``message`` explaining what is wrong otherwise; ``why``
    says, when it holds, why the answer is right (feedback that teaches, not just "correct")."""
    if condition is None:
        raise _not_done(name, hint)
    if not condition:
        raise ExerciseWrong(f"{message} {hint}".strip())
    _ok(f"{name}: {why}" if why else name)


@learner_check
def check_run(name: str, result, *, hint: str = "") -> None:
    """A script run launched from the notebook (a distlab.launch result): every check in its metrics passed."""
    if result is None:
        raise _not_done(name, hint)
    checks = (result.metrics or {}).get("checks", [])
    failed = [c["name"] for c in checks if not c["passed"]]
    if not checks:
        raise ExerciseWrong(f"`{name}`: the run wrote no checks. {hint}".strip())
    if failed:
        raise ExerciseWrong(f"`{name}`: these checks failed: {', '.join(failed)}. {hint}".strip())
    _ok(f"{name}: all {len(checks)} checks of the run passed")


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


@learner_check
def check_parallel_linears(column_parallel_linear, row_parallel_linear, *, ranks: int = 4, hint: str = "") -> None:
    """Notebook 06, exercise 1: the column- and row-parallel linears, forward and weight gradients.

    ``column_parallel_linear(x, weight_shards)`` returns each rank's output columns; ``row_parallel_linear(
    x_shards, weight_shards)`` the summed output. Both are compared with ``x @ W^T`` and, after a backward
    of ``sum(out * upstream)``, each rank's weight gradient with its slice of ``upstream^T x``. Shapes are
    checked before the backward, so a wrong one is reported as such rather than as an error inside it.
    """
    import torch

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 12, generator=generator)           # nn.Linear layout: (out, in)
    x, upstream = torch.randn(6, 12, generator=generator), torch.randn(6, 8, generator=generator)
    expected_out, expected_grad = x @ weight.T, upstream.T @ x  # d sum(out * upstream) / dW = upstream^T x
    for kind, function, split_dim in (("column", column_parallel_linear, 0), ("row", row_parallel_linear, 1)):
        name = f"{kind}_parallel_linear"
        shards = [w.clone().requires_grad_() for w in weight.chunk(ranks, dim=split_dim)]
        try:
            if kind == "column":
                outputs = function(x, shards)
                shapes = [tuple(o.shape) if isinstance(o, torch.Tensor) else None for o in outputs] \
                    if isinstance(outputs, (list, tuple)) else None
                if shapes != [(6, 8 // ranks)] * ranks:
                    raise ExerciseWrong(f"`{name}` should return a list of {ranks} tensors of shape "
                                        f"{(6, 8 // ranks)} (one per rank), got {_short(shapes or outputs)}. "
                                        f"{hint}".strip())
                out = torch.cat(list(outputs), dim=-1)
            else:
                out = function(list(x.chunk(ranks, dim=-1)), shards)
                if not isinstance(out, torch.Tensor) or out.shape != expected_out.shape:
                    raise ExerciseWrong(f"`{name}` should return the full output, a tensor of shape "
                                        f"{tuple(expected_out.shape)}, got {_short(getattr(out, 'shape', out))}. "
                                        f"{hint}".strip())
        except NotImplementedError:
            raise _not_done(name, hint) from None
        difference = _default_compare(out.detach(), expected_out)
        if difference:
            raise ExerciseWrong(f"`{name}`: the output {difference}. {hint}".strip())
        if out.requires_grad:
            (out * upstream).sum().backward()
        if any(s.grad is None for s in shards):
            raise ExerciseWrong(f"`{name}`: no gradient reached the weight shards: keep them in the graph "
                                f"(no .detach(), no torch.no_grad()). {hint}".strip())
        difference = _default_compare(torch.cat([s.grad for s in shards], dim=split_dim), expected_grad)
        if difference:
            raise ExerciseWrong(f"`{name}`: the weight gradients {difference}. {hint}".strip())
    _ok("column_parallel_linear and row_parallel_linear: outputs and weight gradients equal nn.Linear's")


def smallest_world_size(num_params: float, stage: int, gpu_gib: float, reserve_gib: float) -> int:
    """The fewest GPUs (any count) whose ZeRO-``stage`` training state leaves ``reserve_gib`` of ``gpu_gib`` free."""
    from distlab import memory

    budget = (gpu_gib - reserve_gib) * memory.GIB
    return next(n for n in range(1, 1_000_000)
                if memory.zero_state_bytes(int(num_params), n, stage).total <= budget)


@learner_check
def check_min_gpus(name: str, value, *, num_params: float, stage: int, gpu_gib: float, reserve_gib: float,
                   hint: str = "") -> None:
    """Notebook 05, exercise 2: the fewest GPUs for a model under ZeRO, with memory kept for activations.

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


@learner_check
def check_bytes_per_phase(name: str, predicted: dict, comm_rows, *, hint: str = "") -> None:
    """Notebook 06, exercise 2: the payload bytes of one step, phase by phase, against the measured ledger.

    ``predicted`` is ``{phase: bytes}``; ``comm_rows`` the run's ``metrics["comm"]`` (rows with ``phase`` and
    ``measured_bytes``). Each phase is compared, not only the total: the loss statistics counted in backward,
    or the embedding's all-reduce counted twice and the output's forgotten, give the right total.
    """
    if predicted is None or any(value is None or value is Ellipsis for value in dict(predicted).values()):
        raise _not_done(name, hint)
    measured: dict[str, int] = {}
    for row in comm_rows:
        measured[row["phase"]] = measured.get(row["phase"], 0) + row["measured_bytes"]
    if set(predicted) != set(measured):
        raise ExerciseWrong(f"`{name}` should give one number per phase, {sorted(measured)}; got "
                            f"{sorted(predicted)}. {hint}".strip())
    wrong = [f"{phase}: predicted {float(predicted[phase]):,.0f} B, measured {measured[phase]:,} B"
             for phase in measured if not math.isclose(float(predicted[phase]), measured[phase], rel_tol=1e-9)]
    if wrong:
        raise ExerciseWrong(f"`{name}`: " + "; ".join(wrong) + f". {hint}".strip())
    _ok(f"{name}: " + ", ".join(f"{phase} {measured[phase]:,} B" for phase in measured) + " (measured)")


def _block_attention(q, k, v, query_positions, key_positions, causal: bool):
    """Attention of q over one block of keys, and its log-sum-exp; a query that sees no key of the block
    (causal, all its keys in the future) gets out = 0 and lse = -inf, as FlashAttention returns."""
    import torch

    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(key_positions[None, :] > query_positions[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v
    return out, lse


@learner_check
def check_merge_attention_blocks(merge, *, hint: str = "") -> None:
    """Notebook 08: the online-softmax merge, block by block against full softmax attention.

    Without a mask: keys split in two and three blocks. With a causal mask: a query sees no key of a block
    in its future, so that block's lse is -inf for it, and merged in reverse order (a ring can deliver the
    blocks in any order) a query can have seen no key on either side yet: its out must stay 0 and its lse
    -inf, not nan. The merged lse is compared too: the next merge needs it.
    """
    import torch

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, length, 8, generator=generator) for length in (24, 24, 24))
    positions = torch.arange(24)
    cases = [("no mask, keys cut at 10", [10], False, False), ("no mask, keys cut at 4 and 17", [4, 17], False, False),
             ("causal, keys cut at 8 and 16", [8, 16], True, False),
             ("causal, keys cut at 8 and 16, merged last block first", [8, 16], True, True)]
    for label, cuts, causal, reverse in cases:
        full_out, full_lse = _block_attention(q, k, v, positions, positions, causal)
        edges = [0, *cuts, 24]
        blocks = [_block_attention(q, k[..., a:b, :], v[..., a:b, :], positions, positions[a:b], causal)
                  for a, b in zip(edges, edges[1:])]
        blocks = blocks[::-1] if reverse else blocks
        out, lse = blocks[0]
        try:
            for block_out, block_lse in blocks[1:]:
                out, lse = merge(out, lse, block_out, block_lse)
        except NotImplementedError:
            raise _not_done("merge_attention_blocks", hint) from None
        for what, got, expected in (("out", out, full_out), ("lse", lse, full_lse)):
            if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
                raise ExerciseWrong(f"`merge_attention_blocks`, {label}: {what} should be a tensor of shape "
                                    f"{tuple(expected.shape)}, got {_short(got)}. {hint}".strip())
            if torch.isnan(got).any():
                raise ExerciseWrong(f"`merge_attention_blocks`, {label}: {what} has nan: a query that has seen no "
                                    f"key yet has lse -inf on both sides, and exp(-inf - (-inf)) is nan; keep its "
                                    f"out 0 and lse -inf. {hint}".strip())
            if not torch.allclose(got.double(), expected.double(), atol=1e-5, rtol=1e-5):
                worst = (got.double() - expected.double()).abs().nan_to_num(float("inf")).max().item()
                raise ExerciseWrong(f"`merge_attention_blocks`, {label}: {what} differs from full attention by up "
                                    f"to {worst:.3g}. {hint}".strip())
    _ok(f"merge_attention_blocks passed {len(cases)} cases (causal ones with fully masked rows included)")


def _default_compare(got, expected) -> str | None:
    try:
        import torch

        if isinstance(expected, torch.Tensor):
            if not isinstance(got, torch.Tensor):
                return f"returned {type(got).__name__}, expected a tensor"
            if got.shape != expected.shape:
                return f"returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
            if not torch.allclose(got.double(), expected.double(), atol=1e-6, rtol=1e-5):
                return f"differs from the reference by up to {(got.double() - expected.double()).abs().max():.3g}"
            return None
    except ImportError:
        pass
    if isinstance(expected, float) and isinstance(got, (int, float)):
        return None if math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12) else f"returned {got}, expected {expected}"
    return None if got == expected else f"returned {_short(got)}, expected {_short(expected)}"


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
