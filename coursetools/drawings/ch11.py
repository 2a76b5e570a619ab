"""Chapter 11's pictures: the decision path as a flowchart, drawn from the planner's own tree of questions
(``planner.DECISION_QUESTIONS``): each question once, its yes and no, and the worked cases each outcome receives,
routed by the planner's answers (``planner.decision_route``)."""

from __future__ import annotations

import textwrap

# where each node of the tree sits (x, y) on a 10 x 6 canvas; the tree itself is the planner's
_PLACE = {"replica": (3.6, 5.35), "sequence": (3.6, 4.0), "batch": (1.9, 2.6), "long": (6.3, 2.6),
          "DDP": (8.3, 5.35), "FSDP": (1.0, 0.95), "TP + PP": (3.1, 0.95), "TP": (5.3, 0.95), "CP": (7.9, 0.95)}
_OUTCOME_WIDTH = 1.8   # the leaves under question 3 sit 0.3 apart
# what happens on the way down an edge (the "no" of the first question shards the state)
_ON_EDGE = {("replica", False): "no: shard the state (FSDP)"}


def draw_decision_flowchart(fig) -> None:
    from matplotlib.patches import FancyBboxPatch

    from coursetools.figures import RANK_COLOURS   # here, not at the top: coursetools.figures imports this module
    from distlab import planner

    questions, outcomes = planner.DECISION_QUESTIONS, planner.DECISION_OUTCOMES
    reached: dict[str, list[str]] = {}
    for case in planner.decision_cases():
        reached.setdefault(planner.decision_route(case)[1], []).append(case.name)
    ax = fig.subplots()
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.75, 6)
    ax.axis("off")

    def box(node, text, width, colour, face):
        x, y = _PLACE[node]
        lines = textwrap.wrap(text, 30 if width > 2.5 else 22)
        height = 0.22 + 0.2 * len(lines)
        ax.add_patch(FancyBboxPatch((x - width / 2, y - height / 2), width, height, boxstyle="round,pad=0.03",
                                    facecolor=face, edgecolor=colour))
        ax.text(x, y, "\n".join(lines), ha="center", va="center", fontsize=7.5)
        return height

    heights = {}
    for number, (node, (text, _, yes, no)) in enumerate(questions.items(), start=1):
        heights[node] = box(node, f"{number}. {text}", 3.2, RANK_COLOURS[0], "#eef3fb")
    for node, text in outcomes.items():
        heights[node] = box(node, text, _OUTCOME_WIDTH, RANK_COLOURS[1], "#fdf1e6")
        x, y = _PLACE[node]
        cases = [textwrap.fill(name, 28) for name in reached.get(node, [])]
        if cases:
            ax.text(x, y - heights[node] / 2 - 0.1, "\n".join(cases), ha="center", va="top", fontsize=5.5,
                    color="#555555")
    for node, (_, _, yes, no) in questions.items():
        x, y = _PLACE[node]
        for target, said in ((yes, True), (no, False)):
            tx, ty = _PLACE[target]
            start = (x + 1.6, y) if ty == y else (x, y - heights[node] / 2)
            end = (tx - _OUTCOME_WIDTH / 2 - 0.05, ty) if ty == y else (tx, ty + heights[target] / 2)
            ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": "#333333"})
            label = _ON_EDGE.get((node, said), "yes" if said else "no")
            ax.text((start[0] + end[0]) / 2 + 0.08, (start[1] + end[1]) / 2 + 0.05, label, fontsize=6.5,
                    color="#1a7f37" if said else "#b42318")
    ax.text(5, -0.7, "then the planner's search ranks every layout that fits (its first choice may add more than the "
                     "path names), and --dry-run builds it at full size", ha="center", fontsize=7, style="italic")


FIGURES = {"11_decision_flowchart.png": (draw_decision_flowchart, (10, 6))}
