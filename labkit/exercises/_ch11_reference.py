"""Lab 11's reference answers, which :mod:`labkit.exercises.ch11`'s checks import inside themselves: the lab imports
ch11 as ``exercises``, and none of these is reachable through that name. A determined reader can import this module;
the lab says plainly that the planner's own calls, which give the same answers, are allowed."""

from __future__ import annotations

from dataclasses import replace

from labkit.exercises.ch11 import _OUTCOME_LAYOUT, CASE


def _case(model: str, cluster: str, gpus: int):
    from distlab import planner

    return planner.DecisionCase(f"{model} on {gpus} {cluster}", planner.MODELS[model], planner.CLUSTERS[cluster],
                                gpus)


def _path_layout(model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2]):
    """The route of the decision path (the planner's answers to its questions) and the layout its outcome names,
    or None where the outcome leaves the degrees to the search (TP + PP, TP, CP)."""
    from distlab import planner

    route, outcome = planner.decision_route(_case(model, cluster, gpus))
    fixed = _OUTCOME_LAYOUT.get(outcome)
    return route, outcome, (planner.Layout(dp=gpus, **fixed) if fixed is not None else None)


def _costs(layout, model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2]) -> dict:
    """The seconds a layout, at the settings the search gives it, spends on each cost a layout can pay beyond the
    model's own compute: recomputation, exposed communication, the pipeline's bubble."""
    from distlab import planner
    from distlab.planner.step_time import compute_rate, stage_flops

    spec, machine = planner.MODELS[model], planner.CLUSTERS[cluster]
    plan = planner.tune(spec, machine, layout, planner.Options(), gpus)
    options = replace(planner.Options(), activation_checkpointing=plan.settings["checkpointing"])
    flops = stage_flops(spec, layout, plan.worst_stage, options)
    # the rate the planner's step time uses: the GEMM shapes of the plan's own micro-batch
    rate = compute_rate(replace(spec, micro_batch=plan.settings["micro_batch"]), machine, layout, options)
    return {"recomputation": flops["recompute"] / rate,
            "communication": sum(plan.exposed_seconds.values()),
            "bubble": plan.bubble.get("seconds", 0.0)}


def _held_gib(model, cluster, nodes: int) -> float:
    """GiB per GPU that FSDP over ``nodes`` nodes needs for one sequence, every block recomputed (page 11.1's
    second question: ``planner.fsdp_one_sequence_bytes``)."""
    from distlab import planner

    return planner.fsdp_one_sequence_bytes(model, nodes * cluster.gpus_per_node)["total"] / planner.GIB


def _fewest_fsdp_nodes(model, cluster, max_nodes: int = 512) -> int | None:
    """Exercise 2's reference: the fewest nodes on which FSDP over every GPU holds one sequence beside its shards
    (page 11.1's second question asked of 1, 2, 3 ... nodes; the batch aside). """
    from distlab import planner

    return next((n for n in range(1, max_nodes + 1)
                 if planner.fsdp_one_sequence_bytes(model, n * cluster.gpus_per_node)["total"] <= cluster.gpu_bytes),
                None)
