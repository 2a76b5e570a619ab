"""Chapter 09's numbers, recomputed: every table and figure of chapter 09's pages (chapters/09_hybrid_parallel.md,
09.2_*, 09.3_*, read as one text by coursetools.chapters.text) comes from distlab.sizing, distlab.hybrid or
distlab.tensor_parallel, and this test fails when the text drifts from them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from coursetools import chapters
from distlab import hybrid, memory, sizing, tensor_parallel

REPO = Path(__file__).resolve().parents[2]
MIB = 2**20


@pytest.fixture(scope="module")
def text():
    return " ".join(chapters.text("09").split())  # sentences may wrap (and indent) anywhere


@pytest.fixture(scope="module")
def raw():
    return chapters.text("09")


def test_the_three_tables_are_what_distlab_sizing_computes(raw):
    for name, table in (("shapes", sizing.shapes_table_markdown()), ("sizing", sizing.sizing_table_markdown()),
                        ("overlap", sizing.overlap_table_markdown())):
        assert table in raw, f"the {name} table in the chapter is stale; the code gives:\n{table}"


def test_the_stated_assumptions_are_the_defaults(text):
    a = sizing.Assumptions()
    assert (a.seq_len, a.micro_batch, a.activation_checkpointing, a.reserve_bytes, a.gpu_bytes) == (
        4096, 1, True, 4 * memory.GIB, 40 * memory.GIB)
    assert f"sequences of **{a.seq_len:,} tokens**" in text and "a micro-batch of **1 sequence**" in text
    assert "a **reserve of 4 GiB** per GPU" in text and "a GPU of 40 GiB" in text
    assert memory.training_state_bytes(1, "mixed").total == 16 and "**16 bytes per parameter**" in text
    assert sizing.Assumptions().prefetched_units == 2 and "two gathered units" in text


def test_the_block_communication_table_for_7b_on_two_nodes(text):
    block = sizing.block_communication("7B", dp=2, tp=4)
    payload = block["tp"]["rows"][0]["payload_bytes"] // block["tp"]["rows"][0]["calls"]
    row_tp = (f"| tp (4 ranks) | NVLink, 300 GB/s | {block['tp']['calls']} all-reduces of {payload / MIB:.0f} MiB | "
              f"{block['tp']['sent_bytes'] / MIB:.0f} MiB | {block['tp']['seconds'] * 1e3:.2f} ms |")
    gathers = sum(r["calls"] for r in block["dp"]["rows"] if r["collective"] == "all_gather")
    scatters = sum(r["calls"] for r in block["dp"]["rows"] if r["collective"] == "reduce_scatter")
    row_dp = (f"| dp (2 ranks) | Slingshot, 25 GB/s | {gathers} all-gathers + {scatters} reduce-scatter | "
              f"{block['dp']['sent_bytes'] / MIB:.0f} MiB | {block['dp']['seconds'] * 1e3:.1f} ms |")
    assert row_tp in text, row_tp
    assert row_dp in text, row_dp
    assert f"against {block['compute']['seconds'] * 1e3:.2f} ms of the block's matrix multiplies" in text
    # the compute written out: (6 x matrix parameters + 12 S h) x tokens / tp / peak
    shape = sizing.LLAMA_SHAPES["7B"]
    matrices = shape.block_params() - 2 * shape.dim
    by_hand = (6 * matrices + 12 * 4096 * shape.dim) * 4096 / 4 / 312e12
    assert by_hand == pytest.approx(block["compute"]["seconds"])
    assert (f"(6 x {matrices / 1e6:.0f} M matrix parameters + 12 x 4,096 x 4,096 for attention) x 4,096 tokens / 4 "
            f"ranks / 312 TFLOP/s") in text
    # "the link makes the difference of twelve times": the links' ratio, and the times' ratio
    assert tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S / tensor_parallel.SLINGSHOT11_NIC_BYTES_PER_S == 12
    assert round(block["dp"]["seconds"] / block["tp"]["seconds"]) == 12 and "difference of twelve times" in text
    assert round(block["dp"]["sent_bytes"] / block["tp"]["sent_bytes"], 2) == pytest.approx(1.0, abs=0.02)
    # the TP group across the nodes, 2 of its ranks a node: counted per NIC, its bytes leave over 2 NICs, six times
    # NVLink's time and just under the compute's (one NIC a rank would have claimed more than the compute)
    crossing = block["tp"]["sent_bytes"] / (2 * tensor_parallel.SLINGSHOT11_NIC_BYTES_PER_S)
    assert round(crossing / block["tp"]["seconds"]) == 6 and crossing < block["compute"]["seconds"]
    # the NICs are explained before the number (NCCL's rings, one a NIC), and it is compared with the 300 GB/s a
    # node-local TP group gets, not with one NVLink hop (page 8.3's 100 GB/s)
    assert text.index("each leaving the node through a different GPU's NIC") < text.index(
        f"The four all-reduces per block then take {crossing * 1e3:.1f} ms")
    assert (f"2 NICs of 25 GB/s here. The four all-reduces per block then take {crossing * 1e3:.1f} ms. That is six "
            f"times the {block['tp']['seconds'] * 1e3:.2f} ms that a TP group inside one node gets at 300 GB/s, and "
            f"nearly the {block['compute']['seconds'] * 1e3:.2f} ms of compute") in text
    assert "six times NVLink's" not in text and "Against NVLink's 300 GB/s" not in text
    assert "Against the 300 GB/s that a TP group inside one node gets, 2 NICs of 25 GB/s are six times slower" in text
    assert "08.3_all_gather_and_ulysses.md" in text
    assert "would have run on the 25 GB/s NIC and cost more than the compute" not in text
    # the chain's conclusion: FSDP's traffic is not hidden at one sequence; each block waits for the difference
    waits = block["dp"]["seconds"] - block["compute"]["seconds"]
    assert waits > 0 and f"each block waits about {waits * 1e3:.1f} ms for the network" in text
    assert block["tp"]["seconds"] < block["compute"]["seconds"] and "TP's 0.67 ms fits easily inside the compute" in text
    # "with 2 sequences per micro-batch the compute doubles ... and covers the 8.1 ms"
    two = sizing.block_communication("7B", dp=2, tp=4, assumptions=replace(sizing.Assumptions(), micro_batch=2))
    assert two["dp"]["seconds"] == block["dp"]["seconds"] < two["compute"]["seconds"]
    assert (f"with 2 sequences per micro-batch the compute doubles to {two['compute']['seconds'] * 1e3:.1f} ms and "
            f"covers the {block['dp']['seconds'] * 1e3:.1f} ms") in text
    assert sizing.micro_batch_to_hide_fsdp("7B", 2) == 2
    # the alternative head all-reduces B x S x V logits: V is nearly eight times h
    assert round(32000 / 4096) == 8 and "V = 32,000 nearly eight times h = 4,096" in text


def test_the_embedding_plans_for_7b(text):
    cfg = sizing.LLAMA_SHAPES["7B"].config(4096)
    assert sizing.LLAMA_SHAPES["7B"].n_kv_heads == cfg.n_heads  # no GQA: the course's model is the 7B exactly
    outside = {}
    for plan in ("usual", "alternative"):
        rows = [r for r in hybrid.fsdp_tp_comm_formula(cfg, 1, 4096, 1, 4, embedding_plan=plan, bytes_per_element=2)
                if r["where"] == "outside blocks"]
        outside[plan] = rows
    usual = sum(r["payload_bytes"] for r in outside["usual"])
    alternative = sum(r["payload_bytes"] for r in outside["alternative"])
    from distlab import comm

    sent = {plan: sum(comm.bytes_sent_per_rank(r["collective"], r["payload_bytes"] / r["calls"], 4) * r["calls"]
                      for r in rows) for plan, rows in outside.items()}
    # the collectives the text names: usual = all-reduces forward (embedding, 3 loss statistics) and backward (the
    # head's input gradient); alternative = all-gather forward (embedding), all-reduce (logits), all-gather backward
    assert [(r["phase"], r["collective"]) for r in outside["usual"]] == [("forward", "all_reduce"),
                                                                        ("backward", "all_reduce")]
    assert [(r["phase"], r["collective"]) for r in outside["alternative"]] == [
        ("forward", "all_gather"), ("forward", "all_reduce"), ("backward", "all_gather")]
    assert (f"That is {sent['usual'] / MIB:.0f} MiB against {sent['alternative'] / MIB:.0f} MiB, so the usual plan "
            f"sends {sent['alternative'] / sent['usual']:.1f} times fewer bytes") in text
    logits = max(r["payload_bytes"] for r in outside["alternative"])
    assert logits == 4096 * 32000 * 2
    assert usual - 2 * 32 * MIB == 3 * 4096 * 4 == 48 * 1024  # the loss statistics, fp32
    assert f"carry a payload of {usual / MIB:.0f} MiB per step, and 48 KiB of loss statistics" in text
    assert f"The alternative carries {alternative / MIB:.0f} MiB" in text
    assert f"the all-reduce of the logits ({logits / MIB:.0f} MiB)" in text
    assert "five times fewer bytes" not in text


def test_the_two_node_mesh_picture(raw):
    groups = hybrid.grid_groups((1, 2, 4), "device_mesh")
    assert groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert "FSDP groups across the nodes: " + " ".join(str(g) for g in groups["dp"]) in raw
    for node, group in enumerate(groups["tp"]):
        assert f"one TP group {group}" in raw


def test_the_rank_order_table(text):
    shape, gpus_per_node = (2, 2, 4), 4
    crossing = hybrid.crossing_groups_by_order(shape, gpus_per_node)
    for order, label in (("device_mesh", "DeviceMesh"), ("hybrid_context", "HybridParallelContext")):
        tp_groups = hybrid.grid_groups(shape, order)["tp"]
        row = (f"| {label} | {' '.join(str(g) for g in tp_groups)} | "
               f"{len(crossing[order]['tp'])} of {len(tp_groups)} |")
        assert row in text, row
    # the copied order's TP groups hold 2 ranks a node: a ring leaves each node once, over those ranks' 2 NICs
    # (per NIC, as the HSDP section counts), against NVLink: six times slower, not the links' twelve
    per_node = {sum(hybrid.node_of(r, gpus_per_node) == node for r in group)
                for group in hybrid.grid_groups(shape, "hybrid_context")["tp"]
                for node in {hybrid.node_of(r, gpus_per_node) for r in group}}
    slower = tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S / (
        tensor_parallel.SLINGSHOT11_NIC_BYTES_PER_S * min(per_node))
    assert per_node == {2} and slower == 6 and "six times slower" in text and "twelve times slower" not in text
    # the two formulas as the chapter writes them
    assert hybrid.grid_coordinates(6, shape, "hybrid_context") == {"pp": 0, "dp": 0, "tp": 3}
    assert hybrid.grid_coordinates(6, shape, "device_mesh") == {"pp": 0, "dp": 1, "tp": 2}
    assert "rank = pp_rank x dp x tp + dp_rank x tp + tp_rank" in text
    assert "rank = pp_rank x tp x dp + tp_rank x dp + dp_rank" in text


def test_the_sizing_paragraphs(text):
    rows = {r["model"]: r for r in sizing.sizing_table()}
    rule = sizing.RULE_OF_THUMB_NODES
    minimum = [rows[m]["min_nodes"] for m in rule]
    assert f"{minimum[0]}, {minimum[1]}, {minimum[2]} and {minimum[3]} against " \
           f"{rule['7B']}, {rule['13B']}, {rule['30B']} and {rule['70B']}" in text
    assert [rule[m] / rows[m]["min_nodes"] for m in rule] == [2, 2, 2, 2] and "half the nodes of the rule" in text
    # the rule is defined before the table that uses it, as the course's own estimate, and how it was made
    per_node = [rows[m]["params"] / rule[m] / 1e9 for m in rule]
    assert (f"one node for every {min(per_node):.1f} B to {max(per_node):.1f} B parameters") in text
    assert "the course's own round estimate, not a published rule. It was made by doubling the fewest nodes" in text
    assert text.index("is a **rule of thumb**") < text.index("| rule of thumb |")
    assert "Where the computation and the rule of thumb agree" not in text
    # the FSDP units counted are the largest unit: the root up to 13 B, a block from 30 B on
    for m, shape in sizing.LLAMA_SHAPES.items():
        root = 2 * shape.vocab_size * shape.dim + shape.dim
        assert (root > shape.block_params()) == (m in ("1B", "7B", "13B")), m
    assert "the root (the embedding, the head and the final norm) up to 13 B, and a block from 30 B on" in text
    assert f"30 B needs {rows['30B']['min_nodes_without_checkpointing']} nodes" in text
    assert rows["70B"]["min_nodes_without_checkpointing"] is None and "70 B fits on no number of nodes" in text
    # 70B's bf16 block inputs on every TP rank: 80 x 4096 x 8192 x 2 bytes
    assert 80 * 4096 * 8192 * 2 == 5 * memory.GIB and "(5 GiB at 80 layers)" in text
    fits, needed = sizing.largest_micro_batch("70B", 20), sizing.micro_batch_to_hide_fsdp("70B", 20)
    assert f"room for {fits} sequences on 20 nodes where {needed} are needed" in text
    assert f"{sizing.min_nodes_to_hide_fsdp('70B')} nodes are the fewest that hide FSDP" in text
    with_sp = replace(sizing.Assumptions(), sequence_parallel=True)
    assert f"with SP the inputs shrink four times and {sizing.min_nodes_to_hide_fsdp('70B', with_sp)} nodes do" in text
    assert f"({sizing.min_nodes_to_hide_fsdp('30B')} nodes by this criterion, {rule['30B']} by the rule)" in text
    # "one micro-batch of 4,096 tokens does too little compute to hide a 30 B or 70 B block's all-gathers"
    for m in ("30B", "70B"):
        assert all(sizing.micro_batch_to_hide_fsdp(m, n) > 1 for n in range(2, rule[m] + 1))
    # after0610 B3: one sequence hides none of them, at the rule's nodes: 2, 3, 4 and 4 are needed
    needed = {m: sizing.micro_batch_to_hide_fsdp(m, rule[m]) for m in rule}
    assert all(n > 1 for n in needed.values())
    assert "too little compute to hide a 30 B or 70 B block's all-gathers" not in text
    assert (f"too little compute to hide any of these blocks' all-gathers across nodes (compute at the bf16 peak, as "
            f"on page 9.1). At the rule's nodes, 7 B needs {needed['7B']} sequences, 13 B {needed['13B']}, and 30 B "
            f"and 70 B {needed['30B']} (the table below).") in text and needed["30B"] == needed["70B"]
    for m in ("7B", "13B"):  # "generous": half the rule's nodes already hide FSDP
        assert sizing.min_nodes_to_hide_fsdp(m) <= rule[m] // 2
    assert "generous for 7 B and 13 B" in text


def test_pipe_is_gone_from_torch(text):
    import importlib.util

    assert importlib.util.find_spec("torch.distributed.pipeline") is None
    assert importlib.util.find_spec("torch.distributed.pipelining") is not None
    assert "removed in 2.4 (pytorch/pytorch#127354)" in text
    # DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3: the chapter cites the assertion
    assert "DeepSpeed's pipeline engine refuses ZeRO-2 and ZeRO-3" in text
    assert "`deepspeed/runtime/pipe/engine.py:76-77`" in text and "incompatible with pipeline parallelism" in text


def test_the_chapter_names_scripts_and_modules_that_exist(raw):
    for path in ("notebooks/student/09_hybrid_parallel.ipynb", "scripts/09_hybrid_parallel/rank_grid.py",
                 "scripts/09_hybrid_parallel/fsdp_tp_hybrid.py", "scripts/09_hybrid_parallel/pp_dp_hybrid.py",
                 "scripts/09_hybrid_parallel/hybrid_3d.py", "pbs/09_hybrid_parallel.pbs"):
        assert (REPO / path).exists() and path.split("/")[-1] in raw, path
    assert (REPO / "pbs" / "instructor_demo.pbs").exists() and "pbs/instructor_demo.pbs" in raw
    for name in ("pp_dp_8gpus.json", "fsdp_pp_8gpus.json", "hybrid_3d_16gpus.json"):  # the reference layouts
        assert (REPO / "scripts" / "09_hybrid_parallel" / "configs" / name).exists(), name
    import distlab.hybrid_pipeline as hybrid_pipeline

    assert hasattr(hybrid_pipeline, "dp_gradient_sync_bytes") and "dp_gradient_sync_bytes" in raw
    assert hasattr(tensor_parallel, "activation_bytes") and "tensor_parallel.activation_bytes" in raw


def test_second_pass_corrections_are_what_torch_does(text):
    """The placements a learner prints, who turns off FSDP's sync in a pipeline, what PP divides, one byte split."""
    import inspect

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import stage as pipeline_stage
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    flat = text
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        colwise, rowwise = (str(p.placements) for p in model.parameters())
    finally:
        dist.destroy_process_group()
    assert f"`{rowwise}`" in flat and f"`{colwise}`" in flat
    source = inspect.getsource(pipeline_stage)
    assert "set_requires_gradient_sync(False)" in source and "set_reshard_after_backward(False)" in source
    assert "reshard_after_forward" not in source  # the user's choice, never the stage's
    assert "torch's pipeline schedules do exactly this" not in flat
    assert "Only TP, SP, PP or CP divide activations" not in flat and "PP does not help the first stage" in flat
    assert "4 + 4 + 8" in flat and "2 weights + 2 gradients + 4 master" not in (
        REPO / "notebooks" / "09_hybrid_parallel.ipynb").read_text()


def test_the_hsdp_table_is_what_sizing_computes(raw, text):
    from distlab import sizing

    assert sizing.hsdp_table_markdown() in raw
    seven, seventy = sizing.hsdp_against_fsdp("7B", 2), sizing.hsdp_against_fsdp("70B", 8)
    assert f"7 B fits HSDP on 40 GiB GPUs ({seven['hsdp_state_gib']:.0f} GiB of state" in text
    assert f"70 B does not ({seventy['hsdp_state_gib']:.0f} GiB per GPU)" in text
    for model, nodes in (("7B", 2), ("7B", 8), ("70B", 8), ("70B", 32)):  # the section's claims, every row
        row = sizing.hsdp_against_fsdp(model, nodes)
        world, n = nodes * 4, nodes
        # by hand, per NIC: FSDP (W-1)/W x 8 bytes a parameter / 4 NICs; HSDP 2 (n-1)/n x 4 bytes / 4
        fsdp = (world - 1) / world * 8 * row["params"] / 4 / 1e9
        hsdp = 2 * (n - 1) / n * (4 * row["params"] // 4) / 1e9
        assert row["fsdp_nic_gb"] == pytest.approx(fsdp) and row["hsdp_nic_gb"] == pytest.approx(hsdp)
        assert 1 < row["saving"] <= 2 and row["hsdp_state_gib"] > row["fsdp_state_gib"]
    assert round(seven["saving"], 2) == 1.75 and "1.75x on 2 nodes" in text and "never more than 2x" in text
    assert "what most multi-node FSDP jobs run" not in text
    assert "`train_fsdp.py --replicate 2`" in text
    # the per-parameter payloads the table and the ratio rest on, and what HSDP buys
    assert memory.training_state_bytes(1, "mixed").total == 16   # (not the payload: 2 + 2 + 4 = 8 is)
    assert ("FSDP sends 8 bytes per parameter a step (bf16 weights gathered twice, 2 + 2, and fp32 gradients "
            "reduce-scattered, 4), so each NIC carries (W - 1) / W x 8 N / 4") in text
    assert "for a model of N parameters" in text and "for W GPUs on m nodes" in text
    assert "per parameter P" not in text
    assert "HSDP's all-reduce of the fp32 gradient shard carries 2 (m - 1) / m x 4 N / 4" in text
    assert "What HSDP buys is where its collectives run" in text


def test_the_clipping_paragraph_names_what_the_code_does(text):
    import inspect

    from distlab import hybrid_pipeline

    source = inspect.getsource(hybrid_pipeline.clip_grad_norm_)
    for call in ("get_total_norm", "full_tensor", "clip_grads_with_norm_"):
        assert call in source and call in text, call
    assert "dist.all_reduce(total, op=dist.ReduceOp.MAX if infinite else dist.ReduceOp.SUM, group=pp_group)" in source
    assert "summed over the pp group (an all-reduce; for the infinity norm, the largest, a MAX all-reduce)" in text
    tests = (REPO / "tests" / "scripts" / "test_09_hybrid_pipeline.py").read_text()
    assert '"--clip-grad-norm", "0.5"' in tests and "`hybrid_3d.py --clip-grad-norm 0.5` on 2 x 2 x 2 ranks" in text


def test_the_planted_wrong_group_paragraph_names_a_flag_that_exists(text):
    """The run itself is tests/scripts/test_09_hybrid_2d.py::test_the_planted_wrong_group_fails_..."""
    script = (Path(__file__).resolve().parents[2] / "scripts" / "09_hybrid_parallel" / "fsdp_tp_hybrid.py").read_text()
    planted = script[script.index('"--planted-bug", choices=['):].split("]", 1)[0]   # chapter 14 adds its own
    assert '"tp-on-dp-group"' in planted and "`fsdp_tp_hybrid.py --planted-bug tp-on-dp-group`" in text
    assert "every byte count still equals its formula" in text and "rank 0's tp group is `[0, 2]`" in text


def test_every_source_is_named_and_no_form_is_clipped(text):
    """Issue 48: the sources the chapter leans on are named, and "with 2 of its ranks a node" and its kind are
    written out."""
    for unnamed in ("one of our source texts", "the guide this chapter follows", "a widely copied"):
        assert unnamed not in text, unnamed
    assert "Hybrid Parallelism Implementation Guide" in text and "TianpeiLuke/cursus" in text
    assert "native_pytorch_hybrid_parallelism_implementation.md" in text
    assert "docs.pytorch.org/tutorials/intermediate/TP_tutorial.html" in text
    for clipped in ("of its ranks a node", "ranks a node", "rank a node", "NICs a node, one each", "GPUs a node",
                    "GiB a GPU", "bytes a parameter", "activation a block"):
        assert clipped not in text, clipped


def test_the_new_pictures_are_where_the_chapter_explains_them(raw):
    first, second, _ = (p.read_text() for p in chapters.pages("09"))
    assert "figures/09_two_d_sharded_weight.png" in first and "_StridedShard" in first
    assert "figures/09_ring_across_two_nodes.png" in first
    # each mechanism's picture comes before the chapter's measured figure
    assert first.index("09_two_d_sharded_weight.png") < first.index("09_hybrid_step_timeline.png")
    assert "rows 0, 1, 4 and 5" in " ".join(first.split())
    assert "the two ranks of dp 0 together hold rows 0, 1, 4 and 5 (rank 0 rows 0 and 1, rank 1 rows 4 and 5)" in \
        " ".join(first.split()) and "dp rank 0 holds rows" not in " ".join(first.split())
    # FSDP's traffic comes per unit twice a step (forward and backward gathers), never "once per unit per step"
    assert "once per unit per step" not in " ".join(first.split())
    # the ring picture: its left panel is plain 1-D FSDP (page 9.2's), its right the guide's order, as the text says
    import inspect

    from coursetools.drawings import ch09
    drawing = inspect.getsource(ch09.draw_ring_across_two_nodes)
    assert "copied order" not in drawing and "guide's (HybridParallelContext) order" in drawing
    assert "plain (1-D) FSDP over all 8 GPUs, as on page 9.2" in drawing
    from coursetools import figures
    assert "replica {" not in inspect.getsource(figures.draw_mesh_3d)   # dp is FSDP here: shards, not replicas
    assert "09_ring_across_two_nodes" not in second and "ring picture" in second


def test_the_measured_confirmation_states_the_scripts_tolerances(text):
    """9.1's one sentence of measurement: the tolerances fsdp_tp_hybrid.py checks with on its default preset."""
    script = (REPO / "scripts" / "09_hybrid_parallel" / "fsdp_tp_hybrid.py").read_text()
    assert "tensor_parallel.TOLERANCE[args.preset]" in script and 'presets=("tiny", "a100")' in script  # tiny: default
    tiny = tensor_parallel.TOLERANCE["tiny"]
    assert (tiny["loss"], tiny["grad"]) == (1e-5, 1e-6)
    assert "Its losses equal one device's to 1e-5, and its gradients to 1e-6" in text


def test_the_timeline_paragraph_reads_the_measured_step(text):
    """9.1 reads the measured timeline: in backward a unit's all-gather (dp) comes before the TP all-reduces and
    the reduce-scatter (an all-reduce under gloo, on dp), and the grey row is the main thread's operators."""
    import json

    from coursetools import figures

    rows = json.loads(figures.HYBRID_STEP_TIMELINE.read_text())["rows"]
    (start, end), = [(r["start"], r["end"]) for r in rows if r["lane"] == "backward"]
    inside = sorted((r for r in rows if r["lane"] in ("tp", "dp") and start <= r["start"] < end),
                    key=lambda r: r["start"])
    assert (inside[0]["lane"], inside[0]["kind"]) == ("dp", "all_gather")
    last_gather = max(i for i, r in enumerate(inside) if r["kind"] == "all_gather")
    after = [r["lane"] for r in inside[last_gather + 1:]]
    assert all(r["kind"] == "all_reduce" for r in inside[last_gather + 1:])
    assert after == ["tp", "tp", "dp", "tp", "tp", "dp", "dp"]   # per block: 2 TP all-reduces, its reduce-scatter
    assert "In backward (shaded), the all-gathers (blue) run ahead. Then each of the 2 blocks shows its two TP " \
           "all-reduces and its reduce-scatter (orange), and the last reduce-scatter is the root unit's" in text
    assert "alternating with the block's compute" not in text


def test_what_a_second_cold_reader_missed(text):
    import json

    # after0610 B11: the rule has no 1 B row, and the page says why (it fits one node with room to spare)
    rows = {r["model"]: r for r in sizing.sizing_table()}
    assert "1B" not in sizing.RULE_OF_THUMB_NODES and rows["1B"]["min_nodes"] == 1
    assert rows["1B"]["gib_per_gpu"]["total"] < 40 / 4
    assert "The rule starts at 7 B: 1 B fits one node with room to spare, so it needs no second node." in text
    # B12: "fewest nodes where FSDP hides" is 1 for 7 B because one node sends nothing across nodes
    one_node = sizing.block_communication("7B", 1, 4)
    assert one_node["dp"]["seconds"] == 0 and sizing.min_nodes_to_hide_fsdp("7B") == 1
    assert ("The 1 for 7 B is one node, where TP takes the node's 4 GPUs and dp is 1: no FSDP traffic crosses a "
            "node, so there is nothing to hide.") in text
    # B1: page 9.1's six times is 2 NICs; one rank a node (page 6.1) is the links' 12
    ratio = tensor_parallel.NVLINK3_A100_PER_DIRECTION_BYTES_PER_S / tensor_parallel.SLINGSHOT11_NIC_BYTES_PER_S
    assert (f"With one rank of the group a node, as page 6.1 counted, one NIC carries it all: {ratio:.0f} times "
            f"slower.") in text
    # B8: AdamW cancels a constant scale; what does not
    assert "AdamW rescales them away" not in text
    assert ("AdamW divides each gradient by its running size, so the scale cancels (all but its eps) and the loss "
            "looks fine. Clipping at a fixed norm, or a switch to SGD, then acts on gradients tp times too small.") in text
    # B9: the planted bug's TP group holds the dp ranks, which read different samples
    assert "ranks that read other rows" not in text
    assert "So TP's all-reduces run over ranks that hold different samples (the dp ranks)." in text
    # B4: the forward half of the measured timeline, read from its data
    data = json.loads((REPO / "chapters" / "figures" / "data" / "09_hybrid_step_timeline.json").read_text())
    rows_ = data["rows"]
    backward = next(r for r in rows_ if r["lane"] == "backward")["start"]
    ms = lambda x: x * 1e3  # noqa: E731
    tp_fwd = [r for r in rows_ if r["lane"] == "tp" and r["end"] <= backward]
    dp_fwd = [r for r in rows_ if r["lane"] == "dp" and r["end"] <= backward]
    first = tp_fwd[0]
    assert first == max((r for r in rows_ if r["lane"] == "tp"), key=lambda r: r["end"] - r["start"])
    assert (round(ms(first["start"]), 1), round(ms(first["end"]), 1)) == (1.5, 19.0)
    assert round(ms(first["end"] - first["start"])) == 18
    # the grey bar above it covers nearly all of it: rank 0 waits inside the collective
    covered = max(min(r["end"], first["end"]) - max(r["start"], first["start"])
                  for r in rows_ if r["lane"] == "compute")
    assert covered > 0.9 * (first["end"] - first["start"])
    # forward: the embedding's one, two per block (g of each region), three in the loss on vocabulary shards
    # (torch/distributed/tensor/parallel/loss.py:209, 214 and 315)
    assert len(tp_fwd) == 1 + 2 * data["model"]["n_layers"] + 3
    # the forward gathers: the root and block 0 in the first 2.5 ms, block 1 at 31-35 ms
    assert len(dp_fwd) == 3 and all(r["kind"] == "all_gather" for r in dp_fwd)
    assert ms(dp_fwd[1]["end"]) < 2.5 and (round(ms(dp_fwd[2]["start"])), round(ms(dp_fwd[2]["end"]))) == (31, 35)
    assert ("In forward (unshaded), the blue bars gather the root unit and block 0 (0-2 ms), then block 1 (31-35 ms). "
            "The first orange bar, from 1.5 to 19.0 ms, is the embedding's all-reduce, the longest of the step: the "
            "grey bar above it is rank 0 waiting 18 ms for its TP partner to join. Each block then adds two "
            "all-reduces, and the loss three.") in text
