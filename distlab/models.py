"""The course's shared models: a small MLP and a LLaMA-style transformer.

The transformer follows LLaMA (RMSNorm, rotary position embeddings, SwiGLU feed-forward, causal
attention) with torchtitan's module names, so the tensor-parallel plans of later chapters read like the
ones people use in production::

    tok_embeddings -> layers[i].{attention_norm, attention.{wq,wk,wv,wo}, ffn_norm, feed_forward.{w1,w2,w3}}
                   -> norm -> output

Attention reshapes with ``view(B, T, -1, head_dim)``: it never assumes the number of heads, so a
tensor-parallel rank that holds a column slice of wq/wk/wv computes exactly its local heads.

Initialisation depends only on the seed: every rank and the single-device reference build identical weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    ffn_hidden: int = 192
    seq_len: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_kv_heads: int | None = None  # grouped-query attention (LLaMA 2 70B, LLaMA 3); None: every head its own k, v

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return (self.n_kv_heads or self.n_heads) * self.head_dim

    def num_params(self) -> int:
        """Parameter count from the shapes (tested equal to the model's)."""
        per_layer = 2 * self.dim * self.dim + 2 * self.dim * self.kv_dim + 3 * self.dim * self.ffn_hidden + 2 * self.dim
        return 2 * self.vocab_size * self.dim + self.n_layers * per_layer + self.dim

    def to_dict(self) -> dict:
        return asdict(self)


# Presets: tiny runs a step in milliseconds on a laptop CPU; a100 sizes are meaningful on 4 x A100-40GB.
PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(),
    "small": TransformerConfig(vocab_size=512, dim=128, n_layers=4, n_heads=8, ffn_hidden=384, seq_len=64),
    # ~1.3 B parameters: trains on one A100-40GB with bf16 autocast; 4 GPUs make it fast.
    "a100": TransformerConfig(vocab_size=32000, dim=2048, n_layers=24, n_heads=16, ffn_hidden=5632,
                              seq_len=1024),
    # ~3.3 B parameters: 16 bytes/param of AdamW training state (53 GB) does not fit one A100-40GB;
    # sharded over 4 GPUs (FSDP) it does.
    "a100_large": TransformerConfig(vocab_size=32000, dim=3072, n_layers=28, n_heads=24, ffn_hidden=8192,
                                    seq_len=1024),
    # 8 of Llama 3 8B's 32 layers at its own widths, vocabulary and sequence length: Llama 3's Table 3 (dim 4,096,
    # FFN 14,336, 32 heads, 8 key/value heads, RoPE theta 500,000; distlab.planner.sources 'llama3_table3_shape'),
    # the released tokenizer's 128,256 words (as the planner's 405B), torchtitan's llama3_8b.toml seq_len 8192
    # ('torchtitan_llama3_8b_toml'). Each layer's matrix multiplies are the 8B model's, and the whole (2.8 B
    # parameters, 45 GB of fp32 AdamW training state) fits one 80 GB GPU. Chapter 01 compares its single-GPU
    # throughput with torchtitan's published 8B runs.
    "llama3_8b_slice": TransformerConfig(vocab_size=128256, dim=4096, n_layers=8, n_heads=32, n_kv_heads=8,
                                         ffn_hidden=14336, seq_len=8192, rope_theta=500000.0),
}


def preset(name: str, **overrides) -> TransformerConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 even under bf16: the mean of squares loses precision otherwise.
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of rotary embeddings, each (seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (B, T, heads, head_dim) by position-dependent angles."""
    x_pairs = x.float().unflatten(-1, (-1, 2))
    x_even, x_odd = x_pairs[..., 0], x_pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1, not n_heads: under tensor parallelism this rank holds only its local heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if k.shape[2] != q.shape[2]:  # grouped-query attention: each k, v head serves q.heads / k.heads heads
            k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """LLaMA-style decoder. ``forward(tokens (B, T)) -> logits (B, T, vocab)``.

    ``layers`` is a ModuleDict keyed "0", "1", ... (as in torchtitan) so a pipeline stage can delete the
    layers it does not own and keep the names, and therefore the checkpoints, of the ones it keeps.
    Missing ``tok_embeddings``/``norm``/``output`` (set to None) make the model a middle pipeline stage.
    """

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        # Not persistent: derived from the config, so checkpoints do not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        seq = h.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def _init_transformer_(model: Transformer) -> None:
    # GPT-2/LLaMA-style: N(0, 0.02), with the projections that write into the residual stream scaled down
    # by sqrt(2 * layers) so the residual's variance does not grow with depth.
    residual_std = 0.02 / math.sqrt(2 * model.cfg.n_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif name.endswith(("wo.weight", "w2.weight")):
            nn.init.normal_(param, std=residual_std)
        else:
            nn.init.normal_(param, std=0.02)


def build_transformer(cfg: TransformerConfig | str = "tiny", seed: int = 0, device="cpu",
                      dtype: torch.dtype = torch.float32) -> Transformer:
    """The transformer with weights that depend only on ``seed`` (the global RNG is left untouched)."""
    cfg = preset(cfg) if isinstance(cfg, str) else cfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Transformer(cfg)
        _init_transformer_(model)
    return model.to(device=device, dtype=dtype)


# ---- "any model": what a user's own model often has, for the hand-written DDP and ZeRO to prove they take it ----

def make_any_model(model: Transformer) -> Transformer:
    """The transformer as a user's own model often is (chapters 04 and 05 train it with ``--any-model``):

    * the output head tied to the embedding: one weight under two names (one gradient, the two uses summed);
    * frozen parameters (``requires_grad=False``): the whole first block, as when fine-tuning the top of a model,
      and every norm: never reduced, never stepped, left as they were;
    * a bias on the head, one per token of the vocabulary (127 with ``--any-model``: a size no rank count above 1
      divides, so a sharded optimizer must pad it).
    """
    model.output.weight = model.tok_embeddings.weight
    model.output.bias = nn.Parameter(torch.zeros(model.output.out_features, device=model.output.weight.device))
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or name.startswith("layers.0."):
            param.requires_grad_(False)
    return model


def parameter_groups(model: nn.Module, lr: float, *, any_model: bool = False) -> list[dict]:
    """AdamW's parameter groups, frozen parameters left out. The plain model: one group (AdamW's defaults).
    ``any_model``: two, as training recipes set them: the matrices with weight decay 0.1; the embedding (with its
    tied head) and the bias without weight decay, at half the learning rate."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]   # a tied weight once
    if not any_model:
        return [{"params": [p for _, p in trainable]}]
    decayed = lambda n, p: p.dim() == 2 and "embeddings" not in n  # noqa: E731
    return [{"params": [p for n, p in trainable if decayed(n, p)], "weight_decay": 0.1},
            {"params": [p for n, p in trainable if not decayed(n, p)], "weight_decay": 0.0, "lr": lr / 2}]

class MLP(nn.Module):
    """``Linear -> GELU -> ... -> Linear``; layers named ``layers.0``, ``layers.2``, ... as in nn.Sequential."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        blocks: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            blocks.append(nn.Linear(fan_in, fan_out))
            if i < len(sizes) - 2:
                blocks.append(nn.GELU())
        self.layers = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build_mlp(sizes: list[int] = (32, 64, 64, 8), seed: int = 0, device="cpu") -> MLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(list(sizes))
    return model.to(device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def adamw_for_mixed_parameters(parameters, lr: float) -> torch.optim.AdamW:
    """AdamW for a model whose parameters are partly DTensors (sharded by TP or FSDP) and partly plain tensors
    (a norm left out of a TP plan, experts kept out of FSDP).

    On a GPU, AdamW defaults to its foreach kernels, and one foreach call cannot take DTensors and plain tensors
    together ("got mixed torch.Tensor and DTensor"); on the CPU it defaults to a loop, where the mix passes. So:
    foreach=True on every device (the CPU run takes the GPU's path), and one parameter group per kind (AdamW runs
    each group on its own; the update is the same as one group's)."""
    from torch.distributed.tensor import DTensor

    parameters = list(parameters)
    groups = [{"params": [p for p in parameters if isinstance(p, DTensor)]},
              {"params": [p for p in parameters if not isinstance(p, DTensor)]}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, foreach=True)


def train_reference(cfg: TransformerConfig, *, seed: int, lr: float, steps: int, batch: int, seq_len: int | None = None,
                    device="cpu", clip_grad_norm: float | None = None, grads_at_step: int = 0) -> dict:
    """The single-device run every parallel transformer script is checked against.

    The model built from the seed alone (never copied from a parallel one), each step's whole global batch
    (``distlab.data.token_batch``), AdamW. Returns ``losses`` (every step), ``first_grads`` (step 0, by
    parameter name, on the CPU; of step ``grads_at_step`` when given: a run resumed from a checkpoint compares its
    first step's) and ``params`` (after the last step, by name, on the CPU). With
    ``clip_grad_norm``, each step's gradients are clipped to that total norm by torch's ``clip_grad_norm_``, and
    ``grad_norms`` holds each step's norm before clipping.
    """
    from distlab import data

    seq_len = seq_len or cfg.seq_len
    model = build_transformer(cfg, seed=seed, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, first_grads, grad_norms = [], {}, []
    for step in range(steps):
        inputs, targets = data.split_inputs_targets(
            data.token_batch(step, batch, seq_len, cfg.vocab_size, seed).to(device))
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        if step == grads_at_step:
            first_grads = {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()}
        if clip_grad_norm is not None:
            grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "first_grads": first_grads, "params": params, "grad_norms": grad_norms}
