"""FSDP under torch's pipeline schedules: how many all-gathers a step issues (``schedules.fsdp_all_gathers``), held
to torch 2.13 three ways: our UNSHARD/RESHARD lowering against torch's own (``pipeline_order_with_comms``), our
interleaved order with torch's rounds against torch's, and the counts against the all-gathers a real torch step
issues (FSDP2 and torch's schedule on the fake process group: one process plays one rank of a pp x dp mesh)."""

import multiprocessing

import pytest

from distlab import schedules

pytest.importorskip("torch")


def _torch_lowered(ranks, microbatches, chunks):
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        stages = [PipelineStage(torch.nn.Linear(2, 2), chunk * ranks, ranks * chunks, torch.device("cpu"))
                  for chunk in range(chunks)]
        built = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum())
        return built.pipeline_order, built.pipeline_order_with_comms
    finally:
        dist.destroy_process_group()


def _runs(actions: list[str]) -> list:
    """Consecutive RESHARDs as one set: torch evicts in its set's iteration order, we in unsharding order."""
    out: list = []
    for action in actions:
        if action.endswith("RESHARD") and out and isinstance(out[-1], frozenset):
            out[-1] = out[-1] | {action}
        else:
            out.append(frozenset({action}) if action.endswith("RESHARD") else action)
    return out


# (P, M, V): Megatron's sizes (M a multiple of P), torch's wider rounds (M = 6, 10, 12), the review's 8 x 32 x 8
SIZES = [(4, 8, 2), (2, 4, 3), (4, 8, 4), (4, 6, 2), (4, 10, 3), (8, 12, 2), (8, 32, 8)]


@pytest.mark.parametrize("ranks, microbatches, chunks", SIZES)
def test_our_interleaved_order_and_unshard_reshard_lowering_are_torchs(ranks, microbatches, chunks):
    from torch.distributed.pipelining.schedules import _ComputationType as T

    order, lowered = _torch_lowered(ranks, microbatches, chunks)
    ours = schedules.interleaved_1f1b(ranks, microbatches, chunks, torch_rounds=True)
    assert schedules.from_torch_pipeline_order(order).actions == ours.actions
    kept = (T.FORWARD, T.FULL_BACKWARD, T.UNSHARD, T.RESHARD)
    for rank in range(ranks):
        theirs = [str(a) for a in lowered[rank] if a.computation_type in kept]
        mine = [str(a) for a in schedules.add_unshard_reshard(ours.actions[rank])]
        assert _runs(mine) == _runs(theirs), f"rank {rank} of {ranks} x {microbatches} x {chunks}"


@pytest.mark.parametrize("ranks, microbatches, chunks", [(4, 8, 2), (2, 4, 3)])
def test_torch_reduces_each_chunks_gradients_right_after_its_last_backward(ranks, microbatches, chunks):
    """Chapter 11.3: torch's REDUCE_GRAD (FSDP's reduce-scatters under PP) for a chunk comes right after that chunk's
    M-th backward (torch 2.13 ``_add_reduce_grad``), so under interleaving before the rank's other chunks finish:
    after each chunk's last backward, not after the rank's."""
    from torch.distributed.pipelining.schedules import _ComputationType as T

    _, lowered = _torch_lowered(ranks, microbatches, chunks)
    for rank in range(ranks):
        acts = [a for a in lowered[rank] if a is not None and a.computation_type in (T.FULL_BACKWARD, T.REDUCE_GRAD)]
        reduces = [i for i, a in enumerate(acts) if a.computation_type == T.REDUCE_GRAD]
        assert len(reduces) == chunks
        for i in reduces:
            stage = acts[i].stage_index
            done = [a for a in acts[:i] if a.computation_type == T.FULL_BACKWARD and a.stage_index == stage]
            assert len(done) == microbatches and acts[i - 1] is done[-1]
        assert any(a.computation_type == T.FULL_BACKWARD for a in acts[reduces[0]:])   # others still to finish


def test_the_review_case_gathers_each_chunk_47_times_on_rank_0():
    # P = 8, V = 8, M = 32: rank 0's chunks re-gathered through torch's window of 3, not once each
    actions = schedules.interleaved_1f1b(8, 32, 8).actions[0]
    counts = schedules.fsdp_all_gathers(actions, reshard_after_forward=False, runtime=True)
    assert counts == {0: 6, 8: 6, 16: 8, 24: 5, 32: 5, 40: 5, 48: 8, 56: 4}
    # with at most 3 chunks a rank the window holds them all: one gather each
    few = schedules.interleaved_1f1b(8, 32, 3).actions[0]
    assert schedules.fsdp_all_gathers(few, False, True) == {0: 1, 8: 1, 16: 1}


def _count_torch_step(job):
    """One step of torch's schedule with FSDP2 on the fake process group, as global rank ``rank`` of a (pp, dp = 2)
    mesh: every chunk two Linear units (the root holds no parameter). The all-gathers it issues, counted."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.pipelining.stage import InferenceMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from distlab import comm

    schedule, ranks, microbatches, chunks, reshard, rank = job
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2 * ranks)
    try:
        mesh = init_device_mesh("cpu", (ranks, 2), mesh_dim_names=("pp", "dp"))
        position = mesh["pp"].get_local_rank()
        stages = []
        for chunk in range(chunks):
            part = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            for unit in part:
                fully_shard(unit, mesh=mesh["dp"], reshard_after_forward=reshard)
            fully_shard(part, mesh=mesh["dp"], reshard_after_forward=reshard)
            example = (torch.randn(1, 4),)
            stages.append(PipelineStage(part, chunk * ranks + position, ranks * chunks, torch.device("cpu"),
                                        input_args=example, output_args=example, input_grads=example,
                                        output_grads=example, group=mesh["pp"].get_group()))
        loss = lambda out, target: out.sum()  # noqa: E731
        if schedule == "interleaved_1f1b":
            built = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss)
        else:
            built = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule](stages[0], n_microbatches=microbatches,
                                                                            loss_fn=loss)

        def static_shapes(stages, has_backward, p2p_done):
            # the shape vote is a receive, which the fake group leaves at zero ("dynamic"): the shapes are given
            for stage in stages:
                stage._inference_mode = InferenceMode.STATIC

        built._warmup_p2p = static_shapes
        batch = torch.randn(microbatches, 4)
        with comm.CommCounter() as counter:
            if position == 0:
                built.step(batch, target=batch)
            elif position == ranks - 1:
                built.step(target=batch)
            else:
                built.step()
    finally:
        dist.destroy_process_group()
    return sum(call.collective == "all_gather" for call in counter.calls)


# (schedule, P, M, V, reshard_after_forward, global rank): pipeline position = rank // 2
TORCH_STEPS = [("interleaved_1f1b", 2, 4, 4, False, 0), ("interleaved_1f1b", 2, 4, 4, True, 0),
               ("interleaved_1f1b", 2, 4, 4, False, 2), ("interleaved_1f1b", 2, 4, 2, True, 0),
               ("1f1b", 2, 4, 1, False, 0), ("1f1b", 2, 4, 1, True, 2), ("gpipe", 2, 4, 1, True, 0)]


@pytest.fixture(scope="module")
def torch_steps():
    with multiprocessing.get_context("fork").Pool(processes=1, maxtasksperchild=len(TORCH_STEPS)) as pool:
        return dict(zip(TORCH_STEPS, pool.map(_count_torch_step, TORCH_STEPS, chunksize=1)))


@pytest.mark.parametrize("case", TORCH_STEPS)
def test_all_gathers_of_a_torch_step_are_counted(torch_steps, case):
    schedule, ranks, microbatches, chunks, reshard, rank = case
    built = (schedules.interleaved_1f1b(ranks, microbatches, chunks, torch_rounds=True) if chunks > 1
             else schedules.build(schedule, ranks, microbatches))
    counts = schedules.fsdp_all_gathers(built.actions[rank // 2], reshard, runtime=chunks > 1)
    assert 2 * sum(counts.values()) == torch_steps[case]   # two FSDP units a chunk
