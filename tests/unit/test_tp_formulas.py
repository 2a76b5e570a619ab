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
