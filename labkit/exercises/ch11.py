"""Lab 11's exercise checks (choosing a strategy).

Exercise 1 follows chapter 11's decision path for 70B on 64 H100s, then looks past it: the layout the path gives
(:func:`check_path_layout`, the answer the planner's own tree of questions reaches), a layout within 90 % of the
search's best other than the search's first choice, which page 11.2 names (:func:`check_better_layout`), and what
the path's layout pays that the better one does not (:func:`check_what_it_pays`, the largest of its costs as the
planner counts them). Exercise 2: the fewest nodes on which FSDP over every GPU holds one sequence of 13B at 16K
tokens, and the GiB per GPU it needs there (:func:`check_fewest_nodes`).
tests/unit/test_exercises_ch11_more.py feeds each check the plausible wrong answers it must reject, and the answers
a learner following the chapter gives. A wrong answer's message points at the evidence (the planner's numbers to
print, the learner's own layout's share), never at the answer.

The checks' references live in :mod:`labkit.exercises._ch11_reference`, imported inside the checks, so the lab's
``exercises`` (this module) holds none of them. That hides the answers from a glance, not from a determined reader:
the planner's own calls give them, and the lab says so. Exercise 1's two choice answers can be guessed in a few tries.
"""

from __future__ import annotations

import math

from labkit.exercises.checks import (ExerciseIncomplete, ExerciseWrong, _not_done, _ok, check_true, check_value,
                                     learner_check)

__all__ = ["ExerciseIncomplete", "ExerciseWrong", "check_true", "check_value", "check_path_layout",
           "check_better_layout", "check_what_it_pays", "check_fewest_nodes", "nodes_case", "GIB_TOLERANCE"]

# Exercise 1's case: 70B, its 4K-token sequences and 1,024 sequences a step, on 64 H100-80GB (8 a node)
CASE = ("70b", "h100-80gb", 64)
# Exercise 2's case: 13B with 16K-token sequences on Derecho's A100-40GB nodes of 4 GPUs, FSDP over every GPU.
# Chapter 09 sizes 13B at 4K tokens, and the state alone (194 GiB over 160 GiB a node) gives one node too few: at 16K
# the activations decide (tests/unit/test_exercises_ch11_more.py)
NODES_CASE = ("13b", "a100-40gb", 16384)
# how close Exercise 2's GiB per GPU must come to the planner's sum of the same parts. Page 11.1's recipe lands within
# 0.01 GiB of it; each usual slip moves it further: the reserve (4 GiB), FSDP's buffers (3.9), the one block
# recomputed (3.2), GB for GiB (2.7), the fp32 log-softmax (2.0) or its 2 bytes for 4 (1.0), the head's three fp32
# s x h tensors (0.9), one gathered block (0.6) (tests/unit/test_exercises_ch11_more.py)
GIB_TOLERANCE = 0.5
# how a learner answers each of page 11.1's questions from the planner's numbers (the wrong answer's pointer)
_HOW_TO_ANSWER = ("1, does DDP's replica fit one GPU: planner.evaluate(model, cluster, planner.Layout(), "
                  "planner.Options(), 1).fits; 2, sharded by FSDP over all the GPUs, does one sequence fit, every "
                  "block recomputed: count it as page 11.1 counts 7B, or read planner.evaluate(model, cluster, "
                  "planner.Layout(dp=..., zero_stage=3), planner.Options(activation_checkpointing='full')).fits; 3, "
                  "does the batch hold a sequence for every GPU; 4, is a sequence 32K tokens or longer")
# what the path's outcome means for a layout of ``gpus`` GPUs, where the outcome fixes every degree
_OUTCOME_LAYOUT = {"DDP": dict(zero_stage=0), "FSDP": dict(zero_stage=3)}


@learner_check
def check_path_layout(layout, model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2], *,
                      hint: str = "") -> None:
    """``layout`` must be the one the decision path leads to; the confirmation says how it fares in the search."""
    from labkit.exercises import _ch11_reference as _reference
    from distlab import planner
    from labkit import planner_widgets

    if layout is None or layout is Ellipsis:
        raise _not_done("path_70b", hint)
    if not isinstance(layout, planner.Layout):
        raise ExerciseWrong(f"write the answer as planner.Layout(tp=..., pp=..., dp=..., zero_stage=...), not "
                            f"{type(layout).__name__}. {hint}".strip())
    route, outcome, expected = _reference._path_layout(model, cluster, gpus)
    if layout != expected:
        raise ExerciseWrong(f"{layout.label()} is not where the path leads. Answer page 11.1's questions in order "
                            f"from the planner's numbers ({_HOW_TO_ANSWER}), and follow the flowchart from each "
                            f"answer. {hint}".strip())
    said = " ".join(f"{planner.DECISION_QUESTIONS[q][0]} {'Yes' if a else 'No'}." for q, a in route)
    verdict = planner_widgets.layout_verdict(layout, model, cluster, gpus)
    _ok(f"path_70b: {said} So: {planner.DECISION_OUTCOMES[outcome]}. {verdict.message}")


@learner_check
def check_better_layout(layout, model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2], *,
                        within: float = 0.9, hint: str = "") -> None:
    """``layout`` fits, reaches ``within`` of the best throughput the search finds, and has degrees (tp, pp, dp, cp)
    other than the search's first choice, which page 11.2 names, and other than the path's layout, which the
    exercise compares it with: the learner searches, not copies. The path's layout is refused whatever its share:
    it sits just under the bar, and compared with itself the last question would have no answer."""
    from labkit.exercises import _ch11_reference as _reference
    from distlab import planner
    from labkit import planner_widgets

    if layout is None or layout is Ellipsis:
        raise _not_done("layout_70b", hint)
    verdict = planner_widgets.layout_verdict(layout, model, cluster, gpus, within=within)
    first = planner.search(planner.MODELS[model], planner.CLUSTERS[cluster], gpus)[0].layout
    degrees = ("tp", "pp", "dp", "cp")
    path = _reference._path_layout(model, cluster, gpus)[2]
    if path is not None and all(getattr(layout, d) == getattr(path, d) for d in degrees):
        raise ExerciseWrong(f"{layout.label()} has the degrees of the path's layout, path_70b, which the next question "
                            f"compares it with; find other degrees (tp, pp or dp) within {within:.0%}. "
                            f"{hint}".strip())
    if all(getattr(layout, d) == getattr(first, d) for d in degrees):
        raise ExerciseWrong(f"{layout.label()} has the degrees of the search's first choice, which page 11.2 names; "
                            f"find other degrees (tp, pp or dp) within {within:.0%}. {hint}".strip())
    if not verdict.ok:
        raise ExerciseWrong(f"{verdict.message}. {hint}".strip())
    _ok(f"layout_70b: {verdict.message}")


@learner_check
def check_what_it_pays(answer, path, better, model: str = CASE[0], cluster: str = CASE[1], gpus: int = CASE[2], *,
                       hint: str = "") -> None:
    """``answer`` names the cost ("recomputation", "communication" or "bubble") that the path's layout ``path``
    pays more of, in seconds a step, than ``better`` does: the largest difference, as the planner counts them."""
    from labkit.exercises import _ch11_reference as _reference
    if answer is None or answer is Ellipsis:
        raise _not_done("cost_70b", hint)
    if path is None or better is None:
        raise ExerciseIncomplete("answer path_70b and layout_70b first")
    paid, spent = _reference._costs(path, model, cluster, gpus), _reference._costs(better, model, cluster, gpus)
    extra = {name: paid[name] - spent[name] for name in paid}
    right = max(extra, key=extra.get)
    shown = ", ".join(f"{name} {paid[name]:.1f} s against {spent[name]:.1f} s" for name in paid)
    if str(answer).strip().lower() not in extra:
        raise ExerciseWrong(f"cost_70b is one of {', '.join(repr(n) for n in extra)}, not {answer!r}. "
                            f"{hint}".strip())
    if str(answer).strip().lower() != right:
        raise ExerciseWrong(f"cost_70b = {answer!r} is not what {path.label()} pays most beyond "
                            f"{better.label()}. Compare the two plans' settings (describe_settings()), their "
                            f"compute_seconds, exposed_seconds and bubbles. {hint}".strip())
    _ok(f"cost_70b: per step, {shown}. The largest is what {path.label()} pays beyond {better.label()}")


def nodes_case(model: str = NODES_CASE[0], seq_len: int = NODES_CASE[2]):
    """Exercise 2's model at ``seq_len`` tokens a sequence, the step's tokens kept (fewer, longer sequences)."""
    from distlab import planner
    from labkit import planner_widgets

    return planner_widgets.with_sequence_length(planner.MODELS[model], seq_len)


@learner_check
def check_fewest_nodes(nodes, gib, model: str = NODES_CASE[0], cluster: str = NODES_CASE[1],
                       seq_len: int = NODES_CASE[2], *, hint: str = "") -> None:
    """``nodes`` is the fewest nodes on which FSDP over every GPU holds one sequence, every block recomputed, and
    ``gib`` the GiB per GPU it needs on ``nodes`` nodes, within :data:`GIB_TOLERANCE` of the planner's sum of the
    same parts. The GiB is checked first, at the learner's own count, and its message is the same whether the count
    is right or not: a guessed count passes nothing without the sum that shows it. A count whose sum is right but
    which is not the fewest is never told the answer, nor, when it fits, whether it is too many (a few guesses would
    find a small count); one that does not fit is told that its own sum is over the GPU's memory. The confirmation
    adds the count before it and what the search finds with TP or CP."""
    from labkit.exercises import _ch11_reference as _reference
    from distlab import planner

    if nodes is None or nodes is Ellipsis:
        raise _not_done("nodes_13b", hint)
    if gib is None or gib is Ellipsis:
        raise _not_done("gib_13b", hint)
    if isinstance(nodes, bool) or not isinstance(nodes, (int, float)) or nodes != int(nodes):
        raise ExerciseWrong(f"nodes_13b is a whole number of nodes, not {nodes!r}. {hint}".strip())
    nodes, machine = int(nodes), planner.CLUSTERS[cluster]
    if nodes < 1:
        raise ExerciseWrong(f"nodes_13b counts nodes: at least 1, not {nodes}. {hint}".strip())
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0:
        raise ExerciseWrong(f"gib_13b is a number of GiB per GPU, not {gib!r}. {hint}".strip())
    spec = nodes_case(model, seq_len)
    gpu_gib = machine.gpu_bytes / planner.GIB
    held = _reference._held_gib(spec, machine, nodes)
    if abs(gib - held) > GIB_TOLERANCE:
        raise ExerciseWrong(f"gib_13b = {gib:g} GiB is not, within {GIB_TOLERANCE:g} GiB, what FSDP over {nodes} "
                            f"node(s) of {machine.gpus_per_node} GPUs needs per GPU at {seq_len:,} tokens. Add every "
                            f"part as page 11.1 does for 7B: the state's share, one sequence's activations, FSDP's "
                            f"buffers and the reserve, in GiB (2^30 bytes). {hint}".strip())
    fewest = _reference._fewest_fsdp_nodes(spec, machine)
    if nodes != fewest and held > gpu_gib:
        raise ExerciseWrong(f"on {nodes} node(s) your sum, {gib:g} GiB per GPU, is more than the GPU's "
                            f"{gpu_gib:.0f} GiB: one sequence does not fit there. {hint}".strip())
    if nodes != fewest:
        raise ExerciseWrong(f"nodes_13b = {nodes} is not the fewest nodes on which FSDP over every GPU holds a "
                            f"{seq_len:,}-token sequence. Add, per GPU, every part (the state's share, activations, "
                            f"FSDP's units, the reserve) for a node count and for the one before it. {hint}".strip())
    searched = planner.fewest_nodes(spec, machine)
    before = (f"; on {nodes - 1} node(s), {_reference._held_gib(spec, machine, nodes - 1):.1f} GiB, over the GPU's "
              f"{gpu_gib:.0f}" if nodes > 1 else "")
    _ok(f"nodes_13b = {nodes}, gib_13b = {gib:g}: FSDP over {nodes * machine.gpus_per_node} GPUs needs {held:.1f} GiB "
        f"per GPU of {gpu_gib:.0f}{before}. Free to add TP, SP or CP, the planner's search fits it on {searched} "
        f"node(s): they divide the activations, which FSDP does not")
