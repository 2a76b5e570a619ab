"""Lab 11's exercise checks (choosing a strategy).

Exercise 1 follows chapter 11's decision path for 70B on 64 H100s, then looks past it: the layout the path gives
(:func:`check_path_layout`, the answer the planner's own tree of questions reaches), a layout within 90 % of the
search's best (:func:`check_true` on the planner's verdict), and what the path's layout pays that the better one
does not (:func:`check_what_it_pays`, the largest of its costs as the planner counts them). Exercise 2: the fewest
nodes for a model (:func:`check_value`). tests/unit/test_exercises_ch11_more.py feeds each check the plausible
wrong answers it must reject, and the answers a learner following the chapter gives.
"""

from __future__ import annotations

from dataclasses import replace

from labkit.exercises.checks import (ExerciseIncomplete, ExerciseWrong, _not_done, _ok, check_true, check_value,
                                     learner_check)

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_true", "check_value", "check_path_layout",
           "check_what_it_pays", "path_layout", "costs"]

# Exercise 1's case: 70B, its 4K-token sequences and 1,024 sequences a step, on 64 H100-80GB (8 a node)
CASE = ("70b", "h100-80gb", 64)
# what the path's outcome means for a layout of ``gpus`` GPUs, where the outcome fixes every degree
_OUTCOME_LAYOUT = {"DDP": dict(zero_stage=0), "FSDP": dict(zero_stage=3)}


def _case(model: str, cluster: str, gpus: int):
    from distlab import planner

    return planner.DecisionCase(f"{model} on {gpus} {cluster}", planner.MODELS[model], planner.CLUSTERS[cluster],
                                gpus)


def path_layout(model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2]):
    """The route of the decision path (the planner's answers to its questions) and the layout its outcome names,
    or None where the outcome leaves the degrees to the search (TP + PP, TP, CP)."""
    from distlab import planner

    route, outcome = planner.decision_route(_case(model, cluster, gpus))
    fixed = _OUTCOME_LAYOUT.get(outcome)
    return route, outcome, (planner.Layout(dp=gpus, **fixed) if fixed is not None else None)


@learner_check
def check_path_layout(layout, model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2], *,
                      hint: str = "") -> None:
    """``layout`` must be the one the decision path leads to; the confirmation says how it fares in the search."""
    from distlab import planner
    from labkit import planner_widgets

    if layout is None or layout is Ellipsis:
        raise _not_done("path_70b", hint)
    if not isinstance(layout, planner.Layout):
        raise ExerciseWrong(f"write the answer as planner.Layout(tp=..., pp=..., dp=..., zero_stage=...), not "
                            f"{type(layout).__name__}. {hint}".strip())
    route, outcome, expected = path_layout(model, cluster, gpus)
    said = " ".join(f"{planner.DECISION_QUESTIONS[q][0]} {'Yes' if a else 'No'}." for q, a in route)
    if layout != expected:
        raise ExerciseWrong(f"{layout.label()} is not where the path leads. The planner answers its questions "
                            f"so: {said} Where do those answers lead on page 11.1's flowchart? {hint}".strip())
    verdict = planner_widgets.layout_verdict(layout, model, cluster, gpus)
    _ok(f"path_70b: {said} So: {planner.DECISION_OUTCOMES[outcome]}. {verdict.message}")


def costs(layout, model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2]) -> dict:
    """The seconds a layout, at the settings the search gives it, spends on each cost a layout can pay beyond the
    model's own compute: recomputation, exposed communication, the pipeline's bubble."""
    from distlab import planner
    from distlab.planner.step_time import compute_rate, stage_flops

    spec, machine = planner.MODELS[model], planner.CLUSTERS[cluster]
    plan = planner.tune(spec, machine, layout, planner.Options(), gpus)
    options = replace(planner.Options(), activation_checkpointing=plan.settings["checkpointing"])
    flops = stage_flops(spec, layout, plan.worst_stage, options)
    rate = compute_rate(spec, machine, layout, options)   # the rate the planner's step time uses (GEMM shapes)
    return {"recomputation": flops["recompute"] / rate,
            "communication": sum(plan.exposed_seconds.values()),
            "bubble": plan.bubble.get("seconds", 0.0)}


@learner_check
def check_what_it_pays(answer, path, better, model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2], *,
                       hint: str = "") -> None:
    """``answer`` names the cost ("recomputation", "communication" or "bubble") that the path's layout ``path``
    pays more of, in seconds a step, than ``better`` does: the largest difference, as the planner counts them."""
    if answer is None or answer is Ellipsis:
        raise _not_done("cost_70b", hint)
    if path is None or better is None:
        raise ExerciseIncomplete("answer path_70b and layout_70b first")
    paid, spent = costs(path, model, cluster, gpus), costs(better, model, cluster, gpus)
    extra = {name: paid[name] - spent[name] for name in paid}
    right = max(extra, key=extra.get)
    shown = ", ".join(f"{name} {paid[name]:.1f} s against {spent[name]:.1f} s" for name in paid)
    if str(answer).strip().lower() not in extra:
        raise ExerciseWrong(f"cost_70b is one of {', '.join(repr(n) for n in extra)}, not {answer!r}. "
                            f"{hint}".strip())
    if str(answer).strip().lower() != right:
        raise ExerciseWrong(f"cost_70b = {answer!r} is not what {path.label()} pays most beyond "
                            f"{better.label()}. Compare the two plans' settings (describe_settings()), their "
                            f"exposed_seconds and their bubbles. {hint}".strip())
    _ok(f"cost_70b: per step, {shown}. The largest is what {path.label()} pays beyond {better.label()}")
