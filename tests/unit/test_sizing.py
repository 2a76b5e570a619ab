"""The sizing guide of chapter 09 (distlab.sizing): shapes against their published parameter counts, each part of
the per-GPU memory against a hand computation, and the fewest nodes against the definition of "fewest"."""

from __future__ import annotations

from dataclasses import replace

import pytest

from distlab import memory, models, sizing

GIB = 2**30
DEFAULT = sizing.Assumptions()

# Parameter counts as the model cards publish them (independent of the shapes' arithmetic).
PUBLISHED_PARAMS = {"1B": 1_100_048_384, "7B": 6_738_415_616, "13B": 13_015_864_320, "30B": 32_528_943_616,
                    "70B": 68_976_648_192}


def test_a_40_gb_a100_has_40_gib():
    assert sizing.A100_40GB_BYTES == 40 * 1024**3 == DEFAULT.gpu_bytes


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
def test_shapes_have_their_published_parameter_counts(name):
    assert sizing.LLAMA_SHAPES[name].num_params() == PUBLISHED_PARAMS[name]


def test_shapes_without_grouped_query_attention_count_as_the_course_model():
    for shape in sizing.LLAMA_SHAPES.values():
        if shape.n_kv_heads == shape.n_heads:
            assert shape.num_params() == shape.config(4096).num_params()
        else:  # GQA: k and v have fewer heads than the course's model gives them
            assert shape.num_params() < shape.config(4096).num_params()
    # and the course's model counts what it builds (a small shape, built)
    small = sizing.LlamaShape("x", 64, 2, 4, 4, 192, 128, "test")
    assert small.num_params() == models.count_params(models.build_transformer(small.config(32)))


def test_state_per_gpu_by_hand():
    shape = sizing.LLAMA_SHAPES["7B"]
    norms = (2 * 32 + 1) * 4096
    for dp, tp in ((1, 1), (2, 4), (8, 4), (3, 2)):
        expected = 16 * ((PUBLISHED_PARAMS["7B"] - norms) / tp + norms) / dp
        assert sizing.state_bytes_per_gpu("7B", dp, tp).total == pytest.approx(expected)
    # one GPU holds the whole 16 B/param of chapter 05; dp x tp GPUs each hold 1/(dp tp) of the matrices
    assert sizing.state_bytes_per_gpu(shape, 1, 1) == memory.training_state_bytes(PUBLISHED_PARAMS["7B"], "mixed")


def test_activations_by_hand_for_7b():
    b, s, h, f, a, v, t = 1, 4096, 4096, 11008, 32, 32000, 4
    # one block, fp32 numbers (tensor_parallel.activation_bytes' terms), saved in bf16 = half the bytes
    one_block_fp32 = (2 * (2 * b * s * h + b * s) + 2 * b * s * h + (4 * b * s * h + b * s * a) // t
                      + 4 * b * s * f // t) * 4
    head = ((2 * b * s * h + b * s) + b * s * h + b * s * v // t + 1) * 4 + b * s * 8
    checkpointed = 32 * b * s * h * 2 + one_block_fp32 / 2 + head
    assert sizing.activation_bytes_per_gpu("7B", 4) == pytest.approx(checkpointed)
    assert 32 * b * s * h * 2 == GIB  # every block's bf16 input: exactly 1 GiB for 7B at 4096 tokens
    everything = sizing.activation_bytes_per_gpu("7B", 4, replace(DEFAULT, activation_checkpointing=False))
    assert everything == pytest.approx(32 * one_block_fp32 / 2 + head)
    sequence_parallel = sizing.activation_bytes_per_gpu("7B", 4, replace(DEFAULT, sequence_parallel=True))
    assert sequence_parallel < checkpointed - 0.7 * GIB  # the block inputs are sharded 4 ways


def test_fsdp_unit_by_hand():
    shape = sizing.LLAMA_SHAPES["70B"]
    block = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192
    assert shape.block_params() == block
    assert sizing.fsdp_unit_bytes("70B", 4) == pytest.approx((2 * 2 + 4) * block / 4)
    # 1B: the root unit (embedding + output) is larger than a block
    tiny_llama = sizing.LLAMA_SHAPES["1B"]
    assert 2 * 32000 * 2048 > tiny_llama.block_params()
    assert sizing.fsdp_unit_bytes("1B", 4) == pytest.approx(8 * (2 * 32000 * 2048 + 2048) / 4)


@pytest.mark.parametrize("name", list(PUBLISHED_PARAMS))
@pytest.mark.parametrize("assumptions", [DEFAULT, replace(DEFAULT, micro_batch=2),
                                         replace(DEFAULT, reserve_bytes=0, sequence_parallel=True)])
def test_fewest_nodes_is_the_fewest(name, assumptions):
    nodes = sizing.min_nodes(name, assumptions)
    assert nodes is not None
    assert sizing.memory_per_gpu(name, nodes, 4, assumptions).fits
    assert all(not sizing.memory_per_gpu(name, n, 4, assumptions).fits for n in range(1, nodes))
    # the parts add up, and only the state shrinks with more nodes
    more = sizing.memory_per_gpu(name, nodes + 1, 4, assumptions)
    here = sizing.memory_per_gpu(name, nodes, 4, assumptions)
    assert here.total == pytest.approx(here.state.total + here.fsdp_unit + here.activations + here.reserve)
    assert more.state.total < here.state.total and more.activations == here.activations


def test_the_guide_with_the_default_assumptions():
    rows = {r["model"]: r for r in sizing.sizing_table()}
    assert {m: r["min_nodes"] for m, r in rows.items()} == {"1B": 1, "7B": 1, "13B": 2, "30B": 4, "70B": 10}
    assert {m: r["min_nodes_without_checkpointing"] for m, r in rows.items()} == {
        "1B": 1, "7B": 1, "13B": 3, "30B": 25, "70B": None}
    # the rule of thumb is twice the memory minimum for 7B..70B
    assert all(sizing.RULE_OF_THUMB_NODES[m] == 2 * rows[m]["min_nodes"] for m in sizing.RULE_OF_THUMB_NODES)


def test_activations_do_not_shrink_with_fsdp_so_some_models_never_fit_without_checkpointing():
    no_checkpointing = replace(DEFAULT, activation_checkpointing=False)
    assert sizing.min_nodes("70B", no_checkpointing) is None
    fixed = sizing.memory_per_gpu("70B", 1000, 4, no_checkpointing)
    assert fixed.activations + fixed.fsdp_unit + fixed.reserve > DEFAULT.gpu_bytes


def test_largest_micro_batch_at_the_rule_of_thumb():
    assert {m: sizing.largest_micro_batch(m, n) for m, n in sizing.RULE_OF_THUMB_NODES.items()} == {
        "7B": 14, "13B": 10, "30B": 5, "70B": 3}
    for name, nodes in sizing.RULE_OF_THUMB_NODES.items():
        largest = sizing.largest_micro_batch(name, nodes)
        assert sizing.memory_per_gpu(name, nodes, 4, replace(DEFAULT, micro_batch=largest)).fits
        assert not sizing.memory_per_gpu(name, nodes, 4, replace(DEFAULT, micro_batch=largest + 1)).fits


def test_layout_problems():
    assert sizing.layout_problems("7B", 2, 4) == []
    assert any("larger than the 4 GPUs" in p for p in sizing.layout_problems("7B", 1, 8))
    assert any("52 attention heads do not split over 8" in p for p in sizing.layout_problems("30B", 1, 8))
    assert any("4 key/value heads do not split over 8" in p for p in sizing.layout_problems("1B", 1, 8))
    assert any("do not split over 3" in p for p in sizing.layout_problems("7B", 1, 3))
    with pytest.raises(ValueError, match="larger than the 4 GPUs"):
        sizing.min_nodes("7B", tp=8)
    with pytest.raises(KeyError, match="unknown model"):
        sizing.memory_per_gpu("8B", 1)


def test_the_exercise_answer_counts_the_optimizer_state():
    # 13B, 8 GiB of activations per GPU: 16 B/param = 193.9 GiB over GPUs holding 32 GiB each: 7 GPUs, 2 nodes
    assert sizing.state_gib_per_gpu(13e9, 1) == pytest.approx(16 * 13e9 / GIB)
    assert sizing.fewest_nodes_for_state(13e9, 8) == 2
    assert sizing.fewest_nodes_for_state(70e9, 8) == 9
    forgot_the_optimizer = -(-(4 * 70e9 / GIB) // 32) // 4  # weights + gradients only: 4 B/param
    assert forgot_the_optimizer < sizing.fewest_nodes_for_state(70e9, 8)
    with pytest.raises(ValueError, match="no room"):
        sizing.fewest_nodes_for_state(7e9, 40)


def test_the_markdown_table_has_a_row_per_model_and_says_derived():
    table = sizing.sizing_table_markdown()
    lines = table.splitlines()
    assert len(lines) == 2 + len(sizing.LLAMA_SHAPES)  # header, separator, one row per model
    assert "(derived)" in lines[0]
    assert lines[-1].startswith("| 70B | 68.98 B | 10 |") and "| no number of nodes |" in lines[-1]


def test_block_communication_by_hand_for_7b_on_two_nodes():
    block = sizing.block_communication("7B", dp=2, tp=4)
    activation = 1 * 4096 * 4096 * 2  # one micro-batch's block output, bf16: 32 MiB
    assert activation == 32 * 2**20
    # TP: 2 all-reduces forward, 2 backward; a ring all-reduce over 4 sends 2 x 3/4 of the payload
    assert block["tp"]["calls"] == 4 and block["tp"]["sent_bytes"] == 4 * 2 * 3 / 4 * activation
    # FSDP over 2 nodes: this TP rank's share of the block (norms whole), gathered twice in bf16,
    # gradients reduce-scattered once in fp32; each sends (2-1)/2 of the payload
    shard = (4 * 4096 * 4096 + 3 * 4096 * 11008) / 4 + 2 * 4096
    assert block["dp"]["calls"] == 3
    assert block["dp"]["sent_bytes"] == pytest.approx((2 * 2 * shard + 4 * shard) / 2)
    assert block["dp"]["seconds"] == pytest.approx(block["dp"]["sent_bytes"] / 25e9)  # Slingshot-11 NIC
    assert block["tp"]["seconds"] == pytest.approx(block["tp"]["sent_bytes"] / 300e9)  # NVLink 3, one way
    flops = (6 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 12 * 4096 * 4096) * 4096 / 4
    assert block["compute"]["seconds"] == pytest.approx(flops / 312e12)
    # FSDP's bytes do not grow with the micro-batch; TP's and the compute do
    bigger = sizing.block_communication("7B", dp=2, tp=4, assumptions=replace(DEFAULT, micro_batch=4))
    assert bigger["dp"]["sent_bytes"] == block["dp"]["sent_bytes"]
    assert bigger["tp"]["sent_bytes"] == 4 * block["tp"]["sent_bytes"]
    assert bigger["compute"]["seconds"] == pytest.approx(4 * block["compute"]["seconds"])


@pytest.mark.parametrize("name, nodes", list(sizing.RULE_OF_THUMB_NODES.items()))
def test_micro_batch_to_hide_fsdp_is_the_fewest(name, nodes):
    needed = sizing.micro_batch_to_hide_fsdp(name, nodes)

    def hidden(micro_batch):
        block = sizing.block_communication(name, nodes, 4, replace(DEFAULT, micro_batch=micro_batch))
        return block["compute"]["seconds"] >= block["dp"]["seconds"]

    assert hidden(needed) and (needed == 1 or not hidden(needed - 1))


def test_what_the_rule_of_thumbs_nodes_buy():
    assert {m: (sizing.largest_micro_batch(m, n), sizing.micro_batch_to_hide_fsdp(m, n))
            for m, n in sizing.RULE_OF_THUMB_NODES.items()} == {
        "7B": (14, 2), "13B": (10, 3), "30B": (5, 4), "70B": (3, 4)}
    assert {m: sizing.min_nodes_to_hide_fsdp(m) for m in sizing.RULE_OF_THUMB_NODES} == {
        "7B": 1, "13B": 2, "30B": 7, "70B": 26}
    with_sp = replace(DEFAULT, sequence_parallel=True)
    assert {m: sizing.min_nodes_to_hide_fsdp(m, with_sp) for m in ("30B", "70B")} == {"30B": 4, "70B": 10}
    nodes = sizing.min_nodes_to_hide_fsdp("70B")
    assert sizing.largest_micro_batch("70B", nodes) >= sizing.micro_batch_to_hide_fsdp("70B", nodes)
    assert sizing.largest_micro_batch("70B", nodes - 1) < sizing.micro_batch_to_hide_fsdp("70B", nodes - 1)
