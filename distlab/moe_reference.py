"""Chapter 13's single-device reference: the MoE layer written plainly, one token at a time, apart from distlab.moe.

``distlab.moe`` routes, caps, sorts and computes every token at once (``route``, ``capacity_mask``,
``sort_by_expert``, ``Experts``), and both of its layers, the single-device ``MoE`` and the expert-parallel
``ExpertParallelMoE``, call those same functions. Checked against each other, a mistake in any of them would be in
both, and every comparison would pass. This module is what the scripts check the expert-parallel layer against
instead: it calls none of them. It shares only the weights (copied when it is built), and follows each definition
as written, in loops a learner can read top to bottom:

* **routing**: each token's scores over the E experts (softmax, or sigmoid as DeepSeek-V3), its top-k experts by
  score + bias, highest first; their weights are the chosen scores divided by their sum;
* **capacity** (GShard, Switch): each expert takes at most ``ceil(factor x tokens x k / E)`` assignments of a group
  of tokens, filled every first choice in token order, then every second choice; the rest are dropped;
* **the output** of a token: the sum over its kept assignments of weight x that expert's SwiGLU of the token
  (plus the shared expert's), one token and one expert at a time;
* **the load-balancing loss** and **the bias update**, each from its paper's definition (below).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# the name of each weight in distlab.moe's layers -> its name here (the weights are copied by these names)
NAMES = {"router.gate.weight": "gate", "experts.w1": "w1", "experts.w3": "w3", "experts.w2": "w2",
         "shared.w1.weight": "shared_w1", "shared.w3.weight": "shared_w3", "shared.w2.weight": "shared_w2"}


def reference_name(name: str) -> str:
    """A parameter's name in a model of distlab.moe layers -> its name once those layers are references."""
    for theirs, ours in NAMES.items():
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on one token (a vector of the hidden size): w2 (silu(w1 x) * w3 x), chapter 01's feed-forward."""
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


class ReferenceMoE(nn.Module):
    """The MoE layer of ``layer`` (a ``distlab.moe.MoE``: its configuration and a copy of its weights), computed
    token by token. ``forward(x, groups)`` returns the output and what the routing did, as ``distlab.moe``'s layers
    do; ``groups``: how many consecutive groups of tokens capacity is counted over (under EP, one a rank)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        cfg = layer.cfg
        self.num_experts, self.top_k, self.scoring = cfg.num_experts, cfg.top_k, cfg.scoring
        self.capacity_factor, self.has_shared = cfg.capacity_factor, cfg.shared_expert
        for name, param in layer.named_parameters():
            setattr(self, NAMES[name], nn.Parameter(param.detach().clone()))
        self.register_buffer("bias", layer.router.bias.detach().clone())   # moved by update_bias, no gradient

    def scores(self, token: torch.Tensor) -> torch.Tensor:
        """The router's score of every expert for one token."""
        logits = self.gate @ token
        return logits.softmax(dim=0) if self.scoring == "softmax" else logits.sigmoid()

    def choose(self, scores: torch.Tensor) -> list[int]:
        """The token's top-k experts by score + bias, highest first (the bias moves the choice only)."""
        biased = (scores + self.bias).tolist()
        return sorted(range(self.num_experts), key=lambda e: biased[e], reverse=True)[: self.top_k]

    def forward(self, x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, dict]:
        tokens, per_group = x.shape[0], x.shape[0] // groups
        rows = x.unbind(0)                                    # one vector a token
        w1, w3, w2 = self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)   # one matrix an expert
        scores = [self.scores(row) for row in rows]
        chosen = [self.choose(s) for s in scores]

        # capacity, group by group: every first choice in token order, then every second, ... each expert's queue
        # cut at the limit
        kept = [[True] * self.top_k for _ in range(tokens)]
        if self.capacity_factor is not None:
            limit = math.ceil(self.capacity_factor * per_group * self.top_k / self.num_experts)
            for start in range(0, tokens, per_group):
                taken = [0] * self.num_experts
                for slot in range(self.top_k):
                    for t in range(start, start + per_group):
                        expert = chosen[t][slot]
                        kept[t][slot] = taken[expert] < limit
                        taken[expert] += kept[t][slot]

        # each token's output: its kept experts, weighted by their share of the chosen scores, plus the shared one
        outputs = []
        for t in range(tokens):
            weights = scores[t][chosen[t]] / scores[t][chosen[t]].sum()
            out = x.new_zeros(x.shape[1])
            for slot, expert in enumerate(chosen[t]):
                if kept[t][slot]:
                    out = out + weights[slot] * swiglu(rows[t], w1[expert], w3[expert], w2[expert])
            if self.has_shared:
                out = out + swiglu(rows[t], self.shared_w1, self.shared_w3, self.shared_w2)
            outputs.append(out)

        load = [0] * self.num_experts   # each expert's kept assignments
        for t in range(tokens):
            for slot, expert in enumerate(chosen[t]):
                load[expert] += kept[t][slot]
        return torch.stack(outputs), {
            "scores": torch.stack(scores), "chosen": torch.tensor(chosen, device=x.device),
            "keep": torch.tensor(kept, device=x.device), "load": torch.tensor(load, device=x.device),
            "dropped": sum(not k for row in kept for k in row)}


def load_balancing_loss(scores: torch.Tensor, chosen: torch.Tensor, num_experts: int, groups: int = 1) -> torch.Tensor:
    """The auxiliary loss of Switch Transformers (Fedus, Zoph and Shazeer 2022, section 2.2, "A Differentiable Load
    Balancing Loss"), E x sum_e f_e x P_e, for top-k routing as DeepSeek-V3's complementary sequence-wise balance
    loss counts it (DeepSeek-V3 Technical Report, section 2.1.2):

    * f_e: the share of the group's T x k assignments (before capacity) that chose expert e: a count, no gradient;
    * P_e: the mean over the group's tokens of e's score, each token's scores divided by their sum (softmax
      scores already sum to 1; sigmoid ones do not): the gradient reaches the router through it.

    Computed per group of consecutive tokens, then averaged over the groups. 1 when routing is uniform."""
    losses = []
    per_group = scores.shape[0] // groups
    for start in range(0, scores.shape[0], per_group):
        group_scores, group_chosen = scores[start:start + per_group], chosen[start:start + per_group].tolist()
        assignments = per_group * len(group_chosen[0])
        loss = 0.0
        for e in range(num_experts):
            f = sum(row.count(e) for row in group_chosen) / assignments
            P = sum(group_scores[t, e] / group_scores[t].sum() for t in range(per_group)) / per_group
            loss = loss + f * P
        losses.append(num_experts * loss)
    return sum(losses) / groups


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing (its report, section 2.1.2): at the end of each step, the bias
    of an expert that got more assignments than the mean falls by ``rate`` (gamma, the bias update speed), that of
    one that got fewer rises by it; an expert at the mean keeps its bias. ``load``: the step's assignments of each
    expert over the whole batch."""
    mean = sum(load.tolist()) / len(load)
    for e, assigned in enumerate(load.tolist()):
        if assigned > mean:
            bias[e] -= rate
        elif assigned < mean:
            bias[e] += rate


def replace_moe_layers(model: nn.Module) -> nn.Module:
    """Every MoE feed-forward of a ``distlab.moe.moe_transformer`` made a reference layer with the same weights
    (in place); parameter names follow :func:`reference_name`."""
    for block in model.layers.values():
        block.feed_forward.layer = ReferenceMoE(block.feed_forward.layer)
    return model
