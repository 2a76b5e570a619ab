"""The search over every layout of a GPU count, and the questions asked of it (best, rank, fewest nodes)."""

from __future__ import annotations

import functools
import itertools
from copy import copy as _shallow_copy
from dataclasses import fields as _fields
from dataclasses import replace

from distlab.planner.memory import memory_per_gpu
from distlab.planner.spec import CHECKPOINTING, ZERO_STAGES, Cluster, Layout, ModelSpec, Options, layout_problems
from distlab.planner.step_time import Plan, evaluate, rejected

MICRO_BATCHES = (1, 2, 4, 8)  # sequences per microbatch the search tries (those that divide a replica's batch)
CHUNKS = (1, 2, 4, 8)         # the interleaved schedule's stages per rank the search tries (1: plain 1F1B)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cp_degrees(model: ModelSpec, ways: int, options: Options = Options()) -> list[int]:
    """The CP degrees the search evaluates where ``ways`` GPUs are left after TP and PP: ``options.context_parallel``
    when it is set; else 1 and every divisor of ``ways`` that leaves each rank at least ``options.cp_min_tokens``
    tokens of a sequence (an assumption, stated: the estimate counts CP's bytes, which hide behind attention, and
    times each GEMM with s / cp rows, which finds short shares almost free; it does not see a real ring's cost beyond
    its bytes, each hop's attention kernel on a shorter block and its synchronisation; LLaMA 3 405B used CP 16 only
    for its 128K-token stage, 8K per rank)."""
    if options.context_parallel is not None:
        return [options.context_parallel] if ways % options.context_parallel == 0 else []
    return [c for c in divisors(ways) if c == 1 or model.seq_len // c >= options.cp_min_tokens]


def expert_parallel_degrees(model: ModelSpec, dp: int, tp: int = 1, cp: int = 1) -> list[int]:
    """The EP degrees (above 1) the search tries for a MoE model over ``dp`` data-parallel ranks of ``cp x tp``:
    torchtitan's, every cp and tp rank and a divisor of dp of the data-parallel ones, where the experts split."""
    if not model.is_moe:
        return []
    return [k * cp * tp for k in divisors(dp) if k * cp * tp > 1 and model.experts % (k * cp * tp) == 0]


def candidate_layouts(model: ModelSpec, cluster: Cluster, gpus: int, options: Options = Options()) -> list[Layout]:
    """Every (tp, pp, cp, dp) with tp x pp x cp x dp = gpus: tp a divisor of the node, every CP degree (only
    ``options.context_parallel`` when it is set), each ZeRO stage tried. Sizes that do not divide the model (heads
    over TP, layers over PP, the sequence over CP, the batch over DP) stay in the list: :func:`evaluate` rejects
    them with their reason, and :func:`search` the CP degrees :func:`cp_degrees` leaves out. HSDP is tried
    where it keeps FSDP's group inside a node: ZeRO-3 with the shard group a node's worth of dp ranks. A MoE
    model's layouts come again with each EP degree (:func:`expert_parallel_degrees`)."""
    stages = (options.zero_stage,) if options.zero_stage is not None else ZERO_STAGES
    layouts = []
    for tp in divisors(cluster.gpus_per_node):
        if gpus % tp:
            continue
        for pp in divisors(gpus // tp):
            rest = gpus // (tp * pp)
            for cp in divisors(rest) if options.context_parallel is None else cp_degrees(model, rest, options):
                for stage in stages:
                    layouts.append(Layout(tp, pp, rest // cp, cp, stage))
                    # a MoE model: every EP degree that divides dp and the experts
                    layouts += [Layout(tp, pp, rest // cp, cp, stage, ep=ep) for ep in expert_parallel_degrees(
                        model, rest // cp, tp, cp)]
                # HSDP: FSDP's shards inside a node (dp ranks of a node's tp groups), replicated across nodes
                shard = cluster.gpus_per_node // tp
                dp = rest // cp
                if 3 in stages and cp == 1 and 1 < shard < dp and dp % shard == 0:
                    layouts.append(Layout(tp, pp, dp, cp, 3, shard))
    return layouts


def search_rule_problems(model: ModelSpec, layout: Layout, options: Options = Options()) -> list[str]:
    """The search's own reason to leave a layout out (a CP share shorter than ``options.cp_min_tokens``)."""
    if layout.cp in cp_degrees(model, layout.cp * layout.dp, options):
        return []
    return [f"CP {layout.cp} leaves {model.seq_len // layout.cp} tokens of a sequence per rank, fewer than the "
            f"search's {options.cp_min_tokens} (--cp-min-tokens), an assumption: the estimate finds short shares almost "
            f"free, but does not see a real ring's cost beyond its bytes (each hop's kernel and synchronisation)"]


def variants(model: ModelSpec, layout: Layout, options: Options = Options()) -> list[tuple[ModelSpec, Options]]:
    """The settings the search tries for one layout, each a (model, options) pair with concrete values: the
    micro-batch (``search_micro_batch``), the interleaved schedule's chunks (``chunks`` None, under PP), the
    checkpointing mode (``activation_checkpointing`` None; selective only without flash attention, where it
    saves memory: with a flash-attention kernel it saves what none saves and recomputes more), and FSDP's
    gathered weights over the microbatches (``fsdp_keep_gathered`` None, FSDP without PP)."""
    per_replica = model.global_batch // layout.dp
    micro = [b for b in MICRO_BATCHES if per_replica % b == 0] if options.search_micro_batch else [model.micro_batch]
    interleaved = options.schedule == "interleaved_1f1b" and options.chunks is None and layout.pp > 1
    chunk_choices = [v for v in CHUNKS if layout.pp * v <= model.layers + 2] if interleaved else [options.chunks]
    modes = CHECKPOINTING if options.activation_checkpointing is None else [options.activation_checkpointing]
    modes = [m for m in modes if m != "selective" or not options.flash_attention or len(modes) == 1]
    keep = [True, False] if options.fsdp_keep_gathered is None and layout.zero_stage == 3 and layout.pp == 1 \
        else [options.fsdp_keep_gathered]
    return [(replace(model, micro_batch=b), replace(options, chunks=v, activation_checkpointing=m,
                                                     fsdp_keep_gathered=k))
            for b, v, m, k in itertools.product(micro or [model.micro_batch], chunk_choices, modes, keep)]


def tune(model: ModelSpec, cluster: Cluster, layout: Layout, options: Options = Options(),
         gpus: int | None = None) -> Plan:
    """One layout with the settings the search chooses (:func:`variants`): the fastest that fits; when none fits,
    the one that needs least memory, with its reason. Memory first, time only for those that fit."""
    problems = layout_problems(model, cluster, layout, gpus, options)
    if problems:
        return rejected(layout, cluster, problems)
    fitting, smallest = [], None
    for spec, settings in variants(model, layout, options):
        if layout_problems(spec, cluster, layout, gpus, settings):
            continue
        need = max(memory_per_gpu(spec, layout, s, settings)["total"] for s in {0, layout.pp - 1})
        if need <= cluster.gpu_bytes:
            fitting.append((spec, settings))
        elif smallest is None or need < smallest[0]:
            smallest = (need, spec, settings)
    if fitting:
        return max((evaluate(spec, cluster, layout, settings, gpus) for spec, settings in fitting),
                   key=lambda plan: plan.tokens_per_second)
    if smallest is None:
        return evaluate(model, cluster, layout, options, gpus)
    return evaluate(smallest[1], cluster, layout, smallest[2], gpus)


def search(model: ModelSpec, cluster: Cluster, gpus: int, options: Options = Options()) -> list[Plan]:
    """Every layout of ``gpus`` GPUs evaluated: those that fit first, by estimated tokens/s, then the others
    with their reasons (invalid ones, and those the search's CP rule leaves out, last).

    The same question asked twice in one process is answered once (a chapter's tables and their tests ask
    the same searches again): the arguments are frozen dataclasses; each caller gets copies of the cached plans
    (a Plan's dicts and lists are mutable), so a caller that edits what it got cannot change the next answer. The
    cache does not see module state: code that patches the planner's functions calls ``_search.cache_clear()``."""
    return [_own_copy(plan) for plan in _search(model, cluster, gpus, options)]


def _fresh(value):
    if type(value) is dict:
        return {key: _fresh(item) for key, item in value.items()}
    if type(value) is list:
        return [_fresh(item) for item in value]
    return value   # numbers, strings, frozen dataclasses


def _own_copy(plan: Plan) -> Plan:
    """The plan with dicts and lists of its own (a third of ``copy.deepcopy``'s time)."""
    mine = _shallow_copy(plan)
    for field in _fields(plan):
        value = getattr(plan, field.name)
        if type(value) in (dict, list):
            setattr(mine, field.name, _fresh(value))
    return mine


@functools.lru_cache(maxsize=64)
def _search(model: ModelSpec, cluster: Cluster, gpus: int, options: Options) -> tuple[Plan, ...]:
    plans = []
    for layout in candidate_layouts(model, cluster, gpus, options):
        rule = search_rule_problems(model, layout, options)
        plans.append(rejected(layout, cluster, layout_problems(model, cluster, layout, gpus, options) + rule)
                     if rule else tune(model, cluster, layout, options, gpus))
    return tuple(sorted(plans, key=lambda p: (not p.fits, bool(p.problems), -p.tokens_per_second,
                                              p.memory_per_gpu_bytes.get("total", 0))))


def best(model: ModelSpec, cluster: Cluster, gpus: int, options: Options = Options()) -> Plan | None:
    plans = search(model, cluster, gpus, options)
    return plans[0] if plans and plans[0].fits else None


def rank_of(plans: list[Plan], layout: Layout) -> int | None:
    """1-based place of ``layout`` among the plans that fit; None when it does not fit."""
    fitting = [p.layout for p in plans if p.fits]
    return fitting.index(layout) + 1 if layout in fitting else None


def fewest_nodes(model: ModelSpec, cluster: Cluster, options: Options = Options(), max_nodes: int = 512) -> int | None:
    """The fewest nodes on which some layout fits (the search on each node count)."""
    for nodes in range(1, max_nodes + 1):
        if best(model, cluster, nodes * cluster.gpus_per_node, options):
            return nodes
    return None
