"""Chapter 09's exercise checks (labkit.exercises.ch09): a correct answer passes, a stub is "not written yet",
and each plausible wrong answer is rejected with the hint that names it."""

from __future__ import annotations

import pytest

from labkit.exercises import ch09 as ex
from labkit.exercises.checks import ExerciseIncomplete, ExerciseWrong


def coordinates_device_mesh(rank, pp, dp, tp):
    return rank // (dp * tp), rank // tp % dp, rank % tp


def groups_device_mesh(rank, pp, dp, tp):
    p, d, t = coordinates_device_mesh(rank, pp, dp, tp)
    return {"pp": [i * dp * tp + d * tp + t for i in range(pp)],
            "dp": [p * dp * tp + i * tp + t for i in range(dp)],
            "tp": [p * dp * tp + d * tp + i for i in range(tp)]}


def coordinates_hybrid_context(rank, pp, dp, tp):  # dp innermost: the copied order
    return rank // (tp * dp), rank % dp, rank // dp % tp


def stub(*args):
    raise NotImplementedError


def test_rank_grid_accepts_the_device_mesh_order(capsys):
    ex.check_rank_grid(coordinates_device_mesh, groups_device_mesh)
    assert "Correct" in capsys.readouterr().out


def test_rank_grid_names_the_copied_order():
    with pytest.raises(ExerciseWrong, match="HybridParallelContext order"):
        ex.check_rank_grid(coordinates_hybrid_context, groups_device_mesh)


def test_rank_grid_rejects_groups_without_their_order_or_of_the_wrong_dimension():
    def reversed_tp(rank, pp, dp, tp):
        return {**groups_device_mesh(rank, pp, dp, tp), "tp": groups_device_mesh(rank, pp, dp, tp)["tp"][::-1]}

    def swapped(rank, pp, dp, tp):
        g = groups_device_mesh(rank, pp, dp, tp)
        return {"pp": g["pp"], "dp": g["tp"], "tp": g["dp"]}

    for wrong in (reversed_tp, swapped):
        with pytest.raises(ExerciseWrong, match="wrong order|not this rank's"):
            ex.check_rank_grid(coordinates_device_mesh, wrong)


def test_rank_grid_stub_is_not_written_yet():
    with pytest.raises(ExerciseIncomplete, match="not written yet"):
        ex.check_rank_grid(stub, groups_device_mesh)
    with pytest.raises(ExerciseIncomplete, match="not written yet"):
        ex.check_rank_grid(coordinates_device_mesh, stub)


def layout(bytes_per_param):
    def choose_layout(num_params, nodes, activation_gib):
        gpus = 4 * nodes
        state_gib = bytes_per_param * num_params / gpus / 2**30
        return (nodes, 4) if state_gib + activation_gib <= 40 else None
    return choose_layout


def test_layout_accepts_sixteen_bytes_per_parameter_in_any_split(capsys):
    ex.check_layout_choice(layout(16))
    assert "Correct" in capsys.readouterr().out

    def tp_two(num_params, nodes, activation_gib):  # another split of the same GPUs fits the same
        answer = layout(16)(num_params, nodes, activation_gib)
        return None if answer is None else (2 * nodes, 2)

    ex.check_layout_choice(tp_two)


def test_layout_that_keeps_a_reserve_back_is_rejected_with_its_hint():
    def with_reserve(num_params, nodes, activation_gib):   # page 9.3's 4 GiB reserve, which the exercise drops
        gpus = 4 * nodes
        return (nodes, 4) if 16 * num_params / gpus / 2**30 + activation_gib + 4 <= 40 else None

    with pytest.raises(ExerciseWrong, match="This exercise keeps none"):
        ex.check_layout_choice(with_reserve)


@pytest.mark.parametrize("bytes_per_parameter", [4, 8])  # weights + gradients in bf16, or as fp32 shards
def test_layout_that_forgets_the_optimizer_state_is_rejected(bytes_per_parameter):
    with pytest.raises(ExerciseWrong, match=r"4 \+ 4 \+ 8, the chapter's convention"):
        ex.check_layout_choice(layout(bytes_per_parameter))


def test_layout_errors_on_gpus_and_nodes():
    def tp_eight(num_params, nodes, activation_gib):
        answer = layout(16)(num_params, nodes, activation_gib)
        return None if answer is None else (nodes // 2 or 1, 8) if nodes > 1 else (1, 8)

    with pytest.raises(ExerciseWrong):
        ex.check_layout_choice(tp_eight)

    def one_node_only(num_params, nodes, activation_gib):
        return None if layout(16)(num_params, nodes, activation_gib) is None else (1, 4)

    with pytest.raises(ExerciseWrong, match="use them all"):
        ex.check_layout_choice(one_node_only)
    with pytest.raises(ExerciseWrong, match="returned None"):
        ex.check_layout_choice(lambda *args: None)
    with pytest.raises(ExerciseIncomplete, match="not written yet"):
        ex.check_layout_choice(stub)


def test_block_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {name: ColwiseParallel() for name in ex.COLWISE} | {name: RowwiseParallel() for name in ex.ROWWISE}
    ex.check_block_plan(plan)
    with pytest.raises(ExerciseIncomplete, match="not written yet"):
        ex.check_block_plan(None)
    swapped = plan | {"attention.wo": ColwiseParallel()}  # the plausible mistake: wo split like wq
    with pytest.raises(ExerciseWrong, match="attention.wo.* as ColwiseParallel"):
        ex.check_block_plan(swapped)
    everything_colwise = {name: ColwiseParallel() for name in ex.COLWISE + ex.ROWWISE}
    with pytest.raises(ExerciseWrong):
        ex.check_block_plan(everything_colwise)
    without_w3 = {k: v for k, v in plan.items() if k != "feed_forward.w3"}
    with pytest.raises(ExerciseWrong, match="feed_forward.w3"):
        ex.check_block_plan(without_w3)
    # the course's own plan for the blocks passes
    from distlab import tensor_parallel

    library = {k.removeprefix("layers.*."): v for k, v in tensor_parallel.transformer_tp_plan().items()
               if k.startswith("layers.*.")}
    ex.check_block_plan(library)
