"""distlab.moe's pieces against independent forms: routing, capacity, the experts as the course's SwiGLU, balance."""

import math

import pytest
import torch

from distlab import models, moe


def routed(scoring="softmax", tokens=64, **kw):
    torch.manual_seed(0)
    cfg = moe.MoEConfig(scoring=scoring, **kw)
    layer = moe.MoE(cfg)
    x = torch.randn(tokens, cfg.dim)
    return cfg, layer, x


def test_softmax_top_k_renormalised_is_a_softmax_over_the_chosen_logits():
    cfg, layer, x = routed()
    weights, chosen, _ = moe.route(layer.router, x, cfg.top_k, "softmax")
    logits = layer.router(x)
    mixtral = torch.softmax(logits.gather(-1, chosen), dim=-1)   # Mixtral's form: top-k logits, then softmax
    assert torch.allclose(weights, mixtral, atol=1e-6)
    assert torch.equal(chosen, torch.topk(logits, cfg.top_k).indices)


def test_the_bias_moves_the_choice_not_the_weights():
    cfg, layer, x = routed("sigmoid")
    layer.router.bias[3] = 10.0   # expert 3 is chosen by every token, at its own score
    weights, chosen, scores = moe.route(layer.router, x, cfg.top_k, "sigmoid")
    assert (chosen == 3).any(dim=-1).all()
    raw = scores.gather(-1, chosen)
    assert torch.allclose(weights, raw / raw.sum(-1, keepdim=True))


def test_capacity_drops_exactly_what_the_formula_says_first_choices_first():
    cfg, layer, x = routed(capacity_factor=0.5, num_experts=4, top_k=2)
    _, chosen, _ = moe.route(layer.router, x, cfg.top_k, cfg.scoring)
    limit = moe.capacity(64, cfg)
    assert limit == math.ceil(0.5 * 64 * 2 / 4) == 16
    keep = moe.capacity_mask(chosen, cfg.num_experts, limit)
    assert int((~keep).sum()) == moe.dropped_by_formula(chosen, cfg.num_experts, limit) > 0
    for e in range(cfg.num_experts):
        assert int((keep & (chosen == e)).sum()) == min(limit, int((chosen == e).sum()))
        # GShard's priority: a second choice is kept only if every first choice of that expert was
        firsts, seconds = (chosen[:, 0] == e), (chosen[:, 1] == e)
        if (keep[:, 1] & seconds).any():
            assert keep[:, 0][firsts].all()
    assert moe.capacity_mask(chosen, cfg.num_experts, None).all()


def test_the_experts_are_the_courses_swiglu_feed_forward():
    cfg, layer, x = routed(num_experts=3)
    counts = [10, 0, 54]
    out = layer.experts(x, counts)
    ffn = models.FeedForward(cfg.dim, cfg.ffn_hidden)
    start = 0
    for e, n in enumerate(counts):
        with torch.no_grad():
            ffn.w1.weight.copy_(layer.experts.w1[e])
            ffn.w3.weight.copy_(layer.experts.w3[e])
            ffn.w2.weight.copy_(layer.experts.w2[e])
        assert torch.allclose(out[start:start + n], ffn(x[start:start + n]), atol=1e-6)
        start += n


def test_the_grouped_matrix_multiply_is_the_loop_with_an_empty_expert_gradients_included():
    """Experts.grouped (torch._grouped_mm; on the CPU torch's own loop) against Experts.looped: the offsets, the
    transposes and an expert with no row. Gradients of the rows and of every stacked weight."""
    cfg, layer, x = routed(num_experts=4)
    counts = [20, 0, 30, 14]
    results = []
    for path in (layer.experts.grouped, layer.experts.looped):
        layer.zero_grad(set_to_none=True)
        rows = x.clone().requires_grad_(True)
        out = path(rows, counts)
        out.pow(2).sum().backward()
        results.append([out, rows.grad, layer.experts.w1.grad, layer.experts.w3.grad, layer.experts.w2.grad])
    for grouped, looped in zip(*results):
        assert torch.allclose(grouped, looped, atol=1e-5)
    assert results[0][2][1].abs().max() == 0   # the empty expert learns nothing


def test_grouped_offsets_are_checked_by_that_test():
    """The same comparison with the offsets shifted by one row (a plausible off-by-one) fails."""
    cfg, layer, x = routed(num_experts=4)
    counts = [20, 0, 30, 14]
    shifted = [21, 0, 29, 14]
    assert not torch.allclose(layer.experts.grouped(x, shifted), layer.experts.looped(x, counts), atol=1e-5)


def test_the_layer_is_the_weighted_sum_of_its_chosen_experts():
    cfg, layer, x = routed(shared_expert=True)
    y, info = layer(x)
    weights, chosen, _ = moe.route(layer.router, x, cfg.top_k, cfg.scoring)
    expected = layer.shared(x).clone()
    for t in range(x.shape[0]):   # one token at a time: no sorting, no index_add
        for k in range(cfg.top_k):
            e = int(chosen[t, k])
            expected[t] += weights[t, k] * _one_expert(layer.experts, e, x[t])
    assert torch.allclose(y, expected, atol=1e-5)
    assert int(info["load"].sum()) == x.shape[0] * cfg.top_k and info["dropped"] == 0


def _one_expert(experts, e, row):
    h = torch.nn.functional.silu(experts.w1[e] @ row) * (experts.w3[e] @ row)
    return experts.w2[e] @ h


def test_the_auxiliary_loss_is_one_when_balanced_and_e_when_collapsed():
    e = 4
    uniform_scores = torch.full((8, e), 1 / e)
    balanced = torch.tensor([[0], [1], [2], [3], [0], [1], [2], [3]])
    assert moe.load_balancing_loss(uniform_scores, balanced, e).item() == pytest.approx(1.0)
    collapsed_scores = torch.tensor([[1.0, 0, 0, 0]] * 8)
    assert moe.load_balancing_loss(collapsed_scores, torch.zeros(8, 1, dtype=torch.long), e).item() == pytest.approx(e)


def test_the_bias_update_raises_the_underloaded_and_lowers_the_overloaded():
    router = moe.Router(8, 4)
    moe.update_bias(router, torch.tensor([10, 2, 4, 0]), rate=0.1)   # mean 4
    assert router.bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.1])


def test_total_and_active_parameters():
    cfg = moe.MoEConfig(dim=32, ffn_hidden=64, num_experts=8, top_k=2, shared_expert=True)
    expert = 3 * 32 * 64
    assert cfg.num_params() == 32 * 8 + 9 * expert and cfg.active_params() == 32 * 8 + 3 * expert
    assert sum(p.numel() for p in moe.MoE(cfg).parameters()) == cfg.num_params()


def test_bad_layouts_are_named():
    assert moe.config_problems(moe.MoEConfig(num_experts=6), 4) == ["6 experts do not split over an EP degree of 4"]
    assert "top-k 9" in moe.config_problems(moe.MoEConfig(top_k=9), 1)[0]
    assert "capacity factor 0" in moe.config_problems(moe.MoEConfig(capacity_factor=0), 1)[0]


def test_the_dispatch_formula():
    assert moe.dispatch_bytes(32, 2, 32, 4, 0.75) == 6144 and moe.uniform_leaving_share(4) == 0.75


def test_the_expert_parallel_layer_lives_on_the_device_of_the_layer_it_was_built_from(tmp_path):
    """On a GPU its router, experts and shared expert must sit on cuda:N beside the tokens; built on the CPU they
    failed with 'mat2 is on cpu' on an H200. The meta device stands for 'not the CPU' here."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        with torch.device("meta"):
            full = moe.MoE(moe.MoEConfig(shared_expert=True))
        layer = moe.ExpertParallelMoE(full)
        assert {t.device.type for t in [*layer.parameters(), *layer.buffers()]} == {"meta"}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("experts,top_k,ffn,shared,dim,batch,seq", [
    (8, 2, 64, False, 64, 2, 32), (8, 4, 128, False, 64, 2, 32), (16, 2, 64, True, 128, 4, 16), (4, 1, 32, True, 32, 1, 64)])
def test_saved_activations_of_a_moe_block_are_the_formula(experts, top_k, ffn, shared, dim, batch, seq):
    """Measured: what a block of the MoE transformer saves beyond a block with no feed-forward (the dense formula
    with no SwiGLU) = moe.saved_activation_bytes. The planner's MoE activations are this formula."""
    from dataclasses import replace

    from distlab import memory, tensor_parallel

    cfg = replace(models.preset("tiny"), dim=dim, seq_len=seq)
    mcfg = moe.MoEConfig(dim=dim, ffn_hidden=ffn, num_experts=experts, top_k=top_k, shared_expert=shared)
    measured = []
    for layers in (1, 2):
        model = moe.moe_transformer(replace(cfg, n_layers=layers), mcfg)
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
        with memory.saved_activation_bytes(exclude=model.parameters()) as saved:
            models.lm_loss(model(tokens), tokens)
        measured.append(saved.bytes)
    without_ffn = tensor_parallel.activation_bytes(replace(cfg, ffn_hidden=0), batch, seq)["per_layer"]
    assert measured[1] - measured[0] - without_ffn == moe.saved_activation_bytes(
        batch * seq, dim, ffn, experts, top_k, int(shared))
