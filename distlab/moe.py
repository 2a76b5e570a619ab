"""Mixture of experts, the mechanism of chapter 13: a router, experts, and expert parallelism by hand.

A MoE feed-forward layer replaces one SwiGLU feed-forward by ``num_experts`` of them and a router that sends each
token to ``top_k`` experts, weighting their outputs. Parameters grow with the experts; the compute of a token does
not (it visits ``top_k`` experts). Expert parallelism (EP) puts ``num_experts / ep`` experts on each rank of an EP
group; each rank routes its own tokens and sends every token to the rank that holds its expert, with one
variable-split all-to-all (the *dispatch*), and gets the outputs back with the reverse one (the *combine*).

Single device (:class:`MoE`) and expert parallel (:class:`ExpertParallelMoE`) share every piece of routing:
:func:`route`, :func:`capacity_mask` and :func:`sort_by_expert`, so the EP layer differs only by the two
all-to-alls and which experts it holds. That is also why the scripts do not check one against the other (a mistake
in a shared function would be on both sides): they check the EP layer against ``distlab.moe_reference``, the same
layer written apart, one token at a time. What they check: outputs, gradients (the router's included) and training
losses equal; the bytes each rank sends = :func:`dispatch_bytes`; the dropped assignments =
:func:`dropped_by_formula`.

Capacity (GShard, Switch): with a capacity factor, each expert takes at most ``ceil(factor x tokens x top_k /
num_experts)`` assignments of a *group* of tokens (GShard's groups; under EP, one rank's tokens), first choices
before second choices, in token order; the rest are dropped (the token keeps its residual path and any shared
expert). Without one (the default) the layer is dropless, as Megablocks, DeepSeek-V3 and torchtitan run.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distlab.models import FeedForward

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    dim: int = 32
    ffn_hidden: int = 64              # each expert's SwiGLU width (and the shared expert's)
    num_experts: int = 8
    top_k: int = 2
    scoring: str = "softmax"          # softmax top-k (Mixtral), or sigmoid top-k (DeepSeek-V3)
    shared_expert: bool = False       # one expert every token visits (DeepSeek-V3's 1 shared + 256 routed)
    capacity_factor: float | None = None   # None: dropless

    def to_dict(self) -> dict:
        return asdict(self)

    def expert_params(self) -> int:
        return self.num_experts * 3 * self.dim * self.ffn_hidden

    def num_params(self) -> int:
        """Total parameters (state: every expert) against active ones (compute: top_k experts a token)."""
        return self.dim * self.num_experts + self.expert_params() + self.shared_expert * 3 * self.dim * self.ffn_hidden

    def active_params(self) -> int:
        return self.dim * self.num_experts + (self.top_k + self.shared_expert) * 3 * self.dim * self.ffn_hidden


def config_problems(cfg: MoEConfig, ep: int) -> list[str]:
    """What makes a layout impossible, each as one sentence (the scripts exit 2 with them)."""
    problems = []
    if cfg.num_experts % ep:
        problems.append(f"{cfg.num_experts} experts do not split over an EP degree of {ep}")
    if not 1 <= cfg.top_k <= cfg.num_experts:
        problems.append(f"top-k {cfg.top_k} must be between 1 and the {cfg.num_experts} experts")
    if cfg.capacity_factor is not None and cfg.capacity_factor <= 0:
        problems.append(f"capacity factor {cfg.capacity_factor} must be > 0")
    if cfg.scoring not in SCORINGS:
        problems.append(f"scoring {cfg.scoring!r} is not one of {SCORINGS}")
    return problems


# --------------------------------------------------------------------------------------------------
# Routing: shared by the single-device layer and the expert-parallel one
# --------------------------------------------------------------------------------------------------


class Router(nn.Module):
    """Scores every expert for every token and picks ``top_k``. ``bias`` (a buffer, no gradient) shifts the
    *choice* only, never the weights: DeepSeek-V3's auxiliary-loss-free balancing moves it after each step."""

    def __init__(self, dim: int, num_experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.register_buffer("bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)


def route(router: Router, x: torch.Tensor, top_k: int, scoring: str):
    """(weights [T, k], experts [T, k], scores [T, E]). softmax: probabilities, top-k of them, renormalised (the
    same as a softmax over the k chosen logits, as Mixtral computes it). sigmoid: each expert's score on its own,
    top-k of score + bias, the chosen scores normalised to sum to 1 (DeepSeek-V3)."""
    logits = router(x)
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    chosen = torch.topk(scores + router.bias, top_k, dim=-1).indices   # the bias moves the choice only
    weights = scores.gather(-1, chosen)
    return weights / weights.sum(dim=-1, keepdim=True), chosen, scores


def capacity(tokens: int, cfg: MoEConfig) -> int | None:
    """Assignments an expert takes from a group of ``tokens`` (None: dropless)."""
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.num_experts)


def capacity_mask(chosen: torch.Tensor, num_experts: int, limit: int | None) -> torch.Tensor:
    """[T, k] True where the assignment is kept. Each expert's queue is filled first choices first, then second
    choices, each in token order (GShard's priority), and cut at ``limit``."""
    if limit is None:
        return torch.ones_like(chosen, dtype=torch.bool)
    by_slot = chosen.t().reshape(-1)                       # slot-major: every first choice, then every second
    one_hot = F.one_hot(by_slot, num_experts)
    position = (one_hot.cumsum(dim=0) - 1).gather(1, by_slot[:, None]).squeeze(1)   # place in its expert's queue
    return (position < limit).reshape(chosen.shape[1], chosen.shape[0]).t()


def dropped_by_formula(chosen: torch.Tensor, num_experts: int, limit: int | None) -> int:
    """Assignments over capacity: sum over experts of max(0, assigned - capacity). Counted from the choices alone,
    not from :func:`capacity_mask`."""
    if limit is None:
        return 0
    counts = torch.bincount(chosen.reshape(-1), minlength=num_experts)
    return int((counts - limit).clamp(min=0).sum())


def sort_by_expert(chosen: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, num_experts: int):
    """The kept (token, expert) assignments grouped by expert: (token index, weight, expert) of each row in that
    order, and the rows of each expert."""
    tokens = torch.arange(chosen.shape[0], device=chosen.device)[:, None].expand_as(chosen)[keep]
    experts, kept_weights = chosen[keep], weights[keep]
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts)
    return tokens[order], kept_weights[order], experts[order], counts


# --------------------------------------------------------------------------------------------------
# The experts
# --------------------------------------------------------------------------------------------------


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether the course runs the experts as torch's grouped matrix multiply (one call for every expert): on
    Hopper-class GPUs in bf16, where it is one fused kernel. ``torch._grouped_mm`` also runs elsewhere (on a CPU
    torch loops over the groups itself); the course's choice is to run the loop of ordinary matrix multiplies
    there, so that what runs is plain to read. The scripts say which ran."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


class Experts(nn.Module):
    """``num_experts`` SwiGLU feed-forwards as stacked weights ([E, F, H] and [E, H, F]), so that a rank's share of
    them is a slice, and a grouped matrix multiply can run them at once."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=w.shape[-1] ** -0.5)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x``: rows grouped by expert, ``counts[e]`` rows for expert e."""
        return self.grouped(x, counts) if grouped_mm_available(x) else self.looped(x, counts)

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every expert in one kernel per matrix: ``offsets`` marks where each expert's rows end."""
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        w1, w3, w2 = (w.to(x.dtype).transpose(-2, -1) for w in (self.w1, self.w3, self.w2))
        h = F.silu(torch._grouped_mm(x, w1, offs=offsets)) * torch._grouped_mm(x, w3, offs=offsets)
        out = torch._grouped_mm(h, w2, offs=offsets)
        if out.requires_grad:
            # its backward refuses a gradient with zero strides, as out.sum() sends back ("Invalid strides/sizes",
            # an H100 under torch 2.11): hand it a dense one
            out.register_hook(lambda grad: grad.contiguous())
        return out

    def looped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One expert after another: three ordinary matrix multiplies each (weights cast to the rows' dtype, as
        ``grouped`` does)."""
        w1, w3, w2 = (w.to(x.dtype) for w in (self.w1, self.w3, self.w2))
        outputs = [F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
                   for e, rows in enumerate(x.split(counts))]
        return torch.cat(outputs) if outputs else x.new_zeros(0, self.w2.shape[1])


def load_balancing_loss(scores: torch.Tensor, chosen: torch.Tensor, num_experts: int, groups: int = 1) -> torch.Tensor:
    """Switch/GShard's auxiliary loss, E x sum_e f_e x P_e, per group of tokens, averaged over the groups: f_e the
    share of the group's assignments that chose e (no gradient), P_e the mean score of e (the gradient flows
    through it). 1 when routing is uniform; E when every token picks the same experts."""
    losses = []
    for s, c in zip(scores.chunk(groups), chosen.chunk(groups)):
        share = torch.bincount(c.reshape(-1), minlength=num_experts).to(s.dtype) / c.numel()
        probability = (s / s.sum(dim=-1, keepdim=True)).mean(dim=0)
        losses.append(num_experts * (share * probability).sum())
    return torch.stack(losses).mean()


@torch.no_grad()
def update_bias(router: Router, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: after a step, raise the bias of the experts that got fewer
    assignments than the mean and lower it for those that got more, by ``rate``. ``load``: the global counts."""
    router.bias += rate * torch.sign(load.float().mean() - load.float())


# --------------------------------------------------------------------------------------------------
# The layers
# --------------------------------------------------------------------------------------------------


class MoE(nn.Module):
    """The single-device MoE feed-forward layer, from which an expert-parallel one is built (the scripts check
    that against ``distlab.moe_reference``, which shares none of this code). ``groups``: how many groups capacity and the auxiliary loss are computed over (under EP, the ranks)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Router(cfg.dim, cfg.num_experts)
        self.experts = Experts(cfg.num_experts, cfg.dim, cfg.ffn_hidden)
        self.shared = FeedForward(cfg.dim, cfg.ffn_hidden) if cfg.shared_expert else None

    def forward(self, x: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        weights, chosen, scores = route(self.router, x, cfg.top_k, cfg.scoring)
        limit = capacity(x.shape[0] // groups, cfg)
        keep = torch.cat([capacity_mask(c, cfg.num_experts, limit) for c in chosen.chunk(groups)])
        tokens, row_weights, _, counts = sort_by_expert(chosen, weights, keep, cfg.num_experts)
        out = self.experts(x[tokens], counts.tolist())
        y = torch.zeros_like(x).index_add(0, tokens, out * row_weights[:, None])
        if self.shared is not None:
            y = y + self.shared(x)
        return y, {"scores": scores, "chosen": chosen, "load": torch.bincount(chosen[keep], minlength=cfg.num_experts),
                   "dropped": int((~keep).sum())}


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits, and its gradient: the same exchange backwards (what a rank
    sent to rank j, it gets the gradient of from rank j)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, log):
        ctx.splits, ctx.group, ctx.log = (output_splits, input_splits), group, log
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        if log is not None:
            log.append(("forward", input_splits))
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        back = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        if ctx.log is not None:
            ctx.log.append(("backward", output_splits))
        return back, None, None, None, None


def all_to_all(x, output_splits: list[int], input_splits: list[int], group=None, log: list | None = None):
    """Differentiable variable-split all-to-all; ``log`` (a list) receives the rows each call sent to each rank."""
    return _AllToAll.apply(x, output_splits, input_splits, group, log)


class ExpertParallelMoE(nn.Module):
    """The same layer with its experts spread over an EP group: this rank holds experts [r E/ep, (r+1) E/ep) and
    a replica of the router and the shared expert (data parallel: their gradients are all-reduced over the
    group, the experts' are not: each expert lives on one rank and gets its gradient from every rank's tokens
    through the combine's backward).

    Built from a single-device :class:`MoE` (the same initial weights), as a course does on a laptop; a real
    model initialises only its own experts."""

    def __init__(self, full: MoE, group=None):
        super().__init__()
        self.cfg, self.group = full.cfg, group
        self.ep, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.local = self.cfg.num_experts // self.ep
        lo, hi = self.rank * self.local, (self.rank + 1) * self.local
        # built where the layer lives (the rank's GPU): modules made on the CPU failed on an H200 ("mat2 is on cpu")
        with torch.device(full.router.gate.weight.device):
            self.router = Router(self.cfg.dim, self.cfg.num_experts)
            self.experts = Experts(self.local, self.cfg.dim, self.cfg.ffn_hidden)
            self.shared = FeedForward(self.cfg.dim, self.cfg.ffn_hidden) if full.shared is not None else None
        self.router.load_state_dict(full.router.state_dict())
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(self.experts, name).copy_(getattr(full.experts, name)[lo:hi])
        if self.shared is not None:
            self.shared.load_state_dict(full.shared.state_dict())
        self.regroup = True                # False: the planted bug of ep_from_scratch.py --planted-bug
        self.log: list | None = None       # set to a list to record the all-to-alls' splits
        self.phases: list | None = None    # set to a list to record (phase, start, end) of each part, in seconds

    @contextlib.contextmanager
    def _phase(self, name: str, device: torch.device):
        if self.phases is None:
            yield
            return
        if device.type == "cuda":      # the clock may be read only when the GPU's queue is empty
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.phases.append((name, start, time.perf_counter()))

    def replicated_parameters(self) -> list[nn.Parameter]:
        """What every rank of the group holds whole: the router and the shared expert."""
        return list(self.router.parameters()) + (list(self.shared.parameters()) if self.shared is not None else [])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        cfg, ep, local = self.cfg, self.ep, self.local
        # 1. route this rank's tokens (its own group for capacity), and sort the kept assignments by expert
        with self._phase("route", x.device):
            weights, chosen, scores = route(self.router, x, cfg.top_k, cfg.scoring)
            keep = capacity_mask(chosen, cfg.num_experts, capacity(x.shape[0], cfg))
            tokens, row_weights, _, counts = sort_by_expert(chosen, weights, keep, cfg.num_experts)
        # 2. tell every rank how many rows it gets for each of its experts (an all-to-all of E counts)
        with self._phase("counts", x.device):
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
            received = received.view(ep, local)                       # [source rank, my expert]
            send_splits = counts.view(ep, local).sum(dim=1).tolist()  # rows to each rank: its experts are contiguous
            receive_splits = received.sum(dim=1).tolist()
        # 3. dispatch: each token to the rank of its expert
        with self._phase("dispatch", x.device):
            arrived = all_to_all(x[tokens], receive_splits, send_splits, self.group, self.log)
        # 4. the rows came grouped by source rank, then by expert: regroup by expert, compute, put back
        with self._phase("experts", x.device):
            expert_of_row = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(received.reshape(-1))
            regroup = (torch.argsort(expert_of_row, stable=True) if self.regroup
                       else torch.arange(expert_of_row.numel(), device=x.device))
            computed = self.experts(arrived[regroup], received.sum(dim=0).tolist())
            by_source = computed[torch.argsort(regroup)]
        # 5. combine: the outputs back to the ranks their tokens came from, weighted by the router, summed per token
        with self._phase("combine", x.device):
            returned = all_to_all(by_source, send_splits, receive_splits, self.group, self.log)
            y = torch.zeros_like(x).index_add(0, tokens, returned * row_weights[:, None])
        if self.shared is not None:
            y = y + self.shared(x)
        return y, {"scores": scores, "chosen": chosen, "load": torch.bincount(chosen[keep], minlength=cfg.num_experts),
                   "dropped": int((~keep).sum()), "send_splits": send_splits, "rows_computed": sum(receive_splits)}


# --------------------------------------------------------------------------------------------------
# Beside tensor parallelism: each TP rank routes its own share of the tokens
# --------------------------------------------------------------------------------------------------


class _SplitTokens(torch.autograd.Function):
    """Forward: this TP rank's share of rows every TP rank holds alike. Backward: each rank has the gradient of
    its share only; the input is replicated, so its gradient is all of them, gathered."""

    @staticmethod
    def forward(ctx, x, group, log):
        ctx.group, ctx.log = group, log
        return x.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.group, ctx.log), None, None


class _GatherTokens(torch.autograd.Function):
    """Forward: every TP rank's share of rows, all-gathered into the whole (replicated again). Backward: what
    follows is replicated over TP, so every rank holds the same gradient of the whole: each keeps its share."""

    @staticmethod
    def forward(ctx, rows, group, log):
        ctx.group = group
        return _gather_rows(rows, group, log)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)].contiguous(), None, None


def _gather_rows(rows: torch.Tensor, group, log: list | None) -> torch.Tensor:
    out = rows.new_empty((dist.get_world_size(group) * rows.shape[0], *rows.shape[1:]))
    dist.all_gather_single(out, rows.contiguous(), group=group)
    if log is not None:
        log.append(out.numel() * out.element_size())
    return out


class TokensSplitOverTP(nn.Module):
    """A MoE layer beside TP (torchtitan's layout): the tokens reach the feed-forward replicated over the TP group;
    each TP rank routes and dispatches only its 1/tp of them (else every TP rank would send the same rows and
    compute the same experts), and an all-gather over TP makes the output whole again. The router's and the shared
    expert's gradients then come from a share of the tokens on each TP rank: sum them over TP
    (:func:`reduce_over_tp`)."""

    def __init__(self, layer: nn.Module, tp_group):
        super().__init__()
        self.layer, self.tp_group = layer, tp_group
        self.gathered: list[int] = []      # bytes of each all-gather over TP (outputs forward, input grads backward)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        y, info = self.layer(_SplitTokens.apply(x, self.tp_group, self.gathered))
        return _GatherTokens.apply(y, self.tp_group, self.gathered), info


def reduce_over_tp(parameters, tp_group) -> int:
    """Sum gradients computed from each TP rank's share of the tokens over the TP group (the local shard of a
    DTensor gradient: FSDP shards it alike on every TP rank). Returns the bytes all-reduced."""
    sent = 0
    for param in parameters:
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        dist.all_reduce(grad, group=tp_group)
        sent += grad.numel() * grad.element_size()
    return sent


# --------------------------------------------------------------------------------------------------
# Formulas
# --------------------------------------------------------------------------------------------------


def dispatch_matrix(chosen: torch.Tensor, keep: torch.Tensor, ranks: int, experts_per_rank: int) -> torch.Tensor:
    """[ranks, ranks]: the rows rank i sends to rank j in a dispatch, for a routing of every token ([ranks x T, k],
    each rank's T tokens consecutive) and its kept assignments; the diagonal is what stays on the rank."""
    owner = (chosen // experts_per_rank)[keep]
    source = (torch.arange(chosen.shape[0], device=chosen.device)[:, None].expand_as(chosen)
              // (chosen.shape[0] // ranks))[keep]
    return torch.bincount(source * ranks + owner, minlength=ranks * ranks).view(ranks, ranks)


def dispatch_bytes(tokens: int, top_k: int, dim: int, bytes_per_element: int, leaving_share: float) -> float:
    """Bytes one rank sends in one dispatch: tokens x top-k x hidden x bytes x the share of its assignments whose
    expert is on another rank. The combine sends as many back; backward repeats both (4 x per layer and step)."""
    return tokens * top_k * dim * bytes_per_element * leaving_share


def saved_activation_bytes(tokens: int, dim: int, ffn_hidden: int, num_experts: int, top_k: int,
                           shared_experts: int = 0, dtype_bytes: int = 4) -> int:
    """Bytes a MoE feed-forward layer (this module's, dropless) saves for backward beyond a block without a
    feed-forward (``tensor_parallel.activation_bytes`` with no SwiGLU), for ``tokens`` tokens. Per token: its
    router scores (E) and one more number; per routed copy (top-k a token) the dispatched row, the expert's output
    and its weighted copy (3 h) and SwiGLU's four tensors (4 f), plus four int64 indices and a bool mask
    (33 bytes); each shared expert's SwiGLU (4 f). Measured equal on CPU (tests/unit/test_moe.py)."""
    numbers = num_experts + 1 + top_k * (3 * dim + 4 * ffn_hidden) + shared_experts * 4 * ffn_hidden
    return tokens * (numbers * dtype_bytes + 33 * top_k)


def uniform_leaving_share(ep: int) -> float:
    """The share of assignments that leave the rank when routing is uniform: (ep - 1) / ep."""
    return (ep - 1) / ep


# --------------------------------------------------------------------------------------------------
# In a transformer
# --------------------------------------------------------------------------------------------------


class MoEFeedForward(nn.Module):
    """A block's feed-forward as a MoE layer (either kind): [B, T, H] in and out, the tokens flattened for the
    router. ``last`` keeps the routing of the latest forward (the load, the scores for an auxiliary loss)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer
        self.last: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, self.last = self.layer(x.reshape(-1, x.shape[-1]))
        return y.view_as(x)


def moe_transformer(cfg, moe_cfg: MoEConfig, seed: int = 0, device="cpu"):
    """The course's transformer (``models.build_transformer``) with every block's feed-forward replaced by a MoE
    layer of ``moe_cfg`` (its hidden size set to the model's), weights depending on ``seed`` alone."""
    from dataclasses import replace

    from distlab import models

    model = models.build_transformer(cfg, seed=seed, device=device)
    moe_cfg = replace(moe_cfg, dim=cfg.dim)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        for block in model.layers.values():
            block.feed_forward = MoEFeedForward(MoE(moe_cfg)).to(device)
    return model

