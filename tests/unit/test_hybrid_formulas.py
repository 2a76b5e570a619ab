"""The 2-D FSDP x TP formulas of distlab.hybrid, against independent answers: chapter 05's ZeRO-3 formula,
chapter 06's TP formulas, torch.chunk, and the real plan + fully_shard applied on a fake process group
(one process plays every rank: local shard sizes and the collectives of a step, for uneven shapes too)."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import pytest
import torch

from distlab import comm, hybrid, models, tensor_parallel

TINY = models.preset("tiny")
NORMS = (2 * TINY.n_layers + 1) * TINY.dim
SCRIPT = Path(__file__).resolve().parents[2] / "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py"


def load_script():
    spec = importlib.util.spec_from_file_location("fsdp_tp_hybrid", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rows, parts", [(10, 4), (5, 4), (8, 4), (65, 3), (1, 2), (64, 1)])
def test_chunk_rows_is_torch_chunk(rows, parts):
    pieces = [len(piece) for piece in torch.chunk(torch.empty(rows), parts)]
    pieces += [0] * (parts - len(pieces))  # torch.chunk returns fewer pieces when rows run out; FSDP: empty
    assert [hybrid._chunk_rows(rows, parts, i) for i in range(parts)] == pieces


@pytest.mark.parametrize("embedding_plan", hybrid.EMBEDDING_PLANS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_param_counts_agree_with_chapter_06_and_add_up(tp, embedding_plan):
    # dp = 1: what chapter 06's formula says one TP rank holds
    held = hybrid.hybrid_param_count_per_rank(TINY, 1, tp, embedding_plan=embedding_plan)
    assert held["total"] == tensor_parallel.tp_param_count_per_rank(TINY, tp)["total"]
    for dp in (1, 2, 4):
        per_rank = [hybrid.hybrid_param_count_per_rank(TINY, dp, tp, d, embedding_plan)["total"] for d in range(dp)]
        # over one TP rank's dp replicas: its whole TP slice; over every rank: matrices once, norms tp times
        assert sum(per_rank) == held["total"]
        assert tp * sum(per_rank) == TINY.num_params() - NORMS + tp * NORMS
    assert hybrid.hybrid_param_count_per_rank(TINY, 2, 2)["total"] == (TINY.num_params() - NORMS) // 4 + NORMS // 2
    state = hybrid.hybrid_state_bytes(TINY, 2, 2)
    assert (state.params, state.grads, state.optimizer) == (4 * 30880, 4 * 30880, 8 * 30880)


def test_uneven_rows_give_the_last_dp_ranks_less():
    cfg = models.preset("tiny", vocab_size=130)  # 65 vocabulary rows per TP rank, over dp 3: 22, 22, 21
    counts = [hybrid.hybrid_param_count_per_rank(cfg, 3, 2, d)["root"] for d in range(3)]
    assert counts[0] == counts[1] > counts[2]
    # one row fewer of the embedding and of the head; the final norm's 64 numbers split 22, 22, 20
    assert counts[0] - counts[2] == 2 * cfg.dim + 2


def test_fsdp_traffic_equals_chapter_05_zero3_formula_on_the_tp_slice():
    for tp in (1, 2, 4):
        rows = hybrid.fsdp_tp_comm_formula(TINY, 4, 32, 2, tp)
        dp_bytes = {}
        for row in rows:
            if row["dimension"] == "dp":
                dp_bytes[row["collective"]] = dp_bytes.get(row["collective"], 0) + row["payload_bytes"]
        tp_slice = tensor_parallel.tp_param_count_per_rank(TINY, tp)["total"]
        assert dp_bytes == comm.zero_step_bytes(tp_slice, 3)  # 2 all-gathers and 1 reduce-scatter of it
    kept = hybrid.fsdp_tp_comm_formula(TINY, 4, 32, 2, 2, reshard_after_forward=False)
    gathered = sum(r["payload_bytes"] for r in kept if r["dimension"] == "dp" and r["collective"] == "all_gather")
    assert gathered == comm.zero_step_bytes(tensor_parallel.tp_param_count_per_rank(TINY, 2)["total"], 3,
                                            reshard_after_forward=False)["all_gather"]


def test_tp_traffic_is_chapter_06_on_the_replica_batch():
    for sequence_parallel in (False, True):
        ours = hybrid.fsdp_tp_comm_formula(TINY, 8, 32, 2, 4, sequence_parallel=sequence_parallel)
        chapter_06 = tensor_parallel.tp_comm_formula(TINY, 4, 32, 4, sequence_parallel=sequence_parallel)
        for collective in ("all_reduce", "all_gather", "reduce_scatter"):
            assert sum(r["payload_bytes"] for r in ours if r["dimension"] == "tp" and r["collective"] == collective) \
                == sum(r["payload_bytes"] for r in chapter_06 if r["collective"] == collective)
            assert sum(r["calls"] for r in ours if r["dimension"] == "tp" and r["collective"] == collective) \
                == sum(r["calls"] for r in chapter_06 if r["collective"] == collective)
    blocks = [r for r in hybrid.fsdp_tp_comm_formula(TINY, 8, 32, 2, 4)
              if r["where"] == "blocks" and r["dimension"] == "tp"]
    assert [(r["phase"], r["calls"], r["payload_bytes"]) for r in blocks] == [
        ("forward", 2 * TINY.n_layers, 2 * TINY.n_layers * 4 * 32 * 64 * 4),
        ("backward", 2 * TINY.n_layers, 2 * TINY.n_layers * 4 * 32 * 64 * 4)]


def test_alternative_plan_all_reduces_the_logits():
    rows = hybrid.fsdp_tp_comm_formula(TINY, 4, 32, 2, 2, embedding_plan="alternative")
    outside = {(r["phase"], r["collective"]): r["payload_bytes"] for r in rows
               if r["dimension"] == "tp" and r["where"] == "outside blocks"}
    assert outside == {("forward", "all_gather"): 2 * 32 * 64 * 4, ("forward", "all_reduce"): 2 * 32 * 128 * 4,
                       ("backward", "all_gather"): 2 * 32 * 64 * 4}


def test_dimensions_of_one_rank_have_no_rows():
    assert {r["dimension"] for r in hybrid.fsdp_tp_comm_formula(TINY, 4, 32, 1, 4)} == {"tp"}
    assert {r["dimension"] for r in hybrid.fsdp_tp_comm_formula(TINY, 4, 32, 4, 1)} == {"dp"}


def test_measured_rows_group_by_dimension_and_unit():
    units = hybrid.fsdp_unit_params(TINY, 2)
    calls = []
    for collective, payload, size, source, module, phase in [
        ("all_gather", 4 * units["block"], 2, "c10d", "FSDPTransformer", "backward"),  # prefetched: size says block
        ("all_gather", 4 * units["root"], 2, "c10d", "FSDPTransformer", "forward"),
        ("all_gather", 12, 2, "c10d", "FSDPTransformer", "forward"),                   # neither unit
        ("all_reduce", 100, 2, "functional", "FSDPTransformer.layers.1.attention", "forward"),
        ("all_reduce", 8, 2, "functional", "Global", "forward"),
        ("all_reduce", 8, 1, "functional", "Global", "forward"),                       # a group of one
    ]:
        call = comm.CollectiveCall(collective, payload, size, source)
        call.module, call.phase = module, phase
        calls.append(call)
    rows = {(r["dimension"], r["phase"], r["where"], r["collective"]): (r["calls"], r["payload_bytes"])
            for r in hybrid.measured_fsdp_tp_comm_rows(calls, TINY, 2)}
    assert rows == {("dp", "backward", "blocks", "all_gather"): (1, 4 * units["block"]),
                    ("dp", "forward", "root", "all_gather"): (1, 4 * units["root"]),
                    ("dp", "forward", "unknown unit", "all_gather"): (1, 12),
                    ("tp", "forward", "blocks", "all_reduce"): (1, 100),
                    ("tp", "forward", "outside blocks", "all_reduce"): (1, 8)}
    joined = hybrid.join_fsdp_tp_comm_rows(hybrid.measured_fsdp_tp_comm_rows(calls, TINY, 2),
                                           hybrid.fsdp_tp_comm_formula(TINY, 4, 32, 2, 2), 2, 2)
    unknown = [r for r in joined if r["where"] == "unknown unit"]
    assert unknown and unknown[0]["analytic_calls"] == 0  # a measurement the formula lacks shows as a row


@pytest.mark.parametrize("dp, tp, vocab, plan", [(2, 2, 128, "usual"), (3, 2, 130, "usual"),
                                                 (2, 2, 128, "alternative")])
def test_plan_and_fully_shard_on_a_fake_world_match_the_formulas(dp, tp, vocab, plan):
    """The script's own TP plan and FSDP wrapping, every rank of a dp x tp fake world in turn: local shard
    sizes = hybrid_param_count_per_rank, and one step's collectives = fsdp_tp_comm_formula (uneven too)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    script = load_script()
    cfg = models.preset("tiny", vocab_size=vocab)
    args = type("Args", (), dict(seed=0, embedding_plan=plan, sequence_parallel=False, reshard_after_forward=True,
                                 precision="fp32"))
    assert not dist.is_initialized()
    for rank in range(dp * tp):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * tp)
        try:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            model = script.build_hybrid_model(cfg, args, mesh, "cpu")
            held = sum(p.to_local().numel() for p in model.parameters())
            assert held == hybrid.hybrid_param_count_per_rank(cfg, dp, tp, mesh.get_local_rank("dp"), plan)["total"]
            if rank == 0:  # one step on the first rank (FSDP pads every piece to the same size on the wire)
                tokens = torch.randint(0, vocab, (2, 17))
                with comm.ModuleCommCounter() as counter, \
                        loss_parallel() if plan == "usual" else contextlib.nullcontext():
                    models.lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
                measured = hybrid.measured_fsdp_tp_comm_rows(counter.calls, cfg, tp, plan, dp=dp)
                formula = hybrid.fsdp_tp_comm_formula(cfg, 2 * dp, 16, dp, tp, embedding_plan=plan)
                key = lambda r: (r["dimension"], r["phase"], r["where"], r["collective"])  # noqa: E731
                assert sorted(measured, key=key) == sorted(formula, key=key)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("plan", hybrid.EMBEDDING_PLANS)
def test_tp_local_shapes_are_the_shapes_the_plan_leaves(plan):
    """Every parameter's local shape after the script's TP plan (fake world of 2, rank 0) = tp_local_shapes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = models.build_transformer(TINY, 0)
        parallelize_module(model, init_device_mesh("cpu", (2,)), load_script().tp_plan(plan, False))
        local = {name: tuple((p.to_local() if hasattr(p, "to_local") else p).shape)  # norms stay plain
                 for name, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    expected = {name: (rows,) if columns == 1 else (rows, columns)
                for name, (rows, columns) in hybrid.tp_local_shapes(TINY, 2, plan).items()}
    assert local == expected


def test_precision_defaults_and_the_bytes_of_each_kind_of_traffic():
    import argparse

    assert hybrid.resolve_precision(argparse.Namespace(preset="a100", precision=None)) == "bf16"
    assert hybrid.resolve_precision(argparse.Namespace(preset="tiny", precision=None)) == "fp32"
    assert hybrid.resolve_precision(argparse.Namespace(preset="a100", precision="fp32")) == "fp32"
    assert hybrid.precision_bytes("bf16") == {"bytes_per_element": 2, "reduce_bytes_per_element": 4}
    fp32 = {(r["dimension"], r["phase"], r["where"], r["collective"]): r["payload_bytes"]
            for r in hybrid.fsdp_tp_comm_formula(TINY, 4, 32, 2, 2)}
    bf16 = {(r["dimension"], r["phase"], r["where"], r["collective"]): r["payload_bytes"]
            for r in hybrid.fsdp_tp_comm_formula(TINY, 4, 32, 2, 2, **hybrid.precision_bytes("bf16"))}
    # FSDP's reduce-scatters stay fp32 (reduce_dtype); its all-gathers and TP's activations halve
    for key, value in bf16.items():
        if key[3] == "reduce_scatter":
            assert value == fp32[key], key
        elif key[0] == "dp" or key[2] == "blocks":
            assert 2 * value == fp32[key], key
    policy = hybrid.mixed_precision_policy("bf16", root=True)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == \
        (torch.bfloat16, torch.float32, torch.float32)
    assert hybrid.mixed_precision_policy("bf16").output_dtype is None    # stages pass bf16 on
