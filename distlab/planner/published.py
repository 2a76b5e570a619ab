"""Published layouts reproduced, and mixtures of experts counted."""

from __future__ import annotations

from dataclasses import replace

from distlab.planner.search import rank_of, search
from distlab.planner.spec import CLUSTERS, GIB, MODELS, Layout, Options
from distlab.planner.step_time import evaluate

PUBLISHED = (
    {"model": "gpt3-175b", "cluster": "v100-32gb", "gpus": 1024, "layout": Layout(8, 8, 16, 1, 1),
     "options": Options(schedule="1f1b"), "claim": "GPT-3 175B on 1024 V100 (TP 8, PP 8, DP 16)"},
    {"model": "mt-nlg-530b", "cluster": "a100-80gb", "gpus": 2240, "layout": Layout(8, 35, 8, 1, 1),
     "options": Options(schedule="1f1b"), "claim": "MT-NLG 530B on 2240 A100-80GB (TP 8, PP 35, DP 8)"},
    {"model": "405b", "cluster": "h100-80gb", "gpus": 16384, "layout": Layout(8, 16, 128, 1, 1),
     "options": Options(schedule="interleaved_1f1b", chunks=2, sequence_parallel=True),
     "claim": "LLaMA 3 405B on 16K H100 (TP 8, PP 16, DP 128, sequence parallel, interleaved 1F1B)"},
    {"model": "405b", "cluster": "h100-80gb", "gpus": 16384, "layout": Layout(8, 16, 8, 16, 1),
     "sizes": {"seq_len": 131072, "global_batch": 128},  # its long-context stage: 16M tokens a step, 128K each
     "options": Options(schedule="interleaved_1f1b", chunks=2, sequence_parallel=True),
     "claim": "LLaMA 3 405B, 128K-token sequences, on 16K H100 (TP 8, CP 16, PP 16, DP 8)"},
)


def published_table() -> list[dict]:
    """Each published layout: evaluated, and its place in the search over the same GPUs (ZeRO-1, as each used
    a sharded optimizer; the search also tries DDP and FSDP)."""
    rows = []
    for entry in PUBLISHED:
        model, cluster = replace(MODELS[entry["model"]], **entry.get("sizes", {})), CLUSTERS[entry["cluster"]]
        plan = evaluate(model, cluster, entry["layout"], entry["options"], entry["gpus"])
        plans = search(model, cluster, entry["gpus"], entry["options"])
        top = plans[0]
        rows.append({"claim": entry["claim"], "model": entry["model"], "cluster": entry["cluster"],
                     "gpus": entry["gpus"], "layout": entry["layout"].label(), "fits": plan.fits,
                     "gib_per_gpu": plan.memory_per_gpu_bytes["total"] / GIB, "mfu": plan.mfu,
                     "rank": rank_of(plans, entry["layout"]), "fitting": sum(p.fits for p in plans),
                     "candidates": len(plans), "best": top.layout.label(), "best_mfu": top.mfu})
    return rows


def published_table_markdown() -> str:
    lines = ["| published layout | fits (derived) | GiB per GPU (derived) | MFU (derived) | place among "
             "layouts that fit | the planner's first choice (MFU) |", "|---|---|---:|---:|---:|---|"]
    for r in published_table():
        lines.append(f"| {r['claim']} | {'yes' if r['fits'] else 'no'} | {r['gib_per_gpu']:.1f} | {r['mfu']:.0%} | "
                     f"{r['rank']} of {r['fitting']} | {r['best']} ({r['best_mfu']:.0%}) |")
    return "\n".join(lines)


# Mixture of experts: a published table that lists total parameters as the per-token ones (or the reverse)
# gets the memory (all experts are stored) or the compute (only top_k run) wrong. Mixtral 8x7B's shape:
MIXTRAL_8X7B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "vocab": 32000,
                "experts": 8, "top_k": 2}


def moe_params(layers, hidden, heads, kv_heads, ffn, vocab, experts, top_k) -> dict:
    """Total (stored: every expert) and active (used per token: top_k experts) parameters of a LLaMA-style
    mixture of experts with a router per layer."""
    kv_dim = kv_heads * hidden // heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim
    expert = 3 * hidden * ffn
    shared = 2 * vocab * hidden + hidden + layers * (attention + 2 * hidden + hidden * experts)
    return {"total": shared + layers * experts * expert, "active": shared + layers * top_k * expert,
            "naive_name": experts * 7e9}

