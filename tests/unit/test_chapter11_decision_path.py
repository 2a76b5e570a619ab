"""Chapter 11's decision path (its flowchart, 11_decision_flowchart.png): each question asked once, and each worked
case routed by the planner's own answers to the outcome the planner's search confirms.

A question "asked twice" is one whose answer an earlier question already fixed: every case that reaches it gives
the same answer. The flowchart the chapter drew before asked "Does it fit on one GPU?" and then "Too big for a
replica per GPU?"; planted below, it is caught."""

from __future__ import annotations

from distlab import planner


def questions_asked_twice(questions, start, cases) -> list[str]:
    """The questions whose answer is the same for every case that reaches them, or that a path meets twice."""
    met: dict[str, set[bool]] = {}
    for case in cases:
        route, _ = planner.decision_route(case, questions, start)
        nodes = [node for node, _ in route]
        assert len(nodes) == len(set(nodes)), f"{case.name} meets a question twice: {nodes}"
        for node, answer in route:
            met.setdefault(node, set()).add(answer)
    return [node for node, answers in met.items() if len(answers) < 2] + [n for n in questions if n not in met]


def test_the_flowchart_asks_each_question_once():
    questions, cases = planner.DECISION_QUESTIONS, planner.decision_cases()
    assert len({text for text, *_ in questions.values()}) == len(questions)
    assert questions_asked_twice(questions, planner.DECISION_START, cases) == []
    # every question and every outcome is reached: the tree has no branch a case never takes
    outcomes = {planner.decision_route(case)[1] for case in cases}
    assert outcomes == set(planner.DECISION_OUTCOMES)


def test_the_old_flowchart_is_caught_asking_twice():
    fits = planner.DECISION_QUESTIONS["replica"][1]
    old = {"fits": ("Does it fit on one GPU?", fits, "DDP", "too_big"),
           "too_big": ("Too big for a replica per GPU?", lambda case: not fits(case), "FSDP", "wide")}
    wide = planner.DECISION_QUESTIONS["long"]
    old["wide"] = ("Layers too wide, activations too big?", wide[1], "TP", "PP")
    assert questions_asked_twice(old, "fits", planner.decision_cases()) == ["too_big", "wide"]


def test_each_case_lands_where_the_search_puts_it():
    """The outcome's dimensions (TP, PP, CP) are those of the search's first choice for the case; DDP's case is one
    where DDP is within 3 % of the best."""
    for case in planner.decision_cases():
        outcome = planner.decision_route(case)[1]
        plans = planner.search(case.model, case.cluster, case.gpus)
        first = plans[0].layout
        if outcome == "DDP":
            ddp = next(p for p in plans if p.layout == planner.Layout(dp=case.gpus, zero_stage=0))
            assert ddp.fits and ddp.mfu >= 0.97 * plans[0].mfu, case.name
            continue
        tp, pp, cp = planner.OUTCOME_DIMENSIONS[outcome]
        assert first.zero_stage > 0, case.name
        assert (first.pp > 1) == pp and (first.cp > 1) == cp, (case.name, first.label())
        assert tp is None or (first.tp > 1) == tp, (case.name, first.label())
