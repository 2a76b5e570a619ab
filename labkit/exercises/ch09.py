"""The checks of chapter 09's exercises (hybrid parallelism), with feedback that names the usual mistake.

* :func:`check_rank_grid`: the coordinates and the groups of a rank in a (pp, dp, tp) grid, in DeviceMesh's
  order (tp innermost). The expected answers are read off ``torch.arange(world).view(pp, dp, tp)``, which is
  how DeviceMesh lays ranks out; an answer in the copied HybridParallelContext order is recognised and named.
* :func:`check_layout_choice`: a ``dp x tp`` layout that fits a model's training state (16 bytes per
  parameter: weights, gradients *and* AdamW's state) plus the activations on N nodes of 4 x A100-40GB, or None.
* :func:`check_block_plan`: the tensor-parallel plan of one transformer block, ``{module: style}``.

Each raises :class:`labkit.exercises.checks.ExerciseIncomplete` while the exercise is a stub and
:class:`labkit.exercises.checks.ExerciseWrong` with a hint when the answer is wrong.
"""

from __future__ import annotations

from distlab import hybrid, sizing
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong, call_learner, learner_check

NOT_WRITTEN = "is not written yet."

# (pp, dp, tp) grids and ranks the grid exercise is checked on: small, lopsided, and the chapter's 16 ranks.
GRID_CASES = [((1, 2, 4), 5), ((2, 2, 4), 6), ((2, 2, 4), 13), ((2, 3, 2), 7), ((4, 2, 2), 9), ((1, 1, 4), 3)]

# (parameters, nodes, activation GiB per GPU) the layout exercise is checked on.
LAYOUT_CASES = [(7e9, 1, 8), (13e9, 1, 8), (13e9, 2, 8), (30e9, 4, 8), (70e9, 8, 6), (70e9, 8, 8), (1e9, 1, 30)]
GPUS_PER_NODE = 4
GPU_GIB = sizing.A100_40GB_BYTES / sizing.GIB

# The plan of one block: the linears that split their output features (heads, feed-forward columns) and
# those that split their input features and produce partial sums.
COLWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")


def _expected_grid(shape, rank):
    """Coordinates and groups of ``rank`` read off ``arange(world).view(pp, dp, tp)`` (DeviceMesh's layout)."""
    import torch

    pp, dp, tp = shape
    grid = torch.arange(pp * dp * tp).view(pp, dp, tp)
    p, d, t = (int(i) for i in (grid == rank).nonzero()[0])
    groups = {"pp": grid[:, d, t].tolist(), "dp": grid[p, :, t].tolist(), "tp": grid[p, d, :].tolist()}
    return (p, d, t), groups


@learner_check
def check_rank_grid(coordinates, groups) -> None:
    """``coordinates(rank, pp, dp, tp) -> (pp_rank, dp_rank, tp_rank)`` and ``groups(rank, pp, dp, tp) ->
    {"pp": [...], "dp": [...], "tp": [...]}`` (members in order of their coordinate), DeviceMesh's order."""
    for shape, rank in GRID_CASES:
        want_coordinates, want_groups = _expected_grid(shape, rank)
        got = call_learner("coordinates", coordinates, rank, *shape)
        if got is None:
            raise ExerciseIncomplete(f"`coordinates` {NOT_WRITTEN} It returned None.")
        if tuple(got) != want_coordinates:
            other = hybrid.grid_coordinates(rank, shape, "hybrid_context")
            hint = ("That is the HybridParallelContext order (dp innermost). DeviceMesh puts tp innermost: "
                    "rank = pp_rank * dp * tp + dp_rank * tp + tp_rank."
                    if tuple(got) == (other["pp"], other["dp"], other["tp"]) else
                    "Peel the innermost dimension off first: tp_rank = rank % tp, then dp, then pp.")
            raise ExerciseWrong(f"`coordinates({rank}, pp={shape[0]}, dp={shape[1]}, tp={shape[2]})` returned "
                                f"{tuple(got)}, not this rank's place in the grid. {hint}")
    for shape, rank in GRID_CASES:
        _, want_groups = _expected_grid(shape, rank)
        got = call_learner("groups", groups, rank, *shape)
        if got is None:
            raise ExerciseIncomplete(f"`groups` {NOT_WRITTEN} It returned None.")
        for dim in ("pp", "dp", "tp"):
            if dim not in got or list(got[dim]) != want_groups[dim]:
                mine = got.get(dim)
                how = ("the right ranks, in the wrong order: list them in order of their {dim} coordinate"
                       if mine is not None and sorted(mine) == want_groups[dim] else
                       "not this rank's {dim} group: the ranks whose other two coordinates equal this rank's, in "
                       "order of their {dim} coordinate").format(dim=dim)
                raise ExerciseWrong(
                    f"`groups({rank}, pp={shape[0]}, dp={shape[1]}, tp={shape[2]})['{dim}']` is {mine}: {how}.")
    print(f"Correct: coordinates and groups of {len(GRID_CASES)} ranks in DeviceMesh's (pp, dp, tp) order.")


def _fits(num_params: float, gpus: int, activation_gib: float) -> bool:
    return sizing.state_gib_per_gpu(num_params, gpus) + activation_gib <= GPU_GIB


@learner_check
def check_layout_choice(choose_layout) -> None:
    """``choose_layout(num_params, nodes, activation_gib) -> (dp, tp)`` that fits, or None when no layout of
    those nodes does: TP inside a node (tp <= 4), dp x tp = every GPU, state + activations <= 40 GiB."""
    for num_params, nodes, activation_gib in LAYOUT_CASES:
        gpus = nodes * GPUS_PER_NODE
        fits = _fits(num_params, gpus, activation_gib)
        state = sizing.state_gib_per_gpu(num_params, gpus)
        where = f"`choose_layout({num_params:.0e}, nodes={nodes}, activation_gib={activation_gib})`"
        got = call_learner("choose_layout", choose_layout, num_params, nodes, activation_gib)
        if not fits:
            if got is not None:
                # weights and gradients only: 2 + 2 bytes in bf16, or 4 + 4 as FSDP2's fp32 shards
                forgot = any(b * num_params / gpus / sizing.GIB + activation_gib <= GPU_GIB for b in (4, 8))
                hint = (" Did you count weights and gradients only? Each parameter holds its fp32 shard (4 bytes), "
                        "its fp32 gradient (4) and AdamW's two fp32 moments (8): 16 in all, 4 + 4 + 8, the "
                        "chapter's convention." if forgot else "")
                raise ExerciseWrong(f"{where} returned {got}, a layout that does not fit: the state alone is "
                                    f"{state:.1f} GiB per GPU on {gpus} GPUs, + {activation_gib} GiB of activations, "
                                    f"against {GPU_GIB:g} GiB.{hint}")
            continue
        if got is None:
            # the plausible slip: keeping page 9.3's 4 GiB reserve back, which this exercise does not
            reserved = state + activation_gib + sizing.Assumptions().reserve_bytes / sizing.GIB > GPU_GIB
            hint = (" Did you keep a reserve back? This exercise keeps none: the state and activation_gib share "
                    f"the whole {GPU_GIB:g} GiB." if reserved else "")
            raise ExerciseWrong(f"{where} returned None, but {state:.1f} + {activation_gib} GiB fits on each of "
                                f"{gpus} GPUs.{hint}")
        try:
            dp, tp = (int(x) for x in got)
        except (TypeError, ValueError):
            raise ExerciseWrong(f"{where} should return (dp, tp) or None, not {got!r}.") from None
        if dp * tp != gpus:
            raise ExerciseWrong(f"{where} returned dp={dp}, tp={tp}: dp x tp = {dp * tp}, but the {nodes} node(s) "
                                f"have {gpus} GPUs; use them all.")
        if not 1 <= tp <= GPUS_PER_NODE:
            raise ExerciseWrong(f"{where} returned tp={tp}: TP must stay inside a node of {GPUS_PER_NODE} GPUs "
                                f"(its all-reduces run every layer).")
    print(f"Correct: {len(LAYOUT_CASES)} layouts, each fitting exactly when 16 bytes per parameter do.")


@learner_check
def check_block_plan(block_plan) -> None:
    """``block_plan``: ``{name inside a block: ColwiseParallel() or RowwiseParallel()}`` for the seven linears."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if block_plan is None:
        raise ExerciseIncomplete(f"`block_plan` {NOT_WRITTEN} Write a dict from module names to styles.")
    if not isinstance(block_plan, dict):
        raise ExerciseWrong(f"`block_plan` should be a dict, not {type(block_plan).__name__}.")
    missing = [name for name in COLWISE + ROWWISE if name not in block_plan]
    if missing:
        raise ExerciseWrong(f"`block_plan` has no entry for {', '.join(missing)}: every linear of the block is "
                            f"split (names as in `model.layers['0']`, e.g. 'attention.wq').")
    # a wrong style is told what it would cost, not which style is right (with two styles, naming it is the answer)
    for name in COLWISE:
        if type(block_plan[name]) is not ColwiseParallel:
            raise ExerciseWrong(f"`{name}` as {type(block_plan[name]).__name__}(): its input, the block's activations, "
                                f"arrives whole on every rank; where should each rank's share of the heads (or of "
                                f"the feed-forward columns) come from, with no communication?")
    for name in ROWWISE:
        if type(block_plan[name]) is not RowwiseParallel:
            raise ExerciseWrong(f"`{name}` as {type(block_plan[name]).__name__}(): its input arrives already split "
                                f"by the layer before it (each rank holds its heads or its columns); how does the "
                                f"output come back whole from those parts?")
    print("Correct: q, k, v, w1, w3 column-wise; wo, w2 row-wise: two all-reduces per block forward.")
