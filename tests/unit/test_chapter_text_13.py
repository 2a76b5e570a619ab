"""Chapter 13's worked numbers come from the code: the picture of dispatch and combine (drawn from distlab.moe's
routing), the bytes and times of a Mixtral dispatch, the shares of the dispatch picture (the planner's
conclusions at scale: tests/unit/test_planner_moe.py).
Each is recomputed here, and the test fails when the text drifts."""

from pathlib import Path

import torch

from coursetools import chapters, figures
from coursetools.drawings import ch13
from distlab import moe, planner

ROOT = Path(__file__).resolve().parents[2]
TEXT = " ".join(chapters.text("13").split())


def test_the_chapter_has_its_two_pages_and_the_picture_of_dispatch_and_combine():
    assert [p.name for p in chapters.pages("13")] == ["13_expert_parallel.md", "13.2_capacity_balance_and_scale.md"]
    assert "](figures/13_dispatch_and_combine.png)" in TEXT
    # the mechanism's picture comes before the measured dispatch
    assert TEXT.index("figures/13_dispatch_and_combine.png") < TEXT.index("figures/13_expert_dispatch.png")


def test_the_worked_example_is_the_pictures_routing():
    example = ch13.dispatch_and_combine_example()
    chosen, weights = example["chosen"], example["weights"]
    # token x0's two experts and gate weights, as the text follows them
    (first, second), (w1, w2) = chosen[0].tolist(), weights[0].tolist()
    assert f"gives expert {first} a gate weight of {w1:.2f}, and expert {second} a weight of {w2:.2f}" in TEXT
    assert f"y0 = {w1:.2f}·e{first}(x0) + {w2:.2f}·e{second}(x0)" in TEXT
    assert first // 2 == 1 and second // 2 == 0        # "Expert 1 lives on rank 0 ... Expert 3 lives on rank 1"
    # the rows each rank sends and keeps, counted from the choices alone (expert e lives on rank e // 2)
    owner = chosen // 2
    home = torch.arange(6)[:, None].expand_as(chosen) // 3
    sends = [int(((owner != home) & (home == r)).sum()) for r in range(2)]
    keeps = [6 - s for s in sends]
    assert sends == [int(example["matrix"][r].sum() - example["matrix"][r, r]) for r in range(2)]
    assert (f"rank 0 sends {sends[0]} of its 6 rows to rank 1 and keeps {keeps[0]}. Rank 1 sends {sends[1]} of its 6 "
            f"to rank 0 and keeps {keeps[1]}") in TEXT
    assert f"a row is {ch13.DIM * 4} bytes, so rank 0's dispatch is {sends[0] * ch13.DIM * 4} bytes" in TEXT
    computed = [int((owner == r).sum()) for r in range(2)]
    assert computed == [len(rows) for rows in example["computed"]]
    assert f"rank 0's experts compute {computed[0]} rows and rank 1's compute {computed[1]}" in TEXT
    assert f"which has {computed[1] / computed[0] - 1:.0%} more rows" in TEXT
    assert f"computed {computed[1] / computed[0] - 1:.0%} more rows than the other's" in TEXT


def test_the_pictures_rows_computed_and_combined_by_hand_give_the_layers_output():
    """The picture is the mechanism: each rank's experts run on the rows it received, and each token's outputs,
    weighted by its gate and summed on its own rank, are what the single-device layer computes."""
    example = ch13.dispatch_and_combine_example()
    layer, x = example["layer"], example["x"]
    y = torch.zeros_like(x)
    with torch.no_grad():
        for rows in example["computed"]:
            for token, expert, weight in rows:   # expert e's SwiGLU, written out from its stacked weights
                e = layer.experts
                hidden = torch.nn.functional.silu(e.w1[expert] @ x[token]) * (e.w3[expert] @ x[token])
                y[token] += weight * (e.w2[expert] @ hidden)
        expected, _ = layer(x)
    assert sum(len(rows) for rows in example["computed"]) == 6 * 2
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-6), (y - expected).abs().max()


def test_the_mixtral_dispatch_costs_what_the_text_says():
    model, cluster = planner.MODELS["mixtral-8x7b"], planner.CLUSTERS["h100-80gb"]
    tokens, top_k, hidden, layers = model.seq_len, model.top_k, model.hidden, model.layers
    assert (tokens, top_k, hidden, layers, model.experts) == (4096, 2, 4096, 32, 8)
    one = moe.dispatch_bytes(tokens, top_k, hidden, 2, moe.uniform_leaving_share(8))
    assert f"One dispatch is 4,096 x 2 x 4,096 x 2 bytes (bf16) x 7/8 = {one / 1e6:.1f} MB" in TEXT
    step = 4 * layers * one
    assert f"over 32 layers, make {step / 1e9:.1f} GB a rank and step" in TEXT
    compute = 6 * model.active_params() * tokens / (cluster.peak_flops * cluster.compute_efficiency)
    assert (f"6 x {model.active_params() / 1e9:.1f} B active parameters x 4,096 tokens / "
            f"({cluster.compute_efficiency:.2f} x {cluster.peak_flops / 1e12:.0f} TFLOP/s), takes {compute:.2f} s") in TEXT
    assert f"takes {compute:.2f} s on an H100, at {cluster.compute_efficiency:.0%} of its bf16 peak. That {cluster.compute_efficiency:.0%} is the planner's one-number" in TEXT
    nvlink, network = step / cluster.intra_node_bytes_per_s, step / cluster.inter_node_bytes_per_s
    assert f"NVLink at the planner's {cluster.intra_node_bytes_per_s / 1e9:.0f} GB/s a GPU moves {step / 1e9:.1f} GB in {nvlink:.3f} s, {nvlink / compute:.0%} of that compute" in TEXT
    assert f"at {cluster.inter_node_bytes_per_s / 1e9:.0f} GB/s a GPU would need {network:.2f} s, " \
           f"{network / compute:.0%} of the compute" in TEXT
    stored = planner.DEEPSEEK_V3
    assert f"DeepSeek-V3 stores {stored.num_params() / stored.active_params():.0f} times what a token" in TEXT


def test_the_measured_dispatch_shares_are_the_routings():
    shares = []
    for step in range(4):
        matrix = figures.expert_dispatch_of_step(step)
        shares.append(float((matrix[0].sum() - matrix[0, 0]) / matrix[0].sum()))
    assert moe.uniform_leaving_share(4) == 0.75
    # matrix[0] is rank 0's row: the share is rank 0's, not the whole matrix's (which differs at step 1)
    overall = figures.expert_dispatch_of_step(1)
    assert round(float(1 - overall.diagonal().sum() / overall.sum()), 3) != round(shares[1], 3)
    assert f"Rank 0's share here is {shares[1]:.3f} by chance: at steps 0 and 3 it is {shares[0]:.3f} and " \
           f"{shares[3]:.3f}" in TEXT


def test_the_capacity_of_the_worked_example():
    assert "capacity is ceil(1.0 x 32 x 2 / 8) = 8 rows" in TEXT
    assert moe.capacity(32, moe.MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0)) == 8


def test_the_exercises_name_the_labs_graded_exercises():
    graded = chapters.lab_exercises("13")
    assert len(graded) == 3
    items = chapters.exercise_items(chapters.pages("13")[-1].read_text())
    assert len(items) == 3 and all(f'"{title}"' in item for title, item in zip(graded, items))


def test_the_grouped_matrix_multiply_is_the_courses_choice_not_a_limit_of_torch():
    """torch._grouped_mm runs off Hopper too (a CPU, fp32 and bf16); the Hopper/bf16 gate is distlab.moe's."""
    import inspect

    import torch

    a, b, offs = torch.randn(6, 8), torch.randn(2, 8, 16), torch.tensor([2, 6], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch._grouped_mm(a.to(dtype), b.to(dtype), offs=offs).shape == (6, 16)
    gate = inspect.getsource(moe.grouped_mm_available)
    assert "torch.bfloat16" in gate and "(9, 0)" in gate and "is_cuda" in gate
    assert "Elsewhere, a CPU included, they run as a loop" not in TEXT
    assert "takes them all in one call, on a CPU too. The course's layer calls it only on a Hopper GPU in bf16" in TEXT


def test_the_dispatch_bytes_say_the_scripts_row_size():
    # 6,144 B over 48 rows is 128 B a row: hidden 32 in fp32 (the script's --dim), not the hand example's 8
    matrix = figures.expert_dispatch_of_step()
    kept, sent = int(matrix[0, 0]), int(matrix[0].sum() - matrix[0, 0])
    script = (ROOT / "scripts" / "13_expert_parallel" / "ep_from_scratch.py").read_text()
    assert 'p.add_argument("--dim", type=runtime.positive_int, default=32' in script
    assert moe.dispatch_bytes(32, 2, 32, 4, 0.75) == sent * 32 * 4 == 6144
    assert (f"Rank 0 keeps {kept} of its 64 assignments and sends {sent} rows. The script's hidden size is 32 in fp32, "
            f"so a row is 128 B, and the {sent} rows are {sent * 32 * 4:,} B") in TEXT
    assert "An EP group is ep / (cp x tp) data-parallel ranks, taken with every context-parallel" in TEXT
