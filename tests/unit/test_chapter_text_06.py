"""Chapter 06's numbers, recomputed: the test fails when the chapter's pages (chapters/06_tensor_parallel.md,
chapters/06.2_dtensor_and_the_ledger.md, read as one text) drift from the code."""

import ast
import re
from dataclasses import replace
from pathlib import Path

from coursetools import chapters
from distlab import metrics, models
from distlab import tensor_parallel as tp

TEXT = chapters.text("06")
FLAT = " ".join(TEXT.split())  # the text as read: a phrase matches whatever the line breaks
GIB = 2**30


def says(phrase: str) -> None:
    assert " ".join(phrase.split()) in FLAT, f"chapter 06 no longer says {phrase!r}: the code computes it; update the text"


def test_tiny_run_payloads():
    tiny = models.preset("tiny")
    rows = tp.tp_comm_formula(tiny, 4, 32, 4)
    activation = 4 * 32 * tiny.dim * 4  # B x S x h fp32
    assert {r["payload_bytes"] // r["calls"] for r in rows if r["where"] == "blocks"} == {activation}
    says(f"issue exactly one all-reduce of {activation:,} bytes forward and one backward")
    says(f"For the tiny run that is {activation:,} bytes per activation all-reduce")
    loss = sum(r["payload_bytes"] for r in rows if r["where"] == "loss")
    says(f"and {loss:,} bytes\nfor the loss")
    says(f"(B = 4 sequences of S = 32 tokens, h = {tiny.dim}, fp32)")


def test_parameters_per_rank_and_the_a100_large_state():
    tiny, large = models.preset("tiny"), models.preset("a100_large")
    says(f"{tp.tp_param_count_per_rank(tiny, 4)['total'] * 4:,} bytes of the tiny model's {tiny.num_params() * 4:,}")
    full, quarter = (tp.tp_param_count_per_rank(large, t)["total"] * 16 / GIB for t in (1, 4))
    says(f"the `a100_large` preset's {full:.1f} GiB of AdamW")
    says(f"is {quarter:.1f} GiB per GPU under TP 4")


def test_the_a100_ledger_and_the_node_argument():
    a100 = models.preset("a100")
    says(f"The `a100` preset (h = {a100.dim})")
    per_all_reduce = 2 * 1024 * a100.dim * 4
    total = sum(r["payload_bytes"] for r in tp.tp_comm_formula(a100, 2, 1024, 4))
    says(f"all-reduces {per_all_reduce / 1e6:.1f} MB of fp32 activations 4 times per layer and step")
    # the layers' share, then the whole ledger: the embedding's, the output's and the loss's all-reduces added
    rows = tp.tp_comm_formula(a100, 2, 1024, 4)
    layers = sum(r["payload_bytes"] for r in rows if r["where"] == "blocks")
    assert layers == 4 * a100.n_layers * per_all_reduce and total > layers
    says(f"Its {a100.n_layers} layers make that {layers / 1e9:.2f} GB; with the embedding's, the output's and the "
         f"loss's all-reduces, {total / 1e9:.2f} GB of payload per step")
    nvlink = tp.tp_comm_time_per_layer(a100, 4, tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S,
                                       metrics.peak_flops("A100", "bf16"))
    slingshot = tp.tp_comm_time_per_layer(a100, 4, tp.SLINGSHOT11_NIC_BYTES_PER_S, metrics.peak_flops("A100", "bf16"))
    says(f"= {nvlink['sent_bytes']:,.0f} bytes per token and layer")
    says(f"take **{nvlink['comm_s'] * 1e9:.0f} ns**")
    says(f"**{slingshot['comm_s'] * 1e9:.0f} ns**, {slingshot['comm_s'] / nvlink['comm_s']:.0f} times longer")
    says(f"bf16 peak: **{nvlink['compute_s'] * 1e9:.0f} ns**")
    # the compute rebuilt from the page: h, S, a layer's parameters, 6 FLOPs each, attention's 12 x S x h
    layer = 4 * a100.dim ** 2 + 3 * a100.dim * a100.ffn_hidden
    dense, attention = 6 * layer, 12 * a100.seq_len * a100.dim
    assert nvlink["flops"] == (dense + attention) / 4
    says(f"Take `--preset a100` (h = {a100.dim}, sequences of S = {a100.seq_len:,} tokens) in bf16 on TP 4")
    says(f"A layer has {layer / 1e6:.1f} M parameters, at 6 FLOPs per parameter and token (chapter 01), plus "
         f"attention's 12 x S x h: {dense / 1e6:.1f} M + {attention / 1e6:.1f} M = {(dense + attention) / 1e6:.1f} M "
         f"FLOPs per token, {nvlink['flops'] / 1e6:.1f} M on each of 4 ranks")
    says(f"{tp.NVLINK3_A100_TOTAL_BYTES_PER_S / 1e9:.0f} GB/s in total per GPU, which is "
         f"{tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S / 1e9:.0f} GB/s in each direction")


def test_h_is_the_width_and_a_the_heads():
    # issue 9 item 10: one letter, one meaning. Upper-case H is no longer used at all.
    assert not re.search(r"\bH\b", TEXT)
    says("a/n of its a heads on a TP rank")


def test_grouped_query_attention_under_tp_is_taught_as_the_code_checks_it():
    flat = FLAT
    gqa = replace(models.preset("tiny"), n_heads=8, n_kv_heads=2)
    problems = tp.tp_config_problems(gqa, 4)
    assert problems and "2 key/value heads do not split over 4 TP ranks" in problems[0]
    says("`2 key/value heads do not split over 4 TP ranks`")
    assert not tp.tp_config_problems(replace(models.preset("tiny"), n_heads=8, n_kv_heads=4), 4)
    assert "(`--heads 8 --kv-heads 4` on 4 ranks equals one device; a test runs it)" in flat
    tests = (Path(__file__).resolve().parents[1] / "scripts" / "test_06_tensor_parallel.py").read_text()
    assert '"--heads", "8", "--kv-heads", "4"' in tests
    assert "Inference engines then **replicate** them" in flat


def test_dropout_streams_and_dtensors_cuda_only_tracker():
    import torch
    import torch.nn as nn
    model = models.build_transformer(models.preset("tiny"), seed=0)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())  # "the course model has no dropout"
    says("**Random numbers: the course model has no dropout.**")
    random_py = (Path(torch.__file__).parent / "distributed" / "tensor" / "_random.py").read_text().splitlines()
    assert random_py[202].strip() == 'if self._device.type == "cpu":' and "raise RuntimeError" in random_py[203]
    says("constructing it raises (`_random.py:203`)")
    dispatch = (Path(torch.__file__).parent / "distributed" / "tensor" / "_dispatch.py").read_text()
    assert "if not random._rng_tracker and is_rng_supported_mesh(mesh):" in dispatch


def test_the_losses_are_equal_to_a_tolerance_not_identical():
    assert tp.TOLERANCE["tiny"]["loss"] == 1e-5  # the tolerance tp_transformer.py checks the losses with
    says("(4.8e-7\nmeasured, tolerance 1e-5)")
    assert "the losses of the run are identical" not in TEXT


def _script_constant(path: str, name: str) -> float:
    """A module-level constant of a script, read off its source (the scripts are not importable modules)."""
    tree = ast.parse(Path(path).read_text())
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name])


def test_hand_written_tp_and_dtensor_agree_to_a_tolerance_not_bit_for_bit():
    # tp_from_scratch.py's last check is a relative difference against TOLERANCE (4 CPU ranks measure 8.34e-8)
    tolerance = _script_constant("scripts/06_tensor_parallel/tp_from_scratch.py", "TOLERANCE")
    stated = f"{tolerance:.0e}".replace("e-0", "e-")  # 1e-05 -> 1e-5, as the page writes it
    body = " ".join(chapters.text("06").split("## How we know")[0].split())
    assert "bit for bit" not in body.replace("not bit for bit", "")
    says(f"the two tracks agree to fp32 rounding, within a relative tolerance of {stated}")
    says(f"uses the same relative tolerance of {stated}. On 4 CPU ranks it measured 8.34e-8, not 0")


def test_the_compiled_blocks_section_names_what_the_code_does():
    """The section's claims, each against its source: the flag and the copy in the script, the profiler's count
    in distlab, the planted failures in the test that runs it, and the torch line that makes the view."""
    import torch

    from distlab import profiling

    root = Path(__file__).resolve().parents[2]
    script = (root / "scripts" / "06_tensor_parallel" / "tp_transformer.py").read_text()
    test = (root / "tests" / "scripts" / "test_compile.py").read_text()
    # the proof of the compiled run sits in the appendix, under its own heading
    section = TEXT[TEXT.index("### Compiled blocks"):TEXT.index("### Grouped-query attention elsewhere")]
    assert TEXT.index("## How we know") < TEXT.index("### Compiled blocks")
    assert '"--compile"' in script and "block.compile()" in script
    assert "tok_embeddings.register_forward_hook(lambda module, inputs, output: output.clone())" in script
    assert "profiling.collective_calls" in section and callable(profiling.collective_calls)
    assert "profiling.collective_calls" in script and "step_totals" in script
    for planted in ("Without the copy", "half their bytes"):
        assert planted in section
    assert "without the copy of the embedding's output the first backward raises" in test
    assert "a payload\n    counted at half its bytes fails the ledger check" in test
    assert "'Tensor' object has no attribute '_local_tensor'" in section
    line = (Path(torch.__file__).parent / "distributed" / "tensor" / "_api.py").read_text().splitlines()[111]
    assert "`distributed/tensor/_api.py:112`" in section and "view_as" in line, line


def test_the_worked_example_splits_over_two_ranks_as_the_text_says():
    """The first page's example, recomputed on one device: x = (1, 2), W1 (4 x 2), ReLU, W2 (2 x 4); rank r holds
    W1's rows and W2's columns 2r, 2r + 1, and the two partial sums add up to the unsplit output."""
    import torch

    x = torch.tensor([1.0, 2.0])
    w1 = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, -1.0]])
    w2 = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 1.0, -1.0]])
    hidden = w1 @ x
    full = w2 @ torch.relu(hidden)
    partial = [w2[:, 2 * r:2 * r + 2] @ torch.relu(w1[2 * r:2 * r + 2] @ x) for r in range(2)]
    assert torch.equal(partial[0] + partial[1], full)

    def show(t):
        return "(" + ", ".join(f"{v:g}" for v in t.tolist()) + ")"

    says("W1 = [[1, 0], [0, 1], [1, 1], [1, -1]]        W2 = [[1, 1, 1, 1], [1, -1, 1, -1]]")
    says(f"W1 x = {show(hidden)}, the ReLU makes it {show(torch.relu(hidden))}, and W2 of that is **y = {show(full)}**")
    says(f"the partial sum {show(partial[0])}. Rank 1 computes {show(hidden[2:])}, which its ReLU makes "
         f"{show(torch.relu(hidden[2:]))}, and gets the partial sum {show(partial[1])}")
    says(f"{show(partial[0])} + {show(partial[1])} = **{show(full)}**, the one-device output")


def test_the_f_and_g_picture_follows_the_plan_the_text_describes():
    import coursetools.figures  # noqa: F401  (the drawings import their helpers from it)
    from coursetools.drawings import ch06
    assert ch06.block_regions() == [{"name": "attention", "column": ["wq", "wk", "wv"], "row": ["wo"]},
                                    {"name": "feed_forward", "column": ["w1", "w3"], "row": ["w2"]}]
    says("wq, wk and wv are column parallel, which means split *by heads*")
    says("w1 and w3 are column parallel, w2 is row parallel")
    assert FLAT.index("figures/06_column_row_split.png") < FLAT.index("figures/06_f_and_g_in_a_block.png")


def test_what_a_cold_reader_needs_is_on_the_page():
    """A learner's review (learn0507): names explained where they are used, the chapter's bridge from 05 true, and
    proof kept in "How we know"."""
    says("Their names, column and row, refer to Wᵀ, the matrix as the maths writes it. In `nn.Linear`'s storage W it "
         "is the other way round: column parallel cuts W's rows, and row parallel cuts W's columns.")
    says("`RowwiseParallel` cuts that table's rows: each rank gets a slice of the vocabulary")
    says("g is `Partial -> Replicate` applied to the activation in forward. f is `Partial -> Replicate` applied to "
         "the input's gradient in backward.")
    says("ffn_hidden/n of the hidden features (ffn_hidden is the feed-forward width)")
    assert "F/n" not in FLAT and "view(B, T" not in FLAT
    says("ZeRO shards the state, not the computation")
    assert "a batch that cannot grow" not in FLAT
    says("DP's all-reduce comes once per step, and FSDP's gathers go unit by unit")
    assert "Their traffic comes once per step" not in FLAT
    body = FLAT[:FLAT.index("## How we know")]
    assert "dispatch mode" not in body and "CUDA-like devices" not in body
    says("The course model has no dropout, so it needs neither.")


def test_the_across_nodes_factor_says_how_many_ranks_a_node_it_counts():
    # after0610 B1: 12 times is one rank of the group a node; k ranks a node share k NICs (chapter 09's six, k = 2)
    ratio = tp.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S / tp.SLINGSHOT11_NIC_BYTES_PER_S
    assert ratio == 12 and ratio / 2 == 6
    says(f"{ratio:.0f} times longer. That counts one rank of the group per node, each sending over its own NIC. "
         f"With k ranks of the group in each node, while the group still spans nodes, their k NICs share the traffic, "
         f"and the factor falls to "
         f"{ratio:.0f}/k (page 9.1)")
    says(f"{ratio:.0f} times slower than NVLink with one rank of the group a node (with k ranks a node, k NICs share "
         f"it: {ratio:.0f}/k, page 9.1)")
    says(f"{ratio:.0f} times slower across nodes (one rank of the group a node)")
    # B16: the NCCL fact used in place, not only by reference; B15: which W_r the backward formula means
    says("since NCCL runs several rings at once, each over different links (page 8.3)")
    says("Here W_r is rank r's block of rows of W, not the block of columns of the row-parallel layer above.")


def test_the_pages_say_which_dtype_and_what_tp_adds_to_the_state():
    # after0610 B7: page 6.1 prices bf16, page 6.2's ledger is fp32: 4 bytes against 2
    a100 = models.preset("a100")
    assert 2 * 1024 * a100.dim * 4 == 2 * (2 * 1024 * a100.dim * 2)
    says("the cost the previous page priced per token, there in bf16, here in fp32 at twice the bytes")
    # B14: the state fits, the activations are extra and replicated between the regions
    says("The activations come on top, and between the regions every rank holds them whole (chapter 08 splits them)")
