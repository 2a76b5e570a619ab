"""The chapter's tables (chapter 11's pages paste them; its text test recomputes them) and its decision path: four
questions, each asked once, that lead a case to the dimensions its layout needs."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from distlab import sizing
from distlab.planner.memory import memory_per_gpu
from distlab.planner.published import MIXTRAL_8X7B, MIXTRAL_8X22B, moe_params
from distlab.planner.search import best, fewest_nodes, rank_of, search, tune
from distlab.planner.spec import CLUSTERS, GIB, MODELS, Cluster, Layout, ModelSpec, Options
from distlab.planner.step_time import Plan, evaluate


def _gib(plan: Plan) -> str:
    total = plan.memory_per_gpu_bytes.get("total", float("nan"))
    return f"{total / GIB:.1f} GiB" if total == total else "-"


def _verdict(plan: Plan) -> str:
    return (f"fits, {_gib(plan)}, MFU {plan.mfu:.0%}" if plan.fits
            else f"does not fit: {plan.reason}" if plan.problems else f"does not fit ({_gib(plan)})")


def _verdict_set(plan: Plan) -> str:
    """The verdict with the settings it was evaluated at (micro-batch, recomputation...), which its MFU depends on."""
    return f"{_verdict(plan)} ({plan.describe_settings()})" if plan.fits else _verdict(plan)


def _best_with(plans: list[Plan], condition) -> Plan | None:
    return next((p for p in plans if condition(p.layout)), None)


# ---- the decision path: a tree of questions, each asked once, over a case (a model, a cluster, a GPU count) ----

@dataclass(frozen=True)
class DecisionCase:
    name: str
    model: ModelSpec
    cluster: Cluster
    gpus: int


def _replica_fits_one_gpu(case: DecisionCase) -> bool:
    """A whole replica (state, activations, buffers, reserve) on one GPU, as DDP holds it."""
    return evaluate(case.model, case.cluster, Layout(), Options(), 1).fits


def fsdp_one_sequence_bytes(model: ModelSpec, gpus: int) -> dict:
    """Memory per GPU by part for FSDP over ``gpus`` GPUs, one sequence a micro-batch, every block recomputed:
    page 11.1's second question, as it counts 7B by hand."""
    return memory_per_gpu(replace(model, micro_batch=1), Layout(dp=gpus, zero_stage=3), 0,
                          Options(activation_checkpointing="full"))


def _sequence_fits_beside_shards(case: DecisionCase) -> bool:
    """FSDP over every GPU, one sequence a micro-batch, every block recomputed: does it fit (the batch aside)?"""
    return fsdp_one_sequence_bytes(case.model, case.gpus)["total"] <= case.cluster.gpu_bytes


def _a_sequence_for_every_gpu(case: DecisionCase) -> bool:
    return case.model.global_batch >= case.gpus


# the path's rule of thumb, not the search's limit: from 32K, CP can split a sequence 4 ways with each share at least
# Options.cp_min_tokens (8,192) tokens. The search tries CP wherever a share keeps that many: CP 2 from 16K, where
# for 70B on 64 A100-40GB it only ties TP 2 (test_chapter_text_11.py)
LONG_SEQUENCE = 32768


def _long_sequence(case: DecisionCase) -> bool:
    return case.model.seq_len >= LONG_SEQUENCE


# each question: (its text, the planner's answer for a case, where "yes" leads, where "no" leads); a leaf is an
# outcome (the dimensions a layout adds). The tree is the flowchart of 11_decision_flowchart.png.
DECISION_QUESTIONS: dict[str, tuple[str, Callable[[DecisionCase], bool], str, str]] = {
    "replica": ("Does a whole replica fit on one GPU?", _replica_fits_one_gpu, "DDP", "sequence"),
    "sequence": ("Sharded by FSDP, does one sequence's activations fit?", _sequence_fits_beside_shards,
                 "batch", "long"),
    "batch": ("Does every GPU get a sequence of the batch?", _a_sequence_for_every_gpu, "FSDP", "TP + PP"),
    "long": ("Is a sequence 32K tokens or longer?", _long_sequence, "CP", "TP"),
}
DECISION_START = "replica"
# what each outcome means: the dimensions it adds and why
DECISION_OUTCOMES = {
    "DDP": "DDP: one replica per GPU",
    "FSDP": "FSDP over every GPU",
    "TP + PP": "TP in a node, PP across nodes, ZeRO or FSDP over the rest",
    "TP": "TP in a node, with SP; FSDP over the rest",
    "CP": "CP over the sequence (with TP and SP where it helps); FSDP over the rest",
}
# the outcome's dimensions, as the search's first choice for a case of that outcome must show them (tp, pp, cp)
OUTCOME_DIMENSIONS = {"DDP": (False, False, False), "FSDP": (False, False, False), "TP + PP": (True, True, False),
                      "TP": (True, False, False), "CP": (None, False, True)}


LLAMA_405B_4K = replace(MODELS["405b"], seq_len=4096, global_batch=4096)


def decision_cases() -> list[DecisionCase]:
    c = CLUSTERS
    return [DecisionCase("1B on 8 A100-80GB", MODELS["1b"], c["a100-80gb"], 8),
            DecisionCase("7B on 4 nodes of 4 A100-40GB", MODELS["7b"], c["a100-40gb"], 16),
            DecisionCase("70B, 16K-token sequences, on 16 nodes of 4 A100-40GB",
                         replace(MODELS["70b"], seq_len=16384, global_batch=256), c["a100-40gb"], 64),
            # Llama 3's 16M tokens a step, in 4K-token sequences: at its 8K, FSDP over every GPU cannot hold one
            # sequence beside its gathered units (question 2: no), and the path goes to TP
            DecisionCase("405B, 4K-token sequences, on 16,384 H100-80GB", LLAMA_405B_4K, c["h100-80gb"], 16384),
            DecisionCase("70B, 32K-token sequences, on 64 H100-80GB",
                         replace(MODELS["70b"], seq_len=32768, global_batch=128), c["h100-80gb"], 64),
            DecisionCase("70B, 128K-token sequences, on 64 H100-80GB",
                         replace(MODELS["70b"], seq_len=131072, global_batch=32), c["h100-80gb"], 64)]


def decision_route(case: DecisionCase, questions=None, start: str = DECISION_START) -> tuple[list[tuple[str, bool]], str]:
    """The questions a case meets, each with the planner's answer, and the outcome it reaches."""
    questions = DECISION_QUESTIONS if questions is None else questions
    route, node = [], start
    while node in questions:
        text, answer, yes, no = questions[node]
        said = bool(answer(case))
        route.append((node, said))
        node = yes if said else no
    return route, node


def _path_words(route: list[tuple[str, bool]], outcome: str) -> str:
    return ", ".join(f"{DECISION_QUESTIONS[q][0].rstrip('?')}: {'yes' if a else 'no'}" for q, a in route) \
        + f". So: {outcome}"


def decision_path() -> list[dict]:
    """The chapter's worked cases: each case, its route through the decision path, and what the planner says."""
    cases = decision_cases()
    steps = []
    one_case = cases[0]
    one = tune(one_case.model, one_case.cluster, Layout(), Options(), 1)
    plans = search(one_case.model, one_case.cluster, one_case.gpus)
    ddp = _best_with(plans, lambda l: l.zero_stage == 0 and l.tp == l.pp == 1)
    answers = [f"one GPU: {_verdict_set(one)}; DDP on 8: {_verdict_set(ddp)}, place {rank_of(plans, ddp.layout)} "
               f"of {sum(p.fits for p in plans)}"]
    seven = cases[1]
    plans = search(seven.model, seven.cluster, seven.gpus)
    ddp, fsdp = (evaluate(seven.model, seven.cluster, Layout(dp=seven.gpus, zero_stage=z)) for z in (0, 3))
    answers.append(f"DDP: {_verdict(ddp)}; FSDP dp={seven.gpus}: {_verdict_set(fsdp)}; best: "
                   f"{plans[0].layout.label()}, {_verdict_set(plans[0])}")
    # 16K-token sequences (4M tokens a step): FSDP's traffic hides on Derecho's four NICs a node, its activations do
    # not fit beside the state
    wide = cases[2]
    plans = search(wide.model, wide.cluster, wide.gpus)
    fsdp = tune(wide.model, wide.cluster, Layout(dp=64, zero_stage=3))
    answers.append(f"FSDP alone (dp=64): {_verdict(fsdp)}; best: {plans[0].layout.label()}, {_verdict(plans[0])}")
    big = cases[3]
    plans = search(big.model, big.cluster, big.gpus)
    flat = _best_with(plans, lambda l: l.pp == 1)
    answers.append(f"best without PP: {flat.layout.label()}, {_verdict(flat)}; "
                   f"best: {plans[0].layout.label()}, {_verdict_set(plans[0])}")
    long = cases[4]
    no_sp, sp = (evaluate(long.model, long.cluster, Layout(8, 8, 1, 1, 1), Options(sequence_parallel=s), 64)
                 for s in (False, True))
    plans = search(long.model, long.cluster, long.gpus)
    flat = _best_with(plans, lambda l: l.cp == 1)
    answers.append(f"tp=8,pp=8: activations {no_sp.memory_per_gpu_bytes['activations'] / GIB:.1f} GiB without SP, "
                   f"{sp.memory_per_gpu_bytes['activations'] / GIB:.1f} GiB with SP; best without CP: "
                   f"{flat.layout.label()}, MFU {flat.mfu:.0%} ({flat.describe_settings()}); best: "
                   f"{plans[0].layout.label()}, MFU {plans[0].mfu:.0%} ({plans[0].describe_settings()})")
    longest = cases[5]
    without_sp = search(longest.model, longest.cluster, longest.gpus, Options(sequence_parallel=False))
    plans = search(longest.model, longest.cluster, longest.gpus)
    fitting = sum(p.fits for p in without_sp if p.layout.cp == 1)
    flat = _best_with(plans, lambda l: l.cp == 1)
    answers.append(f"without SP, {'no layout' if not fitting else f'{fitting} layouts'} without CP "
                   f"{'fits' if not fitting else 'fit'}; with SP, best without CP: {flat.layout.label()}, "
                   f"{_verdict(flat)}; best: {plans[0].layout.label()}, {_verdict(plans[0])}")
    for case, answer in zip(cases, answers):
        route, outcome = decision_route(case)
        steps.append({"case": case.name, "route": route, "outcome": outcome, "path": _path_words(route, outcome),
                      "answer": answer})
    return steps


def decision_path_markdown() -> str:
    lines = ["| case | the questions answered, by number | what the planner says (derived) |", "|---|---|---|"]
    number = {node: i + 1 for i, node in enumerate(DECISION_QUESTIONS)}
    for s in decision_path():
        said = ", ".join(f"{number[q]} {'yes' if a else 'no'}" for q, a in s["route"])
        lines.append(f"| {s['case']} | {said}: **{s['outcome']}** | {s['answer']} |")
    return "\n".join(lines)


# the search's first choice first, then one degree raised at the others' expense
TRADEOFF_LAYOUTS = (Layout(4, 4, 4, 1, 1), Layout(1, 8, 8, 1, 3), Layout(2, 8, 4, 1, 3), Layout(8, 8, 1, 1, 1),
                    Layout(8, 1, 8, 1, 3), Layout(8, 2, 4, 1, 1), Layout(8, 4, 2, 1, 1), Layout(2, 2, 16, 1, 3),
                    Layout(1, 2, 32, 1, 3))


def tradeoffs_markdown(model: str = "70b", cluster: str = "h100-80gb", gpus: int = 64) -> str:
    """Raising one degree at the others' expense, each layout with the settings the search gives it: whether it
    fits, memory, the seconds of each dimension's traffic and what of it stays exposed, bubble, MFU."""
    lines = [f"| {model} on {gpus} x {cluster} | settings | fits | GiB per GPU | TP s (exposed) | DP s (exposed) | "
             "PP s (all sends; only fill and drain exposed) | bubble (of the step) | step s | MFU |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for layout in TRADEOFF_LAYOUTS:
        plan = tune(MODELS[model], CLUSTERS[cluster], layout, Options(), gpus)
        s, e = plan.comm_seconds, plan.exposed_seconds
        lines.append(f"| {layout.label()} | {plan.describe_settings()} | {'yes' if plan.fits else '**no**'} | "
                     f"{plan.memory_per_gpu_bytes['total'] / GIB:.1f} | {s['tp']:.2f} ({e['tp']:.2f}) | "
                     f"{s['dp']:.2f} ({e['dp']:.2f}) | {s['pp']:.2f} | {plan.bubble['of_step']:.1%} | "
                     f"{plan.step_seconds:.1f} | {plan.mfu:.1%} |")
    return "\n".join(lines)


def sizing_check_markdown() -> str:
    """Chapter 09's guide (TP = a node, FSDP over nodes) against the planner's search over every layout, for every
    model of chapter 09's table."""
    lines = ["| model | chapter 09: fewest nodes, TP 4 x FSDP | planner: fewest nodes, any layout | "
             "its layout there |", "|---|---:|---:|---|"]
    for name in sizing.LLAMA_SHAPES:
        spec = MODELS[name.lower()]
        nodes = fewest_nodes(spec, CLUSTERS["a100-40gb"])
        plan = best(spec, CLUSTERS["a100-40gb"], nodes * CLUSTERS["a100-40gb"].gpus_per_node)
        lines.append(f"| {name} | {sizing.min_nodes(name)} | {nodes} | {plan.layout.label()} |")
    return "\n".join(lines)


def moe_markdown() -> str:
    counted = moe_params(**MIXTRAL_8X7B)
    return (f"Mixtral 8x7B: {counted['total'] / 1e9:.1f} B parameters stored (every expert), "
            f"{counted['active'] / 1e9:.1f} B used per token (2 of 8 experts), not the "
            f"{counted['naive_name'] / 1e9:.0f} B its name suggests. Memory follows the {counted['total'] / 1e9:.1f} B "
            f"({16 * counted['total'] / GIB:.0f} GiB of mixed-precision AdamW state); "
            f"FLOPs per token follow the {counted['active'] / 1e9:.1f} B.")


def moe_correction_markdown() -> str:
    """The seed's Mixtral 8x22B row gave "141B active": 141 B is what it stores."""
    counted = moe_params(**MIXTRAL_8X22B)
    return (f"Mixtral 8x22B stores {counted['total'] / 1e9:.0f} B parameters and uses "
            f"{counted['active'] / 1e9:.0f} B per token")


# Megatron-Core's MoE README: "With MCore v0.9, we've achieved remarkable performance of **468 TFLOPS** for Mixtral
# 8X7B bf16 training" (sources.SOURCES["megatron_moe_readme_468_tflops"])
MIXTRAL_MCORE_TFLOPS = 468


def moe_at_scale() -> dict:
    """Chapter 13's numbers at scale (derived, except the published ones named so): DeepSeek-V3 counted and its
    published layout evaluated, with the all-to-alls on the critical path and hidden (DualPipe); Mixtral 8x7B's
    best layout on 64 H100s."""
    from distlab.planner.communication import all_to_all_seconds, collective_calls, comm_per_step
    from distlab.planner.published import (DEEPSEEK_V3, DEEPSEEK_V3_GPU_HOURS_PER_TRILLION_TOKENS,
                                           DEEPSEEK_V3_LAYOUT, DEEPSEEK_V3_OPTIONS, DEEPSEEK_V3_PUBLISHED, H800)
    from distlab.planner.step_time import stage_time

    layout = DEEPSEEK_V3_LAYOUT
    exposed, hidden = (tune(DEEPSEEK_V3, H800, layout, replace(DEEPSEEK_V3_OPTIONS, ep_overlap=overlap))
                       for overlap in (False, True))
    settings = replace(DEEPSEEK_V3_OPTIONS, activation_checkpointing=hidden.settings["checkpointing"],
                       chunks=hidden.settings["chunks"])
    gpn = H800.gpus_per_node

    def leaving_bytes(s):
        return sum(comm_per_step(DEEPSEEK_V3, layout, s, settings, gpn)["ep"].values())

    stage = max(range(layout.pp), key=lambda s: (leaving_bytes(s), -s))
    per_link = comm_per_step(DEEPSEEK_V3, layout, stage, settings, gpn)["ep"]
    leaving = sum(per_link.values())
    links = all_to_all_seconds(layout, H800, per_link,
                               sum(collective_calls(DEEPSEEK_V3, layout, stage, settings, gpn)["ep"].values()))
    timing = stage_time(DEEPSEEK_V3, H800, layout, stage, settings)
    # Megatron-Core's reference mapping for Mixtral 8x7B (its MoE README: 64 H100, seq 4096, TP 1, EP 8, PP 4, VP 8,
    # MBS 1, GBS 256; MCore v0.8) beside the 468 TFLOP/s it states for v0.9 without a configuration
    mapping = tune(replace(MODELS["mixtral-8x7b"], seq_len=4096, global_batch=256, micro_batch=1),
                   CLUSTERS["h100-80gb"], Layout(tp=1, pp=4, dp=16, zero_stage=1, ep=8),
                   Options(chunks=8, search_micro_batch=False))
    mixtral = search(MODELS["mixtral-8x7b"], CLUSTERS["h100-80gb"], 64)
    best_mixtral = next(p for p in mixtral if p.fits)
    no_ep = next(p for p in mixtral if p.fits and p.layout.ep == 1)
    return {"total": DEEPSEEK_V3.num_params(), "active": DEEPSEEK_V3.active_params(),
            "published": DEEPSEEK_V3_PUBLISHED, "layout": layout.label(), "fits": hidden.fits,
            "gib": hidden.memory_per_gpu_bytes["total"] / GIB, "settings": hidden.describe_settings(),
            "stage": stage, "all_to_all_gb": leaving / 1e9, "network_share": links["inter_node_bytes"] / leaving,
            "network_gb": links["inter_node_bytes"] / 1e9, "all_to_all_s": links["total"],
            "compute_s": timing["compute"], "compute_to_all_to_all": timing["compute"] / links["total"],
            "tokens_per_gpu_exposed": exposed.tokens_per_second / layout.gpus,
            "tokens_per_gpu_hidden": hidden.tokens_per_second / layout.gpus,
            "exposed_ep_s": exposed.exposed_seconds["ep"], "step_exposed_s": exposed.step_seconds,
            "step_hidden_s": hidden.step_seconds,
            "tokens_per_gpu_published": 1e12 / (DEEPSEEK_V3_GPU_HOURS_PER_TRILLION_TOKENS * 3600),
            "mixtral_best": best_mixtral.layout.label(), "mixtral_best_mfu": best_mixtral.mfu,
            "mixtral_no_ep": no_ep.layout.label(), "mixtral_no_ep_mfu": no_ep.mfu,
            "mixtral_mapping_mfu": mapping.mfu, "mixtral_mapping_fits": mapping.fits,
            "mixtral_published_mfu": MIXTRAL_MCORE_TFLOPS * 1e12 / CLUSTERS["h100-80gb"].peak_flops}


def moe_at_scale_markdown(numbers: dict | None = None) -> str:
    """The table chapter 13 pastes (derived rows say so; the published ones cite DeepSeek-V3's report)."""
    n = numbers or moe_at_scale()
    rows = [
        ("DeepSeek-V3's parameters, stored / used per token", f"{n['total'] / 1e9:.1f} B / {n['active'] / 1e9:.1f} B",
         f"{n['published']['total'] / 1e9:.0f} B / {n['published']['active'] / 1e9:.0f} B (its abstract)"),
        (f"its layout, {n['layout']}, on 2,048 H800", f"fits: {n['gib']:.1f} GiB a GPU ({n['settings']})",
         "trained (section 3.2)"),
        (f"all-to-all bytes a GPU sends in a step (stage {n['stage']}, node-limited routing, FP8 dispatch)",
         f"{n['all_to_all_gb']:,.0f} GB, {n['network_share']:.0%} of it over InfiniBand", "-"),
        ("that stage's compute : all-to-all time", f"{n['compute_to_all_to_all']:.1f} : 1 ({n['compute_s']:.1f} s : "
         f"{n['all_to_all_s']:.1f} s)", "about 1 : 1 (section 3.2.1)"),
        ("tokens/s a GPU, all-to-alls on the critical path",
         f"{n['tokens_per_gpu_exposed']:,.0f} (step {n['step_exposed_s']:.1f} s)", "-"),
        ("tokens/s a GPU, all-to-alls hidden behind compute (DualPipe)",
         f"{n['tokens_per_gpu_hidden']:,.0f} (step {n['step_hidden_s']:.1f} s)",
         f"{n['tokens_per_gpu_published']:,.0f} (180K GPU hours a trillion tokens, section 1)"),
        ("Mixtral 8x7B on 64 H100: the search's best",
         f"{n['mixtral_best']} (MFU {n['mixtral_best_mfu']:.1%})", "-"),
        ("... its best without EP", f"{n['mixtral_no_ep']} (MFU {n['mixtral_no_ep_mfu']:.1%})", "-"),
        ("Mixtral 8x7B at Megatron-Core's reference mapping (64 H100, tp=1,pp=4,dp=16,ep=8, 8 chunks)",
         f"MFU {n['mixtral_mapping_mfu']:.1%}", f"468 TFLOP/s, {n['mixtral_published_mfu']:.1%} of the bf16 peak "
         "(MCore v0.9, its MoE README; no configuration stated)"),
    ]
    lines = ["| what | the planner (derived) | published (measured) |", "|---|---|---|"]
    lines += [f"| {what} | {derived} | {published} |" for what, derived, published in rows]
    return "\n".join(lines)
