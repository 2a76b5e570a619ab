"""What full recomputation computes again, counted on torch's own checkpoint against the planner's
``stage_flops(...)["recompute"]``.

A block is checkpointed as the course's scripts do it (non-reentrant, torch's default early stop) and run forward and
backward on CPU under ``FlopCounterMode``, attention on the math kernel so that its two s x s products are counted as
matmuls. The GEMM FLOPs of that backward less those of the same block's backward without checkpointing are what the
recomputation ran. The planner also charges 2 FLOPs a parameter to the norms' and biases' weights, which no GEMM
multiplies: added from the torch module's own one-dimensional parameters. Torch's early stop leaves out the block's
last GEMM (the down projection; a MoE layer's shared expert's); with ``set_checkpoint_early_stop(False)`` the whole
forward runs again, as Megatron's recompute does (``Options.recompute_early_stop=False``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from distlab import models, moe, planner
from distlab.planner.step_time import last_gemm_flops, stage_flops

BATCH, SEQ = 2, 16


def _backward_flops(run, x, *, checkpointed: bool, early_stop: bool = True) -> int:
    """GEMM FLOPs of one backward of ``run(x)`` (forward not counted)."""
    with sdpa_kernel(SDPBackend.MATH), set_checkpoint_early_stop(early_stop):
        out = checkpoint(run, x, use_reentrant=False) if checkpointed else run(x)
        counter = FlopCounterMode(display=False)
        with counter:
            out.float().square().sum().backward()
    return counter.get_total_flops()


def recomputed_flops(run, x, early_stop: bool) -> int:
    return (_backward_flops(run, x.clone().requires_grad_(), checkpointed=True, early_stop=early_stop)
            - _backward_flops(run, x.clone().requires_grad_(), checkpointed=False))


def vector_params(module) -> int:
    """Norm weights and biases: parameters no GEMM multiplies, which the planner charges 2 FLOPs each."""
    return sum(p.numel() for p in module.parameters() if p.dim() == 1)


def planned(spec, early_stop: bool) -> float:
    options = planner.Options(activation_checkpointing="full", recompute_early_stop=early_stop)
    return stage_flops(spec, planner.Layout(), 0, options)["recompute"]


def llama_case():
    cfg = models.TransformerConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=88,
                                   seq_len=SEQ)
    torch.manual_seed(0)
    block = models.TransformerBlock(cfg)
    cos, sin = models.rope_tables(cfg.head_dim, SEQ)
    spec = planner.ModelSpec("block", 1, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.vocab_size, SEQ,
                             BATCH, BATCH)
    return spec, block, lambda x: block(x, cos, sin)


def gpt_case():
    h, heads, f = 32, 4, 128
    torch.manual_seed(0)
    # GPT's block as torch builds it (pre-norm, GELU MLP, biases), dropout 0 as large runs train
    layer = torch.nn.TransformerEncoderLayer(h, heads, f, dropout=0.0, activation="gelu", batch_first=True,
                                             norm_first=True)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(SEQ)
    spec = planner.ModelSpec("gpt-block", 1, h, heads, heads, f, 64, SEQ, BATCH, BATCH, architecture="gpt")
    return spec, layer, lambda x: layer(x, src_mask=mask, is_causal=True)


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("case", [llama_case, gpt_case], ids=["llama", "gpt"])
def test_the_recomputed_forward_is_what_torchs_checkpoint_runs_again(case, early_stop):
    spec, module, run = case()
    x = torch.randn(BATCH, SEQ, spec.hidden)
    counted = recomputed_flops(run, x, early_stop) + 2 * vector_params(module) * BATCH * SEQ
    assert planned(spec, early_stop) == counted, (planned(spec, early_stop), counted)


def test_early_stop_skips_exactly_the_down_projection():
    """The difference between the two settings is one GEMM: the MLP's down projection, 2 h f a token."""
    spec, _, run = llama_case()
    x = torch.randn(BATCH, SEQ, spec.hidden)
    skipped = recomputed_flops(run, x, False) - recomputed_flops(run, x, True)
    assert skipped == 2 * spec.hidden * spec.ffn * BATCH * SEQ == last_gemm_flops(spec) * BATCH * SEQ


def test_a_moe_layer_with_a_shared_expert_skips_the_shared_down_projection():
    """distlab.moe's layer: the routed experts' outputs are saved by their weighting, so they run again; the shared
    expert runs last, and its down projection does not. Without a shared expert nothing is skipped."""
    for shared in (True, False):
        cfg = moe.MoEConfig(dim=32, ffn_hidden=48, num_experts=4, top_k=2, shared_expert=shared)
        torch.manual_seed(0)
        layer = moe.MoE(cfg)
        tokens = BATCH * SEQ
        x = torch.randn(tokens, cfg.dim)
        skipped = recomputed_flops(lambda t: layer(t)[0], x, False) - recomputed_flops(lambda t: layer(t)[0], x, True)
        spec = planner.ModelSpec("moe", 1, cfg.dim, 4, 4, 64, 64, SEQ, BATCH, BATCH, experts=cfg.num_experts,
                                 top_k=cfg.top_k, expert_ffn=cfg.ffn_hidden, shared_experts=int(shared))
        assert skipped == last_gemm_flops(spec, moe=True) * tokens == (2 * cfg.dim * cfg.ffn_hidden * tokens
                                                                      if shared else 0)
