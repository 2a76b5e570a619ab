"""Chapter 13's proof, independent of the code it proves: the expert-parallel layer against distlab.moe_reference
(written apart, one token at a time), and a plausible bug planted in each function distlab.moe's layers share
(route, capacity_mask, sort_by_expert, Experts, load_balancing_loss, update_bias): the comparison must fail.

The scripts make the same comparison on 4 ranks (tests/scripts/test_13_expert_parallel.py); here the expert-parallel
layer runs on one rank of a process group, which is enough to reach every shared function, in milliseconds."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import moe, moe_reference

TOLERANCE = 1e-5       # fp32, a few ulps of outputs up to about 3 (the scripts' tolerance)
AUX_WEIGHT, BIAS_RATE, LR = 0.01, 0.01, 0.1
# every feature on at once, so that each shared function is on the path: capacity (some assignments dropped), a
# shared expert, the auxiliary loss and the bias update (two steps: the second routes with a moved bias)
EVERYTHING = dict(top_k=2, shared_expert=True, capacity_factor=1.0)


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory):
    store = tmp_path_factory.mktemp("moe_reference") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def compare(steps: int = 2, **config) -> dict[str, float]:
    """Train the expert-parallel layer and the reference side by side (mean squared error plus the weighted
    auxiliary loss, plain SGD, the bias update after each step); the largest difference of each kind."""
    torch.manual_seed(0)
    full = moe.MoE(moe.MoEConfig(**config))
    layer, reference = moe.ExpertParallelMoE(copy.deepcopy(full)), moe_reference.ReferenceMoE(full)
    diffs = dict.fromkeys(["output", "loss", "router grad", "expert grads", "input grad", "load", "bias"], 0.0)

    def worst(key, a, b):
        diffs[key] = max(diffs[key], (a - b).abs().max().item())

    for step in range(steps):
        x, target = torch.randn(64, full.cfg.dim), torch.randn(64, full.cfg.dim)
        ours_x, theirs_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        y, info = layer(ours_x)
        ry, rinfo = reference(theirs_x)
        loss = F.mse_loss(y, target) + AUX_WEIGHT * moe.load_balancing_loss(info["scores"], info["chosen"],
                                                                             full.cfg.num_experts)
        reference_loss = F.mse_loss(ry, target) + AUX_WEIGHT * moe_reference.load_balancing_loss(
            rinfo["scores"], rinfo["chosen"], full.cfg.num_experts)
        loss.backward()
        reference_loss.backward()
        worst("output", y, ry)
        worst("loss", loss, reference_loss)
        worst("input grad", ours_x.grad, theirs_x.grad)
        worst("load", info["load"].float(), rinfo["load"].float())
        for name, param in layer.named_parameters():
            theirs = getattr(reference, moe_reference.reference_name(name))
            worst("router grad" if name.startswith("router") else "expert grads", param.grad, theirs.grad)
        with torch.no_grad():
            for param in [*layer.parameters(), *reference.parameters()]:
                param -= LR * param.grad
                param.grad = None
        moe.update_bias(layer.router, info["load"], BIAS_RATE)
        moe_reference.update_bias(reference.bias, rinfo["load"], BIAS_RATE)
        worst("bias", layer.router.bias, reference.bias)
    return diffs


@pytest.mark.parametrize("scoring", moe.SCORINGS)
def test_the_expert_parallel_layer_equals_the_reference(scoring):
    diffs = compare(scoring=scoring, **EVERYTHING)
    assert all(d <= TOLERANCE for d in diffs.values()), diffs
    assert compare(scoring=scoring)["output"] <= TOLERANCE   # dropless


def test_the_reference_calls_none_of_the_shared_functions(monkeypatch):
    """Each shared function replaced by one that raises: the reference (forward, loss, bias update) still runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("the reference called distlab.moe")

    for name in ("route", "capacity", "capacity_mask", "sort_by_expert", "load_balancing_loss", "update_bias"):
        monkeypatch.setattr(moe, name, refuse)
    monkeypatch.setattr(moe.Experts, "forward", refuse)
    monkeypatch.setattr(moe.Router, "forward", refuse)
    torch.manual_seed(0)
    full = moe.MoE(moe.MoEConfig(**EVERYTHING))
    reference = moe_reference.ReferenceMoE(full)
    y, info = reference(torch.randn(16, full.cfg.dim), groups=2)
    moe_reference.load_balancing_loss(info["scores"], info["chosen"], full.cfg.num_experts, groups=2).backward()
    moe_reference.update_bias(reference.bias, info["load"], BIAS_RATE)
    assert reference.gate.grad is not None


def test_the_reference_loss_is_one_when_balanced_and_e_when_collapsed():
    """Switch's bounds, on the reference's own loss: 1 for uniform routing, E when every token picks expert 0."""
    e = 4
    balanced = torch.tensor([[0], [1], [2], [3], [0], [1], [2], [3]])
    assert moe_reference.load_balancing_loss(torch.full((8, e), 1 / e), balanced, e).item() == pytest.approx(1.0)
    collapsed = torch.tensor([[1.0, 0, 0, 0]] * 8)
    assert moe_reference.load_balancing_loss(collapsed, torch.zeros(8, 1, dtype=torch.long), e).item() == \
        pytest.approx(e)


# ---- a plausible bug in each shared function, planted; each must fail the comparison ----

def route_not_renormalised(router, x, top_k, scoring):
    """The chosen scores used as weights without dividing by their sum."""
    logits = router(x)
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    chosen = torch.topk(scores + router.bias, top_k, dim=-1).indices
    return scores.gather(-1, chosen), chosen, scores


def route_ignoring_the_bias(router, x, top_k, scoring):
    """The bias left out of the choice (DeepSeek-V3's balancing then moves nothing)."""
    logits = router(x)
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    chosen = torch.topk(scores, top_k, dim=-1).indices
    weights = scores.gather(-1, chosen)
    return weights / weights.sum(dim=-1, keepdim=True), chosen, scores


def capacity_mask_token_major(chosen, num_experts, limit):
    """Queues filled token by token (a token's second choice before the next token's first): GShard's priority
    lost, the same number dropped."""
    if limit is None:
        return torch.ones_like(chosen, dtype=torch.bool)
    flat = chosen.reshape(-1)
    position = (F.one_hot(flat, num_experts).cumsum(dim=0) - 1).gather(1, flat[:, None]).squeeze(1)
    return (position < limit).reshape(chosen.shape)


def sort_by_expert_weights_unsorted(chosen, weights, keep, num_experts):
    """The rows sorted by expert, their router weights left in token order."""
    tokens = torch.arange(chosen.shape[0])[:, None].expand_as(chosen)[keep]
    experts, kept_weights = chosen[keep], weights[keep]
    order = torch.argsort(experts, stable=True)
    return tokens[order], kept_weights, experts[order], torch.bincount(experts, minlength=num_experts)


def experts_gate_and_up_swapped(self, x, counts):
    """silu(w3 x) * w1 x instead of silu(w1 x) * w3 x."""
    outputs = [F.linear(F.silu(F.linear(rows, self.w3[e])) * F.linear(rows, self.w1[e]), self.w2[e])
               for e, rows in enumerate(x.split(counts))]
    return torch.cat(outputs)


def load_balancing_loss_detached(scores, chosen, num_experts, groups=1):
    """P_e detached: the loss has its value and no gradient path to the router."""
    share = torch.bincount(chosen.reshape(-1), minlength=num_experts).to(scores.dtype) / chosen.numel()
    probability = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0).detach()
    return num_experts * (share * probability).sum()


@torch.no_grad()
def update_bias_sign_flipped(router, load, rate):
    """The overloaded experts' bias raised, the underloaded ones' lowered."""
    router.bias += rate * torch.sign(load.float() - load.float().mean())


PLANTED = {   # name: (what is replaced, the bug, the comparisons it must fail)
    "route: weights not renormalised": ((moe, "route"), route_not_renormalised,
                                        {"output", "loss", "router grad", "expert grads"}),
    "route: the bias left out of the choice": ((moe, "route"), route_ignoring_the_bias,
                                               {"load", "output", "bias"}),
    "capacity_mask: token-major priority": ((moe, "capacity_mask"), capacity_mask_token_major,
                                            {"output", "loss"}),
    "sort_by_expert: weights not sorted": ((moe, "sort_by_expert"), sort_by_expert_weights_unsorted,
                                           {"output", "loss", "router grad"}),
    "Experts: gate and up projections swapped": ((moe.Experts, "looped"), experts_gate_and_up_swapped,
                                                 {"output", "expert grads"}),
    "load_balancing_loss: no gradient path": ((moe, "load_balancing_loss"), load_balancing_loss_detached,
                                              {"router grad"}),
    "update_bias: sign flipped": ((moe, "update_bias"), update_bias_sign_flipped, {"bias", "load"}),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_bug_in_each_shared_function_fails_the_comparison(bug, monkeypatch):
    (owner, name), planted, failing = PLANTED[bug]
    monkeypatch.setattr(owner, name, planted)
    diffs = compare(**EVERYTHING)
    failed = {key for key, d in diffs.items() if d > TOLERANCE}
    assert failing <= failed, (failed, diffs)
