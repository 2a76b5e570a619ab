"""distlab.tensor_parallel: the plan covers the model, and the formulas the chapters quote."""

import pytest
import torch

from distlab import memory, models, tensor_parallel as tp


@pytest.mark.parametrize("preset,batch,seq_len", [("tiny", 4, 32), ("tiny", 2, 16), ("small", 1, 64)])
def test_activation_formula_of_one_device_equals_what_autograd_saves(preset, batch, seq_len):
    cfg = models.preset(preset)
    model = models.build_transformer(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()  # as sp_transformer.py: targets own storage
    with memory.saved_activation_bytes(exclude=[*model.parameters(), *model.buffers(), tokens]) as saved:
        models.lm_loss(model(inputs), targets)
    assert saved.bytes == tp.activation_bytes(cfg, batch, seq_len)["total"]


def test_sequence_parallel_divides_the_norms_and_leaves_the_gathered_inputs():
    cfg = models.preset("a100")
    plain = tp.activation_bytes(cfg, 2, 1024, 4)
    sequence = tp.activation_bytes(cfg, 2, 1024, 4, sequence_parallel=True)
    assert sequence["norms"] * 4 == plain["norms"]
    assert sequence["tp_inputs"] == plain["tp_inputs"]  # DTensor saves the all-gathered input
    assert sequence["attention"] == plain["attention"] and sequence["swiglu"] == plain["swiglu"]
    single = tp.activation_bytes(cfg, 2, 1024, 1)
    assert sequence["total"] < plain["total"] < single["total"]


@pytest.mark.parametrize("tp_degree", [2, 4, 8])
def test_sequence_parallel_sends_what_tensor_parallel_sends(tp_degree):
    from distlab.comm import bytes_sent_per_rank

    cfg = models.preset("a100")

    def activation_traffic(rows):
        return sum(bytes_sent_per_rank(r["collective"], r["payload_bytes"], tp_degree)
                   for r in rows if r["where"] not in ("loss", "norm weights"))

    plain = tp.tp_comm_formula(cfg, 2, 1024, tp_degree)
    sequence = tp.tp_comm_formula(cfg, 2, 1024, tp_degree, sequence_parallel=True)
    assert activation_traffic(plain) == pytest.approx(activation_traffic(sequence))


def test_comm_formula_counts_two_all_reduces_per_block_each_way():
    cfg = models.preset("tiny")
    rows = {(r["phase"], r["where"]): r for r in tp.tp_comm_formula(cfg, 4, 32, 4)}
    for phase in ("forward", "backward"):
        assert rows[(phase, "blocks")]["calls"] == 2 * cfg.n_layers
        assert rows[(phase, "blocks")]["payload_bytes"] == 2 * cfg.n_layers * 4 * 32 * cfg.dim * 4
    per_linear = {(r["phase"], r["where"]): r for r in tp.tp_comm_formula(cfg, 4, 32, 4, region_inputs=False)}
    assert per_linear[("backward", "blocks")]["calls"] == 5 * cfg.n_layers


def test_parameters_per_rank():
    cfg = models.preset("tiny")
    assert tp.tp_param_count_per_rank(cfg, 1)["total"] == cfg.num_params()
    per_rank = tp.tp_param_count_per_rank(cfg, 4)
    assert 4 * per_rank["sharded"] + per_rank["replicated"] == cfg.num_params()


def test_plan_splits_every_linear_and_the_embedding():
    from fnmatch import fnmatch

    model = models.build_transformer("tiny")
    plan = tp.transformer_tp_plan()
    weights = [name for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))]
    for name in weights:
        assert any(fnmatch(name, pattern) for pattern in plan), f"{name} is not split by the plan"
    sequence_plan = tp.transformer_tp_plan(sequence_parallel=True)
    norms = [name for name, module in model.named_modules() if isinstance(module, models.RMSNorm)]
    assert all(any(fnmatch(name, pattern) for pattern in sequence_plan) for name in norms)
    with pytest.raises(ValueError):
        tp.transformer_tp_plan(sequence_parallel=True, region_inputs=False)


def test_config_problems_are_one_sentence_each():
    cfg = models.preset("tiny")
    assert tp.tp_config_problems(cfg, 4) == []
    assert tp.tp_config_problems(models.preset("tiny", n_heads=2), 4) == ["2 attention heads do not split over 4 TP ranks"]
    assert "sequence length 30 does not split over 4 ranks" in tp.tp_config_problems(cfg, 4, seq_len=30,
                                                                                      sequence_parallel=True)
    assert tp.tp_config_problems(cfg, 4, seq_len=30) == []  # plain TP does not split the sequence
    gqa = models.preset("tiny", n_heads=8, n_kv_heads=2)           # grouped-query attention: 2 key/value heads
    assert tp.tp_config_problems(gqa, 2) == []
    assert tp.tp_config_problems(gqa, 4) == ["2 key/value heads do not split over 4 TP ranks (grouped-query "
                                             "attention: with more TP ranks than key/value heads, each would have "
                                             "to be replicated)"]
    assert tp.tp_config_problems(models.preset("tiny", n_heads=4, n_kv_heads=3), 1) == [
        "4 attention heads do not share 3 key/value heads evenly"]


def test_why_tensor_parallelism_stays_inside_a_node():
    """The numbers chapter 06 quotes: A100 preset, TP 4, bf16, at the A100's bf16 peak."""
    cfg = models.preset("a100")
    assert tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S == 300e9 and tp.SLINGSHOT11_NIC_BYTES_PER_S == 25e9
    nvlink = tp.tp_comm_time_per_layer(cfg, 4, tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S, 312e12)
    slingshot = tp.tp_comm_time_per_layer(cfg, 4, tp.SLINGSHOT11_NIC_BYTES_PER_S, 312e12)
    assert nvlink["sent_bytes"] == 24576
    assert round(nvlink["comm_over_compute"], 2) == 0.31
    assert round(slingshot["comm_over_compute"], 1) == 3.7
    assert slingshot["comm_s"] / nvlink["comm_s"] == pytest.approx(12)


def test_the_numbers_chapters_06_and_08_quote():
    """Every figure the chapter texts state that is not printed by a script run comes from these formulas."""
    from distlab.comm import bytes_sent_per_rank

    tiny, a100, large = models.preset("tiny"), models.preset("a100"), models.preset("a100_large")
    # 06: parameters per rank, tiny model on TP 4 (fp32), and the a100_large training state (16 B/param)
    assert tp.tp_param_count_per_rank(tiny, 4)["total"] * 4 == 124_160 and tiny.num_params() * 4 == 492_800
    assert [round(tp.tp_param_count_per_rank(large, t)["total"] * 16 / 1e9, 1) for t in (1, 4)] == [53.9, 13.5]
    # 06: per token and layer, a100 preset, TP 4, bf16: ns of all-reduce over NVLink / Slingshot, ns of compute
    nvlink = tp.tp_comm_time_per_layer(a100, 4, tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S, 312e12)
    slingshot = tp.tp_comm_time_per_layer(a100, 4, tp.SLINGSHOT11_NIC_BYTES_PER_S, 312e12)
    assert (round(nvlink["comm_s"] * 1e9), round(slingshot["comm_s"] * 1e9), round(nvlink["compute_s"] * 1e9)) == \
        (82, 983, 267)
    # 06: one TP 4 step of the a100 preset at B = 2: 16.8 MB per all-reduce, 1.64 GB of payload in all
    assert 2 * 1024 * a100.dim * 4 == 16_777_216
    assert round(sum(r["payload_bytes"] for r in tp.tp_comm_formula(a100, 2, 1024, 4)) / 1e9, 2) == 1.64
    # 08: saved activations per rank, tiny model (B = 4, S = 32) and a100 preset (B = 2, S = 1024, GB)
    assert [tp.activation_bytes(tiny, 4, 32, t, sequence_parallel=s)["total"]
            for t, s in ((1, False), (4, False), (4, True))] == [1_613_316, 774_660, 526_980]
    assert [round(tp.activation_bytes(a100, 2, 1024, t, sequence_parallel=s)["total"] / 1e9, 2)
            for t, s in ((1, False), (4, False), (4, True))] == [8.77, 4.04, 2.81]
    plain = tp.activation_bytes(a100, 2, 1024, 4)
    assert (round(plain["norms"] / 1e9, 2), round(plain["tp_inputs"] / 1e9, 2)) == (1.61, 0.81)
    # 08: activation bytes each rank sends in one tiny step, TP and TP + SP alike
    for sequence_parallel in (False, True):
        rows = tp.tp_comm_formula(tiny, 4, 32, 4, sequence_parallel=sequence_parallel)
        assert sum(bytes_sent_per_rank(r["collective"], r["payload_bytes"], 4)
                   for r in rows if r["where"] not in ("loss", "norm weights")) == 491_520


def test_model_flags_fill_defaults_and_override_shapes():
    from distlab import models, runtime, tensor_parallel

    parser = runtime.parser(None, presets=("tiny", "a100"))
    tensor_parallel.add_model_flags(parser)
    args = parser.parse_args(["--heads", "8"])
    cfg = tensor_parallel.model_from_args(args)
    assert (args.batch, args.seq_len, args.lr) == (4, models.preset("tiny").seq_len, 1e-3)
    assert cfg == models.preset("tiny", n_heads=8)
    args = parser.parse_args(["--preset", "a100", "--batch", "6", "--dim", "512"])
    assert tensor_parallel.model_from_args(args).dim == 512 and args.batch == 6
    assert args.lr == runtime.LARGE_MODEL_LR  # the a100 preset's learning rate


def test_step_totals_sum_every_phase_and_place_per_collective():
    """What compiled TP is held to (its collectives counted off the profiler, a step's totals): the formula's rows
    summed per collective. For the tiny model on 2 ranks: 10 all-reduces of B x S x h (2 blocks x 2 regions x 2
    directions, the embedding, the output projection's input gradient) and the loss's 3 of B x S."""
    formula = tp.tp_comm_formula(models.preset("tiny"), 4, 32, 2)
    totals = tp.step_totals(formula)
    assert totals == [{"phase": "step", "where": "all", "collective": "all_reduce", "calls": 13,
                       "payload_bytes": 10 * 4 * 32 * 64 * 4 + 3 * 4 * 32 * 4}]
    assert tp.step_totals([{"collective": "all_gather", "calls": 1, "payload_bytes": 8}] * 2)[0]["calls"] == 2
